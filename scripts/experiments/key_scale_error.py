"""What the key scales do to attention, layer by layer, on an exported model: the relative error of
each compressed layer's attention output (causal, float64, exact values, positions 256..511 of each
window of 512) and the mean KL of its softmax weights when its keys are packed by the reference
Lloyd-Max format with the calibrated offsets and no scales, with the scales weighing every (query,
key) pair alike (s = (E[(k - m)^2] / E[q^2])^(1/4), the rule before export/key_scale.py), and with
export/key_scale.py's attention-weighted scales. Offsets and scales come from one text, the errors
from another.

    python scripts/experiments/key_scale_error.py smollm2/model.onnx --tokenizer smollm2 --calibrate topics_far.txt --text topics.txt
"""

from __future__ import annotations

import argparse

import numpy as np

from turboquant.export.calibrate import _query_probe, load_tokens
from turboquant.export.key_scale import AttentionMoments
from turboquant.export.plan import plan_layers
from turboquant.reference.formats import pack, unpack

WINDOW, SCORED_FROM = 512, 256


def capture(model_path: str, ids: np.ndarray, windows: int, layers: list[int], preset: str) -> dict:
    """Per layer: post-rotary q [W, Hq, S, D], k and v [W, Hkv, S, D] of `windows` prefills."""
    from turboquant.decoder import DecoderSession
    from turboquant.ort import session_options_beside

    plan = dict(preset=preset, boundary=2, skip_layers=None, keep_layers=None)
    probe, queries = _query_probe(model_path, plan, layers)
    sess = DecoderSession(probe, options=session_options_beside(model_path))
    got = {i: ([], [], []) for i in queries}
    for w in range(windows):
        outs = sess.run_all(ids[None, w * WINDOW:(w + 1) * WINDOW], sess.empty_cache(1), 0)
        for i, (name, heads, _) in queries.items():
            q = np.asarray(outs[name], np.float64)
            if q.ndim == 3:
                q = q.reshape(1, q.shape[1], heads, -1).transpose(0, 2, 1, 3)
            got[i][0].append(q[0])
            got[i][1].append(np.asarray(outs[sess.cache_outputs[(i, "key")]], np.float64)[0])
            got[i][2].append(np.asarray(outs[sess.cache_outputs[(i, "value")]], np.float64)[0])
    return {i: tuple(np.stack(x) for x in xs) for i, xs in got.items()}


def closed_form(q: np.ndarray, k: np.ndarray, mean: np.ndarray) -> np.ndarray:
    hkv, d = k.shape[1], k.shape[-1]
    ksq = ((k - mean[None, :, None]) ** 2).mean((0, 2))
    qsq = (q * q).mean((0, 2)).reshape(hkv, -1, d).mean(1)
    s = (ksq / qsq) ** 0.25
    return np.clip(s / np.exp(np.log(s).mean(-1, keepdims=True)), 1 / 16, 16)


def errors(q, k, v, mean, s, fmt) -> tuple[float, float]:
    """(sum of squared output errors / sum of squared outputs, mean KL of the weights) over the scored rows."""
    d = k.shape[-1]
    x = ((k - mean[None, :, None]) / s[None, :, None]).astype(np.float32)
    kq = unpack(pack(x, fmt), fmt, d).astype(np.float64) * s[None, :, None] + mean[None, :, None]
    group = q.shape[1] // k.shape[1]
    mask = np.tril(np.ones((WINDOW, WINDOW), bool))[SCORED_FROM:]
    num = den = kl = 0.0
    for h in range(q.shape[1]):
        j = h // group
        ps = []
        for keys in (k[:, j], kq[:, j]):
            a = np.where(mask, q[:, h, SCORED_FROM:] @ keys.transpose(0, 2, 1) / np.sqrt(d), -np.inf)
            p = np.exp(a - a.max(-1, keepdims=True))
            ps.append(p / p.sum(-1, keepdims=True))
        o, oq = ps[0] @ v[:, j], ps[1] @ v[:, j]
        num += ((o - oq) ** 2).sum()
        den += (o * o).sum()
        kl += np.where(mask, ps[0] * (np.log(ps[0] + 1e-300) - np.log(ps[1] + 1e-300)), 0.0).sum(-1).mean()
    return num / den, kl / q.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--calibrate", required=True, help="text the offsets and scales come from")
    ap.add_argument("--text", required=True, help="text the errors are measured on")
    ap.add_argument("--preset", default="turboquant_4bit_nc")
    ap.add_argument("--windows", type=int, default=8, help="windows of 512 calibrated on (half as many measured)")
    args = ap.parse_args()
    import onnx_ir as ir

    from turboquant.config import TQ_PRESETS

    model = ir.load(args.model)
    layers = [p.index for p in plan_layers(model, args.preset)[0] if p.compressed]
    fmt = f"mse{TQ_PRESETS[args.preset]['key_quant_bits']}"
    cal = capture(args.model, load_tokens(args.calibrate, args.tokenizer, model)[0], args.windows, layers, args.preset)
    held = capture(args.model, load_tokens(args.text, args.tokenizer, model)[0], max(1, args.windows // 2), layers, args.preset)
    totals = np.zeros((3, 2))
    print(f"{args.preset} keys ({fmt}): attention output error / mean KL of the weights, per layer")
    print("layer   offsets only        scales alike (before)   attention-weighted (now)")
    for i in layers:
        q, k, v = cal[i]
        mean = k.mean((0, 2))
        am = AttentionMoments()
        for w in range(q.shape[0]):
            am.add(q[w:w + 1], k[w:w + 1], v[w:w + 1])
        rows = [errors(*held[i], mean, s, fmt) for s in (np.ones_like(mean), closed_form(q, k, mean), am.scales(mean))]
        totals += np.array(rows)
        print(f"{i:5d}  " + "   ".join(f"{e:.5f} / {kl:.5f}" for e, kl in rows), flush=True)
    print("sum    " + "   ".join(f"{e:.4f} / {kl:.4f}" for e, kl in totals))
    print(f"attention-weighted against before: output error {totals[2, 0] / totals[1, 0] - 1:+.1%}, "
          f"KL {totals[2, 1] / totals[1, 1] - 1:+.1%}")


if __name__ == "__main__":
    main()
