#!/usr/bin/env python3
"""Decode attention (q_len 1) over several `bench_kernels --attention-only` runs of one binary:
per head shape, key count and bits, the median over the runs of the packed and dense times and
the range of the per-run speedups (dense / packed), so one slow run shows without deciding.

    python3 scripts/attn_runs_table.py run1.jsonl run2.jsonl ...
"""
import json
import statistics
import sys
from collections import defaultdict

points = defaultdict(list)
for path in sys.argv[1:]:
    for line in open(path):
        if not line.startswith('{"bench":"qsdpa"'):
            continue
        j = json.loads(line)
        if j["q_len"] != 1:
            continue
        points[(j["shape"], j["keys"], j["bits"])].append((j["seconds"], j["dense_bf16_seconds"]))

print(f"{len(sys.argv) - 1} runs; us per call (median over runs of each run's median of five)")
print("| shape | keys | bits | packed us | dense us | median speedup | speedup range |")
print("|---|---|---|---|---|---|---|")
for (shape, keys, bits), v in sorted(points.items()):
    t = statistics.median(a for a, _ in v)
    d = statistics.median(b for _, b in v)
    s = [b / a for a, b in v]
    print(f"| {shape} | {keys} | {bits} | {t * 1e6:.1f} | {d * 1e6:.1f} | {statistics.median(s):.2f} | "
          f"{min(s):.2f}-{max(s):.2f} |")
