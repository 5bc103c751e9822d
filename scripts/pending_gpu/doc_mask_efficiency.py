"""Where the document mask's time goes, forward, bf16 (bench.MODS_SHAPES' d = 64 shapes unless
given other head dims after the JSON path,
the gallery's four documents): ours with its block mask and FlexAttention with its own, each
beside the same side's call without a mask, all in one process (interleaved rounds). The
visible share of the scores is sum(L_i^2) / N^2 over the documents' lengths, so "rate" is each
call's TFLOP/s on the visible scores alone; "over dense" that rate over the same side's dense
rate: 1.0 would mean the masked call runs at its dense speed on the work it keeps.
    usage (GPU machine): python3 scripts/pending_gpu/doc_mask_efficiency.py [JSON [HEAD_DIM ...]]"""

import json
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import cupyflash
from cupyflash import bench

torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
flex = torch.compile(flex_attention, dynamic=False)


def measure(shape: bench.PrefillShape, name: str, functions: dict) -> dict:
    n = shape.seqlen
    mask_mod = functions[name]["mask_mod"]
    q, k, v = bench.prefill_inputs(shape)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ours_block = cupyflash.create_block_mask(mask_mod, None, None, n, n, device="cuda")
    flex_block = create_block_mask(functions[name]["flex_mask"], None, None, n, n, device="cuda")
    # the visible scores, counted from the mask itself a row block at a time
    keys = torch.arange(n, device="cuda")
    visible = sum(int(mask_mod(0, 0, keys[r0 : r0 + 1024, None], keys[None, :]).sum()) for r0 in range(0, n, 1024))
    calls = {
        "ours_mask": lambda: cupyflash.attention(q, k, v, block_mask=ours_block),
        "ours_dense": lambda: cupyflash.attention(q, k, v),
        "flex_mask": lambda: flex(qt, kt, vt, block_mask=flex_block),
        "flex_dense": lambda: flex(qt, kt, vt),
    }
    ms = bench.three_timings_ms(calls, repeat=15, warmup_ms=200.0)
    flops_dense = 4 * shape.batch * shape.heads * n * n * shape.head_dim
    share = visible / (n * n)
    row = {"function": name, "d": shape.head_dim, "N": n, "visible": round(share, 4),
           "sparsity_ours": round(ours_block.sparsity(), 4), "ms": ms}  # fmt: skip
    for timing, by in ms.items():
        rate = {key: flops_dense * (share if key.endswith("mask") else 1) / t / 1e9 for key, t in by.items()}
        row[timing] = {
            "ours_rate": round(rate["ours_mask"], 1),
            "flex_rate": round(rate["flex_mask"], 1),
            "ours_over_dense": round(rate["ours_mask"] / rate["ours_dense"], 3),
            "flex_over_dense": round(rate["flex_mask"] / rate["flex_dense"], 3),
            "ours_over_flex": round(by["flex_mask"] / by["ours_mask"], 3),
            "dense_ours_over_flex": round(by["flex_dense"] / by["ours_dense"], 3),
        }
    return row


rows = []
head_dims = [int(d) for d in sys.argv[2:]] or [64]
for shape in bench.MODS_SHAPES:
    if shape.head_dim in head_dims:
        functions = bench.mods_gallery(shape.seqlen, shape.heads)
        for name in ("document", "document_causal"):
            rows.append(measure(shape, name, functions))
            print(json.dumps({key: value for key, value in rows[-1].items() if key != "ms"}), flush=True)
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)
