#!/bin/bash
# What one call on the lent GPU machine runs. The binaries come from scripts/cuda-check.sh and
# travel in .device/ (the GPU machine has no Rust toolchain). Results go to $OUT (or ./out);
# tables are made by scripts/tables.py.
#
#   bash scripts/device-run.sh check bench peers table
#
# Phases:
#   check        CUDA kernel tests (every kernel against the CPU reference), then fixture tokens
#   tokens       fixture greedy ids in f32 against the goldens, both MoE paths
#   compare      GPU against CPU and batch against alone, same binary, f32 then bf16
#   kvq          quantized-KV ids: GPU against CPU
#   graphkvq     quantized-KV ids with CUDA graphs on and off, then decode with graphs on/off
#   graphscratch graph replays after eager launches that replaced scratch buffers
#   bench        model speed over the four configs (the README's table)
#   peers        transformers and candle-transformers on the same shapes
#   table        the model table from bench and peers
#   quant        4/8-bit weights: resident memory, decode and prefill
#   profile      ncu GPU time of one decode step per config, and of E4B's 4096-token prefill
#   attn         decode attention, ROUNDS runs, and its table
#   matvec       packed and dense products, ROUNDS runs, and the one-row table
#   experts      grouped expert products (26B-A4B shapes)
#   unfused      E4B and 26B-A4B with CANDLE_GEMMA_UNFUSED=1
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
for f in .device/*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; done
chmod +x .device/cuda_kernels_test .device/cuda_kernels .device/model_speed .device/generate .device/peer_ct 2>/dev/null
source .device/device-env.sh
C=fixtures/real-configs
B=.device/model_speed
K=.device/cuda_kernels
T="python3 scripts/tables.py"
tokens() {
  python3 scripts/gpu_tokens_check.py .device/generate > "$OUT/tokens-f32.txt" 2>&1; echo "tokens exit $?"
  tail -1 "$OUT/tokens-f32.txt"
  # The MoE fixture again with every forward through the sorted (prefill) expert path.
  CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=0 python3 scripts/gpu_tokens_check.py .device/generate \
    > "$OUT/tokens-f32-moe-sorted.txt" 2>&1
  echo "tokens (MoE sorted path) exit $?"; tail -1 "$OUT/tokens-f32-moe-sorted.txt"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
for phase in "$@"; do
  case $phase in
    check)
      CUDA_KERNELS_REQUIRE_GPU=1 .device/cuda_kernels_test --test-threads=1 --nocapture \
        > "$OUT/cuda-kernels-test.txt" 2>&1; echo "cuda kernel tests exit $?"
      grep -E "FAIL|panicked" "$OUT/cuda-kernels-test.txt" | head -5
      grep -E "^test result" "$OUT/cuda-kernels-test.txt"
      tokens
      ;;
    tokens)
      tokens
      ;;
    compare)
      for dt in f32 bf16; do
        python3 scripts/gpu_tokens_compare.py .device/generate $dt > "$OUT/tokens-compare-$dt.txt" 2>&1
        echo "compare $dt exit $?"; tail -1 "$OUT/tokens-compare-$dt.txt"
      done
      ;;
    kvq)
      python3 scripts/gpu_kvq_check.py .device/generate > "$OUT/kvq-ids.txt" 2>&1; echo "kvq ids exit $?"
      tail -1 "$OUT/kvq-ids.txt"
      ;;
    graphkvq)
      python3 scripts/gpu_graph_kvq_check.py .device/generate > "$OUT/graph-kvq-ids.txt" 2>&1
      echo "graph kvq ids exit $?"; tail -1 "$OUT/graph-kvq-ids.txt"
      for round in 1 2; do
        for v in 1 0; do
          for m in ${KVQ_MODELS:-e2b e4b}; do
            CANDLE_GEMMA_CUDA_GRAPH=$v $B --config $C/$m-config.json --prefill 0 --batch 1 \
              --context 4096 --steps 16 --kv dense,q4,q8 2>>"$OUT/bench.err" | grep decode \
              | sed "s/^{/{\"cuda_graph_env\":$v,/" >> "$OUT/graph-kvq-decode.jsonl"
          done
        done
      done
      $T decode "$OUT/graph-kvq-decode.jsonl" --field cuda_graph_env
      ;;
    graphscratch)
      python3 scripts/gpu_graph_scratch_check.py $B ${ROUNDS:-4} > "$OUT/graph-scratch.txt" 2>&1
      echo "graph scratch exit $?"; tail -1 "$OUT/graph-scratch.txt"
      ;;
    bench)
      for m in e2b e4b 26b-a4b; do
        $B --config $C/$m-config.json --prefill 512,4096 --batch 1,8,32 --context 128,4096 --steps 16 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | grep -v memory | cut -c1-160
      done
      $B --config $C/31b-config.json --prefill 512,4096 --batch 1,8 --context 128 --steps 8 \
        2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | cut -c1-160
      $B --config $C/31b-config.json --prefill 0 --batch 1 --context 4096 --steps 8 \
        2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | grep decode | cut -c1-160
      ;;
    peers)
      [ -x .device/peer_ct ] && .device/peer_ct $C/e2b-config.json $C/e4b-config.json $C/31b-config.json \
        2>>"$OUT/peers.err" | tee -a "$OUT/peers.jsonl"
      python3 scripts/peers/transformers_bench.py $C/e2b-config.json $C/e4b-config.json \
        $C/26b-a4b-config.json $C/31b-config.json 2>>"$OUT/peers.err" | tee -a "$OUT/peers.jsonl"
      ;;
    table)
      $T model "$OUT/bench.jsonl" "$OUT/peers.jsonl" | tee "$OUT/table.md"
      ;;
    quant)
      for m in 31b 26b-a4b; do
        $B --config $C/$m-config.json --weights q4 --memory-only 2>>"$OUT/bench.err" | tee -a "$OUT/bench-q.jsonl"
      done
      for m in ${QUANT_MODELS:-e4b 26b-a4b 31b}; do
        $B --config $C/$m-config.json --weights q4,q8 --prefill 512 --batch 1,8 --context 128 --kv dense,q4 --steps 8 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench-q.jsonl" | cut -c1-160
      done
      $T decode "$OUT/bench-q.jsonl"
      ;;
    profile)
      NCU="ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv"
      for m in ${PROFILE_MODELS:-e2b e4b 26b-a4b 31b}; do
        wall=$($B --config $C/$m-config.json --prefill 0 --batch 1 --context 128 --steps 16 2>>"$OUT/bench.err" \
          | python3 -c "import json,sys; print([json.loads(l)['step_ms'] for l in sys.stdin if '\"decode\"' in l][0])")
        $NCU --log-file "$OUT/ncu-$m-decode.csv" $B --config $C/$m-config.json --prefill 0 --batch 1 \
          --context 128 --steps 8 --profile > /dev/null 2>>"$OUT/bench.err"
        $T ncu "$OUT/ncu-$m-decode.csv" --wall-ms "$wall" --label "$m decode b=1 ctx=128" --top 12
      done
      wall=$($B --config $C/e4b-config.json --prefill 4096 --batch 0 2>>"$OUT/bench.err" \
        | python3 -c "import json,sys; print([4096e3/json.loads(l)['tok_s'] for l in sys.stdin if 'prefill' in l][0])")
      $NCU --log-file "$OUT/ncu-e4b-prefill.csv" $B --config $C/e4b-config.json --prefill 4096 --batch 0 --profile \
        > /dev/null 2>>"$OUT/bench.err"
      $T ncu "$OUT/ncu-e4b-prefill.csv" --wall-ms "$wall" --label "e4b prefill 4096" --top 15
      ;;
    attn)
      for r in $(seq ${ROUNDS:-2}); do
        $K --attention-only > "$OUT/attn-$r.jsonl" 2>&1; echo "attention round $r exit $?"
      done
      $T attention "$OUT"/attn-*.jsonl | tee "$OUT/attn-table.md"
      ;;
    matvec)
      for r in $(seq ${ROUNDS:-2}); do
        $K --matmul-only > "$OUT/matvec-$r.jsonl" 2>&1; echo "matvec round $r exit $?"
      done
      $K --dense-only > "$OUT/dense-matvec.jsonl" 2>&1; echo "dense exit $?"
      $T matvec "$OUT"/matvec-*.jsonl | tee "$OUT/matvec-table.md"
      ;;
    experts)
      $K --experts 2>&1 | tee "$OUT/grouped-experts.jsonl" | cut -c1-220
      ;;
    unfused)
      for m in e4b 26b-a4b; do
        CANDLE_GEMMA_UNFUSED=1 $B --config $C/$m-config.json --prefill 4096 --batch 1,8 --context 128 --steps 16 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench-unfused.jsonl" | grep -v memory | cut -c1-160
      done
      ;;
    *)
      echo "unknown phase: $phase" >&2
      ;;
  esac
done
