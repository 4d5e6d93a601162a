"""The plugin library as TensorRT's registry and ONNX parser see it: creators, fields, serialisation,
format and type queries, the workspace bound and refusals. Runs without a GPU."""

import subprocess

import pytest

import turboquant
from turboquant.config import packed_size

ATTN = dict(key_format="mse4", value_format="uint4", norm_correction=1, is_causal=0, head_dim=128, q_num_heads=0,
            kv_num_heads=0, scale=0.0, has_mask=-1)


def test_library_exports_only_its_entry_points(trt):
    out = subprocess.run(["nm", "-D", "--defined-only", turboquant.trt_plugin_path()], capture_output=True, text=True, check=True)
    assert sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip()) == ["getCreators", "setLoggerFinder"]


def test_creators_name_the_onnx_ops(trt):
    creators = {c.split()[0]: c.split() for c in trt.creators()}
    assert set(creators) == {"TQPack", "TQUnpack", "TQAttention"}
    for name, (_, namespace, version, *fields) in creators.items():
        assert (namespace, version) == ("turboquant", "1")
    fields = {f.split(":")[0] for f in creators["TQAttention"][3:]}
    assert fields == set(ATTN)  # the ONNX op's attributes, plus has_mask
    assert {f.split(":")[0] for f in creators["TQPack"][3:]} == {"format", "head_dim", "norm_correction"}
    assert {f.split(":")[0] for f in creators["TQUnpack"][3:]} == {"format", "head_dim", "dtype"}


@pytest.mark.parametrize("name, fields", [
    ("TQPack", dict(format="mse3", head_dim=96, norm_correction=0)),
    ("TQUnpack", dict(format="fp8", head_dim=64, dtype=10)),
    ("TQAttention", dict(ATTN, key_format="mse3", value_format="uint3", is_causal=1, q_num_heads=32, kv_num_heads=8, scale=0.125, has_mask=1)),
])
def test_fields_survive_serialisation(trt, name, fields):
    p = trt.create(name, **fields)
    assert p is not None and p.identity() == f"{name} turboquant 1"
    want = {k: (f"{v:g}" if isinstance(v, float) else str(v)) for k, v in fields.items()}
    assert p.fields() == want
    again = p.roundtrip()
    assert again.identity() == p.identity() and again.fields() == want
    assert p.clone().fields() == want


def test_defaults_fill_absent_fields(trt):
    p = trt.create("TQAttention")
    assert p.fields()["key_format"] == "mse4" and p.fields()["value_format"] == "uint4" and p.fields()["has_mask"] == "-1"


@pytest.mark.parametrize("name, fields, message", [
    ("TQPack", dict(format="int4"), "field 'format' is 'int4'"),
    ("TQPack", dict(format="mse4", bogus=1), "unknown field 'bogus'"),
    ("TQPack", dict(format="mse4", head_dim=100), "head_dim 100 is not supported"),
    ("TQUnpack", dict(format="mse4", head_dim=64, dtype=7), "field 'dtype' is 7"),
    ("TQUnpack", dict(format="mse4"), "head_dim 0 is not supported"),
    ("TQAttention", dict(key_format=3), "field 'key_format' has type"),
    ("TQAttention", dict(scale=-1.0), "attribute 'scale' is -1"),
    ("TQAttention", dict(has_mask=2), "has_mask"),
    # each field has its attribute's type: an INT scale is not read as a float, nor a FLOAT flag as an int
    ("TQAttention", dict(scale=1), "TQAttention: field 'scale' has type kINT32 and length 1; expected one float"),
    ("TQAttention", dict(is_causal=1.0), "TQAttention: field 'is_causal' has type kFLOAT32 and length 1; expected one integer"),
    ("TQPack", dict(format="mse4", norm_correction=0.0), "TQPack: field 'norm_correction' has type kFLOAT32"),
    ("TQUnpack", dict(format=4, head_dim=64), "TQUnpack: field 'format' has type kINT32 and length 1; expected a string"),
])
def test_bad_fields_are_refused_with_a_message(trt, capfd, name, fields, message):
    assert trt.create(name, **fields) is None
    assert message in capfd.readouterr().err


def test_output_types(trt):
    assert trt.create("TQPack", format="mse4").output_types(["float16"]) == ["uint8"]
    assert trt.create("TQUnpack", format="mse4", head_dim=64, dtype=16).output_types(["uint8"]) == ["bfloat16"]
    a = trt.create("TQAttention", **ATTN)
    assert a.output_types(["float16"] * 3 + ["uint8"] * 2) == ["float16", "uint8", "uint8"]


