"""Score and mask functions at d = 64 on the Hopper forward's two-consumer tile against the
three-consumer one (issue 40), including the functions whose three-consumer build spills (a bias
gathered per key: 284 bytes in the step loop, offline): which tile each function should get, and
the local memory of each build as the driver reports it (what a run-time choice can read).

Rounds alternate the tiles (each round: both tiles, order rotating), 20 calls each after 3 warm
ones, CUDA events; the median round per tile. Prints one JSON line per (function, N) and the
ratio three / two consumers (> 1: three faster).
    usage (GPU machine, tree root): python3 scripts/pending_gpu/mods_tiles_bench.py [--rounds 5]
"""

import argparse
import functools
import json
import statistics

import torch

import cupyflash
from cupyflash import _dispatch, _kernels, _plan, bench, mods
from cupyflash._specs import Fa3Tile

TILES = {
    "two": Fa3Tile(128, stages=4, pingpong=True, dynamic=True),
    "three": Fa3Tile(128, consumers=3, stages=2, pingpong=True, dynamic=True),
}


def gallery(n: int, heads: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    slopes = torch.rand(heads, generator=gen, device="cuda") * 0.1
    bias = torch.randn(heads, n, generator=gen, device="cuda")
    bias2 = torch.randn(n, n, generator=gen, device="cuda")
    bounds = torch.sort(torch.randint(1, n, (3,), generator=gen, device="cuda")).values
    doc = torch.bucketize(torch.arange(n, device="cuda"), bounds, right=True).to(torch.int32)
    return {
        "alibi": {"score_mod": lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j)},
        "softcap": {"score_mod": lambda s, b, h, i, j: 30.0 * mods.tanh(s / 30.0)},
        "relpos": {"score_mod": lambda s, b, h, i, j: s + 0.01 * (i - j)},
        "key_bias": {"score_mod": lambda s, b, h, i, j: s + bias[h, j]},
        "pair_bias": {"score_mod": lambda s, b, h, i, j: s + bias2[i, j]},
        "document": {"mask_mod": lambda b, h, i, j: doc[i] == doc[j]},
    }


def time_ms(fn) -> float:
    """ms a call, 20 calls back to back between two events, after a short warm-up."""
    return bench.cuda_time_ms(fn, warmup_ms=50.0, repeat=1, calls=20)


def local_bytes() -> int:
    return max((k.local_bytes for k in _kernels._compiled.values() if k.spec.name.startswith("cf_fa3_fwd")), default=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    for n in args.seqlens:
        batch, heads = 16384 // n, 32
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(batch, n, heads, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        for name, functions in gallery(n, heads).items():
            times: dict[str, list[float]] = {t: [] for t in TILES}
            local: dict[str, int] = {}
            outs = {}
            for r in range(args.rounds):
                order = list(TILES) if r % 2 == 0 else list(TILES)[::-1]
                for t in order:
                    for bounded in (False, True):
                        _dispatch.FA3_MODS_FWD_TILES[64, bounded] = TILES[t]
                    _plan.clear_caches()
                    _kernels._compiled.clear()

                    call = functools.partial(cupyflash.attention, q, k, v, **functions)

                    outs[t] = call()
                    local[t] = local_bytes()
                    times[t].append(time_ms(call))
            med = {t: statistics.median(v) for t, v in times.items()}
            row = {
                "function": name,
                "seqlen": n,
                "ms": {t: round(m, 4) for t, m in med.items()},
                "three_over_two": round(med["two"] / med["three"], 3),
                "spread": {t: round(max(v) / min(v), 3) for t, v in times.items()},
                "local_bytes": local,
                "max_abs_diff": float((outs["two"].float() - outs["three"].float()).abs().max()),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
