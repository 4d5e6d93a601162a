"""Triton model repositories: configs that parse as Triton's ModelConfig and match the model's I/O."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.export import export
from turboquant.serving.triton import main, write_repository

text_format = pytest.importorskip("google.protobuf.text_format")
model_config = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] (the test extra) parses the configs")


@pytest.fixture(scope="module")
def rewritten(module_tmp):
    pytest.importorskip("torch")
    from turboquant import random_decoders

    d = module_tmp.mktemp("triton")
    cfg = random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64)
    return export(random_decoders.export(cfg, d / "tiny.onnx"), "turboquant_4bit_nc", d / "tiny.tq.onnx", cache="concat").output


def parse(folder):
    return text_format.Parse((folder / "config.pbtxt").read_text(), model_config.ModelConfig())


def test_stateless_onnxruntime_repository(rewritten, tmp_path):
    folder = write_repository(rewritten, tmp_path / "repo", gpus=[0, 1], instances=2)
    cfg = parse(folder)
    assert (folder / "1" / "model.onnx").is_file() and cfg.backend == "onnxruntime" and cfg.max_batch_size == 0
    assert cfg.model_operations.op_library_filename[0].endswith("libturboquant_ort.so")
    inputs = {i.name: i for i in cfg.input}
    key = inputs["past_key_values.2.key"]
    assert model_config.DataType.Name(key.data_type) == "TYPE_UINT8" and list(key.dims) == [-1, 2, -1, 34]  # 4bit_nc, d64
    assert model_config.DataType.Name(inputs["past_key_values.0.key"].data_type) == "TYPE_FP32"  # boundary layer
    assert {o.name for o in cfg.output} >= {"logits", "present.2.key"}
    assert list(cfg.instance_group[0].gpus) == [0, 1] and cfg.instance_group[0].count == 2


def test_stateful_repository_keeps_the_cache_on_the_server(rewritten, tmp_path):
    cfg = parse(write_repository(rewritten, tmp_path / "repo", stateful=True))
    assert cfg.max_batch_size == 1 and not any(i.name.startswith("past_key_values") for i in cfg.input)
    states = {s.input_name: s for s in cfg.sequence_batching.state}
    assert len(states) == 12 and states["past_key_values.3.value"].output_name == "present.3.value"
    assert list(states["past_key_values.3.key"].initial_state[0].dims) == [2, 0, 34]
    assert list(cfg.input[0].dims) == [-1]  # input_ids without the batch axis


def test_tensorrt_repository_and_errors(rewritten, tmp_path, capsys):
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    cfg = parse(write_repository(rewritten, tmp_path / "repo", backend="tensorrt", engine=plan, gpus=[0]))
    assert cfg.platform == "tensorrt_plan" and (tmp_path / "repo" / "tiny" / "1" / "model.plan").is_file()
    assert main([str(rewritten), "--out", str(tmp_path / "r2"), "--backend", "tensorrt"]) == 2
    assert "give --engine PLAN" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.onnx"), "--out", str(tmp_path / "r3")]) == 2


@pytest.mark.parametrize("args, message", [
    (["--name", "../../escaped"], "--name '../../escaped' is not a model name Triton takes"),
    (["--name", 'a"b'], "--name 'a\"b' is not a model name Triton takes"),
    (["--name", ".hidden"], "not starting with '.'"),
    (["--name", "a/b"], "is not a model name"),
    (["--instances", "-3"], "argument --instances: must be a positive count, not -3"),
    (["--instances", "0"], "argument --instances: must be a positive count, not 0"),
    (["--gpus=-1"], "argument --gpus: must be zero or more, not -1"),
    (["--gpus", "0,x"], "argument --gpus: expected a non-negative integer, got 'x'"),
    (["--library", 'lib"x.so'], "config.pbtxt cannot quote a path"),
])
def test_cli_refuses_bad_arguments(rewritten, tmp_path, capsys, args, message):
    """Nothing is written, outside --out or in it, and the message names the argument."""
    out = tmp_path / "deep" / "repo"
    argv = [str(rewritten), "--out", str(out), *args]
    if message.startswith("argument"):  # argparse's own refusal
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    else:
        assert main(argv) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert list(tmp_path.rglob("*")) == []


def test_default_name_must_be_a_model_name_too(rewritten, tmp_path, capsys):
    odd = tmp_path / ".tiny.onnx"  # the name up to its first dot is empty: the repository folder itself
    odd.write_bytes(rewritten.read_bytes())
    assert main([str(odd), "--out", str(tmp_path / "repo")]) == 2
    assert "--name '' is not a model name" in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_not_an_onnx_model(tmp_path, capsys):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not protobuf \x00\x01\x02")
    assert main([str(bad), "--out", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err
    assert "model.onnx: not an ONNX model" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "repo").exists()



def test_in_place_rewrite_is_refused(rewritten, tmp_path, capsys):
    """A model whose caches are buffers written in place: Triton's backend binds inputs and outputs apart."""
    in_place = export(rewritten.with_name("tiny.onnx"), "turboquant_4bit_nc", tmp_path / "ip.onnx", cache="in-place",
                      offsets=False).output
    assert main([str(in_place), "--out", str(tmp_path / "repo")]) == 2
    assert "--cache concat" in capsys.readouterr().err and not (tmp_path / "repo").exists()


