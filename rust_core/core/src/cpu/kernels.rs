//! Runtime kernel dispatch ([`isa`], capped by `MOEQ_CPU_ISA`), activation quantisation and the
//! fp32 dot product of unquantized layers. The GEMM kernels live in [`super::packed`] (int8)
//! and [`super::wo`] (weight-only); every SIMD path has a scalar reference it equals.

/// The kernel family of this CPU.
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
    /// aarch64 NEON (always present there): widening `smull` int8 products.
    #[cfg(target_arch = "aarch64")]
    Neon,
}

/// The kernel family every CPU kernel dispatches to: the best this CPU runs, capped by the
/// environment variable `MOEQ_CPU_ISA` (`scalar`, `avx2`, `avx512`, `avx512_vnni`, `neon`) so that each
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
    #[cfg(target_arch = "aarch64")]
    {
        return Isa::Neon;
    }
    #[allow(unreachable_code)]
    Isa::Scalar
}

impl Isa {
    /// The NEON int8 tile applies.
    pub fn neon(self) -> bool {
        #[cfg(target_arch = "aarch64")]
        {
            self == Isa::Neon
        }
        #[cfg(not(target_arch = "aarch64"))]
        {
            false
        }
    }
    /// The AVX-512 VNNI int8 kernels apply.
    pub fn vnni(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self == Isa::Avx512Vnni
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX-512F (fp32) kernels apply.
    pub fn avx512(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx512 | Isa::Avx512Vnni)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    /// The AVX2 int8 tile applies (no VNNI).
    pub fn avx2_int8(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self, Isa::Avx2 | Isa::Avx512)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
}

/// The bf16 dot-product kernels (AVX512-BF16 `vdpbf16ps`) apply: the CPU has them and
/// `MOEQ_CPU_ISA` leaves AVX-512 on. `MOEQ_CPU_BF16=0` switches them off, so weight-only layers
/// with bf16 inputs compute in fp32 as with any other input.
pub fn bf16_dot() -> bool {
    static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *BF16.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            isa().avx512()
                && std::arch::is_x86_feature_detected!("avx512bf16")
                && std::env::var("MOEQ_CPU_BF16").map_or(true, |v| v.trim() != "0")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
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
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => "neon",
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let w: Vec<f32> = (0..1003).map(|i| ((i * 37) % 255) as f32 - 127.0).collect();
        let x: Vec<f32> = (0..1003)
            .map(|i| ((i * 13) % 17) as f32 * 0.25 - 2.0)
            .collect();
        let exact: f64 = w
            .iter()
            .zip(&x)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        for got in [dot_f32(&w, &x), dot_f32_lanes(&w, &x)] {
            assert!(
                (f64::from(got) - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                "{got} vs {exact}"
            );
        }
    }
}
