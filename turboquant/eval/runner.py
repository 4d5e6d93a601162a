"""Windows of the text and the decode loop that scores models on them."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from collections.abc import Sequence

import numpy as np

from .metrics import Comparison, Scores, log_softmax


@dataclasses.dataclass(frozen=True)
class Windows:
    """Windows of `context` tokens starting every `stride` tokens; each prefills `prefill` tokens and
    decodes (and scores) the rest. With the default stride (context - prefill) the scored spans tile
    the text. Scoring stops once `max_tokens` tokens are scored, rounded up to whole windows (at
    least one window)."""

    context: int = 512
    prefill: int = 256
    stride: int | None = None
    max_tokens: int | None = 2048
    batch: int = 8

    def check(self) -> None:
        if self.context < 2:
            raise ValueError(f"context must be at least 2 tokens, got {self.context}")
        if not 1 <= self.prefill < self.context:
            raise ValueError(f"prefill must be between 1 and context - 1 = {self.context - 1}, got {self.prefill}")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"stride must be positive, got {self.stride}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.batch < 1:
            raise ValueError(f"batch must be positive, got {self.batch}")

    def cut(self, ids: np.ndarray) -> np.ndarray:
        """[windows, context] token ids."""
        self.check()
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size < self.context:
            raise ValueError(f"the text has {ids.size} tokens, fewer than one window of context {self.context}; "
                             "give more text or a smaller --context")
        stride = self.stride or (self.context - self.prefill)
        starts = range(0, ids.size - self.context + 1, stride)
        per_window = self.context - self.prefill
        n = len(starts) if self.max_tokens is None else max(1, min(len(starts), -(-self.max_tokens // per_window)))
        return np.stack([ids[s:s + self.context] for s in starts[:n]])


class Evaluator:
    """Runs the original once on the windows, then compares any number of models with it."""

    def __init__(self, original: str | os.PathLike, ids: np.ndarray, windows: Windows = Windows(), *,
                 providers: Sequence = ("CPUExecutionProvider",), threads: int | None = None, progress: bool = True,
                 shared_buffer: bool = False, cache_dir: str | os.PathLike | None = None):
        """shared_buffer: run every model as onnxruntime-genai does, one buffer of `context` rows per
        cache tensor bound as past and present (turboquant.shared_buffer), the original too; without
        it each model takes the loop its caches need (turboquant.decode_loop.open_decoder).
        cache_dir: where the original's log-probabilities are kept (turboquant.eval.cache) and looked
        up, so a later Evaluator on the same original, tokens and settings skips its run; None: no cache.
        `cached` says whether they came from there."""
        from . import cache

        self.windows = windows
        self.shared_buffer = shared_buffer
        cut = windows.cut(ids)
        self.batches = np.array_split(cut, -(-len(cut) // windows.batch))
        self.providers = providers
        self.threads = threads
        self.progress = progress
        self.original = Scores()
        self._ref: list[np.ndarray] = []
        self.cached = False
        self.cache_entry = None
        if cache_dir is not None:
            settings = {"windows": dataclasses.asdict(windows), "providers": [str(x) for x in providers],
                        "shared_buffer": shared_buffer}
            self.cache_entry = pathlib.Path(cache_dir) / cache.key(original, cut, settings)
            found = cache.load(self.cache_entry)
            if found is not None:
                meta, self._ref = found
                self.original = Scores(meta["nll_sum"], meta["tokens"])
                self.cached = True
                return
        for batch, logp in self._run(original, "original"):
            self.original.add(logp, batch[:, self.windows.prefill:])
            self._ref.append(logp)
        if self.cache_entry is not None:
            try:
                cache.store(self.cache_entry, {"nll_sum": self.original.nll_sum, "tokens": self.original.tokens}, self._ref)
            except OSError as e:  # the cache only spares a later run; this one goes on without it
                print(f"warning: the original's logits not kept in {self.cache_entry.parent}: {e.strerror or e}", file=sys.stderr)
                self.cache_entry = None

    @property
    def scored_tokens(self) -> int:
        return self.original.tokens

    def compare(self, model: str | os.PathLike, name: str | None = None, simulate: str | None = None) -> Comparison:
        """simulate: run `model` with its caches held in that format (turboquant.eval.simulated.SCHEMES)."""
        result = Comparison(name or os.fspath(model), self.original)
        for (batch, logp), ref in zip(self._run(model, name or os.path.basename(model), simulate), self._ref):
            result.add(ref, logp, batch[:, self.windows.prefill:])
        return result

    def _run(self, model, label: str, simulate: str | None = None):
        """Yields (window ids [B, context], log-probs [B, context - prefill, V]) per batch."""
        from tqdm import tqdm

        from turboquant.decode_loop import open_decoder

        if self.shared_buffer:
            from turboquant.shared_buffer import SharedBufferDecoder

            sess = SharedBufferDecoder(model, self.windows.context, providers=self.providers, threads=self.threads)
        else:  # the loop each model's caches take
            sess = open_decoder(model, self.windows.context, providers=self.providers, threads=self.threads)
        if simulate is not None:
            from .simulated import SimulatedCache

            sess = SimulatedCache(sess, simulate)
        steps = sum(len(b) for b in self.batches) * (self.windows.context - self.windows.prefill)
        with tqdm(total=steps, desc=label[:40], unit="tok", disable=not self.progress, leave=False) as bar:
            for batch in self.batches:
                logits = sess.teacher_forced(batch, self.windows.prefill, progress=lambda: bar.update(len(batch)))
                yield batch, log_softmax(logits[:, :-1])
