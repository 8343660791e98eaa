"""`moeq repack --target marlin`: the bytes against an independent numpy implementation of the
spec, bit-exact dequantisation (--verify), determinism, atomic output, and bad inputs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from marlin_ref import ct_moe_to_marlin

import moeq_rs as mq
from moeq_rs.repack import parse_size, repack_checkpoint
from synth import GROUP, quant_config, read_raw, write_checkpoint

WNA16 = [
    "qwen3_w4a16_g128_sym",
    "qwen3_w4a16_g128_asym",
    "qwen3_w8a16_g128",
    "qwen3_w8a16_channel",
    "qwen3_w4a16_actorder",
    "mixtral_w8a16_channel",
    "laguna_mixed_int4_int8",
    "qwen3_w4a16_sharded",
]


def raw(ckpt: mq.Checkpoint, name: str) -> np.ndarray:
    return np.asarray(ckpt.tensor(name))


def layer_experts(ckpt: mq.Checkpoint, prefix: str) -> list[int]:
    """The expert indices stored under ``prefix`` (``<layer>.experts``), from the tensor names."""
    pat = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    return sorted({int(m.group(1)) for n in ckpt.tensor_names() if (m := pat.match(n))})


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moeq_rs", *args], capture_output=True, text=True, check=False
    )


def digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


@pytest.mark.parametrize("name", WNA16)
def test_repack_matches_numpy_reference_and_verifies(
    fixture_path: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    src_dir = fixture_path(name)
    out = tmp_path / "marlin"
    r = cli("repack", str(src_dir), str(out), "--target", "marlin", "--verify")
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout and "repack [" in r.stderr
    src, dst = mq.open(src_dir), mq.open(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["moeq"]["layout"] == "marlin" and cfg["moeq"]["layout_version"] == 1
    assert dst.summary()["layout"] == "marlin"
    src_names = set(src.tensor_names())
    # The reference's scheme and sizes come from what compressed-tensors wrote (its schemes
    # file and the source tensors), not from the record the repack wrote.
    ct_schemes = json.loads((src_dir / "ref" / "schemes.json").read_text())
    for meta, layer in zip(cfg["moeq"]["layers"], src.moe_layers(), strict=True):
        p = meta["prefix"]
        assert p == f"{layer['prefix']}.experts"
        w1, w3, w2 = (
            ("w1", "w3", "w2")
            if name.startswith("mixtral")
            else ("gate_proj", "up_proj", "down_proj")
        )
        ct = ct_schemes[f"{p}.0.{w1}"]["weights"]
        bits, sym = ct["num_bits"], ct["symmetric"]
        group = ct["group_size"] if ct["strategy"] == "group" else -1
        # Group act-order is what stores a g_idx (and what the fixtures use).
        act_order = ct["actorder"] == "group"
        assert act_order == (f"{p}.0.{w1}.weight_g_idx" in src_names)
        inter, hidden = (int(v) for v in raw(src, f"{p}.0.{w1}.weight_shape"))
        want_meta = (bits, group, sym, act_order, hidden, inter, len(layer_experts(src, p)))
        got_meta = tuple(
            meta[k]
            for k in (
                "num_bits",
                "group_size",
                "symmetric",
                "act_order",
                "hidden_size",
                "intermediate_size",
                "num_experts",
            )
        )
        assert got_meta == want_meta, p
        experts = []
        for e in range(len(layer_experts(src, p))):
            x: dict[str, Any] = {}
            for role, proj in (("gate", w1), ("up", w3), ("down", w2)):
                m = f"{p}.{e}.{proj}"
                x[f"{role}_packed"] = raw(src, f"{m}.weight_packed")
                x[f"{role}_scale"] = raw(src, f"{m}.weight_scale")
                if not sym:
                    x[f"{role}_zp"] = raw(src, f"{m}.weight_zero_point")
                if act_order:
                    x[f"{role}_g_idx"] = raw(src, f"{m}.weight_g_idx")
            experts.append(x)
        ref = ct_moe_to_marlin(experts, hidden, inter, bits, group, sym, act_order)
        pairs = {
            "w13_weight_packed": "w13",
            "w2_weight_packed": "w2",
            "w13_weight_scale": "s13",
            "w2_weight_scale": "s2",
        }
        if not sym:
            pairs |= {"w13_weight_zero_point": "z13", "w2_weight_zero_point": "z2"}
        if act_order:
            pairs |= {
                "w13_weight_g_idx": "g13",
                "w2_weight_g_idx": "g2",
                "w13_g_idx_sort_indices": "p13",
                "w2_g_idx_sort_indices": "p2",
            }
        for tensor, key in pairs.items():
            got = raw(dst, f"{p}.{tensor}")
            want = ref[key]
            assert got.shape == want.shape, tensor
            assert got.tobytes() == want.astype(got.dtype).tobytes(), f"{p}.{tensor}"
        # No per-expert tensor of a converted layer survives; everything else is copied.
        assert not any(n.startswith(f"{p}.0.") for n in dst.tensor_names())
    for n in dst.tensor_names():
        if n in src_names:
            assert raw(dst, n).tobytes() == raw(src, n).tobytes(), n


def test_repack_is_deterministic(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    src = fixture_path("qwen3_w4a16_g128_asym")
    a, b = tmp_path / "a", tmp_path / "b"
    repack_checkpoint(src, a)
    repack_checkpoint(src, b, max_shard_size="600KB")
    c = tmp_path / "c"
    repack_checkpoint(src, c, max_shard_size="600KB")
    assert digest(b) == digest(c)
    assert len(list(b.glob("*.safetensors"))) > 1 and (b / "model.safetensors.index.json").exists()
    assert (a / "model.safetensors").exists()
    # Shard splits change the files, never the tensors.
    ta, tb = mq.open(a), mq.open(b)
    assert ta.tensor_names() == tb.tensor_names()
    for n in ta.tensor_names():
        assert raw(ta, n).tobytes() == raw(tb, n).tobytes()


def test_existing_output_is_refused_without_force(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"
    out.mkdir()
    r = cli("repack", str(src), str(out), "--target", "marlin")
    assert r.returncode == 1 and "already exists (pass --force" in r.stderr
    assert list(out.iterdir()) == []
    r = cli("repack", str(src), str(out), "--target", "marlin", "--force")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "temporary directories left behind"


def test_a_repack_elsewhere_to_the_same_out_dir_is_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Two `--force` repacks to one OUT_DIR both said they had written it, the later one having
    deleted the other's output; the second is refused now, before any work, and told which
    process holds `.<name>.moeq-lock` beside OUT_DIR (an flock, as another repack takes it)."""
    import fcntl

    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"
    lock = tmp_path / ".out.moeq-lock"
    with lock.open("w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        r = cli("repack", str(src), str(out), "--target", "cpu", "--force")
        assert r.returncode == 1
        assert (
            f"moeq: error: {out}: another repack (process 4242) is writing it; wait for that "
            "one to finish, or write elsewhere" in r.stderr
        ), r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [lock.name]
        assert lock.read_text() == "4242\n"
    # Released (as by a holder killed outright, which leaves the file): taken over, removed.
    r = cli("repack", str(src), str(out), "--target", "cpu", "--force")
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_lock_is_taken_before_out_dir_is_looked_at(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Whether OUT_DIR exists is decided under the lock: a repack that committed between an
    earlier look and the lock made this one do all its work before failing at its own commit
    ("appeared while the repack ran"). With the lock held elsewhere and OUT_DIR present, the
    refusal names the other repack, not the OUT_DIR it is about to replace."""
    import fcntl

    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"
    out.mkdir()
    lock = tmp_path / ".out.moeq-lock"
    with lock.open("w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        for force in ([], ["--force"]):
            r = cli("repack", str(src), str(out), "--target", "cpu", *force)
            assert r.returncode == 1
            assert "another repack (process 4242) is writing it" in r.stderr, r.stderr
            assert "already exists" not in r.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [lock.name, "out"]
        assert list(out.iterdir()) == []
    r = cli("repack", str(src), str(out), "--target", "cpu")
    assert r.returncode == 1
    assert f"moeq: error: {out}: already exists" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_lock_is_held_while_the_repack_writes(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    import fcntl

    out = tmp_path / "out"
    lock = tmp_path / ".out.moeq-lock"
    seen: list[str] = []

    def progress(stage: str, done: int, total: int, written: int, wtotal: int) -> None:
        if stage in seen:
            return
        seen.append(stage)
        with lock.open("r") as other:
            assert other.read() == f"{os.getpid()}\n"
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

    repack_checkpoint(fixture_path("qwen3_w4a16_g128_sym"), out, progress=progress)
    assert {"copy", "layers", "commit"} <= set(seen), seen
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_interrupted_write_leaves_nothing(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    src = fixture_path("qwen3_w4a16_g128_sym")
    out = tmp_path / "out"
    calls = []

    def progress(stage: str, done: int, total: int, written: int, wtotal: int) -> None:
        calls.append(stage)
        if stage == "layers":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repack_checkpoint(src, out, progress=progress)
    assert "layers" in calls
    assert list(tmp_path.iterdir()) == [], "nothing may be left beside or at OUT_DIR"


@pytest.mark.parametrize("target", ["marlin", "cpu"])
def test_progress_ends_at_its_totals(
    fixture_path: Callable[[str], Path], tmp_path: Path, target: str
) -> None:
    """The byte total counted the shards' headers, which `written` (tensor bytes) never does:
    the bar ended below 100%."""
    events: list[tuple[str, int, int, int, int]] = []

    def progress(*event: Any) -> None:
        events.append(event)

    out = tmp_path / "out"
    repack_checkpoint(fixture_path("qwen3_w4a16_g128_sym"), out, target=target, progress=progress)
    stage, done, total, written, wtotal = events[-1]
    assert (stage, done, written) == ("commit", total, wtotal)
    data = sum(
        t.nbytes for t in mq.open(out).views().values()
    )  # every tensor of the output, written once
    assert written == data
    assert all(e[3] <= e[4] for e in events)


@pytest.mark.parametrize("target", ["marlin", "cpu"])
def test_verify_reports_its_own_progress(
    fixture_path: Callable[[str], Path], tmp_path: Path, target: str
) -> None:
    """--verify (most of a verified repack's time) reported the final counts on every tick:
    the bar sat at 100% and a log got one identical line per tick. Its ticks now count the
    layers checked and their bytes, from the copies' bytes up to the total."""
    events: list[tuple[str, int, int, int, int]] = []

    def progress(*event: Any) -> None:
        events.append(event)

    out = tmp_path / "out"
    src = fixture_path("laguna_mixed_int4_int8")
    repack_checkpoint(src, out, target=target, verify=True, progress=progress)
    copied = max(e[3] for e in events if e[0] == "copy")
    ticks = [(e[1], e[3]) for e in events if e[0] == "verify"]
    total, wtotal = events[-1][2], events[-1][4]
    assert ticks[0][1] == copied < ticks[-1][1] == wtotal, ticks
    assert ticks == sorted(ticks) and ticks[-1][0] == total
    assert len({b for _, b in ticks}) == 1 + len(mq.open(out).moe_layers())
    # A log (stderr not a terminal) gets a line per tenth, not one per tick.
    r = cli("repack", str(src), str(tmp_path / "o2"), "--target", target, "--verify")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("repack [")]
    assert 0 < sum(" verify " in x for x in lines) <= 11 and len(lines) <= 22, r.stderr


@pytest.mark.parametrize("stage", ["verify", "commit"])
def test_an_interrupt_while_verifying_or_before_the_commit_leaves_nothing(
    fixture_path: Callable[[str], Path], tmp_path: Path, stage: str
) -> None:
    """--verify reported progress (and so checked for Ctrl-C) only once it was done, tens of
    seconds on a large checkpoint; it now does after each layer. The last check comes just
    before the rename that commits OUT_DIR."""
    src = fixture_path("qwen3_w4a16_g128_sym")
    out = tmp_path / "out"
    seen: list[str] = []

    def progress(at: str, done: int, total: int, written: int, wtotal: int) -> None:
        seen.append(at)
        if at == stage and (stage == "commit" or seen.count("verify") == 2):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repack_checkpoint(src, out, verify=True, progress=progress)
    assert seen.count("verify") == 2 if stage == "verify" else seen[-1] == "commit"
    assert list(tmp_path.iterdir()) == [], "nothing may be left beside or at OUT_DIR"


def test_interrupt_from_signal(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    # A real SIGINT mid-run: the progress callback sees it and the CLI exits 130, cleanly.
    # Python leaves SIGINT ignored when it starts with it ignored (a job started with `&`
    # without job control, nohup): the child installs the interactive handler itself.
    src = fixture_path("qwen3_w4a16_g128_sym")
    out = tmp_path / "out"
    code = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from moeq_rs import cli, repack\n"
        "orig = repack.repack_checkpoint\n"
        "def wrapped(*a, **k):\n"
        "    p = k['progress']\n"
        "    def prog(stage, *rest):\n"
        "        p(stage, *rest)\n"
        "        if stage == 'layers': os.kill(os.getpid(), signal.SIGINT)\n"
        "    k['progress'] = prog\n"
        "    return orig(*a, **k)\n"
        "repack.repack_checkpoint = wrapped\n"
        f"sys.exit(cli.main(['repack', {str(src)!r}, {str(out)!r}, '--target', 'marlin']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 130, r.stderr
    assert "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_read_only_output_location(fixture_path: Callable[[str], Path]) -> None:
    # /proc refuses new directories even to root.
    r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), "/proc/moeq-out", "--target", "marlin")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("moeq: error: /proc/") and "Traceback" not in r.stderr
    assert not os.path.exists("/proc/moeq-out")


def test_missing_parent_directory(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    r = cli(
        "repack",
        str(fixture_path("qwen3_w8a16_g128")),
        str(tmp_path / "a" / "b"),
        "--target",
        "marlin",
    )
    assert r.returncode == 1 and "parent directory" in r.stderr


@pytest.mark.parametrize(
    "name,error,match",
    [
        ("qwen3_w8a8_dynamic", "UnsupportedSchemeError", "weight-only pack-quantized"),
        ("qwen3_mixed_per_expert", "UnsupportedSchemeError", "per-expert mixed precision"),
        ("qwen3_unquantized", "UnsupportedSchemeError", "not quantized"),
    ],
)
def test_unsupported_schemes(
    fixture_path: Callable[[str], Path], tmp_path: Path, name: str, error: str, match: str
) -> None:
    with pytest.raises(getattr(mq, error), match=match):
        repack_checkpoint(fixture_path(name), tmp_path / "out")
    r = cli("repack", str(fixture_path(name)), str(tmp_path / "out"), "--target", "marlin")
    assert r.returncode == 1 and r.stderr.startswith("moeq: error:") and match in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_scales_in_another_dtype_than_the_layers_are_refused_for_marlin(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """One Marlin scale tensor holds a layer's scales in one dtype: an expert projection whose
    scales were stored as F32 (exact values) was copied as if its bits were BF16, zeros and
    garbage with no error unless --verify ran. Refused now, naming it; the CPU target, which
    keeps scales per projection, repacks it and verifies."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w4a16_g128_sym"), src)
    shard = src / "model.safetensors"
    tensors = load_file(str(shard))
    name = "model.layers.0.mlp.experts.2.down_proj"
    tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"].to(torch.float32)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    want = rf"{re.escape(name)}: weight_scale is F32 but expert 0 up_proj's is BF16"
    with pytest.raises(mq.LayoutError, match=want):
        repack_checkpoint(src, tmp_path / "out", target="marlin")
    with pytest.raises(mq.LayoutError, match=want):
        mq.open(src).marlin_layer(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    r = repack_checkpoint(src, tmp_path / "cpu", target="cpu", verify=True)
    assert r["verified_modules"] > 0


def test_shape_not_tileable(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", hidden=96)
    with pytest.raises(mq.LayoutError, match="size_n=96 is not a positive multiple of 64"):
        repack_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gate_and_up_g_idx_must_agree(tmp_path: Path) -> None:
    qc = quant_config()
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    # hidden 128 and intermediate 64 keep two groups of 32 along both K dimensions.
    src = write_checkpoint(tmp_path / "src", qc=qc, hidden=128, inter=64, g_idx="distinct")
    with pytest.raises(
        mq.LayoutError,
        match=r"experts\.0\.gate_proj\.weight_g_idx' and "
        r"'.*experts\.0\.up_proj\.weight_g_idx' differ",
    ):
        repack_checkpoint(src, tmp_path / "out")
    ok = write_checkpoint(tmp_path / "ok", qc=qc, hidden=128, inter=64, g_idx="shared")
    r = repack_checkpoint(ok, tmp_path / "out", verify=True)
    assert r["verified_modules"] == 6 and GROUP == 32


CPU_PREPACKED = {
    "qwen3_w8a8_dynamic": "int8_w8a8",
    "qwen3_w8a8_static": "int8_w8a8",
    "deepseek_v3_w8a8_dynamic": "int8_w8a8",
    "qwen3_w8a16_g128": "weight_only",
    "qwen3_w4a16_g128_asym": "weight_only",
    "qwen3_w4a16_actorder": "weight_only",
    "mixtral_w8a16_channel": "weight_only",
    "laguna_mixed_int4_int8": "weight_only",
    "qwen3_mixed_per_expert": None,  # copied unchanged
    "qwen3_unquantized": None,
}


@pytest.mark.parametrize("name", sorted(CPU_PREPACKED))
def test_cpu_layout_loads_and_runs_bit_identically(
    fixture_path: Callable[[str], Path], tmp_path: Path, name: str
) -> None:
    """--target cpu --verify writes the prepacked layout; a layer loaded from it gives exactly
    the outputs of the same layer loaded (and packed) from the source."""
    import torch

    src = fixture_path(name)
    out = tmp_path / "cpu"
    r = cli("repack", str(src), str(out), "--target", "cpu", "--verify")
    assert r.returncode == 0, r.stderr
    moeq = json.loads((out / "config.json").read_text())["moeq"]
    assert moeq["layout"] == "cpu" and moeq["layout_version"] == 1
    kinds = {entry["kind"] for entry in moeq["layers"]}
    want = CPU_PREPACKED[name]
    assert kinds == ({want} if want else set())
    layers = [entry["layer"] for entry in moeq["layers"]]
    if want:
        stacked = mq.open(out)
        p = moeq["layers"][0]["prefix"]
        assert stacked.tensor(f"{p}.w13_weight_packed").dtype == np.int8
        assert f"verified {2 * 3 * moeq['layers'][0]['num_experts']}" in r.stdout
    report = json.loads(cli("inspect", "--json", str(out)).stdout)
    by_layer = {entry["layer"]: entry for entry in report["moe_layers"]}
    for layer in layers:
        assert by_layer[layer]["layout"] == "cpu"
        assert by_layer[layer]["backend"] == "cpu_simd"
    g = torch.Generator().manual_seed(3)
    for layer in sorted(by_layer):
        a = mq.MoELayer.from_checkpoint(src, layer)
        b = mq.MoELayer.from_checkpoint(out, layer)
        for tokens in (1, 13):
            x = torch.randn(tokens, a.hidden_size, generator=g)
            logits = torch.randn(tokens, a.num_experts, generator=g)
            ya, yb = a(x, logits), b(x, logits)
            assert torch.equal(ya, yb) and ya.abs().max() > 0


def test_a_layout_is_refused_where_its_kernels_do_not_run(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A Marlin repack planned and loaded on the CPU, or a CPU repack planned for CUDA, would
    name a backend that cannot read the layer: the plan says why instead, and the CPU loader
    raises the same reason (it said "not an MoE layer (MoE layers: [])")."""
    src = fixture_path("laguna_mixed_int4_int8")
    cases = [("marlin", "cpu", "vLLM's Marlin layout"), ("cpu", "cuda", "the CPU layout")]
    for target, platform, stored in cases:
        out = tmp_path / target
        repack_checkpoint(src, out, target=target)
        doc = json.loads(cli("inspect", str(out), "--json", "--platform", platform).stdout)
        repacked = [x for x in doc["moe_layers"] if x.get("layout") == target]
        assert [x["layer"] for x in repacked] == [1, 2]
        other = "cpu" if target == "marlin" else "marlin"
        for x in repacked:
            assert x["backend"] is None
            assert x["error"].startswith(f"stored in {stored} (moeq repack --target {target})")
            assert x["error"].endswith(
                f"load the source checkpoint, or repack it with --target {other}"
            )
        # Where the layout's kernels run, it plans as before.
        home = "cuda" if target == "marlin" else "cpu"
        doc = json.loads(cli("inspect", str(out), "--json", "--platform", home).stdout)
        assert all(x["error"] is None for x in doc["moe_layers"])
    with pytest.raises(mq.UnsupportedSchemeError, match=r"layer 1: stored in vLLM's Marlin"):
        mq.MoELayer.from_checkpoint(tmp_path / "marlin", 1)
    with pytest.raises(mq.UnsupportedSchemeError, match=r"stored in the CPU layout"):
        mq.cuda.load_moe_layer(tmp_path / "cpu", 1)
    # W8A8 has no Marlin layout (it runs on CUDA from its source form): only the source is
    # offered.
    w8a8 = tmp_path / "w8a8"
    repack_checkpoint(fixture_path("qwen3_w8a8_dynamic"), w8a8, target="cpu")
    errors = [x["error"] for x in mq.plan(w8a8, "cuda").layers]
    assert errors and all(e.endswith("; load the source checkpoint") for e in errors), errors
    # A layer that is not a MoE layer names the repacked ones among the MoE layers.
    for target in ("marlin", "cpu"):
        with pytest.raises(mq.CheckpointError, match=r"\(MoE layers: \[1, 2\]\)"):
            mq.MoELayer.from_checkpoint(tmp_path / target, 0)


def test_cpu_layout_is_not_repacked_again(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "cpu"
    repack_checkpoint(fixture_path("qwen3_w8a8_static"), out, target="cpu")
    r = cli("repack", str(out), str(tmp_path / "again"), "--target", "cpu")
    assert r.returncode == 1 and "already a repacked checkpoint" in r.stderr
    assert not (tmp_path / "again").exists()


def test_damaged_cpu_layout_is_refused(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    """A recorded geometry that disagrees with the stored tensors is refused at open, naming
    the tensor; an unknown layout name is refused too."""
    out = tmp_path / "cpu"
    repack_checkpoint(fixture_path("qwen3_w4a16_actorder"), out, target="cpu")
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["moeq"]["layers"][0]["hidden_size"] += 8
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.MoeqError, match="w13_weight_packed"):
        mq.open(out)
    cfg["moeq"]["layers"][0]["hidden_size"] -= 8
    cfg["moeq"]["layout"] = "gpu-magic"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.UnsupportedSchemeError, match="gpu-magic"):
        mq.open(out)
    cfg["moeq"]["layout"] = "cpu"
    # A record naming another layer's tensors loaded them under its own index; a missing
    # list left the repacked tensors to no one ("no MoE layers").
    first, second = cfg["moeq"]["layers"][:2]
    first["prefix"], second["prefix"] = second["prefix"], first["prefix"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=r"moeq\.layers\[0\]\.prefix: .* is not a prefix"):
        mq.open(out)
    del cfg["moeq"]["layers"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=r"moeq\.layers: missing"):
        mq.open(out)


def _edited_cpu_output(src: Path, out: Path) -> tuple[Path, dict[str, Any]]:
    repack_checkpoint(src, out, target="cpu")
    return out / "config.json", json.loads((out / "config.json").read_text())


@pytest.mark.parametrize(
    ("fixture", "edits", "tensor"),
    [
        ("qwen3_w4a16_g128_asym", {("weights", "symmetric"): True}, "w13_weight_zero_point"),
        ("qwen3_w4a16_actorder", {("act_order",): False}, "w13_g_idx_sort_indices"),
        (
            "qwen3_w8a8_static",
            {
                ("static_act_scales",): False,
                ("activation", "dynamic"): True,
                ("activation", "strategy"): "token",
            },
            "w13_input_scale",
        ),
    ],
)
def test_a_cpu_layout_record_that_leaves_stored_tensors_out_is_refused(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    fixture: str,
    edits: dict[tuple[str, ...], object],
    tensor: str,
) -> None:
    """A record edited to say less than the tensors hold (symmetric over stored zero points,
    no act-order over stored sort indices, dynamic over stored input scales) loaded the layer
    as the record said, the tensors ignored: outputs off by 0.1-0.5. Refused, naming the
    tensor."""
    cfg_path, cfg = _edited_cpu_output(fixture_path(fixture), tmp_path / "cpu")
    for key, value in edits.items():
        entry = cfg["moeq"]["layers"][0]
        for k in key[:-1]:
            entry = entry[k]
        entry[key[-1]] = value
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.MoeqError, match=f"{tensor}.* has no place for it"):
        mq.MoELayer.from_checkpoint(tmp_path / "cpu", 0)


def test_a_cpu_layout_record_at_odds_with_itself_is_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A `kind` that the entry's activation contradicts (or no version writes), and a layer
    listed twice, were accepted."""
    cfg_path, cfg = _edited_cpu_output(fixture_path("qwen3_w8a16_g128"), tmp_path / "cpu")
    layers = cfg["moeq"]["layers"]
    for kind in ("banana", "int8_w8a8"):
        layers[0]["kind"] = kind
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(mq.ConfigError, match=rf"moeq\.layers\[0\]\.kind: .*{kind}"):
            mq.open(tmp_path / "cpu")
    layers[0]["kind"] = "weight_only"
    layers.append(dict(layers[0]))
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=r"layer 0 is listed twice"):
        mq.open(tmp_path / "cpu")
    # A Marlin record whose intermediate size passes its padding opened (the plan alone
    # reported it).
    out = tmp_path / "marlin"
    repack_checkpoint(fixture_path("qwen3_w4a16_g128_sym"), out, target="marlin")
    cfg = json.loads((out / "config.json").read_text())
    entry = cfg["moeq"]["layers"][0]
    entry["intermediate_size"] = entry["intermediate_size_padded"] + 1
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match="is above intermediate_size_padded"):
        mq.open(out)


@pytest.mark.parametrize(
    ("target", "fixture", "key", "edit", "match"),
    [
        # A W8A8 CPU layer recorded with float or 4-bit weights, or activations the kernels do
        # not quantise: `inspect` refused the layer while the loader, which reads the blocks
        # whatever the record says, built it.
        ("cpu", "qwen3_w8a8_dynamic", "weights", {"type": "float"}, "weights the CPU layout"),
        ("cpu", "qwen3_w8a8_dynamic", "weights", {"num_bits": 4}, "weights the CPU layout"),
        ("cpu", "qwen3_w4a16_g128_sym", "weights", {"strategy": "tensor", "group_size": None}, ""),
        ("cpu", "qwen3_w8a8_dynamic", "activation", {"num_bits": 4}, "activations the CPU"),
        ("cpu", "qwen3_w8a8_dynamic", "activation", {"type": "float"}, "activations the CPU"),
        (
            "cpu",
            "qwen3_w8a8_dynamic",
            "activation",
            {"strategy": "group", "group_size": 128},
            "dynamic per token or static per tensor",
        ),
        ("cpu", "qwen3_w8a8_dynamic", "activation", {"strategy": "tensor"}, "activations the"),
        # The Marlin record's weight args against its own checked geometry: the plan said
        # int8_w8a16 over 4-bit tensors.
        ("marlin", "qwen3_w4a16_g128_sym", "weights", {"num_bits": 8}, "num_bits 8 where the"),
        ("marlin", "qwen3_w4a16_g128_sym", "weights", {"group_size": 64}, "group_size 64 where"),
        ("marlin", "qwen3_w4a16_g128_sym", "weights", {"symmetric": False}, "symmetric false"),
        ("marlin", "qwen3_w4a16_g128_asym", "weights", {"type": "float"}, "type is not int"),
        ("marlin", "qwen3_w4a16_actorder", "weights", {"actorder": None}, "no group actorder"),
        ("marlin", "qwen3_w4a16_actorder", "weights", {"actorder": "weight"}, "no group act"),
    ],
)
def test_a_layout_record_whose_quant_args_are_not_its_tensors_is_refused(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    target: str,
    fixture: str,
    key: str,
    edit: dict[str, Any],
    match: str,
) -> None:
    """A repacked layer's recorded quantization args that no repack writes for its tensors
    opened, and the plan followed the record while the loader followed the tensors. Refused at
    open, naming the field. Found by a fuzzing helper (weights) and a review helper
    (activations)."""
    out = tmp_path / target
    repack_checkpoint(fixture_path(fixture), out, target=target)
    cfg = json.loads((out / "config.json").read_text())
    mq.open(out)  # as written, it opens
    cfg["moeq"]["layers"][0][key].update(edit)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=rf"moeq\.layers\[0\]\.{key}: .*{match}"):
        mq.open(out)


@pytest.mark.parametrize(
    ("fixture", "activation", "stated"),
    [
        ("qwen3_w8a8_static", {"dynamic": True, "strategy": "token"}, "true .*dynamic"),
        ("qwen3_w8a8_dynamic", {"dynamic": False, "strategy": "tensor"}, "false .*static"),
    ],
)
def test_a_cpu_layout_record_whose_static_flag_contradicts_its_activation_is_refused(
    fixture_path: Callable[[str], Path],
    tmp_path: Path,
    fixture: str,
    activation: dict[str, Any],
    stated: str,
) -> None:
    """`static_act_scales` said what the loader read (input scales or not) and `activation`
    what the plan said (static or dynamic); each could be edited alone."""
    cfg_path, cfg = _edited_cpu_output(fixture_path(fixture), tmp_path / "cpu")
    cfg["moeq"]["layers"][0]["activation"].update(activation)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match=rf"static_act_scales: {stated}"):
        mq.open(tmp_path / "cpu")


def test_damaged_values_in_a_cpu_layout_are_refused(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A 4-bit code or zero point outside -8..7, or act-order sort indices that repeat a
    column, built the layer and gave other outputs without an error; the source path refuses
    the like. Refused at load, naming the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    def damaged(fixture: str, tensor: str, edit: Callable[[torch.Tensor], None]) -> Path:
        out = tmp_path / f"{fixture}-{tensor}"
        repack_checkpoint(fixture_path(fixture), out, target="cpu")
        (shard,) = [p for p in out.glob("*.safetensors") if tensor in load_file(p)]
        tensors = load_file(shard)
        edit(tensors[tensor])
        save_file(tensors, shard, metadata={"format": "pt"})
        return out

    prefix = "model.layers.0.mlp.experts"
    cases = [
        ("qwen3_w4a16_g128_sym", "w13_weight_packed", 100, r"element 0 is 100; 4-bit"),
        ("qwen3_w4a16_g128_asym", "w2_weight_zero_point", -9, r"element 0 is -9; 4-bit"),
    ]
    for fixture, name, value, match in cases:

        def put(t: torch.Tensor, value: int = value) -> None:
            t.view(-1)[0] = value

        out = damaged(fixture, f"{prefix}.{name}", put)
        with pytest.raises(mq.CheckpointError, match=match):
            mq.MoELayer.from_checkpoint(out, 0)

    def repeat(t: torch.Tensor) -> None:
        t.view(-1)[1] = t.view(-1)[0]

    out = damaged("qwen3_w4a16_actorder", f"{prefix}.w2_g_idx_sort_indices", repeat)
    with pytest.raises(mq.LayoutError, match="repeats a column"):
        mq.MoELayer.from_checkpoint(out, 0)


def test_unknown_target(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(mq.MoeqError, match="target 'amx' is not available"):
        repack_checkpoint(fixture_path("qwen3_w8a16_g128"), tmp_path / "o", target="amx")


def test_bad_max_shard_size(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    r = cli(
        "repack",
        str(fixture_path("qwen3_w8a16_g128")),
        str(tmp_path / "o"),
        "--target",
        "marlin",
        "--max-shard-size",
        "lots",
    )
    assert r.returncode == 1 and "cannot read 'lots'" in r.stderr


def test_more_shards_than_the_process_may_hold_open(tmp_path: Path) -> None:
    """An output of more shards than the open-file limit (1,024 by default; a 700 GB model in
    500 MB shards has 1,400) is written: shards are not all held open at once."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    out = tmp_path / "o"
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", "examples/tiny-moe-int4-int8", str(out),
         "--target", "cpu", "--max-shard-size", "1KB", "--verify"],
        capture_output=True, text=True, preexec_fn=low_limit, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 48, len(shards)
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) > 48
    assert mq.open(out).summary()["layout"] == "cpu"


