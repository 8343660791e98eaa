"""Opening compressed-tensors checkpoints: :func:`open` and :class:`Checkpoint`."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from . import _core
from ._args import I64_MAX, flag_arg, int_in, text_arg
from ._deps import need_torch
from ._threads import adopt_main_thread
from .errors import CheckpointError, ConfigError, LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "open"]

Framework = Literal["numpy", "np", "torch", "pt"]

_TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "U8": "uint8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    # One byte holding two values: the flat packed bytes the numpy side gives.
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}

# dtypes numpy lacks travel as these unsigned bit patterns (numpy side) and are viewed back
# into the real dtype on the torch side.
_BIT_PATTERN = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"}

# The numpy dtype of each dtype the native module returns computed tensors in (dequantized
# weights, Marlin tensors): torch's name where numpy has it, else the bit pattern, as `tensor`
# gives it.
_NUMPY_DTYPES = {
    name: ("uint16" if name == "BF16" else "uint8") if name in _BIT_PATTERN else torch_name
    for name, torch_name in _TORCH_DTYPES.items()
}
# Sub-byte dtypes come as their packed bytes, flat, as `tensor` gives them.
_PACKED = {"F4", "F6_E2M3", "F6_E3M2"}


def _wants_torch(framework: str, what: str) -> bool:
    """Whether ``framework`` asks for torch tensors (torch then must be installed)."""
    if framework in ("numpy", "np"):
        return False
    if framework in ("torch", "pt"):
        need_torch(what)
        return True
    raise ConfigError(f"arguments: framework: {framework!r} is not 'numpy' or 'torch'")


def _array(data: Any, dtype: str, shape: Any) -> np.ndarray:
    """A numpy array over the bytes the native module returned."""
    if dtype in _PACKED:
        return np.frombuffer(data, dtype=np.uint8)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise TypeError(f"dtype {dtype} has no numpy equivalent")
    return np.frombuffer(data, dtype=np_dtype).reshape(shape)


def _tensor(data: Any, dtype: str, shape: Any) -> torch.Tensor:
    """A torch tensor over the bytes the native module returned (empty data gives an empty
    tensor: ``frombuffer`` refuses zero-length buffers)."""
    torch = need_torch("a torch tensor")

    if len(data) == 0:
        return torch.empty(shape, dtype=_torch_dtype(dtype))
    return torch.frombuffer(data, dtype=_torch_dtype(dtype)).reshape(shape)


def _torch_dtype(name: str) -> torch.dtype:
    torch = need_torch("a torch tensor")

    attr = _TORCH_DTYPES.get(name)
    dt = getattr(torch, attr, None) if attr else None
    if dt is None:
        raise TypeError(f"dtype {name} has no torch equivalent in this torch version")
    return dt


class Checkpoint:
    """A validated, memory-mapped compressed-tensors checkpoint directory.

    Create it with :func:`moeq_rs.open` or ``Checkpoint(path)`` (the same). Headers,
    ``config.json``, the quantization config and the tensors of every Linear module were checked
    when it was opened; tensor data stays mapped and is read only when asked for. Tensors
    returned as numpy arrays are read-only views of the mapped files: another process truncating
    a file underneath is outside moeq_rs's control.
    """

    def __init__(self, path: str | os.PathLike[str] | _core.Checkpoint) -> None:
        if isinstance(path, _core.Checkpoint):
            core = path
        else:
            text = path_text(path, "path")
            adopt_main_thread()  # the parallel parsing runs on the CPU forward's threads
            core = _core.Checkpoint.open(text)
        self._core = core
        # Bound directly: listing views of thousands of tensors should cost one call each.
        self.view = core.tensor_buffer  # type: ignore[method-assign]
        self._config: dict[str, Any] | None = None
        self._summary: dict[str, Any] | None = None
        self._routing_warned = False  # see moe.warn_unchecked_family

    @property
    def path(self) -> Path:
        return Path(self._core.path)

    @property
    def config(self) -> dict[str, Any]:
        """``config.json`` as a dict (a copy: editing it changes nothing read later)."""
        return copy.deepcopy(self._parsed_config())

    def _parsed_config(self) -> dict[str, Any]:
        if self._config is None:
            self._config = json.loads(self._core.config_json())
        return self._config

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """``config.json``'s ``quantization_config`` (a copy), or None."""
        qc = self._parsed_config().get("quantization_config")
        return copy.deepcopy(qc) if isinstance(qc, dict) else None

    def summary(self) -> dict[str, Any]:
        """The checkpoint facts of ``moeq inspect --json`` (a copy: editing it changes nothing
        the checkpoint answers later)."""
        return copy.deepcopy(self._facts())

    def _facts(self) -> dict[str, Any]:
        """:meth:`summary`, parsed once and shared by this package's own readers (which do not
        edit it)."""
        if self._summary is None:
            self._summary = json.loads(self._core.summary_json())
        return self._summary

    def moe_layers(self) -> list[dict[str, Any]]:
        """One dict per MoE layer: ``layer``, ``prefix``, ``num_experts``, ``weight``,
        ``activation``, ``format``, sizes, router and shared experts (see ``moeq inspect``);
        copies, as :meth:`summary`'s."""
        return copy.deepcopy(self._facts()["moe_layers"])

    def tensor_names(self) -> list[str]:
        return self._core.tensor_names()

    def tensor_info(self, name: str) -> tuple[str, list[int], Path]:
        """``(dtype, shape, file)`` of a tensor, from the header only."""
        dtype, shape, file = self._core.tensor_info(text_arg(name, "name"))
        return dtype, list(shape), Path(file)

    def view(self, name: str) -> _core.TensorBuffer:  # replaced per instance in __init__
        """A zero-copy, read-only view of a tensor's bytes in the mapped file: ``.dtype``
        (safetensors name), ``.shape``, ``.nbytes``; ``numpy.asarray(view)`` makes an array of it
        without copying (BF16/FP8 as unsigned bit patterns)."""
        return self._core.tensor_buffer(name)

    def views(self) -> dict[str, _core.TensorBuffer]:
        """Every tensor's zero-copy view (see :meth:`view`), by name, in name order."""
        return self._core.tensor_buffers()

    def tensor(self, name: str, framework: Framework = "numpy") -> Any:
        """A tensor by name.

        numpy (default): a read-only zero-copy view of the mapped bytes; BF16 and FP8 arrive as
        their unsigned bit patterns (numpy has no such dtypes), the sub-byte F4 and F6 as their
        packed bytes (a flat uint8 array of ``nbytes``). torch: a tensor of the real dtype (a
        copy, so it is writable; F4 as ``float4_e2m1fn_x2``, one byte per pair, flat), or a
        ``TypeError`` for a dtype this torch lacks (F6).
        """
        as_torch = _wants_torch(framework, "Checkpoint.tensor(framework='torch')")
        buf = self._core.tensor_buffer(text_arg(name, "name"))
        arr = np.asarray(buf)
        if not as_torch:
            return arr
        import torch  # (installed: `_wants_torch` checked)

        t = torch.from_numpy(arr.copy())
        if buf.dtype in _BIT_PATTERN:
            t = t.view(_torch_dtype(buf.dtype))
        return t

    def module(self, module: str) -> dict[str, Any]:
        """Facts of a Linear module: scheme, sizes, which quantization tensors it has."""
        return json.loads(self._core.module_json(text_arg(module, "module")))

    def scheme(self, module: str) -> dict[str, Any] | None:
        """The resolved scheme of a module, or None when it is stored unquantized.

        ``{"group", "format", "weight", "activation"}`` with normalised args (strategy inferred,
        channel ``group_size`` = -1, actorder ``"group"``/``"weight"``/None).
        """
        m = self.module(module)
        if not m["quantized"]:
            return None
        return {k: m[k] for k in ("group", "format", "weight", "activation")}

    def dequantize(self, module: str, exact: bool = False, framework: Framework = "torch") -> Any:
        """The module's weight ``[out_features, in_features]`` in the scale dtype, bit-exact with
        compressed-tensors' own decompression. Unquantized modules come back as stored.

        ``exact=True``: ``(q - zp) * scale`` as float32 without the final rounding to the scale
        dtype (what the CPU kernels compute with). ``framework="numpy"``: a numpy array instead
        of a torch tensor (no torch needed; bf16 as its uint16 bit pattern, as :meth:`tensor`)."""
        as_torch = _wants_torch(framework, "Checkpoint.dequantize (framework='torch')")
        data, dtype, shape = self._core.dequantize(
            text_arg(module, "module"), flag_arg(exact, "exact")
        )
        return _tensor(data, dtype, shape) if as_torch else _array(data, dtype, shape)

    def marlin_layer(
        self, layer: int, framework: Framework = "torch"
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Decoder layer ``layer``'s MoE tensors in the Marlin layout, in memory: exactly what
        ``moeq repack --target marlin`` writes for it (``P.w13_weight_packed``,
        ``P.w13_weight_scale``, ..., with ``P = <prefix>.experts``), and its geometry
        (``experts``, ``hidden``, ``intermediate``, ``intermediate_padded``, ``bits``,
        ``group_size``, ``symmetric``, ``act_order``, ``scale_dtype``, ``prefix``). Raises
        :class:`moeq_rs.UnsupportedSchemeError` for layers whose scheme the Marlin layout cannot
        hold; limits of the kernels (see the plan's ``cuda`` backends) are not checked here. On a
        checkpoint repacked for Marlin: the stored layer, as written; one repacked for the CPU
        raises :class:`moeq_rs.LayoutError` (its layers are not converted back).
        ``framework="numpy"``: numpy arrays instead of torch tensors (bf16 scales as uint16 bit
        patterns)."""
        index = int_in(layer, 0, I64_MAX)
        if index is None:
            raise LayoutError(f"layer: {layer!r} is not a decoder layer index (an int >= 0)")
        as_torch = _wants_torch(framework, "Checkpoint.marlin_layer (framework='torch')")
        geometry, tensors = self._core.marlin_layer(index)
        convert = _tensor if as_torch else _array
        return geometry, {name: convert(data, dtype, shape) for name, dtype, shape, data in tensors}

    def __deepcopy__(self, memo: dict[int, Any]) -> Checkpoint:
        # Read-only (mapped files; every accessor returns copies), so a deep copy may share
        # it, as one shares a str. The native object itself cannot be copied.
        return self

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Pickled as its directory: unpickling (another process, say) opens and checks it
        # again. The native object and its mappings cannot cross a process.
        return (open, (str(self.path),))

    def __repr__(self) -> str:
        layers = self._facts()["moe_layers"]
        return f"<moeq_rs.Checkpoint {str(self.path)!r}: {len(layers)} MoE layers>"


def path_text(path: object, what: str) -> str:
    """``path`` (str, bytes or ``os.PathLike``) as the text the native side reads; anything
    else, or a name that is not UTF-8, is a :class:`moeq_rs.CheckpointError` naming ``what``."""
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        raise CheckpointError(
            f"{what}: expected a path (str, bytes or os.PathLike), got {type(path).__name__}"
        ) from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CheckpointError(
            f"{what}: {text!r} is not valid UTF-8, which moeq_rs needs of paths"
        ) from None
    return text


def as_checkpoint(
    path_or_checkpoint: str | os.PathLike[str] | Checkpoint, what: str = "path_or_checkpoint"
) -> Checkpoint:
    """An open :class:`Checkpoint` as it is, or the directory opened with :func:`open`; a bad
    path is an error naming the argument ``what``."""
    if isinstance(path_or_checkpoint, Checkpoint):
        return path_or_checkpoint
    return _open(path_or_checkpoint, what)


def open(path: str | os.PathLike[str]) -> Checkpoint:  # noqa: A001 - mirrors safetensors/builtins
    """Open and validate a checkpoint directory (``config.json`` + safetensors files).

    Raises a :class:`moeq_rs.MoeqError` subclass naming the file, tensor or key on bad input.
    """
    return _open(path, "path")


def _open(path: object, what: str) -> Checkpoint:
    # Checked here too, so that a bad path's error names the caller's argument.
    return Checkpoint(path_text(path, what))
