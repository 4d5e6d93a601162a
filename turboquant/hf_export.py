"""python -m turboquant.hf_export: export a local Hugging Face causal LM to ONNX with its KV cache.

What a user does before turboquant: torch.onnx (TorchScript exporter by default, or dynamo) over the
model with past_key_values.N.key/value inputs and present.N.key/value outputs. The tokenizer is saved
beside the model, so the folder serves as --tokenizer for turboquant.eval and --calibrate. Reads a
model folder (config.json and weights) or a GGUF file inside one (--gguf), offline.

    python -m turboquant.hf_export path/to/model-folder -o smollm2/model.onnx
    python -m turboquant.hf_export path/to/folder --gguf model.Q4_1.gguf -o smollm2/model.onnx
"""

from __future__ import annotations

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turboquant.hf_export", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="local folder of a Hugging Face causal LM (or holding the --gguf file)")
    p.add_argument("-o", "--output", required=True, help="the .onnx file to write (its folder gets the tokenizer)")
    p.add_argument("--gguf", help="a GGUF file name inside the folder; transformers dequantizes it to float32")
    p.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = p.parse_args(argv)

    src = pathlib.Path(args.model)
    out = pathlib.Path(args.output)
    if not src.is_dir():
        print(f"error: {src} is not a folder", file=sys.stderr)
        return 2
    if args.gguf and not (src / args.gguf).is_file():
        print(f"error: {src / args.gguf}: no such file", file=sys.stderr)
        return 2
    if out.suffix != ".onnx":
        print(f"error: the output {out} should end in .onnx", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .examples import export_model

    kw = {"gguf_file": args.gguf} if args.gguf else {}
    model = AutoModelForCausalLM.from_pretrained(str(src), local_files_only=True, **kw)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        AutoTokenizer.from_pretrained(str(src), local_files_only=True, **kw).save_pretrained(str(out.parent))
    except (OSError, ValueError) as e:  # a model folder without a tokenizer still exports
        print(f"note: no tokenizer saved ({e})", file=sys.stderr)
    c = model.config
    print(f"exporting {c.model_type}: {c.num_hidden_layers} layers, {c.num_attention_heads} query heads, "
          f"{getattr(c, 'num_key_value_heads', None) or c.num_attention_heads} kv heads to {out}", flush=True)
    export_model(model, out, args.exporter, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
