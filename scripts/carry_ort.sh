#!/usr/bin/env bash
# Here (a machine with PyPI): onnxruntime-gpu and onnxruntime-genai-cuda for the GPU machine, which has
# no package index and takes 64 MiB per call of the device tool. The GPU wheel unpacked without its
# TensorRT provider and packed with xz is 4 parts where the wheel itself is 5 (shared/device/
# prepare-ortgpu.sh): .carry/ort-1 .. ort-4, genai's wheel in the last. Carry one per call, back to
# back, each moved to /tmp/parts there; `scripts/gpu_session.sh ort` then installs both into /tmp/site.
set -euo pipefail
ver=${ORT_GPU_VERSION:-1.31.1} genai=${GENAI_VERSION:-0.18.0}
cache=${TMPDIR:-/tmp}/carry-ort-$ver
mkdir -p "$cache"
# shellcheck source=scripts/carry_common.sh
source "$(dirname "$0")/carry_common.sh"
ls "$cache"/onnxruntime_gpu-"$ver"-*.whl > /dev/null 2>&1 || download_cp312 "$cache" "onnxruntime-gpu==$ver"
ls "$cache"/onnxruntime_genai_cuda-"$genai"-*.whl > /dev/null 2>&1 || download_cp312 "$cache" "onnxruntime-genai-cuda==$genai"
if [ ! -f "$cache/ort.tar.xz" ]; then
  rm -rf "$cache/tree" && mkdir "$cache/tree"
  (cd "$cache/tree" && unzip -q ../onnxruntime_gpu-"$ver"-*.whl && rm -f onnxruntime/capi/libonnxruntime_providers_tensorrt.so &&
     tar -cf - . | xz -9 -T0 > ../ort.tar.xz.tmp) && mv "$cache/ort.tar.xz.tmp" "$cache/ort.tar.xz"
fi
split_to_carry "$cache/ort.tar.xz" ort ortp
i=$CARRY_PARTS
cp "$cache"/onnxruntime_genai_cuda-"$genai"-*.whl ".carry/ort-$i/"
echo "made .carry/ort-1 .. ort-$i; on the GPU machine: mkdir -p /tmp/parts && mv .carry/ort-K/* /tmp/parts/ (one call each), then bash scripts/gpu_session.sh ort"
