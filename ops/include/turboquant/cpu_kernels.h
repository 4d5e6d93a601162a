// CPU kernels of the turboquant ops. They take raw pointers and sizes and know nothing of
// ONNX Runtime or TensorRT; the runtime adapters validate tensors and call them.
// Preconditions (the adapters check them): head dims supported (format.h), Hq % Hkv == 0,
// buffers of the sizes stated below.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "turboquant/format.h"
#include "turboquant/params.h"

namespace turboquant::cpu {

using turboquant::AttentionParams;
using turboquant::BhsStrides;
using turboquant::MaskType;
using turboquant::Offset;

// Runs fn(i) for every i in [0, n), possibly concurrently. Adapters map it onto their runtime's
// thread pool (ORT: the session's intra-op pool); serial_for is the single-threaded fallback.
// The instruction set the kernels below run with, chosen at library load (ops/cpu/dispatch.cpp):
// "x86-64-v3" (AVX2, FMA, F16C), "x86-64" (any x86-64 CPU, or TURBOQUANT_CPU_BASELINE=1) or "generic".
const char* instruction_set();

using ParallelFor = std::function<void(size_t n, const std::function<void(size_t)>& fn)>;
void serial_for(size_t n, const std::function<void(size_t)>& fn);

// One vector: encode x[0..d) (float32, offset already removed) into out[0..packed_size).
void encode_vector(Format fmt, int d, bool norm_correction, const float* x, uint8_t* out);
// One vector: decode packed bytes into out[0..d) float32 (no offset added).
void decode_vector(Format fmt, int d, const uint8_t* in, float* out);

// x: n vectors of d elements of type dt; out: n * packed_size(fmt, d) bytes.
void pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
          uint8_t* out, const ParallelFor& pfor);
// in: n packed vectors; out: n * d elements of type dt.
void unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
            const ParallelFor& pfor);

// present_key/present_value: [B, Hkv, past_len + new_len, bytes]; past_* : [B, Hkv, past_len, bytes].
void attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
               const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
               uint8_t* present_value, const ParallelFor& pfor);

// TQGroupQueryAttention: rotary (when rot.rotary_dim > 0) on Q and the new K, then attention()
// with p.past_lens set (host memory, checked by gqa_past_lengths) over buffers that may be shared
// (present_key == past_key: the new rows are written in place).
void gqa_attention(const AttentionParams& p, const RotaryParams& rot, const void* q, const void* k, const void* v,
                   const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                   uint8_t* present_value, const ParallelFor& pfor);

// TQPagedAttention: sequence b's tokens [cumulative[b], cumulative[b + 1]) of q, k, v and y (strides
// p.q.s, p.k.s, p.v.s, p.y.s elements a token) after past_seqlens[b] tokens already in the pools,
// through gqa_attention one sequence at a time with p.blocks' row b (all checked by
// check_paged_tables). The new rows are packed into the pools key_pool/value_pool in place; when
// they are not key_cache/value_cache (the runtime did not alias them) the caches are copied first.
void paged_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                     const int32_t* past_seqlens, const void* q, const void* k, const void* v,
                     const uint8_t* key_cache, const uint8_t* value_cache, void* y,
                     uint8_t* key_pool, uint8_t* value_pool, const ParallelFor& pfor);

}  // namespace turboquant::cpu
