//! The core's peak rate of the dot-product instructions the CPU kernels are built on
//! (AVX-512 VNNI `vpdpbusd`, AVX512-BF16 `vdpbf16ps`), one thread, 16 independent
//! accumulators so that throughput, not latency, bounds it:
//! `cargo run --release --example dot_peak`.

#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;

    /// `n` rounds of 16 `vpdpbusd`; returns a checksum so the work is kept.
    ///
    /// # Safety
    /// The CPU supports AVX-512F, BW and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni(n: usize) -> i32 {
        let a = _mm512_set1_epi32(0x0102_0304);
        let b = _mm512_set1_epi32(0x0101_0101);
        let mut acc = [_mm512_setzero_si512(); 16];
        for _ in 0..n {
            for v in acc.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, a, b);
            }
        }
        let mut s = _mm512_setzero_si512();
        for v in acc {
            s = _mm512_add_epi32(s, v);
        }
        _mm512_reduce_add_epi32(s)
    }

    /// `n` rounds of 16 `vdpbf16ps`.
    ///
    /// # Safety
    /// The CPU supports AVX-512F and AVX512-BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn bf16(n: usize) -> f32 {
        // SAFETY: __m512bh and __m512i are both 64 bytes of plain bits.
        let a: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80)) };
        let mut acc = [_mm512_setzero_ps(); 16];
        for _ in 0..n {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, a, a);
            }
        }
        let mut s = _mm512_setzero_ps();
        for v in acc {
            s = _mm512_add_ps(s, v);
        }
        _mm512_reduce_add_ps(s)
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    {
        use std::time::Instant;
        let n = 20_000_000;
        if std::arch::is_x86_feature_detected!("avx512vnni")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            let t = Instant::now();
            // SAFETY: AVX-512 VNNI and BW (and with them F) detected.
            let r = unsafe { peak::vnni(n) };
            let dt = t.elapsed().as_secs_f64();
            println!(
                "vpdpbusd: {:.0} GMAC/s per core (u8 x i8; checksum {r})",
                (n * 16 * 64) as f64 / dt / 1e9
            );
        } else {
            println!("vpdpbusd: this CPU has no AVX-512 VNNI");
        }
        if std::arch::is_x86_feature_detected!("avx512bf16") {
            let t = Instant::now();
            // SAFETY: AVX512-BF16 (and AVX-512F) detected.
            let r = unsafe { peak::bf16(n) };
            let dt = t.elapsed().as_secs_f64();
            println!(
                "vdpbf16ps: {:.0} GMAC/s per core (bf16 x bf16; checksum {r})",
                (n * 16 * 32) as f64 / dt / 1e9
            );
        } else {
            println!("vdpbf16ps: this CPU has no AVX512-BF16");
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    println!("dot_peak measures x86-64 instructions only");
}
