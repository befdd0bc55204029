#!/usr/bin/env python3
"""Load generator for the OpenAI-compatible server of `examples/serve` (standard library only).

For each concurrency level (default 1, 8, 32, 64) it sends `--requests` streamed
`POST /v1/completions` requests (the prompt as a list of random token ids, `ignore_eos`, greedy)
from that many client threads and reports aggregate tok/s, time to first token and inter-token
latency (p50, p99), and errors by HTTP status: one JSON line per level on stdout, then a
markdown table.

`--join-streams N` adds the "long prompt joins" probe: N streams run, then one
`--join-prompt-len` (4,096) token prompt is sent; the running streams' inter-token latency
during its prefill (from sending it to its first token) is reported next to their latency before
it.

`--self-test` starts a tiny fake server on 127.0.0.1 that streams fake tokens (and answers 429
above a concurrency cap), runs every level and the probe against it, and checks the counts.

    python3 scripts/loadgen.py --url http://127.0.0.1:8080 --prompt-len 128 --max-tokens 128
    python3 scripts/loadgen.py --kv-bits 4 --concurrency 32 --join-streams 8
    python3 scripts/loadgen.py --shared-prefix 1024 --prompt-len 1100 --concurrency 8
    python3 scripts/loadgen.py --self-test
"""

import argparse
import http.client
import http.server
import json
import math
import queue
import random
import socketserver
import sys
import threading
import time
import urllib.parse


