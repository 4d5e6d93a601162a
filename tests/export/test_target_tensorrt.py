"""--target tensorrt: the turboquant nodes as TensorRT's ONNX parser maps them to the plugins, and an
engine built from a rewritten model where TensorRT is installed."""

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto

import turboquant.onnx_ops  # noqa: F401 - the schemas registered (shape inference of both forms), as in a user's process
from turboquant import node_models, random_decoders
from turboquant import tensorrt as tq_trt
from turboquant.config import packed_size
from turboquant.decoder import DecoderSession
from turboquant.export import RewriteError, export
from turboquant.export.__main__ import main
from turboquant.export.tensorrt import for_tensorrt


def test_nodes_carry_the_plugin_namespace_and_no_empty_inputs(exported, rewritten, tmp_path):
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
        assert attrs["packed_dtype"] == TensorProto.INT8
    assert {p.key: p.value for p in m.metadata_props}["turboquant.target"] == "tensorrt"
    # the packed caches in and out as int8 (TensorRT takes no uint8 network output from a plugin), the same bytes
    types = {v.name: v.type.tensor_type.elem_type for v in (*m.graph.input, *m.graph.output, *m.graph.value_info)}
    packed = [name for name, t in types.items() if t == TensorProto.INT8]
    assert len(packed) == 4 * len(r.compressed) and TensorProto.UINT8 not in types.values()
    assert all(name.startswith(("past_key_values.", "present.")) for name in packed)
    ort_form = onnx.load(str(rewritten("llama-gqa-torchscript", "turboquant_4bit_nc").output))  # uint8 there
    assert sum(v.type.tensor_type.elem_type == TensorProto.UINT8 for v in ort_form.graph.input) == 2 * len(r.compressed)


def test_half_precision_export_takes_the_in_place_plugin_form(exported, tmp_path):
    """A 16-bit export for TensorRT: every layer TQGroupQueryAttention over buffers written in place
    (kept layers raw16), in the plugins' form; a float32 one keeps the concat form, saying why."""
    r = export(exported("llama-gqa-torchscript-fp16"), "turboquant_4bit_nc", tmp_path / "h.onnx", target="tensorrt",
               offsets=False)
    m = onnx.load(str(r.output))
    gqa = [n for n in m.graph.node if n.op_type == "TQGroupQueryAttention"]
    assert len(gqa) == 6 and not [n for n in m.graph.node if n.domain == "com.microsoft"]
    formats = sorted(onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "key_format")) for n in gqa)
    assert formats == [b"mse4"] * 2 + [b"raw16"] * 4
    assert all("" not in n.input for n in gqa) and any(n.op_type == "ConstantOfShape" for n in m.graph.node)
    assert {p.key: p.value for p in m.metadata_props}["turboquant.cache"] == "in-place"
    r32 = export(exported("llama-gqa-torchscript"), "turboquant_4bit_nc", tmp_path / "f.onnx", target="tensorrt",
                 offsets=False)
    assert any("float32 caches" in n for n in r32.notes)


def test_cli_target_option(exported, tmp_path, capsys):
    src = exported("llama-gqa-torchscript")
    assert main([str(src), "--preset", "turboquant_k8v4", "-o", str(tmp_path / "t.onnx"), "--target", "tensorrt"]) == 0
    with pytest.raises(SystemExit):
        main([str(src), "--preset", "turboquant_k8v4", "--target", "tflite"])


def _trt_or_skip():
    try:
        trt = tq_trt.trt_module()
    except tq_trt.TensorRTMissing as e:
        pytest.skip(str(e))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT engine test needs a GPU")
    why = tq_trt.gpu_refusal("tensorrt-rtx" if tq_trt.is_rtx(trt) else "tensorrt")
    if why:
        pytest.skip(f"{trt.__name__} runs no engine on this GPU: {why}")
    return trt


@pytest.mark.gpu
def test_engine_matches_onnxruntime(exported, tmp_path):
    trt = _trt_or_skip()
    torch = pytest.importorskip("torch")
    from turboquant import tensorrt as tq_trt

    src = exported("llama-gqa-torchscript")
    ref = export(src, "turboquant_4bit_nc", tmp_path / "ort.onnx").output
    r = export(src, "turboquant_4bit_nc", tmp_path / "trt.onnx", target="tensorrt")
    engine_bytes = tq_trt.build_engine(r.output, tq_trt.decoder_profile(r.output, past=(0, 16, 64)))
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    handle = tq_trt.load_plugins(runtime.get_plugin_registry(), trt=trt)  # noqa: F841 - kept alive while the engine runs
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
            dtype = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int8: torch.int8}[engine.get_tensor_dtype(name)]
            outs[name] = torch.empty(shape, dtype=dtype, device="cuda")
            ctx.set_tensor_address(name, outs[name].data_ptr())
    stream = torch.cuda.current_stream()
    assert ctx.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    np.testing.assert_allclose(outs["logits"].float().cpu().numpy(), want, rtol=2e-3, atol=2e-3)


