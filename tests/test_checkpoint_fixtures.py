"""moeq_rs against the real compressed-tensors library, on every generated fixture: schemes,
bit-exact dequantisation, MoE discovery, tensor access and `moeq inspect --json`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import moeq_rs as mq

FIXTURES = [
    "qwen3_w4a16_g128_sym",
    "qwen3_w4a16_g128_asym",
    "qwen3_w8a16_g128",
    "qwen3_w8a16_channel",
    "qwen3_w8a8_dynamic",
    "qwen3_w8a8_static",
    "laguna_mixed_int4_int8",
    "qwen3_w4a16_actorder",
    "mixtral_w8a16_channel",
    "deepseek_v3_w8a8_dynamic",
    "qwen3_w4a16_sharded",
    "qwen3_mixed_per_expert",
    "qwen3_unquantized",
]


def ct_weight_args(w: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors' args normalised the way DESIGN.md's contract spells them."""
    strategy = w["strategy"]
    group = w["group_size"] if strategy == "group" else -1
    actorder = {"dynamic": "group", "static": "weight", True: "group"}.get(
        w.get("actorder"), w.get("actorder")
    )
    return {
        "num_bits": w["num_bits"],
        "type": w["type"],
        "strategy": strategy,
        "group_size": group,
        "symmetric": w["symmetric"],
        "actorder": actorder or None,
    }


def ct_activation_args(a: dict[str, Any] | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {
        "num_bits": a["num_bits"],
        "type": a["type"],
        "strategy": a["strategy"],
        "dynamic": bool(a["dynamic"]),
        "symmetric": a["symmetric"],
    }


@pytest.mark.parametrize("name", FIXTURES)
def test_schemes_match_compressed_tensors(fixture_path: Callable[[str], Path], name: str) -> None:
    path = fixture_path(name)
    ref = json.loads((path / "ref" / "schemes.json").read_text())
    ckpt = mq.open(path)
    if name == "qwen3_unquantized":
        assert ref == {}
        assert ckpt.scheme("model.layers.0.mlp.experts.0.gate_proj") is None
        return
    assert ref, "the generator recorded no quantized module"
    for module, ct in ref.items():
        got = ckpt.scheme(module)
        assert got is not None, module
        assert got["format"] == ct["format"], module
        assert got["weight"] == ct_weight_args(ct["weights"]), module
        assert got["activation"] == ct_activation_args(ct["input_activations"]), module


@pytest.mark.parametrize("name", FIXTURES)
def test_dequantize_is_bit_exact_with_compressed_tensors(
    fixture_path: Callable[[str], Path], name: str
) -> None:
    path = fixture_path(name)
    ref = load_file(str(path / "ref" / "dequant.safetensors"))
    ckpt = mq.open(path)
    if name == "qwen3_unquantized":
        # Unquantized modules come back exactly as stored.
        module = "model.layers.1.mlp.experts.3.down_proj"
        stored = ckpt.tensor(f"{module}.weight", "torch")
        assert torch.equal(ckpt.dequantize(module).view(torch.int16), stored.view(torch.int16))
        return
    assert ref
    for key, expected in ref.items():
        module = key.removesuffix(".weight")
        got = ckpt.dequantize(module)
        assert got.dtype == expected.dtype and got.shape == expected.shape, module
        # Bit patterns, not values: -0.0 vs +0.0 or NaN payloads would show.
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), module


@pytest.mark.parametrize("name", FIXTURES)
def test_tensor_access_matches_safetensors(fixture_path: Callable[[str], Path], name: str) -> None:
    path = fixture_path(name)
    ckpt = mq.open(path)
    seen = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                expected = st.get_tensor(key)
                got = ckpt.tensor(key, "torch")
                assert got.dtype == expected.dtype and got.shape == expected.shape, key
                assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), key
                arr = ckpt.tensor(key)
                assert not arr.flags.writeable
                assert arr.tobytes() == expected.view(torch.uint8).numpy().tobytes(), key
                seen += 1
    assert seen == len(ckpt.tensor_names()) == len(ckpt.views())


