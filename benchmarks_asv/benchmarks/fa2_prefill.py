"""FA2 forward (prefill): TFLOP/s of cupyflash beside PyTorch SDPA's flash and cuDNN backends on
the first suite's 8 shapes (d = 64 and 128, N = 1024 and 16384, causal and not; H * d = 2048,
B * N = 16384, bf16); the full set of 24 runs in `python -m cupyflash bench`. They are 8 of
Prefill's 12 shapes, so they are read from Prefill's run -- its setup_cache: the same process,
inputs and GEMM reference -- not measured a second time; ``Fa2PrefillOverGemm`` gives
cupyflash's over the GEMM's. (Up to 1661eae each shape and backend had a process of its own.)"""

from __future__ import annotations

from . import _reference as reference
from . import prefill

SHAPES = ([64, 128], [1024, 16384], [False, True])
SHAPE_NAMES = ["head_dim", "seqlen", "causal"]


class Fa2Prefill(prefill._Run):
    params = (["cupyflash", "flash", "cudnn"], *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]
    track_tflops = prefill.Prefill.track_tflops


class Fa2PrefillOverGemm(reference._RatioEntries, prefill._Run):
    params = (["cupyflash"], *SHAPES)
    param_names = ["backend", *SHAPE_NAMES]
