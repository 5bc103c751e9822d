// The Hopper forward's collective epilogue: a consumer's 64 rows of a finished tile normalised
// (1 / l), staged through shared memory (rows no other consumer touches), then written as
// 16-byte coalesced stores, with the natural-log LSE, as FlashAttention-3's CollectiveEpilogueFwd.
#pragma once

#include "common.cuh"
#include "fa3_shared.cuh"
#include "hopper.cuh"
#include "params.cuh"
#include "softmax.cuh"

// Where a finished tile's rows of O and LSE go.
struct Fa3TileOut {
  int row_block0, batch, head;
  SeqRange q;
  bool has_keys;  // it visited a key block (else acc_o holds no value of it)
  bool bad;       // its sequence's device-side values are bad (TileRows): NaN rows, not zeros
  // FP8 inputs: the tile's softmax factor (with q_descale k_descale) and V's descale, which
  // multiplies 1 / l (the epilogue of a tile runs under the next tile's first Q K^T).
  float scale_log2, v_descale;
};

template <typename Traits>
struct Fa3Epilogue {
  using Element = typename Traits::Element;

  const AttnParams& params;
  uint32_t s_o;             // O's staging tile: its own buffer, or Q buffer 0
  int consumer, tid, lane;  // this thread's consumer warpgroup, and its index and lane in it
  int consumer_row0;        // first row of the consumer in the tile
  int warp_row0;            // first row of the warp in the tile

  CF_DEVICE void store(const Fa3TileOut& out, const float (&acc_o)[1][Traits::kDTiles][4],
                       typename Traits::Softmax& softmax, float scale_log2) const {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kHeadDim = Traits::kHeadDim;
    float inv_sum[2], lse[2];
    softmax.finalize(scale_log2, inv_sum, lse);
    if (params.sinks != nullptr) {  // (a tile without keys: lse -inf, so the sink's own)
      const float sink = params.sinks[out.head];
      add_sink(sink, inv_sum[0], lse[0]);
      add_sink(sink, inv_sum[1], lse[1]);
    }
    if constexpr (Traits::Fp8) {
      inv_sum[0] *= out.v_descale;
      inv_sum[1] *= out.v_descale;
    }
    // A tile without keys writes zeros (NaN for a bad sequence, which visits none). Chosen, not
    // multiplied: acc_o may hold anything (even NaN) there, and zeroing it would redefine wgmma
    // accumulators while the next tile's first Q K^T is in flight, which makes ptxas serialise
    // every wgmma of the kernel.
    if (out.bad) lse[0] = lse[1] = quiet_nan();
    const float no_keys = out.bad ? quiet_nan() : 0.f;
    auto normalised = [&](int dt, int e) {
      return out.has_keys ? acc_o[0][dt][e] * inv_sum[e / 2] : no_keys;
    };
#pragma unroll
    for (int dt = 0; dt < Traits::kDTiles; ++dt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + lane / 4 + 8 * half;
        const int col = 8 * dt + 2 * (lane % 4);
        st_shared_b32(s_o + swizzled_offset<kBlockM>(row, col),
                      Traits::Ops::pack2(normalised(dt, 2 * half), normalised(dt, 2 * half + 1)));
      }
    }
    named_barrier_sync(NamedBarrier::kWarpgroup, consumer);

    Element* g_o = static_cast<Element*>(params.o_ptr) + out.batch * params.o_batch_stride +
                   static_cast<int64_t>(out.q.start) * params.o_row_stride +
                   out.head * params.o_head_stride;
    constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
    for (int idx = tid; idx < Traits::kRowsPerConsumer * kChunksPerRow; idx += kWarpgroupThreads) {
      const int row = consumer_row0 + idx / kChunksPerRow;
      const int col = (idx % kChunksPerRow) * 8;
      if (out.row_block0 + row < out.q.len) {
        st_global_chunk<typename Traits::Columns>(
            g_o + static_cast<int64_t>(out.row_block0 + row) * params.o_row_stride, col / 8,
            ld_shared_b128(s_o + swizzled_offset<kBlockM>(row, col)));
      }
    }
    if (params.lse_ptr != nullptr && lane % 4 == 0) {
      float* g_lse = params.lse_ptr + out.batch * params.lse_batch_stride +
                     out.head * params.lse_head_stride + out.q.start;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = out.row_block0 + warp_row0 + lane / 4 + 8 * half;
        if (row < out.q.len) g_lse[row] = lse[half];
      }
    }
    // Every warp has read its staged rows before any warp writes the next tile's (and, with
    // O staged in the Q tile, before the producer refills it).
    named_barrier_sync(NamedBarrier::kWarpgroup, consumer);
  }
};
