"""Property tests (hypothesis) of the public functions against the float64 oracle.

Host (CPU, NumPy inputs, run in CI): random shapes (batch, lengths 0/1/odd, GQA ratios, odd
head dims and 0), float32/float64, both layouts, non-contiguous views, every flag (causal,
windows with -1 and their edges, softcap, scales negative, 0 and tiny), every host algorithm,
packed sequences with empty ones, KV caches (contiguous and paged: page sizes 1/2/16, shuffled
block tables, garbage past every length and in unused table entries, appended tokens, split
counts), merge_states, and NaN/Inf placements, each against reference.py.

Error bounds, from first-order error analysis of float arithmetic with unit roundoff eps of the
input dtype (the reference sees the same rounded inputs, so only arithmetic error counts):
a score q.k * scale is off by at most ``score_err = eps ((d + 2) |scale| max|q_i| max|k_j|
+ 4 softcap + 1)``; softmax moves by at most 2 x that in l1 and the sums add ``eps (Nk + 4)``, so
``|O - O_ref| <= 2 (2 score_err + sum_err) max|v|`` and ``|LSE - LSE_ref| <= 2 (score_err +
sum_err) + 2 eps |LSE_ref|``. Non-finite inputs must give the reference's NaN/-inf pattern.

GPU (``gpu`` marker, skipped here): the same strategies on CuPy/torch GPU inputs in float16 and
bfloat16 over the GPU head dims, a fixed budget of examples each, against the reference under
the per-dtype bounds of the other GPU tests (helpers.BOUND, within 2x naive low precision).
Also here: NumPy scalars as options (issue 15: accepted everywhere, ``causal=1.0`` refused
everywhere, whatever the plan cache holds; attention's GPU case is in test_gpu_pipeline.py).

``HYPOTHESIS_PROFILE=explore`` draws new examples on each run (conftest.py); the default profile
is derandomized. ``CUPYFLASH_FUZZ_SCALE=10`` runs ten times the examples.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytest.importorskip("hypothesis")

from helpers import (  # noqa: E402
    BOUND,
    check_attention,
    check_kvcache,
    check_lse,
    is_hopper,
    kv_reference,
    need_torch,
    paginate,
    rel_error,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import _launch, reference  # noqa: E402

_SCALE = float(os.environ.get("CUPYFLASH_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> Any:
    """Settings of one fuzz test: its example budget (times CUPYFLASH_FUZZ_SCALE), no deadline
    (first calls compile on the GPU), and no health check on slow or large draws."""
    return settings(
        max_examples=max(1, round(examples * _SCALE)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


HOST_ALGORITHMS = ("auto", "naive", "fa1", "fa2", "fa3", "decode")
HOST_DTYPES = (np.float32, np.float64)
SCALES = (None, None, 1.0, 0.0, -0.5, 1e-30, 1e-6, 0.1, 2.0, -7.0, 30.0)
SOFTCAPS = (0.0, 0.0, 0.0, 1e-3, 0.5, 5.0, 50.0)
VIEWS = ("contiguous", "contiguous", "every-other-head", "transposed", "reversed", "fortran", "strided-d")
HOST_HEAD_DIMS = st.integers(0, 40)
SMALL_HEAD_DIMS = st.integers(1, 24)


def lengths(longest: int) -> st.SearchStrategy[int]:
    """Sequence lengths: the edges (0, 1, 2, odd) often, anything up to ``longest`` too."""
    return st.one_of(st.sampled_from((0, 1, 2, 7)), st.integers(0, longest))


def window_bound(n: int) -> st.SearchStrategy[int]:
    """A window bound: -1 (unbounded) or 0 .. n + 2 (past the last edge that still hides a key)."""
    return st.one_of(st.just(-1), st.integers(0, n + 2))


def view(x: np.ndarray, kind: str) -> np.ndarray:
    """The values of ``x`` (4-D) behind other strides."""
    if kind == "every-other-head":
        big = np.zeros((*x.shape[:2], 2 * x.shape[2], x.shape[3]), dtype=x.dtype)
        big[:, :, ::2] = x
        return big[:, :, ::2]
    if kind == "transposed":
        return np.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2)
    if kind == "reversed":
        return np.ascontiguousarray(x[:, ::-1])[:, ::-1]
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "strided-d":
        big = np.zeros((*x.shape[:3], 2 * x.shape[3]), dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    return x


def _finite_row_norm(x: np.ndarray) -> float:
    """The largest 2-norm over the last axis among rows without a non-finite entry (0 if none)."""
    rows = x.reshape(-1, x.shape[-1]) if x.size else np.zeros((0, 1))
    rows = rows[np.isfinite(rows).all(axis=1)]
    return float(np.sqrt((rows.astype(np.float64) ** 2).sum(axis=1)).max()) if rows.size else 0.0


def bounds(
    dtype: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, nk: int, scale: Any, softcap: float
) -> tuple[float, Any]:
    """(absolute bound on O, bound on LSE as a function of the reference LSE) for rows that see
    up to ``nk`` keys: see the module docstring. Norms are over finite rows only (rows with a
    non-finite entry are checked by their pattern)."""
    eps = float(np.finfo(dtype).eps)
    d = q.shape[-1]
    scale = (1.0 / math.sqrt(d) if d else 1.0) if scale is None else scale
    score_err = eps * ((d + 2) * abs(scale) * _finite_row_norm(q) * _finite_row_norm(k) + 4 * softcap + 1)
    sum_err = eps * (nk + 4)
    finite_v = v[np.isfinite(v)]
    vmax = float(np.abs(finite_v).max()) if finite_v.size else 1.0
    out_atol = 2 * (2 * score_err + sum_err) * max(vmax, 1e-30)
    return out_atol, lambda ref_lse: 2 * (score_err + sum_err) + 2 * eps * np.abs(np.nan_to_num(ref_lse, posinf=0.0))


def assert_matches(
    out: Any, lse: Any, ref: np.ndarray, ref_lse: np.ndarray, out_atol: float, lse_atol: Any, nan_exact: bool = True
) -> None:
    """Same shapes; NaN where the reference has NaN (``nan_exact``; else only the same
    non-finite elements), -inf LSE exactly where it does; the rest within the bounds."""
    out, lse = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    if nan_exact:
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg="NaN pattern of O")
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(ref), err_msg="non-finite pattern of O")
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse), err_msg="NaN pattern of LSE")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse), err_msg="-inf pattern of LSE")
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=0, atol=out_atol, err_msg="O")
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_less(np.abs(lse[finite] - ref_lse[finite]), lse_atol(ref_lse[finite]) + 1e-300)


def host_dtype(dtype: Any) -> Any:
    """The dtype of the host data a case starts from: float32 for the GPU's 16-bit dtypes (the
    GPU tests round it on the device; NumPy knows "bfloat16" only once ml_dtypes is imported)."""
    return np.float32 if dtype in ("float16", "bfloat16") else dtype


def lse_dtype(dtype: Any) -> Any:
    """The LSE dtype rule: float32 or the input's dtype, whichever is wider."""
    return np.result_type(np.float32, dtype)


