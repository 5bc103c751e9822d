"""The GPU a call runs on, as the planners see it: its architecture and limits, read once per
device (``DeviceInfo``). Planning asks the driver nothing else."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import _interop
from ._specs import HOPPER_ARCH, HOPPER_SMEM_PER_BLOCK


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    arch: str  # NVRTC target: "sm_90a" on Hopper, else "sm_XY"
    num_sms: int
    max_smem_per_block: int  # opt-in dynamic shared memory of one CTA
    smem_per_sm: int
    regs_per_sm: int
    max_threads_per_sm: int
    max_blocks_per_sm: int


#: An H100's or H200's limits (SXM, 132 SMs; the two agree in every one): the device that host
#: tests, offline builds and scripts plan for where no GPU is present.
HOPPER = DeviceInfo(0, HOPPER_ARCH, 132, HOPPER_SMEM_PER_BLOCK, 228 * 1024, 65536, 2048, 32)


@functools.cache
def device_info(index: int) -> DeviceInfo:
    from ._kernels import device_arch

    attr = functools.partial(_interop.device_attribute, index)
    return DeviceInfo(
        index=index,
        arch=device_arch(index),
        num_sms=attr("MultiProcessorCount"),
        max_smem_per_block=attr("MaxSharedMemoryPerBlockOptin"),
        smem_per_sm=attr("MaxSharedMemoryPerMultiprocessor"),
        regs_per_sm=attr("MaxRegistersPerMultiprocessor"),
        max_threads_per_sm=attr("MaxThreadsPerMultiProcessor"),
        max_blocks_per_sm=attr("MaxBlocksPerMultiprocessor"),
    )
