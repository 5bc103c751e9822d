"""The scripts/ that run on the GPU machine, checked here without a GPU: they import (so a
renamed internal they use shows up in CI, not on the GPU machine), their command lines parse,
the sanitizer's workload runs on host arrays and its runner works with a stand-in sanitizer."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name",
    [
        *("tune", "ab", "sanitize", "sanitize_workload", "sass_evidence", "jax_jit_bench", "ncu_attention"),
        "bench_varlen_train",
    ],
)
def test_script_imports_and_its_help_runs(name):
    module = load(name)
    if hasattr(module, "main"):
        with pytest.raises(SystemExit) as done:
            module.main(["--help"])
        assert done.value.code == 0


def test_varlen_training_bench_shapes():
    """Packed batches of 16k tokens, each at both head dims, causal and not; the uniform ones
    (which get a padded twin) and the uneven mix."""
    module = load("bench_varlen_train")
    full, quick = module.shapes(False), module.shapes(True)
    assert {label for label, *_ in full} == {"16x1k", "4x4k", "mix"} and len(full) == 12 and len(quick) == 8
    assert all(sum(lengths) == 16384 for _, lengths, _, _ in full)
    assert len(set(next(lengths for label, lengths, *_ in full if label == "mix"))) > 1


def test_tune_mods_times_every_candidate_on_every_gallery_function(monkeypatch):
    """tune.py mods puts each candidate into FA3_MODS_FWD_TILES (bounded calls too) before it
    times the gallery's functions, and each candidate is a Hopper tile a function's call takes."""
    from cupyflash import _dispatch, bench

    tune = load("tune")
    names = ["softcap", "document"]
    monkeypatch.setattr(bench, "mods_gallery", lambda n, heads: {name: {} for name in [*names, "alibi"]})
    monkeypatch.setattr(_dispatch, "FA3_MODS_FWD_TILES", dict(_dispatch.FA3_MODS_FWD_TILES))
    seen = []

    def run_mods(shape, name, functions, backward):
        tile = _dispatch.FA3_MODS_FWD_TILES[shape.head_dim, False]
        assert _dispatch.FA3_MODS_FWD_TILES[shape.head_dim, True] == tile and not backward
        seen.append((shape.head_dim, shape.seqlen, repr(tile), name))
        return {"function": name}

    monkeypatch.setattr(bench, "run_mods", run_mods)
    rows = tune.tune_mods(tune.argparse.Namespace(head_dims=None, seqlens=[4096], functions=names, dtype="bfloat16"))
    want = [(d, 4096, repr(t), n) for d, tiles in tune.MODS_CANDIDATES.items() for t in tiles for n in names]
    assert seen == want and len(rows) == len(want) and all(r["spill_bytes"] == 0 for r in rows)
    for d, tiles in tune.MODS_CANDIDATES.items():
        for tile in tiles:
            _dispatch.FA3_MODS_FWD_TILES[d, False] = tile
            spec = _dispatch.fa3_fwd_spec("bfloat16", d, _dispatch.MaskFlags(False, False, False), 4096,
                                          mods_source="// f")  # fmt: skip
            assert spec is not None and spec.tile == tile


def test_schedule_model():
    """Uniform tiles balance under both schedules; a document mask's band of query blocks per CTA
    (the static stride over 128 query blocks a head) does not, the dynamic counter does."""
    model = load("schedule_model")
    assert model.busiest_over_even([1.0] * 264, 132) == (1.0, 1.0)
    work = model.document_tiles([12000, 2000, 1384, 1000], batch=1, heads=16)
    static, dynamic = model.busiest_over_even(work, 132)
    assert len(work) == 16 * 128 and static > 1.3 and dynamic < 1.1
    assert model.packed_tiles([300, 128], heads=1) == [3.0, 3.0, 3.0, 1.0, model.EMPTY_TILE, model.EMPTY_TILE]


def test_ncu_attention_summary_reads_a_report(monkeypatch, capsys):
    """ncu_attention.py --summary: one row per kernel from ncu's raw CSV (a header row, a units
    row), time in us, the named metrics (a missing one as -), the three largest stall ratios."""
    ncu = load("ncu_attention")
    names = ["Kernel Name", "gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"]  # fmt: skip
    table = [names, ["", "ns", "%", "", "", "", "", ""], ["cf_fa3_bwd_bf16_128", "1,234,500", "71.5", "0.5", "2.25",
             "0.75", "1.5", "9.0"], []]  # fmt: skip
    text = "\n".join(",".join(f'"{c}"' for c in row) for row in table)
    monkeypatch.setattr(ncu.subprocess, "run", lambda *a, **k: ncu.subprocess.CompletedProcess(a, 0, text, ""))
    ncu.main(["--summary", "report.ncu-rep"])
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| cf_fa3_bwd_bf16_128 | 1234.5 | 71.5 | - |")
    assert row.endswith("long_scoreboard_per_issue_active 2.25, math_pipe_throttle_per_issue_active 1.50, "
                        "wait_per_issue_active 0.75 |")  # fmt: skip
    # the unit is the report's: a long kernel's time in msecond (as 2.6, once read as 0.0 us)
    table[1][1], table[2][1] = "msecond", "2.61"
    text = "\n".join(",".join(f'"{c}"' for c in row) for row in table)
    ncu.main(["--summary", "report.ncu-rep"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| cf_fa3_bwd_bf16_128 | 2610.0 |")


def test_ab_measuring_code_is_python():
    ab = load("ab")
    ast.parse(ab.PREAMBLE + ab.MEASURE_HOST)
    ast.parse(ab.PREAMBLE + ab.MEASURE_PREFILL.format(dtypes=ab.DTYPES, harness="bench.py"))


def test_the_timed_host_code_uses_only_the_public_api():
    """ab.py host must measure an old export (whose private modules differ) alike."""
    ab = load("ab")
    assert not re.search(r"cupyflash\._|from cupyflash import _", ab.MEASURE_HOST)


def test_sanitize_workload_runs_on_host_arrays():
    workload = load("sanitize_workload")
    assert workload.run("numpy", "tiny") == len(workload.cases("tiny", hopper=True))
    labels = [label for label, _ in workload.cases("small", hopper=True)]
    for family in ("attention fa2", "attention fa3", "attention fa1", "attention naive", "varlen fa3", "kvcache",
                   "merge_states", "page=1 ", "page=16 ", "page=256 ", "splits=3", "new=4", "kvcache fp8 e4m3",
                   "kvcache fp8 e5m2"):  # fmt: skip
        assert any(family in label for label in labels), family
    with pytest.raises(SystemExit, match="no tiny case matches"):  # a sanitizer run over no call
        workload.run("numpy", "tiny", only="no such case")


FAKE_SANITIZER = """#!/usr/bin/env python3
# Stands in for compute-sanitizer: runs the program after the options, writes a report.
import subprocess, sys
args = sys.argv[1:]
options = {}
while args and args[0].startswith("--"):
    options[args[0]] = args[1]
    args = args[2:]
