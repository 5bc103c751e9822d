// Which keys a block of query rows sees: the range of key blocks to visit, whether a block needs
// element-wise masking, and the masking itself (causal / sliding window / ragged tail), for
// blocks of consecutive query rows (KeyMask) and for the decode kernel's packed GQA rows
// (PackedRowMask: row r is query token r / group), and the other way round for the backward: the
// query blocks that see a block of keys (QueryRangeOfKeys).
//
// Query row i sees key j iff  j < seqlen_k,
//                             j <= i + shift + window_right   (Is_causal; causal: window_right = 0)
//                             j >= i + shift - window_left    (Is_local)
//                             j < shift or bit j - shift of row i's tree word   (Is_tree, decode)
// with shift = seqlen_k - seqlen_q (bottom-right alignment, as flash-attn >= 2.1).
#pragma once

#include "common.cuh"

// The key of element e of 8-key tile nt of an m16n8 accumulator, from the tile's first key.
struct MmaKeyColumns {
  CF_DEVICE int operator()(int nt, int lane, int e) const {
    return 8 * nt + 2 * (lane % 4) + e % 2;
  }
};

template <int kBlockM, int kBlockN, bool Is_causal, bool Is_local>
struct KeyMask {
  int row_first;  // first query row of the block
  int row_last;   // last real query row of the block (< seqlen_q)
  int seqlen_k;
  int shift;
  int window_left, window_right;

  CF_DEVICE KeyMask(int m_block, int seqlen_q, int seqlen_k_, int window_left_, int window_right_)
      : row_first(m_block * kBlockM),
        row_last(min(m_block * kBlockM + kBlockM, seqlen_q) - 1),
        seqlen_k(seqlen_k_),
        shift(seqlen_k_ - seqlen_q),
        window_left(window_left_),
        window_right(window_right_) {}

  // First key block with a visible key for some row of the block.
  CF_DEVICE int n_block_begin() const {
    if (!Is_local) return 0;
    return max(0, row_first + shift - window_left) / kBlockN;
  }

  // One past the last key block with a visible key (<= n_block_begin() when none is visible).
  CF_DEVICE int n_block_end() const {
    int key_end = seqlen_k;
    if (Is_causal) key_end = min(key_end, row_last + shift + window_right + 1);
    return ceil_div(max(key_end, 0), kBlockN);
  }

  // Does key block n hide any key from any row of the block (ragged tail included)?
  CF_DEVICE bool needs_mask(int n_block) const {
    const int key_first = n_block * kBlockN;
    const int key_last = key_first + kBlockN - 1;
    bool partial = key_last >= seqlen_k;
    if (Is_causal) partial |= key_last > row_first + shift + window_right;
    if (Is_local) partial |= key_first < row_last + shift - window_left;
    return partial;
  }

  CF_DEVICE bool visible(int row, int key) const {
    bool ok = key < seqlen_k;
    if (Is_causal) ok &= key <= row + shift + window_right;
    if (Is_local) ok &= key >= row + shift - window_left;
    return ok;
  }

  // Set hidden scores of an MMA accumulator tile to -inf. Fragment layout of m16n8 tiles:
  // element e of tile (mt, nt) sits at row row0 + 16 mt + lane / 4 + 8 (e / 2),
  // key key0 + MmaKeyColumns{}(nt, lane, e).
  template <int kMTiles, int kNTiles>
  CF_DEVICE void apply(float (&s)[kMTiles][kNTiles][4], int row0, int key0, int lane) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2);
          const int key = key0 + MmaKeyColumns{}(nt, lane, e);
          if (!visible(row, key)) s[mt][nt][e] = neg_infinity();
        }
      }
    }
  }
};

// Which keys the packed rows of a CTA see: MMA row r holds query token (row0 + r) / group; the
// CTA's rows hold tokens query_first .. query_last. Is_tree (speculative decoding's tree, never
// with a causal or window bound): the query tokens are the last seqlen_q keys, the drafts; key j
// >= shift is draft j - shift, which row r sees iff bit j - shift of word r at tree_rows is set
// (the words built once per CTA, in shared memory); every key before the drafts is visible.
// Wide_tree: 64-bit words (33 to 64 drafts), where a 32-bit word holds up to 32.
template <bool Wide_tree>
struct TreeWordOf {
  using type = uint32_t;
};
template <>
struct TreeWordOf<true> {
  using type = uint64_t;
};

