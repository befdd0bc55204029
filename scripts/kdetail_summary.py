"""Summarises an `ncu --csv --page details` log: one line a launch with the metrics named."""
import csv
import sys

WANT = [
    "Duration", "DRAM Throughput", "Memory Throughput", "Registers Per Thread",
    "Theoretical Occupancy", "Achieved Occupancy", "Block Limit Registers",
    "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler", "L1/TEX Hit Rate",
    "L2 Hit Rate", "Mem Busy", "Max Bandwidth",
]
rows = {}
meta = {}
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    i = r["ID"]
    meta[i] = (r["Kernel Name"][:40], r["Grid Size"], r["Block Size"])
    if r["Metric Name"] in WANT:
        rows.setdefault(i, {})[r["Metric Name"]] = r["Metric Value"] + r["Metric Unit"][:2]
for i, m in rows.items():
    k, g, b = meta[i]
    print(f"{i:>3} {k} grid={g} block={b} " + " ".join(f"{n.split()[0]}={m.get(n, '-')}" for n in WANT))
