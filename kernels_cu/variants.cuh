// Score variants: the transform a raw score q . k goes through before the mask and the online
// softmax (FlashInfer's LogitsTransform). Every kernel calls its variant at one place, on an
// m16n8 accumulator tile (transform_scores) or on one score (the naive softmax), so ALiBi, a bias
// tile or a user score function is one more struct here, not an edit of every kernel.
//
// A variant is constructed from the kernel's AttnParams (and, where the kernel knows them, the
// batch entry, query head and shift = seqlen_k - seqlen_q of its tile) and maps (score, query
// row, key) to the logit; the row and key are those of the sequence (what ALiBi indexes by).
// The factor the softmax multiplies the logit by is softmax_scale_log2 (params.cuh).
#pragma once

#include "common.cuh"
#include "params.cuh"

// logit(s) = s: plain attention (the scale is folded into softmax_scale_log2).
struct NoScoreTransform {
  static constexpr bool kHasScoreMod = false;  // (as UserMods': the Hopper backward reads it)
  static constexpr bool kGradIsOne = true;
  CF_DEVICE explicit NoScoreTransform(const AttnParams&) {}
  CF_DEVICE NoScoreTransform(const AttnParams& p, int /*batch*/, int /*head*/, int /*shift*/)
      : NoScoreTransform(p) {}
  CF_DEVICE float operator()(float score, int /*row*/, int /*key*/) const { return score; }
};

// logit(s) = tanh(s * scale / softcap) (Gemma 2's soft cap); the softcap factor itself is folded
// into softmax_scale_log2. The params are read at each use, so the prescale stays an operand
// from parameter memory rather than a register held across the main loop.
struct Softcap {
  const AttnParams& params;
  CF_DEVICE explicit Softcap(const AttnParams& p) : params(p) {}
  CF_DEVICE Softcap(const AttnParams& p, int /*batch*/, int /*head*/, int /*shift*/) : params(p) {}
  CF_DEVICE float operator()(float score, int /*row*/, int /*key*/) const {
    return fast_tanh(score * params.softcap_prescale);
  }
};

// logit(s) = s - slope / M * |row + shift - key| (ALiBi; M the softmax's multiplier, so that the
// softmax sees scale * s - slope * |i + shift - j|, flash-attn's bias). Needs the tile's batch
// entry and query head (the slope) and its sequence's shift.
struct Alibi {
  float coef;  // -slope / M, M = softmax_scale_log2 / log2 e (params.cuh: alibi_scale)
  int shift;
  CF_DEVICE Alibi(const AttnParams& p, int batch, int head, int shift_)
      : coef(-p.alibi_slopes[batch * p.alibi_batch_stride + head] * p.alibi_scale), shift(shift_) {}
  CF_DEVICE float operator()(float score, int row, int key) const {
    return fmaf(coef, static_cast<float>(abs(row + shift - key)), score);
  }
  // The tile loops' form: row + shift - key converted once for a thread's first row and key,
  // each score's distance that plus its small offset in float, then the same FFMA (|x| free).
  // Exact while the distances stay below 2^24, as the operator's conversion.
  CF_DEVICE float distance(int row, int key) const { return static_cast<float>(row + shift - key); }
  CF_DEVICE float at_distance(float score, float distance) const {
    return fmaf(coef, fabsf(distance), score);
  }
};

// logit(s) = tanh(s * scale / softcap) - slope / M * |row + shift - key|: the cap, then ALiBi's
// bias (flash-attn's order; M = softcap here, the softcap being folded into the multiplier).
struct SoftcapAlibi {
  Softcap cap;
  Alibi alibi;
  CF_DEVICE SoftcapAlibi(const AttnParams& p, int batch, int head, int shift)
      : cap(p), alibi(p, batch, head, shift) {}
  CF_DEVICE float operator()(float score, int row, int key) const {
    return alibi(cap(score, row, key), row, key);
  }
};

// dS through the softcap: d(c tanh(z / c))/dz = 1 - t^2 with t the capped score. A masked logit
// (-inf, P = 0) would give 0 * inf; its dS is 0.
CF_DEVICE float softcap_grad(float ds, float prob, float t) {
  return prob != 0.f ? ds * (1.f - t * t) : 0.f;
}

// The capped score t of a logit, whose 1 - t^2 is the softcap's derivative in the backward: the
// logit itself, less ALiBi's bias where that follows the cap (recomputed, not held in registers).
template <typename Transform>
CF_DEVICE float capped_score(const Transform&, float logit, int /*row*/, int /*key*/) {
  return logit;
}
CF_DEVICE float capped_score(const SoftcapAlibi& t, float logit, int row, int key) {
  return logit - t.alibi(0.f, row, key);
}

