// Dropout on the attention probabilities: which elements of P a call keeps, from a counter-based
// generator (Philox4x32-10, Salmon et al. 2011), so that the backward regenerates the forward's
// mask from the seed alone, and the host twin (cupyflash/xp_impl.py, Dropout) reproduces it bit
// for bit.
//
// Element (query row i, key j) of query head h, batch entry b (i, j within the sequence) is
// kept iff its 16-bit draw u >= dropout_threshold (= round(p * 65536)), where
//   Philox(counter = (4 (j / 16) + (j % 8) / 2,  8 (i / 16) + i % 8,  h,  b), key = seed)
// gives four 32-bit words = eight 16-bit draws, and the element's draw is number
//   4 ((i / 8) % 2) + 2 ((j / 8) % 2) + j % 2     (word = number / 2, low half first).
// One call covers the eight elements an mma.sync accumulator thread holds in a 16 x 16 block of
// S (rows lane / 4 + {0, 8}, columns 2 (lane % 4) + {0, 1, 8, 9}), so the forward draws once
// per 8 elements; the backward, whose tiles are S^T, uses half of each of two draws.
// Kept values are scaled by dropout_scale = 65536 / (65536 - threshold), the inverse of the keep
// probability the threshold gives: 1 / (1 - p) to 2^-17 / (1 - p), as SDPA's and flash-attn's.
#pragma once

#include "common.cuh"

struct Philox4 {
  uint32_t x, y, z, w;
};

// Philox4x32-10: ten rounds of two 32 x 32 -> 64-bit products, the key bumped by the Weyl
// constants between rounds (the published test vectors: tests/test_dropout.py).
CF_DEVICE Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = {hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

// The eight 16-bit draws of one counter, as "keep" bits: bit n is draw number n (see above).
CF_DEVICE uint32_t keep_bits(const Philox4& r, uint32_t threshold) {
  const uint32_t words[4] = {r.x, r.y, r.z, r.w};
  uint32_t bits = 0;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const uint32_t draw = (words[n / 2] >> (16 * (n % 2))) & 0xFFFFu;
    bits |= (draw >= threshold ? 1u : 0u) << n;
  }
  return bits;
}

struct DropoutMask {
  uint32_t k0, k1, threshold;
  uint32_t head, batch;

  CF_DEVICE DropoutMask(uint64_t seed, uint32_t threshold_, int head_, int batch_)
      : k0(static_cast<uint32_t>(seed)),
        k1(static_cast<uint32_t>(seed >> 32)),
        threshold(threshold_),
        head(static_cast<uint32_t>(head_)),
        batch(static_cast<uint32_t>(batch_)) {}

  // The keep bits of the 16 x 16 block whose first row is row16 and first key key16 (both
  // multiples of 16), for draw counter (row16, key16) + this lane's offsets (x: lane % 4,
  // y: lane / 4): the forward's and the dQ kernel's layout.
  CF_DEVICE uint32_t block_bits(int row16, int key16, int lane) const {
    const Philox4 c = {static_cast<uint32_t>(key16 / 4 + lane % 4),
                       static_cast<uint32_t>(row16 / 2 + lane / 4), head, batch};
    return keep_bits(philox4x32_10(c, k0, k1), threshold);
  }

  // P (probabilities in an accumulator tile of rows row0.., keys key0.., both multiples of 16):
  // dropped elements set to 0. The kept ones are scaled later (the output's 1 / l, or dV's).
  template <int kMTiles, int kNTiles>
  CF_DEVICE void apply(float (&p)[kMTiles][kNTiles][4], int row0, int key0, int lane) const {
    static_assert(kNTiles % 2 == 0, "16-key blocks");
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        const uint32_t bits = block_bits(row0 + 16 * mt, key0 + 16 * np, lane);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // element e of n-tile 2 np + h: row + 8 (e / 2), key + 8 h + e % 2
            const int n = 4 * (e / 2) + 2 * h + e % 2;
            if (!((bits >> n) & 1u)) p[mt][2 * np + h][e] = 0.f;
          }
        }
      }
    }
  }

  // The keep bits of the transposed tile (the backward's S^T: 16 keys from key0 as the M rows,
  // query rows from row0 in n-tiles), per n-tile pair np and column c (query row offset within
  // the thread's pair): bit 2 h' + hf holds n-tile 2 np + h', key row lane / 4 + 8 hf.
  CF_DEVICE uint32_t transposed_bits(int row16, int key16, int lane, int c) const {
    const Philox4 ctr = {static_cast<uint32_t>(key16 / 4 + lane / 8),
                         static_cast<uint32_t>(row16 / 2 + 2 * (lane % 4) + c), head, batch};
    const uint32_t bits = keep_bits(philox4x32_10(ctr, k0, k1), threshold);
    // draw 4 (i / 8 % 2) + 2 (j / 8 % 2) + j % 2, with j % 2 = (lane / 4) % 2: four of the eight
    const int j1 = (lane / 4) % 2;
    uint32_t out = 0;
#pragma unroll
    for (int hp = 0; hp < 2; ++hp)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        out |= ((bits >> (4 * hp + 2 * hf + j1)) & 1u) << (2 * hp + hf);
    return out;
  }
};
