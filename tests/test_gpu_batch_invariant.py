"""``batch_invariant=True`` on the GPU: each sequence's output and LSE bit for bit those of the
same sequence run alone (in a cache of its own size) and at another place in the batch, over 20
random batches per cache type, and within the usual error of the float64 reference; a CUDA graph
replays it; the split tickets are left at 0; the prefill kernels (padded and packed) give each
sequence its own bits. Outputs are NaN-poisoned before every launch (conftest). The planner's
side of the same rule: test_batch_invariant.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, capture, check_kvcache, kv_reference, need_torch, rel_error

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

COMPOSITIONS = 20
HQ, HKV, D = 32, 8, 128
MAX_LENGTH = 40_000
MAX_TOKENS = 1_500_000  # B x L of one batch (6 GB of bf16 K and V): lengths cut to fit
LAYOUTS = (0, 1, 16)  # contiguous, page sizes 1 and 16
E4M3_MAX = 448.0


def _lengths(rng: np.random.Generator, b: int) -> list[int]:
    """b lengths in 1 .. 40k, log-uniform (short and long alike), with split edges mixed in, cut so
    that the batch's cache fits MAX_TOKENS."""
    lengths = np.exp(rng.uniform(0, np.log(MAX_LENGTH), size=b)).astype(int).clip(1, MAX_LENGTH)
    for i in rng.choice(b, size=min(b, 2), replace=False):
        lengths[i] = rng.choice([1, 4095, 4096, 4097, 8192, MAX_LENGTH])
    return lengths.clip(1, MAX_TOKENS // b).tolist()


def _paginate(torch, caches, page_size, gen):
    """Caches [B, L, H, d] (any dtype: paged as bytes) as pages in a shuffled order, with spare
    pages of noise, through one block table [B, ceil(L / page_size)], all on the GPU."""
    b, length = caches[0].shape[:2]
    per_seq = -(-length // page_size)
    num_pages = b * per_seq + 5
    table = torch.randperm(num_pages, generator=gen, device="cuda")[: b * per_seq].reshape(b, per_seq)
    paged = []
    for cache in caches:
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        shape = (num_pages, page_size, *raw.shape[2:])
        if raw.dtype == torch.uint8:  # noise bytes (finite e4m3 values)
            pages = torch.randint(0, 100, shape, generator=gen, device="cuda", dtype=torch.uint8)
        else:
            pages = torch.randn(shape, generator=gen, device="cuda", dtype=raw.dtype)
        padded = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, per_seq * page_size - length))
        pages[table.flatten()] = padded.reshape(b * per_seq, page_size, *raw.shape[2:])
        paged.append(pages.view(cache.dtype))
    return paged, table.to(torch.int32)


