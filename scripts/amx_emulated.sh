#!/usr/bin/env bash
# Runs our AMX-INT8 tiles on an emulated Sapphire Rapids CPU, for machines without AMX:
#
#     make check-amx-emulated        (or scripts/amx_emulated.sh)
#
# It builds the Bochs 3.0 emulator from Debian's source with scripts/amx_emulated/*.patch
# (fixes to its tdpbusd and tile-state saving, and the XFD support Linux needs to enable AMX),
# boots Debian's bookworm-backports kernel on its `sapphire_rapids` CPU model with
# `examples/amx_probe` (built static) as /init, and reads the probe's report from the emulated
# serial port. The probe runs the int8 GEMM and a W8A8 MoE layer under every kernel family
# (scalar, AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI, AMX) in child processes and checks that they
# agree bit for bit, that AMX was chosen and really ran, and that two threads repeating an AMX
# GEMM always get the right sums. This script then also requires, from the emulator's log,
# that Linux trapped a first tile instruction (XFD #NM) and saved and restored live tile state
# (a thread preempted inside an AMX pass), and reports how often. Speed means nothing here:
# Bochs interprets every instruction.
#
# Needs: a Debian-like host with apt-get (for isolinux, genisoimage, cpio), curl, xz, a C++
# compiler, make, the Rust toolchain, and deb.debian.org (or DEBIAN_MIRROR). About 6 minutes
# on 2 cores from nothing; work files go to target/amx-emulated (AMX_EMU_DIR, no spaces).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${AMX_EMU_DIR:-$ROOT/target/amx-emulated}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PATCH="$ROOT/scripts/amx_emulated/bochs-3.0-amx.patch"
BOCHS_SRC=bochs_3.0+dfsg.orig.tar.xz
BOCHS_SHA256=78f6c73d4a6472d5130a87ab9dc306d02c7c71ed8e25b3a8ef642e2a7acd282b
BOCHS_FLAGS="--enable-x86-64 --enable-cpu-level=6 --enable-avx --enable-evex --enable-amx
    --enable-all-optimizations --with-nogui --disable-docbook --enable-pci"
RUN_SECONDS=${AMX_EMU_SECONDS:-1500}

say() { printf 'amx_emulated: %s\n' "$*" >&2; }
die() {
    say "$*"
    exit 1
}
case "$WORK" in *[[:space:]]*) die "the work directory must not contain spaces: $WORK" ;; esac
mkdir -p "$WORK"
cd "$WORK"

# Downloads `url` to `file` through a temporary name, checking its SHA256.
fetch() {
    local url=$1 file=$2 sha=$3
    curl -fsSL -o "$file.part" "$url" || die "cannot download $url"
    echo "$sha  $file.part" | sha256sum -c --quiet - || die "checksum mismatch for $url"
    mv "$file.part" "$file"
}

# 1. The emulator, rebuilt whenever the patch or the build flags change.
stamp=$(cat "$PATCH" <(echo "$BOCHS_FLAGS") | sha256sum | cut -d' ' -f1)
if [ "$(cat bochs.stamp 2> /dev/null)" != "$stamp" ] || [ ! -x bochs-3.0/bochs ]; then
    say "building Bochs 3.0 with AMX, AVX-512 and our patches"
    [ -f "$BOCHS_SRC" ] || fetch "$MIRROR/pool/main/b/bochs/$BOCHS_SRC" "$BOCHS_SRC" "$BOCHS_SHA256"
    rm -rf bochs-3.0 bochs.stamp
    tar xf "$BOCHS_SRC"
    (
        cd bochs-3.0
        patch -p1 -s < "$PATCH"
        # shellcheck disable=SC2086
        ./configure -q $BOCHS_FLAGS > configure.log
        make -s -j"$(nproc)" > make.log 2>&1 || {
            tail -20 make.log
            exit 1
        }
    )
    echo "$stamp" > bochs.stamp
fi

