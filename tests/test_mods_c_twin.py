"""The score hook's generated CUDA C, run on the host against the host path.

``_mods.kernel_mods`` writes the C that the kernels include: each traced function, then
``cf_user_mods`` (the mask's -inf, an index outside a captured array's NaN), ``cf_user_score``
(a BlockMask's plain tiles) and ``cf_user_mods_grad`` (the backward's d score_mod / d score).
NVRTC checks that this C compiles (tests/test_mods.py); it cannot check that it computes what
the trace means. Here the same text is compiled as C++ by the host's compiler, with a few lines
standing in for CUDA's qualifiers and intrinsics, called on random scores and indices, and
compared element by element with ``_mods.evaluate`` in float32, the host path's twin: integer
and boolean results exactly (Python's floor division and modulo on negative operands, index
arithmetic, comparisons across kinds), float results to float32 rounding (the math library's
exp / log / tanh differ from NumPy's in the last bits), NaN and infinities where they fall.
Captured arrays of every element type the kernels read, with strides of sliced views. A wrong
expression that compiles fails here, on a machine with no GPU.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np
import pytest
from helpers import host_library, needs_host_cxx

from cupyflash import _mods, mods

pytestmark = needs_host_cxx

# What CUDA gives the generated text and a host compiler lacks. x86-64 float arithmetic is IEEE
# binary32 (SSE), as the GPU's; -ffp-contract=off keeps a * b + c two roundings, as NumPy's.
STAND_INS = r"""
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(unsigned int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float cf_host_expf(float x) { return std::exp(x); }  // (the GPU's: a few ulp from these)
static inline float cf_host_logf(float x) { return std::log(x); }
#define __expf cf_host_expf
#define __logf cf_host_logf
static inline float fast_tanh(float x) { return std::tanh(x); }  // (common.cuh's: tanh.approx.f32)
"""
PRELUDE = (
    STAND_INS
    + r"""
struct AttnParams {  // the fields kernels_cu/params.cuh's AttnParams gives the score hook
  const void* mod_buffer0; const void* mod_buffer1; const void* mod_buffer2; const void* mod_buffer3;
  int64_t mod_buffer0_stride0, mod_buffer0_stride1, mod_buffer1_stride0, mod_buffer1_stride1;
  int64_t mod_buffer2_stride0, mod_buffer2_stride1, mod_buffer3_stride0, mod_buffer3_stride1;
  int32_t seqlen_q, seqlen_k;
};
"""
)

DRIVER = r"""
extern "C" void cf_run_{n}(int count, const AttnParams* p, const float* score, const int* b, const int* h,
                          const int* q, const int* kv, float* both, float* alone, float* slope) {{
  for (int i = 0; i < count; ++i) {{
    pair{n}::CfUserModsState st;  // (b, h)'s part, as UserMods computes it once per tile
    pair{n}::cf_user_mods_head(*p, b[i], h[i], st);
    both[i] = pair{n}::cf_user_mods(*p, st, score[i], b[i], h[i], q[i], kv[i]);
    alone[i] = pair{n}::cf_user_score(*p, st, score[i], b[i], h[i], q[i], kv[i]);
    slope[i] = pair{n}::cf_user_mods_grad(*p, st, score[i], b[i], h[i], q[i], kv[i]);
  }}
}}
"""


class Params(ctypes.Structure):
    _fields_ = (
        [(f"mod_buffer{i}", ctypes.c_void_p) for i in range(4)]
        + [(f"mod_buffer{i}_stride{axis}", ctypes.c_int64) for i in range(4) for axis in range(2)]
        + [("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32)]
    )


NB, NH, NQ, NK = 2, 4, 61, 75  # index ranges of the grids
# A call's index ranges (_mods.Grid): the reads they keep inside their arrays are compiled with
# no check, so every test of the generated C runs both ways.
GRIDS = {"checked": None, "grid": _mods.Grid(NB, NH, NQ, NK)}
COUNT = 6000


def _captured(rng):
    """Captured arrays of every element type the kernels read, several as sliced views (strides
    other than their shapes' own)."""
    doc = np.repeat(np.arange(9), 9)[:NK].astype(np.int32)  # documents of 9 tokens
    table = rng.standard_normal((NH, 2 * 128)).astype(np.float32)[:, ::2]  # (4, 128), stride 2
    slopes = (2.0 ** -np.arange(1, NH + 1)).astype(np.float64)
    wide = rng.integers(-50, 50, (NK, 3)).astype(np.int64)[:, 1]  # 1-D, stride 3
    small = rng.integers(-7, 7, NK).astype(np.int16)
    keep = rng.random(NK) < 0.7
    bytes_ = rng.integers(0, 255, NK).astype(np.uint8)
    signed = rng.integers(-128, 127, (NK, NQ)).astype(np.int8).T  # (NQ, NK), transposed strides
    return doc, table, slopes, wide, small, keep, bytes_, signed


def _pairs(rng):
    """(name, score_mod, mask_mod) as Python functions, traced by the test: the gallery's forms and
    the operations whose C differs from Python's (// and % on negatives, int / int, kinds mixed)."""
    doc, table, slopes, wide, small, keep, bytes_, signed = _captured(rng)
    return {
        "document-causal": (None, lambda b, h, q, kv: (doc[q] == doc[kv]) & ~(kv > q)),
        "chunks-or-stride": (None, lambda b, h, q, kv: (q // 8 == kv // 8) | (kv % 3 == 0)),
        "negative-floordiv-mod": (
            lambda s, b, h, q, kv: s + ((kv - q) // 7) * 0.25 + ((q - kv) % -5) - (kv - 40) // -3,
            lambda b, h, q, kv: ((q - kv) % 4 != 1) | ((kv - q) // 6 == -2),
        ),
        "relative-table": (lambda s, b, h, q, kv: s + table[h, kv - q + 64] - 0.5 * mods.abs(q - kv), None),
        "alibi-window": (
            lambda s, b, h, q, kv: s - slopes[h] * mods.abs(q - kv),
            lambda b, h, q, kv: (q - kv < 16) & (kv <= q),
        ),
        "softcap-where": (
            lambda s, b, h, q, kv: mods.where(q >= kv, 30.0 * mods.tanh(s / 30.0), mods.log(mods.exp(s) + 1) / 2),
            None,
        ),
        "min-max-float-mod": (
            lambda s, b, h, q, kv: mods.maximum(mods.minimum(s, 5), -math.inf) + (s // 2) % 1.5 + q / (kv + 1),
            None,
        ),
        "integer-dtypes": (
            lambda s, b, h, q, kv: s * (1 + small[kv]) + wide[kv] / 64 + mods.minimum(bytes_[kv], 200) / 255,
            lambda b, h, q, kv: keep[kv] | (h == b),
        ),
        # values of b and h alone, computed once per tile into the state (an index among them)
        "per-head-state": (
            lambda s, b, h, q, kv: s * slopes[h] + table[h % 4, kv] - (h // 2) * 0.5 + slopes[(h + b) % 4],
            lambda b, h, q, kv: (h // 2 == b) | keep[kv],
        ),
        "head-read-outside": (lambda s, b, h, q, kv: s + slopes[h + 2], None),  # heads 2, 3: outside
        # a constant score_mod is its own derivative (0): the two under names of their own
        "constant": (lambda s, b, h, q, kv: 0.0, lambda b, h, q, kv: kv <= q + 3),
        # past 32 bits: products, sums and differences the kernels must compute in 64 (their
        # range says so), a floor division of a 32-bit value by -1 (INT_MIN / -1 overflows 32)
        "wide-integers": (
            lambda s, b, h, q, kv: (
                s + ((q * 3_000_000_000 + kv * 2_147_483_647) % 1000) / 1000 + ((wide[kv] * 5_000_000_000) // 7) % 3
            ),
            lambda b, h, q, kv: ((kv - q) * 100_000 // 70_000 > -5) | ((q - 2_147_483_647 - kv) // -1 > 2**31 + 40),
        ),
        "bool-and-int-compare": (
            lambda s, b, h, q, kv: mods.where(keep[kv] & ~(q > 30), s, -s) + mods.abs(signed[q, kv]),
            lambda b, h, q, kv: (mods.maximum(q - kv, kv - q) <= 2 * h + 3) | (signed[q, kv] > 100),
        ),
    }


def _host(mod, values, buffers):
    """The host path's value (its index grids are int64 aranges; the kernels' ints are 32-bit)."""
    values = {k: v.astype(np.int64) if k != "score" else v for k, v in values.items()}
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # the grid's NaN and infinite scores
        return np.asarray(_mods.evaluate(np, mod, values, buffers, np.float32))


def _expected(score_mod, mask_mod, values):
    """What cf_user_mods, cf_user_score and cf_user_mods_grad should return, from the host path."""
    shape = values["score"].shape
    logit = values["score"] if score_mod is None else _host(score_mod, values, score_mod.buffers)
    logit = np.broadcast_to(np.asarray(logit, np.float32), shape)
    shown = np.ones(shape, bool)
    if mask_mod is not None:
        shown = np.broadcast_to(_host(mask_mod, values, mask_mod.buffers), shape)
    if score_mod is None:
        slope = np.ones(shape, np.float32)
    else:
        slope = np.broadcast_to(_host(_mods.score_derivative(score_mod), values, score_mod.buffers), shape)
    return np.where(shown, logit, np.float32(-np.inf)), logit, slope.astype(np.float32)


def _guarded(array):
    """A C-contiguous copy of ``array`` that ends where an unreadable page begins: a read past its
    end stops the process with SIGSEGV (pytest's faulthandler names the test), where an ordinary
    copy would hand the C a neighbour's bytes, which no comparison could tell from a value."""
    page = mmap.PAGESIZE
    pages = -(-array.nbytes // page) + 1
    region = mmap.mmap(-1, pages * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    copy = np.frombuffer(region, array.dtype, array.size, offset=(pages - 1) * page - array.nbytes)
    copy = copy.reshape(array.shape)
    copy[...] = array
    return copy


def _params(kernel, score_mod, mask_mod, guarded=False):
    """The AttnParams of a launch over the NQ x NK grid; ``guarded``: each array a ``_guarded``
    copy (the tile loops compute the parts of rows and keys past the sequence)."""
    params = Params()
    params.seqlen_q, params.seqlen_k = NQ, NK
    params.arrays = []  # (kept alive with the struct that points into them)
    for n, array in enumerate(kernel.arrays(score_mod, mask_mod)):
        # as a launch binds it (_launch's INDEX operands): a copy where the last axis's stride is
        # not 1, which the generated C assumes
        if guarded:
            array = _guarded(array)
        elif array.shape[-1] > 1 and array.strides[-1] != array.itemsize:
            array = np.ascontiguousarray(array)
        params.arrays.append(array)
        setattr(params, f"mod_buffer{n}", array.ctypes.data)
        for axis, stride in enumerate(array.strides):
            setattr(params, f"mod_buffer{n}_stride{axis}", stride // array.itemsize)
    return params


@pytest.fixture(scope="module", params=list(GRIDS))
def compiled(tmp_path_factory, request):
    """Every pair's kernel_mods source, each in its own namespace, in one shared library: every
    read checked, or those the grid's ranges keep inside unchecked."""
    rng = np.random.default_rng(11)
    pairs = _pairs(rng)
    traced = {}
    parts = [PRELUDE]
    for n, (name, (score_fn, mask_fn)) in enumerate(pairs.items()):
        score_mod = None if score_fn is None else _mods.trace_score_mod(score_fn)
        mask_mod = None if mask_fn is None else _mods.trace_mask_mod(mask_fn)
        kernel = _mods.kernel_mods(score_mod, mask_mod, grid=GRIDS[request.param])
        traced[name] = (n, score_mod, mask_mod, kernel)
        parts += [f"namespace pair{n} {{", kernel.source, "}", DRIVER.format(n=n)]
    flags = ("-ffp-contract=off", "-fno-fast-math", "-Wno-unused-variable", "-Wno-unused-function")
    library = host_library("\n".join(parts), tmp_path_factory.mktemp("mods_c"), *flags)
    return library, traced


def _grid(rng, in_range):
    values = {
        "b": rng.integers(0, NB, COUNT).astype(np.int32),
        "h": rng.integers(0, NH, COUNT).astype(np.int32),
        "q_idx": rng.integers(0, NQ, COUNT).astype(np.int32),
        "kv_idx": rng.integers(0, NK, COUNT).astype(np.int32),
    }
    score = (rng.standard_normal(COUNT) * 8).astype(np.float32)
    score[::97] = np.nan  # NaN in gives NaN out
    score[5::89] = np.inf
    score[7::101] = -np.inf
    values["score"] = score
    if in_range:  # the relative table reads kv - q + 64: keep it inside its 128 columns
        keep = np.abs(values["kv_idx"].astype(np.int64) - values["q_idx"]) < 64
        values = {k: v[keep] for k, v in values.items()}
    return values


def _run(library, n, params, values):
    count = values["score"].shape[0]
    outs = [np.empty(count, np.float32) for _ in range(3)]
    pointer = ctypes.POINTER(ctypes.c_float)

    def ptr(a):
        return a.ctypes.data_as(ctypes.c_void_p)

    getattr(library, f"cf_run_{n}")(
        ctypes.c_int(count), ctypes.byref(params), *(ptr(values[k]) for k in ("score", "b", "h", "q_idx", "kv_idx")),
        *(o.ctypes.data_as(pointer) for o in outs),
    )  # fmt: skip
    return outs


def _same(got, want, name, exact):
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all(), f"{name}: NaN at {np.flatnonzero(np.isnan(got) != nan)[:8]}"
    if exact:
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=name)
    else:  # float32 rounding; infinities equal
        np.testing.assert_allclose(got[~nan], want[~nan], rtol=4e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", [name for name in _pairs(np.random.default_rng(0)) if name != "head-read-outside"])
def test_the_generated_c_computes_what_the_host_path_does(compiled, name):
    library, traced = compiled
    n, score_mod, mask_mod, kernel = traced[name]
    values = _grid(np.random.default_rng(hash(name) % 2**32), in_range=True)
    both, alone, slope = _run(library, n, _params(kernel, score_mod, mask_mod), values)
    want_both, want_alone, want_slope = _expected(score_mod, mask_mod, values)
    # a score_mod of indices and integers alone gives exact results; transcendental ones round
    exact = name in ("document-causal", "chunks-or-stride")
    _same(both, want_both, f"{name}: cf_user_mods", exact)
    _same(alone, want_alone, f"{name}: cf_user_score", exact)
    _same(slope, want_slope, f"{name}: cf_user_mods_grad", exact)
    if mask_mod is not None:  # where the mask hides a score: -inf exactly, whatever the score
        hidden = ~np.broadcast_to(_host(mask_mod, values, mask_mod.buffers), both.shape)
        assert hidden.any() and (~hidden).any(), "the grid should show and hide scores"
        assert np.isneginf(both[hidden]).all()


def _check_outside(compiled, name, values, outside):
    """Pair ``name``'s C on ``values``: NaN where ``outside`` (an index outside a captured array),
    the host path's values elsewhere (its slope too), and the host path raising on them all."""
    library, traced = compiled
    n, score_mod, mask_mod, kernel = traced[name]
    assert outside.any() and (~outside).any()
    both, alone, slope = _run(library, n, _params(kernel, score_mod, mask_mod), values)
    assert np.isnan(both[outside]).all() and np.isnan(alone[outside]).all()
    want_both, _, want_slope = _expected(score_mod, mask_mod, {k: v[~outside] for k, v in values.items()})
    _same(both[~outside], want_both, "inside", exact=False)
    _same(slope[~outside], want_slope, "slope inside", exact=False)
    with pytest.raises(IndexError, match="outside the array"):
        _host(score_mod, values, score_mod.buffers)


def test_an_index_outside_a_captured_array_makes_the_score_nan(compiled):
    """The host path raises for such a read; the kernel's function reads nothing there and makes
    the score NaN (its row's output NaN, never a value from past the array)."""
    values = _grid(np.random.default_rng(5), in_range=False)
    column = values["kv_idx"].astype(np.int64) - values["q_idx"] + 64
    _check_outside(compiled, "relative-table", values, (column < 0) | (column >= 128))


def test_a_head_s_read_outside_its_array_makes_every_score_of_that_head_nan(compiled):
    """A read that depends on b and h alone runs once per tile (the state): outside its array it
    makes every score of those heads NaN, the others exact; the host path raises."""
    values = _grid(np.random.default_rng(6), in_range=True)
    _check_outside(compiled, "head-read-outside", values, values["h"] + 2 >= NH)


# -- the kernels' tile loops ---------------------------------------------------------------------
# kernels_cu/variants.cuh itself, built on the host: transform_scores and
# transform_scores_transposed compute what depends on a row alone or a key alone once for the
# scores of a thread's fragment that share it (UserMods' parts), then combine them per score.
# They must give, bit for bit, what the hook gives score by score. A few stand-ins replace
# common.cuh (CUDA's qualifiers and intrinsics the file names); params.cuh is the kernels' own.
HOST_COMMON = (
    "#pragma once\n"
    + STAND_INS
    + r"""
#define CF_DEVICE inline
#define __restrict__
struct int2 { int x, y; };
struct __half { unsigned short bits; };
template <typename T> static inline T __ldg(const T* p) { return *p; }
static inline float neg_infinity() { return __int_as_float(0xff800000u); }
static inline float quiet_nan() { return __int_as_float(0x7fffffffu); }
static inline constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
static inline void atomicOr(int32_t* p, int32_t bits) { *p |= bits; }
static inline uint32_t ld_shared_b32(uint32_t) { return 0; }
static inline uint32_t ld_shared_u16(uint32_t) { return 0; }
"""
)


def _variants_on_host(folder) -> str:
    """kernels_cu/variants.cuh's text for a host build in ``folder``: its own includes dropped,
    HOST_COMMON written there as common.cuh beside the kernels' params.cuh (which includes it)."""
    from cupyflash import _source

    kernel_dir = _source.kernel_dir()
    variants = (kernel_dir / "variants.cuh").read_text()
    (folder / "common.cuh").write_text(HOST_COMMON)
    (folder / "params.cuh").write_text((kernel_dir / "params.cuh").read_text())
    return "\n".join(line for line in variants.splitlines() if not line.startswith(("#pragma once", "#include")))


TILES_DRIVER = r"""
namespace pair{n} {{
constexpr int kMTiles = 2, kNTiles = 4;
static bool same(float a, float b) {{ return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; }}
// The score by score answer of a tile of class `state`: both functions (mixed), score_mod alone
// (a BlockMask's plain tile), the score itself (plain, no score_mod).
static float one(const UserMods& mods, int state, float score, int row, int key) {{
  if (cf_user_has_mask_mod && state == kMaskCellPlain)
    return UserMods::kHasScoreMod ? mods.score_only(score, row, key) : score;
  return mods(score, row, key);
}}
// Every lane's fragment of kMTiles x kNTiles m16n8 tiles (and a transposed one) at (row0, key0):
// the number of scores whose tile loop differs from the score by score answer.
extern "C" int cf_tiles_{n}(const void* const* buffers, const int64_t* strides, int seqlen_q, int seqlen_k,
                            float scale, int b, int h, int row0, int key0, int state, unsigned seed) {{
  AttnParams p{{}};
  const void** slots[4] = {{&p.mod_buffer0, &p.mod_buffer1, &p.mod_buffer2, &p.mod_buffer3}};
  int64_t* stride_slots[4] = {{&p.mod_buffer0_stride0, &p.mod_buffer1_stride0, &p.mod_buffer2_stride0,
                               &p.mod_buffer3_stride0}};
  for (int i = 0; i < 4; ++i) {{ *slots[i] = buffers[i]; *stride_slots[i] = strides[i]; }}
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.mod_score_scale = scale;
  const UserMods mods(p, b, h, 0);
  int bad = 0, unguarded_checked = 0;
  auto random_score = [&] {{ seed = seed * 1664525u + 1013904223u; return ((int)(seed >> 8) % 4000) / 100.f - 20.f; }};
  for (int lane = 0; lane < 32; ++lane) {{
    float s[kMTiles][kNTiles][4], want[kMTiles][kNTiles][4];
    for (int mt = 0; mt < kMTiles; ++mt) for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) {{
      s[mt][nt][e] = random_score();
      const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2), key = key0 + 8 * nt + 2 * (lane % 4) + e % 2;
      want[mt][nt][e] = one(mods, state, s[mt][nt][e], row, key);
    }}
    float u[kMTiles][kNTiles][4];
    std::memcpy(u, s, sizeof(s));
    user_mods_by_state</*Transposed=*/false>(mods, state, s, row0, key0, lane);
    for (int mt = 0; mt < kMTiles; ++mt) for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e)
      bad += !same(s[mt][nt][e], want[mt][nt][e]);
    // the Hopper forward's loop without the guard (functions that read nothing by row or key):
    // the same inside the sequence
    if (!UserMods::kReadsByIndex) {{
      user_mods_by_state</*Transposed=*/false>(PastUnguarded<UserMods>(mods), state, u, row0, key0, lane);
      for (int mt = 0; mt < kMTiles; ++mt) for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) {{
        const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2), key = key0 + 8 * nt + 2 * (lane % 4) + e % 2;
        if (row < seqlen_q && key < seqlen_k) bad += !same(u[mt][nt][e], want[mt][nt][e]);
      }}
      unguarded_checked += 1;
    }}
    float t[1][kNTiles][4], want_t[1][kNTiles][4];
    for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) {{
      t[0][nt][e] = random_score();
      const int key = key0 + lane / 4 + 8 * (e / 2), row = row0 + 8 * nt + 2 * (lane % 4) + e % 2;
      want_t[0][nt][e] = one(mods, state, t[0][nt][e], row, key);
    }}
    user_mods_by_state</*Transposed=*/true>(mods, state, t, row0, key0, lane);
    for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) bad += !same(t[0][nt][e], want_t[0][nt][e]);
  }}
  return bad + (unguarded_checked ? 1 << 20 : 0);  // (bit 20: the unguarded loop ran)
}}
}}
"""


def test_the_kernels_tile_loops_match_the_hook_score_by_score(tmp_path):
    """variants.cuh's tile loops (UserMods by parts: a row's and a key's reads once per
    fragment, in both layouts, both tile classes) give bit for bit what the hook gives score by
    score, on every pair here: NaN where an index is outside its array, rows and keys past the
    sequence left alone (tiles straddling both ends), with a scale. Each pair with every read
    checked and with the grid's unchecked, the arrays ending at an unreadable page: the parts
    of rows and keys past the sequence read nothing past an array."""
    variants = _variants_on_host(tmp_path)
    pairs = _pairs(np.random.default_rng(12))
    parts = ['#include "common.cuh"', '#include "params.cuh"', "#define CF_USER_MODS"]
    traced = {}
    for name, (score_fn, mask_fn) in pairs.items():
        score_mod = None if score_fn is None else _mods.trace_score_mod(score_fn)
        mask_mod = None if mask_fn is None else _mods.trace_mask_mod(mask_fn)
        for grid_name, grid in GRIDS.items():  # (unchecked reads: their parts clamped into the grid)
            n = len(traced)
            kernel = _mods.kernel_mods(score_mod, mask_mod, grid=grid)
            traced[name, grid_name] = (n, score_mod, mask_mod, kernel)
            parts += [f"namespace pair{n} {{", kernel.source, variants, "}", TILES_DRIVER.format(n=n)]
    flags = ("-ffp-contract=off", "-fno-fast-math", "-Wno-unused-variable", "-Wno-unused-function",
             "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized", f"-I{tmp_path}")  # fmt: skip
    library = host_library("\n".join(parts), tmp_path, *flags)
    checked = 0
    for name, (n, score_mod, mask_mod, kernel) in traced.items():
        params = _params(kernel, score_mod, mask_mod, guarded=True)
        buffers = (ctypes.c_void_p * 4)(*(getattr(params, f"mod_buffer{i}") for i in range(4)))
        strides = (ctypes.c_int64 * 4)(*(getattr(params, f"mod_buffer{i}_stride0") for i in range(4)))
        run = getattr(library, f"cf_tiles_{n}")
        run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 2, ctypes.c_float, *[ctypes.c_int] * 5,
                        ctypes.c_uint]  # fmt: skip
        for seqlen_q, seqlen_k in ((NQ, NK), (50, 40)):  # tiles past both ends
            for row0, key0 in ((0, 0), (32, 40), (48, 64)):
                for state in (1, 2):  # mixed, plain (kMaskCellMixed, kMaskCellPlain)
                    for b, h in ((0, 0), (1, 3)):
                        bad = run(buffers, strides, seqlen_q, seqlen_k, 0.37, b, h, row0, key0, state, 7 + row0)
                        unguarded = bad >> 20  # functions reading nothing by row or key: PastUnguarded too
                        assert unguarded == (not _mods._reads_by_index_any(score_mod, mask_mod)), name
                        bad &= (1 << 20) - 1
                        assert bad == 0, f"{name}: {bad} scores differ (Nq {seqlen_q}, Nk {seqlen_k}, {row0}, {key0})"
                        checked += 1
    assert checked == len(traced) * 24


def test_an_index_difference_converted_by_parts_is_the_integer_s_float(tmp_path):
    """With a call's grid under 2^24 positions, an integer of both indices that a float takes
    (ALiBi's |q_idx - kv_idx|, a signed distance) is computed from q_idx and kv_idx converted once
    per row and per key (_mods._float_by_parts): bit for bit the float of the integer, up to the
    last position; past 2^24 positions the kernels convert the integer itself."""
    slopes = (2.0 ** -np.arange(1, NH + 1)).astype(np.float32)
    score_mod = _mods.trace_score_mod(lambda s, b, h, q, kv: s - slopes[h] * mods.abs(q - kv) + 0.5 * (kv - q))
    largest = (1 << 24) - 1  # positions 0 .. 2^24 - 1: every difference a float exactly
    grids = {
        "ints": None,
        "parts": _mods.Grid(1, NH, largest + 1, largest + 1),
        "past": _mods.Grid(1, NH, (1 << 24) + 1, 2),
    }
    sources = {name: _mods.kernel_mods(score_mod, None, grid=grid).source for name, grid in grids.items()}
    assert "fabsf(" in sources["parts"] and "(float)(q_idx)" in sources["parts"]
    assert "fabsf(" not in sources["ints"] and "fabsf(" not in sources["past"]
    parts = [PRELUDE]
    for n, source in enumerate(sources.values()):
        parts += [f"namespace pair{n} {{", source, "}", DRIVER.format(n=n)]
    library = host_library("\n".join(parts), tmp_path, "-ffp-contract=off", "-Wno-unused-variable")
    rng = np.random.default_rng(13)
    count = 4000
    values = {
        "score": (rng.standard_normal(count) * 8).astype(np.float32),
        "b": np.zeros(count, np.int32),
        "h": rng.integers(0, NH, count).astype(np.int32),
        "q_idx": rng.integers(0, largest + 1, count).astype(np.int32),
        "kv_idx": rng.integers(0, largest + 1, count).astype(np.int32),
    }
    values["q_idx"][:4], values["kv_idx"][:4] = [0, largest, largest, 0], [largest, 0, largest, 0]
    values["kv_idx"][4:2000] = np.clip(values["q_idx"][4:2000] + rng.integers(-40, 40, 1996), 0, largest)
    outputs = [_run(library, n, _params(kernel, score_mod, None), values) for n, kernel in enumerate(
        _mods.kernel_mods(score_mod, None, grid=grid) for grid in grids.values())]  # fmt: skip
    for got in outputs[1:]:
        for a, b in zip(got, outputs[0], strict=True):
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    _same(outputs[0][0], _expected(score_mod, None, values)[0], "ints against the host path", exact=False)


RANGES_DRIVER = r"""
// block_mask_key_blocks for one tile of kBlockM rows from row0 (of `rows`): the key blocks
// [n_begin, n_end) of a tile whose mask bounds gave [0, n_blocks), in out[0], out[1].
template <int kBlockM>
static void ranges_of(const int32_t* ranges, int row0, int rows, int n_blocks, int* out) {
  AttnParams p{};
  p.mask_key_ranges = ranges;
  int n_begin = 0, n_end = n_blocks;
  block_mask_key_blocks<kBlockM, 128>(p, 0, 0, row0, rows, n_begin, n_end);
  out[0] = n_begin;
  out[1] = n_end;
}
extern "C" void cf_key_blocks(const int32_t* ranges, int block_m, int row0, int rows, int n_blocks, int* out) {
  if (block_m == 64) ranges_of<64>(ranges, row0, rows, n_blocks, out);
  if (block_m == 128) ranges_of<128>(ranges, row0, rows, n_blocks, out);
  if (block_m == 192) ranges_of<192>(ranges, row0, rows, n_blocks, out);
}
"""


def test_a_tile_s_key_blocks_cover_every_key_its_rows_see(tmp_path):
    """variants.cuh's block_mask_key_blocks (a BlockMask's keys per 128 query rows bounding a
    tile's loop), built on the host, for the kernels' 64-, 128- and 192-row tiles (the last,
    three consumers, spans two range blocks): the key blocks from the first that holds a key some
    row of the tile sees to the last, none where its rows see none; a last tile's padding rows
    read no range past the mask's rows (the ranges end there, at an unreadable page)."""
    variants = _variants_on_host(tmp_path)
    source = "\n".join(['#include "common.cuh"', '#include "params.cuh"', variants, RANGES_DRIVER])
    flags = ("-Wno-unused-variable", "-Wno-unused-function", "-Wno-unknown-pragmas", f"-I{tmp_path}")
    run = host_library(source, tmp_path, *flags).cf_key_blocks
    run.argtypes = [ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p]
    rng = np.random.default_rng(21)
    checked = 0
    for rows in (64, 129, 200, 300, 383, 384, 1000):
        range_blocks = -(-rows // 128)
        keys = 3000
        for _ in range(20):
            first = rng.integers(0, keys, range_blocks)
            end = np.minimum(first + rng.integers(1, 1500, range_blocks), keys)
            empty = rng.random(range_blocks) < 0.3
            first[empty], end[empty] = 0, 0
            table = np.stack([first, end], -1).astype(np.int32)
            ranges = _guarded(table)
            for block_m in (64, 128, 192):
                for row0 in range(0, rows, block_m):
                    out = np.zeros(2, np.int32)
                    run(ranges.ctypes.data, block_m, row0, rows, 24, out.ctypes.data)
                    blocks = range(row0 // 128, (min(row0 + block_m, rows) - 1) // 128 + 1)
                    seen = [(table[r, 0], table[r, 1]) for r in blocks if table[r, 0] < table[r, 1]]
                    if not seen:
                        assert out[1] <= out[0], (rows, block_m, row0)
                    else:
                        lo, hi = min(s[0] for s in seen), max(s[1] for s in seen)
                        assert tuple(out) == (lo // 128, min(24, -(-hi // 128))), (rows, block_m, row0)
                    checked += 1
    assert checked > 1000


ALIBI_DRIVER = r"""
#include <algorithm>
// The built-in ALiBi's tile loop (transform_scores over kMTiles x kNTiles m16n8 tiles at
// (row0, key0)) against its per-score operator, every lane: how many scores differ in their bits,
// and the largest difference relative to the operator's bias.
extern "C" int cf_alibi_tiles(float slope, float scale, int shift, int row0, int key0, unsigned seed,
                              float* worst) {
  constexpr int kMTiles = 2, kNTiles = 16;  // (the Hopper forward's 128-key blocks)
  AttnParams p{};
  const float slopes[1] = {slope};
  p.alibi_slopes = slopes;
  p.alibi_scale = scale;
  const Alibi alibi(p, 0, 0, shift);
  int differ = 0;
  *worst = 0.f;
  for (int lane = 0; lane < 32; ++lane) {
    float s[kMTiles][kNTiles][4], want[kMTiles][kNTiles][4], score[kMTiles][kNTiles][4];
    for (int mt = 0; mt < kMTiles; ++mt) for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) {
      seed = seed * 1664525u + 1013904223u;
      s[mt][nt][e] = score[mt][nt][e] = ((int)(seed >> 8) % 4000) / 100.f - 20.f;
      const int row = row0 + 16 * mt + lane / 4 + 8 * (e / 2), key = key0 + 8 * nt + 2 * (lane % 4) + e % 2;
      want[mt][nt][e] = alibi(s[mt][nt][e], row, key);
    }
    transform_scores(alibi, s, row0, key0, lane);
    for (int mt = 0; mt < kMTiles; ++mt) for (int nt = 0; nt < kNTiles; ++nt) for (int e = 0; e < 4; ++e) {
      const float got = s[mt][nt][e], ref = want[mt][nt][e];
      differ += std::memcmp(&got, &ref, 4) != 0;
      const float bias = std::fabs(ref - score[mt][nt][e]);
      if (bias > 0.f) *worst = std::max(*worst, std::fabs(got - ref) / bias);
    }
  }
  return differ;
}
"""


def test_the_builtin_alibi_tile_loop_is_its_operator(tmp_path):
    """variants.cuh's transform_scores for the built-in ALiBi (the distance converted once per
    row, the key's offset in the tile subtracted in float) gives bit for bit what Alibi's
    operator gives score by score (the integer distance's float) wherever the tile's distances
    stay below 2^24 - 2^7, tiles straddling the diagonal, with a shift either way; past that, the
    bias within 2^-22 of the operator's (a bias of 2^24 slope / M or more)."""
    variants = _variants_on_host(tmp_path)
    source = "\n".join(['#include "common.cuh"', '#include "params.cuh"', variants, ALIBI_DRIVER])
    flags = ("-ffp-contract=off", "-fno-fast-math", "-Wno-unused-variable", "-Wno-unused-function",
             "-Wno-unknown-pragmas", "-Wno-maybe-uninitialized", f"-I{tmp_path}")  # fmt: skip
    run = host_library(source, tmp_path, *flags).cf_alibi_tiles
    run.argtypes = [ctypes.c_float, ctypes.c_float, *[ctypes.c_int] * 3, ctypes.c_uint,
                    ctypes.POINTER(ctypes.c_float)]  # fmt: skip
    worst = ctypes.c_float()
    edge = (1 << 24) - 200  # the last distances every step keeps exact (a tile spans 32 rows, 128 keys)
    exact = [(0, 0, 0), (40, 0, 64), (64, 128, -64), (0, 5000, 17), (edge, 0, 0), (0, edge, 0), (edge - 31, 0, 0),
             (1 << 30, (1 << 30) + 3, 0), (0, 1 << 20, edge - (1 << 20))]  # fmt: skip
    for row0, key0, shift in exact:
        for slope, scale in ((0.5, 0.125), (2.0**-8, 1.0), (-0.25, 0.3)):
            differ = run(slope, scale, shift, row0, key0, 11 + row0 % 97, ctypes.byref(worst))
            assert differ == 0, (row0, key0, shift, slope, differ)
    for row0, key0, shift in (((1 << 26) + 5, 0, 0), (0, (1 << 25) + 3, 7), ((1 << 30) + 1, 2, 1 << 24)):
        run(0.5, 0.125, shift, row0, key0, 3, ctypes.byref(worst))
        assert worst.value <= 2.0**-22, (row0, key0, shift, worst.value)
