// FlashAttention-2 backward (Dao, 2023, Algorithm 2) on mma.sync tensor cores: three kernels
// over one BwdParams, launched in order on one stream.
//
//   fa2_bwd_prep   per query row: D = rowsum(dO * O) - dLSE, the saved LSE as -LSE * log2 e,
//                  dQacc = 0 (dLSE: d LSE_i / d s_ij = P_ij, so an LSE gradient enters as -D)
//   fa2_bwd        per key block (grid: key blocks, B, Hkv), for every query head of the group
//                  and every query block that sees the keys:
//                    dP^T = V dO^T,  S^T = K Q^T                       (the keys are the M rows)
//                    P^T  = exp2(logit(S^T) * scale_log2 - LSE log2 e) (P recomputed, nothing N^2)
//                    dS^T = P^T * (dP^T - D)  (* (1 - tanh^2) with softcap)
//                    dV  += P^T dO,  dK += dS^T Q                      (registers, whole loop)
//                    dQacc += dS K                                     (fp32 atomics in L2)
//   fa2_bwd_dq     per query row: dQ = dQacc * dq_scale in the element type
//   (dropout: the forward's mask M regenerated from the seed, kernels_cu/dropout.cuh; with
//    r = dropout_scale, dV += (P * M)^T dO r and dS = P * (dP * M r - D); D = rowsum(dO * O) still)
//   (deterministic: fa2_bwd without its dQ part, then fa2_bwd_dq_blocks, no atomics; below)
//
// Warp w of the main kernel owns keys 16 w .. 16 w + 15 of the block for the first five
// products, so P^T and dS^T go from the score accumulators straight into the A operand of
// dV and dK (as P does in the forward's P V); dS^T is staged once through shared memory for
// dQ, whose reduction runs over all the block's keys. GQA: the CTA of a KV head loops over its
// group's query heads, so dK and dV are summed in registers, with no per-query-head copy.
//
// Scale (see _plan.plan_backward): the kernel differentiates with respect to the raw score
// s = q . k. With logit(s) = s the softmax multiplier is |scale| on (-q when scale < 0) and
// dK = dk_scale dS^T Q with dk_scale = |scale|; with softcap, d logit / ds = scale (1 - t^2)
// with t = tanh(s scale / softcap), so dk_scale = scale. dQ = scale dS K in both cases.
#pragma once

#include "attn_mask.cuh"  // the mask's block summary, run before the kernels
#include "common.cuh"
#include "dropout.cuh"
#include "dq_tiles.cuh"  // the Hopper backward's dQacc layout, read by fa2_bwd_dq
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tile_mma.cuh"
#include "variants.cuh"

// The largest divisor of n that is at most limit.
CF_DEVICE constexpr int largest_divisor_upto(int n, int limit) {
  for (int c = limit; c > 1; --c)
    if (n % c == 0) return c;
  return 1;
}

// ---------------------------------------------------------------------------------------------
// The per-row kernels: a row's 16-byte chunks on consecutive lanes, as many rows per warp as fit
// (a row of 8 chunks at d = 64 would leave 24 lanes idle: issue-bound at half the bandwidth).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim_, typename Element_, int kValidDim_ = 0>
struct BwdRowTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Columns = TileColumns<kHeadDim_, kValidDim_>;  // dQ's accumulator is kHeadDim wide
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks of a row
  // kChunks a power of two: 32 / kChunks rows per warp, their lanes aligned groups (the dot
  // product's xor shuffles stay in the row); else one row per warp. dq: rows in pairs (below).
  static constexpr bool kPow2Chunks = (kChunks & (kChunks - 1)) == 0;
  static constexpr int kRowsPerWarp = kPow2Chunks ? 32 / kChunks : 1;
  static constexpr int kLanesPerRow = kPow2Chunks ? kChunks : 32;
  static constexpr int kSmemBytes = 0;
  static_assert(kHeadDim % 8 == 0 && kChunks <= 32, "one chunk per lane at most");
};

// This lane's row (prep: grid (ceil(rows / (4 kRowsPerWarp)), B or 1 when varlen, Hq); rows =
// seqlen_q, the padded rows when dq_tiled, the packed total when varlen) and its chunk.
template <typename Traits>
CF_DEVICE int bwd_lane_row(int* chunk) {
  const int lane = threadIdx.x % 32;
  *chunk = lane % Traits::kLanesPerRow;
  return (blockIdx.x * Traits::kNWarps + threadIdx.x / 32) * Traits::kRowsPerWarp +
         lane / Traits::kLanesPerRow;
}

// Row r of query head h, batch b (blockIdx.y, z) in the per-row temporaries.
CF_DEVICE int64_t bwd_temp_row(const BwdParams& p, int row) {
  return blockIdx.y * p.row_batch_stride + blockIdx.z * p.row_head_stride + row;
}

// Where a lane's row of the per-row kernels lies: its temporary row t, the input's row `row`
// (of its batch entry, or of the packed tensors), its row in its sequence's tiles `seq_row`, and
// whether it is a sequence's row (`real`; else a padding row of the temporaries). The grid's rows
// are the input's rows, except for packed sequences in the Hopper backward's tiles
// (kDqTilesPacked): there they are a head's temporary rows, each found in its sequence by
// dq_seq_of_temp_row.
struct BwdRowPlace {
  int64_t t;
  int row, seq_row, seq_len;  // (a padded batch: seq_row = row, seq_len = seqlen_q)
  bool real;
};
CF_DEVICE BwdRowPlace bwd_row_place(const BwdParams& p, int grid_row) {
  const AttnParams& a = p.attn;
  if (p.dq_tiled != kDqTilesPacked)
    return {bwd_temp_row(p, grid_row), grid_row, grid_row, a.seqlen_q, grid_row < a.seqlen_q};
  const DqSeqRow s = dq_seq_of_temp_row(a.cu_seqlens_q, a.batch, a.seqlen_q, grid_row);
  const bool real = grid_row < p.row_head_stride && s.seq_row >= 0 && s.seq_row < s.len;
  return {bwd_temp_row(p, grid_row), s.start + s.seq_row, s.seq_row, s.len, real};
}

// The kHeadDim floats of dQacc at row t (row-major or tiled: the same addresses) set to 0, by the
// row's lanes (chunk = its lane in the row).
template <typename Traits>
CF_DEVICE void zero_accumulator_row(const BwdParams& p, int64_t t, int chunk) {
  if (p.dq_accum == nullptr) return;  // deterministic: dQ has no accumulator
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + t * Traits::kHeadDim);
  for (int i = chunk; i < Traits::kHeadDim / 4; i += Traits::kLanesPerRow)
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

