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

import dataclasses
import importlib.metadata
import json
import pathlib
import re
import shutil

from turboquant.saving import OutputExists, refuse_existing

from .errors import RewriteError
from .plan import RewriteResult

CONFIG = "genai_config.json"
PER_LAYER_SHAPES_SINCE = (0, 14, 0)
# genai_config.json's sliding_window section with `layers` (the windowed layers' window-sized buffers,
# for GroupQueryAttention's sliding_window_cache) and `cache_slack`: microsoft/onnxruntime-genai #2334
WINDOW_CACHE_SINCE = (0, 18, 0)
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


def _providers(decoder: dict) -> set[str]:
    """The execution providers genai_config.json names for the decoder (none: the CPU)."""
    entries = decoder.get("session_options", {}).get("provider_options", [])
    return {k for e in entries if isinstance(e, dict) for k in e}


def keeps_window_cache(decoder: dict, version: str | None = None, cuda_graph: bool = False
                       ) -> tuple[bool, str | None]:
    """Whether the rewrite keeps the windowed layers' window-sized caches (export/gqa.py) for this
    decoder, and a line for the summary where the answer needs one: where genai_config.json has a
    sliding_window section naming its layers, the decoder runs on the CPU or CUDA provider (the
    op's kernels for the others take full-length caches only), its decode steps are not replayed
    from CUDA graphs (cuda_graph, or enable_cuda_graph in the config: ONNX Runtime runs a graph's
    first step more than once before it captures it, and a step that drops rows off a window-sized
    cache cannot be run twice) and genai (the installed one, or `version`) reads the section's
    layers. Without genai installed: assumed, and said."""
    section = decoder.get("sliding_window")
    if not isinstance(section, dict) or not section.get("layers") or not (section.get("window_size") or 0) > 0:
        return False, None
    providers = sorted(_providers(decoder) - {"cpu", "cuda"})
    if providers:
        return False, (f"window-sized caches made full-length: the decoder runs on {', '.join(providers)}, where "
                       "TQGroupQueryAttention takes full-length caches only")
    if cuda_graph or str((_cuda_options(decoder) or {}).get("enable_cuda_graph", "0")) in ("1", "true", "True"):
        return False, ("window-sized caches made full-length: decode steps replayed from CUDA graphs (ONNX Runtime "
                       "runs a graph's first step more than once, and a step that drops rows off a window-sized cache "
                       "cannot be repeated)")
    since = ".".join(map(str, WINDOW_CACHE_SINCE))
    where = "given" if version is not None else "installed"
    version = version if version is not None else installed_version()
    if version is None:
        return True, f"window-sized caches kept: onnxruntime-genai allocates them from {since}"
    if _release(version) >= WINDOW_CACHE_SINCE:
        return True, None
    return False, (f"window-sized caches made full-length: onnxruntime-genai {version} ({where}) does not allocate "
                   f"them (from {since})")


def check_output_folder(src: pathlib.Path, out: pathlib.Path) -> None:
    """genai reads one genai_config.json per folder: the rewritten model needs its own folder."""
    if (src.parent / CONFIG).is_file() and out.parent.resolve() == src.parent.resolve():
        raise RewriteError(f"{src.parent} is an onnxruntime-genai folder ({CONFIG}); the rewritten model needs its own "
                           f"config, so write it to another folder (-o OTHER_DIR/{out.name})")


def read_config(path: pathlib.Path) -> tuple[dict, dict]:
    """(the config, its model.decoder section) of genai_config.json at path; a RewriteError where it is
    not JSON or lacks what the rewrite edits."""
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RewriteError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RewriteError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    model = config.get("model") if isinstance(config, dict) else None
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise RewriteError(f"{path} has no model.decoder section")
    options = decoder.get("session_options", {})
    if not isinstance(options, dict) or not isinstance(options.get("provider_options", []), list):
        raise RewriteError(f"{path}: model.decoder.session_options must be an object whose provider_options is a list")
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
    _, decoder = read_config(path)
    if _cuda_options(decoder) is None:
        providers = sorted(_providers(decoder)) or ["cpu"]
        raise RewriteError(f"--genai-cuda-graph: {path} runs the decoder on {', '.join(providers)}, not on the cuda "
                           "provider whose graphs it would enable (build the model for cuda)")


@dataclasses.dataclass
class Folder:
    """What the output folder gets beside the model, read and checked before any work."""
    config: dict  # the source's genai_config.json, edited when staged
    decoder: dict  # its model.decoder section
    library: pathlib.Path  # turboquant's custom-op library, copied beside the model
    copies: list[pathlib.Path]  # the source folder's other files (tokenizer, chat template, ...)
    cuda_graph: bool = False  # the CUDA provider's decode steps replayed from graphs (enable_cuda_graph)

    def names(self) -> list[str]:
        return [self.library.name, *(f.name for f in self.copies), CONFIG]


