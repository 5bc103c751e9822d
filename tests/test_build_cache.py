"""Kernel build cache: one compile per variant under concurrency, fingerprinted sources."""

from __future__ import annotations

import shutil
import threading
import time

from cupyflash import _kernels, _source
from cupyflash._specs import Fa2FwdSpec, TileConfig


def test_concurrent_requests_compile_once(monkeypatch):
    calls = []

    def slow_compile(spec, device_id):
        calls.append(spec)
        time.sleep(0.2)
        return _kernels.CompiledKernel(spec, "sm_90a", object(), 100, 0, 0.2)

    monkeypatch.setattr(_kernels, "_compile_for_device", slow_compile)
    monkeypatch.setattr(_kernels, "_compiled", {})
    spec = Fa2FwdSpec("bfloat16", 128, TileConfig(128, 64, 8, q_in_regs=True), causal=True)
    other = Fa2FwdSpec("float16", 64, TileConfig(128, 128, 8, q_in_regs=True))
    results = []
    threads = [
        threading.Thread(target=lambda s=s: results.append(_kernels.get_kernel(s, 0))) for s in [spec] * 8 + [other] * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.name for s in calls) == sorted([spec.name, other.name])
    assert len({id(r) for r in results if r.spec == spec}) == 1


def test_source_names_variant_and_fingerprint():
    spec = Fa2FwdSpec("float16", 96, TileConfig(128, 64, 8), causal=True, softcap=True)
    code, options, name = _source.render(spec)
    assert name == "cf_fa2_fwd_fp16_d96_m128_n64_w8_s2_causal_softcap"
    assert f"void __launch_bounds__(256, 1)\n{name}(const AttnParams params)" in code
    assert f"sha256={_source.fingerprint()}" in code
    assert "Fa2FwdTraits<96, 128, 64, 8, 2, false, false, __half, true, false, true, false, false>" in code
    assert "--std=c++17" in options and f"-I{_source.kernel_dir()}" in options


def test_header_edit_changes_the_fingerprint(tmp_path, monkeypatch):
    copy = tmp_path / "kernels_cu"
    shutil.copytree(_source.kernel_dir(), copy)
    monkeypatch.setattr(_source, "_PACKAGE_DIR", tmp_path)
    _source.kernel_dir.cache_clear()
    _source.fingerprint.cache_clear()
    try:
        before = _source.fingerprint()
        (copy / "softmax.cuh").write_text((copy / "softmax.cuh").read_text() + "\n// edited\n")
        _source.fingerprint.cache_clear()
        assert _source.fingerprint() != before
    finally:
        _source.kernel_dir.cache_clear()
        _source.fingerprint.cache_clear()


def test_import_and_cli_without_gpu():
    import subprocess
    import sys

    info = subprocess.run([sys.executable, "-m", "cupyflash", "info"], capture_output=True, text=True, check=True)
    assert "cupyflash" in info.stdout and "kernel sources" in info.stdout
