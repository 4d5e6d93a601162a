// The last launch of a TQAttention call (finish_kernel): one block per query row merges the split
// kernel's partial results with log-sum-exp, adds the new tokens exactly (float K/V, key offset
// removed; or their part from prefill.cu), restores the value offset and writes Y; in the same launch,
// other blocks pack the new tokens into the present caches (pack_warp_per_vector.cuh); a call with
// no rows to merge (a first prompt) packs them by the four-lane kernel alone (pack_four_lanes.cuh).
#include <cmath>
#include <type_traits>

#include <cuda_fp16.h>

#include "attention_steps.cuh"
#include "cuda_core.cuh"
#include "pack_four_lanes.cuh"
#include "pack_warp_per_vector.cuh"
#include "split_common.cuh"
#include "turboquant/rotary.h"

namespace turboquant::cuda::detail {
namespace {

constexpr int kMaxCols = kMaxHeadDim / kThreads;  // value columns per thread in the merge kernel

__device__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  return total;
}

// Element i of a float tensor (Q, K, V) by the conversion instructions: the values load_float gives
// (a NaN may come back with another payload, which no attention result keeps).
__device__ inline float load_value(DType dt, const void* base, int64_t i) {
  switch (dt) {
    case DType::kFloat16: return __half2float(static_cast<const __half*>(base)[i]);
    case DType::kBFloat16: return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
    default: return static_cast<const float*>(base)[i];
  }
}

// Query row gr = (b, hkv, row) by the block's threads: red and qrow are the block's scratch. A
// decode step's merge is what is left after the split kernel, so everything that needs only the
// op's inputs (the query row, the new tokens' exact scores and values) comes before the wait for
// the split kernel's partial results, which are then read 8 splits at a time (a log-sum-exp over
// each chunk, rescaling the running result between chunks). new_part: the new tokens' part of every
// row, written by prefill.cu (a launch before this one), instead of their scores here.
__device__ void merge_row(const AttentionParams& p, const RotaryParams& rot, const Layout& l, const void* q,
                          const void* k, const void* v, const void* mask, const float* partial, const float* new_part,
                          void* y, int64_t gr, float* red, float* qrow, float* krow, bool after_split) {
  TQ_PHASE(gr == 0, 8);
  if (!after_split) grid_dependency_wait();
  const int64_t bh = gr / l.rows, row = gr % l.rows;
  const int64_t b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t pos = row / l.group, hq = hkv * l.group + row % l.group;
  const int d = p.head_dim, dv = p.v_head_dim, tid = threadIdx.x;

  for (int i = tid; i < d; i += kThreads) qrow[i] = load_value(p.dtype, q, b * p.q.b + hq * p.q.h + pos * p.q.s + i);
  const int64_t past = p.past_of(b);  // an input of the op (no launch of ours writes past lengths)
  const bool rotary = rot.rotary_dim > 0;  // fused (fuses_rotary: one query, one new token)
  if (rotary) {  // the query row and the new key rotated here, as the rotary kernel would have
    for (int i = tid; i < d; i += kThreads) krow[i] = load_value(p.dtype, k, b * p.k.b + hkv * p.k.h + i);
    __syncthreads();
    const float* scale = key_scale_row(rot, hkv, d);
    rotate_shared(rot, p.dtype, d, rotary_position(rot, b, pos, p.q_len, past), qrow, tid, kThreads, scale,
                  ScaleSide::kQuery);
    rotate_shared(rot, p.dtype, d, rotary_position(rot, b, 0, p.new_len, past), krow, tid, kThreads, scale,
                  ScaleSide::kKey);
  }
  const float* koff = p.key_offset ? p.key_offset + hkv * d : nullptr;
  float kn[kMaxCols], vn[kMaxCols];  // new token n's key elements tid + c kThreads and value columns
  auto load_new = [&](int64_t n) {
    const int64_t kbase = b * p.k.b + hkv * p.k.h + n * p.k.s, vbase = b * p.v.b + hkv * p.v.h + n * p.v.s;
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) {
      const int i = tid + c * kThreads;
      kn[c] = i < d ? (rotary ? krow[i] : load_value(p.dtype, k, kbase + i)) - (koff ? koff[i] : 0.0f) : 0.0f;
      vn[c] = i < dv ? load_value(p.dtype, v, vbase + i) : 0.0f;
    }
  };
  if (rotary) __syncthreads();  // krow rotated
  const int64_t new_len = new_part ? 0 : p.new_len;  // the new tokens this block scores
  // the first new token inside the row's sliding window (the ones before it are not scored)
  const int64_t first_new = p.window > 0 ? max(static_cast<int64_t>(0), pos + p.new_len - p.q_len - p.window + 1) : 0;
  if (new_len > first_new) load_new(first_new);

