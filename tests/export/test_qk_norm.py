"""genai's CUDA builds of Qwen3 fuse the Q/K RMSNorm into GroupQueryAttention (inputs 14 and 15):
the rewrite unfuses it (export/qk_norm.py) and compresses those builds; refusals of the op's other
inputs name them."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from turboquant.export import export
from turboquant.export.gqa import unsupported_features
from turboquant.shared_buffer import SharedBufferDecoder

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")
pytest.importorskip("transformers")

from turboquant import architectures, coverage  # noqa: E402


@pytest.fixture(scope="module")
def qwen3(module_tmp):
    """(the CPU fp32 build, the CUDA fp16 build) of one random Qwen3."""
    folder = module_tmp.mktemp("qwen3")
    arch = architectures.by_name("Qwen3")
    return coverage.build(arch, folder), coverage.build(arch, folder, "fp16", "cuda")


def _gqa(path):
    return [n for n in onnx.load(path, load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]


def test_cuda_build_fuses_the_norm_and_is_rewritten(qwen3, tmp_path):
    """The CUDA build gives the op q_norm_weight and k_norm_weight (the CPU build has the norm as
    nodes); its rewrite unfuses them, compresses the layers, and run on the CPU tracks the CPU
    build of the same weights (fp16 against fp32: teacher-forced top-1 >= 85%)."""
    cpu, cuda = qwen3
    fused = _gqa(cuda)
    assert all(len(n.input) == 16 and n.input[14] and n.input[15] for n in fused)
    assert all(len(n.input) <= 12 or not any(n.input[12:]) for n in _gqa(cpu))
    dry = export(cuda, "turboquant_4bit_nc", tmp_path / "dry" / "model.onnx", boundary=1, calibrate="random",
                 progress=False, dry_run=True)
    assert dry.compressed == [1, 2] and "its fused Q/K norm unfused" in dry.summary()
    result = export(cuda, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=1, calibrate="random",
                    progress=False)
    out = onnx.load(result.output, load_external_data=False)
    tq = [n for n in out.graph.node if n.op_type == "TQGroupQueryAttention"]
    assert len(tq) == 4 and all(len(n.input) <= 15 for n in tq)
    assert sum(n.op_type == "SimplifiedLayerNormalization" and "q_norm" in n.name for n in out.graph.node) == 4
    assert "the cuda provider, which the installed onnxruntime-genai cannot run here" in result.summary()
    ids = np.random.default_rng(5).integers(3, 640, (1, 48 + 16))
    a = SharedBufferDecoder(cpu, 64).teacher_forced(ids, 48)
    b = SharedBufferDecoder(result.output, 64).teacher_forced(ids, 48)
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    assert top1 >= 0.85, top1


def test_default_calibration_runs_the_cuda_build_on_the_cpu(qwen3, tmp_path):
    """The default calibration writes its text with the original on the CPU, whose GroupQueryAttention
    kernel rejects the fused norm: it runs a copy with the norm unfused."""
    _, cuda = qwen3
    result = export(cuda, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=1, progress=False)
    meta = {p.key: p.value for p in onnx.load(str(result.output), load_external_data=False).metadata_props}
    assert "self-generated" in meta["turboquant.calibration"]


def test_refusals_name_the_real_input(qwen3):
    """k_scale, query_seqlens and a lone norm weight are refused by name, never as 'quantized-cache inputs'."""
    _, cuda = qwen3
    model = ir.load(cuda)
    node = next(n for n in model.graph if n.op_type == "GroupQueryAttention")
    assert unsupported_features(node) == []  # the fused norm is taken
    weight = node.inputs[14]
    node.replace_input_with(15, None)
    assert unsupported_features(node) == ["only one of q_norm_weight and k_norm_weight (inputs 14, 15), which the op "
                                          "takes together"]
    node.replace_input_with(15, weight)
    node.replace_input_with(12, weight)
    assert unsupported_features(node) == ["input k_scale (a quantized cache)"]
    node.replace_input_with(12, None)
    node.resize_inputs(17)
    node.replace_input_with(16, node.inputs[5])
    found = unsupported_features(node)
    assert found == ["input query_seqlens (right-padded query chunks)"]
    assert not any("quantized-cache inputs" in f for f in found)


@pytest.mark.gpu
def test_cuda_build_runs_in_genai_on_cuda(cuda_ready, qwen3, tmp_path):
    """On the GPU (onnxruntime-genai-cuda): the rewrite's own check runs genai on the CUDA folder, and
    the rewrite, fed the original's greedy tokens, picks the same top token on >= 85% of the steps
    (original: ORT's GroupQueryAttention with the fused norm; rewrite: the unfused nodes)."""
    import onnxruntime_genai as og

    if not og.is_cuda_available():
        pytest.skip("CUDA test skipped: the installed onnxruntime-genai has no CUDA (install onnxruntime-genai-cuda)")
    _, cuda = qwen3
    result = export(cuda, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=1, progress=False)
    assert "checked: onnxruntime-genai loaded the folder and generated 4 tokens" in result.summary()
    top1 = coverage.teacher_forced_top1(cuda.parent, result.output.parent, 640)
    print(f"Qwen3 CUDA build, fused Q/K norm unfused: teacher-forced top-1 {top1:.1%}")
    assert top1 >= coverage.MIN_TOP1, top1
