"""Synthetic compressed-tensors pack-quantized Qwen3-MoE checkpoints (expert tensors + router only)
for shapes the fixtures lack: intermediate padding (I % 64 != 0), H == group_size, channelwise,
asymmetric 4-bit, fp16 scales. Packing follows compressed-tensors pack_to_int32 (sequential along
the last axis; zero points packed along N). `write_synth(root)` writes them under root."""

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_ref import REPO, V  # noqa: E402

BASE_FIXTURE = "qwen3_w4a16_g128_asym"
CASES = {  # name: (H, I, bits, group, symmetric)
    "pad_i96_g32_w4_asym": (256, 96, 4, 32, False),
    "pad_i160_g32_w8_sym": (128, 160, 8, 32, True),
    "pad_i32_g32_w4_sym": (256, 32, 4, 32, True),
    "pad_i96_chan_w8_sym": (128, 96, 8, -1, True),
    "i192_g64_w4_asym": (256, 192, 4, 64, False),
    "h128_g128_i256_w4_sym": (128, 256, 4, 128, True),
    "h128_g128_i128_w8_sym": (128, 128, 8, 128, True),
    "i128_g128_w4_fp16": (256, 128, 4, 128, True),
}


def write_synth(root: Path, fixtures: Path) -> list[Path]:
    """One checkpoint per case under `root`; the config starts from a fixture's."""
    base = json.loads((fixtures / BASE_FIXTURE / "config.json").read_text())
    paths: list[Path] = []
    E, LAYERS = 4, 2
    g = torch.Generator().manual_seed(7)
    for name, (H, I, bits, gs, sym) in CASES.items():
        out = str(root / name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        paths.append(Path(out))
        cfg = dict(base)
        cfg.update(
            hidden_size=H,
            moe_intermediate_size=I,
            num_hidden_layers=LAYERS,
            num_local_experts=E,
            intermediate_size=3 * I,
        )
        sdt = torch.float16 if "fp16" in name else torch.bfloat16
        if sdt == torch.float16:
            cfg["dtype"] = "float16"
        w = {
            "dynamic": False,
            "num_bits": bits,
            "strategy": "group" if gs > 0 else "channel",
            "symmetric": sym,
            "type": "int",
        }
        if gs > 0:
            w["group_size"] = gs
        cfg["quantization_config"] = {
            "config_groups": {
                "group_0": {
                    "format": "pack-quantized",
                    "input_activations": None,
                    "output_activations": None,
                    "targets": ["Linear"],
                    "weights": w,
                }
            },
            "format": "pack-quantized",
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "ignore": [f"model.layers.{l}.mlp.gate" for l in range(LAYERS)] + ["lm_head"],
            "sparsity_config": {},
            "kv_cache_scheme": None,
            "version": "0.20.1",
        }
        T = {}
        for l in range(LAYERS):
            T[f"model.layers.{l}.mlp.gate.weight"] = torch.randn(E, H, generator=g).to(
                torch.bfloat16
            )
            for e in range(E):
                for proj, (N, K) in {
                    "gate_proj": (I, H),
                    "up_proj": (I, H),
                    "down_proj": (H, I),
                }.items():
                    p = f"model.layers.{l}.mlp.experts.{e}.{proj}."
                    G = 1 if gs < 0 else K // gs
                    codes = torch.randint(0, 1 << bits, (N, K), generator=g, dtype=torch.int32)
                    T[p + "weight_packed"] = V["pack_cols"](codes, bits, N, K)
                    T[p + "weight_scale"] = (torch.rand(N, G, generator=g) * 0.01 + 1e-3).to(sdt)
                    T[p + "weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
                    if not sym:
                        zp = torch.randint(0, 1 << bits, (N, G), generator=g, dtype=torch.int32)
                        T[p + "weight_zero_point"] = V["pack_rows"](zp, bits, N, G)
        save_file(T, out + "/model.safetensors", metadata={"format": "pt"})
        json.dump(cfg, open(out + "/config.json", "w"), indent=1)

    return paths


if __name__ == "__main__":
    for p in write_synth(Path(sys.argv[1]), REPO / "tests" / "fixtures" / "out"):
        print("wrote", p)