// Kinds of an attention mask (SDPA's attn_mask; AttnParams::bias_ptr): none, additive in the
// kernel's element type, boolean (one byte per element: true = the key takes part).
enum : int { kNoBias = 0, kAdditiveBias = 1, kBoolBias = 2, kUserMods = 3 };

// logit(s) = s + bias / M for an additive mask (M the softmax's multiplier, as ALiBi's: the
// softmax sees scale * s + bias), or s where a boolean mask holds and -inf where it does not.
// The mask is [B|1, H|1, Nq|1, Nk|1] through strides (0 on a broadcast axis); (row, key) past the
// sequence are not read (the key mask hides those keys, and no row past Nq is stored).
template <typename BiasElement, bool Is_bool>
struct AttnBias {
  const BiasElement* base;  // the tile's batch entry and query head
  int64_t row_stride, key_stride;
  float scale;
  int rows, keys;
  CF_DEVICE AttnBias(const AttnParams& p, int batch, int head, int /*shift*/)
      : base(static_cast<const BiasElement*>(p.bias_ptr) + batch * p.bias_batch_stride +
             head * p.bias_head_stride),
        row_stride(p.bias_row_stride),
        key_stride(p.bias_key_stride),
        scale(p.alibi_scale),
        rows(p.seqlen_q),
        keys(p.seqlen_k) {}
  CF_DEVICE float operator()(float score, int row, int key) const {
    if (row >= rows || key >= keys) return score;
    return apply(score, base[row * row_stride + key * key_stride]);
  }
  CF_DEVICE float apply(float score, BiasElement b) const {
    if constexpr (Is_bool) {
      return b != 0 ? score : neg_infinity();
    } else {
      return fmaf(to_float(b), scale, score);
    }
  }
  // Elements per 16-byte chunk, and whether the tiles can be copied in such chunks (the
  // forward's staged tiles, fa2_fwd.cu): keys contiguous, every row 16-byte aligned, and whole
  // chunks of keys (no chunk reaches past the last key). CTA-uniform.
  static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(BiasElement));
  CF_DEVICE bool stageable() const {
    return key_stride == 1 && row_stride % kChunkElems == 0 && keys % kChunkElems == 0 &&
           reinterpret_cast<unsigned long long>(base) % 16 == 0;
  }
};

// A cell of the mask's block summary (AttnParams::mask_cells; kernels_cu/attn_mask.cuh): every
// key hidden (boolean false, additive -inf), every key shown unchanged (boolean true, additive
// exactly 0), anything else (NaN included: it must reach the output), or past the mask's rows or
// keys (the summary covers whole tiles of every kernel of the launch; such a cell counts for
// nothing).
enum : int { kMaskCellHidden = 0, kMaskCellMixed = 1, kMaskCellPlain = 2, kMaskCellEmpty = 3 };

// The state of a tile of kBlockM query rows from row0 and kBlockN keys from key0 of query head
// `head`, from the summary's cells covering it. An attn_mask's cells are the tiles of the launch's
// smallest kernel: kOneCell where the caller's tile is one cell (the forward; one load), else a
// tile spans a few cells (the backward's key-block kernel beside its dQ kernel). A BlockMask's
// cells have the size its maker chose: a tile spans a few, or lies in one (whose state is then
// the tile's: hidden or plain hold for every part of a cell; mixed is left to the function).
// Uniform over the CTA: a broadcast load per cell.
template <int kBlockM, int kBlockN, bool kOneCell>
CF_DEVICE int mask_tile_state(const AttnParams& p, int batch, int head, int row0, int key0) {
  const unsigned char* cells =
      p.mask_cells + batch * p.mask_cells_batch_stride + head * p.mask_cells_head_stride;
  const int m0 = row0 >> p.mask_cell_rows_log2;
  const int n0 = key0 >> p.mask_cell_keys_log2;
  if constexpr (kOneCell) {
    const int c = __ldg(cells + m0 * p.mask_cells_row_stride + n0 * p.mask_cells_key_stride);
    return c == kMaskCellEmpty ? kMaskCellHidden : c;
  } else {
    const int cells_m = max(kBlockM >> p.mask_cell_rows_log2, 1);
    const int cells_n = max(kBlockN >> p.mask_cell_keys_log2, 1);
    bool any_shown = false, all_plain = true;
    for (int m = 0; m < cells_m; ++m)
      for (int n = 0; n < cells_n; ++n) {
        const int c =
            __ldg(cells + (m0 + m) * p.mask_cells_row_stride + (n0 + n) * p.mask_cells_key_stride);
        any_shown |= c == kMaskCellMixed || c == kMaskCellPlain;
        all_plain &= c == kMaskCellPlain || c == kMaskCellEmpty;
      }
    return !any_shown ? kMaskCellHidden : all_plain ? kMaskCellPlain : kMaskCellMixed;
  }
}

