"""Per-layer sensitivity: how much each layer's compression costs, to pick layers to keep.

mode "only": compress one layer at a time, every other layer uncompressed (boundaries included, to
show why they are kept). mode "all-but-one": compress every layer the preset compresses (boundaries
kept) except one; a layer whose exclusion lowers the increase most is the one to keep.
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile

from .runner import Evaluator

_PAST_KEY = re.compile(r"^(?:past_key_values|past)\.(\d+)\.key$|^past_key[._](\d+)$")


def cache_layers(model: str | os.PathLike) -> list[int]:
    """Layer numbers of a decoder's past key inputs."""
    import onnx

    m = onnx.load(os.fspath(model), load_external_data=False)
    found = sorted(int(g[1] or g[2]) for i in m.graph.input if (g := _PAST_KEY.match(i.name)))
    if not found:
        raise ValueError(f"{model}: no KV-cache inputs named like past_key_values.N.key")
    return found


def choose_layers(original: str | os.PathLike, mode: str, layers: list[int] | None, boundary: int) -> tuple[list[int], list[int], set[int]]:
    """(layers to examine, every cache layer, boundary layers); ValueError when the choice makes no sense."""
    every = cache_layers(original)
    if boundary < 0:
        raise ValueError(f"the boundary must be zero or more layers, not {boundary}")
    if mode == "all-but-one" and 2 * boundary >= len(every):
        raise ValueError(f"a boundary of {boundary} keeps all {len(every)} cache layers of {original}: nothing to compress")
    kept = set(every[:boundary] + every[len(every) - boundary:]) if boundary else set()
    if mode == "only":
        todo = layers if layers is not None else every
    elif mode == "all-but-one":
        todo = layers if layers is not None else [i for i in every if i not in kept]
    else:
        raise ValueError(f"mode must be 'only' or 'all-but-one', got {mode!r}")
    unknown = sorted(set(todo) - set(every))
    if unknown:
        raise ValueError(f"layers {unknown} are not cache layers of {original} (it has {every[0]}..{every[-1]})")
    if mode == "all-but-one" and (bad := sorted(set(todo) & kept)):
        raise ValueError(f"layers {bad} are boundary layers (kept anyway with boundary {boundary}); "
                         "all-but-one examines compressed layers")
    return todo, every, kept


def layer_sensitivity(evaluator: Evaluator, original: str | os.PathLike, preset: str, *, mode: str = "only",
                      layers: list[int] | None = None, boundary: int = 2):
    """Yields (layer, Comparison) for each layer examined; rewrites into a temporary folder, each
    calibrated as the export's default does, on tokens made once (writing them is the slow part)."""
    import numpy as np
    import onnx_ir as ir

    from turboquant.export import export
    from turboquant.export.calibrate import calibration_tokens
    from turboquant.export.rewrite import DATA_FREE_DEFAULT

    todo, every, kept = choose_layers(original, mode, layers, boundary)
    with tempfile.TemporaryDirectory(prefix="turboquant-sensitivity-") as tmp:
        ids, _ = calibration_tokens(DATA_FREE_DEFAULT, None, ir.load(original), original)
        calibrate = None
        if ids is not None:
            calibrate = pathlib.Path(tmp) / "calibration.npy"
            np.save(calibrate, ids)
        for layer in todo:
            keep = [i for i in every if i != layer] if mode == "only" else sorted(kept | {layer})
            out = pathlib.Path(tmp) / f"layer{layer}.onnx"
            export(original, preset, out, keep_layers=keep, progress=False, calibrate=calibrate)
            label = f"{preset} {'only' if mode == 'only' else 'all but'} layer {layer}"
            yield layer, evaluator.compare(out, label)
            for f in pathlib.Path(tmp).iterdir():
                if f.name != "calibration.npy":
                    f.unlink()


def costliest_layers(rows: list[tuple[int, object]], count: int) -> list[int]:
    """The `count` layers whose compression alone cost most (mode "only" rows of (layer, Comparison)),
    by mean KL, which ranks layers more steadily than perplexity on a short text; sorted."""
    ranked = sorted(rows, key=lambda r: r[1].mean_kl, reverse=True)
    return sorted(layer for layer, _ in ranked[:count])
