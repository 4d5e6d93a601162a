import pytest

from turboquant import TQ_PRESETS, LayerInfo, TurboQuantConfig
from turboquant.config import packed_size, padded_dim

EXPECTED_SLOT = {  # key_packed_size + value_packed_size, from the issue (d = 64, 96, 128, 256)
    "turboquant_k8v4": (100, 148, 196, 388),
    "turboquant_4bit_nc": (70, 118, 134, 262),
    "turboquant_k3v4_nc": (62, 102, 118, 230),
    "turboquant_3bit_nc": (54, 90, 102, 198),
}


@pytest.mark.parametrize("preset", list(EXPECTED_SLOT))
def test_slot_sizes(preset):
    got = tuple(
        TurboQuantConfig.from_cache_dtype(preset, d).key_packed_size + TurboQuantConfig.from_cache_dtype(preset, d).value_packed_size
        for d in (64, 96, 128, 256)
    )
    assert got == EXPECTED_SLOT[preset]
    assert TurboQuantConfig.from_cache_dtype(preset, 128).slot_size == EXPECTED_SLOT[preset][2]


def test_presets_match_design_table():
    assert set(TQ_PRESETS) == set(EXPECTED_SLOT)
    c = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 128)
    assert (c.key_fp8, c.mse_bits, c.n_centroids, c.key_format, c.value_format) == (True, 0, 0, "fp8", "uint4")
    assert not c.norm_correction
    c = TurboQuantConfig.from_cache_dtype("turboquant_k3v4_nc", 128)
    assert (c.key_fp8, c.mse_bits, c.key_mse_bits, c.centroid_bits, c.n_centroids) == (False, 3, 3, 3, 8)
    assert c.norm_correction and c.value_quant_bits == 4
    assert TurboQuantConfig.from_cache_dtype("turboquant_3bit_nc", 128).value_format == "uint3"
    ratios = [round(TurboQuantConfig.from_cache_dtype(p, 128).compression_ratio, 2) for p in EXPECTED_SLOT]
    assert ratios == [2.61, 3.82, 4.34, 5.02]


def test_slot_size_aligned():
    c = TurboQuantConfig.from_cache_dtype("turboquant_4bit_nc", 128)
    assert c.slot_size_aligned % 16 == 0 and 0 <= c.slot_size_aligned - c.slot_size < 16


def test_mse_keys_use_padded_dim():
    assert padded_dim(96) == 128 and padded_dim(80) == 128 and padded_dim(128) == 128
    assert packed_size("mse4", 96) == packed_size("mse4", 128) == 66
    assert packed_size("mse3", 80) == 50
    assert packed_size("uint4", 80) == 44 and packed_size("fp8", 80) == 80 and packed_size("raw16", 80) == 160


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        TurboQuantConfig.from_cache_dtype("turboquant_2bit", 128)
    for name in TQ_PRESETS:
        assert name in str(e.value)


@pytest.mark.parametrize("head_dim", [0, 8, 12, 100, 264, 512])
def test_unsupported_head_dim(head_dim):
    with pytest.raises(ValueError, match="multiples of 8 from 16 to 256"):
        TurboQuantConfig(head_dim=head_dim)


def test_unsupported_bits():
    with pytest.raises(ValueError, match="supported are 3, 4, 8"):
        TurboQuantConfig(key_quant_bits=2)
    with pytest.raises(ValueError, match="supported are 3, 4"):
        TurboQuantConfig(value_quant_bits=8)


def test_unknown_format():
    with pytest.raises(ValueError, match="mse3, mse4, fp8, uint3, uint4, raw16"):
        packed_size("int4", 128)


def dense(n):
    return [LayerInfo(i) for i in range(n)]


@pytest.mark.parametrize(
    "n_layers, n, expected",
    [(12, 2, [0, 1, 10, 11]), (4, 2, [0, 1, 2, 3]), (3, 2, [0, 2]), (2, 2, [0, 1]), (1, 2, []), (12, 0, []), (12, 1, [0, 11])],
)
def test_boundary_layers_dense(n_layers, n, expected):
    assert TurboQuantConfig.get_boundary_skip_layers(dense(n_layers), n) == expected


def test_boundary_layers_hybrid_gets_none():
    layers = [LayerInfo(i, has_kv_cache=(i % 4 == 3), kind="attention" if i % 4 == 3 else "linear_attention") for i in range(12)]
    assert TurboQuantConfig.get_boundary_skip_layers(layers) == []


def test_boundary_layers_need_attention():
    with pytest.raises(ValueError, match="no attention layer"):
        TurboQuantConfig.get_boundary_skip_layers([LayerInfo(0, has_kv_cache=False, kind="mamba")])
    with pytest.raises(ValueError, match="no attention layer"):
        TurboQuantConfig.get_boundary_skip_layers([])
