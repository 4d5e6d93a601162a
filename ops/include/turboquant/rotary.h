// One head's rotary embedding, shared by the CPU and CUDA kernels (float32 math, as ORT's
// RotaryEmbedding computes it; the result is rounded to the tensor's dtype by the caller's store).
#pragma once

#include "turboquant/float_io.h"
#include "turboquant/params.h"

namespace turboquant {

// x[0..d) rotated in place for position pos (clamped to the table; the adapters check it first).
TQ_HD void rotate_head(const RotaryParams& r, DType dt, int d, int64_t pos, float* x) {
  const int half = r.rotary_dim / 2;
  if (half <= 0 || half * 2 > d || r.max_positions <= 0) return;
  pos = pos < 0 ? 0 : (pos >= r.max_positions ? r.max_positions - 1 : pos);
  for (int i = 0; i < half; ++i) {
    const float c = load_float(dt, r.cos, pos * half + i), s = load_float(dt, r.sin, pos * half + i);
    const int a = r.interleaved ? 2 * i : i, b = r.interleaved ? 2 * i + 1 : i + half;
    const float xa = x[a], xb = x[b];
    x[a] = xa * c - xb * s;
    x[b] = xb * c + xa * s;
  }
}

}  // namespace turboquant
