"""Developer tool: one decode step of TQGroupQueryAttention on the CPU against ORT's GroupQueryAttention
on a float32 cache, both as onnxruntime-genai runs them (past and present one buffer, bound in place
through IO binding, rotary inside the op), B = 1, 32 query / 8 KV heads of 128, float32 inputs, in one
process. The op bench (`python -m turboquant.bench attention --device cpu`) times TQAttention and ORT's
ops with the cache copied into present every step instead. Prints median ms per step (wall, then CPU
time of all threads) for each:

    python scripts/cpu_gqa_step.py [--context 4096 8192] [--threads 2]
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from turboquant import node_models
from turboquant.bench import baselines
from turboquant.bench.prefill import _bind, _time
from turboquant.ort import session_options
from turboquant.reference import formats

HQ, HKV, D = 32, 8, 128
SHARED = {"present_key": "past_key", "present_value": "past_value"}
FORMATS = [("raw16", "raw16"), ("mse4", "uint4"), ("fp8", "uint4"), ("mse3", "uint3")]


def packed_buffer(rng, fmt: str, rows: int, width: int) -> np.ndarray:
    """[1, HKV, rows, width] rows of fmt (a block of 256 random vectors tiled: the time does not depend
    on the values)."""
    unit = formats.pack(rng.standard_normal((1, HKV, 256, D)).astype(np.float32), fmt, True)
    out = np.zeros((1, HKV, rows, width), np.uint8)
    out[..., :unit.shape[-1]] = np.tile(unit, (1, 1, rows // 256 + 1, 1))[:, :, :rows]
    return out


def step_times(s: int, threads: int, repeat: int, rng) -> list[tuple[str, float, float]]:
    rows = s + 8
    cos, sin = baselines.rotary_tables(rows + 1, D, TensorProto.FLOAT)
    k = rng.standard_normal((1, 1, HKV * D)).astype(np.float32)
    common = {"query": rng.standard_normal((1, 1, HQ * D)).astype(np.float32), "key": k, "value": k.copy(),
              "seqlens_k": np.array([s], np.int32), "total_sequence_length": np.array(s + 1, np.int32),
              "cos_cache": cos, "sin_cache": sin}
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(baselines.gqa_model(HQ, HKV, D, TensorProto.FLOAT, rotary=True).SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    feeds = dict(common, past_key=rng.standard_normal((1, HKV, rows, D)).astype(np.float32),
                 past_value=rng.standard_normal((1, HKV, rows, D)).astype(np.float32))
    io, _ = _bind(sess, feeds, "cpu", SHARED)
    out = [("ort_gqa_fp32", *_time(sess, io, repeat))]
    for kf, vf in FORMATS:
        model = node_models.gqa_model(q_heads=HQ, kv_heads=HKV, head_dim=D, key_format=kf, value_format=vf,
                                      rotary_dim=D, dtype=TensorProto.FLOAT)
        sess = ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
        width = max(formats.packed_size(kf, D), formats.packed_size(vf, D))
        feeds = dict(common, past_key=packed_buffer(rng, kf, rows, width), past_value=packed_buffer(rng, vf, rows, width))
        io, _ = _bind(sess, feeds, "cpu", SHARED)
        out.append((f"tq_gqa_{kf}_{vf}", *_time(sess, io, repeat)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for s in args.context:
        times = step_times(s, args.threads, args.repeat, rng)
        base = times[0][1]
        for name, ms, cpu_ms in times:
            print(f"S={s:<6} {name:<22} {ms:8.2f} ms  cpu {cpu_ms:8.2f} ms  {base / ms:5.2f}x ORT's")


if __name__ == "__main__":
    main()
