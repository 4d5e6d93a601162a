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

import os
import pathlib
import re
import shutil
import sys

from ..arguments import check_output_folder, external_data_files, non_negative_list, positive, read_onnx
from ..saving import publish_folder, refuse_existing, staging
from ..boundary import Parser, boundary

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


_ESCAPES = {ord("\\"): "\\\\", ord('"'): '\\"', ord("'"): "\\'", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"}


def quoted(text: str) -> str:
    """text as a protobuf text-format string literal: quotes, backslashes and control bytes escaped
    (octal for the rest), so a tensor name (any string in ONNX) cannot end the string and add
    configuration; UTF-8 beyond ASCII is kept as it is, which the format reads."""
    out = []
    for c in text:
        if ord(c) in _ESCAPES:
            out.append(_ESCAPES[ord(c)])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\{ord(c):03o}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def _tensor(kind: str, name: str, dtype: str, dims: list[int]) -> str:
    return f'{kind} {{\n  name: {quoted(name)}\n  data_type: {dtype}\n  dims: [ {", ".join(map(str, dims))} ]\n}}\n'


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
                f'    {{\n      input_name: {quoted(n)}\n      output_name: {quoted(out_name)}\n      data_type: {t}\n'
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
    """Writes out/NAME/config.pbtxt and out/NAME/1/ (the model, or the engine), all of NAME's folder or
    none of it, never over a model already in the repository; returns the model folder."""
    model = pathlib.Path(model)
    if not model.is_file():
        raise ValueError(f"{model}: no such file")
    _check_options(backend, engine, library, instances, gpus)
    name = check_name(name if name is not None else model.name.split(".")[0])
    folder = _check_repository(out, name)
    inputs, outputs, proto = _io(model)
    _check_decoder(model, proto, inputs)
    if backend == "onnxruntime" and library is None:
        import turboquant

        try:
            library = turboquant.ort_library_path()
        except FileNotFoundError as e:  # not built: the repository would name no library
            raise ValueError(f"{e} (or give --library PATH as the server sees it)") from None
    text = config_text(name, inputs, outputs, backend=backend, library=library or "", gpus=gpus or [],
                       instances=instances, stateful=stateful)
    with staging(folder.parent) as tmp:  # the folders made for it go again if it fails
        (tmp / name / "1").mkdir(parents=True)
        for src, dst in _files(model, proto, backend, engine):
            (tmp / name / "1" / dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / name / "1" / dst)
        (tmp / name / "config.pbtxt").write_text(text)
        publish_folder(tmp / name, folder, "the repository's model")
    return folder


def _check_options(backend, engine, library, instances, gpus) -> None:
    if backend not in ("onnxruntime", "tensorrt"):
        raise ValueError(f"backend must be 'onnxruntime' or 'tensorrt', got {backend!r}")
    if backend == "tensorrt" and (engine is None or not pathlib.Path(engine).is_file()):
        raise ValueError("the TensorRT backend serves an engine: give --engine PLAN (built by turboquant build-engine, "
                         "trtexec or turboquant.tensorrt.build_engine)")
    if backend == "onnxruntime" and engine is not None:
        raise ValueError("--engine is served by --backend tensorrt; the onnxruntime backend serves the model itself")
    if backend == "tensorrt" and library is not None:
        raise ValueError("--library is the ONNX Runtime backend's custom-op library; TensorRT's plugins are given "
                         "to the server (--backend-config=tensorrt,plugins=...)")
    if not isinstance(instances, int) or instances < 1:
        raise ValueError(f"--instances must be a positive count, got {instances!r}")
    if any(not isinstance(g, int) or g < 0 for g in gpus or []):
        raise ValueError(f"--gpus must be GPU ids of zero or more, got {gpus}")
    if library is not None and any(c in library for c in '"\\\n'):
        raise ValueError(f"--library {library!r}: config.pbtxt cannot quote a path with '\"', '\\' or a newline")


def _check_repository(out: str | os.PathLike, name: str) -> pathlib.Path:
    """out/name, refused where out is no folder, cannot be written or already has a model `name`."""
    out = check_output_folder(out, "--out")
    refuse_existing([out / name], "the repository's model")
    return out / name


def _check_decoder(model: pathlib.Path, proto, inputs) -> None:
    """A decoder's cache inputs: [batch, heads, positions, row] each (the state's shapes come from them)."""
    caches = [(n, d) for n, _, d in inputs if n.startswith("past_key_values.") or n.startswith("past_")]
    if not caches:
        raise ValueError(f"{model} has no KV-cache inputs (past_key_values.N.key or past_N_key): not a decoder")
    for n, d in caches:
        if len(d) != 4:
            raise ValueError(f"{model}: cache input {n} has {len(d)} dims; a decoder's caches are [batch, heads, positions, row]")
    if {p.key: p.value for p in proto.metadata_props}.get("turboquant.cache") == "in-place":
        raise ValueError(f"{model}: its caches are buffers written in place (--cache in-place), which Triton's "
                         "ONNX Runtime backend cannot bind as both input and output; rewrite with --cache concat")


def _files(model: pathlib.Path, proto, backend: str, engine) -> list[tuple[pathlib.Path, str]]:
    """(source, path in the version folder): the model and its external data where the model names
    it, or the engine."""
    if backend == "tensorrt":
        return [(pathlib.Path(engine), "model.plan")]
    data = sorted(external_data_files(proto, model.parent))
    outside = [f for f in data if ".." in f.relative_to(model.parent).parts]
    if outside:
        raise ValueError(f"{model}: its external data {outside[0]} lies outside its folder; the repository could not hold it")
    return [(model, "model.onnx")] + [(f, str(f.relative_to(model.parent))) for f in data]


@boundary("python -m turboquant.serving.triton")
def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m turboquant.serving.triton", description=__doc__.split("\n\n")[0])
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
    except OSError as e:
        print(f"error: cannot write the repository in {a.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {folder}/config.pbtxt and {folder}/1/")
    if a.backend == "tensorrt":
        print("start Triton with the plugins: tritonserver --model-repository ... "
              "--backend-config=tensorrt,plugins=$(python -c 'import turboquant; print(turboquant.trt_plugin_path())')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
