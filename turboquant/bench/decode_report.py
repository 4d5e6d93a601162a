"""bench decode's table (ratios to the first model, notes on how each figure was made), JSON and plot."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from ..saving import OutputExists, save_new_figure, staging, write_new_text
from .cells import number, ratio
from .decode import Record


GPU_NOTE = ("the device's busy time per step (kernels and copies, their union, from CUPTI) over as many steps again "
            "from the same cache; ms/step beyond it is time no kernel ran (the host's work between them)")


def table(records: list[Record]) -> str:
    """One markdown table per (batch, context) point; the x columns are each model against the first."""
    points = list(dict.fromkeys((r.batch, r.context) for r in records))
    return "\n\n".join(point_table([r for r in records if (r.batch, r.context) == p]) for p in points)


def _labels(records: list[Record]) -> dict[str, str]:
    """Model paths without the folder they all share (the JSON keeps them whole)."""
    names = list(dict.fromkeys(r.model for r in records))
    common = os.path.commonpath([os.path.dirname(n) or "." for n in names]) if len(names) > 1 else os.path.dirname(names[0])
    return {n: os.path.relpath(n, common) if common else n for n in names}


def _ms(r: Record, note) -> str:
    """ms/step; over rounds, the median with the rounds' range and how they ran."""
    if not r.round_ms:
        return number(r.ms_per_step, ".2f")
    done = [v for v in r.round_ms if v is not None]
    return f"{r.ms_per_step:.2f} ({min(done):.2f}-{max(done):.2f}) {note(r.rounds_how)}"


def point_table(records: list[Record]) -> str:
    first = records[0]
    label = _labels(records)
    cap = any(r.capacity_bytes for r in records)
    head = ["model", "ms/step", "tokens/s", "x tok/s", "ttft ms", "x ttft", "KV MB", "x KV", "peak MB", "fill"]
    if cap:
        head[9:9] = ["max batch @S", "max context @B", "x batch"]
    gpu = any(r.gpu_ms_per_step for r in records)
    if gpu:
        head[2:2] = ["GPU ms/step"]
    lines = [f"device {first.device}, batch {first.batch}, context {first.context}, {first.steps} timed steps, "
             f"runtime {first.runtime}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict[str, int] = {}

    def note(text: str) -> str:
        notes.setdefault(text, len(notes) + 1)
        return f"[{notes[text]}]"

    mixed = len({r.cuda_graph for r in records}) > 1  # a model may be listed twice, with and without graphs

    def name(r: Record) -> str:
        return label[r.model] + (" (CUDA graphs)" if mixed and r.cuda_graph else "")

    for r in records:
        if r.error:
            lines.append(f"| {name(r)} | failed: {r.error} |" + " |" * (len(head) - 2))
            continue
        row = [name(r), _ms(r, note), number(r.tokens_per_s, ".1f"), ratio(r.tokens_per_s, first.tokens_per_s),
               f"{number(r.ttft_ms, '.0f')} {note(r.ttft_how)}", ratio(r.ttft_ms, first.ttft_ms, invert=True),
               f"{r.kv_bytes / 1e6:.1f}", ratio(r.kv_bytes, first.kv_bytes, invert=True),
               f"{number(r.peak_bytes and r.peak_bytes / 1e6, '.0f')} {note(r.peak_how)}", r.fill.split(" ")[0] + (f" {note(r.fill)}" if " " in r.fill else "")]
        if cap:
            row[9:9] = [f"{number(r.capacity_batch, 'd')} {note(r.capacity_check or '')}", number(r.capacity_context, "d"),
                        ratio(r.capacity_batch, first.capacity_batch)]
        if gpu:
            row[2:2] = [f"{r.gpu_ms_per_step:.2f} {note(GPU_NOTE)}" if r.gpu_ms_per_step else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("x columns: against the first model, above 1x is better (more tokens/s, a shorter ttft, a smaller KV "
                 "cache, more sequences)")
    lines += [f"[{n}] {text}" for text, n in notes.items()]
    loops = {r.loop for r in records if r.loop}
    lines.append("decode loop: " + "; ".join(sorted(loops)))
    return "\n".join(lines)


def _json(records: list[Record]) -> str:
    return json.dumps([dataclasses.asdict(r) for r in records], indent=1)


def write_json(records: list[Record], path: str | os.PathLike) -> None:
    """A new file (saving.write_new_text: atomic, never over a file)."""
    write_new_text(path, _json(records), "--json")


class JsonRecords:
    """The --json file of a run, saved again after every record (a run cut short keeps what it
    measured): made new the first time, then replaced only while it is still the file this run made."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._mine: tuple[int, int] | None = None  # (device, inode) of the file this run made

    def save(self, records: list[Record]) -> None:
        if self._mine is None:
            write_new_text(self.path, _json(records), "--json")
            self._mine = _identity(self.path)
            return
        with staging(self.path.parent) as tmp:
            staged = tmp / self.path.name
            staged.write_text(_json(records))
            if not os.path.lexists(self.path) or _identity(self.path) != self._mine:
                raise OutputExists(f"--json {self.path} was removed or replaced during the run; left as it is")
            mine = _identity(staged)
            os.replace(staged, self.path)  # over this run's own earlier save only
        self._mine = mine


def _identity(path: pathlib.Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def plot(records: list[Record], path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if not r.error]
    names = [f"{pathlib.Path(r.model).parent.name}/{pathlib.Path(r.model).name} B{r.batch} S{r.context}" for r in ok]
    panels = [("tokens/s", [r.tokens_per_s for r in ok]),
              ("time to first token, s", [None if r.ttft_ms is None else r.ttft_ms / 1e3 for r in ok]),
              ("KV cache at S, GB", [r.kv_bytes / 1e9 for r in ok])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(range(len(values)), [v or 0 for v in values], color=[f"C{i}" for i in range(len(values))])
        for i, v in enumerate(values):
            if v is None:  # a figure not measured (see the JSON's ttft_how) is marked, not drawn as zero
                ax.text(i, 0, "not measured", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(values)), names, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    r0 = records[0]
    fig.suptitle(f"decode on {r0.device} ({r0.runtime} runtime)", fontsize=10)
    fig.tight_layout()
    try:
        save_new_figure(fig, path, dpi=120)
    finally:
        plt.close(fig)
