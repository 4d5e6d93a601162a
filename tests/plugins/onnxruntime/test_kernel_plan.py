"""The CUDA split-KV planner (ops/cuda/split_plan.cpp), asked through the custom-op library on any
machine: which kernel serves a decode call, and the layout, shared memory and workspace it is
launched with. The GPU tests in test_kernel_choice.py check that the kernel it names is the one
that runs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataclasses

from turboquant.kernel_plan import A100, H200, L4, plan_prefill, plan_split


@pytest.fixture(autouse=True, scope="module")
def split_kernels():
    """The plans of the split kernels (TURBOQUANT_DENSE_PREFILL=0), but where a test turns the dense
    prefill path on: most one-sequence chunks here are the chunk kernels'."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TURBOQUANT_DENSE_PREFILL", "0")
        yield


# the presets' decode shape on an 8B model: B = 8, 32 query heads on 8 KV heads of 128, S = 32768
PRESET = dict(batch=8, q_heads=32, kv_heads=8, past_len=32768, head_dim=128, dtype="float16")


def test_presets_run_the_tensor_core_bulk_kernel_in_one_wave():
    """16 warps of 32-token tiles a block, one block per SM: 132 SMs over 64 (b, head) pairs give 2
    splits of 16384 tokens; the partial results are (max, sum, 128 values) per row and split."""
    for kf, vf in (("mse4", "uint4"), ("mse3", "uint4"), ("mse3", "uint3"), ("fp8", "uint4")):
        plan = plan_split(**PRESET, key_format=kf, value_format=vf)
        assert plan.kernel == "tc_bulk" and plan.warps == 16, (kf, vf, plan)
        assert (plan.splits, plan.split_len, plan.rows_per_block, plan.row_blocks) == (2, 16384, 4, 1)
        assert plan.workspace == 8 * 8 * 4 * 2 * (2 + 128) * 4
        assert 48 * 1024 < plan.smem <= H200.smem_optin - 1024  # opted in, room for the static part


def test_mse4_shared_memory_is_the_kernels_layout():
    """mse4/uint4 at head size 128: query fragments and rows (8 KiB) below a 64 KiB table at the
    window's 64 KiB boundary, 6 warps' double buffers below it (2 x (2144 + 2208) bytes each), the
    other 10 above it."""
    plan = plan_split(**PRESET, key_format="mse4", value_format="uint4")
    assert plan.smem == 65536 + 65536 + 10 * 2 * (2144 + 2208)


