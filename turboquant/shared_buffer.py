"""Running a decoder the way onnxruntime-genai does with past_present_share_buffer: one buffer of
max_length rows per cache tensor, bound as both the past input and the present output of every
step, so the model (GroupQueryAttention, or turboquant's TQGroupQueryAttention: genai models, and
exported decoders rewritten with --cache in-place) writes each step's tokens into it in place.
Plain ONNX Runtime with IO binding, on the CPU or the CUDA provider.

    dec = SharedBufferDecoder("genai_folder/model.onnx", max_length=256)
    tokens = dec.generate(prompt_ids, max_new_tokens=32)

Static shapes (static_shapes=True): every decode step (one token per sequence after a prompt)
takes inputs of one shape, as genai feeds a model it runs from CUDA graphs: attention_mask as
wide as the buffers, ones for each sequence's tokens and zeros after, position_ids [B, 1]. The
models' lengths come from the mask's sums and its width only sizes the attention op's
total_sequence_length, so the logits are those of the growing mask. The inputs are device buffers
bound once and updated in place, the logits a buffer of their own. cuda_graph=True adds ONNX
Runtime's CUDA graphs (enable_cuda_graph): the first decode step on a binding is captured, later
ones replay it; prompts run without a graph (run option gpu_graph_id -1) in the same session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from .decoder import _NP, DecoderSession

_TYPES = {**_NP, "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}
_NO_GRAPH = "-1"  # ORT's gpu_graph_id for a run neither captured nor replayed


@dataclasses.dataclass
class _Binding:
    """A decode step's inputs and outputs bound once: the cache buffers (held, so that no other
    buffer takes their addresses while a graph may replay onto them), a buffer per other input,
    updated in place each step, and the logits' buffer."""
    key: tuple
    io: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    logits: ort.OrtValue
    cache: dict
    run_options: ort.RunOptions | None = None
    graph_id: int | None = None
    ran: bool = False  # a graph's first run captures it

    @property
    def rows(self) -> int:
        return next(iter(self.cache.values())).shape()[2]


