"""Speculative decoding's tree mask (``attention_with_kvcache(tree_mask=)``) on the host: the
array-API twin against the float64 reference over every cache layout (random trees, a chain
against causal, a lone root, GQA, k_new appended and read back), the refusals, and the GPU
planner's tree variant (which needs no GPU)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from helpers import kv_reference, paginate, random_tree_mask

import cupyflash
from cupyflash import _device, _plan, reference
from cupyflash._dispatch import DECODE_REGISTERS, decode_spec
from cupyflash._specs import DecodeSpec
from cupyflash._validate import kvcache_problem

H200 = _device.HOPPER


def _ancestors_of_chain(nq: int) -> np.ndarray:
    return np.tril(np.ones((nq, nq), dtype=bool))


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("page_size", [None, 1, 4, 16], ids=["contiguous", "paged1", "paged4", "paged16"])
@pytest.mark.parametrize("nq", [1, 4, 7, 40])
@pytest.mark.parametrize("form", ["per-sequence", "shared", "shared-3d"])
def test_tree_matches_reference(xp, rng, page_size, nq, form):
    """Random trees over ragged caches (0, 1, 20 and a full cache before the append), GQA 3: the
    drafts appended by k_new land at cache_seqlens[b] + t, and each row sees every earlier key and
    the drafts its tree row names (40 drafts: past a 32-bit row word)."""
    b, length, hq, hkv, d = 4, max(37, 21 + nq), 6, 2, 16
    q = rng.standard_normal((b, nq, hq, d))
    k_cache, v_cache = (rng.standard_normal((b, length, hkv, d)) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, nq, hkv, d)) for _ in range(2))
    cached = np.array([0, 1, 20, length - nq], dtype=np.int32)
    trees = np.stack([random_tree_mask(rng, nq) for _ in range(b)])
    given = {"per-sequence": trees, "shared": trees[0], "shared-3d": trees[:1]}[form]
    per_sequence = trees if form == "per-sequence" else np.broadcast_to(trees[:1], trees.shape)
    table = None
    k_dev, v_dev = k_cache, v_cache
    if page_size is not None:
        (k_dev, v_dev), table = paginate(rng, (k_cache, v_cache), page_size)
    args = [xp.asarray(x.astype(np.float32)) for x in (q, k_dev, v_dev, k_new, v_new)]
    out, lse = cupyflash.attention_with_kvcache(
        args[0], args[1], args[2], cache_seqlens=xp.asarray(cached), k_new=args[3], v_new=args[4],
        block_table=None if table is None else xp.asarray(table), tree_mask=xp.asarray(given), return_lse=True,
    )  # fmt: skip
    k_after = reference.to_numpy64(args[1])  # the drafts' keys, read back where the append put them
    for i in range(b):
        for t in range(nq):
            pos = int(cached[i]) + t
            where = (i, pos) if table is None else (table[i, pos // page_size], pos % page_size)
            np.testing.assert_array_equal(k_after[where], k_new[i, t].astype(np.float32))
    ref_k, ref_v = _f32(k_cache), _f32(v_cache)
    for i in range(b):
        ref_k[i, cached[i] : cached[i] + nq] = _f32(k_new[i])
        ref_v[i, cached[i] : cached[i] + nq] = _f32(v_new[i])
    ref, ref_lse = kv_reference(_f32(q), ref_k, ref_v, cached + nq, False, tree_mask=per_sequence)
    np.testing.assert_allclose(reference.to_numpy64(out), ref, atol=2e-5)
    lse64 = reference.to_numpy64(lse)
    assert (np.isneginf(lse64) == np.isneginf(ref_lse)).all()
    np.testing.assert_allclose(lse64[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-4)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("nq", [1, 5, 16])
def test_a_chain_is_causal(rng, page_size, nq):
    """The chain (each draft sees every earlier one) is the causal rule, bit for bit: the same
    scores hidden, the same algorithm; and with a tree, causal=True and False say the same."""
    b, length, hq, hkv, d = 3, 70, 4, 1, 8
    q = rng.standard_normal((b, nq, hq, d))
    caches = [rng.standard_normal((b, length, hkv, d)) for _ in "kv"]
    cached = np.array([nq, 33, length], dtype=np.int32)  # the drafts already in the cache
    table = None
    if page_size is not None:
        caches, table = paginate(rng, caches, page_size)
    call = lambda **kw: cupyflash.attention_with_kvcache(  # noqa: E731
        q, *caches, cache_seqlens=cached, block_table=table, return_lse=True, **kw
    )
    chain, causal = call(tree_mask=_ancestors_of_chain(nq)), call(causal=True)
    for got, want in zip(chain, causal):
        np.testing.assert_array_equal(got, want)
    tree = random_tree_mask(rng, nq)
    for got, want in zip(call(tree_mask=tree, causal=False), call(tree_mask=tree, causal=True)):
        np.testing.assert_array_equal(got, want)


def test_a_lone_root_and_drafts_that_do_not_see_themselves(rng):
    """One draft seeing itself is a plain decode step; drafts that see only the root; a draft
    that sees no draft at all over an empty prefix has no key: output 0, LSE -inf."""
    b, hq, hkv, d = 2, 4, 2, 8
    caches = [rng.standard_normal((b, 12, hkv, d)) for _ in "kv"]
    q1 = rng.standard_normal((b, 1, hq, d))
    lone = cupyflash.attention_with_kvcache(q1, *caches, cache_seqlens=np.array([5, 12], np.int32),
                                            tree_mask=np.ones((1, 1), bool))  # fmt: skip
    plain = cupyflash.attention_with_kvcache(q1, *caches, cache_seqlens=np.array([5, 12], np.int32), causal=False)
    np.testing.assert_array_equal(lone, plain)
    nq = 4
    star = np.zeros((nq, nq), dtype=bool)
    star[:, 0] = True  # every draft sees the root, none itself (but the root)
    q = rng.standard_normal((b, nq, hq, d))
    seqlens = np.array([nq, 9], dtype=np.int32)  # sequence 0: the drafts only, no prefix
    empty = star.copy()
    empty[2] = False  # draft 2 sees nothing
    out, lse = cupyflash.attention_with_kvcache(q, *caches, cache_seqlens=seqlens, tree_mask=empty, return_lse=True)
    ref, ref_lse = kv_reference(q, *caches, seqlens, False, tree_mask=np.stack([empty] * b))
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert np.isneginf(ref_lse[0, :, 2]).all() and np.isneginf(lse[0, :, 2]).all()
    assert (out[0, 2] == 0).all() and np.isfinite(lse[1]).all()
    np.testing.assert_allclose(lse[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)], atol=1e-12)


def test_fewer_keys_than_drafts(rng):
    """A sequence of Nk < Nq keys holds only the last Nk drafts (bottom-right, as causal)."""
    nq, hq, d = 5, 2, 8
    caches = [rng.standard_normal((1, 8, 1, d)) for _ in "kv"]
    q = rng.standard_normal((1, nq, hq, d))
    tree = random_tree_mask(rng, nq)
    out, lse = cupyflash.attention_with_kvcache(q, *caches, cache_seqlens=3, tree_mask=tree, return_lse=True)
    ref, ref_lse = kv_reference(q, *caches, [3], False, tree_mask=tree[None])
    np.testing.assert_allclose(out, ref, atol=1e-12)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()


@pytest.mark.parametrize("page_size", [None, 4])
def test_tree_with_sinks(xp, rng, page_size):
    """Learnable sinks join a tree's rows as any other row's: attention_with_kvcache(tree_mask=,
    sinks=) against reference.attention with both, drafts appended by k_new, a draft that sees no
    key at all (output 0, LSE = its head's sink); and the reference itself against the rule a sink
    follows (lse' = logaddexp(lse, sink), out' = out exp(lse - lse') of the tree alone)."""
    b, length, hq, hkv, d, nq = 3, 24, 4, 2, 8, 5
    q = rng.standard_normal((b, nq, hq, d))
    k_cache, v_cache = (rng.standard_normal((b, length, hkv, d)) for _ in "kv")
    k_new, v_new = (rng.standard_normal((b, nq, hkv, d)) for _ in "kv")
    sinks = rng.standard_normal(hq) * 2
    cached = np.array([0, 7, length - nq], dtype=np.int32)
    trees = np.stack([random_tree_mask(rng, nq) for _ in range(b)])
    trees[0, 3] = False  # sequence 0 has no prefix: its draft 3 sees no key
    k_dev, v_dev, table = k_cache, v_cache, None
    if page_size is not None:
        (k_dev, v_dev), table = paginate(rng, (k_cache, v_cache), page_size)
    args = [xp.asarray(x.astype(np.float32)) for x in (q, k_dev, v_dev, k_new, v_new, sinks)]
    out, lse = cupyflash.attention_with_kvcache(
        args[0], args[1], args[2], cache_seqlens=xp.asarray(cached), k_new=args[3], v_new=args[4],
        block_table=None if table is None else xp.asarray(table), tree_mask=xp.asarray(trees), sinks=args[5],
        return_lse=True,
    )  # fmt: skip
    ref_k, ref_v = _f32(k_cache), _f32(v_cache)
    for i in range(b):
        ref_k[i, cached[i] : cached[i] + nq] = _f32(k_new[i])
        ref_v[i, cached[i] : cached[i] + nq] = _f32(v_new[i])
    sinks32 = _f32(sinks)
    lengths = cached + nq
    ref, ref_lse = kv_reference(_f32(q), ref_k, ref_v, lengths, False, tree_mask=trees, sinks=sinks32)
    out64, lse64 = reference.to_numpy64(out), reference.to_numpy64(lse)
    np.testing.assert_allclose(out64, ref, atol=2e-5)
    np.testing.assert_allclose(lse64, ref_lse, atol=1e-4)
    assert (out64[0, 3] == 0).all()
    np.testing.assert_allclose(lse64[0, :, 3], sinks32, atol=1e-6)
    # The reference's two features together follow the sink's rule over the tree alone.
    tree_only, tree_lse = kv_reference(_f32(q), ref_k, ref_v, lengths, False, tree_mask=trees)
    merged = np.logaddexp(tree_lse, sinks32[None, :, None])
    np.testing.assert_allclose(ref_lse, merged, atol=1e-12)
    weight = np.exp(tree_lse - merged).transpose(0, 2, 1)[..., None]  # [B, Nq, Hq, 1]
    np.testing.assert_allclose(ref, tree_only * weight, atol=1e-12)


@pytest.mark.parametrize("layout", ["batch_idx-leftpad", "e4m3", "e4m3-paged4"])
def test_tree_over_the_other_cache_layouts(rng, layout):
    """cache_batch_idx with cache_leftpad, and float8 caches (contiguous and paged), with softcap:
    the tree rows over the keys the call attends (from the first key; the dequantised cache)."""
    b, length, hq, hkv, d, nq = 3, 40, 4, 2, 16, 6
    q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
    new = [rng.standard_normal((b, nq, hkv, d)).astype(np.float32) for _ in "kv"]
    trees = np.stack([random_tree_mask(rng, nq) for _ in range(b)])
    cached = np.array([2, 10, 30], dtype=np.int32)
    if layout == "batch_idx-leftpad":
        entries, first = np.array([4, 0, 2], np.int32), np.array([0, 3, 7], np.int32)
        caches = [rng.standard_normal((5, length, hkv, d)).astype(np.float32) for _ in "kv"]
        expected = [c[entries].astype(np.float64) for c in caches]
        out, lse = cupyflash.attention_with_kvcache(
            q, *caches, cache_seqlens=cached, k_new=new[0], v_new=new[1], cache_batch_idx=entries,
            cache_leftpad=first, tree_mask=trees, softcap=3.0, return_lse=True,
        )  # fmt: skip
    else:
        fp8 = ml_dtypes.float8_e4m3fn
        caches = [rng.standard_normal((b, length, hkv, d)).astype(fp8) for _ in "kv"]
        k_scale, v_scale = 0.5, 0.25
        first = np.zeros(b, np.int32)
        expected = [c.astype(np.float64) * s for c, s in zip(caches, (k_scale, v_scale))]
        dev, table = [c.copy() for c in caches], None
        if layout == "e4m3-paged4":
            dev, table = paginate(rng, [c.view(np.uint8) for c in caches], 4)
            dev = [c.view(fp8) for c in dev]
        out, lse = cupyflash.attention_with_kvcache(
            q, *dev, cache_seqlens=cached, k_new=new[0], v_new=new[1], block_table=table, k_scale=k_scale,
            v_scale=v_scale, tree_mask=trees, softcap=3.0, return_lse=True,
        )  # fmt: skip
        new = [(n / s).astype(fp8).astype(np.float64) * s for n, s in zip(new, (k_scale, v_scale))]  # as appended
    for c, n in zip(expected, new):
        for i in range(b):
            c[i, cached[i] : cached[i] + nq] = n[i]
    outs, lses = [], []
    for i in range(b):
        k, v = (c[i : i + 1, first[i] : cached[i] + nq] for c in expected)
        o, l_ = reference.attention(q[i : i + 1], k, v, softcap=3.0, tree_mask=trees[i], return_lse=True)
        outs.append(o)
        lses.append(l_)
    np.testing.assert_allclose(out, np.concatenate(outs), atol=3e-5)
    np.testing.assert_allclose(lse, np.concatenate(lses), atol=1e-4)


def _call_kwargs(nq: int = 3) -> dict:
    b, hq, hkv, d = 2, 4, 2, 8
    return {
        "q": np.zeros((b, nq, hq, d), np.float32),
        "k_cache": np.zeros((b, 16, hkv, d), np.float32),
        "v_cache": np.zeros((b, 16, hkv, d), np.float32),
        "cache_seqlens": 5,
        "tree_mask": np.ones((nq, nq), bool),
    }


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"tree_mask": np.ones((3, 4), bool)}, ValueError, r"tree_mask must be a bool array \(Nq, Nq\)"),
        ({"tree_mask": np.ones((3, 3, 3), bool)}, ValueError, "batch = 2"),
        ({"tree_mask": np.ones(3, bool)}, ValueError, "got shape"),
        ({"tree_mask": np.ones((1, 2, 3, 3), bool)}, ValueError, "got shape"),
        ({"tree_mask": np.ones((3, 3), np.int32)}, TypeError, "tree_mask must be a bool array, got int32"),
        ({"tree_mask": np.ones((3, 3), np.uint8)}, TypeError, "tree_mask must be a bool array"),
        ({"window": (4, 0)}, ValueError, "tree_mask does not take a window"),
        ({"alibi_slopes": np.ones(4, np.float32)}, ValueError, "tree_mask does not take alibi_slopes"),
    ],
)
def test_tree_mask_refusals(changes, error, message):
    with pytest.raises(error, match=message):
        cupyflash.attention_with_kvcache(**(_call_kwargs() | changes))


