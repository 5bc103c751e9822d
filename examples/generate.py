"""A small GPT-style decoder with random weights: the prompts are prefilled with FA2
(``cupyflash.attention``), then tokens are generated one at a time through a paged KV cache
(``cupyflash.attention_with_kvcache``: the new key/value rows are appended in place and the
cache is read by the split-KV FlashDecoding kernel). Every step's attention output is checked
against the float64 reference over the keys gathered back from the pages; a second, unchecked
run measures tokens per second.

    python examples/generate.py [--steps 64] [--batch 4] [--page-size 16]

Needs a CUDA GPU and PyTorch (for the model's linear layers).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from tinygpt import TinyGPT

import cupyflash
from cupyflash import reference


class PagedCache:
    """Per layer K and V pages [num_pages, page_size, Hkv, d]; pages handed out in shuffled order."""

    def __init__(self, model: TinyGPT, *, batch: int, max_len: int, page_size: int, n_layers: int) -> None:
        per_seq = -(-max_len // page_size)
        num_pages = batch * per_seq
        shape = (num_pages, page_size, model.heads_kv, model.head_dim)
        self.k = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(n_layers)]
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))
        self.block_table = perm.reshape(batch, per_seq).to("cuda", torch.int32)
        self.page_size = page_size

    def write_prompt(self, layer: int, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows 0 .. n - 1 of sequence b (k, v: [n, Hkv, d]), written through the block table."""
        pos = torch.arange(k.shape[0], device="cuda")
        pages = self.block_table[b, pos // self.page_size].long()
        self.k[layer][pages, pos % self.page_size] = k
        self.v[layer][pages, pos % self.page_size] = v

    def gather(self, layer: int, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(n, device="cuda")
        pages = self.block_table[b, pos // self.page_size].long()
        return self.k[layer][pages, pos % self.page_size], self.v[layer][pages, pos % self.page_size]


def generate(model, prompts, *, steps: int, page_size: int, check: bool) -> tuple[list[list[int]], float, float]:
    """Greedy decoding; returns the tokens, the worst relative attention error (if checked) and
    the seconds spent in the decode loop."""
    batch, n_layers = len(prompts), len(model.layers)
    max_len = max(len(p) for p in prompts) + steps
    cache = PagedCache(model, batch=batch, max_len=max_len, page_size=page_size, n_layers=n_layers)
    # Prefill, one prompt at a time (their lengths differ): FA2, causal.
    last = []
    for b, prompt in enumerate(prompts):
        tokens = torch.tensor(prompt, device="cuda")
        x = (model.embed[tokens] + model.pos[: len(prompt)])[None]
        for i, layer in enumerate(model.layers):
            q, k, v = model.split_qkv(x, layer)
            cache.write_prompt(i, b, k[0], v[0])
            x = model.finish_layer(x, cupyflash.attention(q, k, v, causal=True), layer)
        last.append(int(model.logits(x[:, -1]).argmax()))
    seqlens = torch.tensor([len(p) for p in prompts], device="cuda", dtype=torch.int32)
    out_tokens = [[t] for t in last]
    worst = 0.0
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps - 1):
        tokens = torch.tensor([seq[-1] for seq in out_tokens], device="cuda")
        x = (model.embed[tokens] + model.pos[seqlens.long()])[:, None]
        for i, layer in enumerate(model.layers):
            q, k_new, v_new = model.split_qkv(x, layer)
            attn = cupyflash.attention_with_kvcache(
                q, cache.k[i], cache.v[i], cache_seqlens=seqlens, block_table=cache.block_table,
                k_new=k_new, v_new=v_new, causal=True,
            )  # fmt: skip
            if check:
                worst = max(worst, _attention_error(attn, q, cache, i, seqlens))
            x = model.finish_layer(x, attn, layer)
        seqlens += 1
        for seq, t in zip(out_tokens, model.logits(x[:, 0]).argmax(-1).tolist()):
            seq.append(t)
    torch.cuda.synchronize()
    return out_tokens, worst, time.perf_counter() - start


def _attention_error(attn, q, cache: PagedCache, layer: int, seqlens) -> float:
    """Relative error of one step's attention against float64 over the keys read back from
    the pages (the appended row included)."""
    worst = 0.0
    for b, n in enumerate((seqlens + 1).tolist()):
        k, v = cache.gather(layer, b, n)
        ref = reference.attention(q[b : b + 1], k[None], v[None], causal=True)
        got = reference.to_numpy64(attn[b : b + 1])
        worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    model = TinyGPT(vocab=4096, d_model=1024, n_layers=4, heads_q=8, heads_kv=2, max_len=4096)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4096, size=int(n)).tolist() for n in rng.integers(50, 1500, size=args.batch)]
    print("model: 4 layers, d_model 1024, 8 query heads / 2 KV heads of 128, bf16, random weights")
    print(f"prompts: {[len(p) for p in prompts]} tokens; paged KV cache, page size {args.page_size}")
    tokens, worst, _ = generate(model, prompts, steps=args.steps, page_size=args.page_size, check=True)
    print(f"checked run: {args.steps} tokens per sequence, worst relative attention error vs float64: {worst:.2e}")
    assert worst < 1e-2, "decode attention deviates from the reference"
    again, _, seconds = generate(model, prompts, steps=args.steps, page_size=args.page_size, check=False)
    assert again == tokens, "the unchecked run generated different tokens"
    decoded = args.batch * (args.steps - 1)
    print(f"timed run: {decoded} tokens in {seconds * 1e3:.1f} ms = {decoded / seconds:.0f} tokens/s "
          f"({seconds / (args.steps - 1) * 1e3:.2f} ms per step, batch {args.batch})")  # fmt: skip
    print("first sequence:", tokens[0][:16], "...")


if __name__ == "__main__":
    main()
