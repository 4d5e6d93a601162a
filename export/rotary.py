"""The exporter's rotary embedding, moved into the in-place form's attention op (do_rotary).

Exporters of Hugging Face decoders (the TorchScript exporter, optimum, torch.onnx dynamo) spell
the rotary out per layer: x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x2, x1) over the
halves of the head, with cos and sin computed once from position_ids. On the GPU those are a dozen
small nodes per layer (and their shape computations), each one more launch and more host work for
ONNX Runtime per step. GroupQueryAttention and TQGroupQueryAttention rotate Q and K themselves
(do_rotary, cos/sin tables indexed by position), so the in-place form gives them the unrotated Q
and K and the tables instead.

Nothing is taken on trust from the pattern: the tables are the model's own cos/sin subgraph
evaluated at positions 0 .. P - 1, and each layer's rotary subgraph is evaluated on random input
at sampled positions and must equal the op's rotation with those tables; where anything differs
(interleaved or partial rotary, positions that depend on more than position_ids, ...) the layer
keeps the exporter's nodes. The op's positions are each sequence's past length + s, which are
position_ids under the in-place form's contract (right padding).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .errors import RewriteError
from .subgraph import ort_errors, producer, run, subgraph

# Positions the tables hold where the source folder's config.json does not say
# (max_position_embeddings): Llama 3's 131072, 32 MiB of fp16 tables at head size 128.
DEFAULT_POSITIONS = 131072
# The most --rotary-positions takes: 16M positions, 4 GiB of fp16 tables at head size 128 (and
# the float64 copies made on the way), far beyond any model's context.
MAX_POSITIONS = 2**24


@dataclasses.dataclass
class RotarySite:
    q: ir.Value  # unrotated Q and K, in the layout the exporter rotated them
    k: ir.Value
    cos: ir.Value  # the exporter's cos and sin, as Q's rotary takes them
    sin: ir.Value
    doubled: bool  # cos and sin over the whole head (their halves repeat), else [..., D / 2]


@dataclasses.dataclass
class RotaryTables:
    cos: np.ndarray  # [positions, D / 2], float64
    sin: np.ndarray
    seq_axis: int  # the axis of Q and K that holds the sequence


def _rotate_half_of(v: ir.Value) -> ir.Value | None:
    """x where v = Concat(Neg(Slice(x)), Slice(x)) (which halves the slices take is checked numerically)."""
    cat = producer(v, "Concat")
    if cat is None or len(cat.inputs) != 2:
        return None
    neg = producer(cat.inputs[0], "Neg")
    lo, hi = (producer(neg.inputs[0], "Slice") if neg else None), producer(cat.inputs[1], "Slice")
    if lo is None or hi is None or lo.inputs[0] is not hi.inputs[0]:
        return None
    return lo.inputs[0]


def _rotary_parts(x_rot: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, bool] | None:
    """(x, cos, sin, doubled) where x_rot is x turned by cos and sin: x * cos + rotate_half(x) * sin,
    operands in either order, cos and sin over the whole head (doubled: their halves repeat), as
    the TorchScript exporter and optimum write it; or ONNX's RotaryEmbedding (opset 23, torch.onnx
    dynamo) of a 4-D x, not interleaved, over the whole head, with cos and sin [B, S, D / 2]."""
    rope = producer(x_rot, "RotaryEmbedding")
    if rope is not None:
        attrs = {k: a.value for k, a in rope.attributes.items()}
        if attrs.get("interleaved", 0) or attrs.get("rotary_embedding_dim", 0) or len(rope.inputs) != 3:
            return None
        return rope.inputs[0], rope.inputs[1], rope.inputs[2], False
    add = producer(x_rot, "Add")
    if add is None:
        return None
    muls = [producer(v, "Mul") for v in add.inputs]
    if any(m is None for m in muls):
        return None
    for plain, turned in (muls, muls[::-1]):
        for r, s in ((turned.inputs[0], turned.inputs[1]), (turned.inputs[1], turned.inputs[0])):
            x = _rotate_half_of(r)
            if x is None:
                continue
            if plain.inputs[0] is x:
                return x, plain.inputs[1], s, True
            if plain.inputs[1] is x:
                return x, plain.inputs[0], s, True
    return None


def match(q_rot: ir.Value, k_rot: ir.Value) -> RotarySite | None:
    """The unrotated Q and K and the cos/sin Q is turned by, if both have one of the exporters' forms
    (K's own cos/sin are checked against Q's tables numerically)."""
    q, k = _rotary_parts(q_rot), _rotary_parts(k_rot)
    if q is None or k is None or q[3] != k[3]:
        return None
    return RotarySite(q[0], k[0], q[1], q[2], q[3])


def tables(model: ir.Model, site: RotarySite, position_ids: ir.Value, positions: int) -> RotaryTables | None:
    """cos/sin [positions, D / 2] from the exporter's own subgraph at positions 0 .. positions - 1,
    or None where they depend on more than position_ids or are not two equal halves."""
    sub = subgraph([site.cos, site.sin], [(position_ids, ir.DataType.INT64)], dict(model.opset_imports))
    if sub is None:
        return None
    try:
        cos, sin = run(sub, {position_ids.name: np.arange(positions, dtype=np.int64)[None]})
    except MemoryError:
        raise _too_many(positions) from None
    except ort_errors() as e:  # a subgraph ORT cannot run alone is left to the exporter's nodes
        if "alloc" in str(e).lower():  # ORT out of memory (bad_alloc, failed to allocate): no other form fixes that
            raise _too_many(positions) from None
        return None
    if cos.shape != sin.shape or cos.ndim != (4 if site.doubled else 3):
        return None
    seq_axes = [a for a, n in enumerate(cos.shape[:-1]) if n == positions]
    if len(seq_axes) != 1 or np.prod(cos.shape[:-1]) != positions:
        return None
    # doubled: cos broadcasts over Q as [B, 1, S, D] or [B, S, 1, D]; ONNX's RotaryEmbedding takes [B, S, D / 2]
    # for Q as [B, H, S, D]
    seq_axis = seq_axes[0] if site.doubled else 2
    if seq_axis not in (1, 2):
        return None
    cos, sin = (t.reshape(positions, -1).astype(np.float64) for t in (cos, sin))
    if site.doubled:
        half = cos.shape[1] // 2
        if cos.shape[1] % 2 or not (np.array_equal(cos[:, :half], cos[:, half:]) and np.array_equal(sin[:, :half], sin[:, half:])):
            return None
        cos, sin = cos[:, :half], sin[:, :half]
    return RotaryTables(cos, sin, seq_axis)


def _too_many(positions: int) -> RewriteError:
    return RewriteError(f"the rotary tables of {positions} positions do not fit in memory; give fewer with "
                        "--rotary-positions (0 keeps the exporter's rotary)")


def rotate(x: np.ndarray, t: RotaryTables, pos: np.ndarray, dtype) -> np.ndarray:
    """What the op does to x (sequence on t.seq_axis, head on the last) at positions pos, float64,
    with the tables in the model's dtype."""
    shape = [1] * x.ndim
    shape[t.seq_axis], shape[-1] = len(pos), -1
    cos, sin = (np.asarray(a[pos].astype(dtype), np.float64) for a in (t.cos, t.sin))
    cos, sin = np.concatenate([cos, cos], -1).reshape(shape), np.concatenate([sin, sin], -1).reshape(shape)
    half = x.shape[-1] // 2
    turned = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + turned * sin


