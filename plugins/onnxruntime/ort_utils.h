// Shared helpers of the ONNX Runtime adapter: error messages, attribute reading, dtype mapping and
// the bridge from the kernels' ParallelFor to ORT's intra-op thread pool.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <optional>
#include <utility>
#include <stdexcept>
#include <string>
#include <vector>

#include "turboquant/attention_setup.h"  // InvalidArgument
#include "turboquant/cpu_kernels.h"
#include "turboquant/gqa_setup.h"  // GroupedAttrs

namespace turboquant::ort {

// An invalid input or attribute. Its message names the op and what was expected; the kernels'
// ComputeV2 turns it into an ORT_INVALID_ARGUMENT status.
using turboquant::InvalidArgument;

template <typename... Args>
[[noreturn]] void fail(const char* op, Args&&... args) {
  throw_invalid(op, std::forward<Args>(args)...);
}

std::string shape_str(const std::vector<int64_t>& s);

// The shape of an optional input (nullopt when absent).
std::optional<Dims> shape_of(const Ort::ConstValue& x);
// Fails naming op and input when a present input's element type is not `want`.
void check_input_type(const char* op, const Ort::ConstValue& x, const char* name, ONNXTensorElementDataType want);

// An attribute read as the type the op declares, or dflt when the node has none of that name; an
// attribute of any other type fails, naming op, attribute, the declared and the given type (ORT's
// typed getters alone would report it absent, and the op would run with its default).
int64_t attr_int(const char* op, const OrtKernelInfo* info, const char* name, int64_t dflt);
float attr_float(const char* op, const OrtKernelInfo* info, const char* name, float dflt);
std::string attr_string(const char* op, const OrtKernelInfo* info, const char* name, const std::string& dflt);
// The same during shape inference: an int attribute, or dflt when absent.
int64_t infer_attr_int(const char* op, OrtShapeInferContext* ctx, const char* name, int64_t dflt);

// The format named by a string attribute; fails with the list of valid names.
Format attr_format(const char* op, const OrtKernelInfo* info, const char* name, const char* dflt);
bool attr_bool(const char* op, const OrtKernelInfo* info, const char* name, bool dflt);
// The attributes GroupQueryAttention and PagedAttention share, with their defaults, and the formats.
void read_grouped_attrs(const char* op, const OrtKernelInfo* info, GroupedAttrs& a);

DType to_dtype(ONNXTensorElementDataType t);
const char* dtype_name(ONNXTensorElementDataType t);

// ParallelFor over the session's intra-op thread pool.
cpu::ParallelFor ort_parallel_for(const OrtKernelContext* ctx);

// Runs fn, converting exceptions into an OrtStatus (nullptr on success).
template <typename Fn>
OrtStatusPtr guarded(Fn&& fn) {
  try {
    fn();
    return nullptr;
  } catch (const InvalidArgument& e) {
    return Ort::Status(e.what(), ORT_INVALID_ARGUMENT).release();
  } catch (const Ort::Exception& e) {
    return Ort::Status(e.what(), e.GetOrtErrorCode()).release();
  } catch (const std::exception& e) {
    return Ort::Status(e.what(), ORT_RUNTIME_EXCEPTION).release();
  }
}

// Which execution provider a registration serves.
enum class Device { kCpu, kCuda };

// The CustomOpBase boilerplate shared by every op: a kernel built from the node's attributes,
// computed under `guarded`, registered for the CPU or the CUDA execution provider.
template <typename TOp, typename TKernel, Device kDevice>
struct OpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  OrtStatusPtr CreateKernelV2(const OrtApi& /*api*/, const OrtKernelInfo* info, void** kernel) const {
    return guarded([&] { *kernel = new TKernel(info, static_cast<const TOp*>(this)->dtype(), kDevice); });
  }
  const char* GetExecutionProviderType() const {
    return kDevice == Device::kCuda ? "CUDAExecutionProvider" : "CPUExecutionProvider";
  }
};

}  // namespace turboquant::ort
