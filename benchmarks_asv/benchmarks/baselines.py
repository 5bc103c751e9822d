"""The three algorithms side by side (docs/io_analysis.md): naive attention (S and P in HBM),
FlashAttention-1's loop order, FA2 (the mma.sync kernel) and the default dispatch, in TFLOP/s
on GPT-2-medium-like heads (H = 16, d = 64, fp16, non-causal) at N = 1024 and 4096, beside
FlashAttention-4 where flash-attn-4 is installed (n/a where not). Measured in one setup_cache
(bench.run_prefill's interleaved timing: one process, the same inputs) with the fixed GEMM
reference before and after: ``BaselinesOverGemm`` the gated ratios (cupyflash's entries),
``BaselinesOverPeers`` the default dispatch over FlashAttention-4 (listed by the gate, not
gated), ``BaselinesGemm`` the GEMM's TFLOP/s."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

CUPYFLASH = ["cupyflash_naive", "cupyflash_fa1", "cupyflash_fa2", "cupyflash"]
BACKENDS = [*CUPYFLASH, "fa4"]
SEQLENS = [1024, 4096]


class _Run:
    timeout = 900

    def setup_cache(self) -> tuple[dict[tuple[Any, ...], float | None], float | None]:
        require_gpu()
        require_torch()
        from cupyflash import bench

        def family() -> dict[tuple[Any, ...], float | None]:
            results: dict[tuple[Any, ...], float | None] = {}
            for seqlen in SEQLENS:
                shape = bench.PrefillShape(16384 // seqlen, seqlen, 16, 64, False, "float16")
                row = bench.run_prefill(shape, backends=tuple(BACKENDS), timings=("interleaved",))
                for backend in BACKENDS:
                    results[backend, seqlen] = row.get(backend)
            return results

        return reference.measured(family, lambda: reference.gemm_tflops(size=8192))


class Baselines(_Run):
    params = (BACKENDS, SEQLENS)
    param_names = ["backend", "seqlen"]

    def track_tflops(self, run: Any, backend: str, seqlen: int) -> float | None:
        return run[0][backend, seqlen]

    track_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class BaselinesOverGemm(reference._RatioEntries, _Run):
    params = (CUPYFLASH, SEQLENS)
    param_names = ["backend", "seqlen"]


class BaselinesOverPeers(reference._PeerRatioEntries, _Run):
    params = (["fa4"], SEQLENS)
    param_names = ["peer", "seqlen"]


class BaselinesGemm(reference._GemmEntry, _Run):
    pass
