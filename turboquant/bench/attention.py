"""Decode-step timing of TQAttention against ONNX Runtime's CPU attention, in one process.

Every candidate runs the same shape (one new token over a cache of S tokens) with the same
intra-op thread count; the baselines are measured in the same run, and the report gives each
preset's speed-up over each baseline (baseline time / TQAttention time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from .. import node_models
from ..config import TQ_PRESETS, TurboQuantConfig, check_head_dim
from ..ort import inference_session
from ..reference import formats
from ..saving import save_new_figure
from . import baselines


@dataclasses.dataclass
class Shape:
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    context: int = 8192

    def __post_init__(self):
        # ORT's GroupQueryAttention baseline dies on a zero batch (SIGFPE), and the formats need their head sizes
        for field in ("batch", "q_heads", "kv_heads", "context"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be a positive count, got {getattr(self, field)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")
        check_head_dim(self.head_dim)


def need_bytes(shape: Shape) -> int:
    """Host bytes of the largest candidate at its peak: an fp32 baseline's K and V caches fed to ORT
    and the present K and V it returns (drawn as float64 first: no more than those)."""
    return 16 * shape.batch * shape.kv_heads * shape.context * shape.head_dim


@dataclasses.dataclass
class Result:
    name: str
    context: int
    ms: float | None
    bytes_read: int | None = None
    error: str | None = None


def time_session(sess: ort.InferenceSession, feeds: dict, repeat: int, warmup: int = 3) -> float:
    """Median milliseconds of sess.run over `repeat` runs."""
    for _ in range(warmup):
        sess.run(None, feeds)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def tq_candidate(preset: str, shape: Shape, threads: int, rng) -> tuple[ort.InferenceSession, dict, int]:
    cfg = TurboQuantConfig.from_cache_dtype(preset, shape.head_dim)
    b, hq, hkv, d, s = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.context
    model = node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                                   value_format=cfg.value_format, dtype=TensorProto.FLOAT16,
                                   norm_correction=int(cfg.norm_correction), is_causal=1)
    # Packing a long random cache in numpy is slow; tile a short one (timing does not depend on values).
    unit = min(s, 512)
    reps = -(-s // unit)
    pk = np.tile(formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), cfg.key_format, cfg.norm_correction), (1, 1, reps, 1))[:, :, :s]
    pv = np.tile(formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), cfg.value_format), (1, 1, reps, 1))[:, :, :s]
    feeds = {"Q": rng.standard_normal((b, hq, 1, d)).astype(np.float16), "K": rng.standard_normal((b, hkv, 1, d)).astype(np.float16),
             "V": rng.standard_normal((b, hkv, 1, d)).astype(np.float16),
             "past_key": np.ascontiguousarray(pk), "past_value": np.ascontiguousarray(pv)}
    return inference_session(model, threads=threads), feeds, b * hkv * s * cfg.slot_size


def baseline_candidates(shape: Shape, threads: int, rng):
    b, hq, hkv, d, s = shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.context
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    gqa = (baselines.gqa_model, baselines.gqa_feeds)
    att23 = (baselines.attention23_model, baselines.attention23_feeds)
    for name, (build, feed), dtype, cache in [
        ("ort_gqa_fp32", gqa, TensorProto.FLOAT, None),
        ("ort_gqa_fp16", gqa, TensorProto.FLOAT16, None),
        # ORT's own quantized caches (fp16 queries), where this build has them
        *[(f"ort_gqa_{c}", gqa, TensorProto.FLOAT16, c) for c in baselines.QUANT_CACHES],
        ("ort_attention23_fp32", att23, TensorProto.FLOAT, None),
        ("ort_attention23_fp16", att23, TensorProto.FLOAT16, None),
    ]:
        extra = {"cache": cache} if cache else {}
        try:
            sess = ort.InferenceSession(build(hq, hkv, d, dtype, **extra).SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            feeds = feed(rng, b, hq, hkv, d, s, dtype, **extra)
            sess.run(None, feeds)  # a kernel this build lacks may only fail here
            yield name, sess, feeds, 2 * b * hkv * s * baselines.cache_bytes_per_row(d, dtype, cache), None
        except Exception as e:  # noqa: BLE001 - a baseline this ORT build lacks is reported, not fatal
            yield name, None, None, None, str(e).splitlines()[0][:160]


def run_cpu(shape: Shape, presets: list[str], threads: int, repeat: int, seed: int = 0) -> list[Result]:
    rng = np.random.default_rng(seed)
    results = []
    for name, sess, feeds, nbytes, err in baseline_candidates(shape, threads, rng):
        if sess is None:
            results.append(Result(name, shape.context, None, error=err))
            continue
        results.append(Result(name, shape.context, time_session(sess, feeds, repeat), nbytes))
        del sess, feeds
    for preset in presets:
        sess, feeds, nbytes = tq_candidate(preset, shape, threads, rng)
        results.append(Result(preset, shape.context, time_session(sess, feeds, repeat), nbytes))
    return results


def report(results: list[Result], threads: int) -> str:
    base = [r for r in results if r.name.startswith("ort_") and r.ms]
    tq = [r for r in results if r.name in TQ_PRESETS]
    lines = [f"threads={threads}"]
    header = f"{'candidate':<24}{'S':>7}{'ms/step':>10}{'GB/s':>8}" + "".join(f"  {'x vs ' + b.name[4:]:>22}" for b in base)
    lines.append(header)
    for r in results:
        if r.ms is None:
            lines.append(f"{r.name:<24}{r.context:>7}  unavailable: {r.error}")
            continue
        gbs = r.bytes_read / r.ms / 1e6 if r.bytes_read else float("nan")
        row = f"{r.name:<24}{r.context:>7}{r.ms:>10.3f}{gbs:>8.1f}"
        if r in tq:
            row += "".join(f"  {b.ms / r.ms:>22.2f}" for b in base)
        lines.append(row)
    if base and tq:
        fastest = min(base, key=lambda r: r.ms)
        lines.append(f"fastest ORT baseline: {fastest.name} ({fastest.ms:.3f} ms)")
        for r in tq:
            lines.append(f"speed-up of {r.name} over the fastest ORT baseline: {fastest.ms / r.ms:.2f}x")
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.name for r in results):
        pts = sorted((r.context, r.ms) for r in results if r.name == name and r.ms)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name, linestyle="-" if name in TQ_PRESETS else "--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens in the cache)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("CPU decode attention, one new token")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        save_new_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)
