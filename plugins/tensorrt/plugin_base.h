// What every turboquant TensorRT plugin shares: the IPluginV3 capability plumbing, namespace and
// version, serialisation through Fields, and the type mapping to the kernels' DType.
#pragma once

#include <NvInferRuntime.h>

#include <string>

#include "trt_fields.h"
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
inline int64_t volume_but_last(const nvinfer1::Dims& d) {
  int64_t n = 1;
  for (int i = 0; i + 1 < d.nbDims; ++i) n *= d.d[i];
  return n;
}
Format field_format(const char* op, const Fields& f, const char* name);

class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime {
 public:
  explicit PluginBase(Fields fields) : fields_(std::move(fields)) {}

  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override {
    switch (type) {
      case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
      case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
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
};

// The per-plugin boilerplate: its name and clone, from Derived::kName and its Fields.
template <typename Derived>
class Plugin : public PluginBase {
 public:
  using PluginBase::PluginBase;
  const char* getPluginName() const noexcept override { return Derived::kName; }
  nvinfer1::IPluginV3* clone() noexcept override {
    try {
      return new Derived(fields_);
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
