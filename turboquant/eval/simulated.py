"""Other KV-cache formats simulated on an original model, for `turboquant eval --simulate`: after every
step the cache rows it wrote are quantized and dequantized in place, so every later token attends to
the format's values, as it would in a cache stored that way.

The formats are onnxruntime-genai's builder's per-token schemes for PagedAttention
(kv_cache_quant_scheme=int8_per_token / int4_per_token, optionally kv_cache_rotation=hadamard), whose
models load only in an ONNX Runtime whose PagedAttention takes per-token scale blocks and run only on
CUDA through og.Engine, which gives no logits: their quality cannot be measured through them. The
simulation assumes the usual form of such a cache, stated here since the kernel is not read: each
token's key and value vector of each head (after the rotary embedding) rotated by the orthonormal
Hadamard matrix where asked (undone on reading: attention scores and outputs are unchanged by it),
then scaled by its largest magnitude over qmax (an fp16 scale per token and head), rounded to the
nearest integer in [-qmax - 1, qmax] (qmax 7 for int4, 127 for int8). The tokens of a step attend to
each other unquantized, as a fused kernel that quantizes on writing does.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

SCHEMES = {  # name -> (bits, Hadamard rotation)
    "int8_per_token": (8, False),
    "int8_per_token_hadamard": (8, True),
    "int4_per_token": (4, False),
    "int4_per_token_hadamard": (4, True),
}


def words(scheme: str) -> str:
    bits, rotate = SCHEMES[scheme]
    return f"int{bits} per token{' + Hadamard' if rotate else ''} (simulated)"


@functools.lru_cache(maxsize=8)
def hadamard(d: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order d (a power of two): symmetric, its own inverse."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head size, not {d}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(d))


def fake_quantize(x: np.ndarray, scheme: str) -> np.ndarray:
    """x [..., head_size] through the format and back, in float32."""
    bits, rotate = SCHEMES[scheme]
    qmax = 2 ** (bits - 1) - 1
    v = np.asarray(x, np.float32)
    if rotate:
        v = v @ hadamard(v.shape[-1])
    scale = (np.abs(v).max(-1, keepdims=True) / qmax).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(v / np.where(scale > 0, scale, 1)), -qmax - 1, qmax)
    out = q * scale
    return out @ hadamard(v.shape[-1]) if rotate else out


def _writable(value) -> tuple[np.ndarray, object]:
    """(an array over the cache tensor's values, what to do after writing it): numpy arrays and CPU
    OrtValues in place, device OrtValues through a host copy."""
    if isinstance(value, np.ndarray):
        return value, None
    host = value.numpy()  # a copy
    if value.device_name().lower() == "cpu":  # a view of the tensor's own memory instead
        buf = (ctypes.c_byte * host.nbytes).from_address(value.data_ptr())
        return np.frombuffer(buf, host.dtype).reshape(host.shape), None
    return host, lambda: value.update_inplace(host)


class SimulatedCache:
    """A decode loop (DecoderSession or SharedBufferDecoder) whose caches, [B, heads, rows, head_size]
    each, hold `scheme`'s values: the rows each step writes are quantized and dequantized after it."""

    def __init__(self, loop, scheme: str):
        if scheme not in SCHEMES:
            raise ValueError(f"unknown cache format {scheme!r}; one of {', '.join(SCHEMES)}")
        self.loop, self.scheme = loop, scheme

    def empty_cache(self, batch: int = 1) -> dict:
        return self.loop.empty_cache(batch)

    def step(self, input_ids: np.ndarray, cache: dict, past_len: int, *args, **kwargs):
        logits, cache = self.loop.step(input_ids, cache, past_len, *args, **kwargs)
        rows = slice(past_len, past_len + input_ids.shape[1])
        for value in cache.values():
            array, done = _writable(value)
            if array.dtype.kind != "f":
                raise ValueError(f"--simulate needs a float cache, not {array.dtype} (give the original model)")
            array[:, :, rows] = fake_quantize(array[:, :, rows], self.scheme).astype(array.dtype)
            if done is not None:
                done()
        return logits, cache

    def teacher_forced(self, ids: np.ndarray, prefill: int, progress=None) -> np.ndarray:
        from ..decoder import DecoderSession

        return DecoderSession.teacher_forced(self, ids, prefill, progress)
