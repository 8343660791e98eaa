"""GPU checks of the CUDA path, run by scripts/gpu_check.sh on a machine with one NVIDIA GPU.

1. environment: driver, NVRTC, arch; every kernel variant compiles for the device's arch;
   then routing, alignment, SiLU-and-mul and combine one kernel at a time against torch;
2. W8A8 MoE (mq.cuda.w8a8_moe: IMMA and dp4a GEMMs, dynamic and static scales)
   against the CPU path (itself tested against an fp64 emulation) for M in {1, 16, 64, 256}
   tokens, fp32/fp16/bf16 activations, and at H = 100, I = 36 (the GEMMs' tail guards);
3. WNA16 MoE on the Marlin layout (mq.cuda.wna16_moe, the mma.sync kernel) against
   an fp32 torch reference (dequantised weights + matmul) for int4/int8, grouped/channelwise,
   zero points and act-order, fp16/bf16, M in {1, 16, 64, 256}; the Marlin tensors come from
   tests/marlin_ref.py (numpy, the table form of the layout);
4. the W8A8 call on a non-default stream, and captured in a CUDA graph and replayed;
5. whole layers from real checkpoints (MoELayer.from_checkpoint(..., device="cuda")) against
   the CPU MoELayer, when tests/fixtures/out is carried along; MoELayer.from_tensors on CUDA;
6. a benchmark: ratios against torch bf16 (a per-expert loop) and against copy bandwidth, for
   W8A8 and W4A16 (Qwen3-30B-A3B shape).

Prints one line per check and exits non-zero if any check fails; stops at the first CUDA
fault (which leaves the context unusable), naming the check that caused it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

import moeq_rs as mq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from layer_tensors import weight_only_args  # noqa: E402
from marlin_ref import marlin_moe_case  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def failed(name: str, ex: BaseException) -> None:
    """A check that raised. A CUDA fault (an illegal address, a launch failure) leaves the
    process's CUDA context unusable, so every later check would fail with the same error:
    stop at the first, which names the check that caused it."""
    check(name, False, repr(ex))
    text = f"{type(ex).__name__} {ex}"
    if "AcceleratorError" in text or "CUDA error" in text or "CUDA_ERROR" in text:
        print(f"gpu_check: stopping: a CUDA fault in '{name}' broke the context", flush=True)
        print("FAILED:", FAILED)
        sys.exit(1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layer(e: int, h: int, i: int, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g)
    s13 = torch.rand(e, 2 * i, generator=g) * 2e-3 + 1e-4
    s2 = torch.rand(e, h, generator=g) * 2e-3 + 1e-4
    return w13, w2, s13, s2


def torch_moe(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k: int
) -> torch.Tensor:
    """fp32 reference: softmax top-k (renormalised), ``x @ w13[e]`` ([K, 2I]), SiLU(gate) * up,
    ``@ w2[e]`` ([I, H]), weighted sum."""
    w, ids = logits.float().softmax(-1).topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    xf = x.float()
    inter = w13.shape[2] // 2
    out = torch.zeros_like(xf)
    for ex in ids.unique().tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        gu = xf[tok] @ w13[ex]
        hh = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (hh @ w2[ex]) * w[tok, slot, None])
    return out


def torch_bf16_moe(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k: int
) -> torch.Tensor:
    """The benchmarks' torch baseline: softmax top-k, a bf16 per-expert loop (``x @ w13[e].T``
    with w13 ``[E, 2I, H]``, SiLU(gate) * up, ``@ w2[e].T``), ``index_add_``."""
    inter = w2.shape[2]
    w, ids = logits.softmax(-1).topk(k, -1)
    out = torch.zeros_like(x)
    for ex in ids.unique().tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        gu = x[tok] @ w13[ex].T
        hh = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (hh @ w2[ex].T) * w[tok, slot, None].to(x.dtype))
    return out


def kernel_checks(dev: torch.device) -> None:
    """The small kernels one at a time, each against torch and synchronised, before the
    end-to-end checks: a fault or a wrong result then names its kernel. Routing (softmax
    top-k), alignment (per-expert offsets, slots grouped by expert in slot order), SiLU-and-mul
    and the top-k combine, for each activation dtype. (The int8 quantisation and the GEMMs are
    checked through the whole W8A8 and WNA16 calls that follow.)"""
    g = torch.Generator().manual_seed(5)
    for t, e, k in ((1, 8, 2), (37, 64, 6), (300, 128, 8)):
        x = torch.randn(t, 64, device=dev)
        logits = torch.randn(t, e, generator=g)
        name = f"kernel routing+align T={t} E={e} k={k}"
        try:
            r = mq.cuda._Routed(x, logits.to(dev), e, k, True)
            torch.cuda.synchronize()
            w_ref, ids_ref = torch.softmax(logits, -1).topk(k, -1)
            w_ref = w_ref / w_ref.sum(-1, keepdim=True)
            got_w = r.weights.cpu().sort(-1, descending=True).values
            counts = torch.bincount(ids_ref.flatten(), minlength=e)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
            ok = (
                rel(got_w, w_ref) <= 1e-5
                and torch.equal(r.offsets.cpu().long(), offsets)
                and torch.equal(r.order.cpu().long(), torch.argsort(ids_ref.flatten(), stable=True))
            )
            check(name, ok, f"weights rel L2 {rel(got_w, w_ref):.1e}")
        except Exception as ex:  # noqa: BLE001 - report and go on
            failed(name, ex)
    # Ties and NaN: the CPU path's ranking of the softmax scores (torch.topk's order: NaN
    # first, ties to the lower index): a stable descending sort. Also E = 1024 (the largest
    # grid) and k = 64.
    for t, e, k in ((64, 64, 6), (5, 1024, 64), (4096, 128, 8)):
        name = f"kernel routing ties+NaN T={t} E={e} k={k}"
        try:
            logits = torch.randint(0, 4, (t, e), generator=g).float()
            logits[3, 10] = float("nan")
            logits[3, 2] = float("nan")
            r = mq.cuda._Routed(torch.randn(t, 64, device=dev), logits.to(dev), e, k, False)
            ids = torch.zeros(t, k, dtype=torch.int32, device=dev)
            ids.view(-1)[r.order.long()] = torch.repeat_interleave(
                torch.arange(e, device=dev, dtype=torch.int32),
                (r.offsets[1:] - r.offsets[:-1]).long(),
            )
            torch.cuda.synchronize()
            # Ranked by the softmax scores, as the CPU path ranks them (row 3's are all NaN).
            scores = torch.softmax(logits, -1)
            want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            # Slots of a token come back grouped by expert; compare as sets per token, and the
            # weights of the finite rows in order of the picks.
            got_ids = ids.cpu().long().sort(-1).values
            same = torch.equal(got_ids, want.sort(-1).values)
            w_ref = scores.gather(1, want)
            keep = torch.arange(t) != 3
            err = rel(r.weights.cpu()[keep].sort(-1).values, w_ref[keep].sort(-1).values)
            nan_row = bool(r.weights.cpu()[3].isnan().all())
            check(name, same and err <= 1e-5 and nan_row, f"ids equal {same}, weights {err:.1e}")
        except Exception as ex:  # noqa: BLE001 - report and go on
            failed(name, ex)
    t, e, k, inter, h = 19, 8, 3, 40, 24
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    weights = torch.rand(t, k, generator=g)
    for dtype, dt, tol in (
        (torch.float32, "f32", 1e-6),
        (torch.float16, "f16", 2e-3),
        (torch.bfloat16, "bf16", 1e-2),
    ):
        name = f"kernel silu_and_mul+combine {dt}"
        try:
            x = torch.randn(t, h, device=dev).to(dtype)
            r = mq.cuda._Routed(x, (weights.to(dev), ids.to(dev)), e, k, True)
            gu = torch.randn(t * k, 2 * inter, generator=g).to(dtype)
            act = r.silu_and_mul(gu.to(dev), inter, dt)
            down = torch.randn(t * k, h, generator=g).to(dtype)  # sorted order, as the GEMM
            out = r.combine(down.to(dev), h, dt)
            torch.cuda.synchronize()
            gu32 = gu.float()
            act_ref = torch.nn.functional.silu(gu32[:, :inter]) * gu32[:, inter:]
            by_slot = torch.empty_like(down.float())
            by_slot[r.order.cpu().long()] = down.float()
            out_ref = (by_slot.view(t, k, h) * weights[..., None]).sum(1)
            e1, e2 = rel(act.float(), act_ref), rel(out.float(), out_ref)
            check(name, e1 <= tol and e2 <= tol, f"rel L2 {e1:.1e} / {e2:.1e} (<= {tol})")
        except Exception as ex:  # noqa: BLE001 - report and go on
            failed(name, ex)


def w8a8_edge_checks(dev: torch.device) -> None:
    """W8A8 shapes whose K and N are not multiples of the GEMMs' tiles (H = 100, I = 36: K
    of 100 and 36, N of 72 and 100), so the kernels' tail guards and zero fills run."""
    e, h, i, k = 6, 100, 36, 2
    w13, w2, s13, s2 = layer(e, h, i, seed=3)
    gw = [t.to(dev) for t in (w13, s13, w2, s2)]
    a13, a2 = torch.rand(e) * 0.02 + 0.01, torch.rand(e) * 0.01 + 0.005
    for static in (False, True):
        extra = {"a13_scale": a13, "a2_scale": a2} if static else {}
        ref_layer = mq.MoELayer.from_tensors(
            w13,
            w2,
            s13[..., None],
            s2[..., None],
            scheme="w8a8_static" if static else "w8a8_dynamic",
            top_k=k,
            **extra,
        )
        for gemm in ("imma", "dp4a"):
            for m in (1, 17):
                name = f"w8a8 {gemm}{' static' if static else ''} H=100 I=36 M={m}"
                x, logits = torch.randn(m, h), torch.randn(m, e)
                want = ref_layer(x, logits)
                try:
                    got = mq.cuda.w8a8_moe(
                        x.to(dev),
                        logits.to(dev),
                        *gw,
                        top_k=k,
                        gemm=gemm,
                        **{key: v.to(dev) for key, v in extra.items()},
                    )
                    torch.cuda.synchronize()
                    err = rel(got.float(), want)
                    check(name, err <= 2e-3, f"rel L2 {err:.2e} (<= 2e-3)")
                except Exception as ex:  # noqa: BLE001 - report and go on
                    failed(name, ex)


