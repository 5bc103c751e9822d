// FlashDecoding: attention of a few query tokens over a long KV cache, the keys split over CTAs.
//
// decode_partial -- grid (num_splits * m_blocks, Hkv, B). A CTA takes one split of the keys of
//   one (batch, KV head) and every query head that reads that KV head (GQA): the rows of its MMA
//   tiles are the packed (query token, head of the group) pairs, row r = token * group + head,
//   padded to kBlockM. K and V therefore stream from HBM once per KV head, not once per query head.
//   Warps do not share a K/V tile: each runs its own cp.async ring over every kNWarps-th key slice
//   of the split (no CTA barrier in the loop, so one warp waiting on memory never stalls another),
//   with its own online-softmax state. The warps' partial results are merged once at the end.
//   One split (num_splits = 1) writes the normalised output directly. Otherwise each CTA writes
//   its fp32 partial O and LSE and takes a ticket on its (batch, KV head, m-block) counter; the
//   CTA that draws the last ticket merges the splits' partials into the output and sets the
//   counter back to 0 for the next call (one launch per decode step, no combine kernel: the
//   merge starts the moment the last split lands, not after a launch gap).
//   Batch_invariant: a split is a fixed number of keys (blocks_per_split, from the host's
//   BATCH_INVARIANT_SPLIT_KEYS), and a sequence of L keys merges its own ceil(L / split) splits
//   (sequence_splits), in split order, whatever else the launch holds: the splits past its keys
//   exit at once, and one split writes the output directly. Nothing a CTA computes then depends
//   on the batch, its size, the cache's capacity or the sequence's place in it.
//   Is_tree (speculative decoding): the query tokens are the last Nq keys, and among them each
//   sees the drafts its row of the caller's tree mask names (PackedRowMask, tree_row_word).
//   Is_cascade (shared-prefix decoding): one grid axis (decode_work) holds the prefixes' CTAs --
//   split sp of group g's prefix pages for a row block of whole requests of g (rows request-major,
//   packed_row), every key visible -- then each request's CTAs over its own pages as above. Each
//   writes fp32 partials: a request's own split s in slot s, prefix split sp in slot num_splits +
//   sp; each takes a ticket on the counter of every request whose rows it holds, and the CTA that
//   draws a request's last (num_splits + prefix_splits) merges that request's rows.
// decode_merge -- the exact merge of partials (O_i, LSE_i) by LSE rescaling, one warp per output
//   row (merge_row in softmax.cuh, which the fused combine uses too); the kernel serves
//   cupyflash.merge_states.
// decode_append -- writes k_new / v_new into the cache at positions cache_seqlens[b] + t (k_new
//   rotated there first with a rotary embedding); decode_rotary_q -- the queries rotated into a
//   temporary the attention reads.
//
// The cache is contiguous [entries, L_max, Hkv, d] (sequence b in entry cache_batch_idx[b], or b;
// its keys from cache_leftpad[b], or 0) or paged [num_pages, page_size, Hkv, d] through a block
// table [B, max_pages]; page_size is any power of two, down to 1 (a slice's pages looked up once,
// one lane per key). Device-side values are never trusted, and never clamped into a plausible
// answer: a sequence whose cache_seqlens[b] is < 0 or > capacity - seqlen_new, whose first key is
// outside [0, cache_seqlens[b]], whose entry is outside the cache, or one of whose pages in use
// (those holding its keys) has a block-table entry outside [0, num_pages), gets NaN in every
// output row and LSE, appends nothing through a bad entry (nor anything at all with a bad length
// or entry), and sets bit 1 (bad page), 2 (bad length) or 4 (bad entry) of *error_flags; no
// access ever leaves the cache.
#pragma once

#include "common.cuh"
#include "fp8.cuh"      // the float8 cache: widening, quantisation
#include "hopper.cuh"   // the wgmma prefix: swizzled tiles, descriptors, fences
#include "mask.cuh"     // KeyMask, PackedRowMask
#include "kvcache.cuh"  // DecodeParams, CacheSpan, CacheRows: the cache view
#include "params.cuh"
#include "softmax.cuh"   // the online softmax and merge_row
#include "tile_mma.cuh"  // gemm_qk, gemm_pv, load_q_regs: the mma.sync tile verbs
#include "variants.cuh"
#include "wgmma.cuh"  // the wgmma prefix: m64nNk16 wrappers

// Exact merge of partial results: part p of output row (b, i, h) is
//   O_p = o_parts_ptr[p * o_part_stride + b * o_batch_stride + i * o_row_stride + h * o_head_stride + :]
//   LSE_p = lse_parts_ptr[p * lse_part_stride + b * lse_batch_stride + h * lse_head_stride + i].
struct MergeParams {
  const void* o_parts_ptr;
  const float* lse_parts_ptr;
  void* o_ptr;     // [B, Nq, H, d] through the out_* strides
  float* lse_ptr;  // [B, H, Nq] (row stride 1), or nullptr
  int64_t o_part_stride, o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_part_stride, lse_batch_stride, lse_head_stride;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  int64_t out_lse_batch_stride, out_lse_head_stride;
  int32_t num_parts;
  int32_t batch, seqlen_q, heads;
};

template <int kHeadDim_, int kBlockM_, int kWarpKeys_, int kNWarps_, int kStages_, bool Q_in_regs_,
          typename Element_, bool Is_causal_, bool Is_local_ = false, bool Has_softcap_ = false,
          int kValidDim_ = 0, bool Kv_fp8_ = false, bool Batch_invariant_ = false,
          bool Is_tree_ = false, bool Is_cascade_ = false, bool Wide_tree_ = false,
          bool Wgmma_prefix_ = false>
struct DecodeTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Tile = SwizzledTile<kHeadDim_>;
  using Columns = TileColumns<kHeadDim_, kValidDim_>;  // the caller's head dim, if below the tile's

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;      // packed (token, head) rows per CTA
  static constexpr int kWarpKeys = kWarpKeys_;  // keys one warp takes per step
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;  // depth of each warp's K/V ring
  static constexpr bool Q_in_regs = Q_in_regs_;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;  // a window's left bound
  static constexpr bool Has_softcap = Has_softcap_;
  using Transform = ScoreTransform<Has_softcap_>;
  // A float8 cache (the format, e4m3 or e5m2, is DecodeParams::kv_fp8): the ring holds the
  // cached bytes, half a 16-bit slice's, and the MMAs widen them in registers (gemm_qk_fp8,
  // gemm_pv_fp8 below).
  static constexpr bool Kv_fp8 = Kv_fp8_;
  using CacheElement = typename CacheElementOf<Element, Kv_fp8>::type;
  // Each sequence merges only the splits that hold its keys (sequence_splits below).
  static constexpr bool Batch_invariant = Batch_invariant_;
  // Speculative decoding's tree among the draft tokens (DecodeParams::tree_mask): each packed
  // row's word of visible drafts is built once per CTA (tree_row_word) and read by the mask in
  // the slices that reach the drafts only; the variants without a tree hold none of it.
  static constexpr bool Is_tree = Is_tree_;
  // 33 to 64 drafts: a 64-bit word per packed row (the 32-bit variants hold up to 32).
  static constexpr bool Wide_tree = Wide_tree_;
  using TreeWord = typename TreeWordOf<Wide_tree>::type;
  // Cascade decoding: the grid holds the prefixes' CTAs, then the requests' (cascade_work); every
  // CTA writes fp32 partials, and a request's last one merges its own and its prefix's splits.
  static constexpr bool Is_cascade = Is_cascade_;
  // The cascade's prefix CTAs on Hopper (sm_90a): 128 packed rows of whole requests, two
  // warpgroups of 64 rows over shared 128-key K/V tiles, S = Q K^T and O += P V by wgmma
  // (prefix_partial_wgmma below). The requests' own CTAs stay on the mma.sync path above.
  static constexpr bool Wgmma_prefix = Wgmma_prefix_;
  static constexpr int kPrefixRows = 128;  // two warpgroups' wgmma M
  static constexpr int kPrefixKeys = 128;  // keys of a K/V tile: the CTA key block (kBlockN)
  static constexpr int kPrefixStages = kHeadDim_ <= 64 ? 3 : 2;
  // A K/V tile's copy: rows a pass of all threads covers (16-byte chunks), and the passes.
  static constexpr int kPrefixRowStep = kNWarps_ * 32 / (kHeadDim_ / 8);
  static constexpr int kPrefixPasses = kPrefixKeys / kPrefixRowStep;
  static constexpr int kPrefixTileBytes =
      kPrefixKeys * kHeadDim_ * 2;  // K or V, [d / 64][keys][64]
  // (one swizzle atom of slack: the tiles start 1024-byte aligned)
  static constexpr int kSmemPrefixBytes =
      kSwizzleAtomBytes + kPrefixRows * kHeadDim_ * 2 + kPrefixStages * 2 * kPrefixTileBytes;

  static constexpr int kBlockN = kNWarps * kWarpKeys;  // keys of one CTA step (the split unit)
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMTiles = kBlockM / 16;
  static constexpr int kNTiles = kWarpKeys / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kDSteps = kHeadDim / 16;
  static constexpr int kNSteps = kWarpKeys / 16;

  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
  static constexpr int kSmemQBytes = kBlockM * kHeadDim * kElemBytes;
  static constexpr int kStageBytes = kWarpKeys * kHeadDim * int(sizeof(CacheElement));  // a slice
  // Per warp: [kStages][K, V][kWarpKeys][d] cached elements.
  static constexpr int kWarpRingBytes = 2 * kStages * kStageBytes;
  // Epilogue: every warp's normalised O (fp32, rows padded by 8 floats: 2-way instead of 8-way
  // bank conflicts on the fragment stores) and LSE, in the ring once it has drained.
  static constexpr int kMergeRowFloats = kHeadDim + 8;
  static constexpr int kSmemMergeBytes = kNWarps * kBlockM * (kMergeRowFloats + 1) * 4;
  static constexpr int kSmemRingBytes =
      kNWarps * kWarpRingBytes > kSmemMergeBytes ? kNWarps * kWarpRingBytes : kSmemMergeBytes;
  static constexpr int kSmemBytes = Wgmma_prefix && kSmemPrefixBytes > kSmemQBytes + kSmemRingBytes
                                        ? kSmemPrefixBytes
                                        : kSmemQBytes + kSmemRingBytes;

  static_assert(kBlockM % 16 == 0 && kWarpKeys % 16 == 0, "whole MMA tiles");
  static_assert(kStages >= 2, "the K/V ring needs at least two stages");
  static_assert(!Is_tree || kNThreads >= kBlockM, "a thread per packed row builds its tree word");
  static_assert(Is_tree || !Wide_tree, "a wide tree is a tree");
  static_assert(!Is_cascade || kNThreads >= kBlockM, "a thread per request takes its ticket");
  static_assert(!Is_cascade || !(Is_local || Kv_fp8 || Batch_invariant || Is_tree),
                "the cascade takes a 16-bit paged cache, causal or not, softcap or not");
  static_assert(32 % (kHeadDim / 8) == 0 || (kHeadDim / 8) % 32 == 0, "rows map onto lanes");
  static_assert(!Wgmma_prefix || (Is_cascade && kNWarps == 8 && kBlockN == kPrefixKeys &&
                                  Columns::kFull && (kHeadDim == 64 || kHeadDim == 128)),
                "the wgmma prefix: a cascade's 8-warp tile of 128-key blocks, d = 64 or 128");
  static_assert(!Kv_fp8 || (Columns::kFull && (kHeadDim == 64 || kHeadDim == 128)),
                "a float8 cache takes whole tiles of d = 64 or 128");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a float8 slice: rows of d bytes whose
