"""Prefill timing: a first prompt of S tokens, or a continuation chunk of S tokens over a packed past
of P, through TQGroupQueryAttention and TQAttention against ONNX Runtime's GroupQueryAttention and
ONNX Attention-23 on the same shape, dtype, device and threads, in one process.

Every candidate runs through IO binding with its inputs already on the device. GroupQueryAttention,
ours and ORT's, shares one past/present buffer of P + S rows as onnxruntime-genai does; TQAttention
and Attention-23 take a dense past of P tokens and return a new present (their semantics). ORT's CPU
kernels hold a [B, heads, S, P + S] float32 probability matrix: a baseline needing more than
--max-baseline-gb for it is reported as skipped rather than run out of memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from .. import node_models
from ..arguments import at_most, threads
from ..arguments import head_dim as _head_dim, positive as _positive
from ..config import TQ_PRESETS, TurboQuantConfig
from ..node_models import IR_VERSION
from ..ort import session_options
from ..reference import formats
from ..saving import write_new_text
from .checks import non_negative_float

NP_OF = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16}
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


@dataclasses.dataclass
class Point:
    batch: int
    new: int  # tokens of the call
    past: int  # tokens already cached (0: a first prompt)


@dataclasses.dataclass
class Row:
    name: str
    dtype: str
    batch: int
    new: int
    past: int
    ms: float | None
    error: str | None = None
    cpu_ms: float | None = None  # CPU time per run, all threads


def add_parser(sub) -> None:
    """The `prefill` subcommand of python -m turboquant.bench."""
    f = sub.add_parser("prefill", help="first prompts and continuation chunks (many new tokens per call)")
    f.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    f.add_argument("--batch", type=_positive, nargs="+", default=[1, 8])
    f.add_argument("--prompt", type=_positive, nargs="*", default=[2048, 8192, 32768],
                   help="first-prompt lengths (none: skip first prompts)")
    f.add_argument("--chunk", type=_positive, nargs="*", default=[512, 2048],
                   help="continuation chunk lengths, over --past cached tokens (none: skip chunks)")
    f.add_argument("--past", type=_positive, default=32768, help="tokens cached before a chunk (default 32768)")
    f.add_argument("--q-heads", type=_positive, default=32)
    f.add_argument("--kv-heads", type=_positive, default=8)
    f.add_argument("--head-dim", type=_head_dim, default=128)
    f.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="default: fp32 on cpu, fp16 on cuda")
    f.add_argument("--threads", type=threads, default=os.cpu_count(), help="intra-op threads, the same for all")
    f.add_argument("--repeat", type=at_most(10**6), default=3)
    f.add_argument("--presets", nargs="+", default=["turboquant_4bit_nc"], choices=list(TQ_PRESETS))
    f.add_argument("--baselines", nargs="+", default=list(BASELINES), choices=list(BASELINES),
                   help="ORT's attention to time against (default: all)")
    f.add_argument("--max-baseline-gb", type=non_negative_float, default=8.0,
                   help="skip a CPU baseline whose S x (P + S) probabilities need more (default 8)")
    f.add_argument("--json", help="write the rows here as JSON")


def _value(a: np.ndarray, device: str) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device, 0)


def _time(sess, io, repeat: int) -> tuple[float, float]:
    """Median milliseconds of a bound run, outputs synchronised, after one warm-up run; and the
    process's CPU milliseconds per run (all threads), which a machine shared with other work inflates
    far less than the wall time."""
    sess.run_with_iobinding(io)
    io.synchronize_outputs()
    times = []
    c0 = time.process_time()
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run_with_iobinding(io)
        io.synchronize_outputs()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, (time.process_time() - c0) / repeat * 1e3


def _bind(sess, feeds: dict, device: str, shared: dict | None = None):
    """IO binding of feeds on the device (total_sequence_length on the host, as genai has it); outputs
    named in `shared` are bound to that input's buffer (past and present one buffer)."""
    io = sess.io_binding()
    values = {}
    for name, x in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(x) if name == "total_sequence_length" else _value(x, device)
        io.bind_ortvalue_input(name, values[name])
    for out in sess.get_outputs():
        if shared and out.name in shared:
            io.bind_ortvalue_output(out.name, values[shared[out.name]])
        else:
            io.bind_output(out.name, device)
    return io, values


