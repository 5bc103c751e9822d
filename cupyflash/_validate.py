"""Input checks and their error messages, and the normalised description of one call.

Nothing here touches array data: only shapes, dtypes and options, so a rejected call never
launches, writes or loses anything.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

LAYOUTS = ("bshd", "bhsd")
VARLEN_LAYOUT = "thd"  # packed sequences: (total_tokens, heads, head_dim)

# What ``algorithm=`` accepts, per entry point. "auto": the Hopper kernel where it applies, else
# FA2, and the split-KV decode kernel for one-token queries; "fa2": the mma.sync kernel; "fa3": the
# Hopper kernel (wgmma + TMA); "decode": the split-KV decode kernel (FlashDecoding); "fa1" and
# "naive": the baselines of docs/io_analysis.md. On the host every one runs ``xp_impl``.
ALGORITHMS = {
    "attention": ("auto", "fa2", "fa3", "decode", "fa1", "naive"),
    "attention_varlen": ("auto", "fa2", "fa3"),
}

# Scalars users pass: Python's, and NumPy's (np.True_, np.float32(0.125) ...). Checked before any
# cache lookup, so an option is accepted or refused the same way whatever ran before.
_BOOLS = (bool, np.bool_)


def check_flag(name: str, value: Any) -> bool:
    """A bool option (a NumPy bool too); anything else is an error, not a truth value."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r}")


def check_causal(causal: Any) -> bool:
    return check_flag("causal", causal)


class Options(NamedTuple):
    """The score and mask options of a call, checked once at its entry and in one canonical form
    (Python scalars, the window a tuple of ints): what every route below the public functions
    takes, read by name (the planners read them through the ``Problem`` built from them).
    ``scale`` None is the default ``1 / sqrt(head_dim)``, resolved where the head dim is known.
    Immutable and hashed in C: it is part of every plan key (a frozen dataclass cost a decode
    step 0.5 us to build and hash)."""

    causal: bool = False
    scale: float | None = None
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0


def check_options(causal: Any, scale: Any, window: Any, softcap: Any) -> Options:
    """The options of every entry point, checked, before anything is looked up by them. Python's
    own values pass on type checks written inline (a call to a checker each cost a call ~40 ns);
    the options of most calls (a default scale, no window, no softcap) are one of two prebuilt
    objects (building an Options cost ~70 ns more), found first where the window is the public
    functions' default object itself (``NO_WINDOW``: its four type checks cost ~45 ns)."""
    if window is NO_WINDOW and scale is None and type(softcap) is float and not softcap:
        if causal is True or causal is False:
            return _PLAIN[causal]
    if causal is not True and causal is not False:
        causal = check_causal(causal)
    if scale is not None and type(scale) is not float:
        scale = _real("scale", scale)
    if type(window) is not tuple or len(window) != 2 or type(window[0]) is not int or type(window[1]) is not int:
        window = check_window(window)
    if type(softcap) is not float:
        softcap = _real("softcap", softcap)
    if scale is None and not softcap and window == NO_WINDOW:
        return _PLAIN[causal]
    return _new_options(Options, (causal, scale, window, softcap))  # Options(...) without its defaults' cost


_new_options = tuple.__new__
NO_WINDOW = (-1, -1)  # no window: the public functions' default (the same object)
_PLAIN = {False: Options(False), True: Options(True)}  # the options of a plain call, by causal


_REAL_MESSAGES = {
    "scale": "scale must be a finite real number",
    "softcap": "softcap must be a finite number >= 0 (0 disables it)",
}


def check_scale_option(scale: Any) -> float | None:
    """``scale`` as a Python float (None: the default 1 / sqrt(d), resolved with the head dim)."""
    if scale is None or type(scale) is float:
        return scale
    return _real("scale", scale)


def _real(name: str, value: Any) -> float:
    if isinstance(value, _BOOLS) or not isinstance(value, numbers.Real):
        raise ValueError(f"{_REAL_MESSAGES[name]}, got {value!r}")
    return float(value)


