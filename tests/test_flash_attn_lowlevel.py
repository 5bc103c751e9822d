"""flash-attn 2.8's lower-level functions in cupyflash.flash_attn (``_flash_attn_forward``,
``_flash_attn_backward`` and their varlen twins), the dropout pattern ``S_dmask`` flash-attn's
tests decode, and the paged varlen forward on inputs that require grad. Host tensors here (CI);
the GPU runs the same calls through the kernels."""

from __future__ import annotations

import inspect
import math

import pytest

import cupyflash
from cupyflash import flash_attn as fa
from cupyflash import reference

torch = pytest.importorskip("torch")


def _qkv(b=2, sq=9, sk=13, h=4, hk=2, d=16, dtype=torch.float64, grad=False):
    return tuple(
        torch.randn(b, n, heads, d, dtype=dtype, requires_grad=grad) for n, heads in ((sq, h), (sk, hk), (sk, hk))
    )


def test_signatures_are_flash_attn_2_8s():
    """Names, order and defaults as flash_attn/flash_attn_interface.py (2.8) states them."""
    params = {
        fa._flash_attn_forward: "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
        "alibi_slopes return_softmax",
        fa._flash_attn_backward: "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal "
        "window_size_left window_size_right softcap alibi_slopes deterministic rng_state=None",
        fa._flash_attn_varlen_forward: "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
        "softmax_scale causal window_size_left=-1 window_size_right=-1 softcap=0.0 alibi_slopes=None "
        "return_softmax=False block_table=None leftpad_k=None seqused_k=None zero_tensors=False num_splits=0",
        fa._flash_attn_varlen_backward: "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
        "max_seqlen_k dropout_p softmax_scale causal window_size_left window_size_right softcap alibi_slopes "
        "deterministic rng_state=None zero_tensors=False",
    }
    for function, want in params.items():
        got = [
            n if p.default is p.empty else f"{n}={p.default!r}"
            for n, p in inspect.signature(function).parameters.items()
        ]
        assert got == want.split(), function.__name__


def test_forward_and_backward_are_attention_s():
    torch.manual_seed(0)
    q, k, v = _qkv()
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(q, k, v, 0.0, 0.3, True, 4, 7, 0.0, None, False)
    want, want_lse = cupyflash.attention(q, k, v, causal=True, scale=0.3, window=(4, 0), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and s_dmask is None
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    softmax_d = fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.3, True, 4, 7, 0.0, None, False)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, scale=0.3, window=(4, 0))
    for given, grad in zip((dq, dk, dv), grads):
        assert torch.equal(given, grad)
    assert softmax_d.shape == (2, 4, 128) and softmax_d.dtype == torch.float32
    torch.testing.assert_close(softmax_d[..., :9], (dout * out).sum(-1).transpose(1, 2).float())
    assert not softmax_d[..., 9:].any()
    # buffers may be None (flash-attn computes and drops them)
    fa._flash_attn_backward(dout, q, k, v, out, lse, None, dk, None, 0.0, 0.3, True, 4, 7, 0.0, None, False)
    assert torch.equal(dk, grads[1])


def test_dropout_s_rng_state_regenerates_the_mask():
    q, k, v = _qkv()
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.25, None, False, -1, -1, 0.0, None, False)
    seed = int(rng_state[0]) % 2**64
    want, _ = cupyflash.attention(q, k, v, dropout_p=0.25, seed=seed, return_lse=True)
    assert torch.equal(out, want)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.25, None, False, -1, -1, 0.0, None, False, rng_state)
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.25, seed=seed)
    for given, grad in zip((dq, dk, dv), grads):
        assert torch.equal(given, grad)
    with pytest.raises(ValueError, match="rng_state"):
        fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.25, None, False, -1, -1, 0.0, None, False)


