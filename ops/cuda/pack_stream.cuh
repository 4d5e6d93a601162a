// TQPack for throughput: four lanes per vector, eight vectors per warp, byte-identical to the CPU
// codec (vector_codec.h) like the one-warp-per-vector packing of pack_device.cuh, which stays for
// the few new tokens of a decode step (latency) and the head sizes below 64.
//
// Why this layout: the codec fixes the order of every rounding, and two orders matter.
//  - Sums of squares: 32 partial sums (term i goes to partial i % 32, ascending), then a butterfly
//    at distances 16, 8, 4, 2, 1.
//  - The rotation: butterflies at distance 1, 2, 4, ... Dp/2, in that order.
// A vector is read as chunks of 8 elements (16 bytes of fp16): lane j of the vector's four holds
// chunks j, j + 4, j + 8, ... ("chunk layout"), so element i = 8j + a + 32s sits in lane j at
// (s, a): the partial sums run over s in the lane, the butterfly's distances 16 and 8 are the two
// lane bits (shuffles) and 4, 2, 1 are within the lane, and so are the rotation's distances 1, 2, 4.
// The vector then goes through shared memory to the "strided layout" (lane j holds i = j + 4m),
// where the distances 8 ... Dp/2 are within the lane, and so is the norm correction's sum (partial
// j + 4 (m % 8), butterfly distances 16, 8, 4 in the lane, 2 and 1 by shuffles). The indices go back
// through shared memory to the chunk layout, where each lane packs whole bytes, and a warp's eight
// packed rows (contiguous in the output) leave in 16-byte stores.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "pack_device.cuh"
#include "turboquant/float_io.h"
#include "turboquant/cuda_kernels.h"
#include "turboquant/numerics.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {

constexpr int kStreamLanes = 4;                         // lanes per vector
constexpr int kStreamVectors = 32 / kStreamLanes;       // vectors per warp
constexpr int kStreamWarps = 4;                         // warps per block
constexpr int kStreamThreads = 32 * kStreamWarps;
constexpr int kStreamVectorsPerBlock = kStreamWarps * kStreamVectors;
constexpr unsigned kStreamAll = 0xffffffffu;

// Bytes of a staged packed row of a non-MSE format, at most (head size d <= Dp).
template <Format F>
constexpr int stage_row_bytes(int dp) {
  return F == Format::kRaw16 ? 2 * dp : F == Format::kFp8 ? dp : F == Format::kUint4 ? dp / 2 + 4 : 3 * dp / 8 + 4;
}

// The codebook search (codebook_lookup): buckets of width 1/8 centred on j/8, j in [-130, 130],
// which holds every rotated coordinate of a finite vector (|z| <= sqrt(Dp) <= 16). Bucket j holds
// the values that round to j/8 (ties either way: [j/8 - 1/16, j/8 + 1/16]); its entry is the number
// of boundaries below it and the first boundary at or above its start (NaN: none). When a bucket
// holds at most that one boundary (checked below at compile time: the closest boundaries are 0.258
// apart for 4 bits, 0.5 for 3), one comparison finishes the count.
constexpr int kBucketHalf = 130;
constexpr int kBuckets = 2 * kBucketHalf + 1;

struct BucketEntry {
  float next;  // the first boundary >= the bucket's start, or NaN
  int below;   // boundaries below the bucket's start
};

struct alignas(16) CodebookTables {
  BucketEntry buckets[kBuckets + 1];  // (+ 1: a whole number of 16-byte copies)
  double csq[16];                     // centroid squares, as the norm correction's products round them
};

template <int kBits>
constexpr CodebookTables make_codebook_tables() {
  constexpr int kBounds = (1 << kBits) - 1;
  const float* b = kBits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4;
  const double* c = kBits == 3 ? codebook::kCentroids3 : codebook::kCentroids4;
  CodebookTables t{};
  for (int i = 0; i < kBuckets; ++i) {
    const float lo = (i - kBucketHalf - 0.5f) / 8.0f;
    int k = 0;
    while (k < kBounds && b[k] < lo) ++k;
    t.buckets[i] = {k < kBounds ? b[k] : std::numeric_limits<float>::quiet_NaN(), k};
  }
  for (int i = 0; i < 16; ++i) t.csq[i] = c[i % (1 << kBits)] * c[i % (1 << kBits)];
  return t;
}

