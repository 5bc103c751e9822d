"""The IO study: HBM bytes, FLOPs, runtime and peak memory of naive, FA1 and FA2 on the GPU,
beside cupyflash.io_model's predictions (docs/io_analysis.md).

Steps (`scripts/gpu_check.sh LOG_DIR io` runs the first two on the H200, ncu around the second):
  runtime     CUDA-event runtimes of every study point, peak memory, naive's out-of-memory N,
              FA2 at N = 1,048,576                                   -> runtime.json
  ncu-target  every study point once between cudaProfilerStart/Stop, each preceded by a marker
              kernel, for `ncu --profile-from-start off` (Nsight Compute's DRAM counters)
                                                                     -> ncu_manifest.json
  report      ncu's CSV + the manifest + runtime.json + the model -> CSV tables, markdown, PNGs
              (runs anywhere; matplotlib for the plots)

Every point uses float16 bhsd-contiguous CuPy arrays of fresh random data, non-causal.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cupyflash import io_model  # noqa: E402
from cupyflash._dispatch import FA1_STUDY_BLOCK_C, fa1_tiles, fa2_fwd_tiles  # noqa: E402

H200_SMEM_PER_BLOCK = 227 * 1024  # the model's M when the study did not record the device's
MARKER_KERNEL = "cf_io_study_marker"
GPT2 = {"batch": 64, "heads": 16, "seqlen": 1024, "head_dim": 64}  # the paper's GPT-2 medium
SWEEP_HEAD_DIMS = (64, 128, 256, 512)
SWEEP_SEQLENS = (512, 1024, 2048, 4096, 8192)
SWEEP_PAIRS = {"batch": 8, "heads": 16}  # 128 (batch, head) CTAs for FA1: about one per SM
MEMORY_HEAD_DIM = 128
NAIVE_OOM_SEQLENS = (65536, 131072, 163840, 180224, 196608, 262144)
FA2_LONG_SEQLEN = 1_048_576


# ---------------------------------------------------------------------------------------------
# The study points.
# ---------------------------------------------------------------------------------------------
def study_points(groups: str | None = None) -> list[dict[str, Any]]:
    """Every (group, algorithm, shape, tiles) point the ncu and runtime passes measure."""
    points: list[dict[str, Any]] = []

    def add(group: str, algorithm: str, batch: int, heads: int, seqlen: int, head_dim: int, **tiles: int) -> None:
        points.append(
            {"group": group, "algorithm": algorithm, "batch": batch, "heads": heads, "seqlen": seqlen,
             "head_dim": head_dim, **tiles}
        )  # fmt: skip

    for algorithm in ("naive", "fa1", "fa2"):
        add("gpt2", algorithm, **GPT2)
    for block_c in FA1_STUDY_BLOCK_C:
        add("tiles", "fa1", **GPT2, block_r=min(block_c, GPT2["head_dim"]), block_c=block_c)
    for head_dim in SWEEP_HEAD_DIMS:
        for algorithm in ("naive", "fa1", "fa2"):
            if algorithm != "fa2" or head_dim <= 256:
                add("head_dim", algorithm, **SWEEP_PAIRS, seqlen=2048, head_dim=head_dim)
    for seqlen in SWEEP_SEQLENS:
        for algorithm in ("naive", "fa1", "fa2"):
            add("seqlen", algorithm, **SWEEP_PAIRS, seqlen=seqlen, head_dim=64)
    for i, point in enumerate(points):
        point["id"] = i
    if groups:
        chosen = groups.split(",")
        points = [p for p in points if p["group"] in chosen]
    return points


def point_label(point: dict[str, Any]) -> str:
    tiles = f" B_r={point['block_r']} B_c={point['block_c']}" if "block_c" in point else ""
    return (
        f"{point['group']}/{point['algorithm']} B={point['batch']} H={point['heads']} N={point['seqlen']} "
        f"d={point['head_dim']}{tiles}"
    )


# ---------------------------------------------------------------------------------------------
# The model's predictions for a point.
# ---------------------------------------------------------------------------------------------
def shape_of(point: dict[str, Any]) -> io_model.AttentionShape:
    n = point["seqlen"]
    return io_model.AttentionShape(point["batch"], point["heads"], n, n, point["head_dim"])


def model_costs(point: dict[str, Any], max_smem: int = H200_SMEM_PER_BLOCK) -> dict[str, io_model.Cost]:
    """{"model": cost} (FA2 also "model_l2": K/V once per head) for the point's algorithm."""
    shape = shape_of(point)
    if point["algorithm"] == "naive":
        return {"model": io_model.naive_cost(shape)}
    if point["algorithm"] == "fa1":
        block_r, block_c = point.get("block_r"), point.get("block_c")
        if block_c is None:
            block_r, block_c = fa1_tiles(point["head_dim"], shape.element_bytes, max_smem)
        return {"model": io_model.fa1_cost(shape, block_r, block_c)}
    tile = fa2_fwd_tiles(point["head_dim"], narrow=False)[0]
    return {
        "model": io_model.fa2_cost(shape, tile.block_m, tile.block_n, kv_reuse="per_block"),
        "model_l2": io_model.fa2_cost(shape, tile.block_m, tile.block_n, kv_reuse="l2"),
    }


