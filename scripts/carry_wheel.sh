#!/usr/bin/env bash
# Here: the wheel .ci/run builds (dist/turboquant_onnx-*.whl) for the GPU machine, which takes 64 MiB per call of
# the device tool: .carry/wheel-1 (.. wheel-N for a larger wheel, parts of 61000000 bytes), the wheel's name in
# wheel-1/wheel-name. Carry one per call, back to back, each moved to /tmp/parts there (after carry_ort.sh's parts
# and `gpu_session.sh ort`); `scripts/gpu_session.sh wheel` then installs it and runs its GPU tests.
set -euo pipefail
shopt -s nullglob
wheels=(dist/turboquant_onnx-*.whl)
[ ${#wheels[@]} = 1 ] || { echo "carry_wheel.sh: want one dist/turboquant_onnx-*.whl (.ci/run's wheel step), found ${#wheels[@]}" >&2; exit 2; }
# shellcheck source=scripts/carry_common.sh
source "$(dirname "$0")/carry_common.sh"
split_to_carry "${wheels[0]}" wheel wheelp
i=$CARRY_PARTS
basename "${wheels[0]}" > .carry/wheel-1/wheel-name
echo "made .carry/wheel-1 .. wheel-$i from ${wheels[0]} ($(du -h "${wheels[0]}" | cut -f1)); on the GPU machine: mkdir -p /tmp/parts && mv .carry/wheel-K/* /tmp/parts/ (one call each), then bash scripts/gpu_session.sh wheel"
