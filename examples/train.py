"""Train a ~100M-parameter decoder twice from the same initial weights and the same batches:
once with ``cupyflash.attention`` and once with PyTorch SDPA, and write both loss curves.

The corpus is synthetic and fixed by its seed: each sequence is 1024 tokens of a fixed random
Markov chain (every token has 4 equally likely successors: a floor of log 4 = 1.386 that the
model reaches by learning the table) followed by the same 1024 tokens again, which only
attention back to the first half can predict (an induction head must form): the second half's
loss falling below log 4 shows attention and its gradients at work.

    python examples/train.py [--steps 300] [--json losses.json]

Needs a CUDA GPU and PyTorch. bf16 autocast, AdamW, sequence 2048, batch 8.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import cupyflash

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, HALF = 8192, 768, 12, 12, 2048, 1024


class Decoder(torch.nn.Module):
    """Pre-norm GPT: token + learned position embeddings, LAYERS x (causal attention, 4x GELU MLP)."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(SEQ, D_MODEL))
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "norm1": torch.nn.RMSNorm(D_MODEL),
                    "qkv": torch.nn.Linear(D_MODEL, 3 * D_MODEL, bias=False),
                    "out": torch.nn.Linear(D_MODEL, D_MODEL, bias=False),
                    "norm2": torch.nn.RMSNorm(D_MODEL),
                    "up": torch.nn.Linear(D_MODEL, 4 * D_MODEL, bias=False),
                    "down": torch.nn.Linear(4 * D_MODEL, D_MODEL, bias=False),
                }
            )
            for _ in range(LAYERS)
        )
        self.norm = torch.nn.RMSNorm(D_MODEL)
        self.unembed = torch.nn.Linear(D_MODEL, VOCAB, bias=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "cupyflash":
            return cupyflash.attention(q, k, v, causal=True)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, n = tokens.shape
        x = self.embed(tokens) + self.pos[:n]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, n, 3, HEADS, -1).unbind(2)
            x = x + blk["out"](self.attend(q, k, v).reshape(b, n, D_MODEL))
            x = x + blk["down"](torch.nn.functional.gelu(blk["up"](blk["norm2"](x))))
        return self.unembed(self.norm(x))


SUCCESSORS = 4


def batches(steps: int, batch: int, seed: int = 0) -> list[torch.Tensor]:
    """The fixed corpus: every step's batch of (a Markov-chain half, the same half again)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=gen, device="cuda")
    rows = steps * batch
    half = torch.empty(rows, HALF, dtype=torch.long, device="cuda")
    half[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen, device="cuda")
    choice = torch.randint(0, SUCCESSORS, (rows, HALF), generator=gen, device="cuda")
    for i in range(1, HALF):  # every sequence's walk at once
        half[:, i] = table[half[:, i - 1], choice[:, i]]
    return list(torch.cat([half, half], dim=1).split(batch))


def train(backend: str, data: list[torch.Tensor], init: dict) -> dict:
    torch.manual_seed(0)
    model = Decoder(backend).cuda()
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    losses, first_half, second_half = [], [], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for step, tokens in enumerate(data):
        for group in opt.param_groups:  # linear warm-up over 30 steps, then constant
            group["lr"] = 6e-4 * min(1.0, (step + 1) / 30)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        per_token = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(tokens.shape[0], -1)
        loss = per_token.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        second_half.append(per_token[:, HALF:].mean().item())
        first_half.append(per_token[:, : HALF - 1].mean().item())
        if step % 50 == 0:
            print(
                f"{backend:9} step {step:4d} loss {losses[-1]:.4f} first half {first_half[-1]:.4f} "
                f"second half {second_half[-1]:.4f}",
                flush=True,
            )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens_per_s = len(data) * data[0].numel() / seconds
    print(f"{backend:9} {len(data)} steps in {seconds:.1f} s: {tokens_per_s:,.0f} tokens/s", flush=True)
    return {
        "loss": losses, "first_half_loss": first_half, "second_half_loss": second_half, "tokens_per_s": tokens_per_s,
        "seconds": seconds,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="write both runs' losses and tokens/s here")
    args = parser.parse_args()
    torch.manual_seed(0)
    init = Decoder("sdpa").state_dict()
    params = sum(p.numel() for p in init.values())
    print(
        f"{params / 1e6:.1f}M parameters, sequence {SEQ}, batch {args.batch}, log(vocab) = {math.log(VOCAB):.3f}, "
        f"log({SUCCESSORS}) = {math.log(SUCCESSORS):.3f}"
    )
    data = batches(args.steps, args.batch)
    runs = {backend: train(backend, data, init) for backend in ("cupyflash", "sdpa")}
    a, b = runs["cupyflash"]["loss"], runs["sdpa"]["loss"]
    last_a, last_b = sum(a[-50:]) / 50, sum(b[-50:]) / 50
    largest = max(abs(x - y) for x, y in zip(a, b))
    print(f"last 50 steps: mean loss cupyflash {last_a:.4f}, sdpa {last_b:.4f}; max |difference| {largest:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"parameters": params, "steps": args.steps, "batch": args.batch, **runs}, f)


if __name__ == "__main__":
    main()
