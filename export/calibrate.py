"""Calibration: the mean post-RoPE key (and value) of each layer and KV head, and a per-channel key
scale that weighs the key quantization error by what the queries read.

Offsets. Attention is unchanged when one vector is subtracted from every key of a head (each
query's scores move by one constant, which softmax removes), and LLM keys carry large fixed
per-channel components that waste the codebook.

Key scales. Scores are unchanged when channel i of every query is multiplied by s_i and channel i of
every key divided by it: export/key_scale.py chooses s for Lloyd-Max keys by the error it leaves in
each attention's output, from the calibration's queries, keys and values. The bytes per token do not change.
fp8 keys (no rotation) take another scale: s_i = the largest |k_i| calibrated (k centred) / 64, so
that every channel's extreme key lands on 64, a value e4m3 holds exactly, 7x under its 448
(fp8_key_scale).

The original model runs in ONNX Runtime on a few windows of calibration tokens from an empty cache
(a prefill, so every key is a new key); its present.N.key / present.N.value outputs are exactly the
keys and values each layer caches, and the queries are read where each attention takes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator

import numpy as np

from turboquant.config import TQ_PRESETS

from .errors import RewriteError
from .key_scale import AttentionMoments


@dataclasses.dataclass
class Calibration:
    keys: dict[int, np.ndarray]  # layer -> mean key, float32 [Hkv, D]
    values: dict[int, np.ndarray]  # layer -> mean value, float32 [Hkv, D]
    tokens: int
    source: str
    key_scales: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # layer -> s, float32 [Hkv, D]
    q_heads: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> query heads
    value_scales: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # layer -> s, float32 [Hkv, D]
    window: int = 0  # tokens per prefilled window


def calibration_metadata(calibration: Calibration | None, value_offsets: bool, key_scales: bool) -> dict[str, str]:
    """What calibrated a rewritten model, for its metadata_props (None: not calibrated, said so)."""
    if calibration is None:
        return {"turboquant.offsets": "none", "turboquant.key_scales": "no", "turboquant.calibration": "none"}
    return {"turboquant.offsets": "keys and values" if value_offsets else "keys",
            "turboquant.key_scales": "yes" if key_scales and calibration.key_scales else "no",
            "turboquant.value_scales": "yes" if calibration.value_scales else "no",
            "turboquant.calibration": f"{calibration.source}, {calibration.tokens} tokens in windows of {calibration.window}"}


FP8_KEY_PEAK = 64.0  # where fp8_key_scale puts each channel's largest calibrated |k|: exact in e4m3, 7x under 448


def fp8_key_scale(peak: np.ndarray, limit: float = 4096.0) -> np.ndarray:
    """s = peak / 64 per KV head and channel, peak the largest |k| calibrated (k centred), kept within
    [1/limit, limit] (queries are multiplied by it, in the model's float type). A power-of-two scale
    changes no rounding of e4m3; this one changes the mantissas, and the channels' extreme keys (on the
    head_dim-128 model, those of the first token, which every query reads) become exact: it cut the
    score error of fp8 keys 3x against offsets alone (docs/performance.md, Quality)."""
    s = np.where(peak > 0, peak / FP8_KEY_PEAK, 1.0)
    return np.clip(s, 1.0 / limit, limit).astype(np.float32)


def key_peaks(sums: dict, layer: int, mean_k: np.ndarray) -> np.ndarray:
    """The largest |k - mean| per KV head and channel, from add_cache_sums' extremes."""
    return np.maximum(sums["kmax"][layer] - mean_k, mean_k - sums["kmin"][layer])


def load_tokens(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None, model=None) -> tuple[np.ndarray, str]:
    """Token ids from a .npy/.ids file, or from text through a local Hugging Face tokenizer; each
    within the vocabulary of `model` (an onnx_ir.Model) where it says its size."""
    from turboquant.tokens import load_tokens as load

    try:
        return load(path, tokenizer, vocab=vocabulary_size(model) if model is not None else None)
    except ValueError as e:
        raise RewriteError(f"calibration file: {e}") from None


