"""User score and mask functions as expressions (FlexAttention's ``score_mod`` / ``mask_mod``).

A plain Python function is called once on symbolic values (``Sym``) that record what it does
into an expression tree (``Expr``): arithmetic, comparisons, logical ``& | ~``, ``where``, ``abs``,
``exp``, ``log``, ``tanh``, ``minimum``, ``maximum``, Python number constants, and indexing of
captured 1-D / 2-D arrays by index expressions. The tree is the function's identity (``Mod.key``:
captured arrays appear as buffer slots with their shape and dtype, never their values), and it
has two readers: ``evaluate`` (the host path, in the arrays' own array-API namespace) and
``cuda_source`` (a ``__device__`` function for the kernels' score hook).

Python control flow on a traced value (``if``, ``bool``, ``int``, ``float``) cannot be recorded,
so it is refused with a TypeError that names the operation and the way out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import numbers
import operator
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

#: The values a node yields: float32 scores, integer indices, booleans.
FLOAT, INT, BOOL = "float", "int", "bool"

_ARGS = {"score": FLOAT, "b": INT, "h": INT, "q_idx": INT, "kv_idx": INT}
_UNARY = ("neg", "abs", "exp", "log", "tanh", "not")
_ARITH = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LOGIC = {"and": "&", "or": "|"}


@dataclass(frozen=True, slots=True)
class Expr:
    """One node: ``op`` ("arg", "const", "buf", "index", an operator or a function), the kind of
    value it yields, and its operands (nodes, or for leaves a name, a number or a buffer spec)."""

    op: str
    kind: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """A captured array as the expression sees it: its slot (order of first use), shape, dtype."""

    slot: int
    shape: tuple[int, ...]
    dtype: str


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1].removeprefix("dtype('").removesuffix("')")


def _kind_of_dtype(name: str) -> str:
    if name == "bool":
        return BOOL
    return INT if "int" in name else FLOAT


class _Trace:
    """The buffers a trace has met, by identity, in order of first use."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.arrays: list[Any] = []
        self.specs: list[BufferSpec] = []

    def buffer(self, array: Any) -> BufferSpec:
        for spec, seen in zip(self.specs, self.arrays):
            if seen is array:
                return spec
        spec = BufferSpec(len(self.specs), tuple(int(n) for n in array.shape), _dtype_name(array.dtype))
        self.arrays.append(array)
        self.specs.append(spec)
        return spec


def _promote(a: str, b: str) -> str:
    if FLOAT in (a, b):
        return FLOAT
    return INT


class Sym:
    """A traced value: every operation on it records a node instead of computing."""

    __slots__ = ("expr", "trace")
    __array_ufunc__ = None  # NumPy defers to our reflected operators (array * sym -> Sym.__rmul__)
    __array_priority__ = 1000

    def __init__(self, expr: Expr, trace: _Trace) -> None:
        self.expr = expr
        self.trace = trace

    def _lift(self, other: Any, what: str) -> Expr:
        return _lift(other, self.trace, what)

    def _binary(self, op: str, other: Any, reflected: bool = False) -> Sym:
        a, b = self.expr, self._lift(other, _ARITH.get(op) or _COMPARE.get(op) or _LOGIC[op])
        if reflected:
            a, b = b, a
        if op in _LOGIC:
            if a.kind != BOOL or b.kind != BOOL:
                raise TypeError(
                    f"{self.trace.role} uses `{_LOGIC[op]}` on a non-boolean traced value: `&`, `|` and `~` are "
                    "logical (and, or, not) on comparisons"
                )
            kind = BOOL
        elif op in _COMPARE:
            _no_bool_arith(self.trace, a, b, _COMPARE[op])
            kind = BOOL
        else:
            _no_bool_arith(self.trace, a, b, _ARITH[op])
            kind = FLOAT if op == "truediv" else _promote(a.kind, b.kind)
        return Sym(Expr(op, kind, (a, b)), self.trace)

    def __add__(self, o: Any) -> Sym:
        return self._binary("add", o)

    def __radd__(self, o: Any) -> Sym:
        return self._binary("add", o, True)

    def __sub__(self, o: Any) -> Sym:
        return self._binary("sub", o)

    def __rsub__(self, o: Any) -> Sym:
        return self._binary("sub", o, True)

    def __mul__(self, o: Any) -> Sym:
        return self._binary("mul", o)

    def __rmul__(self, o: Any) -> Sym:
        return self._binary("mul", o, True)

    def __truediv__(self, o: Any) -> Sym:
        return self._binary("truediv", o)

    def __rtruediv__(self, o: Any) -> Sym:
        return self._binary("truediv", o, True)

    def __floordiv__(self, o: Any) -> Sym:
        return self._binary("floordiv", o)

    def __rfloordiv__(self, o: Any) -> Sym:
        return self._binary("floordiv", o, True)

    def __mod__(self, o: Any) -> Sym:
        return self._binary("mod", o)

    def __rmod__(self, o: Any) -> Sym:
        return self._binary("mod", o, True)

    def __lt__(self, o: Any) -> Sym:
        return self._binary("lt", o)

    def __le__(self, o: Any) -> Sym:
        return self._binary("le", o)

    def __gt__(self, o: Any) -> Sym:
        return self._binary("gt", o)

    def __ge__(self, o: Any) -> Sym:
        return self._binary("ge", o)

    def __eq__(self, o: Any) -> Sym:  # type: ignore[override]
        return self._binary("eq", o)

    def __ne__(self, o: Any) -> Sym:  # type: ignore[override]
        return self._binary("ne", o)

    def __and__(self, o: Any) -> Sym:
        return self._binary("and", o)

    def __rand__(self, o: Any) -> Sym:
        return self._binary("and", o, True)

    def __or__(self, o: Any) -> Sym:
        return self._binary("or", o)

    def __ror__(self, o: Any) -> Sym:
        return self._binary("or", o, True)

    def __neg__(self) -> Sym:
        return _unary("neg", self)

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        return _unary("abs", self)

    def __invert__(self) -> Sym:
        return _unary("not", self)

    __hash__ = None  # type: ignore[assignment]

    def _refuse(self, operation: str) -> Any:
        raise TypeError(
            f"{self.trace.role} uses {operation} on a traced value: Python control flow cannot depend on the "
            "scores or indices; use cupyflash.mods.where (and &, |, ~ for and, or, not)"
        )

    def __bool__(self) -> bool:
        return bool(self._refuse("`if` (or bool(), and, or, not)"))

    def __int__(self) -> int:
        return int(self._refuse("int()"))

    def __float__(self) -> float:
        return float(self._refuse("float()"))

    def __index__(self) -> int:
        return int(self._refuse("an index into a Python sequence or an array it did not capture"))

    def __iter__(self) -> Any:
        return self._refuse("iteration")

    def __pow__(self, o: Any) -> Any:
        return self._refuse("`**`")

    __rpow__ = __pow__

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse(
            "a NumPy function, or indexes an array it reaches other than as a closure variable, global or default "
            "(use the functions of cupyflash.mods; capture arrays in a closure)"
        )


def _no_bool_arith(trace: _Trace, a: Expr, b: Expr, symbol: str) -> None:
    if a.kind == BOOL or b.kind == BOOL:
        raise TypeError(f"{trace.role} uses `{symbol}` on a boolean traced value: use cupyflash.mods.where")


def _lift(value: Any, trace: _Trace, what: str) -> Expr:
    if isinstance(value, Sym):
        return value.expr
    if isinstance(value, bool):
        return Expr("const", BOOL, (value,))
    if isinstance(value, numbers.Integral):
        return Expr("const", INT, (int(value),))
    if isinstance(value, numbers.Real):
        return Expr("const", FLOAT, (float(value),))
    raise TypeError(
        f"{trace.role} uses `{what}` with a {type(value).__name__}: a traced expression takes Python numbers, "
        "traced values, and captured 1-D / 2-D arrays indexed by traced values"
    )


def _unary(op: str, x: Any) -> Any:
    if not isinstance(x, Sym):
        raise TypeError(f"{op} of a {type(x).__name__} is not traced")
    kind = x.expr.kind
    if op == "not":
        if kind != BOOL:
            raise TypeError(f"{x.trace.role} uses `~` on a non-boolean traced value: `~` is logical not")
    elif kind == BOOL:
        raise TypeError(f"{x.trace.role} uses {op} on a boolean traced value: use cupyflash.mods.where")
    elif op in ("exp", "log", "tanh"):
        kind = FLOAT
    return Sym(Expr(op, kind, (x.expr,)), x.trace)


class TracedBuffer:
    """A captured 1-D / 2-D array during a trace: indexing it by traced values records a read."""

    __slots__ = ("array", "name", "trace")

    def __init__(self, array: Any, name: str, trace: _Trace) -> None:
        self.array, self.name, self.trace = array, name, trace

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.array.shape)

    def __getitem__(self, index: Any) -> Sym:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != len(self.shape):
            raise TypeError(
                f"{self.trace.role} indexes the captured {len(self.shape)}-D array {self.name!r} with {len(index)} "
                f"index{'es' if len(index) != 1 else ''}: give one index expression per axis"
            )
        exprs = tuple(_lift(i, self.trace, f"{self.name}[...]") for i in index)
        if any(e.kind != INT for e in exprs):
            raise TypeError(f"{self.trace.role} indexes {self.name!r} with a non-integer expression")
        spec = self.trace.buffer(self.array)
        kind = _kind_of_dtype(spec.dtype)
        return Sym(Expr("index", kind, (Expr("buf", kind, (spec,)), *exprs)), self.trace)

    def __getattr__(self, name: str) -> Any:
        raise TypeError(
            f"{self.trace.role} uses {self.name}.{name} of a captured array: only indexing by traced values is traced"
        )