def _inspect_json(path: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "inspect", str(path), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # exactly one JSON document on stdout


W4_G128 = {
    "num_bits": 4,
    "type": "int",
    "strategy": "group",
    "group_size": 128,
    "symmetric": True,
    "actorder": None,
}
W8_G128 = {**W4_G128, "num_bits": 8}
W8_CHANNEL = {**W8_G128, "strategy": "channel", "group_size": -1}
A8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True, "symmetric": True}
A8_STATIC = {
    "num_bits": 8,
    "type": "int",
    "strategy": "tensor",
    "dynamic": False,
    "symmetric": True,
}

# name -> (prefix pattern, layers, experts, weight per layer, activation, format per layer)
EXPECTED: dict[str, dict[str, Any]] = {
    "qwen3_w4a16_g128_sym": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W4_G128] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_w4a16_g128_asym": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [{**W4_G128, "symmetric": False}] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_w8a16_g128": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W8_G128] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_w8a16_channel": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W8_CHANNEL] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_w8a8_dynamic": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W8_CHANNEL] * 2,
        "activation": A8_TOKEN,
        "format": "int-quantized",
    },
    "qwen3_w8a8_static": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W8_CHANNEL] * 2,
        "activation": A8_STATIC,
        "format": "int-quantized",
    },
    "laguna_mixed_int4_int8": {
        "layers": [1, 2],
        "experts": 8,
        "weight": [W4_G128, W8_G128],
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_w4a16_actorder": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [{**W4_G128, "actorder": "group"}] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "mixtral_w8a16_channel": {
        "layers": [0, 1],
        "experts": 4,
        "weight": [W8_CHANNEL] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "deepseek_v3_w8a8_dynamic": {
        "layers": [1, 2],
        "experts": 8,
        "weight": [W8_CHANNEL] * 2,
        "activation": A8_TOKEN,
        "format": "int-quantized",
    },
    "qwen3_w4a16_sharded": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [W4_G128] * 2,
        "activation": None,
        "format": "pack-quantized",
    },
    "qwen3_unquantized": {
        "layers": [0, 1],
        "experts": 8,
        "weight": [None, None],
        "activation": None,
        "format": "dense",
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_inspect_json_field_by_field(fixture_path: Callable[[str], Path], name: str) -> None:
    path = fixture_path(name)
    doc = _inspect_json(path)
    exp = EXPECTED[name]
    assert set(doc) >= {"model_dir", "quant_method", "format", "moe_layers"}
    assert doc["model_dir"] == str(path)
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    assert doc["quant_method"] == (qc["quant_method"] if qc else None)
    assert doc["format"] == (qc["format"] if qc else None)
    layers = doc["moe_layers"]
    assert [layer["layer"] for layer in layers] == exp["layers"]
    block = "block_sparse_moe" if name.startswith("mixtral") else "mlp"
    for layer, weight in zip(layers, exp["weight"], strict=True):
        assert layer["prefix"] == f"model.layers.{layer['layer']}.{block}"
        assert layer["num_experts"] == exp["experts"]
        assert layer["weight"] == weight
        assert layer["activation"] == exp["activation"]
        assert layer["format"] == exp["format"]
        assert layer["mixed"] is False
        assert (layer["hidden_size"], layer["intermediate_size"]) == (256, 128)


def test_inspect_per_expert_mix(fixture_path: Callable[[str], Path]) -> None:
    doc = _inspect_json(fixture_path("qwen3_mixed_per_expert"))
    for layer in doc["moe_layers"]:
        assert layer["mixed"] is True and layer["weight"] is None
        assert [e["expert"] for e in layer["experts"]] == list(range(8))
        for e in layer["experts"]:
            assert e["weight"] == (W4_G128 if e["expert"] < 4 else W8_G128)


def test_deepseek_routing_shared_experts_and_dense_layer(
    fixture_path: Callable[[str], Path],
) -> None:
    path = fixture_path("deepseek_v3_w8a8_dynamic")
    cfg = json.loads((path / "config.json").read_text())
    doc = _inspect_json(path)
    r = doc["routing"]
    assert r["scoring_func"] == "sigmoid"
    assert r["top_k"] == cfg["num_experts_per_tok"]
    assert r["n_group"] == cfg["n_group"] and r["topk_group"] == cfg["topk_group"]
    assert r["routed_scaling_factor"] == cfg["routed_scaling_factor"]
    assert r["renormalize"] == cfg["norm_topk_prob"]
    assert doc["dense_layers"] == [0]
    for layer in doc["moe_layers"]:
        p = layer["prefix"]
        assert layer["router"] == {
            "module": f"{p}.gate",
            "e_score_correction_bias": f"{p}.gate.e_score_correction_bias",
        }
        assert layer["shared_experts"]["prefix"] == f"{p}.shared_experts"
        assert layer["shared_experts"]["weight"] == W8_CHANNEL


def test_laguna_layout(fixture_path: Callable[[str], Path]) -> None:
    doc = _inspect_json(fixture_path("laguna_mixed_int4_int8"))
    assert doc["dense_layers"] == [0]
    assert doc["routing"]["scoring_func"] == "sigmoid"
    assert doc["routing"]["renormalize"] is True
    assert doc["routing"]["routed_scaling_factor"] == 2.5
    for layer in doc["moe_layers"]:
        p = layer["prefix"]
        assert layer["router"]["e_score_correction_bias"] == f"{p}.experts.e_score_correction_bias"
        assert layer["shared_experts"]["prefix"] == f"{p}.shared_expert"
        # Shared experts are targeted by the "Linear" group (int8) even in the int4 layer.
        assert layer["shared_experts"]["weight"] == W8_G128


def test_sharded_equals_single_file(fixture_path: Callable[[str], Path]) -> None:
    sharded = mq.open(fixture_path("qwen3_w4a16_sharded"))
    single = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    assert len(list(fixture_path("qwen3_w4a16_sharded").glob("*.safetensors"))) >= 3
    assert sharded.tensor_names() == single.tensor_names()
    for name in single.tensor_names():
        assert np.array_equal(sharded.tensor(name), single.tensor(name)), name


def test_actorder_g_idx_is_used(fixture_path: Callable[[str], Path]) -> None:
    ckpt = mq.open(fixture_path("qwen3_w4a16_actorder"))
    module = "model.layers.0.mlp.experts.2.gate_proj"
    info = ckpt.module(module)
    assert info["has_g_idx"] and info["weight"]["actorder"] == "group"
    g_idx = ckpt.tensor(f"{module}.weight_g_idx")
    assert sorted(set(g_idx.tolist())) == [0, 1]
    assert not np.array_equal(g_idx, np.arange(256) // 128), "g_idx should be permuted"


def test_static_input_scales(fixture_path: Callable[[str], Path]) -> None:
    ckpt = mq.open(fixture_path("qwen3_w8a8_static"))
    for e in range(8):
        info = ckpt.module(f"model.layers.0.mlp.experts.{e}.up_proj")
        assert info["has_input_scale"]


def test_demo_checkpoint_matches_its_reference() -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / "tiny-moe-int4-int8"
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) <= 5 * 1024 * 1024
    ckpt = mq.open(path)
    ref = load_file(str(path / "ref" / "dequant.safetensors"))
    assert len(ref) > 10
    for key, expected in ref.items():
        got = ckpt.dequantize(key.removesuffix(".weight"))
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), key


