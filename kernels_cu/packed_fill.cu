// Packed sequences (attention_varlen and its backward): the output rows that belong to no
// sequence set to what a row without keys holds (O and the gradients 0, LSE -inf). The first
// step of a packed launch, so the kernels after it write the sequences' rows over it.
//
// Which rows those are: with good offsets, the rows from cu_seqlens[batch] to the packed total
// (usually none). With offsets the kernels refuse (a first one other than 0, a decrease, an end
// past the total: seq_range in params.cuh), or a sequence longer than the stated maximum (the
// grids cover max_seqlen rows of a sequence), every row: the rows a bad sequence meant to own
// are unknown, and the kernels write only the good ones (docs/robustness.md). This is what a
// fill of the whole output gave, which it replaces: that fill wrote every output once more, 4
// bytes per element of O, dQ, dK and dV (16k tokens at H x d = 2048: 192 MB, ~70 us on an H100,
// about 5% of a training step), where the tail is usually empty.
#pragma once

#include "params.cuh"

struct PackedFillTraits {
  static constexpr int kNThreads = 256;
  static constexpr int kSmemBytes = 0;
};

// The first row no sequence owns (see above); every thread of the CTA gets the answer. Each pair
// is judged by the kernels' own rule (seq_range), which also keeps the length's subtraction to
// offsets inside [0, total].
CF_DEVICE int first_unowned_row(const int32_t* cu_seqlens, int batch, int total, int max_len) {
  int32_t bad = 0;
  for (int b = threadIdx.x; b < batch; b += blockDim.x) {
    if (seq_range(cu_seqlens, b, total, 1, &bad).len > max_len) bad = 1;
  }
  // (every pair good: the last one's end, cu_seqlens[batch], is within the total)
  return __syncthreads_or(bad) ? 0 : cu_seqlens[batch];
}

// Bytes [begin, end) of `base` set to `word` repeated (a 4-byte pattern, by address, so an
// element's bytes keep their place): 16-byte stores over the 16-byte-aligned middle, single
// bytes at either end; the grid's threads stride over them.
CF_DEVICE void fill_bytes(unsigned char* base, int64_t begin, int64_t end, uint32_t word) {
  if (begin >= end) return;
  const int64_t thread = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t address = static_cast<int64_t>(reinterpret_cast<unsigned long long>(base));
  const int64_t middle_begin = min(((address + begin + 15) & ~int64_t{15}) - address, end);
  const int64_t middle_end = max(((address + end) & ~int64_t{15}) - address, middle_begin);
  auto byte_of = [&](int64_t i) {
    return static_cast<unsigned char>(word >> (8 * ((address + i) & 3)));
  };
  for (int64_t i = begin + thread; i < middle_begin; i += threads) base[i] = byte_of(i);
  for (int64_t i = middle_end + thread; i < end; i += threads) base[i] = byte_of(i);
  const uint4 chunk = make_uint4(word, word, word, word);
  uint4* chunks = reinterpret_cast<uint4*>(base + middle_begin);
  for (int64_t i = thread; i < (middle_end - middle_begin) / 16; i += threads) chunks[i] = chunk;
}

constexpr uint32_t kNegInfinityBits = 0xff800000u;  // float -inf
constexpr int kElementBytes = 2;                    // fp16 / bf16 outputs

// Rows [first, total) of a packed (total, heads, d) output: one contiguous span (the plan's
// outputs are C-contiguous, _launch checks a caller's).
CF_DEVICE void fill_rows(void* ptr, int64_t row_stride, int first, int total) {
  const int64_t row_bytes = row_stride * kElementBytes;
  fill_bytes(static_cast<unsigned char*>(ptr), first * row_bytes, total * row_bytes, 0u);
}

// The forward's O and LSE ((heads, total): each head's rows [first, total)).
CF_DEVICE void packed_fill_forward(const AttnParams& p) {
  const int first = first_unowned_row(p.cu_seqlens_q, p.batch, p.seqlen_q, p.max_seqlen_q);
  fill_rows(p.o_ptr, p.o_row_stride, first, p.seqlen_q);
  if (p.lse_ptr == nullptr) return;  // not requested
  for (int h = 0; h < p.h; ++h) {
    auto* lse = reinterpret_cast<unsigned char*>(p.lse_ptr + h * p.lse_head_stride);
    fill_bytes(lse, first * int64_t{4}, p.seqlen_q * int64_t{4}, kNegInfinityBits);
  }
}

// The backward's dQ (query rows), dK and dV (key rows).
CF_DEVICE void packed_fill_backward(const BwdParams& p) {
  const AttnParams& a = p.attn;
  const int first_q = first_unowned_row(a.cu_seqlens_q, a.batch, a.seqlen_q, a.max_seqlen_q);
  const int first_k = first_unowned_row(a.cu_seqlens_k, a.batch, a.seqlen_k, a.max_seqlen_k);
  fill_rows(p.dq_ptr, p.dq_row_stride, first_q, a.seqlen_q);
  fill_rows(p.dk_ptr, p.dk_row_stride, first_k, a.seqlen_k);
  fill_rows(p.dv_ptr, p.dv_row_stride, first_k, a.seqlen_k);
}
