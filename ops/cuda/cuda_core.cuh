// What the CUDA-core kernels of TQAttention share (attention_split.cu's split kernel and finish.cu's
// merge): their block size and the causal/mask test, the warp reductions.
#pragma once

#include <cstdint>

#include "turboquant/float_io.h"
#include "turboquant/params.h"

namespace turboquant::cuda::detail {

constexpr int kThreads = 128;

// The term key j adds to query row pos's score (b, query head hq): the mask's, and whether the key
// is allowed at all (causal, a bool mask).
__device__ inline float mask_value(const AttentionParams& p, const void* mask, int64_t b, int64_t hq, int64_t pos, int64_t j,
                            bool* allowed) {
  *allowed = true;
  if (p.is_causal && j > pos + (p.past_of(b) + p.new_len - p.q_len)) {
    *allowed = false;
    return 0.0f;
  }
  if (p.mask_type == MaskType::kNone) return 0.0f;
  const int64_t i = b * p.mask_stride[0] + hq * p.mask_stride[1] + pos * p.mask_stride[2] + j * p.mask_stride[3];
  switch (p.mask_type) {
    case MaskType::kBool:
      *allowed = static_cast<const uint8_t*>(mask)[i] != 0;
      return 0.0f;
    case MaskType::kFloat32: return static_cast<const float*>(mask)[i];
    case MaskType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(mask)[i]);
    case MaskType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(mask)[i]);
    default: return 0.0f;
  }
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace turboquant::cuda::detail
