// TQGroupQueryAttention on the CPU: the rotary embedding of Q and the new K (and the key scale) into
// scratch copies, then the TQAttention kernel with per-sequence past lengths over the (possibly shared) buffers;
// a window-sized buffer's rows moved into place around it (turboquant/window_cache.h).
#include <algorithm>
#include <cstring>
#include <vector>

#include "turboquant/cpu_kernels.h"
#include "turboquant/rotary.h"
#include "turboquant/window_cache.h"

namespace turboquant::cpu {
namespace {

// x viewed through st as [B, heads, S, D], rotated (and scaled as `side`) into a dense [B, S, heads, D]
// copy; returns its strides.
BhsStrides rotate_into(const AttentionParams& p, const RotaryParams& rot, ScaleSide side, const BhsStrides& st,
                       const void* x, std::vector<uint8_t>& out, const ParallelFor& pfor) {
  const int64_t heads = side == ScaleSide::kQuery ? p.q_heads : p.kv_heads;
  const int64_t group = heads / p.kv_heads;
  const int d = p.head_dim;
  const int64_t s_len = p.q_len;
  out.resize(static_cast<size_t>(p.batch * s_len * heads * d * dtype_size(p.dtype)));
  const BhsStrides dense{s_len * heads * d, d, heads * d};
  pfor(static_cast<size_t>(p.batch * s_len), [&](size_t i) {
    const int64_t b = static_cast<int64_t>(i) / s_len, s = static_cast<int64_t>(i) % s_len;
    const int64_t pos = rot.position_ids ? rot.position_ids[i] : p.past_of(b) + s;
    float row[kMaxHeadDim];
    for (int64_t h = 0; h < heads; ++h) {
      load_row(p.dtype, x, b * st.b + h * st.h + s * st.s, d, row);
      rotate_head(rot, p.dtype, d, pos, row, key_scale_row(rot, h / group, d), side);
      const int64_t base = b * dense.b + h * dense.h + s * dense.s;
      for (int j = 0; j < d; ++j) store_float(p.dtype, out.data(), base + j, row[j]);
    }
  });
  return dense;
}

// Rows [from_b, from_b + count_b) of each (b, h) of src (src_rows rows per (b, h)) to rows
// [to_b, ...) of dst; verbatim bytes, whatever the format, and memmove since src may be dst.
struct RowMove {
  const uint8_t* src;
  int64_t src_rows;
  uint8_t* dst;
  int64_t dst_rows;
  int64_t row_bytes;
};

void move_rows(const AttentionParams& p, const RowMove& m, const std::vector<WindowStep>& steps,
               int64_t (*from)(const WindowStep&), int64_t (*to)(const WindowStep&),
               int64_t (*count)(const WindowStep&), int64_t (*zero_from)(const WindowStep&), const ParallelFor& pfor) {
  pfor(static_cast<size_t>(p.batch * p.kv_heads), [&](size_t bh) {
    const WindowStep& w = steps[bh / static_cast<size_t>(p.kv_heads)];
    const int64_t n = count(w);
    uint8_t* dst = m.dst + static_cast<int64_t>(bh) * m.dst_rows * m.row_bytes;
    const uint8_t* src = m.src + static_cast<int64_t>(bh) * m.src_rows * m.row_bytes;
    if (n > 0 && (src != dst || from(w) != to(w))) {
      std::memmove(dst + to(w) * m.row_bytes, src + from(w) * m.row_bytes, n * m.row_bytes);
    }
    if (zero_from) {
      const int64_t z = zero_from(w);
      std::memset(dst + z * m.row_bytes, 0, (m.dst_rows - z) * m.row_bytes);
    }
  });
}

// The attention over a window-sized buffer of C = p.window_cache rows (p.past_lens: absolute pasts).
// In place when no sequence drops a row its first query reads: the kept rows move to the front and
// the new rows follow them. Otherwise (a prompt longer than C, a chunk that evicts its own window)
// on a staging copy of the resident rows, whose last L(T) rows are kept. A fresh present gets zeros
// wherever no row is written, padding of the new rows included.
void windowed_attention(const AttentionParams& p, const void* q, const void* k, const void* v,
                        const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                        uint8_t* present_value, const ParallelFor& pfor) {
  const int64_t cap = p.window_cache, s = p.new_len;
  std::vector<WindowStep> steps(static_cast<size_t>(p.batch));
  bool staged = false;
  int64_t resident = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const WindowStep w = window_step(p.past_of(b), s, cap, p.window);
    steps[static_cast<size_t>(b)] = w;
    staged = staged || w.staged;
    resident = std::max(resident, w.resident);
  }
  AttentionParams a = p;
  a.window_cache = 0;
  a.past_lens_bias = 0;
  std::vector<int32_t> row_past(static_cast<size_t>(p.batch));
  const bool fresh_key = present_key != past_key, fresh_value = present_value != past_value;
  const RowMove keys_in{past_key, cap, present_key, cap, p.key_row()};
  const RowMove values_in{past_value, cap, present_value, cap, p.value_row()};
  if (!staged) {
    int64_t longest = 0;
    for (size_t b = 0; b < steps.size(); ++b) {
      row_past[b] = static_cast<int32_t>(steps[b].kept);
      longest = std::max(longest, steps[b].kept);
    }
    auto from = [](const WindowStep& w) { return w.resident - w.kept; };
    auto to = [](const WindowStep&) { return int64_t{0}; };
    auto count = [](const WindowStep& w) { return w.kept; };
    auto zero = [](const WindowStep& w) { return w.kept; };
    move_rows(p, keys_in, steps, from, to, count, fresh_key ? +zero : nullptr, pfor);
    move_rows(p, values_in, steps, from, to, count, fresh_value ? +zero : nullptr, pfor);
    a.past_lens = row_past.data();
    a.past_len = longest;
    a.past_rows = a.present_rows = cap;
    attention(a, q, k, v, nullptr, present_key, present_value, y, present_key, present_value, pfor);
    return;
  }
  const int64_t rows = resident + s;
  std::vector<uint8_t> stage_key(static_cast<size_t>(p.batch * p.kv_heads * rows * p.key_row()));
  std::vector<uint8_t> stage_value(static_cast<size_t>(p.batch * p.kv_heads * rows * p.value_row()));
  for (size_t b = 0; b < steps.size(); ++b) row_past[b] = static_cast<int32_t>(steps[b].resident);
  auto start = [](const WindowStep&) { return int64_t{0}; };
  auto resident_rows = [](const WindowStep& w) { return w.resident; };
  move_rows(p, {past_key, cap, stage_key.data(), rows, p.key_row()}, steps, start, start, resident_rows, nullptr, pfor);
  move_rows(p, {past_value, cap, stage_value.data(), rows, p.value_row()}, steps, start, start, resident_rows, nullptr,
            pfor);
  a.past_lens = row_past.data();
  a.past_len = resident;
  a.past_rows = a.present_rows = rows;
  attention(a, q, k, v, nullptr, stage_key.data(), stage_value.data(), y, stage_key.data(), stage_value.data(), pfor);
  auto tail = [](const WindowStep& w) { return w.resident - w.kept; };  // the last L(T) of resident + S rows
  auto end = [](const WindowStep& w) { return w.end; };
  move_rows(p, {stage_key.data(), rows, present_key, cap, p.key_row()}, steps, tail, start, end,
            fresh_key ? +end : nullptr, pfor);
  move_rows(p, {stage_value.data(), rows, present_value, cap, p.value_row()}, steps, tail, start, end,
            fresh_value ? +end : nullptr, pfor);
}

}  // namespace

void gqa_attention(const AttentionParams& p0, const RotaryParams& rot, const void* q, const void* k, const void* v,
                   const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                   uint8_t* present_value, const ParallelFor& pfor) {
  AttentionParams p = p0;
  std::vector<uint8_t> q_rot, k_rot;
  if (rot.rotary_dim > 0) {
    p.q = rotate_into(p, rot, ScaleSide::kQuery, p0.q, q, q_rot, pfor);
    p.k = rotate_into(p, rot, ScaleSide::kKey, p0.k, k, k_rot, pfor);
    q = q_rot.data();
    k = k_rot.data();
  }
  if (p.window_cache > 0) {
    windowed_attention(p, q, k, v, past_key, past_value, y, present_key, present_value, pfor);
    return;
  }
  attention(p, q, k, v, nullptr, past_key, past_value, y, present_key, present_value, pfor);
}

}  // namespace turboquant::cpu
