"""``python -m cupyflash bench-transformers``: transformers models built from configs (random
init, fixed seed) with cupyflash's attention ("cupyfa", :mod:`cupyflash.integrations.transformers`)
beside transformers' SDPA and eager attention, in one process, on the same model object (switched
with ``set_attn_implementation``, so the weights are the same tensors) and the same inputs:

1. prefill time of the whole model (batch 1 x 8192 and 4 x 2048 tokens), interleaved rounds of
   :func:`cupyflash.bench.cuda_times_ms`, single calls after warm-up and back-to-back calls;
2. logits against a reference (eager attention in float32 on the same bf16 weights; float64 on
   the CPU in float32): cupyflash's max |diff| and top-1 agreement beside SDPA's and eager's in the
   model's dtype (the floor);
3. a left- and a right-padded batch, the same comparison on the valid positions;
4. greedy generation from a left-padded batch with a DynamicCache and a StaticCache: tokens
   against the peer's and tokens per second.

Gemma2's attention softcap is not in SDPA: transformers 5.17 drops it, later releases refuse
SDPA for Gemma2. Its SDPA peer is therefore registered here as transformers' own SDPA function
without the softcap (:data:`SDPA_WITHOUT_SOFTCAP`), timed only; its logits and tokens are checked
against eager attention, which applies the softcap.

``--quick`` runs tiny models (float32 on the CPU: the host path; a CPU test runs the command
end to end). transformers is imported only here.
"""

from __future__ import annotations

import functools
import gc
import inspect
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from . import bench

#: transformers' SDPA function with Gemma2's softcap dropped, registered under this name (no
#: "sdpa" in it: transformers 5.24 checks a name containing "sdpa" against the model's SDPA
#: support, which Gemma2 has not there).
SDPA_WITHOUT_SOFTCAP = "torch_sdp_nosoftcap"
SEED = 0
#: Eager attention materialises (B, H, N, N) scores in float32: timed only up to this length.
EAGER_MAX_SEQLEN = 2048
#: cupyflash's max |logit diff| from the reference may be this many times the floor's (the larger
#: of SDPA's and eager's in the same dtype), as flash-attn's 2x rule for attention outputs.
FLOOR_FACTOR = 2.0


@dataclass(frozen=True)
class Sizes:
    """Per-layer sizes shared by the three families, and the runs' token counts."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    intermediate: int
    vocab: int
    window: int
    prefill: tuple[tuple[int, int], ...]  # (batch, seqlen) of the timed forwards
    check_seqlen: int  # the logits check: one sequence of this length
    padded_lengths: tuple[int, ...]  # the padded batches' valid lengths
    prompt_lengths: tuple[int, ...]  # the generation batch's prompt lengths (left padded)
    new_tokens: int
    repeat: int  # samples per timing (single calls; back-to-back: a quarter as many)
    back_to_back_calls: int  # calls per back-to-back sample
    warmup_ms: float


#: A 1B-class layer (Llama-3.2-1B's width: hidden 2048, 32 heads of 64 there; here 16 heads of
#: d = 128, the head size of the larger models), 8 layers, a 32000 vocabulary so that the LM head
#: does not dominate. The window (1024, shorter than Gemma2's 4096) is crossed by the 2k checks
#: and by the longest generation prompt, not only by the 8k prefill.
GPU_SIZES = Sizes(
    hidden=2048, heads=16, kv_heads=8, head_dim=128, layers=8, intermediate=8192, vocab=32000, window=1024,
    prefill=((1, 8192), (4, 2048)), check_seqlen=2048, padded_lengths=(2048, 1531, 1000, 257),
    prompt_lengths=(1100, 800, 500, 257), new_tokens=32, repeat=20, back_to_back_calls=10, warmup_ms=300.0,
)  # fmt: skip
QUICK_SIZES = Sizes(
    hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, intermediate=128, vocab=101, window=6,
    prefill=((1, 32), (2, 16)), check_seqlen=24, padded_lengths=(17, 12, 9, 5),
    prompt_lengths=(11, 8, 6, 3), new_tokens=4, repeat=1, back_to_back_calls=2, warmup_ms=0.0,
)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A model family's config: which transformers config reproduces its attention, and why."""

    name: str
    config_class: str
    attention: str  # what the config makes the attention do, for the output
    softcap: bool  # attention logit softcapping: SDPA cannot run it


