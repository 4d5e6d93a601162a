// CUDA execution provider: ORT's compute stream, scratch from ORT's CUDA allocator, the launchers
// of ops/cuda. No synchronisation: ORT orders the stream.
#include "cuda_dispatch.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <unordered_map>

#include "turboquant/cuda_kernels.h"

namespace turboquant::ort {

bool cuda_compiled() { return true; }

const char* cuda_last_split_kernel() { return cuda::split_kernel_name(cuda::last_split_kernel()); }
const char* cuda_last_prefill_kernel() { return cuda::prefill_kernel_name(cuda::last_prefill_kernel()); }
#ifdef TQ_SM90A
bool cuda_sm90a_compiled() { return true; }
#else
bool cuda_sm90a_compiled() { return false; }
#endif

namespace {

void check(const char* op, cudaError_t e) {
  if (e != cudaSuccess) fail(op, "CUDA error: ", cudaGetErrorString(e));
}

// Named here, before the launch: the launchers would only say "misaligned address".
void check_aligned(const char* op, const uint8_t* past_key, const uint8_t* past_value, const uint8_t* present_key,
                   const uint8_t* present_value) {
  if (!cuda::caches_aligned(past_key, past_value, present_key, present_value)) {
    fail(op, "the packed caches (past_key, past_value, present_key, present_value) must start at multiples of ",
         cuda::kCacheAlignment, " bytes; got addresses ", static_cast<const void*>(past_key), ", ",
         static_cast<const void*>(past_value), ", ", static_cast<const void*>(present_key), ", ",
         static_cast<const void*>(present_value));
  }
}

cudaStream_t stream_of(OrtKernelContext* context) {
  return static_cast<cudaStream_t>(Ort::KernelContext(context).GetGPUComputeStream());
}

int device_sms(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int> sms;
  std::lock_guard<std::mutex> lock(mu);
  auto it = sms.find(device);
  if (it != sms.end()) return it->second;
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) n = 100;
  return sms[device] = n;
}

// Scratch memory from ORT's allocator for the CUDA device in use, released at scope exit.
struct Scratch {
  Scratch(OrtKernelContext* context, size_t bytes, int device) {
    if (bytes == 0) return;
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    Ort::ThrowOnError(Ort::GetApi().KernelContext_GetAllocator(context, info, &allocator));
    ptr = allocator->Alloc(allocator, bytes);
    if (ptr == nullptr) fail("turboquant", "could not allocate ", bytes, " bytes of CUDA scratch");
  }
  ~Scratch() {
    if (ptr) allocator->Free(allocator, ptr);
    if (allocator) Ort::GetApi().ReleaseAllocator(allocator);
  }
  OrtAllocator* allocator = nullptr;
  void* ptr = nullptr;
};

// launch(scratch, sms, stream) with workspace_bytes(sms) bytes of scratch on the current device.
template <typename Bytes, typename Launch>
void with_scratch(OrtKernelContext* context, const char* op, Bytes&& workspace_bytes, Launch&& launch) {
  int device = 0;
  check(op, cudaGetDevice(&device));
  const int sms = device_sms(device);
  Scratch scratch(context, workspace_bytes(sms), device);
  check(op, launch(scratch.ptr, sms, stream_of(context)));
}

}  // namespace

void cuda_pack(OrtKernelContext* context, Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n,
               const Offset& offset, uint8_t* out) {
  check("TQPack", cuda::pack(fmt, d, norm_correction, dt, x, n, offset, out, stream_of(context)));
}

void cuda_unpack(OrtKernelContext* context, Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset,
                 DType dt, void* out) {
  check("TQUnpack", cuda::unpack(fmt, d, in, n, offset, dt, out, stream_of(context)));
}

void cuda_attention(OrtKernelContext* context, const AttentionParams& p, const void* q, const void* k, const void* v,
                    const void* mask, const uint8_t* past_key, const uint8_t* past_value, void* y,
                    uint8_t* present_key, uint8_t* present_value) {
  constexpr const char* kOp = "TQAttention";
  check_aligned(kOp, past_key, past_value, present_key, present_value);
  with_scratch(context, kOp, [&](int sms) { return cuda::attention_workspace_bytes(p, sms); },
               [&](void* scratch, int sms, cudaStream_t stream) {
                 return cuda::attention(p, q, k, v, mask, past_key, past_value, y, present_key, present_value, scratch,
                                        sms, stream);
               });
}

void cuda_gqa(OrtKernelContext* context, const AttentionParams& p, const RotaryParams& rot, const int32_t* seqlens_k,
              bool first_prompt, const void* q, const void* k, const void* v, const uint8_t* past_key,
              const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value) {
  constexpr const char* kOp = "TQGroupQueryAttention";
  check_aligned(kOp, past_key, past_value, present_key, present_value);
  with_scratch(context, kOp, [&](int sms) { return cuda::gqa_workspace_bytes(p, rot, sms); },
               [&](void* scratch, int sms, cudaStream_t stream) {
                 return cuda::gqa_attention(p, rot, seqlens_k, first_prompt, q, k, v, past_key, past_value, y,
                                            present_key, present_value, scratch, sms, stream);
               });
}

void cuda_paged(OrtKernelContext* context, const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                const int32_t* past_seqlens, const void* q, const void* k, const void* v, const uint8_t* key_cache,
                const uint8_t* value_cache, void* y, uint8_t* key_pool, uint8_t* value_pool) {
  constexpr const char* kOp = "TQPagedAttention";
  check_aligned(kOp, key_cache, value_cache, key_pool, value_pool);
  with_scratch(context, kOp, [&](int sms) { return cuda::paged_workspace_bytes(p, rot, cumulative, past_seqlens, sms); },
               [&](void* scratch, int sms, cudaStream_t stream) {
                 return cuda::paged_attention(p, rot, cumulative, past_seqlens, q, k, v, key_cache, value_cache, y,
                                              key_pool, value_pool, scratch, sms, stream);
               });
}

}  // namespace turboquant::ort
