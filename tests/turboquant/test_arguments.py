"""turboquant.arguments: the CLIs' shared checks refuse bad counts and output paths before any work,
naming what was wrong, and make nothing."""

import argparse

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from turboquant import arguments
from turboquant.saving import OutputExists


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [(arguments.positive, "3", 3), (arguments.non_negative, "0", 0), (arguments.non_negative_list, "0, 2,", [0, 2])],
)
def test_counts_parse(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (arguments.positive, "0", "must be a positive count, not 0"),
        (arguments.positive, "two", "expected a positive integer, got 'two'"),
        (arguments.non_negative, "-1", "must be zero or more, not -1"),
        (arguments.non_negative_list, "0,x", "expected a non-negative integer, got 'x'"),
        (arguments.head_dim, "1.5", "expected an integer head size, got '1.5'"),
    ],
)
def test_bad_counts_are_named(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_head_dim_outside_the_formats_is_refused():
    assert arguments.head_dim("128") == 128
    with pytest.raises(argparse.ArgumentTypeError, match="8"):
        arguments.head_dim("8")


def test_output_file_may_be_new_in_new_folders(tmp_path):
    assert arguments.check_output_file(tmp_path / "a" / "b" / "out.onnx") == tmp_path / "a" / "b" / "out.onnx"
    assert list(tmp_path.iterdir()) == []  # checked, not made


def test_output_file_refusals(tmp_path):
    (tmp_path / "file").write_text("user's")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="-o is an empty name"):
        arguments.check_output_file(" ", "-o")
    with pytest.raises(OutputExists, match="-o .*file exists"):
        arguments.check_output_file(tmp_path / "file", "-o")
    with pytest.raises(ValueError, match="-o .*dir is a folder; give a file name"):
        arguments.check_output_file(tmp_path / "dir", "-o")
    with pytest.raises(ValueError, match="file is a file, not a folder"):
        arguments.check_output_file(tmp_path / "file" / "out.onnx", "-o")
    with pytest.raises(ValueError, match="is longer than the 255 bytes its file system takes"):
        arguments.check_output_file(tmp_path / ("x" * 300) / "out.onnx", "-o")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]
    assert (tmp_path / "file").read_text() == "user's"


def test_a_folder_that_takes_no_files_is_refused():
    # /proc refuses new files even to root, whose permissions alone would let it write anywhere
    with pytest.raises(ValueError, match="-o /proc/out.onnx: cannot write in /proc"):
        arguments.check_output_file("/proc/out.onnx", "-o")
    with pytest.raises(ValueError, match="--out /proc/new: cannot write in /proc"):
        arguments.check_output_folder("/proc/new", "--out")


def test_output_folder(tmp_path):
    (tmp_path / "file").write_text("")
    assert arguments.check_output_folder(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert arguments.check_output_folder(tmp_path, "--out") == tmp_path  # an existing folder is fine
    with pytest.raises(ValueError, match="--out is an empty name"):
        arguments.check_output_folder("", "--out")
    with pytest.raises(ValueError, match="--out .*file is a file, not a folder"):
        arguments.check_output_folder(tmp_path / "file", "--out")
    with pytest.raises(ValueError, match="file is a file, not a folder"):
        arguments.check_output_folder(tmp_path / "file" / "sub", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_plot_file_needs_a_format_matplotlib_saves(tmp_path):
    pytest.importorskip("matplotlib")
    assert arguments.check_plot_file(tmp_path / "p.svg") == tmp_path / "p.svg"
    with pytest.raises(ValueError, match=r"--plot .*p.txt: a plot is saved as one of .*\.png"):
        arguments.check_plot_file(tmp_path / "p.txt")
    with pytest.raises(ValueError, match=r"--plot .*p.pgf: a plot is saved as one of"):  # it needs LaTeX
        arguments.check_plot_file(tmp_path / "p.pgf")


def _model_with_external_data(folder):
    w = numpy_helper.from_array(np.ones((64, 64), "float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [w],
    )
    model = helper.make_model(graph, ir_version=10)
    onnx.save(model, str(folder / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    return folder / "m.onnx"


def test_read_onnx(tmp_path):
    path = _model_with_external_data(tmp_path)
    model = arguments.read_onnx(path)
    assert model.graph.node[0].op_type == "MatMul"
    assert arguments.external_data_files(model, tmp_path) == {tmp_path / "m.data"}
    (tmp_path / "not.onnx").write_text("hello")
    with pytest.raises(ValueError, match=f"{tmp_path} is a folder, not an ONNX model"):
        arguments.read_onnx(tmp_path)
    with pytest.raises(ValueError, match="missing.onnx: no such file"):
        arguments.read_onnx(tmp_path / "missing.onnx")
    with pytest.raises(ValueError, match=r"not.onnx: not an ONNX model \("):
        arguments.read_onnx(tmp_path / "not.onnx")
    (tmp_path / "m.data").unlink()
    with pytest.raises(ValueError, match="m.onnx: its external data file .*m.data is missing"):
        arguments.read_onnx(path)


def test_a_link_to_nothing_on_the_way_is_refused(tmp_path):
    (tmp_path / "dl").symlink_to(tmp_path / "nowhere")
    for check, what in [(arguments.check_output_file, "-o"), (arguments.check_output_folder, "--out")]:
        with pytest.raises(ValueError, match=f"{what} .*dl/x/y: .*dl is a link to .*nowhere, which does not exist"):
            check(tmp_path / "dl" / "x" / "y", what)
    with pytest.raises(ValueError, match="--out .*dl: .*dl is a link to .*nowhere, which does not exist"):
        arguments.check_output_folder(tmp_path / "dl", "--out")
    with pytest.raises(OutputExists, match="dl exists"):
        arguments.check_output_file(tmp_path / "dl", "-o")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert arguments.check_output_file(tmp_path / "link" / "new" / "x.onnx", "-o") == tmp_path / "link" / "new" / "x.onnx"
    assert arguments.check_output_folder(tmp_path / "link", "--out") == tmp_path / "link"
