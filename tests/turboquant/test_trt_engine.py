"""Engines run on a GPU (turboquant.trt_engine): a small decoder rewritten for ONNX Runtime and with
--target tensorrt (the same preset, no calibration: the same numbers), the engine built by
TensorRT-RTX, then a prompt and greedy decode steps through the engine, its caches bound in place,
against the ONNX Runtime rewrite on the CUDA provider. Skipped without a GPU, TensorRT-RTX, the
plugin library or onnxruntime-gpu, saying which."""

import pytest

import turboquant
from turboquant import random_decoders
from turboquant import tensorrt as tq_trt
from turboquant.export import export

pytestmark = pytest.mark.gpu

CFG = random_decoders.TinyConfig(family="llama", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=2, vocab=640)
CAPACITY = 64


@pytest.fixture(scope="module")
def gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU: TensorRT-RTX engines run on one")
    try:
        tq_trt.trt_module("tensorrt-rtx")
        turboquant.trt_plugin_path()
    except (tq_trt.TensorRTMissing, FileNotFoundError) as e:
        pytest.skip(str(e))
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu)")
    ort.preload_dlls()
    return torch


def _original(kind, folder):
    if kind == "torchscript":
        return random_decoders.export(CFG, folder / "model.onnx", "torchscript", "float16")
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the genai model")
    return random_decoders.export_genai(CFG, folder / "genai", precision="fp16", provider="NvTensorRtRtx")


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("kind", ["torchscript", "genai"])
def test_greedy_tokens_match_onnxruntime(gpu, kind, preset, tmp_path):
    import numpy as np

    from turboquant.trt_engine import EngineDecoder, check_against_onnxruntime

    src = _original(kind, tmp_path)
    ort_form = export(src, preset, tmp_path / "ort" / "model.onnx", calibrate=None, offsets=False, boundary=1,
                      progress=False).output
    trt_form = export(src, preset, tmp_path / "trt" / "model.onnx", target="tensorrt", calibrate=None, offsets=False,
                      boundary=1, progress=False).output
    prof = tq_trt.decoder_profile(trt_form, batch=(1, 2, 2), new=(1, 1, 16), past=(0, 16, CAPACITY - 16), capacity=CAPACITY)
    dec = EngineDecoder(tq_trt.build_engine(trt_form, prof, runtime="tensorrt-rtx"), runtime="tensorrt-rtx")
    prompt = np.random.default_rng(0).integers(3, CFG.vocab, (2, 12))
    res = check_against_onnxruntime(ort_form, dec, prompt, steps=12, capacity=CAPACITY)
    assert res["tokens_engine"] == res["tokens_ort"]
    assert max(res["relative_diffs"]) < 2e-2, res["relative_diffs"]
