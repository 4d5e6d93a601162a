"""TurboQuant configuration: presets, per-vector byte sizes and boundary-layer selection.

This keeps the seed's (vLLM's) configuration API -- TQ_PRESETS, TurboQuantConfig and its
properties, from_cache_dtype, boundary-layer selection -- but describes an ONNX model instead of
vLLM's ModelConfig: the layer list comes from the rewrite pass (turboquant.export), which knows
which layers own a KV cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

FORMAT_VERSION = 1

# head_dim must be a multiple of 8 (3-bit packing fills whole bytes every 8 coordinates).
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
SUPPORTED_KEY_BITS = (3, 4, 8)  # 3 and 4: Lloyd-Max (MSE) keys; 8: float8 e4m3fn keys
SUPPORTED_VALUE_BITS = (3, 4)

TQ_PRESETS: dict[str, dict] = {
    "turboquant_k8v4": {"key_quant_bits": 8, "value_quant_bits": 4, "norm_correction": False},
    "turboquant_4bit_nc": {"key_quant_bits": 4, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_k3v4_nc": {"key_quant_bits": 3, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_3bit_nc": {"key_quant_bits": 3, "value_quant_bits": 3, "norm_correction": True},
}

# Names of the per-vector formats (docs/design.md section 2), as the ops' `format` attributes spell them.
KEY_FORMATS = ("mse3", "mse4", "fp8")
VALUE_FORMATS = ("uint3", "uint4")
ALL_FORMATS = ("mse3", "mse4", "fp8", "uint3", "uint4", "raw16")


def padded_dim(head_dim: int) -> int:
    """Dp: the next power of two >= head_dim (the Walsh-Hadamard rotation's size)."""
    return 1 << (int(head_dim) - 1).bit_length()


def check_head_dim(head_dim: int) -> int:
    if not isinstance(head_dim, int) or isinstance(head_dim, bool):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim % 8 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"unsupported head_dim {head_dim}: supported are multiples of 8 from {MIN_HEAD_DIM} "
            f"to {MAX_HEAD_DIM} (e.g. 64, 80, 96, 128, 256)"
        )
    return head_dim


def packed_size(fmt: str, head_dim: int) -> int:
    """Bytes of one packed vector of length head_dim in format `fmt`."""
    check_head_dim(head_dim)
    if fmt in ("mse3", "mse4"):
        bits = int(fmt[3])
        return (padded_dim(head_dim) * bits + 7) // 8 + 2  # indices, fp16 scale
    if fmt == "fp8":
        return head_dim
    if fmt in ("uint3", "uint4"):
        bits = int(fmt[4])
        return (head_dim * bits + 7) // 8 + 4  # indices, fp16 scale, fp16 zero
    if fmt == "raw16":
        return 2 * head_dim
    raise ValueError(f"unknown format {fmt!r}: expected one of {', '.join(ALL_FORMATS)}")


