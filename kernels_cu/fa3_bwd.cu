// Hopper backward (sm_90a): FlashAttention-2's backward (fa2_bwd.cu's products, and its per-row
// prep and dQ conversion kernels before and after this one) on wgmma, TMA and a producer
// warpgroup, as FlashAttention-3 (Shah et al., 2024) runs its backward.
//
// One CTA per block of 128 keys (grid: key blocks, B, Hkv) of a padded batch, in the order of
// tile_scheduler.cuh's fa3_bwd_tile; its work (Fa3BwdWork: the key block, its sequence and its
// steps) shared by 3 warpgroups, each a function below:
//   producer   (fa3_bwd_load) one thread loads K and V once, then for every step (a query head
//              of the group and a block of query rows, 64 at d = 128 (80 without a causal
//              mask or window) and 128 at d = 64 (Fa3BwdTraits::kBlockM), that sees the keys)
//              Q and dO (TMA tiles) into a two-deep mbarrier ring (the rows' -LSE log2 e and D:
//              each consumer loads its own copy; Rows_by_producer: the producer copies them in
//              with Q and dO).
//   consumers  (fa3_bwd_consume) consumer c owns keys 64 c .. 64 c + 63 of the block (the wgmma
//              M rows); per step
//     S^T = K_c Q^T,  dP^T = V_c dO^T        wgmma ss, every operand straight from its TMA tile
//     P^T = exp2(S^T scale_log2 - LSE log2 e),  dS^T = P^T * (dP^T - D)      in registers
//       (softcap: S^T = tanh(S^T softcap_prescale) first, and dS^T times its 1 - tanh^2)
//     dV_c += P^T dO,  dK_c += dS^T Q        wgmma rs: P^T and dS^T from registers as the A
//                                            operand (the forward's P V), dO and Q read MN-major
//       (P^T formed and dV issued while dP^T is still on the tensor cores: Exp_under_dp)
//     dS^T to shared memory, dQ = dS K       wgmma ss_tt, both operands MN-major
//       (d = 128: consumer c computes d's columns 64 c .. 64 c + 63 over all 128 keys; d = 64:
//        rows 64 c .. 64 c + 63 of the 128 over all 128 keys; 80-row steps: dS stored instead
//        and dQ^T = K^T dS^T, wgmma ss_ta, K read MN-major and dS K-major: Dq_swapped)
//     dQ staged in its fragments' order (dq_tiles.cuh), then added into dQacc in L2 by one
//     bulk reduce-add (no per-element atomics)
//   and at the end (fa3_bwd_store_dk_dv) dK (times dk_scale) and dV, summed over the whole loop
//   in registers, stored through shared memory as whole rows.
//   dQ writer  (fa3_bwd_dq_writer, deterministic or decoupled) warp 1 of the producer warpgroup
//              adds the staged dQ instead of a consumer thread.
// Deterministic (bit-identical dQ run to run): a warp of the producer warpgroup adds the staged
// dQ tiles (two-deep) while the consumers go on, and every tile of dQacc takes its adds from the
// key blocks in one order, the last key block that sees it first: a key block waits for its turn
// (the tile's semaphore counts the adds done), adds, waits for the add to complete, passes the
// turn on. Key blocks run last first (the grid reversed), so a turn is only ever waited for from
// a key block with a lower linear CTA index: no deadlock as long as the GPU starts CTAs in
// increasing index order, which CUDA does not promise but does (FlashAttention-3's deterministic
// backward assumes the same). Under causal masks or windows the block waited for, seeing fewer
// query rows, is two steps ahead (no waiting in the steady state); without them each key block
// lags the one before by one add's round trip, once per wave.
// GQA: the CTA of a KV head loops over its group's query heads, so dK and dV are summed in
// registers, with no per-query-head copy. Rows past seqlen_q: TMA reads zeros for their Q and
// dO, their -LSE reads as -inf and D as 0, so that P^T and dS^T are 0 there.
// Packed sequences (Varlen; grid: the longest sequence's key blocks, B, Hkv): a CTA takes its
// sequence's keys and rows (none: it returns), and zeroes what TMA read past the sequence's end
// in shared memory; the per-row temporaries start at an aligned row per sequence (dq_tiles.cuh).
#pragma once

#include "common.cuh"
#include "dq_tiles.cuh"
#include "fa3_shared.cuh"  // member_offset, kWarpgroupThreads
#include "hopper.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"  // zero_fill
#include "tile_scheduler.cuh"
#include "variants.cuh"  // Softcap
#include "wgmma.cuh"

// Shared memory after the base is aligned up to a 1024-byte swizzle atom: K, V (each [d / 64]
// [128 keys][64], swizzled as TMA writes them), the ring's Q and dO tiles, dS^T ([query rows /
// 64][keys][64], swizzled: the MN-major A operand of dQ; 80-row steps: dS, [keys / 64][query
// rows][64], the K-major B operand of dQ^T), dQ's staging (dq_tiles.cuh), the ring's
// -LSE log2 e and D rows, the mbarriers.
template <int kKVBytes, int kQBytes, int kRowBytes, int kDsBytes, int kDqBytes, int kStages,
          int kDsStages, int kRowCopies>
struct Fa3BwdSharedStorage {
  unsigned char s_k[kKVBytes];
  unsigned char s_v[kKVBytes];
  unsigned char s_q[kStages][kQBytes];
  unsigned char s_do[kStages][kQBytes];
  unsigned char s_ds[kDsStages][kDsBytes];
  unsigned char s_dq[kDqBytes];
  unsigned char s_rows[kRowCopies][kStages][2][kRowBytes];  // [copy][stage]: -LSE log2 e, then D
  uint64_t s_kv_full;                                       // K and V have landed
  uint64_t s_q_full[kStages];                               // the step's Q and dO have landed
  uint64_t s_q_empty[kStages];                              // every consumer warp is done with them
};

template <int kHeadDim_, int kBlockM_, typename Element_, bool Is_causal_, bool Is_local_,
          bool Has_softcap_ = false, bool Deterministic_ = false, bool Has_user_mask_ = false,
          bool Has_alibi_ = false, bool Varlen_ = false, bool Dq_writer_ = Deterministic_,
          bool Decoupled_ = false, bool Late_exp_ = false, bool Dq_first_ = false,
          bool Rows_by_producer_ = false>
