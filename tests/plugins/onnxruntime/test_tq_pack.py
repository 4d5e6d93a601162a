"""TQPack / TQUnpack in ONNX Runtime (CPU) against the numpy reference."""

import os

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from turboquant import node_models
from turboquant.ort import run
from turboquant.config import ALL_FORMATS, packed_size
from turboquant.reference import formats
from turboquant.reference.numerics import bfloat16

# TQ_MAX_EXAMPLES caps hypothesis's examples per test: the op tests under compute-sanitizer
# (scripts/gpu_session.sh check) run all of them, each on fewer cases.
MAX_EXAMPLES = int(os.environ.get("TQ_MAX_EXAMPLES", "1000"))

DTYPES = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16), TensorProto.BFLOAT16: bfloat16}
HEAD_DIMS = [16, 64, 80, 96, 128, 256]


@st.composite
def vectors(draw, d=None):
    """Float vectors [lead..., D] with NaN-free extremes: constant rows, zeros, huge and tiny scales."""
    d = d or draw(st.sampled_from(HEAD_DIMS))
    lead = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(list(DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["normal", "constant", "zeros", "huge", "tiny", "offset"]))
    rng = np.random.default_rng(seed)
    shape = (*lead, d)
    if kind == "normal":
        x = rng.standard_normal(shape) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    elif kind == "constant":
        x = np.broadcast_to(rng.standard_normal((*lead, 1)) * 10, shape)
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "huge":
        x = rng.standard_normal(shape) * (6e4 if dtype == TensorProto.FLOAT16 else 1e20)
    elif kind == "tiny":
        x = rng.standard_normal(shape) * 1e-6
    else:
        x = rng.standard_normal(shape) + 100.0
    x = x.astype(np.float32)
    if dtype == TensorProto.FLOAT16:
        x = np.clip(x, -65504, 65504)
    return dtype, x.astype(DTYPES[dtype])


@settings(max_examples=min(150, MAX_EXAMPLES), deadline=None)
@given(data=vectors(), fmt=st.sampled_from(ALL_FORMATS), nc=st.booleans())
def test_pack_matches_reference_byte_for_byte(ort_session, device, data, fmt, nc):
    dtype, x = data
    d = x.shape[-1]
    sess = ort_session(node_models.pack_model(fmt, d, dtype, rank=x.ndim, norm_correction=int(nc)), device=device)
    got = run(sess, {"x": x})[0]
    want = formats.pack(x, fmt, nc)
    assert got.shape == (*x.shape[:-1], packed_size(fmt, d))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["mse4", "uint3", "fp8"])
def test_pack_many_vectors(ort_session, device, rng, fmt):
    """More vectors than the CUDA kernel's blocks cover in one pass (132 SMs x 32 blocks x 32 vectors
    on an H200), so its blocks stride over them; special rows among them: zeros, +-0 extremes, infinities."""
    x = rng.standard_normal((2, 70001, 128)).astype(np.float16)
    x[0, 5] = 0.0
    x[0, 6] = np.abs(x[0, 6]) + 0.125
    x[0, 6, [3, 40]] = [-0.0, 0.0]
    x[1, 7] = -np.abs(x[1, 7]) - 0.125
    x[1, 7, [9, 100]] = [0.0, -0.0]
    x[1, -1, 17] = np.inf
    sess = ort_session(node_models.pack_model(fmt, 128, TensorProto.FLOAT16, rank=3), device=device)
    np.testing.assert_array_equal(run(sess, {"x": x})[0], formats.pack(x, fmt, True))


@pytest.mark.parametrize("fmt", ["uint3", "uint4"])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("d", [16, 128])
def test_nan_packs_as_a_nan_vector(ort_session, device, fmt, dtype, d):
    """A vector with a NaN anywhere (first, inside, last; either sign) packs as the reference's NaN
    vector (indices 0, scale and zero fp16 NaN) and reads back NaN everywhere; its neighbours do not
    change."""
    x = np.tile(np.arange(d, dtype=np.float32), (3, 6, 1))
    for row, (where, sign) in enumerate([(0, 1), (3, 1), (d - 1, 1), (3, -1), (1, -1)]):
        x[1, row, where] = sign * np.nan
    x = x.astype(DTYPES[dtype])
    got = run(ort_session(node_models.pack_model(fmt, d, dtype, rank=3), device=device), {"x": x})[0]
    want = formats.pack(x, fmt)
    np.testing.assert_array_equal(got, want)
    nb = d * int(fmt[4]) // 8
    assert (got[1, :5, :nb] == 0).all() and (got[1, :5, nb:] == [0x00, 0x7E, 0x00, 0x7E]).all()
    back = run(ort_session(node_models.unpack_model(fmt, d, rank=3), device=device), {"packed": got})[0]
    assert np.isnan(back[1, :5]).all() and np.isfinite(back[1, 5]).all() and np.isfinite(back[[0, 2]]).all()


@settings(max_examples=min(100, MAX_EXAMPLES), deadline=None)
@given(data=vectors(), fmt=st.sampled_from(ALL_FORMATS))
def test_unpack_matches_reference(ort_session, device, data, fmt):
    dtype, x = data
    d = x.shape[-1]
    packed = formats.pack(x, fmt)
    got = run(ort_session(node_models.unpack_model(fmt, d, dtype, rank=x.ndim), device=device), {"packed": packed})[0]
    with np.errstate(over="ignore"):  # extreme codes read back past fp16's range: inf, as the op's rounding gives
        want = formats.unpack(packed, fmt, d).astype(DTYPES[dtype])
    assert got.dtype == DTYPES[dtype]
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-6, atol=0)


