"""The README's Python examples run as written, in order, from the repository root, and say
what their comments say."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_readme_python_blocks_run() -> None:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        os.chdir(cwd)
    # The values the comments announce.
    assert namespace["plan"].layer(2)["quant_config"]["kind"] == "int8_w8a16"
    cfg = namespace["cfg"]
    assert (cfg.use_int8_w8a8, cfg.per_act_token_quant) == (True, True)
    assert namespace["wna16_scale_kind"](8, 128) == "int8_static_group"
    assert tuple(namespace["w"].shape) == (128, 256)  # [out, in] of the tiny model's gate_proj
    y = namespace["y"]
    assert y.shape == (4, 256) and y.dtype == torch.float32 and torch.isfinite(y).all()
