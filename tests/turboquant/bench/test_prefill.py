"""The prefill bench on the CPU: prompts and continuation chunks through ours and ORT's attention in one run."""

import json

import pytest

from turboquant.bench.__main__ import main

SMALL = ["--device", "cpu", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--threads", "1", "--repeat", "1"]


def test_prefill_bench_times_prompts_and_chunks_against_ort(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    assert main(["prefill", *SMALL, "--batch", "1", "2", "--prompt", "40", "--chunk", "33", "--past", "50",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    names = ["ort_gqa", "ort_attention23", "tq_gqa:turboquant_4bit_nc", "tq_attention:turboquant_4bit_nc"]
    points = [(1, 40, 0), (2, 40, 0), (1, 33, 50), (2, 33, 50)]
    assert [(r["batch"], r["new"], r["past"], r["name"]) for r in rows] == [(*p, n) for p in points for n in names]
    # ORT's CPU GroupQueryAttention refuses chunks of several sequences: reported, not fatal
    refused = [r for r in rows if r["ms"] is None]
    assert [(r["name"], r["batch"], r["past"]) for r in refused] == [("ort_gqa", 2, 50)]
    assert "batch_size must be 1" in refused[0]["error"]
    assert all(r["ms"] > 0 and r["dtype"] == "fp32" for r in rows if r not in refused)
    printed = capsys.readouterr().out
    assert "tq / ort" in printed and printed.count(" of gqa") == 6 and printed.count(" of attention23") == 8


def test_prefill_bench_skips_a_baseline_too_large_for_memory(capsys):
    assert main(["prefill", *SMALL, "--batch", "1", "--prompt", "40", "--chunk", "--baselines", "gqa",
                 "--max-baseline-gb", "1e-6"]) == 0
    printed = capsys.readouterr().out
    assert "ort_gqa" in printed and "skipped: its probabilities need" in printed
    assert "ort_attention23" not in printed and "of gqa" not in printed


def test_prefill_bench_needs_something_to_time(capsys):
    assert main(["prefill", *SMALL, "--prompt", "--chunk"]) == 2
    assert "no --prompt and no --chunk" in capsys.readouterr().err


def test_prefill_bench_refuses_a_length_that_is_not_positive():
    with pytest.raises(SystemExit) as e:
        main(["prefill", "--prompt", "0"])
    assert e.value.code == 2


def test_prefill_bench_refuses_a_json_path_it_cannot_write(tmp_path, capsys):
    assert main(["prefill", *SMALL, "--prompt", "40", "--chunk", "--json", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def _refused(capsys, argv, message):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and message in err.strip().splitlines()[-1], err


def test_prefill_bench_never_writes_over_a_file(tmp_path, capsys):
    taken = tmp_path / "pf.json"
    taken.write_bytes(b"keep")
    _refused(capsys, ["prefill", *SMALL, "--prompt", "16", "--chunk", "--json", str(taken)], "--json")
    assert taken.read_bytes() == b"keep" and [p.name for p in tmp_path.iterdir()] == ["pf.json"]


def test_prefill_bench_makes_the_json_folder(tmp_path):
    out = tmp_path / "nodir" / "pf.json"
    assert main(["prefill", *SMALL, "--batch", "1", "--prompt", "16", "--chunk", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 4 and [p.name for p in out.parent.iterdir()] == ["pf.json"]


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-inf", "lots"])
def test_prefill_bench_refuses_a_memory_limit_that_is_no_size(value, capsys):
    _refused(capsys, ["prefill", *SMALL, "--prompt", "16", "--chunk", "--max-baseline-gb", value],
             "argument --max-baseline-gb")


def test_prefill_bench_refuses_arrays_larger_than_the_machine(capsys):
    _refused(capsys, ["prefill", *SMALL, "--batch", "1", "--prompt", "16", "--chunk", "1000", "--past", "2000000000"],
             "--chunk 1000 at batch 1 over --past 2000000000 needs about")