template <typename Traits>
CF_DEVICE void fa2_bwd_prep(const BwdParams& p) {
  using Element = typename Traits::Element;
  const AttnParams& a = p.attn;
  // Packed sequences: the first CTA checks every sequence's offsets and seqused_k and reports
  // the bad ones (the key-block kernel skips a bad sequence without a word: its registers), and
  // where the key-block grid covers max_seqlen_k keys (grid_keys), a sequence with more.
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
      (a.cu_seqlens_q != nullptr || a.seqused_k != nullptr)) {
    int32_t bits = 0;
    for (int b = threadIdx.x; b < a.batch; b += Traits::kNThreads) {
      const SeqRows rows = seq_rows(a, b);
      bits |= rows.error_bits;
      if (p.grid_keys > 0 && rows.k.len > p.grid_keys) bits |= kBadSeqlen;
    }
    report_error(a, bits);
  }
  int chunk;
  const int grid_row = bwd_lane_row<Traits>(&chunk);
  const BwdRowPlace place = bwd_row_place(p, grid_row);
  const int64_t t = place.t;
  const int row = place.row;
  const bool real = place.real;
  const int b = blockIdx.y, h = blockIdx.z;
  float dot = 0.f;
  if (real && chunk < Traits::Columns::kChunks) {
    const auto* g_o = static_cast<const Element*>(a.o_ptr) + b * a.o_batch_stride +
                      row * a.o_row_stride + h * a.o_head_stride;
    const auto* g_do = static_cast<const Element*>(p.do_ptr) + b * p.do_batch_stride +
                       row * p.do_row_stride + h * p.do_head_stride;
    const uint4 o = ld_global_chunk<typename Traits::Columns>(g_o, chunk);
    const uint4 d = ld_global_chunk<typename Traits::Columns>(g_do, chunk);
    const Element* oe = reinterpret_cast<const Element*>(&o);
    const Element* de = reinterpret_cast<const Element*>(&d);
#pragma unroll
    for (int i = 0; i < 8; ++i) dot += to_float(oe[i]) * to_float(de[i]);
  }
#pragma unroll
  for (int offset = Traits::kLanesPerRow / 2; offset > 0; offset /= 2)
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (!real) {
    // The Hopper backward's tiles: a padding row's floats belong to the tile (the grid covers
    // row_head_stride rows), zeroed for the tile's other rows.
    if (p.dq_tiled && grid_row < p.row_head_stride) zero_accumulator_row<Traits>(p, t, chunk);
    if (p.dsink_rows != nullptr && chunk == 0 && grid_row < p.row_head_stride)
      p.dsink_rows[t] = 0.f;
    // and its -LSE log2 e and D: -inf and 0, so that a step's rows can be copied whole (the
    // Hopper backward's Rows_by_producer) and a padding row's P^T and dS^T come out 0
    if (p.dq_tiled && chunk == 0 && grid_row < p.row_head_stride) {
      p.neg_lse_log2[t] = neg_infinity();
      p.dsum[t] = 0.f;
    }
    return;
  }
  if (chunk == 0) {
    const float lse = a.lse_ptr[b * a.lse_batch_stride + h * a.lse_head_stride + row];
    if (p.dlse_ptr != nullptr)
      dot -= p.dlse_ptr[b * p.dlse_batch_stride + h * p.dlse_head_stride + row];
    p.dsum[t] = dot;
    // dLoss / dsink = sum over rows of -P_sink * D, P_sink = exp(sink - LSE): the sink's logit
    // enters O only through the denominator (and LSE, through dLSE, which D holds).
    // (LSE = -inf: a packed row outside every sequence, or a sink of -inf; no share.)
    if (p.dsink_rows != nullptr)
      p.dsink_rows[t] = lse == neg_infinity() ? 0.f : -expf(a.sinks[h] - lse) * dot;
    p.neg_lse_log2[t] = lse == neg_infinity() ? neg_infinity() : -lse * kLog2e;
    // The deterministic Hopper backward's count of adds into this row's tile (tiles start at
    // a sequence's rows that are multiples of 64, all inside it).
    if (p.dq_semaphore != nullptr && place.seq_row % kDqTileRows == 0)
      p.dq_semaphore[t / kDqTileRows] = 0;
  }
  zero_accumulator_row<Traits>(p, t, chunk);  // (fa2_bwd_dq makes a NaN-LSE row's dQ NaN)
}

// dQ from the 80-row steps' tiles (kDqTilesSwapped; d = 128, a padded batch), on dq's grid: a
// lane per row and 16 columns (the grid's lanes: rows x d / 16). Lanes 0-7 of a group of 8 take
// rows 8 j .. 8 j + 7 of a 16-column group: the 8 fragments each reads are 64 contiguous bytes
// for the 8 (two lanes a float4: rows 2 i, 2 i + 1), and a row's 16 columns 32 bytes of dQ.
template <typename Traits>
CF_DEVICE void fa2_bwd_dq_swapped(const BwdParams& p) {
  using Element = typename Traits::Element;
  constexpr int kGroups = Traits::kHeadDim / 16;  // 16-column groups a row
  static_assert(Traits::kHeadDim == 2 * kDqPartCols, "the 80-row steps are d = 128's");
  const int lane_index = (blockIdx.x * Traits::kNWarps + threadIdx.x / 32) * 32 + threadIdx.x % 32;
  const int row = lane_index / (8 * kGroups) * 8 + lane_index % 8;
  const int group = lane_index / 8 % kGroups;
  if (row >= p.attn.seqlen_q) return;
  const int64_t t = bwd_temp_row(p, row);
  const int r = row % kDqSwappedRows;  // in its tile
  const float* tile = p.dq_accum + (t - r) * Traits::kHeadDim;
  float lo[8], hi[8];  // columns 16 group + k and + 8 + k
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(tile + dq_swapped_float4(r, group, k)));
    lo[k] = r % 2 ? f.y : f.x;
    hi[k] = r % 2 ? f.w : f.z;
  }
  // (a NaN LSE: NaN dQ, as fa2_bwd_dq's)
  const float s = is_nan(p.neg_lse_log2[t]) ? quiet_nan() : p.dq_scale;
  uint4 out[2];
  uint32_t* words = reinterpret_cast<uint32_t*>(out);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    words[k] = Traits::Ops::pack2(lo[2 * k] * s, lo[2 * k + 1] * s);
    words[4 + k] = Traits::Ops::pack2(hi[2 * k] * s, hi[2 * k + 1] * s);
  }
  auto* g_dq = static_cast<Element*>(p.dq_ptr) + blockIdx.y * p.dq_batch_stride +
               row * p.dq_row_stride + blockIdx.z * p.dq_head_stride + 16 * group;
  reinterpret_cast<uint4*>(g_dq)[0] = out[0];
  reinterpret_cast<uint4*>(g_dq)[1] = out[1];
}

