"""Data-free calibration tokens the model writes itself: the original model continues short prompts
of random token ids, by sampling with a fixed seed (or greedily), and its continuations calibrate
the rewrite instead of random ids. Random ids put every layer in states real text never reaches;
the model's own text follows its own distribution, which is what the key offsets and scales should
describe, and it needs no text or tokenizer.

16 sequences of 256 tokens, generated together as one batch (252 decode steps of 16); the
calibration (export/calibrate.py `collect`) prefills them in windows of its own length, sequences
back to back where a window is longer: close to one sequence per window in the eval, at a fraction
of the writing (docs/performance.md, Quality: the calibration's window).
"""

from __future__ import annotations

import os

import numpy as np

from .errors import RewriteError

WINDOW = 256  # tokens per sequence
SEQUENCES = 16  # 4096 tokens: export/calibrate.py CALIBRATION_TOKENS


def check_options(sequences: int, window: int, prompt: int, temperature: float) -> None:
    """Refuses option values that cannot generate calibration text, before any work."""
    for name, value, low in (("sequences", sequences, 1), ("window", window, 2), ("prompt", prompt, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise RewriteError(f"self-generated calibration: {name} must be an integer of at least {low}, got {value!r}")
    if prompt >= window:
        raise RewriteError(f"self-generated calibration: the prompt ({prompt} tokens) must be shorter than the window ({window})")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise RewriteError(f"self-generated calibration: temperature must be a number of 0 (greedy) or more, got {temperature!r}")


def self_generated_tokens(model_path: str | os.PathLike, vocab: int | None, *, sequences: int = SEQUENCES,
                          window: int = WINDOW, prompt: int = 4, temperature: float = 1.0, seed: int = 0,
                          progress: bool = False) -> tuple[np.ndarray | None, str]:
    """sequences x window token ids as one row: each sequence `prompt` random ids over the vocabulary,
    then the original model's continuation (sampled at `temperature`, greedy at 0; seeded by
    `seed`). Returns (None, reason) when the vocabulary size is unknown (vocab None)."""
    check_options(sequences, window, prompt, temperature)
    if vocab is None:
        return None, "none (the vocabulary size is not in the model)"
    from tqdm import tqdm

    from turboquant.decode_loop import open_decoder

    from .qk_norm import runnable_on_cpu

    rng = np.random.default_rng(seed)
    ids = np.zeros((sequences, window), np.int64)
    ids[:, :prompt] = rng.integers(0, vocab, (sequences, prompt))
    try:
        with runnable_on_cpu(model_path) as runnable:
            sess = open_decoder(runnable, window)
            cache = sess.empty_cache(sequences)
            logits, cache = sess.step(ids[:, :prompt], cache, 0)
            for t in tqdm(range(prompt, window), desc="writing calibration text", unit="token", disable=not progress):
                ids[:, t] = _pick(np.asarray(logits[:, -1], np.float64), temperature, rng)
                if t + 1 < window:
                    logits, cache = sess.step(ids[:, t:t + 1], cache, t)
    except (ValueError, RuntimeError) as e:  # the loop's refusal or ONNX Runtime's failure, named
        raise RewriteError(f"self-generated calibration: cannot run {model_path}: {str(e).splitlines()[0][:300]}") from None
    how = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"
    return ids.reshape(-1), (f"data-free (self-generated: {sequences} continuations, {how}, of {prompt} random token ids, "
                             f"seed {seed})")


def _pick(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> np.ndarray:
    """The next token of each row: the argmax (greedy), or a sample of softmax(logits / temperature)
    by the Gumbel-max trick (one draw per vocabulary entry, so the seed fixes every choice)."""
    if temperature == 0:
        return logits.argmax(-1)
    return (logits / temperature + rng.gumbel(size=logits.shape)).argmax(-1)
