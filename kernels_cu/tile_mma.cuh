// The mma.sync tile verbs of the Ampere-path kernels (FA2 forward and backward, FA1, the split-KV
// decode partial):
// K/V/Q tiles into swizzled shared memory with cp.async, Q fragments by ldmatrix, and the two
// GEMMs of a key block, S = Q K^T and O += P V, on m16n8k16 tensor-core tiles. Templated on the
// kernel's traits, which name kHeadDim, kNThreads, kMTiles, kNTiles, kDTiles, kDSteps, kNSteps,
// kElemBytes, Q_in_regs, Tile (SwizzledTile), Columns (TileColumns) and Ops (ElementTraits).
#pragma once

#include "common.cuh"
#include "softmax.cuh"  // p_operand: the S accumulator re-packed as P V's A operand

// Rows [0, kRows) of a global tile of the caller's columns into a swizzled shared tile, element
// by element (a head dim that is not a multiple of 8: see TileColumns); rows >= rows_valid and
// the columns past the caller's are zeros. Synchronous loads, so the data is in shared memory
// when the thread passes its next barrier, as cp.async's would be after its wait.
template <typename Traits, int kRows>
CF_DEVICE void load_tile_elements(uint32_t s_tile, const typename Traits::Element* g_tile,
                                  int64_t row_stride, int rows_valid, int tid) {
  using Columns = typename Traits::Columns;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll 1
  for (int idx = tid; idx < kChunks; idx += Traits::kNThreads) {
    const int row = idx / kChunksPerRow;
    const int chunk = idx % kChunksPerRow;
    const uint4 v = row < rows_valid ? ld_global_chunk<Columns>(g_tile + row * row_stride, chunk)
                                     : make_uint4(0u, 0u, 0u, 0u);
    st_shared_b128(s_tile + Traits::Tile::offset(row, chunk) * Traits::kElemBytes, v);
  }
}

// NaN into rows [0, min(rows_valid, kRows)) of a [rows][kHeadDim] global tile of the caller's
// columns, and into count floats from g_float: the output of a sequence whose device-side values
// are bad (params.cuh's SeqRows), which must not look like an answer. Runs instead of the
// sequence's computation, never beside it, so it costs the main loop nothing.
template <typename Traits, int kRows>
CF_DEVICE void store_nan_rows(typename Traits::Element* g_tile, int64_t row_stride, int rows_valid,
                              int tid) {
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  const uint32_t nan2 = Traits::Ops::pack2(quiet_nan(), quiet_nan());
  const uint4 nan8 = make_uint4(nan2, nan2, nan2, nan2);
#pragma unroll 1
  for (int idx = tid; idx < kRows * kChunksPerRow; idx += Traits::kNThreads) {
    const int row = idx / kChunksPerRow;
    if (row >= rows_valid) break;
    st_global_chunk<typename Traits::Columns>(g_tile + row * row_stride, idx % kChunksPerRow, nan8);
  }
}

template <typename Traits>
CF_DEVICE void store_nan_floats(float* g_float, int64_t count, int tid) {
#pragma unroll 1
  for (int64_t i = tid; i < count; i += Traits::kNThreads) g_float[i] = quiet_nan();
}