def test_varlen_forward_and_backward_are_attention_varlen_s():
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 17], dtype=torch.int32)
    q, k, v = (torch.randn(n, h, 16, dtype=torch.float64) for n, h in ((11, 4), (17, 2), (17, 2)))
    out, lse, _, rng_state = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 7, 8, 0.1, None, True, softcap=3.0)
    seed = int(rng_state[0]) % 2**64
    want, want_lse = cupyflash.attention_varlen(
        q, k, v, cu_q, cu_k, 7, 8, causal=True, softcap=3.0, dropout_p=0.1, seed=seed, return_lse=True
    )
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and lse.shape == (4, 11)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    softmax_d = fa._flash_attn_varlen_backward(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 7, 8, 0.1, None, True, -1, -1, 3.0, None, False, rng_state
    )
    grads = cupyflash.attention_varlen_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, 7, 8, causal=True, softcap=3.0, dropout_p=0.1, seed=seed
    )
    for given, grad in zip((dq, dk, dv), grads):
        assert torch.equal(given, grad)
    assert softmax_d.shape == (4, 11 + 3 * 128)
    torch.testing.assert_close(softmax_d[:, :11], (dout * out).sum(-1).T.float())
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 7, 8, 0.0, None, True, leftpad_k=cu_k[:-1])


def _decode(s_dmask, q, k, lse, causal):
    """flash-attn's tests' decoding of S_dmask: the sign bit is the dropout mask, |S| scaled by
    exp(m - lse), m the running max of each key block (of _get_block_size_n keys), last first."""
    sq, sk, d = q.shape[1], k.shape[1], q.shape[-1]
    s = s_dmask[:, :, :sq, :sk]
    keep = s >= 0
    scores = torch.einsum("bqhd,bkhd->bhqk", q / math.sqrt(d), k.repeat_interleave(q.shape[2] // k.shape[2], 2))
    mask = torch.from_numpy(reference.visible_keys(sq, sk, causal, (-1, -1)))
    scores = scores.masked_fill(~mask, -math.inf)
    block = fa._get_block_size_n(q.device, d, True, causal)
    maxes = torch.stack([x.amax(-1) for x in scores.split(block, -1)], -1)
    running = torch.cummax(maxes.flip(-1), -1).values.flip(-1).unbind(-1)
    probs = torch.cat([a * torch.exp(m - lse)[..., None] for a, m in zip(s.abs().split(block, -1), running)], -1)
    return keep, probs, mask


@pytest.mark.parametrize("causal", [False, True])
def test_s_dmask_is_flash_attn_s_encoding(causal):
    """return_attn_probs with dropout: the pattern decodes (as flash-attn's tests decode it) into
    the softmax and the very mask the forward dropped with: out = (P * keep / (1 - p)) V."""
    torch.manual_seed(3)
    q, k, v = _qkv(sq=70, sk=150, d=64)
    p = 0.3
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, p, causal=causal, return_attn_probs=True)
    assert s_dmask.shape == (2, 4, 128, 256) and s_dmask.dtype == q.dtype
    keep, probs, mask = _decode(s_dmask, q, k, lse, causal)
    want_p = torch.softmax(
        torch.einsum("bqhd,bkhd->bhqk", q / 8, k.repeat_interleave(2, 2)).masked_fill(~mask, -math.inf), -1
    )
    torch.testing.assert_close(probs, want_p, rtol=1e-12, atol=1e-14)
    dropped = (~keep & mask).sum() / (mask.sum() * 8)
    assert abs(float(dropped) - p) < 0.02
    want = torch.einsum("bhqk,bkhd->bqhd", probs * keep / (1 - round(p * 65536) / 65536), v.repeat_interleave(2, 2))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    assert not s_dmask[:, :, 70:].any() and not s_dmask[..., 150:].any()
    # without dropout: no pattern (flash-attn returns an empty tensor)
    assert fa.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[2] is None


def test_varlen_s_dmask_per_sequence():
    torch.manual_seed(4)
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, 2, 16, dtype=torch.float64) for _ in range(3))
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, 0.2, causal=True, return_attn_probs=True)
    assert s_dmask.shape == (2, 2, 128, 128)
    for b, (start, end) in enumerate([(0, 5), (5, 17)]):
        n = end - start
        keep, probs, mask = _decode(
            s_dmask[b : b + 1], q[None, start:end], k[None, start:end], lse[None, :, start:end], True
        )
        want = torch.einsum("bhqk,bkhd->bqhd", probs * keep / (1 - round(0.2 * 65536) / 65536), v[None, start:end])
        torch.testing.assert_close(out[None, start:end], want, rtol=1e-10, atol=1e-12)
        assert not s_dmask[b, :, n:].any()


