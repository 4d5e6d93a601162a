"""TQPagedAttention in ONNX Runtime (CPU) against the numpy reference: several sequences of different
lengths over scattered blocks of a pool, first prompts, decode steps and continuation chunks, the pools
updated in place (outputs bound to the inputs' buffers, as onnxruntime-genai's Engine binds them) or
copied (fresh outputs); every byte outside the new tokens' slots as it was; refusals."""

import os

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from turboquant import node_models
from turboquant.config import TQ_PRESETS, TurboQuantConfig
from turboquant.ort import run
from turboquant.reference import formats, paged_attention, pool_rows
from turboquant.reference.numerics import bfloat16

MAX_EXAMPLES = int(os.environ.get("TQ_MAX_EXAMPLES", "1000"))

NP = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}
TOL = {TensorProto.FLOAT: 2e-4, TensorProto.FLOAT16: 4e-3, TensorProto.BFLOAT16: 3e-2}


def preset_formats(name, d=64):
    cfg = TurboQuantConfig.from_cache_dtype(name, d)
    return (cfg.key_format, cfg.value_format), cfg.norm_correction


# every preset, and raw16 (boundary layers)
FORMATS = {name: preset_formats(name) for name in TQ_PRESETS} | {"raw16": (("raw16", "raw16"), True)}

# (past_seqlens, new tokens) of three sequences
MODES = {
    "first": ([0, 0, 0], [5, 1, 9]),
    "decode": ([7, 12, 3], [1, 1, 1]),
    "chunk": ([6, 3, 13], [4, 0, 9]),  # the second sequence has no new token this step
}

BASE = dict(d=64, hkv=2, group=2, block_size=4, pad=3, dtype=TensorProto.FLOAT, packed=False, rotary=0,
            interleaved=False, offsets=False, key_scale=False, window=-1, softcap=0.0, sink=False, spare=5, seed=0)


