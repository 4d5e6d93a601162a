// Packing of vectors on the GPU, one warp per vector, shared by TQPack (pack.cu) and the packing
// of the new tokens into the present cache (finish.cu): the same operations in the same order as
// the CPU codec (turboquant/vector_codec.h), the butterflies of the rotation spread over the lanes,
// the norm's sum of squares as lane partial sums and a shuffle butterfly, the order the codec
// fixes; so the bytes are identical to the CPU kernels'.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "rotary_lanes.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/float_io.h"
#include "turboquant/rotary.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {

constexpr int kPackThreads = 128;
constexpr int kPackWarps = kPackThreads / 32;
constexpr unsigned kPackLanes = 0xffffffffu;

// Where vector v comes from and goes to. Vector indices fit 32 bits (the launcher checks), so the
// divisions are 32-bit ones.
struct VectorMap {
  // TQPack: x[v*d ..], out[v*bytes ..], offset row (v / period) % rows. Present: x[b*sb + h*sh +
  // n*ss ..] for v = (b*H + h)*N + n, out at row past(b) + n of (b, h) (rows.offset), offset row h.
  bool present = false;
  BhsStrides st;
  uint32_t heads = 1, new_len = 1;
  NewTokenRows rows;

  struct Where {
    int64_t in, out;
    uint32_t offset_row;
    bool inside;  // false: a row past the buffer's end (a device-side length out of range), not written
  };
  __device__ Where locate(uint32_t v, int d, int bytes, const Offset& offset) const {
    if (!present) {
      const uint32_t row = offset.data ? (v / static_cast<uint32_t>(offset.period)) % static_cast<uint32_t>(offset.rows) : 0;
      return {static_cast<int64_t>(v) * d, static_cast<int64_t>(v) * bytes, row, true};
    }
    const uint32_t n = v % new_len, bh = v / new_len, b = bh / heads, h = bh % heads;
    const int64_t row = rows.past_of(b) + n;
    return {b * st.b + h * st.h + n * st.s, rows.offset(bh, b, h, row), h, row < rows.present_rows};
  }
};

// codec::butterfly_total over the lanes' partial sums: every lane gets the total.
__device__ inline float warp_total(float x) {
  for (int o = 1; o < codec::kSumLanes; o <<= 1) x = __fadd_rn(x, __shfl_xor_sync(kPackLanes, x, o));
  return x;
}

