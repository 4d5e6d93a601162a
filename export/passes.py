"""The rewrite as an onnx-ir pass, for pipelines that run passes on a model in memory:

    import onnx_ir as ir
    from turboquant.export.passes import TurboQuantRewrite

    model = ir.load("model.onnx")
    rewrite = TurboQuantRewrite("turboquant_4bit_nc", cache="in-place")
    rewrite(model)                      # or inside an ir.passes.PassManager
    print(rewrite.result.summary())

The pass rewrites in place; its preconditions (a known preset, a KV cache the rewrite can read, a
cache form the model allows) are checked in `requires`, raising `RewritePreconditionError`, which is
both onnx-ir's PreconditionError and a RewriteError. Calibration runs the original model from its
file, so the pass takes one computed beforehand (export.calibrate.collect, calibrate_gqa.collect_gqa);
`export.export` is the file wrapper that does that, then saves atomically.
"""

from __future__ import annotations

import onnx_ir as ir

from turboquant.config import TQ_PRESETS

from .cache_io import find_cache_layers
from .errors import RewriteError
from .gqa import rewrite_gqa_model, uses_gqa
from .paged import rewrite_paged_model, uses_paged


class RewritePreconditionError(RewriteError, ir.passes.PreconditionError):
    """A model the rewrite cannot take, found before anything changed."""


class TurboQuantRewrite(ir.passes.InPlacePass):
    def __init__(self, preset: str, *, boundary: int = 2, skip_layers=None, keep_layers=None, cache: str = "concat",
                 calibration=None, value_offsets: bool = False, key_scales: bool = True, q_heads: dict | None = None,
                 kept_raw16: bool = False, rotary_positions: int | None = None, flat_outputs: dict | None = None,
                 unsupported: str = "refuse",
                 per_layer: bool | None = None, progress: bool | None = None, plan: tuple | None = None,
                 window_cache: bool = False):
        """cache: "concat" (export.concat.rewrite_model) or "in-place" (export.in_place; q_heads for
        graphs that do not say their query heads, kept_raw16 for TensorRT, rotary_positions for the
        rotary inside the ops, flat_outputs from export.mask_probe); onnxruntime-genai models
        take export.gqa whatever it says (unsupported, per_layer, window_cache are its options), and
        paged ones (com.microsoft PagedAttention, the Engine's) export.paged. plan: the layer plan
        of the model the pass will be called on, as plan_layers (plan_gqa_layers for onnxruntime-genai
        models) returns it, when the caller has made it already; None: planned in the call."""
        super().__init__()
        self.preset, self.cache = preset, cache
        self.plan_args = dict(boundary=boundary, skip_layers=skip_layers, keep_layers=keep_layers)
        self.calibration, self.value_offsets, self.key_scales = calibration, value_offsets, key_scales
        self.q_heads, self.kept_raw16, self.rotary_positions = q_heads or {}, kept_raw16, rotary_positions
        self.flat_outputs = flat_outputs or {}
        self.unsupported, self.per_layer, self.progress = unsupported, per_layer, progress
        self.plan, self.window_cache = plan, window_cache
        self.result = None  # the RewriteResult of the last call

    def requires(self, model: ir.Model) -> None:
        if self.preset not in TQ_PRESETS:
            raise RewritePreconditionError(f"unknown preset {self.preset!r}: valid presets are {', '.join(TQ_PRESETS)}")
        if self.cache not in ("concat", "in-place"):
            raise RewritePreconditionError(f"cache must be 'concat' or 'in-place', got {self.cache!r}")
        if uses_gqa(model) or uses_paged(model):
            return
        try:
            find_cache_layers(model.graph)
        except RewriteError as e:
            raise RewritePreconditionError(str(e)) from None
        if self.cache == "in-place" and any(n.op_type == "If" for n in model.graph):
            raise RewritePreconditionError("the in-place cache form takes a decoder without If branches; this one is merged")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opts = dict(calibration=self.calibration, value_offsets=self.value_offsets, key_scales=self.key_scales,
                    plan=self.plan, **self.plan_args)
        if uses_paged(model):
            self.result = rewrite_paged_model(model, self.preset, **opts)
        elif uses_gqa(model):
            self.result = rewrite_gqa_model(model, self.preset, unsupported=self.unsupported, per_layer=self.per_layer,
                                            window_cache=self.window_cache, **opts)
        elif self.cache == "in-place":
            from .in_place import rewrite_in_place

            self.result = rewrite_in_place(model, self.preset, self.q_heads, kept_raw16=self.kept_raw16,
                                           rotary_positions=self.rotary_positions, flat_outputs=self.flat_outputs,
                                           **opts)
        else:
            from .concat import rewrite_model

            self.result = rewrite_model(model, self.preset, progress=self.progress, **opts)
        return ir.passes.PassResult(model, modified=True)
