"""A serving loop in miniature: continuous batching over a paged KV cache, as vLLM schedules it.

Requests with prompts and generation lengths of their own arrive over time (a fixed, seeded
schedule counted in steps) and are served by one loop. A page allocator hands each request pages
of a shared K/V pool ``(layers, num_pages, page_size, Hkv, d)`` as its sequence grows (a request
is admitted only when the free pages cover what every running request may still need, so none is
ever preempted) and takes them back when it finishes. Every step runs ONE packed batch through
the model: each request in decode contributes its last token, each request still in its prompt a
chunk of it (chunked prefill); the new tokens' K/V rows are written into their pages through a
slot mapping (``page * page_size + offset``) and each layer's attention is one call,

    cupyflash.attention_varlen(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal=True, block_table=block_table)

over the packed queries and every request's keys in place in the pages: the causal mask is
aligned bottom-right per sequence, so a decode row sees all of its keys and a prompt chunk's rows
see the cache before the chunk plus the chunk causally. ``--backend sdpa`` runs the same loop
with PyTorch SDPA over each request's keys gathered from the pages (the decode rows as one
padded batch with a key mask, each prompt chunk alone), the reference. With both backends (the
default) the SDPA run is fed the tokens that the cupyflash run generated, so both see the same
inputs at every position (in bfloat16 a near-tie between two tokens can go either way, and two
free-running runs would part there for good), and the two runs' logits and greedy picks are
compared per request. Reports tokens/s and the per-step latency (mean, p50, p90, max) of each
backend, each timed run after an untimed warm-up run over the first requests.

    python examples/serve.py [--requests 128] [--page-size 16] [--max-chunk 256] [--backend both] [--json PATH]
    python examples/serve.py --device cpu --requests 6 --vocab 64 --d-model 32 --layers 2 --heads-q 4 \\
        --heads-kv 2 --prompt-len 3 24 --gen-len 2 8 --page-size 4 --max-chunk 8 --num-pages 24

Needs PyTorch. On CUDA the model runs in bfloat16; ``--device cpu`` runs float32 torch CPU
tensors, which cupyflash takes through its array-API host path (tiny sizes: the tests run it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tinygpt import TinyGPT

import cupyflash

# Relative logits difference (Frobenius norm over one request's sampled rows) allowed between
# the two backends. float32: both compute the same float32 sums in another order (~1e-6 seen on
# the CPU). bfloat16: each attention output is rounded to bfloat16 (relative 2^-9 per element)
# by both, but not always the same way, and the difference grows through the layers; 2.5e-2 holds
# 3x above the 7e-3 measured on the CPU runs of the CLI's default model in bfloat16.
LOGITS_BOUND = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2, torch.float16: 5e-3}
# Index arrays of a step share one host-to-device copy; each starts on a 16-byte boundary.
_ALIGN = 4


@dataclass(frozen=True)
class Request:
    rid: int
    arrival: int  # the step at which the request arrives
    prompt: tuple[int, ...]
    gen_len: int  # tokens to generate

    @property
    def max_keys(self) -> int:
        """K/V rows the request ever holds: the last generated token is never fed back."""
        return len(self.prompt) + self.gen_len - 1


def make_schedule(
    count: int, *, rate: float, prompt_len: Sequence[int], gen_len: Sequence[int], vocab: int, seed: int
) -> list[Request]:
    """``count`` requests arriving as a Poisson process of ``rate`` requests per step, prompt and
    generation lengths uniform in the inclusive ranges, random prompt tokens."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[0] = 0.0  # the first request opens the run
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    prompts = rng.integers(prompt_len[0], prompt_len[1] + 1, size=count)
    gens = rng.integers(gen_len[0], gen_len[1] + 1, size=count)
    return [
        Request(rid, int(arrivals[rid]), tuple(rng.integers(0, vocab, size=int(prompts[rid])).tolist()), int(gens[rid]))
        for rid in range(count)
    ]


