"""The rewrite of paged onnxruntime-genai folders (com.microsoft PagedAttention, built for the
continuous-batching Engine by genai's own builder from a small random Llama config) to
TQPagedAttention: the graph, genai_config.json, and runs of the Engine's loop
(turboquant.paged_decoder) against the GroupQueryAttention twin rewritten with the same preset,
and of og.Engine itself."""

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from turboquant import TQ_PRESETS, random_decoders
from turboquant.config import TurboQuantConfig, packed_size
from turboquant.export import RewriteError, export
from turboquant.export.paged import check_width, heads_per_node, pool_bytes, pool_width
from turboquant.export.paged_twin import gqa_twin
from turboquant.export.plan import LayerPlan, RewriteResult
from turboquant.paged_decoder import PagedDecoder
from turboquant.shared_buffer import SharedBufferDecoder

from .cli_helpers import assert_refused, run_main, tree

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")

# Hkv 4 and head size 32: a raw16 row (64 bytes) is wider than every preset's packed one, so the
# boundary layers split (g = floor(4 * W / 64) KV heads per node: 1 or 2)
CONFIG = random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=8, kv_heads=4, head_dim=32, seed=3, vocab=640)
D, HKV = 32, 4
PROMPTS = [9, 21, 5]  # three requests of different lengths; the third joins two steps later
JOINS = [0, 0, 2]
NEW = 8
BLOCK = 16  # the requests cross blocks


def width(preset):
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    return max(packed_size(cfg.key_format, D), packed_size(cfg.value_format, D))


# W with the 2 + 2 boundary layers (raw16 rows of 64 bytes): the width of the fewest pool bytes a
# token over 2 packed layers and 4 boundary layers of ceil(4 / g) pool pairs, g = floor(4 W / 64):
# packed widths 20 (4bit_nc, k3v4_nc) take 2 + 4 x 4 pairs of 20 (360 bytes), where 32 takes 2 + 4 x 2 (320);
# k8v4's 32 is already that; 3bit_nc's 16 takes 2 + 4 x 4 pairs of 16 (288).
BOUNDARY_WIDTH = {"turboquant_k8v4": 32, "turboquant_4bit_nc": 32, "turboquant_k3v4_nc": 32, "turboquant_3bit_nc": 16}


@pytest.fixture(scope="module")
def built(module_tmp):
    return random_decoders.export_genai(CONFIG, module_tmp.mktemp("paged"), precision="fp16", provider="cuda",
                                        extra={"use_paged_attention": "true"})


@pytest.fixture(scope="module")
def twin(built, module_tmp):
    """The GroupQueryAttention twin of the paged model (same weights), a file of its own."""
    path = module_tmp.mktemp("twin") / "model.onnx"
    ir.save(gqa_twin(ir.load(built)), path, external_data="model.onnx.data")
    return path


@pytest.fixture(scope="module")
def rewritten(built, module_tmp):
    cache = {}

    def get(preset, boundary, **kw):
        key = (preset, boundary, tuple(sorted(kw.items())))
        if key not in cache:
            out = module_tmp.mktemp("tq") / "model.onnx"
            cache[key] = export(built, preset, out, boundary=boundary, progress=False, **kw)
        return cache[key]

    return get


def _prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, CONFIG.vocab, n) for n in PROMPTS]


def test_builder_writes_paged_attention(built):
    """What genai 0.18's builder writes for the Engine (what the rewrite maps): packed QKV, the pools
    [num_blocks, block_size, Hkv, D], attention_metadata as input 16, no slot_mapping, no Q/K norm."""
    m = onnx.load(built, load_external_data=False)
    nodes = [n for n in m.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == 6 and all(len(n.input) == 17 and n.input[1] == "" and n.input[16] == "attention_metadata"
                                   and not any(n.input[10:16]) for n in nodes)
    pools = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in m.graph.input
             if i.name.startswith("past_key_values")}
    assert pools["past_key_values.0.key"] == ["num_blocks", "block_size", HKV, D]


