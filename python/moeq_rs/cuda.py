"""The CUDA path (kernels compiled by NVRTC, launched through cudarc).

Not built yet: the CUDA kernels are the subject of a later issue. :func:`is_available` says so
truthfully (False, never an exception); :func:`compile_kernels` raises
:class:`moeq_rs.CudaUnavailableError` with that explanation.
"""

from __future__ import annotations

from typing import Any

from .errors import CudaUnavailableError

__all__ = ["compile_kernels", "is_available"]


def is_available() -> bool:
    """Whether moeq_rs can run MoE layers on a CUDA GPU here. Never raises."""
    return False


def compile_kernels(arch: str = "sm_90") -> dict[str, dict[str, Any]]:
    """Compile every CUDA kernel variant for ``arch`` (not available in this build)."""
    raise CudaUnavailableError(
        f"compile_kernels({arch!r}): this build of moeq_rs has no CUDA kernels yet"
    )