def make(c):
    """(model, feeds, new_slots): a pool of the blocks the sequences need plus c["spare"] more, in a
    random order, stale bytes in every padding byte; each sequence's blocks taken from a shuffled list,
    unused table columns -1. new_slots: bool [num_blocks, block_size], the slots the new tokens take."""
    rng = np.random.default_rng(c["seed"])
    kf, vf = c["formats"]
    d, hkv, bs = c["d"], c["hkv"], c["block_size"]
    hq = hkv * c["group"]
    dt = NP[c["dtype"]]
    pasts, news = c["pasts"], c["news"]
    totals = [p + n for p, n in zip(pasts, news)]
    needed = [-(-t // bs) for t in totals]
    num_blocks = sum(needed) + c["spare"]
    max_blocks = max(needed) + 1
    order = rng.permutation(num_blocks)
    table = np.full((len(pasts), max_blocks), -1, np.int32)
    new_slots = np.zeros((num_blocks, bs), bool)
    at = 0
    for i, n in enumerate(needed):
        table[i, :n] = order[at:at + n]
        at += n
        for r in range(pasts[i], totals[i]):
            new_slots[table[i, r // bs], r % bs] = True
    width = c.get("width") or max(formats.packed_size(kf, d), formats.packed_size(vf, d)) + c["pad"]
    pool_heads = c.get("pool_heads") or hkv
    model = node_models.paged_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=kf, value_format=vf,
                                    row_bytes=width, pool_heads=pool_heads, dtype=c["dtype"], packed_qkv=c["packed"], rotary_dim=c["rotary"],
                                    offsets=c["offsets"], key_scale=c["key_scale"], rotary_interleaved=int(c["interleaved"]),
                                    norm_correction=int(c["nc"]), local_window_size=c["window"], softcap=c["softcap"],
                                    head_sink=c["sink"])
    feeds = {}
    for name, fmt in (("key_cache", kf), ("value_cache", vf)):
        pool = rng.integers(0, 256, (num_blocks, bs, pool_heads, width), dtype=np.uint8)
        packed = formats.pack(rng.standard_normal((num_blocks, hkv, bs, d)).astype(np.float32), fmt, c["nc"])
        pool_rows(pool, hkv, packed.shape[-1])[:] = packed
        feeds[name] = pool
    tokens = sum(news)
    feeds["cumulative_sequence_length"] = np.concatenate([[0], np.cumsum(news)]).astype(np.int32)
    feeds["past_seqlens"] = np.array(pasts, np.int32)
    feeds["block_table"] = table
    if c["packed"]:
        feeds["query"] = rng.standard_normal((tokens, (hq + 2 * hkv) * d)).astype(dt)
    else:
        feeds["query"] = rng.standard_normal((tokens, hq * d)).astype(dt)
        feeds["key"] = rng.standard_normal((tokens, hkv * d)).astype(dt)
        feeds["value"] = rng.standard_normal((tokens, hkv * d)).astype(dt)
    if c["rotary"]:
        angles = rng.uniform(0, 6.3, (max(totals) + 3, c["rotary"] // 2))
        feeds["cos_cache"], feeds["sin_cache"] = np.cos(angles).astype(dt), np.sin(angles).astype(dt)
    if c["sink"]:
        feeds["head_sink"] = (2 * rng.standard_normal(hq)).astype(dt)
    if c["offsets"]:
        feeds["key_offset"] = rng.standard_normal((hkv, d)).astype(np.float32)
        feeds["value_offset"] = rng.standard_normal((hkv, d)).astype(np.float32)
    if c["key_scale"]:
        feeds["key_scale"] = np.exp(rng.uniform(-1.4, 1.4, (hkv, d))).astype(np.float32)
    return model, feeds, new_slots


def reference(c, feeds):
    kf, vf = c["formats"]
    return paged_attention(
        feeds["query"], feeds.get("key"), feeds.get("value"), feeds["key_cache"], feeds["value_cache"],
        feeds["cumulative_sequence_length"], feeds["past_seqlens"], feeds["block_table"], feeds.get("cos_cache"),
        feeds.get("sin_cache"), feeds.get("key_offset"), feeds.get("value_offset"), feeds.get("key_scale"),
        key_format=kf, value_format=vf, norm_correction=c["nc"], num_heads=c["hkv"] * c["group"],
        kv_num_heads=c["hkv"], do_rotary=c["rotary"] > 0, rotary_interleaved=c["interleaved"],
        local_window_size=c["window"], softcap=c["softcap"], head_sink=feeds.get("head_sink"))


def run_in_place(session, feeds):
    """One run with key_cache_out/value_cache_out bound to the pools' own buffers (the Engine's way)."""
    io = session.io_binding()
    # copies of the pools, the OrtValues' memory (an OrtValue shares its array's and does not keep it alive)
    pools = {name: feeds[name].copy() for name in ("key_cache", "value_cache")}
    io.bind_output("output", "cpu")  # first: get_outputs() follows the binding order
    for name, x in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(pools.get(name, x))
        io.bind_ortvalue_input(name, v)
        if name in pools:
            io.bind_ortvalue_output(name + "_out", v)
    session.run_with_iobinding(io)
    return io.get_outputs()[0].numpy(), pools["key_cache"], pools["value_cache"]


def check(c, feeds, new_slots, got, want):
    y, pk, pv = got
    wy, wk, wv = want
    kf, vf = c["formats"]
    for out, ref, pool, fmt in ((pk, wk, feeds["key_cache"], kf), (pv, wv, feeds["value_cache"], vf)):
        np.testing.assert_array_equal(out, ref)
        # on its own (not through the reference): only the packed bytes of the new tokens' slots changed
        may_change = np.zeros(pool.shape, bool)
        blocks, slots = np.nonzero(new_slots)
        pool_rows(may_change, c["hkv"], formats.packed_size(fmt, c["d"]))[blocks, :, slots] = True
        assert not (out != pool)[~may_change].any(), "a byte outside the new tokens' packed slots changed"
    assert y.shape == wy.shape
    y32, w32 = y.astype(np.float32), wy.astype(np.float32)
    assert np.all(np.isfinite(y32))
    span = max(1.0, float(np.abs(w32).max()))
    np.testing.assert_allclose(y32, w32, rtol=TOL[c["dtype"]], atol=TOL[c["dtype"]] * span)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("preset", list(FORMATS))
def test_presets_match_reference(ort_session, preset, mode):
    """Every preset's formats (and raw16), first prompts, decode steps and continuation chunks of three
    sequences over scattered blocks of 4 slots, the pools updated in place and as fresh outputs."""
    fmts, nc = FORMATS[preset]
    pasts, news = MODES[mode]
    c = dict(BASE, formats=fmts, nc=nc, pasts=pasts, news=news, seed=len(preset) * 7 + len(mode))
    model, feeds, new_slots = make(c)
    pools = feeds["key_cache"].copy(), feeds["value_cache"].copy()
    session = ort_session(model, 2)
    want = reference(c, feeds)
    check(c, feeds, new_slots, run(session, feeds), want)  # fresh outputs: the pools copied into them first
    check(c, feeds, new_slots, run_in_place(session, feeds), want)
    np.testing.assert_array_equal(feeds["key_cache"], pools[0])  # the fed pools themselves untouched
    np.testing.assert_array_equal(feeds["value_cache"], pools[1])


@pytest.mark.parametrize("formats_, block_size, dtype, rotary, packed", [
    (("mse4", "uint4"), 16, TensorProto.FLOAT16, 64, False),
    (("fp8", "uint4"), 4, TensorProto.FLOAT, 32, True),
    (("mse3", "uint3"), 8, TensorProto.BFLOAT16, 0, False),
])
def test_long_chunks_cross_many_blocks(ort_session, formats_, block_size, dtype, rotary, packed):
    """Chunks of 40 and 33 new tokens (the kernel's tiled pass over the past) after pasts that end
    inside a block, and a decode step beside them, over blocks of 4 to 16 slots."""
    c = dict(BASE, formats=formats_, nc=True, pasts=[21, 50, 9], news=[40, 1, 33], block_size=block_size,
             dtype=dtype, rotary=rotary, packed=packed, seed=block_size)
    model, feeds, new_slots = make(c)
    check(c, feeds, new_slots, run(ort_session(model, 2), feeds), reference(c, feeds))


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_every_feature_at_once(ort_session, dtype):
    """Interleaved rotary, key_scale, offsets, a window of 5, softcap and head sinks on a chunk."""
    c = dict(BASE, formats=("mse4", "uint4"), nc=True, pasts=[6, 3, 13], news=[4, 2, 9], dtype=dtype, rotary=64,
             interleaved=True, offsets=True, key_scale=True, window=5, softcap=20.0, sink=True, seed=3)
    model, feeds, new_slots = make(c)
    session = ort_session(model, 2)
    want = reference(c, feeds)
    check(c, feeds, new_slots, run(session, feeds), want)
    check(c, feeds, new_slots, run_in_place(session, feeds), want)


@pytest.mark.parametrize("mode", ["first", "chunk"])
def test_rows_wider_than_the_pools_width(ort_session, mode):
    """A pool's row width W need not be the format's: one KV head's raw16 rows (128 bytes) in pools of
    [.., 4, 40] (160-byte slots), as the rewrite splits a boundary layer over pools of a packed width."""
    pasts, news = MODES[mode]
    c = dict(BASE, formats=("raw16", "raw16"), nc=True, pasts=pasts, news=news, hkv=1, group=3, pool_heads=4,
             width=40, seed=5)
    model, feeds, new_slots = make(c)
    want = reference(c, feeds)
    check(c, feeds, new_slots, run(ort_session(model, 2), feeds), want)
    check(c, feeds, new_slots, run_in_place(ort_session(model, 2), feeds), want)


def test_steps_continue_in_the_same_pool(ort_session):
    """A prompt, then decode steps, each step's pools the next one's input (in place): the op agrees with
    the reference carried along the same steps, blocks of other sequences untouched throughout."""
    c = dict(BASE, formats=("mse3", "uint4"), nc=True, pasts=[0, 0], news=[10, 5], rotary=64, seed=11)
    model, feeds, _ = make(c)  # blocks and rotary rows for the steps' 10 and 5 tokens
    session = ort_session(model, 2)
    ref_k, ref_v = feeds["key_cache"], feeds["value_cache"]
    rng = np.random.default_rng(5)
    pasts = [0, 0]
    for news in ([6, 3], [1, 1], [1, 0], [2, 1]):
        step = dict(feeds, key_cache=ref_k, value_cache=ref_v,
                    cumulative_sequence_length=np.concatenate([[0], np.cumsum(news)]).astype(np.int32),
                    past_seqlens=np.array(pasts, np.int32))
        tokens = sum(news)
        for name, width in (("query", 4 * 64), ("key", 2 * 64), ("value", 2 * 64)):
            step[name] = rng.standard_normal((tokens, width)).astype(np.float32)
        want = reference(dict(c, pasts=pasts, news=news), step)
        y, pk, pv = run_in_place(session, step)
        np.testing.assert_array_equal(pk, want[1])
        np.testing.assert_array_equal(pv, want[2])
        np.testing.assert_allclose(y, want[0], rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(want[0]).max())))
        ref_k, ref_v = want[1], want[2]
        pasts = [p + n for p, n in zip(pasts, news)]


@st.composite
def cases(draw):
    b = draw(st.integers(1, 4))
    return dict(BASE, formats=draw(st.sampled_from([f for f, _ in FORMATS.values()])), nc=draw(st.booleans()),
                pasts=[draw(st.integers(0, 30)) for _ in range(b)], news=[draw(st.sampled_from([0, 1, 1, 3, 7]))
                                                                          for _ in range(b)],
                block_size=draw(st.sampled_from([1, 3, 8, 16])), d=draw(st.sampled_from([16, 64, 128])),
                hkv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2, 4])), pad=draw(st.sampled_from([0, 5])),
                rotary=draw(st.sampled_from([0, 16])), seed=draw(st.integers(0, 2**31)))


