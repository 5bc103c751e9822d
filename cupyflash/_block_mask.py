"""``BlockMask``: a mask_mod's block summary, made once (``cupyflash.create_block_mask``) and read
by the kernels of every call that takes it, as FlexAttention's ``create_block_mask`` makes its.

The summary cuts the (query row, key) plane into cells of ``BLOCK_SIZE`` rows x keys, for each
batch entry and head the mask reads (one for all where it reads neither ``b`` nor ``h``), and
says of each cell whether the mask hides every key of it, shows every key, or is mixed
(``xp_impl.MASK_CELL_*``); beside it, per 128 rows (keys), the keys (rows) its shown cells span.
It is made where the mask's captured arrays live: on a GPU by one kernel (kernels_cu/attn_mask.cuh's
``block_mask_cells``, the traced mask evaluated at every score of each cell, one CTA per cell),
on the host by ``xp_impl.block_mask_cells`` (the mask on index grids). A call with it skips the
tiles whose cells are hidden (no K/V load, no MMA), runs score_mod alone on plain tiles and the
mask per score on mixed ones: its result is the mask_mod's alone, the summary only saves work.
A call with a mask_mod and no BlockMask gets the summary the mask's own tile classes imply
(``implied``: interval arithmetic on the host, no evaluation), where they decide some cell.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from . import _interop, _launch, _mod_tiles, _mods, _plan, xp_impl


class BlockMask:
    """A ``mask_mod`` and its block summary (``cupyflash.create_block_mask`` makes one).

    Pass it as ``attention(q, k, v, block_mask=...)`` (and to ``attention_backward``) in place of
    ``mask_mod=``: the kernels then skip the tiles the mask hides and evaluate it only on the
    tiles it cuts through. The result is the mask_mod's; the summary only saves work.

    Attributes
    ----------
    mask_mod : the function, as given (None in the summary a call's mask_mod implies)
    shape : (B, H, Q_LEN, KV_LEN) as given (None: broadcast over that axis)
    BLOCK_SIZE : (rows, keys) of a cell
    cells : uint8 array (B or 1, H or 1, ceil(Q_LEN / rows), ceil(KV_LEN / keys)) of the library
        and device the summary was made on: ``HIDDEN``, ``MIXED`` or ``PLAIN`` per cell (1 on an
        axis of batch or heads the mask does not read)

    The summary is of the mask's captured arrays as they were when it was made: make a new
    BlockMask when their values change. On a GPU it is written on the current stream of its
    library at that time: a call on another stream should follow a synchronisation (as with
    FlexAttention's).
    """

    HIDDEN, MIXED, PLAIN = xp_impl.MASK_CELL_HIDDEN, xp_impl.MASK_CELL_MIXED, xp_impl.MASK_CELL_PLAIN

    __slots__ = (
        "mask_mod", "shape", "BLOCK_SIZE", "_mod", "_extents", "_cells", "_ranges", "_layout", "_lib", "_device",
        "_pointers", "_lock",
    )  # fmt: skip

    def __init__(
        self, mask_mod: Callable[..., Any] | None, shape: tuple[Any, Any, int, int], block: tuple[int, int],
        mod: _mods.Mod, extents: tuple[int, int], cells: Any, ranges: tuple[Any, Any], lib: Any, device: int,
    ) -> None:  # fmt: skip
        self.mask_mod = mask_mod
        self.shape = shape
        self.BLOCK_SIZE = block
        self._mod = mod  # the traced mask
        self._extents = extents  # (batch entries, heads) of the summary: 1 on an axis not read
        self._cells = cells  # padded to whole 128-row and 128-key blocks (the kernels' largest tiles)
        self._ranges = ranges  # (key ranges, row ranges): xp_impl.block_mask_ranges
        self._layout = _plan.BlockCells.of(tuple(cells.shape), block)
        self._lib = lib  # the ArrayLib of a summary made on a GPU, None on the host
        self._device = device  # its GPU, -1 on the host
        # per GPU: the addresses of (cells, key ranges, row ranges) there (a host summary's copies)
        self._pointers: dict[int, tuple[int, int, int, tuple[Any, ...]]] = {}
        self._lock = threading.Lock()

    @property
    def cells(self) -> Any:
        rows, keys = self.BLOCK_SIZE
        return self._cells[:, :, : -(-self.shape[2] // rows), : -(-self.shape[3] // keys)]

    def sparsity(self) -> float:
        """The share of cells the mask hides, in percent (FlexAttention's ``sparsity()``; on a GPU
        this reads the summary back)."""
        cells = self.cells
        from array_api_compat import array_namespace

        xp = array_namespace(cells)
        hidden = int(xp.sum(xp.astype(cells == self.HIDDEN, xp.int64)))
        return 100.0 * hidden / max(math.prod(cells.shape), 1)

    def __repr__(self) -> str:
        where = "the host" if self._device < 0 else f"GPU {self._device}"
        return f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, on {where})"


def _block_size(block_size: Any) -> tuple[int, int]:
    sizes = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    if len(sizes) != 2 or not all(
        isinstance(n, int) and not isinstance(n, bool) and 16 <= n <= 2**16 and n & (n - 1) == 0 for n in sizes
    ):
        raise ValueError(
            "BLOCK_SIZE must be a power of two from 16 to 65536, or a pair (rows, keys) of them (the kernels shift by "
            f"it), got {block_size!r}"
        )
    return sizes


def _size(name: str, value: Any, optional: bool = True) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        kind = "a positive int" + (" or None (broadcast)" if optional else "")
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def _length(name: str, value: Any) -> int:
    length = _size(name, value, optional=False)
    assert length is not None
    return length


def _reads(mod: _mods.Mod) -> set[str]:
    """The arguments (b, h, q_idx, kv_idx) the traced mask reads."""
    found: set[str] = set()
    stack = [mod.expr]
    while stack:
        e = stack.pop()
        if e.op == "arg":
            found.add(e.args[0])
        stack.extend(a for a in e.args if isinstance(a, _mods.Expr))
    return found


def create(
    mask_mod: Callable[..., Any], batch: Any, heads: Any, seqlen_q: Any, seqlen_k: Any, device: Any, block_size: Any
) -> BlockMask:
    """``create_block_mask``'s work (its arguments checked here)."""
    mod = _mods.trace_mask_mod(mask_mod)
    batch, heads = _size("B", batch, True), _size("H", heads, True)
    seqlen_q, seqlen_k = _length("Q_LEN", seqlen_q), _length("KV_LEN", seqlen_k)
    shape = (batch, heads, seqlen_q, seqlen_k)
    block = _block_size(block_size)
    reads = _reads(mod)
    for arg, name, given in (("b", "B", shape[0]), ("h", "H", shape[1])):
        if arg in reads and given is None:
            raise ValueError(
                f"mask_mod reads {arg}, so its summary differs between {'batch entries' if arg == 'b' else 'heads'}: "
                f"give {name} (None is for a mask that is the same for all)"
            )
    extents = (batch if batch is not None and "b" in reads else 1, heads if heads is not None and "h" in reads else 1)
    # whole blocks of 128 rows and keys (the largest tile of a kernel that reads the cells)
    units = (max(block[0], _plan.RANGE_BLOCK), max(block[1], _plan.RANGE_BLOCK))
    lengths = (seqlen_q, seqlen_k)
    cells = (-(-seqlen_q // units[0]) * units[0] // block[0], -(-seqlen_k // units[1]) * units[1] // block[1])
    if extents[0] * extents[1] * cells[0] * cells[1] >= 2**31:
        raise ValueError(
            f"the summary would have {extents[0] * extents[1] * cells[0] * cells[1]} cells (32-bit offsets in the "
            "kernels): use a larger BLOCK_SIZE, or B / H = None where the mask is the same for all"
        )
    gpu = _where(mod, device)
    if gpu is None:
        return _on_host(mask_mod, shape, block, mod, extents, lengths, cells)
    return _on_gpu(mask_mod, shape, block, mod, extents, lengths, cells, *gpu)


def _where(mod: _mods.Mod, device: Any) -> tuple[Any, int, tuple[Any, ...]] | None:
    """(library, GPU, the captured arrays as the kernels read them) of a summary made on a GPU,
    None on the host: where the captured arrays are, or ``device`` for a mask with none."""
    names = tuple(f"mask_mod's captured array {i}" for i in range(len(mod.buffers)))
    found = _interop.gpu_arrays(names, mod.buffers) if mod.buffers else None
    on_host = bool(mod.buffers) and found is None
    if device is None:
        if found is None:
            return None
        lib, gpu, adopted = found
        return lib, gpu, tuple(adopted)
    target = _interop.gpu_of_device(device)
    if target is None:
        if found is not None:
            raise ValueError(
                f"device={device!r}, but mask_mod captures arrays on GPU {found[1]}: the host cannot read them"
            )
        return None
    if on_host:
        raise ValueError(f"device={device!r}, but mask_mod captures host arrays: move them to that GPU first")
    if found is not None:
        if found[1] != target[1]:
            raise ValueError(f"device={device!r} is GPU {target[1]}, but mask_mod captures arrays on GPU {found[1]}")
        return found[0], found[1], tuple(found[2])
    return target[0], target[1], ()


def _on_host(
    mask_mod: Any, shape: Any, block: tuple[int, int], mod: _mods.Mod, extents: tuple[int, int],
    lengths: tuple[int, int], cells: tuple[int, int],
) -> BlockMask:  # fmt: skip
    import numpy as np
    from array_api_compat import array_namespace

    xp = array_namespace(*mod.buffers) if mod.buffers else array_namespace(np.empty(0))
    summary = xp_impl.block_mask_cells(xp, mod, mod.buffers, extents, lengths, block, cells)
    return BlockMask(
        mask_mod, shape, block, mod, extents, summary, xp_impl.block_mask_ranges(xp, summary, block), None, -1
    )


_plans = _plan.new_cache()


def _on_gpu(
    mask_mod: Any, shape: Any, block: tuple[int, int], mod: _mods.Mod, extents: tuple[int, int],
    lengths: tuple[int, int], cells: tuple[int, int], lib: Any, device: int, buffers: tuple[Any, ...],
) -> BlockMask:  # fmt: skip
    from array_api_compat import array_namespace

    kernel = _mods.kernel_mods(None, mod)
    launch = _plans.get((mod.key, extents, lengths, block), lambda: _plan.plan_block_mask_cells(
        kernel, extents, lengths, block, cells))  # fmt: skip
    if lib.wraps:  # arrays adopted through DLPack: keep the summary in CuPy (its kernels' library)
        lib = _interop.CUPY_LIB
    arrays = {f"mod_buffer{i}": buffers[slot] for i, (_, slot) in enumerate(kernel.buffers)}
    (summary,) = _launch.run_outputs(launch, lib, device, arrays)
    ranges = xp_impl.block_mask_ranges(array_namespace(summary), summary, block)
    return BlockMask(mask_mod, shape, block, mod, extents, summary, ranges, lib, device)


# ---------------------------------------------------------------------------------------------
# The summary a mask_mod implies: a call with a mask_mod and no BlockMask.
# ---------------------------------------------------------------------------------------------
#: Cells of an implied summary: 64 x 64 (the kernels' tiles are 64 or 128 rows by 32 to 176 keys;
#: a tile spanning several cells takes their combined state).
IMPLIED_BLOCK = (64, 64)
#: An implied summary has at most this many cells: its interval arithmetic runs on the host at a
#: signature's first call, a few NumPy passes over every cell (B x H x Nq/64 x Nk/64 for a mask
#: that reads b and h; about 0.1 s at 2M cells).
IMPLIED_MAX_CELLS = 1 << 21
#: Past that, cells of 128 x 128 (the largest the GPU tests cover): sequences up to about 180k.
IMPLIED_LARGEST_BLOCK = 128
_implied: OrderedDict[Any, BlockMask | None] = OrderedDict()
_implied_lock = threading.Lock()
_IMPLIED_ENTRIES = 64
_captured: dict[int, BlockMask] = {}  # the summaries CUDA graphs read (``implied_on``)


def implied(
    mod: _mods.Mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, signature: Any = None
) -> BlockMask | None:
    """The summary a mask_mod implies by its own tile classes (``_mod_tiles.tile_classes``:
    interval arithmetic over each cell's rows and keys, the mask never evaluated): what a call
    with a mask_mod and no BlockMask hands the kernels, so that each skips the cells the mask
    hides by its index arithmetic alone (a window, chunks, a prefix, a causal term beside a
    captured array's), runs score_mod alone on the cells it shows whole, and bounds its loops by
    the shown ranges; the Hopper forward, which reads summaries but classes no tile itself, too.
    Made on the host once per (expression, batch, heads, lengths) and copied to a GPU at its
    first call there; None where the classes decide no cell (every one mixed: a document mask
    alone) or the summary would pass IMPLIED_MAX_CELLS. ``signature``: an object that stands for
    the expression, kept across calls (the call's compiled KernelMods): a cheaper key than the
    expression a call traces anew (no deep comparison)."""
    key = (mod.key if signature is None else signature, batch, heads, seqlen_q, seqlen_k)
    with _implied_lock:
        if key in _implied:
            _implied.move_to_end(key)
            return _implied[key]
    made = _implied_summary(mod, batch, heads, seqlen_q, seqlen_k)
    with _implied_lock:
        _implied[key] = made
        while len(_implied) > _IMPLIED_ENTRIES:
            _implied.popitem(last=False)
    return made


def _implied_summary(mod: _mods.Mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> BlockMask | None:
    import numpy as np

    reads = _reads(mod)
    extents = (batch if "b" in reads else 1, heads if "h" in reads else 1)
    if min(extents) <= 0:
        return None
    block = IMPLIED_BLOCK
    while True:  # cells of 64, or larger for long sequences (a cell holding several tiles: its state)
        units = (max(block[0], _plan.RANGE_BLOCK), max(block[1], _plan.RANGE_BLOCK))
        cells = (-(-seqlen_q // units[0]) * units[0] // block[0], -(-seqlen_k // units[1]) * units[1] // block[1])
        if extents[0] * extents[1] * cells[0] * cells[1] <= IMPLIED_MAX_CELLS:
            break
        if block[0] >= IMPLIED_LARGEST_BLOCK:
            return None
        block = (2 * block[0], 2 * block[1])
    row0, key0 = np.arange(cells[0]) * block[0], np.arange(cells[1]) * block[1]
    row1, key1 = np.minimum(row0 + block[0], seqlen_q) - 1, np.minimum(key0 + block[1], seqlen_k) - 1
    states = _mod_tiles.tile_classes(
        mod, np.arange(extents[0]).reshape(-1, 1, 1, 1), np.arange(extents[1]).reshape(1, -1, 1, 1),
        (row0.reshape(1, 1, -1, 1), row1.reshape(1, 1, -1, 1)), (key0.reshape(1, 1, 1, -1), key1.reshape(1, 1, 1, -1)),
    )  # fmt: skip
    full = (extents[0], extents[1], cells[0], cells[1])
    states = np.broadcast_to(np.asarray(states, dtype=np.uint8), full)
    past = (row0 >= seqlen_q).reshape(-1, 1) | (key0 >= seqlen_k).reshape(1, -1)  # cells past the lengths
    states = np.where(past, np.uint8(xp_impl.MASK_CELL_EMPTY), states)
    decided = (states == xp_impl.MASK_CELL_HIDDEN) | (states == xp_impl.MASK_CELL_PLAIN)
    if not decided.any():
        return None
    states = np.ascontiguousarray(states)
    shape = (batch, heads, seqlen_q, seqlen_k)
    ranges = xp_impl.block_mask_ranges(np, states, block)
    return BlockMask(None, shape, block, mod, extents, states, ranges, None, -1)


def implied_on(
    mod: _mods.Mod, batch: int, heads: int, seqlen_q: int, seqlen_k: int, lib: Any, device: int, signature: Any
) -> BlockMask | None:
    """``implied``, where a call on ``device`` can read it: not while its stream captures a
    CUDA graph before the summary's first copy there (the call then classes tiles in the
    kernels, FA2's and the mma.sync backward's, or not at all, the Hopper forward's: the same
    result). One a capture reads is kept for the process: the graph holds its addresses, which
    the cache's eviction would otherwise free."""
    summary = implied(mod, batch, heads, seqlen_q, seqlen_k, signature)
    if summary is None or not _interop.stream_is_capturing(lib.stream(device)):
        return summary
    if device not in summary._pointers:
        return None
    with _implied_lock:
        _captured.setdefault(id(summary), summary)
    return summary


# ---------------------------------------------------------------------------------------------
# What the executors ask of a BlockMask.
# ---------------------------------------------------------------------------------------------
def traced(block_mask: Any) -> _mods.Mod:
    """The traced mask_mod of a ``block_mask=`` argument (checked to be a BlockMask)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a cupyflash.BlockMask (create_block_mask), got {type(block_mask).__name__}"
        )
    return block_mask._mod


def same_mask(block_mask: BlockMask, mod: _mods.Mod) -> bool:
    """Is ``mod`` (a call's mask_mod, traced) the BlockMask's mask: the same expression over the
    same captured arrays?"""
    mine = block_mask._mod
    return mod.key == mine.key and all(a is b for a, b in zip(mod.buffers, mine.buffers, strict=True))


def check_call(block_mask: BlockMask, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """A call's shape against the BlockMask's: the same lengths, and a batch and head count its
    own or one it broadcasts to (None; or 1 where the mask does not read that argument)."""
    b, h, rows, keys = block_mask.shape
    if (rows, keys) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"the block_mask was made for Q_LEN={rows}, KV_LEN={keys}; this call has {seqlen_q} query rows and "
            f"{seqlen_k} keys"
        )
    reads = _reads(block_mask._mod)
    for name, made, arg, have in (("B", b, "b", batch), ("H", h, "h", heads)):
        if made is None or made == have or (made == 1 and arg not in reads):
            continue
        why = f" (its mask_mod reads {arg}: a mask made for one does not stand for all)" if made == 1 else ""
        what = "batch entries" if arg == "b" else "query heads"
        raise ValueError(f"the block_mask was made for {name}={made}; this call has {have} {what}{why}")


def layout(block_mask: BlockMask) -> _plan.BlockCells:
    """The summary's layout, as a plan fixes it."""
    return block_mask._layout


def kernel_buffers(block_mask: BlockMask, lib: Any, device: int) -> tuple[int, int, int]:
    """The addresses of the summary's cells, key ranges and row ranges on GPU ``device``: where it
    was made, or (made on the host) a copy there, made at the first call on that GPU."""
    hit = block_mask._pointers.get(device)
    if hit is not None:
        return hit[:3]
    if block_mask._device >= 0 and block_mask._device != device:
        raise ValueError(f"the block_mask was made on GPU {block_mask._device}; this call runs on GPU {device}")
    with block_mask._lock:
        hit = block_mask._pointers.get(device)
        if hit is None:
            buffers = (block_mask._cells, *block_mask._ranges)
            owner = block_mask._lib
            if owner is None:  # a host summary: copied to the GPU once
                if _interop.stream_is_capturing(lib.stream(device)):
                    raise ValueError(
                        "the block_mask was made on the host and is copied to the GPU at its first call there, which "
                        "cannot run inside CUDA graph capture: call once before capturing, or make it on the GPU "
                        "(create_block_mask(..., device=...))"
                    )
                buffers = tuple(_interop.upload(x, device) for x in buffers)
                owner = _interop.CUPY_LIB
            cells, key_ranges, row_ranges = (owner.ptr(x) for x in buffers)
            hit = block_mask._pointers[device] = (cells, key_ranges, row_ranges, buffers)
    return hit[:3]
