import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.eval.metrics import Comparison, Scores, log_softmax, mean_kl


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 50), st.integers(0, 2**31 - 1))
def test_scores_against_direct_formulas(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 3, (rows, 5, vocab))
    b = a + rng.normal(0, 1, a.shape)
    t = rng.integers(0, vocab, (rows, 5))
    c = Comparison("m", Scores())
    la, lb = log_softmax(a), log_softmax(b)
    c.original.add(la, t)
    c.add(la, lb, t)
    pa = np.exp(a) / np.exp(a).sum(-1, keepdims=True)
    pb = np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    ppl = lambda p: np.exp(-np.log(np.take_along_axis(p, t[..., None], -1)).mean())  # noqa: E731
    assert np.isclose(c.original.perplexity, ppl(pa), rtol=1e-4)
    assert np.isclose(c.rewritten.perplexity, ppl(pb), rtol=1e-4)
    assert np.isclose(c.ppl_increase, ppl(pb) / ppl(pa) - 1, rtol=1e-3, atol=1e-5)
    assert np.isclose(c.mean_kl, (pa * np.log(pa / pb)).sum(-1).mean(), rtol=1e-3, atol=1e-5)
    assert np.isclose(mean_kl(a, b), (pa * np.log(pa / pb)).sum(-1).mean(), rtol=1e-3, atol=1e-5)
    assert c.top1 == (a.argmax(-1) == b.argmax(-1)).mean()


def test_identical_distributions_give_zero():
    logp = log_softmax(np.random.default_rng(0).normal(0, 5, (2, 7, 300)))
    t = np.zeros((2, 7), np.int64)
    c = Comparison("same", Scores())
    c.original.add(logp, t)
    c.add(logp, logp.copy(), t)
    assert c.mean_kl == 0.0 and c.ppl_increase == 0.0 and c.top1 == 1.0
    assert mean_kl(logp, logp.copy()) == 0.0
