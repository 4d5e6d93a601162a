// The split-KV decode kernel for the presets' format pairs on tensor cores: MSE 4-bit, MSE 3-bit or
// fp8 keys with uint4 values, MSE 3-bit keys with uint3 values, key and value head size 64, 128 or
// 256. It writes the same partial results as split_kernel (attention_split.cu); the finish kernel merges
// them.
//
// Tokens are the M dimension of every product, so a 16-token tile fills the m16n8k16 rows and the
// (up to 8) query rows of the GQA group are its N columns:
// 1. S = K Q^T. A = 16 tokens' key codes, one packed byte (two 4-bit codes) at a time through a
//    table of (centroid, centroid) half2 pairs, or an fp8 pair converted to half2 (exact); B = the
//    rotated queries, split into fp16 high and low parts (two products) so that only the keys are
//    rounded: the centroids to fp16 (relative 2^-12, what an fp16 cache does to its keys). The byte
//    table has 32 copies, one per lane, so its lookups never conflict.
// 2. Online softmax per query row on the accumulators (a row is a column here: 8 lanes x 4 tokens),
//    after TQAttention's mask where it has one (its element per token and row, read from global
//    memory: an additive term, or -inf where a bool mask is false; one element per key when the
//    block's rows share a mask row).
// 3. O^T += V^T P^T. A = the tile's value codes as fp16 subnormals: one byte permute pairs two
//    tokens' bytes, and a mask leaves the low nibble (code * 2^-24, exact) or the high one in place
//    (code * 2^-20); the powers of two come back when the accumulators are stored. B = the softmax
//    weights times each token's value scale, transposed from the score accumulators by movmatrix.
//    The zero points add sum_t p_t z_t.
// Tile rows are a fixed permutation of each 32-token warp tile (rho below), chosen so that the
// lanes' 32-bit loads of a tile's value words hit 32 different banks.
//
// A warp walks its own 32-token tiles, double-buffered in shared memory (bulk copies on sm_90,
// cp.async before); the block's 16 (or 8) warps, one block per SM, share the byte table and the
// query fragments, and are merged at the end.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_pipeline.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <type_traits>
#include <utility>

#include "device_attributes.h"
#include "mask.cuh"
#include "ptx.cuh"
#include "rotary_lanes.cuh"
#include "split_common.cuh"
#include "split_geometry.h"
#include "turboquant/float_io.h"
#include "turboquant/rotary.h"
#include "turboquant/vector_codec.h"

// The split kernel's dynamic shared memory, under a plain name so that inline PTX can take its
// shared-space address as a constant (the table lookups then add their offset inside the load).
extern "C" __shared__ __align__(16) unsigned char turboquant_tc_smem[];

namespace turboquant::cuda::detail {
namespace {

using namespace tc_geometry;
// Tiles per warp brought into L2 at a block's start (split kernel below); one round measured best
// (docs/performance.md, kept choices).
#ifndef TQ_PREFETCH_ROUNDS
#define TQ_PREFETCH_ROUNDS 1  // (developer A/B builds set others: scripts/build_probe.sh)
#endif
constexpr int kPrefetchRounds = TQ_PREFETCH_ROUNDS;
constexpr int kCopies = 32;    // copies of the byte table, one per lane
constexpr float kCodeUnit = 16777216.0f;  // 2^24: value codes enter the products as fp16 subnormals

// 4-register m16n8k16 fp16 product (ptx.cuh)
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  mma16816_f16(c, a0, a1, a2, a3, b0, b1);
}

// Hopper's bulk copies (cp.async.bulk): one instruction moves a tile into shared memory and
// signals an mbarrier, where per-lane cp.async took ~160 instructions per tile (address arithmetic
// and loop control). Before sm_90 the tiles keep per-lane cp.async.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define TQ_BULK_COPY 1
// (bulk_copy, ptx.cuh: the buffer's earlier reads are ordered before the copy by the warp's own
// __syncwarp; earlier writes through the generic proxy need a fence.proxy.async, see copy_exact.)
// A full tile's two copies (keys, values) and the arrival that expects them, by one lane of the
// converged warp (elect.sync): issued from a lane-0 branch, the compiler wraps each copy in a loop
// over the lanes' operands (they must be uniform), some 50 instructions per tile. The caches are
// read once per step, so their lines are marked the first for L2 to evict: the step's other data
// (queries, partial results, a model's weights) is not pushed out for them (faster at every
// measured size: docs/performance.md, kept choices).
__device__ __forceinline__ void bulk_copy_tile(uint32_t bar, uint32_t kdst, const void* ksrc, uint32_t kbytes,
                                               uint32_t vdst, const void* vsrc, uint32_t vbytes) {
  asm volatile(
      "{\n .reg .pred one;\n elect.sync _|one, 0xffffffff;\n"
      " @one mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %7;\n"
      " .reg .b64 pol;\n createpolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
      " @one cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%1], [%2], %3, [%0], pol;\n"
      " @one cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%4], [%5], %6, [%0], pol;\n}\n" ::"r"(bar),
      "r"(kdst), "l"(ksrc), "r"(kbytes), "r"(vdst), "l"(vsrc), "r"(vbytes), "r"(kbytes + vbytes)
      : "memory");
}
// Brings `bytes` (a multiple of 16, from a 16-byte aligned src) into L2 without waiting: a hint, so
// it may read memory that the launch before is still writing (a later read still sees the writes).
__device__ __forceinline__ void bulk_prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
// The 16-byte blocks inside [from, from + bytes) into L2.
__device__ __forceinline__ void bulk_prefetch_l2_inside(const uint8_t* from, int64_t bytes) {
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(from) + 15) & ~uintptr_t{15};
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(from) + bytes) & ~uintptr_t{15};
  if (hi > lo) bulk_prefetch_l2(reinterpret_cast<const void*>(lo), static_cast<uint32_t>(hi - lo));
}
#endif

// Centroid i (as float) from immediates: the kernel's first read of constant memory, with a
// different address per lane, would wait for a cold miss and then serialise.
template <int kBits, int K>
constexpr float kCentroidFloat = static_cast<float>(kBits == 3 ? codebook::kCentroids3[K % 8] : codebook::kCentroids4[K]);
template <int kBits, int... K>
__device__ __forceinline__ float centroid_select(int i, std::integer_sequence<int, K...>) {
  float v = 0.0f;
  ((v = i == K ? kCentroidFloat<kBits, K> : v), ...);
  return v;
}
template <int kBits>
__device__ __forceinline__ float centroid_immediate(int i) {
  return centroid_select<kBits>(i, std::make_integer_sequence<int, 1 << kBits>{});
}

