"""turboquant.eval keeps the original's log-probabilities, so later comparisons skip its run."""

import json
import os

import pytest

import turboquant.decoder
import turboquant.shared_buffer  # noqa: F401 - its class derives from DecoderSession before a test wraps that in a function
from turboquant.eval import Evaluator, Windows
from turboquant.eval.__main__ import main
from turboquant.tokens import load_tokens

WINDOWS = Windows(context=48, prefill=24, max_tokens=48, batch=2)


def _counting_sessions(monkeypatch):
    """The models DecoderSession is opened on, in order."""
    opened = []
    real = turboquant.decoder.DecoderSession

    def session(model, *a, **kw):
        opened.append(os.fspath(model))
        return real(model, *a, **kw)

    monkeypatch.setattr(turboquant.decoder, "DecoderSession", session)
    return opened


def test_second_evaluator_reuses_the_original_logits(tiny, tmp_path, monkeypatch):
    src, dst, text = tiny
    ids, _ = load_tokens(text)
    opened = _counting_sessions(monkeypatch)
    first = Evaluator(src, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c")
    assert not first.cached and opened == [os.fspath(src)]
    second = Evaluator(src, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c")
    assert second.cached and opened == [os.fspath(src)]  # the original was not run again
    assert second.original == first.original
    a, b = first.compare(dst), second.compare(dst)
    assert (a.mean_kl, a.top1, a.rewritten.perplexity) == (b.mean_kl, b.top1, b.rewritten.perplexity)


def test_other_tokens_settings_or_a_changed_original_miss(tiny, tmp_path, monkeypatch):
    src, _, text = tiny
    ids, _ = load_tokens(text)
    Evaluator(src, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c")
    assert not Evaluator(src, ids[1:], WINDOWS, progress=False, cache_dir=tmp_path / "c").cached
    assert not Evaluator(src, ids, Windows(context=48, prefill=16, max_tokens=48, batch=2), progress=False,
                         cache_dir=tmp_path / "c").cached
    copy = tmp_path / "copy.onnx"  # another path, the same bytes: its own entry
    copy.write_bytes(src.read_bytes())
    assert not Evaluator(copy, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c").cached
    assert Evaluator(copy, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c").cached
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the original re-exported
    assert not Evaluator(copy, ids, WINDOWS, progress=False, cache_dir=tmp_path / "c").cached


def test_cli_says_when_cached_logits_were_used(tiny, tmp_path, capsys):
    src, dst, text = tiny
    base = [str(src), str(dst), "--text", str(text), "--context", "48", "--prefill", "24", "--max-tokens", "48",
            "--no-progress", "--cache-dir", str(tmp_path / "c")]
    assert main(base + ["--json", str(tmp_path / "a.json")]) == 0
    assert "logits kept in" in capsys.readouterr().out
    assert main(base + ["--json", str(tmp_path / "b.json")]) == 0
    assert "cached logits from" in capsys.readouterr().out
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert (a.pop("original_cached"), b.pop("original_cached")) == (False, True)
    assert a == b


def test_no_cache_writes_nothing(tiny, tmp_path, capsys):
    src, dst, text = tiny
    assert main([str(src), str(dst), "--text", str(text), "--context", "48", "--prefill", "24", "--max-tokens", "48",
                 "--no-progress", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "cached" not in out and "kept in" not in out
    assert not (tmp_path / "cache").exists()  # $TURBOQUANT_CACHE, set by conftest


def test_default_folder_and_bad_cache_dir(tiny, tmp_path, capsys):
    src, dst, text = tiny
    base = [str(src), str(dst), "--text", str(text), "--context", "48", "--prefill", "24", "--max-tokens", "48",
            "--no-progress"]
    assert main(base) == 0
    assert len(list((tmp_path / "cache" / "eval").iterdir())) == 1  # $TURBOQUANT_CACHE/eval
    (tmp_path / "f").write_text("")
    for extra, message in [(["--cache-dir", str(tmp_path / "f")], "is a file, not a folder"),
                           (["--cache-dir", str(tmp_path / "d"), "--no-cache"], "contradict")]:
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