def verified(model: ir.Model, x: ir.Value, x_rot: ir.Value, t: RotaryTables, position_ids: ir.Value,
             head_dim: int, dtype: ir.DataType) -> bool:
    """Whether the exporter's rotary of x (x_rot) is the op's at sampled positions, on random input."""
    sub = subgraph([x_rot], [(x, dtype), (position_ids, ir.DataType.INT64)], dict(model.opset_imports))
    if sub is None:
        return False
    positions = len(t.cos)
    pos = np.unique(np.r_[0, 1, 2, 7, np.random.default_rng(0).integers(0, positions, 4), positions - 1])
    shape = [1, 2, 2, head_dim]
    shape[t.seq_axis] = len(pos)
    np_dtype = dtype.numpy()
    xv = np.random.default_rng(1).standard_normal(shape).astype(np_dtype)
    try:
        (got,) = run(sub, {x.name: xv, position_ids.name: pos[None].astype(np.int64)})
    except ort_errors():  # as in tables()
        return False
    want = rotate(xv.astype(np.float64), t, pos, np_dtype)
    tol = 1e-5 if dtype == ir.DataType.FLOAT else 2e-2
    return got.shape == want.shape and bool(np.allclose(got.astype(np.float64), want, atol=tol, rtol=tol))


@dataclasses.dataclass
class Fused:
    q: ir.Value  # what the op takes instead of the rotated Q and K
    k: ir.Value
    seq_axis: int  # 2: q and k are [B, H, S, D]; 1: [B, S, H, D]
    cos_cache: ir.Value  # [positions, D / 2] initializers of the model's dtype
    sin_cache: ir.Value


