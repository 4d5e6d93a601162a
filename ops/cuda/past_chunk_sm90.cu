// A continuation chunk's query rows over the packed past on Hopper's warpgroup products (wgmma,
// sm_90a code alone; plan kTensorCoreChunkWgmma): past_chunk.cu's contract (MSE 4- or 3-bit keys,
// uint4 or uint3 values) in caches whose (b, head) regions of rows start at 16-byte boundaries. A
// block takes 128 of a KV head's chunk rows (its query heads at consecutive positions) and one
// split of the past, in three warpgroups:
// - a producer: one thread copies each tile's 128 packed rows of K and of V into shared memory (bulk
//   copies, three tiles ahead, an mbarrier each); then each of the warpgroup's threads decodes one
//   token into the 16-bit tiles the products read (128-byte swizzle, two buffers of keys and two of
//   values): a chunk's 8 codes as the nibbles of a word (3-bit codes spread into them), keys as
//   centroid x scale / sqrt(D), the token's 16 (or 8) values looked up by byte permutes from
//   registers (a table in shared memory would take the bandwidth the products need), values as
//   code x scale + zero;
// - two consumers of 64 rows each, as prefill_sm90.cu's (wgmma_flash.cuh): S = Q K^T from shared
//   memory, the online softmax in registers, O += P V, taking turns at the tensor cores.
// The block first rotates its query rows (chunk_queries.cuh: MSE keys are scored in the rotated
// domain), and writes the split kernels' partial results, which the finish kernel merges with the
// new tokens' part (prefill.cu). The scales are folded into the tiles, where past_chunk.cu applies
// them to the scores and weights in fp32: each key element is centroid x scale rounded once to 16
// bits (an fp16 cache's rounding); each value is code x scale + zero in one fused operation on the
// scale and zero rounded to 16 bits (for bf16 about twice the error of rounding the value alone).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "chunk_queries.cuh"
#include "split_common.cuh"
#include "split_geometry.h"
#include "turboquant/vector_codec.h"
#include "wgmma_flash.cuh"

namespace turboquant::cuda::detail {
namespace {

namespace geo = chunk_sm90_geometry;
constexpr int kConsumers = 2;                     // consumer warpgroups, 64 rows each
constexpr int kThreads = 128 * (kConsumers + 1);  // and the producer's
constexpr int kRows = geo::kRows, kKeys = geo::kKeys, kStages = geo::kStages, kRawStages = geo::kRawStages;
static_assert(kRows == 64 * kConsumers && kKeys == wgmma_flash::kKeys && kKeys == 128,
              "a consumer's product has 64 rows; a producer thread decodes one token of a tile");
// The registers each warpgroup keeps (setmaxnreg): the producer's decoding needs under 56 (ptxas
// fits its code to the count), the consumers take what it gives back. A raise waits until the
// block's pool holds the registers, so the counts must fit what the block was launched with (168
// per thread at 384 threads), or the consumers wait forever.
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(kConsumers * kConsumerRegs + kProducerRegs <= (kConsumers + 1) * kLaunchRegs,
              "the consumers' registers come from what the producer gives back");

// Byte offset of 16-byte chunk c (elements 8c..8c+7) of row r in a 128-byte-swizzled tile of `rows`
// rows: column atoms of 64 elements (wgmma.cuh).
__device__ __forceinline__ uint32_t swizzled(int rows, int r, int c) {
  return static_cast<uint32_t>((c / 8) * rows * 128 + r * 128 + (((c % 8) ^ (r % 8)) * 16));
}

template <typename T2>
__device__ __forceinline__ T2 as_pair(uint32_t u) {
  T2 x;
  memcpy(&x, &u, 4);
  return x;
}
template <typename T2>
__device__ __forceinline__ uint32_t as_word(T2 x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
}

// Centroid k of the KB-bit codebook as a float constant (k known when the loops are unrolled), so the
// products with a token's scale take immediates rather than registers or constant-memory doubles.
template <int KB>
__device__ constexpr float centroid(int k) {
  constexpr float c4[16] = {TQ_CENTROIDS4};
  constexpr float c3[8] = {TQ_CENTROIDS3};
  return KB == 4 ? c4[k] : c3[k];
}

// The 16-bit type's pairs, as 32-bit words.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using T2 = __half2;
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024 in each half; | code (< 16): 1024 + code exactly
  static __device__ __forceinline__ uint16_t bits(float x) { return __half_as_ushort(__float2half_rn(x)); }
  static __device__ __forceinline__ uint32_t bits2(float x, float y) { return as_word(__floats2half2_rn(x, y)); }
};
template <>
struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static constexpr uint32_t kMagic = 0x43004300u;  // 128 in each half; | code (< 16): 128 + code exactly
  static __device__ __forceinline__ uint16_t bits(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  static __device__ __forceinline__ uint32_t bits2(float x, float y) { return as_word(__floats2bfloat162_rn(x, y)); }
};

// The 8 codes of chunk c (elements 8c..8c+7) of a row's code bytes, kBits each (little-endian: chunk c
// is bytes [c kBits, (c + 1) kBits)), as the nibbles of a word, code k in nibble k. row: 4-byte
// aligned.
template <int kBits>
__device__ __forceinline__ uint32_t chunk_codes(const uint8_t* row, int c) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(row);
  if constexpr (kBits == 4) {
    return w[c];
  } else {
    const int a = 3 * c / 4, o = 3 * c % 4;  // the chunk's 24 bits start at byte o of word a
    const uint32_t x = o <= 1 ? w[a] >> (8 * o) : __funnelshift_r(w[a], w[a + 1], 8 * o);
    // codes 0-3 (bits 0-11) and 4-7 (bits 12-23) into the two 16-bit lanes, then each lane's four
    // 3-bit fields into nibbles
    const uint32_t y = (x & 0xFFFFu) | ((x << 4) & 0xFFFF0000u);
    return (y & 0x00070007u) | ((y << 1) & 0x00700070u) | ((y << 2) & 0x07000700u) | ((y << 3) & 0x70007000u);
  }
}

