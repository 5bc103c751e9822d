"""The GPU route's host work on a machine without a GPU: CPU tensors stand in for CUDA ones (the
pipeline sees PyTorch CUDA tensors on device 0 of an H200-like DeviceInfo), kernels are never
compiled and launch through a no-op driver call (their params struct still packed). Import it
before calling cupyflash; used by host_cascade.py and mods_sass.py."""

import torch

from cupyflash import _device, _interop, _kernels, _workspace


class StandInLib(_interop.TorchLib):
    def stream(self, device):
        return 0

    def empty(self, shape, dtype, device, like=None):
        return torch.empty(shape, dtype=self._dtype(dtype))


LIB = StandInLib()


def _on_cpu(arrays):
    return all(x is None or (isinstance(x, torch.Tensor) and x.device.type == "cpu") for x in arrays)


_real_lean, _real_gpu_arrays = _interop.lean_arrays, _interop.gpu_arrays
_interop.lean_arrays = lambda arrays: (LIB, 0, False) if _on_cpu(arrays) else _real_lean(arrays)
_interop.gpu_arrays = lambda names, arrays: (LIB, 0, list(arrays)) if _on_cpu(arrays) else _real_gpu_arrays(names, arrays)
_interop.current_device = lambda: 0
_interop.stream_is_capturing = _workspace.stream_is_capturing = lambda stream: False
_device.device_info = lambda index: _device.DeviceInfo(0, "sm_90a", 132, 232448, 233472, 65536, 2048, 32)
_kernels.device_arch = lambda index: "sm_90a"


class _Function:
    ptr = 0


class _Driver:
    class CUDADriverError(Exception):
        pass

    @staticmethod
    def launchKernel(*args):  # noqa: N802 (the driver's name)
        pass


_kernels._compile_for_device = lambda spec, device: _kernels.CompiledKernel(spec, "sm_90a", _Function(), 0, 0, 0.0)
_kernels._driver = lambda: _Driver
_workspace.error_word_ptrs[0] = 1 << 20
