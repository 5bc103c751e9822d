"""``batch_invariant=True`` on the CPU: the planner splits each sequence at the same keys (how
many splits, where, in which merge order) whatever else is in the batch, where it sits, how large
the cache is or how it is paged; the host twin splits at the same keys; the flag is part of the
plans' keys, travels through every route and is refused beside ``num_splits``; the host path's
result for a sequence is bit-identical across batch compositions. The kernels' bits are
test_gpu_batch_invariant.py's; their compile, test_compile.py's sample."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import _attention, _device, _dispatch, _host, _interop, _kvcache, _launch, _plan
from cupyflash._fp8 import Fp8Cache
from cupyflash._specs import DecodeSpec
from cupyflash._validate import Options, attention_problem, kvcache_problem

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from host_overhead import stand_in  # noqa: E402

H200 = _device.HOPPER
A100 = _device.DeviceInfo(0, "sm_80", 108, 166912, 167936, 65536, 2048, 32)
SPLIT = _dispatch.BATCH_INVARIANT_SPLIT_KEYS
COMPOSITIONS = 20


def _plan_cache_call(lengths, capacity, page_size=0, *, batch_invariant=True, device=H200, heads=(32, 8), d=128,
                     nq=1, fp8=False, num_splits=0):  # fmt: skip
    """The plan of one cache call over ``lengths`` (one int32 cache_seqlens array), a contiguous
    cache of ``capacity`` keys per sequence, or pages of ``page_size`` keys (a table row covering
    ``capacity``)."""
    b, (hq, hkv) = len(lengths), heads
    table = None
    if page_size:
        per_seq = -(-capacity // page_size)
        cache = (b * per_seq + 3, page_size, hkv, d)
        table = (b, per_seq)
    else:
        cache = (b, capacity, hkv, d)
    kp = kvcache_problem(
        (b, nq, hq, d), cache, cache, cache_seqlens=np.asarray(lengths, np.int32), block_table_shape=table,
        k_new_shape=None, v_new_shape=None, causal=True, scale=None,
    )  # fmt: skip
    dtypes = {"q": "bfloat16", "cache_seqlens": "int32", **({"block_table": "int32"} if table else {})}
    return _plan.plan_kvcache(
        kp, dtypes, device, num_splits=num_splits, batch_invariant=batch_invariant,
        fp8=Fp8Cache("e4m3") if fp8 else None,
    )  # fmt: skip


def _decode_step(launch):
    (step,) = [s for s in launch.steps if isinstance(s.spec, DecodeSpec)]
    return step


def _expected(length: int) -> tuple[tuple[int, int], ...]:
    """ceil(L / SPLIT) splits (one for an empty sequence), keys [SPLIT s, SPLIT (s + 1)), in order."""
    return tuple((s, min(s + SPLIT, length)) for s in range(0, max(length, 1), SPLIT))


def _lengths(rng: np.random.Generator, b: int) -> list[int]:
    """b lengths in 1 .. 40k, log-uniform (short and long ones alike), with the split's edges mixed in."""
    lengths = np.exp(rng.uniform(0, np.log(40_000), size=b)).astype(int).clip(1, 40_000).tolist()
    edges = [1, SPLIT - 1, SPLIT, SPLIT + 1, 2 * SPLIT, 40_000]
    for i in rng.choice(b, size=min(b, 2), replace=False):
        lengths[i] = int(rng.choice(edges))
    return lengths