@pytest.mark.parametrize("mask", ["bool", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kf, vf", [("mse4", "uint4"), ("fp8", "uint4"), ("mse3", "uint3"), ("raw16", "raw16")])
def test_a_mask_keeps_the_bulk_kernel_and_its_layout(mask, kf, vf):
    """The bulk kernel's masked variant: the same plan as without the mask."""
    plan = plan_split(**PRESET, key_format=kf, value_format=vf, mask=mask)
    assert plan == plan_split(**PRESET, key_format=kf, value_format=vf) and plan.kernel == "tc_bulk"


@pytest.mark.parametrize("change, kf, vf", [
    ({"head_dim": 256}, "mse4", "uint4"),  # the bulk kernel's 8-warp blocks have no masked variant
    ({}, "mse4", "uint3"),  # tc_mma's pair
    ({"head_dim": 80}, "mse4", "uint4"),
])
def test_masks_the_bulk_kernel_does_not_take_run_the_cuda_core_kernel(change, kf, vf):
    plan = plan_split(**{**PRESET, **change}, key_format=kf, value_format=vf, mask="float16")
    assert plan.kernel == "cuda_core" and plan.warps == 0
    if not change:  # 8 blocks' worth per SM over 64 (b, head) pairs asks for 17 splits; in whole
        # 128-token tiles 2048 tokens each, which 16 cover; two staged tiles of packed K and V
        assert (plan.splits, plan.split_len, plan.smem) == (16, 2048, 2 * 128 * (66 + 52))


def test_misaligned_fp8_caches_get_the_cuda_core_kernel_with_its_own_layout():
    """fp8 keys are copied in swizzled 16-byte chunks: caches at other addresses run the CUDA-core
    kernel, laid out for it (not with the tensor-core kernel's 512-token splits)."""
    aligned = plan_split(**PRESET, key_format="fp8", value_format="uint4")
    off = plan_split(**PRESET, key_format="fp8", value_format="uint4", aligned16=False)
    assert aligned.kernel == "tc_bulk" and off.kernel == "cuda_core"
    assert off.split_len % 128 == 0 and (off.splits, off.split_len) == (16, 2048)
    assert off.smem == 2 * 128 * (128 + 68)
    # the MSE pairs copy any 2-byte aligned rows
    assert plan_split(**PRESET, key_format="mse4", value_format="uint4", aligned16=False).kernel == "tc_bulk"


def test_float32_keeps_the_cuda_core_kernel():
    """The tensor-core kernels round the softmax weights to fp16: within fp16/bf16 outputs'
    tolerance, not float32's."""
    for kf, vf in (("mse4", "uint4"), ("fp8", "uint4"), ("raw16", "raw16")):
        assert plan_split(**{**PRESET, "dtype": "float32"}, key_format=kf, value_format=vf).kernel == "cuda_core"


def test_raw16_runs_the_tensor_core_bulk_kernel():
    """raw16 rows (genai's boundary layers) at head sizes 64 and 128, fp16 and bf16 queries: the bulk
    kernel with as many warps as their double buffers fit (8 at 64, 6 at 128; 4 at 128 in sm_80's
    163 KiB), one wave of blocks."""
    for dtype in ("float16", "bfloat16"):
        plan = plan_split(**{**PRESET, "dtype": dtype}, key_format="raw16", value_format="raw16")
        assert (plan.kernel, plan.warps) == ("tc_bulk", 6), (dtype, plan)
        # two splits of whole rounds of 6 x 32 tokens
        assert (plan.splits, plan.split_len) == (2, 16512)
        # query fragments and rows (8 KiB), 6 warps' two tiles of 32 rows of 256 + 256 bytes (+ 20 bytes
        # of slack each, rounded to 16)
        assert plan.smem == 8192 + 6 * 2 * 2 * 8224
    small = plan_split(**{**PRESET, "head_dim": 64}, key_format="raw16", value_format="raw16")
    assert (small.kernel, small.warps, small.smem) == ("tc_bulk", 8, 4096 + 8 * 2 * 2 * 4128)
    a100 = plan_split(**PRESET, key_format="raw16", value_format="raw16", device=A100)
    assert (a100.kernel, a100.warps, a100.smem) == ("tc_bulk", 4, 8192 + 4 * 2 * 2 * 8224)
    assert plan_split(**PRESET, key_format="raw16", value_format="raw16", device=L4).kernel == "cuda_core"


@pytest.mark.parametrize("change", [
    {"dtype": "float32"}, {"head_dim": 256}, {"head_dim": 80}, {"aligned16": False},
    {"key_row_bytes": 262, "value_row_bytes": 262},  # a shared buffer's rows, not whole 16-byte chunks
    {"q_len": 4, "new_len": 1, "is_causal": True},
])
def test_raw16_elsewhere_keeps_the_cuda_core_kernel(change):
    plan = plan_split(**{**PRESET, **change}, key_format="raw16", value_format="raw16")
    assert plan.kernel == "cuda_core", (change, plan)


@pytest.mark.parametrize("formats", [("raw16", "raw16"), ("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4")])
def test_chunks_run_on_the_prefill_kernel_over_the_past_decoded_dense(monkeypatch, formats):
    """A chunk of 2048 tokens over a past of 30720 (the Engine's prompt chunks), any preset's formats or
    raw16 (boundary layers), fp16 or bf16, caches at any alignment: one
    split, the whole past, decoded dense (K then V) after the partial results of its rows and of the new
    tokens (a past the host knows, TQPagedAttention's or TQAttention's); not with TURBOQUANT_DENSE_PREFILL=0,
    for several sequences, windows, softcap, sinks, a float32 call, a few rows, a past whose dense copy
    would pass 256 MiB, or TQGroupQueryAttention's buffers (its sequence's past read on the device)."""
    call = dict(batch=1, q_heads=24, kv_heads=8, q_len=2048, past_len=30720, head_dim=128, key_format=formats[0],
                value_format=formats[1])
    monkeypatch.delenv("TURBOQUANT_DENSE_PREFILL", raising=False)
    part = 8 * 2048 * 3 * (2 + 128) * 4
    for change in ({}, {"dtype": "bfloat16"}, {"aligned16": False}):
        plan = plan_split(**{**call, **change})
        assert (plan.kernel, plan.splits, plan.split_len) == ("dense_prefill", 1, 30720), change
        assert plan.new_part and plan.new_part_offset == part
        assert plan.workspace == (2 * part + 255) // 256 * 256 + 2 * 30720 * 8 * 128 * 2
    for change in ({"batch": 2}, {"local_window_size": 1024}, {"softcap": 30.0}, {"head_sink": True}, {"q_len": 16},
                   {"dtype": "float32"}, {"past_len": 65536 + 1}, {"buffer_rows": 32768}):
        assert plan_split(**{**call, **change}).kernel != "dense_prefill", change
    monkeypatch.setenv("TURBOQUANT_DENSE_PREFILL", "0")
    assert plan_split(**call).kernel in ("tc_bulk", "tc_chunk")


def test_raw16_in_wider_rows_of_whole_chunks_runs_the_bulk_kernel():
    """A shared buffer's rows wider than 2 x head size, in whole 16-byte chunks, are read at their
    own pitch."""
    plan = plan_split(**PRESET, key_format="raw16", value_format="raw16", key_row_bytes=272, value_row_bytes=272)
    assert plan.kernel == "tc_bulk"


def test_head_sizes_the_bulk_kernel_does_not_take_run_the_mma_kernel():
    """Head size 80 (padded key length 128, values 80) and mse4 keys with uint3 values: attention_mma.cu."""
    assert plan_split(**{**PRESET, "head_dim": 80}, key_format="mse4", value_format="uint4").kernel == "tc_mma"
    assert plan_split(**PRESET, key_format="mse4", value_format="uint3").kernel == "tc_mma"
    assert plan_split(**{**PRESET, "head_dim": 80}, key_format="fp8", value_format="uint4").kernel == "cuda_core"


def test_causal_prompt_chunks_over_a_past_keep_the_cuda_core_kernel():
    """Several causal query rows over fewer new tokens: some rows could then miss past tokens, which
    only the CUDA-core kernel masks."""
    base = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True)
    assert plan_split(**base, q_len=4).kernel == "tc_bulk"  # as many new tokens as queries
    assert plan_split(**base, q_len=4, new_len=2).kernel == "cuda_core"


def test_continuation_chunks_take_the_new_tokens_part_from_tensor_cores():
    """Several query rows over a past: their new tokens attended by prefill.cu (fp16 or bf16, head size
    64 or 128), each row's part one more partial result; a decode step's one new token, float32 and
    other head sizes by the finish kernel's merge."""
    chunk = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True, q_len=512)
    assert plan_split(**chunk).new_part and plan_split(**{**chunk, "dtype": "bfloat16"}).new_part
    assert plan_split(**chunk, mask="bool").new_part
    assert not plan_split(**{**chunk, "q_len": 1}).new_part
    assert not plan_split(**{**chunk, "dtype": "float32"}).new_part
    assert not plan_split(**{**chunk, "head_dim": 80}).new_part


