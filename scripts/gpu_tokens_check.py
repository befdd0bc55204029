"""Runs examples/generate on every fixture's golden prompts on the GPU (f32) and compares the
greedy ids with the goldens (which the CPU build reproduces: tests/golden.rs), up to the first
near-tie (reference top-2 margin < 0.01).

    python3 scripts/gpu_tokens_check.py path/to/generate [--dtype f32]
"""
import json
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def main(binary, dtype="f32"):
    total = ok = 0
    for golden in sorted(FIX.glob("*/golden.json")):
        g = json.load(open(golden))
        for i, case in enumerate(g["cases"]):
            n = len(case["greedy_ids"])
            out = subprocess.run(
                [binary, "--model", str(golden.parent), "--prompt-ids", ",".join(map(str, case["prompt_ids"])),
                 "--max-tokens", str(n), "--ignore-eos", "--json", "--dtype", dtype],
                capture_output=True, text=True, check=True)
            ids = json.loads(out.stdout.strip().splitlines()[-1])["sequences"][0]["ids"]
            margins = case["margins"]
            k = next((j for j, m in enumerate(margins) if m < 0.01), n)
            same = ids[:k] == case["greedy_ids"][:k]
            agree = next((j for j in range(n) if ids[j] != case["greedy_ids"][j]), n)
            total += 1
            ok += same
            print(json.dumps({"fixture": golden.parent.name, "case": i, "dtype": dtype, "compared": k,
                              "equal_up_to_near_tie": same, "agreeing_prefix": agree, "ids": ids}), flush=True)
    print(f"{ok} passed, {total - ok} failed")


if __name__ == "__main__":
    main(*sys.argv[1:])
