"""The in-place cache form of an exported decoder (torch.onnx, optimum): every layer's attention
becomes one GroupQueryAttention-style node over a preallocated cache buffer that the model's loop
binds as both its past input and its present output, so that a step writes only its new rows.

Compressed layers get turboquant.TQGroupQueryAttention over packed uint8 rows (the width of the
larger of their formats, as in export/gqa.py); boundary and kept layers get ONNX Runtime's own
com.microsoft.GroupQueryAttention over float rows of the model's dtype (bfloat16 models: raw16
TQGroupQueryAttention, which ORT's op does not take). Both take the exporter's rotary inside
(do_rotary) where export/rotary.py verifies it; elsewhere it stays outside the op (do_rotary 0).

Masks as lengths: the exporter's attention mask (attention_mask combined with causal) is replaced
by each sequence's length, sum(attention_mask[b]), and the op's causal alignment. That is
GroupQueryAttention's contract: sequences are right-padded (a first prompt's padding at its end,
each later token written at row sum(mask) - 1, whatever the mask holds before it). Left padding
cannot be told from a right-padded row by lengths alone; models for left-padded batches keep the
default (concat) form, which keeps the mask.

Shape computations that read a cache's sequence length (exporters' past_len, Shape(past)[2]) are
given it from the lengths instead: attention_mask's length less input_ids'.

The step then runs about the nodes of a genai model: the exporter's rotary inside the op
(export/rotary.py), Q, K and V from one product (export/packed_qkv.py) and the op's output fed to
the output projection as it is, where export/mask_probe.py found the value that holds it.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

import turboquant
from turboquant.config import FORMAT_VERSION, TQ_PRESETS

from .cache_io import CacheLayer
from .errors import RewriteError
from .forms import AttentionSite, locate
from .gqa import BOUNDARY_FORMAT, _describe_widths, row_width
from . import output_projection, packed_qkv
from . import rotary as rotary_fusion
from .plan import LayerPlan, RewriteResult, plan_layers
from .surgery import _REPEAT_CHAIN, _initializer, _replace_graph_output, _scaled

FORM = "in-place"
MAX_LENGTH = "max_length"  # the buffers' symbolic row count, chosen by the loop that allocates them


@dataclasses.dataclass
class Lengths:
    seqlens_k: ir.Value  # int32 [B]: each sequence's length - 1
    total: ir.Value  # int32 scalar: attention_mask's length
    total_1d: ir.Value  # int64 [1]: the same, for shape computations
    input_ids: ir.Value
    _past: ir.Value | None = None

    def past_1d(self, graph: ir.Graph) -> ir.Value:
        """int64 [1]: total less the new tokens, made where first asked for (after the pass that
        would remove it unused; the final topological sort puts it in order)."""
        if self._past is None:
            b = _Builder(graph, graph[0], "tq_lengths_")
            new_1d = b("Shape", [self.input_ids], "new_1d", ir.DataType.INT64, [1], start=1, end=2)
            self._past = b("Sub", [self.total_1d, new_1d], "past_1d", ir.DataType.INT64, [1])
        return self._past


class _Builder:
    """Appends nodes in order before `anchor` (or at the graph's start), naming their outputs."""

    def __init__(self, graph: ir.Graph, anchor: ir.Node, prefix: str):
        self.graph, self.anchor, self.prefix = graph, anchor, prefix

    def __call__(self, op: str, inputs: list, name: str, dtype=None, shape=None, domain: str = "", num_outputs: int = 1,
                 **attrs) -> ir.Value | tuple:
        n = ir.node(op, inputs, attrs, domain=domain, num_outputs=num_outputs, name=f"{self.prefix}{name}")
        self.graph.insert_before(self.anchor, n)
        for k, o in enumerate(n.outputs):
            o.name = f"{self.prefix}{name}" + (f"_{k}" if num_outputs > 1 else "")
        if dtype is not None:
            n.outputs[0].dtype = dtype
        if shape is not None:
            n.outputs[0].shape = ir.Shape(shape)
        return n.outputs[0] if num_outputs == 1 else tuple(n.outputs)

    def const(self, name: str, array) -> ir.Value:
        return self("Constant", [], name, value=ir.tensor(np.asarray(array), name=f"{self.prefix}{name}"))


def _input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def lengths(graph: ir.Graph) -> Lengths:
    """seqlens_k and total_sequence_length from attention_mask [B, total], at the start of the graph."""
    mask, ids = _input(graph, "attention_mask"), _input(graph, "input_ids")
    if mask is None or ids is None:
        missing = [n for n, v in (("attention_mask", mask), ("input_ids", ids)) if v is None]
        raise RewriteError(f"the in-place cache form takes each sequence's length from attention_mask and the new "
                           f"tokens from input_ids; this model has no {' or '.join(missing)} input")
    b = _Builder(graph, graph[0], "tq_lengths_")
    m64 = b("Cast", [mask], "mask", ir.DataType.INT64, to=ir.DataType.INT64)
    sums = b("ReduceSum", [m64, b.const("axis", np.array([1], np.int64))], "sum", ir.DataType.INT64, keepdims=0)
    seqlens = b("Cast", [b("Sub", [sums, b.const("one", np.array(1, np.int64))], "sum_minus_one")], "seqlens_k",
                ir.DataType.INT32, to=ir.DataType.INT32)
    total_1d = b("Shape", [mask], "total_1d", ir.DataType.INT64, [1], start=1, end=2)
    total = b("Cast", [b("Squeeze", [total_1d], "total_scalar")], "total_sequence_length", ir.DataType.INT32, [],
              to=ir.DataType.INT32)
    return Lengths(seqlens, total, total_1d, ids)


def _rank(x: ir.Value, site: AttentionSite) -> int:
    """Q/K/V's rank: their shape's, else 3 for ONNX Attention with head-count attributes, 4 otherwise."""
    if x.shape is not None:
        return len(x.shape)
    return 3 if site.form.startswith("attention") and site.q_num_heads else 4


def _to_bsd(b: _Builder, x: ir.Value, site: AttentionSite, name: str) -> ir.Value:
    """[B, H, S, D] -> [B, S, H * D] (3-D inputs are that already)."""
    return x if _rank(x, site) == 3 else _bhsd_to_bsd(b, x, name)


def _bhsd_to_bsd(b: _Builder, x: ir.Value, name: str) -> ir.Value:
    t = b("Transpose", [x], f"{name}_bshd", x.dtype, perm=[0, 2, 1, 3])
    return b("Reshape", [t, b.const(f"{name}_shape", np.array([0, 0, -1], np.int64))], f"{name}_bsd", x.dtype)


def query_heads(site: AttentionSite) -> int | None:
    """Hq where the graph says it: the attribute, or Q's static head axis."""
    if site.q_num_heads:
        return int(site.q_num_heads)
    q = site.q
    if q.shape is not None and len(q.shape) == 4 and isinstance(q.shape[1], int):
        return q.shape[1]
    return None


def packs(plan: LayerPlan) -> bool:
    """Whether the layer takes TQGroupQueryAttention's uint8 rows (compressed, or a kept layer as
    raw16) rather than ORT's GroupQueryAttention over float rows."""
    return plan.compressed or plan.key_format == BOUNDARY_FORMAT


def apply_in_place(model: ir.Model, site: AttentionSite, layer: CacheLayer, plan: LayerPlan, lens: Lengths, q_heads: int,
                   norm_correction: bool, key_offset=None, value_offset=None, key_scale=None, value_scale=None,
                   rotary: rotary_fusion.Fused | None = None, y_flat: tuple[ir.Value, int | None] | None = None) -> ir.Node:
    """Replaces one layer's attention by the in-place op (module docstring); returns the new node.
    The old attention and its cache concats are left for RemoveUnusedNodesPass, their shape
    readers for reroute_shapes. rotary: the op rotates Q and K itself (export/rotary.py). y_flat:
    a value after the attention that is its output as [B, S, Hq * D] and the type a Cast on the way
    gave it (None: the output's own), which the op's output replaces (the reshapes and transposes
    between them then go)."""
    graph = site.anchor.graph
    i = layer.index
    b = _Builder(graph, site.anchor, f"tq_in_place_{i}_")
    hkv, d = plan.kv_heads, plan.head_dim
    packed = packs(plan)
    if rotary is None:
        q, k = _to_bsd(b, site.q, site, "query"), _to_bsd(b, site.k_new, site, "key")
    elif rotary.seq_axis == 2:  # [B, H, S, D], as the exporter rotated them
        q, k = (_bhsd_to_bsd(b, x, n) for x, n in ((rotary.q, "query"), (rotary.k, "key")))
    else:  # [B, S, H, D]
        flat = b.const("bsd_shape", np.array([0, 0, -1], np.int64))
        q, k = (b("Reshape", [x, flat], f"{n}_bsd", x.dtype) for x, n in ((rotary.q, "query"), (rotary.k, "key")))
    v = _to_bsd(b, site.v_new, site, "value")
    if rotary is not None and rotary.seq_axis == 2 and value_scale is None:  # export/packed_qkv.py
        qkv = _packed_qkv(model, b, rotary, site.v_new, (q_heads, hkv, hkv), d, layer.past_key.dtype, i)
        if qkv is not None:
            q, k, v = qkv, None, None
    scale_in_op = key_scale is not None and rotary is not None and packed
    if scale_in_op:  # the op scales after its rotary: key_scale input, offsets in scaled units
        if key_offset is not None:
            key_offset = (key_offset / key_scale).astype(np.float32)
    elif key_scale is not None:  # export/calibrate.py: Q times the scale, K divided by it, scores unchanged
        dtype = layer.past_key.dtype.numpy()
        q = _scaled(graph, site.anchor, q, np.repeat(key_scale, q_heads // hkv, axis=0).reshape(-1).astype(dtype),
                    f"tq_query_scaled_{i}")
        k = _scaled(graph, site.anchor, k, (1.0 / key_scale).reshape(-1).astype(dtype), f"tq_key_scaled_{i}")
        if key_offset is not None:
            key_offset = (key_offset / key_scale).astype(np.float32)
    if value_scale is not None:  # export/calibrate.py value_scale: V divided by it here, Y multiplied back below
        v = _scaled(graph, site.anchor, v, (1.0 / value_scale).reshape(-1).astype(layer.past_key.dtype.numpy()),
                    f"tq_value_scaled_{i}")
        if value_offset is not None:
            value_offset = (value_offset / value_scale).astype(np.float32)
    attrs = {"num_heads": int(q_heads), "kv_num_heads": int(hkv), "do_rotary": int(rotary is not None)}
    if rotary is not None:
        attrs["rotary_interleaved"] = 0
    if site.scale:
        attrs["scale"] = float(site.scale)
    inputs = [q, k, v, layer.past_key, layer.past_value, lens.seqlens_k, lens.total]
    inputs += [rotary.cos_cache, rotary.sin_cache] if rotary is not None else [None, None]
    if packed:
        attrs.update(key_format=plan.key_format, value_format=plan.value_format, norm_correction=int(norm_correction))
        if key_offset is not None or value_offset is not None or scale_in_op:
            zeros = np.zeros((hkv, d), np.float32)
            inputs += [None] * 3 + [_initializer(model, f"tq_key_offset_{i}", key_offset if key_offset is not None else zeros)]
            inputs.append(_initializer(model, f"tq_value_offset_{i}", value_offset) if value_offset is not None else None)
            if scale_in_op:
                inputs.append(_initializer(model, f"tq_key_scale_{i}", np.asarray(key_scale, np.float32)))
    while inputs[-1] is None:  # optional inputs left out at the end
        inputs.pop()
    if packed:
        node = ir.node("TQGroupQueryAttention", inputs, attrs, domain=turboquant.DOMAIN, num_outputs=3, name=f"tq_in_place_{i}")
    else:
        node = ir.node("GroupQueryAttention", inputs, attrs, domain="com.microsoft", num_outputs=3, name=f"tq_in_place_{i}")
    graph.insert_before(site.anchor, node)
    y = node.outputs[0]
    y.name, y.dtype = f"tq_in_place_{i}_y", layer.past_key.dtype
    if value_scale is not None:  # [B, S, Hq * D]: each query head's channels by its KV head's scale
        factor = np.repeat(value_scale, q_heads // hkv, axis=0).reshape(-1).astype(layer.past_key.dtype.numpy())
        y = _scaled(graph, site.anchor, y, factor, f"tq_output_scaled_{i}")
    if y_flat is not None:  # export/mask_probe.py found it
        flat, to = y_flat
        to = to if to is not None else site.y_cast_to
        if to is not None and to != int(y.dtype):
            flat_y = b("Cast", [y], "y_flat_cast", ir.DataType(to), to=ir.DataType(to))
        else:
            flat_y = y
        flat.replace_all_uses_with(flat_y)
        if flat_y is not y:
            output_projection.narrow(model, b, y, flat_y, i)
    if _rank(site.q, site) == 4:  # the original Y is [B, Hq, S, Dv]
        y4 = b("Reshape", [y, b.const("y_shape", np.array([0, 0, q_heads, d], np.int64))], "y_bshd", y.dtype)
        y = b("Transpose", [y4], "y_bhsd", y.dtype, perm=[0, 2, 1, 3])
    if site.y_cast_to is not None:
        y = b("Cast", [y], "y_cast", ir.DataType(site.y_cast_to), to=ir.DataType(site.y_cast_to))
    if site.y.dtype is not None:
        y.dtype, y.shape = site.y.dtype, site.y.shape
    if site.y.is_graph_output():
        _replace_graph_output(graph, site.y, y)
    site.y.replace_all_uses_with(y)
    width = row_width(plan.key_format, plan.value_format, d) if packed else d
    plan.row_bytes = width if packed else None
    for old, new, name in ((site.present_key, node.outputs[1], "present_key"), (site.present_value, node.outputs[2], "present_value")):
        if old.is_graph_output():
            _replace_graph_output(graph, old, new)
        else:
            new.name = f"tq_in_place_{i}_{name}"
    for val in (layer.past_key, layer.past_value, node.outputs[1], node.outputs[2]):
        batch = val.shape[0] if val.shape is not None and len(val.shape) == 4 else "batch"
        val.dtype = ir.DataType.UINT8 if packed else layer.past_key.dtype
        val.shape = ir.Shape([batch, hkv, MAX_LENGTH, width])
    return node


def _replace_shape_reader(user: ir.Node, parts: list[ir.Value]) -> None:
    """Shape node `user` gives the same numbers from `parts` (int64 [1] each, one per axis), its
    start and end kept, so that the tensor it read can go."""
    b = _Builder(user.graph, user, f"{user.name}_tq_")
    shape = b("Concat", parts, "shape", ir.DataType.INT64, [len(parts)], axis=0)
    start, end = user.attributes.get("start"), user.attributes.get("end")
    if start is not None or end is not None:
        shape = b("Slice", [shape, b.const("start", np.array([start.value if start else 0], np.int64)),
                            b.const("end", np.array([end.value if end else len(parts)], np.int64))], "slice",
                  ir.DataType.INT64)
    user.outputs[0].replace_all_uses_with(shape)


def _flat(by_name: dict, found: tuple[str, int | None] | None) -> tuple[ir.Value, int | None] | None:
    """The probe's flat output (export/mask_probe.py) as a value of this model."""
    return None if found is None or found[0] not in by_name else (by_name[found[0]], found[1])


def _packed_qkv(model: ir.Model, b: _Builder, rotary: rotary_fusion.Fused, v4: ir.Value, heads: tuple[int, int, int],
                d: int, dtype: ir.DataType, i: int) -> ir.Value | None:
    """One product h @ [Wq Wk Wv] (+ biases) for the op's packed input, where export/packed_qkv.py
    verifies the exporter's three; the Shape nodes that read the three are given the same numbers
    from h, so that the three products can go."""
    found = packed_qkv.packed(model, rotary.q, rotary.k, v4, heads, d, dtype)
    if found is None:
        return None
    projections, weight, bias = found
    h = projections[0].h
    qkv = b("MatMul", [h, _initializer(model, f"tq_qkv_weight_{i}", weight)], "qkv", dtype)
    if bias is not None:
        qkv = b("Add", [qkv, _initializer(model, f"tq_qkv_bias_{i}", bias)], "qkv_biased", dtype)
    batch, seq = (b("Shape", [h], name, ir.DataType.INT64, [1], start=a, end=a + 1) for a, name in ((0, "batch"), (1, "seq")))
    d_1d = b.const("head_size", np.array([d], np.int64))
    for p, n, name in zip(projections, heads, ("query", "key", "value")):
        heads_1d, flat = b.const(f"{name}_heads", np.array([n], np.int64)), b.const(f"{name}_width", np.array([n * d], np.int64))
        *products, reshaped, x4 = p.outputs  # [B, S, n D] (the product, biased), [B, S, n, D], [B, n, S, D]
        for v, parts in [(o, [batch, seq, flat]) for o in products] + [
                (reshaped, [batch, seq, heads_1d, d_1d]), (x4, [batch, heads_1d, seq, d_1d])]:
            for user in list(v.consumers()):
                if user.op_type == "Shape":
                    _replace_shape_reader(user, parts)
    return qkv


def reroute_shapes(old: ir.Value, buffer: ir.Value, rows_1d: ir.Value, head_dim: int, q_heads: int | None, layer: int,
                   skip: ir.Node | None = None) -> None:
    """Shape(old) read after the attention is gone (old: a float cache of rows_1d rows, possibly
    repeated over the query heads, or the past input itself) becomes the same numbers from the
    buffer: batch and heads from its shape (q_heads where repeated), the rows from rows_1d, the head
    size a constant. Any other reader left is refused."""
    frontier = [(old, False)]
    while frontier:
        v, repeated = frontier.pop()
        for user in list(v.consumers()):
            if user is skip:
                continue
            if user.op_type in _REPEAT_CHAIN:
                frontier.append((user.outputs[0], repeated or user.op_type == "Reshape"))
                continue
            if user.op_type != "Shape":
                raise RewriteError(f"layer {layer}: {user.name!r} ({user.op_type}) reads the cache {v.name!r}, which the "
                                   "in-place form replaces by a buffer of max_length rows")
            if repeated and q_heads is None:
                raise RewriteError(f"layer {layer}: {user.name!r} reads the shape of {v.name!r} repeated over the "
                                   "query heads, whose count turboquant cannot re-derive")
            b = _Builder(user.graph, user, f"{user.name}_tq_")
            heads = (b.const("heads", np.array([q_heads], np.int64)) if repeated
                     else b("Shape", [buffer], "heads", ir.DataType.INT64, [1], start=1, end=2))
            _replace_shape_reader(user, [b("Shape", [buffer], "batch", ir.DataType.INT64, [1], start=0, end=1), heads,
                                         rows_1d, b.const("head_dim", np.array([head_dim], np.int64))])


def rewrite_in_place(model: ir.Model, preset: str, q_heads: dict[int, int], *, boundary: int = 2, skip_layers=None,
                     keep_layers=None, calibration=None, value_offsets: bool = False, key_scales: bool = True,
                     kept_raw16: bool = False, rotary_positions: int | None = None,
                     flat_outputs: dict[int, tuple[str, int | None]] | None = None,
                     plan: tuple | None = None) -> RewriteResult:
    """Rewrites an exported decoder into the in-place form (module docstring); returns what was done.
    q_heads: each layer's query heads where the graph does not say them (probe_query_heads).
    calibration as in export.concat.rewrite_model. kept_raw16: the kept layers as raw16
    TQGroupQueryAttention too (TensorRT, which has no GroupQueryAttention; exact for 16-bit models).
    rotary_positions: the exporter's rotary moved into the ops with tables of that many positions
    where it is verified to be theirs (export/rotary.py); None keeps it outside. flat_outputs: per
    layer, the name of the value after its attention that the probe found to hold the output as
    [B, S, heads * D] (export/mask_probe.py): the op's output takes its place. plan: plan_layers of
    `model` with these options, where the caller has it (None: planned here)."""
    plans, layers = plan or plan_layers(model, preset, boundary, skip_layers, keep_layers)
    cfg = TQ_PRESETS[preset]
    sites = {p.index: locate(layers[p.index]) for p in plans}
    nested = [i for i, s in sites.items() if s.anchor.graph is not model.graph]
    if nested:
        raise RewriteError(f"layers {nested} attend inside a subgraph (a merged decoder's If): the in-place cache form "
                           "takes a decoder without branches (export it unmerged, or use the default cache form)")
    if not any(p.compressed for p in plans):
        raise RewriteError("no layer left to compress: every cache layer is a boundary or kept layer")
    lens = lengths(model.graph)
    dtype = layers[plans[0].index].past_key.dtype
    fused = {} if rotary_positions is None else rotary_fusion.plan(
        model, {p.index: (sites[p.index].q, sites[p.index].k_new) for p in plans},
        {p.index: p.head_dim for p in plans}, dtype, rotary_positions)
    done, heads_of, flat_layers = [], {}, []
    by_name = {v.name: v for n in model.graph for v in n.outputs}
    for plan in plans:
        i, site, layer = plan.index, sites[plan.index], layers[plan.index]
        heads = heads_of[i] = query_heads(site) or q_heads.get(i)
        if not heads or plan.kv_heads is None:
            raise RewriteError(f"layer {i}: cannot tell its query and KV head counts for the in-place form")
        if layer.v_head_dim != layer.head_dim:  # GroupQueryAttention's caches share one head size
            raise RewriteError(f"layer {i}: value head size {layer.v_head_dim} differs from the key's {layer.head_dim}, "
                               "which the in-place form's GroupQueryAttention does not take")
        use = plan.compressed and calibration is not None
        kscale = calibration.key_scales.get(i) if use and key_scales else None
        if not plan.compressed and (kept_raw16 or layer.past_key.dtype == ir.DataType.BFLOAT16):
            plan.key_format = plan.value_format = BOUNDARY_FORMAT
        if i in fused:  # shapes read off the rotated Q and K: the unrotated ones have them, and the rotary can go
            for rotated, unrotated in ((site.q, fused[i].q), (site.k_new, fused[i].k)):
                for user in list(rotated.consumers()):
                    if user.op_type == "Shape":
                        user.replace_input_with(0, unrotated)
        flat = _flat(by_name, (flat_outputs or {}).get(i))
        node = apply_in_place(model, site, layer, plan, lens, heads, cfg["norm_correction"],
                              calibration.keys.get(i) if use else None,
                              calibration.values.get(i) if use and value_offsets else None, kscale,
                              calibration.value_scales.get(i) if use else None, fused.get(i), flat)
        if flat is not None:
            flat_layers.append(i)
        plan.form = f"{site.form}, {FORM}" + (", rotary in the op" if i in fused else "") + (
            ", Q, K and V packed" if node.inputs[1] is None else "") + (", output as the projection reads it" if flat else "")
        done.append((site, node, layer, plan))
    common_passes.RemoveUnusedNodesPass()(model)
    for site, node, layer, plan in done:  # shape readers left of the old caches (TorchScript's reshapes)
        for old, buffer in ((site.present_key, node.outputs[1]), (site.present_value, node.outputs[2])):
            reroute_shapes(old, buffer, lens.total_1d, plan.head_dim, heads_of[layer.index], layer.index)
    common_passes.RemoveUnusedNodesPass()(model)
    for site, node, layer, plan in done:  # then of the past inputs (exporters' past_len: Shape(past)[2])
        for past in (layer.past_key, layer.past_value):
            reroute_shapes(past, past, lens.past_1d(model.graph), plan.head_dim, None, layer.index, skip=node)
    common_passes.RemoveUnusedNodesPass()(model)
    common_passes.TopologicalSortPass()(model)
    model.opset_imports[turboquant.DOMAIN] = turboquant.OPSET_VERSION
    model.opset_imports.setdefault("com.microsoft", 1)
    model.metadata_props.update({
        "turboquant.preset": preset,
        "turboquant.format_version": str(FORMAT_VERSION),
        "turboquant.version": turboquant.__version__,
        "turboquant.cache": FORM,
        **({"turboquant.rotary_positions": str(rotary_positions)} if fused else {}),
        "turboquant.cache_row_bytes": json.dumps({str(p.index): p.row_bytes for p in plans if p.row_bytes}),
        "turboquant.layers": json.dumps([{"layer": p.index, "compressed": p.compressed,
                                          "key_format": p.key_format if packs(p) else None,
                                          "value_format": p.value_format if packs(p) else None,
                                          "norm_correction": bool(cfg["norm_correction"]) if p.compressed else None,
                                          "form": p.form} for p in plans]),
    })
    from .calibrate import calibration_metadata

    model.metadata_props.update(calibration_metadata(calibration, value_offsets, key_scales))
    packed = [p for p in plans if p.row_bytes]
    notes = [f"caches updated in place: buffers of {MAX_LENGTH} rows bound as past and present; sequence lengths from "
             "attention_mask's sums (right padding), the exporter's masks removed",
             "cache rows (bytes per token and KV head, for K and for V, uint8): " + _describe_widths(packed)
             + ("; the others keep float rows of their head size (ONNX Runtime's GroupQueryAttention)"
                if len(packed) < len(plans) else "")]
    if rotary_positions is not None:
        notes.append(_rotary_note(fused, plans, rotary_positions))
    if flat_layers:
        notes.append(f"the attention's output fed to the output projection as it is in {len(flat_layers)} of {len(done)} "
                     "layers (the exporter's reshapes and transposes after it gone: checked on the probe run)")
    packed_layers = [n.name for _, n, _, _ in done if n.inputs[1] is None]
    if packed_layers:
        notes.append(f"Q, K and V from one product in {len(packed_layers)} of {len(done)} layers (the exporter's three "
                     "weights side by side, its reshapes and transposes gone)")
    return RewriteResult(preset, plans, None, notes)



def _rotary_note(fused: dict, plans: list[LayerPlan], positions: int) -> str:
    from .plan import _ranges

    if not fused:
        return ("no rotary embedding of position_ids in a form the attention ops take (rotate-half or ONNX's "
                "RotaryEmbedding, whole head, not interleaved): position embeddings stay where the exporter put them")
    left = [p.index for p in plans if p.index not in fused]
    return (f"rotary embedding inside the attention ops (do_rotary, tables of {positions} positions: the longest "
            "sequence the model takes)" + (f"; layers {_ranges(left)} keep the exporter's" if left else ""))
