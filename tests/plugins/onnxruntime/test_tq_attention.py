"""TQAttention in ONNX Runtime (CPU) against the numpy reference."""

import os

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from turboquant import node_models
from turboquant.kernel_plan import cuda_device, plan_split
from turboquant.ort import run
from turboquant.reference import attention, formats
from turboquant.reference.numerics import bfloat16

# TQ_MAX_EXAMPLES caps hypothesis's examples per test: the op tests under compute-sanitizer
# (scripts/gpu_session.sh check) run all of them, each on fewer cases.
MAX_EXAMPLES = int(os.environ.get("TQ_MAX_EXAMPLES", "1000"))

NP = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}
TOL = {TensorProto.FLOAT: 2e-4, TensorProto.FLOAT16: 4e-3, TensorProto.BFLOAT16: 3e-2}
KEY_FORMATS = ["mse3", "mse4", "fp8", "raw16"]
VALUE_FORMATS = ["uint3", "uint4", "raw16", "fp8"]


def to_layout(x, layout):
    """[B, H, S, D] -> the op's layout."""
    if layout == "bhsd":
        return x
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


@st.composite
def cases(draw):
    c = {
        "b": draw(st.integers(1, 2)),
        "hkv": draw(st.integers(1, 3)),
        "group": draw(st.sampled_from([1, 2, 4, 5, 8, 12])),
        "sq": draw(st.integers(1, 4)),
        "sp": draw(st.sampled_from([0, 1, 3, 17, 40])),
        "d": draw(st.sampled_from([16, 64, 80, 96, 128, 256])),
        "kf": draw(st.sampled_from(KEY_FORMATS)),
        "vf": draw(st.sampled_from(VALUE_FORMATS)),
        "dtype": draw(st.sampled_from(list(NP))),
        "layout": draw(st.sampled_from(["bhsd", "bsd"])),
        "mask": draw(st.sampled_from([None, "bool", "float", "float16"])),
        "mask_shape": draw(st.sampled_from(["full", "1hqk", "b1qk", "qk", "k"])),
        "causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.05])),
        "offsets": draw(st.booleans()),
        "nc": draw(st.booleans()),
        "values": draw(st.sampled_from(["normal", "wide", "constant"])),
        "seed": draw(st.integers(0, 2**31)),
    }
    return c


def make_inputs(c, rng):
    b, hkv, hq, sq, sp, d = c["b"], c["hkv"], c["hkv"] * c["group"], c["sq"], c["sp"], c["d"]
    dt = NP[c["dtype"]]

    def vals(shape):
        if c["values"] == "constant":
            return np.broadcast_to(rng.standard_normal((*shape[:-1], 1)), shape).astype(np.float32)
        scale = 20.0 if c["values"] == "wide" else 1.0
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    q = vals((b, hq, sq, d)).astype(dt)
    k = vals((b, hkv, sq, d)).astype(dt)
    v = vals((b, hkv, sq, d)).astype(dt)
    koff = voff = None
    if c["offsets"]:
        koff = rng.standard_normal((hkv, d)).astype(np.float32)
        voff = rng.standard_normal((hkv, d)).astype(np.float32)
    pk = formats.pack(vals((b, hkv, sp, d)), c["kf"], c["nc"])
    pv = formats.pack(vals((b, hkv, sp, d)), c["vf"])
    st_ = sp + sq
    mask = None
    if c["mask"]:
        shape = {"full": (b, hq, sq, st_), "1hqk": (1, hq, sq, st_), "b1qk": (b, 1, sq, st_), "qk": (sq, st_), "k": (st_,)}[c["mask_shape"]]
        if c["mask"] == "bool":
            mask = rng.random(shape) > 0.3
        else:
            mask = rng.standard_normal(shape).astype(np.float32)
            mask[rng.random(shape) < 0.2] = -np.inf
            mask = mask.astype(np.float16 if c["mask"] == "float16" else np.float32)
    return q, k, v, mask, pk, pv, koff, voff


def model_for(c, mask):
    mask_type = None
    if mask is not None:
        mask_type = {np.dtype(bool): TensorProto.BOOL, np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}[mask.dtype]
    attrs = {"is_causal": int(c["causal"]), "norm_correction": int(c["nc"])}
    if c["scale"]:
        attrs["scale"] = c["scale"]
    m = node_models.attention_model(q_heads=c["hkv"] * c["group"], kv_heads=c["hkv"], head_dim=c["d"], key_format=c["kf"],
                               value_format=c["vf"], dtype=c["dtype"], layout=c["layout"], mask=mask_type,
                               offsets=c["offsets"], **attrs)
    if mask is not None:  # the mask's rank varies: leave its shape open
        m.graph.input[3].type.tensor_type.ClearField("shape")
    return m


