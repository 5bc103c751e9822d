"""Kernel variants: one frozen dataclass per kernel, one field per C++ template argument.

``spec.name`` is the ``extern "C"`` symbol of the variant, its log label and its error label.
The compiled binary is keyed by ``(spec, arch)``; the source does not depend on the arch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Element types the tensor-core kernels take, with their C++ spelling.
CUDA_ELEMENT_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "f32"}

#: Head dimensions with a compiled FA2 variant (multiples of 32: 16-byte swizzle groups).
FA2_HEAD_DIMS = (32, 64, 96, 128, 192, 256)

#: Targets every variant is compiled for in CI: Ampere (sm_80) and Hopper (sm_90a).
CI_ARCHS = ("sm_80", "sm_90a")


@dataclass(frozen=True, slots=True)
class TileConfig:
    """CTA tiling of the FA2 forward: query rows x key rows per block, warps, K/V ring depth."""

    block_m: int
    block_n: int
    num_warps: int
    stages: int = 2
    q_in_regs: bool = False
    overlap: bool = False  # issue Q K_{j+1}^T before the softmax of block j (two K, two V stages)
    min_blocks: int = 1  # CTAs per SM to fit in registers (__launch_bounds__'s second argument)

    def __post_init__(self) -> None:
        rows_per_warp, rem = divmod(self.block_m, self.num_warps)
        if rem or rows_per_warp % 16:
            raise ValueError(f"block_m={self.block_m} must give each of {self.num_warps} warps whole 16-row tiles")
        if self.block_n % 16 or self.stages < 2:
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16 and stages >= 2")
        if self.overlap and self.stages != 2:
            raise ValueError("the overlapped loop runs exactly two K and two V stages")


@dataclass(frozen=True, slots=True)
class Fa2FwdSpec:
    """A variant of ``kernels_cu/fa2_fwd.cu`` (template ``Fa2FwdTraits``)."""

    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    tile: TileConfig
    causal: bool = False  # right bound: key <= row + shift + window_right
    local: bool = False  # left bound: key >= row + shift - window_left
    softcap: bool = False

    kernel = "fa2_fwd"
    source_file = "fa2_fwd.cu"
    params_type = "AttnParams"

    def __post_init__(self) -> None:
        if self.dtype not in CUDA_ELEMENT_TYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(CUDA_ELEMENT_TYPES)}")
        if self.head_dim not in FA2_HEAD_DIMS:
            raise ValueError(f"unsupported head_dim {self.head_dim}; supported: {FA2_HEAD_DIMS}")

    @property
    def name(self) -> str:
        t = self.tile
        flags = "".join(
            f"_{flag}"
            for flag, on in (
                ("qreg", t.q_in_regs),
                ("ovl", t.overlap),
                (f"b{t.min_blocks}", t.min_blocks > 1),
                ("causal", self.causal),
                ("local", self.local),
                ("softcap", self.softcap),
            )
            if on
        )
        return (
            f"cf_fa2_fwd_{_SHORT_DTYPE[self.dtype]}_d{self.head_dim}"
            f"_m{t.block_m}_n{t.block_n}_w{t.num_warps}_s{t.stages}{flags}"
        )

    @property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def smem_bytes(self) -> int:
        t = self.tile
        elements = t.block_m * self.head_dim + 2 * t.stages * t.block_n * self.head_dim
        return 2 * elements

    def template_args(self) -> str:
        t = self.tile
        b = lambda flag: "true" if flag else "false"  # noqa: E731
        return (
            f"Fa2FwdTraits<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, {t.stages}, "
            f"{b(t.q_in_regs)}, {b(t.overlap)}, {CUDA_ELEMENT_TYPES[self.dtype]}, {b(self.causal)}, {b(self.local)}, "
            f"{b(self.softcap)}>"
        )

    @property
    def launch_bounds(self) -> str:
        return f"{self.num_threads}, {self.tile.min_blocks}"

    @property
    def entry_body(self) -> str:
        return "fa2_fwd<Traits>(params);"


#: Head dimensions with a compiled decode variant.
DECODE_HEAD_DIMS = (64, 128, 256)
#: Query tokens per sequence the decode kernel takes (one, or a few for speculative decoding).
DECODE_MAX_QUERIES = 16
#: Element types of merge_states on the GPU (the split-KV partials are float32).
MERGE_ELEMENT_TYPES = {**CUDA_ELEMENT_TYPES, "float32": "float"}


def _check_dtype(dtype: str, supported: dict[str, str]) -> None:
    if dtype not in supported:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(supported)}")


@dataclass(frozen=True, slots=True)
class DecodeTile:
    """CTA shape of the split-KV partial kernel: packed GQA rows (query tokens x query heads of one
    KV head, padded) per CTA, keys a warp takes per step, warps, and the depth of each warp's ring."""

    block_m: int
    warp_keys: int
    num_warps: int
    stages: int
    q_in_regs: bool = True
    min_blocks: int = 1  # CTAs per SM to fit in registers (__launch_bounds__'s second argument)

    def __post_init__(self) -> None:
        if self.block_m % 16 or self.warp_keys % 16 or self.stages < 2:
            raise ValueError(f"{self}: block_m and warp_keys must be multiples of 16, stages >= 2")

    @property
    def block_n(self) -> int:
        """Keys of one CTA step: the unit the KV splits are made of."""
        return self.num_warps * self.warp_keys


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    """A variant of ``decode_partial`` in ``kernels_cu/decode.cu`` (template ``DecodeTraits``)."""

    dtype: str
    head_dim: int
    tile: DecodeTile
    causal: bool = False

    kernel = "decode_partial"
    source_file = "decode.cu"
    params_type = "DecodeParams"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if self.head_dim not in DECODE_HEAD_DIMS:
            raise ValueError(f"unsupported head_dim {self.head_dim}; supported: {DECODE_HEAD_DIMS}")

    @property
    def name(self) -> str:
        t = self.tile
        flags = ("_qreg" if t.q_in_regs else "") + (f"_b{t.min_blocks}" if t.min_blocks > 1 else "")
        flags += "_causal" if self.causal else ""
        return (
            f"cf_decode_{_SHORT_DTYPE[self.dtype]}_d{self.head_dim}"
            f"_m{t.block_m}_k{t.warp_keys}_w{t.num_warps}_s{t.stages}{flags}"
        )

    @property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def smem_bytes(self) -> int:
        t, d = self.tile, self.head_dim
        ring = t.num_warps * 2 * t.stages * t.warp_keys * d * 2
        merge = t.num_warps * t.block_m * (d + 8 + 1) * 4  # the warps' fp32 partials, padded rows
        return t.block_m * d * 2 + max(ring, merge)

    def template_args(self) -> str:
        t = self.tile
        b = lambda flag: "true" if flag else "false"  # noqa: E731
        return (
            f"DecodeTraits<{self.head_dim}, {t.block_m}, {t.warp_keys}, {t.num_warps}, {t.stages}, "
            f"{b(t.q_in_regs)}, {CUDA_ELEMENT_TYPES[self.dtype]}, {b(self.causal)}>"
        )

    @property
    def launch_bounds(self) -> str:
        return f"{self.num_threads}, {self.tile.min_blocks}"

    @property
    def entry_body(self) -> str:
        return "decode_partial<Traits>(params);"


