// Loading and storing float32/float16/bfloat16 tensors element by element, as float32.
#pragma once

#include <cstdint>

#include "turboquant/format.h"
#include "turboquant/numerics.h"

namespace turboquant {

TQ_HD float load_float(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

TQ_HD void store_float(DType dt, void* base, int64_t i, float v) {
  switch (dt) {
    case DType::kFloat16: static_cast<uint16_t*>(base)[i] = f32_to_f16(v); break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = f32_to_bf16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

// v as a store to dt and a load give it back.
TQ_HD float round_to(DType dt, float v) {
  switch (dt) {
    case DType::kFloat16: return f16_to_f32(f32_to_f16(v));
    case DType::kBFloat16: return bf16_to_f32(f32_to_bf16(v));
    default: return v;
  }
}

// load_float in two steps, the load and the conversion, for kernels that issue several loads before
// converting the first: with load_float's switch around each load and its conversion the compiler
// waits for each load in turn (a round trip to memory each).
TQ_HD uint32_t load_bits(DType dt, const void* base, int64_t i) {
  return dt == DType::kFloat32 ? static_cast<const uint32_t*>(base)[i] : static_cast<const uint16_t*>(base)[i];
}
TQ_HD float bits_float(DType dt, uint32_t bits) {
  switch (dt) {
    case DType::kFloat16: return f16_to_f32(static_cast<uint16_t>(bits));
    case DType::kBFloat16: return bf16_to_f32(static_cast<uint16_t>(bits));
    default: return bits_f32(bits);
  }
}

// n contiguous elements starting at element `first`.
TQ_HD void load_row(DType dt, const void* base, int64_t first, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = load_float(dt, base, first + i);
}

}  // namespace turboquant
