// TQAttention on the CPU (docs/design.md sections 3 and 4).
//
// Work is split into tasks of query rows (the query heads of one GQA group, at one or more positions)
// against one KV head. A task keeps, per row, a running maximum, sum and weighted sum of values (online
// softmax), folds in the past and then the new tokens a block of keys at a time, and divides at the end;
// no buffer grows with the sequence. Per task:
// 1. a decode step's past (fewer than kPrefillTokens new tokens; tasks of kLutRows rows): MSE keys
//    scored through per-task lookup tables over pairs of packed indices (a byte for 4-bit keys, 6 bits
//    for 3-bit keys): score = s * sum_pairs LUT[pair][code], with the query rotated once (q . H) and
//    the softmax scale folded into the table, no key dequantized; other key formats decoded once and
//    dotted with every row. Values dequantized on the fly: for uint formats sum_j p_j (q_j * scale_j +
//    zero_j) is accumulated as (p_j * scale_j) * q_j plus a separate sum of p_j * zero_j;
// 2. a prefill call's past (tasks of kTaskRows rows): key and value tiles decoded once per task into
//    float32, MSE keys in the rotated domain (centroid times scale, against the rows' rotated queries),
//    and run through the same register-blocked tiles as the new tokens (tiles.h): the decoding is
//    shared by 64 rows, where lookup tables are built and read per 8;
// 3. the new tokens' keys and values exactly, in float32 tiles of tiles::kKeys keys prepared once per
//    call (NewTiles) and shared by all the task's rows, the key offset removed;
// 4. softcap, then mask, causal limit (aligned to the end of the cache) and sliding window on every
//    block before it is folded in; the head sink only in the final division.
// A sliding window (GroupQueryAttention's local_window_size) starts each row's pass over the past at
// the task's first visible key, so keys before every row's window are neither scored nor read: a
// decode step reads W rows per head whatever the past.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "tiles.h"
#include "turboquant/float_io.h"
#include "turboquant/vector_codec.h"
#include "turboquant/codebook_data.h"
#include "turboquant/cpu_kernels.h"

namespace turboquant::cpu {
namespace {

constexpr int kLutRows = 8;         // rows of one lookup table: a decode step's past, kLutRows rows at a time
constexpr int kTaskRows = 64;       // rows of a task of a prefill call: they share every key tile
constexpr int kPrefillTokens = 32;  // new tokens that make a call a prefill (tasks of kTaskRows rows)
constexpr int kPastChunk = 1024;    // past keys a decode step scores, weighs and sums at a time
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

// a . b over n elements, n a multiple of 8 (head sizes are): eight lanes and two accumulators (one
// scalar chain was most of a decode step over raw16 or fp8 keys; docs/performance.md, CPU decode).
float dot(const float* a, const float* b, int n) {
  tiles::V8 s0{}, s1{};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 += tiles::load8(a + i) * tiles::load8(b + i);
    s1 += tiles::load8(a + i + 8) * tiles::load8(b + i + 8);
  }
  if (i < n) s0 += tiles::load8(a + i) * tiles::load8(b + i);
  const tiles::V8 t = s0 + s1;
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

struct CentroidFloats {
  float c3[8], c4[16];
  CentroidFloats() {
    for (int i = 0; i < 8; ++i) c3[i] = static_cast<float>(codebook::kCentroids3[i]);
    for (int i = 0; i < 16; ++i) c4[i] = static_cast<float>(codebook::kCentroids4[i]);
  }
};
// Tables built on first use, not at library load: this file is also compiled for x86-64-v3
// (CMakeLists.txt), and that copy's load-time initialisers would run on every CPU.
const CentroidFloats& centroid_floats() {
  static const CentroidFloats table;
  return table;
}

struct Fp8Table {
  float t[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) t[b] = fp8_to_f32(static_cast<uint8_t>(b));
  }
};
const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}

// A raw16 or fp8 row as floats: raw16 by the F16C conversion, eight at a time, where the target has it
// (exact, as the codec's), fp8 through a table; other formats by the codec.
void plain_row_as_floats(Format fmt, int d, const uint8_t* in, float* out) {
  if (fmt == Format::kFp8) {
    const float* table = fp8_table().t;
    for (int i = 0; i < d; ++i) out[i] = table[in[i]];
    return;
  }
#if defined(__F16C__)
  if (fmt == Format::kRaw16) {
    for (int i = 0; i < d; i += 8) {
      _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i))));
    }
    return;
  }