# ---------------------------------------------------------------------------------------------
# Running a point on the GPU.
# ---------------------------------------------------------------------------------------------
def make_inputs(point: dict[str, Any], seed: int) -> tuple[Any, Any, Any]:
    import cupy

    rng = cupy.random.default_rng(seed)
    dims = (point["batch"], point["heads"], point["seqlen"], point["head_dim"])
    return tuple(rng.standard_normal(dims, dtype=cupy.float32).astype(cupy.float16) for _ in range(3))  # type: ignore[return-value]


def attention_call(point: dict[str, Any], q: Any, k: Any, v: Any, causal: bool = False) -> Callable[[], Any]:
    import cupyflash
    from cupyflash import _baselines_gpu, _interop
    from cupyflash._validate import attention_problem

    if "block_c" not in point:
        return lambda: cupyflash.attention(q, k, v, layout="bhsd", causal=causal, algorithm=point["algorithm"])
    problem = attention_problem(
        q.shape, k.shape, v.shape, causal=causal, scale=None, window=(-1, -1), softcap=0.0, layout="bhsd"
    )
    return lambda: _baselines_gpu.gpu_attention(
        _interop.CUPY, q, k, v, q.device.id, problem, "fa1", block_r=point["block_r"], block_c=point["block_c"]
    )


def cuda_event_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds between CUDA events of ``repeat`` calls, after one warm-up call."""
    import cupy

    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(statistics.median(times))


def _free_pool() -> None:
    import cupy

    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


class PeakMemory:
    """Peak bytes held through CuPy's memory pool while active (a CuPy memory hook)."""

    def __init__(self) -> None:
        from cupy.cuda import memory_hook

        outer = self

        class _Hook(memory_hook.MemoryHook):  # type: ignore[misc]
            name = "cupyflash_peak"

            def malloc_postprocess(self, **kw: Any) -> None:
                outer.current += kw["mem_size"] if kw.get("mem_ptr") else 0
                outer.peak = max(outer.peak, outer.current)

            def free_postprocess(self, **kw: Any) -> None:
                outer.current -= kw["mem_size"]

        self.hook = _Hook()
        self.current = 0
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        self.hook.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hook.__exit__(*exc)


def measure_peak(point: dict[str, Any], causal: bool) -> tuple[int | None, float | None, str | None]:
    """(peak bytes, ms, error) of one call with inputs allocated inside the measurement; an
    out-of-memory error is caught and reported."""
    _free_pool()
    try:
        with PeakMemory() as peak:
            q, k, v = make_inputs(point, seed=1)
            call = attention_call(point, q, k, v, causal=causal)
            ms = cuda_event_ms(call, repeat=2)
            del q, k, v, call
        return peak.peak, ms, None
    except Exception as error:  # out of memory: CuPy's OutOfMemoryError, or cuBLAS's workspace
        return None, None, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    finally:
        _free_pool()


