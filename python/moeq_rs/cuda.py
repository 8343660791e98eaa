"""The CUDA path: kernels in ``cuda/`` compiled by NVRTC to CUBIN, launched through cudarc.

NVRTC is found (``MOEQ_NVRTC_PATH``, the nvidia pip wheel that torch's CUDA build installs, or
whatever is already loaded) and every kernel variant compiles for a given architecture with no
GPU (:func:`compile_kernels`). On a GPU, ``MoELayer.from_checkpoint(path, layer,
device="cuda")`` (:func:`load_moe_layer`) and ``MoELayer.from_tensors(..., device="cuda")`` run
the kernels on torch's current stream; :func:`w8a8_moe` and :func:`wna16_moe` are the
functional forms. ``scripts/gpu_check.sh`` checks them on a GPU against torch and the CPU path.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

from . import _core
from ._args import text_arg
from ._deps import need_torch

__all__ = [
    "compile_kernels",
    "driver_present",
    "is_available",
    "load_moe_layer",
    "nvrtc_dirs",
    "nvrtc_version",
    "w8a8_moe",
    "wna16_moe",
]


def nvrtc_dirs() -> list[str]:
    """Directories of the nvidia pip wheels that may hold ``libnvrtc`` (CUDA 13 and 12 layouts)."""
    return list(_nvrtc_dirs())


@functools.cache
def _nvrtc_dirs() -> tuple[str, ...]:
    # Looked up once: every kernel launch passes them (an import and three stat calls each
    # time were a large part of a decode step's launch overhead).
    try:
        import nvidia  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return ()
    out = []
    for base in getattr(nvidia, "__path__", []):
        for sub in ("cu13/lib", "cu12/lib", "cuda_nvrtc/lib"):
            d = os.path.join(base, sub)
            if os.path.isdir(d):
                out.append(d)
    return tuple(out)


def driver_present() -> bool:
    """Whether a CUDA driver with at least one device is present. Never raises."""
    try:
        return bool(_core.cuda_driver_available())
    except Exception:  # noqa: BLE001 - the contract is "never raises"
        return False


def is_available() -> bool:
    """Whether moeq_rs can run MoE layers on a CUDA GPU here: a driver with a device, NVRTC,
    and torch seeing a CUDA device. Never raises."""
    try:
        if not driver_present():
            return False
        nvrtc_version()
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - the contract is "never raises"
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
    return _core.cuda_compile_kernels(text_arg(arch, "arch"), nvrtc_dirs())


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


_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def _torch_dtype(dt: str) -> Any:
    """The torch dtype of a kernel variant's suffix (``"bf16"`` -> ``torch.bfloat16``)."""
    import torch

    return getattr(torch, next(name for name, suffix in _DTYPES.items() if suffix == dt))


def _require_visible_cuda(dev: Any, shown: str) -> None:
    """:class:`moeq_rs.CudaUnavailableError` unless torch sees CUDA device ``dev``; ``shown``
    names it in the message."""
    import torch

    from .errors import CudaUnavailableError

    if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
        raise CudaUnavailableError(
            f"{shown}: torch sees {torch.cuda.device_count()} CUDA device(s) "
            "(no driver, or no such GPU)"
        )


def _check_cuda_tensors(x: Any, tensors: dict[str, Any]) -> None:
    """CUDA, on hidden_states' device, contiguous."""
    import torch

    from .errors import LayoutError

    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            raise LayoutError(f"{name}: expected a CUDA tensor")
        if t.device != x.device:
            raise LayoutError(f"{name}: on {t.device}, hidden_states on {x.device}")
        if not t.is_contiguous():
            raise LayoutError(f"{name}: expected a contiguous tensor")


def _check_aligned(tensors: dict[str, Any]) -> None:
    """The kernels read these tensors 4 bytes at a time: their data must start 4-byte aligned."""
    from .errors import LayoutError

    for name, t in tensors.items():
        if t.data_ptr() % 4:
            raise LayoutError(
                f"{name}: its data must start 4-byte aligned (a view at an odd offset?)"
            )


# Grid y of the grouped GEMMs: one block per 16 sorted rows, plus one per expert.
_MAX_GRID_Y = 65535


def _check_grid(tokens: int, top_k: int, experts: int) -> None:
    from .errors import LayoutError

    if (tokens * top_k + 15) // 16 + experts > _MAX_GRID_Y:
        raise LayoutError(
            f"hidden_states: {tokens} tokens x top_k {top_k} need more GEMM blocks than one "
            f"launch holds ({_MAX_GRID_Y}); split the batch"
        )


