"""Forward + backward TFLOP/s (the backward counted as 2.5x the forward's FLOPs) on the 12 prefill
shapes (bf16): cupyflash through autograd, with ``deterministic=True`` and with ALiBi
(``cupyflash_alibi``: the standard slopes, what ALiBi costs beside the call without it),
PyTorch SDPA's flash and cuDNN backends, and FlashAttention-4 where flash-attn-4 is installed
(n/a where not), all measured in one setup_cache in one process on the same tensors, in the
interleaved timing of bench.run_training only, with the fixed GEMM reference before and after,
so the peers sit beside cupyflash on the dashboard. ``TrainingOverGemm``: cupyflash's over the
GEMM's (the gated ratios); ``TrainingOverPeers``: cupyflash's over cuDNN's and
FlashAttention-4's (listed by the gate, not gated); ``TrainingGemm``: the GEMM's TFLOP/s. The
``TrainingDropout*`` classes: the same with ``dropout_p = 0.1``, from a setup_cache of their own,
without FlashAttention-4 (it has no dropout)."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "cupyflash_det", "cupyflash_alibi", "flash", "cudnn", "fa4"]
DROPOUT_BACKENDS = ["cupyflash", "flash", "cudnn"]
#: The peers cupyflash's ratio is tracked against.
RATIO_PEERS = ["cudnn", "fa4"]
SHAPES = ([64, 128], [1024, 4096, 16384], [False, True])
SHAPE_NAMES = ["head_dim", "seqlen", "causal"]

_Measured = tuple[dict[tuple[Any, ...], float | None], float | None]


def _measure(backends: list[str], dropout_p: float) -> _Measured:
    require_gpu()
    require_torch()
    from cupyflash import bench

    def family() -> dict[tuple[Any, ...], float | None]:
        results: dict[tuple[Any, ...], float | None] = {}
        for shape in bench.prefill_shapes(dtypes=("bfloat16",)):
            row = bench.run_training(shape, backends=tuple(backends), dropout_p=dropout_p, timings=("interleaved",))
            for backend in backends:
                results[backend, shape.head_dim, shape.seqlen, shape.causal] = row.get(backend)
        return results

    return reference.measured(family, lambda: reference.gemm_tflops(size=8192))


class _Run:
    timeout = 1200

    def setup_cache(self) -> _Measured:
        return _measure(BACKENDS, 0.0)


class Training(_Run):
    params = (BACKENDS, *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]

    def track_fwd_bwd_tflops(
        self, run: _Measured, backend: str, head_dim: int, seqlen: int, causal: bool
    ) -> float | None:
        return run[0][backend, head_dim, seqlen, causal]

    track_fwd_bwd_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class TrainingOverGemm(reference._RatioEntries, _Run):
    params = (["cupyflash", "cupyflash_det", "cupyflash_alibi"], *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]


class TrainingOverPeers(reference._PeerRatioEntries, _Run):
    params = (RATIO_PEERS, *SHAPES)
    param_names = ["peer", *SHAPE_NAMES]


class TrainingGemm(reference._GemmEntry, _Run):
    pass


class _DropoutRun(_Run):
    # A setup_cache of its own: asv keys a cache by the function's module and line, so one
    # inherited from _Run would hand these classes the dropout-free run's numbers.
    def setup_cache(self) -> _Measured:
        return _measure(DROPOUT_BACKENDS, 0.1)


class TrainingDropout(_DropoutRun):
    """The same shapes with ``dropout_p = 0.1`` on every backend (each its own generator):
    cupyflash's Philox mask in the FA2 forward and backward beside SDPA's flash and cuDNN."""

    params = (DROPOUT_BACKENDS, *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]
    track_fwd_bwd_tflops = Training.track_fwd_bwd_tflops


class TrainingDropoutOverGemm(reference._RatioEntries, _DropoutRun):
    params = (["cupyflash"], *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]


class TrainingDropoutGemm(reference._GemmEntry, _DropoutRun):
    pass
