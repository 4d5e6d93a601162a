"""Scalar conversions shared by the reference formats: saturating fp16, fp8 e4m3fn, bfloat16."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP16_MAX = 65504.0
FP8_E4M3_MAX = 448.0
# The one NaN a pack stores, whatever NaN reached it (hosts and GPUs give arithmetic NaNs other signs).
F16_NAN_BITS = 0x7E00
FP8_NAN_BITS = 0x7F

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)


def to_f32(x: np.ndarray) -> np.ndarray:
    """Any supported float input (float32, float16, bfloat16) as float32, exactly."""
    x = np.asarray(x)
    if x.dtype not in (np.float32, np.float16, bfloat16):
        raise TypeError(f"expected float32, float16 or bfloat16, got {x.dtype}")
    return x.astype(np.float32)


def sat_f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16, round to nearest even, finite values saturated to +-65504.

    The formats keep their scales and zero points finite: an inf there would turn a whole vector
    into NaNs on read.
    """
    return f16(np.clip(np.asarray(x, np.float32), -FP16_MAX, FP16_MAX))


def f16(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 as a cast does (beyond +-65504: +-inf), every NaN F16_NAN_BITS."""
    with np.errstate(over="ignore"):
        h = np.asarray(np.asarray(x, np.float32).astype(np.float16))
    return np.where(np.isnan(h), np.array(F16_NAN_BITS, np.uint16).view(np.float16), h)


def f32_to_fp8_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3fn bits, round to nearest even, saturating to +-448; every NaN FP8_NAN_BITS."""
    x = np.clip(np.asarray(x, np.float32), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return np.where(np.isnan(x), np.uint8(FP8_NAN_BITS), x.astype(float8_e4m3fn).view(np.uint8))


def fp8_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return np.asarray(b, np.uint8).view(float8_e4m3fn).astype(np.float32)


def cast_float(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> float32/float16/bfloat16 with IEEE round to nearest even."""
    return np.asarray(x, np.float32).astype(dtype)
