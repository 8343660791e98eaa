//! The compute limit of the CPU kernels' products on this machine (`moeq_core::cpu::peak`):
//! `MOEQ_NUM_THREADS=2 cargo run --release --example dot_peak`.
use moeq_core::cpu::peak::{measure, Dot};

fn main() {
    let threads = moeq_core::cpu::num_threads();
    for dot in [Dot::Int8, Dot::Bf16, Dot::F32] {
        match measure(dot, threads) {
            Some((name, rate)) => println!("{dot:?}: {name}, {threads} threads: {rate:.0} GMAC/s"),
            None => println!("{dot:?}: no probe for this dispatch"),
        }
    }
}
