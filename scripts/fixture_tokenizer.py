"""The fixtures' synthetic tokenizer (a 512-token BPE vocabulary with byte fallback and Gemma 4's
special tokens) and the tokenizer files each fixture folder holds."""

import json

from fixture_common import VOCAB


SPECIAL = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>",
    46: "<|tool>", 47: "<tool|>", 48: "<|tool_call>", 49: "<tool_call|>",
    50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
    98: "<|think|>", 100: "<|channel>", 101: "<channel|>",
    105: "<|turn>", 106: "<turn|>",
}
NEWLINE_ID = 107
BYTE_START = 108  # <0x00>..<0xFF> at 108..363

CORPUS = (
    "the quick brown fox jumps over the lazy dog . hello world , this is a tiny "
    "tokenizer for testing the gemma model in rust . we want to encode and decode "
    "text in the same way as the real one , with spaces as the special marker and "
    "byte fallback for everything else . there is another thing that is here and "
    "there ; it is what it is . the model was trained on some of the text and then "
    "tested with other text , which is the point of this test ."
)


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    vocab = {}
    for i in range(BYTE_START):
        if i in SPECIAL:
            vocab[SPECIAL[i]] = i
        elif i == NEWLINE_ID:
            vocab["\n"] = i
        else:
            vocab[f"<unused{i}>"] = i
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = BYTE_START + b
    nid = BYTE_START + 256
    alphabet = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
        [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("0123456789.,;")
    for ch in alphabet:
        vocab[ch] = nid
        nid += 1
    # greedy BPE merges learned from CORPUS (sentencepiece-style: "▁" glued to words)
    words = {}
    for wd in CORPUS.split(" "):
        t = tuple("▁" + wd)
        words[t] = words.get(t, 0) + 1
    merges = []
    while nid < VOCAB:
        pairs = {}
        for wd, c in words.items():
            for a, b in zip(wd, wd[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        new = best[0] + best[1]
        merges.append(best)
        vocab[new] = nid
        nid += 1
        nw = {}
        for wd, c in words.items():
            out, i = [], 0
            while i < len(wd):
                if i + 1 < len(wd) and (wd[i], wd[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(wd[i])
                    i += 1
            nw[tuple(out)] = nw.get(tuple(out), 0) + c
        words = nw
    assert nid == VOCAB, nid

    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                        byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [SPECIAL[i] for i in sorted(SPECIAL)] + \
        [f"<unused{i}>" for i in range(BYTE_START) if i not in SPECIAL and i != NEWLINE_ID]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    # checks
    for i, t in SPECIAL.items():
        assert tok.token_to_id(t) == i, (t, i)
    assert tok.token_to_id("\n") == NEWLINE_ID
    assert tok.get_vocab_size() == VOCAB
    for s in ["Hello world, the quick brown fox!\nLine two: 42 ~`{}|", "naïve café — 日本 🙂"]:
        ids = tok.encode(s).ids
        assert ids[0] == 2 and max(ids) < VOCAB
        assert tok.decode(ids) == s, (tok.decode(ids), s)
    e = tok.encode("<|turn>user\nhi<turn|>", add_special_tokens=False).ids
    assert e[0] == 105 and e[-1] == 106 and NEWLINE_ID in e, e
    return tok


def write_tokenizer_files(d, tok):
    tok.save(str(d / "tokenizer.json"))
    json.dump({
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "padding_side": "left",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }, open(d / "tokenizer_config.json", "w"), indent=2)
    json.dump({
        "bos_token_id": 2,
        "do_sample": True,
        "eos_token_id": [1, 106, 50],
        "pad_token_id": 0,
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }, open(d / "generation_config.json", "w"), indent=2)
