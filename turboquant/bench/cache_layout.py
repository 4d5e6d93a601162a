"""What a decoder's KV cache looks like, read from the model file alone (no session, no weights):
each cache input's KV heads, row width and dtype, whether the model runs genai-style shared
buffers, and the checks that a rewritten model belongs to the original it is compared with."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections import Counter

import numpy as np

from ..config import packed_size
from ..decoder import _PAST, _layer_kind

_DTYPES = {1: np.float32, 10: np.float16, 2: np.uint8}
_REPLACED_WEIGHTS = ("tq_qkv_weight_", "tq_o_proj_weight_")  # the rewrite's forms of the exporter's weights
_SHARED_OPS = {"GroupQueryAttention", "TQGroupQueryAttention"}
GENAI_CONFIG = "genai_config.json"
MAX_ROTARY_POSITIONS = 1 << 24  # the rewrite's own bound (turboquant.export --rotary-positions)
MAX_CONTEXT = 1 << 40  # a context_length beyond any buffer a machine holds: a damaged config


class LayoutError(ValueError):
    """A model that cannot be benchmarked, or a pair that does not belong together; `arg` names the
    command-line argument at fault."""

    def __init__(self, arg: str, message: str):
        super().__init__(message)
        self.arg = arg


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    name: str
    layer: int
    kind: str  # "key" or "value"
    heads: int
    width: int  # elements per row (bytes for uint8 caches)
    dtype: type
    key_format: str | None = None  # packed layers: the format and head_dim TQPack takes
    norm_correction: bool = False
    head_dim: int | None = None

    @property
    def row_bytes(self) -> int:
        return self.heads * self.width * np.dtype(self.dtype).itemsize


@dataclasses.dataclass
class ModelInfo:
    path: pathlib.Path  # the .onnx file
    genai_folder: pathlib.Path | None  # the folder with genai_config.json, if any
    caches: list[CacheTensor]
    shared: bool  # GroupQueryAttention-style: one max_length buffer per tensor, written in place
    preset: str | None  # turboquant.preset of a rewritten model
    vocab: int | None
    weight_shapes: Counter  # shapes of the large initializers (what a rewrite leaves as it was)
    max_length: int | None  # genai_config's context_length
    rotary_positions: int | None = None  # a rewrite's rotary tables: the positions its attention ops take

    @property
    def layers(self) -> int:
        return len({c.layer for c in self.caches})

    def bytes_per_token(self) -> int:
        """Cache bytes one sequence holds per token, all layers, K and V."""
        return sum(c.row_bytes for c in self.caches)

    def kv_bytes(self, batch: int, context: int) -> int:
        return batch * context * self.bytes_per_token()


def genai_config(folder: pathlib.Path) -> dict:
    """genai_config.json's "model" section; LayoutError naming the file where it is not one."""
    config = folder / GENAI_CONFIG
    try:
        model = json.loads(config.read_text())["model"]
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__  # a UnicodeDecodeError has no strerror
        raise LayoutError("MODEL", f"{config}: cannot be read ({why})") from None
    except json.JSONDecodeError as e:
        raise LayoutError("MODEL", f"{config}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (KeyError, TypeError):
        raise LayoutError("MODEL", f"{config}: no \"model\" section") from None
    if not isinstance(model, dict) or not isinstance(model.get("decoder", {}), dict):
        raise LayoutError("MODEL", f"{config}: \"model\" and its \"decoder\" are not objects")
    for key, value in [("context_length", model.get("context_length")), ("vocab_size", model.get("vocab_size")),
                       *((f"decoder.{k}", model.get("decoder", {}).get(k))
                         for k in ("head_size", "hidden_size", "num_attention_heads"))]:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_CONTEXT):
            raise LayoutError("MODEL", f"{config}: model.{key} is {repr(value)[:40]}, not a whole number from 1 to 2**40")
    if not isinstance(model.get("decoder", {}).get("filename", ""), str):
        raise LayoutError("MODEL", f"{config}: model.decoder.filename is not a file name")
    return model


def resolve(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None]:
    """The .onnx file of a model argument (a file, or a genai folder) and its genai folder, if any."""
    p = pathlib.Path(path)
    if p.is_dir():
        if not (p / GENAI_CONFIG).is_file():
            raise LayoutError("MODEL", f"{p} is a folder without {GENAI_CONFIG}; pass the .onnx file")
        name = genai_config(p).get("decoder", {}).get("filename", "model.onnx")
        return p / name, p
    if not p.is_file():
        raise LayoutError("MODEL", f"{p}: no such file")
    return p, p.parent if (p.parent / GENAI_CONFIG).is_file() else None


