// The window-sized cache layout of GroupQueryAttention's sliding_window_cache = 1 (ONNX Runtime's
// contract, kept byte for byte so that genai allocates and drives it as it does the original): a
// buffer of C >= W rows per (b, kv head) whose rows [0, L(T)) hold the L(T) most recent positions
// of a sequence of T tokens in order, rows drifting forward until the buffer is full, then the
// oldest G = C - W + 1 (or a multiple) dropped off the front at once, so that L depends on T alone.
#pragma once

#include <cstdint>

#include "turboquant/numerics.h"  // TQ_HD

namespace turboquant {

// L(T): the rows a sequence of T tokens occupies (ORT's WindowedCacheEnd).
TQ_HD int64_t window_cache_end(int64_t tokens, int64_t capacity, int64_t window) {
  if (tokens <= capacity) return tokens;
  const int64_t gap = capacity - window + 1;
  return tokens - gap * ((tokens - capacity + gap - 1) / gap);
}

// One step of S new tokens after P past ones.
struct WindowStep {
  int64_t resident = 0;  // rows held before the step: L(P)
  int64_t kept = 0;      // past rows still held after it: L(P + S) - S (negative when S > L(P + S))
  int64_t end = 0;       // rows held after it: L(P + S)
  // The step drops past rows its own first query still reads (kept < min(P, W - 1)): it runs on a
  // staging copy of the resident rows and keeps the last `end` rows of the result.
  bool staged = false;
};

TQ_HD WindowStep window_step(int64_t past, int64_t new_len, int64_t capacity, int64_t window) {
  WindowStep s;
  s.resident = window_cache_end(past, capacity, window);
  s.end = window_cache_end(past + new_len, capacity, window);
  s.kept = s.end - new_len;
  const int64_t needed = past < window - 1 ? past : window - 1;
  s.staged = s.kept < needed;
  return s;
}

}  // namespace turboquant
