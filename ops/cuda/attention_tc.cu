// The split-KV decode kernel for the 4-bit value presets on tensor cores: MSE 4-bit or fp8 keys,
// uint4 values, key and value head size 64, 128 or 256. It writes the same partial results as
// split_kernel (attention.cu); the merge kernel combines them.
//
// Tokens are the M dimension of every product, so a 16-token tile fills the m16n8k16 rows and the
// (up to 8) query rows of the GQA group are its N columns:
// 1. S = K Q^T. A = 16 tokens' key codes, one packed byte (two 4-bit codes) at a time through a
//    table of (centroid, centroid) half2 pairs, or an fp8 pair converted to half2 (exact); B = the
//    rotated queries, split into fp16 high and low parts (two products) so that only the keys are
//    rounded: the centroids to fp16 (relative 2^-12, what an fp16 cache does to its keys). The byte
//    table has 32 copies, one per lane, so its lookups never conflict.
// 2. Online softmax per query row on the accumulators (a row is a column here: 8 lanes x 4 tokens).
// 3. O^T += V^T P^T. A = the tile's value codes as fp16 subnormals: one byte permute pairs two
//    tokens' bytes, and a mask leaves the low nibble (code * 2^-24, exact) or the high one in place
//    (code * 2^-20); the powers of two come back when the accumulators are stored. B = the softmax
//    weights times each token's value scale, transposed from the score accumulators by movmatrix.
//    The zero points add sum_t p_t z_t.
// Tile rows are a fixed permutation of each 32-token warp tile (rho below), chosen so that the
// lanes' 32-bit loads of a tile's value words hit 32 different banks.
//
// A warp walks its own 32-token tiles, double-buffered in shared memory with cp.async; 8 warps per
// block share the byte table and the query fragments, and are merged at the end.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include <atomic>
#include <cfloat>
#include <cmath>

#include "split_common.cuh"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kTok = 32;       // tokens per warp tile (two m16 row tiles)
constexpr int kRowsMax = 8;    // query rows per block: the N of the products
constexpr int kCopies = 32;    // copies of the byte table, one per lane
constexpr int kMaxDevices = 64;
constexpr float kCodeUnit = 16777216.0f;  // 2^24: value codes enter the products as fp16 subnormals

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The transpose of the 8x8 fp16 matrix whose row g, columns 2t..2t+1 lane 4g+t holds.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two e4m3 codes (low byte first) as a half2. From sm_89 the hardware converts them exactly; before,
// the byte's bits shifted into an fp16 give the value / 256 (normal and subnormal codes alike),
// which the score scale takes back (kFp8Unit).
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
#else
  const uint32_t x = __byte_perm(pair, 0u, 0x1404);  // byte 0 -> bits 8..15, byte 1 -> bits 24..31
  return (x & 0x80008000u) | ((x >> 1) & 0x3f803f80u);
#endif
}

__device__ __forceinline__ float fp8_unit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return 1.0f;
#else
  return 256.0f;
#endif
}

// Row r of a warp tile: rho(16 nu + r) = 8 (r/2 % 4) + r % 2 + 2 (r >= 8) + 4 nu. The value loads of
// one K position pair (2t, 2t+1 for t = 0..3) then read tokens 8t + c, whose rows start 8t * (row
// words) apart: 8 distinct multiples of 8 banks for any odd number of words per row.
__device__ __forceinline__ int tile_token(int r, int nu) { return 8 * ((r >> 1) & 3) + (r & 1) + 2 * (r >> 3) + 4 * nu; }

// fp8 key rows are copied in 16-byte chunks, chunk c of token u stored at chunk c ^ swizzle(u), so
// that the 8 tokens one load instruction reads (tile_token of r = 0..7) use 8 different chunks.
__device__ __forceinline__ int fp8_swizzle(int u, int chunks) { return ((u >> 3) | ((u & 1) << 2)) & (chunks - 1); }

