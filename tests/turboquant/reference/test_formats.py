"""The numpy reference of the formats: golden bytes pin the layout, round trips bound the error."""

import numpy as np
import pytest

from turboquant import codebook
from turboquant.config import ALL_FORMATS, packed_size
from turboquant.reference import formats
from turboquant.reference.numerics import bfloat16


def hexbytes(a):
    return bytes(np.asarray(a, np.uint8).ravel()).hex(" ")


def test_uint4_golden():
    # 0..15: min 0, max 15, scale 1 -> q = i; even coordinate in the low nibble; fp16 1.0 = 0x3c00.
    v = np.arange(16, dtype=np.float32)
    assert hexbytes(formats.pack(v, "uint4")) == "10 32 54 76 98 ba dc fe 00 3c 00 00"


def test_uint3_golden():
    # 0..7 twice: scale 1, codes 0..7 fill 24 bits LSB first: sum k << 3k = 0xfac688.
    v = np.tile(np.arange(8, dtype=np.float32), 2)
    assert hexbytes(formats.pack(v, "uint3")) == "88 c6 fa 88 c6 fa 00 3c 00 00"


def test_uint_offset_and_zero_point():
    v = np.full(16, -2.0, np.float32)
    v[3] = 13.0  # min -2, max 13 -> scale 1, zero -2 (fp16 0xc000)
    packed = formats.pack(v, "uint4")
    assert hexbytes(packed[-4:]) == "00 3c 00 c0"
    np.testing.assert_array_equal(formats.unpack(packed, "uint4", 16), v)


def test_fp8_golden():
    # 1.0 = 0x38, -2.0 = 0xc0, 448 and beyond saturate to 0x7e, 2^-9 (smallest subnormal) = 0x01,
    # 1.75 = 0x3e, 0.0 = 0x00, 1.0625 ties to even (1.0) = 0x38, 1.1875 ties to even (1.25) = 0x3a.
    v = np.array([1.0, -2.0, 448.0, 1000.0, 2.0**-9, 1.75, 0.0, 1.0625, 1.1875, -1e9, 0, 0, 0, 0, 0, 0], np.float32)
    assert hexbytes(formats.pack(v, "fp8")[:10]) == "38 c0 7e 7e 01 3e 00 38 3a fe"


def test_mse4_golden():
    # e0 rotates to all-ones (row 0 of H); 1.0 lies between boundaries 10 (0.80) and 11 (1.10), so
    # every index is 11 = 0xb; s = n = 1.0 without norm correction.
    v = np.zeros(16, np.float32)
    v[0] = 1.0
    assert hexbytes(formats.pack(v, "mse4", norm_correction=False)) == " ".join(["bb"] * 8 + ["00", "3c"])
    # with norm correction s = n * sqrt(Dp) / ||c_unit[idx]|| = 4 / (4 * c[11])
    s = np.float16(np.float32(1.0 / codebook.lloyd_max(4)[0][11]))
    packed = formats.pack(v, "mse4", norm_correction=True)
    assert packed[-2:].view(np.float16)[0] == s


def test_mse3_golden():
    # -3 e0 rotates to -1 everywhere (unit vector); -1 lies between boundaries 1 (-1.05) and 2 (-0.50):
    # index 2 everywhere, 3-bit word 0o22222222 = 0x492492; s = 3.0 = 0x4200.
    v = np.zeros(16, np.float32)
    v[0] = -3.0
    assert hexbytes(formats.pack(v, "mse3", norm_correction=False)) == "92 24 49 92 24 49 00 42"


def test_raw16_is_fp16_bits():
    v = np.array([1.0, -2.5, 65504.0, 1e-8] + [0.0] * 12, np.float32)
    assert np.array_equal(formats.pack(v, "raw16"), v.astype(np.float16).view(np.uint8))


def test_ties_go_up():
    # a coordinate exactly on a boundary takes the upper cell
    b = codebook.boundaries_f32(4)
    assert np.searchsorted(b, b[7], side="right") == 8


