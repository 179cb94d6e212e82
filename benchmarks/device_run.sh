#!/usr/bin/env bash
# One device-machine session: environment, GPU tests, GEMM and EP benchmarks; logs in $OUT.
# Usage (from the repo root on the GPU machine): bash benchmarks/device_run.sh [steps]
# steps: comma list of env,test,run,gemm,quant,ep,trace,sweep,layer,probe,ncu,ab (default env,test,gemm,ep)
# AB_BASE=<commit> AB_ARGS="<moestream bench arguments>": the ab step runs them base, new, new, base
#   (benchmarks/ab_commits.py; prepare the commit on the CPU machine and carry benchmarks/.ab);
#   AB_BASE_ARGS: the base's own bench arguments where its CLI predates the current options
# GEMM_VARIANTS: the gemm step's variants (moestream.tools.bench_kernels.VARIANTS; default
#   layer-call, what the layer runs in bf16; fp8-layer-call in fp8)
# CLOCKS=500: log SM clocks, power and temperature every 500 ms to $OUT/clocks.csv
# TRACE_TUNING=l1.block_n=128: the trace step with Tuning overrides (dotted names) (moestream trace --tuning)
# TRACE_ARGS="--virtual-ranks 2 --experts 32": further moestream trace arguments
# EP_SKEW=0.3: the ep step with a hot expert (moestream bench --skew)
set -u
OUT=${OUT:-/tmp/moestream-out}
mkdir -p "$OUT"
STEPS=${1:-env,test,gemm,ep}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if [ -n "${CLOCKS:-}" ]; then
  # SM clock, power and temperature of every GPU every CLOCKS ms while the steps run (are
  # long GEMM-bound calls power-capped below the clock the short calibration runs see?)
  nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms "$CLOCKS" > "$OUT/clocks.csv" 2>&1 &
  CLOCKS_PID=$!
  trap 'kill $CLOCKS_PID 2>/dev/null' EXIT
fi
if has env; then
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.txt"
  nvidia-smi topo -m 2>&1 | tee -a "$OUT/env.txt"
  python3 -m moestream.tools.cli check 2>&1 | tee -a "$OUT/env.txt"
fi
if has test; then
  # TEST_WORKERS=8: pytest-xdist workers sharing the GPU (the device has 16 cores; most of a
  # GPU test's time is its kernels' compile, on the CPU)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m "gpu or multigpu" ${TESTS:-tests} -p no:cacheprovider \
    ${TEST_WORKERS:+-n $TEST_WORKERS} --timeout 240 --durations=25 2>&1 | tee "$OUT/test_gpu.log" | tail -40
fi
if has run; then
  timeout ${RUN_TIMEOUT:-120} python3 -m moestream.tools.cli run 2>&1 | tee "$OUT/run.log" | tail -15
fi
if has gemm; then
  timeout ${GEMM_TIMEOUT:-240} python3 -m moestream.tools.cli bench --virtual-ranks ${GEMM_R:-1} --shapes ${GEMM_SHAPES:-dsv3,qwen3} \
    --tokens-per-expert ${GEMM_M:-16,128,512,2048} --variants ${GEMM_VARIANTS:-layer-call} \
    ${GEMM_EXPERTS:+--experts-per-rank $GEMM_EXPERTS} \
    --out "$OUT/gemm_h200.jsonl" 2>&1 | tee "$OUT/gemm.log" | tail -80
fi
if has quant; then
  timeout ${QUANT_TIMEOUT:-240} python3 benchmarks/quant_gemm.py --shapes ${QUANT_SHAPES:-dsv3,qwen3} \
    --tokens-per-expert ${QUANT_M:-16,128,2048} ${QUANT_CONFIGS:+--fp4w-configs $QUANT_CONFIGS} \
    --out "$OUT/quant_gemm.jsonl" 2>&1 | tee "$OUT/quant.log" | tail -60
fi
if has ep; then
  MOESTREAM_EP_PARTIAL="$OUT/ep_partial.jsonl" timeout ${EP_TIMEOUT:-200} python3 -m moestream.tools.cli bench --shapes ${EP_SHAPES:-dsv3,qwen3} \
    --tokens ${EP_TOKENS:-1,128,2048,8192} ${EP_DTYPE:+--dtype $EP_DTYPE} ${EP_IMPL:+--impl $EP_IMPL} \
    ${EP_TUNING:+--tuning $EP_TUNING} ${EP_BLOCK_M:+--block-m $EP_BLOCK_M} ${EP_SKEW:+--skew $EP_SKEW} \
    --out "$OUT/ep_h200x2.jsonl" --plot "$OUT/ep_h200x2.png" \
    2>&1 | tee "$OUT/ep.log" | tail -40
