// The TensorRT plugin library's only exported entry points (see exports.map): the creators that
// IPluginRegistry::loadLibrary, trtexec --dynamicPlugins/--staticPlugins and the ONNX parser find,
// and the logger hook.
#include "tq_attention_plugin.h"
#include "tq_gqa_plugin.h"
#include "tq_pack_plugins.h"

namespace {

turboquant::trt::Creator<turboquant::trt::PackPlugin> g_pack;
turboquant::trt::Creator<turboquant::trt::UnpackPlugin> g_unpack;
turboquant::trt::Creator<turboquant::trt::AttentionPlugin> g_attention;
turboquant::trt::Creator<turboquant::trt::GqaPlugin> g_gqa;

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept {
  turboquant::trt::set_logger_finder(finder);
}

__attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) noexcept {
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&g_pack, &g_unpack, &g_attention, &g_gqa};
  nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}

}  // extern "C"