// Value codes as fp16 subnormals. Code i of a group (4-bit: nibble i of a word; 3-bit: bits
// 3i..3i+2 of 3 bytes) lies within bits 0..9 of the 16 bits that start at group byte code_byte, at
// bit code_shift: one byte permute per start byte puts those 16 bits of two tokens into the two
// halves of a word, and a mask leaves the half code * 2^(code_shift - 24).
__host__ __device__ constexpr int code_byte(int bits, int i) { return bits * i / 8; }
__host__ __device__ constexpr int code_shift(int bits, int i) { return bits * i - 8 * code_byte(bits, i); }
__host__ __device__ constexpr float code_weight(int bits, int i) { return static_cast<float>(1 << code_shift(bits, i)); }
__host__ __device__ constexpr uint32_t code_mask(int bits, int i) {
  return (((1u << bits) - 1) << code_shift(bits, i)) * 0x10001u;
}
// Every code of a group must lie within its window's low 10 bits (the fp16 mantissa: above, the
// half is no longer linear in the code), and the windows must start inside the group word.
constexpr bool codes_fit(int bits) {
  for (int i = 0; i < 8; ++i) {
    if (code_shift(bits, i) + bits > 10 || code_byte(bits, i) > 3) return false;
  }
  return true;
}
static_assert(codes_fit(3) && codes_fit(4), "a value code outside its subnormal window");
__host__ __device__ constexpr uint32_t window(int byte) {  // bytes byte, byte+1 of x | of y
  return byte | ((byte + 1) << 4) | ((4 + byte) << 8) | ((5 + byte) << 12);
}

__host__ __device__ constexpr int round16(int n) { return (n + 15) / 16 * 16; }
__host__ __device__ inline int key_tile_bytes(int kb) { return round16(kTok * kb + 16); }  // +16: funnel-shift over-read
__host__ __device__ inline int value_tile_bytes(int vb) { return round16(kTok * vb); }
__host__ __device__ inline int warp_stage_bytes(int kb, int vb) { return 2 * (key_tile_bytes(kb) + value_tile_bytes(vb)); }

