// The first split-KV attention kernel on tensor cores, for MSE keys and uint values: the same blocks
// and partial results as split_kernel (attention_split.cu), fewer instructions per token. The presets'
// usual shapes go to attention_tc.cu; this one keeps what that one does not take (head sizes 80
// and 96, where the padded key length differs from the value head size; MSE 4-bit keys with uint3
// values).
//
// A block takes one KV head, one slice of the past and up to 8 query rows (the GQA group); each of
// its 4 warps walks its own 16-token tiles with its own online softmax, and the warps' states are
// merged at the end. Per tile (m16n8k16 products, fp32 accumulators; rows 8-15 of every A operand
// are zero):
// 1. scores S^T = Q K^T: A = the rows' rotated queries, B = the keys' centroids, looked up per packed
//    byte (two 4-bit codes) or 6 bits (two 3-bit codes) in a table of half2 - keys are never
//    dequantized to a tile. fp16 alone would cost about 1e-3 of relative score accuracy, so the
//    query (scaled to |q| <= 1 per row) and the centroids are each split into fp16 high and low
//    parts and three products (hi*hi + lo*hi + hi*lo) leave an error near 2^-22;
// 2. the online softmax on the accumulators in registers (a row's 16 scores live in the 4 lanes of
//    a quad);
// 3. O += P V: the score accumulators are, as they stand, the A operand (FlashAttention-2's layout
//    trick), with each token's value scale folded in (p * scale); B = the tile's value codes as
//    exact fp16 integers, dequantized into shared memory and read with ldmatrix.trans; the zero
//    points add sum_t p_t * zero_t to every column.
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cfloat>
#include <cmath>

#include "mask.cuh"
#include "ptx.cuh"
#include "split_common.cuh"
#include "split_geometry.h"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {
namespace {

constexpr int kWarps = mma_geometry::kWarps;
constexpr int kThreads = kWarps * 32;
constexpr int kTok = mma_geometry::kTok;          // tokens per warp tile
constexpr int kMaxRows = mma_geometry::kMaxRows;  // query rows per block (the A operand's real rows)
using mma_geometry::merge_bytes;
using mma_geometry::packed_tile_bytes;
using mma_geometry::warp_stage_bytes;
constexpr int kMaxSteps = kMaxHeadDim / 16;    // k-steps of the score product (Dp <= 256)

__device__ inline void mma16816(float* c, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  mma16816_f16(c, a0, 0u, a2, 0u, b0, b1);  // rows 8-15 of A (registers a1, a3) are zero
}

__device__ inline void ldmatrix_x4_trans(uint32_t* r, const void* row_address) {
  detail::ldmatrix_x4_trans(r, smem_u32(row_address));
}

__device__ inline float load_half(const uint8_t* p) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const uint16_t*>(p)));
}

struct Smem {
  // per k-step and lane: the A fragments (row g, columns 2t..2t+1 and 2t+8..2t+9) of the
  // normalised rotated queries, high and low parts
  uint2 qa_hi[kMaxSteps][32], qa_lo[kMaxSteps][32];
  uint32_t lut_hi[256], lut_lo[256];  // half2 (centroid of the low code, of the high code)
  float row_factor[kMaxRows];         // softmax scale / Dp * the row's query normaliser
  int64_t row_pos[kMaxRows], row_hq[kMaxRows];
};

static_assert(sizeof(Smem) == mma_geometry::kStaticBytes, "the planner's count of the static shared memory");

