"""cupyflash.io_model against counts worked out by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest

from cupyflash import io_model
from cupyflash.io_model import AttentionShape

# One head, N = 1024, d = 64, 2-byte elements. A [N, d] tensor is 1024 * 64 * 2 = 131072 bytes,
# an [N, N] one 1024 * 1024 * 2 = 2097152, the LSE 1024 * 4 = 4096.
ONE_HEAD = AttentionShape(batch=1, heads=1, seqlen_q=1024, seqlen_k=1024, head_dim=64)


def test_naive_bytes_and_flops():
    cost = io_model.naive_cost(ONE_HEAD)
    # read: Q, K (262144) + S (2097152) + P (2097152) + V (131072)
    assert cost.hbm_read == 4_587_520
    # write: S + P (4194304) + LSE (4096) + O (131072)
    assert cost.hbm_write == 4_329_472
    assert cost.matmul_flops == 4 * 1024 * 1024 * 64
    # 9 FLOPs per score in the two softmax passes, 4 per row to finish
    assert cost.softmax_flops == 9 * 1024 * 1024 + 4 * 1024
    # q, k, v, o (4 * 131072) + LSE (4096) + S and P (2 * 2097152)
    assert cost.peak_memory == 4 * 131072 + 4096 + 2 * 2097152


def test_naive_equals_the_papers_standard_count():
    """Theorem 2's standard attention: 4 N d + 4 N^2 elements (plus our LSE)."""
    paper = io_model.paper_hbm_elements(1024, 64, sram_elements=116224)["standard"]
    assert io_model.naive_cost(ONE_HEAD).hbm_bytes == 2 * paper + 4096


def test_fa1_bytes():
    # B_r = 64, B_c = 448: T_c = ceil(1024 / 448) = 3 steps for every one of the 16 Q tiles.
    cost = io_model.fa1_cost(ONE_HEAD, block_r=64, block_c=448)
    q_reads = 3 * 131072  # Q on each step
    state = 2 * 1024 * (4 * 64 + 8)  # (O fp32, m, l) read on steps 2 and 3 = 540672
    kv = 2 * 131072  # K and V once
    assert cost.hbm_read == q_reads + state + kv == 1_196_032
    assert cost.hbm_write == state + 131072 + 4096 == 675_840
    # peak: q, k, v, o, LSE and the float32 state (1024 rows * (64 * 4 + 8))
    assert cost.peak_memory == 4 * 131072 + 4096 + 1024 * 264


def test_fa1_bytes_grow_with_outer_steps():
    """Halving B_c doubles T_c and with it the Q and state traffic (the paper's N^2 d^2 / M)."""
    costs = [io_model.fa1_cost(ONE_HEAD, 64, block_c).hbm_bytes for block_c in (512, 256, 128)]
    # T_c = 2, 4, 8: Q reads 2, 4, 8 x 131072; state 2 x (T_c - 1) x 270336
    expected = [t * 131072 + 2 * (t - 1) * 270336 + 2 * 131072 + 131072 + 4096 for t in (2, 4, 8)]
    assert costs == expected


def test_fa1_state_bytes_option():
    """A 16-bit running O (what the paper's count assumes) halves the O part of the state."""
    full = io_model.fa1_cost(ONE_HEAD, 64, 448)
    half = io_model.fa1_cost(ONE_HEAD, 64, 448, state_bytes=2)
    assert full.hbm_bytes - half.hbm_bytes == 2 * 2 * 1024 * 64 * 2  # 2 steps, read + write, 2 bytes less


def test_fa2_bytes():
    # block_m = 128 -> T_r = 8 query blocks; each reads all of K and V (per_block).
    per_block = io_model.fa2_cost(ONE_HEAD, block_m=128, block_n=64)
    assert per_block.hbm_read == 131072 + 8 * 2 * 131072 == 2_228_224
    assert per_block.hbm_write == 131072 + 4096
    once = io_model.fa2_cost(ONE_HEAD, block_m=128, block_n=64, kv_reuse="l2")
    assert once.hbm_read == 131072 + 2 * 131072
    assert once.peak_memory == 4 * 131072 + 4096
    with pytest.raises(ValueError, match="kv_reuse"):
        io_model.fa2_cost(ONE_HEAD, 128, 64, kv_reuse="sometimes")


