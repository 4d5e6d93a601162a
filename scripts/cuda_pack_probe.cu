// Developer probe: ops/cuda's TQPack launcher alone (no ONNX Runtime). Checks the packed bytes of
// both GPU kernels (the four-lanes-per-vector one, and the one-warp-per-vector one it falls back to
// for unaligned buffers) against the CPU kernel over formats, head sizes, dtypes, offsets and
// special values, then times TQPack on 2^21 fp16 vectors of 128 against a device copy.
//   bash scripts/build_probe.sh OUT [ARCH]   builds it as OUT.pack next to the attention probe
//   OUT.pack [vectors] [format]   (a format: only its timing, e.g. for ncu)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../ops/cuda/pack_four_lanes.cuh"
#include "turboquant/cpu_kernels.h"
#include "turboquant/cuda_kernels.h"
#include "turboquant/numerics.h"
#include "cuda_check.h"

using namespace turboquant;

namespace {

const cpu::ParallelFor serial = [](size_t n, const std::function<void(size_t)>& fn) {
  for (size_t i = 0; i < n; ++i) fn(i);
};

// n vectors of d values of type dt: normal values; unless special < 0 also vectors scaled to the
// extremes, zero vectors and vectors whose minimum or maximum is zero of both signs; special >= 1:
// infinities, special 2: NaNs, of both signs.
std::vector<uint8_t> make_input(DType dt, int d, int64_t n, int special, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint8_t> buf(n * d * dtype_size(dt));
  for (int64_t v = 0; v < n; ++v) {
    const int kind = special < 0 ? 0 : v % 11;
    const float scale = kind == 3 ? 1e-6f : kind == 5 ? 3e4f : kind == 7 ? 0.0f : 1.0f;
    for (int i = 0; i < d; ++i) {
      float f = nd(rng) * scale;
      // zero extremes of both signs: a positive (kind 2) or negative (kind 4) vector with -0 and +0
      if (kind == 2 || kind == 4) f = (kind == 2 ? 1.0f : -1.0f) * (std::fabs(f) + 0.125f);
      if ((kind == 2 || kind == 4) && (i == (v * 7) % d || i == (v * 13 + 5) % d)) f = (i == (v * 7) % d) == (v & 1) ? -0.0f : 0.0f;
      // (fp32 and bf16) a huge element beside tiny ones: quotients by the norm below 2^-126
      if (kind == 6 && dt != DType::kFloat16) f = i == 0 ? 3e30f : (i % 3 ? 0.0f : f * 1e-20f);
      if (special && kind == 9 && i == v % d) f = (v & 1) && special > 1 ? NAN : -INFINITY;
      if (special && kind == 10 && i == 0) f = (v & 2) && special > 1 ? -NAN : INFINITY;
      const int64_t k = v * d + i;
      if (dt == DType::kFloat32) std::memcpy(&buf[4 * k], &f, 4);
      const uint16_t h = dt == DType::kFloat16 ? f32_to_f16(f) : f32_to_bf16(f);
      if (dt != DType::kFloat32) std::memcpy(&buf[2 * k], &h, 2);
    }
  }
  return buf;
}

const char* dtype_name(DType t) { return t == DType::kFloat32 ? "f32" : t == DType::kFloat16 ? "f16" : "bf16"; }

// Bytes of the GPU's packing that differ from the CPU's; misalign: x and out shifted off 16 bytes.
int64_t compare(Format fmt, int d, DType dt, bool nc, bool offset, int special, bool misalign, int64_t n, std::mt19937& rng) {
  const std::vector<uint8_t> x = make_input(dt, d, n, special, rng);
  const int64_t bytes = packed_size(fmt, d);
  const int rows = 3;
  std::vector<float> off(rows * d);
  for (auto& o : off) o = std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);
  Offset host_off, dev_off;
  float* doff = nullptr;
  if (offset) {
    CHECK(cudaMalloc(&doff, off.size() * 4));
    CHECK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
    host_off = {off.data(), rows, 5};
    dev_off = {doff, rows, 5};
  }
  std::vector<uint8_t> want(n * bytes), got(n * bytes);
  cpu::pack(fmt, d, nc, dt, x.data(), n, host_off, want.data(), serial);
  const int shift = misalign ? 8 : 0;
  uint8_t *dx, *dout;
  CHECK(cudaMalloc(&dx, x.size() + 16));
  CHECK(cudaMalloc(&dout, n * bytes + 16));
  CHECK(cudaMemcpy(dx + shift, x.data(), x.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dout, 0xAB, n * bytes + 16));
  CHECK(cuda::pack(fmt, d, nc, dt, dx + shift, n, dev_off, dout + (misalign ? 2 : 0), 0));
  CHECK(cudaDeviceSynchronize());
  CHECK(cudaMemcpy(got.data(), dout + (misalign ? 2 : 0), n * bytes, cudaMemcpyDeviceToHost));
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n * bytes; ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  if (bad) {
    const int64_t v = first / bytes;
    std::printf("  first difference: vector %lld byte %lld: gpu %02x cpu %02x\n", (long long)v, (long long)(first % bytes),
                got[first], want[first]);
  }
  cudaFree(dx), cudaFree(dout), cudaFree(doff);
  return bad;
}

