"""The rewrite of onnxruntime-genai models: com.microsoft GroupQueryAttention over a shared,
preallocated cache becomes turboquant.TQGroupQueryAttention over packed uint8 caches.

Each layer's K and V rows get one byte width W (the op takes past_key and past_value of the same
shape): compressed layers the larger of their key and value formats' packed sizes, boundary and
kept layers raw16 (their fp16 bits, exact for fp16 models), 2 * head_size. The packed sizes are
always even, and multiples of 4 for the power-of-two head sizes the CUDA tensor-core kernels serve
(which want value rows of whole words and key rows of 2-byte ones), so no row is padded; the CUDA
ops' 4-byte alignment is of the buffers' start, which ORT's and genai's allocations meet. The cache
inputs and outputs declare their concrete KV heads (dim 1) and W (dim 3), from which
onnxruntime-genai (0.14.0 and later, export/genai.py) allocates each layer's buffer; with an older
genai installed, every layer gets the widest W (genai then allocates one shape for all layers), and
the summary says so.
onnxruntime-genai takes one dtype for every cache (that of the first past input), so all of them
are uint8. Sliding windows (local_window_size), softcap and head sinks (input 11) are kept: the op
takes them as GroupQueryAttention does. Window-sized caches (sliding_window_cache = 1, what genai
0.18's builder writes for windowed layers on the CPU and CUDA: a buffer of C >= W rows that the op
compacts as the window moves) stay window-sized with window_cache (the op keeps the attribute, the
cache inputs their `*sliding*` length axis, and export/genai.py genai_config.json's sliding_window
section, so genai allocates those layers C rows of the packed width); without it (an older genai, a
CUDA build, TensorRT) they become full-length ones, rows by position as in every other layer: the
attribute dropped and the layer's cache length named as the full layers' (export/genai.py drops the
section, so genai allocates max_length rows for every layer); the op still reads only the window's
rows. smooth_softmax becomes a head_sink of zeros (ONNX Runtime's definition: a sink of 0 in every
head's denominator). Nodes with features the op lacks (attention bias, QK output, quantized caches)
are refused, or with unsupported="leave" kept as they
are (the model then mixes cache dtypes and is no longer loadable by onnxruntime-genai, which the
summary says).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

import turboquant
from turboquant.config import FORMAT_VERSION, TQ_PRESETS, packed_size

from .cache_io import CacheLayer
from .errors import RewriteError
from .plan import LayerPlan, RewriteResult, _ranges, plan_layers
from .qk_norm import fused_norm_problem, has_fused_qk_norm, unfuse_qk_norm
from .surgery import _initializer, take_outputs

BOUNDARY_FORMAT = "raw16"
_NUM_INPUTS = 12  # GroupQueryAttention's inputs, up to head_sink; key_offset, value_offset, key_scale follow
_HEAD_SINK = 11
# (its later ones: 12, 13 k_scale, v_scale; 14, 15 q_norm_weight, k_norm_weight, unfused by export/qk_norm.py;
# 16 query_seqlens)
_PASS = {"Cast", "Identity"}


def is_gqa_node(n: ir.Node) -> bool:
    return n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"


def uses_gqa(model: ir.Model) -> bool:
    return any(is_gqa_node(n) for n in model.graph)


def refuse_fused_attention(model: ir.Model) -> None:
    """ONNX Runtime's fused attention contrib ops other than GroupQueryAttention (onnxruntime-genai's
    builder writes MultiHeadAttention for fp16 on the CPU, with the caches concatenated outside the
    op and a symbolic head size; ORT's transformer optimizer writes both) are not rewritten: refused
    by name rather than by the symptom the exporter-pattern path would meet first."""
    if uses_gqa(model):
        return
    for n in model.graph:
        if n.domain == "com.microsoft" and n.op_type in ("MultiHeadAttention", "Attention"):
            raise RewriteError(
                f"node {n.name!r} is com.microsoft.{n.op_type}, which turboquant does not rewrite (onnxruntime-genai's "
                "builder writes it for fp16 on the CPU, ORT's transformer optimizer for fused models); rewrite the "
                "builder's GroupQueryAttention models (-p fp32 or int4 with -e cpu, or -e cuda) or the exporter's "
                "model before optimization")


def _attr(n: ir.Node, name: str, default):
    a = n.attributes.get(name)
    return default if a is None else a.value


def _describe(n: ir.Node) -> str:
    return f"node {n.name!r} (com.microsoft.GroupQueryAttention)"


def gqa_node(layer: CacheLayer) -> ir.Node | None:
    """The GroupQueryAttention node that takes this layer's past_key and past_value, or None."""
    return node_reading(layer, is_gqa_node, _describe)


