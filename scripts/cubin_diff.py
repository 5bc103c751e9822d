"""Cubin identity across a kernel-source change: snapshot every shipped variant, compare two snapshots.

    python scripts/cubin_diff.py snapshot DIR [--workers 2] [--filter SUBSTRING]
    python scripts/cubin_diff.py compare DIR_A DIR_B
    python scripts/cubin_diff.py counts DIR_A DIR_B [--filter SUBSTRING] [--nvdisasm PATH]

``snapshot`` compiles every variant the compile test builds (tests/test_compile.py's JOBS: each
variant of ``_dispatch.all_kernel_specs`` for each CI arch it targets) with NVRTC, no GPU needed,
and writes ``DIR/<spec.name>.<arch>.cubin``, the NVRTC log beside it (``.log``) and
``DIR/specs.json``: the strings each spec renders (name, template arguments, launch bounds,
parameter declaration, entry body, shared-memory bytes). The cupyflash that is imported decides
what is built: run it with ``PYTHONPATH=`` a pristine export of a commit to snapshot that commit.

``compare`` lists the variants whose cubins are identical, changed, added or removed, and the
spec strings that differ; it exits 1 when any cubin changed, was added or was removed.

``counts`` prints the SASS instruction count of each variant in both snapshots (nvdisasm, from
the pip package nvidia-cuda-nvdisasm or a CUDA toolkit). CuPy's ``nvrtc.getCUBIN`` returns the
cubin less its last byte (a zero in the last program header): it is put back before
disassembling.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _jobs(name_filter: str | None) -> list:
    from cupyflash._dispatch import FA1_DEVICE_SMEM, all_kernel_specs

    jobs = [
        (spec, arch) for arch, smem in FA1_DEVICE_SMEM.items() for spec in all_kernel_specs(smem) if arch in spec.archs
    ]
    if name_filter:
        jobs = [(spec, arch) for spec, arch in jobs if name_filter in spec.name]
    return jobs


def _spec_strings(spec) -> dict[str, object]:
    return {
        "name": spec.name,
        "template_args": spec.template_args(),
        "launch_bounds": spec.launch_bounds,
        "param_decl": spec.param_decl,
        "entry_body": spec.entry_body,
        "smem_bytes": spec.smem_bytes,
        "num_threads": spec.num_threads,
    }


def snapshot(out: Path, workers: int, name_filter: str | None) -> None:
    import cupyflash
    from cupyflash import _kernels

    print(f"cupyflash from {Path(cupyflash.__file__).parent}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(name_filter)

    def build(job):
        spec, arch = job
        result = _kernels.compile_offline(spec, arch)
        stem = f"{spec.name}.{arch}"
        (out / f"{stem}.cubin").write_bytes(result.cubin)
        (out / f"{stem}.log").write_text(result.log)
        return stem, result.seconds

    done = [build(jobs[0])]  # alone first: loads NVRTC and its builtins once
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for i, item in enumerate(pool.map(build, jobs[1:]), start=2):
            done.append(item)
            if i % 50 == 0 or i == len(jobs):
                print(f"{i}/{len(jobs)}", flush=True)
    specs = {f"{spec.name}.{arch}": _spec_strings(spec) for spec, arch in jobs}
    (out / "specs.json").write_text(json.dumps(specs, indent=1, sort_keys=True))
    print(f"{len(done)} cubins in {out} ({sum(s for _, s in done):.0f} s of compiles)")


def _digests(folder: Path) -> dict[str, str]:
    return {
        path.name[: -len(".cubin")]: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.glob("*.cubin"))
    }


def compare(a: Path, b: Path) -> int:
    da, db = _digests(a), _digests(b)
    identical = sorted(k for k in da.keys() & db.keys() if da[k] == db[k])
    changed = sorted(k for k in da.keys() & db.keys() if da[k] != db[k])
    removed = sorted(da.keys() - db.keys())
    added = sorted(db.keys() - da.keys())
    print(f"{len(identical)} identical, {len(changed)} changed, {len(added)} added, {len(removed)} removed")
    for title, names in (("changed", changed), ("added", added), ("removed", removed)):
        for name in names:
            print(f"{title}: {name}")
    spec_a, spec_b = a / "specs.json", b / "specs.json"
    if spec_a.is_file() and spec_b.is_file():
        sa, sb = json.loads(spec_a.read_text()), json.loads(spec_b.read_text())
        differing = [
            (key, field, sa[key][field], sb[key].get(field))
            for key in sorted(sa.keys() & sb.keys())
            for field in sa[key]
            if sa[key][field] != sb[key].get(field)
        ]
        print(f"spec strings: {len(differing)} differ")
        for key, field, va, vb in differing:
            print(f"spec {key} {field}: {va!r} -> {vb!r}")
    return 1 if changed or added or removed else 0


def find_nvdisasm(given: str | None = None) -> str | None:
    """nvdisasm: ``given``, $NVDISASM, on PATH, in the CUDA toolkit ($CUDA_HOME) or from the pip
    package nvidia-cuda-nvdisasm; None where there is none."""
    toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")
    candidates = [given, os.environ.get("NVDISASM"), "nvdisasm", str(toolkit)]
    try:
        import nvidia.cu13  # type: ignore[import-not-found]  # pip install nvidia-cuda-nvdisasm

        candidates.append(str(Path(nvidia.cu13.__path__[0], "bin", "nvdisasm")))
    except ImportError:
        pass
    return next((found for c in candidates if c and (found := shutil.which(c))), None)


def sass_listing(cubin: bytes, nvdisasm: str) -> list[tuple[int, str]]:
    """The SASS instructions of a cubin with their offsets in their function (the offsets
    compute-sanitizer reports), one (offset, instruction) each, encodings dropped."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin + bytes(-len(cubin) % 8))  # (getCUBIN's cubin less its last byte)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    return [
        (int(m.group(1), 16), m.group(2).strip())
        for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", text, re.MULTILINE)
    ]