def check_case(ort_session, c, threads=2, device="cpu"):
    rng = np.random.default_rng(c["seed"])
    q, k, v, mask, pk, pv, koff, voff = make_inputs(c, rng)
    hq, hkv = c["hkv"] * c["group"], c["hkv"]
    feeds = {"Q": to_layout(q, c["layout"]), "K": to_layout(k, c["layout"]), "V": to_layout(v, c["layout"]),
             "past_key": pk, "past_value": pv}
    if mask is not None:
        feeds["attn_mask"] = mask
    if c["offsets"]:
        feeds["key_offset"], feeds["value_offset"] = koff, voff
    y, prk, prv = run(ort_session(model_for(c, mask), threads, device), feeds)
    wy, wk, wv = attention(feeds["Q"], feeds["K"], feeds["V"], mask, pk, pv, koff, voff, key_format=c["kf"],
                           value_format=c["vf"], norm_correction=c["nc"], is_causal=c["causal"], scale=c["scale"],
                           q_num_heads=hq, kv_num_heads=hkv, fp16_centroids=fp16_centroids(c, device))
    np.testing.assert_array_equal(prk, wk)
    np.testing.assert_array_equal(prv, wv)
    assert y.dtype == wy.dtype and y.shape == wy.shape
    y32, w32 = y.astype(np.float32), wy.astype(np.float32)
    assert np.all(np.isfinite(y32))
    span = max(1.0, float(np.abs(w32).max()))
    np.testing.assert_allclose(y32, w32, rtol=TOL[c["dtype"]], atol=TOL[c["dtype"]] * span)


DTYPE_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


def fp16_centroids(c, device):
    """Whether the reference scores the past through fp16 centroids, as the kernel that runs does:
    the bulk and chunk tensor-core split kernels (documented to round MSE keys as an fp16 cache would;
    with "wide" values the scores reach thousands, where that rounding can tip near-equal keys). The
    mma kernel adds the centroids' fp16 low parts in a product of their own: its keys are not rounded."""
    if device != "cuda" or c["sp"] == 0 or not c["kf"].startswith("mse"):
        return False
    return plan_split(**planned_call(c), device=cuda_device()).kernel in ("tc_bulk", "tc_chunk")


def planned_prefill(c):
    """A case as turboquant.kernel_plan.plan_prefill's keywords."""
    mask = {None: None, "bool": "bool", "float": "float32", "float16": "float16"}[c["mask"]]
    return dict(q_len=c["sq"], head_dim=c["d"], dtype=DTYPE_NAMES[c["dtype"]], mask=mask)


def planned_call(c):
    """A case as turboquant.kernel_plan.plan_split's keywords (what the op hands the planner)."""
    mask = {None: None, "bool": "bool", "float": "float32", "float16": "float16"}[c["mask"]]
    return dict(batch=c["b"], q_heads=c["hkv"] * c["group"], kv_heads=c["hkv"], q_len=c["sq"], past_len=c["sp"],
                head_dim=c["d"], key_format=c["kf"], value_format=c["vf"], dtype=DTYPE_NAMES[c["dtype"]], mask=mask,
                is_causal=c["causal"])


@settings(max_examples=min(250, MAX_EXAMPLES), deadline=None)
@given(c=cases())
def test_matches_reference(ort_session, device, c):
    check_case(ort_session, c, device=device)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("kf, vf", [("mse4", "uint4"), ("mse3", "uint4"), ("mse3", "uint3"), ("fp8", "uint4")])
def test_presets_every_head_dim(ort_session, device, d, kf, vf):
    c = dict(b=1, hkv=2, group=4, sq=1, sp=33, d=d, kf=kf, vf=vf, dtype=TensorProto.FLOAT16, layout="bhsd", mask=None,
             mask_shape="full", causal=True, scale=None, offsets=False, nc=True, values="normal", seed=d)
    check_case(ort_session, c, device=device)


