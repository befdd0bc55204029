#!/usr/bin/env python3
"""Markdown table of this crate's bench against the peers, with ratios (ours / peer), from the
JSON lines of `examples/bench.rs` and of the peer scripts (same shapes, same GPU, same run).

    python3 scripts/perf_table.py bench.jsonl peers.jsonl
"""
import json
import sys


def load(path):
    out = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def key(j):
    m = j.get("model", "").removesuffix("-config")
    if j.get("op") == "decode":
        return (m, f"decode b={j['batch']}")
    if j.get("op") == "prefill":
        return (m, f"prefill {j['tokens']}")
    return None


def main(ours_path, peers_path):
    ours, peers = {}, {}
    for j in load(ours_path):
        k = key(j)
        if k and j.get("kv", "dense") == "dense" and j.get("weights", "bf16") == "bf16" \
                and j.get("context", 128) == 128 and "tok_s" in j:
            ours[k] = j["tok_s"]
    engines = []
    for j in load(peers_path):
        k = key(j)
        e = j.get("engine")
        if e and e not in engines:
            engines.append(e)
        if k and "tok_s" in j:
            peers[(e,) + k] = j["tok_s"]
    models = ["e2b", "e4b", "26b-a4b", "31b"]
    ops = ["decode b=1", "decode b=8", "prefill 512", "prefill 4096"]
    head = "| shape | measure | candle-gemma (tok/s) | " + " | ".join(
        f"{e} (tok/s, ours/theirs)" for e in engines) + " |"
    print(head)
    print("|" + "---|" * (3 + len(engines)))
    for m in models:
        for op in ops:
            v = ours.get((m, op))
            if v is None:
                continue
            cells = []
            for e in engines:
                p = peers.get((e, m, op))
                cells.append("not run" if p is None else f"{p:,.1f} ({v / p:.1f}x)")
            print(f"| {m} | {op} | {v:,.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