// kKeyBits: 4 or 3 (MSE keys) or 8 (fp8 keys); kValBits: 4 or 3 (uint values); kD: the key
// product's length (MSE: the padded head size; fp8: the head size) and the value head size.
template <int kKeyBits, int kValBits, int kD>
__global__ void __launch_bounds__(kThreads, kD >= 256 ? 1 : 2)
    tc_split_kernel(AttentionParams p, Layout l, const void* q, const uint8_t* past_key, const uint8_t* past_value,
                    float* partial) {
  constexpr bool kFp8 = kKeyBits == 8;
  constexpr int kSteps = kD / 16;                     // k-steps of the score product
  constexpr int kKeyWords = kFp8 ? kSteps : kD / 32;  // code groups (4 or 3 bytes) of a key row per lane
  constexpr int kValWords = kD / 64;                  // code groups (4 or 3 bytes) of a value row per lane
  constexpr int kMt = 4 * kValWords;                  // m16 tiles of O^T (dv / 16)
  constexpr int kPairs = kKeyBits == 3 ? 64 : 256;    // code pairs the table holds
  constexpr int kKeyPayload = kD * kKeyBits / 8, kValPayload = kD * kValBits / 8;
  __shared__ uint32_t lut[kFp8 ? 1 : kPairs * kCopies];  // [pair][lane]: half2 (centroid of the first code, of the second)
  __shared__ uint4 qf[kSteps][32];  // per k-step and lane: B fragments (hi b0, hi b1, lo b0, lo b1)
  __shared__ float row_factor[kRowsMax];
  __shared__ int64_t row_pos[kRowsMax], row_hq[kRowsMax];
  extern __shared__ __align__(16) uint8_t dyn[];

  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * l.rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(l.rows_per_block), l.rows - row0));
  const int kb = static_cast<int>(p.key_row()), vb = static_cast<int>(p.value_row());
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  if (!kFp8) {
    const double* c = codec::centroids(kKeyBits);
    for (int i = tid; i < kPairs * kCopies; i += kThreads) {
      const int e = i / kCopies, mask = (1 << kKeyBits) - 1;
      lut[i] = pack_half2(static_cast<float>(c[e & mask]), static_cast<float>(c[e >> kKeyBits]));
    }
  }
  // --- the block's query rows: rotated (MSE), normalised per row, split into fp16 hi + lo ---
  float* qv = reinterpret_cast<float*>(dyn);  // [kRowsMax][kD], before the stages use the space
  if (tid < kRowsMax) {
    const int64_t row = row0 + tid;
    row_pos[tid] = row / l.group;
    row_hq[tid] = hkv * l.group + row % l.group;
  }
  __syncthreads();
  load_query_rows(p, q, b, row_hq, row_pos, rows, kRowsMax, kD, !kFp8, qv);
  {  // warp r: row r's largest magnitude
    float m = 0.0f;
    for (int i = lane; i < kD; i += 32) m = fmaxf(m, fabsf(qv[warp * kD + i]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) row_factor[warp] = m;
  }
  __syncthreads();
  for (int k = tid; k < kSteps * 32; k += kThreads) {
    // lane ln's B fragment at k-step s: row ln/4, the 4 dims its A fragment's codes stand for
    const int s = k / 32, ln = k % 32, r = ln / 4, tt = ln % 4;
    const int d0 = kFp8 ? 4 * (tt + 4 * s) : 8 * (tt + 4 * (s / 2)) + 4 * (s % 2);
    const float m = row_factor[r], inv = m > 0.0f ? 1.0f / m : 0.0f;
    float hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = qv[r * kD + d0 + j] * inv;
      hi[j] = __half2float(__float2half_rn(x));
      lo[j] = x - hi[j];
    }
    qf[s][ln] = make_uint4(pack_half2(hi[0], hi[1]), pack_half2(hi[2], hi[3]), pack_half2(lo[0], lo[1]),
                           pack_half2(lo[2], lo[3]));
  }
  __syncthreads();
  const float fold = kFp8 ? p.scale * fp8_unit() : p.scale / static_cast<float>(kD);
  const float fac[2] = {row_factor[2 * t] * fold, row_factor[2 * t + 1] * fold};  // this lane's columns
  __syncthreads();  // qv's space is reused below

  // --- this warp's tiles ---
  const int ktile = key_tile_bytes(kb), tile = ktile + value_tile_bytes(vb);
  uint8_t* stage = dyn + warp * 2 * tile;
  const int64_t begin = static_cast<int64_t>(split) * l.split_len;
  const int len = static_cast<int>(max(static_cast<int64_t>(0), min(p.past_of(b), begin + l.split_len) - begin));
  const uint8_t* keys = past_key + (bh * p.past_rows_or_len() + begin) * kb;  // this split's rows
  const uint8_t* vals = past_value + (bh * p.past_rows_or_len() + begin) * vb;
  constexpr int kChunks = kD / 16;  // fp8 rows: 16-byte chunks

  // A full tile is 32 rows, a multiple of 16 bytes; its start is as aligned as the split's first
  // row (tiles start at multiples of 32 rows), so each cache's tiles are copied in chunks of the
  // widest size that alignment allows, without the general case's checks.
  auto chunk_width = [](const uint8_t* base) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(base);
    return (a & 15) == 0 ? 16 : (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : 0;
  };
  const int kwidth = chunk_width(keys), vwidth = chunk_width(vals);
  auto copy_tile = [&](uint8_t* dst, const uint8_t* src, int bytes, int width) {
    if (width == 16) {
      for (int i = lane; i < bytes / 16; i += 32) __pipeline_memcpy_async(dst + 16 * i, src + 16 * i, 16);
    } else if (width == 8) {
      for (int i = lane; i < bytes / 8; i += 32) __pipeline_memcpy_async(dst + 8 * i, src + 8 * i, 8);
    } else if (width == 4) {
      for (int i = lane; i < bytes / 4; i += 32) __pipeline_memcpy_async(dst + 4 * i, src + 4 * i, 4);
    } else {
      warp_copy_async(dst, src, bytes, lane);
    }
  };
  auto fetch = [&](int r0, int buf) {  // start copying the tile of rows r0.. into buffer buf
    const int n = min(kTok, len - r0);
    uint8_t* dst = stage + buf * tile;
    const uint8_t* ksrc = keys + static_cast<int64_t>(r0) * kb;
    const uint8_t* vsrc = vals + static_cast<int64_t>(r0) * vb;
    if (kFp8) {
      for (int i = lane; i < n * kChunks; i += 32) {
        const int u = i / kChunks, c = i % kChunks;
        __pipeline_memcpy_async(dst + u * kb + 16 * (c ^ fp8_swizzle(u, kChunks)), ksrc + u * kb + 16 * c, 16);
      }
    } else if (n == kTok) {
      copy_tile(dst, ksrc, kTok * kb, kwidth);
    } else {
      warp_copy_async(dst, ksrc, n * kb, lane);
    }
    if (n == kTok) {
      copy_tile(dst + ktile, vsrc, kTok * vb, vwidth);
    } else {
      warp_copy_async(dst + ktile, vsrc, n * vb, lane);
    }
    __pipeline_commit();
  };

  // Scores are kept in base 2 (log2 e folded into the factors) for ex2.approx.
  const float l2fac[2] = {fac[0] * 1.44269504f, fac[1] * 1.44269504f};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, z_run[2] = {0.0f, 0.0f};
  float o[kMt][4];  // O^T: rows = value columns (see the store below), columns 2t, 2t+1 = query rows
