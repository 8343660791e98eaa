//! Runs the int8 kernels under every kernel family the CPU offers and checks that they agree bit
//! for bit: `cargo run --release --example amx_probe` (exit status 0 when every check passes).
//! Made for CPUs (or emulators) with AMX-INT8, where it is the hardware check of our AMX tiles;
//! elsewhere it checks the families this CPU has.
//!
//! Each family runs in a child process of this binary (the family is chosen once per process,
//! capped by `MOEQ_CPU_ISA`): the int8 GEMM on shapes around the AMX tile, pass and padding
//! edges, and a W8A8 MoE layer. A child checks every GEMM accumulator against a direct sum
//! (`wrong=` counts the misses) and counts the GEMM calls that ran on the AMX tiles. The parent compares
//! the children's fingerprints with the scalar child's, and on a CPU with AMX requires that the
//! unset child chose `amx_int8` and ran AMX on every GEMM shape AMX takes. That child
//! also runs a stress: two threads repeating one GEMM, so a thread is likely preempted with
//! live tile state.
//!
//! `scripts/amx_emulated.sh` boots it as `/init` of a Linux kernel under the Bochs emulator's
//! Sapphire Rapids model; it prints `AMX PROBE: PASS` or `AMX PROBE: FAIL` at the end, and
//! then powers the machine off (or halts it) when it runs as process 1.
use std::process::Command;

use moeq_core::cpu::amx::{hardware_calls, KSTEP, MIN_ROWS};
use moeq_core::cpu::build::{from_raw, RawProj, RawScheme, RawWeights};
use moeq_core::cpu::kernels::{isa, isa_name};
use moeq_core::cpu::linear::Compute;
use moeq_core::cpu::packed::{PackedI8, BLOCK};

const CHILD: &str = "MOEQ_AMX_PROBE_CHILD";
/// Set for the child that runs the two-thread stress (the unset one): its value is the number
/// of GEMMs per thread.
const STRESS: &str = "MOEQ_AMX_PROBE_STRESS";
const STRESS_REPS: usize = 400;

/// FNV-1a over 32-bit words: a fingerprint that changes with any bit of any output.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn word(&mut self, w: u32) {
        for b in w.to_le_bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// A small deterministic generator (xorshift64*), so every child sees the same inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 56) as u8
    }
}

/// One GEMM problem: codes `q` `[n, k]`, packed, and activations `xu` `[m, k_pad]` (`x + 128`,
/// padding columns 128, i.e. x = 0).
struct Problem {
    m: usize,
    n: usize,
    k: usize,
    q: Vec<i8>,
    packed: PackedI8,
    xu: Vec<u8>,
}

type Lanes = (usize, usize, [i32; BLOCK]);

impl Problem {
    /// Random codes, or (`extreme`) activations of 255 against weights of -128 and 127, the
    /// largest products of each sign.
    fn new(m: usize, n: usize, k: usize, extreme: bool, rng: &mut Rng) -> Problem {
        let q: Vec<i8> = (0..n * k)
            .map(|i| match (extreme, i % 3) {
                (false, _) => rng.byte() as i8,
                (true, 0) => -128,
                (true, _) => 127,
            })
            .collect();
        let packed = PackedI8::pack(&q, n, k);
        let k_pad = packed.k_pad;
        let xu: Vec<u8> = (0..m * k_pad)
            .map(|i| match (i % k_pad >= k, extreme) {
                (true, _) => 128,
                (false, true) => 255,
                (false, false) => rng.byte(),
            })
            .collect();
        Problem {
            m,
            n,
            k,
            q,
            packed,
            xu,
        }
    }

    /// The kernel's (row, block, lanes), sorted: kernels hand them out in different orders.
    fn gemm(&self) -> Vec<Lanes> {
        let mut got = Vec::new();
        let blocks = self.packed.blocks();
        self.packed.gemm(&self.xu, self.m, 0, blocks, |r, b, acc| {
            got.push((r, b, *acc))
        });
        got.sort_by_key(|g| (g.0, g.1));
        got
    }

