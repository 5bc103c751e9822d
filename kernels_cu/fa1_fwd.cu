// FlashAttention-1 forward (Dao et al., 2022, Algorithm 1) on mma.sync tensor cores, with the
// paper's loop order and HBM traffic kept on purpose: it exists to be measured beside FA2.
//
// Grid (Hq, B): one CTA per (batch, head), as V1 was. Shared memory holds one K/V tile of
// kBlockC rows (B_c) and one Q tile of kBlockR rows (B_r):
//
//   for each K/V tile j (outer):                 K_j, V_j: HBM -> shared memory, once
//     for each Q tile i that sees a key of j (inner):
//       Q_i: HBM -> shared;  O_i (fp32), m_i, l_i: HBM -> registers (not on i's first tile)
//       S = Q_i K_j^T, online softmax, O_i = diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + P V_j)
//       O_i, m_i, l_i: registers -> HBM          (on i's last tile: O in the input type + LSE)
//
// So Q and the running (O, m, l) cross HBM once per (i, j) pair: T_c = ceil(Nk / B_c) times
// per query row, the N^2 d^2 / M term of the paper's Theorem 2. The running O is float32 in
// a scratch buffer, as FA1's own implementation kept it (16-bit rounding at every one of T_c
// steps would compound). The state is stored normalised, as the paper writes it.
//
// Inside one (i, j) step the kBlockC keys are consumed kBlockN at a time (the register tile of
// S per warp is 16 x kBlockN), with the same online-softmax verbs as FA2; that changes no HBM
// traffic. Each warp owns 16 query rows of the Q tile. At d = 512 the O accumulator of 16 rows
// (256 floats a thread) does not fit in registers: the step runs twice, each pass owning half
// of O's columns and recomputing S (twice the Q K^T FLOPs, the same HBM traffic).
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tile_mma.cuh"  // load_tile_async, gemm_qk, gemm_pv
#include "variants.cuh"

template <int kHeadDim_, int kBlockR_, int kBlockC_, int kBlockN_, typename Element_,
          bool Is_causal_, bool Is_local_, bool Has_softcap_>
struct Fa1FwdTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Tile = SwizzledTile<kHeadDim_>;
  using Columns = TileColumns<kHeadDim_, 0>;  // every column is the caller's

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockR = kBlockR_;  // B_r: query rows per Q tile
  static constexpr int kBlockC = kBlockC_;  // B_c: keys per K/V tile
  static constexpr int kBlockN = kBlockN_;  // keys per register tile of S
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  using Transform = ScoreTransform<Has_softcap>;
  static constexpr bool Q_in_regs = false;

  static constexpr int kNWarps = kBlockR / 16;  // 16 query rows per warp
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kOutDim = kHeadDim < 256 ? kHeadDim : 256;  // O columns per pass
  static constexpr int kOutPasses = kHeadDim / kOutDim;

  // The names gemm_qk / gemm_pv / load_tile_async read (tile_mma.cuh).
  static constexpr int kMTiles = 1;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kOutDim / 8;
  static constexpr int kDSteps = kHeadDim / 16;
  static constexpr int kNSteps = kBlockN / 16;
  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
  static constexpr int kSmemBytes = (2 * kBlockC + kBlockR) * kHeadDim * kElemBytes;

  static_assert(kBlockR % 16 == 0 && kBlockN % 16 == 0 && kBlockC % kBlockN == 0, "MMA tiles");
  static_assert(kHeadDim % kOutDim == 0, "O passes");
};

// The running state of one warp's 16 rows between (i, j) steps, in HBM: O normalised [Nq][d]
// float32, m (raw-logit max) and l (full row sum) [Nq] float32, for one (batch, head).
struct Fa1State {
  float* o;
  float* row_max;
  float* row_sum;
};

