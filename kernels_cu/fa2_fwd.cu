// FlashAttention-2 forward (Dao, 2023) on mma.sync tensor cores.
//
// Grid (num_m_blocks, B, Hq): one CTA per block of kBlockM query rows of one (batch, head).
// blockIdx.x runs fastest, so the CTAs resident at one time share a (batch, head) and its K/V
// stays in L2. Each warp owns kBlockM / kNWarps query rows end to end (no cross-warp reduction):
//
//   O = 0, m = -inf, l = 0                                       (registers)
//   for each visible key block j (last first, so the masked blocks come first):
//     S = Q K_j^T                    mma.sync, Q from registers or smem, K via ldmatrix
//     S = softcap / mask (only blocks that need it; an attn_mask's mixed tiles staged through
//         shared memory with K_j, V_j where its layout allows: load_mask_tile)
//     m_new = max(m, rowmax S); O *= exp2(m - m_new); P = exp2(S - m_new); l = l * .. + rowsum P
//     (dropout: P's dropped elements set to 0; the kept ones scaled by dropout_scale with 1 / l)
//     O += P V_j                     P re-packed from the S accumulators as the A operand
//   O /= l, LSE = m + log l                                      (once, at the end)
//
// K/V tiles stream through a kStages-deep cp.async ring: while block j is computed, blocks
// j - 1 .. j - kStages + 1 are in flight. With Overlap, the loop is software-pipelined instead:
// the MMAs of block j + 1's scores are issued before block j's softmax (see the loop).
#pragma once

#include "attn_mask.cuh"  // the mask's block summary, run before the kernels
#include "common.cuh"
#include "dropout.cuh"
#include "kvcache.cuh"  // CacheRows, CacheSpan: fa2_fwd_kvcache
#include "mask.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "tile_mma.cuh"
#include "variants.cuh"

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_, bool Q_in_regs_,
          bool Overlap_, typename Element_, bool Is_causal_, bool Is_local_, bool Has_softcap_,
          bool Has_dropout_ = false, bool Has_alibi_ = false, int kValidDim_ = 0, int kBias_ = 0>
struct Fa2FwdTraits {
  using Element = Element_;
  using Ops = ElementTraits<Element>;
  using Tile = SwizzledTile<kHeadDim_>;
  using Columns = TileColumns<kHeadDim_, kValidDim_>;  // the caller's head dim, if below the tile's

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static constexpr bool Q_in_regs = Q_in_regs_;
  static constexpr bool Overlap = Overlap_;  // issue Q K_{j+1}^T before the softmax of block j
  static constexpr bool Is_causal = Is_causal_;
  static constexpr bool Is_local = Is_local_;
  static constexpr bool Has_softcap = Has_softcap_;
  static constexpr bool Has_dropout = Has_dropout_;
  static constexpr int kBias = kBias_;  // an attn_mask (kAdditiveBias, kBoolBias), kUserMods
  // A mask tensor: its block summary, its staged tiles.
  static constexpr bool Has_mask_tensor = kBias_ == kAdditiveBias || kBias_ == kBoolBias;
  static constexpr bool Has_user_mods = kBias_ == kUserMods;
  // A block summary to read: a mask tensor's, or a user mask_mod's where the call has a BlockMask
  // (AttnParams::mask_cells non-null; without one every tile the function may touch is mixed).
  static constexpr bool Has_cells = Has_mask_tensor || Has_user_mods;
  using Transform = ScoreTransform<Has_softcap, Has_alibi_, kBias_, Element_>;

  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // 16-row MMA tiles per warp
  static constexpr int kNTiles = kBlockN / 8;        // 8-key column tiles of S
  static constexpr int kDTiles = kHeadDim / 8;       // 8-wide column tiles of O
  static constexpr int kDSteps = kHeadDim / 16;      // k-steps of Q K^T
  static constexpr int kNSteps = kBlockN / 16;       // k-steps of P V

