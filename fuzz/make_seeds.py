#!/usr/bin/env python3
"""Writes the seed corpora of the `config` and `safetensors_header` fuzz targets from the
crate's fixtures (run from the repository root: `python3 fuzz/make_seeds.py`).

config: every fixture config.json and real config, as is.
safetensors_header: small checkpoints cut from the fixtures: the embedding, one norm and one
projection (and, for MoE fixtures, one expert stack pair), dense or MLX-packed, each tensor cut
to at most 2 rows (and 2 experts), keeping its names, dtype and row width.

The prompt_cache seeds come from `cargo test --test fuzz_regressions -- --ignored
write_prompt_cache_seeds`; the output_parser seeds are written below.
"""
import glob
import json
import os
import shutil
import struct

SEEDS = "fuzz/seeds"
KEEP = (
    "embed_tokens.",
    "layers.0.input_layernorm.",
    "layers.0.self_attn.q_proj.",
    "layers.0.experts.switch_glu.gate_proj.",
    "layers.0.experts.switch_glu.up_proj.",
)
SIZES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


def cut(shape):
    if len(shape) == 2:
        return [min(shape[0], 2), shape[1]]
    if len(shape) == 3:
        return [min(shape[0], 2), min(shape[1], 2), shape[2]]
    return shape


def small_checkpoint(src, dst):
    data = open(src, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    out_header, out_body = {}, b""
    for name in sorted(k for k in header if k != "__metadata__"):
        if not any(k in name for k in KEEP) or "per_layer" in name:
            continue
        info = header[name]
        shape = cut(info["shape"])
        size = SIZES[info["dtype"]]
        for d in shape:
            size *= d
        start = info["data_offsets"][0]
        out_header[name] = {
            "dtype": info["dtype"],
            "shape": shape,
            "data_offsets": [len(out_body), len(out_body) + size],
        }
        out_body += body[start : start + size]
    text = json.dumps(out_header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + out_body)


def main():
    d = f"{SEEDS}/config"
    os.makedirs(d, exist_ok=True)
    for p in sorted(glob.glob("fixtures/*/config.json")):
        shutil.copy(p, f"{d}/{p.split('/')[1]}.json")
    for p in sorted(glob.glob("fixtures/real-configs/*.json")):
        shutil.copy(p, f"{d}/real-{os.path.basename(p)}")

    d = f"{SEEDS}/safetensors_header"
    os.makedirs(d, exist_ok=True)
    for fixture in ["e2b-hf", "e4b-text", "e2b-q4", "e2b-q8", "moe-mlx", "moe-q4"]:
        small_checkpoint(f"fixtures/{fixture}/model.safetensors", f"{d}/{fixture}.safetensors")

    d = f"{SEEDS}/output_parser"
    os.makedirs(d, exist_ok=True)
    texts = {
        # First byte: bit 0 starts inside a thought. 0xFF splits chunks.
        "thought_text_call": b"\x00<|channel>thought\nThe user greets me.<chan\xffnel|>Hi!"
        b"<|tool_call>call:wave{times:2,who:<|\"|>you<|\"|>}<tool_\xffcall|><turn|>",
        "in_thinking": b"\x01plan\xff<channel|>answer<eos>",
        "turns": b"\x00A<turn|>\n<|tu\xffrn>model\nB<eos>",
        "bad_call": b"\x00<|tool_call>call:f{a:<tool_call|>ok\xff<|channel>thought\nstill",
        "nested": b"\x00<|tool_call>call:f{a:[1,{b:<|\"|>x<|\"|>}],c:true}<tool_call|>"
        b"<|tool_call>call:g{}<tool_call|>",
    }
    for name, t in texts.items():
        open(f"{d}/{name}", "wb").write(t)


if __name__ == "__main__":
    main()
