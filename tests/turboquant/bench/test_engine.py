"""bench engine's runner: the figures made from requests' times, the prompts, and requests served
through a real og.Engine on the CPU (a tiny GroupQueryAttention model, which the Engine batches
statically there: PagedAttention has no CPU kernel)."""

import pytest

from turboquant.bench import engine
from turboquant.bench.engine import PointResult, RequestTimes, percentile, summarize

from .engine_folders import built


def test_percentile_is_nearest_rank():
    assert percentile([], 90) is None
    assert percentile([5.0], 90) == 5.0
    values = [float(v) for v in range(10, 0, -1)]  # 10 .. 1, unordered on purpose
    assert percentile(values, 90) == 9.0 and percentile(values, 50) == 5.0 and percentile(values, 100) == 10.0
    assert percentile([1.0, 2.0, 3.0], 90) == 3.0


def test_summarize():
    times = [RequestTimes(first=0.1, last=0.5, finished=0.5, tokens=5),
             RequestTimes(first=0.3, last=1.1, finished=1.1, tokens=5),
             RequestTimes(first=0.2, last=0.2, finished=0.2, tokens=1),
             RequestTimes(error="ENGINE_EXECUTION_FAILURE", finished=0.4)]
    r = summarize(PointResult("m", 4, 100, 5), times)
    assert r.tokens == 11 and r.failed == 1 and r.wall_s == 1.1
    assert r.tokens_per_s == pytest.approx(11 / 1.1)
    assert r.ttft_p50_ms == pytest.approx(200) and r.ttft_p90_ms == pytest.approx(300)
    assert r.tpot_ms == pytest.approx(150)  # median of 100 and 200 ms per token after the first


def test_nothing_served():
    r = summarize(PointResult("m", 2, 10, 3), [RequestTimes(), RequestTimes()])
    assert r.tokens == 0 and r.tokens_per_s is None and r.ttft_p50_ms is None and r.wall_s is None


def test_prompts_distinct_and_repeatable():
    a = engine.prompts(1000, 4, 50, seed=1)
    assert len(a) == 4 and all(p.shape == (50,) and p.dtype.name == "int32" and p.min() >= 3 and p.max() < 1000 for p in a)
    assert len({p.tobytes() for p in a}) == 4
    assert all((x == y).all() for x, y in zip(a, engine.prompts(1000, 4, 50, seed=1)))
    assert not (engine.prompts(1000, 4, 50, seed=2)[0] == a[0]).all()


@pytest.fixture(scope="module")
def static_engine(module_tmp):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder and Engine)")
    folder = built(module_tmp.mktemp("engine") / "cpu", "fp32", "cpu")
    model, eng = engine.open_engine(str(folder), "cpu", {"engine": {"static_batching": {"max_batch_size": 4}}})
    yield eng
    del eng, model


def test_requests_through_the_engine(static_engine):
    """6 requests where the Engine batches 4: all 6 get every token, at most 4 decode at once, and
    the last two start only after a first one is done."""
    engine.warm_up(static_engine, 512, 16)
    r = engine.run_point(static_engine, "tiny", 512, 6, 40, 5, fits=4)
    assert r.error is None and r.cut is None and r.failed == 0
    assert r.tokens == 30 and r.peak_decoding == 4 and r.fits == 4
    assert r.tokens_per_s > 0 and 0 < r.ttft_p50_ms <= r.ttft_p90_ms <= r.wall_s * 1e3 and r.tpot_ms > 0


def test_a_budget_cuts_the_point(static_engine):
    times, peak, blocked, cut = engine.serve(static_engine, engine.prompts(512, 6, 40, 0), 50, budget=0.0)
    assert cut is not None and "budget 0 s" in cut and "unfinished" in cut
    assert sum(t.tokens for t in times) < 6 * 50
    again = engine.run_point(static_engine, "tiny", 512, 2, 40, 3)  # the Engine serves on after a cut
    assert again.tokens == 6 and again.cut is None
