"""Host time of a tiny call (1 query, 128 keys, 8 heads, d = 128): what a decode step pays in
Python before the GPU does anything. PyTorch SDPA on the same tensors is the peer. The three
calls are measured once per run, interleaved, in one setup_cache (bench.host_overhead_us)."""

from __future__ import annotations

from ._gpu import require_gpu, require_torch

CALLS = ["cupyflash_torch_us", "cupyflash_cupy_us", "sdpa_us"]


class HostOverhead:
    params = (CALLS,)
    param_names = ["call"]
    timeout = 300

    def setup_cache(self) -> dict[str, float]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        return bench.host_overhead_us(rounds=3, calls=500)

    def track_tiny_call(self, results: dict[str, float], call: str) -> float:
        return results[call]

    track_tiny_call.unit = "us"  # type: ignore[attr-defined]
