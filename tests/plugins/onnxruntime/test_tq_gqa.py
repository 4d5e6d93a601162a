"""TQGroupQueryAttention in ONNX Runtime (CPU, and CUDA where present) against the numpy reference,
with the past/present buffer shared in place as onnxruntime-genai shares it."""

import os

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from turboquant import node_models
from turboquant.ort import from_ort_value, run, to_ort_value
from turboquant.reference import formats, group_query_attention
from turboquant.reference.numerics import bfloat16

# TQ_MAX_EXAMPLES caps hypothesis's examples per test: the op tests under compute-sanitizer
# (scripts/gpu_session.sh check) run all of them, each on fewer cases.
MAX_EXAMPLES = int(os.environ.get("TQ_MAX_EXAMPLES", "1000"))

NP = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}
TOL = {TensorProto.FLOAT: 2e-4, TensorProto.FLOAT16: 4e-3, TensorProto.BFLOAT16: 3e-2}
FORMATS = [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16")]


@st.composite
def cases(draw):
    b = draw(st.integers(1, 3))
    s = draw(st.sampled_from([1, 1, 2, 5]))
    first = draw(st.booleans())
    capacity = draw(st.sampled_from([8, 24, 40]))
    if first:
        lengths = [draw(st.integers(1, s)) for _ in range(b)]  # right-padded prompts
        lengths[0] = s
    else:
        lengths = [draw(st.integers(s, capacity)) for _ in range(b)]
    d = draw(st.sampled_from([16, 64, 80, 128]))
    return {
        "b": b, "s": s, "first": first, "capacity": capacity, "lengths": lengths, "d": d,
        "hkv": draw(st.integers(1, 2)), "group": draw(st.sampled_from([1, 2, 4])),
        "formats": draw(st.sampled_from(FORMATS)), "pad": draw(st.sampled_from([0, 6])),
        "packed": draw(st.booleans()), "rotary": draw(st.sampled_from([0, d // 2, d])),
        "interleaved": draw(st.booleans()), "position_ids": draw(st.booleans()),
        "dtype": draw(st.sampled_from(list(NP))), "nc": draw(st.booleans()), "offsets": draw(st.booleans()),
        "key_scale": draw(st.booleans()), "seed": draw(st.integers(0, 2**31)),
    }


def make(c):
    """(model, feeds) for a case: a past buffer of `capacity` rows holding each sequence's past; a
    key_scale (c["key_scale"]) only with the rotary, which it follows; c["window"], c["softcap"] and
    c["sink"] (optional) give local_window_size, softcap and a head_sink input."""
    rng = np.random.default_rng(c["seed"])
    key_scale = c.get("key_scale", False) and c["rotary"] > 0
    b, s, d, hkv = c["b"], c["s"], c["d"], c["hkv"]
    hq = hkv * c["group"]
    kf, vf = c["formats"]
    dt = NP[c["dtype"]]
    width = max(formats.packed_size(kf, d), formats.packed_size(vf, d)) + c["pad"]
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=kf, value_format=vf, row_bytes=width,
                             dtype=c["dtype"], packed_qkv=c["packed"], rotary_dim=c["rotary"],
                             position_ids=c["position_ids"] and c["rotary"] > 0, offsets=c["offsets"], key_scale=key_scale,
                             rotary_interleaved=int(c["interleaved"]), norm_correction=int(c["nc"]),
                             local_window_size=c.get("window", -1), softcap=c.get("softcap", 0.0),
                             head_sink=c.get("sink", False))
    cap = c["capacity"]
    past = {}
    for name, fmt in (("past_key", kf), ("past_value", vf)):
        buf = rng.integers(0, 256, (b, hkv, cap, width), dtype=np.uint8)  # stale bytes everywhere
        packed = formats.pack(rng.standard_normal((b, hkv, cap, d)).astype(np.float32), fmt, c["nc"])
        buf[..., :packed.shape[-1]] = packed
        past[name] = buf
    total = s if c["first"] else max(c["lengths"])
    seqlens = np.array(c["lengths"], np.int32) - 1
    feeds = {**past, "seqlens_k": seqlens, "total_sequence_length": np.array(total, np.int32)}
    if c["packed"]:
        feeds["query"] = rng.standard_normal((b, s, (hq + 2 * hkv) * d)).astype(dt)
    else:
        feeds["query"] = rng.standard_normal((b, s, hq * d)).astype(dt)
        feeds["key"] = rng.standard_normal((b, s, hkv * d)).astype(dt)
        feeds["value"] = rng.standard_normal((b, s, hkv * d)).astype(dt)
    if c["rotary"]:
        angles = rng.uniform(0, 6.3, (cap + 4, c["rotary"] // 2))
        feeds["cos_cache"], feeds["sin_cache"] = np.cos(angles).astype(dt), np.sin(angles).astype(dt)
        if c["position_ids"]:
            feeds["position_ids"] = rng.integers(0, cap + 4, (b, s)).astype(np.int64)
    if c["offsets"]:
        feeds["key_offset"] = rng.standard_normal((hkv, d)).astype(np.float32)
        feeds["value_offset"] = rng.standard_normal((hkv, d)).astype(np.float32)
    if key_scale:  # positive, a factor of about 4 either way, as calibrations give
        feeds["key_scale"] = np.exp(rng.uniform(-1.4, 1.4, (hkv, d))).astype(np.float32)
    if c.get("sink", False):  # logits about the scores' size: some rows' weight mostly in the sink
        feeds["head_sink"] = (2 * rng.standard_normal(hq)).astype(dt)
    return model, feeds


def reference(c, feeds):
    kf, vf = c["formats"]
    return group_query_attention(
        feeds["query"], feeds.get("key"), feeds.get("value"), feeds["past_key"], feeds["past_value"],
        feeds["seqlens_k"], feeds["total_sequence_length"], feeds.get("cos_cache"), feeds.get("sin_cache"),
        feeds.get("position_ids"), feeds.get("key_offset"), feeds.get("value_offset"), feeds.get("key_scale"), key_format=kf,
        value_format=vf, norm_correction=c["nc"], num_heads=c["hkv"] * c["group"], kv_num_heads=c["hkv"],
        do_rotary=c["rotary"] > 0, rotary_interleaved=c["interleaved"], local_window_size=c.get("window", -1),
        softcap=c.get("softcap", 0.0), head_sink=feeds.get("head_sink"))


def written_rows(c):
    """[(b, first row, end row)] of the new tokens."""
    s = c["s"]
    return [(i, 0 if c["first"] else n - s, (0 if c["first"] else n - s) + s) for i, n in enumerate(c["lengths"])]


def check_outputs(c, y, pk, pv, want):
    wy, wk, wv = want
    kf, vf = c["formats"]
    kb, vb = formats.packed_size(kf, c["d"]), formats.packed_size(vf, c["d"])
    for got, ref, nb in ((pk, wk, kb), (pv, wv, vb)):
        assert got.shape == ref.shape
        cap = c["capacity"]
        np.testing.assert_array_equal(got[:, :, :cap][..., nb:], ref[:, :, :cap][..., nb:])  # padding untouched
        for i, lo, hi in written_rows(c):
            np.testing.assert_array_equal(got[i, :, :lo], ref[i, :, :lo])  # earlier rows untouched
            np.testing.assert_array_equal(got[i, :, lo:hi, :nb], ref[i, :, lo:hi, :nb])  # new rows packed
            np.testing.assert_array_equal(got[i, :, hi:cap], ref[i, :, hi:cap])  # later rows untouched
    valid = np.zeros(y.shape[:2], bool)  # padded prompt positions are unspecified (as in ORT)
    for i, n in enumerate(c["lengths"]):
        valid[i, : (n if c["first"] else c["s"])] = True
    y32, w32 = y.astype(np.float32)[valid], wy.astype(np.float32)[valid]
    assert np.all(np.isfinite(y32))
    span = max(1.0, float(np.abs(w32).max()))
    np.testing.assert_allclose(y32, w32, rtol=TOL[c["dtype"]], atol=TOL[c["dtype"]] * span)


DTYPE_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def planned_call(c, feeds):
    """The case as turboquant.kernel_plan.plan_split's keywords (what the op hands the planner)."""
    kf, vf = c["formats"]
    width = feeds["past_key"].shape[-1]
    past = 0 if c["first"] else int(feeds["total_sequence_length"]) - c["s"]
    return dict(batch=c["b"], q_heads=c["hkv"] * c["group"], kv_heads=c["hkv"], q_len=c["s"], past_len=past,
                head_dim=c["d"], key_format=kf, value_format=vf, dtype=DTYPE_NAMES[c["dtype"]], is_causal=True,
                key_row_bytes=width, value_row_bytes=width, buffer_rows=feeds["past_key"].shape[2])


def run_shared(session, feeds, device):
    """One run with present bound to past's own buffers (genai's past_present_share_buffer)."""
    io = session.io_binding()
    kind, dev_id = ("cuda", 0) if device == "cuda" else ("cpu", 0)
    shared = {}
    for name, x in feeds.items():
        if name in ("past_key", "past_value"):
            v = ort.OrtValue.ortvalue_from_numpy(x, kind, dev_id)
            shared[name] = v
            io.bind_ortvalue_input(name, v)
        elif name == "total_sequence_length":
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x))  # host memory, as in genai
        elif x.dtype == bfloat16:  # (ORT's numpy path lacks bfloat16: bound in host memory, ORT copies it)
            io.bind_ortvalue_input(name, to_ort_value(x))
        else:
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, kind, dev_id))
    bf16 = feeds["query"].dtype == bfloat16
    io.bind_output("output", "cpu" if bf16 else kind)
    io.bind_ortvalue_output("present_key", shared["past_key"])
    io.bind_ortvalue_output("present_value", shared["past_value"])
    session.run_with_iobinding(io)
    y = from_ort_value(io.get_outputs()[0]) if bf16 else io.get_outputs()[0].numpy()
    return y, shared["past_key"].numpy(), shared["past_value"].numpy(), shared


@settings(max_examples=min(150, MAX_EXAMPLES), deadline=None)
@given(c=cases())
def test_matches_reference(ort_session, device, c):
    model, feeds = make(c)
    y, pk, pv = run(ort_session(model, 2, device), feeds)
    want = reference(c, feeds)
    check_outputs(c, y, pk, pv, want)
    np.testing.assert_array_equal(pk, want[1])  # a fresh present: every byte the reference's, zeros included
    np.testing.assert_array_equal(pv, want[2])


@pytest.mark.parametrize("first, s, runs, formats", [
    (False, 1, [[9, 5, 9], [9, 9, 2], [3, 9, 9]], ("mse4", "uint4")),
    (False, 3, [[11, 4, 10], [11, 11, 3], [6, 9, 11]], ("fp8", "uint4")),
    (True, 6, [[6, 2, 5], [6, 6, 1], [3, 6, 4]], ("mse3", "uint3")),
])
def test_fresh_present_holds_zeros_where_nothing_is_written(ort_session, device, first, s, runs, formats):
    """A fresh present longer than the past buffer of 4 or 8 rows (total_sequence_length beyond some
    sequences' lengths, rows wider than the packed vectors): the rows after the past that no new
    token reaches, and the padding of the new rows there, are zeros in every run, whatever an earlier
    run left in that memory."""
    session = None
    for seed, lengths in enumerate(runs):
        c = dict(BASE, b=3, s=s, first=first, capacity=4 if first else 8, lengths=lengths, formats=formats, pad=6,
                 seed=seed)
        model, feeds = make(c)
        session = session or ort_session(model, 2, device)
        _, pk, pv = run(session, feeds)
        _, wk, wv = reference(c, feeds)
        assert pk.shape[2] == max(lengths) > c["capacity"]
        np.testing.assert_array_equal(pk, wk)
        np.testing.assert_array_equal(pv, wv)


@settings(max_examples=min(40, MAX_EXAMPLES), deadline=None)
@given(c=cases())
def test_shared_buffer_is_updated_in_place(ort_session, device, c):
    """present bound to past's OrtValue: the op writes the new rows into that buffer, leaves every
    other byte as it was, and gives the same output as with separate buffers."""
    if not c["first"] and max(c["lengths"]) > c["capacity"]:
        return
    model, feeds = make(c)
    session = ort_session(model, 2, device)
    y, pk, pv, _ = run_shared(session, feeds, device)
    check_outputs(c, y, pk, pv, reference(c, feeds))


def test_genai_style_decode_loop(ort_session, device):
    """A prompt of 6 tokens for two sequences of different lengths (right padded), then 12 decode
    steps, all in one shared buffer of 24 rows with rotary, as onnxruntime-genai drives it; each
    step equals the reference run on the buffer as it was."""
    c = dict(b=2, s=6, first=True, capacity=24, lengths=[6, 4], d=64, hkv=2, group=2, formats=("mse4", "uint4"),
             pad=0, packed=True, rotary=64, interleaved=False, position_ids=False, dtype=TensorProto.FLOAT, nc=True,
             offsets=False, seed=5)
    model, feeds = make(c)
    for name in ("past_key", "past_value"):
        feeds[name][:] = 0  # genai zeroes its buffers
    session = ort_session(model, 2, device)
    io = session.io_binding()
    kind = "cuda" if device == "cuda" else "cpu"
    buffers = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n], kind, 0) for n in ("past_key", "past_value")}
    rng = np.random.default_rng(0)
    lengths = list(c["lengths"])
    for step in range(13):
        if step:
            c = {**c, "s": 1, "first": False}
            lengths = [n + 1 for n in lengths]
            c["lengths"] = lengths
            feeds["query"] = rng.standard_normal((2, 1, feeds["query"].shape[2])).astype(np.float32)
            feeds["seqlens_k"] = np.array(lengths, np.int32) - 1
            feeds["total_sequence_length"] = np.array(max(lengths), np.int32)
        before = {n: buffers[n].numpy() for n in buffers}
        want = reference(c, {**feeds, **before})
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        for n in ("query", "seqlens_k", "cos_cache", "sin_cache"):
            io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(feeds[n], kind, 0))
        io.bind_ortvalue_input("total_sequence_length", ort.OrtValue.ortvalue_from_numpy(feeds["total_sequence_length"]))
        for n in buffers:
            io.bind_ortvalue_input(n, buffers[n])
        io.bind_output("output", kind)
        io.bind_ortvalue_output("present_key", buffers["past_key"])
        io.bind_ortvalue_output("present_value", buffers["past_value"])
        session.run_with_iobinding(io)
        check_outputs(c, io.get_outputs()[0].numpy(), buffers["past_key"].numpy(), buffers["past_value"].numpy(), want)


