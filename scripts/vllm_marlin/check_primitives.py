"""Checks 1-4: moeq_rs.repack primitives vs vLLM's own Python layout functions (see vllm_ref.py).
Run: .venv/bin/python scripts/vllm_marlin/check_primitives.py"""

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_ref import V  # noqa: E402

import moeq_rs.repack as R  # noqa: E402

stats = defaultdict(lambda: [0, 0, 0])
fails = []


def record(check, ok, desc):
    """ok: True (bytes equal), False (mismatch/unexpected error), "refused" (moeq raised
    LayoutError for a shape vLLM's Python function accepts but no Marlin kernel uses)."""
    if ok == "refused":
        stats[check][2] += 1
        return
    stats[check][0 if ok else 1] += 1
    if not ok:
        fails.append(f"{check}: {desc}")


def same_bytes(a, b):
    a = (
        a.detach().cpu().contiguous()
        if isinstance(a, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(a))
    )
    b = (
        b.detach().cpu().contiguous()
        if isinstance(b, torch.Tensor)
        else torch.from_numpy(np.ascontiguousarray(b))
    )
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    return a.view(torch.uint8).numpy().tobytes() == b.view(torch.uint8).numpy().tobytes()


SEEDS = [0, 1, 2]
KS = [128, 256, 512]
NS = [64, 128, 256]

