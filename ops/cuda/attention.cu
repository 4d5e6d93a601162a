// TQAttention on the GPU (docs/design.md section 3).
//
// 1. present = past ++ pack(new - offset): a copy kernel (when present is not past's buffer) and
//    the finish kernel's packing blocks (same codec as the CPU).
// 2. split_kernel: grid (B*Hkv, splits, row blocks). A block takes up to 8 query rows (the
//    query heads of one GQA group at one or more positions) against one KV head and one slice of
//    the packed past, so each packed byte is read once per KV head. Per tile of kTile tokens, each
//    thread scores one token for all rows: MSE keys against the rotated query (q . H, scaled) and
//    the codebook centroids, without dequantizing; fp8/raw16 keys against q. A block-wide online
//    softmax follows, then every thread owns head-size columns and adds the tile's values,
//    dequantized in registers. It writes (max, sum, acc[Dv]) per row and split.
// 3. For a continuation chunk (several query rows over a past), prefill.cu attends the new tokens on
//    tensor cores and writes their part as one more partial result per row.
// 4. finish_kernel: one block per query row merges the splits with log-sum-exp, adds the new tokens
//    exactly (float K/V, key offset removed; or their part from step 3), restores the value offset
//    and writes Y; in the same launch, other blocks pack the new tokens into the present caches
//    (pack_warp_per_vector.cuh).
// On sm_90 the tensor-core split kernel and the finish kernel are programmatic dependent launches
// (split_common.cuh): each may start while the launch before it runs, and waits for it before
// reading what it wrote.
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <type_traits>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include "pack_warp_per_vector.cuh"
#include "prefill.cuh"
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/float_io.h"
#include "turboquant/rotary.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda {
using namespace detail;
namespace {

constexpr int kThreads = 128;
constexpr int kMaxCols = kMaxHeadDim / kThreads;  // value columns per thread in the merge kernel

__device__ float mask_value(const AttentionParams& p, const void* mask, int64_t b, int64_t hq, int64_t pos, int64_t j,
                            bool* allowed) {
  *allowed = true;
  if (p.is_causal && j > pos + (p.past_of(b) + p.new_len - p.q_len)) {
    *allowed = false;
    return 0.0f;
  }
  if (p.mask_type == MaskType::kNone) return 0.0f;
  const int64_t i = b * p.mask_stride[0] + hq * p.mask_stride[1] + pos * p.mask_stride[2] + j * p.mask_stride[3];
  switch (p.mask_type) {
    case MaskType::kBool:
      *allowed = static_cast<const uint8_t*>(mask)[i] != 0;
      return 0.0f;
    case MaskType::kFloat32: return static_cast<const float*>(mask)[i];
    case MaskType::kFloat16: return f16_to_f32(static_cast<const uint16_t*>(mask)[i]);
    case MaskType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(mask)[i]);
    default: return 0.0f;
  }
}

