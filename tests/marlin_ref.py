"""An independent numpy implementation of the Marlin layout, written from the table form of the
spec (reference/marlin_layout.md §5.3, §6, §7), not from moeq_rs's closed-form Rust code."""

from __future__ import annotations

import numpy as np


def weight_perm(bits: int) -> np.ndarray:
    perm: list[int] = []
    for i in range(32):
        col = i // 4
        lane: list[int] = []
        for block in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1):
                lane.append(16 * row + col + 8 * block)
        for j in range(4):
            perm.extend(p + 256 * j for p in lane)
    arr = np.array(perm)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]
    return arr.reshape(-1, len(interleave))[:, interleave].ravel()


SCALE_PERM_GROUPED = np.array([i + 8 * j for i in range(8) for j in range(8)])
SCALE_PERM_SINGLE = np.array([2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)])


def pack_along_last(codes: np.ndarray, bits: int) -> np.ndarray:
    """Consecutive runs of 32/bits codes into one word, element j at bit j*bits."""
    pf = 32 // bits
    c = codes.astype(np.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // pf, pf)
    out = np.zeros(c.shape[:-1], dtype=np.uint32)
    for j in range(pf):
        out |= c[..., j] << np.uint32(j * bits)
    return out.view(np.int32)


def unpack_along_last(words: np.ndarray, bits: int) -> np.ndarray:
    pf = 32 // bits
    w = words.view(np.uint32)
    out = np.zeros((*w.shape, pf), dtype=np.uint32)
    for j in range(pf):
        out[..., j] = (w >> np.uint32(j * bits)) & np.uint32((1 << bits) - 1)
    return out.reshape(*w.shape[:-1], w.shape[-1] * pf)


def gptq_codes(qweight: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight [K/pf, N] (packed along K) to codes [K, N]."""
    pf = 32 // bits
    w = qweight.view(np.uint32)
    k_words, n = w.shape
    out = np.zeros((k_words, pf, n), dtype=np.uint32)
    for j in range(pf):
        out[:, j, :] = (w >> np.uint32(j * bits)) & np.uint32((1 << bits) - 1)
    return out.reshape(k_words * pf, n)


def gptq_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    return pack_along_last(codes.T.copy(), bits).T.copy()


def marlin_weights(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [K, N] (already act-order sorted) to Marlin words [K/16, N*16/pf]."""
    k, n = codes.shape
    c = codes.reshape(k // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(k // 16, 16 * n)
    perm = weight_perm(bits)
    c = c.reshape(-1, 1024)[:, perm].reshape(k // 16, 16 * n)
    return pack_along_last(c, bits)


def repack(qweight: np.ndarray, perm: np.ndarray | None, bits: int) -> np.ndarray:
    codes = gptq_codes(qweight, bits)
    if perm is not None and perm.size:
        codes = codes[perm]
    return marlin_weights(codes, bits)


def permute_scales(s: np.ndarray, size_k: int, group_size: int) -> np.ndarray:
    table = SCALE_PERM_GROUPED if group_size != -1 and group_size < size_k else SCALE_PERM_SINGLE
    return s.reshape(-1, len(table))[:, table].reshape(s.shape)


def permute_bias(b: np.ndarray) -> np.ndarray:
    return b.reshape(-1, 32)[:, SCALE_PERM_SINGLE].reshape(b.shape)


def zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """Codes [G, N] to Marlin zero points [G, N/pf]."""
    g, n = zp.shape
    z = zp.reshape(-1, 64)[:, SCALE_PERM_GROUPED].reshape(g, n)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]
    z = z.reshape(-1, len(interleave))[:, interleave].reshape(g, n)
    return pack_along_last(z, bits)


def ct_unpack_rows(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """CT weight_packed [rows, ceil(cols*bits/32)] to unsigned codes [rows, cols]."""
    return unpack_along_last(packed, bits)[:, :cols]


def ct_unpack_zero_points(zp: np.ndarray, bits: int, rows: int) -> np.ndarray:
    """compressed-tensors packed zero points [ceil(rows*bits/32), G] to codes [G, rows]."""
    return unpack_along_last(np.ascontiguousarray(zp.T), bits)[:, :rows]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def ct_moe_to_marlin(
    experts: list[dict[str, np.ndarray]],
    hidden: int,
    inter: int,
    bits: int,
    group: int,
    symmetric: bool,
    act_order: bool,
) -> dict[str, np.ndarray]:
    """The "newer main" CT MoE -> Marlin recipe of reference/marlin_layout.md §8/§8b.

    ``experts[e]`` maps ``"gate"|"up"|"down"`` + ``"_packed" | "_scale" | "_zp" | "_g_idx"`` to
    the checkpoint arrays (scales as raw 16/32-bit patterns).
    """
    pf = 32 // bits
    lcm = 64 if group <= 0 else np.lcm(64, group)
    ip = inter if act_order else _round_up(inter, int(lcm))
    out: dict[str, list[np.ndarray]] = {
        k: [] for k in ("w13", "w2", "s13", "s2", "z13", "z2", "g13", "p13", "g2", "p2")
    }
    for x in experts:
        gate = ct_unpack_rows(x["gate_packed"], bits, hidden).T  # [H, I]
        up = ct_unpack_rows(x["up_packed"], bits, hidden).T
        down = ct_unpack_rows(x["down_packed"], bits, inter).T  # [I, H]
        w13 = np.zeros((hidden, 2 * ip), dtype=np.uint32)
        w13[:, :inter], w13[:, ip : ip + inter] = gate, up
        w2 = np.zeros((ip, hidden), dtype=np.uint32)
        w2[:inter] = down
        if act_order:
            p13 = np.argsort(x["gate_g_idx"], kind="stable")
            p2 = np.argsort(x["down_g_idx"], kind="stable")
            w13, w2 = w13[p13], w2[p2]
            out["g13"].append(x["gate_g_idx"][p13].astype(np.int32))
            out["p13"].append(p13.astype(np.int32))
            out["g2"].append(x["down_g_idx"][p2].astype(np.int32))
            out["p2"].append(p2.astype(np.int32))
        out["w13"].append(marlin_weights(w13, bits))
        out["w2"].append(marlin_weights(w2, bits))
        gh = x["gate_scale"].shape[1]
        s13 = np.zeros((gh, 2 * ip), dtype=x["gate_scale"].dtype)
        s13[:, :inter], s13[:, ip : ip + inter] = x["gate_scale"].T, x["up_scale"].T
        out["s13"].append(permute_scales(s13, inter, group))
        gi_src = x["down_scale"].shape[1]
        gi = ip // group if group > 0 else 1
        s2 = np.zeros((gi, hidden), dtype=x["down_scale"].dtype)
        s2[:gi_src] = x["down_scale"].T
        out["s2"].append(permute_scales(s2, gi * (group if group > 0 else pf), group))
        if not symmetric:
            z13 = np.zeros((gh, 2 * ip), dtype=np.uint32)
            z13[:, :inter] = ct_unpack_zero_points(x["gate_zp"], bits, inter)
            z13[:, ip : ip + inter] = ct_unpack_zero_points(x["up_zp"], bits, inter)
            z2 = np.zeros((gi, hidden), dtype=np.uint32)
            z2[:gi_src] = ct_unpack_zero_points(x["down_zp"], bits, hidden)
            out["z13"].append(zero_points(z13, bits))
            out["z2"].append(zero_points(z2, bits))
    return {k: np.stack(v) for k, v in out.items() if v}


def marlin_moe_case(
    rng: np.random.Generator,
    experts: int,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    *,
    zero_points_on: bool = False,
    act_order: bool = False,
    scale_size_k: int | None = None,
) -> dict[str, np.ndarray]:
    """Random WNA16 expert weights and their Marlin MoE tensors, built with this module's
    table-form layout: ``codes`` [E, K, N] (biased, as stored), ``scales`` [E, G, N] f32,
    ``zp`` [E, G, N] codes or absent, ``g_idx`` [E, K] (original order); Marlin ``w`` [E, K/16,
    N*16/pf], ``s`` [E, G, N] (table chosen from ``scale_size_k``, default K), ``z`` [E, G, N/8],
    ``g_sorted`` and ``perm`` [E, K]; and ``weights`` [E, K, N] f64, the dequantised weights in
    original row order."""
    groups = 1 if group_size == -1 else k // group_size
    gs = k if group_size == -1 else group_size
    codes = rng.integers(0, 1 << bits, size=(experts, k, n), dtype=np.int64)
    scales = rng.uniform(0.5, 2.0, size=(experts, groups, n)).astype(np.float32) / 64
    zp = rng.integers(0, 16, size=(experts, groups, n)) if zero_points_on else None
    if act_order:
        g_idx = np.stack([rng.permutation(np.arange(k) // gs) for _ in range(experts)])
    else:
        g_idx = np.broadcast_to(np.arange(k) // gs, (experts, k)).copy()
    perm = np.stack([np.argsort(g, kind="stable") for g in g_idx])
    bias = zp if zp is not None else np.full((experts, groups, n), 1 << (bits - 1))
    rows = np.arange(experts)[:, None]
    weights = (codes - np.take_along_axis(bias, g_idx[:, :, None].repeat(n, 2), 1)) * (
        np.take_along_axis(scales.astype(np.float64), g_idx[:, :, None].repeat(n, 2), 1)
    )
    size_k = k if scale_size_k is None else scale_size_k
    out = {
        "codes": codes,
        "scales": scales,
        "g_idx": g_idx,
        "weights": weights,
        "w": np.stack([marlin_weights(codes[e][perm[e]], bits) for e in range(experts)]).view(
            np.int32
        ),
        "s": np.stack([permute_scales(scales[e], size_k, group_size) for e in range(experts)]),
        "g_sorted": g_idx[rows, perm].astype(np.int32),
        "perm": perm.astype(np.int32),
    }
    if zp is not None:
        out["zp"] = zp
        out["z"] = np.stack([zero_points(zp[e], bits) for e in range(experts)])
    return out
