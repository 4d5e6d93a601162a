// TQPack for throughput (and a first prompt's tokens into the present caches): four lanes per vector,
// eight vectors per warp, byte-identical to the CPU codec (vector_codec.h) like the one-warp-per-vector
// packing of pack_warp_per_vector.cuh, which stays for the few new tokens of a decode step (latency)
// and the head sizes below 64.
//
// Why this layout: the codec fixes the order of every rounding, and two orders matter.
//  - The norm's sum of squares: 32 partial sums (term i goes to partial i % 32, ascending), then a
//    butterfly at distances 1, 2, 4, 8, 16.
//  - The rotation: butterflies at distance 1, 2, 4, ... Dp/2, in that order.
// A vector is read as chunks of 8 elements (16 bytes of fp16): lane j of the vector's four holds
// chunks j, j + 4, j + 8, ... ("chunk layout"), so element i = 8j + a + 32s sits in lane j at
// (s, a): the lane holds the partial sums 8j .. 8j + 7 whole, the sums' butterfly at distances 1, 2,
// 4 stays within the lane and 8, 16 are the two lane bits (shuffles); the rotation's distances 1, 2,
// 4 are within the lane too. The vector then goes through shared memory to the "pair layout" (lane
// j holds the pairs i = 8m + 2j + a, a = 0, 1), where the distances 8 ... Dp/2 are within the lane,
// and so are both codes of a 4-bit index byte. The norm correction's sum is an integer sum
// (order-free), carried in the same word as the code the bucket table hands out. A warp's eight
// packed rows (contiguous in the output) leave in 16-byte stores.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "pack_warp_per_vector.cuh"
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

// Bytes of a staged packed row, at most (head size d <= Dp).
template <Format F>
constexpr int stage_row_bytes(int dp) {
  return F == Format::kRaw16 ? 2 * dp : F == Format::kFp8 ? dp : is_mse(F) ? dp * format_bits(F) / 8 + 2 : dp * format_bits(F) / 8 + 4;
}

// The codebook search: buckets of width 1/8 centred on j/8, j in [-24, 24], which hold the
// coordinates clamped to +-3 (beyond every boundary, so the codes do not change; a NaN goes to
// -3, whose bucket counts no boundary and whose comparison fails, so a NaN gets 0 as in the codec).
// Bucket j holds the values that round to j/8 (ties either way: [j/8 - 1/16, j/8 + 1/16]); its
// entry is the first boundary at or above its start (NaN: none) and the code of its start. When a
// bucket holds at most that one boundary (checked below at compile time: the closest boundaries
// are 0.258 apart for 4 bits, 0.5 for 3), one comparison picks the code: the entry's, or (z at or
// above the boundary) the next bucket's, loaded only then. The bucket is worked out in two
// multiply-adds whose roundings can move a coordinate by 2^-16 of a bucket; no boundary lies that
// close to a bucket's edge (checked below), so a coordinate that lands in the neighbouring bucket
// still gets its code.
// A code word: the index k in bits 0-3, codec::centroid_square_q(k) from bit kCsqShift; summing a
// lane's words sums its centroid squares above bit kCsqShift, below which the indices' sum stays.
// In shared memory the boundaries and the words are two tables of kCopies copies, entry by entry,
// lane l reading copy l % kCopies. With 32 copies a warp's lookups in either table hit 32 different
// banks, one wavefront each. (An earlier layout, 16 copies of 8-byte {boundary, word} entries, took
// 2 wavefronts for the pair and 2 more for the next bucket's word, whose lanes l and l + 16 shared
// a bank.) Head size 256 keeps 16 copies (two-way conflicts), as 32 do not fit the 48 KB of static
// shared memory beside its rows.
constexpr int kBucketHalf = 24;
constexpr int kBuckets = 2 * kBucketHalf + 1;
constexpr int bucket_copies(int ks) { return ks == 8 ? 16 : 32; }
constexpr float kClamp = kBucketHalf / 8.0f;
constexpr int kCsqShift = 10;

struct alignas(16) CodebookTables {
  float next[kBuckets];          // the first boundary >= the bucket's start, or NaN
  uint32_t word[kBuckets + 1];   // the code word of the boundaries below the bucket's start (+ 1: a
                                 // last bucket's successor, never read)
};

