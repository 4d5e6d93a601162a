"""python -m turboquant.eval ORIGINAL.onnx [REWRITTEN.onnx ...] --text FILE [--tokenizer DIR] [options]"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from turboquant.arguments import check_output_file, check_output_folder, cuda_missing, non_negative, positive, read_onnx, threads
from turboquant.saving import write_new_text
from turboquant.config import TQ_PRESETS
from turboquant.eval.simulated import SCHEMES, words
from turboquant.boundary import Parser, boundary


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers, got {text!r}") from None


def parse(argv):
    p = Parser(
        prog="python -m turboquant.eval",
        description="Teacher-forced comparison of rewritten decoders with their original through the KV-cache path: "
        "each window is prefilled, then decoded one token at a time; perplexity, its relative increase, mean KL "
        "and top-1 agreement over the decoded tokens.")
    p.add_argument("original", help="the original exported decoder (.onnx)")
    p.add_argument("rewritten", nargs="*", help="rewritten models to compare with it")
    p.add_argument("--text", required=True, help="text file (with --tokenizer), or token ids as .npy / .ids (whitespace-separated)")
    p.add_argument("--tokenizer", metavar="DIR", help="local Hugging Face tokenizer folder for a text file")
    p.add_argument("--context", type=positive, default=512, help="tokens per window (default 512)")
    p.add_argument("--prefill", type=positive, default=256, help="tokens prefilled at the start of each window; the rest are "
                   "decoded one at a time and scored (default 256)")
    p.add_argument("--stride", type=positive, help="tokens between window starts (default context - prefill: scored spans tile the text)")
    p.add_argument("--max-tokens", type=non_negative, default=2048, help="score about this many tokens, rounded up to whole windows "
                   "(default 2048; 0 for the whole text)")
    p.add_argument("--batch", type=positive, default=8, help="windows decoded together (default 8)")
    p.add_argument("--shared-buffer", action="store_true", help="run each model the way onnxruntime-genai does (one "
                   "preallocated buffer per cache tensor, bound as past and present): for genai-built models")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=threads, help="intra-op threads (CPU)")
    p.add_argument("--sensitivity", metavar="PRESET", choices=list(TQ_PRESETS),
                   help="per-layer mode: rewrite the original with PRESET one layer at a time and report each")
    p.add_argument("--sensitivity-mode", choices=["only", "all-but-one"], default="only",
                   help="'only': that layer alone compressed; 'all-but-one': every compressed layer but that one")
    p.add_argument("--layers", type=_layers, help="with --sensitivity, only these layers")
    p.add_argument("--boundary", type=non_negative, default=2, help="with --sensitivity: the first and last N layers the rewrite keeps (default 2); all-but-one keeps them, "
                   "only names the 2N costliest layers to keep instead")
    p.add_argument("--simulate", nargs="+", metavar="FORMAT", choices=list(SCHEMES),
                   help="also score the original with its caches held in these formats, simulated (onnxruntime-genai's "
                   f"per-token PagedAttention caches, whose models give no logits: {', '.join(SCHEMES)}; see "
                   "turboquant.eval.simulated for the form assumed)")
    p.add_argument("--cache-dir", metavar="DIR", help="where the original's log-probabilities are kept for later runs "
                   "on the same original, text and settings (default $TURBOQUANT_CACHE/eval, else ~/.cache/turboquant/eval)")
    p.add_argument("--no-cache", action="store_true", help="run the original and keep nothing")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if not args.rewritten and not args.sensitivity and not args.simulate:
        p.error("give at least one rewritten model, --simulate FORMAT or --sensitivity PRESET")
    if args.json is not None and args.json != "-":  # the results come after the whole run: refuse a bad path now
        try:
            check_output_file(args.json, "--json")
        except ValueError as e:
            p.error(str(e))
    if args.cache_dir and args.no_cache:
        p.error("--cache-dir and --no-cache contradict each other")
    if args.cache_dir is not None:
        try:
            check_output_folder(args.cache_dir, "--cache-dir")
        except ValueError as e:
            p.error(str(e))
    if args.layers is not None and not args.sensitivity:
        p.error("--layers chooses the layers of --sensitivity; give --sensitivity PRESET too")
    if args.device == "cuda" and cuda_missing():
        p.error(f"--device cuda: {cuda_missing()}")
    return args


@boundary("python -m turboquant.eval")
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from turboquant.export import RewriteError
    from turboquant.tokens import load_tokens

    from .cache import default_dir
    from .runner import Evaluator, Windows
    from .sensitivity import choose_layers, costliest_layers, layer_sensitivity

    try:
        vocab = _check_models(args.original, args.rewritten, args.shared_buffer)
        if args.sensitivity:  # refuse a bad layer choice before the long run
            choose_layers(args.original, args.sensitivity_mode, args.layers, args.boundary)
        _check_simulate(args.original, args.simulate or [])
        ids, source = load_tokens(args.text, args.tokenizer, vocab=vocab)
        windows = Windows(args.context, args.prefill, args.stride, args.max_tokens or None, args.batch)
        windows.check()
        providers = ["CUDAExecutionProvider"] if args.device == "cuda" else ["CPUExecutionProvider"]
        progress = not args.no_progress and sys.stderr.isatty()
        ev = Evaluator(args.original, ids, windows, providers=providers, threads=args.threads, progress=progress,
                       shared_buffer=args.shared_buffer,
                       cache_dir=None if args.no_cache else (args.cache_dir or default_dir()))
        print(f"text: {source}, {ids.size} tokens; {ev.scored_tokens} decoded and scored in windows of {args.context} "
              f"(prefill {args.prefill}); original perplexity {ev.original.perplexity:.4f}", flush=True)
        if ev.cached:
            print(f"original: cached logits from {ev.cache_entry} (the original was not run; --no-cache runs it)", flush=True)
        elif ev.cache_entry is not None:
            print(f"original: logits kept in {ev.cache_entry} for later runs", flush=True)
        results = []
        header = f"{'model':<48} {'ppl':>9} {'increase':>9} {'mean KL':>9} {'top-1':>7}"
        print(header)
        for path in args.rewritten:
            results.append(ev.compare(path, _label(path, args.rewritten)))
            _row(results[-1])
        for scheme in args.simulate or []:
            results.append(ev.compare(args.original, f"original, {words(scheme)}", simulate=scheme))
            _row(results[-1])
        keep = None
        if args.sensitivity:
            rows = []
            for layer, r in layer_sensitivity(ev, args.original, args.sensitivity, mode=args.sensitivity_mode,
                                              layers=args.layers, boundary=args.boundary):
                rows.append((layer, r))
                results.append(r)
                _row(r)
            count = 2 * args.boundary  # the default's kept layers: the same bytes when the layers' shapes agree
            if args.sensitivity_mode == "only" and 0 < count < len(rows):
                keep = costliest_layers(rows, count)
                print(f"the {count} layers costliest by mean KL, to keep instead of the first and last "
                      f"{args.boundary}: --keep-layers {','.join(map(str, keep))}")
    except (ValueError, RewriteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"text": source, "original_cached": ev.cached, "text_tokens": int(ids.size), "scored_tokens": ev.scored_tokens, "context": args.context,
               "prefill": args.prefill, "original": args.original, "ppl_original": ev.original.perplexity,
               "results": [r.as_dict() for r in results], "costliest_layers": keep}
        out = json.dumps(doc, indent=2)
        if args.json == "-":
            print(out)
        else:
            try:
                write_new_text(args.json, out + "\n", "--json")
            except (OSError, ValueError) as e:
                print(f"error: --json {args.json}: {e}", file=sys.stderr)
                return 2
    return 0


def _check_models(original: str, rewritten: list[str], shared_buffer: bool) -> int | None:
    """Refuses, before anything runs, a path that is no ONNX model, an original that is a rewrite,
    a rewrite of another model, and models --shared-buffer cannot run; returns the original's
    vocabulary size (None where the model does not say it), which the token ids must stay within."""
    import onnx_ir as ir

    from turboquant.bench.cache_layout import check_same_model, inspect
    from turboquant.export.calibrate import vocabulary_size

    for path in rewritten:
        read_onnx(path)
    vocab = vocabulary_size(ir.from_proto(read_onnx(original)))
    first = inspect(original)
    if first.preset or any(c.dtype is np.uint8 for c in first.caches):
        raise ValueError(f"ORIGINAL {original} is a turboquant rewrite ({first.preset}); pass the model it was made from")
    infos = [inspect(path) for path in rewritten]
    for path, info in zip(rewritten, infos):
        check_same_model(first, info, path)
    if shared_buffer:
        for path, info in [(original, first), *zip(rewritten, infos)]:
            if not info.shared:
                raise ValueError(f"--shared-buffer runs models the way onnxruntime-genai does, on (TQ)GroupQueryAttention's "
                                 f"shared buffers; {path} has no such node (run it without --shared-buffer)")
    return vocab


def _check_simulate(original: str, schemes: list[str]) -> None:
    """Refuses, before anything runs, a Hadamard-rotated format where the original's head size is no
    power of two (the rotation's order)."""
    from turboquant.bench.cache_layout import inspect

    from .simulated import SCHEMES

    widths = {c.width for c in inspect(original).caches}
    for scheme in schemes:
        bad = sorted(w for w in widths if SCHEMES[scheme][1] and (w < 1 or w & (w - 1)))
        if bad:
            raise ValueError(f"--simulate {scheme}: the Hadamard rotation needs a power-of-two head size; "
                             f"{original} has {bad[0]}")


def _label(path: str, paths: list[str]) -> str:
    """The file name, or with its folder where names repeat (genai folders all hold model.onnx)."""
    name = pathlib.Path(path).name
    if sum(pathlib.Path(p).name == name for p in paths) > 1:
        return f"{pathlib.Path(path).parent.name}/{name}"
    return name


def _row(r) -> None:
    print(f"{r.name[:48]:<48} {r.rewritten.perplexity:>9.4f} {r.ppl_increase:>+9.2%} {r.mean_kl:>9.5f} {r.top1:>7.1%}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
