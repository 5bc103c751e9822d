"""``python -m cupyflash {info,warmup,demo,bench,bench-train,bench-decode,bench-varlen,bench-chunked,bench-mask,
bench-mods,bench-cascade,bench-transformers}``."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any


def _gpu_available() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # no CuPy, or no driver
        return False


def cmd_info(_: argparse.Namespace) -> int:
    from . import __version__, _kernels, _source

    print(f"cupyflash {__version__}")
    print(f"kernel sources: {_source.kernel_dir()} (sha256 {_source.fingerprint()[:16]})")
    print(f"kernel cache:   {_kernels.cache_dir()}")
    if _gpu_available():
        import cupy

        for device_id in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(device_id)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            print(
                f"GPU {device_id}: {name}, {props['multiProcessorCount']} SMs, arch {_kernels.device_arch(device_id)}"
            )
    else:
        print("GPU: none visible (attention() runs the array-API algorithms on the host)")
    variants = _kernels.cached_variants()
    print(f"compiled variants in the cache for these sources: {len(variants)}")
    for v in variants:
        spill = f", {v['local_bytes']} B local" if v["local_bytes"] else ""
        print(f"  {v['arch']:7} {v['name']}  ({v['registers']} regs{spill}, {v['seconds']} s)")
    return 0


def _progress(total: int) -> Callable[[object], None]:
    """A progress bar on a terminal; a line per tenth of the work in a log."""
    done = [0]
    start = time.perf_counter()
    tty = sys.stderr.isatty()

    def update(kernel: object) -> None:
        done[0] += 1
        name = getattr(getattr(kernel, "spec", None), "name", "")
        elapsed = time.perf_counter() - start
        if tty:
            width = 30
            filled = width * done[0] // total
            bar = f"[{'#' * filled}{'.' * (width - filled)}]"
            sys.stderr.write(f"\r{bar} {done[0]}/{total} {elapsed:5.1f}s {name[:60]:60}")
            if done[0] == total:
                sys.stderr.write("\n")
        elif done[0] == total or done[0] % max(1, total // 10) == 0:
            sys.stderr.write(f"{done[0]}/{total} compiled, {elapsed:.1f}s ({name})\n")
        sys.stderr.flush()

    return update


def cmd_warmup(args: argparse.Namespace) -> int:
    from . import _kernels
    from ._dispatch import FA1_DEVICE_SMEM, all_kernel_specs

    if args.arch:  # no GPU needed: check that every variant builds for an arch
        fa1_smem = FA1_DEVICE_SMEM.get(args.arch, FA1_DEVICE_SMEM["sm_90a"])
        specs = [s for s in all_kernel_specs(fa1_smem) if args.arch in s.archs]
        update = _progress(len(specs))
        worst = 0
        for spec in specs:
            build = _kernels.compile_offline(spec, args.arch)
            worst = max(worst, build.spill_bytes)
            update(type("Done", (), {"spec": spec})())
        print(f"{len(specs)} variants built for {args.arch}; largest spill: {worst} bytes")
        return 0
    if not _gpu_available():
        print("no GPU visible: use --arch sm_80|sm_90a to build offline", file=sys.stderr)
        return 1
    import cupy

    device_id = cupy.cuda.runtime.getDevice()
    max_smem = cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]
    arch = _kernels.device_arch(device_id)
    # FA1's tiles follow the device's shared memory; the TMA (Hopper) variants build for sm_90a only
    specs = [s for s in all_kernel_specs(max_smem) if s.smem_bytes <= max_smem and (arch in s.archs or not s.uses_tma)]
    kernels = _kernels.warmup(specs, device_id, workers=args.jobs, on_done=_progress(len(specs)))
    spilled = [k.spec.name for k in kernels if k.local_bytes]
    print(f"{len(kernels)} variants ready on GPU {device_id}; with local memory: {spilled or 'none'}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    demo.run(seqlen=args.seqlen)
    return 0


def _require_gpu(command: str) -> bool:
    available = _gpu_available()
    if not available:
        print(f"{command} needs a GPU", file=sys.stderr)
    return available


def _write_json(path: str | None, results: dict[str, object]) -> None:
    """The benchmark's results, where ``--json`` asked for them."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def _prefill_rows(args: argparse.Namespace, run: Any, table: Any) -> list[dict[str, Any]]:
    """Each prefill shape of ``args`` run and printed as its row of ``table``, then the table,
    what its numbers are, and why an entry has none."""
    from . import bench

    shapes = bench.prefill_shapes(tuple(args.dtype), tuple(args.head_dims or bench.PREFILL_HEAD_DIMS))
    if args.quick:
        shapes = [s for s in shapes if s.seqlen == 4096]
    rows = []
    for shape in shapes:
        rows.append(run(shape))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    headline = "interleaved" if "interleaved" in args.timings else args.timings[0]
    print(f"TFLOP/s: the {headline} timing; each ratio: its range over {', '.join(args.timings)} (one process)")
    print(table(rows))
    for line in bench.format_refusals(rows):
        print(f"no number: {line}")
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    if not _require_gpu("bench"):
        return 1
    from . import bench

    backends, timings = tuple(args.backends or bench.PREFILL_BACKENDS), tuple(args.timings)
    rows = _prefill_rows(
        args, lambda shape: bench.run_prefill(shape, backends=backends, timings=timings), bench.format_prefill_table
    )
    overhead = bench.host_overhead_us()
    print(f"host time of a tiny call (1 query, 128 keys, 8 heads, d=128): {overhead}")
    _write_json(args.json, {"prefill": rows, "host_overhead": overhead, "timings": list(timings)})
    return 0


