"""Build a TensorRT engine from a model rewritten with --target tensorrt, with turboquant's plugins.

    python -m turboquant.build_engine model.trt.onnx -o model.plan [--batch 1 1 4] [--new 1 1 256] [--past 0 256 4096]

TensorRT (10 or later) or TensorRT for RTX, whichever is installed (`pip install
"turboquant-onnx[tensorrt-rtx]"`; TensorRT-RTX builds without a GPU). The optimisation profile
covers every input of the model: batch sizes, new tokens per step (the prompt's length at most) and
past lengths (min, opt, max); models rewritten from onnxruntime-genai's keep their caches in buffers
of --capacity rows (default: the longest past plus the most new tokens).
"""

from __future__ import annotations

import sys

from .arguments import check_output_file, non_negative, positive, read_onnx
from .boundary import Parser, boundary


@boundary("python -m turboquant.build_engine")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m turboquant.build_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the rewritten decoder (.onnx), written by `turboquant export ... --target tensorrt`")
    p.add_argument("-o", "--output", required=True, help="the serialized engine to write (.plan); never overwritten")
    p.add_argument("--batch", nargs=3, type=positive, default=(1, 1, 4), metavar=("MIN", "OPT", "MAX"),
                   help="batch sizes (default 1 1 4)")
    p.add_argument("--new", nargs=3, type=positive, default=(1, 1, 256), metavar=("MIN", "OPT", "MAX"),
                   help="new tokens per step: 1 for decode, up to the longest prompt (default 1 1 256)")
    p.add_argument("--past", nargs=3, type=non_negative, default=(0, 256, 4096), metavar=("MIN", "OPT", "MAX"),
                   help="tokens already in the cache (default 0 256 4096)")
    p.add_argument("--capacity", type=positive,
                   help="rows of the shared cache buffers (onnxruntime-genai models; default: past MAX + new MAX)")
    p.add_argument("--tensorrt", choices=["auto", "tensorrt", "tensorrt-rtx"], default="auto",
                   help="which TensorRT builds: auto (tensorrt where installed, else TensorRT-RTX), or one of them")
    p.add_argument("--compute-capability", metavar="SMxy",
                   help="TensorRT-RTX: the GPU the engine is for (e.g. SM89; default: TensorRT-RTX's choice)")
    p.add_argument("--workspace", type=positive, metavar="BYTES", help="the builder's workspace limit")
    p.add_argument("--verbose", action="store_true", help="print TensorRT's log")
    a = p.parse_args(argv)
    for name in ("batch", "new", "past"):
        lo, mid, hi = getattr(a, name)
        if not lo <= mid <= hi:
            p.error(f"--{name} {lo} {mid} {hi}: expected MIN <= OPT <= MAX")

    from . import tensorrt as tq_trt
    from .saving import OutputExists, publish, staging

    try:
        out = check_output_file(a.output, "-o")
        model = read_onnx(a.model)
        target = {p.key: p.value for p in model.metadata_props}.get("turboquant.target")
        if target != "tensorrt":
            raise ValueError(f"{a.model} is not a --target tensorrt rewrite (its turboquant.target is {target or 'absent'}): "
                             f"rewrite it with `turboquant export ORIGINAL.onnx --target tensorrt -o ...`")
        profile = tq_trt.decoder_profile(a.model, batch=a.batch, new=a.new, past=a.past, capacity=a.capacity)
        engine = tq_trt.build_engine(a.model, profile, runtime=a.tensorrt, compute_capability=a.compute_capability,
                                     workspace_bytes=a.workspace, verbose=a.verbose)
        with staging(out.parent) as tmp:
            (tmp / out.name).write_bytes(engine)
            publish([(tmp / out.name, out)], "-o")
    except (ValueError, OutputExists, tq_trt.TensorRTMissing, tq_trt.EngineBuildError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {a.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(engine)} bytes, built by {tq_trt.trt_module(a.tensorrt).__name__} "
          f"{tq_trt.trt_module(a.tensorrt).__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
