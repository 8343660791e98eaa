"""Benchmark: loading one Qwen3-30B-A3B-shaped W8A8 MoE layer (H2048 I768 E128, 604 MB of int8
expert weights) from the compressed-tensors checkpoint (packed at load) and from the output of
`moeq repack --target cpu` (prepacked), interleaved, with the page cache warm for both.

    MOEQ_NUM_THREADS=2 .venv/bin/python bench/load_cpu_layout.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import moeq_rs as mq
from moeq_rs.repack import repack_checkpoint

H, INTER, E, K = 2048, 768, 128, 8


def write_source(path: Path) -> None:
    path.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": H,
        "moe_intermediate_size": INTER,
        "num_experts": E,
        "num_experts_per_tok": K,
        "norm_topk_prob": True,
        "num_hidden_layers": 1,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "ignore": ["model.layers.0.mlp.gate", "lm_head"],
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "format": "int-quantized",
                    "weights": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
        },
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.mlp"
    tensors = {f"{p}.gate.weight": torch.randn(E, H, generator=g).to(torch.bfloat16)}
    for e in range(E):
        for proj, (n, k) in (
            ("gate_proj", (INTER, H)),
            ("up_proj", (INTER, H)),
            ("down_proj", (H, INTER)),
        ):
            name = f"{p}.experts.{e}.{proj}"
            tensors[f"{name}.weight"] = torch.randint(
                -127, 128, (n, k), dtype=torch.int8, generator=g
            )
            tensors[f"{name}.weight_scale"] = (torch.rand(n, 1, generator=g) * 1e-3).to(
                torch.bfloat16
            )
    save_file(tensors, str(path / "model.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        src, cpu = Path(tmp) / "src", Path(tmp) / "cpu"
        write_source(src)
        t0 = time.perf_counter()
        r = repack_checkpoint(src, cpu, target="cpu")
        print(
            f"repack --target cpu: {r['bytes_written'] / 1e6:.0f} MB in "
            f"{time.perf_counter() - t0:.2f} s"
        )
        times: dict[str, list[float]] = {"source (packed at load)": [], "cpu layout": []}
        x = torch.randn(4, H)
        logits = torch.randn(4, E)
        outs = {}
        for _ in range(args.rounds):
            for label, d in (("source (packed at load)", src), ("cpu layout", cpu)):
                t0 = time.perf_counter()
                layer = mq.MoELayer.from_checkpoint(d, 0)
                times[label].append(time.perf_counter() - t0)
                outs[label] = layer(x, logits)
                del layer
        assert torch.equal(*outs.values())
        for label, ts in times.items():
            print(f"{label:25} median {statistics.median(ts) * 1e3:8.1f} ms")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
