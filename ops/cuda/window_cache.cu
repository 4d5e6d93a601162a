// TQGroupQueryAttention over a window-sized buffer on the GPU (turboquant/window_cache.h, ONNX
// Runtime's layout): every length comes from seqlens_k on the device and the launches have a fixed
// geometry, so a decode step can be captured into a CUDA graph and replayed at later lengths. A decode
// step moves the kept rows to the front in place (one block per head, so that the left shift cannot
// race) and appends its row; a step of several tokens runs on a staging copy of the resident rows and
// copies the last L(T) rows back.
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/window_cache.h"

namespace turboquant::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kCopyBlocksPerHead = 16;  // grid.y: a head's rows spread over this many blocks

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Per sequence: the absolute past P = seqlens_k[b] + 1 - S (clamped at 0: lengths in device memory
// are clamped, not checked), the step's rows, and (when the rotary needs them) the absolute
// positions P + s the rotary turns Q and K by. staged: the rows of a staging copy.
__global__ void plan_kernel(const int32_t* seqlens_k, int64_t batch, int64_t new_len, int64_t capacity, int64_t window,
                            bool staged, int32_t* row_past, int32_t* first, int32_t* rows_after, int64_t* positions) {
  const int64_t n = batch * new_len;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / new_len, s = i % new_len;
    const int64_t raw = static_cast<int64_t>(seqlens_k[b]) + 1 - new_len;
    const int64_t past = raw < 0 ? 0 : raw;
    if (positions) positions[i] = past + s;
    if (s != 0) continue;
    const WindowStep w = window_step(past, new_len, capacity, window);
    // in place: the kept rows [resident - kept, resident) move to [0, kept); staged: the resident rows
    // are the staging copy's past, and its rows [resident - kept, resident - kept + end) come back
    row_past[b] = static_cast<int32_t>(staged ? w.resident : w.kept);
    first[b] = static_cast<int32_t>(w.resident - w.kept);
    rows_after[b] = static_cast<int32_t>(w.end);
  }
}

// Rows [first[b], first[b] + count[b]) of each (b, h) block of src to rows [0, count[b]) of dst's; with
// zero_rest, dst rows [count[b], dst_rows) zeroed too. first == nullptr: from row 0. src and dst never
// overlap.
struct RowCopy {
  const uint8_t* src = nullptr;
  int64_t src_rows = 0;
  uint8_t* dst = nullptr;
  int64_t dst_rows = 0;
  int64_t row_bytes = 0, kv_heads = 1;
  const int32_t* first = nullptr;
  const int32_t* count = nullptr;
  bool zero_rest = false;
};

template <typename Word>
__global__ void row_copy_kernel(RowCopy c) {
  const int64_t bh = blockIdx.x, b = bh / c.kv_heads;
  const int64_t words_per_row = c.row_bytes / static_cast<int64_t>(sizeof(Word));
  int64_t n = c.count[b];
  n = n < 0 ? 0 : (n > c.dst_rows ? c.dst_rows : n);
  const int64_t from = c.first ? c.first[b] : 0;
  if (from < 0 || from + n > c.src_rows) return;  // clamped lengths never read past the source
  const Word* src = reinterpret_cast<const Word*>(c.src + (bh * c.src_rows + from) * c.row_bytes);
  Word* dst = reinterpret_cast<Word*>(c.dst + bh * c.dst_rows * c.row_bytes);
  const int64_t copied = n * words_per_row, total = c.zero_rest ? c.dst_rows * words_per_row : copied;
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total; i += step) {
    dst[i] = i < copied ? src[i] : Word{0};
  }
}

// A decode step's compaction of shared buffers, in place: rows [first[b], first[b] + count[b]) of
// each (b, h) of cache blockIdx.y moved to rows [0, count[b]), one block per (b, h) and cache, in
// ascending chunks each read whole before any of it is written (a left shift then never overwrites
// a word a later chunk still reads); nothing to do where first[b] == 0, most steps.
struct RowShift {
  uint8_t* cache[2] = {nullptr, nullptr};  // key, value; null: not shared (moved by copy_rows)
  int64_t row_bytes[2] = {0, 0};
  int64_t rows = 0, kv_heads = 1;
  const int32_t* first = nullptr;
  const int32_t* count = nullptr;
};

