// CPU kernels of the turboquant ops. They take raw pointers and sizes and know nothing of
// ONNX Runtime or TensorRT; the runtime adapters validate tensors and call them.
// Preconditions (the adapters check them): head dims supported (format.h), Hq % Hkv == 0,
// buffers of the sizes stated below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "turboquant/format.h"

namespace turboquant::cpu {

// Runs fn(i) for every i in [0, n), possibly concurrently. Adapters map it onto their runtime's
// thread pool (ORT: the session's intra-op pool); serial_for is the single-threaded fallback.
using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& fn)>;
void serial_for(size_t n, const std::function<void(size_t)>& fn);

// Optional per-head offsets, float32 [rows, D]: vector v uses row (v / period) % rows.
// (For a cache laid out [B, H, S, D]: rows = H, period = S.) data == nullptr means no offset.
struct Offset {
  const float* data = nullptr;
  int64_t rows = 1;
  int64_t period = 1;
  const float* row_for(int64_t v, int d) const { return data ? data + ((v / period) % rows) * d : nullptr; }
};

// One vector: encode x[0..d) (float32, offset already removed) into out[0..packed_size).
void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out);
// One vector: decode packed bytes into out[0..d) float32 (no offset added).
void decode_vector(Format fmt, int d, const uint8_t* in, float* out);

// x: n vectors of d elements of type dt; out: n * packed_size(fmt, d) bytes.
void pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
          uint8_t* out, const ParallelFor& pfor);
// in: n packed vectors; out: n * d elements of type dt.
void unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
            const ParallelFor& pfor);

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

// present_key/present_value: [B, Hkv, past_len + new_len, bytes]; past_* : [B, Hkv, past_len, bytes].
void attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
               const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
               uint8_t* present_value, const ParallelFor& pfor);

}  // namespace turboquant::cpu
