#!/usr/bin/env python3
"""Generate tiny random-weight Gemma 4 fixtures + golden outputs from mlx-lm.

Usage:  python3 scripts/make_fixtures.py [fixture ...]      (default: all)

Writes fixtures/<name>/{config.json, *.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, golden.json}, then
fixtures/crosscheck.json (transformers vs mlx-lm).  Deterministic: fixed seeds.

Reference: mlx-lm 0.32.2 / mlx 0.32.4 (CPU, float32 compute);
cross-check: transformers 5.23 (CPU, float32, eager attention).
"""

import copy
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from fixture_common import (CONFIGS, EMB_STD, FIX, N_NEW, POST_NORM, PROMPT_LENS, QK_NORM,
                            REFERENCE, SEEDS, VOCAB, WINDOW, first_shared, geometry, min_margin,
                            sig)
from fixture_report import crosscheck_all, write_readme
from fixture_tokenizer import build_tokenizer, write_tokenizer_files


mx.set_default_device(mx.cpu)


# ----------------------------------------------------------------------------
# configs
# ----------------------------------------------------------------------------

ROPE = {
    "full_attention": {
        "partial_rotary_factor": 0.25,
        "rope_theta": 1000000.0,
        "rope_type": "proportional",
    },
    "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
}


def layer_types(n, full):
    return ["full_attention" if i in full else "sliding_attention" for i in range(n)]


def text_config(**kw):
    c = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": 1,
        "expert_intermediate_size": None,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 64,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,
        "num_attention_heads": 4,
        "num_experts": None,
        "num_global_key_value_heads": None,
        "num_hidden_layers": 6,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 0,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": copy.deepcopy(ROPE),
        "sliding_window": WINDOW,
        "tie_word_embeddings": True,
        "top_k_experts": None,
        "use_bidirectional_attention": None,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
    }
    c.update(kw)
    return dict(sorted(c.items()))


def multimodal_config(tc, real_file, dtype):
    real = json.load(open(CONFIGS / real_file))
    top = {k: v for k, v in real.items() if k not in ("transformers_version",)}
    top["text_config"] = tc
    top["dtype"] = dtype
    top["eos_token_id"] = [1, 106]
    top["tie_word_embeddings"] = True
    return dict(sorted(top.items()))


def cfg_e2b(dtype="bfloat16"):
    tc = text_config(
        dtype=dtype,
        num_hidden_layers=10,
        layer_types=layer_types(10, {4, 9}),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=VOCAB,
        intermediate_size=96,
        use_double_wide_mlp=True,
        num_kv_shared_layers=4,
    )
    return multimodal_config(tc, "e2b-config.json", dtype)


def cfg_e4b():
    tc = text_config(
        dtype="float32",
        num_hidden_layers=12,
        layer_types=layer_types(12, {5, 11}),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=VOCAB,
        intermediate_size=128,
        use_double_wide_mlp=False,
        num_kv_shared_layers=4,
    )
    # bare text config: full-layer geometry via per_layer_config, no global_head_dim
    del tc["global_head_dim"]
    del tc["num_global_key_value_heads"]
    tc["per_layer_config"] = {"05": {"head_dim": 64}, "11": {"head_dim": 64}}
    tc["architectures"] = ["Gemma4ForCausalLM"]
    return dict(sorted(tc.items()))


def cfg_moe():
    tc = text_config(
        dtype="float32",
        num_hidden_layers=6,
        layer_types=layer_types(6, {5}),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        head_dim=32,
        global_head_dim=64,
        hidden_size_per_layer_input=0,
        intermediate_size=48,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        use_bidirectional_attention="vision",
    )
    return multimodal_config(tc, "26b-a4b-config.json", "float32")


def cfg_dense():
    tc = text_config(
        dtype="float32",
        num_hidden_layers=6,
        layer_types=layer_types(6, {5}),
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        head_dim=32,
        global_head_dim=64,
        hidden_size_per_layer_input=0,
        intermediate_size=128,
        use_bidirectional_attention="vision",
    )
    return multimodal_config(tc, "31b-config.json", "float32")