  static constexpr int kElemBytes = static_cast<int>(sizeof(Element));
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  static constexpr int kSmemKVElems = kBlockN * kHeadDim;  // one K (or V) stage
  // An attn_mask's staged tiles, one per K/V stage: kBlockM rows of kBlockN keys, each row 16
  // bytes longer than its keys (cp.async's 16-byte alignment; the fragment reads' banks).
  static constexpr int kMaskElemBytes = kBias_ == kBoolBias ? 1 : kElemBytes;  // AttnBias's
  static constexpr int kMaskRowBytes = kBlockN * kMaskElemBytes + 16;
  static constexpr int kMaskStageBytes = Has_mask_tensor ? kBlockM * kMaskRowBytes : 0;
  static constexpr int kSmemBytes =
      (kSmemQElems + 2 * kStages * kSmemKVElems) * kElemBytes + kStages * kMaskStageBytes;

  static_assert(kRowsPerWarp % 16 == 0, "each warp needs whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shapes");
  static_assert(kStages >= 2, "the K/V ring needs at least two stages");
  static_assert(!Overlap || kStages == 2, "the overlapped loop runs two K and two V stages");
  static_assert(!Overlap || !Has_cells, "a mask's tile skipping runs in the K/V ring");
};

// K and V of one (batch, KV head) in dense or packed tensors: key block n_block at a fixed stride.
template <typename Traits>
struct DenseKv {
  using Element = typename Traits::Element;
  const Element* k;
  const Element* v;
  int64_t k_row_stride, v_row_stride;

  CF_DEVICE void load_k(uint32_t s_tile, int n_block, int rows_valid, int tid) const {
    load_tile_async<Traits, Traits::kBlockN>(
        s_tile, k + static_cast<int64_t>(n_block) * Traits::kBlockN * k_row_stride, k_row_stride,
        rows_valid, tid);
  }
  CF_DEVICE void load_v(uint32_t s_tile, int n_block, int rows_valid, int tid) const {
    load_tile_async<Traits, Traits::kBlockN>(
        s_tile, v + static_cast<int64_t>(n_block) * Traits::kBlockN * v_row_stride, v_row_stride,
        rows_valid, tid);
  }
  // The epilogue's barrier; dense tensors hold no device value to doubt.
  CF_DEVICE bool barrier_any_bad() const {
    __syncthreads();
    return false;
  }
};

// Rows [0, kRows) of keys key0 .. of a paged cache whose pages are smaller than the block, into a
// swizzled tile (rows >= rows_valid zero-filled), as load_tile_async lays them out: each thread
// keeps one 16-byte chunk column and walks down its rows. Every row's page is looked up first,
// all lookups in flight together, then the copies are issued: with a lookup per copy, each copy
// waited on its own dependent load of the block table.
template <typename Traits, int kRows>
CF_DEVICE void load_tile_paged(uint32_t s_tile, const CacheRows<typename Traits::Element>& rows,
                               int key0, int rows_valid, int tid, int* bad_page) {
  using Columns = typename Traits::Columns;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kRowsPerIter = Traits::kNThreads / kChunksPerRow;
  constexpr int kIters = ceil_div(kRows, kRowsPerIter);
  const int chunk = tid % kChunksPerRow;
  const int row0 = tid / kChunksPerRow;
  int page[kIters];
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int row = row0 + it * kRowsPerIter;
    page[it] = 0;
    if (row < rows_valid) {
      const int entry = __ldg(rows.pages + ((key0 + row) >> rows.page_size_log2));
      const bool bad = static_cast<unsigned>(entry) >= static_cast<unsigned>(rows.num_pages);
      if (bad) *bad_page = 1;  // (page 0 is read instead: the rows are NaN anyway)
      page[it] = bad ? 0 : entry;
    }
  }
  const int slot_mask = (1 << rows.page_size_log2) - 1;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int row = row0 + it * kRowsPerIter;
    if (kRows % kRowsPerIter == 0 || row < kRows) {
      const bool valid = Columns::holds(chunk) && row < rows_valid;
      const typename Traits::Element* src = rows.base + page[it] * rows.page_stride +
                                            ((key0 + row) & slot_mask) * rows.row_stride +
                                            chunk * 8;
      cp_async_16(s_tile + Traits::Tile::offset(row, chunk) * Traits::kElemBytes,
                  valid ? src : rows.base, valid);
    }
  }
}

