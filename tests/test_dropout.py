"""Dropout on the attention probabilities (kernels_cu/dropout.cuh and its twin, xp_impl.Dropout).

Host tests: the Philox4x32-10 generator against its published test vectors; the mask is a
function of (seed, batch, query head, row, key) alone (the same whatever the block sizes, so the
naive and FA2 host algorithms agree), keeps 1 - p of the elements, and leaves the LSE alone;
forward and backward against PyTorch autograd of the explicit formula ``(P * M / (1 - p)) V``;
gradcheck through the custom op; seeds from torch's generator; torch.compile draws a fresh
seed per call; bad options raise. GPU tests: the kernels against the float64 formula with the
host's mask (so the CUDA generator is checked draw for draw), forward and backward (atomic and
deterministic dQ), packed sequences, autograd, and CUDA-graph capture.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FULL,
    check_forward_backward_against_formula,
    dropout_keep,
    naive_low_precision,
    need_torch,
)

import cupyflash
from cupyflash.xp_impl import Dropout, philox4x32_10

# Random123's known answers for Philox4x32-10: (counter, key) -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter, key, want", PHILOX_KAT)
def test_philox_known_answers(counter, key, want):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == want


def test_the_mask_depends_on_the_element_not_on_the_blocks():
    whole = dropout_keep(0.3, 11, 2, 3, 70, 90)
    assert abs(whole.mean() - 0.7) < 0.01
    d = Dropout(0.3, 11)
    like = np.empty((2, 3, 1, 0, 0))
    pieces = [[d.keep(np, like, 3, (r, min(r + 32, 70)), (c, min(c + 48, 90))) for c in range(0, 90, 48)]
              for r in range(0, 70, 32)]  # fmt: skip
    rebuilt = np.concatenate([np.concatenate(row, axis=-1) for row in pieces], axis=-2).reshape(whole.shape)
    assert (rebuilt == whole).all()
    assert (dropout_keep(0.3, 12, 2, 3, 70, 90) != whole).mean() > 0.3  # another seed, another mask
    assert (dropout_keep(0.3, 11, 2, 3, 70, 90, batch0=1)[0] == whole[1]).all()  # the batch index is absolute


def _explicit(torch, q, k, v, p, seed, **options):
    """(P * M / (1 - p)) V in float64, differentiable, bshd."""
    b, nq, hq, _ = q.shape
    keep = dropout_keep(p, seed, b, hq, nq, k.shape[1])
    return naive_low_precision(q, k, v, layout="bshd", dropout=(p, keep), **options)


@pytest.mark.parametrize("options", [{"causal": True}, {"window": (5, 2)}, {"softcap": 3.0}], ids=str)
def test_host_forward_and_backward_match_the_explicit_formula(options):
    torch = need_torch()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 16, dtype=torch.float64) for n, h in ((37, 4), (45, 2), (45, 2)))
    full = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    out, lse = cupyflash.attention(q, k, v, dropout_p=0.4, seed=5, return_lse=True, **options)
    naive = cupyflash.attention(q, k, v, dropout_p=0.4, seed=5, algorithm="naive", **options)
    _, lse_plain = cupyflash.attention(q, k, v, return_lse=True, **options)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = _explicit(torch, *leaves, 0.4, 5, **full)
    close = {"rtol": 1e-5, "atol": 1e-6}  # the formula's scores are float32 (naive_low_precision)
    torch.testing.assert_close(out, want.detach(), **close)
    torch.testing.assert_close(naive, want.detach(), **close)
    torch.testing.assert_close(lse, lse_plain)  # the LSE is the undropped softmax's
    dout = torch.randn_like(out)
    (want * dout).sum().backward()
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.4, seed=5, **options)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, **close)


def test_gradcheck_through_the_custom_op():
    torch = need_torch()
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, requires_grad=True) for n in (6, 9, 9))
    torch.autograd.gradcheck(
        lambda *x: cupyflash.attention(*x, causal=True, dropout_p=0.3, seed=3), (q, k, v), fast_mode=not FULL
    )
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv, vv = (torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.autograd.gradcheck(
        lambda *x: cupyflash.attention_varlen(*x, cu, cu, 5, 5, causal=True, dropout_p=0.3, seed=3),
        (qv, kv, vv),
        fast_mode=not FULL,
    )


def test_varlen_sequences_use_their_own_batch_index():
    rng = np.random.default_rng(2)
    cu = np.array([0, 5, 12], dtype=np.int32)
    q, k, v = (rng.standard_normal((12, 2, 8)) for _ in range(3))
    packed = cupyflash.attention_varlen(q, k, v, cu, cu, 7, 7, dropout_p=0.5, seed=9)
    for b in range(2):
        s = slice(cu[b], cu[b + 1])
        keep = dropout_keep(0.5, 9, 1, 2, 7 if b else 5, 7 if b else 5, batch0=b)
        torch = need_torch()
        seq = [torch.from_numpy(x[s][None]) for x in (q, k, v)]
        want = naive_low_precision(*seq, causal=False, window=(-1, -1), softcap=0.0, scale=None, layout="bshd",
                                   dropout=(0.5, keep))  # fmt: skip
        np.testing.assert_allclose(packed[s], want[0].numpy(), rtol=1e-5, atol=1e-6)


def test_seeds_come_from_torch_and_compile_draws_one_per_call():
    torch = need_torch()
    q, k, v = (torch.randn(1, 20, 2, 16) for _ in range(3))
    torch.manual_seed(4)
    first = cupyflash.attention(q, k, v, dropout_p=0.5)
    second = cupyflash.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(4)
    assert torch.equal(cupyflash.attention(q, k, v, dropout_p=0.5), first)  # torch.manual_seed reproduces it
    assert not torch.equal(first, second)  # a fresh seed per call
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: cupyflash.attention(q, k, v, dropout_p=0.5), fullgraph=True)
    a, b = f(q, k, v), f(q, k, v)
    assert not torch.equal(a, b), "the compiled graph baked one seed in"
    g = torch.compile(lambda q, k, v: cupyflash.attention(q, k, v, dropout_p=0.5, seed=8), fullgraph=True)
    assert torch.equal(g(q, k, v), cupyflash.attention(q, k, v, dropout_p=0.5, seed=8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"dropout_p": 1 - 2**-18}, "below 1 - 2"),
        ({"dropout_p": -0.1}, "dropout_p"),
        ({"dropout_p": True}, "dropout_p"),
        ({"dropout_p": "0.1"}, "dropout_p"),
        ({"dropout_p": 0.1, "seed": -1}, "seed"),
        ({"dropout_p": 0.1, "seed": 2**64}, "seed"),
        ({"dropout_p": 0.1, "seed": 1.5}, "seed"),
        ({"dropout_p": 0.1, "algorithm": "decode"}, "dropout"),
        ({"dropout_p": 0.1, "algorithm": "fa1"}, "dropout"),
    ],
)
def test_bad_dropout_options_raise(kwargs, message):
    q = k = v = np.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match=message):
        cupyflash.attention(q, k, v, **kwargs)


def test_a_backward_with_dropout_needs_the_seed():
    q = k = v = dout = np.ones((1, 4, 1, 8))
    out, lse = cupyflash.attention(q, k, v, dropout_p=0.2, seed=1, return_lse=True)
    with pytest.raises(ValueError, match="seed"):
        cupyflash.attention_backward(dout, q, k, v, out, lse, dropout_p=0.2)


# ---------------------------------------------------------------------------------------------
# GPU: the FA2 kernels' draws and formulas against the host's mask in float64.
# ---------------------------------------------------------------------------------------------
GPU_CASES = {  # (B, Nq, Nk, Hq, Hkv, options)
    "plain-gqa-odd": (2, 97, 130, 4, 2, {}),
    "causal": (1, 130, 130, 2, 2, {"causal": True}),
    "window-softcap": (1, 70, 200, 2, 1, {"window": (40, 8), "softcap": 10.0}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256))
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic", "deterministic"))
def test_gpu_forward_and_backward_match_the_explicit_formula(rng, dtype, head_dim, case, deterministic):
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, options = GPU_CASES[case]
    full = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    t = getattr(torch, dtype)
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=t)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=t) for _ in range(2))
    seed = int(rng.integers(1 << 63)) * 2 + 1  # the high word of the key used too
    p = 0.17
    out, lse = cupyflash.attention(q, k, v, dropout_p=p, seed=seed, return_lse=True, **options)
    dout = torch.randn_like(q)
    grads = cupyflash.attention_backward(
        dout, q, k, v, out, lse, dropout_p=p, seed=seed, deterministic=deterministic, **options
    )
    keep = dropout_keep(p, seed, b, hq, nq, nk)
    check_forward_backward_against_formula(out, grads, q, k, v, dout, dropout=(p, keep), **full)


@pytest.mark.gpu
def test_gpu_dropout_repeats_under_one_seed_and_keeps_1_minus_p():
    torch = need_torch()
    q, k = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.ones_like(k)  # O = the kept fraction of each row's P, scaled: 1 on average
    out_a = cupyflash.attention(q, k, v, dropout_p=0.3, seed=21)
    out_b = cupyflash.attention(q, k, v, dropout_p=0.3, seed=21)
    out_c = cupyflash.attention(q, k, v, dropout_p=0.3, seed=22)
    assert torch.equal(out_a, out_b) and not torch.equal(out_a, out_c)
    assert abs(out_a.float().mean().item() - 1.0) < 0.02
    q0 = torch.zeros_like(q)  # uniform P: O = kept keys / Nk / (1 - p)
    kept = cupyflash.attention(q0, k, v, dropout_p=0.3, seed=23).float()[..., 0] * 0.7
    assert abs(kept.mean().item() - 0.7) < 0.003


@pytest.mark.gpu
def test_gpu_varlen_and_autograd_with_dropout():
    torch = need_torch()
    torch.manual_seed(5)
    cu = torch.tensor([0, 33, 33, 130], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(130, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = cupyflash.attention_varlen(q, k, v, cu, cu, 97, 97, causal=True, dropout_p=0.2, seed=77)
    dout = torch.randn_like(out)
    out.backward(dout)
    for b in (0, 2):
        s = slice(int(cu[b]), int(cu[b + 1]))
        n = s.stop - s.start
        keep = dropout_keep(0.2, 77, 1, 4, n, n, batch0=b)
        seq = [x.detach()[s][None].double().requires_grad_(True) for x in (q, k, v)]
        want = naive_low_precision(*seq, causal=True, window=(-1, -1), softcap=0.0, scale=None, layout="bshd",
                                   dropout=(0.2, keep))  # fmt: skip
        (want * dout[s][None].double()).sum().backward()
        torch.testing.assert_close(out[s].double(), want[0].detach(), atol=4e-3, rtol=4e-3)
        for leaf, ref in zip((q, k, v), seq):
            torch.testing.assert_close(leaf.grad[s].double(), ref.grad[0], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_dropout_under_graph_capture_needs_a_seed():
    torch = need_torch()
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cupyflash.attention(q, k, v, dropout_p=0.1, seed=1)  # compiled and planned before capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="seed"), torch.cuda.graph(graph, stream=stream):
            cupyflash.attention(q, k, v, dropout_p=0.1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = cupyflash.attention(q, k, v, dropout_p=0.1, seed=1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cupyflash.attention(q, k, v, dropout_p=0.1, seed=1))


@pytest.mark.gpu
def test_gpu_fa3_refuses_dropout_and_auto_runs_fa2():
    torch = need_torch()
    q, k, v = (torch.randn(1, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="dropout"):
        cupyflash.attention(q, k, v, dropout_p=0.1, seed=1, algorithm="fa3")
    assert torch.equal(
        cupyflash.attention(q, k, v, dropout_p=0.1, seed=1), cupyflash.attention(q, k, v, dropout_p=0.1, seed=1,
                                                                                  algorithm="fa2")
    )  # fmt: skip