// chunks are XOR-swizzled within each 128-byte line (of one row at d = 128, two at d = 64) so
// that each 8-lane phase of gemm_qk_fp8's K loads (2 rows x 4 chunks) and gemm_pv_fp8's V loads
// (the same columns of 4 rows), and of the cp.async writes, hits 8 different bank groups
// (checked lane by lane for both head dims).
template <int kHeadDim>
CF_DEVICE uint32_t fp8_chunk_offset(int row, int chunk) {
  static_assert(kHeadDim == 64 || kHeadDim == 128, "float8 rows of 64 or 128 bytes");
  const int line = kHeadDim == 128 ? row : row / 2;
  const int pos = kHeadDim == 128 ? chunk : (row % 2) * 4 + chunk;
  const int swizzle = kHeadDim == 128 ? ((line >> 1) & 6) ^ ((line & 1) << 2) : line & 6;
  return line * 128 + (pos ^ swizzle) * 16;
}

// Shared-memory byte offset of 16-byte chunk `chunk` of row `row` of a warp's ring slice: the
// swizzled tile of a 16-bit cache (ldmatrix reads it), or a float8 cache's swizzled bytes.
template <typename Traits>
CF_DEVICE uint32_t slice_chunk_offset(int row, int chunk) {
  if constexpr (Traits::Kv_fp8) {
    return fp8_chunk_offset<Traits::kHeadDim>(row, chunk);
  } else {
    return Traits::Tile::offset(row, chunk) * Traits::kElemBytes;
  }
}

// One warp copies keys [key0, key0 + kWarpKeys) of a cache into its ring slice at s_tile (keys
// >= seqlen_k zero-filled), 16-byte chunks (8 elements of a 16-bit cache, 16 of a float8 one):
// lane l takes chunk l % kChunksPerRow of rows l / kChunksPerRow, + 32 / kChunksPerRow, ...: a
// warp instruction reads whole 128-byte lines. This loop is most of the
// kernel's instructions, so the rows of a slice that lie in one page (every contiguous cache,
// and pages of >= kWarpKeys tokens: key0 is a multiple of kWarpKeys) take one address and a
// fixed stride: a generic per-row address took ~65 SASS instructions per copy, 80% of the loop,
// and held a warp to ~3 GB/s on the H200. Smaller pages take each row's page from the slice's
// table entries, read once (below).
template <typename Traits>
CF_DEVICE void load_slice_async(uint32_t s_tile,
                                const CacheRows<typename Traits::CacheElement>& cache, int key0,
                                int seqlen_k, int lane, int* bad_page) {
  using CacheElement = typename Traits::CacheElement;
  constexpr int kChunkElements = 16 / static_cast<int>(sizeof(CacheElement));
  constexpr int kChunksPerRow = Traits::kHeadDim / kChunkElements;
  static_assert(kChunksPerRow <= 32 && 32 % kChunksPerRow == 0,
                "a row is at most one warp's chunks");
  constexpr int kRowsPerIter = 32 / kChunksPerRow;
  constexpr int kIters = Traits::kWarpKeys / kRowsPerIter;
  using Columns = typename Traits::Columns;
  const int chunk = lane % kChunksPerRow;
  const int row0 = lane / kChunksPerRow;
  // (A float8 slice is a whole tile: Columns::holds is in 8-element chunks of 16-bit rows.)
  const bool chunk_valid = Traits::Kv_fp8 || Columns::holds(chunk);
  if constexpr (!Traits::Kv_fp8 && !Columns::kWholeChunks) {
    // 2-byte aligned rows (see TileColumns): element by element, each row looked up.
#pragma unroll 2
    for (int it = 0; it < kIters; ++it) {
      const int row = row0 + it * kRowsPerIter;
      const uint4 v = key0 + row < seqlen_k
                          ? ld_global_chunk<Columns>(cache.row(key0 + row, bad_page), chunk)
                          : make_uint4(0u, 0u, 0u, 0u);
      st_shared_b128(s_tile + slice_chunk_offset<Traits>(row, chunk), v);
    }
  } else if (cache.pages == nullptr || (1 << cache.page_size_log2) >= Traits::kWarpKeys) {
    const CacheElement* src =
        cache.row(key0, bad_page) + row0 * cache.row_stride + chunk * kChunkElements;
    const int64_t step = kRowsPerIter * cache.row_stride;
    if (key0 + Traits::kWarpKeys <= seqlen_k && chunk_valid) {
      // A whole slice (every one but a sequence's last): no per-row test, no zero fill -- half
      // the copy loop's instructions, which the float8 cache's step notices.
#pragma unroll
      for (int it = 0; it < kIters; ++it, src += step)
        cp_async_16(s_tile + slice_chunk_offset<Traits>(row0 + it * kRowsPerIter, chunk), src);
    } else {
#pragma unroll
      for (int it = 0; it < kIters; ++it, src += step) {
        const int row = row0 + it * kRowsPerIter;
        const bool valid = chunk_valid && key0 + row < seqlen_k;
        cp_async_16(s_tile + slice_chunk_offset<Traits>(row, chunk), valid ? src : cache.base,
                    valid);
      }
    }
  } else {
    // Pages smaller than a slice. Lane l looks up the page of key key0 + l once (one coalesced
    // read of the block table, before any copy) and each copy takes its row's page from that
    // lane by a shuffle: with a table read per row, every copy waited on a dependent load (page
    // size 1 ran at 64% of the contiguous cache's bandwidth).
    static_assert(Traits::kWarpKeys <= 32, "one lane per key of the slice");
    int my_page = 0;
    if (lane < Traits::kWarpKeys && key0 + lane < seqlen_k) {
      const int entry = __ldg(cache.pages + ((key0 + lane) >> cache.page_size_log2));
      const bool bad = static_cast<unsigned>(entry) >= static_cast<unsigned>(cache.num_pages);
      if (bad) *bad_page = 1;  // (a row of page 0 is read instead: its result is NaN anyway)
      my_page = bad ? 0 : entry;
    }
    const int slot_mask = (1 << cache.page_size_log2) - 1;
#pragma unroll 2
    for (int it = 0; it < kIters; ++it) {
      const int row = row0 + it * kRowsPerIter;
      const int page = __shfl_sync(0xffffffffu, my_page, row);
      const bool valid = chunk_valid && key0 + row < seqlen_k;
      const CacheElement* src = cache.base + page * cache.page_stride +
                                ((key0 + row) & slot_mask) * cache.row_stride +
                                chunk * kChunkElements;
      cp_async_16(s_tile + slice_chunk_offset<Traits>(row, chunk), valid ? src : cache.base, valid);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A float8 cache's MMAs: fp16 operands widened in registers from the cached bytes (fp8.cuh).
//
// An MMA's k order and n order are free as long as its two operands agree, and the fp8 path
// picks them so that each lane's bytes are contiguous in shared memory (lane = 4 g + t):
//   Q K^T, k-step ds = 4 c + j: lane (g, t) loads 16 bytes of one key row, columns 64 c + 16 t ..
//     + 15; word j of them (columns p .. p + 3, p = 64 c + 16 t + 4 j) widens to b0 = columns
//     (p, p + 1) and b1 = (p + 2, p + 3), and Q's fragment takes the same columns.
//   Keys: column n of 8-key tile nt is key 16 (nt / 2) + 4 (n / 2) + 2 (nt % 2) + n % 2
//     (Fp8KeyColumns), so that lane t's P fragment of k-step ks (columns 2t, 2t + 1 of tiles 2 ks
//     and 2 ks + 1) holds keys 4t .. 4t + 3 of it: the B operand of P V is four whole rows.
//   P V, d-tile dt: column n is d column n d / 8 + dt, so that lane g's V bytes (columns
//     g d / 8 .. + d / 8 - 1 of rows 4t .. 4t + 3) are one load per row; byte permutes pair
//     rows 4t, 4t + 1 (b0) and 4t + 2, 4t + 3 (b1) for each d tile.
// ---------------------------------------------------------------------------------------------
// Column n = 2 pair + odd of 8-key tile nt.
CF_DEVICE constexpr int fp8_slice_key(int nt, int pair, int odd) {
  return 16 * (nt / 2) + 4 * pair + 2 * (nt % 2) + odd;
}
struct Fp8KeyColumns {  // the accumulator's element e of tile nt (MmaKeyColumns' counterpart)
  CF_DEVICE int operator()(int nt, int lane, int e) const {
    return fp8_slice_key(nt, lane % 4, e % 2);
  }
};

// The score columns' keys of a 16-bit slice (ldmatrix's order) and of a float8 one.
template <bool Kv_fp8>
struct SliceKeyColumns {
  using type = MmaKeyColumns;
};
template <>
struct SliceKeyColumns<true> {
  using type = Fp8KeyColumns;
};

// O's column of element e of d-tile dt in the fp8 path's order.
template <int kHeadDim>
CF_DEVICE int fp8_o_column(int dt, int lane, int e) {
  return (2 * (lane % 4) + e % 2) * (kHeadDim / 8) + dt;
}

// P = exp2(..) <= 1 goes into fp16 times 2^15 (<= 32768): fp16's 10-bit mantissa then reaches
// probabilities down to 2^-39 of the row's largest (unscaled, fp16 would round those below 2^-14
// and drop those below 2^-25, which a long row of small weights adds up). O is unscaled once.
constexpr float kFp8PScale = 32768.f;

// Q's fp16 fragments in the fp8 path's column order, from the CTA's 16-bit Q tile at s_q: r_q[mt]
// [ds] = columns (p, p + 1) of rows g and g + 8, then (p + 2, p + 3) of both (m16n8k16's a0..a3).
// fp16 q is taken as it is. bf16 q is multiplied by one power of two 2^e for the CTA's rows,
// with 2^e max|q| in [2^14, 2^15): every element above 2^-38 max|q| is then exact in fp16 (which
// has 3 more mantissa bits than bf16), and those below weigh less in a score than its fp32
// rounding. Returns 2^-e (1 for fp16), by which the scores are multiplied back. (Every warp
// loads every fragment, so the warp's max is the CTA's; a NaN element stays NaN.)
template <typename Traits>
CF_DEVICE float fp8_q_fragments(uint32_t (&r_q)[Traits::kMTiles][Traits::kDSteps][4], uint32_t s_q,
                                int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
    for (int ds = 0; ds < Traits::kDSteps; ++ds)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = 64 * (ds / 4) + 16 * t + 4 * (ds % 4);
        const int row = 16 * mt + g + 8 * half;
        const uint2 v = ld_shared_b64(s_q + (Traits::Tile::offset(row, col / 8) + col % 8) * 2);
        r_q[mt][ds][half] = v.x;
        r_q[mt][ds][2 + half] = v.y;
      }
  if constexpr (Traits::Ops::kIsFp16) {
    return 1.f;
  } else {
    const auto element = [](uint32_t word, int i) {
      return __uint_as_float(i == 0 ? word << 16 : word & 0xffff0000u);
    };
    // The max over finite elements: an infinity (or NaN) stays one after the scaling, and must
    // not leave the other rows' finite elements unscaled (above fp16's 65504: infinite).
    const auto finite_abs = [](float x) { return fabsf(x) < -neg_infinity() ? fabsf(x) : 0.f; };
    float amax = 0.f;
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
      for (int ds = 0; ds < Traits::kDSteps; ++ds)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          amax = fmaxf(amax, fmaxf(finite_abs(element(r_q[mt][ds][i], 0)),
                                   finite_abs(element(r_q[mt][ds][i], 1))));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    int e = 0;  // (every element 0 or not finite: q converts as it is)
    if (amax > 0.f) {
      const int exponent = static_cast<int>((__float_as_uint(amax) >> 23) & 0xff) - 127;
      e = min(max(14 - exponent, -126), 126);
    }
    const float scale = pow2(e);
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
      for (int ds = 0; ds < Traits::kDSteps; ++ds)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t word = r_q[mt][ds][i];
          r_q[mt][ds][i] =
              ElementTraits<__half>::pack2(element(word, 0) * scale, element(word, 1) * scale);
        }
    return pow2(-e);
  }
}

// The A operand of k-step ds: from registers, or (not Q_in_regs) from the fragment-ordered copy
// at s_qf, one 16-byte load per lane (consecutive lanes, no bank conflict).
template <typename Traits>
CF_DEVICE void fp8_q_operand(uint32_t (&a)[4],
                             const uint32_t (&r_q)[Traits::kMTiles][Traits::kDSteps][4],
                             uint32_t s_qf, int mt, int ds, int lane) {
  if constexpr (Traits::Q_in_regs) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = r_q[mt][ds][i];
  } else {
    const uint4 v = ld_shared_b128(s_qf + ((mt * Traits::kDSteps + ds) * 32 + lane) * 16);
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
  }
}