def test_a_model_already_in_the_repository_is_kept(rewritten, tmp_path, capsys):
    folder = write_repository(rewritten, tmp_path / "repo")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert main([str(rewritten), "--out", str(tmp_path / "repo"), "--gpus", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{folder} exists; turboquant does not overwrite files" in err[0], err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["tiny"]  # no staging folder left


@pytest.mark.parametrize("case", ["out is a file", "empty out", "engine on onnxruntime", "library on tensorrt",
                                  "not a decoder", "cache of rank 1", "unwritable out", "library not built"])
def test_refusals_leave_nothing(rewritten, tmp_path, capsys, monkeypatch, case):
    import onnx
    from onnx import TensorProto, helper

    plan = tmp_path / "in" / "model.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"engine")
    model, out, extra, message = rewritten, tmp_path / "repo", [], None
    if case == "out is a file":
        out.write_text("x")
        message = f"--out {out} is a file"
    elif case == "empty out":
        out, message = "", "--out is an empty name"
    elif case == "engine on onnxruntime":
        extra, message = ["--engine", str(plan)], "--engine is served by --backend tensorrt"
    elif case == "library on tensorrt":
        extra, message = ["--backend", "tensorrt", "--engine", str(plan), "--library", "/x.so"], "--library is the ONNX Runtime backend's"
    elif case in ("not a decoder", "cache of rank 1"):
        name = "x" if case == "not a decoder" else "past_key_values.0.key"
        graph = helper.make_graph([helper.make_node("Identity", [name], ["y"])], "g",
                                  [helper.make_tensor_value_info(name, TensorProto.FLOAT, [4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
        model = tmp_path / "in" / "m.onnx"
        onnx.save(helper.make_model(graph), str(model))
        extra = ["--stateful"]
        message = "not a decoder" if case == "not a decoder" else "cache input past_key_values.0.key has 1 dims"
    elif case == "unwritable out":
        out, message = "/proc/tq-repo", "--out /proc/tq-repo: cannot write in /proc"
    else:
        monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "missing.so"))
        message = "give --library PATH"
    assert main([str(model), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["in", "repo"] if case == "out is a file" else ["in"]), left


def test_a_failed_copy_leaves_no_folder_behind(rewritten, tmp_path, capsys, monkeypatch):
    import errno

    from turboquant.serving import triton

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(triton.shutil, "copy2", full_disk)
    assert main([str(rewritten), "--out", str(tmp_path / "a" / "b" / "repo")]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # a/b/repo made for it, and removed again


def test_tensor_names_are_quoted_not_injected(rewritten, tmp_path):
    """A tensor name holding a quote, a newline and a brace (legal in ONNX and ONNX Runtime) stays one
    name in config.pbtxt: it parses back as itself, and adds no input or setting."""
    import onnx

    m = onnx.load(rewritten)
    evil = 'attention_mask"\n}\ninput {\n  name: "injected'
    for node in m.graph.node:
        node.input[:] = [evil if n == "attention_mask" else n for n in node.input]
    next(i for i in m.graph.input if i.name == "attention_mask").name = evil
    path = tmp_path / "evil.onnx"
    onnx.save(m, path)
    folder = write_repository(path, tmp_path / "repo")
    config = parse(folder)
    names = [i.name for i in config.input]
    assert evil in names and "injected" not in names and len(names) == len([i for i in m.graph.input if i.name not in
                                                                            {t.name for t in m.graph.initializer}])


@settings(max_examples=200, deadline=None)
@given(name=st.text())
def test_quoted_round_trips_any_text(name):
    from turboquant.serving.triton import quoted

    config = text_format.Parse(f"name: {quoted(name)}\n", model_config.ModelConfig())
    assert config.name == name
