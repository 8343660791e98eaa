//! int8 weight-only codes on the u8 x i8 dot-product instruction (`vpdpbusd`) for bf16
//! activations in few rows (decode). There the fp32 tile is bound by converting every code to
//! fp32 (three instructions per 16 codes, ~29 GMAC/s per Zen 4 core, slower than memory
//! delivers the codes); here a 64-byte line of codes is one byte permute and three dot products.
//!
//! Exactness: a bf16 value has an 8-bit significand, so within a chunk of up to [`CHUNK`]
//! columns a row's values are integers times one power of two, `x = a * 2^-sh`, `|a| < 2^22`,
//! `sh` chosen from the chunk's largest magnitude. That is exact for every value within 14
//! binades of the largest; smaller ones round to the nearest multiple of 2^-22 of it, below
//! fp32's own rounding of the chunk's sum. `a` is written in three signed base-256 digits,
//! `a = d0 + 256 d1 + 65536 d2` (`-128 <= d < 128`), each digit broadcast as the s8 operand of
//! `vpdpbusd` against the codes as u8 (`q + 128`, one xor), so with `D` a digit's sum over the
//! chunk, `Σ a q = (r0 + 256 r1) + 65536 r2` where `r = Σ d (q + 128) - 128 D`: exact in int32
//! within a chunk (`|Σ (d0 + 256 d1) q| <= 32896 * 128 * CHUNK`), then in f64, times `2^-sh`.
//! A group's chunks add in f64, rounded once to f32; then the fp32 path's epilogue:
//! `acc -= z * Σx`, `y += acc * s` (fused). So a group's dot product carries one rounding where
//! the fp32 tile carries one per column. Inputs are rounded to bf16 first (the bf16 path's
//! [`to_bf16`]), as that path does for the intermediate `silu(gate) * up`; rows holding a
//! non-finite value or a nonzero chunk below 2^-100 take the fp32 tile instead
//! ([`BlockedWo::fixed_rows_from`] gives `None`).
//!
//! Layout: the codes are the blocks' own (`[k][16]` bytes per block, so one 64-byte line is 4
//! columns of 16 features); `vpermb` turns it into `vpdpbusd`'s order (4 columns per feature).
//! Inputs: `[m][k / 4][3]` u32, per quad of columns the digit `j` of its four `a` in word `j`,
//! each broadcast from memory as one `vpdpbusd` operand. [`block_scalar`] repeats the
//! arithmetic exactly.

use super::bf16::to_bf16;
use super::{BlockedWo, Codes, BLOCK};

/// Columns per fixed-point chunk: `32896 * 128 * CHUNK` (the low digits' int32 sum, see the
/// module docs) must stay below 2^31.
pub const CHUNK: usize = 128;
/// Rows one pass of the kernel runs (its accumulators: 3 digits per row, with 4 partial sums
/// each at one row to cover the dot product's latency).
const PASS_ROWS: usize = 2;
/// How far ahead (bytes) the weight stream is prefetched, a line per quad, as the W8A8 decode
/// stream does (the blocks of a layer are one run, so this crosses into the next block; a
/// second prefetch of the next block's line, as the fp32 tile issues, measured alike).
#[cfg(target_arch = "x86_64")]
const PF_DIST: usize = 4096;

const _: () = assert!(32896 * 128 * CHUNK < (1 << 31));

/// A chunk of columns: `start..end` inside group `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
    pub group: usize,
}

/// The chunks of `k` columns grouped at `group_starts` (each group cut every [`CHUNK`]
/// columns), when every group start and `k` are multiples of 4 (a quad never straddles a
/// chunk); `None` otherwise.
pub fn chunks(k: usize, group_starts: &[usize]) -> Option<Vec<Chunk>> {
    if !k.is_multiple_of(4) || k == 0 || group_starts.iter().any(|g| !g.is_multiple_of(4)) {
        return None;
    }
    let groups = group_starts.len().max(1);
    let mut out = Vec::new();
    for g in 0..groups {
        let a = group_starts.get(g).copied().unwrap_or(0);
        let e = group_starts.get(g + 1).copied().unwrap_or(k).min(k);
        let mut s = a;
        while s < e {
            let end = (s + CHUNK).min(e);
            out.push(Chunk {
                start: s,
                end,
                group: g,
            });
            s = end;
        }
    }
    Some(out)
}