// Whether every bucket holds at most one boundary.
template <int kBits>
constexpr bool buckets_hold_one() {
  constexpr int kBounds = (1 << kBits) - 1;
  const float* b = kBits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4;
  for (int k = 0; k + 1 < kBounds; ++k) {
    if (b[k + 1] - b[k] <= 1.0f / 8.0f) return false;
  }
  return true;
}
static_assert(buckets_hold_one<3>() && buckets_hold_one<4>(), "a codebook bucket holds two boundaries");

__device__ const CodebookTables kCodebookTables3 = make_codebook_tables<3>();
__device__ const CodebookTables kCodebookTables4 = make_codebook_tables<4>();

// Shared memory of a block, for vectors of padded size Dp = 32 * kS (kS chunks per lane).
template <Format F, int kS>
struct __align__(16) StreamSmem {
  static constexpr int kDp = 32 * kS;
  static constexpr int kRowFloats = kDp + 4;  // + 16 bytes: the eight rows of a warp on different banks
  static constexpr int kIdxRow = kDp + 8;     // + 8 bytes: the same for the index bytes, rows 8-aligned
  // MSE: the transposition's floats, then (after a __syncwarp) the warp's packed rows; else the rows
  static constexpr int kWarpBytes = is_mse(F) ? kStreamVectors * kRowFloats * 4 : kStreamVectors * stage_row_bytes<F>(kDp);
  alignas(16) uint8_t rows[kStreamWarps][kWarpBytes];
  alignas(8) uint8_t idx[kStreamWarps][kStreamVectors][is_mse(F) ? kIdxRow : 8];
  CodebookTables codebook;  // MSE formats
};

// Copies the codebook tables of F (MSE formats) for the block; syncs it.
template <Format F, int kS>
__device__ inline void load_codebook(StreamSmem<F, kS>& sm) {
  if constexpr (is_mse(F)) {
    const uint4* src = reinterpret_cast<const uint4*>(format_bits(F) == 3 ? &kCodebookTables3 : &kCodebookTables4);
    uint4* dst = reinterpret_cast<uint4*>(&sm.codebook);
    for (int i = threadIdx.x; i < static_cast<int>(sizeof(CodebookTables) / 16); i += blockDim.x) dst[i] = src[i];
    __syncthreads();
  }
}

__device__ inline uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// A bucket entry at a shared address. Not volatile, so that the compiler may issue the loads of
// several elements ahead of their uses; the tables are written once, before the block's first
// __syncthreads, and every address comes from bucket_base, which follows it.
__device__ inline BucketEntry load_bucket(uint32_t address) {
  BucketEntry e;
  asm("ld.shared.v2.b32 {%0, %1}, [%2];" : "=f"(e.next), "=r"(e.below) : "r"(address));
  return e;
}

// Rounding to a multiple of 1/8 by adding 1.5 * 2^20 (whose float spacing is 1/8): the difference
// of the bit patterns is then the bucket. kRoundBits * 8 comes off the table's shared address
// once, so a lookup is one add and one multiply-add of addresses (32-bit, wrapping).
constexpr float kRound = 1572864.0f;
constexpr uint32_t kRoundBits = 0x49c00000u;

// The shared address that bucket lookups of the bit pattern of z + kRound start from. (Passed
// through a shuffle so that the compiler cannot split the constant back out of it.)
__device__ inline uint32_t bucket_base(const BucketEntry* buckets) {
  const uint32_t base = shared_address(buckets + kBucketHalf) - kRoundBits * static_cast<uint32_t>(sizeof(BucketEntry));
  return __shfl_sync(kStreamAll, base, 0);
}

// codec::codebook_index (the number of boundaries <= z) through the buckets. kAny false: z finite
// with |z| <= 16; true: any z, clamped to +-3 first (a NaN to -3, whose bucket counts no boundary
// and whose comparison fails, so a NaN gets 0 as in the codec).
template <bool kAny>
__device__ inline int codebook_lookup(float z, uint32_t base) {
  const float t = kAny ? fminf(fmaxf(z, -3.0f), 3.0f) : z;
  const BucketEntry e = load_bucket(base + __float_as_uint(t + kRound) * static_cast<uint32_t>(sizeof(BucketEntry)));
  return e.below + (e.next <= z ? 1 : 0);
}