// Asynchronously copy rows [0, kRows) of a [rows][kHeadDim] global tile into a swizzled shared
// tile; rows >= rows_valid, and the chunks past the caller's columns (Traits::Columns), are
// zero-filled. Consecutive threads take consecutive 16-byte chunks of a row, so a warp reads 512
// contiguous bytes per instruction (coalesced). The source pointer advances by a stride step
// instead of being recomputed per row: with every row address live, ptxas hoisted 16 64-bit
// addresses out of the main loop and spilled (d = 128, 128 x 64 tile).
template <typename Traits, int kRows>
CF_DEVICE void load_tile_async(uint32_t s_tile, const typename Traits::Element* g_tile,
                               int64_t row_stride, int rows_valid, int tid) {
  using Columns = typename Traits::Columns;
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kElemBytes = sizeof(typename Traits::Element);
  if constexpr (!Columns::kWholeChunks) {
    load_tile_elements<Traits, kRows>(s_tile, g_tile, row_stride, rows_valid, tid);
  } else if constexpr (Traits::kNThreads % kChunksPerRow == 0) {
    // Every thread keeps one chunk column and walks down the rows.
    constexpr int kRowsPerIter = Traits::kNThreads / kChunksPerRow;
    constexpr int kIters = ceil_div(kRows, kRowsPerIter);
    const int chunk = tid % kChunksPerRow;
    const bool chunk_valid = Columns::holds(chunk);
    int row = tid / kChunksPerRow;
    const auto* src = g_tile + row * row_stride + chunk * 8;
    const int64_t src_step = kRowsPerIter * row_stride;
#pragma unroll 1
    for (int it = 0; it < kIters; ++it, row += kRowsPerIter, src += src_step) {
      if (kRows % kRowsPerIter == 0 || row < kRows) {
        const bool valid = chunk_valid && row < rows_valid;
        cp_async_16(s_tile + Traits::Tile::offset(row, chunk) * kElemBytes, valid ? src : g_tile,
                    valid);
      }
    }
  } else {
    // Rows of 12 or 24 chunks (d = 96, 192) do not divide the thread count: index chunk by chunk.
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll 1
    for (int idx = tid; idx < kChunks; idx += Traits::kNThreads) {
      const int row = idx / kChunksPerRow;
      const int chunk = idx % kChunksPerRow;
      const bool valid = Columns::holds(chunk) && row < rows_valid;
      cp_async_16(s_tile + Traits::Tile::offset(row, chunk) * kElemBytes,
                  g_tile + (valid ? row : 0) * row_stride + chunk * 8, valid);
    }
  }
}

// Asynchronously copy rows [0, kRows) of a [rows][kHeadDim] tile whose rows lie anywhere
// (row_ptr(r): the row's address, or nullptr for a row to zero-fill) into a swizzled tile, with
// kThreads threads: a warp for its own K/V slice, the CTA for Q. Each 32 threads read whole
// 16-byte chunks of consecutive rows, so a warp instruction covers 512 contiguous-row bytes.
template <typename Traits, int kRows, int kThreads, typename RowPtr>
CF_DEVICE void load_rows_async(uint32_t s_tile, const RowPtr& row_ptr, int thread) {
  constexpr int kChunksPerRow = Traits::kHeadDim / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll 1
  for (int it = 0; it < ceil_div(kChunks, kThreads); ++it) {
    const int idx = it * kThreads + thread;
    if (kChunks % kThreads == 0 || idx < kChunks) {
      const int row = idx / kChunksPerRow;
      const int chunk = idx % kChunksPerRow;
      const typename Traits::Element* src = row_ptr(row);
      const uint32_t dst = s_tile + Traits::Tile::offset(row, chunk) * Traits::kElemBytes;
      if constexpr (Traits::Columns::kWholeChunks) {
        const bool valid = Traits::Columns::holds(chunk) && src != nullptr;
        cp_async_16(dst, src != nullptr ? src + chunk * 8 : row_ptr.fallback(), valid);
      } else {  // 2-byte aligned rows: element by element (see TileColumns)
        st_shared_b128(dst, src != nullptr ? ld_global_chunk<typename Traits::Columns>(src, chunk)
                                           : make_uint4(0u, 0u, 0u, 0u));
      }
    }
  }
}

