// TQPack / TQUnpack on the GPU: one thread per vector, through the same per-vector codec as the
// CPU (turboquant/vector_codec.h). Compiled with -fmad=false so that every rounding matches.
#include "turboquant/cuda_kernels.h"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda {
namespace {

constexpr int kThreads = 128;

__global__ void pack_kernel(Format fmt, int d, bool nc, DType dt, const void* x, int64_t n, Offset offset,
                            uint8_t* out, int bytes) {
  const int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (v >= n) return;
  float row[kMaxHeadDim];
  const float* off = offset.row_for(v, d);
  for (int i = 0; i < d; ++i) row[i] = load_float(dt, x, v * d + i);
  if (off) for (int i = 0; i < d; ++i) row[i] -= off[i];
  codec::encode_vector(fmt, d, nc, row, out + v * bytes);
}

__global__ void unpack_kernel(Format fmt, int d, const uint8_t* in, int64_t n, Offset offset, DType dt, void* out,
                              int bytes) {
  const int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (v >= n) return;
  float row[kMaxHeadDim];
  codec::decode_vector(fmt, d, in + v * bytes, row);
  const float* off = offset.row_for(v, d);
  if (off) for (int i = 0; i < d; ++i) row[i] += off[i];
  for (int i = 0; i < d; ++i) store_float(dt, out, v * d + i, row[i]);
}

}  // namespace

cudaError_t pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
                 uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  pack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fmt, d, norm_correction, dt, x, n, offset, out,
                                                                      packed_size(fmt, d));
  return cudaGetLastError();
}

cudaError_t unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  unpack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fmt, d, in, n, offset, dt, out, packed_size(fmt, d));
  return cudaGetLastError();
}

}  // namespace turboquant::cuda
