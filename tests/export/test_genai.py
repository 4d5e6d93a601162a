"""The rewrite of onnxruntime-genai models: built by genai's own model builder from small random
Llama and Qwen2 configs, rewritten to TQGroupQueryAttention, run with a shared buffer through
plain ONNX Runtime and through onnxruntime-genai itself."""

import json
import pathlib
import re
import shutil
from unittest import mock

import numpy as np
import onnx
import pytest

from turboquant import TQ_PRESETS, random_decoders
from turboquant.config import TurboQuantConfig, packed_size
from turboquant.eval.metrics import mean_kl
from turboquant.export import RewriteError, export
from turboquant.export import genai as genai_folder
from turboquant.export import genai_check
from turboquant.export.gqa import row_width
from turboquant.shared_buffer import SharedBufferDecoder

from .cli_helpers import assert_refused, run_main, tree as _tree

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")

# vocab differs from the MLP width on purpose: genai's builder takes any Linear with vocab outputs
# for the LM head
CONFIGS = {
    "llama": random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=1, vocab=640),
    "qwen2": random_decoders.TinyConfig(family="qwen2", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=2, vocab=640),
}
MAX_LENGTH = 64
STEPS = 32
RAW16 = 2 * 64  # a boundary layer's row: head size 64 in fp16 bits
PACKED = {p: max(packed_size(TurboQuantConfig.from_cache_dtype(p, 64).key_format, 64),
                 packed_size(TurboQuantConfig.from_cache_dtype(p, 64).value_format, 64)) for p in TQ_PRESETS}


@pytest.fixture(scope="module")
def built(module_tmp):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = random_decoders.export_genai(CONFIGS[name], module_tmp.mktemp(f"genai-{name}"))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def rewritten(built, module_tmp):
    cache = {}

    def get(name, preset, genai_version=None, **kw):
        """genai_version: rewrite as if that onnxruntime-genai were installed."""
        key = (name, preset, genai_version, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            out = module_tmp.mktemp(f"tq-{name}") / "model.onnx"
            with mock.patch.object(genai_folder, "installed_version", return_value=genai_version or "0.18.0"):
                cache[key] = export(built(name), preset, out, progress=False, **kw)
        return cache[key]

    return get


def test_builder_model_uses_group_query_attention(built):
    m = onnx.load(built("llama"), load_external_data=False)
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 6 and all(n.input[1] == "" for n in gqa)  # packed QKV
    assert {a.name: onnx.helper.get_attribute_value(a) for a in gqa[0].attribute}["do_rotary"] == 1


# every preset on Llama; on Qwen2 (biases after the QKV projection: biased keys) one preset of each
# key calibration, Lloyd-Max's and fp8's (the 3-bit presets calibrate as 4bit_nc does; their formats
# are the op tests' to cover)
TRACKED = [("llama", preset) for preset in TQ_PRESETS] + [("qwen2", "turboquant_4bit_nc"), ("qwen2", "turboquant_k8v4")]


@pytest.mark.parametrize(("name", "preset"), TRACKED)
def test_rewritten_model_tracks_the_original(built, rewritten, name, preset):
    result = rewritten(name, preset)
    assert result.compressed == [2, 3] and result.kept == [0, 1, 4, 5]
    ids = np.random.default_rng(7).integers(0, CONFIGS[name].vocab, (2, 12 + STEPS))
    a = SharedBufferDecoder(built(name), MAX_LENGTH).teacher_forced(ids, 12)
    b = SharedBufferDecoder(result.output, MAX_LENGTH).teacher_forced(ids, 12)
    # the prompt's own tokens are attended exactly: the first step matches to float tolerance
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-3 * max(1.0, float(np.abs(a[:, 0]).max())))
    kl = mean_kl(a[:, 1:], b[:, 1:])
    top1 = float((a[:, 1:].argmax(-1) == b[:, 1:].argmax(-1)).mean())
    print(f"{name} {preset}: mean KL {kl:.4f}, top-1 {top1:.1%}")
    assert np.isfinite(b).all() and len(set(a.argmax(-1).ravel())) > STEPS // 2
    assert kl > 0.0  # the compressed layers do change something
    assert top1 >= (0.8 if preset in ("turboquant_k8v4", "turboquant_4bit_nc") else 0.6), (kl, top1)


