"""Whole-model decode benchmark: every model in one process, on the same token ids, through the
loop a user runs (turboquant.decoder.DecoderSession for growing caches, SharedBufferDecoder for
genai-style shared buffers; IO binding with device-resident caches on CUDA), or through
onnxruntime-genai's own og.Generator (runtime "genai").

Per model: ms per decode step and tokens/s (all B sequences) at context S, time to first token
(a prefill of S tokens and its next token), the cache layout's bytes at S, peak memory, and with a
capacity budget the largest batch at S and the longest context at B that fit.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from ..decoder import greedy
from . import memory
from .cache_layout import ModelInfo

WARMUP = 2  # decode steps run before the timed ones


@dataclasses.dataclass
class Options:
    device: str = "cpu"
    points: list[tuple[int, int]] = dataclasses.field(default_factory=lambda: [(1, 1024)])  # (batch, context), in order
    steps: int = 16
    prefill_chunk: int | None = None  # None: the prompt in one call
    runtime: str = "ort"  # "ort" or "genai"
    cuda_graph: bool = False  # CUDA: decode steps replayed from CUDA graphs (og.Generator's, or SharedBufferDecoder's)
    graph_models: tuple[int, ...] | None = None  # with cuda_graph: the models (0-based) that replay graphs; None: all
    fill: str = "prefill"  # "prefill" or "random"
    ttft_budget: float = 120.0  # fill random: seconds the prefill for ttft may take before it is given up
    ttft_max_tokens: int | None = None  # fill random: the prefill for ttft only where batch x context is at most this
    capacity: int | None = None
    threads: int | None = None
    seed: int = 0
    ttft_warmup: bool = True  # the prompt once untimed first: ttft without the process's first-call costs
    rounds: int = 1  # every model this many times, the models' order reversed every other round (run_rounds)
    isolate: bool = False  # each model of each round in a process of its own (run_rounds)


@dataclasses.dataclass
class Record:
    model: str
    device: str
    batch: int
    context: int
    ms_per_step: float | None
    tokens_per_s: float | None
    ttft_ms: float | None
    kv_bytes: int
    peak_bytes: int | None
    runtime: str = "ort"
    loop: str = ""  # the decode loop that ran the model
    fill: str = ""  # how the caches reached S tokens before the timed steps
    ttft_how: str = ""
    peak_how: str = ""
    steps: int = 0
    capacity_bytes: int | None = None
    capacity_batch: int | None = None
    capacity_context: int | None = None
    capacity_check: str | None = None
    error: str | None = None
    gpu_ms_per_step: float | None = None  # CUDA: the device's busy time per step (kernels, copies)
    cuda_graph: bool = False  # its decode steps replayed from CUDA graphs
    round_ms: list[float | None] | None = None  # run_rounds: each round's ms/step (None: that round failed)
    rounds_how: str = ""  # run_rounds: how the rounds ran


def token_ids(vocab: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """The ids every model sees: prompt and decode tokens alike (ids 3.. skip the special tokens)."""
    return np.random.default_rng(seed).integers(3, max(vocab, 4), (batch, length), dtype=np.int64)


def host_bytes(infos: list[ModelInfo], opts: Options) -> int:
    """Host bytes a run holds at its largest, from the layouts: every point's token ids (made up
    front); on the CPU, one model's caches at its largest point (twice for DecoderSession, which takes
    numpy copies) and a prefill call's logits."""
    total = sum(b * (s + WARMUP + opts.steps) * 8 for b, s in opts.points)
    if opts.device != "cpu":  # the caches are the device's (its own out-of-memory errors, recorded)
        return total
    most = 0
    for info in infos:
        for b, s in opts.points:
            caches = info.kv_bytes(b, s + WARMUP + opts.steps) * (1 if info.shared else 2)
            logits = b * min(opts.prefill_chunk or s, s) * (info.vocab or 0) * 4 if opts.fill == "prefill" else 0
            most = max(most, caches + logits)
    return total + most


