"""ONNX Runtime's own decode attention, as the baselines TQAttention is measured against."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..models import IR_VERSION

NP_OF = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def gqa_model(hq: int, hkv: int, d: int, dtype: int) -> onnx.ModelProto:
    """com.microsoft GroupQueryAttention, past and present as separate [B, Hkv, S, D] tensors."""
    vi = helper.make_tensor_value_info
    inputs = [vi("query", dtype, ["B", 1, hq * d]), vi("key", dtype, ["B", 1, hkv * d]), vi("value", dtype, ["B", 1, hkv * d]),
              vi("past_key", dtype, ["B", hkv, "P", d]), vi("past_value", dtype, ["B", hkv, "P", d]),
              vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, [])]
    outputs = [vi(n, dtype, None) for n in ("out", "present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv)
    return helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=IR_VERSION)


def gqa_feeds(rng, b: int, hq: int, hkv: int, d: int, s: int, dtype: int) -> dict:
    t = NP_OF[dtype]
    return {"query": rng.standard_normal((b, 1, hq * d)).astype(t), "key": rng.standard_normal((b, 1, hkv * d)).astype(t),
            "value": rng.standard_normal((b, 1, hkv * d)).astype(t),
            "past_key": rng.standard_normal((b, hkv, s, d)).astype(t), "past_value": rng.standard_normal((b, hkv, s, d)).astype(t),
            "seqlens_k": np.full((b,), s, np.int32), "total_sequence_length": np.array(s + 1, np.int32)}


def attention23_model(hq: int, hkv: int, d: int, dtype: int) -> onnx.ModelProto:
    """ONNX Attention (opset 23) with past_key/past_value."""
    vi = helper.make_tensor_value_info
    inputs = [vi("Q", dtype, ["B", hq, 1, d]), vi("K", dtype, ["B", hkv, 1, d]), vi("V", dtype, ["B", hkv, 1, d]),
              vi("past_key", dtype, ["B", hkv, "P", d]), vi("past_value", dtype, ["B", hkv, "P", d])]
    outputs = [vi(n, dtype, None) for n in ("Y", "present_key", "present_value")]
    node = helper.make_node("Attention", ["Q", "K", "V", "", "past_key", "past_value"], [o.name for o in outputs])
    return helper.make_model(helper.make_graph([node], "attention23", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 23)], ir_version=IR_VERSION)


def attention23_feeds(rng, b: int, hq: int, hkv: int, d: int, s: int, dtype: int) -> dict:
    t = NP_OF[dtype]
    return {"Q": rng.standard_normal((b, hq, 1, d)).astype(t), "K": rng.standard_normal((b, hkv, 1, d)).astype(t),
            "V": rng.standard_normal((b, hkv, 1, d)).astype(t),
            "past_key": rng.standard_normal((b, hkv, s, d)).astype(t), "past_value": rng.standard_normal((b, hkv, s, d)).astype(t)}