def inspect(path: str | pathlib.Path) -> ModelInfo:
    import onnx

    onnx_path, folder = resolve(path)
    try:
        m = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same to the user
        raise LayoutError("MODEL", f"{onnx_path}: not an ONNX model ({type(e).__name__})") from None
    missing = sorted(f for f in _data_files(m, onnx_path.parent) if not f.is_file())
    if missing:  # else its cache inputs may read as symbolic, or the session fails once the run is under way
        raise LayoutError("MODEL", f"{onnx_path}: its external data file {missing[0]} is missing")
    config = genai_config(folder) if folder else {}
    decoder = config.get("decoder", {})
    meta = {p.key: p.value for p in m.metadata_props}
    formats = _layer_formats(meta, onnx_path)
    head_dim = None
    if decoder.get("hidden_size") and decoder.get("num_attention_heads"):
        head_dim = decoder["hidden_size"] // decoder["num_attention_heads"]
    caches = []
    for vi in m.graph.input:
        match = _PAST.match(vi.name)
        if not match:
            continue
        layer, kind = _layer_kind(match)
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if len(dims) != 4 or t.elem_type not in _DTYPES:
            raise LayoutError("MODEL", f"{onnx_path}: cache input {vi.name} is not a 4-D float16, float32 or uint8 tensor")
        heads, width = dims[1], dims[3] if dims[3] is not None else decoder.get("head_size")
        if heads is None or width is None:
            raise LayoutError("MODEL", f"{onnx_path}: cache input {vi.name} has symbolic heads or row width {dims}")
        fmt = formats.get(layer, {}).get(f"{kind}_format")
        caches.append(CacheTensor(vi.name, layer, kind, heads, width, _DTYPES[t.elem_type],
                                  fmt if t.elem_type == 2 else None, bool(formats.get(layer, {}).get("norm_correction")),
                                  _head_dim(fmt, width, head_dim) if t.elem_type == 2 else width))
    if not caches:
        raise LayoutError("MODEL", f"{onnx_path} has no KV cache (no inputs named like past_key_values.N.key)")
    caches.sort(key=lambda c: (c.layer, c.kind))
    # a packed key's width may pad head_dim (mse formats): its layer's value width (uint formats do not) decides
    dims = {c.layer: c.head_dim for c in caches if c.kind == "value"}
    caches = [dataclasses.replace(c, head_dim=dims.get(c.layer) or c.head_dim) if c.kind == "key" and c.dtype is np.uint8
              else c for c in caches]
    for c in caches:
        if c.dtype is np.uint8 and c.key_format is None:
            raise LayoutError("MODEL", f"{onnx_path}: uint8 cache {c.name} without turboquant.layers metadata naming its format")
    vocab = None
    for o in m.graph.output:  # a logits output without a declared shape leaves the vocabulary unknown
        dims = o.type.tensor_type.shape.dim
        if o.name == "logits" and len(dims) and dims[-1].HasField("dim_value") and dims[-1].dim_value > 0:
            vocab = dims[-1].dim_value
    # The rewrite's own initializers (tq_*: rotary tables, offsets, scales) are left out, but for the
    # weights it replaces: the packed Q, K and V weight holds the three side by side, so the elements
    # are summed over every matrix, the small ones too (a small model's fused weight reaches the size
    # its parts did not), and shapes are compared for the large ones.
    weights = [t for t in m.graph.initializer if len(t.dims) >= 2
               and (not t.name.startswith("tq_") or t.name.startswith(_REPLACED_WEIGHTS))]
    shapes = Counter(tuple(t.dims) for t in weights if int(np.prod(t.dims)) >= 4096
                     and not t.name.startswith("tq_qkv_weight_"))
    shapes["elements"] = sum(int(np.prod(t.dims)) for t in weights)
    return ModelInfo(onnx_path, folder, caches, any(n.op_type in _SHARED_OPS for n in m.graph.node),
                     meta.get("turboquant.preset"), vocab or config.get("vocab_size"), shapes, config.get("context_length"),
                     _positions(meta, onnx_path))


