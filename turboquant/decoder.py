"""Running an exported decoder with its KV cache in ONNX Runtime: empty caches for the first step,
one step at a time, and a greedy `generate` loop. Works the same for the original model and its
turboquant rewrite (whose compressed layers take uint8 caches), on the CPU or the CUDA provider.

    sess = DecoderSession("model.turboquant_4bit_nc.onnx")
    tokens = sess.generate(prompt_ids, max_new_tokens=32)
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from .ort import session_options
from .step_masks import StepMasks

_PAST = re.compile(r"^(?:past_key_values|past)\.(\d+)\.(key|value)$|^past_(key|value)[._](\d+)$")
_PRESENT = re.compile(r"^present(?:_key_values)?\.(\d+)\.(key|value)$|^present_(key|value)[._](\d+)$")
_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8}


def greedy(logits: np.ndarray) -> np.ndarray:
    """The highest-scoring token of each row (the argmax over the last axis). float16 goes by its bits
    as ordered int16 keys: numpy's argmax over float16, and its conversion to float32, run element by
    element, milliseconds of every decode step at B = 8 (docs/performance.md, "The loop's own time
    between steps")."""
    logits = np.asarray(logits)
    if logits.dtype != np.float16:
        return logits.argmax(-1)
    bits = logits.view(np.int16)
    keys = bits ^ ((bits >> 15) & 0x7FFF)  # negatives' magnitudes reversed: int16 order is float order
    keys[bits == np.int16(-32768)] = 0  # -0.0 ties +0.0, as in float comparison
    return keys.argmax(-1)


def _layer_kind(m: re.Match) -> tuple[int, str]:
    return (int(m[1]), m[2]) if m[1] is not None else (int(m[4]), m[3])


class DecoderSession:
    shares_buffers = False  # past and present bound to one buffer (SharedBufferDecoder)

    def __init__(self, model: str | os.PathLike | bytes, providers: Sequence = ("CPUExecutionProvider",),
                 threads: int | None = None, options: ort.SessionOptions | None = None):
        """model: a path, or a serialized model (its external data found through `options`)."""
        names = [p if isinstance(p, str) else p[0] for p in providers]  # a provider may come with options
        if "CUDAExecutionProvider" in names and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # onnxruntime-gpu finds the CUDA libraries of an installed torch
        so = options or session_options(threads)
        self.session = ort.InferenceSession(model if isinstance(model, bytes) else os.fspath(model), so,
                                            providers=list(providers))
        model = "the model" if isinstance(model, bytes) else model  # for the messages below
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get("turboquant.cache") == "in-place" and not self.shares_buffers:
            raise ValueError(f"{model}: its caches are buffers written in place (rewritten with --cache in-place); "
                             "run it with turboquant.shared_buffer.SharedBufferDecoder")
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.cache_inputs: dict[tuple[int, str], ort.NodeArg] = {}
        for i in self.session.get_inputs():
            m = _PAST.match(i.name)
            if m:
                self.cache_inputs[_layer_kind(m)] = i
        self.cache_outputs: dict[tuple[int, str], str] = {}
        for o in self.session.get_outputs():
            m = _PRESENT.match(o.name)
            if m:
                self.cache_outputs[_layer_kind(m)] = o.name
        if not self.cache_inputs:
            raise ValueError(f"{model}: no KV-cache inputs named like past_key_values.N.key")
        missing = set(self.cache_inputs) - set(self.cache_outputs)
        if missing:
            raise ValueError(f"{model}: no present output for cache inputs {sorted(missing)}")
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.logits_name = "logits" if "logits" in self.output_names else self.output_names[0]
        # On the GPU the cache stays there: IO binding, device-resident OrtValues fed back each step.
        self.on_cuda = self.session.get_providers()[0] == "CUDAExecutionProvider"
        self._masks = StepMasks()
        known = {"input_ids", "attention_mask", "position_ids", "use_cache_branch"} | {a.name for a in self.cache_inputs.values()}
        # hybrid models' other state inputs (LFM2's past.N.conv, Qwen3.5's recurrent states): fed their
        # initial state, zeros, where the model starts from none (past_len 0), then carried in the cache
        # from the output named like them (present for past)
        self.state_inputs = {i.name: i for i in self.session.get_inputs() if i.name not in known and i.type in _NP}
        self.state_outputs = {n: o for n in self.state_inputs
                              if (o := re.sub(r"^past", "present", n)) != n and o in self.output_names}
        positions = next((i for i in self.session.get_inputs() if i.name == "position_ids"), None)
        self._mrope = positions is not None and len(positions.shape) == 3  # MRoPE's [3, batch, seq]

    def initial_state(self, arg: ort.NodeArg, batch: int, past_len: int) -> np.ndarray:
        """Zeros of a state input's shape (batch first, its other dims static): the state before any
        token. Later steps take the state the last one output, carried in the cache."""
        dims = list(arg.shape)[1:]
        if not all(isinstance(d, int) for d in dims):
            raise ValueError(f"state input {arg.name} {arg.shape}: its initial state needs static dims after the batch")
        if past_len:
            why = ("the cache given does not carry it" if arg.name in self.state_outputs
                   else "no output named like it (present for past) carries its next state")
            raise ValueError(f"state input {arg.name}: {past_len} tokens in, {why}")
        return np.zeros((batch, *dims), _NP[arg.type])

    def empty_cache(self, batch: int = 1) -> dict:
        """Zero-length caches of the dtype and shape each cache input wants (numpy arrays on the
        CPU, OrtValues on the GPU)."""
        cache = {}
        for arg in self.cache_inputs.values():
            shape = arg.shape
            heads, last = shape[1], shape[3]
            if not isinstance(heads, int) or not isinstance(last, int):
                raise ValueError(f"cache input {arg.name} has symbolic dims {shape}; cannot make an empty cache")
            if arg.type not in _NP:
                raise ValueError(f"cache input {arg.name} has type {arg.type}; expected float32, float16 or uint8")
            empty = np.zeros((batch, heads, 0, last), _NP[arg.type])
            cache[arg.name] = ort.OrtValue.ortvalue_from_numpy(empty, "cuda", 0) if self.on_cuda else empty
        return cache

    def release(self) -> None:
        """Lets go of cache buffers held between steps: none here (SharedBufferDecoder holds its
        last cache's binding)."""

    def run_all(self, input_ids: np.ndarray, cache: dict[str, np.ndarray], past_len: int) -> dict[str, np.ndarray]:
        """Every output of the model (by name) for new tokens input_ids [B, S] after past_len cached ones (CPU)."""
        return dict(zip(self.output_names, self.session.run(None, self.feeds(input_ids, cache, past_len))))

    def feeds(self, input_ids: np.ndarray, cache: dict, past_len: int) -> dict:
        """The inputs of one step: token ids, the cache, and the mask, positions and branch flag the model takes."""
        b, s = input_ids.shape
        feeds = {"input_ids": input_ids.astype(np.int64), **cache}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = self._masks.ones(b, past_len + s)
        if "position_ids" in self.input_names:  # text only: MRoPE's three streams are the same positions
            shape = (3, b, s) if self._mrope else (b, s)
            feeds["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + s, dtype=np.int64), shape).copy()
        for name, arg in self.state_inputs.items():
            if name not in feeds:
                feeds[name] = self.initial_state(arg, b, past_len)
        if "use_cache_branch" in self.input_names:  # merged decoders (an If on whether a past exists)
            feeds["use_cache_branch"] = np.array([past_len > 0])
        return feeds

    def step(self, input_ids: np.ndarray, cache: dict[str, np.ndarray], past_len: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Runs new tokens input_ids [B, S] after past_len cached ones; returns logits and the next cache."""
        feeds = self.feeds(input_ids, cache, past_len)
        if self.on_cuda:
            return self._step_cuda(feeds)
        outs = dict(zip(self.output_names, self.session.run(None, feeds)))
        return outs[self.logits_name], self._next_cache(outs)

    def _next_cache(self, outs: dict) -> dict:
        nxt = {self.cache_inputs[k].name: outs[self.cache_outputs[k]] for k in self.cache_inputs}
        return {**nxt, **{n: outs[o] for n, o in self.state_outputs.items()}}

    def _step_cuda(self, feeds: dict) -> tuple[np.ndarray, dict]:
        io = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                io.bind_ortvalue_input(name, value)
            else:
                io.bind_cpu_input(name, np.ascontiguousarray(value))
        for name in self.output_names:
            io.bind_output(name, "cpu" if name == self.logits_name else "cuda")
        self.session.run_with_iobinding(io)
        outs = dict(zip(self.output_names, io.get_outputs()))
        return outs[self.logits_name].numpy(), self._next_cache(outs)

    def generate(self, prompt_ids: np.ndarray, max_new_tokens: int = 16) -> np.ndarray:
        """Greedy decoding: returns the new token ids [B, max_new_tokens]. Runs the prompt and then
        max_new_tokens - 1 decode steps: the last token is returned, not fed back."""
        prompt_ids = np.atleast_2d(np.asarray(prompt_ids, np.int64))
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer of zero or more, got {max_new_tokens!r}")
        out = np.zeros((prompt_ids.shape[0], max_new_tokens), np.int64)
        if max_new_tokens == 0:
            return out
        cache = self.empty_cache(prompt_ids.shape[0])
        logits, cache = self.step(prompt_ids, cache, 0)
        past = prompt_ids.shape[1]
        for t in range(max_new_tokens):
            out[:, t] = greedy(logits[:, -1])
            if t + 1 < max_new_tokens:
                logits, cache = self.step(out[:, t:t + 1], cache, past)
                past += 1
        return out

    def teacher_forced(self, ids: np.ndarray, prefill: int, progress=None) -> np.ndarray:
        """Logits for ids[:, prefill-1:] with ids[:, :prefill] prefilled, then one token per step
        (the last row predicts the token after ids). progress: called after each decode step."""
        ids = np.atleast_2d(np.asarray(ids, np.int64))
        cache = self.empty_cache(ids.shape[0])
        logits, cache = self.step(ids[:, :prefill], cache, 0)
        steps = [logits[:, -1]]
        for t in range(prefill, ids.shape[1]):
            logits, cache = self.step(ids[:, t:t + 1], cache, t)
            steps.append(logits[:, -1])
            if progress is not None:
                progress()
        return np.stack(steps, axis=1)
