"""Small ONNX models made of one turboquant node: for tests, benchmarks and users' experiments."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from . import DOMAIN, OPSET_VERSION

# onnxruntime 1.31 refuses IR versions above 13; 10 is what opset 21-23 models commonly carry.
IR_VERSION = 10
DEFAULT_OPSET = 21


def node_model(
    op_type: str,
    inputs: Sequence[tuple[str, int, Sequence] | None],
    outputs: Sequence[tuple[str, int, Sequence]],
    opset: int = DEFAULT_OPSET,
    **attributes,
) -> onnx.ModelProto:
    """A model with one `turboquant` node. inputs/outputs: (name, TensorProto type, shape); None
    leaves an optional input out (an empty name in the node). Shapes may hold symbolic names; a
    shape of None accepts any rank (for tests of the ops' own validation)."""
    node = helper.make_node(
        op_type, [i[0] if i else "" for i in inputs], [o[0] for o in outputs], domain=DOMAIN, **attributes
    )
    graph = helper.make_graph(
        [node],
        f"{op_type.lower()}_graph",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in (i for i in inputs if i)],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
        ir_version=IR_VERSION,
        producer_name="turboquant",
    )


def attention_model(
    *, q_heads: int, kv_heads: int, head_dim: int, key_format: str, value_format: str,
    dtype: int = TensorProto.FLOAT, layout: str = "bhsd", mask: int | None = None, past: bool = True,
    offsets: bool = False, v_head_dim: int | None = None, **attributes,
) -> onnx.ModelProto:
    """One TQAttention node with symbolic batch and sequence sizes.

    layout "bhsd" takes 4-D Q/K/V, "bsd" 3-D ones (q_num_heads/kv_num_heads attributes set).
    mask: None, or the TensorProto type of a 4-D attn_mask input [B or 1, Hq or 1, Sq, S_total].
    """
    from .config import packed_size

    dv = v_head_dim or head_dim
    kb, vb = packed_size(key_format, head_dim), packed_size(value_format, dv)
    if layout == "bhsd":
        q_shape, k_shape, v_shape = ["B", q_heads, "Sq", head_dim], ["B", kv_heads, "Sn", head_dim], ["B", kv_heads, "Sn", dv]
        y_shape = ["B", q_heads, "Sq", dv]
    elif layout == "bsd":
        q_shape, k_shape, v_shape = ["B", "Sq", q_heads * head_dim], ["B", "Sn", kv_heads * head_dim], ["B", "Sn", kv_heads * dv]
        y_shape = ["B", "Sq", q_heads * dv]
        attributes.setdefault("q_num_heads", q_heads)
        attributes.setdefault("kv_num_heads", kv_heads)
    else:
        raise ValueError(f"layout must be 'bhsd' or 'bsd', got {layout!r}")
    inputs = [
        ("Q", dtype, q_shape), ("K", dtype, k_shape), ("V", dtype, v_shape),
        ("attn_mask", mask, ["MB", "MH", "Sq", "St"]) if mask is not None else None,
        ("past_key", TensorProto.UINT8, ["B", kv_heads, "Sp", kb]) if past else None,
        ("past_value", TensorProto.UINT8, ["B", kv_heads, "Sp", vb]) if past else None,
    ]
    if offsets:
        inputs += [("key_offset", TensorProto.FLOAT, [kv_heads, head_dim]), ("value_offset", TensorProto.FLOAT, [kv_heads, dv])]
    while inputs and inputs[-1] is None:
        inputs.pop()
    outputs = [("Y", dtype, y_shape), ("present_key", TensorProto.UINT8, ["B", kv_heads, "St", kb]),
               ("present_value", TensorProto.UINT8, ["B", kv_heads, "St", vb])]
    return node_model("TQAttention", inputs, outputs, key_format=key_format, value_format=value_format, **attributes)


def pack_model(fmt: str, head_dim: int, dtype: int = TensorProto.FLOAT, rank: int = 4, offset_shape=None, **attributes) -> onnx.ModelProto:
    from .config import packed_size

    lead = [f"d{i}" for i in range(rank - 1)]
    inputs = [("x", dtype, [*lead, head_dim])]
    if offset_shape is not None:
        inputs.append(("offset", TensorProto.FLOAT, list(offset_shape)))
    return node_model("TQPack", inputs, [("packed", TensorProto.UINT8, [*lead, packed_size(fmt, head_dim)])],
                      format=fmt, head_dim=head_dim, **attributes)


def unpack_model(fmt: str, head_dim: int, dtype: int = TensorProto.FLOAT, rank: int = 4, offset_shape=None, **attributes) -> onnx.ModelProto:
    from .config import packed_size

    lead = [f"d{i}" for i in range(rank - 1)]
    inputs = [("packed", TensorProto.UINT8, [*lead, packed_size(fmt, head_dim)])]
    if offset_shape is not None:
        inputs.append(("offset", TensorProto.FLOAT, list(offset_shape)))
    return node_model("TQUnpack", inputs, [("x", dtype, [*lead, head_dim])], format=fmt, head_dim=head_dim, dtype=dtype, **attributes)


