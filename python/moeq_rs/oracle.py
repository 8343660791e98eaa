"""The config oracle: which method, scale kind, quant config and backend each MoE layer runs.

The decisions are made in Rust (``rust_core/core/src/oracle``); this module gives them
vLLM-shaped Python names so that a vLLM user finds them where they would look.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, Literal

from . import _core
from ._args import I64_MAX, U32_MAX, as_int, int_in

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = [
    "BACKENDS",
    "Int8MoEQuantConfig",
    "Plan",
    "check_moe_marlin_supports_layer",
    "cpu_bf16_dot",
    "cpu_dot_peak",
    "cpu_features",
    "cpu_fixed_point_rows",
    "cpu_kernel",
    "cpu_park_openmp",
    "cpu_release_scratch",
    "cpu_threads",
    "make_int8_moe_quant_config",
    "marlin_support_reason",
    "plan",
    "wna16_scale_kind",
]

BACKENDS = ("cpu_simd", "cuda_marlin_wna16", "cuda_int8_w8a8")


def wna16_scale_kind(num_bits: int, group_size: int | None) -> str:
    """Scale kind of a weight-only MoE scheme: ``int4_static_group32``, ``int4_static_group``,
    ``int4_static_channel``, ``int8_static_group`` or ``int8_static_channel``.

    ``group_size`` -1 or None means channelwise. Unlike vLLM's scale descriptors, group and
    channel scales are distinct kinds, and int8 grouped scales are a kind of their own.
    Raises :class:`moeq_rs.UnsupportedSchemeError` for widths other than 4 and 8.
    """
    from .errors import UnsupportedSchemeError

    bits = int_in(num_bits, 0, U32_MAX)
    if bits is None:
        raise UnsupportedSchemeError(
            f"wna16_scale_kind: num_bits {num_bits!r} is not a weight-only MoE width (4 or 8)"
        )
    group = None if group_size is None else int_in(group_size, -(I64_MAX + 1), I64_MAX)
    if group_size is not None and group is None:
        raise UnsupportedSchemeError(
            f"wna16_scale_kind: group_size {group_size!r} is invalid "
            "(a positive group size, or -1/None for channelwise)"
        )
    return _core.wna16_scale_kind(bits, group)


def marlin_support_reason(
    hidden_size: int,
    intermediate_size_per_partition: int,
    group_size: int | None,
    allow_tile_padding: bool = True,
) -> str | None:
    """Why Marlin cannot run a MoE layer of these sizes, or None when it can."""
    from .errors import LayoutError

    sizes = {
        "hidden_size": hidden_size,
        "intermediate_size_per_partition": intermediate_size_per_partition,
    }
    checked = {}
    for name, value in sizes.items():
        size = int_in(value, 0, I64_MAX)
        if size is None:
            raise LayoutError(f"{name}: {value!r} is not a size (an int >= 0)")
        checked[name] = size
    group = None if group_size is None else int_in(group_size, -(I64_MAX + 1), I64_MAX)
    if group_size is not None and group is None:
        raise LayoutError(f"group_size: {group_size!r} is not a 64-bit int (or None)")
    hidden, intermediate = checked["hidden_size"], checked["intermediate_size_per_partition"]
    return _core.marlin_support_reason(hidden, intermediate, group, allow_tile_padding)


def check_moe_marlin_supports_layer(
    hidden_size: int,
    intermediate_size_per_partition: int,
    group_size: int | None,
    allow_tile_padding: bool = True,
) -> bool:
    """vLLM's ``check_moe_marlin_supports_layer`` rules on plain sizes: group size in
    {-1, 32, 64, 128} (None = -1), ``hidden_size % 128 == 0``, and the intermediate size per
    partition a multiple of the group size (with tile padding) or of ``max(64, group_size)``
    (without, as act-order requires). :func:`marlin_support_reason` says why not."""
    return (
        marlin_support_reason(
            hidden_size, intermediate_size_per_partition, group_size, allow_tile_padding
        )
        is None
    )


def cpu_features() -> list[str]:
    """SIMD features of this CPU that moeq_rs's CPU kernels can use."""
    return _core.cpu_features()


def cpu_kernel() -> str:
    """The CPU kernel family in use: ``"amx_int8"``, ``"avx512_vnni"``, ``"avx512"``,
    ``"avx_vnni"`` (AVX2 with the 256-bit ``vpdpbusd``), ``"avx2"``, ``"neon"`` or
    ``"scalar"`` (the best this CPU runs, capped by the ``MOEQ_CPU_ISA`` environment variable,
    read once per process). ``"amx_int8"``: AVX-512 VNNI,
    with AMX tiles for int8 GEMMs of 5 rows or more; it is chosen only when Linux grants tile
    state and the tiles pass a self-test against the scalar GEMM."""
    return _core.cpu_kernel()