// S = Q K^T over a float8 slice of keys at s_k (scores in Fp8KeyColumns order, times the 2^e of
// fp8_q_fragments).
template <typename Traits, __nv_fp8_interpretation_t kFormat>
CF_DEVICE void gemm_qk_fp8(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                           const uint32_t (&r_q)[Traits::kMTiles][Traits::kDSteps][4],
                           uint32_t s_qf, uint32_t s_k, int lane) {
  constexpr int kChunks = Traits::kHeadDim / 64;  // 16-byte loads per row and lane
  zero_fill(s);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < Traits::kNTiles; ++nt) {
    const int key = fp8_slice_key(nt, g / 2, g % 2);  // B's column n = g
    uint4 bytes[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
      bytes[c] = ld_shared_b128(s_k + fp8_chunk_offset<Traits::kHeadDim>(key, 4 * c + t));
#pragma unroll
    for (int ds = 0; ds < Traits::kDSteps; ++ds) {
      const uint4& chunk = bytes[ds / 4];
      const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
      uint32_t b0, b1;
      Fp8Widen<kFormat>::apply(words[ds % 4], b0, b1);
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
        uint32_t a[4];
        fp8_q_operand<Traits>(a, r_q, s_qf, mt, ds, lane);
        ElementTraits<__half>::mma_16816(s[mt][nt], a, b0, b1);
      }
    }
  }
}