// A 32-bit load from a shared-memory address (as the table lookups form it: base + offset, which
// the load instruction can add itself).
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
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

// kKeyBits: 4 or 3 (MSE keys), 8 (fp8 keys) or 16 (raw16 keys, with kValBits 16: raw16 values);
// kValBits: 4 or 3 (uint values); kD: the key product's length (MSE: the padded head size; fp8 and
// raw16: the head size) and the value head size.
// kKeyWords4: every key row starts 4-byte aligned in shared memory (rows of a multiple of 4 bytes,
// as onnxruntime-genai's shared buffers have), so code groups are read without funnel shifts.
// kMasked: TQAttention's mask is applied (a variant of its own: the others hold no register for it).
template <int kKeyBits, int kValBits, int kD, bool kKeyWords4, int kWarps, bool kMasked>
__global__ void __launch_bounds__(kWarps * 32, 1)
    tc_split_kernel(AttentionParams p, RotaryParams rot, Layout l, const void* q, const uint8_t* past_key,
                    const uint8_t* past_value, float* partial, const void* mask) {
  constexpr int kThreads = kWarps * 32;
  constexpr bool kFp8 = kKeyBits == 8;
  // raw16 rows (fp16 bits, 2 kD bytes): both caches copied as swizzled 16-byte chunks (as fp8 keys
  // are) to rows of 2 kD bytes, whatever the caches' row bytes; the products' A operands read by
  // ldmatrix (keys) and ldmatrix.trans (values), plain fp16 dot products and weighted sums
  constexpr bool kRaw = kKeyBits == 16;
  static_assert(kRaw == (kValBits == 16), "raw16 keys go with raw16 values");
  constexpr int kRawRow = 2 * kD, kRawChunks = kRawRow / 16;  // raw16 rows in a buffer, their 16-byte chunks
  constexpr int kSteps = kD / 16;                     // k-steps of the score product
  constexpr int kKeyWords = kFp8 ? kSteps : kD / 32;  // code groups (4 or 3 bytes) of a key row per lane
  constexpr int kValWords = kD / 64;                  // code groups (4 or 3 bytes) of a value row per lane
  constexpr int kMt = 4 * kValWords;                  // m16 tiles of O^T (dv / 16)
  constexpr int kPairs = kKeyBits == 3 ? 64 : 256;    // code pairs the table holds
  constexpr int kKeyPayload = kD * kKeyBits / 8, kValPayload = kD * kValBits / 8;
  __shared__ float row_factor[kRowsMax];
  // the mask's element of each query row of the block at past token 0 (-1: no row)
  __shared__ int64_t mask_row[kMasked ? kRowsMax : 1];
  constexpr bool kPermuted = permuted_table(kKeyBits, kD);
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 0);
  TQ_BLOCK(0);
  uint8_t* dyn = turboquant_tc_smem;
  uint32_t dyn_at;  // the dynamic part's shared-window address
  asm("mov.u32 %0, turboquant_tc_smem;\n" : "=r"(dyn_at));
  // (row sizes as launch set them: key_row() and value_row() work them out from the formats, a
  // switch through a jump table in another constant bank and loops, whose cold misses held up the
  // kernel's start)
  const int kb = static_cast<int>(p.key_row_bytes), vb = static_cast<int>(p.value_row_bytes);
  const SmemLayout sl = smem_layout(kKeyBits, kD, kb, vb, kWarps, static_cast<int>(dyn_at % kWindow));
  if (kPermuted && dyn_at % kWindow > kDynStartMax) __trap();  // cannot happen: 1 KiB reserved + < 1 KiB static
  uint32_t* lut = reinterpret_cast<uint32_t*>(dyn + sl.table);  // [pair][lane]: half2 (centroids of the two codes)
  uint4* qf = reinterpret_cast<uint4*>(dyn + sl.fragments);  // [k-step][lane]: hi b0, hi b1, lo b0, lo b1
  float* qv = reinterpret_cast<float*>(dyn + sl.queries);    // [kRowsMax][kD]

  const int64_t bh = blockIdx.x;
  const int split = blockIdx.y;
  const uint32_t heads = static_cast<uint32_t>(p.kv_heads);  // (the grid's x: batch x heads < 2^31)
  const int64_t b = blockIdx.x / heads, hkv = blockIdx.x % heads;
  const int64_t row0 = static_cast<int64_t>(blockIdx.z) * l.rows_per_block;
  const int rows = static_cast<int>(min(static_cast<int64_t>(l.rows_per_block), l.rows - row0));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;

  // --- this warp's tiles, double-buffered (the first one is fetched once the table is built) ---
  const int ktile = key_tile_bytes(kb), tile = ktile + value_tile_bytes(vb);
  uint8_t* stage = warp < sl.low_warps ? dyn + sl.low_stages + warp * 2 * tile
                                       : dyn + sl.high_stages + (warp - sl.low_warps) * 2 * tile;
  // (past lengths are read before the dependency wait below: they are inputs of the op, which no
  // launch of ours writes; the splits start at the sliding window's first key, one query position)
  const int64_t past = p.past_of(b);
  const int64_t begin = window_first_key(p, past) + static_cast<int64_t>(split) * l.split_len;
  // this split's rows; in a pool of blocks (paged) the planner keeps every tile inside one block, at a
  // 16-byte boundary (tile_rows_in_blocks): each tile's rows come from the block table
  const bool paged = p.blocks.table != nullptr;
  const bool mapped = !paged || begin < past;  // (a split past the sequence's end reads no row)
  const uint8_t* keys = paged ? past_key + (mapped ? p.blocks.row_offset(b, hkv, begin, kb) : 0)
                              : past_key + (bh * p.past_rows_or_len() + begin) * kb;
  const uint8_t* vals = paged ? past_value + (mapped ? p.blocks.row_offset(b, hkv, begin, vb) : 0)
                              : past_value + (bh * p.past_rows_or_len() + begin) * vb;
  auto key_rows_at = [&](int r0) -> const uint8_t* {
    return paged ? past_key + p.blocks.row_offset(b, hkv, begin + r0, kb) : keys + static_cast<int64_t>(r0) * kb;
  };
  auto value_rows_at = [&](int r0) -> const uint8_t* {
    return paged ? past_value + p.blocks.row_offset(b, hkv, begin + r0, vb) : vals + static_cast<int64_t>(r0) * vb;
  };
