#!/usr/bin/env python3
"""Decode attention under several variants (files `attnvar-<variant>-<round>.jsonl` from
`device-run.sh attnvar`): per point, each variant's microseconds a call and its ratio to the
dense bf16 call measured in the same run, rounds separated by '/'.

    python3 scripts/attn_variants_table.py out/attnvar-*.jsonl
"""
import collections
import json
import os
import re
import sys

runs = collections.defaultdict(dict)  # variant -> round -> rows
for path in sys.argv[1:]:
    m = re.match(r"attnvar-(.+)-(\d+)\.jsonl$", os.path.basename(path))
    if not m:
        continue
    rows = {}
    for line in open(path):
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("bench") == "qsdpa" and d["q_len"] == 1:
            rows[(d["shape"], d["keys"], d["bits"])] = d
    runs[m.group(1)][int(m.group(2))] = rows

variants = sorted(runs)
points = sorted({k for v in runs.values() for r in v.values() for k in r})
print("| shape | keys | bits | " + " | ".join(f"{v} us | {v} x dense" for v in variants) + " |")
print("|---|---|---|" + "---|---|" * len(variants))
for key in points:
    cells = [str(x) for x in key]
    for v in variants:
        ds = [runs[v][r].get(key) for r in sorted(runs[v])]
        ds = [d for d in ds if d]
        cells.append(" / ".join(f"{d['seconds'] * 1e6:.1f}" for d in ds))
        cells.append(" / ".join(f"{d['speedup']:.2f}" for d in ds))
    print("| " + " | ".join(cells) + " |")