def check_window(window: Any) -> tuple[int, int]:
    """``window`` as a pair of Python ints. A bound may be an int, a NumPy integer, or a 0-d
    integer array of any library (a NumPy array, a PyTorch tensor: flash-attn's tests and some
    of its callers pass them, and its C++ entry takes them as ints); bools and non-integers are
    refused. A 0-d tensor on a GPU is read back to the host (a device synchronisation)."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}") from None
    return _bound(left, window), _bound(right, window)


def _bound(bound: Any, window: Any) -> int:
    if type(bound) is int:
        return bound
    if not isinstance(bound, _BOOLS) and isinstance(bound, numbers.Integral):
        return int(bound)
    # A 0-d integer array: its __index__ gives the int (a float or bool one is refused below).
    array: Any = bound
    if getattr(array, "shape", None) == () and "bool" not in str(getattr(array, "dtype", "bool")):
        try:
            return operator.index(array)
        except TypeError:
            pass
    raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}")


# round(p * 65536) must stay below 65536 (xp_impl.Dropout.threshold).
MAX_DROPOUT_P = 1.0 - 2.0**-17


def check_dropout(dropout_p: Any, seed: Any) -> tuple[float, int | None]:
    """``dropout_p`` as a float in [0, 1) and ``seed`` as None or an int in [0, 2^64)."""
    if type(dropout_p) is not float or not 0.0 <= dropout_p < MAX_DROPOUT_P:
        if isinstance(dropout_p, _BOOLS) or not isinstance(dropout_p, numbers.Real) or not 0 <= float(dropout_p) < 1:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
        dropout_p = float(dropout_p)
        if dropout_p >= MAX_DROPOUT_P:
            raise ValueError(f"dropout_p must be below 1 - 2^-17 (the mask's 16-bit draws keep 1 in 65536 at the "
                             f"least), got {dropout_p!r}")  # fmt: skip
    if seed is not None:
        if isinstance(seed, _BOOLS) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**64:
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
        seed = int(seed)
    return dropout_p, seed


ALIBI_NONE, ALIBI_HEAD, ALIBI_BATCH_HEAD = "none", "head", "batch_head"


def check_alibi(slopes: Any, batch: int, heads_q: int) -> str:
    """The kind of ``alibi_slopes``: flash-attn's (Hq,) or (B, Hq), or none."""
    if slopes is None:
        return ALIBI_NONE
    shape = tuple(getattr(slopes, "shape", ()))
    if shape == (heads_q,):
        return ALIBI_HEAD
    if shape == (batch, heads_q):
        return ALIBI_BATCH_HEAD
    raise ValueError(f"alibi_slopes must have shape (nheads,) = ({heads_q},) or (batch, nheads) = "
                     f"({batch}, {heads_q}), got {shape}")  # fmt: skip


def check_sinks(sinks: Any, heads_q: int) -> bool:
    """Learnable attention sinks (gpt-oss's): one logit per query head, shape (Hq,); True where given."""
    if sinks is None:
        return False
    shape = tuple(getattr(sinks, "shape", ()))
    if shape != (heads_q,):
        raise ValueError(f"sinks must have shape (nheads,) = ({heads_q},): one logit per query head, got {shape}")
    return True


def check_attn_mask(shape: tuple[int, ...], is_bool: bool, p: Problem) -> tuple[str, tuple[int, int, int, int]]:
    """SDPA's attn_mask: 2-D to 4-D, broadcastable to (B, Hq, Nq, Nk) with each axis full or 1
    (the missing leading axes are 1); boolean (True: the key takes part) or additive. Returns
    its kind and 4-D shape."""
    shape = tuple(shape)
    if not 2 <= len(shape) <= 4:
        raise ValueError(f"attn_mask must have 2 to 4 dims, (B|1, Hq|1, Nq|1, Nk|1) from the right, got shape {shape}")
    full = (1,) * (4 - len(shape)) + shape
    want = (p.batch, p.heads_q, p.seqlen_q, p.seqlen_k)
    if any(n not in (1, w) for n, w in zip(full, want)):
        raise ValueError(f"attn_mask of shape {shape} does not broadcast to (B, Hq, Nq, Nk) = {want} axis by axis")
    if p.softcap > 0 or p.alibi != ALIBI_NONE:
        raise ValueError("attn_mask does not combine with softcap or alibi_slopes yet")
    b, h, nq, nk = full
    return ("bool" if is_bool else "additive"), (b, h, nq, nk)


def check_algorithm(entry: str, algorithm: Any) -> str:
    allowed = ALGORITHMS[entry]
    if type(algorithm) is not str or algorithm not in allowed:
        raise ValueError(f"{entry}: algorithm must be one of {allowed}, got {algorithm!r}")
    return algorithm


