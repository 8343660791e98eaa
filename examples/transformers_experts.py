"""moeq's CPU experts inside a Hugging Face transformers model.

transformers (5.x, with compressed-tensors installed) loads a compressed-tensors MoE checkpoint
and dequantises it into fused expert tensors; its MoE blocks route each token and call
`mlp.experts(hidden_states, top_k_index, top_k_weights)`. `MoELayer.forward_topk` has that
meaning (routed experts only, weighted by the router's weights), so a small wrapper puts
moeq's int4/int8 kernels in place of the dequantised experts: transformers keeps its router,
shared experts, attention and generation loop.

    .venv/bin/pip install "transformers>=5" compressed-tensors
    .venv/bin/python examples/transformers_experts.py [MODEL_DIR]

The script first checks transformers' expert tensors against compressed-tensors'
dequantisation (`Checkpoint.dequantize`) and puts the right values in where they differ: with
transformers 5.24 and compressed-tensors 0.20.1 the shipped checkpoint's int8 experts (decoder
layer 2, beside layer 1's int4 ones) load wrong, and W8A8, asymmetric int4 and act-order
checkpoints do not load at all (the script says so and stops). It then prints the greedy
continuation with transformers' experts and with moeq's, and how far the logits are apart
(transformers' experts hold the bf16-rounded dequantised weights, moeq the exact
`(q - z) * s`: ~1e-3 apart).

The swapped model is for inference: moeq's experts keep their weights outside `state_dict()`,
so `save_pretrained` on it would write a checkpoint without experts. Save or repack the source
checkpoint instead (`moeq repack --target cpu` writes the CPU layout).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import moeq_rs as mq

DEFAULT_MODEL = Path(__file__).resolve().parent / "tiny-moe-int4-int8"


class MoeqExperts(torch.nn.Module):
    """A transformers-5 experts module backed by one moeq MoE layer."""

    def __init__(self, layer: mq.MoELayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.layer.forward_topk(hidden_states, top_k_weights, top_k_index)


def use_moeq_experts(model: torch.nn.Module, model_dir: Path) -> list[int]:
    """Swap every MoE block's experts for moeq's; returns the decoder layers swapped."""
    checkpoint = mq.open(model_dir)
    swapped = []
    for info in checkpoint.moe_layers():
        mlp = model.model.layers[info["layer"]].mlp
        if not hasattr(mlp, "experts"):
            raise SystemExit(f"layer {info['layer']}: transformers built no experts module there")
        mlp.experts = MoeqExperts(mq.MoELayer.from_checkpoint(checkpoint, info["layer"]))
        swapped.append(info["layer"])
    return swapped


def expert_names(checkpoint: mq.Checkpoint, prefix: str) -> tuple[str, str, str]:
    """gate, up and down projection names of expert 0 (Mixtral's w1, w3, w2 or the rest's)."""
    names = set(checkpoint.tensor_names())
    for leaves in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        if any(n.startswith(f"{prefix}.experts.0.{leaves[0]}.") for n in names):
            return leaves
    raise SystemExit(f"{prefix}: no gate_proj/w1 expert projections in the checkpoint")


def repair_expert_tensors(model: torch.nn.Module, checkpoint: mq.Checkpoint) -> None:
    """transformers' fused experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) against
    compressed-tensors' dequantisation; wrong values are replaced and reported."""
    for info in checkpoint.moe_layers():
        experts = model.model.layers[info["layer"]].mlp.experts
        gate, up, down = expert_names(checkpoint, info["prefix"])
        base = f"{info['prefix']}.experts"
        worst = 0.0
        with torch.no_grad():
            for e in range(info["num_experts"]):
                w13 = torch.cat(
                    [
                        checkpoint.dequantize(f"{base}.{e}.{gate}"),
                        checkpoint.dequantize(f"{base}.{e}.{up}"),
                    ]
                )
                w2 = checkpoint.dequantize(f"{base}.{e}.{down}")
                for held, right in ((experts.gate_up_proj[e], w13), (experts.down_proj[e], w2)):
                    worst = max(worst, (held - right.to(held.dtype)).abs().max().item())
                    held.copy_(right)
        state = "as compressed-tensors decodes them" if worst == 0 else f"max |error| {worst:.3g}"
        print(f"layer {info['layer']}: transformers' expert tensors {state}")


def main(model_dir: Path) -> int:
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except (RuntimeError, ValueError) as e:
        print(
            f"transformers cannot load {model_dir}: {str(e).splitlines()[0]}\n"
            "(its compressed-tensors loading refuses W8A8, asymmetric int4 and act-order "
            "experts; moeq_rs.MoELayer.from_checkpoint still loads the layers)",
            file=sys.stderr,
        )
        return 2
    repair_expert_tensors(model, mq.open(model_dir))
    prompt = torch.tensor([[1, 17, 42, 99, 7, 256]])
    with torch.inference_mode():
        theirs = model(prompt).logits
        their_tokens = model.generate(prompt, max_new_tokens=12, do_sample=False)

    layers = use_moeq_experts(model, model_dir)
    with torch.inference_mode():
        ours = model(prompt).logits
        our_tokens = model.generate(prompt, max_new_tokens=12, do_sample=False)

    rel = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"moeq experts in decoder layers {layers}")
    print(f"transformers' experts: {their_tokens[0].tolist()}")
    print(f"moeq's experts:        {our_tokens[0].tolist()}")
    print(f"prompt logits rel L2 {rel:.2e}")
    ok = rel < 1e-2
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODEL))
