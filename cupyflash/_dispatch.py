"""A pure ``plan()``: algorithm, kernel variant, grid, block and shared memory for one call.

Tile tables list candidates per head dim, best first; the first whose shared memory fits the
device is used (A100: 163 KB per block, H100/H200: 227 KB). Register counts come from ptxas
(sm_90a, bf16, causal); every shipped candidate compiles with no local-memory spills
(tests/test_compile.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._specs import Fa2FwdSpec, TileConfig

# head_dim -> candidates, best first.
FA2_FWD_TILES: dict[int, tuple[TileConfig, ...]] = {
    32: (TileConfig(128, 128, 8, q_in_regs=True),),  # 144 regs, 40 KB
    64: (TileConfig(128, 128, 8, q_in_regs=True),),  # 174 regs, 80 KB
    96: (TileConfig(128, 64, 8, q_in_regs=True),),  # 170 regs, 72 KB
    128: (TileConfig(128, 64, 8, q_in_regs=True),),  # 212 regs, 96 KB
    192: (TileConfig(128, 64, 8), TileConfig(64, 64, 4)),  # 215 regs, 144 KB | 177 regs, 120 KB
    256: (TileConfig(128, 64, 8), TileConfig(64, 64, 4)),  # 253 regs, 192 KB | 252 regs, 160 KB
}


@dataclass(frozen=True, slots=True)
class MaskFlags:
    """Which bounds a call needs, after normalisation (see _validate.normalize_window)."""

    causal: bool
    local: bool
    softcap: bool


def fa2_fwd_spec(dtype: str, head_dim: int, flags: MaskFlags, max_smem: int) -> Fa2FwdSpec:
    for tile in FA2_FWD_TILES[head_dim]:
        spec = Fa2FwdSpec(dtype, head_dim, tile, flags.causal, flags.local, flags.softcap)
        if spec.smem_bytes <= max_smem:
            return spec
    raise ValueError(f"no FA2 tile for head_dim={head_dim} fits in {max_smem} bytes of shared memory")


def fa2_fwd_grid(spec: Fa2FwdSpec, batch: int, heads: int, seqlen_q: int) -> tuple[int, int, int]:
    block_m = spec.tile.block_m
    return ((seqlen_q + block_m - 1) // block_m, batch, heads)


def all_fa2_fwd_specs() -> list[Fa2FwdSpec]:
    """Every variant the dispatcher can pick: what warmup and the CI compile test build."""
    specs = []
    for head_dim, tiles in FA2_FWD_TILES.items():
        for tile in tiles:
            for dtype in ("float16", "bfloat16"):
                for causal in (False, True):
                    for local in (False, True):
                        for softcap in (False, True):
                            specs.append(Fa2FwdSpec(dtype, head_dim, tile, causal, local, softcap))
    return specs