// kDt: the 8-column tiles of the value accumulators the instantiation holds (dv <= 8 * kDt)
template <int kBits, int vBits, int kDt>
__global__ void __launch_bounds__(kThreads, kDt <= 16 ? 4 : 2) mma_split_kernel(AttentionParams p, Layout l, const void* q,
                                                             const uint8_t* past_key, const uint8_t* past_value,
                                                             float* partial) {
  __shared__ Smem sm;
  extern __shared__ __align__(16) uint8_t dyn[];
  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * l.rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(l.rows_per_block), l.rows - row0));
  const int dv = p.v_head_dim, dp = padded_dim(p.head_dim), steps = dp / 16;
  const int kb = static_cast<int>(p.key_row()), vb = static_cast<int>(p.value_row());
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // --- the block's query rows, rotated (q . H), normalised, split into fp16 hi + lo fragments ---
  float* qrot = reinterpret_cast<float*>(dyn);  // [kMaxRows][dp], before the stages use the space
  if (tid < kMaxRows) {
    const int64_t row = row0 + tid;
    sm.row_pos[tid] = row / l.group;
    sm.row_hq[tid] = hkv * l.group + row % l.group;
  }
  {
    const double* c = codec::centroids(kBits);
    for (int i = tid; i < 256; i += kThreads) {
      int c0, c1;
      if (kBits == 4) {
        c0 = i & 15, c1 = i >> 4;
      } else {
        c0 = i & 7, c1 = (i >> 3) & 7;
      }
      const float f0 = static_cast<float>(c[c0]), f1 = static_cast<float>(c[c1]);
      const __half h0 = __float2half_rn(f0), h1 = __float2half_rn(f1);
      sm.lut_hi[i] = pack_half2(__half2float(h0), __half2float(h1));
      sm.lut_lo[i] = pack_half2(f0 - __half2float(h0), f1 - __half2float(h1));
    }
  }
  __syncthreads();
  load_query_rows(p, q, b, sm.row_hq, sm.row_pos, rows, kMaxRows, dp, true, qrot);
  if (warp == 0) {  // each row's largest |q . H|, by the lanes of warp 0
    for (int r = 0; r < kMaxRows; ++r) {
      float m = 0.0f;
      for (int i = lane; i < dp; i += 32) m = fmaxf(m, fabsf(qrot[r * dp + i]));
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) sm.row_factor[r] = m;
    }
  }
  __syncthreads();
  for (int k = tid; k < steps * 32; k += kThreads) {  // fragment (step s, lane ln): row ln/4, columns 16s + 2(ln%4) (+8)
    const int s = k / 32, ln = k % 32, r = ln / 4, c0 = 16 * s + 2 * (ln % 4);
    const float m = sm.row_factor[r];
    const float inv = m > 0.0f ? 1.0f / m : 0.0f;
    float x[4] = {qrot[r * dp + c0] * inv, qrot[r * dp + c0 + 1] * inv, qrot[r * dp + c0 + 8] * inv,
                  qrot[r * dp + c0 + 9] * inv};
    float hi[4], lo[4];
    for (int j = 0; j < 4; ++j) {
      hi[j] = __half2float(__float2half_rn(x[j]));
      lo[j] = x[j] - hi[j];
    }
    sm.qa_hi[s][ln] = make_uint2(pack_half2(hi[0], hi[1]), pack_half2(hi[2], hi[3]));
    sm.qa_lo[s][ln] = make_uint2(pack_half2(lo[0], lo[1]), pack_half2(lo[2], lo[3]));
  }
  __syncthreads();
  const float fold = p.scale / static_cast<float>(dp);
  const float my_factor = sm.row_factor[g] * fold;  // lane's row is g (rows >= `rows` have zero queries)
  __syncthreads();  // qrot's space is reused below

  // --- this warp's tiles ---
  const int wbytes = warp_stage_bytes(kb, vb, dv), tile_bytes = packed_tile_bytes(kb, vb);
  uint8_t* stage = dyn + warp * wbytes;  // packed tiles 0 and 1, then the dequantized values
  __half* vdq = reinterpret_cast<__half*>(stage + 2 * tile_bytes);
  const int vstride = dv + 8;  // halves per dequantized row
  const int vnb = payload_bytes(p.value_format, dv);
  const int64_t past = p.past_of(b);  // the splits start at the sliding window's first key (one query position)
  const int64_t begin = window_first_key(p, past) + static_cast<int64_t>(split) * l.split_len;
  const int64_t end = min(past, begin + l.split_len);
  const uint8_t* keys = past_key + bh * p.past_rows_or_len() * kb;
  const uint8_t* vals = past_value + bh * p.past_rows_or_len() * vb;
  const int dtiles = dv / 8;

  float m_run = -INFINITY, l_part = 0.0f, z_part = 0.0f;
  float o[kDt][4];  // row g, stored columns 8n + 2t, 8n + 2t + 1, i.e. columns 8n + t, 8n + t + 4 (rows g + 8: zero)
