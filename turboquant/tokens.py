"""Token ids from a file, for calibration and evaluation: a .npy array of ids, a text file of
whitespace-separated integers (.ids), or text through a local Hugging Face tokenizer folder."""

from __future__ import annotations

import hashlib
import os
import pathlib

import numpy as np


def load_tokens(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                vocab: int | None = None) -> tuple[np.ndarray, str]:
    """Returns (int64 ids [N], a description naming the file, its hash and the tokenizer).
    Raises ValueError naming what was wrong, also for a negative id or (given the model's vocabulary
    size) one outside the vocabulary: a Gather would wrap the first and read past the table with
    the second."""
    ids, source = _read(path, tokenizer)
    if ids.size == 0:
        raise ValueError(f"{path}: holds no token ids")
    bad = ids[(ids < 0) | (ids >= vocab)] if vocab is not None else ids[ids < 0]
    if bad.size:
        within = f" (0 to {vocab - 1})" if vocab is not None else ""
        raise ValueError(f"{path}: token id {int(bad[0])} is outside the model's vocabulary{within}; "
                         f"{bad.size} of {ids.size} ids are")
    return ids, source


def _read(path, tokenizer) -> tuple[np.ndarray, str]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    if path.suffix == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, EOFError, OSError) as e:  # empty, truncated, pickled or no .npy at all
            raise ValueError(f"{path}: not a numpy array of token ids ({type(e).__name__}: {_line(e)})") from None
        if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{path}: expected integer token ids, got {getattr(ids, 'dtype', type(ids).__name__)}")
        return ids.reshape(-1).astype(np.int64), f"{path.name} (sha256 {digest})"
    if path.suffix == ".ids":
        try:
            ids = np.array([int(x) for x in data.split()], np.int64)
        except ValueError:
            raise ValueError(f"{path}: a .ids file holds whitespace-separated integers") from None
        except OverflowError:  # an id beyond int64 (any id past the vocabulary is refused by load_tokens)
            big = next(x for x in data.split() if not -2**63 <= int(x) < 2**63)
            raise ValueError(f"{path}: token id {big[:30].decode(errors='replace')} is outside the model's vocabulary") from None
        return ids, f"{path.name} (sha256 {digest})"
    if tokenizer is None:
        raise ValueError(f"{path} is text: give --tokenizer DIR (a local tokenizer folder), or token ids as .npy or .ids")
    if not pathlib.Path(tokenizer).is_dir():
        raise ValueError(f"tokenizer {tokenizer}: not a folder")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("tokenizing text needs transformers (pip install transformers)") from None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its advice on a folder it cannot read is the exception's, below
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds (OSError, ValueError, KeyError...)
        raise ValueError(f"tokenizer {tokenizer}: no tokenizer transformers can load there "
                         f"({type(e).__name__}: {_line(e)})") from None
    ids = np.asarray(tok(data.decode("utf-8", errors="replace"))["input_ids"], np.int64).reshape(-1)
    return ids, f"{path.name} (sha256 {digest}, tokenizer {pathlib.Path(tokenizer).name})"


def _line(e: BaseException) -> str:
    """An exception's first line, shortened: what a one-line refusal quotes of it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (lines[0][:200] if lines else "")