def gqa_model(
    *, q_heads: int, kv_heads: int, head_dim: int, key_format: str, value_format: str, row_bytes: int | None = None,
    pool_heads: int | None = None, dtype: int = TensorProto.FLOAT, packed_qkv: bool = False, rotary_dim: int = 0, position_ids: bool = False,
    offsets: bool = False, key_scale: bool = False, local_window_size: int = -1, softcap: float = 0.0,
    head_sink: bool = False, **attributes,
) -> onnx.ModelProto:
    """One TQGroupQueryAttention node (GroupQueryAttention's input order) with symbolic sizes.

    row_bytes: the caches' last dimension W (default: the larger packed size of the two formats, as
    a genai model's common width). rotary_dim > 0 adds cos_cache/sin_cache inputs and do_rotary=1.
    key_scale adds that input (after the offsets, or empty names in their place).
    local_window_size (-1: none) and softcap (0: none) become attributes when set; head_sink adds
    that input ([q_heads] of dtype, input 11).
    """
    from .config import packed_size

    width = row_bytes or max(packed_size(key_format, head_dim), packed_size(value_format, head_dim))
    hidden = (q_heads + 2 * kv_heads) * head_dim if packed_qkv else q_heads * head_dim
    kv = None if packed_qkv else kv_heads * head_dim
    inputs = [
        ("query", dtype, ["B", "S", hidden]),
        None if packed_qkv else ("key", dtype, ["B", "S", kv]),
        None if packed_qkv else ("value", dtype, ["B", "S", kv]),
        ("past_key", TensorProto.UINT8, ["B", kv_heads, "P", width]),
        ("past_value", TensorProto.UINT8, ["B", kv_heads, "P", width]),
        ("seqlens_k", TensorProto.INT32, ["B"]),
        ("total_sequence_length", TensorProto.INT32, []),
        ("cos_cache", dtype, ["M", rotary_dim // 2]) if rotary_dim else None,
        ("sin_cache", dtype, ["M", rotary_dim // 2]) if rotary_dim else None,
        ("position_ids", TensorProto.INT64, ["B", "S"]) if position_ids else None,
        None,
        ("head_sink", dtype, [q_heads]) if head_sink else None,
    ]
    if offsets:
        inputs += [("key_offset", TensorProto.FLOAT, [kv_heads, head_dim]),
                   ("value_offset", TensorProto.FLOAT, [kv_heads, head_dim])]
    if key_scale:
        inputs += ([] if offsets else [None, None]) + [("key_scale", TensorProto.FLOAT, [kv_heads, head_dim])]
    while inputs and inputs[-1] is None:
        inputs.pop()
    if rotary_dim:
        attributes.setdefault("do_rotary", 1)
    if local_window_size != -1:
        attributes["local_window_size"] = local_window_size
    if softcap:
        attributes["softcap"] = float(softcap)
    outputs = [("output", dtype, ["B", "S", q_heads * head_dim]),
               ("present_key", TensorProto.UINT8, ["B", kv_heads, "T", width]),
               ("present_value", TensorProto.UINT8, ["B", kv_heads, "T", width])]
    return node_model("TQGroupQueryAttention", inputs, outputs, key_format=key_format, value_format=value_format,
                      num_heads=q_heads, kv_num_heads=kv_heads, **attributes)


def paged_model(
    *, q_heads: int, kv_heads: int, head_dim: int, key_format: str, value_format: str, row_bytes: int | None = None,
    pool_heads: int | None = None, dtype: int = TensorProto.FLOAT, packed_qkv: bool = False, rotary_dim: int = 0, offsets: bool = False,
    key_scale: bool = False, local_window_size: int = -1, softcap: float = 0.0, head_sink: bool = False,
    **attributes,
) -> onnx.ModelProto:
    """One TQPagedAttention node (PagedAttention's input order, then turboquant's) with symbolic sizes.

    row_bytes: the pools' last dimension W (default: the larger packed size of the two formats);
    pool_heads: their third (default kv_heads).
    rotary_dim > 0 adds cos_cache/sin_cache and do_rotary=1; head_sink, the offsets and key_scale add
    those inputs (10 to 13); local_window_size (-1: none) and softcap (0: none) become attributes when set.
    """
    from .config import packed_size

    width = row_bytes or max(packed_size(key_format, head_dim), packed_size(value_format, head_dim))
    hidden = (q_heads + 2 * kv_heads) * head_dim if packed_qkv else q_heads * head_dim
    kv = None if packed_qkv else kv_heads * head_dim
    pool = ["num_blocks", "block_size", pool_heads or kv_heads, width]
    inputs = [
        ("query", dtype, ["T", hidden]),
        None if packed_qkv else ("key", dtype, ["T", kv]),
        None if packed_qkv else ("value", dtype, ["T", kv]),
        ("key_cache", TensorProto.UINT8, pool),
        ("value_cache", TensorProto.UINT8, pool),
        ("cumulative_sequence_length", TensorProto.INT32, ["B1"]),
        ("past_seqlens", TensorProto.INT32, ["B"]),
        ("block_table", TensorProto.INT32, ["B", "max_blocks"]),
        ("cos_cache", dtype, ["M", rotary_dim // 2]) if rotary_dim else None,
        ("sin_cache", dtype, ["M", rotary_dim // 2]) if rotary_dim else None,
        ("head_sink", dtype, [q_heads]) if head_sink else None,
        ("key_offset", TensorProto.FLOAT, [kv_heads, head_dim]) if offsets else None,
        ("value_offset", TensorProto.FLOAT, [kv_heads, head_dim]) if offsets else None,
        ("key_scale", TensorProto.FLOAT, [kv_heads, head_dim]) if key_scale else None,
    ]
    while inputs and inputs[-1] is None:
        inputs.pop()
    if rotary_dim:
        attributes.setdefault("do_rotary", 1)
    if local_window_size != -1:
        attributes["local_window_size"] = local_window_size
    if softcap:
        attributes["softcap"] = float(softcap)
    outputs = [("output", dtype, ["T", q_heads * head_dim]),
               ("key_cache_out", TensorProto.UINT8, pool),
               ("value_cache_out", TensorProto.UINT8, pool)]
    return node_model("TQPagedAttention", inputs, outputs, key_format=key_format, value_format=value_format,
                      num_heads=q_heads, kv_num_heads=kv_heads, **attributes)