template <bool Is_causal, bool Is_local = false, bool Is_tree = false, bool Wide_tree = false>
struct PackedRowMask {
  static_assert(!(Is_tree && (Is_causal || Is_local)), "the tree replaces the causal rule");
  static_assert(Is_tree || !Wide_tree, "a wide tree is a tree");
  using TreeWord = typename TreeWordOf<Wide_tree>::type;
  static constexpr int kTreeBits = 8 * static_cast<int>(sizeof(TreeWord));
  KeyMask<1, 1, Is_causal, Is_local> keys;  // the visibility rule per query token
  int row0, group, query_first, query_last;
  // Is_tree: the shared-memory address of [kBlockM] words, one per packed row of the CTA (a
  // 32-bit shared address: one register across the key loop, where a pointer would hold two).
  uint32_t tree_rows;

  CF_DEVICE PackedRowMask(int row0_, int row_end, int group_, int seqlen_q, int seqlen_k,
                          int window_left, int window_right, uint32_t tree_rows_ = 0)
      : keys(0, seqlen_q, seqlen_k, window_left, window_right),
        row0(row0_),
        group(group_),
        query_first(row0_ / group_),
        query_last((row_end - 1) / group_),
        tree_rows(tree_rows_) {}

  // Does the key range hide a key from some row (the ragged tail, the causal edge, the window,
  // the drafts of a tree)?
  CF_DEVICE bool needs_mask(int key_first, int key_last) const {
    bool partial = key_last >= keys.seqlen_k;
    if (Is_causal) partial |= key_last > query_first + keys.shift + keys.window_right;
    if (Is_local) partial |= key_first < query_last + keys.shift - keys.window_left;
    if (Is_tree) partial |= key_last >= keys.shift;
    return partial;
  }

  // Fragment layout as KeyMask::apply: element e of tile (mt, nt) is row 16 mt + lane / 4 +
  // 8 (e / 2), key key0 + key_of(nt, lane, e) (MmaKeyColumns: 8 nt + 2 (lane % 4) + e % 2).
  template <int kMTiles, int kNTiles, typename KeyColumns = MmaKeyColumns>
  CF_DEVICE void apply(float (&s)[kMTiles][kNTiles][4], int key0, int lane,
                       KeyColumns key_of = {}) const {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 16 * mt + lane / 4 + 8 * half;
        const int query = (row0 + row) / group;
        TreeWord tree_word = 0;
        if constexpr (Wide_tree) {
          const uint2 halves = ld_shared_b64(tree_rows + 8 * row);
          tree_word = (static_cast<uint64_t>(halves.y) << 32) | halves.x;
        } else if constexpr (Is_tree) {
          tree_word = ld_shared_b32(tree_rows + 4 * row);
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            const int key = key0 + key_of(nt, lane, e);
            bool visible;
            if constexpr (Is_tree) {  // a key before the drafts, or a draft the row's word names
              // (the word has no bit at or past seqlen_q: the ragged tail is hidden with it)
              const int draft = key - keys.shift;
              visible = draft < 0 || (draft < kTreeBits && ((tree_word >> draft) & 1u));
            } else {
              visible = keys.visible(query, key);
            }
            if (!visible) s[mt][nt][e] = neg_infinity();
          }
      }
  }
};

// Which query rows see a block of keys (the transpose of KeyMask: rows i with a visible key j,
// j <= i + shift + window_right and j >= i + shift - window_left).
template <int kBlockM, int kBlockN, bool Is_causal, bool Is_local>
struct QueryRangeOfKeys {
  KeyMask<kBlockM, kBlockN, Is_causal, Is_local> keys;  // visible(row, key) and the bounds
  int key_first, seqlen_q;