// Eight key elements from their codes' nibbles (code k in nibble k of z) as four words of element
// pairs (0, 1) .. (6, 7): lo / hi, the token's 2^kBits values' low and high bytes, four to a word.
template <int kBits>
__device__ __forceinline__ void lookup8(uint32_t z, const uint32_t (&lo)[kBits == 4 ? 4 : 2],
                                        const uint32_t (&hi)[kBits == 4 ? 4 : 2], uint32_t (&e)[4]) {
  uint32_t l[2], h[2];
  if constexpr (kBits == 4) {
    const uint32_t sel = z & 0x77777777u;  // each code's index in its half of the table (prmt reads 4 at a time)
    // byte k all ones where code k (of 0-3, then of 4-7) is 8 or more: the sign of the byte holding its bit 3
    const uint32_t shifted = z << 4;
    const uint32_t upper[2] = {prmt(shifted, z, 0xD9C8u), prmt(shifted, z, 0xFBEAu)};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t x = half ? sel >> 16 : sel, u = upper[half];
      l[half] = (prmt(lo[0], lo[1], x) & ~u) | (prmt(lo[2], lo[3], x) & u);
      h[half] = (prmt(hi[0], hi[1], x) & ~u) | (prmt(hi[2], hi[3], x) & u);
    }
  } else {  // 8 values: every nibble an index
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t x = half ? z >> 16 : z;
      l[half] = prmt(lo[0], lo[1], x), h[half] = prmt(hi[0], hi[1], x);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    e[2 * half] = prmt(l[half], h[half], 0x5140u);  // element 0's low and high byte, then element 1's
    e[2 * half + 1] = prmt(l[half], h[half], 0x7362u);
  }
}

