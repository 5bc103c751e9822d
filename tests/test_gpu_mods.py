"""score_mod / mask_mod compiled into the FA2 forward's score hook (kernels_cu/variants.cuh's
UserMods): each against the float64 host
path on the same values (the host path is the functions' reference), with causal and windows, GQA,
odd lengths and head dims, captured 1-D and 2-D arrays (strided too), rows every key of which is
hidden (output 0, LSE -inf), NaN in giving NaN out; CuPy and PyTorch inputs. Outputs are
NaN-poisoned (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, need_torch, rel_error, three_consumer_mods_tiles

import cupyflash
from cupyflash import mods, reference

pytestmark = pytest.mark.gpu

B, NQ, NK, HQ, HKV = 2, 197, 301, 8, 2


def _functions(to_array, seed):
    """(name, score_mod, mask_mod), their captured arrays made by ``to_array`` from NumPy ones
    drawn from ``seed`` (the same values on the host and on the GPU)."""
    rng = np.random.default_rng(seed)
    doc_q = to_array(np.sort(rng.integers(0, 4, NQ)).astype(np.int32))
    doc_k = to_array(np.sort(rng.integers(0, 4, NK)).astype(np.int32))
    bias = to_array(rng.standard_normal((HQ, NK)).astype(np.float32))
    wide = to_array(rng.standard_normal((NK, 2 * HQ)).astype(np.float32))[:, ::2]  # (NK, HQ), strided
    slopes = to_array((2.0 ** -np.arange(1, HQ + 1)).astype(np.float32))
    return [
        ("softcap", lambda s, b, h, i, j: 20.0 * mods.tanh(s / 20.0), None),
        ("alibi", lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j), None),
        ("bias-2d", lambda s, b, h, i, j: s + bias[h, j], None),
        ("bias-strided", lambda s, b, h, i, j: s + wide[j, h], None),
        ("document", None, lambda b, h, i, j: doc_q[i] == doc_k[j]),
        ("prefix-lm", None, lambda b, h, i, j: (j <= i) | (j < 64)),
        ("chunked", None, lambda b, h, i, j: (i // 64) == (j // 64)),
        ("both", lambda s, b, h, i, j: s * 0.5 + bias[h, j], lambda b, h, i, j: (j % 3) != 1),
        ("hides-rows", None, lambda b, h, i, j: (i % 5) != 0),  # row i % 5 == 0: no key
    ]


@pytest.mark.parametrize("algorithm", ["auto", "fa2"])  # auto: the Hopper kernel on sm_90
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (50, 9)}, {"scale": -0.2}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80), ("float16", 40)])
def test_functions_match_the_host_path(rng, options, dtype, head_dim, algorithm):
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(B, n, h, head_dim, generator=gen).to(tdtype) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV)))
    host = [x.double().numpy() for x in (q, k, v)]
    on_host = _functions(lambda x: x, 7)
    on_gpu = _functions(lambda x: torch.from_numpy(x).cuda(), 7)
    for (name, score_mod, mask_mod), (_, gpu_score, gpu_mask) in zip(on_host, on_gpu, strict=True):
        want, want_lse = cupyflash.attention(*host, score_mod=score_mod, mask_mod=mask_mod, return_lse=True, **options)
        out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), score_mod=gpu_score, mask_mod=gpu_mask,
                                       return_lse=True, algorithm=algorithm, **options)  # fmt: skip
        assert out.dtype == tdtype and out.shape == q.shape, name
        assert rel_error(reference.to_numpy64(out), want) < BOUND[dtype], name
        got_lse, finite = reference.to_numpy64(lse), np.isfinite(want_lse)
        assert (np.isfinite(got_lse) == finite).all(), name
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2, err_msg=name)
        if name == "hides-rows":  # rows that see no key: output 0 (not NaN), LSE -inf
            assert (reference.to_numpy64(out)[:, ::5] == 0).all()


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (50, 9)}], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_functions_on_three_consumers_match_the_host_path(rng, options, dtype, monkeypatch):
    """test_functions_match_the_host_path at d = 64 on the Hopper forward's 192-row tiles (three
    consumers in round robin, the tile of calls past 2048 keys): a tile's rows past the sequence,
    every function."""
    three_consumer_mods_tiles(monkeypatch)
    test_functions_match_the_host_path(rng, options, dtype, 64, "auto")


def test_cupy_inputs_and_nan(rng):
    """CuPy arrays and captured CuPy arrays; a NaN in q reaches its row's output."""
    cp = pytest.importorskip("cupy")
    q = rng.standard_normal((1, 130, 4, 64)).astype(np.float16)
    k = rng.standard_normal((1, 150, 4, 64)).astype(np.float16)
    q[0, 17, 2, 5] = np.nan
    doc = rng.integers(0, 3, 150).astype(np.int32)

    def mask_on(xp):
        d = xp.asarray(doc)
        return lambda b, h, i, j: d[j] == d[i % 150]

    want = cupyflash.attention(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64), mask_mod=mask_on(np))
    got = cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(k), mask_mod=mask_on(cp))
    got = cp.asnumpy(got).astype(np.float64)
    assert np.isnan(got[0, 17, 2]).all() and np.isnan(want[0, 17, 2]).all()
    keep = ~np.isnan(want)
    assert rel_error(got[keep], want[keep]) < BOUND["float16"]