# ----------------------------------------------------------------------------
# random weights (HF text-only names, i.e. relative to `model.` of Gemma4ForCausalLM)
# ----------------------------------------------------------------------------


def make_weights(tc, seed, emb_std=1.0, lin_gain=1.0, post_norm_range=None):
    rng = np.random.default_rng(seed)
    H = tc["hidden_size"]
    L = tc["num_hidden_layers"]
    nH = tc["num_attention_heads"]
    P = tc["hidden_size_per_layer_input"]
    F = first_shared(tc)
    f32 = np.float32

    def lin(o, i, gain=lin_gain):
        return (rng.standard_normal((o, i)) * gain / math.sqrt(i)).astype(f32)

    def norm(n, lo=0.5, hi=1.5):
        return rng.uniform(lo, hi, size=(n,)).astype(f32)

    def post_norm(n):
        return norm(n, *(post_norm_range or POST_NORM))

    w = {}
    w["embed_tokens.weight"] = (rng.standard_normal((VOCAB, H)) * emb_std).astype(f32)
    w["norm.weight"] = norm(H)
    if P:
        w["embed_tokens_per_layer.weight"] = rng.standard_normal(
            (tc["vocab_size_per_layer_input"], L * P)
        ).astype(f32)
        w["per_layer_model_projection.weight"] = lin(L * P, H)
        w["per_layer_projection_norm.weight"] = norm(P)
    for i in range(L):
        p = f"layers.{i}."
        hd, kvh, has_v = geometry(tc, i)
        for n in ("input_layernorm", "post_attention_layernorm",
                  "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[p + n + ".weight"] = post_norm(H) if n.startswith("post") else norm(H)
        w[p + "layer_scalar"] = rng.uniform(0.3, 1.0, size=(1,)).astype(f32)
        w[p + "self_attn.q_proj.weight"] = lin(nH * hd, H)
        # consumers (i >= F) get k/v/k_norm too; pruned later where wanted
        w[p + "self_attn.k_proj.weight"] = lin(kvh * hd, H)
        if has_v:
            w[p + "self_attn.v_proj.weight"] = lin(kvh * hd, H)
        w[p + "self_attn.o_proj.weight"] = lin(H, nH * hd)
        w[p + "self_attn.q_norm.weight"] = norm(hd, *QK_NORM)
        w[p + "self_attn.k_norm.weight"] = norm(hd, *QK_NORM)
        I = tc["intermediate_size"]
        if tc["use_double_wide_mlp"] and tc["num_kv_shared_layers"] and i >= F:
            I *= 2
        w[p + "mlp.gate_proj.weight"] = lin(I, H)
        w[p + "mlp.up_proj.weight"] = lin(I, H)
        w[p + "mlp.down_proj.weight"] = lin(H, I)
        if P:
            w[p + "per_layer_input_gate.weight"] = lin(P, H)
            w[p + "per_layer_projection.weight"] = lin(H, P)
            w[p + "post_per_layer_input_norm.weight"] = post_norm(H)
        if tc["enable_moe_block"]:
            E, Im = tc["num_experts"], tc["moe_intermediate_size"]
            w[p + "router.proj.weight"] = lin(E, H, gain=3.0)
            w[p + "router.scale"] = rng.uniform(0.5, 1.5, size=(H,)).astype(f32)
            w[p + "router.per_expert_scale"] = rng.uniform(0.5, 2.0, size=(E,)).astype(f32)
            w[p + "experts.gate_up_proj"] = (
                rng.standard_normal((E, 2 * Im, H)) * lin_gain / math.sqrt(H)).astype(f32)
            w[p + "experts.down_proj"] = (
                rng.standard_normal((E, H, Im)) * lin_gain / math.sqrt(Im)).astype(f32)
            for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2"):
                w[p + n + ".weight"] = norm(H)
    return w


def prune_consumers(tc, w):
    F = first_shared(tc)
    out = {}
    for k, v in w.items():
        if k.startswith("layers.") and any(
            s in k for s in (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")
        ):
            if int(k.split(".")[1]) >= F:
                continue
        out[k] = v
    return out


def split_experts(w):
    out = {}
    for k, v in w.items():
        if k.endswith(".experts.gate_up_proj"):
            base = k[: -len(".gate_up_proj")]
            half = v.shape[1] // 2
            out[base + ".switch_glu.gate_proj.weight"] = np.ascontiguousarray(v[:, :half])
            out[base + ".switch_glu.up_proj.weight"] = np.ascontiguousarray(v[:, half:])
        elif k.endswith(".experts.down_proj"):
            out[k[: -len(".down_proj")] + ".switch_glu.down_proj.weight"] = v
        else:
            out[k] = v
    return out


def to_mx(w, dtype):
    return {k: mx.array(v).astype(dtype) for k, v in w.items()}


def save_st(path, arrays, fmt):
    mx.save_safetensors(str(path), arrays, metadata={"format": fmt})


def round_bf16_np(w):
    """Round f32 numpy weights through bf16 (so q-fixtures can share e2b-hf weights)."""
    return {k: np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32)) for k, v in w.items()}