def node_reading(layer: CacheLayer, is_node, describe) -> ir.Node | None:
    """The node (is_node) that takes this layer's past key and value as its inputs 3 and 4, or None."""
    for n in layer.past_key.consumers():
        if is_node(n) and len(n.inputs) > 4 and n.inputs[3] is layer.past_key:
            if n.inputs[4] is not layer.past_value:
                raise RewriteError(f"layer {layer.index}: {describe(n)} takes {layer.past_key.name!r} "
                                   f"but not {layer.past_value.name!r}")
            return n
    return None


def _last_dim(v: ir.Value | None) -> int | None:
    """The static size of v's last axis, from its shape or from the MatMul that makes it."""
    for _ in range(8):
        if v is None:
            return None
        if v.shape is not None and len(v.shape) and isinstance(v.shape[-1], int):
            return v.shape[-1]
        p = v.producer()
        if p is None:
            return None
        if p.op_type == "MatMul" and p.inputs[1] is not None and p.inputs[1].shape is not None:
            d = p.inputs[1].shape[-1]
            return d if isinstance(d, int) else None
        if p.op_type == "MatMulNBits" and p.domain == "com.microsoft":
            return _attr(p, "N", None)
        if p.op_type == "Add":  # a bias after the projection: either input gives the width
            v = p.inputs[0] if p.inputs[0] is not None and p.inputs[0].const_value is None else p.inputs[1]
        elif p.op_type in _PASS:
            v = p.inputs[0]
        else:
            return None
    return None


def head_dim(n: ir.Node) -> int | None:
    hq, hkv = _attr(n, "num_heads", 0), _attr(n, "kv_num_heads", 0)
    packed = len(n.inputs) < 2 or n.inputs[1] is None
    if packed:
        width, heads = _last_dim(n.inputs[0]), hq + 2 * hkv
    else:
        width, heads = _last_dim(n.inputs[1]), hkv
    if not width or not heads or width % heads:
        return None
    return width // heads


def unsupported_features(n: ir.Node) -> list[str]:
    found = []
    window, softcap = _attr(n, "local_window_size", -1), _attr(n, "softcap", 0.0)
    if window == 0 or window < -1:
        found.append(f"local_window_size={window}")
    if not (np.isfinite(softcap) and softcap >= 0):
        found.append(f"softcap={softcap}")
    if _attr(n, "qk_output", 0) or (len(n.outputs) > 3 and n.outputs[3].uses()):
        found.append("the QK output")
    names = {10: "attention_bias", 12: "k_scale (a quantized cache)", 13: "v_scale (a quantized cache)",
             16: "query_seqlens (right-padded query chunks)"}
    for i, name in names.items():
        if len(n.inputs) > i and n.inputs[i] is not None:
            found.append(f"input {name}")
    if len(n.inputs) > 17:
        found.append(f"{len(n.inputs)} inputs (the schema this rewrite knows has 17)")
    if has_fused_qk_norm(n) and fused_norm_problem(n):
        found.append(fused_norm_problem(n))
    if _attr(n, "sliding_window_cache", 0) and _attr(n, "local_window_size", -1) <= 0:
        found.append("sliding_window_cache without a local_window_size")
    if _attr(n, "k_quant_type", "NONE") not in ("NONE", b"NONE") or _attr(n, "v_quant_type", "NONE") not in ("NONE", b"NONE"):
        found.append("k_quant_type/v_quant_type (a quantized cache)")
    if not _attr(n, "causal", 1):
        found.append("causal=0 (bidirectional attention)")
    if n.inputs[3] is not None and n.inputs[3].dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        found.append(f"a {n.inputs[3].dtype} cache")
    return found


def _retype(v: ir.Value, heads: int, width: int, length=None) -> None:
    """uint8 rows of `width` bytes; length (where given) names the sequence axis."""
    dims = list(v.shape) if v.shape is not None and len(v.shape) == 4 else [None, None, None, None]
    v.dtype = ir.DataType.UINT8
    v.shape = ir.Shape([dims[0], heads or dims[1], dims[2] if length is None else length, width])


