// The float8 KV cache: its two formats, the exact widening of cached bytes into the 16-bit
// elements the tensor cores take, and the saturating quantisation of appended tokens.
//
// A cached byte b of KV head h stands for fp8(b) * scale_h. The decode kernel widens fp8(b) to
// q's element type, which is exact in both directions that occur (e4m3: 3 mantissa bits,
// exponents 2^-9 .. 2^8; e5m2: 2 mantissa bits, 2^-16 .. 2^15; fp16 and bf16 hold every such
// value, fp16's subnormals included), and applies the scale in fp32 outside the tile: the K scale
// multiplies the scores (folded into the softmax's multiplier), the V scale the normalised
// output. Multiplying the bytes by the scale in the tile instead would round each product to 8
// (bf16) or 11 (fp16) bits before the MMA, an error the folded form does not have.
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

// Two cached bytes (the low one first) as one word of two elements of q's type.
template <typename Element, __nv_fp8_interpretation_t kFormat>
CF_DEVICE uint32_t widen_fp8x2(uint32_t two_bytes);

template <>
CF_DEVICE uint32_t widen_fp8x2<__half, __NV_E4M3>(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes),
                                                   __NV_E4M3);  // one cvt on sm_89+
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
template <>
CF_DEVICE uint32_t widen_fp8x2<__half, __NV_E5M2>(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E5M2);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
// bf16 through fp16 and fp32 (each step exact for these values; fp16 -> fp32 keeps fp16's
// subnormals, which -ftz=true would flush only in fp32 arithmetic).
template <__nv_fp8_interpretation_t kFormat>
CF_DEVICE uint32_t widen_fp8x2_bf16(uint32_t two_bytes) {
  const uint32_t word = widen_fp8x2<__half, kFormat>(two_bytes);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&word));
  const __nv_bfloat162 b = __float22bfloat162_rn(f);
  return *reinterpret_cast<const uint32_t*>(&b);
}
template <>
CF_DEVICE uint32_t widen_fp8x2<__nv_bfloat16, __NV_E4M3>(uint32_t two_bytes) {
  return widen_fp8x2_bf16<__NV_E4M3>(two_bytes);
}
template <>
CF_DEVICE uint32_t widen_fp8x2<__nv_bfloat16, __NV_E5M2>(uint32_t two_bytes) {
  return widen_fp8x2_bf16<__NV_E5M2>(two_bytes);
}

// Eight cached bytes (two words, the lowest byte first) as one 16-byte chunk of eight elements.
template <typename Element, __nv_fp8_interpretation_t kFormat>
CF_DEVICE uint4 widen_fp8x8(uint32_t lo, uint32_t hi) {
  return make_uint4(
      widen_fp8x2<Element, kFormat>(lo & 0xffffu), widen_fp8x2<Element, kFormat>(lo >> 16),
      widen_fp8x2<Element, kFormat>(hi & 0xffffu), widen_fp8x2<Element, kFormat>(hi >> 16));
}

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
