"""``score_mod`` / ``mask_mod`` under ``torch.compile(fullgraph=True)`` and under ``jax.jit`` /
``jax.grad``, on the CPU: the compiled program runs the host path (the custom ops' bodies, the XLA
custom call's callbacks), so the wiring is checked here against the eager call and against float64
(PyTorch autograd of the formula, the functions evaluated on index grids). The functions' captured
arrays are inputs of the compiled program (new values: the new answer, no recompile), the numbers
they capture guarded (a new one recompiles); what is refused names what it refuses. The GPU twins
are in test_gpu_mods.py and test_gpu_jax.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import need_torch

import cupyflash
from cupyflash import mods

B, NQ, NK, HQ, HKV, D = 2, 37, 45, 4, 2, 16


def _window(left):
    """A sliding window made outside the compiled function (its number captured), bottom-right
    aligned as the built-in ``window=(left, 0)``."""
    return lambda b, h, i, j: (j <= i + (NK - NQ)) & (i + (NK - NQ) - j <= left)


def _document(doc_id):
    """Document masking over packed sequences: doc_id (NK,) captured."""
    return lambda b, h, i, j: doc_id[i] == doc_id[j]


def _softcap(cap):
    return lambda s, b, h, i, j: cap * mods.tanh(s / cap)


def _relative(table):
    """A relative-position bias read from a captured (NQ + NK - 1,) table."""
    return lambda s, b, h, i, j: s + table[i - j + (NK - 1)]


def _functions(lib, seed=0):
    """(name, score_mod, mask_mod), their captured arrays made by ``lib.asarray``."""
    rng = np.random.default_rng(seed)
    doc_id = lib.asarray(np.sort(rng.integers(0, 4, NK)).astype(np.int32))
    table = lib.asarray(rng.standard_normal(NQ + NK - 1).astype(np.float32))
    return [
        ("softcap", _softcap(20.0), None),
        ("relative-bias", _relative(table), None),
        ("document", None, _document(doc_id)),
        ("sliding-window", None, _window(6)),
        ("bias-and-document", _relative(table), _document(doc_id)),
    ]


def _formula(torch, q, k, v, score_mod, mask_mod):
    """float64 ``softmax(score_mod(scale q k^T) where mask_mod) v`` by PyTorch ops (differentiable),
    the user functions called on index grids (B, Hq, Nq, Nk)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / q.shape[-1] ** 0.5
    b, h, i, j = (torch.arange(n).view([-1 if a == axis else 1 for a in range(4)]) for axis, n in enumerate(s.shape))
    if score_mod is not None:
        s = score_mod(s, b, h, i, j).to(torch.float64)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, i, j), float("-inf"))
    return torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v)


def _leaves(torch, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, NQ, HQ, D), (B, NK, HKV, D), (B, NK, HKV, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def _value_and_grads(torch, f, leaves):
    for x in leaves:
        x.grad = None
    out = f(*leaves)
    out.square().sum().backward()
    return [out.detach(), *(x.grad.clone() for x in leaves)]


# -- torch.compile ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", range(5), ids=[name for name, _, _ in _functions(np)])
def test_compiled_forward_and_backward_match_eager_and_float64(case):
    torch = need_torch()
    torch._dynamo.reset()
    _, score_mod, mask_mod = _functions(torch)[case]

    def f(q, k, v):
        return cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)

    leaves = _leaves(torch)
    explained = torch._dynamo.explain(f)(*leaves)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = _value_and_grads(torch, torch.compile(f, fullgraph=True, backend="aot_eager"), leaves)
    eager = _value_and_grads(torch, f, leaves)
    formula = _value_and_grads(torch, lambda q, k, v: _formula(torch, q, k, v, score_mod, mask_mod), leaves)
    for name, got, e, want in zip(("out", "dq", "dk", "dv"), compiled, eager, formula, strict=True):
        torch.testing.assert_close(got, e, rtol=0, atol=0, msg=name)  # the same host path
        torch.testing.assert_close(got, want, msg=name)


