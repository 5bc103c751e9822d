"""attention_with_shared_prefix on the GPU: the one launch of the decode kernel's cascade variant
(and the composition where a request's rows pass one tile) against the float64 reference over
the keys each request saw (its prefix, then its own after the append) and the flat paged call over
the same keys; page sizes 1 and 16, one and several uneven groups (an empty one too), 1 and 4 query
tokens with an append, GQA 32/8 and 8/2, d = 64, 128 and 256, prefix lengths that end inside a
page, empty suffixes, bf16 and fp16, the LSE, repeats (the counters left at 0), a CUDA graph, and
bad device values. Outputs are NaN-poisoned (conftest), the partial buffer too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from helpers import capture, check_kvcache, need_torch

import cupyflash
from cupyflash import _cascade, _device, _dispatch, _plan, reference

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    heads: tuple[int, int]
    d: int
    nq: int
    nnew: int
    groups: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    own_lens: tuple[int, ...]  # tokens cached before the append
    dtype: str = "bfloat16"
    lengths: str = "device"  # prefix_seqlens as "device" (an int32 tensor), "int" or "host" (NumPy)


CASES = {
    # one group; the prefix ends inside a page; own keys empty, short and past a key block
    "one-group-gqa32to8-d128": Case((32, 8), 128, 1, 0, (0, 5), (4100,), (37, 0, 500, 1, 250), lengths="int"),
    # uneven groups over 64-row tiles: a group of 5 takes two row blocks, one of 1 a padded one
    "uneven-gqa8to2-d64-nq4": Case(
        (8, 2), 64, 4, 4, (0, 3, 4, 9), (1000, 37, 2049), (5, 0, 17, 300, 3, 0, 64, 1, 90), dtype="float16"
    ),
    # several query tokens and an append, host lengths of several values, an empty group
    "groups-gqa8to2-d128-nq4": Case(
        (8, 2), 128, 4, 4, (0, 2, 2, 6), (5000, 7, 333), (12, 0, 3, 700, 45, 0), lengths="host"
    ),
    # one request over a long prefix: the prefix split for one wave, one decode token appended
    "one-request-gqa32to8-d128": Case((32, 8), 128, 1, 1, (0, 1), (20001,), (3,)),
    # d = 256 (16-row tiles: 4 requests a row block) with fp16
    "gqa8to2-d256": Case((8, 2), 256, 1, 1, (0, 2, 3), (777, 2500), (10, 0, 129), dtype="float16"),
    # Hopper's wgmma prefix (groups of >= 64 packed rows): a group of 37 requests (a row block of
    # 32 and one of 5), one of 1 (4 rows of a 128-row block), one of 17;
    # prefixes ending inside a 128-key tile and inside a page
    "wgmma-gqa32to8-d128": Case(
        (32, 8), 128, 1, 1, (0, 37, 38, 55), (4100, 9, 1290), tuple((7 * i) % 300 for i in range(55))
    ),
    # 4 query tokens x GQA 8/2 (16 rows a request: 8 a row block), d = 64, fp16, host lengths
    "wgmma-gqa8to2-d64-nq4": Case(
        (8, 2),
        64,
        4,
        4,
        (0, 12, 12, 20),
        (3000, 50, 129),
        tuple((13 * i) % 200 for i in range(20)),
        dtype="float16",
        lengths="host",
    ),
}
FALLBACK = Case((8, 1), 128, 8, 8, (0, 2, 3), (640, 2000), (9, 0, 30))  # 64 rows a request: the composition


def _pool(torch, gen, case, page_size, spare_pages=5):
    """A shuffled page pool (plus spare pages of noise) holding each prefix's keys and room for
    each request's own keys and its append; the two-level tables; the request's queries."""
    hq, hkv = case.heads
    b, g = case.groups[-1], len(case.groups) - 1
    prefix_pages = [-(-n // page_size) for n in case.prefix_lens]
    own_pages = [-(-(n + case.nnew + 3) // page_size) for n in case.own_lens]
    total = sum(prefix_pages) + sum(own_pages) + spare_pages
    dtype = getattr(torch, case.dtype)
    pools = [torch.randn(total, page_size, hkv, case.d, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    order = torch.randperm(total, device="cuda", generator=gen).to(torch.int32).tolist()
    prefix_rows = [order[sum(prefix_pages[:i]) : sum(prefix_pages[: i + 1])] for i in range(g)]
    base = sum(prefix_pages)
    own_rows = [order[base + sum(own_pages[:i]) : base + sum(own_pages[: i + 1])] for i in range(b)]

    def table(rows):
        width = max(max((len(r) for r in rows), default=1), 1)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device="cuda")

    q = torch.randn(b, case.nq, hq, case.d, device="cuda", generator=gen).to(dtype)
    new = [None, None]
    if case.nnew:
        new = [torch.randn(b, case.nnew, hkv, case.d, device="cuda", generator=gen).to(dtype) for _ in range(2)]
    return pools, table(prefix_rows), table(own_rows), prefix_rows, own_rows, q, new


def _lengths(torch, case):
    if case.lengths == "int":
        assert len(set(case.prefix_lens)) == 1
        return case.prefix_lens[0]
    if case.lengths == "host":
        return np.array(case.prefix_lens, dtype=np.int32)
    return torch.tensor(case.prefix_lens, dtype=torch.int32, device="cuda")


def _seen_keys(torch, case, pools, prefix_rows, own_rows):
    """What each request attended, gathered from the pool after the call (its append landed):
    contiguous caches [B, L, Hkv, d] and each request's key count."""
    hkv, d = case.heads[1], case.d
    lengths, keys = [], ([], [])
    for g, (begin, end) in enumerate(zip(case.groups, case.groups[1:])):
        for b in range(begin, end):
            own = case.own_lens[b] + case.nnew
            lengths.append(case.prefix_lens[g] + own)
            for kv, pool in enumerate(pools):
                prefix = pool[prefix_rows[g]].reshape(-1, hkv, d)[: case.prefix_lens[g]]
                mine = pool[own_rows[b]].reshape(-1, hkv, d)[:own]
                keys[kv].append(torch.cat([prefix, mine]))
    width = max(lengths)
    caches = []
    for seqs in keys:
        cache = torch.zeros(len(seqs), width, hkv, d, device="cuda", dtype=seqs[0].dtype)
        for b, s in enumerate(seqs):
            cache[b, : s.shape[0]] = s
        caches.append(cache)
    return caches, lengths


