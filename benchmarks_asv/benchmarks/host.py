"""Host time of a tiny call (1 query, 128 keys, 8 heads, d = 128): what a decode step pays in
Python before the GPU does anything. PyTorch SDPA on the same tensors is the peer."""

from __future__ import annotations

from ._gpu import require_gpu, require_torch


class HostOverhead:
    params = (["cupyflash_torch_us", "cupyflash_cupy_us", "sdpa_us"],)
    param_names = ["call"]
    timeout = 300

    def setup(self, call: str) -> None:
        require_gpu()
        require_torch()

    def track_tiny_call(self, call: str) -> float:
        from cupyflash import bench

        return bench.host_overhead_us(rounds=3, calls=500)[call]

    track_tiny_call.unit = "us"  # type: ignore[attr-defined]
