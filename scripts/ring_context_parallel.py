"""Context parallelism through ring-flash-attn on cupyflash, on real processes: every rank holds a
slice of one long sequence, runs ring-flash-attn's function over ``torch.distributed``, and rank 0
compares the gathered output and gradients with single-device ``cupyflash.attention`` on the
whole sequence, then times a training step (forward + backward) of both.

    torchrun --nproc_per_node=2 scripts/ring_context_parallel.py                 # GPUs, NCCL
    torchrun --nproc_per_node=2 scripts/ring_context_parallel.py --cpu           # CPUs, gloo

What it should print on GPUs (bf16): for each function, the largest relative error of out, dq,
dk and dv against the single-device call (bf16 rounding: below ~2e-2; dq is returned in bf16 by
ring-flash-attn), and the step time per rank beside the single-device step. On CPUs (gloo, the
host path; 2 and 4 processes on the development machine, 2026-12-05) every error is 1e-3 to
3e-3 (`ring world 2: rel. error out 1.1e-03 dq 1.5e-03 dk 2.7e-03 dv 3.1e-03`); the times
mean nothing there.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import cupyflash
import cupyflash.flash_attn


def _shard(x: torch.Tensor, kind: str, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s tokens (axis 1) as each function lays them out."""
    if kind == "zigzag":
        chunks = x.chunk(2 * world, dim=1)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=1)
    if kind == "stripe":
        return x[:, rank::world]
    return x.chunk(world, dim=1)[rank]


def _unshard(parts: list[torch.Tensor], kind: str, world: int) -> torch.Tensor:
    if kind == "zigzag":
        halves = [p.chunk(2, dim=1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=1)
    if kind == "stripe":
        out = torch.empty(parts[0].shape[0], parts[0].shape[1] * world, *parts[0].shape[2:], dtype=parts[0].dtype,
                          device=parts[0].device)  # fmt: skip
        for r, p in enumerate(parts):
            out[:, r::world] = p
        return out
    return torch.cat(parts, dim=1)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU tensors: a check of the logic")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    ring_flash_attn = _import_ring_flash_attn()

    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if not args.cpu:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16  # what ring-flash-attn is written for (it exchanges float32 gradient buffers)
    n = args.seqlen if not args.cpu else min(args.seqlen, 128 * world)
    generator = torch.Generator(device="cpu").manual_seed(0)  # the same inputs on every rank
    q, k, v, dout = (torch.randn(1, n, args.heads, args.head_dim, generator=generator, dtype=torch.float32)
                     .to(device, dtype) for _ in range(4))  # fmt: skip

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = cupyflash.attention(*leaves, causal=True)
    want.backward(dout)
    functions = {"ring": ring_flash_attn.ring_flash_attn_func, "zigzag": ring_flash_attn.zigzag_ring_flash_attn_func,
                 "stripe": ring_flash_attn.stripe_flash_attn_func}  # fmt: skip
    for kind, function in functions.items():
        mine = [_shard(x, kind, rank, world).detach().clone().requires_grad_() for x in (q, k, v)]

        def step(mine: list[torch.Tensor] = mine, function: object = function, kind: str = kind) -> torch.Tensor:
            for x in mine:
                x.grad = None
            out = function(*mine, causal=True)  # type: ignore[operator]
            out.backward(_shard(dout, kind, rank, world))
            return out

        out = step()
        results = []
        for local in (out.detach(), *(x.grad for x in mine)):
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local.contiguous())
            results.append(_unshard(gathered, kind, world))
        errors = [_relative_error(g, w) for g, w in zip(results, (want.detach(), *(x.grad for x in leaves)))]
        seconds = _time(step, args.steps, args.cpu)
        if rank == 0:
            print(f"{kind:7s} world {world}: rel. error out {errors[0]:.1e} dq {errors[1]:.1e} dk {errors[2]:.1e} "
                  f"dv {errors[3]:.1e}; step {seconds * 1e3:.2f} ms per rank", flush=True)  # fmt: skip

    def single() -> None:
        for x in leaves:
            x.grad = None
        cupyflash.attention(*leaves, causal=True).backward(dout)

    if rank == 0:
        print(f"single device, whole sequence: step {_time(single, args.steps, args.cpu) * 1e3:.2f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _import_ring_flash_attn() -> object:
    """ring_flash_attn over cupyflash.flash_attn. ring-flash-attn 0.1.8's transformers adapter
    does not import under transformers 5: it is stubbed then (this script does not use it)."""
    import sys
    import types

    cupyflash.flash_attn.install()  # before ring_flash_attn is imported
    try:
        import ring_flash_attn
    except ImportError:
        for name in [n for n in sys.modules if n.startswith("ring_flash_attn")]:
            del sys.modules[name]
        stub = types.ModuleType("ring_flash_attn.adapters")
        stub.substitute_hf_flash_attn = stub.update_ring_flash_attn_params = None  # type: ignore[attr-defined]
        sys.modules["ring_flash_attn.adapters"] = stub
        import ring_flash_attn
    return ring_flash_attn


def _time(step: object, steps: int, cpu: bool) -> float:
    """Median seconds of one call of ``step`` after a warm-up call."""
    step()  # type: ignore[operator]
    samples = []
    for _ in range(steps):
        if not cpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()  # type: ignore[operator]
        if not cpu:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


if __name__ == "__main__":
    main()
