#!/usr/bin/env python3
"""Writes a GGUF file with random weights at a Gemma 4 config's real shapes, for llama.cpp's
`gemma4` architecture: every `gemma4.*` metadata key and tensor name that llama.cpp's
`src/models/gemma4.cpp` and `src/llama-model.cpp` read (the keys the llama.cpp converter,
`conversion/gemma.py`'s `Gemma4Model`, writes), and a synthetic 262,144-token BPE table with
merges (`tokenizer.ggml.model` = `gemma4`).

Matrices are written as BF16, Q8_0 or Q4_0 (random blocks with finite scales), norms and the
router as F32. The bytes repeat from a pool whose length shares no factor with the row lengths,
so rows differ (and the router spreads tokens over the experts) without drawing billions of
random numbers. Tensors are streamed to disk, so a 17 GB file needs little memory.

    python3 gguf_random.py --config 31b-config.json --type q4_0 --out /tmp/31b-q4_0.gguf

gguf-py comes from llama.cpp's `gguf-py/` (`--gguf-py`, default: beside this script in
`llama.cpp/gguf-py`) or an installed `gguf` package. `--override` shrinks a config for tests;
llama.cpp's KV sharing reuses the last KV-owning sliding and full layers, so a shrunk config
with shared layers must end its KV-owning layers with a sliding then a full layer, as the
released configs do.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

TYPES = {"bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0"}
FILE_TYPES = {"bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}
VOCAB_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>"]


def text_config(path):
    with open(path) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)


class Pool:
    """Random bytes in the layout of one tensor type, handed out cyclically."""

    def __init__(self, kind, rng, n_units):
        if kind == "bf16":
            x = (rng.standard_normal(n_units, dtype=np.float32) * 0.02).view(np.uint32)
            self.unit = 2
            self.data = (x >> 16).astype(np.uint16).view(np.uint8)
        else:
            # Q4_0: f16 scale + 16 bytes of nibbles; Q8_0: f16 scale + 32 int8.
            payload = 16 if kind == "q4_0" else 32
            scale = 0.002 if kind == "q4_0" else 0.0005
            blocks = np.empty((n_units, 2 + payload), dtype=np.uint8)
            s = (rng.uniform(0.5, 1.5, n_units) * scale).astype(np.float16)
            blocks[:, :2] = s.view(np.uint8).reshape(n_units, 2)
            blocks[:, 2:] = rng.integers(0, 256, (n_units, payload), dtype=np.uint8)
            self.unit = 2 + payload
            self.data = blocks.reshape(-1)
        self.pos = 0

    def write(self, fout, nbytes):
        left = nbytes
        while left > 0:
            take = min(left, len(self.data) - self.pos)
            fout.write(memoryview(self.data)[self.pos : self.pos + take])
            self.pos = (self.pos + take) % len(self.data)
            left -= take


class Plan:
    """The tensors of one file, in writing order: name, ggml shape (ne0 first), kind."""

    def __init__(self):
        self.items = []

    def add(self, name, ne, kind):
        self.items.append((name, tuple(int(d) for d in ne), kind))


def build_plan(t, wtype, gguf):
    T = gguf.MODEL_TENSOR
    N = gguf.TENSOR_NAMES
    n_embd = t["hidden_size"]
    n_layer = t["num_hidden_layers"]
    n_vocab = t["vocab_size"]
    nh = t["num_attention_heads"]
    hd_swa = t["head_dim"]
    hd_full = t.get("global_head_dim") or hd_swa
    kv_swa = t["num_key_value_heads"]
    kv_full = t.get("num_global_key_value_heads") or kv_swa
    n_ff = t["intermediate_size"]
    n_pl = t.get("hidden_size_per_layer_input") or 0
    shared = t.get("num_kv_shared_layers") or 0
    k_eq_v = bool(t.get("attention_k_eq_v"))
    moe = bool(t.get("enable_moe_block")) and (t.get("num_experts") or 0) > 0
    double_wide = bool(t.get("use_double_wide_mlp"))
    swa = [lt == "sliding_attention" for lt in t["layer_types"]]
    first_shared = n_layer - shared

    def name(tensor, bid=None, suffix="weight"):
        base = N[tensor].format(bid=bid) if bid is not None else N[tensor]
        return f"{base}.{suffix}"

    p = Plan()
    p.add(name(T.ROPE_FREQS), [hd_full // 2], "f32_rope")
    p.add(name(T.TOKEN_EMBD), [n_embd, n_vocab], wtype)
    if n_pl:
        p.add(name(T.PER_LAYER_TOKEN_EMBD), [n_pl * n_layer, n_vocab], wtype)
        p.add(name(T.PER_LAYER_MODEL_PROJ), [n_embd, n_pl * n_layer], wtype)
        p.add(name(T.PER_LAYER_PROJ_NORM), [n_pl], "f32_one")
    p.add(name(T.OUTPUT_NORM), [n_embd], "f32_one")
    for i in range(n_layer):
        hd = hd_swa if swa[i] else hd_full
        kvh = kv_swa if swa[i] else kv_full
        has_kv = i < first_shared
        ff = n_ff * 2 if double_wide and i >= first_shared else n_ff
        p.add(name(T.ATTN_NORM, i), [n_embd], "f32_one")
        p.add(name(T.ATTN_Q, i), [n_embd, hd * nh], wtype)
        if has_kv:
            p.add(name(T.ATTN_K, i), [n_embd, hd * kvh], wtype)
            # attention_k_eq_v: full-attention layers have no v_proj (values are the keys).
            if not (k_eq_v and not swa[i]):
                p.add(name(T.ATTN_V, i), [n_embd, hd * kvh], wtype)
        p.add(name(T.ATTN_OUT, i), [hd * nh, n_embd], wtype)
        p.add(name(T.ATTN_Q_NORM, i), [hd], "f32_one")
        if has_kv:
            p.add(name(T.ATTN_K_NORM, i), [hd], "f32_one")
        p.add(name(T.ATTN_POST_NORM, i), [n_embd], "f32_one")
        p.add(name(T.LAYER_OUT_SCALE, i), [1], "f32_one")
        p.add(name(T.FFN_NORM, i), [n_embd], "f32_one")
        p.add(name(T.FFN_GATE, i), [n_embd, ff], wtype)
        p.add(name(T.FFN_UP, i), [n_embd, ff], wtype)
        p.add(name(T.FFN_DOWN, i), [ff, n_embd], wtype)
        p.add(name(T.FFN_POST_NORM, i), [n_embd], "f32_one")
        if moe:
            n_exp = t["num_experts"]
            ff_exp = t.get("moe_intermediate_size") or t.get("expert_intermediate_size")
            p.add(name(T.FFN_GATE_INP, i), [n_embd, n_exp], "f32_rand")
            p.add(name(T.FFN_GATE_INP, i, "scale"), [n_embd], "f32_one")
            p.add(name(T.FFN_PRE_NORM_2, i), [n_embd], "f32_one")
            p.add(name(T.FFN_POST_NORM_1, i), [n_embd], "f32_one")
            p.add(name(T.FFN_POST_NORM_2, i), [n_embd], "f32_one")
            p.add(name(T.FFN_GATE_UP_EXP, i), [n_embd, 2 * ff_exp, n_exp], wtype)
            p.add(name(T.FFN_DOWN_EXP, i), [ff_exp, n_embd, n_exp], wtype)
            p.add(name(T.FFN_DOWN_EXP, i, "scale"), [n_exp], "f32_one")
        if n_pl:
            p.add(name(T.PER_LAYER_INP_GATE, i), [n_embd, n_pl], wtype)
            p.add(name(T.PER_LAYER_PROJ, i), [n_pl, n_embd], wtype)
            p.add(name(T.PER_LAYER_POST_NORM, i), [n_embd], "f32_one")
    return p


def add_metadata(w, t, wtype, gguf):
    n_layer = t["num_hidden_layers"]
    swa = [lt == "sliding_attention" for lt in t["layer_types"]]
    hd_swa = t["head_dim"]
    hd_full = t.get("global_head_dim") or hd_swa
    kv_swa = t["num_key_value_heads"]
    kv_full = t.get("num_global_key_value_heads")
    shared = t.get("num_kv_shared_layers") or 0
    rope = t["rope_parameters"]
    w.add_name("gemma4-random")
    w.add_block_count(n_layer)
    w.add_context_length(t["max_position_embeddings"])
    w.add_embedding_length(t["hidden_size"])
    if t.get("use_double_wide_mlp"):
        first_shared = n_layer - shared
        ff = t["intermediate_size"]
        w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n_layer)])
    else:
        w.add_feed_forward_length(t["intermediate_size"])
    w.add_head_count(t["num_attention_heads"])
    if kv_full is not None:
        w.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    else:
        w.add_head_count_kv(kv_swa)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(t["rms_norm_eps"])
    if t.get("enable_moe_block") and t.get("num_experts"):
        w.add_expert_count(t["num_experts"])
        w.add_expert_used_count(t["top_k_experts"])
        w.add_expert_feed_forward_length(t.get("moe_intermediate_size") or t["expert_intermediate_size"])
    w.add_key_length(hd_full)
    w.add_value_length(hd_full)
    w.add_key_length_swa(hd_swa)
    w.add_value_length_swa(hd_swa)
    if t.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(t["final_logit_softcapping"])
    w.add_sliding_window(t["sliding_window"])
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(t.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    prf_swa = rope["sliding_attention"].get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count(hd_full)
    w.add_rope_dimension_count_swa(int(hd_swa * prf_swa))
    w.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[wtype]))
    add_vocab(w, t["vocab_size"], gguf)


def add_vocab(w, n_vocab, gguf):
    """A BPE table llama.cpp's `gemma4` tokenizer accepts: the special tokens at the real ids,
    the 256 byte-fallback tokens, "\\n", "▁", printable ASCII, a few merged pairs, then filler."""
    tokens = list(VOCAB_SPECIALS)
    types = [gguf.TokenType.CONTROL] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    singles = ["\n", "▁"] + [chr(c) for c in range(33, 127)]
    tokens += singles
    types += [gguf.TokenType.NORMAL] * len(singles)
    pairs = [("▁", "t"), ("t", "h"), ("▁", "a"), ("e", "r"), ("i", "n")]
    tokens += [a + b for a, b in pairs]
    types += [gguf.TokenType.NORMAL] * len(pairs)
    filler = n_vocab - len(tokens)
    if filler < 0:
        raise SystemExit(f"vocab_size {n_vocab} is smaller than the fixed tokens ({len(tokens)})")
    tokens += [f"▁tok{i}" for i in range(filler)]
    types += [gguf.TokenType.NORMAL] * filler
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in pairs])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)


def tensor_nbytes(ne, kind, gguf):
    n = int(np.prod(ne))
    if kind.startswith("f32"):
        return 4 * n
    if kind == "bf16":
        return 2 * n
    block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, TYPES[kind])]
    if ne[0] % block:
        raise SystemExit(f"row length {ne[0]} is not a multiple of {block} for {kind}")
    return n // block * size


def write(path, t, wtype, gguf, seed=0):
    rng = np.random.default_rng(seed)
    plan = build_plan(t, wtype, gguf)
    w = gguf.GGUFWriter(path, "gemma4")
    add_metadata(w, t, wtype, gguf)
    for name, ne, kind in plan.items:
        nbytes = tensor_nbytes(ne, kind, gguf)
        shape = list(reversed(ne))  # gguf-py takes numpy order and reverses it
        if kind.startswith("f32"):
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            qt = getattr(gguf.GGMLQuantizationType, TYPES[kind])
            w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # Pools of a prime number of units, so a row never lines up with the pool's period.
    pool = Pool(wtype, rng, 8_388_593 if wtype == "bf16" else 1_048_573)
    fout = w.fout[0]
    total = 0
    hd_full = t.get("global_head_dim") or t["head_dim"]
    n_rot = int(hd_full * t["rope_parameters"]["full_attention"]["partial_rotary_factor"] / 2)
    for name, ne, kind in plan.items:
        nbytes = tensor_nbytes(ne, kind, gguf)
        w.write_padding(fout, fout.tell())
        if kind == "f32_one":
            np.ones(ne, dtype=np.float32).tofile(fout)
        elif kind == "f32_rope":
            # Proportional RoPE on full layers: the unrotated pairs get an infinite period.
            vals = [1.0] * n_rot + [1e30] * (ne[0] - n_rot)
            np.array(vals, dtype=np.float32).tofile(fout)
        elif kind == "f32_rand":
            (rng.standard_normal(int(np.prod(ne)), dtype=np.float32) * 0.02).tofile(fout)
        else:
            pool.write(fout, nbytes)
        w.write_padding(fout, nbytes)
        total += nbytes
    w.close()
    return total, len(plan.items)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--type", required=True, choices=sorted(TYPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf-py", default=os.path.join(os.path.dirname(__file__), "llama.cpp", "gguf-py"))
    ap.add_argument("--override", default="{}", help="JSON merged into the text config (tiny tests)")
    args = ap.parse_args()
    if os.path.isdir(args.gguf_py):
        sys.path.insert(0, args.gguf_py)
    import gguf

    t = text_config(args.config)
    t.update(json.loads(args.override))
    start = time.time()
    total, n = write(args.out, t, args.type, gguf)
    secs = time.time() - start
    print(f"wrote {args.out}: {n} tensors, {total / 1e9:.2f} GB of tensor data, {secs:.1f} s", flush=True)


if __name__ == "__main__":
    main()