@dataclass(frozen=True, slots=True)
class Problem:
    """One attention call, normalised. Window bounds: -1 = unbounded (see normalize_window)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    layout: str
    scale: float
    softcap: float
    window_left: int
    window_right: int
    dropout_p: float = 0.0  # checked by check_dropout
    alibi: str = ALIBI_NONE  # ALiBi slopes: none, (Hq,) "head", or (B, Hq) "batch_head"
    seqused_k: bool = False  # packed: a per-sequence count of the keys used (flash-attn's seqused_k)
    page_size: int = 0  # packed over a paged cache (attention_varlen's block_table): keys per page; 0 without
    mask: str = ""  # an attn_mask: "" none, "additive", "bool"
    mask_shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # its 4-D shape (B|1, Hq|1, Nq|1, Nk|1)
    sinks: bool = False  # learnable sinks (Hq,): a logit per head in every row's softmax denominator

    @property
    def causal_bound(self) -> bool:
        """The variant needs the right (causal) bound."""
        return self.window_right >= 0

    @property
    def local_bound(self) -> bool:
        """The variant needs the left (sliding-window) bound."""
        return self.window_left >= 0


def split_dims(shape: tuple[int, ...], layout: str) -> tuple[int, int, int, int]:
    """(batch, seqlen, heads, head_dim) of a 4-D shape in ``layout``."""
    if layout == "bshd":
        b, s, h, d = shape
    else:
        b, h, s, d = shape
    return b, s, h, d


def normalize_window(causal: bool, window: Any, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """(window_left, window_right) with -1 for "no bound", bounds that hide nothing dropped.

    Query i sees key j iff i + shift - left <= j <= i + shift + right, shift = seqlen_k - seqlen_q.
    A right bound >= seqlen_q - 1 hides no key (the last query sees up to key seqlen_k - 1), and a
    left bound >= seqlen_k - 1 hides none either: both become -1, so e.g. one query token with
    causal=True runs the unmasked variant.
    """
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}") from None
    left, right = check_window(window)
    if left < -1 or right < -1:
        raise ValueError(f"window must be a pair (left, right) of ints >= -1, got {window!r}")
    if causal:  # flash-attn's rule: causal sets the right bound to 0, whatever the window says
        right = 0
    if right >= seqlen_q - 1:
        right = -1
    if left >= seqlen_k - 1:
        left = -1
    return left, right


def check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, _BOOLS) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite real number, got {scale!r}")
    return float(scale)


def check_softcap(softcap: Any) -> float:
    if (
        isinstance(softcap, _BOOLS)
        or not isinstance(softcap, numbers.Real)
        or not math.isfinite(softcap)
        or softcap < 0
    ):
        raise ValueError(f"softcap must be a finite number >= 0 (0 disables it), got {softcap!r}")
    return float(softcap)


def attention_problem(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    *,
    causal: bool,
    scale: Any,
    window: Any,
    softcap: Any,
    layout: str,
    dropout_p: float = 0.0,
) -> Problem:
    """Check the shapes and options of ``attention`` and normalise them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            axes = "(batch, seqlen, heads, head_dim)" if layout == "bshd" else "(batch, heads, seqlen, head_dim)"
            raise ValueError(f"{name} must be 4-D {axes} for layout={layout!r}, got shape {tuple(shape)}")
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    b, sq, hq, d = split_dims(tuple(q_shape), layout)
    bk, sk, hk, dk = split_dims(tuple(k_shape), layout)
    if bk != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {bk}")
    if dk != d:
        raise ValueError(f"q and k must have the same head_dim, got {d} and {dk}")
    if hk == 0 or hq % hk:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of key/value heads ({hk})")
    causal = check_causal(causal)
    left, right = normalize_window(causal, window, sq, sk)
    return Problem(
        batch=b,
        seqlen_q=sq,
        seqlen_k=sk,
        heads_q=hq,
        heads_kv=hk,
        head_dim=d,
        layout=layout,
        scale=check_scale(scale, d),
        softcap=check_softcap(softcap),
        window_left=left,
        window_right=right,
        dropout_p=dropout_p,
    )


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def varlen_problem(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    v_shape: tuple[int, ...],
    cu_seqlens_q_shape: tuple[int, ...],
    cu_seqlens_k_shape: tuple[int, ...],
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    *,
    causal: bool,
    scale: Any,
    window: Any,
    softcap: Any,
    dropout_p: float = 0.0,
    seqused_k_shape: tuple[int, ...] | None = None,
    block_table_shape: tuple[int, ...] | None = None,
) -> Problem:
    """Check ``attention_varlen``'s arguments. The Problem's seqlens are the maxima: they size
    the grid and nothing else. The mask bounds are kept whatever the maxima say (a bound the
    maxima would call "hides nothing" is kept), so an understated max_seqlen can never drop
    the causal mask or the window. With ``block_table_shape`` (B, max_pages), k and v are pages
    ``(num_pages, page_size, Hkv, d)`` and cu_seqlens_k gives each sequence's key count."""
    if len(q_shape) != 3:
        raise ValueError(f"q must be 3-D (total_tokens, heads, head_dim) for attention_varlen, got shape {q_shape}")
    paged = block_table_shape is not None
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if paged and len(shape) != 4:
            raise ValueError(
                f"{name} must be 4-D pages (num_pages, page_size, heads_kv, head_dim) with a block_table, "
                f"got shape {tuple(shape)}"
            )
        if not paged and len(shape) != 3:
            raise ValueError(
                f"{name} must be 3-D (total_tokens, heads, head_dim) for attention_varlen, got shape {tuple(shape)}"
            )
    if tuple(k_shape) != tuple(v_shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k_shape)} and {tuple(v_shape)}")
    for name, shape in (("cu_seqlens_q", cu_seqlens_q_shape), ("cu_seqlens_k", cu_seqlens_k_shape)):
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(shape)}")
    if cu_seqlens_q_shape[0] != cu_seqlens_k_shape[0]:
        lengths = (cu_seqlens_q_shape[0], cu_seqlens_k_shape[0])
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got {lengths}")
    total_q, hq, d = q_shape
    page_size = 0
    if paged:
        assert block_table_shape is not None
        num_pages, page_size, hk, dk = k_shape
        total_k = check_pages(block_table_shape, cu_seqlens_q_shape[0] - 1, num_pages, page_size, "k")
    else:
        total_k, hk, dk = k_shape
    max_q = _check_count("max_seqlen_q", max_seqlen_q)
    max_k = _check_count("max_seqlen_k", max_seqlen_k)
    if max_q > total_q or max_k > total_k:
        what = "the packed query length and a block_table row's keys" if paged else "the packed lengths"
        raise ValueError(f"max_seqlen_q/k ({max_q}, {max_k}) exceed {what} ({total_q}, {total_k})")
    dense = attention_problem(
        (1, max_q, hq, d), (1, max_k, hk, dk), (1, max_k, hk, dk),
        causal=causal, scale=scale, window=window, softcap=softcap, layout="bshd", dropout_p=dropout_p,
    )  # fmt: skip
    left, right = normalize_window(check_causal(causal), window, _UNBOUNDED, _UNBOUNDED)
    batch = cu_seqlens_q_shape[0] - 1
    if seqused_k_shape is not None and tuple(seqused_k_shape) != (batch,):
        raise ValueError(f"seqused_k must be 1-D of length batch = {batch}, got shape {tuple(seqused_k_shape)}")
    if paged and dropout_p:
        raise ValueError("dropout over a paged cache (block_table) is not supported")
    return dataclasses.replace(
        dense, batch=batch, layout=VARLEN_LAYOUT, window_left=left, window_right=right,
        seqused_k=seqused_k_shape is not None, page_size=page_size,
    )  # fmt: skip