// Grid (ceil(pairs / (4 kRowsPerWarp)), B or 1, Hq), pairs = 8 ceil(rows / 16): each lane takes
// one chunk of two rows, r and r + 8 of a 16-row block. In the Hopper backward's tiles those are
// the two rows of each fragment (dq_tiles.cuh): the chunk's 8 columns of both rows are 64
// contiguous bytes (four fragments of consecutive threads), read whole.
template <typename Traits>
CF_DEVICE void fa2_bwd_dq(const BwdParams& p) {
  using Element = typename Traits::Element;
  if constexpr (Traits::kHeadDim == 2 * kDqPartCols && Traits::Columns::kFull) {
    if (p.dq_tiled == kDqTilesSwapped) return fa2_bwd_dq_swapped<Traits>(p);
  }
  int chunk;
  const int pair = bwd_lane_row<Traits>(&chunk);
  // rows row0, row0 + 8 of the grid (of one 16-row block, so of one sequence's tile)
  const BwdRowPlace place = bwd_row_place(p, 16 * (pair / 8) + pair % 8);
  if (!place.real || chunk >= Traits::Columns::kChunks) return;
  const int row0 = place.row;  // the input's
  const int64_t t0 = place.t;
  const bool second = place.seq_row + 8 < place.seq_len;
  float4 lo[2], hi[2];  // columns 8 chunk .. + 3 and + 4 .. + 7 of rows row0, row0 + 8
  if (p.dq_tiled) {
    const int r = place.seq_row % kDqTileRows;
    const float4* frag = reinterpret_cast<const float4*>(p.dq_accum + (t0 - r) * Traits::kHeadDim +
                                                         dq_tile_pair(r, 8 * chunk));
    float4 f[4];  // threads 4 (r % 8) + i of the fragment: column pairs 2 i, 2 i + 1
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = frag[i];
    lo[0] = make_float4(f[0].x, f[0].y, f[1].x, f[1].y);
    hi[0] = make_float4(f[2].x, f[2].y, f[3].x, f[3].y);
    lo[1] = make_float4(f[0].z, f[0].w, f[1].z, f[1].w);
    hi[1] = make_float4(f[2].z, f[2].w, f[3].z, f[3].w);
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (k == 1 && !second) break;
      const float4* acc =
          reinterpret_cast<const float4*>(p.dq_accum + (t0 + 8 * k) * Traits::kHeadDim) + 2 * chunk;
      lo[k] = acc[0];
      hi[k] = acc[1];
    }
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    if (k == 1 && !second) break;
    // A row whose LSE is NaN gets NaN dQ, in either layout: its P is NaN, so its dQ is NaN
    // already where a key block added into it, and a row no key block visits (a bad sequence's,
    // NaN from the forward; a given LSE's NaN at a row that sees no key) is made NaN here.
    const float s = is_nan(p.neg_lse_log2[t0 + 8 * k]) ? quiet_nan() : p.dq_scale;
    uint4 out;
    out.x = Traits::Ops::pack2(lo[k].x * s, lo[k].y * s);
    out.y = Traits::Ops::pack2(lo[k].z * s, lo[k].w * s);
    out.z = Traits::Ops::pack2(hi[k].x * s, hi[k].y * s);
    out.w = Traits::Ops::pack2(hi[k].z * s, hi[k].w * s);
    auto* g_dq = static_cast<Element*>(p.dq_ptr) + blockIdx.y * p.dq_batch_stride +
                 (row0 + 8 * k) * p.dq_row_stride + blockIdx.z * p.dq_head_stride;
    if constexpr (Traits::Columns::kFull) {
      *reinterpret_cast<uint4*>(g_dq + 8 * chunk) = out;
    } else {
      st_global_chunk<typename Traits::Columns>(g_dq, chunk, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The main kernel.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_, bool Is_causal_,
          bool Is_local_, bool Has_softcap_, bool Dq_atomic_ = true, int kDSplit_ = 1,
          bool Has_dropout_ = false, bool Has_alibi_ = false, int kValidDim_ = 0, int kBias_ = 0>
struct Fa2BwdTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Tile = SwizzledTile<kHeadDim_>;  // K, V, Q, dO: [rows][d]
  using Columns = TileColumns<kHeadDim_, kValidDim_>;
  using DsTile = SwizzledTile<kBlockM_>;  // dS^T: [keys][query rows]

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  // Warps that share 16 keys: 1, or 2 for d = 192, 256, where one warp's dK and dV rows over the
  // whole d (2 * 16 * d / 32 floats per thread) would not fit in registers. With 2, each warp
  // computes S^T and dP^T for half the query rows, P^T and dS^T meet in shared memory, and each
  // warp accumulates dK and dV for half of d.
  static constexpr int kDSplit = kDSplit_;
  static constexpr int kKeyWarps = kBlockN / 16;
  static constexpr int kNWarps = kDSplit * kKeyWarps;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  // dQ accumulated here with atomics; false: fa2_bwd_dq_blocks computes it (deterministic).
  static constexpr bool Dq_atomic = Dq_atomic_;
  static constexpr bool Has_dropout = Has_dropout_;
  static constexpr int kBias = kBias_;  // an attn_mask (kAdditiveBias, kBoolBias), kUserMods
  // An attn_mask tensor has a block summary (mask_cells); a user mask_mod has one where the call
  // has a BlockMask (mask_cells non-null).
  static constexpr bool Has_mask_tensor = kBias_ == kAdditiveBias || kBias_ == kBoolBias;
  // A user score_mod: dS times its derivative at the raw score (kept beside the logits).
  static constexpr bool Has_user_mods = kBias_ == kUserMods;
  static constexpr bool Has_cells = Has_mask_tensor || Has_user_mods;
  using Transform = ScoreTransform<Has_softcap, Has_alibi_, kBias_, Element_>;

  // The shape names of tile_mma.cuh for a warp's products with 16 key rows: M = keys (one
  // 16-row tile), N = the warp's query rows (S^T, dP^T), K-steps over d; then M = keys,
  // K-steps over query rows, N = d (dV, dK).
  static constexpr int kPhaseRows = kBlockM / kDSplit;  // query rows of a warp's S^T, dP^T
  static constexpr int kMTiles = 1;
  static constexpr int kNTiles = kPhaseRows / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kAccCols = kHeadDim / kDSplit;  // columns of a warp's dK, dV
  static constexpr int kAccDTiles = kAccCols / 8;
  static constexpr int kDSteps = kHeadDim / 16;
  static constexpr int kNSteps = kBlockM / 16;
  static constexpr bool Q_in_regs = false;
  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));

  // dQ = dS K: warps tile the [kBlockM][d] block, rows first, columns in 16-wide pairs (warps
  // past kDqRowWarps * kDqColWarps sit the product out: small d with few query rows).
  static constexpr int kDqRowWarps = kBlockM / 16 < kNWarps ? kBlockM / 16 : kNWarps;
  static constexpr int kDqColWarps = largest_divisor_upto(kHeadDim / 16, kNWarps / kDqRowWarps);
  static constexpr int kDqMTiles = kBlockM / 16 / kDqRowWarps;
  static constexpr int kDqCols = kHeadDim / kDqColWarps;

  static constexpr int kSmemKVElems = kBlockN * kHeadDim;
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  // K, V; Q and dO double-buffered; dS^T (and P^T when split); -LSE log2 e and D, double-buffered.
  static constexpr int kSmemBytes =
      (2 * kSmemKVElems + 4 * kSmemQElems + (kDSplit > 1 ? 2 : 1) * kBlockN * kBlockM) *
          kElemBytes +
      2 * 2 * kBlockM * 4;

  static_assert(kBlockN % 16 == 0 && kBlockM % 32 == 0 && kHeadDim % 32 == 0, "tile shapes");
  static_assert(kBlockM % (16 * kDqRowWarps) == 0 && kHeadDim % (16 * kDqColWarps) == 0,
                "dQ warp grid");
  static_assert(kDqCols % 16 == 0, "dQ columns come in 16-wide ldmatrix pairs");
  static_assert(kNThreads >= 2 * kBlockM, "one thread per row of LSE and of D");
  static_assert(kDSplit == 1 || (kDSplit == 2 && kPhaseRows % 16 == 0 && kAccCols % 16 == 0),
                "a split halves the query rows of S^T and the columns of dK, dV");
};

