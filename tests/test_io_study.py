"""The IO study's table code (scripts/io_study.py) on a recorded sample of its inputs: ncu's CSV
of a GPU run, the study's manifest and runtime JSON (tests/data/io_study_sample/)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "tests" / "data" / "io_study_sample"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("io_study", ROOT / "scripts" / "io_study.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def manifest():
    return json.loads((SAMPLE / "ncu_manifest.json").read_text())


def test_parse_ncu_csv(study):
    kernels = study.parse_ncu_csv((SAMPLE / "ncu.csv").read_text())
    assert kernels, "no kernel rows parsed"
    assert all({"kernel", "read", "write", "seconds"} <= set(k) for k in kernels)
    assert study.MARKER_KERNEL in kernels[0]["kernel"]
    assert all(k["read"] >= 0 and k["write"] >= 0 and k["seconds"] > 0 for k in kernels)


def test_parse_ncu_csv_details_page_and_units(study):
    """The details page (one row per metric) with scaled units parses to the same numbers."""
    text = "\n".join(
        [
            "==PROF== Connected to process 1",
            '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
            '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"',
            '"0","1","python3","h","kern","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics",'
            '"dram__bytes_read.sum","Mbyte","1,234.5"',
            '"0","1","python3","h","kern","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics",'
            '"dram__bytes_write.sum","Kbyte","2"',
            '"0","1","python3","h","kern","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics",'
            '"gpu__time_duration.sum","usecond","3.5"',
        ]
    )
    (kernel,) = study.parse_ncu_csv(text)
    assert kernel == {"kernel": "kern", "read": 1234.5e6, "write": 2e3, "seconds": pytest.approx(3.5e-6)}


def test_assign_kernels_to_points(study, manifest):
    kernels = study.parse_ncu_csv((SAMPLE / "ncu.csv").read_text())
    measured = study.assign_kernels(kernels, manifest)
    markers = sum(study.MARKER_KERNEL in k["kernel"] for k in kernels)
    assert len(measured) == markers <= len(manifest)
    by_id = {p["id"]: p for p in manifest}
    segments = []  # the kernels after each marker, counted here independently
    for kernel in kernels:
        if study.MARKER_KERNEL in kernel["kernel"]:
            segments.append([])
        else:
            segments[-1].append(kernel)
    for (point_id, got), segment in zip(measured.items(), segments):
        # naive: two GEMMs (cuBLAS may add kernels) and the softmax; the flash kernels: one
        assert len(got["kernels"]) == len(segment) >= (3 if by_id[point_id]["algorithm"] == "naive" else 1)
        assert got["read"] == pytest.approx(sum(k["read"] for k in segment))
        assert got["write"] == pytest.approx(sum(k["write"] for k in segment))
    with pytest.raises(ValueError, match="before the first marker"):
        study.assign_kernels([{"kernel": "gemm", "read": 1.0, "write": 1.0, "seconds": 1.0}], manifest)


def test_rows_tables_and_model(study, manifest, tmp_path):
    kernels = study.parse_ncu_csv((SAMPLE / "ncu.csv").read_text())
    measured = study.assign_kernels(kernels, manifest)
    runtime = json.loads((SAMPLE / "runtime.json").read_text())
    rows = study.build_rows(manifest, measured, runtime)
    assert len(rows) == len(manifest)
    gpt2 = {r["algorithm"]: r for r in rows if r["group"] == "gpt2"}
    # the model's GPT-2 forward: naive 9.13 GB, FA1 1.92 GB (B_r = 64, B_c = 448 on the H200)
    assert gpt2["naive"]["hbm_gb_model"] == pytest.approx(9.131, rel=1e-3)
    assert gpt2["fa1"]["block_c"] == 448 and gpt2["fa1"]["hbm_gb_model"] == pytest.approx(1.917, rel=1e-3)
    for row in rows:
        if row["hbm_gb_measured"] is not None:
            assert row["hbm_gb_measured"] > 0
        if row["ms"] is not None:
            assert row["tflops"] == pytest.approx(row["gflops_model"] / row["ms"])
    markdown = study.write_tables(rows, runtime, tmp_path)
    assert "| algorithm | N | d |" in markdown and "### gpt2" in markdown
    lines = (tmp_path / "io_study.csv").read_text().splitlines()
    assert len(lines) == len(rows) + 1 and lines[0].startswith("group,algorithm")


def test_markdown_formats_missing_values(study):
    table = study.markdown_table([{"a": None, "b": math.nan, "c": 1.23456, "d": 123456.7}], [(x, x) for x in "abcd"])
    assert table.splitlines()[-1] == "| n/a | n/a | 1.23 | 123457 |"
