// The library's one entry point: RegisterCustomOps adds the `turboquant` domain (version 1) to a
// session's options. Everything else in the library has hidden visibility.
#include <cstdio>
#include <mutex>

#include "cuda_dispatch.h"
#include "ort_utils.h"
#include "tq_attention_op.h"
#include "tq_gqa_op.h"
#include "tq_pack_ops.h"
#include "tq_paged_op.h"

namespace {

constexpr const char* kDomain = "turboquant";

using turboquant::ort::Device;

template <template <ONNXTensorElementDataType, Device> class Op, Device kDevice>
void add_float_variants(Ort::CustomOpDomain& domain) {
  // Static: ORT keeps pointers to the op descriptions for as long as sessions use them.
  static Op<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, kDevice> f32;
  static Op<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, kDevice> f16;
  static Op<ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16, kDevice> bf16;
  domain.Add(&f32);
  domain.Add(&f16);
  domain.Add(&bf16);
}

template <Device kDevice>
void add_ops(Ort::CustomOpDomain& domain) {
  add_float_variants<turboquant::ort::PackOp, kDevice>(domain);
  static turboquant::ort::UnpackOp<kDevice> unpack;
  domain.Add(&unpack);
  add_float_variants<turboquant::ort::AttentionOp, kDevice>(domain);
  add_float_variants<turboquant::ort::GqaOp, kDevice>(domain);
  add_float_variants<turboquant::ort::PagedOp, kDevice>(domain);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) {  // an ORT older than the headers: no status can be made, so say it here
    std::fprintf(stderr, "turboquant: this onnxruntime is older than API version %d; ops not registered\n", ORT_API_VERSION);
    return nullptr;
  }
  Ort::InitApi(api);
  return turboquant::ort::guarded([&] {
    // One domain for the life of the process, shared by every session (ORT does not copy it).
    static Ort::CustomOpDomain* domain = nullptr;
    static std::once_flag once;
    std::call_once(once, [] {
      domain = new Ort::CustomOpDomain(kDomain);
      add_ops<Device::kCpu>(*domain);
      if (turboquant::ort::cuda_compiled()) add_ops<Device::kCuda>(*domain);
    });
    Ort::UnownedSessionOptions(options).Add(*domain);
  });
}
