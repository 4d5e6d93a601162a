"""The CUDA bench's tables, from a ShapeRun of the kind cuda.run records (no GPU needed to format them)."""

from turboquant.bench import cuda, cuda_steps
from turboquant.bench.cuda_record import ShapeRun


def _run() -> ShapeRun:
    run = ShapeRun(8, 32768, 4000.0)
    run.add("ort_gqa_fp16", (280e-6, 250e-6), 1_000_000_000)
    run.add("ort_gqa_int4", (300e-6, 270e-6), 300_000_000)
    run.fail("ort_gqa_int8", RuntimeError("no CUDA kernel"))
    run.fail("ort_gqa_fp8", RuntimeError("no CUDA kernel"))
    run.add("torch_sdpa", (None, 240e-6), 1_000_000_000)
    for name, t in (("turboquant_4bit_nc", (400e-6, 350e-6)), ("turboquant_4bit_nc_inplace", (140e-6, 100e-6))):
        run.add(name, t, 280_000_000)
    run.add("ort_gqa_rotary", (290e-6, 260e-6), 1_000_000_000)
    run.add("turboquant_4bit_nc_rotary", (145e-6, 104e-6), 280_000_000)
    return run


def test_ratios_are_baseline_over_ours_for_each_timing():
    run = _run()
    assert abs(run.ratio("turboquant_4bit_nc_inplace", "ort_gqa_fp16", False) - 2.0) < 1e-9
    assert abs(run.ratio("turboquant_4bit_nc_inplace", "ort_gqa_fp16", True) - 2.5) < 1e-9
    assert abs(run.ratio("turboquant_4bit_nc_inplace", "ort_gqa_int4", True) - 2.7) < 1e-9
    assert abs(run.bw_fraction("turboquant_4bit_nc_inplace", True) - 280e6 / 100e-6 / 4e12) < 1e-9
    assert run.ratio("turboquant_4bit_nc_inplace", "ort_gqa_int8", True) is None  # that baseline did not run
    assert run.us("torch_sdpa", False) is None  # timed back to back only


def test_records_are_json():
    import json

    back = json.loads(json.dumps(_run().to_json()))
    assert back["timings"]["turboquant_4bit_nc_inplace"] == {"waited_us": 140.0, "back_to_back_us": 100.0,
                                                              "bytes_read": 280_000_000}
    assert back["errors"]["ort_gqa_int8"] == "no CUDA kernel" and back["batch"] == 8 and back["copy_gbps"] == 4000.0


def test_report_tables():
    text = cuda.report([_run()], ["turboquant_4bit_nc"])
    lines = text.splitlines()
    assert lines[0] == "copy rate 4000 GB/s (read + write, same run)"
    rows = [line for line in lines if line.startswith("| 8 |")]
    assert len(rows) == 5  # in place / present copied, waited for / back to back; with rotary
    assert "100 (2.50x, 2.70x int4, bw 0.70)" in rows[2]  # in place, back to back
    assert "| 240 (bw 1.04) |" in rows[2]  # torch SDPA only among the back-to-back timings
    assert "n/a" in rows[0] and "ORT GQA on its int8 cache unavailable: no CUDA kernel" in text


def test_rotary_preset_is_the_target_preset_when_present():
    assert cuda.rotary_preset(["turboquant_k8v4", "turboquant_4bit_nc"]) == ["turboquant_4bit_nc"]
    assert cuda.rotary_preset(["turboquant_3bit_nc"]) == ["turboquant_3bit_nc"]


def test_rotary_table_compares_with_rotary_gqa():
    run = _run()
    assert abs(run.ratio("turboquant_4bit_nc_rotary", "ort_gqa_rotary", True) - 2.5) < 1e-9  # 260 / 104, not 250 / 104
    lines = cuda.report([run], ["turboquant_k8v4", "turboquant_4bit_nc"]).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("With the rotary embedding"))
    assert "4bit_nc, GPU time" in lines[at + 1]  # the target preset, wherever it is in the list
    assert lines[at + 3] == "| 8 | 32768 | 290 (bw 0.86) | 145 (2.00x, bw 0.48) | 260 (bw 0.96) | 104 (2.50x, bw 0.67) |"


def test_fp8_caches_become_typed_values():
    # numpy has no fp8 type: ORT's fp8 cache baseline feeds its bytes typed FLOAT8E4M3FN
    import ml_dtypes
    import numpy as np

    v = cuda_steps._device_value(np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.float8_e4m3fn), "cpu")
    assert v.data_type() == "tensor(float8e4m3fn)" and v.shape() == [2, 3]


def test_run_records_every_candidate(monkeypatch, capsys):
    """cuda.run's assembly of a ShapeRun, its steps replaced by fixed timings (no GPU): every
    candidate under its name, ORT's missing caches as errors, the variants, and its report."""

    def step(*args, **kwargs):
        if "int8" in args:  # gqa_step's cache, passed positionally
            raise RuntimeError("no CUDA kernel\nmore")
        return (200e-6, 150e-6), 10**9

    for f in ("gqa_step", "tq_step", "tq_gqa_step"):
        monkeypatch.setattr(cuda, f, step)
        monkeypatch.setattr(cuda_steps, f, step)  # the variants' steps (cuda_variants)
    monkeypatch.setattr(cuda, "torch_step", lambda *a, **k: (120e-6, 10**9))
    monkeypatch.setattr(cuda, "copy_bandwidth", lambda: 4e12)
    (run,) = cuda.run([(8, 32768)], ["turboquant_k8v4", "turboquant_4bit_nc"], iters=3)
    assert (run.batch, run.context, run.copy_gbps) == (8, 32768, 4000.0)
    want = {"ort_gqa_fp16", "ort_gqa_int4", "ort_gqa_fp8", "torch_sdpa", "turboquant_k8v4", "turboquant_k8v4_inplace",
            "turboquant_4bit_nc", "turboquant_4bit_nc_inplace", "ort_gqa_rotary", "turboquant_4bit_nc_rotary",
            "raw16_inplace", "turboquant_4bit_nc_masked", "ort_gqa_fp16_graph", "turboquant_4bit_nc_inplace_graph"}
    assert set(run.timings) == want and run.errors == {"ort_gqa_int8": "no CUDA kernel"}
    assert run.us("torch_sdpa", False) is None and run.us("torch_sdpa", True) == 120.0
    assert '"batch": 8' in capsys.readouterr().out  # each shape's record printed as it is measured
    assert "ORT GQA on its int8 cache unavailable: no CUDA kernel" in cuda.report([run], ["turboquant_4bit_nc"])
