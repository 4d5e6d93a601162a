"""Prints the CUDA bench JSON (python -m turboquant.bench attention --device cuda --json F) as a table."""
import json
import sys

PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
print("| B | S | ORT GQA fp16 us | torch SDPA us | " + " | ".join(f"{p[11:]} us (x vs GQA, bw)" for p in PRESETS) + " |")
for r in json.load(open(sys.argv[1])):
    cells = [f"{r[p + '_us']:.0f} ({r[p + '_x_vs_gqa']:.2f}x, {r[p + '_bw_fraction']:.3f})" for p in PRESETS]
    print(f"| {r['B']} | {r['S']} | {r['ort_gqa_fp16_us']:.0f} | {r.get('torch_sdpa_us', 0):.0f} | " + " | ".join(cells) + " |")
print()
print("TQGroupQueryAttention, shared buffer written in place (us, x vs GQA, bw):")
print("| B | S | " + " | ".join(p[11:] for p in PRESETS) + " |")
for r in json.load(open(sys.argv[1])):
    cells = [f"{r[p + '_inplace_us']:.0f} ({r[p + '_inplace_x_vs_gqa']:.2f}x, {r[p + '_inplace_bw_fraction']:.3f})"
             for p in PRESETS]
    print(f"| {r['B']} | {r['S']} | " + " | ".join(cells) + " |")
print(f"copy bandwidth: {r['copy_GBps']:.0f} GB/s (read + write)")
