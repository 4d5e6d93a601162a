// One head's rotary embedding, shared by the CPU and CUDA kernels (float32 math, as ORT's
// RotaryEmbedding computes it; the result is rounded to the tensor's dtype by the caller's store).
#pragma once

#include "turboquant/float_io.h"
#include "turboquant/params.h"

namespace turboquant {

// Whether the table rotates heads of size d (the adapters check the shapes first; a table that does
// not fit leaves the head as it is).
TQ_HD bool rotary_applies(const RotaryParams& r, int d) {
  const int half = r.rotary_dim / 2;
  return half > 0 && half * 2 <= d && r.max_positions > 0;
}

// The elements a and b that pair i of the rotation turns: neighbours (interleaved) or the two halves.
TQ_HD void rotary_pair_index(const RotaryParams& r, int i, int* a, int* b) {
  const int half = r.rotary_dim / 2;
  *a = r.interleaved ? 2 * i : i;
  *b = r.interleaved ? 2 * i + 1 : i + half;
}

// The table row of position pos: clamped to the table.
TQ_HD int64_t table_position(const RotaryParams& r, int64_t pos) {
  return pos < 0 ? 0 : (pos >= r.max_positions ? r.max_positions - 1 : pos);
}

// (xa, xb) turned by the angle whose cosine and sine are c and s.
TQ_HD void turn(float c, float s, float* xa, float* xb) {
  const float a = *xa, b = *xb;
#if defined(__CUDA_ARCH__)  // rounded operations the compiler cannot fuse, as the CPU's (no contraction)
  *xa = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  *xb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
#else
  *xa = a * c - b * s;
  *xb = b * c + a * s;
#endif
}

// Pair i of the rotation, (xa, xb) = (x[a], x[b]), turned by the angle of position pos (clamped to
// the table).
TQ_HD void rotate_pair(const RotaryParams& r, DType dt, int64_t pos, int i, float* xa, float* xb) {
  const int64_t at = table_position(r, pos) * (r.rotary_dim / 2) + i;
  turn(load_float(dt, r.cos, at), load_float(dt, r.sin, at), xa, xb);
}

// Which side of the scores a rotated head is on: the op's key_scale multiplies queries and divides keys.
enum class ScaleSide { kQuery, kKey };

// The key_scale row of KV head hkv, or null (no key_scale).
TQ_HD const float* key_scale_row(const RotaryParams& r, int64_t hkv, int d) {
  return r.key_scale ? r.key_scale + hkv * d : nullptr;
}

// Channel i of a rotated head after the key scale row s (null: none).
TQ_HD float scaled(const float* s, ScaleSide side, int i, float x) {
  if (!s) return x;
#if defined(__CUDA_ARCH__)  // rounded as the CPU's
  return side == ScaleSide::kKey ? __fdiv_rn(x, s[i]) : __fmul_rn(x, s[i]);
#else
  return side == ScaleSide::kKey ? x / s[i] : x * s[i];
#endif
}

// The rotation of one head held by n threads (thread t of n: pairs t, t + n, ...) in memory x that
// they share, then the key scale row s (null: none), each result rounded to dt once as a rotated
// tensor stored in dt would hold it: the attention kernels that rotate Q and the new K themselves
// instead of reading a rotated copy. The caller synchronises the threads before (x loaded) and after.
TQ_HD void rotate_shared(const RotaryParams& r, DType dt, int d, int64_t pos, float* x, int t, int n,
                         const float* s, ScaleSide side) {
  const int turned = rotary_applies(r, d) ? r.rotary_dim : 0;
  for (int i = t; i < turned / 2; i += n) {
    int a, b;
    rotary_pair_index(r, i, &a, &b);
    rotate_pair(r, dt, pos, i, &x[a], &x[b]);
    x[a] = round_to(dt, scaled(s, side, a, x[a]));
    x[b] = round_to(dt, scaled(s, side, b, x[b]));
  }
  if (s) {
    for (int i = turned + t; i < d; i += n) x[i] = round_to(dt, scaled(s, side, i, x[i]));
  }
}

// The position of token s of sequence b whose past is `past` tokens long: position_ids[b, s], or
// past + s.
TQ_HD int64_t rotary_position(const RotaryParams& r, int64_t b, int64_t s, int64_t seq_len, int64_t past) {
  return r.position_ids ? r.position_ids[b * seq_len + s] : past + s;
}

// x[0..d) rotated in place for position pos, then the key scale row s (null: none).
TQ_HD void rotate_head(const RotaryParams& r, DType dt, int d, int64_t pos, float* x, const float* s,
                       ScaleSide side) {
  if (rotary_applies(r, d)) {
    for (int i = 0; i < r.rotary_dim / 2; ++i) {
      int a, b;
      rotary_pair_index(r, i, &a, &b);
      rotate_pair(r, dt, pos, i, &x[a], &x[b]);
    }
  }
  if (s) {
    for (int i = 0; i < d; ++i) x[i] = scaled(s, side, i, x[i]);
  }
}

}  // namespace turboquant