// Key block n_block of a cache (kvcache.cuh) into a swizzled tile. A block that lies in one page
// (contiguous caches, and pages of >= kBlockN keys: key blocks start at multiples of kBlockN and
// page sizes are powers of two) is one address and a fixed stride, as a dense tensor's; smaller
// pages take each row's page from the block table.
template <typename Traits>
CF_DEVICE void load_cache_block(uint32_t s_tile, const CacheRows<typename Traits::Element>& rows,
                                int n_block, int rows_valid, int tid, int* bad_page) {
  using Element = typename Traits::Element;
  const int key0 = n_block * Traits::kBlockN;
  if (rows.pages == nullptr || (1 << rows.page_size_log2) >= Traits::kBlockN) {
    load_tile_async<Traits, Traits::kBlockN>(s_tile, rows.row(key0, bad_page), rows.row_stride,
                                             rows_valid, tid);
  } else if constexpr (Traits::Columns::kWholeChunks &&
                       Traits::kNThreads % (Traits::kHeadDim / 8) == 0) {
    load_tile_paged<Traits, Traits::kBlockN>(s_tile, rows, key0, rows_valid, tid, bad_page);
  } else {  // rows of 12 or 24 chunks (d = 96, 192), or 2-byte aligned rows: row by row
    struct {
      const CacheRows<Element>& rows;
      int key0, rows_valid;
      int* bad_page;
      CF_DEVICE const Element* operator()(int r) const {
        return r < rows_valid ? rows.row(key0 + r, bad_page) : nullptr;
      }
      CF_DEVICE const Element* fallback() const { return rows.base; }
    } row_ptr{rows, key0, rows_valid, bad_page};
    load_rows_async<Traits, Traits::kBlockN, Traits::kNThreads>(s_tile, row_ptr, tid);
  }
}

// K and V of one (batch, KV head) in a KV cache. A block-table entry outside the cache sets the
// thread's *bad_page (a register: the block reads page 0 instead, inside the cache); the
// epilogue's barrier ORs it over the CTA, and a bad span (the sequence's length, first key or
// entry) counts as bad too: the CTA's rows are then NaN.
template <typename Traits>
struct CacheKv {
  CacheRows<typename Traits::Element> k, v;
  int* bad_page;
  bool span_bad;

  CF_DEVICE void load_k(uint32_t s_tile, int n_block, int rows_valid, int tid) const {
    load_cache_block<Traits>(s_tile, k, n_block, rows_valid, tid, bad_page);
  }
  CF_DEVICE void load_v(uint32_t s_tile, int n_block, int rows_valid, int tid) const {
    load_cache_block<Traits>(s_tile, v, n_block, rows_valid, tid, bad_page);
  }
  CF_DEVICE bool barrier_any_bad() const { return __syncthreads_or(*bad_page) != 0 || span_bad; }
};

// An attn_mask's tile (kBlockM rows from row0, kBlockN keys from key0) into a staged copy in
// shared memory (rows kMaskRowBytes apart), by 16-byte cp.async chunks beside the block's K and V
// (the mask is AttnBias::stageable). Rows past the sequence read as zeros; so do chunks past its
// keys, which the key mask hides anyway.
template <typename Traits, typename Bias>
CF_DEVICE void load_mask_tile(uint32_t s_tile, const Bias& bias, int row0, int key0, int tid) {
  constexpr int kChunksPerRow = Traits::kBlockN / Bias::kChunkElems;
  constexpr int kChunks = Traits::kBlockM * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < ceil_div(kChunks, Traits::kNThreads); ++it) {
    const int idx = it * Traits::kNThreads + tid;
    const int row = idx / kChunksPerRow;
    const int key = key0 + (idx % kChunksPerRow) * Bias::kChunkElems;
    if (kChunks % Traits::kNThreads == 0 || idx < kChunks) {
      const bool valid = row0 + row < bias.rows && key < bias.keys;
      cp_async_16(s_tile + row * Traits::kMaskRowBytes + (idx % kChunksPerRow) * 16,
                  valid ? bias.base + (row0 + row) * bias.row_stride + key : bias.base, valid);
    }
  }
}