struct Fa3BwdTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  static constexpr int kHeadDim = kHeadDim_;
  // Query rows per step (the N of S^T and dP^T), FlashAttention-3's: 64 at d = 128, where S^T and
  // dP^T (32 floats each), dK and dV (64 each) and dQ's 32 fill a consumer's 240 registers; 128
  // at d = 64 (S^T and dP^T 64 each, dK and dV 32 each), so that S^T = K_c Q^T and dP^T = V_c dO^T
  // are m64n128 wgmmas: at m64n64 the two consumers' operand reads alone fill shared memory's
  // 128 bytes a cycle (4 KB per 131 kFLOP, 32 cycles of tensor core), at m64n128 three quarters.
  // 80 at d = 128 without a causal mask or window (Dq_swapped below), as FlashAttention-3's.
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = 128;  // keys per CTA: 64 per consumer (wgmma M)
  static constexpr int kConsumers = 2;
  static constexpr int kKeysPerConsumer = kBlockN / kConsumers;
  static constexpr int kStages = 2;  // Q, dO, -LSE log2 e, D: the ring's depth
  static constexpr int kNThreads = kWarpgroupThreads * (1 + kConsumers);
  static constexpr int kColBlocks = kHeadDim / kColBlockElems;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  static constexpr bool Deterministic = Deterministic_;
  // A user mask_mod (cupyflash/_mods.py's cf_user_mods): -inf where it hides a score, before the
  // exponentials, as the forward's hook; dS^T needs nothing more (d logit / d score is 1).
  static constexpr bool Has_user_mask = Has_user_mask_;
  using UserMask = ScoreTransform<false, false, Has_user_mask_ ? kUserMods : kNoBias, Element_>;
  // With a score_mod (and a mask_mod or not), S^T stays raw until dS^T: each score's logit and
  // the derivative there (cf_user_mods_grad) are computed where P^T and dS^T are, from the raw
  // score, so that no second array of 32-64 floats (the logits beside the raw scores, as the
  // mma.sync backward keeps them) sits beside the accumulators.
  static constexpr bool Has_user_score = UserMask::kHasScoreMod;
  // ALiBi's bias (flash-attn's alibi_slopes), added to each logit where P^T is formed: d logit /
  // d score is 1, so dS^T is formed as without it. (Not after a softcap: its derivative would
  // need the capped score without the bias; softcap with ALiBi runs on the mma.sync backward.)
  static constexpr bool Has_alibi = Has_alibi_;
  static_assert(!Has_alibi || !(Has_softcap || Has_user_mask), "ALiBi alone (no softcap, no mods)");
  // Packed sequences (cu_seqlens): a CTA's keys and its steps' rows are its sequence's, and the
  // rows TMA reads past a sequence's end (the next sequence's) are zeroed in shared memory
  // before use. A padded batch's variant carries none of that. With score functions, the rows
  // past the sequence in its last query block are hidden too (below: the hook sees them).
  static constexpr bool Varlen = Varlen_;
  using Bias = ScoreTransform<false, Has_alibi_, kNoBias, Element_>;  // Alibi, or nothing
  // The consumers meet once a step (FlashAttention-3's backward), not twice: dS^T in two
  // buffers, so that one consumer's next dS^T never lands where the other's dQ still reads, and
  // each consumer hands its part of dQ to the writer warp on its own barriers (staged, free),
  // so that neither waits for the other's staging. Apart by up to a step, one consumer's
  // exponentials may run under the other's GEMMs, where in step the two computed at once and
  // the tensor cores waited. (Not with the fixed order yet.)
  static constexpr bool Decoupled = Decoupled_;
  static_assert(!Decoupled || !Deterministic, "decoupled consumers: the default order only");
  static constexpr int kDsStages = Decoupled ? 2 : 1;
  // dQ's adds issued by a warp of the producer warpgroup from two staging buffers (decoupled:
  // from one, each consumer's part added as it is staged; else by a consumer thread from one,
  // which then waits for nothing but the last add's reads).
  static constexpr bool Dq_writer = Dq_writer_ || Decoupled;
  static_assert(Dq_writer || !Deterministic, "the fixed order waits in the writer warp");
  static constexpr int kDqBuffers = Dq_writer && !Decoupled ? 2 : 1;
  // dQ = dS K, a 64 x 64 part per consumer over all 128 keys: by rows at d = 64 (128 rows, one
  // 64-row dQacc tile each), by d's 64-column parts at d = 128 (64 rows). (A 64-row step at
  // d = 64 would split it by keys: two partial sums of one tile, which 128-row steps replaced.)
  static constexpr bool Dq_split_rows = kHeadDim == kDqPartCols;
  // P^T = exp2(S^T scale_log2 - LSE log2 e) formed in S^T's registers as soon as S^T is complete,
  // while dP^T = V_c dO^T is still on the tensor cores (FlashAttention-3's and FA4's order), not
  // after dP^T with dS^T: a step's exponentials (32 a thread at d = 128, 64 at d = 64; MUFU does
  // 16 a clock per SM, so 512-1024 clocks for the two consumers) otherwise ran with no wgmma of
  // either consumer in flight. Not with softcap or a score_mod whose derivative is not 1 (dS^T
  // needs the raw score beside P^T: 32-64 more registers live through dP^T); an additive bias's
  // is. (Late_exp_: the order before, what the dispatcher picks until the new order's GPU
  // suites have run: _dispatch.FA3_BWD_LATE_EXP.)
  static constexpr bool Exp_under_dp =
      !Has_softcap && (!Has_user_score || UserMask::kGradIsOne) && !Late_exp_;
  // With it, dK += dS^T Q issued after dQ = dS K, so that dQ's staging runs while dK is on the
  // tensor cores (FlashAttention-3's and FA4's order; the A/B of tune.py hopper-bwd's dq_first).
  // At d = 128: at d = 64 (128-row steps) the fragments kept past the barrier made ptxas
  // serialise the wgmmas of 6 of 21 variants.
  static constexpr bool Dq_first = Dq_first_ && Exp_under_dp && kHeadDim == 128;
  // 80-row steps at d = 128 (FlashAttention-3's and FA4's tile where no causal mask or window
  // bounds the rows): S^T and dP^T are m64n80 wgmmas, whose 25% more columns than m64n64 take
  // the same A operand (K_c, V_c) from shared memory, and a step's barriers, -LSE / D loads and
  // dQ reduce serve 25% more work. dQ's 80 rows are no multiple of wgmma's M (64), so each
  // consumer computes its part swapped, dQ^T = K^T dS^T: d's 64 columns of its part on M, the
  // 80 rows on N, K read MN-major and dS stored [rows][keys] (K-major), staged in that
  // accumulator's order (dq_tiles.cuh's kDqTilesSwapped). Without causal masks, windows,
  // softcap, ALiBi, score functions, packed sequences or the fixed order (their 64-row paths).
  // Decoupled too where the producer loads the rows (their one copy makes room for the second
  // dS buffer: 231,720 bytes of the H100's 232,448); each consumer's part of the swapped tile
  // is a contiguous half of it (dq_swapped_fragment_bytes), as the writer adds the parts.
  static constexpr bool Dq_swapped = kBlockM % kDqTileRows != 0;
  static_assert(!Dq_swapped ||
                    (kBlockM == kDqSwappedRows && kHeadDim == 2 * kDqPartCols && !Is_causal &&
                     !Is_local && !Has_softcap && !Deterministic && !Has_user_mask && !Has_alibi &&
                     !Varlen && (!Decoupled || Rows_by_producer_) && (!Dq_writer_ || Decoupled) &&
                     Dq_first),
                "80-row steps: d = 128, a padded batch, no mask, score variant or fixed order; "
                "dK after dQ; decoupled with the producer's rows");

  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kRowBytes = kBlockM * 4;  // one step's -LSE log2 e (or D)
  // A step's -LSE log2 e and D copied whole by the producer into the ring's stage with its Q and
  // dO (one bulk copy each, on the stage's full barrier), one copy for both consumers, as FA4's
  // producer loads them; else each consumer loads its own copy a step ahead (kRowValues loads
  // and stores a thread, ordered by the consumers' barrier): the 80-row step's loop ran 567
  // instructions against FA4's 463 for the same wgmmas and exponentials, these loads among the
  // difference. The rows are read whole, padding too: prep writes a padding row's -inf and 0,
  // and the temporaries' rows are padded to whole steps (a padded batch) or aligned per sequence
  // (packed), so a step's rows start 16-byte aligned and are all its own.
  static constexpr bool Rows_by_producer = Rows_by_producer_;
  static constexpr int kRowCopies = Rows_by_producer ? 1 : kConsumers;
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kDqStepBytes = kBlockM * kHeadDim * 4;     // a step's dQ: one or two tiles
  static constexpr int kDqPartBytes = kDqStepBytes / kConsumers;  // a consumer's (contiguous)
  static constexpr int kDqBytes = kDqBuffers * kDqStepBytes;
  using SharedStorage = Fa3BwdSharedStorage<kKVBytes, kQBytes, kRowBytes, kDsBytes, kDqBytes,
                                            kStages, kDsStages, kRowCopies>;
  // (the bulk copies' 16-byte alignment of s_rows: the members before it are whole 16 bytes)
  static_assert((2 * kKVBytes + 2 * kStages * kQBytes + kDsStages * kDsBytes + kDqBytes) % 16 ==
                        0 &&
                    kRowBytes % 16 == 0,
                "the rows' copies 16-byte aligned");
  static constexpr int kSmemBytes = kSwizzleAtomBytes + static_cast<int>(sizeof(SharedStorage));

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  static_assert(kHeadDim == 64 || kHeadDim == 128, "the head dims of the Hopper backward");
  static_assert(Dq_swapped || kBlockM == (Dq_split_rows ? 2 : 1) * kDqTileRows,
                "a dQ part per consumer");
  static_assert(sizeof(Element) == 2, "16-bit elements");
};

template <typename Traits>
struct Fa3BwdSmem {
  using Storage = typename Traits::SharedStorage;
  uint32_t base;