def test_chunks_of_a_tile_of_rows_take_the_chunk_kernel():
    """64 or more query rows per KV head over a past in preallocated buffers, MSE keys with uint values
    at head size 64 or 128: the chunk kernel's 64-row tiles, the past split until about four blocks per
    SM; else the split kernels (dense caches, fewer rows, fp8 keys, masks (the bulk kernel's masked
    variant), float32, causal rows over fewer new tokens)."""
    chunk = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True, q_len=512, buffer_rows=33280)
    assert plan_split(**{**chunk, "buffer_rows": 0}).kernel == "tc_bulk"
    plan = plan_split(**chunk)
    assert (plan.kernel, plan.rows_per_block, plan.row_blocks) == ("tc_chunk", 64, 512 * 4 // 64)
    assert plan.split_len % 64 == 0 and plan.splits * plan.split_len >= 32768 and plan.splits * 8 * plan.row_blocks >= 4 * 132
    assert plan_split(**{**chunk, "head_dim": 64, "key_format": "mse3", "value_format": "uint3"}).kernel == "tc_chunk"
    assert plan_split(**{**chunk, "q_len": 16}).kernel == "tc_chunk"  # 64 rows
    assert plan_split(**{**chunk, "q_len": 15}).kernel == "tc_bulk"
    assert plan_split(**{**chunk, "key_format": "fp8"}).kernel == "tc_bulk"
    assert plan_split(**chunk, mask="bool").kernel == "tc_bulk"
    assert plan_split(**{**chunk, "dtype": "float32"}).kernel == "cuda_core"
    assert plan_split(**{**chunk, "new_len": 100}).kernel == "cuda_core"
    assert plan_split(**{**chunk, "head_dim": 80}).kernel == "tc_mma"


def test_chunks_take_the_wgmma_chunk_kernel_where_enabled(monkeypatch):
    """With TURBOQUANT_CHUNK_WGMMA=1 (until its measurements on the GPU), on devices that run sm_90a
    code: the chunk kernel's calls (MSE keys, uint values) with 128 rows or more per KV head, rows of
    an odd number of 4-byte words in (b, head) regions of multiples of 16 bytes, in 128-row blocks with the past
    split while whole waves of blocks allow; else the chunk kernel."""
    chunk = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True, q_len=512, buffer_rows=33280,
                 key_row_bytes=68, value_row_bytes=68)
    monkeypatch.delenv("TURBOQUANT_CHUNK_WGMMA", raising=False)
    assert plan_split(**chunk).kernel == "tc_chunk"
    monkeypatch.setenv("TURBOQUANT_CHUNK_WGMMA", "1")
    plan = plan_split(**chunk)
    assert (plan.kernel, plan.rows_per_block, plan.row_blocks, plan.splits) == ("tc_chunk_wgmma", 128, 16, 1)
    assert plan.split_len >= 32768 and plan.smem <= H200.smem_optin
    assert plan.workspace >= 8 * 512 * 4 * (2 + 128) * 4 * 2  # the splits' rows and the new tokens' part, float32
    few = plan_split(**{**chunk, "q_len": 32})  # one block per KV head: 16 splits of 2048 fill 128 SMs
    assert (few.kernel, few.row_blocks, few.splits, few.split_len) == ("tc_chunk_wgmma", 1, 16, 2048)
    assert plan_split(**{**chunk, "head_dim": 64}).kernel == "tc_chunk_wgmma"
    assert plan_split(**{**chunk, "dtype": "bfloat16"}).kernel == "tc_chunk_wgmma"
    for formats in (("mse3", "uint4"), ("mse3", "uint3"), ("mse4", "uint3")):  # 52- or 68-byte rows
        assert plan_split(**{**chunk, "key_format": formats[0], "value_format": formats[1]}).kernel == "tc_chunk_wgmma"
    assert plan_split(**{**chunk, "key_format": "mse3", "key_row_bytes": 50}).kernel == "tc_chunk"  # mse3's own 50
    for other in ({"q_len": 31}, {"buffer_rows": 33281}, {"key_row_bytes": 0}, {"aligned16": False}, {"device": A100},
                  {"device": dataclasses.replace(H200, sm90a=False)},
                  {"key_row_bytes": 72, "value_row_bytes": 72},  # an even number of words: the producer's reads conflict
                  {"head_dim": 64, "key_row_bytes": 128, "value_row_bytes": 128}):  # uniform 2 D-byte rows
        assert plan_split(**{**chunk, **other}).kernel == "tc_chunk", other
    monkeypatch.setenv("TURBOQUANT_CHUNK_WGMMA", "0")
    assert plan_split(**chunk).kernel == "tc_chunk"