def test_smooth_softmax_becomes_a_zero_sink(built, tmp_path):
    """GroupQueryAttention's smooth_softmax (a sink of 0 in every head's denominator, ONNX Runtime's
    definition) is rewritten as a head_sink of zeros: the prompt's step, attended exactly, gives the
    original's logits, which smooth_softmax changes."""
    m = onnx.load(built("llama"))
    for node in (n for n in m.graph.node if n.op_type == "GroupQueryAttention"):
        node.attribute.append(onnx.helper.make_attribute("smooth_softmax", 1))
    src = tmp_path / "smooth" / "model.onnx"
    src.parent.mkdir()
    onnx.save(m, src, save_as_external_data=True, location="model.onnx.data")
    shutil.copy(built("llama").parent / "genai_config.json", src.parent)
    result = export(src, "turboquant_4bit_nc", tmp_path / "out" / "model.onnx", progress=False, calibrate="random")
    assert result.compressed == [2, 3]
    out = onnx.load(result.output, load_external_data=False)
    sinks = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer if "smooth_softmax_sink" in i.name}
    for node in (n for n in out.graph.node if n.op_type == "TQGroupQueryAttention"):
        assert "smooth_softmax" not in {a.name for a in node.attribute}
        assert node.input[11] in sinks and not sinks[node.input[11]].any() and sinks[node.input[11]].shape == (4,)
    ids = np.random.default_rng(7).integers(0, CONFIGS["llama"].vocab, (2, 12 + 2))
    a = SharedBufferDecoder(src, MAX_LENGTH).teacher_forced(ids, 12)
    b = SharedBufferDecoder(result.output, MAX_LENGTH).teacher_forced(ids, 12)
    plain = SharedBufferDecoder(built("llama"), MAX_LENGTH).teacher_forced(ids, 12)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-3 * max(1.0, float(np.abs(a[:, 0]).max())))
    assert np.abs(plain[:, 0] - a[:, 0]).max() > 1e-2 * max(1.0, float(np.abs(a[:, 0]).max()))


def _cache_dims(path) -> dict[str, tuple]:
    """name -> (elem type, dim 1, dim 3) of every cache input and output, as the model declares them."""
    m = onnx.load(path, load_external_data=False)
    return {vi.name: (vi.type.tensor_type.elem_type, *(vi.type.tensor_type.shape.dim[i].dim_value for i in (1, 3)))
            for vi in [*m.graph.input, *m.graph.output] if vi.name.startswith(("past_key_values", "present"))}


def _expected_widths(compressed, layers=6, packed=PACKED["turboquant_4bit_nc"]):
    return {i: packed if i in compressed else RAW16 for i in range(layers)}