constexpr int kShiftWords = 4;  // words a thread moves per chunk

template <typename Word>
__device__ void shift_left(Word* dst, const Word* src, int64_t words) {
  const int64_t chunk = static_cast<int64_t>(blockDim.x) * kShiftWords;
  for (int64_t at = 0; at < words; at += chunk) {
    Word r[kShiftWords];
#pragma unroll
    for (int j = 0; j < kShiftWords; ++j) {
      const int64_t i = at + j * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < words) r[j] = src[i];
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kShiftWords; ++j) {
      const int64_t i = at + j * static_cast<int64_t>(blockDim.x) + threadIdx.x;
      if (i < words) dst[i] = r[j];
    }
  }
}

__global__ void shift_rows_kernel(RowShift s) {
  const int c = blockIdx.y;
  const int64_t bh = blockIdx.x, b = bh / s.kv_heads, from = s.first[b];
  if (s.cache[c] == nullptr || from <= 0) return;
  int64_t n = s.count[b];
  n = n < 0 ? 0 : n;
  if (from + n > s.rows) return;  // clamped lengths never read past the buffer
  const int64_t rb = s.row_bytes[c];
  uint8_t* head = s.cache[c] + bh * s.rows * rb;
  if (rb % 4 == 0) {
    shift_left(reinterpret_cast<uint32_t*>(head), reinterpret_cast<const uint32_t*>(head + from * rb), n * rb / 4);
  } else {
    shift_left(head, head + from * rb, n * rb);
  }
}

cudaError_t copy_rows(const RowCopy& c, int64_t batch, cudaStream_t stream) {
  const int64_t heads = batch * c.kv_heads;
  if (heads == 0 || c.dst_rows == 0) return cudaSuccess;
  if (heads > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(heads), kCopyBlocksPerHead);
  if (c.row_bytes % 4 == 0) {
    row_copy_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(c);
  } else {
    row_copy_kernel<uint8_t><<<grid, kThreads, 0, stream>>>(c);
  }
  return cudaGetLastError();
}

// The parts of a windowed call the host knows: the attention's parameters over the (shared) present
// or the staging copy, and the workspace's pieces.
struct WindowLayout {
  AttentionParams attention;
  bool staged = false;
  int64_t rows = 0;  // per (b, h): the staging copy's, or the buffer's
  bool positions = false;
};

WindowLayout layout(const AttentionParams& p, const RotaryParams& rot) {
  WindowLayout l;
  const int64_t cap = p.window_cache, s = p.new_len;
  // a decode step never drops a row it reads (L(T) >= min(T, W)); longer steps are staged, whose
  // copy holds at most min(past, C) resident rows and the new ones
  l.staged = s > 1;
  const int64_t past_bound = p.past_len < cap ? p.past_len : cap;
  l.rows = l.staged ? past_bound + s : cap;
  l.positions = rot.rotary_dim > 0 && rot.position_ids == nullptr;
  AttentionParams& a = l.attention;
  a = p;
  a.window_cache = 0;
  a.past_lens_bias = 0;
  a.past_rows = a.present_rows = l.rows;
  // a decode step's plan covers every kept row (C - 1), as a replayed CUDA graph's must
  a.past_len = l.staged ? past_bound : cap - 1;
  return l;
}

struct WindowWorkspace {
  int32_t *row_past = nullptr, *first = nullptr, *rows_after = nullptr;
  int64_t* positions = nullptr;
  uint8_t *key_rows = nullptr, *value_rows = nullptr;  // the staging copy (a step of several tokens)
  void* rest = nullptr;                                 // gqa_attention's own workspace
  size_t bytes = 0;
};

WindowWorkspace carve(const AttentionParams& p, const WindowLayout& l, void* base) {
  WindowWorkspace w;
  uint8_t* at = static_cast<uint8_t*>(base);
  auto take = [&](size_t n) {
    uint8_t* r = at ? at + w.bytes : nullptr;
    w.bytes += align256(n);
    return r;
  };
  const size_t lens = static_cast<size_t>(p.batch) * sizeof(int32_t);
  w.row_past = reinterpret_cast<int32_t*>(take(lens));
  w.first = reinterpret_cast<int32_t*>(take(lens));
  w.rows_after = reinterpret_cast<int32_t*>(take(lens));
  if (l.positions) w.positions = reinterpret_cast<int64_t*>(take(static_cast<size_t>(p.batch * p.new_len) * 8));
  if (l.staged) {
    const size_t heads_rows = static_cast<size_t>(p.batch * p.kv_heads * l.rows);
    w.key_rows = take(heads_rows * static_cast<size_t>(p.key_row()));
    w.value_rows = take(heads_rows * static_cast<size_t>(p.value_row()));
  }
  w.rest = at ? at + w.bytes : nullptr;
  return w;
}

}  // namespace

