"""Kernel variants: one frozen dataclass per kernel, one field per C++ template argument.

``spec.name`` is the ``extern "C"`` symbol of the variant, its log label and its error label.
The compiled binary is keyed by ``(spec, arch)``; the source does not depend on the arch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

#: Element types the tensor-core kernels take, with their C++ spelling.
CUDA_ELEMENT_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "f32"}

#: Head dimensions with a compiled FA2 variant (multiples of 32: 16-byte swizzle groups).
FA2_HEAD_DIMS = (32, 64, 96, 128, 192, 256)

#: Targets every variant is compiled for in CI: Ampere (sm_80) and Hopper (sm_90a).
CI_ARCHS = ("sm_80", "sm_90a")

#: Head dimensions of the Hopper (wgmma + TMA) forward: multiples of 64 (128-byte swizzle rows).
FA3_HEAD_DIMS = (64, 128, 256)
HOPPER_ARCH = "sm_90a"
#: An H100's or H200's opt-in shared memory of one CTA (227 KB = 232448 bytes; the two agree):
#: the device the offline builds and the all-variant lists plan for where no GPU is present.
HOPPER_SMEM_PER_BLOCK = 227 * 1024
#: Head dimensions of the FP8 forward (e4m3 q, k, v on the Hopper kernel): whole 128-byte rows of
#: e4m3, in the shared memory two Q buffers, O and two K / V stages take (d = 256 needs 256 KB).
FP8_FWD_HEAD_DIMS = (128,)
#: wgmma N extents with a wrapper in kernels_cu/wgmma.cuh (scripts/gen_wgmma.py SHAPES): the shipped
#: key blocks (64, 128), head dims (64, 128, 256) and the backward's 80-row steps.
WGMMA_N = (64, 80, 128, 256)


def _cxx(value: object) -> str:
    """A template argument as C++ spells it (bools as true / false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flags(*flags: tuple[str, bool]) -> str:
    """The name suffix of the flags that are on, in order: ``_causal_softcap``."""
    return "".join(f"_{flag}" for flag, on in flags if on)


def _mask_flags(causal: bool, local: bool, softcap: bool) -> tuple[tuple[str, bool], ...]:
    return (("causal", causal), ("local", local), ("softcap", softcap))


def _check_dtype(dtype: str, supported: dict[str, str]) -> None:
    if dtype not in supported:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(supported)}")


#: The largest head dim a kernel takes (a head dim below a tile width runs on the next one).
MAX_HEAD_DIM = 256


def tile_width(head_dim: int, widths: tuple[int, ...]) -> int:
    """The tile width a head dim runs at: the smallest of ``widths`` that holds it. The kernels
    zero the columns past the caller's in shared memory and never touch them in global memory
    (``TileColumns`` in kernels_cu/common.cuh)."""
    for width in widths:
        if head_dim <= width:
            return width
    raise ValueError(f"head_dim {head_dim} is above the largest tile width, {widths[-1]}")


def _check_columns(head_dim: int, valid_dim: int, widths: tuple[int, ...], whole_chunks: bool = False) -> None:
    """``head_dim`` is a tile width of ``widths``; ``valid_dim`` (0: all of it) the caller's columns,
    which must need this width (not fit a smaller one), and be 16-byte rows where ``whole_chunks``."""
    if head_dim not in widths:
        raise ValueError(f"unsupported head_dim {head_dim}; supported: {widths}")
    if valid_dim and (valid_dim >= head_dim or tile_width(valid_dim, widths) != head_dim):
        raise ValueError(f"valid_dim {valid_dim} does not run at tile width {head_dim}")
    if valid_dim and whole_chunks and valid_dim % 8:
        raise ValueError(f"valid_dim {valid_dim} is not a multiple of 8 (16-byte rows)")


def _dim_part(head_dim: int, valid_dim: int) -> str:
    """The name part of a tile width and its caller's columns: ``d128``, ``d128v80``."""
    return f"d{head_dim}v{valid_dim}" if valid_dim else f"d{head_dim}"


def _columns_arg(valid_dim: int) -> tuple[int, ...]:
    """The traits' trailing ``kValidDim_`` argument, given only below the tile width (so a full
    tile's instantiation is spelled as before)."""
    return (valid_dim,) if valid_dim else ()


def _check_mods(mask: str, mods_source: str, other_variant: bool) -> None:
    """A backward variant's user score_mod / mask_mod: mask "mods" takes its source, alone."""
    if mask not in MASK_KINDS:
        raise ValueError(f"unknown attn_mask kind {mask!r}; kinds: {sorted(MASK_KINDS)}")
    if (mask == "mods") != bool(mods_source):
        raise ValueError("mask 'mods' takes the score_mod / mask_mod source, and only it does")
    if mods_source and other_variant:
        raise ValueError("score_mod / mask_mod do not combine with dropout, softcap or ALiBi on the GPU yet")


def _columns_and_mask(valid_dim: int, mask: str) -> tuple[int, ...]:
    """The FA2 traits' trailing ``kValidDim_, kBias_``: the mask kind (MASK_KINDS) after the
    caller's columns, spelled out only where a mask is on (so a variant without one is spelled
    as before)."""
    return (valid_dim, MASK_KINDS[mask]) if mask else _columns_arg(valid_dim)


