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
  static constexpr int kChunksPerKey = kHeadDim / 16;
  static constexpr int kSmemBytes = kKeys * kHeadDim;
  static_assert(kHeadDim % 64 == 0, "whole 16-byte chunks, four words a thread");
};

// Where 16-byte chunk c of key r sits in its shared-memory row: rotated by r / 16 chunks, so the
// transposing reads (eight keys 16 apart, one word each, per group of four words) fall on 32
// distinct banks (unrotated, rows 16 keys apart start on the same bank).
template <typename Traits>
CF_DEVICE uint32_t vt_smem_offset(int key, int chunk) {
  return key * Traits::kHeadDim + ((chunk + key / 16) % Traits::kChunksPerKey) * 16;
}

template <typename Traits>
CF_DEVICE void fp8_vt(const AttnParams& params) {
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kKeys = Traits::kKeys;
  constexpr int kChunksPerKey = Traits::kChunksPerKey;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t s_v = smem_addr(smem_raw);
  const int key0 = blockIdx.x * kKeys;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const unsigned char* g_v = static_cast<const unsigned char*>(params.v_ptr) +
                             batch * params.v_batch_stride + head * params.v_head_stride;
#pragma unroll
  for (int idx = threadIdx.x; idx < kKeys * kChunksPerKey; idx += Traits::kNThreads) {
    const int key = idx / kChunksPerKey;
    const int chunk = idx % kChunksPerKey;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + key < params.seqlen_k)
      v = *reinterpret_cast<const uint4*>(
          g_v + static_cast<int64_t>(key0 + key) * params.v_row_stride + 16 * chunk);
    st_shared_b128(s_v + vt_smem_offset<Traits>(key, chunk), v);
  }
  __syncthreads();
  // A thread writes 16 positions (pos0 ..) of four columns of d (4 c4 ..): one word of each of
  // the 16 keys there, then four byte transposes. Eight threads in a row cover all 128 positions
  // of those columns: whole 128-byte rows of Vt.
  unsigned char* g_vt = static_cast<unsigned char*>(params.o_ptr) + batch * params.o_batch_stride +
                        head * params.o_head_stride + key0;
  constexpr int kPositionChunks = kKeys / 16;
#pragma unroll
  for (int idx = threadIdx.x; idx < (kHeadDim / 4) * kPositionChunks; idx += Traits::kNThreads) {
    const int c4 = idx / kPositionChunks;
    const int pos0 = (idx % kPositionChunks) * 16;  // 16 positions inside one group of 32
    uint32_t w[16];  // w[i]: columns 4 c4 .. 4 c4 + 3 of the key at position pos0 + i
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int pos = pos0 + i;
      const int key = 32 * (pos / 32) + fp8_vt_key(pos % 32);
      w[i] = ld_shared_b32(s_v + vt_smem_offset<Traits>(key, c4 / 4) + (c4 % 4) * 4);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {                // column 4 c4 + j: byte j of every w[i]
      const uint32_t pick = j | ((4 + j) << 4);  // __byte_perm: byte j of a, then byte j of b
      uint32_t out[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint32_t lo = __byte_perm(w[4 * m], w[4 * m + 1], pick);
        const uint32_t hi = __byte_perm(w[4 * m + 2], w[4 * m + 3], pick);
        out[m] = __byte_perm(lo, hi, 0x5410);  // lo's two low bytes, then hi's
      }
      st_global_b128(g_vt + static_cast<int64_t>(4 * c4 + j) * params.o_row_stride + pos0,
                     make_uint4(out[0], out[1], out[2], out[3]));
    }
  }
}
