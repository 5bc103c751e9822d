"""The benchmark harness's host-side pieces (the timings themselves need a GPU)."""

from __future__ import annotations

import pytest

from cupyflash import bench


@pytest.mark.parametrize("seed", range(5))
def test_varlen_lengths_fill_the_batch_within_bounds(seed):
    lengths = bench.varlen_lengths(total=10000, shortest=100, longest=3000, seed=seed)
    assert sum(lengths) == 10000
    assert all(1 <= n <= 3000 for n in lengths)
    assert all(n >= 100 for n in lengths[:-1])  # only the last one is cut short
    assert bench.varlen_lengths(total=10000, shortest=100, longest=3000, seed=seed) == lengths


def test_varlen_flops_count_each_sequence_alone():
    shape = bench.VarlenShape((3, 5), heads=2, head_dim=4, causal=False)
    assert shape.flops == 4.0 * 2 * 4 * (3 * 3 + 5 * 5)
    assert bench.VarlenShape((3, 5), 2, 4, causal=True).flops == shape.flops / 2


def test_runnable_keeps_the_calls_that_run_and_names_the_refusals():
    def refuse():
        raise ValueError("head_dim 512 not supported\nmore")

    row: dict = {}
    calls = bench.runnable({"ok": lambda: 1, "no": refuse}, row)
    assert list(calls) == ["ok"]
    assert row == {"no": None, "no_error": "head_dim 512 not supported"}


def test_host_times_are_per_call_medians_on_the_host_clock(monkeypatch):
    """host_times_ms runs cuda_times_ms's rounds on the host clock: a sample of several calls
    gives the per-call time (here on a fake clock that each call advances by its cost)."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def costs(seconds: float):
        def call() -> None:
            clock[0] += seconds

        return call

    times = bench.host_times_ms({"short": costs(0.002), "long": costs(0.006)}, warmup_ms=0.0, repeat=3, calls=4)
    assert times == {"short": pytest.approx(2.0), "long": pytest.approx(6.0)}
