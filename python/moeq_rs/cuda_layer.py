"""The CUDA MoE layer: what ``MoELayer.from_checkpoint(..., device="cuda")`` and
``MoELayer.from_tensors(..., device="cuda")`` return (imported on first use: it needs torch)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
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
        """``.to()``, ``.cuda()``, ``.half()``: the kernels' weights follow a move to another
        CUDA device and keep their dtypes; parameters and buffers a caller or subclass adds get
        the cast as in any module."""
        here: torch.device = self.w13.device  # type: ignore[assignment]
        try:
            moved = fn(torch.empty(0, device=here))
        except Exception as e:  # a device this torch cannot reach
            raise LayoutError(f"moving a CUDA MoELayer failed: {e}") from None
        target = moved.device if isinstance(moved, torch.Tensor) else here
        if target != here and target.type != "cuda":
            raise LayoutError(
                f"a CUDA MoELayer cannot move to {target}: build a CPU layer with "
                "MoELayer.from_checkpoint(path, layer) instead"
            )
        kernel = {id(getattr(self, name)) for name in self._tensor_names}

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(target) if id(t) in kernel else fn(t)

        return torch.nn.Module._apply(self, move, recurse)  # type: ignore[no-any-return]

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Softmax top-k routing and the routed experts, on the GPU."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            # _op_handle: a literal under inductor's freezing, whose FX graph cache otherwise
            # served a second layer of the same shapes the first one's graph and weights.
            handle = self._op_handle(hidden_states)
            return torch.ops.moeq.moe_forward(hidden_states, router_logits, handle)
        return self._forward_eager(hidden_states, router_logits)

    def forward_topk(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x_t)``: routed experts only."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return torch.ops.moeq.moe_forward_topk(
                hidden_states, topk_weights, topk_ids, self._op_handle(hidden_states)
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
        where = self.w13.device  # a buffer: nn.Module types it loosely
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"method={self.method}, device={where}"
        )


def from_tensors_on_cuda(device: torch.device, p: dict[str, Any]) -> CudaMoELayer:
    """``MoELayer.from_tensors(..., device="cuda")`` from its checked arguments (``p``, as
    ``moe._parse_tensors`` reads them): the W8A8 launcher's tensors, or a weight-only layer's in
    the Marlin layout (:func:`_marlin_tensors`), on ``device``."""
    scheme, e, h = p["scheme"], p["experts"], p["hidden"]
    if scheme.startswith("w8a8"):
        method, (tensors, options) = "w8a8_int8", _w8a8_tensors(p)
    else:
        method, (tensors, options) = "wna16", _marlin_tensors(p)
    return CudaMoELayer(
        layer=None,
        method=method,
        hidden_size=h,
        num_experts=e,
        top_k=p["top_k"],
        renormalize=p["renormalize"],
        tensors={k: torch.from_numpy(v).to(device) for k, v in tensors.items()},
        options={
            k: torch.from_numpy(v).to(device) if isinstance(v, np.ndarray) else v
            for k, v in options.items()
        },
    )


def _w8a8_tensors(p: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A W8A8 layer's ``from_tensors`` arguments as the W8A8 launcher takes them: int8 weights,
    fp32 ``[E, N]`` per-channel scales, static scales ``[E]`` (finite and positive)."""
    from .errors import UnsupportedSchemeError

    e, h, i, k = p["experts"], p["hidden"], p["intermediate"], p["top_k"]
    if h % 4 or i % 4 or e > 1024 or k > 64:
        raise LayoutError(
            f"w13/w2: the CUDA W8A8 kernels take H and I multiples of 4, at most 1024 experts and "
            f"top_k <= 64 (H={h}, I={i}, E={e}, top_k={k})"
        )
    if p["groups"] != (1, 1):
        raise UnsupportedSchemeError(
            f"group_size {p['group_size']}: the CUDA W8A8 kernels take per-channel weight scales "
            "(group_size=-1)"
        )
    tensors = {
        "w13": p["w13"].reshape(e, 2 * i, h),
        "w13_scale": p["w13_scale"].reshape(e, 2 * i),
        "w2": p["w2"].reshape(e, h, i),
        "w2_scale": p["w2_scale"].reshape(e, h),
    }
    static = p["a13_scale"] is not None
    options: dict[str, Any] = {"a13_scale": None, "a2_scale": None}
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
        options[name] = np.ascontiguousarray(p[name])
    return tensors, options


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """32-bit words (int32 or uint32) to their eight 4-bit values along ``axis``, the first in
    the low bits (compressed-tensors' int4 packing)."""
    w = np.moveaxis(words.view(np.uint32), axis, -1)[..., None]
    values = (w >> (np.arange(8, dtype=np.uint32) * 4)) & 15
    return np.moveaxis(values.reshape(*w.shape[:-2], -1), -1, axis)