#endif
  decode_vector(fmt, d, in, out);
}

// A uint row's codes as floats times scale plus zero, eight at a time: the eight codes' bytes as one
// word, each lane shifting its own code down (a table of code pairs per byte, before, cost a decode step
// about a quarter more; docs/performance.md, CPU decode attention).
// Inlined into its callers: a call per value row costs a decode step a fifth of its time.
__attribute__((always_inline)) inline void uint_row_as_floats(int bits, int d, const uint8_t* in, float scale, float zero,
                                                              float* out) {
  typedef uint32_t U8 __attribute__((vector_size(32)));
  const U8 shift = bits == 4 ? U8{0, 4, 8, 12, 16, 20, 24, 28} : U8{0, 3, 6, 9, 12, 15, 18, 21};
  const uint32_t mask = (1u << bits) - 1;
  for (int i = 0; i < d; i += 8, in += bits) {
    uint32_t word = in[0] | (in[1] << 8) | (in[2] << 16);
    if (bits == 4) word |= static_cast<uint32_t>(in[3]) << 24;
    const U8 codes = ((U8{} + word) >> shift) & mask;
    tiles::store8(out + i, __builtin_convertvector(codes, tiles::V8) * scale + zero);
  }
}

template <int RP>
void score_mse_rows(int bits, int dp, const float* lut, const uint8_t* keys, int64_t key_bytes, int64_t count,
                    int rows, float* out, int64_t out_stride) {
  if (bits == 4) {
    score_mse_keys<RP, 4>(dp, lut, keys, key_bytes, count, rows, out, out_stride);
  } else {
    score_mse_keys<RP, 3>(dp, lut, keys, key_bytes, count, rows, out, out_stride);
  }
}

// Buffers of one thread, reused from task to task (a task's take up to a few hundred KB).
struct Scratch {
  std::vector<float> q, acc, qrot, lut, scores, kt, vt;
};
Scratch& thread_scratch() {
  thread_local Scratch s;
  return s;
}

struct Task {
  int64_t b, hkv, row0;  // rows are (position, group member) pairs: row = pos * group + g
  int rows;
};

// Per row of a task: head, causal limit (keys start <= j <= limit are visible) and the online softmax's state:
// running maximum m, sum l of exp(score - m), the part of l from past keys (it weighs the value
// offset) and the sum of weights times uint value zero points.
struct Rows {
  int64_t hq[kTaskRows], pos[kTaskRows], limit[kTaskRows], start[kTaskRows];
  // scale * q . key_offset: what the key offset took off every score of the row, given back where the
  // scores meet something the softmax's shift invariance does not cover (softcap, head sink)
  float shift[kTaskRows];
  float m[kTaskRows], l[kTaskRows], past_mass[kTaskRows], zsum[kTaskRows];
};

float hmax(tiles::V8 v) {
  float x[8];
  std::memcpy(x, &v, sizeof(x));
  return std::max(std::max(std::max(x[0], x[1]), std::max(x[2], x[3])), std::max(std::max(x[4], x[5]), std::max(x[6], x[7])));
}

float hsum(tiles::V8 v) {
  float x[8];
  std::memcpy(x, &v, sizeof(x));
  return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
}