def test_fa2_backward_counts():
    """N = 1024, d = 64, 2-byte elements: a [N, d] tensor is 131072 bytes, an fp32 accumulator
    row 256; block_m = 64 -> 16 query tiles, each seen by 8 key blocks of 128."""
    cost = io_model.fa2_backward_cost(ONE_HEAD, block_m=64, block_n=128)
    prep_and_dq_in = 2 * 131072 + 4 * 1024 + 256 * 1024  # O, dO, LSE; the accumulator
    kv = 2 * 131072
    rows = 1024 * 8 * (64 * 2 + 8)  # Q / dO rows with -LSE / D, once per key block
    assert cost.hbm_read == prep_and_dq_in + kv + rows == 1_904_640
    assert cost.hbm_write == 8 * 1024 + 256 * 1024 + 131072 + 2 * 131072 == 663_552
    assert cost.matmul_flops == 2.5 * io_model.fa2_cost(ONE_HEAD, 128, 64).matmul_flops  # the 2.5x rule
    once = io_model.fa2_backward_cost(ONE_HEAD, 64, 128, q_reuse="l2")
    assert cost.hbm_read - once.hbm_read == 7 * 1024 * 136
    spilled = io_model.fa2_backward_cost(ONE_HEAD, 64, 128, dq_accum="hbm")
    assert spilled.hbm_read - cost.hbm_read == spilled.hbm_write - cost.hbm_write == 16 * 8 * 64 * 256
    # inputs q, k, v, o, lse; dO; dq, dk, dv; D, -LSE, the accumulator: O(N), nothing N x N
    assert cost.peak_memory == 4 * 131072 + 4096 + 131072 + 3 * 131072 + 1024 * (8 + 256)
    causal = io_model.fa2_backward_cost(AttentionShape(1, 1, 1024, 1024, 64, causal=True), 64, 128)
    assert causal.matmul_flops == 10 * (1024 * 1025 // 2) * 64
    with pytest.raises(ValueError, match="dq_accum"):
        io_model.fa2_backward_cost(ONE_HEAD, 64, 128, dq_accum="sometimes")


def test_causal_counts():
    """N = 128, causal: query i sees i + 1 keys -> 128 * 129 / 2 = 8256 scores."""
    shape = AttentionShape(1, 1, 128, 128, 64, causal=True)
    assert shape.visible_scores() == 8256
    naive = io_model.naive_cost(shape)
    # GEMMs compute all of S; softmax reads only the visible part of S, writes all of P
    assert naive.matmul_flops == 4 * 128 * 128 * 64
    assert naive.hbm_read == 256 * 128 + 2 * 8256 + 2 * 128 * 128 + 128 * 128
    fa2 = io_model.fa2_cost(shape, block_m=64, block_n=64)
    # block 0 (rows 0-63) reads key block 0; block 1 reads key blocks 0 and 1
    assert fa2.hbm_read == 128 * 128 + 2 * (64 + 128) * 128
    assert fa2.matmul_flops == 4 * 8256 * 64


def test_fa1_query_tiles_that_see_no_key():
    """Causal with Nq > Nk: the first rows see nothing; their tile only writes O and the LSE."""
    shape = AttentionShape(1, 1, 96, 32, 64, causal=True)  # row i sees keys <= i - 64
    cost = io_model.fa1_cost(shape, block_r=32, block_c=32)
    # tiles of rows 0-31 and 32-63 see no key; rows 64-95 see key tile 0 in one step
    assert cost.hbm_read == 32 * 128 + 2 * 32 * 128
    assert cost.hbm_write == 96 * 128 + 96 * 4


def test_split_kv_decode():
    shape = AttentionShape(1, 1, 1, 4096, 128)
    cost = io_model.split_kv_decode_cost(shape, num_splits=4)
    partial = 4 * (4 * 128 + 4)
    assert cost.hbm_read == 4 * 256 + 2 * 4096 * 256 + partial
    assert cost.hbm_write == partial + 256 + 4


def test_paper_theorem_2_crossover():
    """With the constants written out, flash / standard ~ T_c 3 N d / 4 N^2 = 3 d^2 / M: at
    M = 192 KB of 16-bit elements (98304) FA1 moves less than standard attention at d = 128 and
    more at d = 256 (the O() estimate N^2 d^2 / M against N^2 puts the crossing near d = 512)."""
    m = 192 * 1024 // 2
    d128 = io_model.paper_hbm_elements(2048, 128, m)
    d256 = io_model.paper_hbm_elements(2048, 256, m)
    # d = 128: B_c = 192, T_c = 11: 2 N d + 11 (3 N d + 4 N) = 524288 + 11 * 794624
    assert d128["flash"] == 2 * 2048 * 128 + 11 * (3 * 2048 * 128 + 4 * 2048) < d128["standard"]
    assert d256["flash"] > d256["standard"] == 4 * 2048 * 256 + 4 * 2048 * 2048
