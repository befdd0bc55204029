#!/usr/bin/env python3
"""Decode attention table from two `bench_kernels --attention-only` runs: the tensor-core
kernel (default) and the CUDA-core one (`CANDLE_GEMMA_QSDPA_TC=0`).

    python3 scripts/attn_table.py attn-tc.jsonl attn-simt.jsonl
"""
import json
import sys


def load(path):
    rows = {}
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        if d.get("bench") != "qsdpa":
            continue
        rows[(d["shape"], d["keys"], d["q_len"], d["bits"], d["path"])] = d
    return rows


tc, simt = load(sys.argv[1]), load(sys.argv[2])
print("| shape | keys | q_len | bits | path | tc us | dense tc us | x dense tc | "
      "simt us | dense simt us | x dense simt | tc kv GB/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(tc, key=lambda k: (k[0], k[2], k[1], k[3], k[4])):
    a, b = tc[key], simt.get(key)
    cells = [key[0], key[1], key[2], key[3], key[4],
             f"{a['seconds'] * 1e6:.1f}", f"{a['dense_bf16_seconds'] * 1e6:.1f}",
             f"{a['speedup']:.2f}"]
    if b:
        cells += [f"{b['seconds'] * 1e6:.1f}", f"{b['dense_bf16_seconds'] * 1e6:.1f}",
                  f"{b['dense_bf16_seconds'] / a['seconds']:.2f}"]
    else:
        cells += ["", "", ""]
    cells.append(f"{a['kv_gb_per_s']:.0f}")
    print("| " + " | ".join(str(c) for c in cells) + " |")