// O += P V over a float8 slice of values at s_v (O's columns in fp8_o_column order, times
// kFp8PScale).
template <typename Traits, __nv_fp8_interpretation_t kFormat>
CF_DEVICE void gemm_pv_fp8(float (&o)[Traits::kMTiles][Traits::kDTiles][4],
                           const float (&p)[Traits::kMTiles][Traits::kNTiles][4], uint32_t s_v,
                           int lane) {
  constexpr int kWords = Traits::kHeadDim / 32;  // a lane's 4-byte words of one row: 4 or 2
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < Traits::kNSteps; ++ks) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float* pair = &p[mt][2 * ks + i / 2][2 * (i % 2)];
        a[mt][i] = ElementTraits<__half>::pack2(pair[0] * kFp8PScale, pair[1] * kFp8PScale);
      }
    uint32_t rows[4][kWords];  // keys 16 ks + 4t + i, columns g d / 8 ..
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = 16 * ks + 4 * t + i;
      if constexpr (Traits::kHeadDim == 128) {
        const uint4 v = ld_shared_b128(s_v + fp8_chunk_offset<128>(key, g));
        rows[i][0] = v.x, rows[i][1] = v.y, rows[i][2] = v.z, rows[i][3] = v.w;
      } else {
        const uint2 v = ld_shared_b64(s_v + fp8_chunk_offset<64>(key, g / 2) + 8 * (g % 2));
        rows[i][0] = v.x, rows[i][1] = v.y;
      }
    }
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      uint32_t b[4][2];  // d tiles 4 w .. 4 w + 3: {b0, b1}
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {  // rows 4t, 4t + 1 -> b0; 4t + 2, 4t + 3 -> b1
        const uint32_t x = rows[2 * pair][w], y = rows[2 * pair + 1][w];
        // (x_k y_k x_k+1 y_k+1): d tiles k and k + 1
        Fp8Widen<kFormat>::apply(__byte_perm(x, y, 0x5140), b[0][pair], b[1][pair]);
        Fp8Widen<kFormat>::apply(__byte_perm(x, y, 0x7362), b[2][pair], b[3][pair]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int mt = 0; mt < Traits::kMTiles; ++mt)
          ElementTraits<__half>::mma_16816(o[mt][4 * w + k], a[mt], b[k][0], b[k][1]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Merge of partial states (the split-KV combine, and merge_states).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim_, typename PartElement_, typename OutElement_>
struct MergeTraits {
  using PartElement = PartElement_;
  using OutElement = OutElement_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kSmemBytes = 0;
};

// merge_states and the combine of partials in [parts, ...] layouts: one warp per output row
// (b, i, h), h fastest.
template <typename Traits>
CF_DEVICE void decode_merge(const MergeParams& p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * Traits::kNWarps + threadIdx.x / 32;
  if (row >= static_cast<int64_t>(p.batch) * p.seqlen_q * p.heads) return;
  const int head = static_cast<int>(row % p.heads);
  const int query = static_cast<int>((row / p.heads) % p.seqlen_q);
  const int batch = static_cast<int>(row / (static_cast<int64_t>(p.heads) * p.seqlen_q));
  const auto* g_o = static_cast<const typename Traits::PartElement*>(p.o_parts_ptr) +
                    batch * p.o_batch_stride + query * p.o_row_stride + head * p.o_head_stride;
  const float* g_lse =
      p.lse_parts_ptr + batch * p.lse_batch_stride + head * p.lse_head_stride + query;
  auto* g_out = static_cast<typename Traits::OutElement*>(p.o_ptr) + batch * p.out_batch_stride +
                query * p.out_row_stride + head * p.out_head_stride;
  float* g_out_lse = p.lse_ptr == nullptr ? nullptr
                                          : p.lse_ptr + batch * p.out_lse_batch_stride +
                                                head * p.out_lse_head_stride + query;
  merge_row<Traits::kHeadDim>(g_o, p.o_part_stride, g_lse, p.lse_part_stride, p.num_parts, g_out,
                              g_out_lse, lane);
}

// The splits whose partials a sequence of seqlen_k keys merges, in split order: every split of
// the launch, or (Batch_invariant) the ceil(seqlen_k / split) that hold its keys -- a function of
// its own length and the fixed split size alone (at least one: an empty or bad sequence still
// writes its rows).
template <typename Traits>
CF_DEVICE int sequence_splits(const DecodeParams& params, int seqlen_k) {
  if constexpr (Traits::Batch_invariant) {
    const int blocks = ceil_div(seqlen_k, Traits::kBlockN);
    return min(params.num_splits, max(1, ceil_div(blocks, params.blocks_per_split)));
  } else {
    return params.num_splits;
  }
}

// The drafts query token `query` of sequence `batch` sees, as a word: bit j set iff its row of
// the caller's bool tree mask holds a nonzero byte at column j (seqlen_q <= the word's bits
// bytes, read once per CTA: a bit test per score where a byte load per score would sit in the
// masked slices).
template <typename Word>
CF_DEVICE Word tree_row_word(const DecodeParams& p, int batch, int query) {
  const unsigned char* row =
      p.tree_mask + batch * p.tree_mask_batch_stride + query * p.tree_mask_row_stride;
  Word word = 0;
  for (int j = 0; j < p.attn.seqlen_q; ++j) word |= static_cast<Word>(row[j] != 0) << j;
  return word;
}

// What one CTA of decode_partial computes: split `split` of the keys, for packed rows [row0, row0
// + kBlockM) of KV head head_k of sequence `batch` -- or (Is_cascade, prefix >= 0) split `split`
// of prefix `prefix`'s keys, for the rows of its requests batch .. batch + requests - 1.
struct DecodeWork {
  int batch, head_k, split, row0, prefix, requests;
};

// The grid of an Is_cascade launch is one axis, the KV head fastest: first the prefixes' CTAs,
// split-major (the row blocks of one split read the same pages at the same time: from HBM once,
// then from L2) -- they are the long ones, so they start first -- then each request's num_splits
// CTAs over its own keys. Otherwise the grid is (num_splits x m-blocks, Hkv, B).
template <typename Traits>
CF_DEVICE DecodeWork decode_work(const DecodeParams& p) {
  if constexpr (Traits::Is_cascade) {
    const int head_k = blockIdx.x % p.attn.h_k;
    const int index = blockIdx.x / p.attn.h_k;
    const int prefix_ctas = p.prefix_splits * p.num_prefix_blocks;
    if (index < prefix_ctas) {
      const int32_t* block = p.prefix_rows + 3 * (index % p.num_prefix_blocks);
      return {block[1], head_k, index / p.num_prefix_blocks, 0, block[0], block[2] - block[1]};
    }
    const int own = index - prefix_ctas;
    return {own / p.num_splits, head_k, own % p.num_splits, 0, -1, 1};
  } else {
    const int m_blocks = gridDim.x / p.num_splits;  // (each split's m-blocks)
    return {static_cast<int>(blockIdx.z),
            static_cast<int>(blockIdx.y),
            static_cast<int>(blockIdx.x / m_blocks),
            static_cast<int>((blockIdx.x % m_blocks) * Traits::kBlockM),
            -1,
            1};
  }
}

// Packed row `packed` of a CTA whose first sequence is `batch`: (sequence, query token, query
// head). A sequence's rows are (token, head of the group) pairs, token-major; an Is_cascade
// prefix CTA's run over its requests, request-major.
struct PackedRow {
  int batch, query, head;
};
template <typename Traits>
CF_DEVICE PackedRow packed_row(int packed, int batch, int head_k, int group, int seqlen_q) {
  if constexpr (Traits::Is_cascade) {
    const int per_request = group * seqlen_q;
    const int within = packed % per_request;
    return {batch + packed / per_request, within / group, head_k * group + within % group};
  } else {
    return {batch, packed / group, head_k * group + packed % group};
  }
}

// Fused combine, after a CTA has written its partials (rows [row0, row_end) of `work`). The
// fence orders this CTA's partial writes before its ticket (the last-block pattern): the CTA
// that draws ticket num_splits - 1 finds every split's partial in L2, and merges them in split
// order. Is_cascade: a CTA takes a ticket for each request whose rows it holds (a prefix CTA,
// several), on that request's counter, which expects its num_splits and its prefix's
// prefix_splits; the CTA that draws a request's last merges that request's rows.
template <typename Traits>
CF_DEVICE void merge_when_last(const DecodeParams& params, const DecodeWork& work, int row_end,
                               int seqlen_k) {
  using Element = typename Traits::Element;
  const AttnParams& attn = params.attn;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int batch = work.batch;
  const int head_k = work.head_k;
  const int group = attn.h_h_k_ratio;
  const int seqlen_q = attn.seqlen_q;
  constexpr int kMostRequests = Traits::Wgmma_prefix ? Traits::kPrefixRows : Traits::kBlockM;
  __shared__ int s_is_last;
  __shared__ bool s_last_of[Traits::Is_cascade ? kMostRequests : 1];  // per request of the CTA
  __threadfence();
  __syncthreads();
  if constexpr (Traits::Is_cascade) {
    bool last = false;
    if (tid < work.requests) {
      int32_t* counter =
          params.split_counters + static_cast<int64_t>(batch + tid) * attn.h_k + head_k;
      last = atomicAdd(counter, 1) == params.num_splits + params.prefix_splits - 1;
      if (last) *counter = 0;  // every split has drawn: ready for the next call on this stream
      s_last_of[tid] = last;
    }
    if (!__syncthreads_or(last)) return;
  } else {
    if (tid == 0) {
      const int m_blocks = gridDim.x / params.num_splits;
      const int64_t group_index = static_cast<int64_t>(batch) * gridDim.y + head_k;
      int32_t* counter = params.split_counters + group_index * m_blocks + blockIdx.x % m_blocks;
      const bool last = atomicAdd(counter, 1) == sequence_splits<Traits>(params, seqlen_k) - 1;
      if (last) *counter = 0;  // every split has drawn: ready for the next call on this stream
      s_is_last = last;
    }
    __syncthreads();
    if (!s_is_last) return;
  }
  __threadfence();
  const int64_t part_rows = static_cast<int64_t>(attn.batch) * attn.h * seqlen_q;
  const int rows = group * seqlen_q * work.requests;  // packed rows of this KV head
  row_end = min(row_end, rows);
#pragma unroll 1
  for (int packed = work.row0 + warp; packed < row_end; packed += Traits::kNWarps) {
    if constexpr (Traits::Is_cascade) {
      if (!s_last_of[packed / (group * seqlen_q)]) continue;  // another CTA merges that request
    }
    const PackedRow at = packed_row<Traits>(packed, batch, head_k, group, seqlen_q);
    const int query = at.query;
    const int head = at.head;
    const int64_t row_index = (static_cast<int64_t>(at.batch) * attn.h + head) * seqlen_q + query;
    Element* g_o = static_cast<Element*>(attn.o_ptr) + at.batch * attn.o_batch_stride +
                   query * attn.o_row_stride + head * attn.o_head_stride;
    float* g_lse = attn.lse_ptr == nullptr ? nullptr
                                           : attn.lse_ptr + at.batch * attn.lse_batch_stride +
                                                 head * attn.lse_head_stride + query;
    const int parts = Traits::Is_cascade ? params.num_splits + params.prefix_splits
                                         : sequence_splits<Traits>(params, seqlen_k);
    merge_row<Traits::kHeadDim, Traits::Columns::kValidDim>(
        params.o_partial_ptr + row_index * Traits::kHeadDim, part_rows * Traits::kHeadDim,
        params.lse_partial_ptr + row_index, part_rows, parts, g_o, g_lse, lane,
        attn.sinks == nullptr ? neg_infinity() : attn.sinks[head]);
  }
}

// ---------------------------------------------------------------------------------------------
// The cascade's prefix CTAs on Hopper (Wgmma_prefix). A prefix row block is many requests' rows
// against the same keys: a prefill, not a decode. On the mma.sync path each warp holds all the
// block's rows (32 at d = 128: 128 fp32 registers of O a thread), so a CTA runs 8 warps and
// reads Q and every K/V slice from shared memory per 16 keys, and the block is compute-bound
// far below the tensor cores' rate. Here the 128 rows of up to 128 / (group x Nq) requests are
// two warpgroups' wgmma M (64 rows each, O 64 registers a thread) over shared 128-key tiles:
//   all 256 threads copy K/V tile j + 1 (cp.async into the 128-byte swizzle wgmma reads; the
//   tile's block-table entries read one tile earlier) while each warpgroup computes
//   S = Q K_j^T (wgmma, A and B from shared memory), the softmax in registers (the m16n8 layout
//   of the mma.sync path: the same OnlineSoftmax), and O += P V_j (wgmma, P from registers, V
//   read MN-major);
//   one CTA barrier a tile publishes its copies (after fence.proxy.async: wgmma reads through the
//   async proxy) and frees the other stage.
// Each thread then writes its O rows' fp32 partial and LSE in the prefix's slot, and the CTA
// takes its requests' tickets as the mma.sync path does (merge_when_last).
// ---------------------------------------------------------------------------------------------
// A K/V tile's copy: thread t takes 16-byte chunk t % (d / 8) of rows t / (d / 8) + i x rows a
// pass (kPrefixPasses of them). The block-table entries of those rows are read a tile ahead
// (prefix_tile_pages), so a tile's copies wait on no table read: a copy that read its row's entry
// first held each step to a chain of dependent L2 round trips.
//
// The table entries of tile key0's rows this thread copies (0 past the prefix: never used).
template <typename Traits>
CF_DEVICE void prefix_tile_pages(int (&entry)[Traits::kPrefixPasses], const int32_t* pages,
                                 int page_size_log2, int key0, int seqlen_k, int tid) {
  const int row0 = tid / (Traits::kHeadDim / 8);
#pragma unroll
  for (int i = 0; i < Traits::kPrefixPasses; ++i) {
    const int key = key0 + row0 + i * Traits::kPrefixRowStep;
    entry[i] = key < seqlen_k ? __ldg(pages + (key >> page_size_log2)) : 0;
  }
}

// One cache's rows of tile key0 into the swizzled tile at s_tile (zeros past the prefix); true if
// an entry in use lies outside the pool (a row of page 0 is read instead: the rows are NaN anyway).
template <typename Traits>
CF_DEVICE bool prefix_tile_copy(uint32_t s_tile, const CacheRows<typename Traits::Element>& cache,
                                const int (&entry)[Traits::kPrefixPasses], int key0, int seqlen_k,
                                int tid) {
  const int row0 = tid / (Traits::kHeadDim / 8);
  const int col = (tid % (Traits::kHeadDim / 8)) * 8;
  bool bad = false;
#pragma unroll
  for (int i = 0; i < Traits::kPrefixPasses; ++i) {
    const int r = row0 + i * Traits::kPrefixRowStep;
    const int key = key0 + r;
    const bool valid = key < seqlen_k;
    const bool outside = cache.outside_pool(entry[i]);
    bad |= valid && outside;
    const auto* src = cache.paged_row(outside ? 0 : entry[i], key) + col;
    cp_async_16(s_tile + swizzled_offset<Traits::kPrefixKeys>(r, col), valid ? src : cache.base,
                valid);
  }
  return bad;
}

template <typename Traits>
CF_DEVICE void prefix_partial_wgmma(const DecodeParams& params, const DecodeWork& work,
                                    const unsigned char* smem_raw) {
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kPrefixRows;
  constexpr int kKeys = Traits::kPrefixKeys;
  constexpr int kStages = Traits::kPrefixStages;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kTileBytes = Traits::kPrefixTileBytes;
  const AttnParams& attn = params.attn;
  const uint32_t s_q = swizzle_aligned_base(smem_raw);  // [d / 64][kRows][64], swizzled
  const uint32_t s_ring = s_q + kRows * kHeadDim * 2;   // [kStages][K, V] tiles, alike
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warpgroup = warp / 4;
  const int group = attn.h_h_k_ratio;
  const int seqlen_q = attn.seqlen_q;
  const int rows = group * seqlen_q * work.requests;  // packed rows (request-major), <= kRows
  const CacheSpan span = prefix_span(params, work.prefix);
  const int seqlen_k = span.cached;
  const int n_begin = work.split * params.prefix_blocks_per_split;
  const int n_end = min(n_begin + params.prefix_blocks_per_split, ceil_div(seqlen_k, kKeys));
  __shared__ int s_bad_page;  // did a thread read a page through a bad block-table entry?
  if (tid == 0) s_bad_page = 0;

  // Q: packed row r of the block (zeros past its rows).
  const Element* g_q = static_cast<const Element*>(attn.q_ptr);
#pragma unroll 1
  for (int i = tid; i < kRows * kChunksPerRow; i += Traits::kNThreads) {
    const int r = i / kChunksPerRow;
    const int col = (i % kChunksPerRow) * 8;
    const Element* src = g_q;
    if (r < rows) {
      const PackedRow at = packed_row<Traits>(r, work.batch, work.head_k, group, seqlen_q);
      src += at.batch * attn.q_batch_stride + at.query * attn.q_row_stride +
             at.head * attn.q_head_stride + col;
    }
    cp_async_16(s_q + swizzled_offset<kRows>(r, col), src, r < rows);
  }
  __syncthreads();  // (s_bad_page)
  const CacheRows<Element> k_rows =
      prefix_rows<Element>(params, attn.k_ptr, attn.k_batch_stride, attn.k_row_stride,
                           attn.k_head_stride, work.head_k, work.prefix);
  const CacheRows<Element> v_rows =
      prefix_rows<Element>(params, attn.v_ptr, attn.v_batch_stride, attn.v_row_stride,
                           attn.v_head_stride, work.head_k, work.prefix);
  // K and V share the prefix's table row: one entry serves both copies of a row.
  int entry[Traits::kPrefixPasses];
  bool bad_page = false;
  auto read_pages = [&](int n_block) {
    prefix_tile_pages<Traits>(entry, k_rows.pages, k_rows.page_size_log2, n_block * kKeys, seqlen_k,
                              tid);
  };
  auto load_kv = [&](int n_block, int stage) {  // (the entries of n_block read before)
    const uint32_t s_k = s_ring + stage * 2 * kTileBytes;
    bad_page |= prefix_tile_copy<Traits>(s_k, k_rows, entry, n_block * kKeys, seqlen_k, tid);
    bad_page |=
        prefix_tile_copy<Traits>(s_k + kTileBytes, v_rows, entry, n_block * kKeys, seqlen_k, tid);
  };
  // Prologue: Q with the first tile, then the next kStages - 2, one commit group each; then the
  // entries of the tile the first step copies.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (n_begin + s < n_end) {
      read_pages(n_begin + s);
      load_kv(n_begin + s, s);
    }
    cp_async_commit();
  }
  if (n_begin + kStages - 1 < n_end) read_pages(n_begin + kStages - 1);

  using MmaQK = Wgmma<kKeys, Element>;
  using MmaPV = Wgmma<kHeadDim, Element>;
  float acc_o[1][kHeadDim / 8][4];
  zero_fill(acc_o);
  OnlineSoftmax<1> softmax;
  const float scale_log2 = attn.softmax_scale_log2;
  const typename Traits::Transform transform(attn);
  // This warpgroup's 64 rows of Q: k-step ks reads 32 bytes of d into the 128-byte rows of
  // column block ks / 4.
  const uint64_t desc_q0 = wgmma_desc(s_q + warpgroup * 64 * kSwizzleRowBytes, 0);
  for (int it = 0, n_block = n_begin; n_block < n_end; ++it, ++n_block) {
    cp_async_wait<kStages - 2>();  // this thread's copies of tile `it` have landed
    fence_proxy_async_shared();    // ... visible to wgmma's reads
    __syncthreads();               // ... and every thread's; tile it - 1's stage is free
    if (n_block + kStages - 1 < n_end) load_kv(n_block + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();
    if (n_block + kStages < n_end) read_pages(n_block + kStages);  // (under this step's wgmma)
    const uint32_t s_k = s_ring + (it % kStages) * 2 * kTileBytes;

    float s[1][kKeys / 8][4];
    const uint64_t desc_k0 = wgmma_desc(s_k, 0);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t col_bytes = (ks % 4) * 32;
      MmaQK::ss(s[0], wgmma_desc_advance(desc_q0, (ks / 4) * kRows * kSwizzleRowBytes + col_bytes),
                wgmma_desc_advance(desc_k0, (ks / 4) * kKeys * kSwizzleRowBytes + col_bytes),
                ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s[0]);

    // Every key of a prefix is visible to every row: only those past its end are masked.
    const int key0 = n_block * kKeys;
    transform_scores(transform, s, /*row0=*/0, key0, lane);
    if (key0 + kKeys > seqlen_k) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + MmaKeyColumns{}(nt, lane, e) >= seqlen_k) s[0][nt][e] = neg_infinity();
    }
    float rescale[2];
    softmax.update_max(s, scale_log2, rescale);
    rescale_rows_if_moved(acc_o, rescale);
    softmax.exp_accumulate(s, scale_log2, rescale);
    uint32_t p[kKeys / 16][4];
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks) p_operand<typename Traits::Ops>(p[ks], s[0], ks);

    // O += P V: k-step ks takes keys 16 ks .. 16 ks + 15 (two 8-row atoms of every column
    // block); d's column blocks are kKeys rows apart.
    const uint64_t desc_v0 = wgmma_desc(s_k + kTileBytes, kKeys * kSwizzleRowBytes);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKeys / 16; ++ks)
      MmaPV::rs_bt(acc_o[0], p[ks], wgmma_desc_advance(desc_v0, ks * 2 * kSwizzleAtomBytes), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(acc_o[0]);
  }
  if (bad_page) s_bad_page = 1;
  cp_async_wait<0>();
  __syncthreads();  // (s_bad_page)

  // This thread's rows (warp w holds rows 16 w .. 16 w + 15 of the block): the normalised
  // partial and its LSE in the prefix's slot num_splits + split.
  float inv_sum[2], lse[2];
  softmax.finalize(scale_log2, inv_sum, lse);
  scale_rows(acc_o, inv_sum);
  const bool bad = span.bad() || s_bad_page != 0;  // the block's rows are NaN
  if (tid == 0 && bad) report_error(params, (s_bad_page != 0 ? kBadPage : 0) | span.error_bits());
  const int slot = params.num_splits + work.split;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 16 * warp + lane / 4 + 8 * half;
    if (r >= rows) continue;
    const PackedRow at = packed_row<Traits>(r, work.batch, work.head_k, group, seqlen_q);
    const int64_t row_index =
        ((static_cast<int64_t>(slot) * attn.batch + at.batch) * attn.h + at.head) * seqlen_q +
        at.query;
    float* g_o = params.o_partial_ptr + row_index * kHeadDim + 2 * (lane % 4);