def test_an_index_outside_a_captured_array_gives_nan_not_a_value_read_past_it():
    """The host path raises IndexError; the kernels read nothing outside the array and make the
    score NaN, so every row that reaches such an index outputs NaN (never a plausible value)."""
    torch = need_torch()
    q, k = (torch.randn(1, n, 2, 64, device="cuda", dtype=torch.bfloat16) for n in (40, 50))
    short = torch.zeros(30, dtype=torch.float32, device="cuda")  # 30 entries, 50 keys read
    on_host = short.cpu()
    with pytest.raises(IndexError, match="outside the array"):
        cupyflash.attention(q.cpu().double(), k.cpu().double(), k.cpu().double(),
                            score_mod=lambda s, b, h, i, j: s + on_host[j])  # fmt: skip
    out = cupyflash.attention(q, k, k, score_mod=lambda s, b, h, i, j: s + short[j])
    assert torch.isnan(out).all()
    causal = cupyflash.attention(q, k, k, causal=True, score_mod=lambda s, b, h, i, j: s + short[j])
    rows_reaching = torch.arange(40, device="cuda") + 10 >= 30  # row i sees keys 0 .. i + 10
    assert torch.isnan(causal[0, rows_reaching]).all() and not torch.isnan(causal[0, ~rows_reaching]).any()


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"scale": -0.2}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_backward_matches_the_host_path(rng, options, dtype, head_dim, deterministic):
    """The backward with each function and score_mod's derivative compiled in (on sm_90 the
    Hopper one at d = 64 and 128, where the logits and derivatives are formed beside dS^T from
    the raw scores; the mma.sync one at d = 80), against the float64 host path's gradients on
    the same values (with a dlse, and sinks)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(B, n, h, head_dim, generator=gen).to(tdtype) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV)))
    sinks = torch.randn(HQ, generator=gen)
    on_host = _functions(lambda x: x, 7)
    on_gpu = _functions(lambda x: torch.from_numpy(x).cuda(), 7)
    for (name, score_mod, mask_mod), (_, gpu_score, gpu_mask) in zip(on_host, on_gpu, strict=True):
        out, lse = cupyflash.attention(q.cuda(), k.cuda(), v.cuda(), score_mod=gpu_score, mask_mod=gpu_mask,
                                       sinks=sinks.cuda(), return_lse=True, **options)  # fmt: skip
        dout = torch.randn(out.shape, generator=gen).to(tdtype)
        dlse = torch.randn(lse.shape, generator=gen)
        grads = cupyflash.attention_backward(
            dout.cuda(), q.cuda(), k.cuda(), v.cuda(), out, lse, dlse=dlse.cuda(), score_mod=gpu_score,
            mask_mod=gpu_mask, sinks=sinks.cuda(), deterministic=deterministic, **options,
        )  # fmt: skip
        host = [x.double().numpy() for x in (dout, q, k, v, out.cpu(), lse.cpu(), dlse, sinks)]
        want = cupyflash.attention_backward(*host[:6], dlse=host[6], score_mod=score_mod, mask_mod=mask_mod,
                                            sinks=host[7], **options)  # fmt: skip
        for grad_name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want, strict=True):
            got = reference.to_numpy64(got)
            assert np.isfinite(got).all() == np.isfinite(ref).all(), (name, grad_name)
            assert rel_error(got, ref) < 3e-2, (name, grad_name)


def test_autograd_on_the_gpu(rng):
    """A training step through autograd with a score and a mask function: the gradients of the
    GPU kernels against the float64 host path's autograd on the same values."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(B, n, h, 64, generator=gen).to(torch.bfloat16) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV)))
    bias = torch.randn(HQ, NK, generator=gen)

    def run(tensors, table):
        leaves = [x.clone().requires_grad_() for x in tensors]
        out = cupyflash.attention(*leaves, causal=True, score_mod=lambda s, b, h, i, j: s + table[h, j],
                                  mask_mod=lambda b, h, i, j: (j % 5) != 2)  # fmt: skip
        out.float().square().sum().backward()
        return [out.detach(), *(x.grad for x in leaves)]

    got = run([x.cuda() for x in (q, k, v)], bias.cuda())
    want = run([x.double() for x in (q, k, v)], bias.double())
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert rel_error(reference.to_numpy64(g), w.numpy()) < 3e-2, name