def _packed_past(rng, cfg: TurboQuantConfig, b: int, hkv: int, rows: int, filled: int, widths: tuple, d: int):
    """Key and value [b, hkv, rows, width] uint8 buffers: the first `filled` rows packed keys / values (a packed block
    of up to 512 tokens tiled: timing does not depend on the values), the rest zero."""
    out = []
    for fmt, nc, width in ((cfg.key_format, cfg.norm_correction, widths[0]), (cfg.value_format, True, widths[1])):
        buf = np.zeros((b, hkv, rows, width), np.uint8)
        if filled:
            unit = min(filled, 512)
            block = formats.pack(rng.standard_normal((b, hkv, unit, d)).astype(np.float32), fmt, nc)
            reps = -(-filled // unit)
            buf[:, :, :filled, :block.shape[-1]] = np.tile(block, (1, 1, reps, 1))[:, :, :filled]
        out.append(buf)
    return out


def _qkv(rng, b, s, hq, hkv, d, dtype, layout):
    t = NP_OF[dtype]
    if layout == "bsd":
        return [rng.standard_normal((b, s, h * d)).astype(t) for h in (hq, hkv, hkv)]
    return [rng.standard_normal((b, h, s, d)).astype(t) for h in (hq, hkv, hkv)]


def tq_gqa(rng, pt: Point, hq, hkv, d, dtype, preset):
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    model = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                             value_format=cfg.value_format, dtype=dtype, norm_correction=int(cfg.norm_correction))
    width = max(formats.packed_size(cfg.key_format, d), formats.packed_size(cfg.value_format, d))
    total = pt.past + pt.new
    pk, pv = _packed_past(rng, cfg, pt.batch, hkv, total, pt.past, (width, width), d)
    q, k, v = _qkv(rng, pt.batch, pt.new, hq, hkv, d, dtype, "bsd")
    feeds = {"query": q, "key": k, "value": v, "past_key": pk, "past_value": pv,
             "seqlens_k": np.full((pt.batch,), total - 1, np.int32), "total_sequence_length": np.array(total, np.int32)}
    return model, feeds, {"present_key": "past_key", "present_value": "past_value"}


def tq_attention(rng, pt: Point, hq, hkv, d, dtype, preset):
    cfg = TurboQuantConfig.from_cache_dtype(preset, d)
    model = node_models.attention_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format=cfg.key_format,
                                   value_format=cfg.value_format, dtype=dtype, is_causal=1,
                                   norm_correction=int(cfg.norm_correction))
    q, k, v = _qkv(rng, pt.batch, pt.new, hq, hkv, d, dtype, "bhsd")
    widths = (formats.packed_size(cfg.key_format, d), formats.packed_size(cfg.value_format, d))
    pk, pv = _packed_past(rng, cfg, pt.batch, hkv, pt.past, pt.past, widths, d)
    return model, {"Q": q, "K": k, "V": v, "past_key": pk, "past_value": pv}, None