def plan_folder(src: pathlib.Path, out: pathlib.Path, library: pathlib.Path, cuda_graph: bool = False) -> Folder:
    """The files out's folder will get; a RewriteError naming the first that exists (nothing is replaced,
    nor a stale tokenizer kept beside a new config)."""
    check_output_folder(src, out)
    if cuda_graph:
        check_cuda_graph(src)
    config, decoder = read_config(src.parent / CONFIG)
    skip = {CONFIG, src.name, out.name, f"{out.name}.data", library.name}
    copies = sorted(f for f in src.parent.iterdir() if f.is_file() and f.name not in skip
                    and not f.name.endswith((".onnx", ".onnx.data", ".onnx_data")))
    folder = Folder(config, decoder, library, copies, cuda_graph)
    try:
        refuse_existing([out.parent / n for n in folder.names()], "the onnxruntime-genai folder's file")
    except OutputExists as e:
        raise RewriteError(str(e)) from None
    return folder


def stage_folder(folder: Folder, out: pathlib.Path, result: RewriteResult, tmp: pathlib.Path
                 ) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """Writes the folder's files into tmp; returns (staged, final) pairs, the config last, so genai
    finds no config before the files it names. With cuda_graph the decode steps are replayed from
    CUDA graphs, which genai's GroupQueryAttention refuses at batch sizes above 1 and
    TQGroupQueryAttention runs."""
    staged = tmp / "genai"  # a folder of its own: no name here meets the model's
    staged.mkdir()
    if folder.cuda_graph:
        _cuda_options(folder.decoder)["enable_cuda_graph"] = "1"
    folder.decoder["filename"] = out.name
    # the uint8 caches' head_size is a row width in bytes: the widest layer's (module docstring)
    folder.decoder["head_size"] = result.row_bytes
    if result.pool_pairs is not None:
        paged_pools(folder.decoder, result.pool_pairs)
    dropped = None if result.window_cache else drop_sliding_window_section(folder.decoder, result)
    if dropped:
        result.notes.append(dropped)
    elif result.window_cache and "cuda" in _providers(folder.decoder):
        note = widen_cuda_window_cache(folder.decoder)
        if note:
            result.notes.append(note)
    folder.decoder.setdefault("session_options", {})["custom_ops_library"] = folder.library.name
    for f in (folder.library, *folder.copies):
        shutil.copy2(f, staged / f.name)
    (staged / CONFIG).write_text(json.dumps(folder.config, indent=4) + "\n")
    return [(staged / n, out.parent / n) for n in folder.names()]


# Rows a CUDA folder's window-sized caches get beyond their window: genai's CUDA default is none
# (ORT's CUDA kernel takes C == W only), which moves every kept row at each decode step once the
# buffer is full; TQGroupQueryAttention takes C > W, and G = C - W + 1 rows free make those moves
# one per G steps.
CUDA_CACHE_SLACK = 64


def widen_cuda_window_cache(decoder: dict) -> str | None:
    """genai_config.json's sliding_window.cache_slack for a CUDA folder whose window-sized caches the
    rewrite keeps, where the section leaves it at genai's default (0); the summary's line."""
    section = decoder["sliding_window"]
    if section.get("cache_slack"):
        return None
    section["cache_slack"] = CUDA_CACHE_SLACK
    return (f"{CONFIG}: sliding_window.cache_slack {CUDA_CACHE_SLACK}: the window-sized caches get "
            f"{CUDA_CACHE_SLACK} rows beyond the window, so their rows move once per {CUDA_CACHE_SLACK + 1} decode "
            "steps rather than at every one")


def drop_sliding_window_section(decoder: dict, result: RewriteResult) -> str | None:
    """genai_config.json's sliding_window section, dropped where the rewrite made every cache
    full-length (export/gqa.py, keeps_window_cache): the section tells onnxruntime-genai (0.18) to
    give its layers window-sized buffers (window_size plus a slack, for GroupQueryAttention's
    sliding_window_cache), while caches of rows by position need max_length rows for every layer. The ops keep
    their local_window_size and read only each window's rows. Returns the summary's line, or None
    where there was no section."""
    section = decoder.get("sliding_window")
    if not section:
        return None
    del decoder["sliding_window"]
    size = section.get("window_size") if isinstance(section, dict) else None
    return (f"{CONFIG}: its sliding_window section (window_size {size}) dropped: onnxruntime-genai allocates every "
            "layer's cache with max_length rows; the attention ops keep their windows and read only their rows")


def paged_pools(decoder: dict, pairs: int) -> None:
    """genai_config.json of a rewritten paged model (export/paged.py): the Engine allocates a pool pair
    for each of num_hidden_layers (src/engine/paged_key_value_cache.cpp), and 0.18 binds those its
    paged_kv state group's layer_ids name, each in [0, num_hidden_layers): both count every pair,
    the boundary layers' extra ones included."""
    decoder["num_hidden_layers"] = pairs
    for group in decoder.get("state_groups", []):
        if isinstance(group, dict) and group.get("kind") == "paged_kv":
            group["layer_ids"] = list(range(pairs))
