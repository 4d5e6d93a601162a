"""TQGroupQueryAttention's sliding_window_cache (ORT's window-sized layout, turboquant/window_cache.h):
runs of calls as genai drives them (a first prompt, decode steps across the fill and several
compactions, continuation chunks) against the numpy reference, against the same op over a
full-length buffer, and (raw16, CPU) against ONNX Runtime's own GroupQueryAttention; decode steps
replayed from a CUDA graph; the refusals. Tests taking `device` run on the GPU too (the gpu mark)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from turboquant import node_models
from turboquant.ort import run
from turboquant.reference import formats, group_query_attention
from turboquant.reference.gqa import window_cache_end

PRESETS = [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16")]
B, D, HKV, GROUP, WINDOW = 2, 64, 2, 2, 8
HQ = HKV * GROUP
TOL = 4e-3


def model_for(formats_, cap_attr=1, window=WINDOW, rotary=D, dtype=TensorProto.FLOAT16):
    kf, vf = formats_
    return node_models.gqa_model(q_heads=HQ, kv_heads=HKV, head_dim=D, key_format=kf, value_format=vf, dtype=dtype,
                                 rotary_dim=rotary, local_window_size=window, sliding_window_cache=cap_attr)


def width_of(formats_):
    return max(formats.packed_size(f, D) for f in formats_)


def steps(prompt, decode, chunks=()):
    """New tokens per call: a first prompt, `decode` single tokens, then the chunks."""
    return [prompt] + [1] * decode + list(chunks)


def tokens(rng, s, batch, dtype=np.float16):
    return {"query": (3.0 * rng.standard_normal((batch, s, HQ * D))).astype(dtype),
            "key": rng.standard_normal((batch, s, HKV * D)).astype(dtype),
            "value": rng.standard_normal((batch, s, HKV * D)).astype(dtype)}


def rotary_tables(rows, dtype=np.float16):
    angles = np.random.default_rng(7).uniform(0, 6.3, (rows, D // 2))
    return {"cos_cache": np.cos(angles).astype(dtype), "sin_cache": np.sin(angles).astype(dtype)}


class Driver:
    """One model's buffers through a run of calls: `shared` binds present to past's OrtValues
    (genai's past_present_share_buffer), else each call's fresh present becomes the next past."""

    def __init__(self, session, rows, width, shared, device="cpu", batch=B):
        self.session, self.shared, self.kind = session, shared, "cuda" if device == "cuda" else "cpu"
        zeros = np.zeros((batch, HKV, rows, width), np.uint8)  # genai zeroes its buffers
        self.past = {"past_key": zeros, "past_value": zeros.copy()}
        if shared:
            self.values = {n: ort.OrtValue.ortvalue_from_numpy(x, self.kind, 0) for n, x in self.past.items()}

    def buffers(self):
        if self.shared:
            return {n: v.numpy() for n, v in self.values.items()}
        return dict(self.past)

    def __call__(self, feeds):
        if not self.shared:
            y, pk, pv = run(self.session, {**feeds, **self.past})
            self.past = {"past_key": pk, "past_value": pv}
            return y, pk, pv
        io = self.session.io_binding()
        for n, x in feeds.items():
            where = ("cpu", 0) if n == "total_sequence_length" else (self.kind, 0)
            io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(x, *where))
        for n, v in self.values.items():
            io.bind_ortvalue_input(n, v)
        io.bind_output("output", self.kind)
        io.bind_ortvalue_output("present_key", self.values["past_key"])
        io.bind_ortvalue_output("present_value", self.values["past_value"])
        self.session.run_with_iobinding(io)
        return (io.get_outputs()[0].numpy(), *self.buffers().values())


def calls(run_steps, seed=0, lengths0=(0, 0)):
    """(feeds, lengths after the call) per call; sequence b starts with lengths0[b] tokens."""
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths0, np.int64)
    for s in run_steps:
        lengths = lengths + s
        feeds = tokens(rng, s, len(lengths))
        feeds["seqlens_k"] = (lengths - 1).astype(np.int32)
        feeds["total_sequence_length"] = np.array(lengths.max(), np.int32)
        yield feeds, lengths.copy()


def reference(formats_, feeds, past, window=WINDOW, windowed=True):
    kf, vf = formats_
    return group_query_attention(**feeds, **past, key_format=kf, value_format=vf, num_heads=HQ, kv_num_heads=HKV,
                                 do_rotary="cos_cache" in feeds, local_window_size=window,
                                 sliding_window_cache=windowed)


def packed(formats_, pk, pv, rows=slice(None)):
    kb, vb = (formats.packed_size(f, D) for f in formats_)
    return pk[:, :, rows, :kb], pv[:, :, rows, :vb]


def check_run(session, formats_, cap, run_steps, shared, device="cpu"):
    """Each call against the reference run on the buffers as they were; returns the plans' staged flags."""
    drive = Driver(session, cap, width_of(formats_), shared, device)
    tables = rotary_tables(200)
    staged = []
    for feeds, lengths in calls(run_steps):
        feeds.update(tables)
        s = feeds["query"].shape[1]
        before = drive.buffers()
        want = reference(formats_, feeds, before)
        y, pk, pv = drive(feeds)
        np.testing.assert_allclose(y.astype(np.float32), want[0].astype(np.float32), atol=TOL, rtol=TOL)
        for b in range(B):
            t = int(lengths[b])
            rows = slice(0, window_cache_end(t, cap, WINDOW))
            for got, exp in zip(packed(formats_, pk[b:b + 1], pv[b:b + 1], rows),
                                packed(formats_, want[1][b:b + 1], want[2][b:b + 1], rows)):
                np.testing.assert_array_equal(got, exp)
            kept = window_cache_end(t, cap, WINDOW) - s
            staged.append(kept < min(t - s, WINDOW - 1))
        if not shared:  # a fresh present: every byte the reference's, zeros where nothing is written
            np.testing.assert_array_equal(pk, want[1])
            np.testing.assert_array_equal(pv, want[2])
    return staged


# capacities C = W (G = 1), W + 5 (G = 6: compactions by 6 rows) and W + 16 (genai's CPU default);
# the CUDA op takes C > W too (ONNX Runtime's own CUDA kernel does not)
CAPACITIES = [WINDOW, WINDOW + 5, WINDOW + 16]


@pytest.mark.parametrize("formats_", PRESETS)
@pytest.mark.parametrize("cap", CAPACITIES)
def test_a_run_of_calls_matches_the_reference(ort_session, device, formats_, cap):
    """A first prompt of 5, decode steps through the fill and at least three compactions, an
    in-place chunk of 2 and a chunk of C tokens (staged: it evicts rows its first query reads), in a
    shared buffer of C rows."""
    decode = cap + 3 * (cap - WINDOW + 1) + 2
    staged = check_run(ort_session(model_for(formats_), 2, device), formats_, cap, steps(5, decode, [2, cap]),
                       shared=True, device=device)
    assert all(staged[-B:]) and not any(staged[:B * (1 + decode)])  # decode steps never stage


@pytest.mark.parametrize("cap", CAPACITIES)
def test_a_first_prompt_longer_than_the_buffer_then_fresh_presents(ort_session, device, cap):
    """A first prompt of C + 7 tokens (staged), decode steps and a chunk, each call's present a
    fresh buffer: rows [L, C) and the new rows' padding are zeros."""
    run_steps = steps(cap + 7, 2 * (cap - WINDOW + 1) + 1, [3])
    formats_ = ("mse4", "uint4")
    staged = check_run(ort_session(model_for(formats_), 2, device), formats_, cap, run_steps, shared=False,
                       device=device)
    assert staged[0]


@pytest.mark.parametrize("formats_", PRESETS)
def test_window_sized_buffer_holds_the_full_buffers_last_rows(ort_session, device, formats_):
    """The same calls on a window-sized buffer of W + 5 rows and on a full-length one with the same
    local_window_size: outputs within tolerance, rows [0, L) of the first the packed bytes of rows
    [T - L, T) of the second (packing is deterministic per row)."""
    cap, total = WINDOW + 5, 80
    run_steps = steps(6, 40, [4, cap + 2])
    windowed = Driver(ort_session(model_for(formats_), 2, device), cap, width_of(formats_), shared=True, device=device)
    full = Driver(ort_session(model_for(formats_, cap_attr=0), 2, device), total, width_of(formats_), shared=True,
                  device=device)
    tables = rotary_tables(200)
    for feeds, lengths in calls(run_steps, seed=3):
        feeds.update(tables)
        y, pk, pv = windowed(feeds)
        y_full, fk, fv = full(feeds)
        np.testing.assert_allclose(y.astype(np.float32), y_full.astype(np.float32), atol=TOL, rtol=TOL)
        for b in range(B):
            t = int(lengths[b])
            n = window_cache_end(t, cap, WINDOW)
            for got, exp in zip(packed(formats_, pk[b:b + 1], pv[b:b + 1], slice(0, n)),
                                packed(formats_, fk[b:b + 1], fv[b:b + 1], slice(t - n, t))):
                np.testing.assert_array_equal(got, exp)


def test_sequences_of_different_lengths(ort_session, device):
    """Two sequences 9 tokens apart (their pasts in different phases of the compaction) through
    decode steps and a chunk of 3, a shared buffer of W + 5 rows."""
    formats_, cap = ("fp8", "uint4"), WINDOW + 5
    rng = np.random.default_rng(11)
    drive = Driver(ort_session(model_for(formats_), 2, device), cap, width_of(formats_), shared=True, device=device)
    lengths0 = (20, 29)
    for name, fmt in (("past_key", formats_[0]), ("past_value", formats_[1])):  # rows [0, L(P)) packed, as resident
        buf = drive.values[name].numpy()
        data = formats.pack(rng.standard_normal((B, HKV, cap, D)).astype(np.float32), fmt, True)
        buf[..., :data.shape[-1]] = data
        drive.values[name].update_inplace(buf)
    tables = rotary_tables(200)
    for feeds, lengths in calls(steps(1, 14, [3]), seed=4, lengths0=lengths0):
        feeds.update(tables)
        want = reference(formats_, feeds, drive.buffers())
        y, pk, pv = drive(feeds)
        np.testing.assert_allclose(y.astype(np.float32), want[0].astype(np.float32), atol=TOL, rtol=TOL)
        for b in range(B):
            rows = slice(0, window_cache_end(int(lengths[b]), cap, WINDOW))
            for got, exp in zip(packed(formats_, pk[b:b + 1], pv[b:b + 1], rows),
                                packed(formats_, want[1][b:b + 1], want[2][b:b + 1], rows)):
                np.testing.assert_array_equal(got, exp)


def ort_gqa_model(cap_rows_name="C", rotary=0):
    """ONNX Runtime's own GroupQueryAttention with sliding_window_cache = 1, float16 caches."""
    inputs = [helper.make_tensor_value_info("query", TensorProto.FLOAT16, ["B", "S", HQ * D]),
              helper.make_tensor_value_info("key", TensorProto.FLOAT16, ["B", "S", HKV * D]),
              helper.make_tensor_value_info("value", TensorProto.FLOAT16, ["B", "S", HKV * D]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT16, ["B", HKV, cap_rows_name, D]),
              helper.make_tensor_value_info("past_value", TensorProto.FLOAT16, ["B", HKV, cap_rows_name, D]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    names = [i.name for i in inputs]
    if rotary:
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["M", rotary // 2])
                   for n in ("cos_cache", "sin_cache")]
        names += ["cos_cache", "sin_cache"]
    outputs = [helper.make_tensor_value_info("output", TensorProto.FLOAT16, ["B", "S", HQ * D]),
               helper.make_tensor_value_info("present_key", TensorProto.FLOAT16, ["B", HKV, cap_rows_name, D]),
               helper.make_tensor_value_info("present_value", TensorProto.FLOAT16, ["B", HKV, cap_rows_name, D])]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs], domain="com.microsoft",
                            num_heads=HQ, kv_num_heads=HKV, local_window_size=WINDOW, sliding_window_cache=1,
                            do_rotary=1 if rotary else 0)
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


@pytest.mark.parametrize("cap", [WINDOW, WINDOW + 5, WINDOW + 16])
@pytest.mark.parametrize("rotary", [0, D])
def test_raw16_matches_onnxruntimes_own_windowed_cache(ort_session, cap, rotary):
    """raw16 (fp16 rows verbatim) against ORT's GroupQueryAttention with sliding_window_cache = 1,
    both in shared buffers of C rows, through a first prompt longer than C, decode steps across
    several compactions and a staged chunk: the same outputs, and rows [0, L) the same bytes (to
    fp16 rounding with the rotary, which ORT applies in float16 and the op in float32)."""
    formats_ = ("raw16", "raw16")
    ours = Driver(ort_session(model_for(formats_, rotary=rotary)), cap, width_of(formats_), shared=True, batch=1)
    theirs = ort.InferenceSession(ort_gqa_model(rotary=rotary).SerializeToString(), providers=["CPUExecutionProvider"])
    theirs_cache = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros((1, HKV, cap, D), np.float16))
                    for n in ("past_key", "past_value")}
    tables = rotary_tables(200) if rotary else {}
    # one sequence: ORT takes a continuation chunk for a batch of one only
    for feeds, lengths in calls(steps(cap + 3, 3 * (cap - WINDOW + 1) + 2, [cap]), seed=5, lengths0=(0,)):
        feeds.update(tables)
        y, pk, pv = ours(feeds)
        io = theirs.io_binding()
        for n, x in feeds.items():
            io.bind_ortvalue_input(n, ort.OrtValue.ortvalue_from_numpy(x))
        for n, v in theirs_cache.items():
            io.bind_ortvalue_input(n, v)
        io.bind_output("output")
        io.bind_ortvalue_output("present_key", theirs_cache["past_key"])
        io.bind_ortvalue_output("present_value", theirs_cache["past_value"])
        theirs.run_with_iobinding(io)
        y_ort = io.get_outputs()[0].numpy()
        np.testing.assert_allclose(y.astype(np.float32), y_ort.astype(np.float32), atol=2 * TOL, rtol=2 * TOL)
        n = window_cache_end(int(lengths[0]), cap, WINDOW)
        for got, cache in ((pk, "past_key"), (pv, "past_value")):
            mine = np.ascontiguousarray(got[0, :, :n, :2 * D]).view(np.float16)
            theirs_rows = theirs_cache[cache].numpy()[0, :, :n]
            if rotary and cache == "past_key":
                np.testing.assert_allclose(mine.astype(np.float32), theirs_rows.astype(np.float32), atol=4e-3,
                                           rtol=4e-3)
            else:
                np.testing.assert_array_equal(mine, theirs_rows)