class SharedBufferDecoder(DecoderSession):
    shares_buffers = True

    def __init__(self, model: str | os.PathLike, max_length: int, head_size: int | None = None,
                 providers: Sequence = ("CPUExecutionProvider",), threads: int | None = None,
                 options: ort.SessionOptions | None = None, static_shapes: bool = False, cuda_graph: bool = False):
        """Each cache buffer takes its own input's KV heads and row width (a rewritten genai model's
        layers differ), as genai allocates them. head_size: the width where an input leaves its last
        dimension symbolic (default: genai_config.json's decoder.head_size beside the model).
        static_shapes: decode steps of fixed input shapes bound once (module docstring); cuda_graph:
        static shapes replayed from CUDA graphs, on the CUDA provider (which must come first)."""
        self.model_name = "the model" if isinstance(model, bytes) else os.fspath(model)
        if cuda_graph:
            providers = _graph_providers(providers)
        try:
            super().__init__(model, providers, threads, options)
        except Exception as e:
            # ORT's refusal of graphs: nodes off the CUDA provider (copies between them), control flow
            if cuda_graph and re.search(r"graph capture|cuda graph", str(e), re.I):
                raise ValueError(f"{self.model_name}: ONNX Runtime cannot run it from CUDA graphs: {e}") from e
            raise
        self.max_length = int(max_length)
        positions = self.session.get_modelmeta().custom_metadata_map.get("turboquant.rotary_positions")
        if positions is not None and self.max_length > int(positions):  # (positions past the tables: refused or clamped)
            raise ValueError(f"{self.model_name}: max_length {self.max_length} is more than the {positions} positions of "
                             "the rotary tables the rewrite gave its attention ops (python -m turboquant.export "
                             "--rotary-positions N)")
        self.head_size = head_size or self._config_head_size(pathlib.Path(model))
        self.device = ("cuda", 0) if self.on_cuda else ("cpu", 0)
        self.cache_shapes: dict[str, tuple[int, int]] = {}  # input name -> (kv heads, row width)
        for arg in self.cache_inputs.values():
            heads, last = arg.shape[1], arg.shape[3]
            last = last if isinstance(last, int) else self.head_size
            if not isinstance(heads, int) or not isinstance(last, int):
                raise ValueError(f"cache input {arg.name} has symbolic dims {arg.shape}; pass head_size")
            self.cache_shapes[arg.name] = (heads, last)
        self._input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.cuda_graph = bool(cuda_graph)
        self.static_shapes = bool(static_shapes) or self.cuda_graph
        self._binding: _Binding | None = None
        self._dynamic: tuple | None = None  # (ids of the cache's OrtValues, IOBinding, the OrtValues)
        self._next_graph = 1  # ORT reserves annotation id 0
        self._prompt_options = None
        if self.static_shapes:
            self._check_static()
        if self.cuda_graph:
            self._prompt_options = ort.RunOptions()
            self._prompt_options.add_run_config_entry("gpu_graph_id", _NO_GRAPH)

    def _check_static(self) -> None:
        if self.cuda_graph and not self.on_cuda:  # ORT fell back to the CPU (no GPU, or CUDA libraries missing)
            raise ValueError(f"{self.model_name}: cuda_graph needs the CUDA provider; the session runs on "
                             f"{self.session.get_providers()[0]}")
        meta = self.session.get_modelmeta().custom_metadata_map
        # an export without position_ids makes its own from the mask (a cumsum) or the past's length (the
        # mask's width), which a static mask moves; genai models rotate inside the op, at their lengths
        if meta.get("turboquant.cache") == "in-place" and "position_ids" not in self.input_names:
            raise ValueError(f"{self.model_name}: static shapes need a position_ids input (this export's positions "
                             "would come from attention_mask or its width, which a mask as wide as the buffers moves)")
        outs = {o.name: o for o in self.session.get_outputs()}
        logits = outs[self.logits_name]
        if logits.type not in _NP or not isinstance(logits.shape[-1], int):
            raise ValueError(f"{self.model_name}: static shapes need logits of a fixed vocabulary and float type; "
                             f"{logits.name} is {logits.type} {logits.shape}")
        if self.state_inputs:  # bound once, a state input would read its first value every step
            raise ValueError(f"{self.model_name}: static shapes bind the KV caches only; the model also takes the "
                             f"states {sorted(self.state_inputs)[:4]}")
        other = [n for n in outs if n != self.logits_name and n not in self.cache_outputs.values()]
        if other and self.cuda_graph:  # a replay writes only buffers bound before the capture
            raise ValueError(f"{self.model_name}: cuda_graph binds logits and the caches only; the model also "
                             f"outputs {other}")

    @staticmethod
    def _config_head_size(model: pathlib.Path) -> int | None:
        config = model.parent / "genai_config.json"
        if not config.is_file():
            return None
        return json.loads(config.read_text())["model"]["decoder"].get("head_size")

    def empty_cache(self, batch: int = 1) -> dict:
        """Zeroed buffers [batch, kv_heads, max_length, W], each input's own (genai zeroes its buffers too).
        cuda_graph: the buffers of the last decode step's binding where they have this batch and
        max_length, as they are (no step reads a row past its sequence's length), so that another
        generation replays the graph captured on them."""
        self.release()
        bound = self._binding
        if self.cuda_graph and bound is not None and bound.key[0] == batch and bound.rows == self.max_length:
            return dict(bound.cache)
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
        lengths - S of their sequence (GroupQueryAttention's convention, as onnxruntime-genai feeds it).
        With static shapes a one-token step after a prompt takes the static inputs; prompts and
        chunks of several tokens take inputs of their own shapes. A hybrid's state inputs (conv,
        recurrent) are not shared buffers: each step writes new ones, which the cache then holds."""
        b, s = input_ids.shape
        if past_len + s > self.max_length:
            raise ValueError(f"{past_len + s} tokens do not fit the buffers' max_length {self.max_length}")
        if self.static_shapes and s == 1 and past_len > 0:
            return self._static_step(input_ids, cache, past_len, lengths), cache
        feeds = self.feeds(input_ids, {n: cache[n] for n in self.state_outputs if n in cache}, past_len)
        if lengths is not None:
            if self.state_inputs and (np.asarray(lengths) != past_len + s).any():
                raise ValueError(f"{self.model_name}: padded sequences would run their padding through the model's "
                                 f"states {sorted(self.state_inputs)[:2]}")
            feeds.update(self._padded(np.asarray(lengths, np.int64), b, s, past_len))
        io = self._dynamic_binding(cache)
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):  # a state the last step wrote
                io.bind_ortvalue_input(name, value)
            else:
                io.bind_cpu_input(name, np.ascontiguousarray(value))
        io.bind_output(self.logits_name, "cpu")
        states = {o: ort.OrtValue.ortvalue_from_shape_and_type((b, *self.state_inputs[n].shape[1:]),
                                                                _NP[self.state_inputs[n].type], *self.device)
                  for n, o in self.state_outputs.items()}
        for name in self.output_names:
            if name in states:
                io.bind_ortvalue_output(name, states[name])
            elif name != self.logits_name and name not in self.cache_outputs.values():
                io.bind_output(name, self.device[0])
        self.session.run_with_iobinding(io, self._prompt_options)
        cache.update({n: states[o] for n, o in self.state_outputs.items()})
        return io.get_outputs_as_ortvaluevector()[0].numpy(), cache  # (get_outputs wraps every cache output too)

    def _dynamic_binding(self, cache: dict) -> ort.IOBinding:
        """The binding of steps of any shape on these cache buffers, kept from step to step (binding
        every layer's two buffers costs the host a few hundred us a step); the other inputs and outputs
        are bound again by each step, replacing the last step's. It holds the buffers until
        another cache is stepped on, empty_cache or release."""
        values = [cache[arg.name] for arg in self.cache_inputs.values()]
        key = tuple(map(id, values))  # ids of values held below, so not reused by others meanwhile
        if self._dynamic is None or self._dynamic[0] != key:
            self._dynamic = None
            io = self.session.io_binding()
            io.bind_output(self.logits_name, "cpu")  # first: get_outputs() follows the binding order
            self._bind_cache(io, cache)
            self._dynamic = (key, io, values)
        return self._dynamic[1]

    def release(self) -> None:
        """Lets go of the cache buffers the last steps' binding holds (empty_cache does too), so that
        a cache the caller dropped is freed before another is allocated."""
        self._dynamic = None

    def _bind_cache(self, io: ort.IOBinding, cache: dict) -> None:
        for key, arg in self.cache_inputs.items():
            io.bind_ortvalue_input(arg.name, cache[arg.name])
            io.bind_ortvalue_output(self.cache_outputs[key], cache[arg.name])

    def _static_step(self, input_ids: np.ndarray, cache: dict, past_len: int, lengths) -> np.ndarray:
        b = input_ids.shape[0]
        lengths = np.full(b, past_len + 1, np.int64) if lengths is None else np.asarray(lengths, np.int64)
        bound = self._bind_static(b, cache)
        if (lengths > bound.rows).any():
            raise ValueError(f"lengths {lengths.tolist()} do not fit the buffers' {bound.rows} rows")
        feeds = self.feeds(input_ids, {}, past_len)
        feeds.update(self._padded(lengths, b, 1, past_len, width=bound.rows))
        for name, value in bound.inputs.items():
            value.update_inplace(np.ascontiguousarray(feeds[name], dtype=_TYPES[self._input_types[name]]))
        try:
            self.session.run_with_iobinding(bound.io, bound.run_options)
        except Exception as e:
            if bound.graph_id is not None and not bound.ran:
                raise ValueError(f"{self.model_name}: ONNX Runtime could not capture the decode step in a CUDA "
                                 f"graph: {e}") from e
            raise
        bound.ran = True
        logits = bound.logits.numpy()
        return logits if self.on_cuda else logits.copy()  # on the CPU numpy() is the buffer, rewritten next step

    def _bind_static(self, b: int, cache: dict) -> _Binding:
        """The binding for a batch of b on these cache buffers: the last one, or a new one (and a
        new graph) where the batch or the buffers differ."""
        key = (b, tuple(cache[arg.name].data_ptr() for arg in self.cache_inputs.values()))
        if self._binding is not None and self._binding.key == key:
            return self._binding
        self._release()
        rows = cache[next(iter(self.cache_inputs.values())).name].shape()[2]
        io = self.session.io_binding()
        inputs = {}
        for name, value in self.feeds(np.zeros((b, 1), np.int64), {}, rows - 1).items():  # the static shapes
            dtype = _TYPES.get(self._input_types[name])
            if dtype is None:
                raise ValueError(f"{self.model_name}: input {name} is {self._input_types[name]}, "
                                 "which static shapes do not feed")
            inputs[name] = ort.OrtValue.ortvalue_from_shape_and_type(np.shape(value), dtype, *self.device)
            io.bind_ortvalue_input(name, inputs[name])
        out = next(o for o in self.session.get_outputs() if o.name == self.logits_name)
        logits = ort.OrtValue.ortvalue_from_shape_and_type((b, 1, out.shape[-1]), _NP[out.type], *self.device)
        io.bind_ortvalue_output(self.logits_name, logits)
        self._bind_cache(io, cache)
        for name in self.output_names:  # none with cuda_graph (_check_static)
            if name != self.logits_name and name not in self.cache_outputs.values():
                io.bind_output(name, self.device[0])
        bound = _Binding(key, io, inputs, logits, {arg.name: cache[arg.name] for arg in self.cache_inputs.values()})
        if self.cuda_graph:
            # ids never reused: ORT may keep an old graph, which would replay onto freed buffers
            bound.graph_id, self._next_graph = self._next_graph, self._next_graph + 1
            bound.run_options = ort.RunOptions()
            bound.run_options.add_run_config_entry("gpu_graph_id", str(bound.graph_id))
        self._binding = bound
        return bound

    def _release(self) -> None:
        """Lets the last binding go, and its graph where this ORT can release one."""
        bound, self._binding = self._binding, None
        if bound is None or bound.graph_id is None or not bound.ran:
            return
        if hasattr(self.session, "release_captured_graph"):  # not in every ORT release
            self.session.release_captured_graph(bound.graph_id)

    def _padded(self, lengths: np.ndarray, b: int, s: int, past_len: int, width: int | None = None) -> dict:
        """The mask (width columns, default past_len + s) and positions of sequences of these lengths."""
        total = past_len + s
        if lengths.shape != (b,) or (lengths > total).any() or (lengths < (1 if past_len == 0 else s)).any():
            raise ValueError(f"lengths must be {b} counts in [{1 if past_len == 0 else s}, {total}], got {lengths.tolist()}")
        feeds = {}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = self._masks.padded(lengths, width or total)
        if "position_ids" in self.input_names:
            start = np.zeros(b, np.int64) if past_len == 0 else lengths - s
            positions = start[:, None] + np.arange(s, dtype=np.int64)[None]
            feeds["position_ids"] = np.broadcast_to(positions, (3, b, s)).copy() if self._mrope else positions
        return feeds

    def buffers(self, cache: dict) -> dict[str, np.ndarray]:
        """Host copies of the cache buffers."""
        return {name: np.array(v.numpy(), copy=True) for name, v in cache.items()}


def _graph_providers(providers: Sequence) -> list:
    """providers with enable_cuda_graph set on the CUDA provider, which must come first (ORT captures
    the graph of the first provider's nodes)."""
    providers = list(providers)
    names = [p if isinstance(p, str) else p[0] for p in providers]
    if not names or names[0] != "CUDAExecutionProvider":
        raise ValueError(f"cuda_graph needs CUDAExecutionProvider as the first provider, got {names}")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ValueError("cuda_graph needs the CUDA provider, which this onnxruntime lacks "
                         f"({', '.join(ort.get_available_providers())}; install onnxruntime-gpu)")
    first = providers[0]
    options = {} if isinstance(first, str) else dict(first[1])
    return [("CUDAExecutionProvider", {**options, "enable_cuda_graph": "1"}), *providers[1:]]