template <typename Traits>
CF_DEVICE void fa2_bwd(const BwdParams& p) {
  using Element = typename Traits::Element;
  using Tile = typename Traits::Tile;
  using DsTile = typename Traits::DsTile;
  using Ops = typename Traits::Ops;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kEB = Traits::kElemBytes;
  const AttnParams& a = p.attn;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t s_k = smem_addr(smem_raw);                    // [kBlockN][d], then dK
  const uint32_t s_v = s_k + Traits::kSmemKVElems * kEB;       // [kBlockN][d], then dV
  const uint32_t s_q = s_v + Traits::kSmemKVElems * kEB;       // [2][kBlockM][d]
  const uint32_t s_do = s_q + 2 * Traits::kSmemQElems * kEB;   // [2][kBlockM][d]
  const uint32_t s_ds = s_do + 2 * Traits::kSmemQElems * kEB;  // [kBlockN][kBlockM]
  const uint32_t s_p = s_ds + kBlockN * kBlockM * kEB;  // [kBlockN][kBlockM] when split, else none
  const uint32_t s_lse = s_p + (Traits::kDSplit > 1 ? kBlockN * kBlockM * kEB : 0);  // [2][kBlockM]
  const uint32_t s_dsum = s_lse + 2 * kBlockM * 4;  // [2][kBlockM] D
  constexpr int kStageBytes = Traits::kSmemQElems * kEB;

  const int n_block = blockIdx.x;  // the first key blocks see the most rows under causal: first
  const int batch = blockIdx.y;
  const int head_k = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int warp_key0 = 16 * (warp % Traits::kKeyWarps);  // this warp's keys in the block
  const int part = warp / Traits::kKeyWarps;  // split: the half of the rows (S^T) and of d (dK, dV)
  const int phase_row0 = part * Traits::kPhaseRows;  // first query row of this warp's S^T
  const int acc_col0 = part * Traits::kAccCols;      // first column of this warp's dK, dV

  // Offsets clamped, unchecked (params.cuh's clamped_seq_rows: a check here spilled the d = 128
  // tiles at their register limit); fa2_bwd_prep checks every sequence and reports a bad one, and
  // a bad sequence's dQ rows are NaN (fa2_bwd_dq writes a NaN-LSE row's dQ, as the forward gave
  // it, as NaN; so does fa2_bwd_dq_blocks).
  const SeqRows seq = clamped_seq_rows(a, batch);
  const SeqRange rows_q = seq.q;
  const SeqRange rows_k = seq.k;
  const int seqlen_q = rows_q.len;
  const int seqlen_k = rows_k.len;
  const int key0 = n_block * kBlockN;
  if (key0 >= seqlen_k) return;  // varlen: a sequence shorter than the grid
  const QueryRangeOfKeys<kBlockM, kBlockN, Traits::Is_causal, Traits::Is_local> range(
      n_block, seqlen_q, seqlen_k, a.window_left, a.window_right);
  const int group = a.h_h_k_ratio;
  int m_begin = range.m_block_begin(), m_end = range.m_block_end();
  if constexpr (Traits::Has_user_mods)  // a BlockMask's shown rows bound the loop too
    block_mask_row_blocks<kBlockM, kBlockN>(a, batch, head_k * group, group, key0, m_begin, m_end);
  const int m_blocks = max(m_end - m_begin, 0);
  const int steps = m_blocks * group;  // (query head of the group, query block) pairs

  const int64_t key_row0 = rows_k.start + key0;
  const Element* g_k = static_cast<const Element*>(a.k_ptr) + batch * a.k_batch_stride +
                       head_k * a.k_head_stride + key_row0 * a.k_row_stride;
  const Element* g_v = static_cast<const Element*>(a.v_ptr) + batch * a.v_batch_stride +
                       head_k * a.v_head_stride + key_row0 * a.v_row_stride;
  load_tile_async<Traits, kBlockN>(s_k, g_k, a.k_row_stride, seqlen_k - key0, tid);
  load_tile_async<Traits, kBlockN>(s_v, g_v, a.v_row_stride, seqlen_k - key0, tid);

  // Step `step` reads query head head_k * group + step / m_blocks, block m_begin + step % m_blocks.
  auto step_head = [&](int step) { return head_k * group + step / m_blocks; };
  auto step_row0 = [&](int step) { return (m_begin + step % m_blocks) * kBlockM; };
  auto load_step = [&](int step, int stage) {
    const int head = step_head(step);
    const int row0 = step_row0(step);
    const int64_t q_row = rows_q.start + row0;
    const int rows_valid = seqlen_q - row0;
    load_tile_async<Traits, kBlockM>(s_q + stage * kStageBytes,
                                     static_cast<const Element*>(a.q_ptr) +
                                         batch * a.q_batch_stride + head * a.q_head_stride +
                                         q_row * a.q_row_stride,
                                     a.q_row_stride, rows_valid, tid);
    load_tile_async<Traits, kBlockM>(s_do + stage * kStageBytes,
                                     static_cast<const Element*>(p.do_ptr) +
                                         batch * p.do_batch_stride + head * p.do_head_stride +
                                         q_row * p.do_row_stride,
                                     p.do_row_stride, rows_valid, tid);
    // -LSE log2 e and D of the block's rows; rows past the sequence read 0, which with their
    // zero Q and dO rows adds nothing to dK, dV, and their dQ rows are never written.
    const int64_t t0 = batch * p.row_batch_stride + head * p.row_head_stride + q_row;
    if (tid < kBlockM) {
      const bool valid = tid < rows_valid;
      cp_async_4(s_lse + (stage * kBlockM + tid) * 4, p.neg_lse_log2 + (valid ? t0 + tid : 0),
                 valid);
    } else if (tid < 2 * kBlockM) {
      const int r = tid - kBlockM;
      const bool valid = r < rows_valid;
      cp_async_4(s_dsum + (stage * kBlockM + r) * 4, p.dsum + (valid ? t0 + r : 0), valid);
    }
  };

  float acc_dk[1][Traits::kAccDTiles][4];
  float acc_dv[1][Traits::kAccDTiles][4];
  zero_fill(acc_dk);
  zero_fill(acc_dv);
  const uint32_t no_regs[1][Traits::kDSteps][4] = {};  // gemm_qk's Q_in_regs operand (unused)
  const float scale_log2 = a.softmax_scale_log2;

  // A mask's state of step `step`'s tile (variants.cuh): a tile it hides is skipped (no load,
  // no MMA: its P and dS are 0), one it shows unchanged is not read (an attn_mask) or evaluated
  // (mask_mod). Mixed without a summary. Read a step before it is needed (the step after the one
  // prefetched): no load waits at the top of the loop.
  auto tile_state = [&](int step) {
    if constexpr (Traits::Has_cells) {
      if (step >= steps) return static_cast<int>(kMaskCellHidden);
      if (Traits::Has_user_mods && a.mask_cells == nullptr) {  // no BlockMask
        if constexpr (user_mask_tiles())  // the mask's own bounds, where the call asks
          return user_mask_tile_state<kBlockM, kBlockN>(a, batch, step_head(step), step_row0(step),
                                                        key0, seqlen_q, seqlen_k);
        return static_cast<int>(kMaskCellMixed);
      }
      return mask_tile_state<kBlockM, kBlockN, false>(a, batch, step_head(step), step_row0(step),
                                                      key0);
    } else {
      return static_cast<int>(kMaskCellMixed);
    }
  };
  int state_cur = tile_state(0), state_next = tile_state(1);
  if (steps > 0 && state_cur != kMaskCellHidden) load_step(0, 0);
  cp_async_commit();  // group: K, V, step 0
  for (int step = 0; step < steps; ++step) {
    const int stage = step % 2;
    // Step `step` has landed; every warp is done with the other stage (read before the last
    // barrier of the previous step) and with dS^T (read after it).
    cp_async_wait<0>();
    __syncthreads();
    const int state = state_cur, prefetch_state = state_next;
    state_cur = state_next;
    state_next = tile_state(step + 2);
    if (step + 1 < steps && prefetch_state != kMaskCellHidden) load_step(step + 1, stage ^ 1);
    cp_async_commit();
    if (state == kMaskCellHidden) continue;  // CTA-uniform
    const uint32_t q_tile = s_q + stage * kStageBytes;
    const uint32_t do_tile = s_do + stage * kStageBytes;
    const int row0 = step_row0(step);

    // dP^T = V dO^T first: dS^T is then formed where P^T is, with the tanh of the softcap
    // still at hand, and no third score-sized array is live.
    // (This warp's query rows start phase_row0 rows into the tiles: a multiple of 8, so the
    // swizzle pattern of each row is unchanged.)
    const uint32_t phase_offset = phase_row0 * Traits::kHeadDim * kEB;
    float acc_dp[1][kNTiles][4];
    gemm_qk<Traits>(acc_dp, no_regs, s_v, do_tile + phase_offset, warp_key0, lane);
    float acc_s[1][kNTiles][4];
    gemm_qk<Traits>(acc_s, no_regs, s_k, q_tile + phase_offset, warp_key0, lane);
    // logit(S^T), then the mask (-inf), as the forward orders them.
    const typename Traits::Transform transform(a, batch, step_head(step), seqlen_k - seqlen_q);
    float raw_s[1][Traits::Has_user_mods ? kNTiles : 1][4];  // the scores score_mod saw
    if constexpr (Traits::Has_user_mods) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) raw_s[0][nt][e] = acc_s[0][nt][e];
    }
    if constexpr (Traits::Has_user_mods) {
      user_mods_by_state</*Transposed=*/true>(transform, state, acc_s, row0 + phase_row0,
                                              key0 + warp_key0, lane);
    } else if (state != kMaskCellPlain) {
      transform_scores_transposed(transform, acc_s, key0 + warp_key0, row0 + phase_row0, lane);
    }
    if (range.needs_mask(row0 / kBlockM)) {
      range.apply(acc_s, key0 + warp_key0, row0 + phase_row0, lane);
    }
    // A packed sequence's last query block runs past its rows, which the hook sees (its guard is
    // the packed total's): the functions' value there is not the answer, and a NaN from a read
    // outside a captured array would reach dK and dV (NaN x the zeroed Q, dO rows). Hidden.
    if constexpr (Traits::Has_user_mods) {
      if (row0 + kBlockM > seqlen_q)  // (uniform)
        range.hide_rows_from(acc_s, row0 + phase_row0, seqlen_q, lane);
    }
    // Dropout: the keep bits of this thread's elements, per pair of query n-tiles and column c.
    uint32_t keep[kNTiles / 2][2];
    if constexpr (Traits::Has_dropout) {
      const DropoutMask dropout(a.dropout_seed, a.dropout_threshold, step_head(step), batch);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          keep[np][c] =
              dropout.transposed_bits(row0 + phase_row0 + 16 * np, key0 + warp_key0, lane, c);
    }
    // P^T and dS^T, rounded to the element type in pairs: the A operands of dV and dK (and
    // dS^T the words staged for dQ).
    uint32_t p_words[kNTiles][2], ds_words[kNTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      // The two query rows (columns) this thread holds in tile nt: their -LSE log2 e and D.
      const int col0 = phase_row0 + 8 * nt + 2 * (lane % 4);
      const float2 neg_lse = ld_shared_f32x2(s_lse + (stage * kBlockM + col0) * 4);
      const float2 dsum = ld_shared_f32x2(s_dsum + (stage * kBlockM + col0) * 4);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float prob[2], ds[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float logit = acc_s[0][nt][2 * half + c];
          prob[c] = fast_exp2(fmaf(logit, scale_log2, c ? neg_lse.y : neg_lse.x));
          float dp = acc_dp[0][nt][2 * half + c];
          float kept_prob = prob[c];
          if constexpr (Traits::Has_dropout) {
            const bool kept = (keep[nt / 2][c] >> (2 * (nt % 2) + half)) & 1u;
            dp = kept ? dp * a.dropout_scale : 0.f;
            kept_prob = kept ? prob[c] : 0.f;
          }
          ds[c] = prob[c] * (dp - (c ? dsum.y : dsum.x));
          if constexpr (Traits::Has_softcap) {
            const int key = key0 + warp_key0 + lane / 4 + 8 * half;
            ds[c] =
                softcap_grad(ds[c], prob[c], capped_score(transform, logit, row0 + col0 + c, key));
          }
          if constexpr (Traits::Has_user_mods) {  // (a hidden score: P = 0, dS = 0)
            const int key = key0 + warp_key0 + lane / 4 + 8 * half;
            const float raw = raw_s[0][Traits::Has_user_mods ? nt : 0][2 * half + c];
            ds[c] = prob[c] != 0.f ? ds[c] * transform.grad(raw, row0 + col0 + c, key) : 0.f;
          }
          prob[c] = kept_prob;  // dV's operand: P * M (times dropout_scale in the epilogue)
        }
        p_words[nt][half] = Ops::pack2(prob[0], prob[1]);
        ds_words[nt][half] = Ops::pack2(ds[0], ds[1]);
      }
    }
    // dS^T (and P^T when split) to shared memory, at this warp's keys and query rows.
    auto stage_words = [&](uint32_t s_tile, const uint32_t (&words)[kNTiles][2]) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = warp_key0 + lane / 4 + 8 * half;
          const int chunk = phase_row0 / 8 + nt;
          st_shared_b32(s_tile + (DsTile::offset(key, chunk) + 2 * (lane % 4)) * kEB,
                        words[nt][half]);
        }
      }
    };
    if constexpr (Traits::kDSplit == 1) {
      gemm_packed_a<Traits>(acc_dv, p_words, do_tile, lane);         // dV += P^T dO
      gemm_packed_a<Traits>(acc_dk, ds_words, q_tile, lane);         // dK += dS^T Q
      if constexpr (Traits::Dq_atomic) stage_words(s_ds, ds_words);  // for dQ = dS K
    } else {
      // Split: the two warps of 16 keys each hold half the rows of P^T and dS^T; both need all
      // of them for their half of dV and dK.
      stage_words(s_p, p_words);
      stage_words(s_ds, ds_words);
      __syncthreads();
      gemm_smem_a<Traits, DsTile, kBlockM / 16>(acc_dv, s_p, warp_key0, do_tile, acc_col0, lane);
      gemm_smem_a<Traits, DsTile, kBlockM / 16>(acc_dk, s_ds, warp_key0, q_tile, acc_col0, lane);
    }

    if constexpr (Traits::Dq_atomic) {
      if constexpr (Traits::kDSplit == 1) __syncthreads();  // dS^T complete (split: synced above)

      // dQacc[rows] += dS K: warp (wr, wc) takes rows 16 kDqMTiles wr .., columns kDqCols wc ...
      constexpr int kDqMTiles = Traits::kDqMTiles;
      constexpr int kDqNTiles = Traits::kDqCols / 8;
      if (warp >= Traits::kDqRowWarps * Traits::kDqColWarps) continue;
      const int dq_row0 = 16 * kDqMTiles * (warp % Traits::kDqRowWarps);
      const int dq_col0 = Traits::kDqCols * (warp / Traits::kDqRowWarps);
      float acc_dq[kDqMTiles][kDqNTiles][4];
      zero_fill(acc_dq);
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) {
        uint32_t a_frag[kDqMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kDqMTiles; ++mt) {
          load_a_frag_trans<DsTile, kEB>(a_frag[mt], s_ds, dq_row0 + 16 * mt, ks, lane);
        }
#pragma unroll
        for (int dp = 0; dp < kDqNTiles / 2; ++dp) {
          // K [keys][d] is B stored [k][n]: ldmatrix.trans as V in gemm_pv.
          const int key = 16 * ks + (lane % 8) + 8 * ((lane / 8) % 2);
          const int xor_bits = Tile::pattern(lane) ^ (lane / 16);
          uint32_t b[4];
          ldmatrix_x4_trans(b, s_k + Tile::pair_offset(key, dq_col0 / 16 + dp, xor_bits) * kEB);
#pragma unroll
          for (int mt = 0; mt < kDqMTiles; ++mt) {
            Ops::mma_16816(acc_dq[mt][2 * dp], a_frag[mt], b[0], b[1]);
            Ops::mma_16816(acc_dq[mt][2 * dp + 1], a_frag[mt], b[2], b[3]);
          }
        }
      }
      const int head = step_head(step);
      float* g_acc = p.dq_accum +
                     (batch * p.row_batch_stride + head * p.row_head_stride + rows_q.start + row0) *
                         Traits::kHeadDim;
