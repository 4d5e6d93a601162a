"""The architecture coverage run: every architecture of turboquant/architectures.py that the
installed onnxruntime-genai builder and transformers both take, as a tiny random model (no
download), built for the CPU (fp32) and rewritten with the default preset, then both folders run
through onnxruntime-genai's Generator, teacher-forced on the original's greedy tokens; the CUDA
build (fp16) rewritten with a dry run. Prints the coverage table (docs/usage.md holds a copy).

    python -m turboquant.coverage [--only NAME ...] [--out DIR] [--torch]

Needs torch, transformers and onnxruntime-genai (the `test` extra).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import sys
import tempfile

import numpy as np

from .architectures import ARCHITECTURES, Architecture, _longrope

PRESET = "turboquant_4bit_nc"
PROMPT, STEPS, PROMPTS = 48, 32, 4  # the run (a 48-token prompt, 32 teacher-forced steps), on 4 prompts
MIN_TOP1 = 0.85


@dataclasses.dataclass
class Row:
    name: str
    builder: str = ""  # genai's builder class, or why it has none
    compressed: list = dataclasses.field(default_factory=list)
    kept: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)  # left as GroupQueryAttention (features the op lacks)
    features: str = ""  # the source's windows, softcap and sinks, which the rewrite keeps
    states: str = ""  # the source's state layers (conv, recurrent), which the rewrite leaves as they were
    top1: float | None = None
    cuda: str = ""  # the CUDA build's dry run
    torch_forms: dict = dataclasses.field(default_factory=dict)  # exporter -> cache form
    error: str = ""
    notes: list = dataclasses.field(default_factory=list)  # the rewrite's summary notes

    def cells(self) -> list[str]:
        comp = _ranges(self.compressed) or "none"
        kept = _ranges(self.kept) or "none"
        left = _ranges(self.left)
        what = f"compressed {comp}; raw16 {kept}" + (f"; left as they were {left}" if left else "")
        what += f"; state layers untouched ({self.states})" if self.states else ""
        top1 = "" if self.top1 is None else f"{self.top1:.0%}"
        forms = ", ".join(f"{k}: {v}" for k, v in self.torch_forms.items())
        return [self.name, self.builder, self.features or "none", self.error or what, top1, self.cuda, forms]


def _ranges(ix) -> str:
    from turboquant.export.plan import _ranges as r

    return r(sorted(ix)) if ix else ""


def hf_model(arch: Architecture, seed: int = 0, head_scale: float = 6.0):
    """The architecture's random Hugging Face model: peaked predictions (turboquant/random_decoders.py)."""
    import torch
    import transformers

    kw = arch.config_kwargs()
    longrope = kw.pop("_longrope", False)
    if arch.vision is None:
        cfg = text = transformers.AutoConfig.for_model(arch.model_type, **kw)
    else:  # the vision-language class: kw is its text config
        cfg = transformers.AutoConfig.for_model(arch.model_type, text_config=kw, vision_config=arch.vision,
                                                tie_word_embeddings=kw["tie_word_embeddings"])
        text = cfg.text_config
    for k, v in kw.items():  # what this transformers' config class no longer keeps, genai's builder may read
        if not hasattr(text, k):
            setattr(text, k, v)
    if longrope:
        head = cfg.hidden_size // cfg.num_attention_heads
        factor = kw.get("partial_rotary_factor", 1.0)
        cfg.rope_parameters = {**_longrope(int(head * factor), kw["original_max_position_embeddings"]),
                               "rope_theta": 10000.0, "partial_rotary_factor": factor}
    rope = getattr(cfg, "rope_parameters", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        # per-layer-type rotary (transformers 5's Gemma 3): genai 0.18's builder reads a top-level rope_type
        cfg.rope_parameters = {**rope, "rope_type": "default", "rope_theta": rope.get("full_attention", {}).get("rope_theta")}
    cfg.architectures = [arch.architecture]
    for c in (cfg, text):
        c.bos_token_id, c.eos_token_id, c.pad_token_id = 1, 2, 2
    torch.manual_seed(seed)
    if arch.vision is None:
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    else:  # the class the builder loads (AutoModelForCausalLM's text-only class names its weights otherwise)
        model = getattr(transformers, arch.architecture)(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    return model


def build(arch: Architecture, folder: pathlib.Path, precision: str = "fp32", provider: str = "cpu") -> pathlib.Path:
    from . import random_decoders

    hf = folder / "hf"
    if not (hf / "config.json").is_file():
        try:
            model = hf_model(arch)
        except (ValueError, AttributeError) as e:  # an unknown model_type or class: the row's answer
            import transformers

            raise RuntimeError(f"transformers {transformers.__version__} cannot make it: {e}") from None
        model.save_pretrained(hf)
        random_decoders.save_tokenizer(hf, arch.config_kwargs()["vocab_size"])
    return build_in_process(hf, folder / f"{provider}-{precision}", precision, provider, folder / "cache")


def build_in_process(hf: pathlib.Path, out: pathlib.Path, precision: str, provider: str, cache: pathlib.Path
                     ) -> pathlib.Path:
    """genai's builder called here rather than as `python -m` (random_decoders.build_genai): torch and
    transformers are imported once for every architecture, not once per build."""
    import contextlib
    import io

    from onnxruntime_genai.models import builder

    args = (None, str(hf), str(out), precision, provider, str(cache))
    try:
        with contextlib.redirect_stdout(io.StringIO()), _gemma3_local_base_freq():
            builder.create_model(*args, **builder.parse_extra_options(*args, []))
    except Exception as e:  # noqa: BLE001 - the builder's own refusals are the row's answer
        raise RuntimeError(f"{type(e).__name__}: {e}") from None
    if not (out / "model.onnx").is_file():
        raise RuntimeError("the builder wrote no model.onnx")
    return out / "model.onnx"


@contextlib.contextmanager
def _gemma3_local_base_freq():
    """genai 0.18's Gemma 3 builder reads config.rope_local_base_freq, which transformers 5 folds into
    rope_parameters["sliding_attention"]: given back, while the builder runs, as a property reading it."""
    import transformers

    klass = getattr(transformers, "Gemma3TextConfig", None)
    if klass is None or hasattr(klass, "rope_local_base_freq"):
        yield
        return
    klass.rope_local_base_freq = property(
        lambda self: ((self.rope_parameters or {}).get("sliding_attention") or {}).get("rope_theta", 10000.0))
    try:
        yield
    finally:
        del klass.rope_local_base_freq


def greedy_and_logits(folder: pathlib.Path, ids: np.ndarray, prompt: int, follow: np.ndarray | None = None):
    """og.Generator over folder: the prompt, then one token per step, either its own greedy choice
    (follow None) or follow's; returns (the tokens fed after the prompt, each step's argmax)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt + STEPS + 1, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids[None, :prompt].astype(np.int32))
    fed, top = [], []
    for t in range(STEPS):
        best = int(np.asarray(gen.get_logits())[0, -1].argmax())
        top.append(best)
        nxt = best if follow is None else int(follow[t])
        fed.append(nxt)
        gen.append_tokens(np.array([[nxt]], np.int32))
    del gen, params, model
    return np.array(fed), np.array(top)


def teacher_forced_top1(original: pathlib.Path, rewritten: pathlib.Path, vocab: int, prompts: int = PROMPTS) -> float:
    """The share of steps where the rewrite's top token is the original's greedy one, fed the
    original's tokens, over `prompts` random prompts (one prompt's greedy path through a random
    model's flat stretches swings it by a quarter)."""
    hits = []
    for seed in range(prompts):
        ids = np.random.default_rng(seed).integers(3, vocab, PROMPT)
        tokens, _ = greedy_and_logits(original, ids, PROMPT)
        _, top = greedy_and_logits(rewritten, ids, PROMPT, follow=tokens)
        hits.append(top == tokens)
    return float(np.mean(hits))


def cover(arch: Architecture, work: pathlib.Path, cuda: bool = True, torch_exporters=()) -> Row:
    """One architecture's row: built, rewritten, run."""
    from turboquant.export import RewriteError, export

    row = Row(arch.name)
    folder = folder_of(arch, work)
    if torch_exporters and arch.torch_export:
        row.torch_forms = torch_forms(arch, folder, torch_exporters)
    try:
        src = build(arch, folder)
    except RuntimeError as e:
        why = str(e).strip().splitlines()[-1][:160]
        row.builder, row.error = "none", why if why.startswith("transformers ") else f"the builder refused it: {why}"
        return row
    row.builder = _builder_class(src)
    row.features = attention_features(src)
    try:
        result = export(src, PRESET, folder / "tq" / "model.onnx", boundary=arch.boundary, calibrate="random",
                        progress=False, unsupported="leave")
    except RewriteError as e:
        row.error = f"refused: {e}"
        return row
    row.compressed, row.kept, row.left = result.compressed, [i for i in result.kept if i not in result.left], result.left
    row.notes = list(result.notes)
    row.states, changed = state_layers(src, result.output)
    if changed:
        row.error = changed
        return row
    row.top1 = teacher_forced_top1(src.parent, result.output.parent, arch.config_kwargs()["vocab_size"])
    if cuda:
        row.cuda = cuda_dry_run(arch, folder)
    return row


def folder_of(arch: Architecture, work: pathlib.Path) -> pathlib.Path:
    """Where cover() builds the architecture: its Hugging Face folder hf/, the CPU build cpu-fp32/,
    the rewrite tq/."""
    return work / "".join(c if c.isalnum() else "_" for c in arch.name)


def torch_forms(arch: Architecture, folder: pathlib.Path, exporters=("torchscript", "dynamo")) -> dict[str, str]:
    """The cache form the default rewrite gives each torch.onnx export of the architecture: "in-place",
    or "concat (why)", or why there is no export."""
    from turboquant.export import RewriteError, export

    from . import random_decoders

    forms = {}
    for exporter in exporters:
        path = folder / f"{exporter}.onnx"
        try:
            random_decoders.export_model(hf_model(arch), path, exporter)
        except Exception as e:  # noqa: BLE001 - torch.onnx's own failures are the cell's answer
            forms[exporter] = f"no export ({type(e).__name__})"
            continue
        try:
            r = export(path, PRESET, folder / f"{exporter}.tq.onnx", boundary=1, calibrate="random", progress=False,
                       dry_run=True)
        except RewriteError as e:
            forms[exporter] = f"refused: {str(e)[:160]}"
            continue
        why = next((n for n in r.notes if n.startswith("cache form concat")), None)
        forms[exporter] = "in-place" if why is None else why.replace("cache form ", "")[:200]
    return forms


def cuda_dry_run(arch: Architecture, folder: pathlib.Path) -> str:
    from turboquant.export import RewriteError, export

    try:
        src = build(arch, folder, "fp16", "cuda")
    except RuntimeError as e:
        return f"no build: {str(e).strip().splitlines()[-1][:120]}"
    try:
        r = export(src, PRESET, folder / "tq-cuda" / "model.onnx", boundary=arch.boundary, calibrate="random", progress=False,
                   unsupported="leave", dry_run=True)
    except RewriteError as e:
        return f"refused: {e}"
    notes = " (Q/K norm unfused)" if any("unfused" in (p.form or "") for p in r.layers) else ""
    return f"dry run: compressed {_ranges(r.compressed) or 'none'}{notes}"


def state_layers(src: pathlib.Path, rewritten: pathlib.Path) -> tuple[str, str]:
    """('conv: layers 0-1, 3-4; recurrent: layers 0-1, 3-4', '') for a genai folder's state inputs
    (its genai_config.json's past_*_names other than the KV cache's), each checked untouched by the
    rewrite: the same input and present output, the same nodes (ops, attributes, inputs, outputs)
    reading the one and writing the other; else the second item names the first difference."""
    import re

    import onnx

    decoder = json.loads((src.parent / "genai_config.json").read_text())["model"]["decoder"]
    kinds = [k[len("past_"):-len("_names")] for k in decoder["inputs"]
             if k.startswith("past_") and k.endswith("_names") and k not in ("past_key_names", "past_value_names")]
    graphs = [onnx.load(str(p), load_external_data=False).graph for p in (src, rewritten)]

    def seen(graph, name):  # the value as a graph input or output, and the nodes reading or writing it
        nodes = [(n.op_type, n.domain, list(n.input), list(n.output),
                  sorted((a.name, str(onnx.helper.get_attribute_value(a))) for a in n.attribute))
                 for n in graph.node if name in n.input or name in n.output]
        return [v.SerializeToString() for v in [*graph.input, *graph.output] if v.name == name], nodes

    parts = []
    for kind in kinds:
        past, present = decoder["inputs"][f"past_{kind}_names"], decoder["outputs"].get(f"present_{kind}_names", "")
        regex = re.compile("^" + re.escape(past).replace("%d", r"(\d+)") + "$")
        layers = sorted(int(m[1]) for v in graphs[0].input if (m := regex.match(v.name)))
        for i in layers:
            for name in (past % i, present % i if present else None):
                if name and seen(graphs[0], name) != seen(graphs[1], name):
                    return "", f"the rewrite changed state layer {i}: {name!r} or the nodes on it"
        if layers:
            parts.append(f"{kind}: layers {_ranges(layers)}")
    return "; ".join(parts), ""


def attention_features(src: pathlib.Path) -> str:
    """'window 16: layers 0-4; softcap 50: 0-3; sinks: 0-3' for the source's GroupQueryAttention nodes."""
    import onnx

    windows, softcaps, sinks = {}, {}, []
    layer = 0
    for n in onnx.load(str(src), load_external_data=False).graph.node:
        if n.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if attrs.get("local_window_size", -1) > 0:
            windows.setdefault(attrs["local_window_size"], []).append(layer)
        if attrs.get("softcap", 0.0):
            softcaps.setdefault(attrs["softcap"], []).append(layer)
        if len(n.input) > 11 and n.input[11]:  # GroupQueryAttention's head_sink
            sinks.append(layer)
        layer += 1
    parts = [f"window {w}: layers {_ranges(ix)}" for w, ix in windows.items()]
    parts += [f"softcap {c:g}: layers {_ranges(ix)}" for c, ix in softcaps.items()]
    parts += [f"sinks: layers {_ranges(sinks)}"] if sinks else []
    return "; ".join(parts)


def _builder_class(src: pathlib.Path) -> str:
    cfg = json.loads((src.parent / "genai_config.json").read_text())
    return cfg["model"]["type"]


def table(rows: list[Row]) -> str:
    head = ["architecture", "genai model type", "windows, softcap, sinks (kept)", "CPU build: layers", "teacher-forced top-1", "CUDA build (fp16)",
            "torch.onnx exports"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turboquant.coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="architectures whose name contains one of these")
    p.add_argument("--out", help="work folder (default: a temporary one)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA builds' dry runs")
    p.add_argument("--torch", action="store_true", help="also export each with torch.onnx (TorchScript and dynamo) and "
                   "give the default rewrite's cache form")
    args = p.parse_args(argv)
    archs = [a for a in ARCHITECTURES if not args.only or any(s.lower() in a.name.lower() for s in args.only)]
    with tempfile.TemporaryDirectory(prefix="turboquant-coverage-") as tmp:
        work = pathlib.Path(args.out or tmp)
        rows = []
        for a in archs:
            rows.append(cover(a, work, cuda=not args.no_cuda,
                              torch_exporters=("torchscript", "dynamo") if args.torch else ()))
            print(rows[-1].cells(), file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