def _providers(device: str) -> list:
    if device == "cuda":
        # kSameAsRequested: the arena grows by what is asked, so the peak is not a power-of-two round-up
        return [("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _session(info: ModelInfo, opts: Options, max_length: int):
    from ..decoder import DecoderSession
    from ..shared_buffer import SharedBufferDecoder

    if info.shared:
        return SharedBufferDecoder(info.path, max_length=max_length, head_size=info.caches[0].width,
                                   providers=_providers(opts.device), threads=opts.threads, cuda_graph=opts.cuda_graph)
    if opts.cuda_graph:  # a graph replays fixed shapes; these caches grow every step
        raise ValueError(f"{info.path}: CUDA graphs need caches written in place (SharedBufferDecoder); "
                         "this model's grow each step (DecoderSession)")
    return DecoderSession(info.path, providers=_providers(opts.device), threads=opts.threads)


def prefill(dec, ids: np.ndarray, chunk: int | None, budget: float | None = None, warmup: bool = False):
    """Runs the prompt ids [B, S] into fresh caches chunk by chunk; returns (seconds to the first
    token, caches, tokens done). Stops after the chunk that passes `budget` seconds. warmup: the same
    prompt once before, untimed (the first call at a shape pays allocations and kernel choices a
    serving process pays once)."""
    if warmup:
        secs, cache, done = prefill(dec, ids, chunk, budget)
        if secs is None:
            return None, cache, done
        del cache
    b, s = ids.shape
    chunk = chunk or s
    cache = dec.empty_cache(b)
    t0 = time.perf_counter()
    done = 0
    while done < s:
        n = min(chunk, s - done)
        logits, cache = dec.step(ids[:, done:done + n], cache, done)
        done += n
        if budget is not None and done < s and time.perf_counter() - t0 > budget:
            return None, cache, done
    greedy(logits[:, -1])  # the first token, as a user's loop picks it
    return time.perf_counter() - t0, cache, done


def _warm(opts: Options) -> str:
    return " (after the same prompt once untimed)" if opts.ttft_warmup else " (the first call at this shape)"


def _chunk_text(chunk: int | None, s: int) -> str:
    return "in one call" if not chunk or chunk >= s else f"in chunks of {chunk}"


def decode_steps(dec, ids: np.ndarray, cache, past: int, steps: int, warmup: int = WARMUP) -> list[float]:
    """Seconds of each of `steps` single-token steps after `warmup` untimed ones, fed ids[:, past:]."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits, cache = dec.step(ids[:, past + i:past + i + 1], cache, past + i)
        greedy(logits[:, -1])
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def gpu_ms_per_step(dec, ids: np.ndarray, cache, past: int, steps: int) -> float | None:
    """Milliseconds per step the device spent in kernels and copies (CUPTI, their union), over `steps`
    more steps from the same cache (shared buffers rewrite the same rows), untimed by the clock: the
    profiler's cost per launch would count in ms/step. What ms/step has beyond it is no kernel's."""
    from . import gpu_time

    busy = gpu_time.busy_seconds(lambda: decode_steps(dec, ids, cache, past, steps, warmup=0))
    return busy / steps * 1e3 if busy else None


def run_ort(info: ModelInfo, opts: Options, dec, ids: np.ndarray, rec: Record) -> None:
    """One (batch, context) point of a model through its decode loop `dec`."""
    from .cache_fill import RandomFill

    b, s = rec.batch, rec.context
    chunk, why = opts.prefill_chunk, ""
    if info.shared:
        dec.max_length = s + WARMUP + opts.steps  # the shared buffers' rows, as genai's max_length
        if b > 1 and chunk and chunk < s:
            chunk, why = None, " (GroupQueryAttention takes a prompt in chunks only at batch 1)"
    if opts.fill == "prefill":
        secs, cache, _ = prefill(dec, ids[:, :s], chunk, warmup=opts.ttft_warmup)
        rec.ttft_ms = secs * 1e3
        rec.fill = "prefill"
        rec.ttft_how = f"prefill of {s} tokens {_chunk_text(chunk, s)}{why}, then the first token{_warm(opts)}"
    else:
        if opts.ttft_max_tokens is not None and b * s > opts.ttft_max_tokens:
            rec.ttft_how = f"not measured: batch x context {b * s} above --ttft-max-tokens {opts.ttft_max_tokens}"
        elif opts.ttft_budget > 0:
            try:
                secs, cache, done = prefill(dec, ids[:, :s], chunk, opts.ttft_budget, warmup=opts.ttft_warmup)
                del cache
            except Exception as e:  # noqa: BLE001 - a prefill too large for the device still leaves the decode to time
                secs, done = None, f"failed ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            if secs is None and isinstance(done, str):
                rec.ttft_how = f"not measured: the prefill {_chunk_text(chunk, s)}{why} {done}"
            elif secs is None:
                rec.ttft_how = (f"not measured: the prefill {_chunk_text(chunk, s)}{why} passed "
                                f"{opts.ttft_budget:g} s after {done} of {s} tokens")
            else:
                rec.ttft_ms = secs * 1e3
                rec.ttft_how = f"prefill of {s} tokens {_chunk_text(chunk, s)}{why}, then the first token{_warm(opts)}"
            gc.collect()
        else:
            rec.ttft_how = "not measured (--ttft-budget 0)"
        rows = dec.max_length if info.shared else s
        numpy = not info.shared and opts.device == "cpu"
        dec.release()  # the prefill's cache, before this one is allocated
        cache = RandomFill(opts.device, opts.seed).caches(info.caches, b, rows, numpy=numpy)
        rec.fill = "random (random K/V repeated to S rows; packed layers through TQPack)"
    times = decode_steps(dec, ids, cache, s, opts.steps)
    rec.ms_per_step = statistics.median(times) * 1e3
    if opts.device == "cuda":
        rec.gpu_ms_per_step = gpu_ms_per_step(dec, ids, cache, s, opts.steps)


def _genai_model(info: ModelInfo, opts: Options):
    import onnxruntime_genai as og

    config = og.Config(str(info.genai_folder))
    config.clear_providers()
    if opts.device == "cuda":
        config.append_provider("cuda")
        if opts.cuda_graph:
            config.set_provider_option("cuda", "enable_cuda_graph", "1")
    return og.Model(config)


def run_genai(info: ModelInfo, opts: Options, model, ids: np.ndarray, rec: Record) -> None:
    """One (batch, context) point through onnxruntime-genai's own generator on og.Model `model`."""
    import onnxruntime_genai as og

    b, s = rec.batch, rec.context
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=s + opts.steps + WARMUP + 1, batch_size=b, do_sample=False)
    if opts.ttft_warmup:  # the same prompt once untimed, in a generator of its own
        warm = og.Generator(model, params)
        warm.append_tokens(ids[:, :s].astype(np.int32))
        warm.generate_next_token()
        del warm
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids[:, :s].astype(np.int32))
    gen.generate_next_token()  # picks the first token from the prompt's logits
    gen.get_next_tokens()
    rec.ttft_ms = (time.perf_counter() - t0) * 1e3
    rec.fill = "prefill (og.Generator.append_tokens)"
    rec.ttft_how = f"append_tokens of {s} tokens in one call, then generate_next_token{_warm(opts)}"
    times = []
    for i in range(WARMUP + opts.steps):
        t0 = time.perf_counter()
        gen.generate_next_token()  # runs the model on the last token, picks the next
        gen.get_next_tokens()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    rec.ms_per_step = statistics.median(times) * 1e3
    del gen, params


