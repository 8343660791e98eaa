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
