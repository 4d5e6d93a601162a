"""The decode step's other forms on CUDA, timed in the same run and the same way as bench.cuda's
presets: TQGroupQueryAttention on raw16 rows (the boundary layers of a rewritten genai model) against
ORT's fp16 GroupQueryAttention on the same bytes; TQAttention with an additive mask (a rewrite that
keeps the exporter's mask) against the same step without one; and one step of ORT's GroupQueryAttention
and of TQGroupQueryAttention replayed from ORT's CUDA graphs (`enable_cuda_graph`), against the same
step launched by each Run.

A form that fails (a CUDA graph capture refused, say) is recorded as NAME_error and reported, not raised.
"""

from __future__ import annotations

from . import cuda

MASKED, GRAPH = "_masked", "_graph"


def _try(row: dict, name: str, step, bw) -> bool:
    try:
        cuda._record(row, name, *step(), bw)
        return True
    except Exception as e:  # noqa: BLE001 - reported in the table, the other forms still run
        row[f"{name}_error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        return False


def _against(row: dict, name: str, base: str) -> None:
    """name_x_vs_BASE[_pipelined]: base's time / name's, same timing."""
    for suffix in ("", "_pipelined"):
        if f"{base}{suffix}_us" in row and f"{name}{suffix}_us" in row:
            row[f"{name}_x_vs_{base}{suffix}"] = row[f"{base}{suffix}_us"] / row[f"{name}{suffix}_us"]


def measure(row: dict, b: int, s: int, preset: str, iters: int, rng, bw: float | None) -> None:
    """The variants at one (B, S), for `preset` (whose mask-free TQAttention and in-place rows `row`
    already holds), into row."""
    hq, hkv, d = 32, 8, 128
    if _try(row, "raw16_inplace", lambda: cuda.tq_gqa_step(cuda.RAW16, b, hq, hkv, d, s, iters, rng), bw):
        _against(row, "raw16_inplace", "ort_gqa_fp16")
    if _try(row, f"{preset}{MASKED}", lambda: cuda.tq_step(preset, b, hq, hkv, d, s, iters, rng, mask=True), bw):
        _against(row, f"{preset}{MASKED}", preset)
    if _try(row, f"ort_gqa_fp16{GRAPH}", lambda: cuda.gqa_step(b, hq, hkv, d, s, iters, rng, graph=True), bw):
        _against(row, f"ort_gqa_fp16{GRAPH}", "ort_gqa_fp16")
    if _try(row, f"{preset}_inplace{GRAPH}", lambda: cuda.tq_gqa_step(preset, b, hq, hkv, d, s, iters, rng, graph=True), bw):
        _against(row, f"{preset}_inplace{GRAPH}", f"{preset}_inplace")
        _against(row, f"{preset}_inplace{GRAPH}", f"ort_gqa_fp16{GRAPH}")


def _us(row: dict, name: str, suffix: str, base: str | None = None) -> str:
    us = row.get(f"{name}{suffix}_us")
    if us is None:
        return "n/a"
    x = row.get(f"{name}_x_vs_{base}{suffix}") if base else None
    return f"{us:.0f}" + (f" ({x:.2f}x)" if x else "")


def report(rows: list[dict], preset: str) -> str:
    """The variants' table: us per step waited for / GPU time, each against its baseline."""
    if not any("raw16_inplace_us" in r or "raw16_inplace_error" in r for r in rows):
        return ""
    short = preset.removeprefix("turboquant_")
    out = ["\nOther forms of the step, us per step waited for / GPU time (x: the baseline's time / this one's): "
           "raw16 rows against ORT GQA fp16; TQAttention masked against the same step mask-free; CUDA graphs "
           "against the same op launched by Run",
           f"| B | S | raw16 in place | {short} TQAttention | {short} masked | GQA fp16 graph | {short} in place | "
           f"{short} in place graph |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [str(r["B"]), str(r["S"])]
        for name, base in (("raw16_inplace", "ort_gqa_fp16"), (preset, None), (f"{preset}{MASKED}", preset),
                           (f"ort_gqa_fp16{GRAPH}", "ort_gqa_fp16"), (f"{preset}_inplace", None),
                           (f"{preset}_inplace{GRAPH}", f"{preset}_inplace")):
            failed = f"{name}_error" in r
            cells.append("failed" if failed else " / ".join(_us(r, name, suffix, base) for suffix in ("", "_pipelined")))
        out.append("| " + " | ".join(cells) + " |")
    for r in rows:
        for key, value in r.items():
            if key.endswith("_error") and not key.startswith("ort_gqa_int") and not key.startswith("ort_gqa_fp8"):
                out.append(f"B={r['B']}, S={r['S']}: {key.removesuffix('_error')} failed: {value}")
    return "\n".join(out)
