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

/// The kernel family every CPU kernel dispatches to: the best this CPU runs, capped by the
/// environment variable `MOEQ_CPU_ISA` (`scalar`, `avx2`, `avx512`, `avx512_vnni`) so that each
/// path can be tested and compared on one machine. A cap above the CPU's support is ignored.
pub fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("MOEQ_CPU_ISA").unwrap_or_default();
        let detected = detect();
        match cap.as_str() {
            "scalar" => Isa::Scalar,
            #[cfg(target_arch = "x86_64")]
            "avx2" if detected != Isa::Scalar => Isa::Avx2,
            #[cfg(target_arch = "x86_64")]
            "avx512" if matches!(detected, Isa::Avx512 | Isa::Avx512Vnni) => Isa::Avx512,
            _ => detected,
        }
    })
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
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
}

/// The name `MOEQ_CPU_ISA` and `cpu_features()` use for `isa`.
pub fn isa_name(isa: Isa) -> &'static str {
    match isa {
        Isa::Scalar => "scalar",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => "avx2",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => "avx512",
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => "avx512_vnni",
    }
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

/// `out[i] = (q[i] - z) * s` in f32: one group of a weight row dequantised (bit-identical on
/// every path: the conversion and subtraction are exact, the product is one IEEE rounding).
pub fn dequant_group(q: &[i8], z: f32, s: f32, out: &mut [f32]) {
    let n = q.len().min(out.len());
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        // SAFETY: AVX-512F detected by `isa()`; both slices cut to n.
        unsafe { x86::dequant_group_avx512(&q[..n], z, s, &mut out[..n]) };
        return;
    }
    for (o, &c) in out[..n].iter_mut().zip(&q[..n]) {
        *o = (f32::from(c) - z) * s;
    }
}

/// `max |x|`, ignoring NaN (as `f32::max` does).
pub fn amax(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        // SAFETY: AVX-512F detected by `isa()`.
        return unsafe { x86::amax_avx512(x) };
    }
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// `out[i] = (clamp(rne(x[i] / s), -128, 127) as i8) ^ 0x80`: int8 quantisation written as the
/// u8 operand of the VNNI kernels; NaN gives 0 and `s` not > 0 gives all zeros (u8 128), as in
/// [`super::linear::quantize_row_static`].
pub fn quantize_u8(x: &[f32], s: f32, out: &mut [u8]) {
    let n = x.len().min(out.len());
    let (x, out) = (&x[..n], &mut out[..n]);
    // Not `s <= 0.0`: a NaN scale quantises to zeros too.
    if s.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        out.fill(128);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        // SAFETY: AVX-512F and BW detected by `isa()`; both slices cut to the same length.
        unsafe { x86::quantize_u8_avx512(x, s, out) };
        return;
    }
    quantize_u8_scalar(x, s, out);
}

/// The scalar form of [`quantize_u8`] (for `s > 0`).
pub fn quantize_u8_scalar(x: &[f32], s: f32, out: &mut [u8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = ((v / s).round_ties_even().clamp(-128.0, 127.0) as i8 as u8) ^ 0x80;
    }
}

/// A register tile of fp32 dot products: `out[f][r] = Σ_i w[f * k + i] * x[r * k + i]` for
/// `f < nf`, `r < nr` (`nf, nr` in 1..=4), `k` terms each. Every weight load feeds `nr`
/// FMAs and every activation load `nf`.
pub fn dot_tile(w: &[f32], nf: usize, x: &[f32], nr: usize, k: usize) -> [[f32; 4]; 4] {
    let mut out = [[0f32; 4]; 4];
    if w.len() < nf * k || x.len() < nr * k || nf > 4 || nr > 4 {
        return [[f32::NAN; 4]; 4];
    }
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        // SAFETY: AVX-512F detected by `isa()`; `w` holds nf rows and `x` nr rows of k values
        // (checked above), which is each kernel's contract.
        unsafe {
            match (nf, nr) {
                (4, 4) => x86::dot_tile_avx512::<4, 4>(w, x, k, &mut out),
                (4, 1) => x86::dot_tile_avx512::<4, 1>(w, x, k, &mut out),
                (1, 4) => x86::dot_tile_avx512::<1, 4>(w, x, k, &mut out),
                _ => {
                    for f in 0..nf {
                        for r in 0..nr {
                            let mut one = [[0f32; 4]; 1];
                            x86::dot_tile_avx512::<1, 1>(
                                &w[f * k..(f + 1) * k],
                                &x[r * k..(r + 1) * k],
                                k,
                                &mut one,
                            );
                            out[f][r] = one[0][0];
                        }
                    }
                }
            }
        }
        return out;
    }
    for (f, o) in out.iter_mut().enumerate().take(nf) {
        for (r, v) in o.iter_mut().enumerate().take(nr) {
            *v = dot_f32(&w[f * k..(f + 1) * k], &x[r * k..(r + 1) * k]);
        }
    }
    out
}

