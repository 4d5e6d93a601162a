"""turboquant.shared_buffer.SharedBufferDecoder's static shapes and CUDA graphs: decode steps whose
inputs keep one shape (attention_mask as wide as the buffers), bound once and updated in place,
against the growing mask's steps; on a GPU, the same steps replayed from ONNX Runtime's CUDA graphs."""

import weakref

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import random_decoders  # noqa: E402
from turboquant.export import export  # noqa: E402
from turboquant.shared_buffer import SharedBufferDecoder  # noqa: E402

PRESET = "turboquant_4bit_nc"
MAX_LENGTH = 40
CFG = dict(layers=4, hidden=128, heads=4, head_dim=32, vocab=320, seed=3)
# in-place rewrites of exports, by family and exporter
EXPORTS = {"llama-torchscript": ("llama", "torchscript", 2), "gpt2-torchscript": ("gpt2", "torchscript", 4),
           "qwen2-dynamo": ("qwen2", "dynamo", 2)}
MODELS = ["genai", "genai-tq", *EXPORTS]


def _genai(folder, precision="fp32", provider="cpu"):
    """onnxruntime-genai's builder's model and its rewrite (GroupQueryAttention and TQGroupQueryAttention)."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the genai models")
    cfg = random_decoders.TinyConfig(family="llama", kv_heads=2, **CFG)
    src = random_decoders.export_genai(cfg, folder, precision=precision, provider=provider)
    return src, export(src, PRESET, folder / "tq" / "model.onnx", boundary=1, offsets=False, progress=False).output


def _in_place(name, folder, dtype="float32"):
    """An export's in-place rewrite (GroupQueryAttention on the kept layers, TQGroupQueryAttention packed)."""
    family, exporter, kv_heads = EXPORTS[name]
    cfg = random_decoders.TinyConfig(family=family, kv_heads=kv_heads, **CFG)
    src = random_decoders.export(cfg, folder / f"{name}.onnx", exporter, dtype)
    return export(src, PRESET, folder / f"{name}.in-place.onnx", boundary=1, cache="in-place", offsets=False,
                  progress=False).output


@pytest.fixture(scope="module")
def models(module_tmp):
    made = {}

    def get(name):
        if name not in made:
            folder = module_tmp.mktemp(name)
            if name.startswith("genai"):
                made["genai"], made["genai-tq"] = _genai(folder)
            else:
                made[name] = _in_place(name, folder)
        return made[name]

    return get


def _padded_decode(dec, ids, lens, steps):
    """A right-padded prompt (lens tokens of ids' rows), then steps tokens per sequence, each at its own
    length; the logits of each sequence's last prompt token and of every step, [B, 1 + steps, V]."""
    prompt = ids[:, :lens.max()].copy()
    for row, n in enumerate(lens):
        prompt[row, n:] = 0  # padding, never attended
    cache = dec.empty_cache(len(lens))
    logits, cache = dec.step(prompt, cache, 0, lengths=lens)
    out = [logits[np.arange(len(lens)), lens - 1]]
    for t in range(steps):
        step_ids = ids[np.arange(len(lens)), lens + t][:, None]
        logits, cache = dec.step(step_ids, cache, int(lens.max()) + t, lengths=lens + t + 1)
        out.append(logits[:, 0])
    return np.stack(out, axis=1)


