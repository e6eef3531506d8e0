"""Integer arithmetic the kernels' plans share (host side, plain Python integers)."""

from __future__ import annotations

__all__ = ["next_pow2", "cdiv"]


def next_pow2(n: int) -> int:
    """The least power of two ``>= n``, for ``n >= 1``."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (toward +infinity)."""
    return -(-a // b)
