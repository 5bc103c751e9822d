"""The split-KV decode call's kernel time (CUDA events, back to back, the best of 5 rounds of 50
calls) on the tree this process imports: GQA 32/8, d = 128, bf16, contiguous and paged (pages of
16) caches. Run once per tree, in turn, to compare two trees' default decode variants.
    usage (GPU machine): PYTHONPATH=TREE python3 docs/evidence/2026-12-07-h100-session-9/scripts/decode_ab.py LABEL"""

import json
import sys

import torch
from event_timing import kernel_us

import cupyflash


def shape_row(row: dict, batch: int, length: int, gen) -> None:
    q = torch.randn(batch, 1, 32, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, length, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    row[f"B{batch}_L{length}"] = kernel_us(lambda: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=lens))
    pages = batch * length // 16
    kp, vp = k.reshape(pages, 16, 8, 128), v.reshape(pages, 16, 8, 128)
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, -1)
    row[f"B{batch}_L{length}_paged"] = kernel_us(
        lambda: cupyflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    )


row = {"tree": sys.argv[1], "file": cupyflash.__file__}
gen = torch.Generator(device="cuda").manual_seed(0)
for batch, length in ((1, 131072), (8, 32768), (32, 32768), (64, 4096)):
    shape_row(row, batch, length, gen)
print(json.dumps(row), flush=True)
