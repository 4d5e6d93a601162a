"""turboquant.tensorrt with a real builder: TensorRT for RTX (pip's tensorrt-rtx wheels; .ci/run
installs them) builds engines without a GPU from --target tensorrt rewrites of a TorchScript-exported
decoder rewritten in place and of a model from onnxruntime-genai's builder, two presets each, through
`turboquant build-engine`. Without a GPU the engine cannot be deserialized (TensorRT-RTX's runtime
needs CUDA), so the plugin layers are found in the serialized engine's layer records here and through
TensorRT's engine inspector on a GPU (the tests marked gpu)."""

import re

import onnx
import pytest
from onnx import TensorProto, helper

import turboquant
from turboquant import random_decoders
from turboquant import tensorrt as tq_trt
from turboquant.build_engine import main as build_engine_main
from turboquant.export import export

CFG = random_decoders.TinyConfig(family="llama", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=1, vocab=640)
PRESETS = ("turboquant_4bit_nc", "turboquant_k8v4")
PROFILE = ["--batch", "1", "1", "2", "--new", "1", "1", "16", "--past", "0", "16", "48"]


@pytest.fixture(scope="module")
def rtx():
    try:
        trt = tq_trt.trt_module("tensorrt-rtx")
    except tq_trt.TensorRTMissing as e:
        pytest.skip(f"{e} (.ci/run installs .[tensorrt-rtx])")
    try:
        turboquant.trt_plugin_path()
    except FileNotFoundError as e:
        pytest.skip(f"TensorRT plugin library not built: {e}")
    return trt


@pytest.fixture(scope="module")
def originals(module_tmp):
    """The two kinds of model: an fp16 TorchScript export (rewritten in place) and genai's builder's
    fp16 model for TensorRT-RTX (standard ONNX layer norms, which TensorRT parses; the CPU and CUDA
    targets' contrib ops it does not)."""
    folder = module_tmp.mktemp("trt-originals")
    made = {"torchscript": random_decoders.export(CFG, folder / "model.onnx", "torchscript", "float16")}
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return made
    made["genai"] = random_decoders.export_genai(CFG, folder / "genai", precision="fp16", provider="NvTensorRtRtx")
    return made


@pytest.fixture(scope="module")
def engines(rtx, originals, module_tmp):
    """(kind, preset) -> (rewrite, engine path, the CLI's exit status and output), built once."""
    folder = module_tmp.mktemp("trt-engines")
    built = {}

    def get(kind, preset, capsys):
        if kind not in originals:
            pytest.skip("onnxruntime-genai is not installed (its builder makes the genai model)")
        if (kind, preset) not in built:
            r = export(originals[kind], preset, folder / f"{kind}.{preset}.onnx", target="tensorrt", calibrate=None,
                       boundary=1, progress=False)
            plan = folder / f"{kind}.{preset}.plan"
            capsys.readouterr()
            code = build_engine_main([str(r.output), "-o", str(plan), *PROFILE])
            built[kind, preset] = (r, plan, code, capsys.readouterr())
        return built[kind, preset]

    return get


@pytest.mark.parametrize("kind", ["torchscript", "genai"])
@pytest.mark.parametrize("preset", PRESETS)
def test_engine_holds_the_plugin_layers(engines, kind, preset, capsys):
    r, plan, code, out = engines(kind, preset, capsys)
    assert code == 0, out.err
    assert f"wrote {plan}" in out.out and "tensorrt_rtx_bindings" in out.out
    data = plan.read_bytes()
    m = onnx.load(str(r.output), load_external_data=False)
    ours = [n for n in m.graph.node if n.domain == turboquant.DOMAIN]
    assert ours and {n.op_type for n in ours} == {"TQGroupQueryAttention"}  # in place in both: present aliases past
    # every turboquant node is a layer of the engine: its record names the node, then the plugin
    # (TQGroupQueryAttention, version 1, namespace turboquant) that runs it
    plugin_layers = set(re.findall(rb"\[ONNX Layer: ([^\]]+)\].{0,80}?TQGroupQueryAttention.{0,40}?1.{0,40}?turboquant",
                                   data, re.S))
    assert plugin_layers == {n.name.encode() for n in ours}
    assert len(ours) == CFG.layers  # the boundary layers too (raw16 in the same plugin)


def test_packed_caches_are_int8_engine_io(engines, capsys):
    r, plan, code, _ = engines("torchscript", PRESETS[0], capsys)
    assert code == 0
    m = onnx.load(str(r.output), load_external_data=False)
    caches = [v for v in (*m.graph.input, *m.graph.output) if v.name.startswith(("past_key_values.", "present."))]
    assert {v.type.tensor_type.elem_type for v in caches} == {TensorProto.INT8}


def test_engine_needs_a_gpu_to_deserialize_here(engines, capsys):
    """TensorRT-RTX's runtime initialises CUDA to deserialize; here that fails and says so (on a GPU
    the gpu tests deserialize and inspect the engine)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_engine_inspector_finds_the_plugins deserializes the engine")
    _, plan, code, _ = engines("torchscript", PRESETS[0], capsys)
    assert code == 0
    with pytest.raises(tq_trt.EngineBuildError, match="could not deserialize"):
        tq_trt.inspect_engine(plan.read_bytes(), runtime="tensorrt-rtx")


def test_gpu_refusal_says_why_in_tensorrts_words(rtx):
    """gpu_refusal: None where a one-layer engine runs, else TensorRT's own reason (here, no GPU)."""
    torch = pytest.importorskip("torch")
    why = tq_trt.gpu_refusal("tensorrt-rtx")
    if torch.cuda.is_available():
        assert why is None or "compute capability" in why
    else:
        assert why and "Error Code" in why and "\n" not in why


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["torchscript", "genai"])
def test_engine_inspector_finds_the_plugins(engines, kind, capsys):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("deserializing a TensorRT-RTX engine needs a GPU")
    why = tq_trt.gpu_refusal("tensorrt-rtx")
    if why:
        pytest.skip(f"TensorRT-RTX runs no engine on this GPU: {why}")
    r, plan, code, _ = engines(kind, PRESETS[0], capsys)
    assert code == 0
    info = tq_trt.inspect_engine(plan.read_bytes(), runtime="tensorrt-rtx")
    m = onnx.load(str(r.output), load_external_data=False)
    ours = {n.name for n in m.graph.node if n.domain == turboquant.DOMAIN}
    text = [str(layer) for layer in info["layers"]]
    assert all(any(name in t for t in text) for name in ours), text[:5]
    assert {d for name, (d, _) in info["io"].items() if name.startswith("present.")} == {"INT8"}


