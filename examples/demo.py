"""The main job on the shipped tiny checkpoint: inspect -> repack (Marlin, verified) -> repack
for the CPU (verified) -> CPU MoE forward from the CPU layout on random tokens -> compare with
an fp64 reference from the source's dequantised weights -> tokens/s.

    .venv/bin/python examples/demo.py [MODEL_DIR]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

import moeq_rs as mq
from moeq_rs.repack import repack_checkpoint


def reference(
    ckpt: mq.Checkpoint, layer: dict, x: torch.Tensor, logits: torch.Tensor, moe: mq.MoELayer
) -> torch.Tensor:
    """fp64 MoE from the exact dequantised weights (routing from the model)."""
    r = ckpt.summary()["routing"]
    scores = (
        torch.sigmoid(logits.double())
        if r["scoring_func"] == "sigmoid"
        else torch.softmax(logits.double(), -1)
    )
    bias_name = (layer["router"] or {}).get("e_score_correction_bias")
    choice = scores + (ckpt.tensor(bias_name, "torch").double() if bias_name else 0)
    ids = choice.topk(moe.top_k, -1).indices
    w = scores.gather(1, ids)
    if r["renormalize"]:
        w = w / w.sum(-1, keepdim=True)
    w = w * r["routed_scaling_factor"]

    def mlp(prefix: str, v: torch.Tensor) -> torch.Tensor:
        def lin(name: str, a: torch.Tensor) -> torch.Tensor:
            return a @ ckpt.dequantize(f"{prefix}.{name}", exact=True).double().T

        return lin("down_proj", torch.nn.functional.silu(lin("gate_proj", v)) * lin("up_proj", v))

    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += w[t, j] * mlp(f"{layer['prefix']}.experts.{int(ids[t, j])}", xd[t : t + 1])[0]
    if layer["shared_experts"]:
        out += mlp(layer["shared_experts"]["prefix"], xd)
    return out


def forward_from(cpu_dir: Path, ckpt: mq.Checkpoint) -> float:
    """Runs every MoE layer loaded from the CPU layout against the source's fp64 reference;
    returns the worst relative L2 error."""
    print("\n== CPU forward (layers loaded from the CPU layout) against the fp64 reference")
    print(
        f"kernels: {mq.oracle.cpu_kernel()}, bf16 dot products "
        f"{'on' if mq.oracle.cpu_bf16_dot() else 'off'}, {mq.oracle.cpu_threads()} threads"
    )
    torch.manual_seed(0)
    worst = 0.0
    for layer in ckpt.moe_layers():
        t0 = time.perf_counter()
        moe = mq.MoELayer.from_checkpoint(cpu_dir, layer["layer"])
        load_ms = (time.perf_counter() - t0) * 1e3
        x = torch.randn(16, moe.hidden_size)
        logits = torch.randn(16, moe.num_experts)
        want = reference(ckpt, layer, x, logits, moe)
        err = float((moe(x, logits).double() - want).norm() / want.norm())
        worst = max(worst, err)
        tokens = 256
        xb = torch.randn(tokens, moe.hidden_size, dtype=torch.bfloat16)
        lb = torch.randn(tokens, moe.num_experts)
        moe(xb, lb)
        t0 = time.perf_counter()
        for _ in range(5):
            moe(xb, lb)
        rate = 5 * tokens / (time.perf_counter() - t0)
        print(
            f"layer {layer['layer']}: loaded in {load_ms:.1f} ms; relative L2 error {err:.1e}; "
            f"{rate:,.0f} tokens/s (bf16, {tokens} tokens per call)"
        )
    return worst


def main() -> int:
    model = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else (Path(__file__).resolve().parent / "tiny-moe-int4-int8")
    )
    ckpt = mq.open(model)
    print(f"\n== plan ({len(ckpt.moe_layers())} MoE layers)")
    for layer in mq.plan(ckpt).layers:
        print(
            f"layer {layer['layer']}: {layer['method']} {layer['quant_config']['kind']} "
            f"g{layer['quant_config']['group_size']} -> {layer['backend']}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        r = repack_checkpoint(ckpt, Path(tmp) / "marlin", verify=True)
        print(
            f"\n== repack --target marlin: {r['tensors']} tensors, "
            f"{r['bytes_written'] / 1e6:.1f} MB, verified {r['verified_modules']} expert "
            f"projections bit for bit"
        )
        cpu_dir = Path(tmp) / "cpu"
        r = repack_checkpoint(ckpt, cpu_dir, target="cpu", verify=True)
        print(
            f"\n== repack --target cpu: {r['layers']} MoE layers prepacked, {r['tensors']} "
            f"tensors, {r['bytes_written'] / 1e6:.1f} MB, verified {r['verified_modules']} "
            f"expert projections bit for bit"
        )
        worst = forward_from(cpu_dir, ckpt)
    if worst > 1e-5:
        print(f"FAILED: error {worst:.1e} above 1e-5")
        return 1
    print("\nok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
