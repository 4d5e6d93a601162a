"""The original model's log-probabilities kept on disk, so later comparisons with it skip its run.

An entry is keyed by the original's files (path, size and modification time of the graph and its
external data), the token ids and the settings that shape the windows and the run; any change
makes a new entry. Each entry is a folder of .npy batches and a JSON file with the scores, written
under a temporary name and renamed into place, and read back memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

FORMAT = 1  # bumped when an entry's layout changes


def default_dir() -> pathlib.Path:
    """$TURBOQUANT_CACHE, else $XDG_CACHE_HOME/turboquant, else ~/.cache/turboquant; entries go in its eval/."""
    if os.environ.get("TURBOQUANT_CACHE"):
        return pathlib.Path(os.environ["TURBOQUANT_CACHE"]) / "eval"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "turboquant" / "eval"


def key(original: str | os.PathLike, ids: np.ndarray, settings: dict) -> str:
    """The entry's name: a hash of the original's files, the token ids and the settings."""
    path = pathlib.Path(original).resolve()
    files = [path] + [p for p in sorted(path.parent.glob(path.name + ".data*")) if p.is_file()]
    stats = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    h = hashlib.sha256(json.dumps({"format": FORMAT, "files": stats, "settings": settings}, sort_keys=True).encode())
    h.update(np.ascontiguousarray(ids, np.int64).tobytes())
    return h.hexdigest()[:32]


def load(folder: pathlib.Path) -> tuple[dict, list[np.ndarray]] | None:
    """(scores, log-prob batches) of an entry, or None when there is none (or it is unreadable)."""
    try:
        meta = json.loads((folder / "scores.json").read_text())
        batches = [np.load(folder / f"batch{i}.npy", mmap_mode="r") for i in range(meta["batches"])]
    except (OSError, ValueError, KeyError):
        return None
    return meta, batches


def store(folder: pathlib.Path, scores: dict, batches: list[np.ndarray]) -> None:
    """Writes an entry atomically; an entry that appeared meanwhile (another run) is kept."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    try:
        for i, b in enumerate(batches):
            np.save(tmp / f"batch{i}.npy", b)
        (tmp / "scores.json").write_text(json.dumps({**scores, "batches": len(batches)}))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