# ----------------------------------------------------------------------------
# goldens (mlx-lm)
# ----------------------------------------------------------------------------


def prompts():
    rng = np.random.default_rng(1234)
    return [[2] + [int(x) for x in rng.integers(110, VOCAB, size=n - 1)] for n in PROMPT_LENS]


def load_mlx(d, override=None):
    from mlx_lm.utils import load_model
    model, config = load_model(Path(d), model_config=override or {})

    def cast(p):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.astype(mx.float32)
        return p

    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())
    return model, config


def mlx_greedy(model, prompt, n_new=N_NEW):
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
    ids, margins, first = [], [], None
    for step in range(n_new):
        lp = logits - mx.logsumexp(logits)
        lpn = np.array(lp)
        if first is None:
            first = lpn
        order = np.argsort(-lpn, kind="stable")
        tok = int(order[0])
        ids.append(tok)
        margins.append(float(lpn[order[0]] - lpn[order[1]]))
        if step + 1 < n_new:
            logits = model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32)
    return ids, margins, first


def make_golden(d, name, covers, override=None):
    model, _ = load_mlx(d, override)
    cases = []
    for pr in prompts():
        ids, margins, first = mlx_greedy(model, pr)
        cases.append({
            "prompt_ids": pr,
            "greedy_ids": ids,
            "margins": [sig(m) for m in margins],
            "first_logprobs": [sig(x) for x in first],
        })
    g = {"reference": REFERENCE, "fixture": name, "covers": covers,
         "mlx_lm_config_override": override or {}, "cases": cases}
    json.dump(g, open(d / "golden.json", "w"), separators=(",", ":"))
    allm = [m for c in cases for m in c["margins"]]
    print(f"[{name}] greedy: {[c['greedy_ids'] for c in cases]}")
    print(f"[{name}] margins min {min(allm):.4f} median {float(np.median(allm)):.4f} "
          f"frac>1 {np.mean(np.array(allm) > 1):.2f}")
    return g


# ----------------------------------------------------------------------------
# fixture builders
# ----------------------------------------------------------------------------


# mlx-lm's gemma4.ModelArgs overwrites text_config.vocab_size with a TOP-LEVEL
# `vocab_size` (default 262144) -> tiny multimodal checkpoints need this override.
MM_OVERRIDE = {"vocab_size": VOCAB}


def fresh_dir(name):
    d = FIX / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def write_config(d, cfg):
    json.dump(cfg, open(d / "config.json", "w"), indent=2)


def e2b_float_weights():
    tc = cfg_e2b()["text_config"]
    w = make_weights(tc, SEEDS["e2b"], emb_std=EMB_STD)
    return tc, round_bf16_np(w)