// The call's new keys and values in float32, once, for every task to share: per (b, kv head), the keys
// in tiles of tiles::kKeys, each transposed (D x kKeys, the key offset removed, zero past the last
// key), and the values as rows of Dv. Reading the inputs in place instead costs each task a strided
// pass (rows of a [B, S, H * D] tensor are H * D apart and thrash the L1 sets) and a conversion.
class NewTiles {
 public:
  NewTiles(const AttentionParams& p, const void* k, const void* v, const ParallelFor& pfor)
      : d_(p.head_dim), dv_(p.v_head_dim), tiles_((p.new_len + tiles::kKeys - 1) / tiles::kKeys) {
    using tiles::kKeys;
    const int64_t pairs = p.batch * p.kv_heads;
    keys_.resize(static_cast<size_t>(pairs * tiles_) * d_ * kKeys);
    values_.resize(static_cast<size_t>(pairs * tiles_) * kKeys * dv_);
    pfor(static_cast<size_t>(pairs * tiles_), [&](size_t i) {
      const int64_t bh = static_cast<int64_t>(i) / tiles_, tile = static_cast<int64_t>(i) % tiles_;
      const int64_t b = bh / p.kv_heads, h = bh % p.kv_heads, n0 = tile * kKeys;
      const int n = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - n0));
      float* kt = keys_.data() + static_cast<size_t>(i) * d_ * kKeys;
      float* vr = values_.data() + static_cast<size_t>(i) * kKeys * dv_;
      const float* koff = p.key_offset ? p.key_offset + h * d_ : nullptr;
      float row[kMaxHeadDim];
      for (int u = 0; u < kKeys; ++u) {
        if (u < n) {
          tiles::load_row8(p.dtype, k, b * p.k.b + h * p.k.h + (n0 + u) * p.k.s, d_, row);
          if (koff) for (int j = 0; j < d_; ++j) row[j] -= koff[j];
          tiles::load_row8(p.dtype, v, b * p.v.b + h * p.v.h + (n0 + u) * p.v.s, dv_, vr + u * dv_);
        } else {
          std::memset(row, 0, sizeof(float) * d_);
          std::memset(vr + u * dv_, 0, sizeof(float) * dv_);
        }
        for (int j = 0; j < d_; ++j) kt[j * kKeys + u] = row[j];
      }
    });
  }
  const float* key_tile(int64_t bh, int64_t tile) const {
    return keys_.data() + static_cast<size_t>(bh * tiles_ + tile) * d_ * tiles::kKeys;
  }
  const float* value_rows(int64_t bh, int64_t first) const {
    return values_.data() + static_cast<size_t>(bh * tiles_ * tiles::kKeys + first) * dv_;
  }

 private:
  int d_, dv_;
  int64_t tiles_;
  std::vector<float> keys_, values_;
};

class Runner {
 public:
  Runner(const AttentionParams& p, const void* q, const void* mask, const NewTiles& fresh, const uint8_t* past_key,
         const uint8_t* past_value, void* y)
      : p_(p), q_(q), mask_(mask), new_(fresh), past_key_(past_key), past_value_(past_value), y_(y) {
    // A call with a tile of new keys has tasks of many rows: they score the past by decoded tiles,
    // which every row shares; a decode step's few rows score it by lookup tables, which need no decoding.
    tiled_past_ = p.new_len >= kPrefillTokens;
    group_ = static_cast<int>(p.q_heads / p.kv_heads);
    past_rows_ = p.past_rows_or_len();
    shifted_ = p.key_offset != nullptr && (p.softcap > 0.0f || p.head_sink != nullptr);
    key_bytes_ = p.key_row();
    value_bytes_ = p.value_row();
    key_stride_ = key_bytes_;
    value_stride_ = value_bytes_;
  }

  int64_t rows_per_head() const { return p_.q_len * group_; }

