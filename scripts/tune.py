"""Tile tuning on the GPU machine: the measurements behind the tables of cupyflash/_dispatch.py.

    python scripts/tune.py fa2 [--head-dims 64 128] [--dtype bfloat16] [--json OUT]
    python scripts/tune.py fa3 [--head-dims 64] [--short] [--dtype bfloat16] [--json OUT]
    python scripts/tune.py mods [--head-dims 64 128] [--seqlens 4096 16384] [--functions document ...] [--json OUT]
    python scripts/tune.py bwd [--head-dims 64 128] [--dtype bfloat16] [--json OUT]
    python scripts/tune.py hopper-bwd [--switch late_exp] [--head-dims 64 128] [--seqlens 4096 16384] [--causal-only]
        [--json OUT]
    python scripts/tune.py decode [--tolerances 0.01 0.05] [--json OUT]
    python scripts/tune.py head-dims [--head-dims 40 80 96] [--seqlens 4096] [--json OUT]

fa2 / fa3: each candidate tile (FA2: TileConfig, block sizes, warps, stages; Hopper: Fa3Tile,
key block, consumer warpgroups, K/V stages) is compiled (in parallel), put into the dispatch
table, checked against the float64 reference on awkward shapes, and timed on bench.py's prefill
shapes (H * d = 2048, B * N = 16384); a candidate that spills is skipped. The table of TFLOP/s
per candidate is what FA2_FWD_TILES / FA3_FWD_TILES / FA3_SHORT_FWD_TILES are set from.
Each candidate is timed with cuDNN in its own rounds (and the Hopper ones after the peers alone,
FlashAttention-4 among them where it is installed): the table's ratios to cuDNN, not the
candidates' TFLOP/s one after another, compare them (a run's clocks drift). ``fa3 --short``: the
short-call candidates at N = 1024.

mods: the Hopper forward's tile with a score or mask function (FA3_MODS_FWD_TILES): each
candidate (static or dynamic schedule) for the gallery's functions beside FlexAttention
(bench.run_mods, forward; the three timings), with the candidate's spill.

bwd: the FA2 backward's (block_m, block_n, d_split) per head dim (FA2_BWD_TILES): registers and spills of
each, its gradient error, and attention_backward's TFLOP/s on the prefill shapes.

hopper-bwd: the Hopper backward with a switch off and on (``--switch``: late_exp, its exponentials
after dP^T as before they ran under it; dq_first, dK after dQ; decoupled, its consumers meeting
once a step; lpt, its causal CTAs longest first in sections of (batch, head) pairs; fwd_lpt, the
forward's causal tiles so; fwd_uniform, the forward's consumer index uniform; rows80, d = 128's
80-row steps; rows_by_producer, each step's -LSE and D copied by the producer; decoupled_rows,
decoupled with the producer's rows in both settings; decoupled_causal, decoupled under the causal
mask at d = 128 alone), per training
shape one right after the other, each with cuDNN (and FlashAttention-4 where installed) in its
rounds: forward + backward and backward alone over each.

decode: DECODE_TILES candidates for d = 128 (bf16, Hq = 32, Hkv = 8, one query token) on four
cache shapes, then the split counts of the best one, paged caches by page size; ``--tolerances``
sweeps only the split heuristic's wave-efficiency tolerance (DECODE_WAVE_TOLERANCE).

head-dims: head dims below a tile width (the next width's kernel, the columns past the caller's
zero): the FA2 kernel, the Hopper kernel and the default beside PyTorch flash and cuDNN, with
TFLOP/s counted at the caller's head dim (H = 2048 / d rounded down, B * N = 16384): the head
dims where FA2 at its own width beats the Hopper kernel at the next set
_dispatch.FA2_OVER_FA3_MAX_HEAD_DIM.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any

import numpy as np

import cupyflash
from cupyflash import _dispatch, _kernels, _plan, bench, reference
from cupyflash._specs import DecodeTile, Fa2FwdSpec, Fa3FwdSpec, Fa3Tile, TileConfig

# ---------------------------------------------------------------------------------------------
# Shared: the correctness check of a candidate and its row of TFLOP/s.
# ---------------------------------------------------------------------------------------------
# (Nq, Nk, causal, window): odd lengths, Nq != Nk, GQA, causal, a window
AWKWARD_SHAPES = ((300, 333, True, (-1, -1)), (77, 200, False, (-1, -1)), (129, 64, False, (20, 7)))
#: The candidates are timed as the tables were set: bench.py's interleaved harness alone (the three
#: timings of a speed claim would triple a tuning run that fills a GPU call).
TUNING_TIMING = ("interleaved",)


def forget_plans() -> None:
    """Drop every cached plan: the next call plans again from the (changed) dispatch tables."""
    _plan.clear_caches()


def max_relative_error(head_dim: int, dtype: str, algorithm: str) -> float:
    """Largest relative error against the float64 reference over AWKWARD_SHAPES."""
    import torch

    rng = np.random.default_rng(head_dim)
    err = 0.0
    for nq, nk, causal, window in AWKWARD_SHAPES:
        q, k, v = (
            torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().to(getattr(torch, dtype))
            for s in ((2, nq, 4, head_dim), (2, nk, 2, head_dim), (2, nk, 2, head_dim))
        )
        out = cupyflash.attention(q, k, v, causal=causal, window=window, algorithm=algorithm)
        ref = reference.attention(q, k, v, causal=causal, window=window)
        err = max(err, float(np.linalg.norm(reference.to_numpy64(out) - ref) / np.linalg.norm(ref)))
    return err


def prefill_row(
    head_dim: int,
    dtype: str,
    backend: str,
    seqlens: tuple[int, ...] = bench.PREFILL_SEQLENS,
    beside: tuple[str, ...] = (),
) -> dict[str, Any]:
    """TFLOP/s of one backend (a cupyflash one, or a peer: "cudnn") on the benchmark's shapes
    (H * d = 2048, B * N = 16384), keyed N1024, N1024c (causal), ...; with ``beside``, those peers
    in the same rounds and the backend's ratio to each (key "N1024/cudnn", ...): candidates timed
    one after another drift with the clocks over a run, a ratio within one round does not."""
    row: dict[str, Any] = {}
    for n in seqlens:
        for causal in (False, True):
            shape = bench.PrefillShape(16384 // n, n, 2048 // head_dim, head_dim, causal, dtype)
            measured = bench.run_prefill(shape, backends=(backend, *beside), timings=TUNING_TIMING)
            key = f"N{n}{'c' if causal else ''}"
            row[key] = measured[backend]
            for peer in beside:
                if measured.get(backend) and measured.get(peer):
                    row[f"{key}/{peer}"] = round(measured[backend] / measured[peer], 3)
    return row


def candidate_row(
    head_dim: int,
    dtype: str,
    tile: Any,
    regs: str,
    algorithm: str,
    seqlens: tuple[int, ...] = bench.PREFILL_SEQLENS,
    beside: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One candidate's line of the tuning table (already in the dispatch table): its error on
    the awkward shapes and its TFLOP/s on the benchmark shapes (and its ratio to the peers
    ``beside`` it in the same rounds), printed as it comes."""
    row = {
        "head_dim": head_dim,
        "tile": repr(tile),
        "regs": regs,
        "err": max_relative_error(head_dim, dtype, algorithm),
        **prefill_row(head_dim, dtype, f"cupyflash_{algorithm}", seqlens, beside),
    }
    print(json.dumps(row), flush=True)
    return row


