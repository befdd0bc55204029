#!/bin/bash
# Builds the `cuda` feature (library, quantized kernels, and the kernel_check, bench_kernels,
# bench and generate examples) on a machine with nvcc but no GPU, and packs the binaries for the
# lent GPU machine.
# CI has no nvcc: this is the developer's command.
#
#   scripts/cuda-check.sh            # check + build, binaries in .device/*.xz
#   then on the GPU (device tool, carry .device):
#   xz -d .device/*.xz && source .device/device-env.sh && .device/kernel_check && .device/bench_kernels
set -euo pipefail
cd "$(dirname "$0")/.."
source ../shared/cuda/toolkit.sh >/dev/null
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target-cuda}
# --release: reuses the build-script outputs (candle's PTX, ours) of the release build below.
cargo check --release --features cuda --all-targets
cargo build --release --features cuda --example kernel_check --example bench_kernels --example bench --example generate
mkdir -p .device
for b in kernel_check bench_kernels bench generate; do
  xz -6 -T2 -c "$CARGO_TARGET_DIR/release/examples/$b" > ".device/$b.xz"
done
cp ../shared/cuda/device-env.sh .device/
ls -la .device
