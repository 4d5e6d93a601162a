"""The plugin library as TensorRT's registry and ONNX parser see it: creators, fields, serialisation,
format and type queries, the workspace bound and refusals. Runs without a GPU."""

import subprocess

import pytest

import turboquant
from turboquant.config import packed_size

from .conftest import torch_cuda_reason

ATTN = dict(key_format="mse4", value_format="uint4", norm_correction=1, is_causal=0, head_dim=128, q_num_heads=0,
            kv_num_heads=0, scale=0.0, has_mask=-1)
GQA = dict(key_format="mse4", value_format="uint4", norm_correction=1, num_heads=4, kv_num_heads=2, scale=0.0, do_rotary=0,
           rotary_interleaved=0, local_window_size=-1, softcap=0.0, smooth_softmax=0, qk_output=0, packed_qkv=-1)


def test_library_exports_only_its_entry_points(trt):
    out = subprocess.run(["nm", "-D", "--defined-only", turboquant.trt_plugin_path()], capture_output=True, text=True, check=True)
    assert sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip()) == ["getCreators", "setLoggerFinder"]


def test_creators_name_the_onnx_ops(trt):
    creators = {c.split()[0]: c.split() for c in trt.creators()}
    assert set(creators) == {"TQPack", "TQUnpack", "TQAttention", "TQGroupQueryAttention"}
    for name, (_, namespace, version, *fields) in creators.items():
        assert (namespace, version) == ("turboquant", "1")
    fields = {f.split(":")[0] for f in creators["TQAttention"][3:]}
    # the ONNX op's attributes, plus has_mask / packed_qkv, and packed_dtype (int8 for --target tensorrt)
    assert fields == set(ATTN) | {"packed_dtype"}
    assert {f.split(":")[0] for f in creators["TQPack"][3:]} == {"format", "head_dim", "norm_correction", "packed_dtype"}
    assert {f.split(":")[0] for f in creators["TQUnpack"][3:]} == {"format", "head_dim", "dtype", "packed_dtype"}
    assert {f.split(":")[0] for f in creators["TQGroupQueryAttention"][3:]} == set(GQA) | {"packed_dtype"}


@pytest.mark.parametrize("name, fields", [
    ("TQPack", dict(format="mse3", head_dim=96, norm_correction=0, packed_dtype=3)),
    ("TQUnpack", dict(format="fp8", head_dim=64, dtype=10)),
    ("TQAttention", dict(ATTN, key_format="mse3", value_format="uint3", is_causal=1, q_num_heads=32, kv_num_heads=8, scale=0.125, has_mask=1)),
    ("TQGroupQueryAttention", dict(GQA, key_format="fp8", norm_correction=0, num_heads=32, kv_num_heads=8, scale=0.0625,
                                   do_rotary=1, rotary_interleaved=1, packed_qkv=1)),
])
def test_fields_survive_serialisation(trt, name, fields):
    p = trt.create(name, **fields)
    assert p is not None and p.identity() == f"{name} turboquant 1"
    want = {k: (f"{v:g}" if isinstance(v, float) else str(v)) for k, v in {"packed_dtype": 2, **fields}.items()}
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
    g = trt.create("TQGroupQueryAttention", **GQA)
    assert g.output_types(["bfloat16", "uint8", "uint8", "int32", "int32"]) == ["bfloat16", "uint8", "uint8"]


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



