"""The CUDA path on a CPU-only machine: NVRTC from the nvidia wheel compiles every kernel
variant to CUBIN for sm_80 and sm_90 with no register spills; no-driver answers are False, not
exceptions. GPU tests (launches) need a device and skip with a reason here."""

from __future__ import annotations

import locale
import os

import numpy as np
import pytest

import moeq_rs as mq

HAVE_NVRTC = bool(mq.cuda.nvrtc_dirs()) or bool(os.environ.get("MOEQ_NVRTC_PATH"))


def test_no_driver_answers_are_false_not_exceptions() -> None:
    assert isinstance(mq.cuda.driver_present(), bool)
    # No driver, or no GPU torch sees: False, never an exception.
    assert mq.cuda.is_available() is (mq.cuda.driver_present() and _gpu())


@pytest.mark.skipif(
    not HAVE_NVRTC and not os.environ.get("MOEQ_REQUIRE_NVRTC"),
    reason="no NVRTC here (install torch's CUDA build or nvidia-cuda-nvrtc)",
)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_kernel_variant_compiles_without_spills(arch: str) -> None:
    """Also on the oldest NVRTC we take (``MOEQ_NVRTC_PATH`` at the nvidia-cuda-nvrtc-cu12 12.1
    wheel's ``lib``): it did not resolve ``__dp4a``, and 12.1 to 12.4 left the calling thread in
    the "C" locale, after which Python in the process read and wrote text as ASCII."""
    major, _minor, _path = mq.cuda.nvrtc_version()
    assert major >= 12
    locale_before = (locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False))
    report = mq.cuda.compile_kernels(arch)
    assert (locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)) == locale_before
    assert len(report) >= 4
    expected = {
        "moe_routing",
        "moe_align",
        "moe_act_bf16",
        "quant_int8_f16",
        "w8a8_gemm_bf16",
        "wna16_gemm_f16",
        "wna16_gemm_bf16",
        "w8a8_imma_f32",
        "w8a8_imma_bf16",
    }
    assert expected <= set(report)
    for name, r in report.items():
        assert r["cubin_bytes"] > 1000, name
        assert r["spill_stores"] == 0, f"{name} spills on {arch}"
        assert 0 < r["registers"] <= 255, name
        assert r["seconds"] > 0 and r["entries"], name
    assert "w8a8_grouped_gemm_bf16" in report["w8a8_gemm_bf16"]["entries"]
    assert "wna16_moe_gemm_f16" in report["wna16_gemm_f16"]["entries"]
    assert "w8a8_imma_gemm_bf16" in report["w8a8_imma_bf16"]["entries"]
    assert "wna16_gemm_f32" not in report  # mma.sync takes 16-bit operands only


@pytest.mark.skipif(not HAVE_NVRTC, reason="no NVRTC here")
def test_bad_architecture_is_a_clear_error() -> None:
    with pytest.raises(mq.CudaUnavailableError, match="not a GPU architecture"):
        mq.cuda.compile_kernels("compute_90")
    with pytest.raises(mq.CudaUnavailableError, match="sm_7"):
        mq.cuda.compile_kernels("sm_7")


def test_cuda_moe_checks_its_arguments_before_any_launch() -> None:
    import torch

    x = torch.randn(2, 8)
    w13 = torch.zeros(2, 8, 8, dtype=torch.int8)
    with pytest.raises(mq.LayoutError, match="hidden_states: expected a CUDA tensor"):
        mq.cuda.w8a8_moe(
            x,
            torch.randn(2, 2),
            w13,
            torch.ones(2, 8),
            torch.zeros(2, 8, 4, dtype=torch.int8),
            torch.ones(2, 8),
            top_k=1,
        )