def configured_positions(src) -> int | None:
    """The source folder's config.json max_position_embeddings, or None where it does not say (no
    file, no such key, not a positive whole number)."""
    import json
    import pathlib

    cfg = pathlib.Path(src).parent / "config.json"
    try:
        n = json.loads(cfg.read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def positions_for(src) -> int:
    """The tables' positions: the source folder's config.json max_position_embeddings, else
    DEFAULT_POSITIONS; RewriteError where config.json asks for more than MAX_POSITIONS (tables of
    2**62 positions are no model's: the file is damaged, or --rotary-positions must choose)."""
    import pathlib

    n = configured_positions(src)
    if n is not None and n > MAX_POSITIONS:
        from .errors import RewriteError

        raise RewriteError(f"{pathlib.Path(src).parent / 'config.json'}: max_position_embeddings {n} is more than the "
                           f"{MAX_POSITIONS} (2**24) positions rotary tables take; give --rotary-positions N "
                           "(0 keeps the exporter's rotary nodes)")
    return n or DEFAULT_POSITIONS


def plan(model: ir.Model, rotated: dict[int, tuple[ir.Value, ir.Value]], head_dim: dict[int, int], dtype: ir.DataType,
         positions: int) -> dict[int, Fused]:
    """The layers whose rotary the op can take (rotated: each layer's rotated Q and K), with their
    inputs and tables; the others are left out (module docstring)."""
    position_ids = next((v for v in model.graph.inputs if v.name == "position_ids"), None)
    if position_ids is None or dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return {}
    made: dict[tuple[int, int], tuple[RotaryTables, ir.Value, ir.Value] | None] = {}
    fused = {}
    for i, (q_rot, k_rot) in rotated.items():
        site = match(q_rot, k_rot)
        if site is None:
            continue
        key = (id(site.cos), id(site.sin))
        if key not in made:
            t = tables(model, site, position_ids, positions)
            # each distinct table once (made holds the first of equal ones under every site's key)
            distinct = {id(v[1]): v for v in made.values() if v is not None}.values()
            same = next((v for v in distinct if t is not None and v[0].seq_axis == t.seq_axis
                         and np.array_equal(v[0].cos, t.cos) and np.array_equal(v[0].sin, t.sin)), None)
            if t is None or same:  # (torch.onnx dynamo computes the same tables in every layer: kept once)
                made[key] = same
            else:
                n = len(distinct)
                cos, sin = (ir.Value(name=f"tq_rotary_{which}_cache{n or ''}",
                                     const_value=ir.tensor(a.astype(dtype.numpy()), name=f"tq_rotary_{which}_cache{n or ''}"))
                            for which, a in (("cos", t.cos), ("sin", t.sin)))
                made[key] = (t, cos, sin)
        entry = made[key]
        if entry is None:
            continue
        t, cos, sin = entry
        if t.cos.shape[1] * 2 != head_dim[i]:
            continue
        if all(verified(model, x, xr, t, position_ids, head_dim[i], dtype) for x, xr in ((site.q, q_rot), (site.k, k_rot))):
            fused[i] = Fused(site.q, site.k, t.seq_axis, cos, sin)
    for entry in {id(v[1]): v for v in made.values() if v is not None}.values():
        if any(f.cos_cache is entry[1] for f in fused.values()):
            model.graph.register_initializer(entry[1])
            model.graph.register_initializer(entry[2])
    return fused
