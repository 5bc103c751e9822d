"""Bad input gets a clear error naming the problem; nothing runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import _device, _interop, _plan
from cupyflash._validate import attention_problem

# The H200's limits, as cupyflash._device.device_info reads them.
H200 = _device.HOPPER

Q = np.zeros((2, 5, 4, 16), dtype=np.float32)
K = np.zeros((2, 7, 2, 16), dtype=np.float32)


@pytest.mark.parametrize(
    ("q", "k", "v", "kwargs", "message"),
    [
        (Q[0], K, K, {}, "q must be 4-D"),
        (Q, K[0], K[0], {}, "k must be 4-D"),
        (Q, K, K[:, :6], {}, "k and v must have the same shape"),
        (Q[:1], K, K, {}, "same batch size"),
        (Q[..., :8], K, K, {}, "same head_dim"),
        (Q[:, :, :3], K, K, {}, "multiple of the number of key/value heads"),
        (Q, K[:, :, :0], K[:, :, :0], {}, "multiple of the number of key/value heads"),
        (Q, K, K, {"scale": math.nan}, "scale must be a finite real number"),
        (Q, K, K, {"scale": math.inf}, "scale must be a finite real number"),
        (Q, K, K, {"scale": "0.1"}, "scale must be a finite real number"),
        (Q, K, K, {"softcap": -1.0}, "softcap must be a finite number >= 0"),
        (Q, K, K, {"window": (-2, 0)}, "window must be a pair"),
        (Q, K, K, {"window": (3,)}, "window must be a pair"),
        (Q, K, K, {"window": (1.5, 2)}, "window must be a pair"),
        (Q, K, K, {"window": (np.array(1.5), 2)}, "window must be a pair"),
        (Q, K, K, {"window": (np.array([1]), 2)}, "window must be a pair"),
        (Q, K, K, {"window": (np.array(True), 2)}, "window must be a pair"),
        (Q, K, K, {"window": (np.array(-2), 0)}, "window must be a pair"),
        (Q, K, K, {"causal": 1}, "causal must be a bool"),
        (Q, K, K, {"layout": "sbhd"}, "layout must be one of"),
        (Q, K, K, {"algorithm": "flash3"}, "algorithm must be one of"),
        (Q.astype(np.int32), K.astype(np.int32), K.astype(np.int32), {}, "real floating dtype"),
        (Q, K.astype(np.float64), K.astype(np.float64), {}, "one dtype"),
    ],
)
def test_bad_input_raises(q, k, v, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        cupyflash.attention(q, k, v, **kwargs)


def test_window_bounds_may_be_numpy_scalars_and_0d_arrays(rng):
    """flash-attn's C++ entry takes its window bounds as ints, and its tests pass 0-d tensors:
    an integer 0-d array (or NumPy integer) is taken as the int it holds."""
    q, k = rng.standard_normal((1, 9, 2, 8)), rng.standard_normal((1, 12, 2, 8))
    want = cupyflash.attention(q, k, k, window=(3, 1))
    for window in [(np.array(3), np.int32(1)), (np.int64(3), np.array(1, dtype=np.int16))]:
        np.testing.assert_array_equal(cupyflash.attention(q, k, k, window=window), want)
    cu = np.array([0, 9], dtype=np.int32)
    np.testing.assert_array_equal(
        cupyflash.attention_varlen(
            q[0], k[0], k[0], cu, np.array([0, 12], dtype=np.int32), 9, 12, window=(np.array(3), np.array(1))
        ),
        want[0],
    )


def test_window_bounds_may_be_0d_tensors():
    torch = pytest.importorskip("torch")
    q, k = torch.randn(1, 9, 2, 8), torch.randn(1, 12, 2, 8)
    want = cupyflash.attention(q, k, k, window=(3, 1))
    got = cupyflash.attention(q, k, k, window=(torch.tensor(3), torch.tensor(1, dtype=torch.int32)))
    assert torch.equal(got, want)
    for bad in [torch.tensor(3.0), torch.tensor(True), torch.tensor([3])]:
        with pytest.raises(ValueError, match="window must be a pair"):
            cupyflash.attention(q, k, k, window=(bad, 1))


def test_bhsd_shapes_are_read_as_bhsd():
    q = np.zeros((2, 4, 5, 16), dtype=np.float32)
    k = np.zeros((2, 3, 7, 16), dtype=np.float32)
    with pytest.raises(
        ValueError, match=r"query heads \(4\) must be a multiple of the number of key/value heads \(3\)"
    ):
        cupyflash.attention(q, k, k, layout="bhsd")


def test_gpu_dtype_and_head_dim_errors_list_what_is_supported():
    with pytest.raises(TypeError, match=r"the GPU kernels take \['bfloat16', 'float16'\], got float32"):
        _plan.check_gpu_dtypes({"q": "float32", "k": "float32", "v": "float32"})
    with pytest.raises(TypeError, match="k must have q's dtype float16, got bfloat16"):
        _plan.check_gpu_dtypes({"q": "float16", "k": "bfloat16", "v": "float16"})
    p = attention_problem((1, 4, 2, 320), (1, 4, 2, 320), (1, 4, 2, 320), causal=False, scale=None, window=(-1, -1),
                          softcap=0.0, layout="bshd")  # fmt: skip
    with pytest.raises(ValueError, match="head_dim from 1 to 256, got 320"):
        _plan.forward_spec(p, "float16", H200, "auto", packed=False)


class _FakeGpuArray:
    """Stands for a GPU array of an unknown library: only the DLPack device query."""

    def __init__(self, shape):
        self.shape = shape

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="q is a numpy array on the host but k is a .* array on GPU 0"):
        cupyflash.attention(Q, _FakeGpuArray(K.shape), K)


def test_mixed_libraries_are_refused():
    import array_api_strict as xps

    with pytest.raises(ValueError, match="all inputs must be arrays of one library on one device"):
        cupyflash.attention(Q, xps.asarray(K), K)


def test_window_normalisation():
    from cupyflash._validate import normalize_window

    assert normalize_window(True, (-1, -1), 1, 100) == (-1, -1)  # one query token: causal hides nothing
    assert normalize_window(True, (-1, -1), 10, 100) == (-1, 0)
    assert normalize_window(False, (200, 9), 10, 100) == (-1, -1)  # bounds wider than the sequence
    assert normalize_window(False, (98, 8), 10, 100) == (98, 8)
    assert normalize_window(True, (5, 0), 10, 100) == (5, 0)


def test_readable_layout_rules():
    shape, strides = (2, 5, 4, 64), (1280, 256, 64, 1)
    assert _interop.kernel_readable(256, shape, strides)
    assert not _interop.kernel_readable(258, shape, strides)  # misaligned base
    assert not _interop.kernel_readable(256, shape, (1280, 256, 1, 4))  # head_dim not unit-stride
    assert not _interop.kernel_readable(256, shape, (1284, 257, 64, 1))  # rows not 16-byte multiples
    assert _interop.kernel_readable(256, (1, 1, 4, 64), (3, 5, 64, 1))  # size-1 axes: strides unused
    assert not _interop.kernel_readable(256, shape, (1280, -256, 64, 1))  # reversed rows (CuPy [::-1])


def test_gpu_scale_range_is_checked_before_launch():
    from cupyflash._validate import attention_problem

    p = attention_problem(
        Q.shape, K.shape, K.shape, causal=False, scale=1e9, window=(-1, -1), softcap=0.0, layout="bshd"
    )
    with pytest.raises(ValueError, match=r"\|scale\| <= 1e\+06"):
        _plan.softmax_factors(p)
    capped = attention_problem(
        Q.shape, K.shape, K.shape, causal=False, scale=1.0, window=(-1, -1), softcap=1e-300, layout="bshd"
    )
    scale_log2, prescale, negate = _plan.softmax_factors(capped)
    assert prescale == 1e30 and not negate and scale_log2 > 0


def test_float_cu_seqlens_are_refused_on_the_host():
    """A float cu_seqlens was truncated by int() without a word; now it is refused."""
    q = np.ones((7, 2, 16), dtype=np.float32)
    cu = np.array([0.0, 3.0, 7.0])
    with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
        cupyflash.attention_varlen(q, q, q, cu, cu.astype(np.int32), 4, 4)


def test_causal_clamps_the_right_window_bound_as_flash_attn():
    """causal=True with window (4, 3): flash-attn's (4, 0), not an error."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 9, 2, 8)), rng.standard_normal((1, 12, 1, 8))
    got = cupyflash.attention(q, k, k, causal=True, window=(4, 3))
    np.testing.assert_array_equal(got, cupyflash.attention(q, k, k, causal=True, window=(4, 0)))
