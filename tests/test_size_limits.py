"""Sizes that no stored byte backs, or that overflow: refused with a typed error when the
checkpoint opens, never a Rust panic, an abort on a huge allocation, or minutes of work."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import moeq_rs as mq
from moeq_rs import cli
from synth import quant_config, read_raw, write_checkpoint, write_raw

PREFIX = "model.layers.0.mlp.experts"


def _write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose tensors all hold zero bytes (shapes with a zero dimension)."""
    hdr = {k: {"dtype": t, "shape": s, "data_offsets": [0, 0]} for k, (t, s) in tensors.items()}
    write_raw(path, hdr, b"")


def test_experts_of_zero_hidden_size_are_refused(tmp_path: Path) -> None:
    # [I, 0] projections hold no bytes whatever I says; the forward sized its buffers by I
    # (2**40 floats: the process aborted).
    inter = 2**40
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "num_experts": 2, "num_experts_per_tok": 1})
    )
    tensors = {
        f"{PREFIX}.{e}.{p}.weight": ("BF16", shape)
        for e in range(2)
        for p, shape in [
            ("gate_proj", [inter, 0]),
            ("up_proj", [inter, 0]),
            ("down_proj", [0, inter]),
        ]
    }
    tensors["model.layers.0.mlp.gate.weight"] = ("BF16", [2, 0])
    _write_header_only(tmp_path / "model.safetensors", tensors)
    with pytest.raises(mq.MoeqError, match=r"experts\.0.*must be positive"):
        mq.open(tmp_path)