#pragma unroll
  for (int i = 0; i < kMt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  const uint32_t lut_lane = lane * 4;  // this lane's copy: byte offset within a table row
  const char* lut_base = reinterpret_cast<const char*>(lut);

  // Tile-invariant byte offsets within a buffer. Score rows: tokens tok(nu, e) = tile_token(g + 8e, nu).
  int key_off[2][2], key_sh[2][2], norm_off[2][2], sz_off[2][2];
#pragma unroll
  for (int nu = 0; nu < 2; ++nu)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int u = tile_token(g + 8 * e, nu);
      const int off = u * kb + (kFp8 ? 4 : kKeyBits) * t;  // the lane's first code group
      key_off[nu][e] = kFp8 ? off : off & ~3;
      key_sh[nu][e] = (off & 3) * 8;
      norm_off[nu][e] = u * kb + kKeyPayload;
      sz_off[nu][e] = ktile + u * vb + kValPayload;
    }
  // Value rows of the K positions 2t, 2t+1 (row a, a + 1) and 2t+8, 2t+9 (row c, c + 1), code
  // group g (4-bit: the aligned word g; 3-bit: bytes 3g..3g+2, funnel-shifted out of two words).
  int val_off[2][2];
  const int val_sh = (kValBits * g & 3) * 8;
#pragma unroll
  for (int nu = 0; nu < 2; ++nu) {
    val_off[nu][0] = ktile + tile_token(2 * t, nu) * vb + (kValBits * g & ~3);
    val_off[nu][1] = ktile + tile_token(2 * t + 8, nu) * vb + (kValBits * g & ~3);
  }

  const int stride = kWarps * kTok;
  if (warp * kTok < len) fetch(warp * kTok, 0);
  int it = 0;
  for (int r0 = warp * kTok; r0 < len; r0 += stride, ++it) {
    const int n_tok = min(kTok, len - r0);
    if (r0 + stride < len) {  // the other buffer was last read by the previous tile, finished by every lane
      fetch(r0 + stride, (it + 1) & 1);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncwarp();
    const uint8_t* buf = stage + (it & 1) * tile;

    // 1. scores: acc[nu][0] the products with the queries' high parts, acc[nu][1] with the low
    float acc[2][2][4];
#pragma unroll
    for (int nu = 0; nu < 2; ++nu)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nu][0][j] = acc[nu][1][j] = 0.0f;
    if (kFp8) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 bq = qf[s][lane];
#pragma unroll
        for (int nu = 0; nu < 2; ++nu) {
          const int ua = tile_token(g, nu), ub = tile_token(g + 8, nu);
          const uint32_t wa = *reinterpret_cast<const uint32_t*>(buf + key_off[nu][0] + 16 * (s ^ fp8_swizzle(ua, kChunks)));
          const uint32_t wb = *reinterpret_cast<const uint32_t*>(buf + key_off[nu][1] + 16 * (s ^ fp8_swizzle(ub, kChunks)));
          const uint32_t a0 = fp8x2_to_half2(wa & 0xffffu), a2 = fp8x2_to_half2(wa >> 16);
          const uint32_t a1 = fp8x2_to_half2(wb & 0xffffu), a3 = fp8x2_to_half2(wb >> 16);
          mma16816(acc[nu][0], a0, a1, a2, a3, bq.x, bq.y);
          mma16816(acc[nu][1], a0, a1, a2, a3, bq.z, bq.w);
        }
      }
    } else {
#pragma unroll
      for (int m = 0; m < kKeyWords; ++m) {
        // code group t + 4m of each row (4 or 3 bytes; rows kb bytes apart are not always
        // 4-aligned): two aligned words, funnel-shifted
        uint32_t w[2][2];
#pragma unroll
        for (int nu = 0; nu < 2; ++nu)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t* kw = reinterpret_cast<const uint32_t*>(buf + key_off[nu][e]) + kKeyBits * m;
            w[nu][e] = __funnelshift_r(kw[0], kw[1], key_sh[nu][e]);
          }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 bq = qf[2 * m + h][lane];
#pragma unroll
          for (int nu = 0; nu < 2; ++nu) {
            // a0/a1: code pair 2h of rows g/g+8, a2/a3: pair 2h+1; table offset = pair * 128 + lane copy
            uint32_t v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int pair = 2 * h + j / 2, e = j % 2;
              const int sft = 2 * kKeyBits * pair - 7;
              const uint32_t x = sft < 0 ? (w[nu][e] << -sft) : (w[nu][e] >> sft);
              v[j] = *reinterpret_cast<const uint32_t*>(lut_base + ((x & ((kPairs - 1) << 7)) | lut_lane));
            }
            mma16816(acc[nu][0], v[0], v[1], v[2], v[3], bq.x, bq.y);
            mma16816(acc[nu][1], v[0], v[1], v[2], v[3], bq.z, bq.w);
          }
        }
      }
    }

    // 2. online softmax: lane (g, t) holds tokens tile_token(g + 8e, nu) of columns 2t, 2t+1
    float sc[2][4], vs[2][2], vz[2][2];