@pytest.mark.parametrize("device", [H200, A100], ids=["sm_90a", "sm_80"])
def test_each_sequence_is_split_alike_in_every_batch(device):
    """20 random batches (B 1..64, lengths 1..40k; contiguous, page sizes 1 and 16; spare
    capacity; a float8 cache; 1 and 4 query tokens): every sequence's splits -- their count,
    their key ranges and the order they merge in -- are those of the same sequence alone in a
    cache of its own size, and ceil(L / 4096) ranges of 4096 keys; the kernel variant, its
    block and shared memory are the same too (nothing else of the launch reaches a CTA's
    arithmetic but pointers and the launch's split count, which the kernel does not use)."""
    rng = np.random.default_rng(41)
    for composition in range(COMPOSITIONS):
        b = int(rng.integers(1, 65))
        lengths = _lengths(rng, b)
        page_size = (0, 1, 16)[composition % 3]
        capacity = max(lengths) + int(rng.integers(0, 3 * SPLIT))
        options = {"fp8": composition % 4 == 3, "nq": 4 if composition % 5 == 4 else 1}
        launch = _plan_cache_call(lengths, capacity, page_size, device=device, **options)
        step = _decode_step(launch)
        assert step.spec.batch_invariant
        assert launch.params.value("blocks_per_split") * step.spec.tile.block_n == SPLIT
        # the host twin splits at the same keys
        assert _host.kvcache_split_keys(capacity, 0, batch_invariant=True) == SPLIT
        for position in rng.permutation(b)[:8]:
            length = lengths[position]
            ranges = _plan.split_ranges(launch, length)
            assert ranges == _expected(length), (composition, position, length)
            alone = _plan_cache_call([length], max(length, 1), page_size, device=device, **options)
            assert _plan.split_ranges(alone, length) == ranges
            alone_step = _decode_step(alone)
            assert (alone_step.spec, alone_step.block, alone_step.smem) == (step.spec, step.block, step.smem)


def test_the_default_splits_by_the_batch():
    """What the flag removes: without it one sequence of 20k keys is split otherwise as the
    batch around it grows (the occupancy model), and by the cache's capacity."""
    length = 20_000
    ranges = {
        b: _plan.split_ranges(_plan_cache_call([length] * b, length, batch_invariant=False), length) for b in (1, 8, 64)
    }
    assert len(set(ranges.values())) == 3, ranges
    wider = _plan.split_ranges(_plan_cache_call([length], 4 * length, batch_invariant=False), length)
    assert wider != ranges[1]
    assert {_plan.split_ranges(_plan_cache_call([length] * b, length), length) for b in (1, 8, 64)} == {
        _expected(length)
    }


def test_dense_decode_splits_do_not_follow_the_batch():
    """attention's decode route (one query token) with the flag: the same splits at every batch size."""

    def plan(b: int, batch_invariant: bool):
        p = attention_problem((b, 1, 32, 128), (b, 30_000, 8, 128), (b, 30_000, 8, 128), causal=False, scale=None,
                              window=(-1, -1), softcap=0.0, layout="bshd")  # fmt: skip
        launch = _plan.plan_attention(p, "bfloat16", H200, "auto", (b, 1, 32, 128), batch_invariant=batch_invariant)
        return _plan.split_ranges(launch, 30_000)

    assert {plan(b, True) for b in (1, 3, 64)} == {_expected(30_000)}
    assert len({plan(b, False) for b in (1, 3, 64)}) > 1


def test_split_size_fits_every_decode_tile():
    """4096 keys are whole CTA steps of every decode tile (16-bit and float8 caches)."""
    for tiles in (*_dispatch.DECODE_TILES.values(), *_dispatch.FP8_DECODE_TILES.values()):
        for tile in tiles:
            assert SPLIT % tile.block_n == 0, tile


def test_num_splits_with_batch_invariant_is_refused(monkeypatch):
    """On the host, on the GPU route (before anything is planned), in the planner, and under
    torch.compile (checked with the other options, before the route hands the call to the custom
    op); a flag that is not a bool too."""
    q = np.zeros((2, 1, 4, 16), np.float32)
    cache = np.zeros((2, 8, 2, 16), np.float32)
    with pytest.raises(ValueError, match="num_splits and batch_invariant=True exclude each other"):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=3, num_splits=2, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=3, batch_invariant="yes")
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        cupyflash.attention(q, cache, cache, batch_invariant=1)
    with pytest.raises(ValueError, match="exclude each other"):
        _plan_cache_call([5, 7], 64, num_splits=3)
    _stub_gpu(monkeypatch)
    q_gpu, cache_gpu = stand_in((2, 1, 32, 128), "float16"), stand_in((2, 4096, 8, 128), "float16")
    with pytest.raises(ValueError, match="exclude each other"):
        cupyflash.attention_with_kvcache(q_gpu, cache_gpu, cache_gpu, cache_seqlens=3, num_splits=1,
                                         batch_invariant=True)  # fmt: skip
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    tq, tcache = torch.from_numpy(q), torch.from_numpy(cache)
    step = torch.compile(
        lambda q: cupyflash.attention_with_kvcache(q, tcache, tcache, cache_seqlens=3, num_splits=4,
                                                   batch_invariant=True),
        fullgraph=True,
    )  # fmt: skip
    with pytest.raises(Exception, match="exclude each other"):
        step(tq)


