"""Decode (one query token over a KV cache): microseconds and GB/s of KV read on the shapes of
the FlashDecoding target (Hq = 32, Hkv = 8, d = 128, bf16, B in 1 / 8 / 64, L in 4096 / 32768 /
131072, B * L <= 2M): cupyflash with its automatic split count, with one split, and PyTorch
SDPA's flash and cuDNN backends (enable_gqa). Measured in one setup_cache (bench.run_decode:
one process, the same caches for all backends) with the fixed reference, a device-to-device
copy (decode is bandwidth-bound: _reference.py), before and after: ``track_us`` /
``track_gbps`` time single calls (the host time before the launch included),
``track_steady_us`` the per-call time of 20 back-to-back calls (host work overlapped with the
GPU's, as in a generation loop). ``DecodeOverCopy`` gives cupyflash's GB/s of both timings over
the copy's (the gated ratios), ``DecodeCopy`` the copy's GB/s."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "splits1", "flash", "cudnn"]
BATCHES = [1, 8, 64]
SEQLENS = [4096, 32768, 131072]

#: (backend, batch, seqlen) -> (us, GB/s, steady us, steady GB/s), and the copy's GB/s.
_Measured = tuple[dict[tuple[Any, ...], tuple[float | None, ...]], float | None]


class _Run:
    timeout = 900

    def setup_cache(self) -> _Measured:
        require_gpu()
        require_torch()
        from cupyflash import bench

        def family() -> dict[tuple[Any, ...], tuple[float | None, ...]]:
            results: dict[tuple[Any, ...], tuple[float | None, ...]] = {}
            for shape in bench.decode_shapes():
                row = bench.run_decode(shape)
                for backend in BACKENDS:
                    tbps, steady_tbps = row.get(f"{backend}_TBps"), row.get(f"{backend}_steady_TBps")
                    results[backend, shape.batch, shape.seqlen] = (
                        row.get(f"{backend}_us"),
                        tbps and tbps * 1e3,
                        row.get(f"{backend}_steady_us"),
                        steady_tbps and steady_tbps * 1e3,
                    )
            return results

        return reference.measured(family, lambda: reference.copy_gbps(mib=1024))

    def setup(self, run: _Measured, *combo: Any) -> None:
        if combo and combo not in run[0]:
            raise NotImplementedError("B * L beyond the benchmark's 2M tokens")


class Decode(_Run):
    params = (BACKENDS, BATCHES, SEQLENS)
    param_names = ["backend", "batch", "seqlen"]

    def track_us(self, run: _Measured, backend: str, batch: int, seqlen: int) -> float | None:
        return run[0][backend, batch, seqlen][0]

    track_us.unit = "us"  # type: ignore[attr-defined]

    def track_gbps(self, run: _Measured, backend: str, batch: int, seqlen: int) -> float | None:
        return run[0][backend, batch, seqlen][1]

    track_gbps.unit = "GB/s"  # type: ignore[attr-defined]

    def track_steady_us(self, run: _Measured, backend: str, batch: int, seqlen: int) -> float | None:
        return run[0][backend, batch, seqlen][2]

    track_steady_us.unit = "us"  # type: ignore[attr-defined]


class DecodeOverCopy(_Run):
    params = (["cupyflash", "splits1"], BATCHES, SEQLENS)
    param_names = ["backend", "batch", "seqlen"]

    def track_gbps_ratio(self, run: _Measured, backend: str, batch: int, seqlen: int) -> float | None:
        return reference.ratio(run[0][backend, batch, seqlen][1], run[1])

    track_gbps_ratio.unit = "ratio"  # type: ignore[attr-defined]

    def track_steady_gbps_ratio(self, run: _Measured, backend: str, batch: int, seqlen: int) -> float | None:
        return reference.ratio(run[0][backend, batch, seqlen][3], run[1])

    track_steady_gbps_ratio.unit = "ratio"  # type: ignore[attr-defined]


class DecodeCopy(reference._CopyEntry, _Run):
    pass
