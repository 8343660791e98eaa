"""Small hand-built checkpoints for tests that need control over every byte.

Real-library fixtures come from ``tests/fixtures/generate.py``; these synthetic ones exist so that
each bad-input test can corrupt exactly one thing in an otherwise valid checkpoint.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

HIDDEN = 64
INTER = 32
EXPERTS = 2
GROUP = 32


def pack_int4_rows(q: np.ndarray) -> np.ndarray:
    """Pack signed int4 codes ``[out, in]`` the compressed-tensors way (q + 8, 8 per int32, LSB
    first)."""
    u = (q.astype(np.int64) + 8).astype(np.uint32)
    out, inn = u.shape
    words = np.zeros((out, inn // 8), dtype=np.uint32)
    for j in range(8):
        words |= u[:, j::8] << np.uint32(4 * j)
    return words.view(np.int32)


def quant_config(**overrides: Any) -> dict[str, Any]:
    qc: dict[str, Any] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "group_size": GROUP,
                    "strategy": "group",
                    "dynamic": False,
                },
                "input_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", "model.layers.0.mlp.gate"],
        "version": "0.20.1",
        "quantization_status": "compressed",
    }
    qc.update(overrides)
    return qc


def tensors(
    seed: int = 0, hidden: int = HIDDEN, inter: int = INTER, g_idx: str | None = None
) -> dict[str, torch.Tensor]:
    """``g_idx``: None, "shared" (gate and up get the same act-order g_idx) or "distinct"."""
    rng = np.random.default_rng(seed)
    out: dict[str, torch.Tensor] = {}
    for e in range(EXPERTS):
        for proj, (o, i) in {
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
        }.items():
            m = f"model.layers.0.mlp.experts.{e}.{proj}"
            q = rng.integers(-8, 8, size=(o, i))
            out[f"{m}.weight_packed"] = torch.from_numpy(pack_int4_rows(q))
            scale = rng.uniform(0.001, 0.02, size=(o, i // GROUP)).astype(np.float32)
            out[f"{m}.weight_scale"] = torch.from_numpy(scale).to(torch.bfloat16)
            out[f"{m}.weight_shape"] = torch.tensor([o, i], dtype=torch.int64)
            if g_idx is not None:
                proj_index = ["gate_proj", "up_proj", "down_proj"].index(proj)
                key = 0 if (g_idx == "shared" and proj != "down_proj") else 1 + 3 * e + proj_index
                perm = np.random.default_rng(key).permutation(i)
                gi = np.empty(i, dtype=np.int32)
                gi[perm] = np.arange(i) // GROUP
                out[f"{m}.weight_g_idx"] = torch.from_numpy(gi)
    out["model.layers.0.mlp.gate.weight"] = torch.randn(
        EXPERTS, hidden, generator=torch.Generator().manual_seed(seed)
    ).to(torch.bfloat16)
    return out


def write_checkpoint(
    path: Path,
    *,
    qc: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    replace: dict[str, torch.Tensor] | None = None,
    shards: int = 1,
    hidden: int = HIDDEN,
    inter: int = INTER,
    g_idx: str | None = None,
) -> Path:
    """A valid tiny Qwen3-MoE W4A16 checkpoint (1 layer, 2 experts), optionally altered."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 1,
        "norm_topk_prob": True,
        "num_hidden_layers": 1,
        "quantization_config": qc if qc is not None else quant_config(),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    ts = tensors(hidden=hidden, inter=inter, g_idx=g_idx)
    ts.update(replace or {})
    for name in drop:
        ts.pop(name)
    if shards == 1:
        save_file(ts, str(path / "model.safetensors"))
        return path
    names = sorted(ts)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: ts[n] for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    )
    return path


def read_raw(file: Path) -> tuple[dict[str, Any], bytes]:
    """Header dict and data section of a safetensors file."""
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(file: Path, header: dict[str, Any], data: bytes, *, pad_to: int = 8) -> None:
    """Write a safetensors file from a header dict and data bytes, without any validation."""
    h = json.dumps(header).encode()
    while pad_to and (8 + len(h)) % pad_to:
        h += b" "
    file.write_bytes(struct.pack("<Q", len(h)) + h + data)
