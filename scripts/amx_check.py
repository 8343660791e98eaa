"""AMX check of the CPU int8 MoE path, for a host whose CPU may have AMX-INT8 (Intel Sapphire
Rapids and later; the GPU host, say). Needs only moeq_rs, torch and numpy (no Rust toolchain):

    python scripts/amx_check.py      (scripts/gpu_check.sh runs it after the GPU checks)

Our AMX tiles are tested against an exact model of the instructions on every machine, and
self-tested against the scalar GEMM at first use; this runs them on real hardware. In fresh
processes (the kernel family is chosen once per process) it runs one W8A8 layer under
``MOEQ_CPU_ISA=scalar``, ``avx512_vnni`` and unset (AMX where usable), checks that all three
give the same bits (decode and prefill shapes), that the unset run reports ``amx_int8`` when the
CPU has it. Then, with VNNI and with AMX, on one thread per physical core (unless
``MOEQ_NUM_THREADS`` is set): the int8 instruction's peak (``mq.oracle.cpu_dot_peak``), the
streaming read rate, and a Qwen3-30B-A3B-shaped layer (H2048 I768 E128 k8) at T=1024 and 4096
and a cache-resident one, each with its median and best time, GMAC/s, share of the peak, the
time its weights take at the read rate, and how many GEMM calls ran on the AMX tiles. It first
prints the CPU model and topology. Exit status 0 when every check passes, the CPU has no AMX,
or the OS refuses tile state (then the VNNI fallback is checked and the AMX check is reported
skipped).
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


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0

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
    threads = mq.oracle.cpu_threads()
    torch.set_num_threads(threads)
    peak = mq.oracle.cpu_dot_peak("int8")
    times.append(f"peak {peak[0]} {peak[1]:.0f} GMAC/s" if peak else "peak: no probe")
    # Streaming read on the same threads: the floor for a call that reads every weight once.
    buf = torch.ones(2**28, dtype=torch.float32)
    bw = max(buf.numel() * 4 / _timed(buf.sum) for _ in range(5))
    del buf
    times.append(f"read {bw / 1e9:.1f} GB/s")

    def timed_layer(name, e, h, i, k, tokens, reps):
        layer = w8a8(e, h, i, k, 1e-3)
        weight_bytes = e * 3 * h * i
        for t in tokens:
            x = torch.randn(t, h, dtype=torch.bfloat16, generator=g)
            layer(x, torch.randn(t, e, generator=g))
            calls = mq._core.cpu_amx_calls()
            # Different routing each call, drawn before the timer.
            logits = [torch.randn(t, e, generator=g) for _ in range(reps)]
            took = sorted(_timed(lambda: layer(x, r)) for r in logits)
            med = took[len(took) // 2]
            macs = t * k * 3 * h * i
            line = (
                f"{name} T={t}: median {med * 1e3:.2f} ms, min {took[0] * 1e3:.2f} ms, "
                f"{macs / med / 1e9:.0f} GMAC/s"
            )
            if peak:
                line += f" ({100 * macs / med / 1e9 / peak[1]:.0f}% of peak)"
            line += (
                f", weights {weight_bytes / 1e6:.0f} MB take {weight_bytes / bw * 1e3:.2f} ms"
                f" at the read rate, amx calls {mq._core.cpu_amx_calls() - calls}"
            )
            times.append(line)

    # Qwen3-30B-A3B's shape: ~64 and ~256 rows per expert (weights read from DRAM each call);
    # then a layer whose weights stay in the last-level cache (four experts, every token to
    # one: ~256 rows each): the kernel's own rate with DRAM out of the way.
    timed_layer("qwen3", 128, 2048, 768, 8, (1024, 4096), 7)
    timed_layer("cache-resident", 4, 2048, 768, 1, (1024,), 15)
print(mq.oracle.cpu_kernel(), mq.oracle.cpu_threads(), " | ".join(times))
"""


def topology() -> tuple[str, int]:
    """The CPU model, sockets, physical cores, logical CPUs, NUMA nodes and kernel, in one
    line; and the physical core count (logical CPUs where sysfs does not say). Cores and
    CPUs are those this process may run on."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores: set[tuple[str, str]] = set()
    # Only the CPUs this process may run on (taskset, cgroups).
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        if allowed is not None and int(cpu.parent.name[3:]) not in allowed:
            continue
        try:
            cores.add(
                (
                    (cpu / "physical_package_id").read_text().strip(),
                    (cpu / "core_id").read_text().strip(),
                )
            )
        except OSError:
            pass
    logical = len(allowed) if allowed else (os.cpu_count() or 1)
    physical = len(cores) or logical
    sockets = len({s for s, _ in cores}) or 1
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    line = (
        f"{model}; {sockets} socket(s), {physical} physical cores, {logical} logical CPUs, "
        f"{nodes or '?'} NUMA node(s); Linux {os.uname().release}"
    )
    return line, physical


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
    machine, physical = topology()
    print("amx_check:", machine)
    print("amx_check: cpu features", features, "kernel", mq.oracle.cpu_kernel())
    # One thread per physical core: two hyperthreads share one core's tile unit.
    os.environ.setdefault("MOEQ_NUM_THREADS", str(physical))
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
            head, *parts = line.split(" | ")
            print(f"amx_check: MOEQ_CPU_ISA={isa}: {head}")
            for part in parts:
                print(f"amx_check:     {part}")
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
