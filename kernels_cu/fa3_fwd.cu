// Hopper forward (sm_90a): FlashAttention-2's algorithm on Hopper's asynchronous machinery, as
// FlashAttention-3 (Shah et al., 2024) runs it.
//
// Tiles are (query block, batch, head), over padded batches or packed sequences (varlen:
// sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] of the packed tensors, and the tiles
// past the end of a sequence shorter than the longest are skipped). A CTA starts on tile
// blockIdx.x; its producer picks the next one and passes it to the consumers through shared
// memory with the Q load (Q is double-buffered), so the loads of a CTA's next tile overlap the
// end of its current one, and a tile's epilogue runs while the next tile's first Q K^T is on the
// tensor cores (at N = 1024 a tile is only ~15 us of work). Three schedules:
//   static   one CTA per SM, tiles blockIdx.x + k gridDim.x: uniform tiles (no causal / window);
//   dynamic  one CTA per SM, each next tile drawn from a global counter in tile order (each
//            (batch, head)'s longest first): uneven tiles (causal) balance themselves, greedily;
//   per tile one CTA per tile (gridDim.x = tiles), handed out in the same order by the hardware.
// A CTA is 1 + kConsumers warpgroups:
//   producer warpgroup  one thread issues every TMA load (Q per tile, then K_j and V_j per key
//                       block into a kStages-deep ring of mbarrier-guarded slots, the ring
//                       running on across tiles); the warpgroup gives its registers away
//                       (setmaxnreg.dec).
//   consumer warpgroups 64 query rows each, end to end (no cross-warpgroup reduction):
//       S = Q K_j^T            wgmma, Q and K straight from the swizzled TMA tiles
//       mask, online softmax   the same verbs and fragment layout as the mma.sync kernel
//       O += P V_j             wgmma with P from registers and V read transposed (MN-major)
//     software-pipelined so that the softmax of block j runs while O += P_{j-1} V_{j-1} is
//     still on the tensor cores, and releasing each K / V slot to the producer as soon as its
//     wgmma has completed.
// The producer runs up to kStages blocks ahead, so HBM traffic overlaps the tensor-core work of
// both consumers; with Pingpong the two consumers take turns issuing their wgmmas, so one's
// softmax also runs under the other's GEMMs.
#pragma once

#include "common.cuh"
#include "hopper.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

// The kernel argument: three TMA tensor maps (innermost first: d, rows, heads, batch) and the
// AttnParams every kernel takes. Passed as a __grid_constant__ so the maps stay in parameter
// memory, where TMA reads them.
struct Fa3Params {
  TmaMap q_map, k_map, v_map;
  AttnParams attn;
  // The dynamic schedule's counters: [0] tiles drawn past the first gridDim.x, [1] CTAs done.
  // Both read 0 at launch; the last CTA to finish sets them back (cupyflash/_workspace.py).
  int32_t* tile_counters;
  int32_t num_m_blocks;  // query blocks per (batch, head): of the longest sequence when varlen
};

template <int kHeadDim_, int kBlockN_, int kConsumers_, int kStages_, bool Separate_o_, bool Pingpong_,
          bool Dynamic_, bool Varlen_, typename Element_, bool Is_causal_, bool Is_local_, bool Has_softcap_>
