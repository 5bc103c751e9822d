"""The work a document mask leaves to tiles of a given shape: packs of N tokens cut into
documents at random (bench.mods_gallery's form: 3 cuts drawn from 1 .. N - 1, sorted), and for
each tile shape (rows x keys) the scores of the tiles not wholly hidden over the scores the mask
shows (1.0: no tile computes a hidden score), and the share of those tiles that are mixed (some
score hidden, some shown: the mask function runs per score there). A model of the tiles alone,
no GPU: it says how much of a document mask's cost is the tile shape's.

    python scripts/doc_mask_tiles.py [--seqlens 4096 16384] [--documents 4] [--trials 200]
        [--tiles 192x128 128x128 64x128]
"""

from __future__ import annotations

import argparse

import numpy as np


def tile_work(doc: np.ndarray, rows: int, keys: int) -> tuple[float, float]:
    """(computed / shown scores, mixed tiles / computed tiles) for documents ``doc`` (one id per
    token, non-decreasing) on tiles of ``rows`` x ``keys``."""
    n = doc.size
    ids = int(doc.max()) + 1
    shown = int((np.bincount(doc, minlength=ids).astype(np.int64) ** 2).sum())
    computed = mixed = 0
    for r0 in range(0, n, rows):
        row_docs = doc[r0 : r0 + rows]
        for k0 in range(0, n, keys):
            key_docs = doc[k0 : k0 + keys]
            if row_docs[-1] < key_docs[0] or row_docs[0] > key_docs[-1]:
                continue  # (ids are sorted: no document in common)
            computed += 1
            mixed += not (row_docs[0] == row_docs[-1] == key_docs[0] == key_docs[-1])
    return computed * rows * keys / shown, mixed / computed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--tiles", nargs="+", default=["192x128", "128x128", "64x128"])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    shapes = [tuple(int(x) for x in t.split("x")) for t in args.tiles]
    print("N  tile  computed/shown  mixed share  (means over trials)")
    for n in args.seqlens:
        results: dict[tuple[int, ...], list[tuple[float, float]]] = {s: [] for s in shapes}
        for _ in range(args.trials):
            cuts = np.sort(rng.integers(1, n, args.documents - 1))
            doc = np.searchsorted(cuts, np.arange(n), side="right")
            for s in shapes:
                results[s].append(tile_work(doc, *s))
        for (rows, keys), values in results.items():
            work, mixed = np.mean(values, axis=0)
            print(f"{n}  {rows}x{keys}  {work:.3f}  {mixed:.3f}")


if __name__ == "__main__":
    main()