def test_smaller_devices():
    """sm_80's 163 KiB take 8-warp mse4 blocks; sm_89's 99 KiB none (the mma kernel instead); the
    fp8 pair's smaller buffers fit 16 warps on sm_80."""
    assert plan_split(**PRESET, key_format="mse4", value_format="uint4", device=L4).kernel == "tc_mma"
    a100 = plan_split(**PRESET, key_format="mse4", value_format="uint4", device=A100)
    assert (a100.kernel, a100.warps) == ("tc_bulk", 8)
    assert plan_split(**PRESET, key_format="fp8", value_format="uint4", device=L4).kernel == "cuda_core"


def test_no_past_or_no_queries_needs_no_split_kernel():
    for change in ({"past_len": 0}, {"q_len": 0, "new_len": 1}):
        plan = plan_split(**{**PRESET, **change}, key_format="mse4", value_format="uint4")
        assert plan.kernel == "none" and plan.workspace == 0


@pytest.mark.parametrize("change, message", [
    ({"key_format": "mse5"}, "key_format is 'mse5'"),
    ({"dtype": "float64"}, "dtype is 'float64'"),
    ({"mask": "int8"}, "mask is 'int8'"),
])
def test_bad_names_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        plan_split(**{**PRESET, "key_format": "mse4", "value_format": "uint4", **change})


