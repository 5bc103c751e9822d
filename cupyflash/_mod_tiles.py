"""What a mask_mod shows over a tile, read from its trace alone (no evaluation per score).

Without a BlockMask the kernels evaluate mask_mod at every score of every tile they visit. Over a
tile of query rows [r0, r1] and keys [k0, k1] of one (b, h), each integer node of the traced mask
takes values in an interval and each boolean node may be false, true or both; carried up the tree
(interval arithmetic; Python's ``//`` and ``%`` by a constant; three-valued ``& | ~``), the root
says whether the mask certainly hides every score of the tile (the kernels skip it: no K/V load,
no MMA), certainly shows every one (score_mod alone, the mask not evaluated), or may do either
(mixed: evaluated per score, as without this). Causal, sliding windows, prefix-LM, chunked local
attention and the index terms of a mask that also reads captured arrays come out exact at tile
granularity; what intervals cannot bound (a captured array's values, a float) counts as either.
Every answer other than mixed holds for every score of the tile (interval arithmetic only widens).

Two readers of one rule, as ``_mods`` has for the scores: ``tile_classes`` (NumPy, any number of
tiles at once: the reference the tests hold the kernels' C to) and ``cuda_source``
(``cf_user_mask_tile``, one tile, in the kernels). Integer endpoints are doubles holding 32-bit
integers: a value past them becomes unbounded (still sound), and ``//`` and ``%`` by a constant
run on ints.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._mods import BOOL, FLOAT, INT, Expr, Mod

#: Tile classes, as kernels_cu/variants.cuh's kMaskCell* and xp_impl's MASK_CELL_*.
HIDDEN, MIXED, PLAIN = 0, 1, 2

#: Endpoints past this magnitude are unbounded: every bounded endpoint is a 32-bit integer (the
#: kernels' // and % run on ints: 64-bit division is a long subroutine that costs registers).
_EXACT = 2.0**31 - 1


def _widen(lo: Any, hi: Any) -> tuple[Any, Any]:
    return np.where(np.abs(lo) > _EXACT, -np.inf, lo), np.where(np.abs(hi) > _EXACT, np.inf, hi)


def _constant(e: Expr) -> int | None:
    """A divisor written as a nonzero integer constant, else None (the two readers agree on it)."""
    if e.op != "const" or e.kind != INT or not e.args[0] or abs(e.args[0]) > _EXACT:
        return None
    return int(e.args[0])


def _floordiv(a: Any, c: int) -> Any:
    """Python's a // c on finite endpoints (32-bit integers: _EXACT), infinities kept."""
    finite = np.isfinite(a)
    exact = np.floor_divide(np.where(finite, a, 0).astype(np.int64), c).astype(np.float64)
    return np.where(finite, exact, a if c > 0 else -a)


