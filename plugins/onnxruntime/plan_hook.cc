// C functions beside RegisterCustomOps, for tests and diagnostics (turboquant/kernel_plan.py calls
// them through ctypes): the CUDA planners for given shapes and device properties (host code, in every
// build), the kernels the process's latest CUDA attention calls ran, and the CPU kernels' instruction set.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_dispatch.h"
#include "turboquant/cpu_kernels.h"
#include "turboquant/split_plan.h"

namespace {

bool parse_dtype(const char* s, turboquant::DType* dt) {
  if (std::strcmp(s, "float32") == 0) return *dt = turboquant::DType::kFloat32, true;
  if (std::strcmp(s, "float16") == 0) return *dt = turboquant::DType::kFloat16, true;
  if (std::strcmp(s, "bfloat16") == 0) return *dt = turboquant::DType::kBFloat16, true;
  return false;
}

bool parse_mask(const char* s, turboquant::MaskType* m) {
  using turboquant::MaskType;
  if (s == nullptr || std::strcmp(s, "none") == 0) return *m = MaskType::kNone, true;
  if (std::strcmp(s, "bool") == 0) return *m = MaskType::kBool, true;
  if (std::strcmp(s, "float32") == 0) return *m = MaskType::kFloat32, true;
  if (std::strcmp(s, "float16") == 0) return *m = MaskType::kFloat16, true;
  if (std::strcmp(s, "bfloat16") == 0) return *m = MaskType::kBFloat16, true;
  return false;
}

// The planners look at whether a call has a softcap and a sink, not at their values.
constexpr uint16_t kSinkStandIn = 0;
void set_features(turboquant::AttentionParams* p, const int64_t* f) {
  p->window = f[0];
  p->softcap = f[1] != 0 ? 1.0f : 0.0f;
  p->head_sink = f[2] != 0 ? &kSinkStandIn : nullptr;
}

}  // namespace

// shape: batch, q_heads, kv_heads, q_len, new_len, past_len, head_dim, v_head_dim, is_causal,
// key_row_bytes, value_row_bytes (0: the formats' sizes), caches 16-byte aligned (0/1), rows of the
// preallocated buffers (0: dense caches), local_window_size (0: none), softcap > 0 (0/1), head_sink (0/1);
// device: sms, smem_optin, cc_major, cc_minor, sm90a (0/1); out: splits, split_len, rows_per_block, row_blocks,
// warps, smem, workspace, new_part (0/1), new_part_offset. Returns the kernel's name, or nullptr for a name it does not know
// (format, dtype, mask) or shapes out of range.
extern "C" __attribute__((visibility("default"))) const char* turboquant_split_plan(
    const char* key_format, const char* value_format, const char* dtype, const char* mask, const int64_t* shape,
    const int64_t* device, int64_t* out) {
  using namespace turboquant;
  AttentionParams p;
  p.key_format = parse_format(key_format);
  p.value_format = parse_format(value_format);
  if (p.key_format == Format::kInvalid || p.value_format == Format::kInvalid) return nullptr;
  if (!parse_dtype(dtype, &p.dtype) || !parse_mask(mask, &p.mask_type)) return nullptr;
  for (int i = 0; i < 16; ++i) {
    if (shape[i] < 0) return nullptr;
  }
  p.batch = shape[0], p.q_heads = shape[1], p.kv_heads = shape[2], p.q_len = shape[3], p.new_len = shape[4];
  p.past_len = shape[5];
  if (p.kv_heads == 0 || p.q_heads % p.kv_heads != 0) return nullptr;
  if (!head_dim_supported(shape[6]) || !head_dim_supported(shape[7])) return nullptr;
  p.head_dim = static_cast<int>(shape[6]), p.v_head_dim = static_cast<int>(shape[7]);
  p.is_causal = shape[8] != 0;
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));  // the ops' default
  p.key_row_bytes = shape[9], p.value_row_bytes = shape[10];
  p.past_rows = p.present_rows = shape[12];
  set_features(&p, shape + 13);
  cuda::DeviceProps dev;
  dev.sms = static_cast<int>(device[0]), dev.smem_optin = static_cast<int>(device[1]);
  dev.cc_major = static_cast<int>(device[2]), dev.cc_minor = static_cast<int>(device[3]);
  dev.sm90a = device[4] != 0;
  const cuda::SplitPlan plan = cuda::plan_split(p, shape[11] != 0, dev);
  out[0] = plan.layout.splits, out[1] = plan.layout.split_len, out[2] = plan.layout.rows_per_block;
  out[3] = plan.layout.row_blocks, out[4] = plan.warps, out[5] = plan.smem, out[6] = static_cast<int64_t>(plan.workspace);
  out[7] = plan.new_part ? 1 : 0, out[8] = static_cast<int64_t>(plan.new_part_offset);
  return cuda::split_kernel_name(plan.kernel);
}

// "tc_bulk", "tc_mma", "cuda_core", "tc_chunk", "tc_chunk_wgmma", or "none" (no CUDA attention call yet, the latest had no past or
// no queries, or this build has no CUDA kernels).
extern "C" __attribute__((visibility("default"))) const char* turboquant_last_split_kernel() {
  return turboquant::ort::cuda_last_split_kernel();
}

// shape: q_len, new_len, head_dim, v_head_dim, local_window_size (0: none), softcap > 0 (0/1), head_sink (0/1),
// past_len; device: sms, smem_optin, cc_major, cc_minor, sm90a (0/1).
// The kernel that attends the new tokens on tensor cores ("none", "mma", "wgmma"), or nullptr for a
// dtype or mask it does not know.
extern "C" __attribute__((visibility("default"))) const char* turboquant_prefill_plan(const char* dtype,
                                                                                       const char* mask,
                                                                                       const int64_t* shape,
                                                                                       const int64_t* device) {
  using namespace turboquant;
  AttentionParams p;
  if (!parse_dtype(dtype, &p.dtype) || !parse_mask(mask, &p.mask_type)) return nullptr;
  p.q_len = shape[0], p.new_len = shape[1];
  p.head_dim = static_cast<int>(shape[2]), p.v_head_dim = static_cast<int>(shape[3]);
  set_features(&p, shape + 4);
  p.past_len = shape[7];
  cuda::DeviceProps dev;
  dev.sms = static_cast<int>(device[0]), dev.smem_optin = static_cast<int>(device[1]);
  dev.cc_major = static_cast<int>(device[2]), dev.cc_minor = static_cast<int>(device[3]);
  dev.sm90a = device[4] != 0;
  return cuda::prefill_kernel_name(cuda::plan_prefill(p, dev));
}

// "mma", "wgmma", or "none" (no such call yet, or this build has no CUDA kernels).
extern "C" __attribute__((visibility("default"))) const char* turboquant_last_prefill_kernel() {
  return turboquant::ort::cuda_last_prefill_kernel();
}

// 1 where the library holds sm_90a kernels.
extern "C" __attribute__((visibility("default"))) int turboquant_sm90a_compiled() {
  return turboquant::ort::cuda_sm90a_compiled() ? 1 : 0;
}

// "x86-64-v3", "x86-64" or "generic": the copy of the CPU kernels chosen at load (ops/cpu/dispatch.cpp).
extern "C" __attribute__((visibility("default"))) const char* turboquant_cpu_instruction_set() {
  return turboquant::cpu::instruction_set();
}
