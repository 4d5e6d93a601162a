"""The in-place cache form (export/in_place.py) on decoders exported by torch.onnx, run by
SharedBufferDecoder against the original and against the default (concat) rewrite."""

import numpy as np
import onnx
import pytest

from turboquant.decoder import DecoderSession
from turboquant.eval.metrics import mean_kl
from turboquant.export import RewriteError, export
from turboquant.shared_buffer import SharedBufferDecoder

from .conftest import MODELS

PRESET = "turboquant_4bit_nc"
STEPS = 32
SEQUENCES = 8  # as test_rewrite_real_models: 256 scored tokens
NAMES = ["llama-gqa-torchscript", "llama-gqa-dynamo", "qwen2-gqa-dynamo-d128", "gpt2-mha-torchscript",
         "llama-gqa-torchscript-fp16", "llama-gqa-optimum", "qwen2-gqa-optimum"]


@pytest.mark.parametrize("name", NAMES)
def test_in_place_matches_the_concat_form(exported, rewritten, name):
    """The same packed bytes attended through buffers written in place: the logits of the default
    rewrite to float tolerance (its boundary layers through ORT's GroupQueryAttention instead of the
    exporter's attention), and the original's as the real-exporter test asks."""
    cfg, _ = MODELS[name]
    in_place, concat = rewritten(name, PRESET, "in-place"), rewritten(name, PRESET)
    assert in_place.compressed == concat.compressed
    ids = np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, (SEQUENCES, 12 + STEPS))
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
    assert top1 >= 0.85, (kl_original, top1)


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-dynamo"])
def test_right_padded_batch_decodes_each_sequence_as_alone(rewritten, name):
    """Prompts of 12 and 7 tokens in one batch, the second right-padded, then decode steps in which
    each sequence writes at its own length: every sequence's logits are those it gets alone."""
    cfg, _ = MODELS[name]
    dec = SharedBufferDecoder(rewritten(name, PRESET, "in-place").output, max_length=48)
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
        alone = SharedBufferDecoder(rewritten(name, PRESET, "in-place").output, max_length=48)
        own = ids[row:row + 1, :n + 6] if row == 0 else np.concatenate([ids[1:2, :7], ids[1:2, 7:13]], axis=1)
        expect = alone.teacher_forced(own, int(n))
        np.testing.assert_allclose(np.stack(together[row]), expect[0, :7], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-dynamo"])
def test_graph_has_buffers_and_no_mask(rewritten, name):
    m = onnx.load(str(rewritten(name, PRESET, "in-place").output), load_external_data=False)
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
        DecoderSession(rewritten(name, PRESET, "in-place").output)


def test_kept_layers_as_raw16(exported, rewritten, tmp_path):
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
    a = SharedBufferDecoder(rewritten(name, PRESET, "in-place").output, max_length=32).teacher_forced(ids, 12)
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


def test_masks_lengths_cannot_replace_keep_the_concat_form(tmp_path):
    """A sliding-window model (Mistral's export masks keys beyond the window): the probe of the original
    finds its masks are not padding with causal, so auto keeps the concat form, saying why, and an
    explicit in-place rewrite is refused."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from turboquant import random_decoders

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, vocab_size=256, sliding_window=4)
    src = random_decoders.export_model(transformers.AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "sw.onnx")
    r = export(src, PRESET, tmp_path / "auto.onnx", boundary=1, offsets=False)
    assert any("layers 0-3: its mask is not attention_mask's padding with causal" in n for n in r.notes)
    assert {p.key: p.value for p in onnx.load(str(r.output), load_external_data=False).metadata_props}.get(
        "turboquant.cache") is None
    with pytest.raises(RewriteError, match="sliding window"):
        export(src, PRESET, tmp_path / "ip.onnx", boundary=1, offsets=False, cache="in-place")


def test_mask_values_read_by_the_probe():
    from turboquant.export.mask_probe import _allowed, expected_mask

    want = expected_mask()
    additive = np.where(want, 0.0, -3.4e38).astype(np.float32)
    assert np.array_equal(_allowed(additive), want) and np.array_equal(_allowed(want.astype(np.float32)), want)
    assert _allowed(additive - 0.5) is None  # a bias on top of the mask


@pytest.mark.gpu
def test_in_place_on_cuda(rewritten, cuda_ready):
    """The fp16 in-place rewrite on the CUDA provider (TQGroupQueryAttention and ORT's
    GroupQueryAttention over device buffers, IO binding): the CPU's logits to fp16 tolerance, and a
    decode step's packed layers on a split kernel the planner names."""
    from turboquant.kernel_plan import last_split_kernel

    name = "llama-gqa-torchscript-fp16"
    model = rewritten(name, PRESET, "in-place").output
    ids = np.random.default_rng(4).integers(0, MODELS[name][0].vocab, (2, 40))
    cuda = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]
    gpu = SharedBufferDecoder(model, max_length=64, providers=cuda)
    assert gpu.on_cuda
    a = gpu.teacher_forced(ids, 24).astype(np.float32)
    b = SharedBufferDecoder(model, max_length=64).teacher_forced(ids, 24).astype(np.float32)
    np.testing.assert_allclose(a[:, 0], b[:, 0], atol=3e-2 * float(np.abs(b).max()))
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 0.9
    assert last_split_kernel() != "none"
    print(f"{name}: the last decode step's split kernel: {last_split_kernel()}")