class _KernelSpecBase:
    """What every kernel spec shares: the symbol name from a family prefix, name parts and flag
    suffixes; ``template_args()`` from the traits template and its arguments; the launch bounds;
    the entry body (the kernel's own shared-memory count asserted against ``smem_bytes``, then
    the call). A subclass declares ``traits``, ``prefix`` and ``entry`` and implements
    ``_name_parts``, ``_name_flags`` and ``_traits_args``."""

    __slots__ = ()
    traits: ClassVar[str]  # the C++ traits template, e.g. "Fa2FwdTraits"
    prefix: ClassVar[str]  # the symbol's prefix after "cf_", e.g. "fa2_fwd"
    entry: ClassVar[str]  # the templated body the extern "C" entry calls

    @property
    def num_threads(self) -> int:
        raise NotImplementedError

    @property
    def smem_bytes(self) -> int:
        raise NotImplementedError

    def _name_parts(self) -> tuple[object, ...]:
        raise NotImplementedError

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return ()

    def _traits_args(self) -> tuple[object, ...]:
        raise NotImplementedError

    @property
    def _min_blocks(self) -> int:
        return 1

    @property
    def name(self) -> str:
        parts = "_".join(str(part) for part in (self.prefix, *self._name_parts()))
        return f"cf_{parts}{_flags(*self._name_flags())}"

    def template_args(self) -> str:
        return f"{self.traits}<{', '.join(_cxx(arg) for arg in self._traits_args())}>"

    @property
    def launch_bounds(self) -> str:
        return f"{self.num_threads}, {self._min_blocks}"

    @property
    def entry_body(self) -> str:
        # The launch passes smem_bytes: the kernel's own count must agree.
        return f'static_assert(Traits::kSmemBytes == {self.smem_bytes}, "smem_bytes"); {self.entry}'


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
class Fa2FwdSpec(_KernelSpecBase):
    """A variant of ``kernels_cu/fa2_fwd.cu`` (template ``Fa2FwdTraits``)."""

    dtype: str  # "float16" | "bfloat16"
    head_dim: int
    tile: TileConfig
    causal: bool = False  # right bound: key <= row + shift + window_right
    local: bool = False  # left bound: key >= row + shift - window_left
    softcap: bool = False
    dropout: bool = False  # dropout on P (kernels_cu/dropout.cuh)
    alibi: bool = False  # ALiBi slopes (kernels_cu/variants.cuh; after the softcap)
    valid_dim: int = 0  # the caller's head dim, when below the tile width head_dim (0: the same)
    mask: str = ""  # an attn_mask (kernels_cu/variants.cuh's AttnBias): "", "additive" or "bool"; "mods"
    # With mask "mods": the user score_mod / mask_mod's device code (_mods.kernel_mods), compiled
    # in front of the kernel (_source.render) for variants.cuh's UserMods.
    mods_source: str = ""

    kernel = "fa2_fwd"
    source_file = "fa2_fwd.cu"
    archs = CI_ARCHS
    params_type = "AttnParams"
    param_decl = "const AttnParams params"
    uses_tma = False
    traits = "Fa2FwdTraits"
    prefix = "fa2_fwd"
    entry = "fa2_fwd<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        _check_columns(self.head_dim, self.valid_dim, FA2_HEAD_DIMS)
        if self.mask not in MASK_KINDS:
            raise ValueError(f"unknown attn_mask kind {self.mask!r}; kinds: {sorted(MASK_KINDS)}")
        if self.mask and (self.softcap or self.alibi):
            raise ValueError("an attn_mask does not combine with softcap or ALiBi yet")
        if (self.mask == "mods") != bool(self.mods_source):
            raise ValueError("mask 'mods' takes the score_mod / mask_mod source, and only it does")
        if self.mods_source and self.dropout:
            raise ValueError("score_mod / mask_mod do not combine with dropout on the GPU yet")

    def _name_parts(self) -> tuple[object, ...]:
        t = self.tile
        return (
            _SHORT_DTYPE[self.dtype],
            _dim_part(self.head_dim, self.valid_dim),
            f"m{t.block_m}",
            f"n{t.block_n}",
            f"w{t.num_warps}",
            f"s{t.stages}",
        )

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        t = self.tile
        return (
            ("qreg", t.q_in_regs),
            ("ovl", t.overlap),
            (f"b{t.min_blocks}", t.min_blocks > 1),
            *_mask_flags(self.causal, self.local, self.softcap),
            ("drop", self.dropout),
            ("alibi", self.alibi),
            (f"{self.mask}mask", self.mask in ("additive", "bool")),
            (f"mods{_digest(self.mods_source)}", bool(self.mods_source)),
        )

    @property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def smem_bytes(self) -> int:
        t = self.tile
        elements = t.block_m * self.head_dim + 2 * t.stages * t.block_n * self.head_dim
        # an attn_mask's staged tiles: a row of block_n keys (1-byte bool, else 2) + 16 bytes
        mask_rows = t.block_n * (1 if self.mask == "bool" else 2) + 16 if self.mask in ("additive", "bool") else 0
        return 2 * elements + t.stages * t.block_m * mask_rows

    def _traits_args(self) -> tuple[object, ...]:
        t = self.tile
        return (
            self.head_dim,
            t.block_m,
            t.block_n,
            t.num_warps,
            t.stages,
            t.q_in_regs,
            t.overlap,
            CUDA_ELEMENT_TYPES[self.dtype],
            self.causal,
            self.local,
            self.softcap,
            self.dropout,
            self.alibi,
            *_columns_and_mask(self.valid_dim, self.mask),
        )

    @property
    def _min_blocks(self) -> int:
        return self.tile.min_blocks


#: attn_mask kinds of the FA2 forward -> the traits' kBias_ (kernels_cu/variants.cuh).
MASK_KINDS = {"": 0, "additive": 1, "bool": 2, "mods": 3}


def _digest(source: str) -> str:
    """12 hex digits of a generated source: the part of a variant's name that tells two apart."""
    return hashlib.sha256(source.encode()).hexdigest()[:12] if source else ""


@dataclass(frozen=True, slots=True)
class Fa2KvCacheSpec(Fa2FwdSpec):
    """``fa2_fwd_kvcache`` of ``kernels_cu/fa2_fwd.cu``: the FA2 forward whose keys come through
    the KV-cache view (``kernels_cu/kvcache.cuh``: contiguous entries or pages, every device
    value checked), for many query tokens against a cache and for packed sequences over pages.
    The same traits as ``Fa2FwdSpec``; no dropout."""

    params_type = "DecodeParams"
    param_decl = "const DecodeParams params"
    kernel = "fa2_fwd_kvcache"
    prefix = "fa2_kvcache"
    entry = "fa2_fwd_kvcache<Traits>(params);"

    def __post_init__(self) -> None:
        Fa2FwdSpec.__post_init__(self)
        if self.dropout:
            raise ValueError("the FA2 forward over a KV cache has no dropout variant")


@dataclass(frozen=True, slots=True)
class Fa3Tile:
    """CTA shape of the Hopper forward: key block, consumer warpgroups of 64 query rows each,
    K/V slots of the mbarrier ring, O staged in its own buffer (so the next tile's Q loads during
    the epilogue) or in the Q tile, turns among the consumers for their wgmma issues (ping-pong
    with two, round robin with three), and the dynamic schedule (persistent CTAs drawing tiles
    from a global counter, each head's longest first); ``single_tile``: one CTA per tile where the
    tiles are uniform too (no causal or window bound), which the hardware hands out as SMs free,
    instead of persistent CTAs on a static stride (the kernel is the same; only its grid differs)."""

    block_n: int
    consumers: int = 2
    stages: int = 2
    separate_o: bool = True
    pingpong: bool = False
    dynamic: bool = False
    single_tile: bool = False

    def __post_init__(self) -> None:
        if self.block_n not in WGMMA_N or self.consumers not in (2, 3) or self.stages < 2:
            raise ValueError(
                f"bad Hopper tile: block_n={self.block_n}, consumers={self.consumers}, stages={self.stages}"
            )
        if self.dynamic and self.single_tile:
            raise ValueError("a Hopper tile is either dynamic (persistent CTAs) or single_tile (a CTA each)")


