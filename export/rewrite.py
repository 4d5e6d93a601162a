"""The rewrite: replace the attention of compressed layers by TQAttention over a packed uint8 cache."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes

import turboquant
from turboquant.config import FORMAT_VERSION, TQ_PRESETS, TurboQuantConfig, packed_size

from .cache_io import CacheLayer, find_cache_layers, layer_infos
from .errors import RewriteError
from .forms import AttentionSite, locate

_SAFE_SHAPE_AXES = (0, 1, 2)  # batch, kv heads, sequence: the same for a packed cache


@dataclasses.dataclass
class LayerPlan:
    index: int
    compressed: bool
    form: str | None
    key_format: str
    value_format: str
    kv_heads: int | None
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_before(self) -> int | None:
        return None if self.kv_heads is None else 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_after(self) -> int | None:
        if self.kv_heads is None:
            return None
        if not self.compressed:
            return self.bytes_before
        return self.kv_heads * (packed_size(self.key_format, self.head_dim) + packed_size(self.value_format, self.head_dim))


@dataclasses.dataclass
class RewriteResult:
    preset: str
    layers: list[LayerPlan]
    output: pathlib.Path | None

    @property
    def compressed(self) -> list[int]:
        return [p.index for p in self.layers if p.compressed]

    @property
    def kept(self) -> list[int]:
        return [p.index for p in self.layers if not p.compressed]

    def summary(self) -> str:
        before = [p.bytes_before for p in self.layers]
        after = [p.bytes_after for p in self.layers]
        lines = [
            f"preset {self.preset}: {len(self.compressed)} of {len(self.layers)} layers compressed",
            f"  compressed: {_ranges(self.compressed) or 'none'}",
            f"  kept as they were: {_ranges(self.kept) or 'none'}",
            f"  forms: {', '.join(sorted({p.form for p in self.layers if p.form}))}",
        ]
        if None not in before:
            ratio = sum(before) / sum(after)
            lines.append(f"  KV cache per token (all layers, batch 1): {sum(before)} bytes before, {sum(after)} after, {ratio:.2f}x smaller")
        else:
            lines.append("  KV cache per token: unknown (the cache inputs have a symbolic head count)")
        if self.output:
            lines.append(f"  written to {self.output}")
        return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _dtype_bytes(v: ir.Value) -> int:
    return {ir.DataType.FLOAT: 4, ir.DataType.FLOAT16: 2, ir.DataType.BFLOAT16: 2}[v.dtype]


def plan_layers(model: ir.Model, preset: str, boundary: int = 2, skip_layers=None, keep_layers=None) -> tuple[list[LayerPlan], dict[int, CacheLayer]]:
    if preset not in TQ_PRESETS:
        raise RewriteError(f"unknown preset {preset!r}: valid presets are {', '.join(TQ_PRESETS)}")
    layers = find_cache_layers(model.graph)
    infos = layer_infos(model.graph, layers)
    if keep_layers is not None:
        kept = set(keep_layers)
    else:
        kept = set(TurboQuantConfig.get_boundary_skip_layers(infos, boundary))
    kept |= set(skip_layers or ())
    unknown = sorted(kept - set(layers))
    if unknown:
        raise RewriteError(f"--skip-layers/--keep-layers name layers without a KV cache: {unknown} (cache layers: {_ranges(sorted(layers))})")
    plans = []
    for i, layer in layers.items():
        cfg = TurboQuantConfig.from_cache_dtype(preset, layer.head_dim)
        plans.append(LayerPlan(i, i not in kept, None, cfg.key_format, cfg.value_format, layer.kv_heads, layer.head_dim,
                               _dtype_bytes(layer.past_key)))
    return plans, layers


def _shape_only_uses_are_safe(v: ir.Value) -> ir.Node | None:
    """A Shape consumer that might read the last axis (whose size packing changes), or None."""
    for n in v.consumers():
        if n.op_type != "Shape":
            continue
        end = n.attributes.get("end")
        if end is not None and 0 <= end.value <= 3:
            continue
        for u in n.outputs[0].consumers():
            idx = ir.convenience.get_const_tensor(u.inputs[1]) if u.op_type == "Gather" and len(u.inputs) > 1 else None
            if idx is None or any(int(i) not in _SAFE_SHAPE_AXES for i in idx.numpy().reshape(-1)):
                return n
    return None


def _packed_type(v: ir.Value, nbytes: int) -> None:
    dims = list(v.shape) if v.shape is not None else [None, None, None, None]
    v.dtype = ir.DataType.UINT8
    v.shape = ir.Shape([*dims[:3], nbytes])


def _replace_graph_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """new takes old's place (and name) among the graph outputs; old's other readers stay on it."""
    name = old.name
    for i, o in enumerate(graph.outputs):
        if o is old:
            graph.outputs[i] = new
    old.name = f"{name}_replaced"
    new.name = name


def _initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(value)
    return value


def apply_site(model: ir.Model, site: AttentionSite, layer: CacheLayer, plan: LayerPlan, norm_correction: bool,
               key_offset: np.ndarray | None = None, value_offset: np.ndarray | None = None) -> ir.Node:
    graph = site.anchor.graph
    attrs = {"key_format": plan.key_format, "value_format": plan.value_format, "norm_correction": int(norm_correction),
             "is_causal": int(site.is_causal)}
    if site.scale:
        attrs["scale"] = float(site.scale)
    if site.q_num_heads:
        attrs["q_num_heads"] = int(site.q_num_heads)
    if site.kv_num_heads:
        attrs["kv_num_heads"] = int(site.kv_num_heads)
    inputs = [site.q, site.k_new, site.v_new, site.mask, layer.past_key, layer.past_value]
    if key_offset is not None or value_offset is not None:
        zeros = np.zeros((key_offset if key_offset is not None else value_offset).shape, np.float32)
        inputs.append(_initializer(model, f"tq_key_offset_{layer.index}", key_offset if key_offset is not None else zeros))
        if value_offset is not None:
            inputs.append(_initializer(model, f"tq_value_offset_{layer.index}", value_offset))
    node = ir.node("TQAttention", inputs, attributes=attrs, domain=turboquant.DOMAIN, num_outputs=3,
                   name=f"tq_attention_{layer.index}")
    graph.insert_before(site.anchor, node)
    y, pk_out, pv_out = node.outputs
    y.name = f"tq_attention_{layer.index}_y"
    if site.y_cast_to is not None:  # the original attended in another type than Q's: keep its output type
        cast = ir.node("Cast", [y], {"to": ir.DataType(site.y_cast_to)}, name=f"tq_attention_{layer.index}_cast")
        graph.insert_after(node, cast)
        y = cast.outputs[0]
        y.name = f"tq_attention_{layer.index}_y_cast"
    if site.y.dtype is not None:  # TorchScript exports often leave intermediate values untyped
        y.dtype, y.shape = site.y.dtype, site.y.shape
    if site.y.is_graph_output():
        _replace_graph_output(graph, site.y, y)
    site.y.replace_all_uses_with(y)
    for old, new, past, nbytes in ((site.present_key, pk_out, layer.past_key, packed_size(plan.key_format, plan.head_dim)),
                                   (site.present_value, pv_out, layer.past_value, packed_size(plan.value_format, plan.head_dim))):
        new.shape = old.shape
        if old.is_graph_output():
            _replace_graph_output(graph, old, new)
        else:
            new.name = f"tq_attention_{layer.index}_{'present_key' if new is pk_out else 'present_value'}"
        _packed_type(new, nbytes)
        _packed_type(past, nbytes)
    return node


def _reroute_cache_shapes(site: AttentionSite, node: ir.Node, head_dim: int) -> None:
    """Shape computations that still read the float cache (or its repeat over query heads) after
    the attention is gone, e.g. the output reshape of TorchScript exports, are given the same
    numbers from the packed cache: batch, heads and length from its shape, the head size as a
    constant, and the query head count from Q's shape."""
    for old, new in ((site.present_key, node.outputs[1]), (site.present_value, node.outputs[2])):
        frontier, chain = [(old, False)], []
        while frontier:
            v, repeated = frontier.pop()
            for user in list(v.consumers()):
                if user.op_type in _REPEAT_CHAIN:
                    frontier.append((user.outputs[0], repeated or user.op_type == "Reshape"))
                elif user.op_type == "Shape" and not user.attributes:
                    chain.append((user, repeated, len(v.shape) if v.shape is not None else None))
                else:
                    raise RewriteError(f"layer {site.layer}: {user.name!r} ({user.op_type}) still reads the float cache "
                                       f"{old.name!r} after its attention was replaced")
        for shape_node, repeated, rank in chain:
            for g in list(shape_node.outputs[0].consumers()):
                idx = ir.convenience.get_const_tensor(g.inputs[1]) if g.op_type == "Gather" and len(g.inputs) > 1 else None
                axis = g.attributes.get("axis")
                if idx is None or (axis is not None and axis.value != 0) or idx.numpy().size != 1:
                    raise RewriteError(f"layer {site.layer}: {g.name!r} ({g.op_type}) reads the shape of the float cache "
                                       f"{old.name!r} in a way turboquant cannot re-derive")
                i = int(idx.numpy().reshape(-1)[0])
                i = i + 4 if i < 0 else i
                graph = g.graph
                if i == 3:
                    value = ir.node("Constant", [], {"value": ir.tensor(np.full(idx.numpy().shape, head_dim, np.int64))}, name=f"{g.name}_tq")
                    graph.insert_before(g, value)
                else:
                    source = site.q if (i == 1 and repeated) else new
                    shp = ir.node("Shape", [source], name=f"{g.name}_tq_shape")
                    value = ir.node("Gather", [shp.outputs[0], g.inputs[1]], {"axis": 0}, name=f"{g.name}_tq")
                    graph.insert_before(g, shp)
                    graph.insert_before(g, value)
                value.outputs[0].name = f"{g.outputs[0].name}_tq"
                g.outputs[0].replace_all_uses_with(value.outputs[0])


