"""Decode-step timing on the GPU, in one process with IO binding and device-resident tensors:
TQAttention (CUDA execution provider) for each preset against ORT's fp16 GroupQueryAttention
(past and present sharing one buffer, as onnxruntime-genai runs it) and torch SDPA when torch is
present, with the achieved bandwidth (bytes of cache read / time) as a fraction of a
device-to-device copy measured in the same run.

Two times per step and candidate (cuda_record.Timing): `waited_us`, a step run and waited for (Run
with IO binding, then the outputs synchronised: the per-call cost of ONNX Runtime's Run on a one-node
graph included), and `back_to_back_us`, the GPU time of a step: steps run back to back without
waiting in between (ORT's end-of-run stream synchronisation turned off,
`disable_synchronize_execution_providers`), the union of their kernels' and copies' intervals / steps
(gpu_time.py): what the kernels of a step take on the GPU, as the layers of a real model's step
follow each other while the host runs ahead. Without torch (whose profiler records them), the wall
time of the back-to-back steps / steps, which measures the host where its per-Run cost exceeds the
step's GPU work. torch SDPA is timed back to back only.

Note: TQAttention has ONNX Attention's semantics, so each call also writes a new present cache
(past ++ new): a copy of the whole packed cache, which its time includes. TQGroupQueryAttention
(the `_inplace` columns) writes the new token into a shared buffer in place, as genai runs it.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from .. import node_models
from ..config import TurboQuantConfig, packed_size
from ..ort import session_options
from ..reference import formats
from . import baselines, gpu_time


def _device_value(a: np.ndarray, device: str = "cuda") -> ort.OrtValue:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.float8_e4m3fn:  # numpy has no fp8: its bytes typed for ONNX, copied over
        host = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint8), TensorProto.FLOAT8E4M3FN)
        dev = ort.OrtValue.ortvalue_from_shape_and_type(a.shape, TensorProto.FLOAT8E4M3FN, device, 0)
        dev.update_inplace(host)
        return dev
    return ort.OrtValue.ortvalue_from_numpy(a, device, 0)


_first_back_to_back = True


def time_iobinding(sess, io, iters: int) -> tuple[float, float]:
    """Seconds per step: the median of steps each waited for, and the GPU time of steps run back to
    back (the stream synchronised once, at the end; their wall time without torch)."""
    for _ in range(5):
        sess.run_with_iobinding(io)
    io.synchronize_outputs()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        times.append(time.perf_counter() - t0)
    back_to_back = ort.RunOptions()
    back_to_back.add_run_config_entry("disable_synchronize_execution_providers", "1")
    for _ in range(3):
        sess.run_with_iobinding(io, back_to_back)
    io.synchronize_outputs()
    # a process's first timed back-to-back sequence runs several times slower (seen on an H200 with
    # ORT 1.31, whichever op comes first): that one is timed twice, the second kept
    global _first_back_to_back
    for _ in range(2 if _first_back_to_back else 1):
        t0 = time.perf_counter()
        for _ in range(iters):
            sess.run_with_iobinding(io, back_to_back)
        io.synchronize_outputs()
        per_step = (time.perf_counter() - t0) / iters
    _first_back_to_back = False

    def sequence():
        for _ in range(iters):
            sess.run_with_iobinding(io, back_to_back)
        io.synchronize_outputs()

    busy = gpu_time.busy_seconds(sequence)
    return float(np.median(times)), busy / iters if busy else per_step


RAW16 = "raw16"  # not a preset: the boundary layers' fp16 rows as a rewritten genai model keeps them


def cache_formats(preset: str, d: int) -> tuple[str, str, bool]:
    """(key format, value format, norm correction) of a preset, or of RAW16's fp16 rows."""
    if preset == RAW16:
        return RAW16, RAW16, False
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    return cfg.key_format, cfg.value_format, cfg.norm_correction


def _cuda_session(model, so, graph: bool = False):
    """A session on the CUDA provider alone; graph: ORT's CUDA graphs (enable_cuda_graph), captured
    on the first runs and replayed after, which need every output bound to a buffer of its own."""
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    provider = ("CUDAExecutionProvider", {"enable_cuda_graph": "1"}) if graph else "CUDAExecutionProvider"
    return ort.InferenceSession(model.SerializeToString(), so, providers=[provider])


def _bind_output(io, name: str, shape, graph: bool) -> None:
    if graph:
        io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_shape_and_type(shape, TensorProto.FLOAT16, "cuda", 0))
    else:
        io.bind_output(name, "cuda")


def tq_step(preset: str, b: int, hq: int, hkv: int, d: int, s: int, iters: int, rng,
            mask: bool = False) -> tuple[tuple[float, float], int]:
    """TQAttention, its present written whole; mask: with an additive fp16 attn_mask [B, 1, 1, S + 1]
    of zeros, as a rewrite that keeps the exporter's mask runs it."""
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    model = node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                                   value_format=cfg.value_format, dtype=TensorProto.FLOAT16,
                                   norm_correction=int(cfg.norm_correction), is_causal=1,
                                   mask=TensorProto.FLOAT16 if mask else None)
    sess = _cuda_session(model, session_options())
    unit = min(s, 1024)
    reps = -(-s // unit)
    pk = np.tile(formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), cfg.key_format, cfg.norm_correction), (1, 1, reps, 1))[:, :, :s]
    pv = np.tile(formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), cfg.value_format), (1, 1, reps, 1))[:, :, :s]
    io = sess.io_binding()
    for name, a in [("Q", rng.standard_normal((b, hq, 1, d)).astype(np.float16)), ("K", rng.standard_normal((b, hkv, 1, d)).astype(np.float16)),
                    ("V", rng.standard_normal((b, hkv, 1, d)).astype(np.float16)), ("past_key", pk), ("past_value", pv),
                    *([("attn_mask", np.zeros((b, 1, 1, s + 1), np.float16))] if mask else [])]:
        io.bind_ortvalue_input(name, _device_value(a))
    for name in ("Y", "present_key", "present_value"):
        io.bind_output(name, "cuda")
    return time_iobinding(sess, io, iters), b * hkv * s * cfg.slot_size


