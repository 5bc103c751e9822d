"""First-call cost: NVRTC compile + load of one FA2 variant with an empty kernel cache, and the
share of a first call that is compile rather than run."""

from __future__ import annotations

import os
import tempfile
import time

from ._gpu import require_gpu


class FirstCall:
    timeout = 300

    def setup(self) -> None:
        require_gpu()
        # A fresh CuPy cache directory: the compile really happens (each benchmark runs in its
        # own process, forked from one that never imported CuPy, so nothing compiled earlier is
        # in memory either).
        os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupyflash-asv-")
        # NVRTC and its builtins library loaded, and the CUDA context made, by one trivial
        # compile first, so that the variant's compile is what is timed: the first measurement on
        # each fresh H200 machine took 0.79-1.19 s and every later one 0.14-0.19 s, the same code
        # (the first process to compile reads the libraries from a cold disk), which the gate
        # cannot tell from a regression.
        import cupy

        cupy.RawModule(code='extern "C" __global__ void warm(float* x) { x[0] = 1.f; }').get_function("warm")

    def track_compile_seconds(self) -> float:
        from cupyflash import _kernels
        from cupyflash._dispatch import MaskFlags, fa2_fwd_spec

        spec = fa2_fwd_spec("bfloat16", 128, MaskFlags(causal=True, local=False, softcap=False), 227 * 1024)
        start = time.perf_counter()
        _kernels.get_kernel(spec, 0)
        return time.perf_counter() - start

    track_compile_seconds.unit = "s"  # type: ignore[attr-defined]

    def track_compile_share_of_first_call(self) -> float:
        """Percent of the first call's wall time (1 x 4096 x 16 x 128, bf16, causal) spent compiling."""
        import cupy

        import cupyflash
        from cupyflash import _kernels

        rng = cupy.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 4096, 16, 128), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        cupyflash.attention(q, k, v, causal=True)
        cupy.cuda.Device().synchronize()
        total = time.perf_counter() - start
        compile_seconds = sum(k.compile_seconds for k in _kernels.compiled_variants())
        return 100.0 * compile_seconds / total

    track_compile_share_of_first_call.unit = "%"  # type: ignore[attr-defined]


class ScoreFunctionBuild:
    """A new score or mask function's first-call cost: its trace, its device code, the summary
    a mask implies, the plan, and NVRTC's build of the Hopper forward variant an H100 runs with
    it (1 x 4096 x 16 x 128, bf16), for sm_90a. Needs no GPU: NVRTC alone."""

    params = ["softcap", "alibi", "relative_bias", "document_causal", "sliding_window"]
    param_names = ["function"]
    timeout = 300

    def setup(self, function: str) -> None:
        # NVRTC and its builtins read by one build first (a process's first build pays that)
        from cupyflash import _kernels
        from cupyflash._specs import MergeSpec

        _kernels.compile_offline(MergeSpec("float32", "bfloat16", 128), "sm_90a")

    def track_seconds(self, function: str) -> float:
        import numpy as np

        from cupyflash import _block_mask, _device, _kernels, _mod_tiles, _mods, _plan, mods
        from cupyflash._attention import with_implied_bounds
        from cupyflash._validate import attention_problem

        n, heads, d = 4096, 16, 128
        slopes = np.exp2(-0.25 * np.arange(1, heads + 1)).astype(np.float32)
        bias = np.zeros((heads, 2 * n), np.float32)
        doc = (np.arange(n) // 700).astype(np.int32)
        gallery = {
            "softcap": (lambda s, b, h, i, j: 30.0 * mods.tanh(s / 30.0), None),
            "alibi": (lambda s, b, h, i, j: s - slopes[h] * mods.abs(i - j), None),
            "relative_bias": (lambda s, b, h, i, j: s + bias[h, i - j + n], None),
            "document_causal": (None, lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i)),
            "sliding_window": (None, lambda b, h, i, j: (j <= i) & (i - j < 1024)),
        }
        score_fn, mask_fn = gallery[function]
        h100 = _device.DeviceInfo(0, "sm_90a", 132, 232448, 233472, 65536, 2048, 32)
        shape = (1, n, heads, d)
        start = time.perf_counter()
        score_mod = None if score_fn is None else _mods.trace_score_mod(score_fn)
        mask_mod = None if mask_fn is None else _mods.trace_mask_mod(mask_fn)
        grid = _mods.Grid(1, heads, n, n)  # (as a call's: the reads its shapes keep inside unchecked)
        kernel = _mods.kernel_mods(score_mod, mask_mod, _mod_tiles.kernel_source(mask_mod), grid)
        problem = attention_problem(shape, shape, shape, causal=False, scale=None, window=(-1, -1), softcap=0.0,
                                    layout="bshd")  # fmt: skip
        problem = with_implied_bounds(problem, mask_mod)
        summary = None if mask_mod is None else _block_mask.implied(mask_mod, 1, heads, n, n)
        cells = None if summary is None else _block_mask.layout(summary)
        launch = _plan.plan_attention(problem, "bfloat16", h100, "auto", shape, mods=kernel, cells=cells)
        (step,) = launch.steps
        _kernels.compile_offline(step.spec, "sm_90a")
        return time.perf_counter() - start

    track_seconds.unit = "s"  # type: ignore[attr-defined]