/// `Σ w[i] * x[i]` in f32, 16 lanes.
#[inline]
pub fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni) {
        let n = w.len().min(x.len());
        let mut out = [[0f32; 4]; 1];
        // SAFETY: AVX-512F detected by `isa()`; one row of n values in each slice.
        unsafe { x86::dot_tile_avx512::<1, 1>(&w[..n], &x[..n], n, &mut out) };
        return out[0][0];
    }
    dot_f32_lanes(w, x)
}

/// The portable form of [`dot_f32`].
pub fn dot_f32_lanes(w: &[f32], x: &[f32]) -> f32 {
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

    /// # Safety
    /// The CPU must support AVX-512F; `q.len() == out.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dequant_group_avx512(q: &[i8], z: f32, s: f32, out: &mut [f32]) {
        let (vz, vs) = (_mm512_set1_ps(z), _mm512_set1_ps(s));
        let mut i = 0;
        while i + 16 <= q.len() {
            // SAFETY: i + 16 <= q.len() == out.len(): the 16-byte load and 64-byte store are in
            // bounds.
            unsafe {
                let c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    q.as_ptr().add(i).cast(),
                )));
                _mm512_storeu_ps(
                    out.as_mut_ptr().add(i),
                    _mm512_mul_ps(_mm512_sub_ps(c, vz), vs),
                );
            }
            i += 16;
        }
        for (o, &c) in out[i..].iter_mut().zip(&q[i..]) {
            *o = (f32::from(c) - z) * s;
        }
    }

    /// `out[f][r]` for `NF` weight rows and `NR` activation rows of `k` values.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `w.len() >= NF * k`, `x.len() >= NR * k`, `out.len() >= NF`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot_tile_avx512<const NF: usize, const NR: usize>(
        w: &[f32],
        x: &[f32],
        k: usize,
        out: &mut [[f32; 4]],
    ) {
        let mut acc = [[_mm512_setzero_ps(); NR]; NF];
        let mut i = 0;
        while i + 16 <= k {
            let mut xs = [_mm512_setzero_ps(); NR];
            for (r, v) in xs.iter_mut().enumerate() {
                // SAFETY: r < NR and i + 16 <= k: inside row r of `x`.
                *v = unsafe { _mm512_loadu_ps(x.as_ptr().add(r * k + i)) };
            }
            for (f, row) in acc.iter_mut().enumerate() {
                // SAFETY: f < NF and i + 16 <= k: inside row f of `w`.
                let vw = unsafe { _mm512_loadu_ps(w.as_ptr().add(f * k + i)) };
                for (a, &vx) in row.iter_mut().zip(&xs) {
                    *a = _mm512_fmadd_ps(vw, vx, *a);
                }
            }
            i += 16;
        }
        for (f, row) in acc.iter().enumerate() {
            for (r, a) in row.iter().enumerate() {
                let mut sum = _mm512_reduce_add_ps(*a);
                for j in i..k {
                    sum += w[f * k + j] * x[r * k + j];
                }
                out[f][r] = sum;
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn amax_avx512(x: &[f32]) -> f32 {
        let mut m = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: i + 16 <= x.len(): the 64-byte load is in bounds.
            let v = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
            // MAXPS returns its second operand when either is NaN, so NaN lanes keep `m`.
            m = _mm512_max_ps(_mm512_abs_ps(v), m);
            i += 16;
        }
        let mut best = _mm512_reduce_max_ps(m);
        for &v in &x[i..] {
            best = best.max(v.abs());
        }
        best
    }

    /// # Safety
    /// The CPU must support AVX-512F and BW; `x.len() == out.len()`; `s > 0`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_u8_avx512(x: &[f32], s: f32, out: &mut [u8]) {
        let vs = _mm512_set1_ps(s);
        let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
        let bias = _mm512_set1_epi32(128);
        let mut i = 0;
        while i + 16 <= x.len() {
            // SAFETY: i + 16 <= x.len() == out.len(): the 64-byte load and 16-byte store are in
            // bounds.
            unsafe {
                let q = _mm512_div_ps(_mm512_loadu_ps(x.as_ptr().add(i)), vs);
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(q, q);
                // Clamping first keeps the conversion in range; clamp and round commute here
                // because the bounds are integers.
                let q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
                let q = _mm512_mask_mov_ps(q, nan, _mm512_setzero_ps());
                let qi = _mm512_cvt_roundps_epi32::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(q);
                let u = _mm512_cvtepi32_epi8(_mm512_add_epi32(qi, bias));
                _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), u);
            }
            i += 16;
        }
        super::quantize_u8_scalar(&x[i..], s, &mut out[i..]);
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
    fn dot_tile_matches_exact_dots() {
        let k = 203;
        let w: Vec<f32> = (0..4 * k)
            .map(|i| ((i * 29) % 31) as f32 * 0.125 - 1.0)
            .collect();
        let x: Vec<f32> = (0..4 * k)
            .map(|i| ((i * 17) % 23) as f32 * 0.25 - 2.0)
            .collect();
        for (nf, nr) in [(4, 4), (4, 1), (1, 4), (1, 1), (3, 2), (2, 3)] {
            let got = dot_tile(&w, nf, &x, nr, k);
            for f in 0..nf {
                for r in 0..nr {
                    let exact: f64 = (0..k)
                        .map(|i| f64::from(w[f * k + i]) * f64::from(x[r * k + i]))
                        .sum();
                    let g = f64::from(got[f][r]);
                    assert!(
                        (g - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                        "{g} vs {exact}"
                    );
                }
            }
        }
        assert!(dot_tile(&w, 4, &x[..300], 4, k)[0][0].is_nan());
    }

    #[test]
    fn dequant_group_is_bit_exact() {
        let q: Vec<i8> = (0..=255u8).map(|v| v as i8).chain([3, -9, 127]).collect();
        for (z, s) in [(0.0f32, 0.013f32), (-8.0, 1.7e-3), (5.0, 3.0e4)] {
            let mut got = vec![0f32; q.len()];
            dequant_group(&q, z, s, &mut got);
            for (g, &c) in got.iter().zip(&q) {
                assert_eq!(g.to_bits(), ((f32::from(c) - z) * s).to_bits());
            }
        }
    }

    #[test]
    fn quantize_matches_reference() {
        let mut x: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 2001) as f32 / 7.0 - 140.0)
            .collect();
        x[5] = f32::NAN;
        x[17] = f32::INFINITY;
        x[18] = f32::NEG_INFINITY;
        x[40] = 0.5; // ties round to even
        x[41] = 1.5;
        x[42] = -2.5;
        for s in [1.0f32, 0.37, 1e-30, 1e30, 0.0, -1.0, f32::INFINITY] {
            let mut want = vec![0i8; x.len()];
            super::super::linear::quantize_row_static(&x, s, &mut want);
            let mut got = vec![0u8; x.len()];
            quantize_u8(&x, s, &mut got);
            let want: Vec<u8> = want.iter().map(|&v| (v as u8) ^ 0x80).collect();
            assert_eq!(got, want, "s = {s}");
        }
        let reference = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(amax(&x).to_bits(), reference.to_bits());
        assert_eq!(
            amax(&x[19..30]),
            x[19..30].iter().fold(0f32, |m, v| m.max(v.abs()))
        );
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