def capacity(info: ModelInfo, budget: int, batch: int, context: int) -> tuple[int, int]:
    """(largest batch at `context`, longest context at `batch`) whose caches fit `budget` bytes,
    from the model's cache layout."""
    per = info.bytes_per_token()
    return budget // (context * per), budget // (batch * per)


def check_capacity(info: ModelInfo, device: str, batch: int, context: int) -> str:
    """Allocates the caches of `batch` sequences of `context` tokens on the device where they fit in
    its free memory; says what was done."""
    from .cache_fill import allocate

    if batch == 0:
        return f"not allocated: one sequence of {context} tokens needs {info.kv_bytes(1, context)} bytes"
    free = memory.device_free() if device == "cuda" else memory.available_host()
    need = info.kv_bytes(batch, context)
    if free is None or need > free:
        return f"not allocated: {need / 1e9:.1f} GB > {(free or 0) / 1e9:.1f} GB free on {device}"
    try:
        # in a process of its own, whose exit returns every byte: memory held by ONNX Runtime's CUDA
        # allocators after the check was still missing when a model decoded at B = 8, S = 32768
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            got = pool.submit(allocate, info.caches, batch, context, device).result()
    except Exception as e:  # noqa: BLE001 - an allocation the device refuses is the answer
        return f"allocation of {need} bytes failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return f"allocated {got} bytes on {device} for batch {batch}"


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _loop(info: ModelInfo, opts: Options) -> str:
    """The decode loop a record's model ran in, in words."""
    if opts.runtime == "genai":
        return f"onnxruntime-genai og.Generator{', CUDA graphs' if opts.cuda_graph else ''}"
    return (f"{'SharedBufferDecoder' if info.shared else 'DecoderSession'}"
            f"{', IO binding, caches on the device' if opts.device == 'cuda' else ''}"
            f"{', CUDA graphs for the decode steps (the prompt without)' if opts.cuda_graph else ''}")


