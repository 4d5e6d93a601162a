"""Developer tool for the GPU machine: where a whole model's decode step goes, per model, through the
shared-buffer loop the bench times (caches filled at random to S rows, as `bench decode --fill
random`): ONNX Runtime's own profile of each node's host time by op type (what a launch costs the
host), and torch's profiler (CUPTI) over the same steps: the device's kernels by name and the CUDA
runtime calls by name, per step; where the device idles (the gaps between its activities, the
largest named by the activities either side) and how much of a step the host spends outside ORT's
Run (the loop's own work: feeds, bindings, logits). Run with PYTHONPATH holding onnxruntime-gpu and
turboquant.

    python scripts/gpu_model_profile.py MODEL [MODEL ...] --batch 1 --context 4096 --steps 20 [--ort-profile] [--cuda-graph]
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


def idle_gaps(spans: list[tuple[int, int, str]], steps: int, top: int = 8) -> None:
    """Prints the device's idle time per step: the gaps between its activities (kernels, copies)
    by size, and the largest gaps' neighbours (name of the activity before and after), summed per step."""
    spans.sort()
    gaps, end, before = [], None, ""
    for a, b, name in spans:
        if end is not None and a > end:
            gaps.append((a - end, before, name))
        if end is None or b > end:
            end, before = b, name
    total = sum(g for g, _, _ in gaps)
    print(f"device idle per step: {total / steps / 1e3:.1f} us in {len(gaps) / steps:.1f} gaps")
    for lo, hi in ((0, 5e3), (5e3, 50e3), (50e3, 1e12)):
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        print(f"  gaps {lo / 1e3:g}-{hi / 1e3:g} us: {sum(sel) / steps / 1e3:9.1f} us per step, {len(sel) / steps:6.1f} per step")
    by_pair = collections.defaultdict(list)
    for g, x, y in gaps:
        by_pair[(x[:50], y[:50])].append(g)
    print("  largest gaps by neighbours (us per step, count per step, largest us):")
    for (x, y), d in sorted(by_pair.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(d) / steps / 1e3:9.1f} {len(d) / steps:6.1f} {max(d) / 1e3:8.1f}  {x} -> {y}")


class RunTimer:
    """Wraps a session's run_with_iobinding to sum the host's time inside ORT's Run."""

    def __init__(self, session) -> None:
        self.inner, self.seconds = session.run_with_iobinding, 0.0
        session.run_with_iobinding = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ort-profile", action="store_true", help="ORT's node profile too (adds host time to every step)")
    ap.add_argument("--cuda-graph", action="store_true", help="decode steps replayed from CUDA graphs")
    args = ap.parse_args()
    b, s, n = args.batch, args.context, args.steps
    for path in args.models:
        info = inspect(path)
        rows = s + 3 * n + 8
        ids = decode.token_ids(info.vocab or 32000, b, rows)
        prefix = os.path.join(tempfile.mkdtemp(), "ort")
        so = session_options()
        so.enable_profiling = args.ort_profile
        so.profile_file_prefix = prefix
        dec = SharedBufferDecoder(info.path, max_length=rows, head_size=info.caches[0].width, cuda_graph=args.cuda_graph,
                                  providers=["CUDAExecutionProvider", "CPUExecutionProvider"], options=so)
        cache = RandomFill("cuda", 0).caches(info.caches, b, rows)
        # warm, then the profiled steps (ORT's profile covers every run: the warm ones are counted out below)
        decode.decode_steps(dec, ids, cache, s, n, warmup=0)
        timer = RunTimer(dec.session)
        times = decode.decode_steps(dec, ids, cache, s + n, n, warmup=0)
        inside = timer.seconds / n * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode.decode_steps(dec, ids, cache, s + 2 * n, n, warmup=0)
        trace = dec.session.end_profiling() if args.ort_profile else None
        print(f"\n== {path}: B={b}, S={s}: {statistics.median(times) * 1e3:.3f} ms per step (median of {n}); "
              f"host inside ORT's Run {inside:.3f} ms, outside it {sum(times) / n * 1e3 - inside:.3f} ms per step")
        if trace:
            print("ONNX Runtime node host time per step, by op type (all runs / 3):")
            for op, us, calls in node_times(trace, 3 * n)[:14]:
                print(f"  {op:<36} {us:9.1f} us  {calls:6.1f} calls  {us / max(calls, 1e-9):7.2f} us/call")
        kernels, api, spans = collections.defaultdict(list), collections.defaultdict(list), []
        for e in prof.profiler.kineto_results.events():
            dev = e.device_type() == torch.autograd.DeviceType.CUDA
            (kernels if dev else api)[e.name()].append(e.duration_ns() / 1e3)
            if dev:
                spans.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
        print("device activities per step (us, count):")
        for name, d in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:14]:
            print(f"  {sum(d) / n:9.1f} us {len(d) / n:7.1f}x  {name[:100]}")
        print(f"  all: {sum(map(sum, kernels.values())) / n:.1f} us in {sum(map(len, kernels.values())) / n:.1f} activities")
        idle_gaps(spans, n)
        print("CUDA runtime calls per step (us, count):")
        for name, d in sorted(((k, v) for k, v in api.items() if k.startswith("cu")), key=lambda kv: -sum(kv[1]))[:12]:
            print(f"  {sum(d) / n:9.1f} us {len(d) / n:7.1f}x  {name[:80]}")
        del dec, cache
        time.sleep(1)


if __name__ == "__main__":
    main()
