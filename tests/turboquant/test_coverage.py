"""The architecture coverage run (turboquant/coverage.py): a tiny random model of every architecture
that the installed onnxruntime-genai builder and transformers take, built for the CPU, rewritten
with the default preset and run through og.Generator against its original (teacher-forced top-1
>= 85%); the CUDA build's rewrite as a dry run where it differs (the fused Q/K norm). What each
gets is asserted: every attention layer compressed (boundary layers raw16), the windows, softcaps
and sinks of Gemma 2, Gemma 3 and gpt-oss kept in the rewritten ops, the state layers of LFM2
and Qwen3.5 (conv, recurrent) left as they were. The table is printed
(pytest -s; docs/usage.md holds a copy)."""

import pytest

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")
pytest.importorskip("transformers")

from turboquant import coverage  # noqa: E402
from turboquant.architectures import ARCHITECTURES, by_name  # noqa: E402

# what the genai builds of the windowed, softcapped and sink architectures hold (the rewrite keeps it)
FEATURES = {
    "Gemma 2 (softcap, alternating window)": "window 16: layers 0, 2; softcap 50: layers 0-3",
    "Gemma 3 (5 of 6 layers windowed)": "window 16: layers 0-4",
    "gpt-oss (window, sinks, MoE)": "window 16: layers 0, 2; sinks: layers 0-3",
}
# the state layers of the hybrids, which the rewrite leaves untouched
STATES = {
    "LFM2 (conv + attention)": "conv: layers 0-1, 3-4",
    "Qwen3.5 (gated DeltaNet + attention)": "conv: layers 0-1, 3-4; recurrent: layers 0-1, 3-4",
}
# the CUDA build differs from the CPU one (the Q/K norm fused into the op; Qwen3.5's MRoPE in fp32
# between casts): its rewrite is dry-run too
CUDA = {"Qwen3", "LFM2 (conv + attention)", "Qwen3.5 (gated DeltaNet + attention)"}
# no key scales: the builder rotates outside the op (HunYuan: before its Q/K norm; Qwen3.5: MRoPE)
UNSCALED = {"HunYuan dense", "Qwen3.5 (gated DeltaNet + attention)"}


@pytest.fixture(scope="module")
def rows():
    made = []
    yield made
    print("\n" + coverage.table(made))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES, ids=[a.name for a in ARCHITECTURES])
def test_architecture(arch, rows, tmp_path):
    row = coverage.cover(arch, tmp_path, cuda=arch.name in CUDA)
    rows.append(row)
    if row.builder == "none":  # the installed builder and transformers do not both take it
        pytest.skip(row.error)
    assert not row.error, row.error
    assert row.features == FEATURES.get(arch.name, ""), row.features
    assert row.states == STATES.get(arch.name, ""), row.states
    if row.features.startswith("window"):  # genai's window-sized buffers, kept (genai 0.18, a CPU build)
        assert any("window-sized caches (sliding_window_cache) kept" in n for n in row.notes), row.notes
    assert row.compressed and not row.left
    assert row.top1 >= coverage.MIN_TOP1, row.top1
    # key scales for every compressed layer whose op applies the rotary, LongRoPE's computed tables included
    # (read off each window's run)
    unscaled = [n for n in row.notes if "no key scales" in n]
    assert all("no rotary inside the op" in n for n in unscaled), unscaled
    assert bool(unscaled) == (arch.name in UNSCALED), unscaled
    assert any(n.startswith("checked: onnxruntime-genai loaded the folder") for n in row.notes), row.notes
    if arch.name in CUDA:
        assert row.cuda.startswith("dry run: compressed ") and "none" not in row.cuda, row.cuda
    if arch.name in STATES:
        folder = coverage.folder_of(arch, tmp_path)
        for model in (folder / "cpu-fp32", folder / "tq"):
            _decode_loop_follows_genai(model, arch.config_kwargs()["vocab_size"])


