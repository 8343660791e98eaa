//! Times the packed int8 GEMM and the int8 linear layer on a Qwen3-MoE expert shape:
//! `cargo run --release --example int8_gemm_time` (`MOEQ_CPU_ISA` picks the kernel family; `N`
//! and `K` set the layer shape, Qwen3-30B-A3B's gate|up by default). Each figure is the best
//! of 20 batches of calls.
mod common;
use common::{best_per_call, env_size};

use moeq_core::cpu::arena::Arena;
use moeq_core::cpu::linear::Linear;
use moeq_core::cpu::packed::PackedI8;
use moeq_core::cpu::spare::LineBytes;
use std::sync::Arc;

fn main() {
    // `N=... K=...` time other shapes (default: Qwen3-30B-A3B's gate|up).
    let (n, k) = (env_size("N", 1536), env_size("K", 2048));
    let q: Vec<i8> = (0..n * k).map(|i| ((i * 7919) % 255) as i8).collect();
    let mut packed = PackedI8::pack(&q, n, k);
    let mut lin = Linear::int8(n, k, q, vec![1e-3; n], None);
    // In an arena, on cache lines, as a loaded layer's weights are.
    if let Linear::Int8 { w, .. } = &mut lin {
        let (arena, at) = Arena::build(&[packed.bytes(), w.bytes()]);
        let arena = Arc::new(arena);
        packed.share(&arena, at[0]);
        w.share(&arena, at[1]);
    }
    let isa = moeq_core::cpu::kernels::isa();
    println!("kernel family: {}", moeq_core::cpu::kernels::isa_name(isa));
    for m in [1usize, 4, 6, 64, 256] {
        // On a cache line, as the forward's prepared rows are.
        let mut xu = LineBytes::take(m * packed.k_pad, 0);
        for (i, v) in xu.iter_mut().enumerate() {
            *v = (i % 251) as u8;
        }
        let calls = (512 / m).max(20);
        let mut sink = 0i32;
        let kernel = best_per_call(calls, || {
            packed.gemm(&xu, m, 0, packed.blocks(), |_, _, acc| sink ^= acc[0]);
        });
        std::hint::black_box(sink);
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 7.0).collect();
        let layer = best_per_call(calls, || {
            std::hint::black_box(lin.forward(&x, m, false));
        });
        let macs = (m * n * k) as f64;
        println!(
            "m={m:4}: one thread: packed GEMM {:.1} GMAC/s, linear layer {:.1} GMAC/s",
            macs / kernel / 1e9,
            macs / layer / 1e9
        );
    }
}