// The warp's vector z (shared memory, d floats) encoded in format F into out. Templated on the
// format so that a kernel holds only the code its formats run: the new tokens' packing runs once
// per decode step, after the attention has streamed the cache through L2, so its instructions come
// from DRAM and a large kernel spends most of its time waiting for them. Products followed by sums
// are explicit roundings (__fmul_rn), so the bytes do not depend on the compiler's contraction.
// csq: the codebook's codec::centroid_square_q, in shared memory.
template <Format F>
__device__ inline void encode_warp(int d, bool nc, const int32_t* csq, float* z, uint8_t* idx, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if constexpr (F == Format::kFp8 || F == Format::kRaw16) {
    for (int i = lane; i < d; i += 32) {
      if constexpr (F == Format::kFp8) {
        out[i] = f32_to_fp8(z[i]);
      } else {
        codec::store_f16(out + 2 * i, f32_to_f16(z[i]));
      }
    }
    return;
  } else {
    constexpr int bits = format_bits(F);
    int n_codes = d;
    float scale_out = 0.0f, zero_out = 0.0f;
    if constexpr (is_mse(F)) {
      const int dp = padded_dim(d);
      n_codes = dp;
      float n2 = 0.0f;
      for (int i = lane; i < d; i += 32) n2 = __fadd_rn(n2, __fmul_rn(z[i], z[i]));
      const float n = __fsqrt_rn(warp_total(n2));
      const float r = codec::norm_reciprocal(n);
      __syncwarp();
      for (int i = lane; i < dp; i += 32) z[i] = i < d ? __fmul_rn(z[i], r) : 0.0f;
      __syncwarp();
#pragma unroll 1  // the levels: one copy of the butterfly loop
      for (int lv = 0; (1 << lv) < dp; ++lv) {  // butterflies at distance h = 2^lv
        const int h = 1 << lv;
        for (int k = lane; k < dp / 2; k += 32) {
          const int i = ((k >> lv) << (lv + 1)) | (k & (h - 1));
          const float a = z[i], b = z[i + h];
          z[i] = a + b;
          z[i + h] = a - b;
        }
        __syncwarp();
      }
      for (int i = lane; i < dp; i += 32) idx[i] = codec::codebook_index(bits, z[i]);
      __syncwarp();
      scale_out = n;
      if (nc) {  // csq: a shared copy, as lanes read different entries, which constant memory serialises
        int32_t cq = 0;
        for (int i = lane; i < dp; i += 32) cq += csq[idx[i]];
        scale_out = codec::corrected_scale(n, dp, __reduce_add_sync(kPackLanes, cq));
      }
    } else {  // uint3 / uint4: min and max are order-free
      float mn = z[0], mx = z[0];
      bool nan = false;
      for (int i = lane; i < d; i += 32) {
        mn = z[i] < mn ? z[i] : mn;
        mx = z[i] > mx ? z[i] : mx;
        nan = nan || z[i] != z[i];
      }
      nan = __any_sync(kPackLanes, nan);
      for (int o = 16; o > 0; o >>= 1) {
        const float a = __shfl_xor_sync(kPackLanes, mn, o), b = __shfl_xor_sync(kPackLanes, mx, o);
        mn = a < mn ? a : mn;
        mx = b > mx ? b : mx;
      }
      const float levels = static_cast<float>((1 << bits) - 1);
      const float range = (mx - mn) / levels;
      const uint16_t s16 = nan ? codec::kUintNanBits : f32_to_f16_sat(range > 1e-8f ? range : 1e-8f);
      const uint16_t z16 = nan ? codec::kUintNanBits : f32_to_f16_sat(mn + 0.0f);
      const float sc = f16_to_f32(s16), zr = f16_to_f32(z16);
      for (int i = lane; i < d; i += 32) {  // a NaN scale fails sc > 0: every code 0
        float v = sc > 0.0f ? floorf((z[i] - zr) / sc + 0.5f) : 0.0f;
        v = v < 0.0f ? 0.0f : (v > levels ? levels : v);
        idx[i] = static_cast<uint8_t>(v);
      }
      __syncwarp();
      scale_out = sc;
      zero_out = zr;
    }
    const int nbytes = n_codes * bits / 8;
    if constexpr (bits == 4) {
      for (int j = lane; j < nbytes; j += 32) out[j] = static_cast<uint8_t>(idx[2 * j] | (idx[2 * j + 1] << 4));
    } else {
      for (int g = lane; g < n_codes / 8; g += 32) {
        uint32_t w = 0;
        for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(idx[8 * g + k]) << (3 * k);
        out[3 * g] = static_cast<uint8_t>(w);
        out[3 * g + 1] = static_cast<uint8_t>(w >> 8);
        out[3 * g + 2] = static_cast<uint8_t>(w >> 16);
      }
    }
    if (lane == 0) {
      codec::store_f16(out + nbytes, f32_to_f16_sat(scale_out));
      if constexpr (is_uint(F)) codec::store_f16(out + nbytes + 2, f32_to_f16_sat(zero_out));
    }
  }
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

// The codec's code min(max(floor(t), 0), levels) (0 for a NaN t, as its float-to-integer cast
// gives): clamping first to [0, levels + 0.5] commutes with the floor, and adding 2^23 rounding
// down floors a float in [0, 2^23) into the low bits, without the conversion instructions.
__device__ inline uint32_t uint_code(float t, float levels) {
  const float c = fminf(fmaxf(t, 0.0f), levels + 0.5f);  // (a NaN becomes 0)
  return __float_as_uint(__fadd_rd(c, 8388608.0f)) - 0x4b000000u;
}

// encode_warp's bytes from registers: lane holding elements lane + 32 c (c < kC, zeros past d; for
// the MSE formats 32 kC is padded_dim(d)), by the same operations in the same order (the butterflies
// at distances 1 .. 16 by shuffles, then in registers; the codes gathered by shuffles). No shared
// memory and no per-element branches: a decode step's new token is packed by this path after the
// attention has streamed the cache, and its time is the fetch of its instructions and its chain of
// dependent steps (docs/performance.md, the new token's packing).
template <Format F, int kC>
__device__ inline void encode_lanes(float (&x)[kC], int d, bool nc, const int32_t* csq, uint8_t* out) {
  const int lane = threadIdx.x & 31;
  if constexpr (F == Format::kFp8 || F == Format::kRaw16) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      if (i >= d) continue;
      if constexpr (F == Format::kFp8) {
        out[i] = f32_to_fp8(x[c]);
      } else {
        codec::store_f16(out + 2 * i, f32_to_f16(x[c]));
      }
    }
    return;
  } else {
    constexpr int bits = format_bits(F);
    uint32_t code[kC];
    int n_codes = d;
    float scale_out = 0.0f, zero_out = 0.0f;
    if constexpr (is_mse(F)) {
      constexpr int dp = 32 * kC;
      n_codes = dp;
      float n2 = 0.0f;
#pragma unroll
      for (int c = 0; c < kC; ++c) n2 = __fadd_rn(n2, __fmul_rn(x[c], x[c]));  // zeros past d add nothing
      const float n = __fsqrt_rn(warp_total(n2));
      const float r = codec::norm_reciprocal(n);
#pragma unroll
      for (int c = 0; c < kC; ++c) x[c] = lane + 32 * c < d ? __fmul_rn(x[c], r) : 0.0f;
#pragma unroll
      for (int h = 1; h < 32; h <<= 1) {
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          const float o = __shfl_xor_sync(kPackLanes, x[c], h);
          x[c] = (lane & h) ? o - x[c] : x[c] + o;  // lower element: a + b; upper: a - b (a the lower's)
        }
      }
#pragma unroll
      for (int h = 1; h < kC; h <<= 1) {
#pragma unroll
        for (int c = 0; c < kC; ++c) {
          if (c & h) continue;
          const float a = x[c], b = x[c + h];
          x[c] = a + b;
          x[c + h] = a - b;
        }
      }
      int32_t cq = 0;
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        code[c] = codec::codebook_index(bits, x[c]);
        cq += csq[code[c]];
      }
      scale_out = nc ? codec::corrected_scale(n, dp, __reduce_add_sync(kPackLanes, cq)) : n;
    } else {  // uint3 / uint4: min and max are order-free (element 0 to start, as encode_warp)
      float mn = __shfl_sync(kPackLanes, x[0], 0), mx = mn;
      bool nan = false;
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        if (lane + 32 * c >= d) continue;
        mn = x[c] < mn ? x[c] : mn;
        mx = x[c] > mx ? x[c] : mx;
        nan = nan || x[c] != x[c];
      }
      nan = __any_sync(kPackLanes, nan);
      for (int o = 16; o > 0; o >>= 1) {
        const float a = __shfl_xor_sync(kPackLanes, mn, o), b = __shfl_xor_sync(kPackLanes, mx, o);
        mn = a < mn ? a : mn;
        mx = b > mx ? b : mx;
      }
      const float levels = static_cast<float>((1 << bits) - 1);
      const float range = (mx - mn) / levels;
      const uint16_t s16 = nan ? codec::kUintNanBits : f32_to_f16_sat(range > 1e-8f ? range : 1e-8f);
      const uint16_t z16 = nan ? codec::kUintNanBits : f32_to_f16_sat(mn + 0.0f);
      const float sc = f16_to_f32(s16), zr = f16_to_f32(z16);
      // by the reciprocal where that is the quotient (pack_four_lanes.cuh); a NaN scale fails
      // sc > 0: every code 0
      const bool quick = sc > 0.0f && fabsf(mn) < 0x1p99f && fabsf(mx) < 0x1p99f;
      const float recip = quick ? __frcp_rn(sc) : 0.0f;
