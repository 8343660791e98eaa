#!/usr/bin/env bash
# GPU check of the CUDA path, for a machine with one NVIDIA GPU (driver, torch with CUDA and
# Python; no Rust toolchain, no network). Build the wheel on the development machine first:
#     rm -rf dist && .venv/bin/maturin build --release -m rust_core/python/Cargo.toml -o dist
# then, on the GPU machine, from the repository root:
#     bash scripts/gpu_check.sh
# (with the `run` tool: carry ["dist", "tests/fixtures/out/qwen3_w8a8_dynamic", ...]; the
# fixture directories listed in LAYER_FIXTURES of gpu_check.py enable the whole-layer checks).
# It installs dist/moeq_rs-*.whl into a temporary directory (no dependencies pulled) and runs
# scripts/gpu_check.py: kernel compilation for the device's arch, W8A8 MoE correctness against
# the CPU path, WNA16 (Marlin layout, mma.sync) correctness against an fp32 torch reference, a
# non-default stream, CUDA graph capture and replay, and benchmarks; then scripts/amx_check.py
# (the CPU int8 path's AMX tiles, when this host's CPU has them). Output
# also goes to $OUT/gpu_check.log when OUT is set. Exit status: 0 when every check passes.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv || true
wheel=$(ls dist/moeq_rs-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then
    echo "no wheel in dist/ (build it with maturin on the development machine)"
    exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$wheel" || exit 2
export PYTHONPATH="$WORK/site" MOEQ_CACHE_DIR="$WORK/kcache" PYTHONUNBUFFERED=1
# The GPU first (the machine's scarce time is its GPU's); then, since the GPU host's CPU may
# have AMX, the CPU int8 path's AMX tiles.
timeout 280 "$PY" scripts/gpu_check.py
rc=$?
timeout 150 "$PY" scripts/amx_check.py
amx_rc=$?
[ "$rc" -eq 0 ] && rc=$amx_rc
echo "gpu_check: ${SECONDS}s, exit $rc"
exit $rc