// One CTA: query block m_block of rows_q of (batch, head) against the seqlen_k keys of `kv`.
// Returns whether the rows were written as NaN (kv found a bad device value; CTA-uniform).
template <typename Traits, typename Kv>
CF_DEVICE bool fa2_fwd_block(const AttnParams& params, int m_block, int batch, int head,
                             const SeqRange rows_q, int seqlen_k, const Kv& kv) {
  using Element = typename Traits::Element;
  using Tile = typename Traits::Tile;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kStages = Traits::kStages;

  constexpr int kStageBytes = Traits::kSmemKVElems * Traits::kElemBytes;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t s_q = smem_addr(smem_raw);                             // [kBlockM][d], then O
  const uint32_t s_k = s_q + Traits::kSmemQElems * Traits::kElemBytes;  // [kStages][kBlockN][d]
  const uint32_t s_v = s_k + kStages * kStageBytes;                     // [kStages][kBlockN][d]
  const uint32_t s_mask = s_v + kStages * kStageBytes;  // [kStages][kBlockM] mask rows (staged)

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp_row0 = (tid / 32) * Traits::kRowsPerWarp;  // first row of this warp in the block

  const int seqlen_q = rows_q.len;
  const int row_block0 = m_block * kBlockM;
  if (row_block0 >= seqlen_q) return false;  // varlen: a sequence shorter than the grid
  const KeyMask<kBlockM, kBlockN, Traits::Is_causal, Traits::Is_local> mask(
      m_block, seqlen_q, seqlen_k, params.window_left, params.window_right);
  int n_begin = mask.n_block_begin();
  int n_end = mask.n_block_end();
  if constexpr (Traits::Has_user_mods)  // a BlockMask's shown keys bound the loop too
    block_mask_key_blocks<kBlockM, kBlockN>(params, batch, head, row_block0, seqlen_q, n_begin,
                                            n_end);

  const int64_t q_row0 = rows_q.start + row_block0;  // first query row of the block
  const Element* g_q = static_cast<const Element*>(params.q_ptr) + batch * params.q_batch_stride +
                       head * params.q_head_stride + q_row0 * params.q_row_stride;

  auto load_kv = [&](int n_block, int stage) {
    const int rows_valid = seqlen_k - n_block * kBlockN;
    kv.load_k(s_k + stage * kStageBytes, n_block, rows_valid, tid);
    kv.load_v(s_v + stage * kStageBytes, n_block, rows_valid, tid);
  };

  float acc_o[kMTiles][Traits::kDTiles][4];
  zero_fill(acc_o);
  OnlineSoftmax<kMTiles> softmax;
  uint32_t r_q[kMTiles][Traits::kDSteps][4];  // Q fragments; optimised away unless Q_in_regs
  const float scale_log2 = params.softmax_scale_log2;

  auto load_q_regs = [&]() {
    if constexpr (Traits::Q_in_regs) ::load_q_regs<Traits>(r_q, s_q, warp_row0, lane);
  };

  // A mask's state of key block n_block (variants.cuh): a tile it hides is skipped (no load, no
  // MMA), one it shows unchanged is not read (an attn_mask) or evaluated (mask_mod); blocks
  // before n_begin are never visited. Without a summary every block is mixed: a constant, and
  // the branches on it fold away.
  auto tile_state = [&](int n_block) {
    if constexpr (Traits::Has_cells) {
      if (n_block < n_begin) return static_cast<int>(kMaskCellHidden);
      if (Traits::Has_user_mods && params.mask_cells == nullptr) {  // no BlockMask
        if constexpr (user_mask_tiles())  // the mask's own bounds, where the call asks
          return user_mask_tile_state<kBlockM, kBlockN>(params, batch, head, row_block0,
                                                        n_block * kBlockN, seqlen_q, seqlen_k);
        return static_cast<int>(kMaskCellMixed);
      }
      return mask_tile_state<kBlockM, kBlockN, /*kOneCell=*/Traits::Has_mask_tensor>(
          params, batch, head, row_block0, n_block * kBlockN);
    } else {
      return static_cast<int>(kMaskCellMixed);
    }
  };
  // Scores of key block n_block -> logits: the score variant (softcap), then the mask. An
  // attn_mask's mixed tiles come from their staged copy in `stage` where the mask is stageable
  // (a uniform branch), else from global memory per score. A BlockMask's plain tiles run
  // score_mod alone.
  const typename Traits::Transform transform(params, batch, head, seqlen_k - seqlen_q);
  bool mask_staged = false;
  if constexpr (Traits::Has_mask_tensor) mask_staged = transform.stageable();
  auto load_mask = [&](int n_block, int stage) {  // with the block's K and V, when staged
    if constexpr (Traits::Has_mask_tensor) {
      if (mask_staged)
        load_mask_tile<Traits>(s_mask + stage * Traits::kMaskStageBytes, transform, row_block0,
                               n_block * kBlockN, tid);
    }
  };
  auto logits = [&](float (&s)[kMTiles][Traits::kNTiles][4], int n_block, int state, int stage) {
    if constexpr (Traits::Has_user_mods) {
      user_mods_by_state</*Transposed=*/false>(transform, state, s, row_block0 + warp_row0,
                                               n_block * kBlockN, lane);
    } else if (state != kMaskCellPlain) {
      if constexpr (Traits::Has_mask_tensor) {
        if (mask_staged)
          transform_scores_staged<Traits::kMaskRowBytes>(
              transform, s, s_mask + stage * Traits::kMaskStageBytes, warp_row0, lane);
        else
          transform_scores(transform, s, row_block0 + warp_row0, n_block * kBlockN, lane);
      } else {
        transform_scores(transform, s, row_block0 + warp_row0, n_block * kBlockN, lane);
      }
    }
    if (mask.needs_mask(n_block)) mask.apply(s, row_block0 + warp_row0, n_block * kBlockN, lane);
  };
  // Logits of key block n_block from the K tile in `stage`: S = Q K^T, then logits().
  auto scores = [&](float (&s)[kMTiles][Traits::kNTiles][4], int n_block, int stage, int state) {
    gemm_qk<Traits>(s, r_q, s_q, s_k + stage * kStageBytes, warp_row0, lane);
    logits(s, n_block, state, stage);
  };

  const DropoutMask dropout(params.dropout_seed, params.dropout_threshold, head, batch);

  // Online softmax of key block n_block's logits (l sums every probability, dropped or not),
  // then O += P V with V from `stage`.
  auto softmax_pv = [&](float (&s)[kMTiles][Traits::kNTiles][4], int n_block, int stage) {
    float rescale[2 * kMTiles];
    softmax.update_max(s, scale_log2, rescale);
    rescale_rows_if_moved(acc_o, rescale);
    softmax.exp_accumulate(s, scale_log2, rescale);
    if constexpr (Traits::Has_dropout)
      dropout.apply(s, row_block0 + warp_row0, n_block * kBlockN, lane);
    gemm_pv<Traits>(acc_o, s, s_v + stage * kStageBytes, lane);
  };

  load_tile_async<Traits, kBlockM>(s_q, g_q, params.q_row_stride, seqlen_q - row_block0, tid);
  if constexpr (!Traits::Overlap) {
    // Ring of kStages K/V pairs: Q and the first kStages - 1 key blocks in the prologue, one
    // commit group each (Q rides with the first), so the group arithmetic holds for short ranges.
    //
    // A mask's tile states are read an iteration before they are needed (the block after the
    // one prefetched), so that no load waits at the top of the loop; the ring is then two
    // stages deep, the prefetched block being the next one.
    static_assert(!Traits::Has_cells || kStages == 2, "a mask's state pipeline");
    int state_cur = tile_state(n_end - 1), state_next = tile_state(n_end - 2);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      const int n_block = n_end - 1 - s;
      const int state = s == 0 ? state_cur : kMaskCellMixed;
      if (n_block >= n_begin && state != kMaskCellHidden) load_kv(n_block, s);
      if (n_block >= n_begin && state == kMaskCellMixed) load_mask(n_block, s);
      cp_async_commit();
    }
    for (int it = 0, n_block = n_end - 1; n_block >= n_begin; ++it, --n_block) {
      // Block n_block has landed (and, for it == 0, Q); the barrier also tells every warp that
      // the stage about to be refilled was released by all warps in the previous iteration.
      cp_async_wait<kStages - 2>();
      __syncthreads();
      const int state = state_cur, prefetch_state = state_next;
      state_cur = state_next;
      state_next = tile_state(n_block - 2);  // used by the next iteration
      const int n_prefetch = n_block - (kStages - 1);
      if (n_prefetch >= n_begin && prefetch_state != kMaskCellHidden)
        load_kv(n_prefetch, (it + kStages - 1) % kStages);
      if (n_prefetch >= n_begin && prefetch_state == kMaskCellMixed)
        load_mask(n_prefetch, (it + kStages - 1) % kStages);
      cp_async_commit();
      if (it == 0) load_q_regs();
      if (state == kMaskCellHidden) continue;  // CTA-uniform: every warp skips the block
      float acc_s[kMTiles][Traits::kNTiles][4];
      scores(acc_s, n_block, it % kStages, state);
      softmax_pv(acc_s, n_block, it % kStages);
    }
  } else {
    // Software pipeline: the MMAs of S_{j+1} = Q K_{j+1}^T are issued before the softmax of
    // block j, so the tensor cores work while the same warp does max / exp2 / rescale (the
    // intra-warp overlap of FlashAttention-3, on mma.sync). K runs one block ahead of V: two
    // K stages and two V stages, each refilled one iteration before it is read.
    const int n_blocks = max(n_end - n_begin, 0);
    auto load_k = [&](int it) {  // K of the it-th visited block (n_end - 1 - it) into stage it % 2
      const int n_block = n_end - 1 - it;
      kv.load_k(s_k + (it % 2) * kStageBytes, n_block, seqlen_k - n_block * kBlockN, tid);
    };
    auto load_v = [&](int it) {
      const int n_block = n_end - 1 - it;
      kv.load_v(s_v + (it % 2) * kStageBytes, n_block, seqlen_k - n_block * kBlockN, tid);
    };
    if (n_blocks > 0) load_k(0);
    cp_async_commit();  // group: Q, K_0
    if (n_blocks > 1) load_k(1);
    if (n_blocks > 0) load_v(0);
    cp_async_commit();  // group: K_1, V_0

    float s_even[kMTiles][Traits::kNTiles][4], s_odd[kMTiles][Traits::kNTiles][4];
    if (n_blocks > 0) {
      cp_async_wait<1>();
      __syncthreads();
      load_q_regs();
      scores(s_even, n_end - 1, 0, kMaskCellMixed);
    }
    // Step it: S_it is in `cur`; computes S_{it+1} into `next` and O += softmax(S_it) V_it.
    auto step = [&](float (&cur)[kMTiles][Traits::kNTiles][4],
                    float (&next)[kMTiles][Traits::kNTiles][4], int it) {
      // K_{it+1} and V_it have landed; every warp is done with K_it and V_{it-1}, whose stages
      // now take K_{it+2} and V_{it+1}.
      cp_async_wait<0>();
      __syncthreads();
      if (it + 2 < n_blocks) load_k(it + 2);
      if (it + 1 < n_blocks) load_v(it + 1);
      cp_async_commit();
      if (it + 1 < n_blocks) {
        gemm_qk<Traits>(next, r_q, s_q, s_k + ((it + 1) % 2) * kStageBytes, warp_row0, lane);
      }
      softmax_pv(cur, n_end - 1 - it, it % 2);
      if (it + 1 < n_blocks) logits(next, n_end - 2 - it, kMaskCellMixed, 0);  // (no mask here)
    };
    // Unrolled by two so that `cur` and `next` swap names instead of registers.
    for (int it = 0; it < n_blocks; it += 2) {
      step(s_even, s_odd, it);
      if (it + 1 < n_blocks) step(s_odd, s_even, it + 1);
    }
  }

  // Epilogue: normalise once, stage the warp's rows of O through shared memory (the Q tile,
  // which no warp reads any more after the barrier), then write 16-byte coalesced rows.
  float inv_sum[2 * kMTiles], lse[2 * kMTiles];
  softmax.finalize(scale_log2, inv_sum, lse);
  if (params.sinks != nullptr) {
    const float sink = params.sinks[head];
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) add_sink(sink, inv_sum[r], lse[r]);
  }
  if constexpr (Traits::Has_dropout) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) inv_sum[r] *= params.dropout_scale;
  }
  scale_rows(acc_o, inv_sum);

  cp_async_wait<0>();
  const bool bad = kv.barrier_any_bad();  // every warp is done with the Q tile, which takes O
  if (bad) {  // a cache's bad device value: NaN rows, not a plausible answer
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) inv_sum[r] = lse[r] = quiet_nan();
    scale_rows(acc_o, inv_sum);
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Traits::kDTiles; ++dt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + 16 * mt + lane / 4 + 8 * half;
        st_shared_b32(s_q + (Tile::offset(row, dt) + 2 * (lane % 4)) * Traits::kElemBytes,
                      Traits::Ops::pack2(acc_o[mt][dt][2 * half], acc_o[mt][dt][2 * half + 1]));
      }
    }
  }
  __syncthreads();

  Element* g_o = static_cast<Element*>(params.o_ptr) + batch * params.o_batch_stride +
                 head * params.o_head_stride + q_row0 * params.o_row_stride;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kChunks = kBlockM * kChunksPerRow;
