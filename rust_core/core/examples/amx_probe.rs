//! Runs the int8 kernels under every kernel family the CPU offers and checks that they agree bit
//! for bit: `cargo run --release --example amx_probe`. Made for CPUs (or emulators) with
//! AMX-INT8, where it is the hardware check of our AMX tiles; elsewhere it checks the families
//! this CPU has. Each family runs in a child process of this binary (the family is chosen once
//! per process, capped by `MOEQ_CPU_ISA`); the parent compares fingerprints of the raw int32
//! GEMM accumulators (tail rows and blocks included) and of W8A8 MoE layer outputs, and each
//! child checks every accumulator against a direct sum (`wrong=` counts the misses).
//!
//! `scripts/amx_emulated.sh` boots it as `/init` of a Linux kernel under the Bochs emulator's
//! Sapphire Rapids model; it prints `AMX PROBE: PASS` or `AMX PROBE: FAIL` at the end, and
//! powers the machine off (or halts it) when it runs as process 1.
use std::process::Command;

use moeq_core::cpu::build::{from_raw, RawProj, RawScheme, RawWeights};
use moeq_core::cpu::kernels::{isa, isa_name};
use moeq_core::cpu::linear::Compute;
use moeq_core::cpu::packed::PackedI8;

const CHILD: &str = "MOEQ_AMX_PROBE_CHILD";

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

/// Prints one fingerprint line per case; the parent compares the lines across families.
fn child() {
    moeq_core::cpu::adopt_calling_thread();
    println!("family {}", isa_name(isa()));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Row counts around the AMX tile (16) and pass (32) edges and the 5-row threshold; feature
    // counts that leave partial blocks and passes; reductions with and without a tail quad.
    for &(m, n, k) in &[
        (5, 16, 64),
        (16, 32, 64),
        (17, 48, 128),
        (31, 40, 200),
        (32, 64, 256),
        (33, 80, 68),
        (47, 96, 320),
        (70, 33, 132),
        (100, 128, 512),
    ] {
        for extreme in [false, true] {
            // The extreme case: all activations 255 against weights of -128, the largest
            // products of each sign.
            let q: Vec<i8> = (0..n * k)
                .map(|i| {
                    if extreme {
                        if i % 3 == 0 {
                            -128
                        } else {
                            127
                        }
                    } else {
                        rng.byte() as i8
                    }
                })
                .collect();
            let packed = PackedI8::pack(&q, n, k);
            let xu: Vec<u8> = (0..m * packed.k_pad)
                .map(|i| {
                    if extreme || i % packed.k_pad >= k {
                        if i % packed.k_pad >= k {
                            128 // the padding of x + 128 for x = 0
                        } else {
                            255
                        }
                    } else {
                        rng.byte()
                    }
                })
                .collect();
            // Twice: a difference between the two runs would point at lost tile state.
            for run in 0..2 {
                let mut got = Vec::new();
                let mut wrong = Vec::new();
                packed.gemm(&xu, m, 0, packed.blocks(), |r, b, acc| {
                    got.push((r, b, *acc));
                    for (l, &v) in acc.iter().enumerate() {
                        let f = 16 * b + l;
                        // Σ (xu - 128) q over the real inputs: what every kernel must give.
                        let want: i32 = if f < n {
                            (0..k)
                                .map(|c| {
                                    (i32::from(xu[r * packed.k_pad + c]) - 128)
                                        * i32::from(q[f * k + c])
                                })
                                .sum()
                        } else {
                            0
                        };
                        if v != want {
                            wrong.push((r, f, v, want));
                        }
                    }
                });
                // Kernels hand (row, block) pairs out in different orders; the fingerprint is
                // of the sorted list.
                got.sort_by_key(|g| (g.0, g.1));
                let mut h = Fnv::new();
                for (r, b, acc) in &got {
                    h.word(*r as u32);
                    h.word(*b as u32);
                    for &v in acc {
                        h.word(v as u32);
                    }
                }
                println!(
                    "gemm m={m} n={n} k={k} extreme={extreme} run={run} tiles={} wrong={} fnv={:016x}",
                    got.len(),
                    wrong.len(),
                    h.0
                );
                if !wrong.is_empty() {
                    eprintln!(
                        "  run {run}: {} wrong lanes; first (row, feature, got, want): {:?}",
                        wrong.len(),
                        &wrong[..wrong.len().min(4)]
                    );
                }
            }
        }
    }
    // A whole W8A8 dynamic layer: routing, grouping, both GEMMs, requantisation, combine.
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
    );
    let layer = match layer {
        Ok(l) => l,
        Err(err) => {
            println!("layer error {err}");
            return;
        }
    };
    for t in [1usize, 5, 37, 100] {
        let x: Vec<f32> = (0..t * hd)
            .map(|_| (f32::from(rng.byte()) - 127.5) / 31.0)
            .collect();
        let logits: Vec<f32> = (0..t * e).map(|_| f32::from(rng.byte()) / 40.0).collect();
        let mut h = Fnv::new();
        match layer.forward(&x, t, &logits, Compute::F32) {
            Ok(y) => {
                for v in &y {
                    h.word(v.to_bits());
                }
                println!("moe w8a8 T={t} outputs={} fnv={:016x}", y.len(), h.0);
            }
            Err(err) => println!("moe w8a8 T={t} error {err}"),
        }
    }
}

