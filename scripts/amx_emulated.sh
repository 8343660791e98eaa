#!/usr/bin/env bash
# Runs our AMX-INT8 tiles on an emulated Sapphire Rapids CPU, for machines without AMX:
#
#     make check-amx-emulated        (or scripts/amx_emulated.sh)
#
# It builds the Bochs 3.0 emulator from Debian's source with scripts/amx_emulated/*.patch (a
# signed-byte fix in its tdpbusd, and the XFD support Linux needs to enable AMX), boots
# Debian's bookworm-backports kernel on its `sapphire_rapids` CPU model with
# `examples/amx_probe` (built static) as /init, and reads the probe's report from the emulated
# serial port. The probe runs the int8 GEMM and a W8A8 MoE layer under every kernel family
# (scalar, AVX2, AVX-512 VNNI, AMX) in child processes, with two threads, and passes when all
# agree bit for bit and the AMX family was really chosen (the kernel granted tile state and our
# hardware self-test passed). Linux traps each thread's first tile instruction (#NM) and
# context-switches tile state, so that path runs too. Speed means nothing here: Bochs
# interprets every instruction.
#
# Needs: a Debian-like host with apt-get (for isolinux, genisoimage, cpio), curl, a C++
# compiler and make, and deb.debian.org (or DEBIAN_MIRROR). About 5 minutes on 2 cores, most of
# it the emulated boot and run; work files go to target/amx-emulated (AMX_EMU_DIR).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${AMX_EMU_DIR:-$ROOT/target/amx-emulated}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BOCHS_SRC=bochs_3.0+dfsg.orig.tar.xz
RUN_SECONDS=${AMX_EMU_SECONDS:-1500}

say() { printf 'amx_emulated: %s\n' "$*" >&2; }
mkdir -p "$WORK"
cd "$WORK"

# 1. The emulator.
BOCHS="$WORK/bochs-3.0/bochs"
if [ ! -x "$BOCHS" ]; then
    say "building Bochs 3.0 with AMX, AVX-512 and our patches"
    [ -f "$BOCHS_SRC" ] || curl -fsSL -o "$BOCHS_SRC.part" "$MIRROR/pool/main/b/bochs/$BOCHS_SRC"
    [ -f "$BOCHS_SRC" ] || mv "$BOCHS_SRC.part" "$BOCHS_SRC"
    rm -rf bochs-3.0
    tar xf "$BOCHS_SRC"
    (
        cd bochs-3.0
        patch -p1 -s < "$ROOT/scripts/amx_emulated/bochs-3.0-amx.patch"
        ./configure -q --enable-x86-64 --enable-cpu-level=6 --enable-avx --enable-evex \
            --enable-amx --enable-all-optimizations --with-nogui --disable-docbook \
            --enable-pci > configure.log
        make -s -j"$(nproc)" > make.log 2>&1 || { tail -20 make.log; exit 1; }
    )
fi

# 2. A kernel with AMX support that boots under Bochs (bookworm's 6.1 hangs in early boot
# there), and the tools to make a bootable CD image.
if [ ! -f vmlinuz ]; then
    say "fetching the newest bookworm-backports amd64 kernel"
    deb=$(curl -fsSL "$MIRROR/dists/bookworm-backports/main/binary-amd64/Packages.xz" | xz -d |
        grep -E '^Filename: pool/main/l/linux-signed-amd64/linux-image-6[^ ]*-amd64_[^ ]*\.deb$' |
        sort -V | tail -1 | cut -d' ' -f2)
    [ -n "$deb" ] || { say "no linux-image found in bookworm-backports"; exit 1; }
    curl -fsSL -o kernel.deb "$MIRROR/$deb"
    rm -rf kernel && dpkg-deb -x kernel.deb kernel
    cp kernel/boot/vmlinuz-* vmlinuz
    rm -rf kernel kernel.deb
fi
if [ ! -x tools/usr/bin/genisoimage ]; then
    say "fetching isolinux, genisoimage and cpio"
    rm -rf debs tools && mkdir -p debs tools
    (cd debs && apt-get download -q isolinux syslinux-common genisoimage cpio > /dev/null 2>&1) ||
        { say "apt-get download failed (needs a Debian-like host)"; exit 1; }
    for d in debs/*.deb; do dpkg-deb -x "$d" tools; done
fi

# 3. The probe, static, as /init of an initramfs (it mounts devtmpfs itself: no device nodes,
# no root needed).
say "building examples/amx_probe (static)"
(cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" cargo build -q --release --locked \
    -p moeq-core --example amx_probe --target x86_64-unknown-linux-gnu --target-dir "$WORK/cargo")
rm -rf initrd iso && mkdir -p initrd/dev iso/isolinux
cp "$WORK/cargo/x86_64-unknown-linux-gnu/release/examples/amx_probe" initrd/init
(cd initrd && find . | "$WORK/tools/bin/cpio" -o -H newc --quiet | gzip -1 > ../iso/initrd.img)
cp vmlinuz iso/vmlinuz
cp tools/usr/lib/ISOLINUX/isolinux.bin tools/usr/lib/syslinux/modules/bios/ldlinux.c32 iso/isolinux/
# no5lvl: Bochs's SMM return rejects 5-level paging; acpi=off: its ACPI enable hangs; the
# `MOEQ_NUM_THREADS=2` word reaches /init as an environment variable.
cat > iso/isolinux/isolinux.cfg <<'EOF'
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  APPEND initrd=/initrd.img console=ttyS0,115200 quiet rdinit=/init panic=0 nokaslr mitigations=off idle=poll no5lvl acpi=off ibt=off MOEQ_NUM_THREADS=2
EOF
tools/usr/bin/genisoimage -quiet -o amx.iso -b isolinux/isolinux.bin -c isolinux/boot.cat \
    -no-emul-boot -boot-load-size 4 -boot-info-table -R -J iso

# 4. Boot it and wait for the report.
cat > bochsrc <<EOF
megs: 512
cpu: model=sapphire_rapids, ips=200000000
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
rm -f serial.txt
say "booting the emulated Sapphire Rapids (a few minutes)"
"$BOCHS" -q -f bochsrc > bochs.out 2>&1 &
pid=$!
trap 'kill $pid 2> /dev/null || true' EXIT
for _ in $(seq "$RUN_SECONDS"); do
    grep -aq 'AMX PROBE:' serial.txt 2> /dev/null && break
    kill -0 $pid 2> /dev/null || break
    sleep 1
done
sleep 2
kill $pid 2> /dev/null || true
# The probe's lines (the kernel's start with a timestamp).
grep -av '^\[' serial.txt || true
if grep -aq 'AMX PROBE: PASS' serial.txt; then
    exit 0
fi
say "no PASS; the boot log is $WORK/serial.txt, Bochs's log $WORK/bochs.log"
exit 1
