"""turboquant.export: rewrite an exported ONNX decoder to attend over a TurboQuant-packed KV cache.

    python -m turboquant.export model.onnx --preset turboquant_4bit_nc -o model.tq.onnx

or, from Python:

    from turboquant.export import export
    result = export("model.onnx", "turboquant_4bit_nc", "model.tq.onnx")
    print(result.summary())

`rewrite_model` (the concat cache form) works on an onnx_ir.Model in memory; `passes.TurboQuantRewrite` is the rewrite as an
onnx-ir pass, for pass pipelines.
"""

from .concat import rewrite_model
from .errors import RewriteError
from .passes import RewritePreconditionError, TurboQuantRewrite
from .plan import RewriteResult
from .rewrite import default_output, export

__all__ = ["RewriteError", "RewritePreconditionError", "RewriteResult", "TurboQuantRewrite", "default_output", "export",
           "rewrite_model"]
