"""The benchmark report: decode attention over a grid of context lengths and batch sizes, written as
a markdown table and PNG plots (time and bandwidth against context length, per preset and baseline)
for the README. Every figure comes from one process; ratios compare candidates of the same run.

    python -m turboquant.bench report --device cpu --context 1024 4096 8192 --batch 1 4 --out bench-report
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

from ..arguments import check_output_file, check_output_folder
from ..config import TQ_PRESETS
from ..saving import publish, refuse_existing, staging
from .cuda_record import INPLACE, ROTARY

PLOTS = ("time", "bandwidth")


@dataclasses.dataclass
class Point:
    device: str
    batch: int
    context: int
    name: str
    ms: float
    bytes_read: int | None

    @property
    def gbps(self) -> float | None:
        return self.bytes_read / self.ms / 1e6 if self.bytes_read and self.ms else None


def measure(device: str, contexts: list[int], batches: list[int], presets: list[str], *, q_heads=32, kv_heads=8,
            head_dim=128, threads: int | None = None, repeat: int = 20) -> list[Point]:
    from tqdm import tqdm

    points = []
    grid = [(b, s) for b in batches for s in contexts]
    if device == "cuda":
        from . import cuda

        if (q_heads, kv_heads, head_dim) != (32, 8, 128):
            raise ValueError("the CUDA benchmark runs docs/design.md's decode shape: 32 query heads, 8 kv heads, head_dim 128")
        for run in cuda.run(grid, presets, repeat):
            for name, t in run.timings.items():
                for back_to_back in (False, True):
                    if (us := t.us(back_to_back)) is not None:
                        label = f"{name}{PIPELINED}" if back_to_back else name
                        points.append(Point("cuda", run.batch, run.context, label, us / 1e3, t.bytes_read))
        return points
    from .attention import Shape, run_cpu

    for b, s in tqdm(grid, desc="benchmark grid", unit="shape"):
        for r in run_cpu(Shape(b, q_heads, kv_heads, head_dim, s), presets, threads, repeat):
            if r.ms is not None:
                points.append(Point("cpu", b, s, r.name, r.ms, r.bytes_read))
    return points


PIPELINED = "_pipelined"  # a point of a candidate's back-to-back timing


def is_baseline(name: str) -> bool:
    """ORT's and torch's attention; everything named after a preset (its in-place variant too) is ours."""
    return name.removesuffix(PIPELINED).removesuffix(INPLACE).removesuffix(ROTARY) not in TQ_PRESETS


def timing(name: str) -> str:
    """How a candidate was timed: ratios only compare candidates timed alike."""
    return "back to back" if name.endswith(PIPELINED) else "waited for"


def markdown(points: list[Point]) -> str:
    names = list(dict.fromkeys(p.name for p in points))
    shapes = sorted({(p.batch, p.context) for p in points})
    at = {(p.batch, p.context, p.name): p for p in points}
    lines = ["| B | S | " + " | ".join(names) + " | best preset vs fastest baseline |",
             "|---:|---:|" + "---:|" * len(names) + "---|"]
    for b, s in shapes:
        cells, base, tq = [], [], []
        for n in names:
            p = at.get((b, s, n))
            cells.append(f"{p.ms:.3f}" if p else "-")
            if p:
                (base if is_baseline(n) else tq).append(p)
        ratios = []
        for how in dict.fromkeys(timing(p.name) for p in base + tq):
            b_how = [p for p in base if timing(p.name) == how]
            t_how = [p for p in tq if timing(p.name) == how]
            if b_how and t_how:
                fb, bt = min(b_how, key=lambda p: p.ms), min(t_how, key=lambda p: p.ms)
                ratios.append(f"{bt.name} {fb.ms / bt.ms:.2f}x vs {fb.name}")
        ratio = "; ".join(ratios)
        lines.append(f"| {b} | {s} | " + " | ".join(cells) + f" | {ratio} |")
    unit = "ms per decode step (one new token)"
    return f"{unit}; device {points[0].device if points else '?'}\n\n" + "\n".join(lines) + "\n"


def plots(points: list[Point], folder: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({p.batch for p in points})
    written = []
    for what, label, value in [("time", "ms per decode step", lambda p: p.ms),
                               ("bandwidth", "GB/s of cache bytes read", lambda p: p.gbps)]:
        names = list(dict.fromkeys(p.name for p in points))
        colours = plt.get_cmap("tab20").colors  # ~30 series: the default cycle's 10 colours repeat
        # the legend beside the axes, where it hides no line
        fig, axes = plt.subplots(1, len(batches), figsize=(9 * len(batches), 5), squeeze=False)
        for ax, b in zip(axes[0], batches):
            for i, name in enumerate(names):
                pts = sorted((p.context, value(p)) for p in points if p.name == name and p.batch == b and value(p))
                if pts:
                    ax.plot(*zip(*pts), marker="o", markersize=3, label=name, color=colours[i % len(colours)],
                            linestyle="--" if is_baseline(name) else ":" if i >= len(colours) else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens in the cache)")
            ax.set_ylabel(label)
            ax.set_title(f"{points[0].device.upper()} decode attention, batch {b}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        fig.tight_layout()
        path = folder / file_names(points[0].device)[f"{what}.png"]
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def file_names(device: str) -> dict[str, str]:
    """What the report writes (table, points, plots) -> its file name in the folder."""
    return {"md": f"attention-{device}.md", "json": f"attention-{device}.json",
            **{f"{what}.png": f"attention-{device}-{what}.png" for what in PLOTS}}


def check_folder(folder: str | os.PathLike, device: str) -> None:
    """ValueError unless the report can go to `folder`: a new folder, or one without any of the
    files the report writes (none is overwritten), where files can be made."""
    folder = check_output_folder(folder, "--out")
    for name in file_names(device).values():
        check_output_file(folder / name, "--out: the report's file")


def write(points: list[Point], folder: str | pathlib.Path) -> list[pathlib.Path]:
    """The table, the points and the plots, all written or none (saving.publish), never over a file."""
    if not points:
        raise ValueError("no measurements to report")
    folder = pathlib.Path(folder)
    names = file_names(points[0].device)
    finals = [folder / name for name in names.values()]
    refuse_existing(finals, "--out: the report's file")
    with staging(folder) as tmp:
        (tmp / names["md"]).write_text(markdown(points))
        (tmp / names["json"]).write_text(json.dumps([dataclasses.asdict(p) for p in points], indent=1) + "\n")
        plots(points, tmp)
        publish([(tmp / name, folder / name) for name in names.values()], "--out: the report's file")
    return finals
