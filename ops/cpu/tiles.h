// Register-blocked float32 tiles for the CPU attention kernel (included by attention.cpp only, which
// is compiled with contraction on): query rows x a tile of float32 keys (exact new ones or decoded
// past ones), scores and the weighted sum of values, plus the vectorised exp, row loads and transposes
// they need. Vectors are GCC/Clang vector extensions,
// so the same code is AVX2/FMA on x86-64-v3 and NEON on ARM.
#pragma once

#include <cstdint>
#include <cstring>

#include "turboquant/float_io.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace turboquant::cpu::tiles {

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }

// Keys per tile of exact keys: the score tile is rows x kKeys, the transposed key tile D x kKeys.
constexpr int kKeys = 64;
// Rows per register block: 6 rows x 16 columns of accumulators is 12 of AVX2's 16 registers.
constexpr int kRowBlock = 6;

// exp(x) for x <= 0 (scores minus their row maximum), eight at a time: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7). Below -87 (and for -inf, the
// masked keys) it is exactly 0. n = trunc(y - 0.5) rounds y = x / ln2 <= 0 to nearest.
inline V8 exp_nonpositive8(V8 x) {
  const V8 lo = V8{} - 87.0f;
  const V8 xc = x < lo ? lo : x;
  const I8 ni = __builtin_convertvector(xc * 1.44269504088896341f - 0.5f, I8);
  const V8 n = __builtin_convertvector(ni, V8);
  const V8 r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  V8 p = V8{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V8 scale = (V8)((ni + 127) << 23);  // a vector cast keeps the bits
  return x < lo ? V8{} : p * scale;
}

// n (a multiple of 8) contiguous elements of dtype dt from element `first`, as float32.
inline void load_row8(DType dt, const void* base, int64_t first, int n, float* out) {
  if (dt == DType::kFloat32) {
    std::memcpy(out, static_cast<const float*>(base) + first, sizeof(float) * n);
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(base) + first;
  if (dt == DType::kBFloat16) {
    for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
    return;
  }
#if defined(__F16C__)
  for (int i = 0; i < n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
#else
  for (int i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
#endif
}

// kt[i][0 .. 8) = rows[0 .. 8)[i] for i < d (d a multiple of 8; rows ld floats apart, kt rows kKeys):
// eight decoded keys into eight columns of a transposed key tile, in 8 x 8 register transposes.
inline void transpose8(const float* rows, int ld, int d, float* kt) {
#if defined(__AVX2__)
  for (int i = 0; i < d; i += 8) {
    __m256 r[8], t[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(rows + k * ld + i);
    for (int k = 0; k < 8; k += 2) {
      t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]);
      t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    }
    for (int k = 0; k < 8; k += 4) {
      r[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44);
      r[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
      r[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44);
      r[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    // r[0..3]: columns 0, 1, 2, 3 of rows 0-3 (low lanes) and of columns 4-7 (high lanes); r[4..7] rows 4-7
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(kt + (i + k) * kKeys, _mm256_permute2f128_ps(r[k], r[k + 4], 0x20));
      _mm256_storeu_ps(kt + (i + k + 4) * kKeys, _mm256_permute2f128_ps(r[k], r[k + 4], 0x31));
    }
  }
#else
  for (int i = 0; i < d; ++i)
    for (int k = 0; k < 8; ++k) kt[i * kKeys + k] = rows[k * ld + i];
#endif
}

// s[r][c0 .. c0 + 16) = q[r] . kt[:, c0 .. c0 + 16) for RB rows; q rows d floats apart, kt [d][kKeys].
template <int RB>
inline void score_block(const float* q, int d, const float* kt, int c0, float* s) {
  V8 a[RB][2] = {};
  for (int i = 0; i < d; ++i) {
    const V8 k0 = load8(kt + i * kKeys + c0), k1 = load8(kt + i * kKeys + c0 + 8);
    for (int r = 0; r < RB; ++r) {
      const float x = q[r * d + i];
      a[r][0] += x * k0;
      a[r][1] += x * k1;
    }
  }
  for (int r = 0; r < RB; ++r) {
    store8(s + r * kKeys + c0, a[r][0]);
    store8(s + r * kKeys + c0 + 8, a[r][1]);
  }
}

// acc[r][c0 .. c0 + 8 * NV) += sum_{u < n} p[r][u] * v[u][c0 ..] for RB rows; p rows kKeys apart,
// v rows ldv floats apart, acc rows dv.
template <int RB, int NV>
inline void value_block(const float* p, const float* v, int64_t ldv, int n, int dv, int c0, float* acc) {
  V8 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = load8(acc + r * dv + c0 + 8 * j);
  for (int u = 0; u < n; ++u) {
    V8 x[NV];
    for (int j = 0; j < NV; ++j) x[j] = load8(v + u * ldv + c0 + 8 * j);
    for (int r = 0; r < RB; ++r) {
      const float w = p[r * kKeys + u];
      for (int j = 0; j < NV; ++j) a[r][j] += w * x[j];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NV; ++j) store8(acc + r * dv + c0 + 8 * j, a[r][j]);
}

template <int RB>
inline void tile_rows(const float* q, int d, const float* kt, int n, const float* v, int64_t ldv, int dv, float* s,
                      float* acc, bool scores) {
  if (scores) {
    for (int c0 = 0; c0 < n; c0 += 16) score_block<RB>(q, d, kt, c0, s);
    return;
  }
  int c = 0;
  for (; c + 16 <= dv; c += 16) value_block<RB, 2>(s, v, ldv, n, dv, c, acc);
  if (c < dv) value_block<RB, 1>(s, v, ldv, n, dv, c, acc);
}

// For rows [0, rows): scores s[r][0 .. n rounded up to 16) = q[r] . kt (scores = true), or acc[r] += s[r][0 .. n) . v (scores = false; v rows ldv floats apart), in register
// blocks of kRowBlock rows.
inline void tile_all_rows(int rows, const float* q, int d, const float* kt, int n, const float* v, int64_t ldv, int dv,
                          float* s, float* acc, bool scores) {
  int r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) {
    tile_rows<kRowBlock>(q + r * d, d, kt, n, v, ldv, dv, s + r * kKeys, acc + r * dv, scores);
  }
  const float *qr = q + r * d;
  float *sr = s + r * kKeys, *ar = acc + r * dv;
  switch (rows - r) {
    case 1: tile_rows<1>(qr, d, kt, n, v, ldv, dv, sr, ar, scores); break;
    case 2: tile_rows<2>(qr, d, kt, n, v, ldv, dv, sr, ar, scores); break;
    case 3: tile_rows<3>(qr, d, kt, n, v, ldv, dv, sr, ar, scores); break;
    case 4: tile_rows<4>(qr, d, kt, n, v, ldv, dv, sr, ar, scores); break;
    case 5: tile_rows<5>(qr, d, kt, n, v, ldv, dv, sr, ar, scores); break;
    default: break;
  }
}

}  // namespace turboquant::cpu::tiles