/// A weight-only layer's input rows in fixed point (see the module docs).
pub struct FixedRows {
    /// `[m][k / 4][3]` u32 as little-endian bytes: per quad, digits 0, 1 and 2 (i8).
    pub planes: Vec<u8>,
    /// `[m][chunks][2]`: `128 (D0 + 256 D1)` and `128 D2`, the terms that take the `+ 128` of
    /// the codes back out.
    pub comp: Vec<i32>,
    /// `[m][chunks]`: `2^-sh`, the value of one unit of `a`.
    pub unit: Vec<f32>,
    /// `[m][groups]`: `Σx` of the bf16 inputs per group (layers with zero points only).
    pub sums: Vec<f32>,
    pub rows: usize,
}

/// Bytes of one row's planes.
fn row_bytes(k: usize) -> usize {
    (k / 4) * 12
}

/// `a` (`|a| <= 2^22`) in signed base-256 digits, least significant first.
fn digits(a: i32) -> [i8; 3] {
    let d0 = a as i8;
    let a1 = (a - i32::from(d0)) >> 8;
    let d1 = a1 as i8;
    [d0, d1, ((a1 - i32::from(d1)) >> 8) as i8]
}

/// One row's inputs (`perm` order) rounded to bf16 into `v`; false if one is not finite.
fn round_row(xr: &[f32], perm: Option<&[u32]>, v: &mut [f32]) -> bool {
    let k = v.len();
    for (c, d) in v.iter_mut().enumerate() {
        let x = match perm {
            Some(p) => xr[p.get(c).map_or(c, |&i| i as usize).min(k - 1)],
            None => xr[c],
        };
        *d = f32::from_bits(u32::from(to_bf16(x)) << 16);
    }
    v.iter().all(|x| x.is_finite())
}

/// The chunk's shift: `2^sh` scales its largest magnitude `mx` below 2^22 (`None` for a
/// nonzero `mx` below 2^-100).
fn shift(mx: f32) -> Option<i32> {
    if mx == 0.0 {
        return Some(0);
    }
    // mx < 2^e: its binary exponent + 1.
    let e = ((mx.to_bits() >> 23) & 0xff) as i32 - 126;
    (e >= -100).then_some(22 - e)
}

/// One row of bf16 values `v` into its digits (`dst`), compensation terms (`comp`) and units
/// (`unit`), chunk by chunk; false where [`shift`] refuses a chunk.
fn digits_row(
    v: &[f32],
    chunks: &[Chunk],
    dst: &mut [u8],
    comp: &mut [i32],
    unit: &mut [f32],
) -> bool {
    for (ci, ch) in chunks.iter().enumerate() {
        let vals = &v[ch.start..ch.end];
        let Some(sh) = shift(vals.iter().fold(0f32, |a, x| a.max(x.abs()))) else {
            return false;
        };
        unit[ci] = pow2(-sh);
        let p = pow2(sh);
        let mut dsum = [0i32; 3];
        for (q, quad) in vals.chunks_exact(4).enumerate() {
            let at = ((ch.start / 4) + q) * 12;
            for (j, &x) in quad.iter().enumerate() {
                // Exact for bf16 values within 14 binades of the largest; the clamp never
                // acts on them (|a| < 2^22).
                let a = ((x * p).round_ties_even() as i32).clamp(-(1 << 22), (1 << 22) - 1);
                for (i, d) in digits(a).into_iter().enumerate() {
                    dst[at + 4 * i + j] = d as u8;
                    dsum[i] += i32::from(d);
                }
            }
        }
        comp[ci * 2] = 128 * (dsum[0] + 256 * dsum[1]);
        comp[ci * 2 + 1] = 128 * dsum[2];
    }
    true
}

/// `2^e` as f32 (`-126 <= e <= 127`).
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

impl BlockedWo {
    /// Whether this layer can take [`FixedRows`]: int8 codes with whole quads per group.
    pub fn fixed_ok(&self) -> bool {
        matches!(self.codes, Codes::I8(_)) && !self.chunks.is_empty()
    }

