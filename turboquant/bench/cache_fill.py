"""Caches filled to a given length without a prefill: a short block of random rows per cache
tensor (random float K/V for float layers; random K/V packed by TQPack through ONNX Runtime for
packed layers) repeated along the sequence axis on the device by an Expand graph, so that the long
cache never passes through the host. Decode time does not depend on the values."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from .. import node_models
from ..ort import inference_session
from .cache_layout import CacheTensor

UNIT = 256  # distinct random rows per tensor and sequence
# elements one ONNX Runtime kernel launch fills or expands: its CUDA fill and Expand kernels index
# with 32-bit integers (a larger ConstantOfShape faults, a larger Expand is refused)
MAX_ELEMENTS = 2**31 - 1
_ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.uint8: TensorProto.UINT8}


def _repeat_model(elem: int) -> onnx.ModelProto:
    """unit [B, H, u, W] -> its rows repeated to [B, H, rows, W] (Unsqueeze, Expand, Reshape, Slice:
    every fixed-size type on every provider)."""
    nodes = [
        helper.make_node("Unsqueeze", ["unit", "axis"], ["u5"]),
        helper.make_node("Expand", ["u5", "shape5"], ["e5"]),
        helper.make_node("Reshape", ["e5", "shape4"], ["r4"]),
        helper.make_node("Slice", ["r4", "zero", "rows", "axis"], ["cache"]),
    ]
    graph = helper.make_graph(
        nodes, "repeat_rows",
        [helper.make_tensor_value_info("unit", elem, ["B", "H", "U", "W"]),
         helper.make_tensor_value_info("shape5", TensorProto.INT64, [5]),
         helper.make_tensor_value_info("shape4", TensorProto.INT64, [4]),
         helper.make_tensor_value_info("rows", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("cache", elem, ["B", "H", "R", "W"])],
        initializer=[helper.make_tensor("axis", TensorProto.INT64, [1], [2]),
                     helper.make_tensor("zero", TensorProto.INT64, [1], [0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=node_models.IR_VERSION)


def _zeros_model(elem: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["cache"], value=helper.make_tensor("v", elem, [1], [0]))],
        "zeros", [helper.make_tensor_value_info("shape", TensorProto.INT64, [4])],
        [helper.make_tensor_value_info("cache", elem, ["B", "H", "R", "W"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=node_models.IR_VERSION)


def allocate(tensors: list[CacheTensor], batch: int, rows: int, device: str) -> int:
    """Allocates (and zeroes) every cache tensor for batch sequences of `rows` rows on the device,
    all held at once, then frees them; returns the bytes held. The tensors come from a session of
    their own, whose arena goes with it (OrtValues made directly would stay in a process-wide one)."""
    providers = ([("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})] if device == "cuda"
                 else ["CPUExecutionProvider"])
    sessions = {}
    held = []
    for c in tensors:
        if c.dtype not in sessions:
            sessions[c.dtype] = ort.InferenceSession(_zeros_model(_ONNX[c.dtype]).SerializeToString(), providers=providers)
        # a tensor over MAX_ELEMENTS in pieces of whole sequences: the same bytes held at once
        step = max(1, MAX_ELEMENTS // (c.heads * rows * c.width))
        for b0 in range(0, batch, step):
            io = sessions[c.dtype].io_binding()
            io.bind_cpu_input("shape", np.array([min(step, batch - b0), c.heads, rows, c.width], np.int64))
            io.bind_output("cache", device)
            sessions[c.dtype].run_with_iobinding(io)
            held.append((io.get_outputs()[0], c))
    total = sum(int(np.prod(v.shape())) * np.dtype(c.dtype).itemsize for v, c in held)
    del held, sessions
    return total


class RandomFill:
    def __init__(self, device: str, seed: int = 0):
        self.device = device
        self.rng = np.random.default_rng(seed)
        # the arena grows by what is asked: a long cache is not rounded up to a power of two
        providers = ([("CUDAExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})] if device == "cuda"
                     else ["CPUExecutionProvider"])
        self._repeat = {dt: ort.InferenceSession(_repeat_model(e).SerializeToString(), providers=providers)
                        for dt, e in _ONNX.items()}
        self._packers: dict = {}

    def unit(self, c: CacheTensor, batch: int) -> np.ndarray:
        """UNIT random rows [batch, heads, UNIT, width] of c's dtype; packed by TQPack for uint8 caches."""
        if c.dtype is not np.uint8:
            return self.rng.standard_normal((batch, c.heads, UNIT, c.width)).astype(c.dtype)
        key = (c.key_format, c.head_dim, c.norm_correction)
        if key not in self._packers:
            extra = {"norm_correction": int(c.norm_correction)} if c.key_format.startswith("mse") else {}
            self._packers[key] = inference_session(node_models.pack_model(c.key_format, c.head_dim, TensorProto.FLOAT16, **extra))
        x = self.rng.standard_normal((batch, c.heads, UNIT, c.head_dim)).astype(np.float16)
        packed = self._packers[key].run(None, {"x": x})[0]
        row = np.zeros((batch, c.heads, UNIT, c.width), np.uint8)  # a shared buffer's row may be wider
        row[..., :packed.shape[-1]] = packed
        return row

    def tensor(self, c: CacheTensor, batch: int, rows: int) -> ort.OrtValue:
        """c's cache for batch sequences of `rows` rows, an OrtValue on the device."""
        unit = self.unit(c, batch)
        reps = -(-rows // UNIT)
        if batch * c.heads * reps * UNIT * c.width > MAX_ELEMENTS:  # too large for one Expand: through the host
            kind, dev = ("cuda", 0) if self.device == "cuda" else ("cpu", 0)
            full = np.ascontiguousarray(np.tile(unit, (1, 1, reps, 1))[:, :, :rows])
            v = ort.OrtValue.ortvalue_from_shape_and_type(full.shape, full.dtype, kind, dev)  # memory of its own
            v.update_inplace(full)
            return v
        sess = self._repeat[c.dtype]
        io = sess.io_binding()
        io.bind_cpu_input("unit", unit)
        io.bind_cpu_input("shape5", np.array([batch, c.heads, reps, UNIT, c.width], np.int64))
        io.bind_cpu_input("shape4", np.array([batch, c.heads, reps * UNIT, c.width], np.int64))
        io.bind_cpu_input("rows", np.array([rows], np.int64))
        io.bind_output("cache", self.device)
        sess.run_with_iobinding(io)
        return io.get_outputs()[0]

    def caches(self, tensors: list[CacheTensor], batch: int, rows: int, numpy: bool = False) -> dict:
        """Every cache input of a model, by name; numpy arrays instead of OrtValues where the decode
        loop feeds numpy (DecoderSession on the CPU)."""
        out = {}
        for c in tensors:
            v = self.tensor(c, batch, rows)
            out[c.name] = v.numpy() if numpy else v
        return out
