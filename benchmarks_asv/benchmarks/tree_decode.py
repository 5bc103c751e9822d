"""Speculative decoding through a tree of draft tokens (``attention_with_kvcache(...,
tree_mask=)``): microseconds and GB/s of KV read of the tree, of as many causal drafts (the
variant the tree's costs are read against) and of PyTorch SDPA with the tree as a boolean
``attn_mask``, at the shapes of ``bench.TREE_DECODE_SHAPES`` (Hq = 32, Hkv = 8, d = 128, bf16)
and 2 / 4 / 8 / 16 drafts. Measured in one setup_cache (bench.run_tree_decode, the interleaved
timing: one process, the same caches for every call) with the fixed reference, a
device-to-device copy (decode is bandwidth-bound: _reference.py), before and after.
``TreeDecodeOverCopy`` gives the tree's GB/s over the copy's (the gated ratio)."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

BACKENDS = ["tree", "causal", "sdpa_mask"]
SHAPES = ["1x32768", "8x32768", "64x4096"]  # batch x cache length: bench.TREE_DECODE_SHAPES
DRAFTS = [2, 4, 8, 16]

#: (backend, shape, drafts) -> (us, GB/s), and the copy's GB/s.
_Measured = tuple[dict[tuple[Any, ...], tuple[float | None, float | None]], float | None]


class _Run:
    timeout = 900

    def setup_cache(self) -> _Measured:
        require_gpu()
        require_torch()
        from cupyflash import bench

        def family() -> dict[tuple[Any, ...], tuple[float | None, float | None]]:
            results: dict[tuple[Any, ...], tuple[float | None, float | None]] = {}
            for batch, seqlen in bench.TREE_DECODE_SHAPES:
                for drafts in bench.TREE_DRAFTS:
                    row = bench.run_tree_decode(bench.DecodeShape(batch, seqlen), drafts, timings=("interleaved",))
                    for backend in BACKENDS:
                        tbps = row.get(f"{backend}_interleaved_TBps")
                        us = row.get("timings", {}).get("interleaved", {}).get(backend)
                        results[backend, f"{batch}x{seqlen}", drafts] = (us, tbps and tbps * 1e3)
            return results

        return reference.measured(family, lambda: reference.copy_gbps(mib=1024))


class TreeDecode(_Run):
    params = (BACKENDS, SHAPES, DRAFTS)
    param_names = ["backend", "shape", "drafts"]

    def track_us(self, run: _Measured, backend: str, shape: str, drafts: int) -> float | None:
        return run[0][backend, shape, drafts][0]

    track_us.unit = "us"  # type: ignore[attr-defined]

    def track_gbps(self, run: _Measured, backend: str, shape: str, drafts: int) -> float | None:
        return run[0][backend, shape, drafts][1]

    track_gbps.unit = "GB/s"  # type: ignore[attr-defined]


class TreeDecodeOverCopy(_Run):
    params = (["tree"], SHAPES, DRAFTS)
    param_names = ["backend", "shape", "drafts"]

    def track_gbps_ratio(self, run: _Measured, backend: str, shape: str, drafts: int) -> float | None:
        return reference.ratio(run[0][backend, shape, drafts][1], run[1])

    track_gbps_ratio.unit = "ratio"  # type: ignore[attr-defined]


class TreeDecodeCopy(reference._CopyEntry, _Run):
    pass