__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// bytes [0, n) of src into dst (shared), 4 bytes at a time when src is 4-byte aligned.
__device__ void copy_to_shared(uint8_t* dst, const uint8_t* src, int64_t n) {
  if ((reinterpret_cast<uintptr_t>(src) & 3) == 0) {
    const int64_t words = n / 4;
    const uint32_t* s4 = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) d4[i] = __ldg(s4 + i);
    for (int64_t i = words * 4 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

// Four float8 e4m3fn codes (little-endian in w) as floats.
__device__ inline void fp8x4_to_f32(uint32_t w, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
#else
  for (int k = 0; k < 4; ++k) out[k] = fp8_to_f32(static_cast<uint8_t>(w >> (8 * k)));
#endif
}

// Starts copying bytes [0, n) of src into dst (shared) without waiting: 16- or 4-byte cp.async
// where both are aligned (the caller commits and waits), plain loads otherwise.
__device__ void copy_to_shared_async(uint8_t* dst, const uint8_t* src, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  const int width = (a & 15) == 0 ? 16 : (a & 3) == 0 ? 4 : 0;
  if (width == 0) {
    copy_to_shared(dst, src, n);
    return;
  }
  const int64_t chunks = n / width;
  for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) __pipeline_memcpy_async(dst + i * width, src + i * width, width);
  for (int64_t i = chunks * width + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

// fp16 values by the hardware's conversion (exact, as codec::load_f16's bit manipulation is, but one
// instruction): one at p (2-byte aligned, as every fp16 field of a packed vector is), and the
// scale/zero pair of a uint vector with a single 4-byte load where it is aligned (it is in the
// presets' layouts: 68- and 52-byte vectors, payloads of 64 and 48 bytes).
__device__ inline float load_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}
__device__ inline float2 load_half2(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    return make_float2(__half2float(__ushort_as_half(static_cast<uint16_t>(w & 0xffffu))),
                       __half2float(__ushort_as_half(static_cast<uint16_t>(w >> 16))));
  }
  return make_float2(load_half(p), load_half(p + 2));
}

// Columns 8*cg .. 8*cg+7 of a packed value vector, as floats. nb: its payload bytes.
__device__ void decode8(Format fmt, int d, const uint8_t* v, int cg, int nb, float* x) {
  switch (fmt) {
    case Format::kUint4:
    case Format::kUint3: {
      const float2 sz = load_half2(v + nb);
      const float scale = sz.x, zero = sz.y;
      uint32_t w;
      const int bits = fmt == Format::kUint4 ? 4 : 3;
      const uint8_t* g = v + cg * bits;  // 8 codes take `bits` bytes
      if (bits == 4 && (reinterpret_cast<uintptr_t>(g) & 3) == 0) {
        w = *reinterpret_cast<const uint32_t*>(g);
      } else {
        w = bits == 4 ? (g[0] | (g[1] << 8) | (g[2] << 16) | (static_cast<uint32_t>(g[3]) << 24)) : (g[0] | (g[1] << 8) | (g[2] << 16));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = static_cast<float>((w >> (bits * j)) & ((1u << bits) - 1)) * scale + zero;
      break;
    }
    case Format::kFp8:
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = fp8_to_f32(v[cg * 8 + j]);
      break;
    case Format::kRaw16:
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = load_half(v + 2 * (cg * 8 + j));
      break;
    default: {  // mse values: decode the whole vector (slow; no preset stores values so)
      float tmp[kMaxHeadDim];
      codec::decode_vector(fmt, d, v, tmp);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = tmp[cg * 8 + j];
    }
  }
}

// Blocks per SM the register allocation must leave room for. The kernel is latency-bound: left to
// itself ptxas gives the 4-row variant 124-135 registers (4 blocks, 25% occupancy); capped for 5
// blocks (96 registers, no spills) it ran 10-16% faster on the H200 (scripts/cuda_attention_probe.cu,
// B=8 S=32768: mse4/uint4 902 -> 811 us, fp8/uint4 1335 -> 1176, mse3/uint3 837 -> 733; B=1 and
// B=32 alike), 6 blocks was no better and 8 spilled and ran slower. The 8-row variant would spill
// under that cap, so it keeps the 3 blocks it had.
constexpr int split_min_blocks(int rows) { return rows <= 4 ? 5 : 3; }

template <int kRows>
__global__ void __launch_bounds__(kThreads, split_min_blocks(kRows)) split_kernel(AttentionParams p, Layout l, const void* q, const void* mask,
                                                         const uint8_t* past_key, const uint8_t* past_value,
                                                         float* partial) {
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * l.rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(kRows), l.rows - row0));
  const int d = p.head_dim, dv = p.v_head_dim, tid = threadIdx.x;
  const bool mse = is_mse(p.key_format);
  const int dp = mse ? padded_dim(d) : d;
  const int kb = static_cast<int>(p.key_row()), vb = static_cast<int>(p.value_row());  // bytes per cache row

  __shared__ __align__(16) float qs[kMaxHeadDim][kRows];  // rotated and scaled query (MSE) or scaled query; qs[i][r]
  __shared__ float scores[kRows][kTile];
  __shared__ float row_max[kRows], row_sum[kRows], row_rescale[kRows];
  __shared__ float centroid[16];
  __shared__ int64_t row_pos[kRows], row_hq[kRows];

  if (tid < 16) centroid[tid] = mse ? static_cast<float>(codec::centroids(format_bits(p.key_format))[tid & ((1 << format_bits(p.key_format)) - 1)]) : 0.0f;
  for (int r = 0; r < kRows; ++r) {
    for (int i = tid; i < kMaxHeadDim; i += kThreads) qs[i][r] = 0.0f;
  }
  if (tid < kRows) {
    const int64_t row = row0 + tid;
    row_pos[tid] = row / l.group;
    row_hq[tid] = hkv * l.group + row % l.group;
    row_max[tid] = -INFINITY;
    row_sum[tid] = 0.0f;
  }
  __syncthreads();
  const float fold = mse ? p.scale / static_cast<float>(dp) : p.scale;
  for (int r = 0; r < rows; ++r) {
    const int64_t base = b * p.q.b + row_hq[r] * p.q.h + row_pos[r] * p.q.s;
    for (int i = tid; i < d; i += kThreads) qs[i][r] = load_float(p.dtype, q, base + i) * fold;
  }
  __syncthreads();
  if (mse) {  // q . H for every row, one butterfly per thread and stage
    for (int h = 1; h < dp; h <<= 1) {
      for (int k = tid; k < rows * (dp / 2); k += kThreads) {
        const int r = k / (dp / 2), j = k % (dp / 2);
        const int i = (j / h) * 2 * h + (j % h);
        const float a = qs[i][r], c = qs[i + h][r];
        qs[i][r] = a + c;
        qs[i + h][r] = a - c;
      }
      __syncthreads();
    }
  }

  const int64_t begin = static_cast<int64_t>(split) * l.split_len;
  const int64_t end = min(p.past_of(b), begin + l.split_len);  // empty for splits past this sequence's end
  const uint8_t* keys = past_key + bh * p.past_rows_or_len() * kb;
  const uint8_t* vals = past_value + bh * p.past_rows_or_len() * vb;
  const int bits = format_bits(p.key_format);
  // value accumulators: 8 columns of every row per thread; threads split the tile's tokens
  const int col_groups = dv / 8, token_groups = kThreads / col_groups;
  const int cg = tid % col_groups, tg = tid / col_groups;
  const bool active = tg < token_groups;
  const int vnb = payload_bytes(p.value_format, dv);
  float acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[r][j] = 0.0f;
  const int warp = tid / 32, lane = tid % 32;

  // The tile's packed keys and values are contiguous in memory: stage them through shared memory
  // with coalesced 4-byte loads, then each thread reads its own token's row there.
  extern __shared__ uint32_t stage_words[];
  uint8_t* stage = reinterpret_cast<uint8_t*>(stage_words);
  const bool staged = l.stage_bytes > 0;

  // fetch(t, buf): start copying the tile at token t into stage buffer buf
  auto fetch = [&](int64_t t, int buf) {
    const int64_t m = min(static_cast<int64_t>(kTile), end - t);
    uint8_t* dst = stage + static_cast<int64_t>(buf) * l.stage_bytes;
    copy_to_shared_async(dst, keys + t * kb, m * kb);
    copy_to_shared_async(dst + kTile * kb, vals + t * vb, m * vb);
    __pipeline_commit();
  };
  if (staged && begin < end) fetch(begin, 0);
  int it = 0;
  for (int64_t t0 = begin; t0 < end; t0 += kTile, ++it) {
    const int64_t n = min(static_cast<int64_t>(kTile), end - t0);
    const uint8_t* ktile = keys + t0 * kb;
    const uint8_t* vtile = vals + t0 * vb;
    if (staged) {
      const bool ahead = l.buffers == 2 && t0 + kTile < end;
      if (ahead) {  // the other buffer was last read by the previous tile, which every thread has finished
        fetch(t0 + kTile, (it + 1) & 1);
        __pipeline_wait_prior(1);
      } else {
        __pipeline_wait_prior(0);
      }
      __syncthreads();
      ktile = stage + static_cast<int64_t>(l.buffers == 2 ? (it & 1) : 0) * l.stage_bytes;
      vtile = ktile + kTile * kb;
    }
    // scores, one token per thread
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.0f;
    if (tid < n) {
      const uint8_t* kr = ktile + static_cast<int64_t>(tid) * kb;
      if (mse) {
        const float ks = load_half(kr + dp * bits / 8);
        if (bits == 4) {
          for (int i = 0; i < dp / 2; ++i) {
            const uint8_t byte = kr[i];
            const float c0 = centroid[byte & 15], c1 = centroid[byte >> 4];
#pragma unroll
            for (int r = 0; r < kRows; ++r) s[r] += qs[2 * i][r] * c0 + qs[2 * i + 1][r] * c1;
          }
        } else {
          for (int i = 0; i < dp; i += 8) {
            const uint8_t* g = kr + i / 8 * 3;
            const uint32_t w = g[0] | (g[1] << 8) | (g[2] << 16);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
              const float c = centroid[(w >> (3 * k)) & 7];
#pragma unroll
              for (int r = 0; r < kRows; ++r) s[r] += qs[i + k][r] * c;
            }
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) s[r] *= ks;
      } else if (p.key_format == Format::kFp8 && (reinterpret_cast<uintptr_t>(kr) & 3) == 0) {
        // four e4m3 codes per aligned word, converted by the hardware (exact: every e4m3 value is
        // an fp16 value) on sm_89 and newer
        for (int i = 0; i < d; i += 4) {
          const uint32_t w = *reinterpret_cast<const uint32_t*>(kr + i);
          float kv[4];
          fp8x4_to_f32(w, kv);
#pragma unroll
          for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int r = 0; r < kRows; ++r) s[r] += qs[i + k][r] * kv[k];
        }
      } else {
        for (int i = 0; i < d; ++i) {
          const float kv = p.key_format == Format::kFp8 ? fp8_to_f32(kr[i]) : load_half(kr + 2 * i);
#pragma unroll
          for (int r = 0; r < kRows; ++r) s[r] += qs[i][r] * kv;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < rows) {
        bool ok = tid < n;
        float add = 0.0f;
        if (ok) add = mask_value(p, mask, b, row_hq[r], row_pos[r], t0 + tid, &ok);
        scores[r][tid] = ok ? s[r] + add : -INFINITY;
      }
    }
    __syncthreads();
    // online softmax per row: warp w handles rows w, w+4
    for (int r = warp; r < rows; r += kThreads / 32) {
      float m = -INFINITY;
      for (int u = lane; u < kTile; u += 32) m = fmaxf(m, scores[r][u]);
      m = warp_max(m);
      const float m_new = fmaxf(row_max[r], m);
      float sum = 0.0f;
      for (int u = lane; u < kTile; u += 32) {
        const float e = m_new == -INFINITY ? 0.0f : __expf(scores[r][u] - m_new);
        scores[r][u] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float rescale = row_max[r] == -INFINITY ? 0.0f : __expf(row_max[r] - m_new);
        row_rescale[r] = rescale;
        row_sum[r] = row_sum[r] * rescale + sum;
        row_max[r] = m_new;
      }
    }
    __syncthreads();
    // values: thread (tg, cg) adds tokens tg, tg + token_groups, ... into columns cg*8 .. cg*8+7
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float rs = r < rows ? row_rescale[r] : 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r][j] *= rs;
    }
    if (active) {
      for (int u = tg; u < n; u += token_groups) {
        const uint8_t* vr = vtile + static_cast<int64_t>(u) * vb;
        float x[8];
        decode8(p.value_format, dv, vr, cg, vnb, x);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          if (r < rows) {
            const float w = scores[r][u];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][j] += w * x[j];
          }
        }
      }
    }
    __syncthreads();
    if (staged && l.buffers == 1 && t0 + kTile < end) fetch(t0 + kTile, 0);
  }
  // Sum the token groups' accumulators into qs (free now), deterministically and without atomics
  // (shared-memory float atomics were half of this kernel's time): when the column groups are a
  // power of two, the lanes of a warp that share columns sum by shuffles and the warps add in turn;
  // otherwise the token groups add in turn.
  float* red = &qs[0][0];  // red[col * kRows + r]
  for (int i = tid; i < kRows * kMaxHeadDim; i += kThreads) red[i] = 0.0f;
  __syncthreads();
  const bool pow2 = (col_groups & (col_groups - 1)) == 0 && col_groups <= 32;
  if (pow2) {
    for (int off = col_groups; off < 32; off <<= 1) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r][j] += __shfl_xor_sync(0xffffffffu, acc[r][j], off);
    }
  }
  const int turns = pow2 ? kThreads / 32 : token_groups;
  const int my_turn = pow2 ? (lane < col_groups ? warp : -1) : (active ? tg : -1);
  for (int t = 0; t < turns; ++t) {
    if (my_turn == t) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < rows)
