"""Small decoders made and exported here, for the example and the tests: randomly initialised
Hugging Face configs (no download), exported with torch.onnx with their KV cache.

Needs torch and transformers (the `test` extra). The initialisation is scaled up so that the models'
next-token predictions are peaked and depend on the input; with the default tiny init every
position predicts nearly the same flat distribution, and agreement between two models says nothing.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    family: str = "llama"  # "llama" (GQA, RoPE, RMSNorm), "qwen2" (GQA with q/k/v bias), "gpt2" (MHA),
    # "mistral" (Llama's attention through a sliding window of `window` tokens)
    layers: int = 6
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 512
    seed: int = 0
    key_bias: float = 0.0  # qwen2: std of random k_proj biases, i.e. a fixed per-channel component in the keys
    mlp: int | None = None  # the MLP's inner width (default 2 x hidden)
    max_positions: int = 1024
    init_range: float = 0.08  # std of the random weights
    head_scale: float = 6.0  # the output projection's extra factor (peaked predictions)
    window: int | None = None  # mistral: the sliding window


def build_model(cfg: TinyConfig, device: str | None = None, dtype=None):
    """device, dtype: where and in which torch dtype the weights are made (default: the CPU, fp32);
    a large model made on the GPU in fp16 takes seconds instead of minutes."""
    import contextlib

    import torch
    import transformers

    torch.manual_seed(cfg.seed)
    common = dict(vocab_size=cfg.vocab, initializer_range=cfg.init_range, use_cache=True)
    old_dtype = torch.get_default_dtype()
    place = torch.device(device) if device else contextlib.nullcontext()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with place:
            model = _hf_model(cfg, common, transformers)
    finally:
        torch.set_default_dtype(old_dtype)
    with torch.no_grad():  # peaked predictions: a larger output projection
        model.get_output_embeddings().weight.mul_(cfg.head_scale)
        if cfg.key_bias and cfg.family == "qwen2":
            for layer in model.model.layers:
                layer.self_attn.k_proj.bias.normal_(0.0, cfg.key_bias)
    return model.eval()


def _hf_model(cfg: TinyConfig, common: dict, transformers):
    if cfg.family in ("llama", "qwen2", "mistral"):
        klass = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                 "mistral": transformers.MistralConfig}[cfg.family]
        if cfg.family == "mistral":
            common = {**common, "sliding_window": cfg.window}
        hf = klass(hidden_size=cfg.hidden, intermediate_size=cfg.mlp or 2 * cfg.hidden, num_hidden_layers=cfg.layers,
                   num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                   max_position_embeddings=cfg.max_positions, tie_word_embeddings=False, **common)
        return transformers.AutoModelForCausalLM.from_config(hf)
    if cfg.family == "gpt2":
        if cfg.heads * cfg.head_dim != cfg.hidden:
            raise ValueError("gpt2: hidden must equal heads * head_dim")
        hf = transformers.GPT2Config(n_embd=cfg.hidden, n_layer=cfg.layers, n_head=cfg.heads, n_positions=cfg.max_positions,
                                     **common)
        return transformers.GPT2LMHeadModel(hf)
    raise ValueError(f"unknown family {cfg.family!r}")


class _CacheIO:
    """Wraps a HF causal LM as f(input_ids, attention_mask, position_ids, *flat_past) -> (logits, *flat_present)."""

    def __init__(self, model, layers: int):
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.m = model

            def forward(self, input_ids, attention_mask, position_ids, *flat):
                from transformers.cache_utils import DynamicCache

                cache = DynamicCache()
                for i in range(layers):
                    cache.update(flat[2 * i], flat[2 * i + 1], i)
                out = self.m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=True)
                res = [out.logits]
                for layer in out.past_key_values.layers:
                    res += [layer.keys, layer.values]
                return tuple(res)

        self.module = Wrapper()


def export(cfg: TinyConfig, path: str | os.PathLike, exporter: str = "torchscript", dtype: str = "float32") -> pathlib.Path:
    """Exports a tiny decoder with past_key_values.N.key/value inputs and present.N.key/value outputs.

    exporter: "torchscript" (torch.onnx dynamo=False, opset 17, decomposed attention) or "dynamo"
    (opset 23, ONNX Attention, optimised by onnxscript). dtype: "float32" or "float16" (weights,
    activations and cache).
    """
    return export_model(build_model(cfg), path, exporter, dtype)


def export_model(model, path: str | os.PathLike, exporter: str = "torchscript", dtype: str = "float32") -> pathlib.Path:
    """Exports any Hugging Face causal LM (a torch module with a .config) the same way as `export`."""
    import torch

    path = pathlib.Path(path)
    io = cache_io(model, dtype)
    with warnings.catch_warnings(), torch.no_grad():  # tracer warnings about Python control flow in HF code: expected
        warnings.simplefilter("ignore")
        _run_exporter(exporter, io.module, io.args, path, io.names_in, io.names_out, io.past)
    _set_ir_version(path)
    return path


@dataclasses.dataclass
class CacheIO:
    """What torch.onnx traces: the wrapped model, example arguments (3 new tokens after 4 cached) and
    the ONNX names of its inputs and outputs."""

    module: object
    args: tuple
    names_in: list[str]
    names_out: list[str]
    past: list  # the example past key/value tensors (args[3:])


def cache_io(model, dtype: str = "float32") -> CacheIO:
    """The model converted to dtype (in place, one parameter at a time) and wrapped for export."""
    import torch

    torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
    model = model.to(torch_dtype).eval()
    c = model.config
    device = next(model.parameters()).device
    layers = c.num_hidden_layers
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    b, s, p = 1, 3, 4
    ids = torch.randint(0, c.vocab_size, (b, s), device=device)
    am = torch.ones(b, p + s, dtype=torch.int64, device=device)
    pos = torch.arange(p, p + s, device=device)[None]
    flat = [torch.randn(b, kv, p, head_dim, dtype=torch_dtype, device=device) for _ in range(2 * layers)]
    names_in = ["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    names_out = ["logits"] + [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    return CacheIO(_CacheIO(model, layers).module, (ids, am, pos, *flat), names_in, names_out, flat)


def _run_exporter(exporter, wrapper, args, path, names_in, names_out, flat) -> None:
    import torch

    if exporter == "torchscript":
        torch.onnx.export(wrapper, args, str(path), input_names=names_in, output_names=names_out,
                          dynamic_axes=torchscript_axes(names_in, names_out), opset_version=17, dynamo=False)
    elif exporter == "dynamo":
        program = torch.onnx.export(wrapper, args, input_names=names_in, output_names=names_out,
                                    dynamic_shapes=dynamo_shapes(flat), opset_version=23, dynamo=True, optimize=True,
                                    verbose=False)
        program.save(str(path))
    else:
        raise ValueError(f"exporter must be 'torchscript' or 'dynamo', got {exporter!r}")


def torchscript_axes(names_in: list[str], names_out: list[str]) -> dict:
    """The TorchScript exporter's dynamic axes: batch, new tokens, cached and total lengths."""
    dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"},
           "position_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    dyn.update({n: {0: "batch", 2: "past"} for n in names_in[3:]})
    dyn.update({n: {0: "batch", 2: "total"} for n in names_out[1:]})
    return dyn


