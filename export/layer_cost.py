"""What compressing each layer alone costs the model, measured on the calibration tokens, to choose
the layers to keep uncompressed (`--keep-layers auto`).

Windows of calibration tokens run through the original model in ONNX Runtime, together: a prefill of
their first `past` tokens, then `steps` tokens decoded one at a time, whose logits are the
reference. For each layer the decode runs again from the same prefill, with that layer's keys and
values (the prefill's and each new token's, once written) passed through the reference packers as
the rewrite stores them (offsets subtracted, keys divided by their scales, packed and unpacked, the
same undone), the other layers exact; the cost is the mean KL divergence of its next-token
distributions from the reference's. Decoding matters: a chunk of new tokens read its own recent keys
exactly and underrated the layers whose heads look back a few tokens. The eval's sensitivity mode
measures the same through each rewritten model, one rewrite per layer (16 minutes on SmolLM2-135M).
"""

from __future__ import annotations

import os

import numpy as np

from turboquant.config import TQ_PRESETS
from turboquant.eval.metrics import mean_kl
from turboquant.reference.formats import pack, unpack

from .calibrate import Calibration, windows
from .plan import LayerPlan


def stored(x: np.ndarray, fmt: str, *, offset: np.ndarray | None, scale: np.ndarray | None,
           norm_correction: bool) -> np.ndarray:
    """x [B, H, S, D] as the packed cache gives it back: (x - offset) / scale packed in `fmt`,
    unpacked, then scaled and offset back (offset and scale [H, D], or None)."""
    y = np.asarray(x, np.float32)
    if offset is not None:
        y = y - offset[None, :, None]
    if scale is not None:
        y = y / scale[None, :, None]
    z = unpack(pack(y, fmt, norm_correction), fmt, y.shape[-1])
    if scale is not None:
        z = z * scale[None, :, None]
    if offset is not None:
        z = z + offset[None, :, None]
    return z.astype(np.asarray(x).dtype)


def layer_costs(model_path: str | os.PathLike, ids: np.ndarray, calibration: Calibration, plans: list[LayerPlan],
                preset: str, *, value_offsets: bool = False, key_scales: bool = True, past: int = 192,
                steps: int = 32, max_windows: int = 16, progress: bool = False) -> dict[int, float]:
    """Mean KL of the decode steps' next-token distributions with each plan's layer alone stored
    packed (its key and value formats, the calibration's offsets and scales), over up to max_windows
    windows of past + steps calibration tokens decoded together. Every plan's layer needs a
    calibration entry."""
    from tqdm import tqdm

    from turboquant.decoder import _NP, DecoderSession

    ids, window, starts = windows(ids, past + steps, max_windows)
    if window < past + steps:
        past = max(1, window * past // (past + steps))
        steps = window - past
    rows = np.stack([ids[s:s + past + steps] for s in starts])
    norm_correction = TQ_PRESETS[preset]["norm_correction"]
    sess = DecoderSession(model_path)
    empty = {}
    for (i, _), arg in sess.cache_inputs.items():
        heads, dim = calibration.keys[i].shape  # genai models leave the cache dims symbolic
        empty[arg.name] = np.zeros((len(rows), heads, 0, dim), _NP[arg.type])

    def packer(i: int, plan: LayerPlan):
        scale = calibration.key_scales.get(i) if key_scales else None
        voff = calibration.values[i] if value_offsets else None
        names = sess.cache_inputs[(i, "key")].name, sess.cache_inputs[(i, "value")].name

        def pack_rows(cache: dict, start: int) -> dict:
            k, v = (cache[n] for n in names)
            packed_k = stored(k[:, :, start:], plan.key_format, offset=calibration.keys[i], scale=scale,
                              norm_correction=norm_correction)
            packed_v = stored(v[:, :, start:], plan.value_format, offset=voff, scale=calibration.value_scales.get(i),
                              norm_correction=norm_correction)
            return {**cache, names[0]: np.concatenate([k[:, :, :start], packed_k], 2),
                    names[1]: np.concatenate([v[:, :, :start], packed_v], 2)}
        return pack_rows

    def decode(cache: dict, pack_rows=None) -> np.ndarray:
        logits = []
        for t in range(past, past + steps):
            step, cache = sess.step(rows[:, t:t + 1], cache, t)
            logits.append(step[:, -1])
            if pack_rows is not None:
                cache = pack_rows(cache, t)  # the new token's key and value, as the op stores them
        return np.stack(logits, 1)

    _, prefilled = sess.step(rows[:, :past], empty, 0)
    reference = decode(prefilled)
    costs = {}
    for p in tqdm(plans, desc="measuring layers", unit="layer", disable=not progress):
        pack_rows = packer(p.index, p)
        costs[p.index] = mean_kl(reference, decode(pack_rows(prefilled, 0), pack_rows))
    return costs


def costliest(costs: dict[int, float], count: int) -> list[int]:
    """The `count` layers of highest cost, sorted by index."""
    return sorted(sorted(costs, key=lambda i: costs[i], reverse=True)[:count])


def measured_keep(model_path: str | os.PathLike, ids: np.ndarray, calibration: Calibration, plans: list[LayerPlan],
                  preset: str, count: int, *, value_offsets: bool, key_scales: bool, progress: bool
                  ) -> tuple[list[int], str]:
    """`--keep-layers auto`: the `count` layers (of those plans compresses) whose packing alone costs
    most, and a line for the summary that names them with their costs."""
    from .errors import RewriteError

    candidates = [p for p in plans if p.compressed]
    if count > len(candidates):
        raise RewriteError(f"--keep-layers auto keeps 2 x --boundary = {count} layers; the model has {len(candidates)} to choose from")
    if count == 0:
        return [], "--keep-layers auto with --boundary 0: every layer compressed, none measured"
    costs = layer_costs(model_path, ids, calibration, candidates, preset, value_offsets=value_offsets,
                        key_scales=key_scales, progress=progress)
    kept = costliest(costs, count)
    ranked = sorted(costs, key=lambda i: costs[i], reverse=True)
    return kept, ("kept layers chosen by their measured cost (mean KL with that layer alone packed, on the "
                  f"calibration tokens): {', '.join(f'{i} ({costs[i]:.2g})' for i in kept)}; the cheapest: "
                  f"{', '.join(f'{i} ({costs[i]:.2g})' for i in ranked[-count:])}")