#ifdef TQ_BULK_COPY
  // The split's first rows (the warps' first kPrefetchRounds tiles) into L2 now, by one lane:
  // DRAM would otherwise idle through the set-up below. Up to the batch's longest past
  // (a parameter: this sequence's own length is a load away), not the buffer's capacity.
  if (kPrefetchRounds > 0 && warp == kWarps - 1 && lane == 0) {
    int64_t rows = max(static_cast<int64_t>(0), min(min(l.split_len, static_cast<int64_t>(kPrefetchRounds) * kWarps * kTok), p.past_len - begin));
    if (paged) rows = mapped ? min(min(rows, past - begin), p.run_length(begin)) : 0;  // the first block's, mapped
    bulk_prefetch_l2_inside(keys, rows * kb);
    bulk_prefetch_l2_inside(vals, rows * vb);
  }
#endif
  const int len = static_cast<int>(max(static_cast<int64_t>(0), min(past, begin + l.split_len) - begin));
  constexpr int kChunks = kD / 16;  // fp8 rows: 16-byte chunks

  // Full tiles are copied as the 16-byte chunks that cover them (16-byte aligned, which rows of 66
  // or 68 bytes rarely start at) into their buffer from byte (source address mod 16): the same for
  // every tile of the warp, since a tile is 32 rows, a multiple of 16 bytes. On sm_90 one bulk copy
  // per cache and tile, else per-lane cp.async. Chunks would leave a cache only at its first or last
  // bytes: those tiles, and the partial ones at the end, are copied exactly. Value rows must stay
  // 4-byte aligned: if the value cache is not, its tiles are copied exactly to the buffer's start.
  const uint8_t* key_end = past_key + p.batch * p.kv_heads * p.past_rows_or_len() * kb;
  const uint8_t* val_end = past_value + p.batch * p.kv_heads * p.past_rows_or_len() * vb;
  const int kdelta = kFp8 || kRaw ? 0 : static_cast<int>(reinterpret_cast<uintptr_t>(keys) & 15);
  const int vdelta_raw = kRaw ? 0 : static_cast<int>(reinterpret_cast<uintptr_t>(vals) & 15);
  const int vdelta = vdelta_raw % 4 == 0 ? vdelta_raw : 0;
  const int kspan = round16(kdelta + kTok * kb), vspan = round16(vdelta + kTok * vb);
#ifdef TQ_BULK_COPY
  __shared__ __align__(8) uint64_t bars[kWarps][2];  // per warp and buffer: its bulk copies landed
  // shared-window addresses, kept in registers (the compiler would otherwise work them out again
  // at every tile from the block's shared-memory base)
  uint32_t bar_at, stage_at;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(bar_at) : "r"(smem_u32(&bars[warp][0])));
  asm volatile("mov.b32 %0, %1;\n" : "=r"(stage_at) : "r"(smem_u32(stage)));
  if (lane == 0) {  // barriers and buffers by their 32-bit shared-window addresses, worked out once per warp
    mbar_init(bar_at, 1);
    mbar_init(bar_at + 8, 1);
    fence_mbarrier_init();
  }
  __syncwarp();
#endif
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 12);
  // Tile r0's chunks start at from0 + r0 * row. Tiles r0 in [lo, hi] are full and their chunks lie
  // inside the cache: worked out once, so that a tile's copy costs a few instructions.
  const uint8_t* kfrom0 = keys - kdelta;
  const uint8_t* vfrom0 = vals - vdelta;
  auto span_tiles = [&](const uint8_t* from0, const uint8_t* base, const uint8_t* end, int row, int span, int* lo) {
    *lo = from0 < base ? kTok : 0;
    const int64_t room = (end - from0) - span;  // r0 * row <= room
    return static_cast<int>(min(room < 0 ? int64_t{-1} : room / row, static_cast<int64_t>(len) - kTok));
  };
  int k_lo = 0, v_lo = 0;
  // (paged: every full tile is a whole span inside its block)
  const int k_hi = kFp8 || kRaw ? -1 : paged ? len - kTok : span_tiles(kfrom0, past_key, key_end, kb, kspan, &k_lo);
  const int v_hi = kRaw || vdelta != vdelta_raw ? -1 : paged ? len - kTok : span_tiles(vfrom0, past_value, val_end, vb, vspan, &v_lo);
  auto key_from = [&](int r0) { return paged ? key_rows_at(r0) - kdelta : kfrom0 + static_cast<uint32_t>(r0 * kb); };
  auto value_from = [&](int r0) { return paged ? value_rows_at(r0) - vdelta : vfrom0 + static_cast<uint32_t>(r0 * vb); };
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 13);
  auto key_spans = [&](int r0) { return r0 >= k_lo && r0 <= k_hi; };
  auto value_spans = [&](int r0) { return r0 >= v_lo && r0 <= v_hi; };
  // The other copies: fp8 keys (swizzled chunks, asynchronous), and the tiles copied exactly
  // (complete on return: rare, and bulk copies may write the buffer later, which needs the
  // generic-proxy writes fenced first).
  auto copy_exact = [&](int r0, uint8_t* dst, bool kspans, bool vspans) {
    const int n = min(kTok, len - r0);
    const uint8_t* ksrc = key_rows_at(r0);
    if (kFp8) {
      for (int i = lane; i < n * kChunks; i += 32) {
        const int u = i / kChunks, c = i % kChunks;
        __pipeline_memcpy_async(dst + u * kb + 16 * (c ^ fp8_swizzle(u, kChunks)), ksrc + u * kb + 16 * c, 16);
      }
    }
    if ((!kFp8 && !kspans) || !vspans) {
      if (!kFp8 && !kspans) warp_copy_async(dst + kdelta, ksrc, n * kb, lane);
      if (!vspans) warp_copy_async(dst + ktile + vdelta, value_rows_at(r0), n * vb, lane);
      __pipeline_commit();
      __pipeline_wait_prior(0);
      __syncwarp();
#ifdef TQ_BULK_COPY
      if (lane == 0) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
    }
  };
  // The usual tile (full, both caches' chunks inside them): no other check.
  const int fast_lo = max(k_lo, v_lo), fast_hi = min(k_hi, v_hi);
  auto fetch = [&](int r0, int buf) {  // start copying the tile of rows r0.. into buffer buf
    uint8_t* dst = stage + buf * tile;
    if constexpr (kRaw) {
      // chunk c of token u at chunk c ^ fp8_swizzle(u) of its row: the 8 rows one ldmatrix phase
      // reads (tile_token of 8 consecutive rows) then fill 8 different chunk columns, conflict-free.
      // Rows past the sequence's end are zero-filled (stale fp16 bits could be inf or NaN, which a
      // zero weight would not cancel in the value product)
      const int n = min(kTok, len - r0);
      const uint8_t* ksrc = key_rows_at(r0);
      const uint8_t* vsrc = value_rows_at(r0);
      const uint32_t at = smem_u32(dst);
#pragma unroll 4
      for (int i = lane; i < kTok * kRawChunks; i += 32) {
        const int u = i / kRawChunks, c = i % kRawChunks;
        const uint32_t to = u * kRawRow + 16 * (c ^ fp8_swizzle(u, kRawChunks));
        const bool on = u < n;
        cp_async16(at + to, on ? ksrc + u * kb + 16 * c : ksrc, on ? 16 : 0);
        cp_async16(at + ktile + to, on ? vsrc + u * vb + 16 * c : vsrc, on ? 16 : 0);
      }
      __pipeline_commit();
      return;
    }
    const bool fast = r0 >= fast_lo && r0 <= fast_hi;
#ifdef TQ_BULK_COPY
    const uint32_t bar = bar_at + 8 * buf, dst_at = stage_at + buf * tile;
    if (fast) {  // the usual tile (MSE keys): two bulk copies, nothing else
      bulk_copy_tile(bar, dst_at, key_from(r0), kspan, dst_at + ktile, value_from(r0), vspan);
      return;
    }
    const bool kspans = key_spans(r0), vspans = value_spans(r0);
    copy_exact(r0, dst, kspans, vspans);
    if (lane == 0) {
      mbar_arrive_expect(bar, (kspans ? kspan : 0) + (vspans ? vspan : 0));
      if (kspans) bulk_copy(dst_at, key_from(r0), kspan, bar);
      if (vspans) bulk_copy(dst_at + ktile, value_from(r0), vspan, bar);
    }
#else
    const bool kspans = fast || key_spans(r0), vspans = fast || value_spans(r0);
    if (!fast) copy_exact(r0, dst, kspans, vspans);
    if (kspans) {
      const uint8_t* from = key_from(r0);
      for (int i = lane; i < kspan / 16; i += 32) __pipeline_memcpy_async(dst + 16 * i, from + 16 * i, 16);
    }
    if (vspans) {
      const uint8_t* from = value_from(r0);
      for (int i = lane; i < vspan / 16; i += 32) __pipeline_memcpy_async(dst + ktile + 16 * i, from + 16 * i, 16);
    }
#endif
    __pipeline_commit();
  };
  // Waits for the copies into buffer buf (its use-th fill) and makes them visible to the warp.
