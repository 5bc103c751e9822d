"""A training step over packed sequences: ``attention_varlen``'s forward + backward (autograd),
beside PyTorch's ``varlen_attn`` on the same packed tensors and, where every sequence has the same
length, the same tokens as a padded batch through ``cupyflash.attention`` and SDPA's cuDNN
backend (the same work: a packed batch should train as fast as its padded twin). bf16, H x d =
2048, the three timings of DESIGN.md; TFLOP/s of the unpadded work, the backward counted as 2.5
forwards; the gradients' largest difference from ``varlen_attn``'s.

With ``--score-mod``, every call adds the same relative-position bias (ALiBi's, written as a
``score_mod``: ``s - slope[h] |q_idx - kv_idx|``): ``attention_varlen`` with it, its padded twin
through ``attention``, and FlexAttention as its users pack sequences (the tokens as one sequence,
a document mask, the same function; its block mask made once, outside the timing), compiled; the
gradients' largest difference is then FlexAttention's.

    python scripts/bench_varlen_train.py [--quick] [--score-mod] [--json OUT]

Runs against the cupyflash on PYTHONPATH, so that one GPU call can time two trees (before and
after a change) with the same script.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

from cupyflash.bench import _torch_varlen_call, runnable, sdpa_call, three_timings_ms, varlen_lengths


def shapes(quick: bool) -> list[tuple[str, tuple[int, ...], int, bool]]:
    """(label, lengths, head_dim, causal): 16 x 1k and 4 x 4k (padded twins), and a mix."""
    mixes = {"16x1k": (1024,) * 16, "4x4k": (4096,) * 4, "mix": varlen_lengths()}
    if quick:
        mixes = {"16x1k": mixes["16x1k"], "mix": mixes["mix"]}
    return [(label, n, d, causal) for label, n in mixes.items() for d in (64, 128) for causal in (False, True)]


def _flex_packed(q: Any, k: Any, v: Any, lengths: tuple[int, ...], causal: bool, slopes: Any) -> Callable[[], Any]:
    """FlexAttention over the packed tokens as one sequence: a document mask (and causal within a
    document), ALiBi's bias as its score_mod (the same distances inside a document)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def same_document(b: Any, h: Any, i: Any, j: Any) -> Any:
        return (doc[i] == doc[j]) & (j <= i) if causal else doc[i] == doc[j]

    def alibi(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s - slopes[h] * (i - j).abs()

    block_mask = create_block_mask(same_document, None, None, total, total, device="cuda")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    flex = torch.compile(flex_attention, dynamic=False)
    views = [x.unsqueeze(0).transpose(1, 2) for x in (q, k, v)]
    return lambda: flex(*views, score_mod=alibi, block_mask=block_mask).transpose(1, 2)[0]


def run(
    label: str, lengths: tuple[int, ...], head_dim: int, causal: bool, repeat: int, score_mod: bool = False
) -> dict[str, Any]:
    import torch

    import cupyflash

    heads, total, longest = 2048 // head_dim, sum(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(total, heads, head_dim, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    options: dict[str, Any] = {"causal": causal}
    peer = "torch_varlen"
    if score_mod:  # ALiBi's slopes, as a score_mod over each sequence's own positions
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], device="cuda")
        options["score_mod"] = lambda s, b, h, i, j: s - slopes[h] * cupyflash.mods.abs(i - j)
        peer = "flex_packed"
    forwards: dict[str, Callable[[], Any]] = {
        "cupyflash": functools.partial(cupyflash.attention_varlen, q, k, v, cu, cu, longest, longest, **options)
    }
    try:
        if score_mod:
            forwards[peer] = _flex_packed(q, k, v, lengths, causal, slopes)
        else:
            forwards[peer] = _torch_varlen_call(q, k, v, cu, longest, causal)
    except (ImportError, AttributeError):
        pass
    if len(set(lengths)) == 1:  # the padded twin: views of the same leaves
        padded = tuple(x.view(len(lengths), longest, heads, head_dim) for x in (q, k, v))
        forwards["cupyflash_padded"] = functools.partial(cupyflash.attention, *padded, **options)
        if not score_mod:
            forwards["cudnn_padded"] = sdpa_call("cudnn", *padded, causal)

    def step(forward: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            out = forward()
            return torch.autograd.grad(out, (q, k, v), dout.view(out.shape))

        return call

    row: dict[str, Any] = {"shape": label, "head_dim": head_dim, "causal": causal, "sequences": len(lengths),
                           "score_mod": score_mod}  # fmt: skip
    steps = runnable({name: step(f) for name, f in forwards.items()}, row)
    if peer in steps and "cupyflash" in steps:
        ours, theirs = steps["cupyflash"](), steps[peer]()
        row[f"max_grad_diff_vs_{peer}"] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    flops = 3.5 * sum(4.0 * heads * n * n * head_dim for n in lengths) / (2 if causal else 1)
    timings = three_timings_ms(steps, repeat=repeat, warmup_ms=200.0)
    row["tflops"] = {t: {name: round(flops / ms / 1e9, 1) for name, ms in by.items()} for t, by in timings.items()}
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 x 1k and the mix only, fewer samples")
    parser.add_argument("--score-mod", action="store_true", help="ALiBi's bias as a score_mod, FlexAttention beside")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for label, lengths, head_dim, causal in shapes(args.quick):
        row = run(label, lengths, head_dim, causal, 9 if args.quick else 15, args.score_mod)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
