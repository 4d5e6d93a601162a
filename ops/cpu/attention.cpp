// TQAttention on the CPU (docs/design.md sections 3 and 4).
//
// Work is split into tasks of up to kMaxRows query rows (the query heads of one GQA group, at one or
// more positions) against one KV head, so every packed KV byte is read once per task. Per task:
// 1. scores against MSE keys through per-row lookup tables over pairs of packed indices (a byte for
//    4-bit keys, 6 bits for 3-bit keys): score = s * sum_pairs LUT[pair][code], with the query rotated
//    once (q . H) and the softmax scale folded into the table; no key is ever dequantized;
// 2. scores against other key formats by decoding the key row once and dotting it with every row;
// 3. the new tokens' keys exactly, in float32, with the key offset removed;
// 4. mask, causal limit (aligned to the end of the cache) and softmax;
// 5. values dequantized on the fly: for uint formats sum_j p_j (q_j * scale_j + zero_j) is
//    accumulated as (p_j * scale_j) * q_j plus a separate sum of p_j * zero_j.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"
#include "turboquant/codebook_data.h"
#include "turboquant/cpu_kernels.h"

namespace turboquant::cpu {
namespace {

constexpr int kMaxRows = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float load_f16_le(const uint8_t* in) { return f16_to_f32(static_cast<uint16_t>(in[0] | (in[1] << 8))); }

// LUT[pair][code][RP]: code = idx[2p] | idx[2p+1] << bits; RP rows (padded with zeros).
template <int RP>
void build_pair_lut(int bits, int dp, int rows, const float* qrot, float* lut) {
  const double* c = bits == 3 ? codebook::kCentroids3 : codebook::kCentroids4;
  const int ncode = 1 << (2 * bits), mask = (1 << bits) - 1;
  for (int p = 0; p < dp / 2; ++p) {
    float* base = lut + static_cast<size_t>(p) * ncode * RP;
    for (int code = 0; code < ncode; ++code) {
      const float c0 = static_cast<float>(c[code & mask]), c1 = static_cast<float>(c[code >> bits]);
      float* e = base + code * RP;
      for (int r = 0; r < RP; ++r) {
        e[r] = r < rows ? qrot[r * dp + 2 * p] * c0 + qrot[r * dp + 2 * p + 1] * c1 : 0.0f;
      }
    }
  }
}

// Scores of `count` packed MSE keys for RP rows: out[r * out_stride + j].
// RP floats as one value (GCC/Clang vector extension): one load and one add per LUT entry, on any
// target the compiler knows (AVX2 here, NEON on ARM).
template <int RP>
struct Lanes {
  typedef float type __attribute__((vector_size(sizeof(float) * RP)));
};
template <>
struct Lanes<1> {
  typedef float type;
};

template <int RP>
inline typename Lanes<RP>::type load_lanes(const float* p) {
  typename Lanes<RP>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int RP, int BITS>
void score_mse_keys(int dp, const float* lut, const uint8_t* keys, int64_t key_bytes, int64_t count, int rows,
                    float* out, int64_t out_stride) {
  using V = typename Lanes<RP>::type;
  constexpr int kCodes = 1 << (2 * BITS);
  const int index_bytes = dp * BITS / 8;
  for (int64_t j = 0; j < count; ++j) {
    const uint8_t* kb = keys + j * key_bytes;
    // Four independent partial sums keep the adds from forming one long dependency chain.
    V a0{}, a1{}, a2{}, a3{};
    if constexpr (BITS == 4) {
      const float* base = lut;
      for (int p = 0; p < index_bytes; p += 4, base += 4 * kCodes * RP) {  // Dp/2 bytes, a multiple of 4
        a0 += load_lanes<RP>(base + kb[p] * RP);
        a1 += load_lanes<RP>(base + (kCodes + kb[p + 1]) * RP);
        a2 += load_lanes<RP>(base + (2 * kCodes + kb[p + 2]) * RP);
        a3 += load_lanes<RP>(base + (3 * kCodes + kb[p + 3]) * RP);
      }
    } else {
      const float* base = lut;
      for (int t = 0; t < index_bytes; t += 3, base += 4 * kCodes * RP) {
        const uint32_t w = kb[t] | (kb[t + 1] << 8) | (kb[t + 2] << 16);
        a0 += load_lanes<RP>(base + (w & 63u) * RP);
        a1 += load_lanes<RP>(base + (kCodes + ((w >> 6) & 63u)) * RP);
        a2 += load_lanes<RP>(base + (2 * kCodes + ((w >> 12) & 63u)) * RP);
        a3 += load_lanes<RP>(base + (3 * kCodes + (w >> 18)) * RP);
      }
    }
    const float s = load_f16_le(kb + index_bytes);
    float acc[RP];
    const V sum = (a0 + a1) + (a2 + a3);
    std::memcpy(acc, &sum, sizeof(acc));
    for (int r = 0; r < rows; ++r) out[r * out_stride + j] = acc[r] * s;
  }
}

template <int RP>
void score_mse_dispatch(int bits, int dp, const float* qrot, int rows, const uint8_t* keys, int64_t key_bytes,
                        int64_t count, float* out, int64_t out_stride, std::vector<float>& lut) {
  lut.assign(static_cast<size_t>(dp / 2) * (1u << (2 * bits)) * RP, 0.0f);
  build_pair_lut<RP>(bits, dp, rows, qrot, lut.data());
  if (bits == 4) {
    score_mse_keys<RP, 4>(dp, lut.data(), keys, key_bytes, count, rows, out, out_stride);
  } else {
    score_mse_keys<RP, 3>(dp, lut.data(), keys, key_bytes, count, rows, out, out_stride);
  }
}

// exp(x) for x <= 0 (scores minus their row maximum), vectorisable: 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2/2, p a degree-6 Taylor polynomial (relative error < 2e-7). Below -87 (and for -inf,
// the masked keys) it returns exactly 0.
inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = bits_f32(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * scale;
}

float dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// Codes of a value row as floats, two at a time: a byte holds two 4-bit codes, 6 bits two 3-bit ones.
struct NibblePairs {
  float t[256][2];
  float t3[64][2];
  NibblePairs() {
    for (int b = 0; b < 256; ++b) {
      t[b][0] = static_cast<float>(b & 15);
      t[b][1] = static_cast<float>(b >> 4);
    }
    for (int b = 0; b < 64; ++b) {
      t3[b][0] = static_cast<float>(b & 7);
      t3[b][1] = static_cast<float>(b >> 3);
    }
  }
};
const NibblePairs kNibbles;

struct Fp8Table {
  float t[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) t[b] = fp8_to_f32(static_cast<uint8_t>(b));
  }
};
const Fp8Table kFp8Table;

void codes_as_floats(int bits, int d, const uint8_t* in, float* out) {
  if (bits == 4) {
    for (int i = 0; i < d / 2; ++i) std::memcpy(out + 2 * i, kNibbles.t[in[i]], sizeof(float) * 2);
    return;
  }
  for (int i = 0; i < d; i += 8, in += 3) {  // 3 bits: 3 bytes hold 8 codes, read as 4 pairs of 6 bits
    const uint32_t w = in[0] | (in[1] << 8) | (in[2] << 16);
    std::memcpy(out + i, kNibbles.t3[w & 63u], sizeof(float) * 2);
    std::memcpy(out + i + 2, kNibbles.t3[(w >> 6) & 63u], sizeof(float) * 2);
    std::memcpy(out + i + 4, kNibbles.t3[(w >> 12) & 63u], sizeof(float) * 2);
    std::memcpy(out + i + 6, kNibbles.t3[w >> 18], sizeof(float) * 2);
  }
}

struct Task {
  int64_t b, hkv, row0;  // rows are (position, group member) pairs: row = pos * group + g
  int rows;
};

class Runner {
 public:
  Runner(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
         const uint8_t* past_key, const uint8_t* past_value, void* y)
      : p_(p), q_(q), k_(k), v_(v), mask_(mask), past_key_(past_key), past_value_(past_value), y_(y) {
    group_ = static_cast<int>(p.q_heads / p.kv_heads);
    past_rows_ = p.past_rows_or_len();
    key_bytes_ = p.key_row();
    value_bytes_ = p.value_row();
  }