  CF_DEVICE explicit Fa3BwdSmem(const void* smem_raw) : base(swizzle_aligned_base(smem_raw)) {}

  CF_DEVICE uint32_t k() const { return base + member_offset(&Storage::s_k); }
  CF_DEVICE uint32_t v() const { return base + member_offset(&Storage::s_v); }
  CF_DEVICE uint32_t q(int s) const {
    return base + member_offset(&Storage::s_q) + s * Traits::kQBytes;
  }
  CF_DEVICE uint32_t dout(int s) const {
    return base + member_offset(&Storage::s_do) + s * Traits::kQBytes;
  }
  CF_DEVICE uint32_t ds(int s) const {
    return base + member_offset(&Storage::s_ds) + s * Traits::kDsBytes;
  }
  CF_DEVICE uint32_t dq() const { return base + member_offset(&Storage::s_dq); }
  // Consumer c's copy of a step's -LSE log2 e (then D, kRowBytes on) in ring stage s (the one
  // copy where the producer loads them).
  CF_DEVICE uint32_t rows(int c, int s) const {
    const int copy = Traits::Rows_by_producer ? 0 : c;
    return base + member_offset(&Storage::s_rows) +
           (copy * Traits::kStages + s) * 2 * Traits::kRowBytes;
  }
  CF_DEVICE uint32_t kv_full() const { return base + member_offset(&Storage::s_kv_full); }
  CF_DEVICE uint32_t q_full(int s) const {
    return base + member_offset(&Storage::s_q_full) + 8 * s;
  }
  CF_DEVICE uint32_t q_empty(int s) const {
    return base + member_offset(&Storage::s_q_empty) + 8 * s;
  }

  CF_DEVICE void init_barriers() const {
    mbar_init(kv_full(), 1);
    for (int s = 0; s < Traits::kStages; ++s) {
      mbar_init(q_full(s), 1);
      mbar_init(q_empty(s), kWarpgroupThreads / 32 * Traits::kConsumers);  // one per consumer warp
    }
    mbar_init_fence();
  }
};

// bar.sync ids of the consumers (0 is __syncthreads): both consumers (dS^T and dQ's staging are
// shared at d = 128), or consumer c alone; with the dQ writer warp, per staging buffer b: staged
// (the consumers arrive, the writer waits) and free again (the writer arrives, the consumers wait);
// decoupled, the same per consumer c (its part of the one buffer) between it and the writer.
// A step of a CTA's loop: a query head of the KV head's group and a block of its query rows.
struct BwdStep {
  int head, m_block;
};

enum class BwdBarrier : int { kBoth = 1, kConsumer = 2, kDqStaged = 4, kDqFree = 6 };
CF_DEVICE void bwd_barrier_sync(BwdBarrier id, int consumer) {
  if (id == BwdBarrier::kBoth)
    named_barrier_sync(static_cast<int>(id), 2 * kWarpgroupThreads);
  else
    named_barrier_sync(static_cast<int>(id) + consumer, kWarpgroupThreads);
}
// Barrier `index` (a staging buffer, or decoupled a consumer) of a dQ hand-over.
constexpr int kDqHandoverThreads = 2 * kWarpgroupThreads + 32;  // both consumers and the writer
constexpr int kDqPartHandoverThreads = kWarpgroupThreads + 32;  // one consumer and the writer
CF_DEVICE void dq_handover_sync(BwdBarrier id, int index, int threads = kDqHandoverThreads) {
  named_barrier_sync(static_cast<int>(id) + index, threads);
}
CF_DEVICE void dq_handover_arrive(BwdBarrier id, int index, int threads = kDqHandoverThreads) {
  named_barrier_arrive(static_cast<int>(id) + index, threads);
}

// A CTA's sequence: a padded batch's whole rows, or (Varlen) its packed rows, with its offsets
// clamped into the totals (prep checks them and reports a bad sequence: clamped_seq_rows).
template <bool Varlen>
CF_DEVICE SeqRows bwd_seq_rows(const AttnParams& a, int batch) {
  if constexpr (Varlen) return clamped_seq_rows(a, batch);
  return SeqRows{{0, a.seqlen_q}, {0, a.seqlen_k}, 0};
}

// A CTA's work: its key block and (batch, KV head) (tile_scheduler.cuh's fa3_bwd_tile), its
// sequence, and its steps: query blocks m_begin .. m_end - 1 (those that see its keys) of every
// query head of the KV head's group in turn, followed step by step (a division by the block
// count per step kept its reciprocal's registers live through the consumers' peak and spilled).
template <typename Traits>
struct Fa3BwdWork {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  using Range = QueryRangeOfKeys<kBlockM, kBlockN, Traits::Is_causal, Traits::Is_local>;

  int n_block, batch, head_k, key0;
  // (Where a padded batch reads a.seqlen_q / seqlen_k or batch * row_batch_stride below instead
  // of seq's equal values, it keeps the code the GPU measured: ptxas schedules the copies apart.)
  SeqRows seq;
  Range range;
  int m_begin, m_end, steps;
  BwdStep first_step;

  CF_DEVICE Fa3BwdWork(const AttnParams& a, const Fa3BwdTile& tile)
      : n_block(tile.n_block),
        batch(tile.batch),
        head_k(tile.head_k),
        key0(tile.n_block * kBlockN),
        seq(bwd_seq_rows<Traits::Varlen>(a, tile.batch)),
        range(tile.n_block, seq.q.len, seq.k.len, a.window_left, a.window_right) {
    const int group = a.h_h_k_ratio;
    m_begin = range.m_block_begin();
    m_end = max(range.m_block_end(), m_begin);
    // A mask_mod's BlockMask narrows them to the query blocks that see some key of this block
    // in any head of the group (its row ranges; no change without one). Not in the fixed order,
    // whose turns count every key block of a query block's causal range.
    if constexpr (Traits::Has_user_mask && !Traits::Deterministic) {
      block_mask_row_blocks<kBlockM, kBlockN>(a, batch, head_k * group, group, key0, m_begin,
                                              m_end);
      m_end = max(m_end, m_begin);
    }
    steps = (m_end - m_begin) * group;
    first_step = BwdStep{head_k * group, m_begin};
  }

  // Packed: the grid covers the longest sequence's keys (the same answer for the whole CTA).
  CF_DEVICE bool no_keys() const { return Traits::Varlen && key0 >= seq.k.len; }

  CF_DEVICE BwdStep next(BwdStep at) const {
    return at.m_block + 1 < m_end ? BwdStep{at.head, at.m_block + 1}
                                  : BwdStep{at.head + 1, m_begin};
  }

  // The step's first per-row temporary: -LSE log2 e, D and dQacc's tile (dq_tiles.cuh; packed
  // sequences each from an aligned start).
  CF_DEVICE int64_t step_rows(const BwdParams& p, BwdStep at) const {
    const int64_t seq_temp0 =
        Traits::Varlen ? dq_seq_temp_start(seq.q.start, batch) : batch * p.row_batch_stride;
    return seq_temp0 + at.head * p.row_head_stride + at.m_block * kBlockM;
  }
};

