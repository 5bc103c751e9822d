"""ALiBi's cost on the FA2 kernel (forward; forward + backward), and SDPA with the same bias as
an additive float mask (its efficient kernel: flash and cuDNN take no ALiBi), one process."""
import json, torch, cupyflash
from cupyflash import bench
for d in (64, 128):
    for n, causal in ((4096, False), (4096, True), (16384, True)):
        shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, causal, "bfloat16")
        q, k, v = bench.prefill_inputs(shape)
        h = shape.heads
        slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1) / h)).float().cuda()
        i = torch.arange(n, device="cuda")
        bias = (-slopes[:, None, None] * (i[:, None] - i[None, :]).abs()).to(torch.bfloat16)
        if causal:
            bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel
        def sdpa():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias[None].expand(shape.batch, -1, -1, -1))
        calls = {
            "fa2": lambda: cupyflash.attention(q, k, v, causal=causal, algorithm="fa2"),
            "fa2_alibi": lambda: cupyflash.attention(q, k, v, causal=causal, alibi_slopes=slopes),
            "auto": lambda: cupyflash.attention(q, k, v, causal=causal),
            "sdpa_efficient_bias": sdpa,
        }
        ms = bench.cuda_times_ms(calls, repeat=20)
        print(json.dumps({"d": d, "n": n, "causal": causal, **{f"{k}_tflops": round(shape.flops / t / 1e9, 1) for k, t in ms.items()}}), flush=True)