def test_a_failed_write_is_named_by_out_dir(tmp_path: Path) -> None:
    """A write that fails (here a file-size limit; a full disk alike) named the hidden staging
    directory, gone by the time the message is read; it names OUT_DIR and the file."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = tmp_path / "o"
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", "examples/tiny-moe-int4-int8", str(out),
         "--target", "cpu"],
        capture_output=True, text=True, preexec_fn=small_files, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert f"moeq: error: {out}: writing model.safetensors: File too large" in r.stderr, r.stderr
    assert "moeq-tmp" not in r.stderr and list(tmp_path.iterdir()) == []


def test_repacked_checkpoint_inspects(fixture_path: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "m"
    repack_checkpoint(fixture_path("laguna_mixed_int4_int8"), out)
    doc = json.loads(cli("inspect", str(out), "--json", "--platform", "cuda").stdout)
    assert doc["layout"] == "marlin"
    assert [
        (layer["layer"], layer["weight"]["num_bits"], layer["backend"])
        for layer in doc["moe_layers"]
    ] == [(1, 4, "cuda_marlin_wna16"), (2, 8, "cuda_marlin_wna16")]
    assert doc["routing"]["scoring_func"] == "sigmoid"
    # Opening validates the recorded layout against the stored shapes.
    cfg = json.loads((out / "config.json").read_text())
    cfg["moeq"]["layers"][0]["num_experts"] = 9
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mq.CheckpointError, match="recorded Marlin layout"):
        mq.open(out)
    cfg["moeq"]["layout_version"] = 2
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mq.ConfigError, match="layout_version 2"):
        mq.open(out)
    with pytest.raises(mq.CheckpointError, match="already a repacked checkpoint"):
        cfg["moeq"]["layout_version"] = 1
        cfg["moeq"]["layers"][0]["num_experts"] = 8
        (out / "config.json").write_text(json.dumps(cfg))
        repack_checkpoint(out, tmp_path / "again")

    # --compat vllm on a repacked checkpoint: the table failed with an internal KeyError and the
    # JSON lacked the "vllm" entries DESIGN.md promises on every layer.
    for target, path in (("marlin", out), ("cpu", tmp_path / "c")):
        if target == "cpu":
            repack_checkpoint(fixture_path("laguna_mixed_int4_int8"), path, target="cpu")
        r = cli("inspect", str(path), "--compat", "vllm")
        assert r.returncode == 0 and "vLLM loads compressed-tensors checkpoints" in r.stdout, r
        doc = json.loads(cli("inspect", str(path), "--json", "--compat", "vllm").stdout)
        for layer in doc["moe_layers"]:
            assert layer["vllm"]["method"] is None and layer["vllm"]["backend"] is None
            assert f"not the {target} layout" in layer["vllm"]["error"]


def test_force_never_deletes_the_source(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """--force replaced an OUT_DIR that was an ancestor of the source directory (deleting the
    source) or one of its shards (replaced by a directory). Only the source itself was refused."""
    import shutil

    src = tmp_path / "models" / "src"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    before = digest(src)
    for out in (tmp_path / "models", src / "model.safetensors", src):
        r = cli("repack", str(src), str(out), "--target", "cpu", "--force")
        assert r.returncode == 1 and r.stderr.startswith("moeq: error:"), r
        assert "source checkpoint" in r.stderr
        assert digest(src) == before
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["src"]


def test_a_refused_scheme_is_not_repacked_into_an_accepted_one(tmp_path: Path) -> None:
    """Weights marked dynamic are refused ("not a storage scheme"), but repack converted them,
    and the output planned and loaded as W4A16. Now --target marlin refuses the layer and
    --target cpu leaves it in its source form, which is still refused."""
    qc = quant_config()
    qc["config_groups"]["group_0"]["weights"]["dynamic"] = True
    src = tmp_path / "src"
    write_checkpoint(src, qc=qc, hidden=128, inter=128)
    r = cli("repack", str(src), str(tmp_path / "m"), "--target", "marlin")
    assert r.returncode == 1 and "dynamic weight quantization" in r.stderr
    assert not (tmp_path / "m").exists()
    repack_checkpoint(src, tmp_path / "c", target="cpu")
    layer = mq.plan(tmp_path / "c").layer(0)
    assert layer["method"] == "unsupported" and layer["backend"] is None
    with pytest.raises(mq.UnsupportedSchemeError, match="dynamic weight quantization"):
        mq.MoELayer.from_checkpoint(tmp_path / "c", 0)


@pytest.mark.parametrize("inter", [96, 160])
def test_intermediate_padding_matches_reference(tmp_path: Path, inter: int) -> None:
    # I = 96 or 160 with group 32: padded to a multiple of lcm(64, 32) = 64 without act-order.
    src_dir = write_checkpoint(tmp_path / "src", hidden=128, inter=inter)
    r = repack_checkpoint(src_dir, tmp_path / "out", verify=True)
    assert r["verified_modules"] == 6
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    meta = cfg["moeq"]["layers"][0]
    assert meta["intermediate_size_padded"] == (inter + 63) // 64 * 64
    src, dst = mq.open(src_dir), mq.open(tmp_path / "out")
    p = meta["prefix"]
    experts = []
    for e in range(meta["num_experts"]):
        experts.append(
            {
                f"{role}_{kind}": raw(src, f"{p}.{e}.{role}_proj.weight_{t}")
                for role in ("gate", "up", "down")
                for kind, t in (("packed", "packed"), ("scale", "scale"))
            }
        )
    ref = ct_moe_to_marlin(experts, 128, inter, 4, 32, True, False)
    for tensor, key in (
        ("w13_weight_packed", "w13"),
        ("w2_weight_packed", "w2"),
        ("w13_weight_scale", "s13"),
        ("w2_weight_scale", "s2"),
    ):
        got = raw(dst, f"{p}.{tensor}")
        assert got.tobytes() == ref[key].astype(got.dtype).tobytes(), tensor


@pytest.mark.parametrize("size", [0, -5, 2**70, None, True, "0", "-1", "nan", "inf", "1e30GB"])
def test_bad_max_shard_size_values(
    fixture_path: Callable[[str], Path], tmp_path: Path, size: object
) -> None:
    """Zero, negative, non-finite, bool and out-of-range sizes are LayoutErrors naming the
    argument (negative and huge ints were OverflowErrors, None an AttributeError), and nothing
    is written."""
    shown = re.escape(repr(size))
    small = size in ("0", "-1")  # read, but below one byte
    large = size in (2**70, "inf", "1e30GB")  # read, but beyond 2**64 - 1
    expect = (
        f"{shown} is less than one byte"
        if small
        else rf"{shown} is more than 2\*\*64 - 1 bytes"
        if large
        else f"cannot read {shown}"
    )
    with pytest.raises(mq.LayoutError, match=f"max shard size: {expect}"):
        repack_checkpoint(
            fixture_path("qwen3_w8a16_g128"), tmp_path / "o", target="cpu", max_shard_size=size
        )
    assert not (tmp_path / "o").exists()


def test_a_killed_repack_leaves_nothing_for_long(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A repack killed outright (SIGKILL) cannot remove its hidden temporary directory, and the
    next run (another pid) left it there for good. The next repack to that OUT_DIR removes what
    processes that no longer exist left and nobody has written for ten minutes; a live
    process's stay, and so does a recent one (the pid may be another host's)."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    dead = int(gone.stdout)
    stale = [tmp_path / f".out.moeq-tmp-{dead}", tmp_path / f".out.moeq-old-{dead}"]
    live = tmp_path / f".out.moeq-tmp-{os.getppid()}"
    recent = tmp_path / f".out.moeq-tmp-{dead + 1 if dead + 1 != os.getppid() else dead + 2}"
    hour_ago = time.time() - 3600
    for d in (*stale, live, recent):
        d.mkdir()
        f = d / "model-00001-of-00002.safetensors"
        f.write_bytes(b"x" * 1000)
        if d != recent:
            os.utime(f, (hour_ago, hour_ago))
            os.utime(d, (hour_ago, hour_ago))
    repack_checkpoint(fixture_path("qwen3_w8a16_g128"), tmp_path / "out", target="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name, recent.name])


def test_the_clean_up_of_abandoned_directories_never_removes_the_source(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A source checkpoint that carries the name of an abandoned temporary directory of its
    OUT_DIR (`.out.moeq-tmp-<pid of no process>`, untouched for an hour), itself or through a
    symlink, was removed by the clean-up at the start of the repack, which then failed on the
    missing source. It is read, and left as it was."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    dead = int(gone.stdout)
    hour_ago = time.time() - 3600
    for kind, through_link in [("tmp", False), ("old", True)]:
        work = tmp_path / f"{kind}-{through_link}"
        work.mkdir()
        real = work / f".out.moeq-{kind}-{dead}"
        shutil.copytree(fixture_path("qwen3_w8a16_g128"), real)
        for p in [*real.iterdir(), real]:
            os.utime(p, (hour_ago, hour_ago))
        before = digest(real)
        src = real
        if through_link:
            src = work / "src"
            src.symlink_to(real.name)
        r = cli("repack", str(src), str(work / "out"), "--target", "cpu")
        assert r.returncode == 0, r.stderr
        assert digest(real) == before
        mq.MoELayer.from_checkpoint(work / "out", 0)


def test_an_output_inside_the_source_is_replaced_with_force(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`moeq repack model model/cpu`, then again with --force: the output is not a file the
    repack reads, so it is replaced (the source's paths are its shards, index, config and
    copied side files, not every entry of its directory); the source is untouched."""
    src = tmp_path / "model"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    before = digest(src)
    out = src / "cpu"
    assert cli("repack", str(src), str(out), "--target", "cpu").returncode == 0
    r = cli("repack", str(src), str(out), "--target", "cpu", "--force")
    assert r.returncode == 0, r.stderr
    mq.MoELayer.from_checkpoint(out, 0)
    assert digest(src) == before


