"""Models exported by real exporters (torch.onnx TorchScript and dynamo, optimum) from small random configs."""

import os
import pickle
import shutil

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from filelock import FileLock  # noqa: E402 - torch's dependency

from turboquant import random_decoders  # noqa: E402
from turboquant.export import export  # noqa: E402

MODELS = {
    # name: (config, exporter)
    "llama-gqa-torchscript": (random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64), "torchscript"),
    "gpt2-mha-torchscript": (random_decoders.TinyConfig(family="gpt2", layers=6, hidden=256, heads=4, kv_heads=4, head_dim=64), "torchscript"),
    "llama-gqa-dynamo": (random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64), "dynamo"),
    "qwen2-gqa-dynamo-d128": (random_decoders.TinyConfig(family="qwen2", layers=5, hidden=256, heads=4, kv_heads=1, head_dim=128, seed=3), "dynamo"),
    # half precision: the exported graph attends in float32 (values cast up) and casts back
    "llama-gqa-torchscript-fp16": (random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=96, seed=5), "torchscript-float16"),
    # optimum's exporter (TorchScript under its own patches), run by a Python of its own (optimum-onnx
    # pins transformers < 4.58): skipped where TURBOQUANT_OPTIMUM_PYTHON is not set (.ci/run sets it)
    "llama-gqa-optimum": (random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=6), "optimum"),
    "qwen2-gqa-optimum": (random_decoders.TinyConfig(family="qwen2", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=7), "optimum"),
    # a merged decoder: the attention inside the branches of an If on use_cache_branch
    # (the same model as llama-gqa-torchscript, so the two rewrites must agree to float tolerance)
    "llama-gqa-torchscript-merged": (random_decoders.TinyConfig(family="llama", layers=6, hidden=256, heads=4, kv_heads=2, head_dim=64), "torchscript-merged"),
}


def _shared_root(tmp_path_factory):
    """A folder every xdist worker of this run sees (their base temps' parent), so that each model is
    exported and each rewrite made once per run, not once per worker (--dist loadfile sends the
    files that use one model to both workers)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "export-models"
    root.mkdir(exist_ok=True)
    return root


def _once(folder, make):
    """make(folder)'s result, made by the first worker to ask and read back by the others (the lock
    holds them until it is there)."""
    with FileLock(f"{folder}.lock"):
        done = folder.with_name(folder.name + ".pickle")
        if done.exists():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # an earlier test's failed attempt
        folder.mkdir(parents=True)
        result = make(folder)
        done.write_bytes(pickle.dumps(result))
        return result


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(name) -> path of that model, exported once per run."""
    cache = {}
    root = _shared_root(tmp_path_factory)

    def make(name, folder):
        cfg, exporter = MODELS[name]
        exporter, _, variant = exporter.partition("-")
        if exporter == "optimum":
            path = random_decoders.export_optimum(cfg, folder)
        else:
            path = random_decoders.export(cfg, folder / f"{name}.onnx", exporter, "float16" if variant == "float16" else "float32")
        if variant == "merged":
            path = random_decoders.merge_with_if(path, folder / f"{name}.merged.onnx")
        return path

    def get(name):
        if name not in cache:
            if MODELS[name][1] == "optimum" and random_decoders.optimum_python() is None:
                pytest.skip(f"optimum's exporter needs a Python with optimum-onnx (it pins transformers < 4.58): set "
                            f"{random_decoders.OPTIMUM_PYTHON} (.ci/run makes one)")
            cache[name] = _once(root / name, lambda folder: make(name, folder))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def rewritten(exported, tmp_path_factory):
    """rewritten(name, preset, cache="concat") -> the RewriteResult of that model's rewrite, made once per run."""
    made = {}
    root = _shared_root(tmp_path_factory)

    def get(name, preset, cache="concat"):
        if (name, preset, cache) not in made:
            src = exported(name)
            # the tests' held-out ids are random: the presets calibrate on the same kind, in windows of
            # 256 (the tests decode at most 64 tokens, far from the Lloyd-Max presets' default 1024's
            # span; the default windows are test_self_calibration.py's and test_calibration.py's)
            made[name, preset, cache] = _once(root / f"rw-{name}.{preset}.{cache}", lambda folder: export(
                src, preset, folder / f"{name}.{preset}.{cache}.onnx", cache=cache, progress=False, calibrate="random",
                calibration_window=256))
        return made[name, preset, cache]

    return get
