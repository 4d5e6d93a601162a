#!/usr/bin/env bash
# On the GPU machine, in one call of the device tool (about 9 minutes at most): random-weight
# decoders of a Llama shape built on the GPU in fp16 by onnxruntime-genai's builder and by torch.onnx's
# TorchScript exporter, each rewritten with turboquant_4bit_nc (python -m turboquant.bench models),
# then `python -m turboquant.bench decode` original against rewritten at B=1/S=4096, B=8/S=32768 and
# B=16/S=65536 (caches filled with random K/V; ttft from a real prefill where it is affordable),
# capacity at 80 GB, and genai's own runtime (og.Generator) at B=1/S=4096. The torchscript rewrite is
# the default (in-place) form; `cross` times genai's fp16 original (ORT's GroupQueryAttention in place,
# the fastest fp16 decode ORT offers) against the torchscript export's rewrite and genai's rewrite in
# one process (--other-exporters), the in-place export target of the design.
#
#   bash scripts/gpu_decode_bench.sh [all|build|bench|cross]     (SHAPE=llama3b|llama8b, BUILDERS="genai torchscript")
#
# Expects onnxruntime-gpu and onnxruntime-genai(-cuda) under /tmp/site, this package (CUDA build)
# under /tmp/tqsite, torch with CUDA and transformers in the system python. Models go to
# /tmp/bench-models/$SHAPE and are kept for a later call on the same machine (`bench` alone reuses
# them). llama8b: ~16 GB per model file, four of them do not fit a 64 GB disk: DROP_ORIGINAL=1 deletes
# the TorchScript original once its bench has run (cross needs only its rewrite), so with
# BUILDERS="torchscript genai" at most three models are on the disk at once. `all` ends with cross.
# The torchscript rewrite is made without calibration (--no-calibration: its data-free calibration
# runs the original on the CPU, minutes at these sizes); offsets do not change the decode's work.
# Logs, JSON and plots go to $OUT; summary.log has each step's exit status and time.
set -uo pipefail
export PYTHONPATH=${TQ_PYTHONPATH:-/tmp/site:/tmp/tqsite} PYTHONUNBUFFERED=1
PY=${PY:-python3}
SHAPE=${SHAPE:-llama3b}
BUILDERS=${BUILDERS:-genai torchscript}
STEPS=${STEPS:-8}
DEVICE=${DEVICE:-cuda} PRECISION=${PRECISION:-fp16}  # DEVICE=cpu PRECISION=fp32 SHAPE=tiny: the same steps on a CPU
POINTS=${POINTS:---batch 1 8 16 --context 4096 32768 65536}
FIRST=${FIRST:-4096}  # the B=1 context whose ttft is measured
LIMIT_SCALE=${LIMIT_SCALE:-1}  # every step's time limit times this (llama8b: 3)
step=${1:-all}
M=/tmp/bench-models/$SHAPE
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT" "$M"
cd /tmp

stage() {  # stage LIMIT NAME COMMAND...: one step under timeout, its log in $OUT/NAME.log
  local limit=$(($1 * LIMIT_SCALE)) name=$2 t0=$SECONDS rc
  shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.log"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "   $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  tail -n 40 "$OUT/$name.log"
}

build() {  # build BUILDER DIR LIMIT [extra]: skipped where an earlier call left the rewrite
  local builder=$1 dir=$2 limit=$3
  shift 3
  [ -f "$dir/tq/model.onnx" ] && { echo "== $builder models: kept from an earlier call in $dir" | tee -a "$OUT/summary.log"; return; }
  rm -rf "$dir"
  stage "$limit" "build_$builder" "$PY" -m turboquant.bench models --shape "$SHAPE" --builder "$builder" \
    --precision "$PRECISION" --device "$DEVICE" -o "$dir" --rewrite "$@"
}

