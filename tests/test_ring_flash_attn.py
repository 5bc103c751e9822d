"""ring-flash-attn's context parallelism on cupyflash (``cupyflash.flash_attn.install()``): its
ring, zigzag and stripe functions on several virtual ranks in one process (a thread per rank,
the K/V send/recv of ``RingComm`` replaced by an in-process exchange with the same protocol),
forward and backward against single-process ``cupyflash.attention``, and llama3's varlen
function (its all-gather and reduce-scatter in process) against ``attention_varlen``; and the real
``torch.distributed`` path (gloo) at world size 1. Host float64 tensors, and (marked gpu) bf16
CUDA tensors with a stream per virtual rank, where the same calls run the kernels."""

from __future__ import annotations

import importlib
import queue
import sys
import threading
import types

import pytest

import cupyflash
from cupyflash import flash_attn

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def ring():
    """ring_flash_attn imported over cupyflash.flash_attn. ring-flash-attn 0.1.8's transformers
    adapter does not import under transformers 5: it is stubbed then (it is not under test)."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed")
    flash_attn.install()
    try:
        import ring_flash_attn
    except ImportError:
        for name in [n for n in sys.modules if n.startswith("ring_flash_attn")]:
            del sys.modules[name]
        stub = types.ModuleType("ring_flash_attn.adapters")
        stub.substitute_hf_flash_attn = stub.update_ring_flash_attn_params = None
        sys.modules["ring_flash_attn.adapters"] = stub
        import ring_flash_attn
    yield ring_flash_attn
    flash_attn.uninstall()


class _Exchange:
    """The in-process network of one run: a mailbox per (receiving rank, comm number)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.boxes: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.local = threading.local()  # the rank of this thread, and how many comms it made

    def box(self, rank: int, number: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((rank, number), queue.Queue())


class _VirtualRingComm:
    """ring_flash_attn.utils.RingComm's protocol (send_recv, commit, wait, send_recv_kv) over an
    ``_Exchange``: a rank's n-th comm talks to the n-th comm of its neighbours, as the ranks make
    their comms in one order."""

    def __init__(self, process_group: _Exchange) -> None:
        local = process_group.local
        self.exchange, self.rank, self.world_size = process_group, local.rank, process_group.world_size
        self.number, local.comms = local.comms, local.comms + 1
        self.send_rank, self.recv_rank = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self._sends: list[torch.Tensor] = []
        self._recvs: list[torch.Tensor] = []
        self._committed = False

    def send_recv(self, to_send: torch.Tensor, recv_tensor: torch.Tensor | None = None) -> torch.Tensor:
        res = torch.empty_like(to_send) if recv_tensor is None else recv_tensor
        self._sends.append(to_send)
        self._recvs.append(res)
        return res

    def commit(self) -> None:
        if self._committed:
            raise RuntimeError("commit called twice")
        sent = [x.clone() for x in self._sends]
        _settle(sent)
        for x in sent:
            self.exchange.box(self.send_rank, self.number).put(x)
        self._committed = True

    def wait(self) -> None:
        if not self._committed:
            raise RuntimeError("wait called before commit")
        for res in self._recvs:
            res.copy_(self.exchange.box(self.rank, self.number).get(timeout=60))
        self._sends, self._recvs, self._committed = [], [], False

    def send_recv_kv(self, k, v, k_buffer=None, v_buffer=None):
        next_k, next_v = self.send_recv(k, k_buffer), self.send_recv(v, v_buffer)
        self.commit()
        return next_k, next_v


def _settle(tensors: list) -> None:
    """Wait for the copies a rank made on its own stream before another rank's stream reads them
    (the in-process stand-in for NCCL's stream ordering)."""
    if tensors and tensors[0].is_cuda:
        torch.cuda.current_stream(tensors[0].device).synchronize()


def _on_virtual_ranks(world_size: int, work, device: str = "cpu") -> list:
    """``work(rank, group)`` on one thread per rank (on CUDA each with its own stream, as ranks
    on separate GPUs are unordered); their results in rank order."""
    exchange, results, errors = _Exchange(world_size), [None] * world_size, []

    def run(rank: int) -> None:
        exchange.local.rank, exchange.local.comms = rank, 0
        try:
            if device == "cuda":
                with torch.cuda.stream(torch.cuda.Stream()):
                    results[rank] = work(rank, exchange)
                    _settle([results[rank][0]])
            else:
                results[rank] = work(rank, exchange)
        except BaseException as error:  # noqa: B036 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def _backward(out: torch.Tensor, dout: torch.Tensor, leaves: list) -> list:
    """The gradients of ``leaves`` (the ring function's q, k, v inputs) from ``out``'s backward,
    run on the calling rank's thread. On CPU that is ``out.backward``. On CUDA, autograd's engine
    runs every backward node on one thread per device, where the first virtual rank to reach a
    collective would wait for ranks queued behind it; there each rank applies its Function's own
    backward as the engine would: without grad mode, each gradient in its input's dtype (the first
    three results are dq, dk, dv)."""
    if not out.is_cuda:
        out.backward(dout)
        return [x.grad for x in leaves]
    with torch.no_grad():
        grads = out.grad_fn.apply(dout)[:3]
    return [g.to(x.dtype) for g, x in zip(grads, leaves, strict=True)]


def _shards(kind: str, world_size: int, n: int) -> list[list[int]]:
    """Each rank's token indices: contiguous (ring), chunks r and 2W-1-r (zigzag), every W-th (stripe)."""
    if kind == "zigzag":
        chunk = n // (2 * world_size)
        mirror = 2 * world_size - 1
        return [[*range(r * chunk, (r + 1) * chunk), *range((mirror - r) * chunk, (mirror - r + 1) * chunk)]
                for r in range(world_size)]  # fmt: skip
    if kind == "stripe":
        return [list(range(r, n, world_size)) for r in range(world_size)]
    per = n // world_size
    return [list(range(r * per, (r + 1) * per)) for r in range(world_size)]


# Each kind's module and function: ring_flash_attn.<name>, <name>_func.
_NAMES = {"ring": "ring_flash_attn", "zigzag": "zigzag_ring_flash_attn", "stripe": "stripe_flash_attn"}


# The host runs float64 (ring-flash-attn accumulates its gradients in float32 starting from
# ``block_dq_buffer.to(torch.float32)``, which aliases the buffer, not a copy, for float32
# inputs); a GPU runs bf16, its result against single-GPU cupyflash.attention within bf16 rounding.
_DEVICES = [
    pytest.param("cpu", id="host"),
    pytest.param("cuda", id="cuda-bf16", marks=pytest.mark.gpu),
]


def _tolerances(device: str) -> tuple[dict, dict]:
    """(out, dk and dv) and dq tolerances: ring-flash-attn returns dq in bfloat16
    (ring_flash_attn_backward's .to(torch.bfloat16))."""
    if device == "cuda":
        return dict(rtol=2e-2, atol=2e-2), dict(rtol=3e-2, atol=3e-2)
    return dict(rtol=1e-5, atol=1e-5), dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize(
    ("kind", "world_size", "causal"),
    [
        ("ring", 2, False),
        ("ring", 4, True),
        ("ring", 8, False),
        ("zigzag", 2, True),
        ("zigzag", 4, True),
        ("stripe", 4, True),
    ],  # zigzag and stripe are causal only
)
def test_ring_functions_on_virtual_ranks_match_attention(ring, monkeypatch, kind, world_size, causal, device):
    name = _NAMES[kind]
    monkeypatch.setattr(importlib.import_module(f"ring_flash_attn.{name}"), "RingComm", _VirtualRingComm)
    function = getattr(ring, f"{name}_func")
    torch.manual_seed(world_size)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    # on the GPU, odd-sized shards of a few hundred tokens (several tiles per rank) and d = 64
    n, h, d = (96 * world_size, 4, 64) if device == "cuda" else (32 * world_size, 2, 16)
    q, k, v, dout = (torch.randn(1, n, h, d, dtype=torch.float64).to(device, dtype) for _ in range(4))
    shards = _shards(kind, world_size, n)

    def work(rank, group):
        idx = torch.tensor(shards[rank], device=device)
        mine = [x[:, idx].clone().requires_grad_() for x in (q, k, v)]
        out = function(*mine, causal=causal, group=group)
        return out.detach(), *_backward(out, dout[:, idx], mine)

    results = _on_virtual_ranks(world_size, work, device)
    order = torch.tensor([i for s in shards for i in s], device=device)
    out, dq, dk, dv = (
        torch.empty(1, n, h, d, dtype=dtype, device=device).index_copy_(1, order, torch.cat([r[i] for r in results], 1))
        for i in range(4)
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = cupyflash.attention(*leaves, causal=causal)
    want.backward(dout)
    close, close_dq = _tolerances(device)
    torch.testing.assert_close(out, want.detach(), **close)
    torch.testing.assert_close(dq.to(dtype), leaves[0].grad, **close_dq)
    for got, leaf in zip((dk, dv), leaves[1:]):
        torch.testing.assert_close(got, leaf.grad, **close)


def test_ring_over_torch_distributed_at_world_size_1(ring, tmp_path):
    """The real RingComm over a gloo process group of one rank: the forward (no send/recv at
    world size 1). Its backward sends dk/dv to the rank itself, which gloo refuses ("Pair is not
    connected"); NCCL runs it (the GPU script)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        q, k, v = (torch.randn(2, 24, 2, 16, dtype=torch.float64) for _ in range(3))
        for causal in (False, True):
            out = ring.ring_flash_attn_func(q, k, v, causal=causal)
            torch.testing.assert_close(out, cupyflash.attention(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


class _Collectives:
    """All-gather and reduce-scatter among the threads of one ``_on_virtual_ranks`` run: a
    rank's n-th collective meets the n-th of every other rank."""

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.condition = threading.Condition()
        self.slots: dict[int, list] = {}

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        local, size = self.exchange.local, self.exchange.world_size
        number = local.collectives = getattr(local, "collectives", 0) + 1
        with self.condition:
            slot = self.slots.setdefault(number, [None] * size)
            slot[local.rank] = tensor.clone()
            _settle([slot[local.rank]])
            self.condition.notify_all()
            if not self.condition.wait_for(lambda: all(x is not None for x in slot), timeout=60):
                raise TimeoutError("a virtual rank did not join the collective")
        return list(slot)


class _VirtualAllGatherComm:
    """ring_flash_attn.utils.AllGatherComm over ``_Collectives`` (blocking; wait() is then free)."""

    def __init__(self, group: _Collectives) -> None:
        self.group = group

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        output.copy_(torch.cat(self.group.gather(tensor), 0))

    def wait(self) -> None:
        pass


class _VirtualDist:
    """The torch.distributed calls llama3's varlen functions make, over ``_Collectives``."""

    @staticmethod
    def get_world_size(group: _Collectives) -> int:
        return group.exchange.world_size

    @staticmethod
    def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, group: _Collectives) -> None:
        total = torch.stack(group.gather(tensor)).sum(0)
        output.copy_(total.chunk(group.exchange.world_size)[group.exchange.local.rank])


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize(("world_size", "causal"), [(2, True), (4, True), (4, False)])
def test_llama3_varlen_on_virtual_ranks_matches_attention_varlen(ring, monkeypatch, world_size, causal, device):
    """llama3's context parallelism (each rank's query slice against the keys all-gathered in
    head strides, dk and dv reduce-scattered) over packed sequences that cross the ranks' slices."""
    module = importlib.import_module("ring_flash_attn.llama3_flash_attn_varlen")
    monkeypatch.setattr(module, "Comm", _VirtualAllGatherComm)
    monkeypatch.setattr(module, "dist", _VirtualDist)
    torch.manual_seed(7 + world_size)
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    n, h, d = (96 * world_size, 4, 64) if device == "cuda" else (16 * world_size, 2, 16)
    cu = torch.tensor([0, 5, n // 2 + 3, n - 7, n], dtype=torch.int32, device=device)
    longest = int((cu[1:] - cu[:-1]).max())
    q, k, v, dout = (torch.randn(n, h, d, dtype=torch.float64).to(device, dtype) for _ in range(4))
    per = n // world_size

    def work(rank, exchange):
        group = exchange.collectives
        cu_q, cu_k, max_q, max_k, keys = ring.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world_size)
        rows = slice(rank * per, (rank + 1) * per)
        mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
        out = ring.llama3_flash_attn_varlen_func(
            *mine, cu_q, cu_k, max_q, max_k, heads_k_stride=1, local_k_slice=keys, causal=causal, group=group
        )
        return out.detach(), *_backward(out, dout[rows], mine)

    def run(rank, exchange):
        if not hasattr(exchange, "collectives"):
            with exchange.lock:
                exchange.__dict__.setdefault("collectives", _Collectives(exchange))
        return work(rank, exchange)

    results = _on_virtual_ranks(world_size, run, device)
    out, dq, dk, dv = (torch.cat([r[i] for r in results]) for i in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = cupyflash.attention_varlen(*leaves, cu, cu, longest, longest, causal=causal)
    want.backward(dout)
    close, _ = _tolerances(device)  # llama3 returns dq in the inputs' dtype
    torch.testing.assert_close(out, want.detach(), **close)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, **close)
