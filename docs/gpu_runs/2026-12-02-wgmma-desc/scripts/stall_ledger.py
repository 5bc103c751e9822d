"""Per-instruction stall samples of Nsight Compute's source page, summed per opcode and per
class of work, for each kernel of the report.

    ncu -i stall_src.ncu-rep --page source --csv --print-source sass > stall_sass.csv
    python stall_ledger.py stall_sass.csv[.gz] [--top N] [--range KERNEL_INDEX LOW HIGH]

Per kernel: the samples (all, and those whose reason is the fixed-latency "wait"), the
instructions executed per opcode, and the samples per class: softmax math, synchronisation
(barriers, mbarrier polls, their branches), wgmma issue, memory, integer / uniform work.
--top N lists the N instructions with the most "wait" samples; --range prints the SASS between
two addresses (hex) of the kernel at KERNEL_INDEX (1 = the first), with their samples.
"""

import argparse
import collections
import csv
import gzip
import io

CLASSES = {
    "math": "FMNMX FFMA FADD FMUL MUFU F2FP SHFL FSEL FSETP".split(),
    "sync": "SYNCS BAR WARPGROUP BRA YIELD VOTE WARPSYNC NANOSLEEP".split(),
    "gemm": ["HGMMA"],
    "mem": "LDS STS LDG STG LDC UTMALDG UTMASTG STSM LDSM UBLKCP".split(),
}


def kernels(path):
    """(kernel name, header index, rows) per kernel of the CSV (each block starts "Kernel Name")."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        text = f.read()
    for block in text.split('"Kernel Name",')[1:]:
        name = block.split(",")[0].strip('"')
        rows = list(csv.reader(io.StringIO("\n".join(block.splitlines()[1:]))))
        yield name, {h: i for i, h in enumerate(rows[0])}, rows[1:]


def number(row, index, column):
    text = row[index[column]].replace(",", "")
    return float(text) if text else 0.0


def opcode(source):
    tokens = source.split()
    if not tokens:
        return "?"
    return (tokens[1] if tokens[0].startswith("@") else tokens[0]).split(".")[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--range", nargs=3, metavar=("KERNEL", "LOW", "HIGH"))
    args = parser.parse_args()
    for k, (name, index, rows) in enumerate(kernels(args.csv), start=1):
        if args.range:
            if k != int(args.range[0]):
                continue
            low, high = (int(a, 16) for a in args.range[1:])
            for row in rows:
                if low <= int(row[index["Address"]], 16) <= high:
                    print(f"{row[index['Address']][-5:]} samples {number(row, index, 'Warp Stall Sampling (All Samples)'):5.0f}"
                          f" wait {number(row, index, 'stall_wait'):5.0f}  {row[index['Source']][:80]}")
            continue
        samples, waits, executed = collections.Counter(), collections.Counter(), collections.Counter()
        per_class, class_executed = collections.Counter(), collections.Counter()
        for row in rows:
            op = opcode(row[index["Source"]])
            group = next((c for c, ops in CLASSES.items() if op in ops), "int/other")
            all_samples = number(row, index, "Warp Stall Sampling (All Samples)")
            samples[op] += all_samples
            waits[op] += number(row, index, "stall_wait")
            executed[op] += number(row, index, "Instructions Executed")
            per_class[group] += all_samples
            class_executed[group] += number(row, index, "Instructions Executed")
        total, total_wait = sum(samples.values()), sum(waits.values())
        print(f"== [{k}] {name[:70]}: {sum(executed.values()) / 1e6:.1f}M instructions, {total:.0f} samples,"
              f" wait {total_wait:.0f} ({total_wait / total:.1%})")
        print("  by class (samples, instructions):",
              ", ".join(f"{c} {v:.0f} ({class_executed[c] / 1e6:.1f}M)" for c, v in per_class.most_common()))
        print("  wait samples by opcode:", ", ".join(f"{op} {v / total_wait:.1%}" for op, v in waits.most_common(8)))
        print("  all samples by opcode:", ", ".join(f"{op} {v / total:.1%}" for op, v in samples.most_common(8)))
        print("  instructions by opcode:", ", ".join(f"{op} {v / 1e6:.2f}M" for op, v in executed.most_common(14)))
        for row in sorted(rows, key=lambda r: -number(r, index, "stall_wait"))[: args.top]:
            print(f"    {row[index['Address']][-5:]} wait {number(row, index, 'stall_wait'):5.0f}  {row[index['Source']][:80]}")


if __name__ == "__main__":
    main()