template <typename Traits>
CF_DEVICE void fa1_fwd(const AttnParams& params, float* o_state, float* max_state,
                       float* sum_state) {
  using Element = typename Traits::Element;
  constexpr int kBlockR = Traits::kBlockR;
  constexpr int kBlockC = Traits::kBlockC;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kEB = Traits::kElemBytes;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t s_k = smem_addr(smem_raw);             // [kBlockC][d]
  const uint32_t s_v = s_k + kBlockC * kHeadDim * kEB;  // [kBlockC][d]
  const uint32_t s_q = s_v + kBlockC * kHeadDim * kEB;  // [kBlockR][d]

  const int head = blockIdx.x;
  const int batch = blockIdx.y;
  const int head_k = head / params.h_h_k_ratio;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row0 = (tid / 32) * 16;
  const int seqlen_q = params.seqlen_q;
  const int seqlen_k = params.seqlen_k;
  const float scale_log2 = params.softmax_scale_log2;
  const int num_q_tiles = ceil_div(seqlen_q, kBlockR);

  const Element* g_q = static_cast<const Element*>(params.q_ptr) + batch * params.q_batch_stride +
                       head * params.q_head_stride;
  const Element* g_k = static_cast<const Element*>(params.k_ptr) + batch * params.k_batch_stride +
                       head_k * params.k_head_stride;
  const Element* g_v = static_cast<const Element*>(params.v_ptr) + batch * params.v_batch_stride +
                       head_k * params.v_head_stride;
  Element* g_o = static_cast<Element*>(params.o_ptr) + batch * params.o_batch_stride +
                 head * params.o_head_stride;
  const int64_t state_row0 = (static_cast<int64_t>(batch) * params.h + head) * seqlen_q;
  const Fa1State state{o_state + state_row0 * kHeadDim, max_state + state_row0,
                       sum_state + state_row0};

  const typename Traits::Transform transform(params);
  using TileMask = KeyMask<kBlockR, kBlockC, Traits::Is_causal, Traits::Is_local>;
  using ChunkMask = KeyMask<kBlockR, kBlockN, Traits::Is_causal, Traits::Is_local>;
  auto tile_mask = [&](int q_tile) {
    return TileMask(q_tile, seqlen_q, seqlen_k, params.window_left, params.window_right);
  };

  // Rows this thread holds: slot r = half (0, 1) -> row lane / 4 + 8 * half of the warp's 16.
  auto thread_row = [&](int q_tile, int half) {
    return q_tile * kBlockR + warp_row0 + lane / 4 + 8 * half;
  };

  auto write_output = [&](int q_tile, const float (&acc)[1][kDTiles][4], const float (&inv)[2],
                          int col0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = thread_row(q_tile, half);
      if (row >= seqlen_q) continue;
      Element* dst = g_o + row * params.o_row_stride + col0 + 2 * (lane % 4);
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(dst + 8 * dt) = Traits::Ops::pack2(
            acc[0][dt][2 * half] * inv[half], acc[0][dt][2 * half + 1] * inv[half]);
      }
    }
  };
  auto write_lse = [&](int q_tile, const float (&lse)[2]) {
    if (params.lse_ptr == nullptr || lane % 4 != 0) return;
    float* g_lse = params.lse_ptr + batch * params.lse_batch_stride + head * params.lse_head_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = thread_row(q_tile, half);
      if (row < seqlen_q) g_lse[row] = lse[half];
    }
  };

  // Query tiles that see no key at all (causal with Nq > Nk, windows, Nk = 0): O = 0, LSE = -inf.
  for (int i = 0; i < num_q_tiles; ++i) {
    const TileMask mask = tile_mask(i);
    if (mask.n_block_begin() < mask.n_block_end()) continue;
    const float zero[1][kDTiles][4] = {};
    const float no_weight[2] = {0.f, 0.f};
    const float no_lse[2] = {neg_infinity(), neg_infinity()};
#pragma unroll
    for (int pass = 0; pass < Traits::kOutPasses; ++pass) {
      write_output(i, zero, no_weight, pass * Traits::kOutDim);
    }
    write_lse(i, no_lse);
  }

  // K/V tiles some query tile sees: [first visible of tile 0, end of the last tile) -- the
  // visible ranges move monotonically with the query row.
  const int j_begin = tile_mask(0).n_block_begin();
  const int j_end = tile_mask(num_q_tiles - 1).n_block_end();

  for (int j = j_begin; j < j_end; ++j) {
    const int key0 = j * kBlockC;
    cp_async_wait<0>();  // (a tile no query tile used is still landing)
    __syncthreads();     // every warp is done with the previous K/V tile
    load_tile_async<Traits, kBlockC>(s_k, g_k + key0 * params.k_row_stride, params.k_row_stride,
                                     seqlen_k - key0, tid);
    load_tile_async<Traits, kBlockC>(s_v, g_v + key0 * params.v_row_stride, params.v_row_stride,
                                     seqlen_k - key0, tid);
    cp_async_commit();

    for (int i = 0; i < num_q_tiles; ++i) {
      const TileMask mask = tile_mask(i);
      if (j < mask.n_block_begin() || j >= mask.n_block_end()) continue;
      const bool first = j == mask.n_block_begin();
      const bool last = j == mask.n_block_end() - 1;
      const int row0 = i * kBlockR;

      __syncthreads();  // every warp is done with the previous Q tile
      load_tile_async<Traits, kBlockR>(s_q, g_q + row0 * params.q_row_stride, params.q_row_stride,
                                       seqlen_q - row0, tid);
      cp_async_commit();

      // m_i and l_i from HBM (rows past the end and a tile's first step start empty). The
      // running sum lives in one lane of each quad until finalize() adds the quad's lanes.
      float saved_max[2], saved_sum[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = thread_row(i, half);
        const bool stored = !first && row < seqlen_q;
        saved_max[half] = stored ? state.row_max[row] : neg_infinity();
        saved_sum[half] = stored ? state.row_sum[row] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();

      // Chunks of kBlockN keys of tile j that some row of Q tile i sees.
      const ChunkMask chunk_mask(i, seqlen_q, seqlen_k, params.window_left, params.window_right);
      const int n_begin = max(chunk_mask.n_block_begin(), key0 / kBlockN);
      const int n_end = min(chunk_mask.n_block_end(), (key0 + kBlockC) / kBlockN);

#pragma unroll 1
      for (int pass = 0; pass < Traits::kOutPasses; ++pass) {
        const int col0 = pass * Traits::kOutDim;
        OnlineSoftmax<1> softmax;
        float acc_o[1][kDTiles][4];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          softmax.row_max[half] = saved_max[half];
          softmax.row_sum[half] = lane % 4 == 0 ? saved_sum[half] : 0.f;
        }
        // O_i from HBM, un-normalised: diag(l_i) O_i.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = thread_row(i, half);
          const bool stored = !first && row < seqlen_q;
          const float* src = state.o + static_cast<int64_t>(row) * kHeadDim + col0 + 2 * (lane % 4);
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            const float2 o =
                stored ? *reinterpret_cast<const float2*>(src + 8 * dt) : make_float2(0.f, 0.f);
            acc_o[0][dt][2 * half] = o.x * saved_sum[half];
            acc_o[0][dt][2 * half + 1] = o.y * saved_sum[half];
          }
        }

#pragma unroll 1
        for (int n = n_begin; n < n_end; ++n) {
          const uint32_t chunk_bytes = (n * kBlockN - key0) * kHeadDim * kEB;
          float acc_s[1][Traits::kNTiles][4];
          const uint32_t r_q_unused[1][Traits::kDSteps][4] = {};
          gemm_qk<Traits>(acc_s, r_q_unused, s_q, s_k + chunk_bytes, warp_row0, lane);
          transform_scores(transform, acc_s, row0 + warp_row0, n * kBlockN, lane);
          if (chunk_mask.needs_mask(n))
            chunk_mask.apply(acc_s, row0 + warp_row0, n * kBlockN, lane);
          float rescale[2];
          softmax.update_max(acc_s, scale_log2, rescale);
          scale_rows(acc_o, rescale);
          softmax.exp_accumulate(acc_s, scale_log2, rescale);
          gemm_pv<Traits>(acc_o, acc_s, s_v + chunk_bytes + col0 * kEB, lane);
        }

        // diag(l_new)^-1: the normalised O of the rows seen so far.
        float inv_sum[2], lse[2];
        softmax.finalize(scale_log2, inv_sum, lse);
        if (last) {
          write_output(i, acc_o, inv_sum, col0);
          if (pass == Traits::kOutPasses - 1) write_lse(i, lse);
        } else {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = thread_row(i, half);
            if (row >= seqlen_q) continue;
            float* dst = state.o + static_cast<int64_t>(row) * kHeadDim + col0 + 2 * (lane % 4);
#pragma unroll
            for (int dt = 0; dt < kDTiles; ++dt) {
              *reinterpret_cast<float2*>(dst + 8 * dt) =
                  make_float2(acc_o[0][dt][2 * half] * inv_sum[half],
                              acc_o[0][dt][2 * half + 1] * inv_sum[half]);
            }
          }
          if (pass == Traits::kOutPasses - 1) {
            // m_i, l_i back to HBM; the quad's lanes hold one row: its first lane writes.
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int row = thread_row(i, half);
              const float l = quad_sum(softmax.row_sum[half]);
              if (row < seqlen_q && lane % 4 == 0) {
                state.row_max[row] = softmax.row_max[half];
                state.row_sum[row] = l;
              }
            }
          }
        }
      }
    }
  }
}
