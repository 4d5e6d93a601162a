"""Issue 61 item 8: windowed models through onnxruntime-genai, original against rewrite, on one GPU.

Two random-weight models made by transformers from a config (no download), built in fp16 for CUDA by
onnxruntime-genai's builder (python -m onnxruntime_genai.models.builder), rewritten by
`turboquant export MODEL --preset turboquant_4bit_nc --boundary 1 --no-offsets` (calibration adds no decode work),
then both folders run through og.Generator at each (batch, context) point: time to first token (the
prompt in one append_tokens call, as genai takes it at batch sizes above 1), ms per decode step and
tokens/s (all sequences), and the KV cache bytes at the context (genai's window-sized layers at
their rows, window_size plus cache_slack: the original's C = W, the rewrite's W + 64, packed).

- gemma3: Gemma-3-4B's attention and widths (hidden 2560, 8 query heads on 4 KV heads of 256, MLP
  10240) in 12 of its 34 layers, 5 of each 6 windowed (W = 1024) as in the model; vocabulary cut to 32000.
- gptoss: gpt-oss-20b's attention (hidden 2880, 64 query heads on 8 KV heads of 64, a sink per head)
  in 8 of its 24 layers, windows (W = 128) on alternate layers as in the model, a mixture of 4 experts
  (of 32; 4 active as in the model) of width 2880; vocabulary cut to 32000.
The rewrite keeps the first and last layer uncompressed (--boundary 1: the default 2 would keep a third
of these shortened models).

Each shape's two folders run side by side in one process of their own under a share of the time
left (--budget, 450 s by default for everything, builds included): at each point, in the order given,
each one's first token, then their decode steps in alternating rounds; a point that fails or does
not finish is reported as not measured, with the reason. Prints a table; --json writes the records.

    PYTHONPATH=/tmp/site:/tmp/tqsite python3 scripts/gpu_window_bench.py --out /tmp/window-bench
    python scripts/gpu_window_bench.py --tiny --device cpu --precision fp32 --points 1x64 2x64   # the CPU check
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import time

WARMUP = 2  # decode steps before the timed ones
ROUNDS = 4  # the timed steps in this many alternating rounds of the original's and the rewrite's


def hf_config(shape: str, tiny: bool):
    """The transformers config of a shape (tiny: the same layer pattern at toy widths, for CPU checks)."""
    import transformers

    if shape == "gemma3":
        layers = 12
        kw = dict(vocab_size=32000, hidden_size=2560, intermediate_size=10240, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                  query_pre_attn_scalar=256, max_position_embeddings=131072, rope_theta=1_000_000.0)
        if tiny:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, sliding_window=16, query_pre_attn_scalar=64,
                      max_position_embeddings=4096)
        kw["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        kw["sliding_window_pattern"] = 6  # (transformers before layer_types)
        cfg = transformers.Gemma3TextConfig(**kw)
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    if shape == "gptoss":
        layers = 8
        kw = dict(vocab_size=32000, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=4,
                  num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072)
        if tiny:
            kw.update(vocab_size=512, hidden_size=128, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, num_local_experts=2, num_experts_per_tok=2,
                      sliding_window=16, max_position_embeddings=4096)
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        cfg = transformers.GptOssConfig(**kw)
        cfg.architectures = ["GptOssForCausalLM"]
        return cfg
    raise ValueError(f"unknown shape {shape!r}; expected gemma3 or gptoss")


def make_hf_folder(shape: str, folder: pathlib.Path, device: str, precision: str, tiny: bool) -> None:
    """Random weights (std 0.02, transformers' init) saved as a Hugging Face folder with a tokenizer."""
    import torch
    import transformers

    from turboquant.random_decoders import save_tokenizer

    cfg = hf_config(shape, tiny)
    torch.manual_seed(0)
    dtype = torch.float16 if precision == "fp16" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


# onnxruntime-genai 0.18's Gemma 3 builder reads rope_local_base_freq and a flat rope_parameters, which
# transformers 5 folds into rope_parameters per layer type: the builder runs with its configs flattened back.
_BUILDER = '''
import runpy, sys, transformers
load = transformers.AutoConfig.from_pretrained
def flat(*a, **k):
    c = load(*a, **k)
    rp = getattr(c, "rope_parameters", None)
    if isinstance(rp, dict) and "full_attention" in rp and "rope_type" not in rp:
        c.rope_local_base_freq = rp.get("sliding_attention", rp["full_attention"])["rope_theta"]
        c.rope_parameters = dict(rp["full_attention"])
    return c
transformers.AutoConfig.from_pretrained = flat
sys.argv = ["builder", *sys.argv[1:]]
runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
'''


def build_genai(hf: pathlib.Path, out: pathlib.Path, precision: str, device: str, cache: pathlib.Path) -> None:
    cmd = [sys.executable, "-c", _BUILDER, "-i", str(hf), "-o", str(out), "-p", precision, "-e", device, "-c", str(cache)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "model.onnx").is_file():
        raise RuntimeError(f"onnxruntime-genai's builder failed (exit {done.returncode}): {done.stderr[-1500:]}")


def build(shape: str, root: pathlib.Path, device: str, precision: str, tiny: bool, log) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(original folder, rewritten folder or None where the rewrite refused the model)."""
    t0 = time.perf_counter()
    hf, original, tq = root / "hf", root / "model", root / "tq"
    for d in (hf, original, tq):
        shutil.rmtree(d, ignore_errors=True)
    make_hf_folder(shape, hf, device, precision, tiny)
    log(f"{shape}: random weights in {hf} ({time.perf_counter() - t0:.0f} s)")
    build_genai(hf, original, precision, device, root / "cache")
    shutil.rmtree(hf)
    shutil.rmtree(root / "cache", ignore_errors=True)
    log(f"{shape}: genai's builder wrote {original} ({time.perf_counter() - t0:.0f} s)")
    cmd = [sys.executable, "-m", "turboquant.export", str(original / "model.onnx"), "--preset", "turboquant_4bit_nc",
           "-o", str(tq / "model.onnx"), "--boundary", "1", "--no-offsets"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
    log(f"{shape}: {' '.join(cmd[2:])} -> exit {done.returncode} ({time.perf_counter() - t0:.0f} s)\n    " + "\n    ".join(tail))
    if done.returncode != 0 or not (tq / "genai_config.json").is_file():
        return original, None
    return original, tq


def _measure(folders: dict[str, str], device: str, points: list[tuple[int, int]], steps: int, queue) -> None:
    """In a process of its own, both folders (original, rewrite) loaded side by side: at each point,
    each one's first token (the prompt, then one token), then their decode steps timed in alternating
    rounds (ROUNDS of steps / ROUNDS steps each, so that a drift of the machine's speed meets both
    alike) and each one's median step; records put on the queue as measured (a process stopped at its
    time limit keeps the points before)."""
    import numpy as np
    import onnxruntime_genai as og

    models, vocab = {}, {}
    for kind, folder in folders.items():
        config = og.Config(folder)
        config.clear_providers()
        if device == "cuda":
            config.append_provider("cuda")
        models[kind] = og.Model(config)
        vocab[kind] = json.loads((pathlib.Path(folder) / "genai_config.json").read_text())["model"]["vocab_size"]
    rng = np.random.default_rng(0)
    per_round = max(1, steps // ROUNDS)

    def generator(kind: str, b: int, length: int):
        params = og.GeneratorParams(models[kind])
        params.set_search_options(max_length=length, batch_size=b, do_sample=False)
        return og.Generator(models[kind], params)

    def step(gen) -> float:
        t0 = time.perf_counter()
        gen.generate_next_token()
        gen.get_next_tokens()
        return time.perf_counter() - t0

    # each model's first-call costs outside every timed prompt, in a cache as long as the shortest
    # point's (a windowed original's sliding cache must hold its window)
    for kind in models:
        warm = generator(kind, 1, min(s for _, s in points) + WARMUP + ROUNDS * per_round + 1)
        warm.append_tokens(rng.integers(3, vocab[kind], (1, 16)).astype(np.int32))
        warm.generate_next_token()
        del warm
    for b, s in points:
        ids = rng.integers(3, min(vocab.values()), (b, s)).astype(np.int32)
        gens, ttft = {}, {}
        try:
            for kind in models:
                gens[kind] = generator(kind, b, s + WARMUP + ROUNDS * per_round + 1)
                t0 = time.perf_counter()
                gens[kind].append_tokens(ids)
                gens[kind].generate_next_token()
                gens[kind].get_next_tokens()
                ttft[kind] = time.perf_counter() - t0
                for _ in range(WARMUP):
                    step(gens[kind])
            times = {kind: [] for kind in gens}
            for _ in range(ROUNDS):
                for kind, gen in gens.items():
                    times[kind] += [step(gen) for _ in range(per_round)]
        except Exception as e:  # noqa: BLE001 - a runtime's refusal at this point is its result
            for kind in models:
                queue.put({"model": kind, "batch": b, "context": s, "error": f"{type(e).__name__}: {str(e)[:300]}"
                           + (f" (in the {next(k for k in models if k not in ttft)})" if len(ttft) < len(models) else "")})
            gens.clear()
            continue
        for kind, t in times.items():
            ms = sorted(t)[len(t) // 2] * 1e3
            queue.put({"model": kind, "batch": b, "context": s, "ttft_ms": ttft[kind] * 1e3, "ms_per_step": ms,
                       "tokens_per_s": b * 1e3 / ms})
        del gens


def measure(folders: dict[str, pathlib.Path], device: str, points, steps: int, limit: float) -> dict:
    """The points measured within `limit` seconds (a process of their own, stopped there), keyed by
    (model, batch, context)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=({k: str(f) for k, f in folders.items()}, device, list(points), steps, queue))
    proc.start()
    proc.join(limit)
    if proc.is_alive():
        proc.kill()
        proc.join()
    got = {}
    while not queue.empty():
        r = queue.get()
        got[(r["model"], r["batch"], r["context"])] = r
    if proc.exitcode not in (0, None) and len(got) < len(points) * len(folders):
        got["error"] = f"exit {proc.exitcode}" + (" (stopped at its time limit)" if proc.exitcode == -9 else "")
    return got