// div_by_reciprocal against the division for every float a with 2^-100 <= |a| < 2^100 (positive
// ones; the negative ones mirror them) and each divisor of b: counts the normal quotients that
// differ (subnormal ones may, and the kernels do not divide where they can occur).
__global__ void division_check(const float* b, unsigned long long* differ) {
  const float bb = b[blockIdx.y], r = __frcp_rn(bb);
  const uint32_t lo = 27u << 23, hi = 227u << 23;  // 2^-100, 2^100
  unsigned long long local = 0;
  for (uint32_t u = lo + blockIdx.x * blockDim.x + threadIdx.x; u < hi; u += gridDim.x * blockDim.x) {
    const float a = __uint_as_float(u);
    const float q = __fdiv_rn(a, bb);  // subnormal quotients are out of div_by_reciprocal's range
    local += fabsf(q) >= 0x1p-126f && __float_as_uint(cuda::detail::div_by_reciprocal(a, bb, r)) != __float_as_uint(q);
  }
  if (local) atomicAdd(differ, local);
}

// the first failures of division_check, for a look at them: (a, b) pairs
__global__ void division_examples(const float* b, int nb, float2* out, unsigned* count) {
  for (int i = 0; i < nb; ++i) {
    const float bb = b[i], r = __frcp_rn(bb);
    for (uint32_t u = (27u << 23) + blockIdx.x * blockDim.x + threadIdx.x; u < (227u << 23); u += gridDim.x * blockDim.x) {
      const float a = __uint_as_float(u);
      const float q = __fdiv_rn(a, bb);
      if (fabsf(q) >= 0x1p-126f && __float_as_uint(cuda::detail::div_by_reciprocal(a, bb, r)) != __float_as_uint(q)) {
        const unsigned k = atomicAdd(count, 1u);
        if (k < 64) out[k] = make_float2(a, bb);
      }
    }
  }
}

