"""The benchmark's ONNX Runtime baselines: GroupQueryAttention on ORT's own quantized caches is
configured as ORT defines it (checked on the CPU provider, which has int8 and int4 caches)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto

from turboquant.bench import baselines


def _run(cache, b=2, hq=8, hkv=2, d=64, s=16):
    model = baselines.gqa_model(hq, hkv, d, TensorProto.FLOAT16, cache=cache)
    feeds = baselines.gqa_feeds(np.random.default_rng(0), b, hq, hkv, d, s, TensorProto.FLOAT16, cache=cache)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return feeds, sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"this onnxruntime has no GroupQueryAttention on a {cache} cache on the CPU: {str(e)[:120]}")


def test_int8_cache_attends_over_the_dequantized_cache():
    b, hq, hkv, d, s = 2, 8, 2, 64, 16
    feeds, (out, present_k, present_v) = _run("int8", b, hq, hkv, d, s)
    assert present_k.shape == (b, hkv, s + 1, d) and present_k.dtype == np.int8
    np.testing.assert_array_equal(present_k[:, :, :s], feeds["past_key"])  # the past kept, the new row appended
    # reference: softmax(q k^T / sqrt(d)) v over the dequantized past and the new token as stored
    scale = feeds["k_scale"][0]
    k = present_k.astype(np.float32) * scale
    v = present_v.astype(np.float32) * feeds["v_scale"][0]
    q = feeds["query"].astype(np.float32).reshape(b, hq, d)
    g = hq // hkv
    want = np.empty((b, hq, d), np.float32)
    for i in range(b):
        for h in range(hq):
            sc = k[i, h // g] @ q[i, h] / np.sqrt(d)
            p = np.exp(sc - sc.max())
            want[i, h] = p @ v[i, h // g] / p.sum()
    np.testing.assert_allclose(out.astype(np.float32).reshape(b, hq, d), want, atol=2e-2, rtol=2e-2)


def test_int4_cache_packs_two_codes_a_byte():
    b, hkv, d, s = 2, 2, 64, 16
    feeds, (out, present_k, _) = _run("int4", b, 8, hkv, d, s)
    assert present_k.shape == (b, hkv, s + 1, d // 2) and present_k.dtype == np.uint8
    np.testing.assert_array_equal(present_k[:, :, :s], feeds["past_key"])
    assert np.isfinite(out.astype(np.float32)).all()
    assert baselines.cache_bytes_per_row(d, TensorProto.FLOAT16, "int4") == d // 2


def test_rotary_gqa_rotates_the_new_query_and_key_with_the_tables():
    # ORT's GQA with do_rotary and rotary_tables' caches equals GQA without rotary fed the query and
    # key rotated in numpy (half-split pairs, position = the past length): the tables' layout is the
    # one ORT reads
    b, hq, hkv, d, s = 1, 2, 1, 16, 3
    feeds = baselines.gqa_feeds(np.random.default_rng(0), b, hq, hkv, d, s, TensorProto.FLOAT, rotary=True)
    cos, sin = feeds["cos_cache"][s], feeds["sin_cache"][s]

    def rotate(x, heads):
        x = x.reshape(heads, d)
        x1, x2 = x[:, : d // 2], x[:, d // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1).reshape(1, 1, heads * d)

    def run(model, f):
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["out"], f)[0]

    with_rotary = run(baselines.gqa_model(hq, hkv, d, TensorProto.FLOAT, rotary=True), feeds)
    plain = {k: v for k, v in feeds.items() if k not in ("cos_cache", "sin_cache")}
    unrotated = run(baselines.gqa_model(hq, hkv, d, TensorProto.FLOAT), plain)
    plain["query"], plain["key"] = rotate(feeds["query"], hq), rotate(feeds["key"], hkv)
    rotated = run(baselines.gqa_model(hq, hkv, d, TensorProto.FLOAT), plain)
    assert np.abs(with_rotary - rotated).max() < 1e-5
    assert np.abs(with_rotary - unrotated).max() > 1e-3  # the rotation changes the result at position 3
