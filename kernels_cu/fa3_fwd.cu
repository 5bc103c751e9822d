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
// both consumers; with Pingpong the consumers take turns issuing their wgmmas (two: ping-pong;
// three: round robin), so one's softmax also runs under the others' GEMMs.
//
// The pieces, as FlashAttention-3 composes its kernel: tile_scheduler.cuh (which tiles, in which
// order), fa3_shared.cuh (the shared-memory layout as one struct, the mbarriers and the named
// barriers), fa3_mainloop.cuh (the producer's loads), fa3_epilogue.cuh (normalise, stage and
// store O and LSE); this file holds the traits, the consumer's pipeline and the kernel body.
#pragma once

#include "common.cuh"
#include "fa3_shared.cuh"    // SharedStorage, the mbarriers and named barriers
#include "fa3_epilogue.cuh"  // Fa3Epilogue: normalise, stage, store O and LSE
#include "fa3_mainloop.cuh"  // Fa3Producer (TMA loads), Fa3Consumer (the wgmma / softmax pipeline)
#include "fp8_fwd.cuh"       // the FP8 forward: P as the e4m3 A operand, the key order of Vt
#include "hopper.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "variants.cuh"
#include "wgmma.cuh"

// The element types of a variant: 16-bit inputs and output of one type, or (FP8 forward) Q, K
// and V in e4m3 with an output of type Out, named by E4m3Inputs<Out>.
template <typename Out>
struct E4m3Inputs;
template <typename Element_>
struct Fa3Elements {
  using Input = Element_;
  using Output = Element_;
  static constexpr bool kFp8 = false;
};
template <typename Out>
struct Fa3Elements<E4m3Inputs<Out>> {
  using Input = __nv_fp8_e4m3;
  using Output = Out;
  static constexpr bool kFp8 = true;
};

template <int kHeadDim_, int kBlockN_, int kConsumers_, int kStages_, bool Separate_o_,
          bool Pingpong_, bool Dynamic_, bool Varlen_, typename Element_, bool Is_causal_,
          bool Is_local_, bool Has_softcap_, int kValidDim_ = 0, bool User_mods_ = false,
          bool Has_alibi_ = false, bool Uniform_consumer_ = false>