// A BlockMask's bounds on a tile's loop (AttnParams::mask_key_ranges, mask_row_ranges: a user
// mask_mod's summary, cupyflash.create_block_mask), as causal / window bounds narrow it; no change
// without one. The ranges are kept per kMaskRangeBlock rows (keys), so that any kernel's tile
// (at most that many rows and keys, at a multiple of its size) reads one: one load, which the
// Hopper producer's 24 registers hold (a loop over cells spilled 36-40 bytes there). CTA-uniform.
constexpr int kMaskRangeBlock = 128;

// The key blocks [n_begin, n_end) of the kBlockM query rows from row0 of query head `head` (of
// `rows` query rows): only those holding a key that some row of the tile's range blocks sees.
template <int kBlockM, int kBlockN>
CF_DEVICE void block_mask_key_blocks(const AttnParams& p, int batch, int head, int row0, int rows,
                                     int& n_begin, int& n_end) {
  static_assert(
      kMaskRangeBlock % kBlockM == 0 || (kBlockM % 64 == 0 && kBlockM <= kMaskRangeBlock + 64),
      "a tile lies in one range block, or (64-row parts from a multiple of 64) in two");
  if (p.mask_key_ranges == nullptr) return;
  const int2* ranges =
      reinterpret_cast<const int2*>(p.mask_key_ranges + batch * p.mask_key_ranges_batch_stride +
                                    head * p.mask_key_ranges_head_stride);
  int2 keys = __ldg(ranges + row0 / kMaskRangeBlock);
  if constexpr (kMaskRangeBlock % kBlockM != 0) {
    // A tile of three 64-row parts (192 rows from a multiple of 192) spans two range blocks:
    // the keys either one's rows see (the second only where a row of the tile is in it: the
    // ranges cover the mask's rows, not a last tile's padding).
    const int2 last = __ldg(ranges + (min(row0 + kBlockM, rows) - 1) / kMaskRangeBlock);
    if (keys.x >= keys.y)
      keys = last;
    else if (last.x < last.y)
      keys.x = min(keys.x, last.x), keys.y = max(keys.y, last.y);
  }
  if (keys.x >= keys.y) {  // every key hidden from every row
    n_end = n_begin;
    return;
  }
  n_begin = max(n_begin, keys.x / kBlockN);
  n_end = min(n_end, ceil_div(keys.y, kBlockN));
}

// The query blocks [m_begin, m_end) that see the kBlockN keys from key0, for any of the `heads`
// query heads from head0 (the backward's CTA of a KV head serves its GQA group): only those
// holding a row that sees some key of the block's range block.
template <int kBlockM, int kBlockN>
CF_DEVICE void block_mask_row_blocks(const AttnParams& p, int batch, int head0, int heads, int key0,
                                     int& m_begin, int& m_end) {
  static_assert(kMaskRangeBlock % kBlockN == 0, "a tile lies in one range block");
  if (p.mask_row_ranges == nullptr) return;
  if (p.mask_row_ranges_head_stride == 0) heads = 1;  // one mask for every head
  int first = 0x7fffffff, end = 0;
  for (int h = head0; h < head0 + heads; ++h) {
    const int2 rows = __ldg(reinterpret_cast<const int2*>(p.mask_row_ranges +
                                                          batch * p.mask_row_ranges_batch_stride +
                                                          h * p.mask_row_ranges_head_stride) +
                            key0 / kMaskRangeBlock);
    if (rows.x < rows.y) {
      first = min(first, rows.x);
      end = max(end, rows.y);
    }
  }
  if (end == 0) {  // every row hidden from every key
    m_end = m_begin;
    return;
  }
  m_begin = max(m_begin, first / kBlockM);
  m_end = min(m_end, ceil_div(end, kBlockM));
}