#pragma unroll
          for (int j = 0; j < 8; ++j) qs[cg * 8 + j][r] += acc[r][j];
    }
    __syncthreads();
  }
  // write partials
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) continue;
    float* out = partial + ((bh * l.rows + row0 + r) * l.splits + split) * partial_stride(dv);
    if (tid == 0) {
      out[0] = row_max[r];
      out[1] = row_sum[r];
    }
    for (int col = tid; col < dv; col += kThreads) out[2 + col] = qs[col][r];
  }
}

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
    rotate_shared(rot, p.dtype, d, rotary_position(rot, b, pos, p.q_len, past), qrow, tid, kThreads);
    rotate_shared(rot, p.dtype, d, rotary_position(rot, b, 0, p.new_len, past), krow, tid, kThreads);
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
  if (new_len > 0) load_new(0);

  // 1. the new tokens, exactly: an online softmax of their scores
  float m = -INFINITY, sum = 0.0f, acc[kMaxCols];
  for (int c = 0; c < kMaxCols; ++c) acc[c] = 0.0f;
  __syncthreads();  // qrow
  float key_shift = 0.0f;  // new_part's scores are of the keys as given; the past's and these of keys - offset
  if (new_part && koff) {
    float part = 0.0f;
    for (int i = tid; i < d; i += kThreads) part += qrow[i] * koff[i];
    key_shift = block_sum(part, red) * p.scale;
  }
  for (int64_t n = 0; n < new_len; ++n) {
    float part = 0.0f, vc[kMaxCols];
#pragma unroll
    for (int c = 0; c < kMaxCols; ++c) {
      const int i = tid + c * kThreads;
      if (i < d) part += qrow[i] * kn[c];
      vc[c] = vn[c];
    }
    if (n + 1 < new_len) load_new(n + 1);
    const float dot = block_sum(part, red) * p.scale;
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
  // so each split adds sum x offset
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
  if (past > 0) {
    const float* part = partial + (bh * l.rows + row) * l.splits * partial_stride(dv);
    const float* voff = p.value_offset ? p.value_offset + hkv * dv : nullptr;
    float off[kMaxCols];
    for (int c = 0; c < kMaxCols; ++c) {
      const int col = tid + c * kThreads;
      off[c] = voff && col < dv ? voff[col] : 0.0f;
    }
    // kChunk splits at a time: all their loads in flight at once, then their largest maximum and
    // weighted sums (an online merge of one split after the other waited for each split's loads:
    // its last merge ended 1.3-3.4 us later in a B = 1 step alone); 2 at a time for up to 2 splits,
    // where 8 cost more (predicated slots) than they save
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
        if (mx == -INFINITY) continue;  // every part so far is empty
        const float rescale = m == -INFINITY ? 0.0f : __expf(m - mx);
        sum *= rescale;
#pragma unroll
        for (int c = 0; c < kMaxCols; ++c) acc[c] *= rescale;
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const float w = ms[u] == -INFINITY ? 0.0f : __expf(ms[u] - mx);
          sum += ss[u] * w;
#pragma unroll
          for (int c = 0; c < kMaxCols; ++c) acc[c] += (as[u][c] + off[c] * ss[u]) * w;
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
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int64_t ybase = b * p.y.b + hq * p.y.h + pos * p.y.s;
  for (int c = 0; c < kMaxCols; ++c) {
    const int col = tid + c * kThreads;
    if (col < dv) store_float(p.dtype, y, ybase + col, acc[c] * inv);
  }
  TQ_PHASE(gr == 0, 11);
}

static_assert(kThreads == kPackThreads, "the finish kernel's merge and packing blocks share a size");

// The last launch of a step: blocks [0, kj.blocks) pack the new keys, the next vj.blocks the new
// values, the rest merge one query row each. FK, FV: the caches' formats, or any pair (chosen at
// run time) when kAny. Launched as a programmatic dependent launch: after_split (this step's split
// kernel was the launch before, and it waited for the ones before it) lets the packing blocks run
// while the split kernel does (they read the inputs and write rows it does not read) and the
// merges load their inputs before waiting for its partial results.
template <Format FK, Format FV, bool kAny>
__global__ void __launch_bounds__(kThreads)
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

template <int kRows>
cudaError_t launch_split(dim3 grid, int smem, cudaStream_t stream, const AttentionParams& p, const Layout& l,
                         const void* q, const void* mask, const uint8_t* past_key, const uint8_t* past_value,
                         float* part) {
  // Two staged tiles can exceed the 48 KiB default of shared memory: opted in per device
  static SharedMemoryOptIn opt_in;
  const cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(split_kernel<kRows>), smem);
  if (e != cudaSuccess) return e;
  split_kernel<kRows><<<grid, kThreads, smem, stream>>>(p, l, q, mask, past_key, past_value, part);
  return cudaGetLastError();
}

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

