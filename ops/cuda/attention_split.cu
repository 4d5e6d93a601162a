// The CUDA-core split kernel of TQAttention (plan.kernel kCudaCore: every call, masks, float32, any
// format pair): grid (B*Hkv, splits, row blocks). A block takes up to 8 query rows (the query heads of
// one GQA group at one or more positions) against one KV head and one slice of the packed past, so
// each packed byte is read once per KV head. Per tile of kTile tokens, each thread scores one token
// for all rows: MSE keys against the rotated query (q . H, scaled) and the codebook centroids,
// without dequantizing; fp8/raw16 keys against q. A block-wide online softmax follows, then every
// thread owns head-size columns and adds the tile's values, dequantized in registers. It writes
// (max, sum, acc[Dv]) per row and split.
#include <cfloat>
#include <cmath>

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include "cuda_core.cuh"
#include "split_common.cuh"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {
namespace {

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

// Blocks per SM the register allocation must leave room for: the kernel is latency-bound, and 5
// blocks of the 4-row variant (96 registers, no spills) beat ptxas's own choice of 4 (docs/
// performance.md, kept choices); the 8-row variant would spill under that cap, so it keeps 3.
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
  __shared__ float row_shift[kRows];  // softcap with a key offset: scale * q . key_offset (softcapped())
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
    row_shift[tid] = 0.0f;
  }
  __syncthreads();
  const float fold = mse ? p.scale / static_cast<float>(dp) : p.scale;
  for (int r = 0; r < rows; ++r) {
    const int64_t base = b * p.q.b + row_hq[r] * p.q.h + row_pos[r] * p.q.s;
    for (int i = tid; i < d; i += kThreads) qs[i][r] = load_float(p.dtype, q, base + i) * fold;
  }
  __syncthreads();
  const bool capped = p.softcap > 0.0f;
  if (capped && p.key_offset) {  // before the rotation below rewrites qs
    const float* koff = p.key_offset + hkv * d;
    for (int r = tid / 32; r < rows; r += kThreads / 32) {
      float part = 0.0f;
      for (int i = tid % 32; i < d; i += 32) part += qs[i][r] * koff[i];
      part = warp_sum(part);
      if (tid % 32 == 0) row_shift[r] = part * (mse ? static_cast<float>(dp) : 1.0f);  // qs holds q * fold
    }
    __syncthreads();
  }
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

  // the splits cover the keys from the sliding window's first (plan_split splits only those)
  const int64_t past = p.past_of(b);
  const int64_t begin = window_first_key(p, past) + static_cast<int64_t>(split) * l.split_len;
  const int64_t end = min(past, begin + l.split_len);  // empty for splits past this sequence's end
  // tiles of kTile tokens, cut at the end of a block in a pool of blocks (paged: rows run back to back
  // only inside one), their rows where row_offset puts them
  const int64_t cache_rows = p.past_rows_or_len();
  auto key_rows_at = [&](int64_t t) { return past_key + p.row_offset(b, hkv, t, cache_rows, kb); };
  auto value_rows_at = [&](int64_t t) { return past_value + p.row_offset(b, hkv, t, cache_rows, vb); };
  auto tile_len = [&](int64_t t) { return min(min(static_cast<int64_t>(kTile), end - t), p.run_length(t)); };
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

  // The tile's packed keys and values are each contiguous in memory: stage them through shared memory
  // with coalesced 4-byte loads, then each thread reads its own token's row there.
  extern __shared__ uint32_t stage_words[];
  uint8_t* stage = reinterpret_cast<uint8_t*>(stage_words);
  const bool staged = l.stage_bytes > 0;

  // fetch(t, buf): start copying the tile at token t into stage buffer buf
  auto fetch = [&](int64_t t, int buf) {
    const int64_t m = tile_len(t);
    uint8_t* dst = stage + static_cast<int64_t>(buf) * l.stage_bytes;
    copy_to_shared_async(dst, key_rows_at(t), m * kb);
    copy_to_shared_async(dst + kTile * kb, value_rows_at(t), m * vb);
    __pipeline_commit();
  };
  if (staged && begin < end) fetch(begin, 0);
  int it = 0;
  for (int64_t t0 = begin, n = 0; t0 < end; t0 += n, ++it) {
    n = tile_len(t0);
    const uint8_t* ktile = key_rows_at(t0);
    const uint8_t* vtile = value_rows_at(t0);
    if (staged) {
      const bool ahead = l.buffers == 2 && t0 + n < end;
      if (ahead) {  // the other buffer was last read by the previous tile, which every thread has finished
        fetch(t0 + n, (it + 1) & 1);
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
    if (capped) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) s[r] = softcapped(s[r], p.softcap, row_shift[r]);
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
        const float e = scores[r][u] == -INFINITY ? 0.0f : __expf(scores[r][u] - m_new);  // a NaN score stays NaN
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
    if (staged && l.buffers == 1 && t0 + n < end) fetch(t0 + n, 0);
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

}  // namespace

cudaError_t launch_cuda_core_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const void* mask,
                                   const uint8_t* past_key, const uint8_t* past_value, float* partial,
                                   cudaStream_t stream) {
  const Layout& l = plan.layout;
  const dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads), l.splits, l.row_blocks);
  switch (l.rows_per_block) {
    case 1: return launch_split<1>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, partial);
    case 2: return launch_split<2>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, partial);
    case 4: return launch_split<4>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, partial);
    default: return launch_split<8>(grid, plan.smem, stream, p, l, q, mask, past_key, past_value, partial);
  }
}

}  // namespace turboquant::cuda::detail