def ort_gqa(rng, pt: Point, hq, hkv, d, dtype):
    vi = helper.make_tensor_value_info
    total = pt.past + pt.new
    inputs = [vi("query", dtype, ["B", "S", hq * d]), vi("key", dtype, ["B", "S", hkv * d]),
              vi("value", dtype, ["B", "S", hkv * d]), vi("past_key", dtype, ["B", hkv, "P", d]),
              vi("past_value", dtype, ["B", hkv, "P", d]), vi("seqlens_k", TensorProto.INT32, ["B"]),
              vi("total_sequence_length", TensorProto.INT32, [])]
    outputs = [vi("output", dtype, None), vi("present_key", dtype, None), vi("present_value", dtype, None)]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs],
                            domain="com.microsoft", num_heads=hq, kv_num_heads=hkv)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs), ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    t = NP_OF[dtype]
    q, k, v = _qkv(rng, pt.batch, pt.new, hq, hkv, d, dtype, "bsd")
    past = [np.zeros((pt.batch, hkv, total, d), t) for _ in range(2)]
    for x in past:
        x[:, :, :pt.past] = rng.standard_normal((pt.batch, hkv, pt.past, d)).astype(t)
    feeds = {"query": q, "key": k, "value": v, "past_key": past[0], "past_value": past[1],
             "seqlens_k": np.full((pt.batch,), total - 1, np.int32), "total_sequence_length": np.array(total, np.int32)}
    return model, feeds, {"present_key": "past_key", "present_value": "past_value"}


def ort_attention23(rng, pt: Point, hq, hkv, d, dtype):
    vi = helper.make_tensor_value_info
    inputs = [vi("Q", dtype, ["B", hq, "S", d]), vi("K", dtype, ["B", hkv, "S", d]), vi("V", dtype, ["B", hkv, "S", d])]
    names = ["Q", "K", "V"]
    if pt.past:
        inputs += [vi("past_key", dtype, ["B", hkv, "P", d]), vi("past_value", dtype, ["B", hkv, "P", d])]
        names += ["", "past_key", "past_value"]
    outputs = [vi(n, dtype, None) for n in ("Y", "present_key", "present_value")]
    node = helper.make_node("Attention", names, [o.name for o in outputs], is_causal=1)
    model = helper.make_model(helper.make_graph([node], "attention23", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 23)], ir_version=IR_VERSION)
    q, k, v = _qkv(rng, pt.batch, pt.new, hq, hkv, d, dtype, "bhsd")
    feeds = {"Q": q, "K": k, "V": v}
    if pt.past:
        feeds |= {n: rng.standard_normal((pt.batch, hkv, pt.past, d)).astype(NP_OF[dtype])
                  for n in ("past_key", "past_value")}
    return model, feeds, None


def _probabilities_gb(pt: Point, hq: int) -> float:
    return pt.batch * hq * pt.new * (pt.past + pt.new) * 4 / 1e9


BASELINES = {"gqa": ort_gqa, "attention23": ort_attention23}


def measure(device: str, pt: Point, hq: int, hkv: int, d: int, dtype_name: str, presets: list[str], threads: int,
            repeat: int, max_baseline_gb: float, baselines=tuple(BASELINES), seed: int = 0) -> list[Row]:
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed)
    candidates = [(f"ort_{b}", lambda f=BASELINES[b]: f(rng, pt, hq, hkv, d, dtype), False) for b in baselines]
    for preset in presets:
        candidates += [(f"tq_gqa:{preset}", lambda p=preset: tq_gqa(rng, pt, hq, hkv, d, dtype, p), True),
                       (f"tq_attention:{preset}", lambda p=preset: tq_attention(rng, pt, hq, hkv, d, dtype, p), True)]
    rows = []
    for name, build, ours in candidates:
        row = Row(name, dtype_name, pt.batch, pt.new, pt.past, None)
        if not ours and device == "cpu" and _probabilities_gb(pt, hq) > max_baseline_gb:
            row.error = f"skipped: its probabilities need {_probabilities_gb(pt, hq):.1f} GB (--max-baseline-gb)"
            rows.append(row)
            print(_line(row), flush=True)
            continue
        try:
            model, feeds, shared = build()
            so = session_options(threads) if ours else ort.SessionOptions()
            so.intra_op_num_threads = threads
            sess = ort.InferenceSession(model.SerializeToString(), so, providers=PROVIDERS[device])
            io, _ = _bind(sess, feeds, device, shared)
            row.ms, row.cpu_ms = _time(sess, io, repeat)
        except Exception as e:  # noqa: BLE001 - a baseline this ORT build lacks is reported, not fatal
            if ours:
                raise
            row.error = str(e).splitlines()[0][:160]
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(r: Row) -> str:
    what = f"{r.name:<34}{r.dtype:>5}{r.batch:>4}{r.new:>7}{r.past:>7}"
    return f"{what}  {r.error}" if r.ms is None else f"{what}{r.ms:>12.1f}{r.cpu_ms:>12.1f}"


