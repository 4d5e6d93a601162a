"""The in-place cache form (export/in_place.py) on decoders exported by torch.onnx, run by
SharedBufferDecoder against the original and against the default (concat) rewrite."""

import numpy as np
import onnx
import pytest

from turboquant.decoder import DecoderSession
from turboquant.example import mean_kl
from turboquant.export import RewriteError, export
from turboquant.shared_buffer import SharedBufferDecoder

from .conftest import MODELS

PRESET = "turboquant_4bit_nc"
STEPS = 32
NAMES = ["llama-gqa-torchscript", "llama-gqa-dynamo", "qwen2-gqa-dynamo-d128", "gpt2-mha-torchscript",
         "llama-gqa-torchscript-fp16"]


@pytest.fixture(scope="module")
def rewrites(exported, tmp_path_factory):
    cache = {}

    def get(name, form):
        if (name, form) not in cache:
            out = tmp_path_factory.mktemp("in_place") / f"{name}.{form}.onnx"
            # the held-out ids below are random: calibrated on the same kind, as the agreement bound assumes
            cache[name, form] = export(exported(name), PRESET, out, cache=form, calibrate="random", progress=False)
        return cache[name, form]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_in_place_matches_the_concat_form(exported, rewrites, name):
    """The same packed bytes attended through buffers written in place: the logits of the default
    rewrite to float tolerance (its boundary layers through ORT's GroupQueryAttention instead of the
    exporter's attention), and the original's as the real-exporter test asks."""
    cfg, _ = MODELS[name]
    in_place, concat = rewrites(name, "in-place"), rewrites(name, "concat")
    assert in_place.compressed == concat.compressed
    ids = np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, (2, 12 + STEPS))
    a = DecoderSession(exported(name)).teacher_forced(ids, 12).astype(np.float32)
    b = DecoderSession(concat.output).teacher_forced(ids, 12).astype(np.float32)
    c = SharedBufferDecoder(in_place.output, max_length=64).teacher_forced(ids, 12).astype(np.float32)
    tol = 2e-2 if name.endswith("fp16") else 1e-3
    np.testing.assert_allclose(c[:, 0], a[:, 0], atol=tol * max(1.0, float(np.abs(a[:, 0]).max())))
    # float rounding apart (fp16: the boundary layers' outputs rounded to half precision once more),
    # a key on a codebook boundary may pack to the neighbouring code: the two rewrites are far
    # closer to each other than either is to the original
    kl_forms, kl_original = mean_kl(b[:, 1:], c[:, 1:]), mean_kl(a[:, 1:], c[:, 1:])
    print(f"{name}: KL in-place vs concat {kl_forms:.2e}, vs the original {kl_original:.2e}")
    assert kl_forms < 0.1 * kl_original, (kl_forms, kl_original)
    top1 = float((a[:, 1:].argmax(-1) == c[:, 1:].argmax(-1)).mean())
    assert top1 >= 0.9, (kl_original, top1)


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-dynamo"])
def test_right_padded_batch_decodes_each_sequence_as_alone(rewrites, name):
    """Prompts of 12 and 7 tokens in one batch, the second right-padded, then decode steps in which
    each sequence writes at its own length: every sequence's logits are those it gets alone."""
    cfg, _ = MODELS[name]
    dec = SharedBufferDecoder(rewrites(name, "in-place").output, max_length=48)
    rng = np.random.default_rng(7)
    lens = np.array([12, 7])
    ids = rng.integers(0, cfg.vocab, (2, 12 + 6))
    prompt = ids[:, :12].copy()
    prompt[1, 7:] = 0  # padding, never attended
    cache = dec.empty_cache(2)
    logits, cache = dec.step(prompt, cache, 0, lengths=lens)
    together = [[logits[0, 11]], [logits[1, 6]]]
    for t in range(6):
        step_ids = np.array([[ids[0, 12 + t]], [ids[1, 7 + t]]])
        logits, cache = dec.step(step_ids, cache, 12 + t, lengths=lens + t + 1)
        together[0].append(logits[0, 0])
        together[1].append(logits[1, 0])
    for row, n in enumerate(lens):
        alone = SharedBufferDecoder(rewrites(name, "in-place").output, max_length=48)
        own = ids[row:row + 1, :n + 6] if row == 0 else np.concatenate([ids[1:2, :7], ids[1:2, 7:13]], axis=1)
        expect = alone.teacher_forced(own, int(n))
        np.testing.assert_allclose(np.stack(together[row]), expect[0, :7], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-dynamo"])
def test_graph_has_buffers_and_no_mask(rewrites, name):
    m = onnx.load(str(rewrites(name, "in-place").output), load_external_data=False)
    ops = {n.op_type for n in m.graph.node}
    assert "Softmax" not in ops and "Attention" not in ops and "Concat" not in {
        n.op_type for n in m.graph.node if any(i.startswith("past_key_values") for i in n.input)}
    assert sum(n.op_type == "TQGroupQueryAttention" for n in m.graph.node) == 2
    assert sum(n.op_type == "GroupQueryAttention" for n in m.graph.node) == 4
    types = {i.name: i.type.tensor_type for i in m.graph.input}
    key2, key0 = types["past_key_values.2.key"], types["past_key_values.0.key"]
    assert key2.elem_type == onnx.TensorProto.UINT8 and key0.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in key2.shape.dim][1:] == [2, "max_length", 36]
    outs = {o.name: o.type.tensor_type for o in m.graph.output}
    assert [d.dim_param or d.dim_value for d in outs["present.2.key"].shape.dim][1:] == [2, "max_length", 36]
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["turboquant.cache"] == "in-place"
    with pytest.raises(ValueError, match="SharedBufferDecoder"):
        DecoderSession(rewrites(name, "in-place").output)


def test_kept_layers_as_raw16(exported, rewrites, tmp_path):
    """kept_raw16 (TensorRT's in-place form, which has no GroupQueryAttention): the kept layers' fp16
    rows as raw16 TQGroupQueryAttention, the same logits as ORT's GroupQueryAttention gives them."""
    import onnx_ir as ir

    from turboquant.export.in_place import rewrite_in_place

    name = "llama-gqa-torchscript-fp16"
    model = ir.load(exported(name))
    result = rewrite_in_place(model, PRESET, {i: 4 for i in range(6)}, kept_raw16=True)
    assert all(p.key_format == "raw16" for p in result.layers if not p.compressed)
    ops = [n.op_type for n in model.graph]
    assert ops.count("TQGroupQueryAttention") == 6 and "GroupQueryAttention" not in ops
    ir.save(model, tmp_path / "raw16.onnx")
    ids = np.random.default_rng(3).integers(0, MODELS[name][0].vocab, (1, 20))
    a = SharedBufferDecoder(rewrites(name, "in-place").output, max_length=32).teacher_forced(ids, 12)
    b = SharedBufferDecoder(tmp_path / "raw16.onnx", max_length=32).teacher_forced(ids, 12)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=2e-2 * float(np.abs(a[:, 0]).max()))
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 0.9


def test_refusals(exported, tmp_path):
    with pytest.raises(RewriteError, match="merged"):
        export(exported("llama-gqa-torchscript-merged"), PRESET, tmp_path / "m.onnx", cache="in-place", offsets=False)
    with pytest.raises(RewriteError, match="float32 caches"):
        export(exported("llama-gqa-torchscript"), PRESET, tmp_path / "t.onnx", cache="in-place", target="tensorrt")
    with pytest.raises(RewriteError, match="cache must be"):
        export(exported("llama-gqa-torchscript"), PRESET, tmp_path / "c.onnx", cache="inplace")
    assert not list(tmp_path.iterdir())
