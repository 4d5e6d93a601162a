// Parameters shared by the CPU and CUDA kernels: offsets, layouts and the attention call.
#pragma once

#include <cstdint>

#include "turboquant/format.h"

namespace turboquant {

// Optional per-head offsets, float32 [rows, D]: vector v uses row (v / period) % rows.
// (For a cache laid out [B, H, S, D]: rows = H, period = S.) data == nullptr means no offset.
struct Offset {
  const float* data = nullptr;
  int64_t rows = 1;
  int64_t period = 1;
  TQ_HD const float* row_for(int64_t v, int d) const { return data ? data + ((v / period) % rows) * d : nullptr; }
};

// Strides (in elements) of a [B, H, S, D] view of a tensor stored as [B, H, S, D] or [B, S, H*D].
struct BhsStrides {
  int64_t b = 0, h = 0, s = 0;
};

enum class MaskType : int { kNone = 0, kBool, kFloat32, kFloat16, kBFloat16 };

struct AttentionParams {
  int64_t batch = 0, q_heads = 0, kv_heads = 0;
  int64_t q_len = 0;     // Sq: query tokens in this call
  int64_t new_len = 0;   // new K/V tokens in this call
  int64_t past_len = 0;  // S_past: tokens already in the packed cache
  int head_dim = 0;      // D of Q and K
  int v_head_dim = 0;    // D of V and Y
  Format key_format = Format::kMse4, value_format = Format::kUint4;
  bool norm_correction = true;
  bool is_causal = false;
  float scale = 0.f;  // softmax scale; the adapter resolves the 1/sqrt(D) default
  DType dtype = DType::kFloat32;  // of Q, K, V and Y
  BhsStrides q, k, v, y;
  MaskType mask_type = MaskType::kNone;
  int64_t mask_stride[4] = {0, 0, 0, 0};  // b, hq, q, k strides in elements; 0 where broadcast
  const float* key_offset = nullptr;      // [kv_heads, head_dim] or nullptr
  const float* value_offset = nullptr;    // [kv_heads, v_head_dim] or nullptr
};

}  // namespace turboquant
