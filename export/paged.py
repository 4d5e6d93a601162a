"""The rewrite of onnxruntime-genai models built for its continuous-batching Engine
(`--extra_options use_paged_attention=true`): com.microsoft PagedAttention over pools of KV blocks
becomes turboquant.TQPagedAttention over pools of packed uint8 rows.

The Engine allocates every layer's pools with one shape and one dtype: [num_blocks, block_size,
num_key_value_heads, head_size] of the first past input's type, both numbers from
genai_config.json (src/engine/paged_key_value_cache.cpp). So every pool of the rewritten model is
uint8 [num_blocks, block_size, Hkv, W] with one W: the largest packed size of the compressed
layers' key and value formats (68 bytes for turboquant_4bit_nc at head size 128), genai_config's
head_size. TQPagedAttention treats each block as block_size * Hkv * W opaque bytes and takes a
format whose rows need kv_num_heads * R <= Hkv * W of them, so a boundary layer, kept as raw16
(R = 2 * D, wider than W), is split into n = ceil(Hkv / g) nodes of g = floor(Hkv * W / (2 * D)) KV
heads each, with their query heads, over pools of their own: the first keeps the layer's pool
names, the others take new ones by the model's own template at indices L, L + 1, ... (L the
model's layer count), which genai_config's num_hidden_layers then counts (export/genai.py), so the
Engine allocates, feeds and binds them all. The split nodes' outputs are concatenated back in
head order.

Inputs 0-9 map one to one; PagedAttention's head_sink (11) becomes input 10, and the calibration's
key_offset, value_offset and key_scale follow as in export/gqa.py. PagedAttention's
attention_metadata (16) is dropped (TQPagedAttention reads its lengths on the host) with its graph
input, so the Engine no longer feeds it. Refused by name: slot_mapping, the fused Q/K norm
weights, quantized pools (k_scale/v_scale, k/v_quant_type, k/v_cache_dtype: the builder's
kv_cache_quant_scheme), a latent (MLA) cache layout, rotary_offset, bidirectional attention and a
windowed ring of blocks (block_table_windowed).
"""

from __future__ import annotations

import json
import re

import numpy as np
import onnx_ir as ir

import turboquant
from turboquant.config import FORMAT_VERSION, TQ_PRESETS, packed_size

from .cache_io import _KV_NAMES, CacheLayer
from .errors import RewriteError
from .gqa import BOUNDARY_FORMAT, _attr, calibrated_inputs, node_reading, plan_node_layers, row_width
from .plan import LayerPlan, RewriteResult, _ranges
from .surgery import take_outputs

OP = "PagedAttention"
_NUM_INPUTS = 10  # PagedAttention's inputs that TQPagedAttention takes one to one (query .. sin_cache)
_HEAD_SINK = 11  # PagedAttention's head_sink: TQPagedAttention's input 10
_METADATA = 16  # attention_metadata: dropped
_REFUSED_INPUTS = {10: "slot_mapping", 12: "q_norm_weight (a fused Q/K norm)", 13: "k_norm_weight (a fused Q/K norm)",
                   14: "k_scale", 15: "v_scale"}


def is_paged_node(n: ir.Node) -> bool:
    return n.op_type == OP and n.domain == "com.microsoft"


def uses_paged(model: ir.Model) -> bool:
    return any(is_paged_node(n) for n in model.graph)


def _describe(n: ir.Node) -> str:
    return f"node {n.name!r} (com.microsoft.PagedAttention)"


def paged_node(layer: CacheLayer) -> ir.Node | None:
    """The PagedAttention node that takes this layer's key and value pools, or None."""
    return node_reading(layer, is_paged_node, _describe)