#pragma unroll
  for (int n = 0; n < kDt; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  auto fetch = [&](int64_t t, int buf) {  // start loading the tile at token t into buffer buf
    const int n = static_cast<int>(min(static_cast<int64_t>(kTok), end - t));
    uint8_t* dst = stage + buf * tile_bytes;
    warp_copy_async(dst, keys + t * kb, n * kb, lane);
    warp_copy_async(dst + kTok * kb, vals + t * vb, n * vb, lane);
    __pipeline_commit();
  };
  const int64_t first = begin + static_cast<int64_t>(warp) * kTok, step = kWarps * kTok;
  if (first < end) fetch(first, 0);
  int it = 0;
  for (int64_t t0 = first; t0 < end; t0 += step, ++it) {
    const int n_tok = static_cast<int>(min(static_cast<int64_t>(kTok), end - t0));
    if (t0 + step < end) {  // the other buffer was last read by the previous tile, finished by every lane
      fetch(t0 + step, (it + 1) & 1);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncwarp();
    const uint8_t* kst = stage + (it & 1) * tile_bytes;
    const uint8_t* vst = kst + kTok * kb;
    // dequantize the value codes of the tile to fp16 integers (padding tokens: zeros)
    if (vBits == 4) {
      // A word holds the 8 codes of columns 8w..8w+7 (nibble i = column 8w + i). They are stored in
      // the order 0,4,1,5,2,6,3,7, which (x >> 4j) & 0x000f000f yields a pair at a time; the
      // accumulators are put back in column order when they are written out.
      const bool words = ((vb | reinterpret_cast<uintptr_t>(vst)) & 3) == 0;
      for (int i = lane; i < kTok * (dv / 8); i += 32) {
        const int u = i / (dv / 8), w = i % (dv / 8);
        uint32_t x = 0;
        if (u < n_tok) {
          const uint8_t* src = vst + u * vb + 4 * w;
          x = words ? *reinterpret_cast<const uint32_t*>(src)
                    : src[0] | (src[1] << 8) | (src[2] << 16) | (static_cast<uint32_t>(src[3]) << 24);
        }
        uint4 out;
        uint32_t* o4 = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // codes j and j+4 -> half2(1024 + c) - 1024
          const uint32_t pair = ((x >> (4 * j)) & 0x000f000fu) | 0x64006400u;
          __half2 h = *reinterpret_cast<const __half2*>(&pair);
          h = __hsub2(h, __floats2half2_rn(1024.0f, 1024.0f));
          o4[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *reinterpret_cast<uint4*>(vdq + u * vstride + 8 * w) = out;
      }
    } else {
      for (int i = lane; i < kTok * (dv / 8); i += 32) {
        const int u = i / (dv / 8), w = i % (dv / 8);
        uint32_t x = 0;
        if (u < n_tok) {
          const uint8_t* src = vst + u * vb + 3 * w;
          x = src[0] | (src[1] << 8) | (src[2] << 16);
        }
        uint4 out;
        uint32_t* o4 = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // codes j and j+4, in the same order as the 4-bit case
          const uint32_t pair = ((x >> (3 * j)) & 0x7u) | (((x >> (3 * j + 12)) & 0x7u) << 16) | 0x64006400u;
          __half2 h = *reinterpret_cast<const __half2*>(&pair);
          h = __hsub2(h, __floats2half2_rn(1024.0f, 1024.0f));
          o4[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
        *reinterpret_cast<uint4*>(vdq + u * vstride + 8 * w) = out;
      }
    }

    // 1. scores of the two 8-token halves: lane (g, t) gets row g, tokens 8j + 2t and 8j + 2t + 1
    float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int s = 0; s < steps; ++s) {
      const uint2 ah = sm.qa_hi[s][lane], al = sm.qa_lo[s][lane];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint8_t* kr = kst + (8 * j + g) * kb;  // the token whose codes this lane supplies (B column g)
        uint32_t c1, c2;
        if (kBits == 4) {
          c1 = kr[8 * s + t];
          c2 = kr[8 * s + 4 + t];
        } else {
          const uint8_t* gb = kr + 6 * s;
          const uint32_t w0 = gb[0] | (gb[1] << 8) | (gb[2] << 16), w1 = gb[3] | (gb[4] << 8) | (gb[5] << 16);
          c1 = (w0 >> (6 * t)) & 63u;
          c2 = (w1 >> (6 * t)) & 63u;
        }
        const uint32_t bh0 = sm.lut_hi[c1], bh1 = sm.lut_hi[c2], bl0 = sm.lut_lo[c1], bl1 = sm.lut_lo[c2];
        mma16816(sc[j], ah.x, ah.y, bh0, bh1);
        mma16816(sc[j], al.x, al.y, bh0, bh1);
        mma16816(sc[j], ah.x, ah.y, bl0, bl1);
      }
    }
    // token scales, validity; 2. online softmax of row g over the 16 tokens (4 lanes x 4 values)
    float s4[4], vsc[4], vzr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int u = 8 * (e / 2) + 2 * t + (e % 2);
      const bool ok = u < n_tok;
      const float ks = ok ? load_half(kst + u * kb + dp * kBits / 8) : 0.0f;
      s4[e] = ok ? sc[e / 2][e % 2] * ks * my_factor : -INFINITY;
      const uint8_t* vr = vst + u * vb + vnb;
      vsc[e] = ok ? load_half(vr) : 0.0f;
      vzr[e] = ok ? load_half(vr + 2) : 0.0f;
    }
    float mt = fmaxf(fmaxf(s4[0], s4[1]), fmaxf(s4[2], s4[3]));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float m_new = fmaxf(m_run, mt);
    const float rescale = m_new == -INFINITY ? 1.0f : (m_run == -INFINITY ? 0.0f : __expf(m_run - m_new));
    float pr[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) pr[e] = s4[e] == -INFINITY ? 0.0f : __expf(s4[e] - m_new);
    l_part = l_part * rescale + (pr[0] + pr[1] + pr[2] + pr[3]);
    z_part = z_part * rescale + (pr[0] * vzr[0] + pr[1] * vzr[1] + pr[2] * vzr[2] + pr[3] * vzr[3]);
    m_run = m_new;
    if (rescale != 1.0f) {
#pragma unroll
      for (int n = 0; n < kDt; ++n) {
        o[n][0] *= rescale;
        o[n][1] *= rescale;
      }
    }
    // 3. O += (P * value scale) V
    const uint32_t pa0 = pack_half2(pr[0] * vsc[0], pr[1] * vsc[1]);  // row g, tokens 2t, 2t+1
    const uint32_t pa2 = pack_half2(pr[2] * vsc[2], pr[3] * vsc[3]);  // row g, tokens 2t+8, 2t+9
    __syncwarp();
    // ldmatrix.x4.trans: matrices (tokens 0-7 | 8-15) x (columns of tiles n, n+1); lane L gives the
    // address of row L%8 of matrix L/8
    const int mat = lane / 8, mrow = lane % 8;
    const __half* base = vdq + ((mat & 1) * 8 + mrow) * vstride + (mat >> 1) * 8;
#pragma unroll
    for (int n = 0; n < kDt; n += 2) {
      if (n < dtiles) {
        uint32_t bfr[4];
        ldmatrix_x4_trans(bfr, base + n * 8);
        mma16816(o[n], pa0, pa2, bfr[0], bfr[1]);
        mma16816(o[n + 1], pa0, pa2, bfr[2], bfr[3]);
      }
    }
    __syncwarp();  // every lane is done with this tile's buffers before they are refilled
  }

  // --- merge: the quad's partial sums, then the warps ---
  l_part += __shfl_xor_sync(0xffffffffu, l_part, 1);
  l_part += __shfl_xor_sync(0xffffffffu, l_part, 2);
  z_part += __shfl_xor_sync(0xffffffffu, z_part, 1);
  z_part += __shfl_xor_sync(0xffffffffu, z_part, 2);
  __syncthreads();  // every warp is done with its stage
  float* ws = reinterpret_cast<float*>(dyn);  // [warp][row][3 + dv]: max, sum, zero sum, acc
  float* mine = ws + (warp * kMaxRows + g) * (3 + dv);
  if (t == 0) {
    mine[0] = m_run;
    mine[1] = l_part;
    mine[2] = z_part;
  }
#pragma unroll
  for (int n = 0; n < kDt; ++n) {
    if (n < dtiles) {  // stored columns 2t and 2t+1 of the tile are columns t and t+4 (the dequant order)
      mine[3 + 8 * n + t] = o[n][0];
      mine[3 + 8 * n + t + 4] = o[n][1];
    }
  }
  __syncthreads();
  store_warp_states(ws, kWarps, kMaxRows, rows, dv, partial + ((bh * l.rows + row0) * l.splits + split) * partial_stride(dv),
                    l.splits * partial_stride(dv));
}