def tq_gqa_step(preset: str, b: int, hq: int, hkv: int, d: int, s: int, iters: int, rng,
                rotary: bool = False, graph: bool = False) -> tuple[tuple[float, float], int]:
    """TQGroupQueryAttention over a shared buffer of s + 1 rows (the new token written in place, no
    cache copy), as a rewritten onnxruntime-genai model runs it; separate Q, K, V and (unless
    rotary) no rotary embedding, as in gqa_step. preset RAW16: fp16 rows; graph: under ORT's CUDA
    graphs."""
    kf, vf, nc = cache_formats(preset, d)
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=kf, value_format=vf,
                                  dtype=TensorProto.FLOAT16, norm_correction=int(nc), rotary_dim=d if rotary else 0)
    sess = _cuda_session(model, session_options(), graph)
    kb, vb = packed_size(kf, d), packed_size(vf, d)
    width = max(kb, vb)
    unit = min(s, 1024)
    reps = -(-(s + 1) // unit)
    caches = {}
    for name, fmt in (("past_key", kf), ("past_value", vf)):
        packed = formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), fmt, nc)
        buf = np.zeros((b, hkv, unit * reps, width), np.uint8)
        buf[..., :packed.shape[-1]] = np.tile(packed, (1, 1, reps, 1))
        caches[name] = _device_value(buf[:, :, :s + 1])
    io = sess.io_binding()
    for name, a in [("query", rng.standard_normal((b, 1, hq * d)).astype(np.float16)),
                    ("key", rng.standard_normal((b, 1, hkv * d)).astype(np.float16)),
                    ("value", rng.standard_normal((b, 1, hkv * d)).astype(np.float16)),
                    ("seqlens_k", np.full((b,), s, np.int32)),
                    *zip(("cos_cache", "sin_cache"), baselines.rotary_tables(s + 1, d, TensorProto.FLOAT16) if rotary else ())]:
        io.bind_ortvalue_input(name, _device_value(a))
    io.bind_ortvalue_input("total_sequence_length", ort.OrtValue.ortvalue_from_numpy(np.array(s + 1, np.int32)))
    for name, v in caches.items():
        io.bind_ortvalue_input(name, v)
    _bind_output(io, "output", (b, 1, hq * d), graph)
    io.bind_ortvalue_output("present_key", caches["past_key"])
    io.bind_ortvalue_output("present_value", caches["past_value"])
    return time_iobinding(sess, io, iters), b * hkv * s * (kb + vb)


def gqa_step(b: int, hq: int, hkv: int, d: int, s: int, iters: int, rng,
             cache: str | None = None, rotary: bool = False, graph: bool = False) -> tuple[tuple[float, float], int]:
    """ORT's GroupQueryAttention on an fp16 cache, or on its own quantized cache (cache = int8, int4,
    fp8), the new token written into a shared buffer in place; rotary: with its rotary embedding;
    graph: under ORT's CUDA graphs."""
    extra = {"cache": cache} if cache else {}
    if rotary:
        extra["rotary"] = True
    model = baselines.gqa_model(hq, hkv, d, TensorProto.FLOAT16, **extra)
    if cache or graph:  # a quantized cache this build has no CUDA kernel for must fail, not run on the CPU
        sess = _cuda_session(model, ort.SessionOptions(), graph)
    else:
        sess = ort.InferenceSession(model.SerializeToString(), ort.SessionOptions(), providers=["CUDAExecutionProvider"])
    f = baselines.gqa_feeds(rng, b, hq, hkv, d, s + 1, TensorProto.FLOAT16, **extra)
    f["seqlens_k"] = np.full((b,), s, np.int32)
    io = sess.io_binding()
    vals = {k: _device_value(v) for k, v in f.items() if k != "total_sequence_length"}
    for k, v in vals.items():
        io.bind_ortvalue_input(k, v)
    io.bind_ortvalue_input("total_sequence_length", ort.OrtValue.ortvalue_from_numpy(np.array(s + 1, np.int32)))
    _bind_output(io, "out", (b, 1, hq * d), graph)
    io.bind_ortvalue_output("present_key", vals["past_key"])  # shared buffer, updated in place
    io.bind_ortvalue_output("present_value", vals["past_value"])
    return time_iobinding(sess, io, iters), 2 * b * hkv * s * baselines.cache_bytes_per_row(d, TensorProto.FLOAT16, cache)


def torch_step(b: int, hq: int, hkv: int, d: int, s: int, iters: int):
    try:
        import torch
    except ImportError:
        return None
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    for _ in range(5):
        f()
    torch.cuda.synchronize()

    def sequence():
        for _ in range(iters):
            f()
        torch.cuda.synchronize()

    busy = gpu_time.busy_seconds(sequence)
    if busy is None:  # nothing recorded: CUDA events around the loop
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        sequence()
        en.record()
        torch.cuda.synchronize()
        busy = st.elapsed_time(en) / 1e3
    return busy / iters, 2 * b * hkv * s * d * 2


def copy_bandwidth() -> float | None:
    """Bytes read plus written per second of a large device-to-device copy."""
    try:
        import torch
    except ImportError:
        return None
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(10):
        y.copy_(x)
    en.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (st.elapsed_time(en) / 1e3)
