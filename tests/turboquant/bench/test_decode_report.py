"""decode_report's outputs: a new file each, never written over one; the records file saved again
during a run replaces only the file that run made."""

import json

import pytest

from turboquant.bench import decode, decode_report
from turboquant.saving import OutputExists


def _records(n=1):
    return [decode.Record(f"m{i}.onnx", "cpu", 1, 16, 1.0, 1000.0, 2.0, 100, None) for i in range(n)]


def test_write_json_and_plot_never_over_a_file(tmp_path):
    for path, write in [(tmp_path / "r.json", decode_report.write_json), (tmp_path / "r.png", decode_report.plot)]:
        path.write_bytes(b"keep")
        with pytest.raises(OutputExists):
            write(_records(), path)
        assert path.read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]


def test_records_saved_again_replace_their_own_file_only(tmp_path):
    path = tmp_path / "sub" / "r.json"
    out = decode_report.JsonRecords(path)
    out.save(_records(1))
    out.save(_records(2))
    assert len(json.loads(path.read_text())) == 2 and [p.name for p in path.parent.iterdir()] == ["r.json"]
    path.unlink()
    path.write_text("theirs")  # another file under the name meanwhile
    with pytest.raises(OutputExists, match="removed or replaced"):
        out.save(_records(3))
    assert path.read_text() == "theirs" and [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_records_never_start_over_a_file(tmp_path):
    (tmp_path / "r.json").write_text("theirs")
    with pytest.raises(OutputExists):
        decode_report.JsonRecords(tmp_path / "r.json").save(_records())
    assert (tmp_path / "r.json").read_text() == "theirs"
