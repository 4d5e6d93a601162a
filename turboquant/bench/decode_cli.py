"""The `decode` and `models` subcommands of python -m turboquant.bench: their arguments, the
checks made before any work (exit status 2 and a message naming the argument), and the runs."""

from __future__ import annotations

import argparse
import decimal
import os
import pathlib
import shutil
import sys

COMMANDS = ("decode", "models")
LARGEST = 2**63 - 1  # ONNX Runtime's shapes and numpy's sizes are int64


def _count(text: str) -> int:
    """A positive whole number, also written as 4e3 or 80e9; exact (Decimal, not float: 2.5e0 is
    refused, not cut to 2, and 1e400 is too large, not an overflow)."""
    try:
        d = decimal.Decimal(text.strip())
    except decimal.InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, not {text!r}") from None
    if not d.is_finite() or d != d.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a positive whole number, not {text!r}")
    if d <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    if d > LARGEST:  # compared before int(): 1e999999999 as an int would take the memory itself
        raise argparse.ArgumentTypeError(f"{text} is too large (at most {LARGEST})")
    return int(d)


def _at_most(limit: int):
    """argparse type: _count, at most `limit` (a count of timed runs: more would never finish)."""
    def check(text: str) -> int:
        n = _count(text)
        if n > limit:
            raise argparse.ArgumentTypeError(f"{text} is more than {limit}")
        return n

    return check


