// Standard attention's middle pass, P = softmax(S), as the baseline runs it: the score matrix
// S = scale * Q K^T [B, Hq, Nq, Nk] has been written to HBM by a cuBLAS GEMM in the input's
// 16-bit type (cupyflash/_naive_gpu.py); this kernel reads it, writes the probabilities
// P [B, Hq, Nq, Nk] to HBM in the same type and the LSE, and a second GEMM reads P back for
// O = P V. That is the textbook 3-pass flow whose N^2 HBM traffic FlashAttention removes.
//
// One CTA per row of S. Pass 1 walks the row's visible keys keeping a running (max, sum) per
// thread (RowMaxSum, softmax.cuh) and merges the threads' states; pass 2 reads the row again
// and writes every P entry (hidden keys get 0). A row of Nk 16-bit scores is 2 Nk bytes, so
// up to Nk ~ 10^5 the second read comes from L2 (50 MB on the H200), not from HBM.
//
// The scale was applied by the GEMM (its alpha); the kernel sees logits s or, with softcap,
// tanh(s * softcap_prescale), and exponentiates in the log2 domain with softmax_scale_log2
// (log2 e, or softcap * log2 e), exactly as the flash kernels do.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "variants.cuh"

template <int kNThreads_, typename Element_, bool Is_causal_, bool Is_local_, bool Has_softcap_>
struct NaiveSoftmaxTraits {
  using Element = Element_;
  static constexpr int kNThreads = kNThreads_;
  static constexpr int kNWarps = kNThreads / 32;
  static constexpr int kVec = 8;  // 16-byte loads and stores: 8 scores
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  using Transform = ScoreTransform<Has_softcap>;
  static constexpr int kSmemBytes = 0;  // dynamic shared memory (the warps' states are static)
  static_assert(kNThreads % 32 == 0, "whole warps");
};

template <typename Traits>
CF_DEVICE void naive_softmax(const AttnParams& params, const typename Traits::Element* s,
                             typename Traits::Element* p) {
  using Element = typename Traits::Element;
  constexpr int kVec = Traits::kVec;
  const int seqlen_q = params.seqlen_q;
  const int seqlen_k = params.seqlen_k;
  const int64_t row_id = blockIdx.x;  // (batch * h + head) * seqlen_q + row
  const int row = static_cast<int>(row_id % seqlen_q);
  const int64_t batch_head = row_id / seqlen_q;
  const int head = static_cast<int>(batch_head % params.h);
  const int batch = static_cast<int>(batch_head / params.h);
  const Element* g_s = s + row_id * seqlen_k;  // [Nk]
  Element* g_p = p + row_id * seqlen_k;        // [Nk]

  // Visible keys of this row: [key_begin, key_end), element-wise mask only near the bounds.
  const KeyMask</*kBlockM=*/1, /*kBlockN=*/1, Traits::Is_causal, Traits::Is_local> mask(
      row, seqlen_q, seqlen_k, params.window_left, params.window_right);
  const int key_begin = mask.n_block_begin();
  const int key_end = max(mask.n_block_end(), key_begin);
  const float scale_log2 = params.softmax_scale_log2;

  const typename Traits::Transform transform(params);
  auto logit = [&](Element x, int key) {
    const float v = transform(to_float(x), row, key);
    return mask.visible(row, key) ? v : neg_infinity();
  };

  // 16-byte vectors need 16-byte aligned rows: Nk % 8 == 0 (S comes from cupy.empty, aligned).
  const bool vectorized = seqlen_k % kVec == 0;

  // -- pass 1: running max and sum of the row
  RowMaxSum state;
  if (vectorized) {
    for (int v = key_begin / kVec + threadIdx.x; v * kVec < key_end; v += Traits::kNThreads) {
      const uint4 raw = *reinterpret_cast<const uint4*>(g_s + v * kVec);
      const Element* x = reinterpret_cast<const Element*>(&raw);
      float l[kVec];
      float local_max = neg_infinity();
      bool nan = false;  // fmaxf drops NaN: a NaN score poisons the row's sum instead
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        l[e] = logit(x[e], v * kVec + e);
        local_max = fmaxf(local_max, l[e]);
        nan |= is_nan(l[e]);
      }
      if (nan) state.row_sum = quiet_nan();
      if (local_max == neg_infinity()) continue;
      RowMaxSum part;  // the 8 scores as one state, merged once
      part.row_max = local_max;
#pragma unroll
      for (int e = 0; e < kVec; ++e) part.row_sum += fast_exp2((l[e] - local_max) * scale_log2);
      state.merge(part, scale_log2);
    }
  } else {
    for (int key = key_begin + threadIdx.x; key < key_end; key += Traits::kNThreads) {
      state.absorb(logit(g_s[key], key), scale_log2);
    }
  }

  // Merge the threads' states: within each warp, then across warps through shared memory.
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    RowMaxSum other;
    other.row_max = __shfl_xor_sync(0xffffffffu, state.row_max, offset);
    other.row_sum = __shfl_xor_sync(0xffffffffu, state.row_sum, offset);
    state.merge(other, scale_log2);
  }
  __shared__ float s_max[Traits::kNWarps], s_sum[Traits::kNWarps];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    s_max[warp] = state.row_max;
    s_sum[warp] = state.row_sum;
  }
  __syncthreads();
  RowMaxSum row_state;