# --- onnxruntime-genai models (TQGroupQueryAttention) -------------------------------------------------

GENAI = random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=1, vocab=640)


@pytest.fixture(scope="module")
def genai_model(module_tmp):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")
    return random_decoders.export_genai(GENAI, module_tmp.mktemp("genai"))


@pytest.fixture(scope="module")
def genai_trt(genai_model, module_tmp):
    out = module_tmp.mktemp("genai-trt") / "model.onnx"
    return export(genai_model, "turboquant_4bit_nc", out, progress=False, target="tensorrt")


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_genai_nodes_take_the_plugins_form(genai_trt):
    """Packed QKV and rotary (genai's builder): query, the caches, seqlens_k, one length carrier
    shared by every layer, cos and sin; present keeps past's shape (each layer its own width)."""
    m = onnx.load(str(genai_trt.output))
    nodes = [n for n in m.graph.node if n.op_type == "TQGroupQueryAttention"]
    assert len(nodes) == GENAI.layers
    produced = {o: n for n in m.graph.node for o in n.output}
    carriers = {n.input[4] for n in nodes}
    assert len(carriers) == 1
    fill = produced[carriers.pop()]
    assert fill.op_type == "ConstantOfShape" and onnx.numpy_helper.to_array(_attrs(fill)["value"]).dtype == np.int32
    widths = json.loads({p.key: p.value for p in m.metadata_props}["turboquant.cache_row_bytes"])
    shapes = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in m.graph.input}
    for layer, n in enumerate(nodes):
        a = _attrs(n)
        assert a["plugin_namespace"] == b"turboquant" and a["plugin_version"] == b"1" and a["packed_qkv"] == 1
        # data-free calibration by default: the key offset, a zero value offset and the key scale follow the rotary tables
        calibrated = layer in genai_trt.compressed
        assert a["do_rotary"] == 1 and "" not in n.input and len(n.input) == 7 + 3 * calibrated
        assert n.input[1:3] == [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        assert n.input[5:7] == ["cos_cache", "sin_cache"]
        assert n.input[7:] == [f"tq_key_offset_{layer}", f"{n.name}_tq_zero_value_offset", f"tq_key_scale_{layer}"][:3 * calibrated]
        assert shapes[n.input[1]][3] == widths[str(layer)]  # boundary layers raw16, the others packed
        assert a["packed_dtype"] == TensorProto.INT8
    caches = [v for v in (*m.graph.input, *m.graph.output) if v.name.startswith(("past_key_values.", "present."))]
    assert len(caches) == 4 * GENAI.layers and {v.type.tensor_type.elem_type for v in caches} == {TensorProto.INT8}
    assert sorted(set(widths.values())) == [max(packed_size("mse4", 64), packed_size("uint4", 64)), 2 * 64]
    assert {p.key: p.value for p in m.metadata_props}["turboquant.target"] == "tensorrt"


def test_genai_folder_is_not_written_for_tensorrt(genai_trt):
    assert not (genai_trt.output.parent / "genai_config.json").exists()  # genai runs on ONNX Runtime only


def test_contrib_ops_tensorrt_lacks_are_named(genai_trt):
    note = next(n for n in genai_trt.notes if "TensorRT's ONNX parser knows none" in n)
    assert "com.microsoft.SkipSimplifiedLayerNormalization x" in note and "SimplifiedLayerNormalization x1" in note
    assert "TQGroupQueryAttention" not in note


def test_length_carrier_has_the_total_in_its_shape(genai_trt, tmp_path):
    """The carrier, run on ONNX Runtime from attention_mask: an empty int32 [0, total] whose second
    dimension is total_sequence_length (attention_mask's length in genai's graphs)."""
    m = onnx.load(str(genai_trt.output))
    carrier = next(n for n in m.graph.node if n.op_type == "TQGroupQueryAttention").input[4]
    part = tmp_path / "carrier.onnx"
    onnx.utils.extract_model(str(genai_trt.output), str(part), ["attention_mask"], [carrier], check_model=False)
    sess = ort.InferenceSession(str(part), providers=["CPUExecutionProvider"])
    for total in (1, 7, 300):
        (out,) = sess.run(None, {"attention_mask": np.ones((2, total), np.int64)})
        assert out.shape == (0, total) and out.dtype == np.int32


def test_genai_cli_target_tensorrt(genai_model, tmp_path, capsys):
    assert main([str(genai_model), "--preset", "turboquant_k8v4", "-o", str(tmp_path / "t.onnx"), "--target", "tensorrt"]) == 0
    assert "TensorRT's ONNX parser knows none" in capsys.readouterr().out


def test_genai_profile_covers_the_shared_buffers(genai_trt):
    prof = tq_trt.decoder_profile(genai_trt.output, batch=(1, 2, 4), new=(1, 1, 64), past=(0, 100, 192))
    m = onnx.load(str(genai_trt.output))
    widths = json.loads({p.key: p.value for p in m.metadata_props}["turboquant.cache_row_bytes"])
    assert prof["input_ids"] == ((1, 1), (2, 1), (4, 64))
    assert prof["attention_mask"] == ((1, 1), (2, 101), (4, 256))
    for layer in range(GENAI.layers):  # the buffers hold every token: 192 + 64 rows in each range
        w = widths[str(layer)]
        assert prof[f"past_key_values.{layer}.key"] == ((1, 2, 256, w), (2, 2, 256, w), (4, 2, 256, w))
    assert prof.values == {}  # total_sequence_length is computed from attention_mask there
    assert tq_trt.decoder_profile(genai_trt.output, capacity=5000)["past_key_values.0.value"][0][2] == 5000
    with pytest.raises(ValueError, match="cannot hold past"):
        tq_trt.decoder_profile(genai_trt.output, new=(1, 1, 64), past=(0, 10, 100), capacity=(100, 164, 164))


def _gqa_trt_model(q_heads=4, kv_heads=2, head_dim=64, **kw):
    model = ir.from_proto(node_models.gqa_model(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, key_format="mse4",
                                                value_format="uint4", **kw))
    for_tensorrt(model)
    return model


def test_profile_gives_the_total_as_a_value_where_it_is_an_input(tmp_path):
    """A graph whose seqlens_k and total_sequence_length are inputs: TensorRT takes the total as a
    shape tensor (it feeds the carrier's ConstantOfShape), profiled by value."""
    path = tmp_path / "gqa.onnx"
    ir.save(_gqa_trt_model(rotary_dim=64), path)
    prof = tq_trt.decoder_profile(path, batch=(1, 2, 8), new=(1, 1, 16), past=(0, 31, 48))
    assert prof["seqlens_k"] == ((1,), (2,), (8,))
    assert prof.values == {"total_sequence_length": ((1,), (32,), (64,))}
    assert prof["past_key"] == ((1, 2, 64, 36), (2, 2, 64, 36), (8, 2, 64, 36))


def test_rotary_inputs_dropped_without_do_rotary_and_key_value_layout_told():
    m = _gqa_trt_model()  # separate key and value, no rotary
    n = next(x for x in m.graph if x.op_type == "TQGroupQueryAttention")
    assert n.attributes["packed_qkv"].value == 0
    assert [v.name for v in n.inputs] == ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                          "total_sequence_length_tq_length"]
    with_pos = _gqa_trt_model(position_ids=True)  # ignored by the op without do_rotary: left out too
    assert len(next(x for x in with_pos.graph if x.op_type == "TQGroupQueryAttention").inputs) == 7
    offsets = next(x for x in _gqa_trt_model(offsets=True).graph if x.op_type == "TQGroupQueryAttention")
    assert [v.name for v in offsets.inputs][-2:] == ["key_offset", "value_offset"]


