// A plugin's attributes as TensorRT PluginFields: declared with defaults, read from a creator's
// PluginFieldCollection (the ONNX parser passes node attributes: INT as kINT32, FLOAT as kFLOAT32,
// STRING as kCHAR), and handed back for serialisation.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace turboquant::trt {

class Fields {
 public:
  Fields& add_int(const char* name, int32_t dflt);
  Fields& add_float(const char* name, float dflt);
  Fields& add_string(const char* name, const char* dflt);

  // Overrides the declared defaults; throws InvalidArgument naming an unknown field or a wrong type.
  void read(const char* op, const nvinfer1::PluginFieldCollection* fc);

  int32_t get_int(const char* name) const;
  float get_float(const char* name) const;
  const std::string& get_string(const char* name) const;

  // Every field with its current value (pointers into this object, valid while it lives unchanged).
  const nvinfer1::PluginFieldCollection* collection();
  // The declared names and types, for IPluginCreatorV3One::getFieldNames.
  const nvinfer1::PluginFieldCollection* names();

 private:
  struct Entry {
    std::string name;
    nvinfer1::PluginFieldType type;
    int32_t i = 0;
    float f = 0.f;
    std::string s;
  };
  const Entry& find(const char* name) const;
  std::vector<Entry> entries_;
  std::vector<nvinfer1::PluginField> view_;
  nvinfer1::PluginFieldCollection collection_{};
};

// Logs through the logger TensorRT handed to setLoggerFinder (stderr before that).
void log_error(const std::string& msg) noexcept;
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

}  // namespace turboquant::trt