// The copies in shared memory: [bucket][copy].
template <int kCopies>
struct alignas(16) SharedBuckets {
  static constexpr int kStride = sizeof(float) * kCopies;  // bytes from a bucket to the next
  static constexpr int kWordOffset = kStride * kBuckets;   // bytes from the boundaries to the words
  float next[kBuckets][kCopies];
  uint32_t word[kBuckets + 1][kCopies];
};

template <int kBits>
constexpr uint32_t code_word(int k) {
  const double* c = kBits == 3 ? codebook::kCentroids3 : codebook::kCentroids4;
  return static_cast<uint32_t>(codec::quantized_square(c[k])) << kCsqShift | static_cast<uint32_t>(k);
}

template <int kBits>
constexpr CodebookTables make_codebook_tables() {
  constexpr int kBounds = (1 << kBits) - 1;
  const float* b = kBits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4;
  CodebookTables t{};
  for (int i = 0; i <= kBuckets; ++i) {
    const float lo = (i - kBucketHalf - 0.5f) / 8.0f;
    int k = 0;
    while (k < kBounds && b[k] < lo) ++k;
    if (i < kBuckets) t.next[i] = k < kBounds ? b[k] : std::numeric_limits<float>::quiet_NaN();
    t.word[i] = code_word<kBits>(k);
  }
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
// Whether every boundary lies at least 2^-9 of a bucket from the buckets' edges.
template <int kBits>
constexpr bool boundaries_off_edges() {
  const float* b = kBits == 3 ? codebook::kBoundaries3 : codebook::kBoundaries4;
  for (int k = 0; k < (1 << kBits) - 1; ++k) {
    const double x = 8.0 * b[k] + kBucketHalf + 0.5;  // edges at whole numbers
    const double frac = x - static_cast<double>(static_cast<long long>(x));
    if (frac < 0x1p-9 || frac > 1.0 - 0x1p-9) return false;
  }
  return true;
}
static_assert(boundaries_off_edges<3>() && boundaries_off_edges<4>(), "a boundary lies at a bucket's edge");
static_assert(-kClamp < codebook::kBoundaries4[0] && codebook::kBoundaries4[14] < kClamp && -kClamp < codebook::kBoundaries3[0] &&
                  codebook::kBoundaries3[6] < kClamp,
              "the clamp cuts a boundary off");
// A lane sums up to 64 code words (Dp = 256): the indices' sum stays below bit kCsqShift and the
// centroid squares' below bit 32.
static_assert(64 * 15 < (1 << kCsqShift) && 64 * (code_word<4>(0) >> kCsqShift) < (1u << (32 - kCsqShift)) &&
                  64 * (code_word<3>(0) >> kCsqShift) < (1u << (32 - kCsqShift)),
              "a lane's code words overflow");

__device__ const CodebookTables kCodebookTables3 = make_codebook_tables<3>();
__device__ const CodebookTables kCodebookTables4 = make_codebook_tables<4>();

// Shared memory of a block, for vectors of padded size Dp = 32 * kS (kS chunks per lane).
template <Format F, int kS>
struct __align__(16) StreamSmem {
  static constexpr int kDp = 32 * kS;
  // MSE: a warp's eight vectors as floats (rows of Dp + 8: the pair layout's 8-byte reads of the
  // eight rows fall on different banks), then its staged packed rows
  static constexpr int kRowFloats = kDp + 8;
  static constexpr int kFloatBytes = is_mse(F) ? kStreamVectors * kRowFloats * 4 : 0;
  static constexpr int kWarpBytes = kFloatBytes + (kStreamVectors * stage_row_bytes<F>(kDp) + 15) / 16 * 16;
  alignas(16) uint8_t rows[kStreamWarps][kWarpBytes];
  static constexpr int kCopies = bucket_copies(kS);
  SharedBuckets<kCopies> codebook;  // MSE formats
};

// Copies the codebook tables of F (MSE formats) for the block; syncs it.
template <Format F, int kS>
__device__ inline void load_codebook(StreamSmem<F, kS>& sm) {
  if constexpr (is_mse(F)) {
    const CodebookTables& src = format_bits(F) == 3 ? kCodebookTables3 : kCodebookTables4;
    constexpr int kCopies = StreamSmem<F, kS>::kCopies;
    for (int i = threadIdx.x; i < (kBuckets + 1) * kCopies; i += blockDim.x) {
      if (i < kBuckets * kCopies) sm.codebook.next[i / kCopies][i % kCopies] = src.next[i / kCopies];
      sm.codebook.word[i / kCopies][i % kCopies] = src.word[i / kCopies];
    }
    __syncthreads();
  }
}

__device__ inline uint32_t shared_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// The bucket of z: t = saturate(z / 6 + 1/2) maps [-3, 3] onto [0, 1] (and a NaN to 0), and adding
// 1.5 * 2^23 (whose float spacing is 1) to 48 t rounds it to the bucket, the difference of the bit
// patterns. kRoundBits buckets come off the table's shared address once, so a lookup is two
// multiply-adds and one shift-add of addresses (32-bit, wrapping).
constexpr float kRound = 12582912.0f;
constexpr uint32_t kRoundBits = 0x4b400000u;

// The shared address that this lane's bucket lookups of the bit pattern of the rounded bucket
// start from. (Passed through a shuffle so that the compiler cannot split the constant back out.)
template <int kCopies>
__device__ inline uint32_t bucket_base(const SharedBuckets<kCopies>& t) {
  static_assert(offsetof(SharedBuckets<kCopies>, word) == SharedBuckets<kCopies>::kWordOffset, "the words follow the boundaries");
  const int lane = threadIdx.x & 31;
  const uint32_t base = shared_address(&t.next[0][0]) - kRoundBits * SharedBuckets<kCopies>::kStride;
  return __shfl_sync(kStreamAll, base, 0) + static_cast<uint32_t>(lane % kCopies) * sizeof(float);
}

// The code word of z (codec::codebook_index: the number of boundaries <= z, and its centroid
// square) through the buckets, for any z: the bucket's boundary, then the word of the bucket or
// (z at or above the boundary) of the next one. The loads are not volatile, so that the compiler
// may issue those of several elements ahead of their uses: the tables are written once, before the
// block's first __syncthreads, and every address comes from bucket_base, which follows it.
template <int kCopies>
__device__ inline uint32_t code_word_of(float z, uint32_t base) {
  using Table = SharedBuckets<kCopies>;
  constexpr int kShift = kCopies == 32 ? 7 : 6;
  static_assert(Table::kStride == 1 << kShift, "a lookup shifts the bucket by kShift");
  const float t = __saturatef(__fmaf_rn(z, 1.0f / (2 * kClamp), 0.5f));
  const float bucket = __fmaf_rn(t, static_cast<float>(kBuckets - 1), kRound);
  const uint32_t at = base + (__float_as_uint(bucket) << kShift);
  float next;
  uint32_t word;
  asm("ld.shared.f32 %0, [%1];" : "=f"(next) : "r"(at));
  const uint32_t word_at = next <= z ? at + Table::kStride : at;
  asm("ld.shared.b32 %0, [%1+%2];" : "=r"(word) : "r"(word_at), "n"(Table::kWordOffset));
  return word;
}

// fp16 words: whether any of their halves is a NaN ((h & 0x7fff) > 0x7c00, i.e. + 0x3ff carries
// into bit 15; the halves cannot carry into each other).
__device__ inline bool any_nan_f16x2(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  constexpr uint32_t kMag = 0x7fff7fffu, kUp = 0x03ff03ffu;
  return ((((a & kMag) + kUp) | ((b & kMag) + kUp) | ((c & kMag) + kUp) | ((d & kMag) + kUp)) & 0x80008000u) != 0;
}

// fp16 bits -> floats through the conversion instruction (a NaN may come back canonical: every
// NaN a pack stores is the codec's one NaN, whatever the input NaN's sign or payload).
__device__ inline void f16_chunk(const uint4& u, float (&o)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[k]));
    o[2 * k] = f.x, o[2 * k + 1] = f.y;
  }
}