@pytest.mark.parametrize("require", ["all", "table only"])
def test_a_learned_bias_table_trains_on_the_gpu(rng, require):
    """A captured bias table that requires grad (q, k, v too, or the table alone): its gradient
    (the array-API backward on the GPU's tensors: the kernels have no scatter for it yet) and
    dq, dk, dv against the float64 host path's, bf16 inputs, causal, GQA."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v = (torch.randn(B, n, h, 64, generator=gen).to(torch.bfloat16) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV)))
    table = 0.5 * torch.randn(HQ, NQ + NK, generator=gen)

    def run(tensors, table):
        leaves = [x.clone().requires_grad_(require == "all") for x in tensors]
        learned = table.clone().requires_grad_()
        out = cupyflash.attention(*leaves, causal=True, score_mod=lambda s, b, h, i, j: s + learned[h, j - i + NQ])
        out.float().square().sum().backward()
        grads = [x.grad for x in leaves] if require == "all" else []
        return [out.detach(), learned.grad, *grads]

    got = run([x.cuda() for x in (q, k, v)], table.cuda())
    want = run([x.double() for x in (q, k, v)], table.double())
    assert got[1].device.type == "cuda" and got[1].dtype == torch.float32
    for name, g, w in zip(("out", "dtable", "dq", "dk", "dv"), got, want, strict=False):
        assert rel_error(reference.to_numpy64(g), w.numpy()) < 3e-2, name


@pytest.mark.parametrize("head_dim", [64, 128])
def test_masks_with_implied_bounds(rng, head_dim):
    """Nq = Nk: a mask_mod whose top-level & holds kv_idx <= q_idx (and q_idx - kv_idx < c) runs the
    kernels' causal (and window) variants, their hidden tiles skipped; forward and backward
    against the float64 host path on the same values."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    n = 333
    q, k, v = (torch.randn(2, n, h, head_dim, generator=gen).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    doc = np.sort(rng.integers(0, 3, n)).astype(np.int32)
    doc_gpu = torch.from_numpy(doc).cuda()
    cases = [
        ("causal", lambda b, h, i, j: j <= i, lambda b, h, i, j: j <= i),
        ("sliding", lambda b, h, i, j: (j <= i) & (i - j < 70), lambda b, h, i, j: (j <= i) & (i - j < 70)),
        ("document causal", lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i),
         lambda b, h, i, j: (doc_gpu[i] == doc_gpu[j]) & (j <= i)),
    ]  # fmt: skip
    for name, on_host, on_gpu in cases:
        leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
        out, lse = cupyflash.attention(*leaves, mask_mod=on_gpu, return_lse=True)
        dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16)
        out.backward(dout.cuda())
        host = [x.double().numpy() for x in (q, k, v)]
        want, want_lse = cupyflash.attention(*host, mask_mod=on_host, return_lse=True)
        grads = cupyflash.attention_backward(dout.double().numpy(), *host, want, want_lse, mask_mod=on_host)
        assert rel_error(reference.to_numpy64(out.detach()), want) < BOUND["bfloat16"], name
        np.testing.assert_allclose(reference.to_numpy64(lse), want_lse, atol=2e-2, err_msg=name)
        for grad_name, leaf, ref in zip(("dq", "dk", "dv"), leaves, grads, strict=True):
            assert rel_error(reference.to_numpy64(leaf.grad), ref) < 3e-2, (name, grad_name)


