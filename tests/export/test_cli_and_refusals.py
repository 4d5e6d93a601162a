"""The CLI, the Python entry point, and every refusal."""

import os
import stat
import subprocess
import sys

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper

from turboquant.export import RewriteError, export

from .cli_helpers import assert_refused, run_main, tree as _tree


def cli(*args):
    return subprocess.run([sys.executable, "-m", "turboquant.export", *map(str, args)], capture_output=True, text=True)


def assert_one_line_error(r, message):
    """Exit status 2 and one line with the message (after argparse's usage, for argument errors)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and message in lines[-1], r.stderr
    assert len(lines) == 1 or lines[0].startswith("usage:") and "Traceback" not in r.stderr, r.stderr


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
    """The flags reach the plan (the default calibration's run of the CLI: test_cli_default_output_and_summary)."""
    src = exported("gpt2-mha-torchscript")
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "a.onnx", "--skip-layers", "3", "--no-offsets")
    assert r.returncode == 0 and "compressed: 2\n" in r.stdout
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "b.onnx", "--keep-layers", "0", "--no-offsets")
    assert r.returncode == 0 and "compressed: 1-5" in r.stdout
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "c.onnx", "--boundary", "0", "--no-offsets")
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
    from turboquant.decode_loop import open_decoder

    logits = open_decoder(out, 8).teacher_forced(np.array([[1, 2, 3, 4, 5]]), 3)
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


def _gqa():
    """A hand-made GroupQueryAttention with separate K and V (the head size from K's shape)."""
    vi = helper.make_tensor_value_info
    ins, outs = _cache_io()
    ins = [vi("q", TensorProto.FLOAT, ["B", 1, 256]), vi("k", TensorProto.FLOAT, ["B", 1, 128]), vi("v", TensorProto.FLOAT, ["B", 1, 128]),
           *ins, vi("seqlens_k", TensorProto.INT32, ["B"]), vi("total_sequence_length", TensorProto.INT32, [])]
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k",
                                                    "total_sequence_length"], ["y", "present.0.key", "present.0.value"],
                            domain="com.microsoft", num_heads=4, kv_num_heads=2, name="gqa0")
    return _model([node], ins, [vi("y", TensorProto.FLOAT, ["B", 1, 256]), *outs])