def _check_index_range(name: str, t: Any, hi: int) -> None:
    """Every entry of an index tensor in ``0..hi`` (a device reduction and a sync, skipped while
    a CUDA graph is being captured; check once before capturing)."""
    import torch

    from .errors import LayoutError

    if t.numel() == 0 or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    lo, top = int(t.min()), int(t.max())
    if lo < 0 or top >= hi:
        raise LayoutError(f"{name}: entries must lie in 0..{hi - 1}, found {lo}..{top}")


def _routing_input(x: Any, routing: Any, e: int, top_k: int) -> tuple[Any, int]:
    """Checks the launchers' second argument: router logits ``[T, E]``, or ``(topk_weights,
    topk_ids)`` ``[T, k]`` (the routed experts only, as ``MoELayer.forward_topk``). Returns it
    (top-k as float32 weights and int32 ids) and the top-k in use."""
    import torch

    from .errors import LayoutError

    t = x.shape[0]
    if not isinstance(routing, tuple):
        _check_cuda_tensors(x, {"router_logits": routing})
        if tuple(routing.shape) != (t, e):
            raise LayoutError(f"router_logits: expected [{t}, {e}], got {list(routing.shape)}")
        return routing, top_k
    if len(routing) != 2:
        raise LayoutError("routing: expected router_logits or (topk_weights, topk_ids)")
    weights, ids = routing
    _check_cuda_tensors(x, {"topk_weights": weights, "topk_ids": ids})
    if ids.dim() != 2 or ids.shape[0] != t or tuple(weights.shape) != tuple(ids.shape):
        raise LayoutError(
            f"topk_weights {list(weights.shape)} and topk_ids {list(ids.shape)} must both be "
            f"[{t}, k]"
        )
    if ids.dtype not in (torch.int32, torch.int64) or not weights.is_floating_point():
        raise LayoutError("topk_ids: expected int32 or int64; topk_weights: a float dtype")
    k = ids.shape[1]
    if not 1 <= k <= e:
        raise LayoutError(f"topk_ids: {k} experts per token, expected 1..{e}")
    _check_index_range("topk_ids", ids, e)
    return (weights.float().contiguous(), ids.to(torch.int32).contiguous()), k


