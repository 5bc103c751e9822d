"""FLOPs and HBM bytes of each algorithm, predicted from its loop structure: the counts behind
the FlashAttention papers' IO analysis, with every constant written out, for the kernels here.

Counting rules (all per forward call; ``e`` = bytes per element of q/k/v/o, 2 for float16/bf16):

* A matrix product of (m x k) by (k x n) is ``2 m k n`` FLOPs. Elementwise work counts one FLOP
  per add, multiply, max or exp2 (a fused multiply-add is two).
* HBM bytes count each tensor the first time a kernel reads it and every time it is written:
  what a GPU with no cache reuse *between* kernels or CTAs moves. Where CTAs of one kernel read
  the same data (FA2's K/V, read by every query block of a head) ``kv_reuse="l2"`` counts it
  once, as an L2 that holds a head's K/V makes it; the truth sits between the two.
* Scores a mask hides are skipped where the kernel skips them (the flash kernels skip whole
  blocks; naive's GEMMs compute all of S), so causal costs follow the kernels, tile by tile.

The paper's Theorem 2 in these terms (N = Nq = Nk, one head, elements not bytes):
standard attention reads Q, K, writes S, reads S, writes P, reads P, V, writes O:
``4 N d + 4 N^2``; FlashAttention reads K, V once and, on each of ``T_c = N / B_c = 4 N d / M``
outer steps, reads Q and reads + writes O, l, m: ``2 N d + T_c (3 N d + 4 N)``, i.e.
``Theta(N^2 d^2 / M)`` (see :func:`paper_hbm_elements`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Elementwise FLOPs per visible score in an online softmax: running max (1), the exponent
#: ``s * scale_log2 - m * scale_log2`` as one FMA (2), exp2 (1), running sum (1).
ONLINE_SOFTMAX_FLOPS_PER_SCORE = 5
#: The naive softmax walks each score twice: pass 1 as above (5); pass 2 recomputes
#: exp2 (FMA 2 + exp2 1) and multiplies by 1 / l (1).
NAIVE_SOFTMAX_FLOPS_PER_SCORE = 5 + 4
#: Per row and key block of an online softmax: rescale the d accumulators (d multiplies) and
#: the state (new max 1, exp2 of the difference 1, l * factor + sum 2).
RESCALE_FLOPS_PER_ROW_BLOCK = 4
#: Per row at the end: 1 / l (1), LSE = m * scale + log l (2 + log 1), and d multiplies.
FINALIZE_FLOPS_PER_ROW = 4
#: FA1's running O in HBM is float32 (as FA1's own implementation kept it); m and l float32.
FA1_STATE_BYTES = 4
LSE_BYTES = 4


@dataclass(frozen=True)
class AttentionShape:
    """One multi-head attention call: ``heads`` query heads, each with its own K/V head."""

    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool = False  # bottom-right aligned
    element_bytes: int = 2

    @property
    def pairs(self) -> int:
        """(batch, head) pairs: every count below is per pair, times this."""
        return self.batch * self.heads

    def key_end(self, row: int) -> int:
        """One past the last key query ``row`` sees."""
        if not self.causal:
            return self.seqlen_k
        return min(max(row + self.seqlen_k - self.seqlen_q + 1, 0), self.seqlen_k)

    def visible_scores(self) -> int:
        """Scores that enter the softmax, per (batch, head)."""
        if not self.causal:
            return self.seqlen_q * self.seqlen_k
        return sum(self.key_end(row) for row in range(self.seqlen_q))

    def tensor_bytes(self, rows: int) -> int:
        """Bytes of a [rows, d] slice of q, k, v or o for every (batch, head)."""
        return rows * self.head_dim * self.element_bytes


@dataclass(frozen=True)
class Cost:
    """Predicted work of one call, summed over every (batch, head)."""

    matmul_flops: float
    softmax_flops: float
    hbm_read: float  # bytes
    hbm_write: float  # bytes
    peak_memory: float  # bytes allocated at once on the GPU: inputs, outputs and intermediates

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.softmax_flops

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_read + self.hbm_write


def _io_bytes(s: AttentionShape) -> float:
    """q, k, v, o and the float32 LSE: what every algorithm allocates."""
    rows = 2 * s.seqlen_q + 2 * s.seqlen_k
    return s.pairs * (s.tensor_bytes(rows) + LSE_BYTES * s.seqlen_q)


def naive_cost(s: AttentionShape) -> Cost:
    """S = scale Q K^T (GEMM: reads Q, K; writes S), P = softmax(S) (reads the visible part of
    S once -- its second pass finds the row in L2 -- writes all of P and the LSE), O = P V
    (GEMM: reads P, V; writes O). S and P are [Nq, Nk] in the input type, both allocated."""
    e, nq, nk, d = s.element_bytes, s.seqlen_q, s.seqlen_k, s.head_dim
    visible = s.visible_scores()
    read = s.tensor_bytes(nq + nk) + e * visible + e * nq * nk + s.tensor_bytes(nk)
    write = e * nq * nk + e * nq * nk + LSE_BYTES * nq + s.tensor_bytes(nq)
    return Cost(
        matmul_flops=s.pairs * 4.0 * nq * nk * d,
        softmax_flops=s.pairs * (NAIVE_SOFTMAX_FLOPS_PER_SCORE * visible + FINALIZE_FLOPS_PER_ROW * nq),
        hbm_read=s.pairs * float(read),
        hbm_write=s.pairs * float(write),
        peak_memory=_io_bytes(s) + s.pairs * 2.0 * e * nq * nk,
    )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _row_tiles(s: AttentionShape, block_rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each query tile."""
    return [(r, min(block_rows, s.seqlen_q - r)) for r in range(0, s.seqlen_q, block_rows)]


