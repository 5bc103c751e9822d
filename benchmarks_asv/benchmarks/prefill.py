"""Forward (prefill) TFLOP/s on the 12 shapes of the FA2 target (d = 64 and 128, H * d = 2048,
N in 1024 / 4096 / 16384 with B * N = 16384, causal and not; bf16): cupyflash's default dispatch
(on Hopper the wgmma kernel), its mma.sync FA2 kernel, and PyTorch SDPA's flash and cuDNN
backends. Every number is measured in setup_cache -- one process, the same inputs for all
backends, CUDA-event medians after warm-up (bench.run_prefill) -- and each parameter combination
reports its own, so the peers sit beside cupyflash on the dashboard. (Fa2Prefill keeps the
first suite's 8 shapes, so its history stays comparable.)"""

from __future__ import annotations

from typing import Any

from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "cupyflash_fa2", "flash", "cudnn"]


class Prefill:
    params = (BACKENDS, [64, 128], [1024, 4096, 16384], [False, True])
    param_names = ["backend", "head_dim", "seqlen", "causal"]
    timeout = 900

    def setup_cache(self) -> dict[tuple[Any, ...], float | None]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        results: dict[tuple[Any, ...], float | None] = {}
        for shape in bench.prefill_shapes(dtypes=("bfloat16",)):
            row = bench.run_prefill(shape, backends=tuple(BACKENDS))
            for backend in BACKENDS:
                results[backend, shape.head_dim, shape.seqlen, shape.causal] = row.get(backend)
        return results

    def track_tflops(
        self, results: dict[tuple[Any, ...], float | None], backend: str, head_dim: int, seqlen: int, causal: bool
    ) -> float | None:
        return results[backend, head_dim, seqlen, causal]

    track_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]
