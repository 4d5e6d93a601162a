"""What the CUDA decode bench records (bench.cuda, bench.cuda_variants): one ShapeRun per (B, S), each
candidate's step timed two ways, every ratio and bandwidth worked out from them when asked for, in
the same run."""

from __future__ import annotations

import dataclasses

# candidates' names in a ShapeRun, beside the presets'
GQA_FP16, GQA_ROTARY, TORCH_SDPA = "ort_gqa_fp16", "ort_gqa_rotary", "torch_sdpa"
INPLACE = "_inplace"  # a preset's TQGroupQueryAttention (shared buffer) step
ROTARY = "_rotary"  # a preset's step with the rotary embedding in the op


@dataclasses.dataclass
class Timing:
    """One candidate's step: waited for (Run, then the outputs synchronised; None where it was not
    timed so) and back to back (the GPU time of steps run without waiting), microseconds."""

    waited_us: float | None
    back_to_back_us: float
    bytes_read: int

    def us(self, back_to_back: bool) -> float | None:
        return self.back_to_back_us if back_to_back else self.waited_us


@dataclasses.dataclass
class ShapeRun:
    batch: int
    context: int
    copy_gbps: float | None = None  # a device-to-device copy's rate in the same run (read + write)
    timings: dict[str, Timing] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # candidate -> why it did not run

    def add(self, name: str, seconds: tuple[float | None, float], bytes_read: int) -> None:
        """name's (waited, back-to-back) seconds per step."""
        waited, back_to_back = seconds
        self.timings[name] = Timing(None if waited is None else waited * 1e6, back_to_back * 1e6, bytes_read)

    def fail(self, name: str, error: Exception) -> None:
        text = str(error)
        self.errors[name] = text.splitlines()[0][:200] if text else type(error).__name__

    def us(self, name: str, back_to_back: bool) -> float | None:
        t = self.timings.get(name)
        return t.us(back_to_back) if t else None

    def ratio(self, name: str, base: str, back_to_back: bool) -> float | None:
        """base's time / name's, the same timing: above 1, name is faster; None where either is missing."""
        ours, theirs = self.us(name, back_to_back), self.us(base, back_to_back)
        return theirs / ours if ours and theirs else None

    def bw_fraction(self, name: str, back_to_back: bool) -> float | None:
        """name's bytes read per second as a fraction of the copy rate."""
        us = self.us(name, back_to_back)
        if not us or not self.copy_gbps:
            return None
        return self.timings[name].bytes_read / (us * 1e-6) / (self.copy_gbps * 1e9)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