def test_bits_roundtrip(rng):
    for bits in (3, 4):
        idx = rng.integers(0, 2**bits, size=(5, 64), dtype=np.uint8)
        packed = formats.pack_bits(idx, bits)
        assert packed.shape == (5, 64 * bits // 8)
        np.testing.assert_array_equal(formats.unpack_bits(packed, bits, 64), idx)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("d", [16, 64, 80, 96, 128, 256])
def test_sizes_and_roundtrip_error(fmt, d, rng):
    x = rng.standard_normal((64, d)).astype(np.float32)
    packed = formats.pack(x, fmt)
    assert packed.dtype == np.uint8 and packed.shape == (64, packed_size(fmt, d))
    rec = formats.unpack(packed, fmt, d)
    rel = np.linalg.norm(rec - x, axis=-1) / np.linalg.norm(x, axis=-1)
    bound = {"mse3": 0.25, "mse4": 0.14, "fp8": 0.05, "uint3": 0.3, "uint4": 0.15, "raw16": 1e-3}[fmt]
    assert rel.mean() < bound


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_constant_and_zero_vectors_stay_finite(fmt):
    for value in (0.0, 3.0, -1e-9, 1e4):
        x = np.full((2, 64), value, np.float32)
        rec = formats.unpack(formats.pack(x, fmt), fmt, 64)
        assert np.all(np.isfinite(rec))
        if fmt in ("uint3", "uint4", "raw16"):
            np.testing.assert_allclose(rec, np.float16(value).astype(np.float32), rtol=1e-3)


NAN_BITS = {"plain": 0x7FC00000, "negative": 0xFFC00000, "payload": 0x7F800123}


@pytest.mark.parametrize("fmt", ["uint3", "uint4"])
@pytest.mark.parametrize("where", [0, 3, 63])
@pytest.mark.parametrize("nan", list(NAN_BITS))
def test_a_uniform_vector_with_a_nan_packs_as_nan(fmt, where, nan):
    """Any NaN (of any sign or payload) makes the whole vector NaN: every index 0, fp16 scale and
    zero both 0x7e00; the other vectors are packed as without it."""
    x = np.tile(np.arange(64, dtype=np.float32), (3, 1))
    x[1, where] = np.array(NAN_BITS[nan], np.uint32).view(np.float32)
    packed = formats.pack(x, fmt)
    nb = 64 * int(fmt[4]) // 8
    assert hexbytes(packed[1]) == hexbytes(np.r_[np.zeros(nb, np.uint8), 0x00, 0x7E, 0x00, 0x7E])
    np.testing.assert_array_equal(packed[[0, 2]], formats.pack(x[[0, 2]], fmt))
    back = formats.unpack(packed, fmt, 64)
    assert np.isnan(back[1]).all() and np.isfinite(back[[0, 2]]).all()


def test_large_magnitudes_saturate_scales():
    x = np.full((1, 64), 1e6, np.float32)
    x[0, 0] = -1e6
    for fmt in ("mse4", "uint4", "fp8"):
        assert np.all(np.isfinite(formats.unpack(formats.pack(x, fmt), fmt, 64)))


def test_offset_is_subtracted_and_added_back(rng):
    x = rng.standard_normal((3, 4, 64)).astype(np.float32) + 5.0
    off = np.full(64, 5.0, np.float32)
    packed = formats.pack(x, "uint4", offset=off)
    np.testing.assert_array_equal(packed, formats.pack(x - off, "uint4"))
    np.testing.assert_allclose(formats.unpack(packed, "uint4", 64, offset=off), x, atol=0.2)


def test_input_dtypes_are_read_exactly(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for dt in (np.float16, bfloat16):
        xd = x.astype(dt)
        np.testing.assert_array_equal(formats.pack(xd, "mse4"), formats.pack(xd.astype(np.float32), "mse4"))


def test_errors():
    with pytest.raises(ValueError, match="unknown format"):
        formats.pack(np.zeros((1, 64), np.float32), "int4")
    with pytest.raises(ValueError, match="multiples of 8"):
        formats.pack(np.zeros((1, 60), np.float32), "uint4")
    with pytest.raises(ValueError, match="take 34 bytes"):
        formats.unpack(np.zeros((1, 33), np.uint8), "mse4", 64)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        formats.pack(np.zeros((1, 64), np.int32), "uint4")
