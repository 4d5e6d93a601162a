"""Exporting a local Hugging Face causal LM to ONNX with its KV cache (python -m turboquant.hf_export,
in __main__.py), its weights streamed into one external-data file (streamed.py)."""
