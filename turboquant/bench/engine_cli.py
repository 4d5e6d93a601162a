"""The `engine` subcommand of python -m turboquant.bench: paged onnxruntime-genai folders served by
og.Engine at the same pool bytes, C concurrent requests of S prompt tokens each, one table per folder
with ratios to the first. Checks made before any model is loaded exit with status 2 and a line naming
the argument."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor

from .engine import PointResult
from .engine_pool import PoolError, PoolLayout, read_layout

CONFIRM_REQUESTS = 4  # requests the confirming pool is made to hold


def _counts(text: str) -> list[int]:
    """argparse type: comma-separated positive whole numbers (8,32,64)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive whole numbers, not {text!r}") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {n}")
        out.append(n)
    return out


def add_parser(sub) -> None:
    from ..arguments import positive
    from .checks import non_negative_float
    from .decode_cli import _count

    e = sub.add_parser("engine", help="paged genai folders served by og.Engine: tokens/s, ttft, requests per pool",
                       description="Serves C concurrent requests of S random prompt tokens through onnxruntime-genai's "
                       "continuous-batching Engine for each paged model folder (genai's builder, --extra_options "
                       "use_paged_attention=true), each with a pool of the same bytes; prints a table per folder, "
                       "with ratios to the first.")
    e.add_argument("folders", nargs="+", metavar="MODEL_DIR", help="paged onnxruntime-genai folders; the first is the baseline")
    e.add_argument("--concurrency", type=_counts, default=[8], metavar="C[,C...]", help="requests submitted at once (default 8)")
    e.add_argument("--context", type=_counts, default=[4096], metavar="S[,S...]", help="prompt tokens per request (default 4096)")
    e.add_argument("--new", type=positive, default=32, help="tokens each request generates (greedy; default 32)")
    e.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the provider (PagedAttention has a CUDA kernel only, in ONNX Runtime 1.32)")
    e.add_argument("--pool-bytes", type=_count, metavar="BYTES",
                   help="every folder's KV pool (num_blocks = BYTES // its block bytes, set through genai_config's "
                   "overlay); default: the first folder's num_blocks x its block bytes")
    e.add_argument("--max-batch", type=positive, help="engine.dynamic_batching.max_batch_size for every folder (default: "
                   "the largest --concurrency, so the pool, not the batch limit, bounds what runs at once)")
    e.add_argument("--seed", type=int, default=0, help="the prompts' random ids")
    e.add_argument("--budget", type=non_negative_float, default=600.0, metavar="SECONDS",
                   help="a point's requests still running after this long are closed and the point marked cut (0: none)")
    e.add_argument("--confirm", action="store_true",
                   help="per folder, also serve 6 requests from a pool of exactly 4 requests' blocks and report how "
                   "many decoded at once: the Engine's own admission against the block arithmetic of 'fit in pool'")
    e.add_argument("--isolate", action="store_true",
                   help="each folder in a process of its own (one folder's device memory cannot hold back the next's)")
    e.add_argument("--json", metavar="FILE", help="write every folder's layout and points here (a new file)")


@dataclasses.dataclass
class Plan:
    device: str
    points: list[tuple[int, int]]  # (concurrency, context)
    new: int
    pool_bytes: int
    max_batch: int
    seed: int
    budget: float | None
    confirm: bool
    vocab: int


@dataclasses.dataclass
class FolderRun:
    layout: PoolLayout
    num_blocks: int
    pool_bytes: int
    engine_bytes: int | None = None  # device memory og.Engine's creation took (CUDA)
    limits: str | None = None  # the Engine's own batch and step limits (og.EngineCapabilities)
    confirm: str | None = None
    points: list = dataclasses.field(default_factory=list)

    def header(self) -> str:
        l = self.layout
        words = (f"{l.cache}; blocks of {l.block_size} tokens, {l.bytes_per_token} bytes a token over {l.layers} layers; "
                 f"pool {self.pool_bytes / 1e9:.2f} GB = {self.num_blocks} blocks")
        if self.engine_bytes is not None:
            words += f" (og.Engine took {self.engine_bytes / 1e9:.2f} GB of the device's memory)"
        if self.limits:
            words += f"; {self.limits}"
        if self.confirm:
            words += f"; confirm: {self.confirm}"
        return words