#pragma unroll
    for (int dt = 0; dt < kHeadDim / 8; ++dt) {
      const float2 o = bad ? make_float2(quiet_nan(), quiet_nan())
                           : make_float2(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
      *reinterpret_cast<float2*>(g_o + 8 * dt) = o;
    }
    if (lane % 4 == 0) params.lse_partial_ptr[row_index] = bad ? quiet_nan() : lse[half];
  }
}

template <typename Traits>
CF_DEVICE void decode_partial(const DecodeParams& params) {
  using Element = typename Traits::Element;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kStages = Traits::kStages;
  constexpr int kWarpKeys = Traits::kWarpKeys;
  constexpr int kBlockN = Traits::kBlockN;
  const AttnParams& attn = params.attn;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t s_q = smem_addr(smem_raw);           // [kBlockM][d] packed query rows
  const uint32_t s_ring = s_q + Traits::kSmemQBytes;  // per warp: [kStages][K, V][kWarpKeys][d]
  float* s_merge = reinterpret_cast<float*>(smem_raw + Traits::kSmemQBytes);  // after the loop

  const DecodeWork work = decode_work<Traits>(params);
  if constexpr (Traits::Wgmma_prefix) {
    if (work.prefix >= 0) {
      prefix_partial_wgmma<Traits>(params, work, smem_raw);
      merge_when_last<Traits>(params, work, Traits::kPrefixRows, 0);
      return;
    }
  }
  const int split = work.split;
  const int row0 = work.row0;  // first packed row of the CTA
  const int head_k = work.head_k;
  const int batch = work.batch;
  const int prefix = work.prefix;  // (-1: a sequence's own keys; always unless Is_cascade)
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int group = attn.h_h_k_ratio;
  const int seqlen_q = attn.seqlen_q;
  const int rows = group * seqlen_q * work.requests;  // packed rows of this KV head

  // Device values (see the file comment). A prefix's keys are all visible to every row (the
  // host checks that each request has >= Nq - 1 keys of its own): the mask sees no query
  // token before them (mask_seqlen_q = 0 puts the causal edge past the prefix's last key).
  const CacheSpan span = prefix >= 0 ? prefix_span(params, prefix) : decode_span(params, batch);
  const int seqlen_k = prefix >= 0 ? span.cached : decode_seqlen_k(params, span);
  const int mask_seqlen_q = prefix >= 0 ? 0 : seqlen_q;
  const int per_split = prefix >= 0 ? params.prefix_blocks_per_split : params.blocks_per_split;
  if constexpr (Traits::Batch_invariant) {
    // past this sequence's keys: not among its splits
    if (split >= sequence_splits<Traits>(params, seqlen_k)) return;
  }
  // Per warp: did it read a page through a bad block-table entry? (Each warp sets only its own.)
  __shared__ int s_bad_page[Traits::kNWarps];
  // A window's left edge: the key blocks before the first key any row of the CTA sees (that of
  // its first query token) are skipped.
  int n_begin = split * per_split;
  if constexpr (Traits::Is_local) {
    const int key_begin = row0 / group + (seqlen_k - seqlen_q) - attn.window_left;
    n_begin = max(n_begin, max(key_begin, 0) / kBlockN);
  }
  const int n_end = min((split + 1) * per_split, ceil_div(seqlen_k, kBlockN));
  // This warp's slices: keys [n * kBlockN + warp * kWarpKeys, + kWarpKeys) for n in [n_begin, w_end).
  const int warp_key0 = warp * kWarpKeys;
  const int w_end = seqlen_k > warp_key0 ? min(n_end, ceil_div(seqlen_k - warp_key0, kBlockN)) : 0;

  // Q: packed row r is token (row0 + r) / group of query head head_k * group + (row0 + r) % group
  // (Is_cascade: of request batch + (row0 + r) / (group x Nq), packed_row).
  const Element* g_q = static_cast<const Element*>(attn.q_ptr) + batch * attn.q_batch_stride +
                       (head_k * group) * attn.q_head_stride;
  struct {
    const Element* g_q;
    int64_t row_stride, head_stride, batch_stride;
    int row0, group, rows, seqlen_q;
    CF_DEVICE const Element* operator()(int r) const {
      const int packed = row0 + r;
      if (packed >= rows) return nullptr;
      if constexpr (Traits::Is_cascade) {
        const PackedRow at = packed_row<Traits>(packed, 0, 0, group, seqlen_q);
        return g_q + at.batch * batch_stride + at.query * row_stride + at.head * head_stride;
      }
      return g_q + (packed / group) * row_stride + (packed % group) * head_stride;
    }
    CF_DEVICE const Element* fallback() const { return g_q; }
  } q_rows{g_q,  attn.q_row_stride, attn.q_head_stride, attn.q_batch_stride, row0, group,
           rows, seqlen_q};
  if (lane == 0) s_bad_page[warp] = 0;
  __syncwarp();
  // A tree's words of the CTA's packed rows (padding rows see no draft; published by the
  // barrier after the Q load).
  using TreeWord = typename Traits::TreeWord;
  __shared__ TreeWord s_tree_rows[Traits::Is_tree ? Traits::kBlockM : 1];
  if constexpr (Traits::Is_tree) {
    if (tid < Traits::kBlockM)
      s_tree_rows[tid] = row0 + tid < rows
                             ? tree_row_word<TreeWord>(params, batch, (row0 + tid) / group)
                             : TreeWord(0);
  }
  load_rows_async<Traits, Traits::kBlockM, Traits::kNThreads>(s_q, q_rows, tid);
  cp_async_commit();

  using CacheElement = typename Traits::CacheElement;
  const CacheRows<CacheElement> k_rows =
      prefix >= 0
          ? prefix_rows<CacheElement>(params, attn.k_ptr, attn.k_batch_stride, attn.k_row_stride,
                                      attn.k_head_stride, head_k, prefix)
          : cache_rows<CacheElement>(params, attn.k_ptr, attn.k_batch_stride, attn.k_row_stride,
                                     attn.k_head_stride, batch, head_k, span.entry, span.first_key);
  const CacheRows<CacheElement> v_rows =
      prefix >= 0
          ? prefix_rows<CacheElement>(params, attn.v_ptr, attn.v_batch_stride, attn.v_row_stride,
                                      attn.v_head_stride, head_k, prefix)
          : cache_rows<CacheElement>(params, attn.v_ptr, attn.v_batch_stride, attn.v_row_stride,
                                     attn.v_head_stride, batch, head_k, span.entry, span.first_key);
  const uint32_t s_warp_ring = s_ring + warp * Traits::kWarpRingBytes;
  auto load_kv = [&](int n_block, int stage) {
    const int key0 = n_block * kBlockN + warp_key0;
    const uint32_t s_k = s_warp_ring + stage * 2 * Traits::kStageBytes;
    load_slice_async<Traits>(s_k, k_rows, key0, seqlen_k, lane, &s_bad_page[warp]);
    load_slice_async<Traits>(s_k + Traits::kStageBytes, v_rows, key0, seqlen_k, lane,
                             &s_bad_page[warp]);
  };

  // Ring prologue: the first kStages - 1 slices of this warp, one commit group each.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (n_begin + s < w_end) load_kv(n_begin + s, s);
    cp_async_commit();
  }
  cp_async_wait<kStages - 1>();  // this thread's Q chunks have landed
  __syncthreads();               // ... and every other thread's

  uint32_t r_q[kMTiles][Traits::kDSteps][4];  // Q fragments; optimised away unless Q_in_regs
  float q_unscale = 1.f;                      // fp8: 2^-e of fp8_q_fragments
  if constexpr (Traits::Kv_fp8) {
    q_unscale = fp8_q_fragments<Traits>(r_q, s_q, lane);
    if constexpr (!Traits::Q_in_regs) {  // the fragment-ordered copy replaces the 16-bit tile
      __syncthreads();                   // (every warp has read it)
      if (warp == 0) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int ds = 0; ds < Traits::kDSteps; ++ds) {
            const uint32_t (&a)[4] = r_q[mt][ds];
            st_shared_b128(s_q + ((mt * Traits::kDSteps + ds) * 32 + lane) * 16,
                           make_uint4(a[0], a[1], a[2], a[3]));
          }
      }
      __syncthreads();
    }
  } else if constexpr (Traits::Q_in_regs) {
#pragma unroll
    for (int ds = 0; ds < Traits::kDSteps; ++ds) {
      uint32_t a[kMTiles][4];
      load_q_frag<Traits>(a, s_q, 0, ds, lane);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) r_q[mt][ds][i] = a[mt][i];
    }
  }

  float acc_o[kMTiles][Traits::kDTiles][4];
  zero_fill(acc_o);
  OnlineSoftmax<kMTiles> softmax;
  float scale_log2 = attn.softmax_scale_log2;
  // A float8 cache's scales, applied in fp32 (fp8.cuh): K's multiplies the scores -- folded into
  // the softmax's multiplier (kept >= the host's 1e-30 floor, _plan.ZERO_SCALE_SURROGATE), or,
  // with softcap, the raw scores before the cap -- and V's the normalised output.
  // The scales wait in shared memory, read where they are used: held in registers across the
  // loop, the d = 64, 64-row tile with softcap spilled 4 bytes (sm_90a, NVRTC 13.0.88).
  __shared__ float2 s_kv_scale;
  if constexpr (Traits::Kv_fp8) {
    const float2 kv_scale = kv_scales(params, head_k);
    if (tid == 0) s_kv_scale = kv_scale;
    // A device k_scale is read as given: 0 gives the uniform softmax of zero keys (the host's
    // floor), a positive one the floored product; a negative, NaN or infinite one, which this
    // multiplier cannot stand for, makes every score NaN -- not a plausible answer.
    if constexpr (!Traits::Has_softcap) {
      const float k_scale = kv_scale.x;
      scale_log2 = k_scale == 0.f                       ? 1e-30f
                   : k_scale > 0.f && isfinite(k_scale) ? fmaxf(scale_log2 * k_scale, 1e-30f)
                                                        : quiet_nan();
    }
    __syncthreads();  // (s_kv_scale)
  }
  const PackedRowMask<Traits::Is_causal, Traits::Is_local, Traits::Is_tree, Traits::Wide_tree> mask(
      row0, min(row0 + Traits::kBlockM, rows), group, mask_seqlen_q, seqlen_k, attn.window_left,
      attn.window_right, Traits::Is_tree ? smem_addr(s_tree_rows) : 0u);
  const typename Traits::Transform transform(attn);

  // A step's softmax over the scores of the warp's slice: the transform, the mask (the keys in
  // the score columns' order), the online update.
  using KeyColumns = typename SliceKeyColumns<Traits::Kv_fp8>::type;
  // (transform_scores assumes MmaKeyColumns; the decode transform, softcap, reads no key.)
  auto softmax_step = [&](float (&acc_s)[kMTiles][Traits::kNTiles][4], int key0) {
    transform_scores(transform, acc_s, /*row0=*/0, key0, lane);  // packed rows: no query row yet
    if (mask.needs_mask(key0, key0 + kWarpKeys - 1)) mask.apply(acc_s, key0, lane, KeyColumns{});
    float rescale[2 * kMTiles];
    softmax.update_max(acc_s, scale_log2, rescale);
    rescale_rows_if_moved(acc_o, rescale);
    softmax.exp_accumulate(acc_s, scale_log2, rescale);
  };
  // A float8 slice: the scores of bf16 q multiplied back to q . k (and by K's scale before a
  // softcap).
  const bool e5m2 = params.kv_fp8 == kKvE5M2;  // (else e4m3)
  auto fp8_step = [&](uint32_t s_k, int key0) {
    if constexpr (Traits::Kv_fp8) {  // (a lambda of every variant: its body only of these)
      float acc_s[kMTiles][Traits::kNTiles][4];
      if (e5m2) {
        gemm_qk_fp8<Traits, __NV_E5M2>(acc_s, r_q, s_q, s_k, lane);
      } else {
        gemm_qk_fp8<Traits, __NV_E4M3>(acc_s, r_q, s_q, s_k, lane);
      }
      if constexpr (!Traits::Ops::kIsFp16 || Traits::Has_softcap) {
        float unscale = q_unscale;  // 1 for fp16 q
        if constexpr (Traits::Has_softcap)
          unscale *= __uint_as_float(ld_shared_b32(smem_addr(&s_kv_scale.x)));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < Traits::kNTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] *= unscale;
      }
      softmax_step(acc_s, key0);
      const uint32_t s_v = s_k + Traits::kStageBytes;
      if (e5m2) {
        gemm_pv_fp8<Traits, __NV_E5M2>(acc_o, acc_s, s_v, lane);
      } else {
        gemm_pv_fp8<Traits, __NV_E4M3>(acc_o, acc_s, s_v, lane);
      }
    }
  };

  for (int it = 0, n_block = n_begin; n_block < w_end; ++it, ++n_block) {
    // Slice it has landed (each lane waits for its own copies; __syncwarp publishes them to
    // the warp). The stage refilled below was last read by this warp's previous step.
    cp_async_wait<kStages - 2>();
    __syncwarp();
    if (n_block + kStages - 1 < w_end) load_kv(n_block + kStages - 1, (it + kStages - 1) % kStages);
    cp_async_commit();

    const uint32_t s_k = s_warp_ring + (it % kStages) * 2 * Traits::kStageBytes;
    const int key0 = n_block * kBlockN + warp_key0;
    if constexpr (Traits::Kv_fp8) {
      fp8_step(s_k, key0);
    } else {
      float acc_s[kMTiles][Traits::kNTiles][4];
      gemm_qk<Traits>(acc_s, r_q, s_q, s_k, 0, lane);
      softmax_step(acc_s, key0);
      gemm_pv<Traits>(acc_o, acc_s, s_k + Traits::kStageBytes, lane);
    }
  }
  // Epilogue 1: each warp normalises its own partial (O_w, LSE_w) and parks it in shared memory.
  float inv_sum[2 * kMTiles], lse[2 * kMTiles];
  softmax.finalize(scale_log2, inv_sum, lse);
  // One split makes its rows' final O and LSE in this CTA: a sink joins warp 0's partial (the
  // merge over the warps below then counts it once). Split rows take it in the merge of splits.
  if (!Traits::Is_cascade && warp == 0 && attn.sinks != nullptr &&
      sequence_splits<Traits>(params, seqlen_k) == 1) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) {
      const int packed = row0 + 16 * (r / 2) + lane / 4 + 8 * (r % 2);
      add_sink(attn.sinks[head_k * group + packed % group], inv_sum[r], lse[r]);
    }
  }
  if constexpr (Traits::Kv_fp8) {
    // V's scale and 2^-15 of P's fp16 copy (the merge is linear in O)
    const float v_unscale = s_kv_scale.y * (1.f / kFp8PScale);
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) inv_sum[r] *= v_unscale;
  }
  scale_rows(acc_o, inv_sum);
  cp_async_wait<0>();
  // Every warp is done with its ring (the merge buffer overlays it); and did any read a page
  // through a bad block-table entry?
  __syncthreads();
  bool bad_page = false;