def _gptq_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned codes ``[E, N, K]`` to GPTQ's words ``[E, K / pf, N]`` (``pf = 32 / bits`` codes
    along K per word, the first in the low bits), the input of the Marlin repack."""
    e, n, k = codes.shape
    pf = 32 // bits
    by_k = codes.transpose(0, 2, 1).astype(np.uint32).reshape(e, k // pf, pf, n)
    shifts = (np.arange(pf, dtype=np.uint32) * bits)[None, None, :, None]
    return np.bitwise_or.reduce(by_k << shifts, axis=2)


def _marlin_tensors(p: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A weight-only layer's ``from_tensors`` arguments (checked, ``moe._parse_tensors``) in
    the Marlin layout ``Checkpoint.marlin_layer`` builds from a checkpoint, byte for byte (the
    repack's rules: w13 = gate then up along N, the intermediate size zero-padded to the tile,
    w13 scales permuted with ``size_k = I``, 4-bit zero points packed). Scales stay fp32 (as
    ``from_tensors`` reads them); codes are stored unsigned (+8 for int4, +128 for int8)."""
    from . import repack
    from .errors import UnsupportedSchemeError

    e, h, i, gs = p["experts"], p["hidden"], p["intermediate"], p["group_size"]
    bits = 4 if p["scheme"] == "w4a16" else 8
    pf = 32 // bits
    if gs not in (-1, 32, 64, 128):
        raise UnsupportedSchemeError(
            f"group_size {gs}: the Marlin layout takes -1 (channelwise), 32, 64 or 128"
        )
    tile = math.lcm(64, max(gs, 1))
    ip = -(-i // tile) * tile
    if h % 64:
        raise LayoutError(
            f"w13: the Marlin layout needs a hidden size that is a multiple of 64 (H = {h})"
        )
    gh, gi_src = p["groups"]
    gi = ip // gs if gs > 0 else 1

    def unsigned(flat: np.ndarray, n: int, k: int) -> np.ndarray:
        if bits == 8:
            return (flat.reshape(e, n, k).astype(np.int16) + 128).astype(np.uint8)
        return _nibbles(flat.reshape(e, n, k // 8), axis=2).astype(np.uint8)

    c13 = np.zeros((e, 2 * ip, h), np.uint8)
    src13 = unsigned(p["w13"], 2 * i, h)
    c13[:, :i], c13[:, ip : ip + i] = src13[:, :i], src13[:, i:]
    c2 = np.zeros((e, h, ip), np.uint8)
    c2[:, :, :i] = unsigned(p["w2"], h, i)
    no_perm = np.zeros((e, 0), np.uint32)
    w13 = repack.gptq_marlin_moe_repack(
        _gptq_words(c13, bits).view(np.int32), no_perm, h, 2 * ip, bits
    )
    w2 = repack.gptq_marlin_moe_repack(_gptq_words(c2, bits).view(np.int32), no_perm, ip, h, bits)

    s13_src = p["w13_scale"].reshape(e, 2 * i, gh).transpose(0, 2, 1)
    s13 = np.zeros((e, gh, 2 * ip), np.float32)
    s13[:, :, :i], s13[:, :, ip : ip + i] = s13_src[:, :, :i], s13_src[:, :, i:]
    s2 = np.zeros((e, gi, h), np.float32)
    s2[:, :gi_src] = p["w2_scale"].reshape(e, h, gi_src).transpose(0, 2, 1)
    size_k2 = gi * (gs if gs > 0 else pf)
    tensors = {
        "w13": w13,
        "w13_scale": repack.marlin_moe_permute_scales(s13, i, 2 * ip, gs),
        "w2": w2,
        "w2_scale": repack.marlin_moe_permute_scales(s2, size_k2, h, gs),
    }
    options: dict[str, Any] = {"num_bits": bits, "group_size": gs, "intermediate_size": i}
    zp13, zp2 = p["w13_zero_point"], p["w2_zero_point"]
    if any(z is not None for z in (*zp13, *zp2)):

        def zp_codes(zp: tuple[Any, Any], n: int, groups: int, name: str) -> np.ndarray:
            """``[E, groups, n]`` unsigned 4-bit codes (zero point + 8); zero points of 0 where
            only the other projection has them (the CPU layer reads the missing side as
            symmetric; the kernel takes zero points for both or neither)."""
            signed, packed = zp
            if signed is None and packed is None:
                return np.full((e, groups, n), 8, np.uint32)
            if packed is not None:
                codes = _nibbles(packed.reshape(e, -(-n // 8), groups), axis=1)[:, :n]
            else:
                codes = signed.reshape(e, n, groups).astype(np.int16) + 8
                bad = np.argwhere((codes < 0) | (codes > 15))
                if len(bad):
                    ex, row, g = bad[0]
                    raise LayoutError(
                        f"{name}: expert {ex}, row {row}, group {g} is "
                        f"{int(codes[ex, row, g]) - 8}; Marlin's 4-bit zero points lie in -8..7"
                    )
            return codes.astype(np.uint32).transpose(0, 2, 1)

        z13_src = zp_codes(zp13, 2 * i, gh, "w13_zero_point")
        z13 = np.zeros((e, gh, 2 * ip), np.uint32)
        z13[:, :, :i], z13[:, :, ip : ip + i] = z13_src[:, :, :i], z13_src[:, :, i:]
        z2 = np.zeros((e, gi, h), np.uint32)
        z2[:, :gi_src] = zp_codes(zp2, h, gi_src, "w2_zero_point")
        options["w13_zero_point"] = np.stack(
            [repack.marlin_zero_points(z, gh, 2 * ip, bits) for z in z13]
        )
        options["w2_zero_point"] = np.stack([repack.marlin_zero_points(z, gi, h, bits) for z in z2])
    return tensors, options
