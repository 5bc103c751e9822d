"""Speculative decoding's tree mask on the GPU (``attention_with_kvcache(tree_mask=)``, the
split-KV kernel's tree variant) against the float64 reference: random trees over ragged caches
of odd lengths with the drafts appended by k_new (read back), contiguous and paged caches (page
sizes 1 and 16), e4m3 caches, a chain against the causal variant bit for bit, the mask's forms
(shared, per sequence, broadcast and strided views, CuPy), softcap with batch_invariant,
learnable sinks, CUDA graph capture, and the refusals. Outputs are NaN-poisoned before every
launch (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, capture, check_kvcache, kv_reference, need_torch, random_tree_mask, rel_error
from test_gpu_decode import _paginate
from test_gpu_fp8_decode import _quantise

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

# (Nq, Hq, Hkv): drafts x GQA group = packed rows. 4 drafts with GQA 4 (16 rows: one MMA tile),
# 7 drafts MHA (odd), 16 drafts MQA 8 (128 rows: several m-blocks of every tile), 23 drafts (odd,
# past 16), 32 (every bit of a 32-bit row word), 41 and 64 (the wide variant's 64-bit words).
ROWS = {"nq4-gqa4": (4, 8, 2), "nq7-mha": (7, 2, 2), "nq16-mqa8": (16, 8, 1), "nq23-gqa2": (23, 4, 2),
        "nq32-gqa4": (32, 8, 2), "nq41-mha": (41, 2, 2), "nq64-gqa2": (64, 4, 2)}  # fmt: skip


def _trees(rng, b, nq):
    """One random tree per sequence: bool NumPy (B, Nq, Nq)."""
    return np.stack([random_tree_mask(rng, nq) for _ in range(b)])


def _draft_step(torch, rng, dtype, head_dim, nq, hq, hkv, length=1031):
    """A speculative step's inputs on ragged caches of an odd length: q, caches, the drafts'
    k_new / v_new, cache_seqlens before the append (0, 1, 500 and a full cache after it)."""
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    b = 4
    q = torch.randn(b, nq, hq, head_dim, generator=gen).to("cuda", tdtype)
    k, v = (torch.randn(b, length, hkv, head_dim, generator=gen).to("cuda", tdtype) for _ in range(2))
    k_new, v_new = (torch.randn(b, nq, hkv, head_dim, generator=gen).to("cuda", tdtype) for _ in range(2))
    cached = [0, 1, 500, length - nq]
    return gen, q, k, v, k_new, v_new, cached


@pytest.mark.parametrize("page_size", [0, 1, 16], ids=["contiguous", "paged1", "paged16"])
@pytest.mark.parametrize("rows", list(ROWS), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tree_matches_reference(rng, dtype, head_dim, rows, page_size):
    torch = need_torch()
    nq, hq, hkv = ROWS[rows]
    gen, q, k, v, k_new, v_new, cached = _draft_step(torch, rng, dtype, head_dim, nq, hq, hkv)
    trees = _trees(rng, len(cached), nq)
    expected_k, expected_v = k.clone(), v.clone()
    for i, n in enumerate(cached):
        expected_k[i, n : n + nq], expected_v[i, n : n + nq] = k_new[i], v_new[i]
    k_cache, v_cache, table = k, v, None
    if page_size:
        (k_cache, v_cache), table = _paginate(torch, (k, v), page_size, gen)
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new,
        tree_mask=torch.from_numpy(trees).cuda(), return_lse=True,
    )  # fmt: skip
    assert type(out) is type(q) and out.dtype == q.dtype and out.shape == q.shape
    cupyflash.check_device_errors()
    lengths = [n + nq for n in cached]
    check_kvcache(out, lse, q, expected_k, expected_v, lengths, False, dtype, tree_mask=trees)
    if page_size:  # the drafts' rows read back through the block table
        for i, n in enumerate(cached):
            for t in range(nq):
                page, slot = table[i, (n + t) // page_size], (n + t) % page_size
                assert torch.equal(k_cache[page, slot], k_new[i, t]) and torch.equal(v_cache[page, slot], v_new[i, t])
    else:
        assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("nq", [1, 5, 16])
def test_a_chain_is_the_causal_variant(rng, nq, page_size):
    """A chain tree hides exactly the scores causal hides: at the same split count (the automatic
    one follows each variant's registers) the outputs are the same bits. The LSEs agree to float32
    rounding, not bit for bit: the two variants' compiled code may contract its additions into
    fused multiply-adds differently (seen on an H100 at 5 drafts, one split)."""
    torch = need_torch()
    gen, q, k, v, _, _, cached = _draft_step(torch, rng, "bfloat16", 128, nq, 8, 2)
    seqlens = torch.tensor([n + nq for n in cached], dtype=torch.int32, device="cuda")
    table = None
    if page_size:
        (k, v), table = _paginate(torch, (k, v), page_size, gen)
    chain = torch.ones(nq, nq, dtype=torch.bool, device="cuda").tril()
    for splits in (1, 3):
        common = {"cache_seqlens": seqlens, "block_table": table, "num_splits": splits, "return_lse": True}
        tree_out, tree_lse = cupyflash.attention_with_kvcache(q, k, v, tree_mask=chain, **common)
        causal_out, causal_lse = cupyflash.attention_with_kvcache(q, k, v, causal=True, **common)
        assert torch.equal(tree_out, causal_out), f"num_splits={splits}"
        torch.testing.assert_close(tree_lse, causal_lse, rtol=2e-6, atol=2e-6, msg=f"num_splits={splits}")


def test_the_mask_forms_agree(rng):
    """One tree for the batch as (Nq, Nq), (1, Nq, Nq), a stride-0 expanded (B, Nq, Nq) view, a
    transposed (strided) view, and CuPy arrays: the same bits as the tree given per sequence."""
    import cupy

    torch = need_torch()
    nq = 6
    _, q, k, v, _, _, cached = _draft_step(torch, rng, "float16", 64, nq, 8, 2)
    seqlens = torch.tensor([n + nq for n in cached], dtype=torch.int32, device="cuda")
    tree = torch.from_numpy(random_tree_mask(rng, nq)).cuda()
    b = q.shape[0]
    want = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, tree_mask=tree.expand(b, nq, nq).clone())
    transposed = tree.T.contiguous().T  # the same values, column-major
    for given in (tree, tree[None], tree.expand(b, nq, nq), transposed):
        got = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, tree_mask=given)
        assert torch.equal(got, want), tuple(given.shape)
    as_cupy = [cupy.asarray(x.cpu().numpy()) for x in (q, k, v, seqlens, tree)]
    got = cupyflash.attention_with_kvcache(*as_cupy[:3], cache_seqlens=as_cupy[3], tree_mask=as_cupy[4])
    assert isinstance(got, cupy.ndarray) and np.array_equal(cupy.asnumpy(got), want.cpu().numpy())


@pytest.mark.parametrize("page_size", [0, 1, 16], ids=["contiguous", "paged1", "paged16"])
@pytest.mark.parametrize("rows", list(ROWS), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tree_over_an_e4m3_cache(rng, head_dim, rows, page_size):
    """The float8 tree variants (drafts quantised as the append stores them) against the float64
    reference of the dequantised cache, no worse than the 16-bit cache's tree variant over those
    values rounded to q's dtype."""
    torch = need_torch()
    nq, hq, hkv = ROWS[rows]
    dtype = "bfloat16"
    gen, q, raw_k, raw_v, k_new, v_new, cached = _draft_step(torch, rng, dtype, head_dim, nq, hq, hkv)
    k_scale = (torch.rand(hkv, generator=gen) * 0.05 + 0.01).cuda()  # per KV head
    v_scale = torch.tensor(0.02, device="cuda")
    k8, v8 = _quantise(torch, raw_k.float(), k_scale[:, None], "e4m3"), _quantise(torch, raw_v.float(), v_scale, "e4m3")
    want_k, want_v = k8.clone(), v8.clone()
    for i, n in enumerate(cached):
        want_k[i, n : n + nq] = _quantise(torch, k_new[i], k_scale[:, None], "e4m3")
        want_v[i, n : n + nq] = _quantise(torch, v_new[i], v_scale, "e4m3")
    k_cache, v_cache, table = k8, v8, None
    if page_size:
        pages, table = _paginate(torch, [c.view(torch.uint8) for c in (k8, v8)], page_size, gen)
        k_cache, v_cache = (p.view(torch.float8_e4m3fn) for p in pages)
    trees = _trees(rng, len(cached), nq)
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new,
        k_scale=k_scale, v_scale=v_scale, tree_mask=torch.from_numpy(trees).cuda(), return_lse=True,
    )  # fmt: skip
    if not page_size:  # the drafts' bytes, and nothing else, written
        assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    deq_k = want_k.double() * k_scale.double()[:, None]
    deq_v = want_v.double() * v_scale.double()
    lengths = [n + nq for n in cached]
    ref, ref_lse = kv_reference(q, deq_k, deq_v, lengths, False, tree_mask=trees)
    out64 = reference.to_numpy64(out)
    assert not np.isnan(out64).any(), "unwritten (NaN-poisoned) output"
    error = rel_error(out64, ref)
    tdtype = getattr(torch, dtype)
    k16, v16 = deq_k.to(tdtype), deq_v.to(tdtype)
    out16 = cupyflash.attention_with_kvcache(
        q, k16, v16, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        tree_mask=torch.from_numpy(trees).cuda(),
    )  # fmt: skip
    error16 = rel_error(reference.to_numpy64(out16), kv_reference(q, k16, v16, lengths, False, tree_mask=trees)[0])
    floor = rel_error(reference.to_numpy64(torch.from_numpy(ref).to(tdtype)), ref)  # (as test_gpu_fp8_decode's)
    assert error < BOUND[dtype] and error <= 1.25 * max(error16, floor) + 1e-5, (error, error16, floor)
    lse64, finite = reference.to_numpy64(lse), np.isfinite(ref_lse)
    assert (np.isneginf(lse64) == np.isneginf(ref_lse)).all()
    np.testing.assert_allclose(lse64[finite], ref_lse[finite], atol=2e-2)


