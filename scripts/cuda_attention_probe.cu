// Developer probe: times ops/cuda's TQAttention launcher alone (no ONNX Runtime), for profiling with
// ncu on the GPU machine, and checks its output against the CPU kernels. Random packed caches (valid
// scales), one new token, fp16 Q/K/V; any format pair (raw16 raw16: genai's boundary layers). Prints
// the split kernel that ran and the planner's layout.
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Iops/include scripts/cuda_attention_probe.cu ops/cuda/attention_mma.cu ops/cuda/attention_tc.cu ops/cuda/split_plan.cpp \
//        ops/cuda/attention.cu ops/cuda/attention_split.cu ops/cuda/finish.cu ops/cuda/copy.cu ops/cuda/prefill.cu ops/cuda/past_chunk.cu ops/cuda/pack.cu ops/cpu/attention.cpp ops/cpu/pack.cpp -o /tmp/probe
//   /tmp/probe B S key_format value_format [iters] [pad] [width] [inplace] [rotary] [shift] [mask] [chunk]
//   pad: rows of capacity past S in the past caches; width: bytes per cache row (0: the packed
//   sizes); inplace 1: past and present share buffers of S + pad + 1 rows, as TQGroupQueryAttention
//   runs (the new token written in place, no cache copy), else present is a separate buffer;
//   rotary 1: through TQGroupQueryAttention's launcher (rotary embedding of Q and K first, past
//   lengths from seqlens_k), checked against the CPU's; shift: the past caches start this many bytes
//   into their allocations (every (b, head) region moves with them: with a capacity that makes
//   regions a multiple of 16 bytes, shift 4 puts them all at 4 mod 16; shifts that are not multiples
//   of 4 are refused by the launchers, which the probe prints); mask 1: TQAttention's additive fp16 mask
//   [B, 1, 1, S + 1] (values in [-2, 0], a padding-style mask's broadcast), not with rotary; chunk C > 1:
//   a continuation chunk of C causal new tokens over the past (not with rotary or mask; inplace 1 for
//   the chunk kernels): each split kernel that may take it (the chunk kernel, then the wgmma one with
//   TURBOQUANT_CHUNK_WGMMA=1) timed back to back and checked against the CPU kernels, in one process.
// Prints the time per step back to back, "alone": each step after a spin kernel that keeps the GPU
// busy while the host queues it, timed by events (median of up to 100; ~3 us of event overhead
// included), as a layer's step runs after other kernels, and "idle-started": each step launched on
// an idle GPU, as ONNX Runtime's steps are. TQ_PROBE_FLUSH_MB=N: each step timed alone follows a read
// of N MB instead (then a read of its Q, K and V), as a model's layer follows its weights' stream: the
// step's instructions, tables and caches come from DRAM, not L2.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "turboquant/cpu_kernels.h"
#include "turboquant/cuda_kernels.h"

using namespace turboquant;

// Keeps the GPU busy for `ns` nanoseconds: queued before a timed step, it lets the host queue the
// step's launches and events behind it, so the events time the step alone (its launches not waited
// for), as a layer's step runs in a model, after other kernels.
__global__ void spin_kernel(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

// Reads n 16-byte words (a sum no input reaches, so the loads stay): L2 then holds these bytes.
__global__ void read_kernel(const uint4* x, int64_t n, unsigned* sink) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 w = x[i];
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

#ifdef TQ_PHASES  // the phase marks of the split kernel's first block and the finish kernel's first merge
namespace turboquant::cuda {
void tc_phase_times(long long* clock, long long* ns, long long* blocks, int* sms);
void finish_phase_times(long long* clock, long long* ns, long long* blocks, int* sms);
}  // namespace turboquant::cuda
#endif

// ms per step of `iters` steps back to back on st, after two warm-up steps.
template <typename Step>
float back_to_back_ms(Step step, int iters, cudaStream_t st) {
  for (int i = 0; i < 2; ++i) step();
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaEventRecord(a, st);
  for (int i = 0; i < iters; ++i) step();
  cudaEventRecord(b, st);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms / iters;
}

// The CPU kernels' ParallelFor on every core (the chunks' references are seconds of work).
void threads(size_t n, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < std::max(1u, std::thread::hardware_concurrency()); ++i) {
    pool.emplace_back([&] {
      for (size_t j; (j = next++) < n;) fn(j);
    });
  }
  for (auto& t : pool) t.join();
}

