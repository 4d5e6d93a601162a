"""Which layers the rewrite compresses, with what formats, and what it reports."""

from __future__ import annotations

import dataclasses
import pathlib

import onnx_ir as ir

from turboquant.config import TQ_PRESETS, TurboQuantConfig, packed_size

from .cache_io import _KV_NAMES, _STATE_NAMES, CacheLayer, find_cache_layers, layer_infos
from .errors import RewriteError


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
    row_bytes: int | None = None  # GroupQueryAttention models: the width of this layer's uint8 cache rows
    pools: int = 1  # paged models: the pool pairs the layer's rows take (a boundary layer split over several)

    @property
    def bytes_before(self) -> int | None:
        return None if self.kv_heads is None else 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_after(self) -> int | None:
        if self.kv_heads is None:
            return None
        if self.row_bytes:
            return 2 * self.kv_heads * self.row_bytes * self.pools
        if not self.compressed:
            return self.bytes_before
        return self.kv_heads * (packed_size(self.key_format, self.head_dim) + packed_size(self.value_format, self.head_dim))


@dataclasses.dataclass
class RewriteResult:
    preset: str
    layers: list[LayerPlan]
    output: pathlib.Path | None
    notes: list[str] = dataclasses.field(default_factory=list)  # printed after the summary
    row_bytes: int | None = None  # GroupQueryAttention models: the widest layer's cache rows (genai's head_size)
    left: list[int] = dataclasses.field(default_factory=list)  # genai models: layers left as they were
    window_cache: list[int] = dataclasses.field(default_factory=list)  # genai models: layers kept window-sized
    pool_pairs: int | None = None  # paged genai models: the key/value pool pairs (genai_config's num_hidden_layers)

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
            lines.append(f"  KV cache per token (all layers, batch 1): {sum(before)} bytes before, {sum(after)} after, {ratio:.2f}x smaller"
                         f" (in the model's own cache dtype, kept layers included)")
            packed = [p for p in self.layers if p.compressed]
            if packed:  # the presets table's measure: a compressed layer against fp16 K and V
                fp16 = sum(4 * p.kv_heads * p.head_dim for p in packed)
                lines.append(f"  compressed layers against fp16 K and V: {fp16} bytes per token, {sum(p.bytes_after for p in packed)}"
                             f" after, {fp16 / sum(p.bytes_after for p in packed):.2f}x smaller")
        else:
            lines.append("  KV cache per token: unknown (the cache inputs have a symbolic head count)")
        lines += [f"  {n}" for n in self.notes]
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


def plan_layers(model: ir.Model, preset: str, boundary: int = 2, skip_layers=None, keep_layers=None,
                head_dim_of=None) -> tuple[list[LayerPlan], dict[int, CacheLayer]]:
    if preset not in TQ_PRESETS:
        raise RewriteError(f"unknown preset {preset!r}: valid presets are {', '.join(TQ_PRESETS)}")
    if not isinstance(boundary, int) or isinstance(boundary, bool) or boundary < 0:
        raise RewriteError(f"--boundary must be a layer count of zero or more, got {boundary!r}")
    layers = find_cache_layers(model.graph, head_dim_of)
    infos = layer_infos(model.graph, layers)
    if keep_layers is not None:
        kept = set(keep_layers)
    else:
        if all(info.has_kv_cache for info in infos):  # a hybrid model's boundary is not used
            _refuse_boundary(boundary, len(layers))
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


def _refuse_boundary(boundary: int, layers: int, auto: bool = False) -> None:
    """A boundary that keeps every cache layer is refused: get_boundary_skip_layers caps it at half the
    layers (vLLM's rule), which keeps them all where their count is even."""
    kept = 2 * boundary if auto else 2 * min(boundary, layers // 2)
    if boundary > 0 and layers > 0 and kept >= layers:
        keeps = (f"--keep-layers auto keeps 2 x --boundary = {2 * boundary} layers; the model has {layers}" if auto
                 else f"--boundary {boundary} keeps the first and last {boundary} of the model's {layers}")
        raise RewriteError(f"{keeps} cache layers, which leaves none to compress (--boundary {(layers - 1) // 2} at most)")


def check_boundary(graph: ir.Graph, boundary, keep_layers=None) -> None:
    """_refuse_boundary from the graph's input names alone, before anything slow (plan_layers checks it
    again); a list of kept layers replaces the boundary, and a hybrid model does not use it."""
    auto = isinstance(keep_layers, str) and keep_layers == "auto"
    if (keep_layers is not None and not auto) or not isinstance(boundary, int) or isinstance(boundary, bool):
        return
    names = [v.name or "" for v in graph.inputs]
    cache = {int(m["layer"]) for n in names for pat in _KV_NAMES if (m := pat.match(n))}
    states = {int(m["layer"]) for n in names if (m := _STATE_NAMES.match(n))}
    if cache and not states - cache:
        _refuse_boundary(boundary, len(cache), auto)
