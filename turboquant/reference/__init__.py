"""Numpy reference implementations: the oracle for every kernel (see formats.py, attention.py)."""

from .attention import attention
from .formats import pack, unpack

__all__ = ["attention", "pack", "unpack"]