def test_cache_io_config_and_library(built, rewritten):
    """Each layer's caches declare uint8 rows of its own width (compressed layers the larger packed
    size of their formats, boundary layers raw16) and the concrete KV heads; genai_config.json's
    head_size is the widest row."""
    result = rewritten("qwen2", "turboquant_4bit_nc")
    widths = _expected_widths([2, 3])
    assert PACKED["turboquant_4bit_nc"] == max(packed_size("mse4", 64), packed_size("uint4", 64)) == 36
    assert [p.row_bytes for p in result.layers] == [widths[i] for i in range(6)] and result.row_bytes == RAW16
    dims = _cache_dims(result.output)
    assert len(dims) == 24
    for name, (elem, heads, width) in dims.items():
        layer = int(re.search(r"\.(\d+)\.", name)[1])
        assert (elem, heads, width) == (onnx.TensorProto.UINT8, 2, widths[layer]), name
    m = onnx.load(result.output, load_external_data=False)
    nodes = [n for n in m.graph.node if n.op_type == "TQGroupQueryAttention"]
    assert len(nodes) == 6 and not any(n.op_type == "GroupQueryAttention" for n in m.graph.node)
    formats = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}["key_format"] for n in nodes]
    assert formats == [b"raw16", b"raw16", b"mse4", b"mse4", b"raw16", b"raw16"]
    meta = {p.key: p.value for p in m.metadata_props}
    assert json.loads(meta["turboquant.cache_row_bytes"]) == {str(i): w for i, w in widths.items()}
    config = json.loads((result.output.parent / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["head_size"] == RAW16 and decoder["filename"] == "model.onnx"
    assert (result.output.parent / decoder["session_options"]["custom_ops_library"]).is_file()
    assert (result.output.parent / "tokenizer.json").is_file()
    summary = result.summary()
    assert meta["turboquant.calibration"].startswith("data-free (self-generated: 16 continuations")  # export/calibrate_gqa.py
    assert "layers 0-1, 4-5: 128 (raw16); layers 2-3: 36 (mse4/uint4)" in summary
    assert "onnxruntime-genai 0.18.0 (installed) allocates each layer's cache" in summary


@pytest.mark.parametrize("kw, compressed", [
    (dict(boundary=0), [0, 1, 2, 3, 4, 5]),
    (dict(boundary=1), [1, 2, 3, 4]),
    (dict(keep_layers=[0, 3]), [1, 2, 4, 5]),
    (dict(skip_layers=[2]), [3]),
])
def test_boundary_and_kept_layers_get_their_own_widths(rewritten, kw, compressed):
    """--boundary 0 packs every layer (every row, and genai's head_size, the packed width); other
    boundaries and --keep-layers/--skip-layers give exactly the kept layers raw16 rows."""
    result = rewritten("llama", "turboquant_4bit_nc", **kw)
    assert result.compressed == compressed
    widths = _expected_widths(compressed)
    assert {p.index: p.row_bytes for p in result.layers} == widths
    for name, (_, _, width) in _cache_dims(result.output).items():
        assert width == widths[int(re.search(r"\.(\d+)\.", name)[1])], name
    config = json.loads((result.output.parent / "genai_config.json").read_text())
    assert config["model"]["decoder"]["head_size"] == max(widths.values())
    assert SharedBufferDecoder(result.output, MAX_LENGTH).cache_shapes == {
        f"past_key_values.{i}.{kv}": (2, widths[i]) for i in range(6) for kv in ("key", "value")}


def test_row_widths_need_no_padding():
    """Why the rewrite pads no row: every preset's width is even (the CUDA kernels copy unaligned key
    rows in 2-byte words) and, for the power-of-two head sizes the tensor-core kernels serve, a
    multiple of 4 (their value rows are read in words)."""
    for preset in TQ_PRESETS:
        for d in range(16, 257, 8):
            cfg = TurboQuantConfig.from_cache_dtype(preset, d)
            w = row_width(cfg.key_format, cfg.value_format, d)
            assert w == max(cfg.key_packed_size, cfg.value_packed_size) and w % 2 == 0, (preset, d, w)
            if d in (64, 128, 256):
                assert w % 4 == 0, (preset, d, w)


@pytest.mark.parametrize("preset", list(TQ_PRESETS))
@pytest.mark.parametrize("kw", [{}, dict(boundary=0), dict(keep_layers=[1, 4])])
def test_summary_bytes_per_token_are_the_formats_sum(rewritten, preset, kw):
    """The summary's KV bytes per token (all layers) are K and V of every KV head at each layer's
    row width, against the original's float32 K and V (the plan's alone: the other boundaries
    uncalibrated; the default one's are test_rewritten_model_tracks_the_original's rewrites)."""
    result = rewritten("llama", preset, **(dict(kw, offsets=False) if kw else kw))
    kv_heads, d = 2, 64
    after = sum(2 * kv_heads * (PACKED[preset] if p.compressed else RAW16) for p in result.layers)
    before = 6 * 2 * kv_heads * d * 4
    assert f"{before} bytes before, {after} after, {before / after:.2f}x smaller" in result.summary()


def test_8b_shape_formula(tmp_path):
    """The 8B shape's target arithmetic on a 6-layer model with its KV shape (8 KV heads of 128,
    fp16, turboquant_4bit_nc, 2 + 2 boundary layers): 4 x 4096 + (L - 4) x 8 x 136 bytes per token
    against L x 4096."""
    cfg = random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=8, kv_heads=8, head_dim=128, seed=3, vocab=640)
    src = random_decoders.export_genai(cfg, tmp_path / "fp16", precision="fp16", provider="cuda")  # GQA in fp16: CUDA's graph
    # no calibration: the bytes per token are the plan's alone
    result = export(src, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", progress=False, dry_run=True, offsets=False)
    layers = 6
    before, after = layers * 4096, 4 * 4096 + (layers - 4) * 8 * 136
    assert f"KV cache per token (all layers, batch 1): {before} bytes before, {after} after" in result.summary()
    # the presets table's measure, labelled apart: the compressed layers against fp16 K and V
    assert "compressed layers against fp16 K and V: 8192 bytes per token, 2176 after, 3.76x smaller" in result.summary()
    assert 32 * 4096 / (4 * 4096 + 28 * 8 * 136) == pytest.approx(2.80, abs=0.005)  # the 8B model's: 2.80x


def test_old_genai_gets_one_width(rewritten):
    """With an onnxruntime-genai older than per-layer cache shapes installed, every layer gets the
    widest row, the config's head_size, and the summary says why."""
    result = rewritten("llama", "turboquant_4bit_nc", genai_version="0.13.2")
    assert {p.row_bytes for p in result.layers} == {RAW16} and result.row_bytes == RAW16
    assert {w for _, _, w in _cache_dims(result.output).values()} == {RAW16}
    summary = result.summary()
    assert "onnxruntime-genai 0.13.2 (installed) allocates every layer's cache with one shape" in summary
    assert "the packed layers need only 36 (--boundary 0" in summary
    assert "6144 bytes before, 3072 after, 2.00x smaller" in summary


@pytest.mark.parametrize("version, per_layer", [("0.13.2", False), ("0.9.0", False), ("0.14.0", True),
                                                ("0.15.0.dev1", True), ("0.18.0", True), ("1.0.0", True)])
def test_per_layer_shapes_by_genai_version(version, per_layer):
    assert genai_folder.reads_per_layer_shapes(version)[0] is per_layer
    with mock.patch.object(genai_folder, "installed_version", return_value=version):
        assert genai_folder.reads_per_layer_shapes()[0] is per_layer


def test_installed_genai_version_is_read():
    import onnxruntime_genai as og

    assert genai_folder.installed_version() == og.__version__
    with mock.patch.object(genai_folder, "installed_version", return_value=None):
        per_layer, note = genai_folder.reads_per_layer_shapes()
    assert per_layer and "from 0.14.0" in note
    with pytest.raises(RewriteError, match="cannot read the onnxruntime-genai version 'main'"):
        genai_folder.reads_per_layer_shapes("main")


def test_shared_buffer_is_written_in_place(built, rewritten):
    """Each step writes its token's row in every layer's buffer and leaves every other byte as it was."""
    dec = SharedBufferDecoder(rewritten("llama", "turboquant_3bit_nc").output, MAX_LENGTH)
    ids = np.random.default_rng(5).integers(0, 640, (2, 16))
    cache = dec.empty_cache(2)
    _, cache = dec.step(ids[:, :10], cache, 0)
    for t in range(10, 16):
        before = dec.buffers(cache)
        _, same = dec.step(ids[:, t:t + 1], cache, t)
        assert same is cache
        after = dec.buffers(cache)
        for name in before:
            changed = np.argwhere((before[name] != after[name]).any(-1))
            assert set(changed[:, 2]) == {t}, (name, t)  # only row t, of every sequence and head
            np.testing.assert_array_equal(np.delete(after[name], t, axis=2), np.delete(before[name], t, axis=2))


def _shape(t) -> tuple:
    shape = t.shape  # numpy's attribute, or og.Tensor's method
    return tuple(shape() if callable(shape) else shape)


def _genai_generate(folder, prompt, steps):
    """Greedy tokens of og.Generator over folder, each cache input's shape as genai bound it, and
    genai's log lines."""
    import onnxruntime_genai as og

    logs = []
    og.set_log_options(enabled=True)
    og.set_log_callback(logs.append)
    try:
        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=prompt.shape[1] + steps, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt.astype(np.int32))
        shapes = {f"past_key_values.{i}.{kv}": _shape(gen.get_input(f"past_key_values.{i}.{kv}"))
                  for i in range(6) for kv in ("key", "value")}
        tokens = []
        while not gen.is_done():
            gen.generate_next_token()
            tokens.append(int(gen.get_next_tokens()[0]))
        del gen, params, model  # before the callback goes: genai logs as it frees them
    finally:
        og.set_log_callback(None)
        og.set_log_options(enabled=False)
    return tokens, shapes, logs


@pytest.mark.parametrize("case, kw, compressed", [
    ("boundary 2", {}, [2, 3]),
    ("boundary 0", dict(boundary=0), [0, 1, 2, 3, 4, 5]),
    ("keep 0,3", dict(keep_layers=[0, 3]), [1, 2, 4, 5]),
    ("genai 0.13", dict(genai_version="0.13.2"), None),
])
def test_generates_with_onnxruntime_genai(rewritten, case, kw, compressed):
    """onnxruntime-genai loads the output folder (custom-op library from genai_config.json, uint8
    caches, its own shared buffers), allocates each layer's buffer with the layer's own width (its
    Generator's inputs; its log says so where the widths differ), and generates the same greedy
    tokens as the plain ONNX Runtime loop over the same model, whose buffers have the same shapes."""
    result = rewritten("llama", "turboquant_4bit_nc", **kw)
    widths = _expected_widths(compressed) if compressed is not None else _expected_widths([])
    prompt = np.random.default_rng(11).integers(3, 640, (1, 9))
    steps = 20
    tokens, shapes, logs = _genai_generate(result.output.parent, prompt, steps)
    expected = {f"past_key_values.{i}.{kv}": (1, 2, 9 + steps, widths[i]) for i in range(6) for kv in ("key", "value")}
    assert shapes == expected
    varies = any("Detected per-layer KV shape variation" in line for line in logs)
    assert varies is (len(set(widths.values())) > 1), logs
    dec = SharedBufferDecoder(result.output, 9 + steps)
    assert {n: v.shape() for n, v in dec.empty_cache(1).items()} == {n: list(s) for n, s in expected.items()}
    ours = dec.generate(prompt, max_new_tokens=len(tokens))
    assert tokens and tokens == ours[0].tolist()


def test_refusals(built, tmp_path):
    src = built("llama")
    with pytest.raises(RewriteError, match="needs its own config"):
        export(src, "turboquant_4bit_nc", src.parent / "model.tq.onnx")
    with pytest.raises(RewriteError, match="calibration file"):
        export(src, "turboquant_4bit_nc", tmp_path / "a" / "m.onnx", calibrate=tmp_path / "ids.npy")


def test_cuda_graph_enabled_in_the_folder(built, tmp_path, capsys):
    """--genai-cuda-graph: the output folder's genai_config.json sets the cuda provider's
    enable_cuda_graph, nothing else of it; refused, with exit status 2 from the CLI, for a folder built
    for the CPU, for TensorRT and for a model that is not genai's."""
    from turboquant.export.__main__ import main

    src = random_decoders.export_genai(CONFIGS["llama"], tmp_path / "cuda", precision="fp16", provider="cuda")
    options = lambda r: json.loads((r.output.parent / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    plain = export(src, "turboquant_4bit_nc", tmp_path / "plain" / "model.onnx", offsets=False, progress=False)
    graphs = export(src, "turboquant_4bit_nc", tmp_path / "graphs" / "model.onnx", offsets=False, progress=False,
                    genai_cuda_graph=True)
    assert options(plain)["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]
    assert options(graphs) == {**options(plain), "provider_options": [{"cuda": {"enable_cuda_graph": "1"}}]}
    assert "decode steps replayed from CUDA graphs" in graphs.summary() and "CUDA graphs" not in plain.summary()
    cpu = built("llama")
    with pytest.raises(RewriteError, match=r"genai_config.json runs the decoder on cpu, not on the cuda provider"):
        export(cpu, "turboquant_4bit_nc", tmp_path / "a" / "model.onnx", offsets=False, genai_cuda_graph=True)
    with pytest.raises(RewriteError, match="not --target tensorrt"):
        export(src, "turboquant_4bit_nc", tmp_path / "b" / "model.onnx", target="tensorrt", genai_cuda_graph=True)
    exported = random_decoders.export(CONFIGS["llama"], tmp_path / "ts.onnx", "torchscript")
    assert main([str(exported), "--preset", "turboquant_4bit_nc", "-o", str(tmp_path / "c" / "m.onnx"),
                 "--genai-cuda-graph"]) == 2
    assert f"error: --genai-cuda-graph is for onnxruntime-genai folders, and {exported.parent} has no genai_config.json" \
        in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def _with_qk_output(m: onnx.ModelProto, index: int) -> onnx.ModelProto:
    """The model with GroupQueryAttention node `index`'s QK output (qk_output = 1) as a graph output."""
    node = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"][index]
    node.output.append(f"qk_{index}")
    node.attribute.append(onnx.helper.make_attribute("qk_output", 1))
    m.graph.output.append(onnx.helper.make_tensor_value_info(f"qk_{index}", onnx.TensorProto.FLOAT, None))
    return m


def test_unsupported_features_refused_or_left(built, tmp_path):
    """A node whose QK output is used: refused by default, naming the layer and the feature; with
    unsupported='leave' that layer keeps GroupQueryAttention and no genai config is written."""
    m = _with_qk_output(onnx.load(built("llama")), 2)
    src = tmp_path / "qk" / "model.onnx"
    src.parent.mkdir()
    onnx.save(m, src, save_as_external_data=True, location="model.onnx.data")
    from turboquant.export import self_text

    # refused before the calibration runs the original (minutes on a large model)
    with mock.patch.object(self_text, "self_generated_tokens", side_effect=AssertionError("calibration ran")):
        with pytest.raises(RewriteError, match="layer 2: .*the QK output"):
            export(src, "turboquant_4bit_nc", tmp_path / "out" / "model.onnx")
    # random ids: the model file alone, without genai_config.json, gives the loop that writes text no row size
    result = export(src, "turboquant_4bit_nc", tmp_path / "out" / "model.onnx", unsupported="leave", calibrate="random")
    assert result.left == [2] and result.compressed == [3]
    out = onnx.load(result.output, load_external_data=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in out.graph.node) == 1
    assert "mixes cache dtypes" in result.summary()


def test_cpu_fp16_multi_head_attention_refused_by_name(tmp_path, capsys):
    """genai's builder writes MultiHeadAttention for fp16 on the CPU (caches concatenated outside the
    op, a symbolic head size): refused naming the op and the builds that are rewritten."""
    src = random_decoders.export_genai(CONFIGS["llama"], tmp_path / "fp16cpu", precision="fp16", provider="cpu")
    assert any(n.op_type == "MultiHeadAttention" for n in onnx.load(src, load_external_data=False).graph.node)
    before = _tree(tmp_path)
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "out" / "model.onnx")
    assert_refused(rc, err, "is com.microsoft.MultiHeadAttention, which turboquant does not rewrite")
    assert "-p fp32 or int4 with -e cpu, or -e cuda" in err and _tree(tmp_path) == before


@pytest.mark.parametrize(("precision", "provider", "extra", "message", "works"), [
    ("fp32", "cpu", {"exclude_embeds": "true"}, "has no input_ids input", {"offsets": False}),
    ("fp32", "cpu", {"exclude_lm_head": "true"}, "lacks (onnxruntime-genai's exclude_lm_head", {"calibrate": "random"}),
    ("bf16", "cuda", None, "ONNX Runtime could not run the original model (NotImplemented", {"offsets": False}),
], ids=["exclude_embeds", "exclude_lm_head", "bf16-cuda"])
def test_builds_the_calibration_cannot_run_are_refused_by_reason(tmp_path, capsys, precision, provider, extra, message,
                                                                 works):
    """Builds whose original the calibration cannot run here (no token ids in, no logits out, bf16
    products on the CPU) are refused with the reason and what rewrites them, which then does."""
    src = random_decoders.export_genai(CONFIGS["llama"], tmp_path / "src", precision=precision, provider=provider,
                                       extra=extra)
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "out" / "model.onnx")
    assert_refused(rc, err, message)
    assert not (tmp_path / "out").exists()
    result = export(src, "turboquant_4bit_nc", tmp_path / "out" / "model.onnx", progress=False, **works)
    assert result.compressed == [2, 3]
    # no generator runs these parts alone, nor the CPU provider bf16: the folder's config is what is
    # checked, unless genai runs the bf16 CUDA folder here (a GPU with onnxruntime-genai-cuda)
    config = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    if provider == "cuda" and genai_check.genai_runs_provider(config)[0]:
        assert "checked: onnxruntime-genai loaded the folder and generated" in result.summary()
    else:
        assert "checked: genai_config.json agrees with the model; not run" in result.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_cuda_fp16_model_tracks_the_original_and_the_cpu(cuda_ready, tmp_path, preset):
    """An fp16 model built for CUDA, rewritten with the defaults (calibrated: Lloyd-Max or fp8 key
    scales): on the CUDA provider (ORT's GroupQueryAttention against TQGroupQueryAttention, both
    over shared buffers) the rewrite tracks the original, and its logits agree with the same rewrite
    run on the CPU."""
    src = random_decoders.export_genai(CONFIGS["llama"], tmp_path / "fp16", precision="fp16", provider="cuda")
    with mock.patch.object(genai_folder, "installed_version", return_value="0.18.0"):
        result = export(src, preset, tmp_path / "tq" / "model.onnx", progress=False)
    cuda = ["CUDAExecutionProvider"]
    widths = _expected_widths([2, 3], packed=PACKED[preset])  # per-layer rows: the packed layers' beside raw16's 128
    for dec in (SharedBufferDecoder(result.output, MAX_LENGTH, providers=cuda), SharedBufferDecoder(result.output, MAX_LENGTH)):
        assert {n: v.shape() for n, v in dec.empty_cache(2).items()} == {
            f"past_key_values.{i}.{kv}": [2, 2, MAX_LENGTH, widths[i]] for i in range(6) for kv in ("key", "value")}
    ids = np.random.default_rng(13).integers(0, CONFIGS["llama"].vocab, (2, 12 + STEPS))
    a = SharedBufferDecoder(src, MAX_LENGTH, providers=cuda).teacher_forced(ids, 12).astype(np.float32)
    b = SharedBufferDecoder(result.output, MAX_LENGTH, providers=cuda).teacher_forced(ids, 12).astype(np.float32)
    c = SharedBufferDecoder(result.output, MAX_LENGTH).teacher_forced(ids, 12).astype(np.float32)
    d = SharedBufferDecoder(src, MAX_LENGTH).teacher_forced(ids, 12).astype(np.float32)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=2e-2 * max(1.0, float(np.abs(a[:, 0]).max())))
    kl, top1 = mean_kl(a[:, 1:], b[:, 1:]), float((a[:, 1:].argmax(-1) == b[:, 1:].argmax(-1)).mean())
    # The providers' fp16 projections differ in the last bits (the original's own CPU-CUDA KL), and
    # quantization turns some of those into different codes, so the rewrite's CPU-CUDA difference
    # is larger (H200: 1.3e-4 for the original, 3.1e-3 for the rewrite, top-1 92%; on the CPU alone,
    # +-1 ulp on the attention weights moves the original by KL 4e-4 and the rewrite by 6e-3). It
    # must stay far below what compression itself costs: a wrong past on either side would not.
    floor, ours = mean_kl(d, a), mean_kl(c, b)
    agree = float((c.argmax(-1) == b.argmax(-1)).mean())
    print(f"cuda fp16 {preset}: mean KL {kl:.4f}, top-1 {top1:.1%}; CPU vs CUDA: original KL {floor:.2e}, "
          f"rewrite KL {ours:.2e}, top-1 {agree:.1%}")
    assert top1 >= 0.8 and ours < 0.2 * kl and agree >= 0.85, (kl, top1, floor, ours, agree)


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["steps", "cuda-graph"])
def test_cuda_generates_with_onnxruntime_genai(cuda_ready, tmp_path, graph):
    """onnxruntime-genai's CUDA build (onnxruntime-genai-cuda) runs the rewritten fp16 CUDA folder:
    per-layer buffers on the GPU, and the greedy tokens of the plain ONNX Runtime loop on CUDA; with
    --genai-cuda-graph, its decode steps replayed from CUDA graphs as the folder's config says."""
    import onnxruntime_genai as og

    if not og.is_cuda_available():
        pytest.skip("CUDA test skipped: the installed onnxruntime-genai has no CUDA (install onnxruntime-genai-cuda)")
    src = random_decoders.export_genai(CONFIGS["llama"], tmp_path / "fp16", precision="fp16", provider="cuda")
    result = export(src, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", progress=False, genai_cuda_graph=graph)
    assert [p.row_bytes for p in result.layers] == [RAW16, RAW16, 36, 36, RAW16, RAW16]
    prompt = np.random.default_rng(17).integers(3, 640, (1, 9))
    steps = 20
    tokens, shapes, logs = _genai_generate(result.output.parent, prompt, steps)
    widths = _expected_widths([2, 3])
    assert shapes == {f"past_key_values.{i}.{kv}": (1, 2, 9 + steps, widths[i]) for i in range(6) for kv in ("key", "value")}
    assert any("Detected per-layer KV shape variation" in line for line in logs), logs
    ours = SharedBufferDecoder(result.output, 9 + steps, providers=["CUDAExecutionProvider"]).generate(prompt, len(tokens))
    assert tokens and tokens == ours[0].tolist()


# -- the output folder: never over the user's files, written as a whole, its config checked first -----

def _copy(src, folder):
    """A copy of src's genai folder in `folder`; the model's path there."""
    shutil.copytree(src.parent, folder)
    return folder / src.name


def test_output_folder_files_refused(built, tmp_path, capsys):
    """A folder holding the user's genai_config.json and tokenizer.json (which was overwritten, and
    kept stale), or a folder where the library goes: refused, every file as it was, nothing added."""
    src = built("llama")
    out = tmp_path / "gout3"
    out.mkdir()
    (out / "genai_config.json").write_text('{"mine": 1}')
    (out / "tokenizer.json").write_text("my tokenizer")
    (tmp_path / "gout4" / "libturboquant_ort.so").mkdir(parents=True)
    before = _tree(tmp_path)
    args = ("--preset", "turboquant_4bit_nc", "--no-offsets")
    assert_refused(*run_main(capsys, src, *args, "-o", out / "model.onnx"),
                   f"the onnxruntime-genai folder's file {out / 'tokenizer.json'} exists; turboquant does not overwrite files")
    assert_refused(*run_main(capsys, src, *args, "-o", tmp_path / "gout4" / "model.onnx"),
                   f"file {tmp_path / 'gout4' / 'libturboquant_ort.so'} exists")
    assert _tree(tmp_path) == before
    (out / "tokenizer.json").unlink()
    assert_refused(*run_main(capsys, src, *args, "-o", out / "model.onnx"), f"file {out / 'genai_config.json'} exists")
    assert sorted(p.name for p in out.iterdir()) == ["genai_config.json"]


def test_output_folder_published_as_a_whole(built, tmp_path, monkeypatch):
    """The config's link failing (it comes last): the model, its data, the library and the tokenizer
    files already given their names go again, and so does the folder the save made."""
    import os

    src = built("llama")
    out = tmp_path / "o" / "model.onnx"
    link = os.link

    def refuse_the_config(a, b, *args, **kw):
        if pathlib.Path(b).name == "genai_config.json":
            raise PermissionError(13, "Permission denied")
        link(a, b, *args, **kw)

    monkeypatch.setattr(os, "link", refuse_the_config)
    with pytest.raises(RewriteError, match="Permission denied"):
        export(src, "turboquant_4bit_nc", out, offsets=False, progress=False)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    export(src, "turboquant_4bit_nc", out, offsets=False, progress=False)
    copied = sorted(f.name for f in src.parent.iterdir() if not f.name.startswith(("model.onnx", "genai_config")))
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ["genai_config.json", "libturboquant_ort.so", "model.onnx", "model.onnx.data", *copied])