def _fail(arg: str, message: str) -> int:
    print(f"error: argument {arg}: {message}", file=sys.stderr)
    return 2


def main(args) -> int:
    try:
        layouts = [read_layout(f) for f in args.folders]
    except PoolError as e:
        return _fail("MODEL_DIR", str(e))
    try:
        import onnxruntime_genai as og
    except ImportError:
        return _fail("MODEL_DIR", "onnxruntime-genai is not installed (its Engine serves the folders)")
    if not hasattr(og, "Engine") or not hasattr(og.Engine, "create_request"):
        return _fail("MODEL_DIR", f"onnxruntime-genai {og.__version__} has no og.Engine.create_request (0.18 or later)")
    if args.device == "cuda" and not og.is_cuda_available():
        return _fail("--device", "cuda: this onnxruntime-genai has no CUDA (onnxruntime-genai-cuda on a machine with a GPU)")
    pool = args.pool_bytes or layouts[0].config_pool_bytes
    if pool is None:
        return _fail("--pool-bytes", f"{args.folders[0]} sizes its pool by gpu_utilization_factor "
                     f"{layouts[0].utilization}, not a block count: give the pool's bytes (e.g. 40e9)")
    points = [(c, s) for s in args.context for c in args.concurrency]
    for layout in layouts:
        for s in args.context:
            if layout.context_length and s + args.new > layout.context_length:
                return _fail("--context", f"{s} + {args.new} new tokens exceed {layout.folder}'s context_length "
                             f"{layout.context_length}")
            if layout.fits(pool, s, args.new) < 1:
                return _fail("--pool-bytes", f"{pool} bytes hold no request of {s} + {args.new} tokens in "
                             f"{layout.folder} ({layout.blocks_per_request(s, args.new) * layout.block_bytes} bytes each)")
    if args.json is not None:
        from .checks import check_outputs

        try:
            check_outputs({"--json": args.json})
        except ValueError as e:
            print(f"error: argument {e}", file=sys.stderr)
            return 2
    plan = Plan(args.device, points, args.new, pool, args.max_batch or max(args.concurrency), args.seed,
                args.budget or None, args.confirm, min(l.vocab for l in layouts if l.vocab) if any(l.vocab for l in layouts) else 32000)
    from .engine_report import NOTES, folder_table, labels

    names = labels([l.folder for l in layouts])
    runs: list[FolderRun] = []
    for layout in layouts:
        _log(f"{layout.folder}: {layout.cache}, pool {plan.pool_bytes / 1e9:.2f} GB = {layout.blocks_in(pool)} blocks")
        if args.isolate:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
                try:
                    runs.append(ex.submit(run_folder, layout, plan).result())
                except Exception as e:  # noqa: BLE001 - the process died (killed for memory, say): the folder failed
                    why = f"its process failed: {type(e).__name__}: {e}"
                    runs.append(FolderRun(layout, layout.blocks_in(pool), pool,
                                          points=[PointResult(layout.folder, c, s, plan.new, error=why) for c, s in points]))
        else:
            runs.append(run_folder(layout, plan))
        base = {(r.concurrency, r.context): r for r in runs[0].points if not r.error}
        # each folder's table as soon as it is done: a run stopped later keeps the folders it finished
        print(folder_table(f"### {names[layout.folder]}: {runs[-1].header()}", runs[-1].points, base) + "\n", flush=True)
    print(NOTES, flush=True)
    if args.json is not None:
        import json

        from ..saving import write_new_text

        doc = [{**dataclasses.asdict(r), "points": [dataclasses.asdict(p) for p in r.points]} for r in runs]
        write_new_text(args.json, json.dumps(doc, indent=1), "--json")
        print(f"records written to {args.json}")
    return 1 if all(p.error for r in runs for p in r.points) else 0


