"""A pure ``plan()``: algorithm, kernel variant, grid, block and shared memory for one call.

Tile tables list candidates per head dim, best first; the first whose shared memory fits the
device is used (A100: 163 KB per block, H100/H200: 227 KB). Every shipped candidate compiles
with no local-memory spills (tests/test_compile.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ._specs import (
    CUDA_ELEMENT_TYPES,
    DECODE_HEAD_DIMS,
    FA1_HEAD_DIMS,
    FA2_BWD_HEAD_DIMS,
    FA2_HEAD_DIMS,
    FA3_BWD_HEAD_DIMS,
    FA3_HEAD_DIMS,
    FP8_DECODE_HEAD_DIMS,
    FP8_FWD_HEAD_DIMS,
    HOPPER_ARCH,
    HOPPER_SMEM_PER_BLOCK,
    WGMMA_PREFIX_KEYS,
    BwdRowSpec,
    DecodeAppendSpec,
    DecodeSpec,
    DecodeTile,
    Fa1FwdSpec,
    Fa2BwdDqSpec,
    Fa2BwdSpec,
    Fa2FwdSpec,
    Fa2KvCacheSpec,
    Fa3BwdSpec,
    Fa3FwdSpec,
    Fa3Tile,
    Fp8VtSpec,
    KernelSpec,
    MaskCellsSpec,
    MergeSpec,
    NaiveSoftmaxSpec,
    PackedFillSpec,
    RotaryQSpec,
    TileConfig,
    tile_width,
)

if TYPE_CHECKING:
    from ._device import DeviceInfo

# head_dim -> candidates, best first. TFLOP/s measured on the H200 (bf16, B * N = 16384,
# H * d = 2048; N = 1024 / 4096 / 16384, non-causal then causal; scripts/tune.py fa2,
# docs/evidence.md, tuning-2026-11-29): the 4-warp 32-row tiles fit two CTAs per SM, whose independent barriers
# keep the tensor cores busier than one 8-warp CTA in lock-step.
FA2_FWD_TILES: dict[int, tuple[TileConfig, ...]] = {
    # 189/146 208/192 214/212 vs 128x128 8 warps 152/115 171/155 177/174
    32: (TileConfig(128, 64, 4),),
    # 260/203 289/261 296/285 vs 128x128 8 warps (Q in registers, overlapped) 230/175 259/240 271/273
    64: (TileConfig(128, 64, 4),),
    # 219/171 245/226 253/245; the overlapped loop 2-5% slower
    96: (TileConfig(128, 64, 8, q_in_regs=True),),
    # 277/216 318/285 333/335 vs 128x32 4 warps 2 CTAs/SM 279/204 315/265 325/289
    128: (TileConfig(128, 128, 8, q_in_regs=True),),
    # 234/177 263/229 271/276 vs 128x32 8 warps 206/160 226/203 234/240, 64x64 4 warps 150/126 ..
    192: (TileConfig(128, 64, 8), TileConfig(64, 64, 4)),
    # 276/202 310/257 321/316 vs 64x64 4 warps 196/161 213/199 219/224 (the A100 fallback: 160 KB)
    256: (TileConfig(128, 64, 8), TileConfig(64, 64, 4)),
}

# Softcap adds a tanh per score and its registers: these tiles spilled with it (d = 128's
# 128 x 128: 12-16 B; d = 256's 128 x 64 and 64 x 64: 4-8 B), so softcap runs narrower key blocks.
# Dropout's Philox draws take registers too (d = 128's 128 x 128 spilled 8 B with causal + local):
# it runs the same narrower tiles, and so does ALiBi (its bias per score).
FA2_FWD_SOFTCAP_TILES: dict[int, tuple[TileConfig, ...]] = {
    128: (TileConfig(128, 64, 8, q_in_regs=True),),
    256: (TileConfig(128, 32, 8), TileConfig(64, 32, 4)),
}
# An attn_mask's element loads per score (with their addresses) spilled d = 32's and 64's four-warp
# tiles (two row tiles a warp) by 12-92 B on sm_80: eight warps of one row tile at d <= 64.
# d = 128: 128 x 64 with Q in registers, 1.13-1.24x the 128 x 32 tile with a mask's tiles staged
# (H200, bf16, four mask kinds at N = 1k and 4k; docs/evidence.md,
# 2026-12-02-softcap-alibi-masks); up to 255 registers on sm_80, no spill. d = 192 runs its plain tiles and d = 256 its
# 32-key softcap tiles (0 spills with every flag on both archs; 64-key tiles spilled 24 B).
FA2_FWD_MASK_TILES: dict[int, tuple[TileConfig, ...]] = {
    32: (TileConfig(128, 64, 8),),
    64: (TileConfig(128, 64, 8),),
    128: (TileConfig(128, 64, 8, q_in_regs=True),),
}


#: (softcap, alibi): the score variants (kernels_cu/variants.cuh) warmup compiles for every FA2
#: family. Softcap with ALiBi compiles on first use: all 464 of its variants (forward, over a
#: cache, backward; one element type per arch) built once with no spill, CI builds a sample.
SCORE_VARIANTS = ((False, False), (True, False), (False, True))


@dataclass(frozen=True, slots=True)
class MaskFlags:
    """Which bounds a call needs, after normalisation (see _validate.normalize_window), its
    score variant, and whether it drops out probabilities (FA2 forward and backward only)."""

    causal: bool
    local: bool
    softcap: bool
    dropout: bool = False
    alibi: bool = False
    mask: str = ""  # an attn_mask: "additive" or "bool" (FA2; not with softcap or ALiBi); "mods"


def fa2_fwd_tiles(head_dim: int, narrow: bool) -> tuple[TileConfig, ...]:
    """The forward's tiles, best first; ``narrow``: with softcap, dropout or ALiBi (their registers)."""
    return (narrow and FA2_FWD_SOFTCAP_TILES.get(head_dim)) or FA2_FWD_TILES[head_dim]


def fa2_fwd_mask_tiles(head_dim: int) -> tuple[TileConfig, ...]:
    """The forward's tiles with an attn_mask (the narrow ones, eight warps at d <= 64)."""
    return FA2_FWD_MASK_TILES.get(head_dim) or fa2_fwd_tiles(head_dim, True)


def columns(head_dim: int, widths: tuple[int, ...]) -> tuple[int, int]:
    """(tile width, valid_dim) of a caller's head dim on kernels of tile ``widths``: valid_dim 0
    where the head dim is a width itself."""
    width = tile_width(head_dim, widths)
    return width, (head_dim if head_dim != width else 0)


def fa2_fwd_spec(
    dtype: str, head_dim: int, flags: MaskFlags, max_smem: int, *, over_cache: bool = False, mods_source: str = ""
) -> Fa2FwdSpec:
    """The FA2 variant of a call; ``head_dim`` is the caller's (any up to 256: the next tile
    width's variant with the columns past it zero). ``over_cache``: the variant whose keys come
    through the KV-cache view (``Fa2KvCacheSpec``). ``mods_source``: a user score_mod / mask_mod
    (flags.mask "mods"), on the narrow tiles (a function per score, as the softcap)."""
    width, valid_dim = columns(head_dim, FA2_HEAD_DIMS)
    kind = Fa2KvCacheSpec if over_cache else Fa2FwdSpec
    narrow = flags.softcap or flags.dropout or flags.alibi or flags.mask == "mods"
    tensor_mask = flags.mask in ("additive", "bool")
    for tile in fa2_fwd_mask_tiles(width) if tensor_mask else fa2_fwd_tiles(width, narrow):
        spec = kind(
            dtype, width, tile, flags.causal, flags.local, flags.softcap, flags.dropout, flags.alibi, valid_dim,
            flags.mask, mods_source,
        )  # fmt: skip
        if spec.smem_bytes <= max_smem:
            return spec
    raise ValueError(f"no FA2 tile for head_dim={head_dim} fits in {max_smem} bytes of shared memory")


def all_fa2_fwd_specs() -> list[Fa2FwdSpec]:
    """Every variant the dispatcher can pick: what warmup and the CI compile test build."""
    specs = []
    for head_dim in FA2_FWD_TILES:
        for softcap, alibi in SCORE_VARIANTS:  # the score variants
            for dropout in (False, True):
                for tile in fa2_fwd_tiles(head_dim, softcap or dropout or alibi):
                    for dtype in ("float16", "bfloat16"):
                        for causal in (False, True):
                            for local in (False, True):
                                specs.append(Fa2FwdSpec(dtype, head_dim, tile, causal, local, softcap, dropout, alibi))
    for head_dim in FA2_FWD_TILES:  # an attn_mask, as fa2_fwd_spec picks
        for mask in ("additive", "bool"):
            for dropout in (False, True):
                for dtype in ("float16", "bfloat16"):
                    for causal in (False, True):
                        for local in (False, True):
                            flags = MaskFlags(causal, local, False, dropout, mask=mask)
                            specs.append(fa2_fwd_spec(dtype, head_dim, flags, HOPPER_SMEM_PER_BLOCK))
    return specs


