"""The paged KV pool of an onnxruntime-genai folder built for the Engine (genai's builder with
--extra_options use_paged_attention=true): block size, bytes a token takes in every layer's key and
value blocks and their per-token scales, the pool genai_config.json asks for, and how many requests
of a given length fit in a pool of a given size.

A request of S prompt tokens that generates N holds ceil((S + N) / block_size) blocks of every
layer once it is done (genai's Engine gives a request whole blocks from one pool shared by all
layers' caches), so a pool of P bytes holds floor(P / block_bytes) blocks and
floor(blocks / ceil((S + N) / block_size)) such requests at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

# ONNX element types of the caches genai's builder writes: fp16/bf16 pools, int8, packed int4 (uint8,
# two values a byte), fp8, and the fp16 per-token scales beside the quantized ones
_ITEM_BYTES = {1: 4, 10: 2, 16: 2, 3: 1, 2: 1, 17: 1}


class PoolError(ValueError):
    """A folder the Engine bench cannot serve; the message names the folder and what is wrong."""


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    folder: str
    block_size: int
    bytes_per_token: int  # every layer's key and value rows of one token, their scales included
    layers: int
    cache: str  # the pool's format in words, from the PagedAttention node's attributes
    max_batch_size: int  # genai_config's engine.dynamic_batching.max_batch_size
    num_blocks: int | None  # genai_config's, where it sets one
    utilization: float | None  # genai_config's gpu_utilization_factor, where it sets one instead
    context_length: int
    vocab: int

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def config_pool_bytes(self) -> int | None:
        """The pool genai_config.json asks for in bytes, where it names a block count."""
        return None if self.num_blocks is None else self.num_blocks * self.block_bytes

    def blocks_in(self, pool_bytes: int) -> int:
        return pool_bytes // self.block_bytes

    def blocks_per_request(self, context: int, new: int) -> int:
        return math.ceil((context + new) / self.block_size)

    def fits(self, pool_bytes: int, context: int, new: int) -> int:
        """Requests of `context` prompt tokens and `new` generated ones the pool holds at once."""
        return self.blocks_in(pool_bytes) // self.blocks_per_request(context, new)


def _names(pattern: str, layers: int) -> list[str]:
    return [pattern % i for i in range(layers)] if "%d" in pattern else []


def read_layout(folder: str | pathlib.Path) -> PoolLayout:
    """The pool layout of a genai folder built with use_paged_attention=true; PoolError otherwise."""
    import onnx

    path = pathlib.Path(folder)
    if not path.is_dir():
        raise PoolError(f"{folder}: no such folder")
    cfg_path = path / "genai_config.json"
    if not cfg_path.is_file():
        raise PoolError(f"{folder}: no genai_config.json (an onnxruntime-genai model folder is needed)")
    try:
        cfg = json.loads(cfg_path.read_text())
        dec = cfg["model"]["decoder"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolError(f"{cfg_path}: not a readable genai_config.json ({type(e).__name__}: {e})") from None
    dyn = (cfg.get("engine") or {}).get("dynamic_batching")
    if not isinstance(dyn, dict):
        raise PoolError(f"{folder}: not a paged model: genai_config.json has no engine.dynamic_batching (build it with "
                        "genai's builder and --extra_options use_paged_attention=true)")
    model_file = path / dec.get("filename", "model.onnx")
    if not model_file.is_file():
        raise PoolError(f"{folder}: genai_config.json names {model_file.name}, which is not there")
    graph = onnx.load(str(model_file), load_external_data=False).graph
    paged = ("PagedAttention", "TQPagedAttention")  # genai's builder's, or turboquant's rewrite of it
    if not any(n.op_type in paged for n in graph.node):
        raise PoolError(f"{folder}: not a paged model: {model_file.name} has no PagedAttention node")
    layers = int(dec["num_hidden_layers"])
    ins, outs = dec.get("inputs", {}), dec.get("outputs", {})
    wanted = set()
    for key in ("past_key_names", "past_value_names", "past_key_scale_names", "past_value_scale_names"):
        wanted.update(_names(ins.get(key, ""), layers))
    per_token = 0
    found = 0
    for i in graph.input:
        if i.name not in wanted:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
        if len(dims) < 3 or any(d is None for d in dims[2:]):
            raise PoolError(f"{folder}: cache input {i.name} has shape {dims}, not [blocks, block_size, heads, ...]")
        item = _ITEM_BYTES.get(i.type.tensor_type.elem_type)
        if item is None:
            raise PoolError(f"{folder}: cache input {i.name} has an element type this bench does not size "
                            f"({onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type)})")
        per_token += int(np.prod(dims[2:])) * item
        found += 1
    if found < 2 * layers:
        raise PoolError(f"{folder}: {found} paged cache inputs found in {model_file.name}, {2 * layers} expected "
                        "(genai_config's past_key_names / past_value_names)")
    nodes = [n for n in graph.node if n.op_type in paged]
    # a rewrite's compressed layers name its formats (its boundary layers' are raw16)
    node = next((n for n in nodes if not any(a.name == "key_format" and a.s == b"raw16" for a in n.attribute)), nodes[0])
    pool_type = next(onnx.TensorProto.DataType.Name(i.type.tensor_type.elem_type) for i in graph.input
                     if i.name in _names(ins.get("past_key_names", ""), layers))
    return PoolLayout(folder=str(path), block_size=int(dyn["block_size"]), bytes_per_token=per_token, layers=layers,
                      cache=_cache_words(node, pool_type), max_batch_size=int(dyn.get("max_batch_size", 0)) or 0,
                      num_blocks=int(dyn["num_blocks"]) if "num_blocks" in dyn else None,
                      utilization=float(dyn["gpu_utilization_factor"]) if "gpu_utilization_factor" in dyn else None,
                      context_length=int(cfg["model"].get("context_length", 0)),
                      vocab=int(cfg["model"].get("vocab_size", 0)))


def _cache_words(node, pool_type: str) -> str:
    """The pool's type where it is not quantized, else e.g. "int4 per token, Hadamard" from
    PagedAttention's quantization attributes."""
    import onnx

    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

    def text(key: str) -> str:
        v = attrs.get(key, b"")
        return (v.decode() if isinstance(v, bytes) else str(v)).lower()

    if node.op_type == "TQPagedAttention":
        return f"turboquant {text('key_format') or 'mse4'}/{text('value_format') or 'uint4'} ({pool_type.lower()} rows)"

    quant = text("k_quant_type")
    if not quant:
        return f"{pool_type.lower()}, not quantized"
    words = f"{text('k_cache_dtype') or pool_type.lower()} {quant.replace('_', ' ')}"
    if text("qk_rotation") and text("qk_rotation") != "none":
        words += f", {text('qk_rotation').capitalize()}"
    return words
