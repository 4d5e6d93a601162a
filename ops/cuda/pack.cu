// TQPack / TQUnpack on the GPU. Packing: four lanes per vector (pack_four_lanes.cuh) where the head size
// and alignments allow, else one warp per vector (pack_warp_per_vector.cuh), both byte-identical to the CPU
// kernels; unpacking: one thread per vector.
#include <algorithm>

#include "device_attributes.h"
#include "pack_warp_per_vector.cuh"
#include "pack_four_lanes.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda {
using namespace detail;
namespace {

constexpr int kThreads = kPackThreads;

template <Format F>
__global__ void __launch_bounds__(kThreads) pack_kernel(bool nc, DType dt, PackJob job) {
  __shared__ float z[kPackWarps][kMaxHeadDim];
  __shared__ uint8_t idx[kPackWarps][kMaxHeadDim];
  __shared__ int32_t csq[16];
  pack_block<F>(job, blockIdx.x, nc, dt, csq, z, idx);
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <Format F>
cudaError_t launch_pack(bool nc, DType dt, const PackJob& job, cudaStream_t stream) {
  // the throughput kernel reads 16-byte chunks, stages rows with 16-bit stores (uint3 rows of head
  // sizes 8 mod 16 have an odd size) and writes 16-byte runs of rows
  const int dp = padded_dim(job.d);
  if (dp >= 64 && job.bytes % 2 == 0 && aligned16(job.x) && aligned16(job.out) && aligned16(job.offset.data)) {
    // blocks stride over the vectors: enough to fill the device several times, few enough that
    // each block's set-up (its codebook tables) serves many vectors
    const int64_t needed = (job.n + kStreamVectorsPerBlock - 1) / kStreamVectorsPerBlock;
    const int64_t fill = 32 * static_cast<int64_t>(std::max(1, device_attribute<cudaDevAttrMultiProcessorCount>()));
    const unsigned blocks = static_cast<unsigned>(std::min(needed, fill));
    const uint32_t n = static_cast<uint32_t>(job.n);
    if (dp == 64) pack_stream_kernel<F, 2><<<blocks, kStreamThreads, 0, stream>>>(nc, dt, job.d, job.x, n, job.offset, job.out);
    if (dp == 128) pack_stream_kernel<F, 4><<<blocks, kStreamThreads, 0, stream>>>(nc, dt, job.d, job.x, n, job.offset, job.out);
    if (dp == 256) pack_stream_kernel<F, 8><<<blocks, kStreamThreads, 0, stream>>>(nc, dt, job.d, job.x, n, job.offset, job.out);
    return cudaGetLastError();
  }
  pack_kernel<F><<<static_cast<unsigned>(job.blocks), kThreads, 0, stream>>>(nc, dt, job);
  return cudaGetLastError();
}

}  // namespace

cudaError_t pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
                 uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n > INT32_MAX) return cudaErrorInvalidValue;  // vector indices are 32-bit
  const PackJob job = make_job(fmt, d, x, n, offset, VectorMap{}, out);
  switch (fmt) {
    case Format::kMse3: return launch_pack<Format::kMse3>(norm_correction, dt, job, stream);
    case Format::kMse4: return launch_pack<Format::kMse4>(norm_correction, dt, job, stream);
    case Format::kUint3: return launch_pack<Format::kUint3>(norm_correction, dt, job, stream);
    case Format::kUint4: return launch_pack<Format::kUint4>(norm_correction, dt, job, stream);
    case Format::kFp8: return launch_pack<Format::kFp8>(norm_correction, dt, job, stream);
    case Format::kRaw16: return launch_pack<Format::kRaw16>(norm_correction, dt, job, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  unpack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fmt, d, in, n, offset, dt, out, packed_size(fmt, d));
  return cudaGetLastError();
}

}  // namespace turboquant::cuda
