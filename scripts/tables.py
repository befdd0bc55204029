#!/usr/bin/env python3
"""Markdown tables from the benches' JSON lines (one object a line; other lines are skipped).

    python3 scripts/tables.py model  BENCH.jsonl [PEERS.jsonl]   # model speed, peers beside it
    python3 scripts/tables.py decode BENCH.jsonl... [--field F]  # every decode point, A/B by F
    python3 scripts/tables.py attention RUN.jsonl...             # decode attention, packed vs dense
    python3 scripts/tables.py matvec RUN.jsonl...                # packed one-row products
    python3 scripts/tables.py ncu LOG.csv [--wall-ms MS] [--top N] [--label L]

`model`, `decode`: lines of `cargo bench --features cuda --bench model_speed -- ...` (and of
`scripts/peers/*`). `attention`, `matvec`: lines of `cargo bench --features cuda --bench
cuda_kernels -- --attention-only | --matmul-only`. Where several runs are given, each cell is
the range over them. `ncu`: a `ncu --csv --metrics gpu__time_duration.sum` log, kernels grouped
by name, with the host's share when the wall time of the same region is given.
"""
import argparse
import collections
import csv
import io
import json
import re


def lines(paths):
    for path in paths:
        for line in open(path, errors="replace"):
            line = line.strip()
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def span(xs, fmt):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "—"
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


MODELS = ["e2b", "e4b", "26b-a4b", "31b"]


def measure(j):
    m = j.get("model", "").removesuffix("-config")
    if j.get("op") == "decode":
        return m, f"decode b={j['batch']}"
    if j.get("op") == "prefill":
        return m, f"prefill {j['tokens']}"
    return None


def model_table(a):
    """Model speed at context 128, bf16 weights, dense KV; peers' tok/s with ours/theirs."""
    ours = collections.defaultdict(list)
    for j in lines(a.bench):
        k = measure(j)
        if k and "tok_s" in j and j.get("kv", "dense") == "dense" \
                and j.get("weights", "bf16") == "bf16" and j.get("context", 128) == 128:
            ours[k].append(j["tok_s"])
    peers, engines = {}, []
    for j in lines(a.peers or []):
        e, k = j.get("engine"), measure(j)
        if e and e not in engines:
            engines.append(e)
        if e and k and "tok_s" in j:
            peers[(e,) + k] = j["tok_s"]
    print("| shape | measure | candle-gemma (tok/s) |"
          + "".join(f" {e} (tok/s, ours/theirs) |" for e in engines))
    print("|" + "---|" * (3 + len(engines)))
    ops = ["decode b=1", "decode b=8", "decode b=32", "prefill 512", "prefill 4096"]
    for m in MODELS:
        for op in ops:
            v = ours.get((m, op))
            if not v:
                continue
            cells = []
            for e in engines:
                p = peers.get((e, m, op))
                cells.append("not run" if p is None else f"{p:,.1f} ({max(v) / p:.1f}x)")
            print(f"| {m} | {op} | {span(v, '{:,.1f}')} |" + "".join(f" {c} |" for c in cells))


def decode_table(a):
    """Every decode point: tok/s, host and step ms; with --field, one row per value of it."""
    runs = collections.defaultdict(list)
    ids = collections.defaultdict(set)
    for j in lines(a.bench):
        if j.get("op") != "decode":
            continue
        key = (j.get("model", "").removesuffix("-config"), j.get("weights", "bf16"),
               j.get("kv", "dense"), j["batch"], j.get("context"), j.get(a.field) if a.field else "")
        runs[key].append(j)
        if "step_ids" in j:
            ids[key[:5]].add(tuple(j["step_ids"]))
    ab = f" {a.field} |" if a.field else ""
    print(f"| model | weights | kv | batch | context |{ab} tok/s | host ms | step ms |")
    print("|---|---|---|---|---|" + ("---|" if a.field else "") + "---|---|---|")
    order = lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9,) + tuple(str(x).zfill(8) for x in k[1:])
    for key in sorted(runs, key=order):
        r = runs[key]
        ab = f" {key[5]} |" if a.field else ""
        print(f"| {' | '.join(str(k) for k in key[:5])} |{ab} {span([x['tok_s'] for x in r], '{:,.1f}')} "
              f"| {span([x.get('host_ms') for x in r], '{:.2f}')} | {span([x.get('step_ms') for x in r], '{:.2f}')} |")
    for key in sorted(ids, key=str):
        if len(ids[key]) > 1:
            print(f"\n{' '.join(map(str, key))}: {len(ids[key])} distinct step-id lists over the runs")