fn run(cap: Option<&str>) -> Option<String> {
    let me = std::env::args().next()?;
    let mut cmd = Command::new(me);
    cmd.env(CHILD, "1");
    match cap {
        Some(c) => cmd.env("MOEQ_CPU_ISA", c),
        None => cmd.env_remove("MOEQ_CPU_ISA"),
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
        println!("child {cap:?} failed: {}", out.status);
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn main() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    if std::process::id() == 1 {
        console_as_init();
    }
    let amx = cpu_has_amx();
    println!(
        "CPUID: AMX-TILE and AMX-INT8 {}",
        if amx { "present" } else { "absent" }
    );
    let reference = run(Some("scalar"));
    let mut ok = reference.is_some();
    if let Some(r) = &reference {
        if misses(r) {
            println!("scalar: accumulators differ from the direct sums");
            ok = false;
        }
    }
    let mut families = Vec::new();
    for cap in [Some("avx2"), Some("avx_vnni"), Some("avx512_vnni"), None] {
        let Some(out) = run(cap) else {
            ok = false;
            continue;
        };
        let family = out.lines().next().unwrap_or("family ?").to_string();
        if misses(&out) {
            println!("{family}: accumulators differ from the direct sums");
            ok = false;
        }
        let same = reference.as_deref().map(|r| body(r) == body(&out));
        println!(
            "{} (cap {}): {}",
            family,
            cap.unwrap_or("none"),
            match same {
                Some(true) => "same bits as scalar",
                _ => "DIFFERS from scalar",
            }
        );
        if same != Some(true) {
            ok = false;
            if let Some(r) = &reference {
                for (a, b) in body(r).iter().zip(body(&out)) {
                    if *a != b {
                        println!("  scalar: {a}\n  {family}: {b}");
                    }
                }
            }
        }
        families.push(family);
    }
    if let Some(r) = &reference {
        print!("{}", r);
    }
    if amx && !families.iter().any(|f| f == "family amx_int8") {
        println!("the CPU has AMX but no child ran amx_int8 (stderr says why)");
        ok = false;
    }
    println!("AMX PROBE: {}", if ok { "PASS" } else { "FAIL" });
    if std::process::id() == 1 {
        // As the emulator's init: power off rather than return (which would panic the kernel).
        // SAFETY: `tcdrain`, `sync` and `reboot` take no pointers; powering off is this process's purpose.
        // `tcdrain` first: a serial console still holding the report would lose it at power-off.
        unsafe {
            libc::tcdrain(1);
            libc::sync();
            libc::reboot(libc::RB_POWER_OFF);
        }
    }
}

/// As process 1 of a bare initramfs: mount devtmpfs on `/dev` and make `/dev/console` our
/// standard streams (children need `/dev/null`; the archive then needs no device nodes, so it
/// is built without root).
fn console_as_init() {
    // SAFETY: the strings are NUL-terminated literals that outlive the calls; `open` returns a
    // descriptor or -1, and `dup2` of a valid descriptor onto 0-2 touches nothing else.
    unsafe {
        libc::mount(
            c"devtmpfs".as_ptr(),
            c"/dev".as_ptr(),
            c"devtmpfs".as_ptr(),
            0,
            std::ptr::null(),
        );
        let fd = libc::open(c"/dev/console".as_ptr(), libc::O_RDWR);
        if fd >= 0 {
            for std_fd in 0..3 {
                libc::dup2(fd, std_fd);
            }
        }
    }
}

/// Whether a child's report has a GEMM whose accumulators missed the direct sums.
fn misses(report: &str) -> bool {
    report
        .lines()
        .any(|l| l.contains(" wrong=") && !l.contains(" wrong=0 "))
}

/// The fingerprint lines, without the first (`family ...`) line.
fn body(s: &str) -> Vec<&str> {
    s.lines().skip(1).collect()
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
