// An attention mask's block summary: one byte per cell of the mask (a tile of query rows x keys of
// one of its (batch, head) slices) saying whether the cell hides every key, shows every key
// unchanged, or is mixed (variants.cuh: kMaskCell*). It runs before the attention kernels of a
// call with an attn_mask, which then skip the tiles a mask hides (no K/V load, no MMA: a padding
// or block-sparse mask costs only the keys it shows) and do not read the mask where a tile shows
// every key as it is. One pass over the mask, which the kernels would read at least once anyway.
// A user mask_mod's summary (cupyflash.create_block_mask: a BlockMask) is the same pass with the
// function evaluated at every (row, key) of the cell, run once when the BlockMask is made.
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

// The cell of this CTA, written from read(row, key, &shown, &plain) over its (row, key): shown
// (the key takes part, or a NaN must reach the output) and plain (shown with the score unchanged).
template <typename Traits, typename Read>
CF_DEVICE void mask_cell(const AttnParams& p, const Read& read) {
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
  bool any_shown = false, all_plain = true;
  for (int r = threadIdx.x / 32; r < rows; r += Traits::kNWarps) {
    for (int j = threadIdx.x % 32; j < keys; j += 32) {
      bool shown, plain;
      read(batch, head, row0 + r, key0 + j, &shown, &plain);
      any_shown |= shown;
      all_plain &= plain;
    }
  }
  any_shown = __syncthreads_or(any_shown);
  all_plain = __syncthreads_and(all_plain);
  if (threadIdx.x == 0) {
    *cell = !any_shown ? kMaskCellHidden : all_plain ? kMaskCellPlain : kMaskCellMixed;
  }
}

// An attn_mask tensor's summary: boolean (shown where true, plain too) or additive (shown where
// not -inf, NaN included; plain where exactly 0).
template <typename Traits>
CF_DEVICE void attn_mask_cells(const AttnParams& p) {
  using BiasElement = typename Traits::BiasElement;
  const auto read = [&](int batch, int head, int row, int key, bool* shown, bool* plain) {
    const auto* mask = static_cast<const BiasElement*>(p.bias_ptr);
    const BiasElement b = mask[batch * p.bias_batch_stride + head * p.bias_head_stride +
                               row * p.bias_row_stride + key * p.bias_key_stride];
    if constexpr (Traits::Is_bool) {
      *shown = *plain = b != 0;
    } else {
      const float x = to_float(b);
      *shown = x != neg_infinity();  // NaN is shown: it must reach the output
      *plain = x == 0.f;
    }
  };
  mask_cell<Traits>(p, read);
}

#ifdef CF_USER_MODS
// A BlockMask's summary (cupyflash/_block_mask.py): cf_user_mods of mask_mod alone at score 0 is 0
// where the key is shown, -inf where it is hidden and NaN where the function indexes outside a
// captured array, which a plain cell must not hide from the kernels (they make that score NaN):
// shown, not plain. b and h are the cell's (0 on a broadcast axis: the mask does not read it).
template <typename Traits>
CF_DEVICE void block_mask_cells(const AttnParams& p) {
  const auto read = [&](int batch, int head, int row, int key, bool* shown, bool* plain) {
    CfUserModsState state;
    cf_user_mods_head(p, batch, head, state);
    const float x = cf_user_mods(p, state, 0.f, batch, head, row, key);
    *shown = x != neg_infinity();
    *plain = x == 0.f;
  };
  mask_cell<Traits>(p, read);
}
#endif