@pytest.mark.parametrize("change", [{"head_dim": 100}, {"q_heads": 30}, {"past_len": -1}])
def test_bad_shapes_are_refused(change):
    with pytest.raises(ValueError, match="the planner refused these shapes"):
        plan_split(**{**PRESET, "key_format": "mse4", "value_format": "uint4", **change})


FORMATS = [("mse4", "uint4"), ("mse3", "uint3"), ("mse3", "uint4"), ("fp8", "uint4"), ("raw16", "raw16"), ("mse4", "uint3")]


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 64), kv_heads=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 4, 8]),
       q_len=st.sampled_from([1, 1, 2, 5]), past_len=st.integers(1, 70000), head_dim=st.sampled_from([64, 80, 128, 256]),
       formats=st.sampled_from(FORMATS), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       aligned=st.booleans(), device=st.sampled_from([H200, A100, L4]))
def test_every_plan_covers_the_past_in_whole_units(batch, kv_heads, group, q_len, past_len, head_dim, formats, dtype,
                                                   aligned, device):
    """Whatever the kernel: the splits cover the past, each a whole number of the kernel's tiles
    (the bulk kernel's warps x 32 tokens, else 128) and none empty; the workspace holds every row's
    partial results; shared memory fits the device."""
    kf, vf = formats
    plan = plan_split(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads, q_len=q_len, past_len=past_len,
                      head_dim=head_dim, key_format=kf, value_format=vf, dtype=dtype, aligned16=aligned, device=device)
    assert plan.kernel in ("tc_bulk", "tc_mma", "cuda_core")
    unit = plan.warps * 32 if plan.kernel == "tc_bulk" else 128
    assert plan.split_len % unit == 0 and plan.splits * plan.split_len >= past_len
    assert (plan.splits - 1) * plan.split_len < past_len
    rows = q_len * group
    part_bytes = batch * kv_heads * rows * (2 + head_dim) * 4
    assert plan.row_blocks * plan.rows_per_block >= rows
    assert plan.new_part == (q_len > 1 and dtype != "float32" and head_dim in (64, 128, 256))
    if plan.new_part:  # the new tokens' part after the splits', at a 256-byte boundary
        assert plan.new_part_offset % 256 == 0 and plan.splits * part_bytes <= plan.new_part_offset < plan.splits * part_bytes + 256
        assert plan.workspace == plan.new_part_offset + part_bytes
    else:
        assert plan.workspace == plan.splits * part_bytes
    limit = 48 * 1024 - 10400 if plan.kernel == "tc_mma" else device.smem_optin - 1024
    assert 0 <= plan.smem <= limit
    if dtype == "float32":
        assert plan.kernel == "cuda_core"
    if kf in ("fp8", "raw16") and not aligned:
        assert plan.kernel == "cuda_core"


