"""python -m turboquant.bench: bad arguments refused in one line with exit status 2, before anything runs."""

import subprocess
import sys

import onnxruntime as ort
import pytest

SMALL = ["--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--context", "64", "--threads", "1", "--repeat", "2",
         "--presets", "turboquant_k8v4"]


def bench(*args):
    # a subprocess: ORT's GroupQueryAttention dies of SIGFPE on a zero batch, which must not take pytest along
    return subprocess.run([sys.executable, "-m", "turboquant.bench", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("what", ["attention", "report"])
@pytest.mark.parametrize("bad, message", [
    (["--batch", "0"], "argument --batch: must be a positive count, not 0"),
    (["--context", "0"], "argument --context: must be a positive count, not 0"),
    (["--repeat", "0"], "argument --repeat: must be a positive count, not 0"),
    (["--kv-heads", "0"], "argument --kv-heads: must be a positive count, not 0"),
    (["--threads", "-1"], "argument --threads: must be a positive count, not -1"),
    (["--head-dim", "12"], "argument --head-dim: unsupported head_dim 12"),
    (["--batch", "two"], "argument --batch: expected a positive integer, got 'two'"),
    (["--q-heads", "6", "--kv-heads", "4"], "argument --q-heads: 6 is not a multiple of --kv-heads 4"),
])
def test_bad_arguments(what, bad, message, tmp_path):
    r = bench(what, *SMALL, *bad, *(["--out", str(tmp_path / "r")] if what == "report" else []))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[0].startswith("usage:") and message in lines[-1], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this ONNX Runtime has CUDA")
@pytest.mark.parametrize("what", ["attention", "report", "pack"])
def test_cuda_without_cuda(what):
    r = bench(what, "--device", "cuda", "--repeat", "1")
    assert r.returncode == 2 and "argument --device: cuda: this ONNX Runtime has no CUDAExecutionProvider" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_shape_refuses_what_the_baselines_cannot_run():
    from turboquant.bench.attention import Shape

    for bad, message in [(dict(batch=0), "batch must be a positive count"), (dict(context=0), "context must be"),
                         (dict(q_heads=6, kv_heads=4), "not a multiple"), (dict(head_dim=12), "unsupported head_dim 12")]:
        with pytest.raises(ValueError, match=message):
            Shape(**bad)
