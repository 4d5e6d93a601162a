"""Developer tool for the GPU machine: where a whole model's decode step goes, per model, through the
shared-buffer loop the bench times (caches filled at random to S rows, as `bench decode --fill
random`): ONNX Runtime's own profile of each node's host time by op type (what a launch costs the
host), and torch's profiler (CUPTI) over the same steps: the device's kernels by name and the CUDA
runtime calls by name, per step. Run with PYTHONPATH holding onnxruntime-gpu and turboquant.

    python scripts/gpu_model_profile.py MODEL [MODEL ...] --batch 1 --context 4096 --steps 20
"""
import argparse
import collections
import json
import os
import statistics
import tempfile
import time

import numpy as np
import onnxruntime as ort

ort.preload_dlls()
import torch  # noqa: E402  (after preload_dlls: torch's CUDA libraries are the ones ORT found)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from turboquant.bench import decode  # noqa: E402
from turboquant.bench.cache_fill import RandomFill  # noqa: E402
from turboquant.bench.cache_layout import inspect  # noqa: E402
from turboquant.ort import session_options  # noqa: E402
from turboquant.shared_buffer import SharedBufferDecoder  # noqa: E402


def node_times(trace: str, steps: int) -> list[tuple[str, float, float]]:
    """(op type, host us per step, calls per step) from ORT's profile of `steps` runs."""
    total, calls = collections.defaultdict(float), collections.Counter()
    for ev in json.load(open(trace)):
        if ev.get("cat") == "Node" and ev["name"].endswith("_kernel_time"):
            op = ev.get("args", {}).get("op_name", "?")
            total[op] += ev["dur"]
            calls[op] += 1
    return sorted(((op, total[op] / steps, calls[op] / steps) for op in total), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    b, s, n = args.batch, args.context, args.steps
    for path in args.models:
        info = inspect(path)
        rows = s + 3 * n + 8
        ids = decode.token_ids(info.vocab or 32000, b, rows)
        prefix = os.path.join(tempfile.mkdtemp(), "ort")
        so = session_options()
        so.enable_profiling = True
        so.profile_file_prefix = prefix
        dec = SharedBufferDecoder(info.path, max_length=rows, head_size=info.caches[0].width,
                                  providers=["CUDAExecutionProvider", "CPUExecutionProvider"], options=so)
        cache = RandomFill("cuda", 0).caches(info.caches, b, rows)
        # warm, then the profiled steps (ORT's profile covers every run: the warm ones are counted out below)
        decode.decode_steps(dec, ids, cache, s, n, warmup=0)
        times = decode.decode_steps(dec, ids, cache, s + n, n, warmup=0)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode.decode_steps(dec, ids, cache, s + 2 * n, n, warmup=0)
        trace = dec.session.end_profiling()
        print(f"\n== {path}: B={b}, S={s}: {statistics.median(times) * 1e3:.3f} ms per step (median of {n})")
        print("ONNX Runtime node host time per step, by op type (all runs / 3):")
        for op, us, calls in node_times(trace, 3 * n)[:14]:
            print(f"  {op:<36} {us:9.1f} us  {calls:6.1f} calls  {us / max(calls, 1e-9):7.2f} us/call")
        kernels, api = collections.defaultdict(list), collections.defaultdict(list)
        for e in prof.profiler.kineto_results.events():
            dev = e.device_type() == torch.autograd.DeviceType.CUDA
            (kernels if dev else api)[e.name()].append(e.duration_ns() / 1e3)
        print("device activities per step (us, count):")
        for name, d in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:14]:
            print(f"  {sum(d) / n:9.1f} us {len(d) / n:7.1f}x  {name[:100]}")
        print(f"  all: {sum(map(sum, kernels.values())) / n:.1f} us in {sum(map(len, kernels.values())) / n:.1f} activities")
        print("CUDA runtime calls per step (us, count):")
        for name, d in sorted(((k, v) for k, v in api.items() if k.startswith("cu")), key=lambda kv: -sum(kv[1]))[:12]:
            print(f"  {sum(d) / n:9.1f} us {len(d) / n:7.1f}x  {name[:80]}")
        del dec, cache
        time.sleep(1)


if __name__ == "__main__":
    main()