// a / b, correctly rounded, from r = RN(1/b): q = RN(a r) is within an ulp of a / b, the residual
// a - b q is exact (an FMA), and RN(q + (a - b q) r) is the rounded quotient (Markstein's
// theorem) as long as nothing overflows or underflows: a finite, b normal, the quotient normal
// (scripts/cuda_pack_probe.cu checks every float a in [2^-100, 2^100) against 512 divisors: the
// only differences are subnormal quotients). Three instructions instead of a division's nine.
__device__ inline float div_by_reciprocal(float a, float b, float r) {
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(__fmaf_rn(-q, b, a), r, q);
}

// fp16 words: whether any of their halves is a NaN ((h & 0x7fff) > 0x7c00, i.e. + 0x3ff carries
// into bit 15; the halves cannot carry into each other).
__device__ inline bool any_nan_f16x2(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  constexpr uint32_t kMag = 0x7fff7fffu, kUp = 0x03ff03ffu;
  return ((((a & kMag) + kUp) | ((b & kMag) + kUp) | ((c & kMag) + kUp) | ((d & kMag) + kUp)) & 0x80008000u) != 0;
}

// fp16 bits -> floats through the conversion instruction (which may return a canonical NaN) or,
// for chunks with a NaN when kNanBits, through the codec's conversion, which keeps the NaN's sign
// (fp8 and raw16 store it).
template <bool kNanBits>
__device__ inline void f16_chunk(const uint4& u, float (&o)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  if (!kNanBits || !any_nan_f16x2(u.x, u.y, u.z, u.w)) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
      o[2 * k] = f.x, o[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) o[2 * k] = f16_to_f32(w[k] & 0xffffu), o[2 * k + 1] = f16_to_f32(w[k] >> 16);
  }
}

// The lane's chunks j, j + 4, ... of the vector starting at element e of x (16-byte aligned), of
// which the first `chunks` exist (and none when !live); the others are zeros. One branch on the
// type per vector, the loads predicated.
template <bool kNanBits, int kS>
__device__ inline void load_chunks(DType dt, const void* x, int64_t e, bool live, int chunks, int j, float (&z)[kS][8]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (dt == DType::kFloat32) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const float*>(x) + e);
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      const int c = j + 4 * s;
      const bool ok = live && c < chunks;
      const uint4 a = ok ? __ldcs(p + 2 * c) : zero, b = ok ? __ldcs(p + 2 * c + 1) : zero;
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) z[s][k] = __uint_as_float(w[k]);
    }
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + e);
  uint4 u[kS];
#pragma unroll
  for (int s = 0; s < kS; ++s) u[s] = live && j + 4 * s < chunks ? __ldcs(p + j + 4 * s) : zero;
  if (dt == DType::kBFloat16) {
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      const uint32_t w[4] = {u[s].x, u[s].y, u[s].z, u[s].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) z[s][2 * k] = __uint_as_float(w[k] << 16), z[s][2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kS; ++s) f16_chunk<kNanBits>(u[s], z[s]);
  }
}

// part + x^2 in float64: the square of a float is exact in float64, so the fused operation rounds
// only the sum, as the codec's separate product and sum do.
__device__ inline double add_square(double part, float x) {
  const double d = static_cast<double>(x);
  return __fma_rn(d, d, part);
}

// Stores into a staged row; kAlign: the alignment every such store has in F's rows.
template <int kAlign>
__device__ inline void stage_u32(uint8_t* p, uint32_t w) {
  if constexpr (kAlign >= 4) {
    *reinterpret_cast<uint32_t*>(p) = w;
  } else if constexpr (kAlign == 2) {
    reinterpret_cast<uint16_t*>(p)[0] = static_cast<uint16_t>(w), reinterpret_cast<uint16_t*>(p)[1] = static_cast<uint16_t>(w >> 16);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = static_cast<uint8_t>(w >> (8 * k));
  }
}

