import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import random_decoders  # noqa: E402
from turboquant.export import export  # noqa: E402

CFG = random_decoders.TinyConfig(family="llama", layers=5, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=256, seed=4)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(original, rewritten 3bit_nc, token ids file) for a small Llama-style decoder."""
    d = tmp_path_factory.mktemp("eval")
    src = random_decoders.export(CFG, d / "tiny.onnx")
    dst = export(src, "turboquant_3bit_nc", d / "tiny.3bit_nc.onnx", boundary=1, progress=False).output
    ids = np.random.default_rng(1).integers(0, CFG.vocab, 400)
    (d / "text.ids").write_text(" ".join(map(str, ids)))
    return src, dst, d / "text.ids"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    """The eval CLI keeps the original's logits under $TURBOQUANT_CACHE: a test's own folder, never ~/.cache."""
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path / "cache"))