// The variant of a kernel's flags (a mask does not combine with softcap or ALiBi yet).
template <typename Element, bool Has_softcap, bool Has_alibi, int kBias>
struct SelectScoreTransform {
  static_assert(kBias == kNoBias || !(Has_softcap || Has_alibi),
                "a mask does not combine with softcap or ALiBi yet");
  using type = NoScoreTransform;
};
template <typename Element>
struct SelectScoreTransform<Element, true, false, kNoBias> {
  using type = Softcap;
};
template <typename Element>
struct SelectScoreTransform<Element, false, true, kNoBias> {
  using type = Alibi;
};
template <typename Element>
struct SelectScoreTransform<Element, true, true, kNoBias> {
  using type = SoftcapAlibi;
};
template <typename Element>
struct SelectScoreTransform<Element, false, false, kAdditiveBias> {
  using type = AttnBias<Element, false>;
};
template <typename Element>
struct SelectScoreTransform<Element, false, false, kBoolBias> {
  using type = AttnBias<unsigned char, true>;
};

// UserMods (below) on a block mask's plain tile, as a variant transform_scores takes: score_mod
// alone, nothing at all without one (kIdentity). (A template, so that kernels without
// CF_USER_MODS can name it in a discarded branch.)
template <typename Mods>
struct ScoreOnly {
  static constexpr bool kIdentity = !Mods::kHasScoreMod;
  static constexpr bool kByParts = true;
  using Row = typename Mods::Row;
  using Key = typename Mods::Key;
  Mods mods;
  CF_DEVICE float operator()(float score, int row, int key) const {
    return mods.score_only(score, row, key);
  }
  CF_DEVICE Row row_part(int row) const { return mods.row_part(row); }
  CF_DEVICE Key key_part(int key) const { return mods.key_part(key); }
  CF_DEVICE bool inside(int row, int key) const { return mods.inside(row, key); }
  CF_DEVICE float at(float score, int row, int key, const Row& r, const Key& k) const {
    return mods.score_only_at(score, row, key, r, k);
  }
};

// A transform that leaves every score as it is (its kIdentity, where it has one): the loops
// applying it are not written.
template <typename Transform, typename = void>
struct IsIdentity {
  static constexpr bool value = false;
};
template <typename Transform>
struct IsIdentity<Transform, decltype(void(Transform::kIdentity))> {
  static constexpr bool value = Transform::kIdentity;
};

// A transform whose scores share per-row and per-key parts (UserMods: what a score_mod or
// mask_mod computes from q_idx or kv_idx alone, a document id's read): transform_scores computes
// each row's and key's part once for the scores of the thread's fragment that share it.
template <typename Transform, typename = void>
struct ByParts {
  static constexpr bool value = false;
};
template <typename Transform>
struct ByParts<Transform, decltype(void(Transform::kByParts))> {
  static constexpr bool value = Transform::kByParts;
};

// The class of a kBlockM x kBlockN tile of a user mask_mod's BlockMask (mask_tile_state): mixed
// without one (no summary: mask_mod on every score).
template <int kBlockM, int kBlockN>
CF_DEVICE int block_mask_tile_state(const AttnParams& p, int batch, int head, int row0, int key0) {
  if (p.mask_cells == nullptr) return kMaskCellMixed;
  return mask_tile_state<kBlockM, kBlockN, /*kOneCell=*/false>(p, batch, head, row0, key0);
}