#ifdef TQ_BULK_COPY
  constexpr bool kCpAsync = kFp8 || kRaw;  // cp.async groups pending from tile to tile: fp8 keys', raw16 rows' (MSE: bulk copies only)
#else
  constexpr bool kCpAsync = true;
#endif
  auto landed = [&](int buf, int use, bool newer_pending) {
    if (kCpAsync) {
      if (newer_pending) {
        __pipeline_wait_prior(1);
      } else {
        __pipeline_wait_prior(0);
      }
    }
#ifdef TQ_BULK_COPY
    if (!kRaw) mbar_wait(bar_at + 8 * buf, use & 1);  // (raw16 tiles: cp.async alone)
#endif
    __syncwarp();
  };
  const int stride = kWarps * kTok;

  if constexpr (!kRaw) if (!kFp8) {
    // The centroids as fp16, converted once, then copy `lane` of pairs warp, warp + kWarps, ...: 8
    // to 32 stores a thread, unrolled, from broadcast reads: the set-up is on the critical path
    // wherever the launch before does not let this one start early.
    constexpr int kRowWords = table_row_bytes(kKeyBits, kD) / 4, kCodes = 1 << kKeyBits;
    __shared__ uint16_t centroid_h[kCodes];
    if (tid < kCodes) centroid_h[tid] = __half_as_ushort(__float2half_rn(centroid_immediate<kKeyBits == 3 ? 3 : 4>(tid)));
    __syncthreads();
    TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 14);
    static_assert(kCopies == 32, "a copy per lane");
