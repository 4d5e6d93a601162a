// TQGroupQueryAttention on the CPU: the rotary embedding of Q and the new K (and the key scale) into
// scratch copies, then the TQAttention kernel with per-sequence past lengths over the (possibly shared) buffers.
#include <vector>

#include "turboquant/cpu_kernels.h"
#include "turboquant/rotary.h"

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
  attention(p, q, k, v, nullptr, past_key, past_value, y, present_key, present_value, pfor);
}

}  // namespace turboquant::cpu
