// The FP8 forward's two layout rules, shared by its kernels (fa3_fwd.cu with e4m3 inputs, and
// fp8_vt.cu, which writes V transposed for it): where P's accumulator registers go in the e4m3
// A operand of P V, and the matching order of keys in Vt.
//
// The 16-bit kernels re-pack P's m16n8 accumulator tiles as the A operand of a k16 wgmma in
// place (softmax.cuh's p_operand): both layouts give a thread the same keys. The e4m3 k32 A
// operand does not. Per warp, lane = 4 g + t holds
//   accumulator tile j (8 keys):     rows g, g + 8; keys 8 j + 2 t, 8 j + 2 t + 1;
//   A operand of a k-step (32 keys): rows g, g + 8; columns 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3.
// Instead of moving P across lanes (shuffles in the softmax's critical path), the kernel puts its
// own keys in the A columns it holds, and V's rows follow them: A column c of k-step ks is key
// 32 ks + fp8_vt_key(c), and Vt stores V's keys in that order (one permutation of every 32 keys,
// applied once in fp8_vt.cu's pass over V). The product P V sums over keys, so the order is free.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

// The key at column c (0..31) of an e4m3 A operand of P, and so at Vt position c of every 32:
// column 4 t + i (i = 0..3) of the lower 16 holds accumulator tile 2 (i / 2) element i % 2 of lane
// group t (keys 8 (i / 2) + 2 t + i % 2); the upper 16 the same, 16 keys on.
CF_DEVICE int fp8_vt_key(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + c % 2;
}

// Four floats as four e4m3 bytes of one register, x0 in the lowest byte: round to nearest even,
// saturated to +-448 (P is in [0, 1]: it never saturates), NaN kept.
CF_DEVICE uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x2, x3), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// P's accumulator tiles 4 ks .. 4 ks + 3 (keys 32 ks .. 32 ks + 31) as the A operand of P V's
// k-step ks: registers 0 / 1 hold rows g / g + 8 of tiles 4 ks and 4 ks + 1 (columns 4 t .. 4 t + 3),
// registers 2 / 3 the same rows of tiles 4 ks + 2 and 4 ks + 3 (columns 16 + 4 t .. 16 + 4 t + 3).
template <int kNTiles>
CF_DEVICE void p_operand_e4m3(uint32_t (&a)[4], const float (&p)[kNTiles][4], int ks) {
  const float (&t0)[4] = p[4 * ks];
  const float (&t1)[4] = p[4 * ks + 1];
  const float (&t2)[4] = p[4 * ks + 2];
  const float (&t3)[4] = p[4 * ks + 3];
  a[0] = pack4_e4m3(t0[0], t0[1], t1[0], t1[1]);
  a[1] = pack4_e4m3(t0[2], t0[3], t1[2], t1[3]);
  a[2] = pack4_e4m3(t2[0], t2[1], t3[0], t3[1]);
  a[3] = pack4_e4m3(t2[2], t2[3], t3[2], t3[3]);
}