#pragma unroll
      for (int mt = 0; mt < kDqMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = dq_row0 + 16 * mt + lane / 4 + 8 * half;
          if (row0 + row >= seqlen_q) continue;
#pragma unroll
          for (int nt = 0; nt < kDqNTiles; ++nt) {
            float* dst = g_acc + row * Traits::kHeadDim + dq_col0 + 8 * nt + 2 * (lane % 4);
            atomicAdd(dst, acc_dq[mt][nt][2 * half]);
            atomicAdd(dst + 1, acc_dq[mt][nt][2 * half + 1]);
          }
        }
      }
    }
  }

  // Epilogue: dK scaled (and dV, by dropout_scale, with dropout), both staged through the K and
  // V tiles (free once every warp is past the last dQ), then written as 16-byte rows.
  const float dv_scale = Traits::Has_dropout ? a.dropout_scale : 1.f;
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int dt = 0; dt < Traits::kAccDTiles; ++dt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_key0 + lane / 4 + 8 * half;
      const int offset = (Tile::offset(row, acc_col0 / 8 + dt) + 2 * (lane % 4)) * kEB;
      st_shared_b32(s_k + offset, Ops::pack2(acc_dk[0][dt][2 * half] * p.dk_scale,
                                             acc_dk[0][dt][2 * half + 1] * p.dk_scale));
      st_shared_b32(s_v + offset, Ops::pack2(acc_dv[0][dt][2 * half] * dv_scale,
                                             acc_dv[0][dt][2 * half + 1] * dv_scale));
    }
  }
  __syncthreads();
  Element* g_dk = static_cast<Element*>(p.dk_ptr) + batch * p.dk_batch_stride +
                  head_k * p.dk_head_stride + key_row0 * p.dk_row_stride;
  Element* g_dv = static_cast<Element*>(p.dv_ptr) + batch * p.dv_batch_stride +
                  head_k * p.dv_head_stride + key_row0 * p.dv_row_stride;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  for (int idx = tid; idx < kBlockN * kChunksPerRow; idx += Traits::kNThreads) {
    const int row = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    if (row >= seqlen_k - key0) break;
    const uint32_t offset = Tile::offset(row, chunk) * kEB;
    st_global_chunk<typename Traits::Columns>(g_dk + row * p.dk_row_stride, chunk,
                                              ld_shared_b128(s_k + offset));
    st_global_chunk<typename Traits::Columns>(g_dv + row * p.dv_row_stride, chunk,
                                              ld_shared_b128(s_v + offset));
  }
}