def test_tree_mask_refuses_the_rotary_tables():
    kwargs = _call_kwargs()
    new = np.zeros((2, 3, 2, 8), np.float32)
    table = np.ones((16, 4), np.float32)
    with pytest.raises(ValueError, match="tree_mask does not take rotary_cos"):
        cupyflash.attention_with_kvcache(**kwargs, k_new=new, v_new=new, rotary_cos=table, rotary_sin=table)


# ---------------------------------------------------------------------------------------------
# The GPU's plan (pure: no GPU needed).
# ---------------------------------------------------------------------------------------------
def _tree_plan(tree_shape, nq=4, dtype="bool", **kw):
    kp = kvcache_problem(
        (3, nq, 8, 128), (3, 64, 2, 128), (3, 64, 2, 128), cache_seqlens=5, block_table_shape=None,
        k_new_shape=None, v_new_shape=None, causal=True, scale=None, tree_mask_shape=tree_shape, **kw,
    )  # fmt: skip
    dtypes = {"q": "bfloat16", "k_cache": "bfloat16", "v_cache": "bfloat16", "tree_mask": dtype}
    return kp, _plan.plan_kvcache(kp, dtypes, H200, num_splits=0)


@pytest.mark.parametrize(("shape", "batch_axis", "row_axis"), [((4, 4), None, 0), ((1, 4, 4), None, 1),
                                                               ((3, 4, 4), 0, 1)])  # fmt: skip
