// What the split-KV attention kernels share (ops/cuda/attention_split.cu, attention_mma.cu,
// attention_tc.cu and past_chunk.cu): how the past is split into blocks, and the partial results the
// merge kernel combines.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "device_attributes.h"
#include "turboquant/split_plan.h"
#include "turboquant/float_io.h"
#include "turboquant/params.h"

namespace turboquant::cuda::detail {

constexpr int kTile = kCudaCoreTile;  // tokens per tile of the CUDA-core kernel; splits are multiples
constexpr int kMaxStageBytes = kCudaCoreStageMax;  // one tile's packed K and V, at most
using Layout = SplitLayout;

// Partial results: [B*Hkv][rows][splits] x (max, sum, acc[Dv]).
__host__ __device__ inline int64_t partial_stride(int dv) { return 2 + dv; }

// Launches the tensor-core bulk split kernel (attention_tc.cu) where plan_split chose it (plan.kernel
// kTensorCoreBulk: its warps, shared memory and layout). rot: the rotary embedding the kernel
// applies to Q as it loads it (rot.rotary_dim 0: none; see fuses_rotary). mask: TQAttention's
// (p.mask_type), or null.
cudaError_t launch_tc_split(const AttentionParams& p, const RotaryParams& rot, const SplitPlan& plan, const void* q,
                            const void* mask, const uint8_t* past_key, const uint8_t* past_value, float* partial,
                            cudaStream_t stream);

// The earlier tensor-core split kernel (attention_mma.cu), for MSE keys and uint values that
// attention_tc.cu does not take (head sizes 80 and 96, MSE 4-bit keys with uint3 values): no mask,
// every past token visible to every query row (plan.kernel kTensorCoreMma). It writes the same
// partials as split_kernel.
cudaError_t launch_mma_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                             const uint8_t* past_value, float* partial, cudaStream_t stream);

// The CUDA-core split kernel (attention_split.cu): every call the others do not take (masks, float32,
// any format pair), up to 8 query rows per block (plan.layout.rows_per_block).
cudaError_t launch_cuda_core_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const void* mask,
                                   const uint8_t* past_key, const uint8_t* past_value, float* partial,
                                   cudaStream_t stream);

// A continuation chunk's query rows over the packed past in 64-row tiles (past_chunk.cu; plan.kernel
// kTensorCoreChunk): MSE keys with uint values, head size 64 or 128, fp16 or bf16, no mask or softcap,
// every past token visible to every row but for a sliding window. It writes the same partials as split_kernel.
cudaError_t launch_chunk_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                               const uint8_t* past_value, float* partial, cudaStream_t stream);

// The same calls on Hopper's warpgroup products (past_chunk_sm90.cu, sm_90a code; plan.kernel
// kTensorCoreChunkWgmma): 128-row blocks.
cudaError_t launch_chunk_split_sm90(const AttentionParams& p, const SplitPlan& plan, const void* q,
                                    const uint8_t* past_key, const uint8_t* past_value, float* partial,
                                    cudaStream_t stream);

// A chunk's query rows over its past (dense_past.cu; plan.kernel kDensePrefill): the past decoded dense
// into the workspace at plan.past_copy_offset, then the prefill kernel; one split's partials.
cudaError_t launch_dense_prefill_split(const AttentionParams& p, const SplitPlan& plan, const void* q,
                                       const uint8_t* past_key, const uint8_t* past_value, void* y, float* partial,
                                       uint8_t* workspace, cudaStream_t stream);