  void run(const Task& t) const {
    const int d = p_.head_dim, dv = p_.v_head_dim, rows = t.rows;
    const int64_t sp = p_.past_of(t.b);  // this sequence's past tokens
    const int64_t stot = sp + p_.new_len;
    Scratch& w = thread_scratch();
    w.q.resize(static_cast<size_t>(rows) * d);
    w.acc.assign(static_cast<size_t>(rows) * dv, 0.0f);
    Rows st;
    for (int r = 0; r < rows; ++r) {
      const int64_t row = t.row0 + r;
      st.pos[r] = row / group_;
      st.hq[r] = t.hkv * group_ + row % group_;
      st.limit[r] = p_.is_causal ? st.pos[r] + (stot - p_.q_len) : stot - 1;
      st.start[r] = p_.window > 0 ? std::max<int64_t>(0, st.limit[r] - p_.window + 1) : 0;
      st.m[r] = kNegInf;
      st.l[r] = st.past_mass[r] = st.zsum[r] = 0.0f;
      float* qr = &w.q[static_cast<size_t>(r) * d];
      tiles::load_row8(p_.dtype, q_, t.b * p_.q.b + st.hq[r] * p_.q.h + st.pos[r] * p_.q.s, d, qr);
      for (int i = 0; i < d; ++i) qr[i] *= p_.scale;
      st.shift[r] = shifted_ ? dot(qr, p_.key_offset + t.hkv * d, d) : 0.0f;
    }
    if (sp > 0 && tiled_past_) {
      past_tiles(t, st, sp, w);
    } else if (sp > 0) {
      for (int r0 = 0; r0 < rows; r0 += kLutRows) past(t, st, r0, std::min(kLutRows, rows - r0), sp, w);
    }
    if (p_.new_len > 0) fresh(t, st, sp, w);
    const float* voff = p_.value_offset ? p_.value_offset + t.hkv * dv : nullptr;
    for (int r = 0; r < rows; ++r) {
      const int64_t base = t.b * p_.y.b + st.hq[r] * p_.y.h + st.pos[r] * p_.y.s;
      // 0: no key visible, the output is 0; NaN: a NaN or +inf score (fold)
      float inv = st.l[r] > 0.0f ? 1.0f / st.l[r] : (st.l[r] == st.l[r] ? 0.0f : st.l[r]);
      if (p_.head_sink && st.l[r] > 0.0f) {  // the sink joins the denominator: exp(sink - m) at m = max(m, sink)
        // against the true scores: those the softcap gave back, else the stored ones plus the shift
        const float sink = load_float(p_.dtype, p_.head_sink, st.hq[r]) - (p_.softcap > 0.0f ? 0.0f : st.shift[r]);
        const float m = std::max(st.m[r], sink);
        const float alpha = std::exp(st.m[r] - m);
        inv = alpha / (st.l[r] * alpha + std::exp(sink - m));
      }
      const float* a = &w.acc[static_cast<size_t>(r) * dv];
      for (int i = 0; i < dv; ++i) {
        float o = a[i] + st.zsum[r];
        if (voff) o += voff[i] * st.past_mass[r];
        store_float(p_.dtype, y_, base + i, o * inv);
      }
    }
  }

 private:
  // Rows [r0, r0 + rb) against the past keys they may see, kPastChunk keys at a time.
  void past(const Task& t, Rows& st, int r0, int rb, int64_t sp, Scratch& w) const {
    const int d = p_.head_dim, dv = p_.v_head_dim;
    int64_t visible = 0, from = sp;
    for (int r = r0; r < r0 + rb; ++r) {
      visible = std::max(visible, std::min(st.limit[r] + 1, sp));
      from = std::min(from, st.start[r]);
    }
    if (visible <= from) return;
    const bool mse = is_mse(p_.key_format);
    const int bits = format_bits(p_.key_format), dp = padded_dim(d);
    const int rp = rb <= 1 ? 1 : rb <= 2 ? 2 : rb <= 4 ? 4 : 8;
    if (mse) {
      w.qrot.assign(static_cast<size_t>(rb) * dp, 0.0f);
      for (int r = 0; r < rb; ++r) {
        float* qr = &w.qrot[static_cast<size_t>(r) * dp];
        const float* q = &w.q[static_cast<size_t>(r0 + r) * d];
        for (int i = 0; i < d; ++i) qr[i] = q[i] * (1.0f / static_cast<float>(dp));
        codec::fwht_inplace(qr, dp);
      }
      w.lut.assign(static_cast<size_t>(dp / 2) * (1u << (2 * bits)) * rp, 0.0f);
      switch (rp) {
        case 1: build_pair_lut<1>(bits, dp, rb, w.qrot.data(), w.lut.data()); break;
        case 2: build_pair_lut<2>(bits, dp, rb, w.qrot.data(), w.lut.data()); break;
        case 4: build_pair_lut<4>(bits, dp, rb, w.qrot.data(), w.lut.data()); break;
        default: build_pair_lut<8>(bits, dp, rb, w.qrot.data(), w.lut.data()); break;
      }
    }
    w.scores.resize(static_cast<size_t>(kLutRows) * kPastChunk);
    float* sc = w.scores.data();
    float* acc = &w.acc[static_cast<size_t>(r0) * dv];
    for (int64_t j0 = from, step = 0; j0 < visible; j0 += step) {  // chunks of rows that lie key_stride_ apart
      step = std::min<int64_t>(std::min<int64_t>(kPastChunk, visible - j0), p_.run_length(j0));
      const int n = static_cast<int>(step);
      const uint8_t* kb = past_key_ + p_.row_offset(t.b, t.hkv, j0, past_rows_, key_bytes_);
      if (mse) {
        switch (rp) {
          case 1: score_mse_rows<1>(bits, dp, w.lut.data(), kb, key_stride_, n, rb, sc, kPastChunk); break;
          case 2: score_mse_rows<2>(bits, dp, w.lut.data(), kb, key_stride_, n, rb, sc, kPastChunk); break;
          case 4: score_mse_rows<4>(bits, dp, w.lut.data(), kb, key_stride_, n, rb, sc, kPastChunk); break;
          default: score_mse_rows<8>(bits, dp, w.lut.data(), kb, key_stride_, n, rb, sc, kPastChunk); break;
        }
      } else {
        float kf[kMaxHeadDim];
        for (int j = 0; j < n; ++j) {
          plain_row_as_floats(p_.key_format, d, kb + j * key_stride_, kf);
          for (int r = 0; r < rb; ++r) sc[r * kPastChunk + j] = dot(&w.q[static_cast<size_t>(r0 + r) * d], kf, d);
        }
      }
      const int n8 = (n + 7) & ~7;
      for (int r = 0; r < rb; ++r) {
        float* s = sc + r * kPastChunk;
        soft_cap(s, n, st.shift[r0 + r]);
        for (int j = n; j < n8; ++j) s[j] = kNegInf;
        apply_mask(t.b, st.hq[r0 + r], st.pos[r0 + r], st.start[r0 + r], st.limit[r0 + r], j0, n, s);
      }
      fold(st, r0, rb, sc, kPastChunk, n8, acc, true);
      accumulate_past_values(t, rb, j0, n, sc, st.zsum + r0, acc);
    }
  }

