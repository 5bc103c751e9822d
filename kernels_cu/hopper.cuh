// Hopper (sm_90a) building blocks: TMA tile loads, mbarriers, bulk reduce-adds and their groups,
// wgmma descriptors and fences, setmaxnreg. Only kernels compiled for sm_90a include this header.
//
// Shared-memory image of a tile: the 128-byte swizzle that both the TMA engine (SWIZZLE_128B)
// and wgmma (descriptor layout type 1) use. A [rows][d] tile is stored as d / 64 column blocks
// [d / 64][rows][64]; each row of a column block is 128 bytes, 8 rows form a 1024-byte atom, and
// the 16-byte chunk c of row r sits at chunk position c ^ (r % 8). Atoms must be 1024-byte aligned.
#pragma once

#include "common.cuh"
#include "params.cuh"  // TmaMap

constexpr int kSwizzleRowBytes = 128;    // one row of a column block
constexpr int kSwizzleAtomBytes = 1024;  // 8 rows: the swizzle period
constexpr int kColBlockElems = 64;       // 16-bit elements per 128-byte row

// A kernel's dynamic shared memory, its .shared address aligned up to a swizzle atom (where the
// kernels' shared-storage structs start).
CF_DEVICE uint32_t swizzle_aligned_base(const void* smem_raw) {
  return (smem_addr(smem_raw) + kSwizzleAtomBytes - 1) & ~(kSwizzleAtomBytes - 1);
}

// Byte offset of element (row, col) inside a [d / 64][rows][64] swizzled tile.
template <int kRows>
CF_DEVICE uint32_t swizzled_offset(int row, int col) {
  const int chunk = (col % kColBlockElems) / 8;
  return (col / kColBlockElems) * kRows * kSwizzleRowBytes + row * kSwizzleRowBytes +
         ((chunk ^ (row % 8)) * 16) + (col % 8) * 2;
}

