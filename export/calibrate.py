"""Calibrated offsets: the mean post-RoPE key (and value) of each layer and KV head.

Attention is unchanged when one vector is subtracted from every key of a head (each query's scores
move by one constant, which softmax removes), and LLM keys carry large fixed per-channel components
that waste the codebook. The original model is run in ONNX Runtime on a few windows of calibration
tokens, from an empty cache; its present.N.key / present.N.value outputs are exactly the keys and
values each layer writes to its cache (after RoPE), and their means over tokens become the
TQAttention key_offset / value_offset inputs of the rewritten layers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib

import numpy as np

from .errors import RewriteError


@dataclasses.dataclass
class Calibration:
    keys: dict[int, np.ndarray]  # layer -> float32 [Hkv, D]
    values: dict[int, np.ndarray]
    tokens: int
    source: str


def load_tokens(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> tuple[np.ndarray, str]:
    """Token ids from a .npy file, or from a text file through a local Hugging Face tokenizer."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise RewriteError(f"calibration file {path}: no such file")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    if path.suffix == ".npy":
        ids = np.load(path)
        if not np.issubdtype(ids.dtype, np.integer):
            raise RewriteError(f"calibration file {path}: expected integer token ids, got {ids.dtype}")
        return ids.reshape(-1).astype(np.int64), f"{path.name} (sha256 {digest})"
    if tokenizer is None:
        raise RewriteError(f"calibration file {path} is text: give --tokenizer DIR (a local tokenizer folder) or token ids as .npy")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RewriteError("calibrating on text needs transformers (pip install transformers)") from None
    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    ids = tok(path.read_text(errors="replace"), return_tensors="np")["input_ids"].reshape(-1)
    return ids.astype(np.int64), f"{path.name} (sha256 {digest}, tokenizer {pathlib.Path(tokenizer).name})"


def collect(model_path: str | os.PathLike, ids: np.ndarray, layers: list[int], source: str, *, window: int = 256,
            max_windows: int = 16, progress: bool = True) -> Calibration:
    """Mean key and value per layer and KV head over up to max_windows windows of `window` tokens."""
    from tqdm import tqdm

    from turboquant.decoder import DecoderSession

    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size < 2:
        raise RewriteError("calibration needs at least 2 tokens")
    window = min(window, ids.size)
    starts = list(range(0, ids.size - window + 1, window))[:max_windows]
    sess = DecoderSession(model_path)
    sums_k: dict[int, np.ndarray] = {}
    sums_v: dict[int, np.ndarray] = {}
    count = 0
    for s in tqdm(starts, desc="calibrating", unit="window", disable=not progress):
        _, cache = sess.step(ids[None, s:s + window], sess.empty_cache(1), 0)
        for layer in layers:
            k = np.asarray(cache[sess.cache_inputs[(layer, "key")].name], np.float64)
            v = np.asarray(cache[sess.cache_inputs[(layer, "value")].name], np.float64)
            sums_k[layer] = sums_k.get(layer, 0.0) + k.sum(axis=(0, 2))
            sums_v[layer] = sums_v.get(layer, 0.0) + v.sum(axis=(0, 2))
        count += window
    return Calibration({i: (sums_k[i] / count).astype(np.float32) for i in layers},
                       {i: (sums_v[i] / count).astype(np.float32) for i in layers}, count, source)