@settings(max_examples=min(100, MAX_EXAMPLES), deadline=None)
@given(c=cases())
def test_matches_reference(ort_session, c):
    if sum(c["news"]) == 0:
        c["news"][0] = 1
    model, feeds, new_slots = make(c)
    check(c, feeds, new_slots, run(ort_session(model, 2), feeds), reference(c, feeds))


REFUSALS = {
    "unmapped block": (lambda f: f["block_table"].__setitem__((1, 0), -1),
                       r"block_table\[1, 0\] = -1 must be a block of the pool"),
    "block beyond the pool": (lambda f: f["block_table"].__setitem__((0, 1), f["key_cache"].shape[0]),
                              r"block_table\[0, 1\] = \d+ must be a block of the pool"),
    "shared block": (lambda f: f["block_table"].__setitem__((2, 0), f["block_table"][0, 0]),
                     r"block \d+ is held by sequence 0 and again by sequence 2"),
    "lengths short of the tokens": (lambda f: f["cumulative_sequence_length"].__setitem__(3, 7),
                                    r"cumulative_sequence_length\[3\] = 7 must be the 13 tokens"),
    "negative past": (lambda f: f["past_seqlens"].__setitem__(1, -2), r"past_seqlens\[1\] = -2 must be >= 0"),
    "table too narrow": (lambda f: f["past_seqlens"].__setitem__(0, 40), r"sequence 0 holds 44 tokens: 11 blocks of 4"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_bad_tables_are_refused(ort_session, what):
    """Each a one-line InvalidArgument naming what was wrong; the reference refuses the same."""
    c = dict(BASE, formats=("mse4", "uint4"), nc=True, pasts=[6, 3, 13], news=[4, 0, 9])
    model, feeds, _ = make(c)
    change, message = REFUSALS[what]
    change(feeds)
    with pytest.raises(Exception, match="TQPagedAttention: " + message):
        run(ort_session(model, 2), feeds)
    with pytest.raises(ValueError):
        reference(c, feeds)


def test_bad_shapes_and_attributes_are_refused(ort_session):
    c = dict(BASE, formats=("mse4", "uint4"), nc=True, pasts=[6, 3, 13], news=[4, 0, 9])
    model, feeds, _ = make(c)
    narrow = dict(feeds, key_cache=feeds["key_cache"][..., :20].copy(), value_cache=feeds["value_cache"][..., :20].copy())
    narrow_model = node_models.paged_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                                           row_bytes=20)
    with pytest.raises(Exception, match=r"TQPagedAttention: the pools' slots of 2 x 20 = 40 bytes .* cannot hold "
                                        r"2 key rows of 34 bytes \(mse4"):
        run(ort_session(narrow_model, 2), narrow)
    with pytest.raises(ValueError, match="slots of 40 bytes cannot hold 2 rows of 36 bytes"):
        reference(c, narrow)
    uneven = dict(feeds, value_cache=feeds["value_cache"][:, :, :1].copy())
    with pytest.raises(ValueError, match=r"value_cache \(\d+, 4, 1, \d+\) must have key_cache's shape"):
        reference(c, uneven)
    table = dict(feeds, block_table=feeds["block_table"][:2].copy())
    with pytest.raises(Exception, match=r"input 'block_table' has shape \[2, \d+\]; expected \[3, max_blocks"):
        run(ort_session(model, 2), table)
    bad = node_models.paged_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                                  local_window_size=0)
    with pytest.raises(Exception, match="attribute 'local_window_size' must be -1 .* or positive, got 0"):
        ort_session(bad, 2)