    /// What every kernel must give: `Σ (xu - 128) q` over the real inputs, zero past `n`.
    fn direct(&self) -> Vec<Lanes> {
        let k_pad = self.packed.k_pad;
        let mut all = Vec::new();
        for r in 0..self.m {
            for b in 0..self.packed.blocks() {
                let mut lanes = [0i32; BLOCK];
                for (l, v) in lanes.iter_mut().enumerate() {
                    let f = BLOCK * b + l;
                    if f < self.n {
                        *v = (0..self.k)
                            .map(|c| {
                                (i32::from(self.xu[r * k_pad + c]) - 128)
                                    * i32::from(self.q[f * self.k + c])
                            })
                            .sum();
                    }
                }
                all.push((r, b, lanes));
            }
        }
        all
    }

    /// Whether AMX takes this GEMM (the dispatch's rule): enough rows and whole 64-byte steps.
    fn amx_eligible(&self) -> bool {
        self.m >= MIN_ROWS && self.packed.k_pad.is_multiple_of(KSTEP)
    }
}

/// Prints one `gemm`/`moe` fingerprint line per case (compared across families), `amx` lines
/// (GEMM calls on the AMX tiles per case; differ by family) and, when asked, a `stress` line.
fn child() -> Result<(), String> {
    moeq_core::cpu::adopt_calling_thread();
    println!("family {}", isa_name(isa()));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Row counts around the 5-row threshold and the tile (16) and pass (32) edges; feature
    // counts leaving partial blocks and passes; reductions padded to whole quads (62, 126,
    // 190), whole (64, 128, ...), and ones AMX leaves to VNNI (k_pad not a multiple of 64).
    for &(m, n, k) in &[
        (5, 16, 64),
        (6, 20, 126),
        (16, 32, 62),
        (17, 48, 128),
        (31, 40, 200),
        (32, 64, 256),
        (33, 80, 190),
        (47, 96, 320),
        (70, 33, 132),
        (100, 128, 512),
    ] {
        for extreme in [false, true] {
            let p = Problem::new(m, n, k, extreme, &mut rng);
            let want = p.direct();
            // Twice: the second run reuses the thread's spare buffers.
            for run in 0..2 {
                let before = hardware_calls();
                let got = p.gemm();
                let calls = hardware_calls() - before;
                let wrong = if got.len() == want.len() {
                    got.iter()
                        .zip(&want)
                        .flat_map(|(g, w)| g.2.iter().zip(&w.2).filter(|(a, b)| a != b))
                        .count()
                } else {
                    usize::MAX
                };
                let case = format!("m={m} n={n} k={k} extreme={extreme} run={run}");
                println!(
                    "gemm {case} tiles={} wrong={wrong} fnv={:016x}",
                    got.len(),
                    digest(got.iter().copied())
                );
                println!("amx {case} eligible={} amx_calls={calls}", p.amx_eligible());
            }
        }
    }
    moe_layer(&mut rng)?;
    if let Some(reps) = std::env::var(STRESS).ok().and_then(|v| v.parse().ok()) {
        stress(reps);
    }
    Ok(())
}

/// A whole W8A8 dynamic layer: routing, grouping, both GEMMs, requantisation, combine.
fn moe_layer(rng: &mut Rng) -> Result<(), String> {
    let (e, hd, inter, top_k) = (8usize, 256usize, 128usize, 2usize);
    let w13: Vec<i8> = (0..e * 2 * inter * hd).map(|_| rng.byte() as i8).collect();
    let w2: Vec<i8> = (0..e * hd * inter).map(|_| rng.byte() as i8).collect();
    let s13: Vec<f32> = (0..e * 2 * inter)
        .map(|_| 1e-3 + f32::from(rng.byte()) * 1e-5)
        .collect();
    let s2: Vec<f32> = (0..e * hd)
        .map(|_| 1e-3 + f32::from(rng.byte()) * 1e-5)
        .collect();
    let proj = |weights, scales| RawProj {
        weights,
        scales,
        zero_points: None,
        act_scales: None,
    };
    let layer = from_raw(
        RawScheme::W8a8Dynamic,
        e,
        hd,
        inter,
        -1,
        proj(RawWeights::Int8(&w13), &s13),
        proj(RawWeights::Int8(&w2), &s2),
        top_k,
        true,
    )
    .map_err(|err| format!("layer: {err}"))?;
    for t in [1usize, 5, 37, 100] {
        let x: Vec<f32> = (0..t * hd)
            .map(|_| (f32::from(rng.byte()) - 127.5) / 31.0)
            .collect();
        let logits: Vec<f32> = (0..t * e).map(|_| f32::from(rng.byte()) / 40.0).collect();
        let before = hardware_calls();
        let y = layer
            .forward(&x, t, &logits, Compute::F32)
            .map_err(|err| format!("moe T={t}: {err}"))?;
        let calls = hardware_calls() - before;
        let mut h = Fnv::new();
        for v in &y {
            h.word(v.to_bits());
        }
        println!("moe w8a8 T={t} outputs={} fnv={:016x}", y.len(), h.0);
        println!("amx moe T={t} amx_calls={calls}");
    }
    // (The tile loop exists where AMX can: x86-64 Linux.)
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if isa().amx() {
        // The compute-peak probe's tile loop (`mq.oracle.cpu_dot_peak("int8")` on AMX): a few
        // rounds, enough to show its instructions run (its speed means nothing here).
        // SAFETY: `isa()` reports AMX only once `amx::usable()` granted and self-tested it.
        unsafe { moeq_core::cpu::amx::peak_loop(2) };
        println!("amx peak loop ran");
    }
    Ok(())
}

