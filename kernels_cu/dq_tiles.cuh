// The Hopper backward's dQ accumulator tiles (BwdParams::dq_tiled): each 64-row tile of a
// (batch, head)'s dQacc rows holds its 64 x kHeadDim floats in the order the consumer warpgroups
// hold them in their wgmma accumulators, so that a warpgroup stages its dQ in shared memory with
// conflict-free 16-byte stores and one bulk reduce-add moves the tile into L2 (a row-major tile
// would put the eight rows of a store 512 bytes apart: one bank, an 8-way conflict).
//
// A tile covers the same addresses as its 64 rows would row by row (t0 * kHeadDim onward), in
// 64-column parts (a consumer's columns of dQ = dS K); inside a part, fragment j (8 columns) of
// thread tid holds its 4 floats contiguously:
//   float (row, col) at ((part * 8 + j) * 128 + tid) * 4 + e, with part = col / 64,
//   j = col % 64 / 8, tid = 32 (row / 16) + 4 (row % 8) + col % 8 / 2, e = 2 (row % 16 / 8) + col % 2
// (the m64nN accumulator layout of wgmma.cuh: warp row / 16, lane row % 8 * 4 + col % 8 / 2).
#pragma once

#include "common.cuh"

enum : int { kDqTileRows = 64, kDqPartCols = 64, kDqPartThreads = 128 };

// Byte offset in the tile of thread tid's fragment j of part `part` (a float4).
CF_DEVICE constexpr int dq_tile_fragment_bytes(int part, int j, int tid) {
  return ((part * (kDqPartCols / 8) + j) * kDqPartThreads + tid) * 16;
}

// Float offset in the tile of the pair (row, col), (row, col + 1), col even: one float2.
CF_DEVICE constexpr int dq_tile_pair(int row, int col) {
  const int tid = 32 * (row / 16) + 4 * (row % 8) + (col % 8) / 2;
  return dq_tile_fragment_bytes(col / kDqPartCols, (col % kDqPartCols) / 8, tid) / 4 +
         2 * ((row % 16) / 8);
}

// The 80-row steps' tiles (BwdParams::dq_tiled == kDqTilesSwapped; d = 128, fa3_bwd.cu's
// Dq_swapped): a consumer computes dQ^T = K^T dS^T (d's 64 columns of its part on wgmma's M, the
// step's 80 rows on N; 80 is no multiple of wgmma's M of 64), so each 80-row tile of a (batch,
// head)'s rows holds its 80 x 128 floats in that accumulator's order, over the same addresses as
// its rows row by row:
//   float (row, col) at ((part * 10 + j) * 128 + tid) * 4 + e, with part = col / 64,
//   j = row / 8, tid = 32 (col % 64 / 16) + 4 (col % 8) + row % 8 / 2,
//   e = 2 (col % 16 / 8) + row % 2
// (the m64n80 accumulator with d as its row: fragment j is 8 query rows).
enum : int { kDqSwappedRows = 80 };

CF_DEVICE constexpr int dq_swapped_fragment_bytes(int part, int j, int tid) {
  return ((part * (kDqSwappedRows / 8) + j) * kDqPartThreads + tid) * 16;
}

// The float4 of an 80-row tile holding columns 16 group + k and 16 group + 8 + k (k < 8) of rows
// row and row + 1 (row even; an odd row's is its pair's): floats 0 and 1 the first column's two
// rows, 2 and 3 the second's (the dq conversion's reads).
CF_DEVICE constexpr int dq_swapped_float4(int row, int group, int k) {
  return dq_swapped_fragment_bytes(group / 4, row / 8, 32 * (group % 4) + 4 * k + row % 8 / 2) / 4;
}

// Packed sequences (BwdParams::dq_tiled == kDqTilesPacked): sequence b's temporary rows (its
// -LSE log2 e, D and dQacc tiles) start at a multiple of kDqSeqAlign at or after its packed
// start, (start + b kDqSeqAlign) rounded down; the next sequence's start lies at least its rows
// rounded up to kDqSeqAlign further on, so that a step's one or two tiles (64 or 128 rows) are
// its own. A head's rows then end by kDqSeqAlign (ceil(total / kDqSeqAlign) + batch) (the
// host's row_head_stride): every start is at most total + (batch - 1) kDqSeqAlign.
enum : int { kDqTilesPadded = 1, kDqTilesPacked = 2, kDqTilesSwapped = 3, kDqSeqAlign = 128 };

CF_DEVICE constexpr int64_t dq_seq_temp_start(int start, int batch) {
  return (static_cast<int64_t>(start) + static_cast<int64_t>(batch) * kDqSeqAlign) / kDqSeqAlign *
         kDqSeqAlign;
}

// Temporary row `row` of a head (0 <= row < the head's rows) in that layout: the sequence whose
// aligned start is the last at or before it (a binary search over cu_seqlens, `batch` + 1
// offsets), its packed rows [start, start + len) and the row's place seq_row in them; a row of
// the sequence where 0 <= seq_row < len, else padding. Offsets are clamped into [0, total] as
// the key-block kernel's clamped_seq_rows clamps them: bad ones (which prep reports) keep every
// access in bounds.
struct DqSeqRow {
  int start, len, seq_row;
};
CF_DEVICE DqSeqRow dq_seq_of_temp_row(const int32_t* cu_seqlens, int batch, int total, int row) {
  auto offset = [&](int b) { return min(max(cu_seqlens[b], 0), total); };
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (dq_seq_temp_start(offset(mid), mid) <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int start = offset(lo);
  return {start, max(offset(lo + 1) - start, 0),
          row - static_cast<int>(dq_seq_temp_start(start, lo))};
}
