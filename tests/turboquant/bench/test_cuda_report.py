"""The CUDA bench's tables, from a row of the shape cuda.run records (no GPU needed to format them)."""

from turboquant.bench import cuda


def _row():
    row = {"B": 8, "S": 32768, "copy_GBps": 4000.0}
    cuda._record(row, "ort_gqa_fp16", (280e-6, 250e-6), 1_000_000_000, 4e12)
    cuda._record(row, "ort_gqa_int4", (300e-6, 270e-6), 300_000_000, 4e12)
    row["ort_gqa_int8_error"] = "no CUDA kernel"
    row["ort_gqa_fp8_error"] = "no CUDA kernel"
    row["torch_sdpa_pipelined_us"] = 240.0
    for name, t in (("turboquant_4bit_nc", (400e-6, 350e-6)), ("turboquant_4bit_nc_inplace", (140e-6, 100e-6))):
        cuda._record(row, name, t, 280_000_000, 4e12)
        cuda._ratios(row, name)
    cuda._record(row, "ort_gqa_rotary", (290e-6, 260e-6), 1_000_000_000, 4e12)
    cuda._record(row, "turboquant_4bit_nc_rotary", (145e-6, 104e-6), 280_000_000, 4e12)
    cuda._rotary_ratios(row, "turboquant_4bit_nc_rotary")
    return row


def test_ratios_are_baseline_over_ours_for_each_timing():
    row = _row()
    assert abs(row["turboquant_4bit_nc_inplace_x_vs_gqa"] - 2.0) < 1e-9
    assert abs(row["turboquant_4bit_nc_inplace_x_vs_gqa_pipelined"] - 2.5) < 1e-9
    assert abs(row["turboquant_4bit_nc_inplace_x_vs_gqa_int4_pipelined"] - 2.7) < 1e-9
    assert abs(row["turboquant_4bit_nc_inplace_pipelined_bw_fraction"] - 280e6 / 100e-6 / 4e12) < 1e-9
    assert "turboquant_4bit_nc_inplace_x_vs_gqa_int8" not in row  # that baseline did not run


def test_report_tables():
    text = cuda.report([_row()], ["turboquant_4bit_nc"])
    lines = text.splitlines()
    assert lines[0] == "copy rate 4000 GB/s (read + write, same run)"
    rows = [line for line in lines if line.startswith("| 8 |")]
    assert len(rows) == 5  # in place / present copied, waited for / back to back; with rotary
    assert "100 (2.50x, 2.70x int4, bw 0.70)" in rows[2]  # in place, back to back
    assert "| 240 |" in rows[2]  # torch SDPA only among the back-to-back timings
    assert "n/a" in rows[0] and "ORT GQA on its int8 cache unavailable: no CUDA kernel" in text


def test_rotary_preset_is_the_target_preset_when_present():
    assert cuda.rotary_preset(["turboquant_k8v4", "turboquant_4bit_nc"]) == ["turboquant_4bit_nc"]
    assert cuda.rotary_preset(["turboquant_3bit_nc"]) == ["turboquant_3bit_nc"]


def test_rotary_table_compares_with_rotary_gqa():
    row = _row()
    assert abs(row["turboquant_4bit_nc_rotary_x_vs_gqa_pipelined"] - 2.5) < 1e-9  # 260 / 104, not 250 / 104
    lines = cuda.report([row], ["turboquant_k8v4", "turboquant_4bit_nc"]).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("With the rotary embedding"))
    assert "4bit_nc, GPU time" in lines[at + 1]  # the target preset, wherever it is in the list
    assert lines[at + 3] == "| 8 | 32768 | 290 (bw 0.86) | 145 (2.00x, bw 0.48) | 260 (bw 0.96) | 104 (2.50x, bw 0.67) |"


def test_fp8_caches_become_typed_values():
    # numpy has no fp8 type: ORT's fp8 cache baseline feeds its bytes typed FLOAT8E4M3FN
    import ml_dtypes
    import numpy as np

    v = cuda._device_value(np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.float8_e4m3fn), "cpu")
    assert v.data_type() == "tensor(float8e4m3fn)" and v.shape() == [2, 3]