def _is_array(x: Any) -> bool:
    return not isinstance(x, (Sym, type)) and hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")


def _empty(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a free variable not assigned yet
        return True
    return False


#: Packages whose functions the trace does not enter looking for captured arrays: a function may
#: call them, but what they read is theirs, not the caller's.
_LIBRARY_PACKAGES = frozenset(
    {"cupyflash", "numpy", "cupy", "cupyx", "torch", "jax", "jaxlib", "array_api_compat", "array_api_strict", "math"}
)
#: How deep the trace follows functions calling functions (``and_masks(causal, document)``'s
#: masks are one level down).
_MAX_NESTING = 4

#: A place a function reads: ("cell", i), ("default", i) or ("global", name).
Step = tuple[str, Any]


def _entered(x: Any) -> bool:
    """Whether the trace looks inside ``x`` for captured arrays: a plain Python function of the
    caller's own (a mask a mask calls) or ``and_masks`` / ``or_masks``', not a library's."""
    if not isinstance(x, types.FunctionType):
        return False
    return x.__code__ in _COMPOSERS or (x.__module__ or "").split(".")[0] not in _LIBRARY_PACKAGES


def _functions_in(x: Any) -> list[tuple[Step, Any]]:
    """What the trace enters of a value a function reads: the value itself (``("", None)``), or
    the functions in a tuple or list of them (``("item", k)``: and_masks' masks)."""
    if _entered(x):
        return [(("", None), x)]
    if isinstance(x, (tuple, list)) and len(x) <= 64:
        return [(("item", k), f) for k, f in enumerate(x) if _entered(f)]
    return []


def _own_reads(fn: types.FunctionType) -> list[tuple[Step, Any]]:
    """``fn``'s closure cells, defaults and the globals it names, with their values."""
    found: list[tuple[Step, Any]] = [
        (("cell", i), c.cell_contents) for i, c in enumerate(fn.__closure__ or ()) if not _empty(c)
    ]
    found += [(("default", i), d) for i, d in enumerate(fn.__defaults__ or ())]
    found += [(("global", n), fn.__globals__[n]) for n in fn.__code__.co_names if n in fn.__globals__]
    return found


def reads(fn: Callable[..., Any]) -> list[tuple[tuple[Step, ...], Any]]:
    """What ``fn`` reads besides its arguments, where the trace looks for captured arrays: its
    closure cells, defaults and the globals it names, and through the functions among them that
    it may call (``_entered``, up to ``_MAX_NESTING`` deep) theirs; each as ``(path, value)``,
    ``path`` the steps from ``fn`` (``(("cell", 0), ("global", "doc_id"))``: the global doc_id of
    the function in fn's first closure cell). Nothing for a callable that is not a plain function
    (its arrays are not captured: indexing one by a traced value is refused)."""
    found: list[tuple[tuple[Step, ...], Any]] = []

    def visit(f: types.FunctionType, path: tuple[Step, ...], depth: int, entered: set[int]) -> None:
        for step, value in _own_reads(f):
            found.append(((*path, step), value))
            for item, inner in _functions_in(value):
                if id(inner) not in entered and depth < _MAX_NESTING:  # (the depth _with_buffers enters)
                    inner_path = (*path, step) if item[0] == "" else (*path, step, item)
                    visit(inner, inner_path, depth + 1, entered | {id(inner)})

    if isinstance(fn, types.FunctionType):
        visit(fn, (), 0, {id(fn)})
    return found


def _with_buffers(fn: Callable[..., Any], trace: _Trace) -> Callable[..., Any]:
    """``fn`` with the 1-D / 2-D arrays it captures (``reads``) replaced by ``TracedBuffer``s, so
    that ``doc_id[q_idx]`` records a read; a function it may call (``_entered``) likewise."""
    made: dict[int, Any] = {}

    def rebuilt(f: Any, depth: int) -> Any:
        if not isinstance(f, types.FunctionType):
            return f
        if id(f) in made:  # called twice, or recursive: one copy
            return made[id(f)]
        made[id(f)] = f  # (itself while its reads are rebuilt)
        code = f.__code__

        def name(kind: str, at: Any) -> str:  # the captured variable's, for messages
            return str(code.co_freevars[at] if kind == "cell" else at if kind == "global" else "default")

        swapped: dict[Step, Any] = {}
        for where, x in _own_reads(f):
            if _is_array(x) and x.ndim in (1, 2):
                swapped[where] = TracedBuffer(x, name(*where), trace)
            elif depth < _MAX_NESTING and _entered(x) and (inner := rebuilt(x, depth + 1)) is not x:
                swapped[where] = inner
            elif depth < _MAX_NESTING and isinstance(x, (tuple, list)) and _functions_in(x):  # and_masks' masks
                items = [rebuilt(y, depth + 1) if _entered(y) else y for y in x]
                if any(a is not b for a, b in zip(items, x, strict=True)):
                    swapped[where] = tuple(items) if isinstance(x, tuple) else items
        if swapped:
            cells = f.__closure__ or ()
            closure = tuple(
                types.CellType(swapped[("cell", i)]) if ("cell", i) in swapped else c for i, c in enumerate(cells)
            )
            namespace = f.__globals__
            if any(kind == "global" for kind, _ in swapped):
                namespace = dict(f.__globals__)
                namespace.update({n: x for (kind, n), x in swapped.items() if kind == "global"})
            defaults = f.__defaults__
            if defaults is not None:
                defaults = tuple(swapped.get(("default", i), d) for i, d in enumerate(defaults))
            made[id(f)] = types.FunctionType(code, namespace, f.__name__, defaults, closure or None)
        return made[id(f)]

    return rebuilt(fn, 0)


# ---------------------------------------------------------------------------------------------
# The functions users call inside a score_mod / mask_mod: traced on Sym, else the array's own.
# ---------------------------------------------------------------------------------------------
def _array_function(name: str, *xs: Any) -> Any:
    from array_api_compat import array_namespace

    arrays = [x for x in xs if not isinstance(x, (int, float, bool))]
    if not arrays:
        raise TypeError(f"cupyflash.mods.{name} takes arrays or traced values, got {[type(x).__name__ for x in xs]}")
    xp = array_namespace(*arrays)
    return getattr(xp, name)(*xs)


def _trace_of(xs: tuple[Any, ...]) -> _Trace | None:
    return next((x.trace for x in xs if isinstance(x, Sym)), None)


def where(condition: Any, x: Any, y: Any) -> Any:
    """``x`` where ``condition`` holds, else ``y`` (traced, or ``xp.where`` on arrays)."""
    trace = _trace_of((condition, x, y))
    if trace is None:
        return _array_function("where", condition, x, y)
    c, a, b = (_lift(v, trace, "where") for v in (condition, x, y))
    if c.kind != BOOL:
        raise TypeError(f"{trace.role} calls where with a non-boolean condition")
    if (a.kind == BOOL) != (b.kind == BOOL):
        raise TypeError(f"{trace.role} calls where with one boolean and one numeric branch")
    kind = BOOL if a.kind == BOOL else _promote(a.kind, b.kind)
    return Sym(Expr("where", kind, (c, a, b)), trace)


def _make_unary(name: str, op: str) -> Callable[[Any], Any]:
    def function(x: Any) -> Any:
        if isinstance(x, Sym):
            return _unary(op, x)
        return _array_function(name, x)

    function.__name__ = name
    function.__doc__ = f"``{name}(x)``: traced on a traced value, the array namespace's ``{name}`` on an array."
    return function


exp = _make_unary("exp", "exp")
log = _make_unary("log", "log")
tanh = _make_unary("tanh", "tanh")
abs = _make_unary("abs", "abs")  # noqa: A001 (the array API's name)


def _make_binary(name: str) -> Callable[[Any, Any], Any]:
    def function(x: Any, y: Any) -> Any:
        trace = _trace_of((x, y))
        if trace is None:
            return _array_function(name, x, y)
        a, b = _lift(x, trace, name), _lift(y, trace, name)
        _no_bool_arith(trace, a, b, name)
        return Sym(Expr(name, _promote(a.kind, b.kind), (a, b)), trace)

    function.__name__ = name
    function.__doc__ = f"``{name}(x, y)``, elementwise: traced on traced values, the array namespace's on arrays."
    return function


minimum = _make_binary("minimum")
maximum = _make_binary("maximum")


def and_masks(*mask_mods: Callable[..., Any]) -> Callable[..., Any]:
    """A mask_mod that shows a score where every one of ``mask_mods`` shows it (FlexAttention's
    ``and_masks``; none: every score). The masks' captured arrays are the result's: traced through
    it, so ``and_masks(causal, document)`` is one expression, the one written inline."""
    return _combined("and_masks", mask_mods, operator.and_, True)


def or_masks(*mask_mods: Callable[..., Any]) -> Callable[..., Any]:
    """A mask_mod that shows a score where any one of ``mask_mods`` shows it (FlexAttention's
    ``or_masks``; none: no score)."""
    return _combined("or_masks", mask_mods, operator.or_, False)


def _combined(name: str, mask_mods: tuple[Any, ...], both: Callable[[Any, Any], Any], empty: bool) -> Any:
    for k, mask_mod in enumerate(mask_mods):
        if not callable(mask_mod):
            raise TypeError(f"{name} takes mask_mod functions, got a {type(mask_mod).__name__} at position {k}")

    def combined(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if not mask_mods:
            return empty
        shown = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            shown = both(shown, mask_mod(b, h, q_idx, kv_idx))
        return shown

    combined.__name__ = combined.__qualname__ = name.removesuffix("s")
    return combined


#: The combined masks' code: the trace enters them (and the masks they hold) though they are ours.
_COMPOSERS = frozenset({_combined("", (), operator.and_, True).__code__})


# ---------------------------------------------------------------------------------------------
# Tracing.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Mod:
    """A traced score_mod or mask_mod: its expression, the captured arrays (slot order) and the
    key that identifies it (the expression, with buffer shapes and dtypes but not values)."""

    role: str  # "score_mod" or "mask_mod"
    expr: Expr
    buffers: tuple[Any, ...]

    @property
    def key(self) -> tuple[str, Expr]:
        return (self.role, self.expr)

    @property
    def name(self) -> str:
        """``cf_<role>_<12 hex digits of the key>``: the device function's name."""
        digest = hashlib.sha256(repr(self.key).encode()).hexdigest()[:12]
        return f"cf_{self.role}_{digest}"


def _trace(fn: Callable[..., Any], role: str, params: tuple[str, ...]) -> Mod:
    if not callable(fn):
        raise TypeError(f"{role} must be a function, got {type(fn).__name__}")
    trace = _Trace(role)
    args = [Sym(Expr("arg", _ARGS[p], (p,)), trace) for p in params]
    try:
        result = _with_buffers(fn, trace)(*args)
    except TypeError as error:
        if "does not support ufuncs" not in str(error):
            raise
        raise TypeError(
            f"{role} uses a NumPy function on a traced value: use the functions of cupyflash.mods (where, exp, log, "
            "tanh, abs, minimum, maximum)"
        ) from None
    except IndexError as error:  # an array the function reaches by a route we do not rewrite
        raise TypeError(
            f"{role} indexes an array that is not a captured 1-D / 2-D array (a closure variable or a global of "
            f"the function): {error}"
        ) from None
    out = _lift(result, trace, "its return value")
    if role == "mask_mod" and out.kind != BOOL:
        raise TypeError(f"mask_mod must return a boolean (a comparison, or & | ~ of them), got a {out.kind} value")
    if role == "score_mod" and out.kind == BOOL:
        raise TypeError("score_mod must return a score (a number), got a boolean: a mask is mask_mod's")
    return Mod(role, out, tuple(trace.arrays))


def trace_score_mod(fn: Callable[..., Any]) -> Mod:
    """``fn(score, b, h, q_idx, kv_idx) -> score``, traced."""
    return _trace(fn, "score_mod", ("score", "b", "h", "q_idx", "kv_idx"))


def trace_mask_mod(fn: Callable[..., Any]) -> Mod:
    """``fn(b, h, q_idx, kv_idx) -> bool``, traced."""
    return _trace(fn, "mask_mod", ("b", "h", "q_idx", "kv_idx"))


# ---------------------------------------------------------------------------------------------
# A call's pair without its arrays: what stays fixed while the arrays change, the static part of
# a traced call (the torch custom ops' text argument, the JAX custom calls' key).
# ---------------------------------------------------------------------------------------------
#: score_mod's and mask_mod's (expression, number of captured arrays), None where not given.
Static = tuple[tuple[Expr, int] | None, tuple[Expr, int] | None]

_ROLES = ("score_mod", "mask_mod")


def static(score_mod: Mod | None, mask_mod: Mod | None) -> Static:
    """The pair's expressions, hashable and free of arrays (their slots keep shapes and dtypes)."""
    return (
        None if score_mod is None else (score_mod.expr, len(score_mod.buffers)),
        None if mask_mod is None else (mask_mod.expr, len(mask_mod.buffers)),
    )


def captured(score_mod: Mod | None, mask_mod: Mod | None) -> tuple[Any, ...]:
    """The pair's captured arrays: score_mod's, then mask_mod's, each in slot order."""
    return tuple(x for mod in (score_mod, mask_mod) if mod is not None for x in mod.buffers)


def rebuilt(pair: Static, arrays: Any) -> tuple[Mod | None, Mod | None]:
    """The pair of ``static`` again, on ``arrays`` (``captured``'s order; e.g. graph inputs or a
    custom call's operands, the same shapes and dtypes)."""
    arrays = tuple(arrays)
    mods: list[Mod | None] = []
    for role, part in zip(_ROLES, pair):
        if part is None:
            mods.append(None)
            continue
        expr, count = part
        mods.append(Mod(role, expr, arrays[:count]))
        arrays = arrays[count:]
    return mods[0], mods[1]


def encode(pair: Static) -> str:
    """``pair`` as text (JSON: the nodes in post-order, a shared node once, each naming its
    operands by position), a string argument of the torch custom ops. ``decode`` reads it back."""
    nodes: list[list[Any]] = []
    at: dict[int, int] = {}

    def visit(e: Expr) -> int:
        if id(e) not in at:
            if e.op == "buf":
                spec = e.args[0]
                payload = [spec.slot, list(spec.shape), spec.dtype]
            elif e.op in ("arg", "const"):
                payload = [e.args[0]]
            else:
                payload = [visit(a) for a in e.args]
            at[id(e)] = len(nodes)
            nodes.append([e.op, e.kind, *payload])
        return at[id(e)]

    roots = {role: [visit(part[0]), part[1]] for role, part in zip(_ROLES, pair) if part is not None}
    return json.dumps({"nodes": nodes, **roots}, separators=(",", ":"))


@functools.lru_cache(maxsize=256)
def decode(text: str) -> Static:
    """``encode``'s text as the pair of expressions (parsed once per text)."""
    data = json.loads(text)
    built: list[Expr] = []
    for op, kind, *payload in data["nodes"]:
        if op == "buf":
            args: tuple[Any, ...] = (BufferSpec(payload[0], tuple(payload[1]), payload[2]),)
        elif op in ("arg", "const"):
            args = (payload[0],)
        else:
            args = tuple(built[i] for i in payload)
        built.append(Expr(op, kind, args))
    parts = [(built[data[role][0]], data[role][1]) if role in data else None for role in _ROLES]
    return parts[0], parts[1]


# ---------------------------------------------------------------------------------------------
# The host path: the expression evaluated on arrays of one array-API namespace.
# ---------------------------------------------------------------------------------------------
def evaluate(xp: Any, mod: Mod, values: dict[str, Any], buffers: tuple[Any, ...], float_dtype: Any) -> Any:
    """The expression on arrays: ``values`` maps the arguments (score, b, h, q_idx, kv_idx) to
    mutually broadcastable arrays (integer indices, the score in ``float_dtype``); ``buffers``
    the captured arrays in ``xp``, slot order. Returns an array (or a Python number)."""
    memo: dict[int, Any] = {}
    wide = xp.arange(1).dtype  # the namespace's index integer: int64 (int32 in JAX without x64)
    # where the arguments are (a GPU for PyTorch's CUDA tensors): a constant made an array goes there
    from array_api_compat import device as array_device

    device = next((array_device(x) for x in values.values() if not isinstance(x, (bool, int, float))), None)

    def as_kind(x: Any, kind: str) -> Any:
        if kind == FLOAT:
            if isinstance(x, (bool, int)):
                return float(x)
            if not isinstance(x, float) and not xp.isdtype(x.dtype, "real floating"):
                return xp.astype(x, float_dtype)
        return x

    def array(x: Any, kind: str) -> Any:
        if isinstance(x, (bool, int, float)):
            dtype = xp.bool if kind == BOOL else float_dtype if kind == FLOAT else wide
            return xp.asarray(x, dtype=dtype, device=device)
        return x

    def run(e: Expr) -> Any:
        hit = memo.get(id(e))
        if hit is not None:
            return hit
        op, args = e.op, e.args
        if op == "arg":
            out = values[args[0]]
        elif op == "const":
            out = args[0]
        elif op == "index":
            indices = [array(run(i), INT) for i in args[1:]]
            out = _gather(xp, mod.role, buffers[args[0].args[0].slot], indices, wide)
            if e.kind == FLOAT:
                out = as_kind(out, e.kind)
            elif e.kind == INT and out.dtype != wide:  # int8 .. int32, uint8: 64-bit as the kernels' (JAX: 32)
                out = xp.astype(out, wide)  # (abs(-128) of an int8 array is 128, 200 + 100 is 300)
        elif op in _ARITH or op in ("minimum", "maximum"):
            a, b = (as_kind(run(x), e.kind) for x in args)
            if op in ("minimum", "maximum"):
                out = getattr(xp, op)(array(a, e.kind), array(b, e.kind))
            elif op == "truediv":
                out = as_kind(a, FLOAT) / as_kind(b, FLOAT)
            elif op == "add":
                out = a + b
            elif op == "sub":
                out = a - b
            elif op == "mul":
                out = a * b
            elif op == "floordiv":
                out = xp.floor_divide(array(a, e.kind), array(b, e.kind))
            else:
                out = xp.remainder(array(a, e.kind), array(b, e.kind))
        elif op in _COMPARE:
            kind = _promote(args[0].kind, args[1].kind) if BOOL not in (args[0].kind, args[1].kind) else BOOL
            a, b = (array(as_kind(run(x), kind), kind) for x in args)
            out = {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b, "eq": a == b, "ne": a != b}[op]
        elif op in _LOGIC:
            a, b = (array(run(x), BOOL) for x in args)
            out = xp.logical_and(a, b) if op == "and" else xp.logical_or(a, b)
        elif op == "not":
            out = xp.logical_not(array(run(args[0]), BOOL))
        elif op == "neg":
            out = -run(args[0])
        elif op in ("abs", "exp", "log", "tanh"):
            out = getattr(xp, op)(array(as_kind(run(args[0]), e.kind), e.kind))
        elif op == "where":
            c = array(run(args[0]), BOOL)
            a, b = (array(as_kind(run(x), e.kind), e.kind) for x in args[1:])
            out = xp.where(c, a, b)
        else:  # pragma: no cover - the tracer makes no other node
            raise AssertionError(op)
        memo[id(e)] = out
        return out

    return run(mod.expr)


def _gather(xp: Any, role: str, buffer: Any, indices: list[Any], wide: Any) -> Any:
    """``buffer[i, j]`` at broadcast integer index arrays (as ``wide`` integers), every index
    checked to lie in the array (Python would wrap a negative one; the kernels' functions make such
    a score NaN)."""
    indices = [xp.astype(i, wide) if i.dtype != wide else i for i in indices]
    indices = list(xp.broadcast_arrays(*indices)) if len(indices) > 1 else indices
    flat_index = indices[0]
    for axis, (i, n) in enumerate(zip(indices, buffer.shape)):
        if math.prod(i.shape) and (int(xp.min(i)) < 0 or int(xp.max(i)) >= n):
            raise IndexError(
                f"{role} reads a captured array of shape {tuple(buffer.shape)} at index {int(xp.min(i))} .. "
                f"{int(xp.max(i))} on axis {axis}: outside the array"
            )
        if axis:
            flat_index = flat_index * n + i
    shape = flat_index.shape
    flat = xp.take(xp.reshape(buffer, (-1,)), xp.reshape(flat_index, (-1,)), axis=0)
    return xp.reshape(flat, shape)


# ---------------------------------------------------------------------------------------------
# CUDA C: the expression as a __device__ function (float32 score, 64-bit integer indices).
# ---------------------------------------------------------------------------------------------
_C_TYPES = {FLOAT: "float", INT: "long long", BOOL: "bool"}
_C_ELEMENT = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long", "bool": "bool",
              "int16": "short", "uint8": "unsigned char", "int8": "signed char"}  # fmt: skip

#: Python's floor division and modulo on integers (C's truncate toward zero), in the 32 or 64
#: bits the operands are computed in. The functions use kernels_cu/common.cuh's ``fast_tanh``
#: too (params.cuh, included before them, includes it).
CUDA_HELPERS = """\
template <typename Int>
__device__ __forceinline__ Int cf_mods_floordiv(Int a, Int b) {
  const Int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <typename Int>
__device__ __forceinline__ Int cf_mods_mod(Int a, Int b) {
  const Int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ float cf_mods_fmod(float a, float b) { return a - b * floorf(a / b); }
// NaN in either gives NaN, as the array API's minimum / maximum (fminf / fmaxf drop it).
__device__ __forceinline__ float cf_mods_minimum(float a, float b) { return (a < b || a != a) ? a : b; }
__device__ __forceinline__ float cf_mods_maximum(float a, float b) { return (a > b || a != a) ? a : b; }
"""


def _c_const(value: Any, kind: str) -> str:
    if kind == BOOL:
        return "true" if value else "false"
    if kind == INT:
        return f"{int(value)}" if _INT32[0] <= int(value) <= _INT32[1] else f"{int(value)}LL"
    if math.isnan(value):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(value):
        return "__int_as_float(0x7f800000)" if value > 0 else "__int_as_float(0xff800000)"
    return f"{float(value)!r}f"


# Integer values as the kernels compute them: in 32 bits wherever the value and its operands
# provably fit (``_int_ranges``), else in 64 bits as the host path does. A 64-bit integer op is 2
# to 4 SASS instructions and a 64-bit int-to-float conversion a multi-cycle one, per score; a
# score costs the tensor cores about 1/8 of a cycle of an SM at d = 128, and an instruction per
# score 1/128 of one, so a few per score decide the kernel's speed.
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)
# b, h, q_idx and kv_idx: indices of the problem's grid, never negative and under 2^31 (a
# score's hook runs for row < Nq and key < Nk alone; a row's or a key's part also runs for the
# rows and keys of a tile past the sequence, whose values are then unused: variants.cuh's
# UserMods).
_INDEX_RANGE = (0, _INT32[1])
_ELEMENT_RANGE = {
    "int32": _INT32,
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int8": (-128, 127),
    "uint8": (0, 255),
    "bool": (0, 1),
}  # fmt: skip  (int64: none)
Range = tuple[int, int] | None