def test_inductor_compiles_a_training_step_with_both_functions():
    """The default backend (Inductor) around the ops: a loss of a projection of the output."""
    torch = need_torch()
    torch._dynamo.reset()
    _, score_mod, mask_mod = _functions(torch)[4]
    weight = torch.randn(D, D, dtype=torch.float64)

    def f(q, k, v):
        return cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod) @ weight

    leaves = _leaves(torch)
    compiled = _value_and_grads(torch, torch.compile(f, fullgraph=True), leaves)
    formula = _value_and_grads(torch, lambda q, k, v: _formula(torch, q, k, v, score_mod, mask_mod) @ weight, leaves)
    for name, got, want in zip(("out", "dq", "dk", "dv"), compiled, formula, strict=True):
        torch.testing.assert_close(got, want, msg=name)


def test_captured_tensors_are_graph_inputs_and_captured_numbers_are_guarded():
    """The same function twice: one compilation. A new doc_id (same shape) in a new closure, or a
    captured table written in place: the new answer without a recompile. A new window width or
    softcap (numbers the functions capture): a recompile, and its answer."""
    torch = need_torch()
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, score_mod, mask_mod):
        return cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    q, k, v = (x.detach() for x in _leaves(torch))
    rng = np.random.default_rng(4)
    table = torch.from_numpy(rng.standard_normal(NQ + NK - 1))
    bias = _relative(table)
    docs = [torch.from_numpy(np.sort(rng.integers(0, n, NK))) for n in (3, 5)]
    first = compiled(q, k, v, bias, _document(docs[0]))
    second = compiled(q, k, v, bias, _document(docs[0]))
    assert counter.frame_count == 1
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(first, _formula(torch, q, k, v, bias, _document(docs[0])))
    new_doc = compiled(q, k, v, bias, _document(docs[1]))
    assert counter.frame_count == 1 and not torch.allclose(new_doc, first)
    torch.testing.assert_close(new_doc, _formula(torch, q, k, v, bias, _document(docs[1])))
    table.mul_(-3.0)  # in place: the graph reads it at run time
    torch.testing.assert_close(compiled(q, k, v, bias, _document(docs[1])), f(q, k, v, bias, _document(docs[1])))
    assert counter.frame_count == 1
    seen = counter.frame_count
    for width, new in ((3, True), (3, False), (9, True)):  # the captured width is guarded
        got = compiled(q, k, v, None, _window(width))
        torch.testing.assert_close(got, cupyflash.attention(q, k, v, window=(width, 0)))
        assert (counter.frame_count > seen) == new, (width, counter.frame_count)
        seen = counter.frame_count
    for cap, new in ((5.0, True), (7.5, True), (7.5, False)):  # the captured softcap too
        got = compiled(q, k, v, _softcap(cap), None)
        torch.testing.assert_close(got, cupyflash.attention(q, k, v, softcap=cap))
        assert (counter.frame_count > seen) == new, (cap, counter.frame_count)
        seen = counter.frame_count


def test_masks_built_from_masks_are_traced_through_under_compile():
    """and_masks / or_masks of masks made outside the compiled function: the arrays they capture
    a level or two down are graph inputs (a new doc_id: no recompile) and the numbers they capture
    are guarded (a new window width: a recompile)."""
    torch = need_torch()
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, mask_mod):
        return cupyflash.attention(q, k, v, mask_mod=mask_mod)

    def causal(b, h, i, j):
        return j <= i + (NK - NQ)

    compiled = torch.compile(f, fullgraph=True, backend=counter)
    q, k, v = (x.detach() for x in _leaves(torch))
    rng = np.random.default_rng(5)
    docs = [torch.from_numpy(np.sort(rng.integers(0, n, NK))) for n in (3, 5)]
    seen = 0
    for doc, width, new in ((0, 4, True), (0, 4, False), (1, 4, False), (1, 9, True)):
        mask_mod = mods.and_masks(causal, mods.or_masks(_document(docs[doc]), _window(width)))
        torch.testing.assert_close(compiled(q, k, v, mask_mod), _formula(torch, q, k, v, None, mask_mod))
        assert (counter.frame_count > seen) == new, (doc, width, counter.frame_count)
        seen = counter.frame_count