FAMILIES = (
    # LlamaConfig: plain causal attention with GQA (num_key_value_heads < num_attention_heads).
    Family("llama", "LlamaConfig", "causal, GQA", softcap=False),
    # Qwen2Config: use_sliding_window=True turns sliding_window on; max_window_layers = L / 2 keeps
    # the lower half of the layers full and gives the upper half the window, Qwen2's layer rule
    # (layer i slides iff i >= max_window_layers); q/k/v projections with bias.
    Family("qwen2", "Qwen2Config", "causal, GQA, window on the upper half of the layers", softcap=False),
    # Gemma2Config: attn_logit_softcapping (50, Gemma2's) on every layer's scores, sliding_window
    # on alternate layers (its default layer_types), query_pre_attn_scalar = head_dim for the
    # 1/sqrt(d) scale, final_logit_softcapping (30) on the logits.
    Family("gemma2", "Gemma2Config", "causal, GQA, softcap 50, window on alternate layers", softcap=True),
)


def model_config(family: Family, sizes: Sizes) -> Any:
    """The transformers config of ``family`` at ``sizes``; no EOS token, so that generation
    always makes ``new_tokens`` tokens."""
    import transformers

    common: dict[str, Any] = {
        "vocab_size": sizes.vocab, "hidden_size": sizes.hidden, "intermediate_size": sizes.intermediate,
        "num_hidden_layers": sizes.layers, "num_attention_heads": sizes.heads,
        "num_key_value_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
        "max_position_embeddings": 2 * max(n for _, n in sizes.prefill), "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": 0,
    }  # fmt: skip
    if family.name == "qwen2":
        common.update(use_sliding_window=True, sliding_window=sizes.window, max_window_layers=sizes.layers // 2)
    elif family.name == "gemma2":
        common.update(sliding_window=sizes.window, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      query_pre_attn_scalar=sizes.head_dim)  # fmt: skip
    return getattr(transformers, family.config_class)(**common)


def register_peers() -> tuple[str, str]:
    """cupyflash's name and :data:`SDPA_WITHOUT_SOFTCAP` registered with transformers."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from .integrations import transformers as cft

    def without_softcap(*args: Any, softcap: float | None = None, **kwargs: Any) -> Any:
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(SDPA_WITHOUT_SOFTCAP, without_softcap)
    AttentionMaskInterface.register(SDPA_WITHOUT_SOFTCAP, sdpa_mask)
    return cft.register(), SDPA_WITHOUT_SOFTCAP


@dataclass
class Setup:
    device: str
    dtype: Any  # the model's torch dtype
    reference_dtype: Any  # the reference's: float32 for a bf16 model, float64 for a float32 one
    sizes: Sizes
    ours: str  # cupyflash's registered name

    def peer(self, family: Family) -> str:
        """The SDPA entry timed beside cupyflash."""
        return SDPA_WITHOUT_SOFTCAP if family.softcap else "sdpa"

    def checked(self, family: Family) -> tuple[str, ...]:
        """The implementations whose logits and tokens are compared: all three, except SDPA
        where it lacks the model's softcap."""
        return (self.ours, "eager") if family.softcap else (self.ours, "sdpa", "eager")

    def times(
        self, fns: dict[str, Callable[[], Any]], *, calls: int = 1, repeat: int | None = None
    ) -> dict[str, float]:
        """Median ms of each function, interleaved (CUDA events on the GPU, the host clock on the CPU)."""
        timer = bench.cuda_times_ms if self.device == "cuda" else bench.host_times_ms
        return timer(fns, warmup_ms=self.sizes.warmup_ms, repeat=repeat or self.sizes.repeat, calls=calls)

    def sync(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


def build_model(family: Family, setup: Setup) -> Any:
    """Random init on the CPU under the fixed seed (the same weights on any host), then moved
    to the device in the model's dtype; eval mode (no dropout)."""
    import torch
    import transformers

    torch.manual_seed(SEED)
    config = model_config(family, setup.sizes)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=setup.ours)
    return model.to(device=setup.device, dtype=setup.dtype).eval()


def reference_model(family: Family, model: Any, setup: Setup) -> Any:
    """Eager attention in the reference dtype on the model's weights (its rounded values)."""
    import transformers

    config = model_config(family, setup.sizes)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    return reference.to(device=setup.device, dtype=setup.reference_dtype).eval()


def use(model: Any, implementation: str) -> None:
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)


