#!/bin/bash
# Compiles src/kernels/metal/qkernels.metal as C++20 against src/kernels/metal/shim.h, so that
# syntax and type errors in the Metal kernels surface without a Mac (runs in CI: needs g++ only).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp src/kernels/metal/shim.h "$tmp/metal_stdlib"
${CXX:-g++} -std=c++20 -fsyntax-only -Wno-attributes -I "$tmp" -x c++ src/kernels/metal/qkernels.metal
echo "qkernels.metal: C++ syntax check passed"
