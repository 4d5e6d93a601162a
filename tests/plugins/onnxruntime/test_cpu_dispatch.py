"""The CPU kernels' two copies (ops/cpu/dispatch.cpp): the copy chosen at load, the baseline copy's
results against the x86-64-v3 copy's, and that no other code of the library uses x86-64-v3 instructions.
The whole op suite also runs on the baseline copy (.ci/run: TURBOQUANT_CPU_BASELINE=1)."""

import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from onnx import TensorProto

import turboquant
from turboquant import node_models
from turboquant.config import ALL_FORMATS
from turboquant.kernel_plan import cpu_instruction_set
from turboquant.ort import inference_session, run

X86 = platform.machine() in ("x86_64", "AMD64")
# x86-64-v3 as /proc/cpuinfo names its features (abm: LZCNT)
V3_FEATURES = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}
NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
ATTENTION_FORMATS = [("mse4", "uint4"), ("mse3", "uint3"), ("fp8", "uint4"), ("raw16", "raw16")]


def cpu_features() -> set[str]:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def baseline_forced() -> bool:
    return os.environ.get("TURBOQUANT_CPU_BASELINE", "") not in ("", "0")


def test_the_copy_chosen_is_the_one_the_cpu_and_the_environment_ask_for():
    got = cpu_instruction_set()
    if not X86:
        assert got == "generic"
        return
    if got == "generic":
        pytest.skip("the library was built with TURBOQUANT_X86_64_V3=OFF: one copy of the CPU kernels")
    want = "x86-64" if baseline_forced() or not V3_FEATURES <= cpu_features() else "x86-64-v3"
    assert got == want


def kernel_outputs() -> dict[str, np.ndarray]:
    """Every CPU kernel on fixed inputs: TQPack and TQUnpack of each format from float32 and float16
    rows, and TQAttention (float16) decoding one token over a packed past and attending a 40-token prompt."""
    rng = np.random.default_rng(7)
    out = {}
    for fmt in ALL_FORMATS:
        for dtype in NP:
            x = (rng.standard_normal((2, 3, 5, 128)) * 3).astype(NP[dtype])
            packed = run(inference_session(node_models.pack_model(fmt, 128, dtype), threads=1), {"x": x})[0]
            out[f"pack {fmt} {dtype}"] = packed
            unpack = node_models.unpack_model(fmt, 128, dtype)
            out[f"unpack {fmt} {dtype}"] = run(inference_session(unpack, threads=1), {"packed": packed})[0]
    f16 = TensorProto.FLOAT16
    for keys, values in ATTENTION_FORMATS:
        common = dict(q_heads=8, kv_heads=2, head_dim=128, key_format=keys, value_format=values, dtype=f16)
        past_k = run(inference_session(node_models.pack_model(keys, 128, f16), threads=1),
                     {"x": rng.standard_normal((1, 2, 300, 128)).astype(np.float16)})[0]
        past_v = run(inference_session(node_models.pack_model(values, 128, f16), threads=1),
                     {"x": rng.standard_normal((1, 2, 300, 128)).astype(np.float16)})[0]
        decode = inference_session(node_models.attention_model(**common), threads=1)
        q, k, v = (rng.standard_normal((1, h, 1, 128)).astype(np.float16) for h in (8, 2, 2))
        y, pk, pv = run(decode, {"Q": q, "K": k, "V": v, "past_key": past_k, "past_value": past_v})
        out[f"decode {keys} y"], out[f"decode {keys} present_key"], out[f"decode {keys} present_value"] = y, pk, pv
        prompt = inference_session(node_models.attention_model(**common, past=False, is_causal=1), threads=1)
        q, k, v = (rng.standard_normal((1, h, 40, 128)).astype(np.float16) for h in (8, 2, 2))
        y, pk, pv = run(prompt, {"Q": q, "K": k, "V": v})
        out[f"prompt {keys} y"], out[f"prompt {keys} present_key"], out[f"prompt {keys} present_value"] = y, pk, pv
    return out


@pytest.mark.skipif(not X86, reason="one copy of the CPU kernels outside x86-64")
def test_the_baseline_copy_packs_the_same_bytes_and_attends_within_tolerance(tmp_path):
    """This process's copy (x86-64-v3 on such a CPU) against the baseline copy, forced in a child process."""
    if cpu_instruction_set() == "generic":
        pytest.skip("the library was built with TURBOQUANT_X86_64_V3=OFF: one copy of the CPU kernels")
    saved = tmp_path / "baseline.npz"
    child = subprocess.run([sys.executable, __file__, str(saved)], capture_output=True, text=True,
                           env={**os.environ, "TURBOQUANT_CPU_BASELINE": "1"})
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["x86-64"]
    baseline = dict(np.load(saved))
    here = kernel_outputs()
    assert sorted(baseline) == sorted(here)
    for name, got in here.items():
        if name.endswith(" y"):  # attention: FMA and vectorised sums reorder the rounding
            np.testing.assert_allclose(got.astype(np.float32), baseline[name].astype(np.float32), rtol=4e-3,
                                       atol=4e-3, err_msg=name)
        else:  # packed bytes, and values unpacked from them
            assert got.tobytes() == baseline[name].tobytes(), name


def v3_only_instruction(line: str) -> bool:
    """An instruction of x86-64-v3 beyond the baseline: VEX-encoded (AVX, AVX2, FMA, F16C), BMI1/2, LZCNT, MOVBE."""
    m = re.match(r"\s*[0-9a-f]+:\s+([a-z0-9]+)", line)
    return m is not None and (m.group(1).startswith("v") or m.group(1) in {
        "andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "lzcnt", "movbe", "mulx", "pdep", "pext", "rorx",
        "sarx", "shlx", "shrx", "tzcnt"})


@pytest.mark.skipif(not X86, reason="x86-64 only")
@pytest.mark.parametrize("library", ["onnxruntime", "tensorrt"])
def test_only_the_x86_64_v3_copy_holds_its_instructions(library):
    """Code that every CPU runs (the dispatcher, the adapters, load-time initialisers, the library
    templates both copies instantiate, whose baseline instance the linker must keep, cudart) holds none."""
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed: cannot disassemble the library")
    if cpu_instruction_set() == "generic":
        pytest.skip("the library was built with TURBOQUANT_X86_64_V3=OFF: one copy of the CPU kernels")
    try:
        path = turboquant.ort_library_path() if library == "onnxruntime" else turboquant.trt_plugin_path()
    except turboquant.LibraryNotBuiltError as e:
        pytest.skip(str(e))
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", "--section=.text", path],
                             capture_output=True, text=True, check=True).stdout
    function, v3_functions, others = None, set(), {}
    for line in listing.splitlines():
        if m := re.match(r"[0-9a-f]+ <(.*)>:$", line):
            function = m.group(1)
        elif function and v3_only_instruction(line):
            if "_x86_64_v3::" in function:
                v3_functions.add(function)
            else:
                others.setdefault(function, line.strip())
    if library == "onnxruntime":  # the TensorRT plugins run no CPU kernel: the linker leaves both copies out
        assert v3_functions, "no function of the x86-64-v3 copy found (a library without its symbols?)"
    assert not others, others


if __name__ == "__main__":  # the child process of the comparison above
    np.savez(sys.argv[1], **kernel_outputs())
    print(cpu_instruction_set())
