"""python -m turboquant.bench decode and models on the CPU: tiny models of both builders (same
attention layout as the benchmark's, 3 layers), their rewrites, the records, the capacity search
against the cache layout's byte count, random cache fills, genai's runtime, and the refusals of bad
arguments. No timing is asserted."""

import dataclasses
import json
import pathlib

import numpy as np
import onnx
import pytest

from turboquant import node_models, random_decoders
from turboquant.bench import __main__ as bench
from turboquant.bench import cache_fill, cache_layout, decode, decode_models, decode_report
from turboquant.config import packed_size

FIELDS = {"model", "device", "batch", "context", "ms_per_step", "tokens_per_s", "ttft_ms", "kv_bytes", "peak_bytes",
          "fill", "ttft_how", "runtime"}
TINY = decode_models.SHAPES["tiny"]


def _bytes_per_token(rewritten: bool, genai: bool, concat: bool = False) -> int:
    """Cache bytes per token of the tiny models, from their config alone: 3 layers, 2 KV heads of 64,
    fp32; the rewrite packs layer 1 (boundary 1) as mse4 keys and uint4 values, in uint8 rows of the
    wider format's width (both rows of one shape, as GroupQueryAttention takes them), or each of its
    own size in the concat form; genai's boundary layers keep raw16 rows, an export's its fp32 rows."""
    h, d = TINY.kv_heads, TINY.head_dim
    if not rewritten:
        return TINY.layers * 2 * h * d * 4
    if concat:
        return 2 * 2 * h * d * 4 + h * (packed_size("mse4", d) + packed_size("uint4", d))
    packed = 2 * h * max(packed_size("mse4", d), packed_size("uint4", d))
    return 2 * 2 * h * 2 * d + packed if genai else 2 * 2 * h * d * 4 + packed


@pytest.fixture(scope="module")
def built(module_tmp):
    """Both builders through the `models` command, each with its rewrite."""
    out = {}
    for builder in decode_models.BUILDERS:
        if builder == "genai":
            pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the genai models")
        folder = module_tmp.mktemp("models") / builder
        assert bench.main(["models", "--shape", "tiny", "--builder", builder, "--precision", "fp32", "--device", "cpu",
                           "-o", str(folder), "--rewrite"]) == 0
        out[builder] = (folder / "model" / "model.onnx", folder / "tq" / "model.onnx")
    return out


