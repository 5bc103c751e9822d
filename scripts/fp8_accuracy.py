"""Accuracy of an FP8 (e4m3) attention forward, emulated on the host, before the kernel is built:
which scales (per tensor or per head), whether a Hadamard rotation of Q and K helps, and how
P should be cast to e4m3, each measured as the RMSE against a float64 attention of the
unquantised inputs, beside the bf16 forward's.

    python scripts/fp8_accuracy.py [--seqlens 1024 4096] [--head-dim 128] [--heads 4]
                                   [--inputs gaussian outliers] [--json OUT]

The emulation follows the Hopper kernel's order of work (kernels_cu/fa3_fwd.cu, FlashAttention-3's
FP8 path): Q, K and V are quantised once by cupyflash.quantize_fp8, ``x8 = saturate(rn(x / s))``
with ``s = amax / 448`` over the tensor or over each head (one batch); a tile of 64 query rows
visits key blocks of 128, the last first, with the online softmax of docs/background (running
max m, P = exp2(S log2e - m), the rescale of O and l when m moves); P is cast to e4m3 for the
P V product (its scale ``p_scale``: P itself in [0, 1], or P * 256 to keep 8 more binades above
e4m3's smallest subnormal, 2^-9, and divided out of O), while l sums the float32 P; products of
float8 values are exact in float32, and their sums are taken in float32 here. Not emulated: the
order and width of the tensor cores' own accumulation, which on Hopper keeps fewer mantissa bits
than float32 for FP8 inputs; the GPU tests of the kernel will compare against this emulation
with that allowance.

Inputs: see make_inputs. Output: per input and sequence length, each method's RMSE and its
ratio to the bf16 forward's.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

BLOCK_M, BLOCK_N = 64, 128


def hadamard(d: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order d (a power of two): H H^T = I, so
    (Q H)(K H)^T = Q K^T, while H spreads an outlier channel over all d of them."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head dim, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def e4m3(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest e4m3 value (ties to even), saturated at +-448, as float32: the
    library's rule (cupyflash._fp8.quantise, as a float8 cache's append)."""
    import ml_dtypes

    from cupyflash import _fp8

    like = np.empty(0, dtype=ml_dtypes.float8_e4m3fn)
    return _fp8.quantise(np, x, "e4m3", np.float32(1.0), like).astype(np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def quantise(x: np.ndarray, granularity: str) -> tuple[np.ndarray, np.ndarray]:
    """x (1, N, H, d) as e4m3 values (float32) and their descale (1, 1, H, 1): x ~ x8 * descale,
    by cupyflash.quantize_fp8 (per head or for the tensor: amax / 448)."""
    from cupyflash import quantize_fp8

    if x.shape[0] != 1:
        raise ValueError("one batch: quantize_fp8's per-head scale spans the batch, the kernel's (B, H)")
    x8, scale = quantize_fp8(x, fmt="e4m3", per=granularity)
    descale = np.broadcast_to(np.asarray(scale, np.float32).reshape(1, 1, -1, 1), (1, 1, x.shape[2], 1))
    return x8.astype(np.float32), descale


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(scale Q K^T) V in float64, (B, N, H, d)."""
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v.astype(np.float64))


def blockwise(q, k, v, scale, cast_p, p_scale=1.0, q_descale=None, k_descale=None, v_descale=None):
    """The kernel's forward in float32: tiles of BLOCK_M rows, key blocks of BLOCK_N visited last
    first, the online softmax in the log2 domain, P cast by ``cast_p`` (after multiplying it by
    p_scale) for P V, l summed from the float32 P. q, k, v hold the operand values (float8 or
    bf16 values as float32); the descales (B, 1, H, 1) multiply S (q's and k's) and O (v's)."""
    b, n, h, d = q.shape
    nk = k.shape[1]
    qd = np.ones((b, 1, h, 1), np.float32) if q_descale is None else q_descale
    kd = np.ones((b, 1, h, 1), np.float32) if k_descale is None else k_descale
    vd = np.ones((b, 1, h, 1), np.float32) if v_descale is None else v_descale
    score_scale = (np.float32(scale * math.log2(math.e)) * qd[:, 0, :, 0] * kd[:, 0, :, 0]).astype(np.float32)
    out = np.empty((b, n, h, d), np.float32)
    for m0 in range(0, n, BLOCK_M):
        qt = q[:, m0 : m0 + BLOCK_M].transpose(0, 2, 1, 3)  # (B, H, M, d)
        rows = qt.shape[2]
        m = np.full((b, h, rows), -np.inf, np.float32)
        row_sum = np.zeros((b, h, rows), np.float32)
        o = np.zeros((b, h, rows, d), np.float32)
        for n0 in reversed(range(0, nk, BLOCK_N)):
            kt = k[:, n0 : n0 + BLOCK_N].transpose(0, 2, 1, 3)
            vt = v[:, n0 : n0 + BLOCK_N].transpose(0, 2, 1, 3)
            s = np.matmul(qt, kt.transpose(0, 1, 3, 2)) * score_scale[:, :, None, None]  # log2 units
            m_new = np.maximum(m, s.max(axis=-1))
            rescale = np.where(m == -np.inf, 0.0, np.exp2(m - m_new)).astype(np.float32)
            p = np.exp2(s - m_new[..., None]).astype(np.float32)
            row_sum = row_sum * rescale + p.sum(axis=-1, dtype=np.float32)
            o = o * rescale[..., None] + np.matmul(cast_p(p * np.float32(p_scale)), vt)
            m = m_new
        o = o / (row_sum[..., None] * np.float32(p_scale)) * vd[:, 0, :, 0][:, :, None, None]
        out[:, m0 : m0 + BLOCK_M] = o.transpose(0, 2, 1, 3)
    return out


INPUTS = ("gaussian", "sparse", "channels")


def make_inputs(kind: str, n: int, h: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v (1, n, h, d): ``gaussian`` N(0, 1); ``sparse`` N(0, 1) with 0.1% of the entries
    drawn from N(0, 10^2) instead (FlashAttention-3's FP8 study); ``channels`` as LLM activations,
    4 of d channels of Q and K 8x larger, and V's heads spread over 2^-6 .. 2^6 in magnitude (one
    scale for the whole tensor puts the small heads near e4m3's subnormals)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, n, h, d)).astype(np.float32) for _ in range(3))
    if kind == "sparse":
        for x in (q, k, v):
            hit = rng.random(x.shape) < 1e-3
            x[hit] = 10.0 * rng.standard_normal(int(hit.sum())).astype(np.float32)
    elif kind == "channels":
        channels = rng.choice(d, size=4, replace=False)
        q[..., channels] *= 8.0
        k[..., channels] *= 8.0
        v = v * np.exp2(np.linspace(-6.0, 6.0, h)).astype(np.float32)[None, None, :, None]
    elif kind != "gaussian":
        raise ValueError(f"unknown inputs {kind!r}: one of {', '.join(INPUTS)}")
    return q, k, v


def methods(d: int):
    """name -> (prepare(q, k, v) -> (q, k, v, descales), cast_p, p_scale)."""
    rotation = hadamard(d).astype(np.float32)

    def bf16_inputs(q, k, v):
        return bf16(q), bf16(k), bf16(v), (None, None, None)

    def fp8(granularity, rotate):
        def prepare(q, k, v):
            if rotate:
                q, k = q @ rotation, k @ rotation
            (q8, qd), (k8, kd), (v8, vd) = (quantise(x, granularity) for x in (q, k, v))
            return q8, k8, v8, (qd, kd, vd)

        return prepare

    table = {"bf16": (bf16_inputs, bf16, 1.0)}
    for granularity in ("tensor", "head"):
        for rotate in (False, True):
            for p_scale in (1.0, 256.0):
                name = f"fp8 {granularity}{' hadamard' if rotate else ''} P*{int(p_scale)}"
                table[name] = (fp8(granularity, rotate), e4m3, p_scale)
    return table


def measure(kind: str, n: int, h: int, d: int, seed: int = 0) -> dict:
    """The reference output's RMS and, per method (its output in bf16), the RMSE against it
    (``rmse``) and the mean over heads of each head's RMSE over that head's RMS (``head_rel``:
    a head of small values weighs as much as a large one)."""
    q, k, v = make_inputs(kind, n, h, d, seed)
    scale = 1.0 / math.sqrt(d)
    ref = reference(q, k, v, scale)
    head_rms = np.sqrt(np.mean(ref**2, axis=(0, 1, 3)))
    rmse, head_rel = {}, {}
    for name, (prepare, cast_p, p_scale) in methods(d).items():
        qq, kk, vv, (qd, kd, vd) = prepare(q, k, v)
        error = bf16(blockwise(qq, kk, vv, scale, cast_p, p_scale, qd, kd, vd)) - ref
        rmse[name] = float(np.sqrt(np.mean(error**2)))
        head_rel[name] = float(np.mean(np.sqrt(np.mean(error**2, axis=(0, 1, 3))) / head_rms))
    return {"ref_rms": float(np.sqrt(np.mean(ref**2))), "rmse": rmse, "head_rel": head_rel}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--inputs", nargs="+", default=list(INPUTS), choices=INPUTS)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for kind in args.inputs:
        for n in args.seqlens:
            result = measure(kind, n, args.heads, args.head_dim)
            rows.append({"inputs": kind, "seqlen": n, "head_dim": args.head_dim, "heads": args.heads, **result})
            rmse, head_rel = result["rmse"], result["head_rel"]
            print(f"{kind} N={n} d={args.head_dim} H={args.heads} (output RMS {result['ref_rms']:.3e}):")
            print(f"  {'method':26s} {'RMSE':>9s} {'/ bf16':>7s} {'per head':>9s} {'/ bf16':>7s}")
            for name in rmse:
                print(
                    f"  {name:26s} {rmse[name]:9.3e} {rmse[name] / rmse['bf16']:7.2f}"
                    f" {head_rel[name]:9.3e} {head_rel[name] / head_rel['bf16']:7.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