// ---------------------------------------------------------------------- dQ writer
// Warp 1 of the producer warpgroup, with Dq_writer (deterministic, decoupled): adds the staged dQ
// into dQacc by bulk reduce-add while the consumers go on; in the fixed order, each tile's adds
// in turn (the semaphores above).
template <typename Traits>
CF_DEVICE void fa3_bwd_dq_writer(const Fa3BwdSmem<Traits>& smem, const BwdParams& p,
                                 const Fa3BwdWork<Traits>& work) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const AttnParams& a = p.attn;
  const SeqRows& seq = work.seq;
  const int n_block = work.n_block;
  const int steps = work.steps;
  // The last key block whose query range holds block m (ranges move up with the key
  // block, so the blocks that see m are consecutive; the same ranges the CTAs loop over).
  // (Packed: the sequence's key blocks that the grid holds. One with more keys than
  // max_seqlen_k, which prep reports, must not wait for a block never launched.)
  auto last_key_block = [&](int m) {
    const int n_blocks = Traits::Varlen
                             ? min(ceil_div(seq.k.len, kBlockN), static_cast<int>(gridDim.x))
                             : static_cast<int>(gridDim.x);
    if constexpr (!Traits::Is_causal) return n_blocks - 1;
    int lo = n_block, hi = n_blocks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      const QueryRangeOfKeys<kBlockM, kBlockN, true, Traits::Is_local> later(
          mid, Traits::Varlen ? seq.q.len : a.seqlen_q, Traits::Varlen ? seq.k.len : a.seqlen_k,
          a.window_left, a.window_right);
      if (later.m_block_begin() <= m)
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  };
  BwdStep at = work.first_step;
  for (int step = 0; step < steps; ++step, at = work.next(at)) {
    if constexpr (Traits::Decoupled) {
      // each consumer's part as it is staged, consumer 0's first (the order of the adds
      // into a tile is not fixed anyway)
      for (int c = 0; c < Traits::kConsumers; ++c) {
        dq_handover_sync(BwdBarrier::kDqStaged, c, kDqPartHandoverThreads);
        if (threadIdx.x == 32) {
          bulk_reduce_add_f32(
              p.dq_accum + work.step_rows(p, at) * kHeadDim + c * Traits::kDqPartBytes / 4,
              smem.dq() + c * Traits::kDqPartBytes, Traits::kDqPartBytes);
          bulk_commit();
          bulk_wait_read<0>();
        }
        __syncwarp();
        if (step + 1 < steps) dq_handover_arrive(BwdBarrier::kDqFree, c, kDqPartHandoverThreads);
      }
      continue;
    }
    const int buffer = step % Traits::kDqBuffers;
    dq_handover_sync(BwdBarrier::kDqStaged, buffer);
    if (threadIdx.x == 32) {
      float* tile = p.dq_accum + work.step_rows(p, at) * kHeadDim;
      // the step's first tile's (a step's tiles are added together)
      int32_t* semaphore = p.dq_semaphore + work.step_rows(p, at) / kDqTileRows;
      if constexpr (Traits::Deterministic) {
        const int turn = last_key_block(at.m_block) - n_block;
        if constexpr (Traits::Varlen) {
          // Decreasing offsets (prep reports them) can give two sequences one tile, and
          // two blocks one turn: a count past this block's turn, which valid offsets never
          // make, means another took it. Go on rather than wait forever.
          while (ld_acquire_gpu(semaphore) < turn) {
          }
        } else {
          while (ld_acquire_gpu(semaphore) != turn) {
          }
        }
        fence_proxy_async_global();
      }
      bulk_reduce_add_f32(tile, smem.dq() + buffer * Traits::kDqStepBytes, Traits::kDqStepBytes);
      bulk_commit();
      if constexpr (Traits::Deterministic) {
        bulk_wait<0>();  // the add done before the turn passes
        fence_proxy_async_global();
        red_release_gpu_add(semaphore, 1);
      } else {
        bulk_wait_read<0>();
      }
    }
    __syncwarp();
    if (step + Traits::kDqBuffers < steps) dq_handover_arrive(BwdBarrier::kDqFree, buffer);
  }
  if (threadIdx.x == 32) bulk_wait<0>();  // the staging buffers stay until the adds are done
}

// ---------------------------------------------------------------------- producer
// One thread: K and V once, then each step's Q and dO (and with Rows_by_producer its -LSE
// log2 e and D) into the ring.
template <typename Traits>
CF_DEVICE void fa3_bwd_load(const Fa3BwdSmem<Traits>& smem, const Fa3BwdParams& params,
                            const Fa3BwdWork<Traits>& work) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  const SeqRows& seq = work.seq;
  const int batch = work.batch;
  const int key0 = work.key0;
  const int head_k = work.head_k;
  const int steps = work.steps;
  // TMA coordinates: packed sequences are one "batch" of the tensor maps, rows offset per
  // sequence.
  const int tma_batch = Traits::Varlen ? 0 : batch;
  mbar_arrive_expect_tx(smem.kv_full(), 2 * Traits::kKVBytes);
  // K and V, then the steps' Q and dO through the ring (hopper.cuh's RingUse: the forward's K / V
  // protocol); each pair's boxes interleaved by column block
  constexpr int kColBlocks = Traits::kColBlocks;
  tma_load_row_pair<kColBlocks, kBlockN, kColBlockElems>(smem.k(), params.k_map, smem.v(),
                                                         params.v_map, smem.kv_full(),
                                                         seq.k.start + key0, head_k, tma_batch);
  BwdStep at = work.first_step;
  for (int step = 0; step < steps; ++step, at = work.next(at)) {
    const RingUse<kStages> use(step);
    const uint32_t full = smem.q_full(use.stage);
    constexpr int kRowTx = Traits::Rows_by_producer ? 2 * Traits::kRowBytes : 0;
    ring_acquire(full, smem.q_empty(use.stage), use.parity, 2 * Traits::kQBytes + kRowTx);
    const int row0 = seq.q.start + at.m_block * kBlockM;
    tma_load_row_pair<kColBlocks, kBlockM, kColBlockElems>(smem.q(use.stage), params.q_map,
                                                           smem.dout(use.stage), params.do_map,
                                                           full, row0, at.head, tma_batch);
    if constexpr (Traits::Rows_by_producer) {
      const BwdParams& p = params.bwd;
      const int64_t rows = work.step_rows(p, at);
      const uint32_t dst = smem.rows(0, use.stage);
      bulk_load(dst, p.neg_lse_log2 + rows, Traits::kRowBytes, full);
      bulk_load(dst + Traits::kRowBytes, p.dsum + rows, Traits::kRowBytes, full);
    }
  }
}

// ---------------------------------------------------------------------- epilogue
// dK * dk_scale and dV into the K and V tiles (once both consumers' last dQ has read K), this
// consumer's 64 key rows, then to global memory as 16-byte chunks of whole rows.
template <typename Traits>
CF_DEVICE void fa3_bwd_store_dk_dv(const Fa3BwdSmem<Traits>& smem, const BwdParams& p,
                                   const Fa3BwdWork<Traits>& work,
                                   const float (&acc_dk)[1][Traits::kHeadDim / 8][4],
                                   const float (&acc_dv)[1][Traits::kHeadDim / 8][4],
                                   int consumer) {
  using Element = typename Traits::Element;
  using Ops = typename Traits::Ops;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const SeqRows& seq = work.seq;
  const int batch = work.batch;
  const int head_k = work.head_k;
  const int key0 = work.key0;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % 32;
  const int wg_key0 = Traits::kKeysPerConsumer * consumer;
  const int warp_key0 = wg_key0 + 16 * (tid / 32);
  bwd_barrier_sync(BwdBarrier::kBoth, consumer);
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t offset =
          swizzled_offset<kBlockN>(warp_key0 + lane / 4 + 8 * half, 8 * j + 2 * (lane % 4));
      st_shared_b32(smem.k() + offset, Ops::pack2(acc_dk[0][j][2 * half] * p.dk_scale,
                                                  acc_dk[0][j][2 * half + 1] * p.dk_scale));
      st_shared_b32(smem.v() + offset,
                    Ops::pack2(acc_dv[0][j][2 * half], acc_dv[0][j][2 * half + 1]));
    }
  bwd_barrier_sync(BwdBarrier::kConsumer, consumer);
  constexpr int kChunks = kHeadDim / 8;
  const int64_t key_row0 = seq.k.start + key0;  // (packed: batch strides 0)
  auto* g_dk = static_cast<Element*>(p.dk_ptr) + batch * p.dk_batch_stride +
               head_k * p.dk_head_stride + key_row0 * p.dk_row_stride;
  auto* g_dv = static_cast<Element*>(p.dv_ptr) + batch * p.dv_batch_stride +
               head_k * p.dv_head_stride + key_row0 * p.dv_row_stride;
  for (int idx = tid; idx < Traits::kKeysPerConsumer * kChunks; idx += kWarpgroupThreads) {
    const int row = wg_key0 + idx / kChunks;
    const int chunk = idx % kChunks;
    if (key0 + row >= seq.k.len) break;
    const uint32_t offset = swizzled_offset<kBlockN>(row, 8 * chunk);
    st_global_b128(g_dk + row * p.dk_row_stride + 8 * chunk, ld_shared_b128(smem.k() + offset));
    st_global_b128(g_dv + row * p.dv_row_stride + 8 * chunk, ld_shared_b128(smem.v() + offset));
  }
}