@dataclasses.dataclass(frozen=True)
class TurboQuantConfig:
    """How one attention layer's K and V vectors are stored.

    key_quant_bits: 3 or 4 (Walsh-Hadamard rotation + Lloyd-Max codebook) or 8 (float8 e4m3fn).
    value_quant_bits: 3 or 4 (uniform min/max quantization).
    norm_correction: for MSE keys, store n / ||c|| instead of n so that the reconstruction has the
    original norm.
    """

    head_dim: int = 128
    key_quant_bits: int = 4
    value_quant_bits: int = 4
    norm_correction: bool = True

    def __post_init__(self) -> None:
        check_head_dim(self.head_dim)
        if self.key_quant_bits not in SUPPORTED_KEY_BITS:
            raise ValueError(
                f"unsupported key_quant_bits {self.key_quant_bits}: supported are "
                f"{', '.join(map(str, SUPPORTED_KEY_BITS))} (8 means float8 e4m3fn keys)"
            )
        if self.value_quant_bits not in SUPPORTED_VALUE_BITS:
            raise ValueError(
                f"unsupported value_quant_bits {self.value_quant_bits}: supported are "
                f"{', '.join(map(str, SUPPORTED_VALUE_BITS))}"
            )

    # -- the seed's properties --------------------------------------------------------------
    @property
    def key_fp8(self) -> bool:
        return self.key_quant_bits == 8

    @property
    def mse_bits(self) -> int:
        """Bits per rotated key coordinate for MSE keys; 0 when keys are fp8."""
        return 0 if self.key_fp8 else self.key_quant_bits

    @property
    def key_mse_bits(self) -> int:
        return self.mse_bits

    @property
    def centroid_bits(self) -> int:
        """Bits of a codebook index (the Lloyd-Max codebook has 2**centroid_bits entries)."""
        return self.mse_bits

    @property
    def n_centroids(self) -> int:
        return 1 << self.centroid_bits if self.centroid_bits else 0

    @property
    def padded_head_dim(self) -> int:
        return padded_dim(self.head_dim)

    @property
    def key_format(self) -> str:
        return "fp8" if self.key_fp8 else f"mse{self.key_quant_bits}"

    @property
    def value_format(self) -> str:
        return f"uint{self.value_quant_bits}"

    @property
    def key_packed_size(self) -> int:
        return packed_size(self.key_format, self.head_dim)

    @property
    def value_packed_size(self) -> int:
        return packed_size(self.value_format, self.head_dim)

    @property
    def slot_size(self) -> int:
        """Bytes of K and V together for one (token, kv-head)."""
        return self.key_packed_size + self.value_packed_size

    @property
    def slot_size_aligned(self) -> int:
        """slot_size rounded up to 16 bytes, for allocators that keep K and V in one slot."""
        return (self.slot_size + 15) // 16 * 16

    @property
    def compression_ratio(self) -> float:
        """fp16 K+V bytes over packed K+V bytes."""
        return 4 * self.head_dim / self.slot_size

    # -- constructors -----------------------------------------------------------------------
    @staticmethod
    def from_cache_dtype(cache_dtype: str, head_dim: int) -> "TurboQuantConfig":
        """The config of a preset name, e.g. 'turboquant_4bit_nc'."""
        if cache_dtype not in TQ_PRESETS:
            raise ValueError(
                f"unknown TurboQuant preset {cache_dtype!r}: valid presets are {', '.join(TQ_PRESETS)}"
            )
        return TurboQuantConfig(head_dim=head_dim, **TQ_PRESETS[cache_dtype])

    # -- boundary layers --------------------------------------------------------------------
    @staticmethod
    def get_boundary_skip_layers(layers: Sequence["LayerInfo"], n: int = 2) -> list[int]:
        """Indices of the layers left uncompressed: the first and last n full-attention layers.

        `layers` describes every decoder layer of the model in order. A dense model (every layer
        has a KV cache) keeps its first and last n attention layers, n capped at half of them.
        A hybrid model (some layers are linear attention, Mamba or other blocks without a KV cache)
        keeps none: its few attention layers are spread out and all of them are worth compressing.
        """
        if n < 0:
            raise ValueError(f"boundary layer count must be >= 0, got {n}")
        attn = [layer.index for layer in layers if layer.has_kv_cache]
        if not attn:
            raise ValueError("no attention layer with a KV cache could be identified in the model")
        if len(attn) != len(layers):
            return []
        n = min(n, len(attn) // 2)
        if n == 0:
            return []
        return sorted(set(attn[:n] + attn[-n:]))


@dataclasses.dataclass(frozen=True)
class LayerInfo:
    """One decoder layer of an ONNX model, as the rewrite sees it."""

    index: int
    has_kv_cache: bool = True
    head_dim: int | None = None
    num_kv_heads: int | None = None
    kind: str = "attention"  # or e.g. "linear_attention", "mamba" for layers without a KV cache