def test_packed_dtype_int8_is_the_same_bytes_under_the_type_tensorrt_takes(trt, capfd):
    """packed_dtype 3 (--target tensorrt): every packed input and output int8, uint8 refused there;
    the roles (mask or past, packed QKV or not) read the same from int8 as from uint8."""
    i8 = dict(packed_dtype=3)
    assert trt.create("TQPack", format="mse4", **i8).output_types(["float16"]) == ["int8"]
    pack = trt.create("TQPack", format="mse4", **i8)
    assert pack.supports(1, ["float16"], ["int8"]) and not pack.supports(1, ["float16"], ["uint8"])
    unpack = trt.create("TQUnpack", format="mse4", head_dim=64, dtype=10, **i8)
    assert unpack.supports(0, ["int8"], ["float16"]) and not unpack.supports(0, ["uint8"], ["float16"])
    a = trt.create("TQAttention", **ATTN, **i8)
    ins, outs = ["float16"] * 3 + ["int8", "int8", "float32", "float32"], ["float16", "int8", "int8"]
    assert a.output_types(ins) == outs
    assert all(a.supports(i, ins, outs) for i in range(len(ins) + len(outs)))
    assert not a.supports(3, ["float16"] * 3 + ["uint8", "uint8"], outs)
    with_mask = ["bfloat16"] * 3 + ["bool", "int8", "int8"]
    assert all(a.supports(i, with_mask, ["bfloat16", "int8", "int8"]) for i in range(9))
    g = trt.create("TQGroupQueryAttention", **dict(GQA, do_rotary=1), **i8)
    gi = ["int8" if t == "uint8" else t for t, _ in gqa_inputs(rotary=True, position_ids=True, offsets=3)]
    assert g.output_types(gi) == ["float16", "int8", "int8"]
    assert all(g.supports(i, gi, ["float16", "int8", "int8"]) for i in range(len(gi) + 3))
    assert not g.supports(12, gi, ["float16", "uint8", "uint8"])  # present_key
    inferred = trt.create("TQGroupQueryAttention", **GQA, **i8)
    separate = [("int8" if t == "uint8" else t, d) for t, d in gqa_inputs(packed=False)]
    assert inferred.configure(separate, [("int8" if t == "uint8" else t, d) for t, d in gqa_outputs()]) == 0
    assert inferred.aliased_input(1) == 3  # past_key found by its int8 type
    assert trt.create("TQPack", format="mse4", packed_dtype=1) is None
    assert "field 'packed_dtype' is 1; expected 2 (uint8) or 3 (int8" in capfd.readouterr().err

def test_workspace_bound_for_a_long_decode(trt):
    a = trt.create("TQAttention", **ATTN)
    kb, vb = packed_size("mse4", 128), packed_size("uint4", 128)
    ins = [("float16", (8, 32, 1, 128)), ("float16", (8, 8, 1, 128)), ("float16", (8, 8, 1, 128)),
           ("uint8", (8, 8, 32768, kb)), ("uint8", (8, 8, 32768, vb))]
    outs = [("float16", (8, 32, 1, 128)), ("uint8", (8, 8, 32769, kb)), ("uint8", (8, 8, 32769, vb))]
    assert a.workspace(ins, outs) > 0
    bad = [("float16", (8, 32, 1, 128)), ("float16", (8, 8, 1, 64))] + ins[2:]
    assert a.workspace(bad, outs) == 0  # refused (and logged), not a crash


def test_workspace_bound_covers_every_call_of_the_profile(trt):
    """The split count's rounding makes the scratch no monotone function of the batch or the query
    length (over a 4096-token past, 7 sequences of 5 queries need more than 16, 2 queries more than
    3): the bound is the largest over the profile, not the largest shape's."""
    a = trt.create("TQAttention", **ATTN)
    kb, vb = packed_size("mse4", 128), packed_size("uint4", 128)

    def io(b, sq, sp=4096):
        ins = [("float16", (b, 32, sq, 128)), ("float16", (b, 8, sq, 128)), ("float16", (b, 8, sq, 128)),
               ("uint8", (b, 8, sp, kb)), ("uint8", (b, 8, sp, vb))]
        return ins, [("float16", (b, 32, sq, 128)), ("uint8", (b, 8, sp + sq, kb)), ("uint8", (b, 8, sp + sq, vb))]

    each = max(a.workspace(*io(b, sq)) for b in range(1, 17) for sq in range(1, 6))
    assert a.workspace_range(io(1, 1)[0], *io(16, 5)) >= each
    if torch_cuda_reason() is not None:
        # without a device the CUDA-core kernel's layout sizes the splits, and over this profile its
        # largest shape is not its neediest; the tensor-core layout of an sm_90 device peaks there
        assert each > a.workspace(*io(16, 5))


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


