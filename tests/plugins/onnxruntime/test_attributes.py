"""Every op reads each attribute with the type docs/ops.md declares: an attribute of another type
(scale=1 as an INT, is_causal=1.0 as a FLOAT) is refused when the session is created, with a message
naming the op, the attribute, the declared and the given type, instead of running with the default."""

import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from turboquant import node_models

ATTENTION = dict(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4")
GQA = dict(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4")


def model_for(op):
    if op == "TQAttention":
        return node_models.attention_model(**ATTENTION)
    if op == "TQGroupQueryAttention":
        return node_models.gqa_model(**GQA)
    if op == "TQPagedAttention":
        return node_models.paged_model(**GQA)
    if op == "TQPack":
        return node_models.pack_model("uint4", 64)
    return node_models.unpack_model("uint4", 64)


def with_attribute(model, name, value):
    node = model.graph.node[0]
    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    node.attribute.append(helper.make_attribute(name, value))
    return model


@pytest.mark.parametrize("op, name, value, declared, given", [
    ("TQAttention", "scale", 1, "FLOAT", "INT"),
    ("TQAttention", "is_causal", 1.0, "INT", "FLOAT"),
    ("TQAttention", "key_format", 4, "STRING", "INT"),
    ("TQAttention", "head_dim", [64], "INT", "INTS"),
    ("TQGroupQueryAttention", "do_rotary", 1.0, "INT", "FLOAT"),
    ("TQGroupQueryAttention", "softcap", 30, "FLOAT", "INT"),
    ("TQGroupQueryAttention", "local_window_size", 2.0, "INT", "FLOAT"),
    ("TQGroupQueryAttention", "num_heads", "4", "INT", "STRING"),
    ("TQGroupQueryAttention", "scale", [0.5], "FLOAT", "FLOATS"),
    ("TQPagedAttention", "softcap", 30, "FLOAT", "INT"),
    ("TQPagedAttention", "value_format", 4, "STRING", "INT"),
    ("TQPack", "format", 4, "STRING", "INT"),
    ("TQPack", "norm_correction", 0.0, "INT", "FLOAT"),
    ("TQPack", "head_dim", 64.0, "INT", "FLOAT"),
    ("TQUnpack", "format", 4.0, "STRING", "FLOAT"),
    ("TQUnpack", "dtype", 10.0, "INT", "FLOAT"),  # read by shape inference too
])
def test_a_wrongly_typed_attribute_is_refused(ort_session, op, name, value, declared, given):
    with pytest.raises(Exception) as e:
        ort_session(with_attribute(model_for(op), name, value))
    message = str(e.value)
    assert f"{op}: attribute '{name}' has type {given}; expected {declared}" in message, message


@pytest.mark.parametrize("op, name, value", [
    ("TQAttention", "scale", 0.125), ("TQAttention", "is_causal", 1), ("TQGroupQueryAttention", "do_rotary", 0),
    ("TQPagedAttention", "local_window_size", 8),
    ("TQPack", "format", "mse3"), ("TQUnpack", "dtype", TensorProto.FLOAT),
])
def test_attributes_of_the_declared_type_are_accepted(ort_session, op, name, value):
    assert isinstance(ort_session(with_attribute(model_for(op), name, value)), ort.InferenceSession)


@pytest.mark.parametrize("name, value", [("softcap", 30.0), ("qk_matmul_output_mode", 1)])
def test_onnx_attention_attributes_tqattention_does_not_take_are_refused(ort_session, name, value):
    """Attributes of ONNX's Attention that TQAttention does not implement: refused, not run without."""
    with pytest.raises(Exception) as e:
        ort_session(with_attribute(model_for("TQAttention"), name, value))
    assert f"TQAttention: attribute '{name}' is not supported" in str(e.value)


def test_head_counts_whose_sums_would_overflow_are_refused(ort_session):
    heads = (2**64 + 2) // 3  # num_heads + 2 * kv_num_heads wraps to 2 in 64 bits
    model = with_attribute(with_attribute(model_for("TQGroupQueryAttention"), "num_heads", heads), "kv_num_heads", heads)
    with pytest.raises(Exception) as e:
        ort_session(model)
    assert "must be positive, num_heads a multiple of kv_num_heads and at most 65536" in str(e.value)
