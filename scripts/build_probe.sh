#!/usr/bin/env bash
# Builds scripts/cuda_attention_probe.cu (the TQAttention launcher alone, against the CPU kernels)
# with the flags CMake gives each file: the packing code without contraction, so the new rows it
# writes are byte-identical to the CPU's; and scripts/cuda_pack_probe.cu (TQPack's kernels against
# the CPU's, and their throughput) as OUT.pack. Developer variants, as OUT.VARIANT (VARIANTS, default
# "nopdl phases"): nopdl, no programmatic dependent launches (A/B timings); phases, the kernels mark
# the times of their phases (TQ_PHASES, split_common.cuh) and the probe prints them; NAME:FLAGS,
# the kernels built with FLAGS (comma-separated), e.g. both:-DTQ_PHASES,-DTQ_NO_PDL. TQPack's
# developer variants, as OUT.pack.NAME (PACK_VARIANTS, default none): NAME:FLAGS, the pack probe and
# TQPack's kernels built with FLAGS, e.g. b6:-DTQ_STREAM_BLOCKS_MSE3=6 (pack_four_lanes.cuh).
#   [VARIANTS="..."] [PACK_VARIANTS="..."] bash scripts/build_probe.sh OUT [ARCH]   (ARCH: 90)
set -euo pipefail
out=$1
arch=${2:-90}
variants=${VARIANTS-nopdl phases}
pack_variants=${PACK_VARIANTS-}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c++17 -O3 -arch=sm_$arch -lineinfo --expt-relaxed-constexpr -Iops/include)
# on sm_90, the sm_90a kernels (wgmma) too, as CMake builds them (TQ_SM90A tells the rest they are there)
sm90a=()
if [[ $arch == 90 ]]; then
  flags+=(-DTQ_SM90A=1)
  sm90a=(ops/cuda/prefill_sm90.cu ops/cuda/past_chunk_sm90.cu)
fi
"$nvcc" "${flags[@]}" -fmad=false -c ops/cuda/pack.cu -o "$tmp/pack_cu.o" &
"$nvcc" "${flags[@]}" -Xcompiler -ffp-contract=off -x c++ -c ops/cpu/pack.cpp -o "$tmp/pack_cpp.o" &
"$nvcc" "${flags[@]}" -x c++ -c ops/cpu/attention.cpp -o "$tmp/attention_cpp.o" &
"$nvcc" "${flags[@]}" -x c++ -c ops/cpu/gqa.cpp -o "$tmp/gqa_cpp.o" &
"$nvcc" "${flags[@]}" -c scripts/cuda_pack_probe.cu -o "$tmp/pack_probe.o" &
for v in base $variants; do
  case $v in
    base) vflags=() ;;
    nopdl) vflags=(-DTQ_NO_PDL) ;;
    phases) vflags=(-DTQ_PHASES) ;;
    *:*) ;;  # NAME:FLAGS, below
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  name=${v%%:*}
  [[ $v == *:* ]] && IFS=, read -r -a vflags <<< "${v#*:}"
  mkdir -p "$tmp/$name"
  for f in ops/cuda/attention.cu ops/cuda/attention_split.cu ops/cuda/finish.cu ops/cuda/copy.cu ops/cuda/attention_mma.cu ops/cuda/attention_tc.cu ops/cuda/gqa.cu ops/cuda/prefill.cu ops/cuda/past_chunk.cu scripts/cuda_attention_probe.cu; do
    "$nvcc" "${flags[@]}" "${vflags[@]}" -c "$f" -o "$tmp/$name/$(basename "$f" .cu).o" &
  done
  for f in "${sm90a[@]}"; do
    "$nvcc" "${flags[@]/-arch=sm_$arch/-gencode=arch=compute_90a,code=sm_90a}" "${vflags[@]}" -c "$f" -o "$tmp/$name/$(basename "$f" .cu).o" &
  done
  # the planner sizes the kernels' launches: built with the same flags (TQ_TC_WARPS)
  "$nvcc" "${flags[@]}" "${vflags[@]}" -x c++ -c ops/cuda/split_plan.cpp -o "$tmp/$name/split_plan.o" &
done
for v in $pack_variants; do
  [[ $v == *:* ]] || { echo "a pack variant is NAME:FLAGS, not $v" >&2; exit 2; }
  IFS=, read -r -a vflags <<< "${v#*:}"
  mkdir -p "$tmp/pack.${v%%:*}"
  "$nvcc" "${flags[@]}" "${vflags[@]}" -fmad=false -c ops/cuda/pack.cu -o "$tmp/pack.${v%%:*}/pack_cu.o" &
  "$nvcc" "${flags[@]}" "${vflags[@]}" -c scripts/cuda_pack_probe.cu -o "$tmp/pack.${v%%:*}/pack_probe.o" &
done
wait
"$nvcc" -arch=sm_$arch "$tmp/pack_probe.o" "$tmp/pack_cu.o" "$tmp/pack_cpp.o" -o "$out.pack"
for v in $pack_variants; do
  "$nvcc" -arch=sm_$arch "$tmp/pack.${v%%:*}/pack_probe.o" "$tmp/pack.${v%%:*}/pack_cu.o" "$tmp/pack_cpp.o" -o "$out.pack.${v%%:*}"
done
common=("$tmp/pack_cu.o" "$tmp/pack_cpp.o" "$tmp/attention_cpp.o" "$tmp/gqa_cpp.o")
"$nvcc" -arch=sm_$arch "${common[@]}" "$tmp/base"/*.o -o "$out"
for v in $variants; do "$nvcc" -arch=sm_$arch "${common[@]}" "$tmp/${v%%:*}"/*.o -o "$out.${v%%:*}"; done