@pytest.mark.parametrize("offset_shape", [[64], [3, 64]])
def test_offsets(ort_session, device, rng, offset_shape):
    x = rng.standard_normal((2, 3, 5, 64)).astype(np.float32) + 4.0
    off = rng.standard_normal(offset_shape).astype(np.float32) + 4.0
    ref_off = off if off.ndim == 1 else off[:, None, :]
    packed = ort_session(node_models.pack_model("mse4", 64, offset_shape=offset_shape), device=device).run(None, {"x": x, "offset": off})[0]
    np.testing.assert_array_equal(packed, formats.pack(x, "mse4", True, ref_off))
    back = ort_session(node_models.unpack_model("mse4", 64, offset_shape=offset_shape), device=device).run(None, {"packed": packed, "offset": off})[0]
    np.testing.assert_allclose(back, formats.unpack(packed, "mse4", 64, ref_off), rtol=1e-6)


def test_zero_offset_changes_nothing(ort_session, rng):
    x = rng.standard_normal((1, 2, 7, 128)).astype(np.float16)
    sess = ort_session(node_models.pack_model("mse3", 128, TensorProto.FLOAT16, offset_shape=[2, 128]))
    plain = ort_session(node_models.pack_model("mse3", 128, TensorProto.FLOAT16)).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x, "offset": np.zeros((2, 128), np.float32)})[0], plain)


# -- errors -----------------------------------------------------------------------------------------

def run_expecting(ort_session, model, feeds, *fragments):
    with pytest.raises((ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.Fail)) as e:
        ort_session(model).run(None, feeds)
    for f in fragments:
        assert f in str(e.value), str(e.value)


def test_pack_errors(ort_session):
    free = node_models.node_model("TQPack", [("x", TensorProto.FLOAT, None)], [("packed", TensorProto.UINT8, None)], format="uint4")
    run_expecting(ort_session, free, {"x": np.zeros((2, 12), np.float32)}, "TQPack", "'x'", "last dimension 12", "multiple of 8")
    run_expecting(ort_session, free, {"x": np.zeros((), np.float32)}, "TQPack", "'x'", "rank >= 1")
    fixed = node_models.node_model("TQPack", [("x", TensorProto.FLOAT, None)], [("packed", TensorProto.UINT8, None)], format="uint4", head_dim=64)
    run_expecting(ort_session, fixed, {"x": np.zeros((2, 128), np.float32)}, "TQPack", "last dimension 128", "'head_dim' is 64")
    with_off = node_models.node_model("TQPack", [("x", TensorProto.FLOAT, None), ("offset", TensorProto.FLOAT, None)],
                                 [("packed", TensorProto.UINT8, None)], format="uint4")
    run_expecting(ort_session, with_off, {"x": np.zeros((1, 2, 3, 64), np.float32), "offset": np.zeros((3, 64), np.float32)},
                  "TQPack", "'offset'", "[3, 64]")


def test_unpack_errors(ort_session):
    m = node_models.node_model("TQUnpack", [("packed", TensorProto.UINT8, None)], [("x", TensorProto.FLOAT, None)], format="mse4", head_dim=64)
    run_expecting(ort_session, m, {"packed": np.zeros((2, 33), np.uint8)}, "TQUnpack", "'packed'", "must be 34", "mse4")


@pytest.mark.parametrize("attrs, fragment", [
    ({"format": "int4"}, "attribute 'format' is 'int4'; expected one of mse3, mse4, fp8, uint3, uint4, raw16"),
    ({"format": "mse4", "norm_correction": 2}, "attribute 'norm_correction' is 2"),
    ({"format": "mse4", "head_dim": 100}, "attribute 'head_dim' is 100"),
])
def test_bad_attributes_fail_at_session_creation(ort_session, attrs, fragment):
    m = node_models.node_model("TQPack", [("x", TensorProto.FLOAT, None)], [("packed", TensorProto.UINT8, None)], **attrs)
    with pytest.raises(Exception) as e:
        ort_session(m)
    assert "TQPack" in str(e.value) and fragment in str(e.value)


def test_unpack_dtype_attribute_must_match_output(ort_session):
    m = node_models.node_model("TQUnpack", [("packed", TensorProto.UINT8, None)], [("x", TensorProto.FLOAT16, None)],
                          format="uint4", head_dim=64, dtype=TensorProto.FLOAT)
    # ORT's own type check catches it, from the type our shape inference gives the output
    with pytest.raises(Exception) as e:
        ort_session(m)
    assert "output arg (x)" in str(e.value) and "tensor(float16)" in str(e.value) and "tensor(float)" in str(e.value)


def test_unpack_unknown_dtype(ort_session):
    m = node_models.node_model("TQUnpack", [("packed", TensorProto.UINT8, None)], [("x", TensorProto.FLOAT, None)],
                          format="uint4", head_dim=64, dtype=TensorProto.INT32)
    with pytest.raises(Exception) as e:
        ort_session(m)
    assert "TQUnpack" in str(e.value) and "attribute 'dtype' is 6" in str(e.value)