# ---------------------------------------------------------------------------------------------
# attention on the host.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: Any
    layout: str
    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float | None
    views: tuple[str, str, str]
    algorithm: str
    seed: int

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self.layout == "bshd":
            return (self.batch, self.seqlen_q, self.heads_q, self.head_dim), (
                self.batch,
                self.seqlen_k,
                self.heads_kv,
                self.head_dim,
            )
        return (self.batch, self.heads_q, self.seqlen_q, self.head_dim), (
            self.batch,
            self.heads_kv,
            self.seqlen_k,
            self.head_dim,
        )

    def options(self) -> dict[str, Any]:
        return {
            "causal": self.causal,
            "window": self.window,
            "softcap": self.softcap,
            "scale": self.scale,
            "layout": self.layout,
        }


@st.composite
def attention_cases(
    draw: Any,
    *,
    head_dims: st.SearchStrategy[int] = HOST_HEAD_DIMS,
    dtypes: tuple[Any, ...] = HOST_DTYPES,
    longest: int = 70,
    batches: tuple[int, ...] = (1, 1, 1, 2, 2, 3, 0),
    algorithms: tuple[str, ...] = HOST_ALGORITHMS,
    scales: tuple[Any, ...] = SCALES,
    softcaps: tuple[float, ...] = SOFTCAPS,
    views: tuple[str, ...] = VIEWS,
) -> AttentionCase:
    nq, nk = draw(lengths(longest)), draw(lengths(longest))
    heads_kv = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    right = draw(st.sampled_from((-1, 0))) if causal else draw(window_bound(nq))
    return AttentionCase(
        batch=draw(st.sampled_from(batches)),
        seqlen_q=nq,
        seqlen_k=nk,
        heads_q=heads_kv * draw(st.sampled_from((1, 1, 2, 3, 4))),
        heads_kv=heads_kv,
        head_dim=draw(head_dims),
        dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(("bshd", "bhsd"))),
        causal=causal,
        window=(draw(window_bound(nk)), right),
        softcap=draw(st.sampled_from(softcaps)),
        scale=draw(st.sampled_from(scales)),
        views=tuple(draw(st.sampled_from(views)) for _ in range(3)),  # type: ignore[arg-type]
        algorithm=draw(st.sampled_from(algorithms)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def host_inputs(case: AttentionCase) -> list[np.ndarray]:
    rng = np.random.default_rng(case.seed)
    shape_q, shape_kv = case.shapes()
    return [rng.standard_normal(s).astype(case.dtype) for s in (shape_q, shape_kv, shape_kv)]


def check_host_attention(
    case: AttentionCase,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    nan_exact: bool = True,
    algorithm: str | None = None,
) -> None:
    views = [view(x, kind) for x, kind in zip((q, k, v), case.views)]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(views, (q, k, v)))
    out, lse = cupyflash.attention(*views, algorithm=algorithm or case.algorithm, return_lse=True, **case.options())
    assert type(out) is np.ndarray and out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == lse_dtype(q.dtype)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **case.options())
    out_atol, lse_atol = bounds(q.dtype, q, k, v, case.seqlen_k, case.scale, case.softcap)
    assert_matches(out, lse, ref, ref_lse, out_atol, lse_atol, nan_exact)


@fuzz(400)
@given(attention_cases())
def test_attention_matches_reference(case):
    check_host_attention(case, *host_inputs(case))


@st.composite
def placements(draw: Any) -> list[tuple[int, float, tuple[float, ...]]]:
    """1-3 non-finite values: (tensor 0/1/2 = q/k/v, value, position as fractions of each axis)."""
    values = st.sampled_from((math.nan, math.nan, math.inf, -math.inf))
    where = st.tuples(*(st.floats(0, 1, exclude_max=True) for _ in range(4)))
    return draw(st.lists(st.tuples(st.integers(0, 2), values, where), min_size=1, max_size=3))


