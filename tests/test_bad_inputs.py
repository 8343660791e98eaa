"""One test per kind of bad input: each raises the right MoeqError subclass naming the file,
tensor, module or key, and none crashes the interpreter or panics."""

from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
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
    with pytest.raises(
        mq.CheckpointError,
        match=rf"model\.safetensors: tensor '{re.escape(name)}': .*overlaps the previous tensor",
    ):
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
    with pytest.raises(mq.CheckpointError, match=r"model\.safetensors: tensor '.+'.*not aligned"):
        mq.open(ckpt)


def test_missing_shard(tmp_path: Path) -> None:
    c = write_checkpoint(tmp_path / "m", shards=3)
    (c / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        mq.CheckpointError, match="model-00002-of-00003.safetensors.*does not exist"
    ):
        mq.open(c)

    # A shard that is there but not a file said "does not exist" too.
    (c / "model-00002-of-00003.safetensors").mkdir()
    with pytest.raises(
        mq.CheckpointError, match="model-00002-of-00003.safetensors', which is a directory"
    ):
        mq.open(c)
    (c / "model-00002-of-00003.safetensors").rmdir()
    (c / "model-00002-of-00003.safetensors").symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(
        mq.CheckpointError, match="00003.safetensors', which is a broken symbolic link"
    ):
        mq.open(c)


def test_plan_layer_takes_a_layer_index(tmp_path: Path) -> None:
    """`Plan.layer("0")` said decoder layer 0 is not an MoE layer (a KeyError), though it is."""
    plan = mq.plan(write_checkpoint(tmp_path / "m"))
    assert plan.layer(0)["layer"] == 0
    for bad in ("0", 0.0, False, -1):
        with pytest.raises(mq.ConfigError, match="is not a decoder layer index"):
            plan.layer(bad)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="decoder layer 9 is not an MoE layer"):
        plan.layer(9)


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


@pytest.mark.parametrize(
    "shard,match",
    [
        ("../elsewhere.safetensors", "not a plain file name"),
        # A regular file that is not a shard (it said "which is not a regular file").
        ("config.json", "'config.json', which is not a .safetensors file"),
    ],
)
def test_index_shard_names_that_are_not_shards(tmp_path: Path, shard: str, match: str) -> None:
    c = write_checkpoint(tmp_path / "m", shards=2)
    idx = json.loads((c / "model.safetensors.index.json").read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = shard
    (c / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(mq.CheckpointError, match=match):
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


@pytest.mark.parametrize("key", ["hidden_size", "moe_intermediate_size"])
@pytest.mark.parametrize("value", ["64", -64, 64.5, True, 1e30])
def test_config_sizes_that_are_not_counts_are_refused(
    tmp_path: Path, key: str, value: object
) -> None:
    """`hidden_size` or `moe_intermediate_size` that is not a count (a string, a negative, a
    fraction, a bool, beyond 2**64) skipped the check of the experts against it, silently; the
    expert count's spellings were refused. Now every size is, naming the key. A list of sizes
    (per layer, in some families) and an integral float still pass."""
    c = write_checkpoint(tmp_path / "m")
    cfg_path = c / "config.json"
    cfg = json.loads(cfg_path.read_text())
    good = cfg[key]
    cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=f"{key}"):
        mq.open(c)
    for fine in (float(good), [good]):
        cfg[key] = fine
        cfg_path.write_text(json.dumps(cfg))
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
    with pytest.raises(
        mq.CheckpointError, match=f"{re.escape(str(tmp_path / 'nope'))}: does not exist"
    ):
        mq.open(tmp_path / "nope")


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(mq.CheckpointError, match="no weights found"):
        mq.open(tmp_path)


def test_weights_or_config_that_are_not_files(ckpt: Path, tmp_path: Path) -> None:
    """A dangling model.safetensors symlink said "no weights found", and a config.json that is
    a directory or a dangling symlink "config.json not found": each now says what is there."""
    weights = st(ckpt)
    weights.rename(tmp_path / "moved.safetensors")
    weights.symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(mq.CheckpointError, match="model.safetensors: is a broken symbolic link"):
        mq.open(ckpt)
    weights.unlink()
    (tmp_path / "moved.safetensors").rename(weights)
    config = ckpt / "config.json"
    config.unlink()
    config.mkdir()
    with pytest.raises(mq.CheckpointError, match="config.json: is a directory, not a file"):
        mq.open(ckpt)
    config.rmdir()
    config.symlink_to(tmp_path / "gone.json")
    with pytest.raises(mq.CheckpointError, match="config.json: is a broken symbolic link"):
        mq.open(ckpt)
    # An index that is not a file said "no weights found" (there is no model.safetensors).
    config.unlink()
    config.write_text("{}")
    weights.unlink()
    index = ckpt / "model.safetensors.index.json"
    index.mkdir()
    with pytest.raises(
        mq.CheckpointError, match=r"model.safetensors.index.json: is a directory, not a file"
    ):
        mq.open(ckpt)
    index.rmdir()
    index.symlink_to(tmp_path / "gone.json")
    with pytest.raises(
        mq.CheckpointError, match=r"model.safetensors.index.json: is a broken symbolic link"
    ):
        mq.open(ckpt)
    # A link that leads back to itself is said to loop, not to lack a target.
    index.unlink()
    index.symlink_to(index.name)
    with pytest.raises(mq.CheckpointError, match=r"index.json: is a symbolic link that loops"):
        mq.open(ckpt)


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
    "argv,names",
    [
        ([], "COMMAND"),
        (["inspect"], "MODEL_DIR"),
        (["inspect", "x", "--platform", "tpu"], "--platform"),
        (["repack", "a", "b"], "--target"),
        (["frobnicate"], "COMMAND"),
        # The flag by its name (it said "arguments: sm: 0", plan()'s argument).
        (["inspect", "x", "--platform", "cuda", "--sm", "0"], "argument --sm: '0' is not a"),
        (["inspect", "x", "--sm", "9o"], "argument --sm: '9o' is not a"),
    ],
)
def test_cli_usage_errors_are_one_line(argv: list[str], names: str) -> None:
    r = subprocess.run([sys.executable, "-m", "moeq_rs", *argv], capture_output=True, text=True)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeq: error: "), r.stderr
    assert names in lines[0], r.stderr


def test_cli_stops_quietly_when_the_reader_goes_away() -> None:
    """`moeq inspect ... | head`: a closed stdout ends the command with SIGPIPE's status and
    nothing on stderr (it printed "moeq: error: Broken pipe" and exited 1)."""
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "moeq_rs", "inspect", "examples/tiny-moe-int4-int8"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["inspect", "--help"]])
def test_cli_help_and_version_report_a_failed_write(argv: list[str]) -> None:
    """argparse ignores a failed write of its help or version text: `moeq --version >
    /dev/full` exited 0 having written nothing. It is now an error, and a readable stdout still
    gets the text."""
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "moeq_rs", *argv], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert (r.returncode, r.stderr.strip()) == (
        1,
        "moeq: error: cannot write to stdout: No space left on device",
    )
    ok = subprocess.run([sys.executable, "-m", "moeq_rs", *argv], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip() and not ok.stderr


@pytest.mark.parametrize("json_out", [False, True])
def test_inspect_reports_a_stdout_it_cannot_write(json_out: bool) -> None:
    """`moeq inspect >&-` (stdout closed from the start): the table form exited 0 having
    written nothing, `--json` died with an internal AttributeError. Both are now one line
    naming stdout, exit 1, as a full disk is (which said only "No space left on device").
    Found by a review helper."""
    argv = [sys.executable, "-m", "moeq_rs", "inspect", "examples/tiny-moe-int4-int8"]
    argv += ["--json"] if json_out else []
    root = Path(__file__).resolve().parent.parent
    closed = subprocess.run(
        ["/bin/sh", "-c", 'exec "$@" >&-', "sh", *argv], capture_output=True, text=True, cwd=root
    )
    assert (closed.returncode, closed.stderr) == (
        1,
        "moeq: error: cannot write to stdout: it is closed\n",
    )
    if Path("/dev/full").exists():
        with open("/dev/full", "w") as full:
            r = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, cwd=root)
        assert (r.returncode, r.stderr) == (
            1,
            "moeq: error: cannot write to stdout: No space left on device\n",
        )


