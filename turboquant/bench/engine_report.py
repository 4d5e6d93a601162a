"""bench engine's tables: one per model folder, a row per (concurrency, context) point, the x columns
against the first folder at the same point."""

from __future__ import annotations

import os

from .cells import number, ratio
from .engine import PointResult


def folder_table(header: str, rows: list[PointResult], base: dict[tuple[int, int], PointResult]) -> str:
    head = ["requests", "context", "new", "output tok/s", "x tok/s", "ttft p50 ms", "ttft p90 ms", "x ttft p50",
            "ms/token", "peak decoding", "fit in pool", "x fit", "blocked", "note"]
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = base.get((r.concurrency, r.context))
        if r.error:
            lines.append(f"| {r.concurrency} | {r.context} | {r.new} | failed: {r.error} |" + " |" * (len(head) - 4))
            continue
        note = "; ".join(x for x in (r.cut, f"{r.failed} failed" if r.failed else None) if x)
        lines.append("| " + " | ".join([
            str(r.concurrency), str(r.context), str(r.new), number(r.tokens_per_s, ".1f"),
            ratio(r.tokens_per_s, b and b.tokens_per_s), number(r.ttft_p50_ms, ".0f"), number(r.ttft_p90_ms, ".0f"),
            ratio(r.ttft_p50_ms, b and b.ttft_p50_ms, invert=True), number(r.tpot_ms, ".2f"), str(r.peak_decoding),
            number(r.fits, "d"), ratio(r.fits, b and b.fits), str(r.capacity_blocked), note or ""]) + " |")
    return "\n".join(lines)


NOTES = ("output tok/s: every request's generated tokens over the time from submitting them all to the last one's end; "
         "ttft: a request's time from that submission to its first token (its wait, its prefill, its first token); "
         "ms/token: median over requests of the time between their first and last token per token after the first; "
         "peak decoding: most requests between their first and last token after any Engine step; "
         "fit in pool: requests of context + new tokens the same pool bytes hold, whole blocks each "
         "(floor(pool blocks / ceil((context + new) / block size))); blocked: CAPACITY_BLOCKED events; "
         "x columns: against the first folder at the same point, above 1x is better")


def labels(names: list[str]) -> dict[str, str]:
    """Folder paths without the folder they all share."""
    if len(names) < 2:
        return {n: n for n in names}
    common = os.path.commonpath([os.path.abspath(n) for n in names])
    return {n: os.path.relpath(os.path.abspath(n), common) if common else n for n in names}
