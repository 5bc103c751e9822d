// The online softmax: the one place where the running max, the running sum, the rescaling of
// the output accumulator and the merge of partial results are computed. Every kernel (FA1's
// per-step update, FA2, the split-KV partial and combine) uses these verbs; cupyflash/xp_impl.py
// implements the same verbs under the same names.
//
// Log2 domain: a logit x enters as exp2(x * scale_log2 - m * scale_log2), one FFMA and one MUFU.
// The running max m is kept on the raw logits (scale_log2 > 0 keeps the order), so masked
// logits (-inf) give exp2(-inf) = 0 and a row that has seen no key keeps m = -inf.
// Every LSE that leaves a kernel is natural log.
#pragma once

#include "common.cuh"

// Combine the values of the 4 lanes that hold one accumulator row (lanes 4g .. 4g + 3).
CF_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
CF_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The per-row state for the rows one thread holds in m16n8 accumulator tiles: kMTiles tiles of
// 16 rows, two rows each per thread (lane / 4 and lane / 4 + 8) -> kRows = 2 * kMTiles.
// Element e of a tile belongs to row slot 2 * mt + e / 2.
template <int kMTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;
  static constexpr int kMaxChains = 4;  // a row's partial maxima in update_max (8+ key tiles)
  float row_max[kRows];  // running max of raw logits, -inf until a visible key is seen
  float row_sum[kRows];  // running sum of exp2(..): this lane's columns only until finalize()

  CF_DEVICE OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = neg_infinity();
      row_sum[r] = 0.f;
    }
  }

  // The max subtracted in the exponent; 0 for a row with no visible key yet so that
  // exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
  static CF_DEVICE float max_scaled(float m, float scale_log2) {
    return m == neg_infinity() ? 0.f : m * scale_log2;
  }

  // Verb 1 -- update the running max with a tile of logits. Returns in `rescale` the factor
  // exp2((m_old - m_new) * scale_log2) by which the output accumulator and the running sum
  // must be multiplied (0 on the first visible tile, 1 when the max did not move).
  template <int kNTiles>
  CF_DEVICE void update_max(const float (&s)[kMTiles][kNTiles][4], float scale_log2,
                            float (&rescale)[kRows]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        float m = row_max[r];
        if constexpr (kNTiles >= kMaxChains * 2) {
          // kMaxChains partial maxima, then combined: a chain of kNTiles / kMaxChains + 2
          // dependent FMNMX instead of kNTiles + 1 before the row's first exponential can issue
          // (FA4's reduction; the same value in any order: max is exact, and fmaxf drops a NaN
          // whichever operand it is)
          float part[kMaxChains];
#pragma unroll
          for (int c = 0; c < kMaxChains; ++c)
            part[c] = fmaxf(s[mt][c][2 * half], s[mt][c][2 * half + 1]);
#pragma unroll
          for (int nt = kMaxChains; nt < kNTiles; ++nt)
            part[nt % kMaxChains] =
                fmaxf(part[nt % kMaxChains], fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
          static_assert(kMaxChains == 4, "the partial maxima combined as a tree of two levels");
          m = fmaxf(m, fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
        } else {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            m = fmaxf(m, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
          }
        }
        m = quad_max(m);
        // The first visible tile finds row_max = -inf: the accumulators are still 0 and the
        // factor must be 0 too (exp2 of a finite difference could overflow to inf, 0 * inf = NaN).
        rescale[r] = row_max[r] == neg_infinity() ? 0.f : fast_exp2((row_max[r] - m) * scale_log2);
        row_max[r] = m;
      }
    }
  }

  // Verb 2 -- turn the logits into probabilities in place, p = exp2(x * scale_log2 - m), and
  // accumulate them into the rescaled running sum. One FFMA per score: exact but for the
  // rounding of m = max * scale_log2 (half an ulp), < 1.2e-4 in p while |m| < 2^11. Past that
  // (|q.k| ~ 1e9 for float16 inputs of ~2e4 at scale 1) the rounding reaches 2^(e - 24) and
  // overflowed exp2 to inf: a warp holding such a row first subtracts the max from its scores
  // (x - max is exact near the max, and <= 0) and exponentiates with m = 0, decided once per
  // block of scores; the exponent loop is shared (a second copy of it spilled the d = 64
  // decode tile, at 255 registers).
  template <int kNTiles>
  CF_DEVICE void exp_accumulate(float (&s)[kMTiles][kNTiles][4], float scale_log2,
                                const float (&rescale)[kRows]) {
    bool large = false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      large |= !(fabsf(row_max[r]) * scale_log2 < kExactFfmaLimit);  // (-inf: rare, exact too)
    }
    const bool exact = __any_sync(0xffffffffu, large);
    if (exact) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          // -FLT_MAX for a row with no visible score yet: its -inf stay -inf (not -inf + inf).
          const float m_raw = fmaxf(row_max[2 * mt + half], -3.402823466e38f);
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
            for (int e = 2 * half; e < 2 * half + 2; ++e) s[mt][nt][e] -= m_raw;
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mt + half;
        const float m = exact ? 0.f : max_scaled(row_max[r], scale_log2);
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -m));
            sum += s[mt][nt][e];
          }
        }
        row_sum[r] = row_sum[r] * rescale[r] + sum;
      }
    }
  }
  static constexpr float kExactFfmaLimit = 2048.f;  // 2^11: see exp_accumulate

  // Verb 3 -- finish the rows: 1 / l for the output and the natural-log LSE
  // (m * scale + ln l). A row that saw no key gets 1 / l = 0 (output 0) and LSE = -inf. A NaN
  // score leaves the max alone (fmaxf drops NaN) but makes its p, hence l, NaN: l = NaN gives
  // 1 / l = NaN and LSE = NaN, even for a row of NaN only (whose max stayed -inf).
  CF_DEVICE void finalize(float scale_log2, float (&inv_sum)[kRows], float (&lse)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float l = quad_sum(row_sum[r]);
      const bool empty = l == 0.f;  // (a max of -inf gives l = 0, or NaN)
      inv_sum[r] = empty ? 0.f : 1.f / l;
      lse[r] = empty ? neg_infinity() : (row_max[r] * scale_log2 + __log2f(l)) * kLn2;
    }
  }
};