@pytest.mark.parametrize("name", MODELS)
def test_static_steps_give_the_growing_masks_logits(models, name):
    """The lengths come from the mask's sums and its width only sizes the attention's
    total_sequence_length (and shapes off the length axis), so a mask as wide as the buffers gives
    the growing mask's logits: for a right-padded batch, teacher forcing and greedy generation."""
    path = models(name)
    ids = np.random.default_rng(1).integers(3, 320, (2, 30))
    lens = np.array([12, 7])
    plain, static = SharedBufferDecoder(path, MAX_LENGTH), SharedBufferDecoder(path, MAX_LENGTH, static_shapes=True)
    np.testing.assert_allclose(_padded_decode(static, ids, lens, 8), _padded_decode(plain, ids, lens, 8), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(static.teacher_forced(ids, 10), plain.teacher_forced(ids, 10), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(static.generate(ids[:, :5], 8), plain.generate(ids[:, :5], 8))


def test_static_inputs_are_bound_once(models):
    """One binding per cache: each step writes the same device buffers, of the same shapes (the mask
    as wide as the buffers, ones up to each sequence's length); other buffers or another batch bind anew."""
    dec = SharedBufferDecoder(models("llama-torchscript"), MAX_LENGTH, static_shapes=True)
    ids = np.random.default_rng(2).integers(3, 320, (2, 20))
    lens = np.array([9, 4])
    _padded_decode(dec, ids, lens, 1)
    bound = dec._binding
    addresses = {n: v.data_ptr() for n, v in bound.inputs.items()}
    assert set(addresses) == {"input_ids", "attention_mask", "position_ids"}
    cache = bound.cache
    for t in range(1, 4):
        step_ids = ids[np.arange(2), lens + t][:, None]
        dec.step(step_ids, cache, 9 + t, lengths=lens + t + 1)
        assert dec._binding is bound and {n: v.data_ptr() for n, v in bound.inputs.items()} == addresses
        mask = bound.inputs["attention_mask"].numpy()
        assert mask.shape == (2, MAX_LENGTH) and mask.dtype == np.int64
        np.testing.assert_array_equal(mask, np.arange(MAX_LENGTH)[None] < (lens + t + 1)[:, None])
        np.testing.assert_array_equal(bound.inputs["position_ids"].numpy(), (lens + t)[:, None])
        np.testing.assert_array_equal(bound.inputs["input_ids"].numpy(), step_ids)
    dec.teacher_forced(ids[:1], 10)  # another batch, new buffers
    assert dec._binding is not bound and dec._binding.key[0] == 1
    with pytest.raises(ValueError, match=r"lengths must be 2 counts in \[1, 13\]"):
        dec.step(ids[:, :1], cache, 12, lengths=[14, 5])


def test_steps_keep_one_binding_per_cache_and_let_it_go_with_the_cache(models):
    """Steps of any shape on one cache reuse its binding (the layers' buffers bound once), give the
    logits of a decoder binding anew each step, bind another cache anew, and let the binding (which
    holds the buffers) go on release and before empty_cache allocates, so that a dropped cache is freed."""
    path = models("genai-tq")
    ids = np.random.default_rng(4).integers(3, 320, (2, 30))
    lens = np.array([11, 6])
    dec = SharedBufferDecoder(path, MAX_LENGTH)
    want = _padded_decode(SharedBufferDecoder(path, MAX_LENGTH), ids, lens, 6)
    np.testing.assert_allclose(_padded_decode(dec, ids, lens, 6), want, rtol=1e-5, atol=1e-5)
    cache = dec.empty_cache(2)
    dec.step(ids[:, :5], cache, 0)
    bound = dec._dynamic
    for t in range(5, 8):
        dec.step(ids[:, t:t + 1], cache, t)
        assert dec._dynamic is bound
    other = dec.empty_cache(2)
    dec.step(ids[:, :5], other, 0)
    assert dec._dynamic is not bound
    del bound
    np.testing.assert_allclose(_padded_decode(dec, ids, lens, 6), want, rtol=1e-5, atol=1e-5)  # its own cache
    dec.step(ids[:, :5], other, 0)
    ref = weakref.ref(other[next(iter(other))])
    del other
    assert ref() is not None  # held by the binding
    dec.release()
    assert dec._dynamic is None and ref() is None
    dec.step(ids[:, :5], cache, 0)
    ref = weakref.ref(cache[next(iter(cache))])
    del cache
    dec.empty_cache(2)
    assert ref() is None


def test_graph_bookkeeping_on_the_cpu(models):
    """cuda_graph's bookkeeping, driven on the CPU (a static-shape decoder told it replays graphs;
    ORT's CPU provider takes the run options and captures nothing): one graph id per binding, prompts
    with gpu_graph_id -1, empty_cache giving the bound buffers back so a second generation keeps the
    graph, another batch a new id, and the tokens of the plain loop throughout."""
    path = models("llama-torchscript")
    dec = SharedBufferDecoder(path, MAX_LENGTH, static_shapes=True)
    dec.cuda_graph = True
    dec._prompt_options = ort.RunOptions()
    dec._prompt_options.add_run_config_entry("gpu_graph_id", "-1")
    ids = np.random.default_rng(3).integers(3, 320, (2, 30))
    want = SharedBufferDecoder(path, MAX_LENGTH).generate(ids[:, :5], 8)
    np.testing.assert_array_equal(dec.generate(ids[:, :5], 8), want)
    first = dec._binding
    assert first.graph_id == 1 and first.run_options.get_run_config_entry("gpu_graph_id") == "1" and first.ran
    assert dec.empty_cache(2) == first.cache and dec.empty_cache(1) != first.cache
    np.testing.assert_array_equal(dec.generate(ids[:, :5], 8), want)
    assert dec._binding is first
    dec.teacher_forced(ids[:1], 10)
    assert dec._binding.graph_id == 2 and dec._binding.key[0] == 1
    np.testing.assert_array_equal(dec.generate(ids[:, :5], 8), want)
    assert dec._binding.graph_id == 3  # the batch of 2's buffers went with their binding: captured anew


def test_static_shapes_refuse_exports_without_position_ids(models, tmp_path):
    """An exported decoder's in-place rewrite that takes no position_ids derives them from the mask
    or the past's length, which a mask as wide as the buffers would move: refused, naming the input."""
    m = onnx.load(models("genai"))  # no position_ids: genai turns rotary inside the op, by length
    onnx.helper.set_model_props(m, {"turboquant.cache": "in-place"})
    onnx.save(m, tmp_path / "model.onnx")
    with pytest.raises(ValueError, match="static shapes need a position_ids input"):
        SharedBufferDecoder(tmp_path / "model.onnx", MAX_LENGTH, head_size=32, static_shapes=True)
    SharedBufferDecoder(tmp_path / "model.onnx", MAX_LENGTH, head_size=32)  # growing masks as before


def test_cuda_graph_refusals_name_the_provider(models):
    """cuda_graph needs ORT's CUDA provider first: refused with the providers named on the CPU;
    open_decoder refuses it (and static shapes) for a model whose caches grow, naming the model."""
    from turboquant.decode_loop import open_decoder

    path = models("genai")
    original = models("llama-torchscript").parent / "llama-torchscript.onnx"
    for kw in ("cuda_graph", "static_shapes"):
        with pytest.raises(ValueError, match=f"{original}: {kw} need caches written in place"):
            open_decoder(original, MAX_LENGTH, **{kw: True})
    assert open_decoder(models("llama-torchscript"), MAX_LENGTH, static_shapes=True).static_shapes
    with pytest.raises(ValueError, match=r"CUDAExecutionProvider as the first provider, got \['CPUExecutionProvider'\]"):
        SharedBufferDecoder(path, MAX_LENGTH, cuda_graph=True)
    with pytest.raises(ValueError, match="first provider"):
        SharedBufferDecoder(path, MAX_LENGTH, providers=["CPUExecutionProvider", "CUDAExecutionProvider"], cuda_graph=True)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ValueError, match="install onnxruntime-gpu"):
            SharedBufferDecoder(path, MAX_LENGTH, providers=["CUDAExecutionProvider"], cuda_graph=True)


@pytest.fixture
def fp16_cuda_models(cuda_ready, tmp_path):
    """fp16 models every node of which ORT's CUDA provider takes (its GroupQueryAttention is fp16 and
    bf16 only): genai's builder's CUDA model, its rewrite, a TorchScript export's in-place rewrite."""
    genai, genai_tq = _genai(tmp_path / "genai", precision="fp16", provider="cuda")
    return {"genai": genai, "genai-tq": genai_tq,
            "llama-torchscript": _in_place("llama-torchscript", tmp_path, "float16")}


@pytest.mark.gpu
def test_cuda_graph_decode_matches_the_plain_loop(fp16_cuda_models):
    """Decode steps replayed from CUDA graphs (the prompt outside them, in the same session) give the
    logits of the same model's steps without graphs, for a right-padded batch; a second generation
    on the same buffers replays the same graph; another batch captures another."""
    cuda = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    ids = np.random.default_rng(5).integers(3, 320, (2, 40))
    lens = np.array([14, 9])
    for name, path in fp16_cuda_models.items():
        plain = SharedBufferDecoder(path, MAX_LENGTH, providers=cuda)
        graph = SharedBufferDecoder(path, MAX_LENGTH, providers=cuda, cuda_graph=True)
        assert graph.on_cuda and graph.static_shapes
        want = _padded_decode(plain, ids, lens, 20).astype(np.float32)
        got = _padded_decode(graph, ids, lens, 20).astype(np.float32)
        # the graph's attention is planned over every row of the buffers (ops.md, CUDA graphs): other
        # splits, the same sums to fp16 rounding
        np.testing.assert_allclose(got, want, atol=2e-2 * max(1.0, float(np.abs(want).max())), err_msg=name)
        assert float((got.argmax(-1) == want.argmax(-1)).mean()) >= 0.95, name
        first = graph._binding
        tokens = graph.generate(ids[:, :6], 12)  # empty_cache gives the bound buffers back: the graph replayed
        again = graph.generate(ids[:, :6], 12)
        assert graph._binding is first and first.graph_id is not None
        np.testing.assert_array_equal(again, tokens, err_msg=name)
        np.testing.assert_array_equal(tokens, plain.generate(ids[:, :6], 12), err_msg=name)
        one = graph.teacher_forced(ids[:1, :24], 10).astype(np.float32)  # another batch: another capture
        assert graph._binding.graph_id == first.graph_id + 1
        np.testing.assert_allclose(one, plain.teacher_forced(ids[:1, :24], 10).astype(np.float32),
                                   atol=2e-2 * max(1.0, float(np.abs(one).max())), err_msg=name)
