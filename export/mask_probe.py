"""What the in-place form needs to know of an exported decoder that its graph may not say: each
layer's query heads (TorchScript exports carry no shapes), whether each layer's attention mask is
the one lengths can replace: attention_mask's padding combined with causal, nothing else (a sliding
window, ALiBi or any other bias is something else), and which value after each layer's attention
holds its output as [B, S, heads * D], the layout the in-place op gives it in.

Both are read off one run of the original model in ONNX Runtime on a probe input: two sequences
with a past of PAST tokens and NEW new ones, the second with a hole in its attention_mask, whose
masks must allow exactly the keys j with attention_mask[b, j] = 1 and j <= PAST + i for query i.
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from .forms import locate
from .plan import plan_layers

PAST, NEW = 253, 3  # a window shorter than 256 tokens shows in the probe; longer ones in config.json (windows)
_HOLE = 1  # the key position the second sequence's attention_mask leaves out


def _causal() -> np.ndarray:
    """bool [NEW, PAST + NEW]: query i sees keys j <= PAST + i."""
    return np.arange(PAST + NEW)[None, :] <= PAST + np.arange(NEW)[:, None]


def expected_mask() -> np.ndarray:
    """bool [2, 1, NEW, PAST + NEW]: the keys each query may attend."""
    am = np.ones((2, PAST + NEW), bool)
    am[1, _HOLE] = False
    return am[:, None, None, :] & _causal()[None, None]


def _allowed(mask: np.ndarray) -> np.ndarray | None:
    """The keys a mask (cast to float32) lets through: a bool mask's ones, an additive mask's zeros
    (its others large negatives); None for any other values (a bias)."""
    if np.all((mask == 0) | (mask == 1)) and (mask == 1).any():
        return mask == 1
    if not np.all((np.abs(mask) < 1e-3) | (mask < -1e3)):
        return None
    return mask > -1.0


def _flat_candidates(y: ir.Value) -> list[tuple[ir.Value, int | None]]:
    """The values of the Reshape/Transpose/Cast chain after the attention's output y (Shape readers
    aside), each with the type the last Cast before it gave (None: y's own): where one is y as
    [B, S, heads * D] (what the output projection reads), the in-place op's own output can take its
    place and the chain can go."""
    out, v, to = [], y, None
    while True:
        users = [n for n in v.consumers() if n.op_type != "Shape"]
        if len(users) != 1 or users[0].op_type not in ("Reshape", "Transpose", "Cast"):
            return out
        if users[0].op_type == "Cast":
            to = int(users[0].attributes["to"].value)
        v = users[0].outputs[0]
        out.append((v, to))


def probe(model_path, plan_args: dict) -> tuple[dict[int, int], dict[int, str], dict[int, tuple[str, int | None]]]:
    """(query heads per layer, the reason each layer whose mask lengths cannot replace, the value
    after each layer's attention that holds its output as [B, S, heads * D], with the type a Cast
    on the way gave it (None: the output's own)) from one run."""
    import onnxruntime as ort

    from turboquant.ort import session_options_beside

    model = ir.load(model_path)
    plans, layers = plan_layers(model, **plan_args)
    outputs: dict[int, tuple] = {}  # layer -> (Q output, mask output or None, 3-D heads or 0, is_causal)
    # layer -> [(value name, its probe output, the type a Cast gave it)]: the attention's output, then its chain
    chains: dict[int, list] = {}
    named: dict[int, str] = {}
    for plan in plans:
        site = locate(layers[plan.index])
        cast = ir.node("Cast", [site.q], {"to": ir.DataType.FLOAT}, name=f"tq_probe_q_{plan.index}")
        site.anchor.graph.insert_before(site.anchor, cast)
        cast.outputs[0].name, cast.outputs[0].dtype = f"tq_probe_q_{plan.index}", ir.DataType.FLOAT
        model.graph.outputs.append(cast.outputs[0])
        mask = None
        if site.mask is not None:
            if id(site.mask) not in named:
                # as float32 (TorchScript leaves its type unsaid): bool masks read 1 and 0, additive ones 0 and -inf
                cast_mask = ir.node("Cast", [site.mask], {"to": ir.DataType.FLOAT}, name=f"tq_probe_mask_{plan.index}")
                site.anchor.graph.insert_before(site.anchor, cast_mask)
                cast_mask.outputs[0].name, cast_mask.outputs[0].dtype = f"tq_probe_mask_{plan.index}", ir.DataType.FLOAT
                model.graph.outputs.append(cast_mask.outputs[0])
                named[id(site.mask)] = cast_mask.outputs[0].name
            mask = named[id(site.mask)]
        outputs[plan.index] = (cast.outputs[0].name, mask, int(site.q_num_heads or 0), site.is_causal)
        # the attention's output and the chain after it, as float32
        chain = [(site.y, None)] + _flat_candidates(site.y)
        for k, (v, to) in enumerate(chain):
            c = ir.node("Cast", [v], {"to": ir.DataType.FLOAT}, name=f"tq_probe_y_{plan.index}_{k}")
            v.producer().graph.insert_after(v.producer(), c)
            c.outputs[0].name, c.outputs[0].dtype = f"tq_probe_y_{plan.index}_{k}", ir.DataType.FLOAT
            model.graph.outputs.append(c.outputs[0])
            chains.setdefault(plan.index, []).append((v.name, c.outputs[0].name, to))
    # from memory, its weights still read from the model's own data files: a copy would be another
    # 16 GB written at the 8B shape
    sess = ort.InferenceSession(ir.to_proto(model).SerializeToString(), session_options_beside(model_path),
                                providers=["CPUExecutionProvider"])
    feeds = _feeds(sess)
    names = [o.name for o in sess.get_outputs()]
    values = dict(zip(names, sess.run(None, feeds)))
    del sess
    heads, bad = {}, {}
    flat = {i: name for i, chain in chains.items() if (name := _flat_value(chain, values))}
    want = expected_mask()
    for i, (q, mask, heads_3d, causal) in outputs.items():
        heads[i] = heads_3d or values[q].shape[1]
        if mask is None:
            if not causal:
                bad[i] = "its attention is neither causal nor masked"
            continue
        got = _allowed(values[mask])
        if got is None:
            bad[i] = f"its mask {mask.removeprefix('tq_probe_mask_')!r} adds values other than 0 and -inf (a bias)"
            continue
        try:
            got, exp = np.broadcast_arrays(got, want)
        except ValueError:
            bad[i] = f"its mask has shape {values[mask].shape}, not broadcastable to [batch, heads, new, total]"
            continue
        if causal:  # the node's own causal alignment applies on top of its mask
            got = got & np.broadcast_to(_causal(), got.shape)
        if not np.array_equal(got, exp):
            bad[i] = "its mask is not attention_mask's padding with causal (a sliding window, or another pattern)"
    return heads, bad, flat


def windows(src, layers: int) -> dict[int, int]:
    """The layers that attend through a sliding window, with its length, as config.json beside the
    model says (Hugging Face's sliding_window, use_sliding_window and layer_types): the probe's
    past is too short to see a window of thousands of tokens. Empty without a config, or where the
    window is off or no shorter than max_position_embeddings."""
    import json
    import pathlib

    try:
        cfg = json.loads((pathlib.Path(src).parent / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cfg, dict):
        return {}
    window, longest = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0 or cfg.get("use_sliding_window") is False:
        return {}
    if isinstance(longest, int) and window >= longest:
        return {}
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return {i: window for i, t in enumerate(types) if "sliding" in str(t)}
    return dict.fromkeys(range(layers), window)


def _flat_value(chain: list, values: dict) -> tuple[str, int | None] | None:
    """The last value of the chain that is the attention's output [B, H, S, D] as [B, S, H * D]."""
    y = values[chain[0][1]]
    if y.ndim != 4:
        return None
    want = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
    found = [(name, to) for name, out, to in chain[1:] if values[out].shape == want.shape
             and np.array_equal(values[out], want)]
    return found[-1] if found else None


def _feeds(sess) -> dict:
    from turboquant.decoder import _NP

    rng = np.random.default_rng(0)
    feeds = {}
    for arg in sess.get_inputs():
        if arg.name == "input_ids":
            feeds[arg.name] = rng.integers(0, 8, (2, NEW)).astype(np.int64)
        elif arg.name == "attention_mask":
            am = np.ones((2, PAST + NEW), np.int64)
            am[1, _HOLE] = 0
            feeds[arg.name] = am
        elif arg.name == "position_ids":
            feeds[arg.name] = np.broadcast_to(np.arange(PAST, PAST + NEW, dtype=np.int64), (2, NEW)).copy()
        elif arg.name.startswith("past"):
            heads, d = arg.shape[1], arg.shape[3]
            feeds[arg.name] = rng.standard_normal((2, heads, PAST, d)).astype(_NP[arg.type])
    return feeds
