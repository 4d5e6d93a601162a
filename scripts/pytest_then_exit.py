"""pytest, then the process ends without Python's shutdown: under compute-sanitizer memcheck the
interpreter's shutdown (ONNX Runtime's CUDA sessions and allocators torn down) took longer than the
tests themselves (the CUDA op tests pass in under 4 minutes, then no exit within 7), so memcheck never
printed its summary. The tests' kernels have all run and been checked by then.

    compute-sanitizer --tool memcheck python3 scripts/pytest_then_exit.py [pytest arguments]
"""

import os
import sys

import pytest

if __name__ == "__main__":
    rc = pytest.main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc))