// ---------------------------------------------------------------------- a consumer's steps
// A consumer warpgroup's step besides forming P^T and dS^T and the products that read them from
// registers (fa3_bwd_consume): its loads and stores of shared memory and the products whose
// operands all come from there.
template <typename Traits>
struct Fa3BwdConsumer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNTiles = kBlockM / 8;     // 8-row column tiles of S^T
  static constexpr int kRowSteps = kBlockM / 16;  // k-steps of dV, dK over the query rows
  static constexpr int kRowValues = ceil_div(2 * kBlockM, kWarpgroupThreads);
  using MmaS = Wgmma<kBlockM, Element>;  // S^T, dP^T: 64 keys x kBlockM query rows
  // dQ: 64 query rows x one 64-column part, or swapped: the part's 64 columns x kBlockM rows
  static constexpr int kDqCols = Traits::Dq_swapped ? kBlockM : kDqPartCols;
  using MmaQ = Wgmma<kDqCols, Element>;

  const Fa3BwdSmem<Traits>& smem;
  const BwdParams& p;
  const Fa3BwdWork<Traits>& work;
  int consumer, tid, lane;
  int wg_key0;    // this consumer's first key in the block
  int warp_key0;  // this warp's

  // A step's -LSE log2 e and D: thread tid loads values tid, tid + 128, ... of the 2 kBlockM
  // (value v: row v of -LSE, or row v - kBlockM of D) a step ahead into this consumer's copy in
  // the ring (plain loads and stores, ordered by the consumer's barriers). A padding row (past
  // seqlen_q; prep writes its values for the producer's copies, these loads do not read them)
  // takes -LSE = -inf and D = 0: its Q and dO are TMA's zeros, so its scores are 0 or masked,
  // P^T = exp2(-inf) = 0 and dS^T = 0 (dP^T = 0) with no test per score, as a real row that
  // sees no key.
  CF_DEVICE void load_row_values(BwdStep at, float (&values)[kRowValues]) const {
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      const int v = tid + kWarpgroupThreads * i;
      if (v >= 2 * kBlockM) break;  // (80-row steps: 160 values, the second pass's first 32)
      // (80 rows: v % 80 held through the loop spilled 8 bytes; a compare is recomputed)
      const int r = Traits::Dq_swapped ? (v < kBlockM ? v : v - kBlockM) : v % kBlockM;
      if (at.m_block * kBlockM + r < work.seq.q.len)
        values[i] = (v < kBlockM ? p.neg_lse_log2 : p.dsum)[work.step_rows(p, at) + r];
      else
        values[i] = v < kBlockM ? neg_infinity() : 0.f;
    }
  }
  CF_DEVICE void store_row_values(int stage, const float (&values)[kRowValues]) const {
#pragma unroll
    for (int i = 0; i < kRowValues; ++i)
      if (tid + kWarpgroupThreads * i < 2 * kBlockM)
        st_shared_b32(smem.rows(consumer, stage) + (tid + kWarpgroupThreads * i) * 4,
                      __float_as_uint(values[i]));
  }

  // (Varlen) Keys past the sequence's end (the next sequence's, read by TMA): their scores are
  // masked, so P^T and dS^T are 0 there, but 0 x Inf or NaN would still be NaN in dP^T (V) and
  // dQ (K). This consumer zeroes its own key rows of both tiles before its first wgmma; its K
  // rows reach the other consumer's dQ after a dq_sync.
  CF_DEVICE void zero_past_keys() const {
    const int valid = work.seq.k.len - work.key0 - wg_key0;  // (the same for the whole warpgroup)
    if (valid < Traits::kKeysPerConsumer) {
      const int first = wg_key0 + max(valid, 0), end = wg_key0 + Traits::kKeysPerConsumer;
      zero_tile_rows<Traits::kColBlocks, kBlockN, true>(smem.k(), first, end, tid,
                                                        kWarpgroupThreads);
      zero_tile_rows<Traits::kColBlocks, kBlockN, true>(smem.v(), first, end, tid,
                                                        kWarpgroupThreads);
      fence_proxy_async_shared();
      bwd_barrier_sync(BwdBarrier::kConsumer, consumer);
    }
  }

  // (Varlen) Rows past the sequence's end in its last query block (the next sequence's): their
  // -LSE is -inf and D 0, so P^T and dS^T are 0, but 0 x Inf or NaN in Q or dO would be NaN in
  // dK and dV. Both consumers read every row of both tiles: they zero them together, then meet
  // (the same answer for both).
  CF_DEVICE void zero_past_rows(uint32_t q_tile, uint32_t do_tile, int row0) const {
    const int valid = work.seq.q.len - row0;
    if (valid < kBlockM) {
      const int thread = consumer * kWarpgroupThreads + tid;
      zero_tile_rows<Traits::kColBlocks, kBlockM, true>(q_tile, valid, kBlockM, thread,
                                                        Traits::kConsumers * kWarpgroupThreads);
      zero_tile_rows<Traits::kColBlocks, kBlockM, true>(do_tile, valid, kBlockM, thread,
                                                        Traits::kConsumers * kWarpgroupThreads);
      fence_proxy_async_shared();
      bwd_barrier_sync(BwdBarrier::kBoth, consumer);
    }
  }

  // S^T = K_c Q^T (or dP^T = V_c dO^T) issued and committed: k-step ks reads 16 columns of d, 32
  // bytes into the 128-byte rows of column block ks / 4 (this consumer's keys start wg_key0
  // rows into K and V).
  CF_DEVICE void issue_scores(float (&acc)[kNTiles][4], uint32_t keys, uint32_t rows) const {
    const uint64_t desc_a0 = wgmma_desc(keys + wg_key0 * kSwizzleRowBytes, 0);
    const uint64_t desc_b0 = wgmma_desc(rows, 0);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t col_bytes = (ks % 4) * 32;
      const uint64_t desc_a =
          wgmma_desc_advance(desc_a0, (ks / 4) * kBlockN * kSwizzleRowBytes + col_bytes);
      const uint64_t desc_b =
          wgmma_desc_advance(desc_b0, (ks / 4) * kBlockM * kSwizzleRowBytes + col_bytes);
      MmaS::ss(acc, desc_a, desc_b, ks > 0);
    }
    wgmma_commit();
  }

  // dS^T to shared memory: key rows of 64 query rows (128 bytes) per column block, swizzled;
  // k-step ks's fragments are four 8 x 8 tiles (keys +0 / +8, query rows 16 ks / + 8), one
  // stmatrix, lanes 8 j .. 8 j + 7 pointing at tile j's key rows.
  // Swapped dQ: dS instead, [keys / 64][query rows][64 keys] (the K-major B operand of dQ^T):
  // each 8 x 8 tile transposed, lanes 8 j .. 8 j + 7 pointing at its query rows.
  CF_DEVICE void store_ds(int ds_stage, const uint32_t (&ds_frag)[kRowSteps][4]) const {
    if constexpr (Traits::Dq_swapped) {
      const int tile = lane / 8;  // fragment register: rows + 8 (tile / 2), keys + 8 (tile % 2)
#pragma unroll
      for (int ks = 0; ks < kRowSteps; ++ks)
        stmatrix_x4_trans(
            smem.ds(ds_stage) + swizzled_offset<kBlockM>(16 * ks + 8 * (tile / 2) + lane % 8,
                                                         warp_key0 + 8 * (tile % 2)),
            ds_frag[ks][0], ds_frag[ks][1], ds_frag[ks][2], ds_frag[ks][3]);
    } else if constexpr (Traits::Exp_under_dp) {
#pragma unroll
      for (int ks = 0; ks < kRowSteps; ++ks)
        stmatrix_x4(
            smem.ds(ds_stage) + swizzled_offset<kBlockN>(warp_key0 + lane % 8 + 8 * (lane / 8 % 2),
                                                         16 * ks + 8 * (lane / 16)),
            ds_frag[ks][0], ds_frag[ks][1], ds_frag[ks][2], ds_frag[ks][3]);
    } else {  // (the order before: a 32-bit store a fragment register)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          st_shared_b32(
              smem.ds(ds_stage) + swizzled_offset<kBlockN>(warp_key0 + lane / 4 + 8 * half,
                                                           8 * nt + 2 * (lane % 4)),
              ds_frag[nt / 2][2 * (nt % 2) + half]);
    }
  }

  // dQ = dS K issued and committed: A = dS (query rows x keys) read from dS^T, B = K (keys x d)
  // read from the K tile, both MN-major; k-step ks takes 16 keys (2048 bytes of either tile).
  // This consumer's part over all 128 keys: rows 64 c .. 64 c + 63 at d = 64 (A from column
  // block c of dS^T), d's columns 64 c .. 64 c + 63 at d = 128 (B from column block c of K);
  // staged as part c of the step's dQ (at d = 64 part c is its 16 KB tile c).
  // Swapped (80-row steps): dQ^T = K^T dS^T, A = K^T (d x keys) from column block c of K read
  // MN-major, B = dS from its [keys / 64][rows][64] tile K-major (k-step ks: 32 bytes into the
  // rows of key block ks / 4).
  CF_DEVICE void issue_dq(float (&acc_dq)[kDqCols / 8][4], int ds_stage) const {
    if constexpr (Traits::Dq_swapped) {
      wgmma_fence();
      const uint64_t desc_k0 =
          wgmma_desc(smem.k() + consumer * kBlockN * kSwizzleRowBytes, kBlockN * kSwizzleRowBytes);
      const uint64_t desc_ds0 = wgmma_desc(smem.ds(ds_stage), 0);
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks)
        MmaQ::ss_ta(
            acc_dq, wgmma_desc_advance(desc_k0, 16 * ks * kSwizzleRowBytes),
            wgmma_desc_advance(desc_ds0, (ks / 4) * kBlockM * kSwizzleRowBytes + (ks % 4) * 32),
            ks > 0);
      wgmma_commit();
      return;
    }
    const uint32_t dq_rows_offset =
        Traits::Dq_split_rows ? consumer * kBlockN * kSwizzleRowBytes : 0;
    const uint32_t dq_cols_offset =
        Traits::Dq_split_rows ? 0 : consumer * kBlockN * kSwizzleRowBytes;
    wgmma_fence();
    const uint64_t desc_ds0 = wgmma_desc(smem.ds(ds_stage) + dq_rows_offset, 0);
    const uint64_t desc_k0 = wgmma_desc(smem.k() + dq_cols_offset, kBlockN * kSwizzleRowBytes);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      const uint32_t key_bytes = 16 * ks * kSwizzleRowBytes;
      MmaQ::ss_tt(acc_dq, wgmma_desc_advance(desc_ds0, key_bytes),
                  wgmma_desc_advance(desc_k0, key_bytes), ks > 0);
    }
    wgmma_commit();
  }

  // dQ staged at `staged` in its fragments' order (dq_tiles.cuh), for one bulk reduce-add.
  CF_DEVICE void stage_dq(uint32_t staged, const float (&acc_dq)[kDqCols / 8][4]) const {
#pragma unroll
    for (int j = 0; j < kDqCols / 8; ++j)
      st_shared_b128(staged + (Traits::Dq_swapped ? dq_swapped_fragment_bytes(consumer, j, tid)
                                                  : dq_tile_fragment_bytes(consumer, j, tid)),
                     make_uint4(__float_as_uint(acc_dq[j][0]), __float_as_uint(acc_dq[j][1]),
                                __float_as_uint(acc_dq[j][2]), __float_as_uint(acc_dq[j][3])));
    fence_proxy_async_shared();
  }
};

