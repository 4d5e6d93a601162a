"""python -m turboquant.hf_export: a saved Hugging Face model folder to ONNX with its KV cache."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import random_decoders  # noqa: E402
from turboquant.decode_loop import open_decoder  # noqa: E402
from turboquant.decoder import DecoderSession  # noqa: E402
from turboquant.hf_export.__main__ import main  # noqa: E402


def test_exports_a_saved_model_folder(tmp_path, capsys):
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=256)
    model = random_decoders.build_model(cfg)
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "onnx" / "model.onnx"
    assert main([str(tmp_path / "hf"), "-o", str(out)]) == 0
    assert "no tokenizer saved" in capsys.readouterr().err  # the folder has none; the model still exports
    # one data file, and the model's config.json as the folder had it (the rewrite reads it)
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.json", "model.onnx", "model.onnx.data"]
    assert (out.parent / "config.json").read_bytes() == (tmp_path / "hf" / "config.json").read_bytes()
    sess = DecoderSession(out)
    assert sorted(sess.cache_inputs) == [(0, "key"), (0, "value"), (1, "key"), (1, "value")]
    ids = np.array([[1, 2, 3, 4]])
    import torch

    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    got, _ = sess.step(ids, sess.empty_cache(1), 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    from turboquant.export import export  # the rewrite reads the graph and its data file

    result = export(out, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=0, progress=False)
    assert result.compressed == [0, 1]
    packed = open_decoder(result.output, ids.shape[1])
    got, _ = packed.step(ids, packed.empty_cache(1), 0)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.5


def test_refusals(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "-o", str(tmp_path / "m.onnx")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    assert main([str(tmp_path / "hf"), "--gguf", "x.gguf", "-o", str(tmp_path / "m.onnx")]) == 2
    assert "x.gguf: no such file" in capsys.readouterr().err
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "m.txt")]) == 2
    assert "should end in .onnx" in capsys.readouterr().err


def test_bad_input_refused_before_transformers_loads(tmp_path, capsys):
    """One line naming what was wrong and exit status 2: no traceback from transformers or mkdir."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    (tmp_path / "file").write_text("")
    for argv, message in [
        ([tmp_path / "empty", "-o", tmp_path / "m.onnx"], "empty has no config.json: not a Hugging Face model folder"),
        ([tmp_path / "hf", "--gguf", "model.gguf", "-o", tmp_path / "m.onnx"], "model.gguf: not a GGUF file"),
        ([tmp_path / "hf", "-o", tmp_path / "file" / "m.onnx"], "file is a file, not a folder"),
        ([tmp_path / "hf", "-o", tmp_path / "m.onnx"], "not a model transformers can load"),  # config.json without a model
    ]:
        assert main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "m.onnx").exists()


def test_fp16_and_an_existing_output_refused(tmp_path, capsys):
    import onnx

    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    random_decoders.build_model(cfg).save_pretrained(tmp_path / "hf")
    out = tmp_path / "model.onnx"
    assert main([str(tmp_path / "hf"), "-o", str(out), "--dtype", "fp16", "--exporter", "torchscript"]) == 0
    m = onnx.load(out, load_external_data=False)
    assert {i.type.tensor_type.elem_type for i in m.graph.input if i.name.startswith("past_key_values.")} == {onnx.TensorProto.FLOAT16}
    before = (out.read_bytes(), (tmp_path / "model.onnx.data").read_bytes())
    capsys.readouterr()
    assert main([str(tmp_path / "hf"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.onnx exists" in err[0], err
    out.unlink()  # the data file alone also blocks the output
    assert main([str(tmp_path / "hf"), "-o", str(out)]) == 2
    assert "model.onnx.data exists" in capsys.readouterr().err
    assert (tmp_path / "model.onnx.data").read_bytes() == before[1]


def test_tokenizer_files_never_overwritten_and_exports_side_by_side(tmp_path, capsys):
    """A second export into the folder keeps the tokenizer it saved there (the same bytes); a folder
    with another tokenizer is refused before the export, its files as they were, nothing left."""
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    random_decoders.build_model(cfg).save_pretrained(tmp_path / "hf")
    random_decoders.save_tokenizer(tmp_path / "hf", cfg.vocab)
    out = tmp_path / "onnx"
    assert main([str(tmp_path / "hf"), "-o", str(out / "fp32.onnx"), "--exporter", "torchscript"]) == 0
    assert "the tokenizer's" in capsys.readouterr().out and (out / "tokenizer.json").is_file()
    saved = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([str(tmp_path / "hf"), "-o", str(out / "fp16.onnx"), "--dtype", "fp16", "--exporter", "torchscript"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in saved} == saved
    assert (out / "fp16.onnx").is_file()

    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text("the user's")
    assert main([str(tmp_path / "hf"), "-o", str(other / "model.onnx"), "--exporter", "torchscript"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "tokenizer.json exists with other contents" in err[-1] and "Traceback" not in "".join(err), err
    assert [p.name for p in other.iterdir()] == ["tokenizer.json"] and (other / "tokenizer.json").read_text() == "the user's"
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "new" / "deeper" / "model.onnx"), "--gguf", ""]) == 2
    assert "--gguf is an empty name" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_unreadable_weights_one_line(tmp_path, capsys):
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    random_decoders.build_model(cfg).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:20])
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "not a model transformers can load" in err[-1] and "Traceback" not in "".join(err), err
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / ".onnx")]) == 2
    assert "needs a name before .onnx" in capsys.readouterr().err


def test_files_that_appear_during_the_export_are_kept(tmp_path, capsys, monkeypatch):
    from turboquant.hf_export import streamed

    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    random_decoders.build_model(cfg).save_pretrained(tmp_path / "hf")
    out = tmp_path / "new" / "model.onnx"
    export_graph = streamed._export_graph

    def another_writer(*args):  # takes the data file's name while the graph is exported
        (tmp_path / "new" / "model.onnx.data").write_text("the user's")
        return export_graph(*args)

    monkeypatch.setattr(streamed, "_export_graph", another_writer)
    assert main([str(tmp_path / "hf"), "-o", str(out), "--exporter", "torchscript"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "model.onnx.data appeared while it was being written" in err[-1], err
    assert [p.name for p in out.parent.iterdir()] == ["model.onnx.data"]
    assert (out.parent / "model.onnx.data").read_text() == "the user's"


def test_an_exporter_failure_is_one_line(tmp_path, capsys, monkeypatch):
    from turboquant.hf_export import streamed

    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    random_decoders.build_model(cfg).save_pretrained(tmp_path / "hf")

    def failing(*args):  # as torch.onnx's TorchScript exporter fails on Cohere's attention
        raise AssertionError("All tensors must have the same rank")

    monkeypatch.setattr(streamed, "_export_graph", failing)
    assert main([str(tmp_path / "hf"), "-o", str(tmp_path / "out" / "model.onnx"), "--exporter", "torchscript"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: torch.onnx's torchscript exporter failed on this model (AssertionError: All tensors must "
                       "have the same rank); try --exporter dynamo"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
