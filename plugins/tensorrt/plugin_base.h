// What every turboquant TensorRT plugin shares: the IPluginV3 capability plumbing, namespace and
// version, serialisation through Fields, and the type mapping to the kernels' DType.
#pragma once

#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "trt_fields.h"
#include "turboquant/attention_setup.h"  // Dims, InvalidArgument
#include "turboquant/format.h"

namespace turboquant::trt {

constexpr const char* kNamespace = "turboquant";
constexpr const char* kVersion = "1";

inline bool is_float(nvinfer1::DataType t) {
  return t == nvinfer1::DataType::kFLOAT || t == nvinfer1::DataType::kHALF || t == nvinfer1::DataType::kBF16;
}
inline DType to_dtype(nvinfer1::DataType t) {
  return t == nvinfer1::DataType::kHALF ? DType::kFloat16 : t == nvinfer1::DataType::kBF16 ? DType::kBFloat16 : DType::kFloat32;
}
// The packed tensors' type, from the packed_dtype field (an ONNX element type): uint8 (2, ONNX Runtime's
// form) or int8 (3, the same bytes: TensorRT refuses UINT8 for tensors between layers and for network
// outputs that no Identity or Cast layer makes, so --target tensorrt declares them int8).
inline bool is_packed_type(nvinfer1::DataType t) { return t == nvinfer1::DataType::kUINT8 || t == nvinfer1::DataType::kINT8; }
nvinfer1::DataType field_packed_type(const char* op, const Fields& f);
inline int64_t volume_but_last(const nvinfer1::Dims& d) {
  int64_t n = 1;
  for (int i = 0; i + 1 < d.nbDims; ++i) n *= d.d[i];
  return n;
}
inline Dims to_dims(const nvinfer1::Dims& d) { return Dims(d.d, d.d + d.nbDims); }
Format field_format(const char* op, const Fields& f, const char* name);

// The device's SM count, which sizes the split-KV work (and so the workspace).
inline int sm_count() {
  int device = 0, n = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0) {
    cudaGetLastError();  // clear
    return 132;          // H100/H200: a size for the workspace bound when no device answers
  }
  return n;
}

// enqueue's status for a launcher's: 0, or -1 with the CUDA error logged under the op's name.
inline int32_t launch_status(const char* op, cudaError_t e) noexcept {
  if (e == cudaSuccess) return 0;
  log_error(std::string(op) + ": CUDA error: " + cudaGetErrorString(e));
  return -1;
}

// The most scratch any call of a profile needs: bytes(p) over every batch size and query length
// from b_min and q_min up to p's (the profile's largest), since the split count's rounding makes
// the scratch no monotone function of either; bytes sets what follows from them (the past).
template <typename Bytes>
size_t largest_over_profile(AttentionParams p, int64_t b_min, int64_t q_min, Bytes&& bytes) {
  const int64_t b_max = p.batch, q_max = p.q_len;
  size_t most = 0;
  for (int64_t b = b_min < 1 ? 1 : b_min; b <= b_max; ++b) {
    for (int64_t q = q_min < 1 ? 1 : q_min; q <= q_max; ++q) {
      p.batch = b;
      p.q_len = q;
      const size_t n = bytes(p);
      most = n > most ? n : most;
    }
  }
  return most;
}

// Build: the build capability, IPluginV3OneBuild, or IPluginV3OneBuildV2 for a plugin whose outputs
// alias inputs (TensorRT 10.3 and later).
template <typename Build>
class PluginBaseOf : public nvinfer1::IPluginV3,
                     public nvinfer1::IPluginV3OneCore,
                     public Build,
                     public nvinfer1::IPluginV3OneRuntime {
 public:
  explicit PluginBaseOf(Fields fields) : fields_(std::move(fields)) {}

  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override {
    switch (type) {
      case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
      case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<Build*>(this);
      case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  const char* getPluginVersion() const noexcept override { return kVersion; }
  const char* getPluginNamespace() const noexcept override { return kNamespace; }

  // Optional inputs make the input count vary between nodes; enqueue's descriptors do not carry it.
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc*, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc*, int32_t) noexcept override {
    num_inputs_ = nbInputs;
    return 0;
  }
  int32_t onShapeChange(const nvinfer1::PluginTensorDesc*, int32_t nbInputs, const nvinfer1::PluginTensorDesc*,
                        int32_t) noexcept override {
    num_inputs_ = nbInputs;
    return 0;
  }
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext*) noexcept override { return clone(); }
  const nvinfer1::PluginFieldCollection* getFieldsToSerialize() noexcept override { return fields_.collection(); }

 protected:
  Fields fields_;
  int32_t num_inputs_ = 0;
  nvinfer1::DataType packed_type_ = nvinfer1::DataType::kUINT8;  // set by each plugin from its packed_dtype field
};
using PluginBase = PluginBaseOf<nvinfer1::IPluginV3OneBuild>;

// The per-plugin boilerplate: its name and clone, from Derived::kName and its Fields.
template <typename Derived, typename Build = nvinfer1::IPluginV3OneBuild>
class Plugin : public PluginBaseOf<Build> {
 public:
  using PluginBaseOf<Build>::PluginBaseOf;
  const char* getPluginName() const noexcept override { return Derived::kName; }
  nvinfer1::IPluginV3* clone() noexcept override {
    try {
      return new Derived(this->fields_);
    } catch (const std::exception& e) {
      log_error(e.what());
      return nullptr;
    }
  }
};

// A creator for plugin P (constructed from Fields; throws InvalidArgument on bad fields).
template <typename P>
class Creator : public nvinfer1::IPluginCreatorV3One {
 public:
  Creator() : fields_(P::declare()) {}
  nvinfer1::IPluginV3* createPlugin(const char* /*name*/, const nvinfer1::PluginFieldCollection* fc,
                                    nvinfer1::TensorRTPhase /*phase*/) noexcept override {
    try {
      Fields f = P::declare();
      f.read(P::kName, fc);
      return new P(std::move(f));
    } catch (const std::exception& e) {
      log_error(e.what());
      return nullptr;
    }
  }
  const nvinfer1::PluginFieldCollection* getFieldNames() noexcept override { return fields_.names(); }
  const char* getPluginName() const noexcept override { return P::kName; }
  const char* getPluginVersion() const noexcept override { return kVersion; }
  const char* getPluginNamespace() const noexcept override { return kNamespace; }

 private:
  Fields fields_;
};

}  // namespace turboquant::trt