  int64_t rows_per_head() const { return p_.q_len * group_; }

  void run(const Task& t) const {
    const int d = p_.head_dim, dv = p_.v_head_dim, rows = t.rows;
    const int64_t sp = p_.past_of(t.b);  // this sequence's past tokens
    const int64_t stot = sp + p_.new_len;
    std::vector<float> qf(static_cast<size_t>(rows) * d);
    std::vector<float> sc(static_cast<size_t>(rows) * stot);
    int64_t pos[kMaxRows], hq[kMaxRows];
    for (int r = 0; r < rows; ++r) {
      const int64_t row = t.row0 + r;
      pos[r] = row / group_;
      hq[r] = t.hkv * group_ + row % group_;
      load_row(p_.dtype, q_, t.b * p_.q.b + hq[r] * p_.q.h + pos[r] * p_.q.s, d, &qf[static_cast<size_t>(r) * d]);
    }
    const float* koff = p_.key_offset ? p_.key_offset + t.hkv * d : nullptr;
    const float* voff = p_.value_offset ? p_.value_offset + t.hkv * dv : nullptr;

    // 1-2. past keys
    if (sp > 0) {
      const uint8_t* keys = past_key_ + (t.b * p_.kv_heads + t.hkv) * past_rows_ * key_bytes_;
      if (is_mse(p_.key_format)) {
        const int dp = padded_dim(d);
        std::vector<float> qrot(static_cast<size_t>(rows) * dp, 0.0f);
        const float fold = p_.scale / static_cast<float>(dp);
        for (int r = 0; r < rows; ++r) {
          float* qr = &qrot[static_cast<size_t>(r) * dp];
          for (int i = 0; i < d; ++i) qr[i] = qf[static_cast<size_t>(r) * d + i] * fold;
          codec::fwht_inplace(qr, dp);
        }
        std::vector<float> lut;
        const int bits = format_bits(p_.key_format);
        if (rows <= 1) score_mse_dispatch<1>(bits, dp, qrot.data(), rows, keys, key_bytes_, sp, sc.data(), stot, lut);
        else if (rows <= 2) score_mse_dispatch<2>(bits, dp, qrot.data(), rows, keys, key_bytes_, sp, sc.data(), stot, lut);
        else if (rows <= 4) score_mse_dispatch<4>(bits, dp, qrot.data(), rows, keys, key_bytes_, sp, sc.data(), stot, lut);
        else score_mse_dispatch<8>(bits, dp, qrot.data(), rows, keys, key_bytes_, sp, sc.data(), stot, lut);
      } else {
        float kf[kMaxHeadDim];
        for (int64_t j = 0; j < sp; ++j) {
          const uint8_t* kb = keys + j * key_bytes_;
          if (p_.key_format == Format::kFp8) {
            for (int i = 0; i < d; ++i) kf[i] = kFp8Table.t[kb[i]];
          } else {
            decode_vector(p_.key_format, d, kb, kf);
          }
          for (int r = 0; r < rows; ++r) sc[r * stot + j] = dot(&qf[static_cast<size_t>(r) * d], kf, d) * p_.scale;
        }
      }
    }
    // 3. new keys, exact
    {
      float kf[kMaxHeadDim];
      for (int64_t n = 0; n < p_.new_len; ++n) {
        load_row(p_.dtype, k_, t.b * p_.k.b + t.hkv * p_.k.h + n * p_.k.s, d, kf);
        if (koff) for (int i = 0; i < d; ++i) kf[i] -= koff[i];
        for (int r = 0; r < rows; ++r) sc[r * stot + sp + n] = dot(&qf[static_cast<size_t>(r) * d], kf, d) * p_.scale;
      }
    }
    // 4. mask, causal limit, softmax (unnormalised; divided at the end)
    float denom[kMaxRows], past_mass[kMaxRows];
    bool live[kMaxRows];
    for (int r = 0; r < rows; ++r) {
      float* s = &sc[static_cast<size_t>(r) * stot];
      apply_mask(t.b, hq[r], pos[r], stot, s);
      float mx = kNegInf;
      for (int64_t j = 0; j < stot; ++j) mx = std::max(mx, s[j]);
      live[r] = mx != kNegInf;
      const float shift = live[r] ? mx : 0.0f;
      for (int64_t j = 0; j < stot; ++j) s[j] = exp_nonpositive(s[j] - shift);
      float sum = 0.0f, psum = 0.0f;
      for (int64_t j = 0; j < sp; ++j) psum += s[j];
      sum = psum;
      for (int64_t j = sp; j < stot; ++j) sum += s[j];
      denom[r] = sum;
      past_mass[r] = psum;
    }
    // 5. values
    std::vector<float> acc(static_cast<size_t>(rows) * dv, 0.0f);
    float zsum[kMaxRows] = {};
    float vf[kMaxHeadDim];
    if (sp > 0) accumulate_past_values(t, rows, sp, stot, sc.data(), acc.data(), zsum);
    for (int64_t n = 0; n < p_.new_len; ++n) {
      load_row(p_.dtype, v_, t.b * p_.v.b + t.hkv * p_.v.h + n * p_.v.s, dv, vf);
      for (int r = 0; r < rows; ++r) axpy(sc[r * stot + sp + n], vf, &acc[static_cast<size_t>(r) * dv], dv);
    }
    for (int r = 0; r < rows; ++r) {
      const int64_t base = t.b * p_.y.b + hq[r] * p_.y.h + pos[r] * p_.y.s;
      const float inv = live[r] ? 1.0f / denom[r] : 0.0f;
      for (int i = 0; i < dv; ++i) {
        float o = acc[static_cast<size_t>(r) * dv + i] + zsum[r];
        if (voff) o += voff[i] * past_mass[r];
        store_float(p_.dtype, y_, base + i, o * inv);
      }
    }
  }