@fuzz(250)
@given(attention_cases(longest=40, batches=(1, 2)), placements())
def test_non_finite_inputs_give_the_reference_pattern_in_every_algorithm(case, where):
    """NaN in a query row: that row's O and LSE are NaN; NaN in a key or value: NaN in every row
    that sees it and no other; +-inf as IEEE arithmetic makes them (reference.py). The same for
    every host algorithm (block and split edges must not spread a NaN)."""
    arrays = host_inputs(case)
    inf_in_v = False
    for tensor, value, position in where:
        x = arrays[tensor]
        if x.size:
            x[tuple(int(f * n) for f, n in zip(position, x.shape))] = value
            inf_in_v |= tensor == 2 and math.isinf(value)
    # +-inf in V: inf where its weight is > 0, NaN where that weight underflows, and float32
    # underflows where float64 does not: compare which elements are finite, not which are NaN.
    for algorithm in ("naive", "fa1", "fa2", "decode"):
        check_host_attention(case, *arrays, nan_exact=not inf_in_v, algorithm=algorithm)


@pytest.mark.parametrize("dtype", HOST_DTYPES)
def test_absurd_scales_follow_ieee_arithmetic(dtype):
    """|scale| of half the dtype's largest number on the host: scores overflow to +-inf where
    IEEE arithmetic says so; a row with a +inf score is NaN (O and LSE), -inf weighs 0; every
    other row matches the reference. Scales at the smallest normal give uniform attention."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((1, 5, 2, 8), (1, 6, 2, 8), (1, 6, 2, 8)))
    huge, tiny = float(np.finfo(dtype).max) / 2, float(np.finfo(dtype).tiny)
    for scale in (huge, -huge):
        out, lse = cupyflash.attention(q, k, v, scale=scale, return_lse=True)
        ref, ref_lse = reference.attention(q, k, v, scale=scale, return_lse=True)
        rows = np.isnan(out).any(axis=-1)  # [B, N, H]
        assert rows.any() and (np.isnan(out) == rows[..., None]).all() and np.isnan(lse.transpose(0, 2, 1)[rows]).all()
        np.testing.assert_allclose(out[~rows], ref[~rows], atol=1e-5)
        # NaN wherever the reference overflows too (and a little earlier: the log2-domain
        # softmax multiplies scores by log2(e) = 1.44, so |s| > max / 1.44 overflows there)
        assert not (np.isnan(ref) & ~np.isnan(out)).any()
    for scale in (tiny, -tiny):
        out = cupyflash.attention(q, k, v, scale=scale)
        np.testing.assert_allclose(out, reference.attention(q, k, v, scale=scale), atol=1e-5)
        np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=1, keepdims=True), out.shape), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# attention_varlen on the host.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VarlenCase:
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    pad_q: int  # rows after the last sequence (garbage: NaN)
    pad_k: int
    extra_max: tuple[int, int]  # max_seqlen_q/k beyond the longest sequence
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: Any
    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float | None
    algorithm: str
    seed: int


@st.composite
def varlen_cases(
    draw: Any,
    *,
    head_dims: Any = SMALL_HEAD_DIMS,
    dtypes: tuple[Any, ...] = HOST_DTYPES,
    longest: int = 24,
    algorithms: tuple[str, ...] = ("auto", "fa2", "fa3"),
    most: int = 5,
    softcaps: tuple[float, ...] = SOFTCAPS,
    scales: tuple[Any, ...] = SCALES,
) -> VarlenCase:
    # A batch of 0 sequences only without padding rows: the host path returns twice the rows for
    # cu_seqlens = [0] with rows in q (cupyflash/_host.py; test_varlen_no_sequence_padding).
    n = draw(st.integers(0, most))
    q_lens = tuple(draw(lengths(longest)) for _ in range(n))
    k_lens = tuple(draw(lengths(longest)) for _ in range(n))
    pad_q, pad_k = (draw(st.integers(0, 3)) if n else 0 for _ in range(2))
    causal = draw(st.booleans())
    big_q, big_k = max(q_lens, default=0), max(k_lens, default=0)
    heads_kv = draw(st.integers(1, 2))
    return VarlenCase(
        q_lens, k_lens, pad_q, pad_k,
        (draw(st.integers(0, sum(q_lens) + pad_q - big_q)), draw(st.integers(0, sum(k_lens) + pad_k - big_k))),
        heads_kv * draw(st.sampled_from((1, 2, 3))), heads_kv, draw(head_dims), draw(st.sampled_from(dtypes)),
        causal, (draw(window_bound(big_k)), draw(st.sampled_from((-1, 0))) if causal else draw(window_bound(big_q))),
        draw(st.sampled_from(softcaps)), draw(st.sampled_from(scales)), draw(st.sampled_from(algorithms)),
        draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def packed_inputs(case: VarlenCase) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    cu_q = np.concatenate([[0], np.cumsum(case.q_lens, dtype=np.int64)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(case.k_lens, dtype=np.int64)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]) + case.pad_q, case.heads_q, case.head_dim)).astype(host_dtype(case.dtype))
    k, v = (
        rng.standard_normal((int(cu_k[-1]) + case.pad_k, case.heads_kv, case.head_dim)).astype(host_dtype(case.dtype))
        for _ in range(2)
    )
    q[cu_q[-1] :], k[cu_k[-1] :], v[cu_k[-1] :] = np.nan, np.nan, np.inf  # never read
    return [q, k, v], cu_q, cu_k


def varlen_reference(case: VarlenCase, q: Any, k: Any, v: Any, cu_q: np.ndarray, cu_k: np.ndarray) -> tuple[Any, Any]:
    """Each sequence through reference.attention; rows after the last sequence 0 and -inf."""
    q64, k64, v64 = (reference.to_numpy64(x) for x in (q, k, v))
    out = np.zeros(q64.shape)
    lse = np.full((q64.shape[1], q64.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        options = {"causal": case.causal, "window": case.window, "softcap": case.softcap, "scale": case.scale}
        o, s = reference.attention(q64[None, rows], k64[None, keys], v64[None, keys], return_lse=True, **options)
        out[rows], lse[:, rows] = o[0], s[0]
    return out, lse


@fuzz(150)
@given(varlen_cases())
def test_varlen_matches_reference(case):
    (q, k, v), cu_q, cu_k = packed_inputs(case)
    max_q, max_k = max(case.q_lens, default=0) + case.extra_max[0], max(case.k_lens, default=0) + case.extra_max[1]
    out, lse = cupyflash.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
        scale=case.scale,
        algorithm=case.algorithm,
        return_lse=True,
    )
    assert out.dtype == q.dtype and lse.dtype == lse_dtype(q.dtype)
    ref, ref_lse = varlen_reference(case, q, k, v, cu_q, cu_k)
    real = slice(0, int(cu_k[-1]))
    out_atol, lse_atol = bounds(
        q.dtype, q[: cu_q[-1]], k[real], v[real], max(case.k_lens, default=0), case.scale, case.softcap
    )
    assert_matches(out, lse, ref, ref_lse, out_atol, lse_atol)


def test_varlen_no_sequence_padding():
    """No sequence at all and 3 rows in q: 3 output rows of 0, LSE -inf (as the GPU path)."""
    q = np.ones((3, 2, 4), np.float32)
    cu = np.zeros(1, np.int32)
    out, lse = cupyflash.attention_varlen(q, q, q, cu, cu, 0, 0, return_lse=True)
    assert out.shape == q.shape and (out == 0).all() and lse.shape == (2, 3) and np.isneginf(lse).all()


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache on the host.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvCase:
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int | None  # None: contiguous cache
    pages_per_seq: int  # paged: table width; contiguous: capacity
    spare_pages: int
    cached: tuple[int, ...]  # tokens already in each sequence's cache
    seqlen_new: int  # tokens appended (k_new / v_new); 0: none given
    int_seqlens: bool  # cache_seqlens as one int (all sequences alike)
    garbage_table: bool  # table entries past the used pages hold out-of-range ids
    causal: bool
    scale: float | None
    num_splits: int
    dtype: Any
    seed: int


@st.composite
def kv_cases(
    draw: Any,
    *,
    head_dims: Any = SMALL_HEAD_DIMS,
    dtypes: tuple[Any, ...] = HOST_DTYPES,
    page_sizes: tuple[Any, ...] = (None, None, 1, 2, 16),
    max_seqlen_q: int = 5,
    max_batch: int = 4,
    max_pages: int = 5,
    min_capacity: int = 0,
    max_capacity: int = 48,
    scales: tuple[Any, ...] = SCALES,
) -> KvCase:
    batch = draw(st.integers(1, max_batch))
    page_size = draw(st.sampled_from(page_sizes))
    if page_size is None:
        pages = draw(st.integers(min_capacity, max_capacity))
        capacity = pages
    else:
        pages = draw(st.integers(1, max_pages))
        capacity = pages * page_size
    new = draw(st.integers(0, min(3, capacity)))
    same = draw(st.booleans())
    first = draw(st.integers(0, capacity - new))
    cached = tuple(first if same else draw(st.integers(0, capacity - new)) for _ in range(batch))
    heads_kv = draw(st.integers(1, 2))
    return KvCase(
        batch, draw(st.integers(1, max_seqlen_q)), heads_kv * draw(st.sampled_from((1, 2, 4))), heads_kv,
        draw(head_dims), page_size, pages, draw(st.integers(0, 3)), cached, new, same and draw(st.booleans()),
        draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from(scales)),
        draw(st.sampled_from((0, 1, 2, 3, 7))), draw(st.sampled_from(dtypes)), draw(st.integers(0, 2**32 - 1)),
    )  # fmt: skip


def kv_inputs(case: KvCase, rng: np.random.Generator) -> dict[str, Any]:
    """q, the caches (garbage NaN/Inf past every length), k_new / v_new, cache_seqlens, table,
    and the contiguous caches after the append for the reference."""
    d, hkv = case.head_dim, case.heads_kv
    capacity = case.pages_per_seq * (case.page_size or 1)
    q = rng.standard_normal((case.batch, case.seqlen_q, case.heads_q, d)).astype(host_dtype(case.dtype))
    k, v = (rng.standard_normal((case.batch, capacity, hkv, d)).astype(host_dtype(case.dtype)) for _ in range(2))
    for b, n in enumerate(case.cached):
        k[b, n:], v[b, n:] = np.nan, np.inf  # not cached yet: appended over, or never read
    new = [rng.standard_normal((case.batch, case.seqlen_new, hkv, d)).astype(host_dtype(case.dtype)) for _ in range(2)]
    after = [k.copy(), v.copy()]
    for b, n in enumerate(case.cached):
        for cache, x in zip(after, new):
            cache[b, n : n + case.seqlen_new] = x[b]
    table = None
    k_cache, v_cache = k, v
    if case.page_size is not None:
        (k_cache, v_cache), table = paginate(rng, (k, v), case.page_size, case.spare_pages)
        unused = np.setdiff1d(np.arange(k_cache.shape[0]), table)
        k_cache[unused], v_cache[unused] = np.nan, np.inf  # pages in no table: never read
        if case.garbage_table:
            for b, n in enumerate(case.cached):
                first_unused = -(-(n + case.seqlen_new) // case.page_size)
                table[b, first_unused:] = rng.choice([-1, k_cache.shape[0], 2**30], size=table.shape[1] - first_unused)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k_new": new[0] if case.seqlen_new else None,
        "v_new": new[1] if case.seqlen_new else None,
        "cache_seqlens": case.cached[0] if case.int_seqlens else np.array(case.cached, np.int32),
        "block_table": table,
        "after": after,
    }


def expected_pages(case: KvCase, arrays: dict[str, Any], before: list[np.ndarray]) -> list[np.ndarray]:
    """The caches as the call must leave them: the new tokens at cache_seqlens[b] + t, nothing else."""
    out = [x.copy() for x in before]
    if not case.seqlen_new:
        return out
    for b, n in enumerate(case.cached):
        for t in range(case.seqlen_new):
            pos = n + t
            where = (
                (b, pos)
                if case.page_size is None
                else (arrays["block_table"][b, pos // case.page_size], pos % case.page_size)
            )
            out[0][where], out[1][where] = arrays["k_new"][b, t], arrays["v_new"][b, t]
    return out


@fuzz(250)
@given(kv_cases())
def test_kvcache_matches_reference(case):
    rng = np.random.default_rng(case.seed)
    arrays = kv_inputs(case, rng)
    before = [arrays["k_cache"].copy(), arrays["v_cache"].copy()]
    call = {name: x for name, x in arrays.items() if name != "after"}
    out, lse = cupyflash.attention_with_kvcache(
        **call, causal=case.causal, scale=case.scale, num_splits=case.num_splits, return_lse=True
    )
    for got, want in zip((arrays["k_cache"], arrays["v_cache"]), expected_pages(case, arrays, before)):
        np.testing.assert_array_equal(got, want, err_msg="the append wrote exactly the new tokens")
    assert out.dtype == case.dtype and lse.dtype == lse_dtype(case.dtype) and out.shape == arrays["q"].shape
    lengths_after = [n + case.seqlen_new for n in case.cached]
    k_after, v_after = arrays["after"]
    ref, ref_lse = kv_reference(arrays["q"], k_after, v_after, lengths_after, case.causal, case.scale)
    k_seen = np.concatenate([k_after[b, :n] for b, n in enumerate(lengths_after)])
    v_seen = np.concatenate([v_after[b, :n] for b, n in enumerate(lengths_after)])
    out_atol, lse_atol = bounds(case.dtype, arrays["q"], k_seen, v_seen, max(lengths_after), case.scale, 0.0)
    assert_matches(out, lse, ref, ref_lse, out_atol, lse_atol)


def test_kvcache_shared_page_appends_in_batch_order():
    """Two sequences whose tables share a page and both append (a caller's error): on the host
    the appends run in batch order, so the later sequence's token wins and both read it; on the
    GPU the order is undefined (docs/robustness.md)."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 1, 2, 8)).astype(np.float32)
    pages = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    table = np.array([[0, 2], [1, 2]], dtype=np.int32)  # page 2 in both
    k_new, v_new = (rng.standard_normal((2, 1, 1, 8)).astype(np.float32) for _ in range(2))
    k_pages, v_pages = pages.copy(), pages.copy()
    cupyflash.attention_with_kvcache(
        q, k_pages, v_pages, cache_seqlens=np.array([5, 5], np.int32), block_table=table, k_new=k_new, v_new=v_new
    )
    np.testing.assert_array_equal(k_pages[2, 1], k_new[1, 0])


# ---------------------------------------------------------------------------------------------
# merge_states on the host.
# ---------------------------------------------------------------------------------------------
@st.composite
def merge_cases(draw: Any, *, head_dims: Any = SMALL_HEAD_DIMS, dtypes: tuple[Any, ...] = HOST_DTYPES) -> Any:
    nk = draw(lengths(40))
    return (
        draw(st.integers(1, 3)),
        draw(lengths(12)),
        nk,
        draw(st.integers(1, 3)),
        draw(head_dims),
        draw(st.sampled_from(dtypes)),
        tuple(draw(st.booleans()) for _ in range(nk)),
        draw(st.booleans()),
        draw(st.integers(0, 2**32 - 1)),
    )


@fuzz(150)
@given(merge_cases())
def test_merge_states_equals_attention_over_the_union(case):
    """Two states over disjoint key sets (either may be empty: lse -inf, O garbage NaN) merge
    to attention over all keys; a NaN query row stays NaN through the merge."""
    b, n, nk, h, d, dtype, in_a, nan_row, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((b, n, h, d), (b, nk, h, d), (b, nk, h, d)))
    if nan_row and n:
        q[0, n - 1, 0, 0] = np.nan
    keys_a = np.flatnonzero(np.array(in_a, dtype=bool))
    keys_b = np.flatnonzero(~np.array(in_a, dtype=bool))
    states = []
    for keys in (keys_a, keys_b):
        o, lse = cupyflash.attention(q, k[:, keys], v[:, keys], return_lse=True)
        o[np.isneginf(lse).transpose(0, 2, 1)] = np.nan  # an empty part's O is garbage
        states += [o, lse]
    out, lse = cupyflash.merge_states(*states)
    assert out.dtype == dtype and lse.dtype == lse_dtype(dtype)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    out_atol, lse_atol = bounds(dtype, q, k, v, nk, None, 0.0)
    assert_matches(out, lse, ref, ref_lse, 4 * out_atol, lambda x: 4 * lse_atol(x))


