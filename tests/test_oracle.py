"""The oracle from Python: vLLM-named helpers, the plan of every fixture, the vLLM report."""

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

import moeq_rs as mq
from moeq_rs.oracle import (
    check_moe_marlin_supports_layer,
    make_int8_moe_quant_config,
    marlin_support_reason,
    wna16_scale_kind,
)

# ---- make_int8_moe_quant_config: vLLM's fixed truth table ---------------------------------

SCALE = torch.ones(8)


@pytest.mark.parametrize("as_numpy", [False, True])
def test_int8_quant_config_truth_table(as_numpy: bool) -> None:
    def t(*shape: int) -> Any:
        x = torch.rand(*shape)
        return x.numpy() if as_numpy else x

    w1, w2 = t(8, 256, 1), t(8, 128, 1)
    dyn = make_int8_moe_quant_config(w1, w2, per_act_token_quant=True)
    assert (dyn.kind, dyn.use_int8_w8a8, dyn.use_int8_w8a16) == ("int8_w8a8", True, False)
    assert dyn.per_act_token_quant and dyn.quant_dtype is torch.int8 and dyn.is_quantized
    assert dyn.is_per_act_token and not dyn.is_per_tensor and dyn.weight_quant_dtype is torch.int8
    assert dyn.a1_scale is None and dyn.a2_scale is None and not dyn.static_act_scales
    assert dyn.w1_scale is w1 and dyn.w2_scale is w2

    w8a16 = make_int8_moe_quant_config(w1, w2)
    assert (w8a16.kind, w8a16.use_int8_w8a8, w8a16.use_int8_w8a16) == ("int8_w8a16", False, True)
    assert not w8a16.per_act_token_quant and w8a16.quant_dtype is None
    # vLLM's is_quantized means "activations are quantized": False for W8A16 (it said True).
    assert not w8a16.is_quantized and not w8a16.is_per_tensor
    assert w8a16.weight_quant_dtype is torch.int8
    # The NVFP4/MX parts of vLLM's config are there, unset.
    for cfg in (dyn, w8a16):
        assert cfg.a1_gscale is None and cfg.g2_alphas is None and cfg.ocp_mx_scheme is None
        assert not (cfg.use_nvfp4_w4a4 or cfg.use_mxfp4_w4a16 or cfg.is_block_quantized)

    a1, a2 = t(8), t(8)
    for flag in (False, True):
        static = make_int8_moe_quant_config(w1, w2, a1, a2, per_act_token_quant=flag)
        assert static.kind == "int8_w8a8" and static.static_act_scales
        assert static.a1_scale is a1 and static.a2_scale is a2
        assert static.per_act_token_quant is flag and static.is_per_tensor is not flag


@pytest.mark.parametrize("which", ["a1", "a2"])
@pytest.mark.parametrize("flag", [False, True])
def test_int8_quant_config_mismatched_pair(which: str, flag: bool) -> None:
    s = torch.ones(8)
    kwargs = {"a1_scale": s} if which == "a1" else {"a2_scale": s}
    with pytest.raises(ValueError, match="a1_scale and a2_scale must both be provided") as e:
        make_int8_moe_quant_config(s, s, per_act_token_quant=flag, **kwargs)
    assert isinstance(e.value, mq.ConfigError)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        (("x", "y"), {}, "w1_scale: expected a torch tensor or a numpy array, got str"),
        ((SCALE, None), {}, "w2_scale: expected a torch tensor or a numpy array, got NoneType"),
        # A stray value must not count as a stored activation scale (vLLM's mode follows from
        # which scales are given), nor a string as the per-token flag.
        ((SCALE, SCALE, "", SCALE), {}, "a1_scale: expected .* or None, got str"),
        ((SCALE, SCALE, SCALE, [1.0]), {}, "a2_scale: expected .* or None, got list"),
        ((SCALE, SCALE), {"w2_bias": 0.0}, "w2_bias: expected .* or None, got float"),
        ((SCALE, SCALE), {"per_act_token_quant": "False"}, "per_act_token_quant: expected True"),
        ((SCALE, SCALE), {"per_act_token_quant": 1}, "per_act_token_quant: expected True"),
    ],
)
def test_int8_quant_config_refuses_what_is_not_a_scale_or_flag(
    args: tuple, kwargs: dict, match: str
) -> None:
    """Before, any value counted: ``"False"`` as the per-token flag made the config dynamic
    W8A8, and a string where an activation scale goes made it static."""
    with pytest.raises(mq.LayoutError, match=match):
        make_int8_moe_quant_config(*args, **kwargs)
    assert make_int8_moe_quant_config(SCALE, SCALE.numpy(), per_act_token_quant=np.True_).kind == (
        "int8_w8a8"
    )


