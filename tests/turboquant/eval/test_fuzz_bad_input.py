"""Fuzz: eval and bench decode on mutated turboquant.* metadata, token files and numeric options
always exit 2 with exactly one line on stderr and no traceback (turboquant.boundary). Bounded: a few
dozen examples per test, the eval tests' own models, nothing run in ONNX Runtime."""

import json

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turboquant.bench import __main__ as bench
from turboquant.eval.__main__ import main as evaluate

FUZZ = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=8)
layer_entries = st.lists(st.fixed_dictionaries({"layer": st.integers(-3, 9) | st.text(max_size=3)},
                                               optional={"key_format": st.sampled_from(["mse4", "mse9", "", "uint4"]) | json_values,
                                                         "value_format": st.sampled_from(["uint4", "raw16", "x"]) | json_values}),
                         max_size=4)


def _one_line(call, capfd) -> str:
    try:
        rc = call()
    except SystemExit as e:
        rc = e.code
    err = capfd.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err)
    return err


@pytest.fixture(scope="module")
def rewrite_proto(tiny):
    return onnx.load(tiny[1])


@FUZZ
@given(key=st.sampled_from(["turboquant.layers", "turboquant.rotary_positions"]),
       text=st.one_of(json_values.map(json.dumps), layer_entries.map(json.dumps), st.text(max_size=40)),
       tool=st.sampled_from(["eval", "bench decode"]))
def test_mutated_metadata(tiny, rewrite_proto, tmp_path_factory, capfd, key, text, tool):
    src, _, ids = tiny
    m = onnx.ModelProto()
    m.CopyFrom(rewrite_proto)
    props = {p.key: p.value for p in m.metadata_props}
    props[key] = text
    if key == "turboquant.rotary_positions":  # a number in range is a valid value: keep it bad
        props["turboquant.layers"] = "{}"
    del m.metadata_props[:]
    for k, v in props.items():
        m.metadata_props.add(key=k, value=v)
    path = tmp_path_factory.mktemp("meta") / "mutated.onnx"
    onnx.save(m, path)
    if tool == "eval":
        _one_line(lambda: evaluate([str(src), str(path), "--text", str(ids), "--no-cache"]), capfd)
    else:
        _one_line(lambda: bench.main(["decode", str(src), str(path), "--steps", "1", "--context", "8"]), capfd)


@FUZZ
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".npy", ".ids"]))
def test_mutated_token_files(tiny, tmp_path_factory, capfd, data, suffix):
    """Short files: even valid ids are fewer than one window of the default context (512)."""
    src, dst, _ = tiny
    path = tmp_path_factory.mktemp("tokens") / f"text{suffix}"
    path.write_bytes(data)
    err = _one_line(lambda: evaluate([str(src), str(dst), "--text", str(path), "--no-cache"]), capfd)
    assert "error:" in err


def _not_a_count(text: str) -> bool:
    try:
        return int(text) <= 0
    except ValueError:
        return True


bad_numbers = st.one_of(st.integers(max_value=0).map(str), st.integers(min_value=2**31).map(str),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.text(max_size=12).filter(_not_a_count))


@FUZZ
@given(option=st.sampled_from(["--threads", "--context", "--prefill", "--stride", "--batch"]), value=bad_numbers)
def test_mutated_eval_options(tiny, capfd, option, value):
    src, dst, ids = tiny
    _one_line(lambda: evaluate([str(src), str(dst), "--text", str(ids), "--no-cache", f"{option}={value}"]), capfd)


@FUZZ
@given(option=st.sampled_from(["--threads", "--steps", "--rounds"]), value=bad_numbers)
def test_mutated_bench_decode_options(tiny, capfd, option, value):
    src, dst, _ = tiny
    _one_line(lambda: bench.main(["decode", str(src), str(dst), f"{option}={value}"]), capfd)
