"""Benchmark: opening a sharded checkpoint and listing every tensor view.

moeq_rs (`mq.open` + a zero-copy numpy view of every tensor) against safetensors' own
`safe_open` (+ `get_slice` of every tensor) on the same files, interleaved in one process, plus a
check that `moeq inspect` reads headers only: its time must not grow with the tensor data.

    .venv/bin/python bench/open_checkpoint.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import moeq_rs as mq

OUT = Path(__file__).resolve().parent / "out"


def make_checkpoint(
    path: Path, *, layers: int, experts: int, hidden: int, inter: int, shards: int
) -> int:
    """A W4A16 g128 Qwen3-MoE-shaped checkpoint; returns the number of tensors."""
    if (path / ".complete").exists():
        return len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp"
        tensors[f"{p}.gate.weight"] = rng.standard_normal((experts, hidden)).astype(np.float16)
        for e in range(experts):
            for proj, (o, i) in {
                "gate_proj": (inter, hidden),
                "up_proj": (inter, hidden),
                "down_proj": (hidden, inter),
            }.items():
                m = f"{p}.experts.{e}.{proj}"
                tensors[f"{m}.weight_packed"] = rng.integers(
                    -(2**31), 2**31 - 1, size=(o, i // 8), dtype=np.int32
                )
                tensors[f"{m}.weight_scale"] = rng.uniform(0, 0.01, (o, i // 128)).astype(
                    np.float16
                )
                tensors[f"{m}.weight_shape"] = np.array([o, i], dtype=np.int64)
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "group_size": 128, "symmetric": True, "type": "int"},
                }
            },
            "ignore": [f"model.layers.{i}.mlp.gate" for i in range(layers)] + ["lm_head"],
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / ".complete").touch()
    return len(names)


def run_moeq(path: Path) -> int:
    return len(mq.open(path).views())


def run_moeq_by_name(path: Path) -> int:
    ckpt = mq.open(path)
    n = 0
    for name in ckpt.tensor_names():
        ckpt.view(name)
        n += 1
    return n


def run_safetensors(path: Path) -> int:
    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as s:
            for k in s.keys():
                s.get_slice(k)
                n += 1
    return n


def run_cli(cmd: list[str]) -> None:
    subprocess.run(cmd, capture_output=True, check=True)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    small = OUT / "open_8shards_2000"
    n = make_checkpoint(small, layers=4, experts=55, hidden=256, inter=128, shards=8)
    assert run_moeq(small) == run_moeq_by_name(small) == run_safetensors(small) == n
    moeq_t, by_name_t, st_t, ratios, ratios_by_name = [], [], [], [], []
    for _ in range(args.rounds):
        a = timed(run_moeq, small)
        b = timed(run_safetensors, small)
        c = timed(run_moeq_by_name, small)
        moeq_t.append(a)
        st_t.append(b)
        by_name_t.append(c)
        ratios.append(b / a)
        ratios_by_name.append(b / c)
    print(
        f"open (full validation) + list {n} tensor views over 8 shards "
        f"({args.rounds} interleaved rounds, medians):"
    )
    print(f"  moeq_rs  mq.open(d).views()              {statistics.median(moeq_t) * 1e3:7.2f} ms")
    print(
        f"  moeq_rs  mq.open(d).view(n) for each name {statistics.median(by_name_t) * 1e3:7.2f} ms"
    )
    print(f"  safetensors safe_open + get_slice each   {statistics.median(st_t) * 1e3:7.2f} ms")
    print(
        f"  speedup vs safetensors (per-round ratio): views() {statistics.median(ratios):.2f}x, "
        f"view(name) {statistics.median(ratios_by_name):.2f}x (>= 1.0: at least as fast)"
    )

    # inspect must read headers only: same tensor count, ~30x more data.
    big = OUT / "open_8shards_2000_large"
    make_checkpoint(big, layers=4, experts=55, hidden=2048, inter=768, shards=8)
    moeq_cli = [sys.executable, "-m", "moeq_rs", "inspect"]
    sizes = {p: sum(f.stat().st_size for f in p.glob("*.safetensors")) for p in (small, big)}
    t_small, t_big = [], []
    for _ in range(5):
        t_small.append(timed(run_cli, moeq_cli + [str(small)]))
        t_big.append(timed(run_cli, moeq_cli + [str(big)]))
    print("moeq inspect (process wall time, median of 5):")
    print(f"  {sizes[small] / 1e6:8.1f} MB of tensors: {statistics.median(t_small) * 1e3:7.1f} ms")
    print(f"  {sizes[big] / 1e6:8.1f} MB of tensors: {statistics.median(t_big) * 1e3:7.1f} ms")
    print(
        f"  time ratio large/small: {statistics.median(t_big) / statistics.median(t_small):.2f}"
        f" for a data ratio of {sizes[big] / sizes[small]:.0f}"
    )


if __name__ == "__main__":
    main()