def tile_classes(mask: Mod, b: Any, h: Any, rows: tuple[Any, Any], keys: tuple[Any, Any]) -> Any:
    """HIDDEN / MIXED / PLAIN (int8) of the tiles of query rows [rows[0], rows[1]] and keys
    [keys[0], keys[1]] (inclusive, broadcastable integer arrays) of batch entry ``b`` and query
    head ``h`` (arrays too), from the traced ``mask`` alone."""
    unknown_int = (np.float64(-np.inf), np.float64(np.inf))
    unknown_bool = (np.bool_(True), np.bool_(True))  # (may be false, may be true)
    args = {
        "b": (np.asarray(b, np.float64),) * 2,
        "h": (np.asarray(h, np.float64),) * 2,
        "q_idx": (np.asarray(rows[0], np.float64), np.asarray(rows[1], np.float64)),
        "kv_idx": (np.asarray(keys[0], np.float64), np.asarray(keys[1], np.float64)),
    }
    memo: dict[int, Any] = {}

    def run(e: Expr) -> Any:  # INT: (lo, hi); BOOL: (may_false, may_true); FLOAT: None
        if id(e) in memo:
            return memo[id(e)]
        op, a = e.op, e.args
        out: Any
        if e.kind == FLOAT:
            out = None
        elif op == "arg":
            out = args[a[0]]
        elif op == "const":
            out = (np.float64(a[0]),) * 2 if e.kind == INT else (np.bool_(not a[0]), np.bool_(a[0]))
        elif op == "index":
            out = unknown_int if e.kind == INT else unknown_bool
        elif e.kind == INT:
            out = _int(op, [run(x) for x in a], [x.kind for x in a], a)
            out = unknown_int if out is None else _widen(*out)
        else:
            out = _bool(op, [run(x) for x in a], [x.kind for x in a])
        memo[id(e)] = out
        return out

    def _int(op: str, xs: list[Any], kinds: list[str], operands: tuple[Expr, ...]) -> Any:
        if op == "where":
            (maybe_false, maybe_true), (alo, ahi), (blo, bhi) = xs
            lo = np.where(maybe_true, np.where(maybe_false, np.minimum(alo, blo), alo), blo)
            hi = np.where(maybe_true, np.where(maybe_false, np.maximum(ahi, bhi), ahi), bhi)
            return lo, hi
        if any(k != INT for k in kinds):
            return None
        if op == "neg":
            return -xs[0][1], -xs[0][0]
        if op == "abs":
            lo, hi = xs[0]
            return (np.where(lo >= 0, lo, np.where(hi <= 0, -hi, 0.0)), np.maximum(np.abs(lo), np.abs(hi)))
        (alo, ahi), (blo, bhi) = xs
        if op == "add":
            return alo + blo, ahi + bhi
        if op == "sub":
            return alo - bhi, ahi - blo
        if op == "minimum":
            return np.minimum(alo, blo), np.minimum(ahi, bhi)
        if op == "maximum":
            return np.maximum(alo, blo), np.maximum(ahi, bhi)
        if op == "mul":
            with np.errstate(invalid="ignore"):  # 0 * inf: either end unbounded
                ends = [x * y for x in (alo, ahi) for y in (blo, bhi)]
            return (
                np.minimum.reduce([np.where(np.isnan(p), -np.inf, p) for p in ends]),
                np.maximum.reduce([np.where(np.isnan(p), np.inf, p) for p in ends]),
            )
        c = _constant(operands[1])
        if c is None:  # a divisor that is not a number in the function's text
            return None
        if op == "floordiv":  # monotone in a: increasing for c > 0, decreasing for c < 0
            lo, hi = _floordiv(alo, c), _floordiv(ahi, c)
            return (lo, hi) if c > 0 else (hi, lo)
        if op == "mod":  # a - c (a // c): exact where the tile stays in one quotient
            one = np.isfinite(alo) & np.isfinite(ahi) & (_floordiv(alo, c) == _floordiv(ahi, c))
            k = np.where(one, _floordiv(alo, c), 0.0)
            lo, hi = (0.0, c - 1.0) if c > 0 else (c + 1.0, 0.0)
            return np.where(one, alo - c * k, lo), np.where(one, ahi - c * k, hi)
        return None

    def _bool(op: str, xs: list[Any], kinds: list[str]) -> Any:
        if op == "not":
            return xs[0][1], xs[0][0]
        if op in ("and", "or"):
            (af, at), (bf, bt) = xs
            return (af | bf, at & bt) if op == "and" else (af & bf, at | bt)
        if op == "where":
            (cf, ct), (af, at), (bf, bt) = xs
            return (ct & af) | (cf & bf), (ct & at) | (cf & bt)
        if op in ("lt", "le", "gt", "ge", "eq", "ne") and kinds == [INT, INT]:
            (alo, ahi), (blo, bhi) = xs
            if op in ("gt", "ge"):  # a > b as b < a
                (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), "lt" if op == "gt" else "le"
            if op == "lt":
                return ahi >= blo, alo < bhi
            if op == "le":
                return ahi > blo, alo <= bhi
            overlap = (alo <= bhi) & (blo <= ahi)
            same = (alo == ahi) & (blo == bhi) & (alo == blo)
            return (~same, overlap) if op == "eq" else (overlap, ~same)
        return unknown_bool

    may_false, may_true = run(mask.expr)
    classes = np.where(~np.asarray(may_true), HIDDEN, np.where(~np.asarray(may_false), PLAIN, MIXED))
    return classes.astype(np.int8)


