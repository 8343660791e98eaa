#!/bin/bash
# Runs an x86-64 Linux binary (the crate's unit tests, say) inside Bochs emulating a Tiger Lake
# CPU (AVX-512F/BW/VL/VNNI/VBMI; no AMX, no AVX512-BF16), to test the AVX-512 kernels on a
# machine without AVX-512 (QEMU's TCG emulates none). It reuses what `make check-amx-emulated`
# builds and fetches into target/amx-emulated (the patched Bochs 3.0, the bookworm-backports
# kernel, isolinux, genisoimage and cpio): run that once first. See README.md here.
# Usage: run.sh BINARY [ARGS...]
# Env: BOCHS_TIMEOUT   wall-clock timeout in seconds (default 2400 = 40 min)
#      BOCHS_IPS       emulated instructions per guest-second (default 200000000)
#      BOCHS_MEGS      guest memory in MB (default 2048)
#      BOCHS_KEEP=1    keep the per-run work directory
#      BOCHS_STRIP=1   strip debug info from (a copy of) BINARY to shrink the initramfs
#      BOCHS_EXTRA     space-separated extra files copied into the guest's /work (the cwd)
#      BOCHS_KERNEL    vmlinuz to boot; BOCHS_KARGS extra kernel args; BOCHS_MODEL Bochs CPU model
#      BOCHS_QUIET=1   don't echo progress / kernel boot log
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
EMU=${AMX_EMU_DIR:-$ROOT/target/amx-emulated}
HERE=$EMU/avx512
KERNEL=${BOCHS_KERNEL:-$EMU/vmlinuz}
TIMEOUT=${BOCHS_TIMEOUT:-2400}
IPS=${BOCHS_IPS:-200000000}
MEGS=${BOCHS_MEGS:-2048}
KARGS=${BOCHS_KARGS:-}
MODEL=${BOCHS_MODEL:-tigerlake}
BOCHS=${BOCHS_BIN:-$EMU/bochs-3.0/bochs}
BIOSDIR=$EMU/bochs-3.0/bios
TOOLS=$EMU/tools
for f in "$BOCHS" "$KERNEL" "$TOOLS/usr/bin/genisoimage" "$TOOLS/usr/lib/ISOLINUX/isolinux.bin"; do
  [ -e "$f" ] || { echo "missing $f: run make check-amx-emulated first" >&2; exit 2; }