# ---------------------------------------------------------------------------------------------
# Options as NumPy scalars (issue 15 item 5): NumPy bool / float scalars are accepted wherever a
# bool / float is, causal=1.0 is refused everywhere, and neither depends on earlier calls.
# ---------------------------------------------------------------------------------------------
def _host_entries(rng: np.random.Generator) -> dict[str, Any]:
    """entry -> fn(causal=..., scale=...) on fresh host inputs."""
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 5, 2, 16), (1, 9, 1, 16), (1, 9, 1, 16)))
    cu = np.array([0, 2, 5], np.int32), np.array([0, 4, 9], np.int32)
    return {
        "attention": lambda **kw: cupyflash.attention(q, k, v, **kw),
        "varlen": lambda **kw: cupyflash.attention_varlen(q[0], k[0], v[0], *cu, 3, 5, **kw),
        "kvcache": lambda **kw: cupyflash.attention_with_kvcache(q[:, :2], k, v, cache_seqlens=7, **kw),
    }


@pytest.mark.parametrize("entry", ["attention", "varlen", "kvcache"])
def test_numpy_scalar_options_are_accepted(entry):
    call = _host_entries(np.random.default_rng(0))[entry]
    want = call(causal=True, scale=0.125)
    for causal, scale in ((np.True_, np.float32(0.125)), (np.bool_(True), np.float64(0.125))):
        np.testing.assert_array_equal(call(causal=causal, scale=scale), want)
    np.testing.assert_array_equal(call(causal=np.False_), call(causal=False))