def for_model(opts: Options, i: int) -> Options:
    """The options model i (0-based, in the order given) runs with: cuda_graph resolved for it."""
    graph = opts.cuda_graph and (opts.graph_models is None or i in opts.graph_models)
    return dataclasses.replace(opts, cuda_graph=graph, graph_models=None)


def _vocab(infos: list[ModelInfo]) -> int:
    return min(i.vocab for i in infos if i.vocab) if any(i.vocab for i in infos) else 32000


def run(paths: list[str], infos: list[ModelInfo], opts: Options, log=print, on_record=None,
        vocab: int | None = None) -> list[Record]:
    """Every model at every point; a model is loaded once for all points (its session or og.Model).
    on_record(records so far): called after each record, e.g. to save partial results. vocab: the
    token ids' range (default: the smallest of the models')."""
    vocab = vocab or _vocab(infos)
    ids = {(b, s): token_ids(vocab, b, s + WARMUP + opts.steps, opts.seed) for b, s in opts.points}
    longest = max(s for _, s in opts.points) + WARMUP + opts.steps
    records = []
    every = opts
    for i, (path, info) in enumerate(zip(paths, infos)):
        opts = for_model(every, i)
        # capacity first: its allocation check needs the device memory a loaded model's arena would hold
        checks = {}
        if opts.capacity:
            for b, s in opts.points:
                fit = capacity(info, opts.capacity, b, s)
                note = check_capacity(info, opts.device, fit[0], s)
                if info.max_length and fit[1] > info.max_length:
                    note += f"; the longest context is beyond genai_config's context_length {info.max_length}"
                checks[b, s] = (*fit, note)
        memory.release()
        base = memory.PeakSampler(opts.device).sample()
        try:
            runner = _genai_model(info, opts) if opts.runtime == "genai" else _session(info, opts, longest)
            load_error = None
        except Exception as e:  # noqa: BLE001 - a model that cannot load is recorded, the others still run
            runner, load_error = None, _error(e)
        for b, s in opts.points:
            rec = Record(path, opts.device, b, s, None, None, None, info.kv_bytes(b, s), None, runtime=opts.runtime,
                         peak_how=memory.HOW[opts.device], steps=opts.steps, error=load_error,
                         cuda_graph=opts.cuda_graph)
            rec.loop = _loop(info, opts)
            log(f"{path}: {opts.runtime} runtime, {opts.fill} fill, B={b}, S={s} ...")
            if runner is not None:
                try:
                    with memory.PeakSampler(opts.device, base) as peak:
                        (run_genai if opts.runtime == "genai" else run_ort)(info, opts, runner, ids[b, s], rec)
                        gc.collect()
                    rec.peak_bytes = peak.added
                    rec.tokens_per_s = b * 1e3 / rec.ms_per_step
                except Exception as e:  # noqa: BLE001 - one point failing (out of memory, say) is recorded
                    rec.error = _error(e)
            if rec.error:
                log(f"  failed: {rec.error}")
            gc.collect()
            if opts.capacity:
                rec.capacity_bytes = opts.capacity
                rec.capacity_batch, rec.capacity_context, rec.capacity_check = checks[b, s]
            records.append(rec)
            if on_record is not None:
                on_record(records)
        del runner
        gc.collect()
    return records


