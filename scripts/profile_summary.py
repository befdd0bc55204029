#!/usr/bin/env python3
"""Summarises an `ncu --csv --metrics gpu__time_duration.sum` log: kernel launches, total GPU
time, and the kernels grouped by name (largest first). Given the wall time of the same region
measured without the profiler (ms), also prints the share of that time the GPU was busy:
the rest is host-side overhead (launches, allocation, synchronisation).

    python3 scripts/profile_summary.py ncu.csv [--wall-ms 12.3] [--top 15]
"""
import argparse
import csv
import collections
import io
import re

UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


def short(name):
    name = re.sub(r"\(.*", "", name)
    name = re.sub(r"<.*", "", name)
    return name.strip()[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--wall-ms", type=float)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    text = open(a.csv, errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    by = collections.defaultdict(lambda: [0, 0.0])
    total, n = 0.0, 0
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", "")) * UNITS.get(r["Metric Unit"], 1e-6)
        k = short(r["Kernel Name"])
        by[k][0] += 1
        by[k][1] += v
        total += v
        n += 1
    print(f"== {a.label} kernels: {n}, GPU time {total:.3f} ms")
    if a.wall_ms:
        print(f"   wall {a.wall_ms:.3f} ms: GPU busy {100 * total / a.wall_ms:.1f}%, "
              f"host-side gap {a.wall_ms - total:.3f} ms ({(a.wall_ms - total) * 1e3 / max(n, 1):.1f} us per launch)")
    for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"   {t:9.3f} ms {100 * t / max(total, 1e-9):5.1f}%  x{c:<5d} {k}")


if __name__ == "__main__":
    main()