#ifdef __CUDACC__
// Programmatic dependent launch (sm_90; no-ops before): a kernel launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the launch before it runs, once
// that one's blocks have all called launch_dependents; grid_dependency_wait then waits until it has
// finished and its writes are visible. Every read of what an earlier launch wrote comes after it.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Developer timings (scripts/build_probe.sh builds OUT.phases with TQ_PHASES): the SM clock and the
// global timer at the phases of one block of a kernel, read back by the function TQ_PHASE_READER
// defines in each file that marks them (the probe prints them). Compiled out
// otherwise.
#ifdef TQ_PHASES
static __device__ long long tq_phase_clock[32], tq_phase_ns[32];  // per file (no relocatable device code)
// every block's start and end (global timer) and SM, by linear block index (the first 4096)
constexpr int kPhaseBlocks = 4096;
static __device__ long long tq_block_ns[kPhaseBlocks][2];
static __device__ int tq_block_sm[kPhaseBlocks];
__device__ __forceinline__ long long global_ns() {
  long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}
__device__ __forceinline__ void phase_mark(int i) {
  tq_phase_clock[i] = clock64();
  tq_phase_ns[i] = global_ns();
}
__device__ __forceinline__ void block_mark(int end) {
  const unsigned id = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (threadIdx.x != 0 || id >= kPhaseBlocks) return;
  tq_block_ns[id][end] = global_ns();
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  tq_block_sm[id] = static_cast<int>(sm);
}
#define TQ_PHASE(first, i) \
  do {                     \
    if ((first) && threadIdx.x == 0) phase_mark(i); \
  } while (0)
#define TQ_BLOCK(end) block_mark(end)
// Defines name(clock, ns, blocks, sms): this file's phase marks, copied to the host (32 of each), and
// the blocks' start and end times and SMs (kPhaseBlocks of each).
#define TQ_PHASE_READER(name)                                                                  \
  void name(long long* clock, long long* ns, long long* blocks, int* sms) {                   \
    cudaMemcpyFromSymbol(clock, detail::tq_phase_clock, 32 * 8);                              \
    cudaMemcpyFromSymbol(ns, detail::tq_phase_ns, 32 * 8);                                    \
    if (blocks) cudaMemcpyFromSymbol(blocks, detail::tq_block_ns, detail::kPhaseBlocks * 16); \
    if (sms) cudaMemcpyFromSymbol(sms, detail::tq_block_sm, detail::kPhaseBlocks * 4);         \
  }
#else
#define TQ_PHASE(first, i) \
  do {                     \
  } while (0)
#define TQ_BLOCK(end) \
  do {                \
  } while (0)
#endif

// f(std::integral_constant<int, D>, T) for the call's head size D (64 or 128) and 16-bit type T (fp16
// or bf16): the template instance a launcher runs.
template <typename F>
cudaError_t with_head_and_type(const AttentionParams& p, const F& f) {
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.head_dim == 64) return bf16 ? f(D64{}, __nv_bfloat16{}) : f(D64{}, __half{});
  return bf16 ? f(D128{}, __nv_bfloat16{}) : f(D128{}, __half{});
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch on devices that
// have them (sm_90 and newer): the kernel may start while the launch before it runs (see above).
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                             Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
#ifdef TQ_NO_PDL  // developer A/B builds (scripts/build_probe.sh)
  config.numAttrs = 0;
#else
  config.numAttrs = device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9 ? 1 : 0;
