"""The fixtures' transformers cross-check (`crosscheck.json`) and `fixtures/README.md`."""

import json

import mlx.core as mx
import numpy as np

from fixture_common import (EMB_STD, FIX, POST_NORM, QK_NORM, REFERENCE, SEEDS, first_shared,
                            layer_plan, sig)


def hf_crosscheck(d, text_cfg, state, golden):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    tcfg = {k: v for k, v in text_cfg.items() if k not in ("architectures",)}
    cfg = Gemma4TextConfig(**tcfg)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).eval().to(torch.float32)
    sd = {"model." + k: torch.tensor(np.asarray(v, dtype=np.float32)) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    F = first_shared(text_cfg)
    bad_unexp = [u for u in unexpected if not any(
        s in u for s in ("k_proj", "v_proj", "k_norm")) or int(u.split(".")[2]) < F]
    assert not missing and not bad_unexp, (missing, bad_unexp)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    import copy as _copy
    model64 = _copy.deepcopy(model).to(torch.float64)
    res = []
    for case in golden["cases"]:
        pr, gids, margins = case["prompt_ids"], case["greedy_ids"], case["margins"]
        seq = torch.tensor([pr + gids[:-1]])
        with torch.no_grad():
            logits = model(seq, use_cache=False).logits[0].to(torch.float64)
        lp = torch.log_softmax(logits, -1).numpy()
        first = lp[len(pr) - 1]
        diff = float(np.max(np.abs(first - np.array(case["first_logprobs"]))))
        with torch.no_grad():
            lg64 = model64(torch.tensor([pr]), use_cache=False).logits[0, -1]
        first64 = torch.log_softmax(lg64, -1).numpy()
        d_hf32_64 = float(np.max(np.abs(first - first64)))
        d_mlx_64 = float(np.max(np.abs(np.array(case["first_logprobs"]) - first64)))
        # teacher-forced argmax vs mlx greedy ids, up to first low-margin step
        agree = 0
        for s in range(len(gids)):
            if int(np.argmax(lp[len(pr) - 1 + s])) != gids[s]:
                break
            agree += 1
            if margins[s] < 0.01:
                break
        lim = next((s for s, m in enumerate(margins) if m < 0.01), len(gids))
        # HF generate with its own cache (greedy)
        with torch.no_grad():
            out = model.generate(torch.tensor([pr]), max_new_tokens=len(gids), do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        gen = out[0, len(pr):].tolist()
        gen_agree = 0
        for a, b in zip(gen, gids):
            if a != b:
                break
            gen_agree += 1
        res.append({"prompt_len": len(pr), "first_logprobs_max_abs_diff": sig(diff),
                    "hf_f64_vs_hf_f32": sig(d_hf32_64), "hf_f64_vs_mlx_f32": sig(d_mlx_64),
                    "teacher_forced_agree_steps": agree, "hf_generate_agree_steps": gen_agree,
                    "steps_before_low_margin": lim, "n_steps": len(gids)})
    return res


def crosscheck_all():
    out = {"reference": REFERENCE, "other": "transformers 5.23 Gemma4ForCausalLM CPU float32 eager",
           "method": "same weights (f32) loaded into Gemma4ForCausalLM built from text_config; "
                     "first_logprobs compared; mlx greedy ids checked by a teacher-forced full "
                     "forward (no cache) and by HF greedy generate (HF cache)",
           "fixtures": {}}
    for name in ("e2b-hf", "e4b-text", "moe-mlx", "dense-sharded"):
        d = FIX / name
        if not (d / "golden.json").exists():
            continue
        golden = json.load(open(d / "golden.json"))
        cfg = json.load(open(d / "config.json"))
        tc = cfg.get("text_config", cfg)
        st = {}
        for f in sorted(d.glob("model*.safetensors")):
            st.update(mx.load(str(f)))
        state = {}
        for k, v in st.items():
            if any(t in k for t in ("vision_tower", "audio_tower", "embed_vision", "embed_audio")):
                continue
            for pre in ("model.language_model.", "language_model.model.", "model."):
                if k.startswith(pre):
                    state[k[len(pre):]] = np.array(v.astype(mx.float32))
                    break
        # MLX split experts -> HF fused
        for k in list(state):
            if k.endswith(".experts.switch_glu.gate_proj.weight"):
                base = k[: -len(".switch_glu.gate_proj.weight")]
                g = state.pop(k)
                u = state.pop(base + ".switch_glu.up_proj.weight")
                state[base + ".gate_up_proj"] = np.concatenate([g, u], axis=1)
                state[base + ".down_proj"] = state.pop(base + ".switch_glu.down_proj.weight")
        res = hf_crosscheck(d, tc, state, golden)
        out["fixtures"][name] = res
        print(f"[crosscheck {name}] {res}")
    json.dump(out, open(FIX / "crosscheck.json", "w"), indent=2)
    return out


# ----------------------------------------------------------------------------


FIXTURE_DOC = {
    # name: (shape/variant, key layout, dtype, quantization, covers)
    "e2b-hf": ("E2B-shaped; multimodal config (`gemma4` + `text_config`, `global_head_dim`)",
               "HF multimodal `model.language_model.*`", "bf16", "none",
               "PLE, KV sharing, double-wide MLP on consumers, consumers SHIP unused k_proj/v_proj/k_norm "
               "(loader must ignore), tower tensors `model.vision_tower.*`/`model.audio_tower.*`/"
               "`model.embed_vision.*` to skip, layer_scalar, proportional RoPE, window 8"),
    "e4b-text": ("E4B-shaped; BARE `gemma4_text` config, full-layer geometry via `per_layer_config` "
                 "(`{\"05\":{\"head_dim\":64},\"11\":{\"head_dim\":64}}`, no `global_head_dim`)",
                 "HF text-only `model.*`", "f32", "none",
                 "per_layer_config parsing, PLE, KV sharing with 2 KV heads, QAT-style pruning "
                 "(consumer k_proj/v_proj/k_norm ABSENT)"),
    "moe-mlx": ("26B-A4B-shaped; multimodal config", "MLX `language_model.model.*`, experts split as "
                "`experts.switch_glu.{gate,up,down}_proj.weight`", "f32", "none",
                "MoE (8 experts, top-2, moe_intermediate 32) beside dense MLP (48), router.scale/"
                "per_expert_scale, attention_k_eq_v (full layer 5 has no v_proj), num_global_key_value_heads 1, "
                "no PLE, MLX tower key `vision_tower.dummy.weight` to skip"),
    "dense-sharded": ("31B-shaped dense k_eq_v; multimodal config", "HF multimodal `model.language_model.*`, "
                      "3 shards + `model.safetensors.index.json`", "f32", "none",
                      "sharded loading via index, attention_k_eq_v, num_global_key_value_heads 1, no PLE/MoE/"
                      "KV sharing, tower tensor to skip"),
    "e2b-q4": ("same architecture and (bf16-rounded) float weights as e2b-hf", "MLX `language_model.model.*`",
               "uint32 packed + bf16 scales/biases; norms/layer_scalar bf16",
               "affine 4-bit g32; overrides `embed_tokens_per_layer` and `per_layer_model_projection` 8-bit g64",
               "MLX affine dequant, per-module overrides, quantized tied embedding as LM head, QAT-style "
               "pruned consumer k/v/k_norm, PLE, KV sharing, double-wide"),
    "e2b-q8": ("same as e2b-q4", "MLX `language_model.model.*`",
               "uint32 packed + bf16 scales/biases; unquantized linears bf16",
               "affine 8-bit g64; override `embed_tokens_per_layer` 4-bit g64; linears with in-dim % 64 != 0 "
               "stay float and are NOT listed in the config (detect by absent `.scales`)",
               "mixed float/quantized modules, per-module override, QAT pruning, PLE, KV sharing"),
    "moe-q4": ("same architecture and (bf16-rounded) float weights as moe-mlx", "MLX `language_model.model.*`",
               "uint32 packed + bf16 scales/biases; unquantized linears bf16",
               "affine 4-bit g32; expert `down_proj` 8-bit g32, `router.proj` 8-bit g64; dense MLP "
               "`down_proj` (in-dim 48) stays float",
               "packed MoE expert stacks (3-D codes/scales/biases), mixed bit widths across expert "
               "stacks, quantized router and tied embedding"),
    "e2b-kvq": ("E2B-shaped like e2b-hf, gentle residual gains (post norms U[0.8, 1.6])",
                "HF multimodal `model.language_model.*`", "f32", "none",
                "the quantized-KV agreement test (8/4-bit caches vs the dense reference); PLE, KV sharing, "
                "double-wide"),
}


def layer_plan_text(tc):
    pl = layer_plan(tc)
    s = f"{tc['num_hidden_layers']} layers; full: {pl['full']}; sliding: others"
    if pl["consumers"]:
        by = {}
        for c, p in pl["consumers"].items():
            by.setdefault(p, []).append(c)
        s += "; consumers " + ", ".join(f"{v}->{k}" for k, v in sorted(by.items()))
    return s


def write_readme():
    rows, margins = [], []
    for name, (shape, layout, dtype, quant, covers) in FIXTURE_DOC.items():
        d = FIX / name
        if not (d / "golden.json").exists():
            continue
        cfg = json.load(open(d / "config.json"))
        tc = cfg.get("text_config", cfg)
        g = json.load(open(d / "golden.json"))
        mm = [m for c in g["cases"] for m in c["margins"]]
        size = sum(f.stat().st_size for f in d.iterdir())
        rows.append(f"| `{name}` | {shape} | {layout} | {dtype} | {quant} | {covers} | "
                    f"{layer_plan_text(tc)} | {min(mm):.4f} / {float(np.median(mm)):.3f} | "
                    f"{size / 1e6:.2f} MB |")
    cc = json.load(open(FIX / "crosscheck.json")) if (FIX / "crosscheck.json").exists() else None
    cc_lines = []
    if cc:
        for name, res in cc["fixtures"].items():
            d = max(r["first_logprobs_max_abs_diff"] for r in res)
            d64 = max(r["hf_f64_vs_mlx_f32"] for r in res)
            h64 = max(r["hf_f64_vs_hf_f32"] for r in res)
            tf = "/".join(str(r["teacher_forced_agree_steps"]) for r in res)
            ge = "/".join(str(r["hf_generate_agree_steps"]) for r in res)
            cc_lines.append(f"| `{name}` | {d:.2e} | {d64:.2e} | {h64:.2e} | {tf} | {ge} |")
    text = f"""# Test fixtures (tiny random-weight Gemma 4 checkpoints + mlx-lm goldens)

Generated by `scripts/make_fixtures.py` — regenerate everything with

    python3 scripts/make_fixtures.py            # all fixtures + crosscheck + this README
    python3 scripts/make_fixtures.py e2b-hf     # a single fixture (names as below, or `crosscheck`)

Deterministic (fixed seeds; rerunning gives byte-identical files). Reference:
**{REFERENCE}**; cross-check: transformers 5.23 (CPU, f32 and f64, eager attention + eager experts).

Common to all: vocab 512, hidden 64, 4 query heads, head_dim 32 (sliding) / 64 (full),
sliding_window 8 (prompts are longer), rms_norm_eps 1e-6, final_logit_softcapping 30,
rope: sliding default θ=1e4, full proportional θ=1e6 prf 0.25, max_position_embeddings 4096,
tied embeddings. Every folder has `config.json`, weights, `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json` (eos `[1,106,50]`, bos 2, pad 0) and `golden.json`.
(`real-configs/` is not produced by this script.)

| fixture | shape / variant | key layout | dtype | quantization | covers | layer plan | top-2 margin min / median | size |
|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

Random weights: linears N(0, 1/in); embedding N(0, {EMB_STD}²); PLE table N(0,1). All norm
weights are plain scales (no `1+`): input/pre-ffw/final/PLE-projection norms U[0.5,1.5], q_norm/k_norm U{list(QK_NORM)} (attention scale is 1.0; larger values made the model
ill-conditioned, ~30x f32 error growth per layer), post_* norms U{list(POST_NORM)} (otherwise the
scaled input embedding dominates the residual and the model repeats its input token),
layer_scalar U[0.3,1.0], router.scale U[0.5,1.5], router.per_expert_scale U[0.5,2.0], router.proj gain 3.
Seeds {SEEDS} were picked with `--search` for the largest minimum top-2 margin.
e2b-q4/q8 quantize the bf16 e2b-hf weights (minus pruned consumer k/v/k_norm) with mlx-lm's
`quantize_model` (MLX's own packing), so their float parts equal e2b-hf's.

## golden.json

```
{{"reference": "{REFERENCE}", "fixture": NAME, "covers": [str, ...],
 "mlx_lm_config_override": {{...}},   # what mlx-lm needed on top of config.json (see below)
 "cases": [{{"prompt_ids": [2, ...],    # BOS + ids in [110,512); lengths 7, 19, 33
            "greedy_ids": [24 ints],    # greedy, dense cache (make_cache(): KVCache / RotatingKVCache(8))
            "margins": [24 floats],     # top1 - top2 log-prob at each generated step
            "first_logprobs": [512 floats]}}]}}   # log-softmax of the logits giving greedy_ids[0]
```
Floats rounded to 6 significant digits (first_logprobs resolution ≈ 5e-5 at magnitude ~50).
The run: load from disk with `mlx_lm.utils.load_model` (sanitize + quantized loading), cast
floating params to f32 (packed weights stay uint32, scales/biases → f32), prefill the whole
prompt, then one token at a time. mlx-lm needed two config overrides, not stored in config.json:
`vocab_size: 512` for the multimodal configs (mlx-lm's `gemma4.ModelArgs` overwrites
`text_config.vocab_size` with a top-level `vocab_size`, default 262144), and
`global_head_dim: 64` for e4b-text (mlx-lm ignores `per_layer_config`).

Suggested tolerances for an f32 port: first_logprobs max abs diff ≲ 2e-3 (measured
mlx-f32 vs HF-f64 ≤ {max((max(r['hf_f64_vs_mlx_f32'] for r in v) for v in cc['fixtures'].values()), default=0) if cc else 0:.1e});
greedy ids should match exactly up to the first step whose golden margin is < 0.01
(every fixture's margins are ≥ 0.05).

## Cross-check against transformers

Same weights loaded into `Gemma4ForCausalLM` (text config as saved — HF parsed e4b-text's
`per_layer_config` itself; consumer k/v/k_norm ignored; experts re-fused to `gate_up_proj`).
Columns: max |first_logprobs(HF f32) − golden|, max |golden − HF f64|, max |HF f32 − HF f64|,
greedy steps agreeing (per prompt 7/19/33) for HF teacher-forced full forward (no cache) and
HF `generate` greedy (HF cache).

| fixture | HF f32 vs mlx | mlx vs HF f64 | HF f32 vs HF f64 | teacher-forced agree | HF generate agree |
|---|---|---|---|---|---|
""" + "\n".join(cc_lines) + """

All four float fixtures agree with transformers on all 24 greedy tokens of every prompt, and the
first-step log-probs differ by ~1e-4 (the same size as HF's own f32-vs-f64 difference), so the
goldens are not an mlx-lm quirk. The quantized fixtures have no transformers counterpart.
Details: `crosscheck.json`.
"""
    open(FIX / "README.md", "w").write(text)