def _caches(torch, b, capacity, cache, gen):
    """Contiguous K, V [B, capacity, Hkv, d] in bf16, or quantised to e4m3 (one row at a time:
    no float32 copy of the whole cache) with per-KV-head K scales and one V scale; and the scale
    keywords of the call."""
    shape = (b, capacity, HKV, D)
    if cache == "bf16":
        return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "kv"], {}
    scales = {"k_scale": torch.rand(HKV, generator=gen, device="cuda") * 0.01 + 0.002,
              "v_scale": torch.tensor(0.01, device="cuda")}  # fmt: skip
    caches = []
    for scale in (scales["k_scale"][:, None], scales["v_scale"]):
        c = torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn)
        for i in range(b):
            raw = torch.randn(shape[1:], generator=gen, device="cuda")
            c[i] = (raw / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        caches.append(c)
    return caches, scales


def _check_reference(out, lse, q, caches, scales, lengths, picked, cache):
    """The batch's rows of the ``picked`` sequences against the float64 reference over the values
    the contiguous ``caches`` hold (dequantised for e4m3)."""
    idx = list(picked)
    sub = [lengths[i] for i in idx]
    k, v = (c[idx] for c in caches)
    if cache == "bf16":
        check_kvcache(out[idx], lse[idx], q[idx], k, v, sub, True, "bfloat16")
        return
    k64 = (k.double() * scales["k_scale"].double()[:, None]).cpu().numpy()
    v64 = (v.double() * scales["v_scale"].double()).cpu().numpy()
    ref, ref_lse = kv_reference(q[idx].double().cpu().numpy(), k64, v64, sub, True)
    out64 = reference.to_numpy64(out[idx])
    assert not np.isnan(out64).any()
    assert rel_error(out64, ref) < BOUND["bfloat16"]
    np.testing.assert_allclose(reference.to_numpy64(lse[idx]), ref_lse, atol=2e-2)


def _call(q, k, v, seqlens, scales, rows, table=None, index=None):
    """The batch-invariant cache call of sequences ``rows`` (q's and cache_seqlens' rows) over
    caches k, v (paged through ``table``, or entries ``index``): (out, lse)."""
    return cupyflash.attention_with_kvcache(
        q[rows], k, v, cache_seqlens=seqlens[rows], block_table=table, cache_batch_idx=index, causal=True,
        return_lse=True, batch_invariant=True, **scales,
    )  # fmt: skip


@pytest.mark.gpu_memory  # (caches up to 64 x 45k tokens, paged copies beside them)
@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_each_sequence_is_bit_identical_alone_and_anywhere_in_the_batch(rng, cache):
    """20 random batches (B 1..64, lengths 1..40k, GQA 32/8, d = 128, bf16 q; contiguous with
    spare capacity, page sizes 1 and 16 in turn; some with 3 causal query tokens): every
    sequence's output and LSE equal bit for bit (torch.equal) those of the same sequence alone
    over a cache of its own size, and those of the batch in another order (cache_batch_idx or
    the table's rows permuted: each sequence at another place); a few sequences of each batch
    against the float64 reference."""
    torch = need_torch()
    gen = torch.Generator(device="cuda").manual_seed(int(rng.integers(1 << 30)))
    for composition in range(COMPOSITIONS):
        b = int(rng.integers(1, 65))
        lengths = _lengths(rng, b)
        nq = 3 if composition % 4 == 3 else 1
        page_size = LAYOUTS[composition % len(LAYOUTS)]
        capacity = max(lengths) + int(rng.integers(0, 5000))
        contiguous, scales = _caches(torch, b, capacity, cache, gen)
        k, v = contiguous
        q = torch.randn(b, nq, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        table = None
        if page_size:
            (k, v), table = _paginate(torch, (k, v), page_size, gen)

        every = torch.arange(b, device="cuda")
        out, lse = _call(q, k, v, seqlens, scales, every, table=table)
        order = torch.from_numpy(rng.permutation(b)).cuda()
        if page_size:
            moved_out, moved_lse = _call(q, k, v, seqlens, scales, order, table=table[order])
        else:
            moved_out, moved_lse = _call(q, k, v, seqlens, scales, order, index=order.to(torch.int32))
        assert torch.equal(moved_out, out[order]) and torch.equal(moved_lse, lse[order]), composition
        for i, n in enumerate(lengths):
            rows = every[i : i + 1]
            if page_size:
                alone = _call(q, k, v, seqlens, scales, rows, table=table[i : i + 1, : -(-n // page_size)])
            else:
                alone = _call(q, k[i : i + 1, :n], v[i : i + 1, :n], seqlens, scales, rows)
            assert torch.equal(alone[0], out[i : i + 1]), (composition, i, n, page_size)
            assert torch.equal(alone[1], lse[i : i + 1]), (composition, i, n, page_size)
        longest, shortest = int(np.argmax(lengths)), int(np.argmin(lengths))
        picked = {longest, shortest, *rng.choice(b, size=min(b, 2), replace=False).tolist()}
        _check_reference(out, lse, q, contiguous, scales, lengths, sorted(picked), cache)
        del k, v, contiguous, table
    torch.cuda.synchronize()
    _check_tickets_at_zero(torch)


def _check_tickets_at_zero(torch):
    """Every split ticket counter of every stream reads 0 (each sequence's last split reset its own)."""
    from cupyflash import _workspace

    for key, buffer in _workspace._buffers.items():
        if key[0] == "torch":
            counters = buffer.array[: buffer.counter_bytes // 4].view(torch.int32)
            assert int(counters.abs().sum()) == 0


def test_batch_invariant_matches_the_default_and_attention():
    """The same call with and without the flag agrees to rounding; attention's decode route
    (one query token) with the flag equals the cache call's bits over the same keys."""
    torch = need_torch()
    b, length = 4, 20_000
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    out, lse = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, return_lse=True, batch_invariant=True)
    check_kvcache(out, lse, q, k, v, [length] * b, True, "bfloat16")
    default = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    assert rel_error(reference.to_numpy64(out), reference.to_numpy64(default)) < BOUND["bfloat16"]
    dense, dense_lse = cupyflash.attention(q, k, v, return_lse=True, batch_invariant=True)
    assert torch.equal(dense, out) and torch.equal(dense_lse, lse)
    single = cupyflash.attention(q[1:2], k[1:2], v[1:2], batch_invariant=True)
    assert torch.equal(single, out[1:2])


def test_cuda_graph_capture_replays_batch_invariant():
    """A batch-invariant decode step (append, then the split kernel) captured in a CUDA graph
    replays with new inputs and matches the eager call bit for bit."""
    torch = need_torch()
    b, length = 3, 12_000
    k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, 1, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([100, 4095, 9000], dtype=torch.int32, device="cuda")

    def step():
        return cupyflash.attention_with_kvcache(
            q, k, v, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, batch_invariant=True
        )

    graph, graph_out = capture(torch, step)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        seqlens += 1
        graph.replay()
        k_eager, v_eager = k.clone(), v.clone()
        eager = cupyflash.attention_with_kvcache(
            q, k_eager, v_eager, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, batch_invariant=True
        )
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager)


@pytest.mark.parametrize("algorithm", ["auto", "fa2"])
def test_prefill_kernels_give_each_sequence_its_own_bits(algorithm):
    """attention on a padded batch (the Hopper kernel under "auto" on sm_90, FA2) and
    attention_varlen on packed sequences (d = 64 without a bound: the tile batch_invariant pins),
    with the flag: each sequence's rows equal bit for bit those of the sequence alone."""
    torch = need_torch()
    b, nq, nk, hq, hkv, d = 5, 333, 1000, 8, 2, 128
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out, lse = cupyflash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True, batch_invariant=True)
    for i in range(b):
        alone, alone_lse = cupyflash.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], causal=True,
                                               algorithm=algorithm, return_lse=True, batch_invariant=True)  # fmt: skip
        assert torch.equal(alone, out[i : i + 1]) and torch.equal(alone_lse, lse[i : i + 1]), i
    lengths = [300, 2500, 50, 1500]  # the batch's longest past 2048 keys, three sequences within it
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    total = int(cu[-1])
    pq, pk, pv = (torch.randn(total, heads, 64, device="cuda", dtype=torch.bfloat16) for heads in (8, 2, 2))
    options = {"algorithm": algorithm, "return_lse": True, "batch_invariant": True}
    packed, packed_lse = cupyflash.attention_varlen(pq, pk, pv, cu, cu, max(lengths), max(lengths), **options)
    for i, n in enumerate(lengths):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        own = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        alone, alone_lse = cupyflash.attention_varlen(pq[rows], pk[rows], pv[rows], own, own, n, n, **options)
        assert torch.equal(alone, packed[rows]) and torch.equal(alone_lse, packed_lse[:, rows]), (i, n)
