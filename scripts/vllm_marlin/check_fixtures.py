"""Check 5: vLLM 0.32's compressed-tensors WNA16 MoE Marlin load path, reproduced with vLLM's own
extracted functions (loader placement from routed_experts.py:_load_w13/_load_w2 with
is_transposed=False, then fused_moe/oracle/int_wna16.py:_process_weights_marlin, with the CUDA
repack replaced by vLLM's marlin_weights oracle), compared tensor by tensor with
moeq_rs.open(path).marlin_layer(layer).

Act-order: vLLM 0.32 refuses CT actorder="group" at config parse
(compressed_tensors/compressed_tensors.py:336) and its gptq_marlin_moe_repack has no perm
(_custom_ops.py:1154). For that fixture the reference adds the act-order step of the older CT
Marlin MoE method (marlin_layout.md §3.2 step 1: per expert stable argsort of g_idx, w13 g_idx
= up_proj's (loaded last), repack gathers rows by the sort indices) around the same
_process_weights_marlin. That part is an emulation, not vLLM 0.32 code.

Run: .venv/bin/python scripts/vllm_marlin/check_fixtures.py [CHECKPOINT_DIR ...]"""

import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_synth import write_synth  # noqa: E402
from vllm_ref import REPO, V  # noqa: E402

import moeq_rs as mq  # noqa: E402

FIXTURES = [
    "qwen3_w4a16_g128_asym",
    "qwen3_w4a16_actorder",
    "qwen3_w8a16_g128",
    "laguna_mixed_int4_int8",
    "qwen3_w4a16_g128_sym",
    "qwen3_w8a16_channel",
    "mixtral_w8a16_channel",
    "qwen3_w4a16_sharded",
    "qwen3_mixed_per_expert",
]

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load_all(path):
    import glob

    out = {}
    for f in sorted(glob.glob(path + "/*.safetensors")):
        with safe_open(f, "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def same(a, b):
    a, b = a.contiguous(), b.contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.view(torch.uint8)
            if a.element_size() == 1
            else a.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]),
            b.view(torch.uint8)
            if b.element_size() == 1
            else b.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[b.element_size()]),
        )
    )


def differing_bytes(a, b) -> int:
    return int(
        (
            a.contiguous().view(-1).view(torch.uint8) != b.contiguous().view(-1).view(torch.uint8)
        ).sum()
    )