// Chunks of fp16 or bf16 (dt) as floats.
template <int kS>
__device__ inline void convert_chunks(DType dt, const uint4 (&u)[kS], float (&z)[kS][8]) {
  if (dt == DType::kBFloat16) {
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      const uint32_t w[4] = {u[s].x, u[s].y, u[s].z, u[s].w};
#pragma unroll
      for (int k = 0; k < 4; ++k) z[s][2 * k] = __uint_as_float(w[k] << 16), z[s][2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int s = 0; s < kS; ++s) f16_chunk(u[s], z[s]);
  }
}

// The lane's chunks j, j + 4, ... of the vector starting at element e of x (16-byte aligned), of
// which the first `chunks` exist; the others are zeros. One branch on the type per vector, and for
// 16-bit types one on whether every chunk exists (the padded size: no predicates, no zeros).
template <int kS>
__device__ inline void load_chunks(DType dt, const void* x, int64_t e, int chunks, int j, float (&z)[kS][8]) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  if (dt == DType::kFloat32) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const float*>(x) + e);
#pragma unroll
    for (int s = 0; s < kS; ++s) {
      const int c = j + 4 * s;
      const bool ok = c < chunks;
      const uint4 a = ok ? __ldcs(p + 2 * c) : zero, b = ok ? __ldcs(p + 2 * c + 1) : zero;
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) z[s][k] = __uint_as_float(w[k]);
    }
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + e) + j;
  uint4 u[kS];
  if (chunks == 4 * kS) {
#pragma unroll
    for (int s = 0; s < kS; ++s) u[s] = __ldcs(p + 4 * s);
  } else {
#pragma unroll
    for (int s = 0; s < kS; ++s) u[s] = j + 4 * s < chunks ? __ldcs(p + 4 * s) : zero;
  }
  convert_chunks(dt, u, z);
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

