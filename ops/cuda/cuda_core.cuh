// What the CUDA-core kernels of TQAttention share (attention_split.cu's split kernel and finish.cu's
// merge): their block size and the causal/mask test, the warp reductions.
#pragma once

#include <cstdint>

#include "mask.cuh"
#include "turboquant/params.h"

namespace turboquant::cuda::detail {

constexpr int kThreads = 128;

// The term key j adds to query row pos's score (b, query head hq): the mask's, and whether the key
// is allowed at all (causal, the sliding window, a bool mask).
__device__ inline float mask_value(const AttentionParams& p, const void* mask, int64_t b, int64_t hq, int64_t pos, int64_t j,
                                   bool* allowed) {
  *allowed = true;
  if (p.is_causal && j > pos + (p.past_of(b) + p.new_len - p.q_len)) {
    *allowed = false;
    return 0.0f;
  }
  if (p.window > 0 && before_window(p, p.past_of(b), pos, j)) {
    *allowed = false;
    return 0.0f;
  }
  if (p.mask_type == MaskType::kNone) return 0.0f;
  float add;
  *allowed = mask_allows(p, mask, mask_at(p, b, hq, pos, j), &add);
  return add;
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
