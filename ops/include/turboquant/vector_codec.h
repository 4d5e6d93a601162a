// Encoding and decoding of one vector in every format of docs/design.md section 2, shared by the CPU
// and CUDA kernels (host and device), so that both produce the same bytes. Every operation that
// decides a stored bit runs in one fixed order: compile users of this header without
// floating-point contraction (-ffp-contract=off, nvcc -fmad=false). The MSE encoder is float32
// throughout, in orders a GPU computes cheaply and the Python reference (reference/formats.py)
// follows exactly: the sum of squares in 32 partial sums and a butterfly from distance 1 up
// (sum_squares), the division by the norm as a product with its reciprocal, and the norm
// correction's ||c||^2 as an integer sum of the centroid squares in units of 2^-13 (exact in any
// order; corrected_scale).
#pragma once

#include <cstdint>

#include "turboquant/codebook_data.h"
#include "turboquant/format.h"
#include "turboquant/numerics.h"

namespace turboquant::codec {

TQ_HD void fwht_inplace(float* x, int n) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// LSB-first bit stream of 3- or 4-bit indices; n % 8 == 0.
TQ_HD void pack_indices(const uint8_t* idx, int n, int bits, uint8_t* out) {
  if (bits == 4) {
    for (int i = 0; i < n; i += 2) *out++ = static_cast<uint8_t>(idx[i] | (idx[i + 1] << 4));
    return;
  }
  for (int i = 0; i < n; i += 8) {
    uint32_t w = 0;
    for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(idx[i + k]) << (3 * k);
    *out++ = static_cast<uint8_t>(w);
    *out++ = static_cast<uint8_t>(w >> 8);
    *out++ = static_cast<uint8_t>(w >> 16);
  }
}

TQ_HD void unpack_indices(const uint8_t* in, int n, int bits, uint8_t* idx) {
  if (bits == 4) {
    for (int i = 0; i < n; i += 2, ++in) {
      idx[i] = *in & 15u;
      idx[i + 1] = *in >> 4;
    }
    return;
  }
  for (int i = 0; i < n; i += 8, in += 3) {
    const uint32_t w = in[0] | (in[1] << 8) | (in[2] << 16);
    for (int k = 0; k < 8; ++k) idx[i + k] = (w >> (3 * k)) & 7u;
  }
}

// Sums of float32 terms in the order of a warp: lane l sums the terms i = l, l + 32, ... in
// ascending order, then the 32 partial sums combine in a butterfly at distance 1, 2, 4, 8, 16
// (every lane adds its partner's sum to its own, so all lanes end with the same total): partials
// that sit in one thread of a GPU kernel combine first.
constexpr int kSumLanes = 32;

TQ_HD float butterfly_total(float* part) {  // part[kSumLanes], overwritten
  for (int o = 1; o < kSumLanes; o <<= 1) {
    float next[kSumLanes];
    for (int l = 0; l < kSumLanes; ++l) next[l] = part[l] + part[l ^ o];
    for (int l = 0; l < kSumLanes; ++l) part[l] = next[l];
  }
  return part[0];
}

// sum over i < n of x[i]^2, each square rounded to float32
TQ_HD float sum_squares(const float* x, int n) {
  float part[kSumLanes] = {};
  for (int i = 0; i < n; ++i) part[i % kSumLanes] += x[i] * x[i];
  return butterfly_total(part);
}

// The norm correction's centroid squares c_unit[k]^2 in units of 2^-13, rounded: a vector's
// ||c||^2 is then an integer sum, exact in any order (Dp <= 256 terms below 2^16 each; a GPU lane's
// share of up to 64 of them fits 22 bits). The rounding moves a scale by at most 3e-5 of itself,
// a sixteenth of fp16's resolution.
constexpr int kCsqFractionBits = 13;
TQ_HD constexpr int32_t quantized_square(double c) {
  return static_cast<int32_t>(c * c * (1 << kCsqFractionBits) + 0.5);
}

// The stored scale with norm correction: n * sqrt(Dp) / ||c_unit[idx]||, in float32, from the
// integer sum cq of quantized_square over the vector's indices.
TQ_HD float corrected_scale(float n, int dp, int32_t cq) {
  const float cn2 = static_cast<float>(cq) * (1.0f / (1 << kCsqFractionBits));  // exact: cq < 2^24
  const float root_dp = sqrtf(static_cast<float>(dp));
  return (n * root_dp) / sqrtf(cn2);
}

// 1 / (n + 1e-8), rounded: every coordinate of the unit vector is x[i] times it.
TQ_HD float norm_reciprocal(float n) { return 1.0f / (n + 1e-8f); }

TQ_HD const double* centroids(int bits) {
#if defined(__CUDA_ARCH__)
  return bits == 3 ? codebook::kCentroids3Device : codebook::kCentroids4Device;
#else
  return bits == 3 ? codebook::kCentroids3 : codebook::kCentroids4;
#endif
}

TQ_HD void store_f16(uint8_t* out, uint16_t h) {
  out[0] = static_cast<uint8_t>(h);
  out[1] = static_cast<uint8_t>(h >> 8);
}

TQ_HD float load_f16(const uint8_t* in) { return f16_to_f32(static_cast<uint16_t>(in[0] | (in[1] << 8))); }

// Number of boundaries <= z (ties go up); boundaries ascending.
TQ_HD uint8_t codebook_index(int bits, float z) {
#if defined(__CUDA_ARCH__)
  const float* b = bits == 3 ? codebook::kBoundaries3Device : codebook::kBoundaries4Device;
#else
  const float* b = bits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4;
#endif
  const int nb = (1 << bits) - 1;
  uint8_t k = 0;
  for (int i = 0; i < nb; ++i) k += b[i] <= z ? 1 : 0;
  return k;
}

// The quantized_square of the codebook of `bits` bits, index k.
TQ_HD int32_t centroid_square_q(int bits, int k) { return quantized_square(centroids(bits)[k]); }

TQ_HD void encode_mse(int bits, int d, bool norm_correction, const float* x, uint8_t* out) {
  const int dp = padded_dim(d);
  const float n = sqrtf(sum_squares(x, d));
  const float r = norm_reciprocal(n);
  float z[kMaxHeadDim];
  for (int i = 0; i < d; ++i) z[i] = x[i] * r;
  for (int i = d; i < dp; ++i) z[i] = 0.0f;
  fwht_inplace(z, dp);
  uint8_t idx[kMaxHeadDim];
  for (int i = 0; i < dp; ++i) idx[i] = codebook_index(bits, z[i]);
  pack_indices(idx, dp, bits, out);
  float s = n;
  if (norm_correction) {
    int32_t cq = 0;
    for (int i = 0; i < dp; ++i) cq += centroid_square_q(bits, idx[i]);
    s = corrected_scale(n, dp, cq);
  }
  store_f16(out + dp * bits / 8, f32_to_f16_sat(s));
}

TQ_HD void decode_mse(int bits, int d, const uint8_t* in, float* out) {
  const int dp = padded_dim(d);
  uint8_t idx[kMaxHeadDim];
  unpack_indices(in, dp, bits, idx);
  const double s = load_f16(in + dp * bits / 8);
  const double* c = centroids(bits);
  float y[kMaxHeadDim];
  for (int i = 0; i < dp; ++i) y[i] = static_cast<float>(c[idx[i]]);
  fwht_inplace(y, dp);
  for (int i = 0; i < d; ++i) out[i] = static_cast<float>(static_cast<double>(y[i]) * (s / dp));
}

// A uniform vector holding a NaN packs as every index 0 with scale and zero both this fp16 quiet
// NaN, so that it reads back NaN in every coordinate (a NaN in one coordinate alone has no code).
constexpr uint16_t kUintNanBits = kF16Nan;

TQ_HD void encode_uint(int bits, int d, const float* x, uint8_t* out) {
  float mn = x[0], mx = x[0];
  bool nan = false;
  for (int i = 0; i < d; ++i) {
    mn = x[i] < mn ? x[i] : mn;
    mx = x[i] > mx ? x[i] : mx;
    nan = nan || x[i] != x[i];
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const float range = (mx - mn) / levels;
  const uint16_t s16 = nan ? kUintNanBits : f32_to_f16_sat(range > 1e-8f ? range : 1e-8f);
  const uint16_t z16 = nan ? kUintNanBits : f32_to_f16_sat(mn + 0.0f);  // a zero minimum as +0
  const float sc = f16_to_f32(s16), zr = f16_to_f32(z16);
  uint8_t q[kMaxHeadDim];
  for (int i = 0; i < d; ++i) {  // a NaN scale fails sc > 0: every code 0
    float v = sc > 0.0f ? floorf((x[i] - zr) / sc + 0.5f) : 0.0f;
    v = v < 0.0f ? 0.0f : (v > levels ? levels : v);
    q[i] = static_cast<uint8_t>(v);
  }
  pack_indices(q, d, bits, out);
  out += d * bits / 8;
  store_f16(out, s16);
  store_f16(out + 2, z16);
}

TQ_HD void decode_uint(int bits, int d, const uint8_t* in, float* out) {
  uint8_t q[kMaxHeadDim];
  unpack_indices(in, d, bits, q);
  const float sc = load_f16(in + d * bits / 8), zr = load_f16(in + d * bits / 8 + 2);
  for (int i = 0; i < d; ++i) out[i] = static_cast<float>(q[i]) * sc + zr;
}

// One vector: x[0..d) float32 (offset already removed) -> out[0..packed_size).
TQ_HD void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out) {
  switch (fmt) {
    case Format::kMse3:
    case Format::kMse4: encode_mse(format_bits(fmt), d, norm_correction, x, out); break;
    case Format::kUint3:
    case Format::kUint4: encode_uint(format_bits(fmt), d, x, out); break;
    case Format::kFp8:
      for (int i = 0; i < d; ++i) out[i] = f32_to_fp8(x[i]);
      break;
    case Format::kRaw16:
      for (int i = 0; i < d; ++i) store_f16(out + 2 * i, f32_to_f16(x[i]));
      break;
    default: break;
  }
}

// One vector: packed bytes -> out[0..d) float32 (no offset added).
TQ_HD void decode_vector(Format fmt, int d, const uint8_t* in, float* out) {
  switch (fmt) {
    case Format::kMse3:
    case Format::kMse4: decode_mse(format_bits(fmt), d, in, out); break;
    case Format::kUint3:
    case Format::kUint4: decode_uint(format_bits(fmt), d, in, out); break;
    case Format::kFp8:
      for (int i = 0; i < d; ++i) out[i] = fp8_to_f32(in[i]);
      break;
    case Format::kRaw16:
      for (int i = 0; i < d; ++i) out[i] = load_f16(in + 2 * i);
      break;
    default: break;
  }
}

}  // namespace turboquant::codec
