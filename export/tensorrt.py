"""The TensorRT form of a rewritten model (--target tensorrt).

TensorRT's ONNX parser maps a node it does not know to the plugin whose name is the node's op_type,
in the namespace its `plugin_namespace` attribute names (version: `plugin_version`); every other
attribute becomes a plugin field. The plugins tell their optional inputs apart by type and position,
so absent optional inputs are dropped instead of left as empty names, and TQAttention says whether
it has a mask (has_mask), which the shapes alone cannot tell while the engine is built.
"""

from __future__ import annotations

import onnx_ir as ir

import turboquant

PLUGIN_VERSION = "1"


def for_tensorrt(model: ir.Model) -> int:
    """Rewrites the turboquant nodes of `model` (subgraphs included) in place; returns how many."""
    count = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != turboquant.DOMAIN:
            continue
        inputs = list(node.inputs)
        if node.op_type == "TQAttention":
            has_mask = len(inputs) > 3 and inputs[3] is not None
            node.attributes["has_mask"] = ir.AttrInt64("has_mask", int(has_mask))
        node.attributes["plugin_namespace"] = ir.AttrString("plugin_namespace", turboquant.DOMAIN)
        node.attributes["plugin_version"] = ir.AttrString("plugin_version", PLUGIN_VERSION)
        kept = [v for v in inputs if v is not None]
        if len(kept) != len(inputs):
            node.resize_inputs(0)
            node.resize_inputs(len(kept))
            for i, v in enumerate(kept):
                node.replace_input_with(i, v)
        count += 1
    model.metadata_props["turboquant.target"] = "tensorrt"
    return count