def wna16_kernel_model(
    w: np.ndarray,
    s: np.ndarray,
    z: np.ndarray | None,
    g_sorted: np.ndarray | None,
    k: int,
    n: int,
    bits: int,
    group_size: int,
    grouped: bool,
) -> np.ndarray:
    """One expert's weights [K, N] (Marlin row order) as cuda/wna16_gemm.cu reads them: the same
    index arithmetic per (k-tile, n-tile, warp, lane) - which word and bit field holds each
    B-fragment code, the permuted scale position, the zero-point nibble - written out in numpy.
    It checks the kernel's reading of the layout against the independent table-form layout of
    marlin_ref.py; the GPU run itself is scripts/gpu_check.sh."""

    def scale_pos(c: int, grouped_table: bool) -> int:
        if grouped_table:
            cc = c & 63
            return (c & ~63) + 8 * (cc & 7) + (cc >> 3)
        cc, r = c & 31, c & 7
        return (c & ~31) + 8 * (r >> 1) + 2 * (cc >> 3) + (r & 1)

    words = 128 if bits == 4 else 256
    n_tiles = n // 64
    flat = w.reshape(-1).view(np.uint32)
    sf = s.reshape(-1).astype(np.float64)
    zf = None if z is None else z.reshape(-1).view(np.uint32)
    bias = 8 if bits == 4 else 128
    out = np.full((k, n), np.nan)
    for kt in range(k // 16):
        for nt in range(n_tiles):
            tw = flat[(kt * n_tiles + nt) * words : (kt * n_tiles + nt + 1) * words]
            for warp in range(4):
                for lane in range(32):
                    gq, t = lane >> 2, lane & 3
                    cols = (nt * 64 + warp * 16 + gq, nt * 64 + warp * 16 + gq + 8)
                    if bits == 4:
                        q = int(tw[4 * lane + warp])
                        codes = [
                            [(q >> (4 * sl)) & 15 for sl in row]
                            for row in ((0, 4, 1, 5), (2, 6, 3, 7))
                        ]
                    else:
                        codes = [
                            [
                                (int(tw[8 * lane + 2 * warp + j]) >> (8 * sl)) & 255
                                for sl in (0, 2, 1, 3)
                            ]
                            for j in (0, 1)
                        ]
                    for j, col in enumerate(cols):
                        for i in range(4):
                            krow = kt * 16 + 2 * t + (i & 1) + 8 * (i >> 1)
                            g = int(g_sorted[krow]) if g_sorted is not None else krow // group_size
                            sc = sf[g * n + scale_pos(col, grouped)]
                            zz = float(bias)
                            if zf is not None:
                                p = scale_pos(col, True)
                                x = p & 7
                                word = int(zf[(g * n + p) >> 3])
                                zz = float((word >> (4 * ((x >> 1) + 4 * (x & 1)))) & 15)
                            out[krow, col] = (codes[j][i] - zz) * sc
    return out


@pytest.mark.parametrize(
    "bits,group_size,zp,act_order,scale_size_k",
    [
        (4, 32, False, False, None),
        (8, 64, False, False, None),
        (4, -1, False, False, None),
        (8, -1, False, False, None),
        (4, 32, True, False, None),
        (4, 32, False, True, None),
        (8, 32, False, True, None),
        (4, 64, False, False, 64),  # w13's rule: group_size >= I picks the single table
    ],
)
def test_wna16_kernel_reads_the_marlin_layout(
    bits: int, group_size: int, zp: bool, act_order: bool, scale_size_k: int | None
) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from marlin_ref import marlin_moe_case

    k, n = 128, 128
    case = marlin_moe_case(
        np.random.default_rng(7),
        1,
        k,
        n,
        bits,
        group_size,
        zero_points_on=zp,
        act_order=act_order,
        scale_size_k=scale_size_k,
    )
    grouped = group_size != -1 and group_size < (scale_size_k or k)
    got = wna16_kernel_model(
        case["w"][0],
        case["s"][0],
        case["z"][0] if zp else None,
        case["g_sorted"][0] if act_order else None,
        k,
        n,
        bits,
        k if group_size == -1 else group_size,
        grouped,
    )
    want = case["weights"][0][case["perm"][0]]  # Marlin row r is original row perm[r]
    assert not np.isnan(got).any(), "some weight was never read"
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_wna16_checks_its_arguments_before_any_launch() -> None:
    import torch

    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 16, 256, dtype=torch.int32)
    with pytest.raises(mq.LayoutError, match="hidden_states: expected a CUDA tensor"):
        mq.cuda.wna16_moe(
            x,
            torch.randn(2, 2),
            w13,
            torch.ones(2, 2, 128),
            torch.zeros(2, 4, 512, dtype=torch.int32),
            torch.ones(2, 1, 256),
            num_bits=4,
            group_size=128,
            top_k=1,
            intermediate_size=128,
        )


class _Validated(Exception):
    """Raised in place of the first launch: every argument check passed."""


def _validate_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def stop(*_args: object, **_kwargs: object) -> None:
        raise _Validated

    monkeypatch.setattr(mq.cuda, "_check_cuda_tensors", lambda *_a: None)
    monkeypatch.setattr(mq.cuda, "_Routed", stop)