  // All the task's rows against the new tokens they may see, from NewTiles.
  void fresh(const Task& t, Rows& st, int64_t sp, Scratch& w) const {
    const int64_t bh = t.b * p_.kv_heads + t.hkv;
    tile_pass(t, st, sp, p_.new_len, w.q.data(), p_.head_dim, w, false, [&](int64_t n0, int) {
      return std::pair{new_.key_tile(bh, n0 / tiles::kKeys), new_.value_rows(bh, n0)};
    });
  }

  // All the task's rows against the past keys they may see, in tiles decoded once per task into float32:
  // MSE keys in the rotated domain (centroid times the key's scale; the rows' queries rotated once),
  // so that score = q_rot . tile as for exact keys; values decoded whole.
  void past_tiles(const Task& t, Rows& st, int64_t sp, Scratch& w) const {
    using tiles::kKeys;
    const int d = p_.head_dim, dv = p_.v_head_dim, rows = t.rows;
    const bool mse = is_mse(p_.key_format);
    const int dq = mse ? padded_dim(d) : d;
    const float* qm = w.q.data();
    if (mse) {
      w.qrot.assign(static_cast<size_t>(rows) * dq, 0.0f);
      for (int r = 0; r < rows; ++r) {
        float* qr = &w.qrot[static_cast<size_t>(r) * dq];
        for (int i = 0; i < d; ++i) qr[i] = w.q[static_cast<size_t>(r) * d + i] * (1.0f / static_cast<float>(dq));
        codec::fwht_inplace(qr, dq);
      }
      qm = w.qrot.data();
    }
    w.kt.resize(static_cast<size_t>(dq) * kKeys);
    w.vt.resize(static_cast<size_t>(kKeys) * dv);
    tile_pass(t, st, 0, sp, qm, dq, w, true, [&](int64_t j0, int n) {
      float *kt = w.kt.data(), *vt = w.vt.data();
      alignas(32) float rows8[8][kMaxHeadDim];
      for (int u0 = 0; u0 < kKeys; u0 += 8) {
        for (int u = u0; u < u0 + 8; ++u) {
          if (u < n) {
            decode_key_row(past_key_ + p_.row_offset(t.b, t.hkv, j0 + u, past_rows_, key_bytes_), dq, rows8[u - u0]);
            decode_value_row(past_value_ + p_.row_offset(t.b, t.hkv, j0 + u, past_rows_, value_bytes_), vt + u * dv);
          } else {
            std::memset(rows8[u - u0], 0, sizeof(float) * dq);
          }
        }
        tiles::transpose8(rows8[0], kMaxHeadDim, dq, kt + u0);
      }
      return std::pair<const float*, const float*>{kt, vt};
    });
  }

