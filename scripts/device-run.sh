#!/bin/bash
# What one `device` call runs on the lent GPU machine (binaries from scripts/cuda-check.sh,
# carried in .device/). Phases: check (kernels vs CPU, fixture tokens vs goldens), bench (our
# bench, fused and unfused), profile (ncu over one decode step / one prefill), peers; attn
# (attention benches with the tensor-core and the CUDA-core kernels, table by
# scripts/attn_table.py), attnab (batch-1 decode under each of ATTN_VARIANTS); the rest are
# listed in the case below. Outputs go to $OUT (or ./out).
#
#   bash scripts/device-run.sh check bench
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
for f in .device/*.xz; do [ -e "${f%.xz}" ] || xz -dk "$f"; done
chmod +x .device/kernel_check .device/bench_kernels .device/bench .device/generate .device/peer_ct .device/bench-old 2>/dev/null
source .device/device-env.sh
C=fixtures/real-configs
B=.device/bench
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
for phase in "$@"; do
  case $phase in
    check)
      .device/kernel_check > "$OUT/kernel-check.txt" 2>&1; echo "kernel_check exit $?"
      grep -E "FAIL" "$OUT/kernel-check.txt" | head -5
      sed -n '/^summary/,$p' "$OUT/kernel-check.txt"
      python3 scripts/gpu_tokens_check.py .device/generate > "$OUT/tokens-f32.txt" 2>&1; echo "tokens exit $?"
      tail -3 "$OUT/tokens-f32.txt"
      # The MoE fixture again with every forward through the sorted (prefill) expert path.
      CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=0 python3 scripts/gpu_tokens_check.py .device/generate > "$OUT/tokens-f32-moe-sorted.txt" 2>&1
      echo "tokens (MoE sorted path) exit $?"; tail -1 "$OUT/tokens-f32-moe-sorted.txt"
      ;;
    bench)
      for m in e2b e4b 26b-a4b; do
        $B --config $C/$m-config.json --prefill 512,4096 --batch 1,8,32 --context 128,4096 --steps 16 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | grep -v memory | cut -c1-160
      done
      $B --config $C/31b-config.json --prefill 512,4096 --batch 1,8 --context 128 --steps 8 \
        2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | cut -c1-160
      $B --config $C/31b-config.json --prefill 0 --batch 1 --context 4096 --steps 8 \
        2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl" | grep decode | cut -c1-160
      ;;
    unfused)
      for m in e4b 26b-a4b; do
        CANDLE_GEMMA_UNFUSED=1 $B --config $C/$m-config.json --prefill 4096 --batch 1,8 --context 128 --steps 16 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench-unfused.jsonl" | grep -v memory | cut -c1-160
      done
      ;;
    quant)
      for m in 31b 26b-a4b; do
        $B --config $C/$m-config.json --weights q4 --memory-only 2>>"$OUT/bench.err" | tee -a "$OUT/bench-q.jsonl"
      done
      for m in ${QUANT_MODELS:-e4b 26b-a4b 31b}; do
        $B --config $C/$m-config.json --weights q4,q8 --prefill 512 --batch 1,8 --context 128 --kv dense,q4 --steps 8 \
          2>>"$OUT/bench.err" | tee -a "$OUT/bench-q.jsonl" | cut -c1-160
      done
      ;;
    profile)
      NCU="ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE:-none} --metrics gpu__time_duration.sum --csv"
      for m in ${PROFILE_MODELS:-e2b e4b 26b-a4b 31b}; do
        $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128 --steps 16 2>>"$OUT/bench.err" >> "$OUT/bench.jsonl"
        $NCU --log-file "$OUT/ncu-$m-decode.csv" $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128 --steps 8 --profile \
          > "$OUT/prof-$m-decode.jsonl" 2>>"$OUT/bench.err"
        # Wall time of the same point from the bench phase (no profiler attached), else from this run.
        wall=$(python3 - "$OUT" "$m" <<'PY'
import json, sys, os
out, m = sys.argv[1], sys.argv[2]
def pick(path):
    if not os.path.exists(path):
        return None
    for l in open(path):
        if not l.startswith("{"):
            continue
        j = json.loads(l)
        if j.get("op") == "decode" and j.get("model") == m + "-config" and j.get("batch") == 1 and j.get("context") == 128 and j.get("weights", "bf16") == "bf16":
            return j["step_ms"]
print(pick(out + "/bench.jsonl") or pick(out + "/prof-" + m + "-decode.jsonl"))
PY
)
        python3 scripts/profile_summary.py "$OUT/ncu-$m-decode.csv" --wall-ms "$wall" --label "$m decode b=1 ctx=128" --top 12
      done
      [ -n "${PROFILE_PREFILL-1}" ] || continue
      $B --config $C/e4b-config.json --prefill 4096 --batch 0 2>>"$OUT/bench.err" | grep prefill > "$OUT/e4b-prefill-wall.jsonl"
      $NCU --log-file "$OUT/ncu-e4b-prefill.csv" $B --config $C/e4b-config.json --prefill 4096 --batch 0 --profile \
        > "$OUT/prof-e4b-prefill.jsonl" 2>>"$OUT/bench.err"
      wall=$(python3 -c "import json,sys; print([4096e3/json.loads(l)['tok_s'] for l in open(sys.argv[1]) if 'prefill' in l][0])" "$OUT/e4b-prefill-wall.jsonl")
      python3 scripts/profile_summary.py "$OUT/ncu-e4b-prefill.csv" --wall-ms "$wall" --label "e4b prefill 4096" --top 15
      ;;
    peers)
      [ -x .device/peer_ct ] && .device/peer_ct $C/e2b-config.json $C/e4b-config.json $C/31b-config.json \
        2>>"$OUT/peers.err" | tee -a "$OUT/peers.jsonl"
      python3 scripts/peers/transformers_bench.py $C/e2b-config.json $C/e4b-config.json $C/26b-a4b-config.json $C/31b-config.json \
        2>>"$OUT/peers.err" | tee -a "$OUT/peers.jsonl"
      ;;
    tokens)
      python3 scripts/gpu_tokens_check.py .device/generate > "$OUT/tokens-f32.txt" 2>&1; echo "tokens exit $?"; tail -1 "$OUT/tokens-f32.txt"
      CANDLE_GEMMA_MOE_GROUPED_MAX_TOKENS=0 python3 scripts/gpu_tokens_check.py .device/generate > "$OUT/tokens-f32-moe-sorted.txt" 2>&1
      echo "tokens (MoE sorted path) exit $?"; tail -1 "$OUT/tokens-f32-moe-sorted.txt"
      ;;
    compare)
      # GPU against CPU and GPU batch against GPU alone, same binary, f32 then bf16.
      python3 scripts/gpu_tokens_compare.py .device/generate f32 > "$OUT/tokens-compare-f32.txt" 2>&1
      echo "compare f32 exit $?"; tail -1 "$OUT/tokens-compare-f32.txt"
      python3 scripts/gpu_tokens_compare.py .device/generate bf16 > "$OUT/tokens-compare-bf16.txt" 2>&1
      echo "compare bf16 exit $?"; tail -1 "$OUT/tokens-compare-bf16.txt"
      ;;
    moe)
      $B --config $C/26b-a4b-config.json --prefill 512,4096 --batch 1,32 --context 128 --steps 8 \
        2>>"$OUT/bench.err" | tee -a "$OUT/bench-moe.jsonl" | cut -c1-160
      python3 scripts/peers/transformers_bench.py $C/26b-a4b-config.json 2>>"$OUT/peers.err" | tee -a "$OUT/peers-moe.jsonl"
      ;;
    table)
      python3 scripts/perf_table.py "$OUT/bench.jsonl" "$OUT/peers.jsonl" | tee "$OUT/table.md"
      ;;
    kcheck)
      .device/kernel_check > "$OUT/kernel-check.txt" 2>&1; echo "kernel_check exit $?"
      grep -E "FAIL" "$OUT/kernel-check.txt" | head -5
      sed -n '/^summary/,$p' "$OUT/kernel-check.txt"
      ;;
    matvec)
      # Quantized matvec only: the tensor-core kernel, then the SIMT one, same process layout.
      .device/bench_kernels --matmul-only > "$OUT/matvec.jsonl" 2>&1
      CANDLE_GEMMA_QMV=old .device/bench_kernels --matmul-only >> "$OUT/matvec.jsonl" 2>&1
      python3 - "$OUT/matvec.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.startswith("{"):
        continue
    j = json.loads(l)
    if j["bench"] == "copy":
        print("copy GB/s", j["gb_per_s"])
    elif j["rows"] <= 8:
        print(f'{j["kernel"]:11s} {j["shape"]:15s} rows={j["rows"]} {j["bits"]}-bit g{j["group"]:<3d} '
              f'{j["seconds"]*1e6:7.1f}us {j["gb_per_s"]:7.1f} GB/s {j["fraction_of_copy"]:.3f} of copy, '
              f'{j["speedup"]:.2f}x bf16')
PY
      ;;
    dense)
      .device/bench_kernels --dense-only > "$OUT/dense-matvec.jsonl" 2>&1
      python3 - "$OUT/dense-matvec.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.startswith("{"):
        print(l.rstrip()); continue
    j = json.loads(l)
    if j["bench"] == "copy":
        print("copy GB/s", j["gb_per_s"])
    elif j["bench"] == "gated_matvec":
        print(f'  gated {j["shape"]:12s} rows={j["rows"]} {j["gated_seconds"]*1e6:8.1f}us ({j["gated_fraction_of_copy"]:.3f} of copy); '
              f'gate then mma {j["gate_then_matvec_seconds"]*1e6:8.1f}us, gate then cublas {j["gate_then_cublas_seconds"]*1e6:8.1f}us')
    else:
        print(f'{j["shape"]:12s} rows={j["rows"]} mma {j["seconds"]*1e6:8.1f}us ({j["fraction_of_copy"]:.3f} of copy) '
              f'cublas {j["cublas_seconds"]*1e6:8.1f}us ({j["cublas_fraction_of_copy"]:.3f}) speedup {j["speedup"]:.2f}x')
PY
      ;;
    densevar)
      # The dense bench per CANDLE_GEMMA_DENSE_SV value (0: tensor-core kernel at one row).
      for v in ${DENSE_SV:-0 1 2 4}; do
        CANDLE_GEMMA_DENSE_SV=$v .device/bench_kernels --dense-only 2>&1 | sed "s/^{/{\"sv\":\"$v\",/" >> "$OUT/densevar.jsonl"
      done
      python3 - "$OUT/densevar.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    if not l.startswith("{"):
        continue
    j = json.loads(l)
    if j["bench"] == "dense_matvec" and j["rows"] == 1:
        print(f'sv={j["sv"]} {j["shape"]:14s} {j["seconds"]*1e6:8.1f}us {j["fraction_of_copy"]:.3f} of copy; cublas {j["cublas_fraction_of_copy"]:.3f}')
    elif j["bench"] == "gated_matvec" and j["rows"] == 1:
        print(f'sv={j["sv"]} gated {j["shape"]:8s} {j["gated_seconds"]*1e6:8.1f}us {j["gated_fraction_of_copy"]:.3f} of copy')
PY
      ;;
    ab)
      # Decode A/B, one process each: default, cuBLAS products, cudarc
      # event tracking kept, default again.
      for m in ${AB_MODELS:-e2b e4b 26b-a4b 31b}; do
        for v in ${AB_VARIANTS:-default CANDLE_GEMMA_DENSE_MV=cublas CANDLE_GEMMA_EVENT_TRACKING=1 default}; do
          echo "== $m $v"
          env $([ $v = default ] || echo $v) $B --config $C/$m-config.json --prefill 0 --batch ${AB_BATCH:-1,8} --context 128 --steps 16 \
            2>>"$OUT/bench.err" | sed "s/^{/{\"variant\":\"$v\",/" | tee -a "$OUT/ab.jsonl" | grep decode | cut -c1-200
        done
      done
      ;;
    gpuab)
      # GPU time of one decode step (ncu, no host noise) per variant: AB_MODELS x AB_VARIANTS.
      NCU="ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv"
      for m in ${AB_MODELS:-e4b 26b-a4b}; do
        for v in ${AB_VARIANTS:-default}; do
          env $([ $v = default ] || echo $v) $NCU --log-file "$OUT/gpuab.csv" $B --config $C/$m-config.json --prefill 0 --batch 1 \
            --context 128 --steps 2 --rounds 1 --profile > /dev/null 2>>"$OUT/bench.err"
          python3 scripts/profile_summary.py "$OUT/gpuab.csv" --label "$m $v" --top ${AB_TOP:-0}
          [ -n "${GPUAB_KEEP:-}" ] && cp "$OUT/gpuab.csv" "$OUT/gpuab-$m-$(echo $v | tr '=' '-').csv"
        done
      done
      rm -f "$OUT/gpuab.csv"
      ;;
    profile8)
      # One 31B decode step at batch 8 under ncu, against its wall time.
      NCU="ncu --profile-from-start off --clock-control none --cache-control ${NCU_CACHE:-none} --metrics gpu__time_duration.sum --csv"
      $B --config $C/31b-config.json --prefill 0 --batch 8 --context 128 --steps 16 2>>"$OUT/bench.err" | tee "$OUT/b8-wall.jsonl" | grep decode | cut -c1-160
      $NCU --log-file "$OUT/ncu-31b-decode-b8.csv" $B --config $C/31b-config.json --prefill 0 --batch 8 --context 128 --steps 8 --profile \
        > "$OUT/prof-31b-decode-b8.jsonl" 2>>"$OUT/bench.err"
      wall=$(python3 -c "import json,sys; print([json.loads(l)['step_ms'] for l in open(sys.argv[1]) if 'decode' in l][0])" "$OUT/b8-wall.jsonl")
      python3 scripts/profile_summary.py "$OUT/ncu-31b-decode-b8.csv" --wall-ms "$wall" --label "31b decode b=8 ctx=128" --top 15
      ;;
    qrow)
      # The row-contiguous 4-bit matvec (one activation row, on) against qmv_tc4 (off), or
      # QROW_VARIANTS: 4-bit rows=1 points of bench_kernels --matmul-only.
      for v in ${QROW_VARIANTS:-off on}; do
        CANDLE_GEMMA_QROW=$v .device/bench_kernels --matmul-only 2>&1 | grep -E '"bits":4|"copy"' | grep -E '"rows":1,|"copy"' | sed "s/^{/{\"variant\":\"$v\",/" >> "$OUT/qrow.jsonl"
      done
      python3 - "$OUT/qrow.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    if j.get("bench") == "qmatmul":
        print(f'{j["variant"]:>4} {j["kernel"]:>20} {j["shape"]:>15} g{j["group"]:<4} {j["seconds"]*1e6:7.1f}us {j["fraction_of_copy"]:.3f}')
PY
      ;;
    qsplit)
      # qmv_row4 variants (4-bit, one row), QSPLIT_ROUNDS rounds of QSPLIT_VARIANTS
      # (split:steps; split auto = row_matvec_split_for, else warps a row pair; steps 1 or 2
      # loads before their math), then the median per variant and point.
      for r in $(seq ${QSPLIT_ROUNDS:-2}); do
        for v in ${QSPLIT_VARIANTS:-auto:2 auto:1 1:2 2:2}; do
          IFS=: read sp st <<< "$v"
          env $([ $sp = auto ] || echo CANDLE_GEMMA_QROW_SPLIT=$sp) $([ $st = auto ] || echo CANDLE_GEMMA_QROW_STEPS=$st) \
            .device/bench_kernels --matmul-only 2>&1 \
            | grep -E '"bits":4|"copy"' | grep -E '"rows":1,|"copy"' \
            | sed "s/^{/{\"variant\":\"$v\",/" >> "$OUT/qsplit.jsonl"
        done
      done
      python3 - "$OUT/qsplit.jsonl" <<'PY'
import json, statistics, sys
from collections import defaultdict
pts = defaultdict(list)
for l in open(sys.argv[1]):
    j = json.loads(l)
    if j.get("bench") == "qmatmul":
        pts[(j["variant"], j["shape"], j["group"])].append((j["seconds"], j["fraction_of_copy"]))
    else:
        print(f'{j["variant"]:>10} copy {j["gb_per_s"]} GB/s')
print("split:steps  shape  group  median us  median share of copy  (runs)")
for (v, sh, g), x in sorted(pts.items(), key=lambda k: (k[0][1], k[0][2], k[0][0])):
    print(f'{v:>10} {sh:>15} g{g:<4} {statistics.median(a for a, _ in x)*1e6:7.2f}us {statistics.median(b for _, b in x):.3f} ({len(x)})')
PY
      ;;
    qmvgpu)
      # GPU time (ncu, caches flushed before each launch) of the one-row 4-bit matvec at each
      # bench_kernels --matmul-only point, against the copy bandwidth of a plain run.
      copy=$(.device/bench_kernels --matmul-only 2>&1 | grep '"copy"' | sed 's/.*gb_per_s":\([0-9.]*\).*/\1/')
      BENCH_KERNELS_ONCE=1 ncu --clock-control none --cache-control all -k "regex:qmv_row4" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv .device/bench_kernels --matmul-only \
        > "$OUT/qmvgpu.csv" 2>&1; echo "ncu exit $?"
      python3 - "$OUT/qmvgpu.csv" "$copy" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
