"""kernels_cu/dq_tiles.cuh run on the host: where the Hopper backward keeps packed sequences'
per-row temporaries (-LSE log2 e, D, dQacc's 64-row tiles).

The key-block kernel (fa3_bwd.cu) adds a step's dQ (one or two 64-row tiles) at sequence b's
``dq_seq_temp_start(start_b, b) + 64 or 128 x step``; the per-row kernels (fa2_bwd.cu's prep and
dq conversion) run over a head's ``row_head_stride`` temporary rows (the plan's) and find each
row's sequence with ``dq_seq_of_temp_row``. The header is compiled here by the host's C++
compiler beside a stand-in for common.cuh, and checked over random packed batches (empty and
one-token sequences, lengths at and beside the 64- and 128-row steps, rows after the last
sequence) against what both kernels need:

* each sequence's steps, rounded up to 128 rows, lie inside the head's rows and apart from every
  other sequence's;
* the per-row kernels' rows of a sequence are exactly its packed rows, each once, at the rows the
  key-block kernel adds into; every other temporary row is padding;
* offsets that are bad (decreasing, negative, past the total: reported by prep) still map every
  row inside the packed total.

And where a tile puts each (row, column) of dQ: a consumer warpgroup stages its accumulator a
float4 per fragment (``dq_tile_fragment_bytes``; the 80-row steps' ``dq_swapped_fragment_bytes``)
for one bulk reduce-add, and the dq conversion reads (row, column) back through ``dq_tile_pair``
(64-row tiles) or ``dq_swapped_float4`` (80-row tiles, dQ^T on wgmma's M). Each reader is checked
against every element the writer stages, with the accumulator layout wgmma.cuh states (thread
32 w + lane, fragment j, element e holds M-row 16 w + lane / 4 + 8 (e / 2), N-column
8 j + 2 (lane % 4) + e % 2): at d = 128 a 64-row tile's part c is its rows (M) x d's columns
64 c .. (N); an 80-row tile's part c is d's columns 64 c .. (M) x its rows (N).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from helpers import host_library, needs_host_cxx

from cupyflash import _device, _plan, _source
from cupyflash._validate import varlen_problem

pytestmark = needs_host_cxx

H200 = _device.HOPPER

COMMON_STANDIN = r"""
#pragma once
#include <algorithm>
#include <cstdint>
#define CF_DEVICE inline
using std::max;
using std::min;
"""

DRIVER = r"""
#include "dq_tiles.cuh"

extern "C" long long temp_start(int start, int batch) { return dq_seq_temp_start(start, batch); }
extern "C" int tile_fragment_bytes(int part, int j, int tid) { return dq_tile_fragment_bytes(part, j, tid); }
extern "C" int tile_pair(int row, int col) { return dq_tile_pair(row, col); }
extern "C" int swapped_fragment_bytes(int part, int j, int tid) { return dq_swapped_fragment_bytes(part, j, tid); }
extern "C" int swapped_float4(int row, int group, int k) { return dq_swapped_float4(row, group, k); }
extern "C" int swapped_rows() { return kDqSwappedRows; }

extern "C" void seq_of_rows(const int32_t* cu, int batch, int total, int rows, int* start, int* len, int* seq_row) {
  for (int r = 0; r < rows; ++r) {
    const DqSeqRow s = dq_seq_of_temp_row(cu, batch, total, r);
    start[r] = s.start;
    len[r] = s.len;
    seq_row[r] = s.seq_row;
  }
}
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dq_tiles_c")
    (folder / "common.cuh").write_text(COMMON_STANDIN)
    (folder / "dq_tiles.cuh").write_text((Path(_source.kernel_dir()) / "dq_tiles.cuh").read_text())
    lib = host_library(DRIVER, folder, f"-I{folder}")
    lib.temp_start.restype = ctypes.c_longlong
    return lib


def head_rows(lengths: list[int], total: int, head_dim: int) -> int:
    """The plan's row_head_stride for these packed query lengths on Hopper."""
    batch = len(lengths)
    problem = varlen_problem(
        (total, 2, head_dim), (total, 2, head_dim), (total, 2, head_dim), (batch + 1,), (batch + 1,),
        max(lengths), max(lengths), causal=True, scale=None, window=(-1, -1), softcap=0.0,
    )  # fmt: skip
    shape = (total, 2, head_dim)
    launch = _plan.plan_backward(problem, "bfloat16", H200, q_shape=shape, k_shape=shape, packed_rows=(total, total))
    assert launch.params.value("dq_tiled") == _plan.backward.DQ_TILES_PACKED
    return int(launch.params.value("row_head_stride"))


