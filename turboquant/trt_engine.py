"""A decoder engine (turboquant.tensorrt.build_engine's) run on the GPU, and checked against the same
rewrite in ONNX Runtime.

    dec = EngineDecoder("model.plan")
    cache = dec.empty_cache(batch=1, capacity=512)      # device buffers, the engine's packed int8 type
    logits = dec.run(feeds, cache)                       # feeds: numpy inputs of one step (ids, mask, positions)

The cache buffers [B, Hkv, capacity, W] are bound as past_key_values.N.* and, where the engine's
present.N.* has the same shape (TQGroupQueryAttention: present aliases past), as present.N.* too:
each step writes its new rows in place, as onnxruntime-genai and turboquant's SharedBufferDecoder do.
Buffers are torch tensors on the CUDA device (torch with CUDA is needed).
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from . import tensorrt as tq_trt


class EngineDecoder:
    def __init__(self, engine: bytes | str | os.PathLike, runtime: str = "auto"):
        import torch

        self.torch = torch
        trt = self.trt = tq_trt.trt_module(runtime)
        self.log = tq_trt._Log(trt)
        self.runtime = trt.Runtime(self.log)
        self._plugins = tq_trt.load_plugins(self.runtime.get_plugin_registry(), trt=trt)  # alive while the engine is
        data = engine if isinstance(engine, (bytes, bytearray)) else pathlib.Path(engine).read_bytes()
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise tq_trt.EngineBuildError("TensorRT could not deserialize the engine: " + " | ".join(self.log.errors[:3]))
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise tq_trt.EngineBuildError("TensorRT could not make an execution context: " + " | ".join(self.log.errors[:3]))
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == mode]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) != mode]
        self.cache_inputs = [n for n in self.inputs if n.startswith("past_key_values.") or n.startswith("past_")]
        self.logits_name = "logits" if "logits" in self.outputs else self.outputs[0]
        self._types = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                       trt.int8: torch.int8, trt.uint8: torch.uint8, trt.int32: torch.int32, trt.int64: torch.int64,
                       trt.bool: torch.bool}
        self.stream = torch.cuda.Stream()

    def dtype(self, name: str):
        return self._types[self.engine.get_tensor_dtype(name)]

    @staticmethod
    def present_of(name: str) -> str:
        return name.replace("past_key_values.", "present.", 1)

    def empty_cache(self, batch: int, capacity: int) -> dict:
        """Zeroed device buffers [batch, Hkv, capacity, W], each cache input's own type and width."""
        cache = {}
        for n in self.cache_inputs:
            shape = list(self.engine.get_tensor_shape(n))
            cache[n] = self.torch.zeros((batch, shape[1], capacity, shape[3]), dtype=self.dtype(n), device="cuda")
        return cache

    def run(self, feeds: dict, cache: dict) -> np.ndarray:
        """One step: feeds (numpy, every input but the caches) copied to the device, the caches bound in
        place (present to past's buffer where the shapes agree; else present is a new buffer, which
        replaces the cache's entry); returns the logits on the host."""
        torch, ctx = self.torch, self.context
        keep = []
        for name in self.inputs:
            if name in cache:
                t = cache[name]
            elif name in feeds:
                value = np.ascontiguousarray(feeds[name])
                if self.engine.is_shape_inference_io(name):  # a shape tensor: TensorRT reads it on the host
                    keep.append(value)
                    ctx.set_input_shape(name, value.shape)
                    ctx.set_tensor_address(name, value.ctypes.data)
                    continue
                t = torch.from_numpy(value).to("cuda").to(self.dtype(name))
            else:
                raise ValueError(f"the engine's input {name!r} is neither fed nor a cache")
            keep.append(t)
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise ValueError(f"input {name} of shape {tuple(t.shape)} is outside the engine's profile")
            ctx.set_tensor_address(name, t.data_ptr())
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            past = name.replace("present.", "past_key_values.", 1)
            if past in cache and tuple(cache[past].shape) == shape:
                outs[name] = cache[past]  # aliased: written in place
            else:
                outs[name] = torch.empty(shape, dtype=self.dtype(name), device="cuda")
            ctx.set_tensor_address(name, outs[name].data_ptr())
        torch.cuda.synchronize()
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed: " + " | ".join(self.log.errors[-3:]))
        self.stream.synchronize()
        for name in self.outputs:
            past = name.replace("present.", "past_key_values.", 1)
            if past in cache and outs[name] is not cache[past]:
                cache[past] = outs[name]  # the concat form: present is the next step's past
        return outs[self.logits_name].float().cpu().numpy()


def check_against_onnxruntime(ort_model: str | os.PathLike, engine: EngineDecoder, prompt: np.ndarray, steps: int,
                              capacity: int, log=print, providers=("CUDAExecutionProvider",)) -> dict:
    """A prompt then `steps` greedy decode steps through the engine and through ort_model (the same
    rewrite for ONNX Runtime, on its CUDA provider, its caches shared buffers as well); returns the
    largest logit difference of each step (relative to the logits' scale) and both token sequences."""
    from .shared_buffer import SharedBufferDecoder

    ref = SharedBufferDecoder(ort_model, max_length=capacity, providers=list(providers))
    if ref.session.get_providers()[0] != providers[0]:
        raise RuntimeError(f"ONNX Runtime runs {ort_model} on {ref.session.get_providers()}, not {providers[0]}")
    b, s = prompt.shape
    ref_cache, cache = ref.empty_cache(b), engine.empty_cache(b, capacity)
    ids_ref = ids_trt = prompt
    past = 0
    diffs, tokens_ref, tokens_trt = [], [], []
    for step in range(steps + 1):
        feeds = ref.feeds(ids_trt, {}, past)
        want, ref_cache = ref.step(ids_ref, ref_cache, past)
        got = engine.run(feeds, cache)
        w, g = want[:, -1].astype(np.float32), got[:, -1].astype(np.float32)
        diffs.append(float(np.abs(w - g).max() / max(np.abs(w).max(), 1e-6)))
        next_ref, next_trt = w.argmax(-1)[:, None], g.argmax(-1)[:, None]
        tokens_ref.append(next_ref[:, 0].tolist())
        tokens_trt.append(next_trt[:, 0].tolist())
        log(f"step {step} ({'prompt of ' + str(s) if step == 0 else 'decode'}): max |logits difference| / max |logit| "
            f"{diffs[-1]:.2e}, tokens ORT {tokens_ref[-1]} engine {tokens_trt[-1]}")
        past += ids_ref.shape[1]
        ids_ref, ids_trt = next_ref, next_trt
    return {"relative_diffs": diffs, "tokens_ort": tokens_ref, "tokens_engine": tokens_trt}
