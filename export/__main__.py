"""python -m turboquant.export MODEL.onnx --preset NAME [-o OUT.onnx] [options]"""

from __future__ import annotations

import argparse
import sys

from turboquant._libs import LibraryNotBuiltError
from turboquant.arguments import non_negative, positive
from turboquant.config import TQ_PRESETS

from .calibrate import DEFAULT_WINDOW, LLOYD_MAX_WINDOW
from .errors import RewriteError
from .options import RewriteOptions
from .rewrite import export_with
from .rotary import MAX_POSITIONS
from turboquant.boundary import Parser, boundary


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def _kept_layers(text: str) -> list[int] | str:
    if text.strip() == "auto":
        return "auto"
    try:
        return _layer_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers or 'auto', got {text!r}") from None


def _positions(text: str) -> int:
    try:  # the tables' own bound first: it is the tighter one
        too_many = int(text) > MAX_POSITIONS
    except ValueError:
        too_many = False  # non_negative names what is wrong with it
    if too_many:
        raise argparse.ArgumentTypeError(f"at most {MAX_POSITIONS} (2**24) positions, not {text}")
    return non_negative(text)


def _options(args: argparse.Namespace) -> RewriteOptions:
    return RewriteOptions(args.preset, boundary=args.boundary, skip_layers=args.skip_layers, keep_layers=args.keep_layers,
                          dry_run=args.dry_run, progress=False if args.no_progress else None, calibrate=args.calibrate,
                          tokenizer=args.tokenizer, offsets=not args.no_offsets, value_offsets=args.value_offsets,
                          key_scales=not args.no_key_scales, value_scales=args.value_scales, target=args.target,
                          unsupported=args.unsupported, cache=args.cache, rotary_positions=args.rotary_positions,
                          calibration_window=args.calibration_window, genai_cuda_graph=args.genai_cuda_graph)


@boundary("python -m turboquant.export")
def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m turboquant.export",
        description="Rewrite an exported ONNX decoder so that its KV cache is stored packed with TurboQuant "
        "and attention reads the packed bytes (turboquant.TQAttention). The first and last attention layers "
        "stay uncompressed.",
    )
    p.add_argument("model", help="the exported decoder (.onnx); never overwritten")
    p.add_argument("--preset", required=True, choices=list(TQ_PRESETS), help="cache format")
    p.add_argument("-o", "--output", help="where to write: a name that does not exist yet, as none is overwritten "
                   "(default: MODEL.<preset>.onnx next to the input)")
    p.add_argument("--boundary", type=non_negative, default=2, help="first and last N attention layers kept uncompressed (default 2)")
    p.add_argument("--skip-layers", type=_layer_list, help="also keep these layers uncompressed, e.g. 0,1,5")
    p.add_argument("--keep-layers", type=_kept_layers, metavar="N,N,...|auto",
                   help="keep exactly these layers uncompressed (replaces --boundary's choice); auto: the 2 x --boundary "
                   "layers whose packing alone costs most, measured on the calibration tokens")
    p.add_argument("--calibrate", metavar="FILE|random|self", help="what the original model runs on in ONNX Runtime to compute "
                   "per-layer key offsets and scales: token ids (.npy/.ids) or text (with --tokenizer), or data-free: "
                   "'random' (random token ids) or 'self' (text the model writes itself, sampled with a fixed seed from "
                   "random-token prompts); a file named so is ./random or ./self (default: self)")
    p.add_argument("--calibration-window", type=positive, metavar="TOKENS",
                   help=f"tokens in each window the calibration prefills from an empty cache (default {LLOYD_MAX_WINDOW} for "
                   f"the Lloyd-Max-key presets, {DEFAULT_WINDOW} for turboquant_k8v4; 4096 "
                   "tokens in all, e.g. 4 windows of 1024; --calibrate self's 16 sequences of 256 tokens back to back): "
                   "the key scales are fitted to attention over that span")
    p.add_argument("--no-offsets", action="store_true", help="no calibration at all: no key offsets or scales")
    p.add_argument("--tokenizer", metavar="DIR", help="local Hugging Face tokenizer folder for a text --calibrate file")
    p.add_argument("--value-offsets", action="store_true", help="with --calibrate, subtract the mean value too")
    p.add_argument("--no-key-scales", action="store_true", help="with --calibrate, offsets only: no per-channel key scales")
    p.add_argument("--value-scales", action="store_true", help="also per-channel value scales from the calibration (V divided "
                   "before the op, its output multiplied back: exact); the in-place form of exported decoders only")
    p.add_argument("--target", choices=["onnxruntime", "tensorrt"], default="onnxruntime",
                   help="the runtime the output is for: onnxruntime (default) or tensorrt (nodes mapped to turboquant's "
                   "TensorRT plugins by the ONNX parser; not runnable in ONNX Runtime)")
    p.add_argument("--unsupported", choices=["refuse", "leave"], default="refuse",
                   help="GroupQueryAttention (onnxruntime-genai) nodes using features TQGroupQueryAttention lacks "
                   "(attention bias, QK output, a quantized cache): refuse the model (default) or leave "
                   "those layers as they are")
    p.add_argument("--cache", choices=["auto", "in-place", "concat"], default="auto",
                   help="in-place: preallocated buffers of max_length rows bound as both past and present and written "
                   "in place, lengths from attention_mask instead of masks (right padding; run by turboquant's "
                   "SharedBufferDecoder); concat: past and present caches as the exporter made them, its masks kept "
                   "(any padding; for loops that feed presents back, Triton, TensorRT); auto (default): in-place where "
                   "the model allows it. onnxruntime-genai models are in place already")
    p.add_argument("--rotary-positions", type=_positions, metavar="N",
                   help="in-place form: the exporter's rotary embedding moved into the attention ops with cos/sin tables of "
                   "N positions, the longest sequence the output then takes (default: config.json's "
                   "max_position_embeddings beside the model, else 131072; at most 2**24); 0 keeps the exporter's rotary nodes")
    p.add_argument("--genai-cuda-graph", action="store_true",
                   help="onnxruntime-genai folders built for cuda: the output's genai_config.json sets enable_cuda_graph, "
                   "so genai replays each decode step from a CUDA graph (faster steps, a slower first token; genai's "
                   "GroupQueryAttention refuses it at batch sizes above 1, turboquant's op runs)")
    p.add_argument("--dry-run", action="store_true", help="analyse and report, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        result = export_with(args.model, args.output, _options(args))
    except (RewriteError, LibraryNotBuiltError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.dry_run:
        print("  (dry run: nothing written)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