common="--device $DEVICE --steps $STEPS --capacity 80e9 --fill random"
if [ "$step" = all ] || [ "$step" = build ]; then  # the rewrite loads the op library: a source tree on the path cannot
  "$PY" -c "from turboquant._libs import ort_library_path; ort_library_path()" 2>&1 | tail -1 | tee -a "$OUT/summary.log"
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "== no built turboquant on PYTHONPATH=$PYTHONPATH: nothing built" | tee -a "$OUT/summary.log"; exit 2; }
fi
"$PY" -c "import onnxruntime as o, onnxruntime_genai as g; print('ort', o.__version__, o.get_available_providers(), 'genai', g.__version__)" \
  2>&1 | tee -a "$OUT/summary.log"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | tee -a "$OUT/summary.log"
for builder in $BUILDERS; do
  if [ "$step" = all ] || [ "$step" = build ]; then
    if [ "$builder" = genai ]; then build genai "$M/genai" 130; else build torchscript "$M/torchscript" 150 --no-calibration; fi
  fi
  if [ "$step" = all ] || [ "$step" = bench ]; then
    d=$M/$builder
    [ -f "$d/tq/model.onnx" ] || { echo "== $builder: no models in $d, bench skipped" | tee -a "$OUT/summary.log"; continue; }
    if [ "$builder" = genai ]; then
      # a batch > 1 prompt goes to GroupQueryAttention in one call, which no budget can stop: ttft at B=1 only
      stage 120 decode_genai_ort "$PY" -m turboquant.bench decode "$d/model" "$d/tq/model.onnx" $POINTS $common \
        --ttft-max-tokens "$FIRST" --json "$OUT/decode_genai_ort.json" --plot "$OUT/decode_genai_ort.png"
    else
      stage 100 decode_torchscript_ort "$PY" -m turboquant.bench decode "$d/model/model.onnx" "$d/tq/model.onnx" \
        $POINTS $common --prefill-chunk 1024 --ttft-budget 15 --ttft-max-tokens 32768 \
        --json "$OUT/decode_torchscript_ort.json" --plot "$OUT/decode_torchscript_ort.png"
    fi
  fi
  if { [ "$step" = all ] || [ "$step" = bench ]; } && [ "$builder" = torchscript ] && [ "${DROP_ORIGINAL:-0}" = 1 ] &&
     [ -f "$M/torchscript/tq/model.onnx" ]; then
    rm -rf "$M/torchscript/model"; echo "== torchscript original deleted (DROP_ORIGINAL=1)" | tee -a "$OUT/summary.log"
  fi
done
if { [ "$step" = all ] || [ "$step" = bench ]; } && [ -f "$M/genai/tq/model.onnx" ]; then
  stage 50 decode_genai_runtime "$PY" -m turboquant.bench decode "$M/genai/model" "$M/genai/tq" --runtime genai \
    --device "$DEVICE" --batch 1 --context "$FIRST" --steps "$STEPS" --json "$OUT/decode_genai_runtime.json"
  # the same through genai's CUDA graphs (each decode step replayed: no host work between kernels)
  [ "$DEVICE" = cuda ] && stage 80 decode_genai_graphs "$PY" -m turboquant.bench decode "$M/genai/model" "$M/genai/tq" \
    --runtime genai --cuda-graph --device cuda --batch 1 8 --context "$FIRST" "$FIRST" --steps "$STEPS" \
    --json "$OUT/decode_genai_graphs.json"
fi
if { [ "$step" = all ] || [ "$step" = cross ]; } && [ -f "$M/genai/tq/model.onnx" ] && [ -f "$M/torchscript/tq/model.onnx" ]; then
  stage 120 decode_cross "$PY" -m turboquant.bench decode "$M/genai/model" "$M/torchscript/tq/model.onnx" \
    "$M/genai/tq/model.onnx" --other-exporters $POINTS $common --ttft-max-tokens "$FIRST" --json "$OUT/decode_cross.json"
fi
cat "$OUT/summary.log"
touch "$OUT/$step.done"  # for a later call to wait on (pgrep -f would find that call's own command line)
