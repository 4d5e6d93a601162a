"""The `turboquant` ONNX domain (version 1): op schemas for onnx.defs and onnx.reference kernels.

`register_schemas()` (called on import) lets onnx.checker and onnx.shape_inference accept models
that use the domain's ops, with shape inference for their outputs.
`REFERENCE_OPS` plugs the numpy reference into onnx.reference.ReferenceEvaluator:

    ReferenceEvaluator(model, new_ops=turboquant.onnx_ops.REFERENCE_OPS).run(None, feeds)

The ops are documented once, in docs/ops.md.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, defs, helper
from onnx.reference.op_run import OpRun

from . import DOMAIN, OPSET_VERSION
from .config import ALL_FORMATS, packed_size
from .reference.attention import attention as reference_attention
from .reference.gqa import group_query_attention as reference_gqa
from .reference.paged import paged_attention as reference_paged
from .reference import formats as ref_formats
from .reference.numerics import bfloat16

FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
_NP_OF = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}

_A = defs.OpSchema.Attribute
_P = defs.OpSchema.FormalParameter
_OPT = defs.OpSchema.FormalParameterOption.Optional
_ATTR = defs.OpSchema.AttrType


def _attr(ctx, name, default):
    a = ctx.get_attribute(name)
    return default if a is None else helper.get_attribute_value(a)


def _shape_of(ctx, i):
    """Dims of input i (ints or symbolic names or None), or None when its shape is unknown."""
    if not ctx.has_input(i):
        return None
    t = ctx.get_input_type(i)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]


def _set(ctx, i, elem_type, dims):
    ctx.set_output_type(i, helper.make_tensor_type_proto(elem_type, dims))


def _fmt_bytes(fmt, d):
    try:
        return packed_size(fmt, d) if isinstance(d, int) and d else None
    except ValueError:
        return None


def _infer_pack(ctx):
    shape = _shape_of(ctx, 0)
    fmt = _attr(ctx, "format", b"").decode() if isinstance(_attr(ctx, "format", b""), bytes) else _attr(ctx, "format", "")
    _set(ctx, 0, TensorProto.UINT8, None if shape is None else shape[:-1] + [_fmt_bytes(fmt, shape[-1])])


def _infer_unpack(ctx):
    shape = _shape_of(ctx, 0)
    dtype = _attr(ctx, "dtype", TensorProto.FLOAT)
    _set(ctx, 0, dtype, None if shape is None else shape[:-1] + [_attr(ctx, "head_dim", None)])


def _infer_attention(ctx):
    q, k, v = _shape_of(ctx, 0), _shape_of(ctx, 1), _shape_of(ctx, 2)
    qtype = ctx.get_input_type(0).tensor_type.elem_type
    kf = _attr(ctx, "key_format", b"mse4")
    vf = _attr(ctx, "value_format", b"uint4")
    kf, vf = (x.decode() if isinstance(x, bytes) else x for x in (kf, vf))
    y = present_k = present_v = None
    if q is not None and v is not None and k is not None and len(q) == len(v) == len(k):
        hkv = _attr(ctx, "kv_num_heads", 0)
        if len(q) == 4:
            y = [q[0], q[1], q[2], v[3]]
            hkv, sn, d, dv = k[1], k[2], k[3], v[3]
        else:
            hq = _attr(ctx, "q_num_heads", 0)
            y = [q[0], q[1], hq * v[2] // hkv if hq and hkv and isinstance(v[2], int) else None]
            sn = k[1]
            d = k[2] // hkv if hkv and isinstance(k[2], int) else None
            dv = v[2] // hkv if hkv and isinstance(v[2], int) else None
        past = _shape_of(ctx, 4)
        total = None
        if past is not None and isinstance(past[2], int) and isinstance(sn, int):
            total = past[2] + sn
        elif not ctx.has_input(4) and isinstance(sn, int):
            total = sn
        present_k = [q[0], hkv or None, total, _fmt_bytes(kf, d)]
        present_v = [q[0], hkv or None, total, _fmt_bytes(vf, dv)]
    _set(ctx, 0, qtype, y)
    _set(ctx, 1, TensorProto.UINT8, present_k)
    _set(ctx, 2, TensorProto.UINT8, present_v)


def _infer_gqa(ctx):
    q, past = _shape_of(ctx, 0), _shape_of(ctx, 3)
    # the TensorRT form (plugin attributes) drops absent optional inputs, so its input 3 is not past_key
    if q is not None and len(q) != 3 or past is not None and len(past) != 4:
        return
    hq, hkv = _attr(ctx, "num_heads", 0), _attr(ctx, "kv_num_heads", 0)
    y = present = None
    if q is not None:
        d = None
        if isinstance(q[2], int) and hq:
            d = q[2] // (hq if ctx.has_input(1) else hq + 2 * hkv)
        y = [q[0], q[1], hq * d if d else None]
    if past is not None:  # a window-sized buffer's present has its rows, C
        present = [past[0], past[1], past[2] if _attr(ctx, "sliding_window_cache", 0) else None, past[3]]
    _set(ctx, 0, ctx.get_input_type(0).tensor_type.elem_type, y)
    _set(ctx, 1, TensorProto.UINT8, present)
    _set(ctx, 2, TensorProto.UINT8, present)


def _infer_paged(ctx):
    q = _shape_of(ctx, 0)
    hq, hkv = _attr(ctx, "num_heads", 0), _attr(ctx, "kv_num_heads", 0)
    y = None
    if q is not None and len(q) == 2:
        d = None
        if isinstance(q[1], int) and hq:
            d = q[1] // (hq if ctx.has_input(1) else hq + 2 * hkv)
        y = [q[0], hq * d if d else None]
    _set(ctx, 0, ctx.get_input_type(0).tensor_type.elem_type, y)
    _set(ctx, 1, TensorProto.UINT8, _shape_of(ctx, 3))
    _set(ctx, 2, TensorProto.UINT8, _shape_of(ctx, 4))


def _schemas() -> list[defs.OpSchema]:
    fmt_doc = "one of " + ", ".join(ALL_FORMATS)
    pack = defs.OpSchema(
        "TQPack", DOMAIN, OPSET_VERSION,
        "Packs vectors on the last axis into a TurboQuant format (docs/ops.md).",
        inputs=[_P("x", "T", "float vectors [..., head_dim]"),
                _P("offset", "tensor(float)", "optional [head_dim] or [H, head_dim], subtracted first", param_option=_OPT)],
        outputs=[_P("packed", "tensor(uint8)", "[..., packed_size]")],
        type_constraints=[("T", FLOAT_TYPES, "float types")],
        attributes=[_A("format", _ATTR.STRING, fmt_doc, required=True),
                    _A("head_dim", _ATTR.INT, "length of a vector (0: the last dimension of x)", required=False),
                    _A("norm_correction", _ATTR.INT, "mse formats: store n/||c|| (1, default) or n (0)", required=False)],
    )
    unpack = defs.OpSchema(
        "TQUnpack", DOMAIN, OPSET_VERSION,
        "Reads packed TurboQuant vectors back as floats (docs/ops.md).",
        inputs=[_P("packed", "tensor(uint8)", "[..., packed_size]"),
                _P("offset", "tensor(float)", "optional [head_dim] or [H, head_dim], added back", param_option=_OPT)],
        outputs=[_P("x", "T", "[..., head_dim]")],
        type_constraints=[("T", FLOAT_TYPES, "float types")],
        attributes=[_A("format", _ATTR.STRING, fmt_doc, required=True),
                    _A("head_dim", _ATTR.INT, "length of a vector", required=True),
                    _A("dtype", _ATTR.INT, "output TensorProto type: FLOAT (1, default), FLOAT16 (10), BFLOAT16 (16)", required=False)],
    )
    # the packed cache's formats, as TQAttention and TQGroupQueryAttention take them
    cache_formats = [_A("key_format", _ATTR.STRING, fmt_doc + " (default mse4)", required=False),
                     _A("value_format", _ATTR.STRING, fmt_doc + " (default uint4)", required=False),
                     _A("norm_correction", _ATTR.INT, "mse keys and values: 1 (default) or 0", required=False)]
    attention = defs.OpSchema(
        "TQAttention", DOMAIN, OPSET_VERSION,
        "ONNX Attention (opset 23) over a packed uint8 KV cache (docs/ops.md).",
        inputs=[_P("Q", "T", "[B, Hq, Sq, D] or [B, Sq, Hq*D]"),
                _P("K", "T", "new keys, [B, Hkv, Sn, D] or [B, Sn, Hkv*D]"),
                _P("V", "T", "new values, [B, Hkv, Sn, Dv] or [B, Sn, Hkv*Dv]"),
                _P("attn_mask", "M", "bool or additive, broadcastable to [B, Hq, Sq, S_past+Sn]", param_option=_OPT),
                _P("past_key", "tensor(uint8)", "[B, Hkv, S_past, key bytes]", param_option=_OPT),
                _P("past_value", "tensor(uint8)", "[B, Hkv, S_past, value bytes]", param_option=_OPT),
                _P("key_offset", "tensor(float)", "[Hkv, D], subtracted from every key", param_option=_OPT),
                _P("value_offset", "tensor(float)", "[Hkv, Dv], subtracted from every stored value", param_option=_OPT)],
        outputs=[_P("Y", "T", "like Q, with head size Dv"),
                 _P("present_key", "tensor(uint8)", "[B, Hkv, S_past+Sn, key bytes]"),
                 _P("present_value", "tensor(uint8)", "[B, Hkv, S_past+Sn, value bytes]")],
        type_constraints=[("T", FLOAT_TYPES, "float types"),
                          ("M", ["tensor(bool)", *FLOAT_TYPES], "bool (true: attend) or additive float mask")],
        attributes=[*cache_formats,
                    _A("head_dim", _ATTR.INT, "D, checked against Q (0: from Q)", required=False),
                    _A("is_causal", _ATTR.INT, "1: causal mask aligned to the end of the cache", required=False),
                    _A("scale", _ATTR.FLOAT, "softmax scale (0 or absent: 1/sqrt(D))", required=False),
                    _A("q_num_heads", _ATTR.INT, "Hq, required for 3-D inputs", required=False),
                    _A("kv_num_heads", _ATTR.INT, "Hkv, required for 3-D inputs", required=False)],
    )
    gqa = defs.OpSchema(
        "TQGroupQueryAttention", DOMAIN, OPSET_VERSION,
        "com.microsoft GroupQueryAttention over packed uint8 caches in a (shareable) buffer (docs/ops.md).",
        inputs=[_P("query", "T", "[B, S, Hq*D], or [B, S, (Hq+2*Hkv)*D] with Q, K, V packed"),
                _P("key", "T", "[B, S, Hkv*D] (absent: packed in query)", param_option=_OPT),
                _P("value", "T", "[B, S, Hkv*D] (absent: packed in query)", param_option=_OPT),
                _P("past_key", "tensor(uint8)", "[B, Hkv, max_length, W], W >= key bytes"),
                _P("past_value", "tensor(uint8)", "[B, Hkv, max_length, W], W >= value bytes"),
                _P("seqlens_k", "tensor(int32)", "[B]: total length of each sequence - 1"),
                _P("total_sequence_length", "tensor(int32)", "scalar, in host memory"),
                _P("cos_cache", "T", "[max_positions, rotary_dim/2] (do_rotary)", param_option=_OPT),
                _P("sin_cache", "T", "[max_positions, rotary_dim/2] (do_rotary)", param_option=_OPT),
                _P("position_ids", "tensor(int64)", "[B, S] (default: past + s)", param_option=_OPT),
                _P("attention_bias", "T", "not supported: refused when given", param_option=_OPT),
                _P("head_sink", "T", "[Hq]: exp(sink - m) joins each head's softmax denominator", param_option=_OPT),
                _P("key_offset", "tensor(float)", "[Hkv, D], subtracted from every key", param_option=_OPT),
                _P("value_offset", "tensor(float)", "[Hkv, D], subtracted from every stored value", param_option=_OPT),
                _P("key_scale", "tensor(float)", "[Hkv, D] (do_rotary), after the rotary: Q multiplied, K divided",
                   param_option=_OPT)],
        outputs=[_P("output", "T", "[B, S, Hq*D]"),
                 _P("present_key", "tensor(uint8)",
                    "[B, Hkv, max(max_length, total) (sliding_window_cache: C), W]; may be past_key's buffer"),
                 _P("present_value", "tensor(uint8)",
                    "[B, Hkv, max(max_length, total) (sliding_window_cache: C), W]; may be past_value's buffer")],
        type_constraints=[("T", FLOAT_TYPES, "float types")],
        attributes=[*cache_formats,
                    _A("num_heads", _ATTR.INT, "Hq", required=True),
                    _A("kv_num_heads", _ATTR.INT, "Hkv", required=True),
                    _A("scale", _ATTR.FLOAT, "softmax scale (0 or absent: 1/sqrt(D))", required=False),
                    _A("do_rotary", _ATTR.INT, "1: rotary embedding of Q and K inside the op", required=False),
                    _A("rotary_interleaved", _ATTR.INT, "1: rotate neighbouring pairs", required=False),
                    _A("local_window_size", _ATTR.INT, "-1: none; W > 0: position p sees keys p-W+1 .. p",
                       required=False),
                    _A("softcap", _ATTR.FLOAT, "0: none; c > 0: scores become c * tanh(score / c)", required=False),
                    _A("smooth_softmax", _ATTR.INT, "must be 0", required=False),
                    _A("qk_output", _ATTR.INT, "must be 0", required=False),
                    _A("sliding_window_cache", _ATTR.INT,
                       "1: past_key's C >= W rows are a window-sized buffer (ORT's layout); present has C rows",
                       required=False)],
    )
    paged = defs.OpSchema(
        "TQPagedAttention", DOMAIN, OPSET_VERSION,
        "com.microsoft PagedAttention over pools of packed uint8 KV blocks, updated in place (docs/ops.md).",
        inputs=[_P("query", "T", "[num_tokens, Hq*D], or [num_tokens, (Hq+2*Hkv)*D] with Q, K, V packed"),
                _P("key", "T", "[num_tokens, Hkv*D] (absent: packed in query)", param_option=_OPT),
                _P("value", "T", "[num_tokens, Hkv*D] (absent: packed in query)", param_option=_OPT),
                _P("key_cache", "tensor(uint8)", "[num_blocks, block_size, Hkv, W], W >= key bytes"),
                _P("value_cache", "tensor(uint8)", "[num_blocks, block_size, Hkv, W], W >= value bytes"),
                _P("cumulative_sequence_length", "tensor(int32)", "[B + 1]: first token of each sequence, then num_tokens"),
                _P("past_seqlens", "tensor(int32)", "[B]: tokens each sequence has cached"),
                _P("block_table", "tensor(int32)", "[B, max_blocks]: the pool blocks of each sequence, in order"),
                _P("cos_cache", "T", "[max_positions, rotary_dim/2] (do_rotary)", param_option=_OPT),
                _P("sin_cache", "T", "[max_positions, rotary_dim/2] (do_rotary)", param_option=_OPT),
                _P("head_sink", "T", "[Hq]: exp(sink - m) joins each head's softmax denominator", param_option=_OPT),
                _P("key_offset", "tensor(float)", "[Hkv, D], subtracted from every key", param_option=_OPT),
                _P("value_offset", "tensor(float)", "[Hkv, D], subtracted from every stored value", param_option=_OPT),
                _P("key_scale", "tensor(float)", "[Hkv, D] (do_rotary), after the rotary: Q multiplied, K divided",
                   param_option=_OPT)],
        outputs=[_P("output", "T", "[num_tokens, Hq*D]"),
                 _P("key_cache_out", "tensor(uint8)", "key_cache with the new keys in their slots; may be its buffer"),
                 _P("value_cache_out", "tensor(uint8)",
                    "value_cache with the new values in their slots; may be its buffer")],
        type_constraints=[("T", FLOAT_TYPES, "float types")],
        attributes=[*cache_formats,
                    _A("num_heads", _ATTR.INT, "Hq", required=True),
                    _A("kv_num_heads", _ATTR.INT, "Hkv", required=True),
                    _A("scale", _ATTR.FLOAT, "softmax scale (0 or absent: 1/sqrt(D))", required=False),
                    _A("do_rotary", _ATTR.INT, "1: rotary embedding of Q and K inside the op", required=False),
                    _A("rotary_interleaved", _ATTR.INT, "1: rotate neighbouring pairs", required=False),
                    _A("local_window_size", _ATTR.INT, "-1: none; W > 0: position p sees keys p-W+1 .. p",
                       required=False),
                    _A("softcap", _ATTR.FLOAT, "0: none; c > 0: scores become c * tanh(score / c)", required=False)],
    )
    paged.set_type_and_shape_inference_function(_infer_paged)
    gqa.set_type_and_shape_inference_function(_infer_gqa)
    pack.set_type_and_shape_inference_function(_infer_pack)
    unpack.set_type_and_shape_inference_function(_infer_unpack)
    attention.set_type_and_shape_inference_function(_infer_attention)
    return [pack, unpack, attention, gqa, paged]


def register_schemas() -> None:
    """Registers the domain's schemas with onnx.defs (idempotent)."""
    for schema in _schemas():
        try:
            defs.get_schema(schema.name, OPSET_VERSION, DOMAIN)
            continue
        except defs.SchemaError:
            pass
        defs.register_schema(schema)


