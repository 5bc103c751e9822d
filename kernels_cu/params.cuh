// AttnParams: the one runtime argument of every attention kernel, passed by value.
//
// Python mirrors this struct as a NumPy structured dtype (cupyflash/_params.py); a CPU test
// compiles static_asserts generated from that dtype against this header, so the two layouts
// cannot drift apart. Strides are in elements and 64-bit: B * N * H * d can pass 2^31.
#pragma once

#include "common.cuh"

struct AttnParams {
  const void* q_ptr;  // [B, Nq, Hq, d] through the strides below; unit stride on d
  const void* k_ptr;  // [B, Nk, Hkv, d]
  const void* v_ptr;  // [B, Nk, Hkv, d]
  void* o_ptr;        // [B, Nq, Hq, d], same element type as q
  float* lse_ptr;     // [B, Hq, Nq] natural-log LSE, or nullptr when not requested
  // Variable length (packed sequences): batch entry b owns rows cu_seqlens[b] .. cu_seqlens[b+1]
  // of the packed [total, H, d] tensors (batch strides 0); nullptr for padded batches.
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* cu_seqlens_k;  // [B + 1]

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;  // row stride is 1

  int32_t batch;
  int32_t seqlen_q, seqlen_k;  // per batch entry, or the packed totals when varlen
  int32_t h, h_k;              // query heads, key/value heads
  int32_t h_h_k_ratio;         // h / h_k: query head i reads key/value head i / h_h_k_ratio
  // Packed: the longest sequences the caller stated (max_seqlen_q / _k: the grids cover that many
  // rows of a sequence), read by packed_fill.cu; 0 for a padded batch.
  int32_t max_seqlen_q, max_seqlen_k;

  // Visible keys of query row i (bottom-right aligned, shift = seqlen_k - seqlen_q):
  //   i + shift - window_left <= j <= i + shift + window_right.
  // Causal is window_right = 0; kernels only read a bound when the variant's flag enables it.
  int32_t window_left, window_right;

  // Scores s = q . k enter the softmax as exp2(logit(s) * softmax_scale_log2 - max) with
  //   logit(s) = s                                  (softmax_scale_log2 = scale * log2 e), or
  //   logit(s) = tanh(s * softcap_prescale)         (softcap_prescale = scale / softcap,
  //                                                  softmax_scale_log2 = softcap * log2 e).
  float softmax_scale_log2;
  float softcap_prescale;
  // A user score_mod / mask_mod (variants with kBias = kUserMods; variants.cuh's UserMods) sees
  // the scaled score s * mod_score_scale (the caller's scale) and returns the logit itself: the
  // softmax then multiplies by log2 e alone (softmax_scale_log2 = log2 e).
  float mod_score_scale;

  // Dropout on P (variants with the Dropout flag; kernels_cu/dropout.cuh): element kept iff its
  // 16-bit Philox draw under the key dropout_seed is >= dropout_threshold (= round(p * 65536));
  // kept values are scaled by dropout_scale = 65536 / (65536 - dropout_threshold).
  uint64_t dropout_seed;
  uint32_t dropout_threshold;
  float dropout_scale;

  // ALiBi (variants with the Has_alibi flag; kernels_cu/variants.cuh): the score of query row i
  // and key j gains -slope * |i + shift - j| (flash-attn's alibi_slopes), slope the fp32
  // alibi_slopes[b * alibi_batch_stride + h]; it enters the logit divided by the softmax's
  // multiplier M = softmax_scale_log2 / log2 e (|scale|, or the softcap): alibi_scale = 1 / M.
  const float* alibi_slopes;
  int64_t alibi_batch_stride;  // 0 for slopes (Hq,), Hq for (B, Hq)
  float alibi_scale;

  // Learnable attention sinks (gpt-oss): the fp32 logit sinks[h] of query head h joins every
  // row's softmax denominator and takes no value, so O = sum_j p_j v_j with
  // p_j = exp(s_j - lse) and lse = log(sum_j exp(s_j) + exp(sinks[h])) (softmax.cuh's add_sink,
  // where a row's final O and LSE are made); nullptr: none.
  const float* sinks;

  // Keys used per batch entry (flash-attn's seqused_k: the first seqused_k[b] keys of sequence
  // b take part, and its causal shift counts those), or nullptr: all. FA2 kernels (seq_rows).
  const int32_t* seqused_k;

