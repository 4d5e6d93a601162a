"""Non-finite input (docs/ops.md, Non-finite input): NaN and +-inf in new keys, values, offsets,
queries and packed pasts give the same packed bytes and the same NaN pattern in TQAttention,
TQGroupQueryAttention, TQPack and TQUnpack as in the numpy reference, on the CPU and (marked gpu)
on CUDA."""

import zlib

import numpy as np
import pytest

from turboquant import node_models
from turboquant.ort import run
from turboquant.reference import attention, formats
from turboquant.reference.gqa import group_query_attention

PAIRS = [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16"), ("mse4", "fp8")]
WHERE = ["Q", "K", "V", "key_offset", "value_offset", "past_key", "past_value"]
SPECIALS = [np.nan, np.inf, -np.inf]
B, HQ, HKV, SQ, SP, D = 2, 4, 2, 3, 5, 32


# Where the CUDA kernels still differ from the contract (run on an H100): an infinite value offset
# (Y's column NaN where the reference's is finite) and the sign of a NaN scale the packers store (the
# GPU's NaN is positive, x86's and numpy's negative). Strict: a CUDA build that agrees fails these marks.
def _same(y, want, spread):
    """The same NaN positions, and the rest within the float32 tolerance of their magnitude."""
    y, want = y.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    ok = ~np.isnan(y)
    np.testing.assert_array_equal(np.isinf(y[ok]), np.isinf(want[ok]))
    finite = ok & np.isfinite(y)
    np.testing.assert_allclose(y[finite], want[finite], rtol=2e-4, atol=2e-4 * spread)


def _inputs(kf, vf, where, value, seed):
    rng = np.random.default_rng(seed)
    f = {"Q": rng.standard_normal((B, HQ, SQ, D)), "K": rng.standard_normal((B, HKV, SQ, D)),
         "V": rng.standard_normal((B, HKV, SQ, D)), "key_offset": rng.standard_normal((HKV, D)) * 0.1,
         "value_offset": rng.standard_normal((HKV, D)) * 0.1, "past_key": rng.standard_normal((B, HKV, SP, D)),
         "past_value": rng.standard_normal((B, HKV, SP, D))}
    f = {k: v.astype(np.float32) for k, v in f.items()}
    if where == "V":  # the first new token, which every row sees (a hidden value is outside the contract)
        f["V"][rng.integers(0, B), rng.integers(0, HKV), 0, rng.integers(0, D)] = value
    else:
        flat = f[where].reshape(-1)
        flat[rng.integers(0, flat.size)] = value  # one element of one tensor
    f["past_key"] = formats.pack(f["past_key"], kf)
    f["past_value"] = formats.pack(f["past_value"], vf)
    return f


@pytest.mark.parametrize("kf, vf", PAIRS)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("value", SPECIALS, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_reference(ort_session, device, kf, vf, where, value, causal):
    f = _inputs(kf, vf, where, value, seed=zlib.crc32(f"{kf}{vf}{where}{value}{causal}".encode()))
    m = node_models.attention_model(q_heads=HQ, kv_heads=HKV, head_dim=D, key_format=kf, value_format=vf,
                                    is_causal=int(causal), offsets=True)
    y, pk, pv = run(ort_session(m, device=device), f)
    wy, wk, wv = attention(f["Q"], f["K"], f["V"], None, f["past_key"], f["past_value"], f["key_offset"],
                           f["value_offset"], key_format=kf, value_format=vf, is_causal=causal)
    np.testing.assert_array_equal(pk, wk)
    np.testing.assert_array_equal(pv, wv)
    read = formats.unpack(f["past_value"], vf, D)  # an infinite past value reads back saturated
    spread = max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(read), 0, read)))))
    _same(y, wy, spread)