def run_runtime(out: Path, log: Callable[[str], None], groups: str | None = None) -> dict[str, Any]:
    import cupy

    device = cupy.cuda.Device()
    free, total = cupy.cuda.runtime.memGetInfo()
    result: dict[str, Any] = {
        "device": cupy.cuda.runtime.getDeviceProperties(device.id)["name"].decode(),
        "max_smem_per_block": device.attributes["MaxSharedMemoryPerBlockOptin"],
        "memory_free": free,
        "memory_total": total,
        "points": [],
    }
    for point in study_points(groups):
        q, k, v = make_inputs(point, seed=point["id"])
        repeat = 3 if point["seqlen"] * point["batch"] >= 65536 or point["algorithm"] == "fa1" else 10
        ms = cuda_event_ms(attention_call(point, q, k, v), repeat)
        result["points"].append({"id": point["id"], "ms": ms})
        (out / "runtime.json").write_text(json.dumps(result, indent=1))  # a timeout keeps it
        log(f"runtime {point_label(point)}: {ms:.3f} ms")
        del q, k, v
        _free_pool()

    memory: list[dict[str, Any]] = []
    if groups and "memory" not in groups.split(","):
        return result
    base = {"batch": 1, "heads": 1, "head_dim": MEMORY_HEAD_DIM}
    for seqlen in (4096, 16384, 65536):
        for algorithm in ("naive", "fa2"):
            memory.append({"algorithm": algorithm, "seqlen": seqlen, "causal": False, **base})
    for seqlen in NAIVE_OOM_SEQLENS:
        memory.append({"algorithm": "naive", "seqlen": seqlen, "causal": False, **base})
    for seqlen in (131072, 262144, FA2_LONG_SEQLEN):
        memory.append({"algorithm": "fa2", "seqlen": seqlen, "causal": True, **base})
    for entry in memory:
        peak, ms, error = measure_peak(entry, entry["causal"])
        entry.update(peak_bytes=peak, ms=ms, error=error)
        label = f"memory {entry['algorithm']} N={entry['seqlen']} causal={entry['causal']}"
        log(f"{label}: peak={peak} ms={ms} {error or ''}")
        result["memory"] = [m for m in memory if "peak_bytes" in m]
        (out / "runtime.json").write_text(json.dumps(result, indent=1))
    (out / "runtime.json").write_text(json.dumps(result, indent=1))
    return result


def run_ncu_target(out: Path, log: Callable[[str], None], groups: str | None = None) -> None:
    """Each point: warm up (compile, cuBLAS heuristics) outside the profiled range, then a
    marker kernel and one call inside it. ncu's rows between two markers are the point's."""
    import cupy

    marker = cupy.RawKernel(f'extern "C" __global__ void {MARKER_KERNEL}(int* x) {{ x[0] += 1; }}', MARKER_KERNEL)
    flag = cupy.zeros(1, dtype=cupy.int32)
    manifest = []
    for point in study_points(groups):
        q, k, v = make_inputs(point, seed=point["id"])
        call = attention_call(point, q, k, v)
        call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.start()
        marker((1,), (1,), (flag,))
        call()
        cupy.cuda.Device().synchronize()
        cupy.cuda.profiler.stop()
        manifest.append(point)
        (out / "ncu_manifest.json").write_text(json.dumps(manifest, indent=1))  # a timeout keeps it
        log(f"ncu-target {point_label(point)}")
        del q, k, v, call
        _free_pool()
    (out / "ncu_manifest.json").write_text(json.dumps(manifest, indent=1))


# ---------------------------------------------------------------------------------------------
# ncu's CSV.
# ---------------------------------------------------------------------------------------------
_UNIT_SCALE = {
    "byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
    "ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0, "second": 1.0,
}  # fmt: skip
METRICS = {"dram__bytes_read.sum": "read", "dram__bytes_write.sum": "write", "gpu__time_duration.sum": "seconds"}


