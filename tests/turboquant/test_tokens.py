"""turboquant.tokens: token files that hold no usable ids are refused with one line naming the file."""

import numpy as np
import pytest

from turboquant.tokens import load_tokens


@pytest.mark.parametrize("name, data, message", [
    ("empty.npy", b"", "not a numpy array of token ids (EOFError"),
    ("cut.npy", None, "not a numpy array of token ids"),
    ("none.npy", np.zeros(0, np.int64), "holds no token ids"),
    ("pickled.npy", np.array([{"a": 1}], object), "not a numpy array of token ids (ValueError"),
    ("float.npy", np.ones(3, np.float32), "expected integer token ids, got float32"),
    ("empty.ids", b"", "holds no token ids"),
    ("huge.ids", b"1 2 " + str(2**70).encode(), f"token id {2**70} is outside the model's vocabulary"),
    ("negative.ids", b"1 -2", "token id -2 is outside the model's vocabulary"),
    ("words.ids", b"1 two", "a .ids file holds whitespace-separated integers"),
])
def test_bad_token_files_are_one_line_naming_the_file(tmp_path, name, data, message):
    path = tmp_path / name
    if isinstance(data, np.ndarray):
        np.save(path, data, allow_pickle=True)
    elif data is None:  # a header and half its array
        np.save(path, np.arange(100, dtype=np.int64))
        path.write_bytes(path.read_bytes()[:-300])
    else:
        path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        load_tokens(path, vocab=1000)
    assert str(path) in str(e.value) and message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_folder_without_a_tokenizer_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "text.txt").write_text("some words")
    (tmp_path / "tok").mkdir()
    with pytest.raises(ValueError) as e:
        load_tokens(tmp_path / "text.txt", tmp_path / "tok")
    assert f"tokenizer {tmp_path / 'tok'}: no tokenizer transformers can load there" in str(e.value)
    assert "\n" not in str(e.value)
