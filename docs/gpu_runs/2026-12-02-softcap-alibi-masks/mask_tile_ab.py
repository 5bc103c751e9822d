"""The mask forward's tile at d = 128 with its mixed tiles staged through shared memory: the
shipped 128 x 32 (Q in registers) against 128 x 64 (Q in registers or in shared memory), beside
SDPA's cuDNN and efficient backends on the same masks; bf16, H x d = 2048, B x N = 16k, one
process, interleaved. Each cupyflash call rebuilds its plan (the same host cost for each)."""

import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupyflash
from cupyflash import _dispatch, _plan, bench
from cupyflash._specs import TileConfig

TILES = {
    "m128n32_qreg": TileConfig(128, 32, 8, q_in_regs=True),
    "m128n64_qreg": TileConfig(128, 64, 8, q_in_regs=True),
    "m128n64": TileConfig(128, 64, 8),
}
shipped = dict(_dispatch.FA2_FWD_MASK_TILES)


def with_tile(tile, q, k, v, mask):
    if tile is None:  # the shipped tile (d = 256: 128 x 32, eight warps)
        return cupyflash.attention(q, k, v, attn_mask=mask)
    _dispatch.FA2_FWD_MASK_TILES[128] = (tile,)
    _plan.clear_caches()
    try:
        return cupyflash.attention(q, k, v, attn_mask=mask)
    finally:
        _dispatch.FA2_FWD_MASK_TILES.clear()
        _dispatch.FA2_FWD_MASK_TILES.update(shipped)


for d, n in ((128, 1024), (128, 4096), (256, 4096)):
    tiles = TILES if d == 128 else {"shipped": None}
    shape = bench.PrefillShape(16384 // n, n, 2048 // d, d, False, "bfloat16")
    q, k, v = bench.prefill_inputs(shape)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for kind in bench.MASK_KINDS:
        mask = bench._mask_for(kind, shape, torch.Generator(device="cuda").manual_seed(1))

        def sdpa(backend, mask=mask):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)

        calls = {name: (lambda t=t, mask=mask: with_tile(t, q, k, v, mask)) for name, t in tiles.items()}
        calls["sdpa_cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION)
        calls["sdpa_efficient"] = lambda: sdpa(SDPBackend.EFFICIENT_ATTENTION)
        want = calls["sdpa_efficient"]().transpose(1, 2).float()
        row = {"d": d, "n": n, "mask": kind}
        row.update({f"maxdiff_{t}": float((calls[t]().float() - want).abs().max()) for t in tiles})
        ms = bench.cuda_times_ms(calls, repeat=15)
        row.update({f"{key}_tflops": round(shape.flops / t / 1e9, 1) for key, t in ms.items()})
        print(json.dumps(row), flush=True)
