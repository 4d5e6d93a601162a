"""turboquant.saving: outputs never replace a file, appear whole or not at all, and leave no staging behind."""

import errno
import os

import pytest

from turboquant import saving


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("kind", ["file", "folder", "broken link"])
def test_refuse_existing_names_what_exists(tmp_path, kind):
    taken = tmp_path / "taken"
    if kind == "file":
        taken.write_text("user's")
    elif kind == "folder":
        taken.mkdir()
    else:
        taken.symlink_to(tmp_path / "nowhere")
    saving.refuse_existing([tmp_path / "free"])
    with pytest.raises(saving.OutputExists, match=f"--json {taken} exists; turboquant does not overwrite"):
        saving.refuse_existing([tmp_path / "free", taken], "--json")


def test_write_new_writes_through_a_staged_file(tmp_path):
    seen = []

    def write(p):
        seen.append(p)
        p.write_bytes(b"new")

    out = tmp_path / "sub" / "out.bin"
    saving.write_new(out, write)
    assert out.read_bytes() == b"new"
    assert seen[0] != out and seen[0].name == out.name
    assert _names(out.parent) == ["out.bin"]  # the staging folder went with the write


def test_write_new_leaves_the_users_file_as_it_was(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("user's")
    with pytest.raises(saving.OutputExists, match="out.txt exists"):
        saving.write_new_text(out, "new")
    assert out.read_text() == "user's"
    assert _names(tmp_path) == ["out.txt"]


def test_a_failed_write_leaves_nothing(tmp_path):
    def write(p):
        p.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        saving.write_new(tmp_path / "out.txt", write)
    assert _names(tmp_path) == []


def test_a_name_taken_while_writing_is_not_replaced(tmp_path):
    out = tmp_path / "out.txt"

    def write(p):
        out.write_text("another writer's")  # the name taken between the check and the publish
        p.write_text("ours")

    with pytest.raises(saving.OutputExists, match="appeared while it was being written; left as it was"):
        saving.write_new(out, write)
    assert out.read_text() == "another writer's"
    assert _names(tmp_path) == ["out.txt"]


def test_publish_is_all_or_nothing(tmp_path):
    with saving.staging(tmp_path) as stage:
        a, b = stage / "a", stage / "b"
        a.write_text("a")
        b.write_text("b")
        (tmp_path / "b").write_text("user's")
        with pytest.raises(saving.OutputExists, match="b appeared"):
            saving.publish([(a, tmp_path / "a"), (b, tmp_path / "b")])
        assert not (tmp_path / "a").exists()  # named first, removed again when b failed
    assert (tmp_path / "b").read_text() == "user's"
    assert _names(tmp_path) == ["b"]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EXDEV])
def test_file_systems_without_hard_links_get_a_checked_rename(tmp_path, monkeypatch, code):
    def no_links(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(saving.os, "link", no_links)
    saving.write_new_text(tmp_path / "out.txt", "new")
    assert (tmp_path / "out.txt").read_text() == "new"
    with pytest.raises(saving.OutputExists, match="out.txt exists"):
        saving.write_new_text(tmp_path / "out.txt", "newer")
    assert (tmp_path / "out.txt").read_text() == "new"


def test_other_link_errors_are_raised(tmp_path, monkeypatch):
    def failing(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(saving.os, "link", failing)
    with pytest.raises(OSError, match="I/O error"):
        saving.write_new_text(tmp_path / "out.txt", "new")
    assert _names(tmp_path) == []


def test_save_new_figure_takes_the_format_from_the_suffix(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    try:
        saving.save_new_figure(fig, tmp_path / "plot.svg")
        with pytest.raises(saving.OutputExists, match="--plot .*plot.svg exists"):
            saving.save_new_figure(fig, tmp_path / "plot.svg")
    finally:
        plt.close(fig)
    assert (tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")


def test_folders_made_for_an_output_go_when_it_fails(tmp_path):
    def write(p):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        saving.write_new(tmp_path / "a" / "b" / "out.json", write)
    assert _names(tmp_path) == []
    saving.write_new_text(tmp_path / "a" / "b" / "out.json", "{}")
    assert (tmp_path / "a" / "b" / "out.json").read_text() == "{}"


def test_publish_folder_never_replaces(tmp_path):
    with saving.staging(tmp_path / "repo") as stage:
        (stage / "model" / "1").mkdir(parents=True)
        (tmp_path / "repo" / "model").mkdir()  # even an empty folder, which a plain rename would replace
        with pytest.raises(saving.OutputExists, match="model appeared while it was being written"):
            saving.publish_folder(stage / "model", tmp_path / "repo" / "model")
        saving.publish_folder(stage / "model", tmp_path / "repo" / "other")
    assert _names(tmp_path / "repo") == ["model", "other"]
    assert _names(tmp_path / "repo" / "other") == ["1"] and _names(tmp_path / "repo" / "model") == []


def test_publish_folder_without_renameat2_checks_then_renames(tmp_path, monkeypatch):
    monkeypatch.setattr(saving, "_rename_noreplace", lambda src, dst, what: False)
    (tmp_path / "a").mkdir()
    (tmp_path / "taken").mkdir()
    with pytest.raises(saving.OutputExists, match="taken exists"):
        saving.publish_folder(tmp_path / "a", tmp_path / "taken")
    saving.publish_folder(tmp_path / "a", tmp_path / "b")
    assert _names(tmp_path) == ["b", "taken"]
