#!/usr/bin/env python3
"""A captured decode graph must not replay after an eager launch replaced a scratch buffer it
holds (batch-8 steps and a longer prefill between the capture and the replay grow them).

Runs the bench over batch 1 and 8 at contexts 4096 and 32768 with 4-bit KV ROUNDS times with
graphs on and once with graphs off, and checks that every (batch, context) point gives the same
step ids in every run. Exit 1 on any difference.

    python3 scripts/gpu_graph_scratch_check.py .device/model_speed [ROUNDS]
"""
import json
import os
import subprocess
import sys

bench = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
cmd = [bench, "--config", "fixtures/real-configs/e4b-config.json", "--prefill", "0",
       "--batch", "1,8", "--context", "4096,32768", "--steps", "16", "--kv", "q4"]
ids = {}
runs = [("graph", r) for r in range(rounds)] + [("no graph", 0)]
for kind, r in runs:
    env = dict(os.environ, CANDLE_GEMMA_CUDA_GRAPH="0" if kind == "no graph" else "1")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("{") and '"decode"' in line:
            d = json.loads(line)
            ids.setdefault((d["batch"], d["context"]), []).append((kind, r, d["step_ids"]))
bad = 0
for point, got in sorted(ids.items()):
    distinct = {tuple(i) for _, _, i in got}
    print(json.dumps({"batch": point[0], "context": point[1], "runs": len(got),
                      "distinct": len(distinct)}))
    bad += len(distinct) > 1
print(f"{len(ids) - bad} of {len(ids)} points identical over {len(runs)} runs")
sys.exit(1 if bad else 0)