struct Fa3FwdTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kStages = kStages_;
  // O is staged for its coalesced store in a buffer of its own (true), or in the Q tile (false:
  // when shared memory is short, d = 256). With its own buffer Q is double-buffered: the
  // producer loads the next tile's Q as soon as it has drawn that tile, ~kStages key blocks
  // before it is needed, where a single Q buffer is refilled only after this tile's last
  // Q K^T and a fresh Q (from HBM: 16-32 KB per SM) may not land before the next tile starts.
  static constexpr bool Separate_o = Separate_o_;
  static constexpr int kQBuffers = Separate_o ? 2 : 1;
  // A tile's epilogue (normalise O, stage and store it) runs while the next tile's first
  // Q K^T is on the tensor cores, instead of between the two: that needs the next tile's Q
  // loaded before this tile's O leaves, so a buffer for each. Not with three consumers: in
  // 160 registers ptxas serialises every wgmma of the kernel to fit the epilogue beside S.
  static constexpr bool Overlap_epilogue = Separate_o && kConsumers_ == 2;
  // The two consumers take turns issuing their wgmmas (FlashAttention-3's ping-pong), so one's
  // softmax runs while the other's GEMMs occupy the tensor cores.
  static constexpr bool Pingpong = Pingpong_;
  // Persistent CTAs draw their next tile from a global counter (else: the static stride).
  static constexpr bool Dynamic = Dynamic_;
  // Packed sequences (cu_seqlens): tiles find their rows per sequence, skip past a shorter
  // sequence's end and clear V rows past it. A padded batch's variant carries none of that code
  // (at N = 1024 a tile is only ~8 key blocks, and its fixed costs show).
  static constexpr bool Varlen = Varlen_;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;

  static constexpr int kRowsPerConsumer = 64;  // wgmma M
  static constexpr int kBlockM = kRowsPerConsumer * kConsumers;
  static constexpr int kNThreads = 128 * (1 + kConsumers);
  static constexpr int kNTiles = kBlockN / 8;   // 8-key column tiles of S (per warp: m16n8)
  static constexpr int kDTiles = kHeadDim / 8;  // 8-wide column tiles of O
  static constexpr int kColBlocks = kHeadDim / kColBlockElems;

  // Shared memory: kQBuffers Q tiles, [O,] kStages K slots, kStages V slots (all swizzled,
  // 1024-byte aligned), then the mbarriers q_full[kQBuffers], q_empty[..], k_full[kStages],
  // k_empty[..], v_full[..], v_empty[..] and each Q buffer's tile index (8 bytes).
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kOBytes = Separate_o ? kQBytes : 0;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kBarrierBytes = 8 * (2 * kQBuffers + 4 * kStages) + 8;
  static constexpr int kSmemBytes = kSwizzleAtomBytes /* alignment slack */ + kQBuffers * kQBytes + kOBytes +
                                    2 * kStages * kKVBytes + kBarrierBytes;

  // Registers: the producer keeps 24, the consumers share the rest of the 64K register file.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  // The softmax of S_j is held above the wait for P_{j-1} V_{j-1} (keep_above_wait), so it runs
  // while that wgmma is in flight, where S, P and O all fit in the registers at once: not with
  // three consumers (160 registers: 272 bytes of spills at d = 64) nor at d = 256 (O alone
  // takes 128: 720), where ptxas may serialise them.
  static constexpr bool Softmax_under_pv = kConsumers == 2 && kHeadDim <= 128;

  static_assert(kHeadDim % kColBlockElems == 0, "head dim must be a multiple of 64");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key block: a multiple of 16 up to 256 (wgmma N, TMA box)");
  static_assert(sizeof(Element) == 2, "16-bit elements");
  static_assert(!Pingpong || kConsumers == 2, "ping-pong alternates two consumers");
};

// Tile t -> (query block, batch, head). Query blocks run fastest, so the CTAs working at one
// time share a (batch, head) and its K/V stays in L2; under causal the last query blocks (the
// most keys) come first, so the long tiles do not straggle at the end.
template <typename Traits>
struct TileScheduler {
  int num_m_blocks;
  int num_tiles;

  CF_DEVICE explicit TileScheduler(const Fa3Params& p)
      : num_m_blocks(p.num_m_blocks), num_tiles(p.num_m_blocks * p.attn.batch * p.attn.h) {}

  struct Tile {
    int m_block, batch, head;
  };

  CF_DEVICE Tile operator()(int t, const AttnParams& params) const {
    const int m = t % num_m_blocks;
    const int bh = t / num_m_blocks;
    return {Traits::Is_causal ? num_m_blocks - 1 - m : m, bh / params.h, bh % params.h};
  }
};

template <typename Traits>
using TileMask = KeyMask<Traits::kBlockM, Traits::kBlockN, Traits::Is_causal, Traits::Is_local>;