def _why(e: Exception, longest: int = 300) -> str:
    """One line for an exception; a long one keeps its start and its end (ONNX Runtime's invalid-graph
    messages name the node first and the reason last)."""
    text = " ".join(str(e).split())
    if len(text) > longest:
        text = f"{text[:100]} ... {text[-(longest - 105):]}"
    return f"{type(e).__name__}: {text}"


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_folder(layout: PoolLayout, plan: Plan) -> FolderRun:
    """Every point of the plan through one og.Engine over `layout`'s folder with a pool of plan.pool_bytes."""
    from . import engine, memory

    run = FolderRun(layout, layout.blocks_in(plan.pool_bytes), plan.pool_bytes)
    if plan.confirm:
        run.confirm = confirm(layout, plan)
        _log(f"  confirm: {run.confirm}")
    overlay = {"engine": {"dynamic_batching": {"num_blocks": run.num_blocks, "max_batch_size": plan.max_batch}}}
    free = memory.device_free() if plan.device == "cuda" else None
    try:
        model, eng = engine.open_engine(layout.folder, plan.device, overlay)
    except Exception as e:  # noqa: BLE001 - a folder the Engine cannot open is reported in its rows
        why = f"og.Engine could not open it: {_why(e)}"
        run.points = [PointResult(layout.folder, c, s, plan.new, error=why) for c, s in plan.points]
        _log(f"  {why}")
        return run
    after = memory.device_free() if plan.device == "cuda" else None
    if free is not None and after is not None:
        run.engine_bytes = free - after
    caps = eng.get_capabilities()
    run.limits = (f"Engine max_batch_size {caps.configured_max_batch_size}, max_scheduled_tokens "
                  f"{caps.max_scheduled_tokens or 'default'} (prompt tokens one step takes)")
    try:
        try:
            engine.warm_up(eng, plan.vocab, layout.block_size)
        except Exception as e:  # noqa: BLE001 - an Engine that cannot serve two short requests serves no point
            why = f"the warm-up's requests failed: {_why(e)}"
            run.points = [PointResult(layout.folder, c, s, plan.new, error=why) for c, s in plan.points]
            _log(f"  {why}")
            return run
        for c, s in plan.points:
            _log(f"  {c} requests of {s} tokens, {plan.new} new ...")
            try:
                r = engine.run_point(eng, layout.folder, plan.vocab, c, s, plan.new, plan.seed, plan.budget,
                                     fits=layout.fits(plan.pool_bytes, s, plan.new))
            except Exception as e:  # noqa: BLE001 - one point failing (out of memory, say) is reported
                r = PointResult(layout.folder, c, s, plan.new, error=_why(e))
            _log(f"  {r.tokens_per_s or 0:.1f} tok/s, ttft p50 {r.ttft_p50_ms or 0:.0f} ms, peak decoding "
                 f"{r.peak_decoding}{', ' + r.error if r.error else ''}")
            run.points.append(r)
    finally:
        del eng, model
        gc.collect()
    return run


def confirm(layout: PoolLayout, plan: Plan, budget: float = 60.0) -> str:
    """Serves CONFIRM_REQUESTS + 2 requests from a pool of exactly CONFIRM_REQUESTS requests' blocks
    and says how many decoded at once: the Engine's admission against PoolLayout.fits. The prompts
    take 1.25 blocks and the tokens generated stay within their second block, so a request holds as
    many blocks when it is admitted as when it is done, and all prefills fit one step."""
    from . import engine

    b = layout.block_size
    context, new = b + b // 4, max(1, min(16, b - b // 4 - 1))
    blocks = CONFIRM_REQUESTS * layout.blocks_per_request(context, new)
    overlay = {"engine": {"dynamic_batching": {"num_blocks": blocks, "max_batch_size": CONFIRM_REQUESTS + 2}}}
    try:
        model, eng = engine.open_engine(layout.folder, plan.device, overlay)
    except Exception as e:  # noqa: BLE001 - reported in the header
        return f"not run: og.Engine could not open it: {_why(e)}"
    try:
        expected = layout.fits(blocks * layout.block_bytes, context, new)
        times, peak, blocked, cut = engine.serve(
            eng, engine.prompts(plan.vocab, CONFIRM_REQUESTS + 2, context, plan.seed), new, budget)
        done = sum(t.tokens == new for t in times)
    finally:
        del eng, model
        gc.collect()
    verdict = "as the block arithmetic says" if peak == expected else "NOT what the block arithmetic says"
    return (f"a pool of {blocks} blocks (for {expected} requests of {context} + {new} tokens) served "
            f"{CONFIRM_REQUESTS + 2} such requests with at most {peak} decoding at once, {verdict}; "
            f"{done} finished all {new} tokens, {blocked} CAPACITY_BLOCKED events{'; ' + cut if cut else ''}")
