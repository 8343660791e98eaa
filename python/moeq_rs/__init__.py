"""moeq_rs: load, check and run quantized Mixture-of-Experts checkpoints.

``import moeq_rs as mq``; ``mq.open(path)`` validates a compressed-tensors checkpoint and gives
access to its MoE layers, schemes, tensors and bit-exact dequantised weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _core, cuda, oracle, repack
from ._deps import have_torch, missing_torch
from .checkpoint import Checkpoint, open
from .errors import (
    CheckpointError,
    ConfigError,
    CudaUnavailableError,
    LayoutError,
    MissingDependencyError,
    MoeqError,
    UncheckedRoutingWarning,
    UnsupportedSchemeError,
)
from .oracle import Plan, plan

if TYPE_CHECKING:
    from .moe import MoELayer as MoELayer
    from .moe import fused_moe as fused_moe

__version__: str = _core.__version__


# MoELayer subclasses torch.nn.Module: these import torch only when they are asked for, and
# are listed (dir(), `import *`) only where torch is installed.
_LAZY = ("MoELayer", "fused_moe")


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    if name in _LAZY:
        if not have_torch():
            raise missing_torch(f"moeq_rs.{name}")
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module 'moeq_rs' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that completion and dir() list them.
    return sorted({*globals(), *__all__})


__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "CudaUnavailableError",
    "LayoutError",
    "MissingDependencyError",
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
if have_torch():
    __all__ += _LAZY


def _register_ops_if_torch_is_loaded() -> None:
    """Registers the ``torch.ops.moeq`` custom ops now when the process has imported torch
    already, so that ``import torch, moeq_rs`` is enough to call them; a process without torch
    (the ``moeq`` command line) does not pay torch's import."""
    import sys

    if sys.modules.get("torch") is not None:
        try:
            from . import moe  # noqa: F401
        except Exception:  # noqa: BLE001
            # Not here: `import moeq_rs` must work whatever the torch (the checkpoint API and
            # the CLI need none); the first use of mq.MoELayer or mq.fused_moe imports the
            # module again and raises its error there.
            pass


_register_ops_if_torch_is_loaded()
