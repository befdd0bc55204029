"""Greedy ids of every fixture prompt on the GPU against the same binary on the CPU (`--cpu`),
and the GPU batch of all of a fixture's prompts against each prompt alone on the GPU, in one
activation dtype (bf16 by default). Two paths that round differently may part at a position
the f32 reference calls a near-tie; a case passes when both agree up to the first position
whose f32 top-2 margin (from golden.json) is below the near-tie threshold (0.05 in bf16, 0.01
in f32).

On these small random-weight fixtures bf16 is far from f32: the CPU's own bf16 run leaves the
f32 goldens after 0-17 tokens, at margins up to ~1, so the bf16 comparisons mostly measure
rounding, not bugs. In f32 they are a real check of the batched path.

    python3 scripts/gpu_tokens_compare.py path/to/generate [bf16|f32]   # a cuda build
"""
import json
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parent.parent / "fixtures"
# Top-2 logit margins below this (in the f32 reference) may flip under the dtype's rounding.
NEAR_TIE = {"bf16": 0.05, "f32": 0.01}


def run(binary, model, prompts, n, cpu, dtype):
    args = [binary, "--model", str(model), "--max-tokens", str(n), "--ignore-eos", "--json",
            "--dtype", dtype]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    if cpu:
        args.append("--cpu")
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return [s["ids"] for s in json.loads(out.stdout.strip().splitlines()[-1])["sequences"]]


def agree(a, b):
    return next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))


def main(binary, dtype="bf16"):
    near_tie = NEAR_TIE[dtype]
    total = ok = 0
    for golden in sorted(FIX.glob("*/golden.json")):
        g = json.load(open(golden))
        cases = g["cases"]
        n = min(len(c["greedy_ids"]) for c in cases)
        alone = []
        for i, case in enumerate(cases):
            gpu = run(binary, golden.parent, [case["prompt_ids"]], n, cpu=False, dtype=dtype)[0]
            cpu = run(binary, golden.parent, [case["prompt_ids"]], n, cpu=True, dtype=dtype)[0]
            alone.append(gpu)
            k = next((j for j, m in enumerate(case["margins"][:n]) if m < near_tie), n)
            a = agree(gpu, cpu)
            same = a >= k
            total += 1
            ok += same
            print(json.dumps({"fixture": golden.parent.name, "case": i, "check": f"gpu_vs_cpu_{dtype}",
                              "compared": k, "agreeing_prefix": a, "pass": same}), flush=True)
        if len(cases) > 1:
            batch = run(binary, golden.parent, [c["prompt_ids"] for c in cases], n, cpu=False,
                        dtype=dtype)
            for i, case in enumerate(cases):
                k = next((j for j, m in enumerate(case["margins"][:n]) if m < near_tie), n)
                a = agree(batch[i], alone[i])
                same = a >= k
                total += 1
                ok += same
                print(json.dumps({"fixture": golden.parent.name, "case": i,
                                  "check": f"gpu_batch_vs_alone_{dtype}", "compared": k,
                                  "agreeing_prefix": a, "pass": same}), flush=True)
    print(f"{ok} passed, {total - ok} failed")
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