PackJob new_token_job(const AttentionParams& p, Format fmt, int d, int64_t row_bytes, const BhsStrides& st,
                      const void* x, const float* offset, uint8_t* present) {
  NewTokenRows rows;
  rows.present_rows = p.present_rows_or_total();
  rows.row_bytes = row_bytes;
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

// The merge of the query rows and the packing of the new tokens, in one launch: a kernel
// specialised for the presets' format pairs, a general one for the others.
cudaError_t finish(const AttentionParams& p, const RotaryParams& rot, const Layout& l, const void* q, const void* k,
                   const void* v, const void* mask, const float* partial, const float* new_part, void* y,
                   uint8_t* present_key, uint8_t* present_value, bool after_split, cudaStream_t stream) {
  PackJob kj = new_token_job(p, p.key_format, p.head_dim, p.key_row(), p.k, k, p.key_offset, present_key);
  kj.rot = rot;  // the new keys rotated as they are packed (fused), or no rotary
  const PackJob vj = new_token_job(p, p.value_format, p.v_head_dim, p.value_row(), p.v, v, p.value_offset, present_value);
  const int64_t merges = p.q_len > 0 ? p.batch * p.kv_heads * l.rows : 0;
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

}  // namespace

namespace {
bool aligned16(const uint8_t* past_key, const uint8_t* past_value) {
  return ((reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value)) & 15) == 0;
}

std::atomic<int> last_kernel{static_cast<int>(SplitKernel::kNone)};
}  // namespace

