"""Greedy ids with a quantized KV cache on the GPU, batch-1 decode replayed from a CUDA graph
(the default) against the same binary with graphs off (CANDLE_GEMMA_CUDA_GRAPH=0), for each
golden prompt of the fixtures named, 4 and 8 bits (groups of 32: the fixtures' head dim),
packed from the first token and after 5 dense tokens, f32 and bf16; then 600-token runs whose
sliding layers' rings wrap many times. The replayed kernels are the captured ones, so the ids
must be identical. Prints each case, the graph state the graph run reported, and a summary;
exits 1 on any difference or when a graph run did not capture.

    python3 scripts/gpu_graph_kvq_check.py path/to/generate [fixture ...]
"""
import json
import os
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def run(binary, model, prompt, n, extra, graph):
    env = dict(os.environ, CANDLE_GEMMA_CUDA_GRAPH="1" if graph else "0")
    out = subprocess.run(
        [binary, "--model", str(model), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n),
         "--ignore-eos", "--json", "--kv-cache", "quantized", "--kv-group-size", "32"] + extra,
        capture_output=True, text=True, check=True, env=env)
    j = json.loads(out.stdout.strip().splitlines()[-1])
    return j["sequences"][0]["ids"], j["stats"].get("cuda_graph", "?")


def main(binary, *fixtures):
    total = same = captured = 0
    cases = []
    for name in fixtures or ["e2b-kvq", "e4b-text"]:
        g = json.load(open(FIX / name / "golden.json"))
        for i, case in enumerate(g["cases"]):
            cases.append((name, i, case["prompt_ids"], len(case["greedy_ids"])))
    cases.append(("e2b-kvq", "long", [2, 100, 200, 300], 600))
    for name, i, prompt, n in cases:
        for dtype in ("f32", "bf16"):
            for bits in (4, 8):
                for start in (0, 5):
                    extra = ["--dtype", dtype, "--kv-bits", str(bits), "--quantized-kv-start", str(start)]
                    on, state = run(binary, FIX / name, prompt, n, extra, True)
                    off, _ = run(binary, FIX / name, prompt, n, extra, False)
                    total += 1
                    same += on == off
                    captured += state.startswith("captured")
                    agree = next((j for j in range(n) if on[j] != off[j]), n)
                    print(json.dumps({"fixture": name, "case": i, "dtype": dtype, "bits": bits, "start": start,
                                      "tokens": n, "identical": on == off, "agreeing_prefix": agree,
                                      "graph": state}), flush=True)
    print(f"graph vs no graph: {same} of {total} identical; {captured} of {total} graph runs captured")
    sys.exit(0 if same == total and captured == total else 1)


if __name__ == "__main__":
    main(*sys.argv[1:])
