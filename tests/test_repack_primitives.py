"""moeq_rs.repack against an independent numpy implementation of the spec (tests/marlin_ref.py),
round trips through the inverses, and the layout rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from marlin_ref import (
    SCALE_PERM_GROUPED,
    SCALE_PERM_SINGLE,
    gptq_pack,
    permute_bias,
    permute_scales,
    repack,
    weight_perm,
    zero_points,
)

import moeq_rs as mq
from moeq_rs import repack as r

rng = np.random.default_rng()


def random_qweight(k: int, n: int, bits: int) -> np.ndarray:
    return (
        rng.integers(0, 2**32, size=(k * bits // 32, n), dtype=np.uint64)
        .astype(np.uint32)
        .view(np.int32)
    )


def test_tables_first_entries_match_the_reference() -> None:
    assert weight_perm(4)[:16].tolist() == [
        0,
        128,
        8,
        136,
        16,
        144,
        24,
        152,
        256,
        384,
        264,
        392,
        272,
        400,
        280,
        408,
    ]
    assert weight_perm(8)[:16].tolist() == [
        0,
        128,
        16,
        144,
        8,
        136,
        24,
        152,
        256,
        384,
        272,
        400,
        264,
        392,
        280,
        408,
    ]
    assert SCALE_PERM_GROUPED[:10].tolist() == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9]
    assert SCALE_PERM_SINGLE[:10].tolist() == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3]


SHAPES = [(128, 64), (256, 192), (384, 128), (512, 256), (1024, 640)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("act_order", [False, True])
def test_repack_matches_numpy_reference(bits: int, k: int, n: int, act_order: bool) -> None:
    q = random_qweight(k, n, bits)
    perm = rng.permutation(k).astype(np.int32) if act_order else np.zeros(0, np.int32)
    got = r.gptq_marlin_repack(q, perm, k, n, bits)
    assert got.dtype == np.int32 and got.shape == (k // 16, n * 16 * bits // 32)
    np.testing.assert_array_equal(got, repack(q, perm, bits))
    np.testing.assert_array_equal(r.gptq_marlin_unrepack(got, perm, k, n, bits), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_moe_repack_matches_per_expert(bits: int) -> None:
    e, k, n = 3, 256, 128
    q = np.stack([random_qweight(k, n, bits) for _ in range(e)])
    perms = np.stack([rng.permutation(k) for _ in range(e)]).astype(np.int32)
    got = r.gptq_marlin_moe_repack(q, perms, k, n, bits)
    assert got.shape == (e, k // 16, n * bits // 2)
    for i in range(e):
        np.testing.assert_array_equal(got[i], repack(q[i], perms[i], bits))
    dense = r.gptq_marlin_moe_repack(q, np.zeros((e, 0), np.int32), k, n, bits)
    for i in range(e):
        np.testing.assert_array_equal(dense[i], repack(q[i], None, bits))


@pytest.mark.parametrize("group_size", [-1, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_match_numpy_reference(group_size: int, dtype: torch.dtype) -> None:
    k, n = 256, 192
    g = 1 if group_size == -1 else k // group_size
    s = torch.randn(g, n).to(dtype)
    got = r.marlin_permute_scales(s, k, n, group_size)
    assert got.dtype == dtype and got.shape == s.shape
    bits = s.view(torch.int16 if dtype != torch.float32 else torch.int32).numpy()
    expected = permute_scales(bits, k, group_size)
    assert np.array_equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32).numpy(), expected
    )
    assert torch.equal(r.marlin_unpermute_scales(got, k, n, group_size), s)
    # bf16 as its uint16 bit pattern, numpy in -> numpy out.
    u16 = s.view(torch.int16).numpy().view(np.uint16) if dtype != torch.float32 else None
    if u16 is not None:
        out = r.marlin_permute_scales(u16, k, n, group_size)
        assert out.dtype == np.uint16 and np.array_equal(out.view(np.int16), expected)


def test_scale_table_choice_uses_size_k() -> None:
    s = rng.standard_normal((1, 128)).astype(np.float32)
    # group_size == size_k: one group, the single table (as vLLM does).
    np.testing.assert_array_equal(
        r.marlin_permute_scales(s, 128, 128, 128),
        s.reshape(-1, 32)[:, SCALE_PERM_SINGLE].reshape(s.shape),
    )
    np.testing.assert_array_equal(
        r.marlin_permute_scales(s, 256, 128, 128),
        s.reshape(-1, 64)[:, SCALE_PERM_GROUPED].reshape(s.shape),
    )


def test_moe_scales() -> None:
    s = rng.standard_normal((4, 2, 128)).astype(np.float16)
    got = r.marlin_moe_permute_scales(s, 256, 128, 128)
    for e in range(4):
        np.testing.assert_array_equal(got[e], permute_scales(s[e], 256, 128))


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_points_match_numpy_reference(bits: int) -> None:
    g, n = 4, 192
    zp = rng.integers(0, 2**bits, size=(g, n)).astype(np.int32)
    got = r.marlin_zero_points(zp, g, n, bits)
    assert got.shape == (g, n * bits // 32)
    np.testing.assert_array_equal(got, zero_points(zp, bits))
    np.testing.assert_array_equal(r.marlin_zero_points_inverse(got, g, n, bits), zp)


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.int16, np.uint32])
def test_zero_points_are_int32_words_whatever_the_codes_dtype(dtype: type) -> None:
    # int64 codes (numpy's and torch's default integers) came back as int64 bit patterns of
    # half the documented width, uint8 ones as 4x as many bytes.
    g, n = 2, 128
    zp = rng.integers(0, 16, size=(g, n))
    want = zero_points(zp.astype(np.int32), 4)
    got = r.marlin_zero_points(zp.astype(dtype), g, n, 4)
    assert got.dtype == np.int32 and got.shape == (g, n * 4 // 32)
    np.testing.assert_array_equal(got, want)
    got_t = r.marlin_zero_points(torch.from_numpy(zp.astype(dtype)), g, n, 4)
    assert got_t.dtype == torch.int32
    np.testing.assert_array_equal(got_t.numpy(), want)
    np.testing.assert_array_equal(r.marlin_zero_points_inverse(got_t, g, n, 4).numpy(), zp)


def test_bias() -> None:
    b = torch.randn(256).to(torch.bfloat16)
    got = r.marlin_permute_bias(b)
    assert np.array_equal(got.view(torch.int16).numpy(), permute_bias(b.view(torch.int16).numpy()))
    assert torch.equal(r.marlin_unpermute_bias(got), b)


def test_torch_in_torch_out_and_non_contiguous_input() -> None:
    k, n, bits = 256, 128, 4
    q = random_qweight(k, 2 * n, bits)[:, ::2]  # non-contiguous view
    assert not q.flags.c_contiguous
    expected = repack(np.ascontiguousarray(q), None, bits)
    np.testing.assert_array_equal(r.gptq_marlin_repack(q, None, k, n, bits), expected)
    t = torch.from_numpy(np.ascontiguousarray(q)).t().contiguous().t()  # non-contiguous tensor
    out = r.gptq_marlin_repack(t, torch.empty(0, dtype=torch.int32), k, n, bits)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.int32
    assert np.array_equal(out.numpy(), expected)


def test_gptq_pack_reference_roundtrip() -> None:
    codes = rng.integers(0, 16, size=(128, 64)).astype(np.uint32)
    q = gptq_pack(codes, 4)
    assert q.shape == (16, 64)
    from marlin_ref import gptq_codes

    np.testing.assert_array_equal(gptq_codes(q, 4), codes)


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda: r.gptq_marlin_repack(random_qweight(256, 64, 4)[:, :50], None, 256, 50, 4),
            "size_n=50 is not a positive multiple of 64",
        ),
        (
            lambda: r.gptq_marlin_repack(random_qweight(256, 64, 4), None, 200, 64, 4),
            "size_k=200 is not a positive multiple of 16",
        ),
        (
            lambda: r.gptq_marlin_repack(random_qweight(256, 64, 4), None, 256, 64, 3),
            "num_bits=3 is not supported",
        ),
        (
            lambda: r.gptq_marlin_repack(random_qweight(256, 64, 4), None, 256, 128, 4),
            "qweight has 2048 words, expected",
        ),
        (
            lambda: r.gptq_marlin_repack(
                random_qweight(256, 64, 4), np.zeros(256, np.int32), 256, 64, 4
            ),
            "appears twice",
        ),
        (
            lambda: r.gptq_marlin_repack(
                random_qweight(256, 64, 4).astype(np.float32), None, 256, 64, 4
            ),
            "expected int32 packed words",
        ),
        # bf16 tensors cross as int16 bits: named as bf16, and not taken as integer codes.
        (
            lambda: r.gptq_marlin_repack(
                torch.zeros(32, 64, dtype=torch.bfloat16), None, 256, 64, 4
            ),
            "qweight: expected int32 packed words, got dtype torch.bfloat16",
        ),
        (
            lambda: r.marlin_zero_points(torch.zeros(2, 64, dtype=torch.bfloat16), 2, 64, 4),
            "zp: expected integer codes, got dtype torch.bfloat16",
        ),
        (
            lambda: r.gptq_marlin_repack(
                random_qweight(256, 64, 4), torch.zeros(256, dtype=torch.bfloat16), 256, 64, 4
            ),
            "perm: expected an integer array, got dtype torch.bfloat16",
        ),
        (
            lambda: r.marlin_permute_scales(np.zeros((2, 100), np.float16), 256, 100, 128),
            "size_n=100",
        ),
        (
            lambda: r.marlin_zero_points(np.full((2, 64), 16, np.int32), 2, 64, 4),
            "does not fit in 4 bits",
        ),
        (
            lambda: r.marlin_permute_scales(np.zeros((2, 64), np.int8), 256, 64, 128),
            "2- or 4-byte dtype",
        ),
        # Integer arguments out of the native module's range, or not integers: named, not an
        # OverflowError.
        (
            lambda: r.gptq_marlin_repack(random_qweight(256, 64, 4), None, -256, 64, 4),
            "size_k: -256 is not an int",
        ),
        (
            lambda: r.gptq_marlin_unrepack(random_qweight(256, 64, 4), None, 256, 2**64, 4),
            f"size_n: {2**64} is not an int",
        ),
        (
            lambda: r.gptq_marlin_moe_repack(
                random_qweight(256, 64, 4)[None], None, 256, 64, num_bits=-4
            ),
            "num_bits: -4 is not an int",
        ),
        (
            lambda: r.marlin_permute_scales(np.zeros((2, 64), np.float16), 256, 64, 2**63),
            "group_size: 9223372036854775808 is not an int",
        ),
        (
            lambda: r.marlin_zero_points(np.zeros((2, 64), np.int32), 2.0, 64, 4),
            "size_k: 2.0 is not an int",
        ),
        (
            lambda: r.marlin_zero_points_inverse(np.zeros((2, 8), np.int32), 2, True, 4),
            "size_n: True is not an int",
        ),
    ],
)
def test_layout_errors(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(mq.LayoutError, match=match):
        call()


def test_integer_arguments_accept_numpy_and_torch_integers() -> None:
    q = random_qweight(256, 64, 4)
    want = r.gptq_marlin_repack(q, None, 256, 64, 4)
    got = r.gptq_marlin_repack(q, None, np.int64(256), torch.tensor(64), num_bits=np.uint8(4))
    assert np.array_equal(got, want)
