"""The main job on the shipped tiny checkpoint: inspect -> repack (Marlin, verified) -> repack
for the CPU (verified) -> CPU MoE forward from the CPU layout on random tokens -> compare with
an fp64 reference from the source's dequantised weights (W8A8: and its activation
quantisation) -> tokens/s. Another MODEL_DIR works too where its experts are named
gate/up/down_proj or w1/w3/w2 (a layer the Marlin layout cannot hold skips that repack).

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

# An expert's (gate, up, down) projections under the naming schemes the demo knows.
NAMINGS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def projections(ckpt: mq.Checkpoint, expert: str) -> tuple[str, str, str]:
    for naming in NAMINGS:
        try:
            for p in naming:
                ckpt.module(f"{expert}.{p}")
        except mq.CheckpointError:
            continue
        return naming
    raise SystemExit(f"{expert}: the demo knows expert projections named {NAMINGS} only")


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
    if r["n_group"] and r["n_group"] > 1:
        # Grouped top-k (DeepSeek-V3): a group scores its best (with a bias: its two best)
        # choices; only the topk_group best groups compete.
        groups = choice.view(choice.shape[0], r["n_group"], -1)
        best = groups.topk(2 if bias_name else 1, -1).values.sum(-1)
        kept = torch.zeros_like(best).scatter_(1, best.topk(r["topk_group"], -1).indices, 1)
        choice = groups.masked_fill(kept[..., None] == 0, float("-inf")).flatten(1)
    ids = choice.topk(moe.top_k, -1).indices
    w = scores.gather(1, ids)
    if r["renormalize"]:
        w = w / w.sum(-1, keepdim=True)
    w = w * r["routed_scaling_factor"]

    # Per expert (routed or shared): its projections' names, weights and schemes, read once.
    seen: dict[str, tuple] = {}

    def expert(prefix: str) -> tuple:
        if prefix not in seen:
            names = projections(ckpt, prefix)
            seen[prefix] = tuple(
                (
                    name,
                    ckpt.dequantize(f"{prefix}.{name}", exact=True).double(),
                    (ckpt.scheme(f"{prefix}.{name}") or {}).get("activation"),
                )
                for name in names
            )
        return seen[prefix]

    def mlp(prefix: str, v: torch.Tensor) -> torch.Tensor:
        gate, up, down = expert(prefix)

        def quantised(name: str, act: dict | None, a: torch.Tensor) -> torch.Tensor:
            """W8A8: `a` as the int8 codes times scale the kernels multiply (DESIGN.md: the
            expert's static input_scale, or max|a| / 127 per row; fp32, round half to even)."""
            if act is None:
                return a
            a32 = a.float()
            if act["dynamic"]:
                s = a32.abs().amax(-1, keepdim=True) / 127
            else:
                s = ckpt.tensor(f"{prefix}.{name}.input_scale", "torch").float()
            q = torch.where(s > 0, a32 / s, 0.0).round().clamp(-128, 127)
            return q.double() * s.double()

        def lin(proj: tuple, a: torch.Tensor) -> torch.Tensor:
            name, w, act = proj
            return quantised(name, act, a) @ w.T

        return lin(down, torch.nn.functional.silu(lin(gate, v)) * lin(up, v))

    out = torch.zeros(x.shape, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += w[t, j] * mlp(f"{layer['prefix']}.experts.{int(ids[t, j])}", xd[t : t + 1])[0]
    if layer["shared_experts"]:
        out += mlp(layer["shared_experts"]["prefix"], xd)
    return out


def tolerance(layer: dict) -> float:
    """The relative L2 error allowed against the reference: fp32 compute on exact weights; with
    W8A8, an intermediate element now and then rounds to the other int8 code (the issue's
    bounds: 2e-3 dynamic, 1e-2 static)."""
    if layer["activation"] is None:
        return 1e-5
    return 2e-3 if layer["activation"]["dynamic"] else 1e-2


def forward_from(cpu_dir: Path, ckpt: mq.Checkpoint) -> float:
    """Runs every MoE layer loaded from the CPU layout against the source's fp64 reference;
    returns the worst relative L2 error, scaled so that each layer's tolerance is 1e-5."""
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
        worst = max(worst, err / tolerance(layer) * 1e-5)
        tokens = 256
        xb = torch.randn(tokens, moe.hidden_size, dtype=torch.bfloat16)
        lb = torch.randn(tokens, moe.num_experts)
        moe(xb, lb)
        t0 = time.perf_counter()
        for _ in range(5):
            moe(xb, lb)
        rate = 5 * tokens / (time.perf_counter() - t0)
        print(
            f"layer {layer['layer']}: loaded in {load_ms:.1f} ms; relative L2 error {err:.1e} "
            f"(bound {tolerance(layer):.0e}); {rate:,.0f} tokens/s (bf16, {tokens} tokens per "
            "call)"
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
        q = layer["quant_config"]
        kind = f"{q['kind']} g{q['group_size']}" if q else "(no single quant config)"
        print(f"layer {layer['layer']}: {layer['method']} {kind} -> {layer['backend']}")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r = repack_checkpoint(ckpt, Path(tmp) / "marlin", verify=True)
        except (mq.UnsupportedSchemeError, mq.LayoutError) as e:
            # A scheme or a shape the Marlin layout cannot hold.
            print(f"\n== repack --target marlin: skipped, {e}")
        else:
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
        print("FAILED: a layer's error is above its bound")
        return 1
    print("\nok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
