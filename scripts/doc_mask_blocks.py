"""The block classes of a document mask over packed sequences, on the host: the share of a
forward's visited 128 x 128 blocks that are mixed (some scores hidden: the mask function runs per
score there) rather than plain, for the benchmark's packing (bench.mods_gallery: four documents,
three random cut points), and the useful share of the scores each tiling computes (ours: 192-row
tiles at d = 64 visit the key blocks between a tile's first and last row's documents; 128-row
tiles; FlexAttention's 128 x 128 blocks each skipped or not). The cut points here come from
NumPy's generator, not the benchmark's CUDA one: the shares are averages over many packings.

    python scripts/doc_mask_blocks.py [--trials 100]"""

from __future__ import annotations

import argparse

import numpy as np


def packing_shares(n: int, causal: bool, rng: np.random.Generator) -> dict[str, float]:
    cuts = np.sort(rng.integers(1, n, 3))
    starts, ends = np.r_[0, cuts], np.r_[cuts, n]
    doc = np.searchsorted(cuts, np.arange(n), side="right")
    lengths = ends - starts
    visible = int((lengths * (lengths + 1) // 2).sum() if causal else (lengths**2).sum())

    def tile_work(rows: int, keys: int = 128) -> int:  # each tile visits its rows' key range
        work = 0
        for m0 in range(0, n, rows):
            last = min(m0 + rows, n) - 1
            lo, hi = starts[doc[m0]], ends[doc[last]]
            hi = min(hi, last + 1) if causal else hi
            work += (-(-hi // keys) - lo // keys) * rows * keys
        return work

    plain = mixed = 0
    for m0 in range(0, n, 128):
        rows = np.arange(m0, min(m0 + 128, n))
        for n0 in range(0, n, 128):
            keys = np.arange(n0, min(n0 + 128, n))
            seen = doc[rows][:, None] == doc[keys][None, :]
            if causal:
                seen &= keys[None, :] <= rows[:, None]
            if seen.all():
                plain += 1
            elif seen.any():
                mixed += 1
    return {
        "mixed_share": mixed / (plain + mixed),
        "useful_192": visible / tile_work(192),
        "useful_128": visible / tile_work(128),
        "useful_flex": visible / ((plain + mixed) * 128 * 128),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("N      causal | mixed blocks | useful share: 192-row tiles  128-row tiles  Flex's blocks")
    for n in (4096, 16384):
        for causal in (False, True):
            rows = [packing_shares(n, causal, rng) for _ in range(args.trials)]
            mean = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
            print(f"{n:<6} {causal!s:<6} | {mean['mixed_share']:12.3f} | {mean['useful_192']:27.3f}"
                  f" {mean['useful_128']:14.3f} {mean['useful_flex']:14.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