#pragma unroll
  for (int w = 0; w < Traits::kNWarps; ++w) bad_page |= s_bad_page[w] != 0;
  const bool bad = span.bad() || bad_page;  // the CTA's rows are NaN, not a plausible answer
  if (tid == 0 && bad) report_error(params, (bad_page ? kBadPage : 0) | span.error_bits());
  constexpr int kRowFloats = Traits::kMergeRowFloats;
  float* s_o = s_merge + warp * Traits::kBlockM * kRowFloats;               // [kBlockM][d + 8]
  float* s_lse = s_merge + Traits::kNWarps * Traits::kBlockM * kRowFloats;  // [kNWarps][kBlockM]
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * mt + lane / 4 + 8 * half;
#pragma unroll
      for (int dt = 0; dt < Traits::kDTiles; ++dt) {
        if constexpr (Traits::Kv_fp8) {  // O's columns in the fp8 path's order
#pragma unroll
          for (int e = 0; e < 2; ++e)
            s_o[row * kRowFloats + fp8_o_column<Traits::kHeadDim>(dt, lane, e)] =
                acc_o[mt][dt][2 * half + e];
        } else {
          *reinterpret_cast<float2*>(s_o + row * kRowFloats + 8 * dt + 2 * (lane % 4)) =
              make_float2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]);
        }
      }
      if (lane % 4 == 0) s_lse[warp * Traits::kBlockM + row] = lse[2 * mt + half];
    }
  __syncthreads();

  // Epilogue 2: merge the warps' partials (verb 4) and write the CTA's rows, 4 columns a thread:
  // the final output when there is one split, else this split's fp32 partial (Is_cascade: always
  // a partial, in slot `split` of a request's own keys, or num_splits + `split` of its prefix's).
  constexpr int kQuads = Traits::kHeadDim / 4;
  // (sequence_splits at each use: a value held across the loop cost the default variants registers)
  const bool single = !Traits::Is_cascade && sequence_splits<Traits>(params, seqlen_k) == 1;
  const int slot = prefix >= 0 ? params.num_splits + split : split;