# TQGroupQueryAttention: head size 64, 4 query heads over 2 KV heads, caches of W = 36 bytes per row
# (the larger of mse4's 34 and uint4's 36), a buffer of 40 rows.
W = max(packed_size("mse4", 64), packed_size("uint4", 64))


def gqa_inputs(b=2, s=1, total=9, capacity=40, packed=True, dtype="float16", rotary=False, position_ids=False,
               offsets=0, carrier=None):
    """(type, shape) of the plugin's inputs in --target tensorrt's order (absent ones left out)."""
    ins = [(dtype, (b, s, (4 + 4) * 64 if packed else 4 * 64))]
    if not packed:
        ins += [(dtype, (b, s, 2 * 64))] * 2
    ins += [("uint8", (b, 2, capacity, W))] * 2 + [("int32", (b,)), ("int32", carrier or (0, total))]
    if rotary:
        ins += [(dtype, (capacity, 32))] * 2
    if position_ids:
        ins += [("int64", (b, s))]
    ins += [("float32", (2, 64))] * offsets
    return ins


def gqa_outputs(b=2, s=1, capacity=40, dtype="float16"):
    return [(dtype, (b, s, 4 * 64)), ("uint8", (b, 2, capacity, W)), ("uint8", (b, 2, capacity, W))]


@pytest.mark.parametrize("fields, message", [
    (dict(), "attributes num_heads (0) and kv_num_heads (0) must be positive"),
    (dict(GQA, num_heads=6, kv_num_heads=4), "num_heads a multiple of kv_num_heads"),
    (dict(GQA, local_window_size=0), "attribute 'local_window_size' must be -1 (no window) or positive, got 0"),
    (dict(GQA, softcap=-30.0), "attribute 'softcap' must be finite and >= 0, got -30"),
    (dict(GQA, smooth_softmax=1), "smooth_softmax is not supported"),
    (dict(GQA, qk_output=1), "qk_output = 1 is not supported"),
    (dict(GQA, key_format="uint4"), "key_format 'uint4' is a value format"),
    (dict(GQA, do_rotary=2), "field 'do_rotary' must be 0 or 1, got 2"),
    (dict(GQA, packed_qkv=2), "field 'packed_qkv' must be -1"),
    (dict(GQA, past_present_share_buffer=1), "unknown field 'past_present_share_buffer'"),
])
def test_gqa_bad_fields_are_refused_with_a_message(trt, capfd, fields, message):
    assert trt.create("TQGroupQueryAttention", **fields) is None
    assert message in capfd.readouterr().err


def test_gqa_output_shapes(trt):
    g = trt.create("TQGroupQueryAttention", **GQA)
    past = (f"B,2,Cap,{W}", f"B,2,Cap,{W}")
    # packed QKV: [B, S, (Hq + 2 Hkv) D] -> [B, S, Hq D]; present is past's buffer, shape and all
    assert g.output_shapes("B,S,512", *past, "B", "0,T") == ["[B, S, 256]", f"[B, 2, Cap, {W}]", f"[B, 2, Cap, {W}]"]
    assert g.output_shapes("B,S,H", *past, "B", "0,T")[0] == "[B, S, ((H*4)/8)]"
    # separate key and value: the output has the query's shape
    assert g.output_shapes("B,S,256", "B,S,128", "B,S,128", *past, "B", "0,T") == [
        "[B, S, 256]", f"[B, 2, Cap, {W}]", f"[B, 2, Cap, {W}]"]
    told = trt.create("TQGroupQueryAttention", **dict(GQA, packed_qkv=0))
    assert told.output_shapes("B,S,256", "B,S,128", "B,S,128", *past, "B", "0,T")[1] == f"[B, 2, Cap, {W}]"
    assert told.output_shapes("B,S,512", *past, "B", "0,T") == ["error"]  # the field says key and value come
    assert g.output_shapes("B,512", *past, "B", "0,T") == ["error"]  # a 2-D query


