"""The CUDA decode bench: each (B, S) timed for every preset against ORT's GroupQueryAttention and torch
SDPA (the steps and how they are timed: cuda_steps.py; the other forms of a step: cuda_variants.py),
one ShapeRun each (cuda_record.py), and the report's markdown tables.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort

from . import baselines, cuda_variants
from .cuda_record import GQA_FP16, GQA_ROTARY, INPLACE, ROTARY, TORCH_SDPA, ShapeRun
from .cuda_steps import copy_bandwidth, gqa_step, torch_step, tq_gqa_step, tq_step


def rotary_preset(presets: list[str]) -> list[str]:
    """The preset the rotary comparison times: turboquant_4bit_nc (the issue's target preset) when it
    is among them, else the first."""
    return ["turboquant_4bit_nc"] if "turboquant_4bit_nc" in presets else presets[:1]


def run(shapes, presets, iters: int = 50, seed: int = 0) -> list[ShapeRun]:
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    rng = np.random.default_rng(seed)
    bw = copy_bandwidth()
    runs = []
    for b, s in shapes:
        hq, hkv, d = 32, 8, 128
        run_ = ShapeRun(b, s, bw / 1e9 if bw else None)
        run_.add("ort_gqa_fp16", *gqa_step(b, hq, hkv, d, s, iters, rng))
        for cache in baselines.QUANT_CACHES:  # ORT's own quantized caches, where this build has them on CUDA
            try:
                run_.add(f"ort_gqa_{cache}", *gqa_step(b, hq, hkv, d, s, iters, rng, cache))
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                run_.fail(f"ort_gqa_{cache}", e)
        ts = torch_step(b, hq, hkv, d, s, iters)
        if ts:
            run_.add(TORCH_SDPA, (None, ts[0]), ts[1])
        for preset in presets:
            run_.add(preset, *tq_step(preset, b, hq, hkv, d, s, iters, rng))
            run_.add(f"{preset}{INPLACE}", *tq_gqa_step(preset, b, hq, hkv, d, s, iters, rng))
        # with the rotary embedding in the op (do_rotary=1), as onnxruntime-genai's models run it: one
        # preset (rotary_preset) against ORT's fp16 GQA
        run_.add(GQA_ROTARY, *gqa_step(b, hq, hkv, d, s, iters, rng, rotary=True))
        for preset in rotary_preset(presets):
            run_.add(f"{preset}{ROTARY}", *tq_gqa_step(preset, b, hq, hkv, d, s, iters, rng, rotary=True))
        if presets:  # raw16 rows, a masked step and CUDA graphs, for the same preset
            cuda_variants.measure(run_, b, s, rotary_preset(presets)[0], iters, rng)
        runs.append(run_)
        print(json.dumps(run_.to_json()), flush=True)
    return runs


def _cell(run_: ShapeRun, name: str, back_to_back: bool, bases: tuple[str, ...] = ()) -> str:
    """us per step, then its ratio to each base (ORT's fp16 GQA first, int4 GQA labelled) and the
    bandwidth fraction."""
    us = run_.us(name, back_to_back)
    if us is None:
        return "n/a"
    parts = []
    for base in bases:
        x = run_.ratio(name, base, back_to_back)
        if x is not None:
            parts.append(f"{x:.2f}x" + ("" if base in (GQA_FP16, GQA_ROTARY) else f" {base.removeprefix('ort_gqa_')}"))
    if (f := run_.bw_fraction(name, back_to_back)) is not None:
        parts.append(f"bw {f:.2f}")
    return f"{us:.0f}" + (f" ({', '.join(parts)})" if parts else "")


def report(runs: list[ShapeRun], presets: list[str]) -> str:
    """Markdown tables of a run: microseconds per decode step, our ratio to ORT's fp16 and int4 GQA
    (their time / ours, same timing) and the bandwidth on the bytes read as a fraction of the copy
    rate; waited-for steps and back-to-back steps, TQGroupQueryAttention (in place) and TQAttention
    (which also copies the cache into its present output)."""
    if not runs:
        return "no measurements"
    caches = ["fp16", *baselines.QUANT_CACHES]
    out = [f"copy rate {runs[0].copy_gbps:.0f} GB/s (read + write, same run)" if runs[0].copy_gbps else ""]
    for back_to_back, what in ((False, "steps run and waited for"), (True, "steps run back to back (GPU time)")):
        for variant, title in ((INPLACE, "TQGroupQueryAttention, in place"), ("", "TQAttention, present copied")):
            out.append(f"\n{title}, {what}: us per step (x vs ORT GQA fp16, x vs GQA int4, bw fraction)")
            head = ["B", "S", *(f"GQA {c}" for c in caches)] + (["torch SDPA"] if back_to_back else [])
            out.append("| " + " | ".join(head + [p.removeprefix("turboquant_") for p in presets]) + " |")
            out.append("|" + "---:|" * (len(head) + len(presets)))
            for r in runs:
                cells = [str(r.batch), str(r.context)]
                cells += [_cell(r, f"ort_gqa_{c}", back_to_back) for c in caches]
                if back_to_back:
                    cells.append(_cell(r, TORCH_SDPA, back_to_back))
                cells += [_cell(r, f"{p}{variant}", back_to_back, (GQA_FP16, "ort_gqa_int4")) for p in presets]
                out.append("| " + " | ".join(cells) + " |")
    if presets and any(GQA_ROTARY in r.timings for r in runs):
        preset = rotary_preset(presets)[0]
        name, short = f"{preset}{ROTARY}", preset.removeprefix("turboquant_")
        out.append("\nWith the rotary embedding in the op (do_rotary=1), TQGroupQueryAttention in place: us per step "
                   "(x vs ORT GQA fp16 with rotary, bw fraction)")
        out.append(f"| B | S | GQA fp16, waited | {short}, waited | GQA fp16, GPU time | {short}, GPU time |")
        out.append("|---:|---:|---:|---:|---:|---:|")
        for r in runs:
            cells = [str(r.batch), str(r.context)]
            for back_to_back in (False, True):
                cells += [_cell(r, GQA_ROTARY, back_to_back), _cell(r, name, back_to_back, (GQA_ROTARY,))]
            out.append("| " + " | ".join(cells) + " |")
    if presets:
        out.append(cuda_variants.report(runs, rotary_preset(presets)[0]))
    for c in baselines.QUANT_CACHES:
        errors = {r.errors.get(f"ort_gqa_{c}") for r in runs} - {None}
        if errors:
            out.append(f"ORT GQA on its {c} cache unavailable: {errors.pop()}")
    return "\n".join(out)