def test_force_never_deletes_a_file_a_source_side_file_links_to(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """--force checked that OUT_DIR held none of the source's shards or config, but not its
    side files: a `tokenizer.json` linking into the earlier output lost its target when that
    output was replaced. Refused now, the file kept."""
    old = tmp_path / "out"
    assert (
        cli("repack", str(fixture_path("qwen3_w8a16_g128")), str(old), "--target", "cpu").returncode
        == 0
    )
    (old / "tok_store.json").write_text('{"tok": 1}')
    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    (src / "tokenizer.json").symlink_to(old / "tok_store.json")
    r = cli("repack", str(src), str(old), "--target", "cpu", "--force")
    assert (
        r.returncode == 1 and "of the source checkpoint, which --force would delete" in r.stderr
    ), r
    assert json.loads((src / "tokenizer.json").read_text()) == {"tok": 1}


def test_force_replaces_only_an_empty_dir_or_an_earlier_repack(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """--force deleted whatever OUT_DIR named: a mistyped `moeq repack src models --force`
    deleted a directory of other checkpoints. It now replaces a symlink, an empty directory or
    an earlier repack output only."""
    src = fixture_path("qwen3_w8a16_g128")
    models = tmp_path / "models"
    (models / "other").mkdir(parents=True)
    (models / "other" / "weights.bin").write_bytes(b"precious")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("precious")
    for out in (models, a_file):
        r = cli("repack", str(src), str(out), "--target", "cpu", "--force")
        assert r.returncode == 1 and "so --force will not delete it" in r.stderr, r
    assert (models / "other" / "weights.bin").read_bytes() == b"precious"
    assert a_file.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes.txt"]
    # An earlier output is replaced (a different target, so its contents change), but not
    # one where someone has since kept other data (a repack writes files only).
    out = tmp_path / "out"
    assert cli("repack", str(src), str(out), "--target", "cpu").returncode == 0
    (out / "mydata").mkdir()
    (out / "mydata" / "notes.txt").write_text("precious")
    r = cli("repack", str(src), str(out), "--target", "marlin", "--force")
    assert r.returncode == 1 and "mydata, which is not a file a repack writes" in r.stderr, r
    assert (out / "mydata" / "notes.txt").read_text() == "precious"
    (out / "mydata" / "notes.txt").unlink()
    (out / "mydata").rmdir()
    r = cli("repack", str(src), str(out), "--target", "marlin", "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["moeq"]["layout"] == "marlin"


def test_out_dir_spellings_name_the_same_entry(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`out/.` renamed `.` at the commit (EBUSY, after all the work) or failed (ENOENT), and
    `link/` followed the symlink and then failed (ENOTDIR): the checks and the commit now work
    on the entry the path names, so a symlink is replaced as documented."""
    src = str(fixture_path("qwen3_w8a16_g128"))
    real, fresh, target, link = (tmp_path / n for n in ("real", "fresh", "target", "link"))
    assert cli("repack", src, str(real), "--target", "cpu").returncode == 0
    for argv in (
        [str(real) + "/.", "--force"],
        [str(fresh) + "/."],
        [str(tmp_path / "slash") + "/"],
    ):
        r = cli("repack", src, *argv[:1], "--target", "cpu", *argv[1:])
        assert r.returncode == 0, (argv, r.stderr)
    target.mkdir()
    link.symlink_to(target)
    r = cli("repack", src, str(link) + "/", "--target", "cpu", "--force")
    assert r.returncode == 0, r.stderr
    assert not link.is_symlink() and (link / "config.json").is_file()
    assert list(target.iterdir()) == []
    for d in ("real", "fresh", "slash", "link"):
        assert mq.open(tmp_path / d).summary()["layout"] == "cpu"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fresh", "link", "real", "slash", "target"
    ]  # fmt: skip


def test_an_output_that_appears_during_the_repack_is_not_replaced(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """OUT_DIR was checked at the start only: two repacks to one OUT_DIR without --force both
    succeeded, the second replacing the first's output."""
    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"

    def progress(stage: str, *_: int) -> None:
        if stage == "layers" and not out.exists():
            out.mkdir()
            (out / "theirs.txt").write_text("theirs")

    with pytest.raises(mq.CheckpointError, match="appeared while the repack ran"):
        repack_checkpoint(src, out, target="cpu", progress=progress)
    assert [p.name for p in out.iterdir()] == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "temporary files left"
    # Nor with --force, which was given for what OUT_DIR held at the start (nothing), even
    # when what appears is an earlier repack's output (which --force replaces).
    earlier = tmp_path / "earlier"
    repack_checkpoint(src, earlier, target="cpu")
    out = tmp_path / "forced"

    def progress_copy(stage: str, *_: int) -> None:
        if stage == "layers" and not out.exists():
            shutil.copytree(earlier, out)

    with pytest.raises(mq.CheckpointError, match="appeared while the repack ran; not replaced"):
        repack_checkpoint(src, out, target="marlin", force=True, progress=progress_copy)
    assert digest(out) == digest(earlier)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "forced", "out"]


def test_sigterm_during_repack_leaves_nothing(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """SIGTERM and SIGHUP (`timeout`, `docker stop`, a closed terminal) killed the CLI with
    the temporary directory of a half-written checkpoint left beside OUT_DIR. They now stop a
    repack as Ctrl-C does, and the exit status is 128 + the signal. A signal the process was
    started ignoring (`nohup` ignores SIGHUP) stays ignored: the repack runs to the end."""
    src = fixture_path("qwen3_w8a16_g128")
    for sig, start_as in [("SIGTERM", "SIG_DFL"), ("SIGHUP", "SIG_DFL"), ("SIGHUP", "SIG_IGN")]:
        out = tmp_path / f"{sig}-{start_as}" / "out"
        out.parent.mkdir()
        script = (
            "import os, signal, sys\n"
            # As the test runner may itself run under nohup (SIGHUP ignored, inherited).
            f"signal.signal(signal.{sig}, signal.{start_as})\n"
            "import moeq_rs.cli as cli\n"
            "call = cli._ProgressBar.__call__\n"
            "def progress(self, stage, *a):\n"
            f"    if stage == 'layers': os.kill(os.getpid(), signal.{sig})\n"
            "    return call(self, stage, *a)\n"
            "cli._ProgressBar.__call__ = progress\n"
            f"sys.exit(cli.main(['repack', {str(src)!r}, {str(out)!r}, '--target', 'cpu']))\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
        )
        if start_as == "SIG_IGN":
            assert r.returncode == 0 and (out / "config.json").exists(), r.stderr
            continue
        signum = {"SIGTERM": 15, "SIGHUP": 1}[sig]
        assert r.returncode == 128 + signum, (r.returncode, r.stderr)
        assert "interrupted; nothing was written" in r.stderr
        assert list(out.parent.iterdir()) == [], "partial output left"


@pytest.mark.parametrize(
    "raised,status", [("KeyboardInterrupt", 130), ("cli._Terminated(15)", 143)]
)
def test_an_interrupt_after_the_commit_says_the_output_is_complete(
    fixture_path: Callable[[str], Path], tmp_path: Path, raised: str, status: int
) -> None:
    """A Ctrl-C or SIGTERM that lands once OUT_DIR is committed (during the rename, the
    summary line, or the return) said "nothing was written" with the output in place."""
    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"
    script = (
        "import sys\n"
        "import moeq_rs.cli as cli, moeq_rs.repack as rp\n"
        "real = rp.repack_checkpoint\n"
        "def late(*args, **kwargs):\n"
        "    real(*args, **kwargs)\n"
        f"    raise {raised}\n"
        "rp.repack_checkpoint = late\n"
        f"sys.exit(cli.main(['repack', {str(src)!r}, {str(out)!r}, '--target', 'cpu']))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == status, r.stderr
    assert f"interrupted as the repack finished; {out} is written and complete" in r.stderr
    assert "nothing was written" not in r.stderr
    assert mq.open(out).summary()["layout"] == "cpu"


def test_an_interrupt_before_the_commit_says_nothing_was_written_whatever_appeared(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Ctrl-C before the commit, after another process made OUT_DIR: the output there is not
    ours (it said "written and complete", seeing only that OUT_DIR had changed)."""
    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "out"
    script = (
        "import os, sys\n"
        "import moeq_rs.cli as cli, moeq_rs.repack as rp\n"
        "real = rp.repack_checkpoint\n"
        "def racing(*args, progress=None, **kwargs):\n"
        "    def p(stage, *counts):\n"
        "        if stage == 'layers':\n"
        f"            os.mkdir({str(out)!r})\n"
        "            raise KeyboardInterrupt\n"
        "        progress(stage, *counts)\n"
        "    return real(*args, progress=p, **kwargs)\n"
        "rp.repack_checkpoint = racing\n"
        f"sys.exit(cli.main(['repack', {str(src)!r}, {str(out)!r}, '--target', 'cpu']))\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, r.stderr
    assert "interrupted; nothing was written" in r.stderr and "complete" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any(out.iterdir())


def test_a_summary_line_that_cannot_be_printed_says_the_output_is_complete(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """With stdout on a full disk the repack wrote OUT_DIR and then said only "No space left
    on device", as if it had failed."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full (Linux)")
    out = tmp_path / "out"
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, "-m", "moeq_rs", "repack", str(fixture_path("qwen3_w8a16_g128")),
             str(out), "--target", "cpu"],
            stdout=full, stderr=subprocess.PIPE, text=True, check=False,
        )  # fmt: skip
    assert r.returncode == 1
    assert f"{out} is written and complete, but its summary could not be printed" in r.stderr
    assert mq.open(out).summary()["layout"] == "cpu"


def test_force_refuses_a_mount_point_before_the_work(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """rename(2) cannot replace a mount point (an empty Docker volume, say): the whole repack
    ran, then failed with a bare EBUSY. Refused up front now, saying why."""
    mount = Path("/proc")
    if not (mount.is_dir() and os.stat(mount).st_dev != os.stat("/").st_dev):
        pytest.skip("needs /proc mounted (Linux)")
    r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), str(mount), "--target", "cpu",
            "--force")  # fmt: skip
    assert r.returncode == 1 and "is a mount point" in r.stderr, r
    assert "write to a new directory inside it" in r.stderr


def test_main_in_process_restores_the_signal_handlers(
    fixture_path: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`moeq_rs.cli.main` called in a process that goes on leaves its SIGTERM/SIGHUP handling
    as it was (its handlers turn the signals into an interrupt for the command only)."""
    import signal

    from moeq_rs.cli import main

    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)]
    assert main(["inspect", str(fixture_path("qwen3_w8a16_g128")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["moe_layers"]
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)] == before


def test_nothing_to_repack_is_an_error(tmp_path: Path) -> None:
    """A checkpoint without MoE layers was 'repacked' into a copy marked as repacked (which
    could then never be repacked); it is refused."""
    import torch
    from safetensors.torch import save_file

    src = tmp_path / "dense"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    save_file(
        {"model.layers.0.mlp.gate_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16)},
        str(src / "model.safetensors"),
    )
    for target in ("cpu", "marlin"):
        r = cli("repack", str(src), str(tmp_path / target), "--target", target)
        assert r.returncode == 1 and "no MoE layers: there is nothing to repack" in r.stderr, r
        assert not (tmp_path / target).exists()
    # A flag value out of range names the flag.
    r = cli("inspect", str(src), "--tp-size", "99999999999999999999999")
    assert r.returncode == 1 and "argument --tp-size: " in r.stderr and "too large" in r.stderr
    # (inspect printed "top-None" as its routing)
    r = cli("inspect", str(src))
    assert r.returncode == 0 and "routing:  - (no MoE layers)" in r.stdout, r


def test_paths_the_terminal_cannot_encode_are_escaped(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """With an ASCII stdout and a non-ASCII OUT_DIR, the repack wrote its output and then
    failed (exit 1, 'internal error: UnicodeEncodeError') printing the path."""
    src = fixture_path("qwen3_w8a16_g128")
    out = tmp_path / "\u00f6ut"
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", str(src), str(out), "--target", "cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
    )
    assert r.returncode == 0, r.stderr
    assert "\\xf6ut" in r.stdout and (out / "config.json").exists()


@pytest.mark.parametrize(
    ("name", "target", "suffix"),
    [
        ("qwen3_w4a16_g128_sym", "marlin", "w13_weight_packed"),
        ("qwen3_w4a16_actorder", "cpu", "w13_weight_packed"),
        ("qwen3_w8a8_dynamic", "cpu", "w13_weight_packed"),
        ("qwen3_w8a8_static", "cpu", "w13_input_scale"),
        ("qwen3_w8a8_static", "cpu", "w2_input_scale"),
    ],
)
def test_verify_catches_a_changed_byte(
    fixture_path: Callable[[str], Path], tmp_path: Path, name: str, target: str, suffix: str
) -> None:
    """--verify compares what was written with the source: one expert byte changed in the
    written shard (after the write, before the verify reads it) fails the repack, naming the
    module, and nothing is left at OUT_DIR. (Each verify path: Marlin, CPU weight-only, CPU
    W8A8, and W8A8's static activation scales, which verify once skipped.)"""
    src = fixture_path(name)
    out = tmp_path / "out"
    changed: list[str] = []

    def progress(stage: str, *_: int) -> None:
        if stage != "verify" or changed:
            return
        (tmp,) = tmp_path.glob(".out.moeq-tmp-*")
        for shard in sorted(tmp.glob("*.safetensors")):
            header, _ = read_raw(shard)
            tensor = next((t for t in header if t.endswith(f"experts.{suffix}")), None)
            if tensor is None:
                continue
            begin, end = header[tensor]["data_offsets"]
            base = 8 + struct.unpack("<Q", shard.read_bytes()[:8])[0]
            at = base + (begin + end) // 2
            with shard.open("r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                # The lowest bit: a 4-bit code stays in -8..7, which the load checks before
                # the verify could compare it.
                f.write(bytes([byte ^ 0x01]))
            changed.append(tensor)
            return

    with pytest.raises(mq.LayoutError, match="differs between the source and the"):
        repack_checkpoint(src, out, target=target, verify=True, progress=progress)
    assert changed, f"no stacked {suffix} tensor found to change"
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_side_files_are_copied_but_not_other_weight_formats(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A served model needs its tokenizer and generation config beside the weights; the
    source's weights in other formats are its unconverted weights, which a loader could pick
    up instead of the repacked shards, so they stay behind (as do subdirectories)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    side = {"tokenizer.json": "{}", "generation_config.json": '{"do_sample": false}'}
    other = ["pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.pth", "m.gguf"]
    for name, text in side.items():
        (src / name).write_text(text)
    for name in other:
        (src / name).write_bytes(b"weights")
    (src / "original").mkdir()
    (src / "original" / "params.json").write_text("{}")
    out = tmp_path / "out"
    assert cli("repack", str(src), str(out), "--target", "cpu").returncode == 0
    for name, text in side.items():
        assert (out / name).read_text() == text
    for name in [*other, "original"]:
        assert not (out / name).exists(), name


def test_side_files_keep_names_that_are_not_utf8(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Side files are copied under their exact (byte) names: names that are not UTF-8 used to
    be copied under their lossy form, so two of them and a real "tok\ufffd.json" became one
    file and two were lost, with exit 0. Found by a review helper."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    names = [os.fsencode(src / "tok") + b"\xff.json", os.fsencode(src / "tok") + b"\xfe.json"]
    names.append(os.fsencode(src / "tok\ufffd.json"))
    for i, name in enumerate(names):
        with open(name, "wb") as f:
            f.write(b"side %d" % i)
    out = tmp_path / "out"
    r = cli("repack", str(src), str(out), "--target", "cpu")
    assert r.returncode == 0, r.stderr
    for i, name in enumerate(names):
        copied = os.fsencode(out) + name[len(os.fsencode(src)) :]
        with open(copied, "rb") as f:
            assert f.read() == b"side %d" % i


def test_an_unwritable_parent_is_reported_as_out_dir(fixture_path: Callable[[str], Path]) -> None:
    """The error named the hidden temporary directory (`/x/.out.moeq-tmp-PID`), a path the user
    never typed. (/proc refuses new entries even to root, whom permissions would not stop.)"""
    r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), "/proc/moeq_out", "--target", "cpu")
    assert r.returncode == 1, r
    assert r.stderr.startswith("moeq: error: /proc/moeq_out: cannot write in /proc"), r.stderr
    assert "moeq-tmp" not in r.stderr


def _chattr(flag: str, *paths: Path) -> None:
    """`chattr` on ``paths``, or a skip where this file system or user cannot (the immutable
    flag stops even root, which is what these tests need)."""
    try:
        r = subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, check=False)
    except FileNotFoundError:
        pytest.skip("needs chattr (e2fsprogs)")
    if r.returncode != 0:
        pytest.skip(f"chattr {flag} refused here: {r.stderr.decode(errors='replace').strip()}")


@pytest.mark.parametrize("flag,where", [("+i", "."), ("+a", "."), ("+i", "config.json")])
def test_force_refuses_an_earlier_output_whose_files_cannot_be_removed(
    fixture_path: Callable[[str], Path], tmp_path: Path, flag: str, where: str
) -> None:
    """--force over an earlier output whose files this process may not remove (write-protected
    for a user; immutable or append-only, or holding an immutable file, even for root) used to
    finish, exit 0, and leave the earlier output moved aside as a hidden `.out.moeq-old-PID`
    (or fail at the commit, after all the work); it is refused before any work."""
    out = tmp_path / "out"
    repack_checkpoint(fixture_path("qwen3_w8a16_g128"), out, target="cpu")
    before = digest(out)
    pinned = out / where
    _chattr(flag, pinned)
    try:
        r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), str(out), "--target", "cpu",
                "--force")  # fmt: skip
    finally:
        _chattr(flag.replace("+", "-"), pinned)
    assert r.returncode == 1, r.stdout
    assert r.stderr.startswith(f"moeq: error: {out}: holds files this user may not remove")
    assert "repack [" not in r.stderr  # refused before any work
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _bind_file(source: Path, target: Path) -> None:
    """Bind-mounts file ``source`` over file ``target``, which unlink then refuses (EBUSY) even
    to root, where no flag or permission check sees it; or a skip where mounting is not
    allowed."""
    r = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {r.stderr.decode(errors='replace').strip()}")


def _unmount_under(path: Path) -> None:
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in points:
        if point.startswith(f"{path}/"):
            subprocess.run(["umount", point], check=False)


@contextlib.contextmanager
def _earlier_output_that_resists_removal(
    src: Path, tmp_path: Path
) -> Iterator[tuple[Path, Callable[[], None]]]:
    """An earlier CPU-layout output ``tmp_path/out`` of ``src``, and a function that makes it
    impossible to remove (a file in it becomes a mount point), for a hook to call once the
    commit's checks have passed. Unmounts, and removes what was moved aside, afterwards."""
    out = tmp_path / "out"
    repack_checkpoint(src, out, target="cpu")
    shutil.copy(out / "config.json", tmp_path / "other")  # the same record, on a mount
    try:
        yield out, lambda: _bind_file(tmp_path / "other", out / "config.json")
    finally:
        _unmount_under(tmp_path)
        for p in tmp_path.glob(".out.moeq-old-*"):
            shutil.rmtree(p)


def _moved_aside(tmp_path: Path) -> Path:
    """The one earlier output a repack to ``tmp_path/out`` moved aside and left."""
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.moeq-old-")]
    return moved


def _left_behind(moved: Path) -> str:
    return (
        f"the earlier output, moved aside to {moved}, could not be removed (Device or resource "
        "busy (os error 16)); remove it by hand"
    )


def test_an_earlier_output_that_cannot_be_removed_after_the_commit_is_reported(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """If the earlier output --force replaced cannot be removed once the new one is in place
    (here a file in it became a mount point during the run), the repack still succeeds, and
    says where the earlier output was left, rather than hiding it beside OUT_DIR."""
    src = fixture_path("qwen3_w8a16_g128")
    with _earlier_output_that_resists_removal(src, tmp_path) as (out, pin):

        def progress(stage: str, *_: int) -> None:
            if stage == "commit":
                pin()

        r = repack_checkpoint(src, out, target="marlin", force=True, progress=progress)
        assert r["leftover"] == _left_behind(_moved_aside(tmp_path))
        assert mq.open(out).summary()["layout"] == "marlin"


@contextlib.contextmanager
def _temporary_directory_pinned_while_writing(
    tmp_path: Path, then: Callable[[], None] = lambda: None
) -> Iterator[tuple[list[Path], Callable[..., None]]]:
    """A progress callback for a repack to ``tmp_path/out`` that makes its temporary directory
    immutable as the layers are written (so that removing it fails), then calls ``then``; and
    the directory it pinned. Unpins and removes it afterwards."""
    staged: list[Path] = []

    def progress(stage: str, *_: int) -> None:
        if stage == "layers" and not staged:
            staged.extend(tmp_path.glob(".out.moeq-tmp-*"))
            _chattr("+i", *staged)
            then()

    try:
        yield staged, progress
    finally:
        for p in staged:
            subprocess.run(["chattr", "-i", str(p)], check=False)
            shutil.rmtree(p, ignore_errors=True)


def test_a_failure_whose_temporary_directory_cannot_be_removed_says_so(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A repack that fails and then cannot remove its temporary directory (made immutable
    during the run) names it in the error: hundreds of MB left behind without a word before."""
    out = tmp_path / "out"
    with _temporary_directory_pinned_while_writing(tmp_path) as (staged, progress):
        with pytest.raises(mq.CheckpointError) as err:
            repack_checkpoint(
                fixture_path("qwen3_w8a16_g128"), out, target="cpu", progress=progress
            )
        assert len(staged) == 1
        assert f"the temporary directory {staged[0]} could not be removed" in str(err.value)
        assert "remove it by hand" in str(err.value)
        assert not out.exists()


def test_a_side_file_that_cannot_be_written_names_the_output(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A write error while copying a side file (here a file-size limit; a full disk alike)
    named the source file, sending the user to the wrong disk; it names what was being
    written, by OUT_DIR (the staging directory it is written in is hidden, and gone)."""
    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w4a16_sharded"), src)
    (src / "tokenizer.json").write_bytes(b"x" * (3 << 20))
    limit = 2 << 20

    def limited() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", str(src), str(tmp_path / "o"), "--target",
         "cpu", "--max-shard-size", "500KB"],
        capture_output=True, text=True, check=False, preexec_fn=limited,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout
    last = r.stderr.splitlines()[-1]
    assert last.startswith("moeq: error: ") and "tokenizer.json: File too large" in last, last
    assert str(src) not in last and "moeq-tmp" not in last
    assert f"{tmp_path / 'o'}: writing tokenizer.json: File too large" in last, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_out_dir_names_too_long_for_the_temporary_directory(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """A 245-byte OUT_DIR name is legal, but `.<name>.moeq-tmp-<pid>` beside it is not: the
    error said "cannot write in .: File name too long", blaming the parent directory."""
    name = "b" * 245
    r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), str(tmp_path / name), "--target",
            "cpu")  # fmt: skip
    assert r.returncode == 1
    assert "its name is 245 bytes, too long for the temporary directory" in r.stderr, r.stderr
    assert re.search(r"use a name of at most 2\d\d bytes", r.stderr), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_parent_that_is_a_file_is_called_one(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    (tmp_path / "afile").write_text("")
    r = cli("repack", str(fixture_path("qwen3_w8a16_g128")), str(tmp_path / "afile" / "out"),
            "--target", "cpu")  # fmt: skip
    assert r.returncode == 1
    assert f"the parent directory {tmp_path / 'afile'} is not a directory" in r.stderr, r.stderr


def test_a_closed_stderr_does_not_stop_the_repack(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """With stderr closed (`2>&-`) the progress bar failed on `None.isatty()` and the repack
    stopped with an internal error, printed on stdout."""
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "moeq_rs", "repack", str(fixture_path("qwen3_w8a16_g128")),
         str(out), "--target", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=False,
        preexec_fn=lambda: os.close(2),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith(f"wrote {out}: ")
    assert mq.open(out).summary()["layout"] == "cpu"


def test_max_shard_size_counts_are_read_exactly() -> None:
    """A byte count went through a float: 2**64 - 1 rounded up and was refused as out of
    range."""
    assert parse_size("18446744073709551615") == 2**64 - 1
    assert parse_size("1_000") == 1000 and parse_size("2KiB") == 2048
    # Too large is said as such (it said "cannot read").
    for huge in ("18446744073709551616", "99999999999999999999GB", "1e30", "1e400", 2**64):
        with pytest.raises(mq.LayoutError, match=r"is more than 2\*\*64 - 1 bytes"):
            parse_size(huge)  # type: ignore[arg-type]
    for unreadable in ("lots", "5XB", "nan", -5.5):
        with pytest.raises(mq.LayoutError, match="cannot read"):
            parse_size(unreadable)


def test_an_interrupt_whose_temporary_directory_cannot_be_removed_says_so(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """Ctrl-C (an exception from the progress callback) when the temporary directory then
    cannot be removed: the exception carries the note (PEP 678), and the CLI prints it after
    "nothing was written"; the note was dropped."""
    if sys.version_info < (3, 11):
        pytest.skip("exception notes need Python 3.11")

    def interrupt() -> None:
        raise KeyboardInterrupt

    pinned = _temporary_directory_pinned_while_writing(tmp_path, then=interrupt)
    with pinned as (staged, progress), pytest.raises(KeyboardInterrupt) as err:
        repack_checkpoint(
            fixture_path("qwen3_w8a16_g128"), tmp_path / "out", target="cpu", progress=progress
        )
    notes = getattr(err.value, "__notes__", [])
    assert len(staged) == 1 and len(notes) == 1, notes
    assert f"the temporary directory {staged[0]} could not be removed" in notes[0]


def test_the_cli_warns_of_an_earlier_output_left_behind(
    fixture_path: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The CLI's side of `leftover`: one `moeq: warning:` line naming where the earlier output
    was left, before the summary (which may fail to print), and exit status 0."""
    from moeq_rs import cli as moeq_cli

    src = fixture_path("qwen3_w8a16_g128")
    with _earlier_output_that_resists_removal(src, tmp_path) as (out, pin):
        bar = moeq_cli._ProgressBar.__call__

        def pinning_bar(self: Any, stage: str, *rest: int) -> None:
            if stage == "commit":
                pin()
            bar(self, stage, *rest)

        monkeypatch.setattr(moeq_cli._ProgressBar, "__call__", pinning_bar)
        status = moeq_cli.main(["repack", str(src), str(out), "--target", "marlin", "--force"])
        captured = capsys.readouterr()
        assert status == 0
        warning = [x for x in captured.err.splitlines() if x.startswith("moeq: warning:")]
        assert warning == [
            f"moeq: warning: {out} is written and complete, but "
            + _left_behind(_moved_aside(tmp_path))
        ], captured.err
        assert captured.out.startswith(f"wrote {out}: ")


def test_side_files_keep_their_permission_bits(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(fixture_path("qwen3_w8a16_g128"), src)
    (src / "private.json").write_text("{}")
    (src / "private.json").chmod(0o600)
    (src / "run.sh").write_text("#!/bin/sh\n")
    (src / "run.sh").chmod(0o755)
    repack_checkpoint(src, tmp_path / "o", target="cpu")
    assert (tmp_path / "o" / "private.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "o" / "run.sh").stat().st_mode & 0o777 == 0o755


def test_an_earlier_output_pinned_during_the_run_is_not_replaced(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """The commit looks at the earlier output again: a file in it made immutable while the
    repack ran is seen there, and the output is not replaced (nothing is moved aside)."""
    out = tmp_path / "out"
    repack_checkpoint(fixture_path("qwen3_w8a16_g128"), out, target="cpu")
    before = digest(out)
    pinned = out / "config.json"

    def progress(stage: str, *_: int) -> None:
        if stage == "commit":
            _chattr("+i", pinned)

    try:
        with pytest.raises(
            mq.CheckpointError, match="changed while the repack ran and holds files"
        ):
            repack_checkpoint(
                fixture_path("qwen3_w8a16_g128"), out, target="marlin", force=True,
                progress=progress,
            )  # fmt: skip
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], check=False)
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_int8_codes_stored_wider_are_read_by_value(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`int-quantized` weights stored as I16 or I32 (which opening accepts for 8-bit codes, as
    ``Checkpoint.dequantize`` reads them) run as their values on the CPU and repack with
    ``--verify``; their raw bytes used to be read as int8 (wrong output, exit 0). Values outside
    int8 (here from a U8 store) are refused naming the tensor and element. Found by a review
    helper."""
    import torch
    from safetensors.torch import load_file, save_file

    src = fixture_path("qwen3_w8a8_static")
    tensors = load_file(str(src / "model.safetensors"))
    x = torch.randn(4, 256)
    w, ids = torch.ones(4, 1), torch.tensor([[0], [1], [2], [3]])
    want = mq.MoELayer.from_checkpoint(src, 0).forward_topk(x, w, ids)
    source_cuda_layer = mq.cuda.load_moe_layer(src, 0, device="cpu")
    assert source_cuda_layer.w13.dtype == torch.int8

    def stored(dtype: torch.dtype, name: str) -> Path:
        dst = tmp_path / name
        dst.mkdir()
        (dst / "config.json").write_text((src / "config.json").read_text())
        out = {
            k: v.to(dtype) if ".experts." in k and k.endswith(".weight") else v
            for k, v in tensors.items()
        }
        save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst

    module = "model.layers.0.mlp.experts.0.gate_proj"
    for dtype in (torch.int16, torch.int32):
        dst = stored(dtype, str(dtype).removeprefix("torch."))
        assert mq.open(dst).tensor(f"{module}.weight").dtype == np.dtype(str(dtype)[6:])
        got = mq.MoELayer.from_checkpoint(dst, 0).forward_topk(x, w, ids)
        assert torch.equal(got, want), dtype
        out = tmp_path / f"{dst.name}.cpu"
        r = cli("repack", str(dst), str(out), "--target", "cpu", "--verify")
        assert r.returncode == 0, r.stderr
        assert torch.equal(mq.MoELayer.from_checkpoint(out, 0).forward_topk(x, w, ids), want)
        # The CUDA path's loader stacks the same int8 codes (it kept the stored dtype).
        cuda_layer = mq.cuda.load_moe_layer(dst, 0, device="cpu")
        assert torch.equal(cuda_layer.w13, source_cuda_layer.w13)
        assert torch.equal(cuda_layer.w2, source_cuda_layer.w2)
    # int8 codes wrapped into U8 (a negative code becomes 129..255).
    dst = stored(torch.uint8, "uint8")
    bad_code = r"experts\.\d+\.\w+_proj\.weight'.*element \d+ is"
    with pytest.raises(mq.CheckpointError, match=bad_code):
        mq.MoELayer.from_checkpoint(dst, 0)
    with pytest.raises(mq.CheckpointError, match=bad_code):
        mq.cuda.load_moe_layer(dst, 0, device="cpu")
    r = cli("repack", str(dst), str(tmp_path / "uint8.cpu"), "--target", "cpu")
    assert r.returncode == 1 and "-128..=127" in r.stderr and not (tmp_path / "uint8.cpu").exists()


def test_marlin_reads_a_missing_g_idx_as_in_order(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """An act-order layer with one projection stored without `weight_g_idx` (read as in order
    by `dequantize` and the CPU path): the Marlin target asked for the missing tensor, and
    without expert 0's up_proj g_idx it dropped act-order for the whole layer (caught only by
    --verify). It now converts the projection as in order, or, for a w13 pair, names the one
    that stores none. Found by a review helper."""
    from safetensors.torch import load_file, save_file

    src = fixture_path("qwen3_w4a16_actorder")
    tensors = load_file(str(src / "model.safetensors"))

    def without(module: str) -> Path:
        dst = tmp_path / module
        dst.mkdir()
        (dst / "config.json").write_text((src / "config.json").read_text())
        kept = {
            k: v for k, v in tensors.items() if k != f"model.layers.0.mlp.{module}.weight_g_idx"
        }
        assert len(kept) == len(tensors) - 1
        save_file(kept, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst

    dst = without("experts.3.down_proj")
    r = cli("repack", str(dst), str(tmp_path / "down.marlin"), "--target", "marlin", "--verify")
    assert r.returncode == 0, r.stderr
    # The CPU target likewise converts the layer (it was left in source form) and runs it as
    # the source does.
    import torch

    r = cli("repack", str(dst), str(tmp_path / "down.cpu"), "--target", "cpu", "--verify")
    assert r.returncode == 0, r.stderr
    layers = mq.open(tmp_path / "down.cpu").moe_layers()
    assert [(e["layer"], e.get("layout")) for e in layers] == [(0, "cpu"), (1, "cpu")]
    x, w = torch.randn(4, 256), torch.full((4, 2), 0.5)
    ids = torch.tensor([[3, 0], [3, 1], [2, 3], [3, 4]])
    want = mq.MoELayer.from_checkpoint(dst, 0).forward_topk(x, w, ids)
    got = mq.MoELayer.from_checkpoint(tmp_path / "down.cpu", 0).forward_topk(x, w, ids)
    assert torch.equal(got, want)
    dst = without("experts.0.up_proj")
    r = cli("repack", str(dst), str(tmp_path / "up.marlin"), "--target", "marlin")
    assert r.returncode == 1
    assert "expert 0:" in r.stderr and "up_proj stores none: read as in order" in r.stderr


def test_two_repacks_to_one_out_dir_in_one_process(tmp_path: Path) -> None:
    """Two threads repacking into one OUT_DIR: the staging directory is named by the pid, so
    they shared it, the second removing the first's files, and a mixed checkpoint (Marlin
    tensors with a CPU layout record) could be committed with no error. Now one repack claims
    it and the other is refused, naming OUT_DIR. (Whether the two overlap is up to the
    scheduler; the claim itself is unit-tested in the Rust core.) Found by a review helper."""
    import threading

    src = Path(__file__).resolve().parent.parent / "examples" / "tiny-moe-int4-int8"

    def run(target: str, out: Path, results: dict, start: threading.Barrier) -> None:
        start.wait()
        try:
            repack_checkpoint(src, out, target=target)
            results[target] = None
        except mq.MoeqError as err:
            results[target] = err

    for trial in range(3):
        out = tmp_path / f"out{trial}"
        results: dict[str, BaseException | None] = {}
        start = threading.Barrier(2)
        threads = [
            threading.Thread(target=run, args=(t, out, results, start)) for t in ("marlin", "cpu")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [t for t, e in results.items() if e is None]
        assert len(winners) == 1, results
        (loser,) = (e for e in results.values() if e is not None)
        # Refused while the other ran, or (if it had finished first) as an existing OUT_DIR.
        assert str(out) in str(loser), loser
        layout = mq.open(out).config["moeq"]["layout"]
        assert layout == winners[0]
        assert mq.open(out).moe_layers()


def test_marlin_layer_of_a_repacked_checkpoint(
    fixture_path: Callable[[str], Path], tmp_path: Path
) -> None:
    """`Checkpoint.marlin_layer` on a checkpoint repacked for Marlin returns its stored layer,
    equal to what the source gives (it said "this decoder layer has no MoE block", though the
    plan points the layer at the Marlin backend); on one repacked for the CPU it says where the
    layer is. Found by a review helper."""
    src = mq.open(fixture_path("qwen3_w4a16_g128_sym"))
    marlin, cpu = tmp_path / "marlin", tmp_path / "cpu"
    repack_checkpoint(src, marlin, target="marlin")
    repack_checkpoint(src, cpu, target="cpu")
    for layer in (0, 1):
        want_geometry, want = src.marlin_layer(layer, framework="numpy")
        geometry, got = mq.open(marlin).marlin_layer(layer, framework="numpy")
        assert geometry == want_geometry
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
        with pytest.raises(mq.LayoutError, match=f"layer {layer}: is stored in moeq's CPU layout"):
            mq.open(cpu).marlin_layer(layer)