@pytest.mark.parametrize("text, message", [
    ("{not json", "genai_config.json is not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("{}", "genai_config.json has no model.decoder section"),
    ('{"model": {"decoder": {"session_options": []}}}', "session_options must be an object whose provider_options is a list"),
], ids=["not-json", "empty", "bad-options"])
def test_bad_config_refused_before_any_work(built, tmp_path, capsys, text, message):
    """Read and checked before the calibration runs or anything is saved (a traceback, or a model
    and its data left without a config, before)."""
    src = _copy(built("llama"), tmp_path / "badgenai")
    (src.parent / "genai_config.json").write_text(text)
    assert_refused(*run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "out" / "model.onnx"), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["badgenai"]


def test_missing_library_refused_before_the_save(built, tmp_path, capsys, monkeypatch):
    """The library the folder gets, missing: refused before anything is written (it was raised after
    the model and its data were saved)."""
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "nope.so"))
    rc, err = run_main(capsys, built("llama"), "--preset", "turboquant_4bit_nc", "--no-offsets", "-o", tmp_path / "out" / "model.onnx")
    assert_refused(rc, err, f"TURBOQUANT_ORT_LIBRARY points at {tmp_path / 'nope.so'}, which is not a file")
    assert list(tmp_path.iterdir()) == []