// A learnable sink (gpt-oss; AttnParams::sinks): a logit that joins a row's softmax
// denominator and takes no value. Applied once, where the row's final O and LSE are made:
//   lse' = log(exp(lse) + exp(sink)) = hi + log1p(exp(lo - hi)),   O' = O exp(lse - lse')
// (inv_sum, which scales O, takes the factor). A row that saw no key (lse = -inf) gets O' = 0
// and lse' = sink; a NaN row or a NaN sink makes both NaN; a sink of -inf changes nothing.
CF_DEVICE void add_sink(float sink, float& inv_sum, float& lse) {
  if (is_nan(lse) || is_nan(sink)) {
    inv_sum = lse = quiet_nan();
    return;
  }
  if (sink == neg_infinity()) return;
  const float hi = fmaxf(lse, sink), lo = fminf(lse, sink);
  const float merged = hi + __log2f(1.f + fast_exp2((lo - hi) * kLog2e)) * kLn2;
  inv_sum *= fast_exp2((lse - merged) * kLog2e);
  lse = merged;
}

// The accumulator steps around the verbs, on m16n8 tiles (row slot 2 mt + e / 2 of a thread).
// Zero an accumulator of m16n8 tiles.
template <int kMTiles, int kCols>
CF_DEVICE void zero_fill(float (&acc)[kMTiles][kCols][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int c = 0; c < kCols; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][c][e] = 0.f;
}

// Multiply each accumulator row by its factor (row slot 2 mt + e / 2).
template <int kMTiles, int kCols>
CF_DEVICE void scale_rows(float (&acc)[kMTiles][kCols][4], const float (&factor)[2 * kMTiles]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int c = 0; c < kCols; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][c][e] *= factor[2 * mt + e / 2];
}

