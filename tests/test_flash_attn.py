"""cupyflash.flash_attn: flash-attn's function names, argument order, defaults and return forms
mapped onto cupyflash (host arrays here, so CI runs them; the `gpu` test runs a flash-attn-style
training call sequence on CUDA tensors)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import rel_error

import cupyflash
from cupyflash import flash_attn as fa
from cupyflash import reference


def _qkv(rng, b=2, sq=9, sk=13, h=4, hk=2, d=16):
    return rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d)), rng.standard_normal((b, sk, hk, d))


def test_func_maps_onto_attention(rng):
    q, k, v = _qkv(rng)
    out = fa.flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(4, 2), softcap=5.0)
    want = cupyflash.attention(q, k, v, scale=0.3, window=(4, 2), softcap=5.0)
    np.testing.assert_array_equal(out, want)
    # causal: the window's right bound is 0 whatever window_size says (flash-attn's rule)
    out, lse, probs = fa.flash_attn_func(q, k, v, causal=True, window_size=(3, 5), return_attn_probs=True)
    want, want_lse = cupyflash.attention(q, k, v, causal=True, window=(3, 0), return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    assert probs is None and lse.shape == (2, 4, 9)
    np.testing.assert_allclose(out, reference.attention(q, k, v, causal=True, window=(3, 0)), rtol=1e-10, atol=1e-12)


def test_window_bounds_as_0d_tensors():
    """As flash-attn's tests pass them: 0-d integer tensors, taken as ints (the cache call too)."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, n, 2, 16, dtype=torch.float64) for n in (7, 11, 11))
    window = (torch.tensor(4), torch.tensor(1))
    assert torch.equal(fa.flash_attn_func(q, k, v, window_size=window), cupyflash.attention(q, k, v, window=(4, 1)))
    out = fa.flash_attn_with_kvcache(q, k, v, window_size=window, causal=True)
    assert torch.equal(out, cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=11, window=(4, 0), causal=True))
    with pytest.raises(ValueError, match="window must be a pair"):
        fa.flash_attn_func(q, k, v, window_size=(torch.tensor(4.0), -1))


def test_packed_forms_are_views_of_one_tensor(rng):
    qkv = rng.standard_normal((2, 11, 3, 4, 16))
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True)
    np.testing.assert_array_equal(out, fa.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))
    q, kv = rng.standard_normal((2, 7, 4, 16)), rng.standard_normal((2, 12, 2, 2, 16))
    out = fa.flash_attn_kvpacked_func(q, kv, softmax_scale=0.5)
    np.testing.assert_array_equal(out, fa.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], softmax_scale=0.5))


def test_varlen_forms(rng):
    cu = np.array([0, 5, 5, 12], dtype=np.int32)
    q, k, v = (rng.standard_normal((12, h, 16)) for h in (4, 2, 2))
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, return_attn_probs=True)
    want, want_lse = cupyflash.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, want)
    assert lse.shape == (4, 12)
    qkv = rng.standard_normal((12, 3, 4, 16))
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, softcap=2.0)
    np.testing.assert_array_equal(
        out, cupyflash.attention_varlen(*(qkv[:, i] for i in range(3)), cu, cu, 7, 7, softcap=2.0)
    )
    kv = rng.standard_normal((12, 2, 2, 16))
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7)
    np.testing.assert_array_equal(out, cupyflash.attention_varlen(q, kv[:, 0], kv[:, 1], cu, cu, 7, 7))


def test_with_kvcache_appends_and_reads_the_whole_cache_by_default(rng):
    k_cache, v_cache = (rng.standard_normal((2, 20, 2, 16)) for _ in range(2))
    q = rng.standard_normal((2, 1, 4, 16))
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache)  # cache_seqlens=None: all 20 keys
    np.testing.assert_allclose(out, reference.attention(q, k_cache, v_cache), rtol=1e-10, atol=1e-12)
    k_new, v_new = (rng.standard_normal((2, 1, 2, 16)) for _ in range(2))
    lens = np.array([3, 11], dtype=np.int32)
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True, return_softmax_lse=True
    )
    np.testing.assert_array_equal(k_cache[1, 11], k_new[1, 0])  # appended in place
    want = reference.attention(q[1:], k_cache[1:, :12], v_cache[1:, :12], causal=True)
    np.testing.assert_allclose(out[1:], want, rtol=1e-10, atol=1e-12)
    assert lse.shape == (2, 4, 1)