#ifdef CF_USER_MODS
// logit(s) = score_mod(s * scale, b, h, row, key), -inf where mask_mod(b, h, row, key) is false
// (FlexAttention's score_mod / mask_mod, traced in Python: cupyflash/_mods.py writes cf_user_mods
// and defines CF_USER_MODS before this file). The function sees the scaled score and returns the
// logit, so the softmax multiplies by log2 e alone (params.cuh: mod_score_scale). (row, key)
// past the sequence are left alone: the key mask hides those keys, no row past Nq is stored,
// and the function's captured arrays are not read out of their range there.
// What the functions read that depends on (b, h) alone (ALiBi's slope, a per-head table's value)
// is read once here, per tile: in a hook called score by score, each call in its own branch, the
// compiler reloads it for every score (cf_user_mods_head, written by cupyflash/_mods.py).
struct UserMods {
  // A mask_mod alone changes no score: the kernels keep their own scale (mod_score_scale is 1)
  // and a block mask's plain tile runs no code (transform_scores skips ScoreOnly).
  static constexpr bool kHasScoreMod = cf_user_has_score_mod;
  // A score_mod alone: every tile is mixed (no BlockMask), so the plain tiles' copy of the hook
  // is not written (user_mods_by_state).
  static constexpr bool kHasMaskMod = cf_user_has_mask_mod;
  // d score_mod / d score is 1 everywhere (an additive bias): grad() need not be called.
  static constexpr bool kGradIsOne = cf_user_grad_is_one;
  // The Hopper forward reads each key's part ahead of its scores (PartsAhead): a mask_mod alone
  // whose key part is one 32-bit read, a document id, 32 registers a thread (_mods.py's
  // READ_KEYS_AHEAD says when). A part of index arithmetic alone (ALiBi's) has no load to hide.
  static constexpr bool kKeysAhead = cf_user_keys_ahead;
  // Neither function reads a captured array at an index of the row or the key (PastUnguarded).
  static constexpr bool kReadsByIndex = cf_user_reads_by_index;
  const AttnParams& params;
  int batch, head, rows, keys;
  CfUserModsState state;
  CF_DEVICE UserMods(const AttnParams& p, int batch_, int head_, int /*shift*/)
      : params(p), batch(batch_), head(head_), rows(p.seqlen_q), keys(p.seqlen_k) {
    cf_user_mods_head(p, batch_, head_, state);
  }
  CF_DEVICE float operator()(float score, int row, int key) const {
    if (row >= rows || key >= keys) return score;
    const float scaled = kHasScoreMod ? score * params.mod_score_scale : score;
    return cf_user_mods(params, state, scaled, batch, head, row, key);
  }
  // A block mask's plain tile (every key of it shown: cupyflash.create_block_mask): score_mod
  // alone, mask_mod not evaluated.
  CF_DEVICE float score_only(float score, int row, int key) const {
    if (row >= rows || key >= keys) return score;
    return cf_user_score(params, state, score * params.mod_score_scale, batch, head, row, key);
  }
  // The same by parts (transform_scores): what depends on the row alone, or on the key alone,
  // computed once for the scores that share it. A row or key past the sequence has its part
  // computed all the same (each read is checked against its array's shape), with no branch: a
  // branch around each part made each read wait for the one before it. `at` is for the scores
  // inside() alone (past the sequence the score is left as it is, as operator() leaves it).
  static constexpr bool kByParts = true;
  using Row = CfUserRow;
  using Key = CfUserKey;
  CF_DEVICE Row row_part(int row) const {
    Row r;
    cf_user_row(params, state, batch, head, row, r);
    return r;
  }
  CF_DEVICE Key key_part(int key) const {
    Key k;
    cf_user_key(params, state, batch, head, key, k);
    return k;
  }
  CF_DEVICE bool inside(int row, int key) const { return row < rows && key < keys; }
  CF_DEVICE float at(float score, int row, int key, const Row& r, const Key& k) const {
    const float scaled = kHasScoreMod ? score * params.mod_score_scale : score;
    return cf_user_mods_at(params, state, r, k, scaled, batch, head, row, key);
  }
  CF_DEVICE float score_only_at(float score, int row, int key, const Row& r, const Key& k) const {
    return cf_user_score_at(params, state, r, k, score * params.mod_score_scale, batch, head, row,
                            key);
  }
  // The backward's d logit / d (scaled score) at the raw score: score_mod's derivative (the
  // kernels' dq_scale / dk_scale carry the scale itself).
  CF_DEVICE float grad(float score, int row, int key) const {
    if (row >= rows || key >= keys) return 1.f;
    return cf_user_mods_grad(params, state, score * params.mod_score_scale, batch, head, row, key);
  }
};
template <typename Element>
struct SelectScoreTransform<Element, false, false, kUserMods> {
  using type = UserMods;
};
#endif

// A transform that reads a captured array at an index of the row or the key (UserMods'
// kReadsByIndex; any other transform is taken to).
template <typename Transform, typename = void>
struct ReadsByIndex {
  static constexpr bool value = true;
};
template <typename Transform>
struct ReadsByIndex<Transform, decltype(void(Transform::kReadsByIndex))> {
  static constexpr bool value = Transform::kReadsByIndex;
};

// A forward's score functions applied past the sequence too, with no branch per score, where
// they read no captured array by row or key (!ReadsByIndex): the key mask hides the keys past
// the sequence after them, no row past it is stored, and no read needs keeping inside an array.
// (Not in a backward: there a row past the sequence meets dO's zeros, and a NaN of the
// function's would reach dK and dV.) At d = 64 on three consumers the branches cost ALiBi's
// score_mod 108 bytes of spill (sm_90a, 160 registers a consumer); none without them.
template <typename Mods>
struct PastUnguarded : Mods {
  CF_DEVICE explicit PastUnguarded(const Mods& mods) : Mods(mods) {}
  CF_DEVICE bool inside(int /*row*/, int /*key*/) const { return true; }
};

