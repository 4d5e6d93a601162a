"""Serving turboquant models: Triton Inference Server model repositories (turboquant.serving.triton)."""
