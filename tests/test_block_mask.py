"""``create_block_mask`` / ``BlockMask`` on the host: the summary against one computed here from
the dense mask on a grid (causal, sliding window, document, prefix-LM, masks that read b and h;
odd lengths; cells of several sizes; B and H broadcast), its shown ranges against the cells, the
refusals (each names what is wrong), and attention / its backward with a block_mask equal to the
mask_mod alone. The kernels that read the summary: tests/test_gpu_block_mask.py (their compile
here)."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import BlockMask

NQ, NK = 197, 301
DOC = np.sort(np.random.default_rng(3).integers(0, 5, NK)).astype(np.int32)  # packed documents


def _masks():
    """(name, mask_mod, B, H): the gallery's masks, and two that read b and h."""
    return [
        ("causal", lambda b, h, i, j: j <= i + (NK - NQ), None, None),
        ("sliding", lambda b, h, i, j: (j <= i + 104) & (i + 104 - j < 70), None, None),
        ("document", lambda b, h, i, j: DOC[i] == DOC[j], None, None),
        ("document-causal", lambda b, h, i, j: (DOC[i] == DOC[j]) & (j <= i), 2, None),
        ("prefix-lm", lambda b, h, i, j: (j <= i) | (j < 40), None, 3),
        ("per-head", lambda b, h, i, j: (i - j) % (h + 2) == 0, None, 3),
        ("per-batch", lambda b, h, i, j: (j < 50 + 100 * b) & (i >= 17 * h), 2, 3),
        ("nothing", lambda b, h, i, j: i < 0, None, None),
        ("everything", lambda b, h, i, j: (i >= 0) | (j < 0), None, None),
    ]


def _dense(mask_mod, batch, heads, nq=NQ, nk=NK):
    b, h, i, j = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(nq), np.arange(nk), indexing="ij")
    return np.broadcast_to(mask_mod(b, h, i, j), b.shape)


