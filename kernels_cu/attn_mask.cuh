// An attention mask's block summary: one byte per cell of the mask (a tile of query rows x keys of
// one of its (batch, head) slices) saying whether the cell hides every key, shows every key
// unchanged, or is mixed (variants.cuh: kMaskCell*). It runs before the attention kernels of a
// call with an attn_mask, which then skip the tiles a mask hides (no K/V load, no MMA: a padding
// or block-sparse mask costs only the keys it shows) and do not read the mask where a tile shows
// every key as it is. One pass over the mask, which the kernels would read at least once anyway.
//
// Grid (cells along keys, cells along rows, mask batch x mask heads); one CTA per cell, its warps
// over the cell's rows and its lanes over the keys (consecutive bytes when the key stride is 1).
// A broadcast axis of the mask (stride 0 in the summary) is read at index 0 only.
#pragma once

#include "common.cuh"
#include "params.cuh"
#include "variants.cuh"  // kMaskCell*

template <typename BiasElement_, bool Is_bool_>
struct MaskCellsTraits {
  using BiasElement = BiasElement_;
  static constexpr bool Is_bool = Is_bool_;
  static constexpr int kNWarps = 8;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kSmemBytes = 0;
};

template <typename Traits>
CF_DEVICE void attn_mask_cells(const AttnParams& p) {
  using BiasElement = typename Traits::BiasElement;
  const int cell_n = blockIdx.x;
  const int cell_m = blockIdx.y;
  const int batch = blockIdx.z / p.mask_heads;
  const int head = blockIdx.z % p.mask_heads;
  const int mask_rows = p.mask_cells_row_stride == 0 ? 1 : p.seqlen_q;
  const int mask_keys = p.mask_cells_key_stride == 0 ? 1 : p.seqlen_k;
  const int row0 = cell_m << p.mask_cell_rows_log2;
  const int key0 = cell_n << p.mask_cell_keys_log2;
  const int rows = min(1 << p.mask_cell_rows_log2, mask_rows - row0);
  const int keys = min(1 << p.mask_cell_keys_log2, mask_keys - key0);
  unsigned char* cell = const_cast<unsigned char*>(p.mask_cells) +
                        batch * p.mask_cells_batch_stride + head * p.mask_cells_head_stride +
                        cell_m * p.mask_cells_row_stride + cell_n * p.mask_cells_key_stride;
  if (rows <= 0 || keys <= 0) {  // past the mask: the tiles of the kernels overhang it
    if (threadIdx.x == 0) *cell = kMaskCellEmpty;
    return;
  }
  const BiasElement* base = static_cast<const BiasElement*>(p.bias_ptr) +
                            batch * p.bias_batch_stride + head * p.bias_head_stride;
  bool any_shown = false, all_plain = true;
  for (int r = threadIdx.x / 32; r < rows; r += Traits::kNWarps) {
    const BiasElement* row = base + (row0 + r) * p.bias_row_stride;
    for (int j = threadIdx.x % 32; j < keys; j += 32) {
      const BiasElement b = row[(key0 + j) * p.bias_key_stride];
      if constexpr (Traits::Is_bool) {
        any_shown |= b != 0;
        all_plain &= b != 0;
      } else {
        const float x = to_float(b);
        any_shown |= x != neg_infinity();  // NaN is shown: it must reach the output
        all_plain &= x == 0.f;
      }
    }
  }
  any_shown = __syncthreads_or(any_shown);
  all_plain = __syncthreads_and(all_plain);
  if (threadIdx.x == 0) {
    *cell = !any_shown ? kMaskCellHidden : all_plain ? kMaskCellPlain : kMaskCellMixed;
  }
}
