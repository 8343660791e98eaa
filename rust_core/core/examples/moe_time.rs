//! Times the CPU MoE forward on the Qwen3-30B-A3B shape (H2048 I768 E128 k8) or another, W8A8
//! dynamic unless `SCHEME` says otherwise:
//! `MOEQ_NUM_THREADS=2 cargo run --release --example moe_time [tokens] [reps]`
//! (`SHAPE=qwen3|dsv2lite|mixtral`, `SCHEME=w8a8|w8a16|w4a16`, `WARM=1` skips the cache flush,
//! `FIXED=1` routes every call the same way, `BF16=1` runs weight-only layers as for bf16
//! inputs).
use std::time::Instant;

use moeq_core::cpu::build::{from_raw, RawProj, RawScheme, SampleCodes};

fn main() -> moeq_core::error::Result<()> {
    // As moeq_rs does for Python's main thread.
    moeq_core::cpu::adopt_calling_thread();
    let mut args = std::env::args().skip(1);
    let tokens: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let (h, i, e, k) = match std::env::var("SHAPE").as_deref() {
        Ok("mixtral") => (4096usize, 14336usize, 8usize, 2usize),
        Ok("dsv2lite") => (2048, 1408, 64, 6),
        _ => (2048, 768, 128, 8),
    };
    let scheme = std::env::var("SCHEME").unwrap_or_else(|_| "w8a8".into());
    let (raw, group) = match scheme.as_str() {
        "w8a16" => (RawScheme::W8a16, 128i64),
        "w4a16" => (RawScheme::W4a16, 128),
        _ => (RawScheme::W8a8Dynamic, -1),
    };
    let g13 = if group > 0 { h / group as usize } else { 1 };
    let g2 = if group > 0 { i / group as usize } else { 1 };
    // `BF16_SCALES=1`: scales that are bf16 values, as a checkpoint's are (weight-only layers
    // then widen into dequantised bf16 weights from 32 rows per expert); else 1e-3.
    let s = if std::env::var_os("BF16_SCALES").is_some() {
        f32::from_bits(1e-3f32.to_bits() & 0xffff_0000)
    } else {
        1e-3
    };
    let s13 = vec![s; e * 2 * i * g13];
    let s2 = vec![s; e * h * g2];
    let proj = |weights, scales| RawProj {
        weights,
        scales,
        zero_points: None,
        act_scales: None,
    };
    let codes = SampleCodes::new(raw == RawScheme::W4a16, e, h, i);
    let (w13r, w2r) = codes.raw();
    let moe = from_raw(
        raw,
        e,
        h,
        i,
        group,
        proj(w13r, &s13),
        proj(w2r, &s2),
        k,
        true,
    )?;
    // The layer holds its own packed copy.
    drop(codes);
    let x: Vec<f32> = (0..tokens * h)
        .map(|v| ((v % 97) as f32 - 48.0) / 9.0)
        .collect();
    // Weights cold, as in bench/moe_cpu.py: read 640 MB before every call.
    let flush: Vec<u64> = (0..640usize << 17).map(|v| v as u64).collect();
    let mut best = f64::MAX;
    let mut all = Vec::new();
    let warm = std::env::var_os("WARM").is_some();
    // The same routing every call: with `WARM=1`, the touched experts stay in cache.
    let fixed = std::env::var_os("FIXED").is_some();
    let compute = if std::env::var_os("BF16").is_some() {
        moeq_core::cpu::linear::Compute::Bf16
    } else {
        moeq_core::cpu::linear::Compute::F32
    };
    for rep in 0..reps {
        if !warm {
            std::hint::black_box(flush.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
        }
        let logits: Vec<f32> = (0..tokens * e)
            .map(|v| ((v * 31 + if fixed { 0 } else { rep * 7 }) % 113) as f32 / 17.0)
            .collect();
        let t = Instant::now();
        std::hint::black_box(moe.forward(&x, tokens, &logits, compute)?);
        best = best.min(t.elapsed().as_secs_f64());
        all.push(t.elapsed().as_secs_f64());
    }
    all.sort_by(f64::total_cmp);
    // The floor for the same bytes: after the same flush, read 8 random 4.7 MB runs of a
    // 600 MB buffer (one layer's worth) with two threads, summing u64 words.
    let bytes: Vec<i8> = (0..e * 3 * i * h).map(|v| v as i8).collect();
    let (arena, _) = moeq_core::cpu::arena::Arena::build(&[&bytes]);
    drop(bytes);
    let raw = arena.slice(0, e * 3 * i * h);
    // SAFETY: the arena slice is 64-byte aligned and a multiple of 8 bytes long.
    let weights: &[u64] = unsafe { std::slice::from_raw_parts(raw.as_ptr().cast(), raw.len() / 8) };
    let per = 3 * i * h / 8;
    let mut reads = Vec::new();
    for rep in 0..reps {
        std::hint::black_box(flush.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
        let picks: Vec<usize> = (0..k).map(|j| (rep * 37 + j * 13) % e).collect();
        let t = Instant::now();
        use rayon::prelude::*;
        let s: u64 = picks
            .par_iter()
            .flat_map_iter(|&p| weights[p * per..(p + 1) * per].chunks(4096))
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .sum();
        std::hint::black_box(s);
        reads.push(t.elapsed().as_secs_f64());
    }
    reads.sort_by(f64::total_cmp);
    println!(
        "plain read of the touched bytes: median {:.2} ms ({:.1} GB/s)",
        reads[reads.len() / 2] * 1e3,
        (k * per * 8) as f64 / reads[reads.len() / 2] / 1e9
    );
    let median = all[all.len() / 2];
    let macs = (tokens * k * 3 * i * h) as f64;
    println!(
        "T={tokens}: best {:.2} ms, median {:.2} ms; {:.0} GMAC/s at the best, {:.0} at the median",
        best * 1e3,
        median * 1e3,
        macs / best / 1e9,
        macs / median / 1e9
    );
    Ok(())
}
