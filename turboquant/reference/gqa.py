"""Numpy reference of TQGroupQueryAttention: com.microsoft GroupQueryAttention over packed caches.

Semantics (as ORT's GroupQueryAttention): query [B, S, Hq*D], or Q, K and V packed in query when key
and value are absent; past_key/past_value uint8 [B, Hkv, max_length, W] with W >= the packed size
(bytes past it are padding); sequence b has past_b = 0 when S == total_sequence_length (a first
prompt), else seqlens_k[b] + 1 - S past tokens. With do_rotary, Q and the new K are turned by the
rotary embedding at positions past_b + s (or position_ids), in float32, then (key_scale [Hkv, D])
Q's channels multiplied by their KV head's key_scale row and K's divided by it, rounded to Q's dtype.
The new tokens are packed into rows past_b .. past_b + S - 1 of present (the past buffer itself when
it is shared; present has max(max_length, total_sequence_length) rows), and each query attends
causally to its sequence's packed past and the exact new tokens, through reference.attention.
local_window_size W > 0: the query at position p sees keys p - W + 1 .. p only (W keys, itself
included); softcap and head_sink as in reference.attention (ORT's GroupQueryAttention's definitions).

sliding_window_cache (ORT's window-sized layout, which needs W > 0 and C = past_key.shape[2] >= W):
sequence b holds T = seqlens_k[b] + 1 tokens after the call (right padding is refused) and the
rotary turns them at their absolute positions; rows [0, L(P)) of the past hold its last L(P) past
positions in order (window_cache_end below, G = C - W + 1), so the new tokens attend to those rows
(they cover the window) and themselves; present has C rows: the last L(T) of the resident rows and
the new ones in rows [0, L(T)), new rows' padding and rows [L(T), C) zeros.
"""

from __future__ import annotations

import numpy as np

from . import formats
from .attention import attention
from .numerics import to_f32


