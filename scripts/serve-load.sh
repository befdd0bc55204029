#!/bin/bash
# Serving under load on one GPU: the `serve` example with random weights at the real shapes,
# driven by scripts/loadgen.py. For E4B, 26B-A4B and 31B (bf16 weights), dense and 4-bit KV, at
# concurrency 1, 8, 32 and 64 (2 x concurrency requests per level, at least 4), plus the
# long-prompt probe on E4B: a 4,096-token prompt joining 8 running streams. Logs go to $OUT
# (default: bench-results/serve-load).
#
#   cargo build --release --features cuda --example serve
#   scripts/serve-load.sh target/release/examples/serve fixtures/real-configs
# SERVE_FLAGS adds server flags (e.g. "--tp 2" with a `--features nccl` build); MODELS and
# LEVELS pick models and concurrency levels.
set -uo pipefail
SERVE=${1:?the serve binary}
CONFIGS=${2:?a folder with e4b-config.json, 26b-a4b-config.json, 31b-config.json}
LOADGEN=${LOADGEN:-$(dirname "$0")/loadgen.py}
OUT=${OUT:-bench-results/serve-load}
PORT=${PORT:-18080}
MODELS=${MODELS:-e4b 26b-a4b 31b}
LEVELS=${LEVELS:-1 8 32 64}
mkdir -p "$OUT"
start() { # config, extra flags
  "$SERVE" --random-weights "$CONFIGS/$1" --dtype bf16 --device cuda --port "$PORT" \
    --max-batch 64 --max-queue 512 --kv-budget-mb 20000 --prefill-chunk 256 ${SERVE_FLAGS:-} "${@:2}" \
    >"$OUT/server-${1%.json}.log" 2>&1 &
  SPID=$!
  for _ in $(seq 1 240); do curl -sf "localhost:$PORT/health" >/dev/null && return 0; sleep 0.5; done
  echo "server did not start"; tail -5 "$OUT/server-${1%.json}.log"; return 1
}
stop() { kill "$SPID"; wait "$SPID" 2>/dev/null; }
lg() {
  timeout "${T:-120}" python3 "$LOADGEN" --url "http://127.0.0.1:$PORT" --vocab 262144 \
    --min-token-id 1000 --prompt-len 128 --max-tokens 128 "$@"
}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  for m in $MODELS; do
    start "$m-config.json" || continue
    # A warm-up request: the kernels' first use is not part of any level.
    lg --concurrency 1 --requests 1 --max-tokens 8 >/dev/null
    for kv in dense 4; do
      for c in $LEVELS; do
        n=$(( 2 * c > 4 ? 2 * c : 4 ))
        echo "### $m bf16, $kv KV, concurrency $c"
        if [ "$kv" = dense ]; then lg --concurrency "$c" --requests "$n"
        else lg --concurrency "$c" --requests "$n" --kv-bits 4; fi
      done
    done
    if [ "$m" = e4b ]; then
      echo "### e4b long prompt joins (8 streams, 4096-token prompt, 256-token chunks)"
      lg --concurrency '' --join-streams 8 --join-prompt-len 4096 --join-stream-tokens 1500 --join-after 1.0
    fi
    stop
  done
} 2>&1 | tee "$OUT/loadgen.txt"