def test_absent_offsets_before_a_later_float_input_become_zeros():
    """The plugin counts its float inputs by position: a value_offset without key_offset, or a
    key_scale without offsets, gets zero offsets (which change nothing) in the places before it."""
    model = ir.from_proto(node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4", value_format="uint4",
                                                offsets=True))
    node = next(x for x in model.graph if x.op_type == "TQGroupQueryAttention")
    node.replace_input_with(12, None)
    for_tensorrt(model)
    zero = node.inputs[-2]
    assert node.inputs[-1].name == "value_offset" and zero.producer().op_type == "Constant"
    np.testing.assert_array_equal(zero.producer().attributes["value"].value.numpy(), np.zeros((2, 64), np.float32))

    node = next(x for x in _gqa_trt_model(rotary_dim=64, key_scale=True).graph if x.op_type == "TQGroupQueryAttention")
    assert node.inputs[-1].name == "key_scale" and len(node.inputs) == 12
    assert [v.producer().op_type for v in node.inputs[-3:-1]] == ["Constant", "Constant"]


def test_head_sinks_are_refused_for_the_plugin_and_windows_and_softcap_kept():
    """The TensorRT plugin's inputs (counted by position) have no place for head_sink: refused, named;
    a window and a softcap are attributes, which the plugin takes as fields."""
    model = ir.from_proto(node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4",
                                                value_format="uint4", head_sink=True))
    with pytest.raises(RewriteError, match="uses input head_sink .attention sinks., which the TensorRT plugin does not"):
        for_tensorrt(model)
    model = ir.from_proto(node_models.gqa_model(q_heads=4, kv_heads=2, head_dim=64, key_format="mse4",
                                                value_format="uint4", local_window_size=16, softcap=30.0))
    for_tensorrt(model)
    node = next(x for x in model.graph if x.op_type == "TQGroupQueryAttention")
    assert node.attributes["local_window_size"].value == 16 and node.attributes["softcap"].value == 30.0


