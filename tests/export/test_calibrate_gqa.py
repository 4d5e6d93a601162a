"""Calibration of onnxruntime-genai models: key offsets (mean rotated keys) and per-channel key scales
after the rotary (the op's key_scale input) for TQGroupQueryAttention, on a small model built by
genai's own builder with large fixed key components (qkv biases)."""

import json

import numpy as np
import onnx
import pytest

from turboquant import random_decoders
from turboquant.eval.runner import Evaluator, Windows
from turboquant.export import RewriteError, export
from turboquant.export import __main__ as cli
from turboquant.shared_buffer import SharedBufferDecoder

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")

CFG = random_decoders.TinyConfig(family="qwen2", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=11, vocab=640,
                          key_bias=2.0)
HQ, HKV, D = CFG.heads, CFG.kv_heads, CFG.head_dim
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def src(module_tmp):
    return random_decoders.export_genai(CFG, module_tmp.mktemp("genai-calib"))


@pytest.fixture(scope="module")
def rewritten(src, module_tmp):
    cache = {}

    def get(preset, **kw):
        key = (preset, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            cache[key] = export(src, preset, module_tmp.mktemp("tq") / "model.onnx", progress=False, **kw)
        return cache[key]

    return get


def _parts(path):
    m = onnx.load(str(path))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node if n.op_type == "Constant"}
    muls = {n.name: consts[n.input[1]] for n in m.graph.node if n.op_type == "Mul" and n.name.startswith("tq_")}
    tq = {n.name: n for n in m.graph.node if n.op_type == "TQGroupQueryAttention"}
    return inits, muls, tq, {p.key: p.value for p in m.metadata_props}


def _scaled_weights(src, path):
    """The original's initializers the rewrite changed (where the key scales were folded)."""
    inits, orig = _parts(path)[0], _parts(src)[0]
    return [n for n in orig if n in inits and not np.array_equal(inits[n], orig[n])]


def _logits(path, ids, prefill=16):
    return SharedBufferDecoder(path, MAX_LENGTH).teacher_forced(ids, prefill)