_REPEAT_CHAIN = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Cast", "Identity"}


def _owning_if(model: ir.Model, graph: ir.Graph) -> tuple[ir.Node, str] | None:
    """The If node whose then_branch or else_branch is `graph`, and which one."""
    for n in ir.traversal.RecursiveGraphIterator(model.graph):
        if n.op_type != "If":
            continue
        for attr in ("then_branch", "else_branch"):
            a = n.attributes.get(attr)
            if a is not None and a.value is graph:
                return n, attr
    return None


def _pack_other_branch(model: ir.Model, node: ir.Node, plan: LayerPlan, norm_correction: bool,
                       key_offset, value_offset) -> None:
    """Merged decoders: the attention was rewritten in one branch of an If (the one with a past);
    the other branch (no past) still returns float presents. Pack those with TQPack, so that both
    branches, and the If's outputs, return the packed cache."""
    graph = node.graph
    owner = _owning_if(model, graph)
    if owner is None:
        raise RewriteError(f"layer {plan.index}: the attention sits in a subgraph that is not an If branch")
    if_node, attr = owner
    other = if_node.attributes["else_branch" if attr == "then_branch" else "then_branch"].value
    for new, fmt, offset in ((node.outputs[1], plan.key_format, key_offset), (node.outputs[2], plan.value_format, value_offset)):
        k = next((i for i, o in enumerate(graph.outputs) if o is new), None)
        if k is None:
            raise RewriteError(f"layer {plan.index}: the present cache is not an output of its If branch")
        src = other.outputs[k]
        inputs = [src]
        if offset is not None:
            inputs.append(_initializer(model, f"tq_{'key' if new is node.outputs[1] else 'value'}_offset_{plan.index}_pack", offset))
        pack = ir.node("TQPack", inputs, {"format": fmt, "head_dim": plan.head_dim, "norm_correction": int(norm_correction)},
                       domain=turboquant.DOMAIN, name=f"tq_pack_{plan.index}_{len(other)}")
        other.append(pack)
        packed = pack.outputs[0]
        packed.name = f"{src.name}_packed"
        _packed_type(packed, packed_size(fmt, plan.head_dim))
        if src.shape is not None:
            packed.shape = ir.Shape([*list(src.shape)[:3], packed_size(fmt, plan.head_dim)])
        other.outputs[k] = packed
        _packed_type(if_node.outputs[k], packed_size(fmt, plan.head_dim))


