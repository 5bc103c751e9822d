"""Each verb of kernels_cu/softmax.cuh through a tiny kernel, against NumPy in float64: the online
softmax over key blocks (update_max, exp_accumulate, finalize) and the merge of partial states
(merge_weights). Cases: an all -inf row, a single visible score, a huge range, NaN, empty merges.
Blocks of 16 keys and of 128 (update_max's partial maxima: 8 key tiles or more). The kernel
compiles in CI (no GPU needed); the `gpu` tests run it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import _kernels, _source

# One warp holds a 16-row tile of m16n8 accumulators (OnlineSoftmax<1>): lane l owns rows l / 4
# and l / 4 + 8, element e of n-tile nt is column nt * 8 + (l % 4) * 2 + e % 2 of row slot e / 2.
SOURCE = r"""
#include "softmax.cuh"

// kNTiles x 8 keys per block: 16 (a running max of 2 key tiles), 128 (16: update_max's partial
// maxima, as the Hopper forward's blocks take them)
template <int kNTiles>
__device__ void online_softmax_blocks(const float* s, int n_blocks, float scale_log2,
                                      float* inv_sum_out, float* lse_out) {
  const int lane = threadIdx.x;
  const int cols = n_blocks * 8 * kNTiles;
  OnlineSoftmax<1> softmax;
  for (int j = 0; j < n_blocks; ++j) {
    float tile[1][kNTiles][4];
    for (int nt = 0; nt < kNTiles; ++nt)
      for (int e = 0; e < 4; ++e) {
        const int row = lane / 4 + 8 * (e / 2);
        const int col = j * 8 * kNTiles + nt * 8 + (lane % 4) * 2 + e % 2;
        tile[0][nt][e] = s[row * cols + col];
      }
    float rescale[2];
    softmax.update_max(tile, scale_log2, rescale);
    softmax.exp_accumulate(tile, scale_log2, rescale);
  }
  float inv_sum[2], lse[2];
  softmax.finalize(scale_log2, inv_sum, lse);
  if (lane % 4 == 0)
    for (int r = 0; r < 2; ++r) {
      inv_sum_out[lane / 4 + 8 * r] = inv_sum[r];
      lse_out[lane / 4 + 8 * r] = lse[r];
    }
}

extern "C" __global__ void online_softmax(const float* s, int n_blocks, float scale_log2,
                                          float* inv_sum_out, float* lse_out) {
  online_softmax_blocks<2>(s, n_blocks, scale_log2, inv_sum_out, lse_out);
}
extern "C" __global__ void online_softmax_wide(const float* s, int n_blocks, float scale_log2,
                                               float* inv_sum_out, float* lse_out) {
  online_softmax_blocks<16>(s, n_blocks, scale_log2, inv_sum_out, lse_out);
}

constexpr int kParts = 3;