#pragma unroll
    for (int k = 0; k < (kPairs + kWarps - 1) / kWarps; ++k) {
      const int e = warp + kWarps * k;
      if (kPairs % kWarps != 0 && e >= kPairs) break;
      lut[e * kRowWords + lane] = centroid_h[e & (kCodes - 1)] | static_cast<uint32_t>(centroid_h[e >> kKeyBits]) << 16;
    }
  }
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 1);
  // A programmatic launch may have started this kernel while the one before it still runs (the
  // table above is all it did meanwhile): the caches and queries are read after it finished. The
  // finish kernel may then start: it reads nothing this kernel writes before its own wait.
  if (rot.rotary_dim > 0 && warp == 0) {  // the query rows' table rows, while the launch before runs
    prefetch_rotary_rows(rot, p.dtype, rotary_position(rot, b, row0 / l.group, p.q_len, p.past_of(b)), lane);
  }
  grid_dependency_wait();
  launch_dependents();
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 2);
  // --- the block's query rows: rotated (MSE), normalised per row, split into fp16 hi + lo ---
  // Warp r < kRowsMax: query row r (zeros past the head size, and rows past `rows`), lane holding
  // elements lane + 32 j, rotated in the warp: the butterflies at distances 1 .. 16 by shuffles, then
  // 32 .. in registers, the order and operations of load_query_rows (7 block-wide steps with a
  // barrier each); its largest magnitude; the row into qv.
  // (blocks of fewer warps than rows, raw16's at head size 128, take rows warp + kWarps, ... after)
  constexpr int kPer = kD / 32;
  float x[kPer];
  // The query loads go first, then the first tiles' copies (every block's, which fill DRAM's
  // queues): the queries would otherwise wait behind them. Every load of the row is issued before
  // any is converted: with load_float (a dtype switch around each load and its conversion) the
  // compiler waited for each load in turn (docs/performance.md, kept choices).
  auto load_row = [&](int qr) {  // query row qr of the block into x
    const int64_t row = row0 + qr, pos = row / l.group, hq = hkv * l.group + row % l.group;
    const int64_t at = b * p.q.b + hq * p.q.h + pos * p.q.s;
    if (p.dtype == DType::kFloat32) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = lane + 32 * j;
        x[j] = qr < rows && i < p.head_dim ? static_cast<const float*>(q)[at + i] : 0.0f;
      }
    } else {
      uint16_t raw[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int i = lane + 32 * j;
        raw[j] = qr < rows && i < p.head_dim ? static_cast<const uint16_t*>(q)[at + i] : uint16_t{0};
      }
      const bool f16 = p.dtype == DType::kFloat16;
#pragma unroll
      for (int j = 0; j < kPer; ++j) x[j] = f16 ? f16_to_f32(raw[j]) : bf16_to_f32(raw[j]);
    }
  };
  auto finish_row = [&](int qr) {  // rotary (fused), rotation (MSE), its largest magnitude, into qv
    const int64_t row = row0 + qr, pos = row / l.group;
    if (rot.rotary_dim > 0 && qr < rows && rotates_in_lanes<kPer>(rot, p.head_dim)) {  // fused (fuses_rotary)
      rotate_lanes(rot, p.dtype, rotary_position(rot, b, pos, p.q_len, p.past_of(b)), x,
                   key_scale_row(rot, hkv, p.head_dim), ScaleSide::kQuery);
    } else if (rot.rotary_dim > 0 && qr < rows) {  // other layouts of the rotation: through shared memory
      float* at = qv + qr * kD;
#pragma unroll
      for (int j = 0; j < kPer; ++j) at[lane + 32 * j] = x[j];
      __syncwarp();
      rotate_shared(rot, p.dtype, p.head_dim, rotary_position(rot, b, pos, p.q_len, p.past_of(b)), at, lane, 32,
                    key_scale_row(rot, hkv, p.head_dim), ScaleSide::kQuery);
      __syncwarp();
#pragma unroll
      for (int j = 0; j < kPer; ++j) x[j] = at[lane + 32 * j];
      __syncwarp();
    }
    if (!kFp8 && !kRaw) {
#pragma unroll
      for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const float o = __shfl_xor_sync(0xffffffffu, x[j], h);
          x[j] = (lane & h) ? o - x[j] : x[j] + o;  // lower element: a + c; upper: a - c (a the lower's)
        }
      }
#pragma unroll
      for (int h = 1; h < kPer; h <<= 1) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          if (j & h) continue;
          const float a = x[j], c = x[j + h];
          x[j] = a + c;
          x[j + h] = a - c;
        }
      }
    }
    TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 16);
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      m = fmaxf(m, fabsf(x[j]));
      qv[qr * kD + lane + 32 * j] = x[j];
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) row_factor[qr] = m;
  };
  if (kMasked && tid < kRowsMax) {
    const int64_t row = row0 + tid;
    mask_row[tid] = tid < rows ? mask_at(p, b, hkv * l.group + row % l.group, row / l.group, 0) : -1;
  }
  if (warp < kRowsMax) load_row(warp);
  if (warp * kTok < len) fetch(warp * kTok, 0);  // the first tile, while the queries are set up
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 15);
  if (warp < kRowsMax) finish_row(warp);
  if constexpr (kWarps < kRowsMax) {
    for (int qr = warp + kWarps; qr < kRowsMax; qr += kWarps) {
      load_row(qr);
      finish_row(qr);
    }
  }
  __syncthreads();
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 17);
  for (int k = tid; k < kSteps * 32; k += kThreads) {
    // lane ln's B fragment at k-step s: row ln/4, the 4 dims its A fragment's codes stand for
    const int s = k / 32, ln = k % 32, r = ln / 4, tt = ln % 4;
    // (raw16: the A fragments are ldmatrix's, dims 16s + 2tt, +1 and 16s + 2tt + 8, +9)
    const int d0 = kRaw ? 16 * s + 2 * tt : kFp8 ? 4 * (tt + 4 * s) : 8 * (tt + 4 * (s / 2)) + 4 * (s % 2);
    const float m = row_factor[r], inv = m > 0.0f ? 1.0f / m : 0.0f;
    float hi[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float x = qv[r * kD + d0 + (kRaw ? (j & 1) + 8 * (j >> 1) : j)] * inv;
      hi[j] = __half2float(__float2half_rn(x));
      lo[j] = x - hi[j];
    }
    qf[s * 32 + ln] = make_uint4(pack_half2(hi[0], hi[1]), pack_half2(hi[2], hi[3]), pack_half2(lo[0], lo[1]),
                                 pack_half2(lo[2], lo[3]));
  }
  __syncthreads();
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 3);
  const float fold = kRaw ? p.scale : kFp8 ? p.scale * fp8_unit() : p.scale / static_cast<float>(kD);
  const float fac[2] = {row_factor[2 * t] * fold, row_factor[2 * t + 1] * fold};  // this lane's columns

  // Scores are kept in base 2 (log2 e folded into the factors) for ex2.approx.
  const float l2fac[2] = {fac[0] * 1.44269504f, fac[1] * 1.44269504f};
  // Every row of the block on one mask row (a mask broadcast over heads and queries, as padding
  // masks are): each lane then reads one key's element per tile, and the scores take theirs by
  // shuffles, instead of eight elements per lane read after the scores (docs/performance.md)
  bool one_mask_row = kMasked;
  if constexpr (kMasked) {
#pragma unroll
    for (int i = 1; i < kRowsMax; ++i) one_mask_row = one_mask_row && (mask_row[i] < 0 || mask_row[i] == mask_row[0]);
  }

  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f}, z_run[2] = {0.0f, 0.0f};
  float o[kMt][4];  // O^T: rows = value columns (see the store below), columns 2t, 2t+1 = query rows