def run_cuda(session, feeds, in_place):
    """One CUDA run: the pools in device memory, bound as the outputs too when in_place (the Engine's
    way); the lengths and the table given as host arrays (ORT moves each where the kernel takes it)."""
    io = session.io_binding()
    io.bind_output("output", "cuda")
    pools = {name: ort.OrtValue.ortvalue_from_numpy(feeds[name].copy(), "cuda", 0) for name in ("key_cache", "value_cache")}
    for name, x in feeds.items():
        if name in pools:
            io.bind_ortvalue_input(name, pools[name])
            if in_place:
                io.bind_ortvalue_output(name + "_out", pools[name])
        else:
            io.bind_cpu_input(name, x)
    if not in_place:
        io.bind_output("key_cache_out", "cuda")
        io.bind_output("value_cache_out", "cuda")
    session.run_with_iobinding(io)
    out = [o.numpy() for o in io.get_outputs()]
    return (out[0], pools["key_cache"].numpy(), pools["value_cache"].numpy()) if in_place else tuple(out)


# the modes, and pasts long enough for several 32-row tiles of the tensor-core decode kernel
CUDA_MODES = MODES | {"long_decode": ([70, 129, 33], [1, 1, 1]), "long_chunk": ([33, 129, 70], [9, 0, 40])}