def rewrite_model(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                  progress: bool | None = None, calibration=None, value_offsets: bool = False) -> RewriteResult:
    """Rewrites `model` in place; returns what was done. Raises RewriteError with the reason when it refuses.

    calibration (export.calibrate.Calibration): per-layer mean keys (and values) to subtract before
    packing (TQAttention's key_offset; value_offset too when value_offsets)."""
    plans, layers = plan_layers(model, preset, boundary, skip_layers, keep_layers)
    cfg = TQ_PRESETS[preset]
    sites = {}
    for plan in plans:  # locate everything before changing anything
        if plan.compressed:
            sites[plan.index] = locate(layers[plan.index])
            plan.form = sites[plan.index].form
    if not sites:
        raise RewriteError("no layer left to compress: every cache layer is a boundary or kept layer")
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    show = progress if progress is not None else (len(sites) >= 8 and sys.stderr.isatty())
    items = list(sites.items())
    it = tqdm(items, desc="rewriting layers", unit="layer", disable=not show) if tqdm else items
    for i, site in it:
        plan = next(p for p in plans if p.index == i)
        koff = calibration.keys.get(i) if calibration is not None else None
        voff = calibration.values.get(i) if calibration is not None and value_offsets else None
        node = apply_site(model, site, layers[i], plan, cfg["norm_correction"], koff, voff)
        if node.graph is not model.graph:
            _pack_other_branch(model, node, plan, cfg["norm_correction"], koff, voff)
        common_passes.RemoveUnusedNodesPass()(model)
        _reroute_cache_shapes(site, node, plan.head_dim)
    common_passes.RemoveUnusedNodesPass()(model)
    for i in sites:  # what is left reading the packed cache must only take its batch/heads/length
        for v in (layers[i].past_key, layers[i].past_value, *_present_outputs(model, i)):
            bad = _shape_only_uses_are_safe(v)
            if bad is not None:
                raise RewriteError(f"layer {i}: {bad.name!r} takes the shape of the cache {v.name!r}, including its last axis, "
                                   "whose size packing changes")
    common_passes.TopologicalSortPass()(model)
    model.opset_imports[turboquant.DOMAIN] = turboquant.OPSET_VERSION
    model.metadata_props.update({
        "turboquant.preset": preset,
        "turboquant.format_version": str(FORMAT_VERSION),
        "turboquant.version": turboquant.__version__,
        "turboquant.layers": json.dumps([{"layer": p.index, "compressed": p.compressed,
                                          "key_format": p.key_format if p.compressed else None,
                                          "value_format": p.value_format if p.compressed else None,
                                          "norm_correction": bool(cfg["norm_correction"]) if p.compressed else None,
                                          "form": p.form} for p in plans]),
    })
    if calibration is not None:
        model.metadata_props["turboquant.offsets"] = "keys and values" if value_offsets else "keys"
        model.metadata_props["turboquant.calibration"] = f"{calibration.source}, {calibration.tokens} tokens"
    return RewriteResult(preset, plans, None)


