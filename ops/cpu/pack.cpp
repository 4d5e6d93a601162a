// TQPack / TQUnpack on the CPU: per-vector encode and decode of every format (DESIGN.md section 2).
// Compiled with -ffp-contract=off: every operation that decides a stored bit must round exactly
// as the Python reference does.
#include <algorithm>
#include <cmath>
#include <vector>

#include "bits.h"
#include "float_io.h"
#include "fwht.h"
#include "turboquant/codebook_data.h"
#include "turboquant/cpu_kernels.h"

namespace turboquant::cpu {

void serial_for(size_t n, const std::function<void(size_t)>& fn) {
  for (size_t i = 0; i < n; ++i) fn(i);
}

namespace {

const double* centroids(int bits) { return bits == 3 ? codebook::kCentroids3 : codebook::kCentroids4; }
const float* boundaries(int bits) { return bits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4; }

void store_f16(uint8_t* out, uint16_t h) {
  out[0] = static_cast<uint8_t>(h);
  out[1] = static_cast<uint8_t>(h >> 8);
}

float load_f16(const uint8_t* in) { return f16_to_f32(static_cast<uint16_t>(in[0] | (in[1] << 8))); }

void encode_mse(int bits, int d, bool norm_correction, const float* x, uint8_t* out) {
  const int dp = padded_dim(d);
  double n2 = 0.0;
  for (int i = 0; i < d; ++i) n2 += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  const float n = static_cast<float>(std::sqrt(n2));
  const float denom = n + 1e-8f;
  float z[kMaxHeadDim];
  for (int i = 0; i < d; ++i) z[i] = x[i] / denom;
  for (int i = d; i < dp; ++i) z[i] = 0.0f;
  fwht_inplace(z, dp);
  const float* b = boundaries(bits);
  const int nb = (1 << bits) - 1;
  uint8_t idx[kMaxHeadDim];
  for (int i = 0; i < dp; ++i) {
    // number of boundaries <= z (ties go up); boundaries ascending
    idx[i] = static_cast<uint8_t>(std::upper_bound(b, b + nb, z[i]) - b);
  }
  pack_indices(idx, dp, bits, out);
  float s = n;
  if (norm_correction) {
    const double* c = centroids(bits);
    double cn2 = 0.0;
    for (int i = 0; i < dp; ++i) cn2 += c[idx[i]] * c[idx[i]];
    s = static_cast<float>(static_cast<double>(n) * std::sqrt(static_cast<double>(dp)) / std::sqrt(cn2));
  }
  store_f16(out + dp * bits / 8, f32_to_f16_sat(s));
}

void decode_mse(int bits, int d, const uint8_t* in, float* out) {
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

void encode_uint(int bits, int d, const float* x, uint8_t* out) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < d; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  const float levels = static_cast<float>((1 << bits) - 1);
  const uint16_t s16 = f32_to_f16_sat(std::max((mx - mn) / levels, 1e-8f));
  const uint16_t z16 = f32_to_f16_sat(mn);
  const float sc = f16_to_f32(s16), zr = f16_to_f32(z16);
  uint8_t q[kMaxHeadDim];
  for (int i = 0; i < d; ++i) {
    float v = sc > 0.0f ? std::floor((x[i] - zr) / sc + 0.5f) : 0.0f;
    v = std::min(std::max(v, 0.0f), levels);
    q[i] = static_cast<uint8_t>(v);
  }
  pack_indices(q, d, bits, out);
  out += d * bits / 8;
  store_f16(out, s16);
  store_f16(out + 2, z16);
}

void decode_uint(int bits, int d, const uint8_t* in, float* out) {
  uint8_t q[kMaxHeadDim];
  unpack_indices(in, d, bits, q);
  const float sc = load_f16(in + d * bits / 8), zr = load_f16(in + d * bits / 8 + 2);
  for (int i = 0; i < d; ++i) out[i] = static_cast<float>(q[i]) * sc + zr;
}

}  // namespace

void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out) {
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

void decode_vector(Format fmt, int d, const uint8_t* in, float* out) {
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

namespace {
constexpr int64_t kVectorsPerTask = 256;
}

void pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
          uint8_t* out, const ParallelFor& pfor) {
  const int64_t bytes = packed_size(fmt, d);
  const size_t tasks = static_cast<size_t>((n + kVectorsPerTask - 1) / kVectorsPerTask);
  pfor(tasks, [&](size_t t) {
    float row[kMaxHeadDim];
    const int64_t end = std::min<int64_t>(n, (static_cast<int64_t>(t) + 1) * kVectorsPerTask);
    for (int64_t v = static_cast<int64_t>(t) * kVectorsPerTask; v < end; ++v) {
      load_row(dt, x, v * d, d, row);
      if (const float* off = offset.row_for(v, d)) {
        for (int i = 0; i < d; ++i) row[i] -= off[i];
      }
      encode_vector(fmt, d, norm_correction, row, out + v * bytes);
    }
  });
}

void unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
            const ParallelFor& pfor) {
  const int64_t bytes = packed_size(fmt, d);
  const size_t tasks = static_cast<size_t>((n + kVectorsPerTask - 1) / kVectorsPerTask);
  pfor(tasks, [&](size_t t) {
    float row[kMaxHeadDim];
    const int64_t end = std::min<int64_t>(n, (static_cast<int64_t>(t) + 1) * kVectorsPerTask);
    for (int64_t v = static_cast<int64_t>(t) * kVectorsPerTask; v < end; ++v) {
      decode_vector(fmt, d, in + v * bytes, row);
      if (const float* off = offset.row_for(v, d)) {
        for (int i = 0; i < d; ++i) row[i] += off[i];
      }
      for (int i = 0; i < d; ++i) store_float(dt, out, v * d + i, row[i]);
    }
  });
}

}  // namespace turboquant::cpu