DOC_IDS = None  # a module global a function made inside the compiled region reads (set by the test)


def test_a_function_made_inside_the_compiled_function_reads_globals():
    """A lambda written in the compiled function that captures no local variable: its global
    array is a graph input too (written in place: the new answer), its global number guarded."""
    torch = need_torch()
    global DOC_IDS
    torch._dynamo.reset()
    DOC_IDS = torch.from_numpy(np.repeat(np.arange(3), [10, 20, 15]))

    def f(q, k, v):
        return cupyflash.attention(q, k, v, mask_mod=lambda b, h, i, j: (DOC_IDS[i] == DOC_IDS[j]) & (j <= i + 8))

    q, k, v = (x.detach() for x in _leaves(torch))
    explained = torch._dynamo.explain(f)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)
    DOC_IDS.copy_(torch.from_numpy(np.repeat(np.arange(3), [30, 5, 10])))
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=0, atol=0)


def test_what_compile_refuses_names_it():
    """An untraceable function (the eager message, naming the operation); a function made in the
    compiled region that captures its locals (how to write it instead); a captured tensor that
    requires grad (the eager message); dropout; a block mask (not yet under compile)."""
    torch = need_torch()
    torch._dynamo.reset()
    q, k, v = (x.detach() for x in _leaves(torch))

    def branchy(s, b, h, i, j):
        if i > j:
            return s
        return -s

    learned = _relative(torch.zeros(NQ + NK - 1, dtype=torch.float64, requires_grad=True))
    block_mask = cupyflash.create_block_mask(_window(3), None, None, NQ, NK, BLOCK_SIZE=16)
    cases = [
        (lambda q: cupyflash.attention(q, k, v, score_mod=branchy), r"score_mod uses `if`"),
        (lambda q, w=3: cupyflash.attention(q, k, v, mask_mod=lambda b, h, i, j: i - j < w + q.shape[1]),
         r"mask_mod made inside the compiled code cannot capture its local variables \(q, w\)"),
        (lambda q: cupyflash.attention(q, k, v, score_mod=learned), r"captured tensor gets no gradient from cupyflash"),
        (lambda q: cupyflash.attention(q, k, v, mask_mod=_window(3), dropout_p=0.1, seed=1),
         r"score_mod / mask_mod with dropout do not run under torch.compile yet"),
        (lambda q: cupyflash.attention(q, k, v, block_mask=block_mask),
         r"block_mask under torch.compile is not supported yet"),
    ]  # fmt: skip
    for f, message in cases:
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(f, fullgraph=True, backend="aot_eager")(q)


def test_opcheck_the_score_function_ops():
    """torch.library.opcheck on attention_mods and its backward: fake kernels, schemas, autograd."""
    torch = need_torch()
    from cupyflash import _mods, _torch_ops

    q, k, v = (x.detach().float().requires_grad_() for x in _leaves(torch))
    _, score_mod, mask_mod = _functions(torch)[4]
    score, mask = _mods.trace_score_mod(score_mod), _mods.trace_mask_mod(mask_mod)
    text, arrays = _mods.encode(_mods.static(score, mask)), list(_mods.captured(score, mask))
    sinks = torch.randn(HQ, requires_grad=True)
    args = (q, k, v, False, 0.25, -1, -1, 0.0, "bshd", "auto", False, None, sinks, False, text, arrays)
    torch.library.opcheck(_torch_ops.attention_mods_op, args)
    out, lse = _torch_ops.attention_mods_op(*args)
    saved = [x.detach() for x in (q, k, v, out, lse)]
    bwd = (torch.randn_like(out), *saved, torch.randn_like(lse), False, 0.25, -1, -1, 0.0, "bshd", False, None,
           sinks.detach(), text, arrays)  # fmt: skip
    torch.library.opcheck(_torch_ops.attention_mods_backward_op, bwd)


