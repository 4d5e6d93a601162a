"""The decode-path evaluation on a tiny exported model."""

import numpy as np
import pytest

from turboquant.decoder import DecoderSession
from turboquant.eval import Evaluator, Windows
from turboquant.eval.metrics import log_softmax
from turboquant.tokens import load_tokens


def test_windows_tile_the_text():
    ids = np.arange(1000)
    w = Windows(context=100, prefill=40, max_tokens=None).cut(ids)
    assert w.shape == (16, 100) and (w[1, 0], w[-1, -1]) == (60, 999)
    scored = np.concatenate([row[40:] for row in w])
    assert (scored == np.arange(40, 1000)).all()  # every token after the first prefill, once
    assert Windows(context=100, prefill=40, max_tokens=130).cut(ids).shape == (3, 100)  # whole windows
    assert Windows(context=100, prefill=40, stride=100, max_tokens=None).cut(ids).shape == (10, 100)


@pytest.mark.parametrize("kw, match", [({"prefill": 0}, "prefill"), ({"prefill": 100}, "prefill"),
                                       ({"context": 1, "prefill": 1}, "context"), ({"stride": 0}, "stride"),
                                       ({"batch": 0}, "batch"), ({"max_tokens": 0}, "max_tokens")])
def test_windows_refuse_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        Windows(**{"context": 100, "prefill": 40, **kw}).cut(np.arange(1000))


def test_short_text_is_refused():
    with pytest.raises(ValueError, match="fewer than one window"):
        Windows(context=512, prefill=256).cut(np.arange(100))


def test_identical_models_give_zero_kl_and_equal_perplexity(tiny):
    src, _, text = tiny
    ids, _ = load_tokens(text)
    ev = Evaluator(src, ids, Windows(context=64, prefill=24, max_tokens=120, batch=2), progress=False)
    same = ev.compare(src)
    assert same.positions == ev.scored_tokens == 120
    assert same.mean_kl == 0.0 and same.top1 == 1.0
    assert same.rewritten.perplexity == ev.original.perplexity


def test_decode_path_perplexity_matches_one_full_pass(tiny):
    """For the original model the decode path and a single prefill of the whole window attend exactly,
    so their perplexities agree to float tolerance: an independent check of the windows and scoring."""
    src, _, text = tiny
    ids, _ = load_tokens(text)
    win = Windows(context=64, prefill=24, max_tokens=80, batch=2)
    ev = Evaluator(src, ids, win, progress=False)
    sess = DecoderSession(src)
    nll = []
    for row in win.cut(ids):
        logits, _ = sess.step(row[None], sess.empty_cache(1), 0)
        logp = log_softmax(logits[0, win.prefill - 1:-1])
        nll.extend(-logp[np.arange(len(logp)), row[win.prefill:]])
    assert np.isclose(ev.original.perplexity, np.exp(np.mean(nll)), rtol=1e-4)


def test_compressed_model_costs_perplexity(tiny):
    src, dst, text = tiny
    ids, _ = load_tokens(text)
    ev = Evaluator(src, ids, Windows(context=64, prefill=24, max_tokens=120, batch=3), progress=False)
    r = ev.compare(dst)
    assert r.mean_kl > 1e-4 and r.top1 < 1.0
    assert r.ppl_increase > -0.05  # noise around a small loss, never a large gain
    assert r.as_dict()["tokens"] == 120