def refused(ort_session, model, feeds, message):
    with pytest.raises(Exception, match=message):
        run(ort_session(model), feeds)


def one_call(cap, s=1, lengths=(12, 12), rotary=D):
    feeds, _ = next(calls([s], lengths0=tuple(n - s for n in lengths)))
    feeds.update({n: np.zeros((B, HKV, cap, width_of(("mse4", "uint4"))), np.uint8) for n in ("past_key", "past_value")})
    if rotary:
        feeds.update(rotary_tables(200))
    return feeds


def test_a_buffer_shorter_than_the_window_is_refused(ort_session):
    refused(ort_session, model_for(("mse4", "uint4")), one_call(WINDOW - 1),
            r"sliding_window_cache: KV cache capacity \(7\) must be at least local_window_size \(8\)\.")


def test_a_window_cache_without_a_window_is_refused(ort_session):
    refused(ort_session, model_for(("mse4", "uint4"), window=-1), one_call(WINDOW),
            r"sliding_window_cache=1 requires local_window_size > 0\.")


def test_other_attribute_values_are_refused(ort_session):
    refused(ort_session, model_for(("mse4", "uint4"), cap_attr=2), one_call(WINDOW),
            "attribute 'sliding_window_cache' must be 0 or 1, got 2")


def test_a_right_padded_first_prompt_is_refused(ort_session):
    feeds = one_call(WINDOW, s=4, lengths=(4, 4))
    feeds["seqlens_k"] = np.array([3, 1], np.int32)  # sequence 1 padded: 2 tokens of the 4
    refused(ort_session, model_for(("mse4", "uint4")), feeds, r"seqlens_k\[1\] = 1 is shorter than the 4 new tokens")