/// An order-independent digest of a GEMM's (row, block, lanes): the fingerprint the families
/// compare, and cheap enough that the stress spends most of its instructions inside AMX passes.
fn digest(lanes: impl IntoIterator<Item = Lanes>) -> u64 {
    lanes.into_iter().fold(0u64, |h, (r, b, acc)| {
        let v = acc.iter().fold(((r as u64) << 32) | b as u64, |v, &x| {
            v.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(u64::from(x as u32))
        });
        h.wrapping_add(v)
    })
}

/// Two threads each run the same GEMM `reps` times, comparing every result's digest with the
/// direct sums'. One long pass per GEMM (k = 16384: 256 steps), so a thread preempted by the
/// timer is most likely preempted inside a pass, with live tile state for the OS to save.
fn stress(reps: usize) {
    let p = Problem::new(32, 32, 16384, false, &mut Rng(7));
    let want = digest(p.direct());
    let blocks = p.packed.blocks();
    let once = || {
        let mut got = 0u64;
        p.packed.gemm(&p.xu, p.m, 0, blocks, |r, b, acc| {
            got = got.wrapping_add(digest([(r, b, *acc)]));
        });
        got
    };
    let before = hardware_calls();
    let bad: usize = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|_| s.spawn(|| (0..reps).filter(|_| once() != want).count()))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or(usize::MAX))
            .sum()
    });
    println!(
        "stress threads=2 reps={reps} mismatches={bad} amx_calls={}",
        hardware_calls() - before
    );
}

