"""The forward kernels on the GPU against the float64 reference: FA2 (mma.sync, every GPU) and,
on Hopper, the wgmma + TMA kernel ("fa3", what "auto" runs there for head_dim 64/128/256).

Outputs are NaN-poisoned before every launch (conftest), inputs are fresh random data, and the
error must stay under the dtype's bound and within 2x the error of naive attention computed in
the same low precision (flash-attn's rule) plus a rounding floor.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import (
    BOUND,
    EXTRA,
    SHAPES,
    check_attention,
    gpu_inputs,
    is_hopper,
    need_torch,
    rel_error,
    skip_unless_kernel,
)

import cupyflash
from cupyflash import reference

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (32, 64, 96, 128, 192, 256)


@pytest.mark.parametrize("algorithm", ("fa2", "fa3"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("case", list(SHAPES), ids=str)
def test_forward_matches_reference(rng, algorithm, dtype, head_dim, case):
    skip_unless_kernel(algorithm, head_dim)
    b, nq, nk, hq, hkv, causal, window, softcap = SHAPES[case]
    q, k, v = gpu_inputs(rng, (b, nq, hq, head_dim), (b, nk, hkv, head_dim), dtype)
    check_attention(q, k, v, causal=causal, window=window, softcap=softcap, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ("fa2", "fa3"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("case", list(EXTRA), ids=str)
def test_windows_and_softcap(rng, algorithm, dtype, head_dim, case):
    skip_unless_kernel(algorithm, head_dim)
    b, nq, nk, hq, hkv, causal, window, softcap = EXTRA[case]
    q, k, v = gpu_inputs(rng, (b, nq, hq, head_dim), (b, nk, hkv, head_dim), dtype)
    check_attention(q, k, v, causal=causal, window=window, softcap=softcap, algorithm=algorithm)


# Head dims below a tile width (TileColumns in kernels_cu/common.cuh): multiples of 8 move in
# 16-byte chunks, the others element by element; "auto" runs the Hopper kernel (at the next of
# 64/128/256) for multiples of 8 on sm_90.
TAIL_HEAD_DIMS = (8, 17, 40, 59, 80, 111, 160, 224)


@pytest.mark.parametrize("algorithm", ("fa2", "auto"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", TAIL_HEAD_DIMS)
@pytest.mark.parametrize("case", [*SHAPES, "window-softcap"], ids=str)
def test_head_dims_below_a_tile_width(rng, algorithm, dtype, head_dim, case):
    b, nq, nk, hq, hkv, causal, window, softcap = {**SHAPES, **EXTRA}[case]
    q, k, v = gpu_inputs(rng, (b, nq, hq, head_dim), (b, nk, hkv, head_dim), dtype)
    check_attention(q, k, v, causal=causal, window=window, softcap=softcap, algorithm=algorithm)


@pytest.mark.parametrize("head_dim, width", [(59, 61), (59, 64), (80, 84), (80, 96), (40, 64)])
def test_head_dim_views_of_wider_rows(rng, head_dim, width):
    """Views of the first head_dim columns of wider rows: read in place where the kernels can
    (element rows: any stride; 16-byte chunks: strides of 8 elements), else through a copy."""
    q, k, v = gpu_inputs(rng, (2, 70, 4, width), (2, 90, 2, width), "bfloat16")
    q, k, v = (x[..., :head_dim] for x in (q, k, v))
    check_attention(q, k, v, causal=True)


@pytest.mark.parametrize("algorithm", ("fa2", "fa3"))
@pytest.mark.parametrize("head_dim, causal", [(128, True), (64, False), (64, True)])
def test_long_sequence(rng, algorithm, head_dim, causal):
    """Past FA3_SHORT_SEQLEN keys: the long-call tiles (the short ones serve most other tests)."""
    q, k, v = gpu_inputs(rng, (1, 4099, 2, head_dim), (1, 4099, 1, head_dim), "bfloat16")
    check_attention(q, k, v, causal=causal, algorithm=algorithm)


@pytest.mark.parametrize(
    "causal, options",
    [(True, {"softcap": 20.0}), (False, {"window": (700, 0)}), (False, {"window": (300, 200)})],
    ids=str,
)
def test_long_sequence_bounded_tiles(rng, causal, options):
    """d = 64 past FA3_SHORT_SEQLEN keys with a bound (causal, a window) and softcap: the long
    calls' bounded tile (uneven tiles on the dynamic schedule)."""
    skip_unless_kernel("fa3", 64)
    q, k, v = gpu_inputs(rng, (2, 2500, 3, 64), (2, 2500, 1, 64), "float16")
    check_attention(q, k, v, causal=causal, algorithm="fa3", **options)