def _copy_with_tensor_edited(src: Path, dst: Path, name: str, edit) -> Path:  # type: ignore[no-untyped-def]
    """A copy of checkpoint ``src`` at ``dst`` whose tensor ``name`` (in whichever shard holds
    it) is ``edit(copy of it)``; returns the shard file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        if name in tensors:
            tensors[name] = edit(tensors[name].clone())
            save_file(tensors, f, metadata={"format": "pt"})
            return f
    pytest.fail(f"{name} not in the fixture")


def test_out_of_range_act_order_g_idx(fixture_path, tmp_path: Path) -> None:
    """A g_idx entry naming a group the scales do not have is refused by the CPU loader and the
    Marlin conversion (it would index past the scales), naming the tensor and the entry."""

    def entry_5_is_99(t: torch.Tensor) -> torch.Tensor:
        t[5] = 99
        return t

    dst = tmp_path / "m"
    name = "model.layers.0.mlp.experts.0.gate_proj.weight_g_idx"
    _copy_with_tensor_edited(fixture_path("qwen3_w4a16_actorder"), dst, name, entry_5_is_99)
    ckpt = mq.open(dst)
    with pytest.raises(mq.MoeqError, match=r"gate_proj.*entry 5 is 99"):
        mq.MoELayer.from_checkpoint(ckpt, 0)
    with pytest.raises(mq.MoeqError, match=r"gate_proj\.weight_g_idx.*entry 5 is 99"):
        ckpt.marlin_layer(0)
    with pytest.raises(mq.MoeqError, match=r"gate_proj\.weight_g_idx.*entry 5 is 99"):
        mq.repack.repack_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "fixture, tensor, value",
    [
        ("qwen3_w4a16_g128_sym", "model.layers.0.mlp.experts.3.down_proj.weight_scale", "nan"),
        ("qwen3_w8a8_static", "model.layers.0.mlp.experts.1.up_proj.weight_scale", "-inf"),
        ("qwen3_w8a8_static", "model.layers.0.mlp.experts.2.down_proj.input_scale", "inf"),
    ],
)
def test_non_finite_scale(
    fixture_path, tmp_path: Path, fixture: str, tensor: str, value: str
) -> None:
    """A NaN or infinite scale would make every token routed through it NaN: the CPU loader and
    the CPU repack refuse it, naming the file, the tensor and the element, and leave no output."""

    def last_is_value(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[t.numel() - 1] = float(value)
        return t

    dst = tmp_path / "m"
    f = _copy_with_tensor_edited(fixture_path(fixture), dst, tensor, last_is_value)
    last = math.prod(mq.open(dst).tensor_info(tensor)[1]) - 1
    want = rf"{f.name}: tensor '{tensor}': element {last} is {value.replace('nan', 'NaN')}"
    _refused_by_cpu_loader_and_repack(dst, tmp_path / "out", mq.CheckpointError, want)


def _refused_by_cpu_loader_and_repack(dst: Path, out: Path, error: type, want: str) -> None:
    """Loading layer 0 of `dst` and repacking it for the CPU raise `error` matching `want`, and
    the repack leaves nothing at `out`."""
    with pytest.raises(error, match=want):
        mq.MoELayer.from_checkpoint(dst, 0)
    with pytest.raises(error, match=want):
        mq.repack.repack_checkpoint(dst, out, target="cpu")
    assert not out.exists()


def _plans_refuse_layer_0(dst: Path, want: str) -> None:
    """On both platforms, layer 0 of `dst` has no backend and says `want`; the others plan."""
    for platform, sm in (("cpu", None), ("cuda", 90)):
        layer, *others = mq.plan(mq.open(dst), platform=platform, sm=sm)["moe_layers"]
        assert layer["layer"] == 0 and layer["backend"] is None
        assert re.search(want, layer["error"]), layer["error"]
        assert any(re.search(want, r["reason"]) for r in layer["rejected_backends"])
        assert all(other["error"] is None for other in others)


def _valid_raw_layer(rng: random.Random) -> tuple[list[torch.Tensor], dict, int, int]:
    """Raw tensors and keyword arguments that `MoELayer.from_tensors` accepts."""
    e, h, i = rng.choice([1, 2, 4]), rng.choice([32, 64, 128]), rng.choice([16, 32, 64])
    scheme = rng.choice(["w8a8_dynamic", "w8a8_static", "w8a16", "w4a16"])
    sizes = [g for g in (16, 32) if i % g == 0]  # h is a multiple of both
    gs = -1 if scheme.startswith("w8a8") or rng.random() < 0.3 else rng.choice(sizes)
    g13, g2 = (1, 1) if gs == -1 else (h // gs, i // gs)
    kw: dict = dict(scheme=scheme, group_size=gs, top_k=rng.randint(1, e))
    if scheme == "w4a16":
        words = lambda *s: torch.randint(-(2**31), 2**31, s, dtype=torch.int64).to(torch.int32)  # noqa: E731
        w13, w2 = words(e, 2 * i, h // 8), words(e, h, i // 8)
        if rng.random() < 0.5:
            kw["w13_zero_point"], kw["w2_zero_point"] = (
                words(e, 2 * i // 8, g13),
                words(e, h // 8, g2),
            )
    else:
        w13 = torch.randint(-128, 128, (e, 2 * i, h), dtype=torch.int8)
        w2 = torch.randint(-128, 128, (e, h, i), dtype=torch.int8)
    sd = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    s13, s2 = (torch.rand(e, 2 * i, g13) * 0.02).to(sd), (torch.rand(e, h, g2) * 0.02).to(sd)
    if scheme == "w8a8_static":
        kw["a13_scale"], kw["a2_scale"] = torch.rand(e) * 0.05 + 0.01, torch.rand(e) * 0.05 + 0.01
    return [w13, w2, s13, s2], kw, e, h


def _mutated(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """``t`` with one thing wrong: layout, size, dtype, rank, emptiness or a non-finite value."""
    r = rng.randrange(8)
    if r == 0 and t.dim() >= 2:
        return t.transpose(-1, -2)
    if r == 1:
        return t[..., :-1]
    if r == 2:
        return t.to(
            rng.choice([torch.float32, torch.int64, torch.uint8, torch.float64, torch.int16])
        )
    if r == 3:
        return t.unsqueeze(0)
    if r == 4:
        return t[:0]
    if r == 5:
        return torch.cat([t, t], dim=-1)
    if r == 6 and t.is_floating_point():
        return t * float(rng.choice(["nan", "inf"]))
    return t[::2] if t.dim() and t.shape[0] > 1 else t.reshape(-1)


def test_random_mutations_are_moeq_errors_or_correct_shapes() -> None:
    """Valid raw layers with up to two random things wrong (a tensor's layout, size, dtype, rank
    or values; group_size, top_k, ids out of range): building and every forward either raise a
    MoeqError naming an argument or return a [T, H] tensor in the input dtype. Nothing else:
    no ZeroDivisionError, OverflowError, panic or crash (the first found this way: group_size=0
    divided by zero). A new seed each run, printed on failure."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")  # shown by pytest when the test fails, whatever escapes
    rng = random.Random(seed)
    # A seed of our own without changing torch's global generator for the tests after this.
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        built, ran = _mutation_rounds(rng, seed)
    # The mutations leave enough valid cases for the forwards to be exercised.
    assert built >= 40 and ran >= 100, (seed, built, ran)


