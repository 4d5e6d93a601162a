#!/usr/bin/env bash
# On the GPU machine (see the device tool): build the package with its CUDA kernels (build; build-variant
# beside it with developer defines, for A/B runs), run the
# ORT op tests on the CUDA execution provider, the TensorRT plugins' enqueue tests and the genai test
# (test), compute-sanitizer on the op tests (check) and on the kernel probes (check-probes), the
# first-prompt kernels' probe (probe; prefill adds the op bench's prefill rows), continuation chunks
# on both chunk kernels in the attention probe (chunk), the CUDA benchmarks, the report's table and plots and a kernel profile (bench), the issue's headline size
# again in a process of its own (repeat), TQPack's developer variants against the default kernels in
# the pack probe (pack-ab; pack-ab-build builds its probes alone, e.g. in the background), the wheel built
# on the CPU machine installed without building and its CUDA and genai tests (wheel). One step
# per call of the device tool. The serving anchor (onnxruntime-genai's Engine over paged folders) is
# scripts/gpu_engine_anchor.sh, after `ort`.
# pack-ab's PACK_VARIANTS: NAME:FLAGS ... as in scripts/build_probe.sh; PACK_BASELINE: a source tree
# under the repo root whose pack probe joins the rounds (e.g. `git archive COMMIT ops scripts`
# extracted into .carry/baseline and carried with pack-ab-build's call).
# Expects onnxruntime-gpu under /tmp/site (`ort`, from the parts scripts/carry_ort.sh makes, or
# shared/device/prepare-ortgpu.sh's) and the ONNX Runtime headers in third_party/
# (scripts/fetch_headers.sh). Logs go to $OUT.
# A visit, calls back to back (the machine goes back after ~30 s idle): (1) carry .carry/ort-1 and
# third_party, move the part to /tmp/parts, and start `build` and `models` in the background
# (`(setsid nohup bash scripts/gpu_session.sh build > /tmp/build.out 2>&1 &)`, the same for `models`
# with MODELS); (2-3) carry ort-2 and ort-3; (4) carry ort-4 and run `ort`; then `wait`
# (WAIT_FOR="/tmp/tq_build.done /tmp/models-llama3b-genai/build.done") before the tests and benches.
# Wait on such files, not on `pgrep -f NAME`: the call's own command line holds NAME.
# Or, to spare the device's build: `bash scripts/build_site.sh .carry/site/tqsite.tgz` here first, then
# carry .carry/site with ort-4 in call (4) and run `SITE=.carry/site/tqsite.tgz bash scripts/gpu_session.sh
# site` before `ort` (no `build`; `models` then waits for `ort` alone).
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/tqsite PYTHONUNBUFFERED=1
root=$(pwd)
step=${1:-all}
if [ "$step" = ort ]; then  # onnxruntime-gpu and onnxruntime-genai-cuda from /tmp/parts (scripts/carry_ort.sh)
  mkdir -p /tmp/site
  cat /tmp/parts/ortp* | xz -dc | tar -x -C /tmp/site && echo "onnxruntime-gpu unpacked into /tmp/site"
  for w in /tmp/parts/onnxruntime_genai*.whl; do
    [ -f "$w" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w"
  done
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())" && touch /tmp/ort.done
fi
if [ "$step" = build ] || [ "$step" = all ]; then
  rm -rf /tmp/tqsrc && cp -r "$root" /tmp/tqsrc
  ( cd /tmp/tqsrc && CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DORT_INCLUDE_DIR=/tmp/tqsrc/third_party/onnxruntime/include" \
      rm -rf /tmp/tqsite && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/tqsite . ) > /tmp/tq_build.log 2>&1
  echo "build exit $?" >> /tmp/tq_build.log
  grep -q "build exit 0" /tmp/tq_build.log && touch /tmp/tq_build.done
fi
if [ "$step" = site ]; then  # the package built on the CPU machine (scripts/build_site.sh), carried as SITE
  rm -rf /tmp/tqsite /tmp/tqsrc && tar xzf "$SITE" -C /tmp && cp -r "$root" /tmp/tqsrc \
    && echo "build exit 0 (carried: $SITE)" > /tmp/tq_build.log && touch /tmp/tq_build.done
fi
if [ "$step" = build-variant ]; then  # VARIANT=NAME:FLAGS (comma-separated CUDA defines, as build_probe.sh's):
  # the package built with them into /tmp/tqsite-NAME (A/B runs: PYTHONPATH=/tmp/site:/tmp/tqsite-NAME), beside `build`
  name=${VARIANT%%:*} vflags=$(tr , ' ' <<< "${VARIANT#*:}")
  rm -rf "/tmp/tqsrc-$name" && cp -r "$root" "/tmp/tqsrc-$name" && rm -rf "/tmp/tqsrc-$name/build"
  ( cd "/tmp/tqsrc-$name" && export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DORT_INCLUDE_DIR=/tmp/tqsrc-$name/third_party/onnxruntime/include -DCMAKE_CUDA_FLAGS='$vflags'" \
      && rm -rf "/tmp/tqsite-$name" && python3 -m pip install -q --no-build-isolation --no-deps --target "/tmp/tqsite-$name" . ) > "/tmp/tq_build-$name.log" 2>&1
  echo "build exit $?" >> "/tmp/tq_build-$name.log"
  grep -q "build exit 0" "/tmp/tq_build-$name.log" && touch "/tmp/tq_build-$name.done"
fi
if [ "$step" = models ]; then  # MODELS="llama3b:genai llama3b:torchscript": scripts/gpu_decode_bench.sh's models, once
  # `build` and `ort` are done (start it in the background in the first call: setsid nohup ... &); each
  # writes /tmp/models-SHAPE-BUILDER/build.done, its logs beside it
  for i in $(seq 900); do [ -f /tmp/tq_build.done ] && [ -f /tmp/ort.done ] && break; sleep 2; done
  for m in ${MODELS:-llama3b:genai}; do
    SHAPE=${m%%:*} BUILDERS=${m#*:} OUT=/tmp/models-${m%%:*}-${m#*:} bash /tmp/tqsrc/scripts/gpu_decode_bench.sh build
  done
fi
if [ "$step" = wait ]; then  # WAIT_FOR="FILE ...": until each exists (at most WAIT_LIMIT seconds)
  for i in $(seq $((${WAIT_LIMIT:-300} / 2))); do
    missing=""; for f in ${WAIT_FOR:-/tmp/tq_build.done}; do [ -f "$f" ] || missing="$missing $f"; done
    [ -z "$missing" ] && break; sleep 2
  done
  [ -z "$missing" ] && echo "ready: ${WAIT_FOR:-/tmp/tq_build.done}" || { echo "still missing after ${WAIT_LIMIT:-300} s:$missing"; exit 1; }
fi
if [ "$step" = test ] || [ "$step" = all ]; then
  cp /tmp/tq_build.log "$OUT/build.log" 2>/dev/null
  cd /tmp
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())" 2>&1 | tee "$OUT/providers.log"
  timeout 400 python3 -m pytest -q -p no:cacheprovider "$root/tests/plugins/onnxruntime" -k cuda -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  timeout 60 python3 -m pytest -q -p no:cacheprovider "$root/tests/turboquant/bench/test_gpu_time.py" -rs 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -3
  nm -D --defined-only /tmp/tqsite/turboquant/lib/libturboquant_trt.so > "$OUT/trt_exports.log" 2>&1
  timeout 300 python3 -m pytest -q -p no:cacheprovider "$root/tests/plugins/tensorrt" "$root/tests/export/test_target_tensorrt.py" -rs 2>&1 | tee "$OUT/trt_tests.log" | tail -15
  # onnxruntime-genai models on the CUDA provider (needs onnxruntime-genai under /tmp/site for its builder)
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider "$root/tests/export/test_genai.py" -k cuda -rs 2>&1 | tee "$OUT/genai_tests.log" | tail -8
  # paged folders rewritten for the Engine: og.Engine's tokens on the CPU and on CUDA against the reference loop's
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider "$root/tests/export/test_paged.py" -k engine -rs 2>&1 | tee "$OUT/paged_tests.log" | tail -8
  # exported decoders rewritten in place, and the other CUDA runs of whole models
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider "$root/tests/export/test_in_place.py" "$root/tests/turboquant" \
    -m gpu -rs 2>&1 | tee "$OUT/model_gpu_tests.log" | tail -12
fi
if [ "$step" = check ]; then  # compute-sanitizer on every CUDA op test, after `test`
  cd /tmp
  CS=/usr/local/cuda/bin/compute-sanitizer
  # every CUDA op test, the hypothesis ones on 10 cases each (TQ_MAX_EXAMPLES): memcheck makes each
  # case ~50x slower, and the whole set has to fit one call of the device tool (memcheck ~220 s,
  # racecheck ~20 s on the H200); pytest_then_exit.py skips the interpreter's shutdown, which memcheck
  # made longer than the tests
  # CHECK_K narrows the tests (a pytest -k expression, e.g. "cuda and first_prompt") where a call
  # has less time than the whole set takes
  for tool in memcheck racecheck; do
    TQ_MAX_EXAMPLES=10 timeout "${CHECK_LIMIT:-330}" $CS --tool $tool --error-exitcode 9 python3 "$root/scripts/pytest_then_exit.py" -q \
      -p no:cacheprovider "$root/tests/plugins/onnxruntime" -k "${CHECK_K:-cuda}" -rs > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' "$OUT/$tool.log" | tr '\n' ' ')"
  done
fi
if [ "$step" = prefill ] || [ "$step" = probe ]; then  # the first-prompt kernels alone (their probe; needs no ORT)
  # PREFILL_VARIANTS: NAME:FLAGS ... developer variants of the kernels, timed after the default on the
  # same shapes (e.g. "pairs:-DTQ_PREFILL_L2_BYTES=1"; FLAGS comma-separated)
  cd /tmp
  for v in default:-DTQ_SM90A=1 ${PREFILL_VARIANTS:-}; do
    /usr/local/cuda/bin/nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DTQ_SM90A=1 $(tr , ' ' <<< "${v#*:}") --expt-relaxed-constexpr \
      -I"$root/ops/include" "$root/scripts/cuda_prefill_probe.cu" "$root/ops/cuda/prefill.cu" "$root/ops/cuda/prefill_sm90.cu" \
      "$root/ops/cuda/split_plan.cpp" -o "/tmp/prefill_probe.${v%%:*}" > "$OUT/prefill_probe_build.${v%%:*}.log" 2>&1 &
  done
  wait
  for a in "1 32 8 4096 128 0 1 20" "8 32 8 2048 128 0 1 20" "1 24 8 16384 128 0 1 10" "2 8 2 300 128 1 1 3" \
           "1 32 8 8192 64 0 1 10" "3 12 4 777 64 1 1 3" "1 32 8 4096 128 0 0 10" "2 4 4 129 128 0 0 3"; do
    timeout 60 /tmp/prefill_probe.default $a
    [ $? = 124 ] && { echo "probe $a: timed out, the rest not run"; break; }
  done 2>&1 | tee -a "$OUT/prefill_probe.log"
  # head size 256 (Gemma 3's 8 query heads on 4): the mma kernel, with two buffers and (one=1) with the
  # single one of sm_86/sm_89
  for one in 0 1; do
    for a in "1 8 4 4096 256 0 1 20" "1 8 4 16384 256 0 1 5" "8 8 4 4096 256 1 1 5" "2 8 4 300 256 1 1 3" "2 4 4 129 256 0 0 3"; do
      echo "one buffer: $one"
      TURBOQUANT_PREFILL_ONE_BUFFER=$one timeout 60 /tmp/prefill_probe.default $a mma
      [ $? = 124 ] && { echo "probe $a: timed out, the rest not run"; break 2; }
    done
  done 2>&1 | tee -a "$OUT/prefill_probe.log"
  # the variants against the default, alternating, on the prompts of the op bench's rows
  for round in 1 2; do
    for a in "1 32 8 8192 128 0 1 20" "8 32 8 8192 128 0 1 5" "8 32 8 2048 128 0 1 20" "1 24 8 16384 128 0 1 10"; do
      for v in default:-DTQ_SM90A=1 ${PREFILL_VARIANTS:-}; do
        echo "round $round ${v%%:*}: $(timeout 60 /tmp/prefill_probe.${v%%:*} $a wgmma | grep -E 'time|check' | tr '\n' ' ')"
      done
    done
  done 2>&1 | tee -a "$OUT/prefill_probe.log"
fi
if [ "$step" = prefill ]; then  # then the op bench's prefill rows
  timeout "${PREFILL_LIMIT:-240}" python3 -m turboquant.bench prefill --device cuda ${PREFILL_ARGS:-} --json "$OUT/prefill.json" \
    > "$OUT/prefill.log" 2>&1
  echo "bench prefill rc=$?"; grep -v "^{" "$OUT/prefill.log" | tail -40
fi
if [ "$step" = chunk ]; then  # continuation chunks on both chunk kernels (the attention probe), then under the sanitizers
  # PROBE: a probe built by scripts/build_probe.sh, carried (gzipped: PROBE=.carry/probe/p.gz); else built
  # here into /tmp/probe. Each case prints the chunk kernel's and (TURBOQUANT_CHUNK_WGMMA=1) the wgmma
  # chunk kernel's time and errors.
  cd /tmp
  probe=${PROBE:+$root/$PROBE}
  if [[ $probe == *.gz ]]; then
    gunzip -c "$probe" > /tmp/probe_carried && chmod +x /tmp/probe_carried && probe=/tmp/probe_carried
  fi
  if [ -z "$probe" ]; then
    ( cd /tmp/tqsrc && VARIANTS="" NVCC=/usr/local/cuda/bin/nvcc bash scripts/build_probe.sh /tmp/probe ) > "$OUT/probe_build.log" 2>&1
    probe=/tmp/probe
  fi
  # B S formats iters pad width inplace rotary shift mask chunk: rows of 68 bytes, S + chunk a multiple of 4
  for a in "1 32768 mse4 uint4 10 0 68 1 0 0 0 512" "1 32768 mse4 uint4 5 0 68 1 0 0 0 2048" \
           "8 32768 mse4 uint4 5 0 68 1 0 0 0 512" "1 4096 mse4 uint4 10 0 68 1 0 0 0 36" "3 1002 mse4 uint4 10 0 68 1 0 0 0 130" \
           "1 32768 mse3 uint3 10 0 52 1 0 0 0 512" "1 32768 mse3 uint4 10 0 68 1 0 0 0 512" "2 1002 mse3 uint3 10 0 52 1 0 0 0 130"; do
    echo "== chunk $a"; timeout 150 "$probe" $a 2>&1 | grep -E "chunk|reference|refused|does not|error" ; echo "rc ${PIPESTATUS[0]}"
  done 2>&1 | tee "$OUT/chunk_probe.log"
  CS=/usr/local/cuda/bin/compute-sanitizer
  for tool in memcheck racecheck; do
    for a in "3 1002 mse4 uint4 1 0 68 1 0 0 0 130" "1 200 mse4 uint4 1 0 68 1 0 0 0 40" "2 1002 mse3 uint3 1 0 52 1 0 0 0 130"; do
      echo "chunk $tool $a: $(timeout 200 $CS --tool $tool --error-exitcode 9 "$probe" $a 2>&1 | grep -E 'chunk |ERROR SUMMARY|RACECHECK SUMMARY' | tr '\n' ' ')"
    done
  done 2>&1 | tee -a "$OUT/chunk_probe.log"
fi
if [ "$step" = check-probes ]; then  # compute-sanitizer on the kernel probe and the TQPack probe
  cd /tmp
  CS=/usr/local/cuda/bin/compute-sanitizer
  ( cd /tmp/tqsrc && NVCC=/usr/local/cuda/bin/nvcc bash scripts/build_probe.sh /tmp/probe ) > "$OUT/probe_build.log" 2>&1
  for tool in memcheck racecheck; do
    for a in "2 37 mse4 uint4 1 0" "2 999 mse4 uint4 1 1" "1 300 fp8 uint4 1 1" "2 999 mse3 uint3 1 1" "1 513 mse3 uint4 1 5" \
             "2 999 mse4 uint4 1 0 68 1" "2 999 mse3 uint4 1 1 0 1" "3 1000 fp8 uint4 1 0 0 1" \
             "2 999 mse4 uint4 1 0 68 1 1" "3 1000 fp8 uint4 1 0 0 1 1" \
             "2 999 raw16 raw16 1 1" "3 1000 raw16 raw16 1 0 0 1 1" "1 300 raw16 raw16 1 0 272 1"; do
      echo "probe $tool $a: $(timeout 60 $CS --tool $tool --error-exitcode 9 /tmp/probe $a 2>&1 | grep -E 'split kernel|max |differing|ERROR SUMMARY|RACECHECK SUMMARY' | tr '\n' ' ')"
    done
  done | tee "$OUT/probe_sanitizers.log"
  # TQPack's kernels on a small run of the pack probe (its byte checks, then 8192 vectors timed)
  for tool in memcheck racecheck; do
    echo "pack probe $tool: $(timeout 150 $CS --tool $tool --error-exitcode 9 /tmp/probe.pack 8192 2>&1 | grep -E 'byte checks|normal quotients|ERROR SUMMARY|RACECHECK SUMMARY' | tr '\n' ' ')"
  done | tee -a "$OUT/probe_sanitizers.log"
fi
if [ "$step" = bench ]; then  # the benchmarks (attention, TQPack, the report's plots) and a kernel profile
  cd /tmp
  timeout 330 python3 -m turboquant.bench attention --device cuda --repeat 30 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; grep -v "^{" "$OUT/bench.log"
  timeout 150 python3 -m turboquant.bench pack --device cuda --vectors 65536 262144 1048576 2097152 --json "$OUT/pack.json" \
    --plot "$OUT/pack-cuda.png" 2>&1 | tee "$OUT/pack.log" | tail -9
  timeout 150 python3 -m turboquant.bench report --device cuda --batch 8 --context 2048 8192 32768 --repeat 20 \
    --out /tmp/report > "$OUT/report.log" 2>&1; echo "report rc=$?"
  # one file for the report's four (the device tool brings back at most 8 files a call)
  tar -C /tmp -cf "$OUT/report.tar" report
  printf 'import numpy as np, onnxruntime as ort\nort.preload_dlls()\nfrom turboquant.bench import cuda_steps as c\nprint(c.tq_gqa_step("turboquant_4bit_nc", 8, 32, 8, 128, 32768, 3, np.random.default_rng(0)))\n' > /tmp/one.py
  timeout 60 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --kernel-name regex:"split|finish" --launch-skip 4 --launch-count 4 python3 /tmp/one.py 2>&1 | grep -E "kernel|gpu__time|dram__" > "$OUT/ncu.log"
  cat "$OUT/ncu.log"
fi
if [ "$step" = repeat ]; then  # the issue's headline size again, in a process of its own (after bench)
  cd /tmp
  timeout 200 python3 -m turboquant.bench attention --device cuda --batch 8 --context 32768 --presets turboquant_4bit_nc \
    --repeat 30 --json "$OUT/repeat.json" > "$OUT/repeat.log" 2>&1
  echo "repeat rc=$?"; grep -v "^{" "$OUT/repeat.log"
fi
if [ "$step" = pack-ab-build ] || [ "$step" = pack-ab ]; then  # the pack probes of pack-ab (on its own: in the background, beside other steps)
  pv=${PACK_VARIANTS:-b6:-DTQ_STREAM_BLOCKS_MSE3=6}
  if [ "$step" = pack-ab-build ] || [ ! -x /tmp/probe.pack ]; then
    {  # from a copy: a carried baseline does not outlive its call
      rm -rf /tmp/pabsrc && cp -r "$root" /tmp/pabsrc &&
        ( cd /tmp/pabsrc && VARIANTS="" PACK_VARIANTS="$pv" NVCC=/usr/local/cuda/bin/nvcc bash scripts/build_probe.sh /tmp/probe ) &&
        if [ -n "${PACK_BASELINE:-}" ]; then
          ( cd "/tmp/pabsrc/$PACK_BASELINE" && VARIANTS="" PACK_VARIANTS="" NVCC=/usr/local/cuda/bin/nvcc bash scripts/build_probe.sh /tmp/probe_baseline )
        fi
      echo "pack-ab build exit $?"
    } > /tmp/pack_ab_build.log 2>&1
  fi
fi
if [ "$step" = pack-ab ]; then  # TQPack's developer variants (PACK_VARIANTS; PACK_BASELINE: an earlier source tree) against the default, alternating
  cd /tmp
  cp /tmp/pack_ab_build.log "$OUT/pack_ab_build.log"
  grep -q "pack-ab build exit 0" /tmp/pack_ab_build.log || { echo "probe build failed"; tail -20 /tmp/pack_ab_build.log; exit 1; }
  probes="/tmp/probe.pack $(for v in $pv; do echo /tmp/probe.pack.${v%%:*}; done)"
  [ -n "${PACK_BASELINE:-}" ] && probes="$probes /tmp/probe_baseline.pack"
  {
    # round 1: byte checks and every format's timing; rounds 2 and 3: the MSE formats' timings
    for b in $probes; do echo "== round 1 $(basename "$b")"; timeout 120 "$b" | grep -E "byte checks|differ|copy:|four lanes"; done
    for round in 2 3; do
      for b in $probes; do
        for f in mse3 mse4; do echo "== round $round $(basename "$b") $f"; timeout 60 "$b" 2097152 $f | grep -E "copy:|four lanes"; done
      done
    done
    # per kernel: warp instructions, issue, shared-memory wavefronts and bank conflicts, occupancy
    for b in $probes; do
      for f in mse3 mse4; do
        echo "== ncu $(basename "$b") $f"
        timeout 60 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:pack_stream --launch-skip 1 --launch-count 1 \
          --metrics gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__warps_active.avg.pct_of_peak_sustained_active \
          "$b" 2097152 $f 2>&1 | grep -E "__|==PROF==|rror"
      done
    done
  } 2>&1 | tee "$OUT/pack_ab.log"
fi
if [ "$step" = trt-rtx ]; then  # TensorRT-RTX from /tmp/trtparts (scripts/carry_trt_rtx.sh), after `build` (or `site`) and `ort`:
  # installs it, then the engine tests (marked gpu: engines TensorRT-RTX builds from --target tensorrt rewrites,
  # inspected, and run against the ORT CUDA ops and rewrites); `trt-check` next
  mkdir -p /tmp/site
  if [ ! -d /tmp/site/tensorrt_rtx_libs ]; then
    libs=/tmp/trtparts/$(cat /tmp/trtparts/libs-wheel-name)
    cat /tmp/trtparts/trtp* > "$libs"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$libs" /tmp/trtparts/tensorrt_rtx_cu13_bindings-*.whl
  fi
  cd /tmp
  python3 -c "from turboquant import tensorrt as t; m = t.trt_module('tensorrt-rtx'); print(m.__name__, m.__version__)" 2>&1 | tee "$OUT/trt_rtx.log"
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv 2>&1 | tee -a "$OUT/trt_rtx.log"
  timeout "${TRT_TEST_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider "$root/tests/turboquant/test_tensorrt.py" \
    "$root/tests/turboquant/test_trt_engine.py" "$root/tests/export/test_target_tensorrt.py" -rs ${TRT_TEST_ARGS:-} 2>&1 \
    | tee "$OUT/trt_engine_tests.log" | tail -25
fi
if [ "$step" = trt-check ]; then  # after trt-rtx and `models` (MODELS=llama3b:torchscript): TRT_MODEL (default that export)
  # rewritten both ways, its engine built by TensorRT-RTX, decode steps and a greedy loop through it against
  # ONNX Runtime's rewrite (scripts/trt_decode_check.py; the rewrites and engine in /tmp/trt-check are reused
  # by a second call where the first ran out of time)
  cd /tmp
  model=${TRT_MODEL:-/tmp/bench-models/llama3b/torchscript/model/model.onnx}
  if [ -f "$model" ]; then
    timeout "${TRT_CHECK_LIMIT:-540}" python3 "$root/scripts/trt_decode_check.py" "$model" --work /tmp/trt-check \
      ${TRT_CHECK_ARGS:-} 2>&1 | tee -a "$OUT/trt_decode_check.log" | tail -30
  else
    echo "no $model: run \`MODELS=llama3b:torchscript bash scripts/gpu_session.sh models\` first" | tee "$OUT/trt_decode_check.log"
  fi
fi
if [ "$step" = wheel ]; then  # the wheel .ci/run builds on the CPU machine (dist/), in parts under /tmp/parts
  # (scripts/carry_wheel.sh), after `ort`: installed into /tmp/tqsite without building, then the CUDA op tests and
  # the genai whole-model tests against it
  mkdir -p /tmp/wheel && WHEEL=/tmp/wheel/$(cat /tmp/parts/wheel-name) && cat /tmp/parts/wheelp* > "$WHEEL"
  rm -rf /tmp/tqsite /tmp/tqsrc && cp -r "$root" /tmp/tqsrc
  python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --target /tmp/tqsite "$WHEEL" \
    && echo "build exit 0 (the wheel $(basename "$WHEEL"), installed)" > /tmp/tq_build.log && touch /tmp/tq_build.done
  cd /tmp
  python3 -c "import onnxruntime as o, turboquant, turboquant.kernel_plan as k; o.preload_dlls()
print(turboquant.__file__, turboquant.ort_library_path(), turboquant.trt_plugin_path())
print('cpu kernels', k.cpu_instruction_set(), '| sm_90a code', bool(k._library().turboquant_sm90a_compiled()), '| device', k.cuda_device())" 2>&1 | tee "$OUT/wheel.log"
  timeout 400 python3 -m pytest -q -p no:cacheprovider "$root/tests/plugins/onnxruntime" -m gpu -rs 2>&1 | tee "$OUT/wheel_gpu_tests.log" | tail -8
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider "$root/tests/export/test_genai.py" -m gpu -rs 2>&1 | tee "$OUT/wheel_genai_tests.log" | tail -8
fi