// A operand of Q K^T for the warp's kMTiles row tiles at k-step ds (columns 16 ds .. 16 ds + 15).
// ldmatrix matrices 0..3 = (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
// (rows 8-15, k 8-15): exactly the a0..a3 registers of m16n8k16.
template <typename Traits>
CF_DEVICE void load_q_frag(uint32_t (&a)[Traits::kMTiles][4], uint32_t s_q, int warp_row0, int ds,
                           int lane) {
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt) {
    const int row = warp_row0 + 16 * mt + (lane % 16);
    const int xor_bits = Traits::Tile::pattern(lane) ^ (lane / 16);
    ldmatrix_x4(a[mt], s_q + Traits::Tile::pair_offset(row, ds, xor_bits) * Traits::kElemBytes);
  }
}

// Every k-step's Q fragments of the warp's rows, into registers (the Q_in_regs variants).
template <typename Traits>
CF_DEVICE void load_q_regs(uint32_t (&r_q)[Traits::kMTiles][Traits::kDSteps][4], uint32_t s_q,
                           int warp_row0, int lane) {
#pragma unroll
  for (int ds = 0; ds < Traits::kDSteps; ++ds) {
    uint32_t a[Traits::kMTiles][4];
    load_q_frag<Traits>(a, s_q, warp_row0, ds, lane);
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) r_q[mt][ds][i] = a[mt][i];
  }
}