#pragma unroll
    for (int nu = 0; nu < 2; ++nu)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool ok = tile_token(g + 8 * e, nu) < n_tok;  // rows past the end hold stale bytes
        const float ks = kFp8 ? 1.0f : __half2float(*reinterpret_cast<const __half*>(buf + norm_off[nu][e]));
        const __half2 sz = *reinterpret_cast<const __half2*>(buf + sz_off[nu][e]);
        vs[nu][e] = ok ? __low2float(sz) : 0.0f;
        vz[nu][e] = ok ? __high2float(sz) : 0.0f;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          sc[nu][2 * e + c] = ok ? (acc[nu][0][2 * e + c] + acc[nu][1][2 * e + c]) * (ks * l2fac[c]) : -INFINITY;
        }
      }
    float rescale[2], m_use[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float mt = fmaxf(fmaxf(sc[0][c], sc[0][2 + c]), fmaxf(sc[1][c], sc[1][2 + c]));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 4));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
      const float m_new = fmaxf(m_run[c], mt);
      m_use[c] = m_new == -INFINITY ? 0.0f : m_new;  // no -inf - -inf: empty columns keep weight 0
      rescale[c] = fast_exp2(m_run[c] - m_use[c]);
      m_run[c] = m_new;
    }
    float pr[2][4];
#pragma unroll
    for (int nu = 0; nu < 2; ++nu)
#pragma unroll
      for (int i = 0; i < 4; ++i) pr[nu][i] = fast_exp2(sc[nu][i] - m_use[i % 2]);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float ls = 0.0f, zs = 0.0f;
#pragma unroll
      for (int nu = 0; nu < 2; ++nu)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          ls += pr[nu][2 * e + c];
          zs += pr[nu][2 * e + c] * vz[nu][e];
        }
      l_run[c] = l_run[c] * rescale[c] + ls;
      z_run[c] = z_run[c] * rescale[c] + zs;
    }
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int i = 0; i < kMt; ++i) {
        o[i][0] *= rescale[0];
        o[i][1] *= rescale[1];
        o[i][2] *= rescale[0];
        o[i][3] *= rescale[1];
      }
    }

    // 3. O^T += V^T (P * value scale)^T, one k16 step per row tile
