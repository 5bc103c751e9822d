"""A BlockMask on the GPU: its summary made by the kernel (kernels_cu/attn_mask.cuh's
block_mask_cells) equal to the host's; the FA2 forward, the Hopper forward and both backwards
reading it (hidden tiles skipped, plain ones with score_mod alone) against the float64
host path and against the mask_mod alone on the GPU: odd lengths, GQA, causal beside the mask,
cells finer and coarser than the tiles, a score_mod beside it, a summary made on the host, CUDA
graph capture. Outputs are NaN-poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, capture, need_torch, rel_error, three_consumer_mods_tiles

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu


def _unclassed(torch, mask_mod, rows, keys):
    """``mask_mod`` with its query and key indices read through an identity table of
    max(``rows``, ``keys``) entries (past the lengths: the kernels evaluate padding rows and keys
    too): the same mask, which index arithmetic cannot class (an array read may hold anything), so
    the kernels evaluate it score by score on every tile. One table, not one per index: the
    kernels take at most 4 captured arrays, and the document masks and the score_mod beside them
    hold 3."""
    ids = torch.arange(max(rows, keys), device="cuda")
    return lambda b, h, i, j: mask_mod(b, h, ids[i], ids[j])


B, NQ, NK, HQ, HKV = 2, 333, 461, 8, 2
SHIFT = NK - NQ


def _masks(to_array, seed):
    """(name, mask_mod, B, H), their captured arrays made by ``to_array`` from NumPy ones drawn from
    ``seed`` (the same values on the host and on the GPU)."""
    rng = np.random.default_rng(seed)
    doc_q = to_array(np.sort(rng.integers(0, 4, NQ)).astype(np.int32))
    doc_k = to_array(np.sort(rng.integers(0, 4, NK)).astype(np.int32))
    table = to_array(rng.integers(0, 2, (HQ, NK)).astype(np.int32))  # a per-head key mask
    return [
        ("document", lambda b, h, i, j: doc_q[i] == doc_k[j], None, None),
        ("document-causal", lambda b, h, i, j: (doc_q[i] == doc_k[j]) & (j <= i + SHIFT), None, None),
        ("sliding", lambda b, h, i, j: (j <= i + SHIFT) & (i + SHIFT - j < 100), None, None),
        ("prefix-lm", lambda b, h, i, j: (j <= i + SHIFT) | (j < 70), None, None),
        ("chunked", lambda b, h, i, j: (i + SHIFT) // 96 == j // 96, None, None),
        ("per-head-keys", lambda b, h, i, j: (table[h, j] == 1) | (j > 400), None, HQ),
        ("per-batch", lambda b, h, i, j: (j < 150 + 200 * b) & (i % 7 != 3), B, None),  # rows i % 7 == 3: no key
    ]


def _qkv(torch, gen, dtype, head_dim):
    return [torch.randn(B, n, h, head_dim, generator=gen).to(dtype) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV))]


@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("block", [128, 64, (32, 64), 16], ids=str)
def test_the_gpu_summary_is_the_host_s(lib, block):
    """The kernel's cells and the ranges made from them equal the host's, mask by mask."""
    if lib == "torch":
        torch = need_torch()
        to_gpu, to_numpy, device = (lambda x: torch.from_numpy(x).cuda()), (lambda x: x.cpu().numpy()), "cuda"
    else:
        cp = pytest.importorskip("cupy")
        to_gpu, to_numpy, device = cp.asarray, cp.asnumpy, 0
    for (name, on_host, batch, heads), (_, on_gpu, _, _) in zip(_masks(lambda x: x, 2), _masks(to_gpu, 2), strict=True):
        want = cupyflash.create_block_mask(on_host, batch, heads, NQ, NK, BLOCK_SIZE=block)
        # (on the GPU by device=: some masks capture no array)
        got = cupyflash.create_block_mask(on_gpu, batch, heads, NQ, NK, device=device, BLOCK_SIZE=block)
        assert "GPU 0" in repr(got) and type(got.cells).__module__.split(".")[0] == lib, name
        np.testing.assert_array_equal(to_numpy(got.cells), np.asarray(want.cells), err_msg=name)
        assert np.isin(to_numpy(got.cells), (0, 1, 2)).all(), name  # every cell written (poisoned: 0x7f)
        for r_got, r_want in zip(got._ranges, want._ranges, strict=True):
            np.testing.assert_array_equal(to_numpy(r_got), np.asarray(r_want), err_msg=name)
        assert got.sparsity() == want.sparsity()
    # a mask with no captured array: made where device= says
    for device in ("cuda", 0):
        got = cupyflash.create_block_mask(
            lambda b, h, i, j: j <= i, None, None, NQ, NK, device=device, BLOCK_SIZE=block
        )
        want = cupyflash.create_block_mask(lambda b, h, i, j: j <= i, None, None, NQ, NK, BLOCK_SIZE=block)
        assert "GPU 0" in repr(got)
        np.testing.assert_array_equal(_host(got.cells), np.asarray(want.cells))


def _host(x):
    """A GPU array's values on the host (a CuPy array or a CUDA tensor)."""
    return x.get() if hasattr(x, "get") else x.cpu().numpy()