@pytest.mark.parametrize("entry", ["attention", "varlen", "kvcache"])
@pytest.mark.parametrize("causal", [1.0, 1, 0, "yes", None])
def test_non_bool_causal_is_refused(entry, causal):
    call = _host_entries(np.random.default_rng(0))[entry]
    with pytest.raises(ValueError, match="causal"):
        call(causal=causal)


# ---------------------------------------------------------------------------------------------
# GPU: the same strategies on GPU inputs (float16 / bfloat16, the GPU head dims).
# ---------------------------------------------------------------------------------------------
GPU_DTYPES = ("float16", "bfloat16")
GPU_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
GPU_KV_HEAD_DIMS = (64, 128, 256)
GPU_SCALES = (None, None, 0.3, -0.2, 0.0, 1e-3, 1.0)
GPU_SOFTCAPS = (0.0, 0.0, 5.0, 30.0)
GPU_EXAMPLES = 60


def _to_gpu(x: np.ndarray, dtype: str, lib: str) -> Any:
    """``x`` rounded to ``dtype`` on the GPU: a torch tensor, or a CuPy array (bfloat16 ones made
    by torch and handed over through DLPack, the route NOTES.md checked on the H200)."""
    host = np.ascontiguousarray(x, dtype=np.float32)
    if lib == "torch" or dtype == "bfloat16":
        torch = need_torch()
        tensor = torch.from_numpy(host).to("cuda", getattr(torch, dtype))
        if lib == "torch":
            return tensor
        import cupy

        return cupy.from_dlpack(tensor)
    import cupy

    return cupy.asarray(host).astype(dtype)


