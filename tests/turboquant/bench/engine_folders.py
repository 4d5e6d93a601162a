"""Model folders for the Engine bench's tests: hand-made paged folders (genai_config.json and a graph
of one PagedAttention node with the cache inputs genai's builder writes), and real builds."""

from __future__ import annotations

import json
import pathlib

import onnx
from onnx import TensorProto, helper

from turboquant.node_models import IR_VERSION


def paged_folder(folder: pathlib.Path, layers: int = 2, heads: int = 2, head_dim: int = 64, block_size: int = 16,
                 int4: bool = False, dynamic: dict | None = None, engine: bool = True, int8: bool = False) -> pathlib.Path:
    """A folder shaped as genai's builder writes a paged model: fp16 blocks, packed int4 with fp16
    per-token scales (int4_per_token, Hadamard), or int8 with them (int8_per_token)."""
    folder.mkdir(parents=True, exist_ok=True)
    vi = helper.make_tensor_value_info
    cache_type, width = ((TensorProto.UINT8, head_dim // 2) if int4 else (TensorProto.INT8, head_dim) if int8
                         else (TensorProto.FLOAT16, head_dim))
    scaled = int4 or int8
    inputs = [vi("input_ids", TensorProto.INT64, ["num_tokens"])]
    for i in range(layers):
        for side in ("key", "value"):
            inputs.append(vi(f"past_key_values.{i}.{side}", cache_type, ["num_blocks", "block_size", heads, width]))
            if scaled:
                inputs.append(vi(f"past_key_values.{i}.{side}_scale", TensorProto.FLOAT16, ["num_blocks", "block_size", heads]))
    attrs = ({"k_cache_dtype": "int4", "k_quant_type": "PER_TOKEN", "qk_rotation": "HADAMARD"} if int4
             else {"k_quant_type": "PER_TOKEN"} if int8 else {})
    node = helper.make_node("PagedAttention", ["input_ids"], ["logits"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=heads, **attrs)
    graph = helper.make_graph([node], "paged", inputs, [vi("logits", TensorProto.FLOAT16, None)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                                ir_version=IR_VERSION), str(folder / "model.onnx"))
    names = {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    if scaled:
        names |= {"past_key_scale_names": "past_key_values.%d.key_scale", "past_value_scale_names": "past_key_values.%d.value_scale"}
    config = {"model": {"context_length": 4096, "vocab_size": 512,
                        "decoder": {"filename": "model.onnx", "num_hidden_layers": layers, "inputs": names}}}
    if engine:
        config["engine"] = {"dynamic_batching": dynamic or {"block_size": block_size, "max_batch_size": 8, "num_blocks": 64}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def built(folder: pathlib.Path, precision: str, provider: str, extra: dict | None = None, layers: int = 2) -> pathlib.Path:
    """A tiny decoder (2 layers, 2 KV heads of 64) through genai's builder; returns its model folder."""
    import dataclasses

    from turboquant import random_decoders
    from turboquant.bench.decode_models import SHAPES

    cfg = dataclasses.replace(SHAPES["tiny"], layers=layers)
    return random_decoders.export_genai(cfg, folder, precision, provider, extra=extra).parent


PAGED = {"use_paged_attention": "true", "paged_block_size": "16", "num_blocks": "64", "max_batch_size": "8"}
INT4 = {**PAGED, "kv_cache_quant_scheme": "int4_per_token", "kv_cache_rotation": "hadamard"}
