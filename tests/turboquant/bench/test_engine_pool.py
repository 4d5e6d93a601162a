"""engine_pool: a paged folder's bytes per token (blocks and per-token scales), the pool genai_config
asks for, and the requests a pool of given bytes holds; folders that are not paged models refused."""

import pytest

from turboquant.bench.engine_pool import PoolError, read_layout

from .engine_folders import paged_folder


def test_fp16_blocks(tmp_path):
    layout = read_layout(paged_folder(tmp_path / "f", layers=3, heads=2, head_dim=64, block_size=16))
    assert layout.bytes_per_token == 3 * 2 * 2 * 64 * 2  # layers x (K, V) x heads x head_dim x fp16
    assert layout.block_bytes == 16 * layout.bytes_per_token
    assert layout.config_pool_bytes == 64 * layout.block_bytes
    assert layout.cache == "float16, not quantized" and layout.max_batch_size == 8


def test_int4_blocks_count_their_scales(tmp_path):
    layout = read_layout(paged_folder(tmp_path / "q", layers=3, heads=2, head_dim=64, int4=True))
    assert layout.bytes_per_token == 3 * 2 * (2 * 32 + 2 * 2)  # packed nibbles + one fp16 scale per head
    assert layout.cache == "int4 per token, Hadamard"


def test_int8_per_token(tmp_path):
    layout = read_layout(paged_folder(tmp_path / "q", layers=3, heads=2, head_dim=64, int8=True))
    assert layout.bytes_per_token == 3 * 2 * (2 * 64 + 2 * 2) and layout.cache == "int8 per token"


def test_the_3b_anchor_shape(tmp_path):
    """Llama-3.2-3B's caches (28 layers, 8 KV heads of 128) in blocks of 256, 40 GB pools: requests of
    4096 and 32768 tokens (+ 32 new) each format holds."""
    fits = {}
    for kind in ("fp16", "int8", "int4"):
        layout = read_layout(paged_folder(tmp_path / kind, layers=28, heads=8, head_dim=128, block_size=256,
                                          int4=kind == "int4", int8=kind == "int8"))
        fits[kind] = [layout.fits(40 * 10**9, s, 32) for s in (4096, 32768)]
    assert fits == {"fp16": [80, 10], "int8": [157, 20], "int4": [310, 40]}


def test_requests_in_a_pool(tmp_path):
    layout = read_layout(paged_folder(tmp_path / "f", block_size=16))
    pool = 100 * layout.block_bytes + layout.block_bytes - 1  # a part block holds nothing
    assert layout.blocks_in(pool) == 100
    assert layout.blocks_per_request(32, 0) == 2 and layout.blocks_per_request(32, 1) == 3
    assert layout.fits(pool, 40, 8) == 33  # 3 blocks a request
    assert layout.fits(pool, 1600, 0) == 1 and layout.fits(pool, 1600, 1) == 0


def test_utilization_instead_of_blocks(tmp_path):
    layout = read_layout(paged_folder(tmp_path / "f", dynamic={"block_size": 256, "gpu_utilization_factor": 0.6}))
    assert layout.num_blocks is None and layout.config_pool_bytes is None and layout.utilization == 0.6


@pytest.mark.parametrize("make, message", [
    (lambda p: p, "no such folder"),
    (lambda p: (p.mkdir(), p)[1], "no genai_config.json"),
    (lambda p: paged_folder(p, engine=False), "not a paged model: genai_config.json has no engine.dynamic_batching"),
    (lambda p: (paged_folder(p), (p / "model.onnx").unlink(), p)[2], "names model.onnx, which is not there"),
    (lambda p: (p.mkdir(), (p / "genai_config.json").write_text("{"), p)[2], "not a readable genai_config.json"),
])
def test_refused(tmp_path, make, message):
    with pytest.raises(PoolError, match=message):
        read_layout(make(tmp_path / "m"))


def test_a_graph_without_paged_attention_refused(tmp_path):
    folder = paged_folder(tmp_path / "m")
    import onnx

    model = onnx.load(str(folder / "model.onnx"))
    model.graph.node[0].op_type = "GroupQueryAttention"
    onnx.save(model, str(folder / "model.onnx"))
    with pytest.raises(PoolError, match="has no PagedAttention node"):
        read_layout(folder)
