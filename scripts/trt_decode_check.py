"""On the GPU machine: a decoder (an fp16 TorchScript export, e.g. the llama3b shape of
`python -m turboquant.bench models`) rewritten twice with one preset, for ONNX Runtime and with
--target tensorrt (no calibration: the two rewrites then hold the same numbers), the TensorRT one
built into an engine by TensorRT-RTX (turboquant.tensorrt.build_engine), then a prompt and greedy
decode steps through the engine (caches bound in place) against the ONNX Runtime rewrite on its
CUDA provider: each step's logits and tokens, and each one's decode-step time.

    python scripts/trt_decode_check.py MODEL.onnx --work DIR [--preset turboquant_4bit_nc] [--prompt 64] [--steps 16]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--work", required=True, help="folder for the rewrites and the engine (reused where they exist)")
    p.add_argument("--preset", default="turboquant_4bit_nc")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--capacity", type=int, default=512)
    p.add_argument("--timing-steps", type=int, default=20, help="decode steps timed at the end (each runtime)")
    p.add_argument("--compute-capability", help="TensorRT-RTX's target GPU (e.g. SM89; default: its own choice)")
    a = p.parse_args(argv)
    import onnxruntime as ort

    ort.preload_dlls()
    import torch

    from turboquant import tensorrt as tq_trt
    from turboquant.export import export
    from turboquant.trt_engine import EngineDecoder, check_against_onnxruntime

    work = pathlib.Path(a.work)
    t0 = time.perf_counter()
    paths = {}
    for target in ("onnxruntime", "tensorrt"):
        out = work / target / "model.onnx"
        if not out.exists():
            r = export(a.model, a.preset, out, target=target, calibrate=None, offsets=False, progress=False)
            print(f"{target} rewrite: {r.summary()} ({time.perf_counter() - t0:.0f} s)", flush=True)
        paths[target] = out
    plan = work / "model.plan"
    if not plan.exists():
        t1 = time.perf_counter()
        prof = tq_trt.decoder_profile(paths["tensorrt"], batch=(1, a.batch, a.batch), new=(1, 1, a.prompt),
                                      past=(0, a.prompt, a.capacity - a.prompt), capacity=a.capacity)
        try:
            engine = tq_trt.build_engine(paths["tensorrt"], prof, runtime="tensorrt-rtx",
                                         compute_capability=a.compute_capability)
        except tq_trt.EngineBuildError as e:
            print(f"TensorRT-RTX refused: {e}", flush=True)
            return 1
        plan.with_suffix(".tmp").write_bytes(engine)
        plan.with_suffix(".tmp").rename(plan)  # whole or absent: a later call reuses it
        print(f"engine built by TensorRT-RTX: {len(engine)} bytes ({time.perf_counter() - t1:.0f} s)", flush=True)
    try:
        dec = EngineDecoder(plan, runtime="tensorrt-rtx")
    except tq_trt.EngineBuildError as e:
        print(f"TensorRT-RTX refused to run the engine on {torch.cuda.get_device_name()}: {e}", flush=True)
        return 1
    info = tq_trt.inspect_engine(plan.read_bytes(), runtime="tensorrt-rtx")
    import onnx

    ours = [n.name for n in onnx.load(str(paths["tensorrt"]), load_external_data=False).graph.node if n.domain == "turboquant"]
    found = [name for name in ours if any(name in str(layer) for layer in info["layers"])]
    print(f"engine on {torch.cuda.get_device_name()}: {len(info['layers'])} layers; the engine inspector finds "
          f"{len(found)} of the {len(ours)} turboquant nodes among them", flush=True)
    prompt = np.random.default_rng(0).integers(3, 30000, (a.batch, a.prompt))
    res = check_against_onnxruntime(paths["onnxruntime"], dec, prompt, a.steps, a.capacity)
    same = res["tokens_ort"] == res["tokens_engine"]
    print(f"greedy tokens {'the same' if same else 'DIFFERENT'} over {a.steps + 1} steps; largest relative logit "
          f"difference {max(res['relative_diffs']):.2e}", flush=True)
    # a decode step's time, each runtime: the same one-token step repeated at past = prompt
    from turboquant.shared_buffer import SharedBufferDecoder

    ref = SharedBufferDecoder(paths["onnxruntime"], max_length=a.capacity, providers=["CUDAExecutionProvider"])
    ids = prompt[:, -1:]
    cache_ref, cache = ref.empty_cache(a.batch), dec.empty_cache(a.batch, a.capacity)
    feeds = ref.feeds(ids, {}, a.prompt)
    for name, run in (("onnxruntime", lambda: ref.step(ids, cache_ref, a.prompt)), ("engine", lambda: dec.run(feeds, cache))):
        run()
        times = []
        for _ in range(a.timing_steps):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        print(f"decode step, {name}: median {1e3 * float(np.median(times)):.2f} ms (host to host, logits copied back)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
