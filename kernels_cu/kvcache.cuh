// The KV-cache view: where sequence b's keys live in a cache (contiguous entries, or pages
// through a block table), which of them it attends, and the checks of the device-side values
// that say so. Shared by the split-KV decode kernel and its append (decode.cu) and by the FA2
// forward over a cache (fa2_fwd.cu: many query tokens against a cache, packed sequences over
// pages). A device value is never trusted and never clamped into a plausible answer: a sequence
// whose length, first key or entry is out of range, or one of whose pages in use has a
// block-table entry outside [0, num_pages), reads and writes nothing through it, gets NaN rows,
// and sets a bit of attn.error_flags (params.cuh), which the host turns into an exception
// (cupyflash.check_device_errors).
#pragma once

#include "common.cuh"
#include "params.cuh"

struct DecodeParams {
  // q [B, Nq, Hq, d], o, lse as for attention (seqlen_q = Nq). k_ptr / v_ptr are the caches;
  // their batch strides are page strides when paged. seqlen_k is the cached length of every
  // sequence when cache_seqlens is nullptr (an int given on the host).
  AttnParams attn;
  const int32_t* cache_seqlens;  // [B] tokens already in the cache, or nullptr
  const int32_t* block_table;    // [B, max_pages] page of each page-sized key range, or nullptr
  const void* k_new_ptr;         // [B, Nnew, Hkv, d] appended before attending, or nullptr
  const void* v_new_ptr;         // [B, Nnew, Hkv, d]
  float* o_partial_ptr;          // [num_splits, B, Hq, Nq, d], when num_splits > 1
  float* lse_partial_ptr;        // [num_splits, B, Hq, Nq]
  int32_t* split_counters;       // [B, Hkv, m_blocks] tickets, 0 between calls, when num_splits > 1
  int64_t block_table_batch_stride;
  int64_t k_new_batch_stride, k_new_row_stride, k_new_head_stride;
  int64_t v_new_batch_stride, v_new_row_stride, v_new_head_stride;
  int32_t seqlen_new;      // Nnew
  int32_t page_size_log2;  // paged cache: log2(page size)
  int32_t num_pages;       // paged cache: pages in k_ptr / v_ptr
  int32_t cache_capacity;  // keys one sequence can hold: L_max, or max_pages * page_size
  int32_t num_splits;
  int32_t blocks_per_split;  // CTA key blocks (kNWarps * kWarpKeys keys) per split
  // Contiguous caches only (flash-attn's cache_batch_idx, cache_leftpad):
  const int32_t*
      cache_batch_idx;  // [B] the cache entry (of cache_batch) of each sequence, or nullptr: b
  const int32_t* cache_leftpad;  // [B] the first key of each sequence's entry, or nullptr: 0
  int32_t cache_batch;           // entries of the cache (its first axis)
  // Rotary embedding before attending (flash-attn's rotary_cos / rotary_sin: [seqlen_ro,
  // rotary_half] in q's element type, seqlen_ro >= capacity): k_new row t of sequence b is
  // rotated at position cache_seqlens[b] + t as it is appended; query token i at
  // cache_seqlens[b] + i (rotary_q_per_token: causal or a window) or cache_seqlens[b], from the
  // caller's q (q_src_*) into attn.q_ptr, a contiguous temporary the attention reads.
  const void* rotary_cos;
  const void* rotary_sin;
  const void* q_src_ptr;
  int64_t q_src_batch_stride, q_src_row_stride, q_src_head_stride;
  int32_t rotary_half;         // rotary_dim / 2; 0: no rotary embedding
  int32_t rotary_interleaved;  // pairs (2i, 2i + 1); else (i, i + rotary_half), GPT-NeoX's
  int32_t rotary_q_per_token;
  // The largest cache_seqlens whose rotated rows stay inside the tables (seqlen_ro less the
  // positions the call adds: k_new's, or the queries' per token). Past it the rotary kernels
  // refuse the sequence (rotary_refused); the attention kernels, which never read the tables,
  // carry no test of it.
  int32_t rotary_max_cached;
  // A float8 cache (kv_fp8 = kKvE4M3 or kKvE5M2, fp8.cuh; kKvSameAsQ: the cache is in q's type):
  // k_ptr / v_ptr hold bytes, their strides in bytes, and byte b of KV head h stands for
  // fp8(b) * scale_h, scale_h = k_scale_ptr[h * k_scale_head_stride] (a device array, read as
  // given), or k_scale where k_scale_ptr is nullptr (a host value); V alike.
  const float* k_scale_ptr;  // [1] or [Hkv], or nullptr
  const float* v_scale_ptr;
  float k_scale, v_scale;
  int32_t k_scale_head_stride, v_scale_head_stride;  // 0 (one scale per tensor) or 1 (per KV head)
  int32_t kv_fp8;
  // Speculative decoding's tree among the draft tokens (the decode kernel's Is_tree variants): the
  // Nq queries are the last Nq keys, and query token i of sequence b sees draft j (key
  // seqlen_k - Nq + j) iff tree_mask[b * tree_mask_batch_stride + i * tree_mask_row_stride + j]
  // is nonzero (the caller's bool array; batch stride 0 for one tree shared by the batch).
  const unsigned char* tree_mask;  // [B|1, Nq, Nq] bytes, unit stride on the last axis, or nullptr
  int64_t tree_mask_batch_stride, tree_mask_row_stride;
  // Cascade (shared-prefix) decoding (the decode kernel's Is_cascade variants): sequence b's keys
  // are its group's prefix, then its own (the cache view above, after the append). Prefix g's
  // key j is slot j % page_size of page prefix_block_table[g * prefix_block_table_batch_stride
  // + j / page_size], in the same pool. A prefix row block (prefix_rows[3 i .. 3 i + 2] = its
  // prefix g, its first request, one past its last: whole requests of one group) reads its pages
  // once for the rows of all its requests.
  const int32_t* prefix_block_table;  // [G, max_prefix_pages]
  const int32_t* prefix_seqlens;      // [G] keys of each prefix, or nullptr: prefix_seqlen for all
  const int32_t* prefix_rows;         // [num_prefix_blocks, 3], built by the host
  int64_t prefix_block_table_batch_stride;
  int32_t prefix_seqlen;
  int32_t prefix_capacity;  // keys a prefix table row holds: max_prefix_pages * page_size
  int32_t num_prefix_blocks;
  int32_t prefix_splits;            // key splits of every prefix (a request's own: num_splits)
  int32_t prefix_blocks_per_split;  // CTA key blocks per prefix split
};

