// The Hopper forward's collective mainloop, producer side (FlashAttention-3's
// CollectiveMainloopFwd::load): the TMA loads of one tile, Q and then K_j and V_j of every visited
// key block into the kStages-deep mbarrier ring. The consumer side (the software-pipelined
// wgmma / softmax loop) stays in fa3_fwd.cu as lambdas over the kernel's locals: moved into a
// struct's methods it compiled to different SASS (docs/evidence.md, cubin-identity.txt).
#pragma once

#include "common.cuh"
#include "fa3_shared.cuh"
#include "hopper.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "tile_scheduler.cuh"
#include "variants.cuh"  // block_mask_key_blocks

template <typename Traits>
using TileMask = KeyMask<Traits::kBlockM, Traits::kBlockN, Traits::Is_causal, Traits::Is_local>;

// ---------------------------------------------------------------------------------------------
// Producer: one thread issues every TMA load.
// ---------------------------------------------------------------------------------------------
template <typename Traits>
struct Fa3Producer {
  using Rows = TileRows<Traits::Varlen>;
  // (No static constexpr members in these structs: each would become a symbol of the cubin.)

  const Fa3Params& p;
  const Fa3Smem<Traits>& smem;

  // The loads of tile `tile` (already announced in buffer qb's tile index): Q into Q buffer qb,
  // then its key blocks, last first, into the ring from position kv_iter on.
  CF_DEVICE void load_tile(const typename TileScheduler<Traits>::Tile& tile, int qb,
                           int& kv_iter) const {
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kStages = Traits::kStages;
    const AttnParams& params = p.attn;
    const int head_k = tile.head / params.h_h_k_ratio;
    const Rows rows(params, tile.batch);
    // TMA coordinates: packed sequences are one "batch" of the tensor map, rows offset per sequence.
    const int tma_batch = Traits::Varlen ? 0 : tile.batch;
    const TileMask<Traits> mask(tile.m_block, rows.q.len, rows.k.len, params.window_left,
                                params.window_right);
    int n_begin = mask.n_block_begin();
    int n_end = mask.n_block_end();
    if constexpr (Traits::User_mods)  // a BlockMask's shown keys, as the consumers bound them
      block_mask_key_blocks<kBlockM, kBlockN>(params, tile.batch, tile.head, tile.m_block * kBlockM,
                                              rows.q.len, n_begin, n_end);
    mbar_arrive_expect_tx(smem.q_full(qb), Traits::kQBytes);
    tma_load_rows<Traits::kColBlocks, kBlockM, Traits::kInColBlockElems>(
        smem.q(qb), p.q_map, smem.q_full(qb), rows.q.start + tile.m_block * kBlockM, tile.head,
        tma_batch);
    // Key block n_block of K or V into its slot of the ring (hopper.cuh's RingUse), once the
    // consumers released it. With FP8 inputs V comes transposed (Vt: d rows of keys): one box of
    // 128 keys x d rows.
    auto load_block = [&](const TmaMap& map, uint32_t slot, uint32_t full_bar, uint32_t empty_bar,
                          int parity, int n_block, bool transposed) {
      ring_acquire(full_bar, empty_bar, parity, Traits::kKVBytes);
      if (Traits::Fp8 && transposed) {
        tma_load_4d(slot, map, full_bar, n_block * kBlockN, 0, head_k, tma_batch);
        return;
      }
      tma_load_rows<Traits::kColBlocks, kBlockN, Traits::kInColBlockElems>(
          slot, map, full_bar, rows.k.start + n_block * kBlockN, head_k, tma_batch);
    };
    for (int n_block = n_end - 1; n_block >= n_begin; --n_block, ++kv_iter) {
      const RingUse<kStages> use(kv_iter);
      load_block(p.k_map, smem.k(use.stage), smem.ring(KvBarrier::kKFull, use.stage),
                 smem.ring(KvBarrier::kKEmpty, use.stage), use.parity, n_block, false);
      load_block(p.v_map, smem.v(use.stage), smem.ring(KvBarrier::kVFull, use.stage),
                 smem.ring(KvBarrier::kVEmpty, use.stage), use.parity, n_block, true);
    }
  }
};