  // MSE: centroids times the stored scale (the rotated domain, dp values); other formats decoded.
  void decode_key_row(const uint8_t* kb, int dq, float* out) const {
    if (!is_mse(p_.key_format)) {
      plain_row_as_floats(p_.key_format, dq, kb, out);
      return;
    }
    const int bits = format_bits(p_.key_format);
    const float s = load_f16_le(kb + dq * bits / 8);
    const float* c = bits == 3 ? centroid_floats().c3 : centroid_floats().c4;
#if defined(__AVX2__)
    {  // eight codes at a time (per-lane shifts), looked up by in-register permutes of the codebook
      const int stride = bits;  // bytes per eight codes
      const __m256i shift = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                      : _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
      const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
      const __m256 lo = _mm256_loadu_ps(c), hi = bits == 4 ? _mm256_loadu_ps(c + 8) : lo;
      const __m256 scale = _mm256_set1_ps(s);
      for (int i = 0; i < dq; i += 8, kb += stride) {
        uint32_t word = kb[0] | (kb[1] << 8) | (kb[2] << 16);
        if (bits == 4) word |= static_cast<uint32_t>(kb[3]) << 24;
        const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shift), mask);
        __m256 v = _mm256_permutevar8x32_ps(lo, codes);
        if (bits == 4) {  // codes 8-15 from the upper half: bit 3 moved to the sign bit selects it
          v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, codes), _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
        }
        _mm256_storeu_ps(out + i, _mm256_mul_ps(v, scale));
      }
      return;
    }
