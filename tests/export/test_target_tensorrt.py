"""--target tensorrt: the turboquant nodes as TensorRT's ONNX parser maps them to the plugins, and an
engine built from a rewritten model where TensorRT is installed."""

import numpy as np
import onnx
import pytest

from turboquant.decoder import DecoderSession
from turboquant.export import export
from turboquant.export.__main__ import main


def test_nodes_carry_the_plugin_namespace_and_no_empty_inputs(exported, tmp_path):
    src = exported("llama-gqa-torchscript")
    r = export(src, "turboquant_4bit_nc", tmp_path / "trt.onnx", calibrate=None, target="tensorrt")
    m = onnx.load(str(r.output))
    nodes = [n for n in m.graph.node if n.domain == "turboquant"]
    assert len(nodes) == len(r.compressed)
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["plugin_namespace"] == b"turboquant" and attrs["plugin_version"] == b"1"
        assert attrs["has_mask"] in (0, 1) and "" not in n.input
        offsets = sum(1 for name in n.input if "_offset_" in name)  # calibrated by default (data-free)
        assert len(n.input) == 5 + attrs["has_mask"] + offsets and offsets == 1
    assert {p.key: p.value for p in m.metadata_props}["turboquant.target"] == "tensorrt"


def test_cli_target_option(exported, tmp_path, capsys):
    src = exported("llama-gqa-torchscript")
    assert main([str(src), "--preset", "turboquant_k8v4", "-o", str(tmp_path / "t.onnx"), "--target", "tensorrt"]) == 0
    with pytest.raises(SystemExit):
        main([str(src), "--preset", "turboquant_k8v4", "--target", "tflite"])


def test_engine_matches_onnxruntime(exported, tmp_path):
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed here (pip's tensorrt needs NVIDIA's index)")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT engine test needs a GPU")
    from turboquant import tensorrt as tq_trt

    src = exported("llama-gqa-torchscript")
    ref = export(src, "turboquant_4bit_nc", tmp_path / "ort.onnx").output
    r = export(src, "turboquant_4bit_nc", tmp_path / "trt.onnx", target="tensorrt")
    engine_bytes = tq_trt.build_engine(r.output, tq_trt.decoder_profile(r.output, past=(0, 16, 64)))
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    handle = tq_trt.load_plugins(runtime.get_plugin_registry())  # noqa: F841 - kept alive while the engine runs
    engine = runtime.deserialize_cuda_engine(engine_bytes)
    ctx = engine.create_execution_context()

    sess = DecoderSession(ref)
    ids = np.random.default_rng(0).integers(0, 512, (1, 6))
    want, _ = sess.step(ids, sess.empty_cache(1), 0)
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 6), np.int64), "position_ids": np.arange(6)[None]}
    feeds.update(sess.empty_cache(1))
    keep = {}
    for name, value in feeds.items():
        t = torch.from_numpy(np.ascontiguousarray(value)).cuda()
        keep[name] = t
        ctx.set_input_shape(name, tuple(t.shape))
        ctx.set_tensor_address(name, t.data_ptr())
    outs = {}
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = {trt.float32: torch.float32, trt.float16: torch.float16, trt.uint8: torch.uint8}[engine.get_tensor_dtype(name)]
            outs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            ctx.set_tensor_address(name, outs[name].data_ptr())
    stream = torch.cuda.current_stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    np.testing.assert_allclose(outs["logits"].float().cpu().numpy(), want, rtol=2e-3, atol=2e-3)
