"""The asv suite on the CPU: well-formed, safe to fork from (no CUDA library imported by its
modules), every entry read from its family's setup_cache (measurement stood in for), the
dashboard builds from the committed results, and the regression gate passes on them, judges
cupyflash on its ratio to the fixed reference of the same run and catches a planted regression."""

from __future__ import annotations

import collections
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "benchmarks_asv" / "asv.conf.json"
RESULTS = ROOT / "benchmarks_asv" / "results"
SUITE = ROOT / "benchmarks_asv" / "benchmarks"

pytest.importorskip("asv")


def _has_git_history() -> bool:
    run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return run.returncode == 0


# The dashboard and the gate read commits from git; a copy of the tree without its history (the
# GPU machine gets one) cannot run them.
needs_git = pytest.mark.skipif(not _has_git_history(), reason="no git history in this checkout")


def _has_branch(name: str) -> bool:
    run = subprocess.run(["git", "rev-parse", "--verify", "--quiet", name], cwd=ROOT, capture_output=True, text=True)
    return run.returncode == 0


# asv publish reads the commits of asv.conf.json's branch ("main"): a clone of another branch
# alone (git clone of a worktree) has none.
needs_main = pytest.mark.skipif(not _has_branch("main"), reason="no branch main in this clone (asv.conf.json's)")


def _asv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asv", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_suite_is_well_formed():
    run = _asv("check", "--config", str(CONF), "--python=same")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No problems found" in run.stdout