template <int kBits, int vBits, int kDt>
cudaError_t launch(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                   const uint8_t* past_value, float* partial, cudaStream_t stream) {
  const int smem = plan.smem;  // within the default 48 KiB with the static part (plan_split)
  const Layout& l = plan.layout;
  dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads), l.splits, l.row_blocks);
  mma_split_kernel<kBits, vBits, kDt><<<grid, kThreads, smem, stream>>>(p, l, q, past_key, past_value, partial);
  return cudaGetLastError();
}

template <int kBits, int vBits>
cudaError_t launch_dv(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                      const uint8_t* past_value, float* partial, cudaStream_t stream) {
  if (p.v_head_dim <= 64) return launch<kBits, vBits, 8>(p, plan, q, past_key, past_value, partial, stream);
  if (p.v_head_dim <= 128) return launch<kBits, vBits, 16>(p, plan, q, past_key, past_value, partial, stream);
  return launch<kBits, vBits, 32>(p, plan, q, past_key, past_value, partial, stream);
}

}  // namespace

cudaError_t launch_mma_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                             const uint8_t* past_value, float* partial, cudaStream_t stream) {
  const int kbits = format_bits(p.key_format), vbits = format_bits(p.value_format);
  if (kbits == 4) {
    return vbits == 4 ? launch_dv<4, 4>(p, plan, q, past_key, past_value, partial, stream)
                      : launch_dv<4, 3>(p, plan, q, past_key, past_value, partial, stream);
  }
  return vbits == 4 ? launch_dv<3, 4>(p, plan, q, past_key, past_value, partial, stream)
                    : launch_dv<3, 3>(p, plan, q, past_key, past_value, partial, stream);
}

}  // namespace turboquant::cuda::detail
