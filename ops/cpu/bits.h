// LSB-first bit packing of 3- and 4-bit indices (coordinate i in bits [b*i, b*i+b)).
#pragma once

#include <cstdint>

namespace turboquant::cpu {

// n % 8 == 0; writes n*bits/8 bytes.
inline void pack_indices(const uint8_t* idx, int n, int bits, uint8_t* out) {
  if (bits == 4) {
    for (int i = 0; i < n; i += 2) *out++ = static_cast<uint8_t>(idx[i] | (idx[i + 1] << 4));
    return;
  }
  for (int i = 0; i < n; i += 8) {  // 3 bits: 8 indices fill 3 bytes
    uint32_t w = 0;
    for (int k = 0; k < 8; ++k) w |= static_cast<uint32_t>(idx[i + k]) << (3 * k);
    *out++ = static_cast<uint8_t>(w);
    *out++ = static_cast<uint8_t>(w >> 8);
    *out++ = static_cast<uint8_t>(w >> 16);
  }
}

inline void unpack_indices(const uint8_t* in, int n, int bits, uint8_t* idx) {
  if (bits == 4) {
    for (int i = 0; i < n; i += 2, ++in) {
      idx[i] = *in & 15u;
      idx[i + 1] = *in >> 4;
    }
    return;
  }
  for (int i = 0; i < n; i += 8, in += 3) {
    const uint32_t w = in[0] | (in[1] << 8) | (in[2] << 16);
    for (int k = 0; k < 8; ++k) idx[i + k] = (w >> (3 * k)) & 7u;
  }
}

}  // namespace turboquant::cpu