@pytest.mark.parametrize("algorithm", ["auto", "fa2"])  # auto: the Hopper kernel on sm_90
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_forward_with_a_block_mask(rng, options, dtype, head_dim, algorithm):
    """Against the float64 host path on the same values, and against the mask_mod alone on the
    GPU (the summary only skips work); with a score_mod beside it too."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q, k, v = _qkv(torch, gen, tdtype, head_dim)
    host = [x.double().numpy() for x in (q, k, v)]
    bias = torch.randn(HQ, NK, generator=gen)
    bias_gpu, bias = bias.cuda(), bias.double().numpy()  # (the host path's in its arrays' namespace)
    for (name, on_host, batch, heads), (_, on_gpu, _, _) in zip(
        _masks(lambda x: x, 7), _masks(lambda x: torch.from_numpy(x).cuda(), 7), strict=True
    ):
        for block in (128, 32):
            bm = cupyflash.create_block_mask(on_gpu, batch, heads, NQ, NK, BLOCK_SIZE=block)
            for score, gpu_score in ((None, None), (lambda s, b, h, i, j: s + bias[h, j],
                                                    lambda s, b, h, i, j: s + bias_gpu[h, j])):  # fmt: skip
                label = (name, block, score is not None)
                want, want_lse = cupyflash.attention(*host, score_mod=score, mask_mod=on_host, return_lse=True,
                                                     **options)  # fmt: skip
                out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), score_mod=gpu_score, block_mask=bm,
                                               algorithm=algorithm, return_lse=True, **options)  # fmt: skip
                alone, alone_lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), score_mod=gpu_score,
                                                       mask_mod=on_gpu, algorithm=algorithm, return_lse=True,
                                                       **options)  # fmt: skip
                got = reference.to_numpy64(out)
                assert rel_error(got, want) < BOUND[dtype], label
                assert rel_error(got, reference.to_numpy64(alone)) < BOUND[dtype], label
                got_lse, finite = reference.to_numpy64(lse), np.isfinite(want_lse)
                assert (np.isfinite(got_lse) == finite).all(), label
                np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2, err_msg=str(label))
                np.testing.assert_allclose(got_lse[finite], reference.to_numpy64(alone_lse)[finite], atol=2e-2)
                if name == "per-batch":  # rows that see no key: 0, LSE -inf, as the mask_mod's alone
                    assert (got[:, 3::7] == 0).all() and np.isneginf(got_lse[:, :, 3::7]).all()


@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_key_ids_read_ahead_give_the_same_bits(rng, dtype, head_dim, monkeypatch):
    """_mods.READ_KEYS_AHEAD (the Hopper forward reads a mask's one read per key, a document id or
    a per-head table's entry, ahead of the scores): output and LSE bit for bit those of the reads
    where they are used, and the float64 host path's; with the block mask and without (every tile
    mixed), causal beside it or not."""
    torch = need_torch()
    from cupyflash import _attention, _mods, _plan

    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (x.cuda() for x in _qkv(torch, gen, getattr(torch, dtype), head_dim))
    host = [reference.to_numpy64(x) for x in (q, k, v)]
    masks = [
        (on_host, on_gpu, batch, heads)
        for (name, on_host, batch, heads), (_, on_gpu, _, _) in zip(
            _masks(lambda x: x, 5), _masks(lambda x: torch.from_numpy(x).cuda(), 5), strict=True
        )
        if name in ("document", "document-causal", "per-head-keys")
    ]
    runs: dict[bool, list] = {}
    try:
        for ahead in (False, True):
            monkeypatch.setattr(_mods, "READ_KEYS_AHEAD", ahead)
            _attention._kernel_mods.clear()
            _plan.clear_caches()
            runs[ahead] = []
            for on_host, on_gpu, batch, heads in masks:
                bm = cupyflash.create_block_mask(on_gpu, batch, heads, NQ, NK)
                for options in ({}, {"causal": True}):
                    for masking in ({"block_mask": bm}, {"mask_mod": on_gpu}):
                        out, lse = cupyflash.attention(q, k, v, return_lse=True, **masking, **options)
                        runs[ahead].append((out.clone(), lse.clone()))
                        if ahead:
                            want = cupyflash.attention(*host, mask_mod=on_host, **options)
                            assert rel_error(reference.to_numpy64(out), want) < BOUND[dtype]
    finally:  # (no variant of either setting left in the caches for the tests after this one)
        _attention._kernel_mods.clear()
        _plan.clear_caches()
    for (out, lse), (out_ahead, lse_ahead) in zip(runs[False], runs[True], strict=True):
        assert torch.equal(out, out_ahead) and torch.equal(lse, lse_ahead)


@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=str)
def test_forward_with_a_block_mask_on_three_consumers(rng, options, monkeypatch):
    """test_forward_with_a_block_mask at d = 64 on the Hopper forward's 192-row tiles (three
    consumers in round robin, the tile of calls past 2048 keys): each tile bounded by the
    two 128-row range blocks its rows span, the last tile's by its rows alone."""
    three_consumer_mods_tiles(monkeypatch)
    test_forward_with_a_block_mask(rng, options, "float16", 64, "auto")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 256)])
