"""examples/serve.py, the continuous-batching loop over a paged KV cache, on the CPU with tiny
sizes (torch CPU tensors: cupyflash's host path): the scheduler's page and budget accounting,
both attention backends against each other and against the model run over each whole sequence
with no cache, every page back in the pool at the end; the same loop on the GPU in bfloat16."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# A pool that holds about two requests at once (so admission waits for pages), prompts longer
# than a chunk (prefill over several steps) and gaps in the arrivals (steps with only decodes).
TINY = (
    "--device cpu --requests 7 --rate 0.5 --vocab 64 --d-model 32 --layers 2 --heads-q 4 --heads-kv 2 "
    "--prompt-len 1 23 --gen-len 1 9 --page-size 4 --max-chunk 6 --max-step-tokens 10 --max-seqs 3 "
    "--num-pages 16 --warmup 2"
).split()


@pytest.fixture(scope="module")
def serve():
    """examples/serve.py as a module (examples/ on sys.path for its tinygpt import)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("serve", EXAMPLES / "serve.py")
        module = sys.modules["serve"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("serve", None)


def tiny_model(serve, requests, dtype=torch.float32):
    return serve.TinyGPT(vocab=64, d_model=32, n_layers=2, heads_q=4, heads_kv=2, device="cpu", dtype=dtype,
                         max_len=max(len(r.prompt) + r.gen_len for r in requests))  # fmt: skip


def test_help_runs(serve):
    with pytest.raises(SystemExit) as done:
        serve.main(["--help"])
    assert done.value.code == 0


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("rate", [0.05, 0.7])
def test_the_scheduler_keeps_its_budgets_and_gives_every_page_back(serve, seed, rate):
    """The scheduler alone, fed made-up tokens: every step within its limits, decodes first, each
    running sequence's pages its own and enough for its keys, and at the end every request
    served to its length and every page free. At 0.7 requests a step the pool runs short (a
    request waits for pages); at 0.05 the server runs dry between arrivals."""
    requests = serve.make_schedule(40, rate=rate, prompt_len=(1, 60), gen_len=(1, 30), vocab=10, seed=seed)
    pool = serve.PagePool(48, seed=seed)
    scheduler = serve.Scheduler(requests, pool, page_size=4, max_chunk=16, max_step_tokens=24, max_seqs=6)
    chunked = idle = 0
    while not scheduler.done():
        work = scheduler.next_step()
        if not work:
            assert not scheduler.running and scheduler.pending
            idle += 1
            continue
        counts = [n for _, n in work]
        assert sum(counts) <= 24 and len(work) <= 6 and max(counts) <= 16
        decodes = [not s.in_prefill() for s, _ in work]
        assert decodes == sorted(decodes, reverse=True)  # decodes lead the batch
        assert all(n == 1 for (s, n), d in zip(work, decodes) if d)
        owned = [p for s in scheduler.running for p in s.pages]
        assert len(owned) == len(set(owned)) and set(owned) == pool.in_use
        assert len(pool.free) + len(pool.in_use) == pool.num_pages
        for s, n in work:
            assert len(s.pages) == -(-(s.cached + n) // 4)
        chunked += any(s.in_prefill() and n < len(s.request.prompt) for s, n in work)
        scheduler.finish_step(work, {s.request.rid: 7 for s, n in work if s.samples(n)}, None)
    assert sorted(scheduler.finished) == [r.rid for r in requests]
    assert all(len(s.output) == s.request.gen_len == len(s.picks) for s in scheduler.finished.values())
    assert sorted(pool.free) == list(range(48)) and not pool.in_use
    assert chunked
    assert (scheduler.steps_waiting_for_pages > 0) if rate > 0.5 else (idle > 0)


def test_both_backends_agree_and_every_page_comes_back(serve, tmp_path):
    out = tmp_path / "serve.json"
    results = serve.main([*TINY, "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    compared = results["comparison"]
    assert compared["agree"] and compared["worst_relative_logits_difference"] < 1e-4
    assert compared["requests_with_identical_greedy_tokens"] == compared["requests"] == 7
    for backend in ("cupyflash", "sdpa"):
        r = results[backend]
        assert r["free_pages_at_end"] == r["num_pages"] == 16
        assert r["steps_waiting_for_pages"] > 0 and r["most_chunks_of_one_prompt"] > 1
        assert r["generated_tokens"] == compared["positions"]
    assert results["cupyflash"]["steps"] == results["sdpa"]["steps"]


def recompute(model, tokens):
    """The logits at every position of one whole sequence, no cache: causal SDPA per layer."""
    x = (model.embed[tokens] + model.pos[: len(tokens)])[None]
    group = model.heads_q // model.heads_kv
    for layer in model.layers:
        q, k, v = (t.transpose(1, 2) for t in model.split_qkv(x, layer))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = model.finish_layer(x, attn.transpose(1, 2), layer)
    return model.logits(x[0])


@pytest.mark.parametrize("backend", ["cupyflash", "sdpa"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_served_logits_are_those_of_each_whole_sequence(serve, backend, page_size):
    """Pages, slot mapping, chunks and block tables change nothing: each request's logits are
    the model's over its prompt and generated tokens computed in one pass without a cache."""
    requests = serve.make_schedule(6, rate=0.8, prompt_len=(1, 30), gen_len=(1, 8), vocab=64, seed=3)
    model = tiny_model(serve, requests)
    run = serve.serve(model, requests, backend=backend, page_size=page_size, num_pages=64 // page_size + 8,
                      max_chunk=7, max_step_tokens=12, max_seqs=4, device="cpu")  # fmt: skip
    rids = np.asarray(run.logit_rids)
    for r in requests:
        s = run.finished[r.rid]
        assert s.output == s.picks
        full = recompute(model, torch.tensor([*r.prompt, *s.output[:-1]]))[len(r.prompt) - 1 :]
        torch.testing.assert_close(run.logits[torch.from_numpy(rids == r.rid)], full, rtol=1e-5, atol=1e-5)
    assert sorted(run.pool.free) == list(range(run.pool.num_pages))


@pytest.mark.gpu
def test_serve_on_the_gpu_in_bfloat16(serve, tmp_path):
    """The GPU loop end to end at small sizes: the varlen kernel over the pages against SDPA."""
    small = "--requests 24 --prompt-len 1 700 --gen-len 1 40 --max-chunk 128 --num-pages 512 --max-seqs 16".split()
    results = serve.main([*small, "--json", str(tmp_path / "serve.json")])
    assert results["comparison"]["agree"], results["comparison"]
    for backend in ("cupyflash", "sdpa"):
        assert results[backend]["free_pages_at_end"] == results[backend]["num_pages"]