def test_masks_built_from_masks(rng):
    """and_masks / or_masks of masks that capture GPU arrays (chunks, documents, a prefix): the
    forward and backward against the float64 host path, and the same bits as the mask written
    inline (the same expression, so the same kernel and the same implied summary)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    n = 777
    q, k, v = (torch.randn(2, n, h, 64, generator=gen).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    doc = np.sort(rng.integers(0, 5, n)).astype(np.int32)
    doc_gpu = torch.from_numpy(doc).cuda()

    def chunked(b, h, i, j):
        return (i // 128 == j // 128) & (j <= i)

    def documents(ids):
        return lambda b, h, i, j: ids[i] == ids[j]

    def prefix(b, h, i, j):
        return j < 40

    combined = {lib: mods.or_masks(mods.and_masks(chunked, documents(ids)), prefix) for lib, ids in
                (("gpu", doc_gpu), ("host", doc))}  # fmt: skip
    inline = lambda b, h, i, j: ((i // 128 == j // 128) & (j <= i) & (doc_gpu[i] == doc_gpu[j])) | (j < 40)  # noqa: E731
    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    out = cupyflash.attention(*leaves, mask_mod=combined["gpu"], deterministic=True)
    dout = torch.randn(out.shape, generator=gen).to(torch.bfloat16).cuda()
    out.backward(dout)
    got = [out.detach(), *(x.grad.clone() for x in leaves)]
    for x in leaves:
        x.grad = None
    again = cupyflash.attention(*leaves, mask_mod=inline, deterministic=True)
    again.backward(dout)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, [again.detach(), *(x.grad for x in leaves)], strict=True):
        assert torch.equal(g, w), name
    host = [x.double().numpy() for x in (q, k, v)]
    want, want_lse = cupyflash.attention(*host, mask_mod=combined["host"], return_lse=True)
    grads = cupyflash.attention_backward(reference.to_numpy64(dout), *host, want, want_lse, mask_mod=combined["host"])
    assert rel_error(reference.to_numpy64(got[0]), want) < BOUND["bfloat16"]
    for name, g, ref in zip(("dq", "dk", "dv"), got[1:], grads, strict=True):
        assert rel_error(reference.to_numpy64(g), ref) < 3e-2, name


def _document(doc_id):
    """Document masking over a captured doc_id (indexed by rows and keys)."""
    return lambda b, h, i, j: doc_id[i] == doc_id[j]


def _step(score_mod, mask_mod):
    """A training step's attention and loss, deterministic (its gradients repeat bit for bit)."""

    def step(q, k, v):
        out = cupyflash.attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=mask_mod, deterministic=True)
        return out, out.float().square().sum()

    return step


def _grads(step, leaves, *extra):
    for x in leaves:
        x.grad = None
    out, loss = step(*leaves, *extra)
    loss.backward()
    return [out.detach(), *(x.grad.clone() for x in leaves)]