def place_rows(library, cu: np.ndarray, total: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cu = np.ascontiguousarray(cu, dtype=np.int32)
    out = [np.empty(rows, np.int32) for _ in range(3)]
    pointers = [x.ctypes.data_as(ctypes.POINTER(ctypes.c_int)) for x in (cu, *out)]
    library.seq_of_rows(pointers[0], len(cu) - 1, total, rows, *pointers[1:])
    return out[0], out[1], out[2]


def random_lengths(rng: np.random.Generator) -> list[int]:
    pool = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 255, 256, 300]
    batch = int(rng.integers(1, 40))
    return [int(rng.choice(pool)) if rng.random() < 0.6 else int(rng.integers(0, 400)) for _ in range(batch)]


@pytest.mark.parametrize("seed", range(40))
def test_packed_sequences_own_their_temporary_rows(library, seed):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1]) + int(rng.integers(0, 5))  # rows after the last sequence
    rows = head_rows(lengths, total, 64 if seed % 2 else 128)
    spans = []
    for b, length in enumerate(lengths):
        first = library.temp_start(int(cu[b]), b)
        assert first % 128 == 0 and first >= cu[b]
        spans.append((first, first + -(-length // 128) * 128))  # its steps of 64 or 128 rows, whole
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, f"{lengths}: a sequence's steps reach into the next one's rows"
    assert spans[-1][1] <= rows
    start, length, seq_row = place_rows(library, cu, total, rows)
    real = (seq_row >= 0) & (seq_row < length)
    packed = (start + seq_row)[real]
    assert np.array_equal(np.sort(packed), np.arange(cu[-1])), "each packed row once, none outside a sequence"
    temp = np.flatnonzero(real)
    for b in range(len(lengths)):  # the rows the key-block kernel adds into
        mine = (packed >= cu[b]) & (packed < cu[b + 1])
        assert np.array_equal(temp[mine], spans[b][0] + packed[mine] - cu[b])


@pytest.mark.parametrize("cu", [[0, 50, 20, 90], [0, -7, 40, 90], [5, 30, 60, 90], [0, 30, 500, 90], [0, 90, 90, 90]])
def test_bad_offsets_stay_inside_the_packed_rows(library, cu):
    total = 90
    start, length, seq_row = place_rows(library, np.array(cu), total, (-(-total // 128) + 3) * 128)
    real = (seq_row >= 0) & (seq_row < length)
    packed = (start + seq_row)[real]
    assert ((packed >= 0) & (packed < total)).all()


TILE_WIDTH = 128  # d = 128: two 64-column parts


def staged(fragment_bytes, rows_on_m: bool, tile_rows: int) -> dict[tuple[int, int], int]:
    """(row, column) -> the float the consumers stage it at, over both parts' 128 threads."""
    where = {}
    n_extent = TILE_WIDTH // 2 if rows_on_m else tile_rows  # the accumulator's N
    for part in range(2):
        for tid in range(128):
            w, lane = divmod(tid, 32)
            for j in range(n_extent // 8):
                for e in range(4):
                    m = 16 * w + lane // 4 + 8 * (e // 2)
                    n = 8 * j + 2 * (lane % 4) + e % 2
                    row, col = (m, 64 * part + n) if rows_on_m else (n, 64 * part + m)
                    where[row, col] = fragment_bytes(part, j, tid) // 4 + e
    return where


def test_a_64_row_tile_s_pairs_are_where_the_consumers_stage_them(library):
    where = staged(library.tile_fragment_bytes, rows_on_m=True, tile_rows=64)
    assert sorted(where.values()) == list(range(64 * TILE_WIDTH))  # every float once
    for (row, col), at in where.items():
        if col % 2 == 0:  # a pair: (row, col) and (row, col + 1) in one float2
            assert library.tile_pair(row, col) == at and where[row, col + 1] == at + 1, (row, col)


def test_an_80_row_tile_s_floats_are_where_the_swapped_consumers_stage_them(library):
    rows = library.swapped_rows()
    assert rows == 80
    where = staged(library.swapped_fragment_bytes, rows_on_m=False, tile_rows=rows)
    assert sorted(where.values()) == list(range(rows * TILE_WIDTH))
    # the dq conversion's float4 of columns 16 g + k and 16 g + 8 + k, rows r and r + 1 (r even)
    for r in range(0, rows, 2):
        for g in range(TILE_WIDTH // 16):
            for k in range(8):
                base = library.swapped_float4(r, g, k)
                assert library.swapped_float4(r + 1, g, k) == base, (r, g, k)
                first, second = 16 * g + k, 16 * g + 8 + k
                got = [where[r, first], where[r + 1, first], where[r, second], where[r + 1, second]]
                assert got == [base, base + 1, base + 2, base + 3], (r, g, k)
