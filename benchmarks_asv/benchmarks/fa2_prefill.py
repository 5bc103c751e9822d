"""FA2 forward (prefill): TFLOP/s of cupyflash beside PyTorch SDPA's flash and cuDNN backends on
the same inputs. Shapes of the FA2 target (H * d = 2048, B * N = 16384, bf16); the full set of
24 runs in `python -m cupyflash bench`. Timed with CUDA events, median after warm-up."""

from __future__ import annotations

from ._gpu import require_gpu, require_torch


class Fa2Prefill:
    params = (["cupyflash", "flash", "cudnn"], [64, 128], [1024, 16384], [False, True])
    param_names = ["backend", "head_dim", "seqlen", "causal"]
    timeout = 600

    def setup(self, backend: str, head_dim: int, seqlen: int, causal: bool) -> None:
        require_gpu()
        require_torch()

    def track_tflops(self, backend: str, head_dim: int, seqlen: int, causal: bool) -> float | None:
        from cupyflash import bench

        shape = bench.PrefillShape(16384 // seqlen, seqlen, 2048 // head_dim, head_dim, causal, "bfloat16")
        return bench.run_prefill(shape, backends=(backend,))[backend]

    track_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]
