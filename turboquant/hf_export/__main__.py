"""python -m turboquant.hf_export: export a local Hugging Face causal LM to ONNX with its KV cache.

What a user does before turboquant: torch.onnx (the dynamo exporter by default, or TorchScript) over the
model with past_key_values.N.key/value inputs and present.N.key/value outputs. Writes the graph and
one external-data file beside it (model.onnx, model.onnx.data), holding about one copy of the weights
in memory while it does; --dtype fp16 gives an fp16 model with fp16 caches. The tokenizer is saved
beside the model, so the folder serves as --tokenizer for turboquant.eval and --calibrate. Reads a
model folder (config.json and weights) or a GGUF file inside one (--gguf), offline.

    python -m turboquant.hf_export path/to/model-folder -o smollm2/model.onnx
    python -m turboquant.hf_export path/to/folder --gguf model.Q4_1.gguf -o smollm2/model.onnx --dtype fp16
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

from ..arguments import check_output_file
from ..saving import publish, staging
from ..boundary import Parser, boundary

GGUF_MAGIC = b"GGUF"
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}


@boundary("python -m turboquant.hf_export")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m turboquant.hf_export", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="local folder of a Hugging Face causal LM (or holding the --gguf file)")
    p.add_argument("-o", "--output", required=True, help="the .onnx file to write (its folder gets the tokenizer)")
    p.add_argument("--gguf", help="a GGUF file name inside the folder; transformers dequantizes it to float32")
    p.add_argument("--exporter", default="dynamo", choices=["dynamo", "torchscript"],
                   help="torch.onnx exporter (default dynamo; TorchScript's tracing briefly holds a second copy of the weights)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                   help="weights, activations and KV cache of the exported model (default fp32)")
    args = p.parse_args(argv)

    try:
        src, out = _check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    from .streamed import ExportFailed, data_file, stage_export

    kw = {"gguf_file": args.gguf} if args.gguf else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, **kw)
    except Exception as e:  # noqa: BLE001 - weights transformers cannot read (any reader's error): its reason, on one line
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"error: {src}: not a model transformers can load ({type(e).__name__}: {detail})", file=sys.stderr)
        return 2
    try:
        with staging(out.parent) as tmp:  # the model, its data and its tokenizer appear together or not at all
            tokenizer = _stage_tokenizer(src, kw, tmp, out.parent)
            config = _stage_config(src, model.config, tmp, out.parent)
            c = model.config
            print(f"exporting {c.model_type}: {c.num_hidden_layers} layers, {c.num_attention_heads} query heads, "
                  f"{getattr(c, 'num_key_value_heads', None) or c.num_attention_heads} kv heads to {out}", flush=True)
            publish(stage_export(model, tmp, out, args.exporter, DTYPES[args.dtype]) + config + tokenizer)
    except ExportFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # a full disk, a file that appeared meanwhile: nothing half-written is left
        print(f"error: cannot write {out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    print(f"wrote {out}, {data_file(out).name}, its config.json" + (f" and the tokenizer's {len(tokenizer)} files" if tokenizer else ""))
    return 0


def _stage_tokenizer(src: pathlib.Path, kw: dict, tmp: pathlib.Path, folder: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """The tokenizer saved into tmp, as (staged, final) pairs for the files the output folder lacks;
    ValueError where the folder has one of its names with other contents (nothing is overwritten)."""
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(src), local_files_only=True, **kw).save_pretrained(str(tmp / "tokenizer"))
    except (OSError, ValueError) as e:  # a model folder without a tokenizer still exports
        print(f"note: no tokenizer saved ({e})", file=sys.stderr)
        return []
    return _new_files(tmp / "tokenizer", folder)


def _stage_config(src: pathlib.Path, config, tmp: pathlib.Path, folder: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """The model's config.json beside the output, as optimum's exports have it (the folder's own, else
    the one transformers read from a GGUF file): the rewrite reads max_position_embeddings and any
    sliding window there, which the graph does not say."""
    (tmp / "config").mkdir()
    if (src / "config.json").is_file():
        shutil.copyfile(src / "config.json", tmp / "config" / "config.json")
    else:
        config.to_json_file(str(tmp / "config" / "config.json"))
    return _new_files(tmp / "config", folder)


def _new_files(staged: pathlib.Path, folder: pathlib.Path) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(staged, final) pairs for the files of `staged` that `folder` lacks; ValueError where it has one
    of their names with other contents (nothing is overwritten)."""
    pairs = []
    for f in sorted(staged.iterdir()):
        final = folder / f.name
        if os.path.lexists(final):
            if final.is_file() and final.read_bytes() == f.read_bytes():
                continue  # the same file saved before (another export of this model)
            raise ValueError(f"{final} exists with other contents; turboquant does not overwrite files")
        pairs.append((f, final))
    return pairs


def _check(args) -> tuple[pathlib.Path, pathlib.Path]:
    """The model folder and the output, refused (ValueError) before transformers loads anything."""
    src = pathlib.Path(args.model)
    out = pathlib.Path(args.output)
    if not src.is_dir():
        raise ValueError(f"{src} is not a folder")
    if args.gguf is not None and not args.gguf.strip():
        raise ValueError("--gguf is an empty name")
    if out.name == ".onnx":
        raise ValueError(f"the output {out} needs a name before .onnx")
    if out.suffix != ".onnx":
        raise ValueError(f"the output {out} should end in .onnx")
    if args.gguf:
        gguf = src / args.gguf
        if not gguf.is_file():
            raise ValueError(f"{gguf}: no such file")
        with open(gguf, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ValueError(f"--gguf {gguf}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    elif not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json: not a Hugging Face model folder (for a GGUF file, give --gguf NAME)")
    check_output_file(out, "the output")
    for f in (out, out.with_name(f"{out.name}.data")):
        if os.path.lexists(f):
            raise ValueError(f"{f} exists; give a new output name (turboquant never overwrites files)")
    return src, out


if __name__ == "__main__":
    raise SystemExit(main())
