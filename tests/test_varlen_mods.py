"""``score_mod`` / ``mask_mod`` on ``attention_varlen`` and its backward (host path): b is the
packed sequence's index and q_idx, kv_idx positions within it. Each against a float64 reference
written here per sequence (forward), and against torch autograd of the formula (gradients, the
captured table's included); the refusals. The GPU kernels' twin: tests/test_gpu_mods.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import mods

HQ, HKV, D = 4, 2, 8
# an empty sequence, a one-token one, Nq < Nk, Nq > Nk; two rows after the last sequence
LENS_Q, LENS_K = (5, 0, 1, 9, 7), (8, 3, 1, 6, 7)
PAD = 2


def _offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


@pytest.fixture()
def packed():
    rng = np.random.default_rng(11)
    total_q, total_k = sum(LENS_Q) + PAD, sum(LENS_K)
    q = rng.standard_normal((total_q, HQ, D))
    k, v = (rng.standard_normal((total_k, HKV, D)) for _ in range(2))
    return q, k, v, _offsets(LENS_Q), _offsets(LENS_K)


def reference(q, k, v, cu_q, cu_k, score=None, visible=None, causal=False):
    """float64 per sequence: ``softmax(score(scale q k^T, b, h, i, j)`` masked by ``visible``
    (and the bottom-right causal bound) ``) v``; rows with no key give 0 and LSE -inf."""
    group = HQ // HKV
    out = np.zeros_like(q)
    lse = np.full((HQ, q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        kb, vb = (np.repeat(x[k0:k1], group, axis=1) for x in (k, v))
        s = np.einsum("qhd,khd->hqk", q[q0:q1], kb) / math.sqrt(D)
        h, i, j = np.meshgrid(np.arange(HQ), np.arange(q1 - q0), np.arange(k1 - k0), indexing="ij")
        if score is not None:
            s = np.broadcast_to(score(s, b, h, i, j), s.shape).astype(np.float64)
        shown = np.ones(s.shape, bool) if visible is None else np.broadcast_to(visible(b, h, i, j), s.shape)
        if causal:
            shown = shown & (j <= i + (k1 - k0) - (q1 - q0))
        s = np.where(shown, s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        total = p.sum(-1, keepdims=True)
        out[q0:q1] = np.einsum("hqk,khd->qhd", p / np.where(total > 0, total, 1.0), vb)
        with np.errstate(divide="ignore"):
            lse[:, q0:q1] = np.log(total[..., 0]) + m[..., 0]
    return out, lse


def _gallery():
    """(name, score_mod, mask_mod, reference score, reference visible): per sequence b."""
    table = np.random.default_rng(5).standard_normal((len(LENS_Q), HQ)) * 0.5  # a bias per (sequence, head)
    prefix = np.array([2, 0, 1, 4, 3], np.int32)  # each sequence's prefix (bidirectional) length
    slopes = 2.0 ** -np.arange(1, HQ + 1)
    lens = np.array(LENS_Q, np.int32)
    rev = np.random.default_rng(6).standard_normal((HQ, max(LENS_Q)))  # a bias by distance from the end
    return [
        ("per-sequence-bias", lambda s, b, h, i, j: s + table[b, h], None, lambda s, b, h, i, j: s + table[b, h], None),
        ("alibi", lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j), None,
         lambda s, b, h, i, j: s - slopes[h] * np.abs(i - j), None),
        ("prefix-lm", None, lambda b, h, i, j: (j <= i) | (j < prefix[b]), None,
         lambda b, h, i, j: (j <= i) | (j < prefix[b])),
        ("chunked", None, lambda b, h, i, j: (i // 3) == (j // 3), None, lambda b, h, i, j: (i // 3) == (j // 3)),
        ("from-the-end", lambda s, b, h, i, j: s + rev[h, lens[b] - 1 - i], None,
         lambda s, b, h, i, j: s + rev[h, lens[b] - 1 - i], None),
        ("both", lambda s, b, h, i, j: 2.0 * mods.tanh(s / 2.0) + 0.1 * b, lambda b, h, i, j: (j % 3) != 1,
         lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0) + 0.1 * b, lambda b, h, i, j: (j % 3) != 1),
    ]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", range(6))
def test_functions_see_each_sequence_s_own_indices(packed, case, causal):
    q, k, v, cu_q, cu_k = packed
    name, score_mod, mask_mod, ref_score, ref_visible = _gallery()[case]
    out, lse = cupyflash.attention_varlen(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, score_mod=score_mod, mask_mod=mask_mod,
        return_lse=True,
    )  # fmt: skip
    want, want_lse = reference(q, k, v, cu_q, cu_k, ref_score, ref_visible, causal)
    np.testing.assert_allclose(out, want, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, err_msg=name)
    assert (out[-PAD:] == 0).all() and (lse[:, -PAD:] == -np.inf).all()


def test_a_sequence_as_a_batch_of_one_agrees_with_attention(packed):
    """Sequence b of the packed call is attention's batch entry b (of a padded batch): the same
    functions, the same b."""
    q, k, v, cu_q, cu_k = packed
    b = 3
    score_mod = lambda s, b, h, i, j: s * (1.0 + 0.25 * b) - 0.05 * mods.abs(i - j)  # noqa: E731
    out = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), score_mod=score_mod)
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    padded = [np.stack([x[r0:r1]] * (b + 1)) for x, r0, r1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
    dense = cupyflash.attention(*padded, score_mod=score_mod)
    np.testing.assert_allclose(out[q0:q1], dense[b], atol=1e-12)


def _torch_reference(torch, q, k, v, cu_q, cu_k, table, causal):
    """out and LSE of the formula of test_gradients_match_torch_autograd_of_the_formula, per
    sequence, in torch (its autograd the reference)."""
    group = HQ // HKV
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        kb, vb = (x[k0:k1].repeat_interleave(group, dim=1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], kb) / math.sqrt(D)
        i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
        s = 3.0 * torch.tanh(s / 3.0) + table[b][:, None, None] * (i - j).abs()
        hidden = (j % 4 == 1) | ((j > i + (k1 - k0) - (q1 - q0)) if causal else torch.zeros_like(j, dtype=bool))
        s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
        outs.append(torch.einsum("hqk,khd->qhd", p, vb))
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_torch_autograd_of_the_formula(packed, causal):
    """q, k, v and a captured (sequence, head) table that require grad get the formula's
    gradients (the table's summed over the sequences that read it); rows outside every sequence
    none; rows whose every key is hidden none."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in packed)
    table = torch.from_numpy(np.random.default_rng(2).standard_normal((len(LENS_Q), HQ)) * 0.1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, table)]
    t = leaves[3]
    out, lse = cupyflash.attention_varlen(
        *leaves[:3], cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal, return_lse=True,
        score_mod=lambda s, b, h, i, j: 3.0 * mods.tanh(s / 3.0) + t[b, h] * mods.abs(i - j),
        mask_mod=lambda b, h, i, j: (j % 4) != 1,
    )  # fmt: skip
    finite = torch.isfinite(lse)
    (out.square().sum() + torch.where(finite, lse, 0.0).sum()).backward()
    ref = [x.clone().requires_grad_() for x in (q, k, v, table)]
    outs, lses = _torch_reference(torch, *ref[:3], cu_q, cu_k, ref[3], causal)
    loss = sum(o.square().sum() for o in outs) + sum(torch.where(torch.isfinite(x), x, 0.0).sum() for x in lses)
    loss.backward()
    for got, r, name in zip(leaves, ref, ("q", "k", "v", "table"), strict=True):
        torch.testing.assert_close(got.grad, r.grad, msg=name)
    assert (leaves[0].grad[-PAD:] == 0).all()


