"""A rewrite whose key offsets come from one calibration's tokens and key scales from another's
(docs/performance.md, Quality: what makes a text-calibrated row worse). Each scale is computed about
its own calibration's mean key, as collect does.

    python scripts/experiments/calibration_halves.py MODEL.onnx PRESET OFFSET_TOKENS.npy SCALE_TOKENS.npy -o OUT/model.onnx
"""

import argparse
import dataclasses

import numpy as np

import turboquant.export.calibrate as calibrate
from turboquant.export import export


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("preset")
    ap.add_argument("offset_tokens", help=".npy token ids for the key offsets (and everything but the key scales)")
    ap.add_argument("scale_tokens", help=".npy token ids for the key scales")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    collect = calibrate.collect

    def halves(model_path, ids, layers, source, **kw):
        offsets = collect(model_path, np.load(args.offset_tokens), layers, source, **kw)
        scales = collect(model_path, np.load(args.scale_tokens), layers, source, **kw)
        return dataclasses.replace(offsets, key_scales=scales.key_scales,
                                   source=f"offsets {args.offset_tokens}, key scales {args.scale_tokens}")

    calibrate.collect = halves  # export's rewrite looks it up at the call
    print(export(args.model, args.preset, args.output, calibrate=args.offset_tokens, progress=False).summary())


if __name__ == "__main__":
    main()