def cpu_bf16_dot() -> bool:
    """Whether weight-only (W8A16, W4A16) layers given bfloat16 activations use bf16 dot
    products here (AVX512-BF16; int4 layers at any rows per expert, int8 from 8), twice the
    fp32 rate. Their numerics:
    activations and the intermediate ``silu(gate) * up`` in bf16, products exact, fp32
    accumulation. ``MOEQ_CPU_BF16=0`` (or ``MOEQ_CPU_ISA`` below ``avx512``) keeps every
    input in fp32 compute."""
    return _core.cpu_bf16_dot()


def cpu_fixed_point_rows(bits: Literal[4, 8]) -> int:
    """Rows per expert up to which weight-only layers given bfloat16 activations, with
    ``bits``-bit codes, take int8 dot products on this CPU (0: never): the inputs in fixed
    point, exact products, the same numerics as the bf16 dot products of
    :func:`cpu_bf16_dot` (activations and intermediate rounded to bf16). AVX-512 VNNI with
    VBMI: int8 codes below 8 rows, 4-bit codes below 8 rows, or at one row where bf16 dot
    products take the rest; AVX2: 4-bit codes at one row. ``MOEQ_CPU_BF16=0`` switches it off
    with the bf16 dot products. A ``bits`` other than 4 or 8 raises ``ValueError``."""
    return _core.cpu_fixed_point_rows(bits)


def cpu_dot_peak(
    kind: Literal["int8", "bf16", "f32"], threads: int | None = None
) -> tuple[str, float] | None:
    """This machine's compute limit for the CPU kernels' products, measured now (~0.1 s):
    ``(instruction, GMAC/s)`` of the instruction the dispatch uses for ``kind`` (``"int8"``:
    W8A8; ``"bf16"``: weight-only layers with bf16 inputs where :func:`cpu_bf16_dot`;
    ``"f32"``: weight-only layers otherwise), issued back to back from registers on
    ``threads`` threads (default :func:`cpu_threads`); on AMX, ``tdpbusd`` on full tiles.
    ``None`` where there is no probe: the scalar and NEON paths. ``bench/moe_cpu.py`` divides a
    layer's rate by it."""
    # `kind` is checked natively (ValueError); negative or non-int counts here, before pyo3's
    # conversion would raise OverflowError or TypeError.
    most = 4 * (os.cpu_count() or 1)
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= most):
        raise ValueError(f"threads: {threads!r} is not a thread count from 1 to {most}")
    return _core.cpu_dot_peak(kind, threads)


def cpu_threads() -> int:
    """Threads the CPU MoE forward runs on: ``MOEQ_NUM_THREADS`` (read once per process; at
    most four per available CPU), else one per available CPU."""
    return _core.cpu_threads()


def cpu_release_scratch() -> int:
    """Frees the CPU forward's spare scratch buffers on all its threads and returns the bytes
    freed. Forwards keep their scratch (up to 8 buffers of up to 256 MiB per thread and element
    type) so that the next prefill does not fault it in again; after a long prompt that can be
    hundreds of MB (about 850 MB for a Qwen3-shape layer at T = 8192). Like
    ``torch.cuda.empty_cache()``: later forwards allocate again as they need. Called from a
    thread other than Python's main one, it frees only the buffers of the pool that serves such
    threads: the main thread's pool is reached from the main thread only. Each calling thread
    also keeps its own buffers (of T x H values), which only a call on that thread,
    or the thread's exit, frees."""
    return _core.cpu_release_scratch()