def _device() -> tuple[int, int]:
    """(device id, its shared memory per block with opt-in)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    return device, cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]


def _write(path: str | None, results: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


# ---------------------------------------------------------------------------------------------
# fa2: the mma.sync kernel's tiles.
# ---------------------------------------------------------------------------------------------
FA2_CANDIDATES = {
    32: [
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 64, 4),
        TileConfig(64, 64, 4, q_in_regs=True, min_blocks=3),
    ],
    64: [
        TileConfig(128, 64, 4),
        TileConfig(128, 64, 4, stages=3),
        TileConfig(64, 64, 4, q_in_regs=True, min_blocks=3),
        TileConfig(128, 128, 8, q_in_regs=True, overlap=True),
    ],
    96: [TileConfig(128, 64, 8, q_in_regs=True), TileConfig(128, 64, 8, q_in_regs=True, overlap=True)],
    128: [
        TileConfig(128, 128, 8, q_in_regs=True),
        TileConfig(128, 128, 8, stages=3, q_in_regs=True),
        TileConfig(128, 32, 4, min_blocks=2),
        TileConfig(64, 64, 4, q_in_regs=True, overlap=True, min_blocks=2),
    ],
    192: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(128, 32, 8)],
    256: [TileConfig(128, 64, 8), TileConfig(64, 64, 4), TileConfig(64, 64, 4, overlap=True)],
}


def tune_fa2(args: argparse.Namespace) -> list[dict[str, Any]]:
    head_dims = args.head_dims or sorted(FA2_CANDIDATES)
    device, _ = _device()
    specs = [
        Fa2FwdSpec(args.dtype, d, tile, causal=causal)
        for d in head_dims
        for tile in FA2_CANDIDATES[d]
        for causal in (False, True)
    ]
    compiled = {k.spec: k for k in _kernels.warmup(specs, device, workers=16)}
    results = []
    for d in head_dims:
        for tile in FA2_CANDIDATES[d]:
            kernels = [compiled[Fa2FwdSpec(args.dtype, d, tile, causal=c)] for c in (False, True)]
            regs = "/".join(str(k.num_regs) for k in kernels)
            if any(k.local_bytes for k in kernels):
                print(f"d={d} {tile}: spills ({[k.local_bytes for k in kernels]} B), skipped")
                continue
            _dispatch.FA2_FWD_TILES[d] = (tile,)
            forget_plans()
            results.append(candidate_row(d, args.dtype, tile, regs, "fa2", beside=("cudnn",)))
    return results


# ---------------------------------------------------------------------------------------------
# fa3: the Hopper kernel's tiles.
# ---------------------------------------------------------------------------------------------
FA3_CANDIDATES = {
    64: [
        Fa3Tile(128, 3, 2),
        Fa3Tile(128, 3, 2, pingpong=True),
        Fa3Tile(128, 3, 2, pingpong=True, dynamic=True),
        Fa3Tile(128, 3, 4, pingpong=True, dynamic=True),
        Fa3Tile(128, 2, 4, pingpong=True, dynamic=True),
    ],
    128: [
        Fa3Tile(128, pingpong=True),
        Fa3Tile(128, pingpong=True, dynamic=True),
    ],
    256: [
        Fa3Tile(64, separate_o=False, pingpong=True),
        Fa3Tile(64, separate_o=False, pingpong=True, dynamic=True),
    ],
}
# Short calls (FA3_SHORT_FWD_TILES): d = 64 tiles at N = 1024, beside cuDNN. (Key blocks of 176
# and 192 were candidates too until their wgmma shapes left kernels_cu/wgmma.cuh.) The last four
# are three-consumer tiles (the long calls' two among them: FA3_FWD_TILES), which gained 4-11% at
# N >= 4k since the short tile was chosen (2026-11-29, H200).
FA3_SHORT_CANDIDATES = {
    64: [
        Fa3Tile(128, 2, 4, pingpong=True),
        Fa3Tile(128, 2, 4, pingpong=True, dynamic=True),
        Fa3Tile(128, 2, 2, pingpong=True),
        Fa3Tile(128, 3, 4),
        Fa3Tile(128, 3, 2),
        Fa3Tile(128, 3, 2, pingpong=True, dynamic=True),
        Fa3Tile(128, 3, 4, pingpong=True, dynamic=True),
    ],
}


def tune_fa3(args: argparse.Namespace) -> list[dict[str, Any]]:
    candidates = FA3_SHORT_CANDIDATES if args.short else FA3_CANDIDATES
    seqlens = (1024,) if args.short else bench.PREFILL_SEQLENS
    head_dims = args.head_dims or sorted(candidates)
    device, max_smem = _device()
    specs = [
        Fa3FwdSpec(args.dtype, d, tile, causal=causal)
        for d in head_dims
        for tile in candidates[d]
        for causal in (False, True)
    ]
    specs = [s for s in specs if s.smem_bytes <= max_smem]
    compiled = {k.spec: k for k in _kernels.warmup(specs, device, workers=16)}
    results = []
    # The peers alone first: cuDNN, and FlashAttention-4 where it is installed; then each candidate
    # with cuDNN in its rounds (its ratio to cuDNN is what compares candidates).
    peers = ["cudnn"]
    try:
        bench.fa4_attention()
        peers.append("fa4")
    except ImportError:
        pass
    for d in head_dims:
        for peer in peers:
            results.append({"head_dim": d, "tile": peer, **prefill_row(d, args.dtype, peer, seqlens)})
            print(json.dumps(results[-1]), flush=True)
    for d in head_dims:
        for tile in candidates[d]:
            kernels = [compiled.get(Fa3FwdSpec(args.dtype, d, tile, causal=c)) for c in (False, True)]
            if any(k is None for k in kernels):
                print(f"d={d} {tile}: over the shared memory of a block, skipped")
                continue
            regs = "/".join(str(k.num_regs) for k in kernels if k is not None)
            if any(k.local_bytes for k in kernels if k is not None):
                print(f"d={d} {tile}: spills, skipped")
                continue
            _dispatch.FA3_FWD_TILES[d, False] = _dispatch.FA3_FWD_TILES[d, True] = tile
            _dispatch.FA3_SHORT_FWD_TILES.pop((d, False), None)  # the candidate at every length
            _dispatch.FA3_SHORT_FWD_TILES.pop((d, True), None)
            forget_plans()
            results.append(candidate_row(d, args.dtype, tile, regs, "fa3", seqlens, beside=("cudnn",)))
    return results


# ---------------------------------------------------------------------------------------------
# mods: the Hopper forward's tiles with a score or mask function (FA3_MODS_FWD_TILES).
# ---------------------------------------------------------------------------------------------
# The two-consumer tiles, static and dynamic: a mask function makes tiles uneven (a document
# mask's rows see their own document's keys), which a persistent CTA on a static stride does not
# balance. At d = 64 three consumers in round robin too, as the built-in options run there: their
# 192-row tiles read two of a BlockMask's 128-row range blocks; some functions' builds spill
# (sm_90a, at 160 registers a consumer: softcap 12-20 bytes, a gathered bias 284, a document mask
# 4-12; ALiBi and index arithmetic none, applied past the sequence with no branch per score),
# which each row's spill_bytes reports.
MODS_CANDIDATES = {
    64: [
        Fa3Tile(128, 2, 4, pingpong=True, dynamic=True),
        Fa3Tile(128, 2, 4, pingpong=True),
        Fa3Tile(128, consumers=3, stages=2, pingpong=True, dynamic=True),
    ],
    128: [Fa3Tile(128, pingpong=True), Fa3Tile(128, pingpong=True, dynamic=True)],
}


def _mods_spill_bytes(tile: Fa3Tile) -> int:
    """The most local memory of the Hopper forwards with a function built on ``tile`` so far."""
    built = [
        k for k in _kernels.compiled_variants()
        if isinstance(k.spec, Fa3FwdSpec) and k.spec.mods_source and k.spec.tile == tile
    ]  # fmt: skip
    return max((k.local_bytes for k in built), default=0)


def tune_mods(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each candidate tile in FA3_MODS_FWD_TILES (for calls with and without a bound), then the
    gallery's functions (bench.mods_gallery) timed beside FlexAttention by bench.run_mods: its
    ratios over FlexAttention and the built-in options, its output's largest difference from
    FlexAttention's, and the candidate kernels' spill."""
    results = []
    head_dims = args.head_dims or sorted(MODS_CANDIDATES)
    for d in head_dims:
        for tile in MODS_CANDIDATES[d]:
            _dispatch.FA3_MODS_FWD_TILES[d, False] = _dispatch.FA3_MODS_FWD_TILES[d, True] = tile
            forget_plans()
            for n in args.seqlens:
                shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, False, args.dtype)
                for name, functions in bench.mods_gallery(n, shape.heads).items():
                    if args.functions and name not in args.functions:
                        continue
                    row = {"tile": repr(tile), **bench.run_mods(shape, name, functions, backward=False)}
                    row["spill_bytes"] = _mods_spill_bytes(tile)
                    results.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "timings_ms"}), flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# decode: the split-KV kernel's tiles, split counts, page sizes.