  // An attention mask (variants with kBias; kernels_cu/variants.cuh's AttnBias): SDPA's attn_mask
  // [B|1, Hq|1, Nq|1, Nk|1], additive in q's element type (entering the logit times alibi_scale,
  // 1 / M) or boolean (one byte, true = take part), element (b, h, i, j) at
  // bias_ptr[b * bias_batch_stride + h * bias_head_stride + i * bias_row_stride + j * bias_key_stride].
  const void* bias_ptr;
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride, bias_key_stride;

  // The mask's block summary (kernels_cu/attn_mask.cuh writes it before the attention kernel):
  // one byte per cell of 2^mask_cell_rows_log2 query rows x 2^mask_cell_keys_log2 keys of the
  // mask's (batch, head), saying whether the cell hides every key (its tiles are skipped: no
  // load, no MMA), shows every key unchanged (the mask is not read there), or is mixed. Cell
  // (b, h, m, n) at mask_cells[b * mask_cells_batch_stride + h * mask_cells_head_stride +
  // m * mask_cells_row_stride + n * mask_cells_key_stride], a stride 0 on a broadcast axis.
  const unsigned char* mask_cells;
  int32_t mask_cells_batch_stride, mask_cells_head_stride;
  int32_t mask_cells_row_stride, mask_cells_key_stride;
  int32_t mask_cell_rows_log2, mask_cell_keys_log2;
  int32_t mask_heads;  // heads of the mask (1 or Hq): the summary kernel's grid z is batch x heads
  // A BlockMask's (cupyflash.create_block_mask: a mask_mod's summary, its cells above) shown
  // ranges, which bound a tile's loop as causal / window bounds do (variants.cuh's
  // block_mask_key_blocks): per block r of kMaskRangeBlock (128) query rows, the keys
  // [first, end) outside which it sees none (first = end = 0: none at all), an int32 pair at
  // mask_key_ranges[b * mask_key_ranges_batch_stride + h * mask_key_ranges_head_stride + 2 r];
  // per block of 128 keys, the rows [first, end) that see one likewise (mask_row_ranges).
  // Strides 0 on a broadcast axis; nullptr: none.
  const int32_t* mask_key_ranges;  // [B|1, Hq|1, row blocks, 2]
  const int32_t* mask_row_ranges;  // [B|1, Hq|1, key blocks, 2]
  int32_t mask_key_ranges_batch_stride, mask_key_ranges_head_stride;
  int32_t mask_row_ranges_batch_stride, mask_row_ranges_head_stride;

  // The device error word ([1], one per GPU, cupyflash/_workspace.py), or nullptr: a kernel that
  // meets a bad device-side value ORs in its bit (kBadCuSeqlensQ ... below), and
  // cupyflash.check_device_errors reads and clears it. Kernels cannot raise, and a check on the
  // host would read the values back: a synchronisation per call.
  int32_t* error_flags;

  // The arrays a user score_mod / mask_mod captured (cupyflash/_mods.py), in slot order (the
  // score function's, then the mask function's), each read as element (i, j) at
  // mod_buffer[i * stride0 + j], element i of a 1-D array at mod_buffer[i] (the launch copies
  // an array whose last axis's stride is not 1: its INDEX operands); nullptr where unused.
  const void* mod_buffer0;
  const void* mod_buffer1;
  const void* mod_buffer2;
  const void* mod_buffer3;
  int64_t mod_buffer0_stride0, mod_buffer0_stride1;
  int64_t mod_buffer1_stride0, mod_buffer1_stride1;
  int64_t mod_buffer2_stride0, mod_buffer2_stride1;
  int64_t mod_buffer3_stride0, mod_buffer3_stride1;
};

// Bits of AttnParams::error_flags, one per kind of bad device-side value (cupyflash/_kvcache.py's
// _DEVICE_ERRORS names each for the exception): a block-table entry in use outside the cache; a
// length (cache_seqlens, a cache_leftpad past it, a paged sequence's key count past its table row,
// a packed sequence's key count past max_seqlen_k in the Hopper backward);
// a cache_batch_idx entry outside the cache; packed offsets (cu_seqlens_q, cu_seqlens_k) that are
// negative, decreasing or past the packed total; a seqused_k outside [0, the sequence's key count];
// a cache_batch_idx entry named by two sequences that both append into it (k_new); a
// cache_seqlens that puts a rotated key or query past rotary_cos's positions.
enum : int32_t {
  kBadPage = 1,
  kBadSeqlen = 2,
  kBadCacheIndex = 4,
  kBadCuSeqlensQ = 8,
  kBadCuSeqlensK = 16,
  kBadSequsedK = 32,
  kBadSharedCacheIndex = 64,
  kBadRotaryPosition = 128
};