def _tile_key_end(s: AttentionShape, row0: int, rows: int) -> int:
    """One past the last key any row of the tile sees (the kernels' KeyMask.n_block_end)."""
    return s.key_end(row0 + rows - 1)


def fa1_cost(s: AttentionShape, block_r: int, block_c: int, *, state_bytes: int = FA1_STATE_BYTES) -> Cost:
    """FA1 (kernels_cu/fa1_fwd.cu): K/V tiles of B_c keys outer, Q tiles of B_r rows inner.

    Per (batch, head): each K/V tile some query tile sees is read once. A query tile that sees
    tiles j = 0 .. T-1 reads Q_i on each of its T steps, reads its running (O, m, l) on steps
    1 .. T-1 and writes it on steps 0 .. T-2 (``state_bytes`` per O element, 4 per m and l), and
    on its last step writes O in the input type and the LSE. With N = Nq = Nk, no mask and
    T_c = ceil(N / B_c): ``2 N d e + T_c N d e + 2 (T_c - 1) N (4 d + 8) + N d e + 4 N``.
    At d = 512 the kernel computes S twice (two halves of O's columns per pass).
    """
    d, nk = s.head_dim, s.seqlen_k
    passes = max(1, d // 256)
    block_n = next(n for n in (64, 32, 16) if block_c % n == 0)  # keys per register tile
    read = write = 0.0
    key_tiles_used = 0
    matmul = softmax = 0.0
    for row0, rows in _row_tiles(s, block_r):
        key_end = _tile_key_end(s, row0, rows)
        steps = _ceil_div(key_end, block_c)
        key_tiles_used = max(key_tiles_used, steps)
        visible = sum(s.key_end(r) for r in range(row0, row0 + rows))
        read += steps * s.tensor_bytes(rows)  # Q_i, once per step
        state_row = state_bytes * d + 2 * 4  # O row, m, l
        read += max(steps - 1, 0) * rows * state_row
        write += max(steps - 1, 0) * rows * state_row
        write += s.tensor_bytes(rows) + LSE_BYTES * rows  # O and LSE, once
        matmul += 2.0 * (passes + 1) * visible * d
        chunks = _ceil_div(key_end, block_n)  # online-softmax updates per row
        softmax += ONLINE_SOFTMAX_FLOPS_PER_SCORE * visible
        softmax += rows * (chunks * (d + RESCALE_FLOPS_PER_ROW_BLOCK) + steps * (2 * d + FINALIZE_FLOPS_PER_ROW))
    read += 2 * s.tensor_bytes(min(key_tiles_used * block_c, nk))  # K_j, V_j once each
    state = s.seqlen_q * (state_bytes * d + 2 * 4)
    return Cost(
        matmul_flops=s.pairs * matmul,
        softmax_flops=s.pairs * softmax,
        hbm_read=s.pairs * read,
        hbm_write=s.pairs * write,
        peak_memory=_io_bytes(s) + s.pairs * float(state),
    )


def fa2_cost(s: AttentionShape, block_m: int, block_n: int, *, kv_reuse: str = "per_block") -> Cost:
    """FA2 (kernels_cu/fa2_fwd.cu): one CTA per query block of ``block_m`` rows reads Q once,
    K/V of every key block of ``block_n`` it sees, writes O and the LSE once; O, m, l never
    leave the chip. ``kv_reuse="per_block"``: each query block's K/V reads reach HBM
    (``T_r`` reads of K and V per head, T_r = ceil(Nq / block_m)); ``"l2"``: once per head."""
    if kv_reuse not in ("per_block", "l2"):
        raise ValueError(f"kv_reuse must be 'per_block' or 'l2', got {kv_reuse!r}")
    d, nk = s.head_dim, s.seqlen_k
    read = float(s.tensor_bytes(s.seqlen_q))
    write = float(s.tensor_bytes(s.seqlen_q) + LSE_BYTES * s.seqlen_q)
    kv_rows = 0
    matmul = softmax = 0.0
    for row0, rows in _row_tiles(s, block_m):
        key_end = _tile_key_end(s, row0, rows)
        blocks = _ceil_div(key_end, block_n)
        kv_rows = kv_rows + min(blocks * block_n, nk) if kv_reuse == "per_block" else max(kv_rows, key_end)
        visible = sum(s.key_end(r) for r in range(row0, row0 + rows))
        matmul += 4.0 * visible * d
        softmax += ONLINE_SOFTMAX_FLOPS_PER_SCORE * visible
        softmax += rows * (blocks * (d + RESCALE_FLOPS_PER_ROW_BLOCK) + d + FINALIZE_FLOPS_PER_ROW)
    read += 2 * s.tensor_bytes(kv_rows)
    return Cost(
        matmul_flops=s.pairs * matmul,
        softmax_flops=s.pairs * softmax,
        hbm_read=s.pairs * read,
        hbm_write=s.pairs * write,
        peak_memory=_io_bytes(s),
    )


#: Elementwise FLOPs per visible score of the backward's key-block kernel: P = exp2(s scale_log2 -
#: LSE log2 e) as one FMA and an exp2 (3), dS = P (dP - D) (2).
BACKWARD_FLOPS_PER_SCORE = 5


def fa2_backward_cost(
    s: AttentionShape, block_m: int, block_n: int, *, q_reuse: str = "per_block", dq_accum: str = "l2"
) -> Cost:
    """The backward (kernels_cu/fa2_bwd.cu, and fa3_bwd.cu's key-block kernel on Hopper): prep
    reads O and dO, writes D and -LSE log2 e and zeroes dQ's float32 accumulator; one CTA per key
    block of ``block_n`` reads K_j, V_j once and, for every query block of ``block_m`` rows that
    sees it, Q_i, dO_i, their -LSE and D, recomputes S and P and runs the five products (S, dP,
    dV, dK, dQ: 10 visible d FLOPs per score), adds its dQ tile into the accumulator and writes
    dK_j, dV_j once; the dq step reads the accumulator and writes dQ.

    ``q_reuse="per_block"``: each key block's Q, dO, -LSE, D reads reach HBM; ``"l2"``: once per
    head (as kv_reuse in fa2_cost). ``dq_accum="l2"``: the accumulator's adds stay in L2 (it
    crosses HBM when prep zeroes it and the dq step reads it); ``"hbm"``: every tile's add also
    reads and writes its float32 rows."""
    if q_reuse not in ("per_block", "l2"):
        raise ValueError(f"q_reuse must be 'per_block' or 'l2', got {q_reuse!r}")
    if dq_accum not in ("l2", "hbm"):
        raise ValueError(f"dq_accum must be 'l2' or 'hbm', got {dq_accum!r}")
    e, nq, nk, d = s.element_bytes, s.seqlen_q, s.seqlen_k, s.head_dim
    row_bytes = d * e + 2 * 4  # a row of Q or dO with its -LSE or D
    accum_row = 4 * d
    # prep: O, dO, LSE in; D, -LSE log2 e, the zeroed accumulator out. dq step: accumulator in, dQ out.
    read = float(2 * s.tensor_bytes(nq) + LSE_BYTES * nq + accum_row * nq)
    write = float(2 * 4 * nq + accum_row * nq + s.tensor_bytes(nq))
    read += 2 * s.tensor_bytes(nk)  # K_j, V_j once
    write += 2 * s.tensor_bytes(nk)  # dK_j, dV_j once
    rows_read = 0
    matmul = softmax = 0.0
    for row0, rows in _row_tiles(s, block_m):
        visible = sum(s.key_end(r) for r in range(row0, row0 + rows))
        blocks = _ceil_div(_tile_key_end(s, row0, rows), block_n)  # key blocks that see the tile
        rows_read += rows * (blocks if q_reuse == "per_block" else min(blocks, 1))
        if dq_accum == "hbm":
            read += blocks * rows * accum_row
            write += blocks * rows * accum_row
        matmul += 10.0 * visible * d
        softmax += BACKWARD_FLOPS_PER_SCORE * visible
    read += rows_read * row_bytes  # Q_i and its -LSE, dO_i and its D
    softmax += nq * (2 * d + d)  # prep's rowsum(dO * O), the dq step's scale
    temporaries = nq * (2 * 4 + accum_row)  # D, -LSE log2 e, the accumulator
    outputs = s.tensor_bytes(nq + 2 * nk)  # dq, dk, dv
    return Cost(
        matmul_flops=s.pairs * matmul,
        softmax_flops=s.pairs * softmax,
        hbm_read=s.pairs * read,
        hbm_write=s.pairs * write,
        peak_memory=_io_bytes(s) + s.pairs * float(s.tensor_bytes(nq) + outputs + temporaries),
    )


def split_kv_decode_cost(s: AttentionShape, num_splits: int) -> Cost:
    """FlashDecoding for a short query block: the keys split in ``num_splits`` chunks, each CTA
    reads Q and its chunk of K/V once and writes a float32 partial O and LSE; the combine kernel
    reads the partials and writes O and the LSE. K/V cross HBM exactly once."""
    nq, nk, d = s.seqlen_q, s.seqlen_k, s.head_dim
    visible = s.visible_scores()
    partial = num_splits * nq * (4 * d + LSE_BYTES)
    read = num_splits * s.tensor_bytes(nq) + 2 * s.tensor_bytes(nk) + partial
    write = partial + s.tensor_bytes(nq) + LSE_BYTES * nq
    combine_flops = num_splits * nq * (2 * d + 4)  # weight (exp, max, sum) and weighted O sum
    return Cost(
        matmul_flops=s.pairs * 4.0 * visible * d,
        softmax_flops=s.pairs * (ONLINE_SOFTMAX_FLOPS_PER_SCORE * visible + combine_flops),
        hbm_read=s.pairs * float(read),
        hbm_write=s.pairs * float(write),
        peak_memory=_io_bytes(s) + s.pairs * float(partial),
    )


def paper_hbm_elements(seqlen: int, head_dim: int, sram_elements: int) -> dict[str, float]:
    """The two counts of the FlashAttention paper's Theorem 2 (one head, elements):
    standard ``4 N d + 4 N^2`` and FlashAttention ``2 N d + T_c (3 N d + 4 N)`` with
    ``T_c = ceil(N / B_c)``, ``B_c = ceil(M / 4d)``."""
    n, d = seqlen, head_dim
    block_c = _ceil_div(sram_elements, 4 * d)
    t_c = _ceil_div(n, block_c)
    return {"standard": 4.0 * n * d + 4.0 * n * n, "flash": 2.0 * n * d + t_c * (3.0 * n * d + 4.0 * n)}
