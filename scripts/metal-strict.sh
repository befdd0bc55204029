#!/bin/bash
# The stricter compile of src/kernels/metal/qkernels.metal: clang (libclang, from the `libclang`
# Python wheel, installed on first use) against src/kernels/metal/strict.h, where Metal's
# `device`, `constant` and `threadgroup` are distinct address spaces and `half`/`bfloat` are
# builtin types. A pointer or reference passed across address spaces fails here as it fails
# in Apple's compiler (scripts/metal-syntax.sh, g++ against the emulation shim, accepts it).
# The script first checks that it would notice: two copies of the source with an address-space
# mix-up must fail, then the real source must pass. Runs in CI (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import clang.cindex" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check libclang==18.1.1 ||
        python3 -m pip install --quiet --disable-pip-version-check libclang==18.1.1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp src/kernels/metal/strict.h "$tmp/metal_stdlib"
cat > "$tmp/check.py" <<'PY'
import sys
import clang.cindex as ci

src, inc = sys.argv[1], sys.argv[2]
args = ["-x", "c++", "-std=c++20", "-I", inc, "-Wno-unknown-attributes", "-Wno-ignored-attributes"]
args += sys.argv[3:]
tu = ci.Index.create().parse(src, args=args)
errors = [d for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
for d in errors[:5]:
    print(f"  {d.location.file}:{d.location.line}: {d.spelling}")
sys.exit(1 if errors else 0)
PY
src=src/kernels/metal/qkernels.metal
# Mix-ups the check must reject: a threadgroup array passed as a device pointer, and the
# constant parameter block passed as a device reference.
sed 's/threadgroup float\* sm_acc, threadgroup float\* sm_m/device float* sm_acc, threadgroup float* sm_m/' "$src" > "$tmp/bad1.metal"
sed 's/inline uint key_pos(constant QsdpaParams& p/inline uint key_pos(device QsdpaParams\& p/' "$src" > "$tmp/bad2.metal"
for bad in bad1 bad2; do
    if cmp -s "$src" "$tmp/$bad.metal"; then
        echo "metal-strict: the $bad mutation no longer applies to $src; update this script" >&2
        exit 1
    fi
    if python3 "$tmp/check.py" "$tmp/$bad.metal" "$tmp" > /dev/null; then
        echo "metal-strict: an address-space mix-up ($bad) compiled: the check is blind" >&2
        exit 1
    fi
done
if ! python3 "$tmp/check.py" "$src" "$tmp"; then
    echo "metal-strict: qkernels.metal fails the address-space check (errors above)" >&2
    exit 1
fi
# Metal 3.0 (macOS 13): no `bfloat`; the library must still compile, without the bf16 kernels.
if ! python3 "$tmp/check.py" "$src" "$tmp" -D__METAL_VERSION__=300; then
    echo "metal-strict: qkernels.metal does not compile without bfloat (Metal 3.0)" >&2
    exit 1
fi
echo "qkernels.metal: strict address-space compile passed for Metal 3.1 and 3.0 (and rejects 2 planted mix-ups)"