def test_the_op_text_round_trips_to_the_same_kernel_source():
    """encode / decode: the same expressions, so the same device functions (the kernel variant a
    compiled call runs is the eager call's)."""
    from cupyflash import _mods

    table = np.arange(10.0, dtype=np.float32)
    score = _mods.trace_score_mod(
        lambda s, b, h, i, j: mods.where(i > j, s * 2.5 + table[i - j], -float("inf")) + (i // 3 % 2) - mods.abs(s)
    )
    mask = _mods.trace_mask_mod(lambda b, h, i, j: ~(j > i) | (j < 2))
    pair = _mods.static(score, mask)
    again = _mods.decode(_mods.encode(pair))
    assert again == pair
    rebuilt = _mods.rebuilt(again, _mods.captured(score, mask))
    assert rebuilt[0].buffers == (table,) and rebuilt[1].buffers == ()
    assert _mods.kernel_mods(*rebuilt).source == _mods.kernel_mods(score, mask).source


# -- JAX ---------------------------------------------------------------------------------------------
def _jax():
    jax = pytest.importorskip("jax")
    return jax, jax.numpy


def _jax_inputs(jax, seed=1):
    rng = np.random.default_rng(seed)
    cpu = jax.devices("cpu")[0]
    shapes = ((B, NQ, HQ, D), (B, NK, HKV, D), (B, NK, HKV, D))
    return [jax.device_put(rng.standard_normal(s).astype(np.float32), cpu) for s in shapes]


def _host_value_and_grads(q, k, v, score_mod, mask_mod):
    """sum(out^2) and its gradients by the eager host path in float64 (``attention_backward``)."""
    host = [np.asarray(x, np.float64) for x in (q, k, v)]
    out, lse = cupyflash.attention(*host, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    grads = cupyflash.attention_backward(2 * out, *host, out, lse, score_mod=score_mod, mask_mod=mask_mod)
    return float(np.sum(out * out)), grads


@pytest.mark.parametrize("case", range(5), ids=[name for name, _, _ in _functions(np)])
def test_jit_and_grad_match_the_host_path_in_float64(case):
    jax, jnp = _jax()
    _, score_mod, mask_mod = _functions(jnp)[case]
    _, host_score, host_mask = _functions(np)[case]
    q, k, v = _jax_inputs(jax)

    def loss(q, k, v):
        out = cupyflash.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        return jnp.sum(out * out)

    hlo = jax.jit(loss).lower(q, k, v).as_text()
    assert "xla_buffer_python_cpu_callback" in hlo and "dot_general" not in hlo
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want_value, want = _host_value_and_grads(q, k, v, host_score, host_mask)
    np.testing.assert_allclose(float(value), want_value, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-5, err_msg=name)
    torch = pytest.importorskip("torch")  # and float64 autograd of the formula
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v)]
    _, host_score, host_mask = _functions(torch)[case]
    formula = _value_and_grads(torch, lambda q, k, v: _formula(torch, q, k, v, host_score, host_mask), leaves)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, formula[1:], strict=True):
        np.testing.assert_allclose(np.asarray(got), ref.numpy(), rtol=2e-4, atol=2e-5, err_msg=name)


