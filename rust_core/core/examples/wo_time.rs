//! Times the weight-only (W4A16 / W8A16) GEMM kernels, fp32 and bf16 dot products, on one
//! thread: with the weights cache-resident (their compute rate,
//! `cargo run --release --example wo_time`), or streaming a 64 MB 4-bit layer from memory
//! (`COLD=1`). The bf16 kernel is timed only on CPUs with bf16 dot products. `BF16_SCALES=1`
//! gives the layer bf16 scales (see the example's `main`).
use std::time::Instant;

mod common;
use common::{best_per_call, env_size};

use moeq_core::cpu::wo::BlockedWo;

/// Where a timed GEMM emits each block's lanes.
type Sink<'a> = dyn FnMut(&[f32; 16]) + 'a;

fn main() {
    if std::env::var_os("COLD").is_some() {
        return cold();
    }
    // `K=14336` (a multiple of 128) times a wider layer; `N` sets its output features.
    let (n, k) = (env_size("N", 512), env_size("K", 2048));
    // `ROWS=64,256` times prefill-sized calls instead of the decode sizes.
    let rows: Vec<usize> = std::env::var("ROWS")
        .ok()
        .map(|v| v.split(',').filter_map(|r| r.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 4, 8]);
    for bits in [4u32, 8] {
        let q: Vec<i8> = (0..n * k)
            .map(|i| {
                let v = ((i * 7919) % 251) as i32;
                if bits == 4 {
                    (v % 16 - 8) as i8
                } else {
                    (v - 125) as i8
                }
            })
            .collect();
        // `GROUP=2048` times larger groups (a multiple of 2 dividing `k`).
        let group = env_size("GROUP", 128);
        let groups: Vec<usize> = (0..k / group).map(|g| g * group).collect();
        // `BF16_SCALES=1`: scales that are bf16 values, as a checkpoint's are, so that tiles
        // of more than one row tile (and int8 ones) widen into dequantised bf16 weights
        // (no group epilogue); otherwise 1e-3, which is not one.
        let s = if std::env::var_os("BF16_SCALES").is_some() {
            f32::from_bits(1e-3f32.to_bits() & 0xffff_0000)
        } else {
            1e-3
        };
        let scale = vec![s; n * groups.len()];
        let w = BlockedWo::new(n, k, &q, &scale, None, groups);
        for &m in &rows {
            let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 7.0).collect();
            // Seconds per call of `gemm`, which emits each block's lanes to a sink (the best
            // batch of ~2000 / m calls in all).
            let per_call = |gemm: &dyn Fn(&mut Sink)| {
                let mut sink = 0f32;
                let s = best_per_call((2000 / m).max(20), || gemm(&mut |l| sink += l[0]));
                std::hint::black_box(sink);
                s
            };
            let s = per_call(&|f| w.gemm(&x, m, 0, w.blocks(), |_, _, l| f(l)));
            report(bits, m, "f32", s, n, k);
            // Without bf16 dot products the bf16 kernel is an emulation, too slow to tell
            // anything (and seconds per size).
            if moeq_core::cpu::kernels::bf16_dot() {
                let xb = w.bf16_rows(&x, m);
                let s = per_call(&|f| w.gemm_bf16(&xb, m, 0, w.blocks(), |_, _, l| f(l)));
                report(bits, m, "bf16", s, n, k);
            }
            // int8 codes with bf16 inputs in fewer rows than the bf16 path takes: the
            // fixed-point int8 dot products (see `wo::fixed`), and the input's preparation.
            if let Some(xf) = w.fixed_rows_from(m, |r| &x[r * k..(r + 1) * k], None) {
                let s = per_call(&|f| w.gemm_fixed(&xf, 0, w.blocks(), |_, _, l| f(l)));
                report(bits, m, "fixed", s, n, k);
                let prep = best_per_call(200, || {
                    std::hint::black_box(w.fixed_rows_from(m, |r| &x[r * k..(r + 1) * k], None));
                });
                println!("  fixed-point input of {m} rows: {:.1} us", prep * 1e6);
            }
        }
    }
}

fn report(bits: u32, m: usize, path: &str, s: f64, n: usize, k: usize) {
    println!(
        "int{bits} m={m} {path}: {:.1} us, {:.1} GMAC/s, {:.1} GB/s of codes",
        s * 1e6,
        (m * n * k) as f64 / s / 1e9,
        (n * k * bits as usize / 8) as f64 / s / 1e9
    );
}

/// One thread streaming a 4-bit layer far larger than the caches, 1 and 4 rows.
fn cold() {
    let (n, k) = (32768usize, 4096usize);
    let q: Vec<i8> = (0..n * k)
        .map(|i| (((i * 7919) % 251) % 16) as i8 - 8)
        .collect();
    let groups: Vec<usize> = (0..k / 128).map(|g| g * 128).collect();
    let scale = vec![1e-3f32; n * groups.len()];
    let w = BlockedWo::new(n, k, &q, &scale, None, groups);
    drop(q);
    let gb = w.code_bytes().len() as f64 / 1e9;
    for m in [1usize, 4] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 7.0).collect();
        let xb = w.bf16_rows(&x, m);
        for _ in 0..3 {
            let mut sink = 0f32;
            let t = Instant::now();
            w.gemm(&x, m, 0, w.blocks(), |_, _, l| sink += l[0]);
            let f = t.elapsed().as_secs_f64();
            let t = Instant::now();
            w.gemm_bf16(&xb, m, 0, w.blocks(), |_, _, l| sink += l[0]);
            let b = t.elapsed().as_secs_f64();
            std::hint::black_box(sink);
            println!(
                "cold, m={m}: fp32 kernel {:.1} GB/s, bf16 kernel {:.1} GB/s of codes",
                gb / f,
                gb / b
            );
        }
    }
}