// S = Q K^T for one key block. K is [kBlockN][d] row-major = B^T, which is the "col" layout of
// the B operand: plain ldmatrix gives b0/b1 of two 8-key tiles per call.
template <typename Traits>
CF_DEVICE void gemm_qk(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                       const uint32_t (&r_q)[Traits::kMTiles][Traits::kDSteps][4], uint32_t s_q,
                       uint32_t s_k, int warp_row0, int lane) {
#pragma unroll
  for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Traits::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

#pragma unroll
  for (int ds = 0; ds < Traits::kDSteps; ++ds) {
    uint32_t a[Traits::kMTiles][4];
    if constexpr (Traits::Q_in_regs) {
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[mt][i] = r_q[mt][ds][i];
    } else {
      load_q_frag<Traits>(a, s_q, warp_row0, ds, lane);
    }
#pragma unroll
    for (int np = 0; np < Traits::kNTiles / 2; ++np) {
      // matrices: (keys 0-7, k 0-7), (keys 0-7, k 8-15), (keys 8-15, k 0-7), (keys 8-15, k 8-15)
      const int key = 16 * np + (lane % 8) + 8 * (lane / 16);
      const int xor_bits = Traits::Tile::pattern(lane) ^ ((lane / 8) % 2);
      uint32_t b[4];
      ldmatrix_x4(b, s_k + Traits::Tile::pair_offset(key, ds, xor_bits) * Traits::kElemBytes);
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
        Traits::Ops::mma_16816(s[mt][2 * np], a[mt], b[0], b[1]);
        Traits::Ops::mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// O += P V for one key block. The S accumulator of 8-key tiles 2 ks and 2 ks + 1 is, element
// for element, the A operand of k-step ks (rows g / g + 8, keys 2t.. / 2t + 8..), so P never
// leaves registers. V is [kBlockN][d] row-major = B row-major: ldmatrix.trans gives the "col"
// fragments of two 8-wide d tiles per call.
template <typename Traits>
CF_DEVICE void gemm_pv(float (&o)[Traits::kMTiles][Traits::kDTiles][4],
                       const float (&p)[Traits::kMTiles][Traits::kNTiles][4], uint32_t s_v,
                       int lane) {
#pragma unroll
  for (int ks = 0; ks < Traits::kNSteps; ++ks) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Traits::kMTiles; ++mt) {
      p_operand<typename Traits::Ops>(a[mt], p[mt], ks);
    }
#pragma unroll
    for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
      // matrices: (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15)
      const int key = 16 * ks + (lane % 8) + 8 * ((lane / 8) % 2);
      const int xor_bits = Traits::Tile::pattern(lane) ^ (lane / 16);
      uint32_t b[4];
      ldmatrix_x4_trans(b, s_v + Traits::Tile::pair_offset(key, dp, xor_bits) * Traits::kElemBytes);
#pragma unroll
      for (int mt = 0; mt < Traits::kMTiles; ++mt) {
        Traits::Ops::mma_16816(o[mt][2 * dp], a[mt], b[0], b[1]);
        Traits::Ops::mma_16816(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc += A B for the warp's 16 rows, A given as the element-type words of an m16n8 accumulator
// (words[nt][half] = elements 2 half, 2 half + 1 of tile nt: k-step ks is tiles 2 ks, 2 ks + 1,
// as p_operand packs them) and B [k][d] row-major in shared memory (ldmatrix.trans, as gemm_pv).
template <typename Traits>
CF_DEVICE void gemm_packed_a(float (&acc)[1][Traits::kDTiles][4],
                             const uint32_t (&words)[Traits::kNTiles][2], uint32_t s_b, int lane) {
  using Tile = typename Traits::Tile;
#pragma unroll
  for (int ks = 0; ks < Traits::kNSteps; ++ks) {
    const uint32_t a[4] = {words[2 * ks][0], words[2 * ks][1], words[2 * ks + 1][0],
                           words[2 * ks + 1][1]};
#pragma unroll
    for (int dp = 0; dp < Traits::kDTiles / 2; ++dp) {
      const int row = 16 * ks + (lane % 8) + 8 * ((lane / 8) % 2);
      const int xor_bits = Tile::pattern(lane) ^ (lane / 16);
      uint32_t b[4];
      ldmatrix_x4_trans(b, s_b + Tile::pair_offset(row, dp, xor_bits) * Traits::kElemBytes);
      Traits::Ops::mma_16816(acc[0][2 * dp], a, b[0], b[1]);
      Traits::Ops::mma_16816(acc[0][2 * dp + 1], a, b[2], b[3]);
    }
  }
}

// A fragments of rows m0 .. m0 + 15 at k-step ks from a tile stored transposed, [k][m]:
// ldmatrix.trans of matrices (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
// gives a0..a3 of m16n8k16.
template <typename TileKM, int kElemBytes>
CF_DEVICE void load_a_frag_trans(uint32_t (&a)[4], uint32_t s_tile, int m0, int ks, int lane) {
  const int row = 16 * ks + (lane % 8) + 8 * (lane / 16);
  const int xor_bits = TileKM::pattern(lane) ^ ((lane / 8) % 2);
  ldmatrix_x4_trans(a, s_tile + TileKM::pair_offset(row, m0 / 16, xor_bits) * kElemBytes);
}

// acc += A B for the warp's 16 rows m0 .., A [m][k] in shared memory (TileA, ldmatrix as Q's
// fragments in load_q_frag), B [k][d] row-major (ldmatrix.trans as V in gemm_pv), kKSteps
// k-steps, the accumulator's kAccDTiles columns from column col0 of B.
template <typename Traits, typename TileA, int kKSteps>
CF_DEVICE void gemm_smem_a(float (&acc)[1][Traits::kAccDTiles][4], uint32_t s_a, int m0,
                           uint32_t s_b, int col0, int lane) {
  using Tile = typename Traits::Tile;
  constexpr int kEB = Traits::kElemBytes;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    const int a_row = m0 + (lane % 16);
    ldmatrix_x4(a, s_a + TileA::pair_offset(a_row, ks, TileA::pattern(lane) ^ (lane / 16)) * kEB);
#pragma unroll
    for (int dp = 0; dp < Traits::kAccDTiles / 2; ++dp) {
      const int row = 16 * ks + (lane % 8) + 8 * ((lane / 8) % 2);
      const int xor_bits = Tile::pattern(lane) ^ (lane / 16);
      uint32_t b[4];
      ldmatrix_x4_trans(b, s_b + Tile::pair_offset(row, col0 / 16 + dp, xor_bits) * kEB);
      Traits::Ops::mma_16816(acc[0][2 * dp], a, b[0], b[1]);
      Traits::Ops::mma_16816(acc[0][2 * dp + 1], a, b[2], b[3]);
    }
  }
}