def logits(model: Any, implementation: str, ids: Any, mask: Any = None, **kwargs: Any) -> Any:
    import torch

    use(model, implementation)
    with torch.no_grad():
        return model(ids, attention_mask=mask, **kwargs).logits


def compare(got: Any, want: Any, valid: Any = None) -> dict[str, float]:
    """max |diff| (in float64) and the fraction of positions with the same top-1 token."""
    if valid is not None:
        got, want = got[valid], want[valid]
    got, want = got.double(), want.double()
    return {
        "max_abs_diff": float((got - want).abs().max()),
        "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).double().mean()),
    }


def token_ids(setup: Setup, batch: int, seqlen: int, seed: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, setup.sizes.vocab, (batch, seqlen), generator=gen).to(setup.device)


def padded_batch(setup: Setup, lengths: tuple[int, ...], side: str, seed: int) -> tuple[Any, Any]:
    """Token ids and the 0/1 attention mask of sequences of ``lengths`` padded on ``side``."""
    import torch

    width = max(lengths)
    ids = token_ids(setup, len(lengths), width, seed)
    positions = torch.arange(width)[None, :]
    counts = torch.tensor(lengths)[:, None]
    valid = positions >= width - counts if side == "left" else positions < counts
    mask = valid.long().to(setup.device)
    return ids.masked_fill(mask == 0, 0), mask


def floor_check(rows: dict[str, dict[str, float]], setup: Setup, family: Family) -> dict[str, Any]:
    """cupyflash's max |diff| from the reference against :data:`FLOOR_FACTOR` x the floor."""
    floor = max(rows[name]["max_abs_diff"] for name in setup.checked(family) if name != setup.ours)
    ours = rows[setup.ours]["max_abs_diff"]
    return {"floor_max_abs_diff": floor, "ratio_to_floor": ours / floor if floor else float("inf"),
            "within_floor": ours <= FLOOR_FACTOR * floor}  # fmt: skip


def check_logits(family: Family, model: Any, reference: Any, setup: Setup) -> dict[str, Any]:
    """One sequence of ``check_seqlen`` tokens: each implementation against the reference."""
    ids = token_ids(setup, 1, setup.sizes.check_seqlen, seed=1)
    want = logits(reference, "eager", ids)
    rows = {name: compare(logits(model, name, ids), want) for name in setup.checked(family)}
    return {"tokens": [1, setup.sizes.check_seqlen], "vs_reference": rows, **floor_check(rows, setup, family)}


def check_padded(family: Family, model: Any, reference: Any, setup: Setup, side: str) -> dict[str, Any]:
    """A ``side``-padded batch: each implementation on the valid positions against the reference
    of each sequence alone, unpadded (rotary positions are relative: the offset of left padding
    does not change the logits), and against the peer (SDPA; eager where SDPA lacks the softcap)
    on the same padded batch."""
    import torch

    ids, mask = padded_batch(setup, setup.sizes.padded_lengths, side, seed=2)
    valid = mask.bool()
    want = torch.cat([logits(reference, "eager", row[keep][None])[0] for row, keep in zip(ids, valid)])
    got = {name: logits(model, name, ids, mask) for name in setup.checked(family)}
    peer = "eager" if family.softcap else "sdpa"
    rows = {name: compare(out[valid], want) for name, out in got.items()}
    versus_peer = {name: compare(out, got[peer], valid) for name, out in got.items() if name != peer}
    return {"side": side, "lengths": list(setup.sizes.padded_lengths), "vs_reference": rows,
            "peer": peer, "vs_peer": versus_peer, **floor_check(rows, setup, family)}  # fmt: skip