def test_get_block_size_n_is_flash_attn_s_table():
    cpu = torch.device("cpu")
    assert [fa._get_block_size_n(cpu, d, True, False) for d in (32, 64, 96, 128, 192, 256)] == [128, 64, 64, 32, 64, 64]
    assert [fa._get_block_size_n(cpu, d, False, True) for d in (32, 64, 128)] == [128, 128, 64]


def test_paged_varlen_forward_runs_with_grad_and_its_backward_raises():
    """flash-attn's paged varlen has a forward and no backward: the forward runs on inputs that
    require grad, and a backward through it raises naming what is missing (no detached result)."""
    page, h, d = 4, 2, 8
    k_pages, v_pages = (torch.randn(6, page, h, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    q = torch.randn(5, h, d, dtype=torch.float64, requires_grad=True)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 7, 12], dtype=torch.int32)
    out = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 3, 7, causal=True, block_table=table)
    assert out.requires_grad
    with torch.no_grad():
        want = cupyflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 3, 7, causal=True, block_table=table)
    assert torch.equal(out.detach(), want)
    with pytest.raises(NotImplementedError, match="block_table has no backward"):
        out.sum().backward()
    low = fa._flash_attn_varlen_forward(q, k_pages, v_pages, cu_q, cu_k, 3, 7, 0.0, None, True, block_table=table)
    assert torch.equal(low[0].detach(), want) and low[0].requires_grad
    with pytest.raises(RuntimeError, match="has no backward pass"):  # the core call keeps refusing up front
        cupyflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 3, 7, causal=True, block_table=table)


def test_flash_attn_gpu_stand_in_takes_the_cxx_argument_order():
    q, k, v = _qkv()
    out, lse, s_dmask, rng_state = fa.flash_attn_gpu.fwd(q, k, v, None, None, 0.0, 0.25, True, -1, -1, 0.0, False)
    assert torch.equal(out, cupyflash.attention(q, k, v, causal=True, scale=0.25))
    dout = torch.randn_like(out)
    dq, dk, dv, _ = fa.flash_attn_gpu.bwd(
        dout, q, k, v, out, lse, None, None, None, None, 0.0, 0.25, True, -1, -1, 0.0, False, None, rng_state
    )
    for got, want in zip((dq, dk, dv), cupyflash.attention_backward(dout, q, k, v, out, lse, causal=True, scale=0.25)):
        assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="out_"):
        fa.flash_attn_gpu.fwd(q, k, v, out, None, 0.0, 0.25, True, -1, -1, 0.0, False)


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
def test_lower_level_functions_on_the_gpu(dropout_p):
    """The same calls on CUDA bf16 tensors: the forward equals cupyflash.attention's (the same
    kernels, the same seed), the backward writes the caller's buffers with attention_backward's
    gradients, and the rng_state of a dropout forward regenerates its mask in the backward."""
    torch.manual_seed(1)
    q, k, v = (x.cuda().to(torch.bfloat16) for x in _qkv(b=2, sq=300, sk=333, h=8, hk=2, d=128))
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, dropout_p, None, True, -1, -1, 0.0, None, False)
    seed = int(rng_state[0]) % 2**64 if dropout_p else None  # its bits as an unsigned seed
    want, want_lse = cupyflash.attention(q, k, v, causal=True, dropout_p=dropout_p, seed=seed, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(x, math.nan) for x in (q, k, v))
    fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, None, True, -1, -1, 0.0, None, True,
                            rng_state)  # fmt: skip
    grads = cupyflash.attention_backward(
        dout, q, k, v, out, lse, causal=True, dropout_p=dropout_p, seed=seed, deterministic=True
    )
    for given, grad in zip((dq, dk, dv), grads):
        assert torch.equal(given, grad)