 private:
  // acc[r][:] += sum_j p[r][j] * decode(value_j) over the past tokens, a tile of kTile tokens at a
  // time: the tile's rows are decoded once into floats, then each 8-wide column block of the
  // accumulators stays in registers while the tile's tokens are added into it. For uint formats the
  // codes are used as they are and the zero points summed apart: p * (q * scale + zero).
  void accumulate_past_values(const Task& t, int rows, int64_t sp, int64_t stot, const float* sc, float* acc,
                              float* zsum) const {
    constexpr int kTile = 16;
    const int dv = p_.v_head_dim;
    const uint8_t* vals = past_value_ + (t.b * p_.kv_heads + t.hkv) * past_rows_ * value_bytes_;
    const bool uint_fmt = is_uint(p_.value_format);
    const int bits = format_bits(p_.value_format);
    const int nb = payload_bytes(p_.value_format, dv);
    alignas(32) float tile[kTile][kMaxHeadDim];
    float w[kMaxRows][kTile];
    for (int64_t j0 = 0; j0 < sp; j0 += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, sp - j0));
      for (int u = 0; u < n; ++u) {
        const uint8_t* vb = vals + (j0 + u) * value_bytes_;
        float vscale = 1.0f;
        if (uint_fmt) {
          codes_as_floats(bits, dv, vb, tile[u]);
          vscale = load_f16_le(vb + nb);
          const float vzero = load_f16_le(vb + nb + 2);
          for (int r = 0; r < rows; ++r) zsum[r] += sc[r * stot + j0 + u] * vzero;
        } else {
          decode_vector(p_.value_format, dv, vb, tile[u]);
        }
        for (int r = 0; r < rows; ++r) w[r][u] = sc[r * stot + j0 + u] * vscale;
      }
      switch (rows) {
        case 1: add_tile<1>(n, dv, tile, w, acc); break;
        case 2: add_tile<2>(n, dv, tile, w, acc); break;
        case 3: add_tile<3>(n, dv, tile, w, acc); break;
        case 4: add_tile<4>(n, dv, tile, w, acc); break;
        case 5: add_tile<5>(n, dv, tile, w, acc); break;
        case 6: add_tile<6>(n, dv, tile, w, acc); break;
        case 7: add_tile<7>(n, dv, tile, w, acc); break;
        default: add_tile<8>(n, dv, tile, w, acc); break;
      }
    }
  }

