"""What a user installs: the source distribution builds (it carries every file the Rust code
compiles in), and the package works without torch where the feature does not need it."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import torch

import moeq_rs as mq

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny-moe-int4-int8"


def test_sdist_carries_every_file_the_rust_code_compiles_in(tmp_path: Path) -> None:
    """The CUDA kernels are `include_str!`ed from the repository root's cuda/; the sdist left
    them out, so `pip install` from it failed to compile."""
    maturin = Path(sys.executable).parent / "maturin"
    r = subprocess.run(
        [str(maturin), "sdist", "-o", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (sdist,) = tmp_path.glob("moeq_rs-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    included = set()
    for src in (ROOT / "rust_core").rglob("*.rs"):
        if "fuzz" in src.relative_to(ROOT).parts or "target" in src.parts:
            continue
        for rel in re.findall(r'include_(?:str|bytes)!\("([^"]+)"\)', src.read_text()):
            included.add((src.parent / rel).resolve().relative_to(ROOT).as_posix())
    assert included, "no include_str! found: the scan is broken"
    assert {"cuda/common.cuh", "cuda/wna16_gemm.cu"} <= included
    missing = sorted(included - names)
    assert not missing, f"the sdist lacks {missing}"
    assert {"LICENSE", "Cargo.lock", "python/moeq_rs/py.typed", "python/moeq_rs/_core.pyi"} <= names


def test_without_torch(tmp_path: Path) -> None:
    """numpy is the one required dependency: opening, planning, numpy tensors, dequantizing
    and the CLI work without torch, and what needs torch says so (a MissingDependencyError,
    also an ImportError) instead of a bare ModuleNotFoundError from inside the package;
    `import *`, dir() and hasattr() no longer fail on the torch-only names."""
    module = "model.layers.1.mlp.experts.3.gate_proj"
    expect = mq.open(TINY).dequantize(module)
    assert expect.dtype == torch.bfloat16
    np.save(tmp_path / "expect.npy", expect.view(torch.int16).numpy().view(np.uint16))
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import numpy as np
        import moeq_rs as mq
        from moeq_rs import *  # noqa: F403
        from moeq_rs.cli import main

        assert "MoELayer" not in mq.__all__ and "MoELayer" not in dir(mq)
        assert not hasattr(mq, "no_such_name")
        for get in (lambda: mq.MoELayer, lambda: mq.fused_moe):
            try:
                get()
            except mq.MissingDependencyError as e:
                assert isinstance(e, ImportError) and "pip install 'moeq_rs[torch]'" in str(e)
                assert "moeq_rs.MoELayer" in str(e) or "moeq_rs.fused_moe" in str(e)
            else:
                raise AssertionError("no error without torch")
        ck = mq.open({str(TINY)!r})
        got = ck.dequantize({module!r}, framework="numpy")
        assert got.dtype == np.uint16, got.dtype
        assert np.array_equal(got, np.load({str(tmp_path / "expect.npy")!r}))
        exact = ck.dequantize({module!r}, exact=True, framework="np")
        assert exact.dtype == np.float32 and exact.shape == got.shape
        geometry, tensors = ck.marlin_layer(1, framework="numpy")
        assert geometry["bits"] == 4 and all(isinstance(t, np.ndarray) for t in tensors.values())
        needs_torch = [
            lambda: ck.dequantize({module!r}),
            lambda: ck.marlin_layer(1),
            lambda: ck.tensor(ck.tensor_names()[0], framework="torch"),
            lambda: mq.cuda.load_moe_layer({str(TINY)!r}, 1),
        ]
        for call in needs_torch:
            try:
                call()
            except mq.MissingDependencyError as e:
                assert "needs torch" in str(e), e
            else:
                raise AssertionError("no error without torch")
        assert main(["inspect", {str(TINY)!r}, "--json"]) == 0
        assert sys.modules["torch"] is None
        print("ok")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_numpy_dequantize_equals_torch() -> None:
    ck = mq.open(TINY)
    modules = ("model.layers.1.mlp.experts.0.up_proj", "model.layers.2.mlp.experts.5.down_proj")
    for module in modules:
        for exact in (False, True):
            t = ck.dequantize(module, exact=exact)
            a = ck.dequantize(module, exact=exact, framework="numpy")
            bits = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t
            assert np.array_equal(a, np.asarray(bits)), (module, exact)
    g_t, t_t = ck.marlin_layer(2)
    g_n, t_n = ck.marlin_layer(2, framework="numpy")
    assert g_t == g_n and t_t.keys() == t_n.keys()
    for k, v in t_t.items():
        raw = v.view(torch.int16).numpy().view(np.uint16) if v.dtype == torch.bfloat16 else v
        assert np.array_equal(t_n[k], np.asarray(raw)), k


def test_numpy_dequantize_of_unquantized_modules_in_every_stored_dtype(tmp_path: Path) -> None:
    """Unquantized modules come back as stored, so `framework="numpy"` must map every stored
    dtype as `tensor()` does (complex64 raised a TypeError)."""
    from safetensors.torch import save_file

    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 16}')
    save_file(
        {
            f"model.layers.{i}.mlp.up_proj.weight": torch.randn(8, 16).to(dt)
            for i, dt in enumerate(dtypes)
        },
        str(tmp_path / "model.safetensors"),
    )
    ck = mq.open(tmp_path)
    for i in range(len(dtypes)):
        module = f"model.layers.{i}.mlp.up_proj"
        got = ck.dequantize(module, framework="numpy")
        want = ck.tensor(f"{module}.weight")
        assert got.dtype == want.dtype and np.array_equal(got, want), module
