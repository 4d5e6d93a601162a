"""The paged reference against the GQA reference: sequences whose blocks are laid out in a pool in a
shuffled order give TQGroupQueryAttention's outputs over the same rows held contiguously."""

import numpy as np
import pytest

from turboquant.reference import formats, group_query_attention, paged_attention, pool_rows


@pytest.mark.parametrize("block_size", [1, 3, 8])
@pytest.mark.parametrize("s", [1, 4])
def test_pool_of_shuffled_blocks_gives_the_contiguous_cache_results(block_size, s):
    rng = np.random.default_rng(block_size * 10 + s)
    b, hkv, hq, d, cap = 3, 2, 4, 32, 24
    lengths = [9, 24, 14]  # totals after the step, s new tokens each
    past_key = formats.pack(rng.standard_normal((b, hkv, cap, d)).astype(np.float32), "mse3")
    past_value = formats.pack(rng.standard_normal((b, hkv, cap, d)).astype(np.float32), "uint4")
    width = max(past_key.shape[-1], past_value.shape[-1]) + 3
    q = rng.standard_normal((b, s, hq * d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    attrs = dict(key_format="mse3", value_format="uint4", num_heads=hq, kv_num_heads=hkv)
    wy, wk, wv = group_query_attention(q, k, v, past_key, past_value, np.array(lengths, np.int32) - 1,
                                       np.array(cap, np.int32), **attrs)

    per_seq = -(-cap // block_size)
    order = rng.permutation(b * per_seq + 2)  # two blocks no sequence holds
    table = order[:b * per_seq].reshape(b, per_seq).astype(np.int32)
    pools = []
    for cache in (past_key, past_value):
        pool = rng.integers(0, 256, (len(order), block_size, hkv, width), dtype=np.uint8)
        rows = pool_rows(pool, hkv, cache.shape[-1])
        for i in range(b):
            for r in range(cap):
                rows[table[i, r // block_size], :, r % block_size] = cache[i, :, r]
        pools.append(pool)
    cu = np.arange(b + 1, dtype=np.int32) * s
    y, pk, pv = paged_attention(q.reshape(b * s, -1), k.reshape(b * s, -1), v.reshape(b * s, -1), *pools, cu,
                                np.array(lengths, np.int32) - s, table, **attrs)
    np.testing.assert_array_equal(y, wy.reshape(b * s, -1))
    for pool, before, want in ((pk, pools[0], wk), (pv, pools[1], wv)):
        rows = pool_rows(pool, hkv, want.shape[-1])
        for i in range(b):
            for r in range(cap):
                np.testing.assert_array_equal(rows[table[i, r // block_size], :, r % block_size], want[i, :, r])
        spare = order[b * per_seq:]
        np.testing.assert_array_equal(pool[spare], before[spare])