def all_mask_cells_specs(params_type: str) -> list[MaskCellsSpec]:
    """The mask summary's variants in the forward's (``AttnParams``) or the backward's launches."""
    return [MaskCellsSpec(mask_dtype, params_type) for mask_dtype in ("bool", *CUDA_ELEMENT_TYPES)]


def all_packed_fill_specs() -> list[PackedFillSpec]:
    """The packed launches' first step, in each launch's params struct (forward on FA2 or the
    Hopper kernel, backward)."""
    return [PackedFillSpec(params_type) for params_type in ("AttnParams", "Fa3Params", "BwdParams")]


def all_fa2_kvcache_specs(max_smem: int = HOPPER_SMEM_PER_BLOCK) -> list[Fa2FwdSpec]:
    """The FA2-over-a-cache variants ``fa2_fwd_spec(..., over_cache=True)`` picks on a device with
    ``max_smem`` bytes of shared memory per block (no dropout: the cache calls have none)."""
    return [
        fa2_fwd_spec(dtype, head_dim, MaskFlags(causal, local, softcap, alibi=alibi), max_smem, over_cache=True)
        for head_dim in FA2_FWD_TILES
        for softcap, alibi in SCORE_VARIANTS
        for dtype in ("float16", "bfloat16")
        for causal in (False, True)
        for local in (False, True)
    ]


# Hopper forward: (head_dim, bounded) -> tile, bounded = a causal or window bound (uneven tiles)
# or not (uniform tiles: persistent CTAs on a static stride). Uneven tiles run either one CTA per
# tile or, with `dynamic`, persistent CTAs drawing tiles from a global counter (in tile order:
# each (batch, head)'s longest first).
# Measured on the H200 (bf16, the prefill shapes; scripts/tune.py fa3, docs/evidence.md): TFLOP/s
# at N = 1024/4096/16384.
# Two consumers keep S (block_n / 2 fp32 per thread), P and O (d / 2) in the 240 registers each
# consumer thread gets; d = 256's O takes 128, so its key block is 64 and its O is staged in the
# Q tile (shared memory is short).
FA3_FWD_TILES: dict[tuple[int, bool], Fa3Tile] = {
    # 474 at N = 16384 vs 432 with two consumers; causal: ping-pong 214/342/425 vs 198/319/410,
    # three consumers 179/330/425; dynamic ping-pong 264/381/439 vs 233/374/439 one CTA per tile
    # (2026-11-29-dynamic; the persistent CTA overlaps the next tile's loads with this one's end).
    # Causal, three consumers taking turns in round robin on the dynamic schedule: 447 against 418
    # at N = 16384 in a tuning run (candidates in turn), the same ratio to cuDNN as this tile
    # (1.04-1.06x against 1.03-1.05x) with each tree in its own process
    # (docs/evidence/2026-12-07-h100-session-8/). Measured again beside FlashAttention-4
    # (2026-12-07, H100, bf16 N = 16384 causal): this tile 390 TFLOP/s, cuDNN 416, FA4 479; the
    # three consumers 1.035x cuDNN against this tile's 0.925x at 16384 and 0.975x against 0.927x
    # at 4096 in a tuning run (docs/evidence/2026-12-07-h100-session-14/): they take over above
    # the short calls (FA3_SHORT_FWD_TILES keeps this tile at N <= 2048: 0.869x against 0.908x).
    (64, False): Fa3Tile(128, consumers=3, stages=2),
    (64, True): Fa3Tile(128, consumers=3, stages=2, pingpong=True, dynamic=True),
    # ping-pong 437/568/604, causal 328/477/582 vs 425/545/600, 273/448/583 without; 176-key
    # blocks (O in the Q tile) 453/518/608, 304/471/574; causal dynamic 343/486/582 vs 315/489/576
    (128, False): Fa3Tile(128, stages=2, pingpong=True),
    (128, True): Fa3Tile(128, stages=2, pingpong=True, dynamic=True),
    # causal: ping-pong 313/470/596 vs 294/457/598; non-causal without it 477/562/620 vs 442/551/611;
    # causal dynamic 320/485/599 vs 347/487/610 one CTA per tile
    (256, False): Fa3Tile(64, stages=2, separate_o=False),
    (256, True): Fa3Tile(64, stages=2, separate_o=False, pingpong=True),
}


#: Head dims up to this one run on the FA2 kernel at its own narrower tile width instead of the
#: Hopper kernel at the wider one. H200, bf16, N = 4096, TFLOP/s counted at the
#: caller's head dim, FA2 / Hopper (scripts/tune.py head-dims, docs/evidence.md (2026-12-01-head-dims)):
#: d = 32 221 / 216, causal 181 / 193 (a tie: FA2 kept for d <= 32, which run both kernels at
#: the same widths, 32 and 64); d = 96 230 / 460, causal 203 / 376; d = 192 246 / 490, causal
#: 214 / 379 -- so 96 and 192 run at 128 and 256 on Hopper.
FA2_OVER_FA3_MAX_HEAD_DIM = 32

#: Keys up to this many per sequence make a short call, which FA3_SHORT_FWD_TILES may serve.
FA3_SHORT_SEQLEN = 2048
# Short calls where another tile wins: (head_dim, bounded) -> tile. At d = 64 without a bound,
# ping-pong over 4 stages 342/349/357 at N = 1024 against three consumers 309/333/336, but
# 407/415 against 429/428 at N = 4096 and 422/428 against 465/467 at 16384 (2026-11-29 tuning
# runs, bf16 TFLOP/s): with few key blocks per tile, one consumer's softmax hides under the
# other's GEMMs; with many, three consumers' larger tile amortises each K/V load over more rows.
# Its dynamic schedule (tiles drawn from a counter, though all are equal) measured 352-359
# against 328-336 static in three runs: a CTA that falls behind (31 tiles each) draws fewer.
# d = 128 kept its static schedule: dynamic 454/474 against 461-480 (docs/evidence.md,
# 2026-11-29-short-dynamic-probe).
# Three consumers over 4 stages without a bound measured 0.986x cuDNN against this tile's 0.890x
# in one tuning run's rounds (H100, bf16, N = 1024; docs/evidence/2026-12-08-h100-session-19/),
# the first since the three-consumer step got shorter (docs/hopper.md item 13); not yet checked
# in separate processes (scripts/pending_gpu/short64_ab_doc.sh), so not yet the default.
FA3_SHORT_FWD_TILES: dict[tuple[int, bool], Fa3Tile] = {
    (64, False): Fa3Tile(128, stages=4, pingpong=True, dynamic=True),
    (64, True): Fa3Tile(128, stages=4, pingpong=True, dynamic=True),
}
#: Short calls with a score or mask function, kept apart from those without one: the two-consumer
#: ping-pong tile on the dynamic schedule, bounded or not (a mask function makes tiles uneven,
#: which a static stride does not balance; FA3_MODS_FWD_TILES past the short calls).
FA3_MODS_SHORT_FWD_TILES: dict[tuple[int, bool], Fa3Tile] = {
    (64, False): FA3_SHORT_FWD_TILES[(64, True)],
    (64, True): FA3_SHORT_FWD_TILES[(64, True)],
}


#: A user score_mod / mask_mod on the Hopper forward up to d = 128; above it the FA2 kernel takes
#: them (d = 256 spilled 12-16 bytes with a captured 2-D array and a mask).
FA3_MODS_MAX_HEAD_DIM = 128
#: At d = 128 without a bound the dynamic schedule too: a mask function makes the tiles uneven
#: (a document mask's rows see their own document's keys), and the static stride gives CTA c the
#: query blocks c, c + 4, c + 8, ... of each head (132 CTAs, 128 query blocks at N = 16k): a band
#: of half the sequence, so the CTAs whose band lies in the longest document did the most work.
#: H100, bf16, N = 16k, 4 documents: 2.65-2.73 ms static against FlashAttention-4's 1.64-1.79 with
#: the same BlockMask (docs/evidence/2026-12-06-h100-session-7/).
FA3_MODS_FWD_TILES: dict[tuple[int, bool], Fa3Tile] = {
    # d = 64 past the short calls: three consumers in round robin, as without a function. The
    # function's per-score work costs the 160-register consumers local memory in some builds
    # (softcap 24 bytes, a gathered per-key bias 160, a per-pair one 192: outside the loop or
    # not, sm_90a), yet the larger tile won for every function measured, with bit-identical
    # output: ALiBi 1.41x / 1.49x the two-consumer tile at N = 4k / 16k, softcap 1.21x / 1.28x,
    # a relative position 1.30x / 1.29x, a per-key bias 1.14x / 1.24x, a per-pair bias
    # 1.31x / 1.18x, a document mask without its block mask 1.30x / 1.57x (H100, bf16;
    # scripts/pending_gpu/mods_tiles_bench.py); with block masks, beside FlexAttention: ALiBi
    # 0.74-0.77x to 1.02-1.12x its speed, a document mask 0.78-0.81x to 0.91-0.93x at 16k
    # (docs/evidence/2026-12-07-h100-session-15/). Short calls keep two (FA3_MODS_SHORT_FWD_TILES).
    (64, False): FA3_FWD_TILES[(64, True)],
    (64, True): FA3_FWD_TILES[(64, True)],
    (128, False): Fa3Tile(128, stages=2, pingpong=True, dynamic=True),
}