def build_e2b_hf(tok):
    name = "e2b-hf"
    d = fresh_dir(name)
    cfg = cfg_e2b("bfloat16")
    tc, w = e2b_float_weights()
    arrays = {"model.language_model." + k: v for k, v in to_mx(w, mx.bfloat16).items()}
    rng = np.random.default_rng(7)
    arrays["model.vision_tower.dummy.weight"] = mx.array(
        rng.standard_normal((4, 8)).astype(np.float32)).astype(mx.bfloat16)
    arrays["model.audio_tower.dummy.weight"] = mx.array(
        rng.standard_normal((3, 5)).astype(np.float32)).astype(mx.bfloat16)
    arrays["model.embed_vision.embedding_projection.weight"] = mx.array(
        rng.standard_normal((64, 16)).astype(np.float32)).astype(mx.bfloat16)
    save_st(d / "model.safetensors", arrays, "pt")
    write_config(d, cfg)
    write_tokenizer_files(d, tok)
    covers = ["PLE", "KV sharing (consumers 6,7,8->5, 9->4)", "double-wide MLP on consumers",
              "global_head_dim", "proportional RoPE", "sliding window 8",
              "consumer k_proj/v_proj/k_norm shipped but unused",
              "tower tensors to skip", "HF multimodal key layout", "bf16 weights",
              "layer_scalar", "multimodal config with text_config"]
    return make_golden(d, name, covers, MM_OVERRIDE)


def build_e2b_kvq(tok):
    """E2B-shaped, f32, HF multimodal layout, with gentle residual gains (post norms in
    [0.8, 1.6]) so that 8/4-bit KV quantization error is not amplified far beyond what real
    checkpoints show: the fixture of the quantized-cache agreement test."""
    name = "e2b-kvq"
    d = fresh_dir(name)
    cfg = cfg_e2b("float32")
    tc = cfg["text_config"]
    w = make_weights(tc, SEEDS["e2b"] + 1000, emb_std=EMB_STD, post_norm_range=(0.8, 1.6))
    arrays = {"model.language_model." + k: v for k, v in to_mx(w, mx.float32).items()}
    save_st(d / "model.safetensors", arrays, "pt")
    write_config(d, cfg)
    write_tokenizer_files(d, tok)
    covers = ["KV quantization agreement (gentle residual gains)", "PLE", "KV sharing",
              "double-wide MLP", "f32 weights"]
    return make_golden(d, name, covers, MM_OVERRIDE)


def build_e4b_text(tok):
    name = "e4b-text"
    d = fresh_dir(name)
    tc = cfg_e4b()
    w = prune_consumers(tc, make_weights(tc, SEEDS["e4b"], emb_std=EMB_STD))
    arrays = {"model." + k: v for k, v in to_mx(w, mx.float32).items()}
    save_st(d / "model.safetensors", arrays, "pt")
    write_config(d, tc)
    write_tokenizer_files(d, tok)
    covers = ["bare gemma4_text config", "per_layer_config instead of global_head_dim",
              "PLE", "KV sharing (consumers 8,9,10->7, 11->5)", "QAT-style pruned consumer k/v/k_norm",
              "HF text-only key layout (model.*)", "f32 weights", "GQA 2 kv heads"]
    # mlx-lm ignores per_layer_config -> give it the equivalent global_head_dim
    return make_golden(d, name, covers, {"global_head_dim": 64})


def build_moe_mlx(tok):
    name = "moe-mlx"
    d = fresh_dir(name)
    cfg = cfg_moe()
    tc = cfg["text_config"]
    w = split_experts(make_weights(tc, SEEDS["moe"], emb_std=EMB_STD))
    arrays = {"language_model.model." + k: v for k, v in to_mx(w, mx.float32).items()}
    arrays["vision_tower.dummy.weight"] = mx.zeros((4, 8), dtype=mx.float32) + 0.5
    save_st(d / "model.safetensors", arrays, "mlx")
    write_config(d, cfg)
    write_tokenizer_files(d, tok)
    covers = ["MoE (8 experts, top-2) + dense shared MLP", "router.scale / per_expert_scale",
              "attention_k_eq_v (full layer has no v_proj)", "num_global_key_value_heads 1",
              "MLX key layout language_model.model.*", "experts split as switch_glu.*",
              "no PLE", "f32 weights", "tower tensor to skip (MLX name)"]
    return make_golden(d, name, covers, MM_OVERRIDE)


