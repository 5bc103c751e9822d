"""One training step's backward (or, with ``--forward``, one forward) of cupyflash and of peers,
for Nsight Compute (issue 43: where the Hopper kernels' time goes beside the peers' on the same
inputs). bench.py's prefill shape (bf16, B x N = 16k, H x d = 2048): each backend's forward, then
its backward through autograd (``torch.autograd.grad`` on a retained graph), or its forward alone
(bench.py's prefill calls), warmed three times, then profiled once between cudaProfilerStart and
Stop.

    ncu --clock-control none --profile-from-start off --set detailed \\
        python3 scripts/ncu_attention.py HEAD_DIM SEQLEN [--causal] [--forward] [--backends cupyflash cudnn fa4]
    python3 scripts/ncu_attention.py HEAD_DIM SEQLEN --mods FUNCTION   # a gallery function (issue 40)
    python3 scripts/ncu_attention.py --summary REPORT.ncu-rep   # the table, one row per kernel

``--mods``: one forward of a bench.mods_gallery function (``document``, ``alibi``, ...): ours with
its block mask (cupyflash.create_block_mask), torch's compiled FlexAttention with the same
function and its block mask, and FlashAttention-4 through FlexAttention's FLASH backend where it
takes them; the built-in path where cupyflash has the same attention built in.

``--summary`` reads a report back (``ncu --import --csv --page raw``) and prints, per kernel:
time, SM and memory throughput (% of peak), the tensor pipe's activity, achieved occupancy,
registers, shared-memory bank conflicts and the top stall reasons. FlashAttention-4 is a peer
where ``flash_attn.cute`` is installed (bench.FA4_MODULE)."""

from __future__ import annotations

import argparse
import csv
import io
import subprocess
import sys
from typing import Any

# (report column, what it says); ncu 2025's raw metric names on sm_90
COLUMNS = (
    ("gpu__time_duration.sum", "us"),
    ("sm__throughput.avg.pct_of_peak_sustained_elapsed", "SM %"),
    ("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed", "mem %"),
    ("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "gmma %"),
    ("sm__warps_active.avg.pct_of_peak_sustained_active", "occupancy %"),
    ("launch__registers_per_thread", "regs"),
    ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "smem conflicts"),
)
STALL_PREFIX = "smsp__average_warps_issue_stalled_"