// Eight indices (bytes of lo, hi, each < 2^bits) as the codec's LSB-first bit stream: 4 bytes for
// 4 bits (at a kAlign-aligned p), 3 bytes for 3 bits.
template <int kBits, int kAlign>
__device__ inline void stage_indices(uint8_t* p, uint32_t lo, uint32_t hi) {
  if constexpr (kBits == 4) {
    const uint32_t a = lo | (lo >> 4), b = hi | (hi >> 4);  // bytes 0 and 2 of each hold a pair
    stage_u32<kAlign>(p, __byte_perm(a, b, 0x6420));
  } else {
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) w |= ((lo >> (8 * k)) & 7u) << (3 * k) | ((hi >> (8 * k)) & 7u) << (3 * k + 12);
    p[0] = static_cast<uint8_t>(w), p[1] = static_cast<uint8_t>(w >> 8), p[2] = static_cast<uint8_t>(w >> 16);
  }
}

// MSE formats. z: the lane's chunks (chunk layout), offset removed; row: the vector's floats in
// shared memory; idx: its index bytes; out: its staged packed row; j: the lane within the vector;
// tiny: whether an element's quotient by the norm can be subnormal (not for fp16 without an offset:
// its nonzero elements are >= 2^-24 and its norms below 2^21).
template <int kBits, int kS>
__device__ inline void encode_mse_stream(int d, bool nc, bool tiny, float (&z)[kS][8], float* row, uint8_t* idx,
                                         uint8_t* out, uint32_t buckets, const double* csq, int j) {
  constexpr int kDp = 32 * kS, kM = kDp / 4;
  const int chunks = d / 8;
  // the norm: partial 8 j + a sums the lane's chunks in order; the butterfly's distances 16 and 8
  // are lanes j ^ 2 and j ^ 1, then 4, 2, 1 within the lane
  double part[8];
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    part[a] = 0.0;
#pragma unroll
    for (int s = 0; s < kS; ++s) part[a] = add_square(part[a], z[s][a]);
  }
#pragma unroll
  for (int o = 2; o >= 1; o >>= 1) {
#pragma unroll
    for (int a = 0; a < 8; ++a) part[a] = __dadd_rn(part[a], __shfl_xor_sync(kStreamAll, part[a], o));
  }
  const double p4[4] = {__dadd_rn(part[0], part[4]), __dadd_rn(part[1], part[5]), __dadd_rn(part[2], part[6]),
                        __dadd_rn(part[3], part[7])};
  const double total = __dadd_rn(__dadd_rn(p4[0], p4[2]), __dadd_rn(p4[1], p4[3]));
  const float n = static_cast<float>(sqrt(total));
  const float denom = n + 1e-8f, recip = __frcp_rn(denom);
  // finite: every element finite (so is the norm); then denom is normal (>= 1e-8), its reciprocal
  // too, every quotient at most 1, and every rotated coordinate at most 16 in magnitude. A quotient
  // is normal where the element is at least denom * 2^-124 (or zero: a zero of either sign, which
  // the rotation's sums and the comparisons treat alike).
  const bool finite = denom < 0x1p100f;
  const float small = denom * 0x1p-124f;
  // normalise, rotate at distances 1, 2, 4 (within a chunk), hand over to the strided layout
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    const int c = j + 4 * s;
    if (c < chunks) {
      bool exact = !finite;
      if (tiny) {
#pragma unroll
        for (int a = 0; a < 8; ++a) exact |= fabsf(z[s][a]) < small && z[s][a] != 0.0f;
      }
      if (!exact) {
#pragma unroll
        for (int a = 0; a < 8; ++a) z[s][a] = div_by_reciprocal(z[s][a], denom, recip);
      } else {  // NaNs, infinities, elements with subnormal quotients: the division itself
#pragma unroll
        for (int a = 0; a < 8; ++a) z[s][a] = z[s][a] / denom;
      }
    } else {
#pragma unroll
      for (int a = 0; a < 8; ++a) z[s][a] = 0.0f;
    }