@dataclass(frozen=True, slots=True)
class Fa3FwdSpec(_KernelSpecBase):
    """A variant of ``kernels_cu/fa3_fwd.cu`` (template ``Fa3FwdTraits``): Hopper only.

    One producer warpgroup (TMA) and ``tile.consumers`` warpgroups (wgmma). Persistent (one CTA
    per SM) where the tiles are uniform (no causal / window bound: a static stride) or where the
    tile is dynamic (a global counter hands them out); otherwise one CTA per tile, which the
    hardware hands out longest-first.
    """

    dtype: str
    head_dim: int
    tile: Fa3Tile
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False  # packed sequences (cu_seqlens); a padded batch's variant skips that code
    valid_dim: int = 0  # the caller's head dim (a multiple of 8), when below head_dim
    fp8: bool = False  # q, k, v in e4m3 (V read as Vt, fp8_vt.cu's output); dtype is the output's
    mods_source: str = ""  # a user score_mod / mask_mod's device code (as Fa2FwdSpec's)
    alibi: bool = False  # ALiBi slopes (variants.cuh's Alibi, after the softcap)
    # the consumer index broadcast from lane 0: wgmma descriptors in uniform registers
    # (Fa3FwdTraits::Uniform_consumer; picked while _dispatch.FA3_FWD_UNIFORM_CONSUMER is on)
    uniform_consumer: bool = False

    kernel = "fa3_fwd"
    source_file = "fa3_fwd.cu"
    archs = (HOPPER_ARCH,)
    params_type = "Fa3Params"  # its fields after the three tensor maps
    param_decl = "const __grid_constant__ Fa3Params params"
    uses_tma = True
    traits = "Fa3FwdTraits"
    prefix = "fa3_fwd"
    entry = "fa3_fwd<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        _check_columns(self.head_dim, self.valid_dim, FA3_HEAD_DIMS, whole_chunks=True)
        if self.fp8 and (
            self.head_dim not in FP8_FWD_HEAD_DIMS or self.valid_dim or self.varlen or self.softcap
            or self.tile.block_n != 128 or not self.tile.separate_o
        ):  # fmt: skip
            raise ValueError(f"no FP8 forward variant for {self}: head dims {FP8_FWD_HEAD_DIMS}, 128-key blocks")
        if self.mods_source and (self.fp8 or self.softcap):
            raise ValueError("score_mod / mask_mod do not combine with FP8 inputs or softcap on the Hopper forward")
        if self.alibi and (self.fp8 or self.mods_source):
            raise ValueError("ALiBi does not combine with FP8 inputs or score_mod / mask_mod on the Hopper forward")

    @property
    def persistent(self) -> bool:
        return self.tile.dynamic or not (self.causal or self.local or self.tile.single_tile)

    @property
    def block_n(self) -> int:
        return self.tile.block_n

    @property
    def block_m(self) -> int:
        return 64 * self.tile.consumers

    def _name_parts(self) -> tuple[object, ...]:
        return (
            f"e4m3_{_SHORT_DTYPE[self.dtype]}" if self.fp8 else _SHORT_DTYPE[self.dtype],
            _dim_part(self.head_dim, self.valid_dim),
            f"m{self.block_m}",
            f"n{self.tile.block_n}",
            f"s{self.tile.stages}",
        )

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        t = self.tile
        return (
            ("os", t.separate_o),
            ("pp", t.pingpong),
            ("dyn", t.dynamic),
            *_mask_flags(self.causal, self.local, self.softcap),
            ("alibi", self.alibi),
            ("varlen", self.varlen),
            (f"mods{_digest(self.mods_source)}", bool(self.mods_source)),
            ("uc", self.uniform_consumer),
        )

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.tile.consumers)

    @property
    def smem_bytes(self) -> int:
        # 1024 bytes of alignment slack, Q (double-buffered when O has its own buffer), [O,] the
        # K and V slots, the mbarriers and tile indices (as Fa3FwdTraits::kSmemBytes).
        # Q, K and V take 1 byte an element with FP8 inputs; O always 2.
        t = self.tile
        q_buffers = 2 if t.separate_o else 1
        in_bytes = 1 if self.fp8 else 2
        operands = in_bytes * self.head_dim * (self.block_m * q_buffers + 2 * t.stages * t.block_n)
        o_bytes = 2 * self.head_dim * self.block_m if t.separate_o else 0
        return 1024 + operands + o_bytes + 8 * (2 * q_buffers + 4 * t.stages) + 8

    def _traits_args(self) -> tuple[object, ...]:
        t = self.tile
        element = CUDA_ELEMENT_TYPES[self.dtype]
        return (
            self.head_dim, t.block_n, t.consumers, t.stages, t.separate_o, t.pingpong, t.dynamic, self.varlen,
            f"E4m3Inputs<{element}>" if self.fp8 else element, self.causal, self.local, self.softcap,
            *(
                (self.valid_dim, bool(self.mods_source), self.alibi, True) if self.uniform_consumer
                else (self.valid_dim, False, True) if self.alibi  # (no score function with ALiBi)
                else (self.valid_dim, True) if self.mods_source
                else _columns_arg(self.valid_dim)
            ),
        )  # fmt: skip

    # one CTA per SM (setmaxnreg needs the whole register file): the default _min_blocks of 1


@dataclass(frozen=True, slots=True)
class Fp8VtSpec(_KernelSpecBase):
    """A variant of ``kernels_cu/fp8_vt.cu``: V (e4m3 bytes) transposed, its keys permuted, for the
    FP8 forward (template ``Fp8VtTraits``)."""

    head_dim: int

    kernel = "fp8_vt"
    source_file = "fp8_vt.cu"
    archs = (HOPPER_ARCH,)
    num_threads = 128
    params_type = "AttnParams"
    param_decl = "const AttnParams params"
    uses_tma = False
    traits = "Fp8VtTraits"
    prefix = "fp8_vt"
    entry = "fp8_vt<Traits>(params);"
    keys_per_block = 128  # Vt positions per CTA (Fp8VtTraits::kKeys)

    def __post_init__(self) -> None:
        if self.head_dim not in FP8_FWD_HEAD_DIMS:
            raise ValueError(f"the FP8 forward takes head dims {FP8_FWD_HEAD_DIMS}, got {self.head_dim}")

    @property
    def smem_bytes(self) -> int:
        return self.keys_per_block * self.head_dim

    def _name_parts(self) -> tuple[object, ...]:
        return (f"d{self.head_dim}",)

    def _traits_args(self) -> tuple[object, ...]:
        return (self.head_dim,)