def test_a_serving_sequence_through_the_flash_attn_names(rng):
    """A serving engine's calls as flash-attn users write them: a prompt chunk prefilled over a
    paged cache (flash_attn_varlen_func with block_table), then a decode step with the rotary
    embedding and an append (flash_attn_with_kvcache, GPT-NeoX pairs, paged): each against the
    same math on contiguous keys."""
    page, pages, hk, h, d = 4, 12, 2, 4, 16
    k_pages, v_pages = (rng.standard_normal((pages, page, hk, d)) for _ in range(2))
    table = np.array([[7, 2, 9], [0, 11, 5]], dtype=np.int32)
    lens = [10, 6]  # keys in each sequence's cache after its prompt chunk
    chunk = [3, 6]  # the chunk's queries: the newest positions of each sequence
    q = rng.standard_normal((sum(chunk), h, d))
    cu_q = np.array([0, 3, 9], dtype=np.int32)
    cu_k = np.array([0, 10, 16], dtype=np.int32)
    out = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 10, causal=True, block_table=table)
    gathered = ([np.concatenate([x[p] for p in row])[:n] for row, n in zip(table, lens)] for x in (k_pages, v_pages))
    keys, values = gathered
    for b in range(2):
        want = reference.attention(q[None, cu_q[b] : cu_q[b + 1]], keys[b][None], values[b][None], causal=True)
        np.testing.assert_allclose(out[cu_q[b] : cu_q[b + 1]], want[0], rtol=1e-10, atol=1e-12)
    # the decode step: one new token each, rotated (half the head dim) at its position as appended
    theta = rng.uniform(0, 6.28, (len(table[0]) * page, d // 4))
    cos, sin = np.cos(theta), np.sin(theta)
    q1 = rng.standard_normal((2, 1, h, d))
    k1, v1 = (rng.standard_normal((2, 1, hk, d)) for _ in range(2))
    seqlens = np.array(lens, dtype=np.int32)
    out1 = fa.flash_attn_with_kvcache(
        q1, k_pages, v_pages, k1, v1, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, block_table=table,
        causal=True, rotary_interleaved=False,
    )  # fmt: skip

    def neox(x, pos):  # GPT-NeoX pairs (i, i + R) turned by theta[pos]
        half = d // 4
        c, s_ = np.cos(theta[pos]), np.sin(theta[pos])
        y = x.copy()
        y[..., :half] = x[..., :half] * c - x[..., half : 2 * half] * s_
        y[..., half : 2 * half] = x[..., :half] * s_ + x[..., half : 2 * half] * c
        return y

    for b, n in enumerate(lens):
        appended = k_pages[table[b, n // page], n % page]
        np.testing.assert_allclose(appended, neox(k1[b, 0], n), rtol=1e-12, atol=1e-12)
        k_all = np.concatenate([keys[b], neox(k1[b], n)])[None]
        v_all = np.concatenate([values[b], v1[b]])[None]
        want = reference.attention(neox(q1[b : b + 1], n), k_all, v_all, causal=True)
        np.testing.assert_allclose(out1[b : b + 1], want, rtol=1e-10, atol=1e-12)


def test_rotary_without_new_keys_is_named_not_ignored():
    q = np.zeros((1, 4, 2, 16))
    with pytest.raises(ValueError, match="rotary_cos / rotary_sin rotate q and k_new"):
        fa.flash_attn_with_kvcache(q, q, q, rotary_cos=np.ones((4, 4)), rotary_sin=np.ones((4, 4)), cache_seqlens=1)


def test_a_flash_attn_style_training_step_on_the_host():
    """An MHA block as flash-attn users write it (qkv packed, flash_attn_qkvpacked_func,
    causal): its gradients through the custom op equal autograd of the float64 math."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    qkv = torch.randn(2, 10, 3, 2, 8, dtype=torch.float64, requires_grad=True)
    fa.flash_attn_qkvpacked_func(qkv, causal=True).square().sum().backward()
    got = qkv.grad.clone()
    qkv.grad = None
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    mask = torch.from_numpy(reference.visible_keys(10, 10, True, (-1, -1)))
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf)
    (torch.softmax(s, -1) @ v).transpose(1, 2).square().sum().backward()
    torch.testing.assert_close(got, qkv.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.gpu
def test_a_flash_attn_style_call_sequence_on_the_gpu():
    """Prefill (qkv packed, causal, training), then decoding with the cache, as flash-attn code
    calls them, on bf16 CUDA tensors against the float64 reference."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    qkv = torch.randn(2, 200, 3, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse, _ = fa.flash_attn_qkvpacked_func(qkv, causal=True, return_attn_probs=True)
    ref = reference.attention(*(qkv[:, :, i].detach() for i in range(3)), causal=True)
    assert rel_error(reference.to_numpy64(out.detach()), ref) < 1e-2
    out.float().square().sum().backward()
    assert qkv.grad is not None and torch.isfinite(qkv.grad).all()
    k_cache = torch.zeros(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :200], v_cache[:, :200] = qkv[:, :, 1].detach(), qkv[:, :, 2].detach()
    lens = torch.full((2,), 200, dtype=torch.int32, device="cuda")
    q_new, k_new, v_new = (torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fa.flash_attn_with_kvcache(q_new, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True)
    ref = reference.attention(q_new, k_cache[:, :201], v_cache[:, :201], causal=True)
    assert rel_error(reference.to_numpy64(out), ref) < 1e-2
    assert torch.equal(k_cache[:, 200], k_new[:, 0])


def test_dropout_is_flash_attns():
    """dropout_p drops probabilities (reproducibly under torch.manual_seed); 0 is plain attention."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 9, 2, 16, dtype=torch.float64) for _ in range(3))
    torch.manual_seed(0)
    a = fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(0)
    assert torch.equal(a, fa.flash_attn_func(q, k, v, dropout_p=0.3, causal=True))
    assert not torch.allclose(a, fa.flash_attn_func(q, k, v, causal=True))
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = fa.flash_attn_varlen_func(q.reshape(18, 2, 16), k.reshape(18, 2, 16), v.reshape(18, 2, 16), cu, cu, 9, 9,
                                       dropout_p=0.3, causal=True)  # fmt: skip
    assert packed.shape == (18, 2, 16) and torch.isfinite(packed).all()