#pragma unroll
  for (int i = 0; i < kMt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  const uint32_t lut_lane = lane * 4;  // this lane's copy: byte offset within a table row
  const uint32_t lut_base = dyn_at + sl.table;
  const uint32_t lut_lane_at = lut_base | lut_lane;  // permuted table: a 64 KiB boundary

  // Tile-invariant byte offsets within a buffer. Score rows: tokens tok(nu, e) = tile_token(g + 8e, nu).
  // A lane reads its code group as the two words that hold it, funnel-shifted. With rows of 66
  // bytes (4-bit keys, head size 128) the 8 rows of one load start at words floor((kdelta + 66 u) /
  // 4), u in {0, 1, 8, 9, ...}, alternately 4-byte aligned and not: when kdelta = 2 mod 4 (every
  // other (b, head) region of an odd capacity) those starts are 0, 17, 4, 21, ..., 29 mod 32 banks,
  // and the last row's fourth lane meets the first row's first: 2 wavefronts per load (those
  // regions' blocks ran measurably slower). There the aligned rows, which need one word,
  // read it as the second (the first load one word earlier, shift 32): banks 1-16 and 17-32 for the
  // second load, 0-15 and 16-31 for the first. (Other head sizes and 3-bit keys have the same
  // conflicts at every phase.)
  constexpr bool kAlignedLate = kKeyBits == 4 && kD == 128 && !kKeyWords4;
  int key_off[2][2], key_sh[2][2], norm_off[2][2], sz_off[2][2];
#pragma unroll
  for (int nu = 0; nu < 2; ++nu)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int u = tile_token(g + 8 * e, nu);
      const int off = kdelta + u * kb + (kFp8 ? 4 : kKeyBits) * t;  // the lane's first code group
      key_off[nu][e] = kFp8 ? off : off & ~3;
      key_sh[nu][e] = (off & 3) * 8;
      if (kAlignedLate && (kdelta & 3) == 2 && (off & 3) == 0) key_off[nu][e] -= 4, key_sh[nu][e] = 32;
      norm_off[nu][e] = kdelta + u * kb + kKeyPayload;
      sz_off[nu][e] = ktile + vdelta + u * vb + kValPayload;
    }
  // Value rows of the K positions 2t, 2t+1 (row a, a + 1) and 2t+8, 2t+9 (row c, c + 1), code
  // group g (4-bit: the aligned word g; 3-bit: bytes 3g..3g+2, funnel-shifted out of two words).
  int val_off[2][2];
  const int val_sh = (kValBits * g & 3) * 8;
#pragma unroll
  for (int nu = 0; nu < 2; ++nu) {
    val_off[nu][0] = ktile + vdelta + tile_token(2 * t, nu) * vb + (kValBits * g & ~3);
    val_off[nu][1] = ktile + vdelta + tile_token(2 * t + 8, nu) * vb + (kValBits * g & ~3);
  }

  // raw16: this lane's ldmatrix row (matrix lane / 8, row lane % 8) in each row tile nu. Keys (S = K
  // Q^T, A = 16 tokens x 16 dims, not transposed): matrix i holds tokens tile_token(row + 8 (i & 1),
  // nu), dims 16s + 8 (i >> 1) ..; values (O^T = V^T P^T, A = 16 value columns x 16 tokens,
  // transposed): matrix i holds tokens tile_token(row + 8 (i >> 1), nu), columns 16 mt + 8 (i & 1) ..
  int raw_key_at[2] = {0, 0}, raw_key_swz[2] = {0, 0}, raw_val_at[2] = {0, 0}, raw_val_swz[2] = {0, 0};
  const int raw_key_half = (lane >> 4) & 1, raw_val_half = (lane >> 3) & 1;  // the chunk within 16 elements
  if constexpr (kRaw) {
    const int i = lane >> 3, r = lane & 7;
#pragma unroll
    for (int nu = 0; nu < 2; ++nu) {
      const int uk = tile_token(r + 8 * (i & 1), nu), uv = tile_token(r + 8 * (i >> 1), nu);
      raw_key_at[nu] = uk * kRawRow, raw_key_swz[nu] = fp8_swizzle(uk, kRawChunks);
      raw_val_at[nu] = ktile + uv * kRawRow, raw_val_swz[nu] = fp8_swizzle(uv, kRawChunks);
    }
  }

  int it = 0;
  for (int r0 = warp * kTok; r0 < len; r0 += stride, ++it) {
    const int n_tok = min(kTok, len - r0);
    const bool more = r0 + stride < len;
    if (more) fetch(r0 + stride, (it + 1) & 1);  // the other buffer: read by the previous tile, by every lane
    float mask_term = 0.0f;  // one_mask_row: key r0 + lane's term in base 2, or -inf; loaded while the tile lands
    if (kMasked && one_mask_row && lane < n_tok) {
      float add;
      mask_term = mask_allows(p, mask, mask_row[0] + (begin + r0 + lane) * p.mask_stride[3], &add) ? add * 1.44269504f
                                                                                                  : -INFINITY;
    }
    landed(it & 1, it >> 1, more);
    if (it == 0) TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 18);
    const uint8_t* buf = stage + (it & 1) * tile;

    // 1. scores: the products with the queries' high and low parts, in one accumulator
    float acc[2][4];
#pragma unroll
    for (int nu = 0; nu < 2; ++nu)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[nu][j] = 0.0f;
    if constexpr (kRaw) {
      const uint32_t buf_at = smem_u32(buf);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 bq = qf[s * 32 + lane];
#pragma unroll
        for (int nu = 0; nu < 2; ++nu) {
          uint32_t a[4];
          ldmatrix_x4(a, buf_at + raw_key_at[nu] + 16 * ((2 * s + raw_key_half) ^ raw_key_swz[nu]));
          mma16816(acc[nu], a[0], a[1], a[2], a[3], bq.x, bq.y);
          mma16816(acc[nu], a[0], a[1], a[2], a[3], bq.z, bq.w);
        }
      }
    } else if (kFp8) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint4 bq = qf[s * 32 + lane];
