"""Numpy reference of the packed per-vector formats (docs/design.md section 2, format version 1).

This is the oracle every kernel is tested against: the CPU kernels match it byte for byte. To make
that possible it fixes the order of every floating-point operation that decides a stored bit:
- the norm is float32: squares summed into 32 partial sums (term i into partial i % 32, in
  ascending order), which combine in a butterfly at distance 1, 2, 4, 8, 16 (sum_squares);
- the unit vector is x times the float32 reciprocal of (n + 1e-8);
- the Walsh-Hadamard transform is the standard in-place butterfly (h = 1, 2, 4, ...) in float32,
  applied to the unit vector *without* the 1/sqrt(Dp) factor, so its coordinates are compared
  directly with the unit-variance Lloyd-Max boundaries (float32);
- the norm-corrected scale is n * sqrt(Dp) / ||c_unit[idx]|| in float32, with ||c_unit[idx]||^2 an
  integer sum of the centroid squares in units of 2^-13 (exact in any order), then fp16.
"""

from __future__ import annotations

import numpy as np

from .. import codebook
from ..config import ALL_FORMATS, packed_size, padded_dim
from .numerics import F16_NAN_BITS, f16, f32_to_fp8_bits, fp8_bits_to_f32, sat_f16, to_f32

NORM_EPS = np.float32(1e-8)
SCALE_EPS = np.float32(1e-8)
NAN16 = np.array(F16_NAN_BITS, np.uint16).view(np.float16)  # a uniform vector holding a NaN: its scale and zero


# -- building blocks --------------------------------------------------------------------------

