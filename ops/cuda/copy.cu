// present = past for TQAttention calls whose present is a buffer of its own: both caches' past rows
// copied, and a fresh preallocated present's rows after them zeroed, in one launch (copy_kernel).
#include <algorithm>
#include <cstdint>

#include "attention_steps.cuh"
#include "split_common.cuh"

namespace turboquant::cuda::detail {
namespace {

constexpr int kThreads = 128;

// A batched copy: `regions` ranges of n bytes, src + r src_pitch -> dst + r dst_pitch, of any
// alignment (src == nullptr: the ranges are zeroed). Item i is one 16-byte-aligned block of a
// destination range (n / 16 + 2 per range cover it wherever it starts).
struct CopyJob {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  int64_t src_pitch = 0, dst_pitch = 0, n = 0, regions = 0;
  __host__ __device__ int64_t items() const { return regions * (n / 16 + 2); }
};

// Whole blocks: one 16-byte store of four words funnel-shifted out of the source's aligned words
// (a word holding one of the range's bytes lies in its allocation); the blocks cut by a range's
// ends byte by byte.
__device__ inline void copy_item(const CopyJob& j, int64_t i) {
  const int64_t per = j.n / 16 + 2, r = i / per, k = i % per;
  const uint8_t* s = j.src ? j.src + r * j.src_pitch : nullptr;
  uint8_t* d = j.dst + r * j.dst_pitch;
  const int64_t lo = 16 * k - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & 15);  // the block's first byte
  if (lo >= 0 && lo + 16 <= j.n) {
    if (s == nullptr) {
      *reinterpret_cast<uint4*>(d + lo) = make_uint4(0u, 0u, 0u, 0u);
      return;
    }
    const uintptr_t at = reinterpret_cast<uintptr_t>(s + lo);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(at & ~uintptr_t{3});
    const uint32_t sh = static_cast<uint32_t>(at & 3) * 8;
    const uint32_t a0 = w[0], a1 = w[1], a2 = w[2], a3 = w[3], a4 = sh != 0 ? w[4] : 0u;
    *reinterpret_cast<uint4*>(d + lo) = make_uint4(__funnelshift_r(a0, a1, sh), __funnelshift_r(a1, a2, sh),
                                                   __funnelshift_r(a2, a3, sh), __funnelshift_r(a3, a4, sh));
  } else {
    for (int b = 0; b < 16; ++b) {
      const int64_t o = lo + b;
      if (o >= 0 && o < j.n) d[o] = s ? s[o] : 0;
    }
  }
}

// Both caches' past copies and the zeroing of the rows after them (CopyJobs::job), in one launch,
// at the copy rate of the device (cudaMemcpy2DAsync moved these rows at about half of it on an H200).
struct CopyJobs {
  CopyJob job[4];
  int64_t end[4];  // items of jobs 0..j together, worked out on the host
  CopyJobs(const CopyJob& a, const CopyJob& b, const CopyJob& c, const CopyJob& d) : job{a, b, c, d} {
    int64_t n = 0;
    for (int j = 0; j < 4; ++j) end[j] = n += job[j].items();
  }
};

__global__ void __launch_bounds__(kThreads) copy_kernel(CopyJobs jobs) {
  launch_dependents();  // the split kernel reads the past, not the present
  const int64_t total = jobs.end[3];
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    int q = 0;
    while (q < 3 && i >= jobs.end[q]) ++q;
    copy_item(jobs.job[q], q > 0 ? i - jobs.end[q - 1] : i);
  }
}

// present = past, unless it is the same buffer (the new tokens are packed after each sequence's past
// by the finish kernel).
CopyJob copy_job(const AttentionParams& p, int64_t row_bytes, const uint8_t* past, uint8_t* present) {
  const int64_t past_rows = p.past_rows_or_len(), present_rows = p.present_rows_or_total();
  if (past == nullptr || past == present || past_rows == 0) return CopyJob{};
  return CopyJob{past, present, past_rows * row_bytes, present_rows * row_bytes, past_rows * row_bytes,
                 p.batch * p.kv_heads};
}

// The rows of a fresh preallocated present after the copied past, zeroed (AttentionParams::zeroed_from).
CopyJob zero_job(const AttentionParams& p, int64_t row_bytes, const uint8_t* past, uint8_t* present) {
  const int64_t from = p.zeroed_from(past, present), present_rows = p.present_rows_or_total();
  if (from == present_rows) return CopyJob{};
  return CopyJob{nullptr, present + from * row_bytes, 0, present_rows * row_bytes, (present_rows - from) * row_bytes,
                 p.batch * p.kv_heads};
}

}  // namespace

cudaError_t copy_past(const AttentionParams& p, const uint8_t* past_key, uint8_t* present_key,
                      const uint8_t* past_value, uint8_t* present_value, int num_sms, cudaStream_t stream) {
  const CopyJobs jobs(copy_job(p, p.key_row(), past_key, present_key),
                      copy_job(p, p.value_row(), past_value, present_value),
                      zero_job(p, p.key_row(), past_key, present_key),
                      zero_job(p, p.value_row(), past_value, present_value));
  const int64_t items = jobs.end[3];
  if (items == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, 8LL * std::max(num_sms, 1));
  copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(jobs);
  return cudaGetLastError();
}

}  // namespace turboquant::cuda::detail
