// The FP8 forward's pass over V: Vt, V transposed so that its keys are contiguous, for the e4m3
// P V wgmma (which reads B K-major only), with every 32 keys in fp8_vt_key's order (fp8_fwd.cuh:
// the order of P's columns in the A operand it takes from registers) and zeros past the last key.
//
// One CTA per (128-key block, KV head, batch): it reads the block's [128 keys][d] bytes of V in
// 16-byte chunks (rows past seqlen_k read as zero), keeps them in shared memory, and writes the
// block's d rows of Vt, 128 permuted keys each, in 16-byte chunks. That is one read and one write
// of V (FlashAttention-3 does the same transpose inside its producer warps instead).
//
// Arguments, in an AttnParams: V at v_ptr with the v_* strides (bytes: e4m3 elements), seqlen_k
// keys, h_k heads, batch; Vt at o_ptr, element (b, column c of d, KV head h, position j) at
// b * o_batch_stride + c * o_row_stride + h * o_head_stride + j (the q / k layout's axes, so one
// set of tensor-map axes serves all three), gridDim.x * 128 positions per row.
#pragma once

#include "common.cuh"
#include "fp8_fwd.cuh"
#include "params.cuh"

template <int kHeadDim_>
struct Fp8VtTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kKeys = 128;  // one 128-byte row of Vt per column of d
  static constexpr int kNThreads = 128;
  // A key's bytes and 16 more: consecutive keys 4 banks apart, so the transposing reads of
  // one column spread over the banks.
  static constexpr int kRowBytes = kHeadDim + 16;
  static constexpr int kSmemBytes = kKeys * kRowBytes;
  static_assert(kHeadDim % 16 == 0, "16-byte chunks");
};

template <typename Traits>
CF_DEVICE void fp8_vt(const AttnParams& params) {
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kKeys = Traits::kKeys;
  constexpr int kChunksPerKey = kHeadDim / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t s_v = smem_addr(smem_raw);
  const int key0 = blockIdx.x * kKeys;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const unsigned char* g_v = static_cast<const unsigned char*>(params.v_ptr) +
                             batch * params.v_batch_stride + head * params.v_head_stride;
  for (int idx = threadIdx.x; idx < kKeys * kChunksPerKey; idx += Traits::kNThreads) {
    const int key = idx / kChunksPerKey;
    const int chunk = idx % kChunksPerKey;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + key < params.seqlen_k)
      v = *reinterpret_cast<const uint4*>(
          g_v + static_cast<int64_t>(key0 + key) * params.v_row_stride + 16 * chunk);
    st_shared_b128(s_v + key * Traits::kRowBytes + 16 * chunk, v);
  }
  __syncthreads();
  unsigned char* g_vt = static_cast<unsigned char*>(params.o_ptr) + batch * params.o_batch_stride +
                        head * params.o_head_stride + key0;
  constexpr int kChunksPerRow = kKeys / 16;
  for (int idx = threadIdx.x; idx < kHeadDim * kChunksPerRow; idx += Traits::kNThreads) {
    const int column = idx / kChunksPerRow;
    const int pos0 = (idx % kChunksPerRow) * 16;  // 16 positions inside one group of 32
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int pos = pos0 + 4 * w + b;
        const int key = 32 * (pos / 32) + fp8_vt_key(pos % 32);
        word |= static_cast<uint32_t>(ld_shared_u8(s_v + key * Traits::kRowBytes + column))
                << (8 * b);
      }
      words[w] = word;
    }
    st_global_b128(g_vt + static_cast<int64_t>(column) * params.o_row_stride + pos0,
                   make_uint4(words[0], words[1], words[2], words[3]));
  }
}
