"""GroupQueryAttention's fused Q/K RMSNorm, unfused before the rewrite.

onnxruntime-genai's builder (0.18) gives the CUDA and WebGPU builds of models with per-head Q/K
norms (Qwen3, Gemma 3, LFM2, Qwen3.5) the norm weights as GroupQueryAttention's inputs 14
(q_norm_weight) and 15 (k_norm_weight), with epsilon qk_norm_epsilon (q_norm_epsilon and
k_norm_epsilon override it), and feeds Q, K and V unpacked. ONNX Runtime's schema: the op applies
an RMSNorm over each head of Q and K before its rotary, and its fusion folds the builder's CPU
form, Reshape -> SimplifiedLayerNormalization -> Reshape, into these inputs. The rewrite puts
that standard form back before the op, which TQGroupQueryAttention then takes like any other
build: the same arithmetic (stash_type 1: float32 inside), no kernel change.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile

import numpy as np
import onnx_ir as ir

Q_NORM, K_NORM = 14, 15
DEFAULT_EPSILON = 1e-6  # the schema's qk_norm_epsilon default


def _attr(n: ir.Node, name: str, default):
    a = n.attributes.get(name)
    return default if a is None else a.value


def has_fused_qk_norm(n: ir.Node) -> bool:
    return any(len(n.inputs) > i and n.inputs[i] is not None for i in (Q_NORM, K_NORM))


def fused_norm_problem(n: ir.Node) -> str | None:
    """Why this node's fused norm cannot be unfused (None where it can)."""
    q, k = (n.inputs[i] if len(n.inputs) > i else None for i in (Q_NORM, K_NORM))
    if (q is None) != (k is None):
        return "only one of q_norm_weight and k_norm_weight (inputs 14, 15), which the op takes together"
    if len(n.inputs) < 3 or n.inputs[1] is None or n.inputs[2] is None:
        return "a fused Q/K norm on packed QKV (genai's builder splits Q, K and V where it fuses the norm)"
    return None


def _epsilon(n: ir.Node, which: str) -> float:
    eps = _attr(n, f"{which}_norm_epsilon", None)
    return float(eps if eps is not None else _attr(n, "qk_norm_epsilon", DEFAULT_EPSILON))


def _const(graph: ir.Graph, before: ir.Node, name: str, array: np.ndarray) -> ir.Value:
    c = ir.node("Constant", [], {"value": ir.tensor(array, name=name)}, name=name)
    graph.insert_before(before, c)
    c.outputs[0].name = name
    return c.outputs[0]


def _normed(graph: ir.Graph, node: ir.Node, x: ir.Value, weight: ir.Value, heads: int, head: int, eps: float,
            name: str) -> ir.Value:
    """x [B, S, heads * head] through an RMSNorm over each head: the builder's unfused nodes."""
    split = _const(graph, node, f"{name}/heads_shape", np.array([0, -1, head], np.int64))
    back = _const(graph, node, f"{name}/hidden_shape", np.array([0, -1, heads * head], np.int64))
    r1 = ir.node("Reshape", [x, split], name=f"{name}/Reshape_1")
    norm = ir.node("SimplifiedLayerNormalization", [r1.outputs[0], weight],
                   {"axis": -1, "epsilon": eps, "stash_type": 1}, name=f"{name}/SimplifiedLayerNormalization")
    r2 = ir.node("Reshape", [norm.outputs[0], back], name=f"{name}/Reshape_2")
    for n in (r1, norm, r2):
        graph.insert_before(node, n)
        n.outputs[0].name = n.name + "/output_0"
        n.outputs[0].dtype = x.dtype
    r2.outputs[0].shape = x.shape
    return r2.outputs[0]


def unfuse_qk_norm(node: ir.Node) -> bool:
    """Moves the node's fused Q/K RMSNorm (inputs 14 and 15) into standard nodes before it, leaving
    the op with the inputs before them; True where there was one. The caller checks
    fused_norm_problem first."""
    if not has_fused_qk_norm(node):
        return False
    graph = node.graph
    hq, hkv = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
    qw, kw = node.inputs[Q_NORM], node.inputs[K_NORM]
    head = qw.shape[-1] if qw.shape is not None and isinstance(qw.shape[-1], int) else None
    if head is None and qw.const_value is not None:
        head = int(qw.const_value.shape[-1])
    base = node.name or "GroupQueryAttention"
    q = _normed(graph, node, node.inputs[0], qw, hq, head, _epsilon(node, "q"), f"{base}/q_norm")
    k = _normed(graph, node, node.inputs[1], kw, hkv, head, _epsilon(node, "k"), f"{base}/k_norm")
    node.replace_input_with(0, q)
    node.replace_input_with(1, k)
    for i in (Q_NORM, K_NORM):
        node.replace_input_with(i, None)
    for name in ("qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"):
        node.attributes.pop(name, None)
    return True


@contextlib.contextmanager
def runnable_on_cpu(model_path: str | os.PathLike):
    """model_path, or, where its GroupQueryAttention nodes fuse the Q/K norm (which ONNX Runtime's
    CPU kernel rejects), a copy with the norm unfused in a temporary folder (genai_config.json beside
    it), for the steps that run the original on the CPU before the rewrite."""
    import onnx

    graph = onnx.load(os.fspath(model_path), load_external_data=False).graph
    if not any(n.op_type == "GroupQueryAttention" and any(len(n.input) > i and n.input[i] for i in (Q_NORM, K_NORM))
               for n in graph.node):
        yield model_path
        return
    model = ir.load(model_path)
    for node in model.graph:
        if node.op_type == "GroupQueryAttention" and fused_norm_problem(node) is None:
            unfuse_qk_norm(node)
    with tempfile.TemporaryDirectory(prefix="turboquant-unfused-") as tmp:
        path = pathlib.Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        config = pathlib.Path(model_path).parent / "genai_config.json"
        if config.is_file():  # the cache widths SharedBufferDecoder reads there
            shutil.copy(config, pathlib.Path(tmp) / config.name)
        yield path
