"""turboquant.decoder.DecoderSession on a rewritten model, on the CPU and (where present) the GPU."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import examples  # noqa: E402
from turboquant.decoder import DecoderSession  # noqa: E402
from turboquant.export import export  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("decoder")
    cfg = examples.TinyConfig(family="llama", layers=5, hidden=128, heads=4, kv_heads=2, head_dim=32)
    src = examples.export(cfg, d / "m.onnx", "torchscript")
    return src, export(src, "turboquant_4bit_nc", d / "m.tq.onnx", boundary=1).output


def test_empty_cache_types(models):
    _, tq = models
    sess = DecoderSession(tq)
    cache = sess.empty_cache(2)
    dtypes = {name: arr.dtype for name, arr in cache.items()}
    assert dtypes["past_key_values.0.key"] == np.float32 and dtypes["past_key_values.1.key"] == np.uint8
    assert cache["past_key_values.1.key"].shape == (2, 2, 0, 18)


def test_generate_on_each_device(models, device_ready):
    """Greedy generation of the rewritten model; on the GPU through IO binding with the cache kept on
    the device, giving the CPU's tokens."""
    _, tq = models
    prompt = np.array([[3, 1, 4, 1, 5]])
    # TF32 off: ORT's CUDA MatMuls would otherwise differ from the CPU's by ~1e-3 everywhere
    cuda = ("CUDAExecutionProvider", {"use_tf32": "0"})
    providers = [cuda, "CPUExecutionProvider"] if device_ready == "cuda" else ["CPUExecutionProvider"]
    sess = DecoderSession(tq, providers=providers)
    assert sess.on_cuda == (device_ready == "cuda")
    logits_gpu = sess.teacher_forced(np.array([[3, 1, 4, 1, 5, 9, 2, 6]]), 5)
    logits_cpu = DecoderSession(tq).teacher_forced(np.array([[3, 1, 4, 1, 5, 9, 2, 6]]), 5)
    np.testing.assert_allclose(logits_gpu, logits_cpu, rtol=1e-3, atol=1e-3)
    tokens = sess.generate(prompt, 6)
    assert tokens.shape == (1, 6)
    np.testing.assert_array_equal(tokens, DecoderSession(tq).generate(prompt, 6))