def _int_ranges(root: Expr, arguments: dict[str, Range] | None = None) -> dict[int, Range]:
    """The interval each integer (and boolean) node of ``root`` takes, by node id; None where it
    is not bounded (a 64-bit array's values, a division by a range holding 0). ``arguments``:
    the index arguments' intervals where a call bounds them (``Grid``), _INDEX_RANGE otherwise."""
    ranges: dict[int, Range] = {}
    arguments = arguments or {}

    def corners(values: list[int]) -> Range:
        return min(values), max(values)

    def of(e: Expr) -> Range:
        if id(e) in ranges:
            return ranges[id(e)]
        op, args = e.op, e.args
        found: Range = None
        if e.kind == BOOL:
            found = (0, 1)
        elif e.kind != INT:
            found = None
        elif op == "arg":
            found = arguments.get(args[0], _INDEX_RANGE)
        elif op == "const":
            found = (int(args[0]), int(args[0]))
        elif op == "index":
            found = _ELEMENT_RANGE.get(args[0].args[0].dtype)
        elif op in ("add", "sub", "mul", "floordiv", "mod", "minimum", "maximum"):
            a, b = of(args[0]), of(args[1])
            if a is not None and b is not None:
                if op == "add":
                    found = (a[0] + b[0], a[1] + b[1])
                elif op == "sub":
                    found = (a[0] - b[1], a[1] - b[0])
                elif op == "mul":
                    found = corners([x * y for x in a for y in b])
                elif op == "floordiv" and (b[0] > 0 or b[1] < 0):  # monotone in each, b of one sign
                    found = corners([x // y for x in a for y in b])
                elif op == "mod" and b[0] > 0:
                    found = (0, b[1] - 1)
                elif op == "mod" and b[1] < 0:
                    found = (b[0] + 1, 0)
                elif op == "minimum":
                    found = (min(a[0], b[0]), min(a[1], b[1]))
                elif op == "maximum":
                    found = (max(a[0], b[0]), max(a[1], b[1]))
        elif op == "neg":
            a = of(args[0])
            found = None if a is None else (-a[1], -a[0])
        elif op == "abs":
            a = of(args[0])
            if a is not None:
                found = a if a[0] >= 0 else (-a[1], -a[0]) if a[1] <= 0 else (0, max(-a[0], a[1]))
        elif op == "where":
            a, b = of(args[1]), of(args[2])
            found = None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
        for x in args:  # every integer node below gets its range too
            if isinstance(x, Expr) and id(x) not in ranges:
                of(x)
        if found is not None and (found[0] < _INT64[0] or found[1] > _INT64[1]):
            found = None  # past 64 bits the kernels' (and NumPy's) integers wrap: no bound holds
        ranges[id(e)] = found
        return found

    of(root)
    return ranges


@dataclass(frozen=True, slots=True)
class Grid:
    """One call's index ranges: b < batch, h < heads, q_idx < seqlen_q, kv_idx < seqlen_k. The
    kernels evaluate the head's function for the call's (b, h) alone and a score's only inside
    the sequence (variants.cuh's UserMods: a row's or a key's part, which the tile loops also
    compute past it, keeps its checks)."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int

    def ranges(self) -> dict[str, Range] | None:
        """Each index argument's interval; None for an empty grid (a call with no rows, keys,
        batch entries or heads runs no function: nothing is proven by it)."""
        extents = {"b": self.batch, "h": self.heads, "q_idx": self.seqlen_q, "kv_idx": self.seqlen_k}
        if min(extents.values()) < 1:
            return None
        return {name: (0, n - 1) for name, n in extents.items()}


def _reads_inside(root: Expr, grid: Grid | None) -> frozenset[int]:
    """The captured-array reads (node ids) that ``grid``'s index ranges keep inside their arrays
    on every axis (ALiBi's ``slopes[h]`` when it has H entries, ``bias[h, q_idx - kv_idx + n]``
    when the table has 2n columns, a document id's ``doc[q_idx]`` when doc has Nq entries).
    None: every read checked."""
    arguments = None if grid is None else grid.ranges()
    if arguments is None:
        return frozenset()
    ranges = _int_ranges(root, arguments)
    inside = set()
    stack, seen = [root], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.op == "index":
            spans = [ranges.get(id(i)) for i in e.args[1:]]
            shape = e.args[0].args[0].shape
            if all(r is not None and 0 <= r[0] and r[1] < n for r, n in zip(spans, shape, strict=True)):
                inside.add(id(e))
        stack += [x for x in e.args if isinstance(x, Expr)]
    return frozenset(inside)


def _fits32(r: Range) -> bool:
    return r is not None and _INT32[0] <= r[0] and r[1] <= _INT32[1]


# The math functions, each as the kernels' own score transforms compute it: tanh is common.cuh's
# fast_tanh (tanh.approx.f32, one MUFU op, relative error 2^-11, what the built-in softcap uses:
# tanhf is about 20 instructions a score), exp and log the fast intrinsics (MUFU.EX2 / LG2 with a
# multiply, errors of a few ulp, far under a 16-bit input's rounding).
_MATH = {"exp": "__expf", "log": "__logf", "tanh": "fast_tanh"}


#: What a node's value depends on, as cuda_source places it: b and h alone (the head function,
#: once per tile), q_idx (the row function, once per row of the tile), kv_idx (the key function,
#: once per key), or the score / both indices (the per-score function).
_ON_SCORE, _ON_ROW, _ON_KEY = 1, 2, 4


def _dependencies(root: Expr) -> dict[int, int]:
    """Per node id, the set (_ON_SCORE | _ON_ROW | _ON_KEY) of the arguments its value depends
    on; 0: on b and h alone (constants, ALiBi's slope, a per-head table's row)."""
    depends: dict[int, int] = {}
    argument = {"score": _ON_SCORE, "q_idx": _ON_ROW, "kv_idx": _ON_KEY}

    def visit(e: Expr) -> int:
        hit = depends.get(id(e))
        if hit is not None:
            return hit
        here = argument.get(e.args[0], 0) if e.op == "arg" else 0
        for x in e.args:
            if isinstance(x, Expr):
                here |= visit(x)
        depends[id(e)] = here
        return here

    visit(root)
    return depends


#: Integers of this magnitude and below are floats exactly.
_FLOAT_EXACT = 1 << 24


def _float_by_parts(
    e: Expr, depends: dict[int, int], ranges: dict[int, Range], made: Callable[[str, tuple[Any, ...], int], Expr]
) -> Expr | None:
    """An integer ``e`` of both indices, ``a + b`` or ``a - b`` (or its ``abs``) with ``a`` and
    ``b`` each of one index (or of b and h), as the float it converts to, computed from ``a`` and
    ``b`` converted in their own parts: once per row and per key of a fragment rather than per
    score (ALiBi's |q_idx - kv_idx|: a subtraction, IABS, a move and I2FP per score, then
    FADD with the absolute value free in the FFMA). Only where ``ranges`` (over the call's grid,
    or the expression's own, as ``q_idx % 64``'s) keep ``a``, ``b`` and ``e`` under 2^24 in
    magnitude, where every step is exact: the same float as converting ``e``. None otherwise.
    ``made(op, args, depends)`` makes a node."""
    inner = e.args[0] if e.op == "abs" else e
    if depends.get(id(e)) != _ON_ROW | _ON_KEY or inner.op not in ("add", "sub"):
        return None
    a, b = inner.args
    if not all(isinstance(x, Expr) and depends[id(x)] in (0, _ON_ROW, _ON_KEY) for x in (a, b)):
        return None
    for x in (a, b, inner):
        r = ranges.get(id(x))
        if r is None or r[0] <= -_FLOAT_EXACT or r[1] >= _FLOAT_EXACT:
            return None
    combined = made(
        inner.op, (made("float", (a,), depends[id(a)]), made("float", (b,), depends[id(b)])), depends[id(e)]
    )
    return made("abs", (combined,), depends[id(e)]) if e.op == "abs" else combined


def cuda_source(mod: Mod, name: str = "", grid: Grid | None = None) -> str:
    """``mod`` as device C (deterministic text; include ``CUDA_HELPERS`` once before it), named
    ``name`` (``mod.name`` by default), in four functions by what a value depends on
    (``_dependencies``): ``<name>_head(b, h, arrays..., <name>_state&)`` what depends on b and h
    alone, ``<name>_row_part(b, h, q_idx, arrays...,
    const <name>_state&, <name>_row&)`` what depends on q_idx (and b, h) alone,
    ``<name>_key_part(b, h, kv_idx, ..., <name>_key&)`` what depends on kv_idx alone, and the
    per-score ``__device__ __forceinline__`` function ``<name>((score,) b, h, q_idx, kv_idx,
    arrays..., const <name>_state&, const <name>_row&, const <name>_key&, bool& outside)``. The
    arrays: per captured array its pointer and one int64 element stride per axis but the last,
    whose stride is 1 (the launch copies an array whose last axis is not: _launch's INDEX
    operands), so a 1-D array's read is ``buf[i]``, with no 64-bit multiply. ``outside``
    is set where an index falls outside its array (the host path raises there; the kernel reads
    nothing past the array and its caller makes the score NaN, so the row's output is NaN).
    A per-head or per-score read that ``grid`` (a call's index ranges, ``_reads_inside``) keeps
    inside its array has no check: per score, a check's compare and the NaN select were 2 of
    ALiBi's 11 instructions in the Hopper forward. A row's or key's part keeps its checks and its
    outside flag: the tile loops compute those parts past the sequence too; unchecked, ptxas
    hoisted their loads and spilled the Hopper kernels 12-56 bytes, and with the check kept but
    the flag dropped 4-32 bytes (document masks, d = 64 and 128).

    For speed, as the kernels' built-in transforms: what depends on b and h alone (ALiBi's
    slope, a per-head table's value) is computed once per tile by the head function, not once
    per score (the compiler cannot hoist the reads: each score's hook sits in its own branch);
    what depends on one index alone (a document id's ``doc[q_idx]`` and ``doc[kv_idx]``) once
    per row and once per key of a thread's fragment (variants.cuh's transform_scores: 2 rows and
    32 keys of a 64-score Hopper fragment, so 34 reads for the 128 a per-score gather makes);
    integers in 32 bits where they fit (``_int_ranges``); a division by a constant as a multiply
    by its reciprocal. (Plain loads: ``__ldg`` made ptxas reload the arrays' pointers and strides
    from constant memory for every score, 7,560 -> 8,520 instructions in the document mask's
    Hopper forward, where plain loads give 6,688.)"""
    score_args = ["float score"] if mod.role == "score_mod" else []
    buffer_params: list[str] = []
    for spec in _buffer_specs(mod.expr):
        element = _C_ELEMENT.get(spec.dtype)
        if element is None:
            raise TypeError(f"{mod.role} captures a {spec.dtype} array: the kernels read {sorted(_C_ELEMENT)}")
        buffer_params.append(f"const {element}* __restrict__ buf{spec.slot}")
        buffer_params += [f"long long buf{spec.slot}_stride{axis}" for axis in range(len(spec.shape) - 1)]
    ranges = _int_ranges(mod.expr)
    depends = _dependencies(mod.expr)
    # per place: its function's lines, its struct's fields, the struct's name in the functions
    places: dict[int, tuple[list[str], list[str], str]] = {
        0: ([], [], "st."), _ON_ROW: ([], [], "r."), _ON_KEY: ([], [], "k."), _ON_SCORE: ([], [], "")
    }  # fmt: skip
    names: dict[int, str] = {}
    count = [0]

    def place(e: Expr) -> int:  # the function that computes e (per score: the score or both indices)
        on = depends[id(e)]
        return on if on in (0, _ON_ROW, _ON_KEY) else _ON_SCORE

    def ctype(e: Expr) -> str:
        if e.kind == INT:
            return "int" if _fits32(ranges.get(id(e))) else "long long"
        return _C_TYPES[e.kind]

    # An integer of both indices that a float takes, such as ALiBi's |q_idx - kv_idx|: from its
    # row's and its key's values, each converted once per part (``_float_by_parts``).
    arguments = None if grid is None else grid.ranges()
    in_grid = ranges if arguments is None else _int_ranges(mod.expr, arguments)
    inside = {i for i in _reads_inside(mod.expr, grid) if depends[i] not in (_ON_ROW, _ON_KEY)}  # (see above)
    by_parts: dict[int, Expr | None] = {}
    made: list[Expr] = []  # (the new nodes, alive while their ids key depends)

    def made_node(op: str, args: tuple[Any, ...], on: int) -> Expr:
        node = Expr(op, FLOAT, args)
        made.append(node)
        depends[id(node)] = on
        return node

    def float_by_parts(e: Expr) -> Expr | None:
        if id(e) not in by_parts:
            by_parts[id(e)] = _float_by_parts(e, depends, in_grid, made_node)
        return by_parts[id(e)]

    def cast(e: Expr, want: str) -> str:  # e's value as the C type ``want``
        if want == "float" and e.kind == INT and (parts := float_by_parts(e)) is not None:
            return emit(parts)
        name = emit(e)
        return name if ctype(e) == want else f"({want})({name})"

    def emit(e: Expr) -> str:
        hit = names.get(id(e))
        if hit is not None:
            return hit
        op, args = e.op, e.args
        if op == "arg":
            return args[0]
        if op == "const":
            return _c_const(args[0], e.kind)
        out, fields, prefix = places[place(e)]
        number = count[0]
        count[0] += 1
        mine = ctype(e)
        # integer ops in 32 bits where the result and the operands fit, else in 64
        wide = "long long" if any(ctype(x) == "long long" for x in args if isinstance(x, Expr)) else "int"
        work = mine if e.kind != INT else wide if mine == "int" else "long long"
        if op in ("floordiv", "mod") and work == "int":  # INT_MIN / -1 overflows 32 bits
            a_range, b_range = ranges[id(args[0])], ranges[id(args[1])]
            if a_range and b_range and a_range[0] == _INT32[0] and b_range[0] <= -1 <= b_range[1]:
                work = "long long"
        if op == "index":
            spec = args[0].args[0]
            slot, indices = spec.slot, [emit(i) for i in args[1:]]
            *outer, last = indices  # (the last axis's stride is 1)
            offset = " + ".join([*(f"{i} * buf{slot}_stride{axis}" for axis, i in enumerate(outer)), last])
            read = f"buf{slot}[{offset}]"  # read only where the index is inside the array
            if id(e) in inside:
                text = f"({mine})({read})"
            else:
                bounds = " && ".join(f"{i} >= 0 && {i} < {n}" for i, n in zip(indices, spec.shape, strict=True))
                check = f"in{number}"
                out.append(f"  const bool {check} = {bounds};")
                out.append(f"  {prefix}outside |= !{check};")
                text = f"{check} ? ({mine})({read}) : ({mine})0"
        elif op in _ARITH:
            operand = FLOAT if op == "truediv" or e.kind == FLOAT else work
            a_range, b_range = ranges.get(id(args[0])), ranges.get(id(args[1]))
            reciprocal = None
            if op == "truediv" and args[1].op == "const" and args[1].kind != BOOL:
                reciprocal = _exact_reciprocal(float(args[1].args[0]))
            if reciprocal is not None:
                text = f"({cast(args[0], operand)} * {_c_const(reciprocal, FLOAT)})"
            else:
                a, b = cast(args[0], operand), cast(args[1], operand)
                # C's / and % where they are Python's: a >= 0 (below 2^63: past it, it wrapped), b > 0
                signs_known = a_range and b_range and 0 <= a_range[0] and a_range[1] < 1 << 63 and b_range[0] > 0
                if op in ("floordiv", "mod") and e.kind == INT and signs_known:
                    text = f"({a} {'/' if op == 'floordiv' else '%'} {b})"
                elif op == "floordiv":
                    text = f"cf_mods_floordiv({a}, {b})" if e.kind == INT else f"floorf({a} / {b})"
                elif op == "mod":
                    text = f"cf_mods_mod({a}, {b})" if e.kind == INT else f"cf_mods_fmod({a}, {b})"
                else:
                    text = f"({a} {_ARITH[op]} {b})"
            text = text if operand == mine else f"({mine})({text})"
        elif op in ("minimum", "maximum"):
            operand = FLOAT if e.kind == FLOAT else work
            a, b = cast(args[0], operand), cast(args[1], operand)
            function = f"cf_mods_{op}" if e.kind == FLOAT else op[:3]
            text = f"{function}({a}, {b})"
            text = text if operand == mine else f"({mine})({text})"
        elif op in _COMPARE:
            kind = BOOL if BOOL in (args[0].kind, args[1].kind) else _promote(args[0].kind, args[1].kind)
            operand = _C_TYPES[kind] if kind != INT else wide
            text = f"({cast(args[0], operand)} {_COMPARE[op]} {cast(args[1], operand)})"
        elif op in _LOGIC:
            text = f"({emit(args[0])} {'&&' if op == 'and' else '||'} {emit(args[1])})"
        elif op == "not":
            text = f"(!{emit(args[0])})"
        elif op == "neg":
            text = f"(-{cast(args[0], work)})"
            text = text if work == mine else f"({mine})({text})"
        elif op == "abs":
            function = "fabsf" if e.kind == FLOAT else "abs" if work == "int" else "llabs"
            text = f"{function}({cast(args[0], work)})"
            text = text if work == mine else f"({mine})({text})"
        elif op in _MATH:
            text = f"{_MATH[op]}({cast(args[0], 'float')})"
        elif op == "float":  # (_float_by_parts: an integer of one index, once per row or key)
            text = f"(float)({emit(args[0])})"
        elif op == "where":
            text = f"({emit(args[0])} ? {cast(args[1], mine)} : {cast(args[2], mine)})"
        else:  # pragma: no cover - the tracer makes no other node
            raise AssertionError(op)
        if prefix:
            name = f"{prefix}t{number}"
            fields.append(f"  {mine} t{number};")
            out.append(f"  {name} = {text};")
        else:
            name = f"t{number}"
            out.append(f"  const {mine} {name} = {text};")
        names[id(e)] = name
        return name

    returns = "float" if mod.role == "score_mod" else "bool"
    result = cast(mod.expr, returns)
    name = name or mod.name
    lines = {where: "".join(line + "\n" for line in out) for where, (out, _, _) in places.items()}
    structs = ""
    for suffix, where in (("state", 0), ("row", _ON_ROW), ("key", _ON_KEY)):
        structs += f"struct {name}_{suffix} {{\n  bool outside;\n{''.join(f + chr(10) for f in places[where][1])}}};\n"
    state, row, key = f"const {name}_state& st", f"const {name}_row& r", f"const {name}_key& k"
    function = "__device__ __forceinline__"
    return (
        f"{structs}"
        f"{function} void {name}_head({', '.join(['int b', 'int h', *buffer_params])}, {name}_state& st) {{\n"
        f"  st.outside = false;\n{lines[0]}}}\n"
        f"{function} void {name}_row_part({', '.join(['int b', 'int h', 'int q_idx', *buffer_params])}, {state}, "
        f"{name}_row& r) {{\n  r.outside = st.outside;\n{lines[_ON_ROW]}}}\n"
        f"{function} void {name}_key_part({', '.join(['int b', 'int h', 'int kv_idx', *buffer_params])}, {state}, "
        f"{name}_key& k) {{\n  k.outside = false;\n{lines[_ON_KEY]}}}\n"
        f"{function} {returns} {name}("
        f"{', '.join([*score_args, 'int b', 'int h', 'int q_idx', 'int kv_idx', *buffer_params])}, "
        f"{state}, {row}, {key}, bool& outside) {{\n  outside |= r.outside || k.outside;\n"
        f"{lines[_ON_SCORE]}  return {result};\n}}\n"
    )


def _exact_reciprocal(c: float) -> float | None:
    """1 / c where ``x * (1 / c)`` is ``x / c`` to within an ulp of float32 (a finite, nonzero c
    whose reciprocal is a normal float32; exact for a power of two), else None (the division)."""
    if c == 0 or not math.isfinite(c):
        return None
    r = 1.0 / c
    return r if 2.0**-126 <= math.fabs(r) < 2.0**127 else None


#: Captured arrays the kernels take (AttnParams' mod_buffer0..3, each 1-D or 2-D).
MAX_KERNEL_BUFFERS = 4


@dataclass(frozen=True, slots=True)
class KernelMods:
    """A call's score_mod and mask_mod as the kernels compile them: ``source`` defines the hooks
    kernels_cu/variants.cuh's UserMods calls (``kernel_mods``: ``cf_user_mods_head``,
    ``cf_user_row`` / ``cf_user_key`` and the hooks' ``_at`` forms, ``cf_user_mods``,
    ``cf_user_score``, ``cf_user_mods_grad``) and the constants ``cf_user_has_score_mod`` and
    ``cf_user_has_mask_mod``; ``buffers`` says which captured array goes to AttnParams'
    mod_buffer0, 1, ...: (0 = score_mod / 1 = mask_mod, its slot); ``digest`` names the kernel
    variant."""

    source: str
    buffers: tuple[tuple[int, int], ...]
    digest: str
    ndims: tuple[int, ...]  # each mod_buffer's axes (1 or 2)
    has_score_mod: bool = True  # False for a mask_mod alone (the kernels keep their own scale)

    def arrays(self, score_mod: Mod | None, mask_mod: Mod | None) -> tuple[Any, ...]:
        """The captured arrays of ``score_mod`` / ``mask_mod`` (the ones this was made from) in
        mod_buffer order."""
        mods = (score_mod, mask_mod)
        return tuple(mods[which].buffers[slot] for which, slot in self.buffers)  # type: ignore[union-attr]


#: The Hopper forward reads a mask_mod's part of each key ahead of the scores where that part is
#: one 32-bit read (a document id; variants.cuh's PartsAhead, UserMods::kKeysAhead): the 32
#: gathers of a thread's keys issued before the wait for the block's Q K^T, where read one key
#: tile after another on the softmax's path they stalled the forward (Nsight Compute, H100, d = 64,
#: N = 4k, a 4-document mask: 1.2 long-scoreboard stalls per issued instruction, 1084 us against
#: FlexAttention's 806). Not with a score_mod's read (a bias table's value, alone or beside the id:
#: the tiles spilled 44-320 bytes at d = 64-128). Built and compiled (no spill on the two-consumer
#: tiles at d = 64 and 128, padded and packed; 152 bytes on d = 64's three-consumer tile, which
#: score functions take past 2048 keys). Measured on two consumers (H100, document masks with
#: their block masks, beside FlexAttention): ahead / not 0.97-1.09 at N = 4k and 16k
#: (docs/evidence/2026-12-07-h100-session-15/): off.
READ_KEYS_AHEAD = False


def kernel_mods(score_mod: Mod | None, mask_mod: Mod | None, tiles: str = "", grid: Grid | None = None) -> KernelMods:
    """The device source of a score_mod and / or mask_mod for the kernels' score hook: each
    function (``cuda_source``), then ``cf_user_mods``, which reads their captured arrays from
    AttnParams (at most MAX_KERNEL_BUFFERS), hides the score where mask_mod is false (-inf) and
    else returns score_mod's value (the score itself without one); ``cf_user_score``, score_mod's
    value alone (a BlockMask's plain tiles); and ``cf_user_mods_grad``, the backward's
    d score_mod / d score at the same arguments (``score_derivative``; 1 without one). Each also
    as ``<hook>_at``, taking the parts of its row (``cf_user_row``: what depends on q_idx alone)
    and of its key (``cf_user_key``) computed once for every score that shares them. ``tiles``:
    the mask's tile classes (``_mod_tiles.kernel_source``), appended where a call asks for them.
    ``grid``: the call's index ranges, where a per-head or per-score read they keep inside its
    array needs no check (``cuda_source``; the variant then holds for every call whose ranges
    keep the same reads inside); None: every read checked."""
    # whether there is a score function: without one, the kernels keep their own scale and a
    # BlockMask's plain tiles run no code at all; whether there is a mask function: without one,
    # a tile's class changes nothing and the hook is written once (variants.cuh's UserMods)
    has_score = "true" if score_mod is not None else "false"
    has_mask = "true" if mask_mod is not None else "false"
    # whether d score_mod / d score is 1 everywhere (an additive bias: ALiBi, a relative-position
    # table): the Hopper backward then forms P^T without keeping the raw score for the derivative
    slope = None if score_mod is None else score_derivative(score_mod)
    one = slope is None or (slope.expr.op == "const" and slope.expr.args == (1.0,))
    grad_is_one = "true" if one else "false"
    # whether the Hopper forward reads each key's part ahead of the scores (READ_KEYS_AHEAD)
    key_words = 0 if mask_mod is None else _key_read_words(mask_mod)
    keys_ahead = "true" if READ_KEYS_AHEAD and score_mod is None and key_words == 1 else "false"
    # whether a function reads a captured array at an index of q_idx or kv_idx (a bias table's
    # value, a document id): where none does, the scores past the sequence need no guard
    # (variants.cuh's PastUnguarded)
    by_index = _reads_by_index_any(score_mod, mask_mod)
    parts = [
        CUDA_HELPERS,
        f"constexpr bool cf_user_has_score_mod = {has_score};\n",
        f"constexpr bool cf_user_has_mask_mod = {has_mask};\n",
        f"constexpr bool cf_user_grad_is_one = {grad_is_one};\n",
        f"constexpr bool cf_user_keys_ahead = {keys_ahead};\n",
        f"constexpr bool cf_user_reads_by_index = {'true' if by_index else 'false'};\n",
    ]
    call: dict[str, str] = {}
    heads: list[str] = []
    fields: list[str] = []
    order: list[tuple[int, int]] = []
    ndims: list[int] = []

    def buffers(mod: Mod, which: int) -> list[str]:  # its arrays, read from the mod_buffers
        args = []
        for spec in _buffer_specs(mod.expr):
            if (which, spec.slot) not in order:
                if len(order) == MAX_KERNEL_BUFFERS:
                    raise ValueError(
                        f"score_mod and mask_mod capture more than {MAX_KERNEL_BUFFERS} arrays between them: the "
                        "GPU kernels take at most that many (stack them into one 2-D array)"
                    )
                order.append((which, spec.slot))
                ndims.append(len(spec.shape))
            n = order.index((which, spec.slot))
            args += [f"static_cast<const {_C_ELEMENT[spec.dtype]}*>(p.mod_buffer{n})"]
            args += [f"p.mod_buffer{n}_stride{axis}" for axis in range(len(spec.shape) - 1)]
        return args

    def add(mod: Mod, which: int, field: str) -> str:  # its source and state; returns its call
        arrays = buffers(mod, which)
        # (score_mod's derivative under a name of its own: a constant's is the same expression)
        name = f"{mod.name}_grad" if field == "gradient" else mod.name
        parts.append(cuda_source(mod, name, grid))
        for struct, suffix in ((fields, "state"), (row_fields, "row"), (key_fields, "key")):
            struct.append(f"  {name}_{suffix} {field};")
        heads.append(f"  {name}_head({', '.join(['b', 'h', *arrays, f'st.{field}'])});")
        rows.append(f"  {name}_row_part({', '.join(['b', 'h', 'q_idx', *arrays, f'st.{field}', f'r.{field}'])});")
        keys.append(f"  {name}_key_part({', '.join(['b', 'h', 'kv_idx', *arrays, f'st.{field}', f'k.{field}'])});")
        args = ["score"] if mod.role == "score_mod" else []
        states = [f"st.{field}", f"r.{field}", f"k.{field}"]
        return f"{name}({', '.join([*args, 'b', 'h', 'q_idx', 'kv_idx', *arrays, *states, 'outside'])})"

    row_fields: list[str] = []
    key_fields: list[str] = []
    rows: list[str] = []
    keys: list[str] = []
    for which, mod in enumerate((score_mod, mask_mod)):
        if mod is not None:
            call[mod.role] = add(mod, which, mod.role)
    # d score_mod / d score (1 without one): reads a subset of score_mod's arrays
    gradient = "  return 1.f;\n"
    if slope is not None:
        gradient = f"  bool outside = false;\n  return {add(slope, 0, 'gradient')};\n"
    # What depends on b and h alone, computed once per tile (UserMods' constructor) for every
    # score; what depends on q_idx alone once per row, on kv_idx alone once per key
    # (variants.cuh's transform_scores of UserMods)
    for struct, members in (("CfUserModsState", fields), ("CfUserRow", row_fields), ("CfUserKey", key_fields)):
        parts.append(f"struct {struct} {{\n  char unused = 0;\n" + "".join(f + "\n" for f in members) + "};\n")
    function = "__device__ __forceinline__"
    params = "const AttnParams& p, const CfUserModsState& st"
    for signature, body in (
        ("void cf_user_mods_head(const AttnParams& p, int b, int h, CfUserModsState& st)", heads),
        (f"void cf_user_row({params}, int b, int h, int q_idx, CfUserRow& r)", rows),
        (f"void cf_user_key({params}, int b, int h, int kv_idx, CfUserKey& k)", keys),
    ):
        parts.append(f"{function} {signature} {{\n" + "".join(line + "\n" for line in body) + "}\n")
    at = f"({params}, const CfUserRow& r, const CfUserKey& k, float score, int b, int h, int q_idx, int kv_idx)"
    body = ["  bool outside = false;  // an index outside a captured array: the score is NaN"]
    body.append(f"  const bool shown = {call.get('mask_mod', 'true')};")
    body.append(f"  const float logit = {call.get('score_mod', 'score')};")
    body.append("  if (outside) return __int_as_float(0x7fffffff);")
    body.append("  return shown ? logit : __int_as_float(0xff800000);  // -inf where the mask hides it")
    parts.append(f"{function} float cf_user_mods_at{at} {{\n" + "\n".join(body) + "\n}\n")
    # score_mod alone: a BlockMask's plain tiles, where mask_mod shows every key
    alone = ["  bool outside = false;", f"  const float logit = {call.get('score_mod', 'score')};"]
    alone.append("  return outside ? __int_as_float(0x7fffffff) : logit;")
    parts.append(f"{function} float cf_user_score_at{at} {{\n" + "\n".join(alone) + "\n}\n")
    # (an index outside an array made the forward's row NaN, hence its gradients)
    parts.append(f"{function} float cf_user_mods_grad_at{at} {{\n" + gradient + "}\n")
    # The same for one score, its row's and key's parts computed for it alone
    signature = f"({params}, float score, int b, int h, int q_idx, int kv_idx)"
    for hook in ("cf_user_mods", "cf_user_score", "cf_user_mods_grad"):
        parts.append(
            f"{function} float {hook}{signature} {{\n  CfUserRow r;\n  cf_user_row(p, st, b, h, q_idx, r);\n"
            f"  CfUserKey k;\n  cf_user_key(p, st, b, h, kv_idx, k);\n"
            f"  return {hook}_at(p, st, r, k, score, b, h, q_idx, kv_idx);\n}}\n"
        )
    parts.append(tiles)
    source = "".join(parts)
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    return KernelMods(source, tuple(order), digest, tuple(ndims), score_mod is not None)


def _key_read_words(mod: Mod) -> int:
    """32-bit words of captured arrays that ``mod`` reads per key: its reads whose index depends
    on kv_idx alone (a document id ``doc[kv_idx]``), two words for an 8-byte element."""
    depends = _dependencies(mod.expr)
    reads = (e for e in _nodes(mod.expr) if e.op == "index" and depends[id(e)] == _ON_KEY)
    return sum(2 if e.args[0].args[0].dtype in ("float64", "int64") else 1 for e in reads)


def _reads_by_index_any(*functions: Mod | None) -> bool:
    """Whether one of ``functions`` reads a captured array at an index that depends on q_idx or
    kv_idx (not on b and h alone: ALiBi's slope is read once per tile)."""
    for mod in functions:
        if mod is not None:
            depends = _dependencies(mod.expr)
            if any(e.op == "index" and depends[id(e)] & (_ON_ROW | _ON_KEY) for e in _nodes(mod.expr)):
                return True
    return False


def _buffer_specs(root: Expr) -> list[BufferSpec]:
    found: dict[int, BufferSpec] = {}
    stack = [root]
    while stack:
        e = stack.pop()
        if e.op == "buf":
            found[e.args[0].slot] = e.args[0]
        stack.extend(a for a in e.args if isinstance(a, Expr))
    return [found[s] for s in sorted(found)]


# ---------------------------------------------------------------------------------------------
# Bounds a mask_mod implies: what the kernels' causal and window bounds can skip by the tile.
# ---------------------------------------------------------------------------------------------
def implied_window(mask: Mod) -> tuple[int, int]:
    """``(left, right)`` such that every (q_idx, kv_idx) the mask shows has
    ``q_idx - left <= kv_idx <= q_idx + right`` (-1: no bound found), read from the terms of the
    mask's top-level ``&``: ``kv_idx <= q_idx`` (or ``<``, or ``q_idx >= kv_idx``) gives right 0;
    ``q_idx - kv_idx < c`` (or ``<= c``, or the mirrored comparison) gives left ``c - 1`` (``c``).
    Both are implied by the mask, so a kernel that also applies them (and skips the tiles they
    hide) computes the same attention; any other term is left to the mask itself."""
    return _window_terms(mask)[:2]


def exact_window(mask: Mod) -> tuple[int, int] | None:
    """``implied_window(mask)`` where the mask is that window and nothing else (each term of its
    top-level ``&`` one of the bounds read, ``kv_idx < q_idx`` not among them: it shows no
    diagonal, which no window expresses), else None: such a mask_mod is the causal or
    sliding-window bound itself, which the kernels apply without it."""
    left, right, exact = _window_terms(mask)
    return (left, right) if exact and (left >= 0 or right >= 0) else None


def _window_terms(mask: Mod) -> tuple[int, int, bool]:
    """(left, right) of ``implied_window`` and whether every term of the top-level ``&`` gave
    one of them exactly."""
    left = right = -1
    exact = True
    stack = [mask.expr]
    while stack:
        e = stack.pop()
        if e.op == "and":
            stack.extend(e.args)
            continue
        if e.op not in ("lt", "le", "gt", "ge"):
            exact = False
            continue
        a, b = e.args
        op = e.op
        if op in ("gt", "ge"):  # a > b as b < a
            a, b, op = b, a, "lt" if op == "gt" else "le"
        if _is_arg(a, "kv_idx") and _is_arg(b, "q_idx"):  # kv <= q (kv < q implies it)
            right = 0
            exact &= op == "le"
        elif _is_difference(a) and b.op == "const" and b.kind == INT:  # q - kv < c or <= c
            bound = b.args[0] - (1 if op == "lt" else 0)
            if bound >= 0:
                left = bound if left < 0 else min(left, bound)
            else:
                exact = False
        else:
            exact = False
    return left, right, exact


def _is_arg(e: Expr, name: str) -> bool:
    return e.op == "arg" and e.args[0] == name


def _is_difference(e: Expr) -> bool:
    """``q_idx - kv_idx``."""
    return e.op == "sub" and _is_arg(e.args[0], "q_idx") and _is_arg(e.args[1], "kv_idx")


# ---------------------------------------------------------------------------------------------
# Derivatives for the backward: d score_mod / d score (dS = P (dP - D) times it), and d score_mod
# / d (an element of a captured array it read), for that array's gradient.
# ---------------------------------------------------------------------------------------------
def score_derivative(mod: Mod) -> Mod:
    """``d mod / d score`` as a score_mod of the same arguments and buffers (a float expression;
    0 where the score does not reach, as through ``//``, comparisons and captured arrays)."""
    return derivative(mod, lambda e: _is_arg(e, "score"))


@dataclass(frozen=True, slots=True)
class CapturedRead:
    """One read ``array[i]`` / ``array[i, j]`` of a captured float array in a score_mod: the
    array's slot, the index expressions (score_mod's arguments, integers) and d score_mod / d (the
    element read). The array's gradient adds, over every score, dS times ``slope`` at the index."""

    slot: int
    indices: tuple[Mod, ...]
    slope: Mod


def _nodes(root: Expr) -> Iterator[Expr]:
    """Every node of the expression under ``root`` once (a shared subexpression once), depth
    first, operands in order."""
    stack, seen = [root], set()
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend(x for x in reversed(e.args) if isinstance(x, Expr))


def captured_reads(mod: Mod) -> list[CapturedRead]:
    """The reads of captured float arrays in ``mod`` (each node once, in the order met), with
    their derivatives: what a captured array's gradient is made of (a learned bias table's)."""
    reads = [e for e in _nodes(mod.expr) if e.op == "index" and e.kind == FLOAT]
    return [
        CapturedRead(
            node.args[0].args[0].slot,
            tuple(Mod(mod.role, i, mod.buffers) for i in node.args[1:]),
            derivative(mod, lambda e, node=node: e is node),  # type: ignore[misc]
        )
        for node in reads
    ]


def derivative(mod: Mod, of: Callable[[Expr], bool]) -> Mod:
    """``d mod / d x`` as a score_mod of the same arguments and buffers (a float expression), where
    ``of`` names the node x (the score argument, or one read of a captured array); 0 where x does
    not reach, as through ``//`` and comparisons."""
    memo: dict[int, Expr | None] = {}
    one = Expr("const", FLOAT, (1.0,))

    def fl(x: Expr) -> Expr:
        return x if x.kind == FLOAT else Expr("mul", FLOAT, (one, x))

    def mul(a: Expr | None, b: Expr) -> Expr | None:
        return None if a is None else Expr("mul", FLOAT, (a, b))

    def add(a: Expr | None, b: Expr | None, op: str = "add") -> Expr | None:
        if b is None:
            return a
        if a is None:
            return b if op == "add" else Expr("neg", FLOAT, (b,))
        return Expr(op, FLOAT, (a, b))

    def zero_or(x: Expr | None) -> Expr:
        return Expr("const", FLOAT, (0.0,)) if x is None else x

    def d(e: Expr) -> Expr | None:  # None: identically 0
        if id(e) in memo:
            return memo[id(e)]
        op, args = e.op, e.args
        out: Expr | None
        if of(e):
            out = one
        elif op in ("arg", "const", "buf", "index", "floordiv", "not") or op in _COMPARE or op in _LOGIC:
            out = None
        elif op in ("add", "sub"):
            out = add(d(args[0]), d(args[1]), op)
        elif op == "mul":
            out = add(mul(d(args[0]), fl(args[1])), mul(d(args[1]), fl(args[0])))
        elif op == "truediv":  # (a' b - a b') / b^2
            a, b = fl(args[0]), fl(args[1])
            top = add(mul(d(args[0]), b), mul(d(args[1]), a), "sub")
            out = None if top is None else Expr("truediv", FLOAT, (top, Expr("mul", FLOAT, (b, b))))
        elif op == "mod":  # a - b floor(a / b): a' - floor(a / b) b'
            out = add(d(args[0]), mul(d(args[1]), Expr("floordiv", FLOAT, (fl(args[0]), fl(args[1])))), "sub")
        elif op == "neg":
            da = d(args[0])
            out = None if da is None else Expr("neg", FLOAT, (da,))
        elif op == "abs":  # sign(a) a'
            zero = Expr("const", args[0].kind, (0,) if args[0].kind == INT else (0.0,))
            da = d(args[0])
            out = (
                None
                if da is None
                else Expr("where", FLOAT, (Expr("lt", BOOL, (args[0], zero)), Expr("neg", FLOAT, (da,)), da))
            )
        elif op == "exp":
            out = mul(d(args[0]), e)
        elif op == "log":
            da = d(args[0])
            out = None if da is None else Expr("truediv", FLOAT, (da, fl(args[0])))
        elif op == "tanh":  # (1 - tanh^2) a'
            out = mul(d(args[0]), Expr("sub", FLOAT, (one, Expr("mul", FLOAT, (e, e)))))
        elif op in ("minimum", "maximum", "where"):
            if op == "where":
                condition, a, b = args
            else:
                a, b = args
                condition = Expr("le" if op == "minimum" else "ge", BOOL, (a, b))
            da, db = d(a), d(b)
            out = None if da is None and db is None else Expr("where", FLOAT, (condition, zero_or(da), zero_or(db)))
        else:  # pragma: no cover - the tracer makes no other node
            raise AssertionError(op)
        memo[id(e)] = out
        return out

    return Mod("score_mod", zero_or(d(mod.expr)), mod.buffers)


def uses(mod: Mod, argument: str) -> bool:
    """Whether the traced expression reads ``argument`` ("b", "h", "q_idx", "kv_idx", "score")."""
    return any(_is_arg(e, argument) for e in _nodes(mod.expr))


def draft_tree(xp: Any, mask: Mod, batch: int, drafts: int, like: Any) -> Any:
    """A speculative-decoding step's tree as ``attention_with_kvcache``'s ``tree_mask`` takes it:
    ``mask`` (a mask_mod over the drafts: q_idx, kv_idx in [0, drafts)) evaluated at every
    (b, q_idx, kv_idx) in ``xp`` where ``like`` lives, a bool ``(batch, drafts, drafts)``. It may
    not read ``h`` (one tree per sequence, every head's). A read of a captured array is checked
    against its shape (on a GPU that is a synchronisation), as on the host path."""
    if uses(mask, "h"):
        raise ValueError(
            "a mask_mod over the drafts is one tree per sequence, every head's: this one reads h (give the call "
            "a tree_mask, or a mask_mod that does not depend on the head)"
        )
    from array_api_compat import device

    at = device(like)
    steps = xp.arange(drafts, device=at)
    index = {
        "b": xp.reshape(xp.arange(batch, device=at), (-1, 1, 1)), "h": xp.asarray(0, device=at),
        "q_idx": xp.reshape(steps, (1, -1, 1)), "kv_idx": xp.reshape(steps, (1, 1, -1)),
    }  # fmt: skip
    buffers = tuple(xp.asarray(x, device=at) for x in mask.buffers)
    shown = evaluate(xp, mask, index, buffers, xp.float32)
    shown = xp.asarray(shown, dtype=xp.bool, device=at) if isinstance(shown, (bool, int)) else shown
    return xp.broadcast_to(xp.astype(shown, xp.bool), (batch, drafts, drafts))