def profile(head_dim: int, seqlen: int, causal: bool, backends: list[str], forward_only: bool = False) -> None:
    import functools

    import torch

    import cupyflash
    from cupyflash import bench

    shape = bench.PrefillShape(16384 // seqlen, seqlen, 2048 // head_dim, head_dim, causal, "bfloat16")
    row: dict[str, object] = {}
    steps = {}
    if forward_only:
        q, k, v = bench.prefill_inputs(shape)
        calls = {
            b: functools.partial(cupyflash.attention, q, k, v, causal=causal, algorithm=bench.CUPYFLASH_BACKENDS[b])
            if b in bench.CUPYFLASH_BACKENDS
            else bench.peer_call(b, q, k, v, causal)
            for b in backends
        }
        steps = bench.runnable(calls, row)
    else:
        q, k, v = (x.requires_grad_(True) for x in bench.prefill_inputs(shape))
        dout = torch.randn_like(q)
        forwards = {b: bench._training_call(b, q, k, v, causal, 0.0) for b in backends}
        for backend, forward in bench.runnable(forwards, row).items():
            out = forward()
            out = out.transpose(1, 2) if backend in bench.SDPA_BACKENDS else out
            steps[backend] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    _profile(steps, row)


def _profile(steps: dict[str, Any], row: dict[str, object]) -> None:
    """Each backend's step warmed three times, then run once between cudaProfilerStart and Stop
    under its NVTX range; the backends that refused the inputs named first."""
    import torch

    for name, error in row.items():
        if name.endswith("_error"):
            print(f"not profiled: {name[: -len('_error')]}: {error}", flush=True)
    for _ in range(3):
        for step in steps.values():
            step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for backend, step in steps.items():
        torch.cuda.nvtx.range_push(backend)
        step()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile_mods(head_dim: int, seqlen: int, function: str) -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import cupyflash
    from cupyflash import bench

    shape = bench.PrefillShape(16384 // seqlen, seqlen, 2048 // head_dim, head_dim, False, "bfloat16")
    functions = bench.mods_gallery(seqlen, shape.heads)[function]
    q, k, v = bench.prefill_inputs(shape)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    score_mod, mask_mod, flex_score = functions.get("score_mod"), functions.get("mask_mod"), functions.get("flex_score")
    ours_masking, flex_block = {}, None
    if mask_mod is not None:
        ours_masking = {"block_mask": cupyflash.create_block_mask(mask_mod, None, None, seqlen, seqlen, device="cuda")}
        flex_block = create_block_mask(functions["flex_mask"], None, None, seqlen, seqlen, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    calls = {
        "cupyflash": lambda: cupyflash.attention(q, k, v, score_mod=score_mod, **ours_masking),
        "flex": lambda: flex(qt, kt, vt, score_mod=flex_score, block_mask=flex_block),
    }
    try:
        bench.fa4_attention()  # (FlashAttention-4 itself, not cupyflash's drop-in)
        calls["fa4"] = lambda: flex(qt, kt, vt, score_mod=flex_score, block_mask=flex_block,
                                    kernel_options={"BACKEND": "FLASH"})  # fmt: skip
    except (ImportError, RuntimeError) as error:
        print(f"not profiled: fa4: {error}", flush=True)
    if functions["builtin"] is not None:
        calls["cupyflash_builtin"] = lambda: cupyflash.attention(q, k, v, **functions["builtin"])
    row: dict[str, object] = {}
    steps = bench.runnable(calls, row)
    _profile(steps, row)


def summary(report: str) -> None:
    raw = subprocess.run(["ncu", "--import", report, "--csv", "--page", "raw"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    rows = list(csv.reader(io.StringIO(raw)))
    header, units, body = rows[0], rows[1], [r for r in rows[2:] if r]  # (the second row: the units)
    at = {name: i for i, name in enumerate(header)}
    for wanted, _ in COLUMNS:  # a metric this ncu names otherwise: the first column of its stem
        stem = wanted.split(".")[0]
        same_stem = [i for i, name in enumerate(header) if name.split(".")[0] == stem]
        if wanted not in at and same_stem:
            at[wanted] = same_stem[0]
    # (ncu picks the unit per report: usecond at d = 64 N = 1k, msecond at d = 128 N = 16k)
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "second": 1e6}
    # (per issue slot: ".ratio" where this ncu appends it)
    stalls = [n for n in header if n.startswith(STALL_PREFIX) and "per_issue_active" in n and "not_issued" not in n]
    print("| kernel | " + " | ".join(label for _, label in COLUMNS) + " | top stalls (warps per issue) |")
    print("|---|" + "---|" * len(COLUMNS) + "---|")
    for r in body:
        values = [r[at[c]] if c in at else "-" for c, _ in COLUMNS]
        if values[0] != "-":
            unit = units[at[COLUMNS[0][0]]]
            values[0] = f"{float(values[0].replace(',', '')) * to_us.get(unit, float('nan')):.1f}"
        ratios = ((float(r[at[n]].replace(",", "") or 0), n.removeprefix(STALL_PREFIX).removesuffix(".ratio"))
                  for n in stalls)  # fmt: skip
        top = sorted(ratios, reverse=True)[:3]
        name = r[at["Kernel Name"]][:48] if "Kernel Name" in at else "?"
        print(f"| {name} | " + " | ".join(values) + " | " + ", ".join(f"{s} {v:.2f}" for v, s in top) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head_dim", type=int, nargs="?", default=128)
    parser.add_argument("seqlen", type=int, nargs="?", default=16384)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--forward", action="store_true", help="profile the forward alone")
    parser.add_argument("--backends", nargs="+", default=["cupyflash", "cudnn", "fa4"])
    parser.add_argument("--mods", metavar="FUNCTION", help="a gallery function's forward (bench.mods_gallery)")
    parser.add_argument("--summary", metavar="REPORT", help="print the table of an ncu report instead")
    args = parser.parse_args(argv)
    if args.summary:
        summary(args.summary)
    elif args.mods:
        profile_mods(args.head_dim, args.seqlen, args.mods)
    else:
        profile(args.head_dim, args.seqlen, args.causal, args.backends, forward_only=args.forward)
    return 0


if __name__ == "__main__":
    sys.exit(main())
