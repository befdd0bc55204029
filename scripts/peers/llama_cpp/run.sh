#!/bin/bash
# llama.cpp beside our `model_speed` bench in one call on the GPU machine. Everything comes from
# the folder `pack.sh` fills (carried as `.device/llama`); logs go to $OUT.
#
#   bash .device/llama/run.sh                # from the repository root, on the GPU machine
#
# 1. Builds llama.cpp's llama-bench and llama-batched-bench (CUDA, sm_90) in /tmp/llama-build,
#    outside the carried folder, on cores 3-15; skipped when a warm machine still has the build.
# 2. Meanwhile, on cores 0-1, runs our bench at the same shapes (E4B in bf16, MLX 8-bit and
#    4-bit group 64; 26B-A4B and 31B in 4-bit), and on core 2 writes the first GGUF files.
# 3. Then, one model at a time: llama-bench (decode 128 tokens at depths 0 and 4096, prefill
#    512 and 4096) and llama-batched-bench (128-token prompts, 128 decoded, 8 and 32 parallel
#    sequences), each GGUF deleted after use (the disk holds 64 GiB).
# Every step runs under its own `timeout`, and all of them under DEADLINE seconds from the start.
# MODELS / OURS choose subsets, e.g. MODELS="31b:q4_0" OURS="" (empty: none). LLAMA_BENCH=0 runs only
# llama-batched-bench; WAIT_FILE=F holds step 3 until F is gone (another job of the call owns
# the GPU until then). A call returns at most 8 files,
# so the logs are kept in /tmp/llama-logs and packed into $OUT/logs.tar.gz on exit; run.log and
# the table (table.py) also go to $OUT.
set -uo pipefail
D=${D:-.device/llama}
OUT=${OUT:-$PWD/out}
DEADLINE=${DEADLINE:-570}
MODELS=${MODELS-"e4b:bf16 e4b:q4_0 31b:q4_0 26b-a4b:q4_0 e4b:q8_0"}
OURS=${OURS-"e4b:bf16,q8,q4 31b:q4 26b-a4b:q4"}
C=${CONFIGS:-fixtures/real-configs}
G=/tmp/gguf
BUILD=/tmp/llama-build
L=/tmp/llama-logs
rm -rf "$L" && mkdir -p "$OUT" "$G" "$L"
trap 'tar -czf "$OUT/logs.tar.gz" -C "$L" . ; cp "$L/run.log" "$OUT/" 2> /dev/null' EXIT
T0=$(date +%s)
left() { # seconds a step may take: its own cap, or what the deadline leaves
  local rest=$((DEADLINE - ($(date +%s) - T0) - 5))
  [ "$rest" -lt "$1" ] && echo $((rest > 1 ? rest : 1)) || echo "$1"
}
log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$L/run.log"; }
source "$D/device-env.sh" > "$L/env.txt" 2>&1
cat "$L/env.txt"
nproc; free -g | head -2; df -h /tmp | tail -1
PIN_BUILD="taskset -c 3-$(($(nproc) - 1))"
PIN_OURS="taskset -c 0,1"
PIN_WRITE="taskset -c 2"
if ! command -v taskset > /dev/null || [ "$(nproc)" -lt 8 ]; then
  PIN_BUILD=""; PIN_OURS=""; PIN_WRITE=""
fi

# --- 1. llama.cpp build, in the background ---------------------------------------------------
build() {
  if [ -x "$BUILD/bin/llama-bench" ] && [ -x "$BUILD/bin/llama-batched-bench" ]; then
    echo "build: kept from the last call"; return 0
  fi
  rm -rf /tmp/llama-src && mkdir -p /tmp/llama-src
  tar -xJf "$D/llama.cpp.tar.xz" -C /tmp/llama-src
  local t=$(date +%s)
  $PIN_BUILD cmake -S /tmp/llama-src/llama.cpp -B "$BUILD" -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DCMAKE_BUILD_TYPE=Release || return 1
  $PIN_BUILD cmake --build "$BUILD" -j "$(($(nproc) - 3))" --target llama-bench llama-batched-bench \
    || return 1
  echo "build: $(($(date +%s) - t)) s (configure + build, $(($(nproc) - 3)) jobs)"
}
export D BUILD PIN_BUILD
export -f build
( timeout "$(left 420)" bash -c build > "$L/llama-build.log" 2>&1
  echo "build exit $?" >> "$L/llama-build.log" ) &
BUILD_PID=$!

