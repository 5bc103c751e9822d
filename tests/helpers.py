"""What several test files share: the per-dtype error bounds of the GPU tests, GPU inputs, the
naive low-precision baseline of flash-attn's "2x naive" rule, the forward check, the float64
reference of a KV cache, paged caches, and the host compiler that runs device code's C twins.
Imported as ``from helpers import ...`` (pytest puts tests/ on sys.path, as for conftest.py);
nothing here is a test.
"""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

# CUPYFLASH_COMPILE_ALL=1 (scripts/gpu_check.sh; tests/test_compile.py's levels) also runs the slow host checks at
# their full budget: gradcheck's full Jacobians, where the default compares one random
# projection of them (torch's fast_mode: any wrong gradient still fails, 10-50x fewer calls).
FULL = int(os.environ.get("CUPYFLASH_COMPILE_ALL") or 0) >= 1

# Relative error ||out - ref|| / ||ref|| of a 16-bit GPU result against float64 on the same
# rounded inputs, and the rounding floor (~0.1 unit roundoff) added to 2x the naive error.
BOUND = {"float16": 2e-3, "bfloat16": 1e-2}
FLOOR = {"float16": 5e-5, "bfloat16": 4e-4}

# (B, Nq, Nk, Hq, Hkv, causal, window, softcap): Nq != Nk, odd lengths, GQA/MQA, rows with no
# visible key (Nq > Nk, causal), a single query over a long cache, windows, softcap.
SHAPES = {
    "square": (2, 128, 128, 4, 4, False, (-1, -1), 0.0),
    "causal-gqa-odd": (1, 97, 200, 6, 2, True, (-1, -1), 0.0),
    "causal-mqa-nq>nk": (2, 200, 97, 4, 1, True, (-1, -1), 0.0),
    "one-query": (1, 1, 1025, 8, 2, True, (-1, -1), 0.0),
}
EXTRA = {
    "window-causal": (3, 257, 257, 2, 2, True, (64, -1), 0.0),
    "window-both": (1, 300, 301, 4, 2, False, (16, 16), 0.0),
    "softcap": (1, 300, 301, 4, 2, True, (-1, -1), 30.0),
    "window-softcap": (2, 130, 70, 2, 1, False, (-1, 3), 5.0),
}


def need_torch() -> Any:
    """The torch module, or a skip where it is not installed."""
    return pytest.importorskip("torch")


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| (the norm of b floored at 1e-30)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def dtype_name(x: Any) -> str:
    """ "float16", "bfloat16", ... of a NumPy, CuPy or torch array."""
    return str(x.dtype).removeprefix("torch.")


def gpu_inputs(rng: np.random.Generator, shape_q: Any, shape_kv: Any, dtype: str, lib: str = "torch") -> list[Any]:
    """Fresh standard-normal q, k, v on the GPU in ``dtype`` (torch tensors or CuPy arrays)."""
    host = [rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv)]
    if lib == "torch":
        torch = need_torch()
        return [torch.from_numpy(h).to("cuda", getattr(torch, dtype)) for h in host]
    import cupy

    return [cupy.asarray(h).astype(dtype) for h in host]