def _compiled_and_eager(torch, step, leaves):
    """The step's output and gradients compiled (fullgraph, aot_eager; no graph break) and eager."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(*leaves)
    assert explained.graph_break_count == 0, explained.break_reasons
    return _grads(torch.compile(step, fullgraph=True, backend="aot_eager"), leaves), _grads(step, leaves)


def _host_check(torch, got, tensors, score_mod, mask_mod):
    """The output and gradients of sum(out^2) against the float64 host path on the same values."""
    host = [x.detach().double().cpu().numpy() for x in tensors]
    out, lse = cupyflash.attention(*host, causal=True, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    want = [out, *cupyflash.attention_backward(2 * out, *host, out, lse, causal=True, score_mod=score_mod,
                                                mask_mod=mask_mod)]  # fmt: skip
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert rel_error(reference.to_numpy64(g), w) < 3e-2, name


@pytest.mark.parametrize("name", ["softcap", "bias-2d", "document", "both"])
def test_torch_compile_fullgraph_matches_the_eager_call(rng, name):
    """torch.compile(fullgraph=True) over a training step with the functions (the attention_mods
    op and its backward): no graph break; the output and gradients equal the eager call's bit for
    bit (the same kernels, deterministic) and match the float64 host path."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    tensors = [torch.randn(B, n, h, 64, generator=gen).to(torch.bfloat16) for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV))]
    on_host = {n: (s, m) for n, s, m in _functions(lambda x: x, 7)}
    on_gpu = {n: (s, m) for n, s, m in _functions(lambda x: torch.from_numpy(x).cuda(), 7)}
    step = _step(*on_gpu[name])
    leaves = [x.cuda().requires_grad_() for x in tensors]
    compiled, eager = _compiled_and_eager(torch, step, leaves)
    for what, got, want in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True):
        assert torch.equal(got, want), (name, what)
    _host_check(torch, compiled, tensors, *on_host[name])
    inductor = _grads(torch.compile(step, fullgraph=True), leaves)  # the default backend around the ops
    _host_check(torch, inductor, tensors, *on_host[name])


def test_torch_compile_reads_new_captured_values_without_recompiling(rng):
    """A document mask over a captured doc_id passed to the compiled step: new doc_id values (a new
    closure over a tensor of the same shape) run the same graph and give their own answer."""
    torch = need_torch()
    from torch._dynamo.testing import CompileCounterWithBackend

    shapes = ((B, NQ, HQ, 64), (B, NK, HKV, 64), (B, NK, HKV, 64))
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v, mask: cupyflash.attention(q, k, v, mask_mod=mask), fullgraph=True,
                             backend=counter)  # fmt: skip
    host = [x.double().cpu().numpy() for x in (q, k, v)]
    for groups in (2, 5, 9):
        doc = np.sort(rng.integers(0, groups, NK)).astype(np.int32)
        got = compiled(q, k, v, _document(torch.from_numpy(doc).cuda()))
        want = cupyflash.attention(*host, mask_mod=_document(doc))
        assert rel_error(reference.to_numpy64(got), want) < BOUND["bfloat16"], groups
    assert counter.frame_count == 1