def test_gqa_present_aliases_past(trt, capfd):
    """present_key/present_value alias past_key/past_value (the inputs after the query, or after key
    and value); the other plugins offer no aliasing interface."""
    packed = trt.create("TQGroupQueryAttention", **dict(GQA, packed_qkv=1))
    assert [packed.aliased_input(o) for o in range(3)] == [-1, 1, 2]
    separate = trt.create("TQGroupQueryAttention", **dict(GQA, packed_qkv=0))
    assert [separate.aliased_input(o) for o in range(3)] == [-1, 3, 4]
    # the declaration survives serialisation (packed_qkv is a field)
    assert [separate.roundtrip().aliased_input(o) for o in range(3)] == [-1, 3, 4]
    # inferred: unknown until the inputs are (then not aliased, and said why), then from input 1's type
    inferred = trt.create("TQGroupQueryAttention", **GQA)
    assert inferred.aliased_input(1) == -1 and "set the packed_qkv field" in capfd.readouterr().err
    assert inferred.configure(gqa_inputs(packed=False), gqa_outputs()) == 0
    assert inferred.aliased_input(2) == 4
    assert trt.create("TQAttention", **ATTN).aliased_input(1) == -2


def test_gqa_format_combinations(trt):
    g = trt.create("TQGroupQueryAttention", **dict(GQA, do_rotary=1))
    ins = [t for t, _ in gqa_inputs(rotary=True, position_ids=True, offsets=3)]  # key_offset, value_offset, key_scale
    outs = ["float16", "uint8", "uint8"]
    assert ins == ["float16", "uint8", "uint8", "int32", "int32", "float16", "float16", "int64", "float32", "float32",
                   "float32"]
    assert all(g.supports(i, ins, outs) for i in range(len(ins) + len(outs)))
    assert not g.supports(3, ins[:3] + ["int64"] + ins[4:], outs)  # seqlens_k is int32
    assert not g.supports(4, ins[:4] + ["float32"] + ins[5:], outs)  # so is the length carrier
    assert not g.supports(5, ins[:5] + ["float32"] + ins[6:], outs)  # cos_cache has the query's type
    assert not g.supports(11, ins, ["float32", "uint8", "uint8"])  # the output too
    assert not g.supports(11, ins + ["float32"], outs)  # nothing after key_scale
    separate = [t for t, _ in gqa_inputs(packed=False, dtype="bfloat16")]
    plain = trt.create("TQGroupQueryAttention", **GQA)
    assert all(plain.supports(i, separate, ["bfloat16", "uint8", "uint8"]) for i in range(len(separate) + 3))
    assert not plain.supports(2, ["bfloat16", "bfloat16", "float16"], outs)  # value has the query's type
    told = trt.create("TQGroupQueryAttention", **dict(GQA, packed_qkv=1))
    assert not told.supports(1, separate, outs)  # the field says input 1 is past_key
    assert not plain.supports(0, ["int32"], outs)


def test_gqa_workspace_covers_the_profile(trt):
    g = trt.create("TQGroupQueryAttention", **GQA)
    decode = g.workspace(gqa_inputs(b=8, s=1, total=40), gqa_outputs(b=8))
    assert decode > 0
    # a profile of 1 to 8 sequences of 1 to 24 new tokens: at least what any one call in it needs
    each = [g.workspace(gqa_inputs(b=b, s=s, total=40), gqa_outputs(b=b, s=s)) for b in range(1, 9) for s in (1, 2, 7, 24)]
    ranged = g.workspace_range(gqa_inputs(b=1, s=1, total=1), gqa_inputs(b=8, s=24, total=40), gqa_outputs(b=8, s=24))
    assert ranged >= max(each)
    # the split count's rounding makes some smaller batches need more than the largest (5 new
    # tokens over a long past: 13 sequences more than 16), so the bound is not the largest shape's
    long = dict(s=5, total=4096, capacity=4096)
    each = [g.workspace(gqa_inputs(b=b, **long), gqa_outputs(b=b, s=5, capacity=4096)) for b in range(1, 17)]
    ranged = g.workspace_range(gqa_inputs(b=1, **long), gqa_inputs(b=16, **long), gqa_outputs(b=16, s=5, capacity=4096))
    assert ranged >= max(each)


