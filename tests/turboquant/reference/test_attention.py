"""The reference attention against torch's scaled_dot_product_attention on the decoded cache."""

import numpy as np
import pytest

from turboquant.reference import attention, formats

torch = pytest.importorskip("torch")


def sdpa(q, k, v, mask_bool, scale):
    """torch SDPA with GQA by repetition; all inputs float64 [B, H, S, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask_bool), scale=scale).numpy()


@pytest.mark.parametrize("kf, vf", [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16")])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_on_decoded_cache(kf, vf, causal, rng):
    b, hq, hkv, sq, sp, d = 2, 8, 2, 3, 11, 64
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, sq, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, sq, d)).astype(np.float32)
    pk = formats.pack(rng.standard_normal((b, hkv, sp, d)).astype(np.float32), kf)
    pv = formats.pack(rng.standard_normal((b, hkv, sp, d)).astype(np.float32), vf)
    y, prk, prv = attention(q, k, v, None, pk, pv, key_format=kf, value_format=vf, is_causal=causal)
    k_all = np.concatenate([formats.unpack(pk, kf, d), k], axis=2).astype(np.float64)
    v_all = np.concatenate([formats.unpack(pv, vf, d), v], axis=2).astype(np.float64)
    st = sp + sq
    mask = np.ones((sq, st), bool)
    if causal:
        mask = np.arange(st)[None, :] <= np.arange(sq)[:, None] + sp
    want = sdpa(q.astype(np.float64), k_all, v_all, mask, 1 / np.sqrt(d))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(prk[:, :, :sp], pk) and np.array_equal(prk[:, :, sp:], formats.pack(k, kf))
    assert np.array_equal(prv[:, :, sp:], formats.pack(v, vf))


def test_3d_layout_equals_4d(rng):
    b, hq, hkv, s, d = 1, 4, 2, 5, 32
    q = rng.standard_normal((b, s, hq * d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv * d)).astype(np.float32)
    y3, pk3, _ = attention(q, k, v, key_format="mse4", value_format="uint4", q_num_heads=hq, kv_num_heads=hkv, is_causal=True)
    split = lambda x, h: x.reshape(b, s, h, d).transpose(0, 2, 1, 3)  # noqa: E731
    y4, pk4, _ = attention(split(q, hq), split(k, hkv), split(v, hkv), key_format="mse4", value_format="uint4", is_causal=True)
    np.testing.assert_allclose(y3, y4.transpose(0, 2, 1, 3).reshape(b, s, hq * d), rtol=1e-6)
    assert np.array_equal(pk3, pk4)


def test_key_offset_leaves_exact_attention_unchanged(rng):
    """With no past, scores come from exact keys: shifting every key by one vector changes nothing."""
    b, h, s, d = 1, 2, 6, 64
    q, k, v = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(3))
    off = rng.standard_normal((h, d)).astype(np.float32)
    y0, _, _ = attention(q, k, v, key_format="mse4", value_format="uint4")
    y1, pk, _ = attention(q, k, v, key_offset=off, key_format="mse4", value_format="uint4")
    np.testing.assert_allclose(y0, y1, rtol=1e-4, atol=1e-5)
    assert np.array_equal(pk, formats.pack(k - off[None, :, None, :], "mse4"))


def test_fully_masked_rows_are_zero(rng):
    q, k, v = (rng.standard_normal((1, 1, 2, 16)).astype(np.float32) for _ in range(3))
    mask = np.array([[True, True], [False, False]])
    y, _, _ = attention(q, k, v, mask, key_format="fp8", value_format="uint4")
    assert np.all(y[0, 0, 1] == 0) and np.all(np.isfinite(y))


@pytest.mark.parametrize("vf", ["mse3", "mse4"])
@pytest.mark.parametrize("nc", [False, True])
def test_norm_correction_covers_mse_values(vf, nc, rng):
    """norm_correction applies to every MSE-packed cache, the values' as well as the keys' (as the op
    and TQPack apply it)."""
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 2, 2, 64)).astype(np.float32)
    _, prk, prv = attention(q, k, v, key_format="mse4", value_format=vf, norm_correction=nc)
    assert np.array_equal(prk, formats.pack(k, "mse4", nc))
    assert np.array_equal(prv, formats.pack(v, vf, nc))
    assert not np.array_equal(prv, formats.pack(v, vf, not nc))
