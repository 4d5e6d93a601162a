"""The onnxruntime-genai folder of a rewritten model: the model, genai_config.json pointing at
turboquant's custom-op library (copied beside it), and the source folder's other files (tokenizer,
chat template, ...); and which genai versions allocate each layer's cache from the model's shapes.

genai allocates a decoder's caches as [batch, kv_heads, max_length, head_size] of the first past
input's dtype, kv_heads and head_size from genai_config.json. From 0.14.0 (microsoft/onnxruntime-
genai #2103, src/models/kv_cache.cpp, DefaultKeyValueCache) it reads each layer's past_key shape
from the model too: where a layer's concrete last dim (and, from 0.15.0, #2214, dim 1) differs from
the config's, every layer gets its own concrete dims. So head_size is the widest layer's row width:
a model whose layers all share one width is then allocated as before, and one with narrower layers
differs from the config where it must. Older versions allocate every layer with head_size, which
for such a model ORT refuses at the first step (a shape mismatch on the narrower layers' inputs).
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import shutil

from turboquant._libs import ort_library_path

from .errors import RewriteError
from .plan import RewriteResult

CONFIG = "genai_config.json"
PER_LAYER_SHAPES_SINCE = (0, 14, 0)
# onnxruntime-genai is published under one name per execution provider
DISTRIBUTIONS = ("onnxruntime-genai", "onnxruntime-genai-cuda", "onnxruntime-genai-directml", "onnxruntime-genai-winml")


def installed_version() -> str | None:
    """The version of the installed onnxruntime-genai distribution, or None."""
    for name in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.18.0' or '0.14.0.dev1'."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        raise RewriteError(f"cannot read the onnxruntime-genai version {version!r}")
    return tuple(int(x or 0) for x in m.groups())


def reads_per_layer_shapes(version: str | None = None) -> tuple[bool, str]:
    """Whether genai (the installed one, or `version`) allocates each layer's cache from the model's
    shapes, and a line for the summary saying so. Without genai installed: assumed, and said."""
    where = "given" if version is not None else "installed"
    version = version if version is not None else installed_version()
    since = ".".join(map(str, PER_LAYER_SHAPES_SINCE))
    if version is None:
        return True, f"each layer's width is in its cache inputs' shape, which onnxruntime-genai reads from {since}"
    if _release(version) >= PER_LAYER_SHAPES_SINCE:
        return True, f"onnxruntime-genai {version} ({where}) allocates each layer's cache from its inputs' shape"
    return False, (f"onnxruntime-genai {version} ({where}) allocates every layer's cache with one shape (per-layer "
                   f"shapes from {since}), so every layer's rows are as wide as the widest")


def check_output_folder(src: pathlib.Path, out: pathlib.Path) -> None:
    """genai reads one genai_config.json per folder: the rewritten model needs its own folder."""
    if (src.parent / CONFIG).is_file() and out.parent.resolve() == src.parent.resolve():
        raise RewriteError(f"{src.parent} is an onnxruntime-genai folder ({CONFIG}); the rewritten model needs its own "
                           f"config, so write it to another folder (-o OTHER_DIR/{out.name})")


def _decoder(path: pathlib.Path) -> tuple[dict, dict]:
    """(the config, its model.decoder section) of genai_config.json at path."""
    config = json.loads(path.read_text())
    decoder = config.get("model", {}).get("decoder")
    if not isinstance(decoder, dict):
        raise RewriteError(f"{path} has no model.decoder section")
    return config, decoder


def _cuda_options(decoder: dict) -> dict | None:
    """The decoder's CUDA provider options (session_options.provider_options' "cuda" entry), or None."""
    for entry in decoder.get("session_options", {}).get("provider_options", []):
        if isinstance(entry, dict) and isinstance(entry.get("cuda"), dict):
            return entry["cuda"]
    return None


def check_cuda_graph(src: pathlib.Path) -> None:
    """cuda_graph needs a source folder whose decoder runs on genai's CUDA provider."""
    path = src.parent / CONFIG
    if not path.is_file():
        raise RewriteError(f"--genai-cuda-graph is for onnxruntime-genai folders, and {src.parent} has no {CONFIG}")
    _, decoder = _decoder(path)
    if _cuda_options(decoder) is None:
        providers = [k for e in decoder.get("session_options", {}).get("provider_options", []) for k in e] or ["cpu"]
        raise RewriteError(f"--genai-cuda-graph: {path} runs the decoder on {', '.join(providers)}, not on the cuda "
                           "provider whose graphs it would enable (build the model for cuda)")


def write_folder(src: pathlib.Path, out: pathlib.Path, result: RewriteResult, cuda_graph: bool = False) -> pathlib.Path:
    """Completes out's folder for onnxruntime-genai; returns the config written. cuda_graph: the CUDA
    provider's decode steps replayed from graphs (enable_cuda_graph), which genai's GroupQueryAttention
    refuses at batch sizes above 1 and TQGroupQueryAttention runs."""
    config, decoder = _decoder(src.parent / CONFIG)
    if cuda_graph:
        check_cuda_graph(src)
        _cuda_options(decoder)["enable_cuda_graph"] = "1"
    library = pathlib.Path(ort_library_path())
    shutil.copy2(library, out.parent / library.name)
    decoder["filename"] = out.name
    # the uint8 caches' head_size is a row width in bytes: the widest layer's (module docstring)
    decoder["head_size"] = result.row_bytes
    options = decoder.setdefault("session_options", {})
    options["custom_ops_library"] = library.name
    skip = {CONFIG, src.name, out.name, library.name}
    for f in src.parent.iterdir():
        if f.is_file() and f.name not in skip and not f.name.endswith((".onnx", ".onnx.data", ".onnx_data")):
            if not (out.parent / f.name).exists():
                shutil.copy2(f, out.parent / f.name)
    path = out.parent / CONFIG
    path.write_text(json.dumps(config, indent=4) + "\n")
    return path