@pytest.mark.parametrize("b, formats, rotary", [
    (1, ("mse4", "uint4"), 128), (64, ("mse4", "uint4"), 128), (1, ("mse3", "uint3"), 0), (64, ("fp8", "uint4"), 0),
])
def test_decode_step_of_the_presets_shape(ort_session, device, b, formats, rotary, split_kernel_ran):
    """A decode step of the presets' shape (head size 128, fp16, 8 KV heads of 4 query heads, the
    GPU's tensor-core split kernel, which the CUDA run checks ran): one sequence, and 64 whose 512
    (b, head) pairs take several waves of blocks (the hypothesis cases have at most 6); the new rows
    and outputs equal the reference's."""
    rng = np.random.default_rng(b)
    c = dict(b=b, s=1, first=False, capacity=40, lengths=[int(n) for n in rng.integers(2, 41, b)], d=128, hkv=8,
             group=4, formats=formats, pad=0, packed=False, rotary=rotary, interleaved=False, position_ids=False,
             dtype=TensorProto.FLOAT16, nc=True, offsets=False, key_scale=True, seed=b)
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    if device == "cuda":
        split_kernel_ran("tc_bulk", **planned_call(c, feeds))
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("b, d, group, lengths, rotary, pad, want", [
    (1, 128, 4, [2], 0, 0, "tc_bulk"), (4, 128, 4, [33, 129, 7, 300], 128, 0, "tc_bulk"),
    (3, 64, 8, [1000, 257, 31], 64, 0, "tc_bulk"), (2, 64, 1, [95, 4], 32, 0, "tc_bulk"),
    (2, 128, 4, [40, 17], 0, 6, "cuda_core"),
])
def test_raw16_decode_step(ort_session, device, split_kernel_ran, b, d, group, lengths, rotary, pad, want):
    """A decode step on raw16 rows of 2 x head size bytes in a shared buffer, as onnxruntime-genai
    runs its boundary layers: on the GPU the tensor-core bulk kernel (rotary fused there), several
    sequences of other lengths (not multiples of the 32-token tiles), GQA groups; rows padded to
    other widths (not whole 16-byte chunks) on the CUDA-core kernel. New rows and outputs equal the
    reference's."""
    c = dict(b=b, s=1, first=False, capacity=max(lengths) + 3, lengths=lengths, d=d, hkv=2, group=group,
             formats=("raw16", "raw16"), pad=pad, packed=False, rotary=rotary, interleaved=False,
             position_ids=False, dtype=TensorProto.FLOAT16, nc=True, offsets=b == 3, key_scale=b != 2, seed=sum(lengths))
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    if device == "cuda":
        split_kernel_ran(want, **planned_call(c, feeds))
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("b, s, d, formats, rotary, packed", [
    (2, 300, 128, ("mse4", "uint4"), 128, False), (1, 257, 64, ("mse3", "uint3"), 0, True),
    (3, 130, 128, ("fp8", "uint4"), 64, False),
    pytest.param(1, 1000, 128, ("raw16", "raw16"), 0, False, marks=pytest.mark.long),
])
def test_first_prompt_of_several_tiles(ort_session, device, prefill_kernel_ran, b, s, d, formats, rotary, packed):
    """A first prompt long enough for several tiles of query rows and keys (on CUDA the tensor-core
    prefill kernel), right padded, written into a buffer with rows to spare; the new rows and outputs
    equal the reference's."""
    lengths = [s - 37 * i for i in range(b)]
    c = dict(b=b, s=s, first=True, capacity=s + 9, lengths=lengths, d=d, hkv=2, group=4, formats=formats, pad=0,
             packed=packed, rotary=rotary, interleaved=False, position_ids=False, dtype=TensorProto.FLOAT16, nc=True,
             offsets=False, key_scale=True, seed=s)
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    if device == "cuda":
        prefill_kernel_ran("wgmma", q_len=s, head_dim=d, dtype=DTYPE_NAMES[c["dtype"]])
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("b, s, d, formats, rotary, dtype, offsets, want", [
    (3, 300, 128, ("mse4", "uint4"), 64, TensorProto.FLOAT16, True, "tc_chunk"),
    (1, 257, 64, ("mse3", "uint3"), 0, TensorProto.FLOAT16, False, "tc_chunk"),
    (2, 130, 128, ("fp8", "uint4"), 128, TensorProto.FLOAT16, True, "tc_bulk"),
    (2, 200, 128, ("raw16", "raw16"), 0, TensorProto.FLOAT16, False, "tc_bulk"),
    (2, 130, 64, ("mse4", "uint4"), 64, TensorProto.BFLOAT16, True, "tc_chunk"),
])
def test_continuation_chunk_of_several_tiles(ort_session, device, split_kernel_ran, prefill_kernel_ran, b, s, d, formats,
                                             rotary, dtype, offsets, want):
    """A chunk of many new tokens over pasts of different lengths (on CUDA the past by the chunk
    kernel's 64-row tiles where it takes the formats, the new tokens' part on tensor cores, merged by
    log-sum-exp), with key and value offsets and key scales; the new rows and outputs equal the reference's."""
    lengths = [s + 700 - 311 * i for i in range(b)]
    c = dict(b=b, s=s, first=False, capacity=s + 709, lengths=lengths, d=d, hkv=2, group=4, formats=formats, pad=0,
             packed=False, rotary=rotary, interleaved=False, position_ids=False, dtype=dtype, nc=True, offsets=offsets,
             key_scale=offsets, seed=s)
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    if device == "cuda":
        split_kernel_ran(want, **planned_call(c, feeds))
        prefill_kernel_ran("wgmma", q_len=s, head_dim=d, dtype=DTYPE_NAMES[c["dtype"]])
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("b, s, d, rotary, formats, pad, dtype", [
    (3, 300, 128, 64, ("mse4", "uint4"), 0, TensorProto.FLOAT16), (2, 160, 64, 0, ("mse4", "uint4"), 0, TensorProto.FLOAT16),
    (1, 33, 128, 128, ("mse4", "uint4"), 0, TensorProto.BFLOAT16), (2, 130, 128, 0, ("mse3", "uint4"), 0, TensorProto.FLOAT16),
    (2, 200, 64, 64, ("mse3", "uint3"), 0, TensorProto.BFLOAT16), (1, 64, 128, 0, ("mse4", "uint3"), 2, TensorProto.FLOAT16),
])
def test_continuation_chunk_on_the_wgmma_chunk_kernel(ort_session, device, split_kernel_ran, monkeypatch, b, s, d, rotary,
                                                      formats, pad, dtype):
    """The wgmma chunk kernel (chosen only with TURBOQUANT_CHUNK_WGMMA=1 until measured on the GPU):
    chunks over pasts of different lengths, split so that some splits hold no past of a sequence and
    each split's last tile is partial, in buffers of a multiple of 4 rows of a multiple of 4 bytes,
    every format pair, fp16 and bf16, with key and value offsets and key scales; the new rows and
    outputs equal the reference's."""
    if device != "cuda":
        pytest.skip("the choice of a CUDA kernel (test_continuation_chunk_of_several_tiles runs such chunks on the CPU)")
    monkeypatch.setenv("TURBOQUANT_CHUNK_WGMMA", "1")
    lengths = [s + 700 - 311 * i for i in range(b)]
    c = dict(b=b, s=s, first=False, capacity=(s + 709 + 3) // 4 * 4, lengths=lengths, d=d, hkv=2, group=4,
             formats=formats, pad=pad, packed=False, rotary=rotary, interleaved=False, position_ids=False,
             dtype=dtype, nc=True, offsets=True, key_scale=True, seed=s)
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    split_kernel_ran("tc_chunk_wgmma", **planned_call(c, feeds))
    check_outputs(c, y, pk, pv, reference(c, feeds))