def cmd_bench_train(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-train"):
        return 1
    from . import bench

    backends, timings = tuple(args.backends or bench.TRAINING_BACKENDS), tuple(args.timings)
    rows = _prefill_rows(
        args,
        lambda shape: bench.run_training(shape, backends=backends, dropout_p=args.dropout, timings=timings),
        bench.format_training_table,
    )
    _write_json(args.json, {"training": rows, "timings": list(timings)})
    return 0


def _timing_options(parser: argparse.ArgumentParser, backends: tuple[str, ...], choices: tuple[str, ...]) -> None:
    """--timings and --backends of the prefill and training benchmarks."""
    from . import bench

    parser.add_argument(
        "--timings", nargs="+", choices=bench.TIMINGS, default=list(bench.TIMINGS), metavar="TIMING",
        help="single (calls after warm-up), back_to_back (20 calls between two events), interleaved (rounds of "
        "one call each, shuffled); default: all three (a ratio is a claim where it holds under each)",
    )  # fmt: skip
    parser.add_argument(
        "--backends", nargs="+", choices=choices, metavar="BACKEND",
        help=f"default: {' '.join(backends)} (fa4: FlashAttention-4, where flash-attn-4 is installed); "
        f"any of {', '.join(choices)}",
    )  # fmt: skip


def cmd_bench_decode(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-decode"):
        return 1
    from . import bench

    if args.fp8:  # the float8-cache table only
        fp8_rows = []
        for b, length in bench.FP8_DECODE_SHAPES:
            for page_size in (0, 16):
                fp8_rows.append(bench.run_fp8_decode(bench.DecodeShape(b, length), page_size))
                print(bench.format_fp8_decode_table(fp8_rows[-1:]).splitlines()[-1], flush=True)
        print(f"steady: per call of {bench.DECODE_STEADY_CALLS} back-to-back calls; single: one call between events")
        print(bench.format_fp8_decode_table(fp8_rows))
        _write_json(args.json, {"fp8_decode": fp8_rows})
        return 0
    if args.batch_invariant:  # batch_invariant=True beside the default only
        inv_rows = []
        for b, length in bench.BATCH_INVARIANT_SHAPES:
            for page_size in (0, 16):
                inv_rows.append(bench.run_batch_invariant_decode(bench.DecodeShape(b, length), page_size))
                print(bench.format_batch_invariant_table(inv_rows[-1:]), flush=True)
        print("cost = batch_invariant us / default us (target <= 1.10 at B * L >= 256k); timings: " + ", ".join(
            bench.TIMINGS))  # fmt: skip
        print(bench.format_batch_invariant_table(inv_rows))
        _write_json(args.json, {"batch_invariant_decode": inv_rows})
        return 0
    if args.tree:  # speculative decoding's tree mask only
        tree_rows = []
        for b, length in bench.TREE_DECODE_SHAPES:
            for drafts in bench.TREE_DRAFTS:
                tree_rows.append(bench.run_tree_decode(bench.DecodeShape(b, length), drafts))
                print(bench.format_tree_table(tree_rows[-1:]), flush=True)
        print("cost = tree us / causal us; speedup = SDPA (boolean attn_mask) us / tree us; timings: " + ", ".join(
            bench.TIMINGS))  # fmt: skip
        print(bench.format_tree_table(tree_rows))
        _write_json(args.json, {"tree_decode": tree_rows})
        return 0
    if args.page_sizes:  # the paged-cache table only
        paged = []
        for b, length in bench.PAGED_DECODE_SHAPES:
            paged.append(bench.run_paged_decode(bench.DecodeShape(b, length), tuple(args.page_sizes)))
            print(json.dumps(paged[-1]), flush=True)
        _write_json(args.json, {"paged_decode": paged})
        return 0
    rows = []
    for shape in bench.decode_shapes():
        rows.append(bench.run_decode(shape))
        print(bench.format_decode_table(rows[-1:]).splitlines()[-1], flush=True)
    print("single call (host time before the launch included):")
    print(bench.format_decode_table(rows))
    print(f"steady (per call of {bench.DECODE_STEADY_CALLS} back-to-back calls):")
    print(bench.format_decode_table(rows, "_steady"))
    overhead = bench.decode_host_overhead_us()
    print(f"host time of a decode call (B=1, L=4096, Hq=32, Hkv=8, d=128, bf16): {overhead}")
    _write_json(args.json, {"decode": rows, "host_overhead": overhead})
    return 0


def cmd_bench_chunked(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-chunked"):
        return 1
    from . import bench

    rows = []
    for shape in bench.CHUNK_SHAPES:
        rows.append(bench.run_chunked_prefill(shape))
        print(json.dumps(rows[-1]), flush=True)
    _write_json(args.json, {"chunked_prefill": rows})
    return 0


def cmd_bench_mods(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-mods"):
        return 1
    from . import bench

    rows = []
    for shape in bench.MODS_SHAPES:
        if args.head_dims and shape.head_dim not in args.head_dims:
            continue
        for name, functions in bench.mods_gallery(shape.seqlen, shape.heads).items():
            if args.functions and name not in args.functions:
                continue
            for backward in (False, True) if args.backward else (False,):
                rows.append(bench.run_mods(shape, name, functions, backward))
                print(bench.format_mods_table(rows[-1:]).splitlines()[-1], flush=True)
    print(bench.format_mods_table(rows))
    _write_json(args.json, {"mods": rows})
    return 0


def cmd_bench_mask(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-mask"):
        return 1
    from . import bench

    rows = []
    shapes: tuple[bench.PrefillShape, ...] = bench.MASK_SHAPES
    if args.head_dims:  # the same tokens and H * d at other head dims
        shapes = tuple(replace(s, heads=s.heads * s.head_dim // d, head_dim=d) for s in shapes for d in args.head_dims)
    for shape in shapes:
        for kind in bench.MASK_KINDS:
            rows.append(bench.run_masked_prefill(shape, kind))
            print(json.dumps(rows[-1]), flush=True)
    _write_json(args.json, {"masked_prefill": rows})
    return 0


def cmd_bench_cascade(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-cascade"):
        return 1
    from . import bench

    rows = []
    for shape in bench.CASCADE_SHAPES:
        rows.append(bench.run_cascade(*shape))
        print(json.dumps(rows[-1]), flush=True)
    print(bench.format_cascade_table(rows))
    _write_json(args.json, {"cascade": rows})
    return 0


def cmd_bench_varlen(args: argparse.Namespace) -> int:
    if not _require_gpu("bench-varlen"):
        return 1
    from . import bench

    shapes = bench.varlen_shapes()
    print(f"{len(shapes[0].lengths)} sequences of {list(shapes[0].lengths)} tokens, bf16, TFLOP/s of the unpadded work")
    rows = [bench.run_varlen(shape) for shape in shapes]
    print(bench.format_varlen_table(rows))
    _write_json(args.json, {"varlen": rows})
    return 0


def cmd_bench_transformers(args: argparse.Namespace) -> int:
    """Exits 1 if a stage raised or a logits check fell outside the floor."""
    from . import bench_transformers

    if args.device == "cuda" and not _require_gpu("bench-transformers --device cuda"):
        return 1
    save = functools.partial(_write_json, args.json)  # after each family: a run cut short keeps its results
    report = bench_transformers.run(quick=args.quick, device=args.device, families=args.families, save=save)
    return 1 if report["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="GPU, arch, kernel cache and compiled variants").set_defaults(func=cmd_info)
    warm = sub.add_parser("warmup", help="compile every kernel variant (progress bar)")
    warm.add_argument("--jobs", type=int, default=8, help="parallel NVRTC compiles")
    warm.add_argument("--arch", help="build offline for this arch (sm_80, sm_90a) without a GPU")
    warm.set_defaults(func=cmd_warmup)
    demo = sub.add_parser(
        "demo", help="attention's error against float64 on the host (and the GPU: its speed beside SDPA, its memory)"
    )
    demo.add_argument("--seqlen", type=int, default=4096, help="the GPU timing's sequence length (default 4096)")
    demo.set_defaults(func=cmd_demo)
    from . import bench as harness

    bench = sub.add_parser(
        "bench", help="TFLOP/s against PyTorch SDPA (flash, cuDNN) and FlashAttention-4, under three timings"
    )
    bench.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"])
    bench.add_argument("--quick", action="store_true", help="only N = 4096")
    bench.add_argument("--head-dims", type=int, nargs="+", help="default: 64 128")
    _timing_options(bench, harness.PREFILL_BACKENDS, (*harness.CUPYFLASH_BACKENDS, *harness.PEERS))
    bench.add_argument("--json", help="write the results here")
    bench.set_defaults(func=cmd_bench)
    train = sub.add_parser(
        "bench-train",
        help="forward + backward TFLOP/s and memory against PyTorch SDPA and FlashAttention-4, under three timings",
    )
    train.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"])
    train.add_argument("--quick", action="store_true", help="only N = 4096")
    train.add_argument("--head-dims", type=int, nargs="+", help="default: 64 128")
    train.add_argument("--dropout", type=float, default=0.0, help="dropout_p of every backend (default 0)")
    ours = (*harness.CUPYFLASH_BACKENDS, "cupyflash_det", "cupyflash_alibi")
    _timing_options(train, harness.TRAINING_BACKENDS, (*ours, *harness.PEERS))
    train.add_argument("--json", help="write the results here")
    train.set_defaults(func=cmd_bench_train)
    bench_decode = sub.add_parser("bench-decode", help="decode us and GB/s against PyTorch SDPA (flash, cuDNN)")
    bench_decode.add_argument("--json", help="write the results here")
    bench_decode.add_argument(
        "--page-sizes", type=int, nargs="+", help="instead: the contiguous cache against it paged at these sizes"
    )
    bench_decode.add_argument(
        "--fp8", action="store_true", help="instead: the bf16 cache against its e4m3 copy (contiguous, page 16)"
    )
    bench_decode.add_argument(
        "--batch-invariant", action="store_true",
        help="instead: batch_invariant=True beside the default (contiguous, page 16), under the three timings",
    )  # fmt: skip
    bench_decode.add_argument(
        "--tree", action="store_true",
        help="instead: speculative decoding's tree mask ({2,4,8,16} drafts) beside causal and SDPA with attn_mask",
    )  # fmt: skip
    bench_decode.set_defaults(func=cmd_bench_decode)
    bench_varlen = sub.add_parser("bench-varlen", help="packed sequences: TFLOP/s of both kernels and PyTorch's varlen")
    bench_varlen.add_argument("--json", help="write the results here")
    bench_varlen.set_defaults(func=cmd_bench_varlen)
    chunked = sub.add_parser(
        "bench-chunked", help="chunked prefill against a KV cache: the cache call, paged varlen, dense, SDPA"
    )
    chunked.add_argument("--json", help="write the results here")
    chunked.set_defaults(func=cmd_bench_chunked)
    masked = sub.add_parser("bench-mask", help="attn_mask: key padding, boolean and additive masks against SDPA")
    masked.add_argument("--json", help="write the results here")
    masked.add_argument("--head-dims", type=int, nargs="+", help="default: 128 (H * d = 2048 at each)")
    masked.set_defaults(func=cmd_bench_mask)
    mods_bench = sub.add_parser(
        "bench-mods", help="score_mod / mask_mod against torch FlexAttention and the built-in options"
    )
    mods_bench.add_argument("--json", help="write the results here")
    mods_bench.add_argument("--head-dims", type=int, nargs="+", help="default: 64 and 128")
    mods_bench.add_argument("--functions", nargs="+", help="gallery functions (default: all)")
    mods_bench.add_argument("--backward", action="store_true", help="forward + backward through autograd too")
    mods_bench.set_defaults(func=cmd_bench_mods)
    cascade = sub.add_parser("bench-cascade", help="shared-prefix decoding against the flat paged call")
    cascade.add_argument("--json", help="write the results here")
    cascade.set_defaults(func=cmd_bench_cascade)
    models = sub.add_parser(
        "bench-transformers",
        help="Llama-, Qwen2- and Gemma2-style models with cupyflash beside SDPA and eager: prefill time, logits, "
        "padded batches, generation",
    )
    models.add_argument("--quick", action="store_true", help="tiny models (the CPU path runs them in float32)")
    models.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="default: cuda if visible")
    models.add_argument("--families", nargs="+", choices=("llama", "qwen2", "gemma2"), help="default: all three")
    models.add_argument("--json", help="write the results here")
    models.set_defaults(func=cmd_bench_transformers)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