template <int D, int KB, int VB, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    past_chunk_sm90_kernel(AttentionParams p, Layout l, const T* q, const uint8_t* past_key, const uint8_t* past_value,
                           float* partial, bool q_vectors) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T2 = typename Pair<T>::T2;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_s = smem_u32(smem_raw);
  const uint32_t q_at = (raw_s + 1023u) & ~1023u;  // the swizzle repeats every 1024 bytes
  uint8_t* const base = smem_raw + (q_at - raw_s);  // q_at as a generic pointer
  constexpr uint32_t kQBytes = kRows * D * 2, kTileBytes = kKeys * D * 2;
  const uint32_t k_off = kQBytes, v_off = k_off + kStages * kTileBytes, packed_off = v_off + kStages * kTileBytes;
  const int64_t kb = p.key_row(), vb = p.value_row();
  const uint32_t packed_bytes = static_cast<uint32_t>(geo::raw_stage_bytes(static_cast<int>(kb), static_cast<int>(vb)));
  // the decoded buffers' mbarriers (the producer's 128 threads decoded one, every consumer thread
  // done with it), then packed[r]: the packed rows' copies landed
  const wgmma_flash::Pipeline<kStages> pl{q_at + k_off, q_at + v_off, kTileBytes, q_at + packed_off + kRawStages * packed_bytes};
  auto packed = [&](int r) { return pl.bars + pl.kBarrierBytes + 8 * r; };

  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32 % 4, lane = tid % 32;
  const int64_t bh = blockIdx.z, b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  const int64_t past = p.past_of(b), begin = split * l.split_len;
  const int64_t end = min(past, begin + l.split_len);
  const int tiles = end > begin ? static_cast<int>((end - begin + kKeys - 1) / kKeys) : 0;
  const uint8_t* keys = past_key + (bh * p.past_rows_or_len() + begin) * kb;
  const uint8_t* vals = past_value + (bh * p.past_rows_or_len() + begin) * vb;

  if (tid == 0) {
    pl.init(128, 128 * kConsumers);
    for (int r = 0; r < kRawStages; ++r) mbar_init(packed(r), 1);
    fence_mbarrier_init();
  }
  grid_dependency_wait();  // the past may be the copy kernel's present

  // the query rows, rotated, into Q's tile
  load_rotated_queries<D, kThreads>(base, [](int r, int c) { return swizzled(kRows, r, c); }, p, l, q, b, hkv, r0, kRows,
                                    q_vectors);
  fence_proxy_async();  // Q's writes, before the products read it
  __syncthreads();

  if (wg == kConsumers) {  // the producer (the last warpgroup): thread t decodes token t of each tile
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    const int t = tid - 128 * kConsumers;
    const auto copy = [&](int j) {  // tile j's packed rows (those before `end`, in whole 16 bytes)
      const int r = j % kRawStages;
      const int64_t t0 = static_cast<int64_t>(j) * kKeys, n = min(static_cast<int64_t>(kKeys), end - begin - t0);
      const uint32_t kbytes = static_cast<uint32_t>((n * kb + 15) / 16 * 16), vbytes = static_cast<uint32_t>((n * vb + 15) / 16 * 16);
      const uint32_t dst = q_at + packed_off + r * packed_bytes;
      mbar_arrive_expect(packed(r), kbytes + vbytes);
      bulk_copy(dst, keys + t0 * kb, kbytes, packed(r));
      bulk_copy(dst + static_cast<uint32_t>(kKeys * kb), vals + t0 * vb, vbytes, packed(r));
    };
    if (t == 0) {
      for (int j = 0; j < min(tiles, kRawStages); ++j) copy(j);
    }
    constexpr int kTableWords = (1 << KB) / 4;  // of the token's key values, low or high bytes
    // chunk c of token t's row in a decoded tile (swizzled(kKeys, t, c)): the row's offset with its
    // swizzle, one xor and the atom's offset per chunk
    const uint32_t row_at = t * 128u | (t % 8u) * 16u;
    const auto chunk_at = [&](int c) { return (row_at ^ (c % 8) * 16u) + (c / 8) * kKeys * 128u; };
    constexpr int kKeyCodeBytes = D * KB / 8, kValueCodeBytes = D * VB / 8;
    constexpr float kInvSqrtD = D == 128 ? 0.08838834764831845f : 0.125f;
    for (int j = 0; j < tiles; ++j) {
      const int r = j % kRawStages, s = j % kStages;
      mbar_wait(packed(r), (j / kRawStages) & 1);
      // tokens at or past `end` decode to zeros: their scales (and zero) taken as 0
      const bool on = begin + static_cast<int64_t>(j) * kKeys + t < end;
      const uint8_t* krow = base + packed_off + r * packed_bytes + t * kb;
      const uint8_t* vrow = base + packed_off + r * packed_bytes + kKeys * kb + t * vb;
      const float norm = on ? __half2float(*reinterpret_cast<const __half*>(krow + kKeyCodeBytes)) * kInvSqrtD : 0.0f;
      // the token's key values (centroid x scale in float32, rounded once to T, as fine as an fp16
      // cache's keys) as low and high bytes, four to a word: the products once per token
      uint32_t lo[kTableWords], hi[kTableWords];
#pragma unroll
      for (int i = 0; i < kTableWords; ++i) {
        const uint32_t a = Pair<T>::bits2(centroid<KB>(4 * i) * norm, centroid<KB>(4 * i + 1) * norm);
        const uint32_t b = Pair<T>::bits2(centroid<KB>(4 * i + 2) * norm, centroid<KB>(4 * i + 3) * norm);
        lo[i] = prmt(a, b, 0x6420u), hi[i] = prmt(a, b, 0x7531u);
      }
      if (j >= kStages) mbar_wait(pl.empty_k(s), (j / kStages - 1) & 1);
      uint8_t* kt = base + k_off + s * kTileBytes;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        uint32_t e[4];
        lookup8<KB>(chunk_codes<KB>(krow, c), lo, hi, e);
        *reinterpret_cast<uint4*>(kt + chunk_at(c)) = make_uint4(e[0], e[1], e[2], e[3]);
      }
      fence_proxy_async();
      mbar_arrive(pl.full_k(s));
      const float vscale = on ? __half2float(*reinterpret_cast<const __half*>(vrow + kValueCodeBytes)) : 0.0f;
      const float vzero = on ? __half2float(*reinterpret_cast<const __half*>(vrow + kValueCodeBytes + 2)) : 0.0f;
      const T2 vs = as_pair<T2>(Pair<T>::bits(vscale) * 0x10001u), vz = as_pair<T2>(Pair<T>::bits(vzero) * 0x10001u);
      const T2 magic = as_pair<T2>(Pair<T>::kMagic);
      if (j >= kStages) mbar_wait(pl.empty_v(s), (j / kStages - 1) & 1);
      uint8_t* vt = base + v_off + s * kTileBytes;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        const uint32_t z = chunk_codes<VB>(vrow, c);
        const uint32_t even = z & 0x0F0F0F0Fu, odd = (z >> 4) & 0x0F0F0F0Fu;  // elements 2i, 2i + 1 in byte i
        uint32_t e[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          // elements 2i and 2i + 1 into the two halves' low bytes, their high bytes zero (the sign of a
          // byte below 0x80, repeated), then the magic number's bits
          const uint32_t codes = prmt(even, odd, static_cast<uint32_t>(i | 0x80 | (4 + i) << 8 | 0x8000)) | Pair<T>::kMagic;
          e[i] = as_word(__hfma2(__hsub2(as_pair<T2>(codes), magic), vs, vz));
        }
        *reinterpret_cast<uint4*>(vt + chunk_at(c)) = make_uint4(e[0], e[1], e[2], e[3]);
      }
      fence_proxy_async();
      mbar_arrive(pl.full_v(s));
      asm volatile("bar.sync 3, 128;\n" ::: "memory");  // every token of packed buffer r decoded
      if (t == 0 && j + kRawStages < tiles) copy(j + kRawStages);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  const int row = 64 * wg + 16 * warp + lane / 4;     // this thread's rows in the block: row and row + 8
  const uint32_t q_wg = q_at + wg * 64 * 128;         // the warpgroup's rows in Q's first atom
  float o[D / 2], s[kKeys / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, lsum[2] = {0.0f, 0.0f};
  uint32_t pa[kKeys / 16][4];  // the last tile's weights: the value product's A operand

  // every tile but the split's last is whole; its tokens at or past `end` get no weight
  const auto softmax = [&](int j) {
    const int64_t valid = end - begin - static_cast<int64_t>(j) * kKeys;
    if (valid < kKeys) {
      const auto masked = [&](int column, int) { return column >= valid; };
      wgmma_flash::softmax<D, T, true>(s, o, m, lsum, pa, scale, lane, masked);
    } else {
      wgmma_flash::softmax<D, T, false>(s, o, m, lsum, pa, scale, lane, [](int, int) { return false; });
    }
  };
  wgmma_flash::take_turns<D, T>(pl, tiles, wg, q_wg, kRows, s, o, pa, softmax);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = flash::quad_sum(lsum[h]);
    const int64_t r = r0 + row + 8 * h;
    if (r >= l.rows) continue;
    wgmma_flash::store_partial<D>(partial + ((bh * l.rows + r) * l.splits + split) * partial_stride(D), o, m[h], sum, h,
                                  lane);
  }
