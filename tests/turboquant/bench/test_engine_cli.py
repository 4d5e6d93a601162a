"""bench engine: bad input refused in one line with exit status 2 before any model loads; on a GPU,
paged folders genai's builder made served end to end, the pool's arithmetic confirmed by the Engine."""

import json
import re

import pytest

from turboquant.bench import __main__ as bench
from turboquant.bench import engine_cli

from .engine_folders import INT4, PAGED, built, paged_folder


def _refused(capsys, argv, arg, message):
    try:
        rc = bench.main(["engine", *argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err and f"argument {arg}" in lines[0] and message in lines[0], err


@pytest.fixture
def no_run(monkeypatch):
    monkeypatch.setattr(engine_cli, "run_folder", lambda *a, **k: pytest.fail("a folder was served"))


@pytest.fixture
def folders(tmp_path):
    return str(paged_folder(tmp_path / "fp16")), str(paged_folder(tmp_path / "int4", int4=True))


def test_bad_input_refused(tmp_path, capsys, folders, no_run):
    fp16, int4 = folders
    plain = str(paged_folder(tmp_path / "plain", engine=False))
    auto = str(paged_folder(tmp_path / "auto", dynamic={"block_size": 16, "gpu_utilization_factor": 0.6}))
    (tmp_path / "taken.json").write_text("keep")
    for argv, arg, message in [
        ([str(tmp_path / "nope"), fp16], "MODEL_DIR", "nope: no such folder"),
        ([fp16, plain], "MODEL_DIR", "not a paged model"),
        ([fp16, "--concurrency", "0"], "--concurrency", "must be positive, not 0"),
        ([fp16, "--concurrency", "8,x"], "--concurrency", "expected comma-separated positive whole numbers"),
        ([fp16, "--context", "-5"], "--context", "must be positive, not -5"),
        ([fp16, "--new", "0"], "--new", ""),
        ([fp16, "--budget", "nan"], "--budget", "finite"),
    ]:
        _refused(capsys, argv, arg, message)
    pytest.importorskip("onnxruntime_genai", reason="the checks after these need onnxruntime-genai")
    for argv, arg, message in [
        ([auto, fp16, "--device", "cpu"], "--pool-bytes", "sizes its pool by gpu_utilization_factor 0.6"),
        ([fp16, "--device", "cpu", "--context", "4090", "--new", "7"], "--context", "exceed"),
        ([fp16, int4, "--device", "cpu", "--context", "1000", "--pool-bytes", "1e6"], "--pool-bytes", "hold no request"),
        ([fp16, "--device", "cpu", "--context", "100", "--json", str(tmp_path / "taken.json")], "--json", "exists"),
    ]:
        _refused(capsys, argv, arg, message)
    import onnxruntime_genai as og

    if not og.is_cuda_available():
        _refused(capsys, [fp16, "--context", "100"], "--device", "cuda: this onnxruntime-genai has no CUDA")
    assert (tmp_path / "taken.json").read_text() == "keep"


def test_a_folder_the_engine_cannot_open_is_reported(folders, capsys, tmp_path):
    """Every point of a folder the Engine refuses carries its words; the others still run."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    out = tmp_path / "r.json"
    rc = bench.main(["engine", *folders, "--device", "cpu", "--concurrency", "2,3", "--context", "40", "--new", "4",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and text.count("failed: og.Engine could not open it") == 4
    assert "float16, not quantized; blocks of 16 tokens, 1024 bytes a token over 2 layers; pool 0.00 GB = 64 blocks" in text
    doc = json.loads(out.read_text())
    assert [d["num_blocks"] for d in doc] == [64, 64 * 1024 // 272]  # the same bytes, int4 blocks smaller
    assert all(p["error"] for d in doc for p in d["points"])


def _paged_attention_takes_per_token_scales() -> bool:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    schema = next(s for s in C.get_all_operator_schema() if s.name == "PagedAttention")
    return len(schema.inputs) >= 19


@pytest.mark.gpu
def test_paged_folders_served_on_cuda(tmp_path, capsys, cuda_ready):
    """genai's builder's fp16 and int4_per_token + Hadamard paged folders through the CLI: every
    request gets every token, no more decode at once than the pool holds, and --confirm finds the
    Engine admitting what the block arithmetic says."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    if not og.is_cuda_available():
        pytest.skip("this onnxruntime-genai has no CUDA (onnxruntime-genai-cuda)")
    folders = [str(built(tmp_path / "fp16", "fp16", "cuda", PAGED))]
    if _paged_attention_takes_per_token_scales():
        folders.append(str(built(tmp_path / "int4", "fp16", "cuda", INT4)))
    out = tmp_path / "r.json"
    # 64 blocks of 16 tokens hold 5 requests of 180 + 8 tokens (12 blocks each): 8 submitted
    rc = bench.main(["engine", *folders, "--concurrency", "2,8", "--context", "180", "--new", "8", "--confirm",
                     "--budget", "120", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    doc = json.loads(out.read_text())
    for d in doc:
        assert "as the block arithmetic says" in d["confirm"], d["confirm"]
        for p in d["points"]:
            assert p["error"] is None and p["cut"] is None and p["tokens"] == p["concurrency"] * 8 and p["failed"] == 0
            assert p["peak_decoding"] <= min(p["concurrency"], p["fits"])
    assert doc[0]["points"][1]["fits"] == 5
    assert re.search(r"\| 8 \| 180 \| 8 \| [0-9.]+ \| 1\.00x \|", text)
    if len(folders) < 2:
        pytest.skip("this ONNX Runtime's PagedAttention takes no per-token scales (inputs 17-18 of genai 0.18's "
                    "int4_per_token models): the int4 folder was not served")