#pragma unroll 1
  for (int idx = tid; idx < Traits::kBlockM * kQuads; idx += Traits::kNThreads) {
    const int row = idx / kQuads;
    const int col = (idx % kQuads) * 4;
    const int packed = row0 + row;
    if (packed >= rows) continue;
    float part_lse[Traits::kNWarps], weight[Traits::kNWarps];
#pragma unroll
    for (int w = 0; w < Traits::kNWarps; ++w) part_lse[w] = s_lse[w * Traits::kBlockM + row];
    float row_lse = merge_weights(part_lse, weight);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < Traits::kNWarps; ++w) {
      if (weight[w] == 0.f) continue;  // an empty warp's O is 0 anyway; skip its reads
      const float4 part = *reinterpret_cast<const float4*>(
          s_merge + (w * Traits::kBlockM + row) * kRowFloats + col);
      o.x += weight[w] * part.x;
      o.y += weight[w] * part.y;
      o.z += weight[w] * part.z;
      o.w += weight[w] * part.w;
    }
    if (bad) {  // (a NaN partial also makes the splits' merge NaN)
      o = make_float4(quiet_nan(), quiet_nan(), quiet_nan(), quiet_nan());
      row_lse = quiet_nan();
    }
    const PackedRow at = packed_row<Traits>(packed, batch, head_k, group, seqlen_q);
    const int query = at.query;
    const int head = at.head;
    if (single) {
      Element* g_o = static_cast<Element*>(attn.o_ptr) + batch * attn.o_batch_stride +
                     query * attn.o_row_stride + head * attn.o_head_stride + col;
      const uint2 packed_o = make_uint2(Traits::Ops::pack2(o.x, o.y), Traits::Ops::pack2(o.z, o.w));
      using Columns = typename Traits::Columns;
      if constexpr (Columns::kWholeChunks) {
        if (Columns::kFull || col < Columns::kValidDim) *reinterpret_cast<uint2*>(g_o) = packed_o;
      } else {  // 2-byte aligned rows: the caller's columns of the four, one by one
        const int count = min(max(Columns::kValidDim - col, 0), 4);
        st_global_elements(g_o, make_uint4(packed_o.x, packed_o.y, 0u, 0u), count);
      }
      if (col == 0 && attn.lse_ptr != nullptr) {
        attn.lse_ptr[batch * attn.lse_batch_stride + head * attn.lse_head_stride + query] = row_lse;
      }
    } else {
      const int64_t row_index =
          ((static_cast<int64_t>(slot) * attn.batch + at.batch) * attn.h + head) * seqlen_q + query;
      *reinterpret_cast<float4*>(params.o_partial_ptr + row_index * Traits::kHeadDim + col) = o;
      if (col == 0) params.lse_partial_ptr[row_index] = row_lse;
    }
  }
  if (single) return;

  merge_when_last<Traits>(params, work, row0 + Traits::kBlockM, seqlen_k);
}