# ---------------------------------------------------------------------------------------------
DECODE_CANDIDATES = [
    DecodeTile(16, 16, 4, 3),
    DecodeTile(16, 16, 4, 2, min_blocks=3),
    DecodeTile(16, 16, 4, 4),
    DecodeTile(16, 32, 4, 2),
    DecodeTile(16, 32, 4, 3),
    DecodeTile(16, 16, 8, 2),
    DecodeTile(16, 16, 8, 3),
    DecodeTile(16, 16, 2, 3),
    DecodeTile(16, 32, 2, 3),
    DecodeTile(16, 16, 2, 4),
]
DECODE_SHAPES = [
    bench.DecodeShape(1, 131072),
    bench.DecodeShape(8, 32768),
    bench.DecodeShape(8, 131072),
    bench.DecodeShape(64, 4096),
]


def _decode_us(shape: bench.DecodeShape, **kwargs: Any) -> float:
    q, k, v, seqlens = bench.decode_inputs(shape)
    call = functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens, **kwargs)
    return round(bench.cuda_time_ms(call, warmup_ms=100.0, repeat=20) * 1e3, 1)


def _paged_time(shape: bench.DecodeShape, page_size: int) -> tuple[float, float]:
    """(us, TB/s) with the cache cut into pages listed in a shuffled block table."""
    import torch

    q, k, v, seqlens = bench.decode_inputs(shape)
    k_pages, v_pages = (x.reshape(-1, page_size, shape.heads_kv, shape.head_dim) for x in (k, v))
    table = torch.randperm(k_pages.shape[0], device="cuda").to(torch.int32).reshape(shape.batch, -1)
    call = functools.partial(cupyflash.attention_with_kvcache, q, k_pages, v_pages, cache_seqlens=seqlens,
                             block_table=table)  # fmt: skip
    us = round(bench.cuda_time_ms(call, warmup_ms=100.0, repeat=20) * 1e3, 1)
    return us, round(shape.kv_bytes / us / 1e6, 2)


