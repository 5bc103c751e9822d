"""kernels_cu/mask.cuh run on the host: which keys each kernel's rows see.

Every kernel decides visibility with mask.cuh: the tile ranges to visit (KeyMask's key blocks for
a block of rows, QueryRangeOfKeys' row blocks for a block of keys in the backward), whether a
tile needs per-score masking, and the masking of an MMA accumulator fragment (KeyMask::apply,
QueryRangeOfKeys::apply and apply_by_row_offsets, PackedRowMask::apply for the decode kernel's
packed GQA rows and its tree of drafts, 32- and 64-bit words). The header is compiled here by the
host's C++ compiler beside a stand-in for common.cuh (CF_DEVICE, ceil_div, -inf and the two
shared-memory loads; nothing else of it is used), and each function is checked over every tile
of random shapes against the rule the header states:

    query row i sees key j iff j < seqlen_k, j <= i + shift + window_right (Is_causal),
    j >= i + shift - window_left (Is_local), and for a tree: j < shift or row i's draft bit
    j - shift, with shift = seqlen_k - seqlen_q,

a skipped tile holds no visible score, a tile that needs no mask holds only visible ones, and the
fragment's -inf sit exactly on the hidden scores.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np
import pytest
from helpers import host_library, needs_host_cxx

from cupyflash import _source

pytestmark = needs_host_cxx

COMMON_STANDIN = r"""
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#define CF_DEVICE inline
using std::max;
using std::min;
struct uint2 { unsigned int x, y; };
inline float neg_infinity() { return -INFINITY; }
constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
// shared memory: a host buffer, addressed from 0
inline unsigned char* cf_shared = nullptr;
inline uint32_t ld_shared_b32(uint32_t at) { uint32_t v; std::memcpy(&v, cf_shared + at, 4); return v; }
inline uint2 ld_shared_b64(uint32_t at) { uint2 v; std::memcpy(&v, cf_shared + at, 8); return v; }
"""

DRIVER = r"""
#include "mask.cuh"

// KeyMask<M, N>: per row block its key-block range, per tile needs_mask, visible() on the padded
// grid, and apply() over every 16-row x N-key fragment (hidden: 1).
template <int M, int N, bool C, bool L>
void key_mask(int sq, int sk, int wl, int wr, int* range, unsigned char* needs, unsigned char* visible,
              unsigned char* hidden) {
  const int mb = ceil_div(sq, M), nb = ceil_div(sk, N), keys = nb * N;
  for (int m = 0; m < mb; ++m) {
    const KeyMask<M, N, C, L> mask(m, sq, sk, wl, wr);
    range[2 * m] = mask.n_block_begin();
    range[2 * m + 1] = mask.n_block_end();
    for (int n = 0; n < nb; ++n) {
      needs[m * nb + n] = mask.needs_mask(n);
      for (int w = 0; w < M / 16; ++w)
        for (int lane = 0; lane < 32; ++lane) {
          float s[1][N / 8][4] = {};
          mask.apply(s, m * M + 16 * w, n * N, lane);
          for (int nt = 0; nt < N / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
              const int row = m * M + 16 * w + lane / 4 + 8 * (e / 2);
              const int key = n * N + MmaKeyColumns{}(nt, lane, e);
              hidden[row * keys + key] = std::isinf(s[0][nt][e]);
            }
        }
    }
    for (int row = m * M; row < m * M + M; ++row)
      for (int key = 0; key < keys; ++key) visible[row * keys + key] = mask.visible(row, key);
  }
}