def add_parsers(sub) -> None:
    from ..arguments import non_negative, threads
    from .checks import non_negative_float
    from .decode_models import BUILDERS, SHAPES

    d = sub.add_parser("decode", help="whole-model decode: tokens/s, time to first token, KV bytes, memory, capacity",
                       description="Times each model's decode steps at batch B and context S in one process, on the "
                       "same token ids, through the decode loop a user runs; prints ratios to the first model.")
    d.add_argument("models", nargs="+", metavar="MODEL",
                   help="ORIGINAL.onnx REWRITTEN.onnx [more] (.onnx files, or onnxruntime-genai folders)")
    d.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    d.add_argument("--batch", type=_count, nargs="+", default=[1],
                   help="sequences decoded together (B); several: paired with --context's values in order")
    d.add_argument("--context", type=_count, nargs="+", default=[1024],
                   help="tokens in the cache when the timed steps start (S); several: one point each, one session per model")
    d.add_argument("--steps", type=_at_most(10**6), default=16, help="timed decode steps (median reported; 2 more warm up)")
    d.add_argument("--prefill-chunk", type=_count, help="tokens per prefill call (default: the whole prompt at once; "
                   "onnxruntime-genai's runtime always takes it at once)")
    d.add_argument("--runtime", choices=["ort", "genai"], default="ort",
                   help="ort: turboquant's DecoderSession / SharedBufferDecoder loops; genai: og.Generator (genai folders)")
    d.add_argument("--cuda-graph", type=_count, nargs="*", metavar="N",
                   help="--device cuda: each decode step replayed from a CUDA graph (ONNX Runtime's provider option "
                   "enable_cuda_graph), which takes out the host's work between kernels: onnxruntime-genai's own with "
                   "--runtime genai, SharedBufferDecoder's static-shape steps with --runtime ort (genai folders and "
                   "in-place rewrites; the prompt runs without a graph). Alone: every model; with numbers, those "
                   "MODELs only (1 is the first): ORIGINAL TQ TQ --cuda-graph 3 times the rewrite without and with "
                   "graphs beside an original that runs without")
    d.add_argument("--fill", choices=["prefill", "random"], default="prefill",
                   help="how the caches reach S tokens: a real prefill, or random K/V (packed through TQPack) without one")
    d.add_argument("--ttft-budget", type=non_negative_float, default=120.0, metavar="SECONDS",
                   help="--fill random: the prefill timed for ttft is given up after this long (0: none)")
    d.add_argument("--no-ttft-warmup", dest="ttft_warmup", action="store_false",
                   help="time the first prefill at each point (by default the same prompt runs once untimed first, "
                   "so ttft leaves out the costs a process pays once)")
    d.add_argument("--ttft-max-tokens", type=_count, metavar="N",
                   help="--fill random: time a prefill for ttft only where batch x context is at most N (a prompt "
                   "taken in one call cannot be stopped by --ttft-budget)")
    d.add_argument("--capacity", type=_count, metavar="BYTES",
                   help="report the largest batch at S and the longest context at B whose KV cache fits in BYTES (e.g. 80e9)")
    d.add_argument("--threads", type=threads, help="intra-op threads (default: ONNX Runtime's)")
    d.add_argument("--rounds", type=_at_most(10**4), default=1,
                   help="time every model this many times, one model at a time, the models' order reversed every "
                   "other round; the table gives the medians and their spread, the JSON each round's ms/step")
    d.add_argument("--isolate", action="store_true",
                   help="each model of each round in a process of its own: one model's memory (ONNX Runtime's "
                   "arena, a CUDA context) cannot hold back the next, and a step's spread between processes is sampled")
    d.add_argument("--other-exporters", action="store_true",
                   help="the models may come from different exporters of one architecture (e.g. genai's builder, "
                   "which fuses Q, K and V, against a TorchScript export): the cache layouts are checked, not the "
                   "weight shapes")
    d.add_argument("--json", metavar="FILE", help="write the records here (a list of JSON objects)")
    d.add_argument("--plot", metavar="FILE", help="write a PNG of tokens/s, ttft and KV bytes per model here")
    m = sub.add_parser("models", help="the decode benchmark's random-weight Llama-shape models",
                       description="Builds a random-weight decoder of a Llama shape with onnxruntime-genai's builder "
                       "or torch.onnx's TorchScript exporter, and optionally its turboquant rewrite in DIR/tq.")
    m.add_argument("--shape", choices=list(SHAPES), required=True,
                   help="llama8b (Llama-3.1-8B), llama3b (Llama-3.2-3B), small (8B attention, 4 layers), tiny (tests)")
    m.add_argument("--builder", choices=list(BUILDERS), required=True)
    m.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    m.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the weights are made and which provider genai's builder targets")
    m.add_argument("-o", "--output", required=True, metavar="DIR", help="a new or empty folder")
    m.add_argument("--rewrite", nargs="?", const="turboquant_4bit_nc", metavar="PRESET",
                   help="also write the turboquant rewrite to DIR/tq (default preset turboquant_4bit_nc)")
    m.add_argument("--no-calibration", action="store_true",
                   help="rewrite without key offsets or scales (no data-free calibration run of the original on the CPU)")
    m.add_argument("--boundary", type=non_negative, help="the rewrite's boundary layers (default 2; 1 for models under 6 layers)")
    m.add_argument("--cache", choices=["auto", "in-place", "concat"],
                   help="torchscript: the rewrite's cache form (turboquant.export --cache; default auto, which is in-place "
                   "for these models); genai models are in place already")


def _fail(arg: str, message: str) -> int:
    print(f"error: argument {arg}: {message}", file=sys.stderr)
    return 2


def _refused(e: ValueError) -> int:
    """A check's message that starts with the option's name (checks.check_outputs's)."""
    print(f"error: argument {e}", file=sys.stderr)
    return 2


def main(args) -> int:
    return _decode(args) if args.what == "decode" else _models(args)


