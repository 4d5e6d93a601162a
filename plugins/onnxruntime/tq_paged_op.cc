#include "tq_paged_op.h"

#include "cuda_dispatch.h"
#include "turboquant/gqa_setup.h"  // check_key_scale

namespace turboquant::ort {
namespace {

constexpr const char* kOp = "TQPagedAttention";

void check_type(const Ort::ConstValue& x, const char* name, ONNXTensorElementDataType want) {
  check_input_type(kOp, x, name, want);
}

}  // namespace

PagedKernel::PagedKernel(const OrtKernelInfo* info, ONNXTensorElementDataType t, Device dev) : type(t), device(dev) {
  read_grouped_attrs(kOp, info, attrs);
  attrs.validate();
}

OrtStatusPtr PagedKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    Ort::ConstValue in[14];
    for (size_t i = 0; i < 14; ++i) in[i] = ctx.GetInput(i);
    const auto& [query, key, value, kc, vc, cu, past, table, cos, sin, sink, koff, voff, kscale] = in;
    check_type(kc, "key_cache", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(vc, "value_cache", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(cu, "cumulative_sequence_length", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    check_type(past, "past_seqlens", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    check_type(table, "block_table", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    check_type(koff, "key_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(voff, "value_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(kscale, "key_scale", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(sink, "head_sink", type);
    const PagedShapes shapes{*shape_of(query), shape_of(key), shape_of(value), *shape_of(kc), *shape_of(vc),
                             *shape_of(cu), *shape_of(past), *shape_of(table), shape_of(cos), shape_of(sin),
                             shape_of(sink), shape_of(koff), shape_of(voff), shape_of(kscale)};
    PagedSetup setup = setup_paged(attrs, shapes, to_dtype(type));
    const int32_t* cumulative = cu.GetTensorData<int32_t>();
    const int32_t* past_seqlens = past.GetTensorData<int32_t>();
    AttentionParams& p = setup.params;
    p.blocks.table = table.GetTensorData<int32_t>();
    // (on CUDA the table is in device memory: the lengths are checked, its kernels keep to the pool)
    check_paged_tables(setup, cumulative, past_seqlens, device == Device::kCuda ? nullptr : p.blocks.table);
    p.key_offset = koff ? koff.GetTensorData<float>() : nullptr;
    p.value_offset = voff ? voff.GetTensorData<float>() : nullptr;
    p.head_sink = sink ? sink.GetTensorRawData() : nullptr;
    RotaryParams& rot = setup.rotary;
    if (rot.rotary_dim > 0) {
      rot.cos = cos.GetTensorRawData();
      rot.sin = sin.GetTensorRawData();
      rot.key_scale = kscale ? kscale.GetTensorData<float>() : nullptr;
      if (rot.key_scale && device == Device::kCpu) {
        check_key_scale(rot.key_scale, static_cast<int64_t>(kscale.GetTensorTypeAndShapeInfo().GetElementCount()), kOp);
      }
    }
    const size_t es = static_cast<size_t>(dtype_size(p.dtype));
    const auto* qbase = static_cast<const uint8_t*>(query.GetTensorRawData());
    const void* k = setup.packed_qkv ? qbase + setup.k_first * es : key.GetTensorRawData();
    const void* v = setup.packed_qkv ? qbase + setup.v_first * es : value.GetTensorRawData();
    auto y = ctx.GetOutput(0, setup.y);
    auto key_pool = ctx.GetOutput(1, shapes.key_cache);
    auto value_pool = ctx.GetOutput(2, shapes.value_cache);
    if (device == Device::kCuda) {
      cuda_paged(context, p, rot, cumulative, past_seqlens, qbase, k, v, kc.GetTensorData<uint8_t>(),
                 vc.GetTensorData<uint8_t>(), y.GetTensorMutableRawData(), key_pool.GetTensorMutableData<uint8_t>(),
                 value_pool.GetTensorMutableData<uint8_t>());
      return;
    }
    cpu::paged_attention(p, rot, cumulative, past_seqlens, qbase, k, v, kc.GetTensorData<uint8_t>(),
                         vc.GetTensorData<uint8_t>(), y.GetTensorMutableRawData(),
                         key_pool.GetTensorMutableData<uint8_t>(), value_pool.GetTensorMutableData<uint8_t>(),
                         ort_parallel_for(context));
  });
}

}  // namespace turboquant::ort