@pytest.mark.parametrize("inputs, message, in_profile", [
    # a total beyond the buffers or below S is refused by the call; a profile may span it (the
    # workspace bound takes the most tokens the buffers hold)
    (gqa_inputs(total=41), "total_sequence_length (41) is beyond the 40 rows of the cache buffers", True),
    (gqa_inputs(s=2, total=1), "total_sequence_length (1) is smaller than the sequence length 2", True),
    (gqa_inputs(carrier=(1,)), "expected the length carrier [N, total_sequence_length]", False),  # ORT's scalar
    (gqa_inputs()[:4], "has 4 inputs; expected query, past_key, past_value, seqlens_k, the length carrier", False),
    (gqa_inputs(offsets=3) + [("float32", (2, 64))], "has 9 inputs", False),
    (gqa_inputs(offsets=3), "input 'key_scale' needs do_rotary = 1", False),
    (gqa_inputs(b=3)[:2] + gqa_inputs()[2:], "input 'past_value' has shape [2, 2, 40, 36]; expected [3, 2, max_length, W]", False),
    (gqa_inputs()[:3] + [("int64", (2,))] + gqa_inputs()[4:], "input 3 (seqlens_k) is int64; expected int32", False),
])
def test_gqa_refusals_before_any_launch(trt, capfd, inputs, message, in_profile):
    """Shapes and types enqueue refuses before it launches anything (so no device is needed), with
    the message logged; getWorkspaceSize refuses the ones no profile can hold."""
    g = trt.create("TQGroupQueryAttention", **GQA)
    assert g.enqueue_shapes(inputs, gqa_outputs()) != 0
    assert message in capfd.readouterr().err
    assert (g.workspace(inputs, gqa_outputs()) > 0) == in_profile


def test_exported_genai_nodes_are_accepted_by_the_plugin(trt, tmp_path):
    """Each TQGroupQueryAttention node of a genai model exported with --target tensorrt, as TensorRT's
    ONNX parser hands it over: its attributes as fields (every one known), its input types supported,
    present shaped as past and aliased to it."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes the model)")
    import onnx_ir as ir

    from turboquant import random_decoders
    from turboquant.export import export

    cfg = random_decoders.TinyConfig(family="llama", layers=3, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=1, vocab=640)
    src = random_decoders.export_genai(cfg, tmp_path / "genai")
    out = export(src, "turboquant_k8v4", tmp_path / "trt" / "model.onnx", boundary=0, progress=False, target="tensorrt").output
    model = ir.load(out)
    names = {ir.DataType.FLOAT: "float32", ir.DataType.INT8: "int8", ir.DataType.INT32: "int32"}  # packed: int8
    nodes = [n for n in model.graph if n.op_type == "TQGroupQueryAttention"]
    assert len(nodes) == cfg.layers
    for n in nodes:
        fields = {k: a.value for k, a in n.attributes.items() if k not in ("plugin_namespace", "plugin_version")}
        plugin = trt.create("TQGroupQueryAttention", **fields)
        assert plugin is not None
        types = [names[v.dtype] for v in n.inputs]
        outs = ["float32", "int8", "int8"]
        assert all(plugin.supports(i, types, outs) for i in range(len(types) + 3))
        cache = ",".join(str(x) if isinstance(x, int) else "P" for x in n.inputs[1].shape)
        shapes = plugin.output_shapes("B,S,512", cache, cache, "B", "0,T", "M,32", "M,32")
        assert shapes == ["[B, S, 256]", f"[{cache.replace(',', ', ')}]", f"[{cache.replace(',', ', ')}]"]
        assert [plugin.aliased_input(o) for o in (1, 2)] == [1, 2]