// Sets bits of *error_flags (one thread calls it; an atomic: every sequence's CTAs may report).
CF_DEVICE void report_error(const AttnParams& p, int32_t bits) {
  if (bits != 0 && p.error_flags != nullptr) atomicOr(p.error_flags, bits);
}

// cuTensorMapEncodeTiled's opaque 128-byte CUtensorMap (cuda.h cannot be included under NVRTC).
struct alignas(64) TmaMap {
  unsigned long long opaque[16];
};

// The Hopper forward's argument: three TMA tensor maps (innermost first: d, rows, heads, batch) and the
// AttnParams every kernel takes. Passed as a __grid_constant__ so the maps stay in parameter
// memory, where TMA reads them.
// A descale factor of the FP8 forward: the float32 value for (batch b, KV head h) at
// ptr[b * batch_stride + h * head_stride] (strides 0 on a broadcast axis), or `value` (a host
// number; 1 when none was given) where ptr is nullptr.
struct Fa3Descale {
  const float* ptr;
  int32_t batch_stride, head_stride;
  float value;
  CF_DEVICE float at(int b, int h) const {
    return ptr == nullptr ? value : ptr[b * batch_stride + h * head_stride];
  }
};

struct Fa3Params {
  TmaMap q_map, k_map, v_map;  // with FP8 inputs v_map is over Vt (fp8_vt.cu's output)
  AttnParams attn;
  // The dynamic schedule's counters: [0] tiles drawn past the first gridDim.x, [1] CTAs done.
  // Both read 0 at launch; the last CTA to finish sets them back (cupyflash/_workspace.py).
  int32_t* tile_counters;
  int32_t num_m_blocks;  // query blocks per (batch, head): of the longest sequence when varlen
  // Causal: (batch, head) pairs a section of the tile order (tile_scheduler.cuh); 0 or 1: each
  // pair's query blocks in turn.
  int32_t lpt_pairs;
  Fa3Descale q_descale, k_descale, v_descale;  // FP8 inputs only
};

// The backward's argument (kernels_cu/fa2_bwd.cu's kernels, and the Hopper backward's after its
// tensor maps).
struct BwdParams {
  // q, k, v, o (the forward's output), lse (the forward's, natural log), cu_seqlens, the shape
  // and the softmax factors, as the forward reads them.
  AttnParams attn;
  const void* do_ptr;  // dO, strides do_*
  void* dq_ptr;        // outputs, strides dq_* / dk_* / dv_*
  void* dk_ptr;
  void* dv_ptr;
  float* dq_accum;        // [rows][d] fp32: row r of the per-row temporaries at r * d
  float* neg_lse_log2;    // per row: -LSE * log2 e (-inf where LSE = -inf: the row sees no key)
  float* dsum;            // per row: D = rowsum(dO * O) - dLSE
  const float* dlse_ptr;  // the gradient of the returned LSE, like lse; nullptr when none
  int64_t dlse_batch_stride, dlse_head_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  // Row r of query head h, batch entry b (r in the packed rows when varlen) is temporary row
  // b * row_batch_stride + h * row_head_stride + r.
  int64_t row_batch_stride, row_head_stride;
  float dq_scale, dk_scale;
  // dQacc's layout: rows of d floats (0), or the Hopper backward's tiles (each 64-row tile of a
  // (batch, head) in its MMA fragments' order, kernels_cu/dq_tiles.cuh; prep zeroes the padding
  // rows too): 1 (kDqTilesPadded) a padded batch's rows padded to whole steps, row_head_stride a
  // multiple of 64; 2 (kDqTilesPacked) packed sequences, each from its own 128-aligned start
  // (dq_seq_temp_start), batch stride 0, the per-row kernels' grid over a head's row_head_stride
  // temporary rows; 3 (kDqTilesSwapped) a padded batch's 80-row steps, each tile in the order of
  // the swapped dQ^T accumulator, row_head_stride a multiple of 80.
  int32_t dq_tiled;
  // The deterministic Hopper backward: per dQacc tile, how many key blocks have added into it
  // (they add in a fixed order, fa3_bwd.cu); zeroed by prep. nullptr otherwise.
  int32_t* dq_semaphore;
  // With attn.sinks: per temporary row, the row's share of dLoss / dsinks[h],
  // -exp(sinks[h] - LSE) * D (written by prep; the host sums them per head). nullptr otherwise.
  float* dsink_rows;
  // Packed sequences on the Hopper backward: the keys per sequence its grid covers (key blocks
  // x 128, from max_seqlen_k); prep reports a longer sequence (kBadSeqlen), whose last keys get
  // no dK or dV. 0 otherwise (the grid covers the packed total).
  int32_t grid_keys;
  // The causal Hopper backward: (batch, head) pairs a section of its CTA order
  // (tile_scheduler.cuh's fa3_bwd_tile); 0 or 1: the launch order.
  int32_t lpt_pairs;
};

