"""Running a paged onnxruntime-genai folder (PagedAttention, or turboquant's TQPagedAttention after
the rewrite) the way genai's continuous-batching Engine does, with plain ONNX Runtime: the
reference path that og.Engine's tokens are compared against, and the rewrite's check of a paged
folder on machines where the Engine cannot run it.

As the Engine (src/engine: paged_key_value_cache.cpp, decoders/varlen_decoder_io.cpp): every pool
pair `past_key_names % i` / `past_value_names % i`, i < num_hidden_layers, is allocated once as
[num_blocks, block_size, num_key_value_heads, head_size] of the first past input's type (all from
genai_config.json), bound as both the past input and the present output of every step; a step
packs the unprocessed tokens of every scheduled request back to back (input_ids [num_tokens]),
with cumulative_sequence_lengths [B + 1], past_sequence_lengths [B] (tokens already in the pools),
block_table [B, max_blocks] (-1 past each request's blocks) and, where the model takes it,
attention_metadata [3] (the longest query, the longest sequence twice). A request gets a block
whenever its tokens pass its last one and gives its blocks back when it ends. Requests may join at
later steps (a prompt beside other requests' decode steps), as the Engine schedules them.

    dec = PagedDecoder("folder/model.onnx", num_blocks=64)
    tokens = dec.generate([prompt_a, prompt_b], max_new_tokens=16, joins=[0, 3])
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(uint8)": np.uint8,
       "tensor(int8)": np.int8}


@dataclasses.dataclass
class _Request:
    tokens: list[int]  # prompt and generated so far
    prompt: int
    new: int  # tokens to generate
    join: int  # the step at which it is first scheduled
    processed: int = 0  # tokens in the pools
    blocks: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # the last row of each of its steps

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt >= self.new


class PagedDecoder:
    def __init__(self, model: str | os.PathLike, num_blocks: int, block_size: int | None = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",), threads: int | None = None):
        """model: the .onnx of a paged genai folder (genai_config.json beside it). num_blocks: blocks
        per pool; block_size: genai_config's engine.dynamic_batching.block_size unless given. The
        folder's custom_ops_library (turboquant's, after the rewrite) is registered."""
        path = pathlib.Path(model)
        config = json.loads((path.parent / "genai_config.json").read_text())
        dec = config["model"]["decoder"]
        self.inputs, self.outputs = dec["inputs"], dec["outputs"]
        self.block_size = int(block_size or config["engine"]["dynamic_batching"]["block_size"])
        self.num_blocks = int(num_blocks)
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = int(threads)
        library = dec.get("session_options", {}).get("custom_ops_library")
        if library:
            so.register_custom_ops_library(str(path.parent / library))
        self.session = ort.InferenceSession(str(path), so, providers=list(providers))
        names = {i.name: i for i in self.session.get_inputs()}
        first = self.inputs["past_key_names"] % 0
        if first not in names:
            raise ValueError(f"{path}: no input {first!r} (genai_config.json's past_key_names)")
        dtype = _NP[names[first].type]
        shape = (self.num_blocks, self.block_size, int(dec["num_key_value_heads"]), int(dec["head_size"]))
        self.device = "cuda" if "CUDAExecutionProvider" in self.session.get_providers() else "cpu"
        self.pools = {}
        for i in range(int(dec["num_hidden_layers"])):
            for kind in ("key", "value"):
                past = self.inputs[f"past_{kind}_names"] % i
                present = self.outputs[f"present_{kind}_names"] % i
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, self.device, 0)
                if self.device == "cpu":  # fresh pools hold zeros, as the Engine's arena need not: unread either way
                    value.update_inplace(np.zeros(shape, dtype))
                self.pools[(past, present)] = value
        self.metadata = self.inputs.get("attention_metadata") in names
        self.free = list(range(self.num_blocks))

    def _blocks_for(self, r: _Request, total: int) -> None:
        while len(r.blocks) * self.block_size < total:
            if not self.free:
                raise RuntimeError(f"the pool's {self.num_blocks} blocks of {self.block_size} are all taken")
            r.blocks.append(self.free.pop(0))

    def step(self, batch: list[_Request]) -> np.ndarray:
        """One run over the batch's unprocessed tokens; returns each request's last logits row [B, V]."""
        news = [r.tokens[r.processed:] for r in batch]
        cu = np.concatenate([[0], np.cumsum([len(n) for n in news])]).astype(np.int32)
        past = np.array([r.processed for r in batch], np.int32)
        for r, n in zip(batch, news):
            self._blocks_for(r, r.processed + len(n))
        width = max(len(r.blocks) for r in batch)
        table = np.full((len(batch), width), -1, np.int32)
        for b, r in enumerate(batch):
            table[b, :len(r.blocks)] = r.blocks
        feeds = {self.inputs["input_ids"]: np.concatenate(news).astype(np.int64),
                 self.inputs["cumulative_sequence_lengths"]: cu,
                 self.inputs["past_sequence_lengths"]: past,
                 self.inputs["block_table"]: table}
        if self.metadata:
            longest = int((past + np.diff(cu)).max())
            feeds[self.inputs["attention_metadata"]] = np.array([int(np.diff(cu).max()), longest, longest], np.int32)
        io = self.session.io_binding()
        for name, x in feeds.items():
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(x, self.device, 0)
                                   if name != self.inputs.get("attention_metadata") else ort.OrtValue.ortvalue_from_numpy(x))
        io.bind_output(self.outputs["logits"], "cpu")  # first: copy_outputs_to_cpu's [0]
        for (past_name, present_name), value in self.pools.items():
            io.bind_ortvalue_input(past_name, value)
            io.bind_ortvalue_output(present_name, value)  # in place, as the Engine binds them
        self.session.run_with_iobinding(io)
        logits = io.copy_outputs_to_cpu()[0]
        for r, n in zip(batch, news):
            r.processed += len(n)
        # one row per token (the builder's paged models) or one per request
        rows = cu[1:] - 1 if logits.shape[0] == cu[-1] else np.arange(len(batch))
        return np.asarray(logits[rows], np.float32)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 joins: Sequence[int] | None = None, keep_logits: bool = False):
        """Greedy tokens of each prompt (its new ones only); requests join at the steps `joins`
        (default all at step 0) and leave when they have their tokens. keep_logits: also return each
        request's logits rows, one per step it took part in ([steps, V])."""
        news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        joins = list(joins) if joins is not None else [0] * len(prompts)
        requests = [_Request([int(t) for t in p], len(p), n, j) for p, n, j in zip(prompts, news, joins)]
        if any(r.prompt == 0 for r in requests):
            raise ValueError("every prompt needs at least one token")
        step = 0
        while not all(r.done for r in requests):
            batch = [r for r in requests if r.join <= step and not r.done]
            if batch:
                rows = self.step(batch)
                for r, row in zip(batch, rows):
                    r.tokens.append(int(row.argmax()))
                    if keep_logits:
                        r.logits.append(row)
                    if r.done:
                        self.free += r.blocks
                        r.blocks = []
            step += 1
        tokens = [r.tokens[r.prompt:] for r in requests]
        if keep_logits:
            return tokens, [np.stack(r.logits) for r in requests]
        return tokens