#pragma unroll
      for (int c = 0; c < kC; ++c) {
        const float t = x[c] - zr;
        const float q = quick ? div_by_reciprocal(t, sc, recip) : sc > 0.0f ? t / sc : -0.5f;
        code[c] = uint_code(q + 0.5f, levels);
      }
      scale_out = sc;
      zero_out = zr;
    }
    const int nbytes = n_codes * bits / 8;
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      if constexpr (bits == 4) {  // byte i / 2: codes i (low) and i + 1 of the next lane
        const uint32_t hi = __shfl_down_sync(kPackLanes, code[c], 1);
        if (!(lane & 1) && i < n_codes) out[i >> 1] = static_cast<uint8_t>(code[c] | hi << 4);
      } else {  // 3 bytes per 8 codes, code k of the group at bit 3 k
        uint32_t w = code[c] << (3 * (lane & 7));
        w |= __shfl_xor_sync(kPackLanes, w, 1);
        w |= __shfl_xor_sync(kPackLanes, w, 2);
        w |= __shfl_xor_sync(kPackLanes, w, 4);
        if (!(lane & 7) && i < n_codes) {
          uint8_t* at = out + 3 * (i >> 3);
          at[0] = static_cast<uint8_t>(w);
          at[1] = static_cast<uint8_t>(w >> 8);
          at[2] = static_cast<uint8_t>(w >> 16);
        }
      }
    }
    if (lane == 0) {
      codec::store_f16(out + nbytes, f32_to_f16_sat(scale_out));
      if constexpr (is_uint(F)) codec::store_f16(out + nbytes + 2, f32_to_f16_sat(zero_out));
    }
  }
}

