"""turboquant.decoder.DecoderSession on a rewritten model, on the CPU and (where present) the GPU."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import random_decoders  # noqa: E402
from turboquant.decoder import DecoderSession, greedy  # noqa: E402
from turboquant.export import export  # noqa: E402


@pytest.fixture(scope="module")
def models(module_tmp):
    d = module_tmp.mktemp("decoder")
    cfg = random_decoders.TinyConfig(family="llama", layers=5, hidden=128, heads=4, kv_heads=2, head_dim=32)
    src = random_decoders.export(cfg, d / "m.onnx", "torchscript")
    return src, export(src, "turboquant_4bit_nc", d / "m.tq.onnx", boundary=1, cache="concat").output


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


class _Counting(DecoderSession):
    """Counts the model runs generate makes."""

    steps = 0

    def step(self, input_ids, cache, past_len):
        self.steps += 1
        return super().step(input_ids, cache, past_len)


def test_generate_runs_no_step_it_does_not_return(models):
    src, _ = models
    prompt = np.array([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]])
    sess = _Counting(src)
    empty = sess.generate(prompt, 0)
    assert empty.shape == (2, 0) and empty.dtype == np.int64 and sess.steps == 0
    tokens = sess.generate(prompt, 4)
    assert tokens.shape == (2, 4) and sess.steps == 4  # the prompt, then 3 decode steps
    # the tokens are the greedy ones: each the argmax after the prompt and the tokens before it
    logits = DecoderSession(src).teacher_forced(np.concatenate([prompt, tokens], axis=1), prompt.shape[1])
    np.testing.assert_array_equal(logits[:, :4].argmax(-1), tokens)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer of zero or more, got -1"):
        sess.generate(prompt, -1)


def test_shared_buffer_generate_fills_the_buffer_exactly(tmp_path):
    """The shared loop: a buffer of prompt + new - 1 rows holds every token generate feeds the model."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes the model)")
    from turboquant.shared_buffer import SharedBufferDecoder

    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=320, seed=3)
    model = random_decoders.export_genai(cfg, tmp_path)
    prompt = np.random.default_rng(2).integers(3, cfg.vocab, (2, 6))
    want = SharedBufferDecoder(model, 64).generate(prompt, 5)
    np.testing.assert_array_equal(SharedBufferDecoder(model, 6 + 5 - 1).generate(prompt, 5), want)
    assert SharedBufferDecoder(model, 6).generate(prompt, 0).shape == (2, 0)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 70), st.integers(0, 2**31 - 1), st.sampled_from([1e-6, 1.0, 3e4]))
def test_greedy_over_float16_picks_float32s_argmax(rows, vocab, seed, scale):
    """greedy's int16 keys order float16 as float comparison does: negatives, signed zeros (ties),
    infinities, subnormals and repeated maxima give float32's argmax (the first of equal scores)."""
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):  # scores past float16's range become infinities, as a model's would
        x = (rng.standard_normal((rows, vocab)) * scale).astype(np.float16)
    for value, share in ((0.0, 0.1), (-0.0, 0.1), (np.inf, 0.02), (-np.inf, 0.05), (np.float16(6e-8), 0.05)):
        x[rng.random(x.shape) < share] = value
    x[:, rng.integers(vocab):] *= rng.choice([1, -1])
    want = x.astype(np.float32).argmax(-1)
    np.testing.assert_array_equal(greedy(x), want)
    np.testing.assert_array_equal(greedy(x.astype(np.float32)), want)
    assert x.dtype == np.float16 and np.array_equal(greedy(x[:, None]), want[:, None])  # any leading axes
