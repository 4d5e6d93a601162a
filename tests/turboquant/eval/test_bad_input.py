"""python -m turboquant.eval on bad input: token files, malformed turboquant.* metadata, models ONNX
Runtime cannot run, unbounded numbers; each one line naming what was wrong and exit status 2."""

import json

import onnx
import pytest

from turboquant.eval.__main__ import main

FAST = ["--context", "64", "--prefill", "32", "--max-tokens", "32", "--batch", "2", "--no-cache", "--no-progress"]


def _refused(capfd, argv, *fragments):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's refusals exit from the parser
        rc = e.code
    err = capfd.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert str(f) in err, err
    return err


def _with_metadata(src, dst, **meta):
    m = onnx.load(src)
    props = {p.key: p.value for p in m.metadata_props}
    props.update(meta)
    del m.metadata_props[:]
    for k, v in props.items():
        m.metadata_props.add(key=k, value=v)
    onnx.save(m, dst)
    return dst


def test_an_empty_npy_file(tiny, tmp_path, capfd):
    src, dst, _ = tiny
    (tmp_path / "empty.npy").write_bytes(b"")
    _refused(capfd, [src, dst, "--text", tmp_path / "empty.npy"], tmp_path / "empty.npy", "not a numpy array")


def test_an_id_beyond_int64(tiny, tmp_path, capfd):
    src, dst, _ = tiny
    (tmp_path / "big.ids").write_text(f"1 2 {2**64}")
    _refused(capfd, [src, dst, "--text", tmp_path / "big.ids"], tmp_path / "big.ids", "outside the model's vocabulary")


@pytest.mark.parametrize("layers, fragment", [
    ('[{"layer": 1,', "turboquant.layers is not JSON"),
    ('{"layer": 1}', "turboquant.layers is not a list of objects"),
    ('[{"layer": "one"}]', "layer 'one' is not a layer number"),
    ('[{"layer": 1, "key_format": "mse9", "value_format": "uint4"}]', "key_format 'mse9' is not one of"),
    ('[{"layer": 1, "key_format": ["mse4"]}]', "is not one of"),
])
def test_malformed_turboquant_metadata(tiny, tmp_path, capfd, layers, fragment):
    src, dst, ids = tiny
    bad = _with_metadata(dst, tmp_path / "bad.onnx", **{"turboquant.layers": layers})
    _refused(capfd, [src, bad, "--text", ids], bad, fragment)


def test_malformed_rotary_positions(tiny, tmp_path, capfd):
    src, dst, ids = tiny
    bad = _with_metadata(dst, tmp_path / "bad.onnx", **{"turboquant.rotary_positions": str(2**62)})
    _refused(capfd, [src, bad, "--text", ids], "turboquant.rotary_positions is 4611686018427387904, not 1 to")


def test_a_model_onnx_runtime_cannot_load(tiny, tmp_path, capfd):
    """A weight whose bytes were cut short: ONNX Runtime's Fail, one line naming the models."""
    src, dst, ids = tiny
    m = onnx.load(dst)
    big = max(m.graph.initializer, key=lambda t: len(t.raw_data))
    big.raw_data = big.raw_data[: len(big.raw_data) // 2]
    onnx.save(m, tmp_path / "cut.onnx")
    _refused(capfd, [src, tmp_path / "cut.onnx", "--text", ids, *FAST], "cut.onnx")


@pytest.mark.parametrize("option, value, fragment", [
    ("--threads", str(2**40), "is too large"), ("--threads", "100000", "threads is more than"),
    ("--context", "-5", "must be a positive count"), ("--max-tokens", "1e3", "expected a non-negative integer"),
    ("--batch", "9" * 400, "is too large"),
])
def test_numbers_out_of_bounds(tiny, capfd, option, value, fragment):
    src, dst, ids = tiny
    _refused(capfd, [src, dst, "--text", ids, option, value], f"argument {option}", fragment)


def test_logits_without_a_declared_shape_run(tiny, tmp_path, capfd):
    """The vocabulary is then unknown (the ids are not checked against it), not an IndexError."""
    src, dst, ids = tiny
    for path, name in ((src, "orig.onnx"), (dst, "tq.onnx")):
        m = onnx.load(path)
        next(o for o in m.graph.output if o.name == "logits").type.tensor_type.ClearField("shape")
        onnx.save(m, tmp_path / name)
    rc = main([str(tmp_path / "orig.onnx"), str(tmp_path / "tq.onnx"), "--text", str(ids), *FAST, "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert json.loads(out[out.index("{"):])["results"][0]["top1_agreement"] > 0
