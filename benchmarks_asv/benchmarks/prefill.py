"""Forward (prefill) TFLOP/s on the 12 shapes of the FA2 target (d = 64 and 128, H * d = 2048,
N in 1024 / 4096 / 16384 with B * N = 16384, causal and not; bf16): cupyflash's default dispatch
(on Hopper the wgmma kernel), its mma.sync FA2 kernel, PyTorch SDPA's flash and cuDNN backends,
and FlashAttention-4 where flash-attn-4 is installed (n/a where not). Every number is measured in
one setup_cache -- one process, the same inputs for all backends, CUDA-event medians after
warm-up, the interleaved timing of bench.run_prefill only (the other two of its timings would
triple the run) -- with the fixed reference (a bf16 GEMM, _reference.py) before and after them.
Four benchmarks read it: ``Prefill`` the TFLOP/s of every backend, ``PrefillOverGemm``
cupyflash's over the GEMM's (the series the regression gate judges), ``PrefillOverPeers``
cupyflash's over cuDNN's and FlashAttention-4's (listed by the gate, not gated),
``PrefillGemm`` the GEMM's own; fa2_prefill reads 8 of its shapes."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "cupyflash_fa2", "flash", "cudnn", "fa4"]
CUPYFLASH = ["cupyflash", "cupyflash_fa2"]
#: The peers cupyflash's ratio is tracked against.
RATIO_PEERS = ["cudnn", "fa4"]
SHAPES = ([64, 128], [1024, 4096, 16384], [False, True])
SHAPE_NAMES = ["head_dim", "seqlen", "causal"]


class _Run:
    timeout = 900

    def setup_cache(self) -> tuple[dict[tuple[Any, ...], float | None], float | None]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        def family() -> dict[tuple[Any, ...], float | None]:
            results: dict[tuple[Any, ...], float | None] = {}
            for shape in bench.prefill_shapes(dtypes=("bfloat16",)):
                row = bench.run_prefill(shape, backends=tuple(BACKENDS), timings=("interleaved",))
                for backend in BACKENDS:
                    results[backend, shape.head_dim, shape.seqlen, shape.causal] = row.get(backend)
            return results

        return reference.measured(family, lambda: reference.gemm_tflops(size=8192))


class Prefill(_Run):
    params = (BACKENDS, *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]

    def track_tflops(self, run: Any, backend: str, head_dim: int, seqlen: int, causal: bool) -> float | None:
        return run[0][backend, head_dim, seqlen, causal]

    track_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class PrefillOverGemm(reference._RatioEntries, _Run):
    params = (CUPYFLASH, *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]


class PrefillOverPeers(reference._PeerRatioEntries, _Run):
    params = (RATIO_PEERS, *SHAPES)
    param_names = ["peer", *SHAPE_NAMES]


class PrefillGemm(reference._GemmEntry, _Run):
    pass