BASE = dict(b=2, s=1, first=False, capacity=16, lengths=[5, 9], d=64, hkv=2, group=2, formats=("mse4", "uint4"), pad=0,
            packed=False, rotary=0, interleaved=False, position_ids=False, dtype=TensorProto.FLOAT, nc=True,
            offsets=False, seed=1)


@pytest.mark.parametrize("change, message", [
    ({"seqlens_k": np.array([4, 20], np.int32)}, "seqlens_k[1] = 20"),
    ({"seqlens_k": np.array([-1, 8], np.int32)}, "seqlens_k[0] = -1"),
    ({"total_sequence_length": np.array(40, np.int32), "seqlens_k": np.array([4, 30], np.int32)}, "past buffer of 16 rows"),
    ({"seqlens_k": np.array([4], np.int32)}, "seqlens_k"),
])
def test_bad_lengths_are_refused(ort_session, change, message):
    model, feeds = make(BASE)
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
        run(ort_session(model), {**feeds, **change})


@pytest.mark.parametrize("attrs, message", [
    ({"softcap": -1.0}, "'softcap' must be finite and >= 0, got -1"),
    ({"softcap": float("inf")}, "'softcap' must be finite and >= 0, got inf"),
    ({"local_window_size": 0}, "'local_window_size' must be -1 .no window. or positive, got 0"),
    ({"local_window_size": -2}, "'local_window_size' must be -1 .no window. or positive, got -2"),
    ({"smooth_softmax": 1}, "smooth_softmax"),
    ({"key_format": "uint4"}, "value format"),
    ({"kv_num_heads": 3}, "kv_num_heads"),
])
def test_unsupported_attributes_are_refused(ort_session, attrs, message):
    model, feeds = make(BASE)
    for a in list(model.graph.node[0].attribute):
        if a.name in attrs:
            model.graph.node[0].attribute.remove(a)
    from onnx import helper
    model.graph.node[0].attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    with pytest.raises(Exception, match=message):
        run(ort_session(model), feeds)


