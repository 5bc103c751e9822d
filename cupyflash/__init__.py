"""cupyflash: exact attention (FlashAttention-1/2, FlashDecoding) as CUDA C compiled at run time
through CuPy, behind one function that takes CuPy, PyTorch, JAX or any array-API array."""

from . import mods
from ._api import (
    attention,
    attention_backward,
    attention_varlen,
    attention_varlen_backward,
    attention_with_kvcache,
    create_block_mask,
)
from ._block_mask import BlockMask
from ._cascade import attention_with_shared_prefix
from ._fp8 import quantize_fp8, quantize_qk_fp8
from ._kernels import KernelCompileError
from ._kvcache import DeviceValueError, check_device_errors, merge_states
from ._version import __version__

__all__ = [
    "BlockMask",
    "DeviceValueError",
    "KernelCompileError",
    "__version__",
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "attention_with_shared_prefix",
    "check_device_errors",
    "create_block_mask",
    "merge_states",
    "mods",
    "quantize_fp8",
    "quantize_qk_fp8",
]