def _windowed_folder(built, tmp_path):
    """genai's llama build with layers 1 and 2 as genai 0.18's builder writes Gemma 3's and gpt-oss's
    windowed layers for the CPU: local_window_size, softcap, a head_sink input and a window-sized
    cache (sliding_window_cache, the `*sliding*` length axis, genai_config.json's sliding_window
    section naming the layers)."""
    src_model = built("llama")
    m = onnx.load(src_model)
    nodes = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    heads = next(a.i for a in nodes[1].attribute if a.name == "num_heads")
    for i in (1, 2):
        node = nodes[i]
        kept = [a for a in node.attribute if a.name not in ("local_window_size", "softcap")]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("local_window_size", 4),
                               onnx.helper.make_attribute("softcap", 20.0),
                               onnx.helper.make_attribute("sliding_window_cache", 1)])
        sink = onnx.numpy_helper.from_array(np.linspace(-1, 1, heads).astype(np.float32), f"sinks_{i}")
        m.graph.initializer.append(sink)
        node.input.extend([""] * (12 - len(node.input)))
        node.input[11] = sink.name
        for v in [*m.graph.input, *m.graph.output]:
            if v.name.startswith((f"past_key_values.{i}.", f"present.{i}.")):
                v.type.tensor_type.shape.dim[2].dim_param = v.type.tensor_type.shape.dim[2].dim_param.replace(
                    "sequence", "sliding")
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(m, src, save_as_external_data=True, location="model.onnx.data")
    config = json.loads((src_model.parent / "genai_config.json").read_text())
    config["model"]["decoder"]["sliding_window"] = {"window_size": 4, "slide_key_value_cache": False,
                                                    "slide_inputs": False, "layers": [1, 2], "cache_slack": 0}
    for f in src_model.parent.iterdir():
        if not f.name.startswith("model.onnx"):
            shutil.copy2(f, src.parent / f.name)
    (src.parent / "genai_config.json").write_text(json.dumps(config))
    return src


