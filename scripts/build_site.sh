#!/usr/bin/env bash
# Builds the package for the GPU machine on this machine's CPUs (CUDA kernels for sm_90, the ONNX
# Runtime and TensorRT headers from third_party/) and packs it as OUT, a .tgz holding tqsite/, to
# carry there and unpack with `gpu_session.sh site` instead of its `build`: the device's own build
# takes ~6 min of its time, this one ~4 min of this machine's. Builds the working tree as it is.
#   bash scripts/build_site.sh .carry/site/tqsite.tgz
set -euo pipefail
out=$(realpath -m "$1")
[ -e "$out" ] && { echo "build_site.sh: $out exists; not overwritten" >&2; exit 2; }
[ -d third_party/onnxruntime/include ] || { echo "build_site.sh: run scripts/fetch_headers.sh first" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src"
tar c --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./.carry --exclude=./.site . | tar x -C "$tmp/src"
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90 -DORT_INCLUDE_DIR=$tmp/src/third_party/onnxruntime/include" \
  python3 -m pip install -q --no-deps --target "$tmp/tqsite" "$tmp/src"
ls "$tmp/tqsite/turboquant/lib/"
mkdir -p "$(dirname "$out")"
tar czf "$tmp/tqsite.tgz" -C "$tmp" tqsite && mv "$tmp/tqsite.tgz" "$out"
echo "built $out ($(du -h "$out" | cut -f1))"