def _gpu_view(x: Any, kind: str) -> Any:
    """GPU counterparts of ``view``: a head slice, transposed memory, a non-unit head_dim stride
    (copied by the library), a negative row stride (CuPy float16 only: torch has none). CuPy
    arrays are re-laid out by torch and handed back through DLPack (CuPy has no bfloat16 kernels)."""
    if kind == "reversed":
        return x[:, ::-1].copy()[:, ::-1] if str(x.dtype) == "float16" and not is_torch(x) else x
    if not is_torch(x):
        import cupy

        return cupy.from_dlpack(_gpu_view(need_torch().from_dlpack(x), kind))
    if kind == "every-other-head":
        big = x.new_zeros((*x.shape[:2], 2 * x.shape[2], x.shape[3]))
        big[:, :, ::2] = x
        return big[:, :, ::2]
    if kind == "transposed":
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "strided-d":
        big = x.new_zeros((*x.shape[:3], 2 * x.shape[3]))
        big[..., ::2] = x
        return big[..., ::2]
    return x


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _gpu_algorithm(algorithm: str, head_dim: int) -> str:
    """The drawn algorithm where it can run this head dim on this GPU, else "auto"."""
    from cupyflash._specs import FA3_HEAD_DIMS

    if algorithm == "fa3" and (head_dim not in FA3_HEAD_DIMS or not is_hopper()):
        return "auto"
    if algorithm == "fa1" and head_dim not in (64, 128, 256):
        return "auto"
    return algorithm


def _gpu_attention_cases() -> Any:
    return attention_cases(
        head_dims=st.sampled_from(GPU_HEAD_DIMS),
        dtypes=GPU_DTYPES,
        longest=300,
        batches=(1, 1, 2),
        algorithms=("auto", "auto", "fa2", "fa3", "fa1", "naive"),
        scales=GPU_SCALES,
        softcaps=GPU_SOFTCAPS,
        views=("contiguous", "contiguous", "every-other-head", "transposed", "strided-d", "reversed"),
    )


@pytest.mark.gpu
@fuzz(GPU_EXAMPLES)
@given(_gpu_attention_cases(), st.sampled_from(("torch", "cupy")))
def test_gpu_attention_matches_reference(case, lib):
    rng = np.random.default_rng(case.seed)
    shape_q, shape_kv = case.shapes()
    q, k, v = (
        _gpu_view(_to_gpu(rng.standard_normal(s), case.dtype, lib), kind)
        for s, kind in zip((shape_q, shape_kv, shape_kv), case.views)
    )
    algorithm = _gpu_algorithm(case.algorithm, case.head_dim)
    # naive's LSE comes from S rounded to the input type (tests/test_gpu_baselines.py)
    lse_atol = {"bfloat16": 5e-2, "float16": 1e-2}[case.dtype] if algorithm == "naive" else 2e-3
    check_attention(q, k, v, algorithm=algorithm, lse_atol=lse_atol, **case.options())