// The class of a tile of mask_mod's, without a BlockMask: cupyflash/_mod_tiles.py reads the
// traced mask over the tile's rows and keys as intervals (cf_user_mask_tile: hidden, plain or
// mixed, an answer other than mixed holding for every score of it) and defines
// CF_USER_MASK_TILES where a call asks for it. The kernels call it under `if constexpr
// (user_mask_tiles())`, so that a variant without it compiles to the code it had before. Bounds
// clipped to the sequence (rows and keys past it are the kernels' to drop).
#ifdef CF_USER_MASK_TILES
CF_DEVICE constexpr bool user_mask_tiles() { return true; }
template <int kBlockM, int kBlockN>
CF_DEVICE int user_mask_tile_state(const AttnParams& p, int batch, int head, int row0, int key0,
                                   int seqlen_q, int seqlen_k) {
  return cf_user_mask_tile(p, batch, head, row0, min(row0 + kBlockM, seqlen_q) - 1, key0,
                           min(key0 + kBlockN, seqlen_k) - 1);
}
#else
CF_DEVICE constexpr bool user_mask_tiles() { return false; }
template <int kBlockM, int kBlockN>
CF_DEVICE int user_mask_tile_state(const AttnParams&, int, int, int, int, int, int) {
  return kMaskCellMixed;
}
#endif

template <bool Has_softcap, bool Has_alibi = false, int kBias = kNoBias, typename Element = __half>
using ScoreTransform = typename SelectScoreTransform<Element, Has_softcap, Has_alibi, kBias>::type;

// A ByParts transform on the two scores of key `key` (column c of an m16n8 tile, rows `row` and
// row + 8), from those rows' parts r and the key's part k.
template <typename Transform, typename Row, typename Key>
CF_DEVICE void apply_parts(const Transform& transform, float (&tile)[4], int c, int row, int key,
                           const Row (&r)[2], const Key& k) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float& score = tile[2 * half + c];
    if (transform.inside(row + 8 * half, key))
      score = transform.at(score, row + 8 * half, key, r[half], k);
  }
}

// Apply a variant to a tile of scores. Fragment layout of m16n8 tiles (as KeyMask::apply):
// element e of tile (mt, nt) is row row0 + 16 mt + lane / 4 + 8 (e / 2),
// key key0 + 8 nt + 2 (lane % 4) + e % 2.
template <typename Transform, int kMTiles, int kNTiles>
CF_DEVICE void transform_scores(const Transform& transform, float (&s)[kMTiles][kNTiles][4],
                                int row0, int key0, int lane) {
  if constexpr (IsIdentity<Transform>::value) {
    return;
  } else if constexpr (ByParts<Transform>::value) {
    // a thread's 2 rows of a row tile, then each of its keys once for both rows: 2 + 2 kNTiles
    // parts for 4 kNTiles scores. (A branch per score: computing every score and selecting
    // spilled the Hopper forward at d = 64 and 80 and the Hopper backward at d = 64.)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int row = row0 + 16 * mt + lane / 4;
      const typename Transform::Row r[2] = {transform.row_part(row), transform.row_part(row + 8)};
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int key = key0 + 8 * nt + 2 * (lane % 4) + c;
          apply_parts(transform, s[mt][nt], c, row, key, r, transform.key_part(key));
        }
        // (as AttnBias's: the reads of the whole tile hoisted together spill the FA2 tiles)
        asm volatile("" ::: "memory");
      }
    }
  } else {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2);
          const int key = key0 + 8 * nt + 2 * (lane % 4) + e % 2;
          s[mt][nt][e] = transform(s[mt][nt][e], row, key);
        }
  }
}

// A mask reads one element per score: a column of key tiles at a time, a compiler barrier between
// them, so that the loads of the whole tile are not hoisted together (with their addresses they
// spilled the FA2 tiles).
template <typename BiasElement, bool Is_bool, int kMTiles, int kNTiles>
CF_DEVICE void transform_scores(const AttnBias<BiasElement, Is_bool>& transform,
                                float (&s)[kMTiles][kNTiles][4], int row0, int key0, int lane) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2);
        const int key = key0 + 8 * nt + 2 * (lane % 4) + e % 2;
        s[mt][nt][e] = transform(s[mt][nt][e], row, key);
      }
    asm volatile("" ::: "memory");
  }
}

