"""TurboQuant KV-cache compression for ONNX Runtime and TensorRT.

- turboquant.config: presets and per-layer formats (TQ_PRESETS, TurboQuantConfig)
- turboquant.codebook: exact Lloyd-Max codebooks
- turboquant.reference: numpy reference of the formats and of attention over a packed cache
- turboquant.onnx_ops: the `turboquant` ONNX domain (schemas, onnx.reference implementations)
- turboquant.ort: ONNX Runtime sessions with the custom-op library registered
- turboquant.export: the graph rewrite and its calibration (python -m turboquant.export)
- turboquant.decoder: the decode loop over the KV cache in ONNX Runtime (DecoderSession)
- turboquant.eval: perplexity, KL and top-1 of a rewrite against its original (python -m turboquant.eval)
- turboquant.bench: decode-attention benchmarks and the report (python -m turboquant.bench)
- turboquant.tensorrt: the TensorRT plugin library loaded into a builder or runtime, engine building
  with TensorRT or TensorRT-RTX (python -m turboquant.build_engine); turboquant.trt_engine runs an engine
- turboquant.serving.triton: Triton Inference Server model repositories
- turboquant.hf_export: a local Hugging Face causal LM to ONNX with its KV cache (python -m turboquant.hf_export)
- turboquant.example: the whole job on SmolLM2-135M or a small random model (python -m turboquant.example)
- turboquant.shared_buffer, turboquant.kernel_plan: the shared-buffer decode loop (CUDA graphs too),
  which CUDA kernels serve a call
"""

import importlib.util as _util
import pathlib as _pathlib
import sys as _sys

# The wheel installs the top-level export/ folder as turboquant/export. In a source checkout (for
# instance `python -m turboquant.export` run from the repository root) map that one name the same
# way, and nothing else of the checkout (extending __path__ to the root made turboquant.turboquant
# a second copy of the package).
_SOURCE_EXPORT = _pathlib.Path(__file__).resolve().parent.parent / "export"
if not (_pathlib.Path(__file__).parent / "export").is_dir() and (_SOURCE_EXPORT / "__init__.py").is_file():

    class _SourceExportFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "turboquant.export":
                return None
            return _util.spec_from_file_location(name, _SOURCE_EXPORT / "__init__.py",
                                                 submodule_search_locations=[str(_SOURCE_EXPORT)])

    _sys.meta_path.append(_SourceExportFinder())

from ._libs import LibraryNotBuiltError, ort_library_path, trt_plugin_path
from .config import FORMAT_VERSION, TQ_PRESETS, LayerInfo, TurboQuantConfig

__version__ = "0.1.0"
DOMAIN = "turboquant"
OPSET_VERSION = 1

__all__ = [
    "DOMAIN",
    "FORMAT_VERSION",
    "LayerInfo",
    "LibraryNotBuiltError",
    "OPSET_VERSION",
    "TQ_PRESETS",
    "TurboQuantConfig",
    "ort_library_path",
    "trt_plugin_path",
]
