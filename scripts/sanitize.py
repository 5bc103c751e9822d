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
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def workload_command(size: str, lib: str, only: str | None) -> list[str]:
    return [sys.executable, str(WORKLOAD), "--size", size, "--lib", lib, *(["--only", only] if only else [])]


def run_tool(sanitizer: str, tool: str, out: Path, lib: str, only: str | None, timeout: float, env: dict) -> str:
    """One tool over the workload; returns its summary line."""
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
    count = error_count(log.read_text(errors="replace")) if log.is_file() else None
    if count is None:
        return f"{tool}: no error summary (rc {rc}; see {tool}.log and {tool}.out)"
    if rc != 0 and count == 0:
        return f"{tool}: 0 errors, but the workload failed (rc {rc}; see {tool}.out)"
    return f"{tool}: {count} errors"


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
    return 0 if all(line.endswith(": 0 errors") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
