"""Numpy reference implementations: the oracle for every kernel (see formats.py, attention.py)."""

from .attention import attention
from .formats import pack, unpack
from .gqa import group_query_attention
from .paged import paged_attention, pool_rows

__all__ = ["attention", "group_query_attention", "pack", "paged_attention", "pool_rows", "unpack"]
