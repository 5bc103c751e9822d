"""Measure decode tile candidates and split counts on the GPU (bf16, Hq=32, Hkv=8, d=128, one
query token): the numbers behind _dispatch.DECODE_TILES and decode_num_splits.

    python scripts/tune_decode.py [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

import cupyflash
from cupyflash import _dispatch, _kvcache
from cupyflash._specs import DecodeTile
from cupyflash.bench import DecodeShape, cuda_time_ms, decode_inputs, decode_shapes

CANDIDATES = [
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
SHAPES = [DecodeShape(1, 131072), DecodeShape(8, 32768), DecodeShape(8, 131072), DecodeShape(64, 4096)]


def time_us(shape: DecodeShape, **kwargs: object) -> float:
    q, k, v, seqlens = decode_inputs(shape)
    call = lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, **kwargs)  # noqa: E731
    return round(cuda_time_ms(call, warmup_ms=100.0, repeat=20) * 1e3, 1)


def paged_time(shape: DecodeShape, page_size: int) -> tuple[float, float]:
    """(us, TB/s) with the cache cut into pages listed in a shuffled block table."""
    q, k, v, seqlens = decode_inputs(shape)
    k_pages, v_pages = (x.reshape(-1, page_size, shape.heads_kv, shape.head_dim) for x in (k, v))
    table = torch.randperm(k_pages.shape[0], device="cuda").to(torch.int32).reshape(shape.batch, -1)
    call = lambda: cupyflash.attention_with_kvcache(  # noqa: E731
        q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table
    )
    us = round(cuda_time_ms(call, warmup_ms=100.0, repeat=20) * 1e3, 1)
    return us, round(shape.kv_bytes / us / 1e6, 2)


def tolerance_sweep(tolerances: list[float]) -> dict[str, dict[str, float]]:
    """Per-call us (20 back-to-back calls) of every benchmark shape with the split count chosen
    at each wave-efficiency tolerance (_dispatch.DECODE_WAVE_TOLERANCE)."""
    default = _dispatch.DECODE_WAVE_TOLERANCE
    rows = {}
    for tolerance in tolerances:
        _dispatch.DECODE_WAVE_TOLERANCE = tolerance
        _kvcache._plans.clear()
        row = {}
        for shape in decode_shapes():
            q, k, v, seqlens = decode_inputs(shape)
            call = functools.partial(cupyflash.attention_with_kvcache, q, k, v, cache_seqlens=seqlens)
            row[f"B{shape.batch}_L{shape.seqlen}"] = round(cuda_time_ms(call, warmup_ms=100.0, calls=20) * 1e3, 1)
            plan = next(p for p in _kvcache._plans.values())
            row[f"B{shape.batch}_L{shape.seqlen}_splits"] = plan.num_splits
            _kvcache._plans.clear()
        rows[str(tolerance)] = row
        print(f"tolerance {tolerance}:", json.dumps(row), flush=True)
    _dispatch.DECODE_WAVE_TOLERANCE = default
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--tolerances", type=float, nargs="+", help="only sweep the split-count tolerance")
    args = parser.parse_args()
    if args.tolerances:
        rows = tolerance_sweep(args.tolerances)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tolerance": rows}, f, indent=1)
        return
    default = _dispatch.DECODE_TILES[128]
    results = []
    for tile in CANDIDATES:
        _dispatch.DECODE_TILES[128] = (tile, *default[1:])
        _kvcache._plans.clear()
        row = {"tile": str(tile)}
        for shape in SHAPES:
            us = time_us(shape)
            row[f"B{shape.batch}_L{shape.seqlen}"] = us
            row[f"B{shape.batch}_L{shape.seqlen}_TBps"] = round(shape.kv_bytes / us / 1e6, 2)
        plan = next(iter(_kvcache._plans.values()))
        if plan.partial is not None:
            row["regs"], row["ctas_per_sm"] = plan.partial.num_regs, _kvcache._occupancy(plan.partial, 0)
        print(json.dumps(row), flush=True)
        results.append(row)
    # The best tile by the geometric mean over the shapes, then its split counts.
    keys = [f"B{shape.batch}_L{shape.seqlen}" for shape in SHAPES]
    best = min(results, key=lambda r: math.prod(r[k] for k in keys))
    print("best:", best["tile"], flush=True)
    _dispatch.DECODE_TILES[128] = (CANDIDATES[results.index(best)], *default[1:])
    _kvcache._plans.clear()
    splits = {}
    for shape in (DecodeShape(1, 131072), DecodeShape(8, 32768)):
        row = {n: time_us(shape, num_splits=n) for n in (1, 8, 16, 24, 32, 48, 64, 96, 128)}
        splits[f"B{shape.batch}_L{shape.seqlen}"] = row
        print(f"B={shape.batch} L={shape.seqlen} us by num_splits:", row, flush=True)
    paged = {page: paged_time(DecodeShape(8, 32768), page) for page in (1, 16, 256)}
    print("B=8 L=32768 paged (shuffled pages) us, TB/s by page size:", paged, flush=True)
    _dispatch.DECODE_TILES[128] = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiles": results, "splits": splits, "paged": paged}, f, indent=1)


if __name__ == "__main__":
    main()
