"""python -m turboquant.bench attention|report|pack|prefill|decode|models|engine --device cpu|cuda [options]

Times one decode step (one new token) of TQAttention for each preset and of ONNX Runtime's own
attention (GroupQueryAttention on fp32, fp16 and its own int8/int4/fp8 caches, ONNX Attention-23)
on the same shape, with the same thread count, in one process, and prints each preset's speed-up
over each baseline; `pack` times TQPack against a copy; `prefill` first prompts and continuation
chunks; `decode` whole models, original against rewritten; `models` builds the benchmark models;
`engine` serves paged onnxruntime-genai folders through its continuous-batching Engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..arguments import cuda_missing
from ..arguments import head_dim as _head_dim
from ..arguments import at_most, threads
from ..arguments import positive as _positive
from ..config import TQ_PRESETS
from ..saving import OutputExists, write_new_text
from . import attention, checks, decode_cli, engine_cli, prefill
from ..boundary import Parser, boundary

_repeat = at_most(10**6)  # timed calls per candidate


@boundary("python -m turboquant.bench")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m turboquant.bench", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("attention", help="decode attention per step")
    a.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a.add_argument("--batch", type=_positive, default=1)
    a.add_argument("--q-heads", type=_positive, default=32)
    a.add_argument("--kv-heads", type=_positive, default=8)
    a.add_argument("--head-dim", type=_head_dim, default=128)
    a.add_argument("--context", type=_positive, nargs="+", default=[8192], help="tokens in the cache (several: a sweep)")
    a.add_argument("--threads", type=threads, default=os.cpu_count(), help="intra-op threads, the same for every candidate")
    a.add_argument("--repeat", type=_repeat, default=20)
    a.add_argument("--presets", nargs="+", default=list(TQ_PRESETS), choices=list(TQ_PRESETS))
    a.add_argument("--json", help="write the results here as JSON")
    a.add_argument("--plot", help="write a PNG of time against context length here")
    r = sub.add_parser("report", help="a grid of context lengths and batch sizes: markdown table and PNG plots")
    r.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    r.add_argument("--batch", type=_positive, nargs="+", default=[1, 4])
    r.add_argument("--context", type=_positive, nargs="+", default=[1024, 4096, 8192])
    r.add_argument("--q-heads", type=_positive, default=32)
    r.add_argument("--kv-heads", type=_positive, default=8)
    r.add_argument("--head-dim", type=_head_dim, default=128)
    r.add_argument("--threads", type=threads, default=os.cpu_count())
    r.add_argument("--repeat", type=_repeat, default=20)
    r.add_argument("--presets", nargs="+", default=list(TQ_PRESETS), choices=list(TQ_PRESETS))
    r.add_argument("--out", default="bench-report", help="folder for the table, JSON and plots (default ./bench-report)")
    k = sub.add_parser("pack", help="TQPack throughput per format, against a copy in the same run")
    k.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    k.add_argument("--vectors", type=_positive, nargs="+", default=[1 << 21],
                   help="fp16 vectors per call (default 2097152: 512 MiB; several: a sweep)")
    k.add_argument("--head-dim", type=_head_dim, default=128)
    k.add_argument("--threads", type=threads, default=os.cpu_count())
    k.add_argument("--repeat", type=_repeat, default=20)
    k.add_argument("--json", help="write the results here as JSON")
    k.add_argument("--plot", help="write a PNG of each format's fraction of the copy rate against the vectors per call here")
    decode_cli.add_parsers(sub)
    prefill.add_parser(sub)
    engine_cli.add_parser(sub)
    args = p.parse_args(argv)
    if args.what in decode_cli.COMMANDS:  # their own checks (decode_cli)
        return decode_cli.main(args)
    if args.what == "engine":  # its own checks (engine_cli)
        return engine_cli.main(args)
    _check(p, args)
    try:
        _refuse(args)
    except ValueError as e:
        return checks.fail(args.what, str(e))
    try:
        return _run(args)
    except OutputExists as e:  # a name taken while the run measured: left as it is
        print(f"{checks.PROG} {args.what}: error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    if args.what == "prefill":
        return prefill.main(args)
    if args.what == "pack":
        from . import pack

        rows = []
        for n in args.vectors:
            rows_n = pack.run(args.device, n, args.head_dim, args.threads, args.repeat)
            print(pack.report(rows_n, args.device), flush=True)
            rows += rows_n
        if args.json is not None:
            write_new_text(args.json, json.dumps(rows, indent=1), "--json")
        if args.plot is not None:
            pack.plot(rows, args.device, args.plot)
            print(f"plot written to {args.plot}")
        return 0
    if args.what == "report":
        from . import report

        points = report.measure(args.device, args.context, args.batch, args.presets, q_heads=args.q_heads,
                                kv_heads=args.kv_heads, head_dim=args.head_dim, threads=args.threads, repeat=args.repeat)
        print(report.markdown(points))
        for path in report.write(points, args.out):
            print(f"wrote {path}")
        return 0
    if args.device == "cuda":
        from . import cuda

        shapes = [(args.batch, s) for s in args.context] if args.context != [8192] or args.batch != 1 else \
            [(1, 4096), (1, 32768), (8, 32768), (32, 8192)]
        runs = cuda.run(shapes, args.presets, args.repeat)
        print(cuda.report(runs, args.presets))
        if args.json is not None:
            write_new_text(args.json, json.dumps([r.to_json() for r in runs], indent=1), "--json")
        return 0
    results = []
    for s in args.context:
        shape = attention.Shape(args.batch, args.q_heads, args.kv_heads, args.head_dim, s)
        rs = attention.run_cpu(shape, args.presets, args.threads, args.repeat)
        print(attention.report(rs, args.threads), flush=True)
        results += rs
    if args.json is not None:
        write_new_text(args.json, json.dumps([r.__dict__ for r in results], indent=1), "--json")
    if args.plot is not None:
        attention.plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _check(p: argparse.ArgumentParser, args) -> None:
    """What the argument types alone cannot refuse, before anything is built or timed."""
    if getattr(args, "device", None) == "cuda" and cuda_missing():
        p.error(f"argument --device: cuda: {cuda_missing()}")
    if getattr(args, "q_heads", None) and args.q_heads % args.kv_heads:
        p.error(f"argument --q-heads: {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")


def _refuse(args) -> None:
    """ValueError for what would fail only after the measuring: outputs that cannot be written, arrays
    larger than the machine, no custom-op library for our candidates."""
    if args.what == "report":
        from . import report

        if args.device == "cuda" and (args.q_heads, args.kv_heads, args.head_dim) != (32, 8, 128):
            raise ValueError("--device cuda: the CUDA report runs 32 query heads, 8 KV heads, head_dim 128 only")
        report.check_folder(args.out, args.device)
    else:
        files = {"--json": args.json, "--plot": getattr(args, "plot", None)}
        checks.check_outputs(files, plots=("--plot",))
    checks.check_library()
    for need, what in _arrays(args):
        checks.check_fits(need, what)


def _arrays(args):
    """(bytes, what) of each run's largest host arrays, estimated from the arguments."""
    if args.what == "pack":
        from . import pack

        return [(pack.need_bytes(n, args.head_dim), f"--vectors {n}") for n in args.vectors]
    if args.what == "prefill":
        return prefill.arrays(args)
    if args.device == "cuda":  # the caches are the device's (its own out-of-memory errors)
        return []
    batches = args.batch if args.what == "report" else [args.batch]
    return [(attention.need_bytes(attention.Shape(b, args.q_heads, args.kv_heads, args.head_dim, s)),
             f"--context {s} at batch {b}") for b in batches for s in args.context]


if __name__ == "__main__":
    raise SystemExit(main())