// ---------------------------------------------------------------------------------------------
// Deterministic dQ: one CTA per block of query rows, its key blocks in order (no atomics), the
// forward's loop with dQ in place of O:
//   S = Q K^T, P = exp2(logit(S) * scale_log2 - LSE log2 e), dP = dO V^T, dS = P * (dP - D)
//   (* (1 - tanh^2)), dQ += dS K; dQ = dq_scale dQ, written once.
// Recomputing S and dP here costs two of the backward's five products again; the main kernel
// then skips its dS^T staging and its atomics (Fa2BwdTraits::Dq_atomic = false).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_,
          bool Is_causal_, bool Is_local_, bool Has_softcap_, bool Has_dropout_ = false,
          bool Has_alibi_ = false, int kValidDim_ = 0, int kBias_ = 0>
struct Fa2BwdDqTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Tile = SwizzledTile<kHeadDim_>;
  using Columns = TileColumns<kHeadDim_, kValidDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  static constexpr bool Has_dropout = Has_dropout_;
  static constexpr int kBias = kBias_;  // an attn_mask (kAdditiveBias, kBoolBias), kUserMods
  // An attn_mask tensor has a block summary (mask_cells); a user mask_mod has one where the call
  // has a BlockMask (mask_cells non-null).
  static constexpr bool Has_mask_tensor = kBias_ == kAdditiveBias || kBias_ == kBoolBias;
  // A user score_mod: dS times its derivative at the raw score (kept beside the logits).
  static constexpr bool Has_user_mods = kBias_ == kUserMods;
  static constexpr bool Has_cells = Has_mask_tensor || Has_user_mods;
  using Transform = ScoreTransform<Has_softcap, Has_alibi_, kBias_, Element_>;
  // tile_mma.cuh's names, as the forward's: M = query rows, N = keys, K-steps over d (S, dP),
  // then over keys (dQ).
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kDSteps = kHeadDim / 16;
  static constexpr int kNSteps = kBlockN / 16;
  static constexpr bool Q_in_regs = false;
  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  static constexpr int kSmemKVElems = kBlockN * kHeadDim;
  // Q, dO; K and V double-buffered.
  static constexpr int kSmemBytes = (2 * kSmemQElems + 4 * kSmemKVElems) * kElemBytes;
  static_assert(kRowsPerWarp % 16 == 0 && kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shapes");
};

