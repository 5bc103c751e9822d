"""``score_mod`` / ``mask_mod`` (FlexAttention's meaning) on the host path, and their trace.

The gallery (causal, sliding window, prefix-LM, document masking over packed sequences,
chunked local attention, ALiBi, softcap, a relative-position bias table) against a float64
reference written here in NumPy, and against the built-in options where one exists; the
refusals of what cannot be traced; the key; the device functions compiled by NVRTC.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import cupyflash
from cupyflash import _mods, mods
from cupyflash._specs import HOPPER_SMEM_PER_BLOCK

B, NQ, NK, HQ, HKV, D = 2, 37, 45, 4, 2, 16
SHIFT = NK - NQ  # bottom-right alignment of the built-in masks


@pytest.fixture(scope="module")
def qkv() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((B, NQ, HQ, D)),
        rng.standard_normal((B, NK, HKV, D)),
        rng.standard_normal((B, NK, HKV, D)),
    )


def reference(q, k, v, score=None, visible=None):
    """float64 ``softmax(score(scale q k^T) masked by visible) v``: score and visible take and
    return / give (B, Hq, Nq, Nk) arrays from index grids; empty rows give 0 and LSE -inf."""
    group = HQ // HKV
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    b, h, i, j = np.meshgrid(np.arange(B), np.arange(HQ), np.arange(NQ), np.arange(NK), indexing="ij")
    if score is not None:
        s = np.broadcast_to(score(s, b, h, i, j), s.shape).astype(np.float64)
    if visible is not None:
        s = np.where(visible(b, h, i, j), s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):
        lse = np.log(total[..., 0]) + m[..., 0]
    return out, lse


def check(q, k, v, ref_score=None, ref_visible=None, **kwargs):
    out, lse = cupyflash.attention(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = reference(q, k, v, ref_score, ref_visible)
    np.testing.assert_allclose(out, ref_out, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
    return out, lse


# -- the gallery --------------------------------------------------------------------------------
def test_causal_as_mask_mod(qkv):
    out, lse = check(*qkv, ref_visible=lambda b, h, i, j: j <= i + SHIFT, mask_mod=lambda b, h, q, kv: kv <= q + SHIFT)
    built_in, built_in_lse = cupyflash.attention(*qkv, causal=True, return_lse=True)
    np.testing.assert_allclose(out, built_in, atol=1e-12)
    np.testing.assert_allclose(lse, built_in_lse, atol=1e-12)


def test_sliding_window_as_mask_mod(qkv):
    left, right = 6, 3

    def window(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx + SHIFT - left) & (kv_idx <= q_idx + SHIFT + right)

    out = check(
        *qkv, ref_visible=lambda b, h, i, j: (j >= i + SHIFT - left) & (j <= i + SHIFT + right), mask_mod=window
    )
    np.testing.assert_allclose(out[0], cupyflash.attention(*qkv, window=(left, right)), atol=1e-12)


def test_prefix_lm(qkv):
    prefix = 10

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    check(*qkv, ref_visible=lambda b, h, i, j: (j < prefix) | (j <= i), mask_mod=prefix_lm)


def test_document_masking_over_packed_sequences():
    rng = np.random.default_rng(1)
    n = 50
    doc_id = np.repeat(np.arange(4, dtype=np.int32), [12, 20, 1, 17])
    q = rng.standard_normal((1, n, 2, 8))
    k, v = (rng.standard_normal((1, n, 1, 8)) for _ in range(2))

    def document_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)

    out = cupyflash.attention(q, k, v, mask_mod=document_causal)
    starts = np.r_[0, np.cumsum([12, 20, 1, 17])]
    for s0, s1 in zip(starts[:-1], starts[1:]):  # each document alone, causal
        alone = cupyflash.attention(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], causal=True)
        np.testing.assert_allclose(out[:, s0:s1], alone, atol=1e-12)


def test_chunked_local_attention(qkv):
    chunk = 8

    def chunked(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (kv_idx <= q_idx)

    # rows whose chunk starts past every key they may see have none: output 0, LSE -inf
    check(*qkv, ref_visible=lambda b, h, i, j: (i // chunk == j // chunk) & (j <= i), mask_mod=chunked)


def test_alibi_as_score_mod(qkv):
    slopes = 2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * mods.abs(q_idx + SHIFT - kv_idx)

    out = check(*qkv, ref_score=lambda s, b, h, i, j: s - slopes[h] * np.abs(i + SHIFT - j), score_mod=alibi)[0]
    np.testing.assert_allclose(out, cupyflash.attention(*qkv, alibi_slopes=slopes), atol=1e-12)


def test_softcap_as_score_mod(qkv):
    cap = 0.5

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * mods.tanh(score / cap)

    out = check(*qkv, ref_score=lambda s, *_: cap * np.tanh(s / cap), score_mod=softcap, causal=True,
                ref_visible=lambda b, h, i, j: j <= i + SHIFT)[0]  # fmt: skip
    np.testing.assert_allclose(out, cupyflash.attention(*qkv, softcap=cap, causal=True), atol=1e-12)


def test_relative_position_bias_table(qkv):
    rng = np.random.default_rng(2)
    table = rng.standard_normal((HQ, NQ + NK))  # one bias per head and distance
    offset = NQ

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx - q_idx + offset]

    check(*qkv, ref_score=lambda s, b, h, i, j: s + table[h, j - i + offset], score_mod=relative)


def test_score_and_mask_together_with_where_and_minimum(qkv):
    def score(score, b, h, q_idx, kv_idx):
        return mods.where(h % 2 == 0, mods.minimum(score, 0.25), mods.exp(score) - 1)

    check(
        *qkv, ref_score=lambda s, b, h, i, j: np.where(h % 2 == 0, np.minimum(s, 0.25), np.exp(s) - 1),
        ref_visible=lambda b, h, i, j: ~((b == 1) & (j > 20)),
        score_mod=score, mask_mod=lambda b, h, q, kv: ~((b == 1) & (kv > 20)),
    )  # fmt: skip


@pytest.mark.parametrize("algorithm", ("naive", "fa1", "decode"))
def test_every_host_algorithm(qkv, algorithm):
    chunk = 8
    q, k, v = (x[..., :16] if algorithm == "fa1" else x for x in qkv)

    def chunked(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) | (kv_idx < 3)

    out = cupyflash.attention(q, k, v, mask_mod=chunked, score_mod=lambda s, b, h, i, j: s * 2, algorithm=algorithm)
    ref = cupyflash.attention(q, k, v, mask_mod=chunked, score_mod=lambda s, b, h, i, j: s * 2)
    np.testing.assert_allclose(out, ref, atol=1e-12)


def test_other_namespaces():
    torch = pytest.importorskip("torch")
    xp = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 9, 2, 8)).astype(np.float32) for _ in range(3))
    doc_id = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2])

    def document(b, h, q_idx, kv_idx):
        return doc_id[q_idx] == doc_id[kv_idx]

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.5 * (q_idx - kv_idx)

    expected = cupyflash.attention(q, k, v, mask_mod=document, score_mod=bias)
    on_torch = cupyflash.attention(*(torch.from_numpy(x) for x in (q, k, v)), mask_mod=document, score_mod=bias)
    strict = cupyflash.attention(*(xp.asarray(x) for x in (q, k, v)), mask_mod=document, score_mod=bias)
    np.testing.assert_allclose(on_torch.numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(strict), expected, atol=1e-5)


def test_globals_defaults_and_unassigned_cells(qkv):
    def make():
        def mask(b, h, q_idx, kv_idx, ids=GLOBAL_IDS[:NK]):
            return (GLOBAL_IDS[q_idx] == ids[kv_idx]) | later(kv_idx)

        def later(kv_idx):
            return kv_idx < 2

        return mask

    check(*qkv, ref_visible=lambda b, h, i, j: (GLOBAL_IDS[i] == GLOBAL_IDS[j]) | (j < 2), mask_mod=make())


GLOBAL_IDS = np.arange(NK) // 10


def test_functions_calling_functions_trace_their_arrays(qkv):
    """Masks built from masks: the arrays each one captures (in a closure, a global, a default or
    and_masks' tuple, several levels down) are traced through the function given; and_masks /
    or_masks give the expression written inline (one kernel for both), and the score functions'
    arrays too."""
    rng = np.random.default_rng(9)
    doc_q, doc_k = (np.sort(rng.integers(0, 4, n)) for n in (NQ, NK))
    bias = rng.standard_normal(NK)

    def document(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_k[kv_idx]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + SHIFT

    def window(width):
        return lambda b, h, q_idx, kv_idx: q_idx + SHIFT - kv_idx < width

    combined = mods.or_masks(mods.and_masks(causal, document), window(5))
    wrapped = lambda b, h, i, j: combined(b, h, i, j) & (bias[j] < 1.5)  # noqa: E731
    visible = lambda b, h, i, j: (((j <= i + SHIFT) & (doc_q[i] == doc_k[j])) | (i + SHIFT - j < 5)) & (bias[j] < 1.5)  # noqa: E731
    check(*qkv, ref_visible=visible, mask_mod=wrapped)
    inline = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx + SHIFT) & (doc_q[q_idx] == doc_k[kv_idx])  # noqa: E731
    assert _mods.trace_mask_mod(mods.and_masks(causal, document)).key == _mods.trace_mask_mod(inline).key
    traced = _mods.trace_mask_mod(wrapped)
    assert len(traced.buffers) == 3  # doc_q, doc_k (inside and_masks, inside or_masks), bias
    # every array the trace reads, as deep as it goes, has a place in reads() (torch.compile reads it there)
    deep = mods.and_masks(mods.or_masks(mods.and_masks(document, causal)))  # document: three functions down
    places = [value for _, value in _mods.reads(deep)]
    assert all(any(x is buffer for x in places) for buffer in _mods.trace_mask_mod(deep).buffers)

    def scaled(score, b, h, q_idx, kv_idx):
        return score + shift(kv_idx)

    def shift(kv_idx):
        return 0.5 * bias[kv_idx]

    check(*qkv, ref_score=lambda s, b, h, i, j: s + 0.5 * bias[j], score_mod=scaled)
    check(*qkv, ref_visible=lambda b, h, i, j: np.ones_like(i, bool), mask_mod=mods.and_masks())
    with pytest.raises(TypeError, match="and_masks takes mask_mod functions, got a int at position 1"):
        mods.and_masks(causal, 3)


def test_the_mods_functions_on_arrays():
    x = np.array([-1.0, 0.5, 2.0])
    np.testing.assert_array_equal(mods.where(x > 0, x, 0.0), [0.0, 0.5, 2.0])
    np.testing.assert_array_equal(mods.maximum(x, np.zeros(3)), [0.0, 0.5, 2.0])
    np.testing.assert_allclose(mods.tanh(x), np.tanh(x))


# -- refusals ------------------------------------------------------------------------------------
def _if(score, b, h, q_idx, kv_idx):
    if q_idx > kv_idx:
        return score
    return score - 1


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (_if, r"score_mod uses `if`.*cupyflash\.mods\.where"),
        (lambda s, b, h, q, kv: s * int(q), r"uses int\(\)"),
        (lambda s, b, h, q, kv: s * float(q), r"uses float\(\)"),
        (lambda s, b, h, q, kv: s if bool(q < kv) else s, r"uses `if`"),
        (lambda s, b, h, q, kv: np.exp(s), r"uses a NumPy function"),
        (lambda s, b, h, q, kv: math.exp(s), r"uses float\(\)"),
        (lambda s, b, h, q, kv: s ** 2, r"uses `\*\*`"),
        (lambda s, b, h, q, kv: s + "x", r"uses `\+` with a str"),
        (lambda s, b, h, q, kv: q < kv, r"must return a score"),
    ],
)  # fmt: skip
def test_untraceable_score_mods_are_refused(qkv, fn, match):
    with pytest.raises(TypeError, match=match):
        cupyflash.attention(*qkv, score_mod=fn)


def test_untraceable_mask_mods_are_refused(qkv):
    with pytest.raises(TypeError, match="mask_mod uses `if`"):
        cupyflash.attention(*qkv, mask_mod=lambda b, h, q, kv: q > kv and kv > 2)
    with pytest.raises(TypeError, match="mask_mod must return a boolean"):
        cupyflash.attention(*qkv, mask_mod=lambda b, h, q, kv: q - kv)
    with pytest.raises(TypeError, match="logical"):
        cupyflash.attention(*qkv, mask_mod=lambda b, h, q, kv: q & kv)
    ids = np.zeros(NQ, dtype=np.int32)
    with pytest.raises(TypeError, match="1-D array 'ids' with 2 indexes"):
        cupyflash.attention(*qkv, mask_mod=lambda b, h, q, kv: ids[q, kv] == 0)


def test_reads_outside_a_captured_array_are_refused(qkv):
    short = np.zeros(NQ, dtype=np.int32)  # NQ entries, indexed by keys (NK > NQ)
    with pytest.raises(IndexError, match="outside the array"):
        cupyflash.attention(*qkv, mask_mod=lambda b, h, q, kv: short[kv] == 0)


def test_autograd_matches_torch_autograd_of_the_formula():
    """Tensors that require grad get the gradients of the score function's formula (dS times its
    derivative, a hidden score none), the sinks' included."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 4, 8, generator=gen, dtype=torch.float64) for n in (6, 9, 9))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = cupyflash.attention(
        *leaves[:3], score_mod=lambda s, b, h, i, j: 3.0 * mods.tanh(s / 3.0) - 0.1 * mods.abs(i - j),
        mask_mod=lambda b, h, i, j: (j % 4) != 1, sinks=leaves[3], return_lse=True,
    )  # fmt: skip
    (out.square().sum() + lse.sum()).backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    s = torch.einsum("bihd,bjhd->bhij", ref[0], ref[1]) / 8**0.5
    i, j = torch.arange(6)[:, None], torch.arange(9)[None, :]
    s = (3.0 * torch.tanh(s / 3.0) - 0.1 * (i - j).abs()).masked_fill(j % 4 == 1, float("-inf"))
    s = torch.cat([s, ref[3][None, :, None, None].expand(2, 4, 6, 1)], -1)
    want = torch.einsum("bhij,bjhd->bihd", s.softmax(-1)[..., :-1], ref[2])
    (want.square().sum() + torch.logsumexp(s, -1).sum()).backward()
    for got, r in zip(leaves, ref, strict=True):
        torch.testing.assert_close(got.grad, r.grad)


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": (3, 1), "softcap": 4.0}, {"sinks": True}, {"alibi": True}, {"mask": True}],
    ids=lambda o: "-".join(o) or "plain",
)
def test_captured_tensors_get_their_gradients(options):
    """A learned relative-position bias table, a per-head temperature and a table read through a
    function of it (tanh), GQA, odd lengths: every tensor that requires grad, the captured ones
    included, gets what torch autograd gives the formula, with the forward's other options
    (causal, window, softcap before the function, sinks, ALiBi, a mask_mod beside it)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(5)
    hq, nq, nk = 4, 7, 10
    q, k, v = (torch.randn(2, n, h, 8, generator=gen, dtype=torch.float64) for n, h in ((nq, hq), (nk, 2), (nk, 2)))
    table = 0.3 * torch.randn(hq, nq + nk, generator=gen, dtype=torch.float64)
    temperature = 1 + 0.2 * torch.randn(hq, generator=gen, dtype=torch.float64)
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) if options.get("sinks") else None
    slopes = torch.rand(hq, generator=gen, dtype=torch.float64) if options.get("alibi") else None
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2, 2])[:nk]  # keys' documents, read by the mask

    def run(table, temperature, q, k, v):
        def score_mod(s, b, h, i, j):
            return s * temperature[h] + table[h, j - i + nq] + 0.5 * mods.tanh(table[h, i])

        return cupyflash.attention(
            q, k, v, score_mod=score_mod, causal=options.get("causal", False), window=options.get("window", (-1, -1)),
            softcap=options.get("softcap", 0.0), sinks=sinks, alibi_slopes=slopes, return_lse=True,
            mask_mod=(lambda b, h, i, j: doc[j] != 1) if options.get("mask") else None,
        )  # fmt: skip

    leaves = [x.clone().requires_grad_() for x in (table, temperature, q, k, v)]
    out, lse = run(*leaves)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ((out * weights).sum() + lse.sum()).backward()

    ref = [x.clone().requires_grad_() for x in (table, temperature, q, k, v)]
    rt, rtemp, rq, rk, rv = ref
    s = torch.einsum("bihd,bjhd->bhij", rq, rk.repeat_interleave(2, 2)) / 8**0.5
    if options.get("softcap"):
        s = options["softcap"] * torch.tanh(s / options["softcap"])
    h, i, j = torch.arange(hq)[:, None, None], torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    if slopes is not None:  # ALiBi before the function, bottom-right aligned
        s = s - slopes[:, None, None] * (i + nk - nq - j).abs()
    s = s * rtemp[h] + rt[h, j - i + nq] + 0.5 * torch.tanh(rt[h, i])
    hidden = torch.zeros(nq, nk, dtype=torch.bool)
    if options.get("causal"):
        hidden |= j > i + nk - nq
    if options.get("window"):
        left, right = options["window"]
        hidden |= (j < i + nk - nq - left) | (j > i + nk - nq + right)
    if options.get("mask"):
        hidden = hidden | (doc[None, :] == 1)
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(2, hq, nq, 1)], -1)
    p = s.softmax(-1).nan_to_num(0.0)[..., :nk]
    want = torch.einsum("bhij,bjhd->bihd", p, rv.repeat_interleave(2, 2))
    torch.testing.assert_close(out, want)
    ((want * weights).sum() + torch.logsumexp(s, -1).sum()).backward()
    for name, got, r in zip(("table", "temperature", "q", "k", "v"), leaves, ref, strict=True):
        torch.testing.assert_close(got.grad, r.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict"])
def test_captured_gradients_on_the_array_api_path(namespace):
    """xp_impl's gradients of score_mod's captured arrays in NumPy and in the strict namespace
    (whose scatter is a sort and a running sum), causal, GQA, against central differences of the
    forward; an integer array read beside the table gets none."""
    from cupyflash import xp_impl
    from cupyflash._validate import attention_problem

    xp = pytest.importorskip(namespace)
    rng = np.random.default_rng(7)
    q, k, v = (xp.asarray(rng.standard_normal(s)) for s in ((1, 5, 2, 4), (1, 6, 1, 4), (1, 6, 1, 4)))
    weights = xp.asarray(rng.standard_normal((1, 5, 2, 4)))
    table = 0.5 * rng.standard_normal((2, 11))
    ids = np.array([0, 2, 1, 0, 2, 1])
    p = attention_problem(q.shape, k.shape, v.shape, causal=True, scale=None, window=(-1, -1), softcap=0.0,
                          layout="bshd")  # fmt: skip
    traced = _mods.trace_score_mod(lambda s, b, h, i, j: s + table[h, j - i + 5] * mods.exp(0.1 * ids[j]))

    def on(values):
        return _mods.Mod(traced.role, traced.expr, (xp.asarray(values), xp.asarray(ids)))

    def loss(values):
        out, _ = xp_impl.attention(xp, q, k, v, p, score_mod=on(values))
        return float(xp.sum(out * weights))

    out, lse = xp_impl.attention(xp, q, k, v, p, score_mod=on(table))
    *_, (dtable, dids) = xp_impl.attention_backward(xp, weights, q, k, v, out, lse, p, score_mod=on(table),
                                                    captured_grads=True)  # fmt: skip
    assert dids is None
    step, numeric = 1e-6, np.zeros_like(table)
    for index in np.ndindex(table.shape):
        up, down = table.copy(), table.copy()
        up[index] += step
        down[index] -= step
        numeric[index] = (loss(up) - loss(down)) / (2 * step)
    np.testing.assert_allclose(np.asarray(dtable), numeric, atol=1e-7)


def test_explicit_backward_returns_captured_gradients():
    """attention_backward(captured_grads=True): the gradients of score_mod's captured arrays as a
    last result (None for an integer one), equal to torch autograd's through the forward, with
    sinks and a mask_mod beside them; refused without a score_mod."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, n, h, 8, generator=gen, dtype=torch.float64) for n, h in ((7, 4), (10, 2), (10, 2)))
    table = 0.3 * torch.randn(4, 17, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])

    def call(table):
        def score_mod(s, b, h, i, j):
            return s + table[h, j - i + 7] * mods.exp(0.1 * ids[j])

        return score_mod, (lambda b, h, i, j: ids[j] != 2)

    leaf = table.clone().requires_grad_()
    score_mod, mask_mod = call(leaf)
    out, lse = cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, return_lse=True)
    dout, dlse = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in (out, lse))
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    score_mod, mask_mod = call(table)
    *grads, dsinks, (dtable, dids) = cupyflash.attention_backward(
        dout, q, k, v, out.detach(), lse.detach(), dlse=dlse, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
        captured_grads=True,
    )  # fmt: skip
    assert dids is None and len(grads) == 3 and dsinks.shape == (4,)
    torch.testing.assert_close(dtable, leaf.grad)
    with pytest.raises(ValueError, match="captured_grads=True needs a score_mod"):
        cupyflash.attention_backward(dout, q, k, v, out.detach(), lse.detach(), mask_mod=mask_mod, captured_grads=True)