def _reference_cells(dense, block):
    """Each cell of the dense mask: hidden (0) if it shows no key, plain (2) if it shows all, else mixed (1)."""
    batch, heads, nq, nk = dense.shape
    rows, keys = block
    out = np.empty((batch, heads, -(-nq // rows), -(-nk // keys)), np.uint8)
    for index in np.ndindex(out.shape):
        b, h, m, n = index
        cell = dense[b, h, m * rows : (m + 1) * rows, n * keys : (n + 1) * keys]
        out[index] = BlockMask.PLAIN if cell.all() else BlockMask.MIXED if cell.any() else BlockMask.HIDDEN
    return out


@pytest.mark.parametrize("block", [128, 64, 16, (32, 64), (256, 16)], ids=str)
def test_cells_are_the_dense_mask_s_summary(block):
    for name, mask_mod, batch, heads in _masks():
        bm = cupyflash.create_block_mask(mask_mod, batch, heads, NQ, NK, BLOCK_SIZE=block)
        sizes = block if isinstance(block, tuple) else (block, block)
        assert bm.BLOCK_SIZE == sizes and bm.shape == (batch, heads, NQ, NK) and bm.mask_mod is mask_mod
        want = _reference_cells(_dense(mask_mod, batch or 1, heads or 1), sizes)
        got = np.asarray(bm.cells)
        assert got.dtype == np.uint8, name
        reads_b, reads_h = name == "per-batch", name in ("per-head", "per-batch")
        # one slice for all where the mask does not read the argument
        assert got.shape[:2] == ((batch or 1) if reads_b else 1, (heads or 1) if reads_h else 1), name
        np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want, err_msg=name)
        hidden = (want == BlockMask.HIDDEN).mean() * 100
        assert bm.sparsity() == pytest.approx(hidden if got.shape == want.shape else (got == 0).mean() * 100)


@pytest.mark.parametrize("block", [128, 32, (16, 256)], ids=str)
def test_shown_ranges_bound_every_shown_cell(block):
    """Per 128 rows, the keys [first, end) of its shown cells (and per 128 keys, the rows): every
    shown (row, key) lies inside, and the bounds are the tightest the cells give."""
    from cupyflash import _block_mask, xp_impl

    for name, mask_mod, batch, heads in _masks():
        bm = cupyflash.create_block_mask(mask_mod, batch, heads, NQ, NK, BLOCK_SIZE=block)
        rows, keys = bm.BLOCK_SIZE
        padded = np.asarray(bm._cells)
        key_ranges, row_ranges = (np.asarray(r) for r in bm._ranges)
        assert padded.shape[2] * rows % 128 == 0 and padded.shape[3] * keys % 128 == 0, name  # whole range blocks
        assert key_ranges.shape == (*padded.shape[:2], padded.shape[2] * rows // 128, 2), name
        assert row_ranges.shape == (*padded.shape[:2], padded.shape[3] * keys // 128, 2), name
        shown = np.isin(padded, (BlockMask.MIXED, BlockMask.PLAIN))
        cell_rows = np.repeat(shown, rows, axis=2)
        cell_keys = np.repeat(shown, keys, axis=3)
        for index in np.ndindex(key_ranges.shape[:3]):
            b, h, r = index
            cols = np.flatnonzero(cell_rows[b, h, 128 * r : 128 * (r + 1)].any(axis=0)) * keys
            want = (cols.min(), cols.max() + keys) if cols.size else (0, 0)
            assert tuple(key_ranges[index]) == want, (name, index)
        for index in np.ndindex(row_ranges.shape[:3]):
            b, h, c = index
            lines = np.flatnonzero(cell_keys[b, h, :, 128 * c : 128 * (c + 1)].any(axis=1)) * rows
            want = (lines.min(), lines.max() + rows) if lines.size else (0, 0)
            assert tuple(row_ranges[index]) == want, (name, index)
        assert _block_mask.layout(bm) == _block_mask.layout(bm)  # hashable, a plan key
        assert xp_impl.MASK_RANGE_BLOCK == 128


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict", "torch"])
def test_other_namespaces(namespace):
    """A mask capturing an array of another namespace is summarised in it, as the host path runs it."""
    xp = pytest.importorskip(namespace)
    doc = xp.asarray(DOC)
    bm = cupyflash.create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), None, None, NQ, NK,
                                     BLOCK_SIZE=32)  # fmt: skip
    want = _reference_cells(_dense(lambda b, h, i, j: (DOC[i] == DOC[j]) & (j <= i), 1, 1), (32, 32))
    np.testing.assert_array_equal(np.from_dlpack(bm.cells), want)


def _qkv(rng, batch=2, hq=6, hkv=3, d=16, nq=NQ, nk=NK):
    return (rng.standard_normal((batch, nq, hq, d)), rng.standard_normal((batch, nk, hkv, d)),
            rng.standard_normal((batch, nk, hkv, d)))  # fmt: skip


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (60, 5)}], ids=str)
def test_attention_with_a_block_mask_equals_the_mask_mod_alone(options):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    dout = rng.standard_normal(q.shape)
    bias = rng.standard_normal((6, NK))

    def score_mod(s, b, h, i, j):
        return s * 0.7 + bias[h, j]

    for name, mask_mod, batch, heads in _masks():
        heads = None if heads is None else 6
        bm = cupyflash.create_block_mask(mask_mod, batch, heads, NQ, NK, BLOCK_SIZE=64)
        for score in (None, score_mod):
            want, want_lse = cupyflash.attention(
                q, k, v, score_mod=score, mask_mod=mask_mod, return_lse=True, **options
            )
            out, lse = cupyflash.attention(q, k, v, score_mod=score, block_mask=bm, return_lse=True, **options)
            np.testing.assert_array_equal(out, want, err_msg=name)
            np.testing.assert_array_equal(lse, want_lse, err_msg=name)
            both = cupyflash.attention(q, k, v, score_mod=score, mask_mod=mask_mod, block_mask=bm, **options)
            np.testing.assert_array_equal(both, want, err_msg=name)  # the same function beside it: allowed
            grads = cupyflash.attention_backward(dout, q, k, v, out, lse, score_mod=score, block_mask=bm, **options)
            want_grads = cupyflash.attention_backward(dout, q, k, v, want, want_lse, score_mod=score,
                                                      mask_mod=mask_mod, **options)  # fmt: skip
            for g, w in zip(grads, want_grads, strict=True):
                np.testing.assert_array_equal(g, w, err_msg=name)
        if name == "nothing":  # rows that see no key: 0, LSE -inf, as the mask_mod's
            assert (out == 0).all() and np.isneginf(lse).all()