extern "C" __global__ void merge(const float* lse_parts, int rows, float* weights_out,
                                 float* lse_out) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float lse[kParts], w[kParts];
  for (int i = 0; i < kParts; ++i) lse[i] = lse_parts[row * kParts + i];
  lse_out[row] = merge_weights(lse, w);
  for (int i = 0; i < kParts; ++i) weights_out[row * kParts + i] = w[i];
}
"""

ROWS, BLOCKS, PARTS = 16, 3, 3
LOG2E = 1.0 / math.log(2.0)


def _options() -> list[str]:
    return ["--std=c++17", f"-I{_source.kernel_dir()}", *_source.cuda_include_options()]


def _gpu_kernel(name: str):  # type: ignore[no-untyped-def]
    import cupy

    return cupy.RawModule(code=SOURCE, options=tuple(_options())).get_function(name)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_verb_kernels_compile(arch):
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(SOURCE, "softmax_verbs.cu", [], [])
    try:
        nvrtc.compileProgram(program, [*_options(), _kernels.arch_option(arch)])
    finally:
        nvrtc.destroyProgram(program)


def _scores(block: int = 16) -> tuple[np.ndarray, list[str]]:
    """16 rows x BLOCKS blocks of ``block`` keys: each row a case (NaN rows NaN in the reference
    too)."""
    rng = np.random.default_rng(7)
    s = rng.standard_normal((ROWS, BLOCKS * block)).astype(np.float32)
    cases = ["random"] * ROWS
    s[1] = -np.inf
    cases[1] = "no visible key"
    s[2] = -np.inf
    s[2, 2 * block + 5] = 0.5
    cases[2] = "one visible score, in the last block"
    s[3, :block] = -np.inf
    cases[3] = "first block masked"
    s[4] *= 1e4
    cases[4] = "huge range (|s| * scale up to ~4e4)"
    s[5, 20] = np.nan
    cases[5] = "one NaN score"
    s[6] = np.nan
    cases[6] = "all NaN"
    s[7] = 3e9
    s[7, 5] = 3e9 + 512.0
    cases[7] = "huge scores near each other (the exact-exponent path)"
    s[8, ::2] = -np.inf
    cases[8] = "every other key masked"
    return s, cases


def _reference(s: np.ndarray, scale_log2: float) -> tuple[np.ndarray, np.ndarray]:
    """(1 / l, natural-log LSE) with l = sum exp2((s - max) * scale_log2), in float64."""
    s64 = s.astype(np.float64)
    inv_sum, lse = np.empty(ROWS), np.empty(ROWS)
    for r in range(ROWS):
        row = s64[r]
        if np.isnan(row).any():
            inv_sum[r] = lse[r] = np.nan
            continue
        m = row.max()
        if m == -np.inf:
            inv_sum[r], lse[r] = 0.0, -np.inf
            continue
        total = np.exp2((row - m) * scale_log2).sum()
        inv_sum[r] = 1.0 / total
        lse[r] = (m * scale_log2 + np.log2(total)) / LOG2E
    return inv_sum, lse


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "block"), [("online_softmax", 16), ("online_softmax_wide", 128)])
def test_online_softmax_verbs_match_float64(name, block):
    import cupy

    kernel = _gpu_kernel(name)
    s, cases = _scores(block)
    scale_log2 = 0.125 * LOG2E
    inv_sum, lse = cupy.full(ROWS, np.nan, np.float32), cupy.full(ROWS, np.nan, np.float32)
    kernel((1,), (32,), (cupy.asarray(s), np.int32(BLOCKS), np.float32(scale_log2), inv_sum, lse))
    ref_inv, ref_lse = _reference(s, scale_log2)
    got_inv, got_lse = cupy.asnumpy(inv_sum).astype(np.float64), cupy.asnumpy(lse).astype(np.float64)
    for r, case in enumerate(cases):
        for name, got, ref in (("1/l", got_inv[r], ref_inv[r]), ("lse", got_lse[r], ref_lse[r])):
            if np.isnan(ref) or np.isinf(ref):
                assert (np.isnan(got) and np.isnan(ref)) or got == ref, f"row {r} ({case}): {name} {got} vs {ref}"
            else:
                # lse: absolute (it can be ~1e9 at the huge rows, where float32 holds ~60 there);
                # 1 / l: relative (exp2.approx and float32 sums).
                tolerance = 1e-5 * max(1.0, abs(ref)) if name == "lse" else 1e-5 * abs(ref)
                assert abs(got - ref) <= tolerance + 1e-6, f"row {r} ({case}): {name} {got} vs {ref}"


def _merge_cases() -> tuple[np.ndarray, list[str]]:
    lse = np.array(
        [
            [0.5, -1.0, 2.0],
            [-np.inf, -np.inf, -np.inf],
            [-np.inf, 3.0, -np.inf],
            [80.0, -80.0, 0.0],
            [np.nan, 1.0, 2.0],
            [-np.inf, np.nan, -np.inf],
            [1e30, 1e30, -np.inf],
        ],
        dtype=np.float32,
    )
    names = ["random", "all parts empty", "one part", "huge spread", "a NaN part", "NaN beside empties", "huge"]
    return lse, names


@pytest.mark.gpu
def test_merge_weights_match_float64():
    import cupy

    kernel = _gpu_kernel("merge")
    lse, names = _merge_cases()
    rows = lse.shape[0]
    weights, merged = cupy.full((rows, PARTS), np.nan, np.float32), cupy.full(rows, np.nan, np.float32)
    kernel((1,), (32,), (cupy.asarray(lse), np.int32(rows), weights, merged))
    got_w, got_lse = cupy.asnumpy(weights).astype(np.float64), cupy.asnumpy(merged).astype(np.float64)
    for r, name in enumerate(names):
        parts = lse[r].astype(np.float64)
        if np.isnan(parts).any():
            assert np.isnan(got_lse[r]) and np.isnan(got_w[r]).any(), f"{name}: NaN must propagate"
            continue
        if (parts == -np.inf).all():
            assert got_lse[r] == -np.inf and (got_w[r] == 0).all(), f"{name}: empty merge gives 0, -inf"
            continue
        m = parts.max()
        w = np.exp(parts - m)
        ref_lse = m + np.log(w.sum())
        assert abs(got_lse[r] - ref_lse) <= 1e-6 * max(1.0, abs(ref_lse)), f"{name}: lse {got_lse[r]} vs {ref_lse}"
        np.testing.assert_allclose(got_w[r], w / w.sum(), rtol=1e-5, atol=1e-7, err_msg=name)