def test_int8_quant_config_pair_check_survives_python_O() -> None:
    code = "import torch, moeq_rs.oracle as o\nassert False, 'asserts are stripped under -O'\n"
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, "python -O must strip asserts for this test to mean anything"
    code = (
        "import torch, moeq_rs.oracle as o\n"
        "try:\n"
        "    o.make_int8_moe_quant_config(torch.ones(2), torch.ones(2), a1_scale=torch.ones(1))\n"
        "except ValueError as e:\n"
        "    print('raised', type(e).__name__)\n"
    )
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "raised ConfigError", r.stderr


def test_wna16_scale_kind() -> None:
    assert wna16_scale_kind(4, 32) == "int4_static_group32"
    assert wna16_scale_kind(4, 128) == "int4_static_group"
    assert wna16_scale_kind(4, -1) == wna16_scale_kind(4, None) == "int4_static_channel"
    assert wna16_scale_kind(8, 128) == "int8_static_group"
    assert wna16_scale_kind(8, None) == "int8_static_channel"
    with pytest.raises(mq.UnsupportedSchemeError, match="num_bits 3"):
        wna16_scale_kind(3, 128)


def test_check_moe_marlin_supports_layer() -> None:
    assert check_moe_marlin_supports_layer(2048, 768, 128)
    assert check_moe_marlin_supports_layer(2048, 768, None)
    assert not check_moe_marlin_supports_layer(2000, 768, 128)
    assert "hidden_size=2000" in marlin_support_reason(2000, 768, 128)
    assert check_moe_marlin_supports_layer(2048, 96, 32)
    assert not check_moe_marlin_supports_layer(2048, 96, 32, allow_tile_padding=False)


# ---- plans of every fixture -----------------------------------------------------------------