def wna16_checks(dev: torch.device) -> None:
    e, h, i, k = 8, 256, 128, 2
    rng = np.random.default_rng(3)
    cases = [
        (4, 128, False, False),
        (8, 128, False, False),
        (4, -1, False, False),
        (8, -1, False, False),
        (4, 64, True, False),
        (4, 64, False, True),
        (8, 32, False, True),
    ]
    for bits, gs, zp, act in cases:
        name = f"wna16 int{bits} g{gs}{' zp' if zp else ''}{' act-order' if act else ''}"
        c13 = marlin_moe_case(
            rng, e, h, 2 * i, bits, gs, zero_points_on=zp, act_order=act, scale_size_k=i
        )
        c2 = marlin_moe_case(rng, e, i, h, bits, gs, zero_points_on=zp, act_order=act)
        ref13 = torch.from_numpy(c13["weights"]).float().to(dev)
        ref2 = torch.from_numpy(c2["weights"]).float().to(dev)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        extra = {}
        if zp:
            extra.update(w13_zero_point=t(c13["z"]), w2_zero_point=t(c2["z"]))
        if act:
            extra.update(
                w13_g_idx=t(c13["g_sorted"]),
                w2_g_idx=t(c2["g_sorted"]),
                w13_sort_indices=t(c13["perm"]),
                w2_sort_indices=t(c2["perm"]),
            )
        for dtype in (torch.float16, torch.bfloat16):
            for m in (1, 16, 64, 256):
                x = (torch.randn(m, h) / 4).to(dtype).to(dev)
                logits = torch.randn(m, e, device=dev)
                want = torch_moe(x, logits, ref13, ref2, k)
                try:
                    got = mq.cuda.wna16_moe(
                        x,
                        logits,
                        t(c13["w"]),
                        t(c13["s"]),
                        t(c2["w"]),
                        t(c2["s"]),
                        num_bits=bits,
                        group_size=gs,
                        top_k=k,
                        intermediate_size=i,
                        **extra,
                    )
                    torch.cuda.synchronize()
                    err = rel(got.float(), want)
                    check(f"{name} {dtype} M={m}", err <= 1e-2, f"rel L2 {err:.2e} (<= 1e-2)")
                except Exception as ex:  # noqa: BLE001 - report and go on
                    failed(f"{name} {dtype} M={m}", ex)


FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "out"
LAYER_FIXTURES = (
    "qwen3_w8a8_dynamic",
    "qwen3_w8a8_static",
    "qwen3_w4a16_g128_asym",
    "qwen3_w4a16_actorder",
    "mixtral_w8a16_channel",
)


def layer_checks(dev: torch.device) -> None:
    """MoELayer.from_checkpoint(..., device="cuda") against the CPU MoELayer on real
    compressed-tensors checkpoints (tests/fixtures/out, carried to the GPU machine; skipped when
    absent); the module's behaviour (a MoELayer, buffers, dtype casts kept off, CPU refused)."""
    for name in LAYER_FIXTURES:
        path = FIXTURES / name
        if not (path / ".complete").is_file():
            print(f"SKIP layer {name}: {path} not here (carry tests/fixtures/out/{name})")
            continue
        try:
            ckpt = mq.open(path)
            layer = ckpt.moe_layers()[0]["layer"]
            cpu = mq.MoELayer.from_checkpoint(ckpt, layer)
            gpu = mq.MoELayer.from_checkpoint(ckpt, layer, device=dev)
            kept = gpu.half() is gpu and gpu.w13_scale.dtype != torch.float16
            try:
                gpu.to("cpu")
                refused = False
            except mq.LayoutError:
                refused = True
            check(
                f"layer {name} module",
                isinstance(gpu, mq.MoELayer)
                and "w13" in gpu.state_dict()
                and kept
                and refused
                and gpu.w13.device == dev,
                repr(gpu),
            )
            for dtype in (torch.float16, torch.bfloat16):
                x = (torch.randn(33, cpu.hidden_size) / 2).to(dtype)
                logits = torch.randn(33, cpu.num_experts)
                want = cpu(x.float(), logits)
                got = gpu(x.to(dev), logits.to(dev))
                torch.cuda.synchronize()
                err = rel(got.float(), want)
                check(f"layer {name} {dtype}", err <= 1e-2, f"rel L2 {err:.2e} (<= 1e-2)")
            # A NaN in token 5 (of a copy): its whole output NaN on both paths (W8A8: the
            # scale carries it, the codes cannot), every other token finite.
            xn = x.clone()
            xn[5, 7] = float("nan")
            got_n = gpu(xn.to(dev), logits.to(dev)).float().cpu()
            want_n = cpu(xn.float(), logits)
            keep = torch.arange(33) != 5
            check(
                f"layer {name} NaN token",
                bool(got_n[5].isnan().all() and want_n[5].isnan().all())
                and bool(torch.isfinite(got_n[keep]).all()),
                f"NaN outputs in token 5: {int(got_n[5].isnan().sum())} of {got_n.shape[1]}",
            )
            w, ids = torch.rand(33, 2), torch.randint(0, cpu.num_experts, (33, 2))
            got = gpu.forward_topk(x.to(dev), w.to(dev), ids.to(dev))
            torch.cuda.synchronize()
            err = rel(got.float(), cpu.forward_topk(x.float(), w, ids))
            check(f"layer {name} forward_topk", err <= 1e-2, f"rel L2 {err:.2e} (<= 1e-2)")
            act_order = any(n.endswith(".weight_g_idx") for n in ckpt.tensor_names())
            if gpu.method == "wna16" and not act_order:
                # The same layer from its raw tensors (from_tensors converts them to the Marlin
                # layout itself; the tests check the bytes equal marlin_layer's on the CPU).
                _, raw, kwargs = weight_only_args(ckpt)
                kwargs["top_k"] = gpu.top_k
                again = mq.MoELayer.from_tensors(*raw, device=dev, **kwargs)
                got2 = again.forward_topk(x.to(dev), w.to(dev), ids.to(dev))
                torch.cuda.synchronize()
                err = rel(got2.float(), got.float())
                same = torch.equal(got2, got)
                check(
                    f"layer {name} from_tensors device=cuda",
                    err <= 1e-3,
                    f"rel L2 {err:.1e} from the checkpoint layer, equal: {same}",
                )
            compiled = torch.compile(gpu, fullgraph=True)(x.to(dev), logits.to(dev))
            torch.cuda.synchronize()
            err = rel(compiled.float(), want)
            check(f"layer {name} torch.compile", err <= 1e-2, f"rel L2 {err:.2e}")
        except Exception as ex:  # noqa: BLE001 - report and go on
            failed(f"layer {name}", ex)