# ---------------------------------------------------------------------------------------------
# The GPU routes up to the launch, without a GPU (as test_gpu_routes_stubbed.py).
# ---------------------------------------------------------------------------------------------
def _stub_gpu(monkeypatch):
    """Stand-in CuPy arrays on GPU 0 of an H100; returns the launches handed to ``_launch.run``."""
    seen: list[object] = []

    def run(launch, lib, device, arrays, want_lse, given=_launch.EMPTY):
        seen.append(launch)
        return "out", ("lse" if want_lse else None)

    info = H200
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_launch, "run", run)
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    monkeypatch.setattr(_interop, "stream_is_capturing", lambda stream: False)
    monkeypatch.setattr(_interop.CupyLib, "stream", lambda self, device: 0)
    return seen


def _specs(launch) -> list:
    return [step.spec for step in launch.steps if hasattr(step, "spec")]


def test_the_flag_is_part_of_the_plan_key(monkeypatch):
    """The cache call with and without the flag: two plans (the batch-invariant kernel, splits
    of 4096 keys), each found again by its own key; a launch of 64 sequences over a 40k cache
    holds ceil(40k / 4096) splits whatever the occupancy would pick."""
    seen = _stub_gpu(monkeypatch)
    _kvcache._plans.clear()
    q, cache = stand_in((64, 1, 32, 128), "bfloat16"), stand_in((64, 40_000, 8, 128), "bfloat16")
    seqlens = stand_in((64,), "int32")
    for flag in (False, True, False, True):
        cupyflash.attention_with_kvcache(q, cache, cache, cache_seqlens=seqlens, batch_invariant=flag)
    default, invariant, default_again, invariant_again = seen
    assert default is default_again and invariant is invariant_again and default is not invariant
    assert not _decode_step(default).spec.batch_invariant and _decode_step(invariant).spec.batch_invariant
    assert invariant.params.value("num_splits") == -(-40_000 // SPLIT)
    assert default.params.value("num_splits") == 1  # 512 CTAs already fill the GPU: no split
    # more than 16 query tokens run the FA2 kernel over the cache, which splits no keys: the flag changes nothing
    q_many = stand_in((64, 20, 32, 128), "bfloat16")
    for flag in (False, True):
        cupyflash.attention_with_kvcache(q_many, cache, cache, cache_seqlens=seqlens, batch_invariant=flag)
    assert _specs(seen[-1]) == _specs(seen[-2]) and _specs(seen[-1])[0].kernel == "fa2_fwd_kvcache"


def test_the_flag_survives_the_calls_copies(monkeypatch):
    """The typed calls are copied by their constructors on the way to the kernels (``prepared``
    with dropout or ALiBi, ``on`` for adopted arrays, a float8 cache's checked host scales): each
    copy keeps the flag, so the plan is the batch-invariant one on every route."""
    x = np.zeros((2, 1, 4, 16), np.float32)
    slopes = np.ones(4, np.float32)
    forward = _attention.Forward(x, x, x, Options(False), dropout_p=0.25, seed=3,
                                 alibi_slopes=slopes, batch_invariant=True)  # fmt: skip
    assert forward.prepared().batch_invariant and forward.on(list(forward.arrays())).batch_invariant
    cu = np.array([0, 1, 2], np.int32)
    varlen = _attention.VarlenForward(x[:, 0], x[:, 0], x[:, 0], cu, cu, 1, 1, Options(False),
                                      dropout_p=0.25, seed=3, batch_invariant=True)  # fmt: skip
    assert varlen.prepared().batch_invariant and varlen.on(list(varlen.arrays())).batch_invariant
    named = dict.fromkeys(_kvcache.KV_NAMES) | {"q": x, "k_cache": x, "v_cache": x, "cache_seqlens": 1}
    cache = _kvcache.cache_call(named, Options(False), batch_invariant=True)
    assert cache.on(list(cache.arrays())).batch_invariant and cache.prepared().batch_invariant
    seen = _stub_gpu(monkeypatch)
    q, fp8_cache = stand_in((8, 1, 32, 128), "float16"), stand_in((8, 9000, 8, 128), "uint8")
    cupyflash.attention_with_kvcache(q, fp8_cache, fp8_cache, cache_seqlens=9000, kv_dtype="e4m3", k_scale=0.5,
                                     batch_invariant=True)  # fmt: skip
    assert _decode_step(seen[-1]).spec.batch_invariant


def test_attention_routes_take_the_flag(monkeypatch):
    """attention: the decode route's batch-invariant kernel, the plan keyed by the flag, the
    Hopper and FA2 kernels unchanged by it, the naive baseline (cuBLAS) refusing it;
    attention_varlen: the Hopper tile not chosen by max_seqlen_k (d = 64, with a bound or
    without; d = 128 has no short-call tile)."""
    seen = _stub_gpu(monkeypatch)
    one = stand_in((4, 1, 32, 128), "bfloat16")
    keys = stand_in((4, 9000, 8, 128), "bfloat16")
    cupyflash.attention(one, keys, keys)
    cupyflash.attention(one, keys, keys, batch_invariant=True)
    assert not _specs(seen[-2])[0].batch_invariant and _specs(seen[-1])[0].batch_invariant
    assert _plan.split_ranges(seen[-1], 9000) == _expected(9000)
    prefill = stand_in((2, 300, 8, 128), "bfloat16")
    kv = stand_in((2, 333, 2, 128), "bfloat16")
    for algorithm in ("auto", "fa2"):
        cupyflash.attention(prefill, kv, kv, causal=True, algorithm=algorithm)
        cupyflash.attention(prefill, kv, kv, causal=True, algorithm=algorithm, batch_invariant=True)
        assert _specs(seen[-1]) == _specs(seen[-2])
    with pytest.raises(ValueError, match="cuBLAS"):
        cupyflash.attention(prefill, kv, kv, algorithm="naive", batch_invariant=True)
    q = stand_in((3000, 8, 64), "bfloat16")
    packed = stand_in((6000, 8, 64), "bfloat16")
    cu = stand_in((4,), "int32")
    cupyflash.attention_varlen(q, packed, packed, cu, cu, 1500, 1500)
    cupyflash.attention_varlen(q, packed, packed, cu, cu, 1500, 1500, batch_invariant=True)
    short, general = _specs(seen[-2])[-1], _specs(seen[-1])[-1]  # (packed: after the rows no sequence owns)
    assert short.tile == _dispatch.FA3_SHORT_FWD_TILES[(64, False)]
    assert general.tile == _dispatch.FA3_FWD_TILES[(64, False)]
    cupyflash.attention_varlen(q, packed, packed, cu, cu, 1500, 4000, batch_invariant=True)
    assert _specs(seen[-1])[-1] == general  # whatever the batch's longest sequence
    for flag in (False, True):
        cupyflash.attention_varlen(q, packed, packed, cu, cu, 1500, 1500, causal=True, batch_invariant=flag)
    short, general = _specs(seen[-2])[-1], _specs(seen[-1])[-1]  # causal d = 64 has a short-call tile too
    assert short.tile == _dispatch.FA3_SHORT_FWD_TILES[(64, True)] and short.causal
    assert general.tile == _dispatch.FA3_FWD_TILES[(64, True)] and general.causal
    prefill = stand_in((3000, 8, 128), "bfloat16")  # d = 128: no short-call tile, the flag changes nothing
    for flag in (False, True):
        cupyflash.attention_varlen(prefill, prefill, prefill, cu, cu, 1500, 1500, batch_invariant=flag)
    assert _specs(seen[-1]) == _specs(seen[-2])


# ---------------------------------------------------------------------------------------------
# The host path: the same sequence, the same bits, in any batch.
# ---------------------------------------------------------------------------------------------
def test_host_cache_call_is_bit_identical_across_batches():
    """20 random batches (B 1..6, lengths 1..10k: up to three splits; contiguous with spare
    capacity, or page sizes 1 and 16; the sequence at a random place), each sequence's output
    and LSE against the same sequence alone in a cache of its own size: equal bit for bit, and
    close to the reference."""
    rng = np.random.default_rng(7)
    hq, hkv, d = 4, 2, 16
    for composition in range(COMPOSITIONS):
        b = int(rng.integers(1, 7))
        lengths = np.exp(rng.uniform(0, np.log(10_000), size=b)).astype(int).clip(1, 10_000).tolist()
        capacity = max(lengths) + int(rng.integers(0, 2000))
        page_size = (0, 1, 16)[composition % 3]
        q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, capacity, hkv, d)).astype(np.float32) for _ in "kv")
        out, lse = _host_call(q, k, v, lengths, page_size, rng)
        for i in rng.permutation(b)[:3]:
            n = lengths[i]
            alone_out, alone_lse = _host_call(q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n], [n], 0, rng)
            assert np.array_equal(out[i : i + 1], alone_out), (composition, i, n)
            assert np.array_equal(lse[i : i + 1], alone_lse), (composition, i, n)
        if composition < 3:  # the reference, now and then (the bits are the point here)
            from helpers import kv_reference

            ref, ref_lse = kv_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), lengths, True)
            np.testing.assert_allclose(out, ref, atol=2e-5)
            np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def _host_call(q, k, v, lengths, page_size, rng):
    table = None
    if page_size:
        from helpers import paginate

        (k, v), table = paginate(rng, (k, v), page_size)
    return cupyflash.attention_with_kvcache(
        q, k, v, cache_seqlens=np.asarray(lengths, np.int32), block_table=table, return_lse=True, batch_invariant=True
    )