// The query and key rows of a tile's sequence: all of them for a padded batch, its slice of the
// packed tensors for varlen.
template <bool Varlen>
struct TileRows {
  SeqRange q, k;
  CF_DEVICE TileRows(const AttnParams& params, int batch)
      : q(Varlen ? seq_range(params.cu_seqlens_q, batch, params.seqlen_q) : SeqRange{0, params.seqlen_q}),
        k(Varlen ? seq_range(params.cu_seqlens_k, batch, params.seqlen_k) : SeqRange{0, params.seqlen_k}) {}
};

template <typename Traits>
CF_DEVICE void fa3_fwd(const Fa3Params& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kHeadDim = Traits::kHeadDim;
  const AttnParams& params = p.attn;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (smem_addr(smem_raw) + kSwizzleAtomBytes - 1) & ~(kSwizzleAtomBytes - 1);
  constexpr int kQBuffers = Traits::kQBuffers;
  // Q buffer b holds the Q of the CTA's tiles b, b + kQBuffers, ...
  auto s_q = [&](int b) { return smem_base + b * Traits::kQBytes; };
  const uint32_t s_o = Traits::Separate_o ? s_q(kQBuffers) : s_q(0);
  const uint32_t s_k = s_q(kQBuffers) + Traits::kOBytes;
  const uint32_t s_v = s_k + kStages * Traits::kKVBytes;
  const uint32_t bars = s_v + kStages * Traits::kKVBytes;
  auto bar_q_full = [&](int b) { return bars + 8 * b; };
  auto bar_q_empty = [&](int b) { return bars + 8 * (kQBuffers + b); };
  auto bar = [&](int kind, int stage) { return bars + 8 * (2 * kQBuffers + kind * kStages + stage); };
  enum { kKFull = 0, kKEmpty = 1, kVFull = 2, kVEmpty = 3 };
  // The tile whose Q the producer loads into buffer b, written before its q_full arrival
  // (release) and read by the consumers after their q_full wait (acquire); a value >= num_tiles
  // ends the CTA.
  auto s_tile = [&](int b) { return bar(kVEmpty, kStages) + 4 * b; };
  constexpr int kConsumerWarps = 4 * Traits::kConsumers;

  const TileScheduler<Traits> scheduler(p);
  using Rows = TileRows<Traits::Varlen>;
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int b = 0; b < kQBuffers; ++b) {
      mbar_init(bar_q_full(b), 1);
      mbar_init(bar_q_empty(b), kConsumerWarps);  // one arrival per consumer warp
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar(kKFull, s), 1);
      mbar_init(bar(kVFull, s), 1);
      mbar_init(bar(kKEmpty, s), kConsumerWarps);
      mbar_init(bar(kVEmpty, s), kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    int kv_iter = 0;  // position in the K/V ring, continuing across tiles
    // The next tile: the static stride, or (dynamic) drawn from the counter. Drawn once the
    // current tile's loads are all issued (the producer then runs at most kStages blocks ahead
    // of the consumers): drawn earlier, a CTA would claim it before the CTAs that free up first,
    // and undo the balance of the greedy schedule.
    const int grid = static_cast<int>(gridDim.x);
    auto next_tile = [&](int t) {
      return Traits::Dynamic ? grid + atomicAdd(p.tile_counters, 1) : t + grid;
    };
    // Varlen: a tile past the end of its sequence holds no rows; the consumers never see it.
    auto empty = [&](int t) {
      if constexpr (!Traits::Varlen) return false;
      const auto tile = scheduler(t, params);
      return tile.m_block * kBlockM >= Rows(params, tile.batch).q.len;
    };
    for (int t = blockIdx.x, tile_iter = 0;; ++tile_iter) {
      while (t < scheduler.num_tiles && empty(t)) t = next_tile(t);
      const int qb = tile_iter % kQBuffers;
      mbar_wait(bar_q_empty(qb), ((tile_iter / kQBuffers) & 1) ^ 1);  // the consumers are done with its last Q
      st_shared_b32(s_tile(qb), t);
      if (t >= scheduler.num_tiles) {
        mbar_arrive(bar_q_full(qb));  // no Q: the consumers read the end and stop
        break;
      }
      const auto tile = scheduler(t, params);
      const int head_k = tile.head / params.h_h_k_ratio;
      const Rows rows(params, tile.batch);
      // TMA coordinates: packed sequences are one "batch" of the tensor map, rows offset per sequence.
      const int tma_batch = Traits::Varlen ? 0 : tile.batch;
      const TileMask<Traits> mask(tile.m_block, rows.q.len, rows.k.len, params.window_left,
                                  params.window_right);
      const int n_begin = mask.n_block_begin();
      const int n_end = mask.n_block_end();
      mbar_arrive_expect_tx(bar_q_full(qb), Traits::kQBytes);
#pragma unroll
      for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
        tma_load_4d(s_q(qb) + cb * kBlockM * kSwizzleRowBytes, p.q_map, bar_q_full(qb), cb * kColBlockElems,
                    rows.q.start + tile.m_block * kBlockM, tile.head, tma_batch);
      }
      // Key block n_block of K or V into its slot of the ring, once the consumers released it.
      auto load_block = [&](const TmaMap& map, uint32_t slot, uint32_t full_bar, uint32_t empty_bar,
                            int parity, int n_block) {
        mbar_wait(empty_bar, parity);
        mbar_arrive_expect_tx(full_bar, Traits::kKVBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_4d(slot + cb * kBlockN * kSwizzleRowBytes, map, full_bar, cb * kColBlockElems,
                      rows.k.start + n_block * kBlockN, head_k, tma_batch);
        }
      };
      for (int n_block = n_end - 1; n_block >= n_begin; --n_block, ++kv_iter) {
        const int stage = kv_iter % kStages;
        const int parity = ((kv_iter / kStages) & 1) ^ 1;  // the slot's previous use was released
        load_block(p.k_map, s_k + stage * Traits::kKVBytes, bar(kKFull, stage), bar(kKEmpty, stage),
                   parity, n_block);
        load_block(p.v_map, s_v + stage * Traits::kKVBytes, bar(kVFull, stage), bar(kVEmpty, stage),
                   parity, n_block);
      }
      t = next_tile(t);
    }
    if constexpr (Traits::Dynamic) {
      // This CTA draws no more tiles. The last CTA to get here knows every draw has been made
      // (each CTA fences its draws before counting itself done) and resets both counters.
      __threadfence();
      if (atomicAdd(p.tile_counters + 1, 1) == grid - 1) {
        __threadfence();  // the other CTAs' draws (fenced before their count) come before the reset
        p.tile_counters[0] = 0;
        p.tile_counters[1] = 0;
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int consumer_row0 = consumer * Traits::kRowsPerConsumer;  // in the block
  const int warp_row0 = consumer_row0 + 16 * warp;
  const float scale_log2 = params.softmax_scale_log2;
  using Mma = Wgmma<kBlockN, Element>;
  using MmaPV = Wgmma<kHeadDim, Element>;

  // Ping-pong turns: named barrier kTurn + c is consumer c's "your turn" signal (ids 1, 2 are
  // the epilogues'). A turn is one batch of wgmma issues; consumer 1 hands consumer 0 the first.
  // Both consumers visit the same tiles and blocks, so their turns pair up one for one.
  constexpr int kTurn = 3;
  auto begin_turn = [&]() {
    if constexpr (Traits::Pingpong) named_barrier_sync(kTurn + consumer, 256);
  };
  auto end_turn = [&]() {
    if constexpr (Traits::Pingpong) named_barrier_arrive(kTurn + 1 - consumer, 256);
  };
  if (Traits::Pingpong && consumer == 1) named_barrier_arrive(kTurn, 256);

  // The accumulator and softmax state of the tile being computed; with Overlap_epilogue they
  // hold the previous tile's until its epilogue, which runs under this tile's first Q K^T.
  float acc_o[1][Traits::kDTiles][4];  // one 16-row tile per warp, as the softmax steps count
  zero_fill(acc_o);  // once: each tile's first P V overwrites it (no wgmma is in flight here)
  OnlineSoftmax<1> softmax;
  uint32_t p_prev[kBlockN / 16][4];  // P of the block before, the A operand of its P V

  // Keeps P's registers untouched until the wgmma reading them has completed.
  auto fence_p = [&]() {
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(p_prev[ks][i])::"memory");
  };

  // Where a finished tile's rows of O and LSE go.
  struct TileOut {
    int row_block0, batch, head;
    SeqRange q;
    bool has_keys;  // it visited a key block (else acc_o holds no value of it)
  };
  // Epilogue: normalise, stage this consumer's 64 rows of O (rows no other consumer touches),
  // then 16-byte coalesced stores.
  auto store_tile = [&](const TileOut& out) {
    float inv_sum[2], lse[2];
    softmax.finalize(scale_log2, inv_sum, lse);
    // A tile without keys writes zeros. Chosen, not multiplied: acc_o may hold anything (even
    // NaN) there, and zeroing it would redefine wgmma accumulators while the next tile's first
    // Q K^T is in flight, which makes ptxas serialise every wgmma of the kernel.
    auto normalised = [&](int dt, int e) { return out.has_keys ? acc_o[0][dt][e] * inv_sum[e / 2] : 0.f; };
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
    named_barrier_sync(1 + consumer, 128);

    Element* g_o = static_cast<Element*>(params.o_ptr) + out.batch * params.o_batch_stride +
                   static_cast<int64_t>(out.q.start) * params.o_row_stride + out.head * params.o_head_stride;
    constexpr int kChunksPerRow = kHeadDim / 8;
#pragma unroll
    for (int idx = tid; idx < Traits::kRowsPerConsumer * kChunksPerRow; idx += 128) {
      const int row = consumer_row0 + idx / kChunksPerRow;
      const int col = (idx % kChunksPerRow) * 8;
      if (out.row_block0 + row < out.q.len) {
        st_global_b128(g_o + static_cast<int64_t>(out.row_block0 + row) * params.o_row_stride + col,
                       ld_shared_b128(s_o + swizzled_offset<kBlockM>(row, col)));
      }
    }
    if (params.lse_ptr != nullptr && lane % 4 == 0) {
      float* g_lse = params.lse_ptr + out.batch * params.lse_batch_stride + out.head * params.lse_head_stride +
                     out.q.start;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = out.row_block0 + warp_row0 + lane / 4 + 8 * half;
        if (row < out.q.len) g_lse[row] = lse[half];
      }
    }
    // Every warp has read its staged rows before any warp writes the next tile's (and, with
    // O staged in the Q tile, before the producer refills it).
    named_barrier_sync(1 + consumer, 128);
  };

  // A tile whose last P V has been issued but whose epilogue has not run (Overlap_epilogue).
  struct Pending {
    bool active = false;
    int v_stage = 0;  // with out.has_keys: its last P V is in flight, reading this V slot
    TileOut out{};
  } pending;
  // Completes the pending tile, if any: waits for its last P V (the wgmma group before the next
  // tile's first Q K^T when one was issued), releases that V slot and stores the tile.
  auto finish_pending = [&](bool qk_in_flight) {
    // Waited for on every path, with or without a P V in flight: ptxas checks the wgmma
    // pipeline per control-flow path, not per feasible one, and serialises every wgmma of the
    // kernel if some path could reuse acc_o's registers while a P V might still write them.
    if (qk_in_flight) wgmma_wait<1>();
    else wgmma_wait<0>();
    wgmma_fence_operands(acc_o[0]);
    fence_p();
    if (!pending.active) return;
    if (pending.out.has_keys && lane == 0) mbar_arrive(bar(kVEmpty, pending.v_stage));
    store_tile(pending.out);
    pending.active = false;
  };

  int kv_iter = 0;
  for (int tile_iter = 0;; ++tile_iter) {
    const int qb = tile_iter % kQBuffers;
    mbar_wait(bar_q_full(qb), (tile_iter / kQBuffers) & 1);  // this tile's Q has landed (or the end is announced)
    const int t = static_cast<int>(ld_shared_b32(s_tile(qb)));
    if (t >= scheduler.num_tiles) break;
    const auto tile = scheduler(t, params);
    const int row_block0 = tile.m_block * kBlockM;
    const Rows rows(params, tile.batch);
    const TileMask<Traits> mask(tile.m_block, rows.q.len, rows.k.len, params.window_left,
                                params.window_right);
    const int n_end = mask.n_block_end();
    const int n_blocks = max(n_end - mask.n_block_begin(), 0);

    // S = Q K^T for the K tile in `k_slot`: k-step ks reads 16 columns of d, 32 bytes into the
    // 128-byte rows of column block ks / 4 (this consumer's Q rows start consumer_row0 rows in).
    auto issue_qk = [&](float (&s)[1][Traits::kNTiles][4], uint32_t k_slot) {
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        const uint32_t col_bytes = (ks % 4) * 32;
        const uint64_t desc_q = wgmma_desc(
            s_q(qb) + (ks / 4) * kBlockM * kSwizzleRowBytes + consumer_row0 * kSwizzleRowBytes + col_bytes, 0);
        const uint64_t desc_k = wgmma_desc(k_slot + (ks / 4) * kBlockN * kSwizzleRowBytes + col_bytes, 0);
        Mma::ss(s[0], desc_q, desc_k, ks > 0);
      }
      wgmma_commit();
    };
    // O += P V for the V tile in `v_slot`: k-step ks takes keys 16 ks .. 16 ks + 15 (two 8-row
    // atoms of every column block, 2048 bytes per step); d's column blocks are kBlockN rows apart.
    // The tile's first P V overwrites O (acc_o still holds the previous tile's).
    auto issue_pv = [&](uint32_t v_slot, bool first) {
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        const uint64_t desc_v = wgmma_desc(v_slot + ks * 2 * kSwizzleAtomBytes, kBlockN * kSwizzleRowBytes);
        MmaPV::rs_bt(acc_o[0], p_prev[ks], desc_v, ks > 0 || !first);
      }
      wgmma_commit();
    };
    // Softcap, mask, running max and P = exp2(..) of one block of scores.
    auto softmax_step = [&](float (&s)[1][Traits::kNTiles][4], int n_block, float (&rescale)[2]) {
      if constexpr (Traits::Has_softcap) apply_softcap(s, params.softcap_prescale);
      if (mask.needs_mask(n_block)) mask.apply(s, row_block0 + warp_row0, n_block * kBlockN, lane);
      softmax.update_max(s, scale_log2, rescale);
      softmax.exp_accumulate(s, scale_log2, rescale);
    };
    auto to_operand = [&](const float (&s)[1][Traits::kNTiles][4]) {
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) p_operand<typename Traits::Ops>(p_prev[ks], s[0], ks);
    };
    // Varlen: a sequence's last key block runs into the next sequence's rows (or the packed
    // tensor's unused tail), which TMA does not zero. Their scores are masked to -inf, so P is 0
    // there, but 0 x Inf or NaN in V would still be NaN: this consumer zeroes those V rows
    // before its P V wgmma (the other consumer may write the same zeros; it reads no other value).
    auto clear_v_tail = [&](uint32_t v_slot, int n_block) {
      if constexpr (!Traits::Varlen) return;
      const int valid = rows.k.len - n_block * kBlockN;
      if (valid >= kBlockN) return;  // the same answer for the whole warpgroup
      constexpr int kChunksPerRow = kSwizzleRowBytes / 16;  // a key row of one column block
      const int first = max(valid, 0);
      const int chunks = (kBlockN - first) * Traits::kColBlocks * kChunksPerRow;
      for (int i = tid; i < chunks; i += 128) {
        const int row = first + i / (Traits::kColBlocks * kChunksPerRow);
        const int cb = (i / kChunksPerRow) % Traits::kColBlocks;
        // The swizzle permutes 16-byte chunks within a row: zeroing every chunk of the row
        // needs no swizzle arithmetic.
        const int chunk = i % kChunksPerRow;
        st_shared_zero_b128(v_slot + (cb * kBlockN + row) * kSwizzleRowBytes + chunk * 16);
      }
      fence_proxy_async_shared();
      named_barrier_sync(1 + consumer, 128);
    };
    auto slot = [&](int it, int& stage, int& parity) {
      stage = (kv_iter + it) % kStages;
      parity = ((kv_iter + it) / kStages) & 1;
    };

    // Software pipeline (FlashAttention-3's intra-warpgroup overlap): step `it` issues
    // S_it = Q K_it^T and O += P_{it-1} V_{it-1} back to back, then computes the softmax of S_it
    // while the P V wgmma still runs; O is rescaled once that wgmma has completed. The visited
    // blocks are n_end - 1 - it (last first: the masked blocks come first under causal). Across
    // tiles (Overlap_epilogue) the pipeline runs on: this tile's S_0 = Q K_0^T is issued while
    // the previous tile's last P V still runs, and that tile's epilogue runs under it.
    if (n_blocks > 0) {
      float s0[1][Traits::kNTiles][4];
      int stage, parity;
      slot(0, stage, parity);
      begin_turn();
      mbar_wait(bar(kKFull, stage), parity);
      wgmma_fence();
      issue_qk(s0, s_k + stage * Traits::kKVBytes);
      end_turn();
      finish_pending(/*qk_in_flight=*/true);
      softmax = OnlineSoftmax<1>();
      wgmma_wait<0>();
      wgmma_fence_operands(s0[0]);
      if (lane == 0) mbar_arrive(bar(kKEmpty, stage));
      float rescale[2];
      softmax_step(s0, n_end - 1, rescale);
      to_operand(s0);
    } else {
      finish_pending(/*qk_in_flight=*/false);
      softmax = OnlineSoftmax<1>();
    }
    for (int it = 1; it < n_blocks; ++it) {
      int stage, parity, prev_stage, prev_parity;
      slot(it, stage, parity);
      slot(it - 1, prev_stage, prev_parity);
      float s[1][Traits::kNTiles][4];
      begin_turn();
      mbar_wait(bar(kKFull, stage), parity);
      wgmma_fence();
      issue_qk(s, s_k + stage * Traits::kKVBytes);
      mbar_wait(bar(kVFull, prev_stage), prev_parity);
      clear_v_tail(s_v + prev_stage * Traits::kKVBytes, n_end - it);
      issue_pv(s_v + prev_stage * Traits::kKVBytes, it == 1);
      end_turn();
      wgmma_wait<1>();  // S_it is ready; P_{it-1} V_{it-1} may still run
      wgmma_fence_operands(s[0]);
      if (lane == 0) mbar_arrive(bar(kKEmpty, stage));
      float rescale[2];
      softmax_step(s, n_end - 1 - it, rescale);
      if constexpr (Traits::Softmax_under_pv) keep_above_wait(softmax.row_sum);
      wgmma_wait<0>();
      wgmma_fence_operands(acc_o[0]);
      fence_p();
      if (lane == 0) mbar_arrive(bar(kVEmpty, prev_stage));
      rescale_rows_if_moved(acc_o, rescale);
      to_operand(s);
    }
    // Every Q K^T of the tile has completed: with O staged elsewhere, Q's buffer is free now.
    __syncwarp();  // every lane has read the tile index before the producer may overwrite it
    if (Traits::Separate_o && lane == 0) mbar_arrive(bar_q_empty(qb));
    int last_stage = 0;
    if (n_blocks > 0) {
      int parity;
      slot(n_blocks - 1, last_stage, parity);
      begin_turn();
      mbar_wait(bar(kVFull, last_stage), parity);
      clear_v_tail(s_v + last_stage * Traits::kKVBytes, n_end - n_blocks);
      wgmma_fence();
      issue_pv(s_v + last_stage * Traits::kKVBytes, n_blocks == 1);
      end_turn();
    }
    kv_iter += n_blocks;
    pending = {true, last_stage, {row_block0, tile.batch, tile.head, rows.q, n_blocks > 0}};
    if constexpr (!Traits::Overlap_epilogue) {
      finish_pending(false);
      if (!Traits::Separate_o && lane == 0) mbar_arrive(bar_q_empty(qb));  // O has left the Q tile
    }
  }
  finish_pending(false);
  // Consumer 1's last hand-over is still pending on consumer 0's barrier: take it.
  if (Traits::Pingpong && consumer == 0) named_barrier_sync(kTurn, 256);
}