#pragma unroll
  for (int it = 0; it < ceil_div(kChunks, Traits::kNThreads); ++it) {
    const int idx = it * Traits::kNThreads + tid;
    const int row = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    if ((kChunks % Traits::kNThreads == 0 || idx < kChunks) && row < seqlen_q - row_block0) {
      const uint4 o = ld_shared_b128(s_q + Tile::offset(row, chunk) * Traits::kElemBytes);
      if constexpr (Traits::Columns::kFull) {
        *reinterpret_cast<uint4*>(g_o + row * params.o_row_stride + chunk * 8) = o;
      } else {
        st_global_chunk<typename Traits::Columns>(g_o + row * params.o_row_stride, chunk, o);
      }
    }
  }

  if (params.lse_ptr != nullptr && lane % 4 == 0) {
    float* g_lse = params.lse_ptr + batch * params.lse_batch_stride +
                   head * params.lse_head_stride + rows_q.start;
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) {
      const int row = row_block0 + warp_row0 + 16 * (r / 2) + lane / 4 + 8 * (r % 2);
      if (row < seqlen_q) g_lse[row] = lse[r];
    }
  }
  return bad;
}

// A bad sequence (params.cuh's SeqRows: packed offsets or seqused_k out of range): the CTA's
// rows of O and LSE are NaN and nothing is read. Its first CTA reports the bits.
template <typename Traits>
CF_DEVICE void fa2_fwd_nan_block(const AttnParams& params, int m_block, int batch, int head,
                                 const SeqRows& rows) {
  using Element = typename Traits::Element;
  if (threadIdx.x == 0 && blockIdx.x == 0 && head == 0) report_error(params, rows.error_bits);
  const int row_block0 = m_block * Traits::kBlockM;
  const int rows_valid = min(rows.q.len - row_block0, Traits::kBlockM);
  if (rows_valid <= 0) return;
  const int64_t q_row0 = rows.q.start + row_block0;
  store_nan_rows<Traits, Traits::kBlockM>(
      static_cast<Element*>(params.o_ptr) + batch * params.o_batch_stride +
          head * params.o_head_stride + q_row0 * params.o_row_stride,
      params.o_row_stride, rows_valid, threadIdx.x);
  if (params.lse_ptr != nullptr) {
    store_nan_floats<Traits>(
        params.lse_ptr + batch * params.lse_batch_stride + head * params.lse_head_stride + q_row0,
        rows_valid, threadIdx.x);
  }
}

