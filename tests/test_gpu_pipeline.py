"""What the one GPU pipeline promises on every entry point: no tensor that requires grad comes
back silently detached (it gets its gradient, or a refusal), tensor subclasses are tensors (graph
capture included), options are accepted or refused the same way on a cold and a warm plan
cache, ``algorithm="decode"`` (and "auto" for one query token) runs the split-KV kernel on plain
``attention`` inputs, understated varlen maxima keep the mask, and running out of memory raises
the caller's library's error."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_attention, gpu_inputs, need_torch, rel_error

import cupyflash
from cupyflash import _plan, reference

pytestmark = pytest.mark.gpu


def test_inputs_that_require_grad_get_gradients_not_detached(rng):
    """A tensor that requires grad goes through the custom op and its backward (no silent
    detach); the KV-cache call, which has no backward, refuses it."""
    torch = need_torch()
    q, k, v = gpu_inputs(rng, (1, 33, 4, 64), (1, 40, 2, 64), "bfloat16")
    q.requires_grad_(True)
    out = cupyflash.attention(q, k, v)
    assert out.requires_grad and out.grad_fn is not None
    dout = torch.randn_like(out)
    out.backward(dout)
    with torch.no_grad():  # inference on a parameter: the kernels directly
        out2, lse = cupyflash.attention(q, k, v, return_lse=True)
        dq = cupyflash.attention_backward(dout, q, k, v, out2, lse)[0]
    assert not out2.requires_grad
    assert rel_error(q.grad.double().cpu().numpy(), dq.double().cpu().numpy()) < 1e-2
    kc, vc = (torch.zeros(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kc.requires_grad_(True)
    with pytest.raises(RuntimeError, match="attention_with_kvcache has no backward pass"):
        cupyflash.attention_with_kvcache(q[:, :1].detach().expand(2, 1, 4, 64), kc, vc, cache_seqlens=3)


def test_parameters_mix_with_tensors_and_capture_in_a_graph(rng):
    """nn.Parameter (a tensor subclass) beside plain tensors stays on the torch path: PyTorch's
    stream, so a CUDA graph captures the call."""
    torch = need_torch()
    q, k, v = gpu_inputs(rng, (2, 64, 4, 128), (2, 96, 4, 128), "float16")
    k = torch.nn.Parameter(k, requires_grad=False)
    ref = reference.attention(q, k.detach(), v, causal=True)
    out = cupyflash.attention(q, k, v, causal=True)
    assert rel_error(reference.to_numpy64(out), ref) < 2e-3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cupyflash.attention(q, k, v, causal=True)  # warm (compiled, planned) before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cupyflash.attention(q, k, v, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(reference.to_numpy64(captured), reference.attention(q, k.detach(), v, causal=True)) < 2e-3
    # the KV cache path takes a parameter cache too
    cache = torch.nn.Parameter(torch.randn(2, 64, 4, 128, device="cuda", dtype=torch.float16), requires_grad=False)
    out = cupyflash.attention_with_kvcache(q[:, :1].contiguous(), cache, cache, cache_seqlens=50)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_numpy_scalars_are_options_on_cold_and_warm_caches(rng, lib):
    q, k, v = gpu_inputs(rng, (1, 17, 2, 64), (1, 23, 2, 64), "float16", lib=lib)
    _plan.clear_caches()
    cold = cupyflash.attention(q, k, v, causal=np.True_, scale=np.float32(0.125))
    warm = cupyflash.attention(q, k, v, causal=True, scale=0.125)
    again = cupyflash.attention(q, k, v, causal=np.True_, scale=np.float32(0.125))
    ref = reference.attention(q, k, v, causal=True, scale=0.125)
    for out in (cold, warm, again):
        assert rel_error(reference.to_numpy64(out), ref) < 2e-3
    for order in ("cold", "warm"):
        if order == "cold":
            _plan.clear_caches()
        with pytest.raises(ValueError, match="causal must be a bool"):
            cupyflash.attention(q, k, v, causal=1.0)
        cupyflash.attention(q, k, v, causal=True)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize(("nq", "causal"), [(1, False), (3, True), (16, True)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_algorithm_on_attention_inputs(rng, layout, nq, causal, head_dim):
    shape_q, shape_kv = (2, nq, 8, head_dim), (2, 777, 2, head_dim)
    if layout == "bhsd":
        shape_q, shape_kv = (2, 8, nq, head_dim), (2, 2, 777, head_dim)
    q, k, v = gpu_inputs(rng, shape_q, shape_kv, "bfloat16")
    check_attention(q, k, v, causal=causal, layout=layout, algorithm="decode")
    if nq == 1:  # "auto" runs one-token queries on the same kernel
        check_attention(q, k, v, layout=layout)


def test_decode_algorithm_refuses_what_it_cannot_compute(rng):
    q, k, v = gpu_inputs(rng, (1, 1, 4, 64), (1, 100, 4, 64), "float16")
    with pytest.raises(ValueError, match="algorithm='decode' takes"):
        cupyflash.attention(q, k, v, dropout_p=0.2, seed=1, algorithm="decode")
    for options in ({"window": (10, 0)}, {"window": (30, 5), "softcap": 4.0}):  # the decode kernel's own
        check_attention(q, k, v, algorithm="decode", **options)
        check_attention(q, k, v, **options)


@pytest.mark.parametrize("algorithm", ["fa2", "fa3", "auto"])
def test_understated_varlen_maxima_keep_the_mask(rng, algorithm):
    """max_seqlen_q = 1 while a sequence has 5 queries (causal), and max_seqlen_k = 8 while one
    has 40 keys (window): the maxima size the grid, the mask comes from the options."""
    torch = need_torch()
    from helpers import skip_unless_kernel

    skip_unless_kernel(algorithm, 64)
    lengths_q, lengths_k = [5, 3], [40, 7]
    cu_q = torch.tensor(np.cumsum([0, *lengths_q]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0, *lengths_k]), dtype=torch.int32, device="cuda")
    q, k, v = gpu_inputs(rng, (sum(lengths_q), 4, 64), (sum(lengths_k), 4, 64), "bfloat16")
    for kwargs, maxima in (({"causal": True}, (1, 40)), ({"window": (10, 0)}, (5, 8))):
        out = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, *maxima, algorithm=algorithm, **kwargs)
        for b in range(2):
            q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
            k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
            ref = reference.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
            got = reference.to_numpy64(out[None, q0:q1])
            assert rel_error(got, ref) < 1e-2, (kwargs, b)


@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_out_of_memory_is_the_callers_error_and_leaves_the_library_usable(rng, lib):
    q, k, v = gpu_inputs(rng, (1, 8, 8, 128), (1, 64, 8, 128), "float16", lib=lib)
    rows = 1 << 28  # a zero-stride view of 2^28 query rows: its output needs 512 GiB
    if lib == "torch":
        torch = need_torch()
        big_q = q[:, :1].expand(1, rows, 8, 128)
        error: type[BaseException] = torch.OutOfMemoryError
    else:
        import cupy

        big_q = cupy.broadcast_to(q[:, :1], (1, rows, 8, 128))
        error = cupy.cuda.memory.OutOfMemoryError
    with pytest.raises(error):
        cupyflash.attention(big_q, k, v)
    del big_q
    check_attention(q, k, v)


def test_merge_states_of_non_contiguous_parts(rng):
    torch = need_torch()
    q, k, v = gpu_inputs(rng, (2, 9, 4, 64), (2, 50, 4, 64), "bfloat16")
    o1, l1 = cupyflash.attention(q, k[:, :20], v[:, :20], return_lse=True)
    o2, l2 = cupyflash.attention(q, k[:, 20:], v[:, 20:], return_lse=True)
    o2_strided = torch.empty(2, 9, 8, 64, device="cuda", dtype=o2.dtype)[:, :, ::2]
    o2_strided.copy_(o2)
    o, lse = cupyflash.merge_states(o1, l1, o2_strided, l2)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert rel_error(reference.to_numpy64(o), ref) < 1e-2
    np.testing.assert_allclose(reference.to_numpy64(lse), ref_lse, atol=2e-3)