    /// Rows `0..m` (`row(r)`, in the checkpoint's column order; `perm` gathers act-order
    /// layers into the sorted order) as [`FixedRows`], or `None` where a row holds a
    /// non-finite value or a nonzero chunk below 2^-100 (those take the fp32 tile).
    pub fn fixed_rows_from<'a>(
        &self,
        m: usize,
        row: impl Fn(usize) -> &'a [f32],
        perm: Option<&[u32]>,
    ) -> Option<FixedRows> {
        self.fixed_rows_with(m, row, perm, fixed_dot())
    }

    /// [`BlockedWo::fixed_rows_from`], by the SIMD conversion or the scalar one (equal).
    pub fn fixed_rows_with<'a>(
        &self,
        m: usize,
        row: impl Fn(usize) -> &'a [f32],
        perm: Option<&[u32]>,
        simd: bool,
    ) -> Option<FixedRows> {
        use super::super::spare;
        if !self.fixed_ok() {
            return None;
        }
        let (k, nch, groups) = (self.k, self.chunks.len(), self.groups());
        let rb = row_bytes(k);
        let mut planes = spare::take_any(m * rb, 0u8);
        let mut comp = spare::take_any(m * nch * 2, 0i32);
        let mut unit = spare::take_any(m * nch, 0f32);
        let mut sums = spare::take_any(if self.asym { m * groups } else { 0 }, 0f32);
        let mut v = spare::take_any(k, 0f32);
        let mut ok = true;
        for r in 0..m {
            let xr = row(r);
            let (dst, cc, un) = (
                &mut planes[r * rb..(r + 1) * rb],
                &mut comp[r * nch * 2..(r + 1) * nch * 2],
                &mut unit[r * nch..(r + 1) * nch],
            );
            ok = xr.len() >= k
                && match (simd, perm) {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `simd` only where `fixed_dot()` detected the features (the
                    // caller's word); xr and v hold k values.
                    (true, None) => unsafe { x86::round_row(&xr[..k], &mut v) },
                    _ => round_row(xr, perm, &mut v),
                }
                && match simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above; the chunks are whole quads inside 0..k, dst holds the
                    // row's k / 4 quads, cc and un its chunks.
                    true => unsafe { x86::digits_row(&v, &self.chunks, dst, cc, un) },
                    _ => digits_row(&v, &self.chunks, dst, cc, un),
                };
            if !ok {
                break;
            }
            if self.asym {
                for g in 0..groups {
                    let (a, e) = self.bounds(g);
                    sums[r * groups + g] = v[a..e.min(k)].iter().sum();
                }
            }
        }
        spare::give(v);
        if !ok {
            spare::give(planes);
            spare::give(comp);
            spare::give(unit);
            spare::give(sums);
            return None;
        }
        Some(FixedRows {
            planes,
            comp,
            unit,
            sums,
            rows: m,
        })
    }

    /// `y[r, 16 b + l]` for the rows of `x` and blocks `first_block..first_block + nblocks`:
    /// calls `emit(row, block, &lanes)`.
    pub fn gemm_fixed(
        &self,
        x: &FixedRows,
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
    ) {
        let end = (first_block + nblocks).min(self.blocks());
        let m = x.rows;
        let rb = row_bytes(self.k);
        let nch = self.chunks.len();
        if !self.fixed_ok()
            || x.planes.len() < m * rb
            || x.unit.len() < m * nch
            || x.comp.len() < m * nch * 2
            || (self.asym && x.sums.len() < m * self.groups())
        {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let simd = fixed_dot();
        for b in first_block..end {
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(PASS_ROWS);
                let mut out = [[0f32; BLOCK]; PASS_ROWS];
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: `fixed_dot()` detected AVX-512F/BW/VNNI/VBMI; b < blocks; the
                    // checks above give `x` rows r..r + mr of planes, digit sums, units and
                    // group sums.
                    unsafe {
                        if mr == 2 {
                            x86::block::<2, 1>(self, b, x, r, &mut out);
                        } else {
                            x86::block::<1, 4>(self, b, x, r, &mut out);
                        }
                    }
                } else {
                    block_scalar(self, b, x, r, mr, &mut out);
                }
                #[cfg(not(target_arch = "x86_64"))]
                block_scalar(self, b, x, r, mr, &mut out);
                for (rr, lanes) in out.iter().enumerate().take(mr) {
                    emit(r + rr, b, lanes);
                }
                r += mr;
            }
        }
    }
}

/// Whether the fixed-point kernel runs: AVX-512 VNNI and VBMI (`vpermb`), and the bf16 paths
/// not switched off (`MOEQ_CPU_BF16=0` keeps weight-only layers in fp32 for bf16 inputs).
pub fn fixed_dot() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            super::isa().vnni()
                && std::arch::is_x86_feature_detected!("avx512vbmi")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::env::var("MOEQ_CPU_BF16").map_or(true, |v| v.trim() != "0")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// One group's f64 sum rounded, then the zero-point term and the scale (the SIMD epilogue's
