#!/bin/bash
# For a Mac owner: what only a Mac can show about the `metal` feature, in one run.
#   1. the on-device kernel tests: the crate's Metal kernels through the launcher against the
#      CPU reference (attention, matvec, dequantize; quantize, row gather; candle's Q4_1
#      products), `cargo test --release --features metal`;
#   2. every fixture's goldens on the Metal device in f32, with dense and quantized caches;
#   3. a decode speed figure (examples/generate, greedy, on the Metal device);
# then one summary. Usage: scripts/mac-check.sh [CHECKPOINT]  (default fixtures/e2b-q4: the
# speed of a tiny fixture says little; pass a real MLX 4-bit checkpoint folder for a figure
# worth quoting). Logs go to target/mac-check/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" != "Darwin" ]; then
    echo "mac-check: this is for macOS on Apple silicon (found $(uname -s))" >&2
    exit 2
fi
model=${1:-fixtures/e2b-q4}
logs=target/mac-check
mkdir -p "$logs"
summary=()
failed=0

step() {
    local name=$1 log=$2
    shift 2
    echo "== $name"
    if "$@" >"$logs/$log" 2>&1; then
        summary+=("PASS  $name")
    else
        summary+=("FAIL  $name (see $logs/$log)")
        failed=1
    fi
    # A test that found no Metal device skips itself: say so rather than pass silently.
    if grep -q "no Metal device" "$logs/$log"; then
        summary+=("      ... but no Metal device was found: nothing ran on the GPU")
        failed=1
    fi
}

step "kernel tests on the device (metal_emulation: attention, matvec, dequantize)" kernels.log \
    cargo test --release --features metal --test metal_emulation -- --nocapture on_the_device
step "kernel tests on the device (quantize, row gather, candle Q4_1 products)" device_kernels.log \
    cargo test --release --features metal --test metal_device -- --nocapture quantize_gather
step "fixture goldens on the Metal device in f32 (dense, 8-bit and 4-bit caches)" goldens.log \
    cargo test --release --features metal --test metal_device -- --nocapture goldens
step "the whole test suite with the metal feature" suite.log \
    cargo test --release --features metal

echo "== decode speed: $model"
speed="(not measured)"
if cargo run --release --features metal --example generate -- --model "$model" \
    --prompt-ids 2,18,59,63,96,120 --max-tokens 128 --ignore-eos --json \
    >"$logs/speed.json" 2>"$logs/speed.log"; then
    speed=$(python3 -c 'import json,sys; s=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])["stats"]; print(f"prefill {s[\"prefill_tok_s\"]:.1f} tok/s, decode {s[\"decode_tok_s\"]:.1f} tok/s over {s[\"generated_tokens\"]} tokens")' "$logs/speed.json" 2>/dev/null || tail -1 "$logs/speed.json")
    summary+=("PASS  decode speed ($model, f32, greedy): $speed")
else
    summary+=("FAIL  decode speed (see $logs/speed.log)")
    failed=1
fi

echo
echo "== mac-check summary ($(sysctl -n machdep.cpu.brand_string 2>/dev/null), macOS $(sw_vers -productVersion 2>/dev/null))"
for line in "${summary[@]}"; do
    echo "$line"
done
echo "Max errors per case are in the logs (grep 'max abs error' / 'dlogprob')."
exit $failed