def _full_lengths(layers: dict[int, CacheLayer], nodes: dict[int, ir.Node]) -> tuple:
    """The (past, present) sequence axes of a layer without a window-sized cache, which the rewritten
    window-sized ones take (None where no such layer names them)."""
    for i, n in nodes.items():
        if not _attr(n, "sliding_window_cache", 0):
            dims = [v.shape[2] if v.shape is not None and len(v.shape) == 4 else None
                    for v in (layers[i].past_key, n.outputs[1])]
            return tuple(dims)
    return None, None


def row_width(key_format: str, value_format: str, head_dim: int) -> int:
    """W of a layer: both caches take the larger of the two formats' packed sizes."""
    return max(packed_size(key_format, head_dim), packed_size(value_format, head_dim))


def _replace(graph: ir.Graph, old: ir.Node, key_format: str, value_format: str, norm_correction: bool,
             extra: list | None = None, window_cache: bool = False) -> ir.Node:
    """extra: the inputs to append after GroupQueryAttention's (key_offset, value_offset, key_scale).
    window_cache: window-sized buffers stay so, else they become full-length ones (module docstring)."""
    inputs = list(old.inputs)[:_NUM_INPUTS]
    inputs += [None] * (_NUM_INPUTS - len(inputs))
    if _attr(old, "smooth_softmax", 0) and inputs[_HEAD_SINK] is None:
        # ONNX Runtime's smooth_softmax is a sink of 0 in every head's denominator (a head_sink, when
        # given, takes its place)
        zeros = np.zeros(_attr(old, "num_heads", 0), old.inputs[0].dtype.numpy())
        inputs[_HEAD_SINK] = ir.Value(name=f"{old.name}/smooth_softmax_sink", const_value=ir.tensor(zeros))
        graph.register_initializer(inputs[_HEAD_SINK])
    if extra:
        inputs += list(extra)
    while inputs and inputs[-1] is None:
        inputs.pop()
    dropped = {"smooth_softmax"} | (set() if window_cache else {"sliding_window_cache"})
    attrs = {name: a.value for name, a in old.attributes.items() if name not in dropped}
    attrs.update(key_format=key_format, value_format=value_format, norm_correction=int(norm_correction))
    new = ir.node("TQGroupQueryAttention", inputs, attrs, domain=turboquant.DOMAIN, num_outputs=3,
                  name=f"{old.name}/turboquant")
    graph.insert_before(old, new)
    take_outputs(graph, old.outputs[:3], new.outputs)
    graph.remove(old, safe=True)
    return new


def calibrated_inputs(model: ir.Model, index: int, calibration, *, value_offsets: bool,
                      key_scales: bool) -> list[ir.Value | None]:
    """The initializers to append to the layer's TQGroupQueryAttention inputs (after its twelve of
    GroupQueryAttention): key_offset, value_offset (value_offsets) and key_scale, empty where absent;
    the offset in the scaled keys' units. calibration: export.calibrate.Calibration, measured by
    export/calibrate_gqa.py."""
    koff = calibration.keys.get(index)
    voff = calibration.values.get(index) if value_offsets else None
    s = calibration.key_scales.get(index) if key_scales else None
    if s is not None and koff is not None:
        koff = koff / s
    named = (("key_offset", koff), ("value_offset", voff), ("key_scale", s))
    extra = [None if x is None else _initializer(model, f"tq_{name}_{index}", x.astype(np.float32)) for name, x in named]
    while extra and extra[-1] is None:
        extra.pop()
    return extra


def plan_gqa_layers(model: ir.Model, preset: str, boundary: int = 2, skip_layers=None, keep_layers=None
                    ) -> tuple[list[LayerPlan], dict[int, CacheLayer], dict[int, ir.Node]]:
    """plan_layers for a GroupQueryAttention model, and each layer's GroupQueryAttention node."""
    return plan_node_layers(model, preset, boundary, skip_layers, keep_layers, gqa_node, "GroupQueryAttention")


def plan_node_layers(model: ir.Model, preset: str, boundary, skip_layers, keep_layers, find, op: str
                     ) -> tuple[list[LayerPlan], dict[int, CacheLayer], dict[int, ir.Node]]:
    """plan_layers for a model whose every cache layer is read by one `op` node (find(layer): that node,
    or None), and each layer's node."""
    nodes: dict[int, ir.Node] = {}

    def head_dim_of(layer: CacheLayer) -> int | None:
        n = find(layer)
        if n is None:
            return None
        nodes[layer.index] = n
        d = head_dim(n)
        if d is None:
            raise RewriteError(f"layer {layer.index}: cannot tell the head size of {_describe(n)}: its query input's last "
                               "axis is neither static nor made by a MatMul with a constant weight")
        return d

    plans, layers = plan_layers(model, preset, boundary, skip_layers, keep_layers, head_dim_of)
    others = sorted(set(layers) - set(nodes))
    if others:
        raise RewriteError(f"layers {others} are not read by {op} while layers {sorted(nodes)} are; "
                           "a model that mixes attention forms is not supported")
    return plans, layers, nodes


