"""The CUDA bench's variants table (raw16 rows, a masked step, CUDA graphs), from a ShapeRun of the
kind cuda_variants.measure records, its steps replaced by fixed timings: no GPU needed."""

from turboquant.bench import cuda_steps, cuda_variants
from turboquant.bench.cuda_record import ShapeRun

STEPS = {  # in the order measure() times them
    "raw16_inplace": (300e-6, 290e-6), "turboquant_4bit_nc_masked": (800e-6, 700e-6),
    "ort_gqa_fp16_graph": (260e-6, 245e-6), "turboquant_4bit_nc_inplace_graph": (100e-6, 90e-6),
}


def _run(monkeypatch, fail: str | None = None) -> ShapeRun:
    run = ShapeRun(8, 32768)
    for name, t in (("ort_gqa_fp16", (280e-6, 250e-6)), ("turboquant_4bit_nc", (400e-6, 350e-6)),
                    ("turboquant_4bit_nc_inplace", (120e-6, 100e-6))):
        run.add(name, t, 10**9)
    order = iter(STEPS)

    def step(*args, **kwargs):
        name = next(order)
        if name == fail:
            raise RuntimeError("CUDA graph capture failed\nthe rest of ORT's message")
        return STEPS[name], 10**9

    for f in ("tq_gqa_step", "tq_step", "gqa_step"):
        monkeypatch.setattr(cuda_steps, f, step)
    cuda_variants.measure(run, 8, 32768, "turboquant_4bit_nc", 3, None)
    return run


def test_each_variant_against_its_baseline(monkeypatch):
    run = _run(monkeypatch)
    assert abs(run.ratio("raw16_inplace", "ort_gqa_fp16", False) - 280 / 300) < 1e-9
    assert abs(run.ratio("turboquant_4bit_nc_masked", "turboquant_4bit_nc", True) - 350 / 700) < 1e-9
    assert abs(run.ratio("ort_gqa_fp16_graph", "ort_gqa_fp16", False) - 280 / 260) < 1e-9
    assert abs(run.ratio("turboquant_4bit_nc_inplace_graph", "turboquant_4bit_nc_inplace", False) - 120 / 100) < 1e-9
    assert abs(run.ratio("turboquant_4bit_nc_inplace_graph", "ort_gqa_fp16_graph", True) - 245 / 90) < 1e-9
    line = [x for x in cuda_variants.report([run], "turboquant_4bit_nc").splitlines() if x.startswith("| 8 |")][0]
    assert line == ("| 8 | 32768 | 300 (0.93x) / 290 (0.86x) | 400 / 350 | 800 (0.50x) / 700 (0.50x) | "
                    "260 (1.08x) / 245 (1.02x) | 120 / 100 | 100 (1.20x) / 90 (1.11x) |")


def test_a_failed_variant_is_reported_not_raised(monkeypatch):
    run = _run(monkeypatch, fail="turboquant_4bit_nc_inplace_graph")
    assert run.errors["turboquant_4bit_nc_inplace_graph"] == "CUDA graph capture failed"
    text = cuda_variants.report([run], "turboquant_4bit_nc")
    assert "| failed |" in text and "turboquant_4bit_nc_inplace_graph failed: CUDA graph capture failed" in text
    assert "ort_gqa_fp16_graph" in run.timings  # the others still ran


def test_no_table_without_variant_rows():
    assert cuda_variants.report([ShapeRun(1, 2)], "turboquant_4bit_nc") == ""
