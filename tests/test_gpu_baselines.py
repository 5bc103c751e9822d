"""The GPU baselines of the IO study -- algorithm="naive" (cuBLAS + kernels_cu/naive.cu) and
algorithm="fa1" (kernels_cu/fa1_fwd.cu) -- against the float64 reference, with NaN-poisoned
outputs (conftest) and the same error rules as FA2 (tests/helpers.py's check_attention)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BOUND, EXTRA, SHAPES, check_attention, gpu_inputs, need_torch, rel_error

import cupyflash
from cupyflash import _baselines_gpu, reference

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
FA1_HEAD_DIMS = (64, 128, 256, 512)
NAIVE_HEAD_DIMS = (64, 80, 128, 512)  # any head dim: cuBLAS does the products


def _lse_atol(algorithm, dtype):
    # naive's LSE comes from S rounded to the input type: a bf16 score carries ~2^-9 relative error.
    return 2e-2 if (algorithm, dtype) == ("naive", "bfloat16") else 2e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("algorithm", "head_dim"), [("fa1", d) for d in FA1_HEAD_DIMS] + [("naive", d) for d in NAIVE_HEAD_DIMS]
)
@pytest.mark.parametrize("case", list(SHAPES), ids=str)
def test_baseline_matches_reference(rng, algorithm, dtype, head_dim, case):
    b, nq, nk, hq, hkv, causal, window, softcap = SHAPES[case]
    q, k, v = gpu_inputs(rng, (b, nq, hq, head_dim), (b, nk, hkv, head_dim), dtype)
    check_attention(q, k, v, causal=causal, window=window, algorithm=algorithm, lse_atol=_lse_atol(algorithm, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ["fa1", "naive"])
@pytest.mark.parametrize("case", list(EXTRA), ids=str)
def test_baseline_windows_and_softcap(rng, algorithm, dtype, case):
    b, nq, nk, hq, hkv, causal, window, softcap = EXTRA[case]
    q, k, v = gpu_inputs(rng, (b, nq, hq, 128), (b, nk, hkv, 128), dtype)
    check_attention(
        q, k, v, causal=causal, window=window, softcap=softcap, algorithm=algorithm,
        lse_atol=_lse_atol(algorithm, dtype),
    )  # fmt: skip


@pytest.mark.parametrize(("block_r", "block_c"), [(32, 32), (64, 64), (64, 256), (64, 768), (16, 48)])
@pytest.mark.parametrize("causal", [False, True])
def test_fa1_explicit_tiles(rng, block_r, block_c, causal):
    """Many outer steps (T_c up to 32): the (O, m, l) round trip through HBM at every step."""
    import cupy

    q, k, v = gpu_inputs(rng, (2, 700, 3, 64), (2, 1000, 3, 64), "float16", lib="cupy")
    out, lse = _baselines_gpu.fa1_attention(q, k, v, block_r=block_r, block_c=block_c, causal=causal)
    cupy.cuda.Device().synchronize()
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    assert rel_error(reference.to_numpy64(out), ref) < BOUND["float16"]
    np.testing.assert_allclose(reference.to_numpy64(lse), ref_lse, atol=2e-3, rtol=1e-3)


def test_fa1_tiles_that_do_not_fit_are_refused(rng):
    q, k, v = gpu_inputs(rng, (1, 64, 1, 512), (1, 64, 1, 512), "float16", lib="cupy")
    with pytest.raises(ValueError, match="shared memory"):
        _baselines_gpu.fa1_attention(q, k, v, block_r=64, block_c=512)


def test_three_algorithms_agree(rng):
    """naive, FA1 and FA2 on one input: each close to the reference and to the others."""
    q, k, v = gpu_inputs(rng, (2, 513, 4, 128), (2, 1031, 2, 128), "bfloat16")
    outs = {
        a: reference.to_numpy64(cupyflash.attention(q, k, v, causal=True, algorithm=a)) for a in ("naive", "fa1", "fa2")
    }
    for a in ("naive", "fa1"):
        assert rel_error(outs[a], outs["fa2"]) < 2 * BOUND["bfloat16"]


@pytest.mark.parametrize("algorithm", ["fa1", "naive"])
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_any_scale(rng, algorithm, scale):
    q, k, v = gpu_inputs(rng, (1, 65, 2, 64), (1, 80, 2, 64), "float16")
    check_attention(q, k, v, causal=True, scale=scale, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["fa1", "naive"])
def test_layouts_and_strides(rng, algorithm):
    """bhsd (naive: one collapsed strided batch), bshd with B < H (one GEMM call per batch entry),
    GQA (one call per head), a single head, a head slice and a transposed head_dim (copied)."""
    torch = need_torch()
    q, k, v = gpu_inputs(rng, (2, 4, 77, 64), (2, 4, 91, 64), "bfloat16")
    check_attention(q, k, v, layout="bhsd", causal=True, algorithm=algorithm, lse_atol=_lse_atol(algorithm, "bfloat16"))
    q, k, v = gpu_inputs(rng, (2, 77, 6, 64), (2, 91, 6, 64), "float16")
    check_attention(q, k, v, algorithm=algorithm)
    q, k, v = gpu_inputs(rng, (3, 77, 1, 64), (3, 91, 1, 64), "float16")
    check_attention(q, k, v, causal=True, algorithm=algorithm)
    qs = torch.randn(2, 77, 8, 64, device="cuda", dtype=torch.float16)[:, :, ::2]
    kt = torch.randn(2, 64, 91, 2, device="cuda", dtype=torch.float16).permute(0, 2, 3, 1)
    vt = torch.randn(2, 91, 2, 64, device="cuda", dtype=torch.float16)
    check_attention(qs, kt, vt, causal=True, algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["fa1", "naive"])
def test_cupy_in_cupy_out(rng, algorithm):
    import cupy

    q, k, v = gpu_inputs(rng, (2, 33, 4, 64), (2, 65, 2, 64), "float16", lib="cupy")
    out, _ = check_attention(q, k, v, causal=True, algorithm=algorithm)
    assert isinstance(out, cupy.ndarray)


@pytest.mark.parametrize("algorithm", ["fa1", "naive"])
def test_empty_shapes(algorithm):
    torch = need_torch()
    kw = {"device": "cuda", "dtype": torch.float16}
    out, lse = cupyflash.attention(
        torch.randn(1, 3, 2, 64, **kw), torch.randn(1, 0, 2, 64, **kw), torch.randn(1, 0, 2, 64, **kw),
        return_lse=True, algorithm=algorithm,
    )  # fmt: skip
    assert (out == 0).all() and torch.isneginf(lse).all()
    out = cupyflash.attention(
        torch.randn(2, 0, 4, 64, **kw), torch.randn(2, 5, 4, 64, **kw), torch.randn(2, 5, 4, 64, **kw),
        algorithm=algorithm,
    )  # fmt: skip
    assert out.shape == (2, 0, 4, 64)


def test_unsupported_inputs_are_named():
    torch = need_torch()
    x = torch.randn(1, 8, 2, 80, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="algorithm='fa1' on the GPU supports head_dim"):
        cupyflash.attention(x, x, x, algorithm="fa1")
    y = torch.randn(1, 8, 2, 64, device="cuda")
    for algorithm in ("fa1", "naive"):
        with pytest.raises(TypeError, match="the GPU kernels take"):
            cupyflash.attention(y, y, y, algorithm=algorithm)