def check_calibration_interface(model, calibrate) -> None:
    """The calibration feeds token ids to `input_ids` and, writing text with the model ("self"),
    reads its logits (the `logits` output, else the first, which must then be as wide as the
    vocabulary): refused before any work where the model lacks them (onnxruntime-genai's
    exclude_embeds and exclude_lm_head builds), rather than failing or calibrating on hidden states."""
    vocab = vocabulary_size(model)
    if vocab is None and calibrate in DATA_FREE:
        return  # no data-free tokens without a vocabulary: the rewrite goes on uncalibrated and says so
    names_in = [v.name for v in model.graph.inputs]
    if "input_ids" not in names_in:
        raise RewriteError(f"the calibration feeds token ids and the model has no input_ids input (it takes "
                           f"{', '.join(names_in[:3])}, ...; onnxruntime-genai's exclude_embeds builds take "
                           "inputs_embeds): rewrite it with --no-offsets")
    outputs = list(model.graph.outputs)
    taken = next((v for v in outputs if v.name == "logits"), outputs[0] if outputs else None)  # DecoderSession's
    width = taken.shape[-1] if taken is not None and taken.shape is not None and len(taken.shape) else None
    if calibrate == "self" and taken is not None and taken.name != "logits" and width != vocab:
        raise RewriteError("the default calibration writes text with the model and reads its 'logits' output, which "
                           "this model lacks (onnxruntime-genai's exclude_lm_head builds): give --calibrate random "
                           "(random token ids), a text file, or --no-offsets")


@contextlib.contextmanager
def runtime_failures(what: str) -> Iterator[None]:
    """ONNX Runtime's failures running the original model for the calibration (its own exception
    types among them) as one RewriteError: a model this machine's ONNX Runtime cannot run (bfloat16
    matrix products on the CPU) is refused with the reason, not a traceback."""
    try:
        yield
    except RewriteError:
        raise
    except Exception as e:  # noqa: BLE001 - ONNX Runtime's exception types share no base but Exception
        if not (type(e).__module__.startswith("onnxruntime") or isinstance(e, RuntimeError)):
            raise
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise RewriteError(f"{what}: ONNX Runtime could not run the original model ({type(e).__name__}: {first}); "
                           "--no-offsets rewrites it without calibration") from None


DATA_FREE = ("random", "self")  # --calibrate's data-free sources: random token ids, the model's own text
CALIBRATION_TOKENS = 4096  # what the calibration prefills, in windows of --calibration-window tokens
DEFAULT_WINDOW = 256  # fp8 keys' (turboquant_k8v4), and the default of the functions that take a window
LLOYD_MAX_WINDOW = 1024


def default_window(preset: str) -> int:
    """The calibration window a preset gets unless told: 1024 tokens for Lloyd-Max keys, whose key
    scales fitted in 256-token windows lost 2-2.5x more in 2048-token contexts; 256 for fp8 keys,
    which longer windows did not help (docs/performance.md#quality)."""
    return LLOYD_MAX_WINDOW if TQ_PRESETS.get(preset, {}).get("key_quant_bits") in (3, 4) else DEFAULT_WINDOW


