"""``MoELayer``: a quantized MoE layer as a ``torch.nn.Module``, run by moeq_rs's CPU kernels.

``forward(hidden_states, router_logits)`` routes per the model config (softmax or sigmoid
scores, top-k with or without renormalisation, expert groups as vLLM's ``grouped_topk``,
score-correction bias and routed scaling), runs the routed experts and adds the shared experts.
``forward_topk(hidden_states, topk_weights, topk_ids)`` is the weighted sum of the routed experts
only. Outputs have the hidden dtype.
"""

from __future__ import annotations

import copy
import os
import random
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils._device import DeviceContext as _DeviceContext

from . import _core
from ._args import I64_MAX, as_int, int_in
from ._threads import adopt_main_thread
from .errors import LayoutError, MoeqError, UncheckedRoutingWarning

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["MoELayer", "fused_moe"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_MOVE_TO_CUDA = (
    "MoELayer runs on the CPU only once built there ({device}: its weights are packed for the "
    'CPU kernels): build it on the GPU with MoELayer.from_checkpoint(path, layer, device="cuda")'
)


def _target_device(device: str | torch.device) -> torch.device:
    """``device`` as torch reads it (``"cpu"``, ``"cpu:0"``, ``torch.device("cuda", 1)``): the
    CPU, or a CUDA device torch sees (else ``CudaUnavailableError``); anything else is a device
    no kernel runs on."""
    from .cuda import _require_visible_cuda

    try:
        parsed = device if isinstance(device, torch.device) else torch.device(device)
    except (TypeError, RuntimeError, ValueError) as e:
        raise LayoutError(f"device={device!r}: not a device torch knows ({e})") from None
    if parsed.type == "cuda":
        _require_visible_cuda(parsed, f"device={device!r}")
        return parsed
    if parsed.type != "cpu":
        raise LayoutError(
            f'device={device!r}: MoELayer runs on the CPU (device="cpu") or a CUDA GPU '
            '(device="cuda")'
        )
    return parsed


def _check(t: object, name: str, ndim: int, floating: bool, meta: bool = False) -> torch.Tensor:
    """``t`` as a layer's forward takes it; ``meta``: the call only traces shapes, so it is on
    the meta device (``_meta_call`` has checked that every argument is)."""
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise LayoutError(f"{name}: expected a dense (strided) tensor, got {kind}")
    if not meta and not t.is_cpu:
        raise LayoutError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.dim() != ndim:
        raise LayoutError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if floating and t.dtype not in _FLOATS:
        raise LayoutError(f"{name}: expected float32, float64, float16 or bfloat16, got {t.dtype}")
    if not floating and t.dtype not in (torch.int32, torch.int64):
        raise LayoutError(f"{name}: expected int32 or int64, got {t.dtype}")
    if not t.is_contiguous():
        raise LayoutError(f"{name}: expected a contiguous tensor")
    return t


def _meta_call(hidden_states: object, **others: object) -> bool:
    """Whether a layer's forward only traces shapes (every tensor argument on the meta device,
    as in a model built under ``torch.device("meta")``): after the usual checks it runs the
    custom op, whose fake implementation makes the meta ``[T, H]`` output (so traces record
    the op). A mix of meta and CPU arguments is refused by name."""
    if not isinstance(hidden_states, torch.Tensor):
        return False
    tensors = [t for t in others.values() if isinstance(t, torch.Tensor)]
    if not hidden_states.is_meta and not any(t.is_meta for t in tensors):
        return False
    _refuse_meta_mix(hidden_states, **others)  # type: ignore[arg-type]
    return True


# Plain CPU torch tensors go to the native forward as they are, read and made through torch's
# DLPack C exchange table (false on a torch without one: the numpy path below then serves).
_TORCH_TENSORS_NATIVE = _core.cpu_use_torch_tensors(torch.Tensor)

# Bound once: an attribute chain costs microseconds per decode step with cold caches. torch.compile
# recognises the function itself, whatever it is called here.
_is_compiling = torch.compiler.is_compiling
# Only dynamo's tracing, which the eager fast path must not reach (native code breaks its
# graph); a plain `return False` outside it, cheaper than `is_compiling` (~12 us once evicted).
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", _is_compiling)
_is_tracing = torch.jit.is_tracing
# How many TorchDispatchModes are active (make_fx's proxy mode and FakeTensorMode among them).
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes_enabled = torch._C._is_torch_function_mode_enabled
_function_stack_len = torch._C._len_torch_function_stack
_function_stack_at = torch._C._get_function_stack_at


def _function_modes() -> bool:
    """Whether a TorchFunctionMode is active that should see ``torch.ops.moeq.*``, as dispatch
    modes do: any but ``torch.device``'s (``_DeviceContext``: ``with torch.device(...)``,
    ``torch.set_default_device``), which changes factory functions only."""
    if not _function_modes_enabled():
        return False
    return any(
        type(_function_stack_at(i)) is not _DeviceContext for i in range(_function_stack_len())
    )


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_forward_ad = torch.autograd.forward_ad


def _eager(*tensors: object) -> bool:
    """Whether a call may skip the custom op: not compiling or ``torch.jit.trace``-ing (a trace
    that never saw the op recorded the output as a constant), no TorchDispatchMode active (as
    ``make_fx`` tracing, which likewise baked the output in, ``FakeTensorMode`` or a FLOP
    counter) and no TorchFunctionMode but ``torch.device``'s (each sees the op, never the native
    call), plain tensors (a subclass, a fake tensor among them, needs the op's dispatch: the
    numpy path cannot read it), and no input that needs gradients."""
    if _forward_ad._current_level >= 0:
        _refuse_dual_tensors(tensors)
    return (
        not _is_compiling()
        and not _is_tracing()
        and not _dispatch_modes()
        and not _function_modes()
        and all(type(t) is _Tensor for t in tensors)
        and not _wants_grad(*tensors)
    )


_NO_TRANSFORMS = (
    "moeq_rs MoE layers run on plain tensors: an input has no storage of its own, as inside "
    "torch.func transforms (vmap, grad, jvp), which these layers do not support"
)
_is_functorch_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda t: False)