  template <int R, int kTile>
  static void add_tile(int n, int dv, const float (*tile)[kMaxHeadDim], const float (*w)[kTile], float* acc) {
    using V8 = Lanes<8>::type;
    for (int c = 0; c < dv; c += 8) {
      V8 a[R];
      for (int r = 0; r < R; ++r) a[r] = load_lanes<8>(acc + r * dv + c);
      for (int u = 0; u < n; ++u) {
        const V8 x = load_lanes<8>(tile[u] + c);
        for (int r = 0; r < R; ++r) a[r] += w[r][u] * x;
      }
      for (int r = 0; r < R; ++r) std::memcpy(acc + r * dv + c, &a[r], sizeof(V8));
    }
  }

  void apply_mask(int64_t b, int64_t hq, int64_t pos, int64_t stot, float* s) const {
    if (p_.is_causal) {
      const int64_t limit = pos + (stot - p_.q_len);  // keys j <= limit are visible
      for (int64_t j = std::max<int64_t>(0, limit + 1); j < stot; ++j) s[j] = kNegInf;
    }
    if (p_.mask_type == MaskType::kNone) return;
    const int64_t* st = p_.mask_stride;
    const int64_t base = b * st[0] + hq * st[1] + pos * st[2];
    for (int64_t j = 0; j < stot; ++j) {
      const int64_t i = base + j * st[3];
      switch (p_.mask_type) {
        case MaskType::kBool:
          if (!static_cast<const uint8_t*>(mask_)[i]) s[j] = kNegInf;
          break;
        case MaskType::kFloat32: s[j] += static_cast<const float*>(mask_)[i]; break;
        case MaskType::kFloat16: s[j] += f16_to_f32(static_cast<const uint16_t*>(mask_)[i]); break;
        case MaskType::kBFloat16: s[j] += bf16_to_f32(static_cast<const uint16_t*>(mask_)[i]); break;
        default: break;
      }
    }
  }