@pytest.mark.parametrize(
    "name", ["qwen3_w4a16_g128_sym", "qwen3_w8a16_channel", "qwen3_w4a16_actorder"]
)
def test_wna16_takes_what_the_marlin_repack_writes(
    fixture_path, tmp_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The repacked checkpoint's tensors pass every check of the WNA16 launcher (stopped before
    its first launch), and bad shapes or schemes are refused with the argument named."""
    import json

    import torch
    from safetensors.torch import load_file

    out = tmp_path / "marlin"
    mq.repack.repack_checkpoint(fixture_path(name), out)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    ckpt = mq.open(fixture_path(name))
    info = ckpt.moe_layers()[0]
    p = f"{info['prefix']}.experts"
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    group = next(iter(q["config_groups"].values()))["weights"]
    bits, gs = group["num_bits"], group["group_size"] or -1
    if group.get("strategy") == "channel":
        gs = -1
    act = {}
    if f"{p}.w13_g_idx_sort_indices" in tensors and tensors[f"{p}.w13_g_idx_sort_indices"].numel():
        act = {
            "w13_g_idx": tensors[f"{p}.w13_weight_g_idx"],
            "w2_g_idx": tensors[f"{p}.w2_weight_g_idx"],
            "w13_sort_indices": tensors[f"{p}.w13_g_idx_sort_indices"],
            "w2_sort_indices": tensors[f"{p}.w2_g_idx_sort_indices"],
        }
    moe = mq.MoELayer.from_checkpoint(ckpt, info["layer"])
    e, h = moe.num_experts, moe.hidden_size
    x = torch.randn(3, h, dtype=torch.bfloat16)
    args = (
        x,
        torch.randn(3, e),
        tensors[f"{p}.w13_weight_packed"],
        tensors[f"{p}.w13_weight_scale"],
        tensors[f"{p}.w2_weight_packed"],
        tensors[f"{p}.w2_weight_scale"],
    )
    _validate_only(monkeypatch)
    with pytest.raises(_Validated):
        mq.cuda.wna16_moe(
            *args, num_bits=bits, group_size=gs, top_k=moe.top_k, intermediate_size=128, **act
        )
    with pytest.raises(mq.LayoutError, match="w2:"):
        mq.cuda.wna16_moe(
            *args[:4],
            args[4][:, :-1],
            args[5],
            num_bits=bits,
            group_size=gs,
            top_k=1,
            intermediate_size=128,
            **act,
        )
    with pytest.raises(mq.LayoutError, match="hidden_states"):
        mq.cuda.wna16_moe(
            x.float(),
            *args[1:],
            num_bits=bits,
            group_size=gs,
            top_k=1,
            intermediate_size=128,
            **act,
        )
    with pytest.raises(mq.UnsupportedSchemeError, match="num_bits"):
        mq.cuda.wna16_moe(*args, num_bits=2, group_size=gs, top_k=1, intermediate_size=128, **act)


def test_w8a8_launcher_checks_gemm_and_static_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    e, h, i = 4, 64, 32
    args = (
        torch.randn(3, h),
        torch.randn(3, e),
        torch.zeros(e, 2 * i, h, dtype=torch.int8),
        torch.ones(e, 2 * i),
        torch.zeros(e, h, i, dtype=torch.int8),
        torch.ones(e, h),
    )
    _validate_only(monkeypatch)
    for gemm in ("imma", "dp4a"):
        with pytest.raises(_Validated):
            mq.cuda.w8a8_moe(*args, top_k=2, gemm=gemm)
    with pytest.raises(_Validated):
        mq.cuda.w8a8_moe(*args, top_k=2, a13_scale=torch.ones(e), a2_scale=torch.ones(e))
    with pytest.raises(mq.LayoutError, match="gemm"):
        mq.cuda.w8a8_moe(*args, top_k=2, gemm="wmma")
    with pytest.raises(mq.LayoutError, match="give both"):
        mq.cuda.w8a8_moe(*args, top_k=2, a13_scale=torch.ones(e))
    with pytest.raises(mq.LayoutError, match=r"a2_scale: expected float32 \[4\]"):
        mq.cuda.w8a8_moe(*args, top_k=2, a13_scale=torch.ones(e), a2_scale=torch.ones(e + 1))


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_w4a16_g128_sym",
        "qwen3_w4a16_g128_asym",
        "qwen3_w4a16_actorder",
        "qwen3_w8a16_g128",
        "mixtral_w8a16_channel",
    ],
)
def test_kernel_reads_the_checkpoint_weights_from_the_in_memory_marlin_layer(
    fixture_path, tmp_path, name: str
) -> None:
    """Checkpoint.marlin_layer gives exactly the repack's bytes, and the WNA16 kernel's index
    arithmetic (the numpy model) reads from them every expert's gate, up and down weights as
    compressed-tensors' codes, zero points and scales define them, bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file

    ckpt = mq.open(fixture_path(name))
    info = ckpt.moe_layers()[0]
    geo, tensors = ckpt.marlin_layer(info["layer"])
    out = tmp_path / "marlin"
    mq.repack.repack_checkpoint(ckpt, out)
    on_disk: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        on_disk.update(load_file(f))
    assert tensors and all(torch.equal(t, on_disk[n]) for n, t in tensors.items())
    assert json.loads((out / "config.json").read_text())

    p, e = geo["prefix"], geo["experts"]
    h, i, ip, bits, gs = (
        geo[k] for k in ("hidden", "intermediate", "intermediate_padded", "bits", "group_size")
    )
    names = ("w1", "w3", "w2") if "block_sparse_moe" in p else ("gate_proj", "up_proj", "down_proj")
    act = geo["act_order"]
    for ex in range(e):
        got = {}
        for which, k, n, grouped in (
            ("w13", h, 2 * ip, gs != -1 and gs < i),
            ("w2", ip, h, gs != -1 and (ip // gs) > 1),
        ):
            z = tensors.get(f"{p}.{which}_weight_zero_point")
            g_sorted = tensors.get(f"{p}.{which}_weight_g_idx") if act else None
            w = wna16_kernel_model(
                tensors[f"{p}.{which}_weight_packed"][ex].numpy(),
                tensors[f"{p}.{which}_weight_scale"][ex].float().numpy(),
                None if z is None else z[ex].numpy(),
                None if g_sorted is None else g_sorted[ex].numpy(),
                k,
                n,
                bits,
                k if gs == -1 else gs,
                grouped,
            )
            if act:  # Marlin row r holds original row perm[r]
                perm = tensors[f"{p}.{which}_g_idx_sort_indices"][ex].numpy()
                w = w[np.argsort(perm)]
            got[which] = w
        gate, up, down = (
            ckpt.dequantize(f"{info['prefix']}.experts.{ex}.{m}", exact=True).double().numpy()
            for m in names
        )
        np.testing.assert_array_equal(got["w13"][:, :i], gate.T)
        np.testing.assert_array_equal(got["w13"][:, ip : ip + i], up.T)
        np.testing.assert_array_equal(got["w2"][:i], down.T)


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_w8a8_dynamic",
        "qwen3_w8a8_static",
        "qwen3_w4a16_g128_asym",
        "qwen3_w4a16_actorder",
        "mixtral_w8a16_channel",
    ],
)
def test_cuda_layer_loader_builds_the_launch_arguments(
    fixture_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """load_moe_layer builds its launch arguments on any device; on CPU tensors the
    launch refuses with a named error, and with the device check lifted every argument check
    passes. W8A8 weights stacked for the GPU give the CPU layer's outputs exactly."""
    import torch

    ckpt = mq.open(fixture_path(name))
    layer = ckpt.moe_layers()[0]["layer"]
    moe = mq.cuda.load_moe_layer(ckpt, layer, device="cpu")
    x = torch.randn(5, moe.hidden_size, dtype=torch.bfloat16)
    logits = torch.randn(5, moe.num_experts)
    with pytest.raises(mq.LayoutError, match="expected a CUDA tensor"):
        moe(x, logits)
    assert {"w13", "w13_scale", "w2", "w2_scale"} <= set(dict(moe.named_buffers()))
    if moe.method == "w8a8_int8":
        a = dict(moe.named_buffers())
        static = "a13_scale" in a
        cpu = mq.MoELayer.from_checkpoint(ckpt, layer)
        rebuilt = mq.MoELayer.from_tensors(
            a["w13"],
            a["w2"],
            a["w13_scale"][..., None],
            a["w2_scale"][..., None],
            scheme="w8a8_static" if static else "w8a8_dynamic",
            top_k=moe.top_k,
            a13_scale=a.get("a13_scale"),
            a2_scale=a.get("a2_scale"),
        )
        xf = torch.randn(7, moe.hidden_size)
        lg = torch.randn(7, moe.num_experts)
        assert torch.equal(rebuilt(xf, lg), cpu(xf, lg))
    _validate_only(monkeypatch)
    with pytest.raises(_Validated):
        moe(x, logits)


@pytest.mark.parametrize(
    "name,match",
    [
        ("deepseek_v3_w8a8_dynamic", "shared experts"),
        ("laguna_mixed_int4_int8", "not on the CUDA.*a score-correction bias"),
    ],
)
def test_cuda_layer_loader_names_what_it_cannot_run(fixture_path, name: str, match: str) -> None:
    ckpt = mq.open(fixture_path(name))
    layer = ckpt.moe_layers()[0]["layer"]
    with pytest.raises(mq.UnsupportedSchemeError, match=match):
        mq.cuda.load_moe_layer(ckpt, layer, device="cpu")
    with pytest.raises(mq.LayoutError, match="no MoE block"):
        mq.cuda.load_moe_layer(ckpt, 99, device="cpu")


def test_cuda_layer_loader_without_the_gpu_is_cuda_unavailable(fixture_path) -> None:
    # Moving the weights raised torch's bare RuntimeError ("Found no NVIDIA driver"), which
    # `except mq.MoeqError` missed.
    import torch

    ckpt = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    device = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, on any machine
    with pytest.raises(mq.CudaUnavailableError, match=rf"'{device}': torch sees"):
        mq.cuda.load_moe_layer(ckpt, 0, device=device)
    with pytest.raises(mq.LayoutError, match="'nowhere' is not a torch device"):
        mq.cuda.load_moe_layer(ckpt, 0, device="nowhere")


def test_cuda_layer_loader_refuses_other_activations_and_routers(fixture_path, tmp_path) -> None:
    """A checkpoint whose experts are not SiLU-gated, or whose family routes otherwise, is
    refused, naming hidden_act and model_type, rather than run as a SiLU top-k MoE."""
    import json
    import shutil

    dst = tmp_path / "m"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    cfg["model_type"] = "phimoe"
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mq.UnsupportedSchemeError, match="hidden_act 'gelu'.*model_type 'phimoe'"):
        mq.cuda.load_moe_layer(mq.open(dst), 0, device="cpu")