// ---------------------------------------------------------------------------------------------
// Append: k_new / v_new token t of sequence b goes to cache position cache_seqlens[b] + t. A bad
// length appends nothing; a bad block-table entry for the position writes nothing through it
// (both reported in error_flags; the attention's rows of that sequence are NaN).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim_, typename Element_, bool Kv_fp8_ = false>
struct AppendTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  // A float8 cache: each element quantised as it is written (quantise_fp8x2, fp8.cuh).
  static constexpr bool Kv_fp8 = Kv_fp8_;
  using CacheElement = typename CacheElementOf<Element, Kv_fp8>::type;
  static_assert(!Kv_fp8 || kHeadDim % 8 == 0, "float8 rows are whole 8-byte chunks");
  static constexpr int kNThreads = 32;
  static constexpr int kSmemBytes = 0;
};

// Row x (the caller's head_dim columns) rotated at position pos into y (rotary embedding, as
// RoFormer and flash-attn): pair (a, b) = (2i, 2i + 1) when interleaved, else (i, i + R), for
// i < R = rotary_half, with c, s = rotary_cos[pos, i], rotary_sin[pos, i]:
//   y_a = x_a c - x_b s,   y_b = x_a s + x_b c   (fp32, one rounding); columns >= 2R copied.
// One warp per row, element by element (a few rows per call: the loads are not the cost).
// store(j, value) writes y_j, rounded to q's type (a float8 cache quantises that value).
template <typename Element, typename Store>
CF_DEVICE void rotate_row(const Store& store, const Element* x, int head_dim, const DecodeParams& p,
                          int pos, int lane) {
  const int half = p.rotary_half;
  const auto* cos_row =
      static_cast<const Element*>(p.rotary_cos) + static_cast<int64_t>(pos) * half;
  const auto* sin_row =
      static_cast<const Element*>(p.rotary_sin) + static_cast<int64_t>(pos) * half;
  for (int i = lane; i < half; i += 32) {
    const int a = p.rotary_interleaved ? 2 * i : i;
    const int b = p.rotary_interleaved ? 2 * i + 1 : i + half;
    const float xa = to_float(x[a]), xb = to_float(x[b]);
    const float c = to_float(cos_row[i]), s = to_float(sin_row[i]);
    store(a, from_float<Element>(xa * c - xb * s));
    store(b, from_float<Element>(xa * s + xb * c));
  }
  for (int j = 2 * half + lane; j < head_dim; j += 32) store(j, x[j]);
}

// rotate_row's store into a row of q's type.
template <typename Element>
struct StoreElements {
  Element* y;
  CF_DEVICE void operator()(int j, Element value) const { y[j] = value; }
};

// rotate_row's store into a float8 cache row: value / scale, rounded and saturated.
template <typename Element>
struct StoreFp8 {
  unsigned char* y;
  float scale;
  int32_t format;
  CF_DEVICE void operator()(int j, Element value) const {
    y[j] = quantise_fp8(to_float(value), scale, format);
  }
};

// A sequence whose rotated keys or queries would sit past the rotary tables (flash-attn's may be
// shorter than the cache; it reads past them): nothing appended (kBadRotaryPosition reported)
// and its queries NaN, so that its rows are NaN, not a plausible answer.
CF_DEVICE bool rotary_refused(const DecodeParams& p, const CacheSpan& span) {
  return !span.bad() && span.cached > p.rotary_max_cached;
}

// q rotated into the contiguous temporary attn.q_ptr [B, Nq, Hq, d] the attention reads: grid
// (Nq, Hq, B), one warp per row. A sequence with a bad span (decode_span) is rotated at
// position 0 (its attention rows are NaN whatever q holds; the row is still written whole).
template <typename Traits>
CF_DEVICE void decode_rotary_q(const DecodeParams& p) {
  using Element = typename Traits::Element;
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const AttnParams& a = p.attn;
  const CacheSpan span = decode_span(p, batch);
  const int pos = span.bad() ? 0 : span.cached + (p.rotary_q_per_token ? token : 0);
  const auto* src = static_cast<const Element*>(p.q_src_ptr) + batch * p.q_src_batch_stride +
                    token * p.q_src_row_stride + head * p.q_src_head_stride;
  auto* dst = const_cast<Element*>(static_cast<const Element*>(a.q_ptr)) +
              batch * a.q_batch_stride + token * a.q_row_stride + head * a.q_head_stride;
  if (rotary_refused(p, span)) {
    for (int j = threadIdx.x; j < Traits::kHeadDim; j += 32)
      dst[j] = from_float<Element>(quiet_nan());
    return;
  }
  rotate_row(StoreElements<Element>{dst}, src, Traits::kHeadDim, p, pos, threadIdx.x);
}

// A k_new / v_new row into a cache of q's type, as it is (k_new rotated first).
template <typename Traits>
CF_DEVICE void append_row(typename Traits::Element* k_dst, typename Traits::Element* v_dst,
                          const typename Traits::Element* k_src,
                          const typename Traits::Element* v_src, const DecodeParams& p, int pos) {
  using Element = typename Traits::Element;
  if (p.rotary_half > 0) {  // k_new rotated at its position as it is written; v_new as it is
    rotate_row(StoreElements<Element>{k_dst}, k_src, Traits::kHeadDim, p, pos, threadIdx.x);
    for (int i = threadIdx.x; i < Traits::kHeadDim; i += Traits::kNThreads) v_dst[i] = v_src[i];
    return;
  }
  if constexpr (Traits::kHeadDim % 8 == 0) {
    for (int chunk = threadIdx.x; chunk < Traits::kHeadDim / 8; chunk += Traits::kNThreads) {
      reinterpret_cast<uint4*>(k_dst)[chunk] = reinterpret_cast<const uint4*>(k_src)[chunk];
      reinterpret_cast<uint4*>(v_dst)[chunk] = reinterpret_cast<const uint4*>(v_src)[chunk];
    }
  } else {  // rows 2-byte aligned only (see TileColumns): element by element
    using Bits = unsigned short;
    for (int i = threadIdx.x; i < Traits::kHeadDim; i += Traits::kNThreads) {
      reinterpret_cast<Bits*>(k_dst)[i] = reinterpret_cast<const Bits*>(k_src)[i];
      reinterpret_cast<Bits*>(v_dst)[i] = reinterpret_cast<const Bits*>(v_src)[i];
    }
  }
}

// A k_new / v_new row into a float8 cache, quantised with its KV head's scales (k_new rotated
// first, rounded to q's type, as a 16-bit cache would hold it): 8 elements per lane and step, one
// 8-byte store.
template <typename Traits>
CF_DEVICE void append_fp8_row(unsigned char* k_dst, unsigned char* v_dst,
                              const typename Traits::Element* k_src,
                              const typename Traits::Element* v_src, const DecodeParams& p,
                              int head_k, int pos) {
  using Element = typename Traits::Element;
  const float2 scale = kv_scales(p, head_k);
  const int format = p.kv_fp8;
  const bool rotate = p.rotary_half > 0;
  if (rotate)
    rotate_row(StoreFp8<Element>{k_dst, scale.x, format}, k_src, Traits::kHeadDim, p, pos,
               threadIdx.x);
  for (int chunk = threadIdx.x; chunk < Traits::kHeadDim / 8; chunk += Traits::kNThreads) {
    for (int kv = rotate ? 1 : 0; kv < 2; ++kv) {
      const uint4 x = reinterpret_cast<const uint4*>(kv == 0 ? k_src : v_src)[chunk];
      const float s = kv == 0 ? scale.x : scale.y;
      const uint32_t w[4] = {x.x, x.y, x.z, x.w};
      uint32_t q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const Element* pair = reinterpret_cast<const Element*>(&w[i]);
        q[i] = quantise_fp8x2(to_float(pair[0]), to_float(pair[1]), s, format);
      }
      reinterpret_cast<uint2*>(kv == 0 ? k_dst : v_dst)[chunk] =
          make_uint2(q[0] | (q[1] << 16), q[2] | (q[3] << 16));
    }
  }
}

template <typename Traits>
CF_DEVICE void decode_append(const DecodeParams& p) {
  using Element = typename Traits::Element;
  using CacheElement = typename Traits::CacheElement;
  const int token = blockIdx.x;
  const int head_k = blockIdx.y;
  const int batch = blockIdx.z;
  const bool reporter = threadIdx.x == 0 && head_k == 0;  // one report per (token, sequence)
  int bad_page = 0;
  const CacheSpan span = decode_span(p, batch);
  const int pos = span.cached + token;  // of the entry (the first key does not move it)
  const bool refused = p.rotary_half > 0 && rotary_refused(p, span);
  if (span.bad() || pos >= p.cache_capacity || refused) {
    if (reporter && token == 0)
      report_error(p, span.bad() ? span.error_bits() : refused ? kBadRotaryPosition : kBadSeqlen);
    return;
  }
  const AttnParams& a = p.attn;
  const CacheRows<CacheElement> k_rows = cache_rows<CacheElement>(
      p, a.k_ptr, a.k_batch_stride, a.k_row_stride, a.k_head_stride, batch, head_k, span.entry, 0);
  const CacheRows<CacheElement> v_rows = cache_rows<CacheElement>(
      p, a.v_ptr, a.v_batch_stride, a.v_row_stride, a.v_head_stride, batch, head_k, span.entry, 0);
  const auto* k_src = static_cast<const Element*>(p.k_new_ptr) + batch * p.k_new_batch_stride +
                      token * p.k_new_row_stride + head_k * p.k_new_head_stride;
  const auto* v_src = static_cast<const Element*>(p.v_new_ptr) + batch * p.v_new_batch_stride +
                      token * p.v_new_row_stride + head_k * p.v_new_head_stride;
  CacheElement* k_dst = k_rows.row(pos, &bad_page);
  CacheElement* v_dst = v_rows.row(pos, &bad_page);
  if (bad_page) {
    if (reporter) report_error(p, kBadPage);
    return;
  }
  if constexpr (Traits::Kv_fp8) {
    append_fp8_row<Traits>(k_dst, v_dst, k_src, v_src, p, head_k, pos);
  } else {
    append_row<Traits>(k_dst, v_dst, k_src, v_src, p, pos);
  }
}