def test_eager_step_with_functions_captures_in_a_cuda_graph(rng):
    """The eager route (autograd.Function) with a score_mod and a mask_mod captured in a CUDA graph,
    forward and backward: replays after new q values and new doc_id values written in place equal
    the eager step bit for bit (deterministic)."""
    torch = need_torch()
    leaves = [torch.randn(B, n, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for n, h in ((NQ, HQ), (NK, HKV), (NK, HKV))]  # fmt: skip
    doc = torch.from_numpy(np.sort(rng.integers(0, 3, NK)).astype(np.int32)).cuda()
    bias = torch.from_numpy(rng.standard_normal((HQ, NK)).astype(np.float32)).cuda()
    dout = torch.randn(B, NQ, HQ, 64, device="cuda", dtype=torch.bfloat16)

    def run():
        return cupyflash.attention(*leaves, causal=True, score_mod=lambda s, b, h, i, j: s + bias[h, j],
                                   mask_mod=lambda b, h, i, j: doc[i] == doc[j], deterministic=True)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run().backward(dout)  # compile and plan before capture
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
        out.backward(dout)
    captured = [out, *(x.grad for x in leaves)]
    for _ in range(2):
        with torch.no_grad():
            leaves[0].copy_(torch.randn_like(leaves[0]))
            doc.copy_(torch.from_numpy(np.sort(rng.integers(0, 4, NK)).astype(np.int32)))
        graph.replay()
        replayed = [x.detach().clone() for x in captured]
        for x in leaves:
            x.grad = None
        eager = run()
        eager.backward(dout)
        torch.cuda.synchronize()
        for name, got, want in zip(("out", "dq", "dk", "dv"), replayed, [eager, *(x.grad for x in leaves)]):
            assert torch.equal(got, want.detach()), name


# -- attention_varlen: b the packed sequence, q_idx / kv_idx positions within it ----------------
# an empty sequence, one token, Nq < Nk, Nq > Nk, longer than a tile; 3 rows after the last one
VARLEN_Q, VARLEN_K, VARLEN_PAD = (70, 0, 1, 190, 133), (129, 5, 1, 77, 133), 3


def _varlen_functions(to_array, seed):
    """(name, score_mod, mask_mod) over packed sequences: by sequence (a (sequence, head) table,
    a prefix per sequence), by position within it, and by distance from the sequence's end (which
    reads outside its table at the rows past the sequence that the kernels' tiles cover: every
    read is checked on this route)."""
    rng = np.random.default_rng(seed)
    table = to_array(rng.standard_normal((len(VARLEN_Q), HQ)).astype(np.float32))
    prefix = to_array(np.array([9, 0, 1, 40, 0], np.int32))
    n = max(VARLEN_K)  # i - j + n over [0, max q + max k - 1)
    rel = to_array(rng.standard_normal((HQ, max(VARLEN_Q) + n)).astype(np.float32) * 0.3)
    lens = to_array(np.array(VARLEN_Q, np.int32))
    rev = to_array(rng.standard_normal((HQ, max(VARLEN_Q))).astype(np.float32))
    return [
        ("sequence-bias", lambda s, b, h, i, j: s + table[b, h], None),
        ("relative", lambda s, b, h, i, j: s + rel[h, i - j + n], None),
        ("prefix-lm", None, lambda b, h, i, j: (j <= i) | (j < prefix[b])),
        # rows past a sequence (up to max_seqlen_q, in its last query block) read outside rev: NaN
        # there, which must stay out of the gradients
        ("from-the-end", lambda s, b, h, i, j: s + rev[h, lens[b] - 1 - i], None),
        (
            "both",
            lambda s, b, h, i, j: 20.0 * mods.tanh(s / 20.0) + table[b, h],
            lambda b, h, i, j: (i // 32) == (j // 32),
        ),
    ]


def _packed(torch, gen, dtype, head_dim):
    total_q, total_k = sum(VARLEN_Q) + VARLEN_PAD, sum(VARLEN_K)
    q = torch.randn(total_q, HQ, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(total_k, HKV, head_dim, generator=gen).to(dtype) for _ in range(2))
    offsets = [torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32) for x in (VARLEN_Q, VARLEN_K)]
    return q, k, v, offsets


@pytest.mark.parametrize("algorithm", ["auto", "fa2"])  # auto: the Hopper forward on sm_90
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (40, 7)}], ids=str)
@pytest.mark.parametrize(("dtype", "head_dim"), [("bfloat16", 128), ("float16", 64), ("bfloat16", 80)])
def test_varlen_functions_match_the_host_path(rng, options, dtype, head_dim, algorithm, monkeypatch):
    """Forward and gradients (the packed Hopper backward at d = 64 and 128 on sm_90, the mma.sync
    one at d = 80) per packed sequence against the float64 host path, NaN-poisoned outputs (so
    every row inside a sequence written); a NaN in one sequence's q stays in its rows. The rows
    after the last sequence keep the plan's fill (0, LSE -inf), which the poisoning replaces:
    checked unpoisoned at the end, as test_varlen.py does."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, (cu_q, cu_k) = _packed(torch, gen, getattr(torch, dtype), head_dim)
    # sequence 3's last row (sequences 1 and 2 have 0 and 1 rows), which sees keys under every option
    nan_row = sum(VARLEN_Q[:4]) - 1
    q[nan_row, 1, 5] = float("nan")
    args = (max(VARLEN_Q), max(VARLEN_K))
    host = [x.double().numpy() for x in (q, k, v)] + [cu_q.numpy(), cu_k.numpy()]
    gpu = [x.cuda() for x in (q, k, v, cu_q, cu_k)]
    on_host = _varlen_functions(lambda x: x, 5)
    on_gpu = _varlen_functions(lambda x: torch.from_numpy(x).cuda(), 5)
    inside = sum(VARLEN_Q)  # the rows of the sequences
    nan_seen = False
    for (name, score_mod, mask_mod), (_, gpu_score, gpu_mask) in zip(on_host, on_gpu, strict=True):
        want, want_lse = cupyflash.attention_varlen(*host, *args, score_mod=score_mod, mask_mod=mask_mod,
                                                    return_lse=True, **options)  # fmt: skip
        out, lse = cupyflash.attention_varlen(*gpu, *args, score_mod=gpu_score, mask_mod=gpu_mask, return_lse=True,
                                              algorithm=algorithm, **options)  # fmt: skip
        cupyflash.check_device_errors()
        got, got_lse = reference.to_numpy64(out)[:inside], reference.to_numpy64(lse)[:, :inside]
        want, want_lse = want[:inside], want_lse[:, :inside]
        assert (np.isnan(got) == np.isnan(want)).all(), name
        assert not np.isnan(got[: VARLEN_Q[0]]).any(), name  # (a row a mask hides shows no NaN: 0)
        nan_seen |= bool(np.isnan(got[nan_row]).any())
        ok = ~np.isnan(want)
        assert rel_error(got[ok], want[ok]) < BOUND[dtype], name
        finite = np.isfinite(want_lse)
        assert (np.isfinite(got_lse) == finite).all(), name
        np.testing.assert_allclose(got_lse[finite], want_lse[finite], atol=2e-2, err_msg=name)
        # gradients, without the NaN row
        q_ok = gpu[0].clone()
        q_ok[nan_row] = 0
        out, lse = cupyflash.attention_varlen(q_ok, *gpu[1:], *args, score_mod=gpu_score, mask_mod=gpu_mask,
                                              return_lse=True, **options)  # fmt: skip
        dout = torch.randn(out.shape, generator=gen).to(out.dtype)
        grads = cupyflash.attention_varlen_backward(dout.cuda(), q_ok, *gpu[1:3], out, lse, *gpu[3:], *args,
                                                    score_mod=gpu_score, mask_mod=gpu_mask, **options)  # fmt: skip
        host_ok = [reference.to_numpy64(x) for x in (dout, q_ok, out, lse)]
        ref = cupyflash.attention_varlen_backward(host_ok[0], host_ok[1], *host[1:3], host_ok[2], host_ok[3],
                                                  *host[3:], *args, score_mod=score_mod, mask_mod=mask_mod,
                                                  **options)  # fmt: skip
        for grad_name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
            g, r = reference.to_numpy64(g), r
            if grad_name == "dq":  # (the rows after the last sequence: checked unpoisoned below)
                g, r = g[:inside], r[:inside]
            assert np.isfinite(g).all(), (name, grad_name)
            assert rel_error(g, r) < 3e-2, (name, grad_name)
    assert nan_seen  # (the NaN pattern, the host's, checked above: here that it was there to check)
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "POISON_OUTPUTS", False)
    out, lse = cupyflash.attention_varlen(*gpu, *args, score_mod=gpu_score, mask_mod=gpu_mask, return_lse=True,
                                          algorithm=algorithm, **options)  # fmt: skip
    assert (reference.to_numpy64(out)[inside:] == 0).all()
    assert (reference.to_numpy64(lse)[:, inside:] == -np.inf).all()


@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window": (40, 7)}], ids=str)
def test_varlen_functions_on_three_consumers_match_the_host_path(rng, options, monkeypatch):
    """test_varlen_functions_match_the_host_path at d = 64 on the Hopper forward's 192-row tiles
    (three consumers in round robin, the tile of calls past 2048 keys): a tile's rows past each
    packed sequence."""
    three_consumer_mods_tiles(monkeypatch)
    test_varlen_functions_match_the_host_path(rng, options, "float16", 64, "auto", monkeypatch)


def test_varlen_autograd_and_a_learned_table_on_the_gpu(rng):
    """Autograd through attention_varlen with a score_mod reading a (sequence, head) table that
    requires grad: q, k, v from the kernels, the table's gradient from the array-API path on the
    GPU's tensors; each against the float64 host path."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, (cu_q, cu_k) = _packed(torch, gen, torch.bfloat16, 64)
    table = torch.randn(len(VARLEN_Q), HQ, generator=gen) * 0.3
    args = (max(VARLEN_Q), max(VARLEN_K))
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        leaves = [x.to(device, dtype).requires_grad_() for x in (q, k, v)] + [table.to(device).requires_grad_()]
        out = cupyflash.attention_varlen(
            *leaves[:3], cu_q.to(device), cu_k.to(device), *args, causal=True,
            score_mod=lambda s, b, h, i, j, t=leaves[3]: s + t[b, h] * mods.abs(i - j) * 0.01,
        )  # fmt: skip
        out.float().square().sum().backward()
        results.append([x.grad.double().cpu().numpy() for x in leaves])
    for name, got, want in zip(("dq", "dk", "dv", "dtable"), *results, strict=True):
        assert rel_error(got, want) < 3e-2, name


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_masks_over_aligned_sequences_take_their_bounds(rng, head_dim):
    """Self-attention over packed sequences (one offsets array for queries and keys): a causal
    mask_mod runs as the built-in packed kernels, a causal mask with more in it as the causal
    variant with the hook, a prefix mask (no bound) as the hook alone; each, forward and
    gradients, against the float64 host path."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    lengths = (70, 0, 1, 190, 133)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(torch.bfloat16) for h in (HQ, HKV, HKV))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    prefix = np.array([9, 0, 1, 40, 0], np.int32)
    masks = {
        "causal": lambda p: lambda b, h, i, j: j <= i,
        "causal-chunks": lambda p: lambda b, h, i, j: (j <= i) & ((i // 32) == (j // 32)),
        "prefix": lambda p: lambda b, h, i, j: (j <= i) | (j < p[b]),
    }
    host = [x.double().numpy() for x in (q, k, v)]
    gpu = [x.cuda() for x in (q, k, v)]
    cu_gpu = cu.cuda()
    for name, make in masks.items():
        want, want_lse = cupyflash.attention_varlen(*host, cu.numpy(), cu.numpy(), 190, 190, mask_mod=make(prefix),
                                                    return_lse=True)  # fmt: skip
        mask = make(torch.from_numpy(prefix).cuda())
        out, lse = cupyflash.attention_varlen(*gpu, cu_gpu, cu_gpu, 190, 190, mask_mod=mask, return_lse=True)
        assert rel_error(reference.to_numpy64(out), want) < BOUND["bfloat16"], name
        finite = np.isfinite(want_lse)
        np.testing.assert_allclose(reference.to_numpy64(lse)[finite], want_lse[finite], atol=2e-2, err_msg=name)
        dout = torch.randn(out.shape, generator=gen).to(out.dtype)
        grads = cupyflash.attention_varlen_backward(dout.cuda(), *gpu, out, lse, cu_gpu, cu_gpu, 190, 190,
                                                    mask_mod=mask)  # fmt: skip
        ref = cupyflash.attention_varlen_backward(
            reference.to_numpy64(dout), *host, reference.to_numpy64(out), reference.to_numpy64(lse), cu.numpy(),
            cu.numpy(), 190, 190, mask_mod=make(prefix),
        )  # fmt: skip
        for grad_name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
            g = reference.to_numpy64(g)
            assert np.isfinite(g).all(), (name, grad_name)
            assert rel_error(g, r) < 3e-2, (name, grad_name)


def test_varlen_torch_compile_fullgraph_matches_the_eager_call(rng):
    """torch.compile(fullgraph=True) over a packed training step with the functions (the
    attention_varlen_mods op and its backward): no graph break; the output and gradients equal
    the eager call's bit for bit (deterministic)."""
    torch = need_torch()
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q, k, v, (cu_q, cu_k) = _packed(torch, gen, torch.bfloat16, 64)
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    _, score_mod, mask_mod = _varlen_functions(lambda x: torch.from_numpy(x).cuda(), 5)[4]  # ("both")

    def step(q, k, v):
        out = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), causal=True,
                                         score_mod=score_mod, mask_mod=mask_mod, deterministic=True)  # fmt: skip
        return out, out[: sum(VARLEN_Q)].float().square().sum()

    leaves = [x.cuda().requires_grad_() for x in (q, k, v)]
    compiled, eager = _compiled_and_eager(torch, step, leaves)
    for what, got, want in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True):
        got, want = (x[: sum(VARLEN_Q)] if what in ("out", "dq") else x for x in (got, want))
        assert torch.equal(got, want), what
