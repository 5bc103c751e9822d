"""attention_with_shared_prefix (cascade decoding) on the CPU: the host twin against the flat
paged call over each request's prefix pages followed by its own, with groups, appends, several
query tokens, splits of the prefix (forced: the host path runs one) and the refusals; the GPU's
one launch as planned (its tile, its splits, what each CTA of its grid computes and tickets) and
its route up to the launch, with the device stubbed."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

import cupyflash
from cupyflash import _cascade, _device, _dispatch, _interop, _launch, _plan
from cupyflash._specs import DecodeSpec
from cupyflash._validate import kvcache_problem

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from host_overhead import stand_in  # noqa: E402


def _pool_and_tables(rng, page_size, prefix_lens, own_lens, groups, hkv=2, d=16, spare=2):
    """A shuffled page pool holding each group's prefix and each request's own keys (room for
    ``spare`` more tokens), the two-level tables, and the flat table of the same keys."""
    prefix_pages = [-(-n // page_size) for n in prefix_lens]
    own_pages = [-(-(n + spare) // page_size) for n in own_lens]
    total = sum(prefix_pages) + sum(own_pages)
    order = rng.permutation(total).astype(np.int32)
    pool = rng.standard_normal((total, page_size, hkv, d))
    v_pool = rng.standard_normal((total, page_size, hkv, d))
    taken = iter(order)
    prefix_rows = [[next(taken) for _ in range(n)] for n in prefix_pages]
    own_rows = [[next(taken) for _ in range(n)] for n in own_pages]
    width = max(prefix_pages)
    prefix_table = np.array([r + [0] * (width - len(r)) for r in prefix_rows], dtype=np.int32)
    own_width = max(own_pages)
    own_table = np.array([r + [0] * (own_width - len(r)) for r in own_rows], dtype=np.int32)
    flat = []
    for g in range(len(prefix_lens)):
        for b in range(groups[g], groups[g + 1]):
            # a prefix of whole pages: the flat sequence continues with the request's own pages
            assert prefix_lens[g] % page_size == 0
            flat.append(prefix_rows[g] + own_rows[b])
    flat_width = max(len(r) for r in flat)
    flat_table = np.array([r + [0] * (flat_width - len(r)) for r in flat], dtype=np.int32)
    return pool, v_pool, prefix_table, own_table, flat_table


@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize(("nq", "nnew"), [(1, 0), (1, 1), (3, 3)])
def test_matches_the_flat_paged_call(rng, splits, nq, nnew, monkeypatch):
    monkeypatch.setattr(_cascade, "_host_prefix_splits", lambda keys: splits)
    page_size, groups = 4, [0, 2, 5]
    prefix_lens, own_lens = [24, 12], [3, 0, 7, 1, 5]
    pool, v_pool, prefix_table, own_table, flat_table = _pool_and_tables(rng, page_size, prefix_lens, own_lens, groups)
    b, hq, d = 5, 6, pool.shape[-1]
    q = rng.standard_normal((b, nq, hq, d))
    k_new = v_new = None
    if nnew:
        k_new, v_new = (rng.standard_normal((b, nnew, 2, d)) for _ in range(2))
    seqlens = np.array(own_lens, dtype=np.int32)
    k_flat, v_flat = pool.copy(), v_pool.copy()
    out, lse = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=np.array(prefix_lens, dtype=np.int32),
        block_table=own_table, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, prefix_groups=groups,
        return_lse=True,
    )  # fmt: skip
    per_request = np.repeat(prefix_lens, np.diff(groups)).astype(np.int32)
    want, want_lse = cupyflash.attention_with_kvcache(
        q, k_flat, v_flat, cache_seqlens=seqlens + per_request, block_table=flat_table, k_new=k_new, v_new=v_new,
        return_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    np.testing.assert_array_equal(pool, k_flat)  # the append wrote the same keys into the same pages
    np.testing.assert_array_equal(v_pool, v_flat)


def test_one_group_softcap_non_causal_and_an_empty_prefix(rng):
    page_size = 8
    pool, v_pool, prefix_table, own_table, flat_table = _pool_and_tables(rng, page_size, [16], [5, 9], [0, 2])
    q = rng.standard_normal((2, 2, 2, pool.shape[-1]))
    seqlens = np.array([5, 9], dtype=np.int32)
    options = {"causal": False, "softcap": 3.0, "scale": 0.3}
    out = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=16, block_table=own_table,
        cache_seqlens=seqlens, **options,
    )  # fmt: skip
    want = cupyflash.attention_with_kvcache(q, pool, v_pool, cache_seqlens=seqlens + 16, block_table=flat_table,
                                            **options)  # fmt: skip
    np.testing.assert_allclose(out, want, atol=1e-12)
    # A prefix of no keys: the suffix alone.
    out = cupyflash.attention_with_shared_prefix(
        q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=0, block_table=own_table,
        cache_seqlens=seqlens, **options,
    )  # fmt: skip
    alone = cupyflash.attention_with_kvcache(q, pool, v_pool, cache_seqlens=seqlens, block_table=own_table, **options)
    np.testing.assert_allclose(out, alone, atol=1e-12)


def test_refusals(rng):
    pool, v_pool, prefix_table, own_table, _ = _pool_and_tables(rng, 4, [8, 8], [2, 2, 2], [0, 1, 3])
    q = rng.standard_normal((3, 3, 2, pool.shape[-1]))
    args = {"prefix_block_table": prefix_table, "prefix_seqlens": 8, "block_table": own_table}
    with pytest.raises(ValueError, match="prefix_groups is needed"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, **args)
    with pytest.raises(ValueError, match="offsets from 0 to B"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, prefix_groups=[0, 3], **args)
    with pytest.raises(ValueError, match="must not decrease"):
        cupyflash.attention_with_shared_prefix(q[:, :1], pool, v_pool, cache_seqlens=2, prefix_groups=[0, 4, 3], **args)
    # Three causal query tokens over two keys of its own: the first query may not see the prefix's end.
    with pytest.raises(ValueError, match="fewer than Nq - 1"):
        cupyflash.attention_with_shared_prefix(
            q, pool, v_pool, cache_seqlens=np.array([2, 2, 1], dtype=np.int32), prefix_groups=[0, 1, 3], **args
        )
    with pytest.raises(ValueError, match="must be paged"):
        cupyflash.attention_with_shared_prefix(q, pool[0], v_pool[0], cache_seqlens=2, prefix_groups=[0, 1, 3], **args)


def _merged_parts(out_p, lse_p, splits, dims, packed):
    """The composition's varlen output rearranged by its packing -- packed row t * group + j of KV
    head h is token t at query head h * group + j; else row t of query head h -- to (S, B Nq, Hq, d)
    and (S, B Nq, Hq), and its S parts merged by their LSE: (B, Nq, Hq, d), (B, Hq, Nq)."""
    b, nq, hq, hkv, d = dims
    t, group = b * nq, hq // hkv
    if packed:
        o = out_p.reshape(splits, t, group, hkv, d).transpose(0, 1, 3, 2, 4).reshape(splits, t, hq, d)
        lse = lse_p.reshape(hkv, splits, t, group).transpose(1, 2, 0, 3).reshape(splits, t, hq)
    else:
        o = out_p.reshape(splits, t, hq, d)
        lse = lse_p.reshape(hq, splits, t).transpose(1, 2, 0)
    total = np.logaddexp.reduce(lse, axis=0)
    out = (np.exp(lse - total)[..., None] * o).sum(axis=0)
    return out.reshape(b, nq, hq, d), total.reshape(b, nq, hq).transpose(0, 2, 1)


@pytest.mark.parametrize(("nq", "packed"), [(1, True), (1, False), (3, False)])
def test_the_composition_merge_layout_reads_the_varlen_output_by_its_packing(rng, nq, packed):
    """The strides the composition's one merge launch reads the prefix's S states with
    (parts_layout), walked in NumPy as kernels_cu/decode.cu's decode_merge walks them, against the
    merge of the same varlen output rearranged by its packing."""
    b, hq, hkv, d, splits = 3, 8, 2, 32, 4
    heads, per = (hkv, hq // hkv) if packed else (hq, 1)
    rows = b * nq * per
    out_p = rng.standard_normal((splits * rows, heads, d))
    lse_p = rng.standard_normal((heads, splits * rows))
    lse_p[:, 5] = -np.inf  # a row of a part that saw no key
    want, want_lse = _merged_parts(out_p, lse_p, splits, (b, nq, hq, hkv, d), packed)
    layout = _cascade.parts_layout(splits, (b, nq, hq, hkv, d), packed)
    o_flat, lse_flat = out_p.reshape(-1), lse_p.reshape(-1)
    out, lse = np.zeros(int(np.prod(layout.out_shape))), np.zeros(int(np.prod(layout.lse_shape)))
    (nb, nr, nh, _), (op, ob, orow, oh), (lp, lb, lh) = layout.dims, layout.o_strides, layout.lse_strides
    for i_b in range(nb):
        for i_r in range(nr):
            for i_h in range(nh):
                parts_lse = np.array([lse_flat[p * lp + i_b * lb + i_h * lh + i_r] for p in range(splits)])
                base = i_b * ob + i_r * orow + i_h * oh
                parts = np.stack([o_flat[p * op + base : p * op + base + d] for p in range(splits)])
                total = np.logaddexp.reduce(parts_lse)
                o = (np.exp(parts_lse - total)[:, None] * parts).sum(0)
                s_b, s_r, s_h = layout.out_strides
                start = i_b * s_b + i_r * s_r + i_h * s_h
                out[start : start + d] = o
                lse[i_b * layout.out_lse_strides[0] + i_h * layout.out_lse_strides[1] + i_r] = total
    np.testing.assert_allclose(out.reshape(layout.out_shape), want, atol=1e-12)
    np.testing.assert_allclose(lse.reshape(layout.lse_shape), want_lse, atol=1e-12)


def test_prefix_lengths_past_the_prefix_table_raise_before_the_append(rng):
    pool, v_pool, prefix_table, own_table, _ = _pool_and_tables(rng, 4, [8], [2, 2], [0, 2])
    q = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    k_new = v_new = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    before = pool.copy()
    for lens in (9, -1, np.array([12], dtype=np.int32)):  # the table's 2 pages hold 8 keys
        with pytest.raises(ValueError, match=r"prefix_seqlens .* outside \[0, 8\]"):
            cupyflash.attention_with_shared_prefix(
                q, pool, v_pool, prefix_block_table=prefix_table, prefix_seqlens=lens, block_table=own_table,
                cache_seqlens=2, k_new=k_new, v_new=v_new,
            )  # fmt: skip
    np.testing.assert_array_equal(pool, before)


def test_the_host_twin_in_every_namespace(rng, xp):
    """The kernel's steps in the array-API standard (array_api_strict, torch CPU): an append, two
    groups, prefix lengths as an array of the namespace, against the flat call in NumPy."""
    page_size, groups = 4, [0, 1, 3]
    pool, v_pool, prefix_table, own_table, flat_table = _pool_and_tables(rng, page_size, [8, 12], [2, 0, 5], groups)
    q = rng.standard_normal((3, 1, 4, pool.shape[-1]))
    k_new, v_new = (rng.standard_normal((3, 1, 2, pool.shape[-1])) for _ in range(2))
    seqlens = np.array([2, 0, 5], dtype=np.int32)
    k_flat, v_flat = pool.copy(), v_pool.copy()
    want, want_lse = cupyflash.attention_with_kvcache(
        q, k_flat, v_flat, cache_seqlens=seqlens + np.array([8, 12, 12], dtype=np.int32), block_table=flat_table,
        k_new=k_new, v_new=v_new, return_lse=True,
    )  # fmt: skip
    arrays = [xp.asarray(x) for x in (q, pool, v_pool, prefix_table, own_table, seqlens, k_new, v_new)]
    out, lse = cupyflash.attention_with_shared_prefix(
        *arrays[:3], prefix_block_table=arrays[3], prefix_seqlens=xp.asarray(np.array([8, 12], dtype=np.int32)),
        block_table=arrays[4], cache_seqlens=arrays[5], k_new=arrays[6], v_new=arrays[7], prefix_groups=groups,
        return_lse=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(arrays[1]), k_flat)  # the append, in place


def test_a_prefix_page_outside_the_pool_raises_before_the_append(rng):
    pool, v_pool, prefix_table, own_table, _ = _pool_and_tables(rng, 4, [8], [2, 2], [0, 2])
    q = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    k_new = v_new = rng.standard_normal((2, 1, 2, pool.shape[-1]))
    before = pool.copy()
    bad = prefix_table.copy()
    bad[0, 1] = pool.shape[0]  # the second page holds keys 4 .. 7: in use
    with pytest.raises(ValueError, match=rf"prefix 0: pages \[{pool.shape[0]}\] outside"):
        cupyflash.attention_with_shared_prefix(
            q, pool, v_pool, prefix_block_table=bad, prefix_seqlens=8, block_table=own_table, cache_seqlens=2,
            k_new=k_new, v_new=v_new,
        )  # fmt: skip
    np.testing.assert_array_equal(pool, before)
    out = cupyflash.attention_with_shared_prefix(  # a page past the prefix's keys is never read
        q, pool, v_pool, prefix_block_table=bad, prefix_seqlens=4, block_table=own_table, cache_seqlens=2
    )
    assert np.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# The GPU's one launch, planned on the CPU: its tile, its splits, its grid and what its CTAs do.
# ---------------------------------------------------------------------------------------------
H100 = _device.HOPPER


def _plan_cascade(groups, prefix_pages, own_pages=33, page_size=16, heads=(32, 8), d=128, nq=1, nnew=0, device=H100):
    """The cascade Launch of one call shape (cache_seqlens an int32 array, the plan's view)."""
    b, (hq, hkv) = groups[-1], heads
    kp = kvcache_problem(
        (b, nq, hq, d), (prefix_pages + b * own_pages, page_size, hkv, d), (prefix_pages + b * own_pages, page_size,
        hkv, d), cache_seqlens=np.zeros(b, dtype=np.int32), block_table_shape=(b, own_pages),
        k_new_shape=(b, nnew, hkv, d) if nnew else None, v_new_shape=(b, nnew, hkv, d) if nnew else None,
        causal=True, scale=None,
    )  # fmt: skip
    new = "bfloat16" if nnew else None
    dtypes = {"q": "bfloat16", "k_cache": "bfloat16", "v_cache": "bfloat16", "cache_seqlens": "int32",
              "block_table": "int32", "k_new": new, "v_new": new}  # fmt: skip
    cascade = _plan.CascadePrefix(tuple(groups), prefix_pages)
    return _plan.plan_kvcache(kp, dtypes, device, num_splits=0, cascade=cascade)  # fmt: skip


def _ctas(launch, groups):
    """decode.cu's decode_work for every CTA of a cascade Launch, in Python: (request, KV head,
    split, prefix, requests) per CTA, in grid order."""
    params, (step,) = launch.params, [s for s in launch.steps if isinstance(s.spec, DecodeSpec)]
    hkv, own_splits = params.value("h_k"), params.value("num_splits")
    prefix_splits, num_blocks = params.value("prefix_splits"), params.value("num_prefix_blocks")
    blocks = _plan.cascade_blocks(launch, tuple(groups))
    assert len(blocks) == num_blocks
    ctas = []
    for x in range(step.grid[0]):
        head, index = x % hkv, x // hkv
        if index < prefix_splits * num_blocks:
            g, first, end = blocks[index % num_blocks]
            ctas.append((first, head, index // num_blocks, g, end - first))
        else:
            own = index - prefix_splits * num_blocks
            ctas.append((own // own_splits, head, own % own_splits, -1, 1))
    return ctas


@pytest.mark.parametrize(
    ("groups", "heads", "d", "nq"),
    [([0, 64], (32, 8), 128, 1), ([0, 1], (32, 8), 128, 1), ([0, 3, 3, 4, 9], (8, 2), 64, 4),
     ([0, 2, 7], (8, 2), 128, 4), ([0, 5], (8, 2), 256, 1)],
)  # fmt: skip
@pytest.mark.parametrize("wgmma", [False, True], ids=["mma-sync-prefix", "wgmma-prefix"])
def test_every_part_of_every_request_is_written_once_and_ticketed(monkeypatch, groups, heads, d, nq, wgmma):
    """The cascade grid (decode_work) against the plan: each (request, KV head) gets its own
    splits' parts and one part per prefix split, each slot once, and exactly as many tickets as
    its counter expects (num_splits + prefix_splits); a prefix CTA holds whole requests of one
    group within a tile; the prefix's splits cover its keys."""
    monkeypatch.setattr(_dispatch, "CASCADE_WGMMA_MIN_ROWS", 32 if wgmma else 1 << 30)
    launch = _plan_cascade(groups, prefix_pages=300, d=d, heads=heads, nq=nq, nnew=nq if nq > 1 else 0)
    params, step = launch.params, launch.steps[-1]
    assert step.spec.cascade and step.grid[1:] == (1, 1)
    own, prefix = params.value("num_splits"), params.value("prefix_splits")
    per_request = heads[0] // heads[1] * nq
    slots: dict[tuple[int, int], list[int]] = {}
    for first, head, split, g, requests in _ctas(launch, groups):
        assert requests * per_request <= (step.spec.prefix_rows if g >= 0 else step.spec.tile.block_m)
        if g >= 0:
            assert groups[g] <= first and first + requests <= groups[g + 1]  # one group's requests
        for b in range(first, first + requests):
            slots.setdefault((b, head), []).append(split if g < 0 else own + split)
    assert sorted(slots) == [(b, h) for b in range(groups[-1]) for h in range(heads[1])]
    assert all(sorted(s) == list(range(own + prefix)) for s in slots.values())
    per_split = params.value("prefix_blocks_per_split") * step.spec.tile.block_n
    assert (prefix - 1) * per_split < params.value("prefix_capacity") <= prefix * per_split
    assert launch.scratch.scratch_bytes == 4 * groups[-1] * heads[0] * nq * (step.spec.head_dim + 1) * (own + prefix)
    assert {"prefix_block_table", "prefix_seqlens", "prefix_rows"} <= {op.name for op in launch.operands}


def test_the_tile_holds_a_group_and_the_prefix_takes_one_wave():
    """B = 64, GQA 32/8, d = 128 over 32k keys: on the H100 the wgmma prefix (128 rows, 32 requests
    a row block, 2 blocks; the requests' own CTAs on 16-row tiles); elsewhere (and B = 8) 32-row
    tiles (8 requests a row block, 8 blocks); the prefix's CTAs one wave of the H100's 132 SMs
    (as many splits as fit); B = 2: 16-row tiles; one request: 16 splits of its prefix."""
    launch = _plan_cascade([0, 64], prefix_pages=2048)
    spec, params = launch.steps[-1].spec, launch.params
    assert spec.wgmma_prefix and spec.tile.block_m == 16 and params.value("num_prefix_blocks") == 2
    assert params.value("prefix_splits") == 8  # 8 x 2 x 8 = 128 CTAs <= 132 < 9 x 2 x 8
    assert not _plan_cascade([0, 8], prefix_pages=2048).steps[-1].spec.wgmma_prefix  # 32 rows a group
    assert _plan_cascade([0, 16], prefix_pages=2048).steps[-1].spec.wgmma_prefix  # 64
    launch = _plan_cascade([0, 64], prefix_pages=2048, device=dataclasses.replace(H100, arch="sm_80"))
    spec, params = launch.steps[-1].spec, launch.params
    assert not spec.wgmma_prefix and spec.tile.block_m == 32 and params.value("num_prefix_blocks") == 8
    assert params.value("prefix_splits") == 2  # 2 x 8 x 8 = 128
    assert _plan_cascade([0, 2], prefix_pages=2048).steps[-1].spec.tile.block_m == 16
    one = _plan_cascade([0, 1], prefix_pages=2048)  # 16 splits of 16 key blocks, then the request's own
    assert one.params.value("prefix_splits") == 16 and one.steps[-1].grid[0] == (16 + 1) * 8
    # few keys: a split keeps DECODE_MIN_BLOCKS_PER_SPLIT key blocks (4 x 128 keys)
    assert _plan_cascade([0, 1], prefix_pages=64).params.value("prefix_splits") == 2
    assert _dispatch.cascade_prefix_splits(prefix_ctas=8, key_blocks=10**6, num_sms=132, ctas_per_sm=1,
                                           own_splits=120) == 8  # fmt: skip
    # a prefix with more CTAs than slots is not split
    assert _dispatch.cascade_prefix_splits(prefix_ctas=200, key_blocks=10**6, num_sms=132, ctas_per_sm=1,
                                           own_splits=1) == 1  # fmt: skip


def test_one_launch_takes_a_request_in_one_tile_else_the_composition():
    """A request's packed rows (query tokens x GQA group) must fit one tile of the head dim: 32
    rows at d = 128, 64 at d = 64, 16 at d = 256; more than 16 query tokens never."""
    assert _cascade.one_launch(1, 4, 128) and _cascade.one_launch(4, 4, 128) and _cascade.one_launch(8, 4, 128)
    assert not _cascade.one_launch(8, 8, 128)  # 64 rows
    assert _cascade.one_launch(16, 4, 64) and not _cascade.one_launch(2, 32, 256)
    assert not _cascade.one_launch(17, 1, 64)
    assert _dispatch.cascade_spec("bfloat16", 96, 4, 4, False).valid_dim == 96  # the next tile width
    with pytest.raises(ValueError, match="in one tile"):
        _plan_cascade([0, 2], prefix_pages=8, heads=(8, 1), nq=8, nnew=8)


@pytest.fixture
def stubbed(monkeypatch):
    """The GPU branch up to the launch (as test_gpu_routes_stubbed): the launches handed over,
    the device arrays made, and the compositions taken."""
    seen = {"launches": [], "device_ints": [], "composed": 0}

    def run(launch, lib, device, arrays, want_lse, given=_launch.EMPTY):
        seen["launches"].append((launch, {n for n, x in arrays.items() if x is not None}))
        return "out", None

    def device_ints(like, values):
        seen["device_ints"].append(tuple(values))
        return stand_in(np.shape(values), "int32")

    def composed(call):
        seen["composed"] += 1
        return "composed", None

    info = _device.HOPPER
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_launch, "run", run)
    monkeypatch.setattr(_interop, "current_device", lambda: 0)
    monkeypatch.setattr(_cascade, "device_ints", device_ints)
    monkeypatch.setattr(_cascade, "_composed", composed)
    _cascade._routes.clear()
    yield seen
    _cascade._routes.clear()


def _stand_in_call(b=8, nq=1, heads=(32, 8), d=128, prefix_seqlens=4096, groups=None, **options):
    hq, hkv = heads
    pool = stand_in((256 + b * 4, 16, hkv, d), "float16")
    g = 1 if groups is None else len(groups) - 1
    return cupyflash.attention_with_shared_prefix(
        stand_in((b, nq, hq, d), "float16"), pool, pool, prefix_block_table=stand_in((g, 256), "int32"),
        prefix_seqlens=prefix_seqlens, block_table=stand_in((b, 4), "int32"), cache_seqlens=stand_in((b,), "int32"),
        k_new=stand_in((b, nq, hkv, d), "float16") if nq > 1 else None,
        v_new=stand_in((b, nq, hkv, d), "float16") if nq > 1 else None, prefix_groups=groups, **options,
    )  # fmt: skip


def test_the_gpu_call_is_one_launch_planned_once(stubbed):
    _stand_in_call()
    _stand_in_call(prefix_seqlens=100)  # an int is a per-call value: the same plan
    (launch, given), (again, _) = stubbed["launches"]
    assert again is launch and len(stubbed["device_ints"]) == 1  # the row blocks made once
    assert [s.spec.name for s in launch.steps] == ["cf_decode_fp16_d128_m32_k16_w8_s2_cascade"]
    assert {op.name for op in launch.operands} - {"k_new", "v_new"} <= given
    # host lengths of several values: made into a device array once, with the plan
    _stand_in_call(b=6, prefix_seqlens=np.array([5, 4096], dtype=np.int32), groups=[0, 2, 6])
    _stand_in_call(b=6, prefix_seqlens=np.array([5, 4096], dtype=np.int32), groups=[0, 2, 6])
    assert stubbed["device_ints"][1:] == [((0, 0, 2), (1, 2, 6)), (5, 4096)]
    # a request's rows past one tile: the composition, decided once per signature
    for _ in range(2):
        assert _stand_in_call(nq=8, heads=(8, 1)) == "composed"
    assert stubbed["composed"] == 2 and len(stubbed["launches"]) == 4
    with pytest.raises(ValueError, match=r"prefix_seqlens \[4097\] outside \[0, 4096\]"):
        _stand_in_call(prefix_seqlens=4097)
    with pytest.raises(ValueError, match="one length per prefix"):
        _stand_in_call(prefix_seqlens=stand_in((2,), "int32"))