def _refuse_transforms(*tensors: object) -> None:
    """On the custom op's path outside torch.compile: a dual tensor or a torch.func wrapper
    (whose inputs reach the op with ``requires_grad``) gets this library's message, not torch's
    about the op's autograd function."""
    if _forward_ad._current_level >= 0:
        _refuse_dual_tensors(tensors)
    if any(isinstance(t, torch.Tensor) and _is_functorch_wrapped(t) for t in tensors):
        raise NotImplementedError(_NO_TRANSFORMS)


def _refuse_dual_tensors(tensors: tuple[object, ...]) -> None:
    """Forward-mode AD (inside ``forward_ad.dual_level()``): a dual input's tangent would be
    dropped without a word (the output carried none), so it is refused, as torch refuses ops
    without a forward derivative."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                "moeq_rs MoE layers have no forward-mode derivative: an input is a dual tensor "
                "(torch.autograd.forward_ad); run the layer on its primal"
            )


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values in memory: a negative view (``torch._neg_view``, the ``.imag`` of a
    conjugate view) keeps them un-negated there."""
    return t.resolve_neg() if torch.Tensor.is_neg(t) else t


def _f32(t: torch.Tensor):  # type: ignore[no-untyped-def]
    # Few torch calls: each costs microseconds, and tens of them when caches are cold (a
    # decode step; measured 5-25 us each after a cache flush). The native side takes
    # contiguous arrays of any shape (callers check contiguity), so no reshape.
    t = _plain(t)
    if t.requires_grad:
        t = t.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return _numpy(t)


def _numpy(t: torch.Tensor):  # type: ignore[no-untyped-def]
    try:
        return t.numpy()
    except RuntimeError as e:
        if "storage" not in str(e):
            raise
        # torch.func's vmap, grad and jvp pass wrapper tensors with no storage of their own.
        raise NotImplementedError(_NO_TRANSFORMS) from None


def _hidden(t: torch.Tensor):  # type: ignore[no-untyped-def]
    """What the native forward takes for ``hidden_states``: bf16 as its raw bits (int16), which
    it widens and rounds back itself (two torch conversions fewer per call), else f32."""
    if t.dtype == torch.bfloat16:
        t = _plain(t)
        if t.requires_grad:
            t = t.detach()
        return _numpy(t.view(torch.int16))
    return _f32(t)


def _output(out, dtype: torch.dtype) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The native ``[T, H]`` output (f32, or bf16 bits for bf16 input) as a tensor of ``dtype``."""
    y = torch.from_numpy(out)
    if dtype == torch.bfloat16:
        return y.view(torch.bfloat16)
    if dtype == torch.float32:
        return y
    return y.to(dtype)


def warn_unchecked_family(ckpt: Any) -> None:
    """Warns once per checkpoint object when its model family's router was not checked."""
    summary = ckpt._facts()
    if summary["routing"]["family_checked"] or ckpt._routing_warned:
        return
    ckpt._routing_warned = True
    warnings.warn(
        f"{ckpt.path / 'config.json'}: model_type {summary['model_type']!r}: routing is read "
        "from config.json as for the families moeq_rs checks (softmax or sigmoid top-k, "
        "optional bias, groups, renormalisation and scaling); check that this model's router "
        "is one of those",
        UncheckedRoutingWarning,
        stacklevel=3,
    )


class _NotPicklable(MoeqError, TypeError):
    """Pickling a layer: a MoeqError and, as Python's convention wants, a TypeError."""


