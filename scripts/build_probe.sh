#!/usr/bin/env bash
# Builds scripts/cuda_attention_probe.cu (the TQAttention launcher alone, against the CPU kernels)
# with the flags CMake gives each file: the packing code without contraction, so the new rows it
# writes are byte-identical to the CPU's; and scripts/cuda_pack_probe.cu (TQPack's kernels against
# the CPU's, and their throughput) as OUT.pack; for A/B timings, OUT.nopdl (no programmatic dependent
# launches).   bash scripts/build_probe.sh OUT [ARCH]   (ARCH: 90)
set -euo pipefail
out=$1
arch=${2:-90}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
flags=(-std=c++17 -O3 -arch=sm_$arch -lineinfo --expt-relaxed-constexpr -Iops/include)
"$nvcc" "${flags[@]}" -fmad=false -c ops/cuda/pack.cu -o "$tmp/pack_cu.o" &
"$nvcc" "${flags[@]}" -Xcompiler -ffp-contract=off -x c++ -c ops/cpu/pack.cpp -o "$tmp/pack_cpp.o" &
mkdir -p "$tmp/nopdl"
for f in attention attention_mma attention_tc; do
  "$nvcc" "${flags[@]}" -c "ops/cuda/$f.cu" -o "$tmp/$f.o" &
  "$nvcc" "${flags[@]}" -DTQ_NO_PDL -c "ops/cuda/$f.cu" -o "$tmp/nopdl/$f.o" &
done
"$nvcc" "${flags[@]}" -x c++ -c ops/cpu/attention.cpp -o "$tmp/attention_cpp.o" &
"$nvcc" "${flags[@]}" -c scripts/cuda_attention_probe.cu -o "$tmp/probe.o" &
"$nvcc" "${flags[@]}" -c scripts/cuda_pack_probe.cu -o "$tmp/pack_probe.o" &
wait
"$nvcc" -arch=sm_$arch "$tmp/pack_probe.o" "$tmp/pack_cu.o" "$tmp/pack_cpp.o" -o "$out.pack"
rm "$tmp/pack_probe.o"
common=("$tmp/pack_cu.o" "$tmp/pack_cpp.o" "$tmp/attention_cpp.o" "$tmp/probe.o")
"$nvcc" -arch=sm_$arch "$tmp"/*.o -o "$out"
for v in nopdl; do "$nvcc" -arch=sm_$arch "${common[@]}" "$tmp/$v"/*.o -o "$out.$v"; done