# 2. A kernel with AMX support that boots under Bochs (bookworm's 6.1 hangs in early boot
# there): the newest generic (not -rt, not -cloud) bookworm-backports image, checked against
# the archive's index.
if [ ! -f vmlinuz ]; then
    say "fetching the newest bookworm-backports amd64 kernel"
    index=$(curl -fsSL "$MIRROR/dists/bookworm-backports/main/binary-amd64/Packages.xz" | xz -d) ||
        die "cannot read the bookworm-backports index"
    pick=$(printf '%s\n' "$index" | awk '
        /^Filename: / { f = $2 }
        /^SHA256: / { s = $2 }
        /^$/ { if (f ~ /linux-signed-amd64\/linux-image-6[^\/]*\+deb12(\.[0-9]+)?-amd64_[^\/]*\.deb$/) print f, s; f = s = "" }
        ' | sort -V | tail -1) || true
    [ -n "$pick" ] || die "no generic linux-image found in bookworm-backports"
    fetch "$MIRROR/${pick% *}" kernel.deb "${pick#* }"
    rm -rf kernel && dpkg-deb -x kernel.deb kernel
    cp kernel/boot/vmlinuz-* vmlinuz.part && mv vmlinuz.part vmlinuz
    rm -rf kernel kernel.deb
fi
cpio_bin=$(find tools -name cpio -type f -perm -u+x 2> /dev/null | head -1) || true
if [ ! -x tools/usr/bin/genisoimage ] || [ ! -f tools/usr/lib/ISOLINUX/isolinux.bin ] ||
    [ ! -f tools/usr/lib/syslinux/modules/bios/ldlinux.c32 ] || [ -z "$cpio_bin" ]; then
    say "fetching isolinux, genisoimage and cpio"
    rm -rf debs tools && mkdir -p debs tools
    (cd debs && apt-get download -q isolinux syslinux-common genisoimage cpio > /dev/null 2>&1) ||
        die "apt-get download failed (needs a Debian-like host)"
    for d in debs/*.deb; do dpkg-deb -x "$d" tools; done
    cpio_bin=$(find tools -name cpio -type f -perm -u+x | head -1)
fi

# 3. The probe, static, as /init of an initramfs (it mounts devtmpfs itself: no device nodes,
# no root needed).
say "building examples/amx_probe (static)"
(cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" cargo build -q --release --locked \
    -p moeq-core --example amx_probe --target x86_64-unknown-linux-gnu --target-dir "$WORK/cargo")
rm -rf initrd iso && mkdir -p initrd/dev iso/isolinux
cp "$WORK/cargo/x86_64-unknown-linux-gnu/release/examples/amx_probe" initrd/init
(cd initrd && find . | "$WORK/$cpio_bin" -o -H newc --quiet | gzip -1 > ../iso/initrd.img)
cp vmlinuz iso/vmlinuz
cp tools/usr/lib/ISOLINUX/isolinux.bin tools/usr/lib/syslinux/modules/bios/ldlinux.c32 iso/isolinux/
# no5lvl: Bochs's return from SMM rejects 5-level paging; acpi=off: its ACPI enable hangs (so
# the probe's power-off halts instead, and we stop the emulator on its verdict);
# tsc_early_khz: see step 4. The `MOEQ_NUM_THREADS=2` word reaches /init as an environment
# variable.
cat > iso/isolinux/isolinux.cfg << 'EOF'
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  APPEND initrd=/initrd.img console=ttyS0,115200 quiet rdinit=/init panic=0 nokaslr mitigations=off idle=poll no5lvl acpi=off ibt=off lapic=notscdeadline tsc_early_khz=20000 MOEQ_NUM_THREADS=2
EOF
tools/usr/bin/genisoimage -quiet -o amx.iso -b isolinux/isolinux.bin -c isolinux/boot.cat \
    -no-emul-boot -boot-load-size 4 -boot-info-table -R -J iso

# 4. Boot it and wait for the verdict. Bochs's TSC counts instructions, so the kernel is told
# the TSC runs at the emulated instruction rate (`tsc_early_khz` = ips / 1000); otherwise it
# believes the model's 2.2 GHz, its scheduler sees almost no time pass, and the stress's
# threads are never switched inside a pass. At 5M instructions per second the emulated boot
# stalled; 20M works.
cat > bochsrc << EOF
megs: 512
cpu: model=sapphire_rapids, ips=20000000
romimage: file=$WORK/bochs-3.0/bios/bios.bin-1.13.0
vgaromimage: file=$WORK/bochs-3.0/bios/vgabios-cirrus.bin-1.13.0
ata0-master: type=cdrom, path=$WORK/amx.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$WORK/serial.txt
display_library: nogui
log: $WORK/bochs.log
panic: action=fatal
error: action=report
clock: sync=none
EOF
# Boots once; returns when the probe's verdict or a kernel panic is on the serial port, the
# emulator exits, or the serial log stops growing for STALL seconds (the emulated boot
# occasionally stalls: Bochs then sleeps with the guest waiting for a timer that never fires).
# A busy host slows Bochs enough for one probe family to print nothing for over 150 s (seen
# with tests running beside it): 300 s before an attempt counts as stalled.
STALL=${AMX_EMU_STALL_SECONDS:-300}
boot() {
    rm -f serial.txt bochs.log
    bochs-3.0/bochs -q -f bochsrc > bochs.out 2>&1 &
    pid=$!
    local size=0 quiet=0
    for _ in $(seq "$RUN_SECONDS"); do
        grep -aqE 'AMX PROBE:|Kernel panic' serial.txt 2> /dev/null && break
        kill -0 $pid 2> /dev/null || break
        now=$(stat -c %s serial.txt 2> /dev/null || echo 0)
        if [ "$now" = "$size" ]; then quiet=$((quiet + 1)); else size=$now quiet=0; fi
        [ "$quiet" -lt "$STALL" ] || break
        sleep 1
    done
    sleep 2
    kill $pid 2> /dev/null || true
    wait $pid 2> /dev/null || true
}
pid=
trap '[ -z "$pid" ] || kill $pid 2> /dev/null || true' EXIT
for attempt in 1 2 3; do
    say "booting the emulated Sapphire Rapids (a few minutes; attempt $attempt)"
    boot
    grep -aqE 'AMX PROBE:|Kernel panic' serial.txt 2> /dev/null && break
    say "the emulated boot stalled or ended without a verdict"
done
# The probe's lines (the kernel's start with a timestamp), without the per-case fingerprints.
grep -av '^\[' serial.txt | grep -avE '^(gemm|moe|amx) ' || true
traps=$(grep -ac 'moeq: XFD #NM' bochs.log || true)
saves=$(grep -ac 'moeq: XSAVE of live tile data' bochs.log || true)
restores=$(grep -ac 'moeq: XRSTOR of tile data' bochs.log || true)
say "emulator: $traps first-use traps (XFD #NM), $saves saves and $restores restores of live tile state"
grep -aq 'AMX PROBE: PASS' serial.txt || die "no PASS; boot log $WORK/serial.txt, Bochs log $WORK/bochs.log"
grep -aq 'family amx_int8 (cap none): same bits as scalar' serial.txt ||
    die "the probe passed without running amx_int8 (does the emulated CPU report AMX?)"
[ "$traps" -ge 1 ] || die "Linux never trapped a first tile instruction: XFD was not exercised"
[ "$saves" -ge 1 ] && [ "$restores" -ge 1 ] ||
    die "no thread was switched with live tile state: the stress did not exercise it"
say "PASS"