def check_generation(family: Family, model: Any, setup: Setup, cache: str) -> dict[str, Any]:
    """Greedy generation of ``new_tokens`` from a left-padded batch with ``cache`` ("dynamic" or
    "static"; the static cache without transformers' automatic torch.compile, for every
    implementation alike): each implementation's tokens against each other's, and new tokens
    per second (batch x new tokens over the median time of a generate call)."""
    import torch

    ids, mask = padded_batch(setup, setup.sizes.prompt_lengths, "left", seed=3)
    options: dict[str, Any] = {"attention_mask": mask, "max_new_tokens": setup.sizes.new_tokens, "do_sample": False,
                               "pad_token_id": 0}  # fmt: skip
    if cache == "static":
        options.update(cache_implementation="static", disable_compile=True)
    names = setup.checked(family)

    def generate(name: str) -> Any:
        use(model, name)
        with torch.no_grad():
            return model.generate(ids, **options)[:, ids.shape[1] :]

    tokens = {name: generate(name) for name in names}
    for name, out in tokens.items():
        if out.shape != (len(setup.sizes.prompt_lengths), setup.sizes.new_tokens):
            raise RuntimeError(f"{name}: generated {tuple(out.shape)} tokens, expected {setup.sizes.new_tokens} each")
    agreement = {
        f"{a}_vs_{b}": float((tokens[a] == tokens[b]).double().mean())
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    identical = {
        f"{a}_vs_{b}": bool(torch.equal(tokens[a], tokens[b])) for i, a in enumerate(names) for b in names[i + 1 :]
    }
    calls: dict[str, Callable[[], Any]] = {name: functools.partial(generate, name) for name in names}
    ms = setup.times(calls, repeat=min(3, setup.sizes.repeat))
    count = tokens[names[0]].numel()
    return {
        "cache": cache, "prompt_lengths": list(setup.sizes.prompt_lengths), "new_tokens": setup.sizes.new_tokens,
        "agreement": agreement, "identical": identical,
        "tokens_per_s": {name: round(count / (t * 1e-3), 1) for name, t in ms.items()},
    }  # fmt: skip


def time_prefill(family: Family, model: Any, setup: Setup, batch: int, seqlen: int) -> dict[str, Any]:
    """Milliseconds of a whole-model forward of ``batch`` x ``seqlen`` tokens per implementation
    (eager up to :data:`EAGER_MAX_SEQLEN`), single calls and back-to-back calls, and the ratio
    peer / cupyflash (above 1: cupyflash faster). With ``logits_to_keep=1`` where the model takes
    it (the LM head on the last position only), and the peak memory of one forward."""
    import torch

    ids = token_ids(setup, batch, seqlen, seed=4)
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    names = [setup.ours, setup.peer(family)] + (["eager"] if seqlen <= EAGER_MAX_SEQLEN else [])
    fns: dict[str, Callable[[], Any]] = {name: functools.partial(logits, model, name, ids, **keep) for name in names}
    head = "last (logits_to_keep=1)" if keep else "all"
    row: dict[str, Any] = {"batch": batch, "seqlen": seqlen, "lm_head_rows": head}
    if setup.device == "cuda":
        peak = {}
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()
            torch.cuda.synchronize()
            peak[name] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        row["peak_extra_gib"] = peak
    use(model, names[1])
    start = time.perf_counter()
    use(model, setup.ours)
    use(model, names[1])
    row["switch_ms"] = round((time.perf_counter() - start) * 1e3 / 2, 3)  # host time, inside single samples
    for method, calls, repeat in (
        ("single", 1, None),
        ("back_to_back", setup.sizes.back_to_back_calls, max(1, setup.sizes.repeat // 4)),
    ):
        ms = setup.times(fns, calls=calls, repeat=repeat)
        row[f"{method}_ms"] = {name: round(t, 3) for name, t in ms.items()}
        row[f"{method}_peer_over_ours"] = round(ms[names[1]] / ms[setup.ours], 3)
    return row


def stages(family: Family, model: Any, reference: Any, setup: Setup) -> list[tuple[str, Callable[[], Any]]]:
    """The named stages of one family, in the order they run."""
    named: list[tuple[str, Callable[[], Any]]] = []
    for b, n in setup.sizes.prefill:
        named.append((f"prefill_{b}x{n}", functools.partial(time_prefill, family, model, setup, b, n)))
    named.append(("logits", functools.partial(check_logits, family, model, reference, setup)))
    for side in ("left", "right"):
        named.append((f"padded_{side}", functools.partial(check_padded, family, model, reference, setup, side)))
    for cache in ("dynamic", "static"):
        named.append((f"generate_{cache}", functools.partial(check_generation, family, model, setup, cache)))
    return named


def _error(error: Exception) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()[:2000]


def run_family(family: Family, setup: Setup, say: Callable[[str], None]) -> dict[str, Any]:
    """Every stage of one family, each timed in seconds; a stage that raises is recorded (its
    error, printed) and the others still run."""
    import torch

    result: dict[str, Any] = {"family": family.name, "attention": family.attention, "peer": setup.peer(family),
                              "checked": list(setup.checked(family)), "errors": {}}  # fmt: skip
    try:
        model = build_model(family, setup)
        reference = reference_model(family, model, setup)
    except Exception as error:  # recorded and reported, the command exits 1
        result["errors"]["build"] = _error(error)
        say(f"\n== {family.name}: building the model FAILED: {result['errors']['build']}")
        return result
    result["config"] = {key: getattr(model.config, key, None) for key in CONFIG_KEYS}
    result["parameters_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
    say(f"\n== {family.name} ({family.config_class}: {family.attention}), {result['parameters_m']}M parameters")
    say("config: " + ", ".join(f"{key}={value}" for key, value in result["config"].items() if value is not None))
    for stage, run in stages(family, model, reference, setup):
        start = time.perf_counter()
        try:
            row = run()
            setup.sync()
        except Exception as error:  # recorded and reported, the command exits 1
            result["errors"][stage] = _error(error)
            say(f"{stage}: FAILED: {result['errors'][stage]}")
            continue
        row["seconds"] = round(time.perf_counter() - start, 1)
        result[stage] = row
        say(format_stage(stage, row, setup))
    del model, reference
    gc.collect()
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return result


#: The config fields printed and stored with each family's results.
CONFIG_KEYS = tuple(
    "hidden_size num_attention_heads num_key_value_heads head_dim num_hidden_layers intermediate_size vocab_size "
    "sliding_window layer_types attn_logit_softcapping final_logit_softcapping query_pre_attn_scalar "
    "use_sliding_window max_window_layers".split()
)


def _cells(rows: dict[str, dict[str, float]]) -> str:
    return "  ".join(f"{name} {r['max_abs_diff']:.3g} / {r['top1_agreement']:.3f}" for name, r in rows.items())


def format_stage(stage: str, row: dict[str, Any], setup: Setup) -> str:
    """One stage's lines of the table."""
    if stage.startswith("prefill"):
        names = list(row["single_ms"])
        times = "  ".join(f"{n} {row['single_ms'][n]:.2f} / {row['back_to_back_ms'][n]:.2f}" for n in names)
        return (
            f"prefill {row['batch']}x{row['seqlen']} (LM head rows: {row['lm_head_rows']}) ms single / back-to-back: "
            f"{times}  | {names[1]} / {names[0]}: {row['single_peer_over_ours']:.3f}x single, "
            f"{row['back_to_back_peer_over_ours']:.3f}x back-to-back"
        )
    if stage == "logits" or stage.startswith("padded"):
        what = f"logits 1x{row['tokens'][1]}" if stage == "logits" else f"{row['side']}-padded {row['lengths']}"
        verdict = "within" if row["within_floor"] else "NOT within"
        line = (
            f"{what}: vs reference max|diff| / top-1: {_cells(row['vs_reference'])}  | {setup.ours} "
            f"{row['ratio_to_floor']:.2f}x the floor: {verdict} {FLOOR_FACTOR:g}x"
        )
        if "vs_peer" in row:
            line += f"\n  vs {row['peer']}: {_cells(row['vs_peer'])}"
        return line
    agreement = "  ".join(
        f"{k} {v:.3f}{' (identical)' if row['identical'][k] else ''}" for k, v in row["agreement"].items()
    )
    speed = "  ".join(f"{k} {v:.1f}" for k, v in row["tokens_per_s"].items())
    return f"generate {row['new_tokens']} tokens, {row['cache']} cache: token agreement {agreement}  | tokens/s {speed}"


def failures(results: list[dict[str, Any]]) -> list[str]:
    """The stages that raised and the checks outside the floor."""
    bad: list[str] = []
    for r in results:
        bad += [f"{r['family']} {stage}: raised" for stage in r["errors"]]
        bad += [f"{r['family']} {s}: not within the floor" for s in ("logits", "padded_left", "padded_right")
                if s in r and not r[s]["within_floor"]]  # fmt: skip
    return bad


def run(
    *,
    quick: bool,
    device: str,
    families: tuple[str, ...] | None = None,
    say: Callable[[str], None] = print,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every family's stages; the results as one JSON-ready dict (``failures`` lists what went
    wrong), also given to ``save`` after each family (a run cut short keeps what it measured)."""
    import torch
    import transformers

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = QUICK_SIZES if quick else GPU_SIZES
    ours, _ = register_peers()
    cuda = device == "cuda"
    setup = Setup(
        device, torch.bfloat16 if cuda else torch.float32, torch.float32 if cuda else torch.float64, sizes, ours
    )
    header = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(setup.dtype).removeprefix("torch."),
        "reference": f"eager attention, {str(setup.reference_dtype).removeprefix('torch.')}, the same weights; "
                     "for the padded batches each sequence alone, unpadded",
        "transformers": transformers.__version__, "torch": torch.__version__, "sizes": asdict(sizes),
        "timing": f"interleaved rounds, median of {sizes.repeat} single calls after warm-up and of "
                  f"{max(1, sizes.repeat // 4)} samples of {sizes.back_to_back_calls} back-to-back calls",
        "floor_rule": f"{ours}'s max |logit diff| from the reference <= {FLOOR_FACTOR:g}x the larger of "
                      f"SDPA's and eager's in {str(setup.dtype).removeprefix('torch.')}",
        "gemma2": f"SDPA has no softcap: {SDPA_WITHOUT_SOFTCAP} (transformers' SDPA without it) is timed only; "
                  "logits and tokens are checked against eager",
        "generation": "greedy tokens are reported, not checked: a random-init model's near-tied logits flip "
                      "with rounding, and the tokens after a flip differ; the other pairs give the floor",
    }  # fmt: skip
    for key, value in header.items():
        say(f"{key}: {value}")
    chosen = [f for f in FAMILIES if families is None or f.name in families]
    results: list[dict[str, Any]] = []
    for family in chosen:
        results.append(run_family(family, setup, say))
        if save is not None:
            save({**header, "families": results, "failures": failures(results), "complete": family is chosen[-1]})
    bad = failures(results)
    say("\nfailures: " + (", ".join(bad) or "none"))
    return {**header, "families": results, "failures": bad, "complete": True}