def run_inspect(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`moeq inspect PATH ARGS...` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "moeq_rs", "inspect", str(path), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def inspect(path: Path, *args: str) -> dict[str, Any]:
    r = run_inspect(path, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# name -> per-layer (method, scale_kind, quant kind, per-token, group, static, cpu backend,
#          cuda sm90 backend or the start of its error)
QC = tuple[str, bool, int, bool]
PLANS: dict[str, list[tuple[str, str, QC | None, str | None, str]]] = {
    "qwen3_w4a16_g128_sym": [
        (
            "wna16",
            "int4_static_group",
            ("int4_w4a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "qwen3_w4a16_g128_asym": [
        (
            "wna16",
            "int4_static_group",
            ("int4_w4a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "qwen3_w8a16_g128": [
        (
            "wna16",
            "int8_static_group",
            ("int8_w8a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "qwen3_w8a16_channel": [
        (
            "wna16",
            "int8_static_channel",
            ("int8_w8a16", False, -1, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "mixtral_w8a16_channel": [
        (
            "wna16",
            "int8_static_channel",
            ("int8_w8a16", False, -1, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "qwen3_w8a8_dynamic": [
        (
            "w8a8_int8",
            "int8_channel_dynamic_token",
            ("int8_w8a8", True, -1, False),
            "cpu_simd",
            "cuda_int8_w8a8",
        )
    ]
    * 2,
    "deepseek_v3_w8a8_dynamic": [
        (
            "w8a8_int8",
            "int8_channel_dynamic_token",
            ("int8_w8a8", True, -1, False),
            "cpu_simd",
            "cuda_int8_w8a8",
        )
    ]
    * 2,
    "qwen3_w8a8_static": [
        (
            "w8a8_int8",
            "int8_channel_static_tensor",
            ("int8_w8a8", False, -1, True),
            "cpu_simd",
            "cuda_int8_w8a8",
        )
    ]
    * 2,
    "laguna_mixed_int4_int8": [
        (
            "wna16",
            "int4_static_group",
            ("int4_w4a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        ),
        (
            "wna16",
            "int8_static_group",
            ("int8_w8a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        ),
    ],
    # I = 128 = one group along K for w2: act-order Marlin needs more than one group.
    "qwen3_w4a16_actorder": [
        (
            "wna16",
            "int4_static_group",
            ("int4_w4a16", False, 128, False),
            "cpu_simd",
            "error:no cuda backend can run this layer",
        )
    ]
    * 2,
    "qwen3_w4a16_sharded": [
        (
            "wna16",
            "int4_static_group",
            ("int4_w4a16", False, 128, False),
            "cpu_simd",
            "cuda_marlin_wna16",
        )
    ]
    * 2,
    "qwen3_unquantized": [("unquantized", "none", None, None, "none")] * 2,
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_fields_of_every_fixture(fixture_path: Callable[[str], Path], name: str) -> None:
    path = fixture_path(name)
    cpu = inspect(path)
    cuda = inspect(path, "--platform", "cuda", "--sm", "90")
    assert cpu["platform"]["name"] == "cpu" and cuda["platform"] == {
        "name": "cuda",
        "sm": 90,
        "cpu_features": None,
    }
    expected = PLANS[name]
    assert len(cpu["moe_layers"]) == len(expected)
    for lc, lg, (method, scale, qc, cpu_backend, cuda_outcome) in zip(
        cpu["moe_layers"], cuda["moe_layers"], expected, strict=True
    ):
        for layer in (lc, lg):
            assert layer["method"] == method
            assert layer["scale_kind"] == scale
            if qc is None:
                assert layer["quant_config"] is None
            else:
                assert layer["quant_config"] == {
                    "kind": qc[0],
                    "per_act_token_quant": qc[1],
                    "group_size": qc[2],
                    "static_act_scales": qc[3],
                }
        assert lc["backend"] == cpu_backend
        assert lc["error"] is None
        if cuda_outcome == "none":
            assert lg["backend"] is None and lg["error"] is None
        elif cuda_outcome.startswith("error:"):
            assert lg["backend"] is None
            assert lg["error"].startswith(cuda_outcome.removeprefix("error:"))
        else:
            assert lg["backend"] == cuda_outcome and lg["error"] is None
        for layer in (lc, lg):
            if layer["backend"] or layer["error"]:
                names = {r["backend"] for r in layer["rejected_backends"]}
                assert names == {"cpu_simd", "cuda_marlin_wna16", "cuda_int8_w8a8"} - {
                    layer["backend"]
                }
                assert all(r["reason"] for r in layer["rejected_backends"])


def test_plan_per_expert_mix(fixture_path: Callable[[str], Path]) -> None:
    path = fixture_path("qwen3_mixed_per_expert")
    cpu = inspect(path)
    for layer in cpu["moe_layers"]:
        assert (layer["method"], layer["backend"], layer["error"]) == ("mixed", "cpu_simd", None)
        assert layer["quant_config"] is None
        for e in layer["experts"]:
            kind = "int4_w4a16" if e["expert"] < 4 else "int8_w8a16"
            assert e["quant_config"]["kind"] == kind and e["backend"] == "cpu_simd"
            assert e["error"] is None
    cuda = inspect(path, "--platform", "cuda")
    for layer in cuda["moe_layers"]:
        assert layer["backend"] is None and "cpu_simd only" in layer["error"]


def test_explicit_backend_does_not_fall_back(fixture_path: Callable[[str], Path]) -> None:
    doc = inspect(fixture_path("qwen3_w4a16_g128_sym"), "--backend", "cuda_marlin_wna16")
    for layer in doc["moe_layers"]:
        assert layer["backend"] is None
        assert layer["error"].startswith("backend cuda_marlin_wna16 was requested")
    assert doc["requested_backend"] == "cuda_marlin_wna16"


def test_tp_size_reaches_the_plan(fixture_path: Callable[[str], Path]) -> None:
    # I = 128, tp 2 -> 64 per partition: not a multiple of group 128.
    doc = inspect(fixture_path("qwen3_w4a16_g128_sym"), "--platform", "cuda", "--tp-size", "2")
    for layer in doc["moe_layers"]:
        assert "intermediate per partition 64 is not a multiple of group_size 128" in layer["error"]


BAD_INTS = [-1, 2**64, True, 1.5, "128"]


@pytest.mark.parametrize("value", BAD_INTS)
def test_integer_arguments_out_of_range_name_the_argument(
    fixture_path: Callable[[str], Path], value: object
) -> None:
    """Negative, huge, bool, float and string values of integer arguments are MoeqErrors naming
    the argument (the native module's unsigned and 32-bit parameters answered negative and
    huge values with an OverflowError naming nothing)."""
    path = fixture_path("qwen3_w4a16_g128_sym")
    ckpt = mq.open(path)
    cases = [
        (lambda: wna16_scale_kind(value, 128), mq.UnsupportedSchemeError, "num_bits"),
        (lambda: marlin_support_reason(value, 256, 128), mq.LayoutError, "hidden_size"),
        (
            lambda: marlin_support_reason(256, value, 128),
            mq.LayoutError,
            "intermediate_size_per_partition",
        ),
        (lambda: mq.plan(ckpt, "cuda", value), mq.ConfigError, "arguments: sm"),
        (lambda: mq.plan(ckpt, "cuda", 90, tp_size=value), mq.ConfigError, "arguments: tp_size"),
        (lambda: ckpt.marlin_layer(value), mq.LayoutError, "layer"),
        (lambda: mq.MoELayer.from_checkpoint(ckpt, value), mq.CheckpointError, "layer"),
    ]
    if value != -1:  # -1 is channelwise
        cases.append((lambda: wna16_scale_kind(4, value), mq.UnsupportedSchemeError, "group_size"))
        cases.append((lambda: marlin_support_reason(256, 256, value), mq.LayoutError, "group_size"))
    for call, error, name in cases:
        with pytest.raises(error, match=f"{name}.*{value!r}"):
            call()


def test_integer_arguments_accept_numpy_and_torch_integers(
    fixture_path: Callable[[str], Path],
) -> None:
    ckpt = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    assert wna16_scale_kind(np.int32(4), torch.tensor(128)) == wna16_scale_kind(4, 128)
    assert marlin_support_reason(np.int64(256), np.uint16(256), np.int8(-1)) is None
    plain = mq.plan(ckpt, "cuda", 90, tp_size=2)
    assert mq.plan(ckpt, "cuda", np.int64(90), tp_size=torch.tensor(2)) == plain
    assert ckpt.marlin_layer(np.int64(0))[0] == ckpt.marlin_layer(0)[0]


def test_vllm_compat_report(fixture_path: Callable[[str], Path]) -> None:
    doc = inspect(fixture_path("laguna_mixed_int4_int8"), "--platform", "cuda", "--compat", "vllm")
    assert doc["vllm_snapshot"] == "7cfb97e33791"
    for layer in doc["moe_layers"]:
        assert layer["vllm"]["method"] == "CompressedTensorsWNA16MoEMethod"
        assert layer["vllm"]["backend"] == "MARLIN" and layer["vllm"]["error"] is None
    regs = {r["id"]: r for r in doc["vllm_regressions"]}
    assert regs["int8-grouped-wna16"]["layers"] == [2]
    assert "v0.27.0 and v0.27.1" in regs["int8-grouped-wna16"]["summary"]

    doc = inspect(fixture_path("qwen3_w8a8_dynamic"), "--platform", "cuda", "--compat", "vllm")
    assert {r["id"] for r in doc["vllm_regressions"]} == {"dynamic-w8a8-as-w8a16"}
    assert doc["moe_layers"][0]["vllm"]["backend"] == "TRITON"

    doc = inspect(fixture_path("qwen3_w8a8_static"), "--platform", "cuda", "--compat", "vllm")
    assert doc["moe_layers"][0]["vllm"]["error"].startswith("RuntimeError: Unsupported FusedMoe")
    assert doc["moe_layers"][0]["backend"] == "cuda_int8_w8a8"

    doc = inspect(fixture_path("qwen3_mixed_per_expert"), "--platform", "cuda", "--compat", "vllm")
    assert "expert 0's scheme" in doc["moe_layers"][0]["vllm"]["error"]
    # Without --compat there is no vllm key.
    assert "vllm" not in inspect(fixture_path("qwen3_w8a8_static"))["moe_layers"][0]


def test_vllm_compat_int_weight_only_in_int_quantized_format(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """W8A16 stored `int-quantized` (int8 `weight` tensors, as compressed-tensors writes that
    format): vLLM's config parse asserts float weights for a weight-only group in an
    activation-quantization format, so the model does not load, whatever its MoE layers; every
    layer's vllm verdict says so (checked against vLLM 0.32's own `from_config`). moeq's own
    plan keeps its reason: weight-only MoE layers need `pack-quantized`."""
    from safetensors.torch import load_file, save_file

    src = fixture_path("qwen3_w8a16_channel")
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        if name.endswith(".weight_packed"):
            # 8-bit pack-quantized: four (q + 128) bytes per int32, lowest first (little-endian).
            codes = value.contiguous().view(torch.uint8).reshape(value.shape[0], -1)
            out[name.removesuffix("_packed")] = (codes.to(torch.int16) - 128).to(torch.int8)
        elif not name.endswith(".weight_shape"):
            out[name] = value
    config = json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    qc["format"] = "int-quantized"
    for group in qc["config_groups"].values():
        group["format"] = "int-quantized"
    dst = tmp_path / "w8a16_int_quantized"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})

    name = "model.layers.0.mlp.experts.0.up_proj"
    ckpt = mq.open(dst)
    assert torch.equal(ckpt.dequantize(name), mq.open(src).dequantize(name))
    doc = inspect(dst, "--platform", "cuda", "--sm", "90", "--compat", "vllm")
    assert doc["moe_layers"]
    for layer in doc["moe_layers"]:
        verdict = layer["vllm"]
        assert verdict["method"] is None and verdict["backend"] is None
        assert verdict["error"].startswith("AssertionError (while parsing quantization_config")
        assert '"group_0"' in verdict["error"] and '"int-quantized"' in verdict["error"]
        assert layer["backend"] is None
        assert (
            layer["error"] == 'weight-only MoE needs format "pack-quantized", found "int-quantized"'
        )


def test_vllm_compat_reads_no_declared_format_as_none(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A config that names no format (neither global nor in the group): moeq_rs infers
    pack-quantized from the tensors and plans Marlin, but vLLM reads the format as None and its
    weight-only MoE method raises, so the vllm verdict is that error (it reported Marlin).
    Found by a review helper."""
    import shutil

    src = fixture_path("qwen3_w4a16_g128_sym")
    dst = tmp_path / "no_format"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ref"))
    config = json.loads((src / "config.json").read_text())
    qc = config["quantization_config"]
    qc.pop("format", None)
    for group in qc["config_groups"].values():
        group.pop("format", None)
    (dst / "config.json").write_text(json.dumps(config))
    doc = inspect(dst, "--platform", "cuda", "--sm", "90", "--compat", "vllm")
    assert doc["moe_layers"]
    for layer in doc["moe_layers"]:
        assert layer["format"] == "pack-quantized" and layer["backend"] == "cuda_marlin_wna16"
        verdict = layer["vllm"]
        assert verdict["method"] is None and verdict["backend"] is None
        assert verdict["error"].startswith("ValueError: For Fused MoE layers, only format")
        assert "format None" in verdict["error"]
    # Declared as moeq_rs infers it, the verdict is Marlin.
    doc = inspect(src, "--platform", "cuda", "--sm", "90", "--compat", "vllm")
    assert all(layer["vllm"]["backend"] == "MARLIN" for layer in doc["moe_layers"])


def test_vllm_compat_reads_empty_input_activations_as_none(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`"input_activations": {}`: compressed-tensors (and moeq's own plan) read the default
    arguments, static per-tensor int8, which want an `input_scale`; vLLM reads the empty (falsy)
    dict as no activation quantization (`_quantization_scheme_map_from_config`). In the
    activation-quantization format `int-quantized` that trips its float-weights assert at config
    parse; in `pack-quantized` the group is weight-only to vLLM, so its WNA16 path (and the
    int8-grouped regression) apply."""
    from safetensors.torch import load_file, save_file

    def with_empty_activations(name: str) -> Path:
        src = fixture_path(name)
        tensors = load_file(str(src / "model.safetensors"))
        for key in list(tensors):
            if key.endswith(".weight_scale"):
                scale_key = key.removesuffix("weight_scale") + "input_scale"
                tensors.setdefault(scale_key, torch.tensor([0.02], dtype=torch.bfloat16))
        config = json.loads((src / "config.json").read_text())
        for group in config["quantization_config"]["config_groups"].values():
            group["input_activations"] = {}
        dst = tmp_path / name
        dst.mkdir()
        (dst / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst

    def compat_layers(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        doc = inspect(
            with_empty_activations(name), "--platform", "cuda", "--sm", "90", "--compat", "vllm"
        )
        assert doc["moe_layers"]
        return doc, doc["moe_layers"]

    doc, layers = compat_layers("qwen3_w8a8_static")
    for layer in layers:
        assert layer["method"] == "w8a8_int8" and layer["activation"]["dynamic"] is False
        error = layer["vllm"]["error"]
        assert error.startswith("AssertionError (while parsing quantization_config"), error
        assert "an empty input_activations ({})" in error
    # The parse fails before any layer code: no layer-level regression applies.
    assert doc["vllm_regressions"] == []

    doc, layers = compat_layers("qwen3_w8a16_g128")
    for layer in layers:
        # moeq reads static activations, as compressed-tensors does.
        assert layer["activation"] is not None and layer["activation"]["dynamic"] is False
        verdict = layer["vllm"]
        assert verdict["error"] is None, verdict
        assert "WNA16" in verdict["method"], verdict
    assert "int8-grouped-wna16" in {r["id"] for r in doc["vllm_regressions"]}


def test_vllm_compat_column_of_the_table(fixture_path: Callable[[str], Path]) -> None:
    """The text table's vllm column: method / backend where vLLM would load the layer,
    "error" where it would raise (its message follows the table, per layer)."""
    import subprocess
    import sys

    def rows(name: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "moeq_rs", "inspect", str(fixture_path(name)), "--platform",
             "cuda", "--sm", "90", "--compat", "vllm"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return [line for line in out.splitlines() if line[:1].isdigit()]

    assert all(
        r.endswith("CompressedTensorsWNA16MoEMethod / MARLIN")
        for r in rows("laguna_mixed_int4_int8")
    )
    static = rows("qwen3_w8a8_static")
    assert static and all(r.split()[-1] == "error" for r in static)


def test_plan_api(fixture_path: Callable[[str], Path]) -> None:
    path = fixture_path("laguna_mixed_int4_int8")
    by_path = mq.plan(path, "cuda", 90)
    by_ckpt = mq.plan(mq.open(path), platform="cuda", sm=90)
    assert by_path == by_ckpt
    assert isinstance(by_path, mq.Plan)
    assert by_path.layer(2)["quant_config"]["kind"] == "int8_w8a16"
    with pytest.raises(KeyError):
        by_path.layer(0)
    with pytest.raises(mq.ConfigError, match="platform"):
        mq.plan(path, "tpu")  # type: ignore[arg-type]
    with pytest.raises(mq.ConfigError, match="backend"):
        mq.plan(path, backend="marlin")


def test_cli_rejects_sm_without_cuda(fixture_path: Callable[[str], Path]) -> None:
    r = run_inspect(fixture_path("qwen3_w8a16_g128"), "--sm", "90")
    assert r.returncode == 1 and r.stderr.startswith("moeq: error: --sm needs --platform cuda")


def test_cli_table_with_compat(fixture_path: Callable[[str], Path]) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeq_rs",
            "inspect",
            str(fixture_path("laguna_mixed_int4_int8")),
            "--compat",
            "vllm",
            "--platform",
            "cuda",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("layer"))
    assert header.split() == [
        "layer",
        "experts",
        "bits",
        "group",
        "symmetric",
        "activation",
        "format",
        "method",
        "backend",
        "vllm",
    ]
    assert any("v0.27.0 and v0.27.1" in line for line in lines)
    assert np.any(["cuda_marlin_wna16" in line for line in lines])


@pytest.mark.parametrize("sm", [0, 7, 200, 1000, 4294967295])
def test_an_sm_that_is_no_compute_capability_is_refused(
    fixture_path: Callable[[str], Path], sm: int
) -> None:
    """--sm took any u32: 1000 planned Marlin, 7 planned as a GPU of major version 0."""
    with pytest.raises(mq.ConfigError, match=f"sm: {sm} is not a compute capability"):
        mq.plan(fixture_path("qwen3_w8a16_g128"), platform="cuda", sm=sm)
    r = run_inspect(fixture_path("qwen3_w8a16_g128"), "--platform", "cuda", "--sm", str(sm))
    assert r.returncode == 1
    assert r.stderr.startswith(f"moeq: error: argument --sm: '{sm}' is not a compute capability")


def test_non_gated_experts_are_planned_for_the_cpu_only(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Experts without gate_proj (`silu(up)`) were planned on cuda_marlin_wna16, whose layout
    moeq_rs cannot build for them (`repack --target marlin` refused the layer the plan
    accepted). The CUDA backends now refuse them with the reason; the CPU runs them."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = fixture_path("qwen3_w4a16_g128_sym")
    d = tmp_path / "nongated"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not (".experts." in k and ".gate_proj." in k)}
    save_file(kept, str(d / "model.safetensors"))
    cuda = mq.plan(d, "cuda", 90).layer(0)
    assert cuda["gated"] is False and cuda["backend"] is None
    reasons = dict((r["backend"], r["reason"]) for r in cuda["rejected_backends"])
    assert reasons["cuda_marlin_wna16"].startswith("non-gated experts (no gate_proj)")
    assert "non-gated experts" in cuda["error"]
    with pytest.raises(mq.UnsupportedSchemeError, match="non-gated experts"):
        mq.open(d).marlin_layer(0)
    assert mq.plan(d, "cpu").layer(0)["backend"] == "cpu_simd"
    layer = mq.MoELayer.from_checkpoint(d, 0)
    assert layer(torch.randn(3, layer.hidden_size), torch.randn(3, layer.num_experts)).shape == (
        3,
        layer.hidden_size,
    )