@pytest.mark.parametrize(
    "name", ["qwen3_w4a16_g128_asym", "qwen3_w8a8_static", "qwen3_w4a16_actorder"]
)
def test_exact_dequantize_rounds_to_the_bit_exact_one(
    fixture_path: Callable[[str], Path], name: str
) -> None:
    ckpt = mq.open(fixture_path(name))
    module = "model.layers.1.mlp.experts.5.gate_proj"
    exact = ckpt.dequantize(module, exact=True)
    rounded = ckpt.dequantize(module)
    assert exact.dtype == torch.float32
    assert torch.equal(exact.to(rounded.dtype).view(torch.int16), rounded.view(torch.int16))
    assert not torch.equal(exact, rounded.float()), "exact values keep the unrounded bits"


def test_a_target_repeated_across_groups_goes_to_the_last_group(fixture_path, tmp_path) -> None:
    """A MiniMax-style hybrid: FP8 on "Linear", then W4A16 on "Linear" plus the experts. CT and
    vLLM key targets by their string, so the later group wins for every Linear; the whole
    checkpoint was refused as ambiguous (naming whichever attention module came first)."""
    import shutil

    d = tmp_path / "hybrid"
    shutil.copytree(fixture_path("qwen3_w4a16_g128_sym"), d)
    config = json.loads((d / "config.json").read_text())
    qc = config["quantization_config"]
    w4 = next(iter(qc["config_groups"].values()))
    fp8 = {
        "targets": ["Linear"],
        "format": "float-quantized",
        "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                    "block_structure": [128, 128], "symmetric": True, "dynamic": False},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                              "symmetric": True, "dynamic": True},
    }  # fmt: skip
    experts = r"re:.*mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$"
    qc["format"] = "mixed-precision"
    qc["config_groups"] = {"group_0": fp8, "group_1": {**w4, "targets": ["Linear", experts]}}
    (d / "config.json").write_text(json.dumps(config))
    ckpt = mq.open(d)
    assert ckpt.scheme("model.layers.0.mlp.experts.0.down_proj")["group"] == "group_1"
    plan = mq.plan(ckpt, platform="cuda", sm=90)
    assert [(x["method"], x["backend"]) for x in plan.layers] == [
        ("wna16", "cuda_marlin_wna16")
    ] * len(plan.layers)
    # Swapped, the FP8 group is last: attention then resolves to FP8, which its stored
    # W4A16 tensors do not fit (the experts' regex still gives them W4A16).
    qc["config_groups"] = {"group_1": {**w4, "targets": ["Linear", experts]}, "group_0": fp8}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(mq.CheckpointError, match=r"self_attn\..*float-quantized weights"):
        mq.open(d)