class PagePool:
    """The free list of the K/V pool's pages. Pages are handed out one at a time from a shuffled
    list (so a sequence's pages lie scattered, as in a server that has run a while), given back
    when a request finishes, and a page given back twice or never taken is an error."""

    def __init__(self, num_pages: int, *, seed: int) -> None:
        self.num_pages = num_pages
        self.free: list[int] = np.random.default_rng(seed).permutation(num_pages).tolist()
        self.in_use: set[int] = set()
        self.peak_in_use = 0

    def take(self) -> int:
        page = self.free.pop()
        self.in_use.add(page)
        self.peak_in_use = max(self.peak_in_use, len(self.in_use))
        return page

    def give_back(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.in_use.remove(page)
            self.free.append(page)


# The tokens a run feeds instead of its own picks: request id -> its generated tokens.
Forced = dict[int, list[int]] | None


@dataclass
class Running:
    """A request being served: its pages (block-table row), how many of its tokens have their
    K/V rows in those pages, and what it has generated."""

    request: Request
    pages: list[int] = field(default_factory=list)
    cached: int = 0
    output: list[int] = field(default_factory=list)
    picks: list[int] = field(default_factory=list)  # this backend's greedy choice at each position
    chunks: int = 0  # steps its prompt took

    def tokens(self, n: int) -> Sequence[int]:
        """The next ``n`` tokens to feed: a chunk of the prompt, or the last generated token."""
        if self.in_prefill():
            return self.request.prompt[self.cached : self.cached + n]
        return self.output[-1:]

    def samples(self, n: int) -> bool:
        """Whether feeding ``n`` tokens reaches the end of the sequence, so that the last row's
        logits pick the next token."""
        return self.cached + n == len(self.request.prompt) + len(self.output)

    def in_prefill(self) -> bool:
        return self.cached < len(self.request.prompt)


class Scheduler:
    """First come, first served. Each step: every running request in decode gets its one token,
    then the requests still in their prompt get chunks of up to ``max_chunk`` tokens in admission
    order while the step's ``max_step_tokens`` budget lasts. A waiting request is admitted when
    fewer than ``max_seqs`` run and the free pages, less those that the running requests may still
    take, cover its whole sequence; pages themselves are taken as the sequence grows."""

    def __init__(
        self, requests: Sequence[Request], pool: PagePool, *, page_size: int, max_chunk: int, max_step_tokens: int,
        max_seqs: int,
    ) -> None:  # fmt: skip
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
        self.waiting: deque[Request] = deque()
        self.running: list[Running] = []
        self.finished: dict[int, Running] = {}
        self.pool, self.page_size = pool, page_size
        self.max_chunk, self.max_step_tokens, self.max_seqs = max_chunk, max_step_tokens, max_seqs
        self.clock = 0  # the step count that arrivals are measured in
        self.steps_waiting_for_pages = 0
        for r in requests:
            if self.pages_for(r.max_keys) > pool.num_pages:
                raise ValueError(
                    f"request {r.rid} needs {self.pages_for(r.max_keys)} pages; the pool has {pool.num_pages}"
                )

    def pages_for(self, keys: int) -> int:
        return -(-keys // self.page_size)

    def done(self) -> bool:
        return not (self.pending or self.waiting or self.running)

    def _admit(self) -> None:
        while self.pending and self.pending[0].arrival <= self.clock:
            self.waiting.append(self.pending.popleft())
        promised = sum(self.pages_for(s.request.max_keys) - len(s.pages) for s in self.running)
        while self.waiting and len(self.running) < self.max_seqs:
            need = self.pages_for(self.waiting[0].max_keys)
            if need > len(self.pool.free) - promised:
                self.steps_waiting_for_pages += 1
                break
            self.running.append(Running(self.waiting.popleft()))
            promised += need

    def next_step(self) -> list[tuple[Running, int]]:
        """The step's work, (sequence, tokens it feeds), decodes first; pages taken for them.
        With nothing to run, the clock moves on to the next arrival and the step is empty."""
        self._admit()
        if not self.running:
            self.clock = self.pending[0].arrival
            return []
        work = [(s, 1) for s in self.running if not s.in_prefill()]
        budget = self.max_step_tokens - len(work)
        for s in self.running:
            if s.in_prefill() and budget > 0:
                n = min(self.max_chunk, len(s.request.prompt) - s.cached, budget)
                work.append((s, n))
                budget -= n
        for s, n in work:
            while len(s.pages) < self.pages_for(s.cached + n):
                s.pages.append(self.pool.take())
        return work

    def finish_step(self, work: Sequence[tuple[Running, int]], picks: dict[int, int], forced: Forced) -> None:
        """The step's K/V rows are in the cache; sequences that sampled append their token (the
        forced one, where given); finished requests give their pages back."""
        for s, n in work:
            s.chunks += s.in_prefill()
            s.cached += n
            if s.request.rid in picks:
                s.picks.append(picks[s.request.rid])
                token = picks[s.request.rid] if forced is None else forced[s.request.rid][len(s.output)]
                s.output.append(token)
                if len(s.output) == s.request.gen_len:
                    self.pool.give_back(s.pages)
                    self.running.remove(s)
                    self.finished[s.request.rid] = s
        self.clock += 1


@dataclass
class Step:
    """One packed batch on the device. Sequence b's query rows are ``cu_q[b] : cu_q[b + 1]``;
    its keys, counted by ``cu_k``, are all of its tokens in the pages after this step's write."""

    tokens: torch.Tensor  # [T] int32, the packed input tokens
    positions: torch.Tensor  # [T] int32, each token's position in its sequence
    slots: torch.Tensor  # [T] int32, page * page_size + offset of each token's K/V row
    cu_q: torch.Tensor  # [B + 1] int32
    cu_k: torch.Tensor  # [B + 1] int32
    block_table: torch.Tensor  # [B, max_pages] int32; entries past a sequence's pages are 0
    sample_rows: torch.Tensor  # [S] int32, the rows whose logits pick a next token
    queries: list[int]  # host copies: each sequence's query count,
    keys: list[int]  # its key count,
    decodes: int  # and how many lead the batch with one token of a generated sequence


def pack_step(work: Sequence[tuple[Running, int]], *, page_size: int, width: int, device: str) -> Step:
    """The step's index arrays, built on the host and copied to the device in one transfer."""
    queries = [n for _, n in work]
    keys = [s.cached + n for s, n in work]
    table = np.zeros((len(work), width), np.int32)
    tokens, positions, slots = [], [], []
    for b, (s, n) in enumerate(work):
        pos = np.arange(s.cached, s.cached + n)
        pages = np.asarray(s.pages)
        table[b, : len(pages)] = pages
        tokens.append(s.tokens(n))
        positions.append(pos)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    cu_q = np.cumsum([0, *queries])
    samples = [cu_q[b + 1] - 1 for b, (s, n) in enumerate(work) if s.samples(n)]
    host = {
        "tokens": np.concatenate(tokens), "positions": np.concatenate(positions), "slots": np.concatenate(slots),
        "cu_q": cu_q, "cu_k": np.cumsum([0, *keys]), "block_table": table, "sample_rows": np.asarray(samples),
    }  # fmt: skip
    starts = np.cumsum([0, *(-(-a.size // _ALIGN) * _ALIGN for a in host.values())])
    buffer = np.zeros(starts[-1], np.int32)
    for start, a in zip(starts, host.values()):
        buffer[start : start + a.size] = a.ravel()
    on_device = torch.from_numpy(buffer).to(device)
    views = {name: on_device[start : start + a.size].view(a.shape) for (name, a), start in zip(host.items(), starts)}
    decodes = sum(not s.in_prefill() for s, _ in work)
    return Step(**views, queries=queries, keys=keys, decodes=decodes)


# attention(q [T, Hq, d], k_pages, v_pages [num_pages, page_size, Hkv, d]) -> [T, Hq, d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cupyflash_attention(step: Step, *, page_size: int, group: int) -> Attend:
    """The packed rows over the pages in place: one varlen call per layer."""
    max_q, max_k = max(step.queries), max(step.keys)

    def attend(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        return cupyflash.attention_varlen(
            q, k_pages, v_pages, step.cu_q, step.cu_k, max_q, max_k, causal=True, block_table=step.block_table
        )

    return attend


def sdpa_attention(step: Step, *, page_size: int, group: int) -> Attend:
    """The reference: PyTorch SDPA over each sequence's keys gathered from the pages, the decode
    rows as one batch padded to its longest sequence, each prompt chunk alone, with the
    bottom-right causal mask written out (query i of a sequence with Nq queries and Nk keys sees
    key j iff j <= i + Nk - Nq, which also hides the padding). The query heads that share a KV
    head are folded into its rows, so that K and V are neither copied per query head nor left to
    the GQA support of whichever SDPA kernel runs. Gather indices and masks are made once a step."""
    device = step.tokens.device
    key = torch.arange(max(step.keys), device=device)
    key_slots = step.block_table[:, key // page_size] * page_size + key % page_size  # [B, max_k]
    key_counts = step.cu_k[1:] - step.cu_k[:-1]  # [B]
    spans = [(0, step.decodes)] if step.decodes else []
    spans += [(b, b + 1) for b in range(step.decodes, len(step.keys))]
    cu_q = np.cumsum([0, *step.queries])
    groups = []  # (query rows, key slots [b, Nk], mask [b, 1, group * Nq, Nk])
    for b0, b1 in spans:
        n_q, n_k = step.queries[b0], max(step.keys[b0:b1])
        row = (torch.arange(group * n_q, device=device) % n_q)[:, None]  # folded row g * Nq + i -> i
        mask = key[:n_k] <= row + (key_counts[b0:b1, None, None] - n_q)
        groups.append((slice(int(cu_q[b0]), int(cu_q[b1])), key_slots[b0:b1, :n_k], mask[:, None]))

    def attend(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        heads_q, heads_kv, d = q.shape[1], k_pages.shape[2], q.shape[2]
        k_rows, v_rows = k_pages.flatten(0, 1), v_pages.flatten(0, 1)  # [num_pages * page_size, Hkv, d]
        out = []
        for rows, slots, mask in groups:
            b = slots.shape[0]
            # [b * Nq, Hq, d] -> [b, Hkv, group * Nq, d]: row g * Nq + i is query i of head kv * group + g
            qg = q[rows].reshape(b, -1, heads_kv, group, d).permute(0, 2, 3, 1, 4).flatten(2, 3)
            kg, vg = k_rows[slots].transpose(1, 2), v_rows[slots].transpose(1, 2)  # [b, Hkv, Nk, d]
            o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
            out.append(o.unflatten(2, (group, -1)).permute(0, 3, 1, 2, 4).reshape(-1, heads_q, d))
        return torch.cat(out)

    return attend


BACKENDS = {"cupyflash": cupyflash_attention, "sdpa": sdpa_attention}


def forward(model: TinyGPT, k_pool: torch.Tensor, v_pool: torch.Tensor, step: Step, attend: Attend) -> torch.Tensor:
    """One packed batch through the model: each layer writes its new K/V rows into their pages,
    then attends. Returns the logits of the sampled rows, [S, vocab]."""
    x = (model.embed[step.tokens] + model.pos[step.positions])[None]  # [1, T, d_model]
    for i, layer in enumerate(model.layers):
        q, k, v = model.split_qkv(x, layer)
        k_pool[i].flatten(0, 1)[step.slots] = k[0]
        v_pool[i].flatten(0, 1)[step.slots] = v[0]
        x = model.finish_layer(x, attend(q[0], k_pool[i], v_pool[i])[None], layer)
    return model.logits(x[0, step.sample_rows])


@dataclass
class Run:
    """What one pass over the schedule did: per request its state at the end, the sampled
    logits in the order they were sampled (with the request of each row), each step's time."""

    finished: dict[int, Running]
    logits: torch.Tensor  # [sampled rows, vocab]
    logit_rids: list[int]
    step_seconds: list[float]
    step_tokens: list[int]
    step_seqs: list[int]
    pool: PagePool
    steps_waiting_for_pages: int


def serve(
    model: TinyGPT, requests: Sequence[Request], *, backend: str, page_size: int, num_pages: int, max_chunk: int,
    max_step_tokens: int, max_seqs: int, device: str, forced: Forced = None,
) -> Run:  # fmt: skip
    """Serve every request of the schedule to the end, greedily (or feeding ``forced``)."""
    shape = (len(model.layers), num_pages, page_size, model.heads_kv, model.head_dim)
    k_pool = torch.zeros(shape, device=device, dtype=model.embed.dtype)
    v_pool = torch.zeros(shape, device=device, dtype=model.embed.dtype)
    pool = PagePool(num_pages, seed=1)
    scheduler = Scheduler(requests, pool, page_size=page_size, max_chunk=max_chunk, max_step_tokens=max_step_tokens,
                          max_seqs=max_seqs)  # fmt: skip
    width = max(scheduler.pages_for(r.max_keys) for r in requests)  # of the block table
    group = model.heads_q // model.heads_kv
    logits, logit_rids, seconds, tokens, seqs = [], [], [], [], []
    while not scheduler.done():
        start = time.perf_counter()
        work = scheduler.next_step()
        if not work:
            continue  # nothing arrived yet: no step, no time counted
        step = pack_step(work, page_size=page_size, width=width, device=device)
        attend = BACKENDS[backend](step, page_size=page_size, group=group)
        rows = forward(model, k_pool, v_pool, step, attend)
        rids = [s.request.rid for s, n in work if s.samples(n)]
        picks = dict(zip(rids, rows.argmax(-1).tolist()))  # the host waits for the step here
        scheduler.finish_step(work, picks, forced)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(step.queries))
        seqs.append(len(work))
        logits.append(rows)
        logit_rids += rids
    assert not pool.in_use and sorted(pool.free) == list(range(num_pages)), "pages were not given back"
    return Run(scheduler.finished, torch.cat(logits), logit_rids, seconds, tokens, seqs, pool,
               scheduler.steps_waiting_for_pages)  # fmt: skip


def summary(run: Run, requests: Sequence[Request]) -> dict[str, Any]:
    seconds = np.asarray(run.step_seconds)
    generated = sum(r.gen_len for r in requests)
    ms = 1e3 * seconds
    return {
        "steps": len(seconds), "seconds": float(seconds.sum()), "generated_tokens": generated,
        "tokens_fed": int(sum(run.step_tokens)), "generated_tokens_per_s": generated / float(seconds.sum()),
        "tokens_fed_per_s": sum(run.step_tokens) / float(seconds.sum()),
        "step_ms_mean": float(ms.mean()), "step_ms_p50": float(np.percentile(ms, 50)),
        "step_ms_p90": float(np.percentile(ms, 90)), "step_ms_max": float(ms.max()),
        "mean_tokens_per_step": float(np.mean(run.step_tokens)),
        "mean_sequences_per_step": float(np.mean(run.step_seqs)), "num_pages": run.pool.num_pages,
        "peak_pages_in_use": run.pool.peak_in_use, "free_pages_at_end": len(run.pool.free),
        "steps_waiting_for_pages": run.steps_waiting_for_pages,
        "most_chunks_of_one_prompt": max(s.chunks for s in run.finished.values()),
    }  # fmt: skip


def compare(a: Run, b: Run, dtype: torch.dtype) -> dict[str, Any]:
    """Run ``b`` was fed ``a``'s tokens: per request, does ``b`` pick the same greedy tokens, and
    how far apart are the two runs' logits (relative, over the request's sampled rows)."""
    assert a.logit_rids == b.logit_rids, "the two runs sampled in a different order"
    rids = torch.tensor(a.logit_rids, device=a.logits.device)
    la, lb = a.logits.float(), b.logits.float()
    worst, same_requests, differing = 0.0, 0, 0
    for rid, s in a.finished.items():
        rows = rids == rid
        error = float(torch.linalg.norm(la[rows] - lb[rows]) / torch.linalg.norm(la[rows]))
        worst = max(worst, error)
        mismatches = sum(x != y for x, y in zip(s.output, b.finished[rid].picks))
        same_requests += mismatches == 0
        differing += mismatches
    return {
        "requests": len(a.finished), "requests_with_identical_greedy_tokens": same_requests,
        "positions_with_another_greedy_token": differing, "positions": len(a.logit_rids),
        "worst_relative_logits_difference": worst, "bound": LOGITS_BOUND[dtype], "agree": worst < LOGITS_BOUND[dtype],
    }  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--backend", choices=["both", *BACKENDS], default="both")
    add("--device", default="cuda", help="cuda (bfloat16) or cpu (float32)")
    add("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    add("--requests", type=int, default=128)
    add("--rate", type=float, default=1.0, help="requests arriving per step, on average")
    add("--prompt-len", type=int, nargs=2, default=[16, 2048], metavar=("MIN", "MAX"))
    add("--gen-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    add("--page-size", type=int, default=16)
    add("--num-pages", type=int, default=4096, help="pages in the shared pool")
    add("--max-chunk", type=int, default=256, help="prompt tokens a request feeds per step at most")
    add("--max-step-tokens", type=int, default=1024, help="tokens a step feeds at most")
    add("--max-seqs", type=int, default=64, help="requests running at once at most")
    add("--warmup", type=int, default=8, help="requests served once, untimed, before each timed run")
    add("--vocab", type=int, default=4096)
    add("--d-model", type=int, default=1024)
    add("--layers", type=int, default=4)
    add("--heads-q", type=int, default=8)
    add("--heads-kv", type=int, default=2)
    add("--seed", type=int, default=0)
    add("--json", help="write the configuration and the numbers here")
    args = parser.parse_args(argv)
    if min(args.prompt_len[0], args.gen_len[0], args.max_seqs, args.max_chunk) < 1 or args.warmup < 0:
        parser.error("prompts and generations of one token or more, --max-seqs and --max-chunk >= 1")
    if args.max_step_tokens < args.max_seqs:
        parser.error("--max-step-tokens must leave every running request its decode token (>= --max-seqs)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    requests = make_schedule(args.requests, rate=args.rate, prompt_len=args.prompt_len, gen_len=args.gen_len,
                             vocab=args.vocab, seed=args.seed)  # fmt: skip
    max_len = max(len(r.prompt) + r.gen_len for r in requests)
    model = TinyGPT(vocab=args.vocab, d_model=args.d_model, n_layers=args.layers, heads_q=args.heads_q,
                    heads_kv=args.heads_kv, max_len=max_len, device=args.device, dtype=dtype)  # fmt: skip
    options = {"page_size": args.page_size, "num_pages": args.num_pages, "max_chunk": args.max_chunk,
               "max_step_tokens": args.max_step_tokens, "max_seqs": args.max_seqs, "device": args.device}  # fmt: skip
    print(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads_q} query / {args.heads_kv} KV heads of "
          f"{model.head_dim}, {dtype}, random weights, on {args.device}")  # fmt: skip
    print(f"schedule: {len(requests)} requests, ~{args.rate} per step, prompts {args.prompt_len[0]}-"
          f"{args.prompt_len[1]} tokens, {args.gen_len[0]}-{args.gen_len[1]} generated; {args.num_pages} pages of "
          f"{args.page_size}, chunks <= {args.max_chunk}, <= {args.max_step_tokens} tokens and {args.max_seqs} "
          "requests a step")  # fmt: skip
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    runs: dict[str, Run] = {}
    for backend in backends:
        if args.warmup:
            serve(model, requests[: args.warmup], backend=backend, **options)
        forced = None if not runs else {rid: s.output for rid, s in runs["cupyflash"].finished.items()}
        runs[backend] = serve(model, requests, backend=backend, forced=forced, **options)
    results: dict[str, Any] = {"config": {**vars(args), "dtype": str(dtype)}}
    results.update({backend: summary(run, requests) for backend, run in runs.items()})
    print(f"\n{'backend':10} {'steps':>6} {'gen tok/s':>10} {'fed tok/s':>10} {'step ms: mean':>14} {'p50':>7} "
          f"{'p90':>7} {'max':>7}  pages peak/pool")  # fmt: skip
    for backend in runs:
        r = results[backend]
        print(f"{backend:10} {r['steps']:6d} {r['generated_tokens_per_s']:10.0f} {r['tokens_fed_per_s']:10.0f} "
              f"{r['step_ms_mean']:14.2f} {r['step_ms_p50']:7.2f} {r['step_ms_p90']:7.2f} {r['step_ms_max']:7.2f}  "
              f"{r['peak_pages_in_use']}/{r['num_pages']}")  # fmt: skip
    if len(runs) == 2:
        c = results["comparison"] = compare(runs["cupyflash"], runs["sdpa"], dtype)
        print(f"\nsdpa fed cupyflash's tokens: {c['requests_with_identical_greedy_tokens']}/{c['requests']} requests "
              f"with identical greedy tokens ({c['positions_with_another_greedy_token']} of {c['positions']} "
              f"positions differ); worst relative logits difference {c['worst_relative_logits_difference']:.2e} "
              f"(bound {c['bound']:.1e} for {dtype})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if len(runs) == 2:
        assert results["comparison"]["agree"], "the two backends' logits differ beyond the bound"
    return results


if __name__ == "__main__":
    main()