#endif
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Starts copying n bytes (n even, both addresses 2-byte aligned) into shared memory with the
// warp's lanes: cp.async of 16 or 4 bytes where both addresses allow, plain 2-byte copies otherwise
// and for the tail. The caller commits, waits and syncs the warp.
__device__ inline void warp_copy_async(uint8_t* dst, const uint8_t* src, int n, int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  const int width = (a & 15) == 0 ? 16 : (a & 3) == 0 ? 4 : 0;
  int done = 0;
  if (width) {
    const int chunks = n / width;
    for (int i = lane; i < chunks; i += 32) __pipeline_memcpy_async(dst + i * width, src + i * width, width);
    done = chunks * width;
  }
  for (int i = done / 2 + lane; i < n / 2; i += 32) {
    reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
  }
}
// The block's query rows (batch b; head row_hq[r] at position row_pos[r] for r < rows) as floats in
// x[rows_max][dp], zero beyond the head size and the rows, times H (the unnormalised
// Walsh-Hadamard transform of length dp) when `rotate`: the MSE keys' rotated basis. Syncs the block.
__device__ inline void load_query_rows(const AttentionParams& p, const void* q, int64_t b, const int64_t* row_hq,
                                       const int64_t* row_pos, int rows, int rows_max, int dp, bool rotate, float* x) {
  for (int k = threadIdx.x; k < rows_max * dp; k += blockDim.x) {
    const int r = k / dp, i = k % dp;
    float v = 0.0f;
    if (r < rows && i < p.head_dim) v = load_float(p.dtype, q, b * p.q.b + row_hq[r] * p.q.h + row_pos[r] * p.q.s + i);
    x[k] = v;
  }
  __syncthreads();
  if (!rotate) return;
  for (int h = 1; h < dp; h <<= 1) {
    for (int k = threadIdx.x; k < rows_max * (dp / 2); k += blockDim.x) {
      const int r = k / (dp / 2), j = k % (dp / 2);
      const int i = (j / h) * 2 * h + (j % h);
      float* row = x + r * dp;
      const float a = row[i], c = row[i + h];
      row[i] = a + c;
      row[i + h] = a - c;
    }
    __syncthreads();
  }
}

// The end of a split block whose warps each kept their own online softmax: ws[warp][row][3 + dv]
// holds each warp's max (natural-log units), sum of weights, sum of weights x zero point and value
// accumulators. The block's threads combine them into the partial results of its rows (row r at
// out + r * row_stride: max, sum, acc + zero sum): first a half-warp per row, lane w holding warp
// w's state, works out the row's largest max by shuffles, each warp's factor exp(max_w - max) and
// the row's weighted sums, and stores the max and the sum; then the columns, as sums of the warps'
// accumulators times their factors (one thread per row walking the warps in turn took twice as long,
// at the end of every block, on the critical path of a step). Ends with the block's threads only
// reading ws.
constexpr int kStateWarpsMax = 16, kStateRowsMax = 8;
__device__ inline void store_warp_states(const float* ws, int warps, int rows_max, int rows, int dv, float* out,
                                         int64_t row_stride) {
  __shared__ float factor[kStateRowsMax][kStateWarpsMax], row_zero[kStateRowsMax];
  const int tid = static_cast<int>(threadIdx.x);
  // the warps that hold rows * 16 lanes, whole (the shuffles need every lane of a warp); needs
  // blockDim.x >= 128 for 8 rows
  if (tid < (rows * kStateWarpsMax + 31) / 32 * 32) {
    const int r = tid / kStateWarpsMax, w = tid % kStateWarpsMax;
    const bool on = r < rows && w < warps;
    const float* st = ws + (w * rows_max + r) * (3 + dv);
    const float m = on ? st[0] : -INFINITY;
    float mx = m;
#pragma unroll
    for (int x = kStateWarpsMax / 2; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x, kStateWarpsMax));
    const float f = m == -INFINITY ? 0.0f : __expf(m - mx);
    float sum = on ? st[1] * f : 0.0f, zsum = on ? st[2] * f : 0.0f;
#pragma unroll
    for (int x = kStateWarpsMax / 2; x > 0; x >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, x, kStateWarpsMax);
      zsum += __shfl_xor_sync(0xffffffffu, zsum, x, kStateWarpsMax);
    }
    if (r < rows) {
      factor[r][w] = f;
      if (w == 0) {
        row_zero[r] = zsum;
        out[r * row_stride] = mx;
        out[r * row_stride + 1] = sum;
      }
    }
  }
  __syncthreads();
  for (int k = tid; k < rows * dv; k += static_cast<int>(blockDim.x)) {
    const int r = k / dv, c = k % dv;
    float acc = 0.0f;
    for (int w = 0; w < warps; ++w) acc += ws[(w * rows_max + r) * (3 + dv) + 3 + c] * factor[r][w];
    out[r * row_stride + 2 + c] = acc + row_zero[r];
  }
}
#endif

}  // namespace turboquant::cuda::detail