@pytest.mark.gpu
def test_gqa_engine_updates_the_buffers_in_place(tmp_path, ort_session):
    """Where TensorRT is installed: an engine of one TQGroupQueryAttention node (--target tensorrt's
    form, present bound to past's buffer) against the ORT CUDA op, a first prompt then decode steps."""
    trt = _trt_or_skip()
    torch = pytest.importorskip("torch")
    from turboquant.ort import run

    b, hq, hkv, d, cap = 2, 8, 2, 128, 48
    w = max(packed_size("mse4", d), packed_size("uint4", d))
    proto = node_models.gqa_model(q_heads=hq, kv_heads=hkv, head_dim=d, key_format="mse4", value_format="uint4",
                             dtype=TensorProto.FLOAT16, packed_qkv=True, rotary_dim=d)
    path = tmp_path / "gqa.trt.onnx"
    ir.save(_gqa_trt_model(q_heads=hq, kv_heads=hkv, head_dim=d, dtype=TensorProto.FLOAT16, packed_qkv=True, rotary_dim=d),
            path)
    hidden = (hq + 2 * hkv) * d
    prof = tq_trt.Profile({"query": ((1, 1, hidden), (b, 1, hidden), (b, 16, hidden)), "seqlens_k": ((1,), (b,), (b,)),
                           "past_key": ((1, hkv, cap, w), (b, hkv, cap, w), (b, hkv, cap, w)),
                           "past_value": ((1, hkv, cap, w), (b, hkv, cap, w), (b, hkv, cap, w)),
                           "cos_cache": ((cap, d // 2),) * 3, "sin_cache": ((cap, d // 2),) * 3},
                          values={"total_sequence_length": ((1,), (16,), (cap,))})
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    handle = tq_trt.load_plugins(runtime.get_plugin_registry(), trt=trt)  # noqa: F841 - kept alive while the engine runs
    engine = runtime.deserialize_cuda_engine(tq_trt.build_engine(path, prof))
    ctx = engine.create_execution_context()
    sess = ort_session(proto, device="cuda")
    rng = np.random.default_rng(0)
    angles = rng.uniform(0, 6.3, (cap, d // 2))
    cos, sin = np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)
    past = {n: np.zeros((b, hkv, cap, w), np.uint8) for n in ("past_key", "past_value")}
    bufs = {n: torch.zeros(past[n].shape, dtype=torch.int8, device="cuda") for n in past}  # the engine's packed type
    lengths, s = [7, 5], 7
    for step in range(4):
        if step:
            lengths, s = [n + 1 for n in lengths], 1
        total = 7 if step == 0 else max(lengths)
        feeds = {"query": rng.standard_normal((b, s, hidden)).astype(np.float16), **past,
                 "seqlens_k": np.array(lengths, np.int32) - 1, "total_sequence_length": np.array(total, np.int32),
                 "cos_cache": cos, "sin_cache": sin}
        y, present_k, present_v = run(sess, feeds)
        dev = {n: torch.from_numpy(feeds[n]).cuda() for n in ("query", "seqlens_k", "cos_cache", "sin_cache")}
        host_total = np.array(total, np.int32)
        out = torch.empty((b, s, hq * d), dtype=torch.float16, device="cuda")
        for n, t in {**dev, **bufs}.items():
            ctx.set_input_shape(n, tuple(t.shape))
            ctx.set_tensor_address(n, t.data_ptr())
        ctx.set_tensor_address("total_sequence_length", host_total.ctypes.data)  # a shape tensor: host memory
        ctx.set_tensor_address("output", out.data_ptr())
        ctx.set_tensor_address("present_key", bufs["past_key"].data_ptr())  # aliased: the same buffer
        ctx.set_tensor_address("present_value", bufs["past_value"].data_ptr())
        stream = torch.cuda.current_stream()
        assert ctx.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        np.testing.assert_array_equal(bufs["past_key"].cpu().numpy().view(np.uint8), present_k)
        np.testing.assert_array_equal(bufs["past_value"].cpu().numpy().view(np.uint8), present_v)
        for i, n in enumerate(lengths):
            rows = n if step == 0 else s
            np.testing.assert_array_equal(out.cpu().numpy()[i, :rows], y[i, :rows])
        past = {"past_key": present_k, "past_value": present_v}