def test_host_attention_is_bit_identical_across_batches():
    """attention on the host: no algorithm splits by the batch (``"decode"`` at the GPU's 4096
    keys with the flag), so a sequence's bits are its own in any batch and at any place."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 2, 8, 32)).astype(np.float32)
    k, v = (rng.standard_normal((5, 9000, 2, 32)).astype(np.float32) for _ in "kv")
    for algorithm in ("auto", "decode"):
        out, lse = cupyflash.attention(q, k, v, causal=True, algorithm=algorithm, return_lse=True,
                                       batch_invariant=True)  # fmt: skip
        for order in ([3], [4, 0, 3], [1, 2, 3, 0]):
            part, part_lse = cupyflash.attention(q[order], k[order], v[order], causal=True, algorithm=algorithm,
                                                 return_lse=True, batch_invariant=True)  # fmt: skip
            at = order.index(3)
            assert np.array_equal(part[at], out[3]) and np.array_equal(part_lse[at], lse[3]), (algorithm, order)


def test_the_flag_travels_through_torch_compile_and_jax(monkeypatch):
    """The cache call and attention's decode algorithm under torch.compile (the custom ops) and
    jax.jit (the custom call, its host callback on JAX's CPU backend) reach the host path with
    the flag: splits of 4096 keys, the eager call's bits."""
    seen: list[bool] = []
    real = _host.kvcache_split_keys

    def recording(capacity, num_splits, batch_invariant=False):
        seen.append(batch_invariant)
        return real(capacity, num_splits, batch_invariant)

    monkeypatch.setattr(_host, "kvcache_split_keys", recording)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 9000, 2, 16)).astype(np.float32) for _ in "kv")
    lengths = np.array([8999, 5000], np.int32)
    want = cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=lengths, batch_invariant=True)
    assert seen == [True]
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    tq, tk, tv, tlen = (torch.from_numpy(x) for x in (q, k, v, lengths))

    def step(q, k, v):
        return cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=tlen, batch_invariant=True)

    got = torch.compile(step, fullgraph=True)(tq, tk, tv)
    assert seen[-1] is True and torch.equal(got, step(tq, tk, tv))  # (torch's own host bits: not NumPy's)

    def dense(q, k, v):
        return cupyflash.attention(q, k, v, algorithm="decode", batch_invariant=True)

    assert torch.equal(torch.compile(dense, fullgraph=True)(tq, tk, tv), dense(tq, tk, tv))
    eager_dense = dense(q, k, v)
    jax = pytest.importorskip("jax")
    cpu = jax.devices("cpu")[0]
    jq, jk, jv, jlen = (jax.device_put(x, cpu) for x in (q, k, v, lengths))
    seen.clear()
    jitted = jax.jit(lambda q, k, v, n: cupyflash.attention_with_kvcache(q, k, v, cache_seqlens=n,
                                                                          batch_invariant=True))  # fmt: skip
    assert np.array_equal(np.asarray(jitted(jq, jk, jv, jlen)), want) and seen == [True]
    jitted_dense = jax.jit(lambda q, k, v: cupyflash.attention(q, k, v, algorithm="decode", batch_invariant=True))
    assert np.array_equal(np.asarray(jitted_dense(jq, jk, jv)), eager_dense)
