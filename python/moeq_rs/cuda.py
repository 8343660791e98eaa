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


def _launch(
    dev: int,
    variant: str,
    entry: str,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    stream: int,
    args: list[tuple[str, Any]],
) -> None:
    _core._cuda_launch(dev, variant, entry, grid, block, 0, stream, args, nvrtc_dirs())


def w8a8_moe_unverified(
    hidden_states: Any,
    router_logits: Any,
    w13: Any,
    w13_scale: Any,
    w2: Any,
    w2_scale: Any,
    *,
    top_k: int,
    renormalize: bool = True,
) -> Any:
    """Dynamic per-token W8A8 MoE on CUDA tensors with this build's kernels (softmax top-k,
    alignment, per-token int8 quantisation, dp4a grouped GEMMs, SiLU-and-mul, combine), on
    torch's current stream. **Not yet run on a GPU**: ``scripts/gpu_check.sh`` is its first
    check; it is not wired into :class:`moeq_rs.MoELayer` until that passes.

    ``w13`` int8 ``[E, 2I, H]`` (gate rows, then up rows), ``w2`` int8 ``[E, H, I]``, scales f32
    ``[E, 2I]`` / ``[E, H]``; H and I multiples of 4; E <= 1024."""
    import torch

    from .errors import LayoutError

    x = hidden_states
    tensors = {
        "hidden_states": x,
        "router_logits": router_logits,
        "w13": w13,
        "w13_scale": w13_scale,
        "w2": w2,
        "w2_scale": w2_scale,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise LayoutError(f"{name}: expected a CUDA tensor")
        if t.device != x.device:
            raise LayoutError(f"{name}: on {t.device}, hidden_states on {x.device}")
        if not t.is_contiguous():
            raise LayoutError(f"{name}: expected a contiguous tensor")
    dtypes = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
    if x.dtype not in dtypes or x.dim() != 2:
        raise LayoutError("hidden_states: expected [T, H] float32, float16 or bfloat16")
    t_count, h = x.shape
    if w13.dtype != torch.int8 or w13.dim() != 3 or w13.shape[2] != h:
        raise LayoutError(f"w13: expected int8 [E, 2I, {h}]")
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if w2.dtype != torch.int8 or tuple(w2.shape) != (e, h, inter):
        raise LayoutError(f"w2: expected int8 [{e}, {h}, {inter}]")
    if h % 4 or inter % 4 or two_i % 2:
        raise LayoutError("w13/w2: H and I must be multiples of 4 (4-byte dp4a rows)")
    if w13_scale.dtype != torch.float32 or tuple(w13_scale.shape) != (e, two_i):
        raise LayoutError(f"w13_scale: expected float32 [{e}, {two_i}]")
    if w2_scale.dtype != torch.float32 or tuple(w2_scale.shape) != (e, h):
        raise LayoutError(f"w2_scale: expected float32 [{e}, {h}]")
    if tuple(router_logits.shape) != (t_count, e):
        raise LayoutError(f"router_logits: expected [{t_count}, {e}]")
    if not 1 <= top_k <= min(e, 64) or e > 1024:
        raise LayoutError("top_k must be in 1..min(E, 64) and E <= 1024")
    dt = dtypes[x.dtype]
    dev = x.device.index or 0
    stream = torch.cuda.current_stream(x.device).cuda_stream
    slots = t_count * top_k
    logits = router_logits.float().contiguous()
    weights = torch.empty(t_count, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t_count, top_k, dtype=torch.int32, device=x.device)
    _launch(
        dev,
        "moe_routing",
        "moe_softmax_topk",
        ((t_count + 127) // 128, 1, 1),
        (128, 1, 1),
        stream,
        [
            ("ptr", logits.data_ptr()),
            ("i32", t_count),
            ("i32", e),
            ("i32", top_k),
            ("i32", int(renormalize)),
            ("ptr", weights.data_ptr()),
            ("ptr", ids.data_ptr()),
        ],
    )
    offsets = torch.empty(e + 1, dtype=torch.int32, device=x.device)
    order = torch.empty(slots, dtype=torch.int32, device=x.device)
    threads = max(32, (e + 31) // 32 * 32)
    _launch(
        dev,
        "moe_align",
        "moe_align",
        (1, 1, 1),
        (threads, 1, 1),
        stream,
        [
            ("ptr", ids.data_ptr()),
            ("i32", slots),
            ("i32", e),
            ("ptr", offsets.data_ptr()),
            ("ptr", order.data_ptr()),
        ],
    )
    rows = x.index_select(0, (order // top_k).long()).contiguous()

    def quantize(a: Any) -> tuple[Any, Any]:
        q = torch.empty(a.shape, dtype=torch.int8, device=x.device)
        s = torch.empty(a.shape[0], dtype=torch.float32, device=x.device)
        _launch(
            dev,
            f"quant_int8_{dt}",
            f"quant_int8_per_token_{dt}",
            (a.shape[0], 1, 1),
            (256, 1, 1),
            stream,
            [
                ("ptr", a.data_ptr()),
                ("i32", a.shape[0]),
                ("i32", a.shape[1]),
                ("ptr", q.data_ptr()),
                ("ptr", s.data_ptr()),
            ],
        )
        return q, s

    def gemm(q: Any, s: Any, w: Any, ws: Any, n: int, k: int) -> Any:
        out = torch.empty(slots, n, dtype=x.dtype, device=x.device)
        _launch(
            dev,
            f"w8a8_gemm_{dt}",
            f"w8a8_grouped_gemm_{dt}",
            ((n + 15) // 16, (slots + 15) // 16, e),
            (16, 16, 1),
            stream,
            [
                ("ptr", q.data_ptr()),
                ("ptr", s.data_ptr()),
                ("ptr", w.data_ptr()),
                ("ptr", ws.data_ptr()),
                ("ptr", offsets.data_ptr()),
                ("i32", n),
                ("i32", k),
                ("ptr", out.data_ptr()),
            ],
        )
        return out

    q1, s1 = quantize(rows)
    gu = gemm(q1, s1, w13, w13_scale, two_i, h)
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _launch(
        dev,
        f"moe_act_{dt}",
        f"silu_and_mul_{dt}",
        ((slots * inter + 255) // 256, 1, 1),
        (256, 1, 1),
        stream,
        [("ptr", gu.data_ptr()), ("i32", slots), ("i32", inter), ("ptr", act.data_ptr())],
    )
    q2, s2 = quantize(act)
    down = gemm(q2, s2, w2, w2_scale, h, inter)
    by_slot = torch.empty_like(down)
    by_slot.index_copy_(0, order.long(), down)
    out = torch.empty(t_count, h, dtype=x.dtype, device=x.device)
    _launch(
        dev,
        f"moe_act_{dt}",
        f"moe_combine_{dt}",
        ((t_count * h + 255) // 256, 1, 1),
        (256, 1, 1),
        stream,
        [
            ("ptr", by_slot.data_ptr()),
            ("ptr", weights.data_ptr()),
            ("i32", t_count),
            ("i32", top_k),
            ("i32", h),
            ("ptr", out.data_ptr()),
        ],
    )
    return out