#: Head dimensions with a compiled FA1 variant (512: where the IO model predicts FA1's traffic
#: passes the naive baseline's).
FA1_HEAD_DIMS = (64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class Fa1FwdSpec(_KernelSpecBase):
    """A variant of ``kernels_cu/fa1_fwd.cu`` (template ``Fa1FwdTraits``).

    ``block_r`` / ``block_c`` are the paper's B_r (query rows per Q tile, 16 per warp) and B_c
    (keys per K/V tile); ``block_n`` keys of a K/V tile enter the registers at a time.
    """

    dtype: str
    head_dim: int
    block_r: int
    block_c: int
    causal: bool = False
    local: bool = False
    softcap: bool = False

    kernel = "fa1_fwd"
    source_file = "fa1_fwd.cu"
    archs = CI_ARCHS
    params_type = "AttnParams"
    param_decl = "const AttnParams params, float* o_state, float* max_state, float* sum_state"
    uses_tma = False
    traits = "Fa1FwdTraits"
    prefix = "fa1_fwd"
    entry = "fa1_fwd<Traits>(params, o_state, max_state, sum_state);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if self.head_dim not in FA1_HEAD_DIMS:
            raise ValueError(f"unsupported head_dim {self.head_dim}; supported: {FA1_HEAD_DIMS}")
        if self.block_r % 16 or not 16 <= self.block_r <= 256:
            raise ValueError(f"block_r={self.block_r} must be a multiple of 16 (one warp per 16 rows), 16..256")
        if self.block_c % 16 or self.block_c < 16:
            raise ValueError(f"block_c={self.block_c} must be a positive multiple of 16 (MMA k-steps)")

    @property
    def block_n(self) -> int:
        """Keys per register tile: the widest of 64, 32, 16 that divides B_c."""
        return next(n for n in (64, 32, 16) if self.block_c % n == 0)

    def _name_parts(self) -> tuple[object, ...]:
        return (
            _SHORT_DTYPE[self.dtype],
            f"d{self.head_dim}",
            f"r{self.block_r}",
            f"c{self.block_c}",
            f"n{self.block_n}",
        )

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return _mask_flags(self.causal, self.local, self.softcap)

    @property
    def num_threads(self) -> int:
        return 32 * (self.block_r // 16)

    @property
    def smem_bytes(self) -> int:
        return 2 * (2 * self.block_c + self.block_r) * self.head_dim

    def _traits_args(self) -> tuple[object, ...]:
        return (
            self.head_dim, self.block_r, self.block_c, self.block_n, CUDA_ELEMENT_TYPES[self.dtype],
            self.causal, self.local, self.softcap,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class NaiveSoftmaxSpec(_KernelSpecBase):
    """A variant of ``kernels_cu/naive.cu``: the row softmax between the baseline's two GEMMs."""

    dtype: str
    causal: bool = False
    local: bool = False
    softcap: bool = False

    kernel = "naive_softmax"
    source_file = "naive.cu"
    num_threads = 128  # one CTA per row; 128 x 8 scores per sweep covers a GPT-2 row (1024)
    smem_bytes = 0
    archs = CI_ARCHS
    params_type = "AttnParams"
    param_decl = "const AttnParams params, const Traits::Element* s, Traits::Element* p"
    uses_tma = False
    traits = "NaiveSoftmaxTraits"
    prefix = "naive_softmax"
    entry = "naive_softmax<Traits>(params, s, p);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)

    def _name_parts(self) -> tuple[object, ...]:
        return (_SHORT_DTYPE[self.dtype],)

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return _mask_flags(self.causal, self.local, self.softcap)

    def _traits_args(self) -> tuple[object, ...]:
        return (self.num_threads, CUDA_ELEMENT_TYPES[self.dtype], self.causal, self.local, self.softcap)


#: Head dimensions with a compiled decode variant.
DECODE_HEAD_DIMS = (64, 128, 256)
#: Head dimensions of the decode kernel over a float8 KV cache (whole tiles only: its bytes move
#: in 16-byte chunks of 16 elements, and the widened tile is a 16-bit one of the same width).
FP8_DECODE_HEAD_DIMS = (64, 128)
#: Float8 cache formats -> DecodeParams::kv_fp8 (kernels_cu/fp8.cuh).
FP8_KV_FORMATS = {"e4m3": 1, "e5m2": 2}
#: Query tokens per sequence the decode kernel takes (one, or a few for speculative decoding).
DECODE_MAX_QUERIES = 16
#: Draft tokens a tree mask takes on the split-KV decode kernel: a word of visible drafts per packed
#: row (decode.cu's tree_row_word), 32-bit up to DECODE_TREE_WORD_QUERIES drafts and 64-bit past
#: them (the ``wide_tree`` variants). More query tokens run the FA2 forward over the cache
#: otherwise, which has no tree variant; a tree past 16 drafts stays on the decode kernel, its
#: packed rows tiled over more m-blocks.
DECODE_MAX_TREE_QUERIES = 64
DECODE_TREE_WORD_QUERIES = 32
#: Element types of merge_states on the GPU (the split-KV partials are float32).
MERGE_ELEMENT_TYPES = {**CUDA_ELEMENT_TYPES, "float32": "float"}


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


#: The cascade's prefix CTA on Hopper (DecodeTraits::kPrefixRows, kPrefixKeys): two warpgroups'
#: wgmma rows over 128-key tiles.
WGMMA_PREFIX_ROWS = 128
WGMMA_PREFIX_KEYS = 128


@dataclass(frozen=True, slots=True)
class DecodeSpec(_KernelSpecBase):
    """A variant of ``decode_partial`` in ``kernels_cu/decode.cu`` (template ``DecodeTraits``)."""

    dtype: str
    head_dim: int
    tile: DecodeTile
    causal: bool = False
    valid_dim: int = 0  # the caller's head dim, when below the tile width head_dim
    local: bool = False  # a window's left bound
    softcap: bool = False
    fp8: bool = False  # a float8 cache (the format, e4m3 or e5m2, is a run-time field)
    batch_invariant: bool = False  # each sequence merges only the fixed-size splits of its own keys
    tree: bool = False  # speculative decoding's tree mask among the draft tokens (no causal or window bound)
    cascade: bool = False  # shared-prefix decoding: the prefixes' CTAs and the requests' in one launch
    wide_tree: bool = False  # a tree of 33 to 64 drafts: a 64-bit word of visible drafts per packed row
    # the cascade's prefix CTAs by wgmma (sm_90a): 128 packed rows of whole requests a CTA
    wgmma_prefix: bool = False

    kernel = "decode_partial"
    source_file = "decode.cu"
    params_type = "DecodeParams"
    param_decl = "const DecodeParams params"
    traits = "DecodeTraits"
    prefix = "decode"
    entry = "decode_partial<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        _check_columns(self.head_dim, self.valid_dim, DECODE_HEAD_DIMS)
        if self.fp8 and (self.valid_dim or self.head_dim not in FP8_DECODE_HEAD_DIMS):
            raise ValueError(
                f"a float8 cache takes head_dim {FP8_DECODE_HEAD_DIMS}, not {self.valid_dim or self.head_dim}"
            )
        if self.tree and (self.causal or self.local):
            raise ValueError("a tree mask replaces the causal rule among the drafts: no causal or window bound with it")
        if self.wide_tree and not self.tree:
            raise ValueError("wide_tree is a tree mask's variant (33 to 64 drafts): tree must be set")
        if self.cascade and (self.local or self.fp8 or self.batch_invariant or self.tree):
            raise ValueError("the cascade variant takes a 16-bit cache, causal or not, softcap or not: nothing else")
        if self.wgmma_prefix and not (
            self.cascade and self.tile.num_warps == 8 and self.tile.block_n == WGMMA_PREFIX_KEYS
            and self.head_dim in (64, 128) and not self.valid_dim
        ):  # fmt: skip
            raise ValueError("the wgmma prefix is a cascade's, on 8-warp tiles of 128-key blocks at d = 64 or 128")

    @property
    def archs(self) -> tuple[str, ...]:
        return (HOPPER_ARCH,) if self.wgmma_prefix else CI_ARCHS

    @property
    def uses_tma(self) -> bool:  # (what it stands for here: the variant runs on sm_90a alone)
        return self.wgmma_prefix

    @property
    def prefix_rows(self) -> int:
        """Packed rows of a cascade's prefix CTA (whole requests: the kernel's prefix row block)."""
        return WGMMA_PREFIX_ROWS if self.wgmma_prefix else self.tile.block_m

    def _name_parts(self) -> tuple[object, ...]:
        t = self.tile
        return (
            _SHORT_DTYPE[self.dtype],
            _dim_part(self.head_dim, self.valid_dim),
            f"m{t.block_m}",
            f"k{t.warp_keys}",
            f"w{t.num_warps}",
            f"s{t.stages}",
        )

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        t = self.tile
        return (("qreg", t.q_in_regs), (f"b{t.min_blocks}", t.min_blocks > 1),
                *_mask_flags(self.causal, self.local, self.softcap), ("fp8", self.fp8),
                ("inv", self.batch_invariant), ("tree", self.tree), ("cascade", self.cascade),
                ("wide", self.wide_tree), ("wgp", self.wgmma_prefix))  # fmt: skip

    @property
    def num_threads(self) -> int:
        return 32 * self.tile.num_warps

    @property
    def smem_bytes(self) -> int:
        t, d = self.tile, self.head_dim
        ring = t.num_warps * 2 * t.stages * t.warp_keys * d * (1 if self.fp8 else 2)  # per warp: cached [K, V] slices
        merge = t.num_warps * t.block_m * (d + 8 + 1) * 4  # the warps' fp32 partials, padded rows
        own = t.block_m * d * 2 + max(ring, merge)
        if not self.wgmma_prefix:
            return own
        # DecodeTraits::kSmemPrefixBytes: an atom of alignment slack, Q's rows, and the [K, V]
        # tiles of each of kPrefixStages stages (3 at d = 64, 2 at d = 128)
        stages = 3 if d <= 64 else 2
        return max(own, 1024 + WGMMA_PREFIX_ROWS * d * 2 + stages * 2 * WGMMA_PREFIX_KEYS * d * 2)

    def _traits_args(self) -> tuple[object, ...]:
        t = self.tile
        # The trailing kValidDim_, Kv_fp8_, Batch_invariant_, Is_tree_, Is_cascade_, Wide_tree_
        # spelled out only as far as needed (a variant without them is spelled as before).
        tail: tuple[object, ...] = (
            (self.valid_dim, self.fp8, self.batch_invariant, False, True, False, True) if self.wgmma_prefix
            else (self.valid_dim, self.fp8, self.batch_invariant, True, False, True) if self.wide_tree
            else (self.valid_dim, self.fp8, self.batch_invariant, self.tree, True) if self.cascade
            else (self.valid_dim, self.fp8, self.batch_invariant, True) if self.tree
            else (self.valid_dim, self.fp8, True) if self.batch_invariant
            else (self.valid_dim, True) if self.fp8 else _columns_arg(self.valid_dim)
        )  # fmt: skip
        return (
            self.head_dim, t.block_m, t.warp_keys, t.num_warps, t.stages, t.q_in_regs,
            CUDA_ELEMENT_TYPES[self.dtype], self.causal, self.local, self.softcap, *tail,
        )  # fmt: skip

    @property
    def _min_blocks(self) -> int:
        return self.tile.min_blocks


@dataclass(frozen=True, slots=True)
class DecodeAppendSpec(_KernelSpecBase):
    """``decode_append``: k_new / v_new into the cache (contiguous or paged); ``head_dim`` is
    the caller's (rows of a multiple of 8 elements move in 16-byte chunks, others element by
    element); ``fp8``: quantised into a float8 cache (the format is a run-time field)."""

    dtype: str
    head_dim: int
    fp8: bool = False

    kernel = "decode_append"
    source_file = "decode.cu"
    params_type = "DecodeParams"
    param_decl = "const DecodeParams params"
    archs = CI_ARCHS
    uses_tma = False
    num_threads = 32
    smem_bytes = 0
    traits = "AppendTraits"
    prefix = "decode_append"
    entry = "decode_append<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if not 1 <= self.head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim {self.head_dim} is not in 1 .. {MAX_HEAD_DIM}")
        if self.fp8 and (self.kernel != "decode_append" or self.head_dim % 8):
            raise ValueError(f"{type(self).__name__}: a float8 cache is appended to in whole 8-element chunks")

    def _name_parts(self) -> tuple[object, ...]:
        return (_SHORT_DTYPE[self.dtype], f"d{self.head_dim}")

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return (("fp8", self.fp8),)

    def _traits_args(self) -> tuple[object, ...]:
        return (self.head_dim, CUDA_ELEMENT_TYPES[self.dtype], *((True,) if self.fp8 else ()))


@dataclass(frozen=True, slots=True)
class RotaryQSpec(DecodeAppendSpec):
    """``decode_rotary_q``: the queries of a cache call rotated (rotary embedding) into the
    temporary the attention reads; one warp per row, as the append (which rotates k_new)."""

    kernel = "decode_rotary_q"
    prefix = "decode_rotary_q"
    entry = "decode_rotary_q<Traits>(params);"


@dataclass(frozen=True, slots=True)
class MergeSpec(_KernelSpecBase):
    """``decode_merge``: exact merge of partial (O, LSE) states; split-KV combine and merge_states."""

    part_dtype: str
    out_dtype: str
    head_dim: int

    kernel = "decode_merge"
    source_file = "decode.cu"
    params_type = "MergeParams"
    param_decl = "const MergeParams params"
    archs = CI_ARCHS
    uses_tma = False
    num_threads = 128
    smem_bytes = 0
    rows_per_block = 4  # one warp per output row
    traits = "MergeTraits"
    prefix = "merge"
    entry = "decode_merge<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.part_dtype, MERGE_ELEMENT_TYPES)
        _check_dtype(self.out_dtype, MERGE_ELEMENT_TYPES)
        if self.head_dim % 32 or not 0 < self.head_dim <= 256:
            raise ValueError(f"unsupported head_dim {self.head_dim}; merge takes multiples of 32 up to 256")

    def _name_parts(self) -> tuple[object, ...]:
        return (_SHORT_DTYPE[self.part_dtype], _SHORT_DTYPE[self.out_dtype], f"d{self.head_dim}")

    def _traits_args(self) -> tuple[object, ...]:
        return (self.head_dim, MERGE_ELEMENT_TYPES[self.part_dtype], MERGE_ELEMENT_TYPES[self.out_dtype])


#: Head dimensions with a compiled FA2 backward: the forward's (192 and 256 split d over two
#: warps per 16 keys, ``Fa2BwdSpec.d_split``).
FA2_BWD_HEAD_DIMS = FA2_HEAD_DIMS


@dataclass(frozen=True, slots=True)
class Fa2BwdSpec(_KernelSpecBase):
    """A variant of ``fa2_bwd`` in ``kernels_cu/fa2_bwd.cu`` (template ``Fa2BwdTraits``): one CTA
    per block of ``block_n`` keys (16 per warp), query blocks of ``block_m`` rows."""

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    deterministic: bool = False  # no dQ here (no atomics): Fa2BwdDqSpec's kernel computes it
    d_split: int = 1  # warps sharing 16 keys, each with 1 / d_split of d's dK, dV columns
    dropout: bool = False  # the forward's dropout mask regenerated (kernels_cu/dropout.cuh)
    alibi: bool = False
    valid_dim: int = 0  # the caller's head dim, when below the tile width head_dim
    mask: str = ""  # the forward's attn_mask: "", "additive" or "bool" (MASK_KINDS); "mods"
    mods_source: str = ""  # with mask "mods": the score_mod / mask_mod's device code (as Fa2FwdSpec's)

    kernel = "fa2_bwd"
    source_file = "fa2_bwd.cu"
    archs = CI_ARCHS
    params_type = "BwdParams"
    param_decl = "const BwdParams params"
    uses_tma = False
    traits = "Fa2BwdTraits"
    prefix = "fa2_bwd"
    entry = "fa2_bwd<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        _check_columns(self.head_dim, self.valid_dim, FA2_BWD_HEAD_DIMS)
        if self.block_m % 32 or self.block_n % 16 or self.d_split not in (1, 2):
            raise ValueError(
                f"bad backward tile: block_m={self.block_m}, block_n={self.block_n}, d_split={self.d_split}"
            )
        if self.num_threads < 2 * self.block_m:  # a thread per LSE row and per D row
            raise ValueError(f"bad backward tile: {self.num_threads} threads for {self.block_m} query rows")
        _check_mods(self.mask, self.mods_source, self.dropout or self.softcap or self.alibi)

    def _name_parts(self) -> tuple[object, ...]:
        dims = _dim_part(self.head_dim, self.valid_dim)
        return (_SHORT_DTYPE[self.dtype], dims, f"m{self.block_m}", f"n{self.block_n}")

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return (
            (f"split{self.d_split}", self.d_split > 1), *_mask_flags(self.causal, self.local, self.softcap),
            ("drop", self.dropout), ("alibi", self.alibi), (f"{self.mask}mask", self.mask in ("additive", "bool")),
            (f"mods{_digest(self.mods_source)}", bool(self.mods_source)), ("det", self.deterministic),
        )  # fmt: skip

    @property
    def num_threads(self) -> int:
        return 2 * self.block_n * self.d_split  # d_split warps per 16 keys

    @property
    def smem_bytes(self) -> int:
        # K, V; Q and dO double-buffered; dS^T (and P^T when split); -LSE log2 e and D
        # double-buffered (fp32).
        d, m, n = self.head_dim, self.block_m, self.block_n
        return 2 * (2 * n * d + 4 * m * d + (2 if self.d_split > 1 else 1) * n * m) + 16 * m

    def _traits_args(self) -> tuple[object, ...]:
        return (
            self.head_dim, self.block_m, self.block_n, CUDA_ELEMENT_TYPES[self.dtype], self.causal, self.local,
            self.softcap, not self.deterministic, self.d_split, self.dropout, self.alibi,
            *_columns_and_mask(self.valid_dim, self.mask),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fa2BwdDqSpec(_KernelSpecBase):
    """``fa2_bwd_dq_blocks`` in ``kernels_cu/fa2_bwd.cu`` (template ``Fa2BwdDqTraits``): the
    deterministic backward's dQ, one CTA per ``block_m`` query rows over ``block_n``-key blocks."""

    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    dropout: bool = False
    alibi: bool = False
    valid_dim: int = 0
    mask: str = ""
    mods_source: str = ""

    kernel = "fa2_bwd_dq_blocks"
    source_file = "fa2_bwd.cu"
    archs = CI_ARCHS
    params_type = "BwdParams"
    param_decl = "const BwdParams params"
    uses_tma = False
    traits = "Fa2BwdDqTraits"
    prefix = "fa2_bwd_dqb"
    entry = "fa2_bwd_dq_blocks<Traits>(params);"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        _check_columns(self.head_dim, self.valid_dim, FA2_BWD_HEAD_DIMS)
        rows_per_warp, rem = divmod(self.block_m, self.num_warps)
        if rem or rows_per_warp % 16 or self.block_n % 16:
            raise ValueError(f"bad dQ tile: block_m={self.block_m}, block_n={self.block_n}, warps={self.num_warps}")
        _check_mods(self.mask, self.mods_source, self.dropout or self.softcap or self.alibi)

    def _name_parts(self) -> tuple[object, ...]:
        return (
            _SHORT_DTYPE[self.dtype], _dim_part(self.head_dim, self.valid_dim), f"m{self.block_m}",
            f"n{self.block_n}", f"w{self.num_warps}",
        )  # fmt: skip

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return (
            *_mask_flags(self.causal, self.local, self.softcap), ("drop", self.dropout), ("alibi", self.alibi),
            (f"{self.mask}mask", self.mask in ("additive", "bool")),
            (f"mods{_digest(self.mods_source)}", bool(self.mods_source)),
        )  # fmt: skip

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        return 2 * (2 * self.block_m + 4 * self.block_n) * self.head_dim  # Q, dO; K and V double-buffered

    def _traits_args(self) -> tuple[object, ...]:
        return (
            self.head_dim, self.block_m, self.block_n, self.num_warps, CUDA_ELEMENT_TYPES[self.dtype], self.causal,
            self.local, self.softcap, self.dropout, self.alibi, *_columns_and_mask(self.valid_dim, self.mask),
        )  # fmt: skip


#: Head dims of the Hopper backward (kernels_cu/fa3_bwd.cu); the others run on FA2's.
FA3_BWD_HEAD_DIMS = (64, 128)


@dataclass(frozen=True, slots=True)
class Fa3BwdSpec(_KernelSpecBase):
    """A variant of ``fa3_bwd`` in ``kernels_cu/fa3_bwd.cu`` (template ``Fa3BwdTraits``): Hopper
    only. One CTA per block of 128 keys of a padded batch, or of a packed sequence (``varlen``):
    a producer warpgroup (TMA) and two consumers (wgmma), ``block_m`` query rows per step; dQ
    into the tiled accumulator (``kernels_cu/dq_tiles.cuh``) that the FA2 backward's per-row dq
    step converts."""

    dtype: str
    head_dim: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    deterministic: bool = False  # dQ's adds in a fixed order per tile (a writer warp, semaphores)
    mods_source: str = ""  # a user score_mod / mask_mod's device code (fa3_bwd.cu)
    alibi: bool = False  # ALiBi slopes (not with softcap or score functions)
    varlen: bool = False  # packed sequences (cu_seqlens); a padded batch's variant skips that code
    # the consumers meet once a step, not twice (dS^T in two buffers, dQ's parts handed to the
    # writer warp per consumer; fa3_bwd.cu's Decoupled); the default order only
    decoupled: bool = False
    # P^T formed after dP^T, with dS^T (fa3_bwd.cu's Late_exp_: the order before the exponentials
    # moved under dP^T; tune.py hopper-bwd times the two)
    late_exp: bool = False
    # dK += dS^T Q after dQ = dS K, dQ staged under dK (fa3_bwd.cu's Dq_first; d = 128, not with
    # late_exp)
    dq_first: bool = False
    # 80 query rows a step, dQ computed swapped (fa3_bwd.cu's Dq_swapped): d = 128 without a
    # causal mask, window, softcap, ALiBi, score functions, packed sequences or the fixed order
    rows80: bool = False
    # a step's -LSE log2 e and D copied by the producer with its Q and dO, one copy for both
    # consumers (fa3_bwd.cu's Rows_by_producer), instead of each consumer loading its own
    rows_by_producer: bool = False

    kernel = "fa3_bwd"
    source_file = "fa3_bwd.cu"
    archs = (HOPPER_ARCH,)
    params_type = "Fa3BwdParams"  # BwdParams' fields after the four tensor maps
    param_decl = "const __grid_constant__ Fa3BwdParams params"
    uses_tma = True
    traits = "Fa3BwdTraits"
    prefix = "fa3_bwd"
    entry = "fa3_bwd<Traits>(params);"
    block_n = 128
    num_threads = 384  # a producer and two consumer warpgroups

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if self.head_dim not in FA3_BWD_HEAD_DIMS:
            raise ValueError(f"the Hopper backward takes head_dim in {FA3_BWD_HEAD_DIMS}, got {self.head_dim}")
        if self.mods_source and self.softcap:
            raise ValueError("score_mod / mask_mod do not combine with softcap on the Hopper backward")
        if self.alibi and (self.softcap or self.mods_source):
            raise ValueError("ALiBi does not combine with softcap or score_mod / mask_mod on the Hopper backward")
        if self.dq_first and self.head_dim != 128:
            raise ValueError("dK after dQ (dq_first) is a d = 128 variant of the Hopper backward")
        if self.decoupled and self.deterministic:
            raise ValueError("the decoupled consumers take the default order of dQ's adds, not deterministic=True")
        if self.rows80 and not self.rows80_applies:
            raise ValueError(
                "80-row steps (rows80) are the Hopper backward's d = 128 variant of a padded batch without "
                "a causal mask, window, softcap, ALiBi, score functions or deterministic=True, with dq_first "
                "(decoupled: with rows_by_producer)"
            )

    def _name_parts(self) -> tuple[object, ...]:
        return (_SHORT_DTYPE[self.dtype], self.head_dim)

    def _name_flags(self) -> tuple[tuple[str, bool], ...]:
        return (
            *_mask_flags(self.causal, self.local, self.softcap),
            ("alibi", self.alibi),
            ("det", self.deterministic),
            (f"mods{_digest(self.mods_source)}", bool(self.mods_source)),
            ("varlen", self.varlen),
            ("dec", self.decoupled),
            ("late", self.late_exp),
            ("dqf", self.dq_first),
            ("m80", self.rows80),
            ("rowp", self.rows_by_producer),
        )

    @property
    def rows80_applies(self) -> bool:
        """Whether the other fields allow 80-row steps (fa3_bwd.cu's Dq_swapped static_assert):
        d = 128 with dK after dQ, a padded batch, no causal mask, window, softcap, ALiBi, score
        functions or fixed order; decoupled consumers only with the producer's rows (their second
        dS buffer fits beside one copy of the rows, not two)."""
        others = (self.causal, self.local, self.softcap, self.alibi, self.mods_source, self.varlen,
                  self.deterministic, self.decoupled and not self.rows_by_producer)  # fmt: skip
        return self.head_dim == 128 and self.dq_first and not any(others)

    @property
    def block_m(self) -> int:
        """Query rows per step: FlashAttention-3's 128 at d = 64 (m64n128 wgmmas for S^T and
        dP^T), 64 at d = 128 (the consumers' registers), 80 there with ``rows80``."""
        return 128 if self.head_dim == 64 else 80 if self.rows80 else 64

    @property
    def smem_bytes(self) -> int:
        # 1024 bytes of alignment slack; K, V; Q and dO two-deep; dS^T (16-bit; two-deep when
        # decoupled); a step's dQ staged (fp32, two-deep when deterministic); -LSE log2 e and D
        # two-deep per consumer (one copy when the producer loads them); 5 mbarriers.
        d, m, n = self.head_dim, self.block_m, self.block_n
        stages, staging, ds_stages = 2, 2 if self.deterministic else 1, 2 if self.decoupled else 1
        rows = (1 if self.rows_by_producer else 2) * stages * 2 * 4 * m
        return 1024 + 2 * (2 * n * d + 2 * stages * m * d + ds_stages * n * m) + 4 * staging * m * d + rows + 8 * 5

    def _traits_args(self) -> tuple[object, ...]:
        dtype = CUDA_ELEMENT_TYPES[self.dtype]
        # the template's optional parameters as (value, its default), those at their defaults
        # left off the end (the instantiations of the variants before them stay as they were)
        optional = [
            (self.alibi, False), (self.varlen, False), (self.deterministic, self.deterministic),  # Dq_writer_
            (self.decoupled, False), (self.late_exp, False), (self.dq_first, False),
            (self.rows_by_producer, False),
        ]  # fmt: skip
        while optional and optional[-1][0] == optional[-1][1]:
            optional.pop()
        return (
            self.head_dim, self.block_m, dtype, self.causal, self.local, self.softcap, self.deterministic,
            bool(self.mods_source), *(value for value, _ in optional),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class BwdRowSpec(_KernelSpecBase):
    """The backward's per-row kernels in ``kernels_cu/fa2_bwd.cu`` (template ``BwdRowTraits``):
    ``"prep"`` (D = rowsum(dO * O), -LSE log2 e, dQ's fp32 accumulator zeroed) before the main
    kernel, ``"dq"`` (the accumulator scaled into dQ) after it. A row's 16-byte chunks on
    consecutive lanes, ``rows_per_warp`` rows per warp; dq takes rows in pairs (r, r + 8)."""

    step: str  # "prep" | "dq"
    dtype: str
    head_dim: int  # the tile width of the main kernel (dQ's accumulator rows)
    valid_dim: int = 0

    kernel = "fa2_bwd_rows"
    source_file = "fa2_bwd.cu"
    archs = CI_ARCHS
    params_type = "BwdParams"
    param_decl = "const BwdParams params"
    uses_tma = False
    num_threads = 128
    smem_bytes = 0
    traits = "BwdRowTraits"

    def __post_init__(self) -> None:
        _check_dtype(self.dtype, CUDA_ELEMENT_TYPES)
        if self.step not in ("prep", "dq"):
            raise ValueError(f"unknown backward row step {self.step!r}")
        _check_columns(self.head_dim, self.valid_dim, FA2_BWD_HEAD_DIMS)

    @property
    def prefix(self) -> str:  # type: ignore[override]
        return f"fa2_bwd_{self.step}"

    @property
    def entry(self) -> str:  # type: ignore[override]
        return f"fa2_bwd_{self.step}<Traits>(params);"

    def _name_parts(self) -> tuple[object, ...]:
        return (_SHORT_DTYPE[self.dtype], _dim_part(self.head_dim, self.valid_dim))

    def _traits_args(self) -> tuple[object, ...]:
        return (self.head_dim, CUDA_ELEMENT_TYPES[self.dtype], *_columns_arg(self.valid_dim))

    @property
    def rows_per_warp(self) -> int:
        """As BwdRowTraits::kRowsPerWarp: 32 / chunks where a row's chunks are a power of two."""
        chunks = self.head_dim // 8
        return 32 // chunks if chunks & (chunks - 1) == 0 else 1

    def grid_x(self, rows: int) -> int:
        """The grid's x for ``rows`` rows per (batch, head): prep a warp per ``rows_per_warp``
        rows, dq per as many pairs of rows (r, r + 8), 8 pairs per 16 rows."""
        units = rows if self.step == "prep" else 8 * -(-rows // 16)
        return -(-units // (self.num_threads // 32 * self.rows_per_warp))


@dataclass(frozen=True, slots=True)
class MaskCellsSpec(_KernelSpecBase):
    """``attn_mask_cells`` (``kernels_cu/attn_mask.cuh``): an attn_mask's block summary, written
    before the FA2 kernels that read the mask, in their launch (forward: ``AttnParams``, from
    fa2_fwd.cu; backward: ``BwdParams``, whose ``attn`` it reads, from fa2_bwd.cu). One CTA per
    cell."""

    mask_dtype: str  # "bool", or an additive mask's (q's) "float16" | "bfloat16"
    params_type: str = "AttnParams"  # "AttnParams" | "BwdParams"

    kernel = "attn_mask_cells"
    archs = CI_ARCHS
    uses_tma = False
    num_threads = 256
    smem_bytes = 0
    traits = "MaskCellsTraits"
    prefix = "attn_mask_cells"

    def __post_init__(self) -> None:
        if self.mask_dtype != "bool":
            _check_dtype(self.mask_dtype, CUDA_ELEMENT_TYPES)
        if self.params_type not in ("AttnParams", "BwdParams"):
            raise ValueError(f"the mask summary runs in AttnParams or BwdParams launches, not {self.params_type}")

    @property
    def source_file(self) -> str:
        return "fa2_bwd.cu" if self.params_type == "BwdParams" else "fa2_fwd.cu"

    @property
    def param_decl(self) -> str:
        return f"const {self.params_type} params"

    @property
    def entry(self) -> str:  # type: ignore[override]
        return f"attn_mask_cells<Traits>(params{'.attn' if self.params_type == 'BwdParams' else ''});"

    def _name_parts(self) -> tuple[object, ...]:
        dtype = "bool" if self.mask_dtype == "bool" else _SHORT_DTYPE[self.mask_dtype]
        return (dtype, "bwd" if self.params_type == "BwdParams" else "fwd")

    def _traits_args(self) -> tuple[object, ...]:
        is_bool = self.mask_dtype == "bool"
        return ("unsigned char" if is_bool else CUDA_ELEMENT_TYPES[self.mask_dtype], is_bool)


@dataclass(frozen=True, slots=True)
class BlockMaskCellsSpec(_KernelSpecBase):
    """``block_mask_cells`` (``kernels_cu/attn_mask.cuh``): a BlockMask's summary, the user's
    mask_mod (``mods_source``: ``_mods.kernel_mods(None, mask_mod)``) evaluated at every (row, key)
    of each cell, written once when the BlockMask is made (``cupyflash.create_block_mask``). One
    CTA per cell, as ``attn_mask_cells``."""

    mods_source: str

    kernel = "block_mask_cells"
    source_file = "attn_mask.cuh"
    archs = CI_ARCHS
    params_type = "AttnParams"
    param_decl = "const AttnParams params"
    uses_tma = False
    num_threads = 256
    smem_bytes = 0
    traits = "MaskCellsTraits"  # (its element unused: the cells come from the function)
    prefix = "block_mask_cells"
    entry = "block_mask_cells<Traits>(params);"

    def __post_init__(self) -> None:
        if not self.mods_source:
            raise ValueError("a BlockMask's summary takes its mask_mod's device source")

    def _name_parts(self) -> tuple[object, ...]:
        return (_digest(self.mods_source),)

    def _traits_args(self) -> tuple[object, ...]:
        return ("unsigned char", True)


@dataclass(frozen=True, slots=True)
class PackedFillSpec(_KernelSpecBase):
    """``packed_fill`` (``kernels_cu/packed_fill.cu``): the first step of a packed launch, the
    output rows no sequence owns set to 0 (LSE -inf): the tail after the last sequence, or every
    row where the offsets are bad. One variant per launch's params struct (``params_type``):
    the forward's (``AttnParams``, or ``Fa3Params`` on the Hopper kernel, whose fields start with
    AttnParams' and which it reads as one) and the backward's (``BwdParams``). A grid-stride loop
    of 16-byte stores; its CTAs each check every sequence's offsets first."""

    params_type: str  # "AttnParams" | "Fa3Params" | "BwdParams"

    kernel = "packed_fill"
    source_file = "packed_fill.cu"
    archs = CI_ARCHS
    uses_tma = False
    num_threads = 256
    smem_bytes = 0
    traits = "PackedFillTraits"
    prefix = "packed_fill"
    max_ctas = 264  # two per SM of the H100 / H200: a tail's bytes, usually none

    def __post_init__(self) -> None:
        if self.params_type not in ("AttnParams", "Fa3Params", "BwdParams"):
            raise ValueError(f"the packed fill runs in the forward's or the backward's launch, not {self.params_type}")

    @property
    def backward(self) -> bool:
        return self.params_type == "BwdParams"

    @property
    def param_decl(self) -> str:
        # Fa3Params' launch packs its fields without the tensor maps: AttnParams' bytes come first
        return "const BwdParams params" if self.backward else "const AttnParams params"

    @property
    def entry(self) -> str:  # type: ignore[override]
        return f"packed_fill_{'backward' if self.backward else 'forward'}(params);"

    def template_args(self) -> str:
        return self.traits  # (not a template)

    def _name_parts(self) -> tuple[object, ...]:
        return ({"AttnParams": "fwd", "Fa3Params": "fa3_fwd", "BwdParams": "bwd"}[self.params_type],)

    def _traits_args(self) -> tuple[object, ...]:
        return ()

    def grid(self, rows: int, row_bytes: int) -> tuple[int, int, int]:
        """Enough CTAs for ``rows`` rows of ``row_bytes`` (every row, as bad offsets fill), 8
        stores of 16 bytes per thread, at most ``max_ctas``."""
        chunks_per_cta = self.num_threads * 8
        return (max(1, min(self.max_ctas, -(-rows * row_bytes // 16 // chunks_per_cta))), 1, 1)


KernelSpec = (
    Fa2FwdSpec
    | Fa3FwdSpec
    | Fp8VtSpec
    | Fa1FwdSpec
    | NaiveSoftmaxSpec
    | DecodeSpec
    | DecodeAppendSpec
    | MergeSpec
    | Fa2BwdSpec
    | Fa2BwdDqSpec
    | Fa3BwdSpec
    | BwdRowSpec
    | MaskCellsSpec
    | BlockMaskCellsSpec
    | PackedFillSpec
)