def _flat_paged(torch, q, caches, lengths, page_size, **options):
    """The flat paged call over the same keys: each request's sequence in pages of its own."""
    k, v = caches
    b, width, hkv, d = k.shape
    per = -(-width // page_size)
    pad = per * page_size - width
    paged = [torch.nn.functional.pad(c, (0, 0, 0, 0, 0, pad)).reshape(b * per, page_size, hkv, d) for c in (k, v)]
    table = torch.arange(b * per, dtype=torch.int32, device="cuda").reshape(b, per)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return cupyflash.attention_with_kvcache(
        q, *paged, cache_seqlens=seqlens, block_table=table, return_lse=True, **options
    )


def _call(case, pools, prefix_table, own_table, q, new, lengths, seqlens=None, **options):
    """``seqlens``: the requests' own lengths on the GPU (made from ``case`` when None; a captured
    call is given them, as a copy from the host cannot be captured)."""
    if seqlens is None:
        seqlens = need_torch().tensor(case.own_lens, dtype=need_torch().int32, device="cuda")
    return cupyflash.attention_with_shared_prefix(
        q, *pools, prefix_block_table=prefix_table, prefix_seqlens=lengths, block_table=own_table,
        cache_seqlens=seqlens, k_new=new[0], v_new=new[1], prefix_groups=list(case.groups), return_lse=True, **options,
    )  # fmt: skip


def _check_case(torch, case, page_size, seed, **options):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pools, prefix_table, own_table, prefix_rows, own_rows, q, new = _pool(torch, gen, case, page_size)
    out, lse = _call(case, pools, prefix_table, own_table, q, new, _lengths(torch, case), **options)
    caches, lengths = _seen_keys(torch, case, pools, prefix_rows, own_rows)
    if "softcap" not in options:  # (the float64 reference of a cache call takes no softcap)
        check_kvcache(out, lse, q, *caches, lengths, options.get("causal", True), case.dtype, options.get("scale"))
    want, want_lse = _flat_paged(torch, q, caches, lengths, page_size, **options)
    # the two partial states' rounding aside, the flat call's result (bf16: 8 mantissa bits)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tolerance = 2e-2 if case.dtype == "bfloat16" else 3e-3
    assert (out.float() - want.float()).abs().max().item() < tolerance
    assert (lse - want_lse).abs().max().item() < 1e-3
    cupyflash.check_device_errors()
    return pools, prefix_table, own_table, q, new, out, lse


@pytest.fixture
def one_launch(monkeypatch):
    """The call must run as one launch: the composition raises."""

    def composed(call):
        raise AssertionError("the call took the composition, not the one launch")

    monkeypatch.setattr(_cascade, "_composed", composed)


@pytest.fixture
def no_wgmma_prefix(monkeypatch):
    """The prefix CTAs on the mma.sync path whatever the groups' rows (Hopper's wgmma path off)."""
    monkeypatch.setattr(_dispatch, "CASCADE_WGMMA_MIN_ROWS", 1 << 30)
    _plan.clear_caches()
    yield
    _plan.clear_caches()


@pytest.fixture
def wgmma_prefix_from_64_rows(monkeypatch):
    """Hopper's wgmma prefix wherever a group has 64 packed rows, whatever the default threshold."""
    monkeypatch.setattr(_dispatch, "CASCADE_WGMMA_MIN_ROWS", 64)
    _plan.clear_caches()
    yield
    _plan.clear_caches()


def _takes_wgmma_prefix(case):
    hq, hkv = case.heads
    per_request = hq // hkv * case.nq
    group_rows = per_request * max(e - b for b, e in zip(case.groups, case.groups[1:]))
    arch = _device.device_info(0).arch
    return _dispatch.cascade_spec(case.dtype, case.d, per_request, group_rows, True, arch=arch).wgmma_prefix


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_one_launch_matches_the_reference_and_the_flat_call(request, one_launch, name, page_size):
    torch = need_torch()
    case = CASES[name]
    hq, hkv = case.heads
    assert _cascade.one_launch(case.nq, hq // hkv, case.d)
    if name.startswith("wgmma"):  # (on Hopper these take the wgmma prefix; so may others)
        request.getfixturevalue("wgmma_prefix_from_64_rows")
        assert _takes_wgmma_prefix(case) == (_device.device_info(0).arch == "sm_90a")
    _check_case(torch, case, page_size, seed=10 * list(CASES).index(name) + page_size)


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("wgmma")])
def test_the_wgmma_cases_on_the_mma_sync_path(one_launch, no_wgmma_prefix, name):
    """The same large groups with the prefix CTAs on the mma.sync tiles (what other GPUs run)."""
    torch = need_torch()
    case = CASES[name]
    assert not _takes_wgmma_prefix(case)
    _check_case(torch, case, 16, seed=3 + list(CASES).index(name))