done
[ $# -ge 1 ] || { echo "usage: $0 BINARY [ARGS...]" >&2; exit 2; }
BIN=$(readlink -f "$1"); shift
[ -x "$BIN" ] || { echo "not executable: $BIN" >&2; exit 2; }
CPIO=$(find "$TOOLS" -name cpio -type f -perm -u+x | head -1)
[ -n "$CPIO" ] || { echo "no cpio under $TOOLS: run make check-amx-emulated first" >&2; exit 2; }
# A static busybox for the guest's /init, fetched once as the other tools were.
find_busybox() { find "$TOOLS" -name busybox -type f -perm -u+x | head -1; }
BUSYBOX=$(find_busybox)
if [ -z "$BUSYBOX" ]; then
  rm -rf "$EMU/debs-busybox" && mkdir -p "$EMU/debs-busybox"
  (cd "$EMU/debs-busybox" && apt-get download -q busybox-static > /dev/null 2>&1) &&
    dpkg-deb -x "$EMU"/debs-busybox/busybox-static_*.deb "$TOOLS" ||
    { echo "cannot fetch busybox-static (apt-get download, dpkg-deb -x)" >&2; exit 2; }
  BUSYBOX=$(find_busybox)
  [ -n "$BUSYBOX" ] || { echo "busybox-static holds no busybox binary" >&2; exit 2; }
fi
log() { [ "${BOCHS_QUIET:-0}" = 1 ] || echo "[run.sh $(date +%T)] $*" >&2; }

mkdir -p "$HERE/runs"
W=$(mktemp -d "$HERE/runs/run.XXXXXX")
killbochs() { local i; kill "$1" 2>/dev/null; for i in 1 2 3 4 5; do sleep 1; kill -0 "$1" 2>/dev/null || return 0; kill "$1" 2>/dev/null; done; kill -9 "$1" 2>/dev/null; }
cleanup() { [ -n "${BPID:-}" ] && killbochs "$BPID"; [ "${BOCHS_KEEP:-0}" = 1 ] || rm -rf "$W"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------- initramfs ----------
R=$W/root
mkdir -p "$R"/{bin,sbin,proc,sys,dev,tmp,work,etc,root}
cp "$BUSYBOX" "$R/bin/busybox" || exit 3
BNAME=$(basename "$BIN")
if [ "${BOCHS_STRIP:-0}" = 1 ]; then strip --strip-debug -o "$R/work/$BNAME" "$BIN"; else cp "$BIN" "$R/work/$BNAME"; fi || exit 3
# extra files (BOCHS_EXTRA="f1 f2 ...") go to /work next to BINARY
for f in ${BOCHS_EXTRA:-}; do cp "$f" "$R/work/"; done
# shared libraries (and the dynamic loader at its absolute path)
for f in "$BIN" ${BOCHS_EXTRA:-}; do ldd "$f" 2>/dev/null; done | while read -r a b c d; do
  for p in "$a" "$c"; do
    case "$p" in /*) [ -e "$p" ] && { mkdir -p "$R$(dirname "$p")"; cp -L "$p" "$R$p"; } ;; esac
  done
done
# quote args for sh
QARGS=""
for a in "$@"; do QARGS="$QARGS '$(printf %s "$a" | sed "s/'/'\\\\''/g")'"; done
cat > "$R/init" <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
/bin/busybox --install -s /sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
dmesg -n 1
export PATH=/bin:/sbin HOME=/root TMPDIR=/tmp
exec </dev/null >/dev/ttyS0 2>&1
echo "BOCHS-GUEST: uptime \$(cut -d' ' -f1 /proc/uptime)s; cpu: \$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "BOCHS-GUEST: avx512 flags in /proc/cpuinfo: \$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx512|amx' | tr '\n' ' ')"
echo "BOCHS-GUEST: MemTotal \$(grep MemTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2-)"
echo "BOCHS-BINARY-START"
cd /work
T0=\$(cut -d' ' -f1 /proc/uptime)
'/work/$BNAME'$QARGS
rc=\$?
T1=\$(cut -d' ' -f1 /proc/uptime)
echo "BOCHS-GUEST: binary ran from uptime \${T0}s to \${T1}s (guest clock)"
echo
echo "BOCHS-EXIT-STATUS=\$rc"
sync
sleep 2   # let the UART drain before the kernel prints "reboot: Power down"
poweroff -f
EOF
chmod +x "$R/init"
( cd "$R" && find . | "$CPIO" -o -H newc --quiet ) > "$W/initrd.cpio"   # uncompressed: no gunzip cost in the emulator

# ---------- ISO ----------
I=$W/iso
mkdir -p "$I/isolinux"
cp "$TOOLS/usr/lib/ISOLINUX/isolinux.bin" "$TOOLS/usr/lib/syslinux/modules/bios/ldlinux.c32" "$I/isolinux/"
cp "$KERNEL" "$I/vmlinuz"; mv "$W/initrd.cpio" "$I/initrd"
cat > "$I/isolinux/isolinux.cfg" <<EOF
SERIAL 0 115200
DEFAULT linux
PROMPT 0
TIMEOUT 0
LABEL linux
  KERNEL /vmlinuz
  INITRD /initrd
  APPEND $KARGS console=ttyS0,115200 earlyprintk=serial,ttyS0,115200 panic=-1 nokaslr mitigations=off tsc=reliable random.trust_cpu=on init=/init rdinit=/init
EOF
"$TOOLS/usr/bin/genisoimage" -quiet -o "$W/boot.iso" -b isolinux/isolinux.bin -c isolinux/boot.cat \
  -no-emul-boot -boot-load-size 4 -boot-info-table -R -J "$I" 2>"$W/iso.log" || { cat "$W/iso.log" >&2; exit 3; }
rm -rf "$I" "$R"

# ---------- Bochs ----------
cat > "$W/bochsrc" <<EOF
megs: $MEGS
romimage: file=$BIOSDIR/bios.bin-1.13.0
vgaromimage: file=$BIOSDIR/vgabios-cirrus.bin-1.13.0
cpu: model=$MODEL, count=1, ips=$IPS, reset_on_triple_fault=0, ignore_bad_msrs=1
clock: sync=none, time0=local
display_library: nogui
ata0-master: type=cdrom, path=$W/boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=$W/serial.log
mouse: enabled=0
pci: enabled=1, chipset=i440fx
log: $W/bochs.log
panic: action=fatal
error: action=report
info: action=report
debug: action=ignore
EOF
log "work dir $W; initramfs $(du -h "$W/boot.iso" | cut -f1) iso; starting bochs (timeout ${TIMEOUT}s)"
START=$(date +%s)
"$BOCHS" -q -f "$W/bochsrc" </dev/null >"$W/bochs.out" 2>&1 &
BPID=$!
BOOTED=""; DONE_AT=""; REASON=""
while kill -0 "$BPID" 2>/dev/null; do
  sleep 2
  NOW=$(date +%s)
  if [ -z "$BOOTED" ] && grep -q '^BOCHS-BINARY-START' "$W/serial.log" 2>/dev/null; then
    BOOTED=$((NOW-START)); log "guest booted, binary started after ${BOOTED}s"
  fi
  if [ -z "$DONE_AT" ] && grep -qa -E 'BOCHS-EXIT-STATUS=|Kernel panic' "$W/serial.log" 2>/dev/null; then DONE_AT=$NOW; fi
  # bochs should exit on ACPI power-off; if not, kill it shortly after the marker/panic
  if [ -n "$DONE_AT" ] && [ $((NOW-DONE_AT)) -ge 20 ]; then REASON="killed after marker/panic"; killbochs "$BPID"; break; fi
  if [ $((NOW-START)) -ge "$TIMEOUT" ]; then REASON="TIMEOUT after ${TIMEOUT}s"; killbochs "$BPID"; break; fi
done
wait "$BPID" 2>/dev/null; BPID=""
END=$(date +%s)
log "bochs finished after $((END-START))s ${REASON:+($REASON)}; boot ${BOOTED:-?}s, binary $([ -n "$BOOTED" ] && echo $((END-START-BOOTED)) || echo "?")s (wall, incl. power-off)"
grep -a -E 'ips =|IPS' "$W/bochs.log" 2>/dev/null | tail -1 | sed 's/^/[bochs] /' >&2

tr -d '\r' < "$W/serial.log" > "$W/serial.txt" 2>/dev/null
if grep -q '^BOCHS-BINARY-START' "$W/serial.txt"; then
  [ "${BOCHS_QUIET:-0}" = 1 ] || grep -a '^BOCHS-GUEST' "$W/serial.txt" | head -3 >&2
  sed -n '/^BOCHS-BINARY-START/,$p' "$W/serial.txt" | tail -n +2
else
  echo "---- binary never started; serial log tail: ----" >&2; tail -40 "$W/serial.txt" >&2
  echo "---- bochs.log tail: ----" >&2; tail -20 "$W/bochs.log" >&2; tail -5 "$W/bochs.out" >&2
fi
RC=$(grep -a -o 'BOCHS-EXIT-STATUS=[0-9]*' "$W/serial.txt" | tail -1 | cut -d= -f2)
if [ -z "$RC" ]; then echo "run.sh: no BOCHS-EXIT-STATUS marker (${REASON:-bochs exited}); log kept in $W" >&2; BOCHS_KEEP=1; exit 124; fi
exit "$RC"