def _text(n: ir.Node, name: str, default: str) -> str:
    v = _attr(n, name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def unsupported_features(n: ir.Node, model: ir.Model | None = None) -> list[str]:
    """What a PagedAttention node uses that TQPagedAttention does not take."""
    found = []
    quantized = []  # the signs of pools the builder quantized already (its kv_cache_quant_scheme)
    for i, name in _REFUSED_INPUTS.items():
        if len(n.inputs) > i and n.inputs[i] is not None:
            (quantized if i in (14, 15) else found).append(f"input {name}")
    if len(n.inputs) > 17:
        quantized.append(f"{len(n.inputs)} inputs")
    for name in ("k_quant_type", "v_quant_type"):
        if _text(n, name, "NONE") != "NONE":
            quantized.append(f"{name}={_text(n, name, 'NONE')}")
    for name in ("k_cache_dtype", "v_cache_dtype"):
        if _text(n, name, "") not in ("", "float16", "bfloat16", "float32"):
            quantized.append(f"{name}={_text(n, name, '')}")
    for i, what in ((3, "key_cache"), (4, "value_cache")):
        v = n.inputs[i] if len(n.inputs) > i else None
        if v is not None and v.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            quantized.append(f"{v.dtype} {what}")
    if quantized:
        found.append(f"quantized pools (the builder's kv_cache_quant_scheme: {', '.join(quantized)}; rewrite the "
                     "model built without it)")
    if _text(n, "kv_cache_layout", "SEPARATE") != "SEPARATE":
        found.append(f"kv_cache_layout={_text(n, 'kv_cache_layout', '')} (a latent cache)")
    if _attr(n, "v_head_size", 0):
        found.append(f"v_head_size={_attr(n, 'v_head_size', 0)}")
    if _attr(n, "rotary_offset", 0):
        found.append(f"rotary_offset={_attr(n, 'rotary_offset', 0)}")
    if not _attr(n, "is_causal", 1):
        found.append("is_causal=0 (bidirectional attention)")
    window, softcap = _attr(n, "local_window_size", -1), _attr(n, "softcap", 0.0)
    if window == 0 or window < -1:
        found.append(f"local_window_size={window}")
    if not (np.isfinite(softcap) and softcap >= 0):
        found.append(f"softcap={softcap}")
    if model is not None and any("windowed" in (v.name or "") for v in model.graph.inputs):
        found.append("a windowed ring of blocks (block_table_windowed)")
    return found


def refuse_unsupported(model: ir.Model) -> None:
    """The first PagedAttention node using what TQPagedAttention does not take, refused by name
    before anything reads the pools (whose int8 or packed int4 type would be refused less clearly)."""
    for n in model.graph:
        if is_paged_node(n):
            found = unsupported_features(n, model)
            if found:
                raise RewriteError(f"{_describe(n)} uses {', '.join(found)}, which TQPagedAttention does not take")


def plan_paged_layers(model: ir.Model, preset: str, boundary: int = 2, skip_layers=None, keep_layers=None
                      ) -> tuple[list[LayerPlan], dict[int, CacheLayer], dict[int, ir.Node]]:
    """plan_layers for a paged model, and each layer's PagedAttention node."""
    plans, layers, nodes = plan_node_layers(model, preset, boundary, skip_layers, keep_layers, paged_node,
                                            "PagedAttention")
    for p in plans:  # the pools' dim 1 is the block size: the heads are the op's
        p.kv_heads = _attr(nodes[p.index], "kv_num_heads", 0) or None
    return plans, layers, nodes


def check_supported(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                    plan: tuple | None = None) -> None:
    """Every refusal of rewrite_paged_model, made before anything slower (the calibration)."""
    plans, _, nodes = plan or plan_paged_layers(model, preset, boundary, skip_layers, keep_layers)
    for p in plans:
        found = unsupported_features(nodes[p.index], model)
        if found:
            raise RewriteError(f"layer {p.index}: {_describe(nodes[p.index])} uses {', '.join(found)}, which "
                               "TQPagedAttention does not take")
    if not any(p.compressed for p in plans):
        raise RewriteError("no layer left to compress: every cache layer is a boundary or kept layer")
    check_width(plans)


def check_width(plans: list[LayerPlan]) -> None:
    """Refuses pools of one width that save nothing: raw16 rows wider than the packed layers' slots make
    every slot as wide as theirs (one KV head of 128: 256 bytes)."""
    width = pool_width(plans)
    before = sum(p.kv_heads * packed_size(BOUNDARY_FORMAT, p.head_dim) for p in plans)
    if pool_bytes(plans, width) >= before:
        raise RewriteError(f"pools of one width ({plans[0].kv_heads} x {width} bytes a slot, the onnxruntime-genai Engine "
                           "allocates one shape) would hold the boundary layers' raw16 rows in no less memory than the "
                           "original cache; rewrite with --boundary 0 (every layer compressed)")


def _pool_pairs(plan: LayerPlan, width: int) -> int:
    """The pool pairs a layer takes at width W: 1 for a compressed one, ceil(Hkv / g) for a raw16 one."""
    return 1 if plan.compressed else -(-plan.kv_heads // heads_per_node(plan, width))


def pool_bytes(plans: list[LayerPlan], width: int) -> int:
    """One token's bytes in the key pools (as many in the value pools) at width W."""
    return sum(p.kv_heads * width * _pool_pairs(p, width) for p in plans)


def pool_width(plans: list[LayerPlan]) -> int:
    """W: the one row width of every pool (the Engine allocates one shape). At least the compressed layers'
    packed rows; among the widths that give a raw16 boundary node g = 1 .. Hkv KV heads, the one of the
    fewest pool bytes a token (turboquant_3bit_nc at Hkv 8, head size 128: 64 bytes, two heads a node, where
    its packed 52 would take eight pool pairs a boundary layer)."""
    least = max(row_width(p.key_format, p.value_format, p.head_dim) for p in plans if p.compressed)
    raw = [p for p in plans if not p.compressed]
    if not raw:
        return least
    hkv, row = raw[0].kv_heads, packed_size(BOUNDARY_FORMAT, raw[0].head_dim)
    widths = {max(least, -(-g * row // hkv)) for g in range(1, hkv + 1)}  # each holds g >= 1 raw16 rows a slot
    return min(widths, key=lambda w: (pool_bytes(plans, w), w))


def heads_per_node(plan: LayerPlan, width: int) -> int:
    """g: the KV heads of one raw16 node of a boundary layer, whose rows (2 * D bytes) must fit the
    Hkv * W bytes of a pool's slot."""
    raw = packed_size(BOUNDARY_FORMAT, plan.head_dim)
    g = min(plan.kv_heads, plan.kv_heads * width // raw)
    if g == 0:
        raise RewriteError(f"layer {plan.index}: a boundary layer keeps raw16 rows of {raw} bytes per KV head, and a "
                           f"pool's slot holds {plan.kv_heads} x {width} bytes (the packed width), less than one row; "
                           "rewrite with --boundary 0 (every layer compressed)")
    return g


def _renamed(name: str, index: int) -> str:
    """A cache name with its layer number replaced by index (past_key_values.3.key -> past_key_values.7.key)."""
    for pat in _KV_NAMES + [re.compile(r"^present\.(?P<layer>\d+)\.(?:key|value)$"),
                            re.compile(r"^present_(?:key|value)[._](?P<layer>\d+)$")]:
        m = pat.match(name)
        if m:
            return name[:m.start("layer")] + str(index) + name[m.end("layer"):]
    raise RewriteError(f"cannot name a new pool after {name!r}: no layer number in it")


def _pool_type(v: ir.Value, heads: int, width: int) -> None:
    dims = list(v.shape) if v.shape is not None and len(v.shape) == 4 else ["num_blocks", "block_size", None, None]
    v.dtype = ir.DataType.UINT8
    v.shape = ir.Shape([dims[0], dims[1], heads, width])


def _const(graph: ir.Graph, before: ir.Node, array: np.ndarray, name: str) -> ir.Value:
    node = ir.node("Constant", [], {"value": ir.tensor(array, name=name)}, name=name)
    graph.insert_before(before, node)
    node.outputs[0].name = name
    return node.outputs[0]


def _slice(graph: ir.Graph, before: ir.Node, x: ir.Value, start: int, end: int, axis: int, name: str) -> ir.Value:
    """x[start:end] along axis (a Slice of constant bounds)."""
    bounds = [_const(graph, before, np.array([b], np.int64), f"{name}_{what}")
              for b, what in ((start, "start"), (end, "end"), (axis, "axis"))]
    node = ir.node("Slice", [x, *bounds], name=name)
    graph.insert_before(before, node)
    node.outputs[0].name = name
    node.outputs[0].dtype = x.dtype
    return node.outputs[0]


def _tq_node(old: ir.Node, inputs: list, name: str, key_format: str, value_format: str, norm_correction: bool,
             heads: tuple[int, int] | None = None) -> ir.Node:
    keep = ("scale", "do_rotary", "rotary_interleaved", "local_window_size", "softcap", "num_heads", "kv_num_heads")
    attrs = {k: a.value for k, a in old.attributes.items() if k in keep}
    if heads:
        attrs["num_heads"], attrs["kv_num_heads"] = heads
    if not attrs.get("scale"):  # the op's default is 1/sqrt of its own head size, which a split keeps
        attrs.pop("scale", None)
    attrs.update(key_format=key_format, value_format=value_format, norm_correction=int(norm_correction))
    while inputs and inputs[-1] is None:
        inputs.pop()
    return ir.node("TQPagedAttention", inputs, attrs, domain=turboquant.DOMAIN, num_outputs=3, name=name)


def _base_inputs(old: ir.Node) -> list:
    inputs = list(old.inputs)[:_NUM_INPUTS]
    inputs += [None] * (_NUM_INPUTS - len(inputs))
    inputs.append(old.inputs[_HEAD_SINK] if len(old.inputs) > _HEAD_SINK else None)
    return inputs


def replace_node(graph: ir.Graph, old: ir.Node, key_format: str, value_format: str, norm_correction: bool,
                 extra: list | None = None) -> ir.Node:
    """One TQPagedAttention in old's place (a compressed layer, or a boundary layer whose raw16 rows fit)."""
    inputs = _base_inputs(old) + list(extra or [])
    new = _tq_node(old, inputs, f"{old.name}/turboquant", key_format, value_format, norm_correction)
    graph.insert_before(old, new)
    take_outputs(graph, old.outputs[:3], new.outputs)
    graph.remove(old, safe=True)
    return new


def split_node(graph: ir.Graph, old: ir.Node, head_dim: int, per_node: int, width: int, first_new: int
               ) -> list[ir.Node]:
    """A boundary layer's PagedAttention as ceil(Hkv / per_node) raw16 TQPagedAttention nodes of
    per_node KV heads each (module docstring), their outputs concatenated; the first over the
    layer's pools, the k-th after it over new pool inputs and outputs at index first_new + k - 1.
    Returns the nodes."""
    hq, hkv = _attr(old, "num_heads", 0), _attr(old, "kv_num_heads", 0)
    rep, d = hq // hkv, head_dim
    packed = len(old.inputs) < 2 or old.inputs[1] is None
    query, sink = old.inputs[0], old.inputs[_HEAD_SINK] if len(old.inputs) > _HEAD_SINK else None
    base = _base_inputs(old)
    pools = [old.inputs[3], old.inputs[4]]
    presents = list(old.outputs[1:3])
    present_names = [o.name for o in presents]  # before the first node takes them
    nodes, outs = [], []
    for j, start in enumerate(range(0, hkv, per_node)):
        g = min(per_node, hkv - start)
        name = f"{old.name}/turboquant_{j}"
        q = _slice(graph, old, query, start * rep * d, (start + g) * rep * d, 1, f"{name}/q")
        if packed:
            k = _slice(graph, old, query, (hq + start) * d, (hq + start + g) * d, 1, f"{name}/k")
            v = _slice(graph, old, query, (hq + hkv + start) * d, (hq + hkv + start + g) * d, 1, f"{name}/v")
        else:
            k = _slice(graph, old, old.inputs[1], start * d, (start + g) * d, 1, f"{name}/k")
            v = _slice(graph, old, old.inputs[2], start * d, (start + g) * d, 1, f"{name}/v")
        if j == 0:
            key_pool, value_pool = pools
        else:
            index = first_new + j - 1
            key_pool, value_pool = (ir.Value(name=_renamed(p.name, index), shape=ir.Shape(list(p.shape)),
                                             type=ir.TensorType(ir.DataType.UINT8)) for p in pools)
            for pool in (key_pool, value_pool):
                _pool_type(pool, hkv, width)
            graph.inputs.extend([key_pool, value_pool])
        head_sink = None if sink is None else _slice(graph, old, sink, start * rep, (start + g) * rep, 0, f"{name}/sink")
        inputs = [q, k, v, key_pool, value_pool, *base[5:10], head_sink]
        node = _tq_node(old, inputs, name, BOUNDARY_FORMAT, BOUNDARY_FORMAT, True, (g * rep, g))
        graph.insert_before(old, node)
        if j == 0:
            take_outputs(graph, presents, node.outputs[1:3])
        else:
            for o, name in zip(node.outputs[1:3], present_names):
                o.name = _renamed(name, first_new + j - 1)
                graph.outputs.append(o)
        for o in node.outputs[1:3]:
            _pool_type(o, hkv, width)
        node.outputs[0].dtype = query.dtype
        nodes.append(node)
        outs.append(node.outputs[0])
    concat = ir.node("Concat", outs, {"axis": 1}, name=f"{old.name}/turboquant_concat")
    graph.insert_before(old, concat)
    concat.outputs[0].dtype = query.dtype
    take_outputs(graph, old.outputs[:1], concat.outputs)
    graph.remove(old, safe=True)
    return nodes


def _drop_metadata(graph: ir.Graph) -> bool:
    """attention_metadata's graph input, removed where nothing reads it any more."""
    dropped = False
    for v in list(graph.inputs):
        if v.name == "attention_metadata" and not v.uses():
            graph.inputs.remove(v)
            dropped = True
    return dropped


def rewrite_paged_model(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                        calibration=None, value_offsets: bool = False, key_scales: bool = True,
                        plan: tuple | None = None) -> RewriteResult:
    """Rewrites a paged model in place (module docstring); returns what was done, with pool_pairs
    (genai_config's num_hidden_layers) and row_bytes W (its head_size)."""
    plans, layers, nodes = plan or plan_paged_layers(model, preset, boundary, skip_layers, keep_layers)
    check_supported(model, preset, plan=(plans, layers, nodes))
    cfg = TQ_PRESETS[preset]
    width = pool_width(plans)
    graph = model.graph
    next_pool = max(layers) + 1
    notes = []
    for p in plans:
        node = nodes[p.index]
        layer = layers[p.index]
        p.row_bytes = width
        heads = p.kv_heads
        if p.compressed:
            p.form = "PagedAttention"
            extra = None
            if calibration is not None and p.index in calibration.keys:
                extra = calibrated_inputs(model, p.index, calibration, value_offsets=value_offsets, key_scales=key_scales)
            new = replace_node(graph, node, p.key_format, p.value_format, cfg["norm_correction"], extra)
            outputs = new.outputs[1:3]
        else:
            p.key_format = p.value_format = BOUNDARY_FORMAT
            g = heads_per_node(p, width)
            split = split_node(graph, node, p.head_dim, g, width, next_pool)
            p.pools = len(split)
            next_pool += len(split) - 1
            p.form = "PagedAttention" if len(split) == 1 else f"PagedAttention, split in {len(split)} (KV heads {g} per node)"
            outputs = split[0].outputs[1:3]
        for v in (layer.past_key, layer.past_value, *outputs):
            _pool_type(v, heads, width)
    _drop_metadata(graph)
    model.opset_imports[turboquant.DOMAIN] = turboquant.OPSET_VERSION
    split = [p for p in plans if p.pools > 1]
    notes.append(f"pools: uint8 [num_blocks, block_size, {plans[0].kv_heads}, {width}] for every layer (the onnxruntime-genai "
                 f"Engine allocates one shape; head_size {width}), {next_pool} pool pairs")
    if split:
        notes.append(f"layers {_ranges([p.index for p in split])} (raw16, {2 * split[0].head_dim} bytes per KV head) split "
                     f"over {split[0].pools} pool pairs each, pools {max(layers) + 1}-{next_pool - 1} new")
    model.metadata_props.update({
        "turboquant.preset": preset,
        "turboquant.format_version": str(FORMAT_VERSION),
        "turboquant.version": turboquant.__version__,
        "turboquant.cache_row_bytes": json.dumps({str(p.index): width for p in plans}),
        "turboquant.pool_pairs": str(next_pool),
        "turboquant.layers": json.dumps([{"layer": p.index, "compressed": p.compressed, "key_format": p.key_format,
                                          "value_format": p.value_format,
                                          "norm_correction": bool(cfg["norm_correction"]) if p.compressed else None,
                                          "form": p.form, "pools": p.pools} for p in plans]),
    })
    from .calibrate import calibration_metadata

    model.metadata_props.update(calibration_metadata(calibration, value_offsets, key_scales))
    return RewriteResult(preset, plans, None, notes, row_bytes=width, pool_pairs=next_pool)
