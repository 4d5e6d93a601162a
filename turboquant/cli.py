"""turboquant COMMAND [options]: one command line over the package's tools.

Each command runs the `main` of a `python -m` entry point, which stays usable as it is; this module
only picks the entry point, adds example lines to its --help and names it `turboquant COMMAND`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import sys


@dataclasses.dataclass(frozen=True)
class Command:
    module: str  # whose main(argv) -> int runs the command
    summary: str
    examples: tuple[str, ...]


COMMANDS = {
    "export": Command(
        "turboquant.export.__main__", "rewrite an exported ONNX decoder to a packed KV cache",
        ("turboquant export model.onnx --preset turboquant_4bit_nc -o model.4bit.onnx",
         "turboquant export model.onnx --preset turboquant_k3v4_nc --calibrate text.txt --tokenizer DIR")),
    "eval": Command(
        "turboquant.eval.__main__", "perplexity, KL and top-1 of rewritten models against the original",
        ("turboquant eval model.onnx model.4bit.onnx --text held-out.txt --tokenizer DIR",)),
    "bench": Command(
        "turboquant.bench.__main__", "time decode attention and packing against ONNX Runtime's own",
        ("turboquant bench attention --device cpu --context 8192",
         "turboquant bench pack --device cuda --vectors 2097152")),
    "build-engine": Command(
        "turboquant.build_engine", "build a TensorRT engine from a --target tensorrt rewrite, with the plugins",
        ("turboquant build-engine model.trt.onnx -o model.plan --batch 1 1 4 --past 0 256 4096",)),
    "serve-triton": Command(
        "turboquant.serving.triton", "write a Triton Inference Server model repository",
        ("turboquant serve-triton model.4bit.onnx --out model_repository --gpus 0",)),
    "hf-export": Command(
        "turboquant.hf_export.__main__", "export a local Hugging Face causal LM to ONNX with its KV cache",
        ("turboquant hf-export path/to/model-folder -o model/model.onnx --dtype fp16",)),
    "example": Command(
        "turboquant.example.__main__", "export, rewrite and run SmolLM2-135M (or a small random model) end to end",
        ("turboquant example --out turboquant-example",)),
}

HELP_FLAGS = ("-h", "--help")


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: turboquant COMMAND [options]   (turboquant COMMAND --help for a command's options)", "",
             "One command line over turboquant's tools.", "", "commands:"]
    lines += [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "examples:"] + [f"  {c.examples[0]}" for c in COMMANDS.values()]
    lines += ["", "Each command is also `python -m <module>`, e.g. python -m turboquant.export."]
    return "\n".join(lines)


def _help(command: Command, name: str, main, argv: list[str]) -> int:
    # The entry points name themselves `python -m MODULE`; under this script they are `turboquant NAME`.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    prog = "python -m " + command.module.removesuffix(".__main__")
    sys.stdout.write(out.getvalue().replace(prog, f"turboquant {name}"))
    print("\nexamples:\n" + "\n".join(f"  {e}" for e in command.examples))
    return code if isinstance(code, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in HELP_FLAGS:
        print(usage())
        return 0
    if name == "--version":
        from . import __version__  # the wheel's metadata version is read from it (pyproject.toml)

        print(f"turboquant {__version__}")
        return 0
    command = COMMANDS.get(name)
    if command is None:
        print(f"turboquant: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    main_of = importlib.import_module(command.module).main
    # a help request anywhere before `--` is answered without running anything
    if any(a in HELP_FLAGS for a in (rest[:rest.index("--")] if "--" in rest else rest)):
        return _help(command, name, main_of, rest)
    return main_of(rest)


if __name__ == "__main__":
    raise SystemExit(main())