def sass_instructions(cubin: bytes, nvdisasm: str) -> list[str]:
    """The SASS instructions of a cubin, one string each (addresses and encodings dropped)."""
    return [instruction for _, instruction in sass_listing(cubin, nvdisasm)]


def counts(a: Path, b: Path, name_filter: str | None, nvdisasm: str | None) -> None:
    tool = find_nvdisasm(nvdisasm)
    if tool is None:
        raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm")
    names = sorted({p.name for p in a.glob("*.cubin")} & {p.name for p in b.glob("*.cubin")})
    print(f"{'variant':<72} {'before':>7} {'after':>7} {'delta':>6}")
    for name in names:
        if name_filter and name_filter not in name:
            continue
        before = len(sass_instructions((a / name).read_bytes(), tool))
        after = len(sass_instructions((b / name).read_bytes(), tool))
        print(f"{name[: -len('.cubin')]:<72} {before:>7} {after:>7} {after - before:>+6}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="compile every shipped variant into DIR")
    snap.add_argument("dir", type=Path)
    snap.add_argument("--workers", type=int, default=2)
    snap.add_argument("--filter", default=None, help="only variants whose name contains this")
    cmp_ = sub.add_parser("compare", help="compare two snapshots")
    cmp_.add_argument("dir_a", type=Path)
    cmp_.add_argument("dir_b", type=Path)
    cnt = sub.add_parser("counts", help="SASS instruction counts of two snapshots")
    cnt.add_argument("dir_a", type=Path)
    cnt.add_argument("dir_b", type=Path)
    cnt.add_argument("--filter", default=None)
    cnt.add_argument("--nvdisasm", default=None)
    args = parser.parse_args(argv)
    if args.command == "counts":
        counts(args.dir_a, args.dir_b, args.filter, args.nvdisasm)
        return 0
    if args.command == "snapshot":
        snapshot(args.dir, args.workers, args.filter)
        return 0
    return compare(args.dir_a, args.dir_b)


if __name__ == "__main__":
    sys.exit(main())
