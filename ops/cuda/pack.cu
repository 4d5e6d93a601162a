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

template <Format F, int kS, bool kPresent>
cudaError_t launch_stream(const PackJob& job, bool nc, DType dt, cudaStream_t stream) {
  // blocks stride over the vectors: enough to fill the device several times, few enough that
  // each block's set-up (its codebook tables) serves many vectors
  const int64_t needed = (job.n + kStreamVectorsPerBlock - 1) / kStreamVectorsPerBlock;
  const int64_t fill = 32 * static_cast<int64_t>(std::max(1, device_attribute<cudaDevAttrMultiProcessorCount>()));
  const unsigned blocks = static_cast<unsigned>(std::min(needed, fill));
  pack_stream_kernel<F, kS, kPresent><<<blocks, kStreamThreads, 0, stream>>>(nc, dt, job.d, job.x, static_cast<uint32_t>(job.n),
                                                                            job.offset, job.out, job.map);
  return cudaGetLastError();
}

template <Format F, bool kPresent>
cudaError_t launch_stream_sized(const PackJob& job, bool nc, DType dt, cudaStream_t stream) {
  switch (padded_dim(job.d)) {
    case 64: return launch_stream<F, 2, kPresent>(job, nc, dt, stream);
    case 128: return launch_stream<F, 4, kPresent>(job, nc, dt, stream);
    default: return launch_stream<F, 8, kPresent>(job, nc, dt, stream);
  }
}

template <bool kPresent>
cudaError_t launch_stream_any(const PackJob& job, bool nc, DType dt, cudaStream_t stream) {
  switch (job.fmt) {
    case Format::kMse3: return launch_stream_sized<Format::kMse3, kPresent>(job, nc, dt, stream);
    case Format::kMse4: return launch_stream_sized<Format::kMse4, kPresent>(job, nc, dt, stream);
    case Format::kUint3: return launch_stream_sized<Format::kUint3, kPresent>(job, nc, dt, stream);
    case Format::kUint4: return launch_stream_sized<Format::kUint4, kPresent>(job, nc, dt, stream);
    case Format::kFp8: return launch_stream_sized<Format::kFp8, kPresent>(job, nc, dt, stream);
    case Format::kRaw16: return launch_stream_sized<Format::kRaw16, kPresent>(job, nc, dt, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

namespace detail {

bool stream_pack_supported(const PackJob& job, DType dt) {
  // the throughput kernel reads 16-byte chunks, stages rows with 16-bit stores (uint3 rows of head
  // sizes 8 mod 16 have an odd size) and writes 16-byte runs of rows (TQPack) or 16-bit words of
  // each row (a present map)
  const int dp = padded_dim(job.d);
  const bool sized = (dp == 64 || dp == 128 || dp == 256) && job.d % 8 == 0 && job.bytes % 2 == 0 && job.n <= INT32_MAX;
  if (!sized || !aligned16(job.x) || !aligned16(job.offset.data) || job.rot.rotary_dim > 0) return false;
  if (!job.map.present) return aligned16(job.out);
  const int64_t chunk = 16 / static_cast<int64_t>(dtype_size(dt));  // elements of a 16-byte chunk
  const VectorMap& m = job.map;
  return m.st.b % chunk == 0 && m.st.h % chunk == 0 && m.st.s % chunk == 0 && m.rows.row_bytes % 2 == 0 &&
         (reinterpret_cast<uintptr_t>(job.out) & 1) == 0;
}

cudaError_t launch_stream_pack(const PackJob& job, bool nc, DType dt, cudaStream_t stream) {
  if (job.n == 0) return cudaSuccess;
  return job.map.present ? launch_stream_any<true>(job, nc, dt, stream) : launch_stream_any<false>(job, nc, dt, stream);
}

}  // namespace detail

namespace {

template <Format F>
cudaError_t launch_pack(bool nc, DType dt, const PackJob& job, cudaStream_t stream) {
  if (stream_pack_supported(job, dt)) return launch_stream_sized<F, false>(job, nc, dt, stream);
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