  // 1. the new tokens, exactly: an online softmax of their scores
  float m = -INFINITY, sum = 0.0f, acc[kMaxCols];
  for (int c = 0; c < kMaxCols; ++c) acc[c] = 0.0f;
  __syncthreads();  // qrow
  // new_part's scores are of the keys as given; the past's and these of keys - offset, key_shift below
  // those of the keys as given (which softcap and head_sink take)
  float key_shift = 0.0f;
  if (koff && (new_part || p.softcap > 0.0f || p.head_sink)) {
    float part = 0.0f;
    for (int i = tid; i < d; i += kThreads) part += qrow[i] * koff[i];
    key_shift = block_sum(part, red) * p.scale;
  }
  for (int64_t n = first_new; n < new_len; ++n) {
    float part = 0.0f, vc[kMaxCols];
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) {
      const int i = tid + c * kThreads;
      if (i < d) part += qrow[i] * kn[c];
      vc[c] = vn[c];
    }
    if (n + 1 < new_len) load_new(n + 1);
    float dot = block_sum(part, red) * p.scale;
    if (p.softcap > 0.0f) dot = softcapped(dot, p.softcap, key_shift);
    bool ok;
    const float add = mask_value(p, mask, b, hq, pos, past + n, &ok);
    if (!ok) continue;
    const float s = dot + add;
    if (s == -INFINITY) continue;
    const float m_new = fmaxf(m, s);
    const float rescale = m == -INFINITY ? 0.0f : __expf(m - m_new);
    const float e = __expf(s - m_new);
    sum = sum * rescale + e;
    for (int c = 0; c < kMaxCols; ++c) {
      const int col = tid + c * kThreads;
      if (col < dv) acc[c] = acc[c] * rescale + e * vc[c];
    }
    m = m_new;
  }

  // 2. the splits' partial results (max, sum, acc): past values read back as unpack(v) + offset,
  // so the past's weights' total (mass) times the offset is added once at the end, as the CPU
  // kernel does (an infinite offset times a part's 0 weight would be NaN)
  TQ_PHASE(gr == 0, 9);
  grid_dependency_wait();
  TQ_PHASE(gr == 0, 10);
  if (new_part) {
    const float* np = new_part + (bh * l.rows + row) * partial_stride(dv);
    m = np[0] == -INFINITY ? -INFINITY : np[0] - key_shift;
    sum = np[1];
    for (int c = 0; c < kMaxCols; ++c) {
      const int col = tid + c * kThreads;
      acc[c] = col < dv ? np[2 + col] : 0.0f;
    }
  }
  float mass = 0.0f, off[kMaxCols];
  const float* voff = p.value_offset ? p.value_offset + hkv * dv : nullptr;
  for (int c = 0; c < kMaxCols; ++c) {
    const int col = tid + c * kThreads;
    off[c] = voff && col < dv ? voff[col] : 0.0f;
  }
  if (past > 0) {
    const float* part = partial + (bh * l.rows + row) * l.splits * partial_stride(dv);
    // kChunk splits at a time: all their loads in flight at once (a merge of one split after the
    // other waits for each split's loads), then their largest maximum and weighted sums; 2 at a time
    // for up to 2 splits, where 8 cost more (predicated slots) than they save (docs/performance.md,
    // kept choices)
    const auto merge_splits = [&](auto chunk) {
      constexpr int kChunk = decltype(chunk)::value;
      for (int s0 = 0; s0 < l.splits; s0 += kChunk) {
        float ms[kChunk], ss[kChunk], as[kChunk][kMaxCols];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const bool on = s0 + u < l.splits;
          const float* ps = part + (s0 + u) * partial_stride(dv);
          ms[u] = on ? ps[0] : -INFINITY;
          ss[u] = on ? ps[1] : 0.0f;
#pragma unroll
          for (int c = 0; c < kMaxCols; ++c) {
            const int col = tid + c * kThreads;
            as[u][c] = on && col < dv ? ps[2 + col] : 0.0f;
          }
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) mx = fmaxf(mx, ms[u]);
        if (mx == -INFINITY) {  // every part so far is empty, or saw only NaN scores (its sum NaN)
#pragma unroll
          for (int u = 0; u < kChunk; ++u) sum = ss[u] != ss[u] ? ss[u] : sum;
          continue;
        }
        const float rescale = m == -INFINITY ? 0.0f : __expf(m - mx);
        sum *= rescale;
        mass *= rescale;
#pragma unroll
        for (int c = 0; c < kMaxCols; ++c) acc[c] *= rescale;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const float w = ms[u] == -INFINITY ? 0.0f : __expf(ms[u] - mx);
          sum += ss[u] * w;
          mass += ss[u] * w;
#pragma unroll
          for (int c = 0; c < kMaxCols; ++c) acc[c] += as[u][c] * w;
        }
        m = mx;
      }
    };
    if (l.splits <= 2) {
      merge_splits(std::integral_constant<int, 2>{});
    } else {
      merge_splits(std::integral_constant<int, 8>{});
    }
  }
  if (p.head_sink) {  // the sink joins the softmax's denominator only (its score, in the units of m)
    const float sink = load_float(p.dtype, p.head_sink, hq) - key_shift;
    const float mx = fmaxf(m, sink);
    const float rescale = m == -INFINITY ? 0.0f : __expf(m - mx);
    sum = sum * rescale + (sink == -INFINITY ? 0.0f : __expf(sink - mx));
    mass *= rescale;
    for (int c = 0; c < kMaxCols; ++c) acc[c] *= rescale;
  }
  const float inv = sum > 0.0f ? 1.0f / sum : (sum == sum ? 0.0f : sum);  // NaN: a NaN or +inf score
  const int64_t ybase = b * p.y.b + hq * p.y.h + pos * p.y.s;
  for (int c = 0; c < kMaxCols; ++c) {
    const int col = tid + c * kThreads;
    if (col < dv) store_float(p.dtype, y, ybase + col, (voff ? acc[c] + off[c] * mass : acc[c]) * inv);
  }
  TQ_PHASE(gr == 0, 11);
}

