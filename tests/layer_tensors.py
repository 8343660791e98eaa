"""A weight-only checkpoint layer's tensors in ``MoELayer.from_tensors``' form, for the tests
and for scripts/gpu_check.py (which puts this directory on its path)."""

from __future__ import annotations

import torch

import moeq_rs as mq


def weight_only_args(ckpt: mq.Checkpoint):  # type: ignore[no-untyped-def]
    """A weight-only checkpoint layer's tensors as from_tensors takes them: w13 = gate rows then
    up rows, int4 as compressed-tensors packs it (int32 [E, N, K/8]) or int8 codes, scales
    [E, N, G], packed zero points [E, N/8, G]."""
    info = ckpt.moe_layers()[0]
    layer, p = info["layer"], info["prefix"]
    names = (
        ("w1", "w3", "w2")
        if p.endswith("block_sparse_moe")
        else ("gate_proj", "up_proj", "down_proj")
    )
    scheme = ckpt.scheme(f"{p}.experts.0.{names[0]}")
    assert scheme is not None
    bits = scheme["weight"]["num_bits"]

    def t(name: str) -> torch.Tensor:
        return ckpt.tensor(name, "torch")

    def codes(name: str) -> torch.Tensor:
        words = t(name)
        if bits == 4:
            return words
        u = (words.view(torch.uint8).reshape(words.shape[0], -1)).to(torch.int16)
        return (u - 128).to(torch.int8)

    w13, w2, s13, s2, z13, z2 = [], [], [], [], [], []
    for e in range(info["num_experts"]):
        gate, up, down = (f"{p}.experts.{e}.{n}" for n in names)
        w13.append(torch.cat([codes(f"{gate}.weight_packed"), codes(f"{up}.weight_packed")]))
        w2.append(codes(f"{down}.weight_packed"))
        s13.append(torch.cat([t(f"{gate}.weight_scale"), t(f"{up}.weight_scale")]))
        s2.append(t(f"{down}.weight_scale"))
        if f"{down}.weight_zero_point" in ckpt.tensor_names():
            z13.append(torch.cat([t(f"{gate}.weight_zero_point"), t(f"{up}.weight_zero_point")]))
            z2.append(t(f"{down}.weight_zero_point"))
    gs = scheme["weight"]["group_size"]
    kwargs = {
        "scheme": "w4a16" if bits == 4 else "w8a16",
        "group_size": gs,
        "top_k": 1,
        "w13_zero_point": torch.stack(z13) if z13 else None,
        "w2_zero_point": torch.stack(z2) if z2 else None,
    }
    return layer, [torch.stack(x).contiguous() for x in (w13, w2, s13, s2)], kwargs
