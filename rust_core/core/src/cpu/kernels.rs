//! Dot-product kernels with runtime dispatch: AVX-512BW, AVX2, and the scalar reference.
//! The int8 kernels widen to int16 and use `madd` (exact int32 sums, no saturation), so every
//! path returns exactly the scalar reference's accumulator.

/// The best int8 kernel this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// AVX-512 VNNI: `vpdpbusd` on (x + 128) as u8 times w as i8, minus 128 * sum(w).
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
}

pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("MOEQ_FORCE_SCALAR").is_some() {
                return Isa::Scalar;
            }
            if std::arch::is_x86_feature_detected!("avx512bw") {
                if std::arch::is_x86_feature_detected!("avx512vnni") {
                    return Isa::Avx512Vnni;
                }
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// `Σ a[i] * b[i]` in int32: the scalar reference.
pub fn dot_i8_scalar(a: &[i8], b: &[i8]) -> i32 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum()
}

/// `Σ a[i] * b[i]` in int32 with the best kernel of this CPU.
#[inline]
pub fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match isa() {
        Isa::Scalar => dot_i8_scalar(a, b),
        // SAFETY: `isa()` returned this variant only after detecting the feature at run time.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_i8_avx2(a, b) },
        // SAFETY: as above, AVX-512BW was detected (VNNI implies it here).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vnni => unsafe { x86::dot_i8_avx512(a, b) },
    }
}

/// Four weight rows at once: `out[f * m + r] = Σ_i x[r, i] * w[f, i]` for `w` `[4, k]` with
/// row sums `wsum[f]`.
pub fn dot_rows4(x: &[i8], xu: &[u8], m: usize, k: usize, w: &[i8], wsum: &[i32], out: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512Vnni {
        let mut r = 0;
        while r + 4 <= m {
            // SAFETY: VNNI detected by `isa()`; rows r..r+4 of `xu` and the 4 rows of `w` exist.
            let d = unsafe { x86::dot4x4_vnni(&xu[r * k..(r + 4) * k], &w[..4 * k], k) };
            for f in 0..4 {
                for t in 0..4 {
                    out[f * m + r + t] = d[f * 4 + t] - 128 * wsum[f];
                }
            }
            r += 4;
        }
        while r < m {
            // SAFETY: VNNI detected by `isa()`; row r of `xu` and the 4 rows of `w` exist.
            let d = unsafe { x86::dot4x1_vnni(&xu[r * k..(r + 1) * k], &w[..4 * k], k) };
            for f in 0..4 {
                out[f * m + r] = d[f] - 128 * wsum[f];
            }
            r += 1;
        }
        return;
    }
    for f in 0..4 {
        dot_rows(
            x,
            xu,
            m,
            k,
            &w[f * k..(f + 1) * k],
            wsum[f],
            &mut out[f * m..(f + 1) * m],
        );
    }
}

/// `out[r] = Σ_i x[r, i] * w[i]` for `m` activation rows `x` (`[m, k]` int8, also given as
/// `xu = x + 128` in u8) against one weight row `w` whose element sum is `wsum`.
pub fn dot_rows(x: &[i8], xu: &[u8], m: usize, k: usize, w: &[i8], wsum: i32, out: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx512Vnni {
        let mut r = 0;
        while r + 4 <= m {
            // SAFETY: VNNI detected by `isa()`; rows r..r+4 of `xu` exist (r + 4 <= m, xu is m * k).
            let d = unsafe { x86::dot4_vnni(&xu[r * k..(r + 4) * k], k, &w[..k]) };
            for (j, v) in d.iter().enumerate() {
                out[r + j] = v - 128 * wsum;
            }
            r += 4;
        }
        for rr in r..m {
            // SAFETY: VNNI detected by `isa()`; row rr of `xu` exists (rr < m, xu is m * k).
            out[rr] = unsafe { x86::dot1_vnni(&xu[rr * k..(rr + 1) * k], &w[..k]) } - 128 * wsum;
        }
        return;
    }
    let _ = (xu, wsum);
    for (r, o) in out.iter_mut().enumerate().take(m) {
        *o = dot_i8(&x[r * k..(r + 1) * k], w);
    }
}

/// `Σ (q[i] - z) * x[i]` in f32 with the best kernel of this CPU (fp32 compute, as the
/// weight-only numerics require; lanes sum in a different order than a sequential loop).
#[inline]
pub fn dot_q_f32(q: &[i8], x: &[f32], z: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        let n = q.len().min(x.len());
        // SAFETY: AVX-512 (F and BW) detected by `isa()`; both slices cut to the same length.
        return unsafe { x86::dot_q_f32_avx512(&q[..n], &x[..n], z) };
    }
    dot_q_f32_lanes(q, x, z)
}

