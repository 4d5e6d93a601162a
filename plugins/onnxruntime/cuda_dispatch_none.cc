// Built when the library has no CUDA kernels: the CUDA registrations are left out, so these are
// never reached; they fail loudly if they are.
#include "cuda_dispatch.h"

namespace turboquant::ort {

bool cuda_compiled() { return false; }

const char* cuda_last_split_kernel() { return "none"; }
const char* cuda_last_prefill_kernel() { return "none"; }
bool cuda_sm90a_compiled() { return false; }

namespace {
[[noreturn]] void no_cuda(const char* op) { fail(op, "this build of libturboquant_ort has no CUDA kernels"); }
}  // namespace

void cuda_pack(OrtKernelContext*, Format, int, bool, DType, const void*, int64_t, const Offset&, uint8_t*) { no_cuda("TQPack"); }
void cuda_unpack(OrtKernelContext*, Format, int, const uint8_t*, int64_t, const Offset&, DType, void*) { no_cuda("TQUnpack"); }
void cuda_attention(OrtKernelContext*, const AttentionParams&, const void*, const void*, const void*, const void*,
                    const uint8_t*, const uint8_t*, void*, uint8_t*, uint8_t*) {
  no_cuda("TQAttention");
}

void cuda_gqa(OrtKernelContext*, const AttentionParams&, const RotaryParams&, const int32_t*, bool, const void*,
              const void*, const void*, const uint8_t*, const uint8_t*, void*, uint8_t*, uint8_t*) {
  no_cuda("TQGroupQueryAttention");
}

void cuda_paged(OrtKernelContext*, const AttentionParams&, const RotaryParams&, const int32_t*, const int32_t*,
                const void*, const void*, const void*, const uint8_t*, const uint8_t*, void*, uint8_t*, uint8_t*) {
  no_cuda("TQPagedAttention");
}

}  // namespace turboquant::ort
