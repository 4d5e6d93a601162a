"""The check a rewritten onnxruntime-genai folder passes before the rewrite publishes it.

With onnxruntime-genai installed, "checked" means genai itself loaded the folder (og.Model, which
reads genai_config.json and the custom-op library) and generated CHECK_TOKENS greedy tokens after
a short prompt, in a subprocess (a crash inside genai is a failed check, not a dead rewrite).
Without it, "checked" means what can be known without genai: genai_config.json agrees with the
model (head_size is the widest layer's row, num_key_value_heads each layer's heads; no
sliding_window section, which would give window-sized buffers to caches that hold every position,
unless the ops keep window-sized caches),
and ONNX Runtime runs the model over shared buffers of the shapes genai would allocate
(turboquant.shared_buffer, max_length rows) for the same prompt and tokens. A folder that fails
either is not published: the rewrite ends with the reason, exit status 2. Paged folders (the Engine's,
export/paged.py) are served instead: by og.Engine where genai runs their provider here, else by
turboquant.paged_decoder on the CPU (pools of the shape the Engine allocates). Models no generator runs
alone (genai's exclude_embeds and exclude_lm_head parts) and bfloat16 builds where neither genai
nor ONNX Runtime's CPU provider runs them get the config check only, and the summary says so.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from .errors import RewriteError

PROMPT_TOKENS, CHECK_TOKENS = 8, 4
TIMEOUT_S = 600

_GENAI_RUN = """
import sys, numpy as np, onnxruntime_genai as og
folder, prompt, steps, vocab, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = og.Model(folder)
params = og.GeneratorParams(model)
params.set_search_options(max_length=length, do_sample=False)
gen = og.Generator(model, params)
gen.append_tokens((3 + np.arange(prompt, dtype=np.int32) % max(1, vocab - 3))[None])
for _ in range(steps - 1):
    gen.generate_next_token()
print("generated", gen.get_sequence(0)[prompt:].tolist())
"""


def genai_installed() -> bool:
    from .genai import installed_version

    return installed_version() is not None


def _vocab(config: dict) -> int:
    return int(config.get("model", {}).get("vocab_size") or 32)


def run_with_genai(folder: pathlib.Path) -> str | None:
    """None where genai generated tokens from folder, else its error's last line."""
    config = json.loads((folder / "genai_config.json").read_text())
    cmd = [sys.executable, "-c", _GENAI_RUN, str(folder), str(PROMPT_TOKENS), str(CHECK_TOKENS), str(_vocab(config)),
           str(check_length(config))]
    return _run_check(cmd, "onnxruntime-genai")


def _run_check(cmd: list[str], runtime: str) -> str | None:
    """None where the check subprocess printed "generated", else its error's last line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{runtime} did not finish {CHECK_TOKENS} tokens in {TIMEOUT_S} s"
    if done.returncode == 0 and "generated" in done.stdout:
        return None
    lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit status {done.returncode}")[:600]


def config_problems(model_path: pathlib.Path, config: dict) -> list[str]:
    """Where genai_config.json and the model's cache inputs disagree (module docstring)."""
    import onnx

    decoder = config["model"]["decoder"]
    m = onnx.load(str(model_path), load_external_data=False)
    widths, heads = {}, {}
    for vi in m.graph.input:
        if vi.name.startswith("past_key_values.") or ".past_key" in vi.name:
            dims = vi.type.tensor_type.shape.dim
            if len(dims) == 4:
                widths[vi.name] = dims[3].dim_value or None
                heads[vi.name] = dims[1].dim_value or None
    problems = []
    concrete = {w for w in widths.values() if w}
    if concrete and decoder.get("head_size") != max(concrete):
        problems.append(f"head_size {decoder.get('head_size')} is not the widest cache row, {max(concrete)} bytes")
    kv = {h for h in heads.values() if h}
    if kv and decoder.get("num_key_value_heads") not in kv:
        problems.append(f"num_key_value_heads {decoder.get('num_key_value_heads')} is none of the caches' {sorted(kv)}")
    section = decoder.get("sliding_window")
    if section and not _window_sized(m):
        problems.append("a sliding_window section (onnxruntime-genai 0.18 would give its layers window-sized buffers, "
                        "where the rewritten caches hold every position)")
    return problems


