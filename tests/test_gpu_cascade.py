"""attention_with_shared_prefix on the GPU: the prefix split over key ranges (the GPU's own
choice), GQA-packed, merged with the suffix's decode call; against the flat paged call over the
same pages (bf16), with the append read back. Outputs are NaN-poisoned (conftest)."""

from __future__ import annotations

import pytest
from helpers import need_torch

import cupyflash
from cupyflash import _cascade

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("nq", "nnew"), [(1, 0), (1, 1), (4, 4)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_the_flat_paged_call(nq, nnew, page_size):
    torch = need_torch()
    gen = torch.Generator(device="cuda").manual_seed(nq * 10 + page_size)
    hq, hkv, d = 8, 2, 128
    groups, prefix_lens, own_lens = [0, 3, 5], [8192, 4096], [37, 0, 500, 1, 250]
    spare = 8
    prefix_pages = [n // page_size for n in prefix_lens]
    own_pages = [-(-(n + spare) // page_size) for n in own_lens]
    total = sum(prefix_pages) + sum(own_pages)
    pool, v_pool = (torch.randn(total, page_size, hkv, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32).tolist()
    prefix_rows = [order[sum(prefix_pages[:g]) : sum(prefix_pages[: g + 1])] for g in range(2)]
    base = sum(prefix_pages)
    own_rows = [order[base + sum(own_pages[:b]) : base + sum(own_pages[: b + 1])] for b in range(5)]

    def table(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device="cuda")

    flat = table([prefix_rows[g] + own_rows[b] for g in range(2) for b in range(groups[g], groups[g + 1])])
    q = torch.randn(5, nq, hq, d, device="cuda", generator=gen).bfloat16()
    k_new = v_new = None
    if nnew:
        k_new, v_new = (torch.randn(5, nnew, hkv, d, device="cuda", generator=gen).bfloat16() for _ in range(2))
    seqlens = torch.tensor(own_lens, dtype=torch.int32, device="cuda")
    k_flat, v_flat = pool.clone(), v_pool.clone()
    heads, rows = (hkv, 5 * hq // hkv) if nq == 1 else (hq, 5 * nq)  # GQA-packed rows for one token
    splits = _cascade._prefix_splits((None, torch.cuda.current_device()), max(prefix_pages) * page_size, heads, rows)
    assert splits > 1  # the GPU splits the prefix: the merge of parts is under test
    out, lse = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=table(prefix_rows), prefix_seqlens=torch.tensor(prefix_lens,
        dtype=torch.int32, device="cuda"), block_table=table(own_rows), cache_seqlens=seqlens, k_new=k_new,
        v_new=v_new, prefix_groups=groups, return_lse=True,
    )  # fmt: skip
    per_request = torch.tensor([8192] * 3 + [4096] * 2, dtype=torch.int32, device="cuda")
    want, want_lse = cupyflash.attention_with_kvcache(
        q, k_flat, v_flat, cache_seqlens=seqlens + per_request, block_table=flat, k_new=k_new, v_new=v_new,
        return_lse=True,
    )  # fmt: skip
    assert not torch.isnan(out).any()
    assert (out.float() - want.float()).abs().max() < 2e-2  # the partial outputs' bf16 rounding
    assert (lse - want_lse).abs().max() < 1e-3
    assert torch.equal(pool, k_flat) and torch.equal(v_pool, v_flat)