// A continuation chunk (p.q_len > 1 new tokens over the past): the CPU kernels' Y and new rows, then
// each chunk kernel that takes the call (TURBOQUANT_CHUNK_WGMMA unset, then 1), Y set to NaN before
// its checked run, timed back to back.
template <typename Step>
int chunk_report(const AttentionParams& p, Step step, const __half* q, const __half* k, const __half* v, __half* y,
                 uint8_t* pk, uint8_t* pv, uint8_t* ok, uint8_t* ov, int64_t R, int64_t Rp, int sms, int iters,
                 cudaStream_t st) {
  const int64_t B = p.batch, Hkv = p.kv_heads, C = p.q_len, S = p.past_len, D = p.head_dim;
  const int64_t nq = B * C * p.q_heads * D, nkv = B * C * Hkv * D, kb = p.key_row(), vb = p.value_row();
  const bool inplace = ok == pk;
  std::vector<uint8_t> hk(B * Hkv * R * kb), hv(B * Hkv * R * vb), hok(inplace ? 0 : B * Hkv * Rp * kb),
      hov(inplace ? 0 : B * Hkv * Rp * vb);
  std::vector<__half> hq(nq), hkn(nkv), hvn(nkv), ry(nq), hy(nq);
  cudaMemcpy(hk.data(), pk, hk.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(hv.data(), pv, hv.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(hq.data(), q, nq * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hkn.data(), k, nkv * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hvn.data(), v, nkv * 2, cudaMemcpyDeviceToHost);
  const auto t0 = std::chrono::steady_clock::now();
  uint8_t *rk = inplace ? hk.data() : hok.data(), *rv = inplace ? hv.data() : hov.data();
  cpu::attention(p, hq.data(), hkn.data(), hvn.data(), nullptr, hk.data(), hv.data(), ry.data(), rk, rv, threads);
  printf("the CPU kernels' reference: %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  const int64_t rows = inplace ? R : Rp;  // rows per (b, head) of present
  const double flop = 4.0 * B * p.q_heads * C * (S + C / 2.0) * D;
  for (const char* wgmma : {"0", "1"}) {
    setenv("TURBOQUANT_CHUNK_WGMMA", wgmma, 1);
    const cuda::SplitPlan plan = cuda::attention_plan(p, pk, pv, sms);
    if (wgmma[0] == '1' && plan.kernel != cuda::SplitKernel::kTensorCoreChunkWgmma) {
      printf("the wgmma chunk kernel does not take this call (planned %s)\n", cuda::split_kernel_name(plan.kernel));
      continue;
    }
    cudaMemset(y, 0xFF, nq * 2);  // NaN: a value the kernels do not write shows
    const cudaError_t e = step();
    cudaStreamSynchronize(st);
    const cudaError_t last = cudaGetLastError();
    if (e != cudaSuccess || last != cudaSuccess) {
      printf("%s: %s / %s\n", cuda::split_kernel_name(plan.kernel), cudaGetErrorString(e), cudaGetErrorString(last));
      return 1;
    }
    cudaMemcpy(hy.data(), y, nq * 2, cudaMemcpyDeviceToHost);
    double worst = 0, mag = 0;
    int64_t nan = 0;
    for (int64_t i = 0; i < nq; ++i) {
      const double a = __half2float(hy[i]), b = __half2float(ry[i]);
      if (std::isnan(a) != std::isnan(b)) ++nan;
      else if (!std::isnan(a)) worst = std::max(worst, std::abs(a - b)), mag = std::max(mag, std::abs(b));
    }
    std::vector<uint8_t> gk(B * Hkv * rows * kb), gv(B * Hkv * rows * vb);
    cudaMemcpy(gk.data(), ok, gk.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(gv.data(), ov, gv.size(), cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t bh = 0; bh < B * Hkv; ++bh)
      for (int64_t r = bh * rows + S; r < bh * rows + S + C; ++r) {
        bad += memcmp(gk.data() + r * kb, rk + r * kb, packed_size(p.key_format, D)) != 0;
        bad += memcmp(gv.data() + r * vb, rv + r * vb, packed_size(p.value_format, D)) != 0;
      }
    const float ms = back_to_back_ms(step, iters, st);
    printf("B=%lld S=%lld chunk %lld %s/%s, split kernel %s (planned %s, %d splits of %lld, %d bytes of shared memory): "
           "%.3f ms per call, %.0f TFLOP/s; max |Y_cuda - Y_cpu| = %.3g (max |Y| %.3g), %lld NaN differing, new rows "
           "differing %lld of %lld (%s)\n",
           (long long)B, (long long)S, (long long)C, format_name(p.key_format), format_name(p.value_format),
           cuda::split_kernel_name(cuda::last_split_kernel()), cuda::split_kernel_name(plan.kernel), plan.layout.splits,
           (long long)plan.layout.split_len, plan.smem, ms, flop / (ms * 1e-3) / 1e12, worst, mag,
           (long long)nan, (long long)bad, (long long)(2 * B * Hkv * C), cudaGetErrorString(cudaGetLastError()));
  }
  unsetenv("TURBOQUANT_CHUNK_WGMMA");
  return 0;
}

int main(int argc, char** argv) {
  const int64_t B = argc > 1 ? atoll(argv[1]) : 8, S = argc > 2 ? atoll(argv[2]) : 32768;
  const Format kf = parse_format(argc > 3 ? argv[3] : "mse4"), vf = parse_format(argc > 4 ? argv[4] : "uint4");
  const int64_t Hq = 32, Hkv = 8;
  const int D = 128, iters = argc > 5 ? atoi(argv[5]) : 50;
  const int64_t pad = argc > 6 ? atoll(argv[6]) : 0, width = argc > 7 ? atoll(argv[7]) : 0;
  const bool inplace = argc > 8 && atoi(argv[8]) != 0;
  const bool rotary = argc > 9 && atoi(argv[9]) != 0;
  const int64_t shift = argc > 10 ? atoll(argv[10]) : 0;
  const bool masked = argc > 11 && atoi(argv[11]) != 0 && !rotary;
  const int64_t C = argc > 12 && !rotary && !masked ? std::max(1LL, atoll(argv[12])) : 1;  // new tokens
  const int64_t R = S + pad + (inplace ? C : 0), Rp = inplace ? R : R + C;  // rows of past, of present
  AttentionParams p;
  p.batch = B, p.q_heads = Hq, p.kv_heads = Hkv, p.q_len = C, p.new_len = C, p.past_len = S;
  p.is_causal = C > 1;
  p.head_dim = p.v_head_dim = D, p.key_format = kf, p.value_format = vf, p.norm_correction = true;
  p.scale = 0.0883883f, p.dtype = DType::kFloat16;
  const bool rows = pad || width || inplace;
  p.past_rows = rows ? R : 0, p.present_rows = rows ? Rp : 0;  // present holds all of past's rows
  p.key_row_bytes = width, p.value_row_bytes = width;
  p.q = {C * Hq * D, D, Hq * D}, p.k = {C * Hkv * D, D, Hkv * D}, p.v = p.k, p.y = p.q;  // [B, C, H * D]
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
  cudaMalloc(&pk, B * Hkv * R * kb + shift), cudaMalloc(&pv, B * Hkv * R * vb + shift);
  pk += shift, pv += shift;
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
  const int64_t nq = B * C * Hq * D, nkv = B * C * Hkv * D;  // elements of Q (and Y), of K and of V
  cudaMalloc(&q, nq * 2), cudaMalloc(&k, nkv * 2), cudaMalloc(&v, nkv * 2), cudaMalloc(&y, nq * 2);
  for (__half* t : {q, k, v}) {  // the random block, repeated
    const int64_t n = t == q ? nq : nkv;
    for (int64_t i = 0; i < n; i += unit * D) cudaMemcpy(t + i, x, std::min(unit * D, n - i) * 2, cudaMemcpyDeviceToDevice);
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  [[maybe_unused]] const int64_t sms_count = sms;
  // rotary: tables of the positions 0..R (cos, sin of pos x 10000^(-i / 64)) and seqlens_k = S
  const int64_t half = D / 2, positions = R + C;
  std::vector<__half> hcos(positions * half), hsin(positions * half);
  for (int64_t t = 0; t < positions; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = t * std::pow(10000.0, -double(i) / half);
      hcos[t * half + i] = __float2half(float(std::cos(angle))), hsin[t * half + i] = __float2half(float(std::sin(angle)));
    }
  __half *dcos, *dsin;
  int32_t* seqlens;
  cudaMalloc(&dcos, hcos.size() * 2), cudaMalloc(&dsin, hsin.size() * 2), cudaMalloc(&seqlens, B * 4);
  cudaMemcpy(dcos, hcos.data(), hcos.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dsin, hsin.data(), hsin.size() * 2, cudaMemcpyHostToDevice);
  const std::vector<int32_t> hseq(B, static_cast<int32_t>(S));
  cudaMemcpy(seqlens, hseq.data(), B * 4, cudaMemcpyHostToDevice);
  RotaryParams rot;
  rot.rotary_dim = D, rot.max_positions = positions, rot.cos = dcos, rot.sin = dsin;
  std::vector<__half> hmask(masked ? B * (S + 1) : 0);
  for (auto& m : hmask) m = __float2half(-2.0f * (rand() / (float)RAND_MAX));
  __half* dmask = nullptr;
  if (masked) {
    cudaMalloc(&dmask, hmask.size() * 2);
    cudaMemcpy(dmask, hmask.data(), hmask.size() * 2, cudaMemcpyHostToDevice);
    p.mask_type = MaskType::kFloat16;
    p.mask_stride[0] = S + 1, p.mask_stride[3] = 1;
  }
  void* ws = nullptr;
  size_t ws_bytes = rotary ? cuda::gqa_workspace_bytes(p, rot, sms) : cuda::attention_workspace_bytes(p, sms);
  if (C > 1) {  // room for either chunk kernel's plan
    setenv("TURBOQUANT_CHUNK_WGMMA", "1", 1);
    ws_bytes = std::max(ws_bytes, cuda::attention_workspace_bytes(p, sms));
    unsetenv("TURBOQUANT_CHUNK_WGMMA");
  }
  cudaMalloc(&ws, ws_bytes + 1);
  cudaStream_t st;
  cudaStreamCreate(&st);
  auto step = [&] {
    return rotary ? cuda::gqa_attention(p, rot, seqlens, false, q, k, v, pk, pv, y, ok, ov, ws, sms, st)
                  : cuda::attention(p, q, k, v, dmask, pk, pv, y, ok, ov, ws, sms, st);
  };
  if (const cudaError_t e = step(); e != cudaSuccess) {  // refused (a fault would show as the last error below)
    printf("the launcher refused these caches: %s\n", cudaGetErrorString(e));
    return 0;
  }
  if (C > 1) return chunk_report(p, step, q, k, v, y, pk, pv, ok, ov, R, Rp, sms, iters, st);
  // the planner's choice for this call, and the kernel that ran
  const cuda::SplitPlan plan = cuda::attention_plan(p, pk, pv, sms);
  printf("split kernel %s (planned %s): %d splits of %lld tokens, %d warps, %d bytes of dynamic shared memory\n",
         cuda::split_kernel_name(cuda::last_split_kernel()), cuda::split_kernel_name(plan.kernel), plan.layout.splits,
         static_cast<long long>(plan.layout.split_len), plan.warps, plan.smem);
  const float ms = back_to_back_ms(step, iters, st) * iters;
  // steps alone: each after a spin kernel, between two events (the bench's GPU time counts a step's
  // kernels from the first one's start to the last one's end, as here; but ORT's steps start on an
  // idle GPU with the host launching the second kernel some microseconds after the first, which the
  // phases build's idle-started step shows and this does not)
  const int alone_steps = std::max(5, std::min(100, 2 * iters));  // (few under the sanitizers, iters 1)
  std::vector<cudaEvent_t> ea(alone_steps), eb(alone_steps);
  for (int i = 0; i < alone_steps; ++i) cudaEventCreate(&ea[i]), cudaEventCreate(&eb[i]);
  const char* flush_env = std::getenv("TQ_PROBE_FLUSH_MB");
  const int64_t flush_words = flush_env ? atoll(flush_env) * (1 << 20) / 16 : 0;
  uint4* flush_buf = nullptr;
  unsigned* sink = nullptr;
  if (flush_words > 0) {
    cudaMalloc(&flush_buf, flush_words * 16), cudaMalloc(&sink, 4);
    cudaMemset(flush_buf, 0, flush_words * 16);
    printf("each step timed alone after a read of %lld MB\n", static_cast<long long>(flush_words * 16 >> 20));
  }
  for (int i = 0; i < alone_steps; ++i) {
    if (flush_words > 0) {
      read_kernel<<<4 * sms, 256, 0, st>>>(flush_buf, flush_words, sink);
      read_kernel<<<1, 256, 0, st>>>(reinterpret_cast<const uint4*>(q), B * Hq * D * 2 / 16, sink);
      read_kernel<<<1, 256, 0, st>>>(reinterpret_cast<const uint4*>(k), B * Hkv * D * 2 / 16, sink);
      read_kernel<<<1, 256, 0, st>>>(reinterpret_cast<const uint4*>(v), B * Hkv * D * 2 / 16, sink);
    } else {
      spin_kernel<<<1, 32, 0, st>>>(40000);
    }
    cudaEventRecord(ea[i], st);
    step();
    cudaEventRecord(eb[i], st);
  }
  cudaStreamSynchronize(st);
  std::vector<float> alone(alone_steps);
  for (int i = 0; i < alone_steps; ++i) cudaEventElapsedTime(&alone[i], ea[i], eb[i]);
  std::sort(alone.begin(), alone.end());
  // steps started on an idle GPU, as ONNX Runtime's are (its host work exceeds a step's GPU work):
  // the first launch starts as it is made, the next one some microseconds later; the time from an
  // event recorded just before the step (which includes the first launch's host cost, the same for
  // any build) to its end
  std::vector<float> idle(alone_steps);
  for (int i = 0; i < alone_steps; ++i) {
    cudaStreamSynchronize(st);
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(200)) {
    }
    cudaEventRecord(ea[i], st);
    step();
    cudaEventRecord(eb[i], st);
  }
  cudaStreamSynchronize(st);
  for (int i = 0; i < alone_steps; ++i) cudaEventElapsedTime(&idle[i], ea[i], eb[i]);
  std::sort(idle.begin(), idle.end());
#ifdef TQ_PHASES
  // the last of the steps timed alone (after a spin kernel), then one step after 2 ms of idling
  for (int isolated = 0; isolated < 2; ++isolated) {
    if (isolated) {
      cudaStreamSynchronize(st);
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(2)) {
      }
      step();
      cudaStreamSynchronize(st);
    }
    long long tc[32], tn[32], fc[32], fn[32];
    std::vector<long long> blocks(2 * 4096);
    std::vector<int> sms(4096);
    cuda::tc_phase_times(tc, tn, blocks.data(), sms.data());
    std::vector<long long> fblocks(2 * 4096);
    cuda::finish_phase_times(fc, fn, fblocks.data(), nullptr);
    printf("%s step, ns from the split kernel's first block's start (SM cycles since it):", isolated ? "idle-started" : "last timed");
    // the split kernel's marks in program order (12-19: finer ones where the kernel has them)
    for (int i : {12, 13, 14, 1, 2, 15, 16, 17, 3, 18, 19, 4, 5, 6})
      if (tn[i] != 0) printf(" s%d %lld (%lld)", i, tn[i] - tn[0], tc[i] - tc[0]);
    for (int i = 8; i <= 11; ++i) printf(" f%d %lld", i, fn[i] - tn[0]);
    printf("\n");
    // the split kernel's blocks (in place, tensor-core path: B x Hkv x splits of them): start and end
    // times from block 0's start, quantiles, and the slowest blocks with their SMs
    // (the blocks the launch had: those with a start time, as the marks of one process's runs all
    // come from launches of the same size)
    int nb = 0;
    while (nb < 4096 && blocks[2 * nb] != 0) ++nb;
    std::vector<std::pair<long long, int>> ends;
    long long first = blocks[0], last_start = 0;
    for (int i = 0; i < nb; ++i) first = std::min(first, blocks[2 * i]);
    for (int i = 0; i < nb; ++i) {
      ends.push_back({blocks[2 * i + 1] - first, i});
      last_start = std::max(last_start, blocks[2 * i] - first);
    }
    std::sort(ends.begin(), ends.end());
    printf("  %d blocks: last start %lld ns; ends min %lld, 10%% %lld, median %lld, 90%% %lld, max %lld; slowest (block sm ns):", nb,
           last_start, ends[0].first, ends[nb / 10].first, ends[nb / 2].first, ends[nb * 9 / 10].first, ends[nb - 1].first);
    for (int i = nb - 1; i >= std::max(0, nb - 6); --i) printf(" (%d %d %lld)", ends[i].second, sms[ends[i].second], ends[i].first);
    // the finish kernel's blocks: the packing ones first (the new keys' and values' vectors, 4 per
    // block), then one per merged query row
    const int64_t packs = 2 * ((B * Hkv + 3) / 4), merges = B * Hq;
    long long pack_end = 0, merge_end = 0;
    for (int64_t i = 0; i < std::min<int64_t>(4096, packs + merges); ++i)
      (i < packs ? pack_end : merge_end) = std::max(i < packs ? pack_end : merge_end, fblocks[2 * i + 1] - first);
    printf("; finish: packing blocks end by %lld, merges by %lld", pack_end, merge_end);
    printf("; fastest:");
    for (int i = 0; i < std::min(nb, 4); ++i) printf(" (%d %d %lld)", ends[i].second, sms[ends[i].second], ends[i].first);
    printf("\n");
  }
#endif
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
  if (rotary) {
    RotaryParams hrot = rot;
    hrot.cos = hcos.data(), hrot.sin = hsin.data();
    AttentionParams hp = p;
    const std::vector<int32_t> past(B, static_cast<int32_t>(S));
    hp.past_lens = past.data();
    cpu::gqa_attention(hp, hrot, hq.data(), hkn.data(), hvn.data(), cpk, cpv, ry.data(), inplace ? cpk : hok.data(),
                       inplace ? cpv : hov.data(), serial);
  } else {
    cpu::attention(p, hq.data(), hkn.data(), hvn.data(), masked ? hmask.data() : nullptr, cpk, cpv, ry.data(), inplace ? cpk : hok.data(),
                   inplace ? cpv : hov.data(), serial);
  }
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
  printf("rows %lld/%lld bytes, capacity %lld, caches shifted by %lld bytes, %s%s%s\n", (long long)kb, (long long)vb, (long long)R,
         (long long)shift, inplace ? "in place" : "present copied", rotary ? ", TQGroupQueryAttention with rotary" : "",
         masked ? ", fp16 mask" : "");
  printf("B=%lld S=%lld %s/%s: %.1f us per call, %.0f GB/s of cache read (%s)\n", (long long)B, (long long)S,
         format_name(kf), format_name(vf), ms * 1e3 / iters, bytes / (ms * 1e-3 / iters) / 1e9,
         cudaGetErrorString(cudaGetLastError()));
  printf("B=%lld S=%lld %s/%s alone: median %.1f us (10%% %.1f, 90%% %.1f) over %d steps\n", (long long)B, (long long)S,
         format_name(kf), format_name(vf), alone[alone_steps / 2] * 1e3, alone[alone_steps / 10] * 1e3, alone[alone_steps * 9 / 10] * 1e3,
         alone_steps);
  printf("B=%lld S=%lld %s/%s idle-started: median %.1f us (10%% %.1f, 90%% %.1f) over %d steps\n", (long long)B, (long long)S,
         format_name(kf), format_name(vf), idle[alone_steps / 2] * 1e3, idle[alone_steps / 10] * 1e3, idle[alone_steps * 9 / 10] * 1e3,
         alone_steps);
  return 0;
}