def naive_low_precision(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: Any,
    window: Any,
    softcap: float,
    scale: Any,
    layout: str,
    return_lse: bool = False,
    dropout: tuple[float, Any] | None = None,
    alibi_slopes: Any = None,
    bias: Any = None,
) -> Any:
    """Standard attention in the inputs' own precision (PyTorch's math path, unfused; S in
    float32); with ``return_lse`` also each row's float32 LSE. Differentiable (the backward
    tests run it through autograd in the inputs' precision and in float64). ``dropout``:
    (p, keep mask [B, Hq, Nq, Nk], as ``dropout_keep``): P times the mask / the keep probability.
    ``alibi_slopes`` (Hq,) or (B, Hq): the scores gain -slope * |i + Nk - Nq - j| (flash-attn's).
    ``bias``: a tensor broadcast to (B, Hq, Nq, Nk) added to the scaled scores (an attn_mask)."""
    torch = need_torch()
    # A contiguous copy first: torch's DLPack import aborts the process on some CuPy views.
    q, k, v = (x if isinstance(x, torch.Tensor) else torch.from_dlpack(x.copy(order="C")) for x in (q, k, v))
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = (q @ k.transpose(-1, -2)).float() * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        nq, nk = q.shape[2], k.shape[2]
        distance = (torch.arange(nq)[:, None] + nk - nq - torch.arange(nk)[None, :]).abs().to(s.device, s.dtype)
        slopes = torch.as_tensor(alibi_slopes).to(s.device, s.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * distance
    if bias is not None:
        s = s + bias.to(s.device, s.dtype)
    visible = torch.from_numpy(reference.visible_keys(q.shape[2], k.shape[2], bool(causal), window)).to(q.device)
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if dropout is not None:
        from cupyflash.xp_impl import Dropout

        p = p * torch.as_tensor(dropout[1], device=p.device) * Dropout(dropout[0], 0).scale
    out = p.to(q.dtype) @ v
    out = out.transpose(1, 2) if layout == "bshd" else out
    return (out, torch.logsumexp(s, dim=-1)) if return_lse else out


def dropout_keep(p: float, seed: int, batch: int, heads: int, nq: int, nk: int, batch0: int = 0) -> np.ndarray:
    """The keep mask [B, Hq, Nq, Nk] of dropout ``p`` under ``seed`` (xp_impl's twin of the kernels')."""
    from cupyflash.xp_impl import Dropout

    like = np.empty((batch, heads, 1, 0, 0))
    return Dropout(p, seed, batch0).keep(np, like, heads, (0, nq), (0, nk)).reshape(batch, heads, nq, nk)


def is_hopper() -> bool:
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def skip_unless_kernel(algorithm: str, head_dim: int) -> None:
    """Skip where ``algorithm="fa3"`` cannot run (not Hopper, or a head_dim it lacks)."""
    if algorithm == "fa3" and (head_dim % 8 or not is_hopper()):
        pytest.skip("the Hopper kernel runs head dims that are multiples of 8 on sm_90")


def check_error(out64: np.ndarray, ref: np.ndarray, naive64: np.ndarray, dtype: str) -> float:
    """The per-dtype bound and flash-attn's rule (within 2x naive low precision + a floor)."""
    err, naive_err = rel_error(out64, ref), rel_error(naive64, ref)
    assert err <= BOUND[dtype], f"relative error {err:.2e} over the {dtype} bound {BOUND[dtype]}"
    assert err <= 2 * naive_err + FLOOR[dtype], f"error {err:.2e} > 2 x naive low-precision error {naive_err:.2e}"
    return err


def check_lse(lse64: np.ndarray, ref_lse: np.ndarray, atol: float = 2e-3) -> None:
    """Written everywhere, -inf exactly where the reference's is, close elsewhere."""
    assert not np.isnan(lse64).any(), "unwritten (NaN-poisoned) or NaN LSE"
    assert (np.isneginf(lse64) == np.isneginf(ref_lse)).all(), "rows that see no key must have LSE = -inf"
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse64[finite], ref_lse[finite], atol=atol, rtol=1e-3)


def check_attention(
    q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, layout="bshd", algorithm="auto", lse_atol=2e-3
):
    """``cupyflash.attention`` on GPU inputs against the float64 reference: the output's type,
    dtype and shape, no NaN (outputs are poisoned before the launch), the error rules, the LSE.
    Returns (out, relative error)."""
    out, lse = cupyflash.attention(
        q, k, v, causal=causal, window=window, softcap=softcap, scale=scale, layout=layout, return_lse=True,
        algorithm=algorithm,
    )  # fmt: skip
    assert type(out) is type(q) and out.dtype == q.dtype and tuple(out.shape) == tuple(q.shape)
    ref, ref_lse = reference.attention(
        q, k, v, causal=causal, window=window, softcap=softcap, scale=scale, layout=layout, return_lse=True
    )
    out64 = reference.to_numpy64(out)
    assert not np.isnan(out64).any(), "unwritten (NaN-poisoned) or NaN output"
    naive = reference.to_numpy64(
        naive_low_precision(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale, layout=layout)
    )
    if algorithm == "naive":
        # The naive baseline is the low-precision computation itself (S and P rounded to the
        # input type in HBM): its bound is that of a naive computation, not 2x one.
        err = rel_error(out64, ref)
        assert err <= 1.5 * BOUND[dtype_name(q)], f"naive: relative error {err:.2e}"
    else:
        err = check_error(out64, ref, naive, dtype_name(q))
    check_lse(reference.to_numpy64(lse), ref_lse, lse_atol)
    return out, err