def _number(text: str, unit: str) -> float:
    value = float(text.replace(",", "").strip() or "nan")
    return value * _UNIT_SCALE.get(unit.strip().lower(), 1.0)


def parse_ncu_csv(text: str) -> list[dict[str, Any]]:
    """Kernels in launch order with their DRAM bytes read/written and duration (seconds), from
    ``ncu --csv`` output in either the raw page (one row per kernel, a units row) or the
    details page (one row per kernel and metric). Lines that are not CSV (``==PROF==``) skip."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows:
        return []
    header = rows[0]
    kernels: dict[str, dict[str, Any]] = {}
    if "Metric Name" in header:
        col = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
        for row in rows[1:]:
            metric = METRICS.get(row[col["Metric Name"]])
            if metric is None:
                continue
            entry = kernels.setdefault(row[col["ID"]], {"kernel": row[col["Kernel Name"]]})
            entry[metric] = _number(row[col["Metric Value"]], row[col["Metric Unit"]])
    else:
        id_col, name_col = header.index("ID"), header.index("Kernel Name")
        units = rows[1] if len(rows) > 1 and not rows[1][id_col].strip().isdigit() else [""] * len(header)
        for row in rows[1:]:
            if not row[id_col].strip().isdigit():
                continue
            entry = kernels.setdefault(row[id_col], {"kernel": row[name_col]})
            for metric, key in METRICS.items():
                if metric in header:
                    entry[key] = _number(row[header.index(metric)], units[header.index(metric)])
    return [kernels[key] for key in sorted(kernels, key=int)]


def assign_kernels(kernels: list[dict[str, Any]], manifest: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Sum the kernels after each marker into that point: {point id: read, write, seconds, kernels}."""
    measured: dict[int, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    points = iter(manifest)
    for kernel in kernels:
        if MARKER_KERNEL in kernel["kernel"]:
            point = next(points, None)
            if point is None:
                raise ValueError("ncu's CSV has more marker kernels than the manifest has points")
            current = measured[point["id"]] = {"read": 0.0, "write": 0.0, "seconds": 0.0, "kernels": []}
            continue
        if current is None:
            raise ValueError(f"kernel {kernel['kernel']!r} before the first marker")
        for key in ("read", "write", "seconds"):
            current[key] += kernel.get(key, math.nan)
        current["kernels"].append(kernel["kernel"][:80])
    return measured


# ---------------------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------------------
def build_rows(
    manifest: list[dict[str, Any]], measured: dict[int, dict[str, Any]], runtime: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """One row per point: shape, tiles, measured bytes/time, the model's FLOPs and bytes."""
    runtimes = {p["id"]: p["ms"] for p in (runtime or {}).get("points", [])}
    max_smem = (runtime or {}).get("max_smem_per_block", H200_SMEM_PER_BLOCK)
    rows = []
    for point in manifest:
        costs = model_costs(point, max_smem)
        model = costs["model"]
        got = measured.get(point["id"], {})
        block_r, block_c = point.get("block_r"), point.get("block_c")
        if point["algorithm"] == "fa1" and block_c is None:
            block_r, block_c = fa1_tiles(point["head_dim"], 2, max_smem)
        row = {
            "group": point["group"], "algorithm": point["algorithm"], "batch": point["batch"],
            "heads": point["heads"], "seqlen": point["seqlen"], "head_dim": point["head_dim"],
            "block_r": block_r, "block_c": block_c,
            "gflops_model": model.flops / 1e9,
            "hbm_gb_measured": (got["read"] + got["write"]) / 1e9 if got else None,
            "read_gb_measured": got["read"] / 1e9 if got else None,
            "write_gb_measured": got["write"] / 1e9 if got else None,
            "hbm_gb_model": model.hbm_bytes / 1e9,
            "hbm_gb_model_l2": costs["model_l2"].hbm_bytes / 1e9 if "model_l2" in costs else None,
            "ms": runtimes.get(point["id"]),
            "ms_ncu": got["seconds"] * 1e3 if got else None,
            "kernels": len(got.get("kernels", [])) if got else None,
        }  # fmt: skip
        row["tflops"] = model.flops / (row["ms"] * 1e9) if row["ms"] else None
        rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: Iterable[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``columns`` = [(key, heading)]."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


TABLE_COLUMNS = [
    ("algorithm", "algorithm"), ("seqlen", "N"), ("head_dim", "d"), ("block_r", "B_r"), ("block_c", "B_c"),
    ("gflops_model", "GFLOPs (model)"), ("hbm_gb_measured", "HBM GB (ncu)"), ("hbm_gb_model", "HBM GB (model)"),
    ("hbm_gb_model_l2", "HBM GB (model, K/V once)"), ("ms", "ms (CUDA events)"), ("tflops", "TFLOP/s"),
]  # fmt: skip


def write_tables(rows: list[dict[str, Any]], runtime: dict[str, Any] | None, out: Path) -> str:
    """study.csv with every row, and the markdown of each group's table (returned)."""
    with open(out / "io_study.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    parts = []
    for group in ("gpt2", "tiles", "head_dim", "seqlen"):
        chosen = [r for r in rows if r["group"] == group]
        if chosen:
            parts.append(f"### {group}\n\n{markdown_table(chosen, TABLE_COLUMNS)}\n")
    if runtime and runtime.get("memory"):
        memory_columns = [("algorithm", "algorithm"), ("seqlen", "N"), ("causal", "causal"),
                          ("peak_gb", "peak GB (measured)"), ("peak_gb_model", "peak GB (model)"),
                          ("ms", "ms"), ("error", "error")]  # fmt: skip
        memory_rows = []
        for entry in runtime["memory"]:
            shape = io_model.AttentionShape(1, 1, entry["seqlen"], entry["seqlen"], entry["head_dim"], entry["causal"])
            cost = io_model.naive_cost(shape) if entry["algorithm"] == "naive" else io_model.fa2_cost(shape, 128, 128)
            memory_rows.append({**entry, "peak_gb": entry["peak_bytes"] / 1e9 if entry["peak_bytes"] else None,
                                "peak_gb_model": cost.peak_memory / 1e9})  # fmt: skip
        parts.append(f"### memory (one head, d = {MEMORY_HEAD_DIM})\n\n{markdown_table(memory_rows, memory_columns)}\n")
    return "\n".join(parts)


def plot(rows: list[dict[str, Any]], runtime: dict[str, Any] | None, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    colors = {"naive": "tab:red", "fa1": "tab:blue", "fa2": "tab:green"}

    tiles = sorted((r for r in rows if r["group"] == "tiles"), key=lambda r: r["block_c"])
    if tiles:
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["block_c"] for r in tiles]
        ax.plot(x, _values(tiles, "hbm_gb_measured"), "o-", color="tab:blue", label="HBM GB (ncu)")
        ax.plot(x, _values(tiles, "hbm_gb_model"), "--", color="tab:blue", alpha=0.6, label="HBM GB (model)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("FA1 block size B_c (B_r = min(B_c, 64))")
        ax.set_ylabel("HBM bytes read + written (GB)")
        ax2 = ax.twinx()
        ax2.plot(x, _values(tiles, "ms"), "s-", color="tab:orange", label="runtime (ms)")
        ax2.set_ylabel("runtime (ms)")
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper right", fontsize=8)
        ax.set_title("FA1 forward vs tile size, B=64 H=16 N=1024 d=64, H200", fontsize=10)
        files.append(_save(fig, out / "io_fa1_block_size.png"))

    for group, key, label in (("head_dim", "head_dim", "head dim d"), ("seqlen", "seqlen", "sequence length N")):
        chosen = [r for r in rows if r["group"] == group]
        if not chosen:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for algorithm, color in colors.items():
            series = sorted((r for r in chosen if r["algorithm"] == algorithm), key=lambda r: r[key])
            if not series:
                continue
            x = [r[key] for r in series]
            ax.plot(x, _values(series, "hbm_gb_measured"), "o-", color=color, label=f"{algorithm} (ncu)")
            ax.plot(x, _values(series, "hbm_gb_model"), "--", color=color, alpha=0.6, label=f"{algorithm} (model)")
            if algorithm == "fa2":
                ax.plot(x, _values(series, "hbm_gb_model_l2"), ":", color=color, alpha=0.6,
                        label="fa2 (model, K/V once)")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("HBM bytes read + written (GB)")
        ax.set_title(f"HBM traffic vs {label} (B=8, H=16, fp16), H200")
        ax.legend(fontsize=7)
        files.append(_save(fig, out / f"io_hbm_vs_{key}.png"))

    if runtime and runtime.get("memory"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for algorithm, color in (("naive", "tab:red"), ("fa2", "tab:green")):
            ok = sorted((m for m in runtime["memory"] if m["algorithm"] == algorithm and m["peak_bytes"]),
                        key=lambda m: m["seqlen"])  # fmt: skip
            ax.plot([m["seqlen"] for m in ok], [m["peak_bytes"] / 1e9 for m in ok], "o-", color=color, label=algorithm)
            oom = [m["seqlen"] for m in runtime["memory"] if m["algorithm"] == algorithm and m["error"]]
            if oom:
                ax.axvline(min(oom), color=color, ls=":", label=f"{algorithm}: out of memory at N={min(oom)}")
        ax.axhline(runtime["memory_total"] / 1e9, color="gray", ls="--", label="GPU memory")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (one head, d = 128)")
        ax.set_ylabel("peak memory (GB)")
        ax.legend(fontsize=7)
        ax.set_title("Peak memory: naive O(N^2), FA2 O(N), H200")
        files.append(_save(fig, out / "io_peak_memory.png"))
    return files


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    """A plot series; a point with no value (not measured) is a gap."""
    return [math.nan if r[key] is None else float(r[key]) for r in rows]


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def report(run_dir: Path, out: Path) -> str:
    manifest = json.loads((run_dir / "ncu_manifest.json").read_text())
    ncu_path = run_dir / "ncu.csv"
    measured = assign_kernels(parse_ncu_csv(ncu_path.read_text()), manifest) if ncu_path.exists() else {}
    runtime_path = run_dir / "runtime.json"
    runtime = json.loads(runtime_path.read_text()) if runtime_path.exists() else None
    rows = build_rows(manifest, measured, runtime)
    out.mkdir(parents=True, exist_ok=True)
    markdown = write_tables(rows, runtime, out)
    (out / "io_study_tables.md").write_text(markdown)
    return markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("runtime", "ncu-target", "report"))
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--run", type=Path, help="report: the folder of a GPU run's files")
    parser.add_argument("--plots", type=Path, help="report: where the PNGs go")
    parser.add_argument(
        "--groups", help="runtime / ncu-target: comma list of gpt2, tiles, head_dim, seqlen (runtime: memory)"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    def log(line: str) -> None:  # stderr: under ncu, stdout carries ncu's CSV
        print(f"[{time.perf_counter() - start:7.1f}s] {line}", file=sys.stderr, flush=True)

    if args.step == "runtime":
        run_runtime(args.out, log, args.groups)
    elif args.step == "ncu-target":
        run_ncu_target(args.out, log, args.groups)
    else:
        print(report(args.run or args.out, args.out))
        if args.plots:
            rows_manifest = json.loads(((args.run or args.out) / "ncu_manifest.json").read_text())
            runtime_path = (args.run or args.out) / "runtime.json"
            runtime = json.loads(runtime_path.read_text()) if runtime_path.exists() else None
            ncu_path = (args.run or args.out) / "ncu.csv"
            measured = assign_kernels(parse_ncu_csv(ncu_path.read_text()), rows_manifest) if ncu_path.exists() else {}
            for path in plot(build_rows(rows_manifest, measured, runtime), runtime, args.plots):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