#pragma unroll
  for (int w = 0; w < Traits::kNWarps; ++w) {
    RowMaxSum other;
    other.row_max = s_max[w];
    other.row_sum = s_sum[w];
    row_state.merge(other, scale_log2);
  }
  // Verb 3: 1 / l and the natural-log LSE; a row that sees no key gets P = 0 and LSE = -inf, a
  // row with a NaN score (sum NaN, even where its max stayed -inf) P = NaN and LSE = NaN.
  const bool empty = row_state.row_sum == 0.f;
  const float inv_sum = empty ? 0.f : 1.f / row_state.row_sum;
  const float max_raw = row_state.row_max == neg_infinity() ? 0.f : row_state.row_max;

  // -- pass 2: P = exp2((logit - m) * scale_log2) / l over the whole row (exact near the max,
  // where fma(logit, scale_log2, -m * scale_log2) carries the rounding of m * scale_log2)
  auto prob = [&](Element x, int key) {
    const float l = logit(x, key);
    return from_float<Element>(fast_exp2((l - max_raw) * scale_log2) * inv_sum);
  };
  if (vectorized) {
    for (int v = threadIdx.x; v * kVec < seqlen_k; v += Traits::kNThreads) {
      uint4 out = make_uint4(0, 0, 0, 0);  // hidden keys: exactly 0
      const bool any_visible = v * kVec + kVec > key_begin && v * kVec < key_end;
      if (any_visible && !empty) {
        const uint4 raw = *reinterpret_cast<const uint4*>(g_s + v * kVec);
        const Element* x = reinterpret_cast<const Element*>(&raw);
        Element* y = reinterpret_cast<Element*>(&out);
#pragma unroll
        for (int e = 0; e < kVec; ++e) y[e] = prob(x[e], v * kVec + e);
      }
      *reinterpret_cast<uint4*>(g_p + v * kVec) = out;
    }
  } else {
    for (int key = threadIdx.x; key < seqlen_k; key += Traits::kNThreads) {
      const bool visible = key >= key_begin && key < key_end && !empty;
      g_p[key] = visible ? prob(g_s[key], key) : from_float<Element>(0.f);
    }
  }

  if (params.lse_ptr != nullptr && threadIdx.x == 0) {
    params.lse_ptr[batch * params.lse_batch_stride + head * params.lse_head_stride + row] =
        empty ? neg_infinity()
              : (row_state.row_max * scale_log2 + __log2f(row_state.row_sum)) * kLn2;
  }
}