def _window_sized(m) -> bool:
    """Whether the model's attention ops keep window-sized caches (sliding_window_cache)."""
    return any(a.name == "sliding_window_cache" and a.i for n in m.graph.node if n.op_type == "TQGroupQueryAttention"
               for a in n.attribute)


def check_length(config: dict) -> int:
    """The check's max_length: its prompt and tokens, and at least the window and one token more, as a
    window-sized buffer (genai's window plus a slack, clamped to max_length) holds at least the window."""
    section = config.get("model", {}).get("decoder", {}).get("sliding_window") or {}
    return max(PROMPT_TOKENS + CHECK_TOKENS, int(section.get("window_size") or 0) + 1)


def run_with_onnxruntime(model_path: pathlib.Path, config: dict) -> str | None:
    """None where ONNX Runtime ran the prompt and CHECK_TOKENS steps over genai-shaped buffers."""
    import numpy as np

    from turboquant.shared_buffer import SharedBufferDecoder

    max_length = check_length(config)
    try:
        dec = SharedBufferDecoder(model_path, max_length)
        prompt = 3 + np.arange(PROMPT_TOKENS)[None] % max(1, _vocab(config) - 3)
        dec.generate(prompt, max_new_tokens=CHECK_TOKENS - 1)
    except Exception as e:  # noqa: BLE001 - any failure to run is the check's answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:400] if str(e).strip() else ''}"
    return None


def check_folder(folder: pathlib.Path, model_name: str) -> str:
    """Checks the staged folder (module docstring); returns the line the summary prints, or raises
    RewriteError with the reason the folder is not published."""
    config = json.loads((folder / "genai_config.json").read_text())
    model_path = folder / model_name
    problems = config_problems(model_path, config)
    if problems:
        raise RewriteError("the rewritten onnxruntime-genai folder would not run, so it is not written: "
                           + "; ".join(problems))
    not_run = cannot_generate(model_path)
    if not_run:
        return f"checked: genai_config.json agrees with the model; not run, as the model {not_run}"
    if "engine" in config and any(n.op_type == "TQPagedAttention" for n in _nodes(model_path)):
        runs_here, _ = genai_runs_provider(config)
        if runs_here:
            why = run_engine(folder)
            if why is not None:
                raise RewriteError(f"onnxruntime-genai's Engine could not run the rewritten paged folder, so it is not "
                                   f"written: {why}")
            return (f"checked: onnxruntime-genai's Engine loaded the folder and generated {CHECK_TOKENS} tokens for each "
                    "of two requests")
        why = run_paged(model_path)
        if why is not None:
            raise RewriteError(f"ONNX Runtime could not run the rewritten paged model over the Engine's pools, so it is "
                               f"not written: {why}")
        return (f"checked: genai_config.json agrees with the model, and ONNX Runtime's CPU provider generated "
                f"{CHECK_TOKENS} tokens for two requests over pools of the shape the Engine allocates "
                "(turboquant.paged_decoder)")
    runs_here, where = genai_runs_provider(config)
    if not runs_here and _is_bf16(model_path):
        return (f"checked: genai_config.json agrees with the model; not run ({where}, and ONNX Runtime's CPU provider "
                "has no bfloat16 kernels for it)")
    if runs_here:
        why = run_with_genai(folder)
        if why is not None:
            raise RewriteError(f"onnxruntime-genai could not run the rewritten folder, so it is not written: {why}")
        return f"checked: onnxruntime-genai loaded the folder and generated {CHECK_TOKENS} tokens"
    why = run_with_onnxruntime(model_path, config)
    if why is not None:
        raise RewriteError(f"ONNX Runtime could not run the rewritten model over genai's buffers, so it is not written: {why}")
    return (f"checked without onnxruntime-genai ({where}): genai_config.json agrees with the model, and ONNX "
            f"Runtime's CPU provider generated {CHECK_TOKENS} tokens over buffers of the shapes genai allocates")


def _nodes(model_path: pathlib.Path):
    import onnx

    return onnx.load(str(model_path), load_external_data=False).graph.node