fn run(cap: Option<&str>) -> Option<String> {
    let me = std::env::args().next()?;
    let mut cmd = Command::new(me);
    cmd.env(CHILD, "1");
    match cap {
        Some(c) => cmd.env("MOEQ_CPU_ISA", c).env_remove(STRESS),
        None => cmd
            .env_remove("MOEQ_CPU_ISA")
            .env(STRESS, STRESS_REPS.to_string()),
    };
    let out = match cmd.output() {
        Ok(out) => out,
        Err(err) => {
            println!("cannot run (cap {cap:?}): {err}");
            return None;
        }
    };
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        print!("{}", String::from_utf8_lossy(&out.stdout));
        println!("child (cap {cap:?}) failed: {}", out.status);
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The lines every family must give alike.
fn compared(report: &str) -> Vec<&str> {
    report
        .lines()
        .filter(|l| l.starts_with("gemm ") || l.starts_with("moe "))
        .collect()
}

/// Whether a report has a GEMM whose accumulators missed the direct sums.
fn misses(report: &str) -> bool {
    report
        .lines()
        .any(|l| l.starts_with("gemm ") && !l.contains(" wrong=0 "))
}

/// For the AMX child: every AMX-eligible GEMM and the prefill layer calls ran on the tiles,
/// and the stress ran on AMX without a mismatch. The failures, one line each.
fn amx_gaps(report: &str) -> Vec<String> {
    let mut gaps = Vec::new();
    for l in report.lines().filter(|l| l.starts_with("amx ")) {
        let idle = l.ends_with(" amx_calls=0");
        let due = l.contains(" eligible=true ") || l.contains(" T=37 ") || l.contains(" T=100 ");
        if idle && due {
            gaps.push(format!("AMX did not run: {l}"));
        }
    }
    if report.contains("family amx_int8") && !report.lines().any(|l| l == "amx peak loop ran") {
        gaps.push("the peak probe's tile loop did not run".into());
    }
    match report.lines().find(|l| l.starts_with("stress ")) {
        Some(l) if l.contains(" mismatches=0 ") && !l.ends_with(" amx_calls=0") => {}
        Some(l) => gaps.push(format!("stress failed: {l}")),
        None => gaps.push("no stress line".into()),
    }
    gaps
}

fn main() {
    if std::env::var_os(CHILD).is_some() {
        if let Err(err) = child() {
            println!("error {err}");
            std::process::exit(2);
        }
        return;
    }
    if std::process::id() == 1 {
        console_as_init();
    }
    let ok = parent();
    println!("AMX PROBE: {}", if ok { "PASS" } else { "FAIL" });
    if std::process::id() == 1 {
        // As the emulator's init: power off rather than return (which would panic the kernel).
        // `tcdrain` first: a serial console still holding the report would lose it.
        // SAFETY: `tcdrain`, `sync` and `reboot` take no pointers; powering off is this
        // process's purpose.
        unsafe {
            libc::tcdrain(1);
            libc::sync();
            libc::reboot(libc::RB_POWER_OFF);
        }
    }
    std::process::exit(if ok { 0 } else { 1 });
}

fn parent() -> bool {
    let amx = cpu_has_amx();
    println!(
        "CPUID: AMX-TILE and AMX-INT8 {}",
        if amx { "present" } else { "absent" }
    );
    let Some(reference) = run(Some("scalar")) else {
        return false;
    };
    let mut ok = true;
    if misses(&reference) {
        println!("scalar: accumulators differ from the direct sums");
        ok = false;
    }
    let mut amx_ran = false;
    for cap in [
        Some("avx2"),
        Some("avx_vnni"),
        Some("avx512"),
        Some("avx512_vnni"),
        None,
    ] {
        let Some(out) = run(cap) else {
            ok = false;
            continue;
        };
        let family = out.lines().next().unwrap_or("family ?").to_string();
        if misses(&out) {
            println!("{family}: accumulators differ from the direct sums");
            ok = false;
        }
        let (theirs, ours) = (compared(&reference), compared(&out));
        let same = theirs == ours;
        println!(
            "{family} (cap {}): {}",
            cap.unwrap_or("none"),
            if same {
                "same bits as scalar"
            } else {
                "DIFFERS from scalar"
            }
        );
        if !same {
            ok = false;
            if theirs.len() != ours.len() {
                println!("  {} lines against scalar's {}", ours.len(), theirs.len());
            }
            for (a, b) in theirs.iter().zip(&ours).filter(|(a, b)| a != b) {
                println!("  scalar: {a}\n  {family}: {b}");
            }
        }
        if cap.is_none() {
            if let Some(l) = out.lines().find(|l| l.starts_with("stress ")) {
                println!("  {l}");
                ok &= l.contains(" mismatches=0 ");
            }
        }
        if cap.is_none() && family == "family amx_int8" {
            amx_ran = true;
            for gap in amx_gaps(&out) {
                println!("  {gap}");
                ok = false;
            }
        }
    }
    print!("{reference}");
    if amx && !amx_ran {
        println!("the CPU has AMX but the unset child did not choose amx_int8 (stderr says why)");
        ok = false;
    }
    ok
}

/// As process 1 of a bare initramfs: mount devtmpfs on `/dev` and make `/dev/console` our
/// standard streams (children need `/dev/null`; the archive then needs no device nodes, so it
/// is built without root).
fn console_as_init() {
    // SAFETY: the strings are NUL-terminated literals that outlive the calls; `open` returns a
    // descriptor or -1; `dup2` and `close` touch only descriptors this process owns.
    let mounted = unsafe {
        let mounted = libc::mount(
            c"devtmpfs".as_ptr(),
            c"/dev".as_ptr(),
            c"devtmpfs".as_ptr(),
            0,
            std::ptr::null(),
        ) == 0;
        let fd = libc::open(c"/dev/console".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        if fd >= 0 {
            for std_fd in 0..3 {
                libc::dup2(fd, std_fd);
            }
            if fd > 2 {
                libc::close(fd);
            }
        }
        mounted
    };
    if !mounted {
        eprintln!("amx_probe: could not mount devtmpfs on /dev (already mounted?)");
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // CPUID leaf 7 EDX: bit 24 AMX-TILE, bit 25 AMX-INT8 (leaf 7 exists where the max leaf >= 7).
    if __cpuid(0).eax < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_amx() -> bool {
    false
}