def _mutation_rounds(rng: random.Random, seed: int) -> tuple[int, int]:
    """150 layers with up to two faults each, through from_tensors and the three forwards:
    (layers built, forwards that returned)."""
    built = ran = 0
    for _ in range(150):
        args, kw, e, h = _valid_raw_layer(rng)
        for _ in range(rng.choice([0, 0, 1, 2])):
            j = rng.randrange(7)
            if j < 4:
                args[j] = _mutated(args[j], rng)
            elif j == 4:
                kw["group_size"] = rng.choice([0, -2, 3, 2**40, True, 2.0])
            elif j == 5:
                kw["top_k"] = rng.choice([0, e + 1, -1, 2**70, 1.5])
            else:
                kw["a2_scale"] = torch.rand(e) * float(rng.choice(["nan", "inf", 1.0]))
        try:
            layer = mq.MoELayer.from_tensors(*args, **kw)
        except mq.MoeqError as err:
            assert ": " in str(err), (seed, err)
            continue
        built += 1
        t, k = rng.choice([0, 1, 3, 17]), layer.top_k
        for dtype in (torch.float32, torch.bfloat16):
            x, logits = torch.randn(t, h, dtype=dtype), torch.randn(t, e)
            ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
            ids, w = ids.to(torch.int64), torch.rand(t, k)
            if rng.random() < 0.5:
                which = rng.randrange(4)
                if which == 0:
                    x = _mutated(x, rng)
                elif which == 1:
                    logits = _mutated(logits, rng)
                elif which == 2:
                    ids = ids * 0 + rng.choice([e, -1, 2**31 - 1])
                else:
                    w = _mutated(w, rng)
            rest = {a: b for a, b in kw.items() if a not in ("scheme", "group_size", "top_k")}
            calls = [
                partial(layer, x, logits),
                partial(layer.forward_topk, x, w, ids),
                partial(
                    mq.fused_moe,
                    x,
                    *args,
                    w,
                    ids,
                    scheme=kw["scheme"],
                    group_size=kw["group_size"],
                    **rest,
                ),
            ]
            for call in calls:
                try:
                    with torch.inference_mode():
                        out = call()
                except mq.MoeqError:
                    continue
                ran += 1
                assert out.shape == x.shape and out.dtype == x.dtype, (seed, out.shape, x.shape)
    return built, ran


_ODD_VALUES = [None, -1, 0, 1, 3, 8, 33, 128, 2**31, 2**64, 1.5, 1e308, "", "x", "I8", "F16"]
_ODD_VALUES += ["group", "tensor", [], [1], [0, 0], {}, {"a": 1}, True, False]


def _corrupt_json(obj: object, rng: random.Random) -> str:
    """Changes, deletes or retypes one value somewhere in a JSON tree; says what."""
    parent, key = None, None
    while isinstance(obj, (dict, list)) and obj and (parent is None or rng.random() < 0.75):
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
        parent, key = obj, rng.choice(keys)
        obj = parent[key]
    if parent is None:
        return "nothing"
    old = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.2:
        del parent[key]
        return f"deleted {key}"
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.5:
        parent[key] = old + rng.choice([-1, 1, old])
    else:
        parent[key] = rng.choice(_ODD_VALUES)
    return f"{key}: {str(old)[:30]} -> {parent[key]!r}"


def _corrupt_checkpoint(d: Path, rng: random.Random) -> list[str]:
    """One or two random structural faults in `d`'s config.json (mostly its
    quantization_config), shard index or a safetensors header."""
    what = []
    for _ in range(rng.choice([1, 2])):
        target = rng.choice(["config"] * 3 + ["header"] * 2 + ["index"])
        index = d / "model.safetensors.index.json"
        if target == "config":
            cfg = json.loads((d / "config.json").read_text())
            q = cfg.get("quantization_config")
            sub = q if isinstance(q, dict) and rng.random() < 0.7 else cfg
            what.append("config.json " + _corrupt_json(sub, rng))
            (d / "config.json").write_text(json.dumps(cfg))
        elif target == "index" and index.exists():
            ix = json.loads(index.read_text())
            what.append("index " + _corrupt_json(ix, rng))
            index.write_text(json.dumps(ix))
        else:
            file = rng.choice(sorted(d.glob("*.safetensors")))
            header, data = read_raw(file)
            what.append(f"{file.name} header " + _corrupt_json(header, rng))
            write_raw(file, header, data)
    return what


def _open_plan_and_run(d: Path) -> None:
    """What a user does with a checkpoint: open, summarise, plan for both platforms, read
    tensors, and load and run each MoE layer on the CPU."""
    ckpt = mq.open(d)
    ckpt.summary()
    mq.plan(ckpt, "cpu").to_json()
    mq.plan(ckpt, "cuda", 80).to_json()
    for name in ckpt.tensor_names():
        ckpt.tensor(name)
    for info in ckpt.moe_layers():
        moe = mq.MoELayer.from_checkpoint(ckpt, info["layer"])
        x = torch.randn(3, moe.hidden_size)
        out = moe(x, torch.randn(3, moe.num_experts))
        assert out.shape == x.shape and out.dtype == x.dtype


# A corrupted model_type is a family never checked: the warning is expected, not a finding.
@pytest.mark.filterwarnings("ignore::moeq_rs.UncheckedRoutingWarning")
def test_random_header_and_config_corruption(fixture_path, tmp_path: Path) -> None:
    """Random structural faults in config.json, the shard index or a safetensors header of
    real checkpoints (compressed-tensors and CPU layouts): opening, planning, reading and
    running either raise a MoeqError naming what is wrong or work. Nothing else escapes: no
    KeyError, TypeError, panic or crash. A new seed each run, printed on failure."""
    import shutil

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    names = [
        "qwen3_w4a16_g128_asym",
        "qwen3_w8a8_static",
        "deepseek_v3_w8a8_dynamic",
        "laguna_mixed_int4_int8",
        "qwen3_w4a16_sharded",
        "mixtral_w8a16_channel",
    ]
    sources = [fixture_path(n) for n in names]
    for n in ("laguna_mixed_int4_int8", "deepseek_v3_w8a8_dynamic"):
        mq.repack.repack_checkpoint(fixture_path(n), tmp_path / f"cpu-{n}", target="cpu")
        sources.append(tmp_path / f"cpu-{n}")
    for src in sources:
        _open_plan_and_run(src)  # each source is sound before it is corrupted
    ran = refused = 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for i in range(150):
            d = tmp_path / f"round{i}"
            shutil.copytree(rng.choice(sources), d)
            what = _corrupt_checkpoint(d, rng)
            try:
                _open_plan_and_run(d)
                ran += 1
            except mq.MoeqError as err:
                assert ": " in str(err), (seed, what, err)
                refused += 1
            shutil.rmtree(d)
    assert ran >= 8 and refused >= 60, (seed, ran, refused)  # both outcomes exercised


