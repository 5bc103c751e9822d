"""Decode (one query token over a KV cache): microseconds and GB/s of KV read on the shapes of
the FlashDecoding target (Hq = 32, Hkv = 8, d = 128, bf16, B in 1 / 8 / 64, L in 4096 / 32768 /
131072, B * L <= 2M): cupyflash with its automatic split count, with one split, and PyTorch
SDPA's flash and cuDNN backends (enable_gqa). Measured once in setup_cache (bench.run_decode:
one process, the same caches for all backends): ``track_us`` / ``track_gbps`` time single
calls (the host time before the launch included), ``track_steady_us`` the per-call time of 20
back-to-back calls (host work overlapped with the GPU's, as in a generation loop)."""

from __future__ import annotations

from typing import Any

from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "splits1", "flash", "cudnn"]
BATCHES = [1, 8, 64]
SEQLENS = [4096, 32768, 131072]


class Decode:
    params = (BACKENDS, BATCHES, SEQLENS)
    param_names = ["backend", "batch", "seqlen"]
    timeout = 900

    def setup_cache(self) -> dict[tuple[Any, ...], tuple[float | None, ...]]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        results: dict[tuple[Any, ...], tuple[float | None, ...]] = {}
        for shape in bench.decode_shapes():
            row = bench.run_decode(shape)
            for backend in BACKENDS:
                tbps = row.get(f"{backend}_TBps")
                results[backend, shape.batch, shape.seqlen] = (
                    row.get(f"{backend}_us"),
                    tbps and tbps * 1e3,
                    row.get(f"{backend}_steady_us"),
                )
        return results

    def setup(self, results: dict[tuple[Any, ...], Any], backend: str, batch: int, seqlen: int) -> None:
        if (backend, batch, seqlen) not in results:
            raise NotImplementedError("B * L beyond the benchmark's 2M tokens")

    def track_us(self, results: dict[tuple[Any, ...], Any], backend: str, batch: int, seqlen: int) -> float | None:
        return results[backend, batch, seqlen][0]

    track_us.unit = "us"  # type: ignore[attr-defined]

    def track_gbps(self, results: dict[tuple[Any, ...], Any], backend: str, batch: int, seqlen: int) -> float | None:
        return results[backend, batch, seqlen][1]

    track_gbps.unit = "GB/s"  # type: ignore[attr-defined]

    def track_steady_us(
        self, results: dict[tuple[Any, ...], Any], backend: str, batch: int, seqlen: int
    ) -> float | None:
        return results[backend, batch, seqlen][2]

    track_steady_us.unit = "us"  # type: ignore[attr-defined]
