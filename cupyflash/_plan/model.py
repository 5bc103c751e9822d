"""What a plan is: a ``Launch`` (the steps, the operands and how their pointers and strides
enter the kernel's params struct, the outputs, the per-stream scratch, the params struct's fixed
fields) and the cache of Launches by call signature that every entry point uses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .._params import ParamsTemplate
from .._specs import (
    KernelSpec,
)

# ---------------------------------------------------------------------------------------------
# What a Launch is made of.
# ---------------------------------------------------------------------------------------------
TILE = "tile"  # a 16-bit tensor the kernels read in 16-byte chunks (unit stride on head_dim)
ROWS = "rows"  # one read element by element (a head dim not a multiple of 8: unit stride on it)
FP8_TILE = "fp8_tile"  # a float8 cache (bytes) the kernels read in 16-byte chunks (unit stride on head_dim)
INDEX = "index"  # an int32 array read element by element (unit stride on its last axis)
CONTIGUOUS = "contiguous"  # read as one C-contiguous block (merge_states' parts)
LENGTHS = "lengths"  # cache_seqlens: an int32 array, or one int for every sequence
SCALAR = "scalar"  # a per-call int (the dropout seed) into its field: ptr_slot


@dataclass(frozen=True, slots=True)
class Operand:
    """One input array and where its pointer and strides go in the params struct."""

    name: str
    kind: str = TILE
    ptr_slot: int = -1
    stride_slots: tuple[tuple[int, int], ...] = ()  # (params slot, array axis)
    in_place: bool = False  # written by the kernels: cannot be copied to make it readable
    negate: bool = False  # a negative scale runs as |scale| on -q
    int_slot: int = -1  # LENGTHS: the params slot of an int given for every sequence
    int_limit: tuple[int, int] = (0, 0)  # LENGTHS: (capacity, seqlen_new) an int is checked against
    # LENGTHS with rotary tables: (their positions, the largest int whose rotated rows fit them)
    int_rotary: tuple[int, int] | None = None
    offset_of: tuple[int, str, int] | None = None  # (slot, base operand, element bytes): ptr distance


@dataclass(frozen=True, slots=True)
class Output:
    name: str  # "out" | "lse"
    shape: tuple[int, ...]
    dtype: str
    ptr_slot: int
    fill: float | None = None  # the value rows no kernel writes keep (None: every element written)
    optional: bool = False  # allocated only when returned (the LSE)


@dataclass(frozen=True, slots=True)
class Temporary:
    """A per-call buffer the steps pass to a kernel or a GEMM (FA1's HBM state, naive's S, P),
    or whose pointer goes to a params slot (the backward's dQ accumulator)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    ptr_slot: int = -1


@dataclass(frozen=True, slots=True)
class Scratch:
    """Per-stream device memory (``_workspace``): counters that read 0 and are left at 0, then
    scratch with no initial value; their pointers go to the named slots."""

    counter_bytes: int
    scratch_bytes: int
    counter_slot: int
    scratch_slots: tuple[tuple[int, int], ...] = ()  # (params slot, byte offset in the scratch)


@dataclass(frozen=True, slots=True)
class TmaMaps:
    """A Hopper kernel's tensor maps (the forward's q, k, v; the backward's q, k, v, dout), in the
    order of its params struct, encoded per call from the operands of those names."""

    dtype: str
    axes: tuple[int, int, int]  # (row, head, batch) axes of the operands; -1: batch stride 0
    # Per map: (operand name, (d, rows, heads, batch) innermost first, box rows).
    maps: tuple[tuple[str, tuple[int, int, int, int], int], ...]


@dataclass(frozen=True, slots=True)
class KernelStep:
    spec: KernelSpec
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    tma: TmaMaps | None = None
    buffers: tuple[str, ...] = ()  # temporaries passed after the params struct


@dataclass(frozen=True)
class Launch:
    params: ParamsTemplate
    operands: tuple[Operand, ...]
    outputs: tuple[Output, ...]
    steps: tuple[Any, ...] = ()  # KernelStep, or a step with .execute(call) (the naive GEMMs)
    temporaries: tuple[Temporary, ...] = ()
    scratch: Scratch | None = None
    error_slot: int = -1  # the params slot of the device error word (``error_word_slot``), or -1
    # The steps' compiled kernels, filled by the Launch's first run (``_launch``); never planned.
    kernels: list[Any] = field(default_factory=list, repr=False, compare=False)
    # Derived on construction: operands by name (TMA maps and pointer offsets look them up).
    operand_index: dict[str, int] = field(init=False, repr=False, compare=False)

    # The layouts last found readable by the kernels (``_launch``: a call whose operands have
    # the same raw strides checks only their pointers' alignment), in a one-item list: threads
    # share a Launch, so the item is replaced whole, never edited. It holds, per operand, the raw
    # strides (None: none yet, or not ``plain`` below) and the element strides, the params
    # values with those operands' strides in their slots (a call starts from these values), and
    # those values packed (the bytes a call that sets only ``pointer_words`` launches with).
    layouts: list[tuple[tuple[Any, ...], tuple[Any, ...], tuple[int | float, ...], bytes]] = field(
        init=False, repr=False, compare=False
    )

    # Per operand, what a call's straight path needs, flat: (index, name, the pointer's slot, the
    # pointer's alignment mask: 15 for a TILE (16 bytes), 0 for the others). ``plain``: neither
    # negated nor given as an offset (only these take the straight path).
    bindings: tuple[tuple[int, str, int, int], ...] = field(init=False, repr=False, compare=False)
    plain: tuple[bool, ...] = field(init=False, repr=False, compare=False)
    # Per operand, the int length the last call gave (``_launch``: an int given twice in a row
    # goes into ``layouts``' template; one that changes every call, a decode loop's growing
    # length, is not packed twice a call). Written by calls without a lock: a race costs one
    # call the straight path, never a wrong value (the template is replaced whole).
    ints_seen: list[Any] = field(init=False, repr=False, compare=False)
    # Whether a call keeps each operand's (pointer, strides): the TMA maps, a pointer offset and
    # the steps that launch themselves read them.
    needs_bound: bool = field(init=False, repr=False, compare=False)
    # (slot, index among the struct's 8-byte words) of every pointer a call's straight path sets:
    # the operands', the outputs', the temporaries', the scratch's and the error word's. A call
    # that sets nothing else launches with the packed template and these stores (_launch); None
    # where one of them is not a pointer field.
    pointer_words: tuple[tuple[int, int], ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.operands)
        object.__setattr__(self, "operand_index", {op.name: i for i, op in enumerate(self.operands)})
        values = self.params.values
        object.__setattr__(self, "layouts", [((None,) * n, (None,) * n, values, self.params.struct.pack_bytes(values))])
        object.__setattr__(self, "ints_seen", [None] * n)
        bindings = tuple(
            (i, op.name, op.ptr_slot, 15 if op.kind in (TILE, FP8_TILE) else 0) for i, op in enumerate(self.operands)
        )
        object.__setattr__(self, "bindings", bindings)
        object.__setattr__(self, "plain", tuple(not op.negate and op.offset_of is None for op in self.operands))
        needs_bound = any(op.offset_of is not None for op in self.operands) or any(
            type(step) is not KernelStep or step.tma is not None for step in self.steps
        )
        object.__setattr__(self, "needs_bound", needs_bound)
        slots = [op.ptr_slot for op, plain in zip(self.operands, self.plain) if plain]
        slots += [o.ptr_slot for o in self.outputs] + [t.ptr_slot for t in self.temporaries if t.ptr_slot >= 0]
        if self.scratch is not None:
            slots += [self.scratch.counter_slot, *(slot for slot, _ in self.scratch.scratch_slots)]
        slots += [self.error_slot] if self.error_slot >= 0 else []
        words = self.params.struct.pointer_word
        pointer_words = tuple((slot, words[slot]) for slot in dict.fromkeys(slots))
        object.__setattr__(self, "pointer_words", pointer_words if all(w >= 0 for _, w in pointer_words) else None)


# ---------------------------------------------------------------------------------------------
# One cache helper for every entry point, one eviction rule.
# ---------------------------------------------------------------------------------------------
PlanT = TypeVar("PlanT")


_NO_RECENT: tuple[tuple[Any, Any], tuple[Any, Any]] = (((), None), ((), None))  # no key is ()


class PlanCache(Generic[PlanT]):
    """Launches (or an entry point's tuple of them) by call signature. A process that meets
    endlessly new shapes starts over when the cache is full (no LRU bookkeeping on the hot path);
    a key that cannot be hashed (an argument of an unhashable type) is planned without caching."""

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: dict[Any, PlanT] = {}
        self._lock = threading.Lock()
        #: The cached Launch, or None: the hot path's check before it builds a planning closure.
        #: The dict's own ``get`` (a method around it cost every call ~40 ns), so a key that
        #: cannot be hashed raises TypeError, which the caller takes as a miss (``get`` plans it).
        self.find: Callable[[Any], PlanT | None] = self._entries.get
        #: The (key, plan) of the last two signatures ``lookup`` met, newest first, for a cache that
        #: one call site reads: a call with one of them (every layer's in a decode step, or layers
        #: that alternate two kinds, local and global) compares its key to theirs, part by part and
        #: mostly by identity, instead of hashing it (~2k instructions, ~80 ns on the 2-core host).
        self.recent: tuple[tuple[Any, Any], tuple[Any, Any]] = _NO_RECENT

    def get(self, key: Any, make: Callable[[], PlanT]) -> PlanT:
        try:
            hit = self._entries.get(key)
        except TypeError:
            return make()
        if hit is None:
            hit = make()
            with self._lock:
                if len(self._entries) >= self.MAX_ENTRIES:
                    self._entries.clear()
                self._entries[key] = hit
        return hit

    def lookup(self, key: Any, plan: Callable[..., PlanT], *args: Any) -> PlanT:
        """The plan of ``key`` (``plan(*args)`` made once), kept in ``recent``: the way past
        ``recent`` of a call site that reads it first."""
        try:
            hit = self._entries.get(key)
        except TypeError:  # a part that cannot be hashed: planned uncached (which refuses it)
            return plan(*args)
        if hit is None:
            hit = self.get(key, lambda: plan(*args))
        self.recent = ((key, hit), self.recent[0])
        return hit

    def clear(self) -> None:
        self._entries.clear()
        self.recent = _NO_RECENT

    def values(self) -> list[PlanT]:
        return list(self._entries.values())


ALL_CACHES: list[PlanCache[Any]] = []


def new_cache() -> PlanCache[Launch]:
    cache: PlanCache[Launch] = PlanCache()
    ALL_CACHES.append(cache)
    return cache


def new_pair_cache() -> PlanCache[tuple[Launch, Launch]]:
    """A cache of two Launches a call runs in order (the FP8 forward's)."""
    cache: PlanCache[tuple[Launch, Launch]] = PlanCache()
    ALL_CACHES.append(cache)
    return cache


def new_route_cache() -> PlanCache[Any]:
    """A cache of an entry point's routes: a Launch with the device arrays it reads (made once per
    signature), or None where the call takes another way (the cascade's)."""
    cache: PlanCache[Any] = PlanCache()
    ALL_CACHES.append(cache)
    return cache


def clear_caches() -> None:
    """Forget every plan (the tuning scripts change the tile tables between measurements)."""
    for cache in ALL_CACHES:
        cache.clear()