#pragma unroll
    for (int nu = 0; nu < 2; ++nu) {
      const uint32_t b0 = transpose8x8(pack_half2(pr[nu][0] * vs[nu][0], pr[nu][1] * vs[nu][0]));
      const uint32_t b1 = transpose8x8(pack_half2(pr[nu][2] * vs[nu][1], pr[nu][3] * vs[nu][1]));
      const uint32_t* ra = reinterpret_cast<const uint32_t*>(buf + val_off[nu][0]);
      const uint32_t* rc = reinterpret_cast<const uint32_t*>(buf + val_off[nu][1]);
#pragma unroll
      for (int w = 0; w < kValWords; ++w) {
        uint32_t wa, wb, wc, wd;  // code group g + 8w of tokens a, b, c, d
        if (kValBits == 4) {
          wa = ra[8 * w], wb = ra[vb / 4 + 8 * w], wc = rc[8 * w], wd = rc[vb / 4 + 8 * w];
        } else {
          const int o6 = 6 * w, r6 = vb / 4 + 6 * w;  // 8 groups of 3 bytes = 6 words
          wa = __funnelshift_r(ra[o6], ra[o6 + 1], val_sh), wb = __funnelshift_r(ra[r6], ra[r6 + 1], val_sh);
          wc = __funnelshift_r(rc[o6], rc[o6 + 1], val_sh), wd = __funnelshift_r(rc[r6], rc[r6 + 1], val_sh);
        }
        constexpr int kWin = kValBits == 4 ? 4 : 3;  // start bytes
        uint32_t x[kWin], y[kWin];  // tokens (a, b) and (c, d)
#pragma unroll
        for (int k = 0; k < kWin; ++k) x[k] = __byte_perm(wa, wb, window(k)), y[k] = __byte_perm(wc, wd, window(k));
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // m-tile rows g: code 2j (column 8 (g + 8w) + 2j), rows g + 8: code 2j + 1
          const int c0 = 2 * j, c1 = 2 * j + 1;
          const uint32_t m0 = code_mask(kValBits, c0), m1 = code_mask(kValBits, c1);
          mma16816(o[4 * w + j], x[code_byte(kValBits, c0)] & m0, x[code_byte(kValBits, c1)] & m1,
                   y[code_byte(kValBits, c0)] & m0, y[code_byte(kValBits, c1)] & m1, b0, b1);
        }
      }
    }
    __syncwarp();  // every lane is done with this tile's buffers before they are refilled
  }

  // --- merge: the 8 lanes of a column, then the warps ---
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    for (int x = 4; x < 32; x <<= 1) {
      l_run[c] += __shfl_xor_sync(0xffffffffu, l_run[c], x);
      z_run[c] += __shfl_xor_sync(0xffffffffu, z_run[c], x);
    }
  }
  const int dv = kD;
  __syncthreads();  // every warp is done with its stage
  float* ws = reinterpret_cast<float*>(dyn);  // [warp][row][3 + dv]: max, sum, zero sum, acc
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float* mine = ws + (warp * kRowsMax + 2 * t + c) * (3 + dv);
    if (g == 0) {
      mine[0] = m_run[c] * 0.693147181f;  // back to natural-log units for the merges
      mine[1] = l_run[c];
      mine[2] = z_run[c];
    }
    // m-tile 4w + j: row g is value column 8 (g + 8w) + 2j, row g + 8 the next column
#pragma unroll
    for (int w = 0; w < kValWords; ++w)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mine[3 + 8 * (g + 8 * w) + 2 * j] = o[4 * w + j][c] * (kCodeUnit / code_weight(kValBits, 2 * j));
        mine[3 + 8 * (g + 8 * w) + 2 * j + 1] = o[4 * w + j][2 + c] * (kCodeUnit / code_weight(kValBits, 2 * j + 1));
      }
  }
  __syncthreads();
  store_warp_states(ws, kWarps, kRowsMax, rows, dv, partial + ((bh * l.rows + row0) * l.splits + split) * partial_stride(dv),
                    l.splits * partial_stride(dv));
}

int tc_dynamic_bytes(const AttentionParams& p, int kd) {
  const int kb = static_cast<int>(p.key_row()), vb = static_cast<int>(p.value_row());
  int smem = kWarps * warp_stage_bytes(kb, vb);
  smem = max(smem, kWarps * kRowsMax * (3 + kd) * 4);  // the final merge
  return max(smem, kRowsMax * kd * 4);                  // the query rows
}

int tc_kd(const AttentionParams& p) { return p.key_format == Format::kFp8 ? p.head_dim : padded_dim(p.head_dim); }