#pragma unroll
    for (int h = 1; h < 8; h <<= 1) {
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        if (a & h) continue;
        const float x = z[s][a], y = z[s][a + h];
        z[s][a] = x + y;
        z[s][a + h] = x - y;
      }
    }
    float4* dst = reinterpret_cast<float4*>(row + 8 * c);
    dst[0] = make_float4(z[s][0], z[s][1], z[s][2], z[s][3]);
    dst[1] = make_float4(z[s][4], z[s][5], z[s][6], z[s][7]);
  }
  __syncwarp();
  float y[kM];
#pragma unroll
  for (int m = 0; m < kM; ++m) y[m] = row[j + 4 * m];
  // distances 8 ... Dp/2: element j + 4m pairs with j + 4(m + h/4)
#pragma unroll
  for (int hm = 2; hm < kM; hm <<= 1) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      if (m & hm) continue;
      const float a = y[m], b = y[m + hm];
      y[m] = a + b;
      y[m + hm] = a - b;
    }
  }
  // codebook indices, the norm correction's sum
  double cpart[8];
  const auto indices = [&](auto any) {
    // kBatch at a time, loads before stores: the compiler keeps shared loads behind earlier shared
    // stores, so interleaving them would leave each table lookup's latency exposed
    constexpr int kBatch = 4;
#pragma unroll
    for (int m0 = 0; m0 < kM; m0 += kBatch) {
      int k[kBatch];
#pragma unroll
      for (int t = 0; t < kBatch; ++t) k[t] = codebook_lookup<decltype(any)::value>(y[m0 + t], buckets);
      if (nc) {
#pragma unroll
        for (int t = 0; t < kBatch; ++t) {
          const int r = (m0 + t) % 8;
          cpart[r] = m0 + t < 8 ? csq[k[t]] : __dadd_rn(cpart[r], csq[k[t]]);
        }
      }
#pragma unroll
      for (int t = 0; t < kBatch; ++t) idx[j + 4 * (m0 + t)] = static_cast<uint8_t>(k[t]);
    }
  };
  if (finite) {
    indices(std::false_type{});
  } else {
    indices(std::true_type{});
  }
  float scale = n;
  if (nc) {  // distances 16, 8, 4: partials r ^ 4, r ^ 2, r ^ 1 in the lane; 2, 1: lanes j ^ 2, j ^ 1
    const double q4[4] = {__dadd_rn(cpart[0], cpart[4]), __dadd_rn(cpart[1], cpart[5]),
                          __dadd_rn(cpart[2], cpart[6]), __dadd_rn(cpart[3], cpart[7])};
    double cn2 = __dadd_rn(__dadd_rn(q4[0], q4[2]), __dadd_rn(q4[1], q4[3]));
    cn2 = __dadd_rn(cn2, __shfl_xor_sync(kStreamAll, cn2, 2));
    cn2 = __dadd_rn(cn2, __shfl_xor_sync(kStreamAll, cn2, 1));
    scale = static_cast<float>(__dmul_rn(static_cast<double>(n), sqrt(static_cast<double>(kDp))) / sqrt(cn2));
  }
  __syncwarp();  // the index bytes are written; every lane's reads of the floats are done
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    const int c = j + 4 * s;
    const uint2 w = *reinterpret_cast<const uint2*>(idx + 8 * c);
    stage_indices<kBits, 2>(out + c * kBits, w.x, w.y);  // rows of Dp bits / 2 + 2 bytes
  }
  if (j == 0) codec::store_f16(out + kDp * kBits / 8, f32_to_f16_sat(scale));
}

// uint3 / uint4: min and max (order-free), then each chunk's indices packed in the lane.
// The codec's code min(max(floor(t), 0), levels) (0 for a NaN t, as its float-to-integer cast
// gives): clamping first to [0, levels + 0.5] commutes with the floor, and adding 2^23 rounding
// down floors a float in [0, 2^23) into the low bits, without the conversion instructions.
__device__ inline uint32_t uint_code(float t, float levels) {
  const float c = fminf(fmaxf(t, 0.0f), levels + 0.5f);  // (a NaN becomes 0)
  return __float_as_uint(__fadd_rd(c, 8388608.0f)) - 0x4b000000u;
}