@pytest.mark.parametrize("sq, d, dtype, layout, causal, kf, vf, mask, mask_shape", [
    (300, 128, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", None, "full"),
    (257, 64, TensorProto.BFLOAT16, "bhsd", True, "mse3", "uint3", None, "full"),
    (130, 128, TensorProto.BFLOAT16, "bsd", False, "fp8", "uint4", None, "full"),
    pytest.param(1000, 128, TensorProto.FLOAT16, "bhsd", True, "mse3", "uint4", None, "full", marks=pytest.mark.long),
    (200, 128, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", "float", "b1qk"),
    (150, 64, TensorProto.FLOAT16, "bsd", False, "mse4", "uint4", "bool", "full"),
    (129, 128, TensorProto.BFLOAT16, "bhsd", False, "mse4", "uint4", "float16", "k"),
])
def test_first_prompt(ort_session, device, prefill_kernel_ran, sq, d, dtype, layout, causal, kf, vf, mask, mask_shape):
    """A prompt with no past, long enough for several tiles of query rows and keys (on CUDA the
    tensor-core prefill kernels, which the short hypothesis cases reach only with one tile: Hopper's
    warpgroup products without a mask, mma.sync with one), with and without masks."""
    c = dict(b=2, hkv=2, group=4, sq=sq, sp=0, d=d, kf=kf, vf=vf, dtype=dtype, layout=layout, mask=mask,
             mask_shape=mask_shape, causal=causal, scale=None, offsets=False, nc=True, values="normal", seed=sq)
    check_case(ort_session, c, device=device)
    if device == "cuda":
        prefill_kernel_ran("mma" if mask else "wgmma", **planned_prefill(c))


@pytest.mark.parametrize("b, hkv, group, sq, d, dtype, causal", [
    (1, 1, 1, 333, 128, TensorProto.FLOAT16, True), (3, 2, 3, 200, 128, TensorProto.FLOAT16, True),
    (1, 1, 8, 129, 64, TensorProto.BFLOAT16, True), (2, 4, 2, 2, 128, TensorProto.FLOAT16, True),
    (1, 2, 2, 511, 64, TensorProto.FLOAT16, False),
    pytest.param(1, 8, 4, 1100, 128, TensorProto.BFLOAT16, True, marks=pytest.mark.long),
])
def test_first_prompt_shapes(ort_session, device, prefill_kernel_ran, b, hkv, group, sq, d, dtype, causal):
    """First prompts of other group sizes, batches and lengths (one row over a tile, two rows, several
    tiles of keys with a partial last one)."""
    c = dict(b=b, hkv=hkv, group=group, sq=sq, sp=0, d=d, kf="mse4", vf="uint4", dtype=dtype, layout="bsd", mask=None,
             mask_shape="full", causal=causal, scale=None, offsets=False, nc=True, values="normal", seed=sq + group)
    check_case(ort_session, c, device=device)
    if device == "cuda":
        prefill_kernel_ran("wgmma", **planned_prefill(c))


@pytest.mark.parametrize("sq, sp, d, dtype, layout, causal, kf, vf, mask, mask_shape", [
    (300, 777, 128, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", None, "full"),
    (257, 100, 64, TensorProto.BFLOAT16, "bhsd", True, "mse3", "uint3", None, "full"),
    (130, 513, 128, TensorProto.BFLOAT16, "bsd", False, "fp8", "uint4", None, "full"),
    (200, 1000, 128, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", "float", "b1qk"),
    (150, 31, 64, TensorProto.FLOAT16, "bsd", False, "mse4", "uint4", "bool", "full"),
    (129, 64, 128, TensorProto.BFLOAT16, "bhsd", True, "raw16", "raw16", "float16", "k"),
])
def test_continuation_chunk(ort_session, device, prefill_kernel_ran, sq, sp, d, dtype, layout, causal, kf, vf, mask,
                            mask_shape):
    """A chunk of many new tokens over a packed past, with key and value offsets (on CUDA the new
    tokens' part on tensor cores, one more partial result merged with the past's, whose scores are of
    the keys less their offset), with and without masks (a mask's columns after the past)."""
    c = dict(b=2, hkv=2, group=4, sq=sq, sp=sp, d=d, kf=kf, vf=vf, dtype=dtype, layout=layout, mask=mask,
             mask_shape=mask_shape, causal=causal, scale=None, offsets=True, nc=True, values="normal", seed=sq + sp)
    check_case(ort_session, c, device=device)
    if device == "cuda":
        prefill_kernel_ran("mma" if mask else "wgmma", **planned_prefill(c))


@pytest.mark.parametrize("sq, sp, dtype, layout, causal, kf, vf, mask, mask_shape", [
    (300, 0, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", None, "full"),
    (257, 0, TensorProto.BFLOAT16, "bhsd", True, "mse3", "uint3", None, "full"),
    (130, 0, TensorProto.BFLOAT16, "bsd", False, "fp8", "uint4", None, "full"),
    (200, 0, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", "float", "b1qk"),
    (150, 0, TensorProto.FLOAT16, "bsd", False, "mse4", "uint4", "bool", "full"),
    (129, 0, TensorProto.BFLOAT16, "bhsd", False, "raw16", "raw16", "float16", "k"),
    (300, 777, TensorProto.FLOAT16, "bsd", True, "mse4", "uint4", None, "full"),
    (200, 1000, TensorProto.FLOAT16, "bsd", True, "mse3", "uint3", "float", "b1qk"),
    (129, 64, TensorProto.BFLOAT16, "bhsd", True, "raw16", "raw16", "float16", "k"),
])
@pytest.mark.parametrize("one_buffer", [False, True])
@pytest.mark.parametrize("target", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_head_size_256_prompts(ort_session, target, prefill_kernel_ran, monkeypatch, one_buffer, sq, sp, dtype, layout,
                               causal, kf, vf, mask, mask_shape):
    """Head size 256 (Gemma 3) first prompts and continuation chunks (with key and value offsets) on
    CUDA: their new tokens on prefill.cu's mma.sync kernel (the wgmma kernel has no such tiles), with
    and without masks; with two buffers of keys and values, and with the one that devices of 99 KiB of
    shared memory per block run (TURBOQUANT_PREFILL_ONE_BUFFER=1, read at each launch)."""
    if one_buffer:
        monkeypatch.setenv("TURBOQUANT_PREFILL_ONE_BUFFER", "1")
    c = dict(b=2, hkv=2, group=4, sq=sq, sp=sp, d=256, kf=kf, vf=vf, dtype=dtype, layout=layout, mask=mask,
             mask_shape=mask_shape, causal=causal, scale=None, offsets=sp > 0, nc=True, values="normal", seed=sq + sp)
    check_case(ort_session, c, device=target)
    prefill_kernel_ran("mma", **planned_prefill(c))


@pytest.mark.parametrize("change, want", [
    ({}, "tc_bulk"),
    ({"kf": "mse3", "vf": "uint3", "d": 64, "dtype": TensorProto.BFLOAT16}, "tc_bulk"),
    ({"vf": "uint3", "causal": False}, "tc_mma"),
    ({"kf": "fp8"}, "tc_bulk"),
    ({"sq": 15}, "tc_bulk"),
    ({"mask": "bool"}, "tc_bulk"),
    ({"mask": "float16", "mask_shape": "b1qk", "kf": "fp8"}, "tc_bulk"),
    ({"mask": "float", "d": 256}, "cuda_core"),
])
def test_continuation_chunks_run_the_planned_kernel_on_cuda(ort_session, cuda_ready, split_kernel_ran, change, want):
    """A chunk of many new tokens over a dense past of 1000 on the GPU: its output equals the
    reference's and the split kernel that ran is the planner's (the decode kernels: the chunk kernel
    takes preallocated caches only, test_tq_gqa.py)."""
    c = {**dict(b=2, hkv=2, group=4, sq=200, sp=1000, d=128, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT16,
                layout="bsd", mask=None, mask_shape="full", causal=True, scale=None, offsets=True, nc=True,
                values="normal", seed=5), **change}
    check_case(ort_session, c, device="cuda")
    split_kernel_ran(want, **planned_call(c))


@pytest.mark.parametrize("change, want", [
    ({}, "tc_bulk"),
    ({"kf": "fp8"}, "tc_bulk"),
    ({"kf": "mse3", "vf": "uint3", "dtype": TensorProto.BFLOAT16}, "tc_bulk"),
    ({"mask": "bool"}, "tc_bulk"),
    ({"mask": "float16", "mask_shape": "b1qk"}, "tc_bulk"),
    ({"mask": "float", "mask_shape": "k", "kf": "mse3", "vf": "uint3", "dtype": TensorProto.BFLOAT16}, "tc_bulk"),
    ({"mask": "bool", "mask_shape": "1hqk", "kf": "fp8", "d": 64}, "tc_bulk"),
    ({"mask": "float16", "mask_shape": "qk", "vf": "uint3"}, "cuda_core"),
    ({"dtype": TensorProto.FLOAT}, "cuda_core"),
    ({"d": 80}, "tc_mma"),
    ({"vf": "uint3"}, "tc_mma"),
    ({"sq": 3, "sp": 300}, "tc_bulk"),
    ({"kf": "raw16", "vf": "raw16"}, "tc_bulk"),
    ({"kf": "raw16", "vf": "raw16", "d": 64, "dtype": TensorProto.BFLOAT16}, "tc_bulk"),
    ({"kf": "raw16", "vf": "raw16", "dtype": TensorProto.FLOAT}, "cuda_core"),
    ({"kf": "raw16", "vf": "raw16", "d": 256}, "cuda_core"),
    ({"kf": "raw16", "vf": "raw16", "mask": "bool"}, "tc_bulk"),
    ({"kf": "raw16", "vf": "raw16", "mask": "float16", "mask_shape": "b1qk", "d": 64}, "tc_bulk"),
    ({"sp": 0}, "none"),
])
def test_the_planned_split_kernel_runs_on_cuda(ort_session, cuda_ready, split_kernel_ran, change, want):
    """One decode call per row on the GPU (B = 2, 8 KV heads of 4 query heads of 128, a past of
    1000 tokens): its output equals the reference's and the split kernel that ran is the planner's
    choice (on an H200: `want`)."""
    c = {**dict(b=2, hkv=8, group=4, sq=1, sp=1000, d=128, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT16,
                layout="bsd", mask=None, mask_shape="full", causal=True, scale=None, offsets=False, nc=True,
                values="normal", seed=11), **change}
    check_case(ort_session, c, device="cuda")
    split_kernel_ran(want, **planned_call(c))


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b, hkv, group, sq, sp, offsets", [
    (1, 1, 1, 1, 1, False), (2, 2, 4, 1, 33, False), (3, 2, 8, 1, 257, True), (2, 8, 4, 1, 1000, False),
    (1, 1, 5, 1, 4133, False), (2, 2, 4, 3, 300, False), (2, 1, 32, 1, 95, True),
])
def test_raw16_caches(ort_session, device, split_kernel_ran, dtype, d, b, hkv, group, sq, sp, offsets):
    """raw16 keys and values (onnxruntime-genai's uncompressed boundary layers) at the head sizes the
    GPU's tensor-core bulk kernel takes them (64 and 128), fp16 and bf16: pasts of one token, of
    fewer and more than a warp's 32-token tile and than a block's round of tiles (8 warps at 64, 6 at
    128), not multiples of either; several sequences; GQA groups of 1 to 32 query heads (5: padding
    query rows in a block), several query rows, offsets. The output equals the reference's, and on
    the GPU the bulk kernel ran."""
    c = dict(b=b, hkv=hkv, group=group, sq=sq, sp=sp, d=d, kf="raw16", vf="raw16", dtype=dtype, layout="bsd",
             mask=None, mask_shape="full", causal=True, scale=None, offsets=offsets, nc=True, values="normal",
             seed=sp + d)
    check_case(ort_session, c, device=device)
    if device == "cuda":
        split_kernel_ran("tc_bulk", **planned_call(c))


CASE = dict(b=2, hkv=2, group=2, sq=2, sp=3, d=64, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT, layout="bhsd",
            mask=None, mask_shape="full", causal=True, scale=None, offsets=False, nc=True, values="normal", seed=7)


@pytest.mark.parametrize("vf", ["mse3", "mse4"])
@pytest.mark.parametrize("nc", [False, True])
def test_norm_correction_covers_mse_values(ort_session, device, vf, nc):
    """norm_correction applies to MSE values as to MSE keys, in the op and the reference alike."""
    check_case(ort_session, {**CASE, "vf": vf, "nc": nc}, device=device)


@pytest.mark.parametrize("vf", ["uint3", "uint4"])
def test_new_values_with_a_nan_pack_as_nan_vectors(ort_session, device, vf):
    """The new tokens' values are packed into present as TQPack packs them: a NaN makes the vector's
    row the NaN vector of the format (docs/ops.md), the other rows are unchanged."""
    rng = np.random.default_rng(3)
    q, k, v, _, pk, pv, _, _ = make_inputs({**CASE, "vf": vf}, rng)
    v[0, 1, 0, 5] = np.nan
    v[1, 0, 1, 0] = -np.nan
    m = node_models.attention_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format=vf, is_causal=1)
    _, prk, prv = run(ort_session(m, device=device), {"Q": q, "K": k, "V": v, "past_key": pk, "past_value": pv})
    _, wk, wv = attention(q, k, v, None, pk, pv, key_format="mse4", value_format=vf, is_causal=True)
    np.testing.assert_array_equal(prk, wk)
    np.testing.assert_array_equal(prv, wv)
    nb = 64 * int(vf[4]) // 8
    for b, h, s in ((0, 1, 3), (1, 0, 4)):
        assert (prv[b, h, s, :nb] == 0).all() and list(prv[b, h, s, nb:]) == [0x00, 0x7E, 0x00, 0x7E]


def test_threads_give_the_same_result(ort_session):
    c = dict(b=2, hkv=4, group=4, sq=3, sp=300, d=128, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT, layout="bhsd",
             mask=None, mask_shape="full", causal=True, scale=None, offsets=True, nc=True, values="normal", seed=7)
    check_case(ort_session, c, threads=1)
    check_case(ort_session, c, threads=2)


def test_mqa_long_cache_and_empty_past(ort_session, device):
    base = dict(b=1, hkv=1, group=32, sq=1, d=128, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT16, layout="bsd",
                mask=None, mask_shape="full", causal=True, scale=None, offsets=False, nc=True, values="normal", seed=3)
    check_case(ort_session, {**base, "sp": 2000}, device=device)
    check_case(ort_session, {**base, "sp": 0, "sq": 7}, device=device)


def test_offsets_zero_changes_nothing_and_shift_is_invariant(ort_session, rng):
    """All-zero offsets give the plain op's outputs exactly; a key offset only moves every score of a
    query by the same amount, so with exact (new) keys it leaves Y unchanged."""
    hq, hkv, d = 8, 2, 64
    plain = ort_session(node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse4", value_format="uint4"))
    with_off = ort_session(node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse4", value_format="uint4", offsets=True))
    q = rng.standard_normal((1, hq, 4, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, hkv, 4, d)).astype(np.float32) for _ in range(2))
    pk = formats.pack(rng.standard_normal((1, hkv, 9, d)).astype(np.float32), "mse4")
    pv = formats.pack(rng.standard_normal((1, hkv, 9, d)).astype(np.float32), "uint4")
    feeds = {"Q": q, "K": k, "V": v, "past_key": pk, "past_value": pv}
    zeros = {"key_offset": np.zeros((hkv, d), np.float32), "value_offset": np.zeros((hkv, d), np.float32)}
    for a, b in zip(plain.run(None, feeds), with_off.run(None, {**feeds, **zeros})):
        np.testing.assert_array_equal(a, b)
    empty = {"Q": q, "K": k, "V": v, "past_key": pk[:, :, :0], "past_value": pv[:, :, :0]}
    shift = {"key_offset": rng.standard_normal((hkv, d)).astype(np.float32) * 5, "value_offset": zeros["value_offset"]}
    np.testing.assert_allclose(with_off.run(None, {**empty, **shift})[0], plain.run(None, empty)[0], rtol=1e-4, atol=1e-5)


def test_key_offset_recovers_accuracy_of_biased_keys(ort_session, rng):
    """Keys with a large common component: encoding k - mean makes the packed cache far closer to
    exact attention than encoding k itself."""
    hq, hkv, d, sp = 4, 1, 128, 256
    bias = rng.standard_normal((hkv, d)).astype(np.float32) * 8
    keys = rng.standard_normal((1, hkv, sp, d)).astype(np.float32) + bias[None, :, None, :]
    vals = rng.standard_normal((1, hkv, sp, d)).astype(np.float32)
    q = rng.standard_normal((1, hq, 1, d)).astype(np.float32)
    k, v = keys[:, :, -1:], vals[:, :, -1:]
    exact = attention(q, keys, vals, None, None, None, key_format="raw16", value_format="raw16")[0]
    errs = {}
    for name, off in [("plain", None), ("offset", bias)]:
        m = node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse4", value_format="raw16", offsets=off is not None)
        sub = bias if off is not None else 0.0
        pk = formats.pack(keys[:, :, :-1] - sub, "mse4")
        feeds = {"Q": q, "K": k, "V": v, "past_key": pk, "past_value": formats.pack(vals[:, :, :-1], "raw16")}
        if off is not None:
            feeds |= {"key_offset": off, "value_offset": np.zeros((hkv, d), np.float32)}
        errs[name] = float(np.abs(ort_session(m).run(None, feeds)[0] - exact).mean())
    assert errs["offset"] < 0.5 * errs["plain"], errs


def test_generation_loop_feeds_present_back(ort_session, rng, device):
    """Prefill 5 tokens, then 16 decode steps with present fed back as past: each step equals the
    reference (present byte for byte, Y to float tolerance); on the GPU too."""
    hq, hkv, d = 8, 2, 64
    sess = ort_session(node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse3", value_format="uint4",
                                              dtype=TensorProto.FLOAT16, is_causal=1), device=device)
    pk = np.zeros((1, hkv, 0, formats.packed_size("mse3", d)), np.uint8)
    pv = np.zeros((1, hkv, 0, formats.packed_size("uint4", d)), np.uint8)
    for step in range(17):
        n = 5 if step == 0 else 1
        q = rng.standard_normal((1, hq, n, d)).astype(np.float16)
        k, v = (rng.standard_normal((1, hkv, n, d)).astype(np.float16) for _ in range(2))
        y, nk, nv = sess.run(None, {"Q": q, "K": k, "V": v, "past_key": pk, "past_value": pv})
        wy, wk, wv = attention(q, k, v, None, pk, pv, key_format="mse3", value_format="uint4", is_causal=True)
        np.testing.assert_array_equal(nk, wk)
        np.testing.assert_array_equal(nv, wv)
        np.testing.assert_allclose(y.astype(np.float32), wy.astype(np.float32), atol=4e-3)
        pk, pv = nk, nv
    assert pk.shape[2] == 21


# -- errors -----------------------------------------------------------------------------------------

ERR = (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail)


def free_model(n_inputs=6, **attrs):
    """TQAttention whose inputs have no declared shape, so that only the op validates them."""
    names = ["Q", "K", "V", "attn_mask", "past_key", "past_value", "key_offset", "value_offset"][:n_inputs]
    types = [TensorProto.FLOAT] * 3 + [TensorProto.BOOL, TensorProto.UINT8, TensorProto.UINT8, TensorProto.FLOAT, TensorProto.FLOAT]
    attrs.setdefault("key_format", "mse4")
    attrs.setdefault("value_format", "uint4")
    return node_models.node_model("TQAttention", [(n, t, None) for n, t in zip(names, types)],
                             [("Y", TensorProto.FLOAT, None), ("present_key", TensorProto.UINT8, None), ("present_value", TensorProto.UINT8, None)],
                             **attrs)


def good_feeds(b=1, hq=4, hkv=2, s=1, sp=3, d=64):
    f = np.zeros
    return {"Q": f((b, hq, s, d), np.float32), "K": f((b, hkv, s, d), np.float32), "V": f((b, hkv, s, d), np.float32),
            "attn_mask": np.ones((s, sp + s), bool),
            "past_key": f((b, hkv, sp, 34), np.uint8), "past_value": f((b, hkv, sp, 36), np.uint8),
            "key_offset": f((hkv, d), np.float32), "value_offset": f((hkv, d), np.float32)}


@pytest.mark.parametrize("change, fragments", [
    ({"Q": np.zeros((4, 64), np.float32)}, ["input 'Q' must be 4-D", "[4, 64]"]),
    ({"K": np.zeros((1, 2, 64), np.float32)}, ["input 'K' has rank 3 but 'Q' has rank 4"]),
    ({"Q": np.zeros((1, 3, 1, 64), np.float32)}, ["query head count 3", "multiple of the kv head count 2"]),
    ({"Q": np.zeros((1, 4, 1, 60), np.float32), "K": np.zeros((1, 2, 1, 60), np.float32), "V": np.zeros((1, 2, 1, 60), np.float32)},
     ["input 'Q' has head size 60", "multiple of 8"]),
    ({"K": np.zeros((1, 2, 1, 32), np.float32)}, ["'Q' and 'K' must have the same head size"]),
    ({"V": np.zeros((1, 2, 2, 64), np.float32)}, ["'K' and 'V' must have the same sequence length"]),
    ({"K": np.zeros((2, 2, 1, 64), np.float32)}, ["must share the batch size"]),
    ({"past_key": np.zeros((1, 2, 3, 33), np.uint8)}, ["input 'past_key' has shape [1, 2, 3, 33]", "34 bytes", "mse4"]),
    ({"past_value": np.zeros((1, 2, 3, 33), np.uint8)}, ["input 'past_value' has shape", "36 bytes", "uint4"]),
    ({"past_key": np.zeros((1, 3, 3, 34), np.uint8)}, ["input 'past_key' has shape [1, 3, 3, 34]; expected [1, 2, S_past, 34]"]),
    ({"past_value": np.zeros((1, 2, 4, 36), np.uint8)}, ["hold 3 and 4 tokens"]),
    ({"attn_mask": np.ones((2, 4), bool)}, ["input 'attn_mask' of shape [2, 4] does not broadcast", "[1, 4, 1, 4]"]),
    ({"attn_mask": np.ones((1, 1, 1, 1, 4), bool)}, ["input 'attn_mask' has rank 5"]),
    ({"key_offset": np.zeros((2, 32), np.float32)}, ["input 'key_offset' must be float32 [2, 64]"]),
    ({"value_offset": np.zeros((64,), np.float32)}, ["input 'value_offset' must be float32 [2, 64]"]),
])
def test_bad_inputs_name_the_input(ort_session, change, fragments):
    feeds = {**good_feeds(), **change}
    with pytest.raises(ERR) as e:
        ort_session(free_model(8)).run(None, feeds)
    msg = str(e.value)
    assert "TQAttention" in msg
    for f in fragments:
        assert f in msg, msg


def test_good_feeds_pass(ort_session):
    y, pk, pv = ort_session(free_model(8)).run(None, good_feeds())
    assert y.shape == (1, 4, 1, 64) and pk.shape == (1, 2, 4, 34) and pv.shape == (1, 2, 4, 36)


def test_mask_type_must_be_bool_or_float(ort_session):
    m = free_model(4)
    m.graph.input[3].type.tensor_type.elem_type = TensorProto.INT64
    feeds = {k: v for k, v in good_feeds(sp=0).items() if k in ("Q", "K", "V")}
    with pytest.raises(ERR) as e:
        ort_session(m).run(None, {**feeds, "attn_mask": np.ones((1, 1), np.int64)})
    assert "TQAttention: input 'attn_mask' must be bool or float32/float16/bfloat16" in str(e.value)


def test_past_key_without_past_value(ort_session):
    m = free_model(5)
    feeds = {k: v for k, v in good_feeds().items() if k in ("Q", "K", "V", "attn_mask", "past_key")}
    with pytest.raises(ERR) as e:
        ort_session(m).run(None, feeds)
    assert "'past_key' and 'past_value' must be given together" in str(e.value)


def test_3d_needs_head_counts(ort_session):
    m = free_model(3)
    feeds = {"Q": np.zeros((1, 1, 256), np.float32), "K": np.zeros((1, 1, 128), np.float32), "V": np.zeros((1, 1, 128), np.float32)}
    with pytest.raises(ERR) as e:
        ort_session(m).run(None, feeds)
    assert "input 'Q' is 3-D [1, 1, 256]" in str(e.value) and "'q_num_heads' must give the head count" in str(e.value)
    m = free_model(3, q_num_heads=3, kv_num_heads=2)
    with pytest.raises(ERR) as e:
        ort_session(m).run(None, feeds)
    assert "last dimension 256, not a multiple of attribute 'q_num_heads' = 3" in str(e.value)


def test_head_count_attribute_must_match(ort_session):
    with pytest.raises(ERR) as e:
        ort_session(free_model(8, q_num_heads=8)).run(None, good_feeds())
    assert "input 'Q' has 4 heads" in str(e.value) and "'q_num_heads' is 8" in str(e.value)


@pytest.mark.parametrize("attrs, fragment", [
    ({"key_format": "mse5"}, "attribute 'key_format' is 'mse5'; expected one of mse3, mse4, fp8, uint3, uint4, raw16"),
    ({"value_format": "int4"}, "attribute 'value_format' is 'int4'"),
    ({"is_causal": 2}, "attribute 'is_causal' is 2; expected 0 or 1"),
    ({"norm_correction": -1}, "attribute 'norm_correction' is -1"),
    ({"scale": -1.0}, "attribute 'scale' is -1"),
    ({"head_dim": 100}, "attribute 'head_dim' is 100"),
    ({"q_num_heads": -2}, "must be >= 0"),
])
def test_bad_attributes(ort_session, attrs, fragment):
    with pytest.raises(Exception) as e:
        ort_session(free_model(8, **attrs))
    assert "TQAttention" in str(e.value) and fragment in str(e.value), str(e.value)


def test_causal_needs_enough_keys(ort_session):
    feeds = good_feeds(sp=0)
    feeds["Q"] = np.zeros((1, 4, 3, 64), np.float32)
    feeds = {k: v for k, v in feeds.items() if k in ("Q", "K", "V")}
    with pytest.raises(ERR) as e:
        ort_session(free_model(3, is_causal=1)).run(None, feeds)
    assert "is_causal needs at most as many queries as keys" in str(e.value)


@st.composite
def prefill_cases(draw):
    """Calls of many new tokens (prompts and continuation chunks of odd lengths, across the kernels'
    32-key tiles and 64-row tasks), over pasts of odd lengths, causal or not, with masks."""
    c = draw(cases())
    c["sq"] = draw(st.sampled_from([31, 32, 33, 47, 70]))
    c["sp"] = draw(st.sampled_from([0, 0, 1, 31, 45, 100]))
    c["hkv"] = draw(st.integers(1, 2))
    c["group"] = draw(st.sampled_from([1, 3, 4]))
    c["d"] = draw(st.sampled_from([16, 64, 80, 128]))
    return c


@settings(max_examples=min(120, MAX_EXAMPLES), deadline=None)
@given(c=prefill_cases())
def test_prefill_matches_reference(ort_session, device, c):
    check_case(ort_session, c, device=device)


@pytest.mark.parametrize("sq, sp", [(65, 0), (97, 77)])
def test_prefill_rows_see_only_their_keys(ort_session, sq, sp):
    """A prompt or chunk whose later keys are huge: a causal row that could see any key past its own
    position would be pulled far from the reference."""
    c = dict(b=1, hkv=1, group=4, sq=sq, sp=sp, d=64, kf="mse4", vf="uint4", dtype=TensorProto.FLOAT, layout="bhsd",
             mask=None, mask_shape="full", causal=True, scale=None, offsets=False, nc=True, values="wide", seed=sq)
    check_case(ort_session, c)