def test_explicit_backward_returns_the_captured_gradients_summed_over_sequences(packed):
    q, k, v, cu_q, cu_k = packed
    table = np.random.default_rng(4).standard_normal((HQ,))
    score_mod = lambda s, b, h, i, j: s + table[h] * (i - j)  # noqa: E731
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K))
    out, lse = cupyflash.attention_varlen(q, k, v, *args, score_mod=score_mod, return_lse=True)
    dout = np.random.default_rng(5).standard_normal(out.shape)
    dq, dk, dv, (dtable,) = cupyflash.attention_varlen_backward(
        dout, q, k, v, out, lse, *args, score_mod=score_mod, captured_grads=True
    )
    # finite differences of <dout, out> in the table's entries
    eps = 1e-6
    for h in range(HQ):
        bumped = [table.copy() for _ in range(2)]
        bumped[0][h] += eps
        bumped[1][h] -= eps
        sides = [
            cupyflash.attention_varlen(q, k, v, *args, score_mod=lambda s, b, hh, i, j, t=t: s + t[hh] * (i - j))
            for t in bumped
        ]
        np.testing.assert_allclose(dtable[h], np.sum(dout * (sides[0] - sides[1])) / (2 * eps), rtol=1e-5)
    plain = cupyflash.attention_varlen_backward(dout, q, k, v, out, lse, *args, score_mod=score_mod)
    for a, b in zip(plain, (dq, dk, dv), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_refusals(packed):
    q, k, v, cu_q, cu_k = packed
    args = (cu_q, cu_k, max(LENS_Q), max(LENS_K))
    with pytest.raises(ValueError, match="needs a score_mod"):
        cupyflash.attention_varlen_backward(q, q, k, v, q, np.zeros((HQ, q.shape[0])), *args, captured_grads=True)
    with pytest.raises(TypeError, match="`if`"):  # an untraceable function is refused, named
        cupyflash.attention_varlen(q, k, v, *args, score_mod=lambda s, b, h, i, j: s if i > j else -s)
    table = np.zeros(3)  # shorter than the longest sequence's positions
    with pytest.raises(IndexError, match="outside the array"):
        cupyflash.attention_varlen(q, k, v, *args, score_mod=lambda s, b, h, i, j: s + table[j])
    pages = np.zeros((4, 4, HKV, D))
    table_rows = np.zeros((len(LENS_Q), 4), np.int32)
    with pytest.raises(ValueError, match="block_table"):
        cupyflash.attention_varlen(q, pages, pages, *args, block_table=table_rows, mask_mod=lambda b, h, i, j: j <= i)


def test_torch_compile_fullgraph_matches_the_eager_call(packed):
    """Under torch.compile(fullgraph=True) the call is the attention_varlen_mods op (the traced
    expressions its text, the captured tensors graph inputs): the eager call's output and
    gradients; new values of a captured tensor rerun the graph without a recompile."""
    torch = pytest.importorskip("torch")
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in packed)
    prefix = torch.tensor([2, 0, 1, 4, 3], dtype=torch.int32)
    slopes = torch.tensor(2.0 ** -np.arange(1, HQ + 1))

    def score_mod(s, b, h, i, j):
        return s - slopes[h] * mods.abs(i - j)

    def mask_mod(b, h, i, j):
        return (j <= i) | (j < prefix[b])

    def step(q, k, v):
        out = cupyflash.attention_varlen(
            q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), score_mod=score_mod, mask_mod=mask_mod
        )
        return out.square().sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for new_prefix in ([2, 0, 1, 4, 3], [0, 1, 1, 6, 2]):
        prefix.copy_(torch.tensor(new_prefix, dtype=torch.int32))
        leaves = [[x.clone().requires_grad_() for x in (q, k, v)] for _ in range(2)]
        got, want = compiled(*leaves[0]), step(*leaves[1])
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        for a, b in zip(*leaves, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    assert counter.frame_count == 1


def test_opcheck_the_packed_score_function_ops(packed):
    torch = pytest.importorskip("torch")
    from cupyflash import _mods, _torch_ops

    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in packed)
    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    table = torch.randn(len(LENS_Q), HQ)
    score = _mods.trace_score_mod(lambda s, b, h, i, j: s + table[b, h])
    mask = _mods.trace_mask_mod(lambda b, h, i, j: j <= i)
    text, arrays = _mods.encode(_mods.static(score, mask)), list(_mods.captured(score, mask))
    args = (q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), False, 0.3, -1, -1, 0.0, "auto", False, None, None, None,
            False, text, arrays)  # fmt: skip
    torch.library.opcheck(_torch_ops.attention_varlen_mods_op, args)
    out, lse = _torch_ops.attention_varlen_mods_op(*args)
    saved = [x.detach() for x in (q, k, v, out, lse)]
    bwd = (torch.randn_like(out), *saved, None, cu_q, cu_k, max(LENS_Q), max(LENS_K), False, 0.3, -1, -1, 0.0, False,
           None, None, None, text, arrays)  # fmt: skip
    torch.library.opcheck(_torch_ops.attention_varlen_mods_backward_op, bwd)