@pytest.mark.parametrize("call, dev, want", [
    (dict(q_len=4096, head_dim=128), H200, "wgmma"),
    (dict(q_len=2, head_dim=64, dtype="bfloat16"), H200, "wgmma"),
    (dict(q_len=300, new_len=1300, head_dim=128), H200, "wgmma"),  # a continuation chunk's new tokens
    (dict(q_len=4096, head_dim=128, mask="float16"), H200, "mma"),  # masks stay on the mma.sync kernel
    (dict(q_len=4096, head_dim=128), dataclasses.replace(H200, sm90a=False), "mma"),  # a build without sm_90a code
    (dict(q_len=4096, head_dim=128), A100, "mma"),
    (dict(q_len=4096, head_dim=128), L4, "mma"),
    (dict(q_len=1, head_dim=128), H200, "none"),  # a decode step: the finish kernel
    (dict(q_len=4096, head_dim=128, dtype="float32"), H200, "none"),
    (dict(q_len=4096, head_dim=96), H200, "none"),
    (dict(q_len=4096, head_dim=128, v_head_dim=64), H200, "none"),
    # head size 256 (Gemma 3): the mma.sync kernel everywhere (the wgmma kernel has no such tiles),
    # its two buffers in 160 KiB of shared memory, or one in 96 on sm_86/sm_89's 99 KiB
    (dict(q_len=4096, head_dim=256), H200, "mma"),
    (dict(q_len=4096, head_dim=256, dtype="bfloat16"), H200, "mma"),
    (dict(q_len=4096, head_dim=256, local_window_size=1024, softcap=50.0, head_sink=True), H200, "mma"),
    (dict(q_len=4096, head_dim=256, mask="bool"), H200, "mma"),
    (dict(q_len=300, new_len=300, head_dim=256, past_len=5000, local_window_size=1024), H200, "mma"),  # a chunk's new tokens
    (dict(q_len=4096, head_dim=256), A100, "mma"),
    (dict(q_len=4096, head_dim=256), L4, "mma"),
    (dict(q_len=1, head_dim=256), H200, "none"),
    (dict(q_len=4096, head_dim=256, dtype="float32"), H200, "none"),
    (dict(q_len=4096, head_dim=256, v_head_dim=128), H200, "none"),
])
def test_prefill_kernel_choice(call, dev, want):
    """Several query rows of fp16/bf16 at head size 64, 128 or 256 run on tensor cores: Hopper's
    warpgroup products where the library holds sm_90a code, the call has no mask and the head size is
    at most 128, else the mma.sync kernel."""
    assert plan_prefill(**call, device=dev) == want


@pytest.mark.parametrize("dev", [H200, A100, L4])
def test_a_head_size_256_chunk_writes_its_new_tokens_part(dev):
    """A continuation chunk at head size 256 (Gemma 3's windowed layers): prefill.cu attends its new
    tokens, so the workspace holds one more partial result per row after the splits'."""
    chunk = dict(batch=1, q_heads=8, kv_heads=4, head_dim=256, key_format="mse3", value_format="uint3", dtype="float16",
                 is_causal=True, q_len=512, past_len=4096, buffer_rows=4608, local_window_size=1024, device=dev)
    plan = plan_split(**chunk)
    part_bytes = 4 * 512 * 2 * (2 + 256) * 4
    assert plan.new_part and plan.new_part_offset % 256 == 0
    assert plan.workspace == plan.new_part_offset + part_bytes and plan.new_part_offset >= plan.splits * part_bytes
    assert plan_prefill(q_len=512, head_dim=256, past_len=4096, local_window_size=1024, device=dev) == "mma"


