"""eval --simulate: the per-token formats' quantizer, and the original scored with its caches held in
them (more bits, less divergence; the loop's own caches changed in place)."""

import numpy as np
import pytest

from turboquant.eval import Evaluator, Windows
from turboquant.eval.__main__ import main
from turboquant.eval.simulated import SCHEMES, SimulatedCache, fake_quantize, hadamard


def test_hadamard_is_orthonormal_and_symmetric():
    for d in (1, 2, 64, 128):
        h = hadamard(d)
        assert np.allclose(h @ h, np.eye(d), atol=1e-6) and np.allclose(h, h.T)
    with pytest.raises(ValueError, match="power-of-two head size, not 96"):
        hadamard(96)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_fake_quantize(scheme, rng):
    bits, rotate = SCHEMES[scheme]
    x = rng.standard_normal((3, 5, 64)).astype(np.float32) * rng.uniform(0.1, 10, (3, 5, 1)).astype(np.float32)
    y = fake_quantize(x, scheme)
    v = x @ hadamard(64) if rotate else x
    step = np.abs(v).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    err = (y @ hadamard(64) if rotate else y) - v  # the error where it is made: within half a step (and fp16's scale)
    assert np.all(np.abs(err) <= step * (0.5 + 1e-2))
    levels = np.rint((y @ hadamard(64) if rotate else y) / step.astype(np.float16).astype(np.float32))
    assert len(np.unique(levels)) <= 2 ** bits
    assert np.array_equal(fake_quantize(np.zeros((2, 64), np.float32), scheme), np.zeros((2, 64)))


def test_int4_of_a_known_vector():
    x = np.array([[7.0, -3.4, 0.2, 1.0]], np.float32)  # scale 1: rounded to integers
    assert np.array_equal(fake_quantize(x, "int4_per_token"), [[7.0, -3.0, 0.0, 1.0]])


def test_the_loops_cache_rows_are_replaced(tiny):
    from turboquant.decode_loop import open_decoder

    src, _, _ = tiny
    loop = SimulatedCache(open_decoder(src, 64), "int4_per_token")
    ids = np.random.default_rng(0).integers(0, 256, (2, 12))
    _, cache = loop.step(ids[:, :10], loop.empty_cache(2), 0)
    _, cache = loop.step(ids[:, 10:11], cache, 10)
    for v in cache.values():
        a = np.asarray(v)
        assert np.array_equal(fake_quantize(a, "int4_per_token"), a)  # every row already in the format


def test_more_bits_diverge_less(tiny):
    src, _, ids_file = tiny
    ids = np.array(ids_file.read_text().split(), np.int64)
    ev = Evaluator(src, ids, Windows(context=96, prefill=48, max_tokens=96, batch=2), progress=False)
    r8, r4 = (ev.compare(src, s, simulate=s) for s in ("int8_per_token", "int4_per_token"))
    assert 0 < r8.mean_kl < r4.mean_kl and r4.top1 < 1.0 + 1e-9


def test_cli_row(tiny, capsys):
    src, _, ids_file = tiny
    assert main([str(src), "--text", str(ids_file), "--context", "96", "--prefill", "48", "--max-tokens", "48",
                 "--simulate", "int4_per_token_hadamard", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "original, int4 per token + Hadamard (simulated)" in out


def test_hadamard_on_a_head_size_not_a_power_of_two_refused_first(tmp_path, tiny, capsys, monkeypatch):
    from turboquant import random_decoders
    from turboquant.eval import runner

    cfg = random_decoders.TinyConfig(layers=1, hidden=96, heads=4, kv_heads=2, head_dim=24, vocab=256)
    src = random_decoders.export(cfg, tmp_path / "hd24.onnx")
    monkeypatch.setattr(runner.Evaluator, "__init__", lambda *a, **k: pytest.fail("the original ran"))
    assert main([str(src), "--text", str(tiny[2]), "--simulate", "int4_per_token_hadamard", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a power-of-two head size" in err[0] and "has 24" in err[0]


@pytest.mark.gpu
def test_simulated_on_device_caches(tmp_path, cuda_ready):
    """genai's fp16 CUDA model through the shared buffers on the device: the rows go through a host
    copy and back, and more bits still diverge less."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes the model)")
    from turboquant import random_decoders

    cfg = random_decoders.TinyConfig(layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=512)
    src = random_decoders.export_genai(cfg, tmp_path / "g", "fp16", "cuda")
    ids = np.random.default_rng(2).integers(3, 512, 400)
    ev = Evaluator(src, ids, Windows(context=96, prefill=48, max_tokens=96, batch=2), progress=False,
                   providers=["CUDAExecutionProvider"], shared_buffer=True)
    r8, r4 = (ev.compare(src, s, simulate=s) for s in ("int8_per_token", "int4_per_token_hadamard"))
    assert 0 < r8.mean_kl < r4.mean_kl
