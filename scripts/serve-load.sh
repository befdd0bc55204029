#!/bin/bash
# Serving under load on one GPU: the `serve` example with random weights at the real shapes,
# driven by scripts/loadgen.py. E4B (dense and 4-bit KV at concurrency 1/8/32/64, and the
# long-prompt probe: a 4,096-token prompt joining 8 running streams), then 26B-A4B and 31B at
# concurrency 32. Logs go to $OUT (default: bench-results/serve-load).
#
#   cargo build --release --features cuda --example serve
#   scripts/serve-load.sh target/release/examples/serve fixtures/real-configs
set -uo pipefail
SERVE=${1:?the serve binary}
CONFIGS=${2:?a folder with e4b-config.json, 26b-a4b-config.json, 31b-config.json}
LOADGEN=${LOADGEN:-$(dirname "$0")/loadgen.py}
OUT=${OUT:-bench-results/serve-load}
PORT=${PORT:-18080}
mkdir -p "$OUT"
start() { # config, extra flags
  "$SERVE" --random-weights "$CONFIGS/$1" --dtype bf16 --device cuda --port "$PORT" \
    --max-batch 64 --max-queue 512 --kv-budget-mb 20000 "${@:2}" >"$OUT/server-${1%.json}.log" 2>&1 &
  SPID=$!
  for _ in $(seq 1 240); do curl -sf "localhost:$PORT/health" >/dev/null && return 0; sleep 0.5; done
  echo "server did not start"; tail -5 "$OUT/server-${1%.json}.log"; return 1
}
stop() { kill "$SPID"; wait "$SPID" 2>/dev/null; }
lg() {
  timeout "${T:-150}" python3 "$LOADGEN" --url "http://127.0.0.1:$PORT" --vocab 262144 \
    --min-token-id 1000 --prompt-len 128 --max-tokens 128 "$@"
}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  if start e4b-config.json --prefill-chunk 256; then
    echo "### E4B bf16, dense KV"; lg --concurrency 1,8,32,64
    echo "### E4B bf16, 4-bit KV"; lg --concurrency 8,32 --kv-bits 4
    echo "### E4B long prompt joins (8 streams, 4096-token prompt)"
    lg --concurrency '' --join-streams 8 --join-prompt-len 4096 --join-stream-tokens 1500 --join-after 1.0
    stop
  fi
  for m in 26b-a4b 31b; do
    if start "$m-config.json"; then
      echo "### $m bf16, dense KV"; T=120 lg --concurrency 32 --requests 64
      stop
    fi
  done
} 2>&1 | tee "$OUT/loadgen.txt"