struct Fa3FwdTraits {
  // Element: O's type (and P's, with 16-bit inputs); Input: Q's, K's and V's in memory.
  using Element = typename Fa3Elements<Element_>::Output;
  using Input = typename Fa3Elements<Element_>::Input;
  using Ops = ElementTraits<Element>;
  // FP8 inputs (FlashAttention-3's FP8 forward): Q K^T and P V on e4m3 wgmma (k-steps of 32
  // elements), P cast to e4m3 in registers, V read transposed (Vt [d][keys], written by
  // fp8_vt.cu, keys permuted inside every 32 so that P's accumulator is the A operand as it
  // stands), and the descale factors in the softmax's scale and in 1 / l.
  static constexpr bool Fp8 = Fa3Elements<Element_>::kFp8;
  static constexpr int kInBytes = static_cast<int>(sizeof(Input));
  static constexpr int kInColBlockElems = kSwizzleRowBytes / kInBytes;  // one 128-byte row
  static constexpr int kQkSteps = kHeadDim_ * kInBytes / 32;  // wgmma k-steps: 32 bytes of a row
  static constexpr int kPvSteps = kBlockN_ * kInBytes / 32;
  // The caller's head dim, if below the tile's: the TMA maps span only its columns (the rest of
  // a box reads as zeros) and the epilogue stores only them.
  using Columns = TileColumns<kHeadDim_, kValidDim_>;

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
  // loaded before this tile's O leaves, so a buffer for each. Three consumers (160 registers)
  // fit it at d = 64 over padded batches without softcap (sm_90a: no spill, no serialised
  // wgmma; packed sequences spilled 20 bytes, softcap with them or with ALiBi 64-92; a user
  // score_mod 40 bytes more than without the overlap); at d = 128 ptxas serialised every wgmma
  // of the kernel to fit the epilogue beside S.
  static constexpr bool Three_consumers_fit =
      kConsumers_ == 3 && kHeadDim_ <= 64 && !Has_softcap_ && !Varlen_ && !User_mods_;
  static constexpr bool Overlap_epilogue = Separate_o && (kConsumers_ == 2 || Three_consumers_fit);
  // The consumers take turns issuing their wgmmas (FlashAttention-3's ping-pong with two; with
  // three, round robin as FlashAttention-3's warp-scheduler barriers do), so one's softmax runs
  // while the others' GEMMs occupy the tensor cores.
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
  // A user score_mod / mask_mod (variants.cuh's UserMods): per score, after Q K^T, as the softcap.
  static constexpr bool User_mods = User_mods_;
  // ALiBi's bias (flash-attn's alibi_slopes; variants.cuh's Alibi), after the softcap if any.
  static constexpr bool Has_alibi = Has_alibi_;
  // The consumer's index broadcast from lane 0 (fa3_shared.cuh's warpgroup_index), so that
  // ptxas sees it uniform across the warp and keeps the wgmma descriptors built from it in
  // uniform registers, as the backward's new order does: 15-91 fewer instructions between a
  // tile's first and last wgmma (bf16 variants; fewer R2UR), no spill. Off until timed
  // (_dispatch.FA3_FWD_UNIFORM_CONSUMER).
  static constexpr bool Uniform_consumer = Uniform_consumer_;
  using Transform = ScoreTransform<Has_softcap, Has_alibi, User_mods_ ? kUserMods : kNoBias>;
  // The score functions' per-row and per-key parts read ahead of the scores (variants.cuh's
  // PartsAhead): where a key's part is a gather, its loads run under the Q K^T wgmma.
  static constexpr bool Parts_ahead = KeysAhead<Transform>::value;
  // Functions that read no captured array by row or key applied past the sequence too, with no
  // branch per score (variants.cuh's PastUnguarded): on three consumers, whose 160 registers
  // the branches overran; the two-consumer tiles' code as it was until timed.
  static constexpr bool Mods_past_unguarded =
      User_mods_ && kConsumers_ == 3 && !ReadsByIndex<Transform>::value;
  // The online softmax of a warp's 16 rows (named here, where the Traits are instantiated: a
  // member of type OnlineSoftmax<1> would instantiate it at its definition, which reorders the
  // symbols of the cubin).
  using Softmax = OnlineSoftmax<1>;

  static constexpr int kRowsPerConsumer = 64;  // wgmma M
  static constexpr int kBlockM = kRowsPerConsumer * kConsumers;
  static constexpr int kNThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kNTiles = kBlockN / 8;   // 8-key column tiles of S (per warp: m16n8)
  static constexpr int kDTiles = kHeadDim / 8;  // 8-wide column tiles of O
  static constexpr int kColBlocks = kHeadDim / kInColBlockElems;