ix = {h: i for i, h in enumerate(head)}
vals = {}
for r in rows:
    unit = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3,
            "msecond": 1e-3, "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9,
            "KB": 1e3, "MB": 1e6, "GB": 1e9}.get(r[ix["Metric Unit"]], 1)
    vals.setdefault(r[ix["ID"]], {})[r[ix["Metric Name"]]] = float(r[ix["Metric Value"]].replace(",", "")) * unit
shapes = [("q_proj_sliding", 8192, 5376), ("mlp_gate_up", 21504, 5376), ("mlp_down", 5376, 21504), ("e4b_mlp_down", 2560, 10240)]
points = [(s, o, i, g) for s, o, i in shapes for g in (32, 64, 128)]
copy = float(sys.argv[2])
print(f"copy {copy} GB/s (bench_kernels, same machine)")
for (s, o, i, g), (k, v) in zip(points, sorted(vals.items(), key=lambda kv: int(kv[0]))):
    b = o * i // 2 + 2 * o * (i // g) * 2
    t = v["gpu__time_duration.sum"]
    print(f"{s:>15} g{g:<4} {t*1e6:7.2f}us  {b/t/1e9:7.1f} GB/s  {b/t/1e9/copy:.3f} of copy  dram read {v['dram__bytes_read.sum']/b:.3f}x packed")
