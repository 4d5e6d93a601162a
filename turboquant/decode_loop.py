"""Which decode loop a model's caches take: SharedBufferDecoder (turboquant.shared_buffer) or
DecoderSession (turboquant.decoder)."""

from __future__ import annotations

import os

from . import decoder
from .shared_buffer import SharedBufferDecoder


def open_decoder(model: str | os.PathLike, max_length: int, **kwargs) -> decoder.DecoderSession:
    """The loop a model's caches take: SharedBufferDecoder (buffers of max_length rows written in
    place: onnxruntime-genai models, rewrites with --cache in-place) or DecoderSession (growing
    caches). kwargs: providers, threads, options; static_shapes and cuda_graph (SharedBufferDecoder only)."""
    import onnx

    graph = onnx.load(os.fspath(model), load_external_data=False).graph
    if any(n.op_type in ("GroupQueryAttention", "TQGroupQueryAttention") for n in graph.node):
        return SharedBufferDecoder(model, max_length, **kwargs)
    asked = [k for k in ("static_shapes", "cuda_graph") if kwargs.pop(k, False)]
    if asked:
        raise ValueError(f"{model}: {' and '.join(asked)} need caches written in place (SharedBufferDecoder); "
                         "this model's grow each step (DecoderSession)")
    return decoder.DecoderSession(model, **kwargs)  # looked up at the call, as callers that wrap it expect
