"""PyTorch integration (cupyflash/_torch_ops.py): the custom ops' autograd, fake kernels and
torch.compile. On the CPU (CI) the ops run the array-API path, so gradcheck in float64 checks the
backward's formulas through the same op a GPU call uses; the `gpu` tests add the kernels,
torch.compile on CUDA tensors and CUDA-graph capture of a training step."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import rel_error

import cupyflash

torch = pytest.importorskip("torch")


def _leaves(*shapes, dtype=torch.float64, device="cpu"):
    return [torch.randn(s, dtype=dtype, device=device, requires_grad=True) for s in shapes]


@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"window": (3, 2), "softcap": 2.0},
        {"causal": True, "scale": -0.4, "layout": "bhsd"},
    ],
    ids=str,
)
def test_gradcheck_dense(options):
    torch.manual_seed(0)
    layout = options.get("layout", "bshd")
    shape = (lambda n, h: (2, n, h, 8)) if layout == "bshd" else (lambda n, h: (2, h, n, 8))
    q, k, v = _leaves(shape(5, 4), shape(7, 2), shape(7, 2))

    def f(q, k, v):  # both outputs: the LSE's gradient is part of the op's backward
        return cupyflash.attention(q, k, v, return_lse=True, **options)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_gradcheck_varlen():
    torch.manual_seed(1)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = _leaves((7, 2, 8), (11, 1, 8), (11, 1, 8))  # no padding row: its LSE is -inf, no derivative

    def f(q, k, v):
        return cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_outputs_carry_the_graph_and_no_grad_mode_does_not():
    q, k, v = _leaves((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8))
    out = cupyflash.attention(q, k, v)
    assert out.requires_grad and "cupyflash" in type(out.grad_fn).__name__
    with torch.no_grad():
        assert not cupyflash.attention(q, k, v).requires_grad


@pytest.mark.parametrize("used", ["out", "lse", "both"])
@pytest.mark.parametrize("entry", ["dense", "varlen"])
def test_the_eager_route_equals_the_custom_op(entry, used):
    """Eager calls that need grad take the ops' bodies through one autograd.Function (no
    dispatcher); their gradients equal the custom op's, whichever outputs the loss reads (a
    gradient that reaches only lse is not made into zeros first), and a second derivative raises."""
    from cupyflash import _torch_ops

    torch.manual_seed(11)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    if entry == "dense":
        q, k, v = _leaves((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8))
        rest = (True, 0.3, -1, 0, 0.0, "bshd", "auto", False, 0.0, torch.tensor(0), None, None)
        eager = cupyflash.attention(q, k, v, causal=True, scale=0.3, return_lse=True)
        op = _torch_ops.attention_op
        assert type(eager[0].grad_fn).__name__ == "cupyflash_attentionBackward"
    else:
        q, k, v = _leaves((7, 2, 8), (7, 1, 8), (7, 1, 8))
        rest = (cu, cu, 4, 4, True, 0.3, -1, 0, 0.0, "auto", False, 0.0, torch.tensor(0), None, None)
        eager = cupyflash.attention_varlen(q, k, v, cu, cu, 4, 4, causal=True, scale=0.3, return_lse=True)
        op = _torch_ops.attention_varlen_op
        assert type(eager[0].grad_fn).__name__ == "cupyflash_attention_varlenBackward"
    through_op = op(q, k, v, *rest)
    weights = {"out": (1.0, 0.0), "lse": (0.0, 1.0), "both": (1.0, 1.0)}[used]

    def loss(out, lse):
        finite = torch.where(torch.isfinite(lse), lse, 0.0)
        terms = [w * t for w, t in zip(weights, (out.square().sum(), finite.sin().sum())) if w]
        return sum(terms)

    torch.testing.assert_close(eager[0], through_op[0], rtol=0, atol=0)
    want = torch.autograd.grad(loss(*through_op), (q, k, v), allow_unused=True)
    got = torch.autograd.grad(loss(*eager), (q, k, v), create_graph=False, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    again = cupyflash.attention(q, k, v) if entry == "dense" else cupyflash.attention_varlen(q, k, v, cu, cu, 4, 4)
    (dq,) = torch.autograd.grad(again.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiable"):
        dq.sum().backward()


def test_the_eager_route_carries_dropout_alibi_and_determinism():
    """Dropout with a given seed (the mask regenerated in the backward), ALiBi slopes and
    deterministic mode through the eager route: the custom op's output and gradients, bit for bit."""
    from cupyflash import _torch_ops

    torch.manual_seed(12)
    q, k, v = _leaves((2, 6, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32)
    dout = torch.randn(2, 6, 4, 8, dtype=torch.float64)
    eager = cupyflash.attention(q, k, v, causal=True, dropout_p=0.3, seed=77, alibi_slopes=slopes, deterministic=True)
    assert type(eager.grad_fn).__name__ == "cupyflash_attentionBackward"
    scale = 1.0 / math.sqrt(8)  # as the public function computes the default
    rest = (True, scale, -1, 0, 0.0, "bshd", "auto", True, 0.3, torch.tensor(77), slopes, None)
    through_op, _ = _torch_ops.attention_op(q, k, v, *rest)
    torch.testing.assert_close(eager, through_op, rtol=0, atol=0)
    got = torch.autograd.grad(eager, (q, k, v), dout)
    want = torch.autograd.grad(through_op, (q, k, v), dout)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck_the_custom_ops():
    """torch.library.opcheck: the fake kernels match the real ones, the schemas are honest, the
    autograd registration is consistent (CPU tensors; the GPU test runs CUDA ones)."""
    from cupyflash import _torch_ops

    torch.manual_seed(2)
    q, k, v = _leaves((2, 6, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16), dtype=torch.float32)
    for dropout_p, seed in ((0.0, 0), (0.3, 1234)):  # without dropout, and with it (seed tensor)
        seed_t = torch.tensor(seed, dtype=torch.int64)
        args = (q, k, v, True, 0.25, -1, 0, 0.0, "bshd", "auto", False, dropout_p, seed_t, None)
        torch.library.opcheck(_torch_ops.attention_op, args)
        out, lse = _torch_ops.attention_op(*args)
        saved = [x.detach() for x in (q, k, v, out, lse)]  # no double backward: plain tensors
        bwd = (torch.randn_like(out), *saved, None, True, 0.25, -1, 0, 0.0, "bshd", False, dropout_p, seed_t, None)
        torch.library.opcheck(_torch_ops.attention_backward_op, bwd)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    args = (q, k, v, True, 0.25, -1, 0, 0.0, "bshd", "auto", False, 0.0, torch.tensor(0), slopes)
    torch.library.opcheck(_torch_ops.attention_op, args)


class _Block(torch.nn.Module):
    """A causal self-attention block on cupyflash."""

    def __init__(self, heads: int = 4, head_dim: int = 32) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).unbind(2)
        return self.proj(cupyflash.attention(q, k, v, causal=True).reshape(b, n, -1))