# A length no sequence reaches: normalize_window then drops no bound.
_UNBOUNDED = 2**31 - 1


def check_cu_seqlens_values(cu_q: Any, cu_k: Any, total_q: int, total_k: int | None, max_q: int, max_k: int) -> None:
    """Host-side check of cu_seqlens contents (only where they already live on the host: on the
    GPU this would cost a device synchronisation per call). ``total_k`` None: keys in pages (a
    block_table), whose offsets are counts only."""
    for name, cu, total, longest in (("cu_seqlens_q", cu_q, total_q, max_q), ("cu_seqlens_k", cu_k, total_k, max_k)):
        values = [int(x) for x in cu]
        past_end = total is not None and values[-1] > total
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or past_end:
            end = "" if total is None else f" and end at most at {total}"
            raise ValueError(f"{name} must start at 0 and never decrease{end}, got {values}")
        if any(b - a > longest for a, b in zip(values, values[1:])):
            raise ValueError(f"{name} has a sequence longer than its max_seqlen ({longest}): {values}")


def check_seqused_values(cu_k: list[int], seqused_k: list[int] | None) -> list[int]:
    """Each packed sequence's end of used keys: ``cu_k[b + 1]``, or ``cu_k[b] + seqused_k[b]``
    with ``seqused_k[b]`` checked to lie in 0 .. the sequence's key count (host values: on the GPU
    the kernels check it)."""
    starts, ends = cu_k[:-1], cu_k[1:]
    if seqused_k is None:
        return list(ends)
    counts = [e - s for s, e in zip(starts, ends)]
    if any(not 0 <= n <= c for n, c in zip(seqused_k, counts)):
        raise ValueError(f"seqused_k must lie in 0 .. each sequence's key count {counts}, got {seqused_k}")
    return [s + n for s, n in zip(starts, seqused_k)]


