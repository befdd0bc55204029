"""Summarises decode lines of the bench (JSON, one a line) from an A/B run: one row per model,
KV cache, batch and value of the A/B field, each run as tok/s with its host and step time;
then, where the lines carry `step_ids`, how many distinct lists of step ids each model and
cache gave over all runs (1: every run computed the same tokens).

    python3 scripts/decode_ab_table.py decode.jsonl FIELD
"""
import json
import sys
from collections import defaultdict


def main(path, field):
    runs = defaultdict(list)
    ids = defaultdict(set)
    for line in open(path):
        j = json.loads(line)
        runs[(j["model"], j["kv"], j["batch"], j[field])].append(
            "%.1f tok/s (host %.2f ms, step %.2f ms; %s)"
            % (j["tok_s"], j["host_ms"], j["step_ms"], j.get("cuda_graph", "")[:14]))
        if "step_ids" in j:
            ids[(j["model"], j["kv"])].add(tuple(j["step_ids"]))
    for key in sorted(runs):
        print(*key, "|", "; ".join(runs[key]))
    for key in sorted(ids):
        print(*key, "distinct step-id lists over all runs:", len(ids[key]))


if __name__ == "__main__":
    main(*sys.argv[1:])