def test_the_plan_runs_the_tree_variant(shape, batch_axis, row_axis):
    """The tree replaces the causal rule: the split-KV kernel's tree variant (no causal bound),
    the mask's row stride bound, its batch stride only for one tree per sequence (else 0)."""
    kp, launch = _tree_plan(shape)
    assert kp.tree and not kp.attn.causal_bound
    (step,) = launch.steps
    assert step.spec.tree and not step.spec.causal and step.spec.name.endswith("_tree")
    params = launch.params
    operand = launch.operands[launch.operand_index["tree_mask"]]
    assert operand.ptr_slot == params.slot("tree_mask")
    strides = dict(operand.stride_slots)
    assert strides.get(params.slot("tree_mask_row_stride")) == row_axis
    assert strides.get(params.slot("tree_mask_batch_stride")) == batch_axis
    assert params.value("tree_mask_batch_stride") == 0


@pytest.mark.parametrize("nq", [17, 32, 33, 64])
def test_a_tree_past_16_drafts_stays_on_the_decode_kernel(nq):
    """17 to 64 drafts: the split-KV kernel's tree variant (32-bit words of visible drafts up to
    32 drafts, the wide variant's 64-bit ones past them), its packed rows (drafts x GQA group 4)
    over several m-blocks, where more query tokens without a tree run the FA2 forward over the
    cache."""
    _, launch = _tree_plan((nq, nq), nq=nq)
    step = launch.steps[-1]
    assert isinstance(step.spec, DecodeSpec) and step.spec.tree and step.spec.wide_tree == (nq > 32)
    assert step.grid[0] == -(-nq * 4 // step.spec.tile.block_m) > 1  # m-blocks (one split: 64 keys)
    kp = kvcache_problem(
        (3, nq, 8, 128), (3, 64, 2, 128), (3, 64, 2, 128), cache_seqlens=5, block_table_shape=None,
        k_new_shape=None, v_new_shape=None, causal=True, scale=None, tree_mask_shape=None,
    )  # fmt: skip
    causal = _plan.plan_kvcache(kp, {"q": "bfloat16", "k_cache": "bfloat16", "v_cache": "bfloat16"}, H200, num_splits=0)
    assert not isinstance(causal.steps[-1].spec, DecodeSpec)  # the FA2 forward over the cache


def test_the_plan_refuses_what_the_tree_kernel_does_not_take():
    with pytest.raises(ValueError, match="tree_mask on the GPU takes 1 to 64 query tokens"):
        _tree_plan((65, 65), nq=65)
    with pytest.raises(TypeError, match="tree_mask must be a bool array, got uint8"):
        _tree_plan((4, 4), dtype="uint8")


def test_the_tree_variant_spec():
    """No causal or window bound with a tree; the traits' trailing Is_tree_ spelled out; every
    shipped tree variant's registers in the occupancy table."""
    spec = decode_spec("float16", 128, 4, False, tree=True)
    with pytest.raises(ValueError, match="replaces the causal rule"):
        dataclasses.replace(spec, causal=True)
    with pytest.raises(ValueError, match="replaces the causal rule"):
        dataclasses.replace(spec, local=True)
    assert spec._traits_args() == (*dataclasses.replace(spec, tree=False)._traits_args(), 0, False, False, True)
    tree_names = {name for _, name in DECODE_REGISTERS if name.endswith("_tree")}
    assert len(tree_names) == 22  # 2 types x (6 tiles of the 16-bit caches + 5 of the float8 ones)
    # 33 to 64 drafts: the wide variant (64-bit words), the trailing Wide_tree_ spelled out
    wide = decode_spec("float16", 128, 4, False, tree=True, wide_tree=True)
    assert wide.name == spec.name + "_wide"
    assert wide._traits_args() == (*spec._traits_args(), False, True)
    assert {name[: -len("_wide")] for _, name in DECODE_REGISTERS if name.endswith("_tree_wide")} == tree_names
    with pytest.raises(ValueError, match="tree must be set"):
        dataclasses.replace(wide, tree=False)


def test_torch_compile_keeps_the_tree_mask_in_the_op():
    """Under torch.compile the tree mask goes through the custom op (fullgraph) and gives eager's result."""
    torch = pytest.importorskip("torch")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 4, 16, generator=gen)
    caches = [torch.randn(2, 16, 2, 16, generator=gen) for _ in "kv"]
    tree = torch.from_numpy(random_tree_mask(np.random.default_rng(1), 4))
    lens = torch.tensor([3, 12], dtype=torch.int32)
    step = lambda q: cupyflash.attention_with_kvcache(q, *caches, cache_seqlens=lens, tree_mask=tree)  # noqa: E731
    torch.testing.assert_close(torch.compile(step, fullgraph=True)(q), step(q))