size_t window_cache_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, int num_sms) {
  const WindowLayout l = layout(p, rot);
  return carve(p, l, nullptr).bytes + gqa_workspace_bytes(l.attention, rot, num_sms);
}

cudaError_t window_cache_attention(const AttentionParams& p, const RotaryParams& rot0, const int32_t* seqlens_k,
                                   const void* q, const void* k, const void* v, const uint8_t* past_key,
                                   const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value,
                                   void* workspace, int num_sms, cudaStream_t stream) {
  const WindowLayout l = layout(p, rot0);
  const WindowWorkspace w = carve(p, l, workspace);
  RotaryParams rot = rot0;
  const int64_t n = p.batch * p.new_len;
  const int blocks = static_cast<int>((n + kThreads - 1) / kThreads < 1024 ? (n + kThreads - 1) / kThreads : 1024);
  plan_kernel<<<blocks, kThreads, 0, stream>>>(seqlens_k, p.batch, p.new_len, p.window_cache, p.window, l.staged,
                                               w.row_past, w.first, w.rows_after, w.positions);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (l.positions) rot.position_ids = w.positions;
  AttentionParams a = l.attention;
  a.past_lens = w.row_past;
  const int64_t cap = p.window_cache;
  struct Cache {
    const uint8_t* past;
    uint8_t* present;
    uint8_t* rows;
    int64_t row_bytes;
  };
  const Cache caches[2] = {{past_key, present_key, w.key_rows, p.key_row()},
                           {past_value, present_value, w.value_rows, p.value_row()}};
  if (!l.staged) {
    RowShift shift;
    shift.rows = cap, shift.kv_heads = p.kv_heads, shift.first = w.first, shift.count = a.past_lens;
    for (int i = 0; i < 2; ++i) {
      const Cache& c = caches[i];
      if (c.past == c.present) {  // the shared buffer: its kept rows shifted to the front in place
        shift.cache[i] = c.present, shift.row_bytes[i] = c.row_bytes;
        continue;
      }
      // a fresh present: the kept rows copied over, the rest zeroed
      RowCopy m{c.past, cap, c.present, cap, c.row_bytes, p.kv_heads, w.first, a.past_lens, true};
      if ((e = copy_rows(m, p.batch, stream)) != cudaSuccess) return e;
    }
    if ((shift.cache[0] || shift.cache[1]) && p.batch * p.kv_heads > 0) {
      if (p.batch * p.kv_heads > INT32_MAX) return cudaErrorInvalidValue;
      shift_rows_kernel<<<dim3(static_cast<unsigned>(p.batch * p.kv_heads), 2), kThreads, 0, stream>>>(shift);
      if ((e = cudaGetLastError()) != cudaSuccess) return e;
    }
    return gqa_attention_with_lengths(a, rot, q, k, v, present_key, present_value, y, present_key, present_value,
                                      w.rest, num_sms, stream);
  }
  for (const Cache& c : caches) {  // the resident rows into a zeroed staging copy (its new rows' padding zeros)
    RowCopy in{c.past, cap, c.rows, l.rows, c.row_bytes, p.kv_heads, nullptr, a.past_lens, true};
    if ((e = copy_rows(in, p.batch, stream)) != cudaSuccess) return e;
  }
  e = gqa_attention_with_lengths(a, rot, q, k, v, w.key_rows, w.value_rows, y, w.key_rows, w.value_rows, w.rest,
                                 num_sms, stream);
  if (e != cudaSuccess) return e;
  for (const Cache& c : caches) {  // the last L(T) rows back; a fresh present's rows after them zeroed
    RowCopy out{c.rows, l.rows, c.present, cap, c.row_bytes, p.kv_heads, w.first, w.rows_after, c.past != c.present};
    if ((e = copy_rows(out, p.batch, stream)) != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace turboquant::cuda
