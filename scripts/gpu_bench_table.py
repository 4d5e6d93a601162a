"""Prints the CUDA bench JSON (python -m turboquant.bench attention --device cuda --json F) as tables."""
import json
import sys

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
CACHES = ["int8", "int4", "fp8"]  # ORT GroupQueryAttention's own quantized caches
rows = json.load(open(sys.argv[1]))


def ort_cell(r, cache):
    us = r.get(f"ort_gqa_{cache}_us")
    return f"{us:.0f}" if us else "n/a"


print("| B | S | ORT GQA fp16 us | " + " | ".join(f"ORT GQA {c} us" for c in CACHES) + " | torch SDPA us | "
      + " | ".join(f"{p[11:]} us (x vs GQA, bw)" for p in PRESETS) + " |")
for r in rows:
    cells = [f"{r[p + '_us']:.0f} ({r[p + '_x_vs_gqa']:.2f}x, {r[p + '_bw_fraction']:.3f})" for p in PRESETS]
    print(f"| {r['B']} | {r['S']} | {r['ort_gqa_fp16_us']:.0f} | " + " | ".join(ort_cell(r, c) for c in CACHES)
          + f" | {r.get('torch_sdpa_us', 0):.0f} | " + " | ".join(cells) + " |")
for c in CACHES:
    errors = {r.get(f"ort_gqa_{c}_error") for r in rows} - {None}
    if errors:
        print(f"ORT GQA {c} cache unavailable: {errors.pop()}")
print()
print("TQGroupQueryAttention, shared buffer written in place (us, x vs GQA fp16 / vs GQA int4, bw):")
print("| B | S | " + " | ".join(p[11:] for p in PRESETS) + " |")
for r in rows:
    cells = []
    for p in PRESETS:
        vs4 = r.get(f"{p}_inplace_x_vs_gqa_int4")
        cells.append(f"{r[p + '_inplace_us']:.0f} ({r[p + '_inplace_x_vs_gqa']:.2f}x"
                     + (f" / {vs4:.2f}x" if vs4 else "") + f", {r[p + '_inplace_bw_fraction']:.3f})")
    print(f"| {r['B']} | {r['S']} | " + " | ".join(cells) + " |")
print(f"copy bandwidth: {rows[-1]['copy_GBps']:.0f} GB/s (read + write)")
