"""The CUDA MoE layer: what ``MoELayer.from_checkpoint(..., device="cuda")`` and
``MoELayer.from_tensors(..., device="cuda")`` return (imported on first use: it needs torch)."""

from __future__ import annotations

import math
from typing import Any

import torch

from . import cuda
from .errors import LayoutError
from .moe import MoELayer, _copy_layer, _deepcopy_layer, _NotPicklable, _register

# The launchers in moeq_rs.cuda, by the layer's method: looked up at each call, so that a
# replaced launcher (tests without a GPU) is the one that runs.
_LAUNCHERS = {"wna16": "wna16_moe", "w8a8_int8": "w8a8_moe"}


class CudaMoELayer(MoELayer):
    """A quantized MoE layer on a CUDA GPU: a :class:`moeq_rs.MoELayer` whose weights are CUDA
    buffers (``state_dict`` sees them) and whose forward runs moeq_rs's NVRTC-compiled kernels
    on torch's current stream (CUDA graph capture works). Softmax top-k routing.

    ``.to(other_cuda_device)`` moves the weights; a dtype cast leaves them as they are (outputs
    take the input's dtype); a move off CUDA is refused. Under ``torch.compile`` the forward is
    one ``torch.ops.moeq.moe_forward`` call, as for the CPU layer."""

    def __init__(
        self,
        *,
        layer: int | None,
        method: str,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tensors: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        torch.nn.Module.__init__(self)
        if method not in _LAUNCHERS:
            raise LayoutError(f"method: {method!r} has no CUDA kernel")
        self.layer, self.method = layer, method
        self._hidden_size, self._num_experts, self._top_k = hidden_size, num_experts, top_k
        self._renormalize = bool(renormalize)
        self._tensor_names: list[str] = []
        self._plain: dict[str, Any] = {}
        for name, value in {**tensors, **options}.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
                self._tensor_names.append(name)
            else:
                self._plain[name] = value
        self._handle = _register(self)

    def __copy__(self) -> CudaMoELayer:
        return _copy_layer(self)  # type: ignore[no-any-return]

    def __deepcopy__(self, memo: dict[int, Any]) -> CudaMoELayer:
        return _deepcopy_layer(self, memo)  # type: ignore[no-any-return]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _NotPicklable(
            "a CUDA MoELayer cannot be pickled (its custom-op handle is this process's); save "
            "its state_dict, or build it where it is used with MoELayer.from_checkpoint(path, "
            'layer, device="cuda")'
        )

    def _apply(self, fn: Any, recurse: bool = True) -> CudaMoELayer:
        """``.to()``, ``.cuda()``, ``.half()``: the weights follow a move to another CUDA
        device; their dtypes are the kernels' and stay."""
        here = next(iter(self.buffers())).device
        try:
            moved = fn(torch.empty(0, device=here))
        except Exception as e:  # a device this torch cannot reach
            raise LayoutError(f"moving a CUDA MoELayer failed: {e}") from None
        target = moved.device if isinstance(moved, torch.Tensor) else here
        if target == here:
            return self
        if target.type != "cuda":
            raise LayoutError(
                f"a CUDA MoELayer cannot move to {target}: build a CPU layer with "
                "MoELayer.from_checkpoint(path, layer) instead"
            )
        return torch.nn.Module._apply(self, lambda t: t.to(target), recurse)  # type: ignore[no-any-return]

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Softmax top-k routing and the routed experts, on the GPU."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return torch.ops.moeq.moe_forward(hidden_states, router_logits, self._handle)
        return self._forward_eager(hidden_states, router_logits)

    def forward_topk(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x_t)``: routed experts only."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return torch.ops.moeq.moe_forward_topk(
                hidden_states, topk_weights, topk_ids, self._handle
            )
        return self._forward_topk_eager(hidden_states, topk_weights, topk_ids)

    def _forward_topk_eager(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self._forward_eager(hidden_states, (topk_weights, topk_ids))  # type: ignore[arg-type]

    def _forward_eager(self, hidden_states: torch.Tensor, router_logits: Any) -> torch.Tensor:
        t = {name: getattr(self, name) for name in self._tensor_names}
        weights = [t.pop(k) for k in ("w13", "w13_scale", "w2", "w2_scale")]
        run = getattr(cuda, _LAUNCHERS[self.method])
        out: torch.Tensor = run(
            hidden_states,
            router_logits,
            *weights,
            top_k=self._top_k,
            renormalize=self._renormalize,
            **t,
            **self._plain,
        )
        return out

    def extra_repr(self) -> str:
        where = next(iter(self.buffers())).device
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"method={self.method}, device={where}"
        )


def from_tensors_on_cuda(device: torch.device, p: dict[str, Any]) -> CudaMoELayer:
    """``MoELayer.from_tensors(..., device="cuda")`` from its checked arguments (``p``, as
    ``moe._parse_tensors`` reads them): the W8A8 launcher's tensors on ``device``."""
    from .errors import UnsupportedSchemeError

    scheme, e, h, i = p["scheme"], p["experts"], p["hidden"], p["intermediate"]
    if not scheme.startswith("w8a8"):
        raise UnsupportedSchemeError(
            f"scheme {scheme!r}: from_tensors builds W8A8 layers on CUDA; a weight-only layer "
            "runs there from its checkpoint (MoELayer.from_checkpoint(path, layer, "
            'device="cuda"), which converts it to the Marlin layout) or from Marlin tensors '
            "(moeq repack --target marlin, then moeq_rs.cuda.wna16_moe)"
        )
    if p["groups"] != (1, 1):
        raise UnsupportedSchemeError(
            f"group_size {p['group_size']}: the CUDA W8A8 kernels take per-channel weight scales "
            "(group_size=-1)"
        )

    def on(a: Any, *shape: int) -> torch.Tensor:
        return torch.from_numpy(a).reshape(shape).to(device).contiguous()

    tensors = {
        "w13": on(p["w13"], e, 2 * i, h),
        "w13_scale": on(p["w13_scale"], e, 2 * i),
        "w2": on(p["w2"], e, h, i),
        "w2_scale": on(p["w2_scale"], e, h),
    }
    static = p["a13_scale"] is not None
    for name in ("a13_scale", "a2_scale") if static else ():
        for j, v in enumerate(p[name].tolist()):
            # As the CPU layer refuses them: zero has no codes to give, a negative scale flips
            # the expert's input.
            if not math.isfinite(v):
                raise LayoutError(f"{name}: expert {j} is {v}; scales must be finite")
            if v <= 0:
                raise LayoutError(
                    f"{name}: expert {j} is {v}; static activation scales must be positive"
                )
    options = {
        "a13_scale": on(p["a13_scale"], e) if static else None,
        "a2_scale": on(p["a2_scale"], e) if static else None,
    }
    return CudaMoELayer(
        layer=None,
        method="w8a8_int8",
        hidden_size=h,
        num_experts=e,
        top_k=p["top_k"],
        renormalize=p["renormalize"],
        tensors=tensors,
        options=options,
    )