@pytest.mark.gpu
@pytest.mark.parametrize("formats_", [("mse4", "uint4"), ("raw16", "raw16")])
@pytest.mark.parametrize("cap", [WINDOW, WINDOW + 16])
def test_decode_steps_replayed_from_a_cuda_graph(cuda_ready, formats_, cap):
    """ORT's CUDA graphs (enable_cuda_graph): decode steps of two sequences 2 tokens apart replayed
    from the graph captured at the first step, across the fill and several compactions of a shared
    buffer of C rows, each equal to the reference on the buffer as it was (every length the moves
    and the attention use is read on the device). ONNX Runtime runs the first step more than once
    before it captures it, so that step drops no row here (one that did would drop them again:
    the rewrite keeps full-length caches where decode steps are replayed from graphs)."""
    from turboquant.ort import session_options

    so = session_options()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(model_for(formats_).SerializeToString(), so,
                                   providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
    rng = np.random.default_rng(13)
    lengths = np.array([3, 5], np.int64)
    width = width_of(formats_)
    feeds = {**tokens(rng, 1, B), **rotary_tables(200)}
    feeds["seqlens_k"] = (lengths - 1).astype(np.int32)
    on_gpu = {n: ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0) for n, x in feeds.items()}
    for n, fmt in (("past_key", formats_[0]), ("past_value", formats_[1])):  # resident rows [0, L(P)) packed
        buf = np.zeros((B, HKV, cap, width), np.uint8)
        data = formats.pack(rng.standard_normal((B, HKV, cap, D)).astype(np.float32), fmt, True)
        buf[..., :data.shape[-1]] = data
        on_gpu[n] = ort.OrtValue.ortvalue_from_numpy(buf, "cuda", 0)
    total = ort.OrtValue.ortvalue_from_numpy(np.array(lengths.max(), np.int32))
    y = ort.OrtValue.ortvalue_from_shape_and_type((B, 1, HQ * D), TensorProto.FLOAT16, "cuda", 0)
    io = session.io_binding()  # bound once: a replay reads and writes the addresses it was captured with
    for n, v in on_gpu.items():
        io.bind_ortvalue_input(n, v)
    io.bind_ortvalue_input("total_sequence_length", total)
    io.bind_ortvalue_output("output", y)
    io.bind_ortvalue_output("present_key", on_gpu["past_key"])
    io.bind_ortvalue_output("present_value", on_gpu["past_value"])
    for _ in range(3 * cap):
        lengths = lengths + 1
        step = tokens(rng, 1, B)
        feeds.update(step, seqlens_k=(lengths - 1).astype(np.int32),
                     total_sequence_length=np.array(lengths.max(), np.int32))
        for n in (*step, "seqlens_k"):
            on_gpu[n].update_inplace(feeds[n])
        total.update_inplace(feeds["total_sequence_length"])
        before = {n: on_gpu[n].numpy() for n in ("past_key", "past_value")}
        want = reference(formats_, feeds, before)
        session.run_with_iobinding(io)
        np.testing.assert_allclose(y.numpy().astype(np.float32), want[0].astype(np.float32), atol=TOL, rtol=TOL)
        pk, pv = on_gpu["past_key"].numpy(), on_gpu["past_value"].numpy()
        for b in range(B):
            rows = slice(0, window_cache_end(int(lengths[b]), cap, WINDOW))
            for got, exp in zip(packed(formats_, pk[b:b + 1], pv[b:b + 1], rows),
                                packed(formats_, want[1][b:b + 1], want[2][b:b + 1], rows)):
                np.testing.assert_array_equal(got, exp)
