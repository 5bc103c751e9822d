"""Nsight Compute over one cascade call and one flat paged call at a batch where the cascade
loses (issue 41: B = 1 and 2, 4k prefix, GQA 32/8, d = 128, pages of 16, 512 own keys; both
plans launch 72 CTAs, yet the cascade's kernel takes about 6 us more): the same inputs as
bench.run_cascade, each call warmed (compiled) first, then profiled between cudaProfilerStart
and Stop.
    usage (GPU machine): ncu --clock-control none --profile-from-start off --section ... \\
        python3 docs/evidence/2026-12-06-h100-session/scripts/ncu_cascade.py BATCH PREFIX"""

import sys

import torch

import cupyflash

batch, prefix = int(sys.argv[1]), int(sys.argv[2])
own, page_size, hq, hkv, d = 512, 16, 32, 8, 128
gen = torch.Generator(device="cuda").manual_seed(0)
prefix_pages, own_pages = prefix // page_size, own // page_size
pages = prefix_pages + batch * own_pages
k_pool, v_pool = (
    torch.randn(pages, page_size, hkv, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in "kv"
)
order = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
prefix_table = order[:prefix_pages].reshape(1, prefix_pages)
own_table = order[prefix_pages:].reshape(batch, own_pages)
flat_table = torch.cat([prefix_table.expand(batch, prefix_pages), own_table], dim=1).contiguous()
q = torch.randn(batch, 1, hq, d, device="cuda", generator=gen, dtype=torch.bfloat16)
own_lens = torch.full((batch,), own, dtype=torch.int32, device="cuda")
flat_lens = own_lens + prefix


def cascade():
    return cupyflash.attention_with_shared_prefix(
        q,
        k_pool,
        v_pool,
        prefix_block_table=prefix_table,
        prefix_seqlens=prefix,
        block_table=own_table,
        cache_seqlens=own_lens,
    )


def flat():
    return cupyflash.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=flat_lens, block_table=flat_table)


for _ in range(3):
    cascade(), flat()
torch.cuda.synchronize()
torch.cuda.profiler.start()
cascade()
flat()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
