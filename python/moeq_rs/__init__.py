"""moeq_rs: load, check and run quantized Mixture-of-Experts checkpoints.

``import moeq_rs as mq``; ``mq.open(path)`` validates a compressed-tensors checkpoint and gives
access to its MoE layers, schemes, tensors and bit-exact dequantised weights.
"""

from __future__ import annotations

from . import _core, cuda, oracle, repack
from .checkpoint import Checkpoint, open
from .errors import (
    CheckpointError,
    ConfigError,
    CudaUnavailableError,
    LayoutError,
    MoeqError,
    UncheckedRoutingWarning,
    UnsupportedSchemeError,
)
from .oracle import Plan, plan

__version__: str = _core.__version__


# MoELayer subclasses torch.nn.Module: these import torch only when they are asked for.
_LAZY = ("MoELayer", "fused_moe")


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name in _LAZY:
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module 'moeq_rs' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names above too, so that completion and dir() list them.
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "CudaUnavailableError",
    "LayoutError",
    "MoELayer",
    "fused_moe",
    "MoeqError",
    "UncheckedRoutingWarning",
    "UnsupportedSchemeError",
    "__version__",
    "open",
    "cuda",
    "oracle",
    "repack",
    "plan",
    "Plan",
]