def vllm_layer(T, prefix, E, geo, model_dtype):
    """Returns {name: tensor} as vLLM holds them after process_weights_after_loading."""
    bits, g = geo["bits"], geo["group_size"]
    pf = 32 // bits
    P = prefix  # <...>.mlp.experts
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    if f"{P}.0.gate_proj.weight_packed" not in T:  # Mixtral naming
        names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    H, I = geo["hidden"], geo["intermediate"]
    # --- create_weights (N-first buffers, compressed_tensors_moe_wna16.py get_weight_shape) ---
    Gh = 1 if g == -1 else H // g
    Gi = 1 if g == -1 else I // g
    w13 = torch.zeros(E, 2 * I, H // pf, dtype=torch.int32)
    w2 = torch.zeros(E, H, I // pf, dtype=torch.int32)
    s13 = torch.zeros(E, 2 * I, Gh, dtype=model_dtype)
    s2 = torch.zeros(E, H, Gi, dtype=model_dtype)
    asym = f"{P}.0.{names['w1']}.weight_zero_point" in T
    z13 = torch.zeros(E, 2 * I // pf, Gh, dtype=torch.int32) if asym else None
    z2 = torch.zeros(E, H // pf, Gi, dtype=torch.int32) if asym else None
    actorder = f"{P}.0.{names['w1']}.weight_g_idx" in T
    gi13 = torch.zeros(E, H, dtype=torch.int32)
    gi2 = torch.zeros(E, I, dtype=torch.int32)
    # --- weight_loader: is_transposed=False, w1 rows [0,I), w3 rows [I,2I)
    # (routed_experts.py:_load_w13) ---
    for e in range(E):
        for sid in ("w1", "w3"):
            base = f"{P}.{e}.{names[sid]}."
            off = 0 if sid == "w1" else 1
            w13[e, off * I : (off + 1) * I] = T[base + "weight_packed"]
            s13[e, off * I : (off + 1) * I] = T[base + "weight_scale"].to(
                model_dtype
            )  # copy_ converts
            if asym:
                z13[e, off * I // pf : (off + 1) * I // pf] = T[base + "weight_zero_point"]
            if actorder:
                gi13[e] = T[base + "weight_g_idx"]  # last writer (w3) wins
        base = f"{P}.{e}.{names['w2']}."
        w2[e] = T[base + "weight_packed"]
        s2[e] = T[base + "weight_scale"].to(model_dtype)
        if asym:
            z2[e] = T[base + "weight_zero_point"]
        if actorder:
            gi2[e] = T[base + "weight_g_idx"]

    out = {}
    saved = V["ops"].gptq_marlin_moe_repack
    if actorder:
        sort13 = torch.stack([torch.argsort(gi13[e], stable=True) for e in range(E)]).to(
            torch.int32
        )
        sort2 = torch.stack([torch.argsort(gi2[e], stable=True) for e in range(E)]).to(torch.int32)
        out["w13_weight_g_idx"] = torch.stack([gi13[e][sort13[e].long()] for e in range(E)])
        out["w2_weight_g_idx"] = torch.stack([gi2[e][sort2[e].long()] for e in range(E)])
        out["w13_g_idx_sort_indices"] = sort13
        out["w2_g_idx_sort_indices"] = sort2
        perms = iter([sort13, sort2])

        def repack_with_perm(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
            perm = next(perms)
            return torch.stack(
                [
                    V["ref_repack"](b_q_weight[e], size_k, size_n, num_bits, perm[e])
                    for e in range(b_q_weight.shape[0])
                ]
            )

        V["ops"].gptq_marlin_moe_repack = repack_with_perm
    layer = types.SimpleNamespace(
        intermediate_size_per_partition=I, num_groups_w13=Gh, num_groups_w2=Gi
    )
    try:
        r = V["_process_weights_marlin"](
            layer, None, bits, pf, g, w13, w2, s13, s2, z13, z2, None, None
        )
    finally:
        V["ops"].gptq_marlin_moe_repack = saved
    out["w13_weight_packed"], out["w2_weight_packed"] = r[0], r[1]
    out["w13_weight_scale"], out["w2_weight_scale"] = r[2], r[3]
    if asym:
        out["w13_weight_zero_point"], out["w2_weight_zero_point"] = r[4], r[5]
    return out


def compare(paths: list[Path]) -> int:
    """Prints one line per tensor; returns the number of mismatched tensors."""
    passed = failed = 0
    report = []
    for path in map(str, paths):
        fx = path.rstrip("/").rsplit("/", 1)[-1]
        cfg = json.load(open(path + "/config.json"))
        model_dtype = DT[cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"]
        ck = mq.open(path)
        T = load_all(path)
        for L in ck.moe_layers():
            idx = L["layer"]
            try:
                geo, mine = ck.marlin_layer(idx)
            except Exception as e:  # noqa: BLE001
                report.append(f"{fx} layer {idx}: moeq marlin_layer raised {type(e).__name__}: {e}")
                continue
            P = geo["prefix"]
            ref = vllm_layer(T, P, geo["experts"], geo, model_dtype)
            names = sorted(set(ref) | {k.rsplit(".", 1)[-1] for k in mine})
            for n in names:
                a = mine.get(f"{P}.{n}")
                b = ref.get(n)
                if a is None or b is None:
                    ok = False
                    why = "missing in moeq" if a is None else "missing in vLLM reference"
                else:
                    ok = same(a, b)
                    why = (
                        ""
                        if ok
                        else f"moeq {a.dtype}{tuple(a.shape)} vs vLLM {b.dtype}{tuple(b.shape)}"
                        + (
                            f", {differing_bytes(a, b)} differing bytes"
                            if a.shape == b.shape and a.dtype == b.dtype
                            else ""
                        )
                    )
                passed += ok
                failed += not ok
                report.append(f"{fx} layer {idx} {n}: {'OK' if ok else 'MISMATCH ' + why}")
            report.append(f"{fx} layer {idx}: geometry {geo}")

    print("\n".join(report))
    print(f"tensors equal: {passed}, mismatched: {failed}")
    return failed


def main() -> int:
    """The given checkpoint dirs; by default every fixture plus the synthetic padding cases."""
    if sys.argv[1:]:
        return 1 if compare([Path(p) for p in sys.argv[1:]]) else 0
    fixtures = Path(os.environ.get("MOEQ_FIXTURES_DIR", REPO / "tests" / "fixtures" / "out"))
    with tempfile.TemporaryDirectory() as tmp:
        paths = [fixtures / fx for fx in FIXTURES] + write_synth(Path(tmp), fixtures)
        return 1 if compare(paths) else 0


if __name__ == "__main__":
    sys.exit(main())