# ---------------------------------------------------------------------------------------------
# CUDA C: the same rule for one tile.
# ---------------------------------------------------------------------------------------------
#: Interval helpers (include once). Doubles holding 32-bit integers (past them: unbounded).
CUDA_HELPERS = """\
#ifndef CF_TILE_INF  // (NVRTC has no INFINITY)
#define CF_TILE_INF __longlong_as_double(0x7ff0000000000000LL)
#endif
__device__ __forceinline__ double cf_tile_lo(double x) { return fabs(x) > 2147483647.0 ? -CF_TILE_INF : x; }
__device__ __forceinline__ double cf_tile_hi(double x) { return fabs(x) > 2147483647.0 ? CF_TILE_INF : x; }
__device__ __forceinline__ double cf_tile_nan_lo(double x) { return x != x ? -CF_TILE_INF : x; }
__device__ __forceinline__ double cf_tile_nan_hi(double x) { return x != x ? CF_TILE_INF : x; }
// Python's a // c of a finite endpoint (a 32-bit integer, c a literal); an infinite one stays
// (its sign by c's)
__device__ __forceinline__ double cf_tile_floordiv(double a, int c) {
  if (isinf(a)) return c > 0 ? a : -a;
  const int x = (int)a, q = x / c;
  return (double)((x % c != 0 && ((x < 0) != (c < 0))) ? q - 1 : q);
}
"""


