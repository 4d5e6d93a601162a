// TQGroupQueryAttention on the GPU: past lengths read from seqlens_k where they are used, the rotary
// embedding of Q and the new K (and the key scale) into workspace, then the TQAttention launcher;
// for a decode step (fuses_rotary) the attention kernels rotate and scale Q and K themselves,
// without the rotary launch and the wait for it (docs/performance.md, kept choices).
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/rotary.h"

namespace turboquant::cuda {
namespace {

constexpr int kThreads = 128;

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// One tensor to rotate: x viewed through st, rotated into a dense [B, S, heads, D] copy at out.
struct RotaryJob {
  int64_t heads;
  BhsStrides st, dense;
  const void* x;
  void* out;
};

// One warp per (b, s, head) of Q, then of the new K (one launch for both), its lanes on the
// rotation's pairs (a thread per head walking its elements in turn was several times slower). The
// attention kernels that follow are
// programmatic dependent launches; they may start (and build their tables) as soon as this launch
// has, and wait for it before they read anything.
__global__ void rotary_kernel(AttentionParams p, RotaryParams rot, RotaryJob jq, RotaryJob jk) {
  detail::launch_dependents();
  constexpr int kWarps = kThreads / 32;
  int64_t i = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t nq = p.batch * p.q_len * jq.heads;
  const bool is_q = i < nq;
  if (!is_q) i -= nq;
  const RotaryJob& j = is_q ? jq : jk;
  const int64_t heads = j.heads;
  if (i >= p.batch * p.q_len * heads) return;
  const int64_t h = i % heads, bs = i / heads, b = bs / p.q_len, s = bs % p.q_len;
  const int64_t pos = rot.position_ids ? rot.position_ids[bs] : p.past_of(b) + s;
  const int64_t in = b * j.st.b + h * j.st.h + s * j.st.s, out = b * j.dense.b + h * j.dense.h + s * j.dense.s;
  const int d = p.head_dim, half = rotary_applies(rot, d) ? rot.rotary_dim / 2 : 0;
  const ScaleSide side = is_q ? ScaleSide::kQuery : ScaleSide::kKey;
  const float* scale = key_scale_row(rot, is_q ? h / (heads / p.kv_heads) : h, d);
  for (int k = lane; k < half; k += 32) {
    int ia, ib;
    rotary_pair_index(rot, k, &ia, &ib);
    float xa = load_float(p.dtype, j.x, in + ia), xb = load_float(p.dtype, j.x, in + ib);
    rotate_pair(rot, p.dtype, pos, k, &xa, &xb);
    store_float(p.dtype, j.out, out + ia, scaled(scale, side, ia, xa));
    store_float(p.dtype, j.out, out + ib, scaled(scale, side, ib, xb));
  }
  for (int k = 2 * half + lane; k < d; k += 32) {
    store_float(p.dtype, j.out, out + k, scaled(scale, side, k, load_float(p.dtype, j.x, in + k)));
  }
}

struct Workspace {
  int32_t* past = nullptr;
  uint8_t* q_rot = nullptr;
  uint8_t* k_rot = nullptr;
  void* attention = nullptr;
  size_t bytes = 0;
};

Workspace carve(const AttentionParams& p, const RotaryParams& rot, int num_sms, void* base) {
  Workspace w;
  uint8_t* at = static_cast<uint8_t*>(base);
  auto take = [&](size_t n) {
    uint8_t* r = at ? at + w.bytes : nullptr;
    w.bytes += align256(n);
    return r;
  };
  w.past = reinterpret_cast<int32_t*>(take(static_cast<size_t>(p.batch) * sizeof(int32_t)));
  if (rot.rotary_dim > 0) {
    const size_t per_head = static_cast<size_t>(p.batch * p.q_len * p.head_dim * dtype_size(p.dtype));
    w.q_rot = take(per_head * p.q_heads);
    w.k_rot = take(per_head * p.kv_heads);
  }
  w.attention = take(attention_workspace_bytes(p, num_sms));
  return w;
}

// The plan a step captured into a CUDA graph (ORT's enable_cuda_graph, onnxruntime-genai's, TensorRT's)
// is launched with: replays run it at later lengths with the launch it was captured with, so its splits
// cover every row the buffers hold; each sequence's own past is still read from seqlens_k when it runs.
AttentionParams replayable(const AttentionParams& p, bool first_prompt) {
  AttentionParams r = p;
  if (!first_prompt && p.present_rows > p.past_len + p.new_len) r.past_len = p.present_rows - p.new_len;
  return r;
}

RotaryJob rotary_job(const AttentionParams& p, int64_t heads, const BhsStrides& st, const void* x, uint8_t* out) {
  return RotaryJob{heads, st, {p.q_len * heads * p.head_dim, p.head_dim, heads * p.head_dim}, x, out};
}

cudaError_t rotate(const AttentionParams& p, const RotaryParams& rot, const RotaryJob& jq, const RotaryJob& jk,
                   cudaStream_t stream) {
  const int64_t n = p.batch * p.q_len * (jq.heads + jk.heads), per_block = kThreads / 32;
  if (n == 0) return cudaSuccess;
  if ((n + per_block - 1) / per_block > INT32_MAX) return cudaErrorInvalidValue;
  rotary_kernel<<<static_cast<unsigned>((n + per_block - 1) / per_block), kThreads, 0, stream>>>(p, rot, jq, jk);
  return cudaGetLastError();
}

}  // namespace

size_t gqa_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, int num_sms) {
  if (p.window_cache > 0) return window_cache_workspace_bytes(p, rot, num_sms);
  // enough for the replayable plan too: a capture then finds the block its warm-up runs were given
  // (a first prompt's, no past, is its own: sized as a continuation it would hold partials for every
  // query row)
  const size_t now = carve(p, rot, num_sms, nullptr).bytes;
  const size_t replay = carve(replayable(p, p.past_len == 0), rot, num_sms, nullptr).bytes;
  return now > replay ? now : replay;
}