# --- GGUF writer, in the background: at most two files on disk at once -----------------------
writer() {
  for m in $MODELS; do
    local name=${m%%:*} type=${m##*:}
    while [ "$(ls "$G"/*.gguf 2> /dev/null | wc -l)" -ge 2 ]; do sleep 1; done
    $PIN_WRITE python3 "$D/gguf_random.py" --config "$C/$name-config.json" --type "$type" \
      --out "$G/$name-$type.gguf.part" --gguf-py /tmp/llama-src/llama.cpp/gguf-py \
      && mv "$G/$name-$type.gguf.part" "$G/$name-$type.gguf" && touch "$G/$name-$type.ready"
  done
}
( while [ ! -d /tmp/llama-src/llama.cpp/gguf-py ]; do sleep 1; done
  writer >> "$L/gguf-writer.log" 2>&1 ) &
WRITER_PID=$!

# --- 2. our bench, meanwhile ------------------------------------------------------------------
[ -x "$D/model_speed" ] || { xz -dk "$D/model_speed.xz" && chmod +x "$D/model_speed"; }
for spec in $OURS; do
  name=${spec%%:*} weights=${spec##*:}
  log "ours $name $weights: prefill and batch 1"
  timeout "$(left 150)" $PIN_OURS "$D/model_speed" --config "$C/$name-config.json" --weights "$weights" \
    --prefill 512,4096 --batch 1 --context 128,4096 --steps 32 --rounds 3 \
    >> "$L/ours.jsonl" 2>> "$L/ours.err"; log "exit $?"
  log "ours $name $weights: batch 8 and 32"
  timeout "$(left 150)" $PIN_OURS "$D/model_speed" --config "$C/$name-config.json" --weights "$weights" \
    --prefill 0 --batch 8,32 --context 128 --steps 16 --rounds 3 \
    >> "$L/ours.jsonl" 2>> "$L/ours.err"; log "exit $?"
done

wait $BUILD_PID
log "$(tail -2 "$L/llama-build.log" | tr '\n' ' ')"
if [ ! -x "$BUILD/bin/llama-bench" ]; then
  log "no llama-bench: see llama-build.log"; kill $WRITER_PID 2> /dev/null; exit 1
fi

# Another job of the same call may hold the GPU until it removes WAIT_FILE.
if [ -n "${WAIT_FILE:-}" ]; then
  log "waiting for $WAIT_FILE to go"
  timeout "$(left 300)" bash -c "while [ -e '$WAIT_FILE' ]; do sleep 1; done"
  log "GPU free"
fi

# --- 3. llama.cpp, one model at a time ---------------------------------------------------------
for m in $MODELS; do
  name=${m%%:*} type=${m##*:}
  f="$G/$name-$type.gguf"
  log "llama.cpp $name $type: waiting for the file"
  timeout "$(left 120)" bash -c "while [ ! -e '$G/$name-$type.ready' ]; do sleep 1; done" \
    || { log "no file"; break; }
  [ "${LLAMA_BENCH:-1}" = 1 ] && log "llama-bench $name $type" && timeout "$(left 180)" "$BUILD/bin/llama-bench" -m "$f" -ngl 99 -fa 1 -p 512,4096 -n 128 \
    -d 0,4096 -r 3 -o jsonl > "$L/llama-bench-$name-$type.jsonl" \
    2> "$L/llama-bench-$name-$type.err"; log "exit $?"
  log "llama-batched-bench $name $type"
  timeout "$(left 150)" "$BUILD/bin/llama-batched-bench" -m "$f" -ngl 99 -fa on -c 16384 \
    -b 2048 -ub 512 -npp 128 -ntg 128 -npl 8,32 --output-format jsonl \
    > "$L/llama-batched-$name-$type.jsonl" 2> "$L/llama-batched-$name-$type.err"; log "exit $?"
  rm -f "$f" "$G/$name-$type.ready"
done
kill $WRITER_PID 2> /dev/null
rm -f "$G"/*.gguf "$G"/*.part
# Our batched points again with the GPU machine otherwise idle (the first pass shared the host
# with the llama.cpp build), as long as the deadline leaves time.
for spec in ${OURS_ALONE-"e4b:bf16,q4"}; do
  name=${spec%%:*} weights=${spec##*:}
  [ "$(left 100)" -lt 60 ] && break
  log "ours alone $name $weights: batch 8 and 32"
  timeout "$(left 100)" "$D/model_speed" --config "$C/$name-config.json" --weights "$weights" \
    --prefill 0 --batch 8,32 --context 128 --steps 16 --rounds 3 \
    >> "$L/ours-alone.jsonl" 2>> "$L/ours.err"; log "exit $?"
done
log "done"
python3 "$D/table.py" "$L" 2>&1 | tee "$OUT/table.md"