def test_torch_autograd_on_the_host_with_a_block_mask():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, generator=gen) for n in (NQ, NK, NK))
    doc = torch.from_numpy(DOC)

    def mask_mod(b, h, i, j):
        return (doc[i] == doc[j]) & (j <= i + 104)

    bm = cupyflash.create_block_mask(mask_mod, None, None, NQ, NK, BLOCK_SIZE=32)
    results = []
    for kwargs in ({"mask_mod": mask_mod}, {"block_mask": bm}):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = cupyflash.attention(*leaves, **kwargs)
        out.square().sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((lambda b, h, i, j: j <= i + b, None, None, 8, 8), {}, "reads b.*give B"),
        ((lambda b, h, i, j: j <= i + h, 2, None, 8, 8), {}, "reads h.*give H"),
        ((lambda b, h, i, j: j <= i, None, None, 8, 8), {"BLOCK_SIZE": 96}, "BLOCK_SIZE must be a power of two"),
        ((lambda b, h, i, j: j <= i, None, None, 8, 8), {"BLOCK_SIZE": 8}, "BLOCK_SIZE must be a power of two"),
        ((lambda b, h, i, j: j <= i, None, None, 8, 8), {"BLOCK_SIZE": (64, 64, 64)}, "BLOCK_SIZE"),
        ((lambda b, h, i, j: j <= i, None, None, 0, 8), {}, "Q_LEN must be a positive int"),
        ((lambda b, h, i, j: j <= i, None, None, 8, 2.0), {}, "KV_LEN must be a positive int"),
        ((lambda b, h, i, j: j <= i, 0, None, 8, 8), {}, "B must be a positive int or None"),
        ((lambda b, h, i, j: j <= i, None, None, 8, 8), {"device": "tpu"}, "device must be"),
        ((lambda b, h, i, j: i + j, None, None, 8, 8), {}, "mask_mod must return a boolean"),
        ((lambda b, h, i, j: bool(i < j), None, None, 8, 8), {}, "Python control flow"),
    ],
)
def test_create_refuses(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cupyflash.create_block_mask(*args, **kwargs)


def test_a_call_of_other_shapes_is_refused_naming_the_mismatch():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, batch=2, hq=6, hkv=3)
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    per_batch = lambda b, h, i, j: j <= i + b  # noqa: E731
    cases = [
        (cupyflash.create_block_mask(causal, None, None, NQ + 1, NK), "Q_LEN=198, KV_LEN=301; this call has 197"),
        (cupyflash.create_block_mask(causal, None, None, NQ, NK - 1), "KV_LEN=300"),
        (cupyflash.create_block_mask(causal, 3, None, NQ, NK), "made for B=3; this call has 2 batch entries"),
        (cupyflash.create_block_mask(causal, None, 4, NQ, NK), "made for H=4; this call has 6 query heads"),
        (cupyflash.create_block_mask(per_batch, 1, None, NQ, NK), "B=1.*reads b"),
    ]
    for bm, match in cases:
        with pytest.raises(ValueError, match=match):
            cupyflash.attention(q, k, v, block_mask=bm)
        out, lse = cupyflash.attention(q[:1, :1], k[:1, :1], v[:1, :1], return_lse=True)
        with pytest.raises(ValueError, match=match):
            cupyflash.attention_backward(q, q, k, v, q, np.zeros((2, 6, NQ)), block_mask=bm)
    # broadcast: None, or 1 for a mask that does not read the argument
    for batch, heads in ((None, None), (1, 1), (2, 6), (1, None)):
        bm = cupyflash.create_block_mask(causal, batch, heads, NQ, NK)
        np.testing.assert_array_equal(cupyflash.attention(q, k, v, block_mask=bm),
                                      cupyflash.attention(q, k, v, mask_mod=causal))  # fmt: skip


def test_a_different_mask_mod_beside_the_block_mask_is_refused():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, nq=64, nk=64)
    doc, other = np.zeros(64, np.int32), np.zeros(64, np.int32)
    bm = cupyflash.create_block_mask(lambda b, h, i, j: doc[i] == doc[j], None, None, 64, 64)
    with pytest.raises(ValueError, match="not the block_mask's mask_mod"):
        cupyflash.attention(q, k, v, block_mask=bm, mask_mod=lambda b, h, i, j: j <= i)
    with pytest.raises(ValueError, match="other captured arrays"):  # the same expression over another array
        cupyflash.attention(q, k, v, block_mask=bm, mask_mod=lambda b, h, i, j: other[i] == other[j])
    with pytest.raises(ValueError, match="not the block_mask's mask_mod"):
        cupyflash.attention_backward(
            q, q, k, v, q, np.zeros((2, 6, 64)), block_mask=bm, mask_mod=lambda b, h, i, j: i < j
        )
    with pytest.raises(TypeError, match="block_mask must be a cupyflash.BlockMask"):
        cupyflash.attention(q, k, v, block_mask=np.ones((64, 64), bool))
    with pytest.raises(ValueError, match="do not take attn_mask"):
        cupyflash.attention(q, k, v, block_mask=bm, attn_mask=np.ones((64, 64), bool))


def test_a_host_array_out_of_range_is_refused_as_the_host_path_refuses_it():
    short = np.zeros(10, np.int32)
    with pytest.raises(IndexError, match="outside the array"):
        cupyflash.create_block_mask(lambda b, h, i, j: short[i] == short[j], None, None, 20, 20)


# -- the summary kernel, compiled (run by tests/test_gpu_block_mask.py) ---------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_summary_kernel_compiles_cleanly(arch):
    pytest.importorskip("cupy")
    from cupyflash import _kernels, _mods, _specs

    bias, doc = np.zeros((8, 40), np.float32), np.zeros(40, np.int32)
    for mask_mod in (lambda b, h, i, j: (doc[i] == doc[j]) & (bias[h, j] > 0), lambda b, h, i, j: j <= i):
        spec = _specs.BlockMaskCellsSpec(_mods.kernel_mods(None, _mods.trace_mask_mod(mask_mod)).source)
        build = _kernels.compile_offline(spec, arch)
        assert not build.spill_bytes and not build.warnings, spec.name
