"""What fp8 keys do to attention, layer by layer, on a real model: the relative error of each layer's
attention output (causal, float64) when its keys are cast to e4m3 as they are, with the calibrated
key offsets, with the offsets and fp8 key scales (export/calibrate.py fp8_key_scale), or with the
offsets and a Walsh-Hadamard rotation; and, for scale, when its values take uint4 instead.

The post-rotary queries and keys and the values come from the Hugging Face model in torch (float32),
on two stretches of a text: the offsets and scales from the first, the errors on the second.

    python scripts/experiments/fp8_key_score_error.py MODEL_DIR --gguf FILE.gguf --text topics.txt
"""

from __future__ import annotations

import argparse
import importlib

import numpy as np
import torch


def capture(model, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Post-rotary q [L, Hq, S, D] and k [L, Hkv, S, D], and v [L, Hkv, S, D], of one forward pass."""
    module = importlib.import_module(type(model.model.layers[0].self_attn).__module__)
    original, qs, ks, vs = module.apply_rotary_pos_emb, [], [], []

    def hooked(q, k, *args, **kw):
        q, k = original(q, k, *args, **kw)
        qs.append(q[0].numpy().copy())
        ks.append(k[0].numpy().copy())
        return q, k

    module.apply_rotary_pos_emb = hooked
    hkv = model.config.num_key_value_heads
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: vs.append(o[0].detach().numpy().copy()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        module.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()
    v = np.stack(vs)
    return np.stack(qs), np.stack(ks), v.reshape(v.shape[0], v.shape[1], hkv, -1).transpose(0, 2, 1, 3)


def fp8(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).to(torch.float32).numpy().astype(np.float64)


def uint4(x: np.ndarray) -> np.ndarray:  # docs/design.md's uint4: per row, fp16 scale and zero
    mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = np.maximum((mx - mn) / 15, 1e-8).astype(np.float16).astype(np.float64)
    z = mn.astype(np.float16).astype(np.float64)
    return np.clip(np.floor((x - z) / s + 0.5), 0, 15) * s + z


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = q @ k.T / np.sqrt(q.shape[-1])
    s[np.triu(np.ones(s.shape, bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from turboquant.export.calibrate import fp8_key_scale

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--gguf")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=1024, help="scored tokens (the calibration stretch: half as many)")
    args = ap.parse_args()
    kw = {"gguf_file": args.gguf} if args.gguf else {}
    tok = AutoTokenizer.from_pretrained(args.model, **kw)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32, **kw).eval()
    text = open(args.text, encoding="utf-8").read()
    ids = tok(text[:len(text) // 2], return_tensors="pt").input_ids[:, :args.tokens]
    cal_ids = tok(text[len(text) // 2:], return_tensors="pt").input_ids[:, :args.tokens // 2]
    q, k, v = (x.astype(np.float64) for x in capture(model, ids))
    kc = capture(model, cal_ids)[1].astype(np.float64)
    d = q.shape[-1]
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    rot = h / np.sqrt(d)
    names = ["fp8", "fp8 - offset", "fp8 - offset, scaled", "fp8 - offset, rotated", "uint4 values"]
    print("| layer | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    total = np.zeros(len(names))
    group = q.shape[1] // k.shape[1]
    for layer in range(q.shape[0]):
        err, ref_sq = np.zeros(len(names)), 0.0
        for hk in range(k.shape[1]):
            kk, vv = k[layer, hk], v[layer, hk]
            off = kc[layer, hk].mean(0)
            s = fp8_key_scale(np.abs(kc[layer, hk] - off).max(0)).astype(np.float64)
            keys = [fp8(kk), fp8(kk - off) + off, fp8((kk - off) / s) * s + off, fp8((kk - off) @ rot) @ rot.T + off]
            for j in range(group):
                qq = q[layer, hk * group + j]
                ref = attention(qq, kk, vv)
                ref_sq += (ref ** 2).sum()
                for n, kq in enumerate(keys):
                    err[n] += ((attention(qq, kq, vv) - ref) ** 2).sum()
                err[-1] += ((attention(qq, kk, uint4(vv)) - ref) ** 2).sum()
        total += err / ref_sq
        print(f"| {layer} | " + " | ".join(f"{e / ref_sq:.2e}" for e in err) + " |")
    print("| mean | " + " | ".join(f"{e / q.shape[0]:.2e}" for e in total) + " |")


if __name__ == "__main__":
    main()