def dynamo_shapes(past: list) -> tuple:
    """The dynamo exporter's dynamic shapes for (input_ids, attention_mask, position_ids, *past)."""
    import torch

    d = torch.export.Dim.DYNAMIC
    return ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d}, tuple({0: d, 2: d} for _ in past))


def _set_ir_version(path: pathlib.Path, ir_version: int = 10) -> None:
    """onnxruntime 1.31 refuses IR versions above 13; pin a widely readable one. A model over 2 GB
    keeps its weights in external files, which are left where they are."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    if m.ir_version > ir_version:
        m.ir_version = ir_version
        onnx.save(m, str(path))


OPTIMUM_PYTHON = "TURBOQUANT_OPTIMUM_PYTHON"  # a Python with optimum-onnx, which pins transformers < 4.58


def optimum_python() -> str | None:
    """The Python that runs optimum's exporter (TURBOQUANT_OPTIMUM_PYTHON), or None where none is set."""
    return os.environ.get(OPTIMUM_PYTHON) or None


def export_optimum(cfg: TinyConfig, folder: str | os.PathLike) -> pathlib.Path:
    """Exports a tiny decoder with optimum's ONNX exporter (`optimum-cli export onnx --task
    text-generation-with-past`) run by optimum_python(): the weights made here and saved as a Hugging
    Face folder, which that environment's transformers reads; returns folder/model.onnx."""
    import subprocess

    python = optimum_python()
    if python is None:
        raise RuntimeError(f"set {OPTIMUM_PYTHON} to a Python with optimum-onnx installed")
    folder = pathlib.Path(folder)
    hf = folder / "hf"
    build_model(cfg).save_pretrained(hf)
    cmd = [python, "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(hf),
           "--task", "text-generation-with-past", "--no-post-process", str(folder / "onnx")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = folder / "onnx" / "model.onnx"
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"optimum's exporter failed ({' '.join(cmd)}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    _set_ir_version(path)
    return path


def merge_with_if(src: str | os.PathLike, dst: str | os.PathLike) -> pathlib.Path:
    """A merged decoder, as optimum used to export them: one If on a `use_cache_branch` input whose
    then-branch is the decoder reading past_key_values.N.*, and whose else-branch is the same decoder
    started from empty caches (it never reads the past inputs). Both branches produce the logits and
    present.N.* that the If returns."""
    import copy

    import onnx
    from onnx import TensorProto, helper

    m = onnx.load(str(src))
    g = m.graph
    outer = {i.name for i in g.input} | {t.name for t in g.initializer} | {""}
    past = [i for i in g.input if i.name.startswith("past_key_values.")]

    def branch(prefix: str, empty_past: bool) -> onnx.GraphProto:
        nodes = []
        rename = {}
        if empty_past:  # zero-length caches [batch, kv_heads, 0, head_dim] instead of the inputs
            nodes.append(helper.make_node("Shape", ["input_ids"], [prefix + "batch"], end=1))
            for vi in past:
                dims = vi.type.tensor_type.shape.dim
                shape = helper.make_tensor(prefix + vi.name + "_dims", TensorProto.INT64, [3], [dims[1].dim_value, 0, dims[3].dim_value])
                nodes.append(helper.make_node("Constant", [], [prefix + vi.name + "_rest"], value=shape))
                nodes.append(helper.make_node("Concat", [prefix + "batch", prefix + vi.name + "_rest"], [prefix + vi.name + "_shape"], axis=0))
                nodes.append(helper.make_node("ConstantOfShape", [prefix + vi.name + "_shape"], [prefix + vi.name],
                                              value=helper.make_tensor("v", vi.type.tensor_type.elem_type, [1], [0])))
                rename[vi.name] = prefix + vi.name
        for n in g.node:
            n = copy.deepcopy(n)
            n.name = prefix + n.name
            n.input[:] = [rename.get(x, x if x in outer else prefix + x) for x in n.input]
            n.output[:] = [prefix + x for x in n.output]
            nodes.append(n)
        outputs = [copy.deepcopy(o) for o in g.output]
        for o in outputs:
            o.name = prefix + o.name
        return helper.make_graph(nodes, prefix + "branch", [], outputs)

    use_cache = helper.make_tensor_value_info("use_cache_branch", TensorProto.BOOL, [1])
    node = helper.make_node("If", ["use_cache_branch"], [o.name for o in g.output], name="optimum::if",
                            then_branch=branch("then_", False), else_branch=branch("else_", True))
    merged = helper.make_graph([node], g.name, [*g.input, use_cache], list(g.output), initializer=list(g.initializer))
    out = helper.make_model(merged, opset_imports=m.opset_import, ir_version=m.ir_version)
    onnx.save(out, str(dst))
    return pathlib.Path(dst)


def save_tokenizer(folder: str | os.PathLike, vocab: int) -> None:
    """A word-level tokenizer over `vocab` made-up words (w0, w1, ...) saved as a Hugging Face fast
    tokenizer: what onnxruntime-genai's builder needs to find in a model folder, without a download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.save_pretrained(os.fspath(folder))


def export_genai(cfg: TinyConfig, folder: str | os.PathLike, precision: str = "fp32",
                 provider: str = "cpu", device: str | None = None, extra: dict | None = None) -> pathlib.Path:
    """Builds a tiny decoder with onnxruntime-genai's model builder (GroupQueryAttention, packed QKV,
    rotary inside the op, a shared past/present buffer in genai_config.json); returns model.onnx's
    path in folder/model. Needs the onnxruntime-genai package. device: where the random weights are
    made (given one: in fp16 when precision is fp16), before they are saved as a Hugging Face folder.
    extra: the builder's --extra_options (e.g. {"exclude_embeds": "true"})."""
    folder = pathlib.Path(folder)
    hf_dir = folder / "hf"
    dtype = None
    if device is not None and precision == "fp16":
        import torch

        dtype = torch.float16
    save_hf_folder(build_model(cfg, device, dtype), cfg, hf_dir)
    return build_genai(hf_dir, folder / "model", precision, provider, folder / "cache", extra)


def save_hf_folder(model, cfg: TinyConfig, hf_dir: str | os.PathLike) -> pathlib.Path:
    """A Hugging Face model folder (weights, config, a made-up word tokenizer) that genai's builder reads."""
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 2
    model.save_pretrained(hf_dir)
    save_tokenizer(hf_dir, cfg.vocab)
    return pathlib.Path(hf_dir)


def build_genai(hf_dir: str | os.PathLike, out: str | os.PathLike, precision: str = "fp32", provider: str = "cpu",
                cache: str | os.PathLike | None = None, extra: dict | None = None) -> pathlib.Path:
    """Runs onnxruntime-genai's model builder on a Hugging Face folder; returns out/model.onnx."""
    import subprocess
    import sys

    out = pathlib.Path(out)
    cache = pathlib.Path(cache) if cache else out.parent / "cache"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
           "-p", precision, "-e", provider, "-c", str(cache)]
    if extra:
        cmd += ["--extra_options", *(f"{k}={v}" for k, v in extra.items())]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        raise RuntimeError(f"onnxruntime-genai's builder failed ({' '.join(cmd)}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return out / "model.onnx"
