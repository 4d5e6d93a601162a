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
import statistics
import time

import numpy as np

from . import memory
from .cache_layout import ModelInfo

WARMUP = 2  # decode steps run before the timed ones


@dataclasses.dataclass
class Options:
    device: str = "cpu"
    batch: int = 1
    context: int = 1024
    steps: int = 16
    prefill_chunk: int | None = None  # None: the prompt in one call
    runtime: str = "ort"  # "ort" or "genai"
    fill: str = "prefill"  # "prefill" or "random"
    ttft_budget: float = 120.0  # fill random: seconds the prefill for ttft may take before it is given up
    capacity: int | None = None
    threads: int | None = None
    seed: int = 0


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


def token_ids(vocab: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """The ids every model sees: prompt and decode tokens alike (ids 3.. skip the special tokens)."""
    return np.random.default_rng(seed).integers(3, max(vocab, 4), (batch, length), dtype=np.int64)


def _providers(device: str) -> list:
    if device == "cuda":
        # kSameAsRequested: the arena grows by what is asked, so the peak is not a power-of-two round-up
        return [("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _session(info: ModelInfo, opts: Options):
    from ..decoder import DecoderSession
    from ..shared_buffer import SharedBufferDecoder

    if info.shared:
        return SharedBufferDecoder(info.path, max_length=opts.context + WARMUP + opts.steps,
                                   head_size=info.caches[0].width, providers=_providers(opts.device), threads=opts.threads)
    return DecoderSession(info.path, providers=_providers(opts.device), threads=opts.threads)


def prefill(dec, ids: np.ndarray, chunk: int | None, budget: float | None = None):
    """Runs the prompt ids [B, S] into fresh caches chunk by chunk; returns (seconds to the first
    token, caches, tokens done). Stops after the chunk that passes `budget` seconds."""
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
    logits[:, -1].argmax(-1)  # the first token, as a user's loop picks it
    return time.perf_counter() - t0, cache, done


def _chunk_text(chunk: int | None, s: int) -> str:
    return "in one call" if not chunk or chunk >= s else f"in chunks of {chunk}"


def decode_steps(dec, ids: np.ndarray, cache, past: int, steps: int) -> list[float]:
    """Seconds of each of `steps` single-token steps after WARMUP untimed ones, fed ids[:, past:]."""
    times = []
    for i in range(WARMUP + steps):
        t0 = time.perf_counter()
        logits, cache = dec.step(ids[:, past + i:past + i + 1], cache, past + i)
        logits[:, -1].argmax(-1)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def run_ort(info: ModelInfo, opts: Options, ids: np.ndarray, rec: Record) -> None:
    from .cache_fill import RandomFill

    s = opts.context
    chunk, why = opts.prefill_chunk, ""
    if info.shared and opts.batch > 1 and chunk and chunk < s:
        chunk, why = None, " (GroupQueryAttention takes a prompt in chunks only at batch 1)"
    dec = _session(info, opts)
    rec.loop = f"{type(dec).__name__}{', IO binding, caches on the device' if opts.device == 'cuda' else ''}"
    if opts.fill == "prefill":
        secs, cache, _ = prefill(dec, ids[:, :s], chunk)
        rec.ttft_ms = secs * 1e3
        rec.fill = "prefill"
        rec.ttft_how = f"prefill of {s} tokens {_chunk_text(chunk, s)}{why}, then the first token"
    else:
        if opts.ttft_budget > 0:
            secs, cache, done = prefill(dec, ids[:, :s], chunk, opts.ttft_budget)
            if secs is None:
                rec.ttft_how = (f"not measured: the prefill {_chunk_text(chunk, s)}{why} passed "
                                f"{opts.ttft_budget:g} s after {done} of {s} tokens")
            else:
                rec.ttft_ms = secs * 1e3
                rec.ttft_how = f"prefill of {s} tokens {_chunk_text(chunk, s)}{why}, then the first token"
            del cache
            gc.collect()
        else:
            rec.ttft_how = "not measured (--ttft-budget 0)"
        rows = dec.max_length if info.shared else s
        numpy = not info.shared and opts.device == "cpu"
        cache = RandomFill(opts.device, opts.seed).caches(info.caches, opts.batch, rows, numpy=numpy)
        rec.fill = "random (random K/V repeated to S rows; packed layers through TQPack)"
    times = decode_steps(dec, ids, cache, s, opts.steps)
    rec.ms_per_step = statistics.median(times) * 1e3


def run_genai(info: ModelInfo, opts: Options, ids: np.ndarray, rec: Record) -> None:
    import onnxruntime_genai as og

    s = opts.context
    config = og.Config(str(info.genai_folder))
    config.clear_providers()
    if opts.device == "cuda":
        config.append_provider("cuda")
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=s + opts.steps + WARMUP + 1, batch_size=opts.batch, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(ids[:, :s].astype(np.int32))
    gen.generate_next_token()  # picks the first token from the prompt's logits
    gen.get_next_tokens()
    rec.ttft_ms = (time.perf_counter() - t0) * 1e3
    rec.loop = "onnxruntime-genai og.Generator"
    rec.fill = "prefill (og.Generator.append_tokens)"
    rec.ttft_how = f"append_tokens of {s} tokens in one call, then generate_next_token"
    times = []
    for i in range(WARMUP + opts.steps):
        t0 = time.perf_counter()
        gen.generate_next_token()  # runs the model on the last token, picks the next
        gen.get_next_tokens()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    rec.ms_per_step = statistics.median(times) * 1e3
    del gen, params, model


def capacity(info: ModelInfo, opts: Options) -> tuple[int, int]:
    """(largest batch at context S, longest context at batch B) whose caches fit opts.capacity bytes,
    from the model's cache layout."""
    per = info.bytes_per_token()
    return opts.capacity // (opts.context * per), opts.capacity // (opts.batch * per)


def check_capacity(info: ModelInfo, opts: Options, batch: int) -> str:
    """Allocates the caches of `batch` sequences of S tokens on the device where the budget fits in
    its free memory; says what was done."""
    import onnxruntime as ort

    if batch == 0:
        return f"not allocated: one sequence of {opts.context} tokens needs {info.kv_bytes(1, opts.context)} bytes"
    free = memory.device_free() if opts.device == "cuda" else memory.available_host()
    need = info.kv_bytes(batch, opts.context)
    if free is None or need > free:
        return f"not allocated: {need / 1e9:.1f} GB > {(free or 0) / 1e9:.1f} GB free on {opts.device}"
    try:
        held = [ort.OrtValue.ortvalue_from_shape_and_type([batch, c.heads, opts.context, c.width], c.dtype, opts.device, 0)
                for c in info.caches]
    except Exception as e:  # noqa: BLE001 - an allocation the device refuses is the answer
        return f"allocation of {need} bytes failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    got = sum(int(np.prod(v.shape())) * np.dtype(c.dtype).itemsize for v, c in zip(held, info.caches))
    del held
    return f"allocated {got} bytes on {opts.device} for batch {batch}"


def run(paths: list[str], infos: list[ModelInfo], opts: Options, log=print) -> list[Record]:
    vocab = min(i.vocab for i in infos if i.vocab) if any(i.vocab for i in infos) else 32000
    ids = token_ids(vocab, opts.batch, opts.context + WARMUP + opts.steps, opts.seed)
    records = []
    for path, info in zip(paths, infos):
        rec = Record(path, opts.device, opts.batch, opts.context, None, None, None, info.kv_bytes(opts.batch, opts.context),
                     None, runtime=opts.runtime, peak_how=memory.HOW[opts.device], steps=opts.steps)
        log(f"{path}: {opts.runtime} runtime, {opts.fill} fill, B={opts.batch}, S={opts.context} ...")
        try:
            with memory.PeakSampler(opts.device) as peak:
                (run_genai if opts.runtime == "genai" else run_ort)(info, opts, ids, rec)
                gc.collect()
            rec.peak_bytes = peak.added
            rec.tokens_per_s = opts.batch * 1e3 / rec.ms_per_step
        except Exception as e:  # noqa: BLE001 - one model failing (out of memory, say) is recorded, the others still run
            rec.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"  failed: {rec.error}")
        gc.collect()
        if opts.capacity:
            rec.capacity_bytes = opts.capacity
            rec.capacity_batch, rec.capacity_context = capacity(info, opts)
            rec.capacity_check = check_capacity(info, opts, rec.capacity_batch)
            if info.max_length and rec.capacity_context > info.max_length:
                rec.capacity_check += f"; the longest context is beyond genai_config's context_length {info.max_length}"
        records.append(rec)
    return records