def build_dense_sharded(tok):
    name = "dense-sharded"
    d = fresh_dir(name)
    cfg = cfg_dense()
    tc = cfg["text_config"]
    w = make_weights(tc, SEEDS["dense"], emb_std=EMB_STD)
    arrays = {"model.language_model." + k: v for k, v in to_mx(w, mx.float32).items()}
    arrays["model.vision_tower.dummy.weight"] = mx.ones((2, 3), dtype=mx.float32)
    keys = sorted(arrays)
    n = 3
    shards = [dict() for _ in range(n)]
    # contiguous split by key order, roughly balanced by bytes
    total = sum(arrays[k].nbytes for k in keys)
    acc, si = 0, 0
    for k in keys:
        if acc > (si + 1) * total / n and si < n - 1:
            si += 1
        shards[si][k] = arrays[k]
        acc += arrays[k].nbytes
    weight_map = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_st(d / fn, sh, "pt")
        for k in sh:
            weight_map[k] = fn
    json.dump({"metadata": {"total_size": int(total)},
               "weight_map": dict(sorted(weight_map.items()))},
              open(d / "model.safetensors.index.json", "w"), indent=2)
    write_config(d, cfg)
    write_tokenizer_files(d, tok)
    covers = ["dense k_eq_v (31B-shaped)", "num_global_key_value_heads 1",
              "sharded safetensors + index.json", "HF multimodal key layout",
              "no PLE, no MoE, no KV sharing", "f32 weights", "tower tensor to skip"]
    return make_golden(d, name, covers, MM_OVERRIDE)


def build_e2b_quant(tok, name, bits, group, overrides):
    from mlx_lm.models import gemma4
    from mlx_lm.utils import quantize_model

    d = fresh_dir(name)
    cfg = cfg_e2b("bfloat16")
    tc, w = e2b_float_weights()
    w = prune_consumers(tc, w)
    args = gemma4.ModelArgs.from_dict({**cfg, **MM_OVERRIDE})
    model = gemma4.Model(args)
    arrays = {"language_model.model." + k: v for k, v in to_mx(w, mx.bfloat16).items()}
    model.load_weights(list(arrays.items()), strict=True)

    def pred(path, module):
        for suffix, params in overrides.items():
            if path.endswith(suffix):
                return dict(params)
        return True

    model, qcfg = quantize_model(model, cfg, group, bits, quant_predicate=pred)
    params = dict(tree_flatten(model.parameters()))
    save_st(d / "model.safetensors", params, "mlx")
    qcfg = dict(sorted(qcfg.items()))
    write_config(d, qcfg)
    write_tokenizer_files(d, tok)
    float_mods = sorted({k.rsplit(".", 1)[0] for k, v in params.items()
                         if k.endswith(".weight") and v.ndim == 2 and v.dtype != mx.uint32})
    q_mods = sorted({k[: -len(".scales")] for k in params if k.endswith(".scales")})
    covers = [f"MLX affine {bits}-bit group {group}", "per-module quantization overrides",
              "MLX key layout language_model.model.*", "QAT-style pruned consumer k/v/k_norm",
              "quantized tied embedding used as lm head", "quantized PLE table",
              "PLE", "KV sharing", "double-wide MLP", "bf16 scales/biases"]
    if any(m.endswith("per_layer_projection") for m in float_mods):
        covers.append("mixed float/quantized linears (input dim not divisible by group)")
    g = make_golden(d, name, covers, MM_OVERRIDE)
    info = {"quantized_modules": len(q_mods),
            "float_2d_modules": float_mods,
            "scales_dtype": str(params[q_mods[0] + ".scales"].dtype)}
    print(f"[{name}] {info}")
    g["quant_info"] = info
    return g


