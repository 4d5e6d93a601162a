// Unnormalised Walsh-Hadamard transform, in place, Sylvester (natural) order. The butterfly order
// (h = 1, 2, 4, ...) is the one the Python reference uses, so results agree to the bit.
#pragma once

namespace turboquant::cpu {

inline void fwht_inplace(float* x, int n) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

}  // namespace turboquant::cpu