@pytest.mark.gpu
@fuzz(GPU_EXAMPLES)
@given(
    attention_cases(
        head_dims=st.sampled_from(GPU_HEAD_DIMS),
        dtypes=GPU_DTYPES,
        longest=200,
        batches=(1, 2),
        algorithms=("auto", "fa2", "fa3", "fa1", "naive"),
        scales=GPU_SCALES,
        softcaps=GPU_SOFTCAPS,
        views=("contiguous",),
    ),
    placements(),
)
def test_gpu_nan_inputs_give_the_reference_pattern(case, where):
    """NaN in q, k or v on the GPU: NaN exactly where the reference has it (a NaN query row: O
    and LSE NaN; a NaN key: the rows that see it, and no other row of its key block; a NaN
    value: at least those rows), the other rows under the dtype's bound."""
    rng = np.random.default_rng(case.seed)
    shape_q, shape_kv = case.shapes()
    host = [rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_kv, shape_kv)]
    for tensor, _, position in where:
        if host[tensor].size:
            host[tensor][tuple(int(f * n) for f, n in zip(position, host[tensor].shape))] = np.nan
    q, k, v = (_to_gpu(x, case.dtype, "torch") for x in host)
    out, lse = cupyflash.attention(
        q, k, v, algorithm=_gpu_algorithm(case.algorithm, case.head_dim), return_lse=True, **case.options()
    )
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **case.options())
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    if any(tensor == 2 for tensor, _, _ in where):
        # A NaN value row also reaches the rows of its query tile that mask its key: their weight
        # is an exact 0, and 0 x NaN in the tensor-core product is NaN (as in flash-attn). More
        # NaN, never less: no row the reference gives NaN comes out finite.
        assert np.isnan(out64[np.isnan(ref)]).all(), "a NaN row of the reference came out finite"
        seen = ~np.isnan(out64)
        assert rel_error(out64[seen & np.isfinite(ref)], ref[seen & np.isfinite(ref)]) <= BOUND[case.dtype]
        np.testing.assert_array_equal(np.isnan(lse64), np.isnan(ref_lse), err_msg="NaN pattern of LSE")
        return
    np.testing.assert_array_equal(np.isnan(out64), np.isnan(ref), err_msg="NaN pattern of O")
    np.testing.assert_array_equal(np.isnan(lse64), np.isnan(ref_lse), err_msg="NaN pattern of LSE")
    np.testing.assert_array_equal(np.isneginf(lse64), np.isneginf(ref_lse), err_msg="-inf pattern of LSE")
    finite = np.isfinite(ref)
    assert rel_error(out64[finite], ref[finite]) <= BOUND[case.dtype]


@pytest.mark.gpu
@fuzz(GPU_EXAMPLES)
@given(
    varlen_cases(
        head_dims=st.sampled_from(GPU_HEAD_DIMS),
        dtypes=GPU_DTYPES,
        longest=200,
        most=6,
        softcaps=GPU_SOFTCAPS,
        scales=GPU_SCALES,
    ),
    st.sampled_from(("torch", "cupy")),
)
def test_gpu_varlen_matches_reference(case, lib):
    """Packed sequences (empty ones, one-token ones, garbage past the last) on the GPU: each
    sequence under the dtype's bound, rows outside every sequence 0 with LSE -inf."""
    (q, k, v), cu_q, cu_k = packed_inputs(case)
    args = [_to_gpu(x, case.dtype, lib) for x in (q, k, v)]
    if lib == "torch":
        torch = need_torch()
        cus = [torch.from_numpy(c).cuda() for c in (cu_q, cu_k)]
    else:
        import cupy

        cus = [cupy.asarray(c) for c in (cu_q, cu_k)]
    algorithm = _gpu_algorithm(case.algorithm, case.head_dim)
    max_q, max_k = max(case.q_lens, default=0) + case.extra_max[0], max(case.k_lens, default=0) + case.extra_max[1]
    out, lse = cupyflash.attention_varlen(
        *args,
        *cus,
        max_q,
        max_k,
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
        scale=case.scale,
        algorithm=algorithm,
        return_lse=True,
    )
    ref, ref_lse = varlen_reference(case, *args, cu_q, cu_k)
    out64, end = reference.to_numpy64(out), cu_q[-1]
    assert not np.isnan(out64[:end]).any(), "unwritten (NaN-poisoned) output"
    for b in range(len(case.q_lens)):
        rows = slice(cu_q[b], cu_q[b + 1])
        err = rel_error(out64[rows], ref[rows])
        assert err <= BOUND[case.dtype], f"sequence {b}: relative error {err:.2e}"
    # Rows past the last sequence are the 0 / -inf the output starts as: no kernel writes them,
    # so the poisoned outputs of the tests hold NaN there (test_varlen.py checks them unpoisoned).
    if not _launch.POISON_OUTPUTS:
        assert (out64[end:] == 0).all()
    check_lse(reference.to_numpy64(lse)[:, :end], ref_lse[:, :end])