def rotary(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool,
           scale: np.ndarray | None = None, divide: bool = False) -> np.ndarray:
    """x [B, S, H, D] turned at positions [B, S]; cos/sin [max_positions, rotary_dim / 2]; then, in
    float32, multiplied (divide: divided) by scale [H, D]."""
    half = cos.shape[1]
    xf = to_f32(x).copy()
    c = to_f32(cos)[positions][:, :, None, :]
    s = to_f32(sin)[positions][:, :, None, :]
    if interleaved:
        a, b = xf[..., 0:2 * half:2].copy(), xf[..., 1:2 * half:2].copy()
        xf[..., 0:2 * half:2], xf[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = xf[..., :half].copy(), xf[..., half:2 * half].copy()
        xf[..., :half], xf[..., half:2 * half] = a * c - b * s, b * c + a * s
    if scale is not None:
        xf = xf / scale if divide else xf * scale
    return xf.astype(x.dtype)


def window_cache_end(tokens: int, capacity: int, window: int) -> int:
    """L(T): the rows T tokens occupy in a window-sized buffer of `capacity` rows."""
    if tokens <= capacity:
        return tokens
    gap = capacity - window + 1
    return tokens - gap * -(-(tokens - capacity) // gap)


def past_lengths(seqlens_k, new_len: int, total: int) -> np.ndarray:
    seqlens_k = np.asarray(seqlens_k, np.int64).reshape(-1)
    if new_len == total:
        return np.zeros_like(seqlens_k)
    return seqlens_k + 1 - new_len


def group_query_attention(
    query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None, total_sequence_length=None,
    cos_cache=None, sin_cache=None, position_ids=None, key_offset=None, value_offset=None, key_scale=None, *,
    key_format: str, value_format: str, norm_correction: bool = True, num_heads: int, kv_num_heads: int,
    scale: float | None = None, do_rotary: bool = False, rotary_interleaved: bool = False,
    local_window_size: int = -1, softcap: float = 0.0, head_sink=None, sliding_window_cache: bool = False,
):
    """Returns (output [B, S, Hq*D], present_key, present_value)."""
    query = np.asarray(query)
    b, s, hidden = query.shape
    hq, hkv = num_heads, kv_num_heads
    if key is None:
        d = hidden // (hq + 2 * hkv)
        q = query[..., :hq * d]
        key, value = query[..., hq * d:(hq + hkv) * d], query[..., (hq + hkv) * d:]
    else:
        d = hidden // hq
        q = query
    q = q.reshape(b, s, hq, d)
    k = np.asarray(key).reshape(b, s, hkv, d)
    v = np.asarray(value).reshape(b, s, hkv, d)
    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    if local_window_size == 0 or local_window_size < -1:
        raise ValueError(f"TQGroupQueryAttention: attribute 'local_window_size' must be -1 (no window) or positive, "
                         f"got {local_window_size}")
    if not (np.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"TQGroupQueryAttention: attribute 'softcap' must be finite and >= 0, got {softcap}")
    if sliding_window_cache:
        if local_window_size <= 0:
            raise ValueError("TQGroupQueryAttention: sliding_window_cache=1 requires local_window_size > 0.")
        if past_key.shape[2] < local_window_size:
            raise ValueError(f"TQGroupQueryAttention: sliding_window_cache: KV cache capacity ({past_key.shape[2]}) "
                             f"must be at least local_window_size ({local_window_size}).")
        past = np.asarray(seqlens_k, np.int64).reshape(-1) + 1 - s
        if (past < 0).any():
            raise ValueError(f"TQGroupQueryAttention: seqlens_k {list(past + s - 1)} shorter than the {s} new tokens")
    else:
        past = past_lengths(seqlens_k, s, total)
    if key_scale is not None and not do_rotary:
        raise ValueError("TQGroupQueryAttention: input 'key_scale' needs do_rotary = 1")
    if do_rotary:
        positions = (np.asarray(position_ids, np.int64) if position_ids is not None
                     else past[:, None] + np.arange(s)[None, :])
        ks = None if key_scale is None else np.asarray(key_scale, np.float32)
        q = rotary(q, positions, cos_cache, sin_cache, rotary_interleaved,
                   None if ks is None else np.repeat(ks, hq // hkv, axis=0))
        k = rotary(k, positions, cos_cache, sin_cache, rotary_interleaved, ks, divide=True)
    rows = max(past_key.shape[2], total)
    kb, vb = formats.packed_size(key_format, d), formats.packed_size(value_format, d)
    common = dict(key_format=key_format, value_format=value_format, norm_correction=norm_correction, is_causal=True,
                  scale=scale, q_num_heads=hq, kv_num_heads=hkv, softcap=softcap, head_sink=head_sink)
    if sliding_window_cache:
        return _windowed(q, k, v, past_key, past_value, past, key_offset, value_offset, local_window_size, common,
                         query.dtype)

    def grown(cache):
        out = np.zeros((b, hkv, rows, cache.shape[3]), np.uint8)
        out[:, :, :cache.shape[2]] = cache
        return out

    present_key, present_value = grown(past_key), grown(past_value)
    y = np.zeros((b, s, hq, d), query.dtype)
    for i in range(b):
        n = int(past[i])
        window = None
        if local_window_size > 0:  # query s is at position n + s; key j visible from n + s - W + 1 on
            window = np.arange(n + s)[None, :] > (n + np.arange(s))[:, None] - local_window_size
        yi, pk, pv = attention(
            q[i:i + 1].transpose(0, 2, 1, 3), k[i:i + 1].transpose(0, 2, 1, 3), v[i:i + 1].transpose(0, 2, 1, 3),
            window, past_key[i:i + 1, :, :n, :kb], past_value[i:i + 1, :, :n, :vb], key_offset, value_offset,
            **common)
        y[i] = yi[0].transpose(1, 0, 2)
        present_key[i, :, n:n + s, :kb] = pk[0, :, n:]
        present_value[i, :, n:n + s, :vb] = pv[0, :, n:]
    return y.reshape(b, s, hq * d), present_key, present_value


def _windowed(q, k, v, past_key, past_value, past, key_offset, value_offset, window, common, dtype):
    b, s, hq, d = q.shape
    hkv, cap = past_key.shape[1], past_key.shape[2]
    kb, vb = formats.packed_size(common["key_format"], d), formats.packed_size(common["value_format"], d)
    present_key, present_value = np.zeros_like(past_key), np.zeros_like(past_value)
    y = np.zeros((b, s, hq, d), dtype)
    for i in range(b):
        n = window_cache_end(int(past[i]), cap, window)  # resident rows: absolute positions past - n .. past - 1
        keep = window_cache_end(int(past[i]) + s, cap, window)
        visible = np.arange(n + s)[None, :] > (n + np.arange(s))[:, None] - window
        yi, pk, pv = attention(
            q[i:i + 1].transpose(0, 2, 1, 3), k[i:i + 1].transpose(0, 2, 1, 3), v[i:i + 1].transpose(0, 2, 1, 3),
            visible, past_key[i:i + 1, :, :n, :kb], past_value[i:i + 1, :, :n, :vb], key_offset, value_offset, **common)
        y[i] = yi[0].transpose(1, 0, 2)
        for present, past_rows, new, nb in ((present_key, past_key, pk, kb), (present_value, past_value, pv, vb)):
            rows = np.zeros((hkv, n + s, past_rows.shape[3]), np.uint8)
            rows[:, :n] = past_rows[i, :, :n]  # padding bytes as they were
            rows[:, n:, :nb] = new[0, :, n:]
            present[i, :, :keep] = rows[:, n + s - keep:]
    return y.reshape(b, s, hq * d), present_key, present_value