@dataclass(frozen=True, slots=True)
class DecodeAppendSpec:
    """``decode_append``: k_new / v_new into the cache (contiguous or paged)."""

    dtype: str
    head_dim: int

    kernel = "decode_append"
    source_file = "decode.cu"
    params_type = "DecodeParams"
    num_threads = 32
    smem_bytes = 0
    launch_bounds = "32, 1"
    entry_body = "decode_append<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if self.head_dim % 8:
            raise ValueError(f"head_dim {self.head_dim} must be a multiple of 8 (16-byte rows)")

    @property
    def name(self) -> str:
        return f"cf_decode_append_{_SHORT_DTYPE[self.dtype]}_d{self.head_dim}"

    def template_args(self) -> str:
        return f"AppendTraits<{self.head_dim}, {CUDA_ELEMENT_TYPES[self.dtype]}>"


@dataclass(frozen=True, slots=True)
class MergeSpec:
    """``decode_merge``: exact merge of partial (O, LSE) states; split-KV combine and merge_states."""

    part_dtype: str
    out_dtype: str
    head_dim: int

    kernel = "decode_merge"
    source_file = "decode.cu"
    params_type = "MergeParams"
    num_threads = 128
    smem_bytes = 0
    launch_bounds = "128, 1"
    entry_body = "decode_merge<Traits>(params);"
    rows_per_block = 4  # one warp per output row

    def __post_init__(self) -> None:
        _check_dtype(self.part_dtype, MERGE_ELEMENT_TYPES)
        _check_dtype(self.out_dtype, MERGE_ELEMENT_TYPES)
        if self.head_dim % 32 or not 0 < self.head_dim <= 256:
            raise ValueError(f"unsupported head_dim {self.head_dim}; merge takes multiples of 32 up to 256")

    @property
    def name(self) -> str:
        short = _SHORT_DTYPE
        return f"cf_merge_{short[self.part_dtype]}_{short[self.out_dtype]}_d{self.head_dim}"

    def template_args(self) -> str:
        types = MERGE_ELEMENT_TYPES
        return f"MergeTraits<{self.head_dim}, {types[self.part_dtype]}, {types[self.out_dtype]}>"


KernelSpec = Fa2FwdSpec | DecodeSpec | DecodeAppendSpec | MergeSpec
