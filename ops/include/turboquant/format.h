// The packed per-vector formats of docs/design.md section 2 (format version 1): names and sizes.
#pragma once

#include <cstdint>
#include <cstring>

#include "turboquant/numerics.h"  // TQ_HD

namespace turboquant {

constexpr int kFormatVersion = 1;
constexpr int kMinHeadDim = 16;
constexpr int kMaxHeadDim = 256;
// Head counts beyond any model, so that sums and products of them cannot overflow.
constexpr int64_t kMaxHeads = 1 << 16;

enum class Format : int { kMse3 = 0, kMse4, kFp8, kUint3, kUint4, kRaw16, kInvalid };

// Element types of float tensors (Q/K/V, TQPack input, TQUnpack output).
enum class DType : int { kFloat32 = 0, kFloat16, kBFloat16 };

inline const char* format_name(Format f) {
  switch (f) {
    case Format::kMse3: return "mse3";
    case Format::kMse4: return "mse4";
    case Format::kFp8: return "fp8";
    case Format::kUint3: return "uint3";
    case Format::kUint4: return "uint4";
    case Format::kRaw16: return "raw16";
    default: return "invalid";
  }
}

inline constexpr const char* kFormatList = "mse3, mse4, fp8, uint3, uint4, raw16";

inline Format parse_format(const char* s) {
  for (int i = 0; i < static_cast<int>(Format::kInvalid); ++i) {
    if (std::strcmp(s, format_name(static_cast<Format>(i))) == 0) return static_cast<Format>(i);
  }
  return Format::kInvalid;
}

TQ_HD constexpr bool is_mse(Format f) { return f == Format::kMse3 || f == Format::kMse4; }
TQ_HD constexpr bool is_uint(Format f) { return f == Format::kUint3 || f == Format::kUint4; }
TQ_HD constexpr int format_bits(Format f) {
  return (f == Format::kMse3 || f == Format::kUint3) ? 3 : (f == Format::kMse4 || f == Format::kUint4) ? 4 : 8;
}

TQ_HD bool head_dim_supported(int64_t d) { return d % 8 == 0 && d >= kMinHeadDim && d <= kMaxHeadDim; }

TQ_HD int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// Dp: the next power of two >= d.
TQ_HD int padded_dim(int d) {
  int p = 1;
  while (p < d) p <<= 1;
  return p;
}

// Bytes of the index/payload part (before any fp16 scale or zero).
TQ_HD int payload_bytes(Format f, int d) {
  switch (f) {
    case Format::kMse3: return padded_dim(d) * 3 / 8;
    case Format::kMse4: return padded_dim(d) / 2;
    case Format::kFp8: return d;
    case Format::kUint3: return d * 3 / 8;
    case Format::kUint4: return d / 2;
    case Format::kRaw16: return 2 * d;
    default: return 0;
  }
}

// Bytes of one packed vector of length d (d a supported head_dim).
TQ_HD int packed_size(Format f, int d) {
  if (is_mse(f)) return payload_bytes(f, d) + 2;   // + fp16 scale
  if (is_uint(f)) return payload_bytes(f, d) + 4;  // + fp16 scale, fp16 zero
  return payload_bytes(f, d);
}

}  // namespace turboquant