static_assert(kThreads == kPackThreads, "the finish kernel's merge and packing blocks share a size");

// Developer variant (TQ_FINISH_BLOCKS_PER_SM=N): the kernel's registers capped so that N blocks fit an
// SM (8: 64 registers, no spills for the presets' pairs, where ptxas otherwise takes 91-96 and 5
// blocks fit); split_plan.cpp's TQ_FINISH_RESERVE counts on the same N.
#ifdef TQ_FINISH_BLOCKS_PER_SM
#define TQ_FINISH_BOUNDS __launch_bounds__(kThreads, TQ_FINISH_BLOCKS_PER_SM)
#else
#define TQ_FINISH_BOUNDS __launch_bounds__(kThreads)
#endif

// The last launch of a step: blocks [0, kj.blocks) pack the new keys, the next vj.blocks the new
// values, the rest merge one query row each. FK, FV: the caches' formats, or any pair (chosen at
// run time) when kAny. Launched as a programmatic dependent launch: after_split (this step's split
// kernel was the launch before, and it waited for the ones before it) lets the packing blocks run
// while the split kernel does (they read the inputs and write rows it does not read) and the
// merges load their inputs before waiting for its partial results.
template <Format FK, Format FV, bool kAny>
__global__ void TQ_FINISH_BOUNDS
    finish_kernel(AttentionParams p, RotaryParams rot, Layout l, const void* q, const void* k, const void* v,
                  const void* mask, const float* partial, const float* new_part, void* y, PackJob kj, PackJob vj,
                  bool after_split) {
  __shared__ float red[kThreads / 32];
  __shared__ float qrow[kMaxHeadDim];
  __shared__ float z[kPackWarps][kMaxHeadDim];
  __shared__ uint8_t idx[kPackWarps][kMaxHeadDim];
  __shared__ int32_t csq[16];
  launch_dependents();  // a dependent launch waits for this one before it reads anything
  TQ_BLOCK(0);
  const uint32_t block = blockIdx.x, packs = static_cast<uint32_t>(kj.blocks + vj.blocks);
  if (block >= packs) {
    merge_row(p, rot, l, q, k, v, mask, partial, new_part, y, block - packs, red, qrow, z[0], after_split);
    TQ_BLOCK(1);
    return;
  }
  if (!after_split) grid_dependency_wait();
  if (block < kj.blocks) {
    if constexpr (kAny) {
      pack_block_any(kj, block, p.norm_correction, p.dtype, csq, z, idx);
    } else {
      pack_block<FK>(kj, block, p.norm_correction, p.dtype, csq, z, idx);
    }
  } else {
    const uint32_t vb = block - static_cast<uint32_t>(kj.blocks);
    if constexpr (kAny) {
      pack_block_any(vj, vb, p.norm_correction, p.dtype, csq, z, idx);
    } else {
      pack_block<FV>(vj, vb, p.norm_correction, p.dtype, csq, z, idx);
    }
  }
  TQ_BLOCK(1);
}

