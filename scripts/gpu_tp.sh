#!/bin/bash
# Tensor-parallel checks and speed on a 2-GPU machine. Build here with
#   cargo build --release --features nccl --example generate --bench model_speed
# (libnccl.so.2 on the linker's path, e.g. LIBRARY_PATH from the nvidia-nccl-cu13 wheel), put
# `generate` and the `model_speed-<hash>` binary (as model_speed) into .device/nccl/ with
# device-env.sh and scripts/gpu_tp_check.py (as tp_tokens.py), carry .device/nccl and run
#   bash .device/nccl/run.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
D=.device/nccl
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for f in $D/*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; done
chmod +x $D/generate $D/model_speed
source $D/device-env.sh > "$OUT/env.txt" 2>&1
NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[ -z "$NCCL_LIB" ] && NCCL_LIB=$(dirname "$(find / -xdev -name 'libnccl.so.2' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH="$NCCL_LIB:$LD_LIBRARY_PATH"
echo "nccl lib: $NCCL_LIB $(ls $NCCL_LIB 2>/dev/null | tr '\n' ' ')" | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "tokens"
timeout ${T_TOKENS:-100} python3 $D/tp_tokens.py $D/generate fixtures > "$OUT/tokens.jsonl" 2>&1; echo "tokens exit $?"
tail -1 "$OUT/tokens.jsonl"; grep -c '"ok": true' "$OUT/tokens.jsonl"; grep '"ok": false' "$OUT/tokens.jsonl" | head -5 | cut -c1-400
B="--weights bf16 --kv dense --steps 8 --rounds 3"
for tp in 1 2; do
  el "31b tp $tp"
  timeout ${T_31B:-75} $D/model_speed --config fixtures/real-configs/31b-config.json --prefill 4096 --batch 1,8 --context 128 $B --tp $tp 2>>"$OUT/speed.err" | tee -a "$OUT/speed.jsonl" | cut -c1-330
done
for tp in 1 2; do
  el "26b tp $tp"
  timeout ${T_26B:-45} $D/model_speed --config fixtures/real-configs/26b-a4b-config.json --prefill 0 --batch 1 --context 128 $B --tp $tp 2>>"$OUT/speed.err" | tee -a "$OUT/speed.jsonl" | cut -c1-330
done
el "done"; tail -5 "$OUT/speed.err"
