"""Numpy reference of TQPagedAttention: com.microsoft PagedAttention over pools of packed KV blocks.

Semantics (as ORT's PagedAttention): query [num_tokens, Hq*D] (or Q, K and V packed in query when key
and value are absent) holds the new tokens of B sequences back to back, sequence b's being rows
cumulative_sequence_length[b] .. cumulative_sequence_length[b + 1] - 1, after past_seqlens[b] tokens
already cached. key_cache/value_cache uint8 [num_blocks, block_size, Hp, Wp] (one shape) are pools of
blocks of block_size * Hp * Wp bytes: position r of sequence b is slot s = r % block_size of block
block_table[b, r // block_size], KV head h's row of it at byte (h * block_size + s) * R of the block (R
the format's packed size; bytes past Hkv * block_size * R are unused). Each sequence is TQGroupQueryAttention's (reference.gqa) with
its cached rows gathered from the pool as its past: rotary at positions past + s, causal attention to
the packed past and the exact new tokens, local_window_size, softcap, head_sink, key_offset,
value_offset and key_scale as there. The new tokens are packed into their slots; every other byte of
the pools is returned as it was. Refused: a sequence that
needs a block its table does not map (-1, outside the pool, or beyond max_blocks), a block held by two
sequences or twice, lengths that do not add up to num_tokens, positions beyond the rotary table.
"""

from __future__ import annotations

import numpy as np

from . import formats
from .gqa import group_query_attention

OP = "TQPagedAttention"


def _check(cu, past, table, tokens, num_blocks, block_size, max_positions):
    b = len(past)
    if len(cu) != b + 1 or cu[0] != 0 or cu[-1] != tokens or (np.diff(cu) < 0).any():
        raise ValueError(f"{OP}: cumulative_sequence_length {list(cu)} must rise from 0 to the {tokens} tokens")
    if (past < 0).any():
        raise ValueError(f"{OP}: past_seqlens {list(past)} must be >= 0")
    held = {}
    for i in range(b):
        total = int(past[i] + cu[i + 1] - cu[i])
        blocks = -(-total // block_size)
        if blocks > table.shape[1]:
            raise ValueError(f"{OP}: sequence {i} holds {total} tokens: {blocks} blocks of {block_size}, more than "
                             f"the {table.shape[1]} columns of 'block_table'")
        if max_positions is not None and total > max_positions:
            raise ValueError(f"{OP}: position {total - 1} of sequence {i} is beyond the {max_positions} rows of "
                             f"'cos_cache'")
        for j in range(blocks):
            blk = int(table[i, j])
            if not 0 <= blk < num_blocks:
                raise ValueError(f"{OP}: block_table[{i}, {j}] = {blk} must be a block of the pool, in "
                                 f"[0, {num_blocks})")
            if blk in held:
                raise ValueError(f"{OP}: block {blk} is held by sequence {held[blk]} and again by sequence {i}")
            held[blk] = i


def pool_rows(pool, kv_heads: int, row_bytes: int):
    """[num_blocks, Hkv, block_size, R]: the rows a pool [num_blocks, block_size, Hp, Wp] holds, as a view
    (block n's first Hkv * block_size * R bytes, head-major)."""
    n, bs = pool.shape[:2]
    rows = pool.reshape(n, -1)[:, :kv_heads * bs * row_bytes].reshape(n, kv_heads, bs, row_bytes)
    assert np.shares_memory(rows, pool)
    return rows


def paged_attention(
    query, key=None, value=None, key_cache=None, value_cache=None, cumulative_sequence_length=None,
    past_seqlens=None, block_table=None, cos_cache=None, sin_cache=None, key_offset=None, value_offset=None,
    key_scale=None, *, key_format: str, value_format: str, norm_correction: bool = True, num_heads: int,
    kv_num_heads: int, scale: float | None = None, do_rotary: bool = False, rotary_interleaved: bool = False,
    local_window_size: int = -1, softcap: float = 0.0, head_sink=None,
):
    """Returns (output [num_tokens, Hq*D], key_cache_out, value_cache_out)."""
    query = np.asarray(query)
    tokens, hidden = query.shape
    hq, hkv = num_heads, kv_num_heads
    packed = key is None
    d = hidden // (hq + 2 * hkv) if packed else hidden // hq
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    cu = np.asarray(cumulative_sequence_length, np.int64).reshape(-1)
    past = np.asarray(past_seqlens, np.int64).reshape(-1)
    table = np.asarray(block_table, np.int64)
    _check(cu, past, table, tokens, num_blocks, block_size, cos_cache.shape[0] if do_rotary else None)
    kb, vb = formats.packed_size(key_format, d), formats.packed_size(value_format, d)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"{OP}: value_cache {value_cache.shape} must have key_cache's shape {key_cache.shape}")
    slot = key_cache.shape[2] * key_cache.shape[3]
    if hkv * max(kb, vb) > slot:
        raise ValueError(f"{OP}: the pools' slots of {slot} bytes cannot hold {hkv} rows of {max(kb, vb)} bytes")
    key_out, value_out = key_cache.copy(), value_cache.copy()
    key_rows, value_rows = pool_rows(key_out, hkv, kb), pool_rows(value_out, hkv, vb)  # views: written through
    y = np.zeros((tokens, hq * d), query.dtype)
    attrs = dict(key_format=key_format, value_format=value_format, norm_correction=norm_correction,
                 num_heads=hq, kv_num_heads=hkv, scale=scale, do_rotary=do_rotary,
                 rotary_interleaved=rotary_interleaved, local_window_size=local_window_size, softcap=softcap,
                 head_sink=head_sink)
    for i in range(len(past)):
        first, s, n = int(cu[i]), int(cu[i + 1] - cu[i]), int(past[i])
        if s == 0:
            continue
        rows = np.arange(n + s)
        blocks, slots = table[i, rows // block_size], rows % block_size
        # [1, Hkv, n + s, R]: the sequence's cached rows (and the slots its new rows will take) in order
        seq_key = key_rows[blocks, :, slots].transpose(1, 0, 2)[None]
        seq_value = value_rows[blocks, :, slots].transpose(1, 0, 2)[None]
        q = query[None, first:first + s]
        k = None if packed else np.asarray(key)[None, first:first + s]
        v = None if packed else np.asarray(value)[None, first:first + s]
        yi, pk, pv = group_query_attention(
            q, k, v, seq_key, seq_value, np.array([n + s - 1], np.int32), np.array(n + s, np.int32), cos_cache,
            sin_cache, None, key_offset, value_offset, key_scale, **attrs)
        y[first:first + s] = yi[0]
        key_rows[blocks[n:], :, slots[n:]] = pk[0, :, n:].transpose(1, 0, 2)
        value_rows[blocks[n:], :, slots[n:]] = pv[0, :, n:].transpose(1, 0, 2)
    return y, key_out, value_out