// The (K, V) scales of KV head head_k of a float8 cache.
CF_DEVICE float2 kv_scales(const DecodeParams& p, int head_k) {
  return make_float2(
      p.k_scale_ptr != nullptr ? p.k_scale_ptr[head_k * p.k_scale_head_stride] : p.k_scale,
      p.v_scale_ptr != nullptr ? p.v_scale_ptr[head_k * p.v_scale_head_stride] : p.v_scale);
}

// Sets bits (params.cuh's kBadPage ...) of attn.error_flags (one thread calls it).
CF_DEVICE void report_error(const DecodeParams& p, int32_t bits) { report_error(p.attn, bits); }

// Address of key row `key` of one (batch, KV head) in a contiguous or paged cache.
template <typename Element>
struct CacheRows {
  Element* base;         // KV head applied; contiguous: the entry and the first key too
  const int32_t* pages;  // this sequence's row of the block table, or nullptr
  int64_t page_stride;   // paged: elements between pages
  int64_t row_stride;
  int page_size_log2;
  int num_pages;

  // A block-table entry outside [0, num_pages) sets *bad_page = 1 and gives a row of page 0
  // (inside the cache: the caller reads it, whose result is NaN anyway, or writes nothing). A
  // store, not a flag held in a register across the main loop: the d = 64, 64-row decode tile
  // runs at 255 registers.
  CF_DEVICE Element* row(int key, int* bad_page) const {
    if (pages == nullptr) return base + key * row_stride;
    const int entry = __ldg(pages + (key >> page_size_log2));
    const bool bad = outside_pool(entry);
    if (bad) *bad_page = 1;
    return paged_row(bad ? 0 : entry, key);
  }
  // Paged: whether a block-table entry lies outside [0, num_pages), and key `key`'s row in page
  // `page` (for callers that read a tile's entries ahead of its rows).
  CF_DEVICE bool outside_pool(int entry) const {
    return static_cast<unsigned>(entry) >= static_cast<unsigned>(num_pages);
  }
  CF_DEVICE Element* paged_row(int page, int key) const {
    return base + page * page_stride + (key & ((1 << page_size_log2) - 1)) * row_stride;
  }
};

