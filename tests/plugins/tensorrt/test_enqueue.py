"""The plugins' enqueue on device buffers against the ORT CUDA ops: packing and TQGroupQueryAttention
byte for byte, TQAttention numerically (both run ops/cuda, so agreement is tight). Needs a GPU,
torch and onnxruntime-gpu."""

import numpy as np
import pytest
from onnx import TensorProto

from turboquant import node_models
from turboquant.config import ALL_FORMATS, TQ_PRESETS, TurboQuantConfig, packed_size
from turboquant.ort import run
from turboquant.reference.numerics import bfloat16

from .conftest import torch_cuda_reason

pytestmark = pytest.mark.gpu

NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: bfloat16}
ONNX_DTYPES = list(NP)


@pytest.fixture(scope="module")
def torch():
    reason = torch_cuda_reason()
    if reason:
        pytest.skip(f"GPU test skipped: {reason}")
    import torch

    return torch


def on_gpu(torch, a: np.ndarray):
    if a.dtype == bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def to_numpy(t):
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(bfloat16)
    return t.cpu().numpy()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("dtype", ONNX_DTYPES)
@pytest.mark.parametrize("d, offset", [(64, False), (128, True), (80, True)])
def test_pack_and_unpack_match_ort_cuda_byte_for_byte(trt, torch, ort_session, fmt, dtype, d, offset):
    rng = np.random.default_rng(d + dtype)
    x = (rng.standard_normal((2, 3, 17, d)) * 2 + 0.5).astype(np.float32).astype(NP[dtype])
    off = rng.standard_normal((3, d)).astype(np.float32) if offset else None
    pack_sess = ort_session(node_models.pack_model(fmt, d, dtype, offset_shape=(3, d) if offset else None), device="cuda")
    want = run(pack_sess, {"x": x, **({"offset": off} if offset else {})})[0]

    plugin = trt.create("TQPack", format=fmt, head_dim=d, norm_correction=1)
    packed = torch.zeros(want.shape, dtype=torch.uint8, device="cuda")
    inputs = [on_gpu(torch, x)] + ([on_gpu(torch, off)] if offset else [])
    assert plugin.enqueue(inputs, [packed]) == 0
    torch.cuda.synchronize()
    np.testing.assert_array_equal(packed.cpu().numpy(), want)

    unpack_sess = ort_session(node_models.unpack_model(fmt, d, dtype, offset_shape=(3, d) if offset else None), device="cuda")
    want_x = run(unpack_sess, {"packed": want, **({"offset": off} if offset else {})})[0]
    un = trt.create("TQUnpack", format=fmt, head_dim=d, dtype=dtype)
    out = on_gpu(torch, np.zeros_like(want_x))
    assert un.enqueue([packed] + inputs[1:], [out]) == 0
    torch.cuda.synchronize()
    np.testing.assert_array_equal(to_numpy(out).view(np.uint8), want_x.view(np.uint8))


CASES = [  # preset, dtype, layout, past, new, queries, mask, offsets, causal
    ("turboquant_4bit_nc", TensorProto.FLOAT16, "bhsd", 300, 1, 1, None, False, 0),
    ("turboquant_k8v4", TensorProto.BFLOAT16, "bhsd", 1000, 1, 1, TensorProto.BOOL, True, 0),
    ("turboquant_k3v4_nc", TensorProto.FLOAT, "bsd", 129, 5, 5, TensorProto.FLOAT, False, 1),
    ("turboquant_3bit_nc", TensorProto.FLOAT16, "bhsd", 4000, 1, 1, None, True, 0),
    ("turboquant_4bit_nc", TensorProto.FLOAT16, "bhsd", 0, 64, 64, None, False, 1),
]