def test_gate_and_up_static_input_scales_must_agree(fixture_path, tmp_path: Path) -> None:
    """W8A8 static: gate and up see one input, so one expert's two input scales must agree
    (DESIGN.md). The CPU loader and the CPU repack refuse a checkpoint where they do not,
    naming both modules, and `inspect` says so up front on both platforms instead of planning
    a backend that then refuses the layer."""
    up = "model.layers.0.mlp.experts.3.up_proj"

    def doubled(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    dst = tmp_path / "m"
    _copy_with_tensor_edited(fixture_path("qwen3_w8a8_static"), dst, f"{up}.input_scale", doubled)
    want = rf"'model.layers.0.mlp.experts.3.gate_proj' and '{up}': static input scales differ"
    _refused_by_cpu_loader_and_repack(dst, tmp_path / "out", mq.UnsupportedSchemeError, want)
    _plans_refuse_layer_0(dst, want)
    # The fixture itself plans onto the CPU.
    plan = mq.plan(mq.open(fixture_path("qwen3_w8a8_static")), platform="cpu")
    assert [(x["backend"], x["error"]) for x in plan["moe_layers"]][0] == ("cpu_simd", None)


@pytest.mark.parametrize("value", [0.0, -0.5])  # exact in the checkpoint's bf16
@pytest.mark.parametrize("module", ["experts.1.gate_proj", "experts.2.down_proj"])
def test_static_input_scales_must_be_positive(
    fixture_path, tmp_path: Path, module: str, value: float
) -> None:
    """A zero or negative static activation scale has no codes to give (the quantiser produced
    zeros, so the expert's output was silently 0): the CPU loader and the CPU repack refuse it,
    naming the tensor and the element; so does `MoELayer.from_tensors`, naming the argument."""
    tensor = f"model.layers.0.mlp.{module}.input_scale"

    def set_value(t: torch.Tensor) -> torch.Tensor:
        t.fill_(value)
        return t

    dst = tmp_path / "m"
    f = _copy_with_tensor_edited(fixture_path("qwen3_w8a8_static"), dst, tensor, set_value)
    if module.endswith("gate_proj"):  # gate and up must agree, so up gets the value too
        from safetensors.torch import load_file, save_file

        tensors = load_file(f)
        up = tensor.replace("gate_proj", "up_proj")
        tensors[up] = set_value(tensors[up].clone())
        save_file(tensors, f, metadata={"format": "pt"})
    want = (
        rf"{f.name}: tensor '{tensor}': element 0 is {value:g}; "
        "static activation scales must be positive"
    )
    _refused_by_cpu_loader_and_repack(dst, tmp_path / "out", mq.CheckpointError, want)
    # The plans say so up front on both platforms, and the CUDA loader refuses it too.
    _plans_refuse_layer_0(dst, want)
    ckpt = mq.open(dst)
    info = next(x for x in ckpt.moe_layers() if x["layer"] == 0)
    with pytest.raises(mq.CheckpointError, match=f"'{tensor}': .* must be finite and positive"):
        mq.cuda._int8_stack(ckpt, info)


@pytest.mark.parametrize("value", [0.0, -0.02])
@pytest.mark.parametrize("arg", ["a13_scale", "a2_scale"])
def test_from_tensors_static_scales_must_be_positive(arg: str, value: float) -> None:
    e, h, i = 4, 64, 32
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8)
    scales = {"a13_scale": torch.full((e,), 0.02), "a2_scale": torch.full((e,), 0.02)}
    scales[arg][2] = value
    with pytest.raises(mq.LayoutError, match=rf"{arg}: expert 2 is {value:g}; .* must be positive"):
        mq.MoELayer.from_tensors(
            w13,
            w2,
            torch.rand(e, 2 * i) / 1e3,
            torch.rand(e, h) / 1e3,
            scheme="w8a8_static",
            top_k=2,
            **scales,
        )


@pytest.mark.parametrize("value", [True, [False] * 4])
def test_static_scales_are_not_bools(value: object) -> None:
    """A bool read as a number would be a scale of 1.0."""
    e, h, i = 4, 64, 32
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8)
    s13, s2 = torch.rand(e, 2 * i, 1) / 1e3, torch.rand(e, h, 1) / 1e3
    with pytest.raises(mq.LayoutError, match="a13_scale: expected a number .*, got a bool"):
        mq.MoELayer.from_tensors(
            w13, w2, s13, s2, scheme="w8a8_static", a13_scale=value, a2_scale=0.1, top_k=2
        )
    x, w, ids = torch.randn(3, h), torch.rand(3, 2), torch.randint(0, e, (3, 2))
    with pytest.raises(mq.LayoutError, match="a2_scale: expected a number .*, got a bool"):
        mq.fused_moe(
            x, w13, w2, s13, s2, w, ids, scheme="w8a8_static", a13_scale=0.1, a2_scale=value
        )
    # Whole numbers still read as scales.
    got = mq.fused_moe(x, w13, w2, s13, s2, w, ids, scheme="w8a8_static", a13_scale=1, a2_scale=1)
    want = mq.fused_moe(
        x, w13, w2, s13, s2, w, ids, scheme="w8a8_static", a13_scale=1.0, a2_scale=1.0
    )
    assert torch.equal(got, want)


def test_static_scales_given_as_numbers_ignore_torchs_default_dtype() -> None:
    """Numbers for static scales are read as fp32 whatever torch.set_default_dtype says (an
    fp16 default read 0.1 as 0.09998, and from_tensors then disagreed with fused_moe)."""
    e, h, i = 4, 64, 32
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8)
    s13, s2 = torch.rand(e, 2 * i, 1) / 1e3, torch.rand(e, h, 1) / 1e3
    x, w, ids = torch.randn(3, h), torch.rand(3, 2), torch.randint(0, e, (3, 2))

    def run() -> torch.Tensor:
        layer = mq.MoELayer.from_tensors(
            w13, w2, s13, s2, scheme="w8a8_static", a13_scale=0.1, a2_scale=[0.1, 3e-7, 1, 2],
            top_k=2,
        )  # fmt: skip
        return layer.forward_topk(x, w, ids)

    want = run()
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float16)
        got = run()
    finally:
        torch.set_default_dtype(before)
    assert torch.equal(got, want)