def test_narrow_cache_rows_are_refused(ort_session):
    model, feeds = make(BASE)
    narrow = {n: np.ascontiguousarray(feeds[n][..., :20]) for n in ("past_key", "past_value")}
    model.graph.input[3].type.tensor_type.shape.dim[3].dim_param = "W"
    model.graph.input[4].type.tensor_type.shape.dim[3].dim_param = "W"
    model.graph.output[1].type.tensor_type.shape.dim[3].dim_param = "W"
    model.graph.output[2].type.tensor_type.shape.dim[3].dim_param = "W"
    with pytest.raises(Exception, match="W >= 34"):
        run(ort_session(model), {**feeds, **narrow})


def test_key_scale_without_the_rotary_or_of_the_wrong_shape_is_refused(ort_session):
    model, feeds = make({**BASE, "rotary": 0})
    model = node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                                  key_scale=True)
    with pytest.raises(Exception, match="'key_scale' needs do_rotary = 1"):
        run(ort_session(model), {**feeds, "key_scale": np.ones((2, 64), np.float32)})
    c = {**BASE, "rotary": 64, "key_scale": True}
    model, feeds = make(c)
    for i, dim in enumerate(next(x for x in model.graph.input if x.name == "key_scale").type.tensor_type.shape.dim):
        dim.dim_param = f"ks{i}"  # the op's own check, not ORT's of the declared shape
    with pytest.raises(Exception, match=r"'key_scale' has shape \[2, 32\]; expected \[2, 64\]"):
        run(ort_session(model), {**feeds, "key_scale": np.ones((2, 32), np.float32)})