def _decode_loop_follows_genai(folder, vocab, providers=("CPUExecutionProvider",)):
    """turboquant's decode loop (SharedBufferDecoder, which the self-generated calibration and the
    evals run) carries a hybrid's states from step to step: its greedy tokens are og.Generator's."""
    import numpy as np

    from turboquant.decode_loop import open_decoder

    ids = np.random.default_rng(0).integers(3, vocab, coverage.PROMPT)
    tokens, _ = coverage.greedy_and_logits(folder, ids, coverage.PROMPT)
    loop = open_decoder(folder / "model.onnx", coverage.PROMPT + coverage.STEPS, providers=providers)
    np.testing.assert_array_equal(loop.generate(ids[None], coverage.STEPS)[0], tokens)
    # lengths (MRoPE's positions made 3-D) where no sequence is padded; padding would pass through the states
    two = np.stack([ids, ids])
    logits, _ = loop.step(two, loop.empty_cache(2), 0, lengths=[coverage.PROMPT] * 2)
    assert (logits[:, -1].argmax(-1) == tokens[0]).all()
    with pytest.raises(ValueError, match="padding through the model's states"):
        loop.step(two, loop.empty_cache(2), 0, lengths=[coverage.PROMPT, coverage.PROMPT - 1])
    with pytest.raises(ValueError, match="static shapes bind the KV caches only"):
        open_decoder(folder / "model.onnx", coverage.PROMPT + coverage.STEPS, providers=providers, static_shapes=True)


# the torch.onnx rows: architectures whose attention torch.onnx writes differently (q/k biases, q/k
# norms, partial rotary, scaled embeddings), TorchScript for each and dynamo for Qwen2 (dynamo's
# exports take minutes on 2 cores); python -m turboquant.coverage --torch runs both for every one
TORCH = [(name, "torchscript") for name in ("Qwen2", "Qwen3", "Phi-2", "Gemma")] + [("Qwen2", "dynamo")]


@pytest.mark.slow
@pytest.mark.parametrize("name, exporter", TORCH, ids=[f"{n}-{e}" for n, e in TORCH])
def test_torch_exports_take_the_in_place_form(name, exporter, tmp_path):
    """The same architectures exported by torch.onnx: the default rewrite gives them the in-place
    cache form (no window: nothing in them needs the exporter's masks)."""
    forms = coverage.torch_forms(by_name(name), tmp_path, (exporter,))
    assert forms == {exporter: "in-place"}, forms


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(STATES))
def test_hybrid_cuda_build_rewritten_and_run_on_cuda(cuda_ready, name, tmp_path):
    """The hybrids' CUDA builds (fp16) rewritten in full (calibrated, the folder checked by
    onnxruntime-genai on CUDA) and run through og.Generator on CUDA against the original:
    teacher-forced top-1 >= 85%, the state layers untouched; turboquant's decode loop on the CUDA
    provider carries the states on the device: its greedy tokens are genai's."""
    import onnxruntime_genai as og
    from turboquant.export import export

    if not og.is_cuda_available():
        pytest.skip("CUDA test skipped: the installed onnxruntime-genai has no CUDA (install onnxruntime-genai-cuda)")
    arch = by_name(name)
    folder = coverage.folder_of(arch, tmp_path)
    try:
        src = coverage.build(arch, folder, "fp16", "cuda")
    except RuntimeError as e:  # the installed builder and transformers do not both take it
        pytest.skip(f"{name}: {e}")
    result = export(src, coverage.PRESET, folder / "tq-cuda" / "model.onnx", boundary=arch.boundary,
                    calibrate="random", progress=False)
    assert result.compressed == [2, 5], result.compressed
    assert any(n.startswith("checked: onnxruntime-genai loaded the folder") for n in result.notes), result.notes
    assert coverage.state_layers(src, result.output) == (STATES[name], "")
    vocab = arch.config_kwargs()["vocab_size"]
    top1 = coverage.teacher_forced_top1(src.parent, result.output.parent, vocab)
    print(f"{name}, CUDA fp16: teacher-forced top-1 {top1:.0%}")
    assert top1 >= coverage.MIN_TOP1, top1
    _decode_loop_follows_genai(src.parent, vocab, providers=["CUDAExecutionProvider"])
    _decode_loop_follows_genai(result.output.parent, vocab, providers=["CUDAExecutionProvider"])
