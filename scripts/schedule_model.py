"""The Hopper forward's persistent schedules, modelled on the host: how evenly 132 CTAs share the
tiles of a call whose tiles are uneven, under the static stride (CTA c takes tiles c, c + 132,
...) and the dynamic counter (each CTA draws the next tile in order when it finishes one;
kernels_cu/tile_scheduler.cuh). A tile's cost is its count of key blocks (128 keys); the figure
is the busiest CTA's work over the even share (1.0: perfect balance), so the ratio of the two
figures predicts the schedule's effect on a call that the balance bounds.

    python scripts/schedule_model.py [--ctas 132] [--seed 0]

Cases: a document mask of 4 random documents over N = 16k (B = 1, H = 16: 128 query blocks per
head, so the static stride gives CTA c query blocks c, c + 4, c + 8, ...: a band of half the
sequence) and over N = 4k (B = 4); packed sequences without a bound (tiles over each sequence's
query blocks up to the longest's, the ones past its end empty), 16 x 1k and 8 mixed lengths.
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np

BLOCK = 128  # query rows and keys per tile / key block (the d = 128 tile)
EMPTY_TILE = 0.02  # a tile past a packed sequence's end: drawn and skipped (a key block's 2%)


def busiest_over_even(work: list[float], ctas: int) -> tuple[float, float]:
    """(static, dynamic): the busiest CTA's work over the even share, tiles in ``work``'s order."""
    static = np.zeros(ctas)
    for t, w in enumerate(work):
        static[t % ctas] += w
    finish = [(0.0, c) for c in range(ctas)]  # the dynamic schedule: the first free CTA draws next
    for w in work:
        done, c = heapq.heappop(finish)
        heapq.heappush(finish, (done + w, c))
    even = sum(work) / ctas
    return float(static.max()) / even, max(done for done, _ in finish) / even


def document_tiles(lengths: list[int], batch: int, heads: int) -> list[float]:
    """Tile costs in tile order (query blocks fastest, then head, then batch) of a document mask:
    a query block sees the key blocks of the documents its rows lie in."""
    edges = np.concatenate([[0], np.cumsum(lengths)])
    n = int(edges[-1])
    doc = np.searchsorted(edges[1:-1], np.arange(n), side="right")
    per_block = []
    for m in range(-(-n // BLOCK)):
        rows = doc[m * BLOCK : (m + 1) * BLOCK]
        lo, hi = int(edges[rows.min()]), int(edges[rows.max() + 1])
        per_block.append(float(-(-hi // BLOCK) - lo // BLOCK))
    return per_block * (batch * heads)


def packed_tiles(lengths: list[int], heads: int) -> list[float]:
    """Tile costs of packed sequences without a bound: each of the longest sequence's query
    blocks for every (sequence, head); a block past the sequence's end is empty."""
    blocks = -(-max(lengths) // BLOCK)
    return [
        float(-(-n // BLOCK)) if m * BLOCK < n else EMPTY_TILE
        for n in lengths
        for _ in range(heads)
        for m in range(blocks)
    ]


def random_documents(rng: np.random.Generator, n: int, count: int = 4) -> list[int]:
    bounds = np.sort(rng.integers(1, n, count - 1))
    return [int(x) for x in np.diff(np.concatenate([[0], bounds, [n]]))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctas", type=int, default=132)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    cases = [
        (f"document N=16k {d}", document_tiles(d, 1, 16)) for d in (random_documents(rng, 16384) for _ in range(4))
    ]
    cases += [
        (f"document N=4k B=4 {d}", document_tiles(d, 4, 16)) for d in (random_documents(rng, 4096) for _ in range(2))
    ]
    cases.append(("packed 16 x 1k", packed_tiles([1024] * 16, 16)))
    for _ in range(2):
        lengths = [int(x) for x in rng.integers(256, 4096, 8)]
        cases.append((f"packed mixed {lengths}", packed_tiles(lengths, 16)))
    print("| case | static | dynamic |\n|---|---|---|")
    for name, work in cases:
        static, dynamic = busiest_over_even(work, args.ctas)
        print(f"| {name} | {static:.2f} | {dynamic:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