// attention / attention_varlen: K and V rows of batch entry b (packed: its cu_seqlens_k range).
template <typename Traits>
CF_DEVICE void fa2_fwd(const AttnParams& params) {
  using Element = typename Traits::Element;
  // Causal: the last query blocks see the most keys; launch them first so the long CTAs do not
  // straggle at the end of the grid.
  const int m_block = Traits::Is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int batch = blockIdx.y;
  const int head = blockIdx.z;
  const int head_k = head / params.h_h_k_ratio;
  const SeqRows rows = seq_rows(params, batch);
  if (rows.bad()) {
    fa2_fwd_nan_block<Traits>(params, m_block, batch, head, rows);
    return;
  }
  const DenseKv<Traits> kv{
      static_cast<const Element*>(params.k_ptr) + batch * params.k_batch_stride +
          head_k * params.k_head_stride + rows.k.start * params.k_row_stride,
      static_cast<const Element*>(params.v_ptr) + batch * params.v_batch_stride +
          head_k * params.v_head_stride + rows.k.start * params.v_row_stride,
      params.k_row_stride, params.v_row_stride};
  fa2_fwd_block<Traits>(params, m_block, batch, head, rows.q, rows.k.len, kv);
}

// Many query tokens against a KV cache (attention_with_kvcache past the decode kernel's query
// count, after its append), and packed sequences over a paged cache (attention_varlen's
// block_table): the keys through the cache view of kvcache.cuh, every device value checked.
template <typename Traits>
CF_DEVICE void fa2_fwd_kvcache(const DecodeParams& p) {
  using Element = typename Traits::Element;
  const AttnParams& params = p.attn;
  const int m_block = Traits::Is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int batch = blockIdx.y;
  const int head = blockIdx.z;
  const int head_k = head / params.h_h_k_ratio;
  const CacheSpan span = cache_span(p, batch);
  // Packed queries (cu_seqlens_q) are checked as attention_varlen's (the key span by cache_span):
  // bad offsets leave the sequence no query rows to read or write, so its CTAs stop here.
  int32_t q_bits = 0;
  const SeqRange rows_q =
      seq_range(params.cu_seqlens_q, batch, params.seqlen_q, kBadCuSeqlensQ, &q_bits);
  if (q_bits != 0) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && head == 0) report_error(p, q_bits | span.bits);
    return;
  }
  int bad_page = 0;
  const CacheKv<Traits> kv{
      cache_rows<Element>(p, params.k_ptr, params.k_batch_stride, params.k_row_stride,
                          params.k_head_stride, batch, head_k, span.entry, span.first_key),
      cache_rows<Element>(p, params.v_ptr, params.v_batch_stride, params.v_row_stride,
                          params.v_head_stride, batch, head_k, span.entry, span.first_key),
      &bad_page, span.bad()};
  const bool bad =
      fa2_fwd_block<Traits>(params, m_block, batch, head, rows_q, decode_seqlen_k(p, span), kv);
  // One report per sequence for its span (every CTA of it sees the same one), one per CTA for a
  // page (no page is read through a bad span).
  if (threadIdx.x == 0) {
    int32_t bits = blockIdx.x == 0 && head == 0 ? span.error_bits() : 0;
    if (bad && !span.bad()) bits |= kBadPage;
    report_error(p, bits);
  }
}
