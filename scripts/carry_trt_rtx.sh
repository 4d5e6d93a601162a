#!/usr/bin/env bash
# Here (a machine with PyPI): TensorRT for RTX's wheels (the builder and runtime library, its ONNX
# parser, the Python 3.12 bindings) for the GPU machine, which has no package index and takes 64 MiB
# per call of the device tool. The libraries' wheel (95 MB, already compressed) is split into parts of
# 61 MB, .carry/trt-rtx-1 and trt-rtx-2, the bindings' wheel in the last. Carry one per call, back to
# back, each moved to /tmp/trtparts there; `scripts/gpu_session.sh trt-rtx` then installs both into
# /tmp/site and runs the engine tests.
set -euo pipefail
ver=${TRT_RTX_VERSION:-1.7.1.116}
cache=${TMPDIR:-/tmp}/carry-trt-rtx-$ver
mkdir -p "$cache"
# shellcheck source=scripts/carry_common.sh
source "$(dirname "$0")/carry_common.sh"
ls "$cache"/tensorrt_rtx_cu13_libs-"$ver"-*.whl > /dev/null 2>&1 || download_cp312 "$cache" "tensorrt-rtx-cu13-libs==$ver"
ls "$cache"/tensorrt_rtx_cu13_bindings-"$ver"-*.whl > /dev/null 2>&1 || download_cp312 "$cache" "tensorrt-rtx-cu13-bindings==$ver"
libs=$(ls "$cache"/tensorrt_rtx_cu13_libs-"$ver"-*.whl)
split_to_carry "$libs" trt-rtx trtp
i=$CARRY_PARTS
basename "$libs" > ".carry/trt-rtx-$i/libs-wheel-name"
cp "$cache"/tensorrt_rtx_cu13_bindings-"$ver"-*.whl ".carry/trt-rtx-$i/"
du -sh .carry/trt-rtx-*
echo "made .carry/trt-rtx-1 .. trt-rtx-$i; on the GPU machine: mkdir -p /tmp/trtparts && mv .carry/trt-rtx-K/* /tmp/trtparts/ (one call each), then bash scripts/gpu_session.sh trt-rtx"