# -- onnx.reference kernels -------------------------------------------------------------------------

def _s(x):
    return x.decode() if isinstance(x, bytes) else x


class TQPack(OpRun):
    op_domain = DOMAIN

    def _run(self, x, offset=None, format=None, head_dim=None, norm_correction=None):  # noqa: A002
        if head_dim and x.shape[-1] != head_dim:
            raise ValueError(f"TQPack: input 'x' has last dimension {x.shape[-1]} but attribute 'head_dim' is {head_dim}")
        off = _offset(offset, x.shape)
        nc = True if norm_correction is None else bool(norm_correction)
        return (ref_formats.pack(x, _s(format), nc, off),)


class TQUnpack(OpRun):
    op_domain = DOMAIN

    def _run(self, packed, offset=None, format=None, head_dim=None, dtype=None):  # noqa: A002
        x = ref_formats.unpack(packed, _s(format), int(head_dim))
        if offset is not None:
            x = x + _offset(offset, x.shape)
        return (x.astype(_NP_OF[dtype or TensorProto.FLOAT]),)


def _offset(offset, shape):
    """[D] applies to every vector; [H, D] to the vectors of axis -3."""
    if offset is None:
        return None
    offset = np.asarray(offset, np.float32)
    return offset if offset.ndim == 1 else offset[:, None, :]


