"""Marlin repacking with vLLM's names and argument order.

numpy in -> numpy out, torch in -> torch out (same device), contiguous or not. Weights are int32
(uint32 accepted); scales and biases keep their dtype, and any 2- or 4-byte dtype is accepted
(bf16 may arrive as its uint16 bit pattern); zero-point codes of any integer dtype pack to int32
words. Byte reference: vLLM main @7cfb97e33791, the "newer main" behaviour of
``../shared/reference/marlin_layout.md``. Shape and dtype problems raise
:class:`moeq_rs.LayoutError` naming the rule (``size_n=200 is not a positive multiple of 64``).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import numpy as np

from . import _core
from ._args import I64_MAX, U32_MAX, U64_MAX, flag_arg, int_in, text_arg
from ._threads import adopt_main_thread
from .errors import LayoutError

_P = ParamSpec("_P")
_R = TypeVar("_R")


# The integer arguments of the primitives and the range each must lie in: the native module
# takes them unsigned or 32-bit, and would answer a negative or huge value with an
# OverflowError naming no argument.
_INT_ARGS = {
    "size_k": (0, I64_MAX),
    "size_n": (0, I64_MAX),
    "num_bits": (0, U32_MAX),
    "group_size": (-I64_MAX - 1, I64_MAX),
}


def _primitive(f: Callable[_P, _R]) -> Callable[_P, _R]:
    """``f`` with its integer arguments checked (a LayoutError naming the argument; numpy and
    torch integer scalars become ints) and with Python's main thread among the CPU forward's
    threads (``moeq_rs._threads``): the repack's parallel loops run on those, not on a pool of
    their own, which would idle afterwards and which a forked child would inherit without its
    threads (and wait on)."""
    signature = inspect.signature(f)

    @functools.wraps(f)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        bound = signature.bind(*args, **kwargs)
        for name, (low, high) in _INT_ARGS.items():
            if name in bound.arguments:
                value = int_in(bound.arguments[name], low, high)
                if value is None:
                    raise LayoutError(
                        f"{name}: {bound.arguments[name]!r} is not an int in {low}..={high}"
                    )
                bound.arguments[name] = value
        adopt_main_thread()
        return f(*bound.args, **bound.kwargs)

    return run


__all__ = [
    "parse_size",
    "repack_checkpoint",
    "gptq_marlin_moe_repack",
    "gptq_marlin_repack",
    "gptq_marlin_unrepack",
    "marlin_moe_permute_scales",
    "marlin_permute_bias",
    "marlin_permute_scales",
    "marlin_unpermute_bias",
    "marlin_unpermute_scales",
    "marlin_zero_points",
    "marlin_zero_points_inverse",
]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _to_numpy(x: Any, name: str) -> tuple[np.ndarray, Callable[..., Any]]:
    """A contiguous numpy view of ``x`` and a function turning a result back into x's kind:
    ``back(out)`` views it as x's dtype (results in x's own dtype cross as raw bits),
    ``back(out, keep=True)`` keeps the result's dtype (results of a fixed dtype)."""
    if _is_torch(x):
        import torch

        t = x.detach()
        device, dtype = t.device, t.dtype
        t = t.cpu().contiguous()
        if dtype == torch.bfloat16:
            t = t.view(torch.int16)
        arr = t.numpy()

        def back(out: np.ndarray, keep: bool = False) -> Any:
            r = torch.from_numpy(out)
            if not keep and r.dtype != dtype:
                r = r.view(dtype)
            return r.to(device)

        return arr, back
    if isinstance(x, np.ndarray):
        arr = np.ascontiguousarray(x)

        def back_np(out: np.ndarray, keep: bool = False) -> np.ndarray:
            return out if keep or out.dtype == arr.dtype else out.view(arr.dtype)

        return arr, back_np
    raise LayoutError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


def _dtype_name(source: Any, arr: np.ndarray) -> str:
    """The dtype to name in a message: the caller's (a bf16 tensor crosses as int16 bits)."""
    return str(source.dtype) if _is_torch(source) else str(arr.dtype)


def _words(arr: np.ndarray, name: str, source: Any = None) -> np.ndarray:
    if arr.dtype not in (np.int32, np.uint32):
        raise LayoutError(
            f"{name}: expected int32 packed words, got dtype {_dtype_name(source, arr)}"
        )
    return arr.reshape(-1).view(np.uint32)