  // Shared memory: kQBuffers Q tiles, [O,] kStages K slots, kStages V slots (all swizzled,
  // 1024-byte aligned), then the mbarriers q_full[kQBuffers], q_empty[..], k_full[kStages],
  // k_empty[..], v_full[..], v_empty[..] and each Q buffer's tile index (8 bytes).
  static constexpr int kQBytes = kBlockM * kHeadDim * kInBytes;
  static constexpr int kOBytes = Separate_o ? kBlockM * kHeadDim * 2 : 0;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kInBytes;
  static constexpr int kBarrierBytes = 8 * (2 * kQBuffers + 4 * kStages) + 8;  // + the tile indices
  using SharedStorage = Fa3SharedStorage<kQBytes, kQBuffers, kOBytes, kKVBytes, kStages>;
  static constexpr int kSmemBytes =
      kSwizzleAtomBytes /* alignment slack */ + static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes == kSwizzleAtomBytes + kQBuffers * kQBytes + kOBytes +
                                  2 * kStages * kKVBytes + kBarrierBytes,
                "SharedStorage is the buffers and barriers above, unpadded");

  // Registers: the producer keeps 24, the consumers share the rest of the 64K register file.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 240 : 160;
  // The softmax of S_j is held above the wait for P_{j-1} V_{j-1} (keep_above_wait), so it runs
  // while that wgmma is in flight, where S, P and O all fit in the registers at once: two
  // consumers up to d = 128, three (160 registers) where Three_consumers_fit (without the hold,
  // ptxas put that tile's 64 exponentials of S_j after the wait); not at d = 256 (O alone takes
  // 128 registers: 720 bytes of spills), where ptxas may serialise them.
  static constexpr bool Softmax_under_pv = kConsumers == 2 ? kHeadDim <= 128 : Three_consumers_fit;

  static_assert(kHeadDim % kColBlockElems == 0, "head dim must be a multiple of 64");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256,
                "key block: a multiple of 16 up to 256 (wgmma N, TMA box)");
  static_assert(sizeof(Element) == 2, "16-bit output");
  static_assert(!Fp8 || (kBlockN == 128 && kHeadDim % 128 == 0 && Separate_o && !Varlen &&
                         !Has_softcap && kValidDim_ == 0),
                "FP8 inputs: 128-key blocks (one 128-byte Vt row), whole 128-byte rows of Q and K, "
                "O in its own buffer; no varlen, softcap or partial head dim yet");
  static_assert(Columns::kWholeChunks, "TMA rows are 16-byte multiples: head dims of 8 k");
  static_assert(!Has_alibi || !(Fp8 || User_mods), "ALiBi: 16-bit inputs, no score_mod");
};

// O += P V for the V tile in `v_slot` (a function template, not a lambda of the kernel: NVRTC
// instantiates both branches of an `if constexpr` inside a lambda). The tile's first P V
// overwrites O (acc_o still holds the previous tile's).
//   16-bit: k-step ks takes keys 16 ks .. 16 ks + 15 (two 8-row atoms of every column block,
//           2048 bytes per step) of V read MN-major; d's column blocks are kBlockN rows apart.
//   FP8:    the Vt tile is K-major ([d][128 keys], one 128-byte row per column of d), and k-step
//           ks takes its 32 keys 32 ks bytes into every row, as Q K^T steps through K.
template <typename Traits>
CF_DEVICE void issue_pv_wgmmas(float (&acc_o)[Traits::kDTiles][4],
                               const uint32_t (&p_prev)[Traits::kPvSteps][4], uint32_t v_slot,
                               bool first) {
  using MmaPV = Wgmma<Traits::kHeadDim, typename Traits::Input>;
  if constexpr (Traits::Fp8) {
    const uint64_t desc_vt0 = wgmma_desc(v_slot, 0);
#pragma unroll
    for (int ks = 0; ks < Traits::kPvSteps; ++ks)
      MmaPV::rs(acc_o, p_prev[ks], wgmma_desc_advance(desc_vt0, ks * 32), ks > 0 || !first);
  } else {
    const uint64_t desc_v0 = wgmma_desc(v_slot, Traits::kBlockN * kSwizzleRowBytes);
#pragma unroll
    for (int ks = 0; ks < Traits::kPvSteps; ++ks) {
      const uint64_t desc_v = wgmma_desc_advance(desc_v0, ks * 2 * kSwizzleAtomBytes);
      MmaPV::rs_bt(acc_o, p_prev[ks], desc_v, ks > 0 || !first);
    }
  }
  wgmma_commit();
}