def cache_summary(folder: pathlib.Path) -> dict:
    """Per layer, the cache bytes one sequence holds per row (K and V), the rows genai gives its
    window-sized layers (genai_config.json's sliding_window section: window_size plus its slack;
    absent where a rewrite made every cache full-length), and how many layers are
    compressed (packed formats other than raw16, the boundary layers' uncompressed rows)."""
    from turboquant.bench.cache_layout import inspect

    info = inspect(folder)
    per_layer: dict[int, int] = {}
    for c in info.caches:
        per_layer[c.layer] = per_layer.get(c.layer, 0) + c.row_bytes
    section = json.loads((folder / "genai_config.json").read_text())["model"].get("decoder", {}).get("sliding_window")
    windowed = {}
    if section:
        rows = int(section.get("window_size", 0)) + int(section.get("cache_slack", 0))
        windowed = {int(i): rows for i in section.get("layers", [])}
    return {"per_layer": per_layer, "window_rows": windowed, "layers": len(per_layer),
            "packed_layers": len({c.layer for c in info.caches if c.key_format not in (None, "raw16")})}


def kv_bytes(summary: dict, batch: int, context: int) -> int:
    """The caches' bytes at `context` tokens: window-sized layers hold at most their rows."""
    return batch * sum(row * min(context, summary["window_rows"].get(layer, context))
                       for layer, row in summary["per_layer"].items())