// ---------------------------------------------------------------------- consumers
// Consumer warpgroup 1 + c: keys 64 c .. 64 c + 63 of the block; the steps (the file's head),
// then the epilogue.
template <typename Traits>
CF_DEVICE void fa3_bwd_consume(const Fa3BwdSmem<Traits>& smem, const BwdParams& p,
                               const Fa3BwdWork<Traits>& work) {
  using Element = typename Traits::Element;
  using Ops = typename Traits::Ops;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  const AttnParams& a = p.attn;
  const SeqRows& seq = work.seq;
  const auto& range = work.range;
  const int batch = work.batch;
  const int key0 = work.key0;
  const int steps = work.steps;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  setmaxnreg_inc<Traits::kConsumerRegs>();
  // Uniform across the warp as ptxas sees it in the new order's variants (warpgroup_index: their
  // wgmma descriptors in uniform registers, 94 instructions fewer a step at d = 128); the order
  // before keeps the SASS that was measured (and its d = 64 causal, local, softcap, deterministic
  // variant spilled 8 bytes with it).
  const int consumer = Traits::Exp_under_dp ? warpgroup_index() - 1 : warpgroup - 1;
  const int tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int wg_key0 = Traits::kKeysPerConsumer * consumer;  // this consumer's keys in the block
  const int warp_key0 = wg_key0 + 16 * warp;
  const float scale_log2 = a.softmax_scale_log2;
  using Steps = Fa3BwdConsumer<Traits>;
  using MmaKV = Wgmma<kHeadDim, Element>;  // dV, dK: 64 keys x d
  constexpr int kNTiles = Steps::kNTiles;
  constexpr int kRowSteps = Steps::kRowSteps;
  // One issuer and one reduce of the whole step per step: each consumer adding its own half
  // (two 16 KB reduces, one barrier fewer per step) measured 5-9% slower at d = 128
  // (docs/evidence.md (2026-12-01-hopper-backward)).
  const bool dq_issuer = !Traits::Dq_writer && tid == 0 && consumer == 0;
  // dS^T complete, dQ staged: both consumers (each one's part of dQ reads both's dS^T).
  auto dq_sync = [&]() { bwd_barrier_sync(BwdBarrier::kBoth, consumer); };
  const Steps c{smem, p, work, consumer, tid, lane, wg_key0, warp_key0};

  [[maybe_unused]] float row_values[Steps::kRowValues];  // (this consumer's copy: not loaded)
  if (!Traits::Rows_by_producer && steps > 0) {
    c.load_row_values(work.first_step, row_values);
    c.store_row_values(0, row_values);
  }
  bwd_barrier_sync(BwdBarrier::kConsumer, consumer);

  float acc_dk[1][kHeadDim / 8][4];  // one 16-row tile per warp, as zero_fill counts them
  float acc_dv[1][kHeadDim / 8][4];
  zero_fill(acc_dk);
  zero_fill(acc_dv);
  mbar_wait(smem.kv_full(), 0);
  if constexpr (Traits::Varlen) c.zero_past_keys();

  BwdStep at = work.first_step;
  for (int step = 0; step < steps; ++step) {
    const BwdStep next = work.next(at);
    if (!Traits::Rows_by_producer && step + 1 < steps) c.load_row_values(next, row_values);
    // ALiBi's slope for the step's head (a padded batch: one shift), read before the waits
    [[maybe_unused]] const typename Traits::Bias bias(
        a, batch, at.head, Traits::Varlen ? range.keys.shift : a.seqlen_k - a.seqlen_q);
    const RingUse<kStages> use(step);  // the step's Q and dO (the producer's)
    const int stage = use.stage;
    mbar_wait(smem.q_full(stage), use.parity);
    const uint32_t q_tile = smem.q(stage);
    const uint32_t do_tile = smem.dout(stage);
    const int m_block = at.m_block;
    const int row0 = m_block * kBlockM;
    if constexpr (Traits::Varlen) c.zero_past_rows(q_tile, do_tile, row0);

    // S^T = K_c Q^T, dP^T = V_c dO^T
    float s[1][kNTiles][4], dp[1][kNTiles][4];
    wgmma_fence();
    c.issue_scores(s[0], smem.k(), q_tile);
    c.issue_scores(dp[0], smem.v(), do_tile);
    // (The -LSE of the first part's rows read here, before the wait for S^T, as FA4 reads them
    // among its S^T wgmmas: measured 1-4% slower, H100 2026-12-07, so read where used.)
    wgmma_wait<1>();
    wgmma_fence_operands(s[0]);
    if constexpr (Traits::Has_softcap)  // the forward's order: the cap, then the mask
      transform_scores_transposed(Softcap(a), s, key0 + warp_key0, row0, lane);
    if constexpr (Traits::Has_user_mask && !Traits::Has_user_score) {  // (the step's head: h)
      // by the BlockMask's class of this consumer's keys x the step's rows (mixed without one)
      const int state = block_mask_tile_state<kBlockM, Traits::kKeysPerConsumer>(
          a, batch, at.head, row0, key0 + wg_key0);
      user_mods_by_state</*Transposed=*/true>(typename Traits::UserMask(a, batch, at.head, 0),
                                              state, s, row0, key0 + warp_key0, lane);
    }
    const bool bounded = range.needs_mask(m_block);  // (a score_mod's step below applies them)
    if (!Traits::Has_user_score && bounded)
      range.apply_by_row_offsets(s, key0 + warp_key0, row0, lane);
    // Packed, with score functions: the hook sees the rows past the sequence that its last query
    // block covers (its guard is the packed total's), whose Q and dO rows are zeroed but whose value
    // is not: a NaN from a read outside a captured array there would reach dK and dV (NaN x 0).
    // Those rows hidden: here for a mask_mod alone, with the bounds below for a score_mod.
    [[maybe_unused]] const bool past_rows = Traits::Varlen && seq.q.len - row0 < kBlockM;
    if constexpr (Traits::Varlen && Traits::Has_user_mask && !Traits::Has_user_score) {
      if (past_rows) range.hide_rows_from(s, row0, seq.q.len, lane);  // (the same for the CTA)
    }
    // this thread's query rows of column tile nt: 8 nt + 2 (lane % 4) and the next
    const uint32_t thread_rows = smem.rows(consumer, stage) + 2 * (lane % 4) * 4;
    // ALiBi's row + shift - key for this thread's first row and each of its two keys, converted
    // once a step: a score's distance is it plus the row's offset 8 nt + c (below the step's
    // rows), in float, as the forward's tile loop forms it (variants.cuh's Alibi::distance).
    [[maybe_unused]] float alibi_distance[2];
    if constexpr (Traits::Has_alibi)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        alibi_distance[half] =
            bias.distance(row0 + 2 * (lane % 4), key0 + warp_key0 + lane / 4 + 8 * half);
    // element 2 half + c of column tile nt: row 8 nt + 2 (lane % 4) + c, key lane / 4 + 8 half
    // of the warp's 16
    auto logit_with_bias = [&](float score, int nt, int half, int c) {
      // ALiBi here, where P^T is formed, not over all of S^T after the mask: that kept the bias
      // of a whole step live and spilled the bounded variants at d = 64 (4-12 bytes). After the
      // mask, -inf stays -inf.
      if constexpr (Traits::Has_alibi)
        return bias.at_distance(score, alibi_distance[half] + static_cast<float>(8 * nt + c));
      return score;
    };
    // P^T and dS^T in the element type, as the A fragments of dV and dK: k-step ks is column
    // tiles 2 ks, 2 ks + 1, rows lane / 4 and + 8 (p_operand's order).
    uint32_t p_frag[kRowSteps][4], ds_frag[kRowSteps][4];
    const uint64_t desc_do = wgmma_desc(do_tile, kBlockM * kSwizzleRowBytes);
    const uint64_t desc_q = wgmma_desc(q_tile, kBlockM * kSwizzleRowBytes);
    // dV += P^T dO or dK += dS^T Q over the k-steps of part `part` of `parts` (k-step ks takes
    // query rows 16 ks .. 16 ks + 15: two 8-row atoms of every column block, 2048 bytes; d's
    // column blocks are kBlockM rows apart), the fragments as the A operand from registers.
    auto issue_kv = [&](float (&acc)[kHeadDim / 8][4], const uint32_t (&frags)[kRowSteps][4],
                        uint64_t desc, int part, int parts) {
#pragma unroll
      for (int ks = part * kRowSteps / parts; ks < (part + 1) * kRowSteps / parts; ++ks)
        MmaKV::rs_bt(acc, frags[ks], wgmma_desc_advance(desc, ks * 2 * kSwizzleAtomBytes), 1);
    };
    // At 128 rows a step (d = 64) in two halves of the rows: the first half's fragments are
    // complete and its wgmmas issued before the second half's exponentials, which bounds how far
    // ptxas hoists them (one pass over all 16 column tiles kept ~30 more values live next to the
    // 192 accumulators, and some variants spilled).
    // A score_mod's logits and slopes (computed here) take the same bound further: four times
    // as many parts (softcap's tanh hoisted over a pass spilled 24-28 bytes at both head dims
    // with one or two parts, a document mask beside a bias table 4).
    constexpr int kParts = (kRowSteps >= 8 ? 2 : 1) * (Traits::Has_user_score ? 4 : 1);
    [[maybe_unused]] const typename Traits::UserMask user(a, batch, at.head, 0);  // (b, h) state
    // A score_mod's bounds, applied to its logits: for this thread's keys (two 8-key halves),
    // the rows that see them as offsets lo <= 8 nt + c <= hi from its first row.
    int lo[2] = {0, 0}, hi[2] = {8 * kNTiles, 8 * kNTiles};
    if (Traits::Has_user_score && bounded)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        range.template visible_offsets<kNTiles>(key0 + warp_key0 + lane / 4 + 8 * half,
                                                row0 + 2 * (lane % 4), lo[half], hi[half]);
    if constexpr (Traits::Varlen && Traits::Has_user_score) {
      if (past_rows)  // (above) no row at or past the sequence's end
#pragma unroll
        for (int half = 0; half < 2; ++half)
          hi[half] = min(hi[half], seq.q.len - 1 - (row0 + 2 * (lane % 4)));
    }
    // A score_mod's logit of element 2 half + c of column tile nt, from its (biased) score, -inf
    // outside the bounds above; the score itself without one.
    auto user_logit = [&](float logit, int nt, int half, int c) {
      if constexpr (Traits::Has_user_score) {
        logit =
            user(logit, row0 + 8 * nt + 2 * (lane % 4) + c, key0 + warp_key0 + lane / 4 + 8 * half);
        if (8 * nt + c < lo[half] || 8 * nt + c > hi[half]) logit = neg_infinity();
      }
      return logit;
    };
    auto dv_dk_part = [&](const int part) {
#pragma unroll
      for (int nt = part * kNTiles / kParts; nt < (part + 1) * kNTiles / kParts; ++nt) {
        const float2 neg_lse = ld_shared_f32x2_offset(thread_rows, 8 * nt * 4);
        const float2 dsum = ld_shared_f32x2_offset(thread_rows, Traits::kRowBytes + 8 * nt * 4);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float prob[2], ds[2];
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            float logit = logit_with_bias(s[0][nt][2 * half + c], nt, half, c);
            float slope = 1.f;  // d logit / d (scaled score): score_mod's derivative
            if constexpr (Traits::Has_user_score)
              slope = user.grad(logit, row0 + 8 * nt + 2 * (lane % 4) + c,
                                key0 + warp_key0 + lane / 4 + 8 * half);
            logit = user_logit(logit, nt, half, c);
            prob[c] = fast_exp2(fmaf(logit, scale_log2, c ? neg_lse.y : neg_lse.x));
            ds[c] = prob[c] * (dp[0][nt][2 * half + c] - (c ? dsum.y : dsum.x));
            if constexpr (Traits::Has_softcap)  // the logit is the capped score here (no ALiBi)
              ds[c] = softcap_grad(ds[c], prob[c], logit);
            if constexpr (Traits::Has_user_score)  // (a hidden score's slope may be anything)
              ds[c] = prob[c] != 0.f ? ds[c] * slope : 0.f;
          }
          p_frag[nt / 2][2 * (nt % 2) + half] = Ops::pack2(prob[0], prob[1]);
          ds_frag[nt / 2][2 * (nt % 2) + half] = Ops::pack2(ds[0], ds[1]);
        }
      }
      wgmma_fence();
      issue_kv(acc_dv[0], p_frag, desc_do, part, kParts);
      wgmma_commit();
      issue_kv(acc_dk[0], ds_frag, desc_q, part, kParts);
      wgmma_commit();
    };
    // Every part once, each index a literal (a `#pragma unroll` loop over the calls put the
    // fragments on the stack at d = 64: 768 bytes)
    static_assert(kNTiles % kParts == 0 && kRowSteps % kParts == 0, "whole k-steps a part");
    if constexpr (Traits::Exp_under_dp) {
      // Per part of the rows: P^T in S^T's registers and dV += P^T dO issued, in the first part
      // while dP^T is still on the tensor cores; then dS^T = P^T (dP^T - D) and dK += dS^T Q. (An
      // order ptxas keeps: dV's wgmma reads the exponentials, and the wait for dP^T cannot move
      // above dV's commit.)
      // 80-row steps: P^T packed and dV issued after dS^T instead (FA4's order), so that P^T's
      // fragments never sit beside S^T, dP^T, dK and dV (40 + 40 + 64 + 64 + 20 of 240 registers
      // spilled 64 bytes of dK and serialised every wgmma).
      constexpr bool kDvAfterDs = Traits::Dq_swapped;
      auto early_part = [&](const int part) {
#pragma unroll
        for (int nt = part * kNTiles / kParts; nt < (part + 1) * kNTiles / kParts; ++nt) {
          const float2 neg_lse = ld_shared_f32x2_offset(thread_rows, 8 * nt * 4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // (a score_mod's derivative is 1 here: no slope kept)
            const float logit =
                user_logit(logit_with_bias(s[0][nt][e], nt, e / 2, e % 2), nt, e / 2, e % 2);
            s[0][nt][e] = fast_exp2(fmaf(logit, scale_log2, e % 2 ? neg_lse.y : neg_lse.x));
          }
          if constexpr (!kDvAfterDs) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
              p_frag[nt / 2][2 * (nt % 2) + half] =
                  Ops::pack2(s[0][nt][2 * half], s[0][nt][2 * half + 1]);
          }
        }
        if constexpr (!kDvAfterDs) {
          wgmma_fence();
          issue_kv(acc_dv[0], p_frag, desc_do, part, kParts);
          wgmma_commit();
        }
        if (part == 0) {
          wgmma_wait<kDvAfterDs ? 0 : 1>();  // dP^T complete; dV may still run
          wgmma_fence_operands(dp[0]);
        }
#pragma unroll
        for (int nt = part * kNTiles / kParts; nt < (part + 1) * kNTiles / kParts; ++nt) {
          const float2 dsum = ld_shared_f32x2_offset(thread_rows, Traits::kRowBytes + 8 * nt * 4);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            ds_frag[nt / 2][2 * (nt % 2) + half] =
                Ops::pack2(s[0][nt][2 * half] * (dp[0][nt][2 * half] - dsum.x),
                           s[0][nt][2 * half + 1] * (dp[0][nt][2 * half + 1] - dsum.y));
            if constexpr (kDvAfterDs)
              p_frag[nt / 2][2 * (nt % 2) + half] =
                  Ops::pack2(s[0][nt][2 * half], s[0][nt][2 * half + 1]);
          }
        }
        if constexpr (kDvAfterDs) {
          wgmma_fence();
          issue_kv(acc_dv[0], p_frag, desc_do, part, kParts);
          wgmma_commit();
        }
        if constexpr (!Traits::Dq_first) {
          wgmma_fence();
          issue_kv(acc_dk[0], ds_frag, desc_q, part, kParts);
          wgmma_commit();
        }
      };
      for_each_index<kParts>(early_part);
    } else {
      wgmma_wait<0>();
      wgmma_fence_operands(dp[0]);
      for_each_index<kParts>(dv_dk_part);
    }

    const int ds_stage = step % Traits::kDsStages;
    c.store_ds(ds_stage, ds_frag);  // dS^T to shared memory
    fence_proxy_async_shared();
    if (dq_issuer) bulk_wait_read<0>();  // the last step's dQ has left the staging buffer
    dq_sync();
    const int dq_buffer = step % Traits::kDqBuffers;

    if constexpr (Traits::Dq_swapped) {
      // dV complete (it ran under dS^T's store and the meeting): P^T's registers free before
      // dQ's 40 accumulators join dK, dV and dS^T's fragments
      wgmma_wait<0>();
      wgmma_fence_operands(acc_dv[0]);
#pragma unroll
      for (int ks = 0; ks < kRowSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(p_frag[ks][i])::"memory");
    }
    float acc_dq[Steps::kDqCols / 8][4];
    c.issue_dq(acc_dq, ds_stage);  // dQ = dS K
    // Once every wgmma of the step is complete: P^T and dS^T (register operands) free, Q and dO
    // read.
    auto step_read = [&]() {
      wgmma_fence_operands(acc_dk[0]);
      wgmma_fence_operands(acc_dv[0]);
#pragma unroll
      for (int ks = 0; ks < kRowSteps; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (!Traits::Dq_swapped) asm volatile("" : "+r"(p_frag[ks][i])::"memory");
          asm volatile("" : "+r"(ds_frag[ks][i])::"memory");
        }
      __syncwarp();
      if (lane == 0) mbar_arrive(smem.q_empty(stage));
    };
    if constexpr (Traits::Dq_first) {
      issue_kv(acc_dk[0], ds_frag, desc_q, 0, 1);
      wgmma_commit();
      wgmma_wait<1>();  // dQ complete; dK may still run
      wgmma_fence_operands(acc_dq);
    } else {
      wgmma_wait<0>();
      wgmma_fence_operands(acc_dq);
      step_read();
    }

    // dQ staged in its fragments' order, then one bulk reduce-add into dQacc's tile.
    if (Traits::Decoupled && step >= 1)
      dq_handover_sync(BwdBarrier::kDqFree, consumer,
                       kDqPartHandoverThreads);  // its last part read
    else if (Traits::Dq_writer && !Traits::Decoupled && step >= Traits::kDqBuffers)
      dq_handover_sync(BwdBarrier::kDqFree, dq_buffer);  // the writer has read its last tile
    const uint32_t staged = smem.dq() + dq_buffer * Traits::kDqStepBytes;
    c.stage_dq(staged, acc_dq);
    if (!Traits::Rows_by_producer && step + 1 < steps)
      c.store_row_values((step + 1) % kStages, row_values);
    if constexpr (Traits::Dq_first) {
      wgmma_wait<0>();
      step_read();
    }
    if constexpr (Traits::Decoupled) {
      // the next step's -LSE and D (this consumer's copy) before their reads; no meeting with
      // the other consumer, whose next dS^T goes to the other buffer (the producer's copy: on
      // the stage's full barrier, nothing to order here)
      if constexpr (!Traits::Rows_by_producer) bwd_barrier_sync(BwdBarrier::kConsumer, consumer);
      dq_handover_arrive(BwdBarrier::kDqStaged, consumer, kDqPartHandoverThreads);
    } else {
      dq_sync();  // (also orders the next step's -LSE and D before their reads)
      if constexpr (Traits::Dq_writer) dq_handover_arrive(BwdBarrier::kDqStaged, dq_buffer);
      if (dq_issuer) {
        bulk_reduce_add_f32(p.dq_accum + work.step_rows(p, at) * kHeadDim, staged,
                            Traits::kDqStepBytes);
        bulk_commit();
      }
    }
    at = next;
  }
  if (dq_issuer) bulk_wait<0>();  // the staging buffer stays valid until the last add is done

  fa3_bwd_store_dk_dv<Traits>(smem, p, work, acc_dk, acc_dv, consumer);
}

template <typename Traits>
CF_DEVICE void fa3_bwd(const Fa3BwdParams& params) {
  const BwdParams& p = params.bwd;
  extern __shared__ unsigned char smem_raw[];
  const Fa3BwdSmem<Traits> smem(smem_raw);
  const Fa3BwdWork<Traits> work(p.attn, fa3_bwd_tile<Traits>(p.lpt_pairs));
  if (work.no_keys()) return;

  if (threadIdx.x == 0) smem.init_barriers();
  __syncthreads();
  if (threadIdx.x / kWarpgroupThreads == 0) {  // the producer warpgroup
    setmaxnreg_dec<Traits::kProducerRegs>();
    if constexpr (Traits::Dq_writer) {
      if (threadIdx.x / 32 == 1) fa3_bwd_dq_writer<Traits>(smem, p, work);
    }
    if (threadIdx.x == 0) fa3_bwd_load<Traits>(smem, params, work);
    return;
  }
  fa3_bwd_consume<Traits>(smem, p, work);
}
