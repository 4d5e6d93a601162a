"""turboquant.export: rewrite an exported ONNX decoder to attend over a TurboQuant-packed KV cache."""