def cuda_source(mask: Mod | None) -> str:
    """``cf_user_mask_tile(p, b, h, row_first, row_last, key_first, key_last)``: the class
    (kMaskCellHidden / Mixed / Plain) of a tile of ``mask`` (inclusive bounds), as
    ``tile_classes``; mixed for every tile without a mask. Include CUDA_HELPERS before it."""
    head = (
        "__device__ __forceinline__ int cf_user_mask_tile(const AttnParams& p, int b, int h, int row_first,\n"
        "                                                 int row_last, int key_first, int key_last) {\n"
    )
    if mask is None:
        return head + "  return 1;\n}\n"
    lines: list[str] = []
    names: dict[int, tuple[str, str] | None] = {}
    unknown_int, unknown_bool = ("-CF_TILE_INF", "CF_TILE_INF"), ("true", "true")
    args = {
        "b": ("(double)b", "(double)b"),
        "h": ("(double)h", "(double)h"),
        "q_idx": ("(double)row_first", "(double)row_last"),
        "kv_idx": ("(double)key_first", "(double)key_last"),
    }

    def new(kind: str, lo: str, hi: str) -> tuple[str, str]:
        n = len(lines)
        if kind == INT:
            lines.append(f"  const double i{n}_lo = cf_tile_lo({lo}), i{n}_hi = cf_tile_hi({hi});")
            return f"i{n}_lo", f"i{n}_hi"
        lines.append(f"  const bool b{n}_f = {lo}, b{n}_t = {hi};")
        return f"b{n}_f", f"b{n}_t"

    def emit(e: Expr) -> tuple[str, str] | None:
        if id(e) in names:
            return names[id(e)]
        op, a = e.op, e.args
        out: tuple[str, str] | None
        if e.kind == FLOAT:
            out = None
        elif op == "arg":
            out = args[a[0]]
        elif op == "const":
            out = (f"{float(a[0])!r}",) * 2 if e.kind == INT else (("false", "true") if a[0] else ("true", "false"))
        elif op == "index":
            out = unknown_int if e.kind == INT else unknown_bool
        elif e.kind == INT:
            ends = _c_int(op, [emit(x) for x in a], [x.kind for x in a], a)
            out = unknown_int if ends is None else new(INT, *ends)
        else:
            out = new(BOOL, *_c_bool(op, [emit(x) for x in a], [x.kind for x in a]))
        names[id(e)] = out
        return out

    def _c_int(op: str, xs: list[Any], kinds: list[str], operands: tuple[Expr, ...]) -> tuple[str, str] | None:
        if op == "where":
            (cf, ct), (alo, ahi), (blo, bhi) = xs
            return (
                f"({ct} ? ({cf} ? fmin({alo}, {blo}) : {alo}) : {blo})",
                f"({ct} ? ({cf} ? fmax({ahi}, {bhi}) : {ahi}) : {bhi})",
            )
        if any(k != INT for k in kinds):
            return None
        if op == "neg":
            return f"-({xs[0][1]})", f"-({xs[0][0]})"
        if op == "abs":
            lo, hi = xs[0]
            return f"({lo} >= 0.0 ? {lo} : {hi} <= 0.0 ? -({hi}) : 0.0)", f"fmax(fabs({lo}), fabs({hi}))"
        (alo, ahi), (blo, bhi) = xs
        if op == "add":
            return f"{alo} + {blo}", f"{ahi} + {bhi}"
        if op == "sub":
            return f"{alo} - {bhi}", f"{ahi} - {blo}"
        if op in ("minimum", "maximum"):
            f = "fmin" if op == "minimum" else "fmax"
            return f"{f}({alo}, {blo})", f"{f}({ahi}, {bhi})"
        if op == "mul":
            ends = [f"{x} * {y}" for x in (alo, ahi) for y in (blo, bhi)]
            lo = "fmin(fmin(cf_tile_nan_lo({}), cf_tile_nan_lo({})), fmin(cf_tile_nan_lo({}), cf_tile_nan_lo({})))"
            hi = "fmax(fmax(cf_tile_nan_hi({}), cf_tile_nan_hi({})), fmax(cf_tile_nan_hi({}), cf_tile_nan_hi({})))"
            return lo.format(*ends), hi.format(*ends)
        c = _constant(operands[1])
        if c is None:
            return None
        if op == "floordiv":
            lo, hi = f"cf_tile_floordiv({alo}, {c})", f"cf_tile_floordiv({ahi}, {c})"
            return (lo, hi) if c > 0 else (hi, lo)
        if op == "mod":
            n = len(lines)
            lines.append(
                f"  const bool m{n} = !isinf({alo}) && !isinf({ahi}) && "
                f"cf_tile_floordiv({alo}, {c}) == cf_tile_floordiv({ahi}, {c});"
            )
            lines.append(f"  const double k{n} = m{n} ? cf_tile_floordiv({alo}, {c}) : 0.0;")
            lo, hi = (0.0, c - 1.0) if c > 0 else (c + 1.0, 0.0)
            return f"(m{n} ? {alo} - {c}.0 * k{n} : {lo!r})", f"(m{n} ? {ahi} - {c}.0 * k{n} : {hi!r})"
        return None

    def _c_bool(op: str, xs: list[Any], kinds: list[str]) -> tuple[str, str]:
        if op == "not":
            return xs[0][1], xs[0][0]
        if op in ("and", "or"):
            (af, at), (bf, bt) = xs
            if op == "and":
                return f"({af} || {bf})", f"({at} && {bt})"
            return f"({af} && {bf})", f"({at} || {bt})"
        if op == "where":
            (cf, ct), (af, at), (bf, bt) = xs
            return f"(({ct} && {af}) || ({cf} && {bf}))", f"(({ct} && {at}) || ({cf} && {bt}))"
        if op in ("lt", "le", "gt", "ge", "eq", "ne") and kinds == [INT, INT]:
            (alo, ahi), (blo, bhi) = xs
            if op in ("gt", "ge"):
                (alo, ahi), (blo, bhi), op = (blo, bhi), (alo, ahi), "lt" if op == "gt" else "le"
            if op == "lt":
                return f"({ahi} >= {blo})", f"({alo} < {bhi})"
            if op == "le":
                return f"({ahi} > {blo})", f"({alo} <= {bhi})"
            overlap = f"({alo} <= {bhi} && {blo} <= {ahi})"
            same = f"({alo} == {ahi} && {blo} == {bhi} && {alo} == {blo})"
            return (f"!{same}", overlap) if op == "eq" else (overlap, f"!{same}")
        return unknown_bool

    result = emit(mask.expr)
    assert result is not None
    body = "\n".join(lines)
    return head + (body + "\n" if body else "") + f"  return !({result[1]}) ? 0 : !({result[0]}) ? 2 : 1;\n}}\n"


def kernel_source(mask: Mod | None) -> str:
    """What ``_mods.kernel_mods`` appends for the kernels to class their tiles by ``mask``
    (variants.cuh's user_mask_tile_state reads cf_user_mask_tile where CF_USER_MASK_TILES is
    defined); "" without a mask."""
    if mask is None:
        return ""
    return "#define CF_USER_MASK_TILES\n" + CUDA_HELPERS + cuda_source(mask)