def check_paged_keys(pages: list[list[int]], counts: list[int], num_pages: int, page_size: int) -> None:
    """Packed sequences over pages (``attention_varlen``'s block_table, host values): each key
    count within its table row, and every page the count reaches (the first ``ceil(count /
    page_size)`` of the row) among the cache's ``num_pages``."""
    for b, (row, count) in enumerate(zip(pages, counts)):
        if count > len(row) * page_size:
            raise ValueError(
                f"sequence {b} has {count} keys (cu_seqlens_k / seqused_k), beyond its block_table row ({len(row)} "
                f"pages of {page_size})"
            )
        bad = [x for x in row[: -(-count // page_size)] if not 0 <= x < num_pages]
        if bad:
            raise ValueError(f"block_table[{b}] points outside the {num_pages} pages of the cache: {bad}")


@dataclass(frozen=True, slots=True)
class KvCacheProblem:
    """One ``attention_with_kvcache`` call, normalised. ``attn.seqlen_k`` is the capacity."""

    attn: Problem
    paged: bool
    page_size: int  # paged: tokens per page (a power of two); contiguous: the capacity
    num_pages: int  # paged: pages in the cache; contiguous: its entries (first axis)
    capacity: int  # keys one sequence can hold: L_max, or max_pages * page_size
    seqlen_new: int  # tokens appended (k_new / v_new), 0 without
    batch_idx: bool = False  # contiguous: sequence b uses cache entry cache_batch_idx[b] (else b)
    leftpad: bool = False  # contiguous: sequence b's keys start at cache_leftpad[b] (else 0)
    rotary_half: int = 0  # rotary embedding: rotary_dim / 2 (rotary_cos.shape[1]); 0 without
    rotary_interleaved: bool = False  # pairs (2i, 2i + 1), else (i, i + rotary_half)
    rotary_q_per_token: bool = False  # query token i at cache_seqlens + i (causal or a window), else + 0
    rotary_rows: int = 0  # rotary_cos's positions (seqlen_ro)
    tree_mask_shape: tuple[int, ...] | None = None  # a tree mask among the draft tokens (check_tree_mask)

    @property
    def page_size_log2(self) -> int:
        return self.page_size.bit_length() - 1 if self.paged else 0

    @property
    def rotary_max_cached(self) -> int:
        """The largest cache_seqlens value whose rotated keys and queries stay inside rotary_cos:
        k_new row t sits at cache_seqlens + t, query i at cache_seqlens + i per token (else + 0)."""
        reach = max(self.seqlen_new, self.attn.seqlen_q if self.rotary_q_per_token else 1)
        return self.rotary_rows - reach

    @property
    def tree(self) -> bool:
        """A tree mask among the draft tokens (``attn`` then has no causal or window bound)."""
        return self.tree_mask_shape is not None


def check_pages(table_shape: tuple[int, ...], batch: int, num_pages: int, page_size: int, cache: str) -> int:
    """A block table (batch, max_pages) over ``num_pages`` pages of ``page_size`` (a power of two)
    keys; returns the keys one sequence's row can hold."""
    if len(table_shape) != 2 or table_shape[0] != batch:
        raise ValueError(f"block_table must be 2-D (batch={batch}, max_pages), got shape {table_shape}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} ({cache}.shape[1]) is not supported: it must be a power of two >= 1")
    if num_pages < 1:
        raise ValueError("a paged cache needs at least one page")
    return table_shape[1] * page_size


def check_int_seqlens(cache_seqlens: int, capacity: int, seqlen_new: int) -> None:
    """An int ``cache_seqlens`` (one length for every sequence) leaves room for the new tokens."""
    if isinstance(cache_seqlens, bool) or not 0 <= cache_seqlens <= capacity - seqlen_new:
        raise ValueError(
            f"cache_seqlens={cache_seqlens} with {seqlen_new} new tokens goes beyond the cache "
            f"({capacity} tokens per sequence)"
        )


def kvcache_problem(
    q_shape: tuple[int, ...],
    k_cache_shape: tuple[int, ...],
    v_cache_shape: tuple[int, ...],
    *,
    cache_seqlens: Any,
    block_table_shape: tuple[int, ...] | None,
    k_new_shape: tuple[int, ...] | None,
    v_new_shape: tuple[int, ...] | None,
    causal: Any,
    scale: Any,
    cache_batch_idx_shape: tuple[int, ...] | None = None,
    cache_leftpad_shape: tuple[int, ...] | None = None,
    window: Any = (-1, -1),
    softcap: Any = 0.0,
    rotary_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    rotary_interleaved: Any = True,
    tree_mask_shape: tuple[int, ...] | None = None,
) -> KvCacheProblem:
    """Check the shapes and options of ``attention_with_kvcache`` (and an int ``cache_seqlens``
    against the capacity); array values are checked by the caller where they are on the host.
    ``rotary_shapes``: those of rotary_cos and rotary_sin, (seqlen_ro, rotary_dim / 2) each;
    ``tree_mask_shape``: that of a tree mask among the draft tokens (``check_tree_mask``)."""
    if len(q_shape) != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, heads, head_dim), got shape {tuple(q_shape)}")
    if len(k_cache_shape) != 4:
        raise ValueError(
            "k_cache must be 4-D: (batch, max_seqlen, heads_kv, head_dim), or (num_pages, page_size, heads_kv, "
            f"head_dim) with a block_table, got shape {tuple(k_cache_shape)}"
        )
    if tuple(k_cache_shape) != tuple(v_cache_shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {k_cache_shape} and {v_cache_shape}")
    batch = q_shape[0]
    first, rows, heads_kv, head_dim = k_cache_shape
    paged = block_table_shape is not None
    if paged:
        assert block_table_shape is not None
        capacity, num_pages = check_pages(block_table_shape, batch, first, rows, "k_cache"), first
    else:
        if cache_batch_idx_shape is None and first != batch:
            raise ValueError(f"k_cache must have the batch size of q ({batch}), got {first} (shape {k_cache_shape})")
        if first < 1 and batch > 0:
            raise ValueError("a cache needs at least one entry")
        capacity, num_pages = rows, first
    for name, shape in (("cache_batch_idx", cache_batch_idx_shape), ("cache_leftpad", cache_leftpad_shape)):
        if shape is None:
            continue
        if paged:
            raise ValueError(f"{name} is for contiguous caches: with a block_table the table places each sequence")
        if tuple(shape) != (batch,):
            raise ValueError(f"{name} must be a 1-D int32 array of length {batch}, got shape {tuple(shape)}")
    seqlen_new = 0
    if (k_new_shape is None) != (v_new_shape is None):
        raise ValueError("k_new and v_new go together: give both or neither")
    if k_new_shape is not None:
        if tuple(k_new_shape) != tuple(v_new_shape or ()):
            raise ValueError(f"k_new and v_new must have the same shape, got {k_new_shape} and {v_new_shape}")
        if len(k_new_shape) != 4 or (k_new_shape[0], k_new_shape[2], k_new_shape[3]) != (batch, heads_kv, head_dim):
            raise ValueError(
                f"k_new must be (batch={batch}, seqlen_new, heads_kv={heads_kv}, head_dim={head_dim}), "
                f"got {tuple(k_new_shape)}"
            )
        seqlen_new = k_new_shape[1]
        if seqlen_new > capacity:
            raise ValueError(f"{seqlen_new} new tokens do not fit in a cache of {capacity} tokens per sequence")
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        shape = tuple(getattr(cache_seqlens, "shape", ()))
        if shape != (batch,):
            raise ValueError(f"cache_seqlens must be an int or a 1-D int32 array of length {batch}, got shape {shape}")
    else:
        check_int_seqlens(cache_seqlens, capacity, seqlen_new)
    if tree_mask_shape is not None:  # the tree replaces the causal rule among the drafts
        tree_mask_shape = tuple(tree_mask_shape)
        check_tree_mask(tree_mask_shape, batch, q_shape[1], window, rotary_shapes is not None)
        causal = False
    attn = attention_problem(
        q_shape, (batch, capacity, heads_kv, head_dim), (batch, capacity, heads_kv, head_dim),
        causal=causal, scale=scale, window=window, softcap=softcap, layout="bshd",
    )  # fmt: skip
    rotary_half = rotary_rows = 0
    per_token = causal is True or tuple(window) != (-1, -1)
    if rotary_shapes is not None:
        rotary_rows, rotary_half = _check_rotary(rotary_shapes, head_dim, seqlen_new)
        rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    problem = KvCacheProblem(
        attn, paged, rows if paged else capacity, num_pages, capacity, seqlen_new,
        batch_idx=cache_batch_idx_shape is not None, leftpad=cache_leftpad_shape is not None,
        rotary_half=rotary_half, rotary_interleaved=bool(rotary_interleaved) and rotary_half > 0,
        rotary_q_per_token=rotary_half > 0 and per_token, rotary_rows=rotary_rows, tree_mask_shape=tree_mask_shape,
    )  # fmt: skip
    if rotary_half:
        if problem.rotary_max_cached < 0:
            raise ValueError(
                f"rotary_cos has {rotary_rows} positions, fewer than the "
                f"{rotary_rows - problem.rotary_max_cached} new keys or queries to rotate"
            )
        if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            check_rotary_positions(cache_seqlens, rotary_rows, problem.rotary_max_cached)
    return problem


def check_tree_mask(shape: tuple[int, ...], batch: int, seqlen_q: int, window: Any, rotary: bool) -> None:
    """A tree mask among the Nq draft tokens: bool ``(Nq, Nq)`` (one tree for the batch) or
    ``(B or 1, Nq, Nq)``. Not with a window (a window counts positions, a tree's drafts share
    theirs) nor with the rotary tables (they rotate query i at cache_seqlens + i: a tree's drafts
    sit at their depth, which the caller's own rotation knows)."""
    if (
        shape[-2:] != (seqlen_q, seqlen_q)
        or len(shape) not in (2, 3)
        or (len(shape) == 3 and shape[0] not in (1, batch))
    ):
        raise ValueError(
            f"tree_mask must be a bool array (Nq, Nq) or (batch or 1, Nq, Nq) with Nq = {seqlen_q} query tokens "
            f"and batch = {batch}, got shape {shape}"
        )
    if tuple(window) != (-1, -1):
        raise ValueError(f"tree_mask does not take a window (got {tuple(window)}): the tree says what each draft sees")
    if rotary:
        raise ValueError(
            "tree_mask does not take rotary_cos / rotary_sin (they place query i at cache_seqlens + i; a tree's "
            "drafts sit at their depth): rotate q and k_new at the drafts' positions before the call"
        )


def _check_rotary(shapes: tuple[tuple[int, ...], tuple[int, ...]], head_dim: int, new: int) -> tuple[int, int]:
    """rotary_cos and rotary_sin (seqlen_ro, rotary_dim / 2): one shape, rotary_dim even and at
    most head_dim, and k_new to rotate; returns (seqlen_ro, rotary_dim / 2). The positions the
    call's cache_seqlens reach are checked against seqlen_ro where they are known on the host
    (``check_rotary_positions``: an int, each call, and host arrays), else by the kernels (a
    sequence past the table gets NaN rows and a device error, as a cache_seqlens past the cache),
    not against the cache's capacity: a table as long as the positions in use is enough, as in
    flash-attn."""
    if not new:
        raise ValueError("rotary_cos / rotary_sin rotate q and k_new: they need k_new and v_new")
    cos, sin = (tuple(x) for x in shapes)
    if cos != sin or len(cos) != 2:
        raise ValueError(f"rotary_cos and rotary_sin must be 2-D (seqlen_ro, rotary_dim / 2) alike, got {cos}, {sin}")
    seqlen_ro, half = cos
    if not 1 <= 2 * half <= head_dim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * half} must be in 2 .. head_dim ({head_dim})")
    return seqlen_ro, half


def check_rotary_positions(seqlens: list[int] | int, rows: int, max_cached: int) -> None:
    """Each sequence's rotated keys and queries inside rotary_cos's ``rows`` positions: no
    cache_seqlens past ``max_cached`` (``KvCacheProblem.rotary_max_cached``). Host values: one int
    for every sequence (checked per call by the Launch too: ``Operand.int_rotary``), or one per
    sequence."""
    for b, n in enumerate([seqlens] if isinstance(seqlens, int) else seqlens):
        if n > max_cached:
            name = "cache_seqlens" if isinstance(seqlens, int) else f"cache_seqlens[{b}]"
            raise ValueError(
                f"{name}={n} puts a rotated key or query at position {n + rows - max_cached - 1}, past "
                f"rotary_cos's {rows} positions"
            )


def check_kvcache_values(
    seqlens: list[int],
    pages: list[list[int]] | None,
    p: KvCacheProblem,
    entries: list[int] | None = None,
    first_keys: list[int] | None = None,
) -> None:
    """Host-side check of the contents of cache_seqlens, block_table, cache_batch_idx
    (``entries``) and cache_leftpad (``first_keys``), only where they already live on the host:
    on the GPU this would cost a device synchronisation per call."""
    for b, n in enumerate(seqlens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}]={n} is negative")
        if n > p.capacity - p.seqlen_new:
            # Paged, the capacity is what the table holds: name it, as the thing that is too short.
            rows = f": block_table's {p.capacity // p.page_size} pages of {p.page_size}" if p.paged else ""
            raise ValueError(
                f"cache_seqlens[{b}]={n} with {p.seqlen_new} new tokens goes beyond the cache "
                f"({p.capacity} tokens per sequence{rows})"
            )
        if first_keys is not None and not 0 <= first_keys[b] <= n:
            raise ValueError(f"cache_leftpad[{b}]={first_keys[b]} is outside [0, cache_seqlens[{b}]={n}]")
        if entries is not None and not 0 <= entries[b] < p.num_pages:
            raise ValueError(f"cache_batch_idx[{b}]={entries[b]} is outside the cache's {p.num_pages} entries")
    if p.rotary_half:
        check_rotary_positions(seqlens, p.rotary_rows, p.rotary_max_cached)
    if entries is not None and p.seqlen_new and len(set(entries)) < len(entries):
        # Two sequences appending into one entry: which tokens it ends up with is undefined.
        raise ValueError(f"cache_batch_idx {entries} names an entry twice, with k_new/v_new to append into it")
    if pages is not None:
        for b, (row, n) in enumerate(zip(pages, seqlens)):
            used = -(-(n + p.seqlen_new) // p.page_size)
            bad = [x for x in row[:used] if not 0 <= x < p.num_pages]
            if bad:
                raise ValueError(f"block_table[{b}] points outside the {p.num_pages} pages of the cache: {bad}")


def check_num_splits(num_splits: Any) -> int:
    """0 = chosen by the heuristic; 1 = no split (plain FA2); k = k splits of the KV sequence."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = automatic), got {num_splits!r}")
    return num_splits


BATCH_INVARIANT_SPLITS = (
    "num_splits and batch_invariant=True exclude each other: batch_invariant fixes the size of a split in keys, "
    "so that a sequence's split count follows its own length and nothing else; leave num_splits at 0"
)


def check_batch_invariant(batch_invariant: Any, num_splits: int = 0) -> bool:
    """``batch_invariant`` as a bool, refused beside a ``num_splits`` other than 0 (automatic)."""
    flag = check_flag("batch_invariant", batch_invariant)
    if flag and num_splits:
        raise ValueError(BATCH_INVARIANT_SPLITS)
    return flag


def merge_problem(o_a_shape: Any, lse_a_shape: Any, o_b_shape: Any, lse_b_shape: Any) -> tuple[int, int, int, int]:
    """(B, N, H, d) of ``merge_states``' two states: o (B, N, H, d), lse (B, H, N)."""
    if len(o_a_shape) != 4:
        raise ValueError(f"o_a must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(o_a_shape)}")
    if tuple(o_a_shape) != tuple(o_b_shape):
        raise ValueError(f"o_a and o_b must have the same shape, got {tuple(o_a_shape)} and {tuple(o_b_shape)}")
    b, n, h, d = o_a_shape
    for name, shape in (("lse_a", lse_a_shape), ("lse_b", lse_b_shape)):
        if tuple(shape) != (b, h, n):
            raise ValueError(f"{name} must have shape (batch, heads, seqlen) = {(b, h, n)}, got {tuple(shape)}")
    return b, n, h, d
