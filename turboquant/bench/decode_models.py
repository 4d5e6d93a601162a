"""The decode benchmark's models, made here with random weights: Llama-3.1-8B's and Llama-3.2-3B's
shapes (vocabulary cut to 32000), small variants with the 8B attention for the CPU, and a tiny one
for tests; exported by onnxruntime-genai's model builder or by torch.onnx's TorchScript exporter
(turboquant.random_decoders does both), and optionally rewritten by turboquant.export into DIR/tq.

    python -m turboquant.bench models --shape llama3b --builder genai --precision fp16 --device cuda -o DIR --rewrite

Layout of DIR: model/model.onnx (with genai's genai_config.json and tokenizer beside it, or
TorchScript's weight files), tq/model.onnx (the rewrite). genai's builder reads a Hugging Face folder,
deleted once the builder is done: at the 8B shape it is 16 GB of a disk that holds the four models.
"""

from __future__ import annotations

import pathlib
import shutil
import time

from ..random_decoders import TinyConfig

# Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128, hidden 4096, MLP 14336;
# Llama-3.2-3B: 28 layers, 24 query heads, hidden 3072, MLP 8192. The HF default init range keeps
# fp16 activations finite over 32 layers; positions up to 131072 as the real models (genai's
# max_length comes from them).
_LONG = dict(family="llama", kv_heads=8, head_dim=128, vocab=32000, max_positions=131072, init_range=0.02,
             head_scale=1.0)
SHAPES: dict[str, TinyConfig] = {
    "llama8b": TinyConfig(layers=32, hidden=4096, heads=32, mlp=14336, **_LONG),
    "llama3b": TinyConfig(layers=28, hidden=3072, heads=24, mlp=8192, **_LONG),
    # the 8B attention (32 / 8 heads of 128) in 4 layers, a narrower MLP and vocabulary: CPU runs
    "small": TinyConfig(layers=4, hidden=4096, heads=32, mlp=4096,
                        **{**_LONG, "vocab": 4096, "max_positions": 32768}),
    # the same attention again in 3 layers of a tiny width: tests
    "tiny": TinyConfig(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512, max_positions=4096),
}
BUILDERS = ("genai", "torchscript")


def default_boundary(cfg: TinyConfig) -> int:
    """The rewrite's boundary layers: 2 as the export's default, fewer where the model has too few
    layers for any to be compressed."""
    return 2 if cfg.layers >= 6 else 1


def build(shape: str, builder: str, precision: str, device: str, out: pathlib.Path, rewrite: str | None = None,
          boundary: int | None = None, calibrate: bool = True, cache: str = "auto", log=print) -> dict[str, pathlib.Path]:
    """Makes the model (and its rewrite with preset `rewrite`) under out; returns the paths made.
    calibrate=False: the rewrite without key offsets and scales (export's offsets=False); cache:
    the rewrite's cache form (export's cache)."""
    import torch

    from .. import random_decoders

    cfg = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, pathlib.Path] = {}
    t0 = time.perf_counter()
    dtype = torch.float16 if precision == "fp16" else torch.float32
    if builder == "genai":
        hf = random_decoders.save_hf_folder(random_decoders.build_model(cfg, device, dtype), cfg, out / "hf")
        log(f"random {shape} weights saved to {hf} ({time.perf_counter() - t0:.0f} s)")
        if device == "cuda":  # the builder may want the GPU: the weights made there are saved, let go
            torch.cuda.empty_cache()
        paths["original"] = random_decoders.build_genai(hf, out / "model", precision, device, out / "cache")
        shutil.rmtree(hf)
        shutil.rmtree(out / "cache", ignore_errors=True)
    else:
        model = random_decoders.build_model(cfg, device, dtype)
        (out / "model").mkdir(exist_ok=True)
        paths["original"] = random_decoders.export_model(model, out / "model" / "model.onnx", "torchscript",
                                                  "float16" if precision == "fp16" else "float32")
        del model
    log(f"{builder} model written to {paths['original']} ({time.perf_counter() - t0:.0f} s)")
    if rewrite:
        from turboquant.export import export

        t1 = time.perf_counter()
        # random ids, not the model's own text (the export's default): writing that text runs the
        # original 4096 steps on the CPU, hours at the 8B shape; calibration adds no decode work but a Mul
        result = export(paths["original"], rewrite, out / "tq" / "model.onnx", progress=False, offsets=calibrate,
                        calibrate="random" if calibrate else None,
                        boundary=default_boundary(cfg) if boundary is None else boundary, cache=cache)
        log(result.summary())
        paths["rewritten"] = result.output
        log(f"rewrite written to {result.output} ({time.perf_counter() - t1:.0f} s)")
    return paths
