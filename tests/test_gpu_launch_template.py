"""The launch path's packed template on the GPU: the second and later calls of one plan set only
pointers, and their kernels get the Launch's parameter bytes packed once with the new pointers
stored (tests/test_launch.py checks those bytes on the CPU). Here each kind of launch runs three
times with fresh inputs of the same shapes, every result against the float64 reference, and the
later calls must have taken the packed template: a pointer stored in the wrong word would read
the first call's arrays (a plausible, wrong answer) or fault.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_attention, check_kvcache, gpu_inputs, need_torch, skip_unless_kernel
from test_gpu_backward import check_backward
from test_gpu_decode import _paginate

import cupyflash
from cupyflash import _kernels

pytestmark = pytest.mark.gpu

CALLS = 3


@pytest.fixture
def packed_launches(monkeypatch):
    """Per kernel launch, whether it took the packed template (a list, appended to)."""
    seen: list[bool] = []
    real = _kernels.CompiledKernel.launch

    def spy(self, grid, block, smem, stream, params, maps=None, packed=None):
        seen.append(packed is not None)
        return real(self, grid, block, smem, stream, params, maps, packed)

    monkeypatch.setattr(_kernels.CompiledKernel, "launch", spy)
    return seen


def _later_calls_packed(seen: list[bool], per_call: int) -> None:
    assert len(seen) == CALLS * per_call, seen
    assert all(seen[per_call:]), f"a later call packed every field: {seen}"


@pytest.mark.parametrize("algorithm", ("fa2", "fa3"))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_forward_calls_after_the_first(rng, packed_launches, algorithm, head_dim):
    skip_unless_kernel(algorithm, head_dim)
    for _ in range(CALLS):
        q, k, v = gpu_inputs(rng, (2, 197, 6, head_dim), (2, 301, 2, head_dim), "bfloat16")
        check_attention(q, k, v, causal=True, algorithm=algorithm)
    _later_calls_packed(packed_launches, len(packed_launches) // CALLS)


@pytest.mark.parametrize("deterministic", (False, True))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_backward_calls_after_the_first(rng, packed_launches, deterministic, head_dim):
    torch = need_torch()
    torch.manual_seed(int(rng.integers(1 << 31)))
    for _ in range(CALLS):
        q = torch.randn(2, 197, 6, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 301, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        check_backward(torch, q, k, v, causal=True, window=(-1, -1), softcap=0.0, scale=None, layout="bshd",
                       deterministic=deterministic)  # fmt: skip
    # each call: the forward's launches, then the backward's
    assert all(packed_launches[len(packed_launches) // CALLS :]), packed_launches


@pytest.mark.parametrize("paged", (False, True))
def test_decode_with_append_calls_after_the_first(rng, packed_launches, paged):
    torch = need_torch()
    b, length, nq, hq, hkv, d = 4, 1031, 2, 8, 2, 128
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    cached = [0, 1, 500, length - nq]
    seqlens = torch.tensor(cached, dtype=torch.int32, device="cuda")
    page = 16
    for _ in range(CALLS):
        q = torch.randn(b, nq, hq, d, generator=gen).to("cuda", torch.bfloat16)
        k, v = (torch.randn(b, length, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        k_new, v_new = (torch.randn(b, nq, hkv, d, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
        expected_k, expected_v = k.clone(), v.clone()
        for i, n in enumerate(cached):
            expected_k[i, n : n + nq], expected_v[i, n : n + nq] = k_new[i], v_new[i]
        table = None
        k_cache, v_cache = k, v
        if paged:
            (k_cache, v_cache), table = _paginate(torch, (k, v), page, gen)
        out, lse = cupyflash.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, k_new=k_new, v_new=v_new, causal=True,
            return_lse=True,
        )  # fmt: skip
        check_kvcache(out, lse, q, expected_k, expected_v, [n + nq for n in cached], True, "bfloat16")
        if not paged:
            assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    _later_calls_packed(packed_launches, len(packed_launches) // CALLS)


def test_cupy_forward_calls_after_the_first(rng, packed_launches):
    """CuPy arrays take the same path (their pointers come from another library)."""
    import cupy

    for _ in range(CALLS):
        q, k, v = gpu_inputs(rng, (1, 300, 4, 64), (1, 300, 4, 64), "float16", lib="cupy")
        out = cupyflash.attention(q, k, v)
        want = cupyflash.reference.attention(q, k, v)
        got = cupy.asnumpy(out).astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    _later_calls_packed(packed_launches, len(packed_launches) // CALLS)