def _layer_formats(meta: dict, onnx_path: pathlib.Path) -> dict[int, dict]:
    """turboquant.layers of a rewrite by layer: a JSON list of objects with an integer "layer" and
    known formats; LayoutError naming the metadata where it is anything else."""
    from ..config import ALL_FORMATS

    text = meta.get("turboquant.layers", "[]")
    where = f"{onnx_path}: metadata turboquant.layers"
    try:
        entries = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise LayoutError("MODEL", f"{where} is not JSON ({getattr(e, 'msg', type(e).__name__)})") from None
    if not isinstance(entries, list) or not all(isinstance(d, dict) for d in entries):
        raise LayoutError("MODEL", f"{where} is not a list of objects")
    formats = {}
    for d in entries:
        layer = d.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise LayoutError("MODEL", f"{where}: layer {layer!r} is not a layer number")
        for kind in ("key_format", "value_format"):
            if d.get(kind) is not None and d[kind] not in ALL_FORMATS:
                raise LayoutError("MODEL", f"{where}: layer {layer}'s {kind} {str(d[kind])[:40]!r} is not one of "
                                  f"{', '.join(ALL_FORMATS)}")
        formats[layer] = d
    return formats


def _positions(meta: dict, onnx_path: pathlib.Path) -> int | None:
    """turboquant.rotary_positions of a rewrite (what SharedBufferDecoder refuses a longer max_length by)."""
    text = meta.get("turboquant.rotary_positions")
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        raise LayoutError("MODEL", f"{onnx_path}: metadata turboquant.rotary_positions is {text[:40]!r}, not a number") from None
    if not 0 < n <= MAX_ROTARY_POSITIONS:
        raise LayoutError("MODEL", f"{onnx_path}: metadata turboquant.rotary_positions is {n}, not 1 to {MAX_ROTARY_POSITIONS}")
    return n


def _data_files(model, folder: pathlib.Path) -> set[pathlib.Path]:
    """The files the model's tensors (initializers, node attributes, subgraphs) keep their data in."""
    from onnx import TensorProto
    from onnx.external_data_helper import _get_all_tensors

    return {folder / next((e.value for e in t.external_data if e.key == "location"), "")
            for t in _get_all_tensors(model) if t.data_location == TensorProto.EXTERNAL}


def _head_dim(fmt: str | None, width: int, hint: int | None) -> int | None:
    """A packed layer's head_dim: genai_config's (hidden / heads) where given, else the one whose
    packed size is the row width."""
    if fmt is None:
        return None
    if hint:
        return hint
    for d in range(16, 257, 8):  # the head sizes the formats take
        if packed_size(fmt, d) == width:
            return d
    return None  # a row padded past its vector (a key row as wide as its layer's value row)


def check_same_model(first: ModelInfo, other: ModelInfo, arg: str, weights: bool = True) -> None:
    """other (a rewrite, or another export) must be first's model: same layers and KV heads, float
    layers of the same width, packed layers packing first's head_dim, the same weight shapes (unless
    weights is False: another exporter's model of the same shapes, whose projections it may fuse)."""
    def fail(why: str):
        raise LayoutError(arg, f"{other.path} is not a form of {first.path}: {why}")

    if other.layers != first.layers:
        fail(f"{other.layers} cache layers against {first.layers}")
    mine = {(c.layer, c.kind): c for c in first.caches}
    for c in other.caches:
        ref = mine.get((c.layer, c.kind))
        if ref is None:
            fail(f"cache input {c.name} has no counterpart")
        if c.heads != ref.heads:
            fail(f"layer {c.layer} has {c.heads} KV heads against {ref.heads}")
        if c.dtype is not np.uint8 and c.width != ref.width:
            fail(f"layer {c.layer} caches rows of {c.width} against {ref.width}")
        if c.dtype is np.uint8 and ref.dtype is not np.uint8 and c.key_format:
            need = packed_size(c.key_format, ref.width)
            if need > c.width or (not other.shared and need != c.width):
                fail(f"layer {c.layer}'s {c.key_format} rows of {c.width} bytes do not pack head_dim {ref.width}")
    if first.vocab and other.vocab and first.vocab != other.vocab:
        fail(f"vocabulary {other.vocab} against {first.vocab}")
    if not weights:
        return
    if first.weight_shapes["elements"] != other.weight_shapes["elements"]:
        fail(f"{other.weight_shapes['elements']} weight elements against {first.weight_shapes['elements']}")
    shapes = [Counter({k: n for k, n in w.items() if k != "elements"}) for w in (first.weight_shapes, other.weight_shapes)]
    small, large = sorted(shapes, key=lambda s: sum(s.values()))
    if small - large:
        fail(f"weights of shapes {sorted(small - large)[:3]} are missing")