// A mask on a tile of scores from its staged copy in shared memory (s_tile: the tile's rows
// kRowBytes apart, from the CTA's first row and the block's first key; fa2_fwd.cu's
// load_mask_tile). Each thread reads its two adjacent keys of a row as one 2- or 4-byte word; the
// rows' 16 bytes of padding put the 8 rows a warp reads at once in distinct banks.
template <int kRowBytes, typename BiasElement, bool Is_bool, int kMTiles, int kNTiles>
CF_DEVICE void transform_scores_staged(const AttnBias<BiasElement, Is_bool>& bias,
                                       float (&s)[kMTiles][kNTiles][4], uint32_t s_tile,
                                       int warp_row0, int lane) {
  constexpr int kElemBytes = static_cast<int>(sizeof(BiasElement));
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp_row0 + 16 * mt + lane / 4 + 8 * half;
        const uint32_t addr = s_tile + row * kRowBytes + (8 * nt + 2 * (lane % 4)) * kElemBytes;
        BiasElement pair[2];
        if constexpr (kElemBytes == 2) {
          const uint32_t word = ld_shared_b32(addr);
          pair[0] = *reinterpret_cast<const BiasElement*>(&word);
          pair[1] = *(reinterpret_cast<const BiasElement*>(&word) + 1);
        } else {
          const uint32_t word = ld_shared_u16(addr);
          pair[0] = static_cast<BiasElement>(word & 0xffu);
          pair[1] = static_cast<BiasElement>(word >> 8);
        }
#pragma unroll
        for (int c = 0; c < 2; ++c)
          s[mt][nt][2 * half + c] = bias.apply(s[mt][nt][2 * half + c], pair[c]);
      }
}

// ALiBi over a tile: |row + shift - key| as the float of the integer row + shift - key0 (less
// the thread's first key in the tile) less the key's offset in the tile, one conversion per row
// and FADD, FFMA (|x| free) per score, where the per-score integer form took IADD3, IABS, I2FP
// and FFMA (the Hopper forward's loop over two key blocks at d = 64: 2664 instructions, the same
// ALiBi as a score_mod, converted so by _mods' _float_by_parts, 2364). Bit for bit the
// operator's while |row + shift - key0| + 127 < 2^24 (every step exact); past that the first
// conversion rounds (2^-24 of the distance) and the subtraction as much again: a relative error
// of 2^-23 in a bias of 2^24 slope / M or more, which exp2 takes to 0 for any usual slope.
// (tests/test_mods_c_twin.py checks both.)
template <int kMTiles, int kNTiles>
CF_DEVICE void transform_scores(const Alibi& alibi, float (&s)[kMTiles][kNTiles][4], int row0,
                                int key0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 16 * mt + lane / 4 + 8 * half;
      const float distance = alibi.distance(row, key0 + 2 * (lane % 4));
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& score = s[mt][nt][2 * half + c];
          score = alibi.at_distance(score, distance - static_cast<float>(8 * nt + c));
        }
      }
    }
  }
}

// The identity leaves the tile alone (not even the index arithmetic above is written).
template <int kMTiles, int kNTiles>
CF_DEVICE void transform_scores(const NoScoreTransform&, float (&)[kMTiles][kNTiles][4], int, int,
                                int) {}

// A score variant on a transposed tile (element e of tile (0, nt): key key0 + lane / 4 +
// 8 (e / 2), query row row0 + 8 nt + 2 (lane % 4) + e % 2), with (row, key) as the variant
// reads them in the forward.
template <typename Transform, int kNTiles>
CF_DEVICE void transform_scores_transposed(const Transform& transform, float (&s)[1][kNTiles][4],
                                           int key0, int row0, int lane) {
  if constexpr (IsIdentity<Transform>::value) {
    return;
  } else if constexpr (ByParts<Transform>::value) {
    // the thread's 2 keys, then each of its rows once for both keys
    const int key = key0 + lane / 4;
    const typename Transform::Key k[2] = {transform.key_part(key), transform.key_part(key + 8)};
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int row = row0 + 8 * nt + 2 * (lane % 4) + c;
        const typename Transform::Row r = transform.row_part(row);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float& score = s[0][nt][2 * half + c];
          if (transform.inside(row, key + 8 * half))
            score = transform.at(score, row, key + 8 * half, r, k[half]);
        }
      }
      asm volatile("" ::: "memory");  // (as transform_scores')
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + lane / 4 + 8 * (e / 2);
        const int row = row0 + 8 * nt + 2 * (lane % 4) + e % 2;
        s[0][nt][e] = transform(s[0][nt][e], row, key);
      }
  }
}
template <int kNTiles>
CF_DEVICE void transform_scores_transposed(const NoScoreTransform&, float (&)[1][kNTiles][4], int,
                                           int, int) {}

