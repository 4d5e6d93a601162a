// A head's values held by a warp's lanes (lane + 32 c, c < kC), converted, rounded and turned by the
// rotary embedding in registers: the new keys' packing (pack_warp_per_vector.cuh) and the split
// kernel's query rows (attention_tc.cu). The same operations in the same order as rotate_shared
// (turboquant/rotary.h), so the results are the CPU kernels' bits; one branch on the dtype for all
// of a lane's values and the table's cosines and sines loaded together: a decode step's chain.
#pragma once

#include <cstdint>

#include "turboquant/float_io.h"
#include "turboquant/rotary.h"

namespace turboquant::cuda::detail {

template <int kN>
__device__ inline void bits_floats(DType dt, const uint32_t (&b)[kN], float (&x)[kN]) {
  if (dt == DType::kFloat16) {
#pragma unroll
    for (int c = 0; c < kN; ++c) x[c] = f16_to_f32(static_cast<uint16_t>(b[c]));
  } else if (dt == DType::kBFloat16) {
#pragma unroll
    for (int c = 0; c < kN; ++c) x[c] = bf16_to_f32(static_cast<uint16_t>(b[c]));
  } else {
#pragma unroll
    for (int c = 0; c < kN; ++c) x[c] = bits_f32(b[c]);
  }
}

template <int kN>
__device__ inline void round_all(DType dt, float (&x)[kN]) {
  if (dt == DType::kFloat16) {
#pragma unroll
    for (int c = 0; c < kN; ++c) x[c] = f16_to_f32(f32_to_f16(x[c]));
  } else if (dt == DType::kBFloat16) {
#pragma unroll
    for (int c = 0; c < kN; ++c) x[c] = bf16_to_f32(f32_to_bf16(x[c]));
  }
}

// Whether the rotation of a head of d = 32 kC pairs values of one lane: the halves' layout
// (not interleaved) over the whole head.
template <int kC>
__device__ inline bool rotates_in_lanes(const RotaryParams& r, int d) {
  return kC % 2 == 0 && !r.interleaved && r.rotary_dim == d && d == 32 * kC && rotary_applies(r, d);
}

// Loads into L2 the table rows of position pos (before a kernel's dependency wait: the tables are
// inputs of the op, and a prefetch changes no value).
__device__ inline void prefetch_rotary_rows(const RotaryParams& r, DType dt, int64_t pos, int lane) {
  const int64_t bytes = static_cast<int64_t>(r.rotary_dim / 2) * dtype_size(dt);
  const int64_t at = table_position(r, pos) * bytes;
  for (int64_t o = 128 * lane; o < bytes; o += 32 * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(r.cos) + at + o));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(r.sin) + at + o));
  }
}

// x (rotates_in_lanes) turned for position pos, times or divided by the key scale row s (side),
// each value rounded to dt, as rotate_shared.
template <int kC>
__device__ inline void rotate_lanes(const RotaryParams& r, DType dt, int64_t pos, float (&x)[kC], const float* s,
                                    ScaleSide side) {
  constexpr int kHalf = kC / 2;
  const int lane = threadIdx.x & 31;
  const int64_t row = table_position(r, pos) * (r.rotary_dim / 2);
  uint32_t cb[kHalf], sb[kHalf];
#pragma unroll
  for (int c = 0; c < kHalf; ++c) {
    cb[c] = load_bits(dt, r.cos, row + lane + 32 * c);
    sb[c] = load_bits(dt, r.sin, row + lane + 32 * c);
  }
  float co[kHalf], si[kHalf];
  bits_floats(dt, cb, co);
  bits_floats(dt, sb, si);
#pragma unroll
  for (int c = 0; c < kHalf; ++c) {
    const int i = lane + 32 * c;
    turn(co[c], si[c], &x[c], &x[c + kHalf]);
    x[c] = scaled(s, side, i, x[c]);
    x[c + kHalf] = scaled(s, side, i + 32 * kHalf, x[c + kHalf]);
  }
  round_all(dt, x);
}

}  // namespace turboquant::cuda::detail
