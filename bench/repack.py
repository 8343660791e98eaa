"""Benchmark: Marlin repacking.

1. `gptq_marlin_moe_repack` on a Mixtral-size layer (E=8, H=4096, I=14336; w13 and w2, 4- and
   8-bit) against a plain numpy copy of the same bytes and against a straightforward (vectorised)
   numpy implementation of the same layout (tests/marlin_ref.py, one expert, scaled by E),
   interleaved in one process.
2. End to end: `moeq repack` of a generated multi-GB checkpoint in a child process: MB/s and peak
   RSS against the bound 3 x largest layer + 300 MB.

    .venv/bin/python bench/repack.py [--rounds N] [--layers L] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from moeq_rs import repack as r

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from marlin_ref import repack as numpy_repack  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
E, H, I = 8, 4096, 14336  # noqa: E741 - the usual MoE sizes


def random_words(shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.int32)


def timed(fn, *args) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def primitive(rounds: int) -> None:
    print(
        f"gptq_marlin_moe_repack, Mixtral layer E={E} H={H} I={I} ({rounds} interleaved "
        f"rounds, medians; numpy reference on one expert x {E})"
    )
    print(
        f"{'tensor':8} {'bits':>4} {'MB':>7} {'moeq_rs s':>10} {'copy s':>8} "
        f"{'moeq/copy':>10} {'numpy s':>9} {'numpy/moeq':>11}"
    )
    for bits in (4, 8):
        pf = 32 // bits
        for name, k, n in (("w13", H, 2 * I), ("w2", I, H)):
            q = random_words((E, k // pf, n))
            perm = np.zeros((E, 0), np.int32)
            ours, copy = [], []
            for _ in range(rounds):
                ours.append(timed(r.gptq_marlin_moe_repack, q, perm, k, n, bits))
                copy.append(timed(np.copy, q))
            t_np = timed(numpy_repack, q[0], None, bits) * E
            mo, mc = statistics.median(ours), statistics.median(copy)
            print(
                f"{name:8} {bits:>4} {q.nbytes / 1e6:7.0f} {mo:10.3f} {mc:8.3f} "
                f"{mo / mc:10.2f} {t_np:9.1f} {t_np / mo:11.0f}"
            )
            del q


def write_checkpoint(path: Path, layers: int) -> int:
    """A W4A16 g128 Mixtral-shaped checkpoint (random codes); returns the largest layer's bytes."""
    from safetensors.numpy import save_file

    if (path / ".complete").exists():
        return json.loads((path / ".complete").read_text())["largest_layer"]
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    rng = np.random.default_rng(1)
    weight_map = {}
    largest = 0
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp"
        tensors: dict[str, np.ndarray] = {
            f"{p}.gate.weight": rng.standard_normal((E, H)).astype(np.float16)
        }
        for e in range(E):
            for proj, (o, i) in {
                "gate_proj": (I, H),
                "up_proj": (I, H),
                "down_proj": (H, I),
            }.items():
                m = f"{p}.experts.{e}.{proj}"
                tensors[f"{m}.weight_packed"] = np.frombuffer(
                    rng.bytes(o * i // 2), dtype=np.int32
                ).reshape(o, i // 8)
                tensors[f"{m}.weight_scale"] = rng.uniform(0, 0.01, (o, i // 128)).astype(
                    np.float16
                )
                tensors[f"{m}.weight_shape"] = np.array([o, i], dtype=np.int64)
        largest = max(largest, sum(t.nbytes for t in tensors.values()))
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        save_file(tensors, str(path / fname))
        weight_map.update({n: fname for n in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": H,
                "intermediate_size": I,
                "num_local_experts": E,
                "num_experts_per_tok": 2,
                "num_hidden_layers": layers,
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "format": "pack-quantized",
                    "config_groups": {
                        "group_0": {
                            "targets": ["Linear"],
                            "weights": {
                                "num_bits": 4,
                                "group_size": 128,
                                "symmetric": True,
                                "type": "int",
                            },
                        }
                    },
                    "ignore": [f"model.layers.{i}.mlp.gate" for i in range(layers)] + ["lm_head"],
                },
            }
        )
    )
    (path / ".complete").write_text(json.dumps({"largest_layer": largest}))
    return largest


def end_to_end(layers: int) -> None:
    src = OUT / f"mixtral_w4a16_{layers}layers"
    largest = write_checkpoint(src, layers)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    dst = OUT / "repacked"
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, "-m", "moeq_rs", "repack", str(src), str(dst), "--target", "marlin"]
    # Peak RSS from /usr/bin/time -v: RUSAGE_CHILDREN would count the forked copy of this
    # (large) benchmark process before it execs.
    timer = shutil.which("time") or "/usr/bin/time"
    use_time = Path(timer).exists()
    t0 = time.perf_counter()
    proc = subprocess.run(([timer, "-v"] if use_time else []) + cmd, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    if use_time:
        line = next(x for x in proc.stderr.splitlines() if "Maximum resident set size" in x)
        peak = int(line.split(":")[1]) * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    bound = 3 * largest + 300e6
    print(
        f"\nmoeq repack end to end: {size / 1e9:.2f} GB in {layers} MoE layers "
        f"(largest layer {largest / 1e6:.0f} MB)"
    )
    print(
        f"  {secs:.1f} s wall, {size / 1e6 / secs:.0f} MB/s; peak RSS {peak / 1e6:.0f} MB "
        f"(bound 3 x largest layer + 300 MB = {bound / 1e6:.0f} MB: "
        f"{'within' if peak <= bound else 'EXCEEDED'}; measured with /usr/bin/time -v)"
    )
    print("  " + proc.stdout.strip())
    shutil.rmtree(dst, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    primitive(args.rounds)
    if not args.skip_e2e:
        end_to_end(args.layers)


if __name__ == "__main__":
    main()
