"""Decode attention table from `bench_kernels --attention-only` runs: per shape and key count,
the packed and dense µs a call timed back to back on the GPU (`queued_seconds`, the host out of
the way) and their ratios, with the wall-clock ratios (`speedup`, host included) beside them.
Each cell gives the range over the runs.

    python3 scripts/attn_queued_table.py run1.jsonl run2.jsonl ...
"""
import json
import sys
from collections import defaultdict


def rng(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def main(paths):
    pts = defaultdict(lambda: defaultdict(list))
    for path in paths:
        for line in open(path):
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if d.get("bench") != "qsdpa" or d.get("q_len") != 1:
                continue
            p = pts[(d["shape"], d["keys"])]
            us = lambda k: None if d.get(k) is None else d[k] * 1e6
            p[f"q{d['bits']}"].append(us("queued_seconds"))
            p["qdense"].append(us("dense_queued_seconds"))
            p[f"x{d['bits']}"].append(d.get("queued_speedup"))
            p[f"w{d['bits']}"].append(d.get("speedup"))
    print("| shape | keys | 4-bit µs | 8-bit µs | dense bf16 µs | 4-bit vs dense | 8-bit vs dense "
          "| wall-clock 4-bit / 8-bit vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, keys), p in sorted(pts.items()):
        print(f"| {shape} | {keys // 1024}k | {rng(p['q4'], '{:.1f}')} | {rng(p['q8'], '{:.1f}')} "
              f"| {rng(p['qdense'], '{:.1f}')} | {rng(p['x4'], '{:.2f}x')} | {rng(p['x8'], '{:.2f}x')} "
              f"| {rng(p['w4'], '{:.2f}')} / {rng(p['w8'], '{:.2f}')} |")


if __name__ == "__main__":
    main(sys.argv[1:])
