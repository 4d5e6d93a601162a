// Developer probe: the first-prompt attention kernels (ops/cuda/prefill.cu's mma.sync kernel and
// prefill_sm90.cu's wgmma kernel) alone, each against a float64 reference on sampled rows, and their
// time per call (CUDA events, median).
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DTQ_SM90A=1 --expt-relaxed-constexpr -Iops/include \
//        scripts/cuda_prefill_probe.cu ops/cuda/prefill.cu ops/cuda/prefill_sm90.cu ops/cuda/split_plan.cpp -o /tmp/prefill_probe
//   /tmp/prefill_probe B Hq Hkv S D [bf16] [causal] [iters] [mma|wgmma|both]     (Q, K, V as [B, S, H * D])
// D: 64 or 128 (both kernels), 256 (the mma kernel only; TURBOQUANT_PREFILL_ONE_BUFFER=1 in the
// environment runs its single-buffered variant, sm_86/sm_89's).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../ops/cuda/prefill.cuh"
#include "cuda_check.h"

using namespace turboquant;

static float to_float(uint16_t bits, bool bf16) {
  if (bf16) {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half h;
  std::memcpy(&h, &bits, 2);
  return __half2float(h);
}
static uint16_t from_float(float f, bool bf16) {
  if (bf16) {
    __nv_bfloat16 b = __float2bfloat16(f);
    uint16_t u;
    std::memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

int main(int argc, char** argv) {
  if (argc < 6) {
    std::printf("usage: %s B Hq Hkv S D [bf16] [causal] [iters] [mma|wgmma|both]\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoll(argv[1]), Hq = std::atoll(argv[2]), Hkv = std::atoll(argv[3]), S = std::atoll(argv[4]);
  const int D = std::atoi(argv[5]);
  const bool bf16 = argc > 6 && std::atoi(argv[6]) != 0;
  const bool causal = argc > 7 ? std::atoi(argv[7]) != 0 : true;
  const int iters = argc > 8 ? std::atoi(argv[8]) : 20;
  const std::string which = argc > 9 ? argv[9] : "both";
  std::vector<cuda::PrefillKernel> kernels;
  if (which != "wgmma") kernels.push_back(cuda::PrefillKernel::kMma);
  if (which != "mma" && D != 256) kernels.push_back(cuda::PrefillKernel::kWgmma);  // (at 256 it would take the mma kernel)

  AttentionParams p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = S, p.new_len = S, p.past_len = 0;
  p.head_dim = D, p.v_head_dim = D, p.is_causal = causal, p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.dtype = bf16 ? DType::kBFloat16 : DType::kFloat16;
  p.q = {S * Hq * D, D, Hq * D};
  p.k = {S * Hkv * D, D, Hkv * D};
  p.v = p.k;
  p.y = p.q;

  std::mt19937 gen(1234);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> hq(B * S * Hq * D), hk(B * S * Hkv * D), hv(hk.size()), hy(hq.size());
  for (auto& x : hq) x = from_float(nd(gen), bf16);
  for (auto& x : hk) x = from_float(nd(gen), bf16);
  for (auto& x : hv) x = from_float(nd(gen), bf16);
  uint16_t *dq, *dk, *dv, *dy;
  CHECK(cudaMalloc(&dq, hq.size() * 2));
  CHECK(cudaMalloc(&dk, hk.size() * 2));
  CHECK(cudaMalloc(&dv, hv.size() * 2));
  CHECK(cudaMalloc(&dy, hy.size() * 2));
  CHECK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
  int64_t bad = 0, nonfinite = 0, failed = 0;
  for (const cuda::PrefillKernel kernel : kernels) {
  const char* name = cuda::prefill_kernel_name(kernel);
    CHECK(cudaMemset(dy, 0xff, hy.size() * 2));  // NaN everywhere: every row must be written
    if (!cuda::detail::prefill_supported(p, dq, dk, dv, nullptr, dy)) {
      std::printf("refused: prefill_supported is false\n");
      return 1;
    }
    CHECK(cuda::detail::launch_prefill(p, dq, dk, dv, nullptr, dy, nullptr, nullptr, kernel));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(hy.data(), dy, hy.size() * 2, cudaMemcpyDeviceToHost));

    // the reference on sampled rows (every row for short prompts), every head
    std::vector<int64_t> rows;
    for (int64_t s = 0; s < S; ++s) {
      if (S <= 300 || s < 70 || s >= S - 70 || s % 97 == 0) rows.push_back(s);
    }
    double max_err = 0.0, span = 1e-30;
    int64_t checked = 0;
    bad = 0, nonfinite = 0;
    const double tol = bf16 ? 1.6e-2 : 4e-3;
    std::vector<double> w(S), acc(D);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        if (S > 1024 && (b != 0 || (h != 0 && h != Hq - 1))) continue;  // long prompts: the first and last heads of one sequence
        const int64_t g = h / (Hq / Hkv);
        for (int64_t s : rows) {
          const int64_t last = causal ? s : S - 1;
          double mx = -1e300;
          for (int64_t t = 0; t <= last; ++t) {
            double dot = 0.0;
            for (int i = 0; i < D; ++i) {
              dot += static_cast<double>(to_float(hq[((b * S + s) * Hq + h) * D + i], bf16)) *
                     to_float(hk[((b * S + t) * Hkv + g) * D + i], bf16);
            }
            w[t] = dot * p.scale;
            mx = std::max(mx, w[t]);
          }
          double sum = 0.0;
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t t = 0; t <= last; ++t) {
            const double e = std::exp(w[t] - mx);
            sum += e;
            for (int i = 0; i < D; ++i) acc[i] += e * to_float(hv[((b * S + t) * Hkv + g) * D + i], bf16);
          }
          for (int i = 0; i < D; ++i) {
            const double ref = acc[i] / sum, got = to_float(hy[((b * S + s) * Hq + h) * D + i], bf16);
            if (!std::isfinite(got)) ++nonfinite;
            const double err = std::fabs(got - ref);
            max_err = std::max(max_err, err);
            span = std::max(span, std::fabs(ref));
            if (!(err <= tol * std::max(1.0, std::fabs(ref)))) ++bad;
            ++checked;
          }
        }
      }
    }
    // every value of Y, checked or not, written: a block the launch never ran leaves its rows NaN
    nonfinite = 0;
    for (const uint16_t x : hy) nonfinite += !std::isfinite(to_float(x, bf16));
    std::printf("%s check B=%lld Hq=%lld Hkv=%lld S=%lld D=%d %s %s: %lld values, max abs err %.3g (max |y| %.3g), "
                "%lld beyond tolerance, %lld not finite (of all %zu)\n",
                name, (long long)B, (long long)Hq, (long long)Hkv, (long long)S, D, bf16 ? "bf16" : "fp16",
                causal ? "causal" : "full", (long long)checked, max_err, span, (long long)bad, (long long)nonfinite,
                hy.size());

    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int it = 0; it < iters + 3; ++it) {
      CHECK(cudaEventRecord(e0));
      CHECK(cuda::detail::launch_prefill(p, dq, dk, dv, nullptr, dy, nullptr, nullptr, kernel));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (it >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double flops = 4.0 * B * Hq * static_cast<double>(S) * S * D * (causal ? 0.5 : 1.0);
    std::printf("%s time B=%lld Hq=%lld S=%lld D=%d: %.3f ms median, %.1f TFLOP/s\n", name, (long long)B, (long long)Hq,
                (long long)S, D, med, flops / med / 1e9);
  failed += bad + nonfinite;
  }
  return failed == 0 ? 0 : 1;
}
