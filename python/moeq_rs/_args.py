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


def text_arg(value: object, what: str) -> str:
    """``value`` when it is a str the native module can take (UTF-8: no lone surrogates), else a
    :class:`moeq_rs.LayoutError` naming the argument ``what`` (PyO3's own TypeError or
    UnicodeEncodeError named neither the argument nor moeq_rs)."""
    from .errors import LayoutError

    if not isinstance(value, str):
        raise LayoutError(f"{what}: expected a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LayoutError(f"{what}: {value!r} is not valid UTF-8") from None
    return value


def flag_arg(value: object, what: str) -> bool:
    """``value`` as a bool when it is one (Python or numpy), else a :class:`moeq_rs.LayoutError`
    naming the argument ``what``: 1, "yes" or None are not taken for a flag."""
    import numpy as np

    from .errors import LayoutError

    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise LayoutError(f"{what}: expected True or False, got {value!r}")