def test_jit_captured_arrays_are_operands():
    """A captured array that is an argument of the jitted function: an operand of the custom calls,
    so a new doc_id runs the same compiled program with the new answer."""
    jax, jnp = _jax()
    from cupyflash import _jax as jax_ops

    q, k, v = _jax_inputs(jax)

    def loss(q, k, v, doc_id):
        return jnp.sum(cupyflash.attention(q, k, v, mask_mod=_document(doc_id), score_mod=_softcap(10.0)) ** 2)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    rng = np.random.default_rng(6)
    values = []
    for n in (2, 5):
        doc_id = np.sort(rng.integers(0, n, NK)).astype(np.int32)
        before = dict(jax_ops.runs)
        value, grads = f(q, k, v, jnp.asarray(doc_id))
        assert jax_ops.runs[("cpu", "forward")] == before.get(("cpu", "forward"), 0) + 1
        assert jax_ops.runs[("cpu", "backward")] == before.get(("cpu", "backward"), 0) + 1
        want_value, want = _host_value_and_grads(q, k, v, _softcap(10.0), _document(doc_id))
        np.testing.assert_allclose(float(value), want_value, rtol=1e-5)
        for got, ref in zip(grads, want, strict=True):
            np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-5)
        values.append(float(value))
    assert f._cache_size() == 1 and values[0] != values[1]


@pytest.mark.parametrize("argnums", [(0, 1, 2, 3), (3,)], ids=["all", "table-only"])
def test_jit_grad_of_a_learned_bias_table(argnums):
    """jax.jit(jax.grad) with respect to score_mod's captured table (beside q, k, v, or alone),
    with a mask_mod's integer array beside it: the table's gradient and q, k, v's against float64
    torch autograd of the formula; one backward run per call."""
    jax, jnp = _jax()
    from cupyflash import _jax as jax_ops

    torch = pytest.importorskip("torch")
    q, k, v = _jax_inputs(jax)
    rng = np.random.default_rng(9)
    table = jnp.asarray(rng.standard_normal(NQ + NK - 1).astype(np.float32))
    doc_id = jnp.asarray(np.sort(rng.integers(0, 3, NK)).astype(np.int32))

    def loss(q, k, v, t, doc_id):
        out = cupyflash.attention(q, k, v, score_mod=_relative(t), mask_mod=_document(doc_id))
        return jnp.sum(out * out)

    before = jax_ops.runs[("cpu", "backward")]
    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, table, doc_id)
    assert jax_ops.runs[("cpu", "backward")] == before + 1
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v, table)]
    torch_doc = torch.tensor(np.asarray(doc_id))
    f = lambda q, k, v, t: _formula(torch, q, k, v, _relative(t), _document(torch_doc))  # noqa: E731
    f(*leaves).square().sum().backward()
    for index, got in zip(argnums, grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), leaves[index].grad.numpy(), rtol=2e-4, atol=2e-5,
                                   err_msg="qkvt"[index])  # fmt: skip


def test_what_jax_refuses_names_it():
    """A differentiated mask_mod's captured array; a captured NumPy array inside a transformation
    (its dtype may not be JAX's: int64 without x64); an untraceable function (the eager message)."""
    jax, jnp = _jax()
    q, k, v = _jax_inputs(jax)
    table = jnp.zeros(NQ + NK - 1, jnp.float32)
    levels = jnp.zeros(NK, jnp.float32)
    with pytest.raises(NotImplementedError, match="mask_mod's captured array is differentiated.*stop_gradient"):
        jax.grad(lambda q, t: cupyflash.attention(q, k, v, mask_mod=lambda b, h, i, j: t[j] >= 0).sum(),
                 argnums=(0, 1))(q, levels)  # fmt: skip
    doc_id = np.zeros(NK, np.int64)
    with pytest.raises(TypeError, match="captured array 0 must be a JAX array"):
        jax.jit(lambda q: cupyflash.attention(q, k, v, mask_mod=_document(doc_id)))(q)
    with pytest.raises(TypeError, match="mask_mod uses `if`"):
        jax.jit(lambda q: cupyflash.attention(q, k, v, mask_mod=lambda b, h, i, j: i > j or j > 3))(q)
    grads = jax.grad(lambda q, t: cupyflash.attention(q, k, v, score_mod=_relative(jax.lax.stop_gradient(t))).sum(),
                     argnums=(0, 1))(q, table)  # fmt: skip
    assert not np.asarray(grads[1]).any()