@pytest.mark.gpu
@fuzz(GPU_EXAMPLES)
@given(
    kv_cases(
        head_dims=st.sampled_from(GPU_KV_HEAD_DIMS),
        dtypes=GPU_DTYPES,
        page_sizes=(None, 1, 2, 16, 64, 256),
        max_seqlen_q=16,
        max_pages=6,
        min_capacity=1,
        max_capacity=600,
        scales=GPU_SCALES,
    ),
    st.sampled_from(("torch", "cupy")),
)
def test_gpu_kvcache_matches_reference(case, lib):
    """attention_with_kvcache on the GPU: contiguous or paged (shuffled tables, unused entries
    out of range), appended tokens, split counts, under the dtype's bound; the append writes
    exactly the new tokens."""
    rng = np.random.default_rng(case.seed)
    arrays = kv_inputs(case, rng)
    gpu = {}
    for name in ("q", "k_cache", "v_cache", "k_new", "v_new"):
        gpu[name] = None if arrays[name] is None else _to_gpu(arrays[name], case.dtype, lib)
    rounded = {name: None if x is None else reference.to_numpy64(x) for name, x in gpu.items()}
    for name in ("cache_seqlens", "block_table"):
        x = arrays[name]
        if x is None or isinstance(x, int):
            gpu[name] = x
        elif lib == "torch":
            gpu[name] = need_torch().from_numpy(np.asarray(x, np.int32)).cuda()
        else:
            import cupy

            gpu[name] = cupy.asarray(np.asarray(x, np.int32))
    out, lse = cupyflash.attention_with_kvcache(
        **gpu, causal=case.causal, scale=case.scale, num_splits=case.num_splits, return_lse=True
    )
    host_arrays = {**arrays, **{n: rounded[n] for n in ("k_new", "v_new")}}
    for got, want in zip(
        (gpu["k_cache"], gpu["v_cache"]), expected_pages(case, host_arrays, [rounded["k_cache"], rounded["v_cache"]])
    ):
        np.testing.assert_array_equal(
            reference.to_numpy64(got), want, err_msg="the append wrote exactly the new tokens"
        )
    lengths_after = [n + case.seqlen_new for n in case.cached]
    k_after, v_after = (reference.to_numpy64(_to_gpu(x, case.dtype, lib)) for x in arrays["after"])
    q_t, k_t, v_t = (_to_gpu(x, case.dtype, lib) for x in (rounded["q"], k_after, v_after))
    check_kvcache(out, lse, q_t, k_t, v_t, lengths_after, case.causal, case.dtype, case.scale)


@pytest.mark.gpu
@fuzz(GPU_EXAMPLES)
@given(merge_cases(head_dims=st.sampled_from((32, 64, 96, 128, 256)), dtypes=("float16", "bfloat16", "float32")))
def test_gpu_merge_states_matches_reference(case):
    """Two float64 states over disjoint key sets (an empty one with NaN O), rounded to the GPU
    dtype (LSE float32), merge to attention over all keys under the dtype's bound."""
    torch = need_torch()
    b, n, nk, h, d, dtype, in_a, _, seed = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((b, n, h, d), (b, nk, h, d), (b, nk, h, d)))
    keys = [np.flatnonzero(np.array(in_a, dtype=bool)), np.flatnonzero(~np.array(in_a, dtype=bool))]
    states = []
    for part in keys:
        o, lse = reference.attention(q, k[:, part], v[:, part], return_lse=True)
        o[np.isneginf(lse).transpose(0, 2, 1)] = np.nan
        states += [_to_gpu(o, dtype, "torch"), torch.from_numpy(lse).cuda().float()]
    out, lse = cupyflash.merge_states(*states)
    assert out.dtype == getattr(torch, dtype) and lse.dtype == torch.float32
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    out64 = reference.to_numpy64(out)
    assert not np.isnan(out64).any()
    assert rel_error(out64, ref) <= BOUND.get(dtype, 1e-5)
    check_lse(reference.to_numpy64(lse), ref_lse, atol=1e-4)


def _gpu_entries(torch: Any) -> dict[str, Any]:
    """entry -> fn(causal=..., scale=...) on GPU inputs (attention itself: test_gpu_pipeline.py)."""
    n = 37
    q, k, v = (
        torch.randn(*s, device="cuda", dtype=torch.float16)
        for s in ((1, n, 4, 64), (1, n + 9, 2, 64), (1, n + 9, 2, 64))
    )
    cu_q = torch.tensor([0, 2, n], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 4, n + 9], dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([n], dtype=torch.int32, device="cuda")
    return {
        "varlen": lambda **kw: cupyflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, n - 2, n + 5, **kw),
        "kvcache": lambda **kw: cupyflash.attention_with_kvcache(q[:, :3], k, v, cache_seqlens=seqlens, **kw),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["varlen", "kvcache"])
def test_gpu_numpy_scalar_options_cold_and_warm(entry):
    """NumPy scalars on a cold plan cache, then Python ones on the warm cache: the same bits;
    causal=1.0 (and 1) refused on a cold and on a warm cache (1.0 == True hashes alike: a cache
    keyed on the raw options would take it once True has run)."""
    from cupyflash import _plan

    torch = need_torch()
    call = _gpu_entries(torch)[entry]
    _plan.clear_caches()
    cold = call(causal=np.True_, scale=np.float32(0.125))
    warm = call(causal=True, scale=0.125)
    assert torch.equal(cold, warm)
    assert torch.equal(call(causal=np.True_, scale=np.float32(0.125)), warm)
    for order in ("cold", "warm"):
        if order == "cold":
            _plan.clear_caches()
        for causal in (1.0, 1):
            with pytest.raises(ValueError, match="causal must be a bool"):
                call(causal=causal)
        call(causal=True)