// scale_rows by the online softmax's rescale factors, skipped when no row's max moved: once the
// row maxima settle most blocks leave every factor at exactly 1, and the warp-uniform branch
// saves the d / 4 multiplies per row (results bitwise unchanged).
template <int kMTiles, int kCols>
CF_DEVICE void rescale_rows_if_moved(float (&acc)[kMTiles][kCols][4],
                                     const float (&rescale)[2 * kMTiles]) {
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) moved |= rescale[r] != 1.f;
  if (__any_sync(0xffffffffu, moved)) scale_rows(acc, rescale);
}

// P of 8-key tiles 2 ks and 2 ks + 1 of one 16-row tile as the A operand of k-step ks of P V:
// the m16n8 accumulator layout (rows g / g + 8, keys 2t.. / 2t + 8..) is, element for element,
// m16n8k16's (and wgmma's register) A layout, so P never leaves registers.
template <typename Ops, int kNTiles>
CF_DEVICE void p_operand(uint32_t (&a)[4], const float (&p)[kNTiles][4], int ks) {
  a[0] = Ops::pack2(p[2 * ks][0], p[2 * ks][1]);
  a[1] = Ops::pack2(p[2 * ks][2], p[2 * ks][3]);
  a[2] = Ops::pack2(p[2 * ks + 1][0], p[2 * ks + 1][1]);
  a[3] = Ops::pack2(p[2 * ks + 1][2], p[2 * ks + 1][3]);
}

// Verb 4 -- merge partial results (O_i, lse_i), each O_i normalised over its own keys:
//   lse = log(sum_i exp(lse_i)),   O = sum_i exp(lse_i - lse) * O_i.
// With lse_max = max_i lse_i, part i weighs merge_scale(lse_i, lse_max) = exp(lse_i - lse_max)
// before normalisation by the sum of the weights, and merged_lse(lse_max, sum) is the result's
// LSE. If every part is empty (all lse_i = -inf) the weights are 0 and the LSE stays -inf. A
// part whose LSE is NaN (its scores held a NaN) weighs NaN, whatever lse_max is (fmaxf drops
// the NaN from it): the sum, hence the merged O and LSE, are NaN, as with one pass.
CF_DEVICE float merge_scale(float lse, float lse_max) {
  if (is_nan(lse)) return lse;
  return lse_max == neg_infinity() ? 0.f : fast_exp2((lse - lse_max) * kLog2e);
}
CF_DEVICE float merged_lse(float lse_max, float weight_sum) {
  return weight_sum > 0.f || is_nan(weight_sum) ? lse_max + __logf(weight_sum) : neg_infinity();
}
// 1 / sum of the weights: 0 when every part is empty, NaN when one is NaN.
CF_DEVICE float merge_inv_sum(float weight_sum) {
  return weight_sum > 0.f || is_nan(weight_sum) ? 1.f / weight_sum : 0.f;
}

// The merge of a compile-time number of parts: w_i = exp(lse_i - lse), returns lse.
template <int kParts>
CF_DEVICE float merge_weights(const float (&lse)[kParts], float (&w)[kParts]) {
  float m = neg_infinity();
#pragma unroll
  for (int i = 0; i < kParts; ++i) m = fmaxf(m, lse[i]);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kParts; ++i) {
    w[i] = merge_scale(lse[i], m);
    sum += w[i];
  }
  const float inv = merge_inv_sum(sum);
#pragma unroll
  for (int i = 0; i < kParts; ++i) w[i] *= inv;
  return merged_lse(m, sum);
}

