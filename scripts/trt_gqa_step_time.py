"""Developer tool for the GPU machine: one decode step of the TensorRT TQGroupQueryAttention plugin,
its enqueue driven through the test harness (tests/plugins/tensorrt: no machine here has TensorRT's
builder), against the ORT CUDA op on the same shapes in the same process (32 query / 8 KV heads of
128, fp16, caches of S + 1 rows shared in place, no rotary). Both as GPU time: steps back to back,
the union of their kernels' intervals (turboquant.bench.gpu_time), so the harness's ctypes calls do
not count. Run with PYTHONPATH holding onnxruntime-gpu and turboquant (CUDA build), from the repo root:

    python scripts/trt_gqa_step_time.py [--points 1:4096 8:32768] [--presets turboquant_4bit_nc ...]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import onnxruntime as ort
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "plugins" / "tensorrt"))

import conftest as trt_harness  # noqa: E402 - the harness lives beside the plugin tests

import turboquant  # noqa: E402
from turboquant.bench import cuda_steps as cuda, gpu_time  # noqa: E402
from turboquant.config import packed_size  # noqa: E402
from turboquant.reference import formats  # noqa: E402

HQ, HKV, D = 32, 8, 128


def harness() -> trt_harness.Harness:
    trt_inc, cuda_inc = trt_harness._include_dirs()
    if trt_inc is None or cuda_inc is None:
        sys.exit("needs the TensorRT headers (third_party/tensorrt or TENSORRT_INCLUDE_DIR) and CUDA's")
    so = pathlib.Path(tempfile.mkdtemp(prefix="tq-trt-")) / "harness.so"
    subprocess.run([shutil.which("g++") or "c++", "-std=c++17", "-shared", "-fPIC", "-O1", "-o", str(so),
                    str(trt_harness.HERE / "harness.cc"), "-isystem", trt_inc, "-isystem", cuda_inc, "-ldl"], check=True)
    return trt_harness.Harness(so, turboquant.trt_plugin_path())


def plugin_step_us(h, preset: str, b: int, s: int, iters: int, rng) -> float:
    kf, vf, nc = cuda.cache_formats(preset, D)
    plugin = h.create("TQGroupQueryAttention", key_format=kf, value_format=vf, norm_correction=int(nc),
                      num_heads=HQ, kv_num_heads=HKV, do_rotary=0, packed_qkv=0)
    if plugin is None:
        raise RuntimeError(f"the plugin refused {preset}: {h.h.tqh_error().decode()}")
    width, unit = max(packed_size(kf, D), packed_size(vf, D)), min(s, 1024)
    caches = []
    for fmt in (kf, vf):  # packed random vectors repeated to S + 1 rows, as bench.cuda_steps makes them
        packed = formats.pack(rng.standard_normal((b, HKV, unit, D)).astype(np.float32), fmt, nc)
        buf = np.zeros((b, HKV, s + 1, width), np.uint8)
        reps = -(-(s + 1) // unit)
        buf[..., :packed.shape[-1]] = np.tile(packed, (1, 1, reps, 1))[:, :, :s + 1]
        caches.append(torch.from_numpy(buf).cuda())
    q = torch.randn((b, 1, HQ * D), dtype=torch.float16, device="cuda")
    k, v = (torch.randn((b, 1, HKV * D), dtype=torch.float16, device="cuda") for _ in "kv")
    seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    carrier = torch.empty((0, s + 1), dtype=torch.int32, device="cuda")  # total_sequence_length as a shape
    inputs = [q, k, v, caches[0], caches[1], seqlens, carrier]
    outputs = [torch.empty((b, 1, HQ * D), dtype=torch.float16, device="cuda"), caches[0], caches[1]]
    descs = [(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in inputs]
    out_descs = [(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in outputs]
    ws = torch.empty(max(plugin.workspace(descs, out_descs), 1), dtype=torch.uint8, device="cuda")

    def steps(n: int) -> None:
        for _ in range(n):
            if plugin.enqueue(inputs, outputs, ws) != 0:
                raise RuntimeError(f"enqueue failed: {h.h.tqh_error().decode()}")
        torch.cuda.synchronize()

    steps(5)
    busy = gpu_time.busy_seconds(lambda: steps(iters))
    return busy / iters * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", nargs="+", default=["1:4096", "8:32768"], help="B:S pairs")
    ap.add_argument("--presets", nargs="+", default=["turboquant_4bit_nc", "turboquant_k8v4", cuda.RAW16])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    ort.preload_dlls()
    h, rng = harness(), np.random.default_rng(0)
    print("| B | S | preset | plugin enqueue us (GPU time) | ORT op us (GPU time) | plugin x ORT op |")
    print("|---:|---:|---|---:|---:|---:|")
    for point in args.points:
        b, s = map(int, point.split(":"))
        for preset in args.presets:
            ours = plugin_step_us(h, preset, b, s, args.iters, rng)
            ort_us = cuda.tq_gqa_step(preset, b, HQ, HKV, D, s, args.iters, rng)[0][1] * 1e6
            print(f"| {b} | {s} | {preset} | {ours:.1f} | {ort_us:.1f} | {ort_us / ours:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