@pytest.mark.parametrize("preset, dtype, layout, past, new, sq, mask, offsets, causal", CASES)
def test_attention_matches_ort_cuda(trt, torch, ort_session, preset, dtype, layout, past, new, sq, mask, offsets, causal):
    b, hq, hkv, d = 2, 8, 2, 128
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    kb, vb = packed_size(cfg.key_format, d), packed_size(cfg.value_format, d)
    rng = np.random.default_rng(past + new)
    t = NP[dtype]
    if layout == "bhsd":
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(t) for s in [(b, hq, sq, d), (b, hkv, new, d), (b, hkv, new, d)])
    else:
        q, k, v = (rng.standard_normal(s).astype(np.float32).astype(t) for s in [(b, sq, hq * d), (b, new, hkv * d), (b, new, hkv * d)])
    pk = rng.integers(0, 256, (b, hkv, past, kb), dtype=np.uint8)
    pv = rng.integers(0, 256, (b, hkv, past, vb), dtype=np.uint8)
    # valid scales in the packed vectors: pack real vectors instead of random bytes
    if past:
        from turboquant.reference import formats

        pk = formats.pack(rng.standard_normal((b, hkv, past, d)).astype(np.float32), cfg.key_format, cfg.norm_correction)
        pv = formats.pack(rng.standard_normal((b, hkv, past, d)).astype(np.float32), cfg.value_format)
    feeds = {"Q": q, "K": k, "V": v}
    if mask is not None:
        m = rng.random((b, 1, sq, past + new)) > 0.2
        m[..., -1] = True
        feeds["attn_mask"] = m if mask == TensorProto.BOOL else np.where(m, 0.0, -1e4).astype(np.float32)
    feeds.update(past_key=pk, past_value=pv)
    if offsets:
        feeds.update(key_offset=rng.standard_normal((hkv, d)).astype(np.float32),
                     value_offset=rng.standard_normal((hkv, d)).astype(np.float32))
    model = node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                                   value_format=cfg.value_format, dtype=dtype, layout=layout, mask=mask, offsets=offsets,
                                   norm_correction=int(cfg.norm_correction), is_causal=causal)
    y, present_k, present_v = run(ort_session(model, device="cuda"), feeds)

    fields = dict(key_format=cfg.key_format, value_format=cfg.value_format, norm_correction=int(cfg.norm_correction),
                  is_causal=causal, has_mask=int(mask is not None))
    if layout == "bsd":
        fields.update(q_num_heads=hq, kv_num_heads=hkv)
    plugin = trt.create("TQAttention", **fields)
    inputs = [on_gpu(torch, feeds[n]) for n in feeds]  # absent optional inputs left out, as --target tensorrt does
    outs = [on_gpu(torch, np.zeros_like(y)), torch.zeros(present_k.shape, dtype=torch.uint8, device="cuda"),
            torch.zeros(present_v.shape, dtype=torch.uint8, device="cuda")]
    descs = lambda ts: [(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in ts]  # noqa: E731
    ws_bytes = plugin.workspace(descs(inputs), descs(outs))
    assert ws_bytes >= 0
    ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    assert plugin.enqueue(inputs, outs, ws) == 0
    torch.cuda.synchronize()
    np.testing.assert_array_equal(outs[1].cpu().numpy(), present_k)
    np.testing.assert_array_equal(outs[2].cpu().numpy(), present_v)
    got = to_numpy(outs[0]).astype(np.float32)
    tol = 2e-2 if dtype == TensorProto.BFLOAT16 else 2e-3
    np.testing.assert_allclose(got, y.astype(np.float32), rtol=tol, atol=tol)


def test_attention_enqueue_refuses_bad_shapes(trt, torch, capfd):
    plugin = trt.create("TQAttention", key_format="mse4", value_format="uint4")
    q = torch.zeros((1, 4, 1, 64), dtype=torch.float16, device="cuda")
    k = torch.zeros((1, 3, 1, 64), dtype=torch.float16, device="cuda")  # 4 query heads over 3 kv heads
    past = torch.zeros((1, 3, 5, packed_size("mse4", 64)), dtype=torch.uint8, device="cuda")
    pv = torch.zeros((1, 3, 5, packed_size("uint4", 64)), dtype=torch.uint8, device="cuda")
    outs = [torch.zeros_like(q), torch.zeros((1, 3, 6, past.shape[3]), dtype=torch.uint8, device="cuda"),
            torch.zeros((1, 3, 6, pv.shape[3]), dtype=torch.uint8, device="cuda")]
    assert plugin.enqueue([q, k, k, past, pv], outs) != 0
    assert "multiple of the kv head count" in capfd.readouterr().err


# TQGroupQueryAttention: the plugin updates its buffers in place (present aliased to past), the ORT
# CUDA op is run with separate present buffers fed back as the next past; the two must agree byte
# for byte, outputs included (the same ops/cuda launcher on the same device and SM count).
GQA_STEPS = {  # batch, capacity, the prompt's lengths (right padded to the longest), then each later call's new tokens
    "short": (3, 24, [9, 6, 4], [1, 1, 1, 4, 1]),
    "long": (2, 272, [200, 131], [1, 1, 5, 1]),
    "one": (1, 40, [1], [1, 1, 3]),
}


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("steps", list(GQA_STEPS))
def test_gqa_matches_ort_cuda_byte_for_byte(trt, torch, ort_session, preset, dtype, rotary, steps):
    b, capacity, prompt, later = GQA_STEPS[steps]
    hq, hkv, d = 8, 2, 128
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    # genai's builder packs QKV and rotates in the op, and its rewrite calibrates: offsets and key scales;
    # the other layout without rotary or calibration
    packed = calibrated = rotary
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                             value_format=cfg.value_format, dtype=dtype, packed_qkv=packed, rotary_dim=d if rotary else 0,
                             offsets=calibrated, key_scale=calibrated, norm_correction=int(cfg.norm_correction))
    session = ort_session(model, device="cuda")
    plugin = trt.create("TQGroupQueryAttention", key_format=cfg.key_format, value_format=cfg.value_format,
                        norm_correction=int(cfg.norm_correction), num_heads=hq, kv_num_heads=hkv, do_rotary=int(rotary),
                        packed_qkv=int(packed))
    rng = np.random.default_rng(len(prompt) * 7 + capacity + dtype)
    t = NP[dtype]
    width = max(packed_size(cfg.key_format, d), packed_size(cfg.value_format, d))
    past = {n: np.zeros((b, hkv, capacity, width), np.uint8) for n in ("past_key", "past_value")}  # genai zeroes them
    buffers = {n: torch.zeros(past[n].shape, dtype=torch.uint8, device="cuda") for n in past}
    tables = {}
    if rotary:
        angles = rng.uniform(0, 6.3, (capacity, d // 2))
        tables = {"cos_cache": np.cos(angles).astype(np.float32).astype(t), "sin_cache": np.sin(angles).astype(np.float32).astype(t)}
    if calibrated:
        tables.update(key_offset=rng.standard_normal((hkv, d)).astype(np.float32),
                      value_offset=rng.standard_normal((hkv, d)).astype(np.float32),
                      key_scale=np.exp(rng.uniform(-1.4, 1.4, (hkv, d))).astype(np.float32))
    lengths, s, first = list(prompt), max(prompt), True
    for new in [None] + later:
        if new is not None:
            lengths, s, first = [n + new for n in lengths], new, False
        total = s if first else max(lengths)
        hidden = (hq + 2 * hkv) * d if packed else hq * d
        feeds = {"query": rng.standard_normal((b, s, hidden)).astype(np.float32).astype(t)}
        if not packed:
            feeds["key"], feeds["value"] = (rng.standard_normal((b, s, hkv * d)).astype(np.float32).astype(t) for _ in "kv")
        feeds.update(past, seqlens_k=np.array(lengths, np.int32) - 1, total_sequence_length=np.array(total, np.int32))
        feeds.update(tables)
        y, present_k, present_v = run(session, feeds)

        inputs = [on_gpu(torch, feeds["query"])] + ([] if packed else [on_gpu(torch, feeds["key"]), on_gpu(torch, feeds["value"])])
        inputs += [buffers["past_key"], buffers["past_value"], on_gpu(torch, feeds["seqlens_k"]),
                   torch.empty((0, total), dtype=torch.int32, device="cuda")]  # the length carrier
        inputs += [on_gpu(torch, tables[n]) for n in ("cos_cache", "sin_cache", "key_offset", "value_offset", "key_scale")
                   if n in tables]
        outs = [on_gpu(torch, np.zeros_like(y)), buffers["past_key"], buffers["past_value"]]  # present aliases past
        descs = [(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in inputs]
        out_descs = [(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in outs]
        ws = torch.empty(max(plugin.workspace(descs, out_descs), 1), dtype=torch.uint8, device="cuda")
        assert plugin.enqueue(inputs, outs, ws) == 0
        torch.cuda.synchronize()
        where = f"{steps} step with {s} new tokens, lengths {lengths}"
        np.testing.assert_array_equal(buffers["past_key"].cpu().numpy(), present_k, err_msg=where)
        np.testing.assert_array_equal(buffers["past_value"].cpu().numpy(), present_v, err_msg=where)
        got = to_numpy(outs[0]).view(np.uint8).reshape(b, s, -1)
        want = y.view(np.uint8).reshape(b, s, -1)
        for i, n in enumerate(lengths):  # a padded prompt's positions past its length are unspecified (as in ORT)
            rows = n if first else s
            np.testing.assert_array_equal(got[i, :rows], want[i, :rows], err_msg=f"{where}, sequence {i}")
        past = {"past_key": present_k, "past_value": present_v}


def test_gqa_enqueue_refuses_a_total_beyond_the_buffers(trt, torch, capfd):
    plugin = trt.create("TQGroupQueryAttention", num_heads=4, kv_num_heads=2, packed_qkv=1)
    w = max(packed_size("mse4", 64), packed_size("uint4", 64))
    q = torch.zeros((1, 1, 8 * 64), dtype=torch.float16, device="cuda")
    pk = torch.zeros((1, 2, 16, w), dtype=torch.uint8, device="cuda")
    pv = torch.zeros_like(pk)
    seqlens = torch.tensor([16], dtype=torch.int32, device="cuda")
    carrier = torch.empty((0, 17), dtype=torch.int32, device="cuda")
    assert plugin.enqueue([q, pk, pv, seqlens, carrier], [torch.zeros((1, 1, 256), dtype=torch.float16, device="cuda"), pk, pv]) != 0
    assert "total_sequence_length (17) is beyond the 16 rows" in capfd.readouterr().err