def _check_compiled_block(device: str, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(3)
    block = _Block().to(device, dtype)
    x = torch.randn(2, 40, 128, device=device, dtype=dtype)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(block, fullgraph=True)
    assert (compiled(x) - block(x)).abs().max().item() <= tol

    def loss_and_grads(model):
        for p in block.parameters():
            p.grad = None
        model(x).float().square().mean().backward()
        return [p.grad.clone() for p in block.parameters()]

    for got, want in zip(loss_and_grads(compiled), loss_and_grads(block)):
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def test_torch_compile_fullgraph_forward_and_training_step():
    torch._dynamo.reset()
    _check_compiled_block("cpu", torch.float32, 1e-5)


def test_torch_compile_decode_step_with_cache_append():
    """attention_with_kvcache compiled (fullgraph): one op in the graph, the caches written in
    place exactly as in eager mode, the same output; opcheck on the op."""
    from cupyflash import _torch_ops

    torch._dynamo.reset()
    torch.manual_seed(7)
    q = torch.randn(2, 1, 4, 16)
    k_new, v_new = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    caches = [torch.randn(2, 16, 2, 16) for _ in range(2)]
    eager_caches = [c.clone() for c in caches]

    def step(q, k_cache, v_cache):
        out = cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k_new=k_new, v_new=v_new)
        return out * 2.0

    explained = torch._dynamo.explain(step)(q, *[c.clone() for c in caches])
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, *caches)
    want = step(q, *eager_caches)
    torch.testing.assert_close(got, want)
    for c, e in zip(caches, eager_caches):
        torch.testing.assert_close(c, e)  # k_new, v_new appended by the compiled step too
    assert torch.equal(caches[0][1, 9], k_new[1, 0])
    args = (q, torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16), lens, 0, None, k_new, v_new, True, 0.25, 0)
    torch.library.opcheck(_torch_ops.attention_with_kvcache_op, args)


