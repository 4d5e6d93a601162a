// TQPack / TQUnpack on the CPU: per-vector encode and decode of every format (docs/design.md section 2).
// Compiled with -ffp-contract=off: every operation that decides a stored bit must round exactly
// as the Python reference does.
#include <algorithm>
#include <cmath>
#include <vector>

#include "turboquant/float_io.h"
#include "turboquant/cpu_kernels.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cpu {

void serial_for(size_t n, const std::function<void(size_t)>& fn) {
  for (size_t i = 0; i < n; ++i) fn(i);
}

void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out) {
  codec::encode_vector(fmt, d, norm_correction, x, out);
}

void decode_vector(Format fmt, int d, const uint8_t* in, float* out) { codec::decode_vector(fmt, d, in, out); }

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
