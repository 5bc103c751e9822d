"""ALiBi (flash-attn's ``alibi_slopes``): the score of query i and key j gains
``-slope * |i + Nk - Nq - j|``, slopes ``(Hq,)`` or ``(B, Hq)``.

Host tests: every host algorithm against the explicit formula (``helpers.naive_low_precision``
with its ``alibi_slopes``), with causal, a window and softcap; the backward against PyTorch
autograd of the formula; gradcheck through the custom op; packed sequences (each its own
distance and, for (B, Hq) slopes, its own row); bad shapes. GPU tests: the FA2 kernels (forward,
backward with atomic and deterministic dQ; with softcap too) against the float64 formula, every
head dim; packed
sequences; the kernels without ALiBi refuse it by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FULL, check_forward_backward_against_formula, naive_low_precision, need_torch

import cupyflash

HOST_CASES = [{"causal": True}, {"window": (6, 3)}, {"softcap": 4.0}, {}]


def _slopes(torch, batch, heads, per_batch, device="cpu"):
    base = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)  # the ALiBi paper's geometric slopes
    return (base[None] * torch.rand(batch, 1) * 2 if per_batch else base).float().to(device)


@pytest.mark.parametrize("per_batch", (False, True), ids=("H", "BH"))
@pytest.mark.parametrize("options", HOST_CASES, ids=str)
@pytest.mark.parametrize("algorithm", ("fa2", "naive", "fa1", "decode"))
def test_host_algorithms_match_the_formula(options, per_batch, algorithm):
    torch = need_torch()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, n, h, 16, dtype=torch.float64) for n, h in ((37, 4), (45, 2), (45, 2)))
    slopes = _slopes(torch, 2, 4, per_batch).double()
    if (
        algorithm == "decode"
        and options.get("window", (-1, -1)) != (-1, -1)
        or algorithm == "decode"
        and options.get("softcap")
    ):
        pytest.skip("the decode algorithm takes no window or softcap")
    full = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    got = cupyflash.attention(q, k, v, alibi_slopes=slopes, algorithm=algorithm, **options)
    want = naive_low_precision(q, k, v, layout="bshd", alibi_slopes=slopes, **full)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # the formula's scores are float32


@pytest.mark.parametrize("per_batch", (False, True), ids=("H", "BH"))
@pytest.mark.parametrize("options", HOST_CASES, ids=str)
def test_host_backward_matches_autograd_of_the_formula(options, per_batch):
    torch = need_torch()
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, n, h, 16, dtype=torch.float64) for n, h in ((33, 4), (40, 2), (40, 2)))
    slopes = _slopes(torch, 2, 4, per_batch).double()
    full = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    out, lse = cupyflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **options)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    dout = torch.randn_like(q)
    (naive_low_precision(*leaves, layout="bshd", alibi_slopes=slopes, **full) * dout).sum().backward()
    grads = cupyflash.attention_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, **options)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)


def test_gradcheck_through_the_custom_ops():
    torch = need_torch()
    torch.manual_seed(2)
    slopes = torch.tensor([0.5, 0.125], dtype=torch.float64)
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, requires_grad=True) for n in (6, 9, 9))
    torch.autograd.gradcheck(
        lambda *x: cupyflash.attention(*x, causal=True, alibi_slopes=slopes), (q, k, v), fast_mode=not FULL
    )
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qv, kv, vv = (torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    per_seq = torch.tensor([[0.5, 0.125], [0.25, 1.0]], dtype=torch.float64)
    torch.autograd.gradcheck(
        lambda *x: cupyflash.attention_varlen(*x, cu, cu, 5, 5, causal=True, alibi_slopes=per_seq),
        (qv, kv, vv),
        fast_mode=not FULL,
    )


def test_varlen_uses_each_sequences_distance_and_slopes():
    torch = need_torch()
    torch.manual_seed(3)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 13], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 8, dtype=torch.float64), *(torch.randn(13, 2, 8, dtype=torch.float64) for _ in "kv")
    slopes = _slopes(torch, 2, 4, True).double()
    packed = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 7, 9, causal=True, alibi_slopes=slopes)
    for b in range(2):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        want = naive_low_precision(q[sq][None], k[sk][None], v[sk][None], causal=True, window=(-1, -1), softcap=0.0,
                                   scale=None, layout="bshd", alibi_slopes=slopes[b])  # fmt: skip
        torch.testing.assert_close(packed[sq], want[0], rtol=1e-5, atol=1e-6)


def test_bad_slopes_raise():
    q = k = v = np.ones((2, 4, 3, 8))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cupyflash.attention(q, k, v, alibi_slopes=np.ones(2))
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        cupyflash.attention(q, k, v, alibi_slopes=np.ones((3, 3)))
    with pytest.raises(TypeError, match="alibi_slopes must have a real floating dtype"):
        cupyflash.attention(q, k, v, alibi_slopes=np.ones(3, dtype=np.int32))
    torch = need_torch()
    learnable = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="alibi_slopes require grad"):
        cupyflash.attention(*(torch.ones(2, 4, 3, 8) for _ in range(3)), alibi_slopes=learnable)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------
GPU_CASES = {  # (B, Nq, Nk, Hq, Hkv, options)
    "plain-gqa-odd": (2, 97, 130, 4, 2, {}),
    "causal-nq>nk": (1, 150, 100, 2, 1, {"causal": True}),
    "window": (1, 70, 200, 2, 2, {"window": (40, 8)}),
    "softcap-causal": (2, 90, 150, 4, 2, {"causal": True, "softcap": 3.0}),  # the cap, then ALiBi
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("head_dim", (32, 64, 96, 128, 192, 256))
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("variant", ("H-atomic", "BH-deterministic"))
def test_gpu_forward_and_backward_match_the_formula(rng, dtype, head_dim, case, variant):
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    b, nq, nk, hq, hkv, options = GPU_CASES[case]
    full = {"causal": False, "window": (-1, -1), "softcap": 0.0, "scale": None, **options}
    t = getattr(torch, dtype)
    q = torch.randn(b, nq, hq, head_dim, device="cuda", dtype=t)
    k, v = (torch.randn(b, nk, hkv, head_dim, device="cuda", dtype=t) for _ in range(2))
    slopes = _slopes(torch, b, hq, variant.startswith("BH"), "cuda")
    deterministic = variant.endswith("deterministic")
    out, lse = cupyflash.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **options)
    dout = torch.randn_like(q)
    grads = cupyflash.attention_backward(
        dout, q, k, v, out, lse, alibi_slopes=slopes, deterministic=deterministic, **options
    )
    check_forward_backward_against_formula(out, grads, q, k, v, dout, alibi_slopes=slopes, **full)


@pytest.mark.gpu
def test_gpu_varlen_with_alibi_and_dropout():
    torch = need_torch()
    torch.manual_seed(6)
    cu = torch.tensor([0, 40, 40, 170], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(170, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = _slopes(torch, 3, 4, True, "cuda")
    out = cupyflash.attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, alibi_slopes=slopes)
    for b in (0, 2):
        s = slice(int(cu[b]), int(cu[b + 1]))
        want = naive_low_precision(*(x[s][None].double() for x in (q, k, v)), causal=True, window=(-1, -1),
                                   softcap=0.0, scale=None, layout="bshd", alibi_slopes=slopes[b])  # fmt: skip
        torch.testing.assert_close(out[s].double(), want[0], atol=2e-2, rtol=2e-2)
    # with dropout too: the same kernel flags combined, against the host twin on the same seed
    host = [x.double().cpu() for x in (q, k, v)]
    got = cupyflash.attention_varlen(q, k, v, cu, cu, 130, 130, causal=True, alibi_slopes=slopes, dropout_p=0.2,
                                     seed=3)  # fmt: skip
    want = cupyflash.attention_varlen(*host, cu.cpu(), cu.cpu(), 130, 130, causal=True,
                                      alibi_slopes=slopes.double().cpu(), dropout_p=0.2, seed=3)  # fmt: skip
    torch.testing.assert_close(got.double().cpu(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_kernels_without_alibi_refuse_it():
    torch = need_torch()
    q, k, v = (torch.randn(1, 128, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], device="cuda")
    if torch.cuda.get_device_capability() == (9, 0):  # the Hopper forward has it: as FA2's
        hopper = cupyflash.attention(q, k, v, alibi_slopes=slopes, algorithm="fa3")
        fa2 = cupyflash.attention(q, k, v, alibi_slopes=slopes, algorithm="fa2")
        torch.testing.assert_close(hopper, fa2, atol=2e-2, rtol=0)
    with pytest.raises(ValueError, match="ALiBi"):
        cupyflash.attention(q[:, :1], k, v, alibi_slopes=slopes, algorithm="decode")
    with pytest.raises(TypeError, match="float32"):
        cupyflash.attention(q, k, v, alibi_slopes=slopes.double())
    one = cupyflash.attention(q[:, :1], k, v, alibi_slopes=slopes)  # auto: FA2 for one token with ALiBi
    assert torch.equal(one, cupyflash.attention(q[:, :1], k, v, alibi_slopes=slopes, algorithm="fa2"))


def test_compiled_calls_refuse_learnable_slopes_too():
    torch = need_torch()
    torch._dynamo.reset()
    q = torch.ones(2, 4, 3, 8, requires_grad=True)
    learnable = torch.ones(3, requires_grad=True)
    f = torch.compile(lambda q, s: cupyflash.attention(q, q, q, alibi_slopes=s), fullgraph=True)
    with pytest.raises(Exception, match="alibi_slopes require grad"):
        f(q, learnable)
    assert f(q, learnable.detach()).requires_grad  # constant slopes: the call trains as usual
