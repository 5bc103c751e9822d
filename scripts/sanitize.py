"""compute-sanitizer over every kernel family (run on the GPU machine).

    python scripts/sanitize.py [--out DIR] [--tools memcheck,racecheck,synccheck,initcheck]
                               [--lib cupy|torch] [--only LABEL] [--timeout SECONDS]

Runs scripts/sanitize_workload.py once without a sanitizer (it compiles every variant it needs,
so the tools time kernels, not NVRTC, and a broken workload fails fast), then once under each
tool: memcheck and initcheck on the ``small`` workload, racecheck and synccheck (much slower) on
``tiny``. PYTORCH_NO_CUDA_MEMORY_CACHING=1 and the workload's ``cupy.cuda.set_allocator(None)``
give each buffer its own allocation, so an access past a buffer is an error, not a read of its
neighbour in a pool. Writes ``DIR/<tool>.log`` (the sanitizer's report) and ``DIR/<tool>.out``
(the workload's output), prints one line ``TOOL: N errors`` per tool (also in
``DIR/summary.txt``), and exits 1 if any tool found an error, failed or timed out.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (cubin_diff.py beside it)
from cubin_diff import find_nvdisasm, sass_listing  # noqa: E402

if TYPE_CHECKING:
    from cupyflash._specs import KernelSpec

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# racecheck instruments every shared-memory access and synccheck every barrier: minutes on the
# small workload, so they run the tiny one.
SIZE = {"memcheck": "small", "initcheck": "small", "racecheck": "tiny", "synccheck": "tiny"}
WORKLOAD = Path(__file__).resolve().parent / "sanitize_workload.py"
# "ERROR SUMMARY: N errors" (a second "... N errors were not printed" line counts only the
# reports past --print-limit); racecheck ends with "RACECHECK SUMMARY: H hazards displayed (N
# errors, W warnings)" instead.
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?$", re.MULTILINE)
RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?")
# One racecheck report: "Error: Race reported between Write access at KERNEL+0xOFFSET", then one
# "and Read access at KERNEL+0xOFFSET [N hazards]" line per site it raced with.
RACE_REPORT = re.compile(r"Error: Race reported between .*\n(?:=+\s+and .*\n?)+")
RACE_SITE = re.compile(r"(Write|Read) access at (\S+)\+0x([0-9a-f]+)")
# A tool's summary line with no error (racecheck's may name the bulk-copy reports it set aside).
CLEAN = re.compile(r": 0 errors(?: \(.*\))?$")


def find_sanitizer(explicit: str | None) -> str:
    for candidate in (explicit, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")):
        if candidate:
            return candidate
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "compute-sanitizer").is_file():
            return str(Path(root, "bin", "compute-sanitizer"))
    raise SystemExit("compute-sanitizer not found: put it on PATH or pass --sanitizer / set COMPUTE_SANITIZER")


def error_count(log: str) -> int | None:
    """The sanitizer's own count (its last "ERROR SUMMARY: N errors" line), None if it has none
    (it did not finish)."""
    counts = SUMMARY.findall(log) or RACECHECK_SUMMARY.findall(log)
    return int(counts[-1]) if counts else None


def race_reports(log: str) -> list[list[tuple[str, str, int]]]:
    """racecheck's displayed reports, each as its sites: (Write | Read, kernel, offset)."""
    return [
        [(kind, kernel, int(offset, 16)) for kind, kernel, offset in RACE_SITE.findall(report)]
        for report in RACE_REPORT.findall(log)
    ]


def bulk_copy_reports(log: str, bulk_copies: Callable[[str], set[int] | None]) -> int:
    """How many of racecheck's reports have only bulk copies for their writes: a kernel's
    cp.async.bulk into shared memory (SASS UBLKCP.S.G; ``bulk_copies(kernel)``: their offsets, None
    for a kernel it cannot build) against the reads an mbarrier orders after it (and the reads
    before the next copy, through the ring's other mbarrier). racecheck does not follow an
    mbarrier's ordering: scripts/pending_gpu/race_bulk_control.py, the Hopper backward's ring
    reduced to one buffer and race-free by the PTX memory model, gets the same reports, with the
    copy and with plain stores (docs/evidence/2026-12-07-h100-session-17/). So racecheck cannot
    tell a copy that lands too early from a correct one either: such hand-offs rest on the GPU
    tests (float64 references, poisoned outputs, bit-identical repeats), and the summary line
    names how many reports were set aside. A report with any other write stays an error."""
    known = 0
    for sites in race_reports(log):
        writes = [(kernel, offset) for kind, kernel, offset in sites if kind == "Write"]
        offsets = {kernel: bulk_copies(kernel) for kernel, _ in writes}
        if writes and all(offsets[kernel] and offset in offsets[kernel] for kernel, offset in writes):
            known += 1
    return known


