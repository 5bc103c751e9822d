"""The small GPT-style decoder that the examples run: random weights, GQA, plain weight tensors
(no torch.nn module), attention left to the caller."""

from __future__ import annotations

import torch


class TinyGPT:
    """Pre-norm decoder: token + position embeddings, n_layers x (GQA attention, 4x GELU MLP).

    The weights are drawn from a generator seeded with 0 on ``device`` and cast to ``dtype``
    (bfloat16 on the GPU; float32 for the tests' CPU runs). A caller splits q, k, v out of a
    layer's input, attends as it likes and hands the result to ``finish_layer``.
    """

    def __init__(
        self, *, vocab: int, d_model: int, n_layers: int, heads_q: int, heads_kv: int, max_len: int,
        device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
    ) -> None:  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(0)
        randn = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
        w = lambda *shape: (randn(*shape) / shape[0] ** 0.5).to(dtype)  # noqa: E731
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, d_model // heads_q
        kv_dim = heads_kv * self.head_dim
        self.embed = randn(vocab, d_model).to(dtype)
        self.pos = (0.1 * randn(max_len, d_model)).to(dtype)
        self.layers = [
            {
                "qkv": w(d_model, d_model + 2 * kv_dim),
                "out": w(d_model, d_model),
                "up": w(d_model, 4 * d_model),
                "down": w(4 * d_model, d_model),
            }
            for _ in range(n_layers)
        ]
        self.unembed = w(d_model, vocab)

    def split_qkv(
        self, x: torch.Tensor, layer: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, N, d_model] -> q [B, N, Hq, d], k and v [B, N, Hkv, d] (views of one product)."""
        b, n, _ = x.shape
        qkv = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ layer["qkv"]
        q, k, v = qkv.split([self.heads_q * self.head_dim, *(2 * [self.heads_kv * self.head_dim])], dim=-1)
        return (
            q.reshape(b, n, self.heads_q, self.head_dim),
            k.reshape(b, n, self.heads_kv, self.head_dim),
            v.reshape(b, n, self.heads_kv, self.head_dim),
        )

    def finish_layer(self, x: torch.Tensor, attn: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        """x [B, N, d_model] and the layer's attention [B, N, Hq, d] -> the layer's output."""
        x = x + attn.flatten(2) @ layer["out"]
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ layer["up"]
        return x + torch.nn.functional.gelu(h) @ layer["down"]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.unembed
