// TQPack / TQUnpack on the GPU, and the packing of new tokens into the present cache.
// Packing: one warp per vector, the same operations in the same order as the CPU codec
// (turboquant/vector_codec.h): the butterflies of the rotation spread over the lanes, the float64
// sums (norm, norm correction) done by lane 0 in the CPU's order. Compiled with -fmad=false, so
// every rounding matches and the bytes are identical to the CPU kernels'.
#include "turboquant/cuda_kernels.h"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// Where vector v comes from and goes to.
struct VectorMap {
  // TQPack: x[v*d ..], out[v*bytes ..]. Present: x[b*sb + h*sh + n*ss ..] for v = (b*H + h)*N + n,
  // out at row past(b) + n of (b, h) in a cache of rows.present_rows rows of rows.row_bytes bytes.
  bool present = false;
  BhsStrides st;
  int64_t heads = 1, new_len = 1;
  NewTokenRows rows;

  __device__ int64_t in(int64_t v, int d) const {
    if (!present) return v * d;
    const int64_t n = v % new_len, bh = v / new_len;
    return (bh / heads) * st.b + (bh % heads) * st.h + n * st.s;
  }
  __device__ int64_t out(int64_t v, int bytes) const {
    if (!present) return v * bytes;
    const int64_t n = v % new_len, bh = v / new_len;
    return bh * rows.present_rows * rows.row_bytes + (rows.past_of(bh / heads) + n) * rows.row_bytes;
  }
  // A row past the buffer's end (a device-side length out of range) is not written.
  __device__ bool inside(int64_t v) const {
    return !present || rows.past_of((v / new_len) / heads) + v % new_len < rows.present_rows;
  }
};

__device__ void encode_warp(Format fmt, int d, bool nc, float* z, uint8_t* idx, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if (fmt == Format::kFp8 || fmt == Format::kRaw16) {
    for (int i = lane; i < d; i += 32) {
      if (fmt == Format::kFp8) out[i] = f32_to_fp8(z[i]);
      else codec::store_f16(out + 2 * i, f32_to_f16(z[i]));
    }
    return;
  }
  const int bits = format_bits(fmt);
  int n_codes = d;
  float scale_out = 0.0f, zero_out = 0.0f;
  if (is_mse(fmt)) {
    const int dp = padded_dim(d);
    n_codes = dp;
    float n = 0.0f;
    if (lane == 0) {
      double n2 = 0.0;
      for (int i = 0; i < d; ++i) n2 += static_cast<double>(z[i]) * static_cast<double>(z[i]);
      n = static_cast<float>(sqrt(n2));
    }
    n = __shfl_sync(kFull, n, 0);
    const float denom = n + 1e-8f;
    __syncwarp();
    for (int i = lane; i < dp; i += 32) z[i] = i < d ? z[i] / denom : 0.0f;
    __syncwarp();
    for (int h = 1; h < dp; h <<= 1) {
      for (int k = lane; k < dp / 2; k += 32) {
        const int i = (k / h) * 2 * h + (k % h);
        const float a = z[i], b = z[i + h];
        z[i] = a + b;
        z[i + h] = a - b;
      }
      __syncwarp();
    }
    for (int i = lane; i < dp; i += 32) idx[i] = codec::codebook_index(bits, z[i]);
    __syncwarp();
    scale_out = n;
    if (nc && lane == 0) {
      const double* c = codec::centroids(bits);
      double cn2 = 0.0;
      for (int i = 0; i < dp; ++i) cn2 += c[idx[i]] * c[idx[i]];
      scale_out = static_cast<float>(static_cast<double>(n) * sqrt(static_cast<double>(dp)) / sqrt(cn2));
    }
  } else {  // uint3 / uint4: min and max are order-free
    float mn = z[0], mx = z[0];
    for (int i = lane; i < d; i += 32) {
      mn = z[i] < mn ? z[i] : mn;
      mx = z[i] > mx ? z[i] : mx;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float a = __shfl_xor_sync(kFull, mn, o), b = __shfl_xor_sync(kFull, mx, o);
      mn = a < mn ? a : mn;
      mx = b > mx ? b : mx;
    }
    const float levels = static_cast<float>((1 << bits) - 1);
    const float range = (mx - mn) / levels;
    const uint16_t s16 = f32_to_f16_sat(range > 1e-8f ? range : 1e-8f), z16 = f32_to_f16_sat(mn);
    const float sc = f16_to_f32(s16), zr = f16_to_f32(z16);
    for (int i = lane; i < d; i += 32) {
      float v = sc > 0.0f ? floorf((z[i] - zr) / sc + 0.5f) : 0.0f;
      v = v < 0.0f ? 0.0f : (v > levels ? levels : v);
      idx[i] = static_cast<uint8_t>(v);
    }
    __syncwarp();
    scale_out = sc;
    zero_out = zr;
  }
  const int nbytes = n_codes * bits / 8;
  if (bits == 4) {
    for (int j = lane; j < nbytes; j += 32) out[j] = static_cast<uint8_t>(idx[2 * j] | (idx[2 * j + 1] << 4));
  } else {
    for (int g = lane; g < n_codes / 8; g += 32) {
      uint32_t w = 0;
      for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(idx[8 * g + k]) << (3 * k);
      out[3 * g] = static_cast<uint8_t>(w);
      out[3 * g + 1] = static_cast<uint8_t>(w >> 8);
      out[3 * g + 2] = static_cast<uint8_t>(w >> 16);
    }
  }
  if (lane == 0) {
    codec::store_f16(out + nbytes, f32_to_f16_sat(scale_out));
    if (is_uint(fmt)) codec::store_f16(out + nbytes + 2, f32_to_f16_sat(zero_out));
  }
}