@functools.cache
def _hopper_specs_by_name() -> dict[str, KernelSpec]:
    from cupyflash import _dispatch
    from cupyflash._specs import HOPPER_SMEM_PER_BLOCK

    return {spec.name: spec for spec in _dispatch.all_kernel_specs(HOPPER_SMEM_PER_BLOCK) if "sm_90a" in spec.archs}


@functools.cache
def hopper_bulk_copies(kernel: str) -> set[int] | None:
    """The offsets of ``kernel``'s bulk copies into shared memory (UBLKCP.S.G) in its sm_90a build
    by NVRTC, disassembled by nvdisasm (built offline, a variant's SASS is the one the GPU ran: the
    offsets racecheck reported on 2026-12-07 are these); None where the dispatcher has no variant
    of that name or nvdisasm is missing."""
    from cupyflash import _kernels

    spec, nvdisasm = _hopper_specs_by_name().get(kernel), find_nvdisasm()
    if spec is None or nvdisasm is None:
        return None
    listing = sass_listing(_kernels.compile_offline(spec, "sm_90a").cubin, nvdisasm)
    return {offset for offset, instruction in listing if re.match(r"UBLKCP\.S\.G\b", instruction)}


def workload_command(size: str, lib: str, only: str | None) -> list[str]:
    return [sys.executable, str(WORKLOAD), "--size", size, "--lib", lib, *(["--only", only] if only else [])]


def run_tool(
    sanitizer: str,
    tool: str,
    out: Path,
    lib: str,
    only: str | None,
    timeout: float,
    env: dict,
    bulk_copies: Callable[[str], set[int] | None] = hopper_bulk_copies,
) -> str:
    """One tool over the workload; returns its summary line (racecheck's without the reports
    whose writes are all bulk copies: bulk_copy_reports)."""
    log = out / f"{tool}.log"
    command = [
        sanitizer, "--tool", tool, "--log-file", str(log), "--print-limit", "200",
        *workload_command(SIZE[tool], lib, only),
    ]  # fmt: skip
    with open(out / f"{tool}.out", "w") as output:
        try:
            rc = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return f"{tool}: timed out after {timeout:.0f} s (see {tool}.log)"
    text = log.read_text(errors="replace") if log.is_file() else ""
    count = error_count(text)
    if count is None:
        return f"{tool}: no error summary (rc {rc}; see {tool}.log and {tool}.out)"
    if rc != 0 and count == 0:
        return f"{tool}: 0 errors, but the workload failed (rc {rc}; see {tool}.out)"
    known = bulk_copy_reports(text, bulk_copies) if tool == "racecheck" and count else 0
    aside = f" ({known} more: bulk copies ordered by an mbarrier, which racecheck does not follow)" if known else ""
    return f"{tool}: {count - known} errors{aside}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_logs")) / "sanitize")
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma list of " + ", ".join(TOOLS))
    parser.add_argument("--lib", choices=("cupy", "torch", "numpy"), default="cupy",
                        help="the workload's arrays (numpy: host arrays, for a dry run of this runner)")  # fmt: skip
    parser.add_argument("--only", help="only the workload cases whose label contains this")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per tool")
    parser.add_argument("--sanitizer", help="path of compute-sanitizer")
    args = parser.parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"unknown tools {unknown}; choose from {TOOLS}")
    sanitizer = find_sanitizer(args.sanitizer)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    # Unsanitized first: compiles (and caches) every variant the tools will run, and proves the
    # workload itself runs, so that a tool's failure is the tool's finding.
    sizes = sorted({SIZE[t] for t in tools}, key=("small", "tiny").index)
    for size in sizes:
        with open(args.out / f"plain-{size}.out", "w") as output:
            rc = subprocess.run(
                workload_command(size, args.lib, args.only), stdout=output, stderr=subprocess.STDOUT, env=env
            ).returncode
        if rc != 0:
            print(f"plain: the {size} workload failed without a sanitizer (rc {rc}; see plain-{size}.out)")
            return 1
    lines = [run_tool(sanitizer, tool, args.out, args.lib, args.only, args.timeout, env) for tool in tools]
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    for line in lines:
        print(line, flush=True)
    return 0 if all(CLEAN.search(line) for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