#: The Hopper forward's consumer index broadcast from lane 0 (Fa3FwdSpec.uniform_consumer): its
#: wgmma descriptors in uniform registers, 15-91 fewer instructions in a tile's main loop, no
#: spill. Predicted: 0-2% on the forward (the loop is bound by its wgmmas and exponentials more
#: than by issue). Measured (H100, tune.py hopper-bwd --switch fwd_uniform, d = 64 and 128,
#: N = 1k and 4k): -3% to +3% on the step, the unchanged backward moving as much between the same
#: rounds (docs/evidence/2026-12-07-h100-session-12/). Off.
FA3_FWD_UNIFORM_CONSUMER = False

#: The Hopper forward without a causal or window bound on one CTA per tile (Fa3Tile.single_tile:
#: a grid of every tile, handed out by the hardware as SMs free) instead of persistent CTAs on a
#: static stride, where the tile is not dynamic. The kernel is the same; a CTA's prologue then
#: runs once per tile, and its epilogue under no next tile's loads, against a static stride's
#: tail (an SM whose tiles ran slower finishes last). Predicted -3% to +3% at d = 64 and 128;
#: measured (H100, scripts/ab.py prefill, three rounds, the forward over cuDNN's) d = 64 N = 16k
#: 1.097 against 1.107 off, 4k 0.995 against 1.034, d = 128 16k 0.985 against 0.997
#: (docs/evidence/2026-12-07-h100-session-17/). Off.
FA3_FWD_SINGLE_TILE = False


def fa3_fwd_spec(
    dtype: str,
    head_dim: int,
    flags: MaskFlags,
    seqlen_k: int,
    varlen: bool = False,
    *,
    chosen: bool = False,
    mods_source: str = "",
    batch_invariant: bool = False,
) -> Fa3FwdSpec | None:
    """The Hopper variant for a call (``varlen``: packed sequences, ``seqlen_k`` then the
    longest), or None where it has none: a head dim that is not a multiple of 8 (TMA moves
    16-byte rows), or, unless the caller ``chosen`` this kernel, one that runs faster on FA2
    (``FA2_OVER_FA3_MAX_HEAD_DIM``). ``mods_source``: a user score_mod / mask_mod, on
    FA3_MODS_FWD_TILES up to d = 128 (FA3_MODS_MAX_HEAD_DIM; above it, FA2's).
    ``batch_invariant`` with ``varlen``: the longest sequence is the batch's, so the short-call
    tiles (FA3_SHORT_FWD_TILES, FA3_MODS_SHORT_FWD_TILES) are not chosen by it."""
    if head_dim % 8 or head_dim > FA3_HEAD_DIMS[-1] or (head_dim <= FA2_OVER_FA3_MAX_HEAD_DIM and not chosen):
        return None
    width, valid_dim = columns(head_dim, FA3_HEAD_DIMS)
    key = (width, flags.causal or flags.local)
    if mods_source and width > FA3_MODS_MAX_HEAD_DIM:
        return None
    short = seqlen_k <= FA3_SHORT_SEQLEN and not (varlen and batch_invariant)
    tiles, short_tiles = (
        (FA3_MODS_FWD_TILES, FA3_MODS_SHORT_FWD_TILES) if mods_source else (FA3_FWD_TILES, FA3_SHORT_FWD_TILES)
    )
    tile = (short_tiles.get(key) if short else None) or tiles.get(key) or FA3_FWD_TILES[key]
    if FA3_FWD_SINGLE_TILE and not (flags.causal or flags.local or tile.dynamic):
        tile = replace(tile, single_tile=True)
    return Fa3FwdSpec(
        dtype, width, tile, flags.causal, flags.local, flags.softcap, varlen, valid_dim, mods_source=mods_source,
        alibi=flags.alibi, uniform_consumer=FA3_FWD_UNIFORM_CONSUMER,
    )  # fmt: skip


def all_fa3_fwd_specs() -> list[Fa3FwdSpec]:
    specs = []
    for head_dim in FA3_HEAD_DIMS:
        for dtype in ("float16", "bfloat16"):
            for causal in (False, True):
                for local in (False, True):
                    for softcap, alibi in SCORE_VARIANTS:
                        for seqlen_k in (FA3_SHORT_SEQLEN, FA3_SHORT_SEQLEN + 1):
                            for varlen in (False, True):
                                flags = MaskFlags(causal, local, softcap, alibi=alibi)
                                spec = fa3_fwd_spec(dtype, head_dim, flags, seqlen_k, varlen)
                                assert spec is not None
                                if spec not in specs:
                                    specs.append(spec)
    return specs


# The FP8 forward (e4m3 q, k, v): d = 128's tiles of the 16-bit kernel (ping-pong, two K / V
# stages; dynamic under a bound), a Vt block of 128 keys.
FP8_FWD_TILES: dict[bool, Fa3Tile] = {False: FA3_FWD_TILES[(128, False)], True: FA3_FWD_TILES[(128, True)]}


def fp8_fwd_specs(out_dtype: str, head_dim: int, causal: bool) -> tuple[Fp8VtSpec, Fa3FwdSpec]:
    """The FP8 forward's two kernels: V's transpose, then the Hopper kernel on e4m3 inputs."""
    tile = FP8_FWD_TILES[causal]
    return Fp8VtSpec(head_dim), Fa3FwdSpec(out_dtype, head_dim, tile, causal, fp8=True)


def all_fp8_fwd_specs() -> list[Fp8VtSpec | Fa3FwdSpec]:
    specs: list[Fp8VtSpec | Fa3FwdSpec] = []
    for head_dim in FP8_FWD_HEAD_DIMS:
        specs.append(Fp8VtSpec(head_dim))
        for dtype in ("float16", "bfloat16"):
            specs += [fp8_fwd_specs(dtype, head_dim, causal)[1] for causal in (False, True)]
    return specs


# ---------------------------------------------------------------------------------------------
# FA1: the paper's tiles B_c = ceil(M / 4d), B_r = min(B_c, d) from the on-chip memory M, here
# the device's shared memory per block in elements (H200: 232448 bytes = 116224 16-bit elements),
# rounded down to the MMA layout: B_c to a multiple of 16 keys (m16n8k16 k-steps), B_r to whole
# 16-row warp tiles (at most 16 warps). K_j, V_j and Q_i then take 2 B_c d + B_r d <= 3M/4.
# ---------------------------------------------------------------------------------------------
FA1_MAX_BLOCK_R = 256  # 16 warps


