"""bench's checks before a run: outputs, memory, numbers."""

import argparse

import pytest

from turboquant.bench import checks


def test_two_options_naming_one_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    with pytest.raises(ValueError, match="--plot link/x.png is also --json's file"):
        checks.check_outputs({"--json": "d/x.png", "--plot": "link/x.png"}, plots=("--plot",))
    checks.check_outputs({"--json": "d/x.json", "--plot": "d/x.png", "--other": None}, plots=("--plot",))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d", "link"]


def test_check_fits(monkeypatch):
    monkeypatch.setattr(checks, "host_memory", lambda: 10**9)
    checks.check_fits(10**9, "this")
    with pytest.raises(ValueError, match="this needs about 2 GB of arrays, more than this machine's 1 GB"):
        checks.check_fits(2 * 10**9, "this")


def test_host_memory_is_the_machines():
    import os

    assert checks.host_memory() == pytest.approx(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), rel=0.05)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "-1", "-0.5", "x"])
def test_non_negative_float_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        checks.non_negative_float(text)


def test_non_negative_float_takes():
    assert checks.non_negative_float("0") == 0 and checks.non_negative_float("1e-6") == 1e-6