def _refused(plan: LayerPlan, node: ir.Node, found: list[str]) -> RewriteError:
    return RewriteError(f"layer {plan.index}: {_describe(node)} uses {', '.join(found)}, which "
                        "TQGroupQueryAttention does not support (unsupported='leave' keeps such layers as they are)")


def check_supported(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                    unsupported: str = "refuse", plan: tuple | None = None) -> None:
    """The refusals of rewrite_gqa_model, made before anything slower (calibration runs the original
    model first): a model it would refuse is refused at once. plan: plan_gqa_layers of `model` with these
    options, where the caller has it (None: planned here)."""
    plans, _, nodes = plan or plan_gqa_layers(model, preset, boundary, skip_layers, keep_layers)
    for plan in plans:
        found = unsupported_features(nodes[plan.index])
        if found and unsupported == "refuse":
            raise _refused(plan, nodes[plan.index], found)


def unsupported_layers(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None
                       ) -> dict[int, list[str]]:
    """Each layer whose GroupQueryAttention uses features TQGroupQueryAttention lacks: what it uses."""
    plans, _, nodes = plan_gqa_layers(model, preset, boundary, skip_layers, keep_layers)
    found = {p.index: unsupported_features(nodes[p.index]) for p in plans}
    return {i: f for i, f in found.items() if f}


def refuse_mixed_genai_folder(left: dict[int, list[str]]) -> None:
    """onnxruntime-genai (0.18 included) allocates every layer's cache in one dtype (its first past
    input's), so a folder whose left layers keep float caches beside uint8 ones cannot run: refused."""
    if not left:
        return
    uses = sorted({f for fs in left.values() for f in fs})
    raise RewriteError(f"layers {_ranges(sorted(left))} use {', '.join(uses)}, which TQGroupQueryAttention does not support; "
                       "left as they are they keep float caches beside the rewritten layers' uint8 ones, and "
                       "onnxruntime-genai allocates every layer's cache in one dtype, so the folder could not run "
                       "(rewrite the model file alone, without its genai_config.json beside it, for ONNX Runtime)")