def test_format_combinations(trt):
    a = trt.create("TQAttention", **ATTN)
    ins = ["float16"] * 3 + ["uint8", "uint8", "float32", "float32"]
    outs = ["float16", "uint8", "uint8"]
    assert all(a.supports(i, ins, outs) for i in range(len(ins) + len(outs)))
    assert not a.supports(1, ["float16", "float32", "float16", "uint8", "uint8"], outs)  # K must match Q
    assert not a.supports(0, ["int32"] * 3, outs)
    with_mask = ["bfloat16"] * 3 + ["bool", "uint8", "uint8"]
    assert all(a.supports(i, with_mask, ["bfloat16", "uint8", "uint8"]) for i in range(9))
    no_mask = trt.create("TQAttention", **dict(ATTN, has_mask=0))
    assert not no_mask.supports(3, with_mask, ["bfloat16", "uint8", "uint8"])
    assert not a.supports(7, ins, ["float32", "uint8", "uint8"])  # Y has Q's type
    pack = trt.create("TQPack", format="mse4")
    assert pack.supports(0, ["bfloat16"], ["uint8"]) and pack.supports(1, ["float16"], ["uint8"])
    assert not pack.supports(0, ["uint8"], ["uint8"])


def test_workspace_bound_for_a_long_decode(trt):
    a = trt.create("TQAttention", **ATTN)
    kb, vb = packed_size("mse4", 128), packed_size("uint4", 128)
    ins = [("float16", (8, 32, 1, 128)), ("float16", (8, 8, 1, 128)), ("float16", (8, 8, 1, 128)),
           ("uint8", (8, 8, 32768, kb)), ("uint8", (8, 8, 32768, vb))]
    outs = [("float16", (8, 32, 1, 128)), ("uint8", (8, 8, 32769, kb)), ("uint8", (8, 8, 32769, vb))]
    assert a.workspace(ins, outs) > 0
    bad = [("float16", (8, 32, 1, 128)), ("float16", (8, 8, 1, 64))] + ins[2:]
    assert a.workspace(bad, outs) == 0  # refused (and logged), not a crash


def test_output_shapes(trt):
    kb, vb = packed_size("mse4", 128), packed_size("uint4", 128)
    a = trt.create("TQAttention", **ATTN)
    past = (f"B,8,Sp,{kb}", f"B,8,Sp,{vb}")
    assert a.output_shapes("B,32,Sq,128", "B,8,Sn,128", "B,8,Sn,128", *past) == [
        "[B, 32, Sq, 128]", f"[B, 8, (Sp+Sn), {kb}]", f"[B, 8, (Sp+Sn), {vb}]"]
    # with a mask (found by its last dimension, or told by has_mask), and offsets after the past
    shapes = ["B,32,Sq,128", "B,8,Sn,128", "B,8,Sn,128", "B,1,Sq,St", *past, "8,128", "8,128"]
    assert a.output_shapes(*shapes)[1] == f"[B, 8, (Sp+Sn), {kb}]"
    told = trt.create("TQAttention", **dict(ATTN, has_mask=1))
    assert told.output_shapes(*shapes)[2] == f"[B, 8, (Sp+Sn), {vb}]"
    # 3-D [B, S, H*D]: heads from the fields
    a3 = trt.create("TQAttention", **dict(ATTN, head_dim=0, q_num_heads=32, kv_num_heads=8))
    assert a3.output_shapes("B,Sq,4096", "B,Sn,1024", "B,Sn,1024", *past) == [
        "[B, Sq, 4096]", f"[B, 8, (Sp+Sn), {kb}]", f"[B, 8, (Sp+Sn), {vb}]"]
    # no past: present holds the new tokens
    assert a.output_shapes("B,32,Sq,128", "B,8,Sn,128", "B,8,Sn,128")[1] == f"[B, 8, Sn, {kb}]"
    # a head size unknown when the engine is built is refused
    assert trt.create("TQAttention").output_shapes("B,32,Sq,D", "B,8,Sn,D", "B,8,Sn,D", *past) == ["error"]
    pack = trt.create("TQPack", format="mse3")
    assert pack.output_shapes("B,8,S,96") == [f"[B, 8, S, {packed_size('mse3', 96)}]"]
    unpack = trt.create("TQUnpack", format="uint4", head_dim=64, dtype=10)
    assert unpack.output_shapes(f"B,8,S,{packed_size('uint4', 64)}") == ["[B, 8, S, 64]"]