def test_backward_with_a_block_mask(rng, options, dtype, head_dim, deterministic):
    """The backward reading the summary (on sm_90 the Hopper one at d = 64 and 128: its query
    blocks bounded by the row ranges, the mask on mixed tiles alone; else the mma.sync one),
    against the float64 host path's gradients on the same values (with a dlse and sinks) and
    against the mask_mod alone on the GPU."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q, k, v = _qkv(torch, gen, tdtype, head_dim)
    sinks = torch.randn(HQ, generator=gen)
    for (name, on_host, batch, heads), (_, on_gpu, _, _) in zip(
        _masks(lambda x: x, 9), _masks(lambda x: torch.from_numpy(x).cuda(), 9), strict=True
    ):
        bm = cupyflash.create_block_mask(on_gpu, batch, heads, NQ, NK, BLOCK_SIZE=64)
        gpu = [x.cuda() for x in (q, k, v)]
        out, lse = cupyflash.attention(*gpu, block_mask=bm, sinks=sinks.cuda(), return_lse=True, **options)
        dout = torch.randn(out.shape, generator=gen).to(tdtype)
        dlse = torch.randn(lse.shape, generator=gen)
        common = dict(dlse=dlse.cuda(), sinks=sinks.cuda(), deterministic=deterministic, **options)
        grads = cupyflash.attention_backward(dout.cuda(), *gpu, out, lse, block_mask=bm, **common)
        alone = cupyflash.attention_backward(dout.cuda(), *gpu, out, lse, mask_mod=on_gpu, **common)
        host = [x.double().numpy() for x in (dout, q, k, v, out.cpu(), lse.cpu(), dlse, sinks)]
        want = cupyflash.attention_backward(*host[:6], dlse=host[6], mask_mod=on_host, sinks=host[7], **options)
        for grad_name, got, other, ref in zip(("dq", "dk", "dv", "dsinks"), grads, alone, want, strict=True):
            got = reference.to_numpy64(got)
            assert np.isfinite(got).all() == np.isfinite(ref).all(), (name, grad_name)
            assert rel_error(got, ref) < 3e-2, (name, grad_name)
            assert rel_error(got, reference.to_numpy64(other)) < 2e-2, (name, grad_name)


def test_autograd_with_a_block_mask_and_a_score_mod(rng):
    """A training step through autograd: the gradients with a block_mask (made on the host: copied
    to the GPU at the first call) equal the mask_mod's alone, and the float64 host path's."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _qkv(torch, gen, torch.bfloat16, 64)
    bias = torch.randn(HQ, NK, generator=gen)

    def mask_mod(b, h, i, j):
        return ((i + SHIFT) // 64 == j // 64) | (j < 16)

    bm = cupyflash.create_block_mask(mask_mod, None, None, NQ, NK, BLOCK_SIZE=(64, 32))  # on the host
    assert "the host" in repr(bm)

    def run(tensors, table, **masking):
        leaves = [x.clone().requires_grad_() for x in tensors]
        out = cupyflash.attention(*leaves, score_mod=lambda s, b, h, i, j: s + table[h, j], **masking)
        out.float().square().sum().backward()
        return [out.detach(), *(x.grad for x in leaves)]

    got = run([x.cuda() for x in (q, k, v)], bias.cuda(), block_mask=bm)
    alone = run([x.cuda() for x in (q, k, v)], bias.cuda(), mask_mod=mask_mod)
    want = run([x.double() for x in (q, k, v)], bias.double(), mask_mod=mask_mod)
    for name, g, a, w in zip(("out", "dq", "dk", "dv"), got, alone, want, strict=True):
        assert rel_error(reference.to_numpy64(g), w.numpy()) < 3e-2, name
        assert rel_error(reference.to_numpy64(g), reference.to_numpy64(a)) < 2e-2, name


def test_a_block_mask_skips_work():
    """The tiles a block mask hides are never loaded. 16 documents over the first 4k of 8k keys,
    the rest padding (doc -1) that no query sees, its V NaN: with the mask_mod alone every key
    tile is loaded and 0 x NaN in the P.V product makes NaN rows; with the block mask the padding's
    tiles are skipped and the result is the one with finite padding. (The mask reads its array, so
    the kernels' own tile classes cannot hide those tiles: only the summary does. The speed-up is
    bench-mods'; a timing here would race the other tests for the GPU.)"""
    torch = need_torch()
    n = 8192
    doc = torch.arange(n, device="cuda") // (n // 32)
    doc[n // 2 :] = -1
    q, k, v = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poisoned = v.clone()
    poisoned[:, n // 2 :] = float("nan")

    def document(b, h, i, j):
        return (doc[i] == doc[j]) & (doc[j] >= 0) & (j <= i)

    bm = cupyflash.create_block_mask(document, None, None, n, n)
    assert bm.sparsity() > 90
    for algorithm in ("auto", "fa2"):
        want = cupyflash.attention(q, k, v, algorithm=algorithm, mask_mod=document)
        assert torch.isfinite(want).all(), algorithm
        assert torch.isnan(cupyflash.attention(q, k, poisoned, algorithm=algorithm, mask_mod=document)).any(), algorithm
        got = cupyflash.attention(q, k, poisoned, algorithm=algorithm, block_mask=bm)
        assert torch.isfinite(got).all(), algorithm
        assert rel_error(reference.to_numpy64(got), reference.to_numpy64(want)) < 1e-2, algorithm


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64)])
def test_a_mask_mod_alone_classes_its_own_tiles(rng, dtype, head_dim, deterministic):
    """Without a BlockMask, the kernels class each tile from the traced mask itself
    (cupyflash/_mod_tiles.py's cf_user_mask_tile: hidden tiles skipped, plain ones with score_mod
    alone): the FA2 forward and the mma.sync backward against the float64 host path and against
    the same mask unclassed (``_unclassed``), for the gallery's masks (index-only ones decided, a
    captured array's mixed), with a score_mod beside them."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q, k, v = _qkv(torch, gen, tdtype, head_dim)
    gpu = [x.cuda() for x in (q, k, v)]
    host = [x.double().numpy() for x in (q, k, v)]
    bias = torch.randn(HQ, NK, generator=gen)
    bias_gpu, bias_host = bias.cuda(), bias.double().numpy()
    for (name, on_host, _, _), (_, on_gpu, _, _) in zip(
        _masks(lambda x: x, 5), _masks(lambda x: torch.from_numpy(x).cuda(), 5), strict=True
    ):
        results = {}
        for classed, mask_mod in ((True, on_gpu), (False, _unclassed(torch, on_gpu, NQ + 128, NK + 128))):
            out, lse = cupyflash.attention(*gpu, score_mod=lambda s, b, h, i, j: s + bias_gpu[h, j], mask_mod=mask_mod,
                                           algorithm="fa2", return_lse=True)  # fmt: skip
            dout = torch.ones_like(out)
            grads = cupyflash.attention_backward(dout, *gpu, out, lse, mask_mod=mask_mod, deterministic=deterministic,
                                                 score_mod=lambda s, b, h, i, j: s + bias_gpu[h, j])  # fmt: skip
            results[classed] = [reference.to_numpy64(x) for x in (out, lse, *grads)]
        want_out, want_lse = cupyflash.attention(*host, score_mod=lambda s, b, h, i, j: s + bias_host[h, j],
                                                 mask_mod=on_host, return_lse=True)  # fmt: skip
        got, got_lse = results[True][:2]
        assert rel_error(got, want_out) < BOUND[dtype], name
        finite = np.isfinite(want_lse)
        assert (np.isfinite(got_lse) == finite).all(), name
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2, err_msg=name)
        for label, on, off in zip(("out", "lse", "dq", "dk", "dv"), results[True], results[False], strict=True):
            both = np.isfinite(off)
            assert (np.isfinite(on) == both).all(), (name, label)
            assert rel_error(on[both], off[both]) < 1e-2, (name, label)


@pytest.mark.parametrize("algorithm", ["auto", "fa2"])
def test_a_mask_mod_alone_skips_the_tiles_it_hides(algorithm):
    """The tiles a mask_mod's own classes hide are never loaded: chunked local attention (chunks
    of 512) over the first 4k of 8k keys, written as a mask_mod with no BlockMask, the other keys'
    V NaN. Unclassed (``_unclassed``) every key tile is loaded and 0 x NaN in the P.V product
    makes NaN rows; classed (index arithmetic decides those tiles hidden) the kernels skip them and
    give the result with finite V: the Hopper forward ("auto") by the summary the mask implies
    (_block_mask.implied), FA2's by that summary too. (The speed-up is bench-mods'.)"""
    torch = need_torch()
    n = 8192
    q, k, v = (torch.randn(1, n, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    poisoned = v.clone()
    poisoned[:, n // 2 :] = float("nan")

    def chunked(b, h, i, j):
        return (i // 512 == j // 512) & (j <= i) & (j < n // 2)

    unclassed = _unclassed(torch, chunked, n + 128, n + 128)
    want = cupyflash.attention(q, k, v, mask_mod=unclassed, algorithm=algorithm)
    assert torch.isfinite(want).all()
    assert torch.isnan(cupyflash.attention(q, k, poisoned, mask_mod=unclassed, algorithm=algorithm)).any()
    got = cupyflash.attention(q, k, poisoned, mask_mod=chunked, algorithm=algorithm)
    assert torch.isfinite(got).all()
    assert rel_error(reference.to_numpy64(got), reference.to_numpy64(want)) < 1e-2


def test_a_mask_mod_alone_in_a_cuda_graph():
    """A mask_mod whose summary is implied, in a CUDA graph: the warm-up call before the capture
    copies the summary to the GPU, the captured call reads it, and replays give the eager call's
    bits. (Inside a capture with no copy yet the call runs without it: tests/
    test_gpu_routes_stubbed.py.)"""
    torch = need_torch()
    n = 1000
    q, k, v = (torch.randn(2, n, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def chunked(b, h, i, j):  # (a chunk size no other test uses: a fresh implied summary)
        return (i // 192 == j // 192) & (j <= i)

    graph, out = capture(torch, lambda: cupyflash.attention(q, k, v, mask_mod=chunked))
    eager = cupyflash.attention(q, k, v, mask_mod=chunked)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_an_index_outside_a_captured_array_stays_nan_with_a_block_mask():
    """Where the mask reads outside its array the kernels make the score NaN; the summary calls
    such cells mixed (never hidden or plain), so the rows that reach them are NaN as without it."""
    torch = need_torch()
    q, k = (torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16) for n in (200, 200))
    short = torch.zeros(150, dtype=torch.int32, device="cuda")  # keys 150 .. 199 read past it

    def mask_mod(b, h, i, j):
        return (short[j] == 0) & (j <= i)

    bm = cupyflash.create_block_mask(mask_mod, None, None, 200, 200, BLOCK_SIZE=32)
    out = cupyflash.attention(q, k, k, block_mask=bm)
    alone = cupyflash.attention(q, k, k, mask_mod=mask_mod)
    reaching = torch.arange(200, device="cuda") >= 150
    assert torch.isnan(out[0, reaching]).all() and not torch.isnan(out[0, ~reaching]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(alone))


def test_a_block_mask_in_a_cuda_graph(rng):
    """Captured after a warm-up, replays read the summary in place (made on the GPU beforehand)."""
    torch = need_torch()
    n = 1000
    doc = torch.arange(n, device="cuda") // 200
    q, k, v = (torch.randn(2, n, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    bm = cupyflash.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, n, n, BLOCK_SIZE=64)
    graph, out = capture(torch, lambda: cupyflash.attention(q, k, v, block_mask=bm))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    want = cupyflash.attention(q, k, v, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    assert rel_error(reference.to_numpy64(out), reference.to_numpy64(want)) < BOUND["float16"]


def test_cupy_arrays_and_a_block_mask_of_another_library(rng):
    """CuPy inputs with a summary made in PyTorch on the same GPU (the kernels read it by address)."""
    torch = need_torch()
    cp = pytest.importorskip("cupy")
    q = cp.asarray(rng.standard_normal((1, 300, 4, 64)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((1, 300, 4, 64)).astype(np.float16))
    bm = cupyflash.create_block_mask(lambda b, h, i, j: (i // 50) == (j // 50), None, None, 300, 300,
                                     device="cuda", BLOCK_SIZE=32)  # fmt: skip
    assert type(bm.cells).__module__.split(".")[0] == "torch"
    torch.cuda.synchronize()
    out = cupyflash.attention(q, k, k, block_mask=bm)
    want = cupyflash.attention(q, k, k, mask_mod=lambda b, h, i, j: (i // 50) == (j // 50))
    assert rel_error(cp.asnumpy(out).astype(np.float64), cp.asnumpy(want).astype(np.float64)) < BOUND["float16"]
