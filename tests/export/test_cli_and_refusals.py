"""The CLI, the Python entry point, and every refusal."""

import subprocess
import sys

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper

from turboquant.export import RewriteError, export


def cli(*args):
    return subprocess.run([sys.executable, "-m", "turboquant.export", *map(str, args)], capture_output=True, text=True)


def test_help():
    r = cli("--help")
    assert r.returncode == 0 and "--preset" in r.stdout and "--dry-run" in r.stdout and "--skip-layers" in r.stdout


def test_cli_default_output_and_summary(exported, tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(exported("gpt2-mha-torchscript").read_bytes())
    before = src.read_bytes()
    r = cli(src, "--preset", "turboquant_4bit_nc")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "m.turboquant_4bit_nc.onnx").is_file()
    assert src.read_bytes() == before  # the input is never touched
    assert "2 of 6 layers compressed" in r.stdout and "kept as they were: 0-1, 4-5" in r.stdout
    assert "bytes before" in r.stdout and "x smaller" in r.stdout


def test_cli_dry_run_writes_nothing(exported, tmp_path):
    src = exported("gpt2-mha-torchscript")
    out = tmp_path / "never.onnx"
    r = cli(src, "--preset", "turboquant_k8v4", "-o", out, "--dry-run")
    assert r.returncode == 0 and "dry run" in r.stdout and not out.exists()


def test_cli_layer_selection(exported, tmp_path):
    src = exported("gpt2-mha-torchscript")
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "a.onnx", "--skip-layers", "3")
    assert r.returncode == 0 and "compressed: 2\n" in r.stdout
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "b.onnx", "--keep-layers", "0")
    assert r.returncode == 0 and "compressed: 1-5" in r.stdout
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "c.onnx", "--boundary", "0")
    assert r.returncode == 0 and "6 of 6 layers compressed" in r.stdout


def test_cli_refuses_with_one_line(tmp_path):
    bad = tmp_path / "not_a_model.onnx"
    bad.write_bytes(b"this is not protobuf \x00\x01\x02")
    r = cli(bad, "--preset", "turboquant_4bit_nc")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "not an ONNX model" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli(tmp_path / "missing.onnx", "--preset", "turboquant_4bit_nc")
    assert r.returncode == 2 and "no such file" in r.stderr
    r = cli(bad, "--preset", "turboquant_1bit")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_never_overwrites_input(exported, tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(exported("gpt2-mha-torchscript").read_bytes())
    with pytest.raises(RewriteError, match="never overwrites its input"):
        export(src, "turboquant_4bit_nc", src)
    with pytest.raises(RewriteError, match="never overwrites its input"):
        export(src, "turboquant_4bit_nc", tmp_path / "." / "m.onnx")


def test_unknown_layers_refused(exported, tmp_path):
    with pytest.raises(RewriteError, match=r"name layers without a KV cache: \[17\]"):
        export(exported("gpt2-mha-torchscript"), "turboquant_4bit_nc", tmp_path / "x.onnx", skip_layers=[17])


def test_everything_kept_is_refused(exported, tmp_path):
    with pytest.raises(RewriteError, match="no layer left to compress"):
        export(exported("gpt2-mha-torchscript"), "turboquant_4bit_nc", tmp_path / "x.onnx", keep_layers=list(range(6)))


def test_external_data_roundtrip(exported, tmp_path):
    src = tmp_path / "ext.onnx"
    m = onnx.load(str(exported("llama-gqa-torchscript")))
    onnx.save(m, str(src), save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    out = tmp_path / "ext.tq.onnx"
    export(src, "turboquant_4bit_nc", out)
    assert (tmp_path / "ext.tq.onnx.data").is_file()
    from turboquant.decoder import DecoderSession

    logits = DecoderSession(out).teacher_forced(np.array([[1, 2, 3, 4, 5]]), 3)
    assert np.isfinite(logits).all()


# -- hand-made graphs for the refusals real exporters do not produce ---------------------------------

def _model(nodes, inputs, outputs, opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)], ir_version=10)


def _save(model, path):
    onnx.save(model, str(path))
    return path