// QueryRangeOfKeys<M, N>: per key block its row-block range, per tile needs_mask, and apply() /
// apply_by_row_offsets() over every 16-key x M-row transposed fragment (hidden[row][key]).
template <int M, int N, bool C, bool L>
void query_range(int sq, int sk, int wl, int wr, int* range, unsigned char* needs, unsigned char* hidden,
                 unsigned char* hidden_by_offsets) {
  const int mb = ceil_div(sq, M), nb = ceil_div(sk, N), keys = nb * N;
  for (int n = 0; n < nb; ++n) {
    const QueryRangeOfKeys<M, N, C, L> range_of(n, sq, sk, wl, wr);
    range[2 * n] = range_of.m_block_begin();
    range[2 * n + 1] = range_of.m_block_end();
    for (int m = 0; m < mb; ++m) {
      needs[n * mb + m] = range_of.needs_mask(m);
      for (int w = 0; w < N / 16; ++w)
        for (int lane = 0; lane < 32; ++lane) {
          float s[1][M / 8][4] = {}, t[1][M / 8][4] = {};
          range_of.apply(s, n * N + 16 * w, m * M, lane);
          range_of.apply_by_row_offsets(t, n * N + 16 * w, m * M, lane);
          for (int nt = 0; nt < M / 8; ++nt)
            for (int e = 0; e < 4; ++e) {
              const int key = n * N + 16 * w + lane / 4 + 8 * (e / 2);
              const int row = m * M + 8 * nt + 2 * (lane % 4) + e % 2;
              hidden[row * keys + key] = std::isinf(s[0][nt][e]);
              hidden_by_offsets[row * keys + key] = std::isinf(t[0][nt][e]);
            }
        }
    }
  }
}

// PackedRowMask over a CTA of M packed rows (row r: query (row0 + r) / group), keys in steps of
// K: needs_mask per step and apply() (hidden[r][key]); words: the CTA's tree words in "shared memory".
template <int M, int K, bool C, bool L, bool T, bool W>
void packed_rows(int row0, int row_end, int group, int sq, int sk, int wl, int wr, unsigned char* words,
                 unsigned char* needs, unsigned char* hidden) {
  cf_shared = words;
  const PackedRowMask<C, L, T, W> mask(row0, row_end, group, sq, sk, wl, wr, 0);
  const int steps = ceil_div(sk, K), keys = steps * K;
  for (int step = 0; step < steps; ++step) {
    needs[step] = mask.needs_mask(step * K, step * K + K - 1);
    for (int lane = 0; lane < 32; ++lane) {
      float s[M / 16][K / 8][4] = {};
      mask.apply(s, step * K, lane);
      for (int mt = 0; mt < M / 16; ++mt)
        for (int nt = 0; nt < K / 8; ++nt)
          for (int e = 0; e < 4; ++e) {
            const int row = 16 * mt + lane / 4 + 8 * (e / 2);
            const int key = step * K + MmaKeyColumns{}(nt, lane, e);
            hidden[row * keys + key] = std::isinf(s[mt][nt][e]);
          }
    }
  }
}
"""

KEY_TILES = ((64, 64), (128, 128), (128, 176), (64, 128))
FLAGS = ((False, False), (True, False), (False, True), (True, True))
PACKED = ((False, False, False, False), (True, False, False, False), (True, True, False, False),
          (False, False, True, False), (False, False, True, True))  # fmt: skip
PACKED_ROWS, PACKED_KEYS = 64, 32


def _cpp(*flags: bool) -> str:
    return ", ".join(str(f).lower() for f in flags)


def _name(kind: str, *args: object) -> str:
    return f"{kind}_" + "_".join(str(int(a)) if isinstance(a, bool) else str(a) for a in args)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mask_c")
    (folder / "common.cuh").write_text(COMMON_STANDIN)
    (folder / "mask.cuh").write_text((Path(_source.kernel_dir()) / "mask.cuh").read_text())
    wrappers = []
    ints = "int sq, int sk, int wl, int wr"
    for (m, n), flags in itertools.product(KEY_TILES, FLAGS):
        template = f"<{m}, {n}, {_cpp(*flags)}>"
        for kind in ("key_mask", "query_range"):
            wrappers.append(
                f'extern "C" void {_name(kind, m, n, *flags)}({ints}, int* r, unsigned char* a, unsigned char* x, '
                f"unsigned char* y) {{ {kind}{template}(sq, sk, wl, wr, r, a, x, y); }}"
            )
    for flags in PACKED:
        template = f"<{PACKED_ROWS}, {PACKED_KEYS}, {_cpp(*flags)}>"
        wrappers.append(
            f'extern "C" void {_name("packed", *flags)}(int row0, int row_end, int group, {ints}, unsigned char* '
            f"words, unsigned char* needs, unsigned char* hidden) {{ packed_rows{template}(row0, row_end, group, "
            "sq, sk, wl, wr, words, needs, hidden); }"
        )
    return host_library(DRIVER + "\n".join(wrappers) + "\n", folder, "-Wno-unknown-pragmas", f"-I{folder}")


def _rule(rows, keys, sq, sk, causal, local, wl, wr):
    """The header's rule on index grids (any row, real or padding)."""
    shift = sk - sq
    ok = keys < sk
    if causal:
        ok = ok & (keys <= rows + shift + wr)
    if local:
        ok = ok & (keys >= rows + shift - wl)
    return ok


