"""The onnxruntime-genai folder of a rewritten model: the model, genai_config.json pointing at
turboquant's custom-op library (copied beside it) with head_size set to the cache row width, and the
source folder's other files (tokenizer, chat template, ...)."""

from __future__ import annotations

import json
import pathlib
import shutil

from turboquant._libs import ort_library_path

from .errors import RewriteError
from .plan import RewriteResult

CONFIG = "genai_config.json"


def check_output_folder(src: pathlib.Path, out: pathlib.Path) -> None:
    """genai reads one genai_config.json per folder: the rewritten model needs its own folder."""
    if (src.parent / CONFIG).is_file() and out.parent.resolve() == src.parent.resolve():
        raise RewriteError(f"{src.parent} is an onnxruntime-genai folder ({CONFIG}); the rewritten model needs its own "
                           f"config, so write it to another folder (-o OTHER_DIR/{out.name})")


def write_folder(src: pathlib.Path, out: pathlib.Path, result: RewriteResult) -> pathlib.Path:
    """Completes out's folder for onnxruntime-genai; returns the config written."""
    config = json.loads((src.parent / CONFIG).read_text())
    decoder = config.get("model", {}).get("decoder")
    if not isinstance(decoder, dict):
        raise RewriteError(f"{src.parent / CONFIG} has no model.decoder section")
    library = pathlib.Path(ort_library_path())
    shutil.copy2(library, out.parent / library.name)
    decoder["filename"] = out.name
    # genai allocates every layer's cache as [batch, kv_heads, max_length, head_size] of the past
    # inputs' dtype: for the uint8 caches, head_size is the row width in bytes.
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