// Four 8 x 8 tiles of 16-bit values from the mma fragment layout (register j: tile j, this
// lane's row lane / 4, columns 2 (lane % 4) and + 1) to shared memory, rows where lanes 8 j ..
// 8 j + 7 point (stmatrix.x4, sm_90: one instruction where four 32-bit stores were).
CF_DEVICE void stmatrix_x4(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same four tiles stored transposed (stmatrix.trans): register j's element (lane / 4,
// 2 (lane % 4) + c) lands in row 2 (lane % 4) + c, column lane / 4 of tile j, the rows where
// lanes 8 j .. 8 j + 7 point.
CF_DEVICE void stmatrix_x4_trans(uint32_t row_addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                 uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// Rows [first, end) of a swizzled tile of kColBlocks column blocks of kRows rows set to zero by
// threads `thread`, `thread` + threads, ...: the swizzle permutes 16-byte chunks within a row,
// so zeroing every chunk of a row needs no swizzle arithmetic. (Packed sequences: rows a TMA
// load read past a sequence's end, the next sequence's.) Rolled: the loop not unrolled (the
// Hopper backward's consumers run it beside their accumulators, where the unrolled loop's
// precomputed addresses spilled).
template <int kColBlocks, int kRows, bool Rolled = false>
CF_DEVICE void zero_tile_rows(uint32_t tile, int first, int end, int thread, int threads) {
  constexpr int kChunksPerRow = kSwizzleRowBytes / 16;
  const int chunks = (end - first) * kColBlocks * kChunksPerRow;
  auto zero_chunk = [&](int i) {
    const int row = first + i / (kColBlocks * kChunksPerRow);
    const int cb = (i / kChunksPerRow) % kColBlocks;
    st_shared_zero_b128(tile + (cb * kRows + row) * kSwizzleRowBytes + (i % kChunksPerRow) * 16);
  };
  if constexpr (Rolled) {
#pragma unroll 1
    for (int i = thread; i < chunks; i += threads) zero_chunk(i);
  } else {
    for (int i = thread; i < chunks; i += threads) zero_chunk(i);
  }
}

// ---------------------------------------------------------------------------------------------
// mbarrier: arrival counts plus a transaction (byte) count that TMA completes.
// ---------------------------------------------------------------------------------------------
CF_DEVICE void mbar_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}

// Makes the initialisation visible to the async proxy (TMA) and the other threads.
CF_DEVICE void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

CF_DEVICE void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
CF_DEVICE void mbar_arrive_expect_tx(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// Wait until the phase with the given parity has completed. A fresh barrier is in phase 0, so
// waiting on parity 1 returns at once: producers start their "slot is free" waits there.
CF_DEVICE void mbar_wait(uint32_t bar, int parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// ---------------------------------------------------------------------------------------------
// TMA: one instruction moves a whole box (here 64 elements x rows) into a swizzled tile and
// completes `bytes` on the mbarrier. Coordinates are innermost first; out-of-range rows are
// filled with zeros (so a ragged tail never brings garbage, let alone NaN, into P V).
// ---------------------------------------------------------------------------------------------
CF_DEVICE void tma_load_4d(uint32_t dst, const TmaMap& map, uint32_t bar, int c0, int c1, int c2,
                           int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Rows row0 .. row0 + kRows - 1 of head `head`, batch `batch` of a tensor map, as every Hopper
// kernel's tiles take them (Q, K, V, dO): kColBlocks boxes of kColElems columns, one 128-byte
// swizzled row each, column block cb at dst + cb * kRows rows; all on the mbarrier `bar`.
template <int kColBlocks, int kRows, int kColElems>
CF_DEVICE void tma_load_rows(uint32_t dst, const TmaMap& map, uint32_t bar, int row0, int head,
                             int batch) {
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb)
    tma_load_4d(dst + cb * kRows * kSwizzleRowBytes, map, bar, cb * kColElems, row0, head, batch);
}

// The same rows of two tensor maps of one shape (K and V, Q and dO), their boxes interleaved by
// column block (a's column block cb, then b's), all on the mbarrier `bar`.
template <int kColBlocks, int kRows, int kColElems>
CF_DEVICE void tma_load_row_pair(uint32_t dst_a, const TmaMap& map_a, uint32_t dst_b,
                                 const TmaMap& map_b, uint32_t bar, int row0, int head, int batch) {
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    const uint32_t offset = cb * kRows * kSwizzleRowBytes;
    tma_load_4d(dst_a + offset, map_a, bar, cb * kColElems, row0, head, batch);
    tma_load_4d(dst_b + offset, map_b, bar, cb * kColElems, row0, head, batch);
  }
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) of global memory copied whole into
// shared memory by the TMA engine, completing them on the mbarrier `bar` (no tensor map: the
// backward's per-row -LSE log2 e and D of a step, contiguous in global memory).
CF_DEVICE void bulk_load(uint32_t dst, const void* src, int bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// A ring of TMA-filled buffers (FlashAttention-3's PipelineTmaAsync), the same protocol in the
// forward (K and V blocks) and the backward (Q and dO blocks): slot s has a full mbarrier (one
// producer arrival with the bytes its loads bring) and an empty one (one arrival per consumer
// warp once done reading). Use u of the ring (u = 0, 1, 2, ...) is slot u % kStages, whose full
// barrier completes that use with phase parity (u / kStages) & 1.
// ---------------------------------------------------------------------------------------------
template <int kStages>
struct RingUse {
  int stage, parity;
  CF_DEVICE explicit RingUse(int use) : stage(use % kStages), parity((use / kStages) & 1) {}
};
// The producer's side of a use: wait until the consumers released the slot's use before it
// (the other parity; the first kStages uses pass at once), then announce the bytes to land.
CF_DEVICE void ring_acquire(uint32_t full_bar, uint32_t empty_bar, int parity, int bytes) {
  mbar_wait(empty_bar, parity ^ 1);
  mbar_arrive_expect_tx(full_bar, bytes);
}

// dst[i] += src[i] for `bytes` of fp32 (a multiple of 16, 16-byte aligned), in L2 by the TMA
// engine: one instruction for a whole tile (the backward's dQ), tracked by bulk groups, not mbarriers.
CF_DEVICE void bulk_reduce_add_f32(float* dst, uint32_t src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   reinterpret_cast<uint64_t>(dst)),
               "r"(src), "r"(bytes)
               : "memory");
}
CF_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most kPending of this thread's bulk groups are still reading their shared memory.
template <int kPending>
CF_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Until at most kPending of this thread's bulk groups are incomplete (their writes done).
template <int kPending>
CF_DEVICE void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// A turn counter in global memory, between CTAs (the deterministic backward's order of dQ adds):
// read with acquire, advanced with release, at GPU scope; the proxy fence orders the TMA engine's
// bulk operations (the async proxy) with these generic-proxy accesses of the same thread.
CF_DEVICE int ld_acquire_gpu(const int32_t* counter) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
  return value;
}
CF_DEVICE void red_release_gpu_add(int32_t* counter, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(counter), "r"(value) : "memory");
}
CF_DEVICE void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma shared-memory descriptor, 128-byte swizzle:
//   bits 0-13 start address >> 4, 16-29 leading-dimension byte offset >> 4,
//   32-45 stride-dimension byte offset >> 4, 62-63 layout (1 = 128-byte swizzle).
// K-major operand (Q, K): rows 128 bytes apart, 8-row atoms SBO = 1024 apart; the k-step moves
//   the start address by 32 bytes inside the row (LBO unused).
// MN-major operand (V read as B of P V): along N the 64-element column blocks are LBO apart,
//   along K (keys) the 8-row atoms SBO = 1024 apart.
// ---------------------------------------------------------------------------------------------
CF_DEVICE uint64_t wgmma_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes) {
  uint64_t desc = (smem_byte_addr & 0x3FFFF) >> 4;
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>(kSwizzleAtomBytes >> 4) << 32;
  desc |= 1ull << 62;
  return desc;
}