_ENGINE_RUN = """
import json, sys, numpy as np, onnxruntime_genai as og
folder, device, prompt, steps, vocab = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
config = og.Config(folder)
if device == "cpu":
    config.clear_providers()
config.overlay(json.dumps({"engine": {"dynamic_batching": {"num_blocks": 8, "block_size": 16, "max_batch_size": 2}}}))
engine = og.Engine(og.Model(config))
requests, got = [], {}
for n in (prompt, 2 * prompt + 3):
    options = og.RequestOptions()
    options.set_max_session_tokens(n + steps)
    request = engine.create_request(options=options)
    turn = og.TurnOptions(request)
    turn.set_max_generated_tokens(steps)
    turn.set_do_sample(False)
    request.begin_turn((3 + np.arange(n) % max(1, vocab - 3)).astype(np.int32), turn)
    requests.append(request)
events = engine.create_event_buffer(16)
while engine.has_pending_requests():
    out = engine.run(events)
    for i in range(len(out)):
        ev = out[i]
        if int(ev.flags.value) & int(og.EngineEventFlags.FAILED.value):
            raise RuntimeError(f"a request failed: {ev.error_code.name}")
        if int(ev.flags.value) & int(og.EngineEventFlags.TOKEN.value):
            got.setdefault(id(ev.request), []).append(int(ev.token))
print("generated", list(got.values()))
"""


def run_engine(folder: pathlib.Path, device: str | None = None) -> str | None:
    """None where onnxruntime-genai's Engine served two requests of CHECK_TOKENS tokens from the paged
    folder (on the folder's provider, or on `device` "cpu"), in a subprocess; else its error's last line."""
    config = json.loads((folder / "genai_config.json").read_text())
    cmd = [sys.executable, "-c", _ENGINE_RUN, str(folder), device or "", str(PROMPT_TOKENS), str(CHECK_TOKENS),
           str(_vocab(config))]
    return _run_check(cmd, "onnxruntime-genai's Engine")


def run_paged(model_path: pathlib.Path) -> str | None:
    """None where ONNX Runtime ran two requests of a paged folder (a prompt, then CHECK_TOKENS - 1
    steps) the way the Engine does; else why not. Blocks of 16 rows, whatever the config says, so the
    check's pools stay small and the requests cross a block."""
    import numpy as np

    from turboquant.paged_decoder import PagedDecoder

    try:
        dec = PagedDecoder(model_path, num_blocks=8, block_size=16)
        vocab = _vocab(json.loads((model_path.parent / "genai_config.json").read_text()))
        prompts = [3 + np.arange(n) % max(1, vocab - 3) for n in (PROMPT_TOKENS, 2 * PROMPT_TOKENS + 3)]
        dec.generate(prompts, CHECK_TOKENS, joins=[0, 1])
    except Exception as e:  # noqa: BLE001 - any failure to run is the check's answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:400] if str(e).strip() else ''}"
    return None


def cannot_generate(model_path: pathlib.Path) -> str | None:
    """Why no generator runs the model alone (a part of genai's pipelines), or None."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    if "input_ids" not in {i.name for i in m.graph.input}:
        return "takes no input_ids (genai's exclude_embeds: the embeddings run in another model)"
    if "logits" not in {o.name for o in m.graph.output}:
        return "has no logits output (genai's exclude_lm_head: the head runs in another model)"
    return None


def _is_bf16(model_path: pathlib.Path) -> bool:
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    bf16 = onnx.TensorProto.BFLOAT16
    return (any(t.data_type == bf16 for t in m.graph.initializer)
            or any(i.type.tensor_type.elem_type == bf16 for i in [*m.graph.input, *m.graph.output]))


def genai_runs_provider(config: dict) -> tuple[bool, str]:
    """Whether the installed genai can run the folder's provider here, and if not, why."""
    if not genai_installed():
        return False, "not installed"
    entries = config["model"]["decoder"].get("session_options", {}).get("provider_options", [])
    providers = [k for e in entries if isinstance(e, dict) for k in e]
    if not providers:
        return True, ""
    if providers[0] == "cuda":
        import onnxruntime_genai as og

        if og.is_cuda_available():
            return True, ""
    return False, f"the folder is for the {providers[0]} provider, which the installed onnxruntime-genai cannot run here"


def staged_view(pairs: list[tuple[pathlib.Path, pathlib.Path]], where: pathlib.Path) -> pathlib.Path:
    """A folder of hard links to the staged files under their final names: the folder as it will be
    published (hard, not symbolic: genai refuses a custom-op library that resolves outside the folder)."""
    import os
    import shutil

    where.mkdir()
    for staged, final in pairs:
        try:
            os.link(staged, where / final.name)
        except OSError:  # a file system without hard links
            shutil.copy2(staged, where / final.name)
    return where