# --- refusals: one line, exit status 2 --------------------------------------------------------------


def _tiny_pack_graph(path, extra=None):
    """TQPack -> TQUnpack in --target tensorrt's form, and optionally a node TensorRT does not know."""
    attrs = dict(format="mse4", head_dim=64, plugin_namespace="turboquant", plugin_version="1", packed_dtype=TensorProto.INT8)
    nodes = [helper.make_node("TQPack", ["x"], ["packed"], name="pack0", domain="turboquant", **attrs),
             helper.make_node("TQUnpack", ["packed"], ["y"], name="unpack0", domain="turboquant", dtype=TensorProto.FLOAT16,
                              **attrs)]
    if extra is not None:
        nodes.append(extra)
    shape = ["batch", 2, "rows", 64]  # a cache's: decoder_profile (the CLI's) covers it
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT16, shape)]
    if extra is not None:
        outs.append(helper.make_tensor_value_info(extra.output[0], TensorProto.FLOAT16, shape))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, shape)], outs)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("turboquant", 1),
                                            helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    m.metadata_props.add(key="turboquant.target", value="tensorrt")
    onnx.save(m, str(path))
    return path


def _profile(path):
    return tq_trt.Profile({"x": ((1, 2, 1, 64), (1, 2, 8, 64), (4, 2, 64, 64))})


def test_pack_unpack_engine_builds(rtx, tmp_path):
    """A packed tensor between two plugin layers: int8, which TensorRT takes (uint8 it refuses)."""
    path = _tiny_pack_graph(tmp_path / "pack.onnx")
    assert len(tq_trt.build_engine(path, _profile(path), runtime="tensorrt-rtx")) > 0
    m = onnx.load(str(path))
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "packed_dtype":
                a.i = TensorProto.UINT8
    onnx.save(m, str(path))
    with pytest.raises(tq_trt.EngineBuildError, match=r"node 'pack0' \(TQPack\): .*UINT8") as e:
        tq_trt.build_engine(path, _profile(path), runtime="tensorrt-rtx")
    assert "\n" not in str(e.value)


def test_unknown_op_is_refused_naming_the_node(rtx, tmp_path, capsys):
    """An op neither ONNX's nor a registered plugin: the parser's refusal, one line naming the node;
    the same graph without it builds through the CLI."""
    extra = helper.make_node("FancyNorm", ["y"], ["z"], name="norm7", domain="com.example")
    path = _tiny_pack_graph(tmp_path / "foreign.onnx", extra)
    code = build_engine_main([str(path), "-o", str(tmp_path / "foreign.plan")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "parser refused node 'norm7' (FancyNorm)" in err, err
    assert not (tmp_path / "foreign.plan").exists()
    fine = _tiny_pack_graph(tmp_path / "fine.onnx")
    assert build_engine_main([str(fine), "-o", str(tmp_path / "fine.plan")]) == 0
    assert (tmp_path / "fine.plan").stat().st_size > 0


def test_cli_refusals_are_one_line(tmp_path, capsys):
    path = _tiny_pack_graph(tmp_path / "pack.onnx")
    m = onnx.load(str(path))
    del m.metadata_props[:]
    onnx.save(m, str(tmp_path / "ort.onnx"))
    (tmp_path / "taken.plan").write_bytes(b"mine")
    cases = [([str(tmp_path / "ort.onnx"), "-o", str(tmp_path / "a.plan")], "is not a --target tensorrt rewrite"),
             ([str(path), "-o", str(tmp_path / "taken.plan")], "does not overwrite"),
             ([str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "b.plan")], "no such file"),
             ([str(path), "-o", str(tmp_path / "c.plan"), "--tensorrt", "tensorrt"], "no TensorRT to build with")]
    for argv, message in cases:
        if message == "no TensorRT to build with":
            try:
                tq_trt.trt_module("tensorrt")
                continue  # TensorRT itself is installed here
            except tq_trt.TensorRTMissing:
                pass
        assert build_engine_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert (tmp_path / "taken.plan").read_bytes() == b"mine"
    with pytest.raises(SystemExit):
        build_engine_main([str(path), "-o", str(tmp_path / "d.plan"), "--batch", "4", "1", "2"])


def test_rtx_parser_link_is_made():
    """The unversioned libtensorrt_rtx.so that TensorRT-RTX's parser dlopens, beside the wheel's .so.1."""
    import importlib.util
    import pathlib

    try:
        tq_trt.trt_module("tensorrt-rtx")
    except tq_trt.TensorRTMissing as e:
        pytest.skip(str(e))
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None:
        pytest.skip("TensorRT-RTX is not installed from its wheel")
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    assert (folder / "libtensorrt_rtx.so").resolve() == (folder / "libtensorrt_rtx.so.1").resolve()