def percentile(values, p):
    """Nearest-rank percentile of `values` (None when empty)."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return s[k]


class Result:
    """What one request saw: send time, token arrival times, status, error."""

    def __init__(self):
        self.sent = 0.0
        self.done = 0.0
        self.status = None
        self.error = None
        # (arrival time, tokens in that chunk) per token-bearing chunk.
        self.chunks = []
        self.usage_tokens = None

    @property
    def ok(self):
        return self.status == 200 and self.error is None

    def tokens(self):
        if self.usage_tokens is not None:
            return self.usage_tokens
        return sum(n for _, n in self.chunks)

    def ttft(self):
        return self.chunks[0][0] - self.sent if self.chunks else None

    def gaps(self):
        """Inter-token gaps as (start, end, per-token seconds, tokens)."""
        out = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:]):
            out.append((t0, t1, (t1 - t0) / max(n, 1), max(n, 1)))
        return out


def chunk_tokens(event):
    """Tokens a completion chunk carries: its token ids when returned, else one per non-empty
    text delta."""
    n = 0
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            n += len(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            n += 1
    return n


def stream_request(url, body, api_key, timeout):
    """Sends one streamed completion request and records the arrival of every token chunk."""
    r = Result()
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    payload = json.dumps(body).encode()
    try:
        r.sent = time.perf_counter()
        conn.request("POST", (u.path.rstrip("/") or "") + "/v1/completions", payload, headers)
        resp = conn.getresponse()
        r.status = resp.status
        if resp.status != 200:
            resp.read()
            return r
        finished = False
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                break
            event = json.loads(data)
            if "error" in event:
                r.error = "stream error: " + str(event["error"])[:200]
                break
            now = time.perf_counter()
            n = chunk_tokens(event)
            if n:
                r.chunks.append((now, n))
            usage = event.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                r.usage_tokens = usage["completion_tokens"]
        if not finished and r.error is None:
            r.error = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - every failure is counted, never raised
        r.error = type(e).__name__ + ": " + str(e)[:200]
    finally:
        r.done = time.perf_counter()
        conn.close()
    return r


def request_body(args, rng, prompt_len, max_tokens):
    shared = min(args.shared_prefix, prompt_len)
    common = random.Random(args.seed)
    prompt = [common.randrange(args.min_token_id, args.vocab) for _ in range(shared)]
    prompt += [rng.randrange(args.min_token_id, args.vocab) for _ in range(prompt_len - shared)]
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    # Greedy unless --sampled, which leaves the sampling fields to the server (the model's
    # recommended sampling: Gemma 4's temperature 1, top-k 64, top-p 0.95).
    if not args.sampled:
        body["temperature"] = 0.0
    if args.token_ids:
        body["return_token_ids"] = True
    if args.model:
        body["model"] = args.model
    if args.kv_bits is not None:
        body["kv_bits"] = args.kv_bits
    if args.json_object:
        body["response_format"] = {"type": "json_object"}
    return body


def error_key(r):
    if r.status is not None and r.status != 200:
        return str(r.status)
    return r.error.split(":")[0] if r.error else "unknown"


def summarize(concurrency, results, wall):
    ok = [r for r in results if r.ok]
    errors = {}
    samples = []
    for r in results:
        if not r.ok:
            k = error_key(r)
            errors[k] = errors.get(k, 0) + 1
            if r.error and r.error not in samples and len(samples) < 3:
                samples.append(r.error)
    tokens = sum(r.tokens() for r in ok)
    ttfts = [r.ttft() for r in ok if r.ttft() is not None]
    itls = [g for r in ok for (_, _, g, n) in r.gaps() for _ in range(n)]
    ms = lambda x: None if x is None else round(x * 1000.0, 2)  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "error_samples": samples,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 1) if wall > 0 else None,
        "ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p99": ms(percentile(ttfts, 99))},
        "itl_ms": {"p50": ms(percentile(itls, 50)), "p99": ms(percentile(itls, 99))},
    }


def run_level(args, concurrency, requests):
    """`requests` requests from `concurrency` client threads; returns the summary."""
    rng = random.Random(args.seed * 1000003 + concurrency)
    bodies = queue.Queue()
    for _ in range(requests):
        bodies.put(request_body(args, rng, args.prompt_len, args.max_tokens))
    results, lock = [], threading.Lock()

    def worker():
        while True:
            try:
                body = bodies.get_nowait()
            except queue.Empty:
                return
            r = stream_request(args.url, body, args.api_key, args.timeout)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(concurrency, results, time.perf_counter() - start)


def run_join_probe(args):
    """N streams run; one long prompt joins; the streams' inter-token latency during its
    prefill against before it."""
    n = args.join_streams
    rng = random.Random(args.seed * 7919 + n)
    results = [None] * n

    def stream(i, body):
        results[i] = stream_request(args.url, body, args.api_key, args.timeout)

    threads = []
    for i in range(n):
        body = request_body(args, rng, args.prompt_len, args.join_stream_tokens)
        threads.append(threading.Thread(target=stream, args=(i, body), daemon=True))
    for t in threads:
        t.start()
    time.sleep(args.join_after)
    long_body = request_body(args, rng, args.join_prompt_len, 1)
    joined = stream_request(args.url, long_body, args.api_key, args.timeout)
    for t in threads:
        t.join()
    ok = [r for r in results if r is not None and r.ok]
    window = None
    if joined.ok and joined.chunks:
        window = (joined.sent, joined.chunks[0][0])
    before, during = [], []
    for r in ok:
        for (t0, t1, g, k) in r.gaps():
            if window and t1 >= window[0] and t0 <= window[1]:
                during.extend([g] * k)
            elif window is None or t1 < window[0]:
                before.extend([g] * k)
    ms = lambda x: None if x is None else round(x * 1000.0, 2)  # noqa: E731
    p50_before = percentile(before, 50)
    p99_during = percentile(during, 99)
    ratio = None
    if p50_before and p99_during is not None:
        ratio = round(p99_during / p50_before, 2)
    return {
        "probe": "long_prompt_joins",
        "streams": n,
        "streams_ok": len(ok),
        "join_prompt_tokens": args.join_prompt_len,
        "join_status": joined.status,
        "join_error": joined.error,
        "join_prefill_ms": ms(window[1] - window[0]) if window else None,
        "itl_before_ms": {"p50": ms(p50_before), "p99": ms(percentile(before, 99))},
        "itl_during_ms": {"p50": ms(percentile(during, 50)), "p99": ms(p99_during)},
        "gaps_during": len(during),
        "p99_during_over_p50_before": ratio,
    }


def fmt(x):
    return "-" if x is None else str(x)


def markdown(levels, probe):
    lines = [
        "| concurrency | requests | ok | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in levels:
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
        lines.append(
            f"| {s['concurrency']} | {s['requests']} | {s['ok']} | {fmt(s['tok_s'])} "
            f"| {fmt(s['ttft_ms']['p50'])} | {fmt(s['ttft_ms']['p99'])} "
            f"| {fmt(s['itl_ms']['p50'])} | {fmt(s['itl_ms']['p99'])} | {errs} |"
        )
    if probe:
        lines += [
            "",
            f"Long prompt joins ({probe['join_prompt_tokens']} tokens, {probe['streams']} "
            f"streams): prefill {fmt(probe['join_prefill_ms'])} ms; running streams' ITL "
            f"before p50 {fmt(probe['itl_before_ms']['p50'])} / p99 "
            f"{fmt(probe['itl_before_ms']['p99'])} ms, during p50 "
            f"{fmt(probe['itl_during_ms']['p50'])} / p99 {fmt(probe['itl_during_ms']['p99'])} "
            f"ms (p99 during / p50 before: {fmt(probe['p99_during_over_p50_before'])}).",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The fake server of --self-test.


class FakeHandler(http.server.BaseHTTPRequestHandler):
    """Streams `max_tokens` fake completion chunks (chunked transfer, SSE), after a prefill
    delay proportional to the prompt; 429 above the server's concurrency cap; 400 for a bad
    `kv_bits`."""

    protocol_version = "HTTP/1.1"
    token_s = 0.002
    prefill_s_per_token = 0.00001
    cap = 48
    active = 0
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def send_json(self, status, obj, extra=()):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/completions":
            return self.send_json(404, {"error": {"message": "not found", "type": "invalid_request_error", "param": None, "code": None}})
        try:
            req = json.loads(body)
        except ValueError:
            return self.send_json(400, {"error": {"message": "bad json", "type": "invalid_request_error", "param": None, "code": None}})
        if req.get("kv_bits") not in (None, 4, 8):
            return self.send_json(400, {"error": {"message": "kv_bits", "type": "invalid_request_error", "param": "kv_bits", "code": "invalid_kv_bits"}})
        cls = type(self)
        with cls.lock:
            if cls.active >= cls.cap:
                full = True
            else:
                cls.active += 1
                full = False
        if full:
            return self.send_json(429, {"error": {"message": "queue full", "type": "server_error", "param": None, "code": "queue_full"}}, [("Retry-After", "1")])
        try:
            self.stream(req)
            self.close_connection = True
        finally:
            with cls.lock:
                cls.active -= 1

    def stream(self, req):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        prompt = req.get("prompt") or []
        time.sleep(len(prompt) * self.prefill_s_per_token)
        n = int(req.get("max_tokens", 16))
        for i in range(n):
            if i:
                time.sleep(self.token_s)
            choice = {"index": 0, "text": f" t{i}",
                      "finish_reason": "length" if i == n - 1 else None}
            if req.get("return_token_ids"):
                choice["token_ids"] = [1000 + i]
            ev = {"id": "cmpl-fake", "object": "text_completion", "choices": [choice]}
            self.chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        self.chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self.chunk(b"data: [DONE]\n\n")
        self.chunk(b"")


class FakeServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def handle_error(self, request, client_address):
        # A client closing its connection after `[DONE]` is normal.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def self_test(args):
    server = FakeServer(("127.0.0.1", 0), FakeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args.url = f"http://127.0.0.1:{server.server_address[1]}"
    args.max_tokens = 16
    args.prompt_len = 32
    failures = []
    levels = []
    for c in [1, 8, 32, 64]:
        n = max(2 * c, 8)
        s = run_level(args, c, n)
        levels.append(s)
        print(json.dumps(s), flush=True)
        rejected = s["errors"].get("429", 0)
        if s["ok"] + rejected != n or set(s["errors"]) - {"429"}:
            failures.append(f"level {c}: unexpected errors {s['errors']}")
        if s["completion_tokens"] != 16 * s["ok"]:
            failures.append(f"level {c}: {s['completion_tokens']} tokens for {s['ok']} requests")
        if c < FakeHandler.cap and rejected:
            failures.append(f"level {c}: 429 below the cap")
        if s["ok"] and (s["itl_ms"]["p50"] is None or s["ttft_ms"]["p50"] is None):
            failures.append(f"level {c}: latencies missing")
    FakeHandler.cap = 0  # a full queue: every request is refused with 429
    full = run_level(args, 2, 4)
    FakeHandler.cap = 48
    if full["errors"] != {"429": 4} or full["ok"]:
        failures.append(f"full queue: expected four 429, got {full['errors']}")
    args.join_streams, args.join_stream_tokens, args.join_after = 4, 60, 0.03
    FakeHandler.prefill_s_per_token = 0.00002  # a 4,096-token prompt: about 80 ms
    probe = run_join_probe(args)
    print(json.dumps(probe), flush=True)
    if probe["join_status"] != 200 or probe["streams_ok"] != 4 or not probe["gaps_during"]:
        failures.append(f"probe: {probe}")
    one = stream_request(args.url, request_body(args, random.Random(1), 8, 5), None, 10)
    if not one.ok or len(one.chunks) != 5 or sum(n for _, n in one.chunks) != 5:
        failures.append(f"5 streamed tokens counted as {one.chunks} ({one.error})")
    bad = stream_request(args.url, {"prompt": [1, 2], "kv_bits": 3, "stream": True}, None, 10)
    if bad.status != 400:
        failures.append(f"kv_bits 3 gave {bad.status}")
    print(markdown(levels, probe))
    server.shutdown()
    if failures:
        print("SELF-TEST FAILED:\n" + "\n".join(failures), file=sys.stderr)
        return 1
    print("self-test passed", file=sys.stderr)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default=None, help="the `model` field (omitted when unset)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per level (default: 4 x concurrency, at least 8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="the first N prompt tokens are the same in every request (prefix reuse)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None)
    p.add_argument("--json-object", action="store_true",
                   help="constrained output: response_format json_object (needs a tokenizer)")
    p.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    p.add_argument("--min-token-id", type=int, default=10, help="token ids drawn from this up")
    p.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="do not ask for `return_token_ids` (tokens are then counted per text "
                   "chunk, and in total from `usage`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampled", action="store_true",
                   help="omit the sampling fields (the server's default sampling) instead of greedy")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--join-streams", type=int, default=0,
                   help="run the long-prompt-joins probe with this many streams (0: off)")
    p.add_argument("--join-prompt-len", type=int, default=4096)
    p.add_argument("--join-stream-tokens", type=int, default=256,
                   help="max_tokens of the running streams of the probe")
    p.add_argument("--join-after", type=float, default=2.0,
                   help="seconds the streams run before the long prompt is sent")
    p.add_argument("--self-test", action="store_true", help="run against a built-in fake server")
    args = p.parse_args()
    if args.self_test:
        return self_test(args)
    levels = []
    for c in [int(x) for x in args.concurrency.split(",") if x.strip()]:
        n = args.requests or max(4 * c, 8)
        s = run_level(args, c, n)
        s.update(prompt_len=args.prompt_len, max_tokens=args.max_tokens, kv_bits=args.kv_bits,
                 shared_prefix=args.shared_prefix, json_object=args.json_object)
        levels.append(s)
        print(json.dumps(s), flush=True)
    probe = None
    if args.join_streams > 0:
        probe = run_join_probe(args)
        probe.update(prompt_len=args.prompt_len, kv_bits=args.kv_bits)
        print(json.dumps(probe), flush=True)
    print()
    print(markdown(levels, probe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