// The descriptor of the address `bytes` past the one `desc` holds, for the k-steps of one
// operand: one integer add instead of encoding the address again (mask, shift, or) before each
// wgmma, on the path that issues them. A shared address is below 2^18, so the start-address
// field (bits 0-13) takes the add without a carry into the fields above it. A 64-bit add, which
// ptxas makes one UIADD3.64 writing the whole register pair the wgmma reads: adding to the low
// word alone and or-ing the high word back (the same value) made it write the constant high
// words with a UMOV each before every HGMMA (80 a step of the d = 128 backward; 455 -> 409
// instructions a causal step, 413 -> 366 without a mask, 613 -> 556 at d = 64).
CF_DEVICE uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// Orders this thread's register writes of accumulators / A fragments before the next wgmma.
CF_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Orders this thread's shared-memory stores (generic proxy) before later reads by the async
// proxy (a wgmma operand): needed when a wgmma reads what threads have just written.
CF_DEVICE void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
CF_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
CF_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The wgmma asm statements name the accumulators as outputs when they are *issued*; after
// wgmma_wait this empty asm tells the compiler they change here, so no read of them is
// scheduled between the issue and the wait.
template <int kCols>
CF_DEVICE void wgmma_fence_operands(float (&acc)[kCols][4]) {
#pragma unroll
  for (int c = 0; c < kCols; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[c][e])::"memory");
}

// Keeps the work that produced `sums` above the next wgmma_wait. ptxas schedules
// wgmma.wait_group as if it cost nothing and hoists it above independent arithmetic (an empty
// asm fence does not stop it: ptxas never sees one), so FA3's softmax-under-P V overlap would
// run serially. A branch on the sums (never taken: a running sum of exp2 is >= 0 or NaN) ends
// the basic block, and the wait is not moved above it.
template <int kCount>
CF_DEVICE void keep_above_wait(const float (&sums)[kCount]) {
  bool negative = false;
#pragma unroll
  for (int i = 0; i < kCount; ++i) negative |= sums[i] < 0.f;
  if (negative) __trap();
}

// Register reallocation between warpgroups (counts: multiples of 8 in [24, 256]).
template <int kRegs>
CF_DEVICE void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
CF_DEVICE void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Barrier among the kThreads threads of one warpgroup-sized group (ids 1.. ; 0 is __syncthreads).
CF_DEVICE void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrive without waiting: with named_barrier_sync of the same id on the other side, a one-way
// signal from one warpgroup to another (the ping-pong turn hand-over).
CF_DEVICE void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
