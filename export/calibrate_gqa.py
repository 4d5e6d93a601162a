"""Calibration of onnxruntime-genai models (com.microsoft GroupQueryAttention, rotary inside the op):
the mean rotated key per layer and KV head, and per-channel key scales tied across rotary pairs.

Offsets. TQGroupQueryAttention subtracts key_offset after its rotary, so the offset is the mean of
the rotated keys, which the original op's present_key output holds: the original model runs in
ONNX Runtime on windows of calibration tokens from empty caches (a prefill: every key is new).

Key scales. Q and K enter the op before the rotary, which turns each channel pair (i, i + R/2, or
2i and 2i + 1 when interleaved; R the rotary dimension) by a position's angle. Multiplying both
channels of a pair by one s commutes with that turn, so queries multiplied and keys divided by
s_pair before the op leave every score unchanged; channels past R are not turned and keep their
own scale. s_pair = (E[k_i^2 + k_j^2] / E[q_i^2 + q_j^2])^(1/4) (k centred): pair energies do not
change under the turn, so the queries are read where the op takes them (before the rotary) and the
keys from present_key (after it), as export/calibrate.py's per-channel rule does for plain exports.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np
import onnx_ir as ir

from .calibrate import Calibration, _add, add_cache_sums, key_scale, windows
from .gqa import _attr, plan_gqa_layers
from .surgery import _initializer, scaled_at_source


def rotary_dim(node: ir.Node, head_dim: int) -> int | None:
    """The channels the op's rotary turns: 0 without do_rotary, else twice cos_cache's last axis;
    None when that axis is not static."""
    if not _attr(node, "do_rotary", 0):
        return 0
    cos = node.inputs[7] if len(node.inputs) > 7 else None
    half = cos.shape[-1] if cos is not None and cos.shape is not None and len(cos.shape) == 2 else None
    if not isinstance(half, int) or not 0 < 2 * half <= head_dim:
        return None
    return 2 * half


def pair_groups(head_dim: int, rotary: int, interleaved: bool) -> np.ndarray:
    """Per channel, the id of the channels that must share its scale: a rotary pair, or itself."""
    groups = np.arange(head_dim)
    r = np.arange(rotary)
    groups[:rotary] = r // 2 if interleaved else r % (rotary // 2)
    groups[rotary:] = rotary // 2 + np.arange(head_dim - rotary)
    return groups


def tie(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each channel of x [..., D] replaced by the sum over its group."""
    sums = np.zeros(x.shape[:-1] + (int(groups.max()) + 1,), x.dtype)
    np.add.at(sums, (..., groups), x)
    return sums[..., groups]


