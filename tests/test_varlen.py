"""attention_varlen: packed sequences of different lengths, on the host and on the GPU."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FULL, skip_unless_kernel

import cupyflash
from cupyflash import reference

# (query lengths, key lengths): empty sequences, single tokens, Nq != Nk, a long one.
LENGTHS = [([3, 0, 7, 15], [5, 1, 0, 24]), ([1], [1]), ([130, 65, 1], [64, 200, 129])]


def _packed(rng, q_lens, k_lens, hq=4, hkv=2, d=32, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], hkv, d)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _check(out, lse, q, k, v, cu_q, cu_k, atol, **kw):
    out, lse = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], return_lse=True, **kw)
        assert not np.isnan(out[rows]).any()
        np.testing.assert_allclose(out[rows], ref[0], atol=atol)
        assert (np.isneginf(lse[:, rows]) == np.isneginf(ref_lse[0])).all()
        finite = np.isfinite(ref_lse[0])
        np.testing.assert_allclose(lse[:, rows][finite], ref_lse[0][finite], atol=max(atol, 1e-5))


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"window": (5, 2), "softcap": 3.0}], ids=str)
def test_host_varlen_matches_reference(xp, rng, lengths, kw):
    q, k, v, cu_q, cu_k = _packed(rng, *lengths)
    args = [xp.asarray(x) for x in (q, k, v, cu_q, cu_k)]
    out, lse = cupyflash.attention_varlen(*args, max(lengths[0]), max(lengths[1]), return_lse=True, **kw)
    _check(out, lse, q, k, v, cu_q, cu_k, atol=1e-5, **kw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": np.zeros((4, 2, 2, 8))}, "q must be 3-D"),
        ({"cu_seqlens_k": np.array([0, 4], dtype=np.int32)}, "same length"),
        ({"cu_seqlens_q": np.array([[0, 4, 6]], dtype=np.int32)}, "must be 1-D"),
        ({"max_seqlen_q": -1}, "max_seqlen_q must be an int >= 0"),
        ({"max_seqlen_q": 99}, "exceed the packed lengths"),
        ({"cu_seqlens_q": np.array([0, 5, 4], dtype=np.int32)}, "never decrease"),
        ({"cu_seqlens_k": np.array([1, 3, 6], dtype=np.int32)}, "start at 0"),
        ({"max_seqlen_k": 2}, "longer than its max_seqlen"),
        ({"algorithm": "naive"}, "algorithm must be one of"),
    ],
)
def test_varlen_validation(change, message):
    f = np.zeros
    args = {
        "q": f((6, 2, 8), np.float32), "k": f((6, 2, 8), np.float32), "v": f((6, 2, 8), np.float32),
        "cu_seqlens_q": np.array([0, 4, 6], dtype=np.int32), "cu_seqlens_k": np.array([0, 3, 6], dtype=np.int32),
        "max_seqlen_q": 4, "max_seqlen_k": 3,
    }  # fmt: skip
    args.update(change)
    with pytest.raises(ValueError, match=message):
        cupyflash.attention_varlen(**args)


def _on_gpu(torch, dtype, q, k, v, cu_q, cu_k):
    """The packed inputs as CUDA tensors (q, k, v in ``dtype``), and q, k, v as the GPU sees
    them (rounded to ``dtype``) in float64 for the reference."""
    tensors = [torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q, k, v)]
    cus = [torch.from_numpy(x).cuda() for x in (cu_q, cu_k)]
    return (*tensors, *cus), [reference.to_numpy64(x) for x in tensors]


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["fa2", "fa3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 59, 80])
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("kw", [{"causal": True}, {}, {"window": (20, -1)}], ids=str)
def test_gpu_varlen_matches_reference(rng, algorithm, dtype, head_dim, lengths, kw):
    torch = pytest.importorskip("torch")
    skip_unless_kernel(algorithm, head_dim)
    q, k, v, cu_q, cu_k = _packed(rng, *lengths, d=head_dim)
    args, rounded = _on_gpu(torch, dtype, q, k, v, cu_q, cu_k)
    out, lse = cupyflash.attention_varlen(
        *args, max(lengths[0]), max(lengths[1]), return_lse=True, algorithm=algorithm, **kw
    )
    assert isinstance(out, torch.Tensor) and out.dtype == args[0].dtype
    _check(out, lse, *rounded, cu_q, cu_k, atol=2e-2 if dtype == "bfloat16" else 4e-3, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["fa2", "fa3"])
def test_gpu_varlen_many_sequences_long_and_gqa(rng, algorithm):
    """Dozens of sequences (most tiles of the longest one's grid are empty for the others),
    lengths past the short-call tiles, GQA 4:1, d = 64, 128 and 256, causal and not."""
    torch = pytest.importorskip("torch")
    for head_dim in (64, 128, 256):
        skip_unless_kernel(algorithm, head_dim)
        lengths = [int(n) for n in rng.integers(0, 300, size=40)] + [2100]
        q, k, v, cu_q, cu_k = _packed(rng, lengths, lengths[::-1], hq=8, hkv=2, d=head_dim)
        args, rounded = _on_gpu(torch, "bfloat16", q, k, v, cu_q, cu_k)
        for causal in (False, True):
            out, lse = cupyflash.attention_varlen(
                *args, max(lengths), max(lengths), causal=causal, return_lse=True, algorithm=algorithm
            )
            _check(out, lse, *rounded, cu_q, cu_k, atol=2e-2, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["fa2", "fa3"])
def test_gpu_varlen_ignores_what_lies_past_each_sequence(rng, algorithm):
    """Every sequence's last key block is partial, so it covers rows of the next sequence (or,
    for the last one, the packed tensor's unused tail, here NaN in K and Inf in V): no output
    row may see them."""
    torch = pytest.importorskip("torch")
    skip_unless_kernel(algorithm, 128)
    lengths_q, lengths_k = [70, 200, 33], [150, 77, 301]  # every last key block partial
    q, k, v, cu_q, cu_k = _packed(rng, lengths_q, lengths_k, hq=4, hkv=2, d=128)
    tail = 64
    k = np.concatenate([k, np.full((tail, *k.shape[1:]), np.nan, np.float32)])
    v = np.concatenate([v, np.full((tail, *v.shape[1:]), np.inf, np.float32)])
    args, rounded = _on_gpu(torch, "bfloat16", q, k, v, cu_q, cu_k)
    for causal in (False, True):
        out, lse = cupyflash.attention_varlen(
            *args, max(lengths_q), max(lengths_k), causal=causal, return_lse=True, algorithm=algorithm
        )
        assert bool(torch.isfinite(out).all())
        _check(
            out, lse, rounded[0], rounded[1][: cu_k[-1]], rounded[2][: cu_k[-1]], cu_q, cu_k, atol=2e-2, causal=causal
        )


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 36], ids=["d64", "d36"])  # (3 x 36: rows of 216 bytes)
@pytest.mark.parametrize("algorithm", ["fa2", "fa3"])
def test_gpu_varlen_rows_outside_sequences(rng, algorithm, head_dim):
    """Under the tests' NaN poison (every output filled with NaN before the launch): the rows no
    sequence owns are 0 (LSE -inf) in O and in dq, dk, dv, written by the packed launch's first
    step (kernels_cu/packed_fill.cu), tails after the last sequence of both q and k; every row a
    sequence owns finite. A sequence longer than the stated max_seqlen_q (rows past its grid's
    reach): those rows 0 too, on CuPy arrays."""
    import cupy

    skip_unless_kernel(algorithm, head_dim)
    q, k, v, cu_q, cu_k = _packed(rng, [5, 9], [7, 3], hq=3, hkv=1, d=head_dim)
    q = np.concatenate([q, np.ones((4, *q.shape[1:]), np.float32)])  # 4 query rows in no sequence
    k, v = (np.concatenate([x, np.ones((3, *x.shape[1:]), np.float32)]) for x in (k, v))  # 3 keys
    args = [cupy.asarray(x).astype(cupy.float16) for x in (q, k, v)] + [cupy.asarray(cu_q), cupy.asarray(cu_k)]
    out, lse = cupyflash.attention_varlen(*args, 9, 7, return_lse=True, algorithm=algorithm)
    assert isinstance(out, cupy.ndarray)
    assert bool(cupy.isfinite(out[:14]).all()) and bool(cupy.isfinite(lse[:, :14]).all())
    assert bool((out[14:] == 0).all()) and bool(cupy.isneginf(lse[:, 14:]).all())
    dout = cupy.asarray(rng.standard_normal(out.shape)).astype(cupy.float16)
    dq, dk, dv = cupyflash.attention_varlen_backward(dout, *args[:3], out, lse, *args[3:], 9, 7)
    for name, grad, owned in (("dq", dq, 14), ("dk", dk, 10), ("dv", dv, 10)):
        assert bool(cupy.isfinite(grad[:owned]).all()), name
        assert bool((grad[owned:] == 0).all()), f"{name}'s rows after the last sequence"
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        cupyflash.attention_varlen(*args[:3], args[3].astype(cupy.int64), args[4], 9, 7)
    # max_seqlen_q = 1 where a sequence has 300 rows: the grids reach its first 64 or 128 rows
    # (whole query blocks), the rest keep 0 (docs/robustness.md), as do the 4 rows after it
    q2 = cupy.asarray(rng.standard_normal((304, 3, head_dim))).astype(cupy.float16)
    cu2 = cupy.asarray(np.array([0, 300], np.int32))
    k2, v2 = (cupy.asarray(rng.standard_normal((300, 1, head_dim))).astype(cupy.float16) for _ in range(2))
    out2, lse2 = cupyflash.attention_varlen(q2, k2, v2, cu2, cu2, 1, 300, return_lse=True, algorithm=algorithm)
    assert not bool(cupy.isnan(out2).any()) and not bool(cupy.isnan(lse2).any())
    reached = int((out2 != 0).any(axis=(1, 2)).sum())  # (a computed row of random data is not 0)
    assert 1 <= reached < 300 and bool((out2[:reached] != 0).any(axis=(1, 2)).all())
    assert bool((out2[reached:] == 0).all()) and bool(cupy.isneginf(lse2[:, reached:]).all())
    from cupyflash import _workspace

    _workspace.take_device_errors(cupy.cuda.runtime.getDevice())  # (whatever the forward reported)


# ---------------------------------------------------------------------------------------------
# seqused_k (flash-attn's): only the first seqused_k[b] keys of each sequence take part.
# ---------------------------------------------------------------------------------------------
def _seqused_case(torch, device="cpu", dtype=None):
    torch.manual_seed(11)
    dtype = dtype or torch.float64
    cu_q = torch.tensor([0, 5, 5, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 34, 120], dtype=torch.int32)
    used = torch.tensor([12, 0, 70], dtype=torch.int32)
    q = torch.randn(42, 4, 32, dtype=dtype)  # 2 rows after the last sequence
    k, v = (torch.randn(120, 2, 32, dtype=dtype) for _ in range(2))
    return [x.to(device) for x in (q, k, v, cu_q, cu_k, used)]


def test_seqused_k_is_each_sequence_cut_to_its_used_keys():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k, used = _seqused_case(torch)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = cupyflash.attention_varlen(*leaves, cu_q, cu_k, 35, 86, causal=True, seqused_k=used)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in range(3):
        q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
        k1 = k0 + int(used[b])
        seq = [x.detach()[s][None].clone().requires_grad_(True) for x, s in
               ((q, slice(q0, q1)), (k, slice(k0, k1)), (v, slice(k0, k1)))]  # fmt: skip
        want = cupyflash.attention(*seq, causal=True)
        (want * dout[q0:q1][None]).sum().backward()
        torch.testing.assert_close(out[q0:q1], want[0])
        for leaf, ref, s in zip(leaves, seq, (slice(q0, q1), slice(k0, k1), slice(k0, k1))):
            torch.testing.assert_close(leaf.grad[s], ref.grad[0])
        for leaf in leaves[1:]:  # keys past seqused_k: no gradient
            assert not leaf.grad[k1 : int(cu_k[b + 1])].any()
    torch.autograd.gradcheck(
        lambda *x: cupyflash.attention_varlen(*x, cu_q, cu_k, 35, 86, causal=True, seqused_k=used),
        [x.detach()[:, :1, :4].clone().requires_grad_(True) for x in (q, k, v)],
        fast_mode=not FULL,
    )


def test_seqused_k_is_checked():
    q, k = np.ones((6, 2, 8)), np.ones((6, 1, 8))
    cu = np.array([0, 3, 6], dtype=np.int32)
    with pytest.raises(ValueError, match="seqused_k must be 1-D of length batch = 2"):
        cupyflash.attention_varlen(q, k, k, cu, cu, 3, 3, seqused_k=np.ones(3, np.int32))
    with pytest.raises(ValueError, match="seqused_k must lie in"):
        cupyflash.attention_varlen(q, k, k, cu, cu, 3, 3, seqused_k=np.array([1, 4], np.int32))
    with pytest.raises(TypeError, match="seqused_k must be an integer array"):
        cupyflash.attention_varlen(q, k, k, cu, cu, 3, 3, seqused_k=np.ones(2))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", (False, True))
def test_gpu_seqused_k_matches_the_host(deterministic):
    torch = pytest.importorskip("torch")
    host = _seqused_case(torch)
    q, k, v, cu_q, cu_k, used = (x.cuda() for x in host)
    q, k, v = (x.to(torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    out = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 35, 86, causal=True, seqused_k=used,
                                     deterministic=deterministic)  # fmt: skip
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_leaves = [x.detach().double().cpu().requires_grad_(True) for x in (q, k, v)]
    want = cupyflash.attention_varlen(*ref_leaves, *host[3:5], 35, 86, causal=True, seqused_k=host[5])
    want.backward(dout.double().cpu())
    # The rows no kernel writes by design (after the last sequence; keys past seqused_k) are the
    # plan's fill, 0, which the tests' NaN poisoning replaces: compared on the host test above.
    rows = slice(0, int(host[3][-1]))
    torch.testing.assert_close(out[rows].double().cpu(), want[rows].detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(q.grad[rows].double().cpu(), ref_leaves[0].grad[rows], atol=3e-2, rtol=3e-2)
    for b in range(3):
        keys = slice(int(host[4][b]), int(host[4][b]) + int(host[5][b]))
        for got, ref in zip((k, v), ref_leaves[1:]):
            torch.testing.assert_close(got.grad[keys].double().cpu(), ref.grad[keys], atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="seqused_k"):
        cupyflash.attention_varlen(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 35, 86, seqused_k=used,
                                   algorithm="fa3")  # fmt: skip