// Scores -> logits of a user score_mod / mask_mod's tile by its class: score_mod alone on a
// plain tile (mask_mod's per-score reads, a document id's two gathers, are most of a masked
// tile's cost), both functions otherwise. A hidden tile inside the Hopper kernels' range runs as
// a mixed one, mask_mod giving its -inf: a third copy of the hook (a fill of -inf), or the
// choice made per score, spilled their consumers. A score_mod alone is written once: its two
// copies were the same code, and each unrolled copy of a per-score gather (a bias table's 64
// loads a tile) is a second or more of ptxas at the first call. `Transposed`: the backward's
// tiles (keys down, rows across: transform_scores_transposed).
template <bool Transposed, typename Mods, typename Scores>
CF_DEVICE void user_mods_by_state(const Mods& mods, int state, Scores& s, int row0, int key0,
                                  int lane) {
  if constexpr (Mods::kHasMaskMod) {
    if (state == kMaskCellPlain) {
      if constexpr (Transposed)
        transform_scores_transposed(ScoreOnly<Mods>{mods}, s, key0, row0, lane);
      else
        transform_scores(ScoreOnly<Mods>{mods}, s, row0, key0, lane);
      return;
    }
  }
  if constexpr (Transposed)
    transform_scores_transposed(mods, s, key0, row0, lane);
  else
    transform_scores(mods, s, row0, key0, lane);
}

// A transform whose key parts the Hopper forward reads ahead (UserMods::kKeysAhead).
template <typename Transform, typename = void>
struct KeysAhead {
  static constexpr bool value = false;
};
template <typename Transform>
struct KeysAhead<Transform, decltype(void(Transform::kKeysAhead))> {
  static constexpr bool value = Transform::kKeysAhead;
};

// The same parts read ahead (the Hopper forward): a thread's two rows' parts once per tile and
// its keys' parts of the next key block before the wait for that block's scores, so that their
// loads (a document id's 2 + 32 gathers) run under the Q K^T wgmma. Read where they are used,
// each key tile's reads waited for the one before (transform_scores' compiler barrier, which the
// FA2 tiles need against spills): at d = 64 over a document mask the forward's warps stalled
// 1.2 cycles per issued instruction on those loads (Nsight Compute, H100, N = 4k: 1084 us against
// FlexAttention's 806).
template <typename Mods, int kNTiles, bool kUsed = true>
struct PartsAhead {
  typename Mods::Row row[2];           // rows row0 + lane / 4 and 8 below it
  typename Mods::Key key[kNTiles][2];  // keys key0 + 8 nt + 2 (lane % 4) + c
};
template <typename Mods, int kNTiles>
struct PartsAhead<Mods, kNTiles, false> {};  // read where they are used

template <typename Mods, int kNTiles>
CF_DEVICE void read_row_parts(const Mods& mods, PartsAhead<Mods, kNTiles>& parts, int row0,
                              int lane) {
  parts.row[0] = mods.row_part(row0 + lane / 4);
  parts.row[1] = mods.row_part(row0 + lane / 4 + 8);
}
// The keys' parts of a block, whatever its class: a branch on the class would wait for the
// class's own read (from L2) before the block's Q K^T is issued. (A mask_mod's plain tile uses
// none of them: its loads are issued and not waited for.)
template <typename Mods, int kNTiles>
CF_DEVICE void read_key_parts(const Mods& mods, PartsAhead<Mods, kNTiles>& parts, int key0,
                              int lane) {
#pragma unroll
  for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c)
      parts.key[nt][c] = mods.key_part(key0 + 8 * nt + 2 * (lane % 4) + c);
}

// transform_scores of a ByParts transform (UserMods, ScoreOnly) over one row tile, its parts read
// ahead.
template <typename Transform, typename Mods, int kNTiles>
CF_DEVICE void transform_scores_ahead(const Transform& transform, float (&s)[1][kNTiles][4],
                                      int row0, int key0, int lane,
                                      const PartsAhead<Mods, kNTiles>& parts) {
  if constexpr (!IsIdentity<Transform>::value) {
    const int row = row0 + lane / 4;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        apply_parts(transform, s[0][nt], c, row, key0 + 8 * nt + 2 * (lane % 4) + c, parts.row,
                    parts.key[nt][c]);
  }
}

// user_mods_by_state with the parts read ahead (one row tile, not transposed).
template <typename Mods, int kNTiles>
CF_DEVICE void user_mods_by_state_ahead(const Mods& mods, int state, float (&s)[1][kNTiles][4],
                                        int row0, int key0, int lane,
                                        const PartsAhead<Mods, kNTiles>& parts) {
  if constexpr (Mods::kHasMaskMod) {
    if (state == kMaskCellPlain) {
      transform_scores_ahead(ScoreOnly<Mods>{mods}, s, row0, key0, lane, parts);
      return;
    }
  }
  transform_scores_ahead(mods, s, row0, key0, lane, parts);
}