def _present_outputs(model: ir.Model, layer: int) -> list[ir.Value]:
    node = next((n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name == f"tq_attention_{layer}"), None)
    return list(node.outputs[1:]) if node is not None else []


def _load(path: pathlib.Path) -> ir.Model:
    if not path.is_file():
        raise RewriteError(f"{path}: no such file")
    try:
        return ir.load(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise RewriteError(f"{path}: not an ONNX model ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


def default_output(path: pathlib.Path, preset: str) -> pathlib.Path:
    return path.with_name(f"{path.stem}.{preset}.onnx")


def export(model_path: str | os.PathLike, preset: str, output: str | os.PathLike | None = None, *, boundary: int = 2,
           skip_layers=None, keep_layers=None, dry_run: bool = False, progress: bool | None = None,
           calibrate: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
           value_offsets: bool = False) -> RewriteResult:
    """Rewrites the model at model_path and saves it (never over the input). See python -m turboquant.export.

    calibrate: token ids (.npy) or text (with tokenizer, a local tokenizer folder) on which the
    original model is run to compute the per-layer key (and, with value_offsets, value) offsets."""
    src = pathlib.Path(model_path)
    out = pathlib.Path(output) if output else default_output(src, preset)
    if src.exists() and out.exists() and out.resolve() == src.resolve():
        raise RewriteError(f"the output {out} is the input model; turboquant never overwrites its input")
    model = _load(src)
    calibration = None
    if calibrate is not None:
        from .calibrate import collect, load_tokens

        plans, _ = plan_layers(model, preset, boundary, skip_layers, keep_layers)
        ids, source = load_tokens(calibrate, tokenizer)
        calibration = collect(src, ids, [p.index for p in plans if p.compressed], source,
                              progress=progress if progress is not None else sys.stderr.isatty())
    result = rewrite_model(model, preset, boundary=boundary, skip_layers=skip_layers, keep_layers=keep_layers,
                           progress=progress, calibration=calibration, value_offsets=value_offsets)
    if dry_run:
        return result
    out.parent.mkdir(parents=True, exist_ok=True)
    external = _has_external_data(model) or _initializer_bytes(model) > 1_800_000_000
    data_name = f"{out.name}.data"
    if external and (out.parent / data_name).resolve() in _external_files(src, model):
        raise RewriteError(f"the output's external data file {data_name} is the input's; choose another output name")
    ir.save(model, out, external_data=data_name if external else None)
    result.output = out
    return result


def _initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _has_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def _external_files(src: pathlib.Path, model: ir.Model) -> set[pathlib.Path]:
    files = set()
    for v in model.graph.initializers.values():
        if isinstance(v.const_value, ir.ExternalTensor):
            files.add((src.parent / v.const_value.location).resolve())
    return files
