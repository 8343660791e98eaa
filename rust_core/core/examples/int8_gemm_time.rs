//! Times the int8 linear layer on a Qwen3-MoE expert shape: `cargo run --release --example int8_gemm_time`.
use std::time::Instant;

use moeq_core::cpu::linear::Linear;

fn main() {
    let (n, k) = (1536usize, 2048usize);
    let q: Vec<i8> = (0..n * k).map(|i| ((i * 7919) % 255) as i8).collect();
    let lin = Linear::int8(n, k, q, vec![1e-3; n], None);
    for m in [1usize, 4, 64, 256] {
        let x: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 7.0).collect();
        let reps = (256 / m).max(4);
        let t = Instant::now();
        for _ in 0..reps {
            std::hint::black_box(lin.forward(&x, m, true));
        }
        let secs = t.elapsed().as_secs_f64() / reps as f64;
        println!(
            "m={m:4}: {:.3} ms, {:.1} GMAC/s",
            secs * 1e3,
            (m * n * k) as f64 / secs / 1e9
        );
    }
}