// x0: the vector's first element as the codec converts it (its NaN bits matter here).
template <int kBits, int kS>
__device__ inline void encode_uint_stream(int d, float x0, float (&z)[kS][8], uint8_t* out, int j) {
  const int chunks = d / 8;
  // the codec starts both from x[0]
  float mn = x0, mx = x0;
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    if (j + 4 * s >= chunks) continue;
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      mn = z[s][a] < mn ? z[s][a] : mn;
      mx = z[s][a] > mx ? z[s][a] : mx;
    }
  }
#pragma unroll
  for (int o = 2; o >= 1; o >>= 1) {
    const float a = __shfl_xor_sync(kStreamAll, mn, o), b = __shfl_xor_sync(kStreamAll, mx, o);
    mn = a < mn ? a : mn;
    mx = b > mx ? b : mx;
  }
  mn = keep_first_nan(x0, mn), mx = keep_first_nan(x0, mx);
  const float levels = static_cast<float>((1 << kBits) - 1);
  const float range = (mx - mn) / levels;
  const uint16_t s16 = f32_to_f16_sat(range > 1e-8f ? range : 1e-8f);
  const uint16_t z16 = f32_to_f16_sat(keep_first_nan(x0, mn + 0.0f));  // a zero minimum as +0
  // sc: 0 (every code 0) or an fp16 number (normal as a float); with min and max below 2^99 every
  // dividend is below 2^100, so the quotients by reciprocal are exact except subnormal ones, which
  // floor to 0 after + 0.5 either way (a NaN element, skipped by min and max, gives NaN both ways)
  const float sc = f16_to_f32(s16), zr = f16_to_f32(z16), recip = sc > 0.0f ? __frcp_rn(sc) : 0.0f;
  const auto codes = [&](auto quick) {
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      const int c = j + 4 * s;
      if (c >= chunks) continue;
      uint32_t w[2] = {0, 0};
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        const float t = z[s][a] - zr;
        const float q = decltype(quick)::value ? div_by_reciprocal(t, sc, recip) : sc > 0.0f ? t / sc : -0.5f;
        w[a / 4] |= uint_code(q + 0.5f, levels) << (8 * (a % 4));
      }
      stage_indices<kBits, 4>(out + c * kBits, w[0], w[1]);  // uint4 rows: d / 2 + 4 bytes
    }
  };
  if (sc > 0.0f && fabsf(mn) < 0x1p99f && fabsf(mx) < 0x1p99f) {
    codes(std::true_type{});
  } else {
    codes(std::false_type{});
  }
  if (j == 0) {
    codec::store_f16(out + d * kBits / 8, s16);
    codec::store_f16(out + d * kBits / 8 + 2, z16);
  }
}

// fp8 / raw16: element-wise conversions of the lane's chunks, by the conversion instructions where
// they round as the codec does (finite values: to nearest even; fp8 saturated), the codec's own
// code for chunks with a NaN (whose sign it keeps) and for fp8 before sm_89.
template <Format F, int kS>
__device__ inline void encode_plain_stream(int d, float (&z)[kS][8], uint8_t* out, int j) {
  const int chunks = d / 8;
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    const int c = j + 4 * s;
    if (c >= chunks) continue;
    const float* f = z[s];
    if constexpr (F == Format::kFp8) {
      uint32_t w[2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * k], f[4 * k + 1]), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(f[4 * k + 2], f[4 * k + 3]), __NV_SATFINITE, __NV_E4M3);
        w[k] = lo | hi << 16;
      }
      constexpr uint32_t kMag = 0x7f7f7f7fu, kOne = 0x01010101u;  // a NaN code: magnitude 0x7f
      if ((((w[0] & kMag) + kOne) | ((w[1] & kMag) + kOne)) & 0x80808080u)
#endif
      {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          w[k] = f32_to_fp8(f[4 * k]) | f32_to_fp8(f[4 * k + 1]) << 8 | f32_to_fp8(f[4 * k + 2]) << 16 |
                 static_cast<uint32_t>(f32_to_fp8(f[4 * k + 3])) << 24;
        }
      }
      *reinterpret_cast<uint2*>(out + 8 * c) = make_uint2(w[0], w[1]);  // rows of d bytes, d % 8 == 0
    } else {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __half2 h = __floats2half2_rn(f[2 * k], f[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
      if (any_nan_f16x2(w[0], w[1], w[2], w[3])) {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = f32_to_f16(f[2 * k]) | static_cast<uint32_t>(f32_to_f16(f[2 * k + 1])) << 16;
      }
      *reinterpret_cast<uint4*>(out + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);  // rows of 2 d bytes
    }
  }
}

