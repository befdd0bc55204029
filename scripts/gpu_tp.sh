#!/bin/bash
# Tensor-parallel checks and speed on a 2-GPU machine. Build here with
#   cargo build --release --features nccl --example generate --example serve --bench model_speed
#   cargo test --release --features nccl --test cuda_kernels --no-run
# (libnccl.so.2 on the linker's path, e.g. LIBRARY_PATH from the nvidia-nccl-cu13 wheel), put
# `generate`, `serve`, the `model_speed-<hash>` binary (as model_speed) and the test binary (as
# cuda_kernels_test), xz-compressed, into .device/tp/ with device-env.sh, carry .device/tp and
# run, from the repository root:
#   bash .device/tp/run.sh PHASE...
# Phases: check1 (one-GPU kernel tests, goldens and graph checks on GPU 1, in the background),
# tp (scripts/gpu_tp_check.py and scripts/gpu_tp_serve_check.py), serve (the latter alone),
# speed (model_speed at --tp 1 and 2; one line per run of SPECS: model weights batches prefill
# tp graph extra-env, "-" for none), ab (two builds one after the other: put the earlier
# build's model_speed in as e.g. model_speed_old.xz; one line per run of SPECS: binary model
# weights batches tp prefill), loaded (e2b-q4 bf16 ids while a PyTorch matmul loop keeps GPU 1
# busy: --tp 1 on GPU 1, --tp 2 with graphs off and on, and graphs off with the driver's eager
# module loading, LOADED_RUNS each (LOADED_CASES: "TP ENV...;TP ENV..." instead), against a
# quiet --tp 1 run; "stalled": no ids within
# LOADED_TIMEOUT s; loaded.err has each run's seconds).
# CHECK_GPU picks check1's GPU (1; 0 on a one-GPU machine).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
D=.device/tp
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in $D/*.xz; do [ -e "${f%.xz}" ] || xz -T8 -dk "$f"; done
for f in $D/*.xz; do chmod +x "${f%.xz}"; done
source $D/device-env.sh > "$OUT/env.txt" 2>&1
NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -z "$NCCL_LIB" ] && NCCL_LIB=$(dirname "$(find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$NCCL_LIB:$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
check1() {
  export CUDA_VISIBLE_DEVICES=${CHECK_GPU:-1}
  CUDA_KERNELS_REQUIRE_GPU=1 $D/cuda_kernels_test --test-threads=1 --nocapture > "$OUT/cuda-kernels-test.txt" 2>&1
  echo "cuda kernel tests exit $?: $(grep -E '^test result' "$OUT/cuda-kernels-test.txt")"
  python3 scripts/gpu_tokens_check.py $D/generate > "$OUT/tokens-f32.txt" 2>&1; echo "f32 goldens (1 GPU) exit $?: $(tail -1 "$OUT/tokens-f32.txt")"
  CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=0 python3 scripts/gpu_tokens_check.py $D/generate > "$OUT/tokens-f32-sorted.txt" 2>&1
  echo "f32 goldens, MoE sorted path (1 GPU) exit $?: $(tail -1 "$OUT/tokens-f32-sorted.txt")"
  CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=0 CANDLE_GEMMA_MOE_PADDED_MAX_PCT=100000 python3 scripts/gpu_tokens_check.py $D/generate > "$OUT/tokens-f32-padded.txt" 2>&1
  echo "f32 goldens, MoE sorted path padded (1 GPU) exit $?: $(tail -1 "$OUT/tokens-f32-padded.txt")"
  python3 scripts/gpu_graph_batch_check.py $D/generate > "$OUT/graph-batch.txt" 2>&1; echo "graph batch exit $?: $(tail -1 "$OUT/graph-batch.txt")"
  grep -v '"identical": true' "$OUT/graph-batch.txt" | head -4 | cut -c1-300
  python3 scripts/gpu_graph_kvq_check.py $D/generate > "$OUT/graph-kvq.txt" 2>&1; echo "graph kvq exit $?: $(tail -1 "$OUT/graph-kvq.txt")"
}
for phase in "$@"; do
  case $phase in
  check1) el "check1 (GPU 1, background)"; check1 > "$OUT/check1.log" 2>&1 & C1=$! ;;
  tp)
    el "tp tokens"
    timeout ${T_TOKENS:-240} python3 scripts/gpu_tp_check.py $D/generate fixtures > "$OUT/tp-tokens.jsonl" 2>&1; echo "tp tokens exit $?"
    tail -1 "$OUT/tp-tokens.jsonl"; grep '"ok": false' "$OUT/tp-tokens.jsonl" | head -5 | cut -c1-300
    grep -E '"check": "(kv|batch)' "$OUT/tp-tokens.jsonl" | cut -c1-200
    el "tp serve"
    timeout ${T_SERVE:-150} python3 scripts/gpu_tp_serve_check.py $D/serve fixtures > "$OUT/tp-serve.txt" 2>&1; echo "tp serve exit $?"
    tail -4 "$OUT/tp-serve.txt"; grep '"ok": false' "$OUT/tp-serve.txt" | head -3
    ;;
  loaded)
    [ -n "${C1:-}" ] && { wait $C1; el "check1 done"; cat "$OUT/check1.log"; C1=""; }
    ids() { # TP ENV...: the first 6 greedy ids of e2b-q4 in bf16, or "stalled" (no ids within
      # LOADED_TIMEOUT s, 90 by default; the seconds and stderr's last line go to loaded.err, to
      # tell a run that crawls or ends in an error from one that hangs)
      local tp=$1 t=$SECONDS; shift
      timeout ${LOADED_TIMEOUT:-90} env "$@" $D/generate --model fixtures/e2b-q4 --max-tokens 6 \
        --ignore-eos --json --dtype bf16 --tp "$tp" --prompt-ids 2,503,502,507,262,178,481 \
        2>/tmp/loaded-run.err | tail -1 |
        python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["sequences"][0]["ids"])' \
        2>/dev/null > /tmp/loaded-ids || echo stalled > /tmp/loaded-ids
      cat /tmp/loaded-ids
      echo "tp $tp $*: $(cat /tmp/loaded-ids), $((SECONDS - t)) s, $(tail -c 300 /tmp/loaded-run.err | tail -1)" \
        >> "$OUT/loaded.err"
    }
    quiet=$(ids 1 CUDA_VISIBLE_DEVICES=0)
    el "loaded (quiet --tp 1: $quiet; quiet --tp 1 on GPU 1: $(ids 1 CUDA_VISIBLE_DEVICES=1);" \
      "quiet --tp 2: $(ids 2 CANDLE_GEMMA_CUDA_GRAPH=0))"
    CUDA_VISIBLE_DEVICES=1 timeout 600 python3 -c '
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.empty_like(a)
while True: torch.matmul(a, a, out=b)' & LOAD=$!
    sleep 5
    cases=${LOADED_CASES:-"1 CUDA_VISIBLE_DEVICES=1;2 CANDLE_GEMMA_CUDA_GRAPH=0;2 CANDLE_GEMMA_CUDA_GRAPH=1;2 CANDLE_GEMMA_CUDA_GRAPH=0 CUDA_MODULE_LOADING=EAGER;1 CUDA_VISIBLE_DEVICES=1 CANDLE_GEMMA_PDL=0;1 CUDA_VISIBLE_DEVICES=1 CUDA_LAUNCH_BLOCKING=1"}
    IFS=';' read -ra runs <<< "$cases"
    for run in "${runs[@]}"; do
      set -- $run; right=0; wrong=0; stalled=0
      for i in $(seq ${LOADED_RUNS:-4}); do
        got=$(ids "$@")
        if [ "$got" = "$quiet" ]; then right=$((right+1)); elif [ "$got" = stalled ]; then stalled=$((stalled+1)); else wrong=$((wrong+1)); fi
      done
      echo "loaded --tp $1 (${*:2}): $right right, $wrong wrong, $stalled stalled"
    done
    kill $LOAD
    ;;
  serve)
    el "tp serve"
    timeout ${T_SERVE:-150} python3 scripts/gpu_tp_serve_check.py $D/serve fixtures > "$OUT/tp-serve.txt" 2>&1; echo "tp serve exit $?"
    tail -4 "$OUT/tp-serve.txt"; grep '"ok": false' "$OUT/tp-serve.txt" | head -3 | cut -c1-300
    ;;
  ab)
    [ -n "${C1:-}" ] && { wait $C1; el "check1 done"; cat "$OUT/check1.log"; C1=""; }
    while read -r bin model w batch tp prefill; do
      el "$bin $model $w b $batch tp $tp prefill ${prefill:-0}"
      timeout ${T_SPEED:-90} $D/$bin --config fixtures/real-configs/$model-config.json --prefill ${prefill:-0} \
        --batch $batch --context 128 --weights $w --kv dense --steps 16 --rounds 3 --tp $tp 2>>"$OUT/ab.err" \
        | sed "s/^{/{\"bin\":\"$bin\",/" >> "$OUT/ab.jsonl"
    done < "$SPECS"
    python3 -c '
import json,sys
for l in open(sys.argv[1]):
    j=json.loads(l) if l.startswith("{") else {}
    if j.get("op") in ("decode","prefill"): print(j["bin"], j["model"], j["weights"], "tp", j["tp"], j["op"], j.get("batch", j.get("tokens")), "%.1f tok/s" % j["tok_s"])' "$OUT/ab.jsonl"
    ;;
  speed)
    specs=${SPECS:-$OUT/specs.txt}
    [ -n "${SPECS:-}" ] || cat > "$specs" <<'EOF2'
26b-a4b bf16 1,8 0 1 1 -
26b-a4b bf16 1,8 0 2 1 -
26b-a4b bf16 1,8 0 2 1 CANDLE_GEMMA_PEER_ALL_REDUCE_MAX_BYTES=0
31b bf16 1,8 4096 1 1 -
31b bf16 1,8 4096 2 1 -
31b bf16 1,8 0 2 1 CANDLE_GEMMA_PEER_ALL_REDUCE_MAX_BYTES=0
EOF2
    while read -r model w batch prefill tp g extra; do
      [ "${extra:--}" = "-" ] && extra=""
      el "$model $w b $batch prefill $prefill tp $tp graph $g $extra"
      env $extra CANDLE_GEMMA_CUDA_GRAPH=$g timeout ${T_SPEED:-90} $D/model_speed --config fixtures/real-configs/$model-config.json --prefill $prefill \
        --batch $batch --context 128 --weights $w --kv dense --steps 16 --rounds 3 --tp $tp 2>>"$OUT/speed.err" \
        | sed "s/^{/{\"graph_env\":$g,\"extra\":\"$extra\",/" | tee -a "$OUT/speed.jsonl" | python3 -c '
import json,sys
for l in sys.stdin:
    try: j=json.loads(l)
    except Exception: continue
    if j.get("op") in ("decode","prefill"): print(j["graph_env"], j["model"], j["weights"], "tp", j["tp"], j["op"], j.get("batch", j.get("tokens")), "%.1f tok/s" % j["tok_s"], "step %.2f host %.2f ms" % (j.get("step_ms",0), j.get("host_ms",0)), "ar/step", j.get("all_reduces_per_step", j.get("all_reduces")), "share", j.get("all_reduce_share"), str(j.get("cuda_graph",""))[:60])'
    done < "$specs"
    ;;
  esac
done
[ -n "${C1:-}" ] && { wait $C1; el "check1 done"; cat "$OUT/check1.log"; }
el done
