// The Hopper kernels' tile schedulers: which tiles a CTA computes, in which order.
// The forward's: a tile is (query block, batch, head). Query blocks run fastest, so the CTAs
// working at one time share a (batch, head) and its K/V stays in L2; under causal the last query
// blocks (the most keys) come first, so the long tiles do not straggle at the end. Three
// schedules:
//   static   one CTA per SM, tiles blockIdx.x + k gridDim.x: uniform tiles (no causal / window);
//   dynamic  one CTA per SM, each next tile drawn from a global counter in tile order (each
//            (batch, head)'s longest first): uneven tiles (causal) balance themselves, greedily;
//   per tile one CTA per tile (gridDim.x = tiles), handed out in the same order by the hardware.
// Only the producer walks the schedule; it passes each tile to the consumers with its Q.
// The backward's (fa3_bwd_tile, below): a CTA per key block, (batch, KV head) pairs in launch
// order or, under causal, key block first in sections of pairs.
#pragma once

#include "common.cuh"
#include "params.cuh"

// The query and key rows of a tile's sequence: all of them for a padded batch, its slice of the
// packed tensors for varlen, checked (params.cuh's seq_rows). A bad sequence reads no key (k is
// empty) and its tiles of a valid query range are written as NaN (bad()).
template <bool Varlen>
struct TileRows {
  SeqRange q, k;
  int32_t error_bits;
  CF_DEVICE TileRows(const AttnParams& params, int batch) {
    if constexpr (Varlen) {
      const SeqRows rows = seq_rows(params, batch);
      q = rows.q;
      k = rows.bad() ? SeqRange{rows.k.start, 0} : rows.k;
      error_bits = rows.error_bits;
    } else {
      q = {0, params.seqlen_q};
      k = {0, params.seqlen_k};
      error_bits = 0;
    }
  }
  CF_DEVICE bool bad() const { return error_bits != 0; }
};

// Index t of a launch over `pairs` (batch, head) pairs of `blocks` tiles each, pair-major (its
// pair t / blocks: the caller's `pair_major`), taken in sections of `section_pairs` pairs walked
// block first instead: (block, pair). A section's
// first blocks (under causal its longest tiles) then all come before any later one, and its
// pairs' data shares L2 (the host's section size: _dispatch._even_sections).
struct SectionedIndex {
  int block, pair;
};
CF_DEVICE SectionedIndex section_major(int t, int pair_major, int blocks, int pairs,
                                       int section_pairs) {
  const int first = pair_major / section_pairs * section_pairs;
  const int section = min(section_pairs, pairs - first);
  const int r = t - first * blocks;  // t's place in its section, block first
  return {r / section, first + r % section};
}

template <typename Traits>
struct TileScheduler {
  int num_m_blocks;
  int num_tiles;
  int lpt_pairs;

  CF_DEVICE explicit TileScheduler(const Fa3Params& p)
      : num_m_blocks(p.num_m_blocks),
        num_tiles(p.num_m_blocks * p.attn.batch * p.attn.h),
        lpt_pairs(p.lpt_pairs) {}

  struct Tile {
    int m_block, batch, head;
  };

  // Tile t -> (query block, batch, head). Causal with lpt_pairs > 1 (_dispatch.fa3_fwd_lpt_pairs):
  // the (batch, head) pairs in sections of lpt_pairs, each walked query block first, so that a
  // section's longest tiles all come before any shorter one (in pair order the last pair's
  // longest tile is drawn near the end and runs past it), and a section's K and V share L2.
  CF_DEVICE Tile operator()(int t, const AttnParams& params) const {
    int m = t % num_m_blocks;
    int bh = t / num_m_blocks;
    if constexpr (Traits::Is_causal) {
      if (lpt_pairs > 1) {
        const SectionedIndex at =
            section_major(t, bh, num_m_blocks, num_tiles / num_m_blocks, lpt_pairs);
        m = at.block;
        bh = at.pair;
      }
    }
    return {Traits::Is_causal ? num_m_blocks - 1 - m : m, bh / params.h, bh % params.h};
  }

  // The CTA's tile after t (grid: gridDim.x): the static stride, or drawn from the counter. The
  // producer draws it once the current tile's loads are all issued (it then runs at most
  // kStages blocks ahead of the consumers): drawn earlier, a CTA would claim it before the CTAs
  // that free up first, and undo the balance of the greedy schedule.
  static CF_DEVICE int next(int t, int grid, const Fa3Params& p) {
    if constexpr (Traits::Dynamic) return grid + atomicAdd(p.tile_counters, 1);
    return t + grid;
  }

  // Varlen: a tile past the end of its sequence holds no rows; the consumers never see it. The
  // producer asks once per tile it draws, and every tile is drawn once: the sequence's tile
  // (query block 0, head 0), empty or not, reports its bad values.
  CF_DEVICE bool empty(int t, const AttnParams& params) const {
    if constexpr (!Traits::Varlen) return false;
    const Tile tile = (*this)(t, params);
    const TileRows<Traits::Varlen> rows(params, tile.batch);
    if (tile.m_block == 0 && tile.head == 0) report_error(params, rows.error_bits);
    return tile.m_block * Traits::kBlockM >= rows.q.len;
  }

  // This CTA draws no more tiles. The dynamic schedule's last CTA to get here knows every draw
  // has been made (each CTA fences its draws before counting itself done) and resets both
  // counters ([0] tiles drawn past the first gridDim.x, [1] CTAs done) for the next launch.
  CF_DEVICE void finish(int grid, const Fa3Params& p) const {
    if constexpr (Traits::Dynamic) {
      __threadfence();
      if (atomicAdd(p.tile_counters + 1, 1) == grid - 1) {
        __threadfence();  // the other CTAs' draws (fenced before their count) come before the reset
        p.tile_counters[0] = 0;
        p.tile_counters[1] = 0;
      }
    }
  }
};

// The Hopper backward's: which key block and (batch, KV head) a CTA takes. The grid is (key
// blocks, batch, KV heads), which the hardware hands out in launch order, x fastest.
// Deterministic: the key blocks last to first (the fixed order of dQ's adds, fa3_bwd.cu).
// Causal with lpt_pairs > 1 (_dispatch.fa3_bwd_lpt_pairs): the (batch, head) pairs in sections
// of lpt_pairs, each walked key block first, so that a section's first key blocks, which see the
// most query rows, all start before any shorter one (longest processing time first: in launch
// order the last pair's longest CTA starts near the end and runs past it), and a section's Q, dO
// and dQacc rows share L2. Otherwise as launched: a pair's key blocks first to last, then the
// next pair.
struct Fa3BwdTile {
  int n_block, batch, head_k;
};

template <typename Traits>
CF_DEVICE Fa3BwdTile fa3_bwd_tile(int lpt_pairs) {
  const int blocks = gridDim.x;
  if constexpr (Traits::Deterministic) {
    return {blocks - 1 - int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  } else if constexpr (Traits::Is_causal) {
    if (lpt_pairs > 1) {
      const int batches = gridDim.y;
      const int pair_major = blockIdx.y + batches * blockIdx.z;
      const SectionedIndex at = section_major(blockIdx.x + blocks * pair_major, pair_major, blocks,
                                              batches * int(gridDim.z), lpt_pairs);
      return {at.block, at.pair % batches, at.pair / batches};
    }
  }
  return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
}