def test_value_scales_are_exact_and_tracked(exported, rewritten, tmp_path):
    """--value-scales: V divided per channel before each packed layer's op and its output multiplied
    back by the same factors (one KV head's for each of its query heads); the decode still tracks
    the original; the other forms refuse the option, naming it."""
    name = "llama-gqa-torchscript"
    cfg, _ = MODELS[name]
    # windows of 256: the decode below is 12 + STEPS tokens long, far from the default 1024's span
    result = export(exported(name), PRESET, tmp_path / "vs.onnx", calibrate="random", value_scales=True, progress=False,
                    calibration_window=256)
    m = onnx.load(result.output)
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node if n.op_type == "Constant"}
    muls = {n.name: consts[n.input[1]] for n in m.graph.node if n.op_type == "Mul" and n.input[1] in consts}
    for i in result.compressed:
        v, y = muls[f"tq_value_scaled_{i}"].reshape(cfg.kv_heads, -1), muls[f"tq_output_scaled_{i}"].reshape(cfg.heads, -1)
        np.testing.assert_allclose(np.repeat(1.0 / v, cfg.heads // cfg.kv_heads, axis=0), y, rtol=1e-6)
        assert v.std() > 0.01  # measured, not ones
    scaled = sorted(int(k.rsplit("_", 1)[1]) for k in muls if k.startswith("tq_value_scaled_"))
    assert scaled == sorted(result.compressed)  # the kept layers' values are not quantized: no scales
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["turboquant.value_scales"] == "yes"
    ids = np.random.default_rng(cfg.seed + 1).integers(0, cfg.vocab, (2, 12 + STEPS))
    a = DecoderSession(exported(name)).teacher_forced(ids, 12).astype(np.float32)
    c = SharedBufferDecoder(result.output, max_length=64).teacher_forced(ids, 12).astype(np.float32)
    assert float((a[:, 1:].argmax(-1) == c[:, 1:].argmax(-1)).mean()) >= 0.9
    for kw, says in ((dict(cache="concat"), "in-place cache form only"), (dict(offsets=False), "contradict")):
        with pytest.raises(RewriteError, match=says):
            export(exported(name), PRESET, tmp_path / "refused.onnx", value_scales=True, progress=False, **kw)


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-torchscript-fp16", "llama-gqa-dynamo"])
def test_attention_output_feeds_the_projection_as_it_is(rewritten, name):
    """The probe run finds each layer's output as [B, S, Hq * D] after the exporter's reshapes and
    transposes (export/mask_probe.py), so the op's output goes to the output projection directly (a
    Cast between them where the exporter attends in float32); with Q, K and V packed (TorchScript), no
    Transpose is left in the graph (the decode tests above run these models)."""
    r = rewritten(name, PRESET, "in-place")
    assert all(p.form.endswith("output as the projection reads it") for p in r.layers)
    m = onnx.load(str(r.output), load_external_data=False)
    assert "Transpose" not in {n.op_type for n in m.graph.node} or "dynamo" in name
    producers = {o: n for n in m.graph.node for o in n.output}
    for n in m.graph.node:
        if n.op_type in ("TQGroupQueryAttention", "GroupQueryAttention"):
            users = [u for u in m.graph.node if n.output[0] in u.input]
            assert len(users) == 1 and users[0].op_type in ("MatMul", "Cast"), [u.op_type for u in users]
            assert producers.get(users[0].output[0]) is users[0]


@pytest.mark.parametrize(("window", "config"), [(16, False), (300, True)], ids=["seen-by-the-probe", "config-json"])
def test_sliding_window_keeps_the_exporters_mask(tmp_path, window, config):
    """Lengths cannot replace a sliding window's mask: a window the probe's past covers is seen in
    the mask, a longer one in config.json beside the model; either way the default rewrite keeps the
    concat form (the exporter's mask, window included) and tracks the original past the window, and
    --cache in-place is refused."""
    from turboquant import random_decoders

    cfg = random_decoders.TinyConfig(family="mistral", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32,
                                     window=window, seed=8)
    model = random_decoders.build_model(cfg)
    (tmp_path / "m").mkdir()
    src = random_decoders.export_model(model, tmp_path / "m" / "model.onnx", "torchscript")
    if config:
        model.config.save_pretrained(tmp_path / "m")
    result = export(src, PRESET, tmp_path / "tq" / "model.onnx", boundary=1, progress=False, calibrate="random")
    summary = result.summary()
    assert "cache form concat" in summary and "sliding window" in summary, summary
    with pytest.raises(RewriteError, match="sliding window"):
        export(src, PRESET, tmp_path / "tq2" / "model.onnx", boundary=1, progress=False, calibrate="random", cache="in-place")
    ids = np.random.default_rng(9).integers(0, cfg.vocab, (2, window + 40))
    a = DecoderSession(src).teacher_forced(ids, 8).astype(np.float32)
    b = DecoderSession(result.output).teacher_forced(ids, 8).astype(np.float32)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-4 * max(1.0, float(np.abs(a[:, 0]).max())))
    beyond = slice(window - 8, None)  # the steps whose keys reach past the window
    top1 = float((a[:, beyond].argmax(-1) == b[:, beyond].argmax(-1)).mean())
    assert top1 >= 0.85, top1
