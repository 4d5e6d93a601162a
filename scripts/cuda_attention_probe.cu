// Developer probe: times ops/cuda's TQAttention launcher alone (no ONNX Runtime), for profiling with
// ncu on the GPU machine, and checks its output against the CPU kernels. Random packed caches (valid
// scales), one new token, fp16 Q/K/V.
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Iops/include scripts/cuda_attention_probe.cu ops/cuda/attention_mma.cu ops/cuda/attention_tc.cu \
//        ops/cuda/attention.cu ops/cuda/pack.cu ops/cpu/attention.cpp ops/cpu/pack.cpp -o /tmp/probe
//   /tmp/probe B S key_format value_format [iters] [pad] [width] [inplace]
//   pad: rows of capacity past S in the past caches; width: bytes per cache row (0: the packed
//   sizes); inplace 1: past and present share buffers of S + pad + 1 rows, as TQGroupQueryAttention
//   runs (the new token written in place, no cache copy), else present is a separate buffer.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <functional>
#include <vector>

#include "turboquant/cpu_kernels.h"
#include "turboquant/cuda_kernels.h"

using namespace turboquant;

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 8, S = argc > 2 ? atoll(argv[2]) : 32768;
  const Format kf = parse_format(argc > 3 ? argv[3] : "mse4"), vf = parse_format(argc > 4 ? argv[4] : "uint4");
  const int64_t Hq = 32, Hkv = 8;
  const int D = 128, iters = argc > 5 ? atoi(argv[5]) : 50;
  const int64_t pad = argc > 6 ? atoll(argv[6]) : 0, width = argc > 7 ? atoll(argv[7]) : 0;
  const bool inplace = argc > 8 && atoi(argv[8]) != 0;
  const int64_t R = S + pad + (inplace ? 1 : 0), Rp = inplace ? R : R + 1;  // rows of past, of present
  AttentionParams p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = 1, p.new_len = 1, p.past_len = S;
  p.head_dim = p.v_head_dim = D, p.key_format = kf, p.value_format = vf, p.norm_correction = true;
  p.scale = 0.0883883f, p.dtype = DType::kFloat16;
  const bool rows = pad || width || inplace;
  p.past_rows = rows ? R : 0, p.present_rows = rows ? Rp : 0;  // present holds all of past's rows
  p.key_row_bytes = width, p.value_row_bytes = width;
  p.q = {Hq * D, D, D}, p.k = {Hkv * D, D, D}, p.v = p.k, p.y = p.q;
  const int64_t kb = p.key_row(), vb = p.value_row();
  // packed caches: pack random vectors once into a small block and tile it
  const int64_t unit = 1024;
  std::vector<__half> host(unit * D);
  for (auto& h : host) h = __float2half((rand() / (float)RAND_MAX - 0.5f) * 4);
  __half *x, *q, *k, *v, *y;
  uint8_t *ku, *vu, *pk, *pv, *ok, *ov;
  cudaMalloc(&x, unit * D * 2);
  cudaMemcpy(x, host.data(), unit * D * 2, cudaMemcpyHostToDevice);
  // packed vectors, spread into rows of kb / vb bytes (the padding bytes zero)
  const int64_t kp = packed_size(kf, D), vp = packed_size(vf, D);
  uint8_t *kd, *vd;
  cudaMalloc(&kd, unit * kp), cudaMalloc(&vd, unit * vp);
  cuda::pack(kf, D, true, DType::kFloat16, x, unit, Offset{}, kd, 0);
  cuda::pack(vf, D, true, DType::kFloat16, x, unit, Offset{}, vd, 0);
  cudaMalloc(&ku, unit * kb), cudaMalloc(&vu, unit * vb);
  cudaMemset(ku, 0, unit * kb), cudaMemset(vu, 0, unit * vb);
  cudaMemcpy2D(ku, kb, kd, kp, kp, unit, cudaMemcpyDeviceToDevice);
  cudaMemcpy2D(vu, vb, vd, vp, vp, unit, cudaMemcpyDeviceToDevice);
  cudaMalloc(&pk, B * Hkv * R * kb), cudaMalloc(&pv, B * Hkv * R * vb);
  for (int64_t i = 0; i < B * Hkv * R; i += unit) {
    const int64_t n = std::min(unit, B * Hkv * R - i);
    cudaMemcpy(pk + i * kb, ku, n * kb, cudaMemcpyDeviceToDevice);
    cudaMemcpy(pv + i * vb, vu, n * vb, cudaMemcpyDeviceToDevice);
  }
  if (inplace) {
    ok = pk, ov = pv;
  } else {
    cudaMalloc(&ok, B * Hkv * Rp * kb), cudaMalloc(&ov, B * Hkv * Rp * vb);
  }
  cudaMalloc(&q, B * Hq * D * 2), cudaMalloc(&k, B * Hkv * D * 2), cudaMalloc(&v, B * Hkv * D * 2), cudaMalloc(&y, B * Hq * D * 2);
  cudaMemcpy(q, x, B * Hq * D * 2 < unit * D * 2 ? B * Hq * D * 2 : unit * D * 2, cudaMemcpyDeviceToDevice);
  cudaMemcpy(k, x, B * Hkv * D * 2, cudaMemcpyDeviceToDevice);
  cudaMemcpy(v, x, B * Hkv * D * 2, cudaMemcpyDeviceToDevice);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  void* ws = nullptr;
  cudaMalloc(&ws, cuda::attention_workspace_bytes(p, sms) + 1);
  cudaStream_t st;
  cudaStreamCreate(&st);
  for (int i = 0; i < 3; ++i) cuda::attention(p, q, k, v, nullptr, pk, pv, y, ok, ov, ws, sms, st);
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaEventRecord(a, st);
  for (int i = 0; i < iters; ++i) cuda::attention(p, q, k, v, nullptr, pk, pv, y, ok, ov, ws, sms, st);
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  // check Y against the CPU kernels on the same inputs
  std::vector<uint8_t> hk(B * Hkv * R * kb), hv(B * Hkv * R * vb), hok(B * Hkv * Rp * kb), hov(B * Hkv * Rp * vb);
  std::vector<__half> hq(B * Hq * D), hkn(B * Hkv * D), hvn(B * Hkv * D), hy(B * Hq * D), ry(B * Hq * D);
  cudaMemcpy(hk.data(), pk, hk.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(hv.data(), pv, hv.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(hq.data(), q, hq.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hkn.data(), k, hkn.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hvn.data(), v, hvn.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hy.data(), y, hy.size() * 2, cudaMemcpyDeviceToHost);
  cpu::ParallelFor serial = [](size_t n, const std::function<void(size_t)>& fn) { for (size_t i = 0; i < n; ++i) fn(i); };
  uint8_t *cpk = hk.data(), *cpv = hv.data();
  cpu::attention(p, hq.data(), hkn.data(), hvn.data(), nullptr, cpk, cpv, ry.data(), inplace ? cpk : hok.data(),
                 inplace ? cpv : hov.data(), serial);
  // the new token's packed rows: the GPU's against the CPU's, byte for byte
  std::vector<uint8_t> gk(hk.size()), gv(hv.size());
  if (inplace) {
    cudaMemcpy(gk.data(), pk, gk.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(gv.data(), pv, gv.size(), cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t bh = 0; bh < B * Hkv; ++bh) {
      const int64_t rk = (bh * R + S) * kb, rv = (bh * R + S) * vb;
      bad += memcmp(gk.data() + rk, hk.data() + rk, kp) != 0;
      bad += memcmp(gv.data() + rv, hv.data() + rv, vp) != 0;
    }
    printf("new rows differing from the CPU's: %lld of %lld\n", (long long)bad, (long long)(2 * B * Hkv));
  } else {  // present = past ++ new: the packed bytes of the S + 1 rows of each (b, head)
    std::vector<uint8_t> gk(hok.size()), gv(hov.size());
    cudaMemcpy(gk.data(), ok, gk.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(gv.data(), ov, gv.size(), cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t bh = 0; bh < B * Hkv; ++bh)
      for (int64_t r = bh * Rp; r < bh * Rp + S + 1; ++r) {
        bad += memcmp(gk.data() + r * kb, hok.data() + r * kb, kp) != 0;
        bad += memcmp(gv.data() + r * vb, hov.data() + r * vb, vp) != 0;
      }
    printf("present rows differing from the CPU's: %lld of %lld\n", (long long)bad, (long long)(2 * B * Hkv * (S + 1)));
  }
  double worst = 0, mag = 0;
  for (size_t i = 0; i < hy.size(); ++i) {
    const double a = __half2float(hy[i]), b = __half2float(ry[i]);
    worst = std::max(worst, std::abs(a - b));
    mag = std::max(mag, std::abs(b));
  }
  printf("max |Y_cuda - Y_cpu| = %.3g (max |Y| %.3g)\n", worst, mag);
  const double bytes = double(B * Hkv * S) * (kb + vb);
  printf("rows %lld/%lld bytes, capacity %lld, %s\n", (long long)kb, (long long)vb, (long long)R, inplace ? "in place" : "present copied");
  printf("B=%lld S=%lld %s/%s: %.1f us per call, %.0f GB/s of cache read (%s)\n", (long long)B, (long long)S,
         format_name(kf), format_name(vf), ms * 1e3 / iters, bytes / (ms * 1e-3 / iters) / 1e9,
         cudaGetErrorString(cudaGetLastError()));
  return 0;
}
