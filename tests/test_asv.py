"""The asv suite on the CPU: well-formed, the dashboard builds from the committed results, and
the regression gate passes on them (and catches a planted regression)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "benchmarks_asv" / "asv.conf.json"
RESULTS = ROOT / "benchmarks_asv" / "results"

pytest.importorskip("asv")


def _has_git_history() -> bool:
    run = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return run.returncode == 0


# The dashboard and the gate read commits from git; a copy of the tree without its history (the
# GPU machine gets one) cannot run them.
needs_git = pytest.mark.skipif(not _has_git_history(), reason="no git history in this checkout")


def _asv(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asv", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_suite_is_well_formed():
    run = _asv("check", "--config", str(CONF), "--python=same")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "No problems found" in run.stdout


@needs_git
def test_dashboard_builds_from_committed_results(tmp_path):
    if not (RESULTS / "benchmarks.json").exists():
        pytest.skip("no results committed yet")
    run = _asv("publish", "--config", str(CONF), "--html-dir", str(tmp_path / "html"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "html" / "index.html").exists()


def _gate(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "asv_gate.py"), "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip


@needs_git
def test_regression_gate_on_committed_results():
    if not (RESULTS / "benchmarks.json").exists():
        pytest.skip("no results committed yet")
    run = _gate(RESULTS)
    assert run.returncode == 0, run.stdout + run.stderr


@needs_git
def test_regression_gate_catches_a_slowdown(tmp_path):
    """Two fake commits of this branch: the newer one 20% slower on a TFLOP/s benchmark."""
    commits = subprocess.run(
        ["git", "rev-list", "--first-parent", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if len(commits) < 2:
        pytest.skip("needs two commits")
    machine = tmp_path / "h200"
    machine.mkdir()
    name = "fa2_prefill.Fa2Prefill.track_tflops"
    (tmp_path / "benchmarks.json").write_text(
        json.dumps({name: {"unit": "TFLOP/s", "params": [["'a'"]]}, "version": 2})
    )
    for commit, value in ((commits[1], 300.0), (commits[0], 240.0)):
        result = {
            "commit_hash": commit,
            "result_columns": ["result", "params"],
            "results": {name: [[value], [["'a'"]]]},
        }
        (machine / f"{commit[:8]}.json").write_text(json.dumps(result))
    run = _gate(tmp_path)
    assert run.returncode == 1 and "REGRESSION" in run.stdout, run.stdout
    shutil.rmtree(tmp_path)


@needs_git
def test_regression_gate_reads_cupyflash_against_the_reference_of_the_same_run(tmp_path):
    """A slower machine (cuDNN and cupyflash 20% down together) is no regression; cupyflash
    alone 20% down beside an unchanged cuDNN is; a peer's own drop is never one."""
    commits = subprocess.run(
        ["git", "rev-list", "--first-parent", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if len(commits) < 2:
        pytest.skip("needs two commits")
    name = "prefill.Prefill.track_tflops"
    params = [["'cupyflash'", "'flash'", "'cudnn'"], ["128"]]

    def gate(old: list[float], new: list[float]) -> subprocess.CompletedProcess:
        results = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        (results / "h200").mkdir(parents=True)
        (results / "benchmarks.json").write_text(json.dumps({name: {"unit": "TFLOP/s", "params": params}}))
        for commit, values in ((commits[1], old), (commits[0], new)):
            result = {
                "commit_hash": commit,
                "result_columns": ["result", "params", "version"],
                "results": {name: [values, params, "v1"]},
            }
            (results / "h200" / f"{commit[:8]}.json").write_text(json.dumps(result))
        return _gate(results)

    slower_machine = gate([600.0, 330.0, 600.0], [480.0, 264.0, 480.0])
    assert slower_machine.returncode == 0, slower_machine.stdout
    slower_flash = gate([600.0, 330.0, 600.0], [600.0, 200.0, 600.0])
    assert slower_flash.returncode == 0, slower_flash.stdout
    slower_code = gate([600.0, 330.0, 600.0], [480.0, 330.0, 600.0])
    assert slower_code.returncode == 1 and "REGRESSION" in slower_code.stdout, slower_code.stdout
    shutil.rmtree(tmp_path)
