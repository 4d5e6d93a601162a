"""The concat cache form's rewrite: the attention of compressed layers becomes TQAttention over a packed
uint8 cache, past and present caches as the exporter made them (its masks kept)."""

from __future__ import annotations

import json
import sys

import onnx_ir as ir
import onnx_ir.passes.common as common_passes

import turboquant
from turboquant.config import FORMAT_VERSION, TQ_PRESETS

from .errors import RewriteError
from .forms import locate
from .plan import RewriteResult, plan_layers
from .surgery import apply_site, pack_other_branch, present_outputs, reroute_cache_shapes, shape_only_uses_are_safe


def rewrite_model(model: ir.Model, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None,
                  progress: bool | None = None, calibration=None, value_offsets: bool = False,
                  key_scales: bool = True, plan: tuple | None = None) -> RewriteResult:
    """Rewrites `model` in place; returns what was done. Raises RewriteError with the reason when it refuses.

    calibration (export.calibrate.Calibration): per-layer mean keys (and values) to subtract before
    packing (TQAttention's key_offset; value_offset too when value_offsets), and the per-channel key
    scales (unless key_scales is False). plan: plan_layers of `model` with these options, where the caller
    has it (None: planned here)."""
    plans, layers = plan or plan_layers(model, preset, boundary, skip_layers, keep_layers)
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
        kscale = calibration.key_scales.get(i) if calibration is not None and key_scales else None
        cache_dtype = layers[i].past_key.dtype  # the float type, before apply_site retypes the cache to uint8
        node = apply_site(model, site, layers[i], plan, cfg["norm_correction"], koff, voff, kscale,
                          calibration.q_heads.get(i) if kscale is not None else None)
        if node.graph is not model.graph:
            pack_other_branch(model, node, plan, cfg["norm_correction"], koff, voff, kscale, cache_dtype)
        common_passes.RemoveUnusedNodesPass()(model)
        reroute_cache_shapes(site, node, plan.head_dim)
    common_passes.RemoveUnusedNodesPass()(model)
    for i in sites:  # what is left reading the packed cache must only take its batch/heads/length
        for v in (layers[i].past_key, layers[i].past_value, *present_outputs(model, i)):
            bad = shape_only_uses_are_safe(v)
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
    from .calibrate import calibration_metadata

    model.metadata_props.update(calibration_metadata(calibration, value_offsets, key_scales))
    return RewriteResult(preset, plans, None)