def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised Walsh-Hadamard transform (Sylvester, natural order) over the last axis."""
    x = np.array(x, dtype=np.float32, copy=True)
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return x


def sum_squares(x: np.ndarray) -> np.ndarray:
    """Float32 sums of squares over the last axis in the kernels' order (see the module doc)."""
    d = x.shape[-1]
    sq = x * x
    width = -(-d // 32) * 32
    if width != d:
        sq = np.concatenate([sq, np.zeros((*sq.shape[:-1], width - d), np.float32)], axis=-1)
    rows = sq.reshape(*sq.shape[:-1], width // 32, 32)
    part = rows[..., 0, :]
    for r in range(1, width // 32):
        part = part + rows[..., r, :]
    while part.shape[-1] > 1:  # the butterfly at distance 1, 2, ...: lane 0's sums
        part = part[..., 0::2] + part[..., 1::2]
    return part[..., 0]


CSQ_FRACTION_BITS = 13


def centroid_squares_q(bits: int) -> np.ndarray:
    """The centroid squares c_unit[k]^2 in units of 2^-13, rounded (int64)."""
    c = codebook.lloyd_max(bits)[0].astype(np.float64)
    return np.floor(c * c * float(1 << CSQ_FRACTION_BITS) + 0.5).astype(np.int64)


def pack_bits(idx: np.ndarray, bits: int) -> np.ndarray:
    """LSB-first bit stream: coordinate i in bits [bits*i, bits*i + bits). Last axis % 8 == 0."""
    idx = np.asarray(idx, dtype=np.uint32)
    n = idx.shape[-1]
    groups = idx.reshape(*idx.shape[:-1], n // 8, 8)
    word = np.zeros(groups.shape[:-1], dtype=np.uint32)
    for k in range(8):
        word |= groups[..., k] << np.uint32(bits * k)
    out = np.stack([(word >> np.uint32(8 * j)) & np.uint32(0xFF) for j in range(bits)], axis=-1)
    return out.reshape(*idx.shape[:-1], n * bits // 8).astype(np.uint8)


def unpack_bits(data: np.ndarray, bits: int, n: int) -> np.ndarray:
    data = np.asarray(data, dtype=np.uint8)
    groups = data.reshape(*data.shape[:-1], n // 8, bits).astype(np.uint32)
    word = np.zeros(groups.shape[:-1], dtype=np.uint32)
    for j in range(bits):
        word |= groups[..., j] << np.uint32(8 * j)
    mask = np.uint32((1 << bits) - 1)
    out = np.stack([(word >> np.uint32(bits * k)) & mask for k in range(8)], axis=-1)
    return out.reshape(*data.shape[:-1], n).astype(np.uint8)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _f16_from_bytes(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


# -- MSE keys ---------------------------------------------------------------------------------

def mse_indices(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codebook indices [..., Dp] and float32 norms [...] of vectors x [..., D]."""
    x = to_f32(x)
    d = x.shape[-1]
    dp = padded_dim(d)
    with np.errstate(over="ignore", invalid="ignore"):
        n = np.sqrt(sum_squares(x))
        u = x * (np.float32(1.0) / (n + NORM_EPS))[..., None]
    if dp != d:
        u = np.concatenate([u, np.zeros((*u.shape[:-1], dp - d), np.float32)], axis=-1)
    z = fwht(u)
    idx = np.searchsorted(codebook.boundaries_f32(bits), z, side="right")  # boundaries <= z
    idx = np.where(np.isnan(z), 0, idx)  # no boundary is <= a NaN (an infinite input's coordinates)
    return idx.astype(np.uint8), n


def pack_mse(x: np.ndarray, bits: int, norm_correction: bool) -> np.ndarray:
    idx, n = mse_indices(x, bits)
    dp = idx.shape[-1]
    if norm_correction:
        cq = centroid_squares_q(bits)[idx].sum(-1)
        cn2 = cq.astype(np.float32) * np.float32(2.0**-CSQ_FRACTION_BITS)  # exact: cq < 2^24
        s = (n * np.sqrt(np.float32(dp))) / np.sqrt(cn2)
    else:
        s = n
    s16 = sat_f16(np.asarray(s).astype(np.float32))
    return np.concatenate([pack_bits(idx, bits), _f16_bytes(s16)], axis=-1)


def mse_codes(packed: np.ndarray, bits: int, head_dim: int, fp16_centroids: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Unit-scale centroids [..., Dp] (float64) and scales s [...] (float32) of packed keys;
    fp16_centroids: the centroids rounded to fp16, as the CUDA tensor-core kernels score them."""
    dp = padded_dim(head_dim)
    nb = dp * bits // 8
    idx = unpack_bits(packed[..., :nb], bits, dp)
    table = codebook.lloyd_max(bits)[0]
    if fp16_centroids:
        table = table.astype(np.float16).astype(np.float64)
    return table[idx], _f16_from_bytes(packed[..., nb:nb + 2])


def unpack_mse(packed: np.ndarray, bits: int, head_dim: int, fp16_centroids: bool = False) -> np.ndarray:
    c, s = mse_codes(packed, bits, head_dim, fp16_centroids)
    dp = c.shape[-1]
    # k = s * (c_unit / sqrt(Dp)) . H / sqrt(Dp); H is symmetric, so c . H = fwht(c).
    rec = fwht(c.astype(np.float32)).astype(np.float64) * (s.astype(np.float64)[..., None] / dp)
    return rec[..., :head_dim].astype(np.float32)


# -- uniform values -----------------------------------------------------------------------------

def uint_params(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices [..., D], fp16 scale [...] and fp16 zero [...] of the uniform value format."""
    x = to_f32(x)
    levels = np.float32((1 << bits) - 1)
    # a zero minimum is stored as +0 whichever zeros the vector holds (the min of +0 and -0 is
    # either), so the bytes do not depend on the order a kernel compares in
    with np.errstate(invalid="ignore"):  # a signalling NaN (its vector's bytes are set below)
        mn, mx = x.min(-1) + np.float32(0.0), x.max(-1)
        scale16 = sat_f16(np.maximum((mx - mn) / levels, SCALE_EPS))
    zero16 = sat_f16(mn)
    sc = scale16.astype(np.float32)[..., None]
    zr = zero16.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.floor((x - zr) / sc + np.float32(0.5))
    # A scale below fp16's smallest subnormal stores as 0: the vector is constant to fp16
    # precision and reads back as the zero point, whatever q is; store q = 0.
    q = np.where(sc > 0, q, 0)
    # A vector holding a NaN: every index 0, scale and zero both NAN16, so that it
    # reads back NaN in every coordinate (a NaN in one coordinate alone has no code).
    nan = np.isnan(x).any(-1)
    q = np.where(nan[..., None], 0, q)
    scale16 = np.where(nan, NAN16, scale16)
    zero16 = np.where(nan, NAN16, zero16)
    return np.clip(q, 0, levels).astype(np.uint8), scale16, zero16


def pack_uint(x: np.ndarray, bits: int) -> np.ndarray:
    q, s16, z16 = uint_params(x, bits)
    return np.concatenate([pack_bits(q, bits), _f16_bytes(s16), _f16_bytes(z16)], axis=-1)


def unpack_uint(packed: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    nb = head_dim * bits // 8
    q = unpack_bits(packed[..., :nb], bits, head_dim).astype(np.float32)
    sc = _f16_from_bytes(packed[..., nb:nb + 2])[..., None]
    zr = _f16_from_bytes(packed[..., nb + 2:nb + 4])[..., None]
    return q * sc + zr


# -- dispatch --------------------------------------------------------------------------------

def _check(fmt: str, head_dim: int) -> None:
    if fmt not in ALL_FORMATS:
        raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(ALL_FORMATS)}")
    packed_size(fmt, head_dim)  # validates head_dim


def pack(x: np.ndarray, fmt: str, norm_correction: bool = True, offset: np.ndarray | None = None) -> np.ndarray:
    """Pack vectors x [..., D] (float32/float16/bfloat16) into uint8 [..., packed_size(fmt, D)].

    offset (float32, broadcastable to x) is subtracted first, in float32.
    """
    x = to_f32(x)
    _check(fmt, x.shape[-1])
    if offset is not None:
        x = x - np.asarray(offset, np.float32)
    if fmt in ("mse3", "mse4"):
        return pack_mse(x, int(fmt[3]), norm_correction)
    if fmt == "fp8":
        return f32_to_fp8_bits(x)
    if fmt in ("uint3", "uint4"):
        return pack_uint(x, int(fmt[4]))
    return np.ascontiguousarray(f16(x)).view(np.uint8)  # raw16 is an fp16 cast: beyond +-65504, +-inf


def unpack(packed: np.ndarray, fmt: str, head_dim: int, offset: np.ndarray | None = None,
           fp16_centroids: bool = False) -> np.ndarray:
    """Float32 vectors [..., head_dim] from packed uint8 [..., packed_size(fmt, head_dim)];
    fp16_centroids: MSE keys from centroids rounded to fp16 (mse_codes)."""
    _check(fmt, head_dim)
    packed = np.asarray(packed, np.uint8)
    want = packed_size(fmt, head_dim)
    if packed.shape[-1] != want:
        raise ValueError(f"{fmt} vectors of head_dim {head_dim} take {want} bytes, got last dim {packed.shape[-1]}")
    if fmt in ("mse3", "mse4"):
        x = unpack_mse(packed, int(fmt[3]), head_dim, fp16_centroids)
    elif fmt == "fp8":
        x = fp8_bits_to_f32(packed)
    elif fmt in ("uint3", "uint4"):
        x = unpack_uint(packed, int(fmt[4]), head_dim)
    else:
        x = np.ascontiguousarray(packed).view(np.float16).astype(np.float32)
    if offset is not None:
        x = x + np.asarray(offset, np.float32)
    return x
