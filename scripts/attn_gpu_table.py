#!/usr/bin/env python3
"""GPU time of each decode attention call from `device-run.sh attngpu` (ncu, one call a point,
`bench_kernels --attention-only --quick`): the attention kernel plus its split-combining
kernel, per head shape, key count (1k then 32k, the bench's order) and bits, and the ratio
dense / packed.

    python3 scripts/attn_gpu_table.py attn-gpu.csv
"""
import csv
import sys
from collections import defaultdict

SHAPES = {(2, 256): "e4b_sliding", (2, 512): "e4b_full", (16, 256): "31b_sliding", (4, 512): "31b_full"}


def launches(path):
    rows = csv.reader(l for l in open(path) if not l.startswith("=="))
    head = next(rows)
    k, g, v = head.index("Kernel Name"), head.index("Grid Size"), head.index("Metric Value")
    for r in rows:
        grid = tuple(int(x) for x in r[g].strip("()").split(","))
        yield r[k].split("(")[0].strip(), grid, float(r[v].replace(",", "")) / 1e3


def main(path):
    calls = []  # (name, grid, main us, combine us)
    for name, grid, us in launches(path):
        if name.startswith("qsdpa_combine"):
            calls[-1][3] += us
        else:
            calls.append([name, grid, us, 0.0])
    seen = defaultdict(int)
    table = {}
    for name, grid, us, comb in calls:
        hd, bits = (int(x) for x in name.split("_")[-2:])
        if grid[0] != 1:
            continue  # a prefill block (512 queries), not decode
        shape = SHAPES[(grid[1], hd)]
        i = seen[(shape, bits)]
        seen[(shape, bits)] += 1
        table[(shape, [1024, 32768][i], bits)] = (us, comb, grid[2])
    print("| shape | keys | bits | kernel us | combine us | total us | splits | dense total / total |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, keys, bits), (us, comb, splits) in table.items():
        d = table.get((shape, keys, 16))
        ratio = f"{(d[0] + d[1]) / (us + comb):.2f}" if d and bits != 16 else ""
        name = "dense" if bits == 16 else bits
        print(f"| {shape} | {keys} | {name} | {us:.1f} | {comb:.1f} | {us + comb:.1f} | {splits} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