class TQAttention(OpRun):
    op_domain = DOMAIN

    def _run(self, Q, K, V, attn_mask=None, past_key=None, past_value=None, key_offset=None, value_offset=None,
             key_format=None, value_format=None, norm_correction=None, head_dim=None, is_causal=None, scale=None,
             q_num_heads=None, kv_num_heads=None):
        return reference_attention(
            Q, K, V, attn_mask, past_key, past_value, key_offset, value_offset,
            key_format=_s(key_format or "mse4"), value_format=_s(value_format or "uint4"),
            norm_correction=True if norm_correction is None else bool(norm_correction),
            head_dim=head_dim or None, is_causal=bool(is_causal), scale=scale or None,
            q_num_heads=q_num_heads or 0, kv_num_heads=kv_num_heads or 0,
        )


class TQGroupQueryAttention(OpRun):
    op_domain = DOMAIN

    def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
             total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None, attention_bias=None,
             head_sink=None, key_offset=None, value_offset=None, key_scale=None, key_format=None, value_format=None,
             norm_correction=None, num_heads=None, kv_num_heads=None, scale=None, do_rotary=None,
             rotary_interleaved=None, local_window_size=None, softcap=None, smooth_softmax=None, qk_output=None,
             sliding_window_cache=None):
        refused = {"attention_bias": attention_bias is not None, "smooth_softmax": bool(smooth_softmax),
                   "qk_output": bool(qk_output)}
        if any(refused.values()):
            raise ValueError("TQGroupQueryAttention: not supported: " + ", ".join(k for k, v in refused.items() if v))
        return reference_gqa(
            query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache,
            position_ids, key_offset, value_offset, key_scale, key_format=_s(key_format or "mse4"),
            value_format=_s(value_format or "uint4"),
            norm_correction=True if norm_correction is None else bool(norm_correction),
            num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale or None, do_rotary=bool(do_rotary),
            rotary_interleaved=bool(rotary_interleaved),
            local_window_size=-1 if local_window_size is None else int(local_window_size),
            softcap=float(softcap or 0.0), head_sink=head_sink, sliding_window_cache=bool(sliding_window_cache))


class TQPagedAttention(OpRun):
    op_domain = DOMAIN

    def _run(self, query, key=None, value=None, key_cache=None, value_cache=None, cumulative_sequence_length=None,
             past_seqlens=None, block_table=None, cos_cache=None, sin_cache=None, head_sink=None, key_offset=None,
             value_offset=None, key_scale=None, key_format=None, value_format=None, norm_correction=None,
             num_heads=None, kv_num_heads=None, scale=None, do_rotary=None, rotary_interleaved=None,
             local_window_size=None, softcap=None):
        return reference_paged(
            query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
            cos_cache, sin_cache, key_offset, value_offset, key_scale, key_format=_s(key_format or "mse4"),
            value_format=_s(value_format or "uint4"),
            norm_correction=True if norm_correction is None else bool(norm_correction),
            num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale or None, do_rotary=bool(do_rotary),
            rotary_interleaved=bool(rotary_interleaved),
            local_window_size=-1 if local_window_size is None else int(local_window_size),
            softcap=float(softcap or 0.0), head_sink=head_sink)


REFERENCE_OPS = [TQPack, TQUnpack, TQAttention, TQGroupQueryAttention, TQPagedAttention]

register_schemas()