def rewrite_gqa_model(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                      unsupported: str = "refuse", per_layer: bool | None = None, calibration=None,
                      value_offsets: bool = False, key_scales: bool = True, plan: tuple | None = None,
                      window_cache: bool = False) -> RewriteResult:
    """Rewrites a GroupQueryAttention model in place (module docstring); returns what was done.

    calibration (export.calibrate.Calibration, from export/calibrate_gqa.py): per compressed layer
    the mean rotated key, fed to the op as key_offset (the mean value as value_offset too when
    value_offsets), and the per-channel key scales as its key_scale (unless key_scales is False).

    per_layer: give each layer its own row width (True) or every layer the widest (False); None
    decides by the installed onnxruntime-genai (export/genai.py reads_per_layer_shapes).
    plan: plan_gqa_layers of `model` with these options, where the caller has it (None: planned here).
    window_cache: window-sized caches (sliding_window_cache) stay window-sized, else they become
    full-length (module docstring; export/genai.py keeps_window_cache decides for genai folders)."""
    if unsupported not in ("refuse", "leave"):
        raise RewriteError(f"unsupported must be 'refuse' or 'leave', got {unsupported!r}")
    plans, layers, nodes = plan or plan_gqa_layers(model, preset, boundary, skip_layers, keep_layers)
    cfg = TQ_PRESETS[preset]
    left, notes = [], []
    for plan in plans:
        node = nodes[plan.index]
        found = unsupported_features(node)
        if found and unsupported == "refuse":
            raise _refused(plan, node, found)
        if found:
            left.append(plan.index)
            plan.compressed = False
            plan.form = f"GroupQueryAttention, left as it was ({', '.join(found)})"
            continue
        plan.form = "GroupQueryAttention"
        if unfuse_qk_norm(node):  # genai's CUDA builds: the norm before the op, as its CPU builds have it
            plan.form = "GroupQueryAttention, its fused Q/K norm unfused"
        if not plan.compressed:
            plan.key_format = plan.value_format = BOUNDARY_FORMAT
    rewritten = [p for p in plans if p.index not in left]
    if not any(p.compressed for p in rewritten):
        raise RewriteError("no layer left to compress: every cache layer is a boundary, kept or unsupported layer")
    genai_note = None
    if per_layer is None:
        from .genai import reads_per_layer_shapes

        per_layer, genai_note = reads_per_layer_shapes()
    widths = {p.index: row_width(p.key_format, p.value_format, p.head_dim) for p in rewritten}
    if not per_layer:
        widths = dict.fromkeys(widths, max(widths.values()))
    graph = model.graph
    past_length, present_length = _full_lengths(layers, nodes)
    windowed = [p.index for p in rewritten if _attr(nodes[p.index], "sliding_window_cache", 0)]
    for plan in rewritten:
        plan.row_bytes = widths[plan.index]
        node = nodes[plan.index]
        heads = _attr(node, "kv_num_heads", 0)
        full = plan.index in windowed and not window_cache
        plan.kv_heads = plan.kv_heads or heads or None  # the op's attribute where the cache inputs leave it symbolic
        extra = None
        if calibration is not None and plan.compressed and plan.index in calibration.keys:
            extra = calibrated_inputs(model, plan.index, calibration, value_offsets=value_offsets, key_scales=key_scales)
        node = _replace(graph, node, plan.key_format, plan.value_format, cfg["norm_correction"], extra, window_cache)
        layer = layers[plan.index]
        for v in (layer.past_key, layer.past_value):
            _retype(v, heads, plan.row_bytes, past_length if full else None)
        for v in node.outputs[1:3]:
            _retype(v, heads, plan.row_bytes, present_length if full else None)
    model.opset_imports[turboquant.DOMAIN] = turboquant.OPSET_VERSION
    notes.append("cache rows (bytes per token and KV head, for K and for V): " + _describe_widths(rewritten))
    if windowed and window_cache:
        notes.append(f"layers {_ranges(windowed)}: window-sized caches (sliding_window_cache) kept: onnxruntime-genai "
                     "allocates them C rows of the packed width (the window plus a slack, whatever the context); the "
                     "per-token sizes above are per row")
    elif windowed:
        notes.append(f"layers {_ranges(windowed)}: window-sized caches (sliding_window_cache) made full-length, rows by "
                     "position; the op reads only each window's rows, but their memory grows with the context (the "
                     "per-token sizes above count them as full-length in the original too)")
    if genai_note:
        notes.append(f"  {genai_note}")
    if not per_layer:
        packed = max(row_width(p.key_format, p.value_format, p.head_dim) for p in rewritten if p.compressed)
        if max(widths.values()) > packed:
            notes.append(f"  one width for every layer: the packed layers need only {packed} (--boundary 0, or "
                         "onnxruntime-genai 0.14.0 or later when rewriting, gives them that)")
    if left:
        notes.append(f"layers {left} were left as GroupQueryAttention with float caches: the model mixes cache dtypes, "
                     "which onnxruntime-genai cannot allocate")
    model.metadata_props.update({
        "turboquant.preset": preset,
        "turboquant.format_version": str(FORMAT_VERSION),
        "turboquant.version": turboquant.__version__,
        "turboquant.cache_row_bytes": json.dumps({str(p.index): p.row_bytes for p in rewritten}),
        "turboquant.layers": json.dumps([{"layer": p.index, "compressed": p.compressed,
                                          "key_format": p.key_format if p.index not in left else None,
                                          "value_format": p.value_format if p.index not in left else None,
                                          "norm_correction": bool(cfg["norm_correction"]) if p.compressed else None,
                                          "form": p.form} for p in plans]),
    })
    from .calibrate import calibration_metadata

    model.metadata_props.update(calibration_metadata(calibration, value_offsets, key_scales))
    return RewriteResult(preset, plans, None, notes, row_bytes=max(widths.values()), left=left,
                         window_cache=sorted(windowed) if window_cache else [])


def _describe_widths(plans) -> str:
    """'layers 0-1, 4-5: 128 (raw16); layers 2-3: 36 (mse4/uint4)', widest first."""
    groups: dict[tuple[int, str], list[int]] = {}
    for p in plans:
        fmt = p.key_format if p.key_format == p.value_format else f"{p.key_format}/{p.value_format}"
        groups.setdefault((p.row_bytes, fmt), []).append(p.index)
    return "; ".join(f"layers {_ranges(ix)}: {w} ({fmt})" for (w, fmt), ix in sorted(groups.items(), key=lambda g: -g[0][0]))