def test_paths_may_be_bytes_and_anything_else_is_named(ckpt: Path, tmp_path: Path) -> None:
    """Paths are str, bytes or os.PathLike, as in os.fspath; anything else, or a name that is
    not UTF-8, is a CheckpointError naming the argument (not PyO3's TypeError)."""
    from moeq_rs.repack import repack_checkpoint

    as_text = mq.open(ckpt).summary()
    assert mq.open(os.fsencode(ckpt)).summary() == as_text
    # The constructor opens a path as `open` does (it was an AttributeError on `str`).
    assert mq.Checkpoint(ckpt).summary() == mq.Checkpoint(str(ckpt)).summary() == as_text
    for bad, match in [
        (None, "path: expected a path .*got NoneType"),
        (3, "path: expected a path .*got int"),
        (b"/tmp/\xff", r"path: '/tmp/\\udcff' is not valid UTF-8"),
    ]:
        with pytest.raises(mq.CheckpointError, match=match):
            mq.open(bad)  # type: ignore[arg-type]
        with pytest.raises(mq.CheckpointError, match=match):
            mq.Checkpoint(bad)  # type: ignore[arg-type]
        with pytest.raises(mq.CheckpointError, match=match.replace("path:", "path_or_checkpoint:")):
            mq.plan(bad)  # type: ignore[arg-type]
        with pytest.raises(mq.CheckpointError, match=match.replace("path:", "model_dir:")):
            repack_checkpoint(bad, tmp_path / "never", target="cpu")  # type: ignore[arg-type]
    with pytest.raises(mq.CheckpointError, match="out_dir: expected a path .*got NoneType"):
        repack_checkpoint(ckpt, None, target="cpu")  # type: ignore[arg-type]
    out = tmp_path / "cpu"
    repack_checkpoint(os.fsencode(ckpt), os.fsencode(out), target="cpu")
    repacked = mq.open(out).summary()
    assert (as_text["layout"], repacked["layout"]) == ("compressed-tensors", "cpu")
    assert len(repacked["moe_layers"]) == len(as_text["moe_layers"]) > 0


_SHARED = "model.layers.0.mlp.shared_experts"
_BF16 = torch.bfloat16


def _with_tensors(tmp_path: Path, extra: dict, ignore: list[str] | None = None) -> Path:
    """The synthetic checkpoint with `extra` tensors added (and `ignore` patterns added to the
    quantization config's ignore list)."""
    from safetensors.torch import save_file

    from synth import quant_config, tensors

    qc = quant_config()
    qc["ignore"] = [*qc.get("ignore", []), *(ignore or [])]
    path = tmp_path / "ckpt"
    write_checkpoint(path, qc=qc)
    ts = tensors()
    ts.update(extra)
    save_file(ts, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    "shapes,dtype,message",
    [
        # (gate, up, down) of a shared expert beside routed experts of hidden 64, I 32.
        (((32, 64), (32, 64), (64, 48)), _BF16, r"down is \[64, 48\], expected \[64, 32\]"),
        (((16, 64), (32, 64), (64, 32)), _BF16, r"gate is \[16, 64\] but up is \[32, 64\]"),
        (((32, 48), (32, 48), (48, 32)), _BF16, "takes 48 inputs but the routed experts take 64"),
    ],
)
def test_mis_sized_shared_experts_are_refused_when_the_checkpoint_opens(
    tmp_path: Path, shapes: tuple, dtype: torch.dtype, message: str
) -> None:
    """A shared expert whose projections did not fit together (or took another hidden size)
    was planned cpu_simd and loaded, and then the forward panicked in Rust (slice index out of
    range) or ran with the wrong sizes. Now the checkpoint does not open, as for routed
    experts, and the error names the module. (A shared intermediate size other than the routed
    experts' is normal, as in Qwen2-MoE, and opens.)"""
    extra = {
        f"{_SHARED}.{leaf}.weight": torch.zeros(*shape).to(dtype)
        for leaf, shape in zip(("gate_proj", "up_proj", "down_proj"), shapes, strict=True)
    }
    path = _with_tensors(tmp_path, extra, ignore=[r"re:.*shared_experts.*"])
    with pytest.raises(mq.CheckpointError, match=message) as e:
        mq.open(path)
    assert _SHARED in str(e.value)
    done = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "inspect", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stderr.startswith("moeq: error:")
    assert "Traceback" not in done.stderr and "panicked" not in done.stderr


def test_a_shared_intermediate_size_of_its_own_opens(tmp_path: Path) -> None:
    extra = {
        f"{_SHARED}.{leaf}.weight": torch.zeros(*shape, dtype=_BF16)
        for leaf, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96)))
    }
    path = _with_tensors(tmp_path, extra, ignore=[r"re:.*shared_experts.*"])
    assert mq.plan(path).layer(0)["backend"] == "cpu_simd"


@pytest.mark.parametrize(
    "gate,message",
    [
        (None, r"down_proj.weight': is stored unquantized as I8"),
        ({"weight": torch.zeros(3, 7, dtype=torch.bfloat16)}, r"is BF16 \[3, 7\]"),
        (
            {
                "weight_packed": torch.zeros(1, 8, dtype=torch.int32),
                "weight_scale": torch.ones(1, 2, dtype=torch.bfloat16),
                "weight_shape": torch.tensor([1, 64]),
            },
            "has no plain '.weight' tensor",
        ),
    ],
)
def test_shared_expert_parts_the_cpu_cannot_read_are_refused_by_its_plan(
    tmp_path: Path, gate: dict | None, message: str
) -> None:
    """The plan promised such a layer (cpu_simd, no error) and the loader then refused it
    ('holds 21 values', or a misleading 'not in the checkpoint' for a quantized gate). The CPU
    plan now says why; the checkpoint still opens (other platforms and tools read it)."""
    extra = {
        f"{_SHARED}.{leaf}.weight": torch.zeros(*shape, dtype=_BF16)
        for leaf, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32)))
    }
    if gate is None:
        extra[f"{_SHARED}.down_proj.weight"] = torch.zeros(64, 32, dtype=torch.int8)
    else:
        extra.update({f"model.layers.0.mlp.shared_expert_gate.{k}": v for k, v in gate.items()})
    ignore = [r"re:.*shared_experts.*"]
    if gate is not None and "weight" in gate:
        ignore.append(r"re:.*shared_expert_gate$")
    path = _with_tensors(tmp_path, extra, ignore=ignore)
    layer = mq.plan(path).layer(0)
    assert layer["backend"] is None and re.search(message, layer["error"]), layer
    cuda = mq.plan(path, platform="cuda", sm=90).layer(0)["error"] or ""
    assert "shared" not in cuda, cuda  # (it has its own reason: hidden 64 is too small)
    with pytest.raises(mq.CheckpointError, match=message):
        mq.MoELayer.from_checkpoint(path, 0)


def test_a_missing_top_k_is_a_plan_error_not_a_load_surprise(tmp_path: Path) -> None:
    """Without num_experts_per_tok the plan said cpu_simd (and the table 'top-None'), and only
    the loader refused."""
    path = _with_tensors(tmp_path, {})
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("num_experts_per_tok")
    (path / "config.json").write_text(json.dumps(cfg))
    layer = mq.plan(path).layer(0)
    assert layer["backend"] is None
    assert "num_experts_per_tok: is missing" in layer["error"]
    with pytest.raises(mq.MoeqError, match="num_experts_per_tok"):
        mq.MoELayer.from_checkpoint(path, 0)


@pytest.mark.parametrize(
    "old,new",
    [("experts.1.gate_proj.", "experts.01.gate_proj."), ("experts.1.gate_proj.", "experts.1.w1.")],
)
def test_a_projection_named_twice_is_refused(tmp_path: Path, old: str, new: str) -> None:
    """`experts.1` beside `experts.01`, or `gate_proj` beside Mixtral's `w1`, name one
    projection twice: one copy was silently dropped (which one depended on name order)."""
    from synth import tensors

    twins = {k.replace(old, new): v.clone() for k, v in tensors().items() if old in k}
    assert twins
    path = _with_tensors(tmp_path, twins)
    with pytest.raises(mq.CheckpointError, match="is the same projection of expert 1 as"):
        mq.open(path)


# ---- Checks that a mutation pass over the Python layer found unpinned ----------------------