// One format's vectors: n of them, x and out addressed through map, over `blocks` blocks.
struct PackJob {
  Format fmt = Format::kMse4;
  int d = 0, bytes = 0;
  const void* x = nullptr;
  int64_t n = 0, blocks = 0;
  Offset offset;
  VectorMap map;
  uint8_t* out = nullptr;
  RotaryParams rot;  // present maps: each vector rotated first (TQGroupQueryAttention's new keys, fused)
};

inline PackJob make_job(Format fmt, int d, const void* x, int64_t n, const Offset& offset, const VectorMap& map, uint8_t* out) {
  PackJob j;
  j.fmt = fmt, j.d = d, j.bytes = static_cast<int>(packed_size(fmt, d)), j.x = x, j.n = n;
  j.blocks = (n + kPackWarps - 1) / kPackWarps, j.offset = offset, j.map = map, j.out = out;
  return j;
}

// Vector v of job j in registers (lane + 32 c for c < kC, zeros past d; 32 kC is d, or padded_dim(d)
// for the MSE formats), rotated (fused rotary) and less its offset, encoded by encode_lanes.
template <Format F, int kC>
__device__ inline void pack_vector_lanes(const PackJob& j, uint32_t v, bool nc, DType dt, const int32_t* csq, float* z) {
  const int lane = threadIdx.x & 31;
  const VectorMap::Where at = j.map.locate(v, j.d, j.bytes, j.offset);
  const float* off = j.offset.data ? j.offset.data + static_cast<int64_t>(at.offset_row) * j.d : nullptr;
  const RotaryParams& rot = j.rot;
  const bool rotary = rot.rotary_dim > 0;
  const bool paired = rotary && rotates_in_lanes<kC>(rot, j.d);  // else through the warp's shared row
  uint32_t bits[kC];
  float offs[kC];
  int64_t pos = 0;
  uint32_t h = 0;
  if (rotary) {
    const uint32_t n = v % j.map.new_len, bh = v / j.map.new_len, b = bh / j.map.heads;
    h = bh % j.map.heads;
    pos = rotary_position(rot, b, n, j.map.new_len, j.map.rows.past_of(b));
  }
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const int i = lane + 32 * c;
    bits[c] = i < j.d ? load_bits(dt, j.x, at.in + i) : 0u;
    offs[c] = off && i < j.d ? off[i] : 0.0f;
  }
  float x[kC];
  bits_floats(dt, bits, x);  // zeros past d (their bits are)
  if (paired) {
    rotate_lanes(rot, dt, pos, x, key_scale_row(rot, h, j.d), ScaleSide::kKey);
  } else if (rotary) {  // other layouts of the rotation: through the warp's shared row
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      if (i < j.d) z[i] = x[c];
    }
    __syncwarp();
    rotate_shared(rot, dt, j.d, pos, z, lane, 32, key_scale_row(rot, h, j.d), ScaleSide::kKey);
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const int i = lane + 32 * c;
      x[c] = i < j.d ? z[i] : 0.0f;
    }
  }
  if (off) {
#pragma unroll
    for (int c = 0; c < kC; ++c) x[c] -= offs[c];  // zero past d
  }
  if (!at.inside) return;
  encode_lanes<F, kC>(x, j.d, nc, csq, j.out + at.out);
}

template <Format F>
__device__ inline void pack_vector(const PackJob& j, uint32_t block, bool nc, DType dt, const int32_t* csq, float* z,
                            uint8_t* idx) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const uint32_t v = block * kPackWarps + warp;
  if (v >= j.n) return;  // whole warps leave together
  switch (is_mse(F) ? padded_dim(j.d) : j.d) {  // the register path where 32 lanes hold whole chunks
    case 64: return pack_vector_lanes<F, 2>(j, v, nc, dt, csq, z);
    case 128: return pack_vector_lanes<F, 4>(j, v, nc, dt, csq, z);
    case 256: return pack_vector_lanes<F, 8>(j, v, nc, dt, csq, z);
    default: break;
  }
  const VectorMap::Where at = j.map.locate(v, j.d, j.bytes, j.offset);
  const float* off = j.offset.data ? j.offset.data + static_cast<int64_t>(at.offset_row) * j.d : nullptr;
  // A lane's elements (and offsets) are all loaded before the first is converted: with load_float
  // the compiler waited for each load in turn, kMaxHeadDim / 32 round trips to memory at the start
  // of a chain that ends a small decode step (the new token's packing).
  constexpr int kPer = kMaxHeadDim / 32;
  uint32_t bits[kPer];
  float offs[kPer];