def _decode(tmp_path, *args) -> list[dict]:
    path = tmp_path / "r.json"
    assert bench.main(["decode", *map(str, args), "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_models_of_both_builders(built):
    for builder, (orig, tq) in built.items():
        o, t = cache_layout.inspect(orig), cache_layout.inspect(tq)
        assert o.layers == t.layers == TINY.layers and o.preset is None and t.preset == "turboquant_4bit_nc"
        assert o.shared == (builder == "genai") and [c.heads for c in o.caches] == [TINY.kv_heads] * 2 * TINY.layers
        compressed = [c.layer for c in t.caches if c.key_format not in (None, "raw16")]
        assert compressed == [1, 1]  # boundary 1 on a 3-layer model
    assert (built["genai"][1].parent / "genai_config.json").is_file()


@pytest.mark.parametrize("builder", decode_models.BUILDERS)
@pytest.mark.parametrize("batch", [1, 3])
def test_records_are_well_formed(built, tmp_path, builder, batch):
    orig, tq = built[builder]
    recs = _decode(tmp_path, orig, tq, "--context", 40, "--steps", 3, "--batch", batch, "--prefill-chunk", 16)
    assert [r["model"] for r in recs] == [str(orig), str(tq)]
    for r, rewritten in zip(recs, (False, True)):
        assert FIELDS <= set(r) and r["error"] is None
        assert (r["device"], r["batch"], r["context"], r["runtime"], r["fill"]) == ("cpu", batch, 40, "ort", "prefill")
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] == pytest.approx(batch * 1000 / r["ms_per_step"])
        # GroupQueryAttention (genai models, in-place rewrites) refuses a chunk after the first at batch > 1: one call there
        one_call = (builder == "genai" or rewritten) and batch > 1
        assert r["ttft_ms"] > 0 and ("in one call" if one_call else "chunks of 16") in r["ttft_how"]
        assert r["kv_bytes"] == batch * 40 * _bytes_per_token(rewritten, builder == "genai")
        assert r["peak_bytes"] is None or r["peak_bytes"] >= 0
        assert r["loop"].startswith("SharedBufferDecoder" if builder == "genai" or rewritten else "DecoderSession")


@pytest.mark.parametrize("builder", decode_models.BUILDERS)
def test_random_fill_for_original_and_rewritten(built, tmp_path, builder):
    orig, tq = built[builder]
    recs = _decode(tmp_path, orig, tq, "--context", 700, "--steps", 2, "--fill", "random", "--ttft-budget", 0)
    for r in recs:
        assert r["error"] is None and r["fill"].startswith("random") and r["ms_per_step"] > 0
        assert r["ttft_ms"] is None and "not measured" in r["ttft_how"]
    (tmp_path / "again").mkdir()
    recs = _decode(tmp_path / "again", orig, tq, "--context", 50, 60, "--steps", 2, "--fill", "random",
                   "--ttft-max-tokens", 55)
    assert [r["ttft_ms"] is not None for r in recs] == [True, False, True, False]
    assert all(r["ttft_how"].startswith("prefill of 50") for r in recs if r["context"] == 50)
    assert all("above --ttft-max-tokens 55" in r["ttft_how"] for r in recs if r["context"] == 60)


@pytest.fixture(scope="module")
def concat(built, module_tmp):
    """The tiny TorchScript export rewritten with --cache concat."""
    from turboquant.export import export

    orig = built["torchscript"][0]
    return export(orig, "turboquant_4bit_nc", module_tmp.mktemp("concat") / "model.onnx", boundary=1, cache="concat",
                  progress=False).output


@pytest.mark.parametrize("fill", ["prefill", "random"])
def test_concat_rewrite_of_an_export(built, concat, tmp_path, fill):
    """An exported decoder rewritten in the concat form runs in DecoderSession, growing caches of
    each format's own row size."""
    orig = built["torchscript"][0]
    extra = ["--prefill-chunk", 16] if fill == "prefill" else ["--ttft-budget", 0]
    recs = _decode(tmp_path, orig, concat, "--context", 40, "--steps", 2, "--fill", fill, *extra)
    assert all(r["error"] is None and r["loop"].startswith("DecoderSession") for r in recs)
    assert recs[1]["kv_bytes"] == 40 * _bytes_per_token(True, False, concat=True)


def test_random_fill_repeats_packed_rows_of_the_layout(built):
    t = cache_layout.inspect(built["torchscript"][1])
    fill = cache_fill.RandomFill("cpu")
    caches = fill.caches(t.caches, 2, cache_fill.UNIT + 10, numpy=True)
    for c in t.caches:
        a = caches[c.name]
        assert a.shape == (2, c.heads, cache_fill.UNIT + 10, c.width) and a.dtype == c.dtype
        np.testing.assert_array_equal(a[:, :, cache_fill.UNIT:], a[:, :, :10])
    packed = [c for c in t.caches if c.dtype is np.uint8]
    assert {c.key_format for c in packed} == {"mse4", "uint4"} and all(c.head_dim == TINY.head_dim for c in packed)
    assert len(np.unique(caches[packed[0].name][..., :2])) > 1  # packed random vectors, not zeros


class _CountingDecoder:
    """A decode loop's interface that counts its calls: logits of zeros, no cache."""

    def __init__(self):
        self.calls = []

    def empty_cache(self, b):
        return None

    def step(self, ids, cache, past):
        self.calls.append((ids.shape[1], past))
        return np.zeros((ids.shape[0], ids.shape[1], 4), np.float32), None


@pytest.mark.parametrize("warmup", [False, True])
def test_ttft_prefill_runs_the_prompt_once_untimed_first(warmup):
    dec = _CountingDecoder()
    secs, _, done = decode.prefill(dec, np.zeros((2, 40), np.int64), 16, warmup=warmup)
    once = [(16, 0), (16, 16), (8, 32)]
    assert secs >= 0 and done == 40 and dec.calls == once * (2 if warmup else 1)


def test_tensors_over_one_kernels_limit(built, monkeypatch):
    """Caches larger than one ORT fill or Expand launch takes (MAX_ELEMENTS, made small here): the
    capacity check holds the same bytes in pieces of whole sequences, and the random fill goes
    through the host with the same rows as the Expand path."""
    t = cache_layout.inspect(built["torchscript"][1])
    want = cache_fill.allocate(t.caches, 3, 40, "cpu")
    small = cache_fill.RandomFill("cpu", seed=3).caches(t.caches, 3, cache_fill.UNIT + 10, numpy=True)
    monkeypatch.setattr(cache_fill, "MAX_ELEMENTS", min(c.heads * 40 * c.width for c in t.caches))
    assert cache_fill.allocate(t.caches, 3, 40, "cpu") == want == 3 * 40 * sum(c.row_bytes for c in t.caches)
    big = cache_fill.RandomFill("cpu", seed=3).caches(t.caches, 3, cache_fill.UNIT + 10, numpy=True)
    for c in t.caches:
        np.testing.assert_array_equal(big[c.name], small[c.name])


@pytest.mark.parametrize("budget", [10**5, 10**6, 3 * 10**6 + 7])
@pytest.mark.parametrize("builder", decode_models.BUILDERS)
def test_capacity_agrees_with_the_layout(built, tmp_path, builder, budget):
    orig, tq = built[builder]
    s, b = 64, 2
    recs = _decode(tmp_path, orig, tq, "--context", s, "--batch", b, "--steps", 1, "--capacity", budget, "--fill", "random",
                   "--ttft-budget", 0)
    for r, rewritten in zip(recs, (False, True)):
        per = _bytes_per_token(rewritten, builder == "genai")
        assert r["capacity_batch"] == budget // (s * per) and r["capacity_context"] == budget // (b * per)
        assert r["capacity_batch"] * s * per <= budget < (r["capacity_batch"] + 1) * s * per
        if r["capacity_batch"]:
            assert r["capacity_check"] == f"allocated {r['capacity_batch'] * s * per} bytes on cpu for batch {r['capacity_batch']}"


def test_points_of_a_sweep(built, tmp_path, capsys):
    """Several (batch, context) points: one record per model and point, models in the order given,
    a table per point; a lone --batch pairs with every context."""
    orig, tq = built["genai"]
    recs = _decode(tmp_path, orig, tq, "--context", 20, 90, "--batch", 2, "--steps", 2)
    assert [(r["model"], r["batch"], r["context"]) for r in recs] == [
        (str(orig), 2, 20), (str(orig), 2, 90), (str(tq), 2, 20), (str(tq), 2, 90)]
    assert all(r["error"] is None and r["kv_bytes"] == 2 * r["context"] * _bytes_per_token(r["model"] == str(tq), True)
               for r in recs)
    assert capsys.readouterr().out.count("| model |") == 2
    _fails(capsys, ["decode", str(orig), "--context", "20", "30", "--batch", "1", "2", "3"], "--context")


def test_rounds_alternate_the_models_each_in_a_process_of_its_own(built, tmp_path, capfd):
    """--rounds 3 --isolate: A B, B A, A B, each model of each round in a spawned process; one record
    per model, its ms/step the median of its rounds, each round's kept, the table saying how."""
    orig, tq = built["torchscript"]
    recs = _decode(tmp_path, orig, tq, "--context", 20, "--steps", 2, "--rounds", 3, "--isolate")
    err = capfd.readouterr()
    order = [line.split(": ", 1)[1].split(" (")[0] for line in err.err.splitlines() if line.startswith("round ")]
    assert order == [str(orig), str(tq), str(tq), str(orig), str(orig), str(tq)]
    assert err.err.count("a process of its own") == 6
    assert [r["model"] for r in recs] == [str(orig), str(tq)]
    for r in recs:
        assert r["error"] is None and len(r["round_ms"]) == 3 and all(v > 0 for v in r["round_ms"])
        assert r["ms_per_step"] == pytest.approx(float(np.median(r["round_ms"])))
        assert "median of 3 rounds" in r["rounds_how"] and "process of its own" in r["rounds_how"]
    assert "median of 3 rounds" in err.out and f"({min(recs[0]['round_ms']):.2f}-" in err.out


def test_rounds_record_a_round_that_failed(monkeypatch):
    """A round whose process died is recorded as failed for that model, not hidden by the others."""
    rec = decode.Record("m.onnx", "cpu", 1, 20, 2.0, 500.0, 10.0, 100, None)
    bad = decode.Record("m.onnx", "cpu", 1, 20, None, None, None, 100, None, error="BrokenProcessPool: killed")
    merged = decode._merged([rec, bad, dataclasses.replace(rec, ms_per_step=4.0)], "how")
    assert merged.round_ms == [2.0, None, 4.0] and merged.ms_per_step == 3.0
    assert merged.error == "1 of 3 rounds failed: BrokenProcessPool: killed"


def test_genai_runtime(built, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    orig, tq = built["genai"]
    recs = _decode(tmp_path, orig.parent, tq.parent, "--context", 30, "--steps", 3, "--runtime", "genai")
    for r in recs:
        assert r["error"] is None and r["runtime"] == "genai" and "og.Generator" in r["loop"]
        assert r["ms_per_step"] > 0 and r["ttft_ms"] > 0 and "append_tokens of 30" in r["ttft_how"]


def test_table_and_plot(built, tmp_path, capsys):
    orig, tq = built["torchscript"]
    assert bench.main(["decode", str(orig), str(tq), "--context", "20", "--steps", "2", "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "| model |" in out and "1.00x" in out and "prefill of 20 tokens in one call" in out
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_gpu_busy_column_where_a_record_has_it():
    """The CUDA records' device time per step gets its own column and note; CPU tables stay without."""
    from turboquant.bench import decode_report

    recs = [decode.Record("a/m.onnx", "cuda", 8, 4096, 16.9, 473.0, None, 10**9, None, steps=8, gpu_ms_per_step=12.3),
            decode.Record("b/m.onnx", "cuda", 8, 4096, 12.0, 666.0, None, 4 * 10**8, None, steps=8, gpu_ms_per_step=None)]
    lines = decode_report.point_table(recs).splitlines()
    assert "| model | ms/step | GPU ms/step | tokens/s |" in lines[2]
    assert lines[4].startswith("| a/m.onnx | 16.90 | 12.30 [2] | 473.0 |") and lines[5].startswith("| b/m.onnx | 12.00 | - | 666.0 |")
    assert any(line.startswith("[2] the device's busy time per step") for line in lines)
    for r in recs:
        r.gpu_ms_per_step = None
    assert "GPU ms/step" not in decode_report.point_table(recs)


def _fails(capsys, argv: list[str], arg: str) -> str:
    try:
        rc = bench.main(argv)
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and f"argument {arg}" in err, err
    return err


def test_bad_arguments_exit_2_naming_the_argument(built, tmp_path, capsys):
    orig, tq = map(str, built["torchscript"])
    _fails(capsys, ["decode", orig, tq, "--batch", "0"], "--batch")
    _fails(capsys, ["decode", orig, tq, "--context", "0"], "--context")
    _fails(capsys, ["decode", orig, tq, "--steps", "-1"], "--steps")
    _fails(capsys, ["decode", orig, tq, "--capacity", "0"], "--capacity")
    _fails(capsys, ["decode", orig, tq, "--rounds", "0"], "--rounds")
    onnx.save(node_models.pack_model("mse4", 64), tmp_path / "nocache.onnx")
    assert "no KV cache" in _fails(capsys, ["decode", str(tmp_path / "nocache.onnx")], "MODEL")
    _fails(capsys, ["decode", str(tmp_path / "absent.onnx")], "MODEL")
    (tmp_path / "taken.json").write_text("[]")
    _fails(capsys, ["decode", orig, tq, "--json", str(tmp_path / "taken.json")], "--json")
    assert (tmp_path / "taken.json").read_text() == "[]"
    _fails(capsys, ["decode", orig, tq, "--runtime", "genai"], "MODEL")
    _fails(capsys, ["decode", *map(str, built["genai"]), "--runtime", "genai", "--fill", "random"], "--fill")
    assert "needs --device cuda" in _fails(capsys, ["decode", orig, tq, "--cuda-graph"], "--cuda-graph")
    _fails(capsys, ["decode", *map(str, built["genai"]), "--runtime", "genai", "--cuda-graph"], "--cuda-graph")
    # turboquant's loop replays graphs of buffers written in place only: the original's caches grow
    err = _fails(capsys, ["decode", orig, tq, "--device", "cuda", "--cuda-graph"], "MODEL")
    assert f"{orig}: --cuda-graph needs caches written in place" in err and "DecoderSession" in err
    err = _fails(capsys, ["decode", orig, tq, "--device", "cuda", "--cuda-graph", "3"], "--cuda-graph")
    assert "model numbers run from 1 to 2, not 3" in err
    _fails(capsys, ["decode", orig, tq, "--device", "cuda", "--cuda-graph", "0"], "--cuda-graph")
    _fails(capsys, ["models", "--shape", "tiny", "--builder", "torchscript", "-o", str(tmp_path)], "-o")


def test_cuda_graph_runs_shared_buffer_models_only(built, concat, capsys):
    """--cuda-graph with the ort runtime: genai folders and in-place rewrites pass the argument checks
    (on to the device's), a concat rewrite is refused by name; decode.run records SharedBufferDecoder's
    refusal of a CPU provider and the loop it would have run."""
    from turboquant.arguments import cuda_missing

    genai_orig, genai_tq = map(str, built["genai"])
    if cuda_missing():
        _fails(capsys, ["decode", genai_orig, genai_tq, str(built["torchscript"][1]), "--other-exporters", "--device", "cuda",
                        "--cuda-graph"], "--device")
    assert f"{concat}: --cuda-graph" in _fails(capsys, ["decode", str(concat), "--device", "cuda", "--cuda-graph"], "MODEL")
    paths = [str(p) for p in built["torchscript"]]
    opts = decode.Options(points=[(1, 20)], steps=1, fill="random", ttft_budget=0, cuda_graph=True)
    recs = decode.run(paths, [cache_layout.inspect(p) for p in paths], opts, log=lambda s: None)
    assert recs[0].error.startswith(f"ValueError: {paths[0]}: CUDA graphs need caches written in place")
    assert "CUDAExecutionProvider as the first provider" in recs[1].error
    assert recs[1].loop == "SharedBufferDecoder, CUDA graphs for the decode steps (the prompt without)"
    # graphs for the listed models only: the original runs as ever, the rewrite twice, without and with
    opts = dataclasses.replace(opts, graph_models=(2,))
    recs = decode.run([*paths, paths[1]], [cache_layout.inspect(p) for p in [*paths, paths[1]]], opts, log=lambda s: None)
    assert [r.cuda_graph for r in recs] == [False, False, True]
    assert recs[0].error is None and recs[1].error is None and recs[1].loop == "SharedBufferDecoder"
    assert "CUDAExecutionProvider as the first provider" in recs[2].error
    rows = [line for line in decode_report.table(recs).splitlines() if line.startswith("| ")][1:]
    assert rows[1].startswith(f"| {pathlib.Path(paths[1]).parent.name}/") and "CUDA graphs" not in rows[1]
    assert "(CUDA graphs) | failed: ValueError" in rows[2]


def test_rewrite_of_another_model_is_refused(built, tmp_path, capsys):
    """A rewrite paired with an original it was not made from: another layer count, other KV heads,
    another builder's export of the same shapes."""
    orig, tq = map(str, built["torchscript"])
    deeper = random_decoders.export(random_decoders.TinyConfig(**{**TINY.__dict__, "layers": 4}), tmp_path / "deeper.onnx")
    err = _fails(capsys, ["decode", str(deeper), tq], "MODEL 2")
    assert "4 cache layers against 3" in err or "3 cache layers against 4" in err
    heads = random_decoders.export(random_decoders.TinyConfig(**{**TINY.__dict__, "heads": 2, "kv_heads": 1}), tmp_path / "heads.onnx")
    assert "KV heads" in _fails(capsys, ["decode", str(heads), tq], "MODEL 2")
    _fails(capsys, ["decode", orig, str(built["genai"][1])], "MODEL 2")
    wider = random_decoders.export(random_decoders.TinyConfig(**{**TINY.__dict__, "hidden": 512}), tmp_path / "wider.onnx")
    err = _fails(capsys, ["decode", str(wider), tq], "MODEL 2")
    assert "weight elements against" in err or "weights of shapes" in err
    assert "KV heads" in _fails(capsys, ["decode", str(heads), tq, "--other-exporters"], "MODEL 2")


def test_other_exporters_of_one_architecture(built, tmp_path):
    """--other-exporters: genai's fp32 model (fused QKV) against the TorchScript export's in-place
    rewrite and genai's own, in one process."""
    genai_orig, genai_tq = built["genai"]
    recs = _decode(tmp_path, genai_orig, built["torchscript"][1], genai_tq, "--other-exporters", "--context", 30,
                   "--steps", 2, "--fill", "random", "--ttft-budget", 0)
    assert [r["error"] for r in recs] == [None] * 3 and all(r["loop"].startswith("SharedBufferDecoder") for r in recs)


@pytest.mark.gpu
@pytest.mark.parametrize("builder", decode_models.BUILDERS)
@pytest.mark.parametrize("fill", ["prefill", "random"])
def test_cuda_decode(cuda_ready, built, tmp_path, builder, fill):
    """The same models on the CUDA provider: IO binding with device-resident caches, random caches
    made on the device, the capacity's caches allocated there, peak memory from the device."""
    orig, tq = built[builder]
    recs = _decode(tmp_path, orig, tq, "--device", "cuda", "--context", 300, 600, "--batch", 2, "--steps", 3,
                   "--fill", fill, "--prefill-chunk", 128, "--capacity", 10**7)
    for r in recs:
        assert r["error"] is None and r["device"] == "cuda" and "caches on the device" in r["loop"]
        assert r["ms_per_step"] > 0 and r["fill"].startswith(fill) and r["ttft_ms"] > 0
        assert 0 < r["gpu_ms_per_step"] < 2 * r["ms_per_step"]  # CUPTI saw the steps' kernels
        held = r["capacity_batch"] * r["kv_bytes"] // r["batch"]  # the layout's bytes at the largest batch
        # genai folders add why their longest context stops where it does (genai_config's context_length)
        assert r["capacity_check"].split("; ")[0] == f"allocated {held} bytes on cuda for batch {r['capacity_batch']}"


@pytest.mark.gpu
@pytest.mark.parametrize("fill", ["prefill", "random"])
def test_cuda_graph_decode(cuda_ready, tmp_path, fill):
    """--cuda-graph through turboquant's loop on fp16 models every node of which ORT's CUDA provider
    takes (its GroupQueryAttention is fp16 and bf16 only): genai's builder's CUDA model, its rewrite and
    a TorchScript export's in-place rewrite, each decode step replayed from a graph, the prompt without."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the genai models")
    from turboquant.export import export

    genai = random_decoders.export_genai(TINY, tmp_path / "genai", precision="fp16", provider="cuda")
    genai_tq = export(genai, "turboquant_4bit_nc", tmp_path / "genai_tq" / "model.onnx", boundary=1, offsets=False,
                      progress=False).output
    ts = random_decoders.export(TINY, tmp_path / "ts.onnx", "torchscript", "float16")
    ts_tq = export(ts, "turboquant_4bit_nc", tmp_path / "ts.tq.onnx", boundary=1, cache="in-place", offsets=False,
                   progress=False).output
    recs = _decode(tmp_path, genai, genai_tq, ts_tq, "--other-exporters", "--device", "cuda", "--cuda-graph",
                   "--context", 300, 600, "--batch", 2, "--steps", 3, "--fill", fill)
    for r in recs:
        assert r["error"] is None and r["loop"].endswith("CUDA graphs for the decode steps (the prompt without)")
        assert r["ms_per_step"] > 0 and r["fill"].startswith(fill) and r["ttft_ms"] > 0


@pytest.mark.gpu
def test_cuda_graph_for_listed_models_through_genai(cuda_ready, tmp_path):
    """--cuda-graph 3 through onnxruntime-genai's generator at B = 2: the fp16 original (whose
    GroupQueryAttention refuses genai's graph-mode prompt at B > 1) runs without, the rewrite without
    and with graphs, in one process, the same greedy tokens' timings recorded for all three."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai runs the generator")
    from turboquant.export import export

    genai = random_decoders.export_genai(TINY, tmp_path / "genai", precision="fp16", provider="cuda")
    genai_tq = export(genai, "turboquant_4bit_nc", tmp_path / "genai_tq" / "model.onnx", boundary=1, offsets=False,
                      progress=False).output
    recs = _decode(tmp_path, genai.parent, genai_tq.parent, genai_tq.parent, "--runtime", "genai", "--device", "cuda",
                   "--cuda-graph", 3, "--context", 200, "--batch", 2, "--steps", 3)
    assert [r["error"] for r in recs] == [None] * 3 and [r["cuda_graph"] for r in recs] == [False, False, True]
    assert [r["loop"] for r in recs] == ["onnxruntime-genai og.Generator"] * 2 + ["onnxruntime-genai og.Generator, CUDA graphs"]
    assert all(r["ms_per_step"] > 0 and r["ttft_ms"] > 0 for r in recs)
