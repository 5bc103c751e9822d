"""Score and mask functions (FlexAttention's ``score_mod`` / ``mask_mod``, traced and compiled
into the kernels): TFLOP/s of cupyflash's functions, of torch's compiled FlexAttention with the
same functions, of FlashAttention-4 with them (FlexAttention's FLASH backend, where flash-attn-4
is installed and takes them) and of cupyflash's built-in option where one computes the same
attention, at bench.MODS_SHAPES' N = 4096 rows (bf16, d = 64 and 128, B x N = 16k, H x d =
2048), forward and forward + backward, for two of the gallery's functions: a document mask and
ALiBi as a score_mod (the mask and the score function furthest from their targets; each row
compiles FlexAttention and FlashAttention-4 once, ~10-30 s, so the family stays small).
Counted as dense attention (4 B H N^2 d FLOPs, the backward 2.5 times more) whatever the mask
hides, so the numbers compare peers on one function, not functions. Measured in one
setup_cache (bench.run_mods, the interleaved timing: one process, the same tensors) with the
fixed GEMM reference before and after. ``ModsOverGemm``: cupyflash's over the GEMM's (the gated
ratios); ``ModsOverPeers``: cupyflash's over FlexAttention's and FlashAttention-4's (listed,
not gated)."""

from __future__ import annotations

from typing import Any

from . import _reference as reference
from ._gpu import require_gpu, require_torch

BACKENDS = ["cupyflash", "flex", "fa4", "builtin"]
#: bench.run_mods' names for them.
_TIMED = {"cupyflash": "cupyflash_mods", "flex": "flex", "fa4": "fa4", "builtin": "cupyflash_builtin"}
RATIO_PEERS = ["flex", "fa4"]
FUNCTIONS = ["document", "alibi"]
SHAPES = ([64, 128], ["fwd", "fwd_bwd"])
SHAPE_NAMES = ["head_dim", "pass"]

_Measured = tuple[dict[tuple[Any, ...], float | None], float | None]


class _Run:
    timeout = 1800

    def setup_cache(self) -> _Measured:
        require_gpu()
        require_torch()
        from cupyflash import bench

        def family() -> dict[tuple[Any, ...], float | None]:
            results: dict[tuple[Any, ...], float | None] = {}
            for shape in bench.MODS_SHAPES:
                if shape.seqlen != 4096:
                    continue
                gallery = bench.mods_gallery(shape.seqlen, shape.heads)
                for function in FUNCTIONS:
                    for backward in (False, True):
                        row = bench.run_mods(shape, function, gallery[function], backward, timings=("interleaved",))
                        ms = row.get("timings_ms", {}).get("interleaved", {})
                        flops = 4.0 * shape.batch * shape.heads * shape.seqlen**2 * shape.head_dim
                        flops *= 3.5 if backward else 1.0
                        for backend, timed in _TIMED.items():
                            value = ms.get(timed)
                            key = (backend, function, shape.head_dim, "fwd_bwd" if backward else "fwd")
                            results[key] = flops / value / 1e9 if value else None
            return results

        return reference.measured(family, lambda: reference.gemm_tflops(size=8192))


class Mods(_Run):
    params = (BACKENDS, FUNCTIONS, *SHAPES)
    param_names = ["backend", "function", *SHAPE_NAMES]

    def track_tflops(self, run: _Measured, backend: str, function: str, head_dim: int, pass_: str) -> float | None:
        return run[0][backend, function, head_dim, pass_]

    track_tflops.unit = "TFLOP/s"  # type: ignore[attr-defined]


class ModsOverGemm(reference._RatioEntries, _Run):
    params = (["cupyflash"], FUNCTIONS, *SHAPES)
    param_names = ["backend", "function", *SHAPE_NAMES]


class ModsOverPeers(reference._PeerRatioEntries, _Run):
    params = (RATIO_PEERS, FUNCTIONS, *SHAPES)
    param_names = ["peer", "function", *SHAPE_NAMES]


class ModsGemm(reference._GemmEntry, _Run):
    pass
