"""Constants and layer-geometry helpers shared by the fixture scripts
(`make_fixtures.py`, `fixture_tokenizer.py`, `fixture_report.py`)."""

from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
CONFIGS = Path("/work/shared/gemma4/configs")

VOCAB = 512
WINDOW = 8
N_NEW = 24
PROMPT_LENS = (7, 19, 33)
REFERENCE = "mlx-lm 0.32.2 / mlx 0.32.4 CPU float32"

# Weight-generation parameters of the fixtures (recorded in fixtures/README.md).
EMB_STD = 1.5
POST_NORM = (3.0, 9.0)
QK_NORM = (0.25, 0.75)  # q_norm/k_norm weights (attention scale is 1.0: keep scores moderate)  # range of the post_* norm weights (residual-branch gain)
SEEDS = {"e2b": 115, "e4b": 210, "moe": 301, "dense": 413}  # picked with --search (largest min top-2 margin found)


def full_head_dim(tc, i):
    if tc["layer_types"][i] != "full_attention":
        return tc["head_dim"]
    plc = tc.get("per_layer_config")
    if plc is not None:
        for k, v in plc.items():
            if int(k) == i and "head_dim" in v:
                return v["head_dim"]
        return tc["head_dim"]
    return tc.get("global_head_dim") or tc["head_dim"]


def geometry(tc, i):
    """(head_dim, kv_heads, has_v) of layer i."""
    full = tc["layer_types"][i] == "full_attention"
    hd = full_head_dim(tc, i)
    k_eq_v = tc["attention_k_eq_v"] and full
    kvh = tc["num_key_value_heads"]
    if k_eq_v and tc.get("num_global_key_value_heads") is not None:
        kvh = tc["num_global_key_value_heads"]
    return hd, kvh, not k_eq_v


def first_shared(tc):
    return tc["num_hidden_layers"] - tc["num_kv_shared_layers"]


def layer_plan(tc):
    L = tc["num_hidden_layers"]
    F = first_shared(tc)
    lt = tc["layer_types"]
    prod = {}
    for i in range(F):
        prod[lt[i]] = i
    consumers = {j: prod[lt[j]] for j in range(F, L)} if tc["num_kv_shared_layers"] else {}
    return {
        "sliding": [i for i in range(L) if lt[i] == "sliding_attention"],
        "full": [i for i in range(L) if lt[i] == "full_attention"],
        "consumers": consumers,
    }



def sig(x, n=6):
    return float(f"{float(x):.{n}g}")


def min_margin(g):
    return min(m for c in g["cases"] for m in c["margins"])