def test_softcap_and_batch_invariant(rng):
    """softcap and batch_invariant with a tree: the reference's answer, and a sequence's bits the
    same alone as in its batch."""
    torch = need_torch()
    nq = 8
    _, q, k, v, _, _, cached = _draft_step(torch, rng, "bfloat16", 128, nq, 8, 2, length=9001)
    lengths = [n + nq for n in cached]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    trees = _trees(rng, len(cached), nq)
    tree = torch.from_numpy(trees).cuda()
    out, lse = cupyflash.attention_with_kvcache(
        q, k, v, cache_seqlens=seqlens, tree_mask=tree, softcap=5.0, batch_invariant=True, return_lse=True
    )
    for i, n in enumerate(lengths):
        ref = reference.attention(q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n], softcap=5.0, tree_mask=trees[i])
        assert rel_error(reference.to_numpy64(out[i : i + 1]), ref) < BOUND["bfloat16"], i
    alone = cupyflash.attention_with_kvcache(
        q[3:], k[3:], v[3:], cache_seqlens=seqlens[3:], tree_mask=tree[3:], softcap=5.0, batch_invariant=True
    )
    assert torch.equal(alone, out[3:])
    assert not torch.isnan(lse).any()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_tree_with_sinks(rng, num_splits):
    """Learnable sinks over a tree's rows (bf16, d = 128, GQA 4, a paged cache, the drafts
    appended by k_new): one split adds the sink in its epilogue, several in the merge; a draft
    that sees no key outputs 0 with LSE = its head's sink. Against the float64 reference with both."""
    torch = need_torch()
    nq, hq, hkv = ROWS["nq4-gqa4"]
    gen, q, k, v, k_new, v_new, cached = _draft_step(torch, rng, "bfloat16", 128, nq, hq, hkv)
    trees = _trees(rng, len(cached), nq)
    trees[0, 2] = False  # sequence 0 has no prefix: its draft 2 sees no key
    sinks = (torch.randn(hq, generator=gen) * 2).float()
    expected_k, expected_v = k.clone(), v.clone()
    for i, n in enumerate(cached):
        expected_k[i, n : n + nq], expected_v[i, n : n + nq] = k_new[i], v_new[i]
    (k_cache, v_cache), table = _paginate(torch, (k, v), 16, gen)
    out, lse = cupyflash.attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(cached, dtype=torch.int32, device="cuda"),
        block_table=table, k_new=k_new, v_new=v_new, tree_mask=torch.from_numpy(trees).cuda(), sinks=sinks.cuda(),
        num_splits=num_splits, return_lse=True,
    )  # fmt: skip
    cupyflash.check_device_errors()
    lengths = [n + nq for n in cached]
    want, want_lse = kv_reference(q, expected_k, expected_v, lengths, False, tree_mask=trees, sinks=sinks)
    got = reference.to_numpy64(out)
    assert rel_error(got, want) < BOUND["bfloat16"]
    np.testing.assert_allclose(reference.to_numpy64(lse), want_lse, atol=2e-2, rtol=1e-3)
    assert (got[0, 2] == 0).all()