def test_offsets_and_scales_are_fed_to_the_compressed_layers(src, rewritten):
    r = rewritten("turboquant_4bit_nc")
    assert r.compressed == [2, 3]
    inits, muls, tq, meta = _parts(r.output)
    assert not muls and not _scaled_weights(src, r.output)  # the op scales after its rotary: no node, no weight changed
    for node in tq.values():
        layer = int(node.input[3].split(".")[1])
        if layer not in r.compressed:
            assert len(node.input) <= 12 or not any(node.input[12:]), node.name  # boundary layers: no offsets
            continue
        assert list(node.input[12:]) == [f"tq_key_offset_{layer}", "", f"tq_key_scale_{layer}"]
        koff, s = inits[node.input[12]], inits[node.input[14]]
        assert koff.shape == s.shape == (HKV, D) and koff.dtype == s.dtype == np.float32 and np.abs(koff).max() > 0.1
        assert np.all(s > 0) and s.std() > 0.05
        np.testing.assert_allclose(np.exp(np.log(s).mean(1)), 1.0, rtol=1e-5)  # normalised per head
        assert np.abs(s[:, :D // 2] - s[:, D // 2:]).max() > 0.05  # rotary pairs have scales of their own
    assert meta["turboquant.offsets"] == "keys" and meta["turboquant.key_scales"] == "yes"
    assert meta["turboquant.calibration"].startswith("data-free (self-generated: 16 continuations")


def _as_raw16(path, out):
    """The rewritten model with every TQGroupQueryAttention on raw16 caches (fp16 bits, no
    quantization), offsets and scales kept: what they do to the scores alone."""
    m = onnx.load(str(path))
    for n in m.graph.node:
        if n.op_type == "TQGroupQueryAttention":
            for a in n.attribute:
                if a.name in ("key_format", "value_format"):
                    a.s = b"raw16"
    for v in [*m.graph.input, *m.graph.output]:
        if v.name.startswith(("past_key_values.", "present.")):
            v.type.tensor_type.shape.dim[3].dim_value = 2 * D
    onnx.save(m, str(out))
    return out


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_calibrated_scores_are_unchanged(src, rewritten, tmp_path, preset):
    """On raw16 caches (fp16 bits, no quantization) the calibrated model is as far from the original
    as the uncalibrated one, i.e. fp16 rounding apart (the Lloyd-Max keys' scales and fp8 keys')."""
    ids = np.random.default_rng(99).integers(0, CFG.vocab, (2, 40))  # not the calibration's seed-0 ids
    ref = _logits(src, ids)

    def error(result, name):
        return np.abs(_logits(_as_raw16(result.output, tmp_path / f"{name}.onnx"), ids) - ref)

    floor = error(rewritten(preset, offsets=False), "plain")  # the fp16 rounding alone
    calibrated = error(rewritten(preset, **({"calibrate": "random"} if preset == "turboquant_k8v4" else {})), "calibrated")
    assert calibrated.max() <= 1.25 * floor.max() and calibrated.mean() <= 1.25 * floor.mean()


def test_calibration_lowers_the_error_on_held_out_ids(src, rewritten):
    """Through the eval's shared-buffer loop (as genai runs the models), on ids apart from the
    calibration's; the offsets alone in windows of 256 (means over a window's positions: the default
    1024 is far from these 48-token windows), offsets and scales with the defaults."""
    ids = np.random.default_rng(99).integers(0, CFG.vocab, 208)
    ev = Evaluator(src, ids, Windows(context=48, prefill=16, max_tokens=None, batch=6), progress=False, shared_buffer=True)
    kl = {name: ev.compare(rewritten("turboquant_4bit_nc", **kw).output, name).mean_kl
          for name, kw in (("none", dict(offsets=False)), ("offsets", dict(key_scales=False, calibration_window=256)),
                         ("both", {}))}
    print(f"4bit_nc mean KL on held-out ids over {ev.scored_tokens} decoded tokens: {kl}")
    assert ev.scored_tokens == 6 * 32  # windows start every 32 of the 208 ids, up to 160
    assert kl["offsets"] < 0.8 * kl["none"] and kl["both"] < 0.8 * kl["none"]


def test_options(src, rewritten, tmp_path):
    r = rewritten("turboquant_4bit_nc", offsets=False)
    inits, muls, _, meta = _parts(r.output)
    assert not [n for n in inits if n.startswith("tq_")] and not muls and meta["turboquant.calibration"] == "none"
    assert not _scaled_weights(src, r.output)

    r = rewritten("turboquant_4bit_nc", key_scales=False)
    inits, muls, _, meta = _parts(r.output)
    assert {"tq_key_offset_2", "tq_key_offset_3"} <= set(inits) and not muls and meta["turboquant.key_scales"] == "no"
    assert not _scaled_weights(src, r.output)

    inits, _, _, meta = _parts(rewritten("turboquant_3bit_nc", value_offsets=True).output)
    assert inits["tq_value_offset_2"].shape == (HKV, D) and meta["turboquant.offsets"] == "keys and values"

    _, _, tq, meta = _parts(rewritten("turboquant_k8v4", offsets=False).output)
    assert meta["turboquant.calibration"] == "none" and not any(len(n.input) > 12 for n in tq.values())

    np.save(tmp_path / "ids.npy", np.random.default_rng(3).integers(0, CFG.vocab, 600))
    r = rewritten("turboquant_k8v4", calibrate=tmp_path / "ids.npy")
    inits, muls, _, meta = _parts(r.output)
    assert "tq_key_offset_2" in inits and not muls and meta["turboquant.key_scales"] == "yes"
    s = inits["tq_key_scale_2"]  # fp8 keys' scales: each channel's largest rotated |k - offset| / 64
    assert s.shape == (HKV, D) and np.all(s > 0) and s.std() > 0.01
    assert not _scaled_weights(src, r.output)
    assert "ids.npy" in meta["turboquant.calibration"] and "512 tokens" in meta["turboquant.calibration"]  # whole windows of 256

    with pytest.raises(RewriteError, match="contradict"):
        export(src, "turboquant_4bit_nc", tmp_path / "x" / "model.onnx", calibrate=tmp_path / "ids.npy", offsets=False)


def test_cli_flags(src, tmp_path, capsys):
    out = tmp_path / "cli" / "model.onnx"
    assert cli.main([str(src), "--preset", "turboquant_k3v4_nc", "-o", str(out), "--no-key-scales", "--no-progress"]) == 0
    meta = {p.key: p.value for p in onnx.load(str(out), load_external_data=False).metadata_props}
    assert meta["turboquant.key_scales"] == "no" and meta["turboquant.offsets"] == "keys"
    assert json.loads(meta["turboquant.layers"])[2]["key_format"] == "mse3"
    capsys.readouterr()
    assert cli.main([str(src), "--preset", "turboquant_4bit_nc", "-o", str(tmp_path / "t" / "m.onnx"),
                     "--calibrate", str(tmp_path / "some.txt")]) == 2
    assert "calibration file" in capsys.readouterr().err


def test_eval_cli_runs_genai_models_through_shared_buffers(src, rewritten, tmp_path, capsys):
    from turboquant.eval.__main__ import main

    text = tmp_path / "held-out.ids"
    text.write_text(" ".join(map(str, np.random.default_rng(5).integers(0, CFG.vocab, 120))))
    calibrated, plain = rewritten("turboquant_4bit_nc").output, rewritten("turboquant_4bit_nc", offsets=False).output
    assert main([str(src), str(calibrated), str(plain), "--text", str(text), "--shared-buffer", "--context", "48",
                 "--prefill", "16", "--max-tokens", "32", "--json", "-", "--no-progress"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out[out.index("\n{") + 1:])  # the JSON after the table
    names = [r["model"] for r in doc["results"]]
    assert names == [f"{calibrated.parent.name}/model.onnx", f"{plain.parent.name}/model.onnx"]  # told apart
    assert doc["scored_tokens"] == 32 and all(r["mean_kl"] > 0 for r in doc["results"])


def test_self_generated_calibration(src, rewritten):
    """--calibrate self runs the genai original through its shared-buffer loop to write the text."""
    r = rewritten("turboquant_4bit_nc", calibrate="self")
    inits, _, _, meta = _parts(r.output)
    assert meta["turboquant.calibration"].startswith("data-free (self-generated: 16 continuations")
    assert {"tq_key_offset_2", "tq_key_scale_2"} <= set(inits) and not _scaled_weights(src, r.output)


def test_no_key_scales_where_the_op_has_no_constant_rotary_tables():
    import onnx_ir as ir

    from turboquant import node_models
    from turboquant.export.calibrate_gqa import COMPUTED_TABLES, rotary_tables

    def node(**kw):
        m = ir.from_proto(node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4",
                                                value_format="uint4", **kw))
        return next(iter(m.graph))

    assert "needs do_rotary" in rotary_tables(node(), 64)
    assert rotary_tables(node(rotary_dim=64), 64) == COMPUTED_TABLES  # graph inputs: read off each calibration run
    assert rotary_tables(node(rotary_dim=64, position_ids=True), 64) == "the op takes position_ids"