# ---------------------------------------------------------------------------------------------
# KV caches.
# ---------------------------------------------------------------------------------------------
def kv_reference(
    q: Any, k: Any, v: Any, lengths: Any, causal: bool, scale: Any = None, tree_mask: Any = None, sinks: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of each sequence b over its first lengths[b] keys of contiguous caches
    [B, L, Hkv, d]; returns (out [B, Nq, Hq, d], LSE [B, Hq, Nq]). ``tree_mask``: bool (B, Nq, Nq),
    sequence b's drafts among its last Nq keys (``reference.tree_visible_keys``); ``sinks``: (Hq,)."""
    outs, lses = [], []
    for b, n in enumerate(lengths):
        n = int(n)
        tree = None if tree_mask is None else tree_mask[b]
        out, lse = reference.attention(
            q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=causal, scale=scale, return_lse=True,
            tree_mask=tree, sinks=sinks,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def random_tree_mask(rng: np.random.Generator, nq: int) -> np.ndarray:
    """A random token tree of ``nq`` drafts as speculative decoding draws one: draft 0 the root,
    draft i > 0 a child of a random earlier draft; bool (nq, nq), row i true at i's ancestors and
    i itself (FlashInfer's custom_mask / vLLM's tree attention, unpacked)."""
    mask = np.eye(nq, dtype=bool)
    for i in range(1, nq):
        mask[i] |= mask[int(rng.integers(i))]
    return mask


def check_kvcache(out, lse, q, k, v, lengths, causal, dtype, scale=None, tree_mask=None):
    """A GPU attention_with_kvcache result against kv_reference on contiguous caches holding
    what the call should have seen (new tokens appended): the error rules and the LSE.
    ``tree_mask``: bool NumPy (B, Nq, Nq), each sequence's drafts (the naive baseline takes the
    tree as a -inf bias)."""
    ref, ref_lse = kv_reference(q, k, v, lengths, causal, scale, tree_mask)
    out64 = reference.to_numpy64(out)
    assert not np.isnan(out64).any(), "unwritten (NaN-poisoned) output"

    def tree_bias(i: int, n: int) -> Any:
        if tree_mask is None:
            return None
        visible = need_torch().from_numpy(reference.tree_visible_keys(n, tree_mask[i]))
        return need_torch().zeros(visible.shape).masked_fill(~visible, -math.inf)

    naive = np.concatenate(
        [
            reference.to_numpy64(
                naive_low_precision(
                    q[i : i + 1],
                    k[i : i + 1, :n],
                    v[i : i + 1, :n],
                    causal=causal and tree_mask is None,
                    window=(-1, -1),
                    softcap=0.0,
                    scale=scale,
                    layout="bshd",
                    bias=tree_bias(i, n),
                )
            )
            for i, n in enumerate(lengths)
        ]  # fmt: skip
    )
    check_error(out64, ref, naive, dtype)
    check_lse(reference.to_numpy64(lse), ref_lse)


def paginate(
    rng: np.random.Generator, caches: Any, page_size: int, spare_pages: int = 3
) -> tuple[list[np.ndarray], np.ndarray]:
    """NumPy caches [B, L, H, d] as pages [num_pages, page_size, H, d] in shuffled order (plus
    ``spare_pages`` unused pages of noise) through one int32 block table [B, ceil(L / page_size)]."""
    b, length, h, d = caches[0].shape
    per_seq = -(-length // page_size)
    num_pages = b * per_seq + spare_pages
    table = rng.permutation(num_pages)[: b * per_seq].reshape(b, per_seq)
    paged = []
    for cache in caches:
        pages = rng.standard_normal((num_pages, page_size, h, d)).astype(cache.dtype)
        padded = np.zeros((b, per_seq * page_size, h, d), dtype=cache.dtype)
        padded[:, :length] = cache
        pages[table.ravel()] = padded.reshape(b * per_seq, page_size, h, d)
        paged.append(pages)
    return paged, table.astype(np.int32)


def check_forward_backward_against_formula(out: Any, grads: Any, q: Any, k: Any, v: Any, dout: Any,
                                           **formula: Any) -> None:  # fmt: skip
    """A GPU forward ``out`` and its backward ``grads`` (dq, dk, dv for the loss sum(out * dout))
    against autograd of naive_low_precision(**formula) (bshd) in float64, by check_against_formula
    with the same formula in the inputs' own precision as the naive baseline."""
    import torch

    def run(precision: Any) -> tuple[Any, list[Any]]:
        leaves = [x.detach().to(precision).requires_grad_(True) for x in (q, k, v)]
        o = naive_low_precision(*leaves, layout="bshd", **formula)
        (o.double() * dout.double()).sum().backward()
        return o, [x.grad for x in leaves]

    want, want_grads = run(torch.float64)
    low, low_grads = run(q.dtype)
    check_against_formula(out, want, low, "out")
    for name, got, ref, lo in zip(("dq", "dk", "dv"), grads, want_grads, low_grads):
        check_against_formula(got, ref, lo, name)


def check_against_formula(got: Any, want: Any, low: Any, name: str) -> float:
    """A GPU result against the float64 formula: within the dtype's bound and within 2x the error
    of the same formula in the inputs' own precision plus a rounding floor (flash-attn's rule)."""
    dtype = str(got.dtype).removeprefix("torch.")
    got64, want64, low64 = (x.detach().double().cpu().numpy() for x in (got, want, low))
    assert not np.isnan(got64).any(), f"{name}: unwritten (NaN-poisoned) or NaN"
    err, naive_err = rel_error(got64, want64), rel_error(low64, want64)
    assert err <= 2 * BOUND[dtype] and err <= 2 * naive_err + FLOOR[dtype], f"{name}: {err:.2e} (naive {naive_err:.2e})"
    return err


def capture(torch: Any, step: Any) -> tuple[Any, Any]:
    """``step`` warmed up on a side stream (compile, plan) and captured in a CUDA graph on the
    current one: (the graph, the output tensor its replays rewrite)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


# ---------------------------------------------------------------------------------------------
# Device code run on the host (the *_c_twin tests): kernels_cu's and the generated C compiled by
# the host's C++ compiler, so that what it computes is checked on a machine with no GPU.
# ---------------------------------------------------------------------------------------------
HOST_CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
needs_host_cxx = pytest.mark.skipif(HOST_CXX is None, reason="no host C++ compiler")


def host_library(source: str, folder: Path, *flags: str) -> ctypes.CDLL:
    """``source`` (C++17) built as a shared library in ``folder`` with warnings as errors; an
    error fails the test with the compiler's message."""
    path, library = folder / "twin.cpp", folder / "twin.so"
    path.write_text(source)
    command = [HOST_CXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", *flags, "-o", str(library),
               str(path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(library))


def three_consumer_mods_tiles(monkeypatch) -> None:
    """The Hopper forward's score / mask functions at d = 64 on the tile of calls past
    FA3_SHORT_SEQLEN keys (three consumers in round robin: 192-row tiles on the dynamic schedule)
    for the rest of a test's small shapes: no call is short, the plans made before forgotten
    (monkeypatch restores the threshold; the caller's teardown need not)."""
    from cupyflash import _dispatch, _plan

    if not is_hopper():
        pytest.skip("the Hopper forward's tiles run on sm_90")
    assert _dispatch.FA3_MODS_FWD_TILES[64, False].consumers == 3
    monkeypatch.setattr(_dispatch, "FA3_SHORT_SEQLEN", 0)
    _plan.clear_caches()
