#!/usr/bin/env bash
# On the GPU machine, in one call of the device tool (8 minutes at most): the serving anchor of issue 66.
# A random-weight Llama-3.2-3B-shape model (vocabulary cut to 32000, as `bench models --shape llama3b`)
# made once by transformers on the GPU, built three times by onnxruntime-genai's builder for its
# continuous-batching Engine (PagedAttention, blocks of 256 tokens): an fp16 pool, int8_per_token, and
# int4_per_token with kv_cache_rotation=hadamard; then `python -m turboquant.bench engine` over the three
# at the same pool bytes, 8, 32 and 64 concurrent requests of 4096 and of 32768 random prompt tokens,
# NEW tokens each.
#
#   bash scripts/gpu_engine_anchor.sh [all|build|bench]      (after `scripts/gpu_session.sh ort`)
#
# Beside them, the fp16 folder rewritten by turboquant (python -m turboquant.export, default boundary
# layers, TQ_EXPORT_ARGS: --no-offsets unless set, as the calibration runs the 3B twin on the CPU) with
# each preset of TQ_PRESETS (turboquant_4bit_nc and turboquant_3bit_nc), benched in the same call, the
# fp16 folder first (the baseline).
#
# Needs onnxruntime-gpu and onnxruntime-genai-cuda under /tmp/site (scripts/carry_ort.sh's parts,
# installed by `scripts/gpu_session.sh ort`), torch with CUDA and transformers in the system python, and
# for the rewritten folders this package with its CUDA kernels and op library as a site in /tmp/tqsite
# (scripts/build_site.sh here, unpacked by `gpu_session.sh site`); without it only the builder's three
# folders are benched (turboquant then runs from this source tree: the Engine bench loads no op library).
# Models go to /tmp/engine-anchor and are kept for a later call on the same machine (`bench` alone
# reuses them). Every stage has a time limit cut to what is left of DEADLINE seconds, stages in the
# order that keeps the most comparisons: all three folders at 4096 tokens (with --confirm: each folder's
# Engine admission against the pool's block arithmetic), then at 32768 with 8 and 32 requests, then 64.
# A stage cut by its limit keeps the folders it finished (each table is printed when its folder is done);
# a point cut by its --budget says so in its row. What one call leaves undone, a second call on the same
# (still warm) machine runs with the models kept: STAGES="32768x64" bash scripts/gpu_engine_anchor.sh bench.
# Logs, tables and JSON go to $OUT; summary.log has each stage's exit status and time.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=${TQ_PYTHONPATH:-/tmp/site:/tmp/tqsite:$root} PYTHONUNBUFFERED=1
PY=${PY:-python3}
NEW=${NEW:-32}                        # tokens each request generates
POOL_BYTES=${POOL_BYTES:-40e9}         # every folder's KV pool
BLOCK=${BLOCK:-256}                    # paged_block_size
DEADLINE=${DEADLINE:-470}              # seconds for the whole call, builds included
STAGES=${STAGES:-4096 32768 32768x64}  # the bench stages to run, in this order
TQ_PRESETS=${TQ_PRESETS:-turboquant_4bit_nc turboquant_3bit_nc}  # rewrites of the fp16 folder benched beside it
TQ_EXPORT_ARGS=${TQ_EXPORT_ARGS:---no-offsets}
SHAPE=${SHAPE:-llama3b} DEVICE=${DEVICE:-cuda}  # SHAPE=tiny DEVICE=cpu BLOCK=16 POOL_BYTES=1e7: the plumbing on a CPU
M=${MODELS_DIR:-/tmp/engine-anchor}
OUT=${OUT:-/tmp/engine-anchor-out}
step=${1:-all}
mkdir -p "$OUT" "$M"
cd /tmp
t_start=$SECONDS

left() { echo $((DEADLINE - (SECONDS - t_start))); }

stage() {  # stage LIMIT NAME COMMAND...: under timeout min(LIMIT, time left), its log in $OUT/NAME.log
  local limit=$1 name=$2 t0=$SECONDS rc
  shift 2
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -le 10 ]; then echo "== $name: not run, ${limit} s left of $DEADLINE" | tee -a "$OUT/summary.log"; return; fi
  echo "== $name (limit $limit s): $*" | tee -a "$OUT/summary.log"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "   $name rc=$rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo ' (cut by its time limit)')" | tee -a "$OUT/summary.log"
  grep -v "^  " "$OUT/$name.log" | tail -n 60
}

"$PY" - <<'PY' 2>&1 | tee -a "$OUT/summary.log"
import onnxruntime as o, onnxruntime_genai as g
from onnxruntime.capi import onnxruntime_pybind11_state as C
pa = next((s for s in C.get_all_operator_schema() if s.name == "PagedAttention"), None)
print("onnxruntime", o.__version__, o.get_available_providers(), "| onnxruntime-genai", g.__version__,
      "cuda" if g.is_cuda_available() else "NO CUDA")
print("PagedAttention schema:", "absent" if pa is None else f"{len(pa.inputs)} inputs "
      + ("(takes per-token scales: int8/int4_per_token folders can load)" if len(pa.inputs) >= 19 else
         "(no per-token scales, inputs 17-18 of genai's int8/int4_per_token folders: those folders will not load)"))
