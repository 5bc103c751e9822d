// Shared building blocks of every cupyflash kernel: fixed-width integers,
// element-type traits, and thin wrappers over the PTX instructions the kernels are built from
// (mma.sync, ldmatrix, cp.async, ex2/tanh approximations) plus the shared-memory swizzle.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDACC_RTC__)  // NVRTC ships no <cstdint>
typedef int int32_t;
typedef long long int64_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <cstdint>
#endif

#define CF_DEVICE __device__ __forceinline__

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): turns a log2-domain LSE into natural log

CF_DEVICE float neg_infinity() { return -__int_as_float(0x7f800000); }
CF_DEVICE float quiet_nan() { return __int_as_float(0x7fffffff); }
CF_DEVICE bool is_nan(float x) { return x != x; }

CF_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// f(0), f(1), ..., f(N - 1), each index a literal after inlining: a `#pragma unroll` loop over
// the calls of a lambda left the index to run time in one variant (the fragments it indexes went
// to the stack), and calls written out by hand can repeat or skip one.
template <int... I>
struct IndexList {};
template <int N, int... I>
struct MakeIndexList : MakeIndexList<N - 1, N - 1, I...> {};
template <int... I>
struct MakeIndexList<0, I...> {
  using type = IndexList<I...>;
};
template <typename F, int... I>
CF_DEVICE void call_each_index(F& f, IndexList<I...>) {
  (f(I), ...);
}
template <int N, typename F>
CF_DEVICE void for_each_index(F& f) {
  call_each_index(f, typename MakeIndexList<N>::type{});
}

// ---------------------------------------------------------------------------------------------
// Element types: the two 16-bit floating types the tensor cores take.
// ---------------------------------------------------------------------------------------------
template <typename T>
struct ElementTraits;

template <>
struct ElementTraits<__half> {
  static constexpr bool kIsFp16 = true;
  // Two floats rounded to one 32-bit register holding (lo, hi): an MMA A/B operand word.
  static CF_DEVICE uint32_t pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  // D = A * B + D with A 16x16 (row), B 16x8 (col), fp32 accumulate.
  static CF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ElementTraits<__nv_bfloat16> {
  static constexpr bool kIsFp16 = false;
  static CF_DEVICE uint32_t pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static CF_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Scalar conversions of the element types (and of fp32 partials) to and from float.
CF_DEVICE float to_float(float x) { return x; }
CF_DEVICE float to_float(__half x) { return __half2float(x); }
CF_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
CF_DEVICE T from_float(float x);
template <>
CF_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
CF_DEVICE __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
CF_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------------
// Fast math. ex2.approx is the MUFU instruction the online softmax is built around (one per
// score); ex2.approx(-inf) = +0, which is how masked scores vanish.
// ---------------------------------------------------------------------------------------------
// 2^e for e in [-126, 127], exactly (a normal float's exponent field).
CF_DEVICE float pow2(int e) { return __int_as_float((e + 127) << 23); }

CF_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

CF_DEVICE float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// Shared memory and asynchronous copies.
// ---------------------------------------------------------------------------------------------
// Kernels address shared memory with 32-bit .shared-window addresses from one base: NVRTC
// lowered pointer arithmetic on the generic `extern __shared__` pointer to 64-bit math (464
// add.s64 against nvcc's 83 in the d = 256 kernel) and spilled where nvcc did not.
CF_DEVICE uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

CF_DEVICE void st_shared_b32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(value));
}

CF_DEVICE void st_shared_b128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}

CF_DEVICE void st_shared_zero_b128(uint32_t addr) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u));
}

CF_DEVICE uint32_t ld_shared_b32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

CF_DEVICE uint32_t ld_shared_u16(uint32_t addr) {
  unsigned short v;
  asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(v) : "r"(addr));
  return v;
}