// Enough for either alignment of the caches: the kernel, and with it the splits, can depend on it,
// and callers (TensorRT's getWorkspaceSize) size the workspace before they know the addresses.
size_t attention_workspace_bytes(const AttentionParams& p, int num_sms) {
  const DeviceProps dev = current_device_props(num_sms);
  return std::max(plan_split(p, true, dev).workspace, plan_split(p, false, dev).workspace);
}

SplitPlan attention_plan(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value, int num_sms) {
  return plan_split(p, aligned16(past_key, past_value), current_device_props(num_sms));
}

SplitKernel last_split_kernel() { return static_cast<SplitKernel>(last_kernel.load()); }

bool fuses_rotary(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value) {
  return p.q_len == 1 && p.new_len == 1 &&
         (p.past_len == 0 || attention_plan(p, past_key, past_value).kernel == SplitKernel::kTensorCoreBulk);
}

cudaError_t attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                      const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                      uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream,
                      const RotaryParams* rotary) {
  if (!caches_aligned(past_key, past_value, present_key, present_value)) return cudaErrorMisalignedAddress;
  const RotaryParams rot = rotary ? *rotary : RotaryParams{};
  // the one plan of this call: its kernel, splits (of the query rows: none when q_len is 0) and
  // shared memory; the workspace was sized by the same planner
  const SplitPlan plan = attention_plan(p, past_key, past_value, num_sms);
  const bool fused = p.q_len == 1 && p.new_len == 1 && (p.past_len == 0 || plan.kernel == SplitKernel::kTensorCoreBulk);
  if (rot.rotary_dim > 0 && !fused) return cudaErrorInvalidValue;
  cudaError_t e = copy_past(p, past_key, present_key, past_value, present_value, num_sms, stream);
  if (e != cudaSuccess) return e;
  if (p.batch == 0) return cudaSuccess;
  const Layout& l = plan.layout;
  const bool split = plan.kernel != SplitKernel::kNone;
  last_kernel.store(static_cast<int>(plan.kernel));
  if (split) {
    float* part = static_cast<float*>(workspace);
    switch (plan.kernel) {
      case SplitKernel::kTensorCoreBulk: e = launch_tc_split(p, rot, plan, q, past_key, past_value, part, stream); break;
      case SplitKernel::kTensorCoreMma: e = launch_mma_split(p, plan, q, past_key, past_value, part, stream); break;
      case SplitKernel::kTensorCoreChunk: e = launch_chunk_split(p, plan, q, past_key, past_value, part, stream); break;
      default: {
        const dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads), l.splits, l.row_blocks);
        switch (l.rows_per_block) {
          case 1: e = launch_split<1>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, part); break;
          case 2: e = launch_split<2>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, part); break;
          case 4: e = launch_split<4>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, part); break;
          default: e = launch_split<8>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, part); break;
        }
      }
    }
    if (e != cudaSuccess) return e;
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    if (plan.new_part && prefill_supported(p, q, k, v, mask, y)) {  // a continuation chunk's new tokens on tensor cores
      float* new_part = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + plan.new_part_offset);
      if ((e = launch_prefill(p, q, k, v, mask, y, new_part, stream)) != cudaSuccess) return e;
      return finish(p, rot, l, q, k, v, mask, part, new_part, y, present_key, present_value, false, stream);
    }
  } else if (p.past_len == 0 && prefill_supported(p, q, k, v, mask, y)) {  // a first prompt: its rows on tensor cores
    if ((e = launch_prefill(p, q, k, v, mask, y, nullptr, stream)) != cudaSuccess) return e;
    Layout packs_only = l;
    packs_only.rows = 0;  // the finish kernel then only packs the new tokens
    return finish(p, rot, packs_only, q, k, v, mask, nullptr, nullptr, y, present_key, present_value, false, stream);
  }
  return finish(p, rot, l, q, k, v, mask, static_cast<const float*>(workspace), nullptr, y, present_key, present_value,
                split, stream);
}

#ifdef TQ_PHASES
TQ_PHASE_READER(finish_phase_times)
#endif

}  // namespace turboquant::cuda
