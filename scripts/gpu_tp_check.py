"""Tensor-parallel token checks on the GPU machine (2 GPUs), examples/generate built with
`--features nccl`:
  f32   every fixture's golden prompts at --tp 2 against the goldens, up to the first near-tie
        (reference top-2 margin < 0.01), as scripts/gpu_tokens_check.py does at one GPU;
  bf16  the first golden prompt of every fixture at --tp 2 against --tp 1 of the same binary;
  kv    each cache kind (simple, rotating, quantized 8/4-bit) at --tp 2 against --tp 1 (f32);
  batch three prompts as one batch at --tp 2 against --tp 1 (f32), greedy and sampled (top-k
        40, top-p 0.9 and min-p 0.02 at temperature 1: drawn on each rank's GPU).
    python3 scripts/gpu_tp_check.py path/to/generate fixtures   # generate built with --features nccl
"""
import json, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BIN, FIX = sys.argv[1], Path(sys.argv[2])
# An optional third argument keeps the checks whose name starts with it (e.g. "kv").
ONLY = sys.argv[3] if len(sys.argv) > 3 else ""


def gen(model, prompts, n, dtype="f32", tp=2, extra=()):
    cmd = [BIN, "--model", str(model), "--max-tokens", str(n), "--ignore-eos", "--json", "--dtype", dtype, "--tp", str(tp)]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    cmd += list(extra)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "no answer in 120 s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-400:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def near_tie(margins, n):
    return next((j for j, m in enumerate(margins) if m < 0.01), n)


def f32_case(job):
    golden, i, case = job
    n = len(case["greedy_ids"])
    r = gen(golden.parent, [case["prompt_ids"]], n)
    if "error" in r:
        return {"fixture": golden.parent.name, "case": i, "ok": False, "error": r["error"]}
    ids = r["sequences"][0]["ids"]
    k = near_tie(case["margins"], n)
    agree = next((j for j in range(n) if ids[j] != case["greedy_ids"][j]), n)
    return {"check": "f32-golden", "fixture": golden.parent.name, "case": i, "compared": k,
            "ok": ids[:k] == case["greedy_ids"][:k], "agreeing_prefix": agree}


def pair(name, model, prompts, n, dtype="f32", extra=(), limit=None):
    a, b = gen(model, prompts, n, dtype, 1, extra), gen(model, prompts, n, dtype, 2, extra)
    if "error" in a or "error" in b:
        return {"check": name, "fixture": model.name, "ok": False, "error": a.get("error") or b.get("error")}
    sa = [s["ids"] for s in a["sequences"]]
    sb = [s["ids"] for s in b["sequences"]]
    agree = [next((j for j in range(len(x)) if x[j] != y[j]), len(x)) for x, y in zip(sa, sb)]
    k = n if limit is None else limit
    return {"check": name, "fixture": model.name, "ok": all(x[:k] == y[:k] for x, y in zip(sa, sb)),
            "compared": k, "agreeing_prefix": agree, "tp1": sa[0][:8], "tp2": sb[0][:8]}


def main():
    goldens = sorted(FIX.glob("*/golden.json"))
    jobs = [(g, i, c) for g in goldens for i, c in enumerate(json.load(open(g))["cases"])]
    results = []
    # One process at a time: two-GPU processes sharing the GPUs slow each other's collectives
    # (a waiting NCCL kernel keeps its GPU busy) by orders of magnitude.
    with ThreadPoolExecutor(1) as ex:
        for r in ex.map(f32_case, jobs if "f32-golden".startswith(ONLY) else []):
            print(json.dumps(r), flush=True); results.append(r)
        extra = []
        for g in goldens if "bf16".startswith(ONLY) else []:
            c = json.load(open(g))["cases"][0]
            extra.append(ex.submit(pair, "bf16-tp2-vs-tp1", g.parent, [c["prompt_ids"]], 24, "bf16",
                                   (), near_tie(c["margins"], 24)))
        kvfix = FIX / "e2b-kvq"
        c = json.load(open(kvfix / "golden.json"))["cases"][1]
        kvs = (["--kv-cache", "simple"], ["--kv-cache", "rotating"],
               ["--kv-cache", "quantized", "--kv-bits", "8", "--kv-group-size", "32"],
               ["--kv-cache", "quantized", "--kv-bits", "4", "--kv-group-size", "32"])
        for kv in kvs if "kv".startswith(ONLY) else ():
            extra.append(ex.submit(pair, "kv " + " ".join(kv[1:]), kvfix, [c["prompt_ids"]], 24, "f32", kv))
        for fx in ("moe-mlx", "e2b-hf", "dense-sharded") if "batch".startswith(ONLY) else ():
            cs = json.load(open(FIX / fx / "golden.json"))["cases"]
            extra.append(ex.submit(pair, "batch-of-3", FIX / fx, [x["prompt_ids"] for x in cs], 16))
            sampled = ["--temperature", "1", "--top-k", "40", "--top-p", "0.9", "--min-p", "0.02", "--seed", "7"]
            extra.append(ex.submit(pair, "batch-of-3 sampled", FIX / fx, [x["prompt_ids"] for x in cs], 16,
                                   "f32", sampled))
        for f in extra:
            r = f.result(); print(json.dumps(r), flush=True); results.append(r)
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed")


if __name__ == "__main__":
    main()
