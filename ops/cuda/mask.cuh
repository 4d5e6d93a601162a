// The attention mask of TQAttention as the CUDA kernels read it (attention_split.cu, attention_tc.cu,
// finish.cu, prefill.cu): a bool mask allows a key where it is true, an additive one (float32, fp16,
// bf16) adds its element to the score; p.mask_stride broadcasts it (0 on the axes it lacks).
#pragma once

#include <cstdint>

#include "turboquant/float_io.h"
#include "turboquant/params.h"

namespace turboquant::cuda::detail {

// The element of query row pos (batch b, query head hq) and key `key` (the past's tokens first,
// then the call's new ones).
__device__ __forceinline__ int64_t mask_at(const AttentionParams& p, int64_t b, int64_t hq, int64_t pos, int64_t key) {
  return b * p.mask_stride[0] + hq * p.mask_stride[1] + pos * p.mask_stride[2] + key * p.mask_stride[3];
}

// Whether the element at `at` allows its key, and the term it adds to the score (0 for bool masks).
__device__ __forceinline__ bool mask_allows(const AttentionParams& p, const void* mask, int64_t at, float* add) {
  switch (p.mask_type) {
    case MaskType::kBool: *add = 0.0f; return static_cast<const uint8_t*>(mask)[at] != 0;
    case MaskType::kFloat32: *add = static_cast<const float*>(mask)[at]; return true;
    case MaskType::kFloat16: *add = f16_to_f32(static_cast<const uint16_t*>(mask)[at]); return true;
    case MaskType::kBFloat16: *add = bf16_to_f32(static_cast<const uint16_t*>(mask)[at]); return true;
    default: *add = 0.0f; return true;
  }
}

// GroupQueryAttention's sliding window (p.window > 0), keys numbered as above: query row pos of a
// sequence with `past` tokens is at position past + new_len - q_len + pos and sees keys from that
// position - window + 1. window_first_key: the first past token the sequence's earliest row sees, where
// the split kernels start (the keys before it are skipped, not masked); 0 without a window.
__device__ __forceinline__ int64_t window_first_key(const AttentionParams& p, int64_t past) {
  if (p.window <= 0) return 0;
  const int64_t first = past + p.new_len - p.q_len - p.window + 1;
  return first > 0 ? first : 0;
}
__device__ __forceinline__ bool before_window(const AttentionParams& p, int64_t past, int64_t pos, int64_t key) {
  return p.window > 0 && key < past + p.new_len - p.q_len + pos - p.window + 1;
}

// Gemma 2's softcap of a score: cap * tanh(s / cap) of the score as the op defines it. The kernels'
// scores are of the keys minus key_offset, `shift` = scale * q . key_offset below that score (a
// softmax does not see a row's constant shift; the tanh does), and stay in those units.
__device__ __forceinline__ float softcapped(float s, float cap, float shift) {
  return cap * tanhf((s + shift) / cap) - shift;
}

}  // namespace turboquant::cuda::detail
