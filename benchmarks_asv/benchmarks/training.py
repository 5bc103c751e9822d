"""Forward + backward TFLOP/s (the backward counted as 2.5x the forward's FLOPs) on the 12 prefill
shapes (bf16): cupyflash through autograd (its FA2 backward), with ``deterministic=True``, and
PyTorch SDPA's flash and cuDNN backends, all measured in setup_cache in one process on the same
tensors, interleaved (bench.run_training), so the peers sit beside cupyflash on the dashboard."""

from __future__ import annotations

from typing import Any

from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "cupyflash_det", "flash", "cudnn"]


class Training:
    backends = BACKENDS
    dropout_p = 0.0
    params = (BACKENDS, [64, 128], [1024, 4096, 16384], [False, True])
    param_names = ["backend", "head_dim", "seqlen", "causal"]
    timeout = 1200

    def setup_cache(self) -> dict[tuple[Any, ...], float | None]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        results: dict[tuple[Any, ...], float | None] = {}
        for shape in bench.prefill_shapes(dtypes=("bfloat16",)):
            row = bench.run_training(shape, backends=tuple(self.backends), dropout_p=self.dropout_p)
            for backend in self.backends:
                results[backend, shape.head_dim, shape.seqlen, shape.causal] = row.get(backend)
        return results

    def track_fwd_bwd_tflops(
        self, results: dict[tuple[Any, ...], float | None], backend: str, head_dim: int, seqlen: int, causal: bool
    ) -> float | None:
        return results[backend, head_dim, seqlen, causal]

    track_fwd_bwd_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class TrainingDropout(Training):
    """The same shapes with ``dropout_p = 0.1`` on every backend (each its own generator):
    cupyflash's Philox mask in the FA2 forward and backward beside SDPA's flash and cuDNN."""

    backends = ["cupyflash", "flash", "cudnn"]
    dropout_p = 0.1
    params = (backends, [64, 128], [1024, 4096, 16384], [False, True])