def _rewritten_windows(result):
    out = onnx.load(result.output, load_external_data=False)
    tq = [n for n in out.graph.node if n.op_type == "TQGroupQueryAttention"]
    for i in (1, 2):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in tq[i].attribute}
        assert attrs["local_window_size"] == 4 and attrs["softcap"] == 20.0
        assert tq[i].input[11] == f"sinks_{i}" and tq[i].input[12] == f"tq_key_offset_{i}"
    lengths = {v.name: v.type.tensor_type.shape.dim[2].dim_param for v in out.graph.input if "past_key_values" in v.name}
    attrs = {i: {a.name: onnx.helper.get_attribute_value(a) for a in tq[i].attribute} for i in range(len(tq))}
    return out, attrs, lengths


def test_windows_softcap_and_sinks_are_kept_with_window_sized_caches(built, tmp_path):
    """The window, the softcap and the sink (input 11) kept, the calibration's inputs after it, and
    (onnxruntime-genai 0.18 installed, a CPU build) the window-sized caches too: the attribute, the
    `*sliding*` length axis and genai_config.json's sliding_window section, so genai gives those
    layers C = W + 16 rows (clamped to max_length) of the packed width, which its run binds."""
    import onnxruntime_genai as og

    result = export(_windowed_folder(built, tmp_path), "turboquant_4bit_nc", tmp_path / "out" / "model.onnx",
                    boundary=1, calibrate="random", progress=False)
    assert {1, 2} <= set(result.compressed) and not result.left and result.window_cache == [1, 2]
    out, attrs, lengths = _rewritten_windows(result)
    assert [i for i in attrs if attrs[i].get("sliding_window_cache", 0)] == [1, 2]
    assert {n: "sliding" in d for n, d in lengths.items()} == {n: n.startswith(("past_key_values.1.", "past_key_values.2."))
                                                               for n in lengths}, lengths
    decoder = json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["sliding_window"]["layers"] == [1, 2]
    summary = result.summary()
    assert "layers 1-2: window-sized caches (sliding_window_cache) kept" in summary
    assert "checked: onnxruntime-genai loaded the folder and generated 4 tokens" in summary
    # genai's own buffers: the windowed layers' present is [1, kv heads, W + 16, packed width] from the first
    # step on, the others' max_length rows; 40 tokens drive the windowed ones through compactions
    model = og.Model(str(tmp_path / "out"))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=48, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.arange(3, 11, dtype=np.int32)[None])
    while not gen.is_done():
        gen.generate_next_token()
        assert gen.get_output("present.1.key").shape[2:] == (4 + 16, result.layers[1].row_bytes)
        assert gen.get_output("present.0.key").shape[2:] == (48, result.layers[0].row_bytes)
    assert len(gen.get_sequence(0)) == 48