def _int8_layer_tensors(e: int = 2, h: int = 64, i: int = 32):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    w13 = torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g)
    w2 = torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g)
    return w13, w2, torch.rand(e, 2 * i, 1) * 1e-2, torch.rand(e, h, 1) * 1e-2


def test_from_tensors_argument_checks_the_native_side_does_not_repeat() -> None:
    """One static scale per expert (three for two experts was accepted), and a zero point for
    a symmetric int8 weight-only layer is an unsupported scheme, not a layout error."""
    w13, w2, s13, s2 = _int8_layer_tensors()
    with pytest.raises(mq.LayoutError, match="a13_scale"):
        mq.MoELayer.from_tensors(
            w13, w2, s13, s2, scheme="w8a8_static", a13_scale=torch.ones(3),
            a2_scale=torch.ones(3), top_k=1,
        )  # fmt: skip
    zp = torch.zeros(2, 64, 1, dtype=torch.int8)
    with pytest.raises(mq.UnsupportedSchemeError, match="w13_zero_point: asymmetric int8"):
        mq.MoELayer.from_tensors(
            w13, w2, s13, s2, scheme="w8a16", w13_zero_point=zp, w2_zero_point=zp, top_k=1
        )


def test_routing_and_shape_errors_say_what_is_accepted() -> None:
    """A negative expert id and one past the last are worded alike, by [token, slot]; float8
    inputs are told which dtypes are accepted; an int4 layer whose I is not a multiple of 8 is
    told so, not asked for a w2 shape that cannot exist."""
    w13, w2, s13, s2 = _int8_layer_tensors()
    moe = mq.MoELayer.from_tensors(w13, w2, s13, s2, scheme="w8a16", top_k=2)
    x, w = torch.randn(3, 64), torch.rand(3, 2)
    for bad in (-1, 2):
        ids = torch.tensor([[0, 1], [1, bad], [0, 0]])
        with pytest.raises(
            mq.LayoutError,
            match=rf"moe forward: topk_ids\[1, 1\] = {bad} is not an expert \(the layer has 2",
        ):
            moe.forward_topk(x, w, ids)
    with pytest.raises(
        mq.LayoutError, match="hidden_states: expected float32, float64, float16 or bfloat16"
    ):
        moe(x.to(torch.float8_e4m3fn), torch.randn(3, 2))
    e, h, i = 2, 16, 4
    with pytest.raises(mq.LayoutError, match="a multiple of 8, got I = 4"):
        mq.MoELayer.from_tensors(
            torch.zeros(e, 2 * i, h // 8, dtype=torch.int32),
            torch.zeros(e, h, 1, dtype=torch.int32),
            torch.ones(e, 2 * i, 1), torch.ones(e, h, 1), scheme="w4a16", top_k=1,
        )  # fmt: skip


def test_checkpoint_api_argument_errors(fixture_path) -> None:  # type: ignore[no-untyped-def]
    ck = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    name = next(iter(ck.tensor_names()))
    with pytest.raises(mq.ConfigError, match="framework"):
        ck.tensor(name, framework="jax")
    with pytest.raises(mq.LayoutError, match="not a decoder layer index"):
        ck.marlin_layer(-1)
    with pytest.raises(mq.ConfigError, match="compat"):
        mq.plan(fixture_path("qwen3_w4a16_g128_sym"), compat="bogus")
    # A torch tensor from a checkpoint is the caller's own, writable copy.
    t = ck.tensor(name, "torch")
    before = t.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t.add_(1)
    assert torch.equal(ck.tensor(name, "torch"), before)


def test_repack_primitive_argument_errors() -> None:
    import numpy as np

    from moeq_rs import repack as r

    q = np.zeros((16, 64), np.int32)
    with pytest.raises(mq.LayoutError, match="size_k"):
        r.gptq_marlin_repack(q, None, -1, 64, 4)
    with pytest.raises(mq.LayoutError, match="num_bits"):
        r.gptq_marlin_repack(q, None, 128, 64, 2**32)
    with pytest.raises(mq.LayoutError, match="2- or 4-byte"):
        r.marlin_permute_scales(np.ones((1, 64), np.float64), 128, 64, -1)
    with pytest.raises(mq.LayoutError, match=r"s: expected \[E, G, size_n\], got shape \[1, 64\]"):
        r.marlin_moe_permute_scales(np.ones((1, 64), np.float16), 128, 64, -1)
    with pytest.raises(mq.LayoutError, match="int32 packed words"):
        r.gptq_marlin_unrepack(np.zeros((8, 128), np.int64), None, 128, 64, 4)


def test_cuda_grid_limit_is_exact() -> None:
    """65535 GEMM blocks fit one launch's grid; 65536 do not."""
    from moeq_rs import cuda

    experts = 15
    fits = (65535 - experts) * 16  # (slots + 15) // 16 + experts == 65535
    cuda._check_grid(fits, 1, experts)
    with pytest.raises(mq.LayoutError, match="split the batch"):
        cuda._check_grid(fits + 1, 1, experts)


def test_cli_internal_errors_are_one_line_unless_debugging(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from moeq_rs import cli

    def boom(args):  # type: ignore[no-untyped-def]
        raise ValueError("x")

    monkeypatch.setattr(cli, "_cmd_inspect", boom)
    monkeypatch.delenv("MOEQ_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.main(["inspect", "examples/tiny-moe-int4-int8"])
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip().startswith("moeq: error: internal error: ValueError: x")
    monkeypatch.setenv("MOEQ_DEBUG", "1")
    with pytest.raises(ValueError, match="x"):
        cli.main(["inspect", "examples/tiny-moe-int4-int8"])


def test_import_survives_a_torch_without_the_ops() -> None:
    """A module named torch that is not torch (or a torch the ops cannot load on) leaves
    `import moeq_rs` working: the registration at import gives way."""
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, types; sys.modules['torch'] = types.ModuleType('torch')\n"
            "import moeq_rs; print('ok')",
        ],
        capture_output=True,
        text=True,
    )
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr


def _altered_fixture(
    src: Path, dst: Path, change: dict[str, torch.Tensor], drop: tuple[str, ...] = ()
) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst`` with the tensors ``change``
    written over or added and those named in ``drop`` left out."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "ref"))
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(change)
    for name in drop:
        del tensors[name]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_router_and_input_scale_shapes_are_checked_at_open(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A router of the right row count but the wrong width, and a per-tensor input_scale holding
    more than one value, are refused when the checkpoint opens, naming the tensor (the router's
    width went unchecked; an input_scale's values after the first were silently dropped).
    Found by a review helper."""
    router = "model.layers.0.mlp.gate.weight"
    c = _altered_fixture(
        fixture_path("qwen3_w4a16_g128_sym"), tmp_path / "router", {router: torch.ones(8, 128)}
    )
    with pytest.raises(mq.CheckpointError, match=r"mlp\.gate'.*\[8, 128\], expected \[8, 256\]"):
        mq.open(c)
    scale = "model.layers.0.mlp.experts.0.gate_proj.input_scale"
    c = _altered_fixture(
        fixture_path("qwen3_w8a8_static"), tmp_path / "scale", {scale: torch.tensor([0.02, 1.0])}
    )
    with pytest.raises(mq.CheckpointError, match=r"gate_proj'.*input_scale has shape \[2\], exp"):
        mq.open(c)


def test_fused_expert_tensors_are_refused_naming_the_tensor(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A block whose experts are stored fused (transformers 5's ``experts.gate_up_proj`` [E, 2I,
    H] and ``experts.down_proj``) vanished from the plan: neither MoE nor dense, exit status 0,
    the checkpoint one MoE layer short. It is refused at open, naming the tensor. Found by a
    review helper."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = fixture_path("qwen3_unquantized")
    dst = tmp_path / "fused"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "ref"))
    tensors = load_file(str(src / "model.safetensors"))
    p = "model.layers.1.mlp.experts"
    experts = sorted({int(n.split(".")[5]) for n in tensors if n.startswith(p + ".")})
    gate, up, down = (
        [tensors.pop(f"{p}.{e}.{proj}.weight") for e in experts]
        for proj in ("gate_proj", "up_proj", "down_proj")
    )
    tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up, strict=True)])
    tensors[f"{p}.down_proj"] = torch.stack(down)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    want = r"tensor 'model\.layers\.1\.mlp\.experts\.down_proj': holds several experts"
    with pytest.raises(mq.UnsupportedSchemeError, match=want):
        mq.open(dst)
    with pytest.raises(mq.UnsupportedSchemeError, match=want):
        mq.oracle.plan(dst)
    run = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "inspect", str(dst)], capture_output=True, text=True
    )
    assert run.returncode == 1 and "holds several experts in one tensor" in run.stderr
    # Granite-MoE's names hold no `experts.`: its [E, 2I, H] tensor is found by its shape.
    granite = {
        "model.layers.1.block_sparse_moe.input_linear.weight": tensors.pop(f"{p}.gate_up_proj"),
        "model.layers.1.block_sparse_moe.output_linear.weight": tensors.pop(f"{p}.down_proj"),
    }
    save_file({**tensors, **granite}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(mq.UnsupportedSchemeError, match=r"block_sparse_moe\.input_linear"):
        mq.open(dst)


def test_codes_outside_their_bit_range_are_refused_where_read(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """int8 codes stored as U8 (200) or I32 (300) were dequantised as they stood while the CPU
    loader refused them; an unpacked zero point beyond its range was dequantised as it stood,
    wrapped by the CPU loader and clamped by the Marlin repack. Every reader now refuses a
    value outside the scheme's num_bits range, naming the tensor and element. Found by a review
    helper."""
    from safetensors.torch import load_file

    m = "model.layers.0.mlp.experts.3.gate_proj"
    src = fixture_path("qwen3_w8a8_dynamic")
    w = load_file(str(src / "model.safetensors"))[m + ".weight"]
    good = mq.open(src).dequantize(m)
    u8 = w.to(torch.int16).clamp(min=0).to(torch.uint8)  # the non-negative codes, as U8
    c = _altered_fixture(src, tmp_path / "u8_ok", {m + ".weight": u8})
    assert torch.equal(mq.open(c).dequantize(m), torch.where(w >= 0, good, 0 * good))
    for name, bad, value in (("u8", u8.clone(), 200), ("i32", w.to(torch.int32), 300)):
        bad[1, 2] = value
        c = _altered_fixture(src, tmp_path / name, {m + ".weight": bad})
        element = 1 * w.shape[1] + 2
        want = (
            rf"{m}\.weight.*element {element} is {value} .*8-bit integer codes lie in -128\.\.=127"
        )
        with pytest.raises(mq.CheckpointError, match=want):
            mq.open(c).dequantize(m)
        with pytest.raises(mq.CheckpointError, match=want):
            mq.MoELayer.from_checkpoint(c, 0)

    zp = "model.layers.0.mlp.experts.0.gate_proj.weight_zero_point"
    src = fixture_path("qwen3_w4a16_g128_asym")
    packed = load_file(str(src / "model.safetensors"))[zp]  # [out / 8, groups] int32
    rows = torch.arange(packed.shape[0] * 8)
    fields = (packed[rows // 8] >> (4 * (rows % 8))[:, None]) & 0xF
    unpacked = (fields - 8).to(torch.int8)  # [out, groups], as older compressed-tensors kept it
    c = _altered_fixture(src, tmp_path / "zp_ok", {zp: unpacked})
    module = zp.rsplit(".", 1)[0]
    assert torch.equal(mq.open(c).dequantize(module), mq.open(src).dequantize(module))
    bad_zp = unpacked.clone()
    bad_zp.view(-1)[5] = 9  # 4-bit zero points lie in -8..=7
    c = _altered_fixture(src, tmp_path / "zp", {zp: bad_zp})
    want = r"weight_zero_point.*element 5 is 9 .*4-bit integer codes lie in -8\.\.=7"
    with pytest.raises(mq.CheckpointError, match=want):
        mq.open(c).dequantize(module)
    with pytest.raises(mq.CheckpointError, match=want):
        mq.MoELayer.from_checkpoint(c, 0)
    out = tmp_path / "zp_marlin"
    run = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", "--target", "marlin", str(c), str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 1 and "element 5 is 9" in run.stderr, run.stderr
    assert not out.exists()
    assert not (tmp_path / "zp_marlin").exists()


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("n_shared_experts", 0, "n_shared_experts 0 x moe_intermediate_size 128 (0: no shared"),
        ("n_shared_experts", 2, "n_shared_experts 2 x moe_intermediate_size 128 (256)"),
    ],
)
def test_a_shared_expert_of_another_width_than_the_config_says_is_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path, key: str, value: int, says: str
) -> None:
    """DeepSeek's shared expert is `n_shared_experts` experts of `moe_intermediate_size` fused
    into one MLP; transformers and vLLM build it from the config (none for 0), so a stored one
    of another width does not load there, while the forward here added it regardless. Found by
    a review helper."""
    import shutil

    src = fixture_path("deepseek_v3_w8a8_dynamic")
    assert mq.open(src).moe_layers()  # as shipped (n_shared_experts 1) it opens
    dst = tmp_path / "shared"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ref"))
    config = json.loads((src / "config.json").read_text())
    config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    want = (
        r"model\.layers\.1\.mlp\.shared_experts.*shared expert of intermediate size 128, but "
        + re.escape(f"config.json says {says}")
    )
    with pytest.raises(mq.CheckpointError, match=want):
        mq.open(dst)


def test_an_explicit_shared_expert_width_takes_precedence(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Nemotron-H sizes its shared expert by ``moe_shared_expert_intermediate_size`` (times
    ``n_shared_experts``), not DeepSeek's ``n_shared_experts x moe_intermediate_size``: the
    first width check refused real Nemotron-3-Nano checkpoints (found by a review helper).
    The fixture's shared expert is 128 wide, its routed experts 128."""
    import shutil

    src = fixture_path("deepseek_v3_w8a8_dynamic")
    config = json.loads((src / "config.json").read_text())

    def opened(name: str, **keys: int) -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ref"))
        (dst / "config.json").write_text(json.dumps({**config, **keys}))
        return dst

    # 2 x 64 = 128 (DeepSeek's rule would want 2 x 128 = 256).
    assert mq.open(opened("two", n_shared_experts=2, moe_shared_expert_intermediate_size=64))
    assert mq.open(opened("qwen2", n_shared_experts=2, shared_expert_intermediate_size=128))
    bad = opened("bad", n_shared_experts=1, moe_shared_expert_intermediate_size=96)
    with pytest.raises(
        mq.CheckpointError,
        match=r"intermediate size 128, but config\.json says "
        r"moe_shared_expert_intermediate_size 96 x n_shared_experts 1 \(96\)",
    ):
        mq.open(bad)


@pytest.mark.parametrize("shape", [(4,), (2, 4), (8, 1)])
def test_a_correction_bias_of_the_wrong_shape_refuses_its_layer(
    fixture_path: Callable[[str], Path], tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """A score-correction bias without one value per expert: `inspect` showed the layer planned
    (backend cpu_simd, no error) while the CPU loader refused it. The plan now refuses the layer
    with the loader's reason, in the source and in its CPU repack; the checkpoint still opens.
    Found by a review helper. The shape counts too, not only the number of values: `[2, 4]`
    for 8 experts was taken (found by a fuzzing helper); transformers and vLLM hold `[8]`,
    ERNIE-4.5 `[1, 8]` (tested with its routing) and ERNIE-4.5-VL a row per modality
    (below)."""
    from moeq_rs.repack import repack_checkpoint

    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    c = _altered_fixture(
        fixture_path("deepseek_v3_w8a8_dynamic"), tmp_path / "bias", {bias: torch.zeros(shape)}
    )
    repack_checkpoint(c, tmp_path / "cpu", target="cpu")
    why = (
        f"tensor '{bias}': has shape {list(shape)}, expected one score-correction value per "
        "expert: [8] (or [1, 8] as ERNIE-4.5 stores it)"
    )
    for path in (c, tmp_path / "cpu"):
        doc = json.loads(
            subprocess.run(
                [sys.executable, "-m", "moeq_rs", "inspect", str(path), "--json"],
                capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        (layer,) = [entry for entry in doc["moe_layers"] if entry["layer"] == 1]
        assert layer["backend"] is None and why in layer["error"]
        with pytest.raises(mq.CheckpointError, match=re.escape(why)):
            mq.MoELayer.from_checkpoint(path, 1)
        # The other layer, whose bias is whole, still loads.
        assert mq.MoELayer.from_checkpoint(path, 2).num_experts == 8


def test_ernie_vl_keeps_a_bias_row_per_modality(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """ERNIE-4.5-VL stores `moe_statics.e_score_correction_bias` as one row per modality,
    `[2, E / 2]` (transformers splits it), so the shape rule leaves it to the plan's other
    checks: the CUDA plan keeps its backend, the CPU plan refuses the family's routing."""
    src = fixture_path("deepseek_v3_w8a8_dynamic")
    biases = {n: f"model.layers.{n}.mlp.gate.e_score_correction_bias" for n in (1, 2)}
    statics = {n: f"model.layers.{n}.mlp.moe_statics.e_score_correction_bias" for n in (1, 2)}
    rows = {statics[n]: torch.zeros(2, 4) for n in (1, 2)}

    def ernie(cfg: dict) -> None:
        for key in ("n_routed_experts", "n_group", "topk_group"):
            cfg.pop(key, None)
        cfg.update(model_type="ernie4_5_vl_moe", moe_num_experts=[4, 4])

    c = _altered_fixture(src, tmp_path / "vl", rows, drop=tuple(biases.values()))
    cfg = json.loads((c / "config.json").read_text())
    ernie(cfg)
    (c / "config.json").write_text(json.dumps(cfg))
    ckpt = mq.open(c)
    assert mq.plan(ckpt, "cuda").layer(1)["backend"] is not None
    cpu = mq.plan(ckpt, "cpu").layer(1)
    assert cpu["backend"] is None and "model_type: ERNIE-4.5-VL" in cpu["error"]
    # The same rows under another family are a bias of the wrong shape.
    cfg["model_type"] = "ernie4_5_moe"
    (c / "config.json").write_text(json.dumps(cfg))
    assert "has shape [2, 4]" in mq.plan(mq.open(c), "cuda").layer(1)["error"]


def test_a_layer_missing_the_bias_other_layers_store_is_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A MoE layer without the router score-correction bias that the checkpoint's other MoE
    layers store was routed without it, silently (vLLM refuses such a checkpoint: a weight it
    expects is never loaded). It is now refused, in the source and in its CPU repack, by the
    loader and the plans, naming the missing tensor; the other layer still loads, and so does
    a checkpoint in which no layer has a bias. Found by a fuzzing helper."""
    from moeq_rs.repack import repack_checkpoint

    src = fixture_path("deepseek_v3_w8a8_dynamic")
    bias = "model.layers.{}.mlp.gate.e_score_correction_bias"
    why = (
        "module 'model.layers.2.mlp': has no router score-correction bias "
        f"('{bias.format(2)}' is not in the checkpoint), where model.layers.1.mlp stores one "
        f"('{bias.format(1)}')"
    )
    repack_checkpoint(src, tmp_path / "cpu", target="cpu")
    for name, base in [("src", src), ("repacked", tmp_path / "cpu")]:
        c = _altered_fixture(base, tmp_path / name, {}, drop=(bias.format(2),))
        with pytest.raises(mq.CheckpointError, match=re.escape(why)):
            mq.MoELayer.from_checkpoint(c, 2)
        assert mq.MoELayer.from_checkpoint(c, 1).num_experts == 8
        # (The CUDA plan of the CPU layout refuses both layers for the layout first.)
        for platform in ("cpu", "cuda") if name == "src" else ("cpu",):
            plan = mq.plan(mq.open(c), platform)
            assert plan.layer(2)["backend"] is None and why in plan.layer(2)["error"]
            assert plan.layer(1)["backend"] is not None
    neither = _altered_fixture(src, tmp_path / "neither", {}, drop=(bias.format(1), bias.format(2)))
    assert mq.MoELayer.from_checkpoint(neither, 2).num_experts == 8


def test_api_arguments_of_the_wrong_type_are_named(tmp_path: Path) -> None:
    """A name that is not a str (or not UTF-8), a flag that is not a bool, a platform or target
    that is not a str: a MoeqError naming the argument, not PyO3's bare TypeError or a
    UnicodeEncodeError. Found by a review helper."""
    from moeq_rs.repack import repack_checkpoint

    ck = mq.open(write_checkpoint(tmp_path / "m"))
    module = f"{EXPERT0}"
    cases = [
        (lambda: ck.tensor(None), mq.LayoutError, "name: expected a str, got NoneType"),
        (lambda: ck.tensor("lm\udcffhead"), mq.LayoutError, "name: .* is not valid UTF-8"),
        (lambda: ck.tensor_info(1), mq.LayoutError, "name: expected a str, got int"),
        (lambda: ck.module(None), mq.LayoutError, "module: expected a str"),
        (lambda: ck.dequantize(b"x"), mq.LayoutError, "module: expected a str, got bytes"),
        (lambda: ck.dequantize(module, exact=1), mq.LayoutError, "exact: expected True or False"),
        (lambda: mq.plan(ck, platform=None), mq.ConfigError, "platform: expected a str"),
        (lambda: mq.plan(ck, backend=3), mq.ConfigError, "backend: expected a str, got int"),
        (lambda: repack_checkpoint(ck, tmp_path / "o", target=None), mq.LayoutError, "target:"),
        (lambda: repack_checkpoint(ck, tmp_path / "o", force="yes"), mq.LayoutError, "force:"),
        (lambda: repack_checkpoint(ck, tmp_path / "o", verify=1), mq.LayoutError, "verify:"),
        (lambda: mq.cuda.compile_kernels(90), mq.LayoutError, "arch: expected a str, got int"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert not (tmp_path / "o").exists()
    # numpy's bool is a bool.
    assert ck.dequantize(module, exact=np.bool_(True), framework="numpy").dtype == np.float32
