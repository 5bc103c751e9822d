"""Fixtures shared by the tests: the array-API namespaces of the CPU tests, the `gpu` marker's
skip, NaN-poisoned outputs for every GPU launch, and the hypothesis profiles of test_fuzz.py.
Shared helpers that are not fixtures live in helpers.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

try:
    from hypothesis import settings
except ImportError:  # a GPU machine without the wheel: test_fuzz.py skips itself
    pass
else:
    # "ci" (the default): the same examples on every run (derandomized, no example database),
    # so the fuzz tests cannot flake in CI. HYPOTHESIS_PROFILE=explore draws fresh examples on
    # each run; CUPYFLASH_FUZZ_SCALE multiplies every fuzz test's example budget (test_fuzz.py).
    settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
    settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no GPU visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _namespaces() -> list[object]:
    spaces = [pytest.param("numpy", id="numpy"), pytest.param("array_api_strict", id="array_api_strict")]
    try:
        import torch  # noqa: F401

        spaces.append(pytest.param("torch", id="torch-cpu"))
    except ImportError:
        pass
    return spaces


@pytest.fixture(params=_namespaces())
def xp(request: pytest.FixtureRequest) -> object:
    """An array-API namespace for the host path (numpy, array_api_strict, torch CPU if present)."""
    if request.param == "numpy":
        return np
    if request.param == "torch":
        from array_api_compat import torch as torch_compat

        return torch_compat
    import array_api_strict

    return array_api_strict


@pytest.fixture(autouse=True)
def poison_gpu_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GPU output is filled with NaN before its kernel runs."""
    from cupyflash import _launch

    monkeypatch.setattr(_launch, "POISON_OUTPUTS", True)


def _release_cached_gpu_memory() -> None:
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request: pytest.FixtureRequest):
    """After each GPU test, the memory PyTorch's and CuPy's allocators keep cached is given back:
    a worker otherwise holds its largest tests' float64 references (a 15-worker run on one H100
    had one worker at 61 GiB and 195 of its tests failing for memory, 2026-12-07)."""
    yield
    if request.node.get_closest_marker("gpu") is not None:
        _release_cached_gpu_memory()


@pytest.fixture(autouse=True)
def one_gpu_memory_test_at_a_time(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Tests marked gpu_memory (tens of GiB of GPU memory each) run one at a time across
    pytest-xdist's workers: each holds a lock file in the run's shared temporary folder, and gives
    its cached memory back before letting go. Two of them side by side ran an H100 out of memory
    (2026-12-07: the batch-invariant decode's two caches, up to 64 x 45k tokens each, beside a
    worker at 60 GiB)."""
    if request.node.get_closest_marker("gpu_memory") is None:
        yield
        return
    import fcntl

    lock_path = tmp_path_factory.getbasetemp().parent / "cupyflash-gpu-memory.lock"  # (the workers' common parent)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if request.node.get_closest_marker("gpu") is not None:
                _release_cached_gpu_memory()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random data per test (seeded by the test's name: reproducible, never shared)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