def test_a_captured_table_alone_that_requires_grad_takes_autograds_route(packed):
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = (torch.from_numpy(x) for x in packed)
    table = torch.zeros(HQ, dtype=torch.float64, requires_grad=True)
    out = cupyflash.attention_varlen(
        q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), score_mod=lambda s, b, h, i, j: s + table[h] * (i - j)
    )
    assert out.requires_grad
    out.sum().backward()
    assert table.grad is not None and table.grad.shape == (HQ,) and torch.isfinite(table.grad).all()


def test_captured_gradients_of_a_numpy_table_beside_torch_tensors(packed):
    """A table captured as a NumPy array beside torch q, k, v: its gradient in the tensors'
    namespace (as attention_backward's), equal to the NumPy call's."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed
    table = np.array([0.1, -0.2, 0.05, 0.3])
    score_mod = lambda s, b, h, i, j: s + table[h] * (i - j)  # noqa: E731
    args = (max(LENS_Q), max(LENS_K))
    grads = []
    for arrays in ((q, k, v, cu_q, cu_k), tuple(torch.from_numpy(x) for x in (q, k, v, cu_q, cu_k))):
        out, lse = cupyflash.attention_varlen(*arrays, *args, score_mod=score_mod, return_lse=True)
        grads.append(cupyflash.attention_varlen_backward(
            out * 0 + 1, *arrays[:3], out, lse, *arrays[3:], *args, score_mod=score_mod, captured_grads=True
        )[-1][0])  # fmt: skip
    assert isinstance(grads[1], torch.Tensor)
    np.testing.assert_allclose(grads[1].numpy(), grads[0], atol=1e-12)