def test_a_captured_tensor_alone_that_requires_grad_takes_autograds_route():
    """q, k and v that do not require grad, a captured table that does: the table gets its
    gradient (the call goes through autograd for it); under no_grad nothing does."""
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 5, 2, 8, dtype=torch.float64)
    table = torch.zeros(2, 5, dtype=torch.float64, requires_grad=True)
    out = cupyflash.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + table[h, j])
    assert out.requires_grad
    out.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    with torch.no_grad():
        assert not cupyflash.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + table[h, j]).requires_grad


def test_a_mask_mods_captured_tensor_that_requires_grad_and_attn_mask_are_refused():
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 5, 2, 8, requires_grad=True)
    doc = torch.zeros(5, requires_grad=True)
    with pytest.raises(NotImplementedError, match="mask_mod's captured tensor gets no gradient"):
        cupyflash.attention(q, q, q, mask_mod=lambda b, h, i, j: doc[j] == doc[i])
    with pytest.raises(ValueError, match="write the mask as a mask_mod"):
        cupyflash.attention(q.detach(), q.detach(), q.detach(), mask_mod=lambda b, h, i, j: j <= i,
                            attn_mask=torch.ones(5, 5, dtype=torch.bool))  # fmt: skip


# -- the key -------------------------------------------------------------------------------------
def test_the_same_expression_shares_a_key():
    doc_a, doc_b = np.arange(10, dtype=np.int32), np.ones(10, dtype=np.int32)

    def first(b, h, q_idx, kv_idx):
        return doc_a[q_idx] == doc_a[kv_idx]

    def second(batch, head, row, key):  # other names, other array of the same shape and dtype
        return doc_b[row] == doc_b[key]

    a, b = _mods.trace_mask_mod(first), _mods.trace_mask_mod(second)
    assert a.key == b.key and hash(a.key) == hash(b.key) and a.name == b.name
    assert a.buffers[0] is doc_a and b.buffers[0] is doc_b
    wider = np.arange(11, dtype=np.int32)
    assert _mods.trace_mask_mod(lambda b, h, q, kv: wider[q] == wider[kv]).key != a.key  # shape
    as_int64 = doc_a.astype(np.int64)
    assert _mods.trace_mask_mod(lambda b, h, q, kv: as_int64[q] == as_int64[kv]).key != a.key  # dtype