/// fused operations).
#[inline]
fn finish(acc: f64, z: Option<f32>, sum: f32, s: f32, y: f32) -> f32 {
    let mut a = acc as f32;
    if let Some(z) = z {
        a = (-z).mul_add(sum, a);
    }
    a.mul_add(s, y)
}

/// The scalar reference of one block for rows `r0..r0 + mr`: the SIMD kernel's integers, f64
/// sums and fused f32 operations, in its order.
pub fn block_scalar(
    w: &BlockedWo,
    b: usize,
    x: &FixedRows,
    r0: usize,
    mr: usize,
    out: &mut [[f32; BLOCK]; PASS_ROWS],
) {
    let (k, groups, nch) = (w.k, w.groups(), w.chunks.len());
    let t = w.tile(b);
    let rb = row_bytes(k);
    for (rr, o) in out.iter_mut().enumerate().take(mr) {
        let r = r0 + rr;
        let planes = &x.planes[r * rb..(r + 1) * rb];
        for (l, y) in o.iter_mut().enumerate() {
            let mut total = 0f32;
            let mut acc = 0f64;
            for (ci, ch) in w.chunks.iter().enumerate() {
                let mut sums = [0i64; 3];
                for c in ch.start..ch.end {
                    let u = i64::from(w.codes.get(t.codes, c, l) as u8 ^ 0x80);
                    for (p, s) in sums.iter_mut().enumerate() {
                        *s += i64::from(planes[(c / 4) * 12 + 4 * p + c % 4] as i8) * u;
                    }
                }
                let cc = &x.comp[(r * nch + ci) * 2..(r * nch + ci) * 2 + 2];
                let lo = (sums[0] + 256 * sums[1] - i64::from(cc[0])) as i32;
                let hi = (sums[2] - i64::from(cc[1])) as i32;
                let dot =
                    f64::from(hi).mul_add(65536.0, f64::from(lo)) * f64::from(x.unit[r * nch + ci]);
                acc += dot;
                let last = w.chunks.get(ci + 1).is_none_or(|n| n.group != ch.group);
                if last {
                    let g = ch.group;
                    let z = t.zp.filter(|_| w.asym).map(|z| z[g * BLOCK + l]);
                    let sum = if w.asym { x.sums[r * groups + g] } else { 0.0 };
                    total = finish(acc, z, sum, t.scale[g * BLOCK + l], total);
                    acc = 0.0;
                }
            }
            *y = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{pow2, row_bytes, shift, BlockedWo, Chunk, FixedRows, BLOCK, PASS_ROWS, PF_DIST};
    use std::arch::x86_64::*;

    /// Lanes `0..n` of 16.
    fn mask16(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// [`super::round_row`] without a permutation: the same integer rounding (ties to even,
    /// subnormal results to zero), 16 values a step.
    ///
    /// # Safety
    /// AVX-512F; `v.len() >= x.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn round_row(x: &[f32], v: &mut [f32]) -> bool {
        let (exp, sign) = (_mm512_set1_epi32(0x7f80_0000), _mm512_set1_epi32(i32::MIN));
        let (half, one, top) = (
            _mm512_set1_epi32(0x7fff),
            _mm512_set1_epi32(1),
            _mm512_set1_epi32(0xffff_0000u32 as i32),
        );
        let mut bad: __mmask16 = 0;
        for c in (0..x.len()).step_by(16) {
            let mk = mask16(x.len() - c);
            // SAFETY: lanes c..c + 16 masked to the slices' length.
            let b = unsafe { _mm512_maskz_loadu_epi32(mk, x.as_ptr().add(c).cast()) };
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), one);
            let r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(half, odd)), top);
            let e = _mm512_and_si512(r, exp);
            bad |= _mm512_cmpeq_epi32_mask(e, exp);
            let sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
            let r = _mm512_mask_and_epi32(r, sub, r, sign);
            // SAFETY: as the load.
            unsafe { _mm512_mask_storeu_epi32(v.as_mut_ptr().add(c).cast(), mk, r) };
        }
        bad == 0
    }

    /// Output byte `12 q + 4 j + i` of 4 quads is byte `j` of column `4 q + i`'s dword.
    const fn pack_index() -> [u8; 64] {
        let mut idx = [0u8; 64];
        let mut o = 0;
        while o < 48 {
            let (q, j, i) = (o / 12, (o % 12) / 4, o % 4);
            idx[o] = (4 * (4 * q + i) + j) as u8;
            o += 1;
        }
        idx
    }
    static PACK: [u8; 64] = pack_index();

    /// [`super::digits_row`], 16 columns a step: the digits are the bytes of
    /// `(a + 0x808080) ^ 0x808080` (each byte's `+ 128` absorbs the borrows of the signed
    /// digits), gathered into quads by one `vpermb`.
    ///
    /// # Safety
    /// AVX-512F, BW and VBMI; the chunks are whole quads inside `0..v.len()`, `dst` holds
    /// `v.len() / 4 * 12` bytes, `comp` 2 and `unit` 1 per chunk.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub unsafe fn digits_row(
        v: &[f32],
        chunks: &[Chunk],
        dst: &mut [u8],
        comp: &mut [i32],
        unit: &mut [f32],
    ) -> bool {
        // SAFETY: 64 readable bytes.
        let pack = unsafe { _mm512_loadu_si512(PACK.as_ptr().cast()) };
        let (bias, low16, lo_off, hi_off) = (
            _mm512_set1_epi32(0x0080_8080),
            _mm512_set1_epi32(0xffff),
            _mm512_set1_epi32(0x8080),
            _mm512_set1_epi32(128),
        );
        let (amin, amax) = (
            _mm512_set1_epi32(-(1 << 22)),
            _mm512_set1_epi32((1 << 22) - 1),
        );
        for (ci, ch) in chunks.iter().enumerate() {
            let mut mx = _mm512_setzero_ps();
            for c in (ch.start..ch.end).step_by(16) {
                // SAFETY: lanes masked to the chunk, inside v.
                let x = unsafe { _mm512_maskz_loadu_ps(mask16(ch.end - c), v.as_ptr().add(c)) };
                mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
            }
            let Some(sh) = shift(_mm512_reduce_max_ps(mx)) else {
                return false;
            };
            unit[ci] = pow2(-sh);
            let p = _mm512_set1_ps(pow2(sh));
            let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for c in (ch.start..ch.end).step_by(16) {
                let n = (ch.end - c).min(16);
                // SAFETY: as above. Masked lanes are 0: digits of 0, which add nothing.
                let x = unsafe { _mm512_maskz_loadu_ps(mask16(n), v.as_ptr().add(c)) };
                // Exact products; the conversion rounds to nearest even (the default mode).
                let a = _mm512_min_epi32(
                    _mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x, p)), amin),
                    amax,
                );
                let t = _mm512_add_epi32(a, bias);
                lo = _mm512_add_epi32(lo, _mm512_sub_epi32(_mm512_and_si512(t, low16), lo_off));
                hi = _mm512_add_epi32(hi, _mm512_sub_epi32(_mm512_srli_epi32::<16>(t), hi_off));
                let d = _mm512_permutexvar_epi8(pack, _mm512_xor_si512(t, bias));
                let bytes = (n / 4) * 12;
                // SAFETY: quads c / 4.. (n / 4 of them) lie inside dst.
                unsafe {
                    _mm512_mask_storeu_epi8(
                        dst.as_mut_ptr().add((c / 4) * 12).cast(),
                        (1u64 << bytes) - 1,
                        d,
                    )
                };
            }
            comp[ci * 2] = 128 * _mm512_reduce_add_epi32(lo);
            comp[ci * 2 + 1] = 128 * _mm512_reduce_add_epi32(hi);
        }
        true
    }

    /// `vpermb` indices: output byte `4 l + j` is input byte `16 j + l` (column `j` of the
    /// quad, feature `l`).
    const fn transpose_index() -> [u8; 64] {
        let mut idx = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            idx[i] = (16 * (i % 4) + i / 4) as u8;
            i += 1;
        }
        idx
    }
    static TRANSPOSE: [u8; 64] = transpose_index();

    /// Rows `r0..r0 + MR` of block `b` into `out` (`U` interleaved partial sums per plane).
    ///
    /// # Safety
    /// AVX-512F, BW, VNNI and VBMI; `b < w.blocks()`; `x` holds rows `r0..r0 + MR` of planes,
    /// digit sums, units and (with zero points) group sums; `w.chunks`
    /// are whole quads inside `0..k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn block<const MR: usize, const U: usize>(
        w: &BlockedWo,
        b: usize,
        x: &FixedRows,
        r0: usize,
        out: &mut [[f32; BLOCK]; PASS_ROWS],
    ) {
        let (k, groups, nch) = (w.k, w.groups(), w.chunks.len());
        let t = w.tile(b);
        let cp = t.codes.as_ptr();
        let rb = row_bytes(k);
        // SAFETY: 64 readable bytes.
        let idx = unsafe { _mm512_loadu_si512(TRANSPOSE.as_ptr().cast()) };
        // Codes as u8: q + 128.
        let flip = _mm512_set1_epi8(-128);
        let rows: [*const u8; MR] = std::array::from_fn(|rr| x.planes[(r0 + rr) * rb..].as_ptr());
        let mut total = [_mm512_setzero_ps(); MR];
        let mut acc = [[_mm512_setzero_pd(); 2]; MR];
        for (ci, ch) in w.chunks.iter().enumerate() {
            let mut parts = [[[_mm512_setzero_si512(); U]; 3]; MR];
            let (q0, q1) = (ch.start / 4, ch.end / 4);
            let mut step = |q: usize, u: usize| {
                let at = q * 64;
                // The addresses are formed with wrapping_add; a prefetch never faults.
                _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(at + PF_DIST).cast());
                // SAFETY: quad q < k / 4 lies inside the block's k * 16 bytes.
                let wq = unsafe { _mm512_loadu_si512(cp.add(at).cast()) };
                let wt = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, wq), flip);
                for (rr, row) in rows.iter().enumerate() {
                    for (p, part) in parts[rr].iter_mut().enumerate() {
                        // SAFETY: quad q's plane p lies inside the row's k / 4 * 12 bytes
                        // (the caller's contract on `x`).
                        let v = unsafe { row.add(q * 12 + 4 * p).cast::<i32>().read_unaligned() };
                        part[u] = _mm512_dpbusd_epi32(part[u], wt, _mm512_set1_epi32(v));
                    }
                }
            };
            let mut q = q0;
            while q + U <= q1 {
                for u in 0..U {
                    step(q + u, u);
                }
                q += U;
            }
            while q < q1 {
                step(q, 0);
                q += 1;
            }
            let last = w.chunks.get(ci + 1).is_none_or(|n| n.group != ch.group);
            for rr in 0..MR {
                let r = r0 + rr;
                let sum_of = |p: usize| {
                    let mut s = parts[rr][p][0];
                    for part in &parts[rr][p][1..] {
                        s = _mm512_add_epi32(s, *part);
                    }
                    s
                };
                let cc = (r * nch + ci) * 2;
                // Wrapping int32: the true values fit (see the module docs).
                let lo = _mm512_sub_epi32(
                    _mm512_add_epi32(sum_of(0), _mm512_slli_epi32::<8>(sum_of(1))),
                    _mm512_set1_epi32(x.comp[cc]),
                );
                let hi = _mm512_sub_epi32(sum_of(2), _mm512_set1_epi32(x.comp[cc + 1]));
                let unit = _mm512_set1_pd(f64::from(x.unit[r * nch + ci]));
                let scale16 = _mm512_set1_pd(65536.0);
                let halves = [
                    (_mm512_castsi512_si256(hi), _mm512_castsi512_si256(lo)),
                    (
                        _mm512_extracti64x4_epi64::<1>(hi),
                        _mm512_extracti64x4_epi64::<1>(lo),
                    ),
                ];
                for (h, (hv, lv)) in halves.into_iter().enumerate() {
                    let dot = _mm512_mul_pd(
                        _mm512_fmadd_pd(_mm512_cvtepi32_pd(hv), scale16, _mm512_cvtepi32_pd(lv)),
                        unit,
                    );
                    acc[rr][h] = _mm512_add_pd(acc[rr][h], dot);
                }
                if last {
                    let g = ch.group;
                    let lo32 = _mm512_cvtpd_ps(acc[rr][0]);
                    let hi32 = _mm512_cvtpd_ps(acc[rr][1]);
                    let mut a = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(_mm256_castps_pd(lo32)),
                        _mm256_castps_pd(hi32),
                    ));
                    if let Some(z) = t.zp.filter(|_| w.asym) {
                        // SAFETY: an asymmetric layer keeps groups x 16 zero points per block.
                        let zv = unsafe { _mm512_loadu_ps(z.as_ptr().add(g * BLOCK)) };
                        a = _mm512_fnmadd_ps(zv, _mm512_set1_ps(x.sums[r * groups + g]), a);
                    }
                    // SAFETY: the tile holds groups x 16 scales.
                    let s = unsafe { _mm512_loadu_ps(t.scale.as_ptr().add(g * BLOCK)) };
                    total[rr] = _mm512_fmadd_ps(a, s, total[rr]);
                    acc[rr] = [_mm512_setzero_pd(); 2];
                }
            }
        }
        for (rr, v) in total.iter().enumerate() {
            // SAFETY: rr < MR <= PASS_ROWS; each entry is 16 f32.
            unsafe { _mm512_storeu_ps(out[rr].as_mut_ptr(), *v) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (xorshift).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        /// A bf16 value of either sign with a binary exponent in `lo..hi`.
        fn bf16(&mut self, lo: i32, hi: i32) -> f32 {
            let e = lo + self.below((hi - lo) as u64) as i32;
            let m = 128 + self.below(128) as u32;
            let v = m as f32 * pow2(e - 7);
            if self.below(2) == 0 {
                -v
            } else {
                v
            }
        }
    }

    /// A layer of `n x k` int8 codes in groups of `group` (`k` for channelwise), with zero
    /// points when `asym`.
    fn layer(
        rng: &mut Rng,
        n: usize,
        k: usize,
        group: usize,
        asym: bool,
    ) -> (BlockedWo, Vec<i8>, Vec<f32>, Vec<i8>) {
        let groups = k / group;
        let q: Vec<i8> = (0..n * k).map(|_| rng.next() as i8).collect();
        let scale: Vec<f32> = (0..n * groups)
            .map(|_| f32::from_bits((0x3a00_0000 + rng.below(1 << 22) as u32) & 0xffff_0000))
            .collect();
        let zp: Vec<i8> = (0..n * groups)
            .map(|_| rng.below(256) as u8 as i8)
            .collect();
        let starts = (0..groups).map(|g| g * group).collect();
        let w = BlockedWo::new(n, k, &q, &scale, asym.then_some(&zp[..]), starts);
        (w, q, scale, zp)
    }

    #[test]
    fn digits_rebuild_every_value_in_range() {
        for a in (-(1 << 22)..(1 << 22)).step_by(997).chain([
            -(1 << 22),
            (1 << 22) - 1,
            -1,
            0,
            1,
            127,
            128,
            -128,
            -129,
        ]) {
            let d = digits(a);
            let back = i32::from(d[0]) + 256 * i32::from(d[1]) + 65536 * i32::from(d[2]);
            assert_eq!(back, a);
        }
    }

    /// Where every input of a chunk is within 14 binades of its largest, a group's dot product
    /// is exact before its one rounding: the output equals an f64 reference bit for bit, by
    /// the SIMD kernel (where the CPU has it) and the scalar one; the SIMD conversion of the
    /// inputs equals the scalar one byte for byte.
    #[test]
    fn fixed_point_equals_the_exact_sums_rounded_once() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for (n, k, group, asym, m) in [
            (16, 128, 128, false, 1),
            (40, 256, 128, false, 2),
            (33, 512, 64, true, 3),
            (20, 320, 32, false, 5),
            (17, 384, 384, true, 1),
            (48, 1024, 1024, false, 2),
            (16, 68, 68, false, 1),
        ] {
            let (w, q, scale, zp) = layer(&mut rng, n, k, group, asym);
            assert!(w.fixed_ok());
            let groups = k / group;
            // Each chunk's inputs within 14 binades of one another (a chunk may be all zero).
            let x: Vec<f32> = (0..m * k)
                .map(|i| {
                    let base = ((i / CHUNK) % 7) as i32 * 9 - 30;
                    if rng.below(9) == 0 {
                        0.0
                    } else {
                        rng.bf16(base - 13, base + 1)
                    }
                })
                .collect();
            let row = |r: usize| &x[r * k..(r + 1) * k];
            let scalar = w
                .fixed_rows_with(m, row, None, false)
                .expect("finite inputs");
            if fixed_dot() {
                let simd = w
                    .fixed_rows_with(m, row, None, true)
                    .expect("finite inputs");
                assert_eq!(simd.planes, scalar.planes, "n={n} k={k}");
                assert_eq!(simd.comp, scalar.comp);
                assert_eq!(simd.unit, scalar.unit);
                assert_eq!(simd.sums, scalar.sums);
            }
            let mut got = vec![f32::NAN; m * n];
            w.gemm_fixed(&scalar, 0, w.blocks(), |r, b, lanes| {
                for (l, &v) in lanes.iter().enumerate() {
                    if 16 * b + l < n {
                        got[r * n + 16 * b + l] = v;
                    }
                }
            });
            for r in 0..m {
                for j in 0..n {
                    let mut y = 0f32;
                    for g in 0..groups {
                        let cols = g * group..(g + 1) * group;
                        let exact: f64 = cols
                            .clone()
                            .map(|c| f64::from(q[j * k + c]) * f64::from(x[r * k + c]))
                            .sum();
                        let mut a = exact as f32;
                        if asym {
                            let sum: f32 =
                                x[r * k + g * group..r * k + (g + 1) * group].iter().sum();
                            a = (-f32::from(zp[j * groups + g])).mul_add(sum, a);
                        }
                        y = a.mul_add(scale[j * groups + g], y);
                    }
                    assert_eq!(
                        got[r * n + j].to_bits(),
                        y.to_bits(),
                        "n={n} k={k} g={group} r={r} j={j}"
                    );
                }
            }
            // The scalar reference of every block agrees with what gemm_fixed gave.
            for b in 0..w.blocks() {
                for r in (0..m).step_by(PASS_ROWS) {
                    let mut out = [[0f32; BLOCK]; PASS_ROWS];
                    let mr = (m - r).min(PASS_ROWS);
                    block_scalar(&w, b, &scalar, r, mr, &mut out);
                    for rr in 0..mr {
                        for l in 0..BLOCK.min(n - 16 * b) {
                            assert_eq!(
                                out[rr][l].to_bits(),
                                got[(r + rr) * n + 16 * b + l].to_bits()
                            );
                        }
                    }
                }
            }
        }
    }

    /// Inputs spread over more binades than the fixed point holds lose only below 2^-22 of
    /// their chunk's largest: close to the f64 sums; SIMD and scalar still agree exactly.
    #[test]
    fn wide_inputs_stay_close_and_paths_agree() {
        let mut rng = Rng(12345);
        let (n, k, group, m) = (48, 512, 128, 2);
        let (w, q, scale, _) = layer(&mut rng, n, k, group, false);
        let x: Vec<f32> = (0..m * k).map(|_| rng.bf16(-60, 20)).collect();
        let row = |r: usize| &x[r * k..(r + 1) * k];
        let fx = w.fixed_rows_with(m, row, None, false).expect("finite");
        if fixed_dot() {
            let simd = w.fixed_rows_with(m, row, None, true).expect("finite");
            assert_eq!(simd.planes, fx.planes);
            assert_eq!(simd.comp, fx.comp);
        }
        let mut got = vec![f32::NAN; m * n];
        w.gemm_fixed(&fx, 0, w.blocks(), |r, b, lanes| {
            got[r * n + 16 * b..r * n + 16 * b + 16].copy_from_slice(lanes)
        });
        for r in 0..m {
            for j in 0..n {
                let (mut want, mut mag) = (0f64, 0f64);
                for c in 0..k {
                    let t = f64::from(q[j * k + c])
                        * f64::from(x[r * k + c])
                        * f64::from(scale[j * (k / group) + c / group]);
                    want += t;
                    mag += t.abs();
                }
                assert!(
                    (f64::from(got[r * n + j]) - want).abs() <= 1e-6 * mag,
                    "r={r} j={j}"
                );
            }
        }
    }

    /// A row with a non-finite value, or a nonzero chunk below 2^-100, is refused (the layer
    /// then takes the fp32 tile); groups off whole quads make no chunks.
    #[test]
    fn rows_the_fixed_point_cannot_hold_are_refused() {
        let mut rng = Rng(7);
        let (w, ..) = layer(&mut rng, 16, 256, 128, false);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1e-33] {
            let mut x = vec![0.5f32; 256];
            if bad == 1e-33 {
                x[128..].iter_mut().for_each(|v| *v = bad);
            } else {
                x[77] = bad;
            }
            for simd in [false, fixed_dot()] {
                assert!(
                    w.fixed_rows_with(1, |_| &x[..], None, simd).is_none(),
                    "{bad}"
                );
            }
        }
        assert!(chunks(256, &[0, 126]).is_none());
        assert!(chunks(258, &[0]).is_none());
        assert_eq!(chunks(300, &[0, 40]).map(|c| c.len()), Some(4));
    }
}