// n vectors of d elements (padded_dim(d) == 32 kS, packed rows of an even size); x, out and
// offset.data 16-byte aligned. Each warp packs groups of 8 vectors, blocks stride over the groups.
template <Format F, int kS>
__global__ void __launch_bounds__(kStreamThreads, kS == 8 ? 3 : is_mse(F) && kS == 4 ? 6 : 8) pack_stream_kernel(bool nc, DType dt, int d, const void* x,
                                                                      uint32_t n, Offset offset, uint8_t* out) {
  __shared__ StreamSmem<F, kS> sm;
  load_codebook(sm);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / kStreamLanes, j = lane % kStreamLanes;
  const int bytes = packed_size(F, d), chunks = d / 8;
  const bool tiny = dt != DType::kFloat16 || offset.data;
  const uint32_t buckets = bucket_base(sm.codebook.buckets);
  uint8_t* stage = sm.rows[warp];
  const uint32_t groups = (n + kStreamVectors - 1) / kStreamVectors;
  for (uint32_t group = blockIdx.x * kStreamWarps + warp; group < groups; group += gridDim.x * kStreamWarps) {
    const uint32_t v0 = group * kStreamVectors, v = v0 + g;
    const bool live = v < n;
    float z[kS][8];
    load_chunks<!is_mse(F) && !is_uint(F)>(dt, x, static_cast<int64_t>(v) * d, live, chunks, j, z);
    if (offset.data) {
      const float* off = offset.row_for(live ? v : 0, d);
#pragma unroll
      for (int s = 0; s < kS; ++s) {
        const int c = j + 4 * s;
        if (c >= chunks) continue;
        const float4* o4 = reinterpret_cast<const float4*>(off + 8 * c);
        const float4 a = __ldg(o4), b = __ldg(o4 + 1);
        z[s][0] -= a.x, z[s][1] -= a.y, z[s][2] -= a.z, z[s][3] -= a.w;
        z[s][4] -= b.x, z[s][5] -= b.y, z[s][6] -= b.z, z[s][7] -= b.w;
      }
    }
    uint8_t* row_out = stage + g * bytes;
    if constexpr (is_mse(F)) {
      float* row = reinterpret_cast<float*>(stage) + g * StreamSmem<F, kS>::kRowFloats;
      encode_mse_stream<format_bits(F), kS>(d, nc, tiny, z, row, sm.idx[warp][g], row_out, buckets, sm.codebook.csq, j);
    } else if constexpr (is_uint(F)) {
      // the first element as the codec converts it (a NaN's bits matter to min and max)
      float x0 = live ? load_float(dt, x, static_cast<int64_t>(v) * d) : 0.0f;
      if (live && offset.data) x0 -= offset.row_for(v, d)[0];
      encode_uint_stream<format_bits(F), kS>(d, x0, z, row_out, j);
    } else {
      encode_plain_stream<F, kS>(d, z, row_out, j);
    }
    __syncwarp();
    // the warp's rows are contiguous in out and start 16-byte aligned (8 rows of an even size)
    const uint32_t rows = n - v0 < kStreamVectors ? n - v0 : kStreamVectors;
    const int total = static_cast<int>(rows) * bytes;
    uint8_t* dst = out + static_cast<int64_t>(v0) * bytes;
    for (int o = 16 * lane; o + 16 <= total; o += 16 * 32) {
      __stcs(reinterpret_cast<uint4*>(dst + o), *reinterpret_cast<const uint4*>(stage + o));
    }
    const int o = (total & ~15) + 2 * lane;
    if (o < total) *reinterpret_cast<uint16_t*>(dst + o) = *reinterpret_cast<const uint16_t*>(stage + o);
    __syncwarp();  // the rows are read before the next group writes them
  }
}

}  // namespace turboquant::cuda::detail
