"""Scores accumulated over decoded positions: perplexity, KL against the original, top-1 agreement."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities (a batch of windows times a 50k vocabulary is large in float64)."""
    x = np.asarray(logits, np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)


def mean_kl(logits_p: np.ndarray, logits_q: np.ndarray) -> float:
    """Mean KL(p || q) of the softmax distributions over the last axis."""
    lp, lq = log_softmax(logits_p), log_softmax(logits_q)
    return float((np.exp(lp) * (lp - lq)).sum(-1, dtype=np.float64).mean())


@dataclasses.dataclass
class Scores:
    """One model's negative log-likelihood over the scored tokens."""

    nll_sum: float = 0.0
    tokens: int = 0

    def add(self, logp: np.ndarray, targets: np.ndarray) -> None:
        picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
        self.nll_sum -= float(picked.sum(dtype=np.float64))
        self.tokens += int(targets.size)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens) if self.tokens else float("nan")


@dataclasses.dataclass
class Comparison:
    """A rewritten model against the original on the same positions."""

    name: str
    original: Scores
    rewritten: Scores = dataclasses.field(default_factory=Scores)
    kl_sum: float = 0.0
    top1_same: int = 0
    positions: int = 0

    def add(self, logp_ref: np.ndarray, logp: np.ndarray, targets: np.ndarray) -> None:
        self.rewritten.add(logp, targets)
        self.kl_sum += float((np.exp(logp_ref) * (logp_ref - logp)).sum(dtype=np.float64))
        self.top1_same += int((logp_ref.argmax(-1) == logp.argmax(-1)).sum())
        self.positions += int(targets.size)

    @property
    def ppl_increase(self) -> float:
        """Relative perplexity increase of the rewritten model over the original (0.027 = +2.7%)."""
        return self.rewritten.perplexity / self.original.perplexity - 1.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else float("nan")

    @property
    def top1(self) -> float:
        return self.top1_same / self.positions if self.positions else float("nan")

    def as_dict(self) -> dict:
        return {"model": self.name, "tokens": self.positions, "ppl_original": self.original.perplexity,
                "ppl": self.rewritten.perplexity, "ppl_increase": self.ppl_increase, "mean_kl": self.mean_kl,
                "top1_agreement": self.top1}