#pragma unroll
        for (int nu = 0; nu < 2; ++nu) {
          const int ua = tile_token(g, nu), ub = tile_token(g + 8, nu);
          const uint32_t wa = *reinterpret_cast<const uint32_t*>(buf + key_off[nu][0] + 16 * (s ^ fp8_swizzle(ua, kChunks)));
          const uint32_t wb = *reinterpret_cast<const uint32_t*>(buf + key_off[nu][1] + 16 * (s ^ fp8_swizzle(ub, kChunks)));
          const uint32_t a0 = fp8x2_to_half2(wa & 0xffffu), a2 = fp8x2_to_half2(wa >> 16);
          const uint32_t a1 = fp8x2_to_half2(wb & 0xffffu), a3 = fp8x2_to_half2(wb >> 16);
          mma16816(acc[nu], a0, a1, a2, a3, bq.x, bq.y);
          mma16816(acc[nu], a0, a1, a2, a3, bq.z, bq.w);
        }
      }
    } else {
#pragma unroll
      for (int m = 0; m < kKeyWords; ++m) {
        // code group t + 4m of each row (4 or 3 bytes): a word, or (rows not 4-byte aligned, or
        // 3-byte groups) two aligned words funnel-shifted
        uint32_t w[2][2];
#pragma unroll
        for (int nu = 0; nu < 2; ++nu)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const uint32_t* kw = reinterpret_cast<const uint32_t*>(buf + key_off[nu][e]) + kKeyBits * m;
            if (kKeyWords4 && kKeyBits == 4) {
              w[nu][e] = kw[0];
            } else {
              w[nu][e] = __funnelshift_rc(kw[0], kw[1], key_sh[nu][e]);  // (shift 32: kw[1])
            }
          }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 bq = qf[(2 * m + h) * 32 + lane];
#pragma unroll
          for (int nu = 0; nu < 2; ++nu) {
            // a0/a1: code pair 2h of rows g/g+8, a2/a3: pair 2h+1. Table offset = pair value *
            // row bytes + this lane's copy: 4-bit, one byte permute ((byte << 8) | lane * 4); 3-bit,
            // a shift and a masked or
            uint32_t v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const int pair = 2 * h + j / 2, e = j % 2;
              uint32_t at;
              if (kPermuted) {  // bytes: lane * 4, the code byte, the table's upper half
                at = __byte_perm(w[nu][e], lut_lane_at, 0x7604 | (pair << 4));
              } else {
                const int sft = 2 * kKeyBits * pair - 7;
                const uint32_t x = sft < 0 ? (w[nu][e] << -sft) : (w[nu][e] >> sft);
                at = lut_base + ((x & ((kPairs - 1) << 7)) | lut_lane);
              }
              v[j] = lds32(at);
            }
            mma16816(acc[nu], v[0], v[1], v[2], v[3], bq.x, bq.y);
            mma16816(acc[nu], v[0], v[1], v[2], v[3], bq.z, bq.w);
          }
        }
      }
    }

    // 2. online softmax: lane (g, t) holds tokens tile_token(g + 8e, nu) of columns 2t, 2t+1
    float sc[2][4], vs[2][2], vz[2][2];
    auto scale_scores = [&](auto partial) {  // partial tile: rows past its end hold stale bytes
#pragma unroll
      for (int nu = 0; nu < 2; ++nu)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const bool ok = !decltype(partial)::value || tile_token(g + 8 * e, nu) < n_tok;
          if constexpr (kRaw) {  // no key scale, no value scale or zero point
            vs[nu][e] = ok ? 1.0f : 0.0f;
            vz[nu][e] = 0.0f;
#pragma unroll
            for (int c = 0; c < 2; ++c) sc[nu][2 * e + c] = ok ? acc[nu][2 * e + c] * l2fac[c] : -INFINITY;
            continue;
          }
          const float ks = kFp8 ? 1.0f : __half2float(*reinterpret_cast<const __half*>(buf + norm_off[nu][e]));
          const __half2 sz = *reinterpret_cast<const __half2*>(buf + sz_off[nu][e]);
          vs[nu][e] = ok ? __low2float(sz) : 0.0f;
          vz[nu][e] = ok ? __high2float(sz) : 0.0f;
#pragma unroll
          for (int c = 0; c < 2; ++c) sc[nu][2 * e + c] = ok ? acc[nu][2 * e + c] * (ks * l2fac[c]) : -INFINITY;
        }
    };
    if (n_tok == kTok) {
      scale_scores(std::false_type{});
    } else {
      scale_scores(std::true_type{});
    }
    if (kMasked && one_mask_row) {  // the term of each score's key, from the lane that read it
#pragma unroll
      for (int nu = 0; nu < 2; ++nu)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float term = __shfl_sync(0xffffffffu, mask_term, tile_token(g + 8 * e, nu));
#pragma unroll
          for (int c = 0; c < 2; ++c) sc[nu][2 * e + c] += term;  // (lanes past the tile's end hold 0)
        }
    } else if constexpr (kMasked) {  // the mask's term (or -inf) on each score of a row the block holds
#pragma unroll
      for (int nu = 0; nu < 2; ++nu)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t key = begin + r0 + tile_token(g + 8 * e, nu);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int64_t at = mask_row[2 * t + c];
            if (at < 0 || sc[nu][2 * e + c] == -INFINITY) continue;  // no row, or past the tile's end
            float add;
            const bool allowed = mask_allows(p, mask, at + key * p.mask_stride[3], &add);
            sc[nu][2 * e + c] = allowed ? sc[nu][2 * e + c] + add * 1.44269504f : -INFINITY;
          }
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
      if constexpr (kRaw) {
        const uint32_t buf_at = smem_u32(buf);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, buf_at + raw_val_at[nu] + 16 * ((2 * mt + raw_val_half) ^ raw_val_swz[nu]));
          mma16816(o[mt], a[0], a[1], a[2], a[3], b0, b1);
        }
        continue;
      }
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
    if (it == 0) TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 19);
  }

  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 4);
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
  float* ws = reinterpret_cast<float*>(dyn + sl.states);  // [warp][row][3 + dv]: max, sum, zero sum, acc
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    if (2 * t + c >= rows) continue;  // a padding column: store_warp_states reads the block's rows only
    float* mine = ws + (warp * kRowsMax + 2 * t + c) * (3 + dv);
    if (g == 0) {
      mine[0] = m_run[c] * 0.693147181f;  // back to natural-log units for the merges
      mine[1] = l_run[c];
      mine[2] = z_run[c];
    }
    if constexpr (kRaw) {  // m-tile mt: row g is value column 16 mt + g, row g + 8 column 16 mt + g + 8
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        mine[3 + 16 * mt + g] = o[mt][c];
        mine[3 + 16 * mt + g + 8] = o[mt][2 + c];
      }
    } else {
      // m-tile 4w + j: row g is value column 8 (g + 8w) + 2j, row g + 8 the next column
#pragma unroll
      for (int w = 0; w < kValWords; ++w)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          mine[3 + 8 * (g + 8 * w) + 2 * j] = o[4 * w + j][c] * (kCodeUnit / code_weight(kValBits, 2 * j));
          mine[3 + 8 * (g + 8 * w) + 2 * j + 1] = o[4 * w + j][2 + c] * (kCodeUnit / code_weight(kValBits, 2 * j + 1));
        }
    }
  }
  __syncthreads();
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 5);
  static_assert(kWarps <= kStateWarpsMax && kRowsMax <= kStateRowsMax, "store_warp_states' factors");
  store_warp_states(ws, kWarps, kRowsMax, rows, dv, partial + ((bh * l.rows + row0) * l.splits + split) * partial_stride(dv),
                    l.splits * partial_stride(dv));
  TQ_PHASE(blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, 6);
  TQ_BLOCK(1);
}

