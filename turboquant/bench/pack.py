"""TQPack throughput: fp16 vectors in, packed bytes out, against a plain copy measured in the same
process (on the GPU a device-to-device copy, on the CPU a numpy copy of the same kind of buffer).

The fraction reported is (bytes read + bytes written) / time, over the copy's (bytes read + bytes
written) / time: a pack at 0.5 moves its data at half the speed of copying it. On the GPU two times
per format, as the attention bench takes them (cuda.time_iobinding): a call run and waited for
(ONNX Runtime's per-Run cost included) and calls run back to back (the GPU time of one).

    python -m turboquant.bench pack --device cuda --vectors 2097152
    python -m turboquant.bench pack --device cuda --vectors 65536 262144 2097152 --plot pack-cuda.png
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from .. import node_models
from ..config import packed_size
from ..ort import session_options
from ..saving import save_new_figure

FORMATS = ["mse4", "mse3", "fp8", "uint4", "uint3", "raw16"]  # the presets' formats, genai's uncompressed layers


def _median_seconds(run, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def need_bytes(vectors: int, head_dim: int) -> int:
    """Host bytes of a run at its peak: the input drawn as float64, then kept as fp16 (the copy's two
    buffers and a format's packed output come after the float64 is gone, and take less)."""
    return vectors * head_dim * (8 + 2)


def cpu_copy_rate(nbytes: int, repeat: int) -> float:
    """Bytes read plus written per second of a numpy copy of nbytes."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: np.copyto(dst, src), repeat)


def _session(fmt: str, d: int, device: str, threads: int | None) -> ort.InferenceSession:
    so = session_options(threads)
    providers = ["CPUExecutionProvider"]
    if device == "cuda":
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # the CUDA kernel or nothing
        providers = ["CUDAExecutionProvider"]
    model = node_models.pack_model(fmt, d, TensorProto.FLOAT16, rank=2)
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers)


def run(device: str, vectors: int, head_dim: int = 128, threads: int | None = None, repeat: int = 20,
        formats: list[str] | None = None, seed: int = 0) -> list[dict]:
    """One row per format: seconds per TQPack call over `vectors` vectors, bytes moved, and the
    fraction of the copy rate measured in the same run."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((vectors, head_dim)).astype(np.float16)
    if device == "cuda":
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        from .cuda_steps import copy_bandwidth

        rate = copy_bandwidth()
        x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    else:
        rate = cpu_copy_rate(x.nbytes, repeat)
    rows = []
    for fmt in formats or FORMATS:
        sess = _session(fmt, head_dim, device, threads)
        moved = x.nbytes + vectors * packed_size(fmt, head_dim)
        row = {"format": fmt, "vectors": vectors, "head_dim": head_dim, "bytes_moved": moved}
        if device == "cuda":
            from .cuda_steps import time_iobinding

            io = sess.io_binding()
            io.bind_ortvalue_input("x", x_dev)
            # the output allocated once: runs back to back would otherwise each allocate one
            out = ort.OrtValue.ortvalue_from_shape_and_type((vectors, packed_size(fmt, head_dim)), np.uint8, "cuda", 0)
            io.bind_ortvalue_output("packed", out)
            seconds, pipelined = time_iobinding(sess, io, repeat)
            row.update(seconds_pipelined=pipelined, GBps_pipelined=moved / pipelined / 1e9,
                       copy_fraction_pipelined=moved / pipelined / rate if rate else None)
        else:
            seconds = _median_seconds(lambda sess=sess: sess.run(None, {"x": x}), repeat)
        row.update(seconds=seconds, GBps=moved / seconds / 1e9, copy_GBps=rate / 1e9 if rate else None,
                   copy_fraction=moved / seconds / rate if rate else None)
        rows.append(row)
    return rows


def report(rows: list[dict], device: str) -> str:
    lines = [f"TQPack on {device}: {rows[0]['vectors']} fp16 vectors of {rows[0]['head_dim']}; "
             f"copy rate {rows[0]['copy_GBps']:.1f} GB/s (read + write, same run)" if rows and rows[0]["copy_GBps"]
             else f"TQPack on {device}"]
    pipelined = bool(rows) and "seconds_pipelined" in rows[0]
    head = f"{'format':<8}{'ms/call':>10}{'GB/s':>10}{'x copy rate':>13}"
    lines.append(head + (f"{'back to back: ms':>20}{'GB/s':>10}{'x copy rate':>13}" if pipelined else ""))
    for r in rows:
        frac = f"{r['copy_fraction']:.2f}" if r["copy_fraction"] else "n/a"
        line = f"{r['format']:<8}{r['seconds'] * 1e3:>10.3f}{r['GBps']:>10.1f}{frac:>13}"
        if pipelined:
            pf = f"{r['copy_fraction_pipelined']:.2f}" if r["copy_fraction_pipelined"] else "n/a"
            line += f"{r['seconds_pipelined'] * 1e3:>20.3f}{r['GBps_pipelined']:>10.1f}{pf:>13}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], device: str, path: str) -> None:
    """A PNG of each format's throughput as a fraction of the copy rate against the vectors per call:
    solid lines for calls back to back (GPU time), dashed for calls run and waited for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    series = [("copy_fraction_pipelined", "-", "back to back"), ("copy_fraction", "--", "waited for")]
    for i, fmt in enumerate(dict.fromkeys(r["format"] for r in rows)):
        for key, style, how in series:
            pts = sorted((r["vectors"], r[key]) for r in rows if r["format"] == fmt and r.get(key))
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, color=f"C{i}", linestyle=style, label=f"{fmt}, {how}")
    ax.axhline(1.0, color="grey", linewidth=0.8)  # the copy
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"fp16 vectors of {rows[0]['head_dim']} per call")
    ax.set_ylabel("(bytes read + written) / time, x copy rate")
    ax.set_title(f"TQPack on {device}, against a copy in the same run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    try:
        save_new_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