PackJob new_token_job(const AttentionParams& p, Format fmt, int d, int64_t row_bytes, const BhsStrides& st,
                      const void* x, const float* offset, uint8_t* present) {
  NewTokenRows rows;
  rows.present_rows = p.blocks.table ? p.blocks.max_blocks * p.blocks.block_size : p.present_rows_or_total();
  rows.row_bytes = row_bytes;
  rows.blocks = p.blocks;
  rows.past_len = p.past_len;
  rows.past_lens = p.past_lens;
  rows.past_lens_bias = p.past_lens_bias;
  return detail::new_token_job(fmt, d, x, st, p.batch, p.kv_heads, p.new_len, rows, offset, present);
}

template <Format FK, Format FV, bool kAny = false>
cudaError_t launch_finish(unsigned blocks, const AttentionParams& p, const RotaryParams& rot, const Layout& l,
                          const void* q, const void* k, const void* v, const void* mask, const float* partial,
                          const float* new_part, void* y, bool after_split, const PackJob& kj, const PackJob& vj,
                          cudaStream_t stream) {
  return launch_dependent(finish_kernel<FK, FV, kAny>, dim3(blocks), dim3(kThreads), 0, stream, p, rot, l, q, k, v,
                          mask, partial, new_part, y, kj, vj, after_split);
}

}  // namespace

// A kernel specialised for the presets' format pairs, a general one for the others.
cudaError_t finish(const AttentionParams& p, const RotaryParams& rot, const Layout& l, const void* q, const void* k,
                   const void* v, const void* mask, const float* partial, const float* new_part, void* y,
                   uint8_t* present_key, uint8_t* present_value, bool after_split, cudaStream_t stream) {
  PackJob kj = new_token_job(p, p.key_format, p.head_dim, p.key_row(), p.k, k, p.key_offset, present_key);
  kj.rot = rot;  // the new keys rotated as they are packed (fused), or no rotary
  const PackJob vj = new_token_job(p, p.value_format, p.v_head_dim, p.value_row(), p.v, v, p.value_offset, present_value);
  const int64_t merges = p.q_len > 0 ? p.batch * p.kv_heads * l.rows : 0;
  if (merges == 0 && stream_pack_supported(kj, p.dtype) && stream_pack_supported(vj, p.dtype)) {
    // a first prompt's tokens, Y written before: the throughput kernel, several times the one-warp
    // packing's rate (docs/performance.md, CUDA prefill)
    cudaError_t e = launch_stream_pack(kj, p.norm_correction, p.dtype, stream);
    return e == cudaSuccess ? launch_stream_pack(vj, p.norm_correction, p.dtype, stream) : e;
  }
  const int64_t blocks = merges + kj.blocks + vj.blocks;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX || kj.n > INT32_MAX || vj.n > INT32_MAX) return cudaErrorInvalidValue;
  const bool a = after_split;
  const auto n = static_cast<unsigned>(blocks);
  using F = Format;
  const F kf = p.key_format, vf = p.value_format;
  if (kf == F::kMse4 && vf == F::kUint4) return launch_finish<F::kMse4, F::kUint4>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
  if (kf == F::kFp8 && vf == F::kUint4) return launch_finish<F::kFp8, F::kUint4>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
  if (kf == F::kMse3 && vf == F::kUint4) return launch_finish<F::kMse3, F::kUint4>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
  if (kf == F::kMse3 && vf == F::kUint3) return launch_finish<F::kMse3, F::kUint3>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
  if (kf == F::kRaw16 && vf == F::kRaw16) return launch_finish<F::kRaw16, F::kRaw16>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
  return launch_finish<F::kMse4, F::kUint4, true>(n, p, rot, l, q, k, v, mask, partial, new_part, y, a, kj, vj, stream);
}

}  // namespace turboquant::cuda::detail

#ifdef TQ_PHASES
namespace turboquant::cuda {
TQ_PHASE_READER(finish_phase_times)
}  // namespace turboquant::cuda
#endif