def _perm(perm: Any, name: str = "perm") -> np.ndarray:
    if perm is None:
        return np.zeros(0, dtype=np.uint32)
    arr, _ = _to_numpy(perm, name)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu" or _dtype_name(perm, arr) == "torch.bfloat16":
        raise LayoutError(f"{name}: expected an integer array, got dtype {_dtype_name(perm, arr)}")
    if arr.min() < 0:
        raise LayoutError(f"{name}: holds a negative index")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.uint32)


def _check_ndim(arr: np.ndarray, ndim: int, name: str, shape: str) -> None:
    if arr.ndim != ndim:
        raise LayoutError(f"{name}: expected {shape}, got shape {list(arr.shape)}")


@_primitive
def gptq_marlin_repack(qweight: Any, perm: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """``qweight`` int32 ``[size_k / (32 / num_bits), size_n]`` (GPTQ layout) to the Marlin layout
    int32 ``[size_k / 16, size_n * 16 / (32 / num_bits)]``. ``perm`` is ``[0]`` (no act-order) or
    ``[size_k]`` (row k of the result is row perm[k] of the input)."""
    q, back = _to_numpy(qweight, "qweight")
    _check_ndim(q, 2, "qweight", "[size_k/pack_factor, size_n]")
    out = _core.gptq_marlin_repack(
        _words(q, "qweight", qweight), _perm(perm), size_k, size_n, num_bits
    )
    pf = 32 // num_bits
    return back(out.view(np.int32).reshape(size_k // 16, size_n * 16 // pf))


@_primitive
def gptq_marlin_unrepack(marlin_q: Any, perm: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """The inverse of :func:`gptq_marlin_repack`: the GPTQ ``qweight`` in original row order."""
    q, back = _to_numpy(marlin_q, "marlin_q")
    out = _core.gptq_marlin_unrepack(
        _words(q, "marlin_q", marlin_q), _perm(perm), size_k, size_n, num_bits
    )
    return back(out.view(np.int32).reshape(size_k // (32 // num_bits), size_n))


@_primitive
def gptq_marlin_moe_repack(qweight: Any, perm: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """Per expert :func:`gptq_marlin_repack`: ``[E, K/pf, N]`` to ``[E, K/16, N*16/pf]``; ``perm``
    is ``[E, 0]`` or ``[E, K]``."""
    q, back = _to_numpy(qweight, "qweight")
    _check_ndim(q, 3, "qweight", "[E, size_k/pack_factor, size_n]")
    experts = q.shape[0]
    out = _core.gptq_marlin_moe_repack(
        _words(q, "qweight", qweight), _perm(perm), experts, size_k, size_n, num_bits
    )
    pf = 32 // num_bits
    return back(out.view(np.int32).reshape(experts, size_k // 16, size_n * 16 // pf))


def _permute(
    s: Any, name: str, fn16: Callable[..., np.ndarray], fn32: Callable[..., np.ndarray], *args: Any
) -> Any:
    arr, back = _to_numpy(s, name)
    flat = arr.reshape(-1)
    if arr.dtype.itemsize == 2:
        out = fn16(flat.view(np.uint16), *args)
    elif arr.dtype.itemsize == 4:
        out = fn32(flat.view(np.uint32), *args)
    else:
        raise LayoutError(f"{name}: expected a 2- or 4-byte dtype, got {arr.dtype}")
    return back(out.view(arr.dtype).reshape(arr.shape))


@_primitive
def marlin_permute_scales(s: Any, size_k: int, size_n: int, group_size: int) -> Any:
    """Scales ``[G, N]`` to the Marlin order (same shape and dtype): the grouped table when
    ``group_size != -1 and group_size < size_k``, else the single (channelwise) table."""
    return _permute(
        s,
        "s",
        _core.marlin_permute_scales_u16,
        _core.marlin_permute_scales_u32,
        size_k,
        size_n,
        group_size,
    )


@_primitive
def marlin_unpermute_scales(s: Any, size_k: int, size_n: int, group_size: int) -> Any:
    """The inverse of :func:`marlin_permute_scales`."""
    return _permute(
        s,
        "s",
        _core.marlin_unpermute_scales_u16,
        _core.marlin_unpermute_scales_u32,
        size_k,
        size_n,
        group_size,
    )


@_primitive
def marlin_moe_permute_scales(s: Any, size_k: int, size_n: int, group_size: int) -> Any:
    """Per expert :func:`marlin_permute_scales` on ``[E, G, N]``."""
    arr, _ = _to_numpy(s, "s")
    _check_ndim(arr, 3, "s", "[E, G, size_n]")
    return marlin_permute_scales(s, size_k, size_n, group_size)


@_primitive
def marlin_permute_bias(b: Any) -> Any:
    """vLLM's ``marlin_permute_bias``: the single table on every 32 entries, shape kept."""
    return _permute(
        b,
        "b",
        lambda x: _core.marlin_permute_bias_u16(x),
        lambda x: _core.marlin_permute_bias_u32(x),
    )


@_primitive
def marlin_unpermute_bias(b: Any) -> Any:
    """The inverse of :func:`marlin_permute_bias`."""
    return _permute(
        b,
        "b",
        lambda x: _core.marlin_unpermute_bias_u16(x),
        lambda x: _core.marlin_unpermute_bias_u32(x),
    )


@_primitive
def marlin_zero_points(zp: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """Zero-point codes ``[size_k=G, size_n=N]`` (unsigned, < 2**num_bits) to the Marlin packed
    layout int32 ``[G, N * num_bits / 32]``."""
    arr, back = _to_numpy(zp, "zp")
    if arr.dtype.kind not in "iu" or _dtype_name(zp, arr) == "torch.bfloat16":
        raise LayoutError(f"zp: expected integer codes, got dtype {_dtype_name(zp, arr)}")
    if arr.size and (arr.min() < 0):
        raise LayoutError("zp: codes must be unsigned (0 .. 2**num_bits - 1)")
    codes = np.ascontiguousarray(arr.reshape(-1), dtype=np.uint32)
    out = _core.marlin_zero_points(codes, size_k, size_n, num_bits)
    # int32 words whatever the codes' integer dtype (int64 codes came back as int64 bit
    # patterns of half the width).
    return back(out.view(np.int32).reshape(size_k, size_n * num_bits // 32), keep=True)


@_primitive
def marlin_zero_points_inverse(zp: Any, size_k: int, size_n: int, num_bits: int) -> Any:
    """The inverse of :func:`marlin_zero_points`: int32 codes ``[size_k, size_n]``."""
    arr, back = _to_numpy(zp, "zp")
    out = _core.marlin_zero_points_inverse(_words(arr, "zp", zp), size_k, size_n, num_bits)
    return back(out.view(np.int32).reshape(size_k, size_n))


def parse_size(text: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a plain byte count."""
    bad = LayoutError(f"max shard size: cannot read {text!r} (use e.g. 5GB, 500MB or bytes)")
    huge = LayoutError(f"max shard size: {text!r} is more than 2**64 - 1 bytes (use e.g. 5GB)")
    tiny = LayoutError(f"max shard size: {text!r} is less than one byte (use e.g. 5GB, 500MB)")
    if not isinstance(text, str):
        count = int_in(text, 1, U64_MAX)
        if count is None:
            if isinstance(text, int) and not isinstance(text, bool) and text > U64_MAX:
                raise huge
            raise bad
        return count
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    if unit in units:
        try:
            # An integer count exactly (a float rounds 2**64 - 1 up, out of range).
            whole = int(num) * units[unit]
        except ValueError:
            pass
        else:
            if whole < 1:
                raise tiny
            if whole > U64_MAX:
                raise huge
            return whole
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or math.isnan(value):
        raise bad
    if not value * units[unit] <= U64_MAX:
        raise huge
    if value * units[unit] < 1:
        raise tiny
    return int(value * units[unit])


@_primitive
def repack_checkpoint(
    model_dir: Any,
    out_dir: Any,
    *,
    target: str = "marlin",
    force: bool = False,
    max_shard_size: str | int = "5GB",
    verify: bool = False,
    progress: Callable[[str, int, int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Write ``model_dir`` (a path or an open :class:`moeq_rs.Checkpoint`) repacked for the
    ``target`` layout into ``out_dir``: one MoE layer at a time, through a temporary directory
    beside ``out_dir`` that is renamed at the end (on any error or Ctrl-C nothing is left at
    ``out_dir``). Returns ``{"out_dir", "layers", "tensors", "bytes_written", "seconds",
    "verified_modules", "leftover"}``: ``leftover`` is None, or says what could not be removed
    after the output was committed (an earlier output that ``force`` replaced, moved aside beside
    ``out_dir``), which the caller should report."""

    from .checkpoint import as_checkpoint, path_text

    ckpt = as_checkpoint(model_dir, "model_dir")
    return ckpt._core.repack(
        path_text(out_dir, "out_dir"),
        text_arg(target, "target"),
        flag_arg(force, "force"),
        parse_size(max_shard_size),
        flag_arg(verify, "verify"),
        progress,
    )