def test_jax_refuses_a_tree_mask():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    kwargs = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in _call_kwargs().items()}
    with pytest.raises(NotImplementedError, match="tree_mask does not run on JAX arrays yet"):
        jax.jit(lambda q: cupyflash.attention_with_kvcache(**(kwargs | {"q": q})))(kwargs["q"])


def test_a_mask_mod_over_the_drafts_is_the_tree_it_draws(xp, rng):
    """mask_mod(b, h, q_idx, kv_idx) over the drafts (indices in [0, Nq)): the same call as the
    tree_mask it gives at every (b, q_idx, kv_idx), per sequence through a captured ancestor
    table (b-dependent) or shared (index arithmetic alone); refused where it reads h or beside a
    tree_mask."""
    b, length, hq, hkv, d, nq = 3, 40, 4, 2, 16, 7
    q = rng.standard_normal((b, nq, hq, d)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((b, length, hkv, d)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, nq, hkv, d)).astype(np.float32) for _ in range(2))
    cached = np.array([0, 5, 20], dtype=np.int32)
    trees = np.stack([random_tree_mask(rng, nq) for _ in range(b)])
    ancestors = xp.asarray(trees.reshape(b * nq, nq))  # (a captured array is 1-D or 2-D)
    chunks = np.tril(np.ones((nq, nq), dtype=bool)) & ((np.arange(nq)[:, None] // 3) == (np.arange(nq)[None, :] // 3))
    for mask_mod, tree in (
        (lambda b, h, i, j: ancestors[b * nq + i, j], trees),
        (lambda b, h, i, j: (j <= i) & (i // 3 == j // 3), np.broadcast_to(chunks, trees.shape)),
    ):
        results = []
        for given in ({"mask_mod": mask_mod}, {"tree_mask": xp.asarray(np.ascontiguousarray(tree))}):
            caches = [xp.asarray(x.copy()) for x in (k_cache, v_cache)]
            results.append(cupyflash.attention_with_kvcache(
                xp.asarray(q), *caches, cache_seqlens=xp.asarray(cached), k_new=xp.asarray(k_new),
                v_new=xp.asarray(v_new), return_lse=True, **given,
            ))  # fmt: skip
        for got, want in zip(*results, strict=True):
            np.testing.assert_array_equal(reference.to_numpy64(got), reference.to_numpy64(want))
    args = (xp.asarray(q), xp.asarray(k_cache), xp.asarray(v_cache))
    with pytest.raises(ValueError, match="reads h"):
        cupyflash.attention_with_kvcache(*args, cache_seqlens=5, mask_mod=lambda b, h, i, j: (j <= i) | (h == 0))
    with pytest.raises(ValueError, match="not both"):
        cupyflash.attention_with_kvcache(
            *args, cache_seqlens=5, mask_mod=lambda b, h, i, j: j <= i, tree_mask=xp.asarray(trees)
        )