// f32_to_f16_sat by the conversion instruction (which rounds to nearest even, as it does), the codec's
// one NaN for a NaN.
__device__ inline uint16_t f16_sat_bits(float f) {
  if (f != f) return f32_to_f16(f);
  return __half_as_ushort(__float2half_rn(fminf(fmaxf(f, -kFp16Max), kFp16Max)));
}

// MSE formats. z: the lane's chunks (chunk layout), offset removed; row: the vector's floats in
// shared memory (then mse3's scratch); out: its staged packed row; j: the lane within the
// vector; fused: whether the squares may be fused into the sums (exact squares: fp16 without an
// offset, whose squares are normal floats of at most 22 significant bits).
template <int kBits, int kS>
__device__ inline void encode_mse_stream(int d, bool nc, bool fused, float (&z)[kS][8], float* row, uint8_t* out, uint32_t buckets, int j) {
  constexpr int kDp = 32 * kS, kM = 4 * kS, kCopies = bucket_copies(kS);
  const int chunks = d / 8;
  // the norm: the lane holds partials 8 j + a whole; the butterfly's distances 1, 2, 4 in the
  // lane, then 8 and 16 across lanes j ^ 1 and j ^ 2
  float part[8];
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    part[a] = 0.0f;
    if (fused) {
#pragma unroll
      for (int s = 0; s < kS; ++s) part[a] = __fmaf_rn(z[s][a], z[s][a], part[a]);
    } else {
#pragma unroll
      for (int s = 0; s < kS; ++s) part[a] = __fadd_rn(part[a], __fmul_rn(z[s][a], z[s][a]));
    }
  }
  float total = __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                          __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
  total = __fadd_rn(total, __shfl_xor_sync(kStreamAll, total, 1));
  total = __fadd_rn(total, __shfl_xor_sync(kStreamAll, total, 2));
  const float n = __fsqrt_rn(total);
  const float r = __frcp_rn(__fadd_rn(n, 1e-8f));  // codec::norm_reciprocal
  // normalise, rotate at distances 1, 2, 4 (within a chunk), hand over to the pair layout. The
  // rows of odd vectors hold each chunk's halves swapped: with rows of Dp + 8 floats, both the
  // chunk layout's 16-byte stores and the pair layout's 8-byte loads then hit different banks.
  const int flip = (threadIdx.x >> 2) & 1;  // the vector's parity
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    const int c = j + 4 * s;
    const float rc = c < chunks ? r : 0.0f;  // the padding's chunks: zeros, kept so for a NaN r