float time_ms(const std::function<void()>& fn, int iters) {
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  fn();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) fn();
  cudaEventRecord(b);
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / iters;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t vectors = argc > 1 ? atoll(argv[1]) : (1 << 21);
  const Format only = argc > 2 ? parse_format(argv[2]) : Format::kInvalid;
  std::mt19937 rng(7);
  const Format formats[] = {Format::kMse4, Format::kMse3, Format::kUint4, Format::kUint3, Format::kFp8, Format::kRaw16};
  int64_t failures = 0, cases = 0;
  for (Format fmt : formats) {
    if (only != Format::kInvalid) break;
    for (int d : {64, 128, 256, 48, 80, 96, 136, 32, 16}) {
      for (DType dt : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
        for (int variant = 0; variant < 4; ++variant) {  // plain, offset, no norm correction, misaligned
          const bool offset = variant == 1, nc = variant != 2, misalign = variant == 3;
          // NaN inputs: not for the MSE formats, whose NaN norms take their sign from the
          // arithmetic's NaN propagation, which differs between CPU and GPU
          // or with an offset (x - offset of a NaN x: the GPU's subtraction returns a canonical NaN)
          const int special = is_mse(fmt) || offset ? 1 : 2;
          const int64_t n = 8 * 37 + (d % 7);
          const int64_t bad = compare(fmt, d, dt, nc, offset, special, misalign, n, rng);
          ++cases;
          if (bad) {
            ++failures;
            std::printf("MISMATCH %s d=%d %s nc=%d offset=%d misaligned=%d: %lld bytes\n", format_name(fmt), d,
                        dtype_name(dt), nc, offset, misalign, (long long)bad);
          }
        }
      }
    }
  }
  std::printf("byte checks: %lld cases, %lld with differing bytes\n", (long long)cases, (long long)failures);
  if (only == Format::kInvalid) {  // divisors: 1e-8 (the smallest norm), fp16 scales, mantissas of all ones, random
    std::vector<float> b = {1e-8f, 6e-8f, 1.0f, 1.5f, 3.0f, 65504.0f, 0x1.fffffep0f, 0x1.fffffep-20f, 0x1.000002p0f, 0x1.fffffep99f};
    std::uniform_real_distribution<float> e(-26.5f, 99.0f);
    while (b.size() < 512) b.push_back(std::pow(2.0f, e(rng)));
    float* db;
    unsigned long long* dd;
    CHECK(cudaMalloc(&db, b.size() * 4));
    CHECK(cudaMalloc(&dd, 8));
    CHECK(cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dd, 0, 8));
    division_check<<<dim3(1024, b.size()), 256>>>(db, dd);
    unsigned long long differ = 0;
    CHECK(cudaMemcpy(&differ, dd, 8, cudaMemcpyDeviceToHost));
    std::printf("division by reciprocal: %zu divisors x 2^-100..2^100 dividends: %llu normal quotients differ\n", b.size(), differ);
    if (differ && std::getenv("TQ_DIVISION_EXAMPLES")) {
      float2* de;
      unsigned* dc;
      CHECK(cudaMalloc(&de, 64 * sizeof(float2)));
      CHECK(cudaMalloc(&dc, 4));
      CHECK(cudaMemset(dc, 0, 4));
      division_examples<<<1024, 256>>>(db, 64, de, dc);
      float2 ex[64];
      unsigned cnt = 0;
      CHECK(cudaMemcpy(&cnt, dc, 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(ex, de, sizeof(ex), cudaMemcpyDeviceToHost));
      for (unsigned k = 0; k < std::min(cnt, 64u); ++k) std::printf("  a=%a b=%a a/b=%g\n", ex[k].x, ex[k].y, ex[k].x / ex[k].y);
    }
    failures += differ != 0;
  }

  // throughput: fp16 [vectors, 128] -> packed, against a device-to-device copy of the input
  const int d = 128;
  void* x;
  uint8_t* out;
  CHECK(cudaMalloc(&x, vectors * d * 2 + 16));
  CHECK(cudaMalloc(&out, vectors * 2 * d + 16));
  {
    std::vector<uint8_t> host = make_input(DType::kFloat16, d, 1 << 16, -1, rng);
    for (int64_t v = 0; v < vectors; v += 1 << 16) {
      const int64_t m = std::min<int64_t>(1 << 16, vectors - v);
      CHECK(cudaMemcpy(static_cast<uint8_t*>(x) + v * d * 2, host.data(), m * d * 2, cudaMemcpyHostToDevice));
    }
  }
  void* copy_dst;
  CHECK(cudaMalloc(&copy_dst, vectors * d * 2));
  const float copy_ms = time_ms([&] { cudaMemcpyAsync(copy_dst, x, vectors * d * 2, cudaMemcpyDeviceToDevice, 0); }, 20);
  const double copy_rate = 2.0 * vectors * d * 2 / (copy_ms * 1e-3);
  std::printf("copy: %.3f ms, %.0f GB/s (read + write)\n", copy_ms, copy_rate / 1e9);
  for (Format fmt : formats) {
    if (only != Format::kInvalid && fmt != only) continue;
    const double moved = vectors * (d * 2.0 + packed_size(fmt, d));
    const float fast = time_ms([&] { cuda::pack(fmt, d, true, DType::kFloat16, x, vectors, Offset{}, out, 0); }, 20);
    const float slow = time_ms([&] {
      cuda::pack(fmt, d, true, DType::kFloat16, static_cast<uint8_t*>(x) + 8, vectors - 1, Offset{}, out + 2, 0);
    }, 5);
    std::printf("%-6s four lanes: %.3f ms (%.2fx copy)   one warp: %.3f ms (%.2fx copy)\n", format_name(fmt), fast,
                moved / (fast * 1e-3) / copy_rate, slow, moved / (slow * 1e-3) / copy_rate);
  }
  CHECK(cudaGetLastError());
  return failures ? 1 : 0;
}
