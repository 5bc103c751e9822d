"""Dropout's cost: forward + backward with and without dropout_p = 0.1, each beside PyTorch
flash and cuDNN with the same dropout, one process, bf16, 16k tokens."""
import json
from cupyflash import bench
for d in (64, 128):
    for n in (1024, 4096, 16384):
        for causal in (False, True):
            shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
            for p in (0.0, 0.1):
                row = bench.run_training(shape, ("cupyflash", "flash", "cudnn"), dropout_p=p)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("_ms") and not k.endswith("_mib")}), flush=True)
