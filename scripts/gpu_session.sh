#!/usr/bin/env bash
# On the GPU machine (see the device tool): build the package with its CUDA kernels, then run the
# ORT op tests on the CUDA execution provider, compute-sanitizer on a subset, and the CUDA bench.
# Expects onnxruntime-gpu under /tmp/site (shared/device/prepare-ortgpu.sh) and the ONNX Runtime
# headers in third_party/ (scripts/fetch_headers.sh). Logs go to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/tqsite PYTHONUNBUFFERED=1
root=$(pwd)
step=${1:-all}
if [ "$step" = build ] || [ "$step" = all ]; then
  rm -rf /tmp/tqsrc && cp -r "$root" /tmp/tqsrc
  ( cd /tmp/tqsrc && CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DORT_INCLUDE_DIR=/tmp/tqsrc/third_party/onnxruntime/include" \
      rm -rf /tmp/tqsite && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/tqsite . ) > /tmp/tq_build.log 2>&1
  echo "build exit $?" >> /tmp/tq_build.log
fi
if [ "$step" = test ] || [ "$step" = all ]; then
  cp /tmp/tq_build.log "$OUT/build.log" 2>/dev/null
  cd /tmp
  python3 -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())" 2>&1 | tee "$OUT/providers.log"
  timeout 400 python3 -m pytest -q -p no:cacheprovider "$root/tests/plugins/onnxruntime" -k cuda -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