def _cases(rng, count=14):
    """Random (seqlen_q, seqlen_k, window_left, window_right): Nq < Nk, Nq > Nk (rows with no
    key), equal, one query, windows narrower and wider than a tile, 0-wide windows."""
    fixed = [(1, 1, 0, 0), (1, 300, 17, 0), (300, 97, 5, 3), (257, 257, 64, 0), (200, 201, 0, 0)]
    drawn = [(int(rng.integers(1, 400)), int(rng.integers(1, 400)), int(rng.integers(0, 300)), int(rng.integers(0, 40)))
             for _ in range(count - len(fixed))]  # fmt: skip
    return fixed + drawn


def _p(a, ctype=ctypes.c_void_p):
    return a.ctypes.data_as(ctype)


@pytest.mark.parametrize("tile", KEY_TILES, ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=("none", "causal", "local", "causal-local"))
def test_key_mask_ranges_tiles_and_fragments(library, tile, flags):
    m, n = tile
    causal, local = flags
    function = getattr(library, _name("key_mask", m, n, causal, local))
    for sq, sk, wl, wr in _cases(np.random.default_rng(m * 1000 + n + 7 * causal + 3 * local)):
        wr = wr if causal else 0
        mb, nb = -(-sq // m), -(-sk // n)
        rows, keys = mb * m, nb * n
        ranges = np.zeros(2 * mb, np.int32)
        needs = np.zeros(mb * nb, np.uint8)
        visible, hidden = np.zeros(rows * keys, np.uint8), np.zeros(rows * keys, np.uint8)
        function(sq, sk, wl, wr, _p(ranges), _p(needs), _p(visible), _p(hidden))
        i, j = np.meshgrid(np.arange(rows), np.arange(keys), indexing="ij")
        want = _rule(i, j, sq, sk, causal, local, wl, wr)
        case = f"Nq {sq} Nk {sk} window ({wl}, {wr})"
        np.testing.assert_array_equal(visible.reshape(rows, keys).astype(bool), want, err_msg=f"visible, {case}")
        np.testing.assert_array_equal(hidden.reshape(rows, keys).astype(bool), ~want, err_msg=f"apply, {case}")
        needs = needs.reshape(mb, nb).astype(bool)
        for block in range(mb):
            real = want[block * m : min(block * m + m, sq)]  # the block's real rows
            seen = np.flatnonzero(real.reshape(real.shape[0], nb, n).any(axis=(0, 2)))
            begin, end = ranges[2 * block : 2 * block + 2]
            assert seen.size == 0 or (begin <= seen[0] and seen[-1] < end), (case, block, begin, end, seen)
            for key_block in range(max(begin, 0), min(end, nb)):
                if not needs[block, key_block]:
                    assert real[:, key_block * n : key_block * n + n].all(), (case, block, key_block)


@pytest.mark.parametrize("tile", KEY_TILES, ids=str)
@pytest.mark.parametrize("flags", FLAGS, ids=("none", "causal", "local", "causal-local"))
def test_query_range_of_keys_ranges_tiles_and_fragments(library, tile, flags):
    m, n = tile
    causal, local = flags
    function = getattr(library, _name("query_range", m, n, causal, local))
    for sq, sk, wl, wr in _cases(np.random.default_rng(m * 977 + n + 5 * causal + 11 * local)):
        wr = wr if causal else 0
        mb, nb = -(-sq // m), -(-sk // n)
        rows, keys = mb * m, nb * n
        ranges = np.zeros(2 * nb, np.int32)
        needs = np.zeros(nb * mb, np.uint8)
        hidden, by_offsets = np.zeros(rows * keys, np.uint8), np.zeros(rows * keys, np.uint8)
        function(sq, sk, wl, wr, _p(ranges), _p(needs), _p(hidden), _p(by_offsets))
        i, j = np.meshgrid(np.arange(rows), np.arange(keys), indexing="ij")
        want = _rule(i, j, sq, sk, causal, local, wl, wr)
        case = f"Nq {sq} Nk {sk} window ({wl}, {wr})"
        np.testing.assert_array_equal(hidden.reshape(rows, keys).astype(bool), ~want, err_msg=f"apply, {case}")
        np.testing.assert_array_equal(
            by_offsets.reshape(rows, keys).astype(bool), ~want, err_msg=f"apply_by_row_offsets, {case}"
        )
        needs = needs.reshape(nb, mb).astype(bool)
        real = want & (i < sq)  # padding rows are the kernels' to drop (-LSE = -inf), not the mask's
        for key_block in range(nb):
            cols = real[:, key_block * n : key_block * n + n]
            seen = np.flatnonzero(cols.reshape(mb, m, n).any(axis=(1, 2)))
            begin, end = ranges[2 * key_block : 2 * key_block + 2]
            assert seen.size == 0 or (begin <= seen[0] and seen[-1] < end), (case, key_block, begin, end, seen)
            for block in range(max(begin, 0), min(end, mb)):
                if not needs[key_block, block]:
                    tile_rows = want[block * m : min(block * m + m, sq), key_block * n : key_block * n + n]
                    assert tile_rows.all(), (case, key_block, block)


def _tree(rng, drafts):
    """A random token tree (draft 0 the root; each later draft a child of an earlier one)."""
    mask = np.eye(drafts, dtype=bool)
    for d in range(1, drafts):
        mask[d] |= mask[int(rng.integers(d))]
    return mask


@pytest.mark.parametrize("flags", PACKED, ids=("none", "causal", "causal-local", "tree", "wide-tree"))
def test_packed_rows_of_the_decode_kernel(library, flags):
    causal, local, tree, wide = flags
    function = getattr(library, _name("packed", causal, local, tree, wide))
    rng = np.random.default_rng(sum(2**i * f for i, f in enumerate(flags)))
    for _ in range(12):
        sq = int(rng.integers(33, 65)) if wide else int(rng.integers(1, 33 if tree else 17))
        sk = sq + int(rng.integers(0, 300))
        group = int(rng.integers(1, 9))
        wl, wr = (int(rng.integers(0, 200)) if local else 0), 0
        row0 = PACKED_ROWS * int(rng.integers(0, max(1, sq * group // PACKED_ROWS)))
        row_end = min(row0 + PACKED_ROWS, sq * group)
        steps = -(-sk // PACKED_KEYS)
        keys = steps * PACKED_KEYS
        drafts = _tree(rng, sq) if tree else None
        word_bytes = 8 if wide else 4
        words = np.zeros(PACKED_ROWS * word_bytes, np.uint8)
        if tree:
            for r in range(PACKED_ROWS):
                query = (row0 + r) // group
                bits = sum(1 << d for d in range(sq) if query < sq and drafts[query, d])
                words[r * word_bytes : (r + 1) * word_bytes] = np.frombuffer(
                    bits.to_bytes(word_bytes, "little"), np.uint8
                )
        needs, hidden = np.zeros(steps, np.uint8), np.zeros(PACKED_ROWS * keys, np.uint8)
        function(row0, row_end, group, sq, sk, wl, wr, _p(words), _p(needs), _p(hidden))
        r, j = np.meshgrid(np.arange(PACKED_ROWS), np.arange(keys), indexing="ij")
        query = (row0 + r) // group
        shift = sk - sq
        if tree:
            draft = j - shift
            in_tree = (draft >= 0) & (draft < sq) & (query < sq)
            sees = np.zeros_like(in_tree)
            sees[in_tree] = drafts[query[in_tree], draft[in_tree]]
            want = (draft < 0) | sees
        else:
            want = _rule(query, j, sq, sk, causal, local, wl, wr)
        case = f"Nq {sq} Nk {sk} group {group} rows {row0}..{row_end} window ({wl}, {wr})"
        got = hidden.reshape(PACKED_ROWS, keys).astype(bool)
        real = slice(0, row_end - row0)  # the CTA's rows past row_end hold no query
        np.testing.assert_array_equal(got[real], ~want[real], err_msg=f"apply, {case}")
        for step in np.flatnonzero(needs == 0):
            assert want[real, step * PACKED_KEYS : (step + 1) * PACKED_KEYS].all(), (case, step)
