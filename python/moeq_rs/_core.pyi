"""Type stubs for the native module ``moeq_rs._core`` (rust_core/python/src/lib.rs)."""

from collections.abc import Callable
from os import PathLike
from typing import Any, final

import numpy as np
from numpy.typing import NDArray

__version__: str
__all__ = [
    "wna16_scale_kind",
    "int8_moe_quant_kind",
    "marlin_support_reason",
    "cpu_features",
    "cpu_kernel",
    "cpu_bf16_dot",
    "cpu_fixed_point_rows",
    "cpu_amx_calls",
    "cpu_dot_peak",
    "cpu_threads",
    "cpu_adopt_calling_thread",
    "cpu_park_openmp",
    "cpu_parked_regions",
    "cpu_release_scratch",
    "cpu_use_torch_tensors",
    "_cpu_torch_outputs_alive",
    "_cpu_scratch_poisoned",
    "cuda_driver_available",
    "cuda_compile_kernels",
    "cuda_nvrtc_version",
    "_cuda_launch",
    "gptq_marlin_repack",
    "gptq_marlin_unrepack",
    "gptq_marlin_moe_repack",
    "marlin_permute_scales_u16",
    "marlin_permute_scales_u32",
    "marlin_unpermute_scales_u16",
    "marlin_unpermute_scales_u32",
    "marlin_permute_bias_u16",
    "marlin_permute_bias_u32",
    "marlin_unpermute_bias_u16",
    "marlin_unpermute_bias_u32",
    "marlin_zero_points",
    "marlin_zero_points_inverse",
    "CpuMoeLayer",
    "__version__",
    "Checkpoint",
    "TensorBuffer",
]

@final
class TensorBuffer:
    """Read-only view of one tensor inside a mapped file (numpy array interface)."""

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...

@final
class Checkpoint:
    @staticmethod
    def open(path: str | PathLike[str]) -> Checkpoint: ...
    @property
    def path(self) -> str: ...
    def config_json(self) -> str: ...
    def summary_json(self) -> str: ...
    def report_json(
        self,
        platform: str = "cpu",
        sm: int | None = None,
        backend: str | None = None,
        tp_size: int = 1,
        compat: bool = False,
    ) -> str: ...
    def tensor_names(self) -> list[str]: ...
    def tensor_info(self, name: str) -> tuple[str, list[int], str]: ...
    def tensor_buffer(self, name: str) -> TensorBuffer: ...
    def tensor_buffers(self) -> dict[str, TensorBuffer]: ...
    def module_json(self, module: str) -> str: ...
    def dequantize(self, module: str, exact: bool = False) -> tuple[bytearray, str, list[int]]: ...
    def int8_codes(self, name: str) -> tuple[bytearray, list[int]]: ...
    def marlin_layer(
        self, layer: int
    ) -> tuple[dict[str, Any], list[tuple[str, str, list[int], bytearray]]]: ...
    # Writes the checkpoint in a kernel layout ("marlin" or "cpu") and returns what it wrote
    # (out_dir, layers, tensors, ...). `progress(stage, done, total, bytes_written,
    # bytes_total)` is called after each unit of work; an exception it raises aborts the
    # repack and leaves nothing at `out_dir`.
    def repack(
        self,
        out_dir: str | PathLike[str],
        target: str = "marlin",
        force: bool = False,
        max_shard_size: int = 5000000000,
        verify: bool = False,
        progress: Callable[[str, int, int, int, int], object] | None = None,
    ) -> dict[str, Any]: ...

# Marlin repack primitives on flat arrays (python/moeq_rs/repack.py gives them vLLM's shapes).
def gptq_marlin_repack(
    qweight: NDArray[np.uint32], perm: NDArray[np.uint32], size_k: int, size_n: int, num_bits: int
) -> NDArray[np.uint32]: ...
def gptq_marlin_unrepack(
    marlin_q: NDArray[np.uint32], perm: NDArray[np.uint32], size_k: int, size_n: int, num_bits: int
) -> NDArray[np.uint32]: ...
def gptq_marlin_moe_repack(
    qweight: NDArray[np.uint32],
    perm: NDArray[np.uint32],
    experts: int,
    size_k: int,
    size_n: int,
    num_bits: int,
) -> NDArray[np.uint32]: ...
def marlin_permute_scales_u16(
    s: NDArray[np.uint16], size_k: int, size_n: int, group_size: int
) -> NDArray[np.uint16]: ...
def marlin_permute_scales_u32(
    s: NDArray[np.uint32], size_k: int, size_n: int, group_size: int
) -> NDArray[np.uint32]: ...
def marlin_unpermute_scales_u16(
    s: NDArray[np.uint16], size_k: int, size_n: int, group_size: int
) -> NDArray[np.uint16]: ...
def marlin_unpermute_scales_u32(
    s: NDArray[np.uint32], size_k: int, size_n: int, group_size: int
) -> NDArray[np.uint32]: ...
def marlin_permute_bias_u16(b: NDArray[np.uint16]) -> NDArray[np.uint16]: ...
def marlin_permute_bias_u32(b: NDArray[np.uint32]) -> NDArray[np.uint32]: ...
def marlin_unpermute_bias_u16(b: NDArray[np.uint16]) -> NDArray[np.uint16]: ...
def marlin_unpermute_bias_u32(b: NDArray[np.uint32]) -> NDArray[np.uint32]: ...
def marlin_zero_points(
    zp: NDArray[np.uint32], size_k: int, size_n: int, num_bits: int
) -> NDArray[np.uint32]: ...
def marlin_zero_points_inverse(
    zp: NDArray[np.uint32], size_k: int, size_n: int, num_bits: int
) -> NDArray[np.uint32]: ...
def wna16_scale_kind(num_bits: int, group_size: int | None = None) -> str: ...
def int8_moe_quant_kind(
    has_a1_scale: bool, has_a2_scale: bool, per_act_token_quant: bool
) -> str: ...
def marlin_support_reason(
    hidden_size: int,
    intermediate_size_per_partition: int,
    group_size: int | None = None,
    allow_tile_padding: bool = True,
) -> str | None: ...
def cpu_features() -> list[str]: ...
def cpu_kernel() -> str: ...
def cpu_bf16_dot() -> bool: ...
def cpu_fixed_point_rows(bits: int) -> int: ...
def cpu_dot_peak(kind: str, threads: int | None = None) -> tuple[str, float] | None: ...
def cpu_threads() -> int: ...
def cpu_adopt_calling_thread() -> bool: ...
def cpu_park_openmp(on: bool | None = None) -> bool: ...
def cpu_parked_regions() -> int: ...
def cpu_release_scratch() -> int: ...
def cpu_amx_calls() -> int: ...

