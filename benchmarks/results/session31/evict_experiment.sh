#!/usr/bin/env bash
# session 31 experiment: L2-cache priority (evict_last) of the combine-slot stores (and pool_act)
# It needs the experiment build of session 31 (not committed): moestream/kernels/gemm.py read
# MOESTREAM_SLOT_EVICT (store_slot_rows) and MOESTREAM_ACT_EVICT (l1_store), combine.py
# MOESTREAM_COMBINE_EVICT (combine_tokens) into constexprs passed as eviction_policy.
# The product keeps only the first, for decode pieces (kernels/gemm.DECODE_SLOT_EVICT).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/env.txt"
i=0
for side in ${SIDES:-off on on off}; do
  # off: no hints; on / slot: combine-slot stores evict_last; all: also pool_act stores
  # evict_last and the combine's slot loads evict_first
  case $side in
    on|slot) export MOESTREAM_SLOT_EVICT=evict_last MOESTREAM_ACT_EVICT= MOESTREAM_COMBINE_EVICT= ;;
    all) export MOESTREAM_SLOT_EVICT=evict_last MOESTREAM_ACT_EVICT=evict_last MOESTREAM_COMBINE_EVICT=evict_first ;;
    *) export MOESTREAM_SLOT_EVICT= MOESTREAM_ACT_EVICT= MOESTREAM_COMBINE_EVICT= ;;
  esac
  if [[ ",${STEPS:-floor,gemm}," == *",floor,"* ]]; then
    extra=; [ $i -lt 2 ] && extra=--mma-tiles
    timeout 120 python3 benchmarks/launch_floor.py --shape qwen3 --experts 32 --blocks 8,16,32 \
      --variants dec16 --tile-forms "" $extra --out "$OUT/floor_${i}_$side.jsonl" 2>&1 | tail -14 | tee -a "$OUT/floor.log"
  fi
  if [[ ",${STEPS:-floor,gemm}," == *",gemm,"* ]]; then
    timeout ${GEMM_TIMEOUT:-150} python3 -m moestream.cli bench --virtual-ranks 1 --shapes dsv3,qwen3 --tokens-per-expert ${GEMM_M:-16} \
      --variants ${GEMM_VARIANTS:-dec16} --out "$OUT/gemm_${i}_$side.jsonl" 2>&1 | tail -8 | tee -a "$OUT/gemm.log"
  fi
  if [[ ",${STEPS:-floor,gemm}," == *",layer,"* ]]; then
    timeout ${LAYER_TIMEOUT:-150} python3 -m moestream.cli bench --shapes qwen3,dsv3 --tokens ${LAYER_T:-1,8,32} \
      --providers staged-graph,fp8-staged-graph --out "$OUT/layer_${i}_$side.jsonl" 2>&1 | grep " us$" | tee -a "$OUT/layer.log"
  fi
  i=$((i+1))
done
# one file per step (the device tool returns few files): rows tagged with run and side
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for step in ("floor", "gemm", "layer"):
    files = sorted(glob.glob(f"{out}/{step}_*_*.jsonl"))
    with open(f"{out}/{step}_all.jsonl", "w") as fh:
        for f in files:
            run, side = os.path.basename(f)[:-6].split("_")[1:3]
            for line in open(f):
                r = json.loads(line); r["ab_run"] = int(run); r["side"] = side
                fh.write(json.dumps(r) + "\n")
            os.remove(f)
PY