def _decode_plan() -> dict[str, int]:
    """Split count, registers and resident CTAs per SM of the one decode call planned since the
    last forget_plans()."""
    from cupyflash import _kvcache

    launch = next(iter(_kvcache._plans.values()))
    step = next(s for s in launch.steps if getattr(getattr(s, "spec", None), "kernel", "") == "decode_partial")
    kernel = _kernels.get_kernel(step.spec, 0)
    return {
        "splits": int(launch.params.value("num_splits")),
        "regs": kernel.num_regs,
        "ctas_per_sm": _dispatch.ctas_per_sm(step.spec, _device.device_info(0)),
    }


def _tolerance_sweep(tolerances: list[float]) -> dict[str, dict[str, float]]:
    """Per-call us (20 back-to-back calls) of every benchmark shape with the split count chosen
    at each wave-efficiency tolerance (_dispatch.DECODE_WAVE_TOLERANCE)."""
    default = _dispatch.DECODE_WAVE_TOLERANCE
    rows = {}
    for tolerance in tolerances:
        _dispatch.DECODE_WAVE_TOLERANCE = tolerance
        forget_plans()
        row = {}
        for shape in bench.decode_shapes():
            q, k, v, seqlens = bench.decode_inputs(shape)
            call = functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens)
            row[f"B{shape.batch}_L{shape.seqlen}"] = round(bench.cuda_time_ms(call, warmup_ms=100.0, calls=20) * 1e3, 1)
            row[f"B{shape.batch}_L{shape.seqlen}_splits"] = _decode_plan()["splits"]
            forget_plans()
        rows[str(tolerance)] = row
        print(f"tolerance {tolerance}:", json.dumps(row), flush=True)
    _dispatch.DECODE_WAVE_TOLERANCE = default
    return rows


