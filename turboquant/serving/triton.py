"""python -m turboquant.serving.triton: a Triton Inference Server model repository for a (rewritten)
decoder, with the custom-op library (ONNX Runtime backend) or the plugin library (TensorRT backend).

    python -m turboquant.serving.triton model.turboquant_4bit_nc.onnx --out model_repository
    python -m turboquant.serving.triton model.trt.onnx --backend tensorrt --engine model.plan --out model_repository

Two ways to keep the KV cache:
- stateless (default): the client sends past_key_values.* and gets present.* back each step, the way
  turboquant.decoder.DecoderSession runs; the packed cache makes that traffic 2.6-5x smaller;
- --stateful: Triton's sequence batcher keeps each sequence's cache on the server (implicit state,
  past_key_values.N.* fed from the present.N.* of the previous request with the same sequence id).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import sys

from ..arguments import non_negative_list, positive, read_onnx

_TRITON_TYPES = {1: "TYPE_FP32", 2: "TYPE_UINT8", 3: "TYPE_INT8", 6: "TYPE_INT32", 7: "TYPE_INT64", 9: "TYPE_BOOL",
                 10: "TYPE_FP16", 11: "TYPE_FP64", 16: "TYPE_BF16"}


# A model's folder name in the repository, and a quoted string in config.pbtxt: letters, digits,
# '_', '-' and '.', not starting with a dot (no '..', no hidden folder, no path separator).
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"--name {name!r} is not a model name Triton takes: up to 128 letters, digits, '_', '-' "
                         "and '.', not starting with '.'")
    return name


def _io(model_path: pathlib.Path):
    m = read_onnx(model_path)
    init = {t.name for t in m.graph.initializer}

    def rows(values):
        out = []
        for v in values:
            if v.name in init:
                continue
            t = v.type.tensor_type
            if t.elem_type not in _TRITON_TYPES:
                raise ValueError(f"{v.name}: element type {t.elem_type} has no Triton equivalent")
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out.append((v.name, _TRITON_TYPES[t.elem_type], dims))
        return out

    return rows(m.graph.input), rows(m.graph.output), m


def _tensor(kind: str, name: str, dtype: str, dims: list[int]) -> str:
    return f'{kind} {{\n  name: "{name}"\n  data_type: {dtype}\n  dims: [ {", ".join(map(str, dims))} ]\n}}\n'


def config_text(name: str, inputs, outputs, *, backend: str, library: str, gpus: list[int], instances: int,
                stateful: bool) -> str:
    lines = [f'name: "{name}"\n']
    lines.append('backend: "onnxruntime"\n' if backend == "onnxruntime" else 'platform: "tensorrt_plan"\n')
    if stateful:
        # one sequence per batch slot: the batch axis leaves every tensor's dims
        lines.append("max_batch_size: 1\n")
        caches = {n for n, _, _ in inputs if n.startswith("past_key_values.") or n.startswith("past_")}
        present = {n for n, _, _ in outputs if n.startswith("present")}
        for n, t, d in inputs:
            if n not in caches:
                lines.append(_tensor("input", n, t, d[1:]))
        for n, t, d in outputs:
            if n not in present:
                lines.append(_tensor("output", n, t, d[1:]))
        states = []
        for n, t, d in inputs:
            if n not in caches:
                continue
            out_name = n.replace("past_key_values.", "present.", 1).replace("past_", "present_", 1)
            init_dims = [d[1], 0, d[3]]
            states.append(
                f'    {{\n      input_name: "{n}"\n      output_name: "{out_name}"\n      data_type: {t}\n'
                f'      dims: [ {", ".join(map(str, d[1:]))} ]\n'
                f'      initial_state: {{\n        data_type: {t}\n        dims: [ {", ".join(map(str, init_dims))} ]\n'
                f'        zero_data: true\n        name: "empty cache"\n      }}\n    }}')
        lines.append("sequence_batching {\n  max_sequence_idle_microseconds: 60000000\n  oldest {\n"
                     "    max_candidate_sequences: 64\n  }\n  state [\n" + ",\n".join(states) + "\n  ]\n}\n")
    else:
        lines.append("max_batch_size: 0\n")
        lines += [_tensor("input", n, t, d) for n, t, d in inputs]
        lines += [_tensor("output", n, t, d) for n, t, d in outputs]
    kind = "KIND_GPU" if gpus else "KIND_CPU"
    gpu_line = f"\n    gpus: [ {', '.join(map(str, gpus))} ]" if gpus else ""
    lines.append(f"instance_group [\n  {{\n    kind: {kind}\n    count: {instances}{gpu_line}\n  }}\n]\n")
    if backend == "onnxruntime":
        lines.append(f'model_operations {{\n  op_library_filename: "{library}"\n}}\n')
    return "".join(lines)


def write_repository(model: str | os.PathLike, out: str | os.PathLike, *, name: str | None = None,
                     backend: str = "onnxruntime", engine: str | os.PathLike | None = None, library: str | None = None,
                     gpus: list[int] | None = None, instances: int = 1, stateful: bool = False) -> pathlib.Path:
    """Writes out/NAME/config.pbtxt and out/NAME/1/ (the model, or the engine); returns the model folder."""
    model = pathlib.Path(model)
    if not model.is_file():
        raise ValueError(f"{model}: no such file")
    if backend not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"backend must be 'onnxruntime' or 'tensorrt', got {backend!r}")
    if backend == "tensorrt" and (engine is None or not pathlib.Path(engine).is_file()):
        raise ValueError("the TensorRT backend serves an engine: give --engine PLAN (built with trtexec or "
                         "turboquant.tensorrt.build_engine)")
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"--instances must be a positive count, got {instances!r}")
    if any(not isinstance(g, int) or g < 0 for g in gpus or []):
        raise ValueError(f"--gpus must be GPU ids of zero or more, got {gpus}")
    if library is not None and any(c in library for c in '"\\\n'):
        raise ValueError(f"--library {library!r}: config.pbtxt cannot quote a path with '\"', '\\' or a newline")
    name = check_name(name if name is not None else model.name.split(".")[0])
    inputs, outputs, proto = _io(model)
    if {p.key: p.value for p in proto.metadata_props}.get("turboquant.cache") == "in-place":
        raise ValueError(f"{model}: its caches are buffers written in place (--cache in-place), which Triton's "
                         "ONNX Runtime backend cannot bind as both input and output; rewrite with --cache concat")
    folder = pathlib.Path(out) / name
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    if backend == "onnxruntime":
        shutil.copy2(model, version / "model.onnx")
        for t in proto.graph.initializer:  # external data travels with the model
            for entry in t.external_data:
                if entry.key == "location" and (model.parent / entry.value).is_file():
                    shutil.copy2(model.parent / entry.value, version / entry.value)
        if library is None:
            import turboquant

            library = turboquant.ort_library_path()
    else:
        shutil.copy2(engine, version / "model.plan")
    text = config_text(name, inputs, outputs, backend=backend, library=library or "", gpus=gpus or [],
                       instances=instances, stateful=stateful)
    (folder / "config.pbtxt").write_text(text)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turboquant.serving.triton", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the rewritten decoder (.onnx); for --backend tensorrt, the --target tensorrt one")
    p.add_argument("--out", required=True, help="the model repository folder")
    p.add_argument("--name", help="model name in the repository (default: the file name up to its first dot)")
    p.add_argument("--backend", choices=["onnxruntime", "tensorrt"], default="onnxruntime")
    p.add_argument("--engine", help="with --backend tensorrt: the serialized engine (.plan)")
    p.add_argument("--library", help="custom-op library path as the server sees it (default: this installation's)")
    p.add_argument("--gpus", type=non_negative_list, help="comma-separated GPU ids for the instances (default: CPU instances)")
    p.add_argument("--instances", type=positive, default=1, help="model instances per device (default 1)")
    p.add_argument("--stateful", action="store_true", help="keep each sequence's cache on the server (implicit state)")
    a = p.parse_args(argv)
    try:
        folder = write_repository(a.model, a.out, name=a.name, backend=a.backend, engine=a.engine, library=a.library,
                                  gpus=a.gpus or [], instances=a.instances, stateful=a.stateful)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {folder}/config.pbtxt and {folder}/1/")
    if a.backend == "tensorrt":
        print("start Triton with the plugins: tritonserver --model-repository ... "
              "--backend-config=tensorrt,plugins=$(python -c 'import turboquant; print(turboquant.trt_plugin_path())')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
