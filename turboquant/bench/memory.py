"""Peak memory while one model runs, sampled by a thread: the process's resident set on the CPU;
on CUDA, the device's used memory as nvidia-smi reports it (ONNX Runtime's arenas and every other
allocation of the process, torch's included, with no hook into any allocator; the device is taken
to be this process's alone), each less its level before the model was loaded. A model's points run in the order given, and
ONNX Runtime's CUDA arena keeps its high-water mark from one to the next."""

from __future__ import annotations

import shutil
import subprocess
import threading

HOW = {"cpu": "process RSS (/proc/self/status VmRSS) sampled every 50 ms, above its level before the model was loaded",
       "cuda": "nvidia-smi memory.used of the GPU sampled every 200 ms, above its level before the model was loaded"}


def release() -> None:
    """Hands freed heap back to the system (glibc malloc_trim), so that one model's freed memory
    does not hide the next one's growth in the RSS."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _smi(field: str, gpu: int = 0) -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", str(gpu)],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return int(out.splitlines()[0]) << 20  # MiB
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None


def device_used(gpu: int = 0) -> int | None:
    return _smi("memory.used", gpu)


def device_free(gpu: int = 0) -> int | None:
    return _smi("memory.free", gpu)


def available_host() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    def __init__(self, device: str, base: int | None = None):
        """base: the level to measure from (default: the level on entering)."""
        self.device = device
        self.sample = rss_bytes if device == "cpu" else device_used
        self.period = 0.05 if device == "cpu" else 0.2
        self.base, self.peak = base, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _take(self) -> None:
        v = self.sample()
        if v is not None:
            self.peak = v if self.peak is None else max(self.peak, v)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._take()

    def __enter__(self) -> PeakSampler:
        release()
        if self.base is None:
            self.base = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._take()
        self._stop.set()
        self._thread.join()

    @property
    def added(self) -> int | None:
        """Peak bytes above the level before the model, or None where nothing could be read."""
        if self.base is None or self.peak is None:
            return None
        return max(0, self.peak - self.base)