def test_different_constants_differ():
    def cap(c):
        return _mods.trace_score_mod(lambda s, b, h, q, kv: c * mods.tanh(s / c))

    assert cap(30.0).key == cap(30.0).key
    assert cap(30.0).key != cap(50.0).key
    assert cap(30).key != cap(30.0).key  # an int constant is not a float one


# -- CUDA C --------------------------------------------------------------------------------------
def _gallery() -> list[_mods.Mod]:
    doc_id = np.zeros(64, dtype=np.int32)
    table = np.zeros((4, 128), dtype=np.float32)
    return [
        _mods.trace_mask_mod(lambda b, h, q, kv: (doc_id[q] == doc_id[kv]) & ~(kv > q)),
        _mods.trace_mask_mod(lambda b, h, q, kv: (q // 8 == kv // 8) | (kv % 3 == 0)),
        _mods.trace_score_mod(lambda s, b, h, q, kv: s + table[h, kv - q + 64] - 0.5 * mods.abs(q - kv)),
        _mods.trace_score_mod(
            lambda s, b, h, q, kv: mods.where(q >= kv, 30.0 * mods.tanh(s / 30.0), mods.log(mods.exp(s) + 1) / 2)
        ),
        _mods.trace_score_mod(lambda s, b, h, q, kv: mods.maximum(mods.minimum(s, 5), -math.inf) + (s // 2) % 1.5),
    ]


def test_cuda_source_is_deterministic():
    first, second = (_mods.cuda_source(m) for m in _gallery()[:3]), (_mods.cuda_source(m) for m in _gallery()[:3])
    assert list(first) == list(second)
    text = _mods.cuda_source(_gallery()[0])
    assert text.startswith("struct cf_mask_mod_") and "__device__ __forceinline__ bool cf_mask_mod_" in text
    assert "const int* __restrict__ buf0, " in text and "buf0_stride0" not in text  # 1-D: unit stride


def test_what_depends_on_b_and_h_alone_is_computed_per_tile():
    """The head function computes a per-head read (ALiBi's slope) and what follows from it
    alone, the per-score function reads it from the state; integers that fit in 32 bits are
    computed in 32 (q_idx - kv_idx of two indices), a division by a constant is a multiply, tanh
    the MUFU op."""
    slopes = np.linspace(0.1, 1.0, 8).astype(np.float32)
    mod = _mods.trace_score_mod(lambda s, b, h, q, kv: 30 * mods.tanh(s / 30) - 2 * slopes[h] * mods.abs(q - kv))
    text = _mods.cuda_source(mod)
    head, per_score = text.split("__device__ __forceinline__ float ")
    head = head.split("_row_part(")[0]
    assert "buf0[h]" in head and "st.outside |= !in" in head and "2 * st.t" not in head
    assert "buf0[" not in per_score and "st.t" in per_score
    assert "outside |= r.outside || k.outside;" in per_score and "r.outside = st.outside;" in text
    assert "const int t" in per_score and "abs(" in per_score and "llabs" not in per_score
    assert "long long t" not in per_score and "(long long)" not in per_score
    assert "/ 30" not in per_score and "fast_tanh(" in per_score


def test_what_depends_on_one_index_alone_is_computed_per_row_and_per_key():
    """A document mask's two reads: doc[q_idx] in the row function (once per row of a thread's
    fragment), doc[kv_idx] in the key function (once per key), the per-score function compares
    them and reads nothing; a read whose index takes both (a relative-position table) stays per
    score."""
    doc = np.arange(64, dtype=np.int32) // 7
    text = _mods.cuda_source(_mods.trace_mask_mod(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q)))
    head, rest = text.split("_row_part(", 1)
    row, rest = rest.split("_key_part(", 1)
    key, per_score = rest.split("__device__ __forceinline__ bool ", 1)
    assert "buf0[" not in head
    assert "buf0[q_idx]" in row and "r.outside |= !in" in row and "kv_idx" not in row
    assert "buf0[kv_idx]" in key and "k.outside |= !in" in key and "q_idx" not in key
    assert "buf0[" not in per_score and "r.t" in per_score and "k.t" in per_score and "(kv_idx <= q_idx)" in per_score
    table = np.zeros((4, 128), np.float32)
    text = _mods.cuda_source(_mods.trace_score_mod(lambda s, b, h, q, kv: s + table[h, q - kv + 64]))
    parts = text.split("__device__ __forceinline__ float ")
    assert "buf0[" not in parts[0] and "buf0[h * buf0_stride0 + t" in parts[1]  # 2-D: the last axis's stride is 1


def test_a_call_s_index_ranges_drop_the_checks_of_the_reads_they_keep_inside():
    """With a call's grid (_mods.Grid: b < B, h < H, q_idx < Nq, kv_idx < Nk), a per-head or
    per-score read whose every index stays inside its array is compiled with no check and no
    outside flag; a row's or key's read keeps its check (the tile loops compute those parts past
    the sequence), as does a read the ranges do not keep inside, and without a grid every read."""
    n, heads = 256, 8
    doc, slopes = np.zeros(n, np.int32), np.zeros(heads, np.float32)
    bias = np.zeros((heads, 2 * n), np.float32)
    document = _mods.trace_mask_mod(lambda b, h, q, kv: doc[q] == doc[kv])
    alibi = _mods.trace_score_mod(lambda s, b, h, q, kv: s - slopes[h] * mods.abs(q - kv))
    relative = _mods.trace_score_mod(lambda s, b, h, q, kv: s + bias[h, q - kv + n])

    def unchecked(mod, grid):  # (reads unchecked, reads)
        reads, stack = set(), [mod.expr]
        while stack:
            e = stack.pop()
            reads |= {id(e)} if e.op == "index" else set()
            stack += [x for x in e.args if isinstance(x, _mods.Expr)]
        return len(_mods._reads_inside(mod.expr, grid)), len(reads)

    assert unchecked(document, _mods.Grid(2, heads, n, n)) == (2, 2)
    assert unchecked(document, _mods.Grid(2, heads, n + 1, n)) == (1, 2)  # doc[q_idx] may pass its end
    assert unchecked(alibi, _mods.Grid(1, heads, 9000, 9000)) == (1, 1)
    assert unchecked(alibi, _mods.Grid(1, heads + 1, 10, 10)) == (0, 1)
    assert unchecked(relative, _mods.Grid(1, heads, n, n)) == (1, 1)  # q - kv + n in [1, 2n - 1]
    assert unchecked(relative, _mods.Grid(1, heads, n + 1, n)) == (0, 1)
    assert unchecked(relative, _mods.Grid(1, heads, 0, n)) == (0, 1)  # an empty grid proves nothing
    assert unchecked(document, None) == (0, 2)

    # past 64 bits an integer wraps (the kernels' and NumPy's): no bound holds, the read is checked
    wraps = _mods.trace_score_mod(lambda s, b, h, q, kv: s + bias[0, (q * kv * 2**32) // 2**58])
    assert unchecked(wraps, _mods.Grid(1, 1, 65536, 65536)) == (0, 1)
    # a call with no rows proves nothing, and its device code is every read checked
    quotient = _mods.trace_score_mod(lambda s, b, h, q, kv: s + bias[h, kv // (q + 1)])
    for empty in (_mods.Grid(1, heads, 0, n), _mods.Grid(0, heads, n, n)):
        assert _mods.kernel_mods(quotient, None, grid=empty).source == _mods.kernel_mods(quotient, None).source

    grid = _mods.Grid(2, heads, n, n)
    assert _mods.kernel_mods(alibi, document).source.count("outside |= !in") == 3
    both = _mods.kernel_mods(alibi, document, grid=grid).source
    assert both.count("outside |= !in") == 2 and "r.outside |= !in" in both and "k.outside |= !in" in both
    assert "outside |= !in" not in _mods.kernel_mods(relative, None, grid=grid).source
    assert "outside |= !in" in _mods.kernel_mods(relative, None, grid=_mods.Grid(2, heads, n + 1, n)).source


@pytest.mark.parametrize("arch", ("sm_80", "sm_90a"))
def test_cuda_source_compiles(arch):
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    from cupyflash import _source

    gallery = _gallery()
    gallery += [_mods.score_derivative(m) for m in gallery if m.role == "score_mod"]  # the backward's slopes
    gallery = list({m.name: m for m in gallery}.values())
    calls = []
    for index, mod in enumerate(gallery):  # a test kernel that calls each function once
        specs = _mods._buffer_specs(mod.expr)
        buffers = [", ".join([f"(const {_mods._C_ELEMENT[s.dtype]}*)p", *["1LL"] * (len(s.shape) - 1)]) for s in specs]
        args = (["x[i]"] if mod.role == "score_mod" else []) + ["0", "1", "i", "i + 1"] + buffers
        parts = [f"st{index}", f"r{index}", f"k{index}"]
        calls.append(f"  {mod.name}_state st{index};")
        calls.append(f"  {mod.name}_head({', '.join(['0', '1', *buffers, f'st{index}'])});")
        calls.append(f"  {mod.name}_row r{index};")
        calls.append(f"  {mod.name}_row_part({', '.join(['0', '1', 'i', *buffers, f'st{index}', f'r{index}'])});")
        calls.append(f"  {mod.name}_key k{index};")
        calls.append(f"  {mod.name}_key_part({', '.join(['0', '1', 'i + 1', *buffers, f'st{index}', f'k{index}'])});")
        calls.append(f"  x[i] += (float){mod.name}({', '.join([*args, *parts, 'outside'])});  // {index}")
    source = "\n".join(
        ['#include "common.cuh"', _mods.CUDA_HELPERS, *(_mods.cuda_source(m) for m in gallery),
         'extern "C" __global__ void cf_mods_test(float* x, const void* p) {',
         "  const int i = threadIdx.x;", "  bool outside = false;", *calls, "  if (outside) x[i] = 0.f;", "}"]
    )  # fmt: skip
    program = nvrtc.createProgram(source, "cf_mods_test.cu", [], [])
    try:
        try:
            # (common.cuh as params.cuh brings it to the kernels: fast_tanh)
            nvrtc.compileProgram(program, [f"--gpu-architecture={arch}", "--std=c++17", f"-I{_source.kernel_dir()}",
                                           *_source.cuda_include_options()])  # fmt: skip
        except nvrtc.NVRTCError as error:
            pytest.fail(f"{error}\n{nvrtc.getProgramLog(program)}\n{source}")
        assert len(nvrtc.getCUBIN(program)) > 0
    finally:
        nvrtc.destroyProgram(program)


# -- the backward (host) -------------------------------------------------------------------------
def _gradient_cases(torch):
    table = torch.randn(HQ, NQ + NK, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    slopes = 2.0 ** (-8.0 * torch.arange(1, HQ + 1, dtype=torch.float64) / HQ)
    return {
        "softcap": (lambda s, b, h, q, kv: 0.7 * mods.tanh(s / 0.7), None),
        "alibi": (lambda s, b, h, q, kv: s - slopes[h] * mods.abs(q + SHIFT - kv), lambda b, h, q, kv: kv <= q + SHIFT),
        "table": (lambda s, b, h, q, kv: s + table[h, kv - q + NQ], None),
        "where": (
            lambda s, b, h, q, kv: mods.where(h % 2 == 0, mods.minimum(s, 0.1), mods.log(mods.exp(s) + 1) / 2),
            lambda b, h, q, kv: (q // 8 == kv // 8) | (kv < 3),
        ),
        "poly": (lambda s, b, h, q, kv: mods.maximum(s * s * 0.5 - s, -abs(s)) % 1.5 + 2 / (3 + s * s), None),
    }


@pytest.mark.parametrize("case", ("softcap", "alibi", "table", "where", "poly"))
def test_backward_matches_autograd_of_the_formula(case):
    torch = pytest.importorskip("torch")
    score, visible = _gradient_cases(torch)[case]
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, NQ, HQ, D, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(B, NK, HKV, D, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(B, NQ, HQ, D, dtype=torch.float64, generator=gen)
    out, lse = cupyflash.attention(q, k, v, score_mod=score, mask_mod=visible, return_lse=True)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, score_mod=score, mask_mod=visible)
    # the formula, differentiated by autograd (the same functions run on torch's index grids)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kk, vv = (torch.repeat_interleave(x, HQ // HKV, dim=2) for x in leaves[1:])
    s = torch.einsum("bqhd,bkhd->bhqk", leaves[0], kk) / math.sqrt(D)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in (B, HQ, NQ, NK)), indexing="ij")
    s = torch.broadcast_to(score(s, b, h, i, j), s.shape)
    if visible is not None:
        s = torch.where(visible(b, h, i, j), s, -math.inf)
    p = torch.nan_to_num(torch.softmax(s, dim=-1))
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach(), atol=1e-10, rtol=0)
    for grad, leaf in zip(grads, leaves):
        torch.testing.assert_close(grad, leaf.grad, atol=1e-9, rtol=0)


def test_backward_of_a_mask_mod_alone_matches_the_built_in():
    rng = np.random.default_rng(6)
    q, k, v, dout = (rng.standard_normal((1, n, 2, 8)) for n in (9, 12, 12, 9))
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    built_in = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    modded = cupyflash.attention_backward(dout, q, k, v, out, lse, mask_mod=lambda b, h, i, j: j <= i + 3)
    for a, e in zip(modded, built_in):
        np.testing.assert_allclose(a, e, atol=1e-12)


def test_score_derivative_of_a_score_free_expression_is_zero():
    slope = _mods.score_derivative(_mods.trace_score_mod(lambda s, b, h, q, kv: q - kv))
    assert slope.expr == _mods.Expr("const", "float", (0.0,))


# -- the kernels' score hook (compiled here; run by test_gpu_mods.py) -----------------------------
def _sources(score_mod, mask_mod, full):
    """The device code a call compiles: over the compile tests' arrays (4k rows, 8 heads) the
    call's ranges keep every read inside, so none is checked (_mods.Grid); with
    CUPYFLASH_COMPILE_ALL=1 also every read checked (arrays shorter than a call's ranges)."""
    from cupyflash import _mods

    grid = _mods.Grid(2, 8, 4096, 4096)
    unchecked = _mods.kernel_mods(score_mod, mask_mod, grid=grid).source
    return [unchecked, _mods.kernel_mods(score_mod, mask_mod).source] if full else [unchecked]


def test_only_a_mask_with_one_read_per_key_reads_it_ahead(monkeypatch):
    """_mods.READ_KEYS_AHEAD: the Hopper forward reads a key's part ahead of the scores where it is
    a mask_mod's one 32-bit read (a document id, a per-head table's entry); not an 8-byte read,
    two reads, index arithmetic alone, or a score_mod (a bias table's read spilled the tiles); and
    none while the switch is off. Where on, the Hopper forward's two-consumer variants (short
    calls at d = 64) compile with no spill."""
    from cupyflash import _dispatch, _kernels, _mods

    doc, doc64, table = np.zeros(4096, np.int32), np.zeros(4096, np.int64), np.zeros((8, 4096), np.int32)
    bias = np.zeros((8, 4096), np.float32)
    cases = [
        (None, lambda b, h, i, j: doc[i] == doc[j], True),
        (None, lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), True),
        (None, lambda b, h, i, j: (table[h, j] == 1) | (j > 400), True),
        (None, lambda b, h, i, j: doc64[i] == doc64[j], False),
        (None, lambda b, h, i, j: (doc[j] == 1) & (table[h, j] == 1), False),
        (None, lambda b, h, i, j: (i // 64) == (j // 64), False),
        (lambda s, b, h, i, j: s + bias[h, j], lambda b, h, i, j: doc[i] == doc[j], False),
    ]
    grid = _mods.Grid(2, 8, 4096, 4096)
    for on in (False, True):
        monkeypatch.setattr(_mods, "READ_KEYS_AHEAD", on)
        for score, mask, ahead in cases:
            traced = (None if score is None else _mods.trace_score_mod(score), _mods.trace_mask_mod(mask))
            source = _mods.kernel_mods(*traced, grid=grid).source
            assert f"cf_user_keys_ahead = {'true' if on and ahead else 'false'};" in source
    monkeypatch.setattr(_mods, "READ_KEYS_AHEAD", True)
    source = _mods.kernel_mods(None, _mods.trace_mask_mod(cases[0][1]), grid=grid).source
    for head_dim in (64, 128):
        spec = _dispatch.fa3_fwd_spec("bfloat16", head_dim, _dispatch.MaskFlags(False, False, False),
                                      _dispatch.FA3_SHORT_SEQLEN, mods_source=source)  # fmt: skip
        assert spec is not None and spec.tile.consumers == 2
        build = _kernels.compile_offline(spec, "sm_90a")
        assert not build.spill_bytes and not build.warnings, (head_dim, build.spill_bytes, build.warnings)


def test_functions_reading_nothing_by_index_run_unguarded_on_three_consumers():
    """cf_user_reads_by_index: whether a function reads a captured array at an index of q_idx or
    kv_idx (a per-head slope does not). Where neither does, the Hopper forward's three-consumer
    d = 64 tile applies them past the sequence too (variants.cuh's PastUnguarded), and ALiBi, a
    relative position and index masks build for sm_90a with no spill and no warning there, as
    the tile's 160 registers a consumer did not hold with a branch per score (88-108 bytes)."""
    from helpers import FULL

    from cupyflash import _kernels
    from cupyflash._specs import Fa3FwdSpec, Fa3Tile

    slopes, bias, doc = np.zeros(8, np.float32), np.zeros((8, 4096), np.float32), np.zeros(4096, np.int32)
    grid = _mods.Grid(2, 8, 4096, 4096)
    reads = {
        "alibi": (lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j), None, False),
        "relative": (lambda s, b, h, i, j: s + 0.01 * (i - j), None, False),
        "chunks": (None, lambda b, h, i, j: (i // 64) == (j // 64), False),
        "bias": (lambda s, b, h, i, j: s + bias[h, j], None, True),
        "document": (None, lambda b, h, i, j: doc[i] == doc[j], True),
    }
    tile = Fa3Tile(128, consumers=3, stages=2, pingpong=True, dynamic=True)
    for name, (score, mask, by_index) in reads.items():
        score_mod = None if score is None else _mods.trace_score_mod(score)
        source = _mods.kernel_mods(score_mod, None if mask is None else _mods.trace_mask_mod(mask), grid=grid).source
        assert f"cf_user_reads_by_index = {'true' if by_index else 'false'};" in source, name
        if not by_index and (FULL or name == "alibi"):
            for causal in (False, True) if FULL else (False,):
                spec = Fa3FwdSpec("bfloat16", 64, tile, causal, False, False, False, 0, mods_source=source)
                build = _kernels.compile_offline(spec, "sm_90a")
                assert not build.spill_bytes and not build.warnings, (name, causal, build.spill_bytes, build.warnings)


def test_the_hook_compiles_cleanly_for_every_arch():
    """The FA2 forward with generated functions (a 2-D and a 1-D captured array, both functions,
    a float-only score function, a mask of indices only) at both tile shapes, causal or not, in
    both element types: a cubin for sm_80 and sm_90a with no spill and no warning; the Hopper
    forward's at d = 64, 80, 128 (sm_90a), short and long calls (d = 64's tiles differ there), and
    its packed variant (attention_varlen's), with no spill but the three-consumer d = 64 tile's
    (at most 192 bytes: _dispatch.FA3_MODS_FWD_TILES). Every combination with CUPYFLASH_COMPILE_ALL=1
    (scripts/gpu_check.sh); by default d = 128, causal, one length."""
    from helpers import FULL

    from cupyflash import _dispatch, _kernels, _mods

    # arrays as long as a real call's: with 40 entries ptxas folded the reads' bounds and hid a
    # spill of the Hopper backward (192 bytes at d = 64) that 4k entries show
    bias, doc = np.zeros((8, 8192), np.float32), np.zeros(4096, np.int32)
    slopes = np.zeros(8, np.float32)
    document = _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j])
    pairs = [
        (_mods.trace_score_mod(lambda s, b, h, i, j: s + bias[h, j]), document),
        (_mods.trace_score_mod(lambda s, b, h, i, j: 30.0 * mods.tanh(s / 30.0)), None),
        (None, _mods.trace_mask_mod(lambda b, h, i, j: (i // 64) == (j // 64))),
        (_mods.trace_score_mod(lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j)), None),  # (a read unchecked)
    ]
    builds, sources = [], set()
    for (score_mod, mask_mod), dtype in zip(pairs, ("bfloat16", "float16", "bfloat16", "float16"), strict=True):
        for source in _sources(score_mod, mask_mod, FULL):
            sources.add(source)
            for head_dim in (64, 128) if FULL else (128,):
                for causal in (False, True) if FULL else (True,):
                    flags = _dispatch.MaskFlags(causal, False, False, mask="mods")
                    spec = _dispatch.fa2_fwd_spec(dtype, head_dim, flags, HOPPER_SMEM_PER_BLOCK, mods_source=source)
                    assert spec.mask == "mods"
                    for arch in ("sm_80", "sm_90a"):
                        builds.append((spec.name, arch, _kernels.compile_offline(spec, arch)))
            for head_dim in (64, 80, 128) if FULL else (128,):  # the Hopper forward's, long and short sequences
                for causal in (False, True) if FULL else (True,):
                    for seqlen_k in (1024, 8192) if FULL else (8192,):
                        flags = _dispatch.MaskFlags(causal, False, False)
                        spec = _dispatch.fa3_fwd_spec(dtype, head_dim, flags, seqlen_k, mods_source=source)
                        builds.append((spec.name, "sm_90a", _kernels.compile_offline(spec, "sm_90a")))
    # attention_varlen's: the Hopper forward's packed variant, every read checked (no index ranges)
    varlen = []
    for score_mod, mask_mod in pairs[:2] if FULL else pairs[:1]:
        source = _mods.kernel_mods(score_mod, mask_mod).source
        for head_dim in (64, 128) if FULL else (128,):
            flags = _dispatch.MaskFlags(True, False, False)
            spec = _dispatch.fa3_fwd_spec("bfloat16", head_dim, flags, 8192, True, mods_source=source)
            assert spec is not None and spec.varlen
            varlen.append((spec.name, "sm_90a", _kernels.compile_offline(spec, "sm_90a")))
    builds += varlen
    # The three-consumer d = 64 tile keeps some functions' per-score work partly in local memory
    # (_dispatch.FA3_MODS_FWD_TILES: up to 192 bytes measured, and faster than the two-consumer
    # tile for every function timed); every other build spills nothing.
    three_consumers = {n for n, _, _ in builds if "_d64_m192_" in n}
    assert not [(n, a, b.spill_bytes) for n, a, b in builds if b.spill_bytes and n not in three_consumers]
    assert not [(n, a, b.spill_bytes) for n, a, b in builds if b.spill_bytes > 192]
    assert not [(n, a, b.stack_bytes) for n, a, b in builds if b.stack_bytes and n not in three_consumers]
    assert not [(n, a, b.warnings) for n, a, b in builds if b.warnings]
    # each function pair's source, tile and bound its own variant (FA2's 4, the Hopper one's 8:
    # at d = 64 the short calls' two-consumer tile and the long calls' three-consumer one)
    assert len({name for name, _, _ in builds}) == len(sources) * (4 + 8 if FULL else 2) + len(varlen)


def test_the_backward_hook_compiles_cleanly():
    """The mma.sync backward (key blocks, and the deterministic mode's dQ kernel) with a score
    function, its derivative and a mask function compiled in: no spill, no stack frame, no
    warning, both archs; head dims 64, 128 and 256 with CUPYFLASH_COMPILE_ALL=1
    (scripts/gpu_check.sh), 128 by default. The Hopper backward's variants likewise (its packed
    ones too), each with as many wgmmas as the built-in kernel in the same mode."""
    from helpers import FULL

    from cupyflash import _dispatch, _kernels, _mods

    bias, doc = np.zeros((8, 8192), np.float32), np.zeros(4096, np.int32)  # (as above)
    pairs = [
        (_mods.trace_score_mod(lambda s, b, h, i, j: 20.0 * mods.tanh(s / 20.0) + bias[h, j]),
         _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j])),
        (None, _mods.trace_mask_mod(lambda b, h, i, j: (i // 64) == (j // 64))),
    ]  # fmt: skip
    builds = []
    for score_mod, mask_mod in pairs:
        for source in _sources(score_mod, mask_mod, FULL):
            for head_dim in (64, 128, 256) if FULL else (128,):
                flags = _dispatch.MaskFlags(True, False, False, mask="mods")
                specs = [_dispatch.fa2_bwd_spec("bfloat16", head_dim, flags, deterministic, source)
                         for deterministic in (False, True)]  # fmt: skip
                specs.append(_dispatch.fa2_bwd_dq_spec("bfloat16", head_dim, flags, source))
                for spec in specs:
                    assert spec.mods_source == source
                    builds += [(spec.name, arch, _kernels.compile_offline(spec, arch)) for arch in ("sm_80", "sm_90a")]
    # the Hopper backward (sm_90a; its head dims 64 and 128), every mode: a mask_mod alone, and
    # score_mods (their logits and slopes formed beside dS^T: softcap's tanh, a captured table
    # beside a document mask, ALiBi's per-head slope)
    slopes = np.zeros(8, np.float32)
    hopper = [
        (None, pairs[1][1]),
        (None, _mods.trace_mask_mod(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i))),
        pairs[0],
        (_mods.trace_score_mod(lambda s, b, h, i, j: 30.0 * mods.tanh(s / 30.0)), None),
        (_mods.trace_score_mod(lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j)), None),
    ]
    # Each is held to the built-in kernel's tensor-core work: as many wgmmas per step (a part of
    # the dV / dK pass never run left dQ's later rows unwritten on the GPU), in the steps score
    # functions keep (64 rows at d = 128: the built-in's 80-row steps are not theirs).
    wgmmas = {}
    modes = [(c, d) for c in (False, True) for d in (False, True)] if FULL else [(True, False)]
    for head_dim in (64, 128):
        for causal, deterministic in modes:
            plain = replace(_dispatch.fa3_bwd_spec("bfloat16", head_dim, _dispatch.MaskFlags(causal, False, False),
                                                   deterministic, False, None), rows80=False)  # fmt: skip
            build = _kernels.compile_offline(plain, "sm_90a")
            builds.append((plain.name, "sm_90a", build))
            wgmmas[head_dim, causal, deterministic] = build.ptx.count("wgmma.mma_async")
    for score_mod, mask_mod in hopper if FULL else hopper[1:4]:
        for source in _sources(score_mod, mask_mod, FULL):
            for (head_dim, causal, deterministic), built_in in wgmmas.items():
                flags = _dispatch.MaskFlags(causal, False, False, mask="mods")
                spec = _dispatch.fa3_bwd_spec("bfloat16", head_dim, flags, deterministic, False, source)
                assert spec is not None and spec.mods_source == source
                build = _kernels.compile_offline(spec, "sm_90a")
                builds.append((spec.name, "sm_90a", build))
                assert build.ptx.count("wgmma.mma_async") == built_in > 0, spec.name
    # attention_varlen's: the packed Hopper backward with the hook (every read checked, the rows
    # past a sequence hidden), as many wgmmas as the packed built-in kernel
    lens, rev = np.zeros(4, np.int32), np.zeros((8, 4096), np.float32)
    from_the_end = _mods.trace_score_mod(lambda s, b, h, i, j: s + rev[h, lens[b] - 1 - i])
    for score_mod, mask_mod in [(from_the_end, None), *hopper[:1]] if FULL else [(from_the_end, None)]:
        source = _mods.kernel_mods(score_mod, mask_mod).source
        for head_dim, causal, deterministic in wgmmas:
            plain = _dispatch.fa3_bwd_spec("bfloat16", head_dim, _dispatch.MaskFlags(causal, False, False),
                                           deterministic, True, None)  # fmt: skip
            flags = _dispatch.MaskFlags(causal, False, False, mask="mods")
            spec = _dispatch.fa3_bwd_spec("bfloat16", head_dim, flags, deterministic, True, source)
            assert spec is not None and spec.varlen and plain.varlen
            build = _kernels.compile_offline(spec, "sm_90a")
            builds.append((spec.name, "sm_90a", build))
            wanted = _kernels.compile_offline(plain, "sm_90a").ptx.count("wgmma.mma_async")
            assert build.ptx.count("wgmma.mma_async") == wanted > 0, spec.name
    assert not [(n, a, b.spill_bytes) for n, a, b in builds if b.spill_bytes]
    assert not [(n, a, b.stack_bytes) for n, a, b in builds if b.stack_bytes]
    assert not [(n, a, b.warnings) for n, a, b in builds if b.warnings]
    assert not [(n, a) for n, a, b in builds if "wgmma.mma_async instructions are serialized" in b.log]


def test_kernel_mods_refuses_more_arrays_than_the_kernels_take():
    from cupyflash import _mods

    a0, a1, a2, a3, a4 = (np.zeros(4, np.float32) for _ in range(5))
    score_mod = _mods.trace_score_mod(lambda s, b, h, i, j: s + a0[j] + a1[j] + a2[j] + a3[j])
    mask_mod = _mods.trace_mask_mod(lambda b, h, i, j: a4[j] > 0)
    with pytest.raises(ValueError, match="more than 4 arrays"):
        _mods.kernel_mods(score_mod, mask_mod)
    assert _mods.kernel_mods(score_mod, None).buffers == ((0, 0), (0, 1), (0, 2), (0, 3))


def test_the_backward_plan_runs_the_hook_on_the_hopper_kernel():
    """On Hopper the backward with a score_mod runs the Hopper backward at d = 64 and 128 (the
    mma.sync kernels at other head dims), the functions' arrays bound as the forward binds
    them, the softmax factor log2 e with the scale moved into the functions' argument; a mask_mod
    alone runs the Hopper backward with the kernels' own factor, with its block summary where one comes
    with it (the kernel bounds its query blocks by the summary's row ranges and runs the mask on
    mixed tiles alone)."""
    from dataclasses import replace as changed

    from cupyflash import _device, _mods, _plan
    from cupyflash._plan.common import LOG2E
    from cupyflash._validate import attention_problem

    bias = np.zeros((8, 300), np.float32)
    kernel = _mods.kernel_mods(_mods.trace_score_mod(lambda s, b, h, i, j: s + bias[h, j]), None)
    h100 = _device.HOPPER
    p = attention_problem((2, 200, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128), causal=True, scale=None,
                          window=(-1, -1), softcap=0.0, layout="bshd")  # fmt: skip
    for deterministic in (False, True):
        launch = _plan.plan_backward(p, "bfloat16", h100, q_shape=(2, 200, 8, 128), k_shape=(2, 300, 2, 128),
                                     deterministic=deterministic, mods=kernel)  # fmt: skip
        (hopper,) = [step.spec for step in launch.steps if "fa3_bwd" in step.spec.name]
        assert hopper.mods_source == kernel.source and hopper.deterministic == deterministic
        assert sum("mods" in step.spec.name for step in launch.steps) == 1  # (the per-row steps have none)
        assert "mod_buffer0" in [o.name for o in launch.operands]
        fields = launch.params.struct.dtype.names
        values = dict(zip(fields, launch.params.values, strict=True))
        assert values["softmax_scale_log2"] == pytest.approx(LOG2E)
        assert values["mod_score_scale"] == pytest.approx(128**-0.5)
    # d = 80: the mma.sync kernels (the deterministic mode's dQ kernel with the hook too)
    p80 = changed(p, head_dim=80)
    for deterministic in (False, True):
        launch = _plan.plan_backward(p80, "bfloat16", h100, q_shape=(2, 200, 8, 80), k_shape=(2, 300, 2, 80),
                                     deterministic=deterministic, mods=kernel)  # fmt: skip
        names = [step.spec.name for step in launch.steps]
        assert not any("fa3" in n for n in names) and sum("mods" in n for n in names) == 1 + deterministic
    with pytest.raises(ValueError, match="do not combine with softcap"):
        _plan.plan_backward(changed(p, softcap=5.0), "bfloat16", h100, q_shape=(2, 200, 8, 128),
                            k_shape=(2, 300, 2, 128), mods=kernel)  # fmt: skip
    doc = np.zeros(300, np.int32)
    mask = _mods.kernel_mods(None, _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j]))
    assert not mask.has_score_mod and kernel.has_score_mod
    launch = _plan.plan_backward(p, "bfloat16", h100, q_shape=(2, 200, 8, 128), k_shape=(2, 300, 2, 128),
                                 mods=mask)  # fmt: skip
    (hopper,) = [step.spec for step in launch.steps if "fa3_bwd" in step.spec.name]
    assert hopper.mods_source == mask.source and hopper.causal
    values = dict(zip(launch.params.struct.dtype.names, launch.params.values, strict=True))
    # a mask changes no score: the kernels' own factor, the function called on the raw score
    assert values["softmax_scale_log2"] == pytest.approx(128**-0.5 * LOG2E) and values["dq_tiled"] == 1
    assert values["mod_score_scale"] == 1.0
    cells = _plan.BlockCells.of((1, 1, 4, 5), (64, 64))
    launch = _plan.plan_backward(p, "bfloat16", h100, q_shape=(2, 200, 8, 128), k_shape=(2, 300, 2, 128),
                                 mods=mask, cells=cells)  # fmt: skip
    (hopper,) = [step.spec for step in launch.steps if "fa3_bwd" in step.spec.name]
    assert hopper.mods_source == mask.source
    assert {"mask_cells", "mask_row_ranges"} <= {o.name for o in launch.operands}


def test_a_mask_alone_keeps_the_kernels_scale():
    """The forward's factors: a score_mod sees the scaled score (the softmax multiplies by log2 e
    alone); a mask_mod alone changes no score, so the kernels keep their own factor (scale log2 e)
    and its plain tiles need no code (variants.cuh: ScoreOnly of a mask alone is the identity),
    on the Hopper kernel and on FA2's."""
    from cupyflash import _device, _mods, _plan
    from cupyflash._plan.common import LOG2E
    from cupyflash._validate import attention_problem

    doc, bias = np.zeros(300, np.int32), np.zeros((8, 300), np.float32)
    h100 = _device.HOPPER
    p = attention_problem((2, 300, 8, 128), (2, 300, 2, 128), (2, 300, 2, 128), causal=False, scale=0.2,
                          window=(-1, -1), softcap=0.0, layout="bshd")  # fmt: skip
    mask = _mods.kernel_mods(None, _mods.trace_mask_mod(lambda b, h, i, j: doc[i] == doc[j]))
    score = _mods.kernel_mods(_mods.trace_score_mod(lambda s, b, h, i, j: s + bias[h, j]), None)
    assert "cf_user_has_score_mod = false" in mask.source and "cf_user_has_score_mod = true" in score.source
    for algorithm in ("auto", "fa2"):
        for kernel, factor, argument in ((mask, 0.2 * LOG2E, 1.0), (score, LOG2E, 0.2)):
            launch = _plan.plan_forward(p, "bfloat16", h100, algorithm, q_shape=(2, 300, 8, 128), mods=kernel)
            assert launch.params.value("softmax_scale_log2") == pytest.approx(factor), algorithm
            assert launch.params.value("mod_score_scale") == pytest.approx(argument), algorithm


@pytest.mark.parametrize(
    ("mask_mod", "window", "exact"),
    [
        (lambda b, h, i, j: j <= i, (-1, 0), True),
        (lambda b, h, i, j: i >= j, (-1, 0), True),
        (lambda b, h, i, j: j < i, (-1, 0), False),  # implies j <= i (and hides the diagonal)
        (lambda b, h, i, j: (j <= i) & (i - j < 5), (4, 0), True),
        (lambda b, h, i, j: (i - j <= 5) & (j <= i) & ((i + j) % 2 == 0), (5, 0), False),
        (lambda b, h, i, j: (5 > i - j) & ~(j > i), (4, -1), False),  # ~(j > i) is not read
        (lambda b, h, i, j: 5 > i - j, (4, -1), True),
        (lambda b, h, i, j: (j <= i) | (j < 3), (-1, -1), False),  # an or: nothing implied
        (lambda b, h, i, j: j <= i + 1, (-1, -1), False),
        (lambda b, h, i, j: i - j < 0, (-1, -1), False),  # shows nothing; no bound taken
        (lambda b, h, i, j: (i // 4 == j // 4) & (j <= i), (-1, 0), False),
    ],
)
def test_implied_window_is_implied_by_the_mask(mask_mod, window, exact):
    """The bounds read from a mask's top-level ``&`` hold wherever the mask shows a key (checked
    on a grid), and are the ones expected; ``exact_window`` gives them where the mask is those
    bounds and nothing else (the same keys shown on the grid), else None."""
    from cupyflash import _mods

    traced = _mods.trace_mask_mod(mask_mod)
    left, right = _mods.implied_window(traced)
    assert (left, right) == window
    i, j = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    shown = np.broadcast_to(mask_mod(0, 0, i, j), i.shape)
    if right >= 0:
        assert not (shown & (j > i + right)).any()
    if left >= 0:
        assert not (shown & (j < i - left)).any()
    bounds = (j <= i + right if right >= 0 else True) & (j >= i - left if left >= 0 else True)
    assert _mods.exact_window(traced) == (window if exact else None)
    assert (shown == bounds).all() == exact


def test_implied_bounds_reach_the_plan_only_where_rows_and_keys_align():
    """A causal mask_mod over Nq = Nk plans the kernels' causal variant (its tiles above the
    diagonal skipped); with Nq != Nk, or bounds of the call's own, the problem is left alone."""
    from dataclasses import replace as changed

    from cupyflash import _attention, _mods
    from cupyflash._validate import attention_problem

    sliding = _mods.trace_mask_mod(lambda b, h, i, j: (j <= i) & (i - j < 100))
    square = attention_problem((1, 300, 4, 64), (1, 300, 4, 64), (1, 300, 4, 64), causal=False, scale=None,
                               window=(-1, -1), softcap=0.0, layout="bshd")  # fmt: skip
    bounded = _attention.with_implied_bounds(square, sliding)
    assert (bounded.window_left, bounded.window_right) == (99, 0)
    assert _attention.with_implied_bounds(changed(square, seqlen_k=301), sliding) == changed(square, seqlen_k=301)
    own = changed(square, window_left=10)
    assert _attention.with_implied_bounds(own, sliding) is own
    assert _attention.with_implied_bounds(square, None) is square


def test_the_gallery_example_agrees_with_the_other_way():
    """examples/score_functions.py on the host: every gallery function equals the same attention
    computed another way (the built-in option, or the float64 reference with the mask written out;
    the document mask also as packed sequences), and the learned bias table's gradient equals
    torch autograd's of the bias written out."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "score_functions.py"
    run = subprocess.run([sys.executable, str(script), "--n", "130"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("learned bias, gradient")
    assert lines[4].startswith("  packed (varlen)")
    for line in lines:
        assert float(line.rsplit(" ", 1)[-1]) < 1e-5, line