rc = subprocess.run(args).returncode
errors = 2 if options["--tool"] == "racecheck" else 0
with open(options["--log-file"], "w") as log:
    log.write(f"========= COMPUTE-SANITIZER\\n========= ERROR SUMMARY: {errors} errors\\n")
sys.exit(rc)
"""


def test_sanitize_runner_counts_each_tools_errors(tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    out = tmp_path / "logs"
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "sanitize.py"), "--out", str(out), "--lib", "numpy", "--only", "merge_states",
         "--sanitizer", str(fake)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # racecheck "found" 2
    lines = run.stdout.splitlines()
    assert lines == ["memcheck: 0 errors", "racecheck: 2 errors", "synccheck: 0 errors", "initcheck: 0 errors"]
    assert (out / "summary.txt").read_text().splitlines() == lines
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        assert (out / f"{tool}.log").is_file() and "merge_states" in (out / f"{tool}.out").read_text()


def test_sanitize_error_count():
    sanitize = load("sanitize")
    assert sanitize.error_count("========= ERROR SUMMARY: 0 errors\n") == 0
    assert sanitize.error_count("x\n========= ERROR SUMMARY: 1 error\n") == 1
    assert sanitize.error_count("the program crashed") is None


# racecheck's reports on the Hopper backward with the producer's rows (H100, 2026-12-07,
# scripts/pending_gpu/race_bwd.py; shortened): each bulk copy's write against the rows' reads.
RACECHECK_ON_THE_PRODUCER_ROWS = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at cf_fa3_bwd_bf16_64_causal_rowp+0x{w0:x}
=========     and Read access at cf_fa3_bwd_bf16_64_causal_rowp+0x1310 [640 hazards]
=========     and Read access at cf_fa3_bwd_bf16_64_causal_rowp+0x1320 [640 hazards]
=========
========= Error: Race reported between Write access at cf_fa3_bwd_bf16_64_causal_rowp+0x{w1:x}
=========     and Read access at cf_fa3_bwd_bf16_64_causal_rowp+0x2230 [640 hazards]
=========
========= Error: Race reported between Read access at cf_fa3_bwd_bf16_64_causal_rowp+0x2230
=========     and Write access at cf_fa3_bwd_bf16_64_causal_rowp+0x{w1:x} [12 hazards]
=========     and Write access at cf_fa3_bwd_bf16_64_causal_rowp+0x2240 [16 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (3 errors, 0 warnings)
"""


def test_racecheck_reports_whose_writes_are_bulk_copies_are_set_aside():
    """A report counts as racecheck's blind spot (bulk_copy_reports) only where every write in it
    is one of its kernel's bulk copies; the third report here also has a write at 0x2240 (a
    store), so it stays an error, as do reports on kernels it cannot build."""
    sanitize = load("sanitize")
    log = RACECHECK_ON_THE_PRODUCER_ROWS.format(w0=0x51E0, w1=0x5280)
    reports = sanitize.race_reports(log)
    assert [len(sites) for sites in reports] == [3, 2, 3]
    assert reports[2] == [("Read", "cf_fa3_bwd_bf16_64_causal_rowp", 0x2230),
                          ("Write", "cf_fa3_bwd_bf16_64_causal_rowp", 0x5280),
                          ("Write", "cf_fa3_bwd_bf16_64_causal_rowp", 0x2240)]  # fmt: skip
    assert sanitize.error_count(log) == 3
    assert sanitize.bulk_copy_reports(log, lambda kernel: {0x51E0, 0x5280}) == 2
    assert sanitize.bulk_copy_reports(log, lambda kernel: {0x51E0}) == 1
    assert sanitize.bulk_copy_reports(log, lambda kernel: None) == 0
    assert sanitize.CLEAN.search("racecheck: 0 errors (2 more: bulk copies ordered by an mbarrier, ...)")
    assert not sanitize.CLEAN.search("racecheck: 10 errors")