// The rows of sequence `batch` in a cache, from key first_key of its entry on (contiguous caches:
// entry = cache_batch_idx[batch], checked by decode_span; paged caches take first_key 0).
template <typename Element>
CF_DEVICE CacheRows<Element> cache_rows(const DecodeParams& p, const void* cache,
                                        int64_t batch_stride, int64_t row_stride,
                                        int64_t head_stride, int batch, int head_k, int entry,
                                        int first_key) {
  Element* base = const_cast<Element*>(static_cast<const Element*>(cache)) + head_k * head_stride;
  const bool paged = p.block_table != nullptr;
  if (!paged) base += entry * batch_stride + first_key * row_stride;
  return {base,
          paged ? p.block_table + batch * p.block_table_batch_stride : nullptr,
          batch_stride,
          row_stride,
          p.page_size_log2,
          p.num_pages};
}

// Whether a sequence other than `batch` names cache entry `entry` too. With an append, the two
// would write the same rows (the entry's tokens undefined, as in flash-attn), so both are refused.
// The lanes of the calling warp compare a stride of the batch each: the warp must be whole and
// converged (every caller computes its span at the kernel's top).
CF_DEVICE bool entry_named_twice(const DecodeParams& p, int batch, int entry) {
  bool twice = false;
  for (int b = threadIdx.x % 32; b < p.attn.batch; b += 32)
    twice |= b != batch && p.cache_batch_idx[b] == entry;
  return __any_sync(0xffffffffu, twice);
}

// Where sequence `batch` lives in the cache and which of its keys it attends: its entry (the
// cache's first axis, contiguous caches), its first key (cache_leftpad) and the tokens cached
// before this call's append. bits: kBadSeqlen for a count the cache cannot hold with the append
// (< 0 or > capacity - seqlen_new) or a first key outside [0, cached], kBadCacheIndex for an
// entry outside [0, cache_batch), kBadSharedCacheIndex for an entry another appending sequence
// names too, and for packed sequences kBadCuSeqlensK / kBadSequsedK (one
// int, not a flag per kind: the span lives across the FA2 kernel's main loop). Any bit makes the
// sequence empty (nothing read, nothing written) and its rows NaN.
struct CacheSpan {
  int entry, first_key, cached;
  int32_t bits;
  CF_DEVICE bool bad() const { return bits != 0; }
  CF_DEVICE int32_t error_bits() const { return bits; }
};