def fa1_tiles(head_dim: int, element_bytes: int, max_smem: int) -> tuple[int, int]:
    """(block_r, block_c) of the FA1 kernel on a device with ``max_smem`` bytes per block."""
    from .xp_impl import fa1_block_sizes

    paper_r, paper_c = fa1_block_sizes(head_dim, max_smem // element_bytes)
    block_c = max(16, paper_c // 16 * 16)
    block_r = max(16, min(paper_r, FA1_MAX_BLOCK_R) // 16 * 16)
    return block_r, block_c


#: Tile sizes B_c of the FA1 tile study at d = 64 (B_r = min(B_c, d)); 448 is the H200 formula.
FA1_STUDY_BLOCK_C = (32, 64, 128, 256, 448, 512, 768)

#: Shared memory per block (opt-in) of the GPUs the compile test covers, by NVRTC target.
FA1_DEVICE_SMEM = {"sm_80": 163 * 1024, HOPPER_ARCH: HOPPER_SMEM_PER_BLOCK}  # A100; H100 / H200


def all_fa1_fwd_specs(max_smem: int = HOPPER_SMEM_PER_BLOCK) -> list[Fa1FwdSpec]:
    """The formula-tile FA1 variants of a device with every mask flag, plus (on the H200) the
    tile study's float16 d = 64 variants: what warmup and the CI compile test build."""
    specs = []
    for head_dim in FA1_HEAD_DIMS:
        block_r, block_c = fa1_tiles(head_dim, 2, max_smem)
        for dtype in ("float16", "bfloat16"):
            for causal in (False, True):
                for local in (False, True):
                    for softcap in (False, True):
                        specs.append(Fa1FwdSpec(dtype, head_dim, block_r, block_c, causal, local, softcap))
    for block_c in FA1_STUDY_BLOCK_C:
        study = Fa1FwdSpec("float16", 64, min(block_c, 64), block_c)
        if study.smem_bytes <= max_smem:
            specs.append(study)
    return list(dict.fromkeys(specs))


def all_naive_softmax_specs() -> list[NaiveSoftmaxSpec]:
    return [
        NaiveSoftmaxSpec(dtype, causal, local, softcap)
        for dtype in ("float16", "bfloat16")
        for causal in (False, True)
        for local in (False, True)
        for softcap in (False, True)
    ]


# ---------------------------------------------------------------------------------------------
# FlashDecoding: the split-KV partial kernel's tiles and the number of splits.
# ---------------------------------------------------------------------------------------------
# head_dim -> tiles by packed rows (query tokens x query heads per KV head), smallest first; the
# first whose block_m holds every row is used, the last one tiles larger groups over m-blocks.
# Each warp streams its own ring of 16-key K/V slices. H200, bf16, d = 128, Hq/Hkv = 32/8, one
# token, us at (B, L) = (1, 128k) (8, 32k) (8, 128k) (64, 4k), scripts/tune.py decode,
# docs/evidence.md (2026-11-29-decode): 8 warps x 2 stages (1 CTA/SM) 176 272 970 274, against
# 4 warps x 3 stages (2 CTAs/SM) 191 301 1008 307, 4 x 2 (3 CTAs/SM) 203 296 977 284, 2 x 3
# (4 CTAs/SM) 213 313 1007 311, 32-key slices 173 285 981 278. d = 64 follows d = 128 (not
# measured apart); d = 256 keeps 4 warps x 3 stages (8 x 2 would need 264 KB).
DECODE_TILES: dict[int, tuple[DecodeTile, ...]] = {
    # 16 rows at d = 64: 2 CTAs per SM, held to 128 registers by the launch bounds (the sinks'
    # epilogue took the plain variant from 126 to 132, past a second CTA; the causal one was at 135).
    64: (DecodeTile(16, 16, 8, 2, min_blocks=2), DecodeTile(32, 16, 8, 2), DecodeTile(64, 16, 4, 3, q_in_regs=False)),
    128: (DecodeTile(16, 16, 8, 2), DecodeTile(32, 16, 8, 2, q_in_regs=False)),
    256: (DecodeTile(16, 16, 4, 3, q_in_regs=False),),
}

#: A one-launch cascade's prefix CTAs run by wgmma (sm_90a, 128 rows a CTA) where a group has at
#: least this many packed rows (requests x query tokens x the GQA group): on an H100 faster than
#: the mma.sync tiles from 64 rows (GQA 32/8: B = 16, 0.86-0.96x their time; B = 64, 0.67-0.74x),
#: at 32 slower over a 4k prefix (1.13x) (docs/evidence/2026-12-07-h100-session-9).
CASCADE_WGMMA_MIN_ROWS = 64

#: Upper bound on KV splits (the combine reads num_splits partials per output row).
DECODE_MAX_SPLITS = 128
#: A split covers at least this many CTA key blocks, so its fixed cost (Q load, merge, partial
#: write) stays small beside its share of the KV stream.
DECODE_MIN_BLOCKS_PER_SPLIT = 4


# A float8 cache's tiles: the 16-bit cache's with twice the stages (its slices are half the
# bytes), but at d = 128 and 16 rows Q is read from shared memory at each step (123 registers, not
# 170) for 2 CTAs per SM: on the H200 (bf16 q, GQA 32/8, e4m3, docs/evidence.md,
# 2026-12-02-fp8-decode) 1.57-1.71x the bf16 cache's speed against 1.43-1.66x at 1 CTA per SM, and
# 1.17x against 0.92x at B = 1, L = 32k; 8 warps x 2 stages measured the same, 4 warps x 3 stages
# (4 CTAs per SM) 1.41-1.67x. At d = 64, 2 CTAs per SM measured 1.13-1.22x against 1.16-1.23x.
FP8_DECODE_TILES: dict[int, tuple[DecodeTile, ...]] = {
    64: tuple(replace(t, stages=2 * t.stages, min_blocks=1) for t in DECODE_TILES[64]),
    128: (
        DecodeTile(16, 16, 8, 3, q_in_regs=False, min_blocks=2),
        replace(DECODE_TILES[128][1], stages=2 * DECODE_TILES[128][1].stages),
    ),
}


def decode_tile(head_dim: int, rows: int, fp8: bool = False) -> DecodeTile:
    """The tile for ``rows`` packed GQA rows (query tokens x query heads per KV head) at tile
    width ``head_dim`` (over a float8 cache: FP8_DECODE_TILES)."""
    tiles = (FP8_DECODE_TILES if fp8 else DECODE_TILES)[head_dim]
    return next((t for t in tiles if t.block_m >= rows), tiles[-1])


def decode_spec(
    dtype: str, head_dim: int, rows: int, causal: bool, local: bool = False, softcap: bool = False, fp8: bool = False,
    batch_invariant: bool = False, tree: bool = False, wide_tree: bool = False,
) -> DecodeSpec:  # fmt: skip
    """The decode variant for the caller's ``head_dim`` (as ``fa2_fwd_spec``: the next tile width);
    ``fp8``: over a float8 cache (head dims FP8_DECODE_HEAD_DIMS); ``batch_invariant``: each
    sequence merges only its own splits of BATCH_INVARIANT_SPLIT_KEYS keys; ``tree``: a tree mask
    among the draft tokens (speculative decoding; not with ``causal`` or ``local``), ``wide_tree``
    its variant for 33 to 64 drafts. The tile depends on the rows (query tokens x the GQA group),
    never on the batch."""
    width, valid_dim = columns(head_dim, DECODE_HEAD_DIMS)
    tile = decode_tile(width, rows, fp8)
    return DecodeSpec(
        dtype, width, tile, causal, valid_dim, local, softcap, fp8, batch_invariant, tree, wide_tree=wide_tree
    )


#: ``batch_invariant=True``'s split size in keys. A sequence of L keys takes ceil(L / 4096)
#: splits, keys [4096 s, 4096 (s + 1)), merged in split order, whatever else is in the batch
#: (the default's split count comes from an occupancy model over the whole batch, so a sequence's
#: rounding changes with its neighbours). A multiple of every decode tile's key block (64 and 128
#: keys, DECODE_TILES and FP8_DECODE_TILES), so a split is whole CTA steps. Why 4096: a split's
#: fixed cost (its Q load, the ring's first slices, the warps' merge, the partial write, the
#: ticket) must stay small beside its share of the KV stream. At d = 128 in bf16 a split streams
#: 2 MB of K and V, ~80 us at an H100 SM's share of HBM (3.35 TB/s / 132), against a few us of
#: fixed cost; 2048 would double that share where the default runs one split per sequence
#: (B = 64, L = 32k). And the grid fills the GPU where the issue's target holds: at B * L >= 256k
#: with 8 KV heads there are >= 512 CTAs (3.9 waves of 132 at one CTA per SM). Shorter batches
#: get fewer CTAs than the default would launch (B = 1, L = 32k: 64 against 128): that is the
#: cost of not splitting by the batch (docs/api.md states it; bench.run_batch_invariant_decode
#: times it).
BATCH_INVARIANT_SPLIT_KEYS = 4096


#: A split count within this fraction of the best wave efficiency is as good: the fewest wins.
DECODE_WAVE_TOLERANCE = 0.05


def decode_num_splits(*, ctas: int, key_blocks: int, num_sms: int, ctas_per_sm: int) -> int:
    """Splits of the KV sequence for ``ctas`` = batch x KV heads x m-blocks CTAs per split.

    As flash-attn's heuristic, the wave efficiency ``n / (ceil(n / slots) * slots)`` of the
    n = ctas * splits CTAs decides (slots = SMs x resident CTAs per SM): the fewest splits
    within DECODE_WAVE_TOLERANCE of the best efficiency over every allowed count. A long cache
    over few sequences therefore fills every SM (B = 1, 8 KV heads: 32 splits, not 1), and a
    large batch that already fills the GPU is not split (no combine kernel at all). A split
    keeps at least DECODE_MIN_BLOCKS_PER_SPLIT key blocks.
    """
    slots = max(1, num_sms * ctas_per_sm)
    most = min(DECODE_MAX_SPLITS, key_blocks // DECODE_MIN_BLOCKS_PER_SPLIT)
    if ctas <= 0 or most <= 1:
        return 1
    efficiency = [ctas * s / (-(-ctas * s // slots) * slots) for s in range(1, most + 1)]
    good_enough = max(efficiency) * (1 - DECODE_WAVE_TOLERANCE)
    return next(s for s, eff in enumerate(efficiency, start=1) if eff >= good_enough)


def split_blocks(key_blocks: int, num_splits: int) -> tuple[int, int]:
    """(blocks_per_split, num_splits) with no empty trailing split: ceil(blocks / splits) each."""
    num_splits = max(1, min(num_splits, max(key_blocks, 1)))
    per_split = max(1, -(-key_blocks // num_splits))
    return per_split, -(-max(key_blocks, 1) // per_split)


def cascade_spec(
    dtype: str, head_dim: int, rows_per_request: int, group_rows: int, causal: bool, softcap: bool = False,
    arch: str = "",
) -> DecodeSpec | None:  # fmt: skip
    """The decode variant of a one-launch cascade (``attention_with_shared_prefix``), or None where
    a request's packed rows (``rows_per_request``: query tokens x the GQA group) do not fit one
    tile of the head dim: the kernel takes a ticket per request and merges whole requests, so a
    request is one m-block, and a prefix CTA holds the rows of block_m // rows_per_request
    requests. Of the tiles that hold a request, the smallest that holds the largest group's rows
    (``group_rows``), else the largest: a prefix's pages are read once per row block, so fewer row
    blocks read less (B = 64, GQA 32/8, d = 128: 8 row blocks of 32 rows against 16 of 16); a
    request's own few keys pay the padded rows' MMAs, which its read hides.
    On Hopper (``arch`` sm_90a), where a group has CASCADE_WGMMA_MIN_ROWS rows or more, the prefix
    CTAs take 128 rows by wgmma (``wgmma_prefix``) and the tile, then the requests' own CTAs alone,
    is the smallest that holds a request among those that allow it (``wgmma_prefix_tile``)."""
    width, valid_dim = columns(head_dim, DECODE_HEAD_DIMS)
    fits = cascade_tiles(head_dim, rows_per_request)
    if not fits:
        return None
    wgmma = [t for t in fits if wgmma_prefix_tile(t)]
    if arch == HOPPER_ARCH and width in (64, 128) and not valid_dim and group_rows >= CASCADE_WGMMA_MIN_ROWS and wgmma:
        return DecodeSpec(dtype, width, wgmma[0], causal, softcap=softcap, cascade=True, wgmma_prefix=True)
    tile = next((t for t in fits if t.block_m >= group_rows), fits[-1])
    return DecodeSpec(dtype, width, tile, causal, valid_dim, softcap=softcap, cascade=True)


def wgmma_prefix_tile(tile: DecodeTile) -> bool:
    """Whether a cascade on ``tile`` can run its prefix by wgmma: 8 warps (two warpgroups) over
    128-key blocks, one CTA an SM (the prefix CTA's shared memory)."""
    return tile.num_warps == 8 and tile.block_n == WGMMA_PREFIX_KEYS and tile.min_blocks == 1


def cascade_tiles(head_dim: int, rows_per_request: int) -> tuple[DecodeTile, ...]:
    """The decode tiles of ``head_dim`` that hold a request's packed rows in one m-block."""
    width, _ = columns(head_dim, DECODE_HEAD_DIMS)
    return tuple(t for t in DECODE_TILES[width] if t.block_m >= rows_per_request)


def cascade_prefix_splits(*, prefix_ctas: int, key_blocks: int, num_sms: int, ctas_per_sm: int, own_splits: int) -> int:
    """Splits of every prefix's keys in a one-launch cascade, for ``prefix_ctas`` = prefix row
    blocks x KV heads CTAs per split: the prefix is the long work, so its CTAs take one wave (as
    many splits as fit in the resident slots) and the requests' short CTAs fill the gaps after.
    A second wave of prefix CTAs costs more than it spreads: on an H100 (GQA 32/8, d = 128, 32k
    prefix) one wave against the two asked for before took 16 splits to 33's 55-56 / 61-62 us at
    B = 1, 69 / 80 at B = 8, 76 / 87 at B = 16, and 8 to 24's 167 / 195 us at B = 64 (wgmma prefix,
    16 CTAs a split); fewer splits than a wave read too slowly (B = 64, 4 splits: 237 us). A split
    keeps at least DECODE_MIN_BLOCKS_PER_SPLIT key blocks, and a request merges at most
    DECODE_MAX_SPLITS parts (its ``own_splits`` and the prefix's)."""
    slots = max(1, num_sms * ctas_per_sm)
    most = min(DECODE_MAX_SPLITS - own_splits, key_blocks // DECODE_MIN_BLOCKS_PER_SPLIT)
    if prefix_ctas <= 0 or most <= 1:
        return 1
    return max(1, min(most, slots // prefix_ctas))


def all_decode_specs() -> list[DecodeSpec | DecodeAppendSpec | MergeSpec]:
    """Every decode variant the dispatcher can pick (what warmup and the CI compile test build),
    and merge_states' kernels at the decode head dims."""
    specs: list[DecodeSpec | DecodeAppendSpec | MergeSpec] = []
    for dtype in CUDA_ELEMENT_TYPES:
        for head_dim in DECODE_HEAD_DIMS:
            for tile in DECODE_TILES[head_dim]:
                for causal in (False, True):
                    specs.append(DecodeSpec(dtype, head_dim, tile, causal))
                specs.append(DecodeSpec(dtype, head_dim, tile, tree=True))
            specs.append(DecodeAppendSpec(dtype, head_dim))
            specs.append(RotaryQSpec(dtype, head_dim))
            specs.append(MergeSpec("float32", dtype, head_dim))
            specs.append(MergeSpec(dtype, dtype, head_dim))
        specs += fp8_decode_specs(dtype)
    # batch_invariant's twin of every partial kernel (its windows and softcap compile on first
    # use, as the default's)
    partial = [s for s in specs if isinstance(s, DecodeSpec)]
    wide = [replace(s, wide_tree=True) for s in partial if s.tree]  # trees of 33 to 64 drafts
    specs += wide
    partial += wide
    specs += [replace(s, batch_invariant=True) for s in partial]
    # the one-launch cascade's twin of every 16-bit cache's variant, causal or not
    cascades = [replace(s, cascade=True) for s in partial if not (s.fp8 or s.tree)]
    # ... and, on Hopper, with its prefix by wgmma where the tile allows it
    wgmma = [
        replace(s, wgmma_prefix=True) for s in cascades
        if s.head_dim in (64, 128) and wgmma_prefix_tile(s.tile)
    ]  # fmt: skip
    return specs + cascades + wgmma


def fp8_decode_specs(dtype: str) -> list[DecodeSpec | DecodeAppendSpec]:
    """The float8-cache variants for queries of ``dtype`` (either format: a run-time field): every
    tile of FP8_DECODE_HEAD_DIMS, causal, not, or with a tree mask, and the quantising append.
    Windows and softcap compile on first use (the CI compile test builds a sample)."""
    specs: list[DecodeSpec | DecodeAppendSpec] = []
    for head_dim in FP8_DECODE_HEAD_DIMS:
        specs += [
            DecodeSpec(dtype, head_dim, t, causal, fp8=True, tree=tree)
            for t in FP8_DECODE_TILES[head_dim]
            for causal, tree in ((False, False), (True, False), (False, True))
        ]
        specs.append(DecodeAppendSpec(dtype, head_dim, fp8=True))
    return specs


# The FA2 backward: head_dim -> (block_m, block_n). 16 keys per warp keep the warp's dK and dV
# rows in registers for the whole loop (2 * 16 * d / 32 floats per thread): the widest query
# block that compiles with no spill for every flag (nvcc 13 / sm_90a: d = 128 at 252-255
# registers with 32 rows; 64 rows spilled 8-72 bytes).
# d = 192, 256: two warps per 16 keys split d (d_split = 2; 64 x 64 spilled 12-16 bytes at 256).
FA2_BWD_TILES: dict[int, tuple[int, int, int]] = {
    32: (64, 128, 1), 64: (64, 128, 1), 96: (32, 128, 1), 128: (32, 128, 1), 192: (64, 64, 2), 256: (32, 64, 2),
}  # fmt: skip
# ALiBi at d = 128: 32 x 128 and 32 x 64 spilled 4-24 bytes on sm_90a (NVRTC 13.0.88) for some
# flags; 64 x 64 with two warps per 16 keys (d split) fits every flag on both archs.
FA2_BWD_ALIBI_TILES: dict[int, tuple[int, int, int]] = {**FA2_BWD_TILES, 128: (64, 64, 2)}
# An attn_mask at d = 96: 32 x 128 spilled 4-8 bytes on sm_80 with dropout; 64 x 64 split in d fits.
FA2_BWD_MASK_TILES: dict[int, tuple[int, int, int]] = {**FA2_BWD_ALIBI_TILES, 96: (64, 64, 2)}


# The deterministic backward's dQ kernel: (block_m, block_n, warps), 16 query rows per warp (32
# keys at d = 256: 64 spilled 24 bytes; with dropout at d = 192 too: 64 spilled 4-8 bytes).
FA2_BWD_DQ_TILES: dict[int, tuple[int, int, int]] = {d: (64, 32 if d == 256 else 64, 4) for d in FA2_BWD_HEAD_DIMS}
FA2_BWD_DQ_DROPOUT_TILES: dict[int, tuple[int, int, int]] = {**FA2_BWD_DQ_TILES, 192: (64, 32, 4)}
# An attn_mask's dQ kernel at d = 128 spilled 64 B on sm_80 with 64-key blocks; at d = 256, 32-key
# blocks spilled 8-24 B with a window (both archs; 32 x 32 on two warps too), 16-key blocks none.
FA2_BWD_DQ_MASK_TILES: dict[int, tuple[int, int, int]] = {
    **FA2_BWD_DQ_DROPOUT_TILES, 128: (64, 32, 4), 256: (64, 16, 4),
}  # fmt: skip


def fa2_bwd_spec(
    dtype: str, head_dim: int, flags: MaskFlags, deterministic: bool = False, mods_source: str = ""
) -> Fa2BwdSpec:
    """The backward's main variant; ``head_dim`` is the caller's (as ``fa2_fwd_spec``).
    ``mods_source``: a user score_mod / mask_mod (flags.mask "mods"), on the mask's tiles."""
    width, valid_dim = columns(head_dim, FA2_BWD_HEAD_DIMS)
    # a score variant holding registers (ALiBi's slope, a mask's pointer and strides): narrower tiles
    tiles = FA2_BWD_MASK_TILES if flags.mask else FA2_BWD_ALIBI_TILES if flags.alibi else FA2_BWD_TILES
    block_m, block_n, d_split = tiles[width]
    return Fa2BwdSpec(
        dtype, width, block_m, block_n, flags.causal, flags.local, flags.softcap, deterministic, d_split,
        flags.dropout, flags.alibi, valid_dim, flags.mask, mods_source,
    )  # fmt: skip


def fa2_bwd_dq_spec(dtype: str, head_dim: int, flags: MaskFlags, mods_source: str = "") -> Fa2BwdDqSpec:
    width, valid_dim = columns(head_dim, FA2_BWD_HEAD_DIMS)
    if flags.mask:
        tile = FA2_BWD_DQ_MASK_TILES[width]
    else:
        tile = (FA2_BWD_DQ_DROPOUT_TILES if flags.dropout or flags.alibi else FA2_BWD_DQ_TILES)[width]
    return Fa2BwdDqSpec(
        dtype, width, *tile, flags.causal, flags.local, flags.softcap, flags.dropout, flags.alibi, valid_dim,
        flags.mask, mods_source,
    )  # fmt: skip


def bwd_row_spec(step: str, dtype: str, head_dim: int) -> BwdRowSpec:
    """The backward's per-row kernel ``step`` ("prep" | "dq") for the caller's ``head_dim``."""
    return BwdRowSpec(step, dtype, *columns(head_dim, FA2_BWD_HEAD_DIMS))


#: The Hopper backward's consumers meet once a step instead of twice (Fa3BwdSpec.decoupled:
#: FlashAttention-3's arrangement), default order only. Off: with the producer's rows in d = 128's
#: 80-row steps (tune.py hopper-bwd --switch decoupled_rows, H100) the backward over cuDNN's went
#: 1.049 -> 1.064 at 4k and 1.097 -> 1.114 at 16k while its own TFLOP/s fell (499 -> 486, 584 ->
#: 581): no gain that holds (docs/evidence/2026-12-07-h100-session-17/). Everywhere: off; under
#: the causal mask at d = 128: FA3_BWD_DECOUPLED_CAUSAL.
FA3_BWD_DECOUPLED = False
#: The decoupled consumers where the causal mask bounds d = 128's 64-row steps (FlashAttention-3's
#: and FA4's causal d = 128 backward keeps two dS buffers: `num_stages_PdS=2`): on. Offline one
#: step 441 -> 419 instructions (scripts/peer_sass.py; FA4's 412), 168 registers, no spill in any
#: variant (padded, packed, window, softcap, ALiBi, score functions). Predicted 2-4%; measured (H100, tune.py hopper-bwd
#: --switch decoupled, the backward over cuDNN's in the same rounds, three bf16 passes) 1k 0.969
#: -> 1.002, 0.996 -> 0.980, 0.939 -> 0.970; 4k 0.949 -> 1.040, 0.982 -> 1.025, 0.991 -> 1.012;
#: 16k 1.013 -> 1.060, 1.020 -> 1.063, 1.027 -> 1.051 (its own TFLOP/s +2-5% at 16k); fp16 1k
#: 0.764 -> 0.953, 4k 0.995 -> 0.994, 16k 1.006 -> 1.063. d = 64's went down (1.107 -> 1.092 at
#: 4k, 1.186 -> 1.144 at 16k): not there. The backward, packed, sinks and score-function suites
#: with it passed (docs/evidence/2026-12-07-h100-session-18/).
FA3_BWD_DECOUPLED_CAUSAL = True
#: The Hopper backward's exponentials after dP^T, with dS^T (Fa3BwdSpec.late_exp): the order
#: before they ran under dP^T (fa3_bwd.cu's Exp_under_dp). Off: the new order passed the backward
#: and score-function GPU suites (342 run, none failed) and racecheck; against the order before it
#: was +9-12% TFLOP/s at d = 64 without a mask, 0-6% causal, and -0.2% to +1.8% over cuDNN at
#: d = 128 (H100, docs/evidence/2026-12-07-h100-session-11). The switch stays for tune.py
#: hopper-bwd's A/B.
FA3_BWD_LATE_EXP = False
#: dK += dS^T Q issued after dQ = dS K, dQ's staging under dK (Fa3BwdSpec.dq_first, d = 128): on.
#: The backward and score-function GPU suites passed with it (351, none failed); beside cuDNN and
#: FA4 it was +0.9% to +3.7% in 10 of 12 (shape, run) pairs, -1.1% and -3.4% in the other two
#: (causal, N = 4k) (H100, docs/evidence/2026-12-07-h100-session-11).
FA3_BWD_DQ_FIRST = True
#: 80 query rows a step at d = 128 where no causal mask or window bounds them (Fa3BwdSpec.rows80,
#: fa3_bwd.cu's Dq_swapped: FlashAttention-3's and FA4's non-causal d = 128 tile, dQ computed as
#: dQ^T = K^T dS^T): on. Predicted 3-8% on the non-causal d = 128 backward; measured (H100,
#: tune.py hopper-bwd --switch rows80, two runs, bf16, the backward over cuDNN's in the same
#: rounds) N = 1k 0.929 -> 0.972 and 0.921 -> 0.963, 4k 0.954 -> 0.972 and 0.947 -> 0.990, 16k
#: 0.938 -> 1.014 and 0.944 -> 1.013 (+2-8%); its GPU tests and the d = 128 backward suite with it
#: on passed (docs/evidence/2026-12-07-h100-session-13).
FA3_BWD_ROWS80 = True
#: A step's -LSE log2 e and D copied by the Hopper backward's producer into the ring with its Q
#: and dO, one copy for both consumers (Fa3BwdSpec.rows_by_producer, fa3_bwd.cu's
#: Rows_by_producer: FA4's producer loads them so), instead of each consumer loading its own a
#: step ahead. Offline (sm_90a): the 80-row step loop's instructions and the variants' registers
#: and spills in docs/hopper.md. On: measured (H100, bf16, tune.py hopper-bwd --switch
#: rows_by_producer, the backward over cuDNN's in the same rounds) d = 128 without a mask 1k
#: 0.922 -> 0.987, 4k 0.978 -> 1.042, 16k 0.999 -> 1.097; causal 0.921 -> 0.920, 0.966 -> 0.985,
#: 0.984 -> 1.013; d = 64 without a mask 1.022 -> 1.047, 1.062 -> 1.082, 1.088 -> 1.142; causal
#: 1.028 -> 1.011, 1.096 -> 1.100, 1.150 -> 1.176; under all three timings at d = 128 4k and 16k
#: without a mask and 4k causal; the backward suites with it on passed, and the score-function,
#: block-mask and reliability suites' backward (55) with score functions too
#: (docs/evidence/2026-12-07-h100-session-17/, 2026-12-07-h100-session-18/).
FA3_BWD_ROWS_BY_PRODUCER = True


def _even_sections(pairs: int, per_pair: int, budget: int) -> int:
    """Pairs a section of a sectioned tile order (tile_scheduler.cuh's section_major): at most
    as many as keep ``per_pair`` bytes each within ``budget``, the sections as even as that
    allows (a short last section's long tiles would start last); 0 (no sections) for one pair."""
    if pairs <= 1:
        return 0
    most = max(1, min(pairs, budget // max(per_pair, 1)))
    sections = -(-pairs // most)
    return -(-pairs // sections)


#: The causal Hopper backward hands out its CTAs in sections of (batch, KV head) pairs, each key
#: block first (tile_scheduler.cuh's fa3_bwd_tile), so that a section's longest CTAs start first;
#: a section's pairs keep their Q and dO (16-bit), dQacc (fp32), -LSE and D rows within
#: FA3_BWD_LPT_L2_BYTES (of the H100's 50 MB of L2). Predicted by a list-scheduling model of the
#: launch (CTAs handed out in order as SMs free up, 3 steps' start-up each; B = 16k / N,
#: H = 2048 / d): the main kernel 2-5% shorter at causal N = 1k-8k. Measured (H100, tune.py
#: hopper-bwd --switch lpt, causal N = 1k-16k): no shape faster beyond the noise, d = 128 at
#: N = 1k and 4k 2-5% slower over cuDNN (docs/evidence/2026-12-07-h100-session-12/). Off.
FA3_BWD_LPT = False
FA3_BWD_LPT_L2_BYTES = 32 << 20


def fa3_bwd_lpt_pairs(spec: Fa3BwdSpec, rows_per_pair: int, group: int, pairs: int) -> int:
    """The (batch, KV head) pairs a section of the causal Hopper backward's CTA order holds
    (BwdParams.lpt_pairs; 0: the launch order): at most as many as keep their per-row data,
    ``group`` query heads of ``rows_per_pair`` rows each, within FA3_BWD_LPT_L2_BYTES, and the
    sections as even as that allows (a short last section's long CTAs would start last). The
    deterministic order has its own (its key blocks last to first)."""
    if not (FA3_BWD_LPT and spec.causal and not spec.deterministic):
        return 0
    per_pair = rows_per_pair * group * (spec.head_dim * (2 + 2 + 4) + 4 + 4)
    return _even_sections(pairs, per_pair, FA3_BWD_LPT_L2_BYTES)


#: The causal Hopper forward's tiles in sections of (batch, head) pairs, each query block first
#: (tile_scheduler.cuh's TileScheduler), so that a section's longest tiles come first; a
#: section's pairs keep their share of K and V within FA3_FWD_LPT_L2_BYTES. Predicted by the
#: list-scheduling model of the backward's sections: the causal forward 3-6% shorter at N =
#: 2k-8k. Measured (H100, tune.py hopper-bwd --switch fwd_lpt, causal N = 2k-8k): the step over
#: cuDNN +0.1% to +3.9% while the unchanged backward moved -0.7% to +1.3%; over FA4 -2.3% to
#: +1.5%: at most about 1% on the forward (docs/evidence/2026-12-07-h100-session-12/). Off.
FA3_FWD_LPT = False
FA3_FWD_LPT_L2_BYTES = 32 << 20


def fa3_fwd_lpt_pairs(causal: bool, keys: int, head_dim: int, group: int, pairs: int) -> int:
    """The (batch, head) pairs a section of the causal Hopper forward's tile order holds
    (Fa3Params.lpt_pairs; 0: each pair's query blocks in turn): at most as many as keep their
    share of K and V (16-bit, ``keys`` rows of ``head_dim``, a KV head's shared by ``group``
    query heads) within FA3_FWD_LPT_L2_BYTES, the sections as even as that allows."""
    if not (FA3_FWD_LPT and causal):
        return 0
    return _even_sections(pairs, -(-keys * head_dim * 2 * 2 // max(group, 1)), FA3_FWD_LPT_L2_BYTES)


def _fa3_bwd_dq_first(head_dim: int, softcap: bool) -> bool:
    """Whether the Hopper backward issues dK after dQ: where FA3_BWD_DQ_FIRST reaches the kernel
    (fa3_bwd.cu's Dq_first: d = 128, the exponentials under dP^T, which softcap's derivative
    keeps out), so that no variant compiles twice under two names."""
    return FA3_BWD_DQ_FIRST and head_dim == 128 and not FA3_BWD_LATE_EXP and not softcap


def _fa3_bwd_decoupled(head_dim: int, causal: bool, deterministic: bool) -> bool:
    """Whether the Hopper backward's consumers meet once a step: where FA3_BWD_DECOUPLED or
    FA3_BWD_DECOUPLED_CAUSAL (causal, d = 128) says so, in the default order of dQ's adds."""
    wanted = FA3_BWD_DECOUPLED or (FA3_BWD_DECOUPLED_CAUSAL and causal and head_dim == 128)
    return wanted and not deterministic


def _with_rows80(spec: Fa3BwdSpec) -> Fa3BwdSpec:
    """``spec`` in 80-row steps where FA3_BWD_ROWS80 is on and its other fields allow them."""
    return replace(spec, rows80=True) if FA3_BWD_ROWS80 and spec.rows80_applies else spec


def fa3_bwd_spec(
    dtype: str, head_dim: int, flags: MaskFlags, deterministic: bool, packed: bool, mods_source: str = ""
) -> Fa3BwdSpec | None:
    """The Hopper backward for a call, or None where it has none (then FA2's runs): head dims
    other than FA3_BWD_HEAD_DIMS, dropout, ALiBi with softcap and an attn_mask. Score functions
    (``mods_source``: their device code; over ``packed`` sequences too, the rows past each
    sequence hidden) compile into it: a BlockMask's summary, where the call has one, bounds its
    query blocks (and spares a mask alone's plain tiles the mask). ``deterministic``: dQ's adds
    into each tile in a fixed order (fa3_bwd.cu)."""
    if head_dim not in FA3_BWD_HEAD_DIMS:
        return None
    if flags.dropout or (flags.alibi and flags.softcap):
        return None
    if flags.mask and not (flags.mask == "mods" and mods_source):
        return None
    # The deterministic order with score functions at d = 128 keeps the exponentials after dP^T
    # (the order before, and so dK before dQ): with them under dP^T its causal variants spilled
    # 4 bytes (tests/test_mods.py's sm_90a builds with CUPYFLASH_COMPILE_ALL=1).
    order_before = deterministic and bool(mods_source) and head_dim == 128
    return _with_rows80(Fa3BwdSpec(
        dtype, head_dim, flags.causal, flags.local, flags.softcap, deterministic, mods_source, alibi=flags.alibi,
        varlen=packed, decoupled=_fa3_bwd_decoupled(head_dim, flags.causal, deterministic),
        late_exp=FA3_BWD_LATE_EXP or order_before,
        dq_first=_fa3_bwd_dq_first(head_dim, flags.softcap) and not order_before,
        rows_by_producer=FA3_BWD_ROWS_BY_PRODUCER,
    ))  # fmt: skip


def all_fa3_bwd_specs() -> list[Fa3BwdSpec]:
    """The Hopper backward's variants warmup compiles: every one but a score function's."""
    return [
        _with_rows80(
            Fa3BwdSpec(
                dtype,
                head_dim,
                causal,
                local,
                softcap,
                deterministic,
                alibi=alibi,
                varlen=varlen,
                decoupled=_fa3_bwd_decoupled(head_dim, causal, deterministic),
                late_exp=FA3_BWD_LATE_EXP,
                dq_first=_fa3_bwd_dq_first(head_dim, softcap),
                rows_by_producer=FA3_BWD_ROWS_BY_PRODUCER,
            )
        )
        for head_dim in FA3_BWD_HEAD_DIMS
        for dtype in CUDA_ELEMENT_TYPES
        for causal in (False, True)
        for local in (False, True)
        for softcap, alibi in SCORE_VARIANTS
        for deterministic in (False, True)
        for varlen in (False, True)
    ]


def all_fa2_bwd_specs() -> list[KernelSpec]:
    """The backward's variants warmup compiles: every one but an attn_mask's and softcap with
    ALiBi (those compile on first use; the CI compile test builds a sample of them)."""
    specs: list[KernelSpec] = []
    for head_dim in FA2_BWD_TILES:
        for dtype in CUDA_ELEMENT_TYPES:
            for causal in (False, True):
                for local in (False, True):
                    for softcap, alibi in SCORE_VARIANTS:
                        for dropout in (False, True):
                            flags = MaskFlags(causal, local, softcap, dropout, alibi)
                            specs.append(fa2_bwd_spec(dtype, head_dim, flags))
                            specs.append(fa2_bwd_spec(dtype, head_dim, flags, deterministic=True))
                            specs.append(fa2_bwd_dq_spec(dtype, head_dim, flags))
            specs += [BwdRowSpec("prep", dtype, head_dim), BwdRowSpec("dq", dtype, head_dim)]
    return specs


def all_kernel_specs(max_smem: int) -> list[KernelSpec]:
    """Every variant the dispatcher can pick, FA1's tiles for a device with ``max_smem`` bytes of
    shared memory per block: what warmup compiles and the CI compile test builds (each for the
    archs in its ``archs``; CI in one element type per arch and a sample of the other)."""
    return [
        *all_fa2_fwd_specs(),
        *all_mask_cells_specs("AttnParams"),
        *all_fa2_kvcache_specs(max_smem),
        *all_fa3_fwd_specs(),
        *all_fp8_fwd_specs(),
        *all_decode_specs(),
        *all_naive_softmax_specs(),
        *all_fa1_fwd_specs(max_smem),
        *all_fa2_bwd_specs(),
        *all_fa3_bwd_specs(),
        *all_packed_fill_specs(),
    ]


# ---------------------------------------------------------------------------------------------
# Occupancy of the decode kernel, which decides how many splits fill the GPU. The plan is pure
# (no compile, no driver query), so registers per thread come from this table: ptxas's count
# for each shipped decode variant and arch with NVRTC 13.0.88 (the H200 machine's, pinned in CI),
# which tests/test_compile.py checks on its build (decode_register_table_specs: the float8-cache
# variants ``_fp8``, FP8_DECODE_TILES; the tree-mask variants of speculative decoding ``_tree``;
# the one-launch cascade's ``_cascade``).
# ---------------------------------------------------------------------------------------------
def decode_register_table_specs() -> list[DecodeSpec]:
    """The decode variants DECODE_REGISTERS lists, for each arch: every tile of both element types
    plain, causal or with a tree mask; the float8 cache's; the one-launch cascade's (plain and
    causal)."""
    plain = [
        DecodeSpec(dtype, d, tile, causal, tree=tree)
        for d, tiles in DECODE_TILES.items()
        for tile in tiles
        for causal, tree in ((False, False), (True, False), (False, True))
        for dtype in ("bfloat16", "float16")
    ]
    fp8 = [s for dtype in ("bfloat16", "float16") for s in fp8_decode_specs(dtype) if isinstance(s, DecodeSpec)]
    cascade = [replace(s, cascade=True) for s in plain if not s.tree]
    wide = [replace(s, wide_tree=True) for s in plain + fp8 if s.tree]
    return plain + fp8 + cascade + wide


DECODE_REGISTERS: dict[tuple[str, str], int] = {
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg"): 193,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_cascade"): 195,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_causal"): 197,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_tree"): 196,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_tree_wide"): 196,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_causal_fp8"): 128,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8"): 128,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8_tree"): 128,
    ("sm_80", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8_tree_wide"): 128,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2"): 238,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2_cascade"): 240,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2_causal"): 246,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2_causal_cascade"): 246,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2_tree"): 241,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s2_tree_wide"): 241,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s4_causal_fp8"): 214,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8"): 212,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8_tree"): 212,
    ("sm_80", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8_tree_wide"): 212,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3"): 242,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3_cascade"): 244,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3_causal"): 243,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3_causal_cascade"): 243,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3_tree"): 242,
    ("sm_80", "cf_decode_bf16_d256_m16_k16_w4_s3_tree_wide"): 242,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_cascade"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_causal"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_causal_cascade"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_tree"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_tree_wide"): 128,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_causal_fp8"): 136,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8"): 134,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8_tree"): 134,
    ("sm_80", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8_tree_wide"): 134,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg"): 192,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_cascade"): 197,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_causal"): 198,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_tree"): 195,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_tree_wide"): 196,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_causal_fp8"): 204,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8"): 196,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8_tree"): 202,
    ("sm_80", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8_tree_wide"): 202,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3"): 253,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3_cascade"): 255,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3_causal"): 255,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3_causal_cascade"): 255,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3_tree"): 255,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s3_tree_wide"): 255,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s6_causal_fp8"): 250,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8"): 248,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8_tree"): 248,
    ("sm_80", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8_tree_wide"): 248,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg"): 193,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_cascade"): 195,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_causal"): 197,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_tree"): 196,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_tree_wide"): 196,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_causal_fp8"): 128,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8"): 126,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8_tree"): 128,
    ("sm_80", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8_tree_wide"): 128,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2"): 238,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2_cascade"): 240,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2_causal"): 246,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2_causal_cascade"): 246,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2_tree"): 241,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s2_tree_wide"): 241,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s4_causal_fp8"): 224,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8"): 210,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8_tree"): 210,
    ("sm_80", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8_tree_wide"): 210,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3"): 242,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3_cascade"): 244,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3_causal"): 243,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3_causal_cascade"): 243,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3_tree"): 242,
    ("sm_80", "cf_decode_fp16_d256_m16_k16_w4_s3_tree_wide"): 242,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_cascade"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_causal"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_causal_cascade"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_tree"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_tree_wide"): 128,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_causal_fp8"): 133,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8"): 131,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8_tree"): 134,
    ("sm_80", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8_tree_wide"): 134,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg"): 192,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_cascade"): 197,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_causal"): 198,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_tree"): 195,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_tree_wide"): 196,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_causal_fp8"): 197,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8"): 190,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8_tree"): 192,
    ("sm_80", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8_tree_wide"): 192,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3"): 253,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3_cascade"): 255,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3_causal"): 255,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3_causal_cascade"): 255,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3_tree"): 255,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s3_tree_wide"): 255,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s6_causal_fp8"): 248,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8"): 246,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8_tree"): 248,
    ("sm_80", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8_tree_wide"): 248,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg"): 192,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_cascade"): 195,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_causal"): 196,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_tree"): 195,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s2_qreg_tree_wide"): 195,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_causal_fp8"): 122,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8"): 122,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8_tree"): 121,
    ("sm_90a", "cf_decode_bf16_d128_m16_k16_w8_s3_b2_fp8_tree_wide"): 121,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2"): 236,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2_cascade"): 240,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2_causal"): 242,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2_causal_cascade"): 244,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2_tree"): 239,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s2_tree_wide"): 239,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s4_causal_fp8"): 220,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8"): 221,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8_tree"): 221,
    ("sm_90a", "cf_decode_bf16_d128_m32_k16_w8_s4_fp8_tree_wide"): 221,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3"): 243,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3_cascade"): 244,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3_causal"): 243,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3_causal_cascade"): 243,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3_tree"): 243,
    ("sm_90a", "cf_decode_bf16_d256_m16_k16_w4_s3_tree_wide"): 243,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2"): 125,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_cascade"): 128,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_causal"): 128,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_causal_cascade"): 126,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_tree"): 127,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s2_qreg_b2_tree_wide"): 126,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_causal_fp8"): 148,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8"): 148,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8_tree"): 146,
    ("sm_90a", "cf_decode_bf16_d64_m16_k16_w8_s4_qreg_fp8_tree_wide"): 148,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg"): 191,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_cascade"): 194,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_causal"): 197,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_causal_cascade"): 203,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_tree"): 194,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s2_qreg_tree_wide"): 194,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_causal_fp8"): 224,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8"): 207,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8_tree"): 218,
    ("sm_90a", "cf_decode_bf16_d64_m32_k16_w8_s4_qreg_fp8_tree_wide"): 216,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3"): 254,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3_cascade"): 255,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3_causal"): 255,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3_causal_cascade"): 255,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3_tree"): 254,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s3_tree_wide"): 254,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s6_causal_fp8"): 254,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8"): 242,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8_tree"): 242,
    ("sm_90a", "cf_decode_bf16_d64_m64_k16_w4_s6_fp8_tree_wide"): 242,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg"): 192,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_cascade"): 195,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_causal"): 196,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_causal_cascade"): 199,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_tree"): 195,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s2_qreg_tree_wide"): 195,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_causal_fp8"): 121,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8"): 120,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8_tree"): 120,
    ("sm_90a", "cf_decode_fp16_d128_m16_k16_w8_s3_b2_fp8_tree_wide"): 120,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2"): 236,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2_cascade"): 240,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2_causal"): 242,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2_causal_cascade"): 244,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2_tree"): 239,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s2_tree_wide"): 239,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s4_causal_fp8"): 220,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8"): 221,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8_tree"): 221,
    ("sm_90a", "cf_decode_fp16_d128_m32_k16_w8_s4_fp8_tree_wide"): 221,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3"): 243,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3_cascade"): 244,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3_causal"): 243,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3_causal_cascade"): 243,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3_tree"): 243,
    ("sm_90a", "cf_decode_fp16_d256_m16_k16_w4_s3_tree_wide"): 243,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2"): 125,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_cascade"): 128,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_causal"): 128,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_causal_cascade"): 126,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_tree"): 127,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s2_qreg_b2_tree_wide"): 126,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_causal_fp8"): 146,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8"): 144,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8_tree"): 144,
    ("sm_90a", "cf_decode_fp16_d64_m16_k16_w8_s4_qreg_fp8_tree_wide"): 144,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg"): 191,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_cascade"): 194,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_causal"): 197,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_causal_cascade"): 203,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_tree"): 194,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s2_qreg_tree_wide"): 194,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_causal_fp8"): 211,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8"): 206,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8_tree"): 207,
    ("sm_90a", "cf_decode_fp16_d64_m32_k16_w8_s4_qreg_fp8_tree_wide"): 207,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3"): 254,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3_cascade"): 255,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3_causal"): 255,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3_causal_cascade"): 255,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3_tree"): 254,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s3_tree_wide"): 254,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s6_causal_fp8"): 242,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8"): 243,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8_tree"): 243,
    ("sm_90a", "cf_decode_fp16_d64_m64_k16_w4_s6_fp8_tree_wide"): 243,
}

