"""Quality of a rewritten decoder against its original, through the cache path a user runs.

Each window of the text is prefilled for its first `prefill` tokens, then decoded one token at a time
over the KV cache (teacher forced: the next input is the text's next token, whatever the model
predicted). Every decoded position is scored: perplexity of each model, the relative increase, the
mean KL(original || rewritten) of the next-token distributions and top-1 agreement.

    python -m turboquant.eval model.onnx model.turboquant_4bit_nc.onnx --text book.txt --tokenizer DIR
"""

from .metrics import Comparison, Scores
from .runner import Evaluator, Windows

__all__ = ["Comparison", "Evaluator", "Scores", "Windows"]