CF_DEVICE CacheSpan decode_span(const DecodeParams& p, int batch) {
  CacheSpan s;
  s.cached = p.cache_seqlens != nullptr ? p.cache_seqlens[batch] : p.attn.seqlen_k;
  s.first_key = p.cache_leftpad != nullptr ? p.cache_leftpad[batch] : 0;
  s.entry = p.cache_batch_idx != nullptr ? p.cache_batch_idx[batch] : batch;
  const bool bad_len = s.cached < 0 || s.cached > p.cache_capacity - p.seqlen_new ||
                       s.first_key < 0 || s.first_key > s.cached;
  const bool bad_entry = static_cast<unsigned>(s.entry) >= static_cast<unsigned>(p.cache_batch);
  const bool shared_entry =
      p.cache_batch_idx != nullptr && p.seqlen_new > 0 && entry_named_twice(p, batch, s.entry);
  s.bits = (bad_len ? kBadSeqlen : 0) | (bad_entry ? kBadCacheIndex : 0) |
           (shared_entry ? kBadSharedCacheIndex : 0);
  if (s.bad()) s.cached = s.first_key = s.entry = 0;
  return s;
}

// Keys attended in sequence `batch`: from its first key, the cached ones and the appended ones
// (0 when the span is bad).
CF_DEVICE int decode_seqlen_k(const DecodeParams& p, const CacheSpan& span) {
  return span.bad() ? 0 : span.cached + p.seqlen_new - span.first_key;
}

// The keys of prefix g (cascade decoding): a length outside [0, prefix_capacity] is kBadSeqlen,
// and the prefix is empty (its requests' rows NaN).
CF_DEVICE CacheSpan prefix_span(const DecodeParams& p, int prefix) {
  CacheSpan s;
  s.cached = p.prefix_seqlens != nullptr ? p.prefix_seqlens[prefix] : p.prefix_seqlen;
  s.first_key = s.entry = 0;
  s.bits = s.cached < 0 || s.cached > p.prefix_capacity ? kBadSeqlen : 0;
  if (s.bad()) s.cached = 0;
  return s;
}

// The rows of prefix g's keys (KV head head_k): cache_rows over the prefix's table row.
template <typename Element>
CF_DEVICE CacheRows<Element> prefix_rows(const DecodeParams& p, const void* cache,
                                         int64_t page_stride, int64_t row_stride,
                                         int64_t head_stride, int head_k, int prefix) {
  CacheRows<Element> rows = cache_rows<Element>(p, cache, page_stride, row_stride, head_stride,
                                                /*batch=*/0, head_k, /*entry=*/0, /*first_key=*/0);
  rows.pages = p.prefix_block_table + prefix * p.prefix_block_table_batch_stride;
  return rows;
}

// Packed sequences over a paged cache (attention_varlen's block_table): sequence b's key count
// is cu_seqlens_k[b + 1] - cu_seqlens_k[b] (cut to seqused_k[b] where given), its keys from slot 0
// of its first page. Offsets as the host checks them (a first one other than 0, a negative one, a
// decrease: kBadCuSeqlensK; there is no packed total), a count past its block-table row (capacity:
// kBadSeqlen), a seqused_k outside [0, count] (kBadSequsedK) make the span bad.
CF_DEVICE CacheSpan packed_span(const DecodeParams& p, int batch) {
  const AttnParams& a = p.attn;
  const int start = a.cu_seqlens_k[batch];
  const int count = a.cu_seqlens_k[batch + 1] - start;
  const bool bad_offsets = (batch == 0 && start != 0) || start < 0 || count < 0;
  const int used = a.seqused_k != nullptr ? a.seqused_k[batch] : count;
  CacheSpan s;
  s.entry = batch;
  s.first_key = 0;
  s.bits = bad_offsets                ? kBadCuSeqlensK
           : count > p.cache_capacity ? kBadSeqlen
           : used < 0 || used > count ? kBadSequsedK
                                      : 0;
  s.cached = s.bits != 0 ? 0 : used;
  return s;
}

// The span of sequence b for the FA2 forward over a cache: packed sequences where cu_seqlens_k
// is given, else attention_with_kvcache's.
CF_DEVICE CacheSpan cache_span(const DecodeParams& p, int batch) {
  return p.attn.cu_seqlens_k != nullptr ? packed_span(p, batch) : decode_span(p, batch);
}
