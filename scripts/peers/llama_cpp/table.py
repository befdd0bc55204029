#!/usr/bin/env python3
"""Ratio table of our `model_speed` bench against llama.cpp, from the logs `run.sh` writes.

    python3 table.py LOGDIR            # LOGDIR: the unpacked logs.tar.gz of one run

Reads LOGDIR/ours.jsonl (our bench's JSON lines; LOGDIR/ours-alone.jsonl, where present, holds
points measured again with nothing else running on the machine, and takes precedence), LOGDIR/llama-bench-<model>-<type>.jsonl
(`llama-bench -o jsonl`) and LOGDIR/llama-batched-<model>-<type>.jsonl
(`llama-batched-bench --output-format jsonl`). Prints one markdown row per shape, weight format
and measure, with tok/s of each side, ours over theirs, and the file each figure came from.
"""

import json
import os
import sys

# Our weight format -> the llama.cpp type it is set against, and the label of the pair.
PAIRS = [
    ("bf16", "bf16", "bf16 / BF16"),
    ("q8", "q8_0", "MLX 8-bit g64 / Q8_0"),
    ("q4", "q4_0", "MLX 4-bit g64 / Q4_0"),
]
MODELS = [("e4b", "E4B"), ("26b-a4b", "26B-A4B"), ("31b", "31B")]
# measure label, our selector, llama.cpp selector
MEASURES = [
    ("decode b=1, ctx 128 / depth 0", ("decode", 1, 128), ("tg", 0)),
    ("decode b=1, ctx 4096 / depth 4096", ("decode", 1, 4096), ("tg", 4096)),
    ("prefill 512", ("prefill", 512), ("pp", 512)),
    ("prefill 4096", ("prefill", 4096), ("pp", 4096)),
    ("decode b=8 (aggregate)", ("decode", 8, 128), ("batched", 8)),
    ("decode b=32 (aggregate)", ("decode", 32, 128), ("batched", 32)),
]


def json_lines(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def ours_value(rows, model, weights, sel):
    for r in rows:
        if r.get("model") != f"{model}-config" or r.get("weights") != weights:
            continue
        if r.get("kv", "dense") != "dense":
            continue
        if sel[0] == "prefill" and r.get("op") == "prefill" and r.get("tokens") == sel[1]:
            return r["tok_s"]
        if (
            sel[0] == "decode"
            and r.get("op") == "decode"
            and r.get("batch") == sel[1]
            and r.get("context") == sel[2]
        ):
            return r["tok_s"]
    return None


def llama_value(logdir, model, ltype, sel):
    if sel[0] == "batched":
        name = f"llama-batched-{model}-{ltype}.jsonl"
        for r in json_lines(os.path.join(logdir, name)):
            if r.get("pl") == sel[1]:
                return r["speed_tg"], name
        return None, name
    name = f"llama-bench-{model}-{ltype}.jsonl"
    for r in json_lines(os.path.join(logdir, name)):
        depth = r.get("n_depth", 0)
        if sel[0] == "tg" and r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0 and depth == sel[1]:
            return r["avg_ts"], name
        if sel[0] == "pp" and r.get("n_prompt") == sel[1] and r.get("n_gen", 0) == 0 and depth == 0:
            return r["avg_ts"], name
    return None, name


def fmt(x):
    if x is None:
        return "—"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def main():
    logdir = sys.argv[1] if len(sys.argv) > 1 else "."
    ours = json_lines(os.path.join(logdir, "ours.jsonl"))
    alone = json_lines(os.path.join(logdir, "ours-alone.jsonl"))
    device = next((r for r in ours if "copy_bandwidth_gb_s" in r), None)
    if device:
        print(f"copy bandwidth {device['copy_bandwidth_gb_s']:.0f} GB/s (our bench's SM copy)\n")
    print("| shape | weights (ours / llama.cpp) | measure | ours tok/s | llama.cpp tok/s | ours / llama.cpp | ours file | llama.cpp file |")
    print("|---|---|---|---|---|---|---|---|")
    for model, label in MODELS:
        for ours_w, ltype, pair in PAIRS:
            lines = []
            for mlabel, osel, lsel in MEASURES:
                a = ours_value(alone, model, ours_w, osel)
                ours_src = "ours-alone.jsonl"
                if a is None:
                    a = ours_value(ours, model, ours_w, osel)
                    ours_src = "ours.jsonl"
                b, src = llama_value(logdir, model, ltype, lsel)
                if a is None and b is None:
                    continue
                ratio = f"{a / b:.2f}x" if a and b else "—"
                lines.append(f"| {label} | {pair} | {mlabel} | {fmt(a)} | {fmt(b)} | {ratio} | `{ours_src}` | `{src}` |")
            print("\n".join(lines)) if lines else None


if __name__ == "__main__":
    main()