# Reads torch's DLPack C exchange table from torch.Tensor (once per process); whether the
# CpuMoeLayer.*_torch methods can take torch tensors (False on a torch without the table).
def cpu_use_torch_tensors(tensor_type: type) -> bool: ...

# Output tensors made by the *_torch methods whose buffer torch has not freed yet (for tests).
def _cpu_torch_outputs_alive() -> int: ...

# Whether the CPU forward's reused scratch comes filled with NaN (MOEQ_POISON_SCRATCH=1; tests).
def _cpu_scratch_poisoned() -> bool: ...
def cuda_driver_available() -> bool: ...
def cuda_compile_kernels(arch: str, nvrtc_dirs: list[str]) -> dict[str, dict[str, Any]]: ...
def cuda_nvrtc_version(nvrtc_dirs: list[str]) -> tuple[int, int, str | None]: ...
def _cuda_launch(
    ordinal: int,
    variant: str,
    entry: str,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared_bytes: int,
    stream: int,
    args: list[tuple[str, int | float]],
    nvrtc_dirs: list[str],
) -> None: ...

@final
class CpuMoeLayer:
    @staticmethod
    def from_checkpoint(ckpt: Checkpoint, layer: int) -> CpuMoeLayer: ...
    # Flat arrays: int8 codes (`*_i8`) or int32 words as compressed-tensors packs int4
    # (`*_u32`), f32 scales, zero points in either form, static activation scales.
    @staticmethod
    def from_tensors(
        scheme: str,
        experts: int,
        hidden: int,
        intermediate: int,
        group_size: int,
        w13_i8: NDArray[np.int8] | None,
        w13_u32: NDArray[np.uint32] | None,
        w13_scale: NDArray[np.float32],
        w13_zp_i8: NDArray[np.int8] | None,
        w13_zp_u32: NDArray[np.uint32] | None,
        a13: NDArray[np.float32] | None,
        w2_i8: NDArray[np.int8] | None,
        w2_u32: NDArray[np.uint32] | None,
        w2_scale: NDArray[np.float32],
        w2_zp_i8: NDArray[np.int8] | None,
        w2_zp_u32: NDArray[np.uint32] | None,
        a2: NDArray[np.float32] | None,
        top_k: int,
        renormalize: bool,
    ) -> CpuMoeLayer: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def has_shared_experts(self) -> bool: ...
    # hidden_states: a C-contiguous array (any shape) of tokens * hidden f32 values (f32 out),
    # or of the bits of bf16 values as int16 (bf16 bits out, rounded as torch rounds;
    # computes as for bf16 input). Returns a [tokens, hidden] numpy array.
    def forward(
        self, hidden_states: Any, tokens: int, router_logits: Any, bf16: bool = False
    ) -> Any: ...
    # forward_topk: hidden_states as for forward; topk_weights (f32) and topk_ids (int64)
    # contiguous arrays of tokens * top_k values. Returns a [tokens, hidden] numpy array.
    def forward_topk(
        self,
        hidden_states: Any,
        tokens: int,
        topk_weights: Any,
        topk_ids: Any,
        top_k: int,
        bf16: bool = False,
    ) -> Any: ...
    # forward / forward_topk for plain (exact type) row-major 2-d CPU torch tensors of a float
    # dtype (topk_ids int32 or int64) and the layer's shapes: a [tokens, hidden] tensor of the
    # input's dtype, or None for anything else (the caller's checked path names the problem).
    # eager: None also unless torch is in eager mode (not compiling, tracing or in a forward-AD
    # level), no argument needs gradients and the main thread's adoption is settled.
    def forward_torch(
        self, hidden_states: Any, router_logits: Any, eager: bool = False
    ) -> Any | None: ...
    def forward_topk_torch(
        self, hidden_states: Any, topk_weights: Any, topk_ids: Any, eager: bool = False
    ) -> Any | None: ...
