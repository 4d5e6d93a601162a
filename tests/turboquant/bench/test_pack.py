"""The TQPack throughput bench on the CPU: every preset format timed against a copy of the same run."""

import json

import pytest

from turboquant.bench.__main__ import main
from turboquant.config import packed_size


def test_pack_bench_times_every_format(tmp_path, capsys):
    out = tmp_path / "pack.json"
    assert main(["pack", "--device", "cpu", "--vectors", "512", "--head-dim", "64", "--threads", "1",
                 "--repeat", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["format"] for r in rows] == ["mse4", "mse3", "fp8", "uint4", "uint3", "raw16"]
    for r in rows:
        assert r["bytes_moved"] == 512 * (2 * 64 + packed_size(r["format"], 64))
        assert r["seconds"] > 0 and r["copy_fraction"] > 0
        assert abs(r["copy_fraction"] - r["GBps"] / r["copy_GBps"]) < 1e-9 * r["copy_fraction"]
    printed = capsys.readouterr().out
    assert "copy rate" in printed and all(f in printed for f in ("mse4", "uint3"))


def test_pack_report_prints_back_to_back_times_where_measured():
    from turboquant.bench.pack import report

    row = {"format": "mse4", "vectors": 8, "head_dim": 64, "bytes_moved": 100, "seconds": 2e-3, "GBps": 5e-5,
           "copy_GBps": 1.0, "copy_fraction": 5e-5, "seconds_pipelined": 1e-3, "GBps_pipelined": 1e-4,
           "copy_fraction_pipelined": 1e-4}
    text = report([row], "cuda")
    assert "back to back" in text and "2.000" in text and "1.000" in text
    assert "back to back" not in report([{k: v for k, v in row.items() if "pipelined" not in k}], "cpu")


def test_pack_bench_sweeps_vector_counts_and_plots_them(tmp_path, capsys):
    out, png = tmp_path / "pack.json", tmp_path / "pack.png"
    assert main(["pack", "--device", "cpu", "--vectors", "256", "1024", "--head-dim", "64", "--threads", "1",
                 "--repeat", "2", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["vectors"], r["format"]) for r in rows] == [(n, f) for n in (256, 1024) for f in
                                                          ("mse4", "mse3", "fp8", "uint4", "uint3", "raw16")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "256 fp16 vectors" in printed and "1024 fp16 vectors" in printed and f"plot written to {png}" in printed


def test_pack_bench_refuses_a_vector_count_that_is_not_positive(capsys):
    with pytest.raises(SystemExit):
        main(["pack", "--device", "cpu", "--vectors", "256", "0"])
    assert "--vectors: must be a positive count, not 0" in capsys.readouterr().err