#pragma unroll
    for (int a = 0; a < 8; ++a) z[s][a] = __fmul_rn(z[s][a], rc);
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
    *reinterpret_cast<float4*>(row + 8 * c + 4 * flip) = make_float4(z[s][0], z[s][1], z[s][2], z[s][3]);
    *reinterpret_cast<float4*>(row + 8 * c + 4 * (flip ^ 1)) = make_float4(z[s][4], z[s][5], z[s][6], z[s][7]);
  }
  __syncwarp();
  float2 y[kM];
  const float* pairs = row + 4 * ((j >> 1) ^ flip) + 2 * (j & 1);
#pragma unroll
  for (int m = 0; m < kM; ++m) y[m] = *reinterpret_cast<const float2*>(pairs + 8 * m);
  // distances 8 ... Dp/2: pair m pairs with m + h/8
#pragma unroll
  for (int hm = 1; hm < kM; hm <<= 1) {
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      if (m & hm) continue;
      const float2 a = y[m], b = y[m + hm];
      y[m] = make_float2(a.x + b.x, a.y + b.y);
      y[m + hm] = make_float2(a.x - b.x, a.y - b.y);
    }
  }
  // code words: the index bytes (4 bits: the pair's byte; 3 bits: the pair's 6 bits, combined
  // below) and the centroid squares' sum. Every lookup before any store: the compiler keeps shared
  // loads behind earlier shared stores, which would leave each lookup's latency exposed.
  uint32_t sum = 0, bytes[kM];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    const uint32_t w0 = code_word_of<kCopies>(y[m].x, buckets), w1 = code_word_of<kCopies>(y[m].y, buckets);
    sum += w0 + w1;
    // the codes sit in bits 0-3 with zeros above up to kCsqShift, so the byte is the sum's
    bytes[m] = w0 + (w1 << (kBits == 4 ? 4 : 3));
  }
  if constexpr (kBits == 3) {  // group m's 24 bits: lane j's 6 at bit 6 j; lane j writes groups j + 4 t
    // each code pair's 6 bits as a byte, 4 per group, in the vector's row (its floats are read):
    // rows start on banks 8 g (mod 32), and vectors 4-7 start 4 words further, so the eight
    // vectors' bytes fall on different banks, and their words too
    uint8_t* fields = reinterpret_cast<uint8_t*>(row) + 16 * ((threadIdx.x >> 4) & 1);
    static_assert((kDp + 8) % 32 == 8, "the rows start on banks 8 g");
    __syncwarp();
#pragma unroll
    for (int m = 0; m < kM; ++m) fields[4 * m + j] = static_cast<uint8_t>(bytes[m]);
    __syncwarp();
#pragma unroll
    for (int t = 0; t < kS; ++t) {
      const int m = j + 4 * t;
      const uint32_t x = *reinterpret_cast<const uint32_t*>(fields + 4 * m);  // byte l: lane l's field
      // w = f0 | f1 << 6 | f2 << 12 | f3 << 18 from x = f0 | f1 << 8 | f2 << 16 | f3 << 24 (fields
      // below 64): f1 and f3 moved down by 2 bits (x - 192 (f1 + f3 << 16)), then f2 f3 by 4
      const uint32_t y = x - 192u * __byte_perm(x, 0, 0x4341);
      const uint32_t w = y - (y >> 16) * 0xf000u;
      out[3 * m] = static_cast<uint8_t>(w), out[3 * m + 1] = static_cast<uint8_t>(w >> 8), out[3 * m + 2] = static_cast<uint8_t>(w >> 16);
    }
  } else {
#pragma unroll
    for (int m = 0; m < kM; ++m) out[4 * m + j] = static_cast<uint8_t>(bytes[m]);
  }
  float scale = n;
  if (nc) {
    int32_t cq = static_cast<int32_t>(sum >> kCsqShift);
    cq += __shfl_xor_sync(kStreamAll, cq, 1);
    cq += __shfl_xor_sync(kStreamAll, cq, 2);
    scale = codec::corrected_scale(n, kDp, cq);
  }
  if (j == 0) codec::store_f16(out + kDp * kBits / 8, f16_sat_bits(scale));
}

