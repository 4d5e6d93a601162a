"""Finding a decoder's KV-cache inputs, layer by layer.

Exporters name the cache inputs past_key_values.N.key / .value (optimum, torch.onnx exports of
Hugging Face models, onnxruntime-genai) or past.N.key / past_key.N; the layer index N is what
boundary-layer selection works on. Other per-layer state inputs (conv or SSM states of hybrid
models) mark layers without a KV cache.
"""

from __future__ import annotations

import dataclasses
import re

import onnx_ir as ir

from turboquant.config import LayerInfo, check_head_dim

from .errors import RewriteError

_KV_NAMES = [
    re.compile(r"^(?:past_key_values|past)\.(?P<layer>\d+)\.(?P<kind>key|value)$"),
    re.compile(r"^past_(?P<kind>key|value)[._](?P<layer>\d+)$"),
]
# any other per-layer recurrent state: e.g. past_conv.3, past_ssm_state.3, cache_params.3.conv
_STATE_NAMES = re.compile(r"^(?:past|cache)[\w]*?[._](?P<layer>\d+)(?:[._]\w+)?$")
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclasses.dataclass
class CacheLayer:
    index: int
    past_key: ir.Value
    past_value: ir.Value
    # the head size where the cache's last axis does not give it (genai models: a symbolic width)
    known_head_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.known_head_dim or _static_dim(self.past_key, 3)

    @property
    def v_head_dim(self) -> int:
        return self.known_head_dim or _static_dim(self.past_value, 3)

    @property
    def kv_heads(self) -> int | None:
        d = self.past_key.shape[1] if self.past_key.shape is not None and len(self.past_key.shape) == 4 else None
        return d if isinstance(d, int) else None


def _static_dim(v: ir.Value, axis: int) -> int:
    if v.shape is None or len(v.shape) != 4:
        raise RewriteError(f"cache input {v.name!r} must be 4-D [batch, kv_heads, seq, head_dim], got shape {v.shape}")
    d = v.shape[axis]
    if not isinstance(d, int):
        raise RewriteError(f"cache input {v.name!r} has a symbolic head size ({d}); turboquant needs it static")
    return d


def find_cache_layers(graph: ir.Graph, head_dim_of=None) -> dict[int, CacheLayer]:
    """head_dim_of(layer) -> int | None: the head size from the layer's attention node, for caches
    whose last axis does not say it."""
    keys: dict[int, ir.Value] = {}
    values: dict[int, ir.Value] = {}
    for v in graph.inputs:
        for pat in _KV_NAMES:
            m = pat.match(v.name or "")
            if m:
                (keys if m["kind"] == "key" else values)[int(m["layer"])] = v
                break
    if not keys and not values:
        raise RewriteError(
            "found no KV cache: no graph input is named like past_key_values.N.key / past_key_values.N.value "
            f"(inputs: {', '.join(v.name for v in graph.inputs[:8])}{', ...' if len(graph.inputs) > 8 else ''})"
        )
    if set(keys) != set(values):
        raise RewriteError(f"cache layers with a key input but no value input or the reverse: {sorted(set(keys) ^ set(values))}")
    layers = {i: CacheLayer(i, keys[i], values[i]) for i in sorted(keys)}
    for layer in layers.values():
        if head_dim_of is not None:
            layer.known_head_dim = head_dim_of(layer)
        for v in (layer.past_key, layer.past_value):
            if v.dtype not in FLOAT_TYPES:
                raise RewriteError(f"cache input {v.name!r} is {v.dtype}; turboquant compresses float32, float16 and bfloat16 caches")
        try:
            check_head_dim(layer.head_dim)
            check_head_dim(layer.v_head_dim)
        except ValueError as e:
            raise RewriteError(f"layer {layer.index}: {e}") from None
    return layers


def layer_infos(graph: ir.Graph, layers: dict[int, CacheLayer]) -> list[LayerInfo]:
    """Every layer index seen in a per-layer state input; those without a KV cache make a hybrid."""
    indices = set(layers)
    for v in graph.inputs:
        m = _STATE_NAMES.match(v.name or "")
        if m:
            indices.add(int(m["layer"]))
    return [
        LayerInfo(i, has_kv_cache=i in layers, head_dim=layers[i].head_dim if i in layers else None,
                  num_kv_heads=layers[i].kv_heads if i in layers else None,
                  kind="attention" if i in layers else "recurrent")
        for i in sorted(indices)
    ]