#endif
}

template <int D, int KB, int VB, typename T>
cudaError_t launch(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                   const uint8_t* past_value, float* partial, cudaStream_t stream) {
  static SharedMemoryOptIn opt_in;  // one per instantiation: each kernel has its own attribute
  auto* kernel = past_chunk_sm90_kernel<D, KB, VB, T>;
  // the setmaxnreg counts hold only at kLaunchRegs: a build whose flags gave the kernel other
  // registers (-maxrregcount) would leave its consumers waiting forever, so it is refused instead
  static const cudaError_t registers = [kernel] {
    cudaFuncAttributes a{};
    const cudaError_t e = cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernel));
    return e != cudaSuccess ? e : a.numRegs == kLaunchRegs ? cudaSuccess : cudaErrorInvalidConfiguration;
  }();
  if (registers != cudaSuccess) return registers;
  cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(kernel), plan.smem);
  if (e != cudaSuccess) return e;
  return launch_dependent(kernel, chunk_grid(p, plan.layout), dim3(kThreads), plan.smem, stream, p, plan.layout,
                          static_cast<const T*>(q), past_key, past_value, partial, query_vectors(p, q));
}

}  // namespace

cudaError_t launch_chunk_split_sm90(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                                    const uint8_t* past_value, float* partial, cudaStream_t stream) {
  const int kb = format_bits(p.key_format), vb = format_bits(p.value_format);
  return with_head_and_type(p, [&](auto d, auto t) {
    constexpr int D = decltype(d)::value;
    using T = decltype(t);
    if (kb == 4) {
      return vb == 4 ? launch<D, 4, 4, T>(p, plan, q, past_key, past_value, partial, stream)
                     : launch<D, 4, 3, T>(p, plan, q, past_key, past_value, partial, stream);
    }
    return vb == 4 ? launch<D, 3, 4, T>(p, plan, q, past_key, past_value, partial, stream)
                   : launch<D, 3, 3, T>(p, plan, q, past_key, past_value, partial, stream);
  });
}

}  // namespace turboquant::cuda::detail