def test_the_cache_call_refuses_tensors_that_require_grad_and_fp8_options_under_compile():
    """attention_with_kvcache has no backward: any of its tensors that requires grad is refused by
    name (ALiBi slopes with their own message), never passed back detached; its float8 scales
    are refused under torch.compile (the op does not take them yet)."""
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    cos, sin = torch.randn(16, 4), torch.randn(16, 4)
    new = torch.randn(2, 1, 2, 16)
    given = [("k_cache", {}), ("rotary_cos", {"rotary_cos": cos, "rotary_sin": sin, "k_new": new, "v_new": new})]
    for name, extra in given:
        arrays = {"q": q, "k_cache": k_cache.clone(), "v_cache": v_cache.clone(), **extra}
        arrays[name] = arrays[name].clone().requires_grad_(True)
        with pytest.raises(RuntimeError, match="attention_with_kvcache has no backward pass"):
            cupyflash.attention_with_kvcache(**arrays, cache_seqlens=3)
        with torch.no_grad():
            cupyflash.attention_with_kvcache(**arrays, cache_seqlens=3)
    slopes = torch.rand(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="alibi_slopes require grad"):
        cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, alibi_slopes=slopes)
    torch._dynamo.reset()
    step = torch.compile(
        lambda q: cupyflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, k_scale=0.5), fullgraph=True
    )
    with pytest.raises(Exception, match="k_scale / v_scale / kv_dtype do not go through torch.compile"):
        step(q)


def _check_compiled_loss(f, q, k, v) -> None:
    """f(q, k, v), a scalar loss, compiled (fullgraph): no graph break, eager's gradients."""
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.compile(f, fullgraph=True)(q, k, v).backward()
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    f(q, k, v).backward()
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, b)


def test_torch_compile_varlen_and_its_backward():
    """attention_varlen compiled (fullgraph) forward and backward: no graph break, eager's
    gradients; opcheck on the varlen ops."""
    from cupyflash import _torch_ops

    torch._dynamo.reset()
    torch.manual_seed(8)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    q, k, v = _leaves((11, 4, 16), (11, 2, 16), (11, 2, 16), dtype=torch.float32)

    def f(q, k, v):
        return cupyflash.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True).square().sum()

    _check_compiled_loss(f, q, k, v)
    for dropout_p, seed in ((0.0, 0), (0.25, 99)):
        args = (q, k, v, cu, cu, 7, 7, True, 0.25, -1, 0, 0.0, "auto", False, dropout_p, torch.tensor(seed), None, None)
        torch.library.opcheck(_torch_ops.attention_varlen_op, args)


