"""AMX check of the CPU int8 MoE path, for a host whose CPU may have AMX-INT8 (Intel Sapphire
Rapids and later; the GPU host, say). Needs only moeq_rs, torch and numpy (no Rust toolchain):

    python scripts/amx_check.py      (scripts/gpu_check.sh runs it first)

Our AMX tiles are tested against an exact model of the instructions on every machine, and
self-tested against the scalar GEMM at first use; this runs them on real hardware. In fresh
processes (the kernel family is chosen once per process) it runs one W8A8 layer under
``MOEQ_CPU_ISA=scalar``, ``avx512_vnni`` and unset (AMX where usable), checks that all three
give the same bits (decode and prefill shapes), that the unset run reports ``amx_int8`` when the
CPU has it, and times a Qwen3-30B-A3B-shaped layer (H2048 I768 E128 k8) at T=256 and T=1024
with VNNI and with AMX. Exit status 0 when every check passes, the CPU has no AMX, or the OS
refuses tile state (then the VNNI fallback is checked and the AMX check is reported skipped).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import moeq_rs as mq

_RUN = r"""
import sys, time, numpy as np, torch
import moeq_rs as mq
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
def w8a8(e, h, i, k, s):
    return mq.MoELayer.from_tensors(
        torch.randint(-127, 128, (e, 2 * i, h), dtype=torch.int8, generator=g),
        torch.randint(-127, 128, (e, h, i), dtype=torch.int8, generator=g),
        torch.rand(e, 2 * i, 1, generator=g) * s, torch.rand(e, h, 1, generator=g) * s,
        scheme="w8a8_dynamic", top_k=k)
e, h, i, k = 12, 320, 192, 4
layer = w8a8(e, h, i, k, 1e-2)
outs = []
for t in (1, 5, 37, 300):
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    outs.append(layer(x, logits).numpy().ravel())
np.save(sys.argv[1], np.concatenate(outs))
times = []
if len(sys.argv) > 2:
    e, h, i, k = 128, 2048, 768, 8
    big = w8a8(e, h, i, k, 1e-3)
    for t in (256, 1024):
        x = torch.randn(t, h, dtype=torch.bfloat16, generator=g)
        big(x, torch.randn(t, e, generator=g))
        best = float("inf")
        for _ in range(5):
            logits = torch.randn(t, e, generator=g)
            t0 = time.perf_counter()
            big(x, logits)
            best = min(best, time.perf_counter() - t0)
        times.append(f"T={t} {best * 1e3:.2f} ms")
print(mq.oracle.cpu_kernel(), mq.oracle.cpu_threads(), "; ".join(times))
"""


def run(out: Path, isa: str | None, timed: bool) -> tuple[np.ndarray, str, str]:
    env = dict(os.environ)
    env.pop("MOEQ_CPU_ISA", None)
    if isa is not None:
        env["MOEQ_CPU_ISA"] = isa
    args = [sys.executable, "-c", _RUN, str(out)] + (["timed"] if timed else [])
    ran = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    if ran.returncode != 0:
        print(ran.stdout, ran.stderr)
        raise SystemExit(f"amx_check: the run with MOEQ_CPU_ISA={isa} failed")
    if ran.stderr.strip():
        print(ran.stderr.strip())
    return np.load(out), ran.stdout.strip().splitlines()[-1], ran.stderr


def main() -> int:
    features = mq.oracle.cpu_features()
    print("amx_check: cpu features", features, "kernel", mq.oracle.cpu_kernel())
    if "amx_int8" not in features:
        print("amx_check: no AMX-INT8 on this CPU; nothing to check")
        return 0
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        stderr = ""
        for isa in ("scalar", "avx512_vnni", None):
            timed = isa != "scalar"
            got, line, err = run(Path(tmp) / f"{isa}.npy", isa, timed)
            print(f"amx_check: MOEQ_CPU_ISA={isa}: {line}")
            results[isa] = (got, line.split()[0])
            stderr += err
    ref = results["scalar"][0]
    for isa in ("avx512_vnni", None):
        same = np.array_equal(results[isa][0], ref)
        failed |= not same
        print(f"amx_check: {'PASS' if same else 'FAIL'} {isa} equals scalar bit for bit")
    used = results[None][1]
    if used != "amx_int8" and "refused tile state" in stderr:
        # The designed fallback (Linux older than 5.16, or tile state withheld): not a defect
        # of ours, but nothing of the AMX path ran.
        print("amx_check: SKIP the OS refused AMX tile state; the VNNI fallback ran (above)")
    else:
        ok = used == "amx_int8"
        failed |= not ok
        print(f"amx_check: {'PASS' if ok else 'FAIL'} default kernel is amx_int8 (got {used})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
