"""Batched greedy decode on the GPU with CUDA graphs on (the default) against the same binary
with graphs off (CANDLE_GEMMA_CUDA_GRAPH=0): for each fixture, batches of 3 and 17 prompts of
different lengths (the golden prompts and variants of them), dense (simple, rotating) and
quantized (4 and 8 bits, groups of 32, packed from the first token) caches, f32, and bf16 for
two fixtures; then 300-token runs whose sliding layers' rings wrap many times. The replayed
kernels are the captured ones, so the ids must be identical, and each graph run must report a
captured graph for its batch size. In f32 with a dense cache each sequence of the 3-prompt
batches must also equal the same prompt decoded alone (batch = single, graphs on); with a 4-bit
cache the comparison is reported, not required: the batched and one-row products round
differently in the last bits, and a 4-bit code can flip on such a difference. Prints each case
and a summary; exits 1 on any difference or when a graph run did not capture.

    python3 scripts/gpu_graph_batch_check.py path/to/generate
"""
import json
import os
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parent.parent / "fixtures"
KV = {
    "simple": ["--kv-cache", "simple"],
    "rotating": ["--kv-cache", "rotating"],
    "q4": ["--kv-cache", "quantized", "--kv-bits", "4", "--kv-group-size", "32"],
    "q8": ["--kv-cache", "quantized", "--kv-bits", "8", "--kv-group-size", "32"],
}


def run(binary, model, prompts, n, extra, graph):
    env = dict(os.environ, CANDLE_GEMMA_CUDA_GRAPH="1" if graph else "0")
    cmd = [binary, "--model", str(model), "--max-tokens", str(n), "--ignore-eos", "--json"] + extra
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    j = json.loads(out.stdout.strip().splitlines()[-1])
    return [s["ids"] for s in j["sequences"]], j["stats"].get("cuda_graph", "?")


def prompts_of(name, count):
    g = json.load(open(FIX / name / "golden.json"))
    base = [c["prompt_ids"] for c in g["cases"]]
    out = []
    for i in range(count):
        p = list(base[i % len(base)])
        # Variants: a few more tokens each round, so lengths and positions differ.
        out.append(p + [(7 * i + 3) % 200 + 10 for _ in range(i // len(base))])
    return out


def main(binary):
    total = same = captured = 0
    single_total = single_same = 0
    cases = []
    for name in ["e2b-kvq", "e4b-text", "moe-mlx", "dense-sharded"]:
        for count in (3, 17):
            for kv in KV:
                cases.append((name, count, kv, "f32", 24))
    for name in ["e2b-kvq", "moe-mlx"]:
        for kv in KV:
            cases.append((name, 17, kv, "bf16", 24))
    for kv in ("rotating", "q4"):
        cases.append(("e2b-kvq", 5, kv, "f32", 300))
    for name, count, kv, dtype, n in cases:
        prompts = prompts_of(name, count)
        extra = ["--dtype", dtype] + KV[kv]
        on, state = run(binary, FIX / name, prompts, n, extra, True)
        off, _ = run(binary, FIX / name, prompts, n, extra, False)
        total += 1
        same += on == off
        ok_state = f"batch {count}: captured" in state or (count == 1 and state.startswith("captured"))
        captured += ok_state
        first_diff = next(((b, j) for b in range(count) for j in range(n) if on[b][j] != off[b][j]), None)
        rec = {"fixture": name, "batch": count, "kv": kv, "dtype": dtype, "tokens": n,
               "identical": on == off, "first_difference": first_diff, "graph": state}
        if dtype == "f32" and count == 3 and n == 24 and kv in ("simple", "q4"):
            alone = [run(binary, FIX / name, [p], n, extra, True)[0][0] for p in prompts]
            rec["batch_equals_single"] = alone == on
            rec["batch_vs_single_first_difference"] = next(
                ((b, j) for b in range(count) for j in range(n) if on[b][j] != alone[b][j]), None)
            if kv == "simple":
                single_total += 1
                single_same += alone == on
        print(json.dumps(rec), flush=True)
    print(f"graph vs no graph: {same} of {total} identical; {captured} of {total} graph runs captured; "
          f"batch = single (graphs on, dense): {single_same} of {single_total}")
    sys.exit(0 if same == total and captured == total and single_same == single_total else 1)


if __name__ == "__main__":
    main(*sys.argv[1:])
