"""The only source generation: ``render(spec)`` -> (code, options, entry name).

The kernels are real C++ in ``kernels_cu/``; Python writes only a short preamble: a fingerprint
line, the ``#include`` of the kernel file, ``using Traits = ...;`` and one ``extern "C"`` entry.
CuPy's disk cache keys on the source string and options, not on headers reached through ``-I``,
so the fingerprint (SHA-256 of every file under ``kernels_cu/`` plus the package version) makes a
header edit miss the cache instead of being served a stale binary. Needs no GPU.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from ._specs import KernelSpec
from ._version import __version__

_PACKAGE_DIR = Path(__file__).resolve().parent


@functools.cache
def kernel_dir() -> Path:
    """``kernels_cu/``: inside the package when installed from a wheel, beside it in a checkout."""
    for candidate in (_PACKAGE_DIR / "kernels_cu", _PACKAGE_DIR.parent / "kernels_cu"):
        if (candidate / "fa2_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupyflash's CUDA sources (kernels_cu/) were not found next to {_PACKAGE_DIR}; the installation is incomplete"
    )


@functools.cache
def fingerprint() -> str:
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(kernel_dir().rglob("*.cu*")):
        digest.update(path.relative_to(kernel_dir()).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def cuda_include_options() -> tuple[str, ...]:
    """``-I`` for the CUDA headers (cuda_fp16.h ...) wherever CuPy finds the toolkit."""
    try:
        from cupy.cuda import get_cuda_path
    except ImportError:  # pragma: no cover - CuPy is needed to compile anyway
        return ()
    root = get_cuda_path()
    if root is None or not (Path(root) / "include").is_dir():
        return ()
    return (f"-I{Path(root) / 'include'}",)


def render(spec: KernelSpec) -> tuple[str, tuple[str, ...], str]:
    """Source, NVRTC options (no arch) and entry symbol of one variant."""
    name = spec.name
    # A user score_mod / mask_mod (Fa2FwdSpec.mods_source): its functions after AttnParams, then
    # CF_USER_MODS, which variants.cuh's UserMods is written under.
    mods = getattr(spec, "mods_source", "")
    prelude = f'#include "params.cuh"\n{mods}#define CF_USER_MODS 1\n' if mods else ""
    code = (
        f"// cupyflash {__version__} kernels_cu sha256={fingerprint()}\n"
        f"{prelude}"
        f'#include "{spec.source_file}"\n'
        f"using Traits = {spec.template_args()};\n"
        f'extern "C" __global__ void __launch_bounds__({spec.launch_bounds})\n'
        f"{name}({spec.param_decl}) {{ {spec.entry_body} }}\n"
    )
    options = ("--std=c++17", f"-I{kernel_dir()}", *cuda_include_options())
    return code, options, name
