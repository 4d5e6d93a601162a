"""Benchmarks: `python -m turboquant.bench attention --device cpu` (see __main__.py)."""
