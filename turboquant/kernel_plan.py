"""Which CUDA kernels serve a TQAttention / TQGroupQueryAttention call.

`plan_split` asks the custom-op library's planner (host code, present in every build, so it answers
on machines without a GPU) which split-KV kernel attends the past for given shapes and device
properties; `last_split_kernel` names the one the process's latest CUDA attention call ran. Kernel
names: "tc_bulk" (the tensor-core kernel of ops/cuda/attention_tc.cu), "tc_mma" (attention_mma.cu),
"cuda_core" (attention_split.cu's split kernel), "tc_chunk" (past_chunk.cu), "tc_chunk_wgmma"
(past_chunk_sm90.cu: chosen only where TURBOQUANT_CHUNK_WGMMA=1 until measured on the GPU),
"dense_prefill" (dense_past.cu: a chunk over its past decoded dense, on the prefill kernel) and "none"
(no past or no query rows: no split kernel). `plan_prefill` and `last_prefill_kernel` do the same for the kernel
that attends a call's new tokens when it has several query rows (a first prompt, a continuation
chunk): "wgmma" (ops/cuda/prefill_sm90.cu, Hopper's warpgroup products; head sizes 64 and 128),
"mma" (prefill.cu; head sizes 64, 128 and 256) or "none" (the finish kernel attends each row).
`cpu_instruction_set` names the copy of the CPU kernels in use.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

from ._libs import ort_library_path
from .config import ALL_FORMATS

KERNELS = ("tc_bulk", "tc_mma", "cuda_core", "tc_chunk", "tc_chunk_wgmma", "dense_prefill", "none")
PREFILL_KERNELS = ("wgmma", "mma", "none")
DTYPES = ("float32", "float16", "bfloat16")
MASKS = (None, "bool", "float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Device:
    """What the planner needs of a GPU."""

    sms: int
    smem_optin: int  # bytes of shared memory a block may opt in to
    cc_major: int
    cc_minor: int = 0
    sm90a: bool = False  # the custom-op library holds sm_90a kernels this device runs


H200 = Device(sms=132, smem_optin=232448, cc_major=9, sm90a=True)  # sm_90: 227 KiB per block
A100 = Device(sms=108, smem_optin=166912, cc_major=8)  # sm_80: 163 KiB
L4 = Device(sms=58, smem_optin=101376, cc_major=8, cc_minor=9)  # sm_89: 99 KiB


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    kernel: str
    splits: int
    split_len: int
    rows_per_block: int
    row_blocks: int
    warps: int  # tc_bulk's warps per block, else 0
    smem: int  # dynamic shared memory of the split launch, bytes
    workspace: int  # bytes of partial results
    new_part: bool  # a call over a past whose new tokens' part prefill.cu writes on tensor cores (a continuation chunk)
    new_part_offset: int  # where that part starts in the workspace, bytes


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(ort_library_path())
    lib.turboquant_split_plan.restype = ctypes.c_char_p
    lib.turboquant_split_plan.argtypes = [ctypes.c_char_p] * 4 + [ctypes.POINTER(ctypes.c_int64)] * 3
    lib.turboquant_last_split_kernel.restype = ctypes.c_char_p
    lib.turboquant_last_split_kernel.argtypes = []
    lib.turboquant_prefill_plan.restype = ctypes.c_char_p
    lib.turboquant_prefill_plan.argtypes = [ctypes.c_char_p] * 2 + [ctypes.POINTER(ctypes.c_int64)] * 2
    lib.turboquant_last_prefill_kernel.restype = ctypes.c_char_p
    lib.turboquant_last_prefill_kernel.argtypes = []
    lib.turboquant_sm90a_compiled.restype = ctypes.c_int
    lib.turboquant_sm90a_compiled.argtypes = []
    lib.turboquant_cpu_instruction_set.restype = ctypes.c_char_p
    lib.turboquant_cpu_instruction_set.argtypes = []
    return lib


def cpu_instruction_set() -> str:
    """The copy of the CPU kernels the library chose when it was loaded: "x86-64-v3" (AVX2, FMA, F16C),
    "x86-64" (a CPU without them, or TURBOQUANT_CPU_BASELINE=1 in the environment) or "generic"
    (a build for another architecture)."""
    return _library().turboquant_cpu_instruction_set().decode()


def plan_split(*, batch: int, q_heads: int, kv_heads: int, past_len: int, head_dim: int, key_format: str,
               value_format: str, q_len: int = 1, new_len: int | None = None, v_head_dim: int | None = None,
               dtype: str = "float16", mask: str | None = None, is_causal: bool = False, key_row_bytes: int = 0,
               value_row_bytes: int = 0, aligned16: bool = True, buffer_rows: int = 0, local_window_size: int = -1,
               softcap: float = 0.0, head_sink: bool = False, device: Device = H200) -> SplitPlan:
    """The planner's choice for one call. new_len defaults to q_len, v_head_dim to head_dim; row bytes
    0 mean the formats' packed sizes (a shared buffer's rows may be wider); aligned16: the past caches
    start at multiples of 16 bytes; buffer_rows: rows per (b, head) of preallocated caches
    (TQGroupQueryAttention's shared buffers, the in-place form), 0 for dense ones;
    local_window_size, softcap and head_sink: GroupQueryAttention's sliding window (-1 or 0: none;
    the splits then cover only the window's keys), softcap and whether the call has head_sink."""
    for name, value, allowed in (("key_format", key_format, ALL_FORMATS), ("value_format", value_format, ALL_FORMATS),
                                 ("dtype", dtype, DTYPES), ("mask", mask, MASKS)):
        if value not in allowed:
            raise ValueError(f"{name} is {value!r}; expected one of {', '.join(str(a) for a in allowed)}")
    new_len = q_len if new_len is None else new_len
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    shape = (batch, q_heads, kv_heads, q_len, new_len, past_len, head_dim, v_head_dim, int(is_causal), key_row_bytes,
             value_row_bytes, int(aligned16), buffer_rows, max(local_window_size, 0), int(softcap > 0), int(head_sink))
    props = (device.sms, device.smem_optin, device.cc_major, device.cc_minor, int(device.sm90a))
    out = (ctypes.c_int64 * 9)()
    name = _library().turboquant_split_plan(key_format.encode(), value_format.encode(), dtype.encode(),
                                            (mask or "none").encode(), (ctypes.c_int64 * 16)(*shape),
                                            (ctypes.c_int64 * 5)(*props), out)
    if name is None:
        raise ValueError(f"the planner refused these shapes: batch, q_heads, kv_heads, q_len, new_len, past_len, "
                         f"head_dim, v_head_dim, is_causal, key_row_bytes, value_row_bytes, aligned16 = {shape} "
                         "(negative, heads not a multiple of kv_heads, or an unsupported head size)")
    values = [int(x) for x in out]
    return SplitPlan(name.decode(), *values[:7], bool(values[7]), values[8])


def plan_prefill(*, q_len: int, head_dim: int, new_len: int | None = None, v_head_dim: int | None = None,
                 dtype: str = "float16", mask: str | None = None, local_window_size: int = -1, softcap: float = 0.0,
                 head_sink: bool = False, past_len: int = 0, device: Device = H200) -> str:
    """The kernel that attends a call's new tokens (with several query rows) on tensor cores, or
    "none"; new_len defaults to q_len, v_head_dim to head_dim; local_window_size, softcap, head_sink
    and past_len as plan_split's."""
    for name, value, allowed in (("dtype", dtype, DTYPES), ("mask", mask, MASKS)):
        if value not in allowed:
            raise ValueError(f"{name} is {value!r}; expected one of {', '.join(str(a) for a in allowed)}")
    shape = (q_len, q_len if new_len is None else new_len, head_dim, head_dim if v_head_dim is None else v_head_dim,
             max(local_window_size, 0), int(softcap > 0), int(head_sink), past_len)
    props = (device.sms, device.smem_optin, device.cc_major, device.cc_minor, int(device.sm90a))
    return _library().turboquant_prefill_plan(dtype.encode(), (mask or "none").encode(), (ctypes.c_int64 * 8)(*shape),
                                              (ctypes.c_int64 * 5)(*props)).decode()


def last_prefill_kernel() -> str:
    """The kernel that attended the new tokens of the process's latest CUDA call with several query
    rows on tensor cores ("none" before any, or in a build without CUDA kernels)."""
    return _library().turboquant_last_prefill_kernel().decode()


def last_split_kernel() -> str:
    """The split kernel the process's latest CUDA attention call ran ("none" before any, or in a
    build without CUDA kernels)."""
    return _library().turboquant_last_split_kernel().decode()


def cuda_device(index: int = 0) -> Device:
    """The planner's view of CUDA device `index`, from the driver (libcuda); OSError or RuntimeError
    where there is none."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, value = ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        raise RuntimeError(f"no CUDA device {index}")

    def attribute(code: int) -> int:  # CUdevice_attribute values of cuda.h
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), code, dev) != 0:
            raise RuntimeError(f"cuDeviceGetAttribute({code}) failed for device {index}")
        return value.value

    major, minor = attribute(75), attribute(76)
    sm90a = bool(_library().turboquant_sm90a_compiled()) and (major, minor) == (9, 0)
    return Device(sms=attribute(16), smem_optin=attribute(97), cc_major=major, cc_minor=minor, sm90a=sm90a)