CF_DEVICE uint2 ld_shared_b64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// ld_shared_f32x2(addr + offset) with the add inside the asm: for an offset known at compile
// time ptxas folds it into the instruction (one register holds the base of a row of loads),
// where NVVM would have turned `addr + offset` into an OR that ptxas cannot fold, one register
// per address.
CF_DEVICE float2 ld_shared_f32x2_offset(uint32_t addr, uint32_t offset) {
  uint2 v;
  asm volatile("{\n .reg .u32 a;\n add.u32 a, %2, %3;\n ld.shared.v2.b32 {%0, %1}, [a];\n}\n"
               : "=r"(v.x), "=r"(v.y)
               : "r"(addr), "r"(offset));
  return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

CF_DEVICE float2 ld_shared_f32x2(uint32_t addr) {
  const uint2 v = ld_shared_b64(addr);
  return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

CF_DEVICE uint4 ld_shared_b128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// One 16-byte global store. Spelled out: NVVM split `*(uint4*)p = ld_shared_b128(..)` into four
// 4-byte stores in the Hopper kernel's epilogue (4x the store instructions per row of O).
CF_DEVICE void st_global_b128(void* ptr, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// The first `count` (0..8) 16-bit elements at src, as one 16-byte chunk whose other elements are
// zero: a row of a head dim that is not a multiple of 8 is 2-byte aligned only, so it is read
// element by element (synchronously, unlike cp.async).
CF_DEVICE uint4 ld_global_elements(const void* src, int count) {
  const unsigned short* e = static_cast<const unsigned short*>(src);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = 2 * i < count ? e[2 * i] : 0u;
    const uint32_t hi = 2 * i + 1 < count ? e[2 * i + 1] : 0u;
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The first `count` (0..8) 16-bit elements of a chunk, stored element by element.
CF_DEVICE void st_global_elements(void* dst, uint4 v, int count) {
  unsigned short* e = static_cast<unsigned short*>(dst);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (i < count) e[i] = static_cast<unsigned short>(w[i / 2] >> (16 * (i % 2)));
}

// 16-byte global -> shared copy that bypasses L1 (.cg). When !valid the 16 bytes are zero-filled
// and nothing is read: rows past the end of a sequence become zeros, never garbage (a NaN in
// an unused V row would survive 0 * NaN in P @ V).
CF_DEVICE void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// The same, always copying (no source-size operand to compute).
CF_DEVICE void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// One 4-byte global -> shared copy (.ca: the only size below 16 bytes cp.async takes); zero
// filled when !valid.
CF_DEVICE void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

CF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most kPending committed groups are still in flight.
template <int kPending>
CF_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lane i gives the row address of matrix i / 8, row i % 8, and receives
// in r[j] the two elements (row lane / 4, cols 2 * (lane % 4) + {0, 1}) of matrix j.
CF_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, transposed: r[j] receives (rows 2 * (lane % 4) + {0, 1}, col lane / 4) of matrix j.
CF_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---------------------------------------------------------------------------------------------
// Swizzled row-major tile [rows][kHeadDim] of 16-bit elements in shared memory.
//
// A row is kHeadDim / 8 chunks of 16 bytes. ldmatrix reads one chunk from each of 8 consecutive
// rows per phase; unswizzled, rows 256 bytes apart (d = 128) land in the same 4 banks: an 8-way
// conflict. XOR-ing the chunk index with the row puts the 8 chunks in 8 different 16-byte bank
// groups. When a row is an odd multiple of 64 bytes (d = 32, 96) consecutive rows already
// alternate between the two halves of the 128-byte bank window, so XOR-ing with (row / 2) % 4
// within aligned groups of 4 chunks is enough (and keeps the chunk inside the row).
// ---------------------------------------------------------------------------------------------
template <int kHeadDim>
struct SwizzledTile {
  static constexpr int kChunksPerRow = kHeadDim / 8;
  static_assert(kChunksPerRow % 4 == 0, "head dim must be a multiple of 32");
  static constexpr bool kFullXor = kChunksPerRow % 8 == 0;

  static constexpr int kGroup = kFullXor ? 8 : 4;  // chunks permuted among themselves

  // Swizzle pattern of a row.
  static CF_DEVICE int pattern(int row) { return kFullXor ? (row & 7) : ((row >> 1) & 3); }

  // Element offset of (row, first element of 16-byte chunk `chunk`).
  static CF_DEVICE int offset(int row, int chunk) {
    return row * kHeadDim + (chunk ^ pattern(row)) * 8;
  }

  // ldmatrix addressing: a lane reads row (multiple of 8) + lane % 8 -- whose pattern is
  // pattern(lane) -- at chunk 2 * step + bit, bit in {0, 1} per lane, step an unrolled index.
  // With xor_bits = pattern(lane) ^ bit as the only run-time part of the swizzle, the steps of
  // an unrolled loop share kGroup / 2 base addresses. Written as offset(row, 2 * step + bit),
  // ptxas kept one address per step live across the main loop and spilled (d = 256).
  static CF_DEVICE int pair_offset(int row, int step, int xor_bits) {
    const int chunk_even = 2 * step;
    return row * kHeadDim + (chunk_even & ~(kGroup - 1)) * 8 +
           ((chunk_even & (kGroup - 1)) ^ xor_bits) * 8;
  }
};

// ---------------------------------------------------------------------------------------------
// The caller's columns of a tile. A tile is kHeadDim columns wide (the swizzle's and the MMAs'
// unit); the caller's rows hold kValidDim <= kHeadDim of them (0: all). The columns past
// kValidDim are zeros in shared memory, where they add nothing to Q K^T and give zero columns of
// P V, dS K and dS^T Q, and they are never read or written in global memory: no copy or pad of
// the caller's arrays. A head dim that is a multiple of 8 moves in whole 16-byte chunks (the
// chunks past it skipped); any other is 2-byte aligned row to row and moves element by element.
// ---------------------------------------------------------------------------------------------
template <int kHeadDim, int kValidDim_>
struct TileColumns {
  static constexpr int kValidDim = kValidDim_ > 0 ? kValidDim_ : kHeadDim;
  static constexpr bool kFull = kValidDim == kHeadDim;
  static constexpr bool kWholeChunks = kValidDim % 8 == 0;  // rows of 16-byte chunks
  static constexpr int kChunks = (kValidDim + 7) / 8;       // chunks holding a caller's column
  static_assert(0 < kValidDim && kValidDim <= kHeadDim, "the caller's columns fit the tile");

  // Does 16-byte chunk `chunk` of a row hold any of the caller's columns? (How many: count.)
  static CF_DEVICE constexpr bool holds(int chunk) { return kFull || chunk < kChunks; }
  static CF_DEVICE constexpr int count(int chunk) {
    return kValidDim - 8 * chunk >= 8 ? 8 : (kValidDim - 8 * chunk > 0 ? kValidDim - 8 * chunk : 0);
  }
};

// Chunk `chunk` of a global row of the caller's columns (zeros past them).
template <typename Columns, typename Element>
CF_DEVICE uint4 ld_global_chunk(const Element* row, int chunk) {
  if constexpr (Columns::kWholeChunks) {
    return Columns::holds(chunk) ? *reinterpret_cast<const uint4*>(row + 8 * chunk)
                                 : make_uint4(0u, 0u, 0u, 0u);
  } else {
    return ld_global_elements(row + 8 * chunk, Columns::count(chunk));
  }
}

// Chunk `chunk` of a tile row into a global row of the caller's columns (none past them).
template <typename Columns, typename Element>
CF_DEVICE void st_global_chunk(Element* row, int chunk, uint4 v) {
  if constexpr (Columns::kWholeChunks) {
    if (Columns::holds(chunk)) st_global_b128(row + 8 * chunk, v);
  } else {
    st_global_elements(row + 8 * chunk, v, Columns::count(chunk));
  }
}