def attention_table(a):
    """Decode attention (one query): µs a call timed back to back on the GPU, and the ratios."""
    pts = collections.defaultdict(lambda: collections.defaultdict(list))
    for d in lines(a.runs):
        if d.get("bench") != "qsdpa" or d.get("q_len") != 1:
            continue
        p = pts[(d["shape"], d["keys"])]
        us = lambda k: None if d.get(k) is None else d[k] * 1e6
        p[f"q{d['bits']}"].append(us("queued_seconds"))
        p["dense"].append(us("dense_queued_seconds"))
        p[f"x{d['bits']}"].append(d.get("queued_speedup"))
        p[f"w{d['bits']}"].append(d.get("speedup"))
    print("| shape | keys | 4-bit µs | 8-bit µs | dense bf16 µs | 4-bit vs dense | 8-bit vs dense "
          "| wall clock, 4-bit / 8-bit vs dense |")
    print("|---|---|---|---|---|---|---|---|")
    for (shape, keys), p in sorted(pts.items()):
        print(f"| {shape} | {keys // 1024}k | {span(p['q4'], '{:.1f}')} | {span(p['q8'], '{:.1f}')} "
              f"| {span(p['dense'], '{:.1f}')} | {span(p['x4'], '{:.2f}x')} | {span(p['x8'], '{:.2f}x')} "
              f"| {span(p['w4'], '{:.2f}')} / {span(p['w8'], '{:.2f}')} |")


def matvec_table(a):
    """Packed products at --rows rows: share of the device copy, timed back to back on the GPU."""
    pts = collections.defaultdict(list)
    copy = []
    for d in lines(a.runs):
        if d.get("bench") == "copy":
            copy.append(d["gb_per_s"])
        elif d.get("bench") == "qmatmul" and d.get("rows") == a.rows:
            f = d.get("queued_fraction_of_copy", d.get("fraction_of_copy"))
            pts[(d["shape"], d["out"], d["in"], d["bits"], d["group"])].append(f)
    print(f"Copy {span(copy, '{:,.0f}')} GB/s; {a.rows} row(s); share of the copy bandwidth.\n")
    print("| projection | out x in | bits | group | share of copy |")
    print("|---|---|---|---|---|")
    for (shape, o, i, bits, group), f in sorted(pts.items()):
        print(f"| {shape} | {o}x{i} | {bits} | {group} | {span(f, '{:.3f}')} |")


UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


def ncu_summary(a):
    """Kernels of an ncu log grouped by name, largest GPU time first."""
    text = open(a.csv, errors="replace").read()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:]))) if start >= 0 else []
    by = collections.defaultdict(lambda: [0, 0.0])
    total, n = 0.0, 0
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", "")) * UNITS.get(r["Metric Unit"], 1e-6)
        k = re.sub(r"[(<].*", "", r["Kernel Name"]).strip()[:60]
        by[k][0] += 1
        by[k][1] += v
        total, n = total + v, n + 1
    print(f"== {a.label} kernels: {n}, GPU time {total:.3f} ms")
    if a.wall_ms:
        gap = a.wall_ms - total
        print(f"   wall {a.wall_ms:.3f} ms: GPU busy {100 * total / a.wall_ms:.1f}%, "
              f"host-side gap {gap:.3f} ms ({gap * 1e3 / max(n, 1):.1f} µs a launch)")
    if a.kinds:
        kinds = collections.defaultdict(float)
        for k, (_, t) in by.items():
            kinds[kernel_kind(k)] += t
        for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"   {t:9.3f} ms {100 * t / max(total, 1e-9):5.1f}%  {kind}")
        return
    for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"   {t:9.3f} ms {100 * t / max(total, 1e-9):5.1f}%  x{c:<5d} {k}")


# Kernel-name patterns of the kinds in performance tables, first match wins.
KINDS = [
    (r"nvjet|gemm|cutlass", "cuBLAS GEMMs"),
    (r"prefill_attn", "flash prefill attention"),
    (r"masked_softmax", "masked softmax over the materialised scores"),
    (r"ucopy|copy2d|cast_|to_dtype", "copies and casts"),
    (r"add_norm", "add + norm"),
    (r"gelu", "GeGLU"),
    (r"dense_mv|qmv", "one-row products"),
    (r"moe|gather", "MoE routing, gather and mix"),
    (r"qkv|kv_", "q/k/v prep and K/V writes"),
]


def kernel_kind(name):
    for pattern, kind in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="table", required=True)
    p = sub.add_parser("model")
    p.add_argument("bench", nargs=1)
    p.add_argument("peers", nargs="?")
    p.set_defaults(run=model_table, peers=None)
    p = sub.add_parser("decode")
    p.add_argument("bench", nargs="+")
    p.add_argument("--field")
    p.set_defaults(run=decode_table)
    p = sub.add_parser("attention")
    p.add_argument("runs", nargs="+")
    p.set_defaults(run=attention_table)
    p = sub.add_parser("matvec")
    p.add_argument("runs", nargs="+")
    p.add_argument("--rows", type=int, default=1)
    p.set_defaults(run=matvec_table)
    p = sub.add_parser("ncu")
    p.add_argument("csv")
    p.add_argument("--wall-ms", type=float)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--label", default="")
    p.add_argument("--kinds", action="store_true", help="group kernels by kind")
    p.set_defaults(run=ncu_summary)
    a = ap.parse_args()
    if a.table == "model" and a.peers:
        a.peers = [a.peers]
    a.run(a)


if __name__ == "__main__":
    main()
