"""Quantized-KV references from mlx-lm 0.32.2 (CPU f32) for the candle-gemma fixtures.

Every KV-owning layer gets a QuantizedKVCache(group_size=32, bits=B) from the first token
(mlx-lm's RotatingKVCache cannot be quantized, so sliding layers use a growing quantized cache
with the window mask: the same visible keys as a quantized ring). KV-shared consumer layers
receive the producer's packed K/V; mlx-lm would hand them to the dense SDPA (a crash), so the
module's SDPA is wrapped to take the quantized path for packed tuples.
"""
import json, sys
from pathlib import Path
import numpy as np
import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import load_model
from mlx_lm.models import base, gemma4_text
from mlx_lm.models.cache import QuantizedKVCache

GROUP = 32
state = {"bits": 8}

def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(keys, tuple):
        return base.quantized_scaled_dot_product_attention(
            queries, keys, values, scale=scale, mask=mask, group_size=GROUP, bits=state["bits"])
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)

gemma4_text.scaled_dot_product_attention = sdpa

def load(d, override):
    model, _ = load_model(Path(d), model_config=override)
    cast = lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p
    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    return model

def greedy(model, prompt, n):
    n_caches = len(model.make_cache())
    cache = [QuantizedKVCache(group_size=GROUP, bits=state["bits"]) for _ in range(n_caches)]
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    ids, margins, first = [], [], None
    for step in range(n):
        lp = np.array(logits - mx.logsumexp(logits))
        if first is None:
            first = lp
        order = np.argsort(-lp, kind="stable")
        ids.append(int(order[0]))
        margins.append(float(lp[order[0]] - lp[order[1]]))
        if step + 1 < n:
            logits = model(mx.array([[ids[-1]]]), cache=cache)[0, -1].astype(mx.float32)
    return ids, margins, first

out = {}
root = Path(sys.argv[1])
for name in ["e2b-hf", "e4b-text", "moe-mlx", "dense-sharded", "e2b-q4", "e2b-q8"]:
    d = root / name
    g = json.load(open(d / "golden.json"))
    model = load(d, g["mlx_lm_config_override"])
    for bits in (8, 4):
        state["bits"] = bits
        for i, case in enumerate(g["cases"]):
            ids, margins, first = greedy(model, case["prompt_ids"], 24)
            out[f"{name}/{bits}/{i}"] = {"ids": ids, "margins": [round(m, 4) for m in margins],
                                         "first": [float(x) for x in first]}
json.dump(out, open("/tmp/qref.json", "w"))
for k, v in out.items():
    print(k, v["ids"], "min margin", min(v["margins"]))
