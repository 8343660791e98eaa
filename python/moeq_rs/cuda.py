"""The CUDA path: kernels in ``cuda/`` compiled by NVRTC to CUBIN, launched through cudarc.

What works in this build: NVRTC is found (``MOEQ_NVRTC_PATH``, the nvidia pip wheel that torch's
CUDA build installs, or whatever is already loaded) and every kernel variant compiles for a
given architecture with no GPU (:func:`compile_kernels`). Launching the kernels from
``MoELayer(device="cuda")`` is not built yet, so :func:`is_available` is False until it is,
whatever the machine has.
"""

from __future__ import annotations

import os
from typing import Any

from . import _core

__all__ = ["compile_kernels", "driver_present", "is_available", "nvrtc_dirs", "nvrtc_version"]


def nvrtc_dirs() -> list[str]:
    """Directories of the nvidia pip wheels that may hold ``libnvrtc`` (CUDA 13 and 12 layouts)."""
    try:
        import nvidia  # type: ignore[import-not-found]
    except ImportError:
        return []
    out = []
    for base in getattr(nvidia, "__path__", []):
        for sub in ("cu13/lib", "cu12/lib", "cuda_nvrtc/lib"):
            d = os.path.join(base, sub)
            if os.path.isdir(d):
                out.append(d)
    return out


def driver_present() -> bool:
    """Whether a CUDA driver with at least one device is present. Never raises."""
    try:
        return bool(_core.cuda_driver_available())
    except Exception:  # noqa: BLE001 - the contract is "never raises"
        return False


def is_available() -> bool:
    """Whether moeq_rs can run MoE layers on a CUDA GPU here. Never raises.

    False in this build: the kernels compile (see :func:`compile_kernels`) but the launch path
    of ``MoELayer(device="cuda")`` is not built yet."""
    return False


def nvrtc_version() -> tuple[int, int, str | None]:
    """``(major, minor, path)`` of the NVRTC moeq_rs loads (path None when it was already on
    the loader path). Raises :class:`moeq_rs.CudaUnavailableError` when there is none."""
    return _core.cuda_nvrtc_version(nvrtc_dirs())


def compile_kernels(arch: str = "sm_90") -> dict[str, dict[str, Any]]:
    """Compile every CUDA kernel variant for ``arch`` (``"sm_80"``, ``"sm_90"``, ...) with NVRTC;
    no GPU needed. Returns ``{variant: {"cubin_bytes": int, "registers": int, "spill_stores":
    int, "seconds": float, "entries": [str]}}`` (registers: the most any entry function uses;
    spill_stores: bytes, summed). The CUBINs also go to the disk cache. Raises
    :class:`moeq_rs.CudaUnavailableError` when NVRTC is missing or a kernel fails to compile."""
    return _core.cuda_compile_kernels(arch, nvrtc_dirs())