# (head_dim, causal, batch, seqlen, heads, heads_kv, dtype): 240-320 tiles over 132 SMs in each
# variant family.
MANY_TILES = [
    (64, False, 2, 1001, 16, 4, "bfloat16"),  # the short-call tile: ping-pong, dynamic schedule
    (64, False, 2, 2100, 13, 1, "float16"),  # three consumers, static schedule
    (64, True, 2, 1001, 16, 4, "bfloat16"),
    (64, True, 2, 2100, 13, 1, "bfloat16"),  # past the short call: three in round robin, dynamic
    (128, False, 2, 1001, 20, 4, "bfloat16"),  # 8 key blocks a tile
    (128, False, 1, 2000, 18, 6, "float16"),  # 16 key blocks a tile
    (128, True, 2, 1001, 16, 4, "bfloat16"),
    (256, False, 3, 601, 16, 4, "bfloat16"),  # O in the Q tile: one Q buffer, no overlap
]


@pytest.mark.parametrize("head_dim, causal, batch, seqlen, heads, heads_kv, dtype", MANY_TILES)
def test_many_tiles_per_cta(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype):
    """Persistent CTAs over two tiles or more each: the Q buffers alternate, a tile's epilogue
    runs under the next one's first Q K^T, the K/V ring runs on across tiles, and a ragged last
    query block ends each (batch, head). Bit-identical on later calls (a race would move it)."""
    check_many_tiles(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype)


def check_many_tiles(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype, **switches):
    """A MANY_TILES case on the Hopper forward against the float64 reference, bit-identical on
    two later calls, with ``switches`` (_dispatch's names and values) set for its plans only."""
    from cupyflash import _dispatch, _plan

    skip_unless_kernel("fa3", head_dim)
    saved = {name: getattr(_dispatch, name) for name in switches}
    for name, value in switches.items():
        setattr(_dispatch, name, value)
    _plan.clear_caches()
    try:
        q, k, v = gpu_inputs(rng, (batch, seqlen, heads, head_dim), (batch, seqlen + 7, heads_kv, head_dim), dtype)
        first, _ = check_attention(q, k, v, causal=causal, algorithm="fa3")
        for _ in range(2):
            assert bool((cupyflash.attention(q, k, v, causal=causal, algorithm="fa3") == first).all())
    finally:
        for name, value in saved.items():
            setattr(_dispatch, name, value)
        _plan.clear_caches()


@pytest.mark.parametrize("head_dim, causal, batch, seqlen, heads, heads_kv, dtype", [c for c in MANY_TILES if c[1]])
def test_causal_tiles_longest_first_in_sections(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype):
    """The causal Hopper forward's tiles in sections of 3 (batch, head) pairs, each query block
    first (_dispatch.FA3_FWD_LPT): every tile drawn once (a lost or doubled one would leave rows
    unwritten: outputs poisoned), the float64 reference's output, bit-identical on later calls."""
    room = 3 * (seqlen + 7) * head_dim * 4 // (heads // heads_kv)  # 3 pairs' share of K and V
    check_many_tiles(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype, FA3_FWD_LPT=True,
                     FA3_FWD_LPT_L2_BYTES=room)  # fmt: skip


@pytest.mark.parametrize("head_dim, causal, batch, seqlen, heads, heads_kv, dtype", MANY_TILES)
def test_uniform_consumer_index(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype):
    """The Hopper forward with its consumer index broadcast from lane 0
    (_dispatch.FA3_FWD_UNIFORM_CONSUMER) over persistent CTAs of several tiles each."""
    check_many_tiles(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype, FA3_FWD_UNIFORM_CONSUMER=True)


@pytest.mark.parametrize("head_dim, causal, batch, seqlen, heads, heads_kv, dtype", [c for c in MANY_TILES if not c[1]])
def test_single_tile_schedule(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype):
    """The Hopper forward without a mask on one CTA per tile (_dispatch.FA3_FWD_SINGLE_TILE): every
    tile written once (outputs poisoned), the float64 reference's output, bit-identical later."""
    check_many_tiles(rng, head_dim, causal, batch, seqlen, heads, heads_kv, dtype, FA3_FWD_SINGLE_TILE=True)


def test_auto_runs_the_hopper_kernel_there(rng):
    """On sm_90 "auto" is the wgmma kernel for head_dim 128 (its variant shows in the cache)."""
    from cupyflash import _kernels

    if not is_hopper():
        pytest.skip("not a Hopper GPU")
    q, k, v = gpu_inputs(rng, (1, 64, 2, 128), (1, 64, 2, 128), "float16")
    cupyflash.attention(q, k, v)
    assert any(spec.kernel == "fa3_fwd" and spec.head_dim == 128 for spec, _ in _kernels._compiled)


