"""MoELayer on the CPU against an fp64 torch emulation built from each checkpoint's integer codes,
zero points and scales (W8A8: DESIGN.md's activation quantisation, emulated exactly)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from marlin_ref import ct_unpack_rows, ct_unpack_zero_points
from torch.utils._python_dispatch import TorchDispatchMode

import moeq_rs as mq

CASES = [  # (fixture, layer, emulation mode)
    ("qwen3_w4a16_g128_sym", 0, "weight_only"),
    ("qwen3_w4a16_g128_asym", 1, "weight_only"),
    ("qwen3_w8a16_g128", 0, "weight_only"),
    ("qwen3_w8a16_channel", 1, "weight_only"),
    ("qwen3_w4a16_actorder", 0, "weight_only"),
    ("mixtral_w8a16_channel", 1, "weight_only"),
    ("laguna_mixed_int4_int8", 1, "weight_only"),
    ("laguna_mixed_int4_int8", 2, "weight_only"),
    ("qwen3_mixed_per_expert", 0, "weight_only"),
    ("qwen3_unquantized", 0, "weight_only"),
    ("qwen3_w8a8_dynamic", 0, "w8a8"),
    ("deepseek_v3_w8a8_dynamic", 1, "w8a8"),
    ("qwen3_w8a8_static", 1, "w8a8"),
]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


class Emulation:
    """fp64 reference of one MoE layer, from the checkpoint's stored codes and scales."""

    def __init__(self, ckpt: mq.Checkpoint, layer: int, quantize_activations: bool) -> None:
        self.ckpt = ckpt
        self.info = next(x for x in ckpt.moe_layers() if x["layer"] == layer)
        self.quant = quantize_activations
        self.prefix = self.info["prefix"]
        mixtral = self.prefix.endswith("block_sparse_moe")
        self.names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    def linear(self, module: str, x: torch.Tensor) -> torch.Tensor:
        m = self.ckpt.module(module)
        act = m["activation"]
        if act is None or not self.quant:
            return x.double() @ exact_weight(self.ckpt, module).T
        q = self.ckpt.tensor(f"{module}.weight", "torch").double()
        sw = self.ckpt.tensor(f"{module}.weight_scale", "torch").float().double().reshape(-1)
        x32 = x.float()
        if act["dynamic"]:
            s = x32.abs().amax(dim=-1, keepdim=True) / 127.0
        else:
            s = self.ckpt.tensor(f"{module}.input_scale", "torch").float().reshape(1, 1)
            s = s.expand(x32.shape[0], 1)
        qx = torch.where(s > 0, torch.round(x32 / torch.where(s > 0, s, 1)), 0).clamp(-128, 127)
        return (qx.double() @ q.T) * s.double() * sw

    def expert(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (f"{prefix}.{n}" for n in self.names)
        h = torch.nn.functional.silu(self.linear(g, x)) * self.linear(u, x)
        return self.linear(d, h)

    def topk(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                out[t] += (
                    float(weights[t, j])
                    * self.expert(f"{self.prefix}.experts.{e}", x[t : t + 1])[0]
                )
        return out


def exact_weight(ckpt: mq.Checkpoint, module: str) -> torch.Tensor:
    """``(q - zp) * scale`` in fp64 from the stored integer codes (no rounding to the scale
    dtype, unlike compressed-tensors' own dequantisation)."""
    m = ckpt.module(module)
    if not m["quantized"]:
        return ckpt.tensor(m["weight_tensor"], "torch").double()
    w = m["weight"]
    bits, out_f, in_f = w["num_bits"], m["out_features"], m["in_features"]
    scale = ckpt.tensor(f"{module}.weight_scale", "torch").double().reshape(out_f, -1)
    if m["format"] == "pack-quantized":
        q = torch.from_numpy(
            ct_unpack_rows(np.asarray(ckpt.tensor(m["weight_tensor"])), bits, in_f).astype(np.int64)
        ) - (1 << (bits - 1))
    else:
        q = ckpt.tensor(m["weight_tensor"], "torch").to(torch.int64)
    groups = scale.shape[1]
    if m["has_g_idx"]:
        col_group = ckpt.tensor(f"{module}.weight_g_idx", "torch").long()
    else:
        col_group = torch.arange(in_f) // (in_f // groups)
    zp = torch.zeros(out_f, groups, dtype=torch.int64)
    if m["has_zero_point"]:
        zpt = np.asarray(ckpt.tensor(f"{module}.weight_zero_point"))
        zp = torch.from_numpy(ct_unpack_zero_points(zpt, bits, out_f).T.astype(np.int64)) - (
            1 << (bits - 1)
        )
    return (q - zp[:, col_group]).double() * scale[:, col_group]


def random_routing(tokens: int, experts: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("name,layer,mode", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_topk_matches_emulation(
    fixture_path: Callable[[str], Path], name: str, layer: int, mode: str, dtype: torch.dtype
) -> None:
    ckpt = mq.open(fixture_path(name))
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    tokens = 9
    x = torch.randn(tokens, moe.hidden_size).to(dtype)
    w, ids = random_routing(tokens, moe.num_experts, moe.top_k)
    got = moe.forward_topk(x, w, ids.to(torch.int32))
    assert got.dtype == dtype and got.shape == x.shape and torch.isfinite(got).all()
    want = Emulation(ckpt, layer, mode == "w8a8").topk(x.float(), w, ids)
    err = rel_l2(got, want)
    if dtype != torch.float32 or name == "qwen3_w8a8_static":
        limit = 1e-2  # the output rounds to the input's 16-bit dtype
    elif mode == "w8a8":
        limit = 2e-3
    else:
        limit = 1e-5  # fp32 compute on exact weights: far inside the issue's 5e-3
    assert err <= limit, f"{name} layer {layer} {dtype}: relative L2 error {err:.2e} > {limit}"


@pytest.mark.parametrize("name,layer,mode", CASES)
def test_non_finite_inputs_come_out_where_the_emulation_has_them(
    fixture_path: Callable[[str], Path], name: str, layer: int, mode: str
) -> None:
    """A NaN in a token makes its whole output NaN, as in the fp64 emulation, for every
    scheme with fp32 inputs (W8A8 too: NaN must not quantise to a finite code and vanish).
    An infinity is non-finite where the emulation says so (a dynamic scale: ``inf / inf``)
    and clamps to 127 under a static one. The other tokens are untouched."""
    ckpt = mq.open(fixture_path(name))
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    x = torch.randn(6, moe.hidden_size)
    x[1, 3] = float("nan")
    x[4, 0] = float("inf")
    w, ids = random_routing(6, moe.num_experts, moe.top_k)
    got = moe.forward_topk(x, w, ids)
    want = Emulation(ckpt, layer, mode == "w8a8").topk(x, w, ids)
    assert got[1].isnan().all() and want[1].isnan().all()
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), name
    clean = [0, 2, 3, 5] + ([4] if bool(torch.isfinite(want[4]).all()) else [])
    assert len(clean) == (5 if name == "qwen3_w8a8_static" else 4)
    limit = 1e-2 if name == "qwen3_w8a8_static" else 2e-3 if mode == "w8a8" else 1e-5
    assert rel_l2(got[clean], want[clean]) <= limit


@pytest.mark.parametrize(
    "name,layer",
    [("qwen3_w8a16_channel", 0), ("deepseek_v3_w8a8_dynamic", 1), ("laguna_mixed_int4_int8", 1)],
)
def test_a_nan_router_logit_makes_its_token_nan(
    fixture_path: Callable[[str], Path], name: str, layer: int
) -> None:
    """A NaN router logit makes that token's output NaN whatever the routing: softmax spreads
    it to every score, and sigmoid routing (DeepSeek-V3's grouped, biased top-k; Laguna) ranks
    the NaN score first, as ``torch.topk`` does in vLLM's and transformers' routers, so the
    expert is chosen with a NaN weight rather than the NaN silently dropping out (it used to
    rank last there: the token came out finite, as if the logit were -inf). The other tokens
    are untouched."""
    moe = mq.MoELayer.from_checkpoint(fixture_path(name), layer)
    x = torch.randn(4, moe.hidden_size)
    logits = torch.randn(4, moe.num_experts)
    bad = logits.clone()
    bad[2, 3] = float("nan")
    got, clean = moe(x, bad), moe(x, logits)
    assert got[2].isnan().all(), name
    rows = [0, 1, 3]
    # (Weight-only tokens' last bits may move with their experts' row counts in the call: the
    # kernels tile rows differently, so fp32 sums round differently; 1.5e-6 seen in 300 seeds.)
    assert rel_l2(got[rows], clean[rows]) <= 1e-5
    # As -inf the logit is a number: that expert is never chosen and the token stays finite.
    masked = logits.clone()
    masked[2, 3] = float("-inf")
    assert torch.isfinite(moe(x, masked)).all()


def balanced_routing(tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 routing that gives every expert the same number of rows (tokens * 2 / experts)."""
    t = torch.arange(tokens)
    ids = torch.stack([t % experts, (t + 1 + (t // experts) % (experts - 1)) % experts], dim=1)
    assert (ids[:, 0] != ids[:, 1]).all()
    w = torch.rand(tokens, 2) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def median_token_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The median over tokens (rows) of ``|a - b| / |b|``: the typical token's error."""
    d = (a.double() - b.double()).norm(dim=1) / b.double().norm(dim=1)
    return float(d.median())


def emulate_rows(
    emu: Emulation, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, round_h: bool | set[int]
) -> torch.Tensor:
    """Emulation.topk batched per expert; ``round_h`` rounds ``silu(gate) * up`` to bf16 (in
    every expert, or in those of the set)."""
    g, u, d = emu.names
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        p = f"{emu.prefix}.experts.{e}"
        xe = x[tok]
        h = torch.nn.functional.silu(emu.linear(f"{p}.{g}", xe)) * emu.linear(f"{p}.{u}", xe)
        if round_h is True or (isinstance(round_h, set) and e in round_h):
            h = h.to(torch.bfloat16).double()
        out.index_add_(0, tok, w[tok, slot].double()[:, None] * emu.linear(f"{p}.{d}", h))
    return out


@pytest.mark.parametrize(
    "name,layer,rows",
    [
        ("qwen3_w4a16_g128_asym", 0, 24),
        ("qwen3_w8a16_g128", 1, 24),
        ("qwen3_w4a16_actorder", 0, 24),
        ("mixtral_w8a16_channel", 1, 24),
        ("laguna_mixed_int4_int8", 1, 24),
        # int4 codes looked up in registers (1-8 rows per expert).
        ("qwen3_w4a16_g128_asym", 0, 1),
        ("qwen3_w4a16_g128_asym", 0, 4),
        ("qwen3_w4a16_actorder", 0, 2),
        ("qwen3_w4a16_g128_asym", 0, 8),
    ],
)
def test_bf16_inputs_use_bf16_dot_products(
    fixture_path: Callable[[str], Path], name: str, layer: int, rows: int
) -> None:
    """Weight-only layers given bf16 activations with enough rows per expert (8, or any for
    int4) run bf16 dot products where the CPU has them (products exact, fp32 sums, the
    intermediate rounded to bf16), and with few rows the fixed-point int8 dot products where
    the CPU runs them (``cpu_fixed_point_rows``; same numerics): the result agrees with an
    fp64 emulation that rounds the intermediate to bf16 far better than with one that does
    not. Elsewhere, and for the same rows as fp32 input, fp32 compute."""
    ckpt = mq.open(fixture_path(name))
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    tokens = rows * moe.num_experts // 2  # `rows` rows per expert
    x = torch.randn(tokens, moe.hidden_size).to(torch.bfloat16).float()
    w, ids = balanced_routing(tokens, moe.num_experts)

    def native(bf16: bool) -> torch.Tensor:
        out = moe._core.forward_topk(
            x.numpy().reshape(-1),
            tokens,
            w.numpy().reshape(-1),
            ids.numpy().reshape(-1),
            2,
            bf16=bf16,
        )
        return torch.from_numpy(out).reshape(tokens, -1)

    # Which experts take bf16 numerics (their intermediate rounded to bf16) depends on their
    # rows: bf16 dot products (int4 at any rows, int8 from 8) where the CPU has them, and the
    # fixed-point int8 dot products up to `cpu_fixed_point_rows`. (With fewer tokens than
    # experts the routing gives some experts one row and others two.)
    bits = [4] if "w4a16" in name else [8] if "w8a16" in name else [4, 8]

    def bf16_numerics(n: int) -> bool:
        per_bits = {
            n > 0
            and (
                (mq.oracle.cpu_bf16_dot() and (b == 4 or n >= 8))
                or n <= mq.oracle.cpu_fixed_point_rows(b)  # type: ignore[arg-type]
            )
            for b in bits
        }
        assert len(per_bits) == 1, f"{name}: {n} rows would mix the paths"
        return per_bits.pop()

    counts = torch.bincount(ids.reshape(-1), minlength=moe.num_experts).tolist()
    rounding = {e for e, n in enumerate(counts) if bf16_numerics(n)}
    emu = Emulation(ckpt, layer, False)
    exact_h, rounded_h = (emulate_rows(emu, x, w, ids, r) for r in (False, rounding))
    fp32 = native(False)
    assert rel_l2(fp32, exact_h) <= 1e-5
    bf16 = native(True)
    assert torch.isfinite(bf16).all()
    # Tokens routed only to fp32 experts are computed as for fp32 input.
    touched = torch.tensor([any(int(e) in rounding for e in row) for row in ids])
    assert torch.equal(bf16[~touched], fp32[~touched])
    if rounding:
        # Per-token errors, median over the tokens a bf16 expert computes: where fp32 and fp64
        # put an intermediate on different sides of a bf16 rounding boundary (about one element
        # per test), that token moves by ~1e-4; the median is the typical token.
        b, r, ex = bf16[touched], rounded_h[touched], exact_h[touched]
        near, far = median_token_rel(b, r), median_token_rel(b, ex)
        assert near <= 1e-5, f"{name}: {near:.2e} from the bf16-intermediate emulation"
        assert far >= 20 * near, f"{name}: not measurably bf16 ({near:.2e} vs {far:.2e})"
        assert rel_l2(bf16, rounded_h) <= 5e-4
    else:
        assert torch.equal(bf16, fp32)
    # The public API takes this path for bf16 tensors.
    public = moe.forward_topk(x.to(torch.bfloat16), w, ids)
    assert public.dtype == torch.bfloat16
    assert torch.equal(public, bf16.to(torch.bfloat16))


class DequantisedBf16(Emulation):
    """The fp64 emulation on compressed-tensors' dequantised weights: ``(q - zp) * scale``
    in the (bf16) scale dtype, i.e. the exact product rounded once to bf16."""

    def linear(self, module: str, x: torch.Tensor) -> torch.Tensor:
        w = exact_weight(self.ckpt, module).to(torch.bfloat16).double()
        return x.double() @ w.T


@pytest.mark.parametrize(
    "name,layer",
    [
        ("qwen3_w4a16_g128_asym", 0),
        ("qwen3_w8a16_g128", 1),
        ("qwen3_w4a16_actorder", 0),
        ("mixtral_w8a16_channel", 1),
        ("laguna_mixed_int4_int8", 1),
    ],
)
def test_bf16_inputs_from_32_rows_use_the_dequantised_bf16_weights(
    fixture_path: Callable[[str], Path], name: str, layer: int
) -> None:
    """From 32 rows per expert, weight-only layers with bf16 scales (every fixture's) and bf16
    activations widen their codes into compressed-tensors' own dequantised bf16 weights and
    skip the per-group epilogue: the result agrees with an fp64 emulation on those weights
    (intermediate rounded to bf16) far better than with the exact ``(q - zp) * scale``, and
    stays within the issue's 1e-2 of the exact emulation."""
    ckpt = mq.open(fixture_path(name))
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    rows = 40
    tokens = rows * moe.num_experts // 2
    x = torch.randn(tokens, moe.hidden_size).to(torch.bfloat16)
    w, ids = balanced_routing(tokens, moe.num_experts)
    got = moe.forward_topk(x, w, ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    exact = emulate_rows(Emulation(ckpt, layer, False), x.float(), w, ids, True)
    dequant = emulate_rows(DequantisedBf16(ckpt, layer, False), x.float(), w, ids, True)
    assert rel_l2(got, exact) <= 1e-2
    if not mq.oracle.cpu_bf16_dot():
        pytest.skip("checked above; what follows is the bf16 dot-product path, not on this CPU")
    # Native output before its bf16 rounding, to see the weights' roundings.
    raw = moe._core.forward_topk(
        x.float().numpy().reshape(-1),
        tokens,
        w.numpy().reshape(-1),
        ids.numpy().reshape(-1),
        2,
        bf16=True,
    )
    raw_t = torch.from_numpy(raw).reshape(tokens, -1)
    near, far = median_token_rel(raw_t, dequant), median_token_rel(raw_t, exact)
    assert near <= 1e-5, f"{name}: {near:.2e} from the dequantised-weight emulation"
    assert far >= 20 * near, f"{name}: weights not measurably bf16 ({near:.2e} vs {far:.2e})"
    assert torch.equal(got, raw_t.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["qwen3_w8a8_dynamic", "qwen3_w4a16_g128_asym"])
def test_bf16_forward_equals_f32_forward_rounded(
    fixture_path: Callable[[str], Path], name: str
) -> None:
    """bf16 tensors reach the native forward as their raw bits and come back as bf16 bits:
    the same values as the f32 route (computing as for bf16) rounded by torch, bit for bit."""
    moe = mq.MoELayer.from_checkpoint(fixture_path(name), 0)
    for tokens in (1, 5, 40):
        x = torch.randn(tokens, moe.hidden_size).to(torch.bfloat16)
        logits = torch.randn(tokens, moe.num_experts)
        via_f32 = moe._core.forward(
            x.float().numpy().reshape(-1), tokens, logits.numpy().reshape(-1), bf16=True
        )
        want = torch.from_numpy(via_f32).reshape(tokens, -1).to(torch.bfloat16)
        got = moe(x, logits)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert torch.isfinite(got.float()).all() and got.float().abs().max() > 0
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_dot_products_can_be_switched_off() -> None:
    import os
    import subprocess
    import sys

    script = "import moeq_rs as mq; print(mq.oracle.cpu_bf16_dot())"
    env = dict(os.environ, MOEQ_CPU_BF16="0")
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "False"


_OFFSET_SCRIPT = """
import json, math, sys, torch, moeq_rs as mq
torch.manual_seed(int(sys.argv[1]))
e_count, h, i, group, t = 4, 512, 32, 32, 64
q13, q2 = torch.randint(-8, 8, (e_count, 2 * i, h)), torch.randint(-8, 8, (e_count, h, i))
def pack(q):
    u = (q + 8).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    w = sum(u[..., j] << (4 * j) for j in range(8))
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).contiguous()
s13 = ((torch.rand(e_count, 2 * i, h // group) * .5 + .75) / (4.6 * math.sqrt(h))).bfloat16()
s2 = ((torch.rand(e_count, h, i // group) * .5 + .75) / (4.6 * math.sqrt(i))).bfloat16()
layer = mq.MoELayer.from_tensors(pack(q13), pack(q2), s13, s2, scheme="w4a16",
                                 group_size=group, top_k=1)
x = (torch.randn(t, h) + 8).bfloat16()
c13, c2 = torch.arange(h) // group, torch.arange(i) // group
errors = []
for e in range(e_count):
    w13 = q13[e].double() * s13[e].double()[:, c13]
    w2 = q2[e].double() * s2[e].double()[:, c2]
    gu = x.double() @ w13.T
    want = (torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]) @ w2.T
    got = layer.forward_topk(x, torch.ones(t, 1), torch.full((t, 1), e)).double()
    errors.append(float((got - want).norm() / want.norm()))
print(json.dumps([mq.oracle.cpu_bf16_dot(), max(errors)]))
"""


def test_bf16_exact_keeps_the_exact_weights_for_activations_with_an_offset() -> None:
    """bf16 activations sharing a large offset (``randn + 8``) make gate and up large, and
    SiLU's flat negative side turns the bf16-rounded dequantised weights' small absolute
    error (used from 32 rows per expert) into 1-6e-2 relative L2 against the fp64 emulation,
    beyond the issue's 1e-2 (found by a review's fuzzing). ``MOEQ_CPU_BF16=exact`` keeps the
    bf16 dot products on the exact weights: ~2.5e-3, the intermediate's bf16 rounding."""
    import os
    import subprocess
    import sys

    seed = str(random.randrange(2**31))

    def run(mode: str) -> tuple[bool, float]:
        ran = subprocess.run(
            [sys.executable, "-c", _OFFSET_SCRIPT, seed],
            env=dict(os.environ, MOEQ_CPU_BF16=mode),
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        dot, err = json.loads(ran.stdout)
        return bool(dot), float(err)

    dot, exact = run("exact")
    assert exact <= 5e-3, f"seed {seed}: {exact:.2e}"
    if not dot:
        pytest.skip("checked above; the rounded-weight path needs bf16 dot products")
    _, rounded = run("")
    assert rounded > 2 * exact, f"seed {seed}: {rounded:.2e} vs {exact:.2e}"


_PEAK_SCRIPT = """
import json, moeq_rs as mq
print(json.dumps([mq.oracle.cpu_kernel(), mq.oracle.cpu_bf16_dot()]
                 + [mq.oracle.cpu_dot_peak(k, 1) for k in ("int8", "bf16", "f32")]))
"""


@pytest.mark.parametrize("cap", ["", "scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni"])
def test_dot_peak_probes_the_instruction_the_dispatch_uses(cap: str) -> None:
    """cpu_dot_peak names the instruction of the kernel family in use (``MOEQ_CPU_ISA`` caps
    both), measures a rate no core could exceed, and has no probe for the scalar path."""
    import os
    import subprocess
    import sys

    ran = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT],
        env=dict(os.environ, MOEQ_CPU_ISA=cap),
        capture_output=True,
        text=True,
        check=True,
    )
    kernel, bf16, *peaks = json.loads(ran.stdout)
    int8, bf16_peak, f32 = peaks
    want_int8 = {
        "avx512_vnni": "vpdpbusd zmm",
        "avx_vnni": "vpdpbusd ymm (AVX-VNNI)",
        "avx2": "vpmaddwd + vpaddd ymm",
        "avx512": "vpmaddwd + vpaddd ymm",
        "amx_int8": "tdpbusd (AMX tiles)",
    }.get(kernel)
    assert (int8 and int8[0]) == want_int8, (kernel, int8)
    assert (bf16_peak is not None) == bf16
    if kernel in ("scalar", "neon"):
        assert peaks == [None, None, None]
    per_issue = {
        "vpdpbusd zmm": 64,
        "vpdpbusd ymm (AVX-VNNI)": 32,
        "vpmaddwd + vpaddd ymm": 16,
        "vdpbf16ps zmm": 32,
        "vfmadd zmm": 16,
        "vfmadd ymm": 8,
        # 16 x 16 x 64 multiply-adds per tdpbusd, at most one every 16 cycles: 1024 a cycle,
        # the bound below's 4 issues of 256.
        "tdpbusd (AMX tiles)": 256,
        # 16 x 16 x 32 per tdpbf16ps, one every 16 cycles: 512 a cycle.
        "tdpbf16ps (AMX tiles)": 128,
    }
    for name_rate in (int8, bf16_peak, f32):
        if name_rate is not None:
            # One thread: at most 4 issues per cycle at 5 GHz of the instruction measured (a
            # loop whose multiplies the compiler hoisted out reported ~3x that).
            name, rate = name_rate
            assert 0.5 < rate < per_issue[name] * 4 * 5, name_rate
    with pytest.raises(ValueError, match="kind"):
        mq.oracle.cpu_dot_peak("int4")  # type: ignore[arg-type]
    for bad in (0, -1, 10**6):
        with pytest.raises(ValueError, match="threads"):
            mq.oracle.cpu_dot_peak("f32", bad)


def test_cpu_fixed_point_rows_takes_4_or_8() -> None:
    for b in (4, 8):
        rows = mq.oracle.cpu_fixed_point_rows(b)  # type: ignore[arg-type]
        assert isinstance(rows, int) and 0 <= rows <= 8, (b, rows)
    for bad in (0, 2, -4, 16, 2**70, -(2**70)):
        with pytest.raises(ValueError, match="bits must be 4 or 8"):
            mq.oracle.cpu_fixed_point_rows(bad)  # type: ignore[arg-type]


def test_dynamic_w8a8_is_measurably_w8a8(fixture_path: Callable[[str], Path]) -> None:
    ckpt = mq.open(fixture_path("qwen3_w8a8_dynamic"))
    moe = mq.MoELayer.from_checkpoint(ckpt, 0)
    x = torch.randn(16, moe.hidden_size)
    w, ids = random_routing(16, moe.num_experts, moe.top_k)
    got = moe.forward_topk(x, w, ids)
    w8a8 = Emulation(ckpt, 0, True).topk(x, w, ids)
    w8a16 = Emulation(ckpt, 0, False).topk(x, w, ids)
    near, far = rel_l2(got, w8a8), rel_l2(got, w8a16)
    assert near < far / 5, f"error vs W8A8 emulation {near:.2e}, vs no activation quant {far:.2e}"


def torch_route(
    cfg: dict, routing: dict, logits: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing written from the model definitions (transformers' Qwen3-MoE / DeepSeek-V2 /
    DeepSeek-V3) and vLLM's ``grouped_topk``: with expert groups, only the ``topk_group`` best
    groups compete, a group scored by its two best biased scores when there is a bias, else
    by its best score."""
    k = routing["top_k"]
    logits = logits.double()
    if routing["scoring_func"] == "softmax":
        scores = torch.softmax(logits, -1)
    else:
        scores = torch.sigmoid(logits)
    choice = scores + (bias.double() if bias is not None else 0)
    if routing["n_group"]:
        g = routing["n_group"]
        e = logits.shape[-1]
        grouped = choice.view(-1, g, e // g)
        if bias is not None:
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = grouped.max(dim=-1).values
        keep = gscore.topk(routing["topk_group"], dim=-1).indices
        mask = torch.zeros_like(gscore).scatter_(1, keep, 1).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(e // g, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    if routing["renormalize"]:
        w = w / w.sum(-1, keepdim=True)
    return w * routing["routed_scaling_factor"], ids


# Each fixture's routing as its model's router computes it, written from the model definitions
# and the fixture's config.json rather than read back from moeq's summary: (scoring,
# renormalise, expert groups, routed scaling, top_k). Qwen3-MoE: softmax, `norm_topk_prob`
# (true in the fixture). DeepSeek-V3: sigmoid, renormalised, n_group 2 / topk_group 1 and
# scaling 2.5 from the config. Laguna: sigmoid, renormalised, `moe_routed_scaling_factor` 2.5.
# Mixtral: softmax, always renormalised.
ROUTING_OF_FIXTURE = {
    "qwen3_w4a16_g128_sym": ("softmax", True, None, 1.0, 2),
    "deepseek_v3_w8a8_dynamic": ("sigmoid", True, (2, 1), 2.5, 2),
    "laguna_mixed_int4_int8": ("sigmoid", True, None, 2.5, 2),
    "mixtral_w8a16_channel": ("softmax", True, None, 1.0, 2),
}


def _expected_routing(name: str) -> dict:
    scoring, renormalize, groups, scale, top_k = ROUTING_OF_FIXTURE[name]
    n_group, topk_group = groups or (None, None)
    return {
        "scoring_func": scoring,
        "renormalize": renormalize,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": scale,
        "top_k": top_k,
    }


@pytest.mark.parametrize(
    "name,layer,mode",
    [
        ("qwen3_w4a16_g128_sym", 1, "weight_only"),
        ("deepseek_v3_w8a8_dynamic", 2, "w8a8"),
        ("laguna_mixed_int4_int8", 2, "weight_only"),
        ("mixtral_w8a16_channel", 0, "weight_only"),
    ],
)
def test_forward_routes_and_adds_shared_experts(
    fixture_path: Callable[[str], Path], name: str, layer: int, mode: str
) -> None:
    path = fixture_path(name)
    ckpt = mq.open(path)
    cfg = json.loads((path / "config.json").read_text())
    routing = _expected_routing(name)
    summary = ckpt.summary()["routing"]
    assert {k: summary[k] for k in routing} == routing
    info = next(x for x in ckpt.moe_layers() if x["layer"] == layer)
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    x = torch.randn(6, moe.hidden_size)
    logits = torch.randn(6, moe.num_experts)
    bias_name = (info["router"] or {}).get("e_score_correction_bias")
    bias = ckpt.tensor(bias_name, "torch").float() if bias_name else None
    w, ids = torch_route(cfg, routing, logits, bias)
    emu = Emulation(ckpt, layer, mode == "w8a8")
    want = emu.topk(x, w, ids)
    if info["shared_experts"]:
        want += emu.expert(info["shared_experts"]["prefix"], x)
    got = moe(x, logits)
    limit = 2e-3 if mode == "w8a8" else 1e-4
    assert rel_l2(got, want) <= limit


def test_shared_expert_gate_scales_the_shared_output(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen2-MoE's `shared_expert_gate` (an unquantized Linear(H, 1)): the shared expert's
    output is scaled by sigmoid(x . g) per token. Built on the Laguna fixture (real
    compressed-tensors weights, Qwen2-style `shared_expert`) with a gate added to each MoE
    layer and listed in the quantization config's ignore list, as llm-compressor writes it."""
    src = fixture_path("laguna_mixed_int4_int8")
    cfg = json.loads((src / "config.json").read_text())
    layers = [x["layer"] for x in mq.open(src).moe_layers()]
    gates = {layer: torch.randn(1, cfg["hidden_size"]).to(torch.bfloat16) * 0.2 for layer in layers}
    names = {layer: f"model.layers.{layer}.mlp.shared_expert_gate" for layer in layers}

    def add_gates(tensors: dict) -> None:
        tensors.update({f"{names[layer]}.weight": gates[layer] for layer in layers})

    cfg["quantization_config"]["ignore"] += list(names.values())
    dst = _edited_copy(src, tmp_path / "m", tensors=add_gates, config=lambda c: c.update(cfg))
    ckpt = mq.open(dst)
    routing = _expected_routing("laguna_mixed_int4_int8")
    calls = {}
    for layer in layers:
        info = next(x for x in ckpt.moe_layers() if x["layer"] == layer)
        moe = mq.MoELayer.from_checkpoint(ckpt, layer)
        x = torch.randn(6, moe.hidden_size)
        logits = torch.randn(6, moe.num_experts)
        bias = ckpt.tensor(info["router"]["e_score_correction_bias"], "torch").float()
        w, ids = torch_route(cfg, routing, logits, bias)
        emu = Emulation(ckpt, layer, False)
        routed = emu.topk(x, w, ids)
        shared = emu.expert(info["shared_experts"]["prefix"], x)
        gate = torch.sigmoid(x.double() @ gates[layer].double().t())
        got = moe(x, logits)
        assert rel_l2(got, routed + gate * shared) <= 1e-4
        assert rel_l2(got, routed + shared) > 1e-2  # the gate made a difference
        calls[layer] = (x, logits, got)
    # The same calls split into chunks of 4 tokens (a process of its own: the size is read
    # once): each token's gate comes from its own row, in whichever chunk it lands.
    torch.save(calls, tmp_path / "calls.pt")
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch, moeq_rs as mq\n"
            "calls = torch.load(sys.argv[2])\n"
            "torch.save({l: mq.MoELayer.from_checkpoint(sys.argv[1], l)(x, r)"
            " for l, (x, r, _) in calls.items()}, sys.argv[3])",
            str(dst),
            str(tmp_path / "calls.pt"),
            str(tmp_path / "split.pt"),
        ],
        env=dict(os.environ, MOEQ_CHUNK_TOKENS="4"),
        check=True,
    )
    split = torch.load(tmp_path / "split.pt")
    for layer, (_, _, got) in calls.items():
        assert rel_l2(split[layer], got) <= 1e-5


def test_ernie_routing_softmax_with_moe_statics_bias(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """ERNIE-4.5's router (transformers `Ernie4_5_MoeTopKRouter`): experts chosen on softmax
    scores plus the `moe_statics` bias (`[1, E]`, beside the router), weighted by the scores,
    renormalised; top-k from `moe_k`. Built on the DeepSeek-V3 fixture with its bias moved
    there (and made large enough to change choices) and an ERNIE config."""

    def move_bias(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias")]:
            old = tensors.pop(name)
            new = name.replace("mlp.gate.", "mlp.moe_statics.")
            tensors[new] = (torch.randn(1, old.numel()) * 0.2).to(old.dtype)

    def ernie_config(cfg: dict) -> None:
        dropped = (
            "n_group",
            "topk_group",
            "norm_topk_prob",
            "routed_scaling_factor",
            "scoring_func",
        )
        for key in dropped:
            cfg.pop(key, None)
        cfg["moe_k"] = cfg.pop("num_experts_per_tok")
        cfg["model_type"] = "ernie4_5_moe"

    src = fixture_path("deepseek_v3_w8a8_dynamic")
    dst = _edited_copy(src, tmp_path / "m", tensors=move_bias, config=ernie_config)
    cfg = json.loads((dst / "config.json").read_text())
    ckpt = mq.open(dst)
    routing = ckpt.summary()["routing"]
    assert (routing["scoring_func"], routing["renormalize"], routing["top_k"]) == (
        "softmax",
        True,
        2,
    )
    info = ckpt.moe_layers()[0]
    bias_name = info["router"]["e_score_correction_bias"]
    assert bias_name == f"{info['prefix']}.moe_statics.e_score_correction_bias"
    bias = ckpt.tensor(bias_name, "torch").float().reshape(-1)
    moe = mq.MoELayer.from_checkpoint(ckpt, info["layer"])
    x = torch.randn(32, moe.hidden_size)
    logits = torch.randn(32, moe.num_experts)
    w, ids = torch_route(cfg, routing, logits, bias)
    plain = torch.softmax(logits, -1).topk(2, dim=-1).indices
    assert not torch.equal(ids.sort(-1).values, plain.sort(-1).values)  # the bias matters
    emu = Emulation(ckpt, info["layer"], True)
    want = emu.topk(x, w, ids) + emu.expert(info["shared_experts"]["prefix"], x)
    assert rel_l2(moe(x, logits), want) <= 2e-3


def test_minimax_m2_routing_sigmoid_with_block_bias(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """MiniMax-M2's router (transformers `MiniMaxM2SparseMoeBlock`): sigmoid scores plus the
    bias the block itself holds (`block_sparse_moe.e_score_correction_bias`) for choosing,
    weighted by the scores, renormalised. Built on the Mixtral fixture (same expert naming)
    with such a bias added and a MiniMax-M2 config."""
    src = fixture_path("mixtral_w8a16_channel")

    def add_bias(tensors: dict) -> None:
        for info in mq.open(src).moe_layers():
            bias = torch.randn(info["num_experts"]) * 0.3
            tensors[f"{info['prefix']}.e_score_correction_bias"] = bias

    dst = _with_config(src, tmp_path / "m", tensors=add_bias, model_type="minimax_m2")
    cfg = json.loads((dst / "config.json").read_text())
    ckpt = mq.open(dst)
    routing = ckpt.summary()["routing"]
    assert (routing["scoring_func"], routing["renormalize"]) == ("sigmoid", True)
    for info in ckpt.moe_layers():
        bias_name = info["router"]["e_score_correction_bias"]
        assert bias_name == f"{info['prefix']}.e_score_correction_bias"
        bias = ckpt.tensor(bias_name, "torch").float()
        moe = mq.MoELayer.from_checkpoint(ckpt, info["layer"])
        x = torch.randn(32, moe.hidden_size)
        logits = torch.randn(32, moe.num_experts)
        w, ids = torch_route(cfg, routing, logits, bias)
        plain = torch.sigmoid(logits).topk(2, dim=-1).indices
        assert not torch.equal(ids.sort(-1).values, plain.sort(-1).values)  # the bias matters
        want = Emulation(ckpt, info["layer"], False).topk(x, w, ids)
        assert rel_l2(moe(x, logits), want) <= 1e-4


def _inspect(path: Path) -> str:
    """What `moeq inspect <path>` prints."""
    run = [sys.executable, "-m", "moeq_rs", "inspect", str(path)]
    return subprocess.run(run, capture_output=True, text=True, check=True).stdout


def _renamed(tensors: dict, old: str, new: str) -> None:
    """Renames every tensor whose name contains ``old``."""
    for name in [n for n in tensors if old in n]:
        tensors[name.replace(old, new)] = tensors.pop(name)


def _routing_facts(routing: dict) -> tuple:
    """(scoring, renormalise, expert groups, routed scaling) of a summary's routing."""
    keys = ("scoring_func", "renormalize", "n_group", "routed_scaling_factor")
    return tuple(routing[k] for k in keys)


def _moved_bias(tensors: dict, leaf: str) -> None:
    """Moves the fixture's `gate.e_score_correction_bias` to `mlp.<leaf>`, made large enough
    to change which experts are chosen."""
    _renamed(tensors, "mlp.gate.e_score_correction_bias", f"mlp.{leaf}")
    for name in [n for n in tensors if n.endswith(f"mlp.{leaf}")]:
        tensors[name] = torch.randn(tensors[name].shape) * 0.3


def _ling_v2(tensors: dict, cfg: dict) -> tuple[str | None, str]:
    """Ling-2.0 (vLLM `bailing_moe.py`, inclusionAI's `BailingMoeV2`): `score_function`,
    the bias on the router as `gate.expert_bias`; grouped sigmoid top-k as DeepSeek-V3."""
    _moved_bias(tensors, "gate.expert_bias")
    cfg["score_function"] = "sigmoid"
    cfg["moe_router_enable_expert_bias"] = True
    cfg["model_type"] = "bailing_moe_v2"
    return "gate.expert_bias", "gate"


def _afmoe(tensors: dict, cfg: dict) -> tuple[str | None, str]:
    """AFMoE (transformers `AfmoeTokenChoiceRouter`): the router under `router.gate`, the bias
    on the block as `expert_bias`; sigmoid (the family's only scoring), renormalised (`route_norm`),
    scaled by `route_scale`; no expert groups."""
    _moved_bias(tensors, "expert_bias")
    _renamed(tensors, "mlp.gate.weight", "mlp.router.gate.weight")
    for key in ("n_group", "topk_group"):
        cfg.pop(key)
    cfg["route_norm"] = cfg.pop("norm_topk_prob")
    cfg["route_scale"] = cfg.pop("routed_scaling_factor")
    cfg["model_type"] = "afmoe"
    return "expert_bias", "router.gate"


def _hunyuan(tensors: dict, cfg: dict) -> tuple[str | None, str]:
    """Hunyuan-A13B (transformers `HunYuanMoEV1Gate`/`HunYuanMoEV1Moe`): softmax top-k from the
    per-layer `moe_topk` list, always renormalised, the router as `gate.wg`, the shared expert
    as `shared_mlp`; no bias, groups or scaling."""
    _renamed(tensors, "mlp.shared_experts.", "mlp.shared_mlp.")
    _renamed(tensors, "mlp.gate.weight", "mlp.gate.wg.weight")
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        del tensors[name]
    for key in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"):
        cfg.pop(key)
    cfg["moe_topk"] = [cfg.pop("num_experts_per_tok")] * cfg["num_hidden_layers"]
    cfg["model_type"] = "hunyuan_v1_moe"
    return None, "gate.wg"


@pytest.mark.parametrize(
    "family,routing_want",
    [
        (_ling_v2, ("sigmoid", True, 2, 2.5)),
        (_afmoe, ("sigmoid", True, None, 2.5)),
        (_hunyuan, ("softmax", True, None, 1.0)),
    ],
)
def test_routing_of_families_with_their_own_key_names(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    family: Callable[[dict, dict], tuple[str | None, str]],
    routing_want: tuple,
) -> None:
    """Families that spell the DeepSeek-V3 routing keys and tensors their own way (Ling-2.0,
    AFMoE) or route softmax top-k with a renamed router and shared expert (Hunyuan): before,
    their bias was not found (so experts were chosen without it, by softmax for Ling-2.0), their
    renormalisation and scaling keys were not read, and Hunyuan's top-k and shared expert were
    missed. Built on the DeepSeek-V3 fixture with tensors and config renamed as each family
    stores them; compared with routing written from the family's router."""
    src = fixture_path("deepseek_v3_w8a8_dynamic")
    cfg = json.loads((src / "config.json").read_text())
    leaves: list[tuple[str | None, str]] = []  # (bias, router) as the family stores them

    def edit_config(c: dict) -> None:  # runs after edit_tensors has edited cfg
        c.clear()
        c.update(cfg)

    edit_tensors = lambda state: leaves.append(family(state, cfg))  # noqa: E731
    dst = _edited_copy(src, tmp_path / "m", tensors=edit_tensors, config=edit_config)
    ckpt = mq.open(dst)
    routing = ckpt.summary()["routing"]
    assert _routing_facts(routing) == routing_want and routing["top_k"] == 2
    for info in ckpt.moe_layers():
        bias_leaf, router_leaf = leaves[0]
        assert info["router"]["module"] == f"{info['prefix']}.{router_leaf}"
        bias_name = info["router"]["e_score_correction_bias"]
        assert bias_name == (bias_leaf and f"{info['prefix']}.{bias_leaf}")
        bias = ckpt.tensor(bias_name, "torch").float() if bias_name else None
        moe = mq.MoELayer.from_checkpoint(ckpt, info["layer"])
        x = torch.randn(32, moe.hidden_size)
        logits = torch.randn(32, moe.num_experts)
        w, ids = torch_route(cfg, routing, logits, bias)
        if bias is not None:  # the bias changes which experts are chosen
            plain = torch_route(cfg, routing, logits, None)[1]
            assert not torch.equal(ids.sort(-1).values, plain.sort(-1).values)
        emu = Emulation(ckpt, info["layer"], True)
        shared = emu.expert(info["shared_experts"]["prefix"], x)
        assert info["shared_experts"]["prefix"].endswith(("shared_experts", "shared_mlp"))
        assert rel_l2(moe(x, logits), emu.topk(x, w, ids) + shared) <= 2e-3


@pytest.mark.parametrize(
    "changes,want",
    [
        # Config classes and routers that renormalise, or score by sigmoid, unless told.
        (dict(model_type="glm4_moe"), ("sigmoid", True, None, 1.0)),
        # GLM-4.5V's language model on its own: the GLM-4.5 router, even without a bias tensor.
        (dict(model_type="glm4v_moe_text"), ("sigmoid", True, None, 1.0)),
        (dict(model_type="qwen3_next"), ("softmax", True, None, 1.0)),
        (dict(model_type="hunyuan_v1_moe"), ("softmax", True, None, 1.0)),
        (dict(model_type="qwen3_moe"), ("softmax", False, None, 1.0)),
        (dict(model_type="qwen3_vl_moe"), ("softmax", True, None, 1.0)),
        (dict(model_type="qwen3_5_moe"), ("softmax", True, None, 1.0)),
        (dict(model_type="cohere2_moe"), ("softmax", True, None, 1.0)),
        (
            dict(model_type="cohere2_moe", expert_selection_fn="sigmoid"),
            ("sigmoid", True, None, 1.0),
        ),
        (
            dict(
                model_type="cohere2_moe",
                num_shared_experts=1,
                shared_expert_combination_strategy="sum",
            ),
            ("softmax", True, None, 1.0),
        ),
        # Config classes whose scaling factor (and groups) are not 1 (none) by default.
        (dict(model_type="hy_v3"), ("sigmoid", True, None, 2.826)),
        (dict(model_type="glm4_moe_lite"), ("sigmoid", True, None, 1.8)),
        (dict(model_type="exaone_moe"), ("sigmoid", True, None, 2.5)),
        (dict(model_type="glm_moe_dsa"), ("sigmoid", True, None, 2.5)),
        (dict(model_type="deepseek_v32"), ("sigmoid", True, 8, 2.5)),
        # A wrapper's language model names the family in text_config.
        (
            dict(model_type="kimi_vl", text_config={"model_type": "deepseek_v3"}),
            ("sigmoid", True, 8, 2.5),
        ),
        # DeepSeek-V2's `greedy` top-k ignores the group keys; group_limited_greedy uses them.
        (dict(topk_method="greedy", n_group=4, topk_group=1), ("softmax", False, None, 1.0)),
        (
            dict(topk_method="group_limited_greedy", n_group=4, topk_group=1),
            ("softmax", False, 4, 1.0),
        ),
        # Other families' spellings of the keys, each deciding the outcome.
        (dict(score_function="sigmoid"), ("sigmoid", False, None, 1.0)),
        (dict(score_func="sigmoid"), ("sigmoid", False, None, 1.0)),
        (dict(route_norm=True), ("softmax", True, None, 1.0)),
        (dict(model_type="afmoe", route_norm=False), ("sigmoid", False, None, 1.0)),
        # vLLM's AFMoE renormalises sigmoid scores only.
        (
            dict(model_type="afmoe", score_func="softmax", route_norm=True),
            ("softmax", False, None, 1.0),
        ),
        (dict(route_scale=2.0), ("softmax", False, None, 2.0)),
        (dict(router_scaling_factor=3.0), ("softmax", False, None, 3.0)),
        (dict(moe_router_scaling_factor=4.0), ("softmax", False, None, 4.0)),
    ],
)
def test_family_defaults_when_the_config_is_silent(
    fixture_path: Callable[[str], Path], tmp_path: Path, changes: dict, want: tuple
) -> None:
    """Without `scoring_func` or `norm_topk_prob`, routing follows the family's own router or
    config class; other families' spellings of the keys are read; and the layer routes as the
    summary says."""
    path = _with_config(
        fixture_path("qwen3_w8a16_g128"), tmp_path / "m", norm_topk_prob=None, **changes
    )
    ckpt = mq.open(path)
    routing = ckpt.summary()["routing"]
    assert _routing_facts(routing) == want
    moe = mq.MoELayer.from_checkpoint(ckpt, 0)
    x, logits = torch.randn(16, moe.hidden_size), torch.randn(16, moe.num_experts)
    w, ids = torch_route({}, routing, logits, None)
    assert rel_l2(moe(x, logits), moe.forward_topk(x, w.float(), ids)) <= 1e-6


@pytest.mark.parametrize(
    "changes,defaults,groups",
    [
        (
            dict(model_type="deepseek_v3"),
            ["scoring_func", "renormalize", "routed_scaling_factor", "n_group", "topk_group"],
            (8, 4),
        ),
        # vLLM reads Kimi-K2 through DeepseekV3Config; both group whatever topk_method says.
        (
            dict(model_type="kimi_k2", topk_method="greedy"),
            ["scoring_func", "renormalize", "routed_scaling_factor", "n_group", "topk_group"],
            (8, 4),
        ),
        # One group is no grouping: the default topk_group is neither used nor reported.
        (
            dict(model_type="deepseek_v3", n_group=1),
            ["scoring_func", "renormalize", "routed_scaling_factor"],
            (None, None),
        ),
        # What the config says wins, a value equal to the generic default included.
        (
            dict(
                model_type="deepseek_v3",
                scoring_func="softmax",
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
                n_group=2,
                topk_group=1,
            ),
            [],
            (2, 1),
        ),
        (
            dict(model_type="deepseek_v3", n_group=4),
            ["scoring_func", "renormalize", "routed_scaling_factor", "topk_group"],
            (4, 4),
        ),
        (dict(model_type="qwen3_moe"), [], (None, None)),
        # Unchecked families get their config classes' defaults too (DeepSeek-V4's scoring is
        # one no kernel has), read under their own spellings (moe_renormalize,
        # num_expert_group) where they have them.
        (dict(model_type="lfm2_moe"), ["scoring_func", "renormalize"], (None, None)),
        (dict(model_type="sarvam_moe"), ["renormalize", "routed_scaling_factor"], (None, None)),
        (dict(model_type="minimax_m3_vl"), ["renormalize", "routed_scaling_factor"], (None, None)),
        (
            dict(model_type="kimi_linear", moe_renormalize=False),
            ["scoring_func", "routed_scaling_factor"],
            (None, None),
        ),
        (
            dict(model_type="bailing_hybrid", num_expert_group=1, topk_group=1),
            ["scoring_func", "renormalize", "routed_scaling_factor"],
            (None, 1),
        ),
        (
            dict(model_type="deepseek_v4"),
            ["scoring_func", "renormalize", "routed_scaling_factor"],
            (None, None),
        ),
    ],
)
def test_the_summary_names_the_keys_the_family_filled_in(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    changes: dict,
    defaults: list,
    groups: tuple,
) -> None:
    """Keys config.json leaves out take the family's config class default (as transformers and
    vLLM read them), and `routing["family_defaults"]` names them; a DeepSeek-V3 config without
    its scaling factor and groups scaled by 1 and ignored the groups before."""
    changes = {"norm_topk_prob": None} | changes
    path = _with_config(fixture_path("qwen3_w8a16_g128"), tmp_path / "m", **changes)
    routing = mq.open(path).summary()["routing"]
    assert routing["family_defaults"] == defaults
    assert (routing["n_group"], routing["topk_group"]) == groups
    if changes["model_type"] == "deepseek_v4":
        assert routing["scoring_func"] == "sqrtsoftplus"
        with pytest.raises(mq.UnsupportedSchemeError, match="model_type: DeepSeek-V4 clamps"):
            mq.MoELayer.from_checkpoint(path, 0)
    if changes["model_type"] == "kimi_linear":
        assert routing["renormalize"] is False
    out = _inspect(path)
    said = [line for line in out.splitlines() if "the family's defaults" in line]
    assert said == (
        [f"          (the family's defaults for {', '.join(defaults)})"] if defaults else []
    )


def test_family_default_groups_that_cannot_apply_are_errors(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A `null` n_group where the family needs a number is a ConfigError at open (transformers
    and vLLM fail on it; it is not read as the default), and a default topk_group that does not
    fit the config's n_group is refused saying it is the family's default, not config.json's."""
    src = fixture_path("qwen3_w8a16_g128")
    null = _edited_copy(
        src, tmp_path / "null", config=lambda c: c.update(model_type="deepseek_v3", n_group=None)
    )
    with pytest.raises(mq.ConfigError, match="n_group: null, where this model family needs"):
        mq.open(null)
    path = _with_config(src, tmp_path / "two", model_type="deepseek_v3", n_group=2)
    ckpt = mq.open(path)
    assert (ckpt.summary()["routing"]["n_group"], ckpt.summary()["routing"]["topk_group"]) == (2, 4)
    why = "topk_group: 4 (the model family's default; config.json does not set topk_group) is not"
    with pytest.raises(mq.ConfigError, match=re.escape(why)):
        mq.MoELayer.from_checkpoint(ckpt, 0)


def test_an_unchecked_family_warns_once_per_checkpoint(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A model family whose router was not checked is routed from config.json's keys, with an
    UncheckedRoutingWarning naming the file and family (once per Checkpoint object); checked
    families load silently; `moeq inspect` says so too."""
    import warnings

    src = fixture_path("qwen3_w8a16_g128")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mq.open(src).summary()["routing"]["family_checked"] is True
        mq.MoELayer.from_checkpoint(src, 0)
    path = _with_config(src, tmp_path / "m", model_type="mystery_moe")
    ckpt = mq.open(path)
    assert ckpt.summary()["routing"]["family_checked"] is False
    with pytest.warns(mq.UncheckedRoutingWarning, match="config.json: model_type 'mystery_moe'"):
        mq.MoELayer.from_checkpoint(ckpt, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mq.MoELayer.from_checkpoint(ckpt, 1)  # the same checkpoint object: warned already
    out = _inspect(path)
    assert "(model family not checked: see README)" in out


@pytest.mark.parametrize(
    "bias", ["experts.3.down_proj.bias", "shared_experts.up_proj.bias", "experts.0.gate_proj.bias"]
)
def test_expert_projection_biases_are_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path, bias: str
) -> None:
    """A bias on an expert or shared-expert projection (gpt-oss style) was dropped: the layer
    ran without it, and both repack targets wrote the layer without it. No kernel adds one, so
    the layer is refused everywhere, naming the tensor; the other layers still load."""
    name = f"model.layers.1.mlp.{bias}"

    def add(tensors: dict) -> None:
        rows = tensors[name.replace(".bias", ".weight")].shape[0]
        tensors[name] = torch.randn(rows, dtype=torch.bfloat16)

    path = _edited_copy(fixture_path("deepseek_v3_w8a8_dynamic"), tmp_path / "m", tensors=add)
    ckpt = mq.open(path)
    info = {x["layer"]: x for x in ckpt.moe_layers()}
    msg = f"{name}: expert projection biases are not added by any kernel"
    assert info[1]["unsupported"] == msg and info[2]["unsupported"] is None
    for platform in ("cpu", "cuda"):
        layer = mq.plan(ckpt, platform).layer(1)
        assert layer["backend"] is None and layer["error"] == msg
    with pytest.raises(mq.UnsupportedSchemeError, match=re.escape(msg)):
        mq.MoELayer.from_checkpoint(ckpt, 1)
    with pytest.raises(mq.UnsupportedSchemeError, match=re.escape(msg)):
        ckpt.marlin_layer(1)
    with pytest.raises(mq.UnsupportedSchemeError, match=re.escape(msg)):
        mq.repack.repack_checkpoint(path, tmp_path / "marlin", target="marlin")
    assert not (tmp_path / "marlin").exists()
    mq.MoELayer.from_checkpoint(ckpt, 2)
    # The CPU layout packs the other layer and keeps this one, bias included, in source form.
    mq.repack.repack_checkpoint(path, tmp_path / "cpu", target="cpu")
    with pytest.raises(mq.UnsupportedSchemeError, match=re.escape(msg)):
        mq.MoELayer.from_checkpoint(tmp_path / "cpu", 1)
    mq.MoELayer.from_checkpoint(tmp_path / "cpu", 2)


def _fused_shared_gate(tensors: dict) -> None:
    _renamed(
        tensors,
        "layers.1.mlp.shared_experts.gate_proj.",
        "layers.1.mlp.shared_experts.gate_up_proj.",
    )


def _second_shared_expert(tensors: dict) -> None:
    for name in [n for n in tensors if "layers.1.mlp.shared_experts." in n]:
        tensors[name.replace("shared_experts.", "shared_mlp.")] = tensors[name].clone()


@pytest.mark.parametrize(
    "edit,subject,reason",
    [
        # gate_proj stored fused: the shared expert ran as a non-gated up/down MLP.
        (
            _fused_shared_gate,
            "shared_experts.gate_up_proj",
            "is not a shared-expert projection the forward computes",
        ),
        # A second complete shared expert under another name: only the first one ran.
        (_second_shared_expert, "shared_mlp.down_proj", "is a second shared expert of its block"),
    ],
)
def test_shared_expert_parts_the_forward_would_leave_out_are_refused(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    edit: Callable[[dict], None],
    subject: str,
    reason: str,
) -> None:
    """A shared-expert module the forward does not compute was skipped silently. The layer is
    now refused on every platform, naming the module; the checkpoint still opens and its other
    layers load."""
    path = _edited_copy(fixture_path("deepseek_v3_w8a8_dynamic"), tmp_path / "m", tensors=edit)
    ckpt = mq.open(path)
    msg = f"model.layers.1.mlp.{subject}: {reason}"
    info = {x["layer"]: x for x in ckpt.moe_layers()}
    assert info[1]["unsupported"].startswith(msg) and info[2]["unsupported"] is None
    assert mq.plan(ckpt, "cuda").layer(1)["backend"] is None
    with pytest.raises(mq.UnsupportedSchemeError, match=re.escape(msg)):
        mq.MoELayer.from_checkpoint(ckpt, 1)
    mq.MoELayer.from_checkpoint(ckpt, 2)


def test_per_layer_top_k_must_agree(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    """Hunyuan's `moe_topk` may list a top-k per layer: one shared value is read, different
    values are a ConfigError naming the key (one top-k per model is supported)."""
    src = fixture_path("qwen3_w8a16_g128")
    ok = _with_config(src, tmp_path / "a", num_experts_per_tok=None, moe_topk=[3, 3])
    assert mq.open(ok).summary()["routing"]["top_k"] == 3
    bad = _with_config(src, tmp_path / "b", num_experts_per_tok=None, moe_topk=[2, 4])
    with pytest.raises(mq.ConfigError, match=r"config.json: moe_topk: per-layer top-k \[2, 4\]"):
        mq.open(bad)
    bad = _with_config(src, tmp_path / "c", num_experts_per_tok=None, moe_topk=[2, "x"])
    with pytest.raises(mq.ConfigError, match=r"config.json: moe_topk\[1\]: expected"):
        mq.open(bad)


def _edited_copy(
    src: Path,
    dst: Path,
    tensors: Callable[[dict], None] | None = None,
    config: Callable[[dict], None] | None = None,
) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst``, its tensors and its config.json
    edited in place by ``tensors`` and ``config``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if tensors is not None:
        state = load_file(dst / "model.safetensors")
        tensors(state)
        save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _with_config(
    src: Path, dst: Path, tensors: Callable[[dict], None] | None = None, **changes: object
) -> Path:
    """A copy of checkpoint ``src`` whose config.json has ``changes`` (None deletes a key)."""

    def change(cfg: dict) -> None:
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value

    return _edited_copy(src, dst, tensors, change)


def test_layers_a_qwen_config_makes_the_other_kind_are_said(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """transformers and vLLM build a Qwen-MoE layer from config.json (``mlp_only_layers``,
    ``decoder_sparse_step``, ``num_experts``), moeq from the tensors: where they disagree, the
    others fail to load or run weights the checkpoint lacks, so the summary and `moeq inspect`
    say so; moeq still loads what the tensors hold."""
    src = fixture_path("qwen3_w8a16_g128")
    assert mq.open(src).summary()["config_layer_mismatch"] == []
    assert "warning:" not in _inspect(src)

    only = _with_config(src, tmp_path / "only", mlp_only_layers=[1])
    [m] = mq.open(only).summary()["config_layer_mismatch"]
    assert (m["layer"], m["config"], m["tensors"]) == (1, "dense", "moe")
    assert "mlp_only_layers lists it" in m["reason"] and "vLLM refuses" in m["reason"]
    assert f"warning: layer 1: {m['reason']}" in _inspect(only)
    mq.MoELayer.from_checkpoint(only, 1)  # said, not refused

    step = _with_config(src, tmp_path / "step", decoder_sparse_step=2)
    [m] = mq.open(step).summary()["config_layer_mismatch"]
    assert (m["layer"], m["config"]) == (0, "dense")
    assert "decoder_sparse_step is 2, and 1 is not a multiple of it" in m["reason"]

    # A dense layer where a Qwen3-MoE config (every layer MoE by default) makes a MoE block.
    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-moe-int4-int8"
    assert mq.open(tiny).summary()["config_layer_mismatch"] == []  # not a Qwen family
    qwen = _with_config(tiny, tmp_path / "qwen", model_type="qwen3_moe")
    [m] = mq.open(qwen).summary()["config_layer_mismatch"]
    assert (m["layer"], m["config"], m["tensors"]) == (0, "moe", "dense")
    assert "whose weights the checkpoint lacks" in m["reason"]


@pytest.mark.parametrize(
    "model_type,top_k,renormalize",
    [
        ("minimax", 2, True),
        ("minimax_m2", 2, True),
        ("ernie4_5_moe", 2, True),
        ("hunyuan_v1_moe", 2, True),
        # vLLM's Hunyuan: `renormalize=top_k > 1`; a top-1 expert keeps its score.
        ("hunyuan_v1_moe", 1, False),
    ],
)
def test_families_whose_routers_ignore_norm_topk_prob(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    model_type: str,
    top_k: int,
    renormalize: bool,
) -> None:
    """MiniMax(-M2), ERNIE-4.5 and Hunyuan route as their transformers routers and vLLM's
    models do whatever `norm_topk_prob: false` says: renormalised (Hunyuan: above top-1).
    moeq followed the explicit false, off by up to 2.5 relative L2 on MiniMax-M2 (found by a
    review helper comparing transformers' blocks)."""
    path = _with_config(
        fixture_path("qwen3_w8a16_g128"), tmp_path / "m", model_type=model_type,
        norm_topk_prob=False, num_experts_per_tok=top_k,
    )  # fmt: skip
    ckpt = mq.open(path)
    assert ckpt.summary()["routing"]["renormalize"] is renormalize
    moe = mq.MoELayer.from_checkpoint(ckpt, 0)
    x, logits = torch.randn(16, moe.hidden_size), torch.randn(16, moe.num_experts)
    top = torch.softmax(logits.double(), -1).topk(top_k, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    want = moe.forward_topk(x, w.float(), top.indices)
    assert rel_l2(moe(x, logits), want) <= 1e-6


@pytest.mark.parametrize("value", [False, True, "no"])
def test_mixtral_renormalises_whatever_norm_topk_prob_says(
    fixture_path: Callable[[str], Path], tmp_path: Path, value: object
) -> None:
    """Mixtral's router (transformers) and vLLM's Mixtral (`renormalize=True`) renormalise the
    top-k weights and never read `norm_topk_prob`: a config that carries one, false or even of
    the wrong type, routes as Mixtral does. Before, false turned renormalisation off."""
    path = _with_config(fixture_path("mixtral_w8a16_channel"), tmp_path / "m", norm_topk_prob=value)
    ckpt = mq.open(path)
    assert ckpt.summary()["routing"]["renormalize"] is True
    moe = mq.MoELayer.from_checkpoint(ckpt, 0)
    x, logits = torch.randn(16, moe.hidden_size), torch.randn(16, moe.num_experts)
    top = torch.softmax(logits.double(), -1).topk(moe.top_k, dim=-1)
    w = top.values / top.values.sum(-1, keepdim=True)
    want = moe.forward_topk(x, w.float(), top.indices)
    assert rel_l2(moe(x, logits), want) <= 1e-6
    unnormalised = moe.forward_topk(x, top.values.float(), top.indices)
    assert rel_l2(want, unnormalised) > 1e-2


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_grouped_routing_without_bias(
    fixture_path: Callable[[str], Path], tmp_path: Path, scoring: str
) -> None:
    """DeepSeek-V2's group-limited routing (softmax scores, n_group 4 of 2 experts each, the
    best group kept, no renormalisation, routed scaling 16) and its sigmoid variant: the
    forward picks the experts and weights of vLLM's grouped_topk, which differ from plain
    top-k whenever a token's two best experts lie in different groups."""
    path = _with_config(
        fixture_path("qwen3_w8a16_g128"),
        tmp_path / "m",
        scoring_func=scoring,
        n_group=4.0,  # an integral float reads as 4
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    )
    ckpt = mq.open(path)
    routing = ckpt.summary()["routing"]
    assert (routing["n_group"], routing["topk_group"], routing["scoring_func"]) == (4, 1, scoring)
    moe = mq.MoELayer.from_checkpoint(ckpt, 0)
    x = torch.randn(64, moe.hidden_size)
    logits = torch.randn(64, moe.num_experts)
    w, ids = torch_route({}, routing, logits, None)
    plain_ids = torch_route({}, routing | {"n_group": None}, logits, None)[1]
    assert not torch.equal(ids.sort(-1).values, plain_ids.sort(-1).values)
    want = moe.forward_topk(x, w.float(), ids)
    assert rel_l2(moe(x, logits), want) <= 1e-6


@pytest.mark.parametrize(
    "changes,error,match",
    [
        (dict(n_group=3, topk_group=1), mq.ConfigError, "n_group: 3 expert groups do not divide"),
        (dict(n_group=4), mq.ConfigError, "topk_group: missing, and n_group is 4"),
        (dict(n_group=4, topk_group=5), mq.ConfigError, "topk_group: 5 is not between 1 and"),
        (dict(n_group=8, topk_group=1), mq.ConfigError, "topk_group: 1 groups of 1 experts hold"),
        (dict(num_experts_per_tok=9), mq.ConfigError, "num_experts_per_tok: 9 is not between"),
        (dict(routed_scaling_factor=0.0), mq.ConfigError, "routed_scaling_factor: 0 is not a"),
        (dict(routed_scaling_factor=-2.5), mq.ConfigError, "routed_scaling_factor: -2.5 is not"),
        (dict(route_scale=-1), mq.ConfigError, "route_scale: -1 is not a positive"),
        (dict(routed_scaling_factor=1e39), mq.ConfigError, "routed_scaling_factor: 1e39 is not"),
        # (serde_json reads 1e-50 an ulp low: 9.999999999999999e-51.)
        (
            dict(routed_scaling_factor=1e-50),
            mq.ConfigError,
            r"routed_scaling_factor: [0-9.]+e-5\d is not a positive number within f32",
        ),
        (dict(scoring_func="sqrtsoftplus"), mq.UnsupportedSchemeError, "scoring_func"),
        (dict(hidden_act="gelu"), mq.UnsupportedSchemeError, 'hidden_act: "gelu" experts'),
        (
            dict(hidden_act=None, hidden_activation="gelu_pytorch_tanh"),
            mq.UnsupportedSchemeError,
            'hidden_act: "gelu_pytorch_tanh" experts',
        ),
        # The router weight on the expert input (transformers' Laguna refuses it too); the
        # fixtures' Laguna config says false, which loads.
        (
            dict(moe_apply_router_weight_on_input=True),
            mq.UnsupportedSchemeError,
            "moe_apply_router_weight_on_input: true: the top-k weight would scale each expert's "
            "input",
        ),
        (dict(model_type="llama4"), mq.UnsupportedSchemeError, "model_type: Llama-4 scales"),
        (dict(model_type="phimoe"), mq.UnsupportedSchemeError, "model_type: PhiMoE"),
        (dict(model_type="gpt_oss"), mq.UnsupportedSchemeError, "model_type: gpt-oss experts"),
        (dict(model_type="longcat_flash"), mq.UnsupportedSchemeError, "model_type: LongCat"),
        (dict(model_type="jetmoe"), mq.UnsupportedSchemeError, "model_type: JetMoE"),
        (dict(model_type="ernie4_5_vl_moe"), mq.UnsupportedSchemeError, "model_type: ERNIE-4.5-VL"),
        (dict(model_type="step3p5"), mq.UnsupportedSchemeError, "model_type: Step-3.5 adds"),
        # Hunyuan-V4's clamp is on unless swiglu_limit turns it off; Command-A MoE averages
        # unless its strategy is "sum" (only where it has a shared expert).
        (dict(model_type="hy_v4"), mq.UnsupportedSchemeError, "model_type: Hunyuan-V4 clamps"),
        (
            dict(model_type="hy_v4", swiglu_limit=0.0),
            mq.UnsupportedSchemeError,
            "model_type: Hunyuan-V4 clamps",
        ),
        (dict(model_type="hy_v4_vl"), mq.UnsupportedSchemeError, "model_type: Hunyuan-V4 clamps"),
        (
            dict(model_type="deepseek_v4", scoring_func="softmax"),
            mq.UnsupportedSchemeError,
            "model_type: DeepSeek-V4 clamps",
        ),
        (dict(model_type="inkling2_text"), mq.UnsupportedSchemeError, "model_type: Inkling"),
        (
            dict(model_type="ernie4_5_vl_moe_text"),
            mq.UnsupportedSchemeError,
            "model_type: ERNIE-4.5-VL",
        ),
        (
            dict(model_type="cohere2_moe", num_shared_experts=1),
            mq.UnsupportedSchemeError,
            "model_type: Command-A MoE averages",
        ),
    ],
)
def test_routing_the_cpu_cannot_follow_is_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path, changes: dict, error: type, match: str
) -> None:
    """Routing keys that vLLM would crash on, and scoring functions or expert activations that
    no kernel implements, stop the CPU layer from being built (before any expert is loaded),
    naming config.json and the key; the checkpoint still opens and plans."""
    path = _with_config(fixture_path("qwen3_w8a16_g128"), tmp_path / "m", **changes)
    ckpt = mq.open(path)
    assert ckpt.summary()["routing"]["scoring_func"] == changes.get("scoring_func", "softmax")
    with pytest.raises(error, match=f"config.json: {match}"):
        mq.MoELayer.from_checkpoint(ckpt, 0)
    # The CPU plan says so up front (`moeq inspect`); the CUDA plan (vLLM's routing) does not.
    cpu = mq.plan(ckpt, "cpu").layer(0)
    assert cpu["backend"] is None and re.search(f"config.json: {match}", cpu["error"])
    assert {"backend": "cpu_simd", "reason": cpu["error"]} in cpu["rejected_backends"]
    assert mq.plan(ckpt, "cuda").layer(0)["backend"] is not None


def test_biased_groups_of_one_expert_are_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """DeepSeek-V3's router scores a group by the sum of its two best biased scores; with
    `n_group` equal to the expert count each group holds one expert, where transformers' and
    vLLM's `topk(2)` fail. The CPU forward scored such a group by its one expert, a router no
    reference computes; now the layer is refused naming n_group, from the checkpoint and from
    its CPU repack, and the CPU plan says so. Without a bias (DeepSeek-V2's group-limited
    routing scores a group by its best expert) groups of one still route."""
    from moeq_rs.repack import repack_checkpoint

    src = fixture_path("deepseek_v3_w8a8_dynamic")
    ckpt = mq.open(src)
    layer = ckpt.moe_layers()[0]["layer"]
    experts = mq.MoELayer.from_checkpoint(ckpt, layer).num_experts
    assert ckpt.summary()["routing"]["n_group"] == 2 and experts == 8
    why = (
        f"config.json: n_group: {experts} expert groups of the layer's {experts} experts hold one "
        "expert each, where a router with a score-correction bias scores a group by its two best"
    )
    repack_checkpoint(src, tmp_path / "cpu", target="cpu")
    for name, base in [("ckpt", src), ("repacked", tmp_path / "cpu")]:
        path = _with_config(base, tmp_path / name, n_group=experts, topk_group=4)
        grouped = mq.open(path)
        with pytest.raises(mq.ConfigError, match=re.escape(why)):
            mq.MoELayer.from_checkpoint(grouped, layer)
        cpu = mq.plan(grouped, "cpu").layer(layer)
        assert cpu["backend"] is None and why in cpu["error"]
        # The refusal is the groups of one: the fixture's own two groups of four load.
        assert mq.MoELayer.from_checkpoint(mq.open(base), layer).num_experts == experts

    def drop_bias(tensors: dict) -> None:
        for k in [k for k in tensors if k.endswith("e_score_correction_bias")]:
            del tensors[k]

    unbiased = _edited_copy(
        src,
        tmp_path / "unbiased",
        tensors=drop_bias,
        config=lambda c: c.update(n_group=experts, topk_group=4),
    )
    ckpt = mq.open(unbiased)
    moe = mq.MoELayer.from_checkpoint(ckpt, layer)
    routing = ckpt.summary()["routing"]
    assert (routing["n_group"], routing["topk_group"]) == (experts, 4)
    x, logits = torch.randn(16, moe.hidden_size), torch.randn(16, experts)
    w, ids = torch_route({}, routing, logits, None)
    emu = Emulation(ckpt, layer, True)
    shared = next(x for x in ckpt.moe_layers() if x["layer"] == layer)["shared_experts"]
    want = emu.topk(x, w, ids) + emu.expert(shared["prefix"], x)
    assert rel_l2(moe(x, logits), want) <= 2e-3


@pytest.mark.parametrize("name", ["qwen3_w8a8_dynamic", "qwen3_w8a8_static"])
def test_naive_quantized_w8a8_loads_and_repacks_as_int_quantized(
    fixture_path: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    """compressed-tensors writes the same int8 codes under "naive-quantized" as under
    "int-quantized", and the oracle plans both onto the CPU W8A8 path. The loader took only the
    second ("format has no CPU kernel") and repack --target cpu copied the layer unconverted."""
    from moeq_rs.repack import repack_checkpoint

    def naive(cfg: dict) -> None:
        q = cfg["quantization_config"]
        q["format"] = "naive-quantized"
        for group in q["config_groups"].values():
            group["format"] = "naive-quantized"

    src = fixture_path(name)
    path = _edited_copy(src, tmp_path / "naive", config=naive)
    layer = mq.plan(path, "cpu").layer(0)
    assert (layer["method"], layer["backend"], layer["error"]) == ("w8a8_int8", "cpu_simd", None)
    repack_checkpoint(path, tmp_path / "cpu", target="cpu")
    layers = json.loads((tmp_path / "cpu" / "config.json").read_text())["moeq"]["layers"]
    assert [entry["kind"] for entry in layers] == ["int8_w8a8"] * len(layers) and layers
    want = mq.MoELayer.from_checkpoint(src, 0)
    x = torch.randn(5, want.hidden_size)
    logits = torch.randn(5, want.num_experts)
    for got in (path, tmp_path / "cpu"):
        assert torch.equal(mq.MoELayer.from_checkpoint(got, 0)(x, logits), want(x, logits))


def test_a_cpu_layout_static_scale_the_loader_refuses_is_refused_by_the_plan(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A source checkpoint's bad static input scale is in its plan's error; in the CPU layout
    the plan did not read the stacked scales, so it promised cpu_simd and the load failed."""
    from moeq_rs.repack import repack_checkpoint

    repack_checkpoint(fixture_path("qwen3_w8a8_static"), tmp_path / "cpu", target="cpu")
    prefix = json.loads((tmp_path / "cpu" / "config.json").read_text())["moeq"]["layers"][0][
        "prefix"
    ]
    assert mq.plan(tmp_path / "cpu", "cpu").layer(0)["backend"] == "cpu_simd"
    for which in ("w13_input_scale", "w2_input_scale"):
        name = f"{prefix}.{which}"

        def edit(state: dict, name: str = name) -> None:
            state[name][1] = -1.0

        path = _edited_copy(tmp_path / "cpu", tmp_path / which, tensors=edit)
        want = rf"tensor '{re.escape(name)}': element 1 is -1"
        layer = mq.plan(path, "cpu").layer(0)
        assert layer["backend"] is None and re.search(want, layer["error"]), layer["error"]
        with pytest.raises(mq.CheckpointError, match=want):
            mq.MoELayer.from_checkpoint(path, 0)


def test_cpu_layout_checkpoints_are_refused_for_their_config(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A checkpoint repacked for the CPU is planned from its stored layout; its config is
    checked all the same (plan and loader)."""
    from moeq_rs.repack import repack_checkpoint

    repack_checkpoint(fixture_path("qwen3_w8a16_g128"), tmp_path / "cpu", target="cpu")
    assert mq.plan(tmp_path / "cpu", "cpu").layer(0)["backend"] == "cpu_simd"
    path = _with_config(tmp_path / "cpu", tmp_path / "m", model_type="phimoe")
    layer = mq.plan(path, "cpu").layer(0)
    assert layer["backend"] is None and "config.json: model_type: PhiMoE" in layer["error"]
    with pytest.raises(mq.UnsupportedSchemeError, match="config.json: model_type: PhiMoE"):
        mq.MoELayer.from_checkpoint(path, 0)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("norm_topk_prob", "yes", "true or false"),
        ("n_group", -2, "a non-negative integer"),
        ("topk_group", 1.5, "a non-negative integer"),
        ("num_experts_per_tok", "8", "a non-negative integer"),
        ("routed_scaling_factor", "2.5", "a number"),
        ("scoring_func", 1, "a string"),
        ("hidden_act", ["silu"], "a string"),
        ("moe_apply_router_weight_on_input", "yes", "true or false"),
        # The family sets routing defaults (Laguna's sigmoid, Mixtral's renormalisation).
        ("model_type", ["qwen3_moe"], "a string"),
    ],
)
def test_routing_keys_of_the_wrong_type_are_config_errors(
    fixture_path: Callable[[str], Path], tmp_path: Path, key: str, value: object, expected: str
) -> None:
    """A routing key of the wrong type was ignored (default routing, silently different from
    the model's); it is a ConfigError naming the key when the checkpoint opens."""
    path = _with_config(fixture_path("qwen3_w8a16_g128"), tmp_path / "m", **{key: value})
    with pytest.raises(mq.ConfigError, match=f"config.json: {key}: expected {expected}"):
        mq.open(path)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda m, x, w, i: m.forward_topk(x.t(), w, i), "hidden_states: expected a contiguous"),
        (lambda m, x, w, i: m.forward_topk(x[:, :10].contiguous(), w, i), "hidden_states"),
        (lambda m, x, w, i: m.forward_topk(x, w, i.float()), "topk_ids"),
        (lambda m, x, w, i: m.forward_topk(x, w[:, :1], i), "topk_weights"),
        (lambda m, x, w, i: m.forward_topk(x, w, i + 100), "not an expert"),
        (lambda m, x, w, i: m.forward_topk(x.int(), w, i), "hidden_states"),
        (lambda m, x, w, i: m(x, w), "router_logits"),
        (lambda m, x, w, i: m.forward_topk(x.numpy(), w, i), "torch.Tensor"),
    ],
)
def test_bad_arguments_name_the_argument(
    fixture_path: Callable[[str], Path], bad, match: str
) -> None:  # type: ignore[no-untyped-def]
    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w8a16_g128"), 0)
    x = torch.randn(4, moe.hidden_size)
    w, ids = random_routing(4, moe.num_experts, moe.top_k)
    with pytest.raises(mq.MoeqError, match=match):
        bad(moe, x, w, ids)


def test_native_forward_takes_row_major_arrays_of_any_shape(
    fixture_path: Callable[[str], Path],
) -> None:
    """The native forward reads flat or [T, H] arrays alike and returns [T, H]; a
    column-major array (same bytes, other order) is refused, not misread."""
    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w8a16_g128"), 0)
    t, h = 6, moe.hidden_size
    x = torch.randn(t, h).numpy()
    w, ids = random_routing(t, moe.num_experts, moe.top_k)
    args = (w.numpy(), ids.to(torch.int64).numpy(), moe.top_k)
    flat = moe._core.forward_topk(x.reshape(-1), t, *args)
    rows = moe._core.forward_topk(x, t, *args)
    assert flat.shape == rows.shape == (t, h)
    assert np.array_equal(flat, rows) and np.isfinite(rows).all()
    with pytest.raises(mq.LayoutError, match="hidden_states"):
        moe._core.forward_topk(np.asfortranarray(x), t, *args)
    with pytest.raises(mq.LayoutError, match="hidden_states"):
        moe._core.forward_topk(x.astype(np.float64), t, *args)
    bits = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    assert moe._core.forward_topk(bits, t, *args).dtype == np.int16
    with pytest.raises(mq.LayoutError, match="topk_weights"):
        moe._core.forward_topk(x, t, np.asfortranarray(w.numpy()), *args[1:])


def _pack_u8_rows(u: np.ndarray) -> np.ndarray:
    """Stored 8-bit values ``[rows, cols]`` packed 4 per int32 along a row, LSB first."""
    words = np.zeros((u.shape[0], u.shape[1] // 4), dtype=np.uint32)
    for j in range(4):
        words |= u[:, j::4].astype(np.uint32) << np.uint32(8 * j)
    return words.view(np.int32)


def test_unsupported_layers_are_refused(tmp_path: Path) -> None:
    from synth import GROUP, quant_config, tensors, write_checkpoint

    # A well-formed asymmetric int8 checkpoint (8-bit packing, zero points packed along the
    # output dim as compressed-tensors stores them), so that the refusal is the scheme's.
    qc = quant_config()
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    rng = np.random.default_rng(3)
    replace = {}
    for name, t in tensors().items():
        if name.endswith(".weight_packed"):
            rows, cols = t.shape[0], t.shape[1] * 8
            replace[name] = torch.from_numpy(_pack_u8_rows(rng.integers(0, 256, size=(rows, cols))))
            zp = rng.integers(0, 256, size=(rows, cols // GROUP))
            replace[name.replace(".weight_packed", ".weight_zero_point")] = torch.from_numpy(
                _pack_u8_rows(zp.T).T.copy()
            )
    path = write_checkpoint(tmp_path / "m", qc=qc, replace=replace)
    layer = mq.plan(path)["moe_layers"][0]
    assert layer["weight"]["num_bits"] == 8 and layer["weight"]["symmetric"] is False
    assert layer["backend"] is None
    assert "asymmetric int8 weights are not supported" in layer["error"]
    with pytest.raises(mq.UnsupportedSchemeError, match=r"model\.layers\.0\.mlp .*asymmetric int8"):
        mq.MoELayer.from_checkpoint(path, 0)
    with pytest.raises(mq.CheckpointError, match="not an MoE layer"):
        mq.MoELayer.from_checkpoint(write_checkpoint(tmp_path / "ok"), 5)


def test_inference_mode_and_no_grad(fixture_path: Callable[[str], Path]) -> None:
    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w4a16_g128_sym"), 0)
    x = torch.randn(3, moe.hidden_size)
    w, ids = random_routing(3, moe.num_experts, moe.top_k)
    logits = torch.randn(3, moe.num_experts)
    b = moe.forward_topk(x, w, ids)
    with torch.inference_mode():
        a = moe.forward_topk(x, w, ids)
        c = moe(x, logits)
    assert a.is_inference() and c.is_inference()
    assert torch.equal(a, b), "the same result as outside inference mode"
    with torch.no_grad():
        d = moe.forward_topk(x, w, ids)
        e = moe(x, logits)
    assert not d.requires_grad and not e.requires_grad and d.grad_fn is None
    assert torch.equal(d, b) and torch.equal(e, c)


def stack_from_checkpoint(ckpt: mq.Checkpoint, layer: int, scheme: str) -> dict:
    """Raw from_tensors inputs built from a fixture layer's stored tensors."""
    info = next(x for x in ckpt.moe_layers() if x["layer"] == layer)
    p = info["prefix"] + ".experts"
    e = info["num_experts"]

    def t(name: str) -> torch.Tensor:
        return ckpt.tensor(name, "torch")

    def weights(m: str) -> torch.Tensor:
        if scheme.startswith("w8a8"):
            return t(f"{m}.weight")
        packed = t(f"{m}.weight_packed")
        if scheme == "w4a16":
            return packed
        # int8 codes = stored bytes - 128
        return (packed.view(torch.uint8).to(torch.int16) - 128).to(torch.int8)

    out: dict = {
        "w13": [],
        "w2": [],
        "w13_scale": [],
        "w2_scale": [],
        "zp13": [],
        "zp2": [],
        "a13": [],
        "a2": [],
    }
    for i in range(e):
        g, u, d = (f"{p}.{i}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
        out["w13"].append(torch.cat([weights(g), weights(u)]))
        out["w2"].append(weights(d))
        out["w13_scale"].append(torch.cat([t(f"{g}.weight_scale"), t(f"{u}.weight_scale")]))
        out["w2_scale"].append(t(f"{d}.weight_scale"))
        if ckpt.module(g)["has_zero_point"]:
            out["zp13"].append(
                torch.cat([t(f"{g}.weight_zero_point"), t(f"{u}.weight_zero_point")])
            )
            out["zp2"].append(t(f"{d}.weight_zero_point"))
        if ckpt.module(g)["has_input_scale"]:
            out["a13"].append(t(f"{g}.input_scale").float())
            out["a2"].append(t(f"{d}.input_scale").float())
    stacked = {k: torch.stack(v) if v else None for k, v in out.items()}
    return stacked


@pytest.mark.parametrize(
    "name,scheme,group",
    [
        ("qwen3_w8a8_dynamic", "w8a8_dynamic", -1),
        ("qwen3_w8a8_static", "w8a8_static", -1),
        ("qwen3_w8a16_g128", "w8a16", 128),
        ("qwen3_w8a16_channel", "w8a16", -1),
        ("qwen3_w4a16_g128_sym", "w4a16", 128),
        ("qwen3_w4a16_g128_asym", "w4a16", 128),
    ],
)
def test_from_tensors_equals_from_checkpoint(
    fixture_path: Callable[[str], Path], name: str, scheme: str, group: int
) -> None:
    ckpt = mq.open(fixture_path(name))
    s = stack_from_checkpoint(ckpt, 0, scheme)
    layer = mq.MoELayer.from_tensors(
        s["w13"],
        s["w2"],
        s["w13_scale"],
        s["w2_scale"],
        scheme=scheme,
        group_size=group,
        w13_zero_point=s["zp13"],
        w2_zero_point=s["zp2"],
        a13_scale=s["a13"],
        a2_scale=s["a2"],
        top_k=2,
    )
    ref = mq.MoELayer.from_checkpoint(ckpt, 0)
    x = torch.randn(11, 256)
    w, ids = random_routing(11, 8, 2)
    got = layer.forward_topk(x, w, ids)
    assert torch.equal(got, ref.forward_topk(x, w, ids))
    functional = mq.fused_moe(
        x,
        s["w13"],
        s["w2"],
        s["w13_scale"],
        s["w2_scale"],
        w,
        ids,
        scheme=scheme,
        group_size=group,
        w13_zero_point=s["zp13"],
        w2_zero_point=s["zp2"],
        a13_scale=s["a13"],
        a2_scale=s["a2"],
    )
    assert torch.equal(functional, got)
    # forward() routes with softmax top-k, renormalised.
    logits = torch.randn(11, 8)
    wr, idr = torch.softmax(logits, -1).topk(2, dim=-1)
    wr = wr / wr.sum(-1, keepdim=True)
    assert rel_l2(layer(x, logits), layer.forward_topk(x, wr, idr)) < 1e-6


def _words(*shape: int) -> torch.Tensor:
    """Random int32 words: eight 4-bit codes each, as compressed-tensors packs them."""
    return torch.randint(-(2**31), 2**31, shape, dtype=torch.int64).to(torch.int32)


def _raw_dequant(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, int4: bool):
    """fp64 ``[E, N, K]`` weights from from_tensors' raw arguments, unpacked here with the
    compressed-tensors packing (tests/marlin_ref.py): ``(q - zp) * scale`` per group."""
    e, n = q.shape[0], q.shape[1]
    if int4:
        k = q.shape[2] * 8
        codes = torch.stack(
            [
                torch.from_numpy(ct_unpack_rows(q[x].numpy(), 4, k).astype(np.int64)) - 8
                for x in range(e)
            ]
        )
    else:
        k = q.shape[2]
        codes = q.to(torch.int64)
    s = scale.double() if scale.dim() == 3 else scale.double().unsqueeze(-1)
    groups = s.shape[-1]
    w = codes.double().view(e, n, groups, k // groups)
    if zp is not None:
        z = torch.stack(
            [
                torch.from_numpy(ct_unpack_zero_points(zp[x].numpy(), 4, n).astype(np.int64)).t()
                - 8
                for x in range(e)
            ]
        )
        w = w - z.double().unsqueeze(-1)
    return (w * s.unsqueeze(-1)).view(e, n, k)


@pytest.mark.parametrize(
    "scheme,group,asym",
    [
        ("w8a16", 32, False),
        ("w8a16", 64, False),
        ("w8a16", -1, False),
        ("w4a16", 32, False),
        ("w4a16", 64, True),
        ("w4a16", -1, True),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_weight_only_layers_match_an_fp64_reference(
    scheme: str, group: int, asym: bool, dtype: torch.dtype
) -> None:
    """Group sizes 32/64 and channelwise, symmetric and asymmetric, with fp32, bf16 and fp16
    activations (the fixtures hold group 128 and channelwise only): from_tensors' forward
    against an fp64 MoE on weights dequantised here from the raw arguments."""
    e, h, i, k, t = 4, 128, 64, 2, 9
    int4 = scheme == "w4a16"
    g13, g2 = (1, 1) if group == -1 else (h // group, i // group)
    if int4:
        w13, w2 = _words(e, 2 * i, h // 8), _words(e, h, i // 8)
    else:
        w13 = torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8)
        w2 = torch.randint(-128, 128, (e, h, i), dtype=torch.int8)
    s13, s2 = torch.rand(e, 2 * i, g13) * 0.02 + 1e-3, torch.rand(e, h, g2) * 0.02 + 1e-3
    zp13 = zp2 = None
    if asym:
        zp13, zp2 = _words(e, 2 * i // 8, g13), _words(e, h // 8, g2)
    moe = mq.MoELayer.from_tensors(
        w13,
        w2,
        s13,
        s2,
        scheme=scheme,
        group_size=group,
        w13_zero_point=zp13,
        w2_zero_point=zp2,
        top_k=k,
    )
    x = torch.randn(t, h).to(dtype)
    w, ids = random_routing(t, e, k)
    got = moe.forward_topk(x, w, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    d13, d2 = _raw_dequant(w13, s13, zp13, int4), _raw_dequant(w2, s2, zp2, int4)
    xd, want = x.double(), torch.zeros(t, h, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            ex = int(ids[tok, j])
            gate, up = (d13[ex] @ xd[tok]).split(i)
            want[tok] += float(w[tok, j]) * (d2[ex] @ (torch.nn.functional.silu(gate) * up))
    assert rel_l2(got, want) <= (5e-3 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:
        assert rel_l2(got, want) <= 1e-5  # fp32 compute on the exact weights


def test_from_tensors_rejects_bad_inputs() -> None:
    e, i, h = 2, 64, 128
    w13 = torch.randint(-128, 127, (e, 2 * i, h), dtype=torch.int8)
    w2 = torch.randint(-128, 127, (e, h, i), dtype=torch.int8)
    s13, s2 = torch.rand(e, 2 * i, 1), torch.rand(e, h, 1)
    ok = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1)
    assert ok.num_experts == 2
    cases = [
        (dict(scheme="w9a9"), "scheme"),
        (dict(scheme="w4a16"), "w13: expected dtype torch.int32"),
        (dict(scheme="w8a8_static"), "a13_scale"),
        (dict(scheme="w8a16", group_size=32), "groups do not match"),
        (dict(scheme="w8a8_dynamic", top_k=5), "top_k"),
        # Sizes that would divide by zero, give negative group counts or pass a bool or a
        # float as an integer: each a LayoutError naming the argument.
        (dict(scheme="w8a16", group_size=0), "group_size: 0 must be -1 or divide"),
        (dict(scheme="w8a16", group_size=-2), "group_size: -2 must be -1 or divide"),
        (dict(scheme="w8a16", group_size=48), "group_size: 48 must be -1 or divide"),
        (dict(scheme="w8a16", group_size=True), "group_size: True"),
        (dict(scheme="w8a8_dynamic", top_k=-1), "top_k: -1 must be an integer"),
        (dict(scheme="w8a8_dynamic", top_k=1.0), "top_k: 1.0 must be an integer"),
        (dict(scheme="w8a8_dynamic", top_k=True), "top_k: True"),
        (dict(scheme="w8a8_dynamic", top_k=torch.tensor(True)), "top_k: tensor\\(True\\)"),
    ]
    for kwargs, match in cases:
        kw = {"scheme": "w8a8_dynamic", "top_k": 1} | kwargs
        with pytest.raises(mq.MoeqError, match=match):
            mq.MoELayer.from_tensors(w13, w2, s13, s2, **kw)
    # Integer scalars of numpy and torch are sizes too.
    g = mq.MoELayer.from_tensors(
        w13,
        w2,
        torch.rand(e, 2 * i, 4),
        torch.rand(e, h, 2),
        scheme="w8a16",
        group_size=np.int64(32),
        top_k=torch.tensor(2),
    )
    assert g.top_k == 2
    with pytest.raises(mq.LayoutError, match="w2: expected"):
        mq.MoELayer.from_tensors(w13, w2[:, :, :32], s13, s2, scheme="w8a8_dynamic", top_k=1)
    with pytest.raises(mq.LayoutError, match="w13: expected a contiguous"):
        mq.MoELayer.from_tensors(w13.transpose(1, 2), w2, s13, s2, scheme="w8a8_dynamic", top_k=1)
    # The device as torch spells it: the CPU in any of its forms; CUDA is not ready yet.
    for device in ("cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)):
        cpu = mq.MoELayer.from_tensors(
            w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1, device=device
        )
        assert cpu.num_experts == e
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(mq.CudaUnavailableError):
            mq.MoELayer.from_tensors(
                w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1, device=device
            )
    for device, match in [("meta", "MoELayer runs on the CPU"), ("gpu0", "not a device")]:
        with pytest.raises(mq.LayoutError, match=f"device={device!r}: {match}"):
            mq.MoELayer.from_tensors(
                w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1, device=device
            )


def test_from_checkpoint_takes_the_device_as_torch_spells_it(
    fixture_path: Callable[[str], Path],
) -> None:
    path = fixture_path("qwen3_w8a8_dynamic")
    x, logits = torch.randn(3, 256), torch.randn(3, 8)
    want = mq.MoELayer.from_checkpoint(path, 0)(x, logits)
    moe = mq.MoELayer.from_checkpoint(path, 0, device=torch.device("cpu"))
    assert torch.equal(moe(x, logits), want)
    with pytest.raises(mq.CudaUnavailableError):
        mq.MoELayer.from_checkpoint(path, 0, device=torch.device("cuda"))


def test_torch_compile_and_custom_ops(fixture_path: Callable[[str], Path]) -> None:
    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w8a8_dynamic"), 0)
    x = torch.randn(5, 256)
    w, ids = random_routing(5, 8, 2)
    logits = torch.randn(5, 8)
    eager = moe.forward_topk(x, w, ids)
    assert torch.equal(torch.ops.moeq.moe_forward_topk(x, w, ids, moe._handle), eager)
    compiled = torch.compile(moe.forward_topk, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, w, ids), eager)
    compiled_fwd = torch.compile(moe, backend="eager", fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled_fwd(x, logits), moe(x, logits))
    # The fake implementation gives shapes and dtypes without running the kernels.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = torch.empty(7, 256, dtype=torch.bfloat16)
        out = torch.ops.moeq.moe_forward_topk(
            fx,
            torch.empty(7, 2),
            torch.empty(7, 2, dtype=torch.int64),
            mode.from_tensor(moe._handle),
        )
        assert out.shape == (7, 256) and out.dtype == torch.bfloat16
        # The layer fakes its handle itself (it raised numpy's RuntimeError before).
        out = moe(fx, torch.empty(7, 8))
        assert out.shape == (7, 256) and out.dtype == torch.bfloat16
        assert isinstance(out, torch._subclasses.fake_tensor.FakeTensor)


def test_compiled_calls_name_bad_inputs_as_eager_ones_do(
    fixture_path: Callable[[str], Path],
) -> None:
    """Under ``torch.compile(fullgraph=True)`` a bad input is the same ``LayoutError`` naming the
    argument as in eager mode (a check raised while dynamo traced reached the caller as
    dynamo's ``Unsupported``; the op checks when it runs)."""
    moe = mq.MoELayer.from_checkpoint(fixture_path("qwen3_w8a16_g128"), 0)
    logits = torch.randn(3, 8)
    w, ids = random_routing(3, 8, 2)
    cases = [
        (lambda: moe(torch.randn(256, 3).t(), logits), "hidden_states: expected a contiguous"),
        (lambda: moe(torch.ones(3, 256, dtype=torch.int32), logits), "hidden_states: .*float"),
        (
            lambda: moe.forward_topk(torch.randn(3, 256), w, ids.to(torch.int16)),
            "topk_ids: expected int32 or int64",
        ),
    ]
    # fused_moe, whose fake implementation checks shapes outside torch.compile only.
    raw = _small_w8a16()
    fw, fids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    cases.append(
        (
            lambda: mq.fused_moe(torch.randn(3, 63), *raw, fw, fids, scheme="w8a16"),
            r"hidden_states: expected \[T, 64\]",
        )
    )
    for call, match in cases:
        with pytest.raises(mq.LayoutError, match=match):
            call()
        torch._dynamo.reset()
        with pytest.raises(mq.LayoutError, match=match), torch.no_grad():
            torch.compile(call, backend="eager", fullgraph=True)()


_ISA_SCRIPT = r"""
import sys, numpy as np, torch, moeq_rs as mq
from moeq_rs.moe import MoELayer
g = torch.Generator().manual_seed(7)
e, h, i, k = 12, 202, 72, 3
w13 = torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
w2 = torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g)
s13 = torch.rand(e, 2 * i, 1, generator=g) * 1e-2
s2 = torch.rand(e, h, 1, generator=g) * 1e-2
outs = []
for scheme, a13, a2 in [("w8a8_dynamic", None, None),
                        ("w8a8_static", torch.full((e,), 0.02), torch.full((e,), 0.05))]:
    layer = MoELayer.from_tensors(w13, w2, s13, s2, scheme=scheme, a13_scale=a13,
                                  a2_scale=a2, top_k=k)
    for t in (1, 5, 97):
        x = torch.randn(t, h, generator=g)
        logits = torch.randn(t, e, generator=g)
        outs.append(layer(x, logits).numpy().ravel())
# Weight-only layers (fp32 activations: the fp32 tiles of every family sum in one order).
hq, iq = 128, 64
q13 = torch.randint(-(2**31), 2**31 - 1, (e, 2 * iq, hq // 8), dtype=torch.int32, generator=g)
q2 = torch.randint(-(2**31), 2**31 - 1, (e, hq, iq // 8), dtype=torch.int32, generator=g)
weight_only = [
    (MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=k), h),
    (MoELayer.from_tensors(q13, q2, torch.rand(e, 2 * iq, hq // 32, generator=g) * 1e-2,
                           torch.rand(e, hq, iq // 32, generator=g) * 1e-2, scheme="w4a16",
                           group_size=32, top_k=k), hq),
]
for layer, width in weight_only:
    for t in (1, 2, 5, 97):
        x = torch.randn(t, width, generator=g)
        logits = torch.randn(t, e, generator=g)
        outs.append(layer(x, logits).numpy().ravel())
# An unquantized layer (fp32 dot products, one summation order in every family).
dense = mq.MoELayer.from_checkpoint(sys.argv[2], 1)
for t in (1, 9):
    x = torch.randn(t, dense.hidden_size, generator=g)
    outs.append(dense(x, torch.randn(t, dense.num_experts, generator=g)).numpy().ravel())
np.save(sys.argv[1], np.concatenate(outs))
print(mq.oracle.cpu_threads())
print(mq.oracle.cpu_kernel())
"""


def run_int8_script(out: Path, unquantized: Path, **env: str) -> tuple[np.ndarray, int, str]:
    """Runs _ISA_SCRIPT in a fresh process with `env` added, on the `unquantized` checkpoint's
    layer too: (outputs, threads, kernel)."""
    import os
    import subprocess
    import sys

    ran = subprocess.run(
        [sys.executable, "-c", _ISA_SCRIPT, str(out), str(unquantized)],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        check=True,
    )
    threads, kernel = ran.stdout.strip().splitlines()[-2:]
    return np.load(out), int(threads), kernel


_POISON_SCRIPT = r"""
import sys, numpy as np, torch, moeq_rs as mq
cases, out = sys.argv[1].split(","), []
for case in cases:
    path, layer = case.rsplit(":", 1)
    moe = mq.MoELayer.from_checkpoint(path, int(layer))
    g = torch.Generator().manual_seed(11)
    # Small after large, so buffers come back from earlier calls; bf16 for the bf16 paths.
    f32, bf16 = torch.float32, torch.bfloat16
    for t, dtype in ((37, f32), (5, bf16), (1, f32), (64, bf16), (2, f32)):
        x = torch.randn(t, moe.hidden_size, generator=g).to(dtype)
        logits = torch.randn(t, moe.num_experts, generator=g)
        out.append(moe(x, logits).float().numpy().ravel())
# The run's last value says whether the scratch really came poisoned.
out.append(np.array([float(mq._core._cpu_scratch_poisoned())], dtype=np.float32))
np.save(sys.argv[2], np.concatenate(out))
"""


def test_outputs_and_scratch_are_fully_written(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """With MOEQ_POISON_SCRATCH=1 every reused buffer (the output, the experts' rows, the
    gate/up scratch) starts as NaN instead of what an earlier call left: every fixture scheme,
    shared experts and DeepSeek-V3 routing included, at decode and prefill sizes, gives finite
    outputs bit-identical to a normal run, so no value is left unwritten."""
    import os
    import subprocess
    import sys

    cases = ",".join(f"{fixture_path(name)}:{layer}" for name, layer, _ in CASES)
    runs = {}
    for poison in ("0", "1"):
        dst = tmp_path / f"poison{poison}.npy"
        subprocess.run(
            [sys.executable, "-c", _POISON_SCRIPT, cases, str(dst)],
            env=dict(os.environ, MOEQ_POISON_SCRATCH=poison),
            check=True,
        )
        run = np.load(dst)
        assert run[-1] == (poison == "1"), f"MOEQ_POISON_SCRATCH={poison}: poisoning on?"
        runs[poison] = run[:-1]
    assert np.isfinite(runs["1"]).all()
    assert np.array_equal(runs["1"], runs["0"])


_CHUNK_SCRIPT = r"""
import sys, numpy as np, torch, moeq_rs as mq
out = {}
for n, case in enumerate(sys.argv[1].split(",")):
    path, layer = case.rsplit(":", 1)
    moe = mq.MoELayer.from_checkpoint(path, int(layer))
    g = torch.Generator().manual_seed(11)
    for t, dtype in ((37, torch.float32), (13, torch.bfloat16), (3, torch.float32)):
        x = torch.randn(t, moe.hidden_size, generator=g).to(dtype)
        logits = torch.randn(t, moe.num_experts, generator=g)
        kind = str(dtype).removeprefix("torch.")
        out[f"{n}/{t}/{kind}/forward"] = moe(x, logits).float().numpy()
        ids = torch.randint(0, moe.num_experts, (t, 2), generator=g)
        weights = torch.rand(t, 2, generator=g)
        out[f"{n}/{t}/{kind}/topk"] = moe.forward_topk(x, weights, ids).float().numpy()
np.savez(sys.argv[2], **out)
"""


def test_long_calls_split_into_chunks_give_the_same_outputs(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """MOEQ_CHUNK_TOKENS splits a call into chunks of that many tokens (bounding its memory),
    each a forward of its own tokens: every fixture scheme, routing, shared experts, forward
    and forward_topk, fp32 and bf16, with a chunk that does not divide the token count. W8A8
    and unquantized outputs equal the call whole bit for bit. Weight-only ones depend on each
    expert's row count, as for any two call sizes: with fp32 inputs they differ in the last
    bits only (the tiles' summation order); with bf16 inputs on a CPU with bf16 dot products
    an expert of 8 rows or more runs them, on its intermediate rounded to bf16, where a
    chunk's fewer rows run fp32 FMAs, so they differ by that rounding (2^-9 relative at
    most, before the output's own bf16 rounding), and from 32 rows (not reached here) by the
    weights' rounding to bf16 too. Under MOEQ_POISON_SCRATCH=1, so a row no chunk wrote
    would show as NaN."""
    import os
    import subprocess
    import sys

    cases = ",".join(f"{fixture_path(name)}:{layer}" for name, layer, _ in CASES)
    runs = {}
    for chunk in ("0", "5"):
        dst = tmp_path / f"chunk{chunk}.npz"
        subprocess.run(
            [sys.executable, "-c", _CHUNK_SCRIPT, cases, str(dst)],
            env=dict(os.environ, MOEQ_CHUNK_TOKENS=chunk, MOEQ_POISON_SCRATCH="1"),
            check=True,
        )
        runs[chunk] = np.load(dst)
    assert sorted(runs["0"].files) == sorted(runs["5"].files)
    assert len(runs["0"].files) == 6 * len(CASES)
    for key in runs["0"].files:
        n, t, kind, call = key.split("/")
        name, layer, mode = CASES[int(n)]
        whole, split = runs["0"][key], runs["5"][key]
        assert whole.shape == split.shape == (int(t), whole.shape[1]), key
        assert np.isfinite(split).all() and np.abs(split).max() > 0, (name, layer, key)
        if mode == "w8a8" or name == "qwen3_unquantized":
            assert np.array_equal(split, whole), (name, layer, key)
        else:
            rel = np.linalg.norm(split - whole) / np.linalg.norm(whole)
            assert rel < (1e-5 if kind == "float32" else 4e-3), (name, layer, key, rel)


_SUMMED_SCRIPT = r"""
import sys, numpy as np, torch, moeq_rs as mq
g = torch.Generator().manual_seed(5)
e, h, i, k, t = 8, 512, 64, 3, 1024
w13 = torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
w2 = torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g)
s13 = torch.rand(e, 2 * i, 1, generator=g) * 1e-2 + 1e-3
s2 = torch.rand(e, h, 1, generator=g) * 1e-2 + 1e-3
x = torch.randn(t, h, generator=g)
ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
weights = torch.rand(t, k, generator=g)
out = {}
for scheme in ("w8a8_dynamic", "w8a16"):
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme=scheme, top_k=k)
    for dtype in (torch.float32, torch.bfloat16):
        y = layer.forward_topk(x.to(dtype), weights, ids)
        out[f"{scheme}/{str(dtype).removeprefix('torch.')}"] = y.float().numpy()
# The weight-only reference: fp64 on the exact weights, the inputs as each call saw them.
d13, d2 = w13.double() * s13.double(), w2.double() * s2.double()
for dtype in (torch.float32, torch.bfloat16):
    xd, want = x.to(dtype).double(), torch.zeros(t, h, dtype=torch.float64)
    for ex in range(e):
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        gate, up = (xd[tok] @ d13[ex].T).split(i, dim=1)
        y = (torch.nn.functional.silu(gate) * up) @ d2[ex].T
        want.index_add_(0, tok, weights[tok, slot].double()[:, None] * y)
    out[f"want/{str(dtype).removeprefix('torch.')}"] = want.numpy()
np.savez(sys.argv[1], **out)
"""


def test_long_calls_summed_in_panels_equal_the_buffered_sum(tmp_path: Path) -> None:
    """A call whose routed rows' outputs would not stay in cache (1024 tokens x top-3 x 512
    hidden floats, 6 MiB, 1.5x the 4 MiB threshold; down inputs of 64, at most half what the
    rule allows, on 2 threads) runs its down projections in column panels, adding each
    token's weighted terms as its experts come, instead of through one buffer of every row's
    output. The same call in chunks of 100 tokens (0.6 MiB each) takes the buffer: the W8A8
    outputs are equal bit for bit (three terms per token, added in the same order: an order
    that differed would show in the last bits), and the weight-only ones match an fp64 MoE
    on the exact weights. Under MOEQ_POISON_SCRATCH=1, so a value the panels left unwritten
    would show as NaN."""
    runs = {}
    for chunk in ("0", "100"):
        dst = tmp_path / f"summed{chunk}.npz"
        env = dict(os.environ, MOEQ_CHUNK_TOKENS=chunk, MOEQ_POISON_SCRATCH="1")
        env["MOEQ_NUM_THREADS"] = "2"
        subprocess.run([sys.executable, "-c", _SUMMED_SCRIPT, str(dst)], env=env, check=True)
        runs[chunk] = np.load(dst)
    whole, split = runs["0"], runs["100"]
    for kind in ("float32", "bfloat16"):
        a, b = whole[f"w8a8_dynamic/{kind}"], split[f"w8a8_dynamic/{kind}"]
        assert np.isfinite(a).all() and np.abs(a).max() > 0, kind
        assert np.array_equal(a, b), kind
        want = torch.from_numpy(whole[f"want/{kind}"])
        for run in (whole, split):
            got = torch.from_numpy(run[f"w8a16/{kind}"])
            assert torch.isfinite(got).all(), kind
            assert rel_l2(got, want) <= (1e-5 if kind == "float32" else 1e-2), kind


_CHUNK_MEMORY_SCRIPT = r"""
import sys
import torch
import moeq_rs as mq
from moeq_rs.moe import MoELayer


def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024


g = torch.Generator().manual_seed(3)
e, h, i, k, t = 8, 512, int(sys.argv[1]), 8, 16384
w13 = torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
w2 = torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g)
layer = MoELayer.from_tensors(w13, w2, torch.rand(e, 2 * i, 1, generator=g) * 1e-2,
                              torch.rand(e, h, 1, generator=g) * 1e-2, scheme="w8a8_dynamic",
                              top_k=k)
layer(torch.randn(4, h), torch.randn(4, e))
x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
weights = torch.rand(t, k, generator=g)


def growth(call):
    # From empty spares: what one call kept would serve the next.
    mq.oracle.cpu_release_scratch()
    before = status("VmRSS")
    # The peak from here on: "5" resets the high-water mark to the current size (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    y = call()
    assert torch.isfinite(y).all()
    return status("VmHWM") - before


print(growth(lambda: layer(x, logits)), growth(lambda: layer.forward_topk(x, weights, ids)))
"""


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset"
)
@pytest.mark.parametrize("inter", [128, 640])
def test_chunks_bound_a_long_calls_memory(inter: int) -> None:
    """A 16384-token call of a top-8 layer (hidden 512) holds hundreds of MiB whole; in chunks
    of 1024 tokens its peak grows by a part of that: forward and forward_topk alike. With
    down inputs of 640 the call sums its 131072 routed rows through a buffer of their outputs
    (256 MiB); with 128 it sums them in column panels, holding the experts' down inputs and
    the panels' sums instead (the chunks, 16 MiB of routed outputs each, too), so less
    whole."""
    import os
    import subprocess
    import sys

    growth: dict[str, list[float]] = {}
    for chunk in ("0", "1024"):
        ran = subprocess.run(
            [sys.executable, "-c", _CHUNK_MEMORY_SCRIPT, str(inter)],
            env=dict(os.environ, MOEQ_CHUNK_TOKENS=chunk, MOEQ_NUM_THREADS="2"),
            capture_output=True,
            text=True,
            check=True,
        )
        growth[chunk] = [float(v) for v in ran.stdout.split()[-2:]]
    for whole, split in zip(growth["0"], growth["1024"], strict=True):
        if inter == 640:
            assert whole > 300, growth
            assert split < whole - 200, growth
        else:
            assert whole > 150, growth
            assert split < 0.6 * whole, growth


def test_every_cpu_kernel_gives_identical_int8_results(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """W8A8 (dynamic and static), W8A16 and W4A16 outputs with fp32 activations are
    bit-identical whichever kernel family runs (integer accumulators equal, same epilogue; the
    fp32 tiles in one summation order), in decode (panel-parallel) and prefill
    (expert-parallel) shapes; so are an unquantized layer's (fp32 dot products)."""
    results = {}
    dense = fixture_path("qwen3_unquantized")
    for cap in ("scalar", "avx2", "avx_vnni", "avx512", "avx512_vnni", "amx_int8"):
        got, _, used = run_int8_script(tmp_path / f"{cap}.npy", dense, MOEQ_CPU_ISA=cap)
        results[used] = got
    assert "scalar" in results
    assert len(results) >= 2 or mq.oracle.cpu_kernel() == "scalar"
    reference = results.pop("scalar")
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    for name, got in results.items():
        assert np.array_equal(got, reference), name


def test_thread_count_is_honoured_and_results_do_not_depend_on_it(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """MOEQ_NUM_THREADS sets the pool; one and three threads give bit-identical outputs."""
    dense = fixture_path("qwen3_unquantized")
    one, n1, _ = run_int8_script(tmp_path / "t1.npy", dense, MOEQ_NUM_THREADS="1")
    three, n3, _ = run_int8_script(tmp_path / "t3.npy", dense, MOEQ_NUM_THREADS="3")
    assert (n1, n3) == (1, 3)
    assert np.array_equal(one, three)


_THREADS_SCRIPT = r"""
import threading, numpy as np, torch
from moeq_rs.moe import MoELayer
g = torch.Generator().manual_seed(11)
e, h, i, k = 10, 130, 48, 3
layer = MoELayer.from_tensors(
    torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
    torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g),
    torch.rand(e, 2 * i, 1, generator=g) * 1e-2, torch.rand(e, h, 1, generator=g) * 1e-2,
    scheme="w8a8_dynamic", top_k=k)
inputs = [(torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)) for t in (1, 7, 64)]
def run():
    return [layer(x, lg).numpy().copy() for x, lg in inputs]
first = []
early = threading.Thread(target=lambda: first.append(run()))  # a short-lived thread first
early.start()
early.join()
main = run()  # the main thread (which joined the forward's threads when it built the layer)
assert all(np.array_equal(a, b) for a, b in zip(first[0], main))
seen = {}
def worker(name):
    for _ in range(5):
        seen.setdefault(name, []).append(run())
threads = [threading.Thread(target=worker, args=(n,)) for n in ("a", "b")]
for t in threads:
    t.start()
again = [run() for _ in range(5)]  # the owner, while the other threads run too
for t in threads:
    t.join()
for outs in again + seen["a"] + seen["b"]:
    for got, want in zip(outs, main):
        assert np.array_equal(got, want)
print("ok", len(seen["a"]) + len(seen["b"]) + len(again))
"""


@pytest.mark.parametrize("how", ["set_", "resize_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_changed_by_another_thread_during_a_forward(how: str, dtype: torch.dtype) -> None:
    """The forward read the input tensor after releasing the GIL: another Python thread that
    `set_` or `resize_`d it then made the forward read freed memory (a segfault, or garbage
    once the memory was reused). Inputs are copied first, so the result is the one of the
    tensor as it was at the call. (The other thread waits 10 ms: a torch operator already
    running when the call starts may change the tensor under any reader, torch's own too.)"""
    import sys
    import threading
    import time

    e, h, i, t = 8, 1024, 64, 4096  # x is 16 MiB: its own mapping, unmapped when freed
    g = torch.Generator().manual_seed(0)
    moe = mq.MoELayer.from_tensors(
        torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
        torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g),
        torch.rand(e, 2 * i, 1, generator=g) / 1e3,
        torch.rand(e, h, 1, generator=g) / 1e3,
        scheme="w8a16",
        top_k=8,
    )
    logits = torch.randn(t, e, generator=g)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10)  # this thread keeps the GIL until the forward releases it
    try:
        for _ in range(3):
            x = torch.randn(t, h, generator=g).to(dtype)
            want = moe(x.clone(), logits)
            go = threading.Event()

            def other(x: torch.Tensor = x, go: threading.Event = go) -> None:
                go.wait()
                time.sleep(0.01)
                if how == "set_":
                    x.set_()
                else:
                    x.resize_(4 * t, h)

            th = threading.Thread(target=other)
            th.start()
            go.set()
            # On a loaded machine the other thread may still come first: then x is empty or
            # resized when the call reads it, a LayoutError naming the argument.
            try:
                got = moe(x, logits)
            except mq.LayoutError as err:
                assert re.search("hidden_states|router_logits", str(err))
                th.join()
                continue
            th.join()
            assert torch.equal(got, want)
    finally:
        sys.setswitchinterval(interval)


def test_forward_from_other_threads_equals_the_owner_thread() -> None:
    """The main thread becomes one of the forward's threads when it builds the layer; other
    threads (a short-lived one before its first forward, two running at the same time as it)
    use the shared pool. Every call gives the same bits."""
    import os
    import subprocess
    import sys

    for threads in ("1", "2", "3"):
        ran = subprocess.run(
            [sys.executable, "-c", _THREADS_SCRIPT],
            env=dict(os.environ, MOEQ_NUM_THREADS=threads),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.split() == ["ok", "15"]


def _random_int8_layer(seed: int, top_k: int, inter: int = 128) -> str:
    """Script lines that build ``layer``, a random dynamic-W8A8 layer (E 8, H 256, I ``inter``),
    with ``torch``, ``mq`` (moeq_rs), the generator ``g`` and the sizes ``e, h, i`` in scope."""
    return rf"""
import torch, moeq_rs as mq
g = torch.Generator().manual_seed({seed})
e, h, i = 8, 256, {inter}
layer = mq.MoELayer.from_tensors(
    torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
    torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g),
    torch.rand(e, 2 * i, 1, generator=g) * 1e-2, torch.rand(e, h, 1, generator=g) * 1e-2,
    scheme="w8a8_dynamic", top_k={top_k})
"""


_NO_THREADS_SCRIPT = (
    _random_int8_layer(seed=4, top_k=2)
    + r"""
import resource, sys, threading
x, logits = torch.randn(100, h, generator=g), torch.randn(100, e, generator=g)
weights, ids = torch.softmax(logits, -1).topk(2, dim=-1)
# On the main thread's own pool.
want = [layer(x, logits), layer.forward_topk(x, weights, ids)]
got, failed = [], []
go = threading.Event()
def worker():
    go.wait()
    try:
        # The shared pool for other threads starts now, and cannot.
        got.extend([layer(x, logits), layer.forward_topk(x, weights, ids)])
    except BaseException as err:
        failed.append(f"{type(err).__module__}.{type(err).__name__}: {err}")
t = threading.Thread(target=worker)
t.start()
# No room for a new thread's stack from here on (RLIMIT_NPROC would not bind root).
with open("/proc/self/status") as status:
    vm = next(int(l.split()[1]) for l in status if l.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 10), resource.RLIM_INFINITY))
try:
    threading.Thread(target=lambda: None).start()
    sys.exit("threads were not refused")
except RuntimeError:
    pass
go.set()
t.join()
assert not failed, failed
assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
print("ok")
"""
)


def test_forward_runs_when_the_os_refuses_new_threads() -> None:
    """A forward on another thread than the main one, when the OS refuses new threads (a
    container's pids limit, RLIMIT_NPROC, address space) and the pool for such threads cannot
    start: it runs on the calling thread alone, with the same bits. It used to raise pyo3's
    PanicException (rayon's global pool could not start either), which `except Exception`
    does not catch."""
    import os
    import subprocess
    import sys

    ran = subprocess.run(
        [sys.executable, "-c", _NO_THREADS_SCRIPT],
        env=dict(os.environ, MOEQ_NUM_THREADS="2", RUST_BACKTRACE="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0 and ran.stdout.split() == ["ok"], ran.stdout + ran.stderr
    assert "panicked" not in ran.stderr, ran.stderr


_POOL_SCRIPT = r"""
import collections, os, sys, time, torch
import moeq_rs as mq
torch.set_num_threads(1)  # no OpenMP team: every new thread is ours
def names():
    tasks = os.listdir("/proc/self/task")
    return collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
def new_threads():
    # A new thread names itself once it runs: wait (up to 5 s) until every new one has.
    for _ in range(50):
        new = names() - start
        if "python" not in new:
            break
        time.sleep(0.1)
    return sorted(new.elements())
start = names()
layer = None
if sys.argv[1] == "checkpoint":
    ckpt = mq.open(sys.argv[2])
    layer = mq.MoELayer.from_checkpoint(ckpt, 1)
elif sys.argv[1] == "marlin":  # a Marlin repack of bare arrays, parallel in Rust
    import numpy as np
    q = np.arange(16 * 256, dtype=np.int64).astype(np.int32).reshape(16, 256)
    assert mq.repack.gptq_marlin_repack(q, np.empty(0, np.int32), 128, 256, 4).size == q.size
else:
    g = torch.Generator().manual_seed(2)
    e, h, i = 6, 64, 32
    layer = mq.MoELayer.from_tensors(
        torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
        torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g),
        torch.rand(e, 2 * i, 1) * 1e-2, torch.rand(e, h, 1) * 1e-2, scheme="w8a8_dynamic", top_k=2)
if layer is not None:
    layer(torch.randn(5, layer.hidden_size), torch.randn(5, layer.num_experts))
time.sleep(0.2)  # time for any other thread to appear
print(" ".join(new_threads()))
"""


@pytest.mark.parametrize("how", ["checkpoint", "tensors", "marlin"])
def test_opening_and_packing_run_on_the_forward_threads(
    fixture_path: Callable[[str], Path], how: str
) -> None:
    """Opening a checkpoint, packing a layer and running it (or a Marlin repack) from the main
    thread start the forward's MOEQ_NUM_THREADS - 1 workers and no other thread (no pool of
    their own that would then idle)."""
    import os
    import subprocess
    import sys

    for threads in ("2", "3"):
        ran = subprocess.run(
            [sys.executable, "-c", _POOL_SCRIPT, how, str(fixture_path("qwen3_w8a8_dynamic"))],
            env=dict(os.environ, MOEQ_NUM_THREADS=threads),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr
        want = [f"moeq-cpu-main-{n}" for n in range(1, int(threads))]
        assert ran.stdout.split() == want


def _torch_uses_libgomp() -> bool:
    with open("/proc/self/maps") as maps:
        return any("libgomp" in line for line in maps)


def test_parking_torch_openmp_threads_changes_no_result() -> None:
    """A forward on the main thread parks its idle OpenMP threads (torch's) while it runs, so
    they do not spin on the CPUs its workers need; on or off, every output is the same."""
    from moeq_rs import _core

    g = torch.Generator().manual_seed(5)
    e, h, i, k = 12, 96, 64, 4
    layer = mq.MoELayer.from_tensors(
        torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
        torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g),
        torch.rand(e, 2 * i, 1, generator=g) * 1e-2,
        torch.rand(e, h, 1, generator=g) * 1e-2,
        scheme="w8a8_dynamic",
        top_k=k,
    )
    inputs = [(torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)) for t in (1, 9, 70)]
    inputs.append((torch.randn(300, h, generator=g).bfloat16(), torch.randn(300, e, generator=g)))
    ids = torch.randint(0, e, (5, k), generator=g)
    weights = torch.rand(5, k, generator=g)
    torch_threads = torch.get_num_threads()
    can_park = _torch_uses_libgomp() and mq.oracle.cpu_threads() > 1
    try:
        torch.set_num_threads(2)
        layer(*inputs[0])  # the main thread joined the forward's threads with from_tensors
        outputs: dict[bool, list[torch.Tensor]] = {}
        spin = torch.ones(1 << 20)
        for on in (True, False):
            assert _core.cpu_park_openmp(on) is (on and can_park)
            before = _core.cpu_parked_regions()
            outputs[on] = []
            for x, lg in inputs:
                spin.sum()  # torch's team runs, then spins: a forward now parks it
                outputs[on].append(layer(x, lg))
            spin.sum()
            outputs[on].append(layer.forward_topk(inputs[1][0][:5], weights, ids))
            parked = _core.cpu_parked_regions() - before
            assert parked > 0 if on and can_park else parked == 0
        for a, b in zip(outputs[True], outputs[False], strict=True):
            assert torch.isfinite(a).all() and a.abs().max() > 0
            assert torch.equal(a, b)
        assert mq.oracle.cpu_park_openmp(True) is can_park  # the public form
        with pytest.raises(TypeError, match="on"):
            mq.oracle.cpu_park_openmp(1)  # type: ignore[arg-type]
        torch.set_num_threads(1)
        assert _core.cpu_park_openmp() is False, "a team of one has nothing to park"
    finally:
        torch.set_num_threads(torch_threads)
        _core.cpu_park_openmp(True)


def _layer_script(seed: int, e: int, h: int, i: int, k: int) -> str:
    """The start of a subprocess script: torch on two threads and a W8A8 `layer`."""
    return rf"""
import os, threading, time, torch
import moeq_rs as mq
from moeq_rs import _core
torch.set_num_threads(2)
g = torch.Generator().manual_seed({seed})
e, h, i, k = {e}, {h}, {i}, {k}
layer = mq.MoELayer.from_tensors(
    torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
    torch.randint(-128, 128, (e, h, i), dtype=torch.int8, generator=g),
    torch.rand(e, 2 * i, 1, generator=g) * 1e-2, torch.rand(e, h, 1, generator=g) * 1e-2,
    scheme="w8a8_dynamic", top_k=k)
"""


_PARKING_SCRIPT = (
    _layer_script(3, 16, 1024, 512, 4)
    + r"""
x, logits = torch.randn(256, h, generator=g), torch.randn(256, e, generator=g)
layer(x, logits)  # the main thread joined the forward's threads with from_tensors
other = []
t = threading.Thread(target=lambda: other.append(_core.cpu_park_openmp()))
t.start()
t.join()
print("main", _core.cpu_park_openmp(), "other", other[0])
# A forward right after a torch operator parks (the team spins) unless the team sleeps at
# once (OMP_WAIT_POLICY=passive): count the parked ones of ten.
before = _core.cpu_parked_regions()
for _ in range(10):
    torch.ones(1 << 22).sum()
    time.sleep(float(os.environ.get("SETTLE_MS", "0")) / 1e3)
    layer(x, logits)
print("parked_after_torch", _core.cpu_parked_regions() - before)
if os.environ.get("SAMPLE"):
    main_tid = threading.get_native_id()

    def openmp_running(me):
        # Threads other than the main one, this one and ours (moeq-cpu-*) that are on a CPU.
        n = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) in (main_tid, me):
                continue
            try:
                comm = open(f"/proc/self/task/{tid}/comm").read()
                state = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            n += not comm.startswith("moeq-cpu") and state == "R"
        return n

    def share_running(on):
        _core.cpu_park_openmp(on)
        torch.ones(1 << 22).sum()  # torch's team runs, then spins (OMP_WAIT_POLICY=active)
        seen, stop = [], threading.Event()

        def watch():
            me = threading.get_native_id()
            while not stop.is_set():
                seen.append(openmp_running(me) > 0)
                time.sleep(0.0005)

        w = threading.Thread(target=watch)
        w.start()
        start = time.perf_counter()
        while time.perf_counter() - start < 0.4:
            layer(x, logits)
        stop.set()
        w.join()
        return sum(seen) / max(len(seen), 1)

    print("parked", share_running(True), "unparked", share_running(False))
"""
)


def _run_parking_script(**env: str) -> list[str]:
    import os
    import subprocess
    import sys

    # GOMP_SPINCOUNT would override OMP_WAIT_POLICY.
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    ran = subprocess.run(
        [sys.executable, "-c", _PARKING_SCRIPT],
        env=dict(base, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split()


def test_parking_puts_torch_openmp_threads_to_sleep_during_a_forward() -> None:
    """With torch's idle threads set to spin forever, a thread of its team is seen on a CPU in
    most samples taken while forwards run unparked, and in few while they run parked (the
    samples also fall between forwards, when the team is released). Only the main thread
    parks: another thread may have no OpenMP team, which a region would create."""
    if not _torch_uses_libgomp():
        assert _run_parking_script(MOEQ_NUM_THREADS="2")[:4] == ["main", "False", "other", "False"]
        pytest.skip("checked that nothing parks; torch here has no libgomp team to park")
    # `always`: no backing off after a costly park (the sampler keeps the machine busy).
    out = _run_parking_script(
        MOEQ_NUM_THREADS="2", OMP_WAIT_POLICY="active", SAMPLE="1", MOEQ_PARK_OPENMP="always"
    )
    assert out[:6] == ["main", "True", "other", "False", "parked_after_torch", "10"]
    parked, unparked = float(out[7]), float(out[9])
    # Unparked, the spinner is always running or waiting to run. Parked, it is seen only
    # between forwards and at a region's start and end (2-6% on a quiet machine, ~40% with
    # a build running on both CPUs, when it waits long for a CPU to reach its futex).
    assert unparked > 0.8, out
    assert parked < unparked - 0.3, out


def test_a_sleeping_openmp_team_is_not_woken_to_be_parked() -> None:
    """With torch's idle threads sleeping at once, a forward after a torch operator finds its
    team asleep (their CPU clocks stand still, none is runnable) and runs without a region
    (before any park, no thread is seen on a CPU, so none is created to learn the team)."""
    if not _torch_uses_libgomp():
        pytest.skip("torch here has no libgomp team")
    # 20 ms for the team to reach its sleep even when the machine is busy (a thread still on
    # its way there is runnable, and is rightly parked).
    out = _run_parking_script(MOEQ_NUM_THREADS="2", OMP_WAIT_POLICY="passive", SETTLE_MS="20")
    assert out[:5] == ["main", "True", "other", "False", "parked_after_torch"]
    assert int(out[5]) <= 2, out


def test_parking_can_be_switched_off_and_needs_two_threads() -> None:
    expected = "True" if _torch_uses_libgomp() else "False"
    assert _run_parking_script(MOEQ_NUM_THREADS="2")[:2] == ["main", expected]
    assert _run_parking_script(MOEQ_NUM_THREADS="2", MOEQ_PARK_OPENMP="0")[:2] == ["main", "False"]
    assert _run_parking_script(MOEQ_NUM_THREADS="1")[:2] == ["main", "False"]


_FORK_SCRIPT = (
    _layer_script(1, 8, 64, 32, 2)
    + r"""
x, lg = torch.randn(3, h, generator=g), torch.randn(3, e, generator=g)
torch.ones(1 << 22).sum()  # the parent's OpenMP team now exists; no forward before the fork
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    out = layer(x, lg)
    os.write(write, f"{bool(torch.isfinite(out).all())} {_core.cpu_park_openmp()}".encode())
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.read(read, 100).decode(), status)
"""
)


def test_a_forked_child_never_parks_its_inherited_openmp_team() -> None:
    """A child forked after torch ran a parallel operator inherits libgomp's record of the
    parent's team but not its threads: a parallel region there would wait forever. Its forward
    runs unparked and returns."""
    assert _two_thread_script(_FORK_SCRIPT) == ["True", "False", "0"]


_NO_TEAM_SCRIPT = (
    _layer_script(4, 8, 1024, 512, 2)
    + r"""
def threads():
    return len(os.listdir("/proc/self/task"))

x, lg = torch.randn(256, h, generator=g), torch.randn(256, e, generator=g)
before = threads()  # torch has run no parallel operator: it has no OpenMP team yet
want = layer(x, lg)
after = threads()
pid = os.fork()
if pid == 0:
    ok = torch.equal(layer(x, lg), want)
    ok = ok and bool(torch.isfinite((x + 1).sum()))  # a parallel torch operator
    os._exit(0 if ok else 1)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    status = "hung"
print(after - before, status)
"""
)


def test_a_forward_creates_no_openmp_team_so_forked_children_can_run_torch() -> None:
    """The first forward parked torch's OpenMP team without knowing whether one existed, and a
    parallel region where torch had made none created its threads: the process then had a
    team that a forked child does not, so the child's own parallel torch operators hung (found
    by a review helper; as after any parallel torch operator in the parent, but here moeq_rs
    made it). A first park now waits until some other thread is seen spinning."""
    assert _two_thread_script(_NO_TEAM_SCRIPT) == ["0", "0"]


def _two_thread_script(script: str) -> list[str]:
    """The words `script` prints, run in a fresh process with MOEQ_NUM_THREADS=2."""
    import os

    ran = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, MOEQ_NUM_THREADS="2"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.split()


_FORK_SIDE_THREAD_SCRIPT = (
    _layer_script(2, 8, 64, 32, 2)
    + r"""
x, lg = torch.randn(3, h, generator=g), torch.randn(3, e, generator=g)
want = layer(x, lg)
# A call from another thread starts the pool for threads other than the main one.
side = threading.Thread(target=layer, args=(x, lg))
side.start()
side.join()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    got = []
    t = threading.Thread(target=lambda: got.append(torch.equal(layer(x, lg), want)), daemon=True)
    t.start()
    t.join(60)
    os.write(write, f"{got}".encode())
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.read(read, 100).decode(), status)
"""
)


def test_a_forked_child_runs_forwards_from_other_threads() -> None:
    """The pool for calls from threads other than the main one was built once per process: a
    child forked after the parent used it inherited it without its threads, and a forward
    from any thread but the main one waited forever. The child builds its own."""
    assert _two_thread_script(_FORK_SIDE_THREAD_SCRIPT) == ["[True]", "0"]


_FORK_AFTER_OPEN_SCRIPT = r"""
import os, sys, time, torch
import moeq_rs as mq
torch.set_num_threads(2)
ckpt = mq.open(sys.argv[1])  # the parent opens a checkpoint (and builds a layer), then forks
if sys.argv[2] == "build":
    mq.MoELayer.from_checkpoint(ckpt, 0)
pid = os.fork()
if pid == 0:
    try:
        # A parallel torch operator first: the parent's loading created no OpenMP team
        # for the child to wait on.
        torch.ones(1 << 22).sum()
        layer = mq.MoELayer.from_checkpoint(sys.argv[1], 1)
        x = torch.randn(3, layer.hidden_size)
        out = layer(x, torch.randn(3, layer.num_experts))
        os._exit(0 if bool(torch.isfinite(out).all()) and out.abs().max() > 0 else 3)
    except BaseException:
        os._exit(4)
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("exit", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    print("hung")
"""


@pytest.mark.parametrize("parent", ["open", "build"])
def test_a_child_forked_after_opening_a_checkpoint_opens_packs_and_runs(
    fixture_path: Callable[[str], Path], parent: str
) -> None:
    """A forked child inherits the parent's thread pools but none of their threads. Opening a
    checkpoint once started rayon's global pool, and a child's parallel work then waited
    forever for its missing workers. Now the main thread is one of the pool's threads from the
    open on, so the child's work runs on it (alone) and returns. Loading a layer opens no
    OpenMP region, so a child's first parallel torch operator finds no team it lacks."""
    import os
    import subprocess
    import sys

    ran = subprocess.run(
        [
            sys.executable,
            "-c",
            _FORK_AFTER_OPEN_SCRIPT,
            str(fixture_path("qwen3_w8a8_dynamic")),
            parent,
        ],
        env=dict(os.environ, MOEQ_NUM_THREADS="2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["exit", "0"]


def test_moe_blocks_of_a_second_stack_are_set_aside(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3-Next and Qwen3.5 checkpoints may keep their multi-token-prediction layer as
    `mtp.layers.0.mlp.experts`, beside `model.layers.N.mlp.experts`: with a clashing number the
    checkpoint did not open, with another one the MTP block was loaded as a decoder layer. The
    stack with the most MoE layers is the model's; the other's blocks are listed (summary,
    inspect), not loaded, and left in source form by both repack targets; its dense MLPs are not
    the model's dense layers. The MTP copies here have their experts rotated, so loading one in
    place of the decoder layer would change the output. With as many MoE layers in both stacks,
    a clash is still an error naming both."""
    from moeq_rs.repack import repack_checkpoint

    src = fixture_path("qwen3_w4a16_g128_sym")
    experts = mq.open(src).moe_layers()[0]["num_experts"]

    def mtp_copy_of(layers: dict[int, int], dense: int | None = None) -> Callable[[dict], None]:
        """Copies decoder layer i's MoE block to mtp.layers.layers[i], experts rotated; and a
        dense MLP as mtp.layers.<dense>."""

        def edit(state: dict) -> None:
            for name in list(state):
                for i, j in layers.items():
                    head = f"model.layers.{i}.mlp."
                    if not name.startswith(head):
                        continue
                    rest = name.removeprefix(head)
                    if rest.startswith("experts."):
                        e, leaf = rest.removeprefix("experts.").split(".", 1)
                        rest = f"experts.{(int(e) + 1) % experts}.{leaf}"
                    state[f"mtp.layers.{j}.mlp.{rest}"] = state[name].clone()
            if dense is not None:
                for proj, shape in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
                    state[f"mtp.layers.{dense}.mlp.{proj}_proj.weight"] = torch.randn(shape)

        return edit

    x = torch.randn(8, mq.open(src).moe_layers()[0]["hidden_size"])
    logits = torch.randn(8, experts)
    want = mq.MoELayer.from_checkpoint(src, 0)(x, logits)
    assert mq.open(src).summary()["set_aside_moe"] == []
    for name, layers, aside in [
        ("clash", {0: 0}, ["mtp.layers.0.mlp"]),
        ("apart", {0: 2}, ["mtp.layers.2.mlp"]),
    ]:
        path = _edited_copy(src, tmp_path / name, tensors=mtp_copy_of(layers, dense=3))
        ckpt = mq.open(path)
        summary = ckpt.summary()
        assert summary["set_aside_moe"] == aside and summary["dense_layers"] == []
        assert [i["prefix"] for i in ckpt.moe_layers()] == [
            "model.layers.0.mlp",
            "model.layers.1.mlp",
        ]
        assert torch.equal(mq.MoELayer.from_checkpoint(ckpt, 0)(x, logits), want)
        out = _inspect(path)
        assert f"set aside: {aside[0]} (MoE blocks outside" in out and "dense:" not in out
        repack_checkpoint(path, tmp_path / f"{name}-cpu", target="cpu")
        repacked = mq.open(tmp_path / f"{name}-cpu")
        assert repacked.summary()["set_aside_moe"] == aside
        assert torch.equal(mq.MoELayer.from_checkpoint(repacked, 0)(x, logits), want)
        repack_checkpoint(path, tmp_path / f"{name}-marlin", target="marlin")
        marlin = mq.open(tmp_path / f"{name}-marlin")
        assert marlin.summary()["set_aside_moe"] == aside
        assert [i["layer"] for i in marlin.moe_layers()] == [0, 1]
    tie = _edited_copy(src, tmp_path / "tie", tensors=mtp_copy_of({0: 0, 1: 1}))
    with pytest.raises(mq.MoeqError, match="decoder layer 0 has experts under both"):
        mq.open(tie)

    # The rotation shows: decoder layer 0 with its experts rotated gives another output.
    def rotate(state: dict) -> None:
        mtp_copy_of({0: 0})(state)
        for name in [n for n in state if n.startswith("model.layers.0.mlp.experts.")]:
            del state[name]
        for name in [n for n in state if n.startswith("mtp.layers.0.")]:
            state["model." + name.removeprefix("mtp.")] = state.pop(name)

    rotated = _edited_copy(src, tmp_path / "rotated", tensors=rotate)
    assert rel_l2(mq.MoELayer.from_checkpoint(rotated, 0)(x, logits), want) > 0.1


def test_qwen3_omni_routes_from_the_thinker_config(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen3-Omni keeps its language model's keys in `thinker_config.text_config` and its MoE
    blocks under `thinker.model.layers`, with the talker's beside them: the checkpoint failed
    to load ("no num_experts_per_tok"). The thinker's keys are read (top-k, renormalisation,
    hidden size, activation), the family is checked, the talker's blocks are set aside, and the
    thinker's layers run as the same layers under their usual names."""
    src = fixture_path("qwen3_w8a16_g128")
    keys = ("num_experts_per_tok", "norm_topk_prob", "hidden_size", "hidden_act", "model_type")

    def tensors(state: dict) -> None:
        for name in list(state):
            if name.startswith("model."):
                state["thinker." + name] = state.pop(name)
                if name.startswith("model.layers.0.mlp."):
                    state["talker." + name] = state["thinker." + name].clone()

    def config(cfg: dict) -> None:
        text = {k: cfg.pop(k) for k in keys} | {"model_type": "qwen3_omni_moe_text"}
        cfg["model_type"] = "qwen3_omni_moe"
        cfg["thinker_config"] = {"model_type": "qwen3_omni_moe_thinker", "text_config": text}
        cfg["talker_config"] = {"text_config": {"num_experts_per_tok": 6, "norm_topk_prob": False}}

    path = _edited_copy(src, tmp_path / "omni", tensors=tensors, config=config)
    ckpt = mq.open(path)
    summary = ckpt.summary()
    routing = summary["routing"]
    assert (routing["top_k"], routing["renormalize"], routing["family_checked"]) == (2, True, True)
    assert summary["hidden_act"] == "silu"
    assert summary["set_aside_moe"] == ["talker.model.layers.0.mlp"]
    assert [i["prefix"] for i in ckpt.moe_layers()] == [
        "thinker.model.layers.0.mlp",
        "thinker.model.layers.1.mlp",
    ]
    x = torch.randn(8, ckpt.moe_layers()[0]["hidden_size"])
    logits = torch.randn(8, ckpt.moe_layers()[0]["num_experts"])
    for layer in (0, 1):
        want = mq.MoELayer.from_checkpoint(src, layer)(x, logits)
        assert torch.equal(mq.MoELayer.from_checkpoint(ckpt, layer)(x, logits), want)


def test_a_hidden_size_the_experts_do_not_have_names_where_config_json_says_it(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """The experts' input width is checked against config.json's hidden size, at the top level
    or in a nested language-model config, and the error names the key's path."""
    src = fixture_path("qwen3_w8a16_g128")
    top = _with_config(src, tmp_path / "top", hidden_size=999)
    with pytest.raises(
        mq.MoeqError, match="experts take 256 inputs but config.json says hidden_size 999"
    ):
        mq.open(top)

    def nest(cfg: dict) -> None:
        cfg["thinker_config"] = {"text_config": {"hidden_size": 999}}
        del cfg["hidden_size"]

    nested = _edited_copy(src, tmp_path / "nested", config=nest)
    says = "config.json says thinker_config.text_config.hidden_size 999"
    with pytest.raises(mq.MoeqError, match=says):
        mq.open(nested)


def test_an_expert_width_the_experts_do_not_have_names_moe_intermediate_size(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """config.json's `moe_intermediate_size` (what transformers and vLLM build the experts
    from) is checked against the experts' tensors, at the top level or nested; a list (per
    layer or modality in some families) and a config without the key are not checked."""
    src = fixture_path("qwen3_w8a16_g128")
    assert mq.open(src).moe_layers()[0]["intermediate_size"] == 128
    top = _with_config(src, tmp_path / "top", moe_intermediate_size=96)
    says = "experts have intermediate size 128 but config.json says moe_intermediate_size 96"
    with pytest.raises(mq.CheckpointError, match=says) as err:
        mq.open(top)
    assert "model.layers.0.mlp.experts" in str(err.value)

    def nest(cfg: dict) -> None:
        cfg["text_config"] = {"moe_intermediate_size": 96}
        del cfg["moe_intermediate_size"]

    nested = _edited_copy(src, tmp_path / "nested", config=nest)
    with pytest.raises(mq.CheckpointError, match="says text_config.moe_intermediate_size 96"):
        mq.open(nested)
    for name, value in (("listed", [96, 96]), ("absent", None)):
        ok = _with_config(src, tmp_path / name, moe_intermediate_size=value)
        assert mq.open(ok).moe_layers()[0]["intermediate_size"] == 128


_FREEZING_SCRIPT = r"""
import sys, torch, moeq_rs as mq
import torch._inductor.config as ic
ic.freezing = True  # a usual CPU-inference setting
def layer(seed):
    g = torch.Generator().manual_seed(seed)
    return mq.MoELayer.from_tensors(
        torch.randint(-127, 128, (4, 64, 64), dtype=torch.int8, generator=g),
        torch.randint(-127, 128, (4, 64, 32), dtype=torch.int8, generator=g),
        torch.rand(4, 64, 1, generator=g) / 1e3, torch.rand(4, 64, 1, generator=g) / 1e3,
        scheme="w8a16", top_k=2)
x, r = torch.randn(3, 64), torch.randn(3, 4)
with torch.no_grad():
    for seed in map(int, sys.argv[1:]):
        moe = layer(seed)
        got = torch.compile(moe, fullgraph=True)(x, r)
        assert torch.equal(got, moe(x, r)), seed
print("ok")
"""


def test_inductor_freezing_runs_each_layer_with_its_own_weights(freezing_runs) -> None:  # type: ignore[no-untyped-def]
    """Under inductor's freezing the layer handle became a constant that the FX graph cache did
    not tell apart by value: a second layer of the same shapes got the first one's compiled
    graph and silently ran the first layer's weights (and in another process sharing the
    cache, failed to find it). Each layer now runs its own weights."""
    freezing_runs(_FREEZING_SCRIPT)


def _small_w8a16(e: int = 4, h: int = 64, i: int = 32) -> tuple[torch.Tensor, ...]:
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8)
    return w13, w2, torch.rand(e, 2 * i, 1) / 1e3, torch.rand(e, h, 1) / 1e3


def test_from_tensors_reads_parameters_and_lazy_views_as_values() -> None:
    """Scales held as nn.Parameters (autograd history) or as lazily negated views are read
    as the values they hold (numpy refused them: a RuntimeError)."""
    w13, w2, s13, s2 = _small_w8a16()
    x, logits = torch.randn(5, 64), torch.randn(5, 4)
    want = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)(x, logits)
    for a, b in [
        (torch.nn.Parameter(s13), torch.nn.Parameter(s2)),
        (torch._neg_view(-s13), torch._neg_view(-s2)),
    ]:
        got = mq.MoELayer.from_tensors(w13, w2, a, b, scheme="w8a16", top_k=2)(x, logits)
        assert torch.equal(got, want)


def test_from_tensors_and_fused_moe_name_bad_arguments() -> None:
    w13, w2, s13, s2 = _small_w8a16()
    static = dict(scheme="w8a8_static", a2_scale=0.02, top_k=1)
    for a13, match in [
        ("x", "a13_scale: expected a number or a float tensor"),
        (torch.ones(4, device="meta"), "a13_scale: expected a CPU tensor, got device meta"),
        (torch.ones(4, dtype=torch.complex64), "a13_scale: expected a real floating-point"),
    ]:
        with pytest.raises(mq.LayoutError, match=match):
            mq.MoELayer.from_tensors(w13, w2, s13[..., 0], s2[..., 0], a13_scale=a13, **static)
    with pytest.raises(mq.LayoutError, match="renormalize: expected True or False, got None"):
        mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2, renormalize=None)
    np_false = mq.MoELayer.from_tensors(
        w13, w2, s13, s2, scheme="w8a16", top_k=2, renormalize=np.bool_(False)
    )
    x, w = torch.randn(3, 64), torch.full((3, 6), 1 / 6)
    for ids, match in [(torch.tensor(1), r"got shape \[\]"), (None, "got NoneType")]:
        with pytest.raises(mq.LayoutError, match=f"topk_ids: expected a .*{match}"):
            mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a16")
    # More slots than experts (repeats) work as in MoELayer.forward_topk.
    ids = torch.tensor([[0, 1, 2, 3, 0, 1]] * 3)
    got = mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a16")
    assert torch.equal(got, np_false.forward_topk(x, w, ids))


def test_copies_of_a_layer_have_their_own_custom_op_handle() -> None:
    """copy.copy kept the original's handle: once the original was freed, torch.ops.moeq (and
    compiled graphs) failed with a KeyError, and a new layer given the freed id would have run
    in its place. Handles are never reused, and a freed one is a LayoutError."""
    import copy
    import gc

    w13, w2, s13, s2 = _small_w8a16()
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    a = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    want = a(x, logits)
    b, d = copy.copy(a), copy.deepcopy(a)
    assert len({int(a._handle), int(b._handle), int(d._handle)}) == 3
    del a
    gc.collect()
    for layer in (b, d):
        assert torch.equal(torch.ops.moeq.moe_forward(x, logits, layer._handle), want)
        assert torch.equal(torch.compile(layer)(x, logits), want)
    # (A layer no compiled graph refers to: dynamo's caches keep those alive.)
    gone = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    handle = gone._handle
    del gone
    gc.collect()
    with pytest.raises(
        mq.LayoutError, match=f"layer handle {int(handle)}: no live MoE layer .* was freed"
    ):
        torch.ops.moeq.moe_forward(x, logits, handle)
    with pytest.raises(mq.LayoutError, match="layer: expected a MoE layer's handle"):
        torch.ops.moeq.moe_forward(x, logits, torch.tensor([1, 2]))


def test_pickling_a_layer_is_a_clear_error(tmp_path) -> None:
    """pickle reached the native object's bare TypeError ("cannot pickle
    'moeq_rs._core.CpuMoeLayer'"); torch.save of a model holding a layer is the common case."""
    import io
    import pickle

    w13, w2, s13, s2 = _small_w8a16()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), layer)
    for dump in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(mq.MoeqError, match="MoELayer cannot be pickled.*from_checkpoint") as e:
            dump(model)
        assert isinstance(e.value, TypeError)  # what pickling probes catch
    # The weights of the rest of the model still save, and the layer still runs.
    torch.save(model[0].state_dict(), tmp_path / "linear.pt")
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    assert layer(x, logits).shape == (3, 64)


def test_lazy_names_are_listed() -> None:
    assert {"MoELayer", "fused_moe", "open", "plan"} <= set(dir(mq))


def test_a_meta_argument_beside_cpu_inputs_is_refused_by_name() -> None:
    """torch sends a call with any meta argument to the op's fake implementation, whose
    ``empty_like(hidden_states)`` would come back unwritten for CPU ``hidden_states``: the fake
    implementations refuse the mix by name (all-meta calls still trace shapes), and
    ``fused_moe``'s numbers for static scales become CPU tensors whatever torch's default
    device is. Found by a review helper: garbage came back (values like 1e38)."""
    w13, w2, s13, s2 = _small_w8a16()
    x, w = torch.randn(3, 64), torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    args = dict(hidden_states=x, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
                topk_weights=w, topk_ids=ids)  # fmt: skip
    for name in ("w13", "w13_scale", "topk_weights", "topk_ids"):
        bad = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(mq.LayoutError, match=f"{name}: on device meta"):
            mq.fused_moe(*bad.values(), scheme="w8a16")
    meta = mq.fused_moe(*(t.to("meta") for t in args.values()), scheme="w8a16")
    assert meta.device.type == "meta" and meta.shape == x.shape
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    with pytest.raises(mq.LayoutError, match="topk_ids: on device meta"):
        torch.ops.moeq.moe_forward_topk(x, w, ids.to("meta"), moe._handle)
    with pytest.raises(mq.LayoutError, match="router_logits: on device meta"):
        torch.ops.moeq.moe_forward(x, torch.randn(3, 4, device="meta"), moe._handle)
    meta_logits = torch.randn(3, 4).to("meta")
    assert torch.ops.moeq.moe_forward(x.to("meta"), meta_logits, moe._handle).is_meta
    # Static scales given as numbers under a meta default device.
    w13_8 = torch.randint(-127, 128, w13.shape, dtype=torch.int8)
    w2_8 = torch.randint(-127, 128, w2.shape, dtype=torch.int8)
    static = dict(scheme="w8a8_static", a13_scale=0.02, a2_scale=0.002)
    want = mq.fused_moe(x, w13_8, w2_8, s13, s2, w, ids, **static)
    assert torch.isfinite(want).all()
    with torch.device("meta"):
        got = mq.fused_moe(x, w13_8, w2_8, s13, s2, w, ids, **static)
    assert torch.equal(got, want)
    # All-meta tensors with number scales still trace (a 0-d CPU tensor is a scalar to torch).
    metas = (t.to("meta") for t in (x, w13_8, w2_8, s13, s2, w, ids))
    assert mq.fused_moe(*metas, **static).is_meta


def test_layers_of_one_shape_share_one_compiled_graph() -> None:
    """The handle was an int attribute, which dynamo specialises on: each layer compiled the
    forward again, and the ninth hit the recompile limit (an error under fullgraph=True, eager
    from then on otherwise). As a tensor it is a graph input."""
    from torch._dynamo.utils import counters

    layers = [mq.MoELayer.from_tensors(*_small_w8a16(), scheme="w8a16", top_k=2) for _ in range(10)]
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        for layer in layers:
            compiled = torch.compile(layer, backend="eager", fullgraph=True)
            assert torch.equal(compiled(x, logits), layer(x, logits))
    assert counters["stats"]["unique_graphs"] == 1


_OTHER_PROCESS = r"""
import sys, torch, moeq_rs as mq
g = torch.Generator().manual_seed(1)
w13 = torch.randint(-127, 128, (4, 64, 64), dtype=torch.int8, generator=g)
w2 = torch.randint(-127, 128, (4, 64, 32), dtype=torch.int8, generator=g)
other = mq.MoELayer.from_tensors(w13, w2, torch.rand(4, 64, 1), torch.rand(4, 64, 1),
                                 scheme="w8a16", top_k=2)
program = torch.export.load(sys.argv[1]).module()
try:
    program(torch.randn(3, 64), torch.randn(3, 4))
except mq.LayoutError as e:
    print("refused:", e)
"""


def test_an_exported_program_does_not_run_another_process_layer(tmp_path: Path) -> None:
    """Handles counted from 1 in every process, so a saved torch.export program run in another
    process silently ran whichever layer had its number there. Random handles find no layer
    there, and the op says why."""

    class Block(torch.nn.Module):
        def __init__(self, moe: torch.nn.Module) -> None:
            super().__init__()
            self.moe = moe

        def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return x + self.moe(x, logits)

    moe = mq.MoELayer.from_tensors(*_small_w8a16(), scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    with torch.no_grad():
        program = torch.export.export(Block(moe), (x, logits))
        assert torch.equal(program.module()(x, logits), x + moe(x, logits))
    torch.export.save(program, tmp_path / "moe.pt2")
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, str(tmp_path / "moe.pt2")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "refused: layer handle" in done.stdout
    assert "graph was made in another process" in done.stdout


def test_traces_and_tensor_subclasses_go_through_the_op() -> None:
    """torch.jit.trace of `x + moe(x, logits)` recorded the MoE output as a constant (the
    eager path bypassed the op), and a tensor subclass reached numpy's RuntimeError."""
    from torch.testing._internal.two_tensor import TwoTensor

    moe = mq.MoELayer.from_tensors(*_small_w8a16(), scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)

    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            return x + moe(x, logits)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.trace is deprecated
        traced = torch.jit.trace(Block(), (x, logits))
    x2 = torch.randn(3, 64)
    assert torch.equal(traced(x2, logits), x2 + moe(x2, logits))
    both = moe(TwoTensor(x, x2), logits)
    assert torch.equal(both.a, moe(x, logits)) and torch.equal(both.b, moe(x2, logits))


# torch.compile traces the backward with anomaly detection, which reports the refusal too.
@pytest.mark.filterwarnings("ignore:Error detected in GeneratedBackwardFor_moeq")
def test_gradients_are_refused_alike_eager_and_compiled() -> None:
    """Eager calls dropped the autograd history silently while the custom op kept it and
    failed at backward with torch's generic message: both now return an output that needs
    grad and whose backward says the layer is inference-only; values are unchanged. Compiled
    with grad mode on, compilation fails with that reason."""
    w13, w2, s13, s2 = _small_w8a16()
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    want = moe(x, logits)
    xg = x.clone().requires_grad_()
    for y in (
        moe(xg, logits),
        torch.ops.moeq.moe_forward(xg, logits, moe._handle),
        moe.forward_topk(xg, torch.full((3, 2), 0.5), torch.tensor([[0, 1]] * 3)),
    ):
        assert y.requires_grad
        with pytest.raises(NotImplementedError, match="inference-only"):
            y.sum().backward()
    assert torch.equal(moe(xg, logits).detach(), want)
    with torch.no_grad():
        assert not moe(xg, logits).requires_grad
    # Compiled, the backward is built ahead: the call itself fails, with the same reason.
    with pytest.raises(Exception, match="inference-only"):
        torch.compile(moe, fullgraph=True)(xg, logits)
    with torch.no_grad():
        assert torch.equal(torch.compile(moe, fullgraph=True)(xg, logits), want)


def test_native_sizes_that_would_wrap_are_errors() -> None:
    """The native layer's token count comes from its caller: a product that overflows must not
    wrap to a matching length (it reached an index out of bounds, a Rust panic)."""
    w13, w2, s13, s2 = _small_w8a16()
    core = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)._core
    x = np.random.randn(2, 64).astype(np.float32)
    with pytest.raises(mq.LayoutError, match="topk_ids/topk_weights must be"):
        core.forward_topk(x, 2, np.ones(4, np.float32), np.zeros(4, np.int64), 2 + 2**63)
    with pytest.raises(mq.LayoutError, match="router_logits has 12 values"):
        core.forward(np.random.randn(3, 64).astype(np.float32), 3 + 2**63, np.ones(12, np.float32))


def test_misaligned_input_is_named_as_misaligned() -> None:
    w13, w2, s13, s2 = _small_w8a16()
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    buf = bytearray(3 * 64 * 4 + 4)
    x = torch.from_numpy(np.frombuffer(buf, np.float32, 3 * 64, offset=1).reshape(3, 64))
    x.copy_(torch.randn(3, 64))
    assert x.is_contiguous()
    with pytest.raises(mq.LayoutError, match="hidden_states: must be aligned to its element size"):
        moe(x, torch.randn(3, 4))


def test_the_thread_count_is_bounded_and_bad_values_mean_the_default() -> None:
    """MOEQ_NUM_THREADS had no upper bound: 100000 spent minutes starting threads. At most
    four per available CPU; a value that is not a positive integer means one per CPU."""
    import os

    def threads(value: str) -> int:
        ran = subprocess.run(
            [sys.executable, "-c", "import moeq_rs as mq; print(mq.oracle.cpu_threads())"],
            env=dict(os.environ, MOEQ_NUM_THREADS=value),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        return int(ran.stdout)

    default = threads("")
    assert 1 <= default <= (os.cpu_count() or 1)
    assert threads("1") == 1
    assert threads("100000") == 4 * default
    # A count too large to hold is a large count, capped like 100000 (it meant the default).
    assert threads("99999999999999999999999") == 4 * default
    for bad in ("0", "-1", "abc", "2.5"):
        assert threads(bad) == default, bad


def test_module_moves_are_refused_and_dtype_casts_change_nothing() -> None:
    """.cuda(), .to("cuda") and .to("meta") returned the layer unchanged (its weights are not
    parameters), so a model moved to the GPU kept running this layer on the CPU unnoticed. A
    move off the CPU is now a LayoutError (CudaUnavailableError where torch reaches a GPU); a
    dtype cast changes nothing, the outputs taking the input's dtype as before."""
    moe = mq.MoELayer.from_tensors(*_small_w8a16(), scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    want = moe(x, logits)
    assert moe.to(torch.bfloat16) is moe and moe.half() is moe and moe.to("cpu") is moe
    # What a caller or subclass attaches is cast as any module's would be (it was skipped).
    moe.gain = torch.nn.Parameter(torch.ones(2))
    moe.register_buffer("offset", torch.zeros(2))
    moe.half()
    assert moe.gain.dtype == moe.offset.dtype == torch.float16
    model = torch.nn.ModuleList([torch.nn.Linear(64, 64), moe])
    model.double()
    assert moe.gain.dtype == moe.offset.dtype == model[0].weight.dtype == torch.float64
    for move in (
        moe.cuda,
        lambda: moe.to("cuda:0"),
        lambda: moe.to("meta"),
        lambda: model.to("meta"),
    ):
        # (LayoutError here; CudaUnavailableError where torch reaches a GPU.)
        with pytest.raises(mq.MoeqError, match="MoELayer runs on the CPU only"):
            move()
    assert torch.equal(moe(x, logits), want)
    # Under another default device the handle (and the dtype-cast probe) stay on the CPU.
    weights = _small_w8a16()
    with torch.device("meta"):
        other = mq.MoELayer.from_tensors(*weights, scheme="w8a16", top_k=2)
        assert other.half() is other
    assert other._handle.device.type == "cpu"
    got = torch.compile(other, backend="eager", fullgraph=True)(x, logits)
    assert torch.equal(got, mq.MoELayer.from_tensors(*weights, scheme="w8a16", top_k=2)(x, logits))


_SCRATCH_SCRIPT = (
    # I 1024: down inputs wide enough beside H 256 that long calls keep the buffered sum.
    _random_int8_layer(seed=5, top_k=4, inter=1024)
    + r"""
import threading
x, lg = torch.randn(4096, h, generator=g).bfloat16(), torch.randn(4096, e, generator=g)
want = layer(x, lg)
side = threading.Thread(target=layer, args=(x, lg))  # the other threads' pool too
side.start(); side.join()
# From another thread: the main thread's pool keeps its buffers (only that thread can reach
# them) and the call returns at once (it waited for the main thread before).
off_main = []
t = threading.Thread(target=lambda: off_main.append(mq.oracle.cpu_release_scratch()), daemon=True)
t.start(); t.join(60)
assert off_main, "cpu_release_scratch from another thread did not return"
first = mq.oracle.cpu_release_scratch()
second = mq.oracle.cpu_release_scratch()
print(first, second, torch.equal(layer(x, lg), want))
"""
)


def test_spare_scratch_can_be_released() -> None:
    """Forwards keep their scratch for the next call (hundreds of MB after a long prompt) with
    no way to free it; mq.oracle.cpu_release_scratch() frees it on every forward thread.
    That includes the routed experts' output rows (tokens x top_k x hidden floats), which each
    layer kept for itself, out of its reach and beyond the size limit (2.5 GB per layer after
    a 32k-token prompt of Qwen3's shape). (Calls that sum in column panels instead hold no
    such buffer; this layer's keep it.)"""
    first, second, same = _two_thread_script(_SCRATCH_SCRIPT)
    # The routed rows of both calls (main thread, other threads' pool): 17.5 MB freed before.
    assert int(first) >= 2 * 4096 * 4 * 256 * 4
    assert int(second) == 0 and same == "True"


def test_fused_moe_compiles_with_fullgraph() -> None:
    """`mq.fused_moe` built a layer in Python on every call, which dynamo cannot trace:
    `torch.compile(fullgraph=True)` failed ("Attempted to call function marked as skipped")
    and without fullgraph it broke the graph. It runs as torch.ops.moeq.fused_moe now, for
    weight-only and static W8A8 (number scales) alike, with the eager result's bits."""
    w13, w2, s13, s2 = _small_w8a16()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w, ids = torch.full((5, 2), 0.5), torch.randint(0, 4, (5, 2))

    def weight_only(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a16") * 2

    def static(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return mq.fused_moe(
            x, w13, w2, s13[..., 0], s2[..., 0], w, ids, scheme="w8a8_static",
            a13_scale=0.02, a2_scale=torch.tensor(0.01),
        )  # fmt: skip

    # An argument the op cannot carry still gets the checked path's error, naming it.
    with pytest.raises(mq.LayoutError, match="group_size"):
        mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a16", group_size=2**70)
    for fn in (weight_only, static):
        want = fn(x, w, ids)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="eager", fullgraph=True)(x, w, ids)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), fn.__name__
    # The op is what ran, and its fake gives the output's shape and dtype.
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.moeq.fused_moe(
            mode.from_tensor(x), *(mode.from_tensor(t) for t in (w13, w2, s13, s2, w, ids)),
            "w8a16", -1, None, None, None, None,
        )  # fmt: skip
    assert fake.shape == x.shape and fake.dtype == x.dtype
    args = (x, w13, w2, s13, s2, w, ids, "w8a16", -1, None, None, None, None)
    checks = torch.library.opcheck(torch.ops.moeq.fused_moe.default, args)
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_a_layer_traces_shapes_on_meta_inputs() -> None:
    """A forward with every argument on the meta device (a model run under
    ``torch.device("meta")`` to infer shapes) returns a meta ``[T, H]`` output in the input's
    dtype, after the checks a CPU call makes; it raised "expected a CPU tensor" although the
    ``torch.ops.moeq`` ops traced such calls. Found by a review helper."""
    w13, w2, s13, s2 = _small_w8a16()
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    t = int(torch.randint(1, 9, ()))
    for grad in (False, True):
        x = torch.randn(t, 64, dtype=torch.bfloat16, device="meta", requires_grad=grad)
        logits = torch.randn(t, 4, device="meta")
        out = moe(x, logits)
        assert out.is_meta and out.shape == (t, 64) and out.dtype == torch.bfloat16
        w = torch.rand(t, 2, device="meta")
        ids = torch.zeros(t, 2, dtype=torch.int64, device="meta")
        out = moe.forward_topk(x, w, ids)
        assert out.is_meta and out.shape == (t, 64) and out.dtype == torch.bfloat16
        wide = torch.randn(t, 65, device="meta", requires_grad=grad)
        with pytest.raises(mq.LayoutError, match=r"hidden_states: expected \[T, 64\]"):
            moe(wide, logits)
        with pytest.raises(mq.LayoutError, match=r"router_logits: expected \[\d+, 4\]"):
            moe(x, torch.randn(t, 5, device="meta"))
        with pytest.raises(mq.LayoutError, match="topk_ids: expected int32 or int64"):
            moe.forward_topk(x, w, ids.float())
        with pytest.raises(mq.LayoutError, match="router_logits: on device cpu"):
            moe(x, torch.randn(t, 4))
    with torch.device("meta"):
        assert moe(torch.randn(2, 64), torch.randn(2, 4)).is_meta
    # The meta call runs the op (a review found it returning `empty_like` directly): a trace
    # on meta inputs records it and replays the layer on CPU inputs; an input that needs
    # gradients gets the op's no-backward node; torch.func transforms are refused.
    x, logits = torch.randn(t, 64), torch.randn(t, 4)
    traced = torch.jit.trace(moe, (x.to("meta"), logits.to("meta")), check_trace=False)
    assert torch.equal(traced(x, logits), moe(x, logits))
    from torch.fx.experimental.proxy_tensor import make_fx

    metas = (x.to("meta"), torch.rand(t, 2, device="meta"), ids.new_zeros(t, 2))
    graph = make_fx(lambda a, b, c: moe.forward_topk(a, b, c))(*metas)
    assert "moeq.moe_forward_topk" in str(graph.graph)
    out = moe(x.to("meta").requires_grad_(), logits.to("meta"))
    assert out.is_meta and out.requires_grad
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.vmap(moe)(x.to("meta")[None], logits.to("meta")[None])
    # Fake meta tensors (under FakeTensorMode) get a fake handle, as fake CPU ones do.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake_x, fake_logits = torch.randn(t, 64, device="meta"), torch.randn(t, 4, device="meta")
        assert moe(fake_x, fake_logits).shape == (t, 64)
        fake_ids = torch.zeros(t, 2, dtype=torch.int64, device="meta")
        assert moe.forward_topk(fake_x, torch.rand(t, 2, device="meta"), fake_ids).is_meta


def _count_eager_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wraps the wrapper's ``_eager`` check: the list gets each call's tensor count (the native
    fast path never reaches it)."""
    from moeq_rs import moe as moe_module

    calls: list[int] = []
    real = moe_module._eager

    def counting(*tensors: object) -> bool:
        calls.append(len(tensors))
        return real(*tensors)

    monkeypatch.setattr(moe_module, "_eager", counting)
    return calls


def test_plain_eager_calls_skip_the_python_checks_and_others_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain CPU tensors in eager mode go straight to native code, which checks torch's state
    itself (the wrapper's ``_eager`` costs ~50 us once evicted); an input that needs gradients,
    a trace or a forward-AD level still reaches ``_eager``, whose paths handle them."""
    w13, w2, s13, s2 = _small_w8a16()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    seen = _count_eager_calls(monkeypatch)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    want, want_topk = layer(x, logits), layer.forward_topk(x, w, ids)
    assert seen == []
    grad_x = x.clone().requires_grad_()
    out = layer(grad_x, logits)
    assert seen == [2] and out.requires_grad and torch.equal(out.detach(), want)
    with torch.no_grad():  # no gradient wanted: the native path again
        assert torch.equal(layer.forward_topk(grad_x, w, ids), want_topk)
    assert seen == [2]
    traced = torch.jit.trace(layer, (x, logits), check_trace=False)
    assert len(seen) > 1
    assert torch.equal(traced(x, logits), want)
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level(), pytest.raises(NotImplementedError, match="forward-mode"):
        layer(fwad.make_dual(x, torch.ones_like(x)), logits)


class _SeenOps(TorchDispatchMode):
    """A dispatch mode that records the name of every op it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_the_op_and_make_fx_records_it() -> None:
    """Under a TorchDispatchMode the eager native call bypassed the mode: ``make_fx`` in real
    mode baked the output in as a constant (a graph that replayed one input's result for every
    input) and modes such as FLOP counters never saw the layer. Such calls take the op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w13, w2, s13, s2 = _small_w8a16()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    graph = make_fx(lambda a, b: layer(a, b))(x, logits)
    assert "moeq.moe_forward" in str(graph.graph)
    x2, logits2 = torch.randn(3, 64), torch.randn(3, 4)
    assert torch.equal(graph(x2, logits2), layer(x2, logits2))
    graph = make_fx(lambda a, b, c: layer.forward_topk(a, b, c))(x, w, ids)
    assert torch.equal(graph(x2, w, ids), layer.forward_topk(x2, w, ids))

    with _SeenOps() as seen:
        out = layer(x, logits)
        out_topk = layer.forward_topk(x, w, ids)
    assert "moeq.moe_forward.default" in seen.ops
    assert "moeq.moe_forward_topk.default" in seen.ops
    assert torch.equal(out, layer(x, logits)) and torch.equal(
        out_topk, layer.forward_topk(x, w, ids)
    )


def test_plain_eager_fused_moe_skips_the_op_and_others_take_it() -> None:
    """``fused_moe`` always ran as ``torch.ops.moeq.fused_moe``, and torch runs a custom op's
    kernel inside ``torch._disable_dynamo``, which imports ``torch._dynamo`` on a process's
    first call: ~1.5 s before the first result. Plain eager calls now run what the op runs,
    directly; modes, ``make_fx``, inputs that need gradients and meta tensors still take it."""
    script = """
import sys, torch, moeq_rs as mq
torch.manual_seed(0)
w13 = torch.randint(-127, 128, (4, 64, 64), dtype=torch.int8)
w2 = torch.randint(-127, 128, (4, 64, 32), dtype=torch.int8)
s13, s2 = torch.rand(4, 64, 1) / 1e3, torch.rand(4, 64, 1) / 1e3
x, w, ids = torch.randn(3, 64), torch.rand(3, 2), torch.randint(0, 4, (3, 2))
y = mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a8_static", a13_scale=0.02, a2_scale=0.5)
assert y.shape == (3, 64) and bool(y.isfinite().all()) and bool(y.ne(0).any())
# Weights as a model holds them: nn.Parameters, under no_grad.
P = torch.nn.Parameter
with torch.no_grad():
    z = mq.fused_moe(
        x, P(w13, requires_grad=False), P(w2, requires_grad=False), P(s13), P(s2), w, ids,
        scheme="w8a8_static", a13_scale=0.02, a2_scale=0.5,
    )
assert torch.equal(z, y)
print(any(m.startswith("torch._dynamo") for m in sys.modules))
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "False", ran.stdout

    from torch.fx.experimental.proxy_tensor import make_fx

    w13, w2, s13, s2 = _small_w8a16()
    x, w, ids = torch.randn(3, 64), torch.rand(3, 2), torch.randint(0, 4, (3, 2))

    def call(a: torch.Tensor) -> torch.Tensor:
        return mq.fused_moe(a, w13, w2, s13, s2, w, ids, scheme="w8a16")

    want = call(x)
    assert torch.equal(
        want,
        mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2).forward_topk(x, w, ids),
    )

    with _SeenOps() as seen:
        assert torch.equal(call(x), want)
    assert "moeq.fused_moe.default" in seen.ops
    graph = make_fx(call)(x)
    assert "moeq.fused_moe" in str(graph.graph)
    x2 = torch.randn(3, 64)
    assert torch.equal(graph(x2), call(x2))
    out = call(x.clone().requires_grad_())
    assert out.requires_grad and torch.equal(out.detach(), want)
    with pytest.raises(NotImplementedError, match="inference-only"):
        out.sum().backward()
    meta = mq.fused_moe(*(t.to("meta") for t in (x, w13, w2, s13, s2, w, ids)), scheme="w8a16")
    assert meta.is_meta and meta.shape == (3, 64)
    # Parameters that need gradients (grad mode on) take the op, whose backward refuses.
    out = mq.fused_moe(x, w13, w2, torch.nn.Parameter(s13), s2, w, ids, scheme="w8a16")
    assert out.requires_grad and torch.equal(out.detach(), want)
    # torch.func transforms and dual tensors are refused by name, as before, on either path,
    # whichever argument is transformed.
    for transformed, match in [
        (lambda: torch.func.vmap(call)(x[None]), "torch.func transforms"),
        (
            lambda: torch.func.vmap(
                lambda v: mq.fused_moe(x, v, w2, s13, s2, w, ids, scheme="w8a16")
            )(w13[None]),
            "torch.func transforms",
        ),
        (lambda: torch.func.grad(lambda a: call(a).sum())(x), "torch.func transforms"),
        (lambda: torch.func.jvp(call, (x,), (torch.ones_like(x),)), "forward-mode"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            transformed()


def test_empty_outputs_of_different_dtypes_save_together() -> None:
    """A T=0 output's buffer was an empty Vec's placeholder address, the same for every dtype of
    one size: torch took a bf16 and an fp16 empty output for one storage viewed as two dtypes,
    and ``torch.save`` of both failed. Found by a review's fuzzing."""
    import io

    w13, w2, s13, s2 = _small_w8a16()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    ids, w = torch.zeros(0, 2, dtype=torch.int64), torch.ones(0, 2)
    outs = {
        str(dtype): layer.forward_topk(torch.randn(0, 64, dtype=dtype), w, ids)
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    }
    buf = io.BytesIO()
    torch.save(outs, buf)
    buf.seek(0)
    back = torch.load(buf)
    for name, out in outs.items():
        assert back[name].shape == (0, 64) and back[name].dtype == out.dtype


def test_function_modes_see_the_op_and_torch_device_stays_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TorchFunctionMode (a user's logging or tracing mode) sees ``torch.ops.moeq.*`` as
    dispatch modes do; the eager native call bypassed it. ``torch.device``'s own mode (``with
    torch.device(...)``, ``torch.set_default_device``) changes factory functions only, so
    calls under it stay on the native path."""
    from torch.overrides import TorchFunctionMode

    w13, w2, s13, s2 = _small_w8a16()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    x, logits = torch.randn(3, 64), torch.randn(3, 4)
    w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    want, want_topk = layer(x, logits), layer.forward_topk(x, w, ids)

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        out, out_topk = layer(x, logits), layer.forward_topk(x, w, ids)
    assert "moeq.moe_forward" in seen.funcs and "moeq.moe_forward_topk" in seen.funcs
    assert torch.equal(out, want) and torch.equal(out_topk, want_topk)

    calls = _count_eager_calls(monkeypatch)
    with torch.device("cpu"):
        assert torch.equal(layer(x, logits), want)
        assert torch.equal(layer.forward_topk(x, w, ids), want_topk)
    assert calls == []  # the native path took both
    with Seen() as seen, torch.device("cpu"):
        assert torch.equal(layer(x, logits), want)
    assert calls == [2] and "moeq.moe_forward" in seen.funcs


def test_a_call_whose_scratch_exceeds_the_memory_is_refused_before_allocating() -> None:
    """One token of ``forward_topk`` with 2**22 slots on a layer of intermediate size 2**20
    would need ~50 TB of scratch: a ``LayoutError`` saying so, where the allocation used to
    fail and abort the process (no Python exception)."""
    e, h, i = 1, 8, 2**20
    w13 = torch.ones(e, 2 * i, h, dtype=torch.int8)
    w2 = torch.ones(e, h, i, dtype=torch.int8)
    moe = mq.MoELayer.from_tensors(
        w13, w2, torch.full((e, 2 * i, 1), 1e-3), torch.full((e, h, 1), 1e-3),
        scheme="w8a16", top_k=1,
    )  # fmt: skip
    # ~50 TB: beyond any machine's memory (2**16 slots, ~0.8 TB, would run on a large host).
    slots = 2**22
    w = torch.full((1, slots), 1.0 / slots)
    ids = torch.zeros(1, slots, dtype=torch.int64)
    with pytest.raises(
        mq.LayoutError, match=r"topk_ids: 4194304 slots per token need .* GiB of scratch memory "
    ):
        moe.forward_topk(torch.randn(1, h), w, ids)
    # The layer itself still runs a call of a size that fits.
    x = torch.randn(2, h)
    got = moe.forward_topk(x, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64))
    assert got.shape == (2, h) and torch.isfinite(got).all()


def test_fake_and_unusual_tensors_are_checked_as_real_ones_are() -> None:
    """Under ``FakeTensorMode`` a wrong shape is the same ``LayoutError`` as for real tensors
    (the trace recorded a wrong output shape, and the error came only when run); tensors of
    another layout (sparse, MKL-DNN, nested) are refused by name as not dense (a numpy
    ``TypeError`` or torch's internal error before); 4-bit zero points outside -8..7 are
    refused on the CPU as on CUDA and in checkpoints."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w13, w2, s13, s2 = _small_w8a16()
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    with FakeTensorMode() as mode:
        assert moe(torch.empty(5, 64), torch.empty(5, 4)).shape == (5, 64)
        with pytest.raises(mq.LayoutError, match=r"hidden_states: expected \[T, 64\]"):
            moe(torch.empty(5, 65), torch.empty(5, 4))
        with pytest.raises(mq.LayoutError, match=r"router_logits: expected \[5, 4\]"):
            moe(torch.empty(5, 64), torch.empty(4, 4))
        with pytest.raises(mq.LayoutError, match="must both be"):
            moe.forward_topk(
                torch.empty(5, 64), torch.empty(5, 2), torch.empty(5, 3, dtype=torch.int64)
            )
        args = tuple(mode.from_tensor(t) for t in (w13, w2, s13, s2))
        fw, fids = torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int64)
        assert mq.fused_moe(torch.empty(5, 64), *args, fw, fids, scheme="w8a16").shape == (5, 64)
        with pytest.raises(mq.LayoutError, match=r"hidden_states: expected \[T, 64\]"):
            mq.fused_moe(torch.empty(5, 63), *args, fw, fids, scheme="w8a16")
        with pytest.raises(mq.LayoutError, match="must both be"):
            mq.fused_moe(torch.empty(5, 64), *args, fw, fids[:4], scheme="w8a16")
    x = torch.randn(2, 64)
    logits = torch.randn(2, 4)
    for odd, kind in [
        (x.to_sparse(), "layout torch.sparse_coo"),
        (x.to_mkldnn(), "layout torch._mkldnn"),
        (torch.nested.nested_tensor([x[0], x[1]], layout=torch.jagged), "a nested tensor"),
    ]:
        with pytest.raises(mq.LayoutError, match=f"hidden_states: expected a dense .*{kind}"):
            moe(odd, logits)
    e, h, i = 2, 64, 32
    q13 = torch.randint(0, 2**31 - 1, (e, 2 * i, h // 8), dtype=torch.int32)
    q2 = torch.randint(0, 2**31 - 1, (e, h, i // 8), dtype=torch.int32)
    s13, s2 = torch.rand(e, 2 * i, h // 32) / 1e3, torch.rand(e, h, i // 32) / 1e3
    z13 = torch.zeros(e, 2 * i, h // 32, dtype=torch.int8)
    z2 = torch.zeros(e, h, i // 32, dtype=torch.int8)

    def build(z2: torch.Tensor) -> object:
        return mq.MoELayer.from_tensors(
            q13, q2, s13, s2, scheme="w4a16", group_size=32, top_k=1,
            w13_zero_point=z13, w2_zero_point=z2,
        )  # fmt: skip

    build(z2)
    for bad in (8, -9, 100):
        with pytest.raises(
            mq.LayoutError, match=f"w2_zero_point: expert 0, row 0, group 0 is {bad}; 4-bit"
        ):
            build(torch.full_like(z2, bad))


def test_an_isa_cap_that_names_no_kernel_leaves_the_cpus_best() -> None:
    """``MOEQ_CPU_ISA`` values that name no kernel (misspelt, or of another architecture) leave
    the dispatch where it is unset, as the README says (they capped it below AMX before); a
    kernel's name counts in any case."""
    import os
    import subprocess
    import sys

    def kernel(cap: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "MOEQ_CPU_ISA"}
        if cap is not None:
            env["MOEQ_CPU_ISA"] = cap
        script = "import moeq_rs as mq; print(mq.oracle.cpu_kernel())"
        ran = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        return ran.stdout.strip()

    best = kernel(None)
    for cap in ("bogus", "amx", "Neon" if best != "neon" else "avx2"):
        assert kernel(cap) == best, cap
    assert kernel(" SCALAR ") == "scalar"
