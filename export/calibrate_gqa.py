"""Calibration of onnxruntime-genai models (com.microsoft GroupQueryAttention, rotary inside the op):
the mean rotated key and per-channel key scales, per compressed layer and KV head.

Offsets. TQGroupQueryAttention subtracts key_offset after its rotary, so the offset is the mean of
the rotated keys, which the original op's present_key output holds: the original model runs in
ONNX Runtime on windows of calibration tokens from empty caches (a prefill: every key is new).

Key scales. The op multiplies the rotated queries by its key_scale input and divides the rotated
keys by it, leaving every score unchanged, so the scales are those of plain exports
(export/key_scale.py: weighed by what each attention reads) over rotated queries and keys, with the
values: the keys and values from present_key and present_value, the queries where the op takes them
(a Cast of its input 0 made a model output), turned here by the op's own tables at the window's
positions 0, 1, ..., and the op's scale (1/sqrt(D) where it has none). fp8 keys take
export/calibrate.py's fp8_key_scale from the rotated keys alone.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np
import onnx_ir as ir

from .calibrate import DEFAULT_WINDOW, Calibration, add_cache_sums, fp8_key_scale, key_peaks, window_count, windows
from .gqa import _attr, plan_gqa_layers
from .key_scale import AttentionMoments
from .qk_norm import fused_norm_problem, has_fused_qk_norm, unfuse_qk_norm


# cos_cache and sin_cache computed in the graph (genai's LongRoPE builds pick the short or long factors by
# the sequence's length): the calibration reads them off each window's run, the tables the op used there
COMPUTED_TABLES = "cos_cache and sin_cache are computed in the graph"


def _probe_output(probe: ir.Model, v: ir.Value, name: str) -> str:
    """v as a float32 output of the calibration probe; returns its name."""
    cast = ir.node("Cast", [v], {"to": ir.DataType.FLOAT}, name=name)
    if v.producer() is not None and v.producer().graph is probe.graph:
        probe.graph.insert_after(v.producer(), cast)
    else:  # a graph input or initializer: before its first reader
        probe.graph.insert_before(next(iter(v.consumers())), cast)
    out = cast.outputs[0]
    out.name, out.dtype = name, ir.DataType.FLOAT
    probe.graph.outputs.append(out)
    return name


def rotary_tables(node: ir.Node, head_dim: int) -> tuple[np.ndarray, np.ndarray] | str:
    """The op's cos and sin tables [max_positions, rotary_dim / 2], or why the key scales cannot be
    placed after its rotary (they need do_rotary, constant tables and positions 0, 1, ...)."""
    if not _attr(node, "do_rotary", 0):
        return "no rotary inside the op (the key scale input needs do_rotary)"
    if len(node.inputs) > 9 and node.inputs[9] is not None:
        return "the op takes position_ids"
    given = [node.inputs[i] if len(node.inputs) > i else None for i in (7, 8)]
    if any(v is None for v in given):
        return "no cos_cache or sin_cache input"
    tables = [v.const_value for v in given]
    if any(t is None for t in tables):
        return COMPUTED_TABLES
    cos, sin = (t.numpy().astype(np.float32) for t in tables)
    if cos.ndim != 2 or cos.shape != sin.shape or not 0 < 2 * cos.shape[1] <= head_dim:
        return f"cos_cache {cos.shape} does not fit head size {head_dim}"
    return cos, sin


def collect_gqa(model_path: str | os.PathLike, ids: np.ndarray, source: str, *, preset: str, boundary: int = 2,
                skip_layers=None, keep_layers=None, key_scales: bool = True, window: int = DEFAULT_WINDOW,
                max_windows: int | None = None, progress: bool = True) -> tuple[Calibration, list[str]]:
    """Mean rotated key and mean value per compressed layer and KV head over up to max_windows
    (default window_count) windows of `window` tokens, and (key_scales) the key scales. Returns the
    calibration and notes on layers that got no scales."""
    from tqdm import tqdm

    from turboquant.decoder import _NP, DecoderSession
    from turboquant.reference.gqa import rotary

    ids, window, starts = windows(ids, window, max_windows or window_count(window))
    probe = ir.load(model_path)
    plans, _, nodes = plan_gqa_layers(probe, preset, boundary, skip_layers, keep_layers)
    for node in nodes.values():  # ONNX Runtime's CPU kernel rejects the fused Q/K norm of genai's CUDA builds
        if has_fused_qk_norm(node) and fused_norm_problem(node) is None:
            unfuse_qk_norm(node)
        # window-sized caches (genai's sliding_window_cache) from empty ones: ONNX Runtime's present then
        # holds every window position, as the full-length caches of the rewrite do
        node.attributes.pop("sliding_window_cache", None)
    layers = [p for p in plans if p.compressed]
    tables, queries, notes = {}, {}, []
    fp8 = set()  # layers whose scales need no queries
    computed = {}  # layer -> the probe outputs that hold its computed tables (LongRoPE, dynamic scaling)
    for plan in [p for p in layers if key_scales]:
        node = nodes[plan.index]
        found = rotary_tables(node, plan.head_dim)
        if found == COMPUTED_TABLES and plan.key_format != "fp8":
            computed[plan.index] = [_probe_output(probe, node.inputs[i], f"tq_calibration_{t}_{plan.index}")
                                    for i, t in ((7, "cos"), (8, "sin"))]
            found = (None, None)
        if isinstance(found, str):
            notes.append(f"layer {plan.index}: no key scales ({found})")
            continue
        if plan.key_format == "fp8":
            fp8.add(plan.index)
            continue
        tables[plan.index] = (*found, bool(_attr(node, "rotary_interleaved", 0)))
        cast = ir.node("Cast", [node.inputs[0]], {"to": ir.DataType.FLOAT}, name=f"tq_calibration_q_{plan.index}")
        node.graph.insert_before(node, cast)
        out = cast.outputs[0]
        out.name, out.dtype = f"tq_calibration_q_{plan.index}", ir.DataType.FLOAT
        probe.graph.outputs.append(out)
        queries[plan.index] = out.name
    heads = {p.index: (_attr(nodes[p.index], "num_heads", 0), _attr(nodes[p.index], "kv_num_heads", 0)) for p in plans}
    sums = {name: {} for name in ("k", "k2", "v")}
    count, moments = 0, {i: AttentionMoments() for i in queries}
    with tempfile.TemporaryDirectory(prefix="turboquant-calibration-") as tmp:
        path = pathlib.Path(tmp) / "probe.onnx"
        ir.save(probe, path, external_data="probe.onnx.data")  # weights beside it, wherever the model keeps them
        del probe
        sess = DecoderSession(path)
        dims = {p.index: p.head_dim for p in plans}
        # zero-length caches (genai models leave the cache width symbolic); present then holds the window
        empty = {arg.name: np.zeros((1, heads[i][1], 0, dims[i]), _NP[arg.type]) for (i, _), arg in sess.cache_inputs.items()}
        for s in tqdm(starts, desc="calibrating", unit="window", disable=not progress):
            outs = sess.run_all(ids[None, s:s + window], empty, 0)
            for plan in layers:
                i = plan.index
                k = add_cache_sums(sums, outs, sess, i)
                if i in queries:
                    hq = heads[i][0]
                    q = np.asarray(outs[queries[i]], np.float32)[..., :hq * plan.head_dim]
                    q = q.reshape(q.shape[0], q.shape[1], hq, plan.head_dim)
                    table = tables[i]
                    if i in computed:  # the tables the graph computed for this window's length
                        table = (*(np.asarray(outs[n], np.float32) for n in computed[i]), table[2])
                    rows = table[0].shape[0]
                    pos = np.minimum(np.arange(q.shape[1]), rows - 1)[None, :]  # clamped to the table, as the op does
                    q = rotary(q, pos, *table).transpose(0, 2, 1, 3)
                    moments[i].add(q, k, outs[sess.cache_outputs[(i, "value")]], _attr(nodes[i], "scale", 0.0) or None)
            count += window
    mean_k = {p.index: sums["k"][p.index] / count for p in layers}
    scales = {i: m.scales(mean_k[i]) for i, m in moments.items()}
    scales.update({i: fp8_key_scale(key_peaks(sums, i, mean_k[i])) for i in fp8})
    calibration = Calibration({i: m.astype(np.float32) for i, m in mean_k.items()},
                              {p.index: (sums["v"][p.index] / count).astype(np.float32) for p in layers}, count,
                              source, scales, {i: heads[i][0] for i in scales}, window=window)
    return calibration, notes
