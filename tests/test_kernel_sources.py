"""The CUDA sources as files (no compiler needed): the generated wgmma header is the generator's
output, headers are a library (no .cu includes a .cu), and each file opens with its role."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from cupyflash._kvcache import _DEVICE_ERRORS
from cupyflash._specs import WGMMA_N

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels_cu"


def _gen_wgmma():
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "scripts" / "gen_wgmma.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wgmma_header_is_the_generators_output():
    gen = _gen_wgmma()
    assert (KERNELS / "wgmma.cuh").read_text() == gen.render(), "run: python scripts/gen_wgmma.py"


def test_wgmma_shapes_are_the_specs():
    assert tuple(_gen_wgmma().SHAPES) == WGMMA_N


def test_no_cu_includes_a_cu():
    includes = {
        path.name: re.findall(r'^\s*#include\s+"([^"]+)"', path.read_text(), re.MULTILINE)
        for path in KERNELS.glob("*.cu*")
    }
    offending = {name: [i for i in inc if i.endswith(".cu")] for name, inc in includes.items()}
    assert not {name: inc for name, inc in offending.items() if inc}
    local = {path.name for path in KERNELS.glob("*.cu*")}
    missing = {name: [i for i in inc if i not in local and not i.startswith("cuda_")] for name, inc in includes.items()}
    assert not {name: inc for name, inc in missing.items() if inc}


def test_every_file_opens_with_its_role():
    for path in KERNELS.glob("*.cu*"):
        first = path.read_text().splitlines()[0]
        assert first.startswith("// ") and len(first) > 20, f"{path.name}: no opening comment"


def test_every_device_error_bit_has_its_message():
    """The bits of the device error word (params.cuh) are distinct powers of two, and each has
    the message check_device_errors raises for it, naming the value (and no message lacks a bit)."""
    enum = re.search(r"enum : int32_t \{([^}]*)\}", (KERNELS / "params.cuh").read_text())
    assert enum is not None
    bits = {name: int(value) for name, value in re.findall(r"(kBad\w+) = (\d+)", enum.group(1))}
    assert len(bits) == len(set(bits.values())) >= 6
    assert all(bit & (bit - 1) == 0 for bit in bits.values())
    assert set(bits.values()) == set(_DEVICE_ERRORS)
    named = {"kBadPage": "block_table", "kBadSeqlen": "cache_seqlens", "kBadCacheIndex": "cache_batch_idx",
             "kBadCuSeqlensQ": "cu_seqlens_q value", "kBadCuSeqlensK": "cu_seqlens_k value",
             "kBadSequsedK": "seqused_k value", "kBadSharedCacheIndex": "another sequence also names",
             "kBadRotaryPosition": "past rotary_cos"}  # fmt: skip
    assert set(named) == set(bits)
    for name, word in named.items():
        assert word in _DEVICE_ERRORS[bits[name]], (name, _DEVICE_ERRORS[bits[name]])