# ---------------- 1. dense weights ----------------
for seed in SEEDS:
    g = torch.Generator().manual_seed(seed)
    for bits in (4, 8):
        for K in KS:
            for N in NS:
                codes = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int32)
                qweight = V["gptq_pack"](codes, bits, K, N)  # GPTQ [K/pf, N]
                gidx = torch.randint(0, K // 32, (K,), generator=g, dtype=torch.int32)
                perms = {
                    "empty": torch.empty(0, dtype=torch.int32),
                    "actorder(stable argsort g_idx)": torch.argsort(gidx, stable=True).to(
                        torch.int32
                    ),
                    "random": torch.randperm(K, generator=g).to(torch.int32),
                }
                for pname, perm in perms.items():
                    ref = V["marlin_weights"](
                        codes[perm.long()] if perm.numel() else codes,
                        K,
                        N,
                        bits,
                        V["get_weight_perm"](bits),
                    )
                    ref2 = V["ref_repack"](qweight, K, N, bits, perm)
                    assert torch.equal(ref, ref2)
                    got_t = R.gptq_marlin_repack(qweight, perm, K, N, bits)
                    got_n = R.gptq_marlin_repack(qweight.numpy(), perm.numpy(), K, N, bits)
                    desc = f"seed={seed} bits={bits} K={K} N={N} perm={pname}"
                    record(
                        "1 dense repack (torch)",
                        same_bytes(got_t, ref) and got_t.dtype == torch.int32,
                        desc,
                    )
                    record(
                        "1 dense repack (numpy)",
                        same_bytes(got_n, ref) and got_n.dtype == np.int32,
                        desc,
                    )
                    # non-contiguous input (transposed storage)
                    qnc = qweight.t().contiguous().t()
                    record(
                        "1 dense repack (non-contig)",
                        same_bytes(R.gptq_marlin_repack(qnc, perm, K, N, bits), ref),
                        desc,
                    )

# ---------------- 2. MoE stacking ----------------
for seed in SEEDS:
    g = torch.Generator().manual_seed(100 + seed)
    for bits in (4, 8):
        for E, K, N in [(1, 128, 64), (3, 256, 128), (4, 128, 256), (2, 512, 192)]:
            pf = 32 // bits
            codes = torch.randint(0, 1 << bits, (E, K, N), generator=g, dtype=torch.int32)
            q = torch.stack([V["gptq_pack"](codes[e], bits, K, N) for e in range(E)])
            for pname in ("empty", "actorder"):
                if pname == "empty":
                    perm = torch.empty(E, 0, dtype=torch.int32)
                else:
                    perm = torch.stack(
                        [
                            torch.argsort(torch.randint(0, K // 32, (K,), generator=g), stable=True)
                            for _ in range(E)
                        ]
                    ).to(torch.int32)
                ref = torch.stack([V["ref_repack"](q[e], K, N, bits, perm[e]) for e in range(E)])
                if pname == "empty":
                    # vLLM's own MoE wrapper body (vllm/_custom_ops.py:1154, no perm in 0.32)
                    ref_ops = V["ops"].gptq_marlin_moe_repack(q, K, N, bits)
                    assert torch.equal(ref, ref_ops)
                got = R.gptq_marlin_moe_repack(q, perm, K, N, bits)
                got_n = R.gptq_marlin_moe_repack(q.numpy(), perm.numpy(), K, N, bits)
                desc = f"seed={seed} bits={bits} E={E} K={K} N={N} perm={pname}"
                record(
                    "2 moe repack",
                    same_bytes(got, ref) and tuple(got.shape) == (E, K // 16, N * 16 // pf),
                    desc,
                )
                record("2 moe repack (numpy)", same_bytes(got_n, ref), desc)

# ---------------- 3. scales ----------------
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
for seed in SEEDS:
    g = torch.Generator().manual_seed(200 + seed)
    for K in KS:
        for N in NS + [32, 96, 160]:  # 32/96/160: not multiples of 64, accepted by vLLM's function
            for gs in (-1, 32, 64, 128, K):
                G = 1 if gs == -1 else K // gs
                for dname, dt in DTYPES.items():
                    s = torch.randn(G, N, generator=g).to(dt)
                    desc = f"seed={seed} K={K} N={N} group={gs} dtype={dname}"
                    try:
                        ref = V["marlin_permute_scales"](s, K, N, gs)
                    except RuntimeError:
                        continue  # vLLM itself cannot reshape (G*N not a multiple of the table)
                    tag = "3 scales" + ("" if N % 64 == 0 else " (N%64!=0)")
                    try:
                        got = R.marlin_permute_scales(s, K, N, gs)
                        ok = same_bytes(got, ref) and got.dtype == dt
                    except R.LayoutError as e:
                        ok = "refused" if "multiple of 64" in str(e) else False
                        desc += f" raised LayoutError: {e}"
                    except Exception as e:  # noqa: BLE001
                        ok, desc = False, desc + f" raised {type(e).__name__}: {e}"
                    record(tag, ok, desc)
                    if dname == "bf16":
                        u16 = s.view(torch.int16).numpy().view(np.uint16)
                        try:
                            got = R.marlin_permute_scales(u16, K, N, gs)
                            ok = got.dtype == np.uint16 and same_bytes(
                                got.view(np.int16), ref.view(torch.int16)
                            )
                        except R.LayoutError as e:
                            ok = "refused" if "multiple of 64" in str(e) else False
                        record(tag + " bf16-as-uint16 numpy", ok, desc)
                    if dname == "fp32":
                        try:
                            got = R.marlin_permute_scales(s.numpy(), K, N, gs)
                            ok = same_bytes(got, ref)
                        except R.LayoutError as e:
                            ok = "refused" if "multiple of 64" in str(e) else False
                        record(tag + " fp32 numpy", ok, desc)
    # MoE scales: sizes used by _process_weights_marlin (int_wna16.py:686-700)
    for E in (1, 3):
        for H, I in [(256, 128), (128, 64), (512, 256), (256, 192)]:
            for gs in (-1, 32, 64, 128):
                for dname, dt in DTYPES.items():
                    for which, (kk, nn) in {"w13": (H, 2 * I), "w2": (I, H)}.items():
                        if gs != -1 and kk % gs:
                            continue
                        G = 1 if gs == -1 else kk // gs
                        s = torch.randn(E, G, nn, generator=g).to(dt)
                        for size_k in {I, kk, G * (gs if gs != -1 else 8)}:
                            ref = V["marlin_moe_permute_scales"](s, size_k, nn, gs)
                            got = R.marlin_moe_permute_scales(s, size_k, nn, gs)
                            record(
                                "3 moe scales",
                                same_bytes(got, ref) and got.dtype == dt,
                                f"seed={seed} E={E} {which} K={kk} N={nn} "
                                f"size_k={size_k} g={gs} {dname}",
                            )

# ---------------- 4. zero points ----------------
for seed in SEEDS:
    g = torch.Generator().manual_seed(300 + seed)
    for bits in (4, 8):
        for G in (1, 2, 4, 8):
            for N in NS:
                zp = torch.randint(0, 1 << bits, (G, N), generator=g, dtype=torch.int32)
                ref = V["marlin_zero_points"](zp.clone(), G, N, bits)
                desc = f"seed={seed} bits={bits} G={G} N={N}"
                got = R.marlin_zero_points(zp, G, N, bits)
                record("4 zero points", same_bytes(got, ref) and got.dtype == torch.int32, desc)
                got = R.marlin_zero_points(zp.numpy().astype(np.uint8), G, N, bits)
                record("4 zero points (numpy uint8 codes)", same_bytes(got, ref), desc)
                # compressed-tensors packed path (moe_packed_to_marlin_zero_points, 1 expert)
                packed = V["pack_cols"](zp, bits, G, N)[None]
                ref2 = V["moe_packed_to_marlin_zero_points"](packed, G, N, bits)[0]
                record(
                    "4 zero points via moe_packed_to_marlin_zero_points",
                    same_bytes(got, ref2),
                    desc,
                )

print("check                                              pass  fail  refused")
for k, (p, f, r) in stats.items():
    print(f"{k:50s} {p:5d} {f:5d} {r:5d}")
for f in fails[:40]:
    print("FAIL", f)
print("total fails:", len(fails))
sys.exit(1 if fails else 0)