#pragma unroll
  for (int c = 0; c < kPer; ++c) {
    const int i = lane + 32 * c;
    bits[c] = i < j.d ? load_bits(dt, j.x, at.in + i) : 0u;
    offs[c] = off && i < j.d ? off[i] : 0.0f;
  }
  if (j.rot.rotary_dim > 0) {  // the rotary embedding first, rounded to dt as a rotated copy holds it
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      if (i < j.d) z[i] = bits_float(dt, bits[c]);
    }
    __syncwarp();
    const uint32_t n = v % j.map.new_len, bh = v / j.map.new_len, b = bh / j.map.heads, h = bh % j.map.heads;
    rotate_shared(j.rot, dt, j.d, rotary_position(j.rot, b, n, j.map.new_len, j.map.rows.past_of(b)), z, lane, 32,
                  key_scale_row(j.rot, h, j.d), ScaleSide::kKey);
    __syncwarp();
    if (off) {
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        const int i = lane + 32 * c;
        if (i < j.d) z[i] -= offs[c];
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      if (i < j.d) {
        float xi = bits_float(dt, bits[c]);
        if (off) xi -= offs[c];
        z[i] = xi;
      }
    }
  }
  __syncwarp();
  if (!at.inside) return;
  encode_warp<F>(j.d, nc, csq, z, idx, j.out + at.out);
}

// The new tokens of one cache (x [B, H, N, d], minus offset[h]) as a job for the rows after each
// sequence's past.
inline PackJob new_token_job(Format fmt, int d, const void* x, const BhsStrides& st, int64_t batch, int64_t heads,
                             int64_t new_len, const NewTokenRows& rows, const float* offset, uint8_t* present) {
  VectorMap map;
  map.present = true;
  map.st = st;
  map.heads = static_cast<uint32_t>(heads);
  map.new_len = static_cast<uint32_t>(new_len);
  map.rows = rows;
  Offset off;
  off.data = offset;  // row = head, chosen by the kernel
  off.rows = heads;
  off.period = 1;
  return make_job(fmt, d, x, batch * heads * new_len, off, map, present);
}

// Fills csq[0..16) with the centroid squares of F's codebook (MSE formats) for the block's warps;
// syncs the block.
template <Format F>
__device__ inline void load_centroid_squares(int32_t* csq) {
  if constexpr (is_mse(F)) {
    constexpr int kBits = format_bits(F);
    if (threadIdx.x < 16) csq[threadIdx.x] = codec::centroid_square_q(kBits, threadIdx.x % (1 << kBits));
  }
  __syncthreads();
}

// Block `block` of a job: its kPackWarps warps pack one vector each (z, idx: per-warp scratch).
template <Format F>
__device__ inline void pack_block(const PackJob& j, uint32_t block, bool nc, DType dt, int32_t* csq, float (*z)[kMaxHeadDim],
                                  uint8_t (*idx)[kMaxHeadDim]) {
  load_centroid_squares<F>(csq);
  const int warp = threadIdx.x / 32;
  pack_vector<F>(j, block, nc, dt, csq, z[warp], idx[warp]);
}

// pack_block for a format known only at run time (pairs of formats no kernel is specialised for).
__device__ inline void pack_block_any(const PackJob& j, uint32_t block, bool nc, DType dt, int32_t* csq,
                                      float (*z)[kMaxHeadDim], uint8_t (*idx)[kMaxHeadDim]) {
  switch (j.fmt) {
    case Format::kMse3: pack_block<Format::kMse3>(j, block, nc, dt, csq, z, idx); break;
    case Format::kMse4: pack_block<Format::kMse4>(j, block, nc, dt, csq, z, idx); break;
    case Format::kUint3: pack_block<Format::kUint3>(j, block, nc, dt, csq, z, idx); break;
    case Format::kUint4: pack_block<Format::kUint4>(j, block, nc, dt, csq, z, idx); break;
    case Format::kFp8: pack_block<Format::kFp8>(j, block, nc, dt, csq, z, idx); break;
    case Format::kRaw16: pack_block<Format::kRaw16>(j, block, nc, dt, csq, z, idx); break;
    default: break;
  }
}

}  // namespace turboquant::cuda::detail
