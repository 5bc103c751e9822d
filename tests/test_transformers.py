"""cupyflash.integrations.transformers on tiny models built from configs (random init, float32 on
the CPU, so the host path runs: the mask and padding logic is what is tested here; the `gpu`
test runs a bf16 model on CUDA): logits against transformers' eager attention, for plain causal
(Llama, GQA), sliding-window (Mistral) and softcap (Gemma2) models, left- and right-padded
batches, and greedy generation with a DynamicCache."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from cupyflash.integrations import transformers as cft  # noqa: E402

NAME = cft.register()


def _config(kind: str, head_dim: int = 16) -> object:
    hidden = 4 * head_dim
    common = {"vocab_size": 101, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}  # fmt: skip
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=5)
    return transformers.Gemma2Config(
        **common, head_dim=head_dim, sliding_window=6, attn_logit_softcapping=3.0, query_pre_attn_scalar=head_dim
    )


def _models(kind: str) -> tuple[object, object]:
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation=NAME).eval()
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def test_every_layer_runs_through_cupyflash(monkeypatch):
    """The registered name reaches cupyflash (dense without padding, varlen with it), not a
    fallback of transformers'."""
    calls = {"dense": 0, "varlen": 0}
    dense, varlen = cft.attention, cft.attention_varlen

    def count(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(cft, "attention", count("dense", dense))
    monkeypatch.setattr(cft, "attention_varlen", count("varlen", varlen))
    _, ours = _models("llama")
    ids = torch.randint(1, 101, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        ours(ids)
        ours(ids, attention_mask=mask)
    assert calls == {"dense": 2, "varlen": 2}  # two layers, each call


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_logits_match_eager(kind):
    eager, ours = _models(kind)
    ids = torch.randint(0, 101, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_match_eager(side):
    eager, ours = _models("llama")
    ids = torch.randint(1, 101, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    for row, pad in ((0, 4), (2, 7)):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, 12 - pad :] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_greedy_generation_with_left_padding_and_a_cache():
    eager, ours = _models("mistral")
    ids = torch.randint(1, 101, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_greedy_generation_with_a_static_cache():
    eager, ours = _models("llama")
    ids = torch.randint(1, 101, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
              "cache_implementation": "static"}  # fmt: skip
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_training_gradients_match_eager():
    eager, ours = _models("llama")
    ids = torch.randint(0, 101, (2, 10))
    for model in (eager, ours):
        model.train()
        model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="flash"):
        cft.register("my_flash")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_bf16_model_on_the_gpu_against_eager(kind):
    """The kernels (head_dim 64) inside each model, a left-padded batch: the top-1 tokens of the
    valid positions agree with eager attention (which, unlike SDPA, applies Gemma2's softcap)."""
    torch.manual_seed(0)
    cfg = _config(kind, head_dim=64)
    eager = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").cuda().bfloat16().eval()
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).cuda().bfloat16().eval()
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(1, 101, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    valid = mask.bool()
    assert (got[valid].argmax(-1) == want[valid].argmax(-1)).float().mean() > 0.95


def _positional(q, k, mask, window=None):
    """float64 attention as transformers counts it: causal over positions (bottom-right), the
    window over positions, padded keys hidden; q (B, Hq, Nq, d), k = v (B, Hkv, Nk, d)."""
    nq, nk = q.shape[2], k.shape[2]
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q.double() @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    i, j = torch.arange(nq)[:, None] + nk - nq, torch.arange(nk)[None, :]
    visible = (j <= i) & (True if window is None else j > i - window)
    s = s.masked_fill(~(visible & mask[:, None, None, :]), -torch.inf)
    return (torch.softmax(s, dim=-1).nan_to_num(0.0) @ kk).transpose(1, 2)


def test_masks_packing_cannot_express_run_with_an_attn_mask():
    """Padding among a cache's newest positions, and a window over a mask with gaps, run the
    padding as an attn_mask (positions kept): against the positional formula on the valid rows;
    what cannot be expressed at all still raises."""

    class Module:
        is_causal = True

    q, k = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 8, 16)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, -1] = False  # a cache whose newest position is padding, with 3 query tokens
    out, _ = cft.attention_forward(Module(), q, k, k, mask)
    want = _positional(q, k, mask)
    valid = mask[:, -3:]
    torch.testing.assert_close(out[valid].double(), want[valid], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="2-D boolean padding mask"):
        cft.attention_forward(Module(), q, k, k, torch.zeros(2, 1, 3, 8))
    holes = torch.ones(2, 8, dtype=torch.bool)
    holes[0, 3] = False  # a gap inside a sequence: packed, the window would count tokens
    q8 = torch.randn(2, 4, 8, 16)
    out, _ = cft.attention_forward(Module(), q8, k, k, holes, sliding_window=4)
    want = _positional(q8, k, holes, window=4)
    torch.testing.assert_close(out[holes].double(), want[holes], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        cft.attention_forward(Module(), q8, k, k, holes, sliding_window=4, softcap=3.0)
    cft.attention_forward(Module(), q8, k, k, holes)  # without a window the packed sequence is exact


def test_training_mode_dropout_reaches_the_kernels():
    """In train mode transformers passes the config's attention_dropout: the logits change with
    it (and repeat under one torch seed); in eval mode they equal eager's."""
    cfg = _config("llama")
    cfg.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
    ids = torch.randint(1, 101, (2, 12))
    model.train()
    torch.manual_seed(1)
    a = model(ids).logits
    torch.manual_seed(1)
    assert torch.equal(a, model(ids).logits)
    model.eval()
    assert not torch.allclose(a, model(ids).logits)


def test_left_padded_generation_runs_the_decode_path(monkeypatch):
    """Greedy generation over a left-padded batch (no window): the decode steps go through
    attention_with_kvcache with each row's first valid key (no packing copy), and the tokens
    equal eager attention's."""
    calls = []
    real = cft.attention_with_kvcache

    def counting(*args, **kwargs):
        calls.append(kwargs["cache_leftpad"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(cft, "attention_with_kvcache", counting)
    eager, ours = _models("llama")
    ids = torch.randint(1, 101, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))
    assert calls and all(first == [0, 3, 5] for first in calls)


@pytest.mark.gpu
def test_left_padded_decode_step_on_the_gpu():
    """One decode step of a left-padded bf16 batch on CUDA through the attention function: the
    decode kernel from each row's first valid key, against the float64 reference of those keys."""
    import numpy as np

    from cupyflash import reference

    class Module:
        is_causal = True

    b, hq, hkv, nk, d = 3, 8, 2, 300, 64
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, nk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(b, nk, dtype=torch.bool, device="cuda")
    first = [0, 17, 250]
    for i, f in enumerate(first):
        mask[i, :f] = False
    out, _ = cft.attention_forward(Module(), q, k, v, mask, scaling=d**-0.5)
    for i, f in enumerate(first):
        want = reference.attention(q[i : i + 1, :, :, :], k[i : i + 1, :, f:], v[i : i + 1, :, f:], layout="bhsd")
        got = reference.to_numpy64(out[i : i + 1])
        assert np.abs(got - want.transpose(0, 2, 1, 3)).max() < 2e-2


def test_bench_transformers_runs_end_to_end_on_the_cpu(tmp_path, capsys):
    """``python -m cupyflash bench-transformers --quick`` on the CPU (float32, the host path):
    every family's stages run and pass, the JSON holds each measurement, the table is printed."""
    import json

    from cupyflash.__main__ import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only contend (100x slower on a loaded host)
    try:
        status = main(["bench-transformers", "--quick", "--device", "cpu", "--json", str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "r.json").read_text())
    assert status == 0 and report["failures"] == [] and report["complete"]
    assert [f["family"] for f in report["families"]] == ["llama", "qwen2", "gemma2"]
    for family in report["families"]:
        assert family["errors"] == {}
        prefill = [family[f"prefill_{b}x{n}"] for b, n in report["sizes"]["prefill"]]
        for row in prefill:
            assert set(row["single_ms"]) == {cft.NAME, family["peer"], "eager"}
            assert all(ms > 0 for ms in [*row["single_ms"].values(), *row["back_to_back_ms"].values()])
            assert row["lm_head_rows"] == "last (logits_to_keep=1)"
        for stage in ("logits", "padded_left", "padded_right"):
            rows = family[stage]["vs_reference"]
            assert set(rows) == set(family["checked"]) and family[stage]["within_floor"]
            assert all(r["top1_agreement"] == 1.0 and r["max_abs_diff"] < 1e-5 for r in rows.values())
        for cache in ("dynamic", "static"):
            generated = family[f"generate_{cache}"]
            assert all(generated["identical"].values()) and all(v > 0 for v in generated["tokens_per_s"].values())
    gemma2 = report["families"][2]
    assert gemma2["peer"] == "torch_sdp_nosoftcap" and "sdpa" not in gemma2["checked"]
    assert gemma2["config"]["attn_logit_softcapping"] == 50.0
    qwen2 = report["families"][1]["config"]
    assert qwen2["layer_types"] == ["full_attention", "sliding_attention"]
    out = capsys.readouterr().out
    assert "== gemma2" in out and "failures: none" in out
