"""A mask_mod's tile classes read from its trace (cupyflash/_mod_tiles.py).

Sound: a tile called hidden shows no score and one called plain hides none, checked against the
mask evaluated at every score (``_mods.evaluate``) over random tiles, for the gallery's masks and
for 120 random masks (integer arithmetic, ``//`` and ``%`` by positive and negative constants and
by a varying divisor, ``abs``, ``minimum`` / ``maximum``, ``where``, comparisons, ``& | ~``, a
captured array). Exact where it should be: causal, sliding windows, prefix-LM and chunked local
attention at tile granularity. The kernels' C (``cf_user_mask_tile``) gives the same class as the
NumPy reader on every tile, compiled by the host's C++ compiler.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from helpers import host_library, needs_host_cxx

import cupyflash
from cupyflash import _mod_tiles, _mods, mods
from cupyflash._specs import HOPPER_SMEM_PER_BLOCK

NB, NH, NQ, NK = 2, 3, 300, 331
DOC = np.repeat(np.arange(40), 9)[:NK].astype(np.int32)

GALLERY = {
    "causal": lambda b, h, q, kv: kv <= q,
    "sliding-window": lambda b, h, q, kv: (kv <= q) & (q - kv < 64),
    "prefix-lm": lambda b, h, q, kv: (kv <= q) | (kv < 100),
    "chunked-local": lambda b, h, q, kv: (q // 64 == kv // 64) & (kv <= q),
    "per-head-window": lambda b, h, q, kv: mods.abs(q - kv) <= 16 * (h + 1),
    "document-causal": lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (kv <= q),
    "dilated": lambda b, h, q, kv: ((q - kv) % 4 == 0) | (kv % -3 == -1),
    "negative-chunks": lambda b, h, q, kv: q // -64 == kv // -64,
    "mod-bands": lambda b, h, q, kv: (q % 256 < 128) | (kv % -200 < -150),
}
# index-only masks of comparisons of sums, // and % by a constant: every tile decided exactly
EXACT = ("causal", "sliding-window", "prefix-lm", "chunked-local", "per-head-window", "negative-chunks", "mod-bands")


def _brute(mask: _mods.Mod) -> np.ndarray:
    """The mask at every (b, h, q, kv) of the grid, bool (NB, NH, NQ, NK)."""
    b, h, q, kv = np.meshgrid(np.arange(NB), np.arange(NH), np.arange(NQ), np.arange(NK), indexing="ij", sparse=True)
    values = {"b": b, "h": h, "q_idx": q, "kv_idx": kv}
    with np.errstate(divide="ignore", invalid="ignore"):
        shown = _mods.evaluate(np, mask, values, mask.buffers, np.float32)
    return np.broadcast_to(np.asarray(shown, bool), (NB, NH, NQ, NK))


def _tiles(rng: np.random.Generator, count: int) -> dict[str, np.ndarray]:
    """Random tiles: sizes 1 to 128 (the kernels' 64 and 128 among them), anywhere in the grid."""
    rows = rng.choice([1, 7, 16, 64, 128, int(rng.integers(1, 129))], count)
    keys = rng.choice([1, 8, 64, 128, int(rng.integers(1, 129))], count)
    r0 = rng.integers(0, NQ, count)
    k0 = rng.integers(0, NK, count)
    return {
        "b": rng.integers(0, NB, count),
        "h": rng.integers(0, NH, count),
        "r0": r0,
        "r1": np.minimum(r0 + rows - 1, NQ - 1),
        "k0": k0,
        "k1": np.minimum(k0 + keys - 1, NK - 1),
    }


def _classes(mask: _mods.Mod, t: dict[str, np.ndarray]) -> np.ndarray:
    return _mod_tiles.tile_classes(mask, t["b"], t["h"], (t["r0"], t["r1"]), (t["k0"], t["k1"]))


def _truth(shown: np.ndarray, t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(any score shown, every score shown) per tile."""
    parts = [shown[b, h, r0 : r1 + 1, k0 : k1 + 1] for b, h, r0, r1, k0, k1 in zip(*t.values(), strict=True)]
    return np.array([p.any() for p in parts]), np.array([p.all() for p in parts])


def _check_sound(mask: _mods.Mod, t: dict[str, np.ndarray], name: str) -> np.ndarray:
    classes = _classes(mask, t)
    any_shown, all_shown = _truth(_brute(mask), t)
    wrong_hidden = np.flatnonzero((classes == _mod_tiles.HIDDEN) & any_shown)
    wrong_plain = np.flatnonzero((classes == _mod_tiles.PLAIN) & ~all_shown)
    shown = [_tile(t, i) for i in wrong_hidden[:3]]
    assert wrong_hidden.size == 0, f"{name}: tiles (b, h, rows, keys) called hidden show a score: {shown}"
    hide = [_tile(t, i) for i in wrong_plain[:3]]
    assert wrong_plain.size == 0, f"{name}: tiles (b, h, rows, keys) called plain hide a score: {hide}"
    return classes


def _tile(t: dict[str, np.ndarray], i: int) -> tuple[int, ...]:
    return tuple(int(v[i]) for v in t.values())


@pytest.mark.parametrize("name", list(GALLERY))
def test_gallery_tile_classes_are_sound_and_exact(name):
    mask = _mods.trace_mask_mod(GALLERY[name])
    t = _tiles(np.random.default_rng(len(name)), 400)
    classes = _check_sound(mask, t, name)
    any_shown, all_shown = _truth(_brute(mask), t)
    if name in EXACT:
        np.testing.assert_array_equal(classes == _mod_tiles.HIDDEN, ~any_shown, err_msg=name)
        np.testing.assert_array_equal(classes == _mod_tiles.PLAIN, all_shown, err_msg=name)
    elif name == "document-causal":  # the causal term alone decides: hidden above the diagonal
        above = t["k0"] > t["r1"]
        np.testing.assert_array_equal(classes == _mod_tiles.HIDDEN, above)
        assert not (classes == _mod_tiles.PLAIN).any()  # the documents are a captured array's


@pytest.mark.parametrize("name", list(GALLERY))
def test_the_summary_a_mask_implies_is_the_exact_one_where_it_decides(name):
    """``_block_mask.implied`` (the cells' classes, what a call with a mask_mod alone hands the
    kernels) against ``create_block_mask``'s summary (the mask at every score): every cell it
    calls hidden, plain or past the lengths is so, the same cells as the exact summary's for
    index-only masks, and its shown ranges hold the exact ones (sound bounds on the kernels'
    loops). A mask none of whose cells the classes decide implies none: the dilated one (every
    64 x 64 cell holds shown and hidden scores), a document mask alone (its array's)."""
    from cupyflash import _block_mask, xp_impl

    mask = _mods.trace_mask_mod(GALLERY[name])
    implied = _block_mask.implied(mask, NB, NH, NQ, NK)
    if name == "dilated":
        assert implied is None
        return
    exact = cupyflash.create_block_mask(GALLERY[name], NB, NH, NQ, NK, BLOCK_SIZE=_block_mask.IMPLIED_BLOCK)
    assert implied is not None and implied._cells.shape[:2] == exact._cells.shape[:2], name
    got, want = np.asarray(implied._cells), np.asarray(exact._cells)
    decided = got != xp_impl.MASK_CELL_MIXED
    np.testing.assert_array_equal(got[decided], want[decided], err_msg=name)
    if name in EXACT:
        np.testing.assert_array_equal(got, want, err_msg=name)
    for r_got, r_want in zip(implied._ranges, exact._ranges, strict=True):
        r_got, r_want = np.asarray(r_got), np.asarray(r_want)
        shown = r_want[..., 1] > r_want[..., 0]
        assert (r_got[..., 0][shown] <= r_want[..., 0][shown]).all() and (r_got[..., 1] >= r_want[..., 1]).all(), name
    assert _block_mask.implied(mask, NB, NH, NQ, NK) is implied  # made once per signature
    document = _mods.trace_mask_mod(lambda b, h, q, kv: DOC[q] == DOC[kv])
    assert _block_mask.implied(document, NB, NH, NQ, NK) is None


def test_tiles_of_the_kernels_grid():
    """The classes of a kernel's grid of 128 x 128 tiles over a causal mask: the diagonal mixed,
    below it plain, above it hidden (what the FA2 forward's loop skips and runs score_mod alone on)."""
    mask = _mods.trace_mask_mod(GALLERY["causal"])
    r0 = np.arange(0, 1024, 128)[:, None]
    k0 = np.arange(0, 1024, 128)[None, :]
    classes = _mod_tiles.tile_classes(mask, 0, 0, (r0, r0 + 127), (k0, k0 + 127))
    want = np.where(k0 > r0, _mod_tiles.HIDDEN, np.where(k0 < r0, _mod_tiles.PLAIN, _mod_tiles.MIXED))
    np.testing.assert_array_equal(classes, want)


def _random_int(rng: np.random.Generator, depth: int, var: bool = False) -> str:
    """Python source of an integer expression of b, h, q, kv (var: at least one of them)."""
    if depth == 0 or rng.random() < 0.25:
        leaves = ["q", "kv", "b", "h"] if var else ["q", "kv", "b", "h", str(int(rng.integers(-9, 300)))]
        return str(rng.choice(leaves))
    a = _random_int(rng, depth - 1, var=True)
    b = _random_int(rng, depth - 1)
    v = _random_int(rng, depth - 1, var=True)
    c = int(rng.choice([-7, -3, -1, 1, 2, 5, 64, 100]))
    form = int(rng.integers(10))
    return [
        f"({a} + {b})", f"({a} - {b})", f"({a} * {int(rng.integers(-3, 4))})", f"({a} // {c})", f"({a} % {c})",
        f"mods.abs({a})", f"mods.minimum({a}, {b})", f"mods.maximum({a}, {b})",
        f"mods.where({_random_bool(rng, depth - 1)}, {a}, {b})", f"({a} // (mods.abs({v}) + 1))",
    ][form]  # fmt: skip


def _random_bool(rng: np.random.Generator, depth: int) -> str:
    form = int(rng.integers(6)) if depth > 0 else 0
    if form <= 2:
        op = str(rng.choice(["<", "<=", ">", ">=", "==", "!="]))
        return f"({_random_int(rng, depth, var=True)} {op} {_random_int(rng, depth)})"
    if form == 3:
        return f"~{_random_bool(rng, depth - 1)}"
    if form == 4:
        return f"({_random_bool(rng, depth - 1)} & {_random_bool(rng, depth - 1)})"
    return f"({_random_bool(rng, depth - 1)} | (DOC[kv] > {int(rng.integers(0, 40))}))"


def _random_masks(count: int = 120) -> list[tuple[str, _mods.Mod]]:
    rng = np.random.default_rng(2026)
    masks = []
    for _ in range(count):
        text = _random_bool(rng, int(rng.integers(1, 4)))
        fn = eval(f"lambda b, h, q, kv: {text}", {"mods": mods, "DOC": DOC})  # noqa: S307  (our own text)
        masks.append((text, _mods.trace_mask_mod(fn)))
    return masks


def test_random_masks_tile_classes_are_sound():
    decided = 0
    for i, (text, mask) in enumerate(_random_masks()):
        t = _tiles(np.random.default_rng(i), 120)
        classes = _check_sound(mask, t, text)
        decided += int((classes != _mod_tiles.MIXED).sum())
    assert decided > 4000  # most random masks decide some tiles (not everything is mixed)


@needs_host_cxx
def test_the_kernels_c_gives_the_same_classes(tmp_path):
    """cf_user_mask_tile (each mask's in its own namespace) on the host, tile by tile, against
    tile_classes."""
    masks = [(name, _mods.trace_mask_mod(fn)) for name, fn in GALLERY.items()] + _random_masks()
    parts = [
        "#include <cmath>",
        "using std::isinf;",
        "#define CF_TILE_INF INFINITY",
        "struct AttnParams {};",
        "#define __device__",
        "#define __forceinline__ inline",
        _mod_tiles.CUDA_HELPERS,
    ]
    for n, (_, mask) in enumerate(masks):
        parts += [f"namespace m{n} {{", _mod_tiles.cuda_source(mask), "}"]
        parts.append(
            f'extern "C" void tiles_{n}(int count, const long long* t, int* out) {{ const AttnParams p{{}}; '
            f"for (int i = 0; i < count; ++i) out[i] = m{n}::cf_user_mask_tile(p, t[6 * i], t[6 * i + 1], "
            "t[6 * i + 2], t[6 * i + 3], t[6 * i + 4], t[6 * i + 5]); }"
        )
    library = host_library("\n".join(parts), tmp_path, "-Wno-unused-variable", "-Wno-unused-but-set-variable")
    for n, (text, mask) in enumerate(masks):
        t = _tiles(np.random.default_rng(100 + n), 200)
        packed = np.ascontiguousarray(np.stack(list(t.values()), axis=1).astype(np.int64))
        out = np.empty(200, np.int32)
        getattr(library, f"tiles_{n}")(200, packed.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p))
        np.testing.assert_array_equal(out, _classes(mask, t), err_msg=text)


def test_no_mask_is_mixed_everywhere():
    source = _mod_tiles.cuda_source(None)
    assert "return 1;" in source and "cf_user_mask_tile" in source


def test_the_kernels_compile_with_tile_classes():
    """The FA2 forward and the mma.sync backward's key-block and dQ kernels with a mask's tile
    classes compiled in (what a call with a mask_mod gets): a cubin for sm_80 and sm_90a, no spill,
    no warning. (Without a mask every variant compiles to the bytes it had: the kernels call
    cf_user_mask_tile under `if constexpr`.) Four masks with
    CUPYFLASH_COMPILE_ALL=1 (scripts/gpu_check.sh), two by default."""
    pytest.importorskip("cupy")
    from helpers import FULL

    from cupyflash import _dispatch, _kernels

    # the forms the class code has: comparisons of sums, // (chunks), % and abs (dilated), a
    # captured array's unknowns (document)
    names = ["prefix-lm", "chunked-local", "dilated", "document-causal"] if FULL else ["prefix-lm", "document-causal"]
    builds = []
    for name in names:
        mask = _mods.trace_mask_mod(GALLERY[name])
        source = _mods.kernel_mods(None, mask, _mod_tiles.kernel_source(mask)).source
        assert "#define CF_USER_MASK_TILES" in source
        flags = _dispatch.MaskFlags(False, False, False, mask="mods")
        specs = [
            _dispatch.fa2_fwd_spec("bfloat16", 128, flags, HOPPER_SMEM_PER_BLOCK, mods_source=source),
            _dispatch.fa2_bwd_spec("bfloat16", 128, flags, False, source),
            _dispatch.fa2_bwd_dq_spec("float16", 64, flags, source),
        ]
        builds += [(name, spec.name, arch, _kernels.compile_offline(spec, arch)) for spec in specs
                   for arch in ("sm_80", "sm_90a")]  # fmt: skip
    assert not [(n, s, a, b.spill_bytes) for n, s, a, b in builds if b.spill_bytes]
    assert not [(n, s, a, b.warnings) for n, s, a, b in builds if b.warnings]
