"""ONNX Runtime's own decode attention, as the baselines TQAttention is measured against."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from ..node_models import IR_VERSION

NP_OF = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


# ORT's own quantized caches for GroupQueryAttention (kv_cache_bit_width, k_quant_type, v_quant_type,
# k_scale/v_scale): name -> (cache element type, bit width, stored bytes per head_size elements / d)
QUANT_CACHES = {"int8": (TensorProto.INT8, 8, 1.0), "int4": (TensorProto.UINT8, 4, 0.5),
                "fp8": (TensorProto.FLOAT8E4M3FN, 8, 1.0)}


def cache_bytes_per_row(d: int, dtype: int, cache: str | None) -> int:
    """Bytes of one cached [head_size] vector: the float type's, or a quantized cache's."""
    if cache is None:
        return d * (4 if dtype == TensorProto.FLOAT else 2)
    return int(d * QUANT_CACHES[cache][2])


def gqa_model(hq: int, hkv: int, d: int, dtype: int, cache: str | None = None, rotary: bool = False) -> onnx.ModelProto:
    """com.microsoft GroupQueryAttention, past and present as separate [B, Hkv, S, D] tensors of the
    query's type, or (cache = int8, int4, fp8) of ORT's quantized cache with per-tensor scales;
    rotary: do_rotary=1 with cos_cache/sin_cache inputs [M, D/2] (fp16 cache only)."""
    vi = helper.make_tensor_value_info
    cache_type, attrs, dc = dtype, {}, d
    if cache is not None:
        cache_type, bits, per = QUANT_CACHES[cache]
        dc = int(d * per)
        attrs = {"kv_cache_bit_width": bits, "k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
    inputs = [vi("query", dtype, ["B", 1, hq * d]), vi("key", dtype, ["B", 1, hkv * d]), vi("value", dtype, ["B", 1, hkv * d]),
              vi("past_key", cache_type, ["B", hkv, "P", dc]), vi("past_value", cache_type, ["B", hkv, "P", dc]),
              vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, [])]
    if rotary:
        attrs = {"do_rotary": 1}
        inputs += [vi("cos_cache", dtype, ["M", d // 2]), vi("sin_cache", dtype, ["M", d // 2])]
    names = [i.name for i in inputs]
    if cache is not None:  # inputs 7-11 (cos/sin caches, position ids, attention bias, head sink) absent
        inputs += [vi("k_scale", TensorProto.FLOAT, [1]), vi("v_scale", TensorProto.FLOAT, [1])]
        names += [""] * 5 + ["k_scale", "v_scale"]
    outputs = [vi("out", dtype, None), vi("present_key", cache_type, None), vi("present_value", cache_type, None)]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv, **attrs)
    return helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=IR_VERSION)


def rotary_tables(positions: int, d: int, dtype: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin caches [positions, d / 2] (base 10000), as a model's rotary embedding has them."""
    angle = np.arange(positions)[:, None] * 10000.0 ** (-np.arange(d // 2) / (d // 2))
    return np.cos(angle).astype(NP_OF[dtype]), np.sin(angle).astype(NP_OF[dtype])


def gqa_feeds(rng, b: int, hq: int, hkv: int, d: int, s: int, dtype: int, cache: str | None = None,
              rotary: bool = False) -> dict:
    t = NP_OF[dtype]
    feeds = {"query": rng.standard_normal((b, 1, hq * d)).astype(t), "key": rng.standard_normal((b, 1, hkv * d)).astype(t),
             "value": rng.standard_normal((b, 1, hkv * d)).astype(t),
             "seqlens_k": np.full((b,), s, np.int32), "total_sequence_length": np.array(s + 1, np.int32)}
    if rotary:
        feeds["cos_cache"], feeds["sin_cache"] = rotary_tables(s + 1, d, dtype)
    if cache is None:
        feeds["past_key"] = rng.standard_normal((b, hkv, s, d)).astype(t)
        feeds["past_value"] = rng.standard_normal((b, hkv, s, d)).astype(t)
        return feeds
    dc = int(d * QUANT_CACHES[cache][2])
    for name in ("past_key", "past_value"):
        raw = rng.integers(0, 256, (b, hkv, s, dc), dtype=np.uint8)
        if cache == "fp8":
            raw &= 0x77  # finite e4m3 values of magnitude < 2
            feeds[name] = raw.view(ml_dtypes.float8_e4m3fn)
        else:
            feeds[name] = raw.view(np.int8) if cache == "int8" else raw
    feeds["k_scale"] = np.array([0.02], np.float32)
    feeds["v_scale"] = np.array([0.02], np.float32)
    return feeds


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