def test_a_backward_kernels_bulk_copies_are_found_in_its_sass():
    """hopper_bulk_copies reads the offsets of a kernel's two bulk copies (the producer's -LSE
    and D) off its sm_90a build, where racecheck reported them on the GPU (the same NVRTC builds
    the same SASS): none in the forward, None for a name the dispatcher has not."""
    sanitize = load("sanitize")
    if sanitize.find_nvdisasm() is None:
        pytest.skip("no nvdisasm (pip install nvidia-cuda-nvdisasm)")
    copies = sanitize.hopper_bulk_copies("cf_fa3_bwd_bf16_64_causal_rowp")
    assert copies is not None and len(copies) == 2
    from cupyflash import _dispatch

    forward = next(spec for spec in _dispatch.all_fa3_fwd_specs() if spec.dtype == "bfloat16")
    assert sanitize.hopper_bulk_copies(forward.name) == set()  # (its loads: TMA tiles, UTMALDG)
    assert sanitize.hopper_bulk_copies("no_such_kernel") is None
    w0, w1 = sorted(copies)
    assert sanitize.bulk_copy_reports(RACECHECK_ON_THE_PRODUCER_ROWS.format(w0=w0, w1=w1),
                                      sanitize.hopper_bulk_copies) == 2  # fmt: skip


def test_gpu_check_steps_are_all_defined():
    text = (SCRIPTS / "gpu_check.sh").read_text()
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], check=True)
    steps = re.search(r'^ALL_STEPS="([^"]+)"', text, re.M).group(1).split()
    default = re.search(r"STEPS:-([a-z ]+)\}", text).group(1).split()
    assert set(default) <= set(steps) and "sanitize" not in default and "ab" not in default
    for step in steps:
        assert re.search(rf"^step_{step}\(\) \{{", text, re.M), step
        assert re.search(rf"^#\s+{step}\s", text, re.M), f"{step} is missing from the usage"


def test_fp8_accuracy_emulation_without_casts_is_exact_attention():
    """The FP8 study's blockwise forward (the kernel's order of work) with no cast of P and
    unquantised inputs is attention: 300 rows and keys leave a partial tile and key block."""
    np = pytest.importorskip("numpy")
    fp8 = load("fp8_accuracy")
    q, k, v = fp8.make_inputs("gaussian", 300, 2, 64, seed=1)
    ref = fp8.reference(q, k, v, 0.125)
    out = fp8.blockwise(q, k, v, 0.125, cast_p=lambda p: p)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-6)
    # P scaled before its cast and divided out again: the same result
    scaled = fp8.blockwise(q, k, v, 0.125, cast_p=lambda p: p, p_scale=256.0)
    np.testing.assert_allclose(scaled, ref, rtol=1e-4, atol=1e-6)


def test_fp8_accuracy_quantisers():
    np = pytest.importorskip("numpy")
    fp8 = load("fp8_accuracy")
    h = fp8.hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two"):
        fp8.hadamard(96)
    cast = fp8.e4m3(np.array([1000.0, -1e9, 0.3, 448.0, np.nan, 2.0**-10]))
    assert cast[:4].tolist() == [448.0, -448.0, 0.3125, 448.0]  # saturated, nearest, exact
    assert np.isnan(cast[4]) and cast[5] == 0.0  # NaN stays; half the smallest subnormal rounds to 0
    x = fp8.make_inputs("channels", 64, 4, 64, seed=2)[2]
    for granularity in ("tensor", "head"):
        x8, descale = fp8.quantise(x, granularity)
        assert descale.shape == (1, 1, 4, 1)
        amax = np.max(np.abs(x8), axis=(0, 1, 3))
        assert amax.max() == 448.0 and (granularity == "tensor" or (amax == 448.0).all())
        np.testing.assert_allclose(x8 * descale, x, rtol=2.0**-4, atol=float(descale.max()) * 2.0**-9)


def test_fp8_accuracy_measures_every_method():
    fp8 = load("fp8_accuracy")
    result = fp8.measure("sparse", 256, 2, 64)
    rmse = result["rmse"]
    assert set(rmse) == set(fp8.methods(64)) and all(0 < e < result["ref_rms"] for e in rmse.values())
    assert rmse["bf16"] < min(e for name, e in rmse.items() if name != "bf16")
    # sparse outliers: the Hadamard rotation of Q and K lowers the error of the plain per-tensor cast
    assert rmse["fp8 tensor hadamard P*1"] < rmse["fp8 tensor P*1"]