class MoELayer(torch.nn.Module):
    """A quantized MoE layer on the CPU (``device="cpu"``)."""

    _handle_id: int  # the value of ``_handle``, set by ``_register``

    def __init__(self, core: _core.CpuMoeLayer) -> None:
        super().__init__()
        self._core = core
        # Plain ints: the native getters cost microseconds each per decode step once a cache
        # flush (or the rest of a model) has evicted them.
        self._hidden_size = core.hidden_size
        self._num_experts = core.num_experts
        self._top_k = core.top_k
        self._handle = _register(self)

    def __copy__(self) -> MoELayer:
        return _copy_layer(self)

    def _apply(self, fn: Any, recurse: bool = True) -> MoELayer:
        """What ``.to()``, ``.cuda()``, ``.half()`` and the like do to a module. The weights live
        in moeq_rs's CPU memory, not in parameters: a dtype changes nothing for them (outputs
        take the input's dtype), and a move off the CPU is refused instead of silently not
        happening. Parameters, buffers and modules a caller or subclass adds get the cast."""
        try:
            moved = fn(torch.empty(0, device="cpu"))
        except Exception as e:  # a device this torch cannot reach
            raise LayoutError(f"MoELayer runs on the CPU only; moving it failed: {e}") from None
        device = moved.device if isinstance(moved, torch.Tensor) else torch.device("cpu")
        if device.type == "cuda":
            raise LayoutError(_MOVE_TO_CUDA.format(device=device))
        if device.type != "cpu":
            raise LayoutError(f"MoELayer runs on the CPU only; cannot move it to {device}")
        return super()._apply(fn, recurse)  # type: ignore[no-any-return]

    def __deepcopy__(self, memo: dict[int, Any]) -> MoELayer:
        return _deepcopy_layer(self, memo)

    def __prepare_scriptable__(self) -> Any:
        # torch.jit.script failed on an internal line (`_eager(*tensors)`), not on the layer.
        raise NotImplementedError(
            "torch.jit.script cannot compile a moeq_rs MoELayer (its forward is native code, "
            "not TorchScript): use torch.compile, torch.export or torch.jit.trace"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle (torch.save of a model, spawn/forkserver children) reached the native object's
        # bare "TypeError: cannot pickle 'moeq_rs._core.CpuMoeLayer'". Still a TypeError, as
        # pickling probes expect of what does not pickle.
        raise _NotPicklable(
            "MoELayer cannot be pickled: its packed weights live in moeq_rs's native memory, not "
            "in tensors. Build it where it is used (MoELayer.from_checkpoint(path, layer) in the "
            "other process; forked children inherit it)"
        )

    @classmethod
    def from_checkpoint(
        cls,
        path_or_checkpoint: str | os.PathLike[str] | Checkpoint,
        layer: int,
        device: str | torch.device = "cpu",
    ) -> MoELayer:
        """Load decoder layer ``layer`` (its routed experts, router parameters and shared
        experts). Raises :class:`moeq_rs.UnsupportedSchemeError` when the oracle does not plan a
        quantized layer onto the CPU backend, with the oracle's reason (an unquantized layer,
        whose plan names no backend, runs on the CPU's fp32 / bf16 path); another
        :class:`moeq_rs.MoeqError` for bad input (``ConfigError`` for routing settings such as a
        top-k above the expert count, ``CheckpointError`` for a layer with no MoE block or a
        non-positive static scale, ``CudaUnavailableError`` for a CUDA device torch does not
        see).

        ``device="cuda"`` (or ``"cuda:N"``) loads the layer onto that GPU as a
        :class:`moeq_rs.cuda_layer.CudaMoELayer` (:func:`moeq_rs.cuda.load_moe_layer`: softmax
        top-k layers without shared experts; others raise ``UnsupportedSchemeError`` with the
        reason)."""
        from .checkpoint import as_checkpoint

        target = _target_device(device)
        from .errors import CheckpointError

        index = int_in(layer, 0, I64_MAX)
        if index is None:
            raise CheckpointError(f"layer: {layer!r} is not a decoder layer index (an int >= 0)")
        if target.type == "cuda":
            from .cuda import load_moe_layer

            return load_moe_layer(path_or_checkpoint, index, target)  # type: ignore[no-any-return]
        # Opening and packing run on the forward's threads (MOEQ_NUM_THREADS of them, the main
        # thread among them), not on a pool of their own that would then idle.
        adopt_main_thread()
        ckpt = as_checkpoint(path_or_checkpoint)
        moe = cls(_core.CpuMoeLayer.from_checkpoint(ckpt._core, index))
        warn_unchecked_family(ckpt)
        return moe

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def top_k(self) -> int:
        return self._top_k

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Routed experts (routing per the model config, routed scaling) plus shared experts."""
        if not _is_dynamo_compiling():
            # Plain CPU tensors of the layer's shapes, in eager mode with no gradient wanted:
            # straight to native code, which checks that state itself (the checks below cost
            # ~50 us per call once a cache flush, or the rest of a model, has evicted them).
            out = self._core.forward_torch(hidden_states, router_logits, True)
            if out is not None:
                return out
        if _eager(hidden_states, router_logits):
            # Eager: skip the custom-op dispatch (tens of microseconds, a third of a decode
            # step); graphs, traces, tensor subclasses (fake tensors among them) and inputs that
            # need gradients (whose backward then says there is none, as in a graph) still go
            # through torch.ops.moeq.moe_forward.
            return self._forward_eager(hidden_states, router_logits)
        if not _is_compiling():
            # While torch.compile traces, an error raised here would reach the caller as
            # dynamo's own (with fullgraph=True); the op checks the same when it runs.
            if _meta_call(hidden_states, router_logits=router_logits):
                # Shapes only: checked as an eager call checks them, then the op.
                return self._forward_checked(hidden_states, router_logits)
            # Fake tensors and tensor subclasses (a FakeTensorMode trace, make_fx): their
            # shapes are checked here, or the trace would record a wrong output shape.
            self._check_shapes(
                _check(hidden_states, "hidden_states", 2, True),
                _check(router_logits, "router_logits", 2, True),
            )
            _refuse_transforms(hidden_states, router_logits)
        return torch.ops.moeq.moe_forward(
            hidden_states, router_logits, self._op_handle(hidden_states)
        )

    def forward_topk(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x_t)``: routed experts only."""
        if not _is_dynamo_compiling():
            # As in forward.
            out = self._core.forward_topk_torch(hidden_states, topk_weights, topk_ids, True)
            if out is not None:
                return out
        if _eager(hidden_states, topk_weights, topk_ids):
            return self._forward_topk_eager(hidden_states, topk_weights, topk_ids)
        if not _is_compiling():
            # As in forward: the op checks them when it runs.
            if _meta_call(hidden_states, topk_weights=topk_weights, topk_ids=topk_ids):
                return self._forward_topk_checked(hidden_states, topk_weights, topk_ids)
            self._check_topk_shapes(
                _check(hidden_states, "hidden_states", 2, True),
                _check(topk_weights, "topk_weights", 2, True),
                _check(topk_ids, "topk_ids", 2, False),
            )
            _refuse_transforms(hidden_states, topk_weights, topk_ids)
        return torch.ops.moeq.moe_forward_topk(
            hidden_states, topk_weights, topk_ids, self._op_handle(hidden_states)
        )

    def _op_handle(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The handle to pass the custom op: as it is, or under ``FakeTensorMode`` (outside
        torch.compile, which fakes it itself) as a fake tensor of that mode, which refuses to
        mix real and fake tensors."""
        if not _is_compiling():
            mode = getattr(hidden_states, "fake_mode", None)
            if mode is not None:
                return mode.from_tensor(self._handle)
        elif _inductor_freezes():
            # Freezing folds the handle tensor into a constant that inductor's FX graph cache
            # does not tell apart by value: a second layer of the same shapes was served the
            # first one's graph, handle included, and ran its weights. A literal in the graph
            # is part of the cache key.
            return torch.full((), self._handle_id, dtype=torch.int64)
        return self._handle

    def _forward_eager(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """``forward`` on real tensors (eager calls, and the custom op's implementation). Plain
        row-major CPU tensors of the layer's shapes go straight to the native forward (~0.1 ms
        less per call at decode than ``_forward_checked``'s checks and numpy conversions);
        anything else takes ``_forward_checked``, which names the problem."""
        adopt_main_thread()
        out = self._core.forward_torch(hidden_states, router_logits)
        if out is not None:
            return out
        return self._forward_checked(hidden_states, router_logits)

    def _forward_topk_eager(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """``forward_topk`` on real tensors, as ``_forward_eager``."""
        adopt_main_thread()
        out = self._core.forward_topk_torch(hidden_states, topk_weights, topk_ids)
        if out is not None:
            return out
        return self._forward_topk_checked(hidden_states, topk_weights, topk_ids)

    def _check_shapes(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """``forward``'s shapes: ``x`` ``[T, H]`` and ``logits`` ``[T, E]`` of this layer."""
        t, h = x.shape
        if h != self._hidden_size:
            raise LayoutError(
                f"hidden_states: expected [T, {self._hidden_size}], got {list(x.shape)}"
            )
        if logits.shape != (t, self._num_experts):
            raise LayoutError(
                f"router_logits: expected [{t}, {self._num_experts}], got {list(logits.shape)}"
            )

    def _check_topk_shapes(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
        """``forward_topk``'s shapes: ``x`` ``[T, H]``, weights and ids both ``[T, k]``."""
        t, h = x.shape
        if h != self._hidden_size:
            raise LayoutError(
                f"hidden_states: expected [T, {self._hidden_size}], got {list(x.shape)}"
            )
        _check_routing_shapes(t, w, ids)

    def _forward_checked(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """Any input the native torch path declines: checked (errors name the argument), then
        through numpy."""
        meta = _meta_call(hidden_states, router_logits=router_logits)
        x = _check(hidden_states, "hidden_states", 2, True, meta)
        logits = _check(router_logits, "router_logits", 2, True, meta)
        self._check_shapes(x, logits)
        t = x.shape[0]
        if meta:
            # Through the op (its fake implementation makes the meta output), so that a trace
            # (torch.jit.trace, make_fx) records the op and an input that needs gradients gets
            # its no-backward node, as for CPU inputs.
            _refuse_transforms(x, logits)
            return torch.ops.moeq.moe_forward(x, logits, self._op_handle(x))
        # bf16 input: weight-only layers may use bf16 dot products (moeq_rs.oracle.cpu_bf16_dot).
        out = self._core.forward(_hidden(x), t, _f32(logits))
        return _output(out, x.dtype)

    def _forward_topk_checked(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        meta = _meta_call(hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
        x = _check(hidden_states, "hidden_states", 2, True, meta)
        w = _check(topk_weights, "topk_weights", 2, True, meta)
        ids = _check(topk_ids, "topk_ids", 2, False, meta)
        self._check_topk_shapes(x, w, ids)
        t = x.shape[0]
        if meta:  # as in _forward_checked
            _refuse_transforms(x, w, ids)
            return torch.ops.moeq.moe_forward_topk(x, w, ids, self._op_handle(x))
        k = w.shape[1]
        out = self._core.forward_topk(
            _hidden(x), t, _f32(w), _plain(ids).to(torch.int64).contiguous().numpy(), k
        )
        return _output(out, x.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}"


_SCHEMES = ("w8a8_dynamic", "w8a8_static", "w8a16", "w4a16")


def _np(t: object, name: str, dtypes: tuple[torch.dtype, ...], ndims: tuple[int, ...]):  # type: ignore[no-untyped-def]
    if not isinstance(t, torch.Tensor):
        raise LayoutError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise LayoutError(f"{name}: expected a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        raise LayoutError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() not in ndims:
        raise LayoutError(
            f"{name}: expected {' or '.join(map(str, ndims))} dimensions, got shape {list(t.shape)}"
        )
    if not t.is_contiguous():
        raise LayoutError(f"{name}: expected a contiguous tensor")
    # Read as values: a Parameter's autograd history and a lazily negated view do not matter.
    return t.detach().resolve_neg().resolve_conj()


def _scales(t: object, name: str, e: int, n: int) -> tuple[object, int]:
    s = _np(t, name, _FLOATS, (2, 3))
    if s.dim() == 2:
        s = s.unsqueeze(-1)
    if tuple(s.shape[:2]) != (e, n):
        raise LayoutError(f"{name}: expected [{e}, {n}, groups], got {list(s.shape)}")
    return s.to(torch.float32).contiguous().reshape(-1).numpy(), s.shape[2]


def _act_scales(t: object, name: str, e: int):  # type: ignore[no-untyped-def]
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        try:
            is_bool = np.asarray(t).dtype == np.bool_
            # fp32 whatever torch's default dtype (an fp16 default rounded 0.1 to 0.09998).
            t = torch.tensor(t, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise LayoutError(
                f"{name}: expected a number or a float tensor of one scale per expert, "
                f"got {type(t).__name__} ({err})"
            ) from None
        if is_bool:
            # Converted to float, True would read as a scale of 1.0.
            raise LayoutError(f"{name}: expected a number or a float tensor, got a bool")
    if not t.is_cpu:
        raise LayoutError(f"{name}: expected a CPU tensor, got device {t.device}")
    if not t.dtype.is_floating_point:
        raise LayoutError(f"{name}: expected a real floating-point tensor, got {t.dtype}")
    s = t.detach().resolve_neg().to(torch.float32).reshape(-1)
    if s.numel() == 1:
        s = s.expand(e)
    if s.numel() != e:
        raise LayoutError(
            f"{name}: expected one static scale per expert ([{e}]), got {list(t.shape)}"
        )
    return s.contiguous().numpy()


def _zero_points(t: object, name: str, e: int, n: int, groups: int, int4: bool):  # type: ignore[no-untyped-def]
    if t is None:
        return None, None
    z = _np(t, name, (torch.int8, torch.int32), (3,))
    if z.dtype == torch.int8:
        if tuple(z.shape) != (e, n, groups):
            raise LayoutError(f"{name}: int8 zero points must be [{e}, {n}, {groups}]")
        if int4 and z.numel() and not -8 <= int(z.min()) <= int(z.max()) <= 7:
            # As a checkpoint's are, and as the CUDA layer requires: the same call must not
            # build on one device and fail on the other.
            at = ((z < -8) | (z > 7)).nonzero()[0].tolist()
            raise LayoutError(
                f"{name}: expert {at[0]}, row {at[1]}, group {at[2]} is {int(z[tuple(at)])}; "
                "4-bit zero points lie in -8..7"
            )
        return z.reshape(-1).numpy(), None
    if tuple(z.shape) != (e, (n + 7) // 8, groups):
        raise LayoutError(f"{name}: packed zero points must be [{e}, {(n + 7) // 8}, {groups}]")
    return None, z.reshape(-1).numpy().view("uint32")


def _parse_tensors(
    w13,
    w2,
    w13_scale,
    w2_scale,
    scheme,
    group_size,
    w13_zero_point,  # type: ignore[no-untyped-def]
    w2_zero_point,
    a13_scale,
    a2_scale,
    top_k,
    renormalize,
) -> dict[str, Any]:
    """``from_tensors``' arguments checked (errors name the argument) and read as flat numpy
    arrays, for the CPU layer or the CUDA one."""
    from .errors import UnsupportedSchemeError

    if scheme not in _SCHEMES:
        raise LayoutError(f"scheme: {scheme!r} is not one of {', '.join(_SCHEMES)}")
    int4 = scheme == "w4a16"
    wdt = (torch.int32,) if int4 else (torch.int8,)
    a = _np(w13, "w13", wdt, (3,))
    b = _np(w2, "w2", wdt, (3,))
    e, n13, k13 = a.shape
    h = k13 * 8 if int4 else k13
    if n13 % 2:
        raise LayoutError(
            f"w13: expected [E, 2*I, H] (gate rows, then up rows), got {list(a.shape)}"
        )
    i = n13 // 2
    if int4 and i % 8:
        # w2 packs I along its rows: no [E, H, I/8] exists to ask for.
        raise LayoutError(
            f"w13: int4 packing needs an intermediate size that is a multiple of 8, got "
            f"I = {i} from w13 {list(a.shape)}"
        )
    want = (e, h, i // 8 if int4 else i)
    if tuple(b.shape) != want:
        raise LayoutError(f"w2: expected {list(want)}, got {list(b.shape)}")
    # Before any division by it: 0 or a negative size is an error naming the argument, not a
    # ZeroDivisionError or a negative group count.
    gs = int_in(group_size, -1, I64_MAX)
    if gs is None or (gs != -1 and (gs <= 0 or h % gs or i % gs)):
        raise LayoutError(
            f"group_size: {group_size!r} must be -1 or divide hidden={h} and intermediate={i}"
        )
    group_size = gs
    k = as_int(top_k)
    if k is None or not 1 <= k <= e:
        raise LayoutError(
            f"top_k: {top_k!r} must be an integer between 1 and the number of experts ({e})"
        )
    top_k = k
    if not isinstance(renormalize, (bool, np.bool_)):
        raise LayoutError(f"renormalize: expected True or False, got {renormalize!r}")
    renormalize = bool(renormalize)
    s13, g13 = _scales(w13_scale, "w13_scale", e, n13)
    s2, g2 = _scales(w2_scale, "w2_scale", e, h)
    groups_expected = (1, 1) if group_size == -1 else (h // group_size, i // group_size)
    if (g13, g2) != groups_expected:
        raise LayoutError(
            f"w13_scale/w2_scale: {g13}/{g2} groups do not match group_size "
            f"{group_size} (expected {groups_expected[0]}/{groups_expected[1]})"
        )
    zp13 = _zero_points(w13_zero_point, "w13_zero_point", e, n13, g13, int4)
    zp2 = _zero_points(w2_zero_point, "w2_zero_point", e, h, g2, int4)
    if scheme == "w8a16" and (w13_zero_point is not None or w2_zero_point is not None):
        raise UnsupportedSchemeError("w13_zero_point: asymmetric int8 weights are not supported")
    if scheme.startswith("w8a8") and (w13_zero_point is not None or w2_zero_point is not None):
        raise UnsupportedSchemeError("w13_zero_point: W8A8 needs symmetric int8 weights")
    static = scheme == "w8a8_static"
    if static and (a13_scale is None or a2_scale is None):
        raise LayoutError("a13_scale: w8a8_static needs a13_scale and a2_scale")
    if not static and (a13_scale is not None or a2_scale is not None):
        raise LayoutError(f"a13_scale: static activation scales make no sense with {scheme}")
    return {
        "scheme": scheme,
        "experts": e,
        "hidden": h,
        "intermediate": i,
        "group_size": group_size,
        "groups": (g13, g2),
        "w13": a.reshape(-1).numpy(),
        "w2": b.reshape(-1).numpy(),
        "w13_scale": s13,
        "w2_scale": s2,
        "w13_zero_point": zp13,
        "w2_zero_point": zp2,
        "a13_scale": _act_scales(a13_scale, "a13_scale", e),
        "a2_scale": _act_scales(a2_scale, "a2_scale", e),
        "top_k": top_k,
        "renormalize": renormalize,
    }


def _from_tensors(*args):  # type: ignore[no-untyped-def]
    p = _parse_tensors(*args)
    int4 = p["scheme"] == "w4a16"
    w13_np, w2_np = p["w13"], p["w2"]
    zp13, zp2 = p["w13_zero_point"], p["w2_zero_point"]
    return _core.CpuMoeLayer.from_tensors(
        p["scheme"],
        p["experts"],
        p["hidden"],
        p["intermediate"],
        p["group_size"],
        None if int4 else w13_np,
        w13_np.view("uint32") if int4 else None,
        p["w13_scale"],
        zp13[0],
        zp13[1],
        p["a13_scale"],
        None if int4 else w2_np,
        w2_np.view("uint32") if int4 else None,
        p["w2_scale"],
        zp2[0],
        zp2[1],
        p["a2_scale"],
        p["top_k"],
        p["renormalize"],
    )


def _on_cpu(*args: object) -> tuple[object, ...]:
    """CUDA tensors among ``args`` copied to the CPU (for the checks and the layout work of a
    layer built on CUDA); anything else as it is."""
    return tuple(
        a.detach().cpu() if isinstance(a, torch.Tensor) and a.device.type == "cuda" else a
        for a in args
    )


def _layer_from_tensors(cls, *args) -> MoELayer:  # type: ignore[no-untyped-def]
    adopt_main_thread()  # as in from_checkpoint
    return cls(_from_tensors(*args))


def from_tensors(
    cls,
    w13,
    w2,
    w13_scale,
    w2_scale,
    *,
    scheme: str,
    group_size: int = -1,  # type: ignore[no-untyped-def]
    w13_zero_point=None,
    w2_zero_point=None,
    a13_scale=None,
    a2_scale=None,
    top_k: int,
    renormalize: bool = True,
    device: str | torch.device = "cpu",
) -> MoELayer:
    """A layer from raw stacked tensors. ``scheme``: ``"w8a8_dynamic"``, ``"w8a8_static"``,
    ``"w8a16"`` (int8 ``w13 [E, 2I, H]``, gate rows then up rows, ``w2 [E, H, I]``) or
    ``"w4a16"`` (int32 words as compressed-tensors packs them, ``[E, N, K/8]``); scales
    ``[E, N, groups]`` (``[E, N]`` for channelwise); zero points int8 ``[E, N, groups]`` or packed
    int32 ``[E, N/8, groups]``; static activation scales one per expert. ``forward`` routes with
    softmax top-k (renormalised when ``renormalize``).

    ``device="cuda"`` builds the layer on that GPU (tensors on the CPU or on CUDA):
    W8A8 with per-channel weight scales, or W4A16 / W8A16 converted to the Marlin layout."""
    target = _target_device(device)
    if target.type == "cuda":
        from .cuda_layer import from_tensors_on_cuda

        given = _on_cpu(
            w13, w2, w13_scale, w2_scale, scheme, group_size, w13_zero_point, w2_zero_point,
            a13_scale, a2_scale, top_k, renormalize,
        )  # fmt: skip
        return from_tensors_on_cuda(target, _parse_tensors(*given))
    return _layer_from_tensors(
        cls,
        w13,
        w2,
        w13_scale,
        w2_scale,
        scheme,
        group_size,
        w13_zero_point,
        w2_zero_point,
        a13_scale,
        a2_scale,
        top_k,
        renormalize,
    )


MoELayer.from_tensors = classmethod(from_tensors)  # type: ignore[attr-defined]


def fused_moe(
    hidden_states: torch.Tensor,
    w13,
    w2,
    w13_scale,
    w2_scale,  # type: ignore[no-untyped-def]
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    scheme: str,
    group_size: int = -1,
    w13_zero_point=None,
    w2_zero_point=None,
    a13_scale=None,
    a2_scale=None,
) -> torch.Tensor:
    """Functional form: the weighted sum of the routed experts for raw tensors (the layer is built
    for this call, on the GPU of CUDA ``hidden_states``; build a :class:`MoELayer` once to reuse
    it). With torch tensors (and numbers for the static input scales) it is
    ``torch.ops.moeq.fused_moe`` to ``torch.compile`` (also with ``fullgraph=True``), traces and
    dispatch modes; plain eager calls run the op's implementation directly."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise LayoutError(
            "topk_ids: expected a [tokens, top_k] integer tensor, got "
            + (
                f"shape {list(topk_ids.shape)}"
                if isinstance(topk_ids, torch.Tensor)
                else type(topk_ids).__name__
            )
        )
    # A number for a static input scale crosses as a 0-d float64 CPU tensor (its exact value;
    # on the CPU whatever torch's default device is, as `torch.device("meta")` would route the
    # call to the fake implementation).
    a13, a2 = (
        torch.tensor(float(s), dtype=torch.float64, device="cpu")
        if isinstance(s, (int, float)) and not isinstance(s, bool)
        else s
        for s in (a13_scale, a2_scale)
    )
    optional = (w13_zero_point, w2_zero_point, a13, a2)
    required = (hidden_states, w13, w2, w13_scale, w2_scale, topk_weights)
    if (
        all(isinstance(v, torch.Tensor) for v in required)
        and all(v is None or isinstance(v, torch.Tensor) for v in optional)
        and isinstance(scheme, str)
        and type(group_size) is int
        and abs(group_size) <= I64_MAX
    ):
        tensors = (*required, topk_ids, *(v for v in optional if v is not None))
        if not _is_compiling():
            _refuse_transforms(*tensors)
        if (
            # Weights held as nn.Parameters, as a model holds them, count as plain tensors.
            _eager(*(t.detach() if type(t) is _Parameter else t for t in tensors))
            and not _wants_grad(*tensors)
            and not any(t.is_meta for t in tensors)
        ):
            # Plain eager: what the op runs, without it. torch.library runs a custom op's
            # kernel inside torch._disable_dynamo, which imports torch._dynamo on a process's
            # first call: ~1.5 s before the first result. Meta tensors (shapes only), graphs,
            # traces, modes, other tensor subclasses and inputs that need gradients take the op.
            return _fused_moe_eager(
                hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, scheme,
                group_size, *optional,
            )  # fmt: skip
        return torch.ops.moeq.fused_moe(
            hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, scheme,
            group_size, *optional,
        )  # fmt: skip
    # Anything else (numpy weights, a bad argument) goes the checked way, which names it.
    return _fused_moe_eager(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, scheme,
        group_size, w13_zero_point, w2_zero_point, a13_scale, a2_scale,
    )  # fmt: skip


def _fused_moe_eager(
    hidden_states: Any,
    w13: Any,
    w2: Any,
    w13_scale: Any,
    w2_scale: Any,
    topk_weights: Any,
    topk_ids: torch.Tensor,
    scheme: Any,
    group_size: Any,
    w13_zero_point: Any,
    w2_zero_point: Any,
    a13_scale: Any,
    a2_scale: Any,
) -> torch.Tensor:
    # The layer's own top_k only routes `forward`; `forward_topk` takes any number of slots
    # (repeated experts included), as `MoELayer.forward_topk` does.
    experts = w13.shape[0] if isinstance(w13, torch.Tensor) and w13.dim() == 3 else 1
    # CUDA activations run on their GPU's kernels (the layer built there for this call).
    on_cuda = isinstance(hidden_states, torch.Tensor) and hidden_states.device.type == "cuda"
    layer = MoELayer.from_tensors(  # type: ignore[attr-defined]
        w13,
        w2,
        w13_scale,
        w2_scale,
        scheme=scheme,
        group_size=group_size,
        w13_zero_point=w13_zero_point,
        w2_zero_point=w2_zero_point,
        a13_scale=a13_scale,
        a2_scale=a2_scale,
        top_k=max(1, min(int(topk_ids.shape[1]), experts)),
        device=hidden_states.device if on_cuda else "cpu",
    )
    return layer.forward_topk(hidden_states, topk_weights, topk_ids)


# ---- torch.ops.moeq.* custom ops (with fake implementations for torch.compile) ----------------

# Layers by handle for the custom ops (weak: a layer dropped by its owner is freed). A layer
# holds its handle as a 0-d int64 tensor, not an int: torch.compile specialises a graph on a
# module's int attributes, so each layer recompiled the forward and the ninth hit dynamo's
# recompile limit (a hard error under fullgraph=True, eager from then on otherwise); a tensor is
# a graph input, so layers of one shape share one graph. Handles are random 62-bit numbers,
# never reused in a process: a graph or torch.export program taken to another process (whose
# layers have other handles) finds no layer and says so, rather than running whichever layer
# a counter there had given the same number.
_LAYERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_ISSUE = random.SystemRandom()


def _register(layer: torch.nn.Module) -> torch.Tensor:
    """A handle for the custom ops: any module with ``_forward_eager`` (``MoELayer``, the CUDA
    layer of ``moeq_rs.cuda``)."""
    while True:
        handle = _ISSUE.getrandbits(62)
        if handle and handle not in _LAYERS:
            break
    _LAYERS[handle] = layer
    layer._handle_id = handle  # type: ignore[assignment]
    # On the CPU whatever torch's default device is (a layer built under `torch.device("cuda")`).
    return torch.tensor(handle, dtype=torch.int64, device="cpu")


def _inductor_freezes() -> bool:
    """Whether torch.compile's inductor freezes parameters and buffers into constants."""
    config = sys.modules.get("torch._inductor.config")
    return bool(getattr(config, "freezing", False))


def _copy_layer(layer: Any) -> Any:
    """``copy.copy`` of a layer with a custom-op handle: the copy shares everything (the native
    layer is immutable) but needs a handle of its own, or the custom ops would fail once the
    original is freed."""
    new = layer.__class__.__new__(layer.__class__)
    new.__dict__.update(layer.__dict__)
    new._handle = _register(new)
    return new


def _deepcopy_layer(layer: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy`` likewise; the native layer (``_core``, which cannot be copied) is
    shared, as it is immutable."""
    new = layer.__class__.__new__(layer.__class__)
    memo[id(layer)] = new
    for key, value in layer.__dict__.items():
        if key != "_handle":
            new.__dict__[key] = value if key == "_core" else copy.deepcopy(value, memo)
    new._handle = _register(new)
    return new


def _layer(handle: torch.Tensor) -> Any:
    if not (
        isinstance(handle, torch.Tensor)
        and handle.dim() == 0
        and handle.dtype == torch.int64
        and handle.is_cpu
    ):
        raise LayoutError(
            f"layer: expected a MoE layer's handle (its 0-d int64 CPU tensor `_handle`), got "
            f"{handle!r}"
        )
    number = int(handle)
    layer = _LAYERS.get(number)
    if layer is None:
        raise LayoutError(
            f"layer handle {number}: no live MoE layer of this process has it: the layer was "
            "freed (a torch.ops.moeq call or compiled graph that outlived its layer), or the "
            "graph was made in another process (a saved torch.export program cannot carry a "
            "moeq_rs layer: build the layer and export in the process that runs it)"
        )
    return layer


def _refuse_meta_mix(hidden_states: torch.Tensor, **others: torch.Tensor | None) -> None:
    """In a fake implementation: every argument on the meta device, or none. torch sends a call
    to the fake implementation when any argument is a meta tensor, and with real CPU
    ``hidden_states`` its ``empty_like`` would come back as the (unwritten) result."""
    meta = hidden_states.device.type == "meta"
    for name, t in others.items():
        # (A 0-d CPU tensor is a scalar to torch on any device: fused_moe's number scales.)
        if not isinstance(t, torch.Tensor) or (t.dim() == 0 and t.device.type == "cpu"):
            continue
        if (t.device.type == "meta") != meta:
            raise LayoutError(
                f"{name}: on device {t.device}, but hidden_states is on {hidden_states.device} "
                "(meta tensors only trace shapes: all the tensor arguments on meta, or none)"
            )


@torch.library.custom_op("moeq::moe_forward_topk", mutates_args=())
def _op_forward_topk(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer: torch.Tensor,
) -> torch.Tensor:
    return _layer(layer)._forward_topk_eager(hidden_states, topk_weights, topk_ids)


@_op_forward_topk.register_fake
def _(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    layer: torch.Tensor,
) -> torch.Tensor:
    # (The handle is a CPU tensor whatever the inputs' device.)
    _refuse_meta_mix(hidden_states, topk_weights=topk_weights, topk_ids=topk_ids)
    return torch.empty_like(hidden_states)


@torch.library.custom_op("moeq::moe_forward", mutates_args=())
def _op_forward(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    return _layer(layer)._forward_eager(hidden_states, router_logits)


@_op_forward.register_fake
def _(
    hidden_states: torch.Tensor, router_logits: torch.Tensor, layer: torch.Tensor
) -> torch.Tensor:
    _refuse_meta_mix(hidden_states, router_logits=router_logits)
    return torch.empty_like(hidden_states)


@torch.library.custom_op("moeq::fused_moe", mutates_args=())
def _op_fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scheme: str,
    group_size: int,
    w13_zero_point: torch.Tensor | None,
    w2_zero_point: torch.Tensor | None,
    a13_scale: torch.Tensor | None,
    a2_scale: torch.Tensor | None,
) -> torch.Tensor:
    return _fused_moe_eager(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, scheme,
        group_size, w13_zero_point, w2_zero_point, a13_scale, a2_scale,
    )  # fmt: skip


_FUSED_MOE_ARGS = (
    "w13", "w2", "w13_scale", "w2_scale", "topk_weights", "topk_ids", "scheme", "group_size",
    "w13_zero_point", "w2_zero_point", "a13_scale", "a2_scale",
)  # fmt: skip


@_op_fused_moe.register_fake
def _(hidden_states: torch.Tensor, *rest: Any) -> torch.Tensor:
    args = dict(zip(_FUSED_MOE_ARGS, rest, strict=True))
    _refuse_meta_mix(hidden_states, **args)
    if not _is_compiling():
        # (While torch.compile traces, dynamo would wrap the error as its own; the op checks
        # the same when it runs, as for the layer's ops.)
        _fused_moe_shapes(hidden_states, args)
    # The output is [T, H] in the input's dtype, whatever the weights.
    return torch.empty_like(hidden_states)


def _fused_moe_shapes(x: torch.Tensor, args: dict[str, Any]) -> None:
    """What a fake ``fused_moe`` call can check of the shapes the real one checks (the rest
    needs values): ``x`` ``[T, H]`` with ``w13``'s input size, the weights and ids ``[T, k]``.
    A trace would otherwise record a wrong output shape and fail only when run."""
    w13, w, ids = args["w13"], args["topk_weights"], args["topk_ids"]
    if x.dim() != 2:
        raise LayoutError(f"hidden_states: expected 2 dimensions, got shape {list(x.shape)}")
    _check_routing_shapes(x.shape[0], w, ids)
    if w13.dim() == 3:
        # int4 weights pack 8 inputs per int32.
        h = w13.shape[2] * (8 if args["scheme"] == "w4a16" else 1)
        if x.shape[1] != h:
            raise LayoutError(
                f"hidden_states: expected [T, {h}] (w13's input size), got {list(x.shape)}"
            )


def _check_routing_shapes(t: int, w: torch.Tensor, ids: torch.Tensor) -> None:
    """``topk_weights`` and ``topk_ids`` both ``[t, k]``."""
    if w.dim() != 2 or w.shape != ids.shape or w.shape[0] != t:
        raise LayoutError(
            f"topk_weights {list(w.shape)} and topk_ids {list(ids.shape)} must both be [{t}, k]"
        )


def _wants_grad(*tensors: object) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def _no_backward(ctx: Any, grad: torch.Tensor) -> None:
    raise NotImplementedError(
        "moeq_rs MoE layers are inference-only: the torch.ops.moeq ops (moe_forward[_topk], "
        "fused_moe) have no backward (run them under torch.no_grad() or "
        "torch.inference_mode())"
    )


def _no_context(ctx: Any, inputs: Any, output: Any) -> None:
    pass


# Outputs of inputs that need gradients carry a backward that says there is none, eager or
# compiled alike (rather than torch's generic message, or silently no gradient).
_op_forward.register_autograd(_no_backward, setup_context=_no_context)
_op_forward_topk.register_autograd(_no_backward, setup_context=_no_context)
_op_fused_moe.register_autograd(_no_backward, setup_context=_no_context)
