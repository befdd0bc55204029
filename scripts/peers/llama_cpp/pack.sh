#!/bin/bash
# Packs what a run on the GPU machine needs to build llama.cpp's `llama-bench` and
# `llama-batched-bench` and to write random-weight GGUF files: llama.cpp's own source from the
# llama-cpp-python 0.3.36 source distribution (its `vendor/llama.cpp`, with the `gemma4`
# architecture), trimmed to the build's inputs, plus this folder's scripts, our
# `model_speed` bench binary and the CUDA runtime setup. The GPU machine has no network and a run
# carries at most 64 MiB, so everything goes into one folder that `run` carries.
#
#   scripts/peers/llama_cpp/pack.sh [DEST]     # DEST defaults to /work/main/.device/llama
#
# Needs `model_speed` built first (CUDA, release):
#   cargo bench --features cuda --bench model_speed --no-run
# and MODEL_SPEED=<that binary> in the environment (the script finds the newest one otherwise).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
DEST=${1:-/work/main/.device/llama}
WORK=${WORK:-/tmp/llama-pack}
VERSION=0.3.36
mkdir -p "$DEST" "$WORK"

# 1. llama.cpp source, from the package index's source distribution.
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  python3 -m pip install -q cmake scikit-build-core
  python3 -m pip download --no-deps --no-binary :all: --no-build-isolation \
    "llama-cpp-python==$VERSION" -d "$WORK"
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$WORK"

# 2. Only what the CUDA build of the two bench tools reads, and gguf-py for the writer.
STAGE="$WORK/stage/llama.cpp"
rm -rf "$WORK/stage" && mkdir -p "$STAGE/tools"
cd "$SRC"
cp -r CMakeLists.txt LICENSE cmake include src common vendor gguf-py "$STAGE/"
cp -r tools/llama-bench tools/batched-bench "$STAGE/tools/"
# ggml without the backends this build does not enable (each is added only when switched on).
mkdir -p "$STAGE/ggml/src"
cp -r ggml/CMakeLists.txt ggml/cmake ggml/include "$STAGE/ggml/"
for f in ggml/src/*; do
  [ -d "$f" ] && [[ $(basename "$f") == ggml-* ]] || cp -r "$f" "$STAGE/ggml/src/"
done
cp -r ggml/src/ggml-cpu ggml/src/ggml-cuda "$STAGE/ggml/src/"
# The tools folder's own CMakeLists adds every tool; this build needs two.
printf 'llama_add_compile_flags()\nadd_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\n' \
  > "$STAGE/tools/CMakeLists.txt"
tar -C "$WORK/stage" -cf - llama.cpp | xz -9 -T2 > "$DEST/llama.cpp.tar.xz"

# 3. The scripts a run calls, the configs and our bench.
cp "$HERE"/gguf_random.py "$HERE"/run.sh "$HERE"/table.py "$DEST/"
cp "$ROOT"/../shared/cuda/device-env.sh "$DEST/" 2>/dev/null \
  || cp /work/shared/cuda/device-env.sh "$DEST/"
BIN=${MODEL_SPEED:-$(ls -t "${CARGO_TARGET_DIR:-$ROOT/target}"/release/deps/model_speed-* \
  | grep -v '\.d$' | head -1)}
xz -6 -T2 -c "$BIN" > "$DEST/model_speed.xz"
ls -la "$DEST"
du -sh "$DEST"