PY
      ;;
    qrowe2e)
      # Batch-1 decode with 4-bit weights (E2E_MODELS, context 4096) under each E2E_VARIANTS
      # CANDLE_GEMMA_QROW_STEPS (default: 1, 2, unset = the launcher's choice), E2E_ROUNDS
      # interleaved rounds.
      for r in $(seq ${E2E_ROUNDS:-2}); do
        for v in ${E2E_VARIANTS:-1 2 default}; do
          for m in ${E2E_MODELS:-e4b 31b}; do
            env $([ $v = default ] || echo CANDLE_GEMMA_QROW_STEPS=$v) $B --config $C/$m-config.json \
              --weights q4 --prefill 0 --batch 1 --context 4096 2>/dev/null | grep '"decode"' \
              | sed "s/^{/{\"variant\":\"steps=$v\",\"model\":\"$m\",/" >> "$OUT/qrowe2e.jsonl"
          done
        done
      done
      python3 - "$OUT/qrowe2e.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    print(j["variant"], j["model"], {k: v for k, v in j.items() if "tok" in k})
PY
      ;;
    qtc)
      # The 4-bit dequantize-then-mma matvec, uncapped registers and capped for 4 blocks an SM.
      for v in 1 2 4; do
        CANDLE_GEMMA_QTC_BLOCKS=$v .device/bench_kernels --matmul-only 2>&1 | grep '"bits":4' | grep -v '"rows":512' | sed "s/^{/{\"variant\":\"$v\",/" >> "$OUT/qtc.jsonl"
      done
      python3 - "$OUT/qtc.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    j = json.loads(l)
    print(f'{j["variant"]} {j["shape"]:15s} rows={j["rows"]} g{j["group"]:<3d} {j["seconds"]*1e6:6.1f}us {j["fraction_of_copy"]:.3f}')
