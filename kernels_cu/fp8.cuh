// The float8 KV cache: its two formats, the exact widening of cached bytes into the fp16
// elements the tensor cores take, and the saturating quantisation of appended tokens.
//
// A cached byte b of KV head h stands for fp8(b) * scale_h. The decode kernel widens fp8(b) to
// fp16, which is exact (e4m3: 3 mantissa bits, exponents 2^-9 .. 2^8; e5m2: 2 mantissa bits,
// 2^-16 .. 2^15; fp16 holds every such value, its subnormals included, also times the power of
// two a widening leaves), and applies the scale in fp32 outside the tile: the K scale
// multiplies the scores (folded into the softmax's multiplier), the V scale the normalised
// output. Multiplying the bytes by the scale in the tile instead would round each product to 11
// bits before the MMA, an error the folded form does not have.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

// DecodeParams::kv_fp8: what k_ptr / v_ptr hold.
enum : int32_t { kKvSameAsQ = 0, kKvE4M3 = 1, kKvE5M2 = 2 };

// The element a cache stores: q's type, or a float8 byte.
template <typename Element, bool Kv_fp8>
struct CacheElementOf {
  using type = Element;
};
template <typename Element>
struct CacheElementOf<Element, true> {
  using type = unsigned char;
};

// The MMAs over a float8 cache take fp16 operands whatever q's type: fp16 holds every e4m3 and
// e5m2 value exactly, and the widening is then one instruction per two bytes in registers
// (through fp32 to bf16 it was four, plus a pass through shared memory, which held the cache's
// read rate to 2.1-2.6 TB/s on the H200).
//
// Fp8Widen<kFormat>::apply(w, lo, hi): four cached bytes x0..x3 (the lowest first) as two fp16
// pairs, lo = (x0, x1) and hi = (x2, x3), exactly, NaN and (e5m2) infinities included.
template <__nv_fp8_interpretation_t kFormat>
struct Fp8Widen;

// e5m2 is fp16's upper byte: one byte permute places two.
template <>
struct Fp8Widen<__NV_E5M2> {
  static CF_DEVICE void apply(uint32_t w, uint32_t& lo, uint32_t& hi) {
    lo = __byte_perm(w, 0u, 0x1404);  // 0 x0 0 x1
    hi = __byte_perm(w, 0u, 0x3424);  // 0 x2 0 x3
  }
};

// e4m3: the cvt.rn.f16x2.e4m3x2 instruction (sm_89+; on sm_80 a short emulation). Measured on
// the H200 against widening by integer operations (s eeee mmm -> s 0eeee mmm 0000000, times 2^8,
// seven operations per four bytes and three more to catch the NaN byte, which that maps to a
// finite value): 1.50-1.69x the bf16 cache's speed against 1.25-1.38x.
template <>
struct Fp8Widen<__NV_E4M3> {
  static CF_DEVICE void apply(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // The halves of w as the instructions' operands (ptxas selects the upper one in place; the
    // intrinsic's w >> 16 cost a shift per word)
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
        " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
#else
    const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(w & 0xffffu, __NV_E4M3);
    const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(w >> 16, __NV_E4M3);
    lo = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
    hi = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
#endif
  }
};

// Quantisation on append, as vLLM's and FlashInfer's: byte = cvt.rn.satfinite(x / scale), the
// quotient rounded once in fp32 (IEEE division), then to the nearest fp8 value (ties to even),
// saturated to +-448 (e4m3) or +-57344 (e5m2); NaN stays NaN.
CF_DEVICE uint32_t quantise_fp8x2(float a, float b, float scale, int32_t format) {
  const float2 x = make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale));
  return format == kKvE5M2 ? __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E5M2)
                           : __nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, __NV_E4M3);
}

CF_DEVICE unsigned char quantise_fp8(float x, float scale, int32_t format) {
  return static_cast<unsigned char>(quantise_fp8x2(x, 0.f, scale, format) & 0xffu);
}
