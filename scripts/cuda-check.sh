#!/bin/bash
# Builds the `cuda` feature (library, kernels, the CUDA kernel tests, the CUDA benches and the
# generate example) on a machine with nvcc but no GPU, and packs the binaries for the lent GPU
# machine, which has no Rust toolchain. CI has no nvcc: this is the developer's command.
#
#   scripts/cuda-check.sh            # check + build, binaries in .device/*.xz
#   then on the GPU machine (carry .device): bash scripts/device-run.sh check bench
set -euo pipefail
cd "$(dirname "$0")/.."
source ../shared/cuda/toolkit.sh >/dev/null
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
# --release: reuses the build-script outputs (candle's PTX, ours) of the release build below.
cargo check --release --features cuda --all-targets
cargo build --release --features cuda --example generate
# No kernel may read global memory before its dependent-launch wait (needs cuobjdump and
# nvdisasm: pip install nvidia-cuda-cuobjdump-cu13 nvidia-cuda-nvdisasm-cu13, on PATH).
out=$(dirname "$(ls -t "$CARGO_TARGET_DIR"/release/build/candle-gemma-*/out/matvec.fatbin | head -1)")
# The fatbins must be newer than every kernel source. Cargo keys a build script's run by the
# package, not its folder: a build folder shared with another checkout of the crate can keep
# that checkout's kernels (it happened: a stale build measured as the current one).
stale=""
for cu in src/kernels/cuda/*.cu; do
  fb="$out/$(basename "${cu%.cu}").fatbin"
  if [ ! -e "$fb" ] || [ -n "$( (find "$cu" -newer "$fb"; find src/kernels/cuda -name '*.cuh' -newer "$fb") | head -1)" ]; then
    stale="$stale $cu"
  fi
done
if [ -n "$stale" ]; then
  echo "kernel sources newer than the build's fatbins ($out): $stale" >&2
  echo "touch build.rs and rebuild, or use a CARGO_TARGET_DIR of this checkout's own" >&2
  exit 1
fi
if command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null; then
  python3 scripts/check_pdl_order.py "$out"
else
  echo "cuobjdump/nvdisasm not found: skipping scripts/check_pdl_order.py $out"
fi
mkdir -p .device
xz -6 -T2 -c "$CARGO_TARGET_DIR/release/examples/generate" > .device/generate.xz
# Test and bench binaries carry a hash in their names: ask cargo where it put them.
executable() { # NAME, then the cargo command that builds it (bench builds optimised anyway)
  local name=$1; shift
  cargo "$@" --features cuda --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
paths = [j["executable"] for j in map(json.loads, sys.stdin)
         if j.get("reason") == "compiler-artifact" and j.get("executable") and j["target"]["name"] == sys.argv[1]]
print(paths[-1])' "$name"
}
xz -6 -T2 -c "$(executable cuda_kernels test --release --test cuda_kernels)" > .device/cuda_kernels_test.xz
xz -6 -T2 -c "$(executable model_speed bench --bench model_speed)" > .device/model_speed.xz
xz -6 -T2 -c "$(executable cuda_kernels bench --bench cuda_kernels)" > .device/cuda_kernels.xz
cp ../shared/cuda/device-env.sh .device/
ls -la .device
