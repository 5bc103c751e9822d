"""What every benchmark needs: skip (NotImplementedError, reported n/a) where no GPU is visible."""

from __future__ import annotations


def require_gpu() -> None:
    try:
        import cupy

        available = bool(cupy.cuda.is_available())
    except Exception:
        available = False
    if not available:
        raise NotImplementedError("needs a CUDA GPU")


def require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise NotImplementedError("needs PyTorch for the peer backends") from None
