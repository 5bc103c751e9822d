"""This checkout's bench.run_paged_decode on the cupyflash that PYTHONPATH finds (ab.py's way)."""
import importlib.util, json, os, sys
import cupyflash
print("tree", cupyflash.__file__, flush=True)
spec = importlib.util.spec_from_file_location("ab_bench", os.path.join(sys.argv[1], "cupyflash", "bench.py"))
bench = sys.modules["ab_bench"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
for b, length in bench.PAGED_DECODE_SHAPES:
    print(json.dumps(bench.run_paged_decode(bench.DecodeShape(b, length), (1, 2, 16, 256))), flush=True)
