"""The algorithms once more, written against the array-API standard: the CPU path of
``attention`` and the readable twin of each CUDA kernel.

* ``naive``  -- standard attention: S = Q K^T and P = softmax(S) materialised, O = P V.
* ``fa1``    -- FlashAttention-1: outer loop over K/V blocks (B_c = ceil(M / 4d)), inner over
  Q blocks (B_r = min(B_c, d)); O, l, m live in "HBM" (one array per Q block) and are read and
  written back at every outer step (Algorithm 1 of the paper).
* ``fa2``    -- FlashAttention-2: outer loop over Q blocks, inner over K/V blocks, O, l, m kept
  "on chip" for the whole inner loop, normalised once at the end.
* ``decode`` -- FlashDecoding: the K/V range split into chunks, each chunk an FA2 pass that
  returns its normalised partial (O_s, LSE_s); the partials are merged exactly.

The online-softmax verbs below carry the same names as in kernels_cu/softmax.cuh
(update_max, exp_accumulate, finalize, merge) and the same log2-domain arithmetic; here the
logits arrive already scaled (scale, softcap), so ``scale_log2 = log2(e)``. The key-block
range of a query block is ``KeyMask``, the twin of kernels_cu/mask.cuh. Arrays are
``[B, Hkv, G, N, d]`` inside (G = query heads per K/V head), computed in float32 (float64
inputs stay float64; every LSE comes back in that compute dtype).

Non-finite inputs give what reference.py documents, whatever the algorithm and its block or
split sizes: a row with a NaN or +inf score gets NaN in O and LSE (the max and the sums carry
the NaN through every verb), a NaN value reaches the rows that score its key and no other
(``weighted_values``), and an empty part of a merge weighs nothing whatever its O holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._mods import Mod, captured_reads, evaluate, score_derivative
from ._validate import Problem

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

#: FA1's on-chip memory M in elements: the H200's 227 KB of shared memory per block, 16-bit.
DEFAULT_SRAM_ELEMENTS = 227 * 1024 // 2


def _exp2(xp: Any, x: Any) -> Any:
    return xp.exp(x * LN2)


# ---------------------------------------------------------------------------------------------
# The online-softmax verbs (twins of kernels_cu/softmax.cuh).
# ---------------------------------------------------------------------------------------------
def update_max(xp: Any, row_max: Any, logits: Any, scale_log2: float) -> tuple[Any, Any]:
    """Verb 1: new running max and the factor exp2((m_old - m_new) * scale_log2) for O and l.

    The factor is 0 while the old max is -inf (first visible block: nothing to rescale).
    """
    new_max = xp.maximum(row_max, xp.max(logits, axis=-1))
    never_seen = row_max == -math.inf
    safe_new = xp.where(new_max == -math.inf, xp.zeros_like(new_max), new_max)
    safe_old = xp.where(never_seen, safe_new, row_max)
    rescale = xp.where(never_seen, xp.zeros_like(new_max), _exp2(xp, (safe_old - safe_new) * scale_log2))
    return new_max, rescale


def _max_scaled(xp: Any, row_max: Any, scale_log2: float) -> Any:
    """The max subtracted in the exponent; 0 for a row with no visible key (avoids -inf + inf)."""
    return xp.where(row_max == -math.inf, xp.zeros_like(row_max), row_max * scale_log2)


def exp_accumulate(
    xp: Any, logits: Any, row_max: Any, row_sum: Any, rescale: Any, scale_log2: float
) -> tuple[Any, Any]:
    """Verb 2: probabilities p = exp2(x * scale_log2 - m) and the rescaled running sum."""
    p = _exp2(xp, logits * scale_log2 - _max_scaled(xp, row_max, scale_log2)[..., None])
    return p, row_sum * rescale + xp.sum(p, axis=-1)


def weighted_values(xp: Any, probs: Any, logits: Any, v: Any) -> Any:
    """``probs @ v`` over the keys that take part in each row (score > -inf: visible, not masked).

    With finite values that is the plain product. A NaN or +-inf value must reach exactly the rows
    that give its key a score, as in reference.py: the plain product would add 0 * NaN = NaN from
    a masked key to every row of the block, so the answer would depend on the block sizes. Here
    the non-finite values are taken out of the product and put back, in IEEE arithmetic (+-inf
    where the weight is > 0, NaN where it is 0 or both signs meet), from boolean hit counts.
    """
    finite = xp.isfinite(v)
    if bool(xp.all(finite)):
        return probs @ v
    real = probs @ xp.where(finite, v, xp.zeros_like(v))

    def hits(rows: Any, values: Any) -> Any:  # some key of the row has the value: [.., rows, d]
        return (xp.astype(rows, v.dtype) @ xp.astype(values, v.dtype)) > 0

    takes_part = logits > -math.inf
    weighted = takes_part & (probs > 0)
    nan = hits(takes_part, xp.isnan(v)) | hits(takes_part & (probs == 0), xp.isinf(v))
    pos, neg = hits(weighted, v == math.inf), hits(weighted, v == -math.inf)
    out = xp.where(pos, xp.full_like(real, math.inf), real)
    out = xp.where(neg, xp.full_like(real, -math.inf), out)
    return xp.where(nan | (pos & neg) | xp.isnan(real), xp.full_like(real, math.nan), out)


def finalize(xp: Any, row_max: Any, row_sum: Any, scale_log2: float) -> tuple[Any, Any]:
    """Verb 3: 1 / l for the output and the natural-log LSE; an empty row gives 0 and -inf."""
    empty = (row_sum == 0) | (row_max == -math.inf)
    safe_sum = xp.where(empty, xp.ones_like(row_sum), row_sum)
    inv_sum = xp.where(empty, xp.zeros_like(row_sum), 1.0 / safe_sum)
    lse = (row_max * scale_log2 + xp.log2(safe_sum)) * LN2
    return inv_sum, xp.where(empty, xp.full_like(lse, -math.inf), lse)


def add_sink(xp: Any, out: Any, lse: Any, sink: Any) -> tuple[Any, Any]:
    """A learnable sink (gpt-oss): the logit ``sink`` (broadcast against ``lse``) joins each row's
    softmax denominator and takes no value (twin of softmax.cuh's add_sink):
    lse' = log(exp(lse) + exp(sink)), O' = O exp(lse - lse'). A row that saw no key gets 0 and
    lse' = sink; NaN in lse or sink gives NaN; a sink of -inf changes nothing."""
    sink = sink + xp.zeros_like(lse)
    none = sink == -math.inf
    merged = xp.logaddexp(lse, xp.where(none, xp.zeros_like(sink), sink))  # (kept finite where unused)
    factor = xp.where(none, xp.ones_like(lse), xp.exp(lse - merged))
    return out * factor[..., None], xp.where(none, lse, merged)


def sink_gradient(xp: Any, lse: Any, dsum: Any, sink: Any) -> Any:
    """Each row's share of dLoss / dsink: -P_sink D, P_sink = exp(sink - lse') the sink's weight
    in the row (lse' its LSE, the sink included) and D = rowsum(dO * O) - dLSE (fa2_bwd.cu's
    prep). A row whose LSE is -inf (a sink of -inf) has none."""
    sink = sink + xp.zeros_like(lse)
    weight = xp.where(lse == -math.inf, xp.zeros_like(lse), xp.exp(sink - lse))
    return -weight * dsum


def merge(xp: Any, outs: list[Any], lses: list[Any]) -> tuple[Any, Any]:
    """Verb 4: exact merge of normalised partials: lse = log sum exp(lse_i),
    O = sum_i exp(lse_i - lse) O_i. Parts that saw no key (lse -inf) weigh 0 whatever their O
    holds; all empty -> 0, -inf. A NaN lse (a part with a NaN or +inf score) makes O and lse NaN.
    """
    lse_stack = xp.stack(lses, axis=0)
    m = xp.max(lse_stack, axis=0)
    empty = m == -math.inf
    safe_m = xp.where(empty, xp.zeros_like(m), m)
    weights = _exp2(xp, (lse_stack - safe_m) * LOG2E)  # exp(-inf) = 0 for empty parts
    total = xp.sum(weights, axis=0)
    safe_total = xp.where(empty, xp.ones_like(total), total)
    lse = xp.where(empty, xp.full_like(m, -math.inf), safe_m + xp.log(safe_total))
    out = xp.zeros_like(outs[0])
    for i, o in enumerate(outs):
        w = xp.where(empty, xp.zeros_like(total), weights[i, ...] / safe_total)
        # an empty part adds nothing, even where its O is NaN or garbage (0 * NaN would be NaN)
        part_empty = xp.expand_dims(lses[i] == -math.inf, axis=-1)
        out = out + xp.where(part_empty, xp.zeros_like(o), w[..., None] * o)
    return out, lse


# ---------------------------------------------------------------------------------------------
# Dropout on P (twin of kernels_cu/dropout.cuh): the same Philox4x32-10 draws, element for
# element, so a host call and a GPU call with one seed drop the same probabilities.
# ---------------------------------------------------------------------------------------------
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def philox4x32_10(counter: tuple[Any, Any, Any, Any], key: tuple[int, int]) -> tuple[Any, Any, Any, Any]:
    """Philox4x32-10 on NumPy uint64 arrays that hold 32-bit words (the products fit in 64 bits)."""
    import numpy as np

    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in counter)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    m0, m1, mask = np.uint64(_PHILOX_M[0]), np.uint64(_PHILOX_M[1]), np.uint64(_U32)
    for round_ in range(10):
        if round_:
            k0, k1 = (k0 + np.uint64(_PHILOX_W[0])) & mask, (k1 + np.uint64(_PHILOX_W[1])) & mask
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask
    return c0, c1, c2, c3


@dataclass(frozen=True)
class Dropout:
    """Dropout with probability ``p`` under ``seed``; ``batch0``: the batch index of the first
    batch entry (a packed sequence's index in its batch, where the host runs one at a time)."""

    p: float
    seed: int
    batch0: int = 0

    @property
    def threshold(self) -> int:
        """A 16-bit draw below it drops its element: round(p * 65536), so an element is dropped
        with probability threshold / 65536, within 2^-17 of p (check_dropout keeps it < 65536)."""
        return round(self.p * 65536)

    @property
    def scale(self) -> float:
        """1 / the keep probability actually used, so that the expected output is exact."""
        return 65536.0 / (65536 - self.threshold)

    def keep(self, xp: Any, like: Any, heads: int, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        """Keep mask [B, Hkv, G, rows, keys] (``like``'s leading shape) of query rows
        ``rows[0]..rows[1]-1`` and keys ``keys[0]..keys[1]-1`` of every (batch, query head)."""
        import numpy as np

        batch, hkv, group = like.shape[:3]
        b = np.arange(batch, dtype=np.uint64).reshape(-1, 1, 1, 1) + np.uint64(self.batch0)
        h = np.arange(heads, dtype=np.uint64).reshape(1, -1, 1, 1)
        i = np.arange(*rows, dtype=np.uint64).reshape(1, 1, -1, 1)
        j = np.arange(*keys, dtype=np.uint64).reshape(1, 1, 1, -1)
        u = np.uint64
        counter = (j // u(16) * u(4) + j % u(8) // u(2), i // u(16) * u(8) + i % u(8), h, b)
        c0, c1, c2, c3 = np.broadcast_arrays(*counter)
        words = philox4x32_10((c0, c1, c2, c3), (self.seed & _U32, self.seed >> 32))
        number = u(4) * (i // u(8) % u(2)) + u(2) * (j // u(8) % u(2)) + j % u(2)
        word = np.choose((number // u(2)).astype(np.intp), words)
        draw = (word >> (u(16) * (number % u(2)))) & u(0xFFFF)
        keep = (draw >= u(self.threshold)).reshape(batch, hkv, group, rows[1] - rows[0], keys[1] - keys[0])
        return xp.asarray(keep, device=_device(like))

    def apply(self, xp: Any, probs: Any, heads: int, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        """P with the dropped elements zeroed (the kept ones scaled later, as the kernels do)."""
        return xp.where(self.keep(xp, probs, heads, rows, keys), probs, xp.zeros_like(probs))


# ---------------------------------------------------------------------------------------------
# Masks (twin of kernels_cu/mask.cuh).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KeyMask:
    """Visible keys of query rows [row_first, row_last] under the normalised window bounds."""

    row_first: int
    row_last: int
    seqlen_q: int
    seqlen_k: int
    window_left: int
    window_right: int

    @property
    def shift(self) -> int:
        return self.seqlen_k - self.seqlen_q

    def key_begin(self) -> int:
        if self.window_left < 0:
            return 0
        return max(0, self.row_first + self.shift - self.window_left)

    def key_end(self) -> int:
        end = self.seqlen_k
        if self.window_right >= 0:
            end = min(end, self.row_last + self.shift + self.window_right + 1)
        return max(end, 0)

    def needs_mask(self, key_first: int, key_last: int) -> bool:
        partial = key_last >= self.seqlen_k
        if self.window_right >= 0:
            partial |= key_last > self.row_first + self.shift + self.window_right
        if self.window_left >= 0:
            partial |= key_first < self.row_last + self.shift - self.window_left
        return partial

    def apply(self, xp: Any, logits: Any, key_first: int, key_last: int) -> Any:
        """Set hidden logits of the [rows, keys] block (last two axes) to -inf."""
        device = _device(logits)
        rows = xp.reshape(xp.arange(self.row_first, self.row_last + 1, device=device), (-1, 1))
        keys = xp.reshape(xp.arange(key_first, key_last + 1, device=device), (1, -1))
        ok = keys < self.seqlen_k
        if self.window_right >= 0:
            ok = ok & (keys <= rows + self.shift + self.window_right)
        if self.window_left >= 0:
            ok = ok & (keys >= rows + self.shift - self.window_left)
        return xp.where(ok, logits, xp.full_like(logits, -math.inf))


@dataclass(frozen=True)
class Alibi:
    """ALiBi (twin of kernels_cu/variants.cuh's Alibi): the score of query row i and key j gains
    -slope * |i + Nk - Nq - j|; ``slopes`` [B or 1, Hkv, G, 1, 1] in the compute dtype."""

    slopes: Any

    @staticmethod
    def of(xp: Any, slopes: Any, heads_kv: int, like: Any) -> Alibi:
        """From the caller's (Hq,) or (B, Hq) slopes."""
        s = xp.astype(slopes, like.dtype)
        s = xp.reshape(s, (1 if s.ndim == 1 else s.shape[0], heads_kv, -1, 1, 1))
        return Alibi(xp.asarray(s, device=_device(like)))

    def bias(self, xp: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        device = _device(self.slopes)
        i = xp.reshape(xp.arange(*rows, device=device), (-1, 1))
        j = xp.reshape(xp.arange(*keys, device=device), (1, -1))
        distance = xp.abs(i + (p.seqlen_k - p.seqlen_q) - j)
        return -self.slopes * xp.astype(distance, self.slopes.dtype)


@dataclass(frozen=True)
class MaskBias:
    """An attention mask (twin of kernels_cu/variants.cuh's AttnBias), SDPA's attn_mask: additive,
    or boolean (True: the key takes part; False: its logit -inf); ``values`` [B|1, Hkv|1, G|1,
    Nq|1, Nk|1] as an additive bias in the compute dtype."""

    values: Any

    @staticmethod
    def of(xp: Any, mask: Any, heads_kv: int, like: Any) -> MaskBias:
        """From the caller's 4-D (B|1, Hq|1, Nq|1, Nk|1) mask."""
        if mask.dtype == xp.bool:
            zero = xp.zeros(mask.shape, dtype=like.dtype, device=_device(like))
            values = xp.where(mask, zero, xp.full(mask.shape, -math.inf, dtype=like.dtype, device=_device(like)))
        else:
            values = xp.asarray(xp.astype(mask, like.dtype), device=_device(like))
        b, h, nq, nk = values.shape
        grouped = (heads_kv, h // heads_kv) if h > 1 else (1, 1)
        return MaskBias(xp.reshape(values, (b, *grouped, nq, nk)))

    def bias(self, xp: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        v = self.values
        v = v if v.shape[-2] == 1 else v[..., rows[0] : rows[1], :]
        return v if v.shape[-1] == 1 else v[..., keys[0] : keys[1]]


@dataclass(frozen=True)
class Mods:
    """A traced ``score_mod`` and / or ``mask_mod`` (``_mods``) on the scores after the scale, the
    softcap and ALiBi (``base``): query head h = Hkv index * G + group index, absolute query rows
    and keys; hidden scores become -inf. ``buffers``: each one's captured arrays in ``xp``.
    ``batch0``: the b the functions see for batch entry 0 (a packed sequence's index, where
    ``attention_varlen`` runs each sequence as a batch of one)."""

    score_mod: Mod | None
    mask_mod: Mod | None
    buffers: tuple[tuple[Any, ...], tuple[Any, ...]]
    base: Alibi | None = None
    batch0: int = 0

    @staticmethod
    def of(
        xp: Any, score_mod: Mod | None, mask_mod: Mod | None, base: Alibi | None, like: Any, batch0: int = 0
    ) -> Mods:
        buffers = tuple(
            () if mod is None else tuple(xp.asarray(x, device=_device(like)) for x in mod.buffers)
            for mod in (score_mod, mask_mod)
        )
        return Mods(score_mod, mask_mod, (buffers[0], buffers[1]), base, batch0)

    def apply(self, xp: Any, s: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        """The scores ``s`` [B, Hkv, G, rows, keys] of query rows ``rows`` and keys ``keys`` (ranges)."""
        if self.base is not None:
            s = s + self.base.bias(xp, p, rows, keys)
        index = self._index(xp, s, p, rows, keys)
        if self.score_mod is not None:
            s = self._score(xp, self.score_mod, s, index)
        if self.mask_mod is not None:
            visible = evaluate(xp, self.mask_mod, index, self.buffers[1], s.dtype)
            visible = xp.broadcast_to(xp.asarray(visible, dtype=xp.bool, device=_device(s)), s.shape)
            s = xp.where(visible, s, xp.full_like(s, -math.inf))
        return s

    def score_slope(self, xp: Any, capped: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        """d score_mod / d score at the scores before it (``capped``: scaled and soft-capped)."""
        s = capped if self.base is None else capped + self.base.bias(xp, p, rows, keys)
        if self.score_mod is None:
            return xp.ones_like(s)
        return self._score(xp, score_derivative(self.score_mod), s, self._index(xp, s, p, rows, keys))

    def _score(self, xp: Any, mod: Mod, s: Any, index: dict[str, Any]) -> Any:
        modded = evaluate(xp, mod, {"score": s, **index}, self.buffers[0], s.dtype)
        if not hasattr(modded, "dtype") or modded.dtype != s.dtype:
            modded = xp.asarray(modded, dtype=s.dtype, device=_device(s))
        return xp.broadcast_to(modded, s.shape)

    def _index(self, xp: Any, s: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> dict[str, Any]:
        device, group = _device(s), p.heads_q // p.heads_kv
        return {
            "b": xp.reshape(xp.arange(self.batch0, self.batch0 + p.batch, device=device), (-1, 1, 1, 1, 1)),
            "h": xp.reshape(xp.arange(p.heads_q, device=device), (1, p.heads_kv, group, 1, 1)),
            "q_idx": xp.reshape(xp.arange(*rows, device=device), (-1, 1)),
            "kv_idx": xp.reshape(xp.arange(*keys, device=device), (1, -1)),
        }


class CapturedGradients:
    """The gradients of score_mod's captured float arrays (a learned bias table), accumulated over
    the backward's blocks: each score's dS (the loss's gradient at score_mod's output) times
    d score_mod / d (the element it read), added at that element (``_mods.captured_reads``). In
    the compute dtype; ``result`` casts each to its array's dtype. The kernels' twin would add
    them atomically per score: the kernels have no such scatter yet."""

    def __init__(self, xp: Any, mods: Mods, compute: Any) -> None:
        assert mods.score_mod is not None
        self.mods, self.reads = mods, captured_reads(mods.score_mod)
        arrays = mods.buffers[0]
        self.sums: list[Any] = [
            xp.zeros(math.prod(x.shape), dtype=compute, device=_device(x)) if xp.isdtype(x.dtype, "real floating")
            else None
            for x in arrays
        ]  # fmt: skip

    def add(self, xp: Any, ds: Any, capped: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> None:
        """Block (``rows``, ``keys``): ``ds`` [B, Hkv, G, rows, keys] (0 where hidden), ``capped``
        the scores before the bias and score_mod (scaled and soft-capped)."""
        mods = self.mods
        s = capped if mods.base is None else capped + mods.base.bias(xp, p, rows, keys)
        index = mods._index(xp, s, p, rows, keys)
        arrays = mods.buffers[0]
        for read in self.reads:
            slope = mods._score(xp, read.slope, s, index)
            grad = xp.where(ds != 0, ds * slope, xp.zeros_like(ds))  # a hidden score's slope may be inf
            shape = arrays[read.slot].shape
            flat = None
            for axis, expr in enumerate(read.indices):
                i = evaluate(xp, expr, index, arrays, s.dtype)
                i = xp.broadcast_to(xp.asarray(i, dtype=xp.arange(1).dtype, device=_device(ds)), ds.shape)
                flat = i if flat is None else flat * shape[axis] + i
            assert flat is not None
            self.sums[read.slot] = scatter_add(xp, self.sums[read.slot], xp.reshape(flat, (-1,)),
                                               xp.reshape(grad, (-1,)))  # fmt: skip

    def result(self, xp: Any) -> tuple[Any, ...]:
        """Per captured array of score_mod (slot order): its gradient in its shape and dtype, or
        None for an integer or boolean array."""
        return tuple(
            None if total is None else xp.reshape(xp.astype(total, x.dtype), x.shape)
            for total, x in zip(self.sums, self.mods.buffers[0])
        )


def scatter_add(xp: Any, target: Any, index: Any, values: Any) -> Any:
    """``target`` (1-D) with ``values`` added at ``index`` (1-D integers, repeats summed): the
    namespace's own scatter where it has one, else a sort and a float64 running sum."""
    import array_api_compat as compat

    if compat.is_numpy_namespace(xp) or compat.is_cupy_namespace(xp):
        lib = __import__("cupy" if compat.is_cupy_namespace(xp) else "numpy")
        return target + lib.bincount(index, weights=values, minlength=target.shape[0]).astype(target.dtype)
    if compat.is_torch_namespace(xp):
        return target.index_add(0, index, values.to(target.dtype))
    if compat.is_jax_namespace(xp):
        return target.at[index].add(values.astype(target.dtype))
    order = xp.argsort(index)
    index, values = xp.take(index, order, axis=0), xp.astype(xp.take(values, order, axis=0), xp.float64)
    running = xp.concat([xp.zeros(1, dtype=xp.float64, device=_device(values)), xp.cumulative_sum(values)])
    slots = xp.arange(target.shape[0], dtype=index.dtype, device=_device(values))
    first, past = xp.searchsorted(index, slots, side="left"), xp.searchsorted(index, slots, side="right")
    return target + xp.astype(xp.take(running, past, axis=0) - xp.take(running, first, axis=0), target.dtype)


@dataclass(frozen=True)
class TreeMask:
    """Speculative decoding's tree among the draft tokens (twin of decode.cu's Is_tree rows in
    PackedRowMask): the Nq query rows are the last Nq keys; key j >= Nk - Nq is draft
    j - (Nk - Nq), which row i sees iff ``drafts[i, j - (Nk - Nq)]``; every key before the drafts
    is visible. Hidden scores become -inf (a mask, not an additive bias: a NaN score of a hidden
    key is dropped, as the kernel drops it). ``drafts`` [Nq, Nq] bool, one sequence's."""

    drafts: Any

    def apply(self, xp: Any, s: Any, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
        """The scores ``s`` [.., rows, keys] of query rows ``rows`` and keys ``keys`` (ranges)."""
        shift = p.seqlen_k - p.seqlen_q
        device = _device(s)
        i = xp.reshape(xp.arange(*rows, device=device), (-1, 1))
        draft = xp.reshape(xp.arange(*keys, device=device), (1, -1)) - shift
        column = xp.clip(draft, 0, max(p.seqlen_q - 1, 0))  # (a key before the drafts reads column 0, unused)
        flat = xp.reshape(xp.asarray(self.drafts, device=device), (-1,))
        sees = xp.take(flat, xp.reshape(i * p.seqlen_q + column, (-1,)), axis=0)
        visible = (draft < 0) | xp.reshape(sees, (rows[1] - rows[0], keys[1] - keys[0]))
        return xp.where(visible, s, xp.full_like(s, -math.inf))


# ---------------------------------------------------------------------------------------------
# A mask_mod's block summary (cupyflash.create_block_mask), the twin of kernels_cu/attn_mask.cuh's
# block_mask_cells, and its shown ranges (variants.cuh's block_mask_key_blocks reads them).
# ---------------------------------------------------------------------------------------------
#: The states of a cell (variants.cuh's kMaskCell*): every key hidden, some shown, every key shown
#: (the mask changes no score there), past the mask's rows or keys.
MASK_CELL_HIDDEN, MASK_CELL_MIXED, MASK_CELL_PLAIN, MASK_CELL_EMPTY = 0, 1, 2, 3
#: Rows (keys) per entry of the shown ranges (variants.cuh's kMaskRangeBlock).
MASK_RANGE_BLOCK = 128
#: Scores evaluated at a time while summarising on the host (memory, not speed).
_CELL_CHUNK_SCORES = 1 << 22


def block_mask_cells(
    xp: Any, mask_mod: Mod, buffers: tuple[Any, ...], extents: tuple[int, int], lengths: tuple[int, int],
    block: tuple[int, int], cells: tuple[int, int],
) -> Any:  # fmt: skip
    """The summary [extents[0], extents[1], cells[0], cells[1]] (uint8 states) of ``mask_mod``
    (its captured arrays ``buffers`` in ``xp``) over ``lengths`` = (Nq, Nk), cells of ``block`` =
    (rows, keys): a cell every one of whose (row, key) the mask hides is hidden, one that shows
    all of them plain, any other mixed; cells past the lengths empty. The mask is evaluated as the
    kernels evaluate it (float32 arithmetic), a few cell rows at a time; b, h run over
    ``extents`` (1 on an axis the mask does not read: index 0 stands for all)."""
    rows, keys = block
    seqlen_q, seqlen_k = lengths
    cells_m, cells_n = cells
    device = _device(buffers[0]) if buffers else None
    chunk = max(1, _CELL_CHUNK_SCORES // max(rows * cells_n * keys, 1))  # cell rows per evaluation
    kv_idx = xp.reshape(xp.arange(seqlen_k, dtype=xp.int64, device=device), (1, -1))
    out = []
    for b in range(extents[0]):
        for h in range(extents[1]):
            parts = []
            for m0 in range(0, cells_m, chunk):
                m1 = min(m0 + chunk, cells_m)
                row0, row1 = min(m0 * rows, seqlen_q), min(m1 * rows, seqlen_q)
                q_idx = xp.reshape(xp.arange(row0, row1, dtype=xp.int64, device=device), (-1, 1))
                b_h = (xp.asarray(b, dtype=xp.int64, device=device), xp.asarray(h, dtype=xp.int64, device=device))
                index = {"b": b_h[0], "h": b_h[1], "q_idx": q_idx, "kv_idx": kv_idx}
                shown = evaluate(xp, mask_mod, index, buffers, xp.float32)
                shown = xp.broadcast_to(xp.asarray(shown, dtype=xp.bool, device=device), (row1 - row0, seqlen_k))
                parts.append(_cell_states(xp, shown, (m1 - m0, cells_n), block, device))
            out.append(xp.concat(parts, axis=0) if parts else xp.zeros((0, cells_n), dtype=xp.uint8, device=device))
    return xp.reshape(xp.stack(out), (extents[0], extents[1], cells_m, cells_n))


def _cell_states(xp: Any, shown: Any, cells: tuple[int, int], block: tuple[int, int], device: Any) -> Any:
    """The states of ``cells`` cells of ``block`` from the mask's values ``shown`` [rows, keys]
    over the part of them inside the lengths (their first rows, keys: the rest is past them)."""
    (cells_m, cells_n), (rows, keys) = cells, block
    pad = ((0, cells_m * rows - shown.shape[0]), (0, cells_n * keys - shown.shape[1]))
    inside = xp.ones(shown.shape, dtype=xp.bool, device=device)
    shown, inside = (_padded(xp, x, pad, device) for x in (shown, inside))
    grid = (cells_m, rows, cells_n, keys)
    shown, inside = xp.reshape(shown, grid), xp.reshape(inside, grid)
    any_shown = xp.any(shown, axis=(1, 3))
    all_plain = xp.all(shown | ~inside, axis=(1, 3))
    shown_state = xp.astype(all_plain, xp.uint8) * (MASK_CELL_PLAIN - MASK_CELL_MIXED) + MASK_CELL_MIXED
    state = xp.where(any_shown, shown_state, xp.full_like(shown_state, MASK_CELL_HIDDEN))
    return xp.where(xp.any(inside, axis=(1, 3)), state, xp.full_like(state, MASK_CELL_EMPTY))


def _padded(xp: Any, x: Any, pad: tuple[tuple[int, int], tuple[int, int]], device: Any) -> Any:
    """``x`` [r, c] with ``pad`` false rows and columns after it."""
    (_, rows), (_, cols) = pad
    if cols:
        x = xp.concat([x, xp.zeros((x.shape[0], cols), dtype=xp.bool, device=device)], axis=1)
    if rows:
        x = xp.concat([x, xp.zeros((rows, x.shape[1]), dtype=xp.bool, device=device)], axis=0)
    return x


def block_mask_ranges(xp: Any, cells: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """The shown ranges of a summary ``cells`` [B, H, M, N] of ``block`` = (rows, keys) cells
    (its rows and keys whole multiples of MASK_RANGE_BLOCK, and of the block): int32
    [B, H, M rows / MASK_RANGE_BLOCK, 2], per block of MASK_RANGE_BLOCK rows the keys [first, end)
    of its shown cells ((0, 0): none), and [B, H, N keys / MASK_RANGE_BLOCK, 2], per block of
    keys the rows of its shown cells. Sound bounds on a tile's loop: outside them every cell of
    the tile's block is hidden."""
    shown = (cells == MASK_CELL_MIXED) | (cells == MASK_CELL_PLAIN)
    rows, keys = block
    key_ranges = _spans(xp, shown, rows, keys)
    row_ranges = _spans(xp, xp.permute_dims(shown, (0, 1, 3, 2)), keys, rows)
    return key_ranges, row_ranges


def _spans(xp: Any, shown: Any, along: int, across: int) -> Any:
    """Per block of MASK_RANGE_BLOCK positions along axis -2 (cells of ``along`` positions), the
    positions [first, end) of the shown cells along axis -1 (cells of ``across``)."""
    b, h, m, n = shown.shape
    if along < MASK_RANGE_BLOCK:  # several cell rows per range block: their union
        group = MASK_RANGE_BLOCK // along
        shown = xp.any(xp.reshape(shown, (b, h, m // group, group, n)), axis=3)
    elif along > MASK_RANGE_BLOCK:  # a cell row spans several range blocks: each takes its range
        copies = along // MASK_RANGE_BLOCK
        shown = xp.reshape(xp.broadcast_to(shown[:, :, :, None, :], (b, h, m, copies, n)), (b, h, m * copies, n))
    flags = xp.astype(shown, xp.int8)
    some = xp.any(shown, axis=-1)
    first = xp.argmax(flags, axis=-1)
    end = n - xp.argmax(xp.flip(flags, axis=-1), axis=-1)
    first = xp.where(some, first * across, xp.zeros_like(first))
    end = xp.where(some, end * across, xp.zeros_like(end))
    return xp.astype(xp.stack([first, end], axis=-1), xp.int32)


#: What a score may gain before the softmax: ALiBi's distance bias, an attention mask, the
#: user's score_mod / mask_mod, or a tree mask among draft tokens.
LogitBias = Alibi | MaskBias | Mods | TreeMask


def _biased(xp: Any, s: Any, bias: LogitBias, p: Problem, rows: tuple[int, int], keys: tuple[int, int]) -> Any:
    if isinstance(bias, (Mods, TreeMask)):
        return bias.apply(xp, s, p, rows, keys)
    return s + bias.bias(xp, p, rows, keys)


def _logits(
    xp: Any, q_blk: Any, k_blk: Any, p: Problem, bias: LogitBias | None = None, rows: tuple[int, int] = (0, 0),
    keys: tuple[int, int] = (0, 0),
) -> Any:  # fmt: skip
    """Scaled (and soft-capped) scores of a block: [.., rows, d] x [.., keys, d] -> [.., rows, keys];
    with ``bias`` (ALiBi or an attn_mask), plus it at query rows ``rows`` and keys ``keys`` (ranges)."""
    s = q_blk @ xp.matrix_transpose(k_blk)
    s = p.softcap * xp.tanh(s * (p.scale / p.softcap)) if p.softcap > 0 else s * p.scale
    return s if bias is None else _biased(xp, s, bias, p, rows, keys)


# ---------------------------------------------------------------------------------------------
# The algorithms. q: [B, Hkv, G, Nq, d]; k, v: [B, Hkv, 1, Nk, d]. Return (O, LSE [B, Hkv, G, Nq]).
# ---------------------------------------------------------------------------------------------
def naive(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, dropout: Dropout | None = None, bias: LogitBias | None = None
) -> tuple[Any, Any]:
    """Three passes over N x N matrices: S = Q K^T, P = softmax(S), O = P V (P dropped out first
    with ``dropout``)."""
    mask = KeyMask(0, p.seqlen_q - 1, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
    logits = _logits(xp, q, k, p, bias, (0, p.seqlen_q), (0, p.seqlen_k))
    s = mask.apply(xp, logits, 0, p.seqlen_k - 1)  # pass 1: S
    if p.seqlen_k:
        row_max = xp.max(s, axis=-1)
    else:  # no key at all (max over an empty axis is an error): every row is empty
        row_max = xp.full(s.shape[:-1], -math.inf, dtype=s.dtype, device=_device(s))
    zero_state = xp.zeros_like(row_max)
    probs, row_sum = exp_accumulate(xp, s, row_max, zero_state, zero_state, LOG2E)  # pass 2: P
    inv_sum, lse = finalize(xp, row_max, row_sum, LOG2E)
    if dropout is not None:
        probs = dropout.apply(xp, probs, p.heads_q, (0, p.seqlen_q), (0, p.seqlen_k))
        inv_sum = inv_sum * dropout.scale
    return weighted_values(xp, probs, s, v) * inv_sum[..., None], lse  # pass 3: O


def fa2_partial(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, block_m: int, block_n: int, key_range: tuple[int, int],
    dropout: Dropout | None = None, bias: LogitBias | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """FA2 over keys in ``key_range`` (the whole sequence, or one split of FlashDecoding).

    Query blocks outer; for each, the visible key blocks inner, last first (as the kernel), with
    O, m, l carried across the inner loop and normalised once. With ``dropout``, P's dropped
    elements leave l as it is and O without their values; O is scaled by Dropout.scale at the end.
    """
    outs, lses = [], []
    for row0 in range(0, p.seqlen_q, block_m):
        row1 = min(row0 + block_m, p.seqlen_q)
        mask = KeyMask(row0, row1 - 1, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
        q_blk = q[..., row0:row1, :]
        acc = xp.zeros_like(q_blk)
        row_max = xp.full(q_blk.shape[:-1], -math.inf, dtype=q.dtype, device=_device(q))
        row_sum = xp.zeros(q_blk.shape[:-1], dtype=q.dtype, device=_device(q))
        key_begin = max(mask.key_begin(), key_range[0])
        key_end = min(mask.key_end(), key_range[1])
        for n_block in range((key_end - 1) // block_n, key_begin // block_n - 1, -1):
            key0 = max(n_block * block_n, key_begin)  # the block, clipped to the visible range
            key1 = min(n_block * block_n + block_n, key_end)
            if key1 <= key0:
                continue
            # -- scores of this block, masked only where the block straddles a bound
            s = _logits(xp, q_blk, k[..., key0:key1, :], p, bias, (row0, row1), (key0, key1))
            if mask.needs_mask(key0, key1 - 1):
                s = mask.apply(xp, s, key0, key1 - 1)
            # -- update m and l, rescale O, accumulate P V
            row_max, rescale = update_max(xp, row_max, s, LOG2E)
            probs, row_sum = exp_accumulate(xp, s, row_max, row_sum, rescale, LOG2E)
            if dropout is not None:
                probs = dropout.apply(xp, probs, p.heads_q, (row0, row1), (key0, key1))
            acc = acc * rescale[..., None] + weighted_values(xp, probs, s, v[..., key0:key1, :])
        inv_sum, lse = finalize(xp, row_max, row_sum, LOG2E)
        if dropout is not None:
            inv_sum = inv_sum * dropout.scale
        outs.append(acc * inv_sum[..., None])
        lses.append(lse)
    return xp.concat(outs, axis=-2), xp.concat(lses, axis=-1)


def fa2(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, block_m: int = 64, block_n: int = 64,
    dropout: Dropout | None = None, bias: LogitBias | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    return fa2_partial(
        xp, q, k, v, p, block_m=block_m, block_n=block_n, key_range=(0, p.seqlen_k), dropout=dropout, bias=bias
    )


def fa1_block_sizes(head_dim: int, sram_elements: int = DEFAULT_SRAM_ELEMENTS) -> tuple[int, int]:
    """(B_r, B_c) of FlashAttention-1: B_c = ceil(M / 4d), B_r = min(B_c, d) (d = 0 counts as 1)."""
    d = max(head_dim, 1)
    block_c = -(-sram_elements // (4 * d))
    return min(block_c, d), block_c


def fa1(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, sram_elements: int = DEFAULT_SRAM_ELEMENTS,
    bias: LogitBias | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """Algorithm 1 of FlashAttention: K/V blocks outer, Q blocks inner, O/l/m through "HBM"."""
    block_r, block_c = fa1_block_sizes(p.head_dim, sram_elements)
    row_starts = list(range(0, p.seqlen_q, block_r))
    dev = _device(q)
    # "HBM": O (normalised), l and m of every query block.
    o_hbm = [xp.zeros_like(q[..., r : min(r + block_r, p.seqlen_q), :]) for r in row_starts]
    l_hbm = [xp.zeros(o.shape[:-1], dtype=q.dtype, device=dev) for o in o_hbm]
    m_hbm = [xp.full(o.shape[:-1], -math.inf, dtype=q.dtype, device=dev) for o in o_hbm]
    for key0 in range(0, p.seqlen_k, block_c):  # outer: load K_j, V_j
        key1 = min(key0 + block_c, p.seqlen_k)
        k_blk, v_blk = k[..., key0:key1, :], v[..., key0:key1, :]
        for i, row0 in enumerate(row_starts):  # inner: load Q_i, O_i, l_i, m_i
            row1 = min(row0 + block_r, p.seqlen_q)
            mask = KeyMask(row0, row1 - 1, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
            if key1 <= mask.key_begin() or key0 >= mask.key_end():
                continue  # every key of the block hidden from every row of Q_i
            s = _logits(xp, q[..., row0:row1, :], k_blk, p, bias, (row0, row1), (key0, key1))
            if mask.needs_mask(key0, key1 - 1):
                s = mask.apply(xp, s, key0, key1 - 1)
            m_new, rescale = update_max(xp, m_hbm[i], s, LOG2E)
            probs, l_new = exp_accumulate(xp, s, m_new, l_hbm[i], rescale, LOG2E)
            # O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~_ij - m_new} P~_ij V_j)
            inv_l_new, _ = finalize(xp, m_new, l_new, LOG2E)
            weight_old = (l_hbm[i] * rescale * inv_l_new)[..., None]
            o_hbm[i] = o_hbm[i] * weight_old + weighted_values(xp, probs, s, v_blk) * inv_l_new[..., None]
            l_hbm[i], m_hbm[i] = l_new, m_new  # write back
    lse = [finalize(xp, m, row_sum, LOG2E)[1] for m, row_sum in zip(m_hbm, l_hbm)]
    return xp.concat(o_hbm, axis=-2), xp.concat(lse, axis=-1)


def decode(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, num_splits: int = 4, block_n: int = 64, split_keys: int = 0,
    bias: LogitBias | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """FlashDecoding: split the keys into chunks of ``split_keys`` keys (default: ``num_splits``
    chunks of whole key blocks), one FA2 partial (O_s, LSE_s) each, then merge them exactly."""
    chunk = split_keys
    if chunk <= 0:
        chunk = -(-max(p.seqlen_k, 1) // max(num_splits, 1))
        chunk = -(-chunk // block_n) * block_n  # whole key blocks per split, as the kernel
    outs, lses = [], []
    for key0 in range(0, max(p.seqlen_k, 1), chunk):
        o, lse = fa2_partial(xp, q, k, v, p, block_m=64, block_n=block_n, key_range=(key0, key0 + chunk), bias=bias)
        outs.append(o)
        lses.append(lse)
    return merge(xp, outs, lses)


# ---------------------------------------------------------------------------------------------
# KV cache (twin of decode.cu's decode_append and the cache addressing of decode_partial).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheLayout:
    """Where key ``j`` of sequence ``b`` lives: contiguous [entries, L, Hkv, d] (``pages`` None),
    entry ``entries[b]`` (cache_batch_idx; b without), or paged [num_pages, page_size, Hkv, d],
    page ``pages[b][j // page_size]``, slot ``j % page_size``."""

    pages: list[list[int]] | None
    page_size: int
    entries: list[int] | None = None

    def entry(self, b: int) -> int:
        return b if self.entries is None else self.entries[b]

    def slot(self, b: int, key: int) -> tuple[int, int]:
        if self.pages is None:
            return self.entry(b), key
        return self.pages[b][key // self.page_size], key % self.page_size

    def gather(self, xp: Any, cache: Any, b: int, n: int, first: int = 0) -> Any:
        """Keys first .. n - 1 of sequence b: [n - first, Hkv, d]."""
        if self.pages is None:
            return cache[self.entry(b), first:n, ...]
        used = self.pages[b][: -(-n // self.page_size)]
        if not used:
            return cache[0, :0, ...]
        return xp.concat([cache[page, ...] for page in used], axis=0)[first:n, ...]


def rotary(xp: Any, x: Any, cos: Any, sin: Any, positions: list[list[int]], interleaved: bool) -> Any:
    """Rotary embedding (twin of decode.cu's rotate_row): row n of sequence b of x (B, N, H, d)
    rotated at position positions[b][n], pair (a, b) = (2i, 2i + 1) when ``interleaved``, else
    (i, i + R), i < R = cos.shape[1], with c, s = cos[pos, i], sin[pos, i]:
    y_a = x_a c - x_b s, y_b = x_a s + x_b c; columns >= 2R unchanged. In x's dtype."""
    b, n, h, d = x.shape
    half = cos.shape[1]
    if b * n == 0:
        return x
    index = xp.asarray([p for row in positions for p in row], dtype=xp.int64, device=_device(x))
    c, s = (xp.reshape(xp.astype(xp.take(t, index, axis=0), x.dtype), (b, n, 1, half)) for t in (cos, sin))
    if interleaved:
        xa, xb = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    else:
        xa, xb = x[..., :half], x[..., half : 2 * half]
    ya, yb = xa * c - xb * s, xa * s + xb * c
    pairs = xp.stack((ya, yb), axis=-1) if interleaved else xp.stack((ya, yb), axis=-2)
    rotated = xp.reshape(pairs, (b, n, h, 2 * half))
    return xp.concat((rotated, x[..., 2 * half :]), axis=-1)


def append_kv(xp: Any, cache: Any, new: Any, seqlens: list[int], layout: CacheLayout) -> None:
    """Write new[b, t] at position seqlens[b] + t of sequence b's cache, in place."""
    for b, cached in enumerate(seqlens):
        for t in range(new.shape[1]):
            page, slot = layout.slot(b, cached + t)
            cache[page, slot, ...] = new[b, t, ...]


def attention_with_kvcache(
    xp: Any, q: Any, k_cache: Any, v_cache: Any, seqlens: list[int], layout: CacheLayout, p: Problem, split_keys: int,
    first_keys: list[int] | None = None, alibi_slopes: Any = None, sinks: Any = None, tree_mask: Any = None,
) -> tuple[Any, Any]:  # fmt: skip
    """Per sequence b: FlashDecoding of q[b] over its cached keys first_keys[b] .. seqlens[b] - 1
    (cache_leftpad; from 0 without; new tokens already appended), splits of ``split_keys`` keys
    as the kernel's; ALiBi slopes (Hq,) or (B, Hq); sinks (Hq,); ``tree_mask`` bool (Nq, Nq) or
    (B|1, Nq, Nq): the drafts each query token sees among the last Nq keys (``TreeMask``); returns
    (out like q, LSE [B, Hq, Nq])."""
    outs, lses = [], []
    for b, n in enumerate(seqlens):
        first = 0 if first_keys is None else first_keys[b]
        keys = [xp.expand_dims(layout.gather(xp, c, b, n, first), axis=0) for c in (k_cache, v_cache)]
        p_b = dataclasses.replace(p, batch=1, seqlen_k=n - first)
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.ndim == 1 else alibi_slopes[b : b + 1, ...]
        tree = None
        if tree_mask is not None:
            tree = TreeMask(tree_mask if tree_mask.ndim == 2 else tree_mask[b if tree_mask.shape[0] > 1 else 0, ...])
        out, lse = attention(
            xp, q[b : b + 1, ...], keys[0], keys[1], p_b, algorithm="decode", split_keys=split_keys,
            alibi_slopes=slopes, sinks=sinks, tree=tree,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    if not outs:  # an empty batch
        lse_shape = (0, p.heads_q, p.seqlen_q)
        return xp.zeros(q.shape, dtype=q.dtype, device=_device(q)), xp.zeros(
            lse_shape, dtype=compute_dtype(xp, q), device=_device(q)
        )
    return xp.concat(outs, axis=0), xp.concat(lses, axis=0)


def merge_states(xp: Any, o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Verb 4 on two states: o (B, N, H, d), lse (B, H, N) -> the state over both key sets:
    o in o_a's dtype, lse in the compute dtype (float64 if any input is, else float32)."""
    compute = compute_dtype(xp, o_a, lse_a, lse_b)
    outs = [xp.permute_dims(xp.astype(o, compute), (0, 2, 1, 3)) for o in (o_a, o_b)]
    lses = [xp.astype(lse, compute) for lse in (lse_a, lse_b)]
    out, lse = merge(xp, outs, lses)
    return xp.astype(xp.permute_dims(out, (0, 2, 1, 3)), o_a.dtype), lse


ALGORITHMS: dict[str, Callable[..., tuple[Any, Any]]] = {"naive": naive, "fa1": fa1, "fa2": fa2, "decode": decode}


def compute_dtype(xp: Any, *arrays: Any) -> Any:
    """float64 if any of ``arrays`` is float64, else float32: the arithmetic of the host path and
    the dtype of every LSE it returns (float32 or the input's dtype, whichever is wider), so that
    float64 states merge back to the whole to float64 precision."""
    return xp.float64 if any(x.dtype == xp.float64 for x in arrays) else xp.float32


def _per_head(xp: Any, values: Any, heads_kv: int, compute: Any) -> Any:
    """(Hq,) per-head values as (1, Hkv, group, 1), against (B, Hkv, group, N) rows."""
    return xp.reshape(xp.astype(values, compute), (1, heads_kv, -1, 1))


def _device(x: Any) -> Any:
    from array_api_compat import device

    return device(x)


def attention(
    xp: Any, q: Any, k: Any, v: Any, p: Problem, *, algorithm: str = "fa2", dropout: Dropout | None = None,
    alibi_slopes: Any = None, attn_mask: Any = None, score_mod: Mod | None = None, mask_mod: Mod | None = None,
    sinks: Any = None, tree: TreeMask | None = None, batch0: int = 0, **options: Any,
) -> tuple[Any, Any]:  # fmt: skip
    """Run one algorithm on caller arrays in ``p.layout``; returns (out in the caller's dtype and
    layout, LSE [B, Hq, Nq] in the compute dtype: float64 for float64 inputs, else float32).
    ``dropout``: naive and fa2 only. ``alibi_slopes``: (Hq,) or (B, Hq), every algorithm.
    ``attn_mask``: 4-D (B|1, Hq|1, Nq|1, Nk|1), boolean or additive (not with alibi_slopes).
    ``score_mod``, ``mask_mod``: traced (``_mods``), after ALiBi (not with attn_mask); they see
    b = ``batch0`` + the batch entry (``Mods.batch0``).
    ``sinks``: (Hq,) logits in every row's denominator (``add_sink``), every algorithm.
    ``tree``: a tree among the draft tokens (one sequence's; with none of the biases above, but
    with sinks)."""
    if dropout is not None:
        if algorithm not in ("naive", "fa2"):
            raise ValueError(f"dropout runs with the naive and fa2 algorithms, not {algorithm!r}")
        options["dropout"] = dropout
    compute = compute_dtype(xp, q)
    b, hkv, group = p.batch, p.heads_kv, p.heads_q // p.heads_kv
    if p.layout == "bshd":  # -> [B, H, N, d]
        q, k, v = (xp.permute_dims(x, (0, 2, 1, 3)) for x in (q, k, v))
    q5 = xp.reshape(xp.astype(q, compute), (b, hkv, group, p.seqlen_q, p.head_dim))
    if alibi_slopes is not None:
        options["bias"] = Alibi.of(xp, alibi_slopes, hkv, q5)
    if attn_mask is not None:
        options["bias"] = MaskBias.of(xp, attn_mask, hkv, q5)
    if score_mod is not None or mask_mod is not None:
        options["bias"] = Mods.of(xp, score_mod, mask_mod, options.get("bias"), q5, batch0)
    if tree is not None:
        options["bias"] = tree
    k5 = xp.expand_dims(xp.astype(k, compute), axis=2)
    v5 = xp.expand_dims(xp.astype(v, compute), axis=2)
    if p.seqlen_q == 0 or b == 0:
        out5, lse4 = xp.zeros_like(q5), xp.zeros(q5.shape[:-1], dtype=compute, device=_device(q5))
    else:
        out5, lse4 = ALGORITHMS[algorithm](xp, q5, k5, v5, p, **options)
    if sinks is not None:  # where the rows' final O and LSE are made, as the kernels' epilogues
        out5, lse4 = add_sink(xp, out5, lse4, _per_head(xp, sinks, hkv, compute))
    out = xp.reshape(out5, (b, p.heads_q, p.seqlen_q, p.head_dim))
    if p.layout == "bshd":
        out = xp.permute_dims(out, (0, 2, 1, 3))
    lse = xp.reshape(lse4, (b, p.heads_q, p.seqlen_q))
    return xp.astype(out, q.dtype), lse


def dropout_pattern(
    xp: Any, q: Any, k: Any, p: Problem, dropout: Dropout, block_n: int, alibi_slopes: Any = None
) -> Any:
    """flash-attn's ``S_dmask`` (what ``return_attn_probs=True`` returns with dropout), from the
    mask ``dropout`` regenerated: ``[B, Hq, Nq, Nk]`` in the compute dtype, element (i, j) =
    ``exp(s_ij - m_i)``, where ``m_i`` is row i's running max as FA2 meets the key blocks of
    ``block_n`` keys (last first: the max over block j's keys and those after it), negated where
    the mask drops the element. So the sign bit marks the dropped elements, and
    ``|S| * exp(m - LSE)`` is P (how flash-attn's tests decode it). Hidden keys give 0. The whole
    N x N matrix is made: O(Nq Nk) memory, for tests and inspection only."""
    compute = compute_dtype(xp, q)
    b, hkv, group = p.batch, p.heads_kv, p.heads_q // p.heads_kv
    if p.layout == "bshd":
        q, k = (xp.permute_dims(x, (0, 2, 1, 3)) for x in (q, k))
    q5 = xp.reshape(xp.astype(q, compute), (b, hkv, group, p.seqlen_q, p.head_dim))
    k5 = xp.expand_dims(xp.astype(k, compute), axis=2)
    bias = None if alibi_slopes is None else Alibi.of(xp, alibi_slopes, hkv, q5)
    mask = KeyMask(0, p.seqlen_q - 1, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
    s = mask.apply(xp, _logits(xp, q5, k5, p, bias, (0, p.seqlen_q), (0, p.seqlen_k)), 0, p.seqlen_k - 1)
    # -- each block's running max, as the kernel's key loop (last block first) has it
    row_max = xp.full(s.shape[:-1], -math.inf, dtype=compute, device=_device(s))
    blocks = []
    for key0 in reversed(range(0, p.seqlen_k, block_n)):
        s_blk = s[..., key0 : key0 + block_n]
        row_max = xp.maximum(row_max, xp.max(s_blk, axis=-1))
        blocks.append(_exp2(xp, (s_blk - _max_scaled(xp, row_max, 1.0)[..., None]) * LOG2E))
    probs = xp.concat(blocks[::-1], axis=-1) if blocks else s
    keep = dropout.keep(xp, probs, p.heads_q, (0, p.seqlen_q), (0, p.seqlen_k))
    return xp.reshape(xp.where(keep, probs, -probs), (b, p.heads_q, p.seqlen_q, p.seqlen_k))


# ---------------------------------------------------------------------------------------------
# The backward (FlashAttention-2's): key blocks outer, query blocks inner; P recomputed from Q,
# K and the saved LSE, so nothing of size N x N is kept. With D = rowsum(dO * O):
#   dV_j += P^T dO,  dP = dO V_j^T,  dS = P * (dP - D) (times the softcap's derivative),
#   dQ_i += scale * dS K_j (accumulated over j),  dK_j += scale * dS^T Q_i.
# ---------------------------------------------------------------------------------------------
def fa2_backward(
    xp: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, p: Problem, *, dlse: Any = None,
    block_m: int = 64, block_n: int = 64, dropout: Dropout | None = None, bias: LogitBias | None = None,
    captured: CapturedGradients | None = None,
) -> tuple[Any, Any, Any]:  # fmt: skip
    """(dQ, dK, dV) in the internal layout: q, dout, out [B, Hkv, G, Nq, d]; k, v [B, Hkv, 1, Nk, d];
    lse and dlse (the LSE's gradient, or None) [B, Hkv, G, Nq]. dK and dV are summed over the G
    query heads that read each KV head. With ``dropout`` (the forward's mask M regenerated,
    r = Dropout.scale): dV += (P M r)^T dO and dS = P (dP M r - D). ``captured``: where score_mod's
    captured arrays' gradients accumulate (from dS at score_mod's output)."""
    d_rows = xp.sum(dout * out, axis=-1)  # D_i = rowsum(dO_i * O_i)
    if dlse is not None:  # d LSE_i / d s_ij = P_ij: an LSE gradient enters dS = P (dP - D) as -D
        d_rows = d_rows - dlse
    dq_blocks = [xp.zeros_like(q[..., r : min(r + block_m, p.seqlen_q), :]) for r in range(0, p.seqlen_q, block_m)]
    dk_blocks, dv_blocks = [], []
    for key0 in range(0, p.seqlen_k, block_n):
        key1 = min(key0 + block_n, p.seqlen_k)
        k_blk, v_blk = k[..., key0:key1, :], v[..., key0:key1, :]
        dk = xp.zeros_like(xp.broadcast_to(k_blk, (*q.shape[:3], key1 - key0, p.head_dim)))
        dv = xp.zeros_like(dk)
        for index, row0 in enumerate(range(0, p.seqlen_q, block_m)):
            row1 = min(row0 + block_m, p.seqlen_q)
            mask = KeyMask(row0, row1 - 1, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right)
            if max(mask.key_begin(), key0) >= min(mask.key_end(), key1):
                continue  # no query of this block sees a key of this one
            q_blk, do_blk = q[..., row0:row1, :], dout[..., row0:row1, :]
            # -- P again, from the logits and the saved LSE (0 where masked, or the row is empty)
            capped = _logits(xp, q_blk, k_blk, p)  # the softcap's derivative reads it without the bias
            s = capped if bias is None else _biased(xp, capped, bias, p, (row0, row1), (key0, key1))
            if mask.needs_mask(key0, key1 - 1):
                s = mask.apply(xp, s, key0, key1 - 1)
            lse_blk = lse[..., row0:row1, None]
            visible = (s != -math.inf) & (lse_blk != -math.inf)  # NaN stays visible: NaN in, NaN out
            probs = xp.where(visible, xp.exp(xp.where(visible, s - lse_blk, xp.zeros_like(s))), xp.zeros_like(s))
            # -- dV, then dS = P * (dP - D), through the softcap: d(c tanh(z / c))/dz = 1 - (s / c)^2
            dp = do_blk @ xp.matrix_transpose(v_blk)
            kept = probs
            if dropout is not None:
                keep = dropout.keep(xp, probs, p.heads_q, (row0, row1), (key0, key1))
                zeros = xp.zeros_like(probs)
                kept, dp = xp.where(keep, probs * dropout.scale, zeros), xp.where(keep, dp * dropout.scale, zeros)
            dv = dv + xp.matrix_transpose(kept) @ do_blk
            ds = probs * (dp - d_rows[..., row0:row1, None])
            if captured is not None:
                captured.add(xp, xp.where(visible, ds, xp.zeros_like(ds)), capped, p, (row0, row1), (key0, key1))
            if isinstance(bias, Mods) and bias.score_mod is not None:  # through score_mod: its slope
                slope = bias.score_slope(xp, capped, p, (row0, row1), (key0, key1))
                ds = xp.where(visible, ds * slope, xp.zeros_like(ds))
            if p.softcap > 0:
                ds = xp.where(visible, ds * (1 - (capped / p.softcap) ** 2), xp.zeros_like(ds))
            ds = ds * p.scale
            dq_blocks[index] = dq_blocks[index] + ds @ k_blk
            dk = dk + xp.matrix_transpose(ds) @ q_blk
        dk_blocks.append(xp.sum(dk, axis=2, keepdims=True))
        dv_blocks.append(xp.sum(dv, axis=2, keepdims=True))
    dq = xp.concat(dq_blocks, axis=-2) if dq_blocks else xp.zeros_like(q)
    dk = xp.concat(dk_blocks, axis=-2) if dk_blocks else xp.zeros_like(k)
    dv = xp.concat(dv_blocks, axis=-2) if dv_blocks else xp.zeros_like(v)
    return dq, dk, dv


def attention_backward(
    xp: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, p: Problem, dlse: Any = None,
    dropout: Dropout | None = None, alibi_slopes: Any = None, attn_mask: Any = None, score_mod: Mod | None = None,
    mask_mod: Mod | None = None, sinks: Any = None, captured_grads: bool = False, block: int = 64, batch0: int = 0,
) -> tuple[Any, ...]:  # fmt: skip
    """The gradients of ``attention`` on caller arrays in ``p.layout``: (dq, dk, dv) in the
    inputs' dtype and layout, computed in float32 (float64 for float64 inputs). ``alibi_slopes``,
    ``attn_mask``, ``score_mod``, ``mask_mod``: the forward's (none gets a gradient). With
    ``sinks`` (Hq,) (whose weight ``lse`` holds), (dq, dk, dv, dsinks), dsinks in the compute
    dtype: the keys' gradients need nothing more, since P = exp(S - lse) already leaves the sink's
    share out. ``captured_grads``: one more result, the gradients of score_mod's captured arrays
    (``CapturedGradients.result``). ``block``: rows and keys per step (larger on a GPU's arrays,
    where each step is a launch per operation). ``batch0``: as ``attention``'s."""
    compute = compute_dtype(xp, q)
    b, hkv, group = p.batch, p.heads_kv, p.heads_q // p.heads_kv
    to_bhsd = (lambda x: xp.permute_dims(x, (0, 2, 1, 3))) if p.layout == "bshd" else (lambda x: x)
    q4, do4, o4, k4, v4 = (xp.astype(to_bhsd(x), compute) for x in (q, dout, out, k, v))
    q5, do5, o5 = (xp.reshape(x, (b, hkv, group, p.seqlen_q, p.head_dim)) for x in (q4, do4, o4))
    k5, v5 = xp.expand_dims(k4, axis=2), xp.expand_dims(v4, axis=2)
    lse4, dlse4 = (
        None if x is None else xp.reshape(xp.astype(x, compute), (b, hkv, group, p.seqlen_q)) for x in (lse, dlse)
    )
    bias: LogitBias | None = None
    if alibi_slopes is not None:
        bias = Alibi.of(xp, alibi_slopes, hkv, q5)
    if attn_mask is not None:
        bias = MaskBias.of(xp, attn_mask, hkv, q5)
    if score_mod is not None or mask_mod is not None:
        bias = Mods.of(xp, score_mod, mask_mod, bias if isinstance(bias, Alibi) else None, q5, batch0)
    captured = None
    if captured_grads:
        if not isinstance(bias, Mods) or bias.score_mod is None:
            raise ValueError("captured_grads=True needs a score_mod: its captured arrays are what get gradients")
        captured = CapturedGradients(xp, bias, compute)
    dq5, dk5, dv5 = fa2_backward(
        xp, do5, q5, k5, v5, o5, lse4, p, dlse=dlse4, dropout=dropout, bias=bias, captured=captured, block_m=block,
        block_n=block,
    )  # fmt: skip
    dq = to_bhsd(xp.reshape(dq5, (b, p.heads_q, p.seqlen_q, p.head_dim)))
    dk, dv = (to_bhsd(x[:, :, 0, ...]) for x in (dk5, dv5))
    grads: tuple[Any, ...] = (xp.astype(dq, q.dtype), xp.astype(dk, k.dtype), xp.astype(dv, v.dtype))
    if sinks is not None:
        dsum = xp.sum(do5 * o5, axis=-1) - (0.0 if dlse4 is None else dlse4)
        rows = sink_gradient(xp, lse4, dsum, _per_head(xp, sinks, hkv, compute))
        grads = (*grads, xp.reshape(xp.sum(rows, axis=(0, 3)), (p.heads_q,)))
    return grads if captured is None else (*grads, captured.result(xp))