def test_cuda_layer_goes_through_the_custom_op_under_compile(
    fixture_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torch.compile the CUDA layer is one torch.ops.moeq.moe_forward call on its own
    handle (fake implementation for tracing), which runs its launcher; here the launcher is
    replaced by the CPU layer, since this machine has no GPU."""
    import torch

    ckpt = mq.open(fixture_path("qwen3_w8a8_dynamic"))
    cpu = mq.MoELayer.from_checkpoint(ckpt, 0)

    def launcher(x, routing, *_args, **_kwargs):  # type: ignore[no-untyped-def]
        if isinstance(routing, tuple):
            return cpu._forward_topk_eager(x, *routing)
        return cpu._forward_eager(x, routing)

    monkeypatch.setattr(mq.cuda, "w8a8_moe", launcher)
    moe = mq.cuda.load_moe_layer(ckpt, 0, device="cpu")
    handles = []
    ops = (
        torch.ops.moeq.moe_forward,
        torch.ops.moeq.moe_forward.default,
        torch.ops.moeq.moe_forward_topk,
        torch.ops.moeq.moe_forward_topk.default,
    )

    def backend(gm, _inputs):  # type: ignore[no-untyped-def]
        for node in gm.graph.nodes:
            if node.target in ops:
                handles.append(node.args[-1])  # the layer handle (a graph input) comes last
        return gm.forward

    x, logits = torch.randn(4, moe.hidden_size), torch.randn(4, moe.num_experts)
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend=backend)
    assert torch.equal(compiled(x, logits), cpu(x, logits))
    assert len(handles) == 1
    w, ids = torch.rand(4, 2), torch.randint(0, moe.num_experts, (4, 2))
    topk = torch.compile(moe.forward_topk, fullgraph=True, backend=backend)
    assert torch.equal(topk(x, w, ids), cpu.forward_topk(x, w, ids))
    assert len(handles) == 2


def test_wna16_launcher_refuses_shapes_the_kernel_would_overrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    e, h, i = 2, 192, 128
    args = (
        torch.randn(3, h, dtype=torch.bfloat16),
        torch.randn(3, e),
        torch.zeros(e, h // 16, 2 * i * 2, dtype=torch.int32),
        torch.ones(e, 1, 2 * i),
        torch.zeros(e, i // 16, h * 2, dtype=torch.int32),
        torch.ones(e, 1, h),
    )
    _validate_only(monkeypatch)
    # A group that does not divide H would read the next expert's scales.
    with pytest.raises(mq.UnsupportedSchemeError, match="group_size: 128 must divide H = 192"):
        mq.cuda.wna16_moe(*args, num_bits=4, group_size=128, top_k=1, intermediate_size=i)
    with pytest.raises(_Validated):
        mq.cuda.wna16_moe(*args, num_bits=4, group_size=-1, top_k=1, intermediate_size=i)
    with pytest.raises(mq.LayoutError, match="intermediate_size"):
        mq.cuda.wna16_moe(*args, num_bits=4, group_size=-1, top_k=1, intermediate_size=i + 64)
    odd = torch.empty(3 * h + 1, dtype=torch.bfloat16)[1:].view(3, h)
    with pytest.raises(mq.LayoutError, match="hidden_states: its data must start 4-byte aligned"):
        mq.cuda.wna16_moe(odd, *args[1:], num_bits=4, group_size=-1, top_k=1, intermediate_size=i)
    with pytest.raises(mq.LayoutError, match="split the batch"):
        mq.cuda._check_grid(600_000, 2, 8)
    mq.cuda._check_grid(1024, 8, 128)


def test_w8a8_launcher_refuses_empty_dimensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """H or I of 0 would launch an empty grid (a bare CUDA_ERROR_INVALID_VALUE): refused by
    name, while the same call with I = 4 passes validation."""
    import torch

    e, h = 2, 32
    _validate_only(monkeypatch)
    for inter in (0, 4):
        args = (
            torch.randn(3, h, dtype=torch.bfloat16),
            torch.randn(3, e),
            torch.zeros(e, 2 * inter, h, dtype=torch.int8),
            torch.ones(e, 2 * inter),
            torch.zeros(e, h, inter, dtype=torch.int8),
            torch.ones(e, h),
        )
        if inter == 0:
            with pytest.raises(mq.LayoutError, match="positive multiples of 4.*I=0"):
                mq.cuda.w8a8_moe(*args, top_k=1)
        else:
            with pytest.raises(_Validated):
                mq.cuda.w8a8_moe(*args, top_k=1)


def test_act_order_indices_are_range_checked(fixture_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sort index past K would make the kernel read past an activation row: refused."""
    import torch

    ckpt = mq.open(fixture_path("qwen3_w4a16_actorder"))
    moe = mq.cuda.load_moe_layer(ckpt, 0, device="cpu")
    _validate_only(monkeypatch)
    bad = moe.w2_sort_indices.clone()
    bad[1, 3] = 128  # I = 128: one past the last column
    moe.w2_sort_indices = bad
    x = torch.randn(4, moe.hidden_size).to(torch.bfloat16)
    with pytest.raises(mq.LayoutError, match=r"w2_sort_indices: entries must lie in 0..127"):
        moe(x, torch.randn(4, moe.num_experts))


def test_cuda_layer_forward_topk_checks_the_routing(
    fixture_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """forward_topk takes the given routing: its shapes, dtypes and expert ids are checked
    before any launch."""
    import torch

    ckpt = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    moe = mq.cuda.load_moe_layer(ckpt, 0, device="cpu")
    x = torch.randn(5, moe.hidden_size).to(torch.bfloat16)
    w = torch.rand(5, 3)
    ids = torch.randint(0, moe.num_experts, (5, 3), dtype=torch.int32)
    _validate_only(monkeypatch)
    with pytest.raises(_Validated):
        moe.forward_topk(x, w, ids)
    with pytest.raises(mq.LayoutError, match=r"topk_ids: entries must lie in 0..7"):
        moe.forward_topk(x, w, ids + 5)
    with pytest.raises(mq.LayoutError, match=r"must both be \[5, k\]"):
        moe.forward_topk(x, w[:, :2], ids)
    with pytest.raises(mq.LayoutError, match="topk_ids: expected int32 or int64"):
        moe.forward_topk(x, w, ids.float())


def _gpu() -> bool:
    import torch

    try:
        return torch.cuda.is_available() and mq.cuda.driver_present()
    except Exception:  # noqa: BLE001 - no usable GPU
        return False


needs_gpu = pytest.mark.skipif(
    not _gpu(), reason="no CUDA GPU here: scripts/gpu_check.sh is the GPU check"
)


@needs_gpu
@pytest.mark.parametrize(
    "name",
    ["qwen3_w8a8_dynamic", "qwen3_w8a8_static", "qwen3_w4a16_g128_asym", "qwen3_w4a16_actorder"],
)
def test_cuda_layer_matches_the_cpu_layer_on_a_gpu(fixture_path, name: str) -> None:
    import torch

    ckpt = mq.open(fixture_path(name))
    layer = ckpt.moe_layers()[0]["layer"]
    cpu = mq.MoELayer.from_checkpoint(ckpt, layer)
    gpu = mq.cuda.load_moe_layer(ckpt, layer, device="cuda")
    x = (torch.randn(37, cpu.hidden_size) / 2).to(torch.bfloat16)
    # A NaN in token 5 makes its whole output NaN on both (the W8A8 scale carries it).
    x[5, 7] = float("nan")
    logits = torch.randn(37, cpu.num_experts)
    got = gpu(x.cuda(), logits.cuda()).float().cpu()
    want = cpu(x.float(), logits)
    assert got[5].isnan().all() and want[5].isnan().all()
    keep = torch.arange(37) != 5
    assert torch.isfinite(got[keep]).all()
    assert float((got[keep] - want[keep]).norm() / want[keep].norm()) <= 1e-2


@needs_gpu
def test_wna16_launcher_matches_dequantised_weights_on_a_gpu() -> None:
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from marlin_ref import marlin_moe_case

    rng = np.random.default_rng(11)
    e, h, i, k = 4, 256, 128, 2
    c13 = marlin_moe_case(rng, e, h, 2 * i, 4, 64, scale_size_k=i)
    c2 = marlin_moe_case(rng, e, i, h, 4, 64)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).cuda()

    x = (torch.randn(9, h) / 4).to(torch.bfloat16)
    logits = torch.randn(9, e)
    got = (
        mq.cuda.wna16_moe(
            x.cuda(),
            logits.cuda(),
            t(c13["w"]),
            t(c13["s"]),
            t(c2["w"]),
            t(c2["s"]),
            num_bits=4,
            group_size=64,
            top_k=k,
            intermediate_size=i,
        )
        .float()
        .cpu()
    )
    w, ids = logits.softmax(-1).topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    w13 = torch.from_numpy(c13["weights"]).float()
    w2 = torch.from_numpy(c2["weights"]).float()
    want = torch.zeros(9, h)
    for tok in range(9):
        for j in range(k):
            ex = int(ids[tok, j])
            gu = x[tok].float() @ w13[ex]
            hh = torch.nn.functional.silu(gu[:i]) * gu[i:]
            want[tok] += float(w[tok, j]) * (hh @ w2[ex])
    assert float((got - want).norm() / want.norm()) <= 1e-2


def test_cuda_layer_loader_refuses_a_routed_scaling_factor(fixture_path, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The CUDA combine does not scale the routed sum: a layer whose config scales it (2.5
    here) is refused by name rather than run without the factor."""
    import json
    import shutil

    dst = tmp_path / "scaled"
    shutil.copytree(fixture_path("qwen3_w8a8_dynamic"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["routed_scaling_factor"] = 2.5
    (dst / "config.json").write_text(json.dumps(config))
    ckpt = mq.open(dst)
    with pytest.raises(mq.UnsupportedSchemeError, match="routed_scaling_factor 2.5"):
        mq.cuda.load_moe_layer(ckpt, ckpt.moe_layers()[0]["layer"], device="cpu")


def _small_int8_layer(e: int = 3, h: int = 64, i: int = 32):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(7)
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g)
    s13 = torch.rand(e, 2 * i, 1, generator=g) * 1e-2 + 1e-4
    s2 = torch.rand(e, h, 1, generator=g) * 1e-2 + 1e-4
    return w13, w2, s13, s2


def _parsed(*args, **kwargs):  # type: ignore[no-untyped-def]
    """from_tensors' arguments as moe._parse_tensors reads them (what the CUDA build takes)."""
    from moeq_rs import moe

    names = ("scheme", "group_size", "w13_zero_point", "w2_zero_point", "a13_scale", "a2_scale")
    defaults = {"group_size": -1, "renormalize": True}
    kw = {**defaults, **kwargs}
    rest = [kw.get(n) for n in names] + [kw["top_k"], kw["renormalize"]]
    return moe._parse_tensors(*args, *rest)


@pytest.mark.parametrize("static", [False, True])
def test_from_tensors_on_cuda_builds_the_w8a8_launch_arguments(
    monkeypatch: pytest.MonkeyPatch, static: bool
) -> None:
    """MoELayer.from_tensors(..., device="cuda") without a GPU: its builder on a CPU device
    gives a MoELayer whose buffers are the W8A8 launcher's ([E, N] fp32 scales, [E] static
    scales), that runs the W8A8 launcher with them (every check passing), keeps its dtypes
    under .half() and refuses a move off CUDA-or-here. The same layer on the CPU gives the
    launcher's reference outputs (checked on a GPU by scripts/gpu_check.sh)."""
    import torch

    from moeq_rs.cuda_layer import CudaMoELayer, from_tensors_on_cuda

    w13, w2, s13, s2 = _small_int8_layer()
    extra = {"a13_scale": torch.tensor([0.02, 0.03, 0.05]), "a2_scale": 0.01} if static else {}
    scheme = "w8a8_static" if static else "w8a8_dynamic"
    p = _parsed(w13, w2, s13, s2, scheme=scheme, top_k=2, **extra)
    moe = from_tensors_on_cuda(torch.device("cpu"), p)
    assert isinstance(moe, CudaMoELayer) and isinstance(moe, mq.MoELayer)
    assert (moe.num_experts, moe.top_k, moe.hidden_size, moe.method) == (3, 2, 64, "w8a8_int8")
    b = dict(moe.named_buffers())
    assert torch.equal(b["w13"], w13) and torch.equal(b["w2"], w2)
    assert torch.equal(b["w13_scale"], s13[..., 0]) and b["w2_scale"].shape == (3, 64)
    if static:
        assert torch.equal(b["a13_scale"], extra["a13_scale"])
        assert torch.equal(b["a2_scale"], torch.full((3,), 0.01))
    else:
        assert "a13_scale" not in b
    x, logits = torch.randn(4, 64), torch.randn(4, 3)
    with pytest.raises(mq.LayoutError, match="expected a CUDA tensor"):
        moe(x, logits)
    seen = {}

    def launcher(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(kwargs, n=len(args))
        return torch.zeros(4, 64)

    monkeypatch.setattr(mq.cuda, "w8a8_moe", launcher)
    moe(x, logits)
    assert seen["n"] == 6 and seen["top_k"] == 2 and seen["renormalize"] is True
    assert (seen["a13_scale"] is None) is not static
    assert moe.half() is moe and moe.w13_scale.dtype == torch.float32
    # What a caller attaches is cast as in any module; the kernels' weights stay as they are.
    moe.gain = torch.nn.Parameter(torch.ones(2))
    moe.double()
    assert moe.gain.dtype == torch.float64 and moe.w13.dtype == torch.int8
    assert moe.w13_scale.dtype == torch.float32 and torch.equal(moe.w13, w13)
    with pytest.raises(mq.LayoutError, match="cannot move to meta"):
        moe.to("meta")
    with pytest.raises(TypeError, match="cannot be pickled"):
        __import__("pickle").dumps(moe)


def test_from_tensors_on_cuda_refuses_what_its_kernels_do_not_run() -> None:
    import torch

    from moeq_rs.cuda_layer import from_tensors_on_cuda

    w13, w2, s13, s2 = _small_int8_layer()
    cpu = torch.device("cpu")
    # Weight-only: Marlin's group sizes only, and 4-bit zero points in -8..7.
    g16 = (s13.expand(3, 64, 4).contiguous(), s2.expand(3, 64, 2).contiguous())
    with pytest.raises(mq.UnsupportedSchemeError, match="-1 .channelwise., 32, 64 or 128"):
        p = _parsed(w13, w2, *g16, scheme="w8a16", group_size=16, top_k=1)
        from_tensors_on_cuda(cpu, p)
    packed13 = torch.zeros(3, 64, 8, dtype=torch.int32)  # int4 words: [E, 2I, H/8]
    packed2 = torch.zeros(3, 64, 4, dtype=torch.int32)
    zp13 = torch.zeros(3, 64, 1, dtype=torch.int8)
    zp13[2, 5, 0] = 8
    zp = {"w13_zero_point": zp13, "w2_zero_point": torch.zeros(3, 64, 1, dtype=torch.int8)}
    with pytest.raises(
        mq.LayoutError,
        match="w13_zero_point: expert 2, row 5, group 0 is 8; 4-bit zero points lie in -8..7",
    ):
        p = _parsed(packed13, packed2, s13, s2, scheme="w4a16", top_k=1, **zp)
        from_tensors_on_cuda(cpu, p)
    grouped = (s13.expand(3, 64, 2).contiguous(), s2.expand(3, 64, 1).contiguous())
    with pytest.raises(mq.UnsupportedSchemeError, match="per-channel"):
        p = _parsed(w13, w2, *grouped, scheme="w8a8_dynamic", group_size=32, top_k=1)
        from_tensors_on_cuda(cpu, p)
    for bad, match in ((0.0, "must be positive"), (float("inf"), "must be finite")):
        p = _parsed(w13, w2, s13, s2, scheme="w8a8_static", top_k=1, a13_scale=0.1, a2_scale=bad)
        with pytest.raises(mq.LayoutError, match=f"a2_scale: expert 0 is .*{match}"):
            from_tensors_on_cuda(cpu, p)
    if _gpu():
        return
    # The public door without a GPU: CudaUnavailableError.
    with pytest.raises(mq.CudaUnavailableError, match="torch sees 0 CUDA device"):
        mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1, device="cuda")


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_w4a16_g128_sym",
        "qwen3_w4a16_g128_asym",
        "qwen3_w8a16_channel",
        "qwen3_w8a16_g128",
        "mixtral_w8a16_channel",
        "synthetic_w4a16_g32_padded",
    ],
)
def test_weight_only_from_tensors_on_cuda_equals_the_checkpoint_marlin_layer(
    fixture_path, tmp_path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """MoELayer.from_tensors(..., device="cuda") for W4A16 / W8A16 converts its tensors to the
    Marlin layout itself: the same words, scales (as fp32 values) and zero points that
    Checkpoint.marlin_layer builds from the checkpoint they came from (what
    from_checkpoint(..., device="cuda") runs, checked on a GPU by scripts/gpu_check.sh), and
    the same launch options. The synthetic checkpoint's I = 32 is zero-padded to the 64-wide
    tile, as the repack pads it."""
    import sys
    from pathlib import Path

    import torch

    from moeq_rs.cuda_layer import from_tensors_on_cuda

    sys.path.insert(0, str(Path(__file__).parent))
    if name.startswith("synthetic"):
        import synth

        ckpt = mq.open(synth.write_checkpoint(tmp_path / "ckpt"))
    else:
        ckpt = mq.open(fixture_path(name))
    from layer_tensors import weight_only_args

    layer, tensors, kwargs = weight_only_args(ckpt)
    ours = from_tensors_on_cuda(torch.device("cpu"), _parsed(*tensors, **kwargs))
    ref = mq.cuda.load_moe_layer(ckpt, layer, device="cpu")
    assert ours.method == ref.method == "wna16"
    a, b = dict(ours.named_buffers()), dict(ref.named_buffers())
    assert set(a) == set(b)
    for key in a:
        if "scale" in key:
            assert a[key].dtype == torch.float32
            assert torch.equal(a[key], b[key].float()), key
        else:
            assert torch.equal(a[key], b[key]), key
    assert ours._plain == {k: v for k, v in ref._plain.items() if v is not None}
    if name == "synthetic_w4a16_g32_padded":
        assert ours._plain["intermediate_size"] == 32 and a["w2"].shape[1] == 64 // 16
    # And the launcher takes them (every argument check passes).
    _validate_only(monkeypatch)
    with pytest.raises(_Validated):
        ours(torch.randn(3, ours.hidden_size).to(torch.bfloat16), torch.randn(3, ours.num_experts))


_CUDA_FREEZING_SCRIPT = r"""
import sys, torch, moeq_rs as mq
import torch._inductor.config as ic
from moeq_rs import moe
from moeq_rs.cuda_layer import from_tensors_on_cuda
ic.freezing = True
def launcher(x, routing, w13, w13_scale, w2, w2_scale, **kw):
    # Stands in for the GPU launch (no GPU here): depends on this layer's weights.
    return x * w13_scale.sum()
mq.cuda.w8a8_moe = launcher
def layer(seed):
    g = torch.Generator().manual_seed(seed)
    p = moe._parse_tensors(
        torch.randint(-127, 128, (4, 64, 64), dtype=torch.int8, generator=g),
        torch.randint(-127, 128, (4, 64, 32), dtype=torch.int8, generator=g),
        torch.rand(4, 64, generator=g), torch.rand(4, 64, generator=g),
        "w8a8_dynamic", -1, None, None, None, None, 2, True)
    return from_tensors_on_cuda(torch.device("cpu"), p)
x, r = torch.randn(3, 64), torch.randn(3, 4)
w, ids = torch.rand(3, 2), torch.randint(0, 4, (3, 2))
with torch.no_grad():
    for seed in map(int, sys.argv[1:]):
        m = layer(seed)
        assert torch.equal(torch.compile(m, fullgraph=True)(x, r), m(x, r)), seed
        topk = torch.compile(m.forward_topk, fullgraph=True)(x, w, ids)
        assert torch.equal(topk, m.forward_topk(x, w, ids)), seed
print("ok")
"""


def test_cuda_layer_under_inductor_freezing_runs_its_own_weights(freezing_runs) -> None:  # type: ignore[no-untyped-def]
    """As for the CPU layer: under inductor's freezing the compiled CUDA layer passes its handle
    as a literal, so a second layer of the same shapes is not served the first one's graph
    (and weights) from the FX graph cache; also in a fresh process sharing the cache. (Found
    by review: the CUDA layer passed the handle tensor, and the second layer ran the first
    one's weights.)"""
    freezing_runs(_CUDA_FREEZING_SCRIPT)


@pytest.mark.parametrize("side", ["w13", "w2"])
def test_weight_only_from_tensors_on_cuda_with_one_sides_zero_points(side: str) -> None:
    """A zero point given for one projection only: the CPU layer reads the other as symmetric,
    and so does the CUDA build (zero points of 0 there; the kernel takes both or neither). It
    dropped a lone w2 zero point and failed with an AttributeError on a lone w13 one."""
    import torch

    from moeq_rs.cuda_layer import from_tensors_on_cuda

    g = torch.Generator().manual_seed(3)
    e, h, i, gs = 2, 128, 64, 32
    w13 = torch.randint(-(2**31), 2**31 - 1, (e, 2 * i, h // 8), dtype=torch.int32, generator=g)
    w2 = torch.randint(-(2**31), 2**31 - 1, (e, h, i // 8), dtype=torch.int32, generator=g)
    s13, s2 = torch.rand(e, 2 * i, h // gs) + 0.5, torch.rand(e, h, i // gs) + 0.5
    zp = {
        "w13": torch.randint(-8, 8, (e, 2 * i, h // gs), dtype=torch.int8, generator=g),
        "w2": torch.randint(-8, 8, (e, h, i // gs), dtype=torch.int8, generator=g),
    }
    other = "w2" if side == "w13" else "w13"
    lone = {f"{side}_zero_point": zp[side]}
    explicit = {**lone, f"{other}_zero_point": torch.zeros_like(zp[other])}
    args = (w13, w2, s13, s2)
    built = [
        from_tensors_on_cuda(
            torch.device("cpu"), _parsed(*args, scheme="w4a16", group_size=gs, top_k=1, **kw)
        )
        for kw in (lone, explicit)
    ]
    a, b = (dict(m.named_buffers()) for m in built)
    assert set(a) == set(b) and {"w13_zero_point", "w2_zero_point"} <= set(a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # And the CPU layer agrees that the lone zero point counts and the other side is symmetric.
    x, w, ids = torch.randn(3, h), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int64)
    cpu = [
        mq.MoELayer.from_tensors(*args, scheme="w4a16", group_size=gs, top_k=1, **kw)
        for kw in (lone, explicit, {})
    ]
    outs = [m.forward_topk(x, w, ids) for m in cpu]
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_w8a8_from_tensors_on_cuda_checks_the_kernels_geometry_when_built() -> None:
    import torch

    from moeq_rs.cuda_layer import from_tensors_on_cuda

    e, h, i = 3, 64, 30
    w13 = torch.zeros(e, 2 * i, h, dtype=torch.int8)
    w2 = torch.zeros(e, h, i, dtype=torch.int8)
    s13, s2 = torch.ones(e, 2 * i, 1), torch.ones(e, h, 1)
    p = _parsed(w13, w2, s13, s2, scheme="w8a8_dynamic", top_k=1)
    with pytest.raises(mq.LayoutError, match=r"multiples of 4.*I=30"):
        from_tensors_on_cuda(torch.device("cpu"), p)
