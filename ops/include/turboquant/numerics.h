// Scalar conversions used by every kernel: fp16, bf16 and fp8 e4m3fn <-> fp32.
// Header-only and free of any runtime's types. The rounding is IEEE round-to-nearest-even
// throughout, matching numpy/ml_dtypes, so the packed bytes agree with the Python reference.
#pragma once

#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define TQ_HD __host__ __device__ inline
#else
#define TQ_HD inline
#endif

namespace turboquant {

constexpr float kFp16Max = 65504.0f;
constexpr float kFp8Max = 448.0f;

TQ_HD uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TQ_HD float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The one NaN a pack stores, whatever NaN reached it: hosts and GPUs give arithmetic NaNs other
// signs (x86's inf - inf is negative, a GPU's positive), and the bytes must not depend on which.
constexpr uint16_t kF16Nan = 0x7E00u;
constexpr uint8_t kFp8Nan = 0x7Fu;

// fp32 -> fp16 bits, round to nearest even; overflow gives inf (IEEE), a NaN gives kF16Nan.
TQ_HD uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return kF16Nan;
#if defined(__CUDA_ARCH__)  // the conversion instruction rounds the same
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t sign = (x >> 16) & 0x8000u;
  if (ax == 0x7F800000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: fp16 subnormal (or zero); 2^24 * |f| < 1024 is exact
    const float scaled = bits_f32(ax) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(nearbyintf(scaled)));
  }
  const uint32_t r = ax + 0x0FFFu + ((ax >> 13) & 1u);  // round the 13 dropped bits to even
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
#endif
}

// fp32 -> fp16 with finite values saturated to +-65504 (scales and zero points of the formats).
// A NaN is tested first: compilers may turn the clamp into min/max instructions, which drop it.
TQ_HD uint16_t f32_to_f16_sat(float f) {
  if (f != f) return kF16Nan;
  if (f > kFp16Max) f = kFp16Max;
  if (f < -kFp16Max) f = -kFp16Max;
  return f32_to_f16(f);
}

TQ_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t man = h & 0x3FFu;
#if defined(__CUDA_ARCH__)  // exact by the conversion instruction, but for a NaN's sign and payload
  const float f = __half2float(__ushort_as_half(h));
  return (h & 0x7FFFu) > 0x7C00u ? bits_f32(sign | 0x7F800000u | (man << 13)) : f;
#else
  const uint32_t exp = (h >> 10) & 0x1Fu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7F800000u | (man << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

TQ_HD float bf16_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

TQ_HD uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// fp32 -> float8 e4m3fn bits (bias 7, no infinities, 0x7F is NaN), round to nearest even,
// saturating to +-448; a NaN gives kFp8Nan.
TQ_HD uint8_t f32_to_fp8(float f) {
  const uint32_t x = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return kFp8Nan;
  const float a = bits_f32(ax);
  if (a >= kFp8Max) return static_cast<uint8_t>(sign | 0x7Eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9; q == 8 is the smallest normal
    return static_cast<uint8_t>(sign | static_cast<uint32_t>(nearbyintf(a * 512.0f)));
  }
  const uint32_t r = ax + 0x7FFFFu + ((ax >> 20) & 1u);  // round the 20 dropped bits to even
  const uint32_t e = (r >> 23) - 127u + 7u;
  return static_cast<uint8_t>(sign | (e << 3) | ((r >> 20) & 7u));
}

TQ_HD float fp8_to_f32(uint8_t b) {
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t man = b & 7u;
  float v;
  if (exp == 0xF && man == 7) {
    v = NAN;
  } else if (exp == 0) {
    v = static_cast<float>(man) * (1.0f / 512.0f);
  } else {
    v = bits_f32(((exp + 120u) << 23) | (man << 20));
  }
  return (b & 0x80u) ? -v : v;
}

}  // namespace turboquant
