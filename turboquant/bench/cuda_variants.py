"""The decode step's other forms on CUDA, timed in the same run and the same way as bench.cuda's
presets (cuda_steps.py): TQGroupQueryAttention on raw16 rows (the boundary layers of a rewritten genai model) against
ORT's fp16 GroupQueryAttention on the same bytes; TQAttention with an additive mask (a rewrite that
keeps the exporter's mask) against the same step without one; and one step of ORT's GroupQueryAttention
and of TQGroupQueryAttention replayed from ORT's CUDA graphs (`enable_cuda_graph`), against the same
step launched by each Run.

A form that fails (a CUDA graph capture refused, say) is recorded as NAME_error and reported, not raised.
"""

from __future__ import annotations

from . import cuda_steps as cuda
from .cuda_record import GQA_FP16, INPLACE, ShapeRun

MASKED, GRAPH = "_masked", "_graph"
RAW16_INPLACE = "raw16_inplace"


def _try(run: ShapeRun, name: str, step) -> None:
    try:
        run.add(name, *step())
    except Exception as e:  # noqa: BLE001 - reported in the table, the other forms still run
        run.fail(name, e)


def measure(run: ShapeRun, b: int, s: int, preset: str, iters: int, rng) -> None:
    """The variants at one (B, S), for `preset` (whose mask-free TQAttention and in-place steps `run`
    already holds), into run."""
    hq, hkv, d = 32, 8, 128
    _try(run, RAW16_INPLACE, lambda: cuda.tq_gqa_step(cuda.RAW16, b, hq, hkv, d, s, iters, rng))
    _try(run, f"{preset}{MASKED}", lambda: cuda.tq_step(preset, b, hq, hkv, d, s, iters, rng, mask=True))
    _try(run, f"{GQA_FP16}{GRAPH}", lambda: cuda.gqa_step(b, hq, hkv, d, s, iters, rng, graph=True))
    _try(run, f"{preset}{INPLACE}{GRAPH}",
         lambda: cuda.tq_gqa_step(preset, b, hq, hkv, d, s, iters, rng, graph=True))


def _us(run: ShapeRun, name: str, back_to_back: bool, base: str | None = None) -> str:
    us = run.us(name, back_to_back)
    if us is None:
        return "n/a"
    x = run.ratio(name, base, back_to_back) if base else None
    return f"{us:.0f}" + (f" ({x:.2f}x)" if x else "")


def report(runs: list[ShapeRun], preset: str) -> str:
    """The variants' table: us per step waited for / GPU time, each against its baseline."""
    if not any(RAW16_INPLACE in r.timings or RAW16_INPLACE in r.errors for r in runs):
        return ""
    short, inplace = preset.removeprefix("turboquant_"), f"{preset}{INPLACE}"
    out = ["\nOther forms of the step, us per step waited for / GPU time (x: the baseline's time / this one's): "
           "raw16 rows against ORT GQA fp16; TQAttention masked against the same step mask-free; CUDA graphs "
           "against the same op launched by Run",
           f"| B | S | raw16 in place | {short} TQAttention | {short} masked | GQA fp16 graph | {short} in place | "
           f"{short} in place graph |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        cells = [str(r.batch), str(r.context)]
        for name, base in ((RAW16_INPLACE, GQA_FP16), (preset, None), (f"{preset}{MASKED}", preset),
                           (f"{GQA_FP16}{GRAPH}", GQA_FP16), (inplace, None), (f"{inplace}{GRAPH}", inplace)):
            failed = name in r.errors
            cells.append("failed" if failed else " / ".join(_us(r, name, b2b, base) for b2b in (False, True)))
        out.append("| " + " | ".join(cells) + " |")
    for r in runs:
        for name, error in r.errors.items():
            if not name.startswith("ort_gqa_int") and not name.startswith("ort_gqa_fp8"):
                out.append(f"B={r.batch}, S={r.context}: {name} failed: {error}")
    return "\n".join(out)
