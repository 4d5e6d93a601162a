"""Running a decoder the way onnxruntime-genai does with past_present_share_buffer: one buffer of
max_length rows per cache tensor, bound as both the past input and the present output of every
step, so the model (GroupQueryAttention, or turboquant's TQGroupQueryAttention: genai models, and
exported decoders rewritten with --cache in-place) writes each step's tokens into it in place.
Plain ONNX Runtime with IO binding, on the CPU or the CUDA provider.

    dec = SharedBufferDecoder("genai_folder/model.onnx", max_length=256)
    tokens = dec.generate(prompt_ids, max_new_tokens=32)
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from .decoder import _NP, DecoderSession


class SharedBufferDecoder(DecoderSession):
    shares_buffers = True

    def __init__(self, model: str | os.PathLike, max_length: int, head_size: int | None = None,
                 providers: Sequence = ("CPUExecutionProvider",), threads: int | None = None,
                 options: ort.SessionOptions | None = None):
        """Each cache buffer takes its own input's KV heads and row width (a rewritten genai model's
        layers differ), as genai allocates them. head_size: the width where an input leaves its last
        dimension symbolic (default: genai_config.json's decoder.head_size beside the model)."""
        super().__init__(model, providers, threads, options)
        self.max_length = int(max_length)
        self.head_size = head_size or self._config_head_size(pathlib.Path(model))
        self.device = ("cuda", 0) if self.on_cuda else ("cpu", 0)
        self.cache_shapes: dict[str, tuple[int, int]] = {}  # input name -> (kv heads, row width)
        for arg in self.cache_inputs.values():
            heads, last = arg.shape[1], arg.shape[3]
            last = last if isinstance(last, int) else self.head_size
            if not isinstance(heads, int) or not isinstance(last, int):
                raise ValueError(f"cache input {arg.name} has symbolic dims {arg.shape}; pass head_size")
            self.cache_shapes[arg.name] = (heads, last)

    @staticmethod
    def _config_head_size(model: pathlib.Path) -> int | None:
        config = model.parent / "genai_config.json"
        if not config.is_file():
            return None
        return json.loads(config.read_text())["model"]["decoder"].get("head_size")

    def empty_cache(self, batch: int = 1) -> dict:
        """Zeroed buffers [batch, kv_heads, max_length, W], each input's own (genai zeroes its buffers too)."""
        cache = {}
        for arg in self.cache_inputs.values():
            heads, last = self.cache_shapes[arg.name]
            buf = np.zeros((batch, heads, self.max_length, last), _NP[arg.type])
            cache[arg.name] = ort.OrtValue.ortvalue_from_numpy(buf, *self.device)
        return cache

    def step(self, input_ids: np.ndarray, cache: dict, past_len: int, lengths=None) -> tuple[np.ndarray, dict]:
        """New tokens input_ids [B, S] after past_len cached ones, written into the same buffers.

        lengths [B] (right padding): each sequence's tokens after this step, at most past_len + S;
        a first prompt's rows past its length are padding, and a later step's tokens go to rows
        lengths - S of their sequence (GroupQueryAttention's convention, as onnxruntime-genai feeds it)."""
        b, s = input_ids.shape
        if past_len + s > self.max_length:
            raise ValueError(f"{past_len + s} tokens do not fit the buffers' max_length {self.max_length}")
        feeds = self.feeds(input_ids, {}, past_len)
        if lengths is not None:
            feeds.update(self._padded(np.asarray(lengths, np.int64), b, s, past_len))
        io = self.session.io_binding()
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        io.bind_output(self.logits_name, "cpu")  # first: get_outputs() follows the binding order
        for key, arg in self.cache_inputs.items():
            io.bind_ortvalue_input(arg.name, cache[arg.name])
            io.bind_ortvalue_output(self.cache_outputs[key], cache[arg.name])
        for name in self.output_names:
            if name != self.logits_name and name not in self.cache_outputs.values():
                io.bind_output(name, self.device[0])
        self.session.run_with_iobinding(io)
        return io.get_outputs()[0].numpy(), cache

    def _padded(self, lengths: np.ndarray, b: int, s: int, past_len: int) -> dict:
        total = past_len + s
        if lengths.shape != (b,) or (lengths > total).any() or (lengths < (1 if past_len == 0 else s)).any():
            raise ValueError(f"lengths must be {b} counts in [{1 if past_len == 0 else s}, {total}], got {lengths.tolist()}")
        feeds = {}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = (np.arange(total)[None] < lengths[:, None]).astype(np.int64)
        if "position_ids" in self.input_names:
            start = np.zeros(b, np.int64) if past_len == 0 else lengths - s
            feeds["position_ids"] = start[:, None] + np.arange(s, dtype=np.int64)[None]
        return feeds

    def buffers(self, cache: dict) -> dict[str, np.ndarray]:
        """Host copies of the cache buffers."""
        return {name: np.array(v.numpy(), copy=True) for name, v in cache.items()}