@pytest.mark.parametrize("options", [{"causal": False, "softcap": 4.0}, {"scale": 0.05}], ids=str)
def test_one_launch_options(one_launch, options):
    """softcap (its variant) and non-causal several tokens; a scale of the caller's."""
    torch = need_torch()
    case = Case((8, 2), 128, 4, 4, (0, 3), (3000,), (40, 0, 9), lengths="int")
    _check_case(torch, case, 16, seed=7, **options)


def test_the_composition_where_a_request_passes_one_tile():
    torch = need_torch()
    assert not _cascade.one_launch(FALLBACK.nq, FALLBACK.heads[0] // FALLBACK.heads[1], FALLBACK.d)
    _check_case(torch, FALLBACK, 16, seed=11)


@pytest.mark.parametrize("name", ["uneven-gqa8to2-d64-nq4", "wgmma-gqa8to2-d64-nq4"])
def test_repeats_and_a_cuda_graph_give_the_same_bits(request, one_launch, name):
    """The tickets' counters are left at 0: the same call three times, and replays of a captured
    one, give the same bits; a replay after q changes gives the eager call's new result."""
    torch = need_torch()
    if name.startswith("wgmma"):
        request.getfixturevalue("wgmma_prefix_from_64_rows")
    case = CASES[name]  # (the append writes the same keys at the same places each time)
    gen = torch.Generator(device="cuda").manual_seed(3)
    pools, prefix_table, own_table, _, _, q, new = _pool(torch, gen, case, 16)
    lengths = _lengths(torch, case)
    first = _call(case, pools, prefix_table, own_table, q, new, lengths)
    for _ in range(2):
        again = _call(case, pools, prefix_table, own_table, q, new, lengths)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
    seqlens = torch.tensor(case.own_lens, dtype=torch.int32, device="cuda")
    graph, (out, lse) = capture(torch, lambda: _call(case, pools, prefix_table, own_table, q, new, lengths, seqlens))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])
    q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
    graph.replay()
    eager = _call(case, pools, prefix_table, own_table, q, new, lengths)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
    cupyflash.check_device_errors()


