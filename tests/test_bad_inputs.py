"""One test per kind of bad input: each raises the right MoeqError subclass naming the file,
tensor, module or key, and none crashes the interpreter or panics."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moeq_rs as mq
from synth import read_raw, write_checkpoint, write_raw

EXPERT0 = "model.layers.0.mlp.experts.0.gate_proj"


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "model")


def st(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def test_valid_synthetic_checkpoint_opens(ckpt: Path) -> None:
    c = mq.open(ckpt)
    layers = c.moe_layers()
    assert [layer["num_experts"] for layer in layers] == [2]
    assert layers[0]["weight"]["num_bits"] == 4


def test_truncated_file(ckpt: Path) -> None:
    blob = st(ckpt).read_bytes()
    st(ckpt).write_bytes(blob[: len(blob) - 100])
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*truncated"):
        mq.open(ckpt)


def test_file_shorter_than_prefix(ckpt: Path) -> None:
    st(ckpt).write_bytes(b"\x01\x02")
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*8-byte"):
        mq.open(ckpt)


def test_header_length_beyond_file(ckpt: Path) -> None:
    blob = bytearray(st(ckpt).read_bytes())
    blob[:8] = struct.pack("<Q", len(blob) * 2)
    st(ckpt).write_bytes(bytes(blob))
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*runs past the end"):
        mq.open(ckpt)


def test_oversized_header(ckpt: Path) -> None:
    blob = bytearray(st(ckpt).read_bytes())
    blob[:8] = struct.pack("<Q", 200_000_000)
    st(ckpt).write_bytes(bytes(blob))
    with pytest.raises(
        mq.CheckpointError, match="model.safetensors.*exceeds the 100000000-byte limit"
    ):
        mq.open(ckpt)


def test_invalid_json(ckpt: Path) -> None:
    header, data = read_raw(st(ckpt))
    h = json.dumps(header).encode()[:-1]  # drop the closing brace
    st(ckpt).write_bytes(struct.pack("<Q", len(h)) + h + data)
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*not valid JSON"):
        mq.open(ckpt)


def test_overlapping_offsets(ckpt: Path) -> None:
    header, data = read_raw(st(ckpt))
    name = f"{EXPERT0}.weight_shape"
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b - 8, e - 8]
    write_raw(st(ckpt), header, data)
    with pytest.raises(mq.CheckpointError, match="overlaps|gap"):
        mq.open(ckpt)


def test_dtype_shape_mismatch(ckpt: Path) -> None:
    header, data = read_raw(st(ckpt))
    header[f"{EXPERT0}.weight_scale"]["dtype"] = "F32"
    write_raw(st(ckpt), header, data)
    with pytest.raises(mq.CheckpointError, match=f"{EXPERT0}.weight_scale.*bytes"):
        mq.open(ckpt)


def test_trailing_bytes(ckpt: Path) -> None:
    st(ckpt).write_bytes(st(ckpt).read_bytes() + b"polyglot")
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*8 trailing bytes"):
        mq.open(ckpt)


def test_misaligned_tensor(ckpt: Path) -> None:
    # Rebuild the file with a 1-byte U8 tensor first, so every later tensor is shifted by one.
    header, data = read_raw(st(ckpt))
    meta = header.pop("__metadata__", None)
    shifted = {"aaa_pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    for name, info in header.items():
        b, e = info["data_offsets"]
        shifted[name] = {**info, "data_offsets": [b + 1, e + 1]}
    if meta:
        shifted["__metadata__"] = meta
    write_raw(st(ckpt), shifted, b"\x00" + data)
    with pytest.raises(mq.CheckpointError, match="not aligned"):
        mq.open(ckpt)


def test_missing_shard(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", shards=3)
    (c / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        mq.CheckpointError, match="model-00002-of-00003.safetensors.*does not exist"
    ):
        mq.open(c)


def test_index_names_missing_tensor(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", shards=2)
    idx = json.loads((c / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.mlp.experts.9.up_proj.weight_packed"] = (
        "model-00001-of-00002.safetensors"
    )
    (c / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(mq.CheckpointError, match="experts.9.up_proj.weight_packed"):
        mq.open(c)


def test_tensor_missing_from_index(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", shards=2)
    idx = json.loads((c / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    del idx["weight_map"][name]
    (c / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(mq.CheckpointError, match=f"does not list tensor '{name}'"):
        mq.open(c)


def test_index_shard_path_traversal(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", shards=2)
    idx = json.loads((c / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../elsewhere.safetensors"
    (c / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(mq.CheckpointError, match="not a plain file name"):
        mq.open(c)


def test_missing_weight_scale(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", drop=(f"{EXPERT0}.weight_scale",))
    with pytest.raises(mq.CheckpointError, match=f"{EXPERT0}.weight_scale"):
        mq.open(c)


def test_scale_shape_inconsistent_with_group_size(tmp_path: Path) -> None:
    bad = torch.ones(32, 3, dtype=torch.bfloat16)  # 64 inputs / group 32 = 2 groups, not 3
    c = write_checkpoint(tmp_path / "m", replace={f"{EXPERT0}.weight_scale": bad})
    with pytest.raises(
        mq.CheckpointError, match=f"{EXPERT0}.*weight_scale has shape \\[32, 3\\].*\\[32, 2\\]"
    ):
        mq.open(c)


def test_packed_width_inconsistent_with_weight_shape(tmp_path: Path) -> None:
    c = write_checkpoint(
        tmp_path / "m", replace={f"{EXPERT0}.weight_shape": torch.tensor([32, 72])}
    )
    with pytest.raises(mq.CheckpointError, match=f"{EXPERT0}.*weight_packed has shape"):
        mq.open(c)


def test_unknown_format(tmp_path: Path) -> None:
    from synth import quant_config

    c = write_checkpoint(tmp_path / "m", qc=quant_config(format="zip-quantized"))
    with pytest.raises(
        mq.ConfigError, match="config.json.*quantization_config.format.*zip-quantized"
    ):
        mq.open(c)


def test_wrong_type_names_key_path(tmp_path: Path) -> None:
    from synth import quant_config

    qc = quant_config()
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = "4"
    c = write_checkpoint(tmp_path / "m", qc=qc)
    with pytest.raises(
        mq.ConfigError, match="quantization_config.config_groups.group_0.weights.num_bits"
    ):
        mq.open(c)


def test_online_transform(tmp_path: Path) -> None:
    from synth import quant_config

    qc = quant_config(
        transform_config={
            "config_groups": {
                "spin": {
                    "type": "hadamard",
                    "apply": [{"targets": ["Linear"], "location": "input"}],
                }
            }
        }
    )
    c = write_checkpoint(tmp_path / "m", qc=qc)
    with pytest.raises(mq.UnsupportedSchemeError, match="transform_config.*online hadamard"):
        mq.open(c)


def test_lfs_pointer(ckpt: Path) -> None:
    st(ckpt).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 4096\n")
    with pytest.raises(mq.CheckpointError, match="model.safetensors.*Git LFS pointer"):
        mq.open(ckpt)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(mq.CheckpointError, match="does not exist"):
        mq.open(tmp_path / "nope")


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(mq.CheckpointError, match="no weights found"):
        mq.open(tmp_path)


def test_invalid_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(mq.ConfigError, match="config.json"):
        mq.open(ckpt)


def test_missing_expert(tmp_path: Path) -> None:
    names = [
        f"model.layers.0.mlp.experts.0.{p}.{t}"
        for p in ("gate_proj", "up_proj", "down_proj")
        for t in ("weight_packed", "weight_scale", "weight_shape")
    ]
    c = write_checkpoint(tmp_path / "m", drop=tuple(names))
    with pytest.raises(mq.CheckpointError, match="expert 0 is missing"):
        mq.open(c)


def test_errors_are_value_errors() -> None:
    assert issubclass(mq.CheckpointError, ValueError)
    assert issubclass(mq.ConfigError, mq.MoeqError)
    assert issubclass(mq.CudaUnavailableError, RuntimeError)


@pytest.mark.parametrize("corrupt", ["truncate", "lfs", "config"])
def test_cli_bad_input_is_one_line_exit_1(ckpt: Path, corrupt: str) -> None:
    if corrupt == "truncate":
        st(ckpt).write_bytes(st(ckpt).read_bytes()[:50])
    elif corrupt == "lfs":
        st(ckpt).write_text("version https://git-lfs.github.com/spec/v1\n")
    else:
        (ckpt / "config.json").write_text("[]")
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "inspect", str(ckpt)], capture_output=True, text=True
    )
    assert r.returncode == 1
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeq: error: "), r.stderr
    assert "Traceback" not in r.stderr and "panick" not in r.stderr


@pytest.mark.parametrize(
    "argv",
    [[], ["inspect"], ["inspect", "x", "--platform", "tpu"], ["repack", "a", "b"], ["frobnicate"]],
)
def test_cli_usage_errors_are_one_line(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "moeq_rs", *argv], capture_output=True, text=True)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeq: error: "), r.stderr


def test_out_of_range_act_order_g_idx(fixture_path, tmp_path: Path) -> None:
    """A g_idx entry naming a group the scales do not have is refused by the CPU loader and the
    Marlin conversion (it would index past the scales), naming the tensor and the entry."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / "m"
    shutil.copytree(fixture_path("qwen3_w4a16_actorder"), dst)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight_g_idx"
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        if name in tensors:
            tensors[name] = tensors[name].clone()
            tensors[name][5] = 99
            save_file(tensors, f, metadata={"format": "pt"})
            break
    else:
        pytest.fail(f"{name} not in the fixture")
    ckpt = mq.open(dst)
    with pytest.raises(mq.MoeqError, match=r"gate_proj.*entry 5 is 99"):
        mq.MoELayer.from_checkpoint(ckpt, 0)
    with pytest.raises(mq.MoeqError, match=r"gate_proj\.weight_g_idx.*entry 5 is 99"):
        ckpt.marlin_layer(0)
    with pytest.raises(mq.MoeqError, match=r"gate_proj\.weight_g_idx.*entry 5 is 99"):
        mq.repack.repack_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
