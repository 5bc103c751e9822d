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
