"""The built-in score variants at d = 64 without a bound (plain, alibi_slopes, softcap) on the
non-causal tile (three consumers, static, no round robin) against the causal one (three
consumers in round robin, dynamic): the ALiBi score_mod on the latter ran 1.03-1.15x the
built-in alibi_slopes on the former (docs/evidence/2026-12-07-h100-session-15/), so the round robin
may hide a score variant's per-score work where plain calls measured the two tiles the same.

Rounds alternate the tiles (order rotating), 20 calls each after 3 warm ones, CUDA events; the
median per tile, and cuDNN's (SDPA) plain call in each round as the yardstick. One JSON line
per (variant, N): ms per tile, the ratio round robin / static (> 1: round robin faster).
    usage (GPU machine, tree root): python3 scripts/pending_gpu/builtin_score_tiles.py [--rounds 5]
"""

import argparse
import functools
import json
import statistics

import torch

import cupyflash
from cupyflash import _dispatch, _plan, bench
from cupyflash._specs import Fa3Tile

TILES = {
    "static": Fa3Tile(128, consumers=3, stages=2),
    "round_robin": Fa3Tile(128, consumers=3, stages=2, pingpong=True, dynamic=True),
}


def time_ms(fn) -> float:
    """ms a call, 20 calls back to back between two events, after a short warm-up."""
    return bench.cuda_time_ms(fn, warmup_ms=50.0, repeat=1, calls=20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    shipped = _dispatch.FA3_FWD_TILES[64, False]
    for n in args.seqlens:
        batch, heads = 16384 // n, 32
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(batch, n, heads, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
        slopes = torch.rand(heads, generator=gen, device="cuda") * 0.1
        variants = {"plain": {}, "alibi": {"alibi_slopes": slopes}, "softcap": {"softcap": 30.0}}
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt)
        for name, options in variants.items():
            times: dict[str, list[float]] = {t: [] for t in (*TILES, "cudnn")}
            outs = {}
            for r in range(args.rounds):
                order = list(TILES) if r % 2 == 0 else list(TILES)[::-1]
                for t in order:
                    _dispatch.FA3_FWD_TILES[64, False] = TILES[t]
                    _plan.clear_caches()
                    call = functools.partial(cupyflash.attention, q, k, v, **options)
                    outs[t] = call()
                    times[t].append(time_ms(call))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    times["cudnn"].append(time_ms(sdpa))
            _dispatch.FA3_FWD_TILES[64, False] = shipped
            med = {t: statistics.median(v) for t, v in times.items()}
            row = {
                "variant": name,
                "seqlen": n,
                "ms": {t: round(m, 4) for t, m in med.items()},
                "round_robin_over_static": round(med["static"] / med["round_robin"], 3),
                "spread": {t: round(max(v) / min(v), 3) for t, v in times.items()},
                "max_abs_diff": float((outs["static"].float() - outs["round_robin"].float()).abs().max()),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