def tied_key_scale(key_sq: np.ndarray, query_sq: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """key_scale over pair energies: both channels of a rotary pair get the same s."""
    return key_scale(tie(key_sq, groups), tie(query_sq, groups))


def collect_gqa(model_path: str | os.PathLike, ids: np.ndarray, source: str, *, preset: str, boundary: int = 2,
                skip_layers=None, keep_layers=None, key_scales: bool = True, window: int = 256,
                max_windows: int = 16, progress: bool = True) -> tuple[Calibration, list[str]]:
    """Mean rotated key and mean value per compressed layer and KV head over up to max_windows
    windows of `window` tokens, and (key_scales) the tied key scales. Returns the calibration and
    notes on layers that got no scales."""
    from tqdm import tqdm

    from turboquant.decoder import _NP, DecoderSession

    ids, window, starts = windows(ids, window, max_windows)
    probe = ir.load(model_path)
    plans, _, nodes = plan_gqa_layers(probe, preset, boundary, skip_layers, keep_layers)
    layers = [p for p in plans if p.compressed]
    groups, queries, notes = {}, {}, []
    for plan in [p for p in layers if key_scales and p.key_format.startswith("mse")]:  # fp8 keys are scale-free
        node = nodes[plan.index]
        rotary = rotary_dim(node, plan.head_dim)
        if rotary is None:
            notes.append(f"layer {plan.index}: no key scales (the rotary dimension of {node.name!r} is not static)")
            continue
        groups[plan.index] = pair_groups(plan.head_dim, rotary, bool(_attr(node, "rotary_interleaved", 0)))
        cast = ir.node("Cast", [node.inputs[0]], {"to": ir.DataType.FLOAT}, name=f"tq_calibration_q_{plan.index}")
        node.graph.insert_before(node, cast)
        out = cast.outputs[0]
        out.name, out.dtype = f"tq_calibration_q_{plan.index}", ir.DataType.FLOAT
        probe.graph.outputs.append(out)
        queries[plan.index] = out.name
    heads = {p.index: (_attr(nodes[p.index], "num_heads", 0), _attr(nodes[p.index], "kv_num_heads", 0)) for p in plans}
    sums = {name: {} for name in ("k", "k2", "v", "q2")}
    count = 0
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
                add_cache_sums(sums, outs, sess, i)
                if i in queries:
                    hq, hkv = heads[i]
                    q = np.asarray(outs[queries[i]], np.float64)[..., :hq * plan.head_dim]
                    q = q.reshape(q.shape[0], q.shape[1], hq, plan.head_dim)
                    q2 = (q * q).sum(axis=(0, 1)).reshape(hkv, hq // hkv, -1).mean(1)
                    _add(sums["q2"], i, q2)
            count += window
    mean_k = {p.index: sums["k"][p.index] / count for p in layers}
    scales = {i: tied_key_scale(sums["k2"][i] / count - mean_k[i] ** 2, sums["q2"][i] / count, groups[i])
              for i in sums["q2"]}
    calibration = Calibration({i: m.astype(np.float32) for i, m in mean_k.items()},
                              {p.index: (sums["v"][p.index] / count).astype(np.float32) for p in layers}, count,
                              source, scales, {i: heads[i][0] for i in scales})
    return calibration, notes


def calibrated_inputs(model: ir.Model, node: ir.Node, index: int, calibration: Calibration, *, key_format: str,
                      dtype: np.dtype, value_offsets: bool, key_scales: bool) -> tuple[list, list[ir.Value]]:
    """The GroupQueryAttention node's inputs with Q multiplied and K divided by the layer's key
    scale (folded into the projection's weights where they are a plain MatMul's, else one Mul on the
    packed QKV, or one on each, inserted before node), and the key_offset
    (value_offset) initializers to append: the offset in the scaled keys' units."""
    inputs = list(node.inputs)
    koff = calibration.keys.get(index)
    voff = calibration.values.get(index) if value_offsets else None
    s = calibration.key_scales.get(index) if key_scales and key_format.startswith("mse") else None  # fp8 keys: scale-free
    if s is not None:
        hq, hkv = _attr(node, "num_heads", 0), _attr(node, "kv_num_heads", 0)
        sq, sk = np.repeat(s, hq // hkv, axis=0).reshape(-1), (1.0 / s).reshape(-1)
        if len(inputs) < 2 or inputs[1] is None:  # packed [B, S, (Hq + 2 Hkv) D]: V's channels stay
            factor = np.concatenate([sq, sk, np.ones_like(sk)])
            inputs[0] = scaled_at_source(model.graph, node, inputs[0], factor.astype(dtype), f"tq_qkv_scaled_{index}")
        else:
            inputs[0] = scaled_at_source(model.graph, node, inputs[0], sq.astype(dtype), f"tq_query_scaled_{index}")
            inputs[1] = scaled_at_source(model.graph, node, inputs[1], sk.astype(dtype), f"tq_key_scaled_{index}")
        if koff is not None:
            koff = koff / s
    extra = []
    if koff is not None or voff is not None:
        shape = (koff if koff is not None else voff).shape
        extra.append(_initializer(model, f"tq_key_offset_{index}",
                                  (koff if koff is not None else np.zeros(shape)).astype(np.float32)))
        if voff is not None:
            extra.append(_initializer(model, f"tq_value_offset_{index}", voff.astype(np.float32)))
    return inputs, extra
