"""FlashAttention-4's Hopper backward beside ours in SASS, with no GPU: FA4's kernel
(`flash_attn.cute.flash_bwd_sm90`) compiled for sm_90a from CuTe-DSL fake tensors (as its
interface compiles it, the tile of `_tile_size_bwd_sm90`), ours by NVRTC (`_kernels.compile_offline`),
both disassembled (nvdisasm), and the instructions of one step of each main loop counted by
opcode: how many, and where the exponentials sit between the waits for S^T and dP^T.

    # a Python 3.12 environment with FA4's wheels and the cutlass-dsl libraries (.peers, as
    # ../shared/peers/README.md stages them) and torch; cupyflash on PYTHONPATH
    python scripts/peer_sass.py build HEAD_DIM [--causal] --out DIR   # FA4's cubin into DIR
    python scripts/peer_sass.py compare FA4.cubin HEAD_DIM [--causal] [--late-exp]  # the table

`compare` runs where cupyflash runs (its kernel built offline); NVDISASM names nvdisasm (default:
on PATH)."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def build_fa4(head_dim: int, causal: bool, out: str) -> None:
    """FA4's sm_90a backward (bf16, no GQA, padded batch) compiled from fake tensors; the cubin
    and PTX land in ``out`` (CuTe-DSL's dump directory)."""
    os.makedirs(out, exist_ok=True)
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=out)
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    from flash_attn.cute import interface
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90

    cfg = interface._tile_size_bwd_sm90(head_dim, head_dim, causal, False)
    print(cfg)
    tensors = interface.make_fake_bwd_tensors(BFloat16, False, False, False)
    m_q, m_k, m_v, _, m_do, _, m_dk, m_dv, _, m_lse_log2, m_dpsum, m_dq_accum = tensors[:12]
    kernel = FlashAttentionBackwardSm90(
        BFloat16, head_dim, head_dim, 1, causal, is_local=False, deterministic=False, tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q, dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS,
        SdP_swapAB=cfg.SdP_swapAB, dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB,
        AtomLayoutMSdP=cfg.AtomLayoutMSdP, AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128, dQ_single_wg=cfg.dQ_single_wg,
    )  # fmt: skip
    args = [kernel, m_q, m_k, m_v, m_do, m_lse_log2, m_dpsum, m_dq_accum, m_dk, m_dv, Float32(1.0)]
    args += [None] * 9 + [interface.AuxData(None, None), None, None]
    cute.compile(*args, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")
    print("cubin:", [f for f in os.listdir(out) if f.endswith(".cubin")])


def sass(cubin: bytes) -> list[str]:
    """The instructions of a cubin, in order (nvdisasm; the cubin padded to 8 bytes)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin + b"\0" * (-len(cubin) % 8))
        f.flush()
        text = subprocess.run([os.environ.get("NVDISASM", "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]


def step(instructions: list[str]) -> list[str]:
    """One step of the consumers' main loop: from its first wgmma (S^T) to the branch back after
    its last (the loop's end)."""
    first = next(i for i, t in enumerate(instructions) if "HGMMA" in t)
    last = max(i for i, t in enumerate(instructions) if "HGMMA" in t)
    end = next(i for i in range(last + 6, len(instructions)) if "BRA" in instructions[i])
    return instructions[first : end + 1]


def opcode(instruction: str) -> str:
    words = instruction.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def summary(name: str, body: list[str]) -> str:
    """The step's count, its opcodes by count, and the exponentials before the first full wait."""
    counts = collections.Counter(opcode(t) for t in body)
    waits = [i for i, t in enumerate(body) if t.startswith("WARPGROUP.DEPBAR")]
    under = sum("MUFU.EX2" in t for t in body[waits[0] : waits[1]]) if len(waits) > 1 else 0
    mix = ", ".join(f"{k} {v}" for k, v in counts.most_common(14))
    return f"| {name} | {len(body)} | {counts['MUFU']} ({under} before the second wait) | {mix} |"


def compare(fa4_cubin: str, head_dim: int, causal: bool, late_exp: bool) -> None:
    from dataclasses import replace

    from cupyflash import _dispatch, _kernels

    # the variant the dispatcher picks (dq_first where it applies), or the order before
    spec = _dispatch.fa3_bwd_spec("bfloat16", head_dim, _dispatch.MaskFlags(causal, False, False), False, False)
    assert spec is not None
    if late_exp:
        spec = replace(spec, late_exp=True, dq_first=False)
    ours = _kernels.compile_offline(spec, "sm_90a")
    print("| kernel | instructions a step | exponentials | opcodes |\n|---|---|---|---|")
    with open(fa4_cubin, "rb") as f:
        print(summary("FA4 `flash_bwd_sm90`", step(sass(f.read()))))
    print(summary(f"cupyflash `{spec.name}`", step(sass(bytes(ours.cubin)))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="FA4's sm_90a backward cubin, from fake tensors")
    p.add_argument("head_dim", type=int)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--out", required=True)
    p = sub.add_parser("compare", help="one step of FA4's and of our main loop, by opcode")
    p.add_argument("fa4_cubin")
    p.add_argument("head_dim", type=int)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--late-exp", action="store_true", help="our exponentials after dP^T (the order before)")
    args = parser.parse_args(argv)
    if args.command == "build":
        build_fa4(args.head_dim, args.causal, args.out)
    else:
        compare(args.fa4_cubin, args.head_dim, args.causal, args.late_exp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