@pytest.mark.parametrize("requests", [3, 40], ids=["3-requests", "40-requests-wgmma-prefix-on-hopper"])
def test_bad_prefix_values_give_nan_rows_of_their_group_and_raise(request, one_launch, requests):
    """A prefix length past its table row, or one of its pages in use outside the pool: that
    group's requests get NaN rows (never a plausible answer), the other group's are right, and
    check_device_errors names the value."""
    torch = need_torch()
    request.getfixturevalue("wgmma_prefix_from_64_rows")
    own = tuple((4, 0, 60, 7, 1) * 9)[: 2 + requests]
    case = Case((8, 2), 128, 1, 0, (0, 2, 2 + requests), (100, 300), own)
    gen = torch.Generator(device="cuda").manual_seed(5)
    pools, prefix_table, own_table, prefix_rows, own_rows, q, new = _pool(torch, gen, case, 16)
    capacity = prefix_table.shape[1] * 16
    bad_len = torch.tensor([capacity + 1, 300], dtype=torch.int32, device="cuda")
    out, lse = _call(case, pools, prefix_table, own_table, q, new, bad_len)
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    assert np.isnan(out64[:2]).all() and np.isnan(lse64[:2]).all()
    caches, lengths = _seen_keys(torch, case, pools, prefix_rows, own_rows)
    check_kvcache(out[2:], lse[2:], q[2:], caches[0][2:], caches[1][2:], lengths[2:], True, case.dtype)
    with pytest.raises(cupyflash.DeviceValueError, match="prefix_seqlens"):
        cupyflash.check_device_errors()
    bad_table = prefix_table.clone()
    bad_table[1, 0] = pools[0].shape[0] + 9  # a page of prefix 1 in use
    out, lse = _call(case, pools, bad_table, own_table, q, new, _lengths(torch, case))
    out64 = reference.to_numpy64(out)
    assert np.isnan(out64[2:]).all() and not np.isnan(out64[:2]).any()
    with pytest.raises(cupyflash.DeviceValueError, match="block_table entry in use was outside"):
        cupyflash.check_device_errors()