// Shared memory of a block: the stages (dynamic), the byte table and the query fragments (static).
int tc_block_bytes(const AttentionParams& p) {
  const int kd = tc_kd(p);
  const int pairs = p.key_format == Format::kFp8 ? 0 : p.key_format == Format::kMse3 ? 64 : 256;
  return tc_dynamic_bytes(p, kd) + pairs * kCopies * 4 + kd / 16 * 512 + 256;
}

template <int kKeyBits, int kValBits, int kD>
cudaError_t launch(const AttentionParams& p, const Layout& l, const void* q, const uint8_t* past_key,
                   const uint8_t* past_value, float* partial, cudaStream_t stream) {
  const int smem = tc_dynamic_bytes(p, kD);
  // Beyond 48 KiB per block (static + dynamic) a kernel has to opt in, once per device for the
  // largest size asked so far.
  auto kernel = tc_split_kernel<kKeyBits, kValBits, kD>;
  static std::atomic<int> opted[kMaxDevices];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= kMaxDevices || opted[dev].load() < smem) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices) opted[dev].store(smem);
  }
  dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads), l.splits, l.row_blocks);
  kernel<<<grid, kThreads, smem, stream>>>(p, l, q, past_key, past_value, partial);
  return cudaGetLastError();
}

template <int kKeyBits, int kValBits>
cudaError_t launch_d(const AttentionParams& p, const Layout& l, const void* q, const uint8_t* past_key,
                     const uint8_t* past_value, float* partial, cudaStream_t stream) {
  switch (tc_kd(p)) {
    case 64: return launch<kKeyBits, kValBits, 64>(p, l, q, past_key, past_value, partial, stream);
    case 128: return launch<kKeyBits, kValBits, 128>(p, l, q, past_key, past_value, partial, stream);
    default: return launch<kKeyBits, kValBits, 256>(p, l, q, past_key, past_value, partial, stream);
  }
}

}  // namespace

bool tc_split_supported(const AttentionParams& p) {
  // the presets' pairs: MSE 4-bit, fp8 or MSE 3-bit keys with uint4 values, MSE 3-bit with uint3
  const Format kf = p.key_format, vf = p.value_format;
  const bool pair = vf == Format::kUint4 ? (kf == Format::kMse4 || kf == Format::kFp8 || kf == Format::kMse3)
                                         : (vf == Format::kUint3 && kf == Format::kMse3);
  if (!pair) return false;
  if (p.mask_type != MaskType::kNone) return false;
  if (p.is_causal && p.new_len < p.q_len) return false;  // a query could then miss some past tokens
  const int kd = tc_kd(p);
  if (kd != 64 && kd != 128 && kd != 256) return false;
  if (p.v_head_dim != kd) return false;
  if (kf == Format::kFp8 && p.key_row() != kd) return false;  // swizzled 16-byte chunks
  if (p.value_row() % 4 != 0) return false;                   // aligned value words
  // The weights p * value scale enter the value product in fp16 (relative 2^-11): within the
  // tolerance of fp16/bf16 outputs, not of float32 ones, which keep the CUDA-core kernel.
  if (p.dtype == DType::kFloat32) return false;
  // Rows much wider than the packed vectors (an onnxruntime-genai cache with raw16 layers) would not
  // fit 8 warps' double buffers; they keep the other kernels.
  return tc_block_bytes(p) <= 200 * 1024;
}

int tc_blocks_per_sm(const AttentionParams& p) {
  if (tc_kd(p) >= 256) return 1;                                   // registers
  return tc_block_bytes(p) + 1024 <= 228 * 1024 / 2 ? 2 : 1;      // shared memory
}

cudaError_t launch_tc_split(const AttentionParams& p, const Layout& l, const void* q, const uint8_t* past_key,
                            const uint8_t* past_value, float* partial, cudaStream_t stream) {
  if (p.key_format == Format::kFp8) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value);
    if ((a & 15) != 0) return cudaErrorMisalignedAddress;  // the caller routes these to the other kernels
    return launch_d<8, 4>(p, l, q, past_key, past_value, partial, stream);
  }
  if (p.key_format == Format::kMse4) return launch_d<4, 4>(p, l, q, past_key, past_value, partial, stream);
  return p.value_format == Format::kUint4 ? launch_d<3, 4>(p, l, q, past_key, past_value, partial, stream)
                                          : launch_d<3, 3>(p, l, q, past_key, past_value, partial, stream);
}

}  // namespace turboquant::cuda::detail