def _decode(args) -> int:
    from . import checks, decode, decode_report
    from .cache_layout import LayoutError, check_same_model, inspect

    try:
        infos = [inspect(p) for p in args.models]
        for i, info in enumerate(infos[1:], 2):
            check_same_model(infos[0], info, f"MODEL {i}", weights=not args.other_exporters)
    except LayoutError as e:
        return _fail(e.arg, str(e))
    graphs = args.cuda_graph is not None
    if graphs and args.device != "cuda":
        return _fail("--cuda-graph", "needs --device cuda (ONNX Runtime's CUDA provider captures the graphs)")
    if graphs and any(n > len(args.models) for n in args.cuda_graph):
        return _fail("--cuda-graph", f"model numbers run from 1 to {len(args.models)}, not {max(args.cuda_graph)}")
    graph_models = tuple(sorted({n - 1 for n in args.cuda_graph})) if args.cuda_graph else None
    if graphs and args.runtime == "ort":
        for i, (p, info) in enumerate(zip(args.models, infos)):
            if graph_models is not None and i not in graph_models:
                continue
            if not info.shared:  # a graph replays fixed shapes
                return _fail("MODEL", f"{p}: --cuda-graph needs caches written in place (SharedBufferDecoder: "
                             "onnxruntime-genai models, in-place rewrites); this model's caches grow each step "
                             "(DecoderSession)")
    if args.runtime == "genai":
        if args.fill == "random":
            return _fail("--fill", "random needs the ort runtime: onnxruntime-genai fills its own caches by a prefill")
        for p, info in zip(args.models, infos):
            if info.genai_folder is None:
                return _fail("MODEL", f"{p}: --runtime genai needs an onnxruntime-genai folder (genai_config.json)")
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            return _fail("--runtime", "genai: onnxruntime-genai is not installed")
    if len(args.batch) != len(args.context) and 1 not in (len(args.batch), len(args.context)):
        return _fail("--context", f"{len(args.context)} values do not pair with --batch's {len(args.batch)}")
    n = max(len(args.batch), len(args.context))
    points = list(zip(args.batch * n if len(args.batch) == 1 else args.batch,
                      args.context * n if len(args.context) == 1 else args.context))
    longest = max(args.context)
    for info in infos:
        if info.shared and info.max_length and longest + decode.WARMUP + args.steps > info.max_length:
            return _fail("--context", f"{longest} + {decode.WARMUP + args.steps} steps exceed {info.path}'s "
                         f"context_length {info.max_length}")
    for info in infos:
        if info.shared and info.rotary_positions and longest + decode.WARMUP + args.steps > info.rotary_positions:
            return _fail("--context", f"{longest} + {decode.WARMUP + args.steps} steps exceed the "
                         f"{info.rotary_positions} positions of {info.path}'s rotary tables (python -m "
                         "turboquant.export --rotary-positions N makes longer ones)")
    try:
        checks.check_outputs({"--json": args.json, "--plot": args.plot}, plots=("--plot",))
    except ValueError as e:
        return _refused(e)
    if args.runtime == "ort":
        try:
            checks.check_library()
        except ValueError as e:
            return _fail("MODEL", str(e))
    if args.device == "cuda":
        from ..arguments import cuda_missing

        if cuda_missing():
            return _fail("--device", f"cuda: {cuda_missing()}")
    opts = decode.Options(device=args.device, points=points, steps=args.steps,
                          prefill_chunk=args.prefill_chunk, runtime=args.runtime, fill=args.fill, cuda_graph=graphs, graph_models=graph_models,
                          ttft_budget=args.ttft_budget, ttft_max_tokens=args.ttft_max_tokens, ttft_warmup=args.ttft_warmup, capacity=args.capacity, threads=args.threads,
                          rounds=args.rounds, isolate=args.isolate)
    try:
        checks.check_fits(decode.host_bytes(infos, opts), f"context {longest} at batch {max(args.batch)}")
    except ValueError as e:
        return _fail("--context", str(e))
    out = decode_report.JsonRecords(args.json) if args.json is not None else None
    lost: list = []  # an output whose name was taken during the run (saving.OutputExists): reported at the end

    def saved(records):  # after every record: a run cut short keeps what it measured
        if out is not None and not lost:
            _save(lambda: out.save(records), lost)
        r = records[-1]
        print(f"  {r.ms_per_step or float('nan'):.2f} ms/step, ttft {r.ttft_ms or float('nan'):.0f} ms"
              f"{', ' + r.error if r.error else ''}", file=sys.stderr, flush=True)

    runner = decode.run_rounds if args.rounds > 1 or args.isolate else decode.run
    records = runner(args.models, infos, opts, log=lambda s: print(s, file=sys.stderr, flush=True), on_record=saved)
    print(decode_report.table(records))
    if out is not None and not lost and _save(lambda: out.save(records), lost):
        print(f"records written to {args.json}")
    if args.plot is not None and _save(lambda: decode_report.plot(records, args.plot), lost):
        print(f"plot written to {args.plot}")
    for e in lost:
        print(f"error: {e}", file=sys.stderr)
    return 1 if lost or all(r.error for r in records) else 0


