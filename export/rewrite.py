"""export(): the rewrite of a model file, from its checks and calibration to the atomic save of its output
(python -m turboquant.export); the rewrites themselves are export/concat.py, export/in_place.py and export/gqa.py,
run through export/passes.py."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import onnx_ir as ir

from turboquant.saving import OutputExists, publish, staging

from .errors import RewriteError
from .forms import locate
from .cache_io import _KV_NAMES
from .calibrate import DATA_FREE, check_window, default_window
from .gqa import refuse_fused_attention, uses_gqa
from .paged import uses_paged
from .passes import TurboQuantRewrite
from .options import RewriteOptions
from .plan import RewriteResult, check_boundary, plan_layers
from .rotary import MAX_POSITIONS


def _load(path: pathlib.Path) -> ir.Model:
    if path.is_dir():
        raise RewriteError(f"{path} is a folder, not an ONNX model; give the model's .onnx file")
    if not path.is_file():
        raise RewriteError(f"{path}: no such file")
    try:
        return ir.load(path)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise RewriteError(f"{path}: not an ONNX model ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None


def default_output(path: pathlib.Path, preset: str) -> pathlib.Path:
    return path.with_name(f"{path.stem}.{preset}.onnx")


def _longest_sequence(src: pathlib.Path) -> int | None:
    """The most tokens the model takes, as its folder says: genai_config.json's context_length (the
    buffers onnxruntime-genai allocates, which the calibration's windows must fit), else config.json's
    max_position_embeddings; None where neither does."""
    from .rotary import configured_positions

    return _genai_context(src) or configured_positions(src)


def _genai_context(src: pathlib.Path) -> int | None:
    """genai_config.json's context_length beside the model, where it is a positive whole number (the
    rewrite's read_config names what else is wrong with the file)."""
    from .genai import CONFIG

    try:
        n = json.loads((src.parent / CONFIG).read_text())["model"]["context_length"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _output_path(src: pathlib.Path, preset: str, output) -> pathlib.Path:
    if output is None:
        return default_output(src, preset)
    if not os.fspath(output).strip():  # checked before Path(), which reads "" as "."
        raise RewriteError("the output (-o) is an empty name")
    return pathlib.Path(output)


def _ort_library() -> pathlib.Path:
    """The custom-op library, found before any work (a RewriteError where it is missing)."""
    from turboquant._libs import LibraryNotBuiltError, ort_library_path

    try:
        return pathlib.Path(ort_library_path())
    except LibraryNotBuiltError as e:
        raise RewriteError(str(e)) from None


def export(model_path: str | os.PathLike, preset: str, output: str | os.PathLike | None = None, *, boundary: int = 2,
           skip_layers=None, keep_layers=None, dry_run: bool = False, progress: bool | None = None,
           calibrate: str | os.PathLike | None = None, tokenizer: str | os.PathLike | None = None,
           offsets: bool = True, value_offsets: bool = False, key_scales: bool = True, value_scales: bool = False,
           target: str = "onnxruntime", unsupported: str = "refuse", cache: str = "auto",
           rotary_positions: int | None = None, calibration_window: int | None = None,
           genai_cuda_graph: bool = False) -> RewriteResult:
    """Rewrites the model at model_path and saves it, never over a file that exists (the output's names
    are refused before any work, and its files appear together or not at all: turboquant.saving).
    See python -m turboquant.export.

    calibrate: token ids (.npy) or text (with tokenizer, a local tokenizer folder) on which the
    original model is run to compute the per-layer key offsets and scales (and, with value_offsets,
    value offsets), or a data-free source: "random" (random token ids) or "self" (text the model
    writes itself, export/self_text.py). Without it, every preset calibrates on DATA_FREE_DEFAULT
    ("self"); calibration_window: the tokens of each window the calibration prefills (4096 tokens in
    all, at least one window; the self-written text's 256-token sequences back to back in longer ones;
    None: calibrate.default_window, 1024 for Lloyd-Max keys and 256 for fp8 keys, at most config.json's
    max_position_embeddings beside the model);
    offsets=False turns every calibration off. keep_layers: the layers left uncompressed instead of
    the first and last `boundary`, or "auto": the 2 x boundary layers whose packing alone costs the
    calibration tokens most (export/layer_cost.py). value_scales: also per-channel value scales
    (export/calibrate.py value_scale), in the in-place form of exported decoders only.
    target: "onnxruntime" (the default) or "tensorrt" (the nodes as TensorRT's ONNX parser maps them
    to turboquant's plugins; see export/tensorrt.py).
    cache: "in-place" (export/in_place.py: preallocated buffers written in place, lengths instead
    of masks, right padding; run by turboquant.shared_buffer.SharedBufferDecoder), "concat" (the
    ONNX Attention-compatible form: past and present caches of the past and the total length, the
    exporter's masks kept, any padding; for loops that feed presents back, Triton, TensorRT) or
    "auto" (the default: in-place where the model allows it, else concat, the summary saying why).
    rotary_positions: the in-place form's rotary inside the ops with tables of that many positions
    (export/rotary.py; None: config.json's max_position_embeddings beside the model, else
    rotary.DEFAULT_POSITIONS; 0: the exporter's rotary stays; TensorRT's form keeps it always).
    Models built by onnxruntime-genai (com.microsoft GroupQueryAttention) take export/gqa.py's rewrite;
    unsupported ("refuse" or "leave") says what happens to nodes using features it lacks, and a
    source folder with genai_config.json gets a genai-ready output folder (export/genai.py), whose
    CUDA provider replays decode steps from CUDA graphs with genai_cuda_graph."""
    options = RewriteOptions(preset, boundary=boundary, skip_layers=skip_layers, keep_layers=keep_layers, dry_run=dry_run,
                             progress=progress, calibrate=calibrate, tokenizer=tokenizer, offsets=offsets,
                             value_offsets=value_offsets, key_scales=key_scales, value_scales=value_scales, target=target,
                             unsupported=unsupported, cache=cache, rotary_positions=rotary_positions,
                             calibration_window=calibration_window, genai_cuda_graph=genai_cuda_graph)
    return export_with(model_path, output, options)


def export_with(model_path: str | os.PathLike, output: str | os.PathLike | None, options: RewriteOptions) -> RewriteResult:
    """export() with its options built (export/options.py): what python -m turboquant.export calls."""
    o = options
    preset, boundary, skip_layers, keep_layers, dry_run, progress = (o.preset, o.boundary, o.skip_layers, o.keep_layers,
                                                                     o.dry_run, o.progress)
    calibrate, tokenizer, offsets, value_offsets, key_scales, value_scales = (o.calibrate, o.tokenizer, o.offsets,
                                                                              o.value_offsets, o.key_scales, o.value_scales)
    target, cache, rotary_positions = o.target, o.cache, o.rotary_positions
    calibration_window, genai_cuda_graph = o.calibration_window, o.genai_cuda_graph
    if target not in ("onnxruntime", "tensorrt"):
        raise RewriteError(f"target must be 'onnxruntime' or 'tensorrt', got {target!r}")
    if rotary_positions is not None and (not isinstance(rotary_positions, int) or rotary_positions < 0):
        raise RewriteError(f"rotary_positions must be a non-negative integer (0: the exporter's rotary stays), got {rotary_positions!r}")
    if cache not in ("auto", "concat", "in-place"):
        raise RewriteError(f"cache must be 'auto', 'concat' or 'in-place', got {cache!r}")
    if calibration_window is not None:
        check_window(calibration_window)
    if rotary_positions is not None and rotary_positions > MAX_POSITIONS:
        raise RewriteError(f"rotary_positions must be at most {MAX_POSITIONS} (2**24), got {rotary_positions}")
    src = pathlib.Path(model_path)
    out = _output_path(src, preset, output)
    if calibrate is not None and not offsets:
        raise RewriteError("--calibrate and --no-offsets contradict each other: calibration only computes offsets and scales")
    if calibration_window is not None and not offsets:
        raise RewriteError("--calibration-window and --no-offsets contradict each other: the windows are the calibration's")
    longest = _longest_sequence(src)
    if calibration_window is None:  # no longer than the sequences the model takes (config.json, genai_config.json)
        calibration_window = max(16, min(default_window(preset), longest or default_window(preset)))
    elif offsets and _genai_context(src) is not None and calibration_window > _genai_context(src):
        raise RewriteError(f"--calibration-window {calibration_window} is longer than the {_genai_context(src)} tokens "
                           f"of the model's buffers (genai_config.json's context_length); give at most {_genai_context(src)}")
    if value_scales and not offsets:
        raise RewriteError("--value-scales and --no-offsets contradict each other: the scales come from the calibration")
    if value_scales and (cache == "concat" or target == "tensorrt"):
        raise RewriteError("--value-scales applies to the in-place cache form only, not to --cache concat or --target tensorrt")
    if isinstance(calibrate, str) and calibrate in DATA_FREE and tokenizer is not None:
        raise RewriteError(f"--tokenizer is for a text --calibrate file; --calibrate {calibrate} takes none")
    if genai_cuda_graph and target != "onnxruntime":
        raise RewriteError("--genai-cuda-graph is for onnxruntime-genai folders, which run ONNX Runtime, not --target tensorrt")
    if genai_cuda_graph:
        from .genai import check_cuda_graph

        check_cuda_graph(src)
    library = _ort_library()  # calibration, probes and the output all run turboquant's ops
    model = _load(src)  # without its external data: the input's files are known before any slow work
    _refuse_missing_data(src, model)
    refuse_fused_attention(model)
    if uses_paged(model):
        from .paged import refuse_unsupported

        refuse_unsupported(model)
    _refuse_input_files(src, model, out)  # before check_output_file, whose "exists" would say less
    if not dry_run:  # before calibrating, which takes a while
        _check_writable(out)
        if _saved_external(model):
            _check_writable(_data_file(out), "the output's external data file")
    check_boundary(model.graph, boundary, keep_layers)
    calibrates = offsets
    auto_keep = isinstance(keep_layers, str)
    if auto_keep and keep_layers != "auto":
        raise RewriteError(f"keep_layers must be a list of layer numbers or 'auto', got {keep_layers!r}")
    if auto_keep and not offsets:
        raise RewriteError("--keep-layers auto and --no-offsets contradict each other: the layers are measured with the "
                           "calibration's offsets and scales")
    gqa = uses_gqa(model) or uses_paged(model)
    if calibrates and calibrate is None:
        calibrate = DATA_FREE_DEFAULT
    if calibrates:
        from .calibrate import check_calibration_interface

        check_calibration_interface(model, calibrate)
    shows = progress if progress is not None else sys.stderr.isatty()  # calibration's bars
    if gqa:
        if value_scales:
            raise RewriteError("--value-scales applies to exported decoders' in-place form, not to onnxruntime-genai "
                               "models (GroupQueryAttention)")
        if cache == "concat":
            raise RewriteError("--cache concat does not apply to onnxruntime-genai models (GroupQueryAttention): their "
                               "caches are written in place, and stay so")
        if uses_paged(model):
            _refuse_paged_options(options)
        return _export_gqa(model, src, out, options, calibrate=calibrate if calibrates else False, progress=shows,
                           window=calibration_window, library=library)
    if genai_cuda_graph:
        raise RewriteError(f"--genai-cuda-graph is for onnxruntime-genai models; {src} has no GroupQueryAttention nodes")
    auto = cache == "auto"
    cache, why_concat = _cache_form(model, cache, target)
    calibration, chosen = None, None
    plan = None  # (plans, layers) of `model`, for the rewrite: planned once, here where the calibration plans
    if calibrates:
        from .calibrate import calibration_tokens, collect, runtime_failures
        from .layer_cost import measured_keep

        # auto: every layer calibrated, then the costliest kept
        planned = [] if auto_keep else keep_layers
        plans, layers = plan_layers(model, preset, boundary, skip_layers, planned)
        if not auto_keep:  # auto plans again, with the layers it chose
            plan = plans, layers
        with runtime_failures("calibration"):
            ids, source = calibration_tokens(calibrate, tokenizer, model, src, shows, calibration_window)
            if ids is not None:
                plan_args = dict(preset=preset, boundary=boundary, skip_layers=skip_layers, keep_layers=planned)
                calibration = collect(src, ids, [p.index for p in plans if p.compressed], source,
                                      plan_args=plan_args if key_scales else None, progress=shows,
                                      value_scales=value_scales, window=calibration_window)
                if auto_keep:
                    keep_layers, chosen = measured_keep(src, ids, calibration, plans, preset, 2 * boundary,
                                                        value_offsets=value_offsets, key_scales=key_scales,
                                                        progress=shows)
        if ids is None and auto_keep:
            raise RewriteError(f"--keep-layers auto measures the layers on calibration tokens, and there are none: {source}")
    if cache == "in-place":
        try:
            result = _rewrite_in_place(model, src, options, calibration, keep_layers, plan)
        except RewriteError as e:
            if not auto:
                raise
            model, cache, why_concat = _load(src), "concat", f"the in-place form failed ({e})"
            plan = None  # of the model that failed: the one loaded again plans in its rewrite
    if cache == "concat" and value_scales:
        raise RewriteError(f"--value-scales applies to the in-place cache form only; this model takes the concat form: {why_concat}")
    if cache == "concat":
        rewrite = TurboQuantRewrite(preset, boundary=boundary, skip_layers=skip_layers, keep_layers=keep_layers,
                                    progress=progress, calibration=calibration, value_offsets=value_offsets,
                                    key_scales=key_scales, plan=plan)
        rewrite(model)
        result = rewrite.result
    if chosen:
        result.notes.append(chosen)
    if why_concat:
        result.notes.append(f"cache form concat (past and present as the exporter made them): {why_concat}")
    if target == "tensorrt":
        from .tensorrt import for_tensorrt

        for_tensorrt(model)
    if dry_run:
        return result
    _save(model, out)
    result.output = out
    return result


def _rewrite_in_place(model: ir.Model, src: pathlib.Path, options: RewriteOptions, calibration, keep_layers,
                      plan: tuple | None = None) -> RewriteResult:
    """The in-place rewrite, after export/mask_probe.py has read off the original what the graph may
    not say: query heads, and that every mask is the one lengths replace (else a RewriteError).
    keep_layers: the options' or those --keep-layers auto chose; plan: plan_layers of `model` with them
    (None: planned here)."""
    from .in_place import query_heads
    from .mask_probe import probe, windows

    preset, target, rotary_positions = options.preset, options.target, options.rotary_positions
    value_offsets, key_scales = options.value_offsets, options.key_scales
    plan_args = dict(boundary=options.boundary, skip_layers=options.skip_layers, keep_layers=keep_layers)
    plan = plan or plan_layers(model, preset, **plan_args)
    plans, layers = plan
    windowed = windows(src, len(layers))
    if windowed:
        from .plan import _ranges

        raise RewriteError(f"lengths cannot replace the masks of layers {_ranges(sorted(windowed))}: a sliding window of "
                           f"{max(windowed.values())} tokens (config.json), which the in-place ops do not take")
    sites = [locate(layers[p.index]) for p in plans]
    heads, flat = {}, {}
    if any(s.mask is not None or not s.is_causal or query_heads(s) is None for s in sites):
        heads, bad, flat = probe(src, dict(preset=preset, **plan_args))
        if bad:
            from .plan import _ranges

            why = {r: [i for i in bad if bad[i] == r] for r in dict.fromkeys(bad.values())}
            raise RewriteError("lengths cannot replace the masks of " + "; ".join(
                f"layers {_ranges(ix)}: {r}" for r, ix in why.items()))
    from .rotary import positions_for

    # the rotary inside the ops for ONNX Runtime (its GroupQueryAttention and ours); TensorRT's form keeps it outside
    if rotary_positions is None:
        rotary_positions = positions_for(src)
    positions = rotary_positions if target == "onnxruntime" and rotary_positions > 0 else None
    rewrite = TurboQuantRewrite(preset, cache="in-place", q_heads=heads, calibration=calibration, value_offsets=value_offsets,
                                key_scales=key_scales, kept_raw16=target == "tensorrt", rotary_positions=positions,
                                flat_outputs=flat, plan=plan, **plan_args)
    rewrite(model)
    return rewrite.result


def _cache_form(model: ir.Model, cache: str, target: str) -> tuple[str, str | None]:
    """The cache form to write and, where auto falls back to concat, why."""
    graph_inputs = {v.name for v in model.graph.inputs}
    reasons = []
    caches = [v for v in model.graph.inputs if any(p.match(v.name or "") for p in _KV_NAMES)]
    if target == "tensorrt" and any(v.dtype == ir.DataType.FLOAT for v in caches):
        reasons.append("--target tensorrt with float32 caches (the in-place form's TensorRT kept layers are raw16, "
                       "16-bit rows, which would round them)")
    if any(n.op_type == "If" for n in model.graph):
        reasons.append("a merged decoder (an If on use_cache_branch); export it unmerged for the in-place form")
    missing = [n for n in ("attention_mask", "input_ids") if n not in graph_inputs]
    if missing:
        reasons.append(f"no {' or '.join(missing)} input, from which the in-place form takes the lengths")
    if cache == "in-place" and reasons:
        raise RewriteError(f"--cache in-place is not possible for this model: {'; '.join(reasons)}")
    if cache == "auto":
        return ("concat", "; ".join(reasons)) if reasons else ("in-place", None)
    return cache, None


# What every preset calibrates on unless told (export/calibrate.py DATA_FREE): the model's own text,
# which beat random ids on every preset with Lloyd-Max keys in the evaluation, exported and
# genai-built models alike; fp8 keys (k8v4) since their scales (docs/performance.md#quality).
DATA_FREE_DEFAULT = "self"


def _data_file(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(f"{out.name}.data")


def _check_writable(path: pathlib.Path, what: str = "the output") -> None:
    from turboquant.arguments import check_output_file

    try:
        check_output_file(path, what)
    except ValueError as e:
        raise RewriteError(str(e)) from None


def _refuse_input_files(src: pathlib.Path, model: ir.Model, out: pathlib.Path) -> None:
    """The output and its data file may be none of the input's files (compared as files, so a hard
    link or another spelling of the same path counts): the model or its external data."""
    inputs = [src] + sorted(_external_files(src, model))
    for mine in (out, _data_file(out)):
        for theirs in inputs:
            if os.path.exists(mine) and os.path.exists(theirs) and os.path.samefile(mine, theirs):
                what = "model" if theirs == src else f"external data file {theirs.name}"
                raise RewriteError(f"the output {mine} is the input's {what}; turboquant never overwrites its input")


def _refuse_missing_data(src: pathlib.Path, model: ir.Model) -> None:
    """Every external data file the model names must be there: calibration and saving read them."""
    for f in sorted(_external_files(src, model)):
        if not f.is_file():
            why = "is a folder" if f.is_dir() else "does not exist"
            raise RewriteError(f"{src}: its external data file {f} {why}")


def _save(model: ir.Model, out: pathlib.Path, stage_more=None, check=None) -> None:
    """Writes the model, its external data and stage_more(tmp)'s (staged, final) files under temporary
    names in the output folder, then publishes them together (turboquant.saving): nothing that exists
    is replaced, and a failure leaves none of them and no folder it made."""
    external = _saved_external(model)
    data = _data_file(out)
    try:
        with staging(out.parent) as tmp:
            # the graph names its data file relative to itself: saved under the final names, in tmp
            ir.save(model, tmp / out.name, external_data=data.name if external else None)
            files = [(tmp / data.name, data)] if external else []  # the data first: no graph without it
            files.append((tmp / out.name, out))
            if stage_more is not None:
                files += stage_more(tmp)
            if check is not None:  # the files as they will be published, before any is
                check(files, tmp)
            publish(files, "the output")
    except OutputExists as e:
        raise RewriteError(str(e)) from None
    except OSError as e:
        raise RewriteError(f"cannot write {out}: {e.strerror or e}") from None


def _export_gqa(model: ir.Model, src: pathlib.Path, out: pathlib.Path, options: RewriteOptions, *, calibrate, progress,
                window, library=None) -> RewriteResult:
    """export() for onnxruntime-genai models (GroupQueryAttention). calibrate: a file, "random" or
    "self" (data-free), or False (no calibration), in windows of `window` tokens;
    export/calibrate_gqa.py measures it. progress: whether calibration shows its bars."""
    preset, boundary, skip_layers, keep_layers = options.preset, options.boundary, options.skip_layers, options.keep_layers
    dry_run, tokenizer, target, unsupported = options.dry_run, options.tokenizer, options.target, options.unsupported
    value_offsets, key_scales, cuda_graph = options.value_offsets, options.key_scales, options.genai_cuda_graph
    from . import genai

    genai_folder = target == "onnxruntime" and (src.parent / genai.CONFIG).is_file()  # genai runs ONNX Runtime only
    folder, window_cache, window_note = None, False, None
    paged = uses_paged(model)
    if genai_folder and not paged:  # its config read and every name the output folder gets refused before any work
        window_cache, window_note = genai.keeps_window_cache(genai.read_config(src.parent / genai.CONFIG)[1],
                                                             cuda_graph=cuda_graph)
    if genai_folder and not dry_run:
        folder = genai.plan_folder(src, out, library or _ort_library(), cuda_graph)
    if genai_folder and unsupported == "leave":  # before the calibration: a folder genai could not run is refused
        from .gqa import refuse_mixed_genai_folder, unsupported_layers

        refuse_mixed_genai_folder(unsupported_layers(model, preset, boundary=boundary, skip_layers=skip_layers,
                                                     keep_layers=[] if keep_layers == "auto" else keep_layers))
    calibration, notes = None, []
    plan = None  # plan_gqa_layers of `model` for the rewrite: planned once, where the calibration plans
    if paged:  # refused at once, before the calibration
        from .paged import check_supported as check_paged, plan_paged_layers

        check_paged(model, preset, plan=plan_paged_layers(model, preset, boundary, skip_layers,
                                                           [] if keep_layers == "auto" else keep_layers))
    if calibrate is not False:
        from .calibrate import calibration_tokens, runtime_failures
        from .calibrate_gqa import collect_gqa
        from .gqa import check_supported, plan_gqa_layers
        from .layer_cost import measured_keep

        auto_keep = keep_layers == "auto"
        planned = [] if auto_keep else keep_layers  # auto: every layer calibrated, then the costliest kept
        if paged:
            from .paged import plan_paged_layers

            plan = plan_paged_layers(model, preset, boundary, skip_layers, planned)
        else:
            plan = plan_gqa_layers(model, preset, boundary, skip_layers, planned)
            check_supported(model, preset, boundary=boundary, skip_layers=skip_layers, keep_layers=planned,
                            unsupported=unsupported, plan=plan)

        with runtime_failures("calibration"), _calibration_model(src, paged) as runnable:
            ids, source = calibration_tokens(calibrate, tokenizer, model, runnable, progress, window)
            if ids is not None:
                calibration, notes = collect_gqa(runnable, ids, source, preset=preset, boundary=boundary,
                                                 skip_layers=skip_layers, keep_layers=planned, key_scales=key_scales,
                                                 progress=progress, window=window)
                if auto_keep:
                    plans, _, _ = plan
                    keep_layers, chosen = measured_keep(runnable, ids, calibration, plans, preset, 2 * boundary,
                                                        value_offsets=value_offsets, key_scales=key_scales,
                                                        progress=progress)
                    notes.append(chosen)
        if ids is None and auto_keep:
            raise RewriteError(f"--keep-layers auto measures the layers on calibration tokens, and there are none: {source}")
        if auto_keep:  # the rewrite plans with the layers it chose
            plan = None
        if ids is None:
            notes.append(f"not calibrated: {source}")
    # TensorRT takes each cache's shape as declared: every layer gets its own row width
    rewrite = TurboQuantRewrite(preset, boundary=boundary, skip_layers=skip_layers, keep_layers=keep_layers,
                                unsupported=unsupported, per_layer=True if target == "tensorrt" else None,
                                calibration=calibration, value_offsets=value_offsets, key_scales=key_scales, plan=plan,
                                window_cache=window_cache)
    rewrite(model)
    result = rewrite.result
    result.notes += notes
    if window_note and any("window-sized caches" in n for n in result.notes):
        result.notes.append(f"  {window_note}")
    if target == "tensorrt":
        from .tensorrt import for_tensorrt, foreign_ops

        for_tensorrt(model)
        foreign = foreign_ops(model)
        if foreign:
            result.notes.append("TensorRT's ONNX parser knows none of these ops left in the model (ONNX Runtime contrib "
                                f"ops, not plugins): {', '.join(foreign)}; an engine needs them replaced first")
    if dry_run:
        return result
    writes_folder = folder is not None and not result.left
    checked = []

    def check(files, tmp):
        from .genai_check import check_folder, staged_view

        checked.append(check_folder(staged_view(files, tmp / "check"), out.name))

    _save(model, out, (lambda tmp: genai.stage_folder(folder, out, result, tmp)) if writes_folder else None,
          check if writes_folder else None)
    result.output = out
    result.notes += checked
    if writes_folder:
        result.notes.append(f"onnxruntime-genai folder: {out.parent / genai.CONFIG}"
                            + (", decode steps replayed from CUDA graphs on the cuda provider (enable_cuda_graph)"
                               if cuda_graph else ""))
    elif genai_folder:
        result.notes.append(f"no {genai.CONFIG} written: layers {result.left} keep float caches"
                            + (" (nor CUDA graphs enabled)" if cuda_graph else ""))
    return result


def _refuse_paged_options(options: RewriteOptions) -> None:
    """The options a paged model (PagedAttention, onnxruntime-genai's Engine) does not take."""
    if options.target != "onnxruntime":
        raise RewriteError("--target tensorrt does not apply to paged models (PagedAttention): they are served by "
                           "onnxruntime-genai's Engine, which runs ONNX Runtime")
    if options.unsupported != "refuse":
        raise RewriteError("--unsupported leave does not apply to paged models: the Engine allocates every pool in one "
                           "dtype, so a layer left with float pools could not run beside the uint8 ones")
    if options.genai_cuda_graph:
        raise RewriteError("--genai-cuda-graph applies to GroupQueryAttention folders (og.Generator); the Engine of "
                           "a paged folder takes its own genai_config.json settings")


@contextlib.contextmanager
def _calibration_model(src: pathlib.Path, paged: bool):
    """The model the calibration runs: src, or for a paged model (PagedAttention, which ONNX Runtime's
    CPU provider does not run) its GroupQueryAttention twin (export/paged_twin.py) in a temporary
    folder, with the same layer numbers."""
    if not paged:
        yield src
        return
    import tempfile

    from .paged_twin import gqa_twin

    with tempfile.TemporaryDirectory(prefix="turboquant-twin-") as tmp:
        twin = pathlib.Path(tmp) / "model.onnx"
        ir.save(gqa_twin(ir.load(src)), twin, external_data="model.onnx.data")
        yield twin


def _initializer_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def _saved_external(model: ir.Model) -> bool:
    """Whether the output keeps its weights in a data file: the input did, or they pass protobuf's 2 GB."""
    return _has_external_data(model) or _initializer_bytes(model) > 1_800_000_000


def _has_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())


def _external_files(src: pathlib.Path, model: ir.Model) -> set[pathlib.Path]:
    files = set()
    for v in model.graph.initializers.values():
        if isinstance(v.const_value, ir.ExternalTensor):
            files.add((src.parent / v.const_value.location).resolve())
    return files
