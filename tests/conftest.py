"""Shared pytest fixtures.

`fixtures_dir` runs `tests/fixtures/generate.py` (the real compressed-tensors writes
tiny MoE checkpoints) into `tests/fixtures/out` once per session; fixtures that are
already complete and up to date are not rebuilt. Override the location with
`MOEQ_FIXTURES_DIR`. See tests/fixtures/README.md for the list.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
GENERATOR = TESTS_DIR / "fixtures" / "generate.py"
DEFAULT_FIXTURES_OUT = TESTS_DIR / "fixtures" / "out"
GENERATOR_DEPS = ("torch", "transformers", "compressed_tensors", "safetensors")


def fixtures_out_dir() -> Path:
    return Path(os.environ.get("MOEQ_FIXTURES_DIR", DEFAULT_FIXTURES_OUT))


def fixture_checkpoint(fixtures_dir: Path, name: str) -> Path:
    """Path of one generated checkpoint directory; fails if it was not generated."""
    path = fixtures_dir / name
    if not (path / ".complete").is_file():
        known = sorted(p.name for p in fixtures_dir.iterdir() if (p / ".complete").is_file())
        raise LookupError(f"no generated fixture {name!r} in {fixtures_dir}; have {known}")
    return path


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """Directory holding one complete checkpoint directory per fixture name."""
    missing = [m for m in GENERATOR_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"fixture generator needs {', '.join(missing)} (pip install -e .[test])"
        if os.environ.get("CI"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    out = fixtures_out_dir()
    proc = subprocess.run(
        [sys.executable, str(GENERATOR), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"fixture generation failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}",
            pytrace=False,
        )
    return out


@pytest.fixture(scope="session")
def fixture_path(fixtures_dir: Path) -> Callable[[str], Path]:
    """`fixture_path("qwen3_w4a16_g128_sym")` -> that checkpoint's directory."""

    def get(name: str) -> Path:
        return fixture_checkpoint(fixtures_dir, name)

    return get


@pytest.fixture
def freezing_runs(tmp_path: Path) -> Callable[[str], None]:
    """Runs an inductor-freezing script as a layer's tests need it: in a fresh process with
    seeds 1 and 2, then in another sharing the same inductor cache with seed 2 alone; each run
    must print ``ok``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run(script: str) -> None:
        for seeds in (["1", "2"], ["2"]):
            r = subprocess.run(
                [sys.executable, "-c", script, *seeds],
                capture_output=True, text=True, env=env, timeout=600,
            )  # fmt: skip
            assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]

    return run
