#!/bin/bash
# The moeq-core unit tests on run.sh's emulated Tiger Lake (AVX-512F/BW/VL/VNNI/VBMI), so that
# the AVX-512 kernels' own tests run on a machine without AVX-512: ~5 minutes once the emulator
# is built. Builds it first (scripts/amx_emulated.sh, ~6 minutes, which also runs the AMX
# check) when it is missing.
# Usage: unit_tests.sh [FILTER] (as cargo test's: only the tests whose names contain it)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
EMU=${AMX_EMU_DIR:-$ROOT/target/amx-emulated}
# What run.sh needs from that build (its own list); any one missing means a partial build.
for f in "$EMU/bochs-3.0/bochs" "$EMU/vmlinuz" "$EMU/tools/usr/bin/genisoimage" \
  "$EMU/tools/usr/lib/ISOLINUX/isolinux.bin"; do
  if [ ! -e "$f" ]; then
    echo "[unit_tests.sh] no $f yet: building the emulator (scripts/amx_emulated.sh)" >&2
    "$ROOT/scripts/amx_emulated.sh"
    break
  fi
done
# The unit-test binary's path, as cargo reports it (its name carries a hash).
BIN=$(cd "$ROOT" && cargo test --release --locked -p moeq-core --lib --no-run \
  --message-format=json-render-diagnostics |
  python3 -c 'import json, sys
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable")
         and m["target"]["name"] == "moeq_core"]
print(paths[-1] if paths else "")')
[ -n "$BIN" ] || { echo "cargo reported no moeq-core unit-test binary" >&2; exit 2; }
# A copy: a cargo build during the run may replace the original.
mkdir -p "$EMU/avx512"
COPY=$EMU/avx512/moeq_core-unit-tests
cp "$BIN" "$COPY"
exec "$ROOT/scripts/avx512_emu/run.sh" "$COPY" --test-threads=1 "$@"
