"""The benchmark harness's host-side pieces (the timings themselves need a GPU)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types

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


# ---------------------------------------------------------------------------------------------
# The three timings of a speed claim, on a fake clock.
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def fake_clock(monkeypatch):
    """bench's host clock made a counter that each stand-in call advances by its cost; a call's
    cost may depend on the call before it (a kernel inheriting its neighbour's clocks)."""
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    return clock


def test_three_timings_are_each_function_alone_back_to_back_and_interleaved(fake_clock):
    """ "b" runs 6 ms after itself and 9 ms after "a" (it inherits a's clocks): alone (single, and
    20 back-to-back calls a sample) it measures its own 6 ms, interleaved with "a" mostly 9 --
    the disagreement the three timings exist to show. "a" costs 2 ms wherever it runs."""
    calls = {"a": 0, "b": 0}
    last = [""]

    def stand_in(name: str):
        def call() -> None:
            calls[name] += 1
            fake_clock[0] += 0.002 if name == "a" else (0.009 if last[0] == "a" else 0.006)
            last[0] = name

        return call

    times = bench.three_timings_ms(
        {"a": stand_in("a"), "b": stand_in("b")}, repeat=9, warmup_ms=0.0, times_ms=bench.host_times_ms
    )
    assert list(times) == ["single", "back_to_back", "interleaved"]
    assert times["single"] == {"a": pytest.approx(2.0), "b": pytest.approx(6.0)}
    assert times["back_to_back"] == {"a": pytest.approx(2.0), "b": pytest.approx(6.0)}
    assert times["interleaved"] == {"a": pytest.approx(2.0), "b": pytest.approx(9.0)}
    # per function: single 1 warm-up + 9 samples; back-to-back 1 + 3 samples of 20; interleaved 1 + 9
    assert calls == {"a": 10 + 61 + 10, "b": 10 + 61 + 10}


def test_three_timings_run_the_timings_asked_for_and_refuse_others(fake_clock):
    def call() -> None:
        fake_clock[0] += 0.001

    times = bench.three_timings_ms({"f": call}, repeat=3, warmup_ms=0.0, timings=("back_to_back",),
                                   times_ms=bench.host_times_ms)  # fmt: skip
    assert times == {"back_to_back": {"f": pytest.approx(1.0)}}
    for wrong in ((), ("single", "warm")):
        with pytest.raises(ValueError, match="timings must be some of"):
            bench.three_timings_ms({"f": call}, timings=wrong, times_ms=bench.host_times_ms)


def test_record_timings_keeps_the_interleaved_timing_as_the_rows_number():
    """row[name] and row[name_ms] (what asv and the scripts read) are the interleaved timing's;
    without it, the first timing's; every timing's TFLOP/s under row["timings"]."""
    ms = {"single": {"a": 2.0, "b": 4.0}, "interleaved": {"a": 2.5, "b": 5.0}}
    row: dict = {}
    bench.record_timings(row, ms, lambda name: 1e10 if name == "a" else 4e10)
    assert row["timing"] == "interleaved"
    assert (row["a"], row["a_ms"], row["b"], row["b_ms"]) == (4.0, 2.5, 8.0, 5.0)
    assert row["timings"] == {"single": {"a": 5.0, "b": 10.0}, "interleaved": {"a": 4.0, "b": 8.0}}
    row = {}
    bench.record_timings(row, {"back_to_back": {"a": 1.0}, "single": {"a": 2.0}}, lambda name: 1e10)
    assert (row["timing"], row["a"], row["a_ms"]) == ("back_to_back", 10.0, 1.0)


# ---------------------------------------------------------------------------------------------
# FlashAttention-4 as a peer: present (a stand-in package), absent, or cupyflash in disguise.
# ---------------------------------------------------------------------------------------------
#: A stand-in for flash-attn-4's flash_attn.cute: bshd in and out, an LSE beside the output.
FAKE_FA4 = """
import torch


def flash_attn_func(q, k, v, causal=False, softmax_scale=None):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2), torch.zeros(qt.shape[:3])
"""


def _is_flash_attn(name: str) -> bool:
    return name == "flash_attn" or name.startswith("flash_attn.")


@pytest.fixture()
def no_flash_attn():
    """sys.modules without any flash_attn during the test, as it was after it (a test imports
    its own, or cupyflash.flash_attn.install() registers cupyflash's)."""
    saved = {name: module for name, module in sys.modules.items() if _is_flash_attn(name)}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [name for name in sys.modules if _is_flash_attn(name)]:
        del sys.modules[name]
    sys.modules.update(saved)


def _package(root, monkeypatch, cute_source: str) -> None:
    """A flash_attn package with flash_attn/cute/__init__.py = ``cute_source`` first on sys.path."""
    (root / "flash_attn" / "cute").mkdir(parents=True)
    (root / "flash_attn" / "__init__.py").write_text("")
    (root / "flash_attn" / "cute" / "__init__.py").write_text(cute_source)
    monkeypatch.syspath_prepend(str(root))


def test_fa4_absent_marks_the_row(no_flash_attn):
    sys.modules["flash_attn"] = None  # not importable here, installed or not
    with pytest.raises(ImportError, match="^flash_attn.cute is not installed$"):
        bench.fa4_attention()
    row: dict = {}
    assert bench.runnable({"fa4": bench.peer_call("fa4", None, None, None, causal=False)}, row) == {}
    assert row == {"fa4": None, "fa4_error": "flash_attn.cute is not installed"}


def test_fa4_refuses_cupyflash_registered_as_flash_attn(no_flash_attn):
    import cupyflash.flash_attn

    cupyflash.flash_attn.install()
    try:
        with pytest.raises(RuntimeError, match=r"flash_attn is cupyflash.flash_attn .*uninstall\(\)"):
            bench.fa4_attention()
        row: dict = {}
        bench.runnable({"fa4": bench.peer_call("fa4", None, None, None, causal=False)}, row)
        assert row["fa4"] is None and "cupyflash.flash_attn.install()" in row["fa4_error"]
    finally:
        cupyflash.flash_attn.uninstall()


def test_fa4_refuses_a_flash_attn_cute_that_is_cupyflash(no_flash_attn, tmp_path, monkeypatch):
    """By the function's module (a package re-exporting cupyflash's), by the module's name (an
    alias in sys.modules) and by the module's file (inside the cupyflash package)."""
    import cupyflash.flash_attn

    _package(tmp_path, monkeypatch, "from cupyflash.flash_attn import flash_attn_func\n")
    with pytest.raises(RuntimeError, match="flash_attn.cute resolves into cupyflash .*cupyflash.flash_attn"):
        bench.fa4_attention()
    sys.modules["flash_attn.cute"] = cupyflash.flash_attn
    with pytest.raises(RuntimeError, match="resolves into cupyflash"):
        bench.fa4_attention()
    copy = types.ModuleType("flash_attn.cute")
    copy.__file__ = cupyflash.flash_attn.__file__
    copy.flash_attn_func = lambda *args, **kwargs: None
    sys.modules["flash_attn.cute"] = copy
    with pytest.raises(RuntimeError, match="resolves into cupyflash"):
        bench.fa4_attention()


def test_fa4_call_returns_the_output_of_flash_attn_cute(no_flash_attn, tmp_path, monkeypatch):
    """The stand-in package is taken (not cupyflash's module), its output kept and its LSE
    dropped, at cupyflash's scale, on bshd tensors."""
    torch = pytest.importorskip("torch")
    import cupyflash

    _package(tmp_path, monkeypatch, FAKE_FA4)
    assert bench.fa4_attention().__module__ == "flash_attn.cute"
    q, k, v = (torch.randn(2, 33, 3, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = bench.fa4_call(q, k, v, causal=True)()
    assert out.shape == q.shape
    torch.testing.assert_close(out, cupyflash.attention(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="has no dropout"):
        bench.fa4_call(q, k, v, causal=True, dropout_p=0.1)()


# ---------------------------------------------------------------------------------------------
# run_prefill / run_training on the CPU: torch CPU tensors, the host clock for CUDA events.
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def on_the_host(monkeypatch):
    """bench's CUDA inputs, timer and memory probe replaced by CPU ones (small and quick)."""
    torch = pytest.importorskip("torch")

    def inputs(shape, seed=0):
        gen = torch.Generator().manual_seed(seed)
        dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
        return tuple(torch.randn(dims, generator=gen) for _ in range(3))

    def times_ms(fns, *, warmup_ms=0.0, repeat=2, calls=1):
        return bench.host_times_ms(fns, warmup_ms=0.0, repeat=2, calls=calls)

    monkeypatch.setattr(bench, "prefill_inputs", inputs)
    monkeypatch.setattr(bench, "cuda_times_ms", times_ms)
    monkeypatch.setattr(bench, "extra_mib", lambda call: (call(), 0.0)[1])
    return bench.PrefillShape(1, 64, 2, 16, True, "float32")


def test_run_prefill_without_fa4_marks_it_and_times_the_rest(on_the_host, no_flash_attn):
    sys.modules["flash_attn"] = None
    row = bench.run_prefill(on_the_host, backends=("cupyflash", "fa4"))
    assert row["fa4"] is None and row["fa4_error"] == bench.FA4_MISSING
    assert list(row["timings"]) == list(bench.TIMINGS) and row["timing"] == "interleaved"
    assert all(list(by_name) == ["cupyflash"] for by_name in row["timings"].values())
    assert row["cupyflash"] == row["timings"]["interleaved"]["cupyflash"]  # TFLOP/s (0.0 at this size, on the CPU)
    assert row["cupyflash_ms"] > 0
    assert "fa4" in bench.format_prefill_table([row]).splitlines()[0]


def test_training_times_alibi_beside_the_same_call_without_it(on_the_host):
    """bench-train's cupyflash_alibi: cupyflash with the standard ALiBi slopes (2^(-8 i / H)) on
    the same leaves, timed forward + backward and backward alone beside the call without them."""
    import torch

    import cupyflash

    row = bench.run_training(on_the_host, backends=("cupyflash", "cupyflash_alibi"), timings=("interleaved",))
    timed = {"cupyflash", "cupyflash_bwd", "cupyflash_alibi", "cupyflash_alibi_bwd"}
    assert set(row["timings"]["interleaved"]) == timed
    q, k, v = bench.prefill_inputs(on_the_host)
    slopes = torch.tensor([2.0**-4, 2.0**-8])  # H = 2
    torch.testing.assert_close(bench.alibi_slopes(2, "cpu"), slopes)
    got = bench._training_call("cupyflash_alibi", q, k, v, True, 0.0)()
    torch.testing.assert_close(got, cupyflash.attention(q, k, v, causal=True, alibi_slopes=slopes))
    assert not torch.allclose(got, cupyflash.attention(q, k, v, causal=True))


def test_run_prefill_and_training_time_fa4_beside_cupyflash(on_the_host, no_flash_attn, tmp_path, monkeypatch):
    _package(tmp_path, monkeypatch, FAKE_FA4)
    row = bench.run_prefill(on_the_host, backends=("cupyflash", "fa4"), timings=("single", "interleaved"))
    assert "fa4_error" not in row and row["fa4_ms"] > 0 and isinstance(row["fa4"], float)
    assert list(row["timings"]) == ["single", "interleaved"]
    assert all(set(by_name) == {"cupyflash", "fa4"} for by_name in row["timings"].values())
    row = bench.run_training(on_the_host, backends=("cupyflash", "fa4"), timings=("back_to_back",))
    assert row["timing"] == "back_to_back" and set(row["timings"]) == {"back_to_back"}
    assert set(row["timings"]["back_to_back"]) == {"cupyflash", "cupyflash_bwd", "fa4", "fa4_bwd"}
    assert row["fa4"] == row["timings"]["back_to_back"]["fa4"] and row["fa4_bwd_ms"] > 0
    assert row["fa4_extra_mib"] == 0.0
    dropout = bench.run_training(on_the_host, backends=("fa4",), dropout_p=0.1, timings=("interleaved",))
    assert dropout["fa4"] is None and dropout["fa4_error"] == "flash_attn.cute has no dropout"


def test_run_batch_invariant_decode_times_the_flag_beside_the_default(on_the_host, monkeypatch):
    """The cost row of batch_invariant=True: both calls (and the wide table's, paged) under each
    timing, their cost ratios, and one line of the table per row; on torch CPU tensors."""
    torch = pytest.importorskip("torch")

    def inputs(shape, seed=0):
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(shape.batch, 1, shape.heads_q, shape.head_dim, generator=gen)
        k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim, generator=gen) for _ in "kv")
        return q, k, v, torch.full((shape.batch,), shape.seqlen, dtype=torch.int32)

    monkeypatch.setattr(bench, "decode_inputs", inputs)
    shape = bench.DecodeShape(2, 64, heads_q=4, heads_kv=2, head_dim=16, dtype="float32")
    rows = [bench.run_batch_invariant_decode(shape, page_size, repeat=2) for page_size in (0, 16)]
    contiguous, paged = rows
    assert set(contiguous["timings"]) == set(bench.TIMINGS)
    assert all(set(t) == {"default", "invariant"} for t in contiguous["timings"].values())
    assert all(set(t) == {"default", "invariant", "default_wide", "invariant_wide"} for t in paged["timings"].values())
    for timing in bench.TIMINGS:
        assert contiguous[f"cost_{timing}"] > 0 and paged[f"wide_cost_{timing}"] > 0
        assert f"wide_cost_{timing}" not in contiguous
    assert contiguous["max_abs_diff"] < 1e-5  # the host path: the same algorithm, other split points
    table = bench.format_batch_invariant_table(rows).splitlines()
    assert len(table) == 2 and "page= 0" in table[0] and "wide table -" in table[0] and "page=16" in table[1]
    assert all(b * n >= 4096 and b * n <= bench.DECODE_MAX_TOKENS for b, n in bench.BATCH_INVARIANT_SHAPES)


def test_run_tree_decode_times_the_tree_beside_causal_and_sdpa(on_the_host, monkeypatch):
    """The speculative-decoding row: the tree, the causal chain and SDPA with the tree as a boolean
    attn_mask under each timing, the tree's cost and speedup, and its agreement with SDPA; on torch
    CPU tensors (the host path)."""
    torch = pytest.importorskip("torch")

    def inputs(shape, seed=0):
        gen = torch.Generator().manual_seed(seed)
        k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads_kv, shape.head_dim, generator=gen) for _ in "kv")
        return None, k, v, torch.full((shape.batch,), shape.seqlen, dtype=torch.int32)

    monkeypatch.setattr(bench, "decode_inputs", inputs)
    shape = bench.DecodeShape(2, 64, heads_q=4, heads_kv=2, head_dim=16, dtype="float32")
    rows = [bench.run_tree_decode(shape, drafts, repeat=2) for drafts in (1, 4)]
    for row in rows:
        assert set(row["timings"]) == set(bench.TIMINGS)
        assert all(set(t) == {"tree", "causal", "sdpa_mask"} for t in row["timings"].values())
        # (speedup: SDPA's us over the tree's, which the host path's tree may round to 0.00 on the CPU)
        assert all(row[f"cost_{t}"] > 0 and row[f"speedup_{t}"] >= 0 for t in bench.TIMINGS)
        assert row["max_abs_diff_vs_sdpa"] < 1e-5  # the same tree: the same answer
    table = bench.format_tree_table(rows).splitlines()
    assert len(table) == 2 and "drafts= 1" in table[0] and "drafts= 4" in table[1]
    assert bench.binary_tree_mask(4).tolist() == [
        [True, False, False, False], [True, True, False, False], [True, False, True, False], [True, True, False, True],
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The tables: a ratio as its range over the timings of a row.
# ---------------------------------------------------------------------------------------------
SHAPE = {"dtype": "bfloat16", "head_dim": 128, "seqlen": 4096, "batch": 4, "heads": 16, "causal": False}


def _prefill_row(timings: dict[str, dict[str, float]]) -> dict:
    """A made-up row as run_prefill records it (the interleaved timing, where given, as its numbers)."""
    headline = "interleaved" if "interleaved" in timings else next(iter(timings))
    return {**SHAPE, **timings[headline], "timing": headline, "timings": timings}


def _columns(table: str) -> set[tuple[int, ...]]:
    """The positions of the column separators, per line."""
    return {tuple(i for i, c in enumerate(line) if c == "|") for line in table.splitlines()}


def test_ratio_range_spans_the_timings_of_a_row():
    row = _prefill_row({
        "single": {"cupyflash": 500.0, "cudnn": 700.0},
        "back_to_back": {"cupyflash": 520.0, "cudnn": 720.0},
        "interleaved": {"cupyflash": 504.0, "cudnn": 700.0},
    })  # fmt: skip
    assert bench.ratio_range(row, "cupyflash", "cudnn") == "0.71-0.72x"
    assert bench.ratio_range(row, "cupyflash", "fa4") == "n/a"
    assert bench.ratio_range({"cupyflash": 600.0, "cudnn": 500.0}, "cupyflash", "cudnn") == "1.20x"  # an older row
    same = _prefill_row({"single": {"a": 1.0, "b": 2.0}, "interleaved": {"a": 1.001, "b": 2.0}})
    assert bench.ratio_range(same, "a", "b") == "0.50x"


def test_prefill_table_with_and_without_fa4_and_one_or_three_timings():
    three = _prefill_row({
        "single": {"cupyflash": 610.0, "cupyflash_fa2": 330.0, "flash": 320.0, "cudnn": 600.0, "fa4": 650.0},
        "back_to_back": {"cupyflash": 620.0, "cupyflash_fa2": 335.0, "flash": 322.0, "cudnn": 610.0, "fa4": 655.0},
        "interleaved": {"cupyflash": 600.0, "cupyflash_fa2": 325.0, "flash": 318.0, "cudnn": 598.0, "fa4": 640.0},
    })  # fmt: skip
    one = {**_prefill_row({"interleaved": {"cupyflash": 600.0, "flash": 300.0, "cudnn": 500.0}}), "fa4": None,
           "fa4_error": bench.FA4_MISSING}  # fmt: skip
    table = bench.format_prefill_table([three, one])
    header, with_fa4, without = table.splitlines()
    assert header.split("|")[1].split() == ["cupyflash", "fa2", "flash", "cudnn", "fa4"]
    assert re.split(r"\s{2,}", header.split("|")[2].strip()) == ["vs flash", "vs cudnn", "vs fa4", "fa2/flash"]
    assert with_fa4.split("|")[1].split() == ["600.0", "325.0", "318.0", "598.0", "640.0"]
    assert with_fa4.split("|")[2].split() == ["1.89-1.93x", "1.00-1.02x", "0.94-0.95x", "1.02-1.04x"]
    assert without.split("|")[1].split() == ["600.0", "nan", "300.0", "500.0", "nan"]
    assert without.split("|")[2].split() == ["2.00x", "1.20x", "n/a", "n/a"]
    assert len(_columns(table)) == 1  # one line per shape, the columns aligned
    assert bench.format_refusals([three, one]) == ["fa4: flash_attn.cute is not installed (1 of 2 rows)"]


def test_training_table_with_and_without_fa4():
    def timing(ours: float) -> dict[str, float]:
        return {"cupyflash": ours, "cupyflash_det": 450.0, "flash": 300.0, "cudnn": 560.0, "fa4": 600.0,
                "cupyflash_bwd": 480.0, "flash_bwd": 280.0, "cudnn_bwd": 550.0, "fa4_bwd": 590.0}  # fmt: skip

    three = _prefill_row({"single": timing(500.0), "back_to_back": timing(510.0), "interleaved": timing(520.0)})
    three |= {"cupyflash_extra_mib": 1.5, "flash_extra_mib": 1.5, "cudnn_extra_mib": 2.0, "fa4_extra_mib": 1.0}
    one = _prefill_row({"interleaved": {"cupyflash": 500.0, "cupyflash_det": 450.0, "cudnn": 560.0}})
    table = bench.format_training_table([three, one])
    header, with_fa4, without = table.splitlines()
    assert re.split(r"\s{2,}", header.split("|")[2].strip()) == ["vs flash", "vs cudnn", "vs fa4", "det/ours"]
    assert header.split("|")[1].split() == ["fwd+bwd", "ours", "det", "flash", "cudnn", "fa4"]
    assert with_fa4.split("|")[1].split() == ["520.0", "450.0", "300.0", "560.0", "600.0"]  # interleaved
    assert with_fa4.split("|")[2].split() == ["1.67-1.73x", "0.89-0.93x", "0.83-0.87x", "0.87-0.90x"]
    assert with_fa4.split("|")[3].split() == ["480.0", "280.0", "550.0", "590.0"]
    assert with_fa4.split("|")[4].strip() == "1.5/1.5/2.0/1.0"
    assert without.split("|")[1].split() == ["500.0", "450.0", "nan", "560.0", "nan"]
    assert without.split("|")[2].split() == ["n/a", "0.89x", "n/a", "0.90x"]
    assert len(_columns(table)) == 1


# ---------------------------------------------------------------------------------------------
# python -m cupyflash bench / bench-train: --timings and --backends.
# ---------------------------------------------------------------------------------------------
@pytest.fixture()
def cli(monkeypatch):
    """The command line with a GPU pretended and every measurement recorded and made up."""
    from cupyflash import __main__ as cli

    seen: list[tuple] = []

    def row(shape, backends, timings):
        seen.append((shape.head_dim, shape.seqlen, shape.causal, backends, timings))
        made_up = {"cupyflash": 600.0, "cudnn": 500.0}
        return {**dataclasses.asdict(shape), **made_up, "fa4": None, "fa4_error": bench.FA4_MISSING,
                "timing": timings[0], "timings": {t: made_up for t in timings}}  # fmt: skip

    monkeypatch.setattr(cli, "_require_gpu", lambda command: True)
    monkeypatch.setattr(bench, "run_prefill", lambda shape, backends, timings: row(shape, backends, timings))
    monkeypatch.setattr(
        bench, "run_training", lambda shape, backends, dropout_p, timings: row(shape, backends, timings)
    )
    monkeypatch.setattr(bench, "host_overhead_us", lambda: {"sdpa_us": 15.0})
    return cli.main, seen


@pytest.mark.parametrize("command", ["bench", "bench-train"])
def test_cli_passes_timings_and_backends_and_notes_the_missing_peer(cli, command, tmp_path, capsys):
    main, seen = cli
    shapes = ["--quick", "--dtype", "bfloat16", "--head-dims", "128"]
    out = tmp_path / "rows.json"
    chosen = ["--timings", "interleaved", "--backends", "cupyflash", "fa4", "--json", str(out)]
    assert main([command, *shapes, *chosen]) == 0
    assert seen == [(128, 4096, causal, ("cupyflash", "fa4"), ("interleaved",)) for causal in (False, True)]
    printed = capsys.readouterr().out
    assert "TFLOP/s: the interleaved timing; each ratio: its range over interleaved (one process)" in printed
    assert "no number: fa4: flash_attn.cute is not installed (2 of 2 rows)" in printed
    saved = json.loads(out.read_text())
    assert saved["timings"] == ["interleaved"]
    assert [r["causal"] for r in saved["prefill" if command == "bench" else "training"]] == [False, True]
    seen.clear()
    assert main([command, *shapes]) == 0
    defaults = bench.PREFILL_BACKENDS if command == "bench" else bench.TRAINING_BACKENDS
    assert {s[3:] for s in seen} == {(defaults, bench.TIMINGS)} and "fa4" in defaults
    assert "each ratio: its range over single, back_to_back, interleaved" in capsys.readouterr().out
    for wrong in (["--timings", "warm"], ["--backends", "cupyflash", "sdpa"]):
        with pytest.raises(SystemExit):
            main([command, *shapes, *wrong])


def test_the_mods_table_shows_each_peer_s_range_over_the_timings():
    row = {"function": "alibi", "head_dim": 64, "seqlen": 4096, "backward": True, "max_abs_diff_vs_flex": 0.01,
           "over_flex_single": 1.4, "over_flex_interleaved": 1.2, "over_fa4_single": 0.9, "over_fa4_back_to_back": 0.8,
           "fa4_error": "flash_attn.cute is not installed"}  # fmt: skip
    header, line = bench.format_mods_table([row]).splitlines()
    assert "over fa4" in header
    assert "1.20-1.40" in line and "0.80-0.90" in line and line.endswith("0.01")
    assert line.count(" - ") >= 2  # no built-in path, no block mask: dashes