def tune_decode(args: argparse.Namespace) -> dict[str, Any]:
    if args.tolerances:
        return {"tolerance": _tolerance_sweep(args.tolerances)}
    default = _dispatch.DECODE_TILES[128]
    results = []
    for tile in DECODE_CANDIDATES:
        _dispatch.DECODE_TILES[128] = (tile, *default[1:])
        forget_plans()
        row: dict[str, Any] = {"tile": str(tile)}
        for shape in DECODE_SHAPES:
            us = _decode_us(shape)
            row[f"B{shape.batch}_L{shape.seqlen}"] = us
            row[f"B{shape.batch}_L{shape.seqlen}_TBps"] = round(shape.kv_bytes / us / 1e6, 2)
        plan = _decode_plan()
        row["regs"], row["ctas_per_sm"] = plan["regs"], plan["ctas_per_sm"]
        print(json.dumps(row), flush=True)
        results.append(row)
    # The best tile by the geometric mean over the shapes, then its split counts.
    keys = [f"B{shape.batch}_L{shape.seqlen}" for shape in DECODE_SHAPES]
    best = min(results, key=lambda r: math.prod(r[k] for k in keys))
    print("best:", best["tile"], flush=True)
    _dispatch.DECODE_TILES[128] = (DECODE_CANDIDATES[results.index(best)], *default[1:])
    forget_plans()
    splits = {}
    for shape in (bench.DecodeShape(1, 131072), bench.DecodeShape(8, 32768)):
        by_count = {n: _decode_us(shape, num_splits=n) for n in (1, 8, 16, 24, 32, 48, 64, 96, 128)}
        splits[f"B{shape.batch}_L{shape.seqlen}"] = by_count
        print(f"B={shape.batch} L={shape.seqlen} us by num_splits:", by_count, flush=True)
    paged = {page: _paged_time(bench.DecodeShape(8, 32768), page) for page in (1, 16, 256)}
    print("B=8 L=32768 paged (shuffled pages) us, TB/s by page size:", paged, flush=True)
    _dispatch.DECODE_TILES[128] = default
    forget_plans()
    return {"tiles": results, "splits": splits, "paged": paged}