_REGISTER_ALLOCATION = 256  # registers are given to a warp in units of 256 (sm_80, sm_90)
_SMEM_RESERVED_PER_CTA = 1024  # bytes the driver keeps per CTA on sm_80 and later


def ctas_per_sm(spec: DecodeSpec, device: DeviceInfo) -> int:
    """Resident CTAs per SM of a decode variant: the smallest of the warp, register and shared
    memory limits, as the CUDA occupancy calculator computes them (a GPU test compares it with
    the driver's cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    warps = -(-spec.num_threads // 32)
    limits = [device.max_blocks_per_sm, device.max_threads_per_sm // 32 // warps]
    # A head dim below the tile width, a window, softcap: the plain full tile's count (the table
    # lists the plain variants; offline compiles of the others gave -15 to +8 registers).
    plain = replace(spec, valid_dim=0, local=False, softcap=False)
    registers = DECODE_REGISTERS.get((device.arch, plain.name))
    if registers is not None:
        per_warp = -(-registers * 32 // _REGISTER_ALLOCATION) * _REGISTER_ALLOCATION
        limits.append(device.regs_per_sm // (per_warp * warps))
    else:  # an arch the table does not list: what __launch_bounds__ guarantees
        limits.append(spec.tile.min_blocks)
    if spec.smem_bytes:
        limits.append(device.smem_per_sm // (spec.smem_bytes + _SMEM_RESERVED_PER_CTA))
    return max(1, min(limits))