#endif
    if (bits == 4) {
      for (int i = 0; i < dq; i += 2, ++kb) {
        out[i] = c[*kb & 15u] * s;
        out[i + 1] = c[*kb >> 4] * s;
      }
      return;
    }
    for (int i = 0; i < dq; i += 8, kb += 3) {
      const uint32_t w = kb[0] | (kb[1] << 8) | (kb[2] << 16);
      for (int k = 0; k < 8; ++k) out[i + k] = c[(w >> (3 * k)) & 7u] * s;
    }
  }

  void decode_value_row(const uint8_t* vb, float* out) const {
    const int dv = p_.v_head_dim;
    if (is_uint(p_.value_format)) {
      const int nb = payload_bytes(p_.value_format, dv);
      uint_row_as_floats(format_bits(p_.value_format), dv, vb, load_f16_le(vb + nb), load_f16_le(vb + nb + 2), out);
    } else {
      plain_row_as_floats(p_.value_format, dv, vb, out);
    }
  }

  // Keys [first, first + count) that some row of the task may see, a tile of tiles::kKeys at a time:
  // tile(j, n) gives the transposed key tile (dq x kKeys, zero past n) and the value rows (Dv floats
  // apart) of keys first + j ...; rows scored by qm (dq floats a row), masked, folded, summed.
  template <class Tile>
  void tile_pass(const Task& t, Rows& st, int64_t first, int64_t count, const float* qm, int dq, Scratch& w,
                 bool past_keys, Tile tile) const {
    using tiles::kKeys;
    const int dv = p_.v_head_dim, rows = t.rows;
    int64_t visible = 0, skip = count;
    for (int r = 0; r < rows; ++r) {
      visible = std::max(visible, std::min(st.limit[r] + 1 - first, count));
      skip = std::min(skip, std::max<int64_t>(0, st.start[r] - first));
    }
    // the new keys' tiles are kKeys-aligned; the past's are decoded from any key on
    if (!past_keys) skip -= skip % kKeys;
    w.scores.resize(std::max<size_t>(w.scores.size(), static_cast<size_t>(rows) * kKeys));
    float* sc = w.scores.data();
    for (int64_t j0 = skip; j0 < visible; j0 += kKeys) {
      const int n = static_cast<int>(std::min<int64_t>(kKeys, visible - j0));
      const auto [kt, vr] = tile(j0, n);
      tiles::tile_all_rows(rows, qm, dq, kt, n, vr, dv, dv, sc, w.acc.data(), true);
      for (int r = 0; r < rows; ++r) {
        float* s = sc + r * kKeys;
        soft_cap(s, n, st.shift[r]);
        for (int u = n; u < kKeys; ++u) s[u] = kNegInf;
        apply_mask(t.b, st.hq[r], st.pos[r], st.start[r], st.limit[r], first + j0, n, s);
      }
      fold(st, 0, rows, sc, kKeys, kKeys, w.acc.data(), past_keys);
      tiles::tile_all_rows(rows, qm, dq, kt, n, vr, dv, dv, sc, w.acc.data(), false);
    }
  }

  // Folds a block of scores (rows ld floats apart; n8, a multiple of 8, of them, masked ones -inf) into
  // rows [r0, r0 + rb)'s running maximum and sum, rescaling what those rows summed before when the
  // maximum grows, and turns the scores into weights exp(score - maximum).
  void fold(Rows& st, int r0, int rb, float* sc, int ld, int n8, float* acc, bool past_keys) const {
    using tiles::V8;
    const int dv = p_.v_head_dim;
    for (int r = 0; r < rb; ++r) {
      float* s = sc + r * ld;
      V8 mx8 = V8{} + kNegInf;
      tiles::I8 odd{};  // a NaN or +inf score: the row's output is NaN (docs/ops.md, Non-finite input)
      for (int j = 0; j < n8; j += 8) {
        const V8 x = tiles::load8(s + j);
        mx8 = x > mx8 ? x : mx8;
        odd |= (x != x) | (x == -kNegInf);
      }
      const float mx = hmax(mx8);
      const int R = r0 + r;
      bool poisoned = false;
      for (int i = 0; i < 8; ++i) poisoned = poisoned || odd[i];
      if (poisoned) st.l[R] = std::numeric_limits<float>::quiet_NaN();  // stays NaN: scaled and added to
      if (poisoned || mx == kNegInf) {  // nothing (more) to weigh in this block
        std::memset(s, 0, sizeof(float) * n8);
        continue;
      }
      if (mx > st.m[R]) {
        if (st.m[R] != kNegInf) {
          const float alpha = std::exp(st.m[R] - mx);
          float* a = acc + static_cast<size_t>(r) * dv;
          for (int i = 0; i < dv; ++i) a[i] *= alpha;
          st.l[R] *= alpha;
          st.past_mass[R] *= alpha;
          st.zsum[R] *= alpha;
        }
        st.m[R] = mx;
      }
      V8 sum{};
      for (int j = 0; j < n8; j += 8) {
        const V8 e = tiles::exp_nonpositive8(tiles::load8(s + j) - st.m[R]);
        tiles::store8(s + j, e);
        sum += e;
      }
      const float total = hsum(sum);
      st.l[R] += total;
      if (past_keys) st.past_mass[R] += total;
    }
  }

  // acc[r][:] += sum_j w[r][j] * decode(value_{j0 + j}) for the n past tokens of a chunk (rows
  // value_stride_ apart), a tile of
  // kTile tokens at a time: the tile's rows are decoded once into floats, then each 8-wide column block
  // of the accumulators stays in registers while the tile's tokens are added into it. For uint formats
  // the codes are used as they are and the zero points summed apart: w * (q * scale + zero).
  void accumulate_past_values(const Task& t, int rows, int64_t j0, int n_chunk, const float* sc, float* zsum,
                              float* acc) const {
    constexpr int kTile = 16;
    const int dv = p_.v_head_dim;
    const uint8_t* vals = past_value_ + p_.row_offset(t.b, t.hkv, j0, past_rows_, value_bytes_);
    const bool uint_fmt = is_uint(p_.value_format);
    const int bits = format_bits(p_.value_format);
    const int nb = payload_bytes(p_.value_format, dv);
    alignas(32) float tile[kTile][kMaxHeadDim];
    float w[kLutRows][kTile];
    for (int u0 = 0; u0 < n_chunk; u0 += kTile) {
      const int n = std::min(kTile, n_chunk - u0);
      for (int u = 0; u < n; ++u) {
        const uint8_t* vb = vals + (u0 + u) * value_stride_;
        float vscale = 1.0f;
        if (uint_fmt) {
          uint_row_as_floats(bits, dv, vb, 1.0f, 0.0f, tile[u]);  // the codes: scale and zero apply below
          vscale = load_f16_le(vb + nb);
          const float vzero = load_f16_le(vb + nb + 2);
          for (int r = 0; r < rows; ++r) zsum[r] += sc[r * kPastChunk + u0 + u] * vzero;
        } else {
          plain_row_as_floats(p_.value_format, dv, vb, tile[u]);
        }
        for (int r = 0; r < rows; ++r) w[r][u] = sc[r * kPastChunk + u0 + u] * vscale;
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

  // softcap * tanh(s / softcap) on the true scores (stored score s plus the row's shift) s[0 .. n)
  // when the op has a softcap (before any mask).
  void soft_cap(float* s, int n, float shift) const {
    if (p_.softcap <= 0.0f) return;
    const float c = p_.softcap, inv = 1.0f / p_.softcap;
    for (int j = 0; j < n; ++j) s[j] = c * std::tanh((s[j] + shift) * inv);
  }

  // The window's start, the causal limit and the mask on scores s[0 .. n) of keys j0 .. j0 + n.
  void apply_mask(int64_t b, int64_t hq, int64_t pos, int64_t start, int64_t limit, int64_t j0, int n,
                  float* s) const {
    for (int64_t j = 0, e = std::min<int64_t>(n, start - j0); j < e; ++j) s[j] = kNegInf;
    for (int64_t j = std::max<int64_t>(0, limit + 1 - j0); j < n; ++j) s[j] = kNegInf;
    if (p_.mask_type == MaskType::kNone) return;
    const int64_t* st = p_.mask_stride;
    const int64_t base = b * st[0] + hq * st[1] + pos * st[2] + j0 * st[3];
    for (int j = 0; j < n; ++j) {
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
  const void *q_, *mask_;
  const NewTiles& new_;
  const uint8_t *past_key_, *past_value_;
  void* y_;
  int group_;
  bool tiled_past_, shifted_;
  int64_t past_rows_, key_bytes_, value_bytes_;
  int64_t key_stride_, value_stride_;  // bytes from one past row of a (b, h) to the next within a run (p.run_length)
};

// present[b, h] = past[b, h] ++ pack(new[b, h] - offset[h]): the past rows copied unless present is
// past (a shared buffer), the rows after them zeroed in a fresh preallocated present, the new rows
// written after sequence b's own past. A paged pool is present and past at once: only its new rows
// are written, into the slots the block table gives them.
void write_present(const AttentionParams& p, Format fmt, int d, int64_t row_bytes, const BhsStrides& st,
                   const void* x, const float* offset, const uint8_t* past, uint8_t* present, const ParallelFor& pfor) {
  const int64_t past_rows = p.past_rows_or_len(), present_rows = p.present_rows_or_total();
  const bool nc = p.norm_correction, copy = past != nullptr && past != present && past_rows > 0;
  pfor(static_cast<size_t>(p.batch * p.kv_heads), [&](size_t bh) {
    const int64_t b = static_cast<int64_t>(bh) / p.kv_heads, h = static_cast<int64_t>(bh) % p.kv_heads;
    if (!p.blocks.table) {
      uint8_t* dst = present + static_cast<int64_t>(bh) * present_rows * row_bytes;
      if (copy) std::memcpy(dst, past + static_cast<int64_t>(bh) * past_rows * row_bytes, past_rows * row_bytes);
      const int64_t zero_from = p.zeroed_from(past, present);
      std::memset(dst + zero_from * row_bytes, 0, (present_rows - zero_from) * row_bytes);
    }
    float row[kMaxHeadDim];
    const float* off = offset ? offset + h * d : nullptr;
    const int64_t first = p.past_of(b);
    for (int64_t n = 0; n < p.new_len; ++n) {
      load_row(p.dtype, x, b * st.b + h * st.h + n * st.s, d, row);
      if (off) for (int i = 0; i < d; ++i) row[i] -= off[i];
      encode_vector(fmt, d, nc, row, present + p.row_offset(b, h, first + n, present_rows, row_bytes));
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
  const NewTiles fresh(p, k, v, pfor);
  Runner runner(p, q, mask, fresh, past_key, past_value, y);
  const int64_t rows = runner.rows_per_head();
  // Many rows per task when there is a tile of new keys for them to share; the past alone is scored
  // kLutRows rows at a time, and smaller tasks spread a decode step over more threads.
  const int64_t task_rows = p.new_len >= kPrefillTokens ? kTaskRows : kLutRows;
  const int64_t blocks = (rows + task_rows - 1) / task_rows;
  const int64_t tasks = p.batch * p.kv_heads * blocks;
  pfor(static_cast<size_t>(tasks), [&](size_t i) {
    const int64_t ti = static_cast<int64_t>(i);
    const int64_t blk = ti % blocks, bh = ti / blocks;
    Task t{bh / p.kv_heads, bh % p.kv_heads, blk * task_rows,
           static_cast<int>(std::min<int64_t>(task_rows, rows - blk * task_rows))};
    runner.run(t);
  });
}

}  // namespace turboquant::cpu
