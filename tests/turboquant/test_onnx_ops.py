"""The turboquant domain in onnx: schemas (checker, shape inference) and ReferenceEvaluator ops."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx.reference import ReferenceEvaluator

from turboquant import node_models, onnx_ops
from turboquant.reference import attention, formats


def test_checker_and_shape_inference_accept_the_ops():
    m = node_models.attention_model(q_heads=8, kv_heads=2, head_dim=128, key_format="mse4", value_format="uint4")
    onnx.checker.check_model(m, full_check=True)
    # concrete shapes: present = past + new on axis 2, with the format's byte count
    for vi in m.graph.input:
        dims = vi.type.tensor_type.shape.dim
        for d in dims:
            if d.dim_param in ("B",):
                d.dim_value = 2
            elif d.dim_param == "Sq" or d.dim_param == "Sn":
                d.dim_value = 1
            elif d.dim_param == "Sp":
                d.dim_value = 7
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    shapes = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim] for o in inferred.graph.output}
    assert shapes["Y"] == [2, 8, 1, 128]
    assert shapes["present_key"] == [2, 2, 8, 66]
    assert shapes["present_value"] == [2, 2, 8, 68]


def test_pack_unpack_shape_inference():
    m = node_models.pack_model("mse3", 96, TensorProto.FLOAT16, rank=3)
    onnx.checker.check_model(m, full_check=True)
    m = node_models.unpack_model("uint4", 64, TensorProto.BFLOAT16)
    onnx.checker.check_model(m, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    assert inferred.graph.output[0].type.tensor_type.elem_type == TensorProto.BFLOAT16


def test_reference_evaluator_runs_attention(rng):
    m = node_models.attention_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse3", value_format="uint3", is_causal=1)
    feeds = {
        "Q": rng.standard_normal((1, 4, 2, 64)).astype(np.float32),
        "K": rng.standard_normal((1, 2, 2, 64)).astype(np.float32),
        "V": rng.standard_normal((1, 2, 2, 64)).astype(np.float32),
        "past_key": formats.pack(rng.standard_normal((1, 2, 5, 64)).astype(np.float32), "mse3"),
        "past_value": formats.pack(rng.standard_normal((1, 2, 5, 64)).astype(np.float32), "uint3"),
    }
    got = ReferenceEvaluator(m, new_ops=onnx_ops.REFERENCE_OPS).run(None, feeds)
    want = attention(*(feeds[k] for k in ("Q", "K", "V")), None, feeds["past_key"], feeds["past_value"],
                     key_format="mse3", value_format="uint3", is_causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_reference_evaluator_pack_unpack(dtype, rng):
    np_dtype = np.float32 if dtype == TensorProto.FLOAT else np.float16
    x = rng.standard_normal((2, 3, 4, 64)).astype(np_dtype)
    off = rng.standard_normal((3, 64)).astype(np.float32)
    packed = ReferenceEvaluator(node_models.pack_model("mse4", 64, dtype, offset_shape=[3, 64]), new_ops=onnx_ops.REFERENCE_OPS).run(
        None, {"x": x, "offset": off})[0]
    np.testing.assert_array_equal(packed, formats.pack(x, "mse4", True, off[:, None, :]))
    back = ReferenceEvaluator(node_models.unpack_model("mse4", 64, dtype, offset_shape=[3, 64]), new_ops=onnx_ops.REFERENCE_OPS).run(
        None, {"packed": packed, "offset": off})[0]
    assert back.dtype == np_dtype
    np.testing.assert_allclose(back.astype(np.float32), x.astype(np.float32), atol=0.5)


@pytest.mark.parametrize("window, softcap, sink", [(-1, 0.0, False), (4, 5.0, True)])
def test_group_query_attention_schema_and_reference_evaluator(rng, ort_session, window, softcap, sink):
    """TQGroupQueryAttention passes the checker and shape inference, and ReferenceEvaluator runs it
    (packed QKV, rotary, per-sequence lengths; a window, softcap and head sinks) with the results of
    the ORT kernel."""
    m = node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4", packed_qkv=True,
                              rotary_dim=64, local_window_size=window, softcap=softcap, head_sink=sink)
    onnx.checker.check_model(m, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(m)
    y = inferred.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_value or d.dim_param for d in y] == ["B", "S", 256]
    width = formats.packed_size("uint4", 64)
    angles = rng.uniform(0, 6, (32, 32))
    feeds = {
        "query": rng.standard_normal((2, 1, 8 * 64)).astype(np.float32),
        "past_key": np.zeros((2, 2, 16, width), np.uint8),
        "past_value": np.zeros((2, 2, 16, width), np.uint8),
        "seqlens_k": np.array([4, 9], np.int32),
        "total_sequence_length": np.array(10, np.int32),
        "cos_cache": np.cos(angles).astype(np.float32),
        "sin_cache": np.sin(angles).astype(np.float32),
    }
    if sink:
        feeds["head_sink"] = rng.standard_normal(4).astype(np.float32)
    keys, values = (rng.standard_normal((2, 2, 16, 64)).astype(np.float32) for _ in range(2))
    feeds["past_key"][..., :formats.packed_size("mse4", 64)] = formats.pack(keys, "mse4")
    feeds["past_value"][...] = formats.pack(values, "uint4")
    got = ReferenceEvaluator(m, new_ops=onnx_ops.REFERENCE_OPS).run(None, feeds)
    want = ort_session(m).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-4)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)


def test_window_sized_cache_in_the_reference_evaluator(rng, ort_session):
    """sliding_window_cache = 1: shape inference gives present past's row count (a window-sized
    buffer's C, not the total), and ReferenceEvaluator runs it, past the buffer's 16 rows, with the
    results of the ORT kernel."""
    m = node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                              local_window_size=6, sliding_window_cache=1)
    for i in (3, 4):
        m.graph.input[i].type.tensor_type.shape.dim[2].dim_param = "past_sliding_length"
    del m.graph.output[1:]
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    present = next(v for v in inferred.graph.value_info if v.name == "present_key")
    assert present.type.tensor_type.shape.dim[2].dim_param == "past_sliding_length"
    m = node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                              local_window_size=6, sliding_window_cache=1)
    width = formats.packed_size("uint4", 64)
    feeds = {"query": rng.standard_normal((2, 1, 4 * 64)).astype(np.float32),
             "key": rng.standard_normal((2, 1, 2 * 64)).astype(np.float32),
             "value": rng.standard_normal((2, 1, 2 * 64)).astype(np.float32),
             "past_key": np.zeros((2, 2, 16, width), np.uint8), "past_value": np.zeros((2, 2, 16, width), np.uint8),
             "seqlens_k": np.array([16, 20], np.int32), "total_sequence_length": np.array(21, np.int32)}
    keys, values = (rng.standard_normal((2, 2, 16, 64)).astype(np.float32) for _ in range(2))
    feeds["past_key"][..., :formats.packed_size("mse4", 64)] = formats.pack(keys, "mse4")
    feeds["past_value"][...] = formats.pack(values, "uint4")
    got = ReferenceEvaluator(m, new_ops=onnx_ops.REFERENCE_OPS).run(None, feeds)
    want = ort_session(m).run(None, feeds)
    assert want[1].shape[2] == 16
    np.testing.assert_allclose(got[0], want[0], rtol=2e-4, atol=2e-4)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)


def test_reference_evaluator_runs_paged_attention(rng):
    """The ReferenceEvaluator op is the numpy reference; shape inference gives the pools' shapes back."""
    from turboquant.reference import paged_attention, pool_rows

    m = node_models.paged_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                                rotary_dim=64)
    onnx.checker.check_model(m, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    shapes = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim] for o in inferred.graph.output}
    assert shapes == {"output": ["T", 256], "key_cache_out": ["num_blocks", "block_size", 2, 36],
                      "value_cache_out": ["num_blocks", "block_size", 2, 36]}
    pool = rng.integers(0, 256, (6, 4, 2, 36), dtype=np.uint8)
    pool_rows(pool, 2, 34)[:] = formats.pack(rng.standard_normal((6, 2, 4, 64)).astype(np.float32), "mse4")
    angles = rng.uniform(0, 6.3, (16, 32))
    feeds = {"query": rng.standard_normal((3, 256)).astype(np.float32),
             "key": rng.standard_normal((3, 128)).astype(np.float32),
             "value": rng.standard_normal((3, 128)).astype(np.float32),
             "key_cache": pool, "value_cache": pool.copy(),
             "cumulative_sequence_length": np.array([0, 2, 3], np.int32), "past_seqlens": np.array([5, 0], np.int32),
             "block_table": np.array([[4, 1], [0, -1]], np.int32),
             "cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    got = ReferenceEvaluator(m, new_ops=onnx_ops.REFERENCE_OPS).run(None, feeds)
    want = paged_attention(*(feeds[k] for k in ("query", "key", "value", "key_cache", "value_cache",
                                                 "cumulative_sequence_length", "past_seqlens", "block_table",
                                                 "cos_cache", "sin_cache")),
                           key_format="mse4", value_format="uint4", num_heads=4, kv_num_heads=2, do_rotary=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    changed = got[1] != pool
    assert pool_rows(changed, 2, 34).any(axis=(1, 3)).sum() == 3  # the three new tokens' slots
    assert changed.sum() == pool_rows(changed, 2, 34).sum()  # and nothing else
