//! Times `gptq_marlin_moe_repack` on a Mixtral-size layer: `cargo run --release --example repack_time`.
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (e, k, n) = (8usize, 4096usize, 28672usize);
    for bits in [4u32, 8] {
        let pf = 32 / bits as usize;
        let mut x = 0x9e3779b97f4a7c15u64;
        let q: Vec<u32> = (0..e * k / pf * n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u32
            })
            .collect();
        for _ in 0..3 {
            let t = Instant::now();
            let b = moeq_core::repack::marlin::output_buffer(e * k / 16 * n * 16 / pf);
            println!("output_buffer {:?} {}", t.elapsed(), b.len());
            drop(b);
            let t = Instant::now();
            let out = moeq_core::repack::marlin::gptq_marlin_moe_repack(&q, &[], e, k, n, bits)?;
            let t1 = t.elapsed();
            let t = Instant::now();
            let out2 = moeq_core::repack::marlin::gptq_marlin_moe_repack(&q, &[], e, k, n, bits)?;
            println!("second call {:?} {}", t.elapsed(), out2.len());
            drop(out2);
            let t = Instant::now();
            let c = q.clone();
            let t2 = t.elapsed();
            drop(out);
            let mut buf = moeq_core::repack::marlin::output_buffer(e * k / 16 * n * 16 / pf);
            let t = Instant::now();
            let per = buf.len() / e;
            for (ei, dst) in buf.chunks_mut(per).enumerate() {
                let qe = &q[ei * (k / pf * n)..(ei + 1) * (k / pf * n)];
                moeq_core::repack::marlin::repack_columns(
                    |kt, nn| moeq_core::repack::marlin::gptq_column(qe, n, bits, kt, nn),
                    k,
                    n,
                    bits,
                    dst,
                );
            }
            let t3 = t.elapsed();
            let sum: u64 = buf.iter().map(|&w| u64::from(w)).sum();
            println!("checksum {sum}");
            let t = Instant::now();
            for ei in 0..e {
                let qe = &q[ei * (k / pf * n)..(ei + 1) * (k / pf * n)];
                let o = moeq_core::repack::marlin::gptq_marlin_repack(qe, &[], k, n, bits)?;
                std::hint::black_box(o);
            }
            println!("dense per expert {:?}", t.elapsed());
            println!(
                "bits {bits}: repack {t1:?} (compute only {t3:?}) copy {t2:?} ({} {})",
                buf.len(),
                c.len()
            );
        }
    }
    Ok(())
}
