"""cache_layout.inspect on models that cannot be benchmarked: a broken genai_config.json, weights
missing from beside the model; each a LayoutError naming the file, exit status 2 from bench decode."""

import onnx
import pytest

from turboquant import random_decoders
from turboquant.bench import __main__ as bench
from turboquant.bench import cache_layout, decode_models


@pytest.fixture(scope="module")
def exported(module_tmp):
    return random_decoders.export(decode_models.SHAPES["tiny"], module_tmp.mktemp("tiny") / "model.onnx")


def _refused(capsys, argv, message):
    rc = bench.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("text, message", [
    ("{bad", "not JSON (Expecting property name"), ("{}", 'no "model" section'), ("[1]", 'no "model" section'),
    ('{"model": 3}', "are not objects"), ('{"model": {"decoder": []}}', "are not objects"),
    ('{"model": {"context_length": "long", "decoder": {}}}', "model.context_length is 'long'"),
    ('{"model": {"decoder": {"filename": 7}}}', "filename is not a file name"),
    (b"\xff\xfe", "cannot be read"),
])
def test_a_broken_genai_config_is_named(exported, tmp_path, capsys, text, message):
    folder = tmp_path / "genai"
    folder.mkdir()
    config = folder / cache_layout.GENAI_CONFIG
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(cache_layout.LayoutError) as e:
        cache_layout.inspect(folder)
    assert str(config) in str(e.value) and message in str(e.value) and e.value.arg == "MODEL"
    _refused(capsys, ["decode", str(exported), str(folder)], f"argument MODEL: {config}")


def test_missing_external_data_is_named(exported, tmp_path, capsys):
    folder = tmp_path / "nodata"
    folder.mkdir()
    onnx.save(onnx.load(str(exported)), folder / "model.onnx", save_as_external_data=True,
              location="weights.data", size_threshold=0)
    assert cache_layout.inspect(folder / "model.onnx").layers == 3
    (folder / "weights.data").unlink()
    _refused(capsys, ["decode", str(exported), str(folder / "model.onnx")],
             f"its external data file {folder / 'weights.data'} is missing")


def test_a_rewrite_says_how_many_positions_its_rotary_tables_hold(tmp_path):
    from turboquant.export import export

    orig = random_decoders.export(decode_models.SHAPES["tiny"], tmp_path / "model.onnx")
    tq = export(orig, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=1, progress=False).output
    assert cache_layout.inspect(orig).rotary_positions is None
    assert cache_layout.inspect(tq).rotary_positions == 131072


def test_a_small_models_own_rewrite_is_a_form_of_it(tmp_path):
    """Head size 16 at hidden 64: the exporter's K and V weights (64 x 32) are below the size that makes
    a weight's shape compared, the rewrite's packed Q, K and V weight (64 x 128) above it; their
    elements are counted all the same, so eval and bench decode take the pair (they refused it)."""
    from turboquant.export import export

    cfg = random_decoders.TinyConfig(family="llama", layers=6, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128, seed=4)
    src = random_decoders.export(cfg, tmp_path / "small.onnx")
    dst = export(src, "turboquant_4bit_nc", None, progress=False, offsets=False).output  # default form: in place, QKV packed
    assert any(t.name.startswith("tq_qkv_weight_") for t in onnx.load(dst, load_external_data=False).graph.initializer)
    cache_layout.check_same_model(cache_layout.inspect(src), cache_layout.inspect(dst), "MODEL 2")


def test_malformed_layer_metadata_and_logits_without_a_shape(exported, tmp_path):
    m = onnx.load(exported)
    next(o for o in m.graph.output if o.name == "logits").type.tensor_type.ClearField("shape")
    onnx.save(m, tmp_path / "noshape.onnx")
    assert cache_layout.inspect(tmp_path / "noshape.onnx").vocab is None  # an IndexError before
    m.metadata_props.add(key="turboquant.layers", value='[{"layer": 0, "key_format": 4}]')
    onnx.save(m, tmp_path / "bad.onnx")
    with pytest.raises(cache_layout.LayoutError, match="metadata turboquant.layers: layer 0's key_format '4' is not one of"):
        cache_layout.inspect(tmp_path / "bad.onnx")