namespace {

// The rotary (fused into a decode step's kernels, or a launch into workspace), then the attention,
// with p.past_lens set.
cudaError_t attend(AttentionParams p, const AttentionParams& p0, const RotaryParams& rot, const Workspace& w,
                   const void* q, const void* k, const void* v, const uint8_t* past_key, const uint8_t* past_value,
                   void* y, uint8_t* present_key, uint8_t* present_value, int num_sms, cudaStream_t stream) {
  if (rot.rotary_dim > 0 && fuses_rotary(p, past_key, past_value)) {  // a decode step: no rotary launch
    return attention(p, q, k, v, nullptr, past_key, past_value, y, present_key, present_value, w.attention, num_sms,
                     stream, &rot);
  }
  if (rot.rotary_dim > 0) {
    const RotaryJob jq = rotary_job(p, p.q_heads, p0.q, q, w.q_rot), jk = rotary_job(p, p.kv_heads, p0.k, k, w.k_rot);
    cudaError_t e = rotate(p, rot, jq, jk, stream);
    if (e != cudaSuccess) return e;
    p.q = jq.dense, p.k = jk.dense;
    q = w.q_rot;
    k = w.k_rot;
  }
  return attention(p, q, k, v, nullptr, past_key, past_value, y, present_key, present_value, w.attention, num_sms,
                   stream);
}

}  // namespace

cudaError_t gqa_attention(const AttentionParams& p0, const RotaryParams& rot, const int32_t* seqlens_k,
                          bool first_prompt, const void* q, const void* k, const void* v, const uint8_t* past_key,
                          const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value,
                          void* workspace, int num_sms, cudaStream_t stream) {
  if (!caches_aligned(past_key, past_value, present_key, present_value)) return cudaErrorMisalignedAddress;
  if (p0.batch == 0) return cudaSuccess;
  if (p0.window_cache > 0) {
    return window_cache_attention(p0, rot, seqlens_k, q, k, v, past_key, past_value, y, present_key, present_value,
                                  workspace, num_sms, stream);
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return e;
  AttentionParams p = capture == cudaStreamCaptureStatusActive ? replayable(p0, first_prompt) : p0;
  const Workspace w = carve(p, rot, num_sms, workspace);
  if (first_prompt) {  // no past
    if ((e = cudaMemsetAsync(w.past, 0, p.batch * sizeof(int32_t), stream)) != cudaSuccess) return e;
    p.past_lens = w.past;
  } else {  // seqlens_k[b] = total - 1, so the past is seqlens_k[b] + 1 - S, read where it is used
    p.past_lens = seqlens_k;
    p.past_lens_bias = 1 - p.q_len;
  }
  return attend(p, p0, rot, w, q, k, v, past_key, past_value, y, present_key, present_value, num_sms, stream);
}

cudaError_t gqa_attention_with_lengths(const AttentionParams& p0, const RotaryParams& rot, const void* q,
                                       const void* k, const void* v, const uint8_t* past_key,
                                       const uint8_t* past_value, void* y, uint8_t* present_key,
                                       uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  if (e != cudaSuccess) return e;
  const AttentionParams p = capture == cudaStreamCaptureStatusActive ? replayable(p0, false) : p0;
  const Workspace w = carve(p, rot, num_sms, workspace);
  return attend(p, p0, rot, w, q, k, v, past_key, past_value, y, present_key, present_value, num_sms, stream);
}

}  // namespace turboquant::cuda
