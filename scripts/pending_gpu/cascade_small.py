"""Issue 41, the cascade at small batches (B = 2: 0.90-0.99x the flat paged call): the kernel alone
(CUDA events, 50 calls back to back) of the one-launch cascade with its prefix split into 8 ... 128 parts
(``_dispatch.cascade_prefix_splits`` replaced; the default's count printed) and the requests' own
keys in the default's splits, 1 or 4 (``_dispatch.decode_num_splits``), beside the flat paged
call with its own split count and with others, at B in {1, 2, 4} over 4k and 32k prefixes
(bench.cascade_calls: GQA 32/8, d = 128, bf16, pages of 16, 512 own keys). Where the time goes:
wave quantisation and per-CTA start-up (few keys a split) or the prefix CTAs' read rate. The
batches, prefixes and counts are arguments (larger batches: where the wgmma prefix runs).
    usage (GPU machine): python3 scripts/pending_gpu/cascade_small.py [--batches 1 2 4]
        [--prefixes 32768 4096] [--counts 8 16 32 64 128] [--owns 0 1 4] [--flat-counts 8 16 32 64]"""

import argparse
import json

from cupyflash import _dispatch, _plan, bench


def kernel_us(fn) -> float:
    """Microseconds a call, 50 calls back to back between two events (bench.cuda_time_ms: the
    median of its rounds, after its warm-up)."""
    return round(bench.cuda_time_ms(fn, repeat=5, calls=50) * 1e3, 1)


default_prefix_splits = _dispatch.cascade_prefix_splits
default_num_splits = _dispatch.decode_num_splits
chosen: dict[str, int] = {}


def record_prefix(**kw: int) -> int:
    chosen["prefix"] = default_prefix_splits(**kw)
    return chosen["prefix"]


def record_flat(**kw: int) -> int:
    chosen.setdefault("flat", default_num_splits(**kw))
    return default_num_splits(**kw)


def forced(count: int):
    return lambda **kw: count


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
parser.add_argument("--prefixes", type=int, nargs="+", default=[32768, 4096])
parser.add_argument("--counts", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="prefix splits forced")
parser.add_argument("--owns", type=int, nargs="+", default=[0, 1, 4], help="own splits forced (0: the default's)")
parser.add_argument("--flat-counts", type=int, nargs="*", default=[8, 16, 32, 64], help="the flat call's splits")
args = parser.parse_args()

for prefix in args.prefixes:
    for batch in args.batches:
        calls = bench.cascade_calls(batch, prefix, own=512, page_size=16)
        row: dict[str, object] = {"batch": batch, "prefix": prefix}
        _dispatch.cascade_prefix_splits, _dispatch.decode_num_splits = record_prefix, record_flat
        _plan.clear_caches()
        chosen.clear()
        row["flat"] = kernel_us(calls["flat_paged"])
        row["cascade"] = kernel_us(calls["cascade"])
        row["chosen"] = dict(chosen)
        for count in args.counts:
            _dispatch.cascade_prefix_splits = forced(count)
            for own in args.owns:  # the requests' own splits: 0, the default's count
                _dispatch.decode_num_splits = forced(own) if own else default_num_splits
                _plan.clear_caches()
                row[f"cascade_p{count}" + (f"_o{own}" if own else "")] = kernel_us(calls["cascade"])
        _dispatch.cascade_prefix_splits, _dispatch.decode_num_splits = default_prefix_splits, default_num_splits
        for count in args.flat_counts:
            _dispatch.decode_num_splits = forced(count)
            _plan.clear_caches()
            row[f"flat_s{count}"] = kernel_us(calls["flat_paged"])
        _dispatch.decode_num_splits = default_num_splits
        print(json.dumps(row), flush=True)
_plan.clear_caches()