def _cpu_layout(tmp_path: Path, hidden: int, inter: int) -> Path:
    e = 2
    weights = {
        "num_bits": 4,
        "type": "int",
        "strategy": "group",
        "group_size": 32,
        "symmetric": True,
        "actorder": None,
    }
    layer = {
        "layer": 0,
        "prefix": PREFIX,
        "num_experts": e,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "weights": weights,
        "activation": None,
    }
    config = {
        "model_type": "qwen3_moe",
        "num_experts": e,
        "num_experts_per_tok": 1,
        "quantization_config": quant_config(),
        "moeq": {"layout": "cpu", "layout_version": 1, "layers": [layer]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    two_i = min(2 * inter, 2**62)
    _write_header_only(
        tmp_path / "model.safetensors",
        {
            f"{PREFIX}.w13_weight_packed": ("I8", [e, two_i, hidden]),
            f"{PREFIX}.w2_weight_packed": ("I8", [e, hidden, inter]),
            f"{PREFIX}.w13_weight_scale": ("F32", [e, two_i, hidden // 32]),
            f"{PREFIX}.w2_weight_scale": ("F32", [e, hidden, inter // 32]),
            "model.layers.0.mlp.gate.weight": ("BF16", [e, hidden]),
        },
    )
    return tmp_path


@pytest.mark.parametrize(
    ("hidden", "inter", "want"),
    [
        (0, 2**40, r"moeq\.layers\[0\]\.hidden_size.*0 is not a size"),
    ],
)
def test_cpu_layout_sizes_are_checked(tmp_path: Path, hidden: int, inter: int, want: str) -> None:
    # hidden 0 made every stored tensor empty, so the shape check passed for any intermediate
    # size; loading the layer then aborted on a 4 TB allocation.
    with pytest.raises(mq.ConfigError, match=want):
        mq.open(_cpu_layout(tmp_path, hidden, inter))


@pytest.mark.parametrize("target", ["cpu", "marlin"])
@pytest.mark.parametrize(
    ("key", "value", "want"),
    [
        ("intermediate_size", 2**20 + 1, r"too large \(at most 1048576\)"),
        ("hidden_size", 2**64 - 1, "too large"),
        ("num_experts", 0, "0 is not a size"),
        ("intermediate_size", 0, "0 is not a size"),
        ("layer", 2**21, "too large"),
    ],
)
def test_repacked_layout_sizes_are_bounded(
    tmp_path: Path, target: str, key: str, value: int, want: str
) -> None:
    # Sizes are checked before the stored tensors are compared with them (whose shapes the
    # layout computes from the sizes: 2 * I wrapped for I near 2**63).
    out = tmp_path / target
    mq.repack.repack_checkpoint(write_checkpoint(tmp_path / "src"), out, target=target)
    config = json.loads((out / "config.json").read_text())
    config["moeq"]["layers"][0][key] = value
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(mq.ConfigError, match=rf"moeq\.layers\[0\]\.{key}: .*{want}"):
        mq.open(out)


@pytest.mark.parametrize("bits", [0, 33, 64, 2**32 + 4])
def test_marlin_layout_num_bits_is_4_or_8(tmp_path: Path, bits: int) -> None:
    # 0 divided by zero, 33 and 64 panicked; 2**32 + 4 was cut down to 4 and accepted.
    src = write_checkpoint(tmp_path / "src")
    out = tmp_path / "marlin"
    mq.repack.repack_checkpoint(src, out, target="marlin")
    config = json.loads((out / "config.json").read_text())
    config["moeq"]["layers"][0]["num_bits"] = bits
    (out / "config.json").write_text(json.dumps(config))
    want = rf"moeq\.layers\[0\]\.num_bits: {bits} is (not 4 or 8|too large)"
    with pytest.raises(mq.ConfigError, match=want):
        mq.open(out)


def test_packed_weight_shape_that_overflows(tmp_path: Path) -> None:
    # in * bits wrapped around: [32, 2**62 + 8] at 4 bits packed to one word, so a 128-byte
    # tensor passed as a module of 2**62 inputs (dequantize: a panic).
    q = "model.layers.0.self_attn.q_proj"
    qc = quant_config()
    qc["config_groups"]["group_1"] = {
        "targets": [q],
        "format": "pack-quantized",
        "input_activations": None,
        "weights": {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "channel",
            "group_size": None,
            "dynamic": False,
        },
    }
    d = write_checkpoint(
        tmp_path / "m",
        qc=qc,
        replace={
            f"{q}.weight_packed": torch.zeros(32, 1, dtype=torch.int32),
            f"{q}.weight_scale": torch.ones(32, 1, dtype=torch.bfloat16),
            f"{q}.weight_shape": torch.tensor([32, 2**62 + 8]),
        },
    )
    with pytest.raises(mq.MoeqError, match=rf"{q}.*weight_shape \[32, {2**62 + 8}\] is too large"):
        mq.open(d)


def test_index_naming_a_shard_per_tensor_fails_fast(tmp_path: Path) -> None:
    # The distinct shard names were collected by a linear search per entry: 250k entries took
    # 92 s before the error. A bound far above the few tenths of a second it takes now.
    d = write_checkpoint(tmp_path / "m", shards=2)
    weight_map = {f"t{i}": f"s{i}.safetensors" for i in range(250_000)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    start = time.monotonic()
    with pytest.raises(mq.CheckpointError, match="names shard 's0.safetensors' which does not"):
        mq.open(d)
    assert time.monotonic() - start < 30


def test_cli_reports_a_rust_panic_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # pyo3 raises a Rust panic as PanicException, a BaseException: `except Exception` let it
    # through as a traceback. (No known input panics; a stand-in of that name is raised.)
    class PanicException(BaseException):
        pass

    def panics(_args: object) -> int:
        raise PanicException("attempt to divide by zero")

    monkeypatch.setattr(cli, "_cmd_inspect", panics)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", str(tmp_path)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "moeq: error: internal error (a bug in moeq_rs): Rust panic: attempt to divide by zero "
        "(set MOEQ_DEBUG=1 for a traceback)"
    ]
    monkeypatch.setenv("MOEQ_DEBUG", "1")
    with pytest.raises(PanicException):
        cli.main(["inspect", str(tmp_path)])


@pytest.mark.parametrize("intermediate", [2**62, 2**63 + 8, 16])
def test_native_layer_sizes_must_match_the_arrays(intermediate: int) -> None:
    # A direct native call takes its sizes apart from the arrays: 2**62 rows looped for hours
    # before any length was compared, and 2 * intermediate wrapped past 2**63.
    from moeq_rs import _core

    i8, f = np.zeros(16, np.int8), np.ones(16, np.float32)
    none = {"w13_u32": None, "w13_zp_i8": None, "w13_zp_u32": None, "a13": None}
    none2 = {"w2_u32": None, "w2_zp_i8": None, "w2_zp_u32": None, "a2": None}
    start = time.monotonic()
    with pytest.raises(mq.LayoutError, match=r"w13: holds 16 values, not the"):
        _core.CpuMoeLayer.from_tensors(
            "w8a16", 1, 1, intermediate, -1, w13_i8=i8, w13_scale=f, **none,
            w2_i8=i8, w2_scale=f, **none2, top_k=1, renormalize=True,
        )  # fmt: skip
    assert time.monotonic() - start < 10


def _with_f4_tensor(src: Path, dst: Path, nbytes: int) -> bytes:
    """``src`` with a packed F4 tensor of ``2 * nbytes`` values appended; returns its bytes."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    hdr, data = read_raw(dst / "model.safetensors")
    payload = bytes(range(256)) * (nbytes // 256)
    hdr["zz.weight"] = {
        "dtype": "F4",
        "shape": [2 * nbytes],
        "data_offsets": [len(data), len(data) + nbytes],
    }
    write_raw(dst / "model.safetensors", hdr, data + payload)
    return payload


def test_sub_byte_tensors_are_views_of_their_packed_bytes(tmp_path: Path) -> None:
    # F4 and F6 were exported as one byte per value: an array twice the tensor's size (F4),
    # whose reads ran past the mapping (a segfault) or into the next tensor's bytes.
    payload = _with_f4_tensor(write_checkpoint(tmp_path / "src"), tmp_path / "f4", 1 << 20)
    ck = mq.open(tmp_path / "f4")
    view = ck.view("zz.weight")
    assert (view.dtype, view.shape, view.nbytes) == ("F4", [2 << 20], 1 << 20)
    a = ck.tensor("zz.weight")
    assert a.dtype == np.uint8 and a.shape == (1 << 20,) and not a.flags.writeable
    assert a.tobytes() == payload
    assert int(a.astype(np.int64).sum()) == sum(payload)
    f4 = getattr(torch, "float4_e2m1fn_x2", None)
    if f4 is None:
        # (A torch without the packed-F4 dtype: the torch view is refused, the dtype named.)
        with pytest.raises(TypeError, match="F4 has no torch equivalent"):
            ck.tensor("zz.weight", framework="torch")
        return
    t = ck.tensor("zz.weight", framework="torch")
    assert t.dtype == f4 and t.shape == (1 << 20,)
    assert t.view(torch.uint8).numpy().tobytes() == payload


@pytest.mark.parametrize("value", [-1, 2**64, 1e300, 2.5, "2", True])
def test_declared_expert_count_must_be_a_count(tmp_path: Path, value: object) -> None:
    # A value that was not an unsigned integer was skipped, and with it the check that the
    # checkpoint holds the experts the config declares.
    d = write_checkpoint(tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["num_experts"] = value
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(mq.ConfigError, match=r"config\.json: num_experts: "):
        mq.open(d)


@pytest.mark.parametrize("value", [2, 2.0, [2, 2]])
def test_declared_expert_counts_that_are_accepted(tmp_path: Path, value: object) -> None:
    # An integral float is a count (Python's json writes one that went through a float); a
    # list (a count per modality, ERNIE-4.5-VL) is passed over.
    d = write_checkpoint(tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["num_experts"] = value
    (d / "config.json").write_text(json.dumps(config))
    assert mq.open(d).summary()["moe_layers"][0]["num_experts"] == 2