def test_fa3_refuses_what_it_cannot_run(rng):
    q, k, v = gpu_inputs(rng, (1, 16, 2, 59), (1, 16, 2, 59), "float16")  # TMA moves 16-byte rows
    with pytest.raises(ValueError, match="algorithm='fa3'.*multiple of 8"):
        cupyflash.attention(q, k, v, algorithm="fa3")


@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_any_scale(rng, scale):
    q, k, v = gpu_inputs(rng, (1, 65, 2, 64), (1, 80, 2, 64), "float16")
    check_attention(q, k, v, causal=True, scale=scale)


def test_bhsd_and_strided_inputs(rng):
    torch = need_torch()
    q, k, v = gpu_inputs(rng, (2, 4, 77, 64), (2, 2, 91, 64), "bfloat16")
    check_attention(q, k, v, layout="bhsd", causal=True)
    # a head slice (strided batch/row axes) and a transposed view (head_dim not unit-stride)
    qs = torch.randn(2, 77, 8, 64, device="cuda", dtype=torch.bfloat16)[:, :, ::2]
    kt = torch.randn(2, 64, 91, 2, device="cuda", dtype=torch.bfloat16).permute(0, 2, 3, 1)
    vt = torch.randn(2, 91, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert kt.stride(-1) != 1
    check_attention(qs, kt, vt, causal=True)


def test_cupy_arrays_in_cupy_out(rng):
    import cupy

    q, k, v = gpu_inputs(rng, (2, 33, 4, 128), (2, 65, 2, 128), "float16", lib="cupy")
    out, _ = check_attention(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray)


def test_cupy_negative_strides(rng):
    """A reversed view (negative row stride) is copied first: a TMA map takes unsigned strides."""
    q, k, v = (x[:, ::-1] for x in gpu_inputs(rng, (1, 70, 2, 128), (1, 90, 2, 128), "float16", lib="cupy"))
    assert q.strides[1] < 0
    out = cupyflash.attention(q, k, v, causal=True)
    ref = reference.attention(q, k, v, causal=True)
    assert rel_error(reference.to_numpy64(out), ref) < BOUND["float16"]


def test_jax_arrays_round_trip(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    import jax.numpy as jnp

    host = [rng.standard_normal(s).astype(np.float32) for s in ((1, 40, 4, 64), (1, 50, 4, 64), (1, 50, 4, 64))]
    q, k, v = (jnp.asarray(h, dtype=jnp.bfloat16) for h in host)
    out = cupyflash.attention(q, k, v, causal=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.bfloat16
    ref = reference.attention(q, k, v, causal=True)
    assert rel_error(reference.to_numpy64(out), ref) < BOUND["bfloat16"]


# (algorithm, head_dim, dtype): the default dispatch, and the baselines (FA1's kernel; the naive
# path's GEMMs and softmax kernel).
STREAM_CASES = [("auto", 128, "bfloat16"), ("fa1", 64, "float16"), ("naive", 64, "float16")]


@pytest.mark.parametrize("algorithm, head_dim, dtype", STREAM_CASES)
def test_torch_non_default_stream(rng, algorithm, head_dim, dtype):
    """Work is queued on PyTorch's current stream: launched elsewhere it would read q before the
    copy that the side stream makes after a long sleep, and see NaNs."""
    torch = need_torch()
    q_real, k, v = gpu_inputs(rng, (1, 256, 8, head_dim), (1, 256, 8, head_dim), dtype)
    q = torch.full_like(q_real, math.nan)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the copy lands
        q.copy_(q_real)
        out = cupyflash.attention(q, k, v, causal=True, algorithm=algorithm)
    side.synchronize()
    ref = reference.attention(q_real, k, v, causal=True)
    assert rel_error(reference.to_numpy64(out), ref) < BOUND[dtype]


def test_empty_and_degenerate_shapes():
    torch = need_torch()
    kw = {"device": "cuda", "dtype": torch.float16}
    out, lse = cupyflash.attention(
        torch.randn(2, 0, 4, 64, **kw), torch.randn(2, 5, 4, 64, **kw), torch.randn(2, 5, 4, 64, **kw), return_lse=True
    )
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    out, lse = cupyflash.attention(
        torch.randn(1, 3, 2, 64, **kw), torch.randn(1, 0, 2, 64, **kw), torch.randn(1, 0, 2, 64, **kw), return_lse=True
    )
    assert (out == 0).all() and torch.isneginf(lse).all()
    out = cupyflash.attention(
        torch.randn(0, 3, 2, 64, **kw), torch.randn(0, 4, 2, 64, **kw), torch.randn(0, 4, 2, 64, **kw)
    )
    assert out.shape == (0, 3, 2, 64)


def test_gpu_rejects_unsupported_inputs():
    torch = need_torch()
    x = torch.randn(1, 8, 2, 64, device="cuda")
    with pytest.raises(TypeError, match="the GPU kernels take"):
        cupyflash.attention(x, x, x)
    y = torch.randn(1, 8, 2, 264, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim from 1 to 256"):
        cupyflash.attention(y, y, y)
    with pytest.raises(ValueError, match="algorithm='decode' takes"):
        cupyflash.attention(x.half(), x.half(), x.half(), algorithm="decode", dropout_p=0.5, seed=3)
    with pytest.raises(ValueError, match="q is a torch array on the host but k is a torch array on GPU"):
        cupyflash.attention(x.half().cpu(), x.half(), x.half())


def test_call_from_a_fresh_thread(rng):
    """A thread that never touched CUDA has no current context: the launch must still work."""
    import threading

    q, k, v = gpu_inputs(rng, (1, 70, 4, 64), (1, 90, 2, 64), "float16")
    ref = reference.attention(q, k, v, causal=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=cupyflash.attention(q, k, v, causal=True)))
    thread.start()
    thread.join()
    need_torch().cuda.synchronize()
    assert rel_error(reference.to_numpy64(result["out"]), ref) < BOUND["float16"]


@pytest.mark.parametrize("algorithm", ("fa2", "fa3"))
def test_deterministic_bitwise(rng, algorithm):
    """The same inputs give the same bits: a moving result would be a race."""
    skip_unless_kernel(algorithm, 128)
    q, k, v = gpu_inputs(rng, (2, 1000, 8, 128), (2, 1000, 2, 128), "bfloat16")
    first = cupyflash.attention(q, k, v, causal=True, algorithm=algorithm)
    for _ in range(3):
        assert bool((cupyflash.attention(q, k, v, causal=True, algorithm=algorithm) == first).all())


def test_dynamic_schedule_streams_and_counters(rng):
    """The Hopper kernel's dynamic schedule (causal: persistent CTAs drawing tiles from a global
    counter): 768 tiles over one CTA per SM, calls on two streams at once (each stream has its
    own counters), every result bit-identical to the first, and the counters back at 0."""
    torch = need_torch()
    skip_unless_kernel("fa3", 128)
    from cupyflash import _dispatch, _workspace

    flags = _dispatch.MaskFlags(True, False, False)
    assert _dispatch.fa3_fwd_spec("bfloat16", 128, flags, 2000).tile.dynamic  # else nothing is tested
    q, k, v = gpu_inputs(rng, (3, 2000, 16, 128), (3, 2000, 4, 128), "bfloat16")
    check_attention(q, k, v, causal=True, algorithm="fa3")
    first = cupyflash.attention(q, k, v, causal=True, algorithm="fa3")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(4):
        outs.append(cupyflash.attention(q, k, v, causal=True, algorithm="fa3"))
        with torch.cuda.stream(side):
            outs.append(cupyflash.attention(q, k, v, causal=True, algorithm="fa3"))
    torch.cuda.synchronize()
    assert all(bool((out == first).all()) for out in outs)
    torch_buffers = {key[2]: buffer for key, buffer in _workspace._buffers.items() if key[0] == "torch"}
    assert {torch.cuda.current_stream().cuda_stream, side.cuda_stream} <= set(torch_buffers)
    for buffer in torch_buffers.values():
        assert int(buffer.array[: buffer.counter_bytes // 4].view(torch.int32).abs().sum()) == 0


def test_params_offsets_on_device():
    """The struct's real field offsets, read on the device, equal the NumPy mirror's."""
    import cupy

    from cupyflash import _source
    from cupyflash._params import ATTN_PARAMS_DTYPE, ATTN_PARAMS_FIELDS

    body = "\n".join(
        f"  out[{i}] = (long long)((const char*)&p.{name} - (const char*)&p);"
        for i, (name, _) in enumerate(ATTN_PARAMS_FIELDS)
    )
    code = f'#include "params.cuh"\nextern "C" __global__ void offsets(AttnParams p, long long* out) {{\n{body}\n}}\n'
    kernel = cupy.RawKernel(
        code, "offsets", options=("--std=c++17", f"-I{_source.kernel_dir()}", *_source.cuda_include_options())
    )
    out = cupy.zeros(len(ATTN_PARAMS_FIELDS), dtype=cupy.int64)
    kernel((1,), (1,), (np.zeros(1, dtype=ATTN_PARAMS_DTYPE), out))
    expected = [ATTN_PARAMS_DTYPE.fields[name][1] for name, _ in ATTN_PARAMS_FIELDS]
    assert out.get().tolist() == expected
