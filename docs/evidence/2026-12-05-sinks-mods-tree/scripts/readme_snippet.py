import torch, cupyflash
from cupyflash import mods
doc_id = torch.repeat_interleave(torch.arange(4, device="cuda"), 1024)
def document_causal(b, h, q_idx, kv_idx):
    return (doc_id[q_idx] == doc_id[kv_idx]) & (kv_idx <= q_idx)
def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * mods.tanh(score / 30.0)
q = torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
sinks = torch.zeros(16, device="cuda", requires_grad=True)
out = cupyflash.attention(q, k, v, mask_mod=document_causal, score_mod=softcap, sinks=sinks)
out.float().sum().backward()
print("snippet ok", tuple(q.grad.shape), float(sinks.grad.abs().sum()) > 0, bool(torch.isfinite(q.grad).all()))