  CF_DEVICE QueryRangeOfKeys(int n_block, int seqlen_q_, int seqlen_k, int window_left,
                             int window_right)
      : keys(0, seqlen_q_, seqlen_k, window_left, window_right),
        key_first(n_block * kBlockN),
        seqlen_q(seqlen_q_) {}

  CF_DEVICE int m_block_begin() const {
    if (!Is_causal) return 0;
    return max(0, key_first - keys.shift - keys.window_right) / kBlockM;
  }

  CF_DEVICE int m_block_end() const {
    int row_end = seqlen_q;
    if (Is_local) {
      const int key_last = min(key_first + kBlockN, keys.seqlen_k) - 1;
      row_end = min(row_end, key_last - keys.shift + keys.window_left + 1);
    }
    return ceil_div(max(row_end, 0), kBlockM);
  }

  // Does some (row, key) of the tile fall outside the mask or past the last key?
  CF_DEVICE bool needs_mask(int m_block) const {
    const int row_first = m_block * kBlockM;
    const int row_last = min(row_first + kBlockM, seqlen_q) - 1;
    const int key_last = key_first + kBlockN - 1;
    bool partial = key_last >= keys.seqlen_k;
    if (Is_causal) partial |= key_last > row_first + keys.shift + keys.window_right;
    if (Is_local) partial |= key_first < row_last + keys.shift - keys.window_left;
    return partial;
  }

  // -inf at the rows of a transposed tile (as apply's) at or past `rows`: a packed sequence's
  // rows end there, and a score hook sees the rows past it (its guard is the packed total's).
  template <int kNTiles>
  static CF_DEVICE void hide_rows_from(float (&s)[1][kNTiles][4], int row0, int rows, int lane) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (row0 + 8 * nt + 2 * (lane % 4) + e % 2 >= rows) s[0][nt][e] = neg_infinity();
  }

  // -inf at hidden (row, key) of a transposed tile: element e of tile (0, nt) is key
  // key0 + lane / 4 + 8 (e / 2), query row row0 + 8 nt + 2 (lane % 4) + e % 2.
  template <int kNTiles>
  CF_DEVICE void apply(float (&s)[1][kNTiles][4], int key0, int row0, int lane) const {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + lane / 4 + 8 * (e / 2);
        const int row = row0 + 8 * nt + 2 * (lane % 4) + e % 2;
        if (!keys.visible(row, key)) s[0][nt][e] = neg_infinity();
      }
  }

  // The rows that see `key`, as offsets from the thread's first row thread_row0: lo <= offset <=
  // hi, offset = 8 nt + c for column tile nt of a transposed tile (none past the last key).
  template <int kNTiles>
  CF_DEVICE void visible_offsets(int key, int thread_row0, int& lo, int& hi) const {
    // row >= key - shift - window_right (causal), row <= key - shift + window_left (local)
    lo = Is_causal ? key - keys.shift - keys.window_right - thread_row0 : 0;
    hi = Is_local ? key - keys.shift + keys.window_left - thread_row0 : 8 * kNTiles;
    if (key >= keys.seqlen_k) hi = -1;  // past the last key: no row
  }

  // The same as apply, with a key's visible rows as one range of offsets from the thread's first
  // row (lo <= 8 nt + e % 2 <= hi): a compare with an immediate per score, not row arithmetic.
  // The Hopper backward at d = 64 holds 192 accumulators here, where apply's per-row sums
  // spilled; the mma.sync backward (fa2_bwd.cu) keeps apply, where this form spilled 8 bytes in
  // two sm_80 variants (d = 128 causal softcap dropout, d = 64 causal additive mask det).
  template <int kNTiles>
  CF_DEVICE void apply_by_row_offsets(float (&s)[1][kNTiles][4], int key0, int row0,
                                      int lane) const {
    const int thread_row0 = row0 + 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int lo, hi;
      visible_offsets<kNTiles>(key0 + lane / 4 + 8 * half, thread_row0, lo, hi);
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int offset = 8 * nt + c;
          if (offset < lo || offset > hi) s[0][nt][2 * half + c] = neg_infinity();
        }
    }
  }
};