  const AttentionParams& p_;
  const void *q_, *k_, *v_, *mask_;
  const uint8_t *past_key_, *past_value_;
  void* y_;
  int group_;
  int64_t past_rows_, key_bytes_, value_bytes_;
};

// present[b, h] = past[b, h] ++ pack(new[b, h] - offset[h]): the past rows copied unless present is
// past (a shared buffer), the rows after them zeroed in a fresh preallocated present, the new rows
// written after sequence b's own past.
void write_present(const AttentionParams& p, Format fmt, int d, int64_t row_bytes, const BhsStrides& st,
                   const void* x, const float* offset, const uint8_t* past, uint8_t* present, const ParallelFor& pfor) {
  const int64_t past_rows = p.past_rows_or_len(), present_rows = p.present_rows_or_total();
  const bool nc = p.norm_correction, copy = past != nullptr && past != present && past_rows > 0;
  pfor(static_cast<size_t>(p.batch * p.kv_heads), [&](size_t bh) {
    const int64_t b = static_cast<int64_t>(bh) / p.kv_heads, h = static_cast<int64_t>(bh) % p.kv_heads;
    uint8_t* dst = present + static_cast<int64_t>(bh) * present_rows * row_bytes;
    if (copy) std::memcpy(dst, past + static_cast<int64_t>(bh) * past_rows * row_bytes, past_rows * row_bytes);
    const int64_t zero_from = p.zeroed_from(past, present);
    std::memset(dst + zero_from * row_bytes, 0, (present_rows - zero_from) * row_bytes);
    float row[kMaxHeadDim];
    const float* off = offset ? offset + h * d : nullptr;
    const int64_t first = p.past_of(b);
    for (int64_t n = 0; n < p.new_len; ++n) {
      load_row(p.dtype, x, b * st.b + h * st.h + n * st.s, d, row);
      if (off) for (int i = 0; i < d; ++i) row[i] -= off[i];
      encode_vector(fmt, d, nc, row, dst + (first + n) * row_bytes);
    }
  });
}

}  // namespace

void attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
               const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
               uint8_t* present_value, const ParallelFor& pfor) {
  write_present(p, p.key_format, p.head_dim, p.key_row(), p.k, k, p.key_offset, past_key, present_key, pfor);
  write_present(p, p.value_format, p.v_head_dim, p.value_row(), p.v, v, p.value_offset, past_value, present_value,
                pfor);
  if (p.q_len == 0) return;
  Runner runner(p, q, k, v, mask, past_key, past_value, y);
  const int64_t rows = runner.rows_per_head();
  const int64_t blocks = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t tasks = p.batch * p.kv_heads * blocks;
  pfor(static_cast<size_t>(tasks), [&](size_t i) {
    const int64_t ti = static_cast<int64_t>(i);
    const int64_t blk = ti % blocks, bh = ti / blocks;
    Task t{bh / p.kv_heads, bh % p.kv_heads, blk * kMaxRows,
           static_cast<int>(std::min<int64_t>(kMaxRows, rows - blk * kMaxRows))};
    runner.run(t);
  });
}

}  // namespace turboquant::cpu