def report(rows: list[Row]) -> str:
    """Each TQ row's time over each baseline's on the same point and dtype (the target: <= 1.5 on the
    CPU), by wall time and, in brackets, by CPU time."""
    lines = [f"{'candidate':<34}{'dtype':>5}{'B':>4}{'new':>7}{'past':>7}{'ms':>12}{'cpu ms':>12}   tq / ort (cpu)"]
    for r in rows:
        line = _line(r)
        if r.ms is not None and r.name.startswith("tq_"):
            base = [x for x in rows if x.name.startswith("ort_") and x.ms and (x.dtype, x.batch, x.new, x.past)
                    == (r.dtype, r.batch, r.new, r.past)]
            line += "".join(f"   {r.ms / x.ms:.2f} ({r.cpu_ms / x.cpu_ms:.2f}) of {x.name[4:]}" for x in base)
        lines.append(line)
    return "\n".join(lines)


def _points(args) -> list[Point]:
    return ([Point(b, s, 0) for b in args.batch for s in args.prompt]
            + [Point(b, s, args.past) for b in args.batch for s in args.chunk])


def need_bytes(pt: Point, hq: int, hkv: int, d: int, itemsize: int, probabilities: bool) -> int:
    """Host bytes of a point's largest candidate: a baseline's K and V past (each drawn as float64,
    then kept in the dtype) and what ORT returns of their size, Q, K and V likewise, and ORT's CPU
    probability matrix where the baseline is not skipped."""
    cache = 2 * pt.batch * hkv * (pt.past + pt.new) * d * (8 + 2 * itemsize)
    qkv = pt.batch * pt.new * (hq + 2 * hkv) * d * (8 + itemsize)
    return cache + qkv + (int(_probabilities_gb(pt, hq) * 1e9) if probabilities else 0)


def arrays(args) -> list[tuple[int, str]]:
    """(bytes, what) of every point and dtype, for checks.check_fits."""
    out = []
    for pt in _points(args):
        what = f"--chunk {pt.new} at batch {pt.batch} over --past {pt.past}" if pt.past else \
            f"--prompt {pt.new} at batch {pt.batch}"
        probabilities = args.device == "cpu" and _probabilities_gb(pt, args.q_heads) <= args.max_baseline_gb
        for dt in _dtypes(args):
            itemsize = np.dtype(NP_OF[DTYPES[dt]]).itemsize
            out.append((need_bytes(pt, args.q_heads, args.kv_heads, args.head_dim, itemsize, probabilities), what))
    return out


def _dtypes(args) -> list[str]:
    return args.dtypes or (["fp32"] if args.device == "cpu" else ["fp16"])


def main(args) -> int:
    points = _points(args)
    if not points:
        print("python -m turboquant.bench prefill: error: no --prompt and no --chunk lengths to time", file=sys.stderr)
        return 2
    dtypes = _dtypes(args)
    print(f"device={args.device} threads={args.threads} heads={args.q_heads}/{args.kv_heads} d={args.head_dim}")
    rows = []
    for pt in points:
        for dt in dtypes:
            rows += measure(args.device, pt, args.q_heads, args.kv_heads, args.head_dim, dt, args.presets,
                            args.threads, args.repeat, args.max_baseline_gb, args.baselines)
    print(report(rows))
    if args.json is not None:
        write_new_text(args.json, json.dumps([r.__dict__ for r in rows], indent=1), "--json")
    return 0