def build_moe_q4(tok):
    """moe-mlx's architecture and (bf16-rounded) weights, quantized by mlx-lm: the expert stacks
    (`switch_glu`) stay packed in a quantized checkpoint, gate/up at 4 bits and down at 8."""
    from mlx_lm.models import gemma4
    from mlx_lm.utils import quantize_model

    name = "moe-q4"
    d = fresh_dir(name)
    cfg = cfg_moe()
    cfg["text_config"]["dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    tc = cfg["text_config"]
    w = split_experts(make_weights(tc, SEEDS["moe"], emb_std=EMB_STD))
    args = gemma4.ModelArgs.from_dict({**cfg, **MM_OVERRIDE})
    model = gemma4.Model(args)
    arrays = {"language_model.model." + k: v for k, v in to_mx(w, mx.bfloat16).items()}
    model.load_weights(list(arrays.items()), strict=True)

    def pred(path, module):
        if path.endswith("router.proj"):
            return {"group_size": 64, "bits": 8}  # what mlx-lm's own gemma4 predicate picks
        if path.endswith("switch_glu.down_proj"):
            return {"group_size": 32, "bits": 8}
        return True

    model, qcfg = quantize_model(model, cfg, 32, 4, quant_predicate=pred)
    params = dict(tree_flatten(model.parameters()))
    assert params["language_model.model.layers.0.experts.switch_glu.gate_proj.weight"].dtype == mx.uint32
    save_st(d / "model.safetensors", params, "mlx")
    write_config(d, dict(sorted(qcfg.items())))
    write_tokenizer_files(d, tok)
    covers = ["packed MoE expert stacks (switch_glu gate/up 4-bit g32, down 8-bit g32)",
              "router.proj 8-bit g64", "quantized tied embedding used as lm head",
              "dense MLP down_proj left float (in-dim 48 not a multiple of 32)",
              "attention_k_eq_v", "bf16 scales/biases"]
    return make_golden(d, name, covers, MM_OVERRIDE)


def search_seeds(tok, n=16, thresh=0.05):
    """Offline helper (`make_fixtures.py --search`): for each family, print the
    first seeds whose goldens have every top-2 margin >= thresh.  The chosen
    seeds are hard-coded in SEEDS; this is not run by default."""
    fams = {
        "e2b": lambda: [build_e2b_hf(tok), build_q4(tok), build_q8(tok)],
        "e4b": lambda: [build_e4b_text(tok)],
        "moe": lambda: [build_moe_mlx(tok)],
        "dense": lambda: [build_dense_sharded(tok)],
    }
    base = dict(SEEDS)
    for fam, fn in fams.items():
        for s in range(base[fam], base[fam] + n):
            SEEDS[fam] = s
            mm = [min_margin(g) for g in fn()]
            print(f"SEARCH {fam} seed {s} min margins {mm}")
            if min(mm) >= thresh:
                break


def build_q4(tok):
    return build_e2b_quant(tok, "e2b-q4", 4, 32, {
        "embed_tokens_per_layer": {"group_size": 64, "bits": 8},
        "per_layer_model_projection": {"group_size": 64, "bits": 8},
    })


def build_q8(tok):
    return build_e2b_quant(tok, "e2b-q8", 8, 64, {
        "embed_tokens_per_layer": {"group_size": 64, "bits": 4},
    })


def main(argv):
    FIX.mkdir(exist_ok=True)
    want = set(argv) or {"e2b-hf", "e4b-text", "moe-mlx", "dense-sharded", "e2b-q4", "e2b-q8", "e2b-kvq",
                         "moe-q4", "crosscheck"}
    tok = build_tokenizer()
    if "--search" in want:
        search_seeds(tok)
        return
    if "e2b-hf" in want:
        build_e2b_hf(tok)
    if "e4b-text" in want:
        build_e4b_text(tok)
    if "moe-mlx" in want:
        build_moe_mlx(tok)
    if "dense-sharded" in want:
        build_dense_sharded(tok)
    if "e2b-q4" in want:
        build_q4(tok)
    if "e2b-q8" in want:
        build_q8(tok)
    if "e2b-kvq" in want:
        build_e2b_kvq(tok)
    if "moe-q4" in want:
        build_moe_q4(tok)
    if "crosscheck" in want:
        crosscheck_all()
    write_readme()


if __name__ == "__main__":
    main(sys.argv[1:])