// uint3 / uint4: min and max (order-free), then each chunk's indices packed in the lane.
// x0: the vector's first element, where the codec's min and max start.
template <int kBits, int kS>
__device__ inline void encode_uint_stream(int d, float x0, float (&z)[kS][8], uint8_t* out, int j) {
  const int chunks = d / 8;
  // the codec starts both from x[0]
  float mn = x0, mx = x0;
  bool nan = false;
#pragma unroll
  for (int s = 0; s < kS; ++s) {
    if (j + 4 * s >= chunks) continue;
#pragma unroll
    for (int a = 0; a < 8; ++a) {
      mn = z[s][a] < mn ? z[s][a] : mn;
      mx = z[s][a] > mx ? z[s][a] : mx;
      nan = nan || z[s][a] != z[s][a];
    }
  }
#pragma unroll
  for (int o = 2; o >= 1; o >>= 1) {
    const float a = __shfl_xor_sync(kStreamAll, mn, o), b = __shfl_xor_sync(kStreamAll, mx, o);
    mn = a < mn ? a : mn;
    mx = b > mx ? b : mx;
    const int other_nan = __shfl_xor_sync(kStreamAll, static_cast<int>(nan), o);  // every lane shuffles
    nan = nan || other_nan != 0;
  }
  const float levels = static_cast<float>((1 << kBits) - 1);
  const float range = (mx - mn) / levels;
  // a vector with a NaN: codec::kUintNanBits for both, and every code 0 (sc > 0 fails below)
  const uint16_t s16 = nan ? codec::kUintNanBits : f32_to_f16_sat(range > 1e-8f ? range : 1e-8f);
  const uint16_t z16 = nan ? codec::kUintNanBits : f32_to_f16_sat(mn + 0.0f);  // a zero minimum as +0
  // sc: 0 or NaN (every code 0) or an fp16 number (normal as a float); with min and max below 2^99
  // every dividend is below 2^100, so the quotients by reciprocal are exact except subnormal ones,
  // which floor to 0 after + 0.5 either way
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
// code for chunks with a NaN (its one NaN) and for fp8 before sm_89.
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

// Blocks an SM holds at least (the register budget) for the MSE formats at head size 128, measured
// the fastest of the pack probe's sweep on the H200 (docs/performance.md): mse4 7, 6 and 5 slower;
// mse3 7, as many as its shared memory allows, fewer slower again (a grid of one wave of blocks
// gained nothing at any count). TQ_STREAM_BLOCKS_MSE3 / _MSE4 override them for timing
// (scripts/build_probe.sh PACK_VARIANTS).
#ifndef TQ_STREAM_BLOCKS_MSE3
#define TQ_STREAM_BLOCKS_MSE3 7
#endif
#ifndef TQ_STREAM_BLOCKS_MSE4
#define TQ_STREAM_BLOCKS_MSE4 7
#endif
constexpr int stream_blocks(Format f, int ks) {
  return ks == 8 ? 3 : ks == 4 && f == Format::kMse4 ? TQ_STREAM_BLOCKS_MSE4 : ks == 4 && f == Format::kMse3 ? TQ_STREAM_BLOCKS_MSE3 : 8;
}

// n vectors of d elements (padded_dim(d) == 32 kS, packed rows of an even size); x, out and
// offset.data 16-byte aligned. Each warp packs groups of 8 vectors, blocks stride over the groups.
// kPresent: the vectors and rows of map (a call's new tokens into the present cache, rows of
// map.rows.row_bytes, even, after each sequence's past; input strides of whole 16-byte chunks),
// each row written by its vector's four lanes; else TQPack's (x[v d ..], out[v bytes ..]), a warp's
// eight rows written as one contiguous run.
template <Format F, int kS, bool kPresent = false>
__global__ void __launch_bounds__(kStreamThreads, stream_blocks(F, kS))
    pack_stream_kernel(bool nc, DType dt, int d, const void* x, uint32_t n, Offset offset, uint8_t* out, VectorMap map) {
  __shared__ StreamSmem<F, kS> sm;
  load_codebook(sm);
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane / kStreamLanes, j = lane % kStreamLanes;
  const int bytes = packed_size(F, d), chunks = d / 8;
  const bool fused = dt == DType::kFloat16 && !offset.data;  // exact squares
  const uint32_t buckets = bucket_base(sm.codebook);
  uint8_t* stage = sm.rows[warp] + StreamSmem<F, kS>::kFloatBytes;
  const uint32_t groups = (n + kStreamVectors - 1) / kStreamVectors;
  for (uint32_t group = blockIdx.x * kStreamWarps + warp; group < groups; group += gridDim.x * kStreamWarps) {
    const uint32_t v0 = group * kStreamVectors, v = v0 + g;
    const bool live = v < n;
    // (a vector past the end packs the last one's elements: its row is not written out)
    const uint32_t u = live ? v : n - 1;
    const uint32_t offset_row = offset.data ? static_cast<uint32_t>((u / offset.period) % offset.rows) : 0u;
    const VectorMap::Where at = kPresent ? map.locate(u, d, bytes, offset)
                                         : VectorMap::Where{static_cast<int64_t>(u) * d, 0, offset_row, true};
    float z[kS][8];
    load_chunks(dt, x, at.in, chunks, j, z);
    if (offset.data) {
      const float* off = offset.data + static_cast<int64_t>(at.offset_row) * d;
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
      float* row = reinterpret_cast<float*>(sm.rows[warp]) + g * StreamSmem<F, kS>::kRowFloats;
      encode_mse_stream<format_bits(F), kS>(d, nc, fused, z, row, row_out, buckets, j);
    } else if constexpr (is_uint(F)) {
      // the first element, where the codec's min and max start
      float x0 = live ? load_float(dt, x, at.in) : 0.0f;
      if (live && offset.data) x0 -= offset.data[static_cast<int64_t>(at.offset_row) * d];
      encode_uint_stream<format_bits(F), kS>(d, x0, z, row_out, j);
    } else {
      encode_plain_stream<F, kS>(d, z, row_out, j);
    }
    __syncwarp();
    if constexpr (kPresent) {
      // rows at any even offset: words where the row and its size allow, else half-words
      if (live && at.inside) {
        uint8_t* dst = out + at.out;
        if (((reinterpret_cast<uintptr_t>(dst) | static_cast<uintptr_t>(bytes)) & 3) == 0) {
          for (int o = 4 * j; o < bytes; o += 4 * kStreamLanes) {
            __stcs(reinterpret_cast<uint32_t*>(dst + o), *reinterpret_cast<const uint32_t*>(row_out + o));
          }
        } else {
          for (int o = 2 * j; o < bytes; o += 2 * kStreamLanes) {
            *reinterpret_cast<uint16_t*>(dst + o) = *reinterpret_cast<const uint16_t*>(row_out + o);
          }
        }
      }
    } else {
      // the warp's rows are contiguous in out and start 16-byte aligned (8 rows of an even size)
      const uint32_t rows = n - v0 < kStreamVectors ? n - v0 : kStreamVectors;
      const int total = static_cast<int>(rows) * bytes;
      uint8_t* dst = out + static_cast<int64_t>(v0) * bytes;
      for (int o = 16 * lane; o + 16 <= total; o += 16 * 32) {
        __stcs(reinterpret_cast<uint4*>(dst + o), *reinterpret_cast<const uint4*>(stage + o));
      }
      const int o = (total & ~15) + 2 * lane;
      if (o < total) *reinterpret_cast<uint16_t*>(dst + o) = *reinterpret_cast<const uint16_t*>(stage + o);
    }
    __syncwarp();  // the rows are read before the next group writes them
  }
}

// Whether the four-lane kernel takes job (padded head size 64, 128 or 256, rows of an even size,
// 16-byte aligned input and offsets; TQPack's output 16-byte aligned, a present map's rows at even
// offsets and its input strides whole 16-byte chunks; no fused rotary).
bool stream_pack_supported(const PackJob& job, DType dt);
// Launches it (stream_pack_supported first).
cudaError_t launch_stream_pack(const PackJob& job, bool nc, DType dt, cudaStream_t stream);

}  // namespace turboquant::cuda::detail
