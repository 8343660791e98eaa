"""Integer arguments checked before they reach the native module, whose unsigned and 32-bit
parameters would otherwise answer a negative or huge value with an ``OverflowError`` that names
no argument."""

from __future__ import annotations

import operator

# The native module takes sizes as 64-bit and compute capabilities as 32-bit integers.
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integer (numpy and torch integer scalars
    included), else None; a bool (Python, numpy or torch) is not a size."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def int_in(value: object, low: int, high: int) -> int | None:
    """``value`` as an int when it is one in ``low..=high``, else None."""
    v = as_int(value)
    return v if v is not None and low <= v <= high else None