def test_an_older_genai_gets_full_length_caches(built, tmp_path):
    """With onnxruntime-genai older than 0.18 (which does not read the section's layers) the window-sized
    caches become full-length: the attribute dropped, the full layers' length axis, the section
    dropped, and the summary says why."""
    from turboquant.export import genai as genai_folder

    with mock.patch.object(genai_folder, "installed_version", return_value="0.17.0"):
        result = export(_windowed_folder(built, tmp_path), "turboquant_4bit_nc", tmp_path / "out" / "model.onnx",
                        boundary=1, calibrate=False, progress=False, dry_run=True)
    assert result.window_cache == []
    summary = result.summary()
    assert "layers 1-2: window-sized caches (sliding_window_cache) made full-length" in summary
    assert "onnxruntime-genai 0.17.0 (installed) does not allocate them (from 0.18.0)" in summary


def test_which_providers_keep_window_sized_caches():
    """The CPU and CUDA kernels take window-sized caches; a folder for another provider gets full-length
    ones, and the summary says why."""
    from turboquant.export.genai import keeps_window_cache

    section = {"sliding_window": {"window_size": 16, "layers": [0, 2]}}
    assert keeps_window_cache(section, "0.18.0") == (True, None)
    cuda = {**section, "session_options": {"provider_options": [{"cuda": {}}]}}
    assert keeps_window_cache(cuda, "0.18.0") == (True, None)
    dml = {**section, "session_options": {"provider_options": [{"dml": {}}]}}
    kept, why = keeps_window_cache(dml, "0.18.0")
    assert not kept and "runs on dml" in why
    assert keeps_window_cache({"sliding_window": {"window_size": 16, "layers": []}}, "0.18.0") == (False, None)
    # decode steps replayed from CUDA graphs: ONNX Runtime runs the first step more than once
    kept, why = keeps_window_cache(cuda, "0.18.0", cuda_graph=True)
    assert not kept and "CUDA graphs" in why
    graphs = {**section, "session_options": {"provider_options": [{"cuda": {"enable_cuda_graph": "1"}}]}}
    assert not keeps_window_cache(graphs, "0.18.0")[0]


def test_a_cuda_folder_gets_a_cache_slack():
    """CUDA folders' window-sized caches get CUDA_CACHE_SLACK rows beyond the window (genai's CUDA
    default is none, which would move the kept rows at every decode step); a slack the section sets
    is kept."""
    from turboquant.export.genai import CUDA_CACHE_SLACK, widen_cuda_window_cache

    decoder = {"sliding_window": {"window_size": 16, "layers": [0, 2], "cache_slack": 0}}
    assert "cache_slack 64" in widen_cuda_window_cache(decoder)
    assert decoder["sliding_window"]["cache_slack"] == CUDA_CACHE_SLACK == 64
    decoder = {"sliding_window": {"window_size": 16, "layers": [0, 2], "cache_slack": 8}}
    assert widen_cuda_window_cache(decoder) is None and decoder["sliding_window"]["cache_slack"] == 8