@pytest.mark.gpu
@pytest.mark.parametrize("rotary", [0, 64])
@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("mode", list(CUDA_MODES))
@pytest.mark.parametrize("preset", list(FORMATS))
def test_cuda_matches_reference(cuda_ready, ort_session, preset, mode, block_size, rotary):
    """The CUDA kernels over the pool, float16, head size 128: the new rows' bytes as the reference packs
    them (and nothing else written), outputs within fp16 tolerance, in place and into fresh outputs;
    decode steps over blocks of 32 rows run on the tensor-core kernel (rotary fused), over blocks of 4 on
    the CUDA-core one; a chunk of 80 query rows a KV head over its past decoded dense, on the prefill kernel."""
    from turboquant.kernel_plan import last_split_kernel

    pasts, news = CUDA_MODES[mode]
    formats_, nc = FORMATS[preset]
    c = dict(BASE, formats=formats_, nc=nc, pasts=pasts, news=news, d=128, block_size=block_size,
             dtype=TensorProto.FLOAT16, rotary=rotary, seed=block_size + rotary)
    model, feeds, new_slots = make(c)
    session = ort_session(model, 2, "cuda")
    want = reference(c, feeds)
    check(c, feeds, new_slots, run_cuda(session, feeds, in_place=True), want)
    if mode == "long_decode":
        assert last_split_kernel() == ("tc_bulk" if block_size == 32 else "cuda_core")
    if mode == "long_chunk":
        assert last_split_kernel() == "dense_prefill"  # the last sequence's 40 new tokens over its 70
    check(c, feeds, new_slots, run_cuda(session, feeds, in_place=False), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("formats, d, dtype", [
    (("mse4", "uint4"), 128, TensorProto.FLOAT16), (("mse3", "uint3"), 64, TensorProto.FLOAT16),
    (("raw16", "raw16"), 128, TensorProto.FLOAT16), (("fp8", "uint4"), 256, TensorProto.FLOAT16),
])
def test_cuda_chunk_with_offsets(cuda_ready, ort_session, monkeypatch, formats, d, dtype, dense):
    """A chunk of 80 query rows a KV head over a past of 70 rows in blocks of 32, with key and value
    offsets, head sizes 64, 128 and 256: on the prefill kernel over the past decoded dense,
    and with TURBOQUANT_DENSE_PREFILL=0 on the split kernels, as the reference."""
    from turboquant.kernel_plan import last_split_kernel

    monkeypatch.setenv("TURBOQUANT_DENSE_PREFILL", "1" if dense else "0")
    c = dict(BASE, formats=formats, nc=True, pasts=[70], news=[40], d=d, pad=0, block_size=32, dtype=dtype, rotary=0,
             offsets=True, seed=9)
    model, feeds, new_slots = make(c)
    session = ort_session(model, 2, "cuda")
    want = reference(c, feeds)
    check(c, feeds, new_slots, run_cuda(session, feeds, in_place=True), want)
    assert (last_split_kernel() == "dense_prefill") == dense


@pytest.mark.gpu
def test_cuda_steps_continue_in_the_same_pool(cuda_ready, ort_session):
    """A first prompt, then decode steps in one pool on the device, in place: the CUDA op agrees with the
    CPU op step for step (pools byte for byte)."""
    c = dict(BASE, formats=("mse4", "uint4"), nc=True, pasts=[0, 0, 0], news=[41, 9, 68], d=128, block_size=32,
             dtype=TensorProto.FLOAT16, rotary=64, seed=3)
    model, feeds, _ = make(c)  # blocks and rotary rows for the steps' tokens
    gpu, cpu = ort_session(model, 2, "cuda"), ort_session(model, 2)
    rng = np.random.default_rng(4)
    pools_gpu = pools_cpu = [feeds["key_cache"], feeds["value_cache"]]
    pasts = [0, 0, 0]
    for news in ([37, 5, 64], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]):
        step = dict(feeds, cumulative_sequence_length=np.concatenate([[0], np.cumsum(news)]).astype(np.int32),
                    past_seqlens=np.array(pasts, np.int32))
        for name, width in (("query", 4 * 128), ("key", 2 * 128), ("value", 2 * 128)):
            step[name] = rng.standard_normal((sum(news), width)).astype(np.float16)
        y_gpu, *pools_gpu = run_cuda(gpu, dict(step, key_cache=pools_gpu[0], value_cache=pools_gpu[1]), True)
        y_cpu, *pools_cpu = run(cpu, dict(step, key_cache=pools_cpu[0], value_cache=pools_cpu[1]))
        np.testing.assert_array_equal(pools_gpu[0], pools_cpu[0])
        np.testing.assert_array_equal(pools_gpu[1], pools_cpu[1])
        np.testing.assert_allclose(y_gpu.astype(np.float32), y_cpu.astype(np.float32), rtol=4e-3, atol=4e-3)
        pasts = [p + n for p, n in zip(pasts, news)]


