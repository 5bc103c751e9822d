"""Kernel variants compile through NVRTC for their targets (FA2, FA1, naive, decode: sm_80 and
sm_90a; the Hopper kernels: sm_90a) on a machine with no GPU, with no local-memory spills, no
serialised wgmma and no compiler warning, and with the kernel's own shared-memory count equal to
the spec's (each entry's static_assert); scripts/sass_evidence.py shows the Hopper kernel's
HGMMA / UTMALDG.

Which variants, by ``CUPYFLASH_COMPILE_ALL``:

* unset or 0 (the default, ``python -m pytest -n auto``, CI's: a few minutes on two cores): a sample.
  Every kernel family on every arch it targets, and for each kernel shape (family, arch, head
  dim, tile and every other field that is not a mask flag) the variant with the most mask flags
  (causal, window, softcap, dropout, ALiBi, attn_mask, deterministic, varlen) and those with
  softcap and one other flag (the most registers on the GPU machine's logs: registers do not grow
  with the flag count), so the ones most likely to spill, in the arch's element type; the other
  element type's twin of each family's widest heaviest variant.
* 1 (``scripts/gpu_check.sh`` sets it; CI runs the default): every variant the dispatcher can
  pick, in one element type per arch, and the other type's twin of every 8th (SELECT_OTHER_TYPE
  below).
* 2: every variant in both element types, as ``python -m cupyflash warmup`` builds them on a GPU.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

import pytest

from cupyflash import _dispatch, _kernels
from cupyflash._dispatch import FA1_DEVICE_SMEM, MaskFlags, all_kernel_specs
from cupyflash._specs import HOPPER_SMEM_PER_BLOCK, DecodeAppendSpec, Fa2FwdSpec, KernelSpec, TileConfig


def head_dim_sample() -> list[KernelSpec]:
    """Head dims below a tile width (compiled on demand, one variant per head dim, so not all
    built here): every kernel family at a sample of them -- the element-by-element path (59), the
    smallest (8), chunked tails of the 192 and 256 widths (160 on FA2 and 256 on the Hopper kernel,
    224) -- with no flag and with the flags that take the most registers."""
    specs: list[KernelSpec] = []
    for head_dim in (8, 59, 160, 224):
        for flags in (MaskFlags(False, False, False), MaskFlags(True, True, False, True, True)):
            specs += [
                _dispatch.fa2_fwd_spec("bfloat16", head_dim, flags, HOPPER_SMEM_PER_BLOCK),
                _dispatch.fa2_bwd_spec("bfloat16", head_dim, flags),
                _dispatch.fa2_bwd_spec("float16", head_dim, flags, deterministic=True),
                _dispatch.fa2_bwd_dq_spec("float16", head_dim, flags),
            ]
            hopper = _dispatch.fa3_fwd_spec("bfloat16", head_dim, MaskFlags(flags.causal, flags.local, False), 4096)
            specs += [hopper] if hopper is not None else []
        specs += [_dispatch.bwd_row_spec(step, "bfloat16", head_dim) for step in ("prep", "dq")]
        specs += [_dispatch.decode_spec("float16", head_dim, rows, c) for rows in (4, 64) for c in (False, True)]
        specs += [_dispatch.decode_spec("bfloat16", head_dim, 4, True, local=True, softcap=True)]
        specs.append(DecodeAppendSpec("bfloat16", head_dim))
    # The decode kernel's window and softcap at every shipped tile (full widths).
    for width, tiles in _dispatch.DECODE_TILES.items():
        for tile in tiles:
            for local, softcap in ((True, False), (False, True)):
                specs.append(_dispatch.decode_spec("bfloat16", width, tile.block_m, True, local, softcap))
    # A float8 cache's window and softcap (compiled on first use): every tile, both on at once.
    for width in _dispatch.FP8_DECODE_HEAD_DIMS:
        for tile in _dispatch.DECODE_TILES[width]:
            specs.append(_dispatch.decode_spec("float16", width, tile.block_m, True, True, True, fp8=True))
    # batch_invariant with a window and softcap (compiled on first use): every tile, both on at
    # once, so that the sample's heaviest variant of each decode shape is this one (all 352
    # batch-invariant variants, every flag, type and arch, built with no spill: NVRTC 13.0.88).
    for width, tiles in _dispatch.DECODE_TILES.items():
        for tile in tiles:
            specs.append(_dispatch.decode_spec("bfloat16", width, tile.block_m, True, True, True, batch_invariant=True))
            if width in _dispatch.FP8_DECODE_HEAD_DIMS:
                specs.append(
                    _dispatch.decode_spec("float16", width, tile.block_m, True, True, True, True, batch_invariant=True)
                )
    # A tree mask among draft tokens (speculative decoding) with softcap, compiled on first use:
    # every tile of the 16-bit and float8 caches, in both element types, so that the sample's
    # softcap pairs hold the tree's variants in each arch's type.
    for dtype in ("bfloat16", "float16"):
        for width, tiles in _dispatch.DECODE_TILES.items():
            for tile in tiles:
                specs.append(_dispatch.decode_spec(dtype, width, tile.block_m, False, softcap=True, tree=True))
        for width in _dispatch.FP8_DECODE_HEAD_DIMS:
            for tile in _dispatch.FP8_DECODE_TILES[width]:
                specs.append(
                    _dispatch.decode_spec(dtype, width, tile.block_m, False, softcap=True, fp8=True, tree=True)
                )
    # attn_mask's backward variants and softcap's with ALiBi (compiled on first use, not by
    # warmup): a sample of each kind, with the flags that take the most registers among them
    sample = [
        (MaskFlags(True, False, False, mask="additive"), (64, 128, 256)),
        (MaskFlags(False, False, False, mask="additive"), (80, 192)),
        (MaskFlags(True, False, False, mask="bool"), (80, 192)),
        (MaskFlags(False, False, False, mask="bool"), (64, 128, 256)),
        (MaskFlags(True, True, False, True, mask="bool"), (128, 256)),
        (MaskFlags(True, True, True, True, True), (64, 128, 192, 256)),  # softcap, dropout, ALiBi
        (MaskFlags(False, False, True, False, True), (64, 128, 256)),
    ]
    for flags, head_dims in sample:
        for head_dim in head_dims:
            if flags.softcap and flags.alibi:  # the forward's and the cache's too, and Hopper's
                no_dropout = replace(flags, dropout=False)
                smem = HOPPER_SMEM_PER_BLOCK
                specs.append(_dispatch.fa2_fwd_spec("bfloat16", head_dim, flags, smem))
                specs.append(_dispatch.fa2_fwd_spec("float16", head_dim, no_dropout, smem, over_cache=True))
                for seqlen_k, varlen in ((4096, False), (1024, True)):  # its long and short tiles
                    hopper = _dispatch.fa3_fwd_spec("bfloat16", head_dim, no_dropout, seqlen_k, varlen)
                    specs += [hopper] if hopper is not None else []
            specs.append(_dispatch.fa2_bwd_spec("bfloat16", head_dim, flags))
            specs.append(_dispatch.fa2_bwd_spec("float16", head_dim, flags, deterministic=True))
            specs.append(_dispatch.fa2_bwd_dq_spec("float16", head_dim, flags))
    specs += _dispatch.all_mask_cells_specs("BwdParams")
    return list(dict.fromkeys(specs))


# Each arch with its GPU's shared memory (FA1's tiles follow it: the A100's variants for sm_80,
# the H100/H200's for sm_90a); each variant for the archs it targets.
ALL_JOBS = [
    (spec, arch)
    for arch, smem in FA1_DEVICE_SMEM.items()
    for spec in [*all_kernel_specs(smem), *head_dim_sample()]
    if arch in spec.archs
]

# A variant's two element types take the same registers (60 sampled float16 / bfloat16 pairs on
# both archs: 59 equal, one a register apart, none spilling): only the conversions and the MMA's
# type differ. So level 1 builds every variant in one type per arch (float16 for sm_80, bfloat16
# for sm_90a, the H200's) and the other type's twin of every 8th (the build is most of CI's time on
# two cores); level 2 builds every one, as warmup does on the GPU machine.
PRIMARY_DTYPE = {"sm_80": "float16", "sm_90a": "bfloat16"}
OTHER_TYPE_EVERY = 8
LEVEL = int(os.environ.get("CUPYFLASH_COMPILE_ALL") or 0)
# The fields that switch a masking or gradient feature on (each adds code and registers to the
# same kernel shape); every other field but the element type makes the shape.
FLAG_FIELDS = (
    "causal", "local", "softcap", "dropout", "alibi", "mask", "deterministic", "varlen", "batch_invariant", "tree",
)  # fmt: skip


def select_jobs(jobs: list[tuple[KernelSpec, str]], build_all: bool) -> list[tuple[KernelSpec, str]]:
    """``jobs`` less the other element type's twins, but for every OTHER_TYPE_EVERY-th of them
    (a variant whose twin in the arch's type is not a job is always kept)."""
    if build_all:
        return jobs
    present = set(jobs)
    kept, skipped = [], 0
    for spec, arch in jobs:
        dtype = getattr(spec, "dtype", None)
        primary = PRIMARY_DTYPE[arch]
        if dtype in ("float16", "bfloat16") and dtype != primary and (replace(spec, dtype=primary), arch) in present:
            skipped += 1
            if skipped % OTHER_TYPE_EVERY:
                continue
        kept.append((spec, arch))
    return kept


def flag_count(spec: KernelSpec) -> int:
    return sum(bool(getattr(spec, name, False)) for name in FLAG_FIELDS)


def kernel_shape(job: tuple[KernelSpec, str]) -> tuple[object, ...]:
    """(family, arch, every field but the element type and the flags): head dim, tile, ..."""
    spec, arch = job
    rest = tuple((f.name, getattr(spec, f.name)) for f in fields(spec) if f.name not in (*FLAG_FIELDS, "dtype"))
    return (type(spec).__name__, arch, *rest)


def sample_jobs(jobs: list[tuple[KernelSpec, str]]) -> list[tuple[KernelSpec, str]]:
    """The default sample of ``jobs`` (the module's docstring): for each kernel shape its variant
    with the most flags and those with softcap and one other flag, in the arch's element type, and
    for each (family, arch) the other type's twin of the widest heaviest one."""
    shapes: dict[tuple[object, ...], list[tuple[KernelSpec, str]]] = {}
    for job in select_jobs(jobs, build_all=False):
        shapes.setdefault(kernel_shape(job), []).append(job)

    def typed(job: tuple[KernelSpec, str]) -> bool:  # in the arch's element type (or none)
        spec, arch = job
        return getattr(spec, "dtype", PRIMARY_DTYPE[arch]) == PRIMARY_DTYPE[arch]

    heaviest = [max(group, key=lambda j: (flag_count(j[0]), typed(j))) for group in shapes.values()]
    # Registers do not grow with the flag count: on the H200's variants (docs/gpu_runs/*/variants.log)
    # the FA2 forward's most registers came with softcap and one other flag (local_softcap 210,
    # causal_local_softcap 182 at d=32), in most of its shapes.
    softcap_pairs = [
        j
        for group in shapes.values()
        for j in group
        if getattr(j[0], "softcap", False) and flag_count(j[0]) == 2 and typed(j)
    ]
    families: dict[tuple[str, str], tuple[KernelSpec, str]] = {}
    for spec, arch in heaviest:  # per (family, arch): the widest head dim, then the most flags
        key = (type(spec).__name__, arch)
        rank = (getattr(spec, "head_dim", 0), flag_count(spec))
        best = families.get(key)
        if best is None or rank > (getattr(best[0], "head_dim", 0), flag_count(best[0])):
            families[key] = (spec, arch)
    present = set(jobs)
    twins = []
    for spec, arch in families.values():
        other = {"float16": "bfloat16", "bfloat16": "float16"}.get(getattr(spec, "dtype", ""))
        if other is not None and (replace(spec, dtype=other), arch) in present:
            twins.append((replace(spec, dtype=other), arch))
    return list(dict.fromkeys([*heaviest, *softcap_pairs, *twins]))


JOBS = ALL_JOBS if LEVEL >= 2 else select_jobs(ALL_JOBS, build_all=False) if LEVEL == 1 else sample_jobs(ALL_JOBS)

# DECODE_REGISTERS (the registers per thread the decode occupancy model, and so the split count,
# reads) is checked on the same build: the table's variants join the jobs, all of them at levels 1
# and 2, every 5th by default (prime to the 2 archs, 2 types and 3 masks: both archs, every head
# dim). Most are jobs already; a second build of them was two minutes of CI on two cores.
TABLE_JOBS = [(spec, arch) for spec in _dispatch.decode_register_table_specs() for arch in ("sm_80", "sm_90a")]
TABLE_JOBS = TABLE_JOBS if LEVEL >= 1 else TABLE_JOBS[::5]
BUILD_JOBS = list(dict.fromkeys([*JOBS, *TABLE_JOBS]))
# The NVRTC (major, minor) that made DECODE_REGISTERS: 13.0.88, the H200 machine's, which the
# cuda13 extra pins (cuda-toolkit 13.0.2). Another release allocates registers differently (13.5
# differs on 27 of the 88 decode variants), so the table is checked only against its own NVRTC.
DECODE_REGISTERS_NVRTC = (13, 0)


def _build(job):
    spec, arch = job
    return spec.name, arch, _kernels.compile_offline(spec, arch)


def _build_all(jobs: list[tuple[KernelSpec, str]]) -> list[tuple[str, str, _kernels.OfflineBuild]]:
    """The jobs compiled on a thread pool (NVRTC runs without the GIL)."""
    first = _build(jobs[0])  # alone first: loads NVRTC and its builtins library once
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return [first, *pool.map(_build, jobs[1:])]


def test_the_jobs_cover_what_their_level_promises():
    """Level 1 and 2: every (variant less its element type, arch) of the full list is among the
    jobs. The sample: every kernel shape of every family and arch, each with as many flags as the
    full list's heaviest variant of that shape."""
    if LEVEL >= 1:

        def untyped(job):
            spec, arch = job
            return (replace(spec, dtype="float16") if getattr(spec, "dtype", None) == "bfloat16" else spec), arch

        assert {untyped(job) for job in ALL_JOBS} == {untyped(job) for job in JOBS}
        assert len(JOBS) < len(ALL_JOBS) or LEVEL >= 2
        return
    most: dict[tuple[object, ...], dict[str, int]] = {}
    for which, jobs in (("all", ALL_JOBS), ("sampled", JOBS)):
        for spec, arch in jobs:
            counts = most.setdefault(kernel_shape((spec, arch)), {})
            counts[which] = max(counts.get(which, 0), flag_count(spec))
    assert [shape for shape, counts in most.items() if counts.get("sampled") != counts["all"]] == []
    assert {(type(s), a) for s, a in JOBS} == {(type(s), a) for s, a in ALL_JOBS}
    assert {a for s, a in JOBS} == set(FA1_DEVICE_SMEM)
    assert len(JOBS) < len(ALL_JOBS) // 4


def test_every_variant_compiles_cleanly():
    """One test for the one build (its checks in separate tests would let pytest-xdist build the
    list on two workers): every job gives a cubin with no local-memory spill, no serialised wgmma
    and no compiler warning."""
    builds = _build_all(BUILD_JOBS)
    assert len(builds) == len(BUILD_JOBS) > 0
    for name, arch, build in builds:
        assert build.cubin, f"{name} {arch}: empty cubin"
        assert f"Compiling entry function '{name}' for '{arch}'" in build.log
    spilled = [(name, arch, b.spill_bytes) for name, arch, b in builds if b.spill_bytes]
    # ptxas serialises every wgmma of a kernel (C7514/C7515) when some control-flow path touches
    # an accumulator while its wgmma may be in flight: correct, but the overlap is gone.
    serialised = [(name, arch) for name, arch, b in builds if "wgmma.mma_async instructions are serialized" in b.log]
    # NVRTC returns its front-end warnings (e.g. #607: a pragma not followed by a loop, which
    # silently does nothing) in the same log as ptxas's -v lines; those say "ptxas info".
    warned = [(name, arch, b.warnings) for name, arch, b in builds if b.warnings]
    problems = [
        f"variants spilling to local memory: {spilled}" * bool(spilled),
        f"variants whose wgmmas ptxas serialised: {serialised}" * bool(serialised),
        f"variants compiled with warnings: {warned}" * bool(warned),
    ]
    assert not any(problems), "\n".join(p for p in problems if p)
    check_decode_register_table({(arch, name): build.registers for name, arch, build in builds})


def check_decode_register_table(registers: dict[tuple[str, str], int]) -> None:
    """DECODE_REGISTERS against ptxas's counts of the table's variants in ``registers`` (on a
    mismatch the message holds the table to paste); a warning, not a check, under another NVRTC."""
    version = nvrtc_version()
    if version != DECODE_REGISTERS_NVRTC:
        made = ".".join(map(str, DECODE_REGISTERS_NVRTC))
        found = "none" if version is None else ".".join(map(str, version))
        warnings.warn(
            f"DECODE_REGISTERS not checked: it was made with NVRTC {made}.88 and register counts differ "
            f"between NVRTC releases; this process loads NVRTC {found} (pip install -e '.[cuda13]' pins {made})",
            stacklevel=2,
        )
        return
    actual = {(arch, spec.name): registers[arch, spec.name] for spec, arch in TABLE_JOBS}
    table = _dispatch.DECODE_REGISTERS
    expected = table if LEVEL >= 1 else {key: table.get(key) for key in actual}
    if actual != expected:
        lines = "".join(f'    ("{a}", "{n}"): {r},\n' for (a, n), r in sorted(actual.items()))
        rerun = "" if LEVEL >= 1 else " (of a sample: CUPYFLASH_COMPILE_ALL=1 gives every entry)"
        pytest.fail(f"DECODE_REGISTERS is stale; the compiled variants give{rerun}:\n{lines}")


def nvrtc_version() -> tuple[int, int] | None:
    try:
        from cupy.cuda import nvrtc

        return tuple(nvrtc.getVersion())  # type: ignore[return-value]
    except Exception:  # no CuPy, or no NVRTC library: compile_offline cannot run either
        return None


def test_a_warning_is_seen(monkeypatch):
    from cupyflash import _source

    spec = Fa2FwdSpec("float16", 64, TileConfig(64, 64, 4))
    real_render = _source.render

    def misplaced_pragma(s):
        code, options, name = real_render(s)
        return code + "\n__device__ int cf_probe(int x) {\n#pragma unroll 1\n  x += 1;\n  return x;\n}\n", options, name

    monkeypatch.setattr(_kernels, "render", misplaced_pragma)
    build = _kernels.compile_offline(spec, "sm_80")
    assert any("warning #" in line and "pragma" in line for line in build.warnings), build.log
    assert not any(line.startswith("ptxas info") for line in build.warnings)


def test_compile_error_names_the_variant(monkeypatch):
    from cupyflash import _source

    spec = Fa2FwdSpec("float16", 64, TileConfig(64, 64, 4))
    real_render = _source.render

    def broken(s):
        code, options, name = real_render(s)
        return code + "\nthis is not C++;\n", options, name

    monkeypatch.setattr(_kernels, "render", broken)
    with pytest.raises(_kernels.KernelCompileError, match=rf"(?s){spec.name} for sm_90a failed.*this is not C\+\+"):
        _kernels.compile_offline(spec, "sm_90a")