def test_torch_compile_and_opcheck_with_an_attn_mask():
    """attention with a key-padding attn_mask compiled (fullgraph): no graph break, eager's
    output and gradients; opcheck on the ops with a mask (boolean and additive)."""
    from cupyflash import _torch_ops

    torch._dynamo.reset()
    torch.manual_seed(9)
    q, k, v = _leaves((2, 6, 4, 16), (2, 9, 2, 16), (2, 9, 2, 16), dtype=torch.float32)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., :4] = False

    def f(q, k, v):
        return cupyflash.attention(q, k, v, causal=True, attn_mask=keep).square().sum()

    _check_compiled_loss(f, q, k, v)
    for mask in (keep, torch.randn(1, 4, 6, 9)):
        args = (q, k, v, True, 0.25, -1, 0, 0.0, "bshd", "auto", False, 0.0, torch.tensor(0), None, mask)
        torch.library.opcheck(_torch_ops.attention_op, args)
        out, lse = _torch_ops.attention_op(*args)
        saved = [x.detach() for x in (q, k, v, out, lse)]
        bwd = (torch.randn_like(out), *saved, None, True, 0.25, -1, 0, 0.0, "bshd", False, 0.0, torch.tensor(0), None,
               mask)  # fmt: skip
        torch.library.opcheck(_torch_ops.attention_backward_op, bwd)


def test_importing_cupyflash_does_not_import_torch():
    code = "import sys, cupyflash; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# On the GPU: the kernels behind the ops.
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_autograd_equals_attention_backward():
    torch.manual_seed(4)
    q, k, v = _leaves((2, 100, 8, 64), (2, 130, 2, 64), (2, 130, 2, 64), dtype=torch.bfloat16, device="cuda")
    out, lse = cupyflash.attention(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.autograd.backward((out, lse), (dout, dlse))
    with torch.no_grad():
        want = cupyflash.attention_backward(dout, q, k, v, out, lse, dlse=dlse, causal=True)
    for x, w in zip((q, k, v), want):
        assert rel_error(x.grad.double().cpu().numpy(), w.double().cpu().numpy()) < 1e-2


@pytest.mark.gpu
def test_gpu_deterministic_autograd_repeats_bit_for_bit():
    torch.manual_seed(6)
    q, k, v = _leaves((2, 200, 4, 128), (2, 200, 2, 128), (2, 200, 2, 128), dtype=torch.bfloat16, device="cuda")
    dout = torch.randn_like(q.detach())
    grads = []
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        cupyflash.attention(q, k, v, causal=True, deterministic=True).backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    for again in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], again))


def test_deterministic_must_be_a_bool():
    q = np.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        cupyflash.attention(q, q, q, deterministic="yes")
    with pytest.raises(ValueError, match="deterministic must be a bool"):
        cupyflash.attention_backward(q, q, q, q, q, np.zeros((1, 1, 4)), deterministic=1)


@pytest.mark.gpu
def test_gpu_opcheck():
    from cupyflash import _torch_ops

    q, k, v = _leaves((1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), dtype=torch.float16, device="cuda")
    for dropout_p in (0.0, 0.2):
        args = (q, k, v, False, 0.125, -1, -1, 0.0, "bshd", "auto", True, dropout_p, torch.tensor(5), None)
        torch.library.opcheck(_torch_ops.attention_op, args)


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    torch._dynamo.reset()
    _check_compiled_block("cuda", torch.bfloat16, 3e-2)


@pytest.mark.gpu
def test_gpu_training_step_captures_in_a_cuda_graph():
    """Forward and backward of the ops inside torch.cuda.graph: replay with new inputs gives the
    eager gradients (the kernels run on PyTorch's capture stream and allocate through it)."""
    torch.manual_seed(5)
    q, k, v = _leaves((2, 64, 4, 64), (2, 64, 4, 64), (2, 64, 4, 64), dtype=torch.float16, device="cuda")
    dout = torch.randn_like(q.detach())

    def step():
        for x in (q, k, v):
            x.grad = None
        cupyflash.attention(q, k, v, causal=True).backward(dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and plan before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for x in (q, k, v):
        x.grad = None
    with torch.cuda.graph(graph):
        cupyflash.attention(q, k, v, causal=True).backward(dout)
    captured = [x.grad for x in (q, k, v)]
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    replayed = [g.clone() for g in captured]
    step()
    for got, want in zip(replayed, (q.grad, k.grad, v.grad)):
        assert rel_error(got.double().cpu().numpy(), want.double().cpu().numpy()) < 1e-2
    assert np.isfinite(replayed[0].double().cpu().numpy()).all()