// The Hopper backward's argument (kernels_cu/fa3_bwd.cu): the tensor maps of Q, K, V and dO, then
// the BwdParams of the other backward kernels (a __grid_constant__, as Fa3Params).
struct Fa3BwdParams {
  TmaMap q_map, k_map, v_map, do_map;
  BwdParams bwd;
};

// The rows of one batch entry: [start, start + len).
struct SeqRange {
  int start;
  int len;
};

// Rows cu_seqlens[batch] .. cu_seqlens[batch + 1] of a packed tensor of `total` rows (all of them
// for a padded batch: cu_seqlens nullptr). Offsets the host check refuses too (_validate.py's
// check_cu_seqlens_values: a first offset other than 0, a decrease, an end past the total; a
// negative one is one of those) are never clamped into a plausible range: the sequence gets no
// rows (nothing read or written through them) and `bit` is ORed into *bits.
CF_DEVICE SeqRange seq_range(const int32_t* cu_seqlens, int batch, int total, int32_t bit,
                             int32_t* bits) {
  if (cu_seqlens == nullptr) return {0, total};
  const int start = cu_seqlens[batch];
  const int end = cu_seqlens[batch + 1];
  // start >= 0 follows from the first offset being 0 and no decrease, but each sequence checks
  // only its own pair: a negative start must fail here, not only in the pair that decreases.
  const bool ok = (batch > 0 || start == 0) && start >= 0 && end >= start && end <= total;
  if (ok) return {start, end - start};
  *bits |= bit;
  return {0, 0};
}

// The query and key rows of batch entry b, every device-side value checked (read once per CTA,
// values the kernel needs anyway): cu_seqlens_q / cu_seqlens_k when packed, and seqused_k (the
// first seqused_k[b] keys take part; outside [0, key count] is bad). A range whose offsets are bad
// is empty; the other one keeps its rows. A bad sequence (error_bits != 0) attends no key: the
// kernels write NaN over the rows it still has (its query rows, and its key rows' gradients)
// and report error_bits once per sequence. Which rows a sequence owns is defined only by valid
// offsets, so a sequence never writes through a bad range: with cu_seqlens_q itself bad, rows
// the caller meant for it are written by no one (docs/robustness.md).
struct SeqRows {
  SeqRange q, k;
  int32_t error_bits;
  CF_DEVICE bool bad() const { return error_bits != 0; }
};

CF_DEVICE SeqRows seq_rows(const AttnParams& p, int batch) {
  SeqRows s;
  s.error_bits = 0;
  s.q = seq_range(p.cu_seqlens_q, batch, p.seqlen_q, kBadCuSeqlensQ, &s.error_bits);
  s.k = seq_range(p.cu_seqlens_k, batch, p.seqlen_k, kBadCuSeqlensK, &s.error_bits);
  if (p.seqused_k != nullptr && (s.error_bits & kBadCuSeqlensK) == 0) {
    const int used = p.seqused_k[batch];
    const bool ok = used >= 0 && used <= s.k.len;
    s.k.len = ok ? used : 0;  // bad: no key (a kernel that only skips it reads none)
    if (!ok) s.error_bits |= kBadSequsedK;
  }
  return s;
}

// The rows of batch entry b with its offsets clamped into the packed totals, unchecked: only for
// the backward's key-block kernel, at its register limit (any check there spilled the d = 128
// tiles), in a launch whose prep kernel checks every sequence's offsets (seq_rows) and reports a
// bad one. A bad sequence's dK and dV there are then not an answer, and check_device_errors says
// so; no access leaves the tensors.
CF_DEVICE SeqRows clamped_seq_rows(const AttnParams& p, int batch) {
  auto clamp = [](const int32_t* cu, int b, int total) -> SeqRange {
    if (cu == nullptr) return {0, total};
    const int end = min(max(cu[b + 1], 0), total);
    const int start = min(max(cu[b], 0), end);
    return {start, end - start};
  };
  SeqRows s;
  s.error_bits = 0;
  s.q = clamp(p.cu_seqlens_q, batch, p.seqlen_q);
  s.k = clamp(p.cu_seqlens_k, batch, p.seqlen_k);
  if (p.seqused_k != nullptr) s.k.len = min(max(p.seqused_k[batch], 0), s.k.len);
  return s;
}