def cpu_park_openmp(on: bool | None = None) -> bool:
    """Whether a CPU MoE forward called now on this thread parks torch's idle OpenMP threads
    while it runs. They spin for milliseconds after each torch operator, on the CPUs the
    forward's workers need; parked, they sleep until the forward is done. ``on`` turns this on
    or off for later forwards (``MOEQ_PARK_OPENMP=0`` starts with it off). It applies only on
    the main thread once it has joined the forward's threads (when it opened a checkpoint,
    built a layer or ran a forward), with more than one thread, with torch's GNU
    OpenMP runtime, and only to a team that is spinning: one that sleeps is left alone."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"on: expected a bool or None, got {type(on).__name__}")
    return _core.cpu_park_openmp(on)


class Int8MoEQuantConfig:
    """The int8 fused-MoE quant config, with vLLM's ``FusedMoEQuantConfig`` property names."""

    __slots__ = (
        "_kind",
        "_per_act_token",
        "w1_scale",
        "w2_scale",
        "a1_scale",
        "a2_scale",
        "w1_bias",
        "w2_bias",
    )

    def __init__(
        self,
        kind: str,
        per_act_token_quant: bool,
        w1_scale: Any,
        w2_scale: Any,
        a1_scale: Any,
        a2_scale: Any,
        w1_bias: Any,
        w2_bias: Any,
    ) -> None:
        self._kind = kind
        self._per_act_token = per_act_token_quant
        self.w1_scale = w1_scale
        self.w2_scale = w2_scale
        self.a1_scale = a1_scale
        self.a2_scale = a2_scale
        self.w1_bias = w1_bias
        self.w2_bias = w2_bias

    @property
    def kind(self) -> Literal["int8_w8a8", "int8_w8a16"]:
        return self._kind  # type: ignore[return-value]

    @property
    def use_int8_w8a8(self) -> bool:
        return self._kind == "int8_w8a8"

    @property
    def use_int8_w8a16(self) -> bool:
        return self._kind == "int8_w8a16"

    @property
    def use_int4_w4a16(self) -> bool:
        return False

    @property
    def use_fp8_w8a8(self) -> bool:
        return False

    @property
    def per_act_token_quant(self) -> bool:
        """Per-token activation scales (dynamic); also switches Triton to per-channel weights."""
        return self._per_act_token if self.use_int8_w8a8 else False

    @property
    def per_out_ch_quant(self) -> bool:
        return False

    @property
    def block_shape(self) -> None:
        return None

    @property
    def quant_dtype(self) -> Any:
        """Activation quantization dtype, as vLLM's: ``torch.int8`` for W8A8 (the string
        ``"int8"`` where torch is not installed), None for 16-bit activations."""
        return _int8_dtype() if self.use_int8_w8a8 else None

    @property
    def weight_quant_dtype(self) -> Any:
        """Weight dtype: ``torch.int8`` (``"int8"`` without torch) for both kinds."""
        return _int8_dtype()

    @property
    def is_per_act_token(self) -> bool:
        return self.per_act_token_quant

    @property
    def is_per_tensor(self) -> bool:
        """One activation scale per tensor: W8A8 without per-token scales (vLLM's
        ``GroupShape.PER_TENSOR``); 16-bit activations have no activation scale shape."""
        return self.use_int8_w8a8 and not self.per_act_token_quant

    @property
    def is_block_quantized(self) -> bool:
        return False

    # The NVFP4 / MX / W4A8 parts of vLLM's config, which int8 configs leave unset.
    @property
    def a1_gscale(self) -> None:
        return None

    @property
    def a2_gscale(self) -> None:
        return None

    @property
    def g1_alphas(self) -> None:
        return None

    @property
    def g2_alphas(self) -> None:
        return None

    @property
    def w1_precision(self) -> None:
        return None

    @property
    def w2_precision(self) -> None:
        return None

    @property
    def ocp_mx_scheme(self) -> None:
        return None

    @property
    def use_fp8_w8a16(self) -> bool:
        return False

    @property
    def use_nvfp4_w4a16(self) -> bool:
        return False

    @property
    def use_nvfp4_w4a4(self) -> bool:
        return False

    @property
    def use_mxfp4_w4a16(self) -> bool:
        return False

    @property
    def use_mxfp4_w4a4(self) -> bool:
        return False

    @property
    def use_mxfp4_w4a8(self) -> bool:
        return False

    @property
    def static_act_scales(self) -> bool:
        return self.a1_scale is not None

    @property
    def w1_zp(self) -> None:
        return None

    @property
    def w2_zp(self) -> None:
        return None

    @property
    def is_quantized(self) -> bool:
        """Whether activations are quantized, as vLLM defines it (``quant_dtype is not None``):
        True for W8A8, False for W8A16."""
        return self.use_int8_w8a8

    def __repr__(self) -> str:
        return (
            f"Int8MoEQuantConfig(kind={self._kind!r}, per_act_token_quant="
            f"{self.per_act_token_quant}, static_act_scales={self.static_act_scales})"
        )


def _int8_dtype() -> Any:
    """``torch.int8`` where torch is installed (vLLM's dtype objects), else ``"int8"``."""
    try:
        import torch
    except ImportError:
        return "int8"
    return torch.int8


