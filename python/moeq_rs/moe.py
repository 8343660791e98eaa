"""``MoELayer``: a quantized MoE layer as a ``torch.nn.Module``, run by moeq_rs's CPU kernels.

``forward(hidden_states, router_logits)`` routes per the model config (softmax top-k with or
without renormalisation, or sigmoid grouped top-k with score-correction bias and routed scaling),
runs the routed experts and adds the shared experts. ``forward_topk(hidden_states, topk_weights,
topk_ids)`` is the weighted sum of the routed experts only. Outputs have the hidden dtype.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from . import _core
from .errors import LayoutError

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["MoELayer"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(t: object, name: str, ndim: int, floating: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise LayoutError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.dim() != ndim:
        raise LayoutError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if floating and t.dtype not in _FLOATS:
        raise LayoutError(f"{name}: expected a float dtype, got {t.dtype}")
    if not floating and t.dtype not in (torch.int32, torch.int64):
        raise LayoutError(f"{name}: expected int32 or int64, got {t.dtype}")
    if not t.is_contiguous():
        raise LayoutError(f"{name}: expected a contiguous tensor")
    return t


def _f32(t: torch.Tensor):  # type: ignore[no-untyped-def]
    return t.detach().to(torch.float32).contiguous().reshape(-1).numpy()


class MoELayer(torch.nn.Module):
    """A quantized MoE layer on the CPU (``device="cpu"``)."""

    def __init__(self, core: _core.CpuMoeLayer) -> None:
        super().__init__()
        self._core = core

    @classmethod
    def from_checkpoint(
        cls,
        path_or_checkpoint: str | os.PathLike[str] | Checkpoint,
        layer: int,
        device: str = "cpu",
    ) -> MoELayer:
        """Load decoder layer ``layer`` (its routed experts, router parameters and shared
        experts). Raises :class:`moeq_rs.UnsupportedSchemeError` when the oracle does not plan
        the layer onto the CPU backend, with the oracle's reason."""
        from .checkpoint import Checkpoint
        from .checkpoint import open as open_checkpoint
        from .errors import CudaUnavailableError

        if device != "cpu":
            raise CudaUnavailableError(f"device={device!r}: only the CPU path exists so far")
        ckpt = (
            path_or_checkpoint
            if isinstance(path_or_checkpoint, Checkpoint)
            else open_checkpoint(path_or_checkpoint)
        )
        return cls(_core.CpuMoeLayer.from_checkpoint(ckpt._core, layer))

    @property
    def hidden_size(self) -> int:
        return self._core.hidden_size

    @property
    def num_experts(self) -> int:
        return self._core.num_experts

    @property
    def top_k(self) -> int:
        return self._core.top_k

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        x = _check(hidden_states, "hidden_states", 2, True)
        logits = _check(router_logits, "router_logits", 2, True)
        t, h = x.shape
        if h != self.hidden_size:
            raise LayoutError(
                f"hidden_states: expected [T, {self.hidden_size}], got {list(x.shape)}"
            )
        if tuple(logits.shape) != (t, self.num_experts):
            raise LayoutError(
                f"router_logits: expected [{t}, {self.num_experts}], got {list(logits.shape)}"
            )
        out = self._core.forward(_f32(x), t, _f32(logits))
        return torch.from_numpy(out).reshape(t, h).to(x.dtype)

    def forward_topk(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        x = _check(hidden_states, "hidden_states", 2, True)
        w = _check(topk_weights, "topk_weights", 2, True)
        ids = _check(topk_ids, "topk_ids", 2, False)
        t, h = x.shape
        if h != self.hidden_size:
            raise LayoutError(
                f"hidden_states: expected [T, {self.hidden_size}], got {list(x.shape)}"
            )
        if w.shape != ids.shape or w.shape[0] != t:
            raise LayoutError(
                f"topk_weights {list(w.shape)} and topk_ids {list(ids.shape)} must both be [{t}, k]"
            )
        k = w.shape[1]
        out = self._core.forward_topk(
            _f32(x), t, _f32(w), ids.to(torch.int64).contiguous().reshape(-1).numpy(), k
        )
        return torch.from_numpy(out).reshape(t, h).to(x.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}"