@pytest.mark.parametrize("boundary", [0, 2])
@pytest.mark.parametrize("preset", list(TQ_PRESETS))
def test_rewritten_folder(built, twin, rewritten, tmp_path, preset, boundary):
    """Every pool uint8 [., ., Hkv, W] with one W (the packed layers' widest format, or wider where that
    takes fewer bytes with the boundary layers), boundary layers split over ceil(Hkv / g) pool pairs; genai_config.json counts every pair; the graph passes the
    checker with turboquant's schemas; and the Engine's loop on the rewrite gives, for three
    concurrent requests of different lengths, the greedy tokens and logits of the GroupQueryAttention
    twin rewritten with the same preset (its boundary layers unsplit raw16) run one request at a time."""
    result = rewritten(preset, boundary, offsets=False)
    w = BOUNDARY_WIDTH[preset] if boundary else width(preset)
    g = HKV * w // (2 * D)
    n = -(-HKV // g)
    kept = [0, 1, 4, 5] if boundary else []
    pairs = 6 + len(kept) * (n - 1)
    assert result.row_bytes == w and result.pool_pairs == pairs and result.kept == kept
    m = onnx.load(result.output)
    _check_nodes(m)
    assert {n.op_type for n in m.graph.node} & {"PagedAttention", "TQPagedAttention"} == {"TQPagedAttention"}
    pools = [i for i in m.graph.input if i.name.startswith("past_key_values")]
    assert len(pools) == 2 * pairs and "attention_metadata" not in {i.name for i in m.graph.input}
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.UINT8
               and [d.dim_value for d in i.type.tensor_type.shape.dim][2:] == [HKV, w] for i in pools)
    decoder = json.loads((result.output.parent / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["head_size"] == w and decoder["num_hidden_layers"] == pairs
    assert decoder["state_groups"][0]["layer_ids"] == list(range(pairs))
    assert decoder["session_options"]["custom_ops_library"] in {p.name for p in result.output.parent.iterdir()}

    reference = export(twin, preset, tmp_path / "twin.onnx", boundary=boundary, offsets=False, progress=False)
    wanted = [_twin_run(reference.output, prompt) for prompt in _prompts()]
    # blocks of 64 rows: no request crosses one, and every logit is the twin's bit for bit
    _, logits = PagedDecoder(result.output, num_blocks=6, block_size=64).generate(
        _prompts(), NEW, joins=JOINS, keep_logits=True)
    for rows, (_, want_logits) in zip(logits, wanted):
        np.testing.assert_array_equal(rows, want_logits)
    # blocks of 16: the kernel's runs of rows end at each block's end, which sums the 21-token
    # request's scores in another order than over a contiguous cache (fp16 roundings apart, grown
    # over the layers)
    tokens, logits = PagedDecoder(result.output, num_blocks=12, block_size=BLOCK).generate(
        _prompts(), NEW, joins=JOINS, keep_logits=True)
    for got, rows, (want, want_logits) in zip(tokens, logits, wanted):
        assert got == want
        np.testing.assert_allclose(rows, want_logits, atol=1e-2 * max(1.0, float(np.abs(want_logits).max())))


def _check_nodes(m):
    """The nodes the rewrite wrote pass the checker against their schemas (turboquant's registered by
    turboquant.onnx_ops); the builder's contrib ops (SimplifiedLayerNormalization in the default
    domain) have no schema onnx knows, so the model as a whole is not checked."""
    import turboquant.onnx_ops  # noqa: F401 - the schemas registered

    ctx = onnx.checker.C.CheckerContext()
    ctx.ir_version = m.ir_version
    ctx.opset_imports = {o.domain: o.version for o in m.opset_import}
    written = [n for n in m.graph.node if "/turboquant" in n.name]
    assert written
    for n in written:
        onnx.checker.check_node(n, ctx)


def _twin_run(path, prompt):
    """Greedy tokens and each step's last logits row of one request through the twin (shared buffers)."""
    dec = SharedBufferDecoder(path, len(prompt) + NEW)
    cache = dec.empty_cache(1)
    ids, rows, tokens = np.asarray(prompt)[None], [], []
    logits, cache = dec.step(ids, cache, 0)
    for t in range(NEW):
        row = np.asarray(logits[0, -1], np.float32)
        rows.append(row)
        tokens.append(int(row.argmax()))
        if t + 1 < NEW:
            logits, cache = dec.step(np.array([[tokens[-1]]]), cache, len(prompt) + t)
    return tokens, np.stack(rows)


def test_summary_counts_split_pools(rewritten, capsys):
    """The bytes per token the summary prints count every pool pair of a split boundary layer."""
    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    w = BOUNDARY_WIDTH["turboquant_4bit_nc"]  # 32: g = 2, 2 pool pairs per boundary layer
    after = 2 * 2 * HKV * w + 4 * 2 * 2 * HKV * w
    assert f"{6 * 2 * HKV * D * 2} bytes before, {after} after" in result.summary()


def test_summary_at_the_3b_shape():
    """28 layers, Hkv 8, D 128, 4bit_nc (W 68), 2 + 2 boundary layers split in 4 pool pairs of 2 KV heads:
    24 * 2 * 8 * 68 + 4 * 4 * 2 * 8 * 68 bytes per token against fp16's 28 * 2 * 8 * 256, 2.64x."""
    plans = []
    for i in range(28):
        kept = i < 2 or i >= 26
        p = LayerPlan(i, not kept, "PagedAttention", "raw16" if kept else "mse4", "raw16" if kept else "uint4", 8, 128, 2,
                      row_bytes=68)
        p.pools = -(-8 // heads_per_node(p, 68)) if kept else 1
        plans.append(p)
    assert [p.pools for p in plans if not p.compressed] == [4] * 4
    summary = RewriteResult("turboquant_4bit_nc", plans, None).summary()
    assert f"{28 * 2 * 8 * 256} bytes before, {24 * 2 * 8 * 68 + 4 * 4 * 2 * 8 * 68} after, 2.64x smaller" in summary
    assert pool_width(plans) == 68


def test_pool_width_at_the_3b_shape():
    """3bit_nc's packed 52 bytes would hold one raw16 row (256 bytes) per slot of 8 x 52, eight pool pairs a
    boundary layer (46592 bytes a token, 2.46x); 64 holds two, four pairs (40960, 2.80x), 96 three (3 pairs,
    55296) and 128 four (2 pairs, 65536)."""
    plans = [LayerPlan(i, not (i < 2 or i >= 26), "PagedAttention", "raw16" if i < 2 or i >= 26 else "mse3",
                       "raw16" if i < 2 or i >= 26 else "uint3", 8, 128, 2) for i in range(28)]
    assert pool_width(plans) == 64
    assert {w: 2 * pool_bytes(plans, w) for w in (52, 64, 96, 128)} == {52: 46592, 64: 40960, 96: 55296, 128: 65536}


def test_one_width_no_smaller_than_the_original_is_refused():
    """One KV head of 128: a raw16 row needs the pools' slot as wide as the original cache's row, so the
    packed layers save nothing; refused, suggesting --boundary 0. Two KV heads: one raw16 row a slot of
    2 x 128 bytes, 3.5x smaller than the original."""
    def plans(hkv):
        return [LayerPlan(i, i not in (0, 7), "PagedAttention", "raw16" if i in (0, 7) else "mse4",
                          "raw16" if i in (0, 7) else "uint4", hkv, 128, 2) for i in range(8)]

    assert pool_width(plans(1)) == 256 and pool_bytes(plans(1), 256) == 8 * 256
    with pytest.raises(RewriteError, match=r"no less memory than the original cache; rewrite with --boundary 0"):
        check_width(plans(1))
    assert pool_width(plans(2)) == 128 and pool_bytes(plans(2), 128) == 2 * 128 * (6 + 2 * 2)
    check_width(plans(2))


def test_engine_bench_sizes_the_pools(rewritten):
    """bench engine's pool layout of the rewritten folder: every pool pair's bytes per token, as the summary counts them."""
    from turboquant.bench.engine_pool import read_layout

    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    layout = read_layout(result.output.parent)
    assert layout.layers == result.pool_pairs and layout.bytes_per_token == sum(p.bytes_after for p in result.layers)
    assert layout.cache == "turboquant mse4/uint4 (uint8 rows)"


def test_calibrated_rewrite(rewritten):
    """The calibration runs the GroupQueryAttention twin: the compressed layers get key_offset and key_scale."""
    result = rewritten("turboquant_4bit_nc", 2, calibrate="random")
    m = onnx.load(result.output, load_external_data=False)
    calibrated = [n for n in m.graph.node if n.op_type == "TQPagedAttention" and len(n.input) > 11]
    assert sorted(n.name.split("/")[2] for n in calibrated) == ["layers.2", "layers.3"]
    assert all(n.input[11] and n.input[13] for n in calibrated)
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["turboquant.calibration"] != "none" and meta["turboquant.pool_pairs"] == str(result.pool_pairs)
    tokens = PagedDecoder(result.output, num_blocks=12, block_size=BLOCK).generate(_prompts(), NEW, joins=JOINS)
    assert all(len(t) == NEW for t in tokens)


def _engine_tokens(folder, device):
    from turboquant.bench.engine import open_engine, serve

    overlay = {"engine": {"dynamic_batching": {"num_blocks": 12, "block_size": BLOCK, "max_batch_size": 4}}}
    _, engine = open_engine(str(folder), device, overlay)
    times, _, _, cut = serve(engine, [p.astype(np.int32) for p in _prompts()], NEW)
    assert cut is None and all(t.error is None for t in times)
    return [t.ids for t in times]


def test_og_engine_runs_the_folder_on_the_cpu(rewritten):
    """onnxruntime-genai's Engine serves the rewritten folder unchanged (turboquant's CPU kernel):
    every pool pair allocated, fed and bound, and the greedy tokens of the reference loop."""
    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    want = PagedDecoder(result.output, num_blocks=12, block_size=BLOCK).generate(_prompts(), NEW)
    assert _engine_tokens(result.output.parent, "cpu") == want


def test_engine_bench_serves_more_requests_than_the_pool_holds(rewritten):
    """bench engine's serve over a pool of 6 blocks, which holds two of the requests (29 tokens each:
    2 blocks of 16): all five finish with every token, each closed as its turn ends so that the queued
    ones get its blocks (a finished turn keeps them until its request is closed)."""
    from turboquant.bench.engine import open_engine, serve

    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    overlay = {"engine": {"dynamic_batching": {"num_blocks": 6, "block_size": BLOCK, "max_batch_size": 4}}}
    _, engine = open_engine(str(result.output.parent), "cpu", overlay)
    rng = np.random.default_rng(6)
    times, peak, _, cut = serve(engine, [rng.integers(3, CONFIG.vocab, 21).astype(np.int32) for _ in range(5)], NEW,
                                budget=30)
    assert cut is None and all(t.error is None and t.tokens == NEW for t in times)
    assert peak <= 3


def test_folder_check_through_the_engine(built, rewritten):
    """The rewrite's folder check where genai runs the folder's provider: og.Engine itself serves two
    requests (here on the CPU); a folder it cannot serve gets the Engine's error (the original, whose
    PagedAttention has no CPU kernel)."""
    from turboquant.export import genai_check

    import onnxruntime_genai as og

    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    assert genai_check.run_engine(result.output.parent, "cpu") is None
    if not og.is_cuda_available():  # (onnxruntime-genai-cuda answered otherwise for the original on the H100)
        assert "Could not find an implementation for PagedAttention" in genai_check.run_engine(built.parent, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_og_engine_on_cuda_matches_the_reference_loop(cuda_ready, rewritten, preset):
    """og.Engine (onnxruntime-genai-cuda) serves the rewritten fp16 folder on the GPU (TQPagedAttention's
    CUDA kernels) with three concurrent requests: its greedy tokens are the reference loop's on the same
    device. (The CPU's differ where an fp16 model's near-tie falls the other way; the op's CUDA kernels
    are checked against the CPU's in tests/plugins/onnxruntime/test_tq_paged.py.)"""
    import onnxruntime_genai as og

    if not og.is_cuda_available():
        pytest.skip("CUDA test skipped: the installed onnxruntime-genai has no CUDA (install onnxruntime-genai-cuda)")
    result = rewritten(preset, 2)
    want = PagedDecoder(result.output, num_blocks=12, block_size=BLOCK,
                        providers=["CUDAExecutionProvider"]).generate(_prompts(), NEW)
    assert _engine_tokens(result.output.parent, "cuda") == want


def test_boundary_split_needs_a_row(built):
    """g = 0 (a raw16 row wider than a slot's Hkv * W bytes) is refused, suggesting --boundary 0."""
    plan = LayerPlan(0, False, None, "raw16", "raw16", 1, 128, 2)
    with pytest.raises(RewriteError, match=r"less than one row; rewrite with --boundary 0"):
        heads_per_node(plan, 68)
    assert heads_per_node(LayerPlan(0, False, None, "raw16", "raw16", 8, 128, 2), 68) == 4 // 2 * 1


@pytest.mark.parametrize("what, edit, message", [
    ("slot_mapping", lambda m, n: _add_input(m, n, 10, "slot_mapping", onnx.TensorProto.INT32), "input slot_mapping"),
    ("k_scale", lambda m, n: _add_input(m, n, 14, "k_scale", onnx.TensorProto.FLOAT), "uses quantized pools (the builder's kv_cache_quant_scheme: input k_scale"),
    ("k_quant_type", lambda m, n: n.attribute.append(onnx.helper.make_attribute("k_quant_type", "PER_CHANNEL")),
     "quantized pools (the builder's kv_cache_quant_scheme: k_quant_type=PER_CHANNEL"),
])
def test_refusals_by_name(built, tmp_path, capsys, what, edit, message):
    m = onnx.load(built)
    node = next(n for n in m.graph.node if n.op_type == "PagedAttention")
    edit(m, node)
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    onnx.save(m, src, save_as_external_data=True, location="model.onnx.data")
    (src.parent / "genai_config.json").write_text((built.parent / "genai_config.json").read_text())
    before = tree(tmp_path)
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "-o", tmp_path / "out" / "model.onnx")
    assert_refused(rc, err, message)
    assert "TQPagedAttention does not take" in err and tree(tmp_path) == before


def _add_input(m, node, index, name, elem):
    m.graph.input.append(onnx.helper.make_tensor_value_info(name, elem, [4]))
    while len(node.input) <= index:
        node.input.append("")
    node.input[index] = name


def test_qwen2_folder(tmp_path):
    """A second architecture the builder makes paged (Qwen2: biases after the QKV projection): the
    rewrite with a boundary layer split runs as the twin's rewrite does."""
    cfg = random_decoders.TinyConfig(family="qwen2", layers=4, hidden=256, heads=8, kv_heads=4, head_dim=32, seed=4,
                                     vocab=640)
    src = random_decoders.export_genai(cfg, tmp_path / "qwen2", precision="fp16", provider="cuda",
                                       extra={"use_paged_attention": "true"})
    result = export(src, "turboquant_k8v4", tmp_path / "tq" / "model.onnx", boundary=1, offsets=False, progress=False)
    assert result.kept == [0, 3] and result.pool_pairs == 6  # k8v4's W = 32: 2 KV heads per raw16 node
    twin = tmp_path / "twin" / "model.onnx"
    twin.parent.mkdir()
    ir.save(gqa_twin(ir.load(src)), twin, external_data="model.onnx.data")
    reference = export(twin, "turboquant_k8v4", tmp_path / "twin.tq.onnx", boundary=1, offsets=False, progress=False)
    tokens = PagedDecoder(result.output, num_blocks=12, block_size=BLOCK).generate(_prompts(), NEW, joins=JOINS)
    assert tokens == [_twin_run(reference.output, p)[0] for p in _prompts()]


def test_kv_cache_quant_scheme_folder_refused(tmp_path, capsys):
    """A folder whose pools the builder quantized (kv_cache_quant_scheme=int8_per_token) is refused by
    name, exit status 2, nothing written."""
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=256, heads=8, kv_heads=4, head_dim=32, seed=5,
                                     vocab=640)
    src = random_decoders.export_genai(cfg, tmp_path / "int8", precision="fp16", provider="cuda",
                                       extra={"use_paged_attention": "true", "kv_cache_quant_scheme": "int8_per_token"})
    before = tree(tmp_path)
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "--boundary", "0", "-o", tmp_path / "out" / "model.onnx")
    assert_refused(rc, err, "uses quantized pools (the builder's kv_cache_quant_scheme: 19 inputs, k_quant_type=PER_TOKEN")
    assert tree(tmp_path) == before


def test_reference_loop_reuses_freed_blocks(rewritten):
    """The Engine's loop gives a request's blocks back when it ends: a later request in the same block
    (holding the earlier one's rows) gets the tokens it gets alone; a pool too small is named."""
    result = rewritten("turboquant_4bit_nc", 2, offsets=False)
    a, b = _prompts()[0], _prompts()[1][:9]  # 9 + 7 tokens cached each: one block of 16
    alone = PagedDecoder(result.output, num_blocks=1, block_size=BLOCK).generate([b], NEW)
    after = PagedDecoder(result.output, num_blocks=1, block_size=BLOCK).generate([a, b], NEW, joins=[0, NEW])
    assert after[1] == alone[0]
    with pytest.raises(RuntimeError, match="the pool's 1 blocks of 16 are all taken"):
        PagedDecoder(result.output, num_blocks=1, block_size=BLOCK).generate([a, b], NEW)