def make_int8_moe_quant_config(
    w1_scale: Any,
    w2_scale: Any,
    a1_scale: Any = None,
    a2_scale: Any = None,
    w1_bias: Any = None,
    w2_bias: Any = None,
    per_act_token_quant: bool = False,
) -> Int8MoEQuantConfig:
    """vLLM's ``make_int8_moe_quant_config`` with the fixed (post-#50833) semantics:

    ========================  ===================  ===============================
    a1_scale, a2_scale        per_act_token_quant  result
    ========================  ===================  ===============================
    None, None                True                 int8_w8a8, dynamic per token
    None, None                False                int8_w8a16
    both set                  any                  int8_w8a8, static
    only one set              any                  ValueError (ConfigError)
    ========================  ===================  ===============================

    The pair check is a real exception, so it also holds under ``python -O``. Scales may be torch
    tensors or numpy arrays and are kept as given; anything else (a string, a list), or a
    ``per_act_token_quant`` that is not a bool, is a :class:`moeq_rs.LayoutError` naming the
    argument: the mode follows from which scales are given, so a stray value must not count as
    one.
    """
    from ._args import flag_arg

    arrays = {"w1_scale": w1_scale, "w2_scale": w2_scale}
    optional = {"a1_scale": a1_scale, "a2_scale": a2_scale, "w1_bias": w1_bias, "w2_bias": w2_bias}
    for name, value in arrays.items():
        _require_array(value, name)
    for name, value in optional.items():
        if value is not None:
            _require_array(value, name, "or None")
    per_token = flag_arg(per_act_token_quant, "per_act_token_quant")
    kind = _core.int8_moe_quant_kind(a1_scale is not None, a2_scale is not None, per_token)
    return Int8MoEQuantConfig(
        kind, per_token, w1_scale, w2_scale, a1_scale, a2_scale, w1_bias, w2_bias
    )


def _require_array(value: object, name: str, alternative: str = "") -> None:
    """:class:`moeq_rs.LayoutError` naming ``name`` unless ``value`` is a torch tensor or a numpy
    array (torch is looked up only when it is already imported: a tensor implies it is)."""
    import numpy as np

    from .errors import LayoutError

    torch = sys.modules.get("torch")
    if isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor)):
        return
    wanted = " ".join(filter(None, ["a torch tensor or a numpy array", alternative]))
    raise LayoutError(f"{name}: expected {wanted}, got {type(value).__name__}")


class Plan(dict):  # type: ignore[type-arg]
    """The oracle's plan for a checkpoint: the same document as ``moeq inspect --json``."""

    @property
    def layers(self) -> list[dict[str, Any]]:
        return list(self["moe_layers"])

    def layer(self, index: int) -> dict[str, Any]:
        """The plan of decoder layer ``index``."""
        if int_in(index, 0, I64_MAX) is None:
            from .errors import ConfigError

            raise ConfigError(f"layer: {index!r} is not a decoder layer index (an int >= 0)")
        for layer in self["moe_layers"]:
            if layer["layer"] == index:
                return layer
        raise KeyError(f"decoder layer {index} is not an MoE layer of this checkpoint")

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self, **kwargs)


def plan(
    path_or_checkpoint: str | os.PathLike[str] | Checkpoint,
    platform: Literal["cpu", "cuda"] = "cpu",
    sm: int | None = None,
    *,
    backend: str | None = None,
    tp_size: int = 1,
    compat: Literal["vllm"] | None = None,
) -> Plan:
    """Plan every MoE layer of a checkpoint for ``platform`` (``"cuda"`` with ``sm`` = major*10
    + minor, default 90). ``backend`` forces one backend (layers it cannot run get an ``error``,
    never a silent fallback); ``compat="vllm"`` adds what vLLM would do per layer."""
    from .checkpoint import as_checkpoint

    ckpt = as_checkpoint(path_or_checkpoint)
    from .errors import ConfigError

    if compat not in (None, "vllm"):
        raise ConfigError(f"arguments: compat: {compat!r} is not 'vllm'")
    # Compute capabilities so far are 1.0 to 12.x; a number outside 10..=199 (7, 1000) is a
    # typo, not a GPU, and planned Marlin for 1000.
    if sm is not None and int_in(sm, 10, 199) is None:
        raise ConfigError(
            f"arguments: sm: {sm!r} is not a compute capability (major*10 + minor, 10 to 199: "
            "90 for sm_90)"
        )
    tp = int_in(tp_size, 1, I64_MAX)
    if tp is None:
        raise ConfigError(f"arguments: tp_size: {tp_size!r} must be an int of at least 1")
    for name, value in (("platform", platform), ("backend", backend)):
        if not (isinstance(value, str) or (name == "backend" and value is None)):
            raise ConfigError(f"arguments: {name}: expected a str, got {type(value).__name__}")
        if isinstance(value, str) and not value.isascii():
            # (Every platform and backend name is ASCII; lone surrogates would not even cross.)
            raise ConfigError(f"arguments: {name}: {value!r} is not a {name} name")
    doc = ckpt._core.report_json(platform, as_int(sm), backend, tp, compat == "vllm")
    return Plan(json.loads(doc))