def test_prefill_plan_refuses_unknown_names():
    with pytest.raises(ValueError, match="dtype is 'int8'"):
        plan_prefill(q_len=8, head_dim=128, dtype="int8")


# ---- GroupQueryAttention's sliding window, softcap and head_sink (issue 61) ----------------------


@pytest.mark.parametrize("kf, vf, head_dim, q_heads, kv_heads, window", [
    ("mse4", "uint4", 128, 32, 8, 512),  # the presets' pair: the bulk kernel
    ("mse3", "uint3", 256, 8, 4, 1024),  # Gemma 3 4B's heads (256, 8 on 4), its window
    ("mse4", "uint4", 64, 64, 8, 128),  # gpt-oss-20b's heads (64, 64 on 8), its window
    ("mse4", "uint4", 80, 32, 8, 512),  # the mma kernel's head size
    ("fp8", "uint4", 128, 32, 8, 512),
])
@pytest.mark.parametrize("batch", [1, 8])
def test_a_windowed_decode_step_splits_only_the_window(kf, vf, head_dim, q_heads, kv_heads, window, batch):
    """A decode step of a windowed layer (local_window_size W) over a past of 32768 tokens sees its
    last W - 1 past tokens and itself: the kernels start each sequence's splits at its window, so the
    plan is the one of an unwindowed step over a past of W - 1 tokens (the same kernel, splits and
    workspace), which covers the window and no more."""
    call = dict(batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, key_format=kf, value_format=vf,
                dtype="float16", is_causal=True, buffer_rows=33000)
    windowed = plan_split(**call, past_len=32768, local_window_size=window)
    assert windowed == plan_split(**call, past_len=window - 1)
    unit = windowed.warps * 32 if windowed.kernel == "tc_bulk" else 128
    assert windowed.splits * windowed.split_len >= window - 1 and (windowed.splits - 1) * windowed.split_len < window - 1
    assert windowed.split_len % unit == 0
    full = plan_split(**call, past_len=32768)
    assert windowed.kernel == full.kernel != "cuda_core"  # one query position: no kernel declines the window
    assert windowed.splits * windowed.split_len < full.splits * full.split_len // 16


@pytest.mark.parametrize("window", [-1, 0, 32769, 40000])
def test_a_window_as_long_as_the_context_changes_no_plan(window):
    """A window of at least past + 1 tokens (or none, -1 or 0) hides nothing: the plan without one."""
    call = dict(PRESET, key_format="mse4", value_format="uint4", is_causal=True, buffer_rows=33000)
    assert plan_split(**call, local_window_size=window) == plan_split(**call)


def test_windowed_chunks_split_the_window():
    """A continuation chunk of a windowed layer: its rows start their windows at different keys, which
    the chunk kernel masks per row inside the span the first row's window reaches (W - 1 past tokens);
    its splits cover that span only. The bulk kernel, which sees every past token from every row,
    declines it (here: fp8 keys) for the CUDA-core kernel, which masks per row too; so does the wgmma
    chunk kernel."""
    chunk = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True, q_len=512, buffer_rows=33280)
    plan = plan_split(**chunk, local_window_size=1024)
    assert plan.kernel == "tc_chunk" and plan.new_part  # the chunk's own tokens on tensor cores (prefill.cu)
    assert plan.splits * plan.split_len >= 1023 and (plan.splits - 1) * plan.split_len < 1023
    assert plan_split(**chunk).splits * plan_split(**chunk).split_len >= 32768
    fp8 = plan_split(**{**chunk, "key_format": "fp8"}, local_window_size=1024)
    assert fp8.kernel == "cuda_core" and fp8.splits * fp8.split_len >= 1023 and (fp8.splits - 1) * fp8.split_len < 1023
    assert plan_split(**{**chunk, "key_format": "fp8"}, local_window_size=32768 + 512).kernel == "tc_bulk"  # cuts nothing