def test_cuda_graph_capture_replays_with_new_trees():
    """A speculative step (append the drafts, attend through the tree) captured in a CUDA graph
    replays with new q, drafts and tree values written into the same buffers (the kernel reads
    the tree at run time) and matches the eager call."""
    torch = need_torch()
    b, length, hq, hkv, d, nq = 2, 4096, 32, 8, 128, 8
    k, v = (torch.randn(b, length, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(b, nq, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([1000, 3000], dtype=torch.int32, device="cuda")
    rng = np.random.default_rng(5)
    tree = torch.from_numpy(_trees(rng, b, nq)).cuda()
    step = lambda: cupyflash.attention_with_kvcache(  # noqa: E731
        q, k, v, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, tree_mask=tree
    )
    graph, graph_out = capture(torch, step)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        tree.copy_(torch.from_numpy(_trees(rng, b, nq)))
        seqlens += nq
        graph.replay()
        k_eager, v_eager = k.clone(), v.clone()
        eager = cupyflash.attention_with_kvcache(
            q, k_eager, v_eager, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, tree_mask=tree
        )
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager)
        assert torch.equal(k[1, int(seqlens[1]) + nq - 1], k_new[1, -1])


def test_gpu_refusals():
    torch = need_torch()
    q = torch.zeros(2, 65, 8, 64, device="cuda", dtype=torch.float16)
    k = torch.zeros(2, 128, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="tree_mask on the GPU takes 1 to 64 query tokens"):
        cupyflash.attention_with_kvcache(q, k, k, cache_seqlens=40, tree_mask=torch.ones(65, 65, dtype=torch.bool,
                                                                                        device="cuda"))  # fmt: skip
    with pytest.raises(TypeError, match="tree_mask must be a bool array, got int8"):
        cupyflash.attention_with_kvcache(q[:, :4], k, k, cache_seqlens=40,
                                         tree_mask=torch.ones(4, 4, dtype=torch.int8, device="cuda"))  # fmt: skip


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_a_mask_mod_over_the_drafts_draws_its_tree_on_the_gpu(rng, lib):
    """attention_with_kvcache(mask_mod=) on GPU arrays: the tree drawn where q lives (a captured
    per-sequence ancestor table, and index arithmetic alone), bit for bit the call with that
    tree_mask."""
    b, length, hq, hkv, d, nq = 4, 300, 8, 2, 128, 9
    trees = np.stack([random_tree_mask(rng, nq) for _ in range(b)])
    host = [rng.standard_normal(shape).astype(np.float32) for shape in
            ((b, nq, hq, d), (b, length, hkv, d), (b, length, hkv, d), (b, nq, hkv, d), (b, nq, hkv, d))]  # fmt: skip
    if lib == "torch":
        torch = need_torch()
        to = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
        arrays = [to(x).to(torch.bfloat16) for x in host]
    else:
        cp = pytest.importorskip("cupy")
        to = cp.asarray
        arrays = [to(x).astype(cp.float16) for x in host]
    ancestors = to(trees.reshape(b * nq, nq))
    seqlens = to(np.array([0, 7, 100, 250], dtype=np.int32))
    steps = np.arange(nq)
    parity = np.tril(np.ones((nq, nq), bool)) & (steps[:, None] % 2 == steps[None, :] % 2)
    for mask_mod, tree in (
        (lambda b, h, i, j: ancestors[b * nq + i, j], trees),
        (lambda b, h, i, j: (j <= i) & (i % 2 == j % 2), np.broadcast_to(parity, trees.shape)),
    ):
        results = []
        for given in ({"mask_mod": mask_mod}, {"tree_mask": to(np.ascontiguousarray(tree))}):
            caches = [x.clone() if lib == "torch" else x.copy() for x in arrays[1:3]]
            out, lse = cupyflash.attention_with_kvcache(arrays[0], *caches, cache_seqlens=seqlens, k_new=arrays[3],
                                                        v_new=arrays[4], return_lse=True, **given)  # fmt: skip
            results.append((reference.to_numpy64(out), reference.to_numpy64(lse)))
        for got, want in zip(*results, strict=True):
            np.testing.assert_array_equal(got, want)
