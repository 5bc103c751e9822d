"""Pure plans: a validated problem and a ``DeviceInfo`` in, a ``Launch`` out.

A ``Launch`` is everything a call needs that depends only on shapes, dtypes, options and the
device (``model``). Planning compiles nothing and asks the driver nothing beyond the cached
``DeviceInfo``; ``_launch.run`` executes a Launch, and a kernel is compiled where a Launch first
meets it (``_kernels.get_kernel``). One module per kernel family: ``forward`` (FA2 and the Hopper
kernel), ``fp8_forward``, ``backward``, ``decode`` (FlashDecoding over a KV cache) and ``merge``,
on the blocks of ``common``. This face names what the executors use.
"""

from .backward import plan_backward
from .block_mask import RANGE_BLOCK, BlockCells, plan_block_mask_cells
from .common import check_gpu_dtypes, check_int32, softmax_factors
from .decode import CascadePrefix, cascade_blocks, plan_kvcache, split_ranges
from .forward import forward_spec, plan_attention, plan_forward, plan_paged_varlen
from .fp8_forward import plan_fp8_forward
from .merge import PartsLayout, plan_merge, plan_merge_parts
from .model import (
    CONTIGUOUS,
    FP8_TILE,
    INDEX,
    LENGTHS,
    ROWS,
    SCALAR,
    TILE,
    KernelStep,
    Launch,
    Operand,
    Output,
    PlanCache,
    Scratch,
    Temporary,
    TmaMaps,
    clear_caches,
    new_cache,
    new_pair_cache,
    new_route_cache,
)

__all__ = [
    "BlockCells", "CONTIGUOUS", "FP8_TILE", "INDEX", "LENGTHS", "RANGE_BLOCK", "ROWS", "SCALAR", "TILE",
    "CascadePrefix", "KernelStep", "Launch", "Operand", "Output", "PartsLayout", "PlanCache", "Scratch", "Temporary",
    "TmaMaps", "cascade_blocks", "check_gpu_dtypes", "check_int32", "clear_caches", "forward_spec", "new_cache",
    "new_pair_cache", "new_route_cache", "plan_attention", "plan_backward", "plan_block_mask_cells", "plan_forward",
    "plan_fp8_forward", "plan_kvcache", "plan_merge", "plan_merge_parts", "plan_paged_varlen", "softmax_factors",
    "split_ranges",
]  # fmt: skip
