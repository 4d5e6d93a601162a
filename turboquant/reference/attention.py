"""Numpy reference of TQAttention (docs/design.md sections 3 and 4), the oracle for the kernels.

Semantics: ONNX Attention (opset 23) over a cache whose past entries are packed. The new tokens'
K/V are attended exactly (in float64 here) and packed into present; past tokens are attended from
their packed form. With key_offset, every key is scored as k - key_offset (softmax cancels the
shift); with value_offset, past values read back as unpack(v) + value_offset.
A query row whose keys are all masked out gives zeros; one with a NaN or +inf score among its
visible keys gives NaN (docs/ops.md, Non-finite input).
GroupQueryAttention's softcap and head_sink (keywords, for reference.gqa): softcap > 0 maps each scaled
score s to softcap * tanh(s / softcap) before any mask; head_sink [Hq] adds exp(sink_h - m) to head h's
softmax denominator, m the larger of the row's largest visible score and sink_h. Both see the scores
of the keys as given: the key offset only changes what is stored.
"""

from __future__ import annotations

import numpy as np

from . import formats
from .numerics import to_f32


def to_bhsd(x: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    """[B, H, S, D] as is; [B, S, H*D] split into heads."""
    if x.ndim == 4:
        return x
    if x.ndim == 3:
        b, s, hd = x.shape
        if num_heads <= 0 or hd % num_heads:
            raise ValueError(f"{name}: last dim {hd} is not a multiple of the head count {num_heads}")
        return x.reshape(b, s, num_heads, hd // num_heads).transpose(0, 2, 1, 3)
    raise ValueError(f"{name}: expected rank 3 or 4, got {x.ndim}")


def attention(
    Q, K, V, attn_mask=None, past_key=None, past_value=None, key_offset=None, value_offset=None, *,
    key_format: str, value_format: str, norm_correction: bool = True, head_dim: int | None = None,
    is_causal: bool = False, scale: float | None = None, q_num_heads: int = 0, kv_num_heads: int = 0,
    fp16_centroids: bool = False, softcap: float = 0.0, head_sink=None,
):
    """Returns (Y, present_key, present_value); Y has Q's dtype and layout. fp16_centroids: past MSE
    keys scored through centroids rounded to fp16, the precision of the CUDA tensor-core split
    kernels (an fp16 cache's: relative 2^-12), which scores of extreme magnitude make visible."""
    q_dtype, three_d = np.asarray(Q).dtype, np.asarray(Q).ndim == 3
    q = to_f32(to_bhsd(np.asarray(Q), q_num_heads, "Q")).astype(np.float64)
    k_new = to_f32(to_bhsd(np.asarray(K), kv_num_heads, "K"))
    v_new = to_f32(to_bhsd(np.asarray(V), kv_num_heads, "V"))
    b, hq, sq, d = q.shape
    hkv = k_new.shape[1]
    dv = v_new.shape[3]
    head_dim = head_dim or d
    koff = np.zeros(d, np.float32) if key_offset is None else np.asarray(key_offset, np.float32)[None, :, None, :]
    voff = np.zeros(dv, np.float32) if value_offset is None else np.asarray(value_offset, np.float32)[None, :, None, :]
    kb, vb = formats.packed_size(key_format, d), formats.packed_size(value_format, dv)
    if past_key is None:
        past_key = np.zeros((b, hkv, 0, kb), np.uint8)
        past_value = np.zeros((b, hkv, 0, vb), np.uint8)
    present_key = np.concatenate([past_key, formats.pack(k_new, key_format, norm_correction, koff)], axis=2)
    present_value = np.concatenate([past_value, formats.pack(v_new, value_format, norm_correction, voff)], axis=2)

    # Keys as scored (offset removed), values as read back (offset restored).
    k_all = np.concatenate([formats.unpack(past_key, key_format, d, fp16_centroids=fp16_centroids), k_new - koff],
                           axis=2).astype(np.float64)
    v_all = np.concatenate([formats.unpack(past_value, value_format, dv, voff), v_new], axis=2).astype(np.float64)
    s_total = k_all.shape[2]
    group = hq // hkv
    k_all = np.repeat(k_all, group, axis=1)
    v_all = np.repeat(v_all, group, axis=1)
    sc = 1.0 / np.sqrt(d) if not scale else float(scale)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k_all) * sc
    if key_offset is not None and (softcap > 0 or head_sink is not None):
        # the true scores (q . k): the offset's shift q . key_offset, which the softmax alone would cancel
        shift = np.einsum("bhqd,hd->bhq", q, np.repeat(koff[0, :, 0].astype(np.float64), group, axis=0)) * sc
        scores = scores + shift[..., None]
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    allowed = np.ones((b, hq, sq, s_total), bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == bool:
            allowed &= np.broadcast_to(m, allowed.shape)
        else:
            scores = scores + np.broadcast_to(to_f32(m).astype(np.float64), scores.shape)
    if is_causal:
        qi = np.arange(sq)[:, None] + (s_total - sq)
        allowed &= np.arange(s_total)[None, :] <= qi
    # Non-finite scores (docs/ops.md, Non-finite input): a visible NaN or +inf score makes its row NaN
    # (softmax's inf - inf); a -inf score weighs 0, as a masked key does.
    poisoned = (allowed & (np.isnan(scores) | (scores == np.inf))).any(-1, keepdims=True)
    scores = np.where(allowed & ~np.isnan(scores), scores, -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        row_max = scores.max(-1, keepdims=True)
        live = np.isfinite(row_max) & ~poisoned
        if head_sink is not None:
            sink = to_f32(np.asarray(head_sink)).astype(np.float64).reshape(1, hq, 1, 1)
            row_max = np.maximum(row_max, sink)
        p = np.exp(scores - np.where(live, row_max, 0.0))
        denom = p.sum(-1, keepdims=True)
        if head_sink is not None:
            denom = denom + np.exp(sink - np.where(live, row_max, 0.0))
        p = np.where(live, p / np.where(live, denom, 1.0), 0.0)
        y = np.einsum("bhqk,bhkd->bhqd", p, v_all)
    y = np.where(poisoned, np.nan, y)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, sq, hq * dv)
    return y.astype(np.float32).astype(q_dtype), present_key, present_value