def test_no_kv_cache(tmp_path):
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    with pytest.raises(RewriteError, match="found no KV cache"):
        export(_save(m, tmp_path / "mlp.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx")


def _cache_io(head_dim=64, dtype=TensorProto.FLOAT):
    vi = helper.make_tensor_value_info
    return ([vi("past_key_values.0.key", dtype, ["B", 2, "S", head_dim]), vi("past_key_values.0.value", dtype, ["B", 2, "S", head_dim])],
            [vi("present.0.key", dtype, ["B", 2, "T", head_dim]), vi("present.0.value", dtype, ["B", 2, "T", head_dim])])


def test_unsupported_head_dim(tmp_path):
    ins, outs = _cache_io(head_dim=12)
    m = _model([helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]),
                helper.make_node("Identity", ["past_key_values.0.value"], ["present.0.value"])], ins, outs)
    with pytest.raises(RewriteError, match="unsupported head_dim 12: supported are multiples of 8 from 16 to 256"):
        export(_save(m, tmp_path / "d12.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)


def test_unsupported_dtype(tmp_path):
    ins, outs = _cache_io(dtype=TensorProto.INT8)
    m = _model([helper.make_node("Identity", ["past_key_values.0.key"], ["present.0.key"]),
                helper.make_node("Identity", ["past_key_values.0.value"], ["present.0.value"])], ins, outs)
    with pytest.raises(RewriteError, match="compresses float32, float16 and bfloat16 caches"):
        export(_save(m, tmp_path / "i8.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)


def test_unrecognised_form_names_the_node(tmp_path):
    ins, outs = _cache_io()
    m = _model([helper.make_node("Relu", ["past_key_values.0.key"], ["present.0.key"], name="odd_relu"),
                helper.make_node("Identity", ["past_key_values.0.value"], ["present.0.value"])], ins, outs)
    with pytest.raises(RewriteError, match="read by node 'odd_relu' \\(Relu\\)"):
        export(_save(m, tmp_path / "relu.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)


def test_group_query_attention_with_separate_kv_is_rewritten(tmp_path):
    """A hand-made GroupQueryAttention with separate K and V (the head size from K's shape), no genai
    folder: rewritten to TQGroupQueryAttention over uint8 caches, and no genai_config.json written."""
    vi = helper.make_tensor_value_info
    ins, outs = _cache_io()
    ins = [vi("q", TensorProto.FLOAT, ["B", 1, 256]), vi("k", TensorProto.FLOAT, ["B", 1, 128]), vi("v", TensorProto.FLOAT, ["B", 1, 128]),
           *ins, vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, [])]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
                                                    "total_sequence_length"], ["y", "present.0.key", "present.0.value"],
                            domain="com.microsoft", num_heads=4, kv_num_heads=2, name="gqa0")
    m = _model([node], ins, [vi("y", TensorProto.FLOAT, ["B", 1, 256]), *outs])
    result = export(_save(m, tmp_path / "gqa.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)
    out = onnx.load(result.output)
    assert [n.op_type for n in out.graph.node] == ["TQGroupQueryAttention"]
    assert out.graph.input[3].type.tensor_type.elem_type == TensorProto.UINT8
    assert result.row_bytes == 36 and not (tmp_path / "genai_config.json").exists()


def _attention23(extra_attrs=None, extra_inputs=()):
    vi = helper.make_tensor_value_info
    ins, outs = _cache_io()
    ins = [vi("Q", TensorProto.FLOAT, ["B", 4, "N", 64]), vi("K", TensorProto.FLOAT, ["B", 2, "N", 64]),
           vi("V", TensorProto.FLOAT, ["B", 2, "N", 64]), *ins]
    node = helper.make_node("Attention", ["Q", "K", "V", "", "past_key_values.0.key", "past_key_values.0.value", *extra_inputs],
                            ["Y", "present.0.key", "present.0.value"], name="attn0", **(extra_attrs or {}))
    return _model([node], ins, [vi("Y", TensorProto.FLOAT, ["B", 4, "N", 64]), *outs], opset=23)


def test_attention23_one_for_one(tmp_path, ort_session):
    """Form (a): ONNX Attention with past inputs becomes one TQAttention with the same attributes."""
    src = _save(_attention23({"is_causal": 1, "scale": 0.2}), tmp_path / "a23.onnx")
    result = export(src, "turboquant_4bit_nc", tmp_path / "a23.tq.onnx", boundary=0)
    out = onnx.load(str(result.output))
    (node,) = out.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "TQAttention" and node.domain == "turboquant"
    assert attrs["is_causal"] == 1 and abs(attrs["scale"] - 0.2) < 1e-7 and attrs["key_format"] == b"mse4"
    rng = np.random.default_rng(0)
    feeds = {"Q": rng.standard_normal((1, 4, 3, 64), np.float32), "K": rng.standard_normal((1, 2, 3, 64), np.float32),
             "V": rng.standard_normal((1, 2, 3, 64), np.float32),
             "past_key_values.0.key": np.zeros((1, 2, 0, 34), np.uint8), "past_key_values.0.value": np.zeros((1, 2, 0, 36), np.uint8)}
    y, pk, pv = ort_session(out).run(None, feeds)
    want = onnx.reference.ReferenceEvaluator(onnx.load(str(src))).run(None, {**feeds, "past_key_values.0.key": np.zeros((1, 2, 0, 64), np.float32),
                                                                              "past_key_values.0.value": np.zeros((1, 2, 0, 64), np.float32)})
    np.testing.assert_allclose(y, want[0], rtol=1e-4, atol=1e-5)
    assert pk.shape == (1, 2, 3, 34) and pv.shape == (1, 2, 3, 36)


def test_attention23_softcap_refused(tmp_path):
    src = _save(_attention23({"softcap": 30.0}), tmp_path / "sc.onnx")
    with pytest.raises(RewriteError, match="node 'attn0' \\(Attention\\) uses softcap"):
        export(src, "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)