// The key product's length: the padded head size for MSE keys, the head size for fp8 and raw16.
int tc_kd(const AttentionParams& p) {
  return p.key_format == Format::kFp8 || p.key_format == Format::kRaw16 ? p.head_dim : padded_dim(p.head_dim);
}

template <int kKeyBits, int kValBits, int kD, bool kKeyWords4, int kWarps, bool kMasked>
cudaError_t launch(const AttentionParams& p, const RotaryParams& rot, const SplitPlan& plan, const void* q,
                   const void* mask, const uint8_t* past_key, const uint8_t* past_value, float* partial,
                   cudaStream_t stream) {
  // Beyond 48 KiB per block (static + dynamic) a kernel has to opt in: per device, for the largest
  // size asked there so far
  auto kernel = tc_split_kernel<kKeyBits, kValBits, kD, kKeyWords4, kWarps, kMasked>;
  static SharedMemoryOptIn opt_in;
  const cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(kernel), plan.smem);
  if (e != cudaSuccess) return e;
  const Layout& l = plan.layout;
  const dim3 grid(static_cast<unsigned>(p.batch * p.kv_heads), l.splits, l.row_blocks);
  AttentionParams kp = p;  // the row sizes worked out here, once (see the kernel's kb, vb)
  kp.key_row_bytes = p.key_row();
  kp.value_row_bytes = p.value_row();
  return launch_dependent(kernel, grid, dim3(kWarps * 32), plan.smem, stream, kp, rot, l, q, past_key, past_value,
                          partial, mask);
}

// A mask is taken by the wide blocks (the presets' head sizes 64 and 128) and raw16's: masked_tc_bulk.
template <int kKeyBits, int kValBits, int kD, bool kKeyWords4, int kWarps>
cudaError_t launch_m(const AttentionParams& p, const RotaryParams& rot, const SplitPlan& plan, const void* q,
                     const void* mask, const uint8_t* past_key, const uint8_t* past_value, float* partial,
                     cudaStream_t stream) {
  if (mask == nullptr) {
    return launch<kKeyBits, kValBits, kD, kKeyWords4, kWarps, false>(p, rot, plan, q, nullptr, past_key, past_value,
                                                                     partial, stream);
  }
  if constexpr (kWarps == kWideWarps || kKeyBits == 16) {
    return launch<kKeyBits, kValBits, kD, kKeyWords4, kWarps, true>(p, rot, plan, q, mask, past_key, past_value,
                                                                    partial, stream);
  }
  return cudaErrorInvalidValue;  // plan_split gives these the CUDA-core kernel
}

template <int kKeyBits, int kValBits, bool kKeyWords4 = false>
cudaError_t launch_d(const AttentionParams& p, const RotaryParams& rot, const SplitPlan& plan, const void* q,
                     const void* mask, const uint8_t* past_key, const uint8_t* past_value, float* partial,
                     cudaStream_t stream) {
  constexpr int kWide = kWideWarps;
  const bool wide = plan.warps == kWide;
  switch (tc_kd(p)) {
    case 64:
      return wide ? launch_m<kKeyBits, kValBits, 64, kKeyWords4, kWide>(p, rot, plan, q, mask, past_key, past_value, partial, stream)
                  : launch_m<kKeyBits, kValBits, 64, kKeyWords4, 8>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
    case 128:
      return wide ? launch_m<kKeyBits, kValBits, 128, kKeyWords4, kWide>(p, rot, plan, q, mask, past_key, past_value, partial, stream)
                  : launch_m<kKeyBits, kValBits, 128, kKeyWords4, 8>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
    default: return launch_m<kKeyBits, kValBits, 256, kKeyWords4, 8>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
  }
}

}  // namespace

cudaError_t launch_tc_split(const AttentionParams& p, const RotaryParams& rot, const SplitPlan& plan, const void* q,
                            const void* mask, const uint8_t* past_key, const uint8_t* past_value, float* partial,
                            cudaStream_t stream) {
  if (plan.kernel != SplitKernel::kTensorCoreBulk) return cudaErrorInvalidValue;
  if (p.key_format == Format::kRaw16) {  // raw16 pairs: the warps their buffers leave room for (split_geometry.h)
    const uintptr_t a = reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value);
    if ((a & 15) != 0 || p.key_row() % 16 != 0 || p.value_row() % 16 != 0) return cudaErrorMisalignedAddress;
    constexpr int k64 = tc_geometry::kRaw16Warps64, k128 = tc_geometry::kRaw16Warps128;
    if (tc_kd(p) == 64 && plan.warps == k64) return launch_m<16, 16, 64, false, k64>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
    if (tc_kd(p) == 128 && plan.warps == k128) return launch_m<16, 16, 128, false, k128>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
    if (tc_kd(p) == 128 && plan.warps == 4) return launch_m<16, 16, 128, false, 4>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
    return cudaErrorInvalidValue;
  }
  if (p.key_format == Format::kFp8) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value);
    if ((a & 15) != 0) return cudaErrorMisalignedAddress;  // plan_split routes these to the other kernels
    return launch_d<8, 4>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
  }
  if (p.key_format == Format::kMse4) {
    const bool words = p.key_row() % 4 == 0 && (reinterpret_cast<uintptr_t>(past_key) & 3) == 0;
    return words ? launch_d<4, 4, true>(p, rot, plan, q, mask, past_key, past_value, partial, stream)
                 : launch_d<4, 4>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
  }
  return p.value_format == Format::kUint4 ? launch_d<3, 4>(p, rot, plan, q, mask, past_key, past_value, partial, stream)
                                          : launch_d<3, 3>(p, rot, plan, q, mask, past_key, past_value, partial, stream);
}

}  // namespace turboquant::cuda::detail

#ifdef TQ_PHASES
namespace turboquant::cuda {
TQ_PHASE_READER(tc_phase_times)
}  // namespace turboquant::cuda
#endif