def wna16_bench(dev: torch.device, copy_bw: float, timed) -> None:  # type: ignore[no-untyped-def]
    """W4A16 g128 on the Qwen3-30B-A3B shape: random Marlin words (any word is valid codes)."""
    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device=dev).manual_seed(5)
    w13 = torch.randint(
        -(2**31), 2**31 - 1, (e, h // 16, 2 * i * 2), dtype=torch.int32, device=dev, generator=g
    )
    w2 = torch.randint(
        -(2**31), 2**31 - 1, (e, i // 16, h * 2), dtype=torch.int32, device=dev, generator=g
    )
    s13 = torch.rand(e, h // 128, 2 * i, device=dev, generator=g).to(torch.bfloat16) / 64
    s2 = torch.rand(e, i // 128, h, device=dev, generator=g).to(torch.bfloat16) / 64
    bw13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
    bw2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=dev)
    for t in (1, 1024):
        x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
        logits = torch.randn(t, e, device=dev)

        def ours(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            mq.cuda.wna16_moe(
                x,
                logits,
                w13,
                s13,
                w2,
                s2,
                num_bits=4,
                group_size=128,
                top_k=k,
                intermediate_size=i,
            )

        def ref(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            torch_bf16_moe(x, logits, bw13, bw2, k)

        try:
            a, b = timed(ours), timed(ref, 5)
        except Exception as ex:  # noqa: BLE001
            failed(f"wna16 bench T={t}", ex)
            continue
        touched = min(e, t * k) * 3 * i * h // 2
        print(
            f"W4A16 T={t}: moeq {a * 1e3:.3f} ms, torch bf16 {b * 1e3:.3f} ms ({b / a:.2f}x); "
            f"int4 bytes touched / time = {touched / a / 1e12:.2f} TB/s "
            f"({100 * touched / a / copy_bw:.0f}% of copy bandwidth)"
        )


def main() -> int:
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
    print("nvrtc", mq.cuda.nvrtc_version(), "driver present", mq.cuda.driver_present())
    check("moeq_rs.cuda.is_available()", mq.cuda.is_available() is True)
    cap = torch.cuda.get_device_capability(0)
    arch = f"sm_{cap[0]}{cap[1]}"
    t0 = time.perf_counter()
    report = mq.cuda.compile_kernels(arch)
    spills = {k: v["spill_stores"] for k, v in report.items() if v["spill_stores"]}
    check(
        "compile",
        not spills,
        f"{len(report)} variants for {arch} in {time.perf_counter() - t0:.1f} s; spills: {spills}",
    )

    kernel_checks(torch.device("cuda", 0))

    e, h, i, k = 16, 512, 256, 4
    w13, w2, s13, s2 = layer(e, h, i)
    cpu = mq.MoELayer.from_tensors(
        w13, w2, s13[..., None], s2[..., None], scheme="w8a8_dynamic", top_k=k
    )
    dev = torch.device("cuda", 0)
    gw = [t.to(dev) for t in (w13, s13, w2, s2)]
    a13 = torch.rand(e) * 0.02 + 0.01
    a2 = torch.rand(e) * 0.01 + 0.005
    static_cpu = mq.MoELayer.from_tensors(
        w13,
        w2,
        s13[..., None],
        s2[..., None],
        scheme="w8a8_static",
        top_k=k,
        a13_scale=a13,
        a2_scale=a2,
    )
    for gemm in ("imma", "dp4a"):
        for static in (False, True):
            ref_layer = static_cpu if static else cpu
            extra = {"a13_scale": a13.to(dev), "a2_scale": a2.to(dev)} if static else {}
            kind = f"w8a8 {gemm}{' static' if static else ''}"
            for dtype, tol in (
                (torch.float32, 2e-3),
                (torch.float16, 1e-2),
                (torch.bfloat16, 1e-2),
            ):
                for m in (1, 16, 64, 256):
                    x = torch.randn(m, h).to(dtype)
                    logits = torch.randn(m, e)
                    want = ref_layer(x.float(), logits)
                    try:
                        got = mq.cuda.w8a8_moe(
                            x.to(dev),
                            logits.to(dev),
                            gw[0],
                            gw[1],
                            gw[2],
                            gw[3],
                            top_k=k,
                            gemm=gemm,
                            **extra,
                        )
                        torch.cuda.synchronize()
                        err = rel(got.float(), want)
                        check(f"{kind} {dtype} M={m}", err <= tol, f"rel L2 {err:.2e} (<= {tol})")
                    except Exception as ex:  # noqa: BLE001 - report and go on
                        failed(f"{kind} {dtype} M={m}", ex)

    # MoELayer.from_tensors(..., device="cuda") against the same layer on the CPU.
    for static in (False, True):
        name = f"MoELayer.from_tensors w8a8{' static' if static else ''} device=cuda"
        try:
            extra = {"a13_scale": a13, "a2_scale": a2} if static else {}
            on_gpu = mq.MoELayer.from_tensors(
                w13.to(dev),
                w2,
                s13[..., None],
                s2[..., None],
                scheme="w8a8_static" if static else "w8a8_dynamic",
                top_k=k,
                device="cuda",
                **extra,
            )
            x, logits = torch.randn(40, h), torch.randn(40, e)
            want = (static_cpu if static else cpu)(x, logits)
            got = on_gpu(x.to(dev), logits.to(dev))
            w, ids = torch.rand(40, k), torch.randint(0, e, (40, k))
            got_k = on_gpu.forward_topk(x.to(dev), w.to(dev), ids.to(dev))
            want_k = (static_cpu if static else cpu).forward_topk(x, w, ids)
            torch.cuda.synchronize()
            e1, e2 = rel(got.float(), want), rel(got_k.float(), want_k)
            check(name, e1 <= 2e-3 and e2 <= 2e-3, f"rel L2 {e1:.1e} / forward_topk {e2:.1e}")
        except Exception as ex:  # noqa: BLE001
            failed(name, ex)
        name = f"fused_moe w8a8{' static' if static else ''} on CUDA tensors"
        try:
            args = (w13, w2, s13[..., None], s2[..., None], w, ids)
            kw = {"scheme": "w8a8_static" if static else "w8a8_dynamic", **extra}
            want_f = mq.fused_moe(x, *args, **kw)
            got_f = mq.fused_moe(x.to(dev), *(a.to(dev) for a in args), **kw)
            torch.cuda.synchronize()
            err = rel(got_f.float(), want_f)
            check(name, err <= 2e-3 and got_f.is_cuda, f"rel L2 {err:.1e}")
        except Exception as ex:  # noqa: BLE001
            failed(name, ex)

    w8a8_edge_checks(dev)
    wna16_checks(dev)
    layer_checks(dev)

    x = torch.randn(64, h, dtype=torch.bfloat16, device=dev)
    logits = torch.randn(64, e, device=dev)
    want = cpu(x.float().cpu(), logits.cpu())
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = mq.cuda.w8a8_moe(x, logits, *gw[:2], *gw[2:], top_k=k)
        side.synchronize()
        check("non-default stream", rel(got.float(), want) <= 1e-2)
    except Exception as ex:  # noqa: BLE001
        failed("non-default stream", ex)
    try:
        # Captured on other inputs, replayed on x and logits copied into the same buffers: the
        # replay must read them (and equal an eager call on them bit for bit).
        static_x, static_l = torch.randn_like(x), torch.randn_like(logits)
        mq.cuda.w8a8_moe(static_x, static_l, *gw[:2], *gw[2:], top_k=k)  # warm up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mq.cuda.w8a8_moe(static_x, static_l, *gw[:2], *gw[2:], top_k=k)
        static_x.copy_(x)
        static_l.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        eager = mq.cuda.w8a8_moe(x, logits, *gw[:2], *gw[2:], top_k=k)
        err = rel(captured.float(), want)
        same = torch.equal(captured, eager)
        detail = f"rel L2 {err:.2e}, equal to eager: {same}"
        check("graph capture + replay", err <= 1e-2 and same, detail)
    except Exception as ex:  # noqa: BLE001
        failed("graph capture + replay", ex)

    # Benchmark: Qwen3-30B-A3B shape, T in {1, 1024}.
    e, h, i, k = 128, 2048, 768, 8
    w13, w2, s13, s2 = layer(e, h, i, seed=1)
    gw = [t.to(dev) for t in (w13, s13, w2, s2)]
    bw13 = torch.randn(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
    bw2 = torch.randn(e, h, i, dtype=torch.bfloat16, device=dev)
    buf = torch.empty(2**30, dtype=torch.uint8, device=dev)
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
        fn()
        ts = []
        for _ in range(reps):
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            ts.append(ev0.elapsed_time(ev1) / 1e3)
        return sorted(ts)[len(ts) // 2]

    copy_s = timed(lambda: buf[: 2**29].copy_(buf[2**29 :]))
    copy_bw = 2 * 2**29 / copy_s
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    for t in (1, 1024):
        x = torch.randn(t, h, dtype=torch.bfloat16, device=dev)
        logits = torch.randn(t, e, device=dev)

        def ours(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            mq.cuda.w8a8_moe(x, logits, *gw[:2], *gw[2:], top_k=k)

        def ours_dp4a(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            mq.cuda.w8a8_moe(x, logits, *gw[:2], *gw[2:], top_k=k, gemm="dp4a")

        def ref(x: torch.Tensor = x, logits: torch.Tensor = logits) -> None:
            torch_bf16_moe(x, logits, bw13, bw2, k)

        a, b, c = timed(ours), timed(ref, 5), timed(ours_dp4a, 5)
        touched = min(e, t * k) * 3 * i * h
        print(
            f"W8A8 T={t}: moeq imma {a * 1e3:.3f} ms (dp4a {c * 1e3:.3f} ms), "
            f"torch bf16 {b * 1e3:.3f} ms ({b / a:.2f}x); "
            f"int8 bytes touched / time = {touched / a / 1e12:.2f} TB/s "
            f"({100 * touched / a / copy_bw:.0f}% of copy bandwidth)"
        )
    wna16_bench(dev, copy_bw, timed)
    print("FAILED:", FAILED if FAILED else "none")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
