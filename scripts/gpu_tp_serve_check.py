"""The server sharded over GPUs (`serve --tp 2`, built with `--features nccl`) against the
goldens, on the GPU machine: for each fixture, every golden prompt is sent at once as a dense
greedy request and as a 4-bit KV one, so the ranks decode them as one batch (through their
decode graphs). Dense ids must equal the goldens up to the first near-tie; the 4-bit requests'
ids are compared with the same requests at --tp 1 and reported.
    python3 scripts/gpu_tp_serve_check.py path/to/serve fixtures
"""
import json, re, subprocess, sys, threading, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BIN, FIX = sys.argv[1], Path(sys.argv[2])


def start(model, tp):
    p = subprocess.Popen([BIN, "--model", str(model), "--served-model-name", model.name, "--dtype", "f32",
                          "--port", "0", "--tp", str(tp)],
                         stderr=subprocess.PIPE, text=True)
    for line in p.stderr:
        m = re.search(r"on (http://\S+)", line)
        if m:
            # Keep draining the log so that the server never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, m.group(1)
    raise RuntimeError(f"{model} --tp {tp}: the server ended before listening")


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode()[:400]}") from None


def ids(resp):
    return resp["choices"][0]["token_ids"]


def run(model, tp, cases):
    p, url = start(model, tp)
    try:
        bodies = []
        for c in cases:
            n = len(c["greedy_ids"])
            dense = {"model": model.name, "prompt": c["prompt_ids"], "max_tokens": n, "temperature": 0,
                     "ignore_eos": True, "return_token_ids": True}
            four = dict(dense, kv_bits=4, kv_group_size=32)
            bodies += [dense, four]
        with ThreadPoolExecutor(len(bodies)) as ex:
            out = list(ex.map(lambda b: ids(post(url, b)), bodies))
        return out[0::2], out[1::2]
    finally:
        p.terminate(); p.wait(timeout=30)


def main():
    results = []
    for fx in ("e2b-kvq", "dense-sharded", "moe-mlx"):
        model = FIX / fx
        cases = json.load(open(model / "golden.json"))["cases"]
        t = time.time()
        dense2, four2 = run(model, 2, cases)
        _, four1 = run(model, 1, cases)
        for i, c in enumerate(cases):
            n = len(c["greedy_ids"])
            k = next((j for j, m in enumerate(c["margins"]) if m < 0.01), n)
            r = {"fixture": fx, "case": i, "compared": k, "ok": dense2[i][:k] == c["greedy_ids"][:k],
                 "four_bit_tp2_equals_tp1": four2[i] == four1[i], "four_bit_tokens": len(four2[i])}
            print(json.dumps(r), flush=True); results.append(r)
        print(f"{fx}: {time.time() - t:.1f} s", flush=True)
    bad = [r for r in results if not r["ok"] or r["four_bit_tokens"] == 0]
    print(f"{len(results) - len(bad)} passed, {len(bad)} failed; "
          f"4-bit tp2 == tp1 in {sum(r['four_bit_tp2_equals_tp1'] for r in results)} of {len(results)}")


if __name__ == "__main__":
    main()
