"""What a rewrite of a model file is asked to do: every option of export() and of python -m
turboquant.export, built once (by the CLI, or by export()'s keywords) and read, never changed, by the
steps of the rewrite. export()'s docstring says what each option means; its checks refuse bad values."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class RewriteOptions:
    preset: str
    boundary: int = 2
    skip_layers: list[int] | None = None
    keep_layers: list[int] | str | None = None  # a list of layers, or "auto"
    dry_run: bool = False
    progress: bool | None = None  # None: progress bars where stderr is a terminal
    calibrate: str | os.PathLike | None = None  # a file, "random" or "self"; None: the default source
    tokenizer: str | os.PathLike | None = None
    offsets: bool = True  # False: no calibration at all
    value_offsets: bool = False
    key_scales: bool = True
    value_scales: bool = False
    target: str = "onnxruntime"
    unsupported: str = "refuse"
    cache: str = "auto"
    rotary_positions: int | None = None
    calibration_window: int | None = None
    genai_cuda_graph: bool = False