def test_asking_for_a_router_says_what_it_is() -> None:
    """`scheme`/`dequantize` of a router said "no such Linear module in the checkpoint"
    although its weight is right there: routers (and embeddings, norms) are not quantizable
    Linear modules, and the error now says so and where their weight is."""
    from pathlib import Path

    ck = mq.open(Path(__file__).resolve().parent.parent / "examples" / "tiny-moe-int4-int8")
    gate = "model.layers.1.mlp.gate"
    assert ck.tensor(f"{gate}.weight").shape == (8, 256)
    for call in (ck.scheme, ck.dequantize):
        with pytest.raises(mq.CheckpointError, match="not a quantizable Linear module") as e:
            call(gate)
        assert f"'{gate}.weight' as stored with Checkpoint.tensor" in str(e.value)
    with pytest.raises(mq.CheckpointError, match="no such Linear module"):
        ck.scheme("model.layers.1.mlp.nothing")


def test_summary_and_moe_layers_are_copies(fixture_path: Callable[[str], Path]) -> None:
    """Editing what `summary()` or `moe_layers()` returned changes nothing the checkpoint answers
    later: they handed out the cached dicts, and an edited layer number made the layer
    unloadable ("this decoder layer has no MoE block"). Found by a review helper."""
    ckpt = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    want = ckpt.summary()
    ckpt.moe_layers()[0]["num_experts"] = 999
    ckpt.summary()["moe_layers"][0]["layer"] = 7
    ckpt.summary()["routing"].clear()
    assert ckpt.summary() == want
    assert [entry["layer"] for entry in ckpt.moe_layers()] == [0, 1]
    assert mq.MoELayer.from_checkpoint(ckpt, 0).num_experts == want["moe_layers"][0]["num_experts"]
    # config.json and its quantization_config likewise.
    config = ckpt.config
    ckpt.config["num_experts"] = 1
    ckpt.quantization_config["config_groups"].clear()  # type: ignore[index]
    assert ckpt.config == config and ckpt.quantization_config == config["quantization_config"]


def test_checkpoint_copies_and_pickles_as_its_directory(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """deepcopy of anything holding a Checkpoint, and pickling one (multiprocessing's spawn),
    failed with the native object's bare TypeError. A deep copy shares the read-only object; a
    pickle carries the directory, opened and checked again where it is loaded."""
    import copy
    import pickle
    import shutil

    src = tmp_path / "ck"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    ck = mq.open(src)
    held = {"checkpoint": ck, "layers": [0]}
    assert copy.deepcopy(held)["checkpoint"] is ck
    back = pickle.loads(pickle.dumps(held))["checkpoint"]
    assert isinstance(back, mq.Checkpoint) and back is not ck and back.path == ck.path
    assert back.summary() == ck.summary()
    name = next(iter(ck.tensor_names()))
    assert np.array_equal(back.tensor(name), ck.tensor(name))
    blob = pickle.dumps(ck)
    shutil.rmtree(src)
    with pytest.raises(mq.CheckpointError, match=str(src)):
        pickle.loads(blob)