def test_a_nan_key_stays_in_its_sequence(ort_session):
    """A NaN in one new key (docs/ops.md, Non-finite input): its slot holds the format's NaN bytes as the
    reference packs them, the queries that see it give NaN rows, the other sequences are unaffected."""
    c = dict(BASE, formats=("mse4", "uint4"), nc=True, pasts=[6, 3, 13], news=[4, 2, 9], seed=8)
    model, feeds, _ = make(c)
    feeds["key"][1, 5] = np.nan  # sequence 0's second new token: seen by its last three queries
    y, pk, pv = run(ort_session(model, 2), feeds)
    wy, wk, wv = reference(c, feeds)
    np.testing.assert_array_equal(pk, wk)
    np.testing.assert_array_equal(pv, wv)
    nan_rows = np.isnan(y).any(axis=1)
    np.testing.assert_array_equal(nan_rows, np.isnan(wy).any(axis=1))
    assert nan_rows.tolist() == [False, True, True, True] + [False] * 11
    np.testing.assert_allclose(y[~nan_rows], wy[~nan_rows], rtol=2e-4, atol=2e-4 * max(1.0, float(np.abs(wy[~nan_rows]).max())))


def onnxruntime_paged_model(hq, hkv, d, rotary_dim):
    """One com.microsoft PagedAttention node over float16 pools (ONNX Runtime's CUDA kernel)."""
    from onnx import helper

    f16, i32 = TensorProto.FLOAT16, TensorProto.INT32
    pool = ["num_blocks", "block_size", hkv, d]
    inputs = [("query", f16, ["T", hq * d]), ("key", f16, ["T", hkv * d]), ("value", f16, ["T", hkv * d]),
              ("key_cache", f16, pool), ("value_cache", f16, pool), ("cumulative_sequence_length", i32, ["B1"]),
              ("past_seqlens", i32, ["B"]), ("block_table", i32, ["B", "max_blocks"])]
    if rotary_dim:
        inputs += [("cos_cache", f16, ["M", rotary_dim // 2]), ("sin_cache", f16, ["M", rotary_dim // 2])]
    outputs = [("output", f16, ["T", hq * d]), ("key_cache_out", f16, pool), ("value_cache_out", f16, pool)]
    node = helper.make_node("PagedAttention", [n for n, _, _ in inputs], [n for n, _, _ in outputs],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv, do_rotary=int(bool(rotary_dim)))
    graph = helper.make_graph([node], "paged", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=node_models.IR_VERSION)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rotary", [0, 64])
def test_raw16_agrees_with_onnxruntime_cuda_paged_attention(cuda_ready, ort_session, mode, rotary):
    """The op's semantics against ONNX Runtime's own PagedAttention (CUDA, float16 pools): raw16 rows are
    float16 values, so the same pools (viewed as bytes) give the same output and the same new rows."""
    pasts, news = MODES[mode]
    news = [n or 2 for n in news]  # a sequence without new tokens is this op's extension, not compared
    c = dict(BASE, formats=("raw16", "raw16"), nc=True, pasts=pasts, news=news, pad=0, dtype=TensorProto.FLOAT16,
             rotary=rotary, block_size=16, seed=21)  # (ORT's kernel: blocks of a power of two >= 16)
    model, feeds, new_slots = make(c)
    y, pk, pv = run_in_place(ort_session(model, 2), feeds)
    def token_major(pool):  # ONNX Runtime's layout: [num_blocks, block_size, Hkv, D] float16
        return pool_rows(pool, 2, 128).transpose(0, 2, 1, 3).copy().view(np.float16)

    f16 = {k: (token_major(x) if k in ("key_cache", "value_cache") else x) for k, x in feeds.items()}
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    session = ort.InferenceSession(onnxruntime_paged_model(4, 2, 64, rotary).SerializeToString(), so,
                                   providers=["CUDAExecutionProvider"])
    io = session.io_binding()
    io.bind_output("output", "cuda")
    pools = {}
    for name, x in f16.items():
        if name in ("key_cache", "value_cache"):
            v = pools[name] = ort.OrtValue.ortvalue_from_numpy(x.copy(), "cuda", 0)
            io.bind_ortvalue_input(name, v)
            io.bind_ortvalue_output(name + "_out", v)
        else:
            io.bind_cpu_input(name, x)
    session.run_with_iobinding(io)
    want_y = io.get_outputs()[0].numpy()
    want_k, want_v = pools["key_cache"].numpy(), pools["value_cache"].numpy()
    span = max(1.0, float(np.abs(want_y.astype(np.float32)).max()))
    np.testing.assert_allclose(y.astype(np.float32), want_y.astype(np.float32), rtol=4e-3, atol=4e-3 * span)
    for got, want in ((token_major(pk), want_k), (token_major(pv), want_v)):
        if rotary:  # the rotated keys may round differently by an ulp
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
        else:
            np.testing.assert_array_equal(got, want)
