"""A gallery of score and mask functions (FlexAttention's ``score_mod`` / ``mask_mod``), each run
through ``cupyflash.attention`` and checked against the same attention written another way:
cupyflash's built-in options where it has them (causal, sliding window, softcap, ALiBi), else
the float64 reference with the mask or bias written out as an array.

    python examples/score_functions.py            # NumPy on the CPU (the array-API host path)
    python examples/score_functions.py --gpu      # PyTorch CUDA tensors (the kernels), bf16

Each line: the function, and the largest difference from the other way of computing it.
"""

from __future__ import annotations

import argparse

import numpy as np

import cupyflash
from cupyflash import mods, reference


def gallery(n: int, heads: int, to_array):  # noqa: ANN001, ANN201
    """(name, score_mod, mask_mod, built-in options or None, reference bias (H, N, N) with -inf
    for hidden keys): the same attention two ways. ``to_array`` puts a captured array where q is."""
    rng = np.random.default_rng(0)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    window, prefix, chunk, cap = 48, 32, 64, 20.0
    doc = np.sort(rng.integers(0, 4, n)).astype(np.int32)  # packed documents
    slopes = (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)).astype(np.float32)
    table = rng.standard_normal((heads, 2 * n)).astype(np.float32)  # a bias per head and distance
    draft = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=bool)  # a token tree
    doc_a, slopes_a, table_a, draft_a = (to_array(x) for x in (doc, slopes, table, draft))
    hidden = lambda visible: np.where(visible, 0.0, -np.inf)[None]  # noqa: E731
    drafts = np.ones((n, n), dtype=bool)  # the last 4 tokens see the prefix and their tree
    drafts[n - 4 :, n - 4 :] = draft
    drafts &= j <= i
    return [
        ("causal", None, lambda b, h, q, kv: kv <= q, {"causal": True}, hidden(j <= i)),
        ("sliding window", None, lambda b, h, q, kv: (kv <= q) & (q - kv < window),
         {"causal": True, "window": (window - 1, 0)}, hidden((j <= i) & (i - j < window))),
        ("prefix-LM", None, lambda b, h, q, kv: (kv < prefix) | (kv <= q), None, hidden((j < prefix) | (j <= i))),
        ("document masking", None, lambda b, h, q, kv: (doc_a[q] == doc_a[kv]) & (kv <= q), None,
         hidden((doc[i] == doc[j]) & (j <= i))),
        ("chunked local (Llama 4)", None, lambda b, h, q, kv: (q // chunk == kv // chunk) & (kv <= q), None,
         hidden((i // chunk == j // chunk) & (j <= i))),
        ("softcap", lambda s, b, h, q, kv: cap * mods.tanh(s / cap), None, {"softcap": cap}, None),
        ("ALiBi", lambda s, b, h, q, kv: s - slopes_a[h] * mods.abs(q - kv), None, {"alibi_slopes": slopes_a},
         -slopes[:, None, None] * np.abs(i - j)[None]),
        ("relative position bias", lambda s, b, h, q, kv: s + table_a[h, kv - q + n], None, None,
         np.stack([table[h][j - i + n] for h in range(heads)])),
        # (a traced function reads every index it is given, even where `|` has already decided:
        # the draft indices are clamped into the tree, as a read outside it would be refused)
        ("tree of drafts", None,
         lambda b, h, q, kv: (kv <= q) & ((q < n - 4) | (kv < n - 4)
                                          | draft_a[mods.maximum(q - (n - 4), 0), mods.maximum(kv - (n - 4), 0)]),
         None, hidden(drafts)),
    ]  # fmt: skip


def packed_documents(inputs, n: int, heads: int, to_array):  # noqa: ANN001, ANN201
    """The gallery's documents as packed sequences (``attention_varlen``, one sequence per
    document): its causal document mask is then the packing and ``kv <= q`` within each."""
    doc = np.sort(np.random.default_rng(0).integers(0, 4, n))  # (gallery's)
    lengths = np.bincount(doc, minlength=4)
    cu = to_array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    q, k, v = (x[0] for x in inputs)
    longest = int(lengths.max())
    return cupyflash.attention_varlen(q, k, v, cu, cu, longest, longest, mask_mod=lambda b, h, q, kv: kv <= q)


def biased_reference(q, k, v, bias, scale):  # noqa: ANN001, ANN201
    """float64 attention with an additive (H, N, N) bias (-inf: hidden), q/k/v (1, N, H, d)."""
    q, k, v = (reference.to_numpy64(x)[0].transpose(1, 0, 2) for x in (q, k, v))
    s = scale * q @ k.transpose(0, 2, 1) + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2)[None]


def learned_bias_gradient(n: int, heads: int, d: int, device: str) -> float:
    """A relative-position bias table that trains: its gradient through ``score_mod`` (dS times
    the derivative, summed where each entry was read) against torch autograd of the bias written
    out, in float64. The largest difference."""
    import torch

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, heads, d, generator=gen, dtype=torch.float64).to(device) for _ in range(3))
    table = (0.1 * torch.randn(heads, 2 * n, generator=gen, dtype=torch.float64)).to(device)
    weights = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(device)  # a loss of the output
    mine, theirs = (table.clone().requires_grad_() for _ in range(2))
    out = cupyflash.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + mine[h, j - i + n], causal=True)
    i, j = torch.arange(n, device=device)[:, None], torch.arange(n, device=device)[None, :]
    s = torch.einsum("bihd,bjhd->bhij", q, k) * d**-0.5 + theirs[:, j - i + n]
    want = torch.einsum("bhij,bjhd->bihd", s.masked_fill(j > i, float("-inf")).softmax(-1), v)
    for result in (out, want):
        (result * weights).sum().backward()
    return float((mine.grad - theirs.grad).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="PyTorch CUDA tensors in bf16 (the kernels)")
    parser.add_argument("--n", type=int, default=256, help="tokens")
    args = parser.parse_args()
    n, heads, d = args.n, 4, 64
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((1, n, heads, d)).astype(np.float32) for _ in range(3)]
    if args.gpu:
        import torch

        inputs = [torch.from_numpy(x).cuda().to(torch.bfloat16) for x in host]
        to_array = lambda x: torch.from_numpy(x).cuda()  # noqa: E731
    else:
        inputs, to_array = host, lambda x: x
    scale = d**-0.5
    for name, score_mod, mask_mod, builtin, bias in gallery(n, heads, to_array):
        out = cupyflash.attention(*inputs, score_mod=score_mod, mask_mod=mask_mod)
        if builtin is not None:
            other = cupyflash.attention(*inputs, **builtin)
        else:
            other = biased_reference(*inputs, bias, scale)
        diff = float(np.abs(reference.to_numpy64(out) - reference.to_numpy64(other)).max())
        print(f"{name:24s} max |difference| {diff:.2e}")
        if name == "document masking":  # the same documents packed end to end: attention_varlen
            packed = packed_documents(inputs, n, heads, to_array)
            diff = float(np.abs(reference.to_numpy64(packed) - reference.to_numpy64(out)[0]).max())
            print(f"{'  packed (varlen)':24s} max |difference| {diff:.2e}")
    try:  # the learned bias's gradient (torch autograd: on the GPU with --gpu, else the host path)
        diff = learned_bias_gradient(min(n, 128), heads, d, "cuda" if args.gpu else "cpu")
        print(f"{'learned bias, gradient':24s} max |difference| {diff:.2e}")
    except ImportError:
        print("learned bias, gradient   (needs PyTorch)")


if __name__ == "__main__":
    main()