template <typename Traits>
CF_DEVICE void fa3_fwd(const Fa3Params& p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  const AttnParams& params = p.attn;

  extern __shared__ unsigned char smem_raw[];
  const Fa3Smem<Traits> smem(smem_raw);
  constexpr int kQBuffers = Traits::kQBuffers;
  constexpr int kConsumerWarps = 4 * Traits::kConsumers;

  const TileScheduler<Traits> scheduler(p);
  using Rows = TileRows<Traits::Varlen>;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (threadIdx.x == 0) smem.init_barriers(kConsumerWarps);
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (threadIdx.x != 0) return;
    const Fa3Producer<Traits> producer{p, smem};
    int kv_iter = 0;  // position in the K/V ring, continuing across tiles
    // The next tile: the static stride, or (dynamic) drawn from the counter. Drawn once the
    // current tile's loads are all issued (the producer then runs at most kStages blocks ahead
    // of the consumers): drawn earlier, a CTA would claim it before the CTAs that free up first,
    // and undo the balance of the greedy schedule.
    const int grid = static_cast<int>(gridDim.x);
    auto next_tile = [&](int t) { return scheduler.next(t, grid, p); };
    for (int t = blockIdx.x, tile_iter = 0;; ++tile_iter) {
      while (t < scheduler.num_tiles && scheduler.empty(t, params)) t = next_tile(t);
      const int qb = tile_iter % kQBuffers;
      mbar_wait(smem.q_empty(qb),
                ((tile_iter / kQBuffers) & 1) ^ 1);  // the consumers are done with its last Q
      st_shared_b32(smem.tile(qb), t);
      if (t >= scheduler.num_tiles) {
        mbar_arrive(smem.q_full(qb));  // no Q: the consumers read the end and stop
        break;
      }
      producer.load_tile(scheduler(t, params), qb, kv_iter);
      t = next_tile(t);
    }
    scheduler.finish(grid, p);
    return;
  }

  // ------------------------------------------------------------------ consumers
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int consumer = Traits::Uniform_consumer ? warpgroup_index() - 1 : warpgroup - 1;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int consumer_row0 = consumer * Traits::kRowsPerConsumer;  // in the block
  const int warp_row0 = consumer_row0 + 16 * warp;
  const float scale_log2 = params.softmax_scale_log2;
  using Mma = Wgmma<kBlockN, typename Traits::Input>;

  // Turns: named barrier NamedBarrier::kTurn + c is consumer c's "your turn" signal. A turn is
  // one batch of wgmma issues, handed on to the next consumer (c + 1, the last to 0); the last
  // consumer hands consumer 0 the first. Every consumer visits the same tiles and blocks, so
  // their turns pair up one for one.
  constexpr int kLastConsumer = Traits::kConsumers - 1;
  auto begin_turn = [&]() {
    if constexpr (Traits::Pingpong) named_barrier_sync(NamedBarrier::kTurn, consumer);
  };
  auto end_turn = [&]() {
    if constexpr (Traits::Pingpong)
      named_barrier_arrive(NamedBarrier::kTurn, consumer == kLastConsumer ? 0 : consumer + 1);
  };
  if (Traits::Pingpong && consumer == kLastConsumer)
    named_barrier_arrive(NamedBarrier::kTurn, /*consumer=*/0);

  // The accumulator and softmax state of the tile being computed; with Overlap_epilogue they
  // hold the previous tile's until its epilogue, which runs under this tile's first Q K^T.
  float acc_o[1][Traits::kDTiles][4];  // one 16-row tile per warp, as the softmax steps count
  zero_fill(acc_o);  // once: each tile's first P V overwrites it (no wgmma is in flight here)
  OnlineSoftmax<1> softmax;
  uint32_t p_prev[Traits::kPvSteps][4];  // P of the block before, the A operand of its P V

  // Keeps P's registers untouched until the wgmma reading them has completed.
  auto fence_p = [&]() {
#pragma unroll
    for (int ks = 0; ks < Traits::kPvSteps; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(p_prev[ks][i])::"memory");
  };

  // Where a finished tile's rows of O and LSE go, and how (fa3_epilogue.cuh).
  using TileOut = Fa3TileOut;
  const Fa3Epilogue<Traits> epilogue{params, smem.o(),      consumer, tid,
                                     lane,   consumer_row0, warp_row0};
  auto store_tile = [&](const TileOut& out) {
    epilogue.store(out, acc_o, softmax, Traits::Fp8 ? out.scale_log2 : scale_log2);
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
    if (qk_in_flight)
      wgmma_wait<1>();
    else
      wgmma_wait<0>();
    wgmma_fence_operands(acc_o[0]);
    fence_p();
    if (!pending.active) return;
    if (pending.out.has_keys && lane == 0)
      mbar_arrive(smem.ring(KvBarrier::kVEmpty, pending.v_stage));
    store_tile(pending.out);
    pending.active = false;
  };

  int kv_iter = 0;
  for (int tile_iter = 0;; ++tile_iter) {
    const int qb = tile_iter % kQBuffers;
    mbar_wait(smem.q_full(qb),
              (tile_iter / kQBuffers) & 1);  // this tile's Q has landed (or the end is announced)
    const int t = static_cast<int>(ld_shared_b32(smem.tile(qb)));
    if (t >= scheduler.num_tiles) break;
    const auto tile = scheduler(t, params);
    const int row_block0 = tile.m_block * kBlockM;
    const Rows rows(params, tile.batch);
    const TileMask<Traits> mask(tile.m_block, rows.q.len, rows.k.len, params.window_left,
                                params.window_right);
    int n_end = mask.n_block_end();  // (n_end first: without mods the code is as before it)
    int n_begin = mask.n_block_begin();
    // A BlockMask (a user mask_mod's summary, cupyflash.create_block_mask) narrows the tile's key
    // blocks to those its rows may see, as the producer's loads do: the leading and trailing
    // hidden ones are not visited. Inside that range each consumer classes its 64 rows x the
    // block by the summary (tile_state): plain runs score_mod alone, the others both functions.
    // A hidden block in the middle is still loaded, multiplied and masked: skipping it would
    // need the producer and both consumers to walk one list of blocks through the K/V ring (the
    // FA2 kernel, algorithm="fa2", skips every hidden block).
    if constexpr (Traits::User_mods)
      block_mask_key_blocks<kBlockM, kBlockN>(params, tile.batch, tile.head, row_block0, rows.q.len,
                                              n_begin, n_end);
    const int n_blocks = max(n_end - n_begin, 0);
    // The score variant of this tile's (batch, head): a user function reads them.
    const typename Traits::Transform transform(params, tile.batch, tile.head,
                                               rows.k.len - rows.q.len);
    // A score function's per-row and per-key parts, read ahead of the scores that use them
    // (variants.cuh's PartsAhead): the rows' once here, each block's keys with its class.
    PartsAhead<typename Traits::Transform, Traits::kNTiles, Traits::Parts_ahead> parts;
    if constexpr (Traits::Parts_ahead)
      read_row_parts(transform, parts, row_block0 + warp_row0, lane);
    // FP8: the scores are q_descale k_descale (Q8 K8^T), so the softmax's factor takes both;
    // v_descale scales O with 1 / l in the epilogue.
    float tile_scale_log2 = scale_log2, v_descale = 1.f;
    if constexpr (Traits::Fp8) {
      const int head_k = tile.head / params.h_h_k_ratio;
      const float qk_descale =
          p.q_descale.at(tile.batch, head_k) * p.k_descale.at(tile.batch, head_k);
      v_descale = p.v_descale.at(tile.batch, head_k);
      // A device descale is not read on the host: one that is not positive and finite (0 would
      // give a uniform softmax, a plausible answer) makes the tile's rows NaN instead.
      const bool usable = qk_descale > 0.f && qk_descale <= 3.4028235e38f && v_descale > 0.f &&
                          v_descale <= 3.4028235e38f;
      tile_scale_log2 = usable ? tile_scale_log2 * qk_descale : quiet_nan();
    }

    // S = Q K^T for the K tile in `k_slot`: k-step ks reads 32 bytes of d (16 columns, or 32 of
    // e4m3) into the 128-byte rows of column block ks / 4 (this consumer's Q rows start
    // consumer_row0 rows in).
    auto issue_qk = [&](float (&s)[1][Traits::kNTiles][4], uint32_t k_slot) {
      const uint64_t desc_q0 = wgmma_desc(smem.q(qb) + consumer_row0 * kSwizzleRowBytes, 0);
      const uint64_t desc_k0 = wgmma_desc(k_slot, 0);
#pragma unroll
      for (int ks = 0; ks < Traits::kQkSteps; ++ks) {
        const uint32_t col_bytes = (ks % 4) * 32;
        const uint64_t desc_q =
            wgmma_desc_advance(desc_q0, (ks / 4) * kBlockM * kSwizzleRowBytes + col_bytes);
        const uint64_t desc_k =
            wgmma_desc_advance(desc_k0, (ks / 4) * kBlockN * kSwizzleRowBytes + col_bytes);
        Mma::ss(s[0], desc_q, desc_k, ks > 0);
      }
      wgmma_commit();
    };
    // O += P V for the V tile in `v_slot` (issue_pv_wgmmas above).
    auto issue_pv = [&](uint32_t v_slot, bool first) {
      issue_pv_wgmmas<Traits>(acc_o[0], p_prev, v_slot, first);
    };
    // The block mask's class of this consumer's rows x key block n_block (mixed without one), and
    // the score functions' parts of its keys. Read before the step's waits, so that the loads
    // (from L2 and L1) run under the Q K^T wgmma: read where they are used, they stalled the
    // softmax, the pipeline's critical path, once per block.
    auto tile_state = [&](int n_block) {
      if constexpr (Traits::User_mods) {
        if constexpr (Traits::Parts_ahead)
          read_key_parts(transform, parts, n_block * kBlockN, lane);
        return block_mask_tile_state<Traits::kRowsPerConsumer, kBlockN>(
            params, tile.batch, tile.head, row_block0 + consumer_row0, n_block * kBlockN);
      } else {
        return static_cast<int>(kMaskCellMixed);
      }
    };
    // Softcap, mask, running max and P = exp2(..) of one block of scores.
    auto softmax_step = [&](float (&s)[1][Traits::kNTiles][4], int n_block, int state,
                            float (&rescale)[2]) {
      if constexpr (Traits::User_mods) {  // by the block mask's class of this consumer's rows
        if constexpr (Traits::Parts_ahead)
          user_mods_by_state_ahead(transform, state, s, row_block0 + warp_row0, n_block * kBlockN,
                                   lane, parts);
        else if constexpr (Traits::Mods_past_unguarded)
          user_mods_by_state</*Transposed=*/false>(
              PastUnguarded<typename Traits::Transform>(transform), state, s,
              row_block0 + warp_row0, n_block * kBlockN, lane);
        else
          user_mods_by_state</*Transposed=*/false>(transform, state, s, row_block0 + warp_row0,
                                                   n_block * kBlockN, lane);
      } else {
        transform_scores(transform, s, row_block0 + warp_row0, n_block * kBlockN, lane);
      }
      if (mask.needs_mask(n_block)) mask.apply(s, row_block0 + warp_row0, n_block * kBlockN, lane);
      softmax.update_max(s, tile_scale_log2, rescale);
      softmax.exp_accumulate(s, tile_scale_log2, rescale);
    };
    auto to_operand = [&](const float (&s)[1][Traits::kNTiles][4]) {
#pragma unroll
      for (int ks = 0; ks < Traits::kPvSteps; ++ks) {
        if constexpr (Traits::Fp8)
          p_operand_e4m3(p_prev[ks], s[0], ks);
        else
          p_operand<typename Traits::Ops>(p_prev[ks], s[0], ks);
      }
    };
    // Varlen: a sequence's last key block runs into the next sequence's rows (or the packed
    // tensor's unused tail), which TMA does not zero. Their scores are masked to -inf, so P is 0
    // there, but 0 x Inf or NaN in V would still be NaN: this consumer zeroes those V rows
    // before its P V wgmma (the other consumer may write the same zeros; it reads no other value).
    auto clear_v_tail = [&](uint32_t v_slot, int n_block) {
      if constexpr (!Traits::Varlen) return;
      const int valid = rows.k.len - n_block * kBlockN;
      if (valid >= kBlockN) return;  // the same answer for the whole warpgroup
      zero_tile_rows<Traits::kColBlocks, kBlockN>(v_slot, max(valid, 0), kBlockN, tid,
                                                  kWarpgroupThreads);
      fence_proxy_async_shared();
      named_barrier_sync(NamedBarrier::kWarpgroup, consumer);
    };
    auto slot = [&](int it, int& stage, int& parity) {  // block it's use of the K / V ring
      const RingUse<kStages> use(kv_iter + it);
      stage = use.stage;
      parity = use.parity;
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
      const int state = tile_state(n_end - 1);
      mbar_wait(smem.ring(KvBarrier::kKFull, stage), parity);  // (before the turn, as below)
      begin_turn();
      wgmma_fence();
      issue_qk(s0, smem.k(stage));
      end_turn();
      finish_pending(/*qk_in_flight=*/true);
      softmax = OnlineSoftmax<1>();
      wgmma_wait<0>();
      wgmma_fence_operands(s0[0]);
      if (lane == 0) mbar_arrive(smem.ring(KvBarrier::kKEmpty, stage));
      float rescale[2];
      softmax_step(s0, n_end - 1, state, rescale);
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
      const int state = tile_state(n_end - 1 - it);
      // K_it and V_{it-1} waited for before the turn (FA4's order), so that a turn holds the
      // wgmma issues alone and the next consumer's is not held up by this one's wait for a load
      mbar_wait(smem.ring(KvBarrier::kKFull, stage), parity);
      mbar_wait(smem.ring(KvBarrier::kVFull, prev_stage), prev_parity);
      begin_turn();
      wgmma_fence();
      issue_qk(s, smem.k(stage));
      clear_v_tail(smem.v(prev_stage), n_end - it);
      issue_pv(smem.v(prev_stage), it == 1);
      end_turn();
      wgmma_wait<1>();  // S_it is ready; P_{it-1} V_{it-1} may still run
      wgmma_fence_operands(s[0]);
      if (lane == 0) mbar_arrive(smem.ring(KvBarrier::kKEmpty, stage));
      float rescale[2];
      softmax_step(s, n_end - 1 - it, state, rescale);
      if constexpr (Traits::Softmax_under_pv) keep_above_wait(softmax.row_sum);
      wgmma_wait<0>();
      wgmma_fence_operands(acc_o[0]);
      fence_p();
      if (lane == 0) mbar_arrive(smem.ring(KvBarrier::kVEmpty, prev_stage));
      rescale_rows_if_moved(acc_o, rescale);
      to_operand(s);
    }
    // Every Q K^T of the tile has completed: with O staged elsewhere, Q's buffer is free now.
    __syncwarp();  // every lane has read the tile index before the producer may overwrite it
    if (Traits::Separate_o && lane == 0) mbar_arrive(smem.q_empty(qb));
    int last_stage = 0;
    if (n_blocks > 0) {
      int parity;
      slot(n_blocks - 1, last_stage, parity);
      mbar_wait(smem.ring(KvBarrier::kVFull, last_stage), parity);
      begin_turn();
      clear_v_tail(smem.v(last_stage), n_end - n_blocks);
      wgmma_fence();
      issue_pv(smem.v(last_stage), n_blocks == 1);
      end_turn();
    }
    kv_iter += n_blocks;
    pending = {true,
               last_stage,
               {row_block0, tile.batch, tile.head, rows.q, n_blocks > 0, rows.bad(),
                tile_scale_log2, v_descale}};
    if constexpr (!Traits::Overlap_epilogue) {
      finish_pending(false);
      if (!Traits::Separate_o && lane == 0) mbar_arrive(smem.q_empty(qb));  // O has left the Q tile
    }
  }
  finish_pending(false);
  // The last consumer's last hand-over is still pending on consumer 0's barrier: take it.
  if (Traits::Pingpong && consumer == 0) named_barrier_sync(NamedBarrier::kTurn, /*consumer=*/0);
}