class _Routed:
    """The routing (softmax top-k on the GPU, or given top-k) and the token-by-expert
    alignment of one call."""

    def __init__(self, x: Any, routing: Any, e: int, top_k: int, renormalize: bool) -> None:
        import torch

        self.x, self.top_k, self.e = x, top_k, e
        self.t = x.shape[0]
        self.slots = self.t * top_k
        self.dev = x.device.index or 0
        self.stream = torch.cuda.current_stream(x.device).cuda_stream
        if isinstance(routing, tuple):
            self.weights, ids = routing
            self._align(ids)
            return
        logits = routing.float().contiguous()
        self.weights = torch.empty(self.t, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(self.t, top_k, dtype=torch.int32, device=x.device)
        self.launch(
            "moe_routing",
            "moe_softmax_topk",
            # One warp per token, four per block.
            ((self.t + 3) // 4, 1, 1),
            (128, 1, 1),
            [
                ("ptr", logits.data_ptr()),
                ("i32", self.t),
                ("i32", e),
                ("i32", top_k),
                ("i32", int(renormalize)),
                ("ptr", self.weights.data_ptr()),
                ("ptr", ids.data_ptr()),
            ],
        )
        self._align(ids)

    def _align(self, ids: Any) -> None:
        import torch

        e, x = self.e, self.x
        self.offsets = torch.empty(e + 1, dtype=torch.int32, device=x.device)
        self.order = torch.empty(self.slots, dtype=torch.int32, device=x.device)
        self.launch(
            "moe_align",
            "moe_align",
            # One block of 256 threads per expert.
            (e, 1, 1),
            (256, 1, 1),
            [
                ("ptr", ids.data_ptr()),
                ("i32", self.slots),
                ("i32", e),
                ("ptr", self.offsets.data_ptr()),
                ("ptr", self.order.data_ptr()),
            ],
        )

    def launch(
        self,
        variant: str,
        entry: str,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[tuple[str, Any]],
    ) -> None:
        _launch(self.dev, variant, entry, grid, block, self.stream, args)

    def silu_and_mul(self, gu: Any, inter: int, dt: str) -> Any:
        import torch

        act = torch.empty(self.slots, inter, dtype=_torch_dtype(dt), device=self.x.device)
        self.launch(
            f"moe_act_{dt}",
            f"silu_and_mul_{dt}",
            ((self.slots * inter + 255) // 256, 1, 1),
            (256, 1, 1),
            [("ptr", gu.data_ptr()), ("i32", self.slots), ("i32", inter), ("ptr", act.data_ptr())],
        )
        return act

    def combine(self, down: Any, h: int, dt: str) -> Any:
        """Expert outputs in sorted order ``[slots, h]`` -> the top-k weighted sum ``[T, h]``."""
        import torch

        by_slot = torch.empty_like(down)
        by_slot.index_copy_(0, self.order.long(), down)
        out = torch.empty(self.t, h, dtype=self.x.dtype, device=self.x.device)
        self.launch(
            f"moe_act_{dt}",
            f"moe_combine_{dt}",
            ((self.t * h + 255) // 256, 1, 1),
            (256, 1, 1),
            [
                ("ptr", by_slot.data_ptr()),
                ("ptr", self.weights.data_ptr()),
                ("i32", self.t),
                ("i32", self.top_k),
                ("i32", h),
                ("ptr", out.data_ptr()),
            ],
        )
        return out


def w8a8_moe(
    hidden_states: Any,
    router_logits: Any,
    w13: Any,
    w13_scale: Any,
    w2: Any,
    w2_scale: Any,
    *,
    top_k: int,
    renormalize: bool = True,
    a13_scale: Any = None,
    a2_scale: Any = None,
    gemm: str = "imma",
) -> Any:
    """W8A8 MoE on CUDA tensors with this build's kernels (softmax top-k, alignment, int8
    activation quantisation, grouped int8 GEMMs, SiLU-and-mul, combine), on torch's current
    stream. ``router_logits`` may instead be ``(topk_weights, topk_ids)``: the routed experts
    only, with the given routing. :class:`moeq_rs.MoELayer` on CUDA runs this for W8A8 layers.

    ``w13`` int8 ``[E, 2I, H]`` (gate rows, then up rows), ``w2`` int8 ``[E, H, I]``, scales f32
    ``[E, 2I]`` / ``[E, H]``; H and I multiples of 4; E <= 1024. Activations are quantised per
    token (dynamic), or with each expert's static ``a13_scale`` / ``a2_scale`` (f32 ``[E]``, both
    or neither). ``gemm``: ``"imma"`` (tensor cores, ``mma.sync`` s8) or ``"dp4a"``."""
    torch = need_torch("moeq_rs.cuda.w8a8_moe")

    from .errors import LayoutError

    x = hidden_states
    _check_cuda_tensors(
        x,
        {
            "hidden_states": x,
            "w13": w13,
            "w13_scale": w13_scale,
            "w2": w2,
            "w2_scale": w2_scale,
        },
    )
    _check_aligned({"w13": w13, "w2": w2})
    if str(x.dtype).removeprefix("torch.") not in _DTYPES or x.dim() != 2:
        raise LayoutError("hidden_states: expected [T, H] float32, float16 or bfloat16")
    t_count, h = x.shape
    if w13.dtype != torch.int8 or w13.dim() != 3 or w13.shape[2] != h:
        raise LayoutError(f"w13: expected int8 [E, 2I, {h}]")
    e, two_i, _ = w13.shape
    inter = two_i // 2
    if w2.dtype != torch.int8 or tuple(w2.shape) != (e, h, inter):
        raise LayoutError(f"w2: expected int8 [{e}, {h}, {inter}]")
    if h % 4 or inter % 4 or two_i % 2 or h == 0 or inter == 0:
        # An empty dimension would launch an empty grid, which the driver refuses with a bare
        # CUDA_ERROR_INVALID_VALUE.
        raise LayoutError(
            f"w13/w2: H and I must be positive multiples of 4 (4-byte dp4a rows), got H={h}, "
            f"2I={two_i}"
        )
    if w13_scale.dtype != torch.float32 or tuple(w13_scale.shape) != (e, two_i):
        raise LayoutError(f"w13_scale: expected float32 [{e}, {two_i}]")
    if w2_scale.dtype != torch.float32 or tuple(w2_scale.shape) != (e, h):
        raise LayoutError(f"w2_scale: expected float32 [{e}, {h}]")
    routing, top_k = _routing_input(x, router_logits, e, top_k)
    if not 1 <= top_k <= min(e, 64) or e > 1024:
        raise LayoutError("top_k must be in 1..min(E, 64) and E <= 1024")
    if gemm not in ("imma", "dp4a"):
        raise LayoutError(f"gemm: expected 'imma' or 'dp4a', got {gemm!r}")
    static = (a13_scale, a2_scale)
    if any(a is not None for a in static):
        if any(a is None for a in static):
            raise LayoutError("a13_scale and a2_scale: give both (static W8A8) or neither")
        _check_cuda_tensors(x, {"a13_scale": a13_scale, "a2_scale": a2_scale})
        for name, a in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
            if a.dtype != torch.float32 or tuple(a.shape) != (e,):
                raise LayoutError(f"{name}: expected float32 [{e}] (one input_scale per expert)")
    _check_grid(t_count, top_k, e)
    if t_count == 0:
        return torch.empty(0, h, dtype=x.dtype, device=x.device)
    dt = _DTYPES[str(x.dtype).removeprefix("torch.")]
    r = _Routed(x, routing, e, top_k, renormalize)
    slots = r.slots
    rows = x.index_select(0, (r.order // top_k).long()).contiguous()
    # The expert of each sorted row (for static scales), without a host sync.
    counts = r.offsets[1:] - r.offsets[:-1]
    row_expert = (
        torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=slots)
        if a13_scale is not None
        else None
    )

    def quantize(a: Any, adt: str, static_scale: Any = None) -> tuple[Any, Any]:
        q = torch.empty(a.shape, dtype=torch.int8, device=x.device)
        if static_scale is not None:
            s = static_scale.index_select(0, row_expert).contiguous()
            r.launch(
                f"quant_int8_{adt}",
                f"quant_int8_static_{adt}",
                ((a.numel() + 255) // 256, 1, 1),
                (256, 1, 1),
                [
                    ("ptr", a.data_ptr()),
                    ("i32", a.shape[0]),
                    ("i32", a.shape[1]),
                    ("ptr", s.data_ptr()),
                    ("ptr", q.data_ptr()),
                ],
            )
            return q, s
        s = torch.empty(a.shape[0], dtype=torch.float32, device=x.device)
        r.launch(
            f"quant_int8_{adt}",
            f"quant_int8_per_token_{adt}",
            (a.shape[0], 1, 1),
            (256, 1, 1),
            [
                ("ptr", a.data_ptr()),
                ("i32", a.shape[0]),
                ("i32", a.shape[1]),
                ("ptr", q.data_ptr()),
                ("ptr", s.data_ptr()),
            ],
        )
        return q, s

    def grouped_gemm(q: Any, s: Any, w: Any, ws: Any, n: int, k: int, odt: str) -> Any:
        out = torch.empty(slots, n, dtype=_torch_dtype(odt), device=x.device)
        if gemm == "imma":
            r.launch(
                f"w8a8_imma_{odt}",
                f"w8a8_imma_gemm_{odt}",
                ((n + 63) // 64, (slots + 15) // 16 + e, 1),
                (128, 1, 1),
                [
                    ("ptr", q.data_ptr()),
                    ("ptr", s.data_ptr()),
                    ("ptr", w.data_ptr()),
                    ("ptr", ws.data_ptr()),
                    ("ptr", r.offsets.data_ptr()),
                    ("i32", e),
                    ("i32", n),
                    ("i32", k),
                    ("ptr", out.data_ptr()),
                ],
            )
            return out
        r.launch(
            f"w8a8_gemm_{odt}",
            f"w8a8_grouped_gemm_{odt}",
            ((n + 15) // 16, (slots + 15) // 16, e),
            (16, 16, 1),
            [
                ("ptr", q.data_ptr()),
                ("ptr", s.data_ptr()),
                ("ptr", w.data_ptr()),
                ("ptr", ws.data_ptr()),
                ("ptr", r.offsets.data_ptr()),
                ("i32", n),
                ("i32", k),
                ("ptr", out.data_ptr()),
            ],
        )
        return out

    # The intermediate stays fp32 up to its quantisation (DESIGN.md's numerics, as the CPU path
    # computes it): rounded to bf16 first, a static down_proj scale turned the rounding into
    # whole-code flips, 2.8e-2 relative L2 from the CPU layer on a compressed-tensors checkpoint
    # (scripts/gpu_check.sh on the H200).
    q1, s1 = quantize(rows, dt, a13_scale)
    gu = grouped_gemm(q1, s1, w13, w13_scale, two_i, h, "f32")
    q2, s2 = quantize(r.silu_and_mul(gu, inter, "f32"), "f32", a2_scale)
    return r.combine(grouped_gemm(q2, s2, w2, w2_scale, h, inter, dt), h, dt)


def wna16_moe(
    hidden_states: Any,
    router_logits: Any,
    w13: Any,
    w13_scale: Any,
    w2: Any,
    w2_scale: Any,
    *,
    num_bits: int,
    group_size: int,
    top_k: int,
    renormalize: bool = True,
    intermediate_size: int,
    w13_zero_point: Any = None,
    w2_zero_point: Any = None,
    w13_g_idx: Any = None,
    w2_g_idx: Any = None,
    w13_sort_indices: Any = None,
    w2_sort_indices: Any = None,
) -> Any:
    """WNA16 MoE (int4 or int8 weights, fp16/bf16 activations) on the Marlin layout of
    ``moeq repack --target marlin`` (the ``P.w13_weight_packed``, ``P.w13_weight_scale``, ...
    tensors, per expert stacked), with the tensor-core kernel ``cuda/wna16_gemm.cu``, on torch's
    current stream. ``router_logits`` may instead be ``(topk_weights, topk_ids)``: the routed
    experts only, with the given routing. :class:`moeq_rs.MoELayer` on CUDA runs this for
    weight-only layers.

    ``w13`` int32 ``[E, H/16, 2I*16/pf]``, ``w2`` int32 ``[E, I/16, H*16/pf]`` (pf = 32 /
    num_bits); scales ``[E, G, N]`` in Marlin order (converted to the activation dtype, as vLLM
    keeps them in the model dtype); 4-bit zero points int32 ``[E, G, N/8]``; act-order: sorted
    g_idx and sort indices int32 ``[E, K]`` (their ranges are checked with a sync, except while
    a CUDA graph is captured). ``intermediate_size`` is the unpadded I: it picks the scale table
    of w13, as the repack did."""
    torch = need_torch("moeq_rs.cuda.wna16_moe")

    from .errors import LayoutError, UnsupportedSchemeError

    x = hidden_states
    optional = {
        "w13_zero_point": w13_zero_point,
        "w2_zero_point": w2_zero_point,
        "w13_g_idx": w13_g_idx,
        "w2_g_idx": w2_g_idx,
        "w13_sort_indices": w13_sort_indices,
        "w2_sort_indices": w2_sort_indices,
    }
    given = {k: v for k, v in optional.items() if v is not None}
    _check_cuda_tensors(
        x,
        {
            "hidden_states": x,
            "w13": w13,
            "w13_scale": w13_scale,
            "w2": w2,
            "w2_scale": w2_scale,
            **given,
        },
    )
    _check_aligned({"hidden_states": x})
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        raise LayoutError("hidden_states: expected [T, H] float16 or bfloat16 (tensor cores)")
    if num_bits not in (4, 8):
        raise UnsupportedSchemeError(f"num_bits: expected 4 or 8, got {num_bits}")
    pf = 32 // num_bits
    t_count, h = x.shape
    if w13.dtype != torch.int32 or w13.dim() != 3 or w13.shape[1] != h // 16 or h % 64:
        raise LayoutError(f"w13: expected int32 [E, {h // 16}, 2I*16/{pf}] with H % 64 == 0")
    e = w13.shape[0]
    two_i = w13.shape[2] * pf // 16
    inter = two_i // 2
    if two_i % 128 or w13.shape[2] * pf != two_i * 16:
        raise LayoutError("w13: 2I must be a multiple of 128 (Marlin tiles of 64 columns)")
    if w2.dtype != torch.int32 or tuple(w2.shape) != (e, inter // 16, h * 16 // pf):
        raise LayoutError(f"w2: expected int32 [{e}, {inter // 16}, {h * 16 // pf}]")
    if group_size != -1 and (group_size <= 0 or group_size % 16):
        raise UnsupportedSchemeError(
            f"group_size: expected -1 or a positive multiple of 16, got {group_size}"
        )
    if group_size != -1 and (h % group_size or inter % group_size):
        raise UnsupportedSchemeError(
            f"group_size: {group_size} must divide H = {h} and the (padded) I = {inter}"
        )
    if not 0 < intermediate_size <= inter:
        raise LayoutError(f"intermediate_size: expected 1..{inter}, got {intermediate_size}")
    g13 = 1 if group_size == -1 else h // group_size
    g2 = 1 if group_size == -1 else inter // group_size
    for name, s, shape in (
        ("w13_scale", w13_scale, (e, g13, two_i)),
        ("w2_scale", w2_scale, (e, g2, h)),
    ):
        if s.dtype not in (torch.float16, torch.bfloat16, torch.float32) or tuple(s.shape) != shape:
            raise LayoutError(f"{name}: expected a float tensor {list(shape)}, got {list(s.shape)}")
    zps = (w13_zero_point, w2_zero_point)
    if any(z is not None for z in zps):
        if num_bits != 4 or any(z is None for z in zps):
            raise UnsupportedSchemeError("zero points: 4-bit only, for both w13 and w2")
        for name, z, shape in (
            ("w13_zero_point", w13_zero_point, (e, g13, two_i // 8)),
            ("w2_zero_point", w2_zero_point, (e, g2, h // 8)),
        ):
            if z.dtype != torch.int32 or tuple(z.shape) != shape:
                raise LayoutError(f"{name}: expected int32 {list(shape)}")
    act = (w13_g_idx, w2_g_idx, w13_sort_indices, w2_sort_indices)
    if any(a is not None for a in act):
        if any(a is None for a in act):
            raise LayoutError("act-order: give g_idx and sort indices for both w13 and w2")
        for name, a, k in (
            ("w13_g_idx", w13_g_idx, h),
            ("w13_sort_indices", w13_sort_indices, h),
            ("w2_g_idx", w2_g_idx, inter),
            ("w2_sort_indices", w2_sort_indices, inter),
        ):
            if a.dtype != torch.int32 or tuple(a.shape) != (e, k):
                raise LayoutError(f"{name}: expected int32 [{e}, {k}]")
        _check_index_range("w13_g_idx", w13_g_idx, g13)
        _check_index_range("w2_g_idx", w2_g_idx, g2)
        _check_index_range("w13_sort_indices", w13_sort_indices, h)
        _check_index_range("w2_sort_indices", w2_sort_indices, inter)
    routing, top_k = _routing_input(x, router_logits, e, top_k)
    if not 1 <= top_k <= min(e, 64) or e > 1024:
        raise LayoutError("top_k must be in 1..min(E, 64) and E <= 1024")
    # The scale tables the repack used (vLLM's rules): w13 grouped iff group_size < I, w2
    # grouped iff it has more than one group.
    grouped13 = int(group_size != -1 and group_size < intermediate_size)
    grouped2 = int(group_size != -1 and g2 > 1)
    _check_grid(t_count, top_k, e)
    if t_count == 0:
        return torch.empty(0, h, dtype=x.dtype, device=x.device)
    dt = _DTYPES[str(x.dtype).removeprefix("torch.")]
    r = _Routed(x, routing, e, top_k, renormalize)
    slots = r.slots
    identity = torch.arange(slots, dtype=torch.int32, device=x.device)

    def ptr(t: Any) -> tuple[str, Any]:
        return ("ptr", 0 if t is None else t.data_ptr())

    def gemm(
        a: Any,
        a_div: int,
        index: Any,
        w: Any,
        s: Any,
        z: Any,
        gi: Any,
        perm: Any,
        n: int,
        k: int,
        groups: int,
        grouped: int,
    ) -> Any:
        out = torch.empty(slots, n, dtype=x.dtype, device=x.device)
        s = s.to(x.dtype).contiguous()
        r.launch(
            f"wna16_gemm_{dt}",
            f"wna16_moe_gemm_{dt}",
            (n // 64, (slots + 15) // 16 + e, 1),
            (128, 1, 1),
            [
                ptr(a),
                ("i32", a_div),
                ptr(index),
                ptr(r.offsets),
                ("i32", e),
                ptr(w),
                ptr(s),
                ptr(z),
                ptr(gi),
                ptr(perm),
                ("i32", n),
                ("i32", k),
                ("i32", groups),
                ("i32", k if group_size == -1 else group_size),
                ("i32", num_bits),
                ("i32", grouped),
                ptr(out),
            ],
        )
        return out

    gu = gemm(
        x,
        top_k,
        r.order,
        w13,
        w13_scale,
        w13_zero_point,
        w13_g_idx,
        w13_sort_indices,
        two_i,
        h,
        g13,
        grouped13,
    )
    hidden = r.silu_and_mul(gu, inter, dt)
    down = gemm(
        hidden,
        1,
        identity,
        w2,
        w2_scale,
        w2_zero_point,
        w2_g_idx,
        w2_sort_indices,
        h,
        inter,
        g2,
        grouped2,
    )
    return r.combine(down, h, dt)


def _int8_stack(ckpt: Any, info: dict[str, Any]) -> dict[str, Any]:
    """A W8A8 layer's int8 weights stacked as the W8A8 launcher takes them (CPU tensors)."""
    import torch

    from .errors import CheckpointError, UnsupportedSchemeError

    p = info["prefix"]
    mixtral = p.endswith("block_sparse_moe")
    gate_n, up_n, down_n = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    def t(name: str) -> Any:
        return ckpt.tensor(name, "torch")

    def codes(name: str) -> Any:
        """int8 codes stored in any integer dtype opening accepts (I16, I32, U8 too), read by
        value as the CPU path reads them; a value outside int8 is refused, naming it."""
        data, shape = ckpt._core.int8_codes(name)
        return torch.frombuffer(data, dtype=torch.int8).reshape(shape)

    w13, s13, w2, s2, a13, a2 = [], [], [], [], [], []
    static = not info["activation"]["dynamic"]
    if info["weight"]["strategy"] != "channel":
        raise UnsupportedSchemeError(
            f"{p}: W8A8 weights with strategy {info['weight']['strategy']!r}; the CUDA W8A8 path "
            "takes per-channel weight scales"
        )

    def one(name: str) -> Any:
        v = t(name).float().reshape(-1)
        if v.numel() != 1:
            raise UnsupportedSchemeError(f"{name}: expected one static scale, got {v.numel()}")
        # As the CPU loader: a zero, negative or non-finite scale quantises every token of the
        # expert to nothing (or NaN).
        if not (math.isfinite(v[0].item()) and v[0].item() > 0):
            raise CheckpointError(
                f"tensor '{name}': {v[0].item()}; static activation scales must be finite "
                "and positive"
            )
        return v[0]

    for e in range(info["num_experts"]):
        base = f"{p}.experts.{e}"
        gate, up, down = (f"{base}.{m}" for m in (gate_n, up_n, down_n))
        w13.append(torch.cat([codes(f"{gate}.weight"), codes(f"{up}.weight")]))
        s13.append(
            torch.cat([t(f"{gate}.weight_scale"), t(f"{up}.weight_scale")]).float().reshape(-1)
        )
        w2.append(codes(f"{down}.weight"))
        s2.append(t(f"{down}.weight_scale").float().reshape(-1))
        if static:
            g_in, u_in = one(f"{gate}.input_scale"), one(f"{up}.input_scale")
            if not torch.equal(g_in, u_in):
                raise UnsupportedSchemeError(
                    f"{gate}.input_scale and {up}.input_scale differ: one static scale per "
                    "expert input is needed"
                )
            a13.append(g_in)
            a2.append(one(f"{down}.input_scale"))
    out = {
        "w13": torch.stack(w13).contiguous(),
        "w13_scale": torch.stack(s13).contiguous(),
        "w2": torch.stack(w2).contiguous(),
        "w2_scale": torch.stack(s2).contiguous(),
    }
    if static:
        out["a13_scale"] = torch.stack(a13).contiguous()
        out["a2_scale"] = torch.stack(a2).contiguous()
    return out


def load_moe_layer(path_or_checkpoint: Any, layer: int, device: Any = "cuda") -> Any:
    """Decoder layer ``layer`` on ``device`` for the CUDA kernels (what
    ``MoELayer.from_checkpoint(path, layer, device="cuda")`` returns): a
    :class:`moeq_rs.MoELayer` whose ``forward(hidden_states, router_logits)`` (and
    ``forward_topk(hidden_states, topk_weights, topk_ids)``) runs :func:`wna16_moe` (weights
    from :meth:`moeq_rs.Checkpoint.marlin_layer`) or :func:`w8a8_moe` (int8 weights stacked from
    the checkpoint, static scales per expert). A CPU ``device`` builds the module and its
    launch arguments without a GPU (its forward then refuses, naming the tensor). Softmax top-k
    routing only; layers with shared experts, sigmoid or grouped routing,
    routed scaling, logit soft-capping or mixed schemes raise
    :class:`moeq_rs.UnsupportedSchemeError` with the reason."""
    need_torch("moeq_rs.cuda.load_moe_layer")
    import torch

    from .checkpoint import as_checkpoint
    from .errors import LayoutError, UnsupportedSchemeError
    from .moe import warn_unchecked_family

    ckpt = as_checkpoint(path_or_checkpoint)
    info = next((x for x in ckpt._facts()["moe_layers"] if x["layer"] == layer), None)
    if info is None:
        raise LayoutError(f"layer {layer}: this decoder layer has no MoE block")
    summary = ckpt._facts()
    routing = summary["routing"]
    why = []
    if info["unsupported"]:
        why.append(info["unsupported"])
    if info.get("layout") == "cpu":
        why.append("stored in the CPU layout (moeq repack --target cpu)")
    if info["shared_experts"]:
        why.append("shared experts")
    if routing["scoring_func"] != "softmax" or routing["n_group"]:
        why.append(f"{routing['scoring_func']} routing (n_group {routing['n_group']})")
    if (info["router"] or {}).get("e_score_correction_bias"):
        why.append("a score-correction bias")
    if routing["top_k"] is not None and not 1 <= routing["top_k"] <= info["num_experts"]:
        why.append(f"top_k {routing['top_k']} of {info['num_experts']} experts")
    if routing["routed_scaling_factor"] != 1.0:
        why.append(f"routed_scaling_factor {routing['routed_scaling_factor']}")
    if routing["logit_softcapping"]:
        why.append("router logit soft-capping")
    if not summary["hidden_act_supported"]:
        why.append(f"hidden_act {summary['hidden_act']!r} (the kernels compute silu(gate) * up)")
    if routing["unsupported_family"]:
        why.append(f"model_type {summary['model_type']!r}: {routing['unsupported_family']}")
    if info["mixed"]:
        why.append("mixed schemes across experts")
    if not info["gated"]:
        why.append("non-gated experts")
    if info["method"] not in ("wna16", "w8a8_int8"):
        why.append(f"method {info['method']}")
    if why:
        raise UnsupportedSchemeError(
            f"layer {layer} ({info['prefix']}): not on the CUDA path yet: {', '.join(why)}"
        )
    top_k = routing["top_k"]
    if not top_k:
        raise LayoutError("config.json: no num_experts_per_tok (top_k)")
    warn_unchecked_family(ckpt)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LayoutError(f"device: {device!r} is not a torch device ({e})") from None
    # Checked here: moving the weights would otherwise raise torch's own RuntimeError. (A CPU
    # device builds the module with its launch arguments, for tests; its forward needs a GPU.)
    if dev.type == "cuda":
        _require_visible_cuda(dev, f"device {str(dev)!r}")
    hidden_size, num_experts, method = info["hidden_size"], info["num_experts"], info["method"]
    if method == "wna16":
        geo, tensors = ckpt.marlin_layer(layer)
        p = geo["prefix"]

        def get(suffix: str) -> Any:
            t = tensors.get(f"{p}.{suffix}")
            return None if t is None else t.to(dev)

        args = {
            "w13": get("w13_weight_packed"),
            "w13_scale": get("w13_weight_scale"),
            "w2": get("w2_weight_packed"),
            "w2_scale": get("w2_weight_scale"),
        }
        options: dict[str, Any] = {
            "num_bits": geo["bits"],
            "group_size": geo["group_size"],
            "intermediate_size": geo["intermediate"],
            "w13_zero_point": get("w13_weight_zero_point"),
            "w2_zero_point": get("w2_weight_zero_point"),
        }
        if geo["act_order"]:
            options.update(
                w13_g_idx=get("w13_weight_g_idx"),
                w2_g_idx=get("w2_weight_g_idx"),
                w13_sort_indices=get("w13_g_idx_sort_indices"),
                w2_sort_indices=get("w2_g_idx_sort_indices"),
            )
    else:
        stacked = {k: v.to(dev) for k, v in _int8_stack(ckpt, info).items()}
        args = {k: stacked[k] for k in ("w13", "w13_scale", "w2", "w2_scale")}
        options = {k: stacked.get(k) for k in ("a13_scale", "a2_scale")}

    from .cuda_layer import CudaMoELayer

    return CudaMoELayer(
        layer=layer,
        method=method,
        hidden_size=hidden_size,
        num_experts=num_experts,
        top_k=top_k,
        renormalize=bool(routing["renormalize"]),
        tensors=args,
        options=options,
    )
