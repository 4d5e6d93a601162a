"""Developer tool for the GPU machine: every kernel and copy of a TQGroupQueryAttention step
(turboquant_4bit_nc) and of ORT's fp16 GroupQueryAttention step (B=8, S=32768), as torch.profiler
(CUPTI) records them for the whole process, next to the bench's time per step. Shows what a step
spends outside the attention kernel. Run with PYTHONPATH holding onnxruntime-gpu and turboquant.
"""
import numpy as np, onnxruntime as ort, torch
ort.preload_dlls()
from torch.profiler import profile, ProfilerActivity
from turboquant.bench import cuda_steps as c
rng = np.random.default_rng(0)
for name, fn in [("tqgqa", lambda: c.tq_gqa_step("turboquant_4bit_nc", 8, 32, 8, 128, 32768, 10, rng)),
                 ("gqa", lambda: c.gqa_step(8, 32, 8, 128, 32768, 10, rng))]:
    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = fn()
    print(name, t)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