def test_key_scale_leaves_the_scores_of_exact_caches_unchanged(ort_session):
    """raw16 caches hold the scaled keys as they are (fp32 rounding apart), so the output with any
    key_scale equals the output without one: Q is multiplied by what K is divided by."""
    c = {**BASE, "rotary": 64, "formats": ("raw16", "raw16"), "first": True, "s": 7, "lengths": [7, 5]}
    model, feeds = make(c)
    scaled_model, scaled = make({**c, "key_scale": True})
    y, _, _ = run(ort_session(model), feeds)
    y_scaled, _, _ = run(ort_session(scaled_model), scaled)
    assert np.abs(scaled["key_scale"] - 1).max() > 1
    np.testing.assert_allclose(y_scaled[0], y[0], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(y_scaled[1, :5], y[1, :5], rtol=2e-3, atol=2e-3)


@st.composite
def prefill_cases(draw):
    """Prompts and continuation chunks of odd lengths (across the kernels' 32-key tiles and 64-row
    tasks), several sequences of different lengths (right-padded prompts; pasts of their own)."""
    c = draw(cases())
    s = draw(st.sampled_from([33, 40, 47, 70]))
    cap = draw(st.sampled_from([96, 150]))
    if c["first"]:
        lengths = [draw(st.integers(1, s)) for _ in range(c["b"])]
        lengths[0] = s
    else:
        lengths = [draw(st.integers(s, cap)) for _ in range(c["b"])]
    d = draw(st.sampled_from([16, 64, 128]))
    return {**c, "s": s, "capacity": cap, "lengths": lengths, "d": d, "rotary": draw(st.sampled_from([0, d // 2, d]))}


@settings(max_examples=min(80, MAX_EXAMPLES), deadline=None)
@given(c=prefill_cases())
def test_prefill_matches_reference(ort_session, device, c):
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.gpu
@pytest.mark.parametrize("formats", [("mse4", "uint4"), ("raw16", "raw16")])
def test_decode_steps_replayed_from_a_cuda_graph(cuda_ready, formats):
    """ORT's CUDA graphs (enable_cuda_graph, as onnxruntime-genai can run a model): decode steps of two
    sequences replayed from the graph captured at an early step, 60 steps past it, each equal to the
    reference on the buffer as it was. The captured launch must cover the later lengths."""
    from turboquant.ort import session_options

    c = dict(b=2, s=1, first=False, capacity=320, lengths=[200, 131], d=64, hkv=2, group=2, formats=formats, pad=0,
             packed=True, rotary=64, interleaved=False, position_ids=False, dtype=TensorProto.FLOAT16, nc=True,
             offsets=False, seed=11)
    model, feeds = make(c)
    so = session_options()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(model.SerializeToString(), so,
                                   providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    on_gpu = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n], "cuda", 0)
              for n in ("query", "seqlens_k", "cos_cache", "sin_cache", "past_key", "past_value")}
    total = ort.OrtValue.ortvalue_from_numpy(feeds["total_sequence_length"])  # host memory, as in genai
    y = ort.OrtValue.ortvalue_from_shape_and_type(feeds["query"].shape[:2] + (c["hkv"] * c["group"] * c["d"],),
                                                  TensorProto.FLOAT16, "cuda", 0)
    io = session.io_binding()  # bound once: a replay reads and writes the addresses it was captured with
    for n, v in on_gpu.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_input("total_sequence_length", total)
    io.bind_ortvalue_output("output", y)
    io.bind_ortvalue_output("present_key", on_gpu["past_key"])
    io.bind_ortvalue_output("present_value", on_gpu["past_value"])
    rng = np.random.default_rng(3)
    lengths = list(c["lengths"])
    for step in range(64):
        lengths = [n + 1 for n in lengths]
        c = {**c, "lengths": lengths}
        feeds["query"] = rng.standard_normal(feeds["query"].shape).astype(np.float16)
        feeds["seqlens_k"] = np.array(lengths, np.int32) - 1
        feeds["total_sequence_length"] = np.array(max(lengths), np.int32)
        on_gpu["query"].update_inplace(feeds["query"])
        on_gpu["seqlens_k"].update_inplace(feeds["seqlens_k"])
        total.update_inplace(feeds["total_sequence_length"])
        before = {n: on_gpu[n].numpy() for n in ("past_key", "past_value")}
        want = reference(c, {**feeds, **before})
        session.run_with_iobinding(io)
        check_outputs(c, y.numpy(), on_gpu["past_key"].numpy(), on_gpu["past_value"].numpy(), want)


def _rotary_step(ort_session, table_rows: int, key_scale: float, position: int | None):
    """One decode step of B = 1 with the rotary (a past of 5 tokens), key_scale filled with one value."""
    hq, hkv, d = 2, 1, 16
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse4", value_format="uint4",
                                  rotary_dim=d, position_ids=position is not None, key_scale=True)
    rng = np.random.default_rng(0)
    width = model.graph.input[3].type.tensor_type.shape.dim[3].dim_value
    angles = rng.uniform(0, 6, (table_rows, d // 2))
    feeds = {"query": rng.standard_normal((1, 1, hq * d)).astype(np.float32),
             "key": rng.standard_normal((1, 1, hkv * d)).astype(np.float32),
             "value": rng.standard_normal((1, 1, hkv * d)).astype(np.float32),
             "past_key": np.zeros((1, hkv, 8, width), np.uint8), "past_value": np.zeros((1, hkv, 8, width), np.uint8),
             "seqlens_k": np.array([5], np.int32), "total_sequence_length": np.array(6, np.int32),
             "cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32),
             "key_scale": np.full((hkv, d), key_scale, np.float32)}
    if position is not None:
        feeds["position_ids"] = np.array([[position]], np.int64)
    return ort_session(model).run(None, feeds)


@pytest.mark.parametrize("value", [0.0, -1.0, np.nan, np.inf])
def test_key_scales_that_are_not_positive_and_finite_are_refused(ort_session, value):
    """The keys are divided by key_scale before packing: such a value would pack zeros, NaNs or flipped keys."""
    with pytest.raises(Exception) as e:
        _rotary_step(ort_session, 16, value, None)
    assert "key_scale[0] = " in str(e.value) and "must be positive and finite" in str(e.value)


def test_given_positions_are_checked_against_the_table_not_the_past(ort_session):
    """position_ids inside the cos/sin table run, though the past length alone would lie past its rows."""
    y, _, _ = _rotary_step(ort_session, 4, 1.0, 2)
    assert np.isfinite(y).all()
    with pytest.raises(Exception, match="position 5 of sequence 0 is beyond the 4 rows of 'cos_cache'"):
        _rotary_step(ort_session, 4, 1.0, None)


# -- sliding window, softcap and attention sinks ------------------------------------------------------

@st.composite
def window_cases(draw, prefill=False):
    """cases() (or prefill_cases()) with a window smaller than, equal to or larger than the context,
    a softcap and head sinks, each drawn on or off (at least one on)."""
    c = draw(prefill_cases() if prefill else cases())
    context = max(c["lengths"]) if not c["first"] else c["s"]
    window = draw(st.sampled_from([-1, 1, 3, max(1, context // 2), context, context + 5]))
    softcap = draw(st.sampled_from([0.0, 0.0, 0.5, 3.0]))
    sink = draw(st.booleans())
    if window == -1 and not softcap and not sink:
        window = 2
    return {**c, "window": window, "softcap": softcap, "sink": sink}


@settings(max_examples=min(120, MAX_EXAMPLES), deadline=None)
@given(c=window_cases())
def test_window_softcap_and_sinks_match_reference(ort_session, device, c):
    """Decode steps, short chunks and right-padded first prompts with a sliding window, a softcap, head
    sinks or several of them, over packed caches of every preset's formats: present and output equal
    the reference's."""
    model, feeds = make(c)
    y, pk, pv = run(ort_session(model, 2, device), feeds)
    want = reference(c, feeds)
    check_outputs(c, y, pk, pv, want)
    np.testing.assert_array_equal(pk, want[1])
    np.testing.assert_array_equal(pv, want[2])


@settings(max_examples=min(40, MAX_EXAMPLES), deadline=None)
@given(c=window_cases(prefill=True))
def test_window_softcap_and_sinks_in_prefill_match_reference(ort_session, device, c):
    """The same on prompts and continuation chunks of several tiles of new tokens (the tiled past)."""
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("formats", FORMATS)
@pytest.mark.parametrize("s, window, first", [(1, 7, False), (1, 64, False), (40, 9, False), (70, 33, True)])
def test_window_over_a_long_past_of_several_chunks(ort_session, device, formats, s, window, first):
    """A past of up to 2500 rows (the decode path scores 1024 keys a chunk, the tiled one 64): windows
    that start inside a chunk, with sinks and a softcap; outputs equal the reference's."""
    lengths = [s] if first else [2500, 1100 + s]
    c = dict(BASE, b=len(lengths), s=s, first=first, capacity=2504, lengths=lengths, formats=formats, d=64,
             window=window, softcap=4.0, sink=True, seed=window)
    model, feeds = make(c)
    y, pk, pv, _ = run_shared(ort_session(model, 2, device), feeds, device)
    check_outputs(c, y, pk, pv, reference(c, feeds))


@pytest.mark.parametrize("formats", FORMATS)
def test_decode_step_reads_no_row_before_its_window(ort_session, device, formats):
    """A decode step of W = 16 over pasts of 900 and 40 rows whose rows before each window hold 0xff bytes
    (NaN in every format's scale or value): the output is finite and equals the reference's on the same
    buffer with those rows zeroed, so the kernel neither scores nor reads them (docs/ops.md)."""
    window = 16
    c = dict(BASE, b=2, s=1, capacity=904, lengths=[900, 40], formats=formats, window=window, sink=True, seed=3)
    model, feeds = make(c)
    poisoned, clean = dict(feeds), dict(feeds)
    for name in ("past_key", "past_value"):
        bad, good = feeds[name].copy(), feeds[name].copy()
        for i, n in enumerate(c["lengths"]):
            bad[i, :, :n - window] = 0xFF
            good[i, :, :n - window] = 0
        poisoned[name], clean[name] = bad, good
    y, _, _ = run(ort_session(model, 2, device), poisoned)
    assert np.isfinite(y).all()
    wy, _, _ = reference(c, clean)
    np.testing.assert_allclose(y, wy, rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(wy).max())))


def test_head_sink_of_the_wrong_shape_or_type_is_refused(ort_session):
    c = dict(BASE, sink=True)
    model, feeds = make(c)
    for i, dim in enumerate(next(x for x in model.graph.input if x.name == "head_sink").type.tensor_type.shape.dim):
        dim.dim_param = f"hs{i}"  # the op's own check, not ORT's of the declared shape
    with pytest.raises(Exception, match=r"'head_sink' has shape \[3\]; expected \[4\] \(num_heads\)"):
        run(ort_session(model), {**feeds, "head_sink": np.zeros(3, np.float32)})


def _ort_gqa_model(hq, hkv, d, window, softcap, sink):
    """com.microsoft GroupQueryAttention in float32 (ONNX Runtime's own CPU kernel)."""
    from onnx import helper

    inputs = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "", "", "", "",
              "head_sink" if sink else ""]
    while not inputs[-1]:
        inputs.pop()
    node = helper.make_node("GroupQueryAttention", inputs, ["output", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv, local_window_size=window,
                            softcap=float(softcap))
    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    graph_inputs = [vi("query", f, ["B", "S", hq * d]), vi("key", f, ["B", "S", hkv * d]),
                    vi("value", f, ["B", "S", hkv * d]), vi("past_key", f, ["B", hkv, "P", d]),
                    vi("past_value", f, ["B", hkv, "P", d]), vi("seqlens_k", TensorProto.INT32, ["B"]),
                    vi("total_sequence_length", TensorProto.INT32, [])]
    if sink:
        graph_inputs.append(vi("head_sink", f, [hq]))
    graph = helper.make_graph([node], "gqa", graph_inputs,
                              [vi("output", f, ["B", "S", hq * d]), vi("present_key", f, ["B", hkv, "T", d]),
                               vi("present_value", f, ["B", hkv, "T", d])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=node_models.IR_VERSION)


@pytest.mark.parametrize("first, s, lengths", [(False, 1, [30, 12]), (True, 9, [9, 6]), (False, 5, [27])])
@pytest.mark.parametrize("window, softcap, sink", [
    (-1, 0.0, False), (4, 0.0, False), (12, 0.0, False), (30, 0.0, False), (64, 0.0, False), (-1, 2.0, False),
    (-1, 0.0, True), (5, 1.5, True), (1, 0.0, True),
])
def test_reference_matches_onnxruntime_group_query_attention(first, s, lengths, window, softcap, sink):
    """The reference itself, with raw16 caches, against ONNX Runtime's own float32 GroupQueryAttention
    on the CPU given the same (fp16-exact) past as float32: windows smaller than, equal to and
    larger than the context, softcap, head sinks and their combinations, for decode steps, right-padded
    first prompts and continuation chunks."""
    c = dict(BASE, b=len(lengths), s=s, first=first, capacity=32, lengths=lengths, formats=("raw16", "raw16"),
             window=window, softcap=softcap, sink=sink, seed=s + window)
    _, feeds = make(c)
    hq, hkv, d = c["hkv"] * c["group"], c["hkv"], c["d"]
    ort_feeds = {n: feeds[n] for n in ("query", "key", "value", "seqlens_k", "total_sequence_length")}
    for n in ("past_key", "past_value"):
        ort_feeds[n] = formats.unpack(feeds[n][..., :2 * d], "raw16", d).astype(np.float32)
    if sink:
        ort_feeds["head_sink"] = feeds["head_sink"]
    session = ort.InferenceSession(_ort_gqa_model(hq, hkv, d, window, softcap, sink).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    y_ort = session.run(["output"], ort_feeds)[0]
    y_ref = reference(c, feeds)[0]
    for i, n in enumerate(lengths):
        valid = n if first else s
        np.testing.assert_allclose(y_ref[i, :valid], y_ort[i, :valid], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap, sink", [(2.0, False), (0.0, True), (3.0, True)])
@pytest.mark.parametrize("s, first", [(1, False), (40, False), (33, True)])
def test_key_offset_leaves_softcap_and_sinks_the_true_scores(ort_session, device, softcap, sink, s, first):
    """A key offset only changes what is stored: with raw16 caches (the keys as they are, fp16 rounding
    apart) the output with a large key offset equals the output without one, though the softcap and
    the sink, unlike the softmax, would see the offset's shift of every score."""
    lengths = [s] * 2 if first else [s + 60, s + 7]
    c = dict(BASE, s=s, first=first, capacity=s + 64, lengths=lengths, formats=("raw16", "raw16"), softcap=softcap,
             sink=sink, window=24, seed=s)
    model, feeds = make(c)
    offset_model, with_offset = make({**c, "offsets": True})
    with_offset["key_offset"] = with_offset["key_offset"] * 4  # shifts of several units
    with_offset["value_offset"] = np.zeros_like(with_offset["value_offset"])
    if sink:
        with_offset["head_sink"] = feeds["head_sink"]
    for name in ("past_key", "past_value"):  # the same keys, stored less the offset
        with_offset[name] = feeds[name].copy()
    d = c["d"]
    keys = formats.unpack(feeds["past_key"][..., :2 * d], "raw16", d)
    with_offset["past_key"][..., :2 * d] = formats.pack(keys - with_offset["key_offset"][None, :, None, :], "raw16")
    y, _, _ = run(ort_session(model, 2, device), feeds)
    y_off, _, _ = run(ort_session(offset_model, 2, device), with_offset)
    np.testing.assert_allclose(y_off, y, rtol=3e-3, atol=3e-3)
    check_outputs({**c, "offsets": True}, y_off, *run(ort_session(offset_model, 2, device), with_offset)[1:],
                  reference({**c, "offsets": True}, with_offset))