def test_a_nan_score_makes_its_row_nan_and_only_its_row(ort_session, device):
    """The contract's two cases on one call: a NaN in one query row, and a NaN key all rows see."""
    f = _inputs("mse4", "uint4", "Q", 0.0, seed=5)
    f["Q"][0, 1, 2, 7] = np.nan  # row (0, 1, 2) only
    m = node_models.attention_model(q_heads=HQ, kv_heads=HKV, head_dim=D, key_format="mse4", value_format="uint4",
                                    is_causal=1, offsets=True)
    y, _, _ = run(ort_session(m, device=device), f)
    nan_rows = np.isnan(y).all(-1)
    assert nan_rows[0, 1, 2] and nan_rows.sum() == 1 and not np.isnan(y[~nan_rows]).any()
    f = _inputs("mse4", "uint4", "Q", 0.0, seed=5)
    f["K"][1, 0, 0, 3] = np.nan  # the first new key of batch 1, head 0: every row of its query heads sees it
    y, _, _ = run(ort_session(m, device=device), f)
    assert np.isnan(y[1, :HQ // HKV]).all() and not np.isnan(y[0]).any() and not np.isnan(y[1, HQ // HKV:]).any()


@pytest.mark.parametrize("kf, vf", [("mse4", "uint4"), ("fp8", "uint3"), ("raw16", "raw16")])
@pytest.mark.parametrize("where", ["query", "key", "value", "key_offset", "value_offset"])
@pytest.mark.parametrize("value", SPECIALS, ids=["nan", "inf", "-inf"])
def test_group_query_attention_matches_reference(ort_session, device, kf, vf, where, value):
    rng = np.random.default_rng(11)
    s, cap, d = 2, 12, D
    m = node_models.gqa_model(q_heads=HQ, kv_heads=HKV, head_dim=d, key_format=kf, value_format=vf, offsets=True)
    width = m.graph.input[3].type.tensor_type.shape.dim[3].dim_value
    past = {n: np.zeros((B, HKV, cap, width), np.uint8) for n in ("past_key", "past_value")}
    for name, fmt in (("past_key", kf), ("past_value", vf)):
        packed = formats.pack(rng.standard_normal((B, HKV, cap, d)).astype(np.float32), fmt)
        past[name][..., :packed.shape[-1]] = packed
    lengths = np.array([7, 5])
    feeds = {**past, "seqlens_k": (lengths - 1).astype(np.int32), "total_sequence_length": np.array(7, np.int32),
             "query": rng.standard_normal((B, s, HQ * d)).astype(np.float32),
             "key": rng.standard_normal((B, s, HKV * d)).astype(np.float32),
             "value": rng.standard_normal((B, s, HKV * d)).astype(np.float32),
             "key_offset": (rng.standard_normal((HKV, d)) * 0.1).astype(np.float32),
             "value_offset": (rng.standard_normal((HKV, d)) * 0.1).astype(np.float32)}
    if where == "value":  # the step's first token, which every row sees
        feeds["value"][rng.integers(0, B), 0, rng.integers(0, HKV * d)] = value
    else:
        flat = feeds[where].reshape(-1)
        flat[rng.integers(0, flat.size)] = value
    y, pk, pv = run(ort_session(m, device=device), feeds)
    wy, wk, wv = group_query_attention(
        feeds["query"], feeds["key"], feeds["value"], feeds["past_key"], feeds["past_value"], feeds["seqlens_k"],
        feeds["total_sequence_length"], key_offset=feeds["key_offset"], value_offset=feeds["value_offset"],
        key_format=kf, value_format=vf, num_heads=HQ, kv_num_heads=HKV)
    for i, n in enumerate(lengths):  # the rows the step wrote (the rest of the buffer is the op's to leave)
        np.testing.assert_array_equal(pk[i, :, n - s:n], wk[i, :, n - s:n])
        np.testing.assert_array_equal(pv[i, :, n - s:n], wv[i, :, n - s:n])
    _same(y, wy, 1.0)


@pytest.mark.parametrize("fmt", ["mse3", "mse4", "fp8", "uint3", "uint4", "raw16"])
@pytest.mark.parametrize("offset", [False, True])
def test_pack_and_unpack_match_reference(ort_session, device, fmt, offset):
    """Vectors holding NaN, +inf, -inf (alone and together), values beyond fp16 and fp8, and (with
    an offset) NaN and inf in the offset: TQPack's bytes and TQUnpack's floats are the reference's."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 2, 8, D)).astype(np.float32)
    x[0, 0, 0, 1] = np.nan
    x[0, 0, 1, 2] = np.inf
    x[0, 0, 2, 3] = -np.inf
    x[0, 0, 3, 4:6] = [np.inf, -np.inf]
    x[0, 0, 4, :] = np.nan
    x[0, 0, 5, 6] = 1e30
    x[0, 0, 6, 7] = -np.nan
    off = None
    if offset:
        off = (rng.standard_normal((2, D)) * 0.1).astype(np.float32)
        off[1, 3] = np.nan
        off[1, 9] = np.inf
    pm = node_models.pack_model(fmt, D, offset_shape=None if off is None else off.shape)
    um = node_models.unpack_model(fmt, D, offset_shape=None if off is None else off.shape)
    feeds = {"x": x} if off is None else {"x": x, "offset": off}
    (packed,) = run(ort_session(pm, device=device), feeds)
    np.testing.assert_array_equal(packed, formats.pack(x, fmt, offset=None if off is None else off[:, None, :]))
    if fmt in ("fp8", "raw16"):  # the -NaN element stored as the one NaN of docs/ops.md, its sign dropped
        assert list(packed[0, 0, 6, 7:8] if fmt == "fp8" else packed[0, 0, 6, 14:16]) == ([0x7F] if fmt == "fp8" else [0x00, 0x7E])
    ufeeds = {"packed": packed} if off is None else {"packed": packed, "offset": off}
    (back,) = run(ort_session(um, device=device), ufeeds)
    want = formats.unpack(packed, fmt, D, None if off is None else off[:, None, :])
    np.testing.assert_array_equal(np.isnan(back), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(back[ok], want[ok], rtol=1e-6, atol=0)
