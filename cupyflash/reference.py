"""The oracle: float64 naive attention on the host, written directly from the definition.

``out = softmax(scale * q @ k^T + mask) @ v`` with the mask rule of DESIGN.md applied from the
raw ``causal``/``window`` arguments (not from the normalised bounds the kernels use) or from a
speculative-decoding tree among the last Nq keys (``tree_mask``), softcap
``s -> softcap * tanh(s / softcap)``, bottom-right causal alignment, GQA by head grouping.
Rows that see no key give 0 and LSE -inf. Every test compares against this.

Non-finite inputs follow IEEE arithmetic on that definition, row by row:

* a row with a NaN or +inf score among its visible keys (NaN in its query or in a key it sees,
  inf * 0, inf - inf) has no defined softmax: its output and its LSE are NaN;
* a visible score of -inf weighs 0, as a hidden key; a row whose visible scores are all -inf
  (or that sees no key) gives 0 and LSE -inf;
* a NaN value gives NaN in the output columns of every row that gives its key a score above
  -inf, and nowhere else; +-inf values give +-inf there (NaN where the weight underflows to 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._validate import attention_problem


def to_numpy64(x: Any) -> np.ndarray:
    """Copy any array (NumPy, CuPy, PyTorch, JAX, array-API, DLPack) to a float64 NumPy array."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        return x.get().astype(np.float64)
    if module == "torch":
        return np.asarray(x.detach().to(dtype=__import__("torch").float64).cpu().numpy())
    try:
        return np.asarray(x).astype(np.float64)
    except Exception:  # array_api_strict and other DLPack-only arrays on the host
        return np.from_dlpack(x).astype(np.float64)


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> np.ndarray:
    """Boolean [seqlen_q, seqlen_k]: query i sees key j (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    shift = seqlen_k - seqlen_q
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        ok &= j <= i + shift + right
    if left >= 0:
        ok &= j >= i + shift - left
    return ok


def tree_visible_keys(seqlen_k: int, tree_mask: np.ndarray) -> np.ndarray:
    """Boolean [..., Nq, seqlen_k] of a tree mask [..., Nq, Nq] among the drafts: the Nq queries
    are the last Nq keys; query i sees key j < seqlen_k - Nq (before the drafts), and key j after
    that iff tree_mask[..., i, j - (seqlen_k - Nq)] (with seqlen_k < Nq, only the last seqlen_k
    drafts exist as keys)."""
    tree = np.asarray(tree_mask, dtype=bool)
    nq = tree.shape[-1]
    prefix = np.ones((*tree.shape[:-1], max(seqlen_k - nq, 0)), dtype=bool)
    return np.concatenate([prefix, tree[..., max(nq - seqlen_k, 0) :]], axis=-1)


def _weighted_values(e: np.ndarray, contributes: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``e @ v`` summed over the keys that contribute to each row (visible, score > -inf) only,
    in IEEE arithmetic: a NaN value gives NaN in every row it contributes to, +-inf gives +-inf
    (NaN where its weight is 0 or both signs meet), and a key that does not contribute adds
    nothing, where the plain product would add 0 * NaN = NaN to every row."""
    finite = np.isfinite(v)
    out = e @ np.where(finite, v, 0.0)
    if finite.all():
        return out
    hits = lambda rows, values: (rows.astype(np.float64) @ values.astype(np.float64)) > 0  # noqa: E731
    weighted = contributes & (e > 0)
    nan = hits(contributes, np.isnan(v)) | hits(contributes & (e == 0), np.isinf(v))
    pos, neg = hits(weighted, v == np.inf), hits(weighted, v == -np.inf)
    out = np.where(pos, np.inf, np.where(neg, -np.inf, out))
    return np.where(nan | (pos & neg), np.nan, out)


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    layout: str = "bshd",
    return_lse: bool = False,
    sinks: Any = None,
    tree_mask: Any = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """float64 attention; returns NumPy arrays (out in ``layout``, LSE ``[B, Hq, Nq]``).
    ``sinks`` (Hq,): gpt-oss's learnable sinks, one more score per row, always visible, whose
    value is 0 (a key column of the sink logit against a zero value row).
    ``tree_mask``: bool (Nq, Nq) or (B, Nq, Nq), the drafts each query sees among the last Nq keys
    (``tree_visible_keys``); it replaces ``causal``, and takes no window."""
    if tree_mask is not None and tuple(window) != (-1, -1):
        raise ValueError("a tree mask takes no window")
    q64, k64, v64 = (to_numpy64(x) for x in (q, k, v))
    p = attention_problem(
        q64.shape, k64.shape, v64.shape, causal=causal, scale=scale, window=window, softcap=softcap, layout=layout
    )
    if layout == "bshd":  # -> [B, H, N, d]
        q64, k64, v64 = (x.transpose(0, 2, 1, 3) for x in (q64, k64, v64))
    group = p.heads_q // p.heads_kv
    k64 = np.repeat(k64, group, axis=1)
    v64 = np.repeat(v64, group, axis=1)

    with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs follow IEEE (see above)
        s = p.scale * (q64 @ k64.transpose(0, 1, 3, 2))
        if p.softcap > 0:
            s = p.softcap * np.tanh(s / p.softcap)
        if tree_mask is None:
            visible = visible_keys(p.seqlen_q, p.seqlen_k, causal, (window[0], window[1]))
        else:  # [B or 1, 1, Nq, Nk]: one tree per sequence, the same for every head
            tree = to_numpy64(tree_mask) != 0
            visible = tree_visible_keys(p.seqlen_k, tree.reshape(-1, 1, p.seqlen_q, p.seqlen_q))
        s = np.where(visible, s, -np.inf)
        if sinks is not None:
            column = np.broadcast_to(to_numpy64(sinks)[None, :, None, None], (*s.shape[:3], 1))
            s = np.concatenate([s, column], axis=-1)
            v64 = np.concatenate([v64, np.zeros((*v64.shape[:2], 1, v64.shape[3]))], axis=2)
        m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # NaN if any visible score is NaN
        undefined = np.isnan(m) | (m == np.inf)  # a NaN or +inf score: no softmax
        m_finite = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(np.where(undefined, -np.inf, s) - m_finite)
        row_sum = e.sum(axis=-1, keepdims=True)
        safe_sum = np.where(row_sum > 0, row_sum, 1.0)
        out = np.where(undefined, np.nan, _weighted_values(e, s > -np.inf, v64) / safe_sum)
        lse = np.where(undefined, np.nan, np.where(row_sum > 0, np.log(safe_sum) + m_finite, -np.inf))[..., 0]
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return (out, lse) if return_lse else out