template <typename Traits>
CF_DEVICE void fa2_bwd_dq_blocks(const BwdParams& p) {
  using Element = typename Traits::Element;
  using Tile = typename Traits::Tile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kEB = Traits::kElemBytes;
  const AttnParams& a = p.attn;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t s_q = smem_addr(smem_raw);                   // [kBlockM][d], then dQ
  const uint32_t s_do = s_q + Traits::kSmemQElems * kEB;      // [kBlockM][d]
  const uint32_t s_k = s_do + Traits::kSmemQElems * kEB;      // [2][kBlockN][d]
  const uint32_t s_v = s_k + 2 * Traits::kSmemKVElems * kEB;  // [2][kBlockN][d]
  constexpr int kStageBytes = Traits::kSmemKVElems * kEB;

  const int m_block = Traits::Is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int batch = blockIdx.y;
  const int head = blockIdx.z;
  const int head_k = head / a.h_h_k_ratio;
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row0 = (tid / 32) * Traits::kRowsPerWarp;

  const SeqRows seq = seq_rows(a, batch);
  const SeqRange rows_q = seq.q;
  const SeqRange rows_k = seq.k;
  const int seqlen_q = rows_q.len;
  const int seqlen_k = rows_k.len;
  const int row_block0 = m_block * kBlockM;
  if (row_block0 >= seqlen_q) return;
  if (seq.bad()) {  // NaN dQ rows, nothing read (fa2_bwd reports the bits)
    store_nan_rows<Traits, kBlockM>(static_cast<Element*>(p.dq_ptr) + batch * p.dq_batch_stride +
                                        head * p.dq_head_stride +
                                        (rows_q.start + row_block0) * p.dq_row_stride,
                                    p.dq_row_stride, seqlen_q - row_block0, tid);
    return;
  }
  const KeyMask<kBlockM, kBlockN, Traits::Is_causal, Traits::Is_local> mask(
      m_block, seqlen_q, seqlen_k, a.window_left, a.window_right);
  int n_begin = mask.n_block_begin();
  int n_end = mask.n_block_end();
  if constexpr (Traits::Has_user_mods)  // a BlockMask's shown keys bound the loop too
    block_mask_key_blocks<kBlockM, kBlockN>(a, batch, head, row_block0, seqlen_q, n_begin, n_end);

  const int64_t q_row0 = rows_q.start + row_block0;
  const auto* g_q = static_cast<const Element*>(a.q_ptr) + batch * a.q_batch_stride +
                    head * a.q_head_stride + q_row0 * a.q_row_stride;
  const auto* g_do = static_cast<const Element*>(p.do_ptr) + batch * p.do_batch_stride +
                     head * p.do_head_stride + q_row0 * p.do_row_stride;
  const auto* g_k = static_cast<const Element*>(a.k_ptr) + batch * a.k_batch_stride +
                    head_k * a.k_head_stride + rows_k.start * a.k_row_stride;
  const auto* g_v = static_cast<const Element*>(a.v_ptr) + batch * a.v_batch_stride +
                    head_k * a.v_head_stride + rows_k.start * a.v_row_stride;
  auto load_kv = [&](int n_block, int stage) {
    const int64_t key0 = static_cast<int64_t>(n_block) * kBlockN;
    const int rows_valid = seqlen_k - n_block * kBlockN;
    load_tile_async<Traits, kBlockN>(s_k + stage * kStageBytes, g_k + key0 * a.k_row_stride,
                                     a.k_row_stride, rows_valid, tid);
    load_tile_async<Traits, kBlockN>(s_v + stage * kStageBytes, g_v + key0 * a.v_row_stride,
                                     a.v_row_stride, rows_valid, tid);
  };

  // -LSE log2 e and D of the two rows this thread holds in each 16-row tile (0 past the end:
  // those rows' Q and dO are zero and their dQ is not written).
  float neg_lse[2 * kMTiles], dsum[2 * kMTiles];
  const int64_t t0 = batch * p.row_batch_stride + head * p.row_head_stride + q_row0;
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) {
    const int row = warp_row0 + 16 * (r / 2) + lane / 4 + 8 * (r % 2);
    const bool valid = row_block0 + row < seqlen_q;
    neg_lse[r] = valid ? p.neg_lse_log2[t0 + row] : 0.f;
    dsum[r] = valid ? p.dsum[t0 + row] : 0.f;
  }

  float acc_dq[kMTiles][Traits::kDTiles][4];
  zero_fill(acc_dq);
  const uint32_t no_regs[kMTiles][Traits::kDSteps][4] = {};
  const typename Traits::Transform transform(a, batch, head, seqlen_k - seqlen_q);
  const float scale_log2 = a.softmax_scale_log2;
  const DropoutMask dropout(a.dropout_seed, a.dropout_threshold, head, batch);
  const float dp_scale = Traits::Has_dropout ? a.dropout_scale : 1.f;  // dP * M / (1 - p)

  load_tile_async<Traits, kBlockM>(s_q, g_q, a.q_row_stride, seqlen_q - row_block0, tid);
  load_tile_async<Traits, kBlockM>(s_do, g_do, p.do_row_stride, seqlen_q - row_block0, tid);
  // A mask's state of key block n_block, as in the forward: hidden tiles skipped, the states
  // read an iteration ahead.
  auto tile_state = [&](int n_block) {
    if constexpr (Traits::Has_cells) {
      if (n_block < n_begin) return static_cast<int>(kMaskCellHidden);
      if (Traits::Has_user_mods && a.mask_cells == nullptr) {  // no BlockMask
        if constexpr (user_mask_tiles())  // the mask's own bounds, where the call asks
          return user_mask_tile_state<kBlockM, kBlockN>(a, batch, head, row_block0,
                                                        n_block * kBlockN, seqlen_q, seqlen_k);
        return static_cast<int>(kMaskCellMixed);
      }
      return mask_tile_state<kBlockM, kBlockN, false>(a, batch, head, row_block0,
                                                      n_block * kBlockN);
    } else {
      return static_cast<int>(kMaskCellMixed);
    }
  };
  int state_cur = tile_state(n_end - 1), state_next = tile_state(n_end - 2);
  if (n_end - 1 >= n_begin && state_cur != kMaskCellHidden) load_kv(n_end - 1, 0);
  cp_async_commit();
  for (int it = 0, n_block = n_end - 1; n_block >= n_begin; ++it, --n_block) {
    const int stage = it % 2;
    cp_async_wait<0>();
    __syncthreads();  // block n_block landed; the other stage was released in the last iteration
    const int state = state_cur, prefetch_state = state_next;
    state_cur = state_next;
    state_next = tile_state(n_block - 2);
    if (n_block - 1 >= n_begin && prefetch_state != kMaskCellHidden)
      load_kv(n_block - 1, stage ^ 1);
    cp_async_commit();
    if (state == kMaskCellHidden) continue;  // CTA-uniform
    float acc_s[kMTiles][kNTiles][4], acc_dp[kMTiles][kNTiles][4];
    gemm_qk<Traits>(acc_s, no_regs, s_q, s_k + stage * kStageBytes, warp_row0, lane);
    gemm_qk<Traits>(acc_dp, no_regs, s_do, s_v + stage * kStageBytes, warp_row0, lane);
    float raw_s[Traits::Has_user_mods ? kMTiles : 1][Traits::Has_user_mods ? kNTiles : 1][4];
    if constexpr (Traits::Has_user_mods) {  // the scores score_mod saw
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) raw_s[mt][nt][e] = acc_s[mt][nt][e];
    }
    if constexpr (Traits::Has_user_mods) {
      user_mods_by_state</*Transposed=*/false>(transform, state, acc_s, row_block0 + warp_row0,
                                               n_block * kBlockN, lane);
    } else if (state != kMaskCellPlain) {
      transform_scores(transform, acc_s, row_block0 + warp_row0, n_block * kBlockN, lane);
    }
    if (mask.needs_mask(n_block)) {
      mask.apply(acc_s, row_block0 + warp_row0, n_block * kBlockN, lane);
    }
    if constexpr (Traits::Has_dropout)
      dropout.apply(acc_dp, row_block0 + warp_row0, n_block * kBlockN, lane);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 2 * mt + e / 2;
          const float logit = acc_s[mt][nt][e];
          const float prob = fast_exp2(fmaf(logit, scale_log2, neg_lse[r]));
          float ds = prob * (acc_dp[mt][nt][e] * dp_scale - dsum[r]);
          if constexpr (Traits::Has_softcap) {
            const int row = row_block0 + warp_row0 + 16 * mt + lane / 4 + 8 * (e / 2);
            const int key = n_block * kBlockN + 8 * nt + 2 * (lane % 4) + e % 2;
            ds = softcap_grad(ds, prob, capped_score(transform, logit, row, key));
          }
          if constexpr (Traits::Has_user_mods) {  // (a hidden score: P = 0, dS = 0)
            const int row = row_block0 + warp_row0 + 16 * mt + lane / 4 + 8 * (e / 2);
            const int key = n_block * kBlockN + 8 * nt + 2 * (lane % 4) + e % 2;
            const float raw =
                raw_s[Traits::Has_user_mods ? mt : 0][Traits::Has_user_mods ? nt : 0][e];
            ds = prob != 0.f ? ds * transform.grad(raw, row, key) : 0.f;
          }
          acc_dp[mt][nt][e] = ds;
        }
    gemm_pv<Traits>(acc_dq, acc_dp, s_k + stage * kStageBytes, lane);  // dQ += dS K
  }

  // dQ scaled, staged through the Q tile, written as 16-byte rows.
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < Traits::kDTiles; ++dt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + 16 * mt + lane / 4 + 8 * half;
        st_shared_b32(s_q + (Tile::offset(row, dt) + 2 * (lane % 4)) * kEB,
                      Traits::Ops::pack2(acc_dq[mt][dt][2 * half] * p.dq_scale,
                                         acc_dq[mt][dt][2 * half + 1] * p.dq_scale));
      }
  __syncthreads();
  Element* g_dq = static_cast<Element*>(p.dq_ptr) + batch * p.dq_batch_stride +
                  head * p.dq_head_stride + q_row0 * p.dq_row_stride;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  for (int idx = tid; idx < kBlockM * kChunksPerRow; idx += Traits::kNThreads) {
    const int row = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    if (row >= seqlen_q - row_block0) break;
    st_global_chunk<typename Traits::Columns>(g_dq + row * p.dq_row_stride, chunk,
                                              ld_shared_b128(s_q + Tile::offset(row, chunk) * kEB));
  }
}
