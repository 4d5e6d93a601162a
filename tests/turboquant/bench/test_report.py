"""The benchmark report on a tiny grid: every shape and candidate measured, table and plots written."""

import json

import pytest

from turboquant.bench import report
from turboquant.bench.__main__ import main


def test_report_on_a_tiny_grid(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", "--device", "cpu", "--context", "64", "256", "--batch", "1", "2", "--q-heads", "4",
                 "--kv-heads", "2", "--head-dim", "64", "--threads", "1", "--repeat", "2",
                 "--presets", "turboquant_4bit_nc", "turboquant_k8v4", "--out", str(out)]) == 0
    md = (out / "attention-cpu.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [tuple(r.split("|")[1:3]) for r in rows] == [(" 1 ", " 64 "), (" 1 ", " 256 "), (" 2 ", " 64 "), (" 2 ", " 256 ")]
    assert all("x vs ort_" in r for r in rows)  # a preset against the fastest ORT baseline of the same run
    points = json.loads((out / "attention-cpu.json").read_text())
    names = {p["name"] for p in points}
    assert {"turboquant_4bit_nc", "turboquant_k8v4"} <= names and any(n.startswith("ort_") for n in names)
    assert all(p["ms"] > 0 for p in points) and len(points) == 4 * len(names)
    for what in ("time", "bandwidth"):
        assert (out / f"attention-cpu-{what}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_place_variants_are_ours_not_baselines():
    # the CUDA bench names TQGroupQueryAttention's runs "<preset>_inplace"; the table compares our best
    # against the fastest baseline, which must be ORT's or torch's
    points = [report.Point("cuda", 8, 32768, n, ms, None) for n, ms in
              [("ort_gqa_fp16", 0.289), ("torch_sdpa", 0.252), ("turboquant_k8v4", 0.658),
               ("turboquant_k8v4_inplace", 0.187), ("turboquant_3bit_nc_inplace", 0.200)]]
    assert not report.is_baseline("turboquant_k8v4_inplace") and report.is_baseline("ort_gqa_fp16")
    row = [line for line in report.markdown(points).splitlines() if line.startswith("| 8 |")][0]
    assert row.endswith("| turboquant_k8v4_inplace 1.35x vs torch_sdpa |")


def test_ratios_compare_candidates_timed_alike():
    # waited-for steps against waited-for steps, back-to-back steps against back-to-back ones
    points = [report.Point("cuda", 8, 32768, n, ms, None) for n, ms in
              [("ort_gqa_fp16", 0.280), ("ort_gqa_fp16_pipelined", 0.250), ("torch_sdpa_pipelined", 0.240),
               ("turboquant_4bit_nc_inplace", 0.140), ("turboquant_4bit_nc_inplace_pipelined", 0.100)]]
    assert not report.is_baseline("turboquant_4bit_nc_inplace_pipelined")
    assert report.is_baseline("torch_sdpa_pipelined")
    row = [line for line in report.markdown(points).splitlines() if line.startswith("| 8 |")][0]
    assert row.endswith("| turboquant_4bit_nc_inplace 2.00x vs ort_gqa_fp16; "
                        "turboquant_4bit_nc_inplace_pipelined 2.40x vs torch_sdpa_pipelined |")


TINY = ["--device", "cpu", "--context", "16", "--batch", "1", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--threads", "1", "--repeat", "1", "--presets", "turboquant_k8v4"]


def _refused(capsys, argv, message):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and message in err, err


def test_report_refuses_a_folder_it_cannot_fill_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "measure", lambda *a, **k: pytest.fail("measured"))
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "attention-cpu.md").write_bytes(b"mine")
    (tmp_path / "afile").write_bytes(b"a file")
    _refused(capsys, ["report", *TINY, "--out", str(rep)], f"{rep / 'attention-cpu.md'} exists")
    _refused(capsys, ["report", *TINY, "--out", str(tmp_path / "afile")], "afile is a file, not a folder")
    _refused(capsys, ["report", *TINY, "--out", str(tmp_path / "afile" / "sub")], "afile is a file, not a folder")
    _refused(capsys, ["report", *TINY, "--out", ""], "--out is an empty name")
    _refused(capsys, ["report", *TINY, "--out", "/sys/rep"], "cannot write in /sys")
    assert (rep / "attention-cpu.md").read_bytes() == b"mine" and [p.name for p in rep.iterdir()] == ["attention-cpu.md"]
    assert (tmp_path / "afile").read_bytes() == b"a file"


def test_report_into_a_folder_of_other_files(tmp_path):
    rep = tmp_path / "rep"
    rep.mkdir()
    (rep / "notes.txt").write_text("mine")
    assert main(["report", *TINY, "--out", str(rep)]) == 0
    assert sorted(p.name for p in rep.iterdir()) == sorted(["notes.txt", *report.file_names("cpu").values()])


def test_report_files_appear_together_or_not_at_all(tmp_path, monkeypatch):
    points = [report.Point("cpu", 1, 16, "turboquant_k8v4", 0.1, 100), report.Point("cpu", 1, 16, "ort_gqa_fp32", 0.2, 400)]
    monkeypatch.setattr(report, "plots", lambda *a: (_ for _ in ()).throw(RuntimeError("no plot")))
    with pytest.raises(RuntimeError):
        report.write(points, tmp_path / "rep")
    assert list(tmp_path.iterdir()) == []  # the folder made for the report too

    def plots_and_a_file_meanwhile(points, folder):  # another program takes the last name while we write
        (tmp_path / "rep" / "attention-cpu-bandwidth.png").write_bytes(b"theirs")
        for name in ("time", "bandwidth"):
            (folder / f"attention-cpu-{name}.png").write_bytes(b"ours")

    monkeypatch.setattr(report, "plots", plots_and_a_file_meanwhile)
    with pytest.raises(ValueError, match="appeared while it was being written"):
        report.write(points, tmp_path / "rep")
    assert [p.name for p in (tmp_path / "rep").iterdir()] == ["attention-cpu-bandwidth.png"]
    assert (tmp_path / "rep" / "attention-cpu-bandwidth.png").read_bytes() == b"theirs"
