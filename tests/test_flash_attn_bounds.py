"""flash-attn's contract for bad lengths and page ids in cupyflash.flash_attn: a RuntimeError in
the call, naming the argument (the core API keeps its error word instead). Host arrays here, NumPy
and PyTorch CPU: the rule is the same and costs no synchronisation; the `gpu` tests run it on CUDA
tensors and CuPy arrays, where it reads the values back, and check that CUDA-graph capture skips
it."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _interop
from cupyflash import flash_attn as fa

torch = pytest.importorskip("torch")

B, H, HK, D = 2, 4, 2, 16
CAPACITY, NEW = 12, 2  # contiguous caches (B, CAPACITY, HK, D); k and v append NEW tokens
PAGE, NUM_BLOCKS = 4, 7  # paged caches (NUM_BLOCKS, PAGE, HK, D), block_table (B, 3): 12 keys a row


def _ints(values, lib):
    return np.array(values, dtype=np.int32) if lib == "numpy" else torch.tensor(values, dtype=torch.int32)


def _floats(rng, shape, lib):
    x = rng.standard_normal(shape)
    return x if lib == "numpy" else torch.from_numpy(x)


def _copy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _equal(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b))


def _cache_call(rng, lib, paged=False, append=True, entries=B):
    """(q, k_cache, v_cache, k, v) of a cache call: contiguous (entries, CAPACITY) or paged."""
    shape = (NUM_BLOCKS, PAGE, HK, D) if paged else (entries, CAPACITY, HK, D)
    q = _floats(rng, (B, 1, H, D), lib)
    k_cache, v_cache = (_floats(rng, shape, lib) for _ in range(2))
    k, v = (_floats(rng, (B, NEW, HK, D), lib) if append else None for _ in range(2))
    return q, k_cache, v_cache, k, v


def _against_the_core(q, k_cache, v_cache, k, v, **kwargs):
    """flash_attn_with_kvcache equals cupyflash.attention_with_kvcache on copies of the caches
    (both append), and the appended caches agree."""
    caches = [_copy(k_cache), _copy(v_cache)]
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True, **kwargs)
    core = {n: x for n, x in kwargs.items() if n in ("block_table", "cache_batch_idx", "cache_leftpad")}
    want, want_lse = cupyflash.attention_with_kvcache(
        q, *caches, cache_seqlens=kwargs["cache_seqlens"], k_new=k, v_new=v, causal=kwargs.get("causal", False),
        return_lse=True, **core,
    )  # fmt: skip
    assert _equal(out, want) and _equal(lse, want_lse)
    assert _equal(k_cache, caches[0]) and _equal(v_cache, caches[1])
    assert np.isfinite(np.asarray(out)).all()


def _refused(match, q, k_cache, v_cache, k, v, **kwargs):
    """A RuntimeError naming the argument, and nothing appended to the caches."""
    before = [_copy(k_cache), _copy(v_cache)]
    with pytest.raises(RuntimeError, match=match):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    assert _equal(k_cache, before[0]) and _equal(v_cache, before[1])


LIBS = ["numpy", "torch"]


@pytest.mark.parametrize("lib", LIBS)
def test_cache_seqlens_within_a_contiguous_cache(rng, lib):
    call = _cache_call(rng, lib)
    _against_the_core(*call, cache_seqlens=_ints([CAPACITY - NEW, 3], lib), causal=True)  # exactly full
    _refused(r"cache_seqlens\[0\]=11 with 2 new tokens goes beyond", *call, cache_seqlens=_ints([11, 3], lib))
    _refused(r"cache_seqlens\[1\]=-1 is negative", *call, cache_seqlens=_ints([3, -1], lib))
    _refused(r"cache_seqlens\[0\]=11", *call, cache_seqlens=11)  # an int is a length of every sequence
    q, k_cache, v_cache, _, _ = call  # without new tokens, the whole cache may be read
    _against_the_core(q, k_cache, v_cache, None, None, cache_seqlens=_ints([CAPACITY, 0], lib))
    _refused(r"cache_seqlens\[0\]=13", q, k_cache, v_cache, None, None, cache_seqlens=_ints([13, 0], lib))


@pytest.mark.parametrize("lib", LIBS)
def test_paged_block_table_bounds(rng, lib):
    """flash-attn's test_flash_attn_kvcache_paged_block_table_bounds: cache_seqlens plus the new
    tokens past what the block table holds (block_table.shape[1] * page_size) raises, naming
    block_table; exactly full passes."""
    call = _cache_call(rng, lib, paged=True)
    table = _ints([[0, 1, 2], [3, 4, 5]], lib)
    _against_the_core(*call, cache_seqlens=_ints([10, 10], lib), block_table=table, causal=True)
    with pytest.raises(RuntimeError, match="block_table") as raised:
        fa.flash_attn_with_kvcache(*call, cache_seqlens=_ints([11, 2], lib), block_table=table)
    assert "cache_seqlens[0]=11" in str(raised.value) and "3 pages of 4" in str(raised.value)


@pytest.mark.parametrize("lib", LIBS)
def test_page_ids_the_call_reads(rng, lib):
    """Only the first ceil((cache_seqlens + new) / page_size) entries of a row are read, so only
    they must name a block: a bad id past them is fine (flash-attn reads only those)."""
    call = _cache_call(rng, lib, paged=True)
    lens = _ints([5, 1], lib)  # 7 and 3 keys after the append: 2 pages and 1 page
    _against_the_core(*call, cache_seqlens=lens, block_table=_ints([[0, 1, -1], [2, 99, NUM_BLOCKS]], lib))
    for row in ([0, NUM_BLOCKS, 2], [0, -1, 2]):
        table = _ints([row, [3, 4, 5]], lib)
        _refused(r"block_table\[0\] points outside the 7 pages", *call, cache_seqlens=lens, block_table=table)
    # cache_seqlens=None reads every page of every row (flash-attn's whole cache)
    q, k_cache, v_cache, _, _ = call
    with pytest.raises(RuntimeError, match=r"block_table\[1\] points outside"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=_ints([[0, 1, 2], [3, 4, 7]], lib))


@pytest.mark.parametrize("lib", LIBS)
def test_cache_batch_idx_and_leftpad(rng, lib):
    call = _cache_call(rng, lib, entries=3)
    lens = _ints([4, 6], lib)
    _against_the_core(*call, cache_seqlens=lens, cache_batch_idx=_ints([2, 0], lib))
    for bad in ([0, 3], [-1, 1]):
        _refused("cache_batch_idx", *call, cache_seqlens=lens, cache_batch_idx=_ints(bad, lib))
    _refused("names an entry twice", *call, cache_seqlens=lens, cache_batch_idx=_ints([1, 1], lib))
    call = _cache_call(rng, lib)
    _against_the_core(*call, cache_seqlens=lens, cache_leftpad=_ints([4, 0], lib))  # leftpad = cache_seqlens
    _refused(r"cache_leftpad\[0\]=5 is outside", *call, cache_seqlens=lens, cache_leftpad=_ints([5, 0], lib))


def _packed(rng, lib, lengths_q=(3, 5), lengths_k=(6, 4)):
    q = _floats(rng, (sum(lengths_q) + 1, H, D), lib)  # one row after the last sequence
    k, v = (_floats(rng, (sum(lengths_k), HK, D), lib) for _ in range(2))
    cu_q, cu_k = (_ints(np.concatenate([[0], np.cumsum(n)]).tolist(), lib) for n in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("lib", LIBS)
def test_varlen_offsets(rng, lib):
    q, k, v, cu_q, cu_k = _packed(rng, lib)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 6, causal=True)
    assert _equal(out, cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True))
    assert not np.asarray(out)[-1].any()  # the row after the last sequence stays 0
    full = _ints([0, 3, 9], lib)  # ends exactly at the packed total
    out = fa.flash_attn_varlen_func(q, k, v, full, cu_k, 6, 6)
    assert _equal(out, cupyflash.attention_varlen(q, k, v, full, cu_k, 6, 6))
    cases = {
        "cu_seqlens_q": ([0, 5, 3], [0, 3, 10], [1, 3, 8]),  # decreasing, past the total, not from 0
        "cu_seqlens_k": ([0, 7, 6], [0, 6, 11], [-1, 6, 10]),
    }
    for name, bads in cases.items():
        for bad in bads:
            offsets = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, name: _ints(bad, lib)}
            with pytest.raises(RuntimeError, match=f"flash_attn_varlen_func: {name} must start at 0"):
                fa.flash_attn_varlen_func(q, k, v, offsets["cu_seqlens_q"], offsets["cu_seqlens_k"], 9, 10)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k has a sequence longer than its max_seqlen \(5\)"):
        fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5)
    # the packed forms and the lower-level functions take the same check
    with pytest.raises(RuntimeError, match="cu_seqlens_q must start at 0"):
        fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1) if lib == "torch" else np.stack([k, v], 1),
                                           _ints([0, 5, 3], lib), cu_k, 5, 6)  # fmt: skip
    with pytest.raises(RuntimeError, match="_flash_attn_varlen_forward: cu_seqlens_k must start at 0"):
        fa._flash_attn_varlen_forward(q, k, v, cu_q, _ints([0, 7, 6], lib), 5, 7, 0.0, None, False)


@pytest.mark.parametrize("lib", LIBS)
def test_varlen_seqused_k(rng, lib):
    q, k, v, cu_q, cu_k = _packed(rng, lib)
    used = _ints([6, 0], lib)  # a whole sequence and none of the other: both bounds
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.0, None, True, seqused_k=used)
    want, want_lse = cupyflash.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, causal=True, seqused_k=used,
                                                return_lse=True)  # fmt: skip
    assert _equal(out, want) and _equal(lse, want_lse)
    for bad in ([7, 0], [6, -1]):
        with pytest.raises(RuntimeError, match="seqused_k must lie in 0 .. each sequence's key count"):
            fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.0, None, True, seqused_k=_ints(bad, lib))


@pytest.mark.parametrize("lib", LIBS)
def test_varlen_pages(rng, lib):
    """Paged varlen: cu_seqlens_k counts the keys of each sequence's pages; a count beyond the
    table row and a page id it reaches outside the blocks raise, naming block_table."""
    q = _floats(rng, (8, H, D), lib)
    k_pages, v_pages = (_floats(rng, (NUM_BLOCKS, PAGE, HK, D), lib) for _ in range(2))
    cu_q, cu_k = _ints([0, 3, 8], lib), _ints([0, 12, 17], lib)  # 12 keys (3 full pages), 5 keys (2 pages)
    table = _ints([[0, 1, 2], [3, 4, -1]], lib)  # the -1 is never reached
    out = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 12, causal=True, block_table=table)
    want = cupyflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 5, 12, causal=True, block_table=table)
    assert _equal(out, want) and np.isfinite(np.asarray(out)).all()
    long = _ints([0, 12, 25], lib)  # 13 keys: past a row; a max_seqlen_k that says so is a shape error
    with pytest.raises(ValueError, match="exceed the packed query length and a block_table row's keys"):
        fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, long, 5, 13, block_table=table)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_k has a sequence longer than its max_seqlen \(12\)"):
        fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, long, 5, 12, block_table=table)
    with pytest.raises(RuntimeError, match=r"block_table\[1\] points outside the 7 pages of the cache: \[-1\]"):
        fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, _ints([0, 12, 21], lib), 5, 12, block_table=table)


def test_varlen_backward_checks_the_offsets(rng):
    q, k, v, cu_q, cu_k = _packed(rng, "torch")
    out, lse, _, _ = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, 0.0, None, False)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    args = (0.0, None, False, -1, -1, 0.0, None, False)
    fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 5, 6, *args)
    with pytest.raises(RuntimeError, match="_flash_attn_varlen_backward: cu_seqlens_k must start at 0"):
        fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, _ints([0, 7, 6], "torch"), 5, 7,
                                       *args)  # fmt: skip


def test_shapes_and_dtypes_are_still_the_core_s_errors(rng):
    """Only values raise RuntimeError: a bad shape or dtype is refused by the core call's checks
    (ValueError, TypeError) as before, and nothing is read."""
    call = _cache_call(rng, "numpy")
    with pytest.raises(ValueError, match="cache_seqlens must be an int or a 1-D int32 array of length 2"):
        fa.flash_attn_with_kvcache(*call, cache_seqlens=_ints([1, 2, 3], "numpy"))
    with pytest.raises(TypeError, match="cache_seqlens must be an integer array"):
        fa.flash_attn_with_kvcache(*call, cache_seqlens=np.array([1.0, 99.0]))
    q, k, v, _, cu_k = _packed(rng, "numpy")
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
        fa.flash_attn_varlen_func(q, k, v, np.array([0.0, 3.0, 99.0]), cu_k, 5, 6)


def _no_read_back(monkeypatch):
    """Calls of the core API recorded instead of run, and any read of values refused."""
    calls = []

    def refuse(x):
        raise AssertionError("a value was read back")

    def record(*args, **kwargs):
        calls.append(kwargs)
        return args[0], None

    monkeypatch.setattr(fa, "_host_ints", refuse)
    monkeypatch.setattr(fa, "attention_with_kvcache", record)
    monkeypatch.setattr(fa, "attention_varlen", record)
    return calls


def test_compiling_skips_the_check(rng, monkeypatch):
    """Under torch.compile no value is read (a read would break the graph): the call goes to the
    core API, whose kernels report a bad value in the error word."""
    calls = _no_read_back(monkeypatch)
    monkeypatch.setattr(_interop, "compiling", lambda: True)
    call = _cache_call(rng, "torch", paged=True)
    bad = {"cache_seqlens": _ints([11, -1], "torch"), "block_table": _ints([[0, 1, 99], [-1, 4, 5]], "torch")}
    fa.flash_attn_with_kvcache(*call, **bad)
    q, k, v, _, cu_k = _packed(rng, "torch")
    fa.flash_attn_varlen_func(q, k, v, _ints([0, 5, 3], "torch"), cu_k, 5, 6)
    assert len(calls) == 2 and calls[0]["cache_seqlens"] is bad["cache_seqlens"]


def test_graph_capture_skips_the_check(rng, monkeypatch):
    """During CUDA-graph capture a copy to the host is not allowed: no value is read (a stand-in
    GPU library here, its stream capturing; the `gpu` test captures a real graph)."""

    class CapturingLib:
        def stream(self, device):
            return 1234

    calls = _no_read_back(monkeypatch)
    monkeypatch.setattr(_interop, "gpu_arrays", lambda names, arrays: (CapturingLib(), 0, list(arrays)))
    monkeypatch.setattr(_interop, "stream_is_capturing", lambda stream: stream == 1234)
    call = _cache_call(rng, "torch")
    fa.flash_attn_with_kvcache(*call, cache_seqlens=_ints([11, -1], "torch"))
    assert len(calls) == 1


def test_torch_compile_keeps_one_graph(rng):
    """flash_attn_with_kvcache compiled (fullgraph): the check adds no graph break, and the
    compiled call equals the eager one (whose values were checked)."""
    torch._dynamo.reset()
    q, k_cache, v_cache, k, v = _cache_call(rng, "torch")
    lens = _ints([3, 9], "torch")
    caches = [_copy(k_cache), _copy(v_cache)]

    def step(q, k_cache, v_cache):
        return fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True) * 2.0

    explained = torch._dynamo.explain(step)(q, _copy(k_cache), _copy(v_cache))
    assert explained.graph_break_count == 0, explained.break_reasons
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache)
    torch.testing.assert_close(got, step(q, *caches))


@pytest.mark.gpu
def test_gpu_bad_values_raise_in_the_call_and_the_core_keeps_its_error_word():
    """CUDA tensors and CuPy arrays: the drop-in reads the values back and raises, nothing runs
    (the error word stays clear); the core API does not read them (no error in the call, NaN rows,
    check_device_errors raises); good values equal the core's result; capture skips the check."""
    import cupy

    cupyflash.check_device_errors()
    torch.manual_seed(3)
    dev = "cuda"
    q = torch.randn(B, 1, H, 64, device=dev, dtype=torch.bfloat16)
    k_pages, v_pages = (torch.randn(NUM_BLOCKS, 16, HK, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, NEW, HK, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=dev)  # 48 keys a row
    good = torch.tensor([46, 10], dtype=torch.int32, device=dev)  # 46 + 2 = 48: exactly full
    caches = [k_pages.clone(), v_pages.clone()]
    out = fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=good, block_table=table)
    want = cupyflash.attention_with_kvcache(q, *caches, cache_seqlens=good, block_table=table, k_new=k, v_new=v,
                                            causal=False)  # fmt: skip
    assert torch.equal(out, want) and torch.equal(k_pages, caches[0])
    cupyflash.check_device_errors()
    bad = torch.tensor([47, 10], dtype=torch.int32, device=dev)
    before = k_pages.clone()
    with pytest.raises(RuntimeError, match="block_table") as raised:
        fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=bad, block_table=table)
    assert "cache_seqlens[0]=47" in str(raised.value) and torch.equal(k_pages, before)
    bad_page = torch.tensor([[0, 1, 2], [NUM_BLOCKS, 4, 5]], dtype=torch.int32, device=dev)
    with pytest.raises(RuntimeError, match=r"block_table\[1\] points outside"):
        fa.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, cache_seqlens=good, block_table=bad_page)
    cupyflash.check_device_errors()  # nothing ran with the bad values
    # the core API: no read, no raise in the call; NaN rows and the error word
    out = cupyflash.attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=bad + 2, block_table=table)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()
    with pytest.raises(cupyflash.DeviceValueError, match="cache_seqlens"):
        cupyflash.check_device_errors()
    # CuPy arrays, varlen offsets
    qc, kc, vc = (cupy.asarray(x.float().cpu().numpy()).astype(cupy.float16) for x in (q[:, 0], k[:, 0], v[:, 0]))
    with pytest.raises(RuntimeError, match="cu_seqlens_k must start at 0"):
        fa.flash_attn_varlen_func(qc, kc, vc, cupy.array([0, 1, 2], cupy.int32), cupy.array([0, 2, 1], cupy.int32), 1,
                                  2)  # fmt: skip
    # capture: the check is skipped, the kernels report
    lens = torch.tensor([10, 10], dtype=torch.int32, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)  # plan before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens, block_table=table)
    lens.copy_(torch.tensor([49, 10], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(captured[0]).all() and torch.isfinite(captured[1]).all()
    with pytest.raises(cupyflash.DeviceValueError, match="cache_seqlens"):
        cupyflash.check_device_errors()