# ---------------------------------------------------------------------------------------------
# bwd: the FA2 backward's (block_m, block_n, d_split).
# ---------------------------------------------------------------------------------------------
BWD_CANDIDATES = {  # (block_m, block_n, d_split)
    64: [(64, 128, 1), (32, 128, 1), (64, 64, 1), (128, 128, 1)],
    128: [(32, 128, 1), (32, 64, 1), (64, 128, 1), (64, 64, 1)],
    256: [(32, 64, 2), (64, 64, 2)],
}


def _backward_error(head_dim: int, dtype: str) -> float:
    """Largest relative error of dq, dk, dv on one awkward shape against cupyflash's host
    backward in float64 (checked against PyTorch autograd by tests/test_backward_xp.py)."""
    import torch

    torch.manual_seed(head_dim)
    t = getattr(torch, dtype)
    q = torch.randn(2, 300, 4, head_dim, device="cuda", dtype=t)
    k, v = (torch.randn(2, 333, 2, head_dim, device="cuda", dtype=t) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    host = [reference.to_numpy64(x) for x in (dout, q, k, v)]
    out64, lse64 = cupyflash.attention(*host[1:], causal=True, return_lse=True)
    want = cupyflash.attention_backward(host[0], *host[1:], out64, lse64, causal=True)
    return max(float(np.linalg.norm(reference.to_numpy64(g) - w) / np.linalg.norm(w)) for g, w in zip(grads, want))


def tune_bwd(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each candidate in the table, its error and the TFLOP/s of attention_backward alone (2.5x
    the forward's FLOPs) on the prefill shapes; spilling candidates are timed too (marked)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from cupyflash._specs import Fa2BwdSpec

    device, _ = _device()
    head_dims = args.head_dims or sorted(BWD_CANDIDATES)
    specs = {
        (d, tile): [Fa2BwdSpec(args.dtype, d, *tile[:2], causal, d_split=tile[2]) for causal in (False, True)]
        for d in head_dims
        for tile in BWD_CANDIDATES[d]
    }
    _kernels.get_kernel(next(iter(specs.values()))[0], device)  # one alone first (NVRTC's first use races)
    with ThreadPoolExecutor(16) as pool:
        built = dict(zip(specs, pool.map(lambda pair: [_kernels.get_kernel(s, device) for s in pair], specs.values())))
    rows = []
    for (head_dim, tile), kernels in built.items():
        _dispatch.FA2_BWD_TILES[head_dim] = tile
        forget_plans()
        row: dict[str, Any] = {"head_dim": head_dim, "tile": tile,
                               "regs": [k.num_regs for k in kernels], "spill": [k.local_bytes for k in kernels],
                               "err": _backward_error(head_dim, args.dtype)}  # fmt: skip
        for n in bench.PREFILL_SEQLENS:
            for causal in (False, True):
                shape = bench.PrefillShape(16384 // n, n, 2048 // head_dim, head_dim, causal, args.dtype)
                q, k, v = bench.prefill_inputs(shape)
                dout = torch.randn_like(q)
                out, lse = cupyflash.attention(q, k, v, causal=causal, return_lse=True)
                call = functools.partial(cupyflash.attention_backward, dout, q, k, v, out, lse, causal=causal)
                ms = bench.cuda_time_ms(call, repeat=10)
                row[f"N{n}{'c' if causal else ''}"] = round(shape.flops * 2.5 / ms / 1e9, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# head-dims: which kernel a head dim below a tile width runs faster on.
# ---------------------------------------------------------------------------------------------
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)


def tune_head_dims(args: argparse.Namespace) -> list[dict[str, Any]]:
    device, max_smem = _device()
    dims, seqlens = args.head_dims or HEAD_DIMS, args.seqlens or (4096,)
    shapes = [
        bench.PrefillShape(16384 // n, n, max(1, 2048 // d), d, causal, args.dtype)
        for d in dims
        for n in seqlens
        for causal in (False, True)
    ]
    # The variants these shapes meet, compiled in parallel first (a head dim below a tile width
    # is compiled on demand, so warmup has not built it).
    specs: list[Any] = []
    for s in shapes:
        flags = _dispatch.MaskFlags(s.causal, False, False)
        specs.append(_dispatch.fa2_fwd_spec(s.dtype, s.head_dim, flags, max_smem))
        hopper = _dispatch.fa3_fwd_spec(s.dtype, s.head_dim, flags, s.seqlen, chosen=True)
        specs += [hopper] if hopper is not None else []
    _kernels.warmup(list(dict.fromkeys(specs)), device, workers=16)
    rows = []
    for s in shapes:
        backends = ("cupyflash", "cupyflash_fa2", "cupyflash_fa3", "flash", "cudnn")
        row = bench.run_prefill(s, backends=backends, timings=TUNING_TIMING)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# hopper-bwd: the Hopper backward with a switch off and on, each beside cuDNN.
# ---------------------------------------------------------------------------------------------
#: hopper-bwd's switches: the _dispatch flag each sets
HOPPER_BWD_SWITCHES = {
    "decoupled": "FA3_BWD_DECOUPLED", "late_exp": "FA3_BWD_LATE_EXP", "dq_first": "FA3_BWD_DQ_FIRST",
    "lpt": "FA3_BWD_LPT", "fwd_lpt": "FA3_FWD_LPT", "fwd_uniform": "FA3_FWD_UNIFORM_CONSUMER",
    "rows80": "FA3_BWD_ROWS80", "rows_by_producer": "FA3_BWD_ROWS_BY_PRODUCER",
    "decoupled_rows": "FA3_BWD_DECOUPLED", "decoupled_causal": "FA3_BWD_DECOUPLED_CAUSAL",
}  # fmt: skip
#: the other flags a switch's two settings both run with (the exponentials under dP^T;
#: decoupled_rows: the producer's rows, with which the decoupled consumers take 80-row steps)
HOPPER_BWD_BASE = {"dq_first": {"FA3_BWD_LATE_EXP": False},
                   "decoupled": {"FA3_BWD_LATE_EXP": False, "FA3_BWD_DECOUPLED_CAUSAL": False},
                   "late_exp": {"FA3_BWD_DQ_FIRST": False},
                   "decoupled_rows": {"FA3_BWD_LATE_EXP": False, "FA3_BWD_ROWS_BY_PRODUCER": True,
                                      "FA3_BWD_DECOUPLED_CAUSAL": False},
                   "decoupled_causal": {"FA3_BWD_DECOUPLED": False}}  # fmt: skip


def tune_hopper_bwd(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per training shape, the Hopper backward with a switch (``args.switch``) off and on, one
    right after the other, each with cuDNN (and FlashAttention-4 where installed) in its own
    rounds; first each setting's error on an awkward causal shape against the float64 host
    backward. ``late_exp``: its exponentials after dP^T, the order before they ran under it
    (``_dispatch.FA3_BWD_LATE_EXP``); ``dq_first``: dK issued after dQ, dQ staged under it
    (``_dispatch.FA3_BWD_DQ_FIRST``); ``decoupled``: its consumers meeting once a step
    (``_dispatch.FA3_BWD_DECOUPLED``); the last two with the exponentials under dP^T, the first
    with dK issued in its order (HOPPER_BWD_BASE); ``lpt``: the causal CTAs in sections of
    (batch, head) pairs, longest first (``_dispatch.FA3_BWD_LPT``); ``fwd_lpt``: the causal
    forward's tiles so (``_dispatch.FA3_FWD_LPT``: the step's column moves, not the backward's);
    ``fwd_uniform``: the forward's consumer index uniform (``_dispatch.FA3_FWD_UNIFORM_CONSUMER``);
    ``rows80``: d = 128's 80-row steps without a causal mask (``_dispatch.FA3_BWD_ROWS80``);
    ``rows_by_producer``: each step's -LSE and D copied by the producer
    (``_dispatch.FA3_BWD_ROWS_BY_PRODUCER``); ``decoupled_rows``: the decoupled consumers with the
    producer's rows on in both settings (d = 128 without a mask: 80-row steps either way);
    ``decoupled_causal``: the decoupled consumers under the causal mask at d = 128 alone
    (``_dispatch.FA3_BWD_DECOUPLED_CAUSAL``; ``decoupled`` and ``decoupled_rows`` run with it off)."""
    flag = HOPPER_BWD_SWITCHES[args.switch]
    base = HOPPER_BWD_BASE.get(args.switch, {})
    defaults = {name: getattr(_dispatch, name) for name in (flag, *base)}
    for name, value in base.items():
        setattr(_dispatch, name, value)
    backends = ["cupyflash", "cudnn"]
    try:
        bench.fa4_attention()
        backends.append("fa4")
    except ImportError:
        pass
    head_dims = args.head_dims or [64, 128]
    errors = {}
    for on in (False, True):
        setattr(_dispatch, flag, on)
        forget_plans()
        errors[on] = {d: _backward_error(d, args.dtype) for d in head_dims}
    print(json.dumps({"error": {str(k): v for k, v in errors.items()}}), flush=True)
    rows = []
    for d in head_dims:
        for n in args.seqlens:
            for causal in (True,) if args.causal_only else (False,) if args.noncausal_only else (False, True):
                shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, args.dtype)
                for on in (False, True):
                    setattr(_dispatch, flag, on)
                    forget_plans()
                    measured = bench.run_training(shape, backends=tuple(backends), timings=TUNING_TIMING)
                    row = {args.switch: on, "head_dim": d, "seqlen": n, "causal": causal}
                    for part, key in (("step", ""), ("bwd", "_bwd")):  # forward + backward; backward alone
                        row.update({f"{b}{key}": measured.get(f"{b}{key}") for b in backends})
                        for peer in backends[1:]:
                            ours, theirs = row[f"cupyflash{key}"], row[f"{peer}{key}"]
                            if ours and theirs:
                                row[f"{part}/{peer}"] = round(ours / theirs, 3)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    for name, value in defaults.items():
        setattr(_dispatch, name, value)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kernel", required=True)
    for name in ("fa2", "fa3"):
        p = sub.add_parser(name, help=f"the {name} forward kernel's tiles")
        p.add_argument("--head-dims", type=int, nargs="+")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--json")
        if name == "fa3":
            p.add_argument("--short", action="store_true", help="the short-call candidates at N = 1024")
    p = sub.add_parser("mods", help="the Hopper forward's tiles with score / mask functions")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--functions", nargs="+", help="gallery functions (bench.mods_gallery); default all")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    p = sub.add_parser("bwd", help="the FA2 backward's query and key blocks")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    p = sub.add_parser("hopper-bwd", help="the Hopper backward with a switch off and on")
    p.add_argument("--switch", choices=sorted(HOPPER_BWD_SWITCHES), default="late_exp")
    p.add_argument("--causal-only", action="store_true", help="the causal shapes alone (lpt changes no other)")
    p.add_argument("--noncausal-only", action="store_true", help="the non-causal shapes alone (rows80's)")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    p = sub.add_parser("decode", help="the split-KV decode kernel's tiles, split counts and page sizes")
    p.add_argument("--tolerances", type=float, nargs="+", help="only sweep the split-count tolerance")
    p.add_argument("--json")
    p = sub.add_parser("head-dims", help="FA2 against the Hopper kernel at head dims below a tile width")
    p.add_argument("--head-dims", type=int, nargs="+")
    p.add_argument("--seqlens", type=int, nargs="+")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json")
    args = parser.parse_args(argv)
    tuners = {"fa2": tune_fa2, "fa3": tune_fa3, "mods": tune_mods, "bwd": tune_bwd, "decode": tune_decode,
              "head-dims": tune_head_dims, "hopper-bwd": tune_hopper_bwd}  # fmt: skip
    results = tuners[args.kernel](args)
    _write(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
