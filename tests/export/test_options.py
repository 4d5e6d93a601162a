"""The rewrite's options (export/options.py): one frozen RewriteOptions, built the same by the CLI and by
export()'s keywords; and the layer plan of the model being rewritten made once per export."""

import collections
import dataclasses

import pytest

from turboquant.export import __main__ as cli
from turboquant.export import concat, export, gqa, in_place, mask_probe, plan, rewrite
from turboquant.export.options import RewriteOptions


def test_options_are_frozen():
    options = RewriteOptions("turboquant_4bit_nc", boundary=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.boundary = 3


class _Result:
    def summary(self):
        return "summary"


def test_cli_and_keywords_build_the_same_options(monkeypatch, tmp_path):
    seen = []

    def export_with(model_path, output, options):
        seen.append((str(model_path), str(output), options))
        return _Result()

    monkeypatch.setattr(rewrite, "export_with", export_with)
    monkeypatch.setattr(cli, "export_with", export_with)
    src, out = tmp_path / "m.onnx", tmp_path / "o.onnx"
    export(src, "turboquant_k3v4_nc", out, boundary=1, skip_layers=[2, 3], keep_layers="auto", dry_run=True,
           progress=False, calibrate="random", tokenizer="tok", offsets=False, value_offsets=True, key_scales=False, value_scales=True,
           target="tensorrt", unsupported="leave", cache="concat", rotary_positions=0, calibration_window=512,
           genai_cuda_graph=True)
    assert cli.main([str(src), "--preset", "turboquant_k3v4_nc", "-o", str(out), "--boundary", "1", "--skip-layers", "2,3",
                     "--keep-layers", "auto", "--dry-run", "--no-progress", "--calibrate", "random", "--tokenizer", "tok",
                     "--no-offsets", "--value-offsets",
                     "--no-key-scales", "--value-scales", "--target", "tensorrt", "--unsupported", "leave", "--cache",
                     "concat", "--rotary-positions", "0", "--calibration-window", "512", "--genai-cuda-graph"]) == 0
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0][2].calibration_window == 512 and seen[0][2].skip_layers == [2, 3] and not seen[0][2].key_scales
    # every field set to something other than its default, so a field either form drops is seen
    defaults = RewriteOptions("turboquant_k3v4_nc")
    assert all(getattr(seen[0][2], f.name) != getattr(defaults, f.name)
               for f in dataclasses.fields(RewriteOptions) if f.name != "preset")


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["in-place", "concat"])
def test_the_model_is_planned_once(exported, tmp_path, monkeypatch, cache):
    """export() plans the model it rewrites once and passes the plan down (the calibration's and the
    mask probe's copies, loaded from the file, plan their own)."""
    planned = collections.Counter()
    seen = []  # keeps every planned model alive, so no later model reuses an id counted here
    real = plan.plan_layers

    def counting(model, *args, **kwargs):
        seen.append(model)
        planned[id(model)] += 1
        return real(model, *args, **kwargs)

    for module in (plan, rewrite, concat, in_place, mask_probe, gqa):
        if hasattr(module, "plan_layers"):
            monkeypatch.setattr(module, "plan_layers", counting)
    result = export(exported("llama-gqa-torchscript"), "turboquant_4bit_nc", tmp_path / "tq.onnx", cache=cache,
                    calibrate="random", progress=False, dry_run=True)
    assert result.compressed and planned and max(planned.values()) == 1, planned