def test_group_query_attention_with_separate_kv_is_rewritten(tmp_path):
    """No genai folder: rewritten to TQGroupQueryAttention over uint8 caches, and no genai_config.json written."""
    result = export(_save(_gqa(), tmp_path / "gqa.onnx"), "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=0)
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


# -- the input's files, atomic saves, argument errors --------------------------------------------------

def _external(exported, folder):
    """A copy of a small model with its weights in external data beside it."""
    src = folder / "e.onnx"
    onnx.save(onnx.load(str(exported("gpt2-mha-torchscript"))), str(src), save_as_external_data=True,
              all_tensors_to_one_file=True, location="e.onnx.data", size_threshold=0)
    return src


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_never_overwrites_the_input_files(exported, tmp_path):
    """Compared as files: the input's external data, a hard link to the model or to its data."""
    import os

    src = _external(exported, tmp_path)
    os.link(src, tmp_path / "hard.onnx")
    before = _files(tmp_path)
    for out, what in [("e.onnx.data", "external data file e.onnx.data"), ("hard.onnx", "model")]:
        with pytest.raises(RewriteError, match=f"is the input's {what}; turboquant never overwrites its input"):
            export(src, "turboquant_k8v4", tmp_path / out)
    r = cli(src, "--preset", "turboquant_k8v4", "-o", tmp_path / "e.onnx.data")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "never overwrites" in r.stderr
    assert _files(tmp_path) == before
    os.link(tmp_path / "e.onnx.data", tmp_path / "linked.onnx.data")  # what -o linked.onnx would write
    with pytest.raises(RewriteError, match="linked.onnx.data is the input's external data file e.onnx.data"):
        export(src, "turboquant_k8v4", tmp_path / "linked.onnx")
    assert _files(tmp_path) == {**before, "linked.onnx.data": before["e.onnx.data"]}
    (tmp_path / "hard.onnx").unlink()
    (tmp_path / "linked.onnx.data").unlink()  # onnx refuses data files with several links
    onnx.checker.check_model(str(src))  # still loads, with its data


def test_save_leaves_nothing_behind_when_the_output_is_a_folder(exported, tmp_path):
    src = _external(exported, tmp_path)
    (tmp_path / "out.onnx").mkdir()
    with pytest.raises(RewriteError, match="out.onnx is a folder"):
        export(src, "turboquant_k8v4", tmp_path / "out.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.onnx", "e.onnx.data", "out.onnx"]


def test_save_publishes_the_pair_or_nothing(exported, tmp_path, monkeypatch):
    """A graph that cannot be linked to its name: the data file already published is removed again,
    and neither the staging folder nor the output folder the save made is left."""
    import os

    (tmp_path / "src").mkdir()
    src = _external(exported, tmp_path / "src")
    out = tmp_path / "new" / "deeper" / "o.onnx"
    link = os.link

    def refuse_the_graph(a, b, *args, **kw):
        if os.fspath(b) == os.fspath(out):
            raise PermissionError(13, "Permission denied")
        link(a, b, *args, **kw)

    monkeypatch.setattr(os, "link", refuse_the_graph)
    with pytest.raises(RewriteError, match="cannot write .*o.onnx: Permission denied"):
        export(src, "turboquant_4bit_nc", out, offsets=False)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    export(src, "turboquant_4bit_nc", out, offsets=False)  # and a save that can link writes both
    assert sorted(p.name for p in out.parent.iterdir()) == ["o.onnx", "o.onnx.data"]


def test_an_output_that_appears_during_the_save_is_kept(exported, tmp_path, monkeypatch):
    """A file given the output's name while the model was being written stays as it was, and the
    rewrite's own data file goes again."""
    import onnx_ir as ir

    src = _external(exported, tmp_path)
    out = tmp_path / "o.onnx"
    save = ir.save

    def theirs_appears(model, path, **kw):
        save(model, path, **kw)
        out.write_bytes(b"theirs")

    monkeypatch.setattr(ir, "save", theirs_appears)
    before = _files(tmp_path)
    with pytest.raises(RewriteError, match="o.onnx appeared while it was being written; left as it was"):
        export(src, "turboquant_4bit_nc", out, offsets=False)
    assert _files(tmp_path) == {**before, "o.onnx": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.onnx", "e.onnx.data", "o.onnx"]


def test_output_checked_before_calibration(exported, tmp_path, monkeypatch):
    from turboquant.export import calibrate

    def calibration_ran(*a, **k):
        raise AssertionError("calibration ran before the output was checked")

    monkeypatch.setattr(calibrate, "collect", calibration_ran)
    (tmp_path / "file").write_text("")
    with pytest.raises(RewriteError, match="is a file, not a folder"):
        export(exported("gpt2-mha-torchscript"), "turboquant_4bit_nc", tmp_path / "file" / "x.onnx")


def test_cli_argument_errors(exported, tmp_path):
    """One line naming the argument, exit status 2, no traceback, nothing written."""
    src = exported("gpt2-mha-torchscript")
    (tmp_path / "file").write_text("")
    (tmp_path / "folder.onnx").mkdir()
    np.save(tmp_path / "big.npy", np.array([1, 2, 3, 50_000]))
    np.save(tmp_path / "neg.npy", np.array([1, 2, -1, 4]))
    cases = [
        (["--boundary", "-1"], "argument --boundary: must be zero or more, not -1"),
        (["-o", tmp_path / "file" / "x.onnx"], "is a file, not a folder"),
        (["-o", tmp_path / "folder.onnx"], "folder.onnx is a folder"),
        (["-o", tmp_path / ("n" * 300 + ".onnx")], "is longer than the 255 bytes"),
        (["-o", tmp_path / "a.onnx", "--calibrate", tmp_path / "big.npy"], "token id 50000 is outside the model's vocabulary (0 to "),
        (["-o", tmp_path / "a.onnx", "--calibrate", tmp_path / "neg.npy"], "token id -1 is outside the model's vocabulary"),
    ]
    for args, message in cases:
        r = cli(src, "--preset", "turboquant_4bit_nc", *args)
        assert_one_line_error(r, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.npy", "file", "folder.onnx", "neg.npy"]
    (tmp_path / "src").mkdir()
    r = cli(_external(exported, tmp_path / "src"), "--preset", "turboquant_k8v4", "-o", tmp_path / ("n" * 250 + ".onnx"))
    assert_one_line_error(r, "the output's external data file")  # its name, 5 bytes longer, is the one too long
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.npy", "file", "folder.onnx", "neg.npy", "src"]


def test_negative_boundary_refused_for_every_form(exported, tmp_path):
    for src in (exported("gpt2-mha-torchscript"), _save(_gqa(), tmp_path / "gqa.onnx")):
        with pytest.raises(RewriteError, match="--boundary must be a layer count of zero or more, got -1"):
            export(src, "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=-1)


# -- bad input from the command line: one line, exit status 2, nothing written or changed --------------

def test_existing_outputs_are_refused(exported, tmp_path, capsys):
    """-o naming a file that exists, the default MODEL.<preset>.onnx that exists, an existing
    OUT.onnx.data beside a new OUT.onnx, and /dev/null: refused before any work, all left as they were."""
    src = _external(exported, tmp_path)
    (tmp_path / "exists.onnx").write_bytes(b"mine")
    (tmp_path / "e.turboquant_4bit_nc.onnx").write_bytes(b"my default")
    (tmp_path / "fresh.onnx.data").write_bytes(b"my data")
    before = _tree(tmp_path)
    cases = [(["-o", tmp_path / "exists.onnx"], "exists.onnx exists; turboquant does not overwrite files"),
             ([], "e.turboquant_4bit_nc.onnx exists; turboquant does not overwrite files"),
             (["-o", tmp_path / "fresh.onnx"], "fresh.onnx.data exists; turboquant does not overwrite files")]
    for args, message in cases:
        assert_refused(*run_main(capsys, src, "--preset", "turboquant_4bit_nc", *args), message)
    assert _tree(tmp_path) == before
    null = os.stat("/dev/null")
    assert_refused(*run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", "/dev/null"), "/dev/null exists")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == null.st_rdev and after.st_ino == null.st_ino


def test_empty_output_name_refused(exported, tmp_path, capsys):
    src = tmp_path / "m.onnx"
    src.write_bytes(exported("gpt2-mha-torchscript").read_bytes())
    r = cli(src, "--preset", "turboquant_4bit_nc", "-o", "", "--no-offsets")
    assert_one_line_error(r, "the output (-o) is an empty name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]  # not the default name either
    with pytest.raises(RewriteError, match="empty name"):
        export(src, "turboquant_4bit_nc", "", offsets=False)


def test_too_large_boundary_names_the_layer_count(exported, tmp_path, capsys):
    """A boundary that keeps every layer (which was capped in silence) is refused with the model's
    layer count, before the calibration runs; --keep-layers auto's 2 x boundary too."""
    src = exported("gpt2-mha-torchscript")
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "o.onnx", "--boundary", "9" * 20)
    assert_refused(rc, err, f"argument --boundary: {'9' * 20} is too large (at most 2147483647)")  # a count's bound
    for boundary in ("2147483647", "3"):
        rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "o.onnx", "--boundary", boundary)
        assert_refused(rc, err, f"--boundary {boundary} keeps the first and last {boundary} of the model's 6 cache "
                                "layers, which leaves none to compress (--boundary 2 at most)")
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "o.onnx", "--boundary", "3",
                       "--keep-layers", "auto")
    assert_refused(rc, err, "--keep-layers auto keeps 2 x --boundary = 6 layers; the model has 6 cache layers, which "
                            "leaves none to compress")
    assert list(tmp_path.iterdir()) == []
    assert export(src, "turboquant_4bit_nc", tmp_path / "o.onnx", boundary=3, keep_layers=[0], offsets=False).compressed == [1, 2, 3, 4, 5]


def test_input_folder_is_named_a_folder(tmp_path, capsys):
    (tmp_path / "adir.onnx").mkdir()
    rc, err = run_main(capsys, tmp_path / "adir.onnx", "--preset", "turboquant_4bit_nc")
    assert_refused(rc, err, "adir.onnx is a folder, not an ONNX model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir.onnx"]


@pytest.mark.parametrize("offsets", [[], ["--no-offsets"]], ids=["calibrated", "no-offsets"])
def test_missing_external_data_named_before_any_work(exported, tmp_path, capsys, offsets):
    """The input's data file gone: named, with calibration (which ORT failed on) and without (which
    blamed the output), and the output's folder is not made."""
    (tmp_path / "src").mkdir()
    src = _external(exported, tmp_path / "src")
    (tmp_path / "src" / "e.onnx.data").unlink()
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "nd" / "out.onnx", *offsets)
    assert_refused(rc, err, f"its external data file {tmp_path / 'src' / 'e.onnx.data'} does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_missing_library_refused_before_any_work(exported, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "nope.so"))
    rc, err = run_main(capsys, exported("gpt2-mha-torchscript"), "--preset", "turboquant_4bit_nc", "-o", tmp_path / "o" / "m.onnx")
    assert_refused(rc, err, f"TURBOQUANT_ORT_LIBRARY points at {tmp_path / 'nope.so'}, which is not a file")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_removes_the_folders_it_made(exported, tmp_path, monkeypatch):
    from turboquant.export import rewrite

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rewrite, "publish", full)
    with pytest.raises(RewriteError, match="No space left on device"):
        export(exported("gpt2-mha-torchscript"), "turboquant_4bit_nc", tmp_path / "a" / "b" / "m.onnx", offsets=False)
    assert list(tmp_path.iterdir()) == []