__global__ void __launch_bounds__(kThreads) pack_kernel(Format fmt, int d, bool nc, DType dt, const void* x, int64_t n,
                                                         Offset offset, VectorMap map, uint8_t* out, int bytes) {
  __shared__ float z[kWarps][kMaxHeadDim];
  __shared__ uint8_t idx[kWarps][kMaxHeadDim];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t v = blockIdx.x * static_cast<int64_t>(kWarps) + warp;
  if (v >= n) return;  // whole warps leave together
  const int64_t base = map.in(v, d);
  const float* off = offset.row_for(map.present ? (v / map.new_len) % map.heads : v, d);
  for (int i = lane; i < d; i += 32) {
    float xi = load_float(dt, x, base + i);
    if (off) xi -= off[i];
    z[warp][i] = xi;
  }
  __syncwarp();
  if (!map.inside(v)) return;
  encode_warp(fmt, d, nc, z[warp], idx[warp], out + map.out(v, bytes));
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

cudaError_t launch_pack(Format fmt, int d, bool nc, DType dt, const void* x, int64_t n, const Offset& offset,
                        const VectorMap& map, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kWarps - 1) / kWarps;
  pack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fmt, d, nc, dt, x, n, offset, map, out,
                                                                      packed_size(fmt, d));
  return cudaGetLastError();
}

}  // namespace

cudaError_t pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
                 uint8_t* out, cudaStream_t stream) {
  return launch_pack(fmt, d, norm_correction, dt, x, n, offset, VectorMap{}, out, stream);
}

cudaError_t pack_new_tokens(Format fmt, int d, bool norm_correction, DType dt, const void* x, const BhsStrides& st,
                            int64_t batch, int64_t heads, int64_t new_len, const NewTokenRows& rows,
                            const float* offset, uint8_t* present, cudaStream_t stream) {
  VectorMap map;
  map.present = true;
  map.st = st;
  map.heads = heads;
  map.new_len = new_len;
  map.rows = rows;
  Offset off;
  off.data = offset;  // row = head, chosen by the kernel
  off.rows = heads;
  off.period = 1;
  return launch_pack(fmt, d, norm_correction, dt, x, batch * heads * new_len, off, map, present, stream);
}

cudaError_t unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
                   cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  unpack_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(fmt, d, in, n, offset, dt, out, packed_size(fmt, d));
  return cudaGetLastError();
}

}  // namespace turboquant::cuda