// One warp merges one output row from num_parts states: part p is O_p = g_o[p * o_part_stride
// + :d], LSE_p = g_lse[p * lse_part_stride]. The row gets sum_p w_p O_p / sum_p w_p with
// w_p = exp(LSE_p - max LSE), and g_out_lse (when not nullptr) the merged LSE; the parts are
// kHeadDim wide, the output row its first kValidDim columns. Lane l holds columns l, l + 32, ...
// The parts' LSEs are read 32 at a time, one per lane, and their weights
// broadcast by shuffles; the O reads of consecutive parts do not depend on each other, so the
// unrolled loop keeps several in flight. Loads go through L2 only (ld.global.cg): in the fused
// combine the parts were just written by other CTAs, whose data no L1 of this SM may hold.
// ``sink`` (natural log; -inf: none) joins as one more part whose O is 0 (add_sink's meaning).
template <int kHeadDim, int kValidDim = kHeadDim, typename PartElement, typename OutElement>
CF_DEVICE void merge_row(const PartElement* g_o, int64_t o_part_stride, const float* g_lse,
                         int64_t lse_part_stride, int num_parts, OutElement* g_out,
                         float* g_out_lse, int lane, float sink = neg_infinity()) {
  static_assert(kHeadDim % 32 == 0, "head_dim must be a multiple of 32");
  constexpr int kColsPerLane = kHeadDim / 32;
  // The largest LSE over the parts (-inf when every part is empty).
  float lse_max = neg_infinity();
  for (int part = lane; part < num_parts; part += 32) {
    lse_max = fmaxf(lse_max, __ldcg(g_lse + part * lse_part_stride));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
  }
  lse_max = fmaxf(lse_max, sink);  // (a NaN sink drops out, and its weight makes the sum NaN)

  float acc[kColsPerLane] = {};
  float weight_sum = 0.f;
  for (int part0 = 0; part0 < num_parts; part0 += 32) {
    const int mine = part0 + lane;
    const float my_weight =
        mine < num_parts ? merge_scale(__ldcg(g_lse + mine * lse_part_stride), lse_max) : 0.f;
    weight_sum += my_weight;
    const int count = min(32, num_parts - part0);
    // No branch in the body: the loads of 8 parts are issued together (a skip of empty parts
    // made every part wait for the previous one's L2 round trip: ~12 us for 32 parts).
#pragma unroll 8
    for (int j = 0; j < count; ++j) {
      const float w = __shfl_sync(0xffffffffu, my_weight, j);
      const PartElement* o_part = g_o + (part0 + j) * o_part_stride;
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) {
        const float x = to_float(__ldcg(o_part + lane + 32 * c));
        acc[c] += w == 0.f ? 0.f : w * x;  // an empty part weighs 0 even if its O is NaN
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    weight_sum += __shfl_xor_sync(0xffffffffu, weight_sum, offset);
  }
  weight_sum += merge_scale(sink, lse_max);  // the sink's weight (0 for none)
  const float inv = merge_inv_sum(weight_sum);
#pragma unroll
  for (int c = 0; c < kColsPerLane; ++c) {
    if (kValidDim == kHeadDim || lane + 32 * c < kValidDim) {  // the caller's columns only
      g_out[lane + 32 * c] = from_float<OutElement>(acc[c] * inv);
    }
  }
  if (g_out_lse != nullptr && lane == 0) *g_out_lse = merged_lse(lse_max, weight_sum);
}

// Verbs 1-2 in scalar form, for a kernel that walks one row a score at a time (the naive
// baseline's softmax over a materialised S): the running max and sum of one row's logits, and
// the merge of two such states (threads of a block that each walked part of the row).
struct RowMaxSum {
  float row_max;  // raw logits, -inf until a visible score is seen
  float row_sum;  // sum of exp2(logit * scale_log2 - row_max * scale_log2)

  CF_DEVICE RowMaxSum() : row_max(neg_infinity()), row_sum(0.f) {}

  CF_DEVICE void absorb(float logit, float scale_log2) {
    if (logit == neg_infinity()) return;  // a hidden key adds nothing (and would give NaN)
    const float m = fmaxf(row_max, logit);
    const float rescale = row_max == neg_infinity() ? 0.f : fast_exp2((row_max - m) * scale_log2);
    row_sum = row_sum * rescale + fast_exp2((logit - m) * scale_log2);
    row_max = m;
  }

  CF_DEVICE void merge(const RowMaxSum& other, float scale_log2) {
    const float m = fmaxf(row_max, other.row_max);
    if (m == neg_infinity()) {  // both saw no visible score: their sums are 0, or NaN
      row_sum += other.row_sum;
      return;
    }
    const float w_self = row_max == neg_infinity() ? 0.f : fast_exp2((row_max - m) * scale_log2);
    const float w_other =
        other.row_max == neg_infinity() ? 0.f : fast_exp2((other.row_max - m) * scale_log2);
    row_sum = row_sum * w_self + other.row_sum * w_other;
    row_max = m;
  }
};
