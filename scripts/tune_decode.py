"""Measure decode tile candidates and split counts on the GPU (bf16, Hq=32, Hkv=8, d=128, one
query token): the numbers behind _dispatch.DECODE_TILES and decode_num_splits.

    python scripts/tune_decode.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch

import cupyflash
from cupyflash import _dispatch, _kvcache
from cupyflash._specs import DecodeTile
from cupyflash.bench import DecodeShape, cuda_time_ms, decode_inputs

CANDIDATES = [
    DecodeTile(16, 16, 4, 3),
    DecodeTile(16, 16, 4, 4),
    DecodeTile(16, 16, 4, 2),
    DecodeTile(16, 32, 4, 2),
    DecodeTile(16, 32, 4, 3),
    DecodeTile(16, 16, 8, 2),
    DecodeTile(16, 16, 8, 3),
    DecodeTile(16, 16, 2, 3),
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
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
        row["regs"] = plan.partial.num_regs if plan.partial else None
        print(json.dumps(row), flush=True)
        results.append(row)
    _dispatch.DECODE_TILES[128] = default
    _kvcache._plans.clear()
    splits = {}
    for n in (8, 16, 24, 33, 48, 66, 99, 132):
        splits[n] = time_us(DecodeShape(1, 131072), num_splits=n)
    print("B=1 L=131072 us by num_splits:", splits, flush=True)
    paged = {page: paged_time(DecodeShape(8, 32768), page) for page in (1, 16, 256)}
    print("B=8 L=32768 paged (shuffled pages) us, TB/s by page size:", paged, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiles": results, "splits": splits, "paged": paged}, f, indent=1)


if __name__ == "__main__":
    main()
