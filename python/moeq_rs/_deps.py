"""Optional dependencies: torch is needed only by the MoE layers, torch tensors out of a
checkpoint and the CUDA path; everything else runs on numpy alone."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from .errors import MissingDependencyError


def have_torch() -> bool:
    """Whether torch is installed (without importing it)."""
    if "torch" in sys.modules:
        # None there blocks the import (the standard way to hide a package).
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def missing_torch(what: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"{what} needs torch, which is not installed: pip install 'moeq_rs[torch]' "
        "(or any torch >= 2.5)"
    )


def need_torch(what: str) -> ModuleType:
    """torch, or a :class:`MissingDependencyError` naming ``what`` needs it."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise missing_torch(what) from e
    return torch