PY
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | tee -a "$OUT/summary.log"

build_one() {  # build_one LIMIT NAME EXTRA_OPTIONS...: genai's builder on the shared HF folder, in the background
  local limit=$1 name=$2
  shift 2
  [ -f "$M/$name.done" ] && { echo "== $name: kept from an earlier call" | tee -a "$OUT/summary.log"; return; }
  rm -rf "$M/$name" "$M/cache-$name"
  ( timeout -k 10 "$limit" "$PY" -m onnxruntime_genai.models.builder -i "$M/hf" -o "$M/$name" -p fp16 -e cuda -c "$M/cache-$name" \
      --extra_options use_paged_attention=true paged_block_size="$BLOCK" max_batch_size=64 "$@" > "$OUT/build_$name.log" 2>&1
    rc=$?; echo "build $name exit $rc" >> "$OUT/build_$name.log"; rm -rf "$M/cache-$name"
    [ $rc = 0 ] && touch "$M/$name.done" ) &
}

if [ "$step" = all ] || [ "$step" = build ]; then
  t0=$SECONDS
  if [ ! -f "$M/hf/config.json" ] && ! { [ -f "$M/fp16.done" ] && [ -f "$M/int8.done" ] && [ -f "$M/int4h.done" ]; }; then
    timeout 150 "$PY" - "$M/hf" "$SHAPE" "$DEVICE" <<'PY' > "$OUT/hf.log" 2>&1
import sys, torch
from turboquant import random_decoders
from turboquant.bench.decode_models import SHAPES
cfg = SHAPES[sys.argv[2]]
random_decoders.save_hf_folder(random_decoders.build_model(cfg, sys.argv[3], torch.float16), cfg, sys.argv[1])
print(f"random {sys.argv[2]}-shape weights saved to", sys.argv[1])
PY
    echo "== hf folder rc=$? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  fi
  limit=$(left); [ "$limit" -gt 220 ] && limit=220  # the three builds side by side
  build_one "$limit" fp16
  build_one "$limit" int8 kv_cache_quant_scheme=int8_per_token
  build_one "$limit" int4h kv_cache_quant_scheme=int4_per_token kv_cache_rotation=hadamard
  wait
  for n in fp16 int8 int4h; do tail -n 1 "$OUT/build_$n.log" 2>/dev/null | tee -a "$OUT/summary.log"; done
  echo "== builds done in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  [ -f "$M/fp16.done" ] && [ -f "$M/int8.done" ] && [ -f "$M/int4h.done" ] && rm -rf "$M/hf"
  if [ -f "$M/fp16.done" ] && "$PY" -c "from turboquant._libs import ort_library_path; ort_library_path()" 2>/dev/null; then
    for p in $TQ_PRESETS; do  # side by side, as the builds
      [ -f "$M/$p.done" ] && { echo "== $p: kept from an earlier call" | tee -a "$OUT/summary.log"; continue; }
      rm -rf "$M/$p"
      ( stage 240 "export_$p" "$PY" -m turboquant.export "$M/fp16/model.onnx" --preset "$p" -o "$M/$p/model.onnx" \
          --no-progress $TQ_EXPORT_ARGS
        [ -f "$M/$p/genai_config.json" ] && touch "$M/$p.done" ) &
    done
    wait
  elif [ -f "$M/fp16.done" ]; then
    echo "== no turboquant op library on PYTHONPATH (/tmp/tqsite: scripts/build_site.sh, gpu_session.sh site): the rewrites not made" | tee -a "$OUT/summary.log"
  fi
fi

if [ "$step" = all ] || [ "$step" = bench ]; then
  folders=""
  for n in fp16 int8 int4h $TQ_PRESETS; do [ -f "$M/$n.done" ] && folders="$folders $M/$n"; done
  if [ -z "$folders" ]; then echo "== no folders in $M: nothing to bench" | tee -a "$OUT/summary.log"; exit 1; fi
  common="--new $NEW --pool-bytes $POOL_BYTES --isolate --device $DEVICE"
  for st in $STAGES; do
    case $st in
      4096) stage 170 engine_4096 "$PY" -m turboquant.bench engine $folders --concurrency 8,32,64 --context 4096 $common \
              --confirm --budget 50 --json "$OUT/engine_4096.json" ;;
      32768) stage 300 engine_32768 "$PY" -m turboquant.bench engine $folders --concurrency 8,32 --context 32768 $common \
              --budget 150 --json "$OUT/engine_32768.json" ;;
      32768x64) stage 300 engine_32768x64 "$PY" -m turboquant.bench engine $folders --concurrency 64 --context 32768 \
              $common --budget 150 --json "$OUT/engine_32768x64.json" ;;
      *) echo "== unknown stage $st (4096, 32768, 32768x64)" | tee -a "$OUT/summary.log" ;;
    esac
  done
  cat "$OUT"/engine_*.log 2>/dev/null | grep -v "^  " > "$OUT/anchor.md"
fi
echo "== total $((SECONDS - t_start)) s" | tee -a "$OUT/summary.log"
touch "$OUT/$step.done"
