"""Peer measurement: transformers' Gemma 4 with random weights at a real config's shapes, on
the same GPU as benches/model_speed.rs, printing the same JSON lines (prefill and decode tok/s).

    python3 scripts/peers/transformers_bench.py fixtures/real-configs/e4b-config.json [...]
"""
import json
import sys
import time

import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig


def text_config(path):
    raw = json.load(open(path))
    return Gemma4TextConfig(**raw.get("text_config", raw))


def sync():
    torch.cuda.synchronize()


def main(paths, prefills=(512, 4096), batches=(1, 8), context=128, steps=16):
    dev = "cuda"
    for path in paths:
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        cfg = text_config(path)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        # Built in bf16 directly (an f32 build of 26B-A4B / 31B does not fit in 80 GB).
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(dev):
                model = Gemma4ForCausalLM(cfg).eval()
        except torch.OutOfMemoryError as e:
            print(json.dumps({"engine": "transformers", "model": name, "error": str(e)[:200]}), flush=True)
            torch.cuda.empty_cache()
            continue
        finally:
            torch.set_default_dtype(torch.float32)
        vocab = cfg.vocab_size
        with torch.inference_mode():
            for n in prefills:
                ids = torch.randint(10, vocab, (1, n), device=dev)
                model(ids[:, :16])
                sync()
                t = time.perf_counter()
                model(ids, logits_to_keep=1)
                sync()
                print(json.dumps({"engine": "transformers", "model": name, "op": "prefill",
                                  "tokens": n, "tok_s": n / (time.perf_counter() - t)}), flush=True)
            for b in batches:
                ids = torch.randint(10, vocab, (b, context), device=dev)
                kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
                model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
                sync()
                t0 = time.perf_counter()
                model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
                sync()
                first = time.perf_counter() - t0
                t = time.perf_counter()
                model.generate(ids, **kw)
                sync()
                secs = (time.perf_counter() - t - first) / max(steps - 1, 1)
                print(json.dumps({"engine": "transformers", "model": name, "op": "decode",
                                  "batch": b, "context": context, "tok_s": b / secs,
                                  "step_ms": secs * 1e3}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