def _stderr_log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _in_process_of_its_own(paths, infos, opts: Options, vocab: int) -> list[Record]:
    """run() in a fresh interpreter (spawned, not forked: no CUDA context or arena of this one)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run, paths, infos, opts, _stderr_log, vocab=vocab).result()


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _merged(records: list[Record], how: str) -> Record:
    """One model's records of one point over the rounds: medians, each round's ms/step kept."""
    ok = [r for r in records if not r.error]
    out = dataclasses.replace(ok[0] if ok else records[0], round_ms=[r.ms_per_step for r in records], rounds_how=how)
    failed = [r.error for r in records if r.error]
    if ok:
        out.ms_per_step = _median(r.ms_per_step for r in ok)
        out.tokens_per_s = out.batch * 1e3 / out.ms_per_step
        out.ttft_ms = _median(r.ttft_ms for r in ok)
        out.gpu_ms_per_step = _median(r.gpu_ms_per_step for r in ok)
        peaks = [r.peak_bytes for r in ok if r.peak_bytes is not None]
        out.peak_bytes = max(peaks) if peaks else None
    if failed:  # a round that failed is not hidden by the others' medians
        out.error = f"{len(failed)} of {len(records)} rounds failed: {failed[0]}"
    return out


def run_rounds(paths: list[str], infos: list[ModelInfo], opts: Options, log=print, on_record=None) -> list[Record]:
    """opts.rounds rounds of run(), one model at a time, the models' order reversed every other round
    (A B, B A, ...), each in a process of its own with opts.isolate (one model's memory cannot hold
    back the next one's; the spread between processes is sampled). Returns one record per model and
    point, models in the order given: the medians over the rounds, each round's ms/step in round_ms.
    on_record(every round's records so far) after each model's round."""
    vocab = _vocab(infos)
    single = dataclasses.replace(opts, rounds=1, isolate=False)
    raw: dict[int, list[list[Record]]] = {i: [] for i in range(len(paths))}
    done: list[Record] = []
    for r in range(opts.rounds):
        for i in (range(len(paths)) if r % 2 == 0 else reversed(range(len(paths)))):
            log(f"round {r + 1} of {opts.rounds}: {paths[i]}" + (" (a process of its own)" if opts.isolate else ""))
            one = for_model(single, i)
            if opts.isolate:
                try:
                    records = _in_process_of_its_own([paths[i]], [infos[i]], one, vocab)
                except Exception as e:  # noqa: BLE001 - the process died (killed for memory, say): its points failed
                    records = [Record(paths[i], opts.device, b, s, None, None, None, infos[i].kv_bytes(b, s), None,
                                      runtime=opts.runtime, steps=opts.steps, error=_error(e),
                                      cuda_graph=one.cuda_graph) for b, s in opts.points]
            else:
                records = run([paths[i]], [infos[i]], one, log, vocab=vocab)
            raw[i].append(records)
            done += records
            if on_record is not None:
                on_record(done)
    how = (f"median of {opts.rounds} rounds, the models' order reversed every other round"
           + (", each model of each round in a process of its own" if opts.isolate else ", all in this process")
           + "; each round's ms/step in the JSON (round_ms)")
    return [_merged([rounds[k] for rounds in raw[i]], how) for i in range(len(paths)) for k in range(len(opts.points))]