fi
if has trace; then
  for spec in ${TRACES:-qwen3:8192:token dsv3:2048:token}; do
    IFS=: read -r shape tokens gran <<< "$spec"
    timeout ${TRACE_TIMEOUT:-120} python3 -m moestream.tools.cli trace --shape $shape --tokens $tokens \
      --granularity $gran ${TRACE_TUNING:+--tuning $TRACE_TUNING} ${TRACE_ARGS:-} --out "$OUT/trace_${shape}_${tokens}_${gran}.png" \
      --json "$OUT/trace_${shape}_${tokens}_${gran}.json" 2>&1 | tee -a "$OUT/trace.log" | tail -12
  done
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-200} python3 benchmarks/fused_sweep.py --shapes ${SWEEP_SHAPES:-qwen3,dsv3} \
    --tokens ${SWEEP_TOKENS:-128,8192} ${SWEEP_VARIANTS:+--variants $SWEEP_VARIANTS} \
    --out "$OUT/fused_sweep.jsonl" 2>&1 | tee "$OUT/sweep.log" | tail -30
fi
if has layer; then
  timeout ${LAYER_TIMEOUT:-170} python3 -m moestream.tools.cli bench-layer ${LAYER_ARGS:-} \
    --out "$OUT/layer_h200x2.jsonl" --plot "$OUT/layer_h200x2.png" 2>&1 | tee "$OUT/layer.log" | tail -30
fi
if has probe; then
  timeout ${PROBE_TIMEOUT:-120} python3 -m moestream.tools.cli probe ${PROBE_ARGS:---quick} \
    --out "$OUT/calib_probe.json" 2>&1 | tee "$OUT/probe.log" | tail -30
fi
if has ab; then
  timeout ${AB_TIMEOUT:-300} python3 benchmarks/ab_commits.py run --base "$AB_BASE" \
    --timeout ${AB_RUN_TIMEOUT:-120} --out "$OUT/ab${AB_TAG:-}.jsonl" \
    ${AB_BASE_ARGS:+--base-args "$AB_BASE_ARGS"} -- $AB_ARGS 2>&1 | tee "$OUT/ab${AB_TAG:-}.log" | tail -30
fi
if has ncu; then
  # Nsight Compute counters of single GEMM launches (one process per NCU_CONFIGS item
  # shape:M:variant, the L1 and the L2 launch after the bench's 5 warm-up calls; "torch" as the
  # variant profiles two of torch._grouped_mm's launches instead: its prepare_grouped_gemm_data
  # kernel and its L1 GEMM). Clocks stay as they are (--clock-control none: the clocks the
  # benchmarks run at). Reports: $OUT/ncu_<item>.csv (raw page).
  NCU=${NCU_BIN:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
  echo "ncu: $NCU" | tee "$OUT/ncu.log"
  "$NCU" --query-metrics --chip gh100 2>&1 | grep -i -E 'gmma|tensor|lts__t_(bytes|sectors)' > "$OUT/ncu_metrics_tensor.txt"
  for item in ${NCU_CONFIGS:-dsv3:2048:layer-call dsv3:2048:fp8-layer-call}; do
    IFS=: read -r shape m variant <<< "$item"
    if [ "$variant" = torch ]; then
      filt=(--kernel-name-base mangled -k regex:cutlass --launch-skip 6 --launch-count 2); vargs=(--variants layer-call)
    else
      filt=(-k "regex:^l[12]_kernel" --launch-skip 5 --launch-count 2); vargs=(--variants "$variant")
    fi
    timeout ${NCU_TIMEOUT:-150} "$NCU" --clock-control none --target-processes all "${filt[@]}" \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      --section InstructionStats --csv --page raw --log-file "$OUT/ncu_${shape}_${m}_${variant}.csv" \
      python3 -m moestream.tools.cli bench --virtual-ranks 1 --shapes "$shape" --tokens-per-expert "$m" \
      "${vargs[@]}" --reps 1 >> "$OUT/ncu.log" 2>&1
    echo "$item rc=$? lines=$(wc -l < "$OUT/ncu_${shape}_${m}_${variant}.csv")" | tee -a "$OUT/ncu.log"
  done
fi