def parse_point(text: str) -> tuple[int, int]:
    b, _, s = text.partition("x")
    try:
        point = int(b), int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxCONTEXT (e.g. 8x32768)") from None
    if min(point) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch and context must be positive")
    return point


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/window-bench"))
    ap.add_argument("--shapes", nargs="+", choices=["gemma3", "gptoss"], default=["gemma3", "gptoss"])
    ap.add_argument("--points", nargs="+", type=parse_point, default=[(1, 4096), (8, 4096), (1, 32768), (8, 32768)])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--precision", choices=["fp16", "fp32"], default="fp16")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for everything (builds, rewrites, runs)")
    ap.add_argument("--tiny", action="store_true", help="toy widths of the same layer patterns (CPU checks)")
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("gpu_window_bench: --steps must be at least 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:5.0f} s] {msg}", flush=True)

    folders = {}
    for shape in args.shapes:
        try:
            folders[shape] = build(shape, args.out / shape, args.device, args.precision, args.tiny, log)
        except Exception as e:  # noqa: BLE001 - a builder's refusal is a result to report
            log(f"{shape}: not built: {type(e).__name__}: {str(e)[:1500]}")
    records = []
    for i, (shape, (orig, tq)) in enumerate(folders.items()):
        if tq is None:
            records.append({"shape": shape, "model": "rewrite", "error": "the rewrite refused the model (its log above)"})
            continue
        pair = {"original": orig, "rewrite": tq}
        limit = max(10.0, left() / (len(folders) - i))
        log(f"{shape}: {len(args.points)} points, original and rewrite side by side, within {limit:.0f} s")
        got = measure(pair, args.device, args.points, args.steps, limit)
        for kind, folder in pair.items():
            row = {"shape": shape, "model": kind, "folder": str(folder), **cache_summary(folder)}
            for b, s in args.points:
                r = got.get((kind, b, s))
                rec = {**row, "batch": b, "context": s, "kv_bytes": kv_bytes(row, b, s)}
                records.append({**rec, **r} if r else {**rec, "error": got.get("error", f"not reached within {limit:.0f} s")})
    print()
    print(f"{'shape':7} {'model':9} {'B':>2} {'S':>6} {'ttft ms':>9} {'ms/step':>8} {'tok/s':>8} {'KV MB':>8}  compressed layers")
    for r in records:
        if "batch" not in r:
            print(f"{r['shape']:7} {r['model']:9} {'':>2} {'':>6}  {r['error']}")
            continue
        kv = f"{r['kv_bytes'] / 1e6:8.1f}"
        layers = f"{r['packed_layers']}/{r['layers']}"
        if "ms_per_step" in r:
            print(f"{r['shape']:7} {r['model']:9} {r['batch']:>2} {r['context']:>6} {r['ttft_ms']:9.1f} {r['ms_per_step']:8.2f} "
                  f"{r['tokens_per_s']:8.1f} {kv}  {layers}")
        else:
            print(f"{r['shape']:7} {r['model']:9} {r['batch']:>2} {r['context']:>6} {'':>9} {'':>8} {'':>8} {kv}  {layers}  {r['error']}")
    log(f"done in {time.perf_counter() - start:.0f} s (budget {args.budget:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