def test_benchmark_modules_import_no_cuda_library():
    """asv's forkserver forks every benchmark from the process that imported the suite: a CUDA
    library (or cupyflash, which imports CuPy) imported there would leave each child unusable."""
    code = (
        "import sys; from asv_runner.discovery import disc_benchmarks; "
        f"sys.path.insert(0, {str(SUITE.parent)!r}); list(disc_benchmarks({str(SUITE)!r})); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'cupy', 'torch', 'cupyflash', 'jax'}))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.fixture()
def suite(monkeypatch):
    """The suite's benchmarks (asv_runner's objects), with the GPU checks passed and
    cupyflash.bench's measurements and the fixed references stood in for by values that name
    their key, so a benchmark that reads the wrong entry shows."""
    from asv_runner.discovery import disc_benchmarks

    from cupyflash import bench

    monkeypatch.syspath_prepend(str(SUITE.parent))
    benchmarks = [b for b in disc_benchmarks(str(SUITE)) if not b.name.startswith("compile.")]
    for name, module in list(sys.modules.items()):
        for check in ("require_gpu", "require_torch"):
            if name.startswith("benchmarks.") and hasattr(module, check):
                monkeypatch.setattr(module, check, lambda: None)
    reference = sys.modules["benchmarks._reference"]
    monkeypatch.setattr(reference, "gemm_tflops", lambda *, size: 800.0)
    monkeypatch.setattr(reference, "copy_gbps", lambda *, mib: 4000.0)

    def prefill_value(backend, shape):
        return len(backend) + shape.head_dim + shape.seqlen / 1024 + shape.causal / 2 + shape.batch / 1e3

    def decode_row(shape):
        row = {}
        for backend in ("cupyflash", "splits1", "flash", "cudnn"):
            us = len(backend) + shape.batch + shape.seqlen / 1024
            row |= {f"{backend}_us": us, f"{backend}_TBps": 1 / us, f"{backend}_steady_us": us / 2,
                    f"{backend}_steady_TBps": 2 / us}  # fmt: skip
        return row

    def run_prefill(shape, backends, timings):
        assert timings == ("interleaved",)  # the suite runs one timing of the three (as fast as before them)
        return {b: prefill_value(b, shape) for b in backends}

    def run_training(shape, backends, dropout_p, timings):
        assert timings == ("interleaved",)
        return {b: prefill_value(b, shape) + 1000 * dropout_p for b in backends}

    monkeypatch.setattr(bench, "run_prefill", run_prefill)
    monkeypatch.setattr(bench, "run_training", run_training)
    monkeypatch.setattr(bench, "run_decode", decode_row)

    def tree_row(shape, drafts, timings):
        assert timings == ("interleaved",)
        us = {b: len(b) + shape.batch + shape.seqlen / 1024 + drafts for b in ("tree", "causal", "sdpa_mask")}
        return {"timings": {"interleaved": us}, **{f"{b}_interleaved_TBps": 1 / us[b] for b in us}}

    monkeypatch.setattr(bench, "run_tree_decode", tree_row)

    def mods_row(shape, name, functions, backward, timings):
        assert timings == ("interleaved",)
        ms = {b: len(b) + shape.head_dim / 64 + len(name) / 10 + backward for b in ("cupyflash_mods", "flex", "fa4")}
        if functions["builtin"] is not None:
            ms["cupyflash_builtin"] = 1.0 + backward
        return {"timings_ms": {"interleaved": ms}}

    monkeypatch.setattr(
        bench,
        "mods_gallery",
        lambda seqlen, heads: {
            n: {"builtin": None if n == "document" else {}} for n in ("causal", "document", "softcap", "alibi")
        },
    )
    monkeypatch.setattr(bench, "run_mods", mods_row)
    monkeypatch.setattr(bench, "host_overhead_us", lambda rounds, calls: {"cupyflash_torch_us": 20.0,
                        "cupyflash_cupy_us": 18.0, "sdpa_us": 15.0})  # fmt: skip
    return benchmarks


def _run_all(benchmarks) -> dict[str, dict[tuple, float | None]]:
    """Every benchmark at every parameter combination, as asv runs them: one setup_cache per
    cache key, handed to each benchmark that shares it; None where setup skips."""
    caches: dict[str, object] = {}
    values: dict[str, dict[tuple, float | None]] = {}
    for b in benchmarks:
        if b.setup_cache_key not in caches:
            caches[b.setup_cache_key] = b.do_setup_cache()
        b.set_cache(caches[b.setup_cache_key])
        values[b.name] = {}
        for index, combo in enumerate(itertools.product(*b._params) if b._params else [()]):
            if b._params:
                b.set_param_idx(index)
            values[b.name][combo] = None if b.do_setup() else b.do_run()
    return values


def test_every_entry_is_read_from_its_familys_setup_cache(suite):
    values = _run_all(suite)
    units = {b.name: b.unit for b in suite}
    for name, by_combo in values.items():
        measured = [v for v in by_combo.values() if v is not None]
        assert measured and all(isinstance(v, float) and v > 0 and math.isfinite(v) for v in measured), name
    families = {name.split(".")[0] for name in values} - {"host"}
    for family in families:  # each GPU family has its ratios and its reference's entry
        assert any(units[n] == "ratio" for n in values if n.startswith(f"{family}.")), family
    prefill = values["prefill.Prefill.track_tflops"]
    for combo, ratio in values["prefill.PrefillOverGemm.track_ratio"].items():
        assert ratio == pytest.approx(prefill[combo] / 800.0)
    assert values["prefill.PrefillGemm.track_gemm_tflops"] == {(): 800.0}
    assert values["decode.DecodeCopy.track_copy_gbps"] == {(): 4000.0}
    tree_gbps = values["tree_decode.TreeDecode.track_gbps"]
    for (backend, shape, drafts), ratio in values["tree_decode.TreeDecodeOverCopy.track_gbps_ratio"].items():
        assert ratio == pytest.approx(tree_gbps[backend, shape, drafts] / 4000.0)
    # the row of (B, L, drafts) = (8, 32768, 4), read from the entry its name gives
    assert values["tree_decode.TreeDecode.track_us"][("tree", "8x32768", 4)] == pytest.approx(4 + 8 + 32 + 4)
    gbps = values["decode.Decode.track_gbps"]
    for combo, ratio in values["decode.DecodeOverCopy.track_gbps_ratio"].items():
        assert (ratio is None) == (gbps[combo] is None)  # B * L beyond 2M tokens: skipped in both
        assert ratio is None or ratio == pytest.approx(gbps[combo] / 4000.0)
    # cupyflash over each peer of the same run; FlashAttention-4 a peer of every GPU family but dropout
    for family, cls in (("prefill", "Prefill.track_tflops"), ("training", "Training.track_fwd_bwd_tflops")):
        tflops = values[f"{family}.{cls}"]
        over_peers = values[f"{family}.{cls.split('.')[0]}OverPeers.track_ratio_to_peer"]
        assert {combo[0] for combo in over_peers} == {"cudnn", "fa4"}
        for (peer, *shape), ratio in over_peers.items():
            assert ratio == pytest.approx(tflops[("cupyflash", *shape)] / tflops[(peer, *shape)])
    mods = values["mods.Mods.track_tflops"]
    for (peer, *combo), ratio in values["mods.ModsOverPeers.track_ratio_to_peer"].items():
        assert ratio == pytest.approx(mods[("cupyflash", *combo)] / mods[(peer, *combo)])
    for (_, *combo), ratio in values["mods.ModsOverGemm.track_ratio"].items():
        assert ratio == pytest.approx(mods[("cupyflash", *combo)] / 800.0)
    assert mods["builtin", "document", 64, "fwd"] is None  # (no built-in document mask: n/a)
    # dense FLOPs over the row's milliseconds: alibi, d = 128, forward + backward
    ms = len("cupyflash_mods") + 2 + 0.5 + 1
    assert mods["cupyflash", "alibi", 128, "fwd_bwd"] == pytest.approx(3.5 * 4 * 4 * 16 * 4096**2 * 128 / ms / 1e9)
    baselines = values["baselines.Baselines.track_tflops"]
    for (peer, seqlen), ratio in values["baselines.BaselinesOverPeers.track_ratio_to_peer"].items():
        assert ratio == pytest.approx(baselines["cupyflash", seqlen] / baselines[peer, seqlen])
    assert "fa4" not in {combo[0] for combo in values["baselines.BaselinesOverGemm.track_ratio"]}
    assert "fa4" not in {combo[0] for combo in values["training.TrainingDropout.track_fwd_bwd_tflops"]}
    # Training and TrainingDropout each from their own setup_cache (dropout_p 0 and 0.1).
    plain, dropout = (
        values["training.Training.track_fwd_bwd_tflops"],
        values["training.TrainingDropout.track_fwd_bwd_tflops"],
    )
    for combo, value in dropout.items():
        assert value == pytest.approx(plain[combo] + 100.0)


def test_a_peer_that_did_not_run_reads_none(suite, monkeypatch):
    """FlashAttention-4 not installed (its entries None in every row, as bench.run_prefill marks
    them): its TFLOP/s and cupyflash's ratio to it read None (asv: n/a); cuDNN's are unchanged."""
    from cupyflash import bench

    for name in ("run_prefill", "run_training"):
        measured = getattr(bench, name)

        def without_fa4(*args, measured=measured, **kwargs):
            return {**measured(*args, **kwargs), "fa4": None, "fa4_error": bench.FA4_MISSING}

        monkeypatch.setattr(bench, name, without_fa4)
    values = _run_all(suite)
    for name in (
        "prefill.Prefill.track_tflops",
        "prefill.PrefillOverPeers.track_ratio_to_peer",
        "training.TrainingOverPeers.track_ratio_to_peer",
        "baselines.BaselinesOverPeers.track_ratio_to_peer",
    ):
        by_combo = values[name]
        assert all(value is None for combo, value in by_combo.items() if combo[0] == "fa4"), name
        assert all(value > 0 for combo, value in by_combo.items() if combo[0] != "fa4"), name  # fmt: skip


def test_a_familys_benchmarks_share_one_setup_cache(suite):
    keys = collections.defaultdict(set)
    for b in suite:
        keys[b.setup_cache_key].add(b.name.rsplit(".", 1)[0])
    by_class = {cls: key for key, classes in keys.items() for cls in classes}
    assert by_class["prefill.Prefill"] == by_class["prefill.PrefillOverGemm"] == by_class["prefill.PrefillGemm"]
    assert by_class["fa2_prefill.Fa2Prefill"] == by_class["prefill.Prefill"]  # a subset of its shapes
    assert by_class["decode.Decode"] == by_class["decode.DecodeOverCopy"] == by_class["decode.DecodeCopy"]
    assert by_class["training.TrainingDropout"] == by_class["training.TrainingDropoutOverGemm"]
    assert by_class["prefill.PrefillOverPeers"] == by_class["prefill.Prefill"]
    assert by_class["training.TrainingOverPeers"] == by_class["training.Training"]
    assert by_class["training.Training"] != by_class["training.TrainingDropout"]


@needs_git
@needs_main
def test_dashboard_builds_from_committed_results(tmp_path):
    if not (RESULTS / "benchmarks.json").exists():
        pytest.skip("no results committed yet")
    run = _asv("publish", "--config", str(CONF), "--html-dir", str(tmp_path / "html"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "html" / "index.html").exists()


def _gate(results: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "asv_gate.py"), "--results", str(results), *options],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip


@needs_git
def test_regression_gate_on_committed_results():
    if not (RESULTS / "benchmarks.json").exists():
        pytest.skip("no results committed yet")
    run = _gate(RESULTS)
    assert run.returncode == 0, run.stdout + run.stderr


def _commits() -> list[str]:
    commits = subprocess.run(
        ["git", "rev-list", "--first-parent", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if len(commits) < 2:
        pytest.skip("needs two commits")
    return commits


#: Benchmark name -> (unit, params): a prefill family as the suite reports it.
PREFILL = {
    "prefill.Prefill.track_tflops": ("TFLOP/s", [["'cupyflash'", "'flash'", "'cudnn'"], ["128"]]),
    "prefill.PrefillOverGemm.track_ratio": ("ratio", [["'cupyflash'"], ["128"]]),
    "prefill.PrefillGemm.track_gemm_tflops": ("TFLOP/s", []),
}


def _write_run(
    results: Path, machine: str, commit: str, runs: dict[str, tuple[list, list[float]]], version: str
) -> None:
    """asv's results file of one run: benchmark name -> (params, values)."""
    (results / machine).mkdir(parents=True, exist_ok=True)
    rows = {name: [values, params, version] for name, (params, values) in runs.items()}
    result = {"commit_hash": commit, "result_columns": ["result", "params", "version"], "results": rows}
    (results / machine / f"{commit[:8]}.json").write_text(json.dumps(result))


def _prefill_run(cupyflash: float, flash: float, cudnn: float, gemm: float) -> dict[str, list[float]]:
    """One run of the prefill family: TFLOP/s of each backend and of the GEMM, cupyflash's ratio."""
    return {
        "prefill.Prefill.track_tflops": [cupyflash, flash, cudnn],
        "prefill.PrefillOverGemm.track_ratio": [cupyflash / gemm],
        "prefill.PrefillGemm.track_gemm_tflops": [gemm],
    }


def _gate_runs(tmp_path: Path, benchmarks: dict, old: dict, new: dict, repeat: dict | None = None,
               repeat_version: str = "v1") -> subprocess.CompletedProcess:  # fmt: skip
    """The gate over two synthetic runs of the branch's two newest commits (old, then new) and,
    if given, a second run of the older commit under h200-repeat."""
    commits = _commits()
    results = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
    results.mkdir()
    (results / "benchmarks.json").write_text(
        json.dumps({name: {"unit": unit, "params": params} for name, (unit, params) in benchmarks.items()})
    )

    def write(machine: str, commit: str, values: dict[str, list[float]], version: str = "v1") -> None:
        _write_run(results, machine, commit, {n: (benchmarks[n][1], v) for n, v in values.items()}, version)

    write("h200", commits[1], old)
    write("h200", commits[0], new)
    if repeat is not None:
        write("h200-repeat", commits[1], repeat, repeat_version)
    return _gate(results)


@needs_git
def test_regression_gate_catches_a_slowdown(tmp_path):
    """An entry gated on its absolute value (the first-call compile time) 50% slower."""
    name = "compile.FirstCall.track_compile_seconds"
    run = _gate_runs(tmp_path, {name: ("s", [])}, {name: [1.0]}, {name: [1.5]})
    assert run.returncode == 1 and "REGRESSION" in run.stdout, run.stdout
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_reads_cupyflash_against_the_fixed_reference(tmp_path):
    """A slower host (the GEMM and every backend 20% down) is no regression; the fixed reference
    alone slower (cupyflash's ratio to it up) is none; cupyflash alone 20% down beside an
    unchanged GEMM is one, on its ratio; the peers' own drops and the absolute TFLOP/s are never
    gated."""
    before = _prefill_run(600.0, 330.0, 600.0, gemm=800.0)
    slower_host = _gate_runs(tmp_path, PREFILL, before, _prefill_run(480.0, 264.0, 480.0, gemm=640.0))
    assert slower_host.returncode == 0, slower_host.stdout
    assert "PrefillGemm.track_gemm_tflops(): 800 -> 640 TFLOP/s (-20.0%; context, not gated)" in slower_host.stdout
    slower_gemm = _gate_runs(tmp_path, PREFILL, before, _prefill_run(600.0, 330.0, 600.0, gemm=600.0))
    assert slower_gemm.returncode == 0, slower_gemm.stdout
    slower_peers = _gate_runs(tmp_path, PREFILL, before, _prefill_run(600.0, 200.0, 300.0, gemm=800.0))
    assert slower_peers.returncode == 0, slower_peers.stdout
    slower_code = _gate_runs(tmp_path, PREFILL, before, _prefill_run(480.0, 330.0, 600.0, gemm=800.0))
    assert slower_code.returncode == 1, slower_code.stdout
    flagged = [line for line in slower_code.stdout.splitlines() if line.endswith("REGRESSION")]
    assert len(flagged) == 1 and "PrefillOverGemm.track_ratio('cupyflash', 128): 0.75 -> 0.6 ratio" in flagged[0]
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_lists_cupyflash_over_a_peer_without_gating_it(tmp_path):
    """cupyflash's ratio to cuDNN and to FlashAttention-4 halved (a new peer release): listed,
    never gated -- the peer's code moved, not cupyflash's."""
    name = "prefill.PrefillOverPeers.track_ratio_to_peer"
    benchmarks = {name: ("ratio", [["'cudnn'", "'fa4'"], ["128"]])}
    run = _gate_runs(tmp_path, benchmarks, {name: [1.0, 0.9]}, {name: [0.5, 0.45]})
    assert run.returncode == 0, run.stdout
    assert f"{name}('fa4', 128): 0.9 -> 0.45 ratio (-50.0%; a peer, not gated)" in run.stdout, run.stdout
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_pairs_cover_a_commit_range(tmp_path):
    """Three measured commits, the middle one 50% slower and the newest back: the newest pair
    alone passes; --pairs 2 also compares the middle one with the oldest and flags it."""
    commits = _commits()
    if len(commits) < 3:
        pytest.skip("needs three commits")
    name = "compile.FirstCall.track_compile_seconds"
    results = tmp_path / "range"
    results.mkdir()
    (results / "benchmarks.json").write_text(json.dumps({name: {"unit": "s", "params": []}}))
    for commit, seconds in zip(commits[:3], (1.0, 1.5, 1.0)):  # newest first
        _write_run(results, "h200", commit, {name: ([], [seconds])}, "v1")
    assert _gate(results).returncode == 0
    run = _gate(results, "--pairs", "2")
    assert run.returncode == 1 and run.stdout.count("REGRESSION") == 1, run.stdout
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_threshold_comes_from_a_repeat_of_the_same_version(tmp_path):
    """An 8% drop of the ratio: within a threshold of 2 x a 5% repeat spread; beyond the 3% floor
    when there is no repeat, or only one of another benchmark version."""
    before = _prefill_run(600.0, 330.0, 600.0, gemm=800.0)
    repeat = _prefill_run(570.0, 330.0, 600.0, gemm=800.0)  # the same commit, ratio 5% lower
    after = _prefill_run(552.0, 330.0, 600.0, gemm=800.0)
    assert _gate_runs(tmp_path, PREFILL, before, after, repeat).returncode == 0
    assert _gate_runs(tmp_path, PREFILL, before, after).returncode == 1
    assert _gate_runs(tmp_path, PREFILL, before, after, repeat, repeat_version="v0").returncode == 1
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_spread_does_not_depend_on_the_order_of_the_two_runs(tmp_path):
    """A commit run twice gave 1.0 and 1.25: the threshold is 2 x 25% (relative to the smaller
    value) whichever run came first, so the next commit's 1.8 (44% over a first run of 1.25) and
    1.45 (45% over a first run of 1.0) both pass, and 1.9 (52%) fails."""
    name = "compile.FirstCall.track_compile_seconds"
    benchmarks = {name: ("s", [])}

    def gate(first: float, again: float, new: float) -> int:
        return _gate_runs(tmp_path, benchmarks, {name: [first]}, {name: [new]}, {name: [again]}).returncode

    assert gate(1.25, 1.0, 1.8) == 0
    assert gate(1.0, 1.25, 1.45) == 0
    assert gate(1.25, 1.0, 1.9) == 1
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_reads_the_host_time_against_sdpa_in_the_same_run(tmp_path):
    """The host time has no fixed reference: cupyflash's over SDPA's of the same process."""
    name = "host.HostOverhead.track_tiny_call"
    benchmarks = {name: ("us", [["'cupyflash_torch_us'", "'sdpa_us'"]])}
    slower_host = _gate_runs(tmp_path, benchmarks, {name: [20.0, 15.0]}, {name: [24.0, 18.0]})
    assert slower_host.returncode == 0, slower_host.stdout
    slower_code = _gate_runs(tmp_path, benchmarks, {name: [20.0, 15.0]}, {name: [24.0, 15.0]})
    assert slower_code.returncode == 1 and "REGRESSION" in slower_code.stdout, slower_code.stdout
    shutil.rmtree(tmp_path)