def test_windowed_chunks_decline_the_wgmma_chunk_kernel(monkeypatch):
    monkeypatch.setenv("TURBOQUANT_CHUNK_WGMMA", "1")
    chunk = dict(PRESET, batch=1, key_format="mse4", value_format="uint4", is_causal=True, q_len=512, buffer_rows=33280,
                 key_row_bytes=68, value_row_bytes=68)
    assert plan_split(**chunk).kernel == "tc_chunk_wgmma"
    assert plan_split(**chunk, local_window_size=1024).kernel == "tc_chunk"


def test_softcap_runs_the_cuda_core_kernel_and_a_sink_changes_no_split():
    """softcap changes every score before the softmax: only the CUDA-core kernel applies it among the
    split kernels. head_sink changes only the final normalisation (the finish kernel, prefill.cu's
    first prompts): every split kernel keeps its calls."""
    call = dict(PRESET, key_format="mse4", value_format="uint4", is_causal=True, buffer_rows=33000)
    assert plan_split(**call, softcap=50.0).kernel == "cuda_core"
    assert plan_split(**{**call, "head_dim": 80}, softcap=50.0).kernel == "cuda_core"  # not tc_mma
    chunk = dict(call, batch=1, q_len=512, buffer_rows=33280)
    assert plan_split(**chunk, softcap=30.0).kernel == "cuda_core"
    assert plan_split(**call, head_sink=True) == plan_split(**call)
    assert plan_split(**chunk, head_sink=True) == plan_split(**chunk)
    both = plan_split(**call, local_window_size=128, head_sink=True)
    assert both == plan_split(**{**call, "past_len": 127}) and both.kernel == "tc_bulk"


@pytest.mark.parametrize("features, want", [
    ({}, "wgmma"),
    ({"local_window_size": 1024}, "mma"),  # the window cuts a prompt of 4096
    ({"local_window_size": 4096}, "wgmma"),  # it does not
    ({"local_window_size": 1024, "past_len": 8192}, "mma"),
    ({"softcap": 50.0}, "mma"),
    ({"head_sink": True}, "mma"),
])
def test_prefill_features_run_the_mma_kernel(features, want):
    """prefill.cu applies the sliding window (skipping the key tiles before a block's first window),
    softcap and head_sink; the wgmma kernel declines them."""
    assert plan_prefill(q_len=4096, head_dim=128, **features) == want


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 16), kv_heads=st.sampled_from([1, 2, 8]), group=st.sampled_from([1, 4, 8]),
       q_len=st.sampled_from([1, 1, 3, 64, 300]), past_len=st.integers(1, 70000), window=st.integers(1, 80000),
       head_dim=st.sampled_from([64, 80, 128, 256]), formats=st.sampled_from(FORMATS),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), softcap=st.sampled_from([0.0, 30.0]),
       device=st.sampled_from([H200, A100, L4]))
def test_every_windowed_plan_covers_the_window(batch, kv_heads, group, q_len, past_len, window, head_dim, formats, dtype,
                                               softcap, device):
    """The splits cover the past tokens a windowed call's earliest row sees (min(past, W - 1)), at
    least one, in whole units and none empty; the kernels that see every past token from every row
    never take a window that cuts several query positions (the chunk kernel masks it per row), nor a
    softcap."""
    kf, vf = formats
    plan = plan_split(batch=batch, q_heads=kv_heads * group, kv_heads=kv_heads, q_len=q_len, past_len=past_len,
                      head_dim=head_dim, key_format=kf, value_format=vf, dtype=dtype, is_causal=True,
                      buffer_rows=past_len + q_len, local_window_size=window, softcap=softcap, device=device)
    cuts = window < past_len + q_len
    visible = max(1, min(past_len, window - 1)) if cuts else past_len
    unit = {"tc_bulk": plan.warps * 32, "tc_chunk": 64, "tc_chunk_wgmma": 128}.get(plan.kernel, 128)
    assert plan.split_len % unit == 0 and plan.splits * plan.split_len >= visible
    assert (plan.splits - 1) * plan.split_len < visible
    if softcap:
        assert plan.kernel == "cuda_core"
    elif cuts and q_len > 1:
        assert plan.kernel in ("cuda_core", "tc_chunk")
