"""TQGroupQueryAttention's sliding window (local_window_size), softcap and head_sink on CUDA against
the numpy reference: decode steps, first prompts and continuation chunks, each preset's formats,
windows shorter than, as long as and longer than the context, each CUDA kernel that takes them (the
planner's choice, turboquant.kernel_plan, is checked to be the one that ran). The CPU kernel runs
three of the cases here (its own tests cover it)."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from turboquant import node_models
from turboquant.ort import run
from turboquant.reference import formats, group_query_attention
from turboquant.reference.numerics import bfloat16

NP = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}
TOL = {TensorProto.FLOAT: 2e-4, TensorProto.FLOAT16: 4e-3, TensorProto.BFLOAT16: 3e-2}
DTYPE_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
PRESETS = [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16")]

CUDA = [pytest.param("cuda", marks=pytest.mark.gpu)]
BASE = dict(b=2, d=128, hkv=2, group=4, formats=("mse4", "uint4"), dtype=TensorProto.FLOAT16, window=-1, softcap=0.0,
            sink=False, offsets=False, rotary=0, seed=0)


def make(c):
    """(model, feeds) for a case: `lengths` are each sequence's total after this call (a first
    prompt's are right-padded prompts of c["s"] tokens), in a past buffer of `capacity` rows."""
    rng = np.random.default_rng(c["seed"])
    b, s, d, hkv = c["b"], c["s"], c["d"], c["hkv"]
    hq = hkv * c["group"]
    kf, vf = c["formats"]
    dt = NP[c["dtype"]]
    width = max(formats.packed_size(kf, d), formats.packed_size(vf, d))
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=kf, value_format=vf, row_bytes=width,
                                  dtype=c["dtype"], rotary_dim=c["rotary"], offsets=c["offsets"],
                                  local_window_size=c["window"], softcap=c["softcap"], head_sink=c["sink"])
    cap = c["capacity"]
    feeds = {}
    for name, fmt in (("past_key", kf), ("past_value", vf)):
        buf = rng.integers(0, 256, (b, hkv, cap, width), dtype=np.uint8)  # stale bytes past the packed rows
        packed = formats.pack(rng.standard_normal((b, hkv, cap, d)).astype(np.float32), fmt, True)
        buf[..., :packed.shape[-1]] = packed
        feeds[name] = buf
    total = s if c["first"] else max(c["lengths"])
    feeds["seqlens_k"] = np.array(c["lengths"], np.int32) - 1
    feeds["total_sequence_length"] = np.array(total, np.int32)
    # scores of a few units (queries 3 x N(0, 1)): peaked rows, whose outputs each feature moves well
    # beyond the tolerance
    feeds["query"] = (3.0 * rng.standard_normal((b, s, hq * d))).astype(dt)
    feeds["key"] = rng.standard_normal((b, s, hkv * d)).astype(dt)
    feeds["value"] = rng.standard_normal((b, s, hkv * d)).astype(dt)
    if c["rotary"]:
        angles = rng.uniform(0, 6.3, (cap + 4, c["rotary"] // 2))
        feeds["cos_cache"], feeds["sin_cache"] = np.cos(angles).astype(dt), np.sin(angles).astype(dt)
    if c["offsets"]:  # offsets of the size calibrations give: they shift every score by q . key_offset
        feeds["key_offset"] = (2.0 * rng.standard_normal((hkv, d))).astype(np.float32)
        feeds["value_offset"] = rng.standard_normal((hkv, d)).astype(np.float32)
    if c["sink"]:  # some above every score of a row, some below; the dtype the model declares
        elem = next(i.type.tensor_type.elem_type for i in model.graph.input if i.name == "head_sink")
        feeds["head_sink"] = rng.uniform(0.0, 12.0, hq).astype(NP[elem])
    return model, feeds


def reference(c, feeds):
    kf, vf = c["formats"]
    return group_query_attention(
        feeds["query"], feeds["key"], feeds["value"], feeds["past_key"], feeds["past_value"], feeds["seqlens_k"],
        feeds["total_sequence_length"], feeds.get("cos_cache"), feeds.get("sin_cache"), None, feeds.get("key_offset"),
        feeds.get("value_offset"), None, key_format=kf, value_format=vf, norm_correction=True,
        num_heads=c["hkv"] * c["group"], kv_num_heads=c["hkv"], do_rotary=c["rotary"] > 0,
        local_window_size=c["window"], softcap=c["softcap"], head_sink=feeds["head_sink"] if c["sink"] else None)


def valid_rows(c, y):
    """The output rows a case defines (padded prompt positions are unspecified, as in ORT)."""
    valid = np.zeros(y.shape[:2], bool)
    for i, n in enumerate(c["lengths"]):
        valid[i, : (n if c["first"] else c["s"])] = True
    return y.astype(np.float32)[valid]


def check(c, got, want):
    y, pk, pv = got
    wy, wk, wv = want
    np.testing.assert_array_equal(pk, wk)  # the new rows packed, every other byte as it was
    np.testing.assert_array_equal(pv, wv)
    y32, w32 = valid_rows(c, y), valid_rows(c, wy)
    assert np.all(np.isfinite(y32))
    span = max(1.0, float(np.abs(w32).max()))
    np.testing.assert_allclose(y32, w32, rtol=TOL[c["dtype"]], atol=TOL[c["dtype"]] * span)


def without_features(c):
    """The same call with none of the three features: its output must differ (else the case tests nothing)."""
    return {**c, "window": -1, "softcap": 0.0, "sink": False}


def planned(c):
    """The case as turboquant.kernel_plan.plan_split's keywords."""
    kf, vf = c["formats"]
    width = max(formats.packed_size(kf, c["d"]), formats.packed_size(vf, c["d"]))
    past = 0 if c["first"] else max(c["lengths"]) - c["s"]
    return dict(batch=c["b"], q_heads=c["hkv"] * c["group"], kv_heads=c["hkv"], q_len=c["s"], past_len=past,
                head_dim=c["d"], key_format=kf, value_format=vf, dtype=DTYPE_NAMES[c["dtype"]], is_causal=True,
                key_row_bytes=width, value_row_bytes=width, buffer_rows=max(c["capacity"], max(c["lengths"])),
                local_window_size=c["window"], softcap=c["softcap"], head_sink=c["sink"])


def run_case(ort_session, device, c):
    model, feeds = make(c)
    got = run(ort_session(model, 2, device), feeds)
    want = reference(c, feeds)
    check(c, got, want)
    plain = valid_rows(c, reference(without_features(c), feeds)[0])
    w32 = valid_rows(c, want[0])
    moved = float(np.abs(w32 - plain).max())
    assert moved > 5 * TOL[c["dtype"]] * max(1.0, float(np.abs(w32).max())), f"the features move the output by {moved} only"


# Decode steps: two sequences with 600 and 300 tokens (past 599 and 299) in a buffer of 640 rows; the
# windows cut both, one (300: the second sequence sees all its tokens) or none.
DECODE = dict(BASE, s=1, first=False, lengths=[600, 300], capacity=640)


@pytest.mark.parametrize("formats", PRESETS)
@pytest.mark.parametrize("window", [64, 300, 1000])
@pytest.mark.parametrize("target", CUDA)
def test_decode_window_each_preset(ort_session, cuda_ready, target, formats, window, split_kernel_ran):
    c = dict(DECODE, formats=formats, window=window)
    if window == 1000:  # a window longer than the context changes nothing: with a sink, so the case tests one
        c["sink"] = True
    run_case(ort_session, target, c)
    split_kernel_ran("tc_bulk", **planned(c))


@pytest.mark.parametrize("change, want", [
    ({"d": 64, "group": 8, "window": 128, "sink": True}, "tc_bulk"),  # gpt-oss's heads, window and sinks
    ({"d": 256, "window": 100, "formats": ("mse3", "uint3")}, "tc_bulk"),  # Gemma 3's head size
    ({"d": 80, "window": 100}, "tc_mma"),
    ({"dtype": TensorProto.FLOAT, "window": 100, "sink": True}, "cuda_core"),
    ({"dtype": TensorProto.BFLOAT16, "window": 100, "sink": True}, "tc_bulk"),
    ({"softcap": 2.0}, "cuda_core"),
    ({"softcap": 2.0, "window": 100, "sink": True, "offsets": True}, "cuda_core"),  # scores shifted by q . key_offset
    ({"sink": True, "offsets": True, "rotary": 64}, "tc_bulk"),  # the rotary fused into the bulk kernel
    ({"sink": True, "window": 64, "offsets": True, "rotary": 128, "formats": ("fp8", "uint4")}, "tc_bulk"),
    ({"b": 1, "lengths": [2600], "capacity": 2600, "window": 1700, "hkv": 1}, "tc_bulk"),  # several splits in the window
    ({"b": 1, "lengths": [2600], "capacity": 2600, "window": 1700, "hkv": 1, "dtype": TensorProto.FLOAT}, "cuda_core"),
    ({"window": 1}, "tc_bulk"),  # each query sees itself only
])
@pytest.mark.parametrize("target", CUDA)
def test_decode_features(ort_session, cuda_ready, target, change, want, split_kernel_ran):
    c = dict(DECODE, **change)
    run_case(ort_session, target, c)
    split_kernel_ran(want, **planned(c))


# First prompts: 200 and 150 tokens right-padded to 200.
PROMPT = dict(BASE, s=200, first=True, lengths=[200, 150], capacity=200, d=64)


@pytest.mark.parametrize("change, want", [
    ({"window": 50}, "mma"),
    ({"window": 200, "sink": True}, "mma"),  # a window as long as the prompt: the sink decides
    ({"window": 300, "softcap": 1.5}, "mma"),
    ({"window": 70, "softcap": 1.5, "sink": True, "d": 128}, "mma"),
    ({"window": 64, "sink": True, "offsets": True, "rotary": 64, "formats": ("mse3", "uint3")}, "mma"),
    ({"window": 50, "formats": ("fp8", "uint4"), "dtype": TensorProto.BFLOAT16}, "mma"),
    ({"window": 50, "sink": True, "formats": ("raw16", "raw16")}, "mma"),
    ({"window": 40, "softcap": 1.5, "sink": True, "d": 80}, "none"),  # the finish kernel attends each row
    ({"window": 40, "sink": True, "dtype": TensorProto.FLOAT}, "none"),
    # head size 256 (Gemma 3): one m-tile per warp, Q read from shared memory at each key tile
    ({"window": 50, "d": 256}, "mma"),
    ({"window": 200, "sink": True, "d": 256}, "mma"),
    ({"window": 300, "softcap": 1.5, "d": 256, "dtype": TensorProto.BFLOAT16}, "mma"),
    ({"window": 70, "softcap": 1.5, "sink": True, "d": 256, "formats": ("mse3", "uint3")}, "mma"),
    ({"window": 64, "sink": True, "offsets": True, "rotary": 128, "d": 256, "formats": ("fp8", "uint4")}, "mma"),
    ({"window": 50, "sink": True, "d": 256, "formats": ("raw16", "raw16")}, "mma"),
    ({"b": 1, "s": 700, "lengths": [700], "capacity": 700, "window": 512, "d": 256, "hkv": 1}, "mma"),  # Gemma 3's ratio
    ({"b": 3, "s": 333, "lengths": [333, 64, 200], "capacity": 333, "window": 100, "sink": True, "d": 256}, "mma"),
])
@pytest.mark.parametrize("target", CUDA)
def test_first_prompt_features(ort_session, cuda_ready, target, change, want, prefill_kernel_ran):
    c = dict(PROMPT, **change)
    run_case(ort_session, target, c)
    if want != "none":
        call = planned(c)
        prefill_kernel_ran(want, q_len=c["s"], head_dim=c["d"], dtype=call["dtype"], local_window_size=c["window"],
                           softcap=c["softcap"], head_sink=c["sink"])


# Continuation chunks: 80 new tokens for sequences that end at 780 and 580 (pasts of 700 and 500).
CHUNK = dict(BASE, s=80, first=False, lengths=[780, 580], capacity=800, d=64)


@pytest.mark.parametrize("change, want", [
    ({"window": 100}, "tc_chunk"),  # every row's window inside the past and the chunk
    ({"window": 700}, "tc_chunk"),  # cuts the first sequence only
    ({"window": 2000, "sink": True}, "tc_chunk"),  # cuts nothing: the sink in the finish kernel
    ({"sink": True, "offsets": True}, "tc_chunk"),
    ({"window": 30, "softcap": 1.5, "sink": True, "offsets": True}, "cuda_core"),  # windows inside the chunk
    ({"window": 100, "formats": ("mse3", "uint3"), "d": 128}, "tc_chunk"),
    ({"window": 100, "formats": ("fp8", "uint4"), "sink": True}, "cuda_core"),
    ({"window": 100, "formats": ("raw16", "raw16"), "softcap": 1.5}, "cuda_core"),
    ({"window": 100, "d": 80, "softcap": 1.5}, "cuda_core"),  # no new tokens' part on tensor cores
])
@pytest.mark.parametrize("target", CUDA)
def test_chunk_features(ort_session, cuda_ready, target, change, want, split_kernel_ran):
    c = dict(CHUNK, **change)
    run_case(ort_session, target, c)
    split_kernel_ran(want, **planned(c))


# Head size 256 chunks: the new tokens' part on prefill.cu's mma kernel, the past's on the split
# kernel the planner names (the chunk kernel has no head size 256).
@pytest.mark.parametrize("change, want", [
    ({"window": 100, "formats": ("mse3", "uint3")}, "cuda_core"),  # windows per row: the CUDA-core kernel
    ({"window": 30, "softcap": 1.5, "sink": True}, "cuda_core"),  # windows inside the chunk
    ({"window": 2000, "sink": True}, "tc_bulk"),  # cuts nothing: the sink in the finish kernel
    ({"sink": True, "offsets": True, "dtype": TensorProto.BFLOAT16}, "tc_bulk"),
    ({"window": 100, "formats": ("raw16", "raw16"), "softcap": 1.5}, "cuda_core"),
])
@pytest.mark.parametrize("target", CUDA)
def test_head_size_256_chunks(ort_session, cuda_ready, target, change, want, split_kernel_ran, prefill_kernel_ran):
    c = dict(CHUNK, d=256, **change)
    run_case(ort_session, target, c)
    split_kernel_ran(want, **planned(c))
    prefill_kernel_ran("mma", q_len=c["s"], head_dim=256, dtype=DTYPE_NAMES[c["dtype"]], local_window_size=c["window"],
                       softcap=c["softcap"], head_sink=c["sink"], past_len=max(c["lengths"]) - c["s"])


@pytest.mark.parametrize("c", [
    dict(PROMPT, d=256, window=50, softcap=1.5, sink=True),
    dict(PROMPT, d=256, window=100, sink=True, dtype=TensorProto.BFLOAT16, formats=("mse3", "uint3")),
    dict(CHUNK, d=256, window=100, sink=True, offsets=True),
], ids=["prompt", "prompt-bf16", "chunk"])
@pytest.mark.parametrize("target", CUDA)
def test_head_size_256_one_buffer(ort_session, cuda_ready, target, c, monkeypatch, prefill_kernel_ran):
    """prefill.cu's single-buffered variant at head size 256, which devices of 99 KiB of shared memory
    per block (sm_86, sm_89) run: forced here by TURBOQUANT_PREFILL_ONE_BUFFER=1 (read at each launch)."""
    monkeypatch.setenv("TURBOQUANT_PREFILL_ONE_BUFFER", "1")
    run_case(ort_session, target, c)
    prefill_kernel_ran("mma", q_len=c["s"], head_dim=256, dtype=DTYPE_NAMES[c["dtype"]], local_window_size=c["window"],
                       softcap=c["softcap"], head_sink=c["sink"], past_len=0 if c["first"] else max(c["lengths"]) - c["s"])


def test_model_declares_the_features():
    """What the cases above run: the attributes and the input as the node carries them."""
    model, feeds = make(dict(DECODE, window=64, softcap=2.0, sink=True))
    node = model.graph.node[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["local_window_size"] == 64 and attrs["softcap"] == pytest.approx(2.0)
    assert node.input[11] == "head_sink" and "head_sink" in feeds


@pytest.mark.parametrize("c", [
    dict(DECODE, window=64, softcap=2.0, sink=True, offsets=True),
    dict(PROMPT, window=50, softcap=1.5, sink=True),
    dict(CHUNK, window=100, sink=True, offsets=True),
], ids=["decode", "prompt", "chunk"])
def test_cpu_kernel_on_the_same_cases(ort_session, c):
    run_case(ort_session, "cpu", c)
