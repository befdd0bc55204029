"""Greedy ids with a quantized KV cache on the GPU against the same binary on the CPU (f32), for
each golden prompt of the fixtures named, 4 and 8 bits (groups of 32: the fixtures' head dim),
packed from the first token and after 5 dense tokens. The CPU path quantizes with the reference
code; the GPU path quantizes new tokens straight into the cache's slots. Prints the agreeing
prefix of GPU and CPU for each case.

    python3 scripts/gpu_kvq_check.py path/to/generate [fixture ...]
"""
import json
import subprocess
import sys
from pathlib import Path

FIX = Path(__file__).resolve().parent.parent / "fixtures"


def ids(binary, model, prompt, n, extra):
    out = subprocess.run(
        [binary, "--model", str(model), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(n),
         "--ignore-eos", "--json", "--dtype", "f32", "--kv-cache", "quantized", "--kv-group-size", "32"] + extra,
        capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["sequences"][0]["ids"]


def main(binary, *fixtures):
    total = same = 0
    for name in fixtures or ["e2b-kvq", "e4b-text"]:
        g = json.load(open(FIX / name / "golden.json"))
        for i, case in enumerate(g["cases"]):
            n = len(case["greedy_ids"])
            for bits in (4, 8):
                for start in (0, 5):
                    extra = ["--kv-bits", str(bits), "--quantized-kv-start", str(start)]
                    gpu = ids(binary, FIX / name, case["prompt_ids"], n, extra)
                    cpu = ids(binary, FIX / name, case["prompt_ids"], n, extra + ["--cpu"])
                    agree = next((j for j in range(n) if gpu[j] != cpu[j]), n)
                    total += 1
                    same += gpu == cpu
                    print(json.dumps({"fixture": name, "case": i, "bits": bits, "start": start,
                                      "identical": gpu == cpu, "agreeing_prefix": agree, "of": n}),
                          flush=True)
    print(f"{same} of {total} identical to the CPU")


if __name__ == "__main__":
    main(*sys.argv[1:])