PY
      ;;
    kdetail)
      # ncu sections (throughput, occupancy, stalls) for one launch of each kernel matching
      # KDETAIL_KERNELS at each bench_kernels point (BENCH_KERNELS_ONCE: one call a point).
      for a in ${KDETAIL_ARGS:-all --dense-only}; do
        BENCH_KERNELS_ONCE=1 ncu --clock-control none --cache-control all \
          -k "regex:${KDETAIL_KERNELS:-qmv_tc4|dense_mv|qsdpa}" \
          --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page details \
          --log-file "$OUT/kdetail$a.csv" .device/bench_kernels $([ $a = all ] || echo $a) >> "$OUT/kdetail-bench.txt" 2>&1
        echo "kdetail $a exit $?"; wc -l "$OUT/kdetail$a.csv"; xz -9 "$OUT/kdetail$a.csv"
      done
      ;;
    normdetail)
      # ncu sections for the first folded-norm products of one E4B decode step.
      C2=$C; ncu --profile-from-start off --clock-control none --cache-control none -k "regex:${ND_KERNELS:-dense_mv_norm|dense_mv_gated_norm}" -c ${ND_COUNT:-6} \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --csv --page details --log-file "$OUT/normdetail.csv" $B --config $C2/${ND_MODEL:-e4b}-config.json --prefill 0 --batch 1 \
        --context 128 --steps 2 --rounds 1 --profile > /dev/null 2>>"$OUT/bench.err"
      echo "normdetail exit $?"
      ;;
    floor)
      # Fixed cost of one small kernel: host enqueue and GPU time per launch (2560 bf16 elements).
      .device/bench_kernels --launch-floor 2>&1 | tee "$OUT/launch-floor.jsonl"
      ;;
    attn)
      # Attention benches with the tensor-core kernel (default) and with the CUDA-core one.
      .device/bench_kernels --attention-only > "$OUT/attn-tc.jsonl" 2>&1; echo "tc exit $?"
      CANDLE_GEMMA_QSDPA_TC=0 .device/bench_kernels --attention-only > "$OUT/attn-simt.jsonl" 2>&1
      echo "simt exit $?"
      python3 scripts/attn_table.py "$OUT/attn-tc.jsonl" "$OUT/attn-simt.jsonl"
      ;;
    attnrot)
      # Decode attention with K/V copies rotated past L2 (the default), ATTN_RUNS runs, and one
      # run with a single copy a point (--l2-resident, as the sessions before the fourteenth).
      for r in $(seq ${ATTN_RUNS:-3}); do
        .device/bench_kernels --attention-only > "$OUT/attn-rot-$r.jsonl" 2>&1; echo "run $r exit $?"
      done
      .device/bench_kernels --attention-only --l2-resident > "$OUT/attn-l2.jsonl" 2>&1
      python3 scripts/attn_runs_table.py "$OUT"/attn-rot-*.jsonl
      python3 scripts/attn_runs_table.py "$OUT/attn-l2.jsonl"
      ;;
    kvq)
      # Quantized KV cache: greedy ids on the GPU against the CPU (same binary) and against the
      # GPU's quantize-and-copy path, then batch-1 decode at context 4096 (KVQ_MODELS) with
      # dense/q4/q8 caches, slots written in place against CANDLE_GEMMA_KVQ_IN_PLACE=0, in turn.
      python3 scripts/gpu_kvq_check.py .device/generate > "$OUT/kvq-ids.txt" 2>&1; echo "kvq ids exit $?"
      tail -1 "$OUT/kvq-ids.txt"
      for round in 1 2; do
        for inplace in 1 0; do
          for m in ${KVQ_MODELS:-e2b e4b}; do
            CANDLE_GEMMA_KVQ_IN_PLACE=$inplace $B --config $C/$m-config.json --prefill 0 --batch 1 \
              --context 4096 --steps 16 --kv dense,q4,q8 2>>"$OUT/bench.err" | grep decode \
              | sed "s/^{/{\"in_place\":$inplace,/" >> "$OUT/kvq-decode.jsonl"
          done
        done
      done
      python3 scripts/decode_ab_table.py "$OUT/kvq-decode.jsonl" in_place
      ;;
    attngpu)
      # GPU time of every attention launch (ncu, one call a point, --quick: 1k and 32k keys),
      # then ncu sections for the tensor-core kernel's launches at 32k keys.
      BENCH_KERNELS_ONCE=1 ncu --clock-control none --cache-control none -k "regex:qsdpa" \
        --metrics gpu__time_duration.sum --csv --log-file "$OUT/attn-gpu.csv" \
        .device/bench_kernels --attention-only --quick > "$OUT/attn-gpu-bench.jsonl" 2>&1
      echo "attngpu exit $?"; wc -l "$OUT/attn-gpu.csv"
      [ -n "${ATTN_SECTIONS:-}" ] || continue
      BENCH_KERNELS_ONCE=1 ncu --clock-control none --cache-control all -k "regex:qsdpa_tc" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats --csv --page details \
        --log-file "$OUT/attn-detail.csv" .device/bench_kernels --attention-only --quick > /dev/null 2>&1
      echo "attn detail exit $?"; wc -l "$OUT/attn-detail.csv"
      ;;
    combineab)
      # Split-combine block size, same machine: ncu GPU time of every attention launch (--quick)
      # and the wall-time attention bench, by split count (default) and fixed at 8 and 32 warps,
      # twice each in turn.
      for round in 1 2; do
        for w in default 8 32; do
          e=$([ $w = default ] || echo CANDLE_GEMMA_COMBINE_WARPS=$w)
          env $e BENCH_KERNELS_ONCE=1 ncu --clock-control none --cache-control none -k "regex:qsdpa" \
            --metrics gpu__time_duration.sum --csv --log-file "$OUT/combine-$w-$round.csv" \
            .device/bench_kernels --attention-only --quick > /dev/null 2>&1
          env $e .device/bench_kernels --attention-only > "$OUT/combine-$w-$round.jsonl" 2>&1
          echo "combine warps $w round $round exit $?"
        done
      done
      ;;
    combinegpu)
      # GPU time of every attention launch (ncu, --quick) with the split combine of this build
      # and with the previous one (CANDLE_GEMMA_COMBINE=rows); tables by attn_gpu_table.py.
      for v in default rows; do
        env $([ $v = default ] || echo CANDLE_GEMMA_COMBINE=$v) BENCH_KERNELS_ONCE=1 ncu \
          --clock-control none --cache-control none -k "regex:qsdpa" --metrics gpu__time_duration.sum \
          --csv --log-file "$OUT/combine-gpu-$v.csv" .device/bench_kernels --attention-only --quick \
          > /dev/null 2>&1; echo "combine $v exit $?"
        python3 scripts/attn_gpu_table.py "$OUT/combine-gpu-$v.csv" > "$OUT/combine-gpu-$v.md" 2>&1
      done
      ;;
    graphscratch)
      # Graph replays after eager launches that replaced scratch buffers (see the script).
      python3 scripts/gpu_graph_scratch_check.py .device/bench ${ROUNDS:-4} > "$OUT/graph-scratch.txt" 2>&1
      echo "graph scratch exit $?"; tail -1 "$OUT/graph-scratch.txt"
      ;;
    attnq)
      # Decode and prefill attention at 1k-128k keys, ROUNDS runs; the decode table (GPU-only
      # `queued_seconds` with the wall-clock ratios) by scripts/attn_queued_table.py.
      for r in $(seq ${ROUNDS:-2}); do
        .device/bench_kernels --attention-only > "$OUT/attn-final-$r.jsonl" 2>&1; echo "attention round $r exit $?"
      done
      python3 scripts/attn_queued_table.py "$OUT"/attn-final-*.jsonl | tee "$OUT/attn-final-table.md"
      ;;
    attnvar)
      # Decode attention (--quick: 1k and 32k keys) under each of ATTN_VARIANTS (env settings
      # joined by '+'), alternating, ROUNDS rounds; table by scripts/attn_variants_table.py.
      for r in $(seq ${ROUNDS:-2}); do
        for v in ${ATTN_VARIANTS:-default}; do
          env $([ $v = default ] || echo $v | tr '+' ' ') .device/bench_kernels --attention-only --quick \
            > "$OUT/attnvar-$(echo $v | tr "=+" "__")-$r.jsonl" 2>&1; echo "$v round $r exit $?"
        done
      done
      python3 scripts/attn_variants_table.py "$OUT"/attnvar-*.jsonl
      ;;
    attnab)
      # Batch-1 decode at context 128 with the attention variants in ATTN_VARIANTS.
      for m in ${AB_MODELS:-e2b e4b}; do
        for v in ${ATTN_VARIANTS:-default CANDLE_GEMMA_QSDPA_TC=0}; do
          echo "$m $v"
          env $([ $v = default ] || echo $v) $B --config $C/$m-config.json --prefill 0 --batch 1 \
            --context 128 --steps 16 2>>"$OUT/bench.err" | tee -a "$OUT/attnab.jsonl" | cut -c1-160
        done
      done
      ;;
    coldstart)
      # Wall time of a short E2B bench process with the driver's compile cache off, so every
      # PTX module is compiled at load: .device/bench-old (a build that embeds PTX only, when
      # carried) against .device/bench (fatbins with machine code), then .device/bench with the
      # cache on (candle's own PTX modules compiled once before).
      run_wall() {
        local s e; s=$(date +%s.%N)
        env "$@" --config $C/e2b-config.json --prefill 0 --batch 1 --context 128 --steps 4 --rounds 1 > /dev/null 2>>"$OUT/bench.err"
        e=$(date +%s.%N); python3 -c "print(round($e - $s, 2))"
      }
      for b in bench-old bench; do
        [ -x .device/$b ] || continue
        for i in 1 2; do
          echo "{\"binary\":\"$b\",\"compile_cache\":\"off\",\"run\":$i,\"wall_s\":$(run_wall CUDA_CACHE_DISABLE=1 .device/$b)}" | tee -a "$OUT/coldstart.jsonl"
        done
      done
      for i in 1 2; do
        echo "{\"binary\":\"bench\",\"compile_cache\":\"on\",\"run\":$i,\"wall_s\":$(run_wall CUDA_CACHE_DISABLE=0 .device/bench)}" | tee -a "$OUT/coldstart.jsonl"
      done
      ;;
    experts)
      .device/bench_kernels --experts 2>&1 | tee "$OUT/grouped-experts.jsonl" | cut -c1-220
      ;;
    gmv)
      # The packed grouped expert matvec: its kernel checks, the kernel bench, and 26B-A4B
      # 4-bit decode. (Its variants were compared with CANDLE_GEMMA_GMV in the tenth session.)
      .device/kernel_check > "$OUT/kernel-check.txt" 2>&1
      echo "kernel_check exit $?: $(grep -c 'grouped_qmatvec.*PASS' "$OUT/kernel-check.txt") grouped PASS, $(grep -c FAIL "$OUT/kernel-check.txt") FAIL"
      .device/bench_kernels --experts 2>&1 | grep grouped_experts | tee -a "$OUT/grouped-experts.jsonl" | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d['shape'],d['bits'],d['group'],round(d['seconds']*1e6,1),'us',d['fraction_of_copy'],'bf16',round(d['bf16_seconds']*1e6,1))"
      $B --config $C/26b-a4b-config.json --weights q4 --prefill 0 --batch 1,8 --context 128 --steps 32 --rounds 3 \
        2>>"$OUT/bench.err" | grep decode | tee -a "$OUT/gmv-decode.jsonl" | cut -c1-200
      ;;
    packedfold)
      # The packed product with its add + norm folded in: kernel checks, bf16 fixture tokens
      # with the fold and without (CANDLE_GEMMA_PACKED_FOLD=0), and 4-bit decode A/B.
      .device/kernel_check > "$OUT/kernel-check.txt" 2>&1; echo "kernel_check exit $?"
      grep -E "packed_matvec_add_norm" "$OUT/kernel-check.txt" | tail -4; sed -n '/^summary/,$p' "$OUT/kernel-check.txt" | grep -E "packed_matvec|ALL|FAIL"
      python3 scripts/gpu_tokens_check.py .device/generate bf16 > "$OUT/tokens-bf16-fold.txt" 2>&1
      CANDLE_GEMMA_PACKED_FOLD=0 python3 scripts/gpu_tokens_check.py .device/generate bf16 > "$OUT/tokens-bf16-nofold.txt" 2>&1
      tail -1 "$OUT/tokens-bf16-fold.txt"; tail -1 "$OUT/tokens-bf16-nofold.txt"
      if diff <(grep fixture "$OUT/tokens-bf16-fold.txt") <(grep fixture "$OUT/tokens-bf16-nofold.txt") > /dev/null; then echo "bf16 tokens: fold = no fold"; else echo "bf16 tokens DIFFER with the fold"; fi
      for m in ${FOLD_MODELS:-e4b 26b-a4b 31b}; do
        for v in 1 0 1 0; do
          CANDLE_GEMMA_PACKED_FOLD=$v CANDLE_GEMMA_LAUNCH_STATS=1 $B --config $C/$m-config.json --weights q4 --prefill 0 --batch 1 --context 128 --steps 32 --rounds 3 \
            2>>"$OUT/bench.err" | grep decode | sed "s/^{/{\"packed_fold\":$v,/" | tee -a "$OUT/packed-fold.jsonl" | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d['model'],'fold',d['packed_fold'],round(d['tok_s'],1),'tok/s step',round(d['step_ms'],3),'host',round(d['host_ms'],3),'launches',d['launch_stats'] and round(d['launch_stats']['launches_per_step'],1))"
        done
      done
      ;;
    decodeb1)
      # Batch-1 decode, bf16 weights, context 128 and 4096, three rounds a point.
      for m in ${DECODE_MODELS:-e2b e4b 26b-a4b}; do
        $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128,4096 --steps 32 --rounds 3 \
          2>>"$OUT/bench.err" | grep decode | tee -a "$OUT/decode-b1.jsonl" | cut -c1-200
      done
      ;;
    graph)
      # Batch-1 decode with CUDA graphs (default) and without (CANDLE_GEMMA_CUDA_GRAPH=0),
      # alternating; then every fixture's bf16 greedy ids with and without graphs (they must be
      # identical: the replayed kernels are the captured ones).
      for m in ${GRAPH_MODELS:-e2b e4b 26b-a4b}; do
        for v in 1 0 1 0; do
          CANDLE_GEMMA_CUDA_GRAPH=$v $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128,4096 --steps 32 --rounds 3 \
            2>>"$OUT/bench.err" | grep decode | sed "s/^{/{\"graph_env\":$v,/" | tee -a "$OUT/graph-ab.jsonl" | cut -c1-260
        done
      done
      python3 scripts/gpu_tokens_check.py .device/generate bf16 > "$OUT/tokens-bf16-graph.txt" 2>&1
      CANDLE_GEMMA_CUDA_GRAPH=0 python3 scripts/gpu_tokens_check.py .device/generate bf16 > "$OUT/tokens-bf16-nograph.txt" 2>&1
      if diff <(grep -o '"ids".*' "$OUT/tokens-bf16-graph.txt") <(grep -o '"ids".*' "$OUT/tokens-bf16-nograph.txt") >/dev/null; then
        echo "bf16 fixture ids: graph == no graph ($(grep -c '"ids"' "$OUT/tokens-bf16-graph.txt") cases)"
      else
        echo "bf16 fixture ids DIFFER with and without graphs"
      fi
      # Long runs (rings wrap, simple caches grow during replays), graphs on and off.
      for kv in simple rotating; do
        for v in 1 0; do
          CANDLE_GEMMA_CUDA_GRAPH=$v .device/generate --model fixtures/e2b-hf --prompt-ids 2,100,200,300 \
            --max-tokens 600 --ignore-eos --json --dtype bf16 --kv-cache $kv 2>>"$OUT/bench.err" | tail -1 \
            | python3 -c "import json,sys; print(json.load(sys.stdin)['sequences'][0]['ids'])" > "$OUT/long-$kv-$v.txt"
        done
        cmp -s "$OUT/long-$kv-1.txt" "$OUT/long-$kv-0.txt" && echo "600 tokens, $kv cache: graph == no graph" \
          || echo "600 tokens, $kv cache: DIFFER"
      done
      ;;
    kvqbatch)
      # Batches of several sequences: one K/V write launch for all sequences (packed caches:
      # one quantize launch; dense caches: one copy launch) against one per sequence
      # (CANDLE_GEMMA_BATCH_KV_LAUNCH=0). Greedy ids of a 3-prompt batch from the fixtures
      # (must be identical), then batch-8 decode (BATCH_KV: dense,q4 by default), in turn.
      for fx in e2b-kvq e4b-text; do
        for kv in q4 q8 simple rotating; do
          case $kv in
            q4) flags="--kv-cache quantized --kv-bits 4 --kv-group-size 32" ;;
            q8) flags="--kv-cache quantized --kv-bits 8 --kv-group-size 32" ;;
            *) flags="--kv-cache $kv" ;;
          esac
          for v in 1 0; do
            CANDLE_GEMMA_BATCH_KV_LAUNCH=$v .device/generate --model fixtures/$fx --prompt-ids 2,100,200,300 \
              --prompt-ids 2,17,40,41,42,43,44,45,46,47 --prompt-ids 2,9 --max-tokens 40 --ignore-eos --json \
              --dtype f32 $flags 2>>"$OUT/bench.err" | tail -1 \
              | python3 -c "import json,sys; print([s['ids'] for s in json.load(sys.stdin)['sequences']])" > "$OUT/kvbatch-$fx-$kv-$v.txt"
          done
          cmp -s "$OUT/kvbatch-$fx-$kv-1.txt" "$OUT/kvbatch-$fx-$kv-0.txt" && echo "$fx $kv batch of 3: one launch == per sequence" \
            || echo "$fx $kv batch of 3: DIFFER"
        done
      done
      for round in 1 2; do
        for v in 1 0; do
          for m in ${KVQ_MODELS:-e2b e4b}; do
            CANDLE_GEMMA_BATCH_KV_LAUNCH=$v $B --config $C/$m-config.json --prefill 0 --batch 8 \
              --context 4096 --steps 16 --kv ${BATCH_KV:-dense,q4} 2>>"$OUT/bench.err" | grep decode \
              | sed "s/^{/{\"batch_launch\":$v,/" >> "$OUT/kvbatch-decode.jsonl"
          done
        done
      done
      python3 scripts/decode_ab_table.py "$OUT/kvbatch-decode.jsonl" batch_launch
      ;;
    graphkvq)
      # Quantized KV caches under CUDA graphs: fixture ids with graphs on and off (identical,
      # every graph run captured), then batch-1 decode at context 4096 (KVQ_MODELS) with dense,
      # q4 and q8 caches, graphs on and off, in turn.
      python3 scripts/gpu_graph_kvq_check.py .device/generate > "$OUT/graph-kvq-ids.txt" 2>&1; echo "graph kvq ids exit $?"
      tail -1 "$OUT/graph-kvq-ids.txt"
      for round in 1 2; do
        for v in 1 0; do
          for m in ${KVQ_MODELS:-e2b e4b}; do
            CANDLE_GEMMA_CUDA_GRAPH=$v $B --config $C/$m-config.json --prefill 0 --batch 1 \
              --context 4096 --steps 16 --kv dense,q4,q8 2>>"$OUT/bench.err" | grep decode \
              | sed "s/^{/{\"graph_env\":$v,/" >> "$OUT/graph-kvq-decode.jsonl"
          done
        done
      done
      python3 scripts/decode_ab_table.py "$OUT/graph-kvq-decode.jsonl" graph_env
      ;;
    graphq)
      # Batch-1 decode of 4-bit and 8-bit weights with CUDA graphs (default) and without.
      for m in ${GRAPH_MODELS:-e2b e4b 31b}; do
        for v in 1 0; do
          CANDLE_GEMMA_CUDA_GRAPH=$v $B --config $C/$m-config.json --weights q4,q8 --prefill 0 --batch 1 --context 128 --steps 32 --rounds 3 \
            2>>"$OUT/bench.err" | grep decode | sed "s/^{/{\"graph_env\":$v,/" | tee -a "$OUT/graph-q.jsonl" | cut -c1-260
        done
      done
      ;;
    scratchab)
      # Batch-1 decode with the per-thread scratch buffers (default) and with a fresh buffer a
      # launch (CANDLE_GEMMA_SCRATCH=0), alternating, three runs each.
      for m in ${AB_MODELS:-e2b e4b}; do
        for v in 1 0 1 0 1 0; do
          CANDLE_GEMMA_SCRATCH=$v $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128 --steps 32 --rounds 3 \
            2>>"$OUT/bench.err" | grep decode | sed "s/^{/{\"scratch\":$v,/" | tee -a "$OUT/scratch-ab.jsonl" | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d['model'],'scratch',d['scratch'],round(d['tok_s'],1),'tok/s step',round(d['step_ms'],3),'host',round(d['host_ms'],3))"
        done
      done
      ;;
    hostsample)
      # Where the host's time goes during batch-1 decode: cuda-gdb attaches to a running bench
      # and prints the main thread's stack, SAMPLES times (there is no perf on these machines).
      m=${SAMPLE_MODEL:-e2b}
      $B --config $C/$m-config.json --prefill 0 --batch 1 --context 128 --steps ${SAMPLE_STEPS:-6000} \
        --rounds 1 > "$OUT/hostsample-bench.jsonl" 2>>"$OUT/bench.err" &
      pid=$!
      sleep ${SAMPLE_WARMUP:-20}
      for i in $(seq ${SAMPLES:-40}); do
        kill -0 $pid 2>/dev/null || break
        echo "=== sample $i"
        timeout 20 cuda-gdb -q -batch -p $pid -ex "set pagination off" -ex "bt 60" 2>&1 | grep -E "^#" | sed -E 's/ \(.*//; s/0x[0-9a-f]+ in //'
      done > "$OUT/hostsample-$m.txt"
      kill $pid 2>/dev/null; wait $pid 2>/dev/null
      grep -c "=== sample" "$OUT/hostsample-$m.txt"
      ;;
    kernels)
      .device/bench_kernels > "$OUT/bench-kernels.txt" 2>&1; tail -40 "$OUT/bench-kernels.txt"
      ;;
  esac
done
