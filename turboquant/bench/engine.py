"""Serving through onnxruntime-genai's continuous-batching Engine (og.Engine): C requests of S random
prompt tokens submitted at once, each generating N tokens greedily, the Engine stepped until all are
done; per request the time of its first token, of its last and how many it got.

From those: output tokens/s (all requests' generated tokens over the time from submission to the
last one), time to first token (median and p90: a request's wait in the queue, its prefill and its
first token, as a user of a server sees it), time per output token after the first (median), and the
most requests that were decoding at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time

import numpy as np

WARMUP_NEW = 2  # tokens each warm-up request generates


@dataclasses.dataclass
class RequestTimes:
    """One request's events, in seconds from the submission of the point's requests."""

    first: float | None = None  # its first token
    last: float | None = None  # its latest token
    finished: float | None = None  # its turn finished
    tokens: int = 0
    error: str | None = None
    ids: list[int] = dataclasses.field(default_factory=list)  # the tokens it generated, in order


@dataclasses.dataclass
class PointResult:
    model: str
    concurrency: int
    context: int
    new: int
    wall_s: float | None = None  # submission to the last request's end
    tokens: int = 0
    tokens_per_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    tpot_ms: float | None = None  # median over requests of (last - first) / (tokens - 1)
    peak_decoding: int = 0  # most requests that had their first token and were not done, after any Engine.run
    capacity_blocked: int = 0  # events with CAPACITY_BLOCKED: a request waited for blocks
    fits: int | None = None  # requests of this length the pool holds (engine_pool.PoolLayout.fits)
    failed: int = 0  # requests that ended with FAILED
    cut: str | None = None  # why the point stopped before every request was done
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (q in (0, 100]): the smallest value with at least q% of the
    values at or below it (p90 of 10 values is the 9th smallest)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def summarize(result: PointResult, times: list[RequestTimes]) -> PointResult:
    """Fills result's figures from the requests' times (seconds)."""
    ends = [t.finished if t.finished is not None else t.last for t in times]
    ends = [e for e in ends if e is not None]
    result.tokens = sum(t.tokens for t in times)
    result.failed = sum(t.error is not None for t in times)
    if ends:
        result.wall_s = max(ends)
        result.tokens_per_s = result.tokens / result.wall_s if result.wall_s > 0 else None
    firsts = [t.first * 1e3 for t in times if t.first is not None]
    result.ttft_p50_ms = statistics.median(firsts) if firsts else None
    result.ttft_p90_ms = percentile(firsts, 90)
    tpots = [(t.last - t.first) * 1e3 / (t.tokens - 1) for t in times if t.tokens > 1]
    result.tpot_ms = statistics.median(tpots) if tpots else None
    return result


def prompts(vocab: int, concurrency: int, context: int, seed: int) -> list[np.ndarray]:
    """Each request's prompt: distinct random ids (3.. skips the special tokens), the same for every
    model at the same point and seed."""
    rng = np.random.default_rng([seed, concurrency, context])
    return [rng.integers(3, max(vocab, 4), context, dtype=np.int32) for _ in range(concurrency)]


def open_engine(folder: str, device: str, overlay: dict | None = None):
    """(og.Model, og.Engine) for a genai folder, genai_config overlaid with `overlay` (e.g. the pool's
    block count and the batch limit under engine.dynamic_batching)."""
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.clear_providers()
    if device == "cuda":
        config.append_provider("cuda")
    if overlay:
        config.overlay(json.dumps(overlay))
    model = og.Model(config)
    return model, og.Engine(model)


def serve(engine, batch: list[np.ndarray], new: int, budget: float | None = None) -> tuple[list[RequestTimes], int, int, str | None]:
    """Submits every prompt of `batch` as a request generating `new` tokens greedily, then steps the
    Engine until none is pending, closing each request as its turn ends (the Engine keeps a finished
    turn's blocks for a next turn until its request is closed: a pool that holds fewer requests than
    were submitted would otherwise stall once it filled). Returns (times per request, the most requests decoding at once after
    any step, CAPACITY_BLOCKED events, why it stopped early or None). budget: seconds after which the
    requests still running are closed."""
    import onnxruntime_genai as og

    flags = og.EngineEventFlags
    token, finished, blocked, failed = (int(f.value) for f in (flags.TOKEN, flags.TURN_FINISHED, flags.CAPACITY_BLOCKED,
                                                               flags.FAILED))
    times = [RequestTimes() for _ in batch]
    requests, index = [], {}
    t0 = time.perf_counter()
    for ids in batch:
        options = og.RequestOptions()
        options.set_max_session_tokens(len(ids) + new)
        request = engine.create_request(options=options)
        turn = og.TurnOptions(request)
        turn.set_max_generated_tokens(new)
        turn.set_do_sample(False)
        request.begin_turn(ids, turn)
        index[id(request)] = len(requests)
        requests.append(request)  # the handles stay alive: a released one is abandoned by the Engine
    events = engine.create_event_buffer(max(64, 2 * len(batch)))
    peak = blocked_events = 0
    cut = None
    while engine.has_pending_requests():
        out = engine.run(events)
        now = time.perf_counter() - t0
        for i in range(len(out)):
            ev = out[i]
            k = index.get(id(ev.request))
            if k is None:  # an event of no request of this batch (an earlier one's): not counted
                continue
            f = int(ev.flags.value)
            t = times[k]
            if f & token:
                t.tokens += 1
                t.ids.append(int(ev.token))
                t.last = now
                if t.first is None:
                    t.first = now
            if f & blocked:
                blocked_events += 1
            if f & failed:
                t.error = str(ev.error_code.name)
            if f & (finished | failed) and t.finished is None:
                t.finished = now
                requests[k].close()  # its blocks back to the pool
        peak = max(peak, sum(t.first is not None and t.finished is None for t in times))
        if budget is not None and now > budget:
            cut = f"stopped after {now:.0f} s (budget {budget:g} s): {sum(t.finished is None for t in times)} requests unfinished"
            break
    for request, t in zip(requests, times):
        if t.finished is None:
            request.close()
    return times, peak, blocked_events, cut


def warm_up(engine, vocab: int, block_size: int, count: int = 2) -> None:
    """A few short requests through the Engine before any point is timed: the kernels' first-call
    costs (their choice, the arenas' growth) are a process's, not a point's."""
    rng = np.random.default_rng(12345)
    batch = [rng.integers(3, max(vocab, 4), 2 * block_size, dtype=np.int32) for _ in range(count)]
    serve(engine, batch, WARMUP_NEW)


def run_point(engine, model: str, vocab: int, concurrency: int, context: int, new: int, seed: int = 0,
              budget: float | None = None, fits: int | None = None) -> PointResult:
    """One point (C concurrent requests of S prompt tokens, N new each) through `engine`."""
    result = PointResult(model, concurrency, context, new, fits=fits)
    times, result.peak_decoding, result.capacity_blocked, result.cut = serve(
        engine, prompts(vocab, concurrency, context, seed), new, budget)
    return summarize(result, times)