/// The portable version of [`dot_q_f32`]: 16 independent lanes.
pub fn dot_q_f32_lanes(q: &[i8], x: &[f32], z: f32) -> f32 {
    let mut lanes = [0f32; 16];
    let mut qc = q.chunks_exact(16);
    let mut xc = x.chunks_exact(16);
    for (qq, xx) in (&mut qc).zip(&mut xc) {
        for l in 0..16 {
            lanes[l] += (f32::from(qq[l]) - z) * xx[l];
        }
    }
    let mut tail = 0f32;
    for (&c, &v) in qc.remainder().iter().zip(xc.remainder()) {
        tail += (f32::from(c) - z) * v;
    }
    lanes.iter().sum::<f32>() + tail
}

/// `Σ w[i] * x[i]` in f32, 16 lanes.
#[inline]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let mut wc = w.chunks_exact(16);
    let mut xc = x.chunks_exact(16);
    for (ww, xx) in (&mut wc).zip(&mut xc) {
        for l in 0..16 {
            lanes[l] += ww[l] * xx[l];
        }
    }
    let tail: f32 = wc
        .remainder()
        .iter()
        .zip(xc.remainder())
        .map(|(a, b)| a * b)
        .sum();
    lanes.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2; `a` and `b` have the same length.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot_i8_avx2(a: &[i8], b: &[i8]) -> i32 {
        let n = a.len();
        let mut acc = _mm256_setzero_si256();
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n = a.len() = b.len(): both 16-byte loads are in bounds.
            let (va, vb) = unsafe {
                (
                    _mm_loadu_si128(a.as_ptr().add(i).cast::<__m128i>()),
                    _mm_loadu_si128(b.as_ptr().add(i).cast::<__m128i>()),
                )
            };
            let wa = _mm256_cvtepi8_epi16(va);
            let wb = _mm256_cvtepi8_epi16(vb);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(wa, wb));
            i += 16;
        }
        let mut lanes = [0i32; 8];
        // SAFETY: `lanes` is 32 bytes, exactly one unaligned 256-bit store.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast::<__m256i>(), acc) };
        let mut sum: i32 = lanes.iter().sum();
        for j in i..n {
            sum += i32::from(a[j]) * i32::from(b[j]);
        }
        sum
    }

    /// Four dot products of `xu` rows (`[4, k]`, u8) with one int8 weight row, in int32.
    ///
    /// # Safety
    /// The CPU must support AVX-512 VNNI and BW; `xu.len() == 4 * k` and `w.len() == k`.
    #[target_feature(enable = "avx512vnni,avx512bw")]
    pub unsafe fn dot4_vnni(xu: &[u8], k: usize, w: &[i8]) -> [i32; 4] {
        let mut acc = [_mm512_setzero_si512(); 4];
        let mut i = 0;
        while i + 64 <= k {
            // SAFETY: i + 64 <= k: the 64-byte loads of w and of each of the 4 rows of xu (each
            // k bytes long) are in bounds.
            unsafe {
                let vw = _mm512_loadu_si512(w.as_ptr().add(i).cast());
                for (r, a) in acc.iter_mut().enumerate() {
                    let vx = _mm512_loadu_si512(xu.as_ptr().add(r * k + i).cast());
                    *a = _mm512_dpbusd_epi32(*a, vx, vw);
                }
            }
            i += 64;
        }
        let mut out = [0i32; 4];
        for (r, o) in out.iter_mut().enumerate() {
            let mut sum = _mm512_reduce_add_epi32(acc[r]);
            for j in i..k {
                sum += i32::from(xu[r * k + j]) * i32::from(w[j]);
            }
            *o = sum;
        }
        out
    }

    /// `Σ (q[i] - z) * x[i]`, 16 lanes of f32 FMA.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `q.len() == x.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_q_f32_avx512(q: &[i8], x: &[f32], z: f32) -> f32 {
        let n = q.len();
        let vz = _mm512_set1_ps(z);
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n: two 16-byte loads of q and two 64-byte loads of x in bounds.
            unsafe {
                let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    q.as_ptr().add(i).cast(),
                )));
                let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    q.as_ptr().add(i + 16).cast(),
                )));
                a0 = _mm512_fmadd_ps(
                    _mm512_sub_ps(q0, vz),
                    _mm512_loadu_ps(x.as_ptr().add(i)),
                    a0,
                );
                a1 = _mm512_fmadd_ps(
                    _mm512_sub_ps(q1, vz),
                    _mm512_loadu_ps(x.as_ptr().add(i + 16)),
                    a1,
                );
            }
            i += 32;
        }
        let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for j in i..n {
            sum += (f32::from(q[j]) - z) * x[j];
        }
        sum
    }

    /// Four weight rows against one activation row: `out[f] = Σ xu[i] * w[f, i]`.
    ///
    /// # Safety
    /// The CPU must support AVX-512 VNNI and BW; `xu.len() == k`, `w.len() == 4 * k`.
    #[target_feature(enable = "avx512vnni,avx512bw")]
    pub unsafe fn dot4x1_vnni(xu: &[u8], w: &[i8], k: usize) -> [i32; 4] {
        let mut acc = [_mm512_setzero_si512(); 4];
        let mut i = 0;
        while i + 64 <= k {
            // SAFETY: i + 64 <= k: the 64-byte loads stay inside `xu` and each k-byte row of `w`.
            unsafe {
                let vx = _mm512_loadu_si512(xu.as_ptr().add(i).cast());
                for (f, a) in acc.iter_mut().enumerate() {
                    let vw = _mm512_loadu_si512(w.as_ptr().add(f * k + i).cast());
                    *a = _mm512_dpbusd_epi32(*a, vx, vw);
                }
            }
            i += 64;
        }
        let mut out = [0i32; 4];
        for (f, o) in out.iter_mut().enumerate() {
            let mut sum = _mm512_reduce_add_epi32(acc[f]);
            for j in i..k {
                sum += i32::from(xu[j]) * i32::from(w[f * k + j]);
            }
            *o = sum;
        }
        out
    }

    /// A 4 x 4 tile: `out[f * 4 + t] = Σ xu[t, i] * w[f, i]` (u8 x i8 in int32).
    ///
    /// # Safety
    /// The CPU must support AVX-512 VNNI and BW; `xu.len() == 4 * k`, `w.len() == 4 * k`.
    #[target_feature(enable = "avx512vnni,avx512bw")]
    pub unsafe fn dot4x4_vnni(xu: &[u8], w: &[i8], k: usize) -> [i32; 16] {
        let mut acc = [_mm512_setzero_si512(); 16];
        let mut i = 0;
        while i + 64 <= k {
            // SAFETY: i + 64 <= k: every 64-byte load below reads inside one of the four k-byte
            // rows of `xu` or of `w`.
            unsafe {
                let xs = [
                    _mm512_loadu_si512(xu.as_ptr().add(i).cast()),
                    _mm512_loadu_si512(xu.as_ptr().add(k + i).cast()),
                    _mm512_loadu_si512(xu.as_ptr().add(2 * k + i).cast()),
                    _mm512_loadu_si512(xu.as_ptr().add(3 * k + i).cast()),
                ];
                for f in 0..4 {
                    let vw = _mm512_loadu_si512(w.as_ptr().add(f * k + i).cast());
                    for t in 0..4 {
                        acc[f * 4 + t] = _mm512_dpbusd_epi32(acc[f * 4 + t], xs[t], vw);
                    }
                }
            }
            i += 64;
        }
        let mut out = [0i32; 16];
        for f in 0..4 {
            for t in 0..4 {
                let mut sum = _mm512_reduce_add_epi32(acc[f * 4 + t]);
                for j in i..k {
                    sum += i32::from(xu[t * k + j]) * i32::from(w[f * k + j]);
                }
                out[f * 4 + t] = sum;
            }
        }
        out
    }

    /// One dot product of a u8 row with an int8 weight row, in int32 (two accumulators).
    ///
    /// # Safety
    /// The CPU must support AVX-512 VNNI and BW; `xu.len() == w.len()`.
    #[target_feature(enable = "avx512vnni,avx512bw")]
    pub unsafe fn dot1_vnni(xu: &[u8], w: &[i8]) -> i32 {
        let k = xu.len().min(w.len());
        let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        let mut i = 0;
        while i + 128 <= k {
            // SAFETY: i + 128 <= k: all four 64-byte loads are in bounds of both slices.
            unsafe {
                let x0 = _mm512_loadu_si512(xu.as_ptr().add(i).cast());
                let w0 = _mm512_loadu_si512(w.as_ptr().add(i).cast());
                let x1 = _mm512_loadu_si512(xu.as_ptr().add(i + 64).cast());
                let w1 = _mm512_loadu_si512(w.as_ptr().add(i + 64).cast());
                a0 = _mm512_dpbusd_epi32(a0, x0, w0);
                a1 = _mm512_dpbusd_epi32(a1, x1, w1);
            }
            i += 128;
        }
        while i + 64 <= k {
            // SAFETY: i + 64 <= k: both 64-byte loads are in bounds.
            unsafe {
                let x0 = _mm512_loadu_si512(xu.as_ptr().add(i).cast());
                let w0 = _mm512_loadu_si512(w.as_ptr().add(i).cast());
                a0 = _mm512_dpbusd_epi32(a0, x0, w0);
            }
            i += 64;
        }
        let mut sum = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
        for j in i..k {
            sum += i32::from(xu[j]) * i32::from(w[j]);
        }
        sum
    }

    /// # Safety
    /// The CPU must support AVX-512BW; `a` and `b` have the same length.
    #[target_feature(enable = "avx512bw")]
    pub unsafe fn dot_i8_avx512(a: &[i8], b: &[i8]) -> i32 {
        let n = a.len();
        let mut acc = _mm512_setzero_si512();
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: i + 32 <= n = a.len() = b.len(): both 32-byte loads are in bounds.
            let (va, vb) = unsafe {
                (
                    _mm256_loadu_si256(a.as_ptr().add(i).cast::<__m256i>()),
                    _mm256_loadu_si256(b.as_ptr().add(i).cast::<__m256i>()),
                )
            };
            let wa = _mm512_cvtepi8_epi16(va);
            let wb = _mm512_cvtepi8_epi16(vb);
            acc = _mm512_add_epi32(acc, _mm512_madd_epi16(wa, wb));
            i += 32;
        }
        let mut sum = _mm512_reduce_add_epi32(acc);
        for j in i..n {
            sum += i32::from(a[j]) * i32::from(b[j]);
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The 4 x 4 tile path equals the scalar reference exactly.
        #[test]
        fn dot_rows4_equals_scalar(m in 0usize..11, k in 0usize..300, seed in any::<u64>()) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s as i8 };
            let x: Vec<i8> = (0..m * k).map(|_| next()).collect();
            let w: Vec<i8> = (0..4 * k).map(|_| next()).collect();
            let xu: Vec<u8> = x.iter().map(|&v| (v as u8) ^ 0x80).collect();
            let wsum: Vec<i32> = w.chunks(k.max(1)).take(4).map(|r| r.iter().map(|&v| i32::from(v)).sum()).collect();
            let wsum = if k == 0 { vec![0; 4] } else { wsum };
            let mut out = vec![0i32; 4 * m];
            dot_rows4(&x, &xu, m, k, &w, &wsum, &mut out);
            for f in 0..4 {
                for r in 0..m {
                    prop_assert_eq!(out[f * m + r], dot_i8_scalar(&x[r * k..(r + 1) * k], &w[f * k..(f + 1) * k]));
                }
            }
        }

        /// The blocked VNNI path (and its fallbacks) equals the scalar reference exactly.
        #[test]
        fn dot_rows_equals_scalar(m in 0usize..9, k in 0usize..300, seed in any::<u64>()) {
            let mut s = seed | 1;
            let mut next = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s as i8 };
            let x: Vec<i8> = (0..m * k).map(|_| next()).collect();
            let w: Vec<i8> = (0..k).map(|_| next()).collect();
            let xu: Vec<u8> = x.iter().map(|&v| (v as u8) ^ 0x80).collect();
            let wsum: i32 = w.iter().map(|&v| i32::from(v)).sum();
            let mut out = vec![0i32; m];
            dot_rows(&x, &xu, m, k, &w, wsum, &mut out);
            for r in 0..m {
                prop_assert_eq!(out[r], dot_i8_scalar(&x[r * k..(r + 1) * k], &w));
            }
        }
    }

    proptest! {
        /// Every SIMD path's integer accumulator equals the scalar reference exactly.
        #[test]
        fn simd_dot_equals_scalar(v in proptest::collection::vec((any::<i8>(), any::<i8>()), 0..700)) {
            let (a, b): (Vec<i8>, Vec<i8>) = v.into_iter().unzip();
            let reference = dot_i8_scalar(&a, &b);
            prop_assert_eq!(dot_i8(&a, &b), reference);
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: AVX2 detected just above.
                    prop_assert_eq!(unsafe { x86::dot_i8_avx2(&a, &b) }, reference);
                }
                if std::arch::is_x86_feature_detected!("avx512bw") {
                    // SAFETY: AVX-512BW detected just above.
                    prop_assert_eq!(unsafe { x86::dot_i8_avx512(&a, &b) }, reference);
                }
            }
        }
    }

    #[test]
    fn float_dot_matches_reference() {
        let q: Vec<i8> = (0..1000).map(|i| ((i * 37) % 255 - 127) as i8).collect();
        let x: Vec<f32> = (0..1000)
            .map(|i| ((i * 13) % 17) as f32 * 0.25 - 2.0)
            .collect();
        let exact: f64 = q
            .iter()
            .zip(&x)
            .map(|(&a, &b)| (f64::from(a) - 1.5) * f64::from(b))
            .sum();
        for got in [dot_q_f32(&q, &x, 1.5), dot_q_f32_lanes(&q, &x, 1.5)] {
            assert!(
                (f64::from(got) - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                "{got} vs {exact}"
            );
        }
    }

    #[test]
    fn extremes_do_not_saturate() {
        let a = vec![-128i8; 4096];
        let b = vec![-128i8; 4096];
        assert_eq!(dot_i8(&a, &b), 4096 * 16384);
        assert_eq!(dot_i8_scalar(&a, &b), 4096 * 16384);
    }
}