def _save(write, lost: list) -> bool:
    from ..saving import OutputExists

    try:
        write()
        return True
    except OutputExists as e:
        lost.append(e)
        return False


def _models(args) -> int:
    why = _models_refused(args)
    if why:
        return _fail(*why)
    from turboquant.export import RewriteError

    try:
        paths = _build_new(pathlib.Path(args.output), args)
    except RewriteError as e:  # what the rewrite refuses in the model built: one line, nothing left behind
        return _fail("--rewrite", str(e))
    for k, v in paths.items():
        print(f"{k}: {v}")
    return 0


def _models_refused(args) -> tuple[str, str] | None:
    """(argument, why) for what `models` cannot build, before any weights are made."""
    from ..arguments import check_output_folder
    from . import checks

    try:
        out = check_output_folder(args.output, "-o")
    except ValueError as e:
        return "-o", str(e)
    if out.is_dir() and any(out.iterdir()):
        return "-o", f"{out} is not an empty folder (nothing is overwritten)"
    if args.rewrite is None:  # these shape the rewrite only: given without one, they would be ignored
        for flag, given in (("--no-calibration", args.no_calibration), ("--boundary", args.boundary is not None),
                            ("--cache", args.cache is not None)):
            if given:
                return flag, "shapes the rewrite, and no --rewrite was asked for"
    if args.builder == "genai":
        try:
            import onnxruntime_genai  # noqa: F401
        except ImportError:
            return "--builder", "genai: onnxruntime-genai (its model builder) is not installed"
        if args.precision == "fp16" and args.device == "cpu":
            return "--precision", ("fp16 on the CPU: genai's builder writes MultiHeadAttention there, which turboquant "
                                   "does not rewrite; give --precision fp32 (or --device cuda)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device", "cuda: torch sees no CUDA device"
    if args.rewrite:
        from ..config import TQ_PRESETS

        if args.rewrite not in TQ_PRESETS:
            return "--rewrite", f"unknown preset {args.rewrite!r}; one of {', '.join(TQ_PRESETS)}"
        try:
            checks.check_library()  # the rewrite is checked in ONNX Runtime through it
        except ValueError as e:
            return "--rewrite", str(e)
    if args.boundary is not None and args.boundary < 0:
        return "--boundary", f"must not be negative, not {args.boundary}"
    if args.cache == "concat" and args.builder == "genai":
        return "--cache", "concat is for torchscript exports: genai models' caches are written in place, and stay so"
    return None


def _build_new(out: pathlib.Path, args) -> dict[str, pathlib.Path]:
    """decode_models.build in a temporary folder inside `out`, its folders then moved into `out`: a
    failure leaves `out` as it was (removed again where this run made it)."""
    from ..saving import publish_folder, staging
    from .decode_models import build

    with staging(out) as tmp:  # the folders made for out go again if this fails
        paths = build(args.shape, args.builder, args.precision, args.device, tmp, args.rewrite, args.boundary,
                      calibrate=not args.no_calibration, cache=args.cache or "auto",
                      log=lambda s: print(s.replace(str(tmp), str(out)), flush=True))  # the names they will have
        moved = []
        try:
            for entry in sorted(tmp.iterdir()):
                publish_folder(entry, out / entry.name, "-o")
                moved.append(out / entry.name)
        except BaseException:
            for p in moved:
                shutil.rmtree(p, ignore_errors=True)
            raise
        return {k: out / os.path.relpath(v, tmp) for k, v in paths.items()}
