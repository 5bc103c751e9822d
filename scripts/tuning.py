"""What the tile-tuning scripts (tune_fa2.py, tune_fa3.py) share: the correctness check of a
candidate on awkward shapes and its TFLOP/s row on the benchmark's prefill shapes. Run on the
GPU machine, after the candidate has been put into the dispatch table."""

from __future__ import annotations

from typing import Any

import numpy as np

import cupyflash
from cupyflash import bench, reference

# (Nq, Nk, causal, window): odd lengths, Nq != Nk, GQA, causal, a window
AWKWARD_SHAPES = ((300, 333, True, (-1, -1)), (77, 200, False, (-1, -1)), (129, 64, False, (20, 7)))


def max_relative_error(head_dim: int, dtype: str, algorithm: str) -> float:
    """Largest relative error against the float64 reference over AWKWARD_SHAPES."""
    import torch

    rng = np.random.default_rng(head_dim)
    err = 0.0
    for nq, nk, causal, window in AWKWARD_SHAPES:
        q, k, v = (
            torch.from_numpy(rng.standard_normal(s).astype(np.float32)).cuda().to(getattr(torch, dtype))
            for s in ((2, nq, 4, head_dim), (2, nk, 2, head_dim), (2, nk, 2, head_dim))
        )
        out = cupyflash.attention(q, k, v, causal=causal, window=window, algorithm=algorithm)
        ref = reference.attention(q, k, v, causal=causal, window=window)
        err = max(err, float(np.linalg.norm(reference.to_numpy64(out) - ref) / np.linalg.norm(ref)))
    return err


def prefill_row(
    head_dim: int, dtype: str, backend: str, seqlens: tuple[int, ...] = bench.PREFILL_SEQLENS
) -> dict[str, Any]:
    """TFLOP/s of one backend (a cupyflash one, or a peer: "cudnn") on the benchmark's shapes
    (H * d = 2048, B * N = 16384), keyed N1024, N1024c (causal), ..."""
    row: dict[str, Any] = {}
    for n in seqlens:
        for causal in (False, True):
            shape = bench.PrefillShape(16384 // n, n, 2048 // head_dim, head_dim, causal, dtype)
            row[f"N{n}{'c' if causal else ''}"] = bench.run_prefill(shape, backends=(backend,))[backend]
    return row


def candidate_row(
    head_dim: int, dtype: str, tile: Any, regs: str, algorithm: str, seqlens: tuple[int, ...] = bench.PREFILL_SEQLENS
) -> dict[str, Any]:
    """One candidate's line of the tuning table (already in the dispatch table): its error on
    the awkward shapes and its TFLOP/s on the benchmark shapes, printed as it comes."""
    import json

    row = {
        "head_dim": head_dim,
        "tile": repr(tile),
        "regs": regs,
        "err": max_relative_error(head_dim, dtype, algorithm),
        **prefill_row(head_dim, dtype, f"cupyflash_{algorithm}", seqlens),
    }
    print(json.dumps(row), flush=True)
    return row