def window_count(window: int) -> int:
    """How many windows of `window` tokens the calibration prefills (at least one)."""
    return max(1, CALIBRATION_TOKENS // window)


def check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 16 <= window <= 65536:
        raise RewriteError(f"calibration window must be an integer from 16 to 65536 tokens, got {window!r}")


def calibration_tokens(calibrate, tokenizer, model, model_path, progress: bool = False,
                       window: int = DEFAULT_WINDOW) -> tuple[np.ndarray | None, str]:
    """The tokens the rewrite calibrates on, and what they are: calibrate "random" (random token
    ids, windows' worth), "self" (export/self_text.py: the 16 sequences of 256 tokens the original
    model at model_path writes itself, whatever the window: a window longer than one takes several
    back to back) or a file (load_tokens). Returns (None, reason) when a data-free source cannot be
    used on this model."""
    if isinstance(calibrate, str) and calibrate in DATA_FREE:
        if calibrate == "random":
            return data_free_tokens(model, count=window_count(window) * window)
        from .self_text import self_generated_tokens

        return self_generated_tokens(model_path, vocabulary_size(model), progress=progress)
    return load_tokens(calibrate, tokenizer, model)


def data_free_tokens(model, count: int = CALIBRATION_TOKENS, seed: int = 0) -> tuple[np.ndarray | None, str]:
    """Random token ids over the model's vocabulary, for calibrating without text: the fixed
    per-channel parts of keys that offsets remove, and the channel energies that scales balance,
    come mostly from the weights, not from the text (text the model writes itself, "self", does
    better still: docs/performance.md#quality). Returns (None, reason) when the vocabulary size cannot be read from the model."""
    vocab = vocabulary_size(model)
    if vocab is None:
        return None, "none (the vocabulary size is not in the model)"
    ids = np.random.default_rng(seed).integers(0, vocab, count)
    return ids, f"data-free (random token ids, seed {seed})"


def vocabulary_size(model) -> int | None:
    """The last dimension of the logits output, else the row count of the embedding table."""
    for out in model.graph.outputs:
        if out.name == "logits" and out.shape is not None and isinstance(out.shape[-1], int):
            return int(out.shape[-1])
    for inp in model.graph.inputs:
        if inp.name != "input_ids":
            continue
        for user in inp.consumers():
            table = user.inputs[0] if user.op_type == "Gather" else None
            if table is not None and table.const_value is not None and len(table.const_value.shape) == 2:
                return int(table.const_value.shape[0])
    return None


def _unmerge(model) -> None:
    """A merged decoder (an If on use_cache_branch whose branches are the decoder with and without a
    past) becomes its with-past branch, in place: its queries are then values of the main graph.
    Calibration runs it from empty caches, which the with-past branch takes as well."""
    import onnx_ir as ir

    main = model.graph
    for node in list(main):
        if node.op_type != "If" or "then_branch" not in node.attributes:
            continue
        branch = node.attributes["then_branch"].value
        if not any(n.op_type == "Concat" or n.op_type == "Attention" for n in branch):
            continue
        for n in list(branch):
            branch.remove(n)
            main.insert_before(node, n)
        inners = list(branch.outputs)
        branch.outputs.clear()
        for outer, inner in zip(node.outputs, inners):
            name = outer.name
            outer.name = f"{name}_merged"
            inner.name = name
            outer.replace_all_uses_with(inner, replace_graph_outputs=True)
        main.remove(node, safe=True)
        ir.passes.common.RemoveUnusedNodesPass()(model)
        return


def _query_probe(model_path, plan_args: dict, layers: list[int]) -> tuple[bytes, dict[int, tuple[str, int, float | None]]]:
    """The model (a merged decoder unmerged first) that also outputs, as float32, the queries of the
    given layers' attention, serialized with its weights left in the model's own data files.
    Returns it and, per layer, (output name, query heads or 0 for 4-D queries, the attention's scale
    or None for 1/sqrt(D))."""
    import onnx_ir as ir

    from .forms import locate
    from .plan import plan_layers

    probe = ir.load(model_path)
    _unmerge(probe)
    _, cache_layers = plan_layers(probe, **plan_args)
    found = {}
    for i in layers:
        site = locate(cache_layers[i])
        if site.anchor.graph is not probe.graph:
            continue
        cast = ir.node("Cast", [site.q], {"to": ir.DataType.FLOAT}, name=f"tq_calibration_q_{i}")
        site.anchor.graph.insert_before(site.anchor, cast)
        out = cast.outputs[0]
        out.name, out.dtype = f"tq_calibration_q_{i}", ir.DataType.FLOAT
        probe.graph.outputs.append(out)
        found[i] = (out.name, int(site.q_num_heads or 0), site.scale)
    return ir.to_proto(probe).SerializeToString(), found


def collect(model_path: str | os.PathLike, ids: np.ndarray, layers: list[int], source: str, *, plan_args: dict | None = None,
            window: int = DEFAULT_WINDOW, max_windows: int | None = None, progress: bool = True,
            value_scales: bool = False) -> Calibration:
    """Mean key and value per layer and KV head over up to max_windows (default window_count) windows
    of `window` tokens, (given plan_args, the rewrite's plan_layers arguments) the key scales from the
    queries, and (value_scales) the value scales."""
    from tqdm import tqdm

    from turboquant.decoder import DecoderSession
    from turboquant.ort import session_options_beside

    ids, window, starts = windows(ids, window, max_windows or window_count(window))
    queries: dict[int, tuple[str, int, float | None]] = {}
    if plan_args is not None:
        # from memory, its weights read from the model's own files: a copy would be another 16 GB
        # written at the 8B shape
        probe, queries = _query_probe(model_path, plan_args, layers)
        sess = DecoderSession(probe, options=session_options_beside(model_path))
    else:
        sess = DecoderSession(model_path)
    sums = {name: {} for name in ("k", "k2", "v")}
    count, q_heads, moments = 0, {}, {i: AttentionMoments() for i in queries}
    fp8 = plan_args is not None and TQ_PRESETS[plan_args["preset"]]["key_quant_bits"] == 8  # scaled from key peaks alone
    for s in tqdm(starts, desc="calibrating", unit="window", disable=not progress):
        outs = sess.run_all(ids[None, s:s + window], sess.empty_cache(1), 0)
        for layer in layers:
            k = add_cache_sums(sums, outs, sess, layer)
            if layer in queries:
                name, heads, scale = queries[layer]
                q = np.asarray(outs[name], np.float64)
                if q.ndim == 3:  # [B, S, Hq * D] -> [B, Hq, S, D]
                    q = q.reshape(q.shape[0], q.shape[1], heads, -1).transpose(0, 2, 1, 3)
                q_heads[layer] = q.shape[1]
                if not fp8:
                    moments[layer].add(q, k, outs[sess.cache_outputs[(layer, "value")]], scale)
        count += window
    mean_k = {i: sums["k"][i] / count for i in layers}
    if fp8:
        scales = {i: fp8_key_scale(key_peaks(sums, i, mean_k[i])) for i in moments}
    else:
        scales = {i: m.scales(mean_k[i]) for i, m in moments.items()}
    vscales = {i: value_scale(sums["v2"][i] / count) for i in layers} if value_scales else {}
    return Calibration({i: mean_k[i].astype(np.float32) for i in layers},
                       {i: (sums["v"][i] / count).astype(np.float32) for i in layers}, count, source, scales, q_heads,
                       vscales, window)


def windows(ids: np.ndarray, window: int, max_windows: int) -> tuple[np.ndarray, int, list[int]]:
    """The ids as one row, the window length (at most the ids'), and up to max_windows starts of
    windows that do not overlap, spread evenly over the whole text when it holds more: a text's
    first 4096 tokens cover few of its topics, and the calibration came out worse from them
    (docs/performance.md, Quality: text calibration)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size < 2:
        raise RewriteError("calibration needs at least 2 tokens")
    window = min(window, ids.size)
    count = ids.size // window
    picks = np.linspace(0, count - 1, min(count, max_windows)).round().astype(np.int64)
    return ids, window, [int(p) * window for p in picks]


def value_scale(value_sq: np.ndarray, limit: float = 16.0) -> np.ndarray:
    """s = sqrt(E[v^2]) per KV head and channel, normalised to a geometric mean of 1 per head and kept
    within [1/limit, limit]: values divided by it before the op (per-token uniform quantization then
    sees channels of one size) and the output multiplied by it after, which is exact."""
    v = np.sqrt(value_sq + 1e-6 * value_sq.mean(-1, keepdims=True) + 1e-30)
    v /= np.exp(np.log(v).mean(-1, keepdims=True))
    return np.clip(v, 1.0 / limit, limit).astype(np.float32)


def add_cache_sums(sums: dict, outs: dict, sess, layer: int) -> np.ndarray:
    """Adds a layer's keys and values of one window (and their squares), its present outputs, to
    sums["k"], sums["k2"], sums["v"], sums["v2"], and the keys' extremes to sums["kmax"], sums["kmin"];
    returns the keys [B, Hkv, S, D] as float64."""
    k = np.asarray(outs[sess.cache_outputs[(layer, "key")]], np.float64)
    v = np.asarray(outs[sess.cache_outputs[(layer, "value")]], np.float64)
    _add(sums["k"], layer, k.sum(axis=(0, 2)))
    _add(sums["k2"], layer, (k * k).sum(axis=(0, 2)))
    _add(sums["v"], layer, v.sum(axis=(0, 2)))
    _add(sums.setdefault("v2", {}), layer, (v * v).sum(axis=(0, 2)))
    hi, lo = k.max(axis=(0, 2)), k.min(axis=(0, 2))
    kmax, kmin = sums.setdefault("kmax", {}), sums.setdefault("kmin", {})
    kmax[layer] = np.maximum(kmax[layer], hi) if layer in kmax else hi
    kmin[layer] = np.minimum(kmin[layer], lo) if layer in kmin else lo
    return k


def _add(acc: dict, key, value) -> None:
    acc[key] = acc.get(key, 0.0) + value
