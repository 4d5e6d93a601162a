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

}  // namespace turboquant::cuda::detail
