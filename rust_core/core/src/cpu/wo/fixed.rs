//! Weight-only codes on the u8 x i8 dot-product instruction (`vpdpbusd`) for bf16 activations
//! in few rows (decode). int8 codes: the fp32 tile is bound there by converting every code to
//! fp32 (three instructions per 16 codes, ~29 GMAC/s per Zen 4 core, slower than memory
//! delivers the codes); here a 64-byte line of codes is one byte permute, an xor and three dot
//! products (~59 GMAC/s). 4-bit codes at one row: the bf16 nibble tile takes a shift, a lookup
//! and a dot product per column pair (~51 GMAC/s); here a line of 8 columns is two masks and
//! six dot products (~60 GMAC/s). From two rows the bf16 tile's two dot products per 64 codes
//! beat these three ([`BlockedWo::fixed_max_rows`]).
//!
//! Exactness: a bf16 value has an 8-bit significand, so within a chunk of up to [`CHUNK`]
//! columns a row's values are integers times one power of two, `x = a * 2^-sh`, `|a| < 2^22`,
//! `sh` chosen from the chunk's largest magnitude. That is exact for every value within 14
//! binades of the largest; smaller ones round to the nearest multiple of 2^-22 of it, below
//! fp32's own rounding of the chunk's sum. `a` is written in three signed base-256 digits,
//! `a = d0 + 256 d1 + 65536 d2` (`-128 <= d < 128`), each digit broadcast as the s8 operand of
//! `vpdpbusd` against the codes as u8 (int8: `q + 128`, one xor; 4-bit: the stored `q + 8`,
//! whose 8 the zero-point term takes off as in the other tiles), so with `D` a digit's sum
//! over the chunk, `Σ a q = (r0 + 256 r1) + 65536 r2` where `r = Σ d (q + 128) - 128 D`
//! (int8; `r = Σ d (q + 8)` for 4-bit storage): exact in int32
//! within a chunk (`|Σ (d0 + 256 d1) q| <= 32896 * 128 * CHUNK`), then in f64, times `2^-sh`.
//! A group of one chunk (up to 128 columns, as groups of 32-128 are) is thus exact before its one
//! rounding to f32, which the SIMD kernels make without the f64 detour (`x86::exact_f32`:
//! the integer in two parts exact in f32, one fused multiply-add; one row, 128 features of
//! 2048 4-bit columns on one Zen 3 core: 9.2 -> 7.9 us with groups of 128, 16.1 -> 11.1 us
//! with groups of 32); a longer group (channelwise) adds its chunks' exact sums in f64, which
//! rounds where their magnitudes differ by more than ~2^16, then to f32 (within one f32 ulp of
//! the exact sum rounded once). Then the fp32 path's epilogue: `acc -= z * Σx`, `y += acc * s`
//! (fused). The fp32 tile rounds once per column. Inputs are rounded to bf16 first (the bf16 path's
//! [`to_bf16`]), as that path does for the intermediate `silu(gate) * up`; rows holding a
//! non-finite value or a nonzero chunk below 2^-100 take the fp32 tile instead
//! ([`BlockedWo::fixed_rows_from`] gives `None`).
//!
//! Layout: the codes are the blocks' own. int8: `[k][16]` bytes per block, so one 64-byte line
//! is 4 columns of 16 features; `vpermb` turns it into `vpdpbusd`'s order (4 columns per
//! feature). 4-bit: a line's 32-bit lane `l` holds feature `l`'s 8 columns, in its bytes' low
//! nibbles columns 0, 4, 1, 5 and in the high ones 2, 6, 3, 7 (`LINE_ORDER`): one mask, or a
//! shift and a mask, gives each half as u8 in `vpdpbusd`'s order, and the inputs' digits are
//! written in that column order. Inputs: `[m][k / 4][3]` u32, per quad of (so ordered)
//! columns the digit `j` of its four `a` in word `j`, each broadcast from memory as one
//! `vpdpbusd` operand. [`block_scalar`] repeats the arithmetic exactly.
//!
//! AVX2 CPUs without AVX-512 (AVX-VNNI ones too) run the 4-bit form with `vpmaddubsw` (u8 x
//! s8, adjacent products summed into saturating int16) in place of `vpdpbusd`: a stored value
//! is at most 15 and a digit at least -128, so a pair sums to within ±3840 and never saturates,
//! and four lines (two operands each) add up within int16 before `vpmaddwd` by ones widens
//! them into the int32 sums: the same integers, hence the same outputs bit for bit. int8
//! codes (`q + 128` up to 255) would saturate a pair, so there int8 layers keep the fp32 tile
//! ([`BlockedWo::fixed_max_rows`] is 0 for them).

use super::bf16::{to_bf16, BF16_MIN_ROWS};
use super::{BlockedWo, Codes, BLOCK};

/// Columns per fixed-point chunk: `32896 * 128 * CHUNK` (the low digits' int32 sum, see the
/// module docs) must stay below 2^31.
pub const CHUNK: usize = 128;
/// Rows one pass of the kernel runs (its accumulators: 3 digits per row, with 4 partial sums
/// each at one row to cover the dot product's latency).
const PASS_ROWS: usize = 2;

const _: () = assert!(32896 * 128 * CHUNK < (1 << 31));

/// A chunk's integers `a` lie in `-A_LIMIT..A_LIMIT` (three signed base-256 digits; see the
/// module docs).
const A_LIMIT: i32 = 1 << 22;

/// A chunk of columns: `start..end` inside group `group`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub end: usize,
    pub group: usize,
}

/// The chunks of `k` columns grouped at `group_starts` (each group cut every [`CHUNK`]
/// columns), when every group start and `k` are multiples of `align` (4 for int8 codes: a
/// quad never straddles a chunk; 8 for 4-bit codes: nor does a line's 8 columns); `None`
/// otherwise.
pub fn chunks(k: usize, group_starts: &[usize], align: usize) -> Option<Vec<Chunk>> {
    if !k.is_multiple_of(align) || k == 0 || group_starts.iter().any(|g| !g.is_multiple_of(align)) {
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
    /// The layout they were made for: [`BlockedWo::fixed_layout`] of the layer.
    pub layout: (bool, usize),
}

/// The columns of a 4-bit line (8 columns) in the order its nibbles take as `vpdpbusd`
/// operands: feature `l`'s 32-bit lane holds, in its bytes' low nibbles, columns 0, 4, 1, 5 and
/// in their high nibbles 2, 6, 3, 7 (see `super::nibble_at`).
const LINE_ORDER: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Where column `c` of a 4-bit layer sits in its digits' order (the inverse of
/// [`LINE_ORDER`] within each line).
fn lined_position(c: usize) -> usize {
    const POS: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
    (c / 8) * 8 + POS[c % 8]
}

/// Bytes of one row's planes.
fn row_bytes(k: usize) -> usize {
    (k / 4) * 12
}

/// `Σ v` in eight interleaved partial sums added pairwise (a fixed order that vectorises: a
/// sequential sum of a 2048-value row cost as much as the rest of its conversion).
fn lane_sum(v: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += x;
        }
    }
    let tail: f32 = chunks.remainder().iter().sum();
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
        + tail
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
    // mx >= 2^-100 exactly when e >= -99.
    (e >= -99).then_some(22 - e)
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
                let a = ((x * p).round_ties_even() as i32).clamp(-A_LIMIT, A_LIMIT - 1);
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
    /// Whether this layer can take [`FixedRows`]: whole quads (int8) or lines (4-bit) per
    /// group.
    pub fn fixed_ok(&self) -> bool {
        !self.chunks.is_empty()
    }

    /// Rows per expert up to which bf16 input takes [`FixedRows`] (0: never): as
    /// [`fixed_point_rows`] for this layer's codes, where its groups hold whole quads (int8)
    /// or lines (4-bit).
    pub fn fixed_max_rows(&self) -> usize {
        if self.fixed_ok() {
            fixed_point_rows(self.nibbles())
        } else {
            0
        }
    }

    /// Whether [`BlockedWo::gemm_fixed`] reads `x` (made for this layout, with enough rows).
    pub fn fixed_reads(&self, x: &FixedRows) -> bool {
        let (m, nch) = (x.rows, self.chunks.len());
        self.fixed_ok()
            && x.layout == self.fixed_layout()
            && x.planes.len() >= m * row_bytes(self.k)
            && x.unit.len() >= m * nch
            && x.comp.len() >= m * nch * 2
            && x.sums.len() >= m * self.groups()
    }

    /// What a [`FixedRows`] depends on besides the groups: the digits' column order (4-bit
    /// lines or not) and the chunks. Layers that share one prepared input compare it.
    pub fn fixed_layout(&self) -> (bool, usize) {
        (self.nibbles(), self.chunks.len())
    }

    /// 4-bit storage: stored values `q + 8` are the u8 operand as they are, the `+ 8` taken
    /// off with the zero point as in the other tiles; int8 codes get `+ 128` (an xor), taken
    /// off with the digits' sums.
    fn nibbles(&self) -> bool {
        matches!(self.codes, Codes::U4(_))
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

    /// [`BlockedWo::fixed_rows_from`], by the scalar conversion or (with `simd`, where
    /// [`fixed_dot`] finds the CPU's support) the SIMD one; both give equal bytes.
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
        let simd = simd && kernel() != FixedKernel::Scalar;
        #[cfg(target_arch = "x86_64")]
        let avx512 = kernel() == FixedKernel::Avx512;
        let (k, nch, groups) = (self.k, self.chunks.len(), self.groups());
        let rb = row_bytes(k);
        let mut planes = spare::take_any(m * rb, 0u8);
        let mut comp = spare::take_any(m * nch * 2, 0i32);
        let mut unit = spare::take_any(m * nch, 0f32);
        let mut sums = spare::take_any(m * groups, 0f32);
        let mut v = spare::take_any(k, 0f32);
        let mut lined = spare::take_any(if self.nibbles() { k } else { 0 }, 0f32);
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
                    // SAFETY: `simd` holds only where `kernel()` found AVX-512F/BW/VBMI (or,
                    // for the AVX2 form, AVX2 and FMA); xr (sliced to k) and v hold k values.
                    (true, None) => unsafe {
                        if avx512 {
                            x86::round_row(&xr[..k], &mut v)
                        } else {
                            x86::round_row_avx2(&xr[..k], &mut v)
                        }
                    },
                    _ => round_row(xr, perm, &mut v),
                };
            // 4-bit lines hold their 8 columns' nibbles in the order LINE_ORDER (see
            // `x86::block`): the digits follow it.
            let digits_of = if self.nibbles() && ok {
                for (o, line) in lined.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
                    o.copy_from_slice(&LINE_ORDER.map(|i| line[i]));
                }
                &lined
            } else {
                &v
            };
            ok = ok
                && match simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above; the chunks are whole quads inside 0..k, dst holds the
                    // row's k / 4 quads, cc and un its chunks.
                    true => unsafe {
                        if avx512 {
                            x86::digits_row(digits_of, &self.chunks, dst, cc, un)
                        } else {
                            x86::digits_row_avx2(digits_of, &self.chunks, dst, cc, un)
                        }
                    },
                    _ => digits_row(digits_of, &self.chunks, dst, cc, un),
                };
            if !ok {
                break;
            }
            if self.nibbles() {
                // No `+ 128` to take off (see `nibbles`).
                cc.fill(0);
            }
            // Every layer's (not only those with zero points): layers that share one
            // prepared input may differ in zero points.
            for g in 0..groups {
                let (a, e) = self.bounds(g);
                sums[r * groups + g] = lane_sum(v.get(a..e.min(k)).unwrap_or(&[]));
            }
        }
        spare::give(v);
        spare::give(lined);
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
            layout: self.fixed_layout(),
        })
    }

    /// `y[r, 16 b + l]` for the rows of `x` and blocks `first_block..first_block + nblocks`:
    /// calls `emit(row, block, &lanes)`. Inputs made for another layout emit nothing (see
    /// [`BlockedWo::fixed_reads`]; `forward_cols` fills NaN for them).
    pub fn gemm_fixed(
        &self,
        x: &FixedRows,
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
    ) {
        let end = (first_block + nblocks).min(self.blocks());
        let m = x.rows;
        if !self.fixed_reads(x) {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let simd = kernel();
        for b in first_block..end {
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(PASS_ROWS);
                let mut out = [[0f32; BLOCK]; PASS_ROWS];
                #[cfg(target_arch = "x86_64")]
                if simd == FixedKernel::Avx512 {
                    // SAFETY: `kernel()` detected AVX-512F/BW/VNNI/VBMI; b < blocks; the
                    // checks above give `x` rows r..r + mr of planes, digit sums, units and
                    // group sums.
                    unsafe {
                        match (mr, self.nibbles()) {
                            (2, false) => x86::block::<2, 2, false>(self, b, x, r, &mut out),
                            (2, true) => x86::block::<2, 2, true>(self, b, x, r, &mut out),
                            (_, false) => x86::block::<1, 4, false>(self, b, x, r, &mut out),
                            (_, true) => x86::block::<1, 4, true>(self, b, x, r, &mut out),
                        }
                    }
                } else if simd == FixedKernel::Avx2Nibbles && self.nibbles() {
                    // SAFETY: `kernel()` detected AVX2 and FMA; the rest as above, and the
                    // layer's codes are 4-bit lines.
                    unsafe {
                        if mr == 2 {
                            x86::block_avx2::<2>(self, b, x, r, &mut out);
                        } else {
                            x86::block_avx2::<1>(self, b, x, r, &mut out);
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

/// Rows per expert up to which 4-bit layers take the AVX2 form. One Zen 3 core, codes in L2
/// (`N=128 wo_time`, int4, K=2048, groups of 128): one row 7.9 us against the fp32 tile's
/// 12.4; two rows 16.7-16.9 against 17.2-17.3, three even and four behind (34-37 against
/// 29.3), as the fp32 tile converts each code once for all its rows. Two rows' 3% is not
/// worth their numerics changing (bf16 rounding) with the row count.
const AVX2_MAX_ROWS: usize = 1;

/// Which fixed-point kernel [`BlockedWo::gemm_fixed`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FixedKernel {
    /// AVX-512 VNNI and VBMI (`vpermb`): int8 and 4-bit codes.
    Avx512,
    /// AVX2 and FMA without those: 4-bit codes on `vpmaddubsw` (see the module docs).
    Avx2Nibbles,
    /// Neither: [`block_scalar`] (the reference; no layer is sent to it by
    /// [`BlockedWo::fixed_max_rows`]).
    Scalar,
}

/// This CPU's fixed-point kernel, where the bf16 paths are not switched off
/// (`MOEQ_CPU_BF16=0` keeps weight-only layers in fp32 for bf16 inputs).
pub fn fixed_kernel() -> FixedKernel {
    static KERNEL: std::sync::OnceLock<FixedKernel> = std::sync::OnceLock::new();
    *KERNEL.get_or_init(|| {
        if std::env::var("MOEQ_CPU_BF16").is_ok_and(|v| v.trim() == "0") {
            return FixedKernel::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if super::isa().vnni()
                && std::arch::is_x86_feature_detected!("avx512vbmi")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                return FixedKernel::Avx512;
            }
            if super::isa().avx2_fma() {
                return FixedKernel::Avx2Nibbles;
            }
        }
        FixedKernel::Scalar
    })
}

#[cfg(all(test, target_arch = "x86_64"))]
thread_local! {
    /// Tests: run the AVX2 form on a CPU that would run the AVX-512 one.
    static FORCE_AVX2: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// [`fixed_kernel`], or in tests the AVX2 form where [`FORCE_AVX2`] asks for it and the CPU
/// has AVX2 and FMA.
fn kernel() -> FixedKernel {
    #[cfg(all(test, target_arch = "x86_64"))]
    if FORCE_AVX2.with(std::cell::Cell::get)
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        return FixedKernel::Avx2Nibbles;
    }
    fixed_kernel()
}

/// Rows per expert up to which weight-only layers with bf16 inputs take the fixed-point kernel
/// on this CPU, for 4-bit (`nibbles`) or int8 codes (0: never). On AVX2 CPUs (the
/// `vpmaddubsw` form) 4-bit codes at one row only (`AVX2_MAX_ROWS`), int8 codes never. With
/// AVX-512 VNNI and VBMI, 4-bit codes at one row only where the bf16 nibble tile runs (from
/// two rows its two dot products per 64 codes beat the fixed point's three: one Zen 4 core,
/// codes in cache, 2 rows 86 against 64 GMAC/s), else and for int8 codes below the bf16
/// path's [`BF16_MIN_ROWS`].
pub fn fixed_point_rows(nibbles: bool) -> usize {
    match (nibbles, kernel()) {
        (_, FixedKernel::Scalar) | (false, FixedKernel::Avx2Nibbles) => 0,
        (true, FixedKernel::Avx2Nibbles) => AVX2_MAX_ROWS,
        (true, FixedKernel::Avx512) if super::super::kernels::bf16_dot() => 1,
        (_, FixedKernel::Avx512) => BF16_MIN_ROWS - 1,
    }
}

/// Whether a fixed-point kernel runs for some layers (see [`fixed_kernel`];
/// [`BlockedWo::fixed_max_rows`] says which).
pub fn fixed_dot() -> bool {
    kernel() != FixedKernel::Scalar
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
                    let (u, at) = if w.nibbles() {
                        (w.codes.get(t.codes, c, l) as u8, lined_position(c))
                    } else {
                        (w.codes.get(t.codes, c, l) as u8 ^ 0x80, c)
                    };
                    for (p, s) in sums.iter_mut().enumerate() {
                        *s +=
                            i64::from(planes[(at / 4) * 12 + 4 * p + at % 4] as i8) * i64::from(u);
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
                    let z = t.zp.map(|z| z[g * BLOCK + l]);
                    let sum = if z.is_some() {
                        x.sums[r * groups + g]
                    } else {
                        0.0
                    };
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
    use super::{pow2, row_bytes, shift, BlockedWo, Chunk, FixedRows, A_LIMIT, BLOCK, PASS_ROWS};
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
            // Non-finite inputs first: adding the rounding bias carries some NaNs' mantissas
            // out through the sign bit, to zero.
            bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, exp), exp);
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
        let (amin, amax) = (_mm512_set1_epi32(-A_LIMIT), _mm512_set1_epi32(A_LIMIT - 1));
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

    /// Group `group`'s scales of the next block (`next_scales`: the end of this block's) into
    /// L2, their first and last byte (the scales are f32-aligned, so a group's 64 bytes may
    /// straddle two lines); each kernel calls it at a group's end. Alternated call by call at
    /// T=1, cold (medians of 150 calls): W4A16 with bf16 inputs Qwen3 0.96 / 1.04 against 0.99
    /// / 1.06 ms at groups of 128, 1.21 / 1.25 against 1.24 / 1.28 at 32, DeepSeek-V2-Lite 1.28
    /// / 1.24 against 1.33 / 1.31; W8A16 Qwen3 1.60 / 1.66 against 1.64 / 1.71. The whole next
    /// block's scales at once at the block's start did as well at 128 but 3% worse at 32.
    #[inline(always)]
    fn prefetch_next_scales(next_scales: *const u8, group: usize) {
        let group_bytes = BLOCK * std::mem::size_of::<f32>();
        let line = next_scales.wrapping_add(group * group_bytes);
        // SAFETY: a prefetch never faults, whatever the address (past the last block it lies
        // outside the scales), and changes nothing the program sees; SSE is in the x86-64
        // baseline. The addresses are formed with wrapping_add.
        unsafe {
            _mm_prefetch::<_MM_HINT_T1>(line.cast());
            _mm_prefetch::<_MM_HINT_T1>(line.wrapping_add(group_bytes - 1).cast());
        }
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

    /// Rows `r0..r0 + MR` of block `b` into `out` (`U` interleaved partial sums per digit);
    /// `NIB`: the layer's codes are 4-bit lines (`w.nibbles()`), else int8.
    ///
    /// # Safety
    /// AVX-512F, BW, VNNI and VBMI; `b < w.blocks()`; `x` holds rows `r0..r0 + MR` of planes,
    /// digit sums, units and (with zero points) group sums; `w.chunks`
    /// are whole quads inside `0..k`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
    pub unsafe fn block<const MR: usize, const U: usize, const NIB: bool>(
        w: &BlockedWo,
        b: usize,
        x: &FixedRows,
        r0: usize,
        out: &mut [[f32; BLOCK]; PASS_ROWS],
    ) {
        let (k, groups, nch) = (w.k, w.groups(), w.chunks.len());
        let t = w.tile(b);
        let cp = t.codes.as_ptr();
        // The next block's scales: a stream of their own beside the codes', 64 bytes per group,
        // each read once at its group's end; after that each group prefetches its line of the
        // next block's (below). Past the last block the address lies outside the scales: a prefetch
        // never faults, and it is formed with wrapping_add.
        let next_scales = t.scale.as_ptr_range().end.cast::<u8>();
        let rb = row_bytes(k);
        // SAFETY: 64 readable bytes.
        let idx = unsafe { _mm512_loadu_si512(TRANSPOSE.as_ptr().cast()) };
        // int8 codes as u8: q + 128; 4-bit stored values are u8 once masked.
        let (flip, low4) = (_mm512_set1_epi8(-128), _mm512_set1_epi8(15));
        let rows: [*const u8; MR] = std::array::from_fn(|rr| x.planes[(r0 + rr) * rb..].as_ptr());
        let mut total = [_mm512_setzero_ps(); MR];
        let mut acc = [[_mm512_setzero_pd(); 2]; MR];
        for (ci, ch) in w.chunks.iter().enumerate() {
            let mut parts = [[[_mm512_setzero_si512(); U]; 3]; MR];
            // One 64-byte operand of codes (as u8) times quad q's digits of every row.
            let mut dots = |wt: __m512i, q: usize, u: usize| {
                for (rr, row) in rows.iter().enumerate() {
                    for (p, part) in parts[rr].iter_mut().enumerate() {
                        // SAFETY: quad q's digit p lies inside the row's k / 4 * 12 bytes
                        // (the caller's contract on `x`).
                        let v = unsafe { row.add(q * 12 + 4 * p).cast::<i32>().read_unaligned() };
                        part[u] = _mm512_dpbusd_epi32(part[u], wt, _mm512_set1_epi32(v));
                    }
                }
            };
            // Unit n: int8 quad n (4 columns), or 4-bit line n (8 columns, two operands).
            let mut step = |n: usize, u: usize| {
                let at = n * 64;
                // Ahead in the weight stream, as the W8A8 decode stream does: the blocks of a
                // layer are one run, so this crosses into the next block (against the single
                // prefetch 4 KB ahead of before, a second one of the next block's line, as the
                // fp32 tile issues, measured alike).
                crate::cpu::kernels::prefetch_stream(cp.wrapping_add(at));
                // SAFETY: unit n < k / 4 (int8: k * 16 bytes a block) or k / 8 (4-bit:
                // ceil(k / 8) * 64 bytes) lies inside the block.
                let wq = unsafe { _mm512_loadu_si512(cp.add(at).cast()) };
                if NIB {
                    dots(_mm512_and_si512(wq, low4), 2 * n, u);
                    dots(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(wq), low4),
                        2 * n + 1,
                        u,
                    );
                } else {
                    dots(
                        _mm512_xor_si512(_mm512_permutexvar_epi8(idx, wq), flip),
                        n,
                        u,
                    );
                }
            };
            let (n0, n1) = if NIB {
                (ch.start / 8, ch.end / 8)
            } else {
                (ch.start / 4, ch.end / 4)
            };
            let mut n = n0;
            while n + U <= n1 {
                for u in 0..U {
                    step(n + u, u);
                }
                n += U;
            }
            while n < n1 {
                step(n, 0);
                n += 1;
            }
            let last = w.chunks.get(ci + 1).is_none_or(|n| n.group != ch.group);
            // A group of one chunk (groups of up to 128 columns) rounds its exact sum once,
            // in f32 ([`exact_f32_x16`]); longer ones add their chunks in f64 first.
            let single = last && (ci == 0 || w.chunks[ci - 1].group != ch.group);
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
                let unit = x.unit[r * nch + ci];
                let g = ch.group;
                // The fp32 path's epilogue of a group's sums `a`: `a -= z * Σx` where the
                // layer has zero points, then `total + a * s`.
                let finish = |mut a: __m512, total: __m512| {
                    let (ss, zs) = group_scales(&t, g);
                    if let Some(zs) = zs {
                        // SAFETY: zs holds 16 values (`group_scales` slices them, bounds-checked).
                        let zv = unsafe { _mm512_loadu_ps(zs.as_ptr()) };
                        a = _mm512_fnmadd_ps(zv, _mm512_set1_ps(x.sums[r * groups + g]), a);
                    }
                    // SAFETY: ss holds 16 values (as zs).
                    let s = unsafe { _mm512_loadu_ps(ss.as_ptr()) };
                    _mm512_fmadd_ps(a, s, total)
                };
                if single {
                    // Exact, or an overflow where the f64 path overflows (see `exact_f32`).
                    let a = _mm512_mul_ps(exact_f32_x16(lo, hi), _mm512_set1_ps(unit));
                    total[rr] = finish(a, total[rr]);
                    continue;
                }
                let unit = _mm512_set1_pd(f64::from(unit));
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
                    let lo32 = _mm512_cvtpd_ps(acc[rr][0]);
                    let hi32 = _mm512_cvtpd_ps(acc[rr][1]);
                    let a = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                        _mm512_castpd256_pd512(_mm256_castps_pd(lo32)),
                        _mm256_castps_pd(hi32),
                    ));
                    total[rr] = finish(a, total[rr]);
                    acc[rr] = [_mm512_setzero_pd(); 2];
                }
            }
            if last {
                prefetch_next_scales(next_scales, ch.group);
            }
        }
        for (rr, v) in total.iter().enumerate() {
            // SAFETY: rr < MR <= PASS_ROWS; each entry is 16 f32.
            unsafe { _mm512_storeu_ps(out[rr].as_mut_ptr(), *v) };
        }
    }
    /// Lanes `0..n` of 8, as an AVX2 load or store mask.
    #[target_feature(enable = "avx2")]
    fn mask8(n: usize) -> __m256i {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n.min(8) as i32), lane)
    }

    /// [`round_row`] with AVX2, 8 values a step: the same integer rounding.
    ///
    /// # Safety
    /// AVX2; `v.len() >= x.len()`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn round_row_avx2(x: &[f32], v: &mut [f32]) -> bool {
        let (exp, sign) = (_mm256_set1_epi32(0x7f80_0000), _mm256_set1_epi32(i32::MIN));
        let (half, one, top) = (
            _mm256_set1_epi32(0x7fff),
            _mm256_set1_epi32(1),
            _mm256_set1_epi32(0xffff_0000u32 as i32),
        );
        let zero = _mm256_setzero_si256();
        let mut bad = zero;
        for c in (0..x.len()).step_by(8) {
            let n = x.len() - c;
            // Masked only at the end: AMD's masked stores are microcoded (converting a row
            // of 2048 took 2.95 us on Zen 3 with masked loads and stores every 8 values, 1.7
            // with them only at the end, here and in `digits_row_avx2`).
            // SAFETY: c < x.len(): `load8`'s contract (masked lanes read 0 and are not
            // touched by the store).
            let b = _mm256_castps_si256(unsafe { load8(x, c, n) });
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(b, exp), exp));
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), one);
            let r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(half, odd)), top);
            let e = _mm256_and_si256(r, exp);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, exp));
            // Subnormal results to a signed zero.
            let sub = _mm256_cmpeq_epi32(e, zero);
            let r = _mm256_blendv_epi8(r, _mm256_and_si256(r, sign), sub);
            // SAFETY: lanes c..c + 8 inside v (v.len() >= x.len()), or masked to x's length.
            unsafe {
                if n >= 8 {
                    _mm256_storeu_si256(v.as_mut_ptr().add(c).cast(), r);
                } else {
                    _mm256_maskstore_epi32(v.as_mut_ptr().add(c).cast(), mask8(n), r);
                }
            }
        }
        _mm256_testz_si256(bad, bad) == 1
    }

    /// `vpshufb` indices (both 128-bit lanes alike): output byte `4 j + i` (`j < 3`) is byte
    /// `j` of the lane's column `i` (its dword `i`); bytes 12-15 zero.
    const fn quad_index() -> [i8; 32] {
        let mut idx = [-128i8; 32];
        let mut o = 0;
        while o < 12 {
            let (j, i) = (o / 4, o % 4);
            idx[o] = (4 * i + j) as i8;
            idx[o + 16] = (4 * i + j) as i8;
            o += 1;
        }
        idx
    }
    static QUAD: [i8; 32] = quad_index();

    /// [`super::digits_row`] with AVX2, 8 columns (two quads) a step, as [`digits_row`] does
    /// it: the digits are the bytes of `(a + 0x808080) ^ 0x808080`, each quad's 12 gathered
    /// by one `vpshufb` within its 128-bit lane. A step writes each 12-byte quad as 16 bytes,
    /// whose last 4 the next quad's store overwrites: the chunks must follow one another in
    /// ascending order, as [`super::chunks`] makes them.
    ///
    /// # Safety
    /// AVX2; the chunks are whole quads inside `0..v.len()`, `dst` holds `v.len() / 4 * 12`
    /// bytes, `comp` 2 and `unit` 1 per chunk.
    #[target_feature(enable = "avx2")]
    pub unsafe fn digits_row_avx2(
        v: &[f32],
        chunks: &[Chunk],
        dst: &mut [u8],
        comp: &mut [i32],
        unit: &mut [f32],
    ) -> bool {
        // SAFETY: 32 readable bytes.
        let quad = unsafe { _mm256_loadu_si256(QUAD.as_ptr().cast()) };
        let (bias, low16, lo_off, hi_off) = (
            _mm256_set1_epi32(0x0080_8080),
            _mm256_set1_epi32(0xffff),
            _mm256_set1_epi32(0x8080),
            _mm256_set1_epi32(128),
        );
        let (amin, amax) = (_mm256_set1_epi32(-A_LIMIT), _mm256_set1_epi32(A_LIMIT - 1));
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for (ci, ch) in chunks.iter().enumerate() {
            let mut mx = _mm256_setzero_ps();
            for c in (ch.start..ch.end).step_by(8) {
                // SAFETY: c < ch.end <= v.len() (the caller's contract): `load8`'s.
                let x = unsafe { load8(v, c, ch.end - c) };
                mx = _mm256_max_ps(mx, _mm256_and_ps(x, magnitude));
            }
            let mut lanes = [0f32; 8];
            // SAFETY: 8 writable f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mx) };
            let Some(sh) = shift(lanes.iter().fold(0f32, |a, &l| a.max(l))) else {
                return false;
            };
            unit[ci] = pow2(-sh);
            let p = _mm256_set1_ps(pow2(sh));
            let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for c in (ch.start..ch.end).step_by(8) {
                let n = (ch.end - c).min(8);
                // SAFETY: as above. Masked lanes are 0: digits of 0, which add nothing.
                let x = unsafe { load8(v, c, n) };
                // Exact products; the conversion rounds to nearest even (the default mode).
                let a = _mm256_min_epi32(
                    _mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(x, p)), amin),
                    amax,
                );
                let t = _mm256_add_epi32(a, bias);
                lo = _mm256_add_epi32(lo, _mm256_sub_epi32(_mm256_and_si256(t, low16), lo_off));
                hi = _mm256_add_epi32(hi, _mm256_sub_epi32(_mm256_srli_epi32::<16>(t), hi_off));
                let d = _mm256_shuffle_epi8(_mm256_xor_si256(t, bias), quad);
                // Quads c / 4.. (n / 4 of them, 1 or 2) lie inside dst.
                let at = (c / 4) * 12;
                if n == 8 && at + 28 <= dst.len() {
                    // Each lane's 12 bytes as a 16-byte store: its 4 zero bytes land on the
                    // next quad's, which the next store (or step) writes.
                    // SAFETY: bytes at..at + 28 lie inside dst (checked above).
                    unsafe {
                        let o = dst.as_mut_ptr().add(at);
                        _mm_storeu_si128(o.cast(), _mm256_castsi256_si128(d));
                        _mm_storeu_si128(o.add(12).cast(), _mm256_extracti128_si256::<1>(d));
                    }
                } else {
                    let mut bytes = [0u8; 32];
                    // SAFETY: 32 writable bytes.
                    unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), d) };
                    dst[at..at + 12].copy_from_slice(&bytes[..12]);
                    if n == 8 {
                        dst[at + 12..at + 24].copy_from_slice(&bytes[16..28]);
                    }
                }
            }
            comp[ci * 2] = 128 * reduce_add(lo);
            comp[ci * 2 + 1] = 128 * reduce_add(hi);
        }
        true
    }

    /// `v[c..c + 8]`, lanes from `n` on read as 0 (masked only then: see `round_row_avx2`).
    ///
    /// # Safety
    /// AVX2; `c + n.min(8) <= v.len()`.
    #[target_feature(enable = "avx2")]
    unsafe fn load8(v: &[f32], c: usize, n: usize) -> __m256 {
        // SAFETY: lanes c..c + 8 inside v when n >= 8, else masked to c..c + n (the caller's
        // contract).
        unsafe {
            if n >= 8 {
                _mm256_loadu_ps(v.as_ptr().add(c))
            } else {
                _mm256_maskload_ps(v.as_ptr().add(c), mask8(n))
            }
        }
    }

    /// The wrapping sum of 8 int32 lanes.
    #[target_feature(enable = "avx2")]
    fn reduce_add(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// The integer `lo + 65536 hi` (one chunk's sums, see [`SPLIT_BOUNDS`]) rounded once to
    /// f32, as the f64 path's `cvtpd_ps` rounds it: `hi + (lo >> 16)` times 65536 and
    /// `lo & 0xffff` are both exact in f32 (below 2^24), so the fused multiply-add rounds only
    /// their exact sum. Times a chunk's unit (a power of two from 2^-121 to 2^106, while a
    /// nonzero sum is at least 1) the result stays exact, or overflows to an infinity exactly
    /// where `cvtpd_ps` of the f64 product does.
    #[target_feature(enable = "avx2,fma")]
    pub fn exact_f32(lo: __m256i, hi: __m256i) -> __m256 {
        let top = _mm256_add_epi32(hi, _mm256_srai_epi32::<16>(lo));
        let bottom = _mm256_and_si256(lo, _mm256_set1_epi32(0xffff));
        _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(top),
            _mm256_set1_ps(65536.0),
            _mm256_cvtepi32_ps(bottom),
        )
    }

    /// [`exact_f32`] for 16 lanes.
    #[target_feature(enable = "avx512f")]
    pub fn exact_f32_x16(lo: __m512i, hi: __m512i) -> __m512 {
        let top = _mm512_add_epi32(hi, _mm512_srai_epi32::<16>(lo));
        let bottom = _mm512_and_si512(lo, _mm512_set1_epi32(0xffff));
        _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(top),
            _mm512_set1_ps(65536.0),
            _mm512_cvtepi32_ps(bottom),
        )
    }

    /// `(|lo|, |hi|)` limits of one chunk's sums, int8 codes (`|q| <= 128`; 4-bit ones are
    /// smaller): `|d0 + 256 d1| <= 32896` and `|d2| <= 128` per column. [`exact_f32`]'s
    /// `hi + (lo >> 16)` then stays far below 2^24.
    pub const SPLIT_BOUNDS: (i64, i64) = (
        32896 * 128 * super::CHUNK as i64,
        128 * 128 * super::CHUNK as i64,
    );
    const _: () = assert!(SPLIT_BOUNDS.0 < 1 << 31 && SPLIT_BOUNDS.1 + (1 << 15) < 1 << 24);

    /// A block's scales and (if any) zero points of group `g`: 16 each.
    fn group_scales<'a>(t: &super::super::Tile<'a>, g: usize) -> (&'a [f32], Option<&'a [f32]>) {
        (
            &t.scale[g * BLOCK..(g + 1) * BLOCK],
            t.zp.map(|z| &z[g * BLOCK..(g + 1) * BLOCK]),
        )
    }

    /// The fp32 path's epilogue for half `h` (lanes 8 h..8 h + 8) of a group's sums `a`:
    /// `a -= z * Σx` where the layer has zero points, then `total + a * s`.
    #[target_feature(enable = "avx2,fma")]
    fn finish_half(
        a: __m256,
        ss: &[f32],
        zs: Option<&[f32]>,
        sum: f32,
        h: usize,
        total: __m256,
    ) -> __m256 {
        let mut a = a;
        if let Some(zs) = zs {
            // SAFETY: the slice (bounds-checked) holds the 8 values read.
            let zv = unsafe { _mm256_loadu_ps(zs[8 * h..8 * h + 8].as_ptr()) };
            a = _mm256_fnmadd_ps(zv, _mm256_set1_ps(sum), a);
        }
        // SAFETY: as above.
        let sv = unsafe { _mm256_loadu_ps(ss[8 * h..8 * h + 8].as_ptr()) };
        _mm256_fmadd_ps(a, sv, total)
    }

    /// Lines of two operands each that add up within int16 (`2 * 3840` per line; see the
    /// module docs) before they are widened.
    const AVX2_LINES: usize = 4;
    const _: () = assert!(AVX2_LINES * 2 * 3840 <= i16::MAX as usize);

    /// [`block`] for 4-bit codes on AVX2: rows `r0..r0 + MR` of block `b` into `out`, each
    /// 64-byte line as two 256-bit halves (features 0-7 and 8-15), `vpmaddubsw` for
    /// `vpdpbusd` (see the module docs).
    ///
    /// # Safety
    /// AVX2 and FMA; the layer's codes are 4-bit lines; otherwise as [`block`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn block_avx2<const MR: usize>(
        w: &BlockedWo,
        b: usize,
        x: &FixedRows,
        r0: usize,
        out: &mut [[f32; BLOCK]; PASS_ROWS],
    ) {
        let (k, groups, nch) = (w.k, w.groups(), w.chunks.len());
        let t = w.tile(b);
        let cp = t.codes.as_ptr();
        // As in `block`: the next block's scales, a group's line at a time.
        let next_scales = t.scale.as_ptr_range().end.cast::<u8>();
        let rb = row_bytes(k);
        let (low4, ones) = (_mm256_set1_epi8(15), _mm256_set1_epi16(1));
        let rows: [*const u8; MR] = std::array::from_fn(|rr| x.planes[(r0 + rr) * rb..].as_ptr());
        let mut total = [[_mm256_setzero_ps(); 2]; MR];
        // Per row, features 4 q..4 q + 4 in f64.
        let mut acc = [[_mm256_setzero_pd(); 4]; MR];
        for (ci, ch) in w.chunks.iter().enumerate() {
            // int32 sums per row, digit and half.
            let mut sums = [[[_mm256_setzero_si256(); 2]; 3]; MR];
            let (mut n, n1) = (ch.start / 8, ch.end / 8);
            while n < n1 {
                let stop = (n + AVX2_LINES).min(n1);
                let mut parts = [[[_mm256_setzero_si256(); 2]; 3]; MR];
                while n < stop {
                    let at = n * 64;
                    crate::cpu::kernels::prefetch_stream(cp.wrapping_add(at));
                    for h in 0..2 {
                        // SAFETY: line n < ceil(k / 8) lies inside the block (ceil(k / 8) *
                        // 64 bytes); half h is its bytes 32 h..32 h + 32.
                        let wq = unsafe { _mm256_loadu_si256(cp.add(at + 32 * h).cast()) };
                        let lo = _mm256_and_si256(wq, low4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(wq), low4);
                        for (rr, row) in rows.iter().enumerate() {
                            for (p, part) in parts[rr].iter_mut().enumerate() {
                                // SAFETY: quads 2 n and 2 n + 1's digit p lie inside the row's
                                // k / 4 * 12 bytes (the caller's contract on `x`).
                                let (dl, dh) = unsafe {
                                    (
                                        row.add(2 * n * 12 + 4 * p).cast::<i32>().read_unaligned(),
                                        row.add((2 * n + 1) * 12 + 4 * p)
                                            .cast::<i32>()
                                            .read_unaligned(),
                                    )
                                };
                                let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(dl));
                                let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(dh));
                                part[h] = _mm256_add_epi16(part[h], _mm256_add_epi16(pl, ph));
                            }
                        }
                    }
                    n += 1;
                }
                for (s, pr) in sums.iter_mut().zip(&parts) {
                    for (sp, pp) in s.iter_mut().zip(pr) {
                        for (sh, ph) in sp.iter_mut().zip(pp) {
                            *sh = _mm256_add_epi32(*sh, _mm256_madd_epi16(*ph, ones));
                        }
                    }
                }
            }
            let last = w.chunks.get(ci + 1).is_none_or(|n| n.group != ch.group);
            // A group of one chunk (groups of up to 128 columns) rounds its exact sum once,
            // in f32 ([`exact_f32`]); longer ones add their chunks in f64 first.
            let single = last && (ci == 0 || w.chunks[ci - 1].group != ch.group);
            for rr in 0..MR {
                let r = r0 + rr;
                let cc = (r * nch + ci) * 2;
                let unit = x.unit[r * nch + ci];
                let (clo, chi) = (
                    _mm256_set1_epi32(x.comp[cc]),
                    _mm256_set1_epi32(x.comp[cc + 1]),
                );
                let s = &sums[rr];
                // Wrapping int32: the true values fit (see the module docs).
                let lo: [__m256i; 2] = std::array::from_fn(|h| {
                    _mm256_sub_epi32(
                        _mm256_add_epi32(s[0][h], _mm256_slli_epi32::<8>(s[1][h])),
                        clo,
                    )
                });
                let hi: [__m256i; 2] = std::array::from_fn(|h| _mm256_sub_epi32(s[2][h], chi));
                let g = ch.group;
                if single {
                    let (ss, zs) = group_scales(&t, g);
                    let unit = _mm256_set1_ps(unit);
                    for h in 0..2 {
                        // Exact, or an overflow where the f64 path overflows (see
                        // `exact_f32`).
                        let a = _mm256_mul_ps(exact_f32(lo[h], hi[h]), unit);
                        total[rr][h] =
                            finish_half(a, ss, zs, x.sums[r * groups + g], h, total[rr][h]);
                    }
                    continue;
                }
                let unit = _mm256_set1_pd(f64::from(unit));
                let scale16 = _mm256_set1_pd(65536.0);
                for h in 0..2 {
                    let quarters = [
                        (_mm256_castsi256_si128(hi[h]), _mm256_castsi256_si128(lo[h])),
                        (
                            _mm256_extracti128_si256::<1>(hi[h]),
                            _mm256_extracti128_si256::<1>(lo[h]),
                        ),
                    ];
                    for (q, (hv, lv)) in quarters.into_iter().enumerate() {
                        let dot = _mm256_mul_pd(
                            _mm256_fmadd_pd(
                                _mm256_cvtepi32_pd(hv),
                                scale16,
                                _mm256_cvtepi32_pd(lv),
                            ),
                            unit,
                        );
                        acc[rr][2 * h + q] = _mm256_add_pd(acc[rr][2 * h + q], dot);
                    }
                }
                if last {
                    let (ss, zs) = group_scales(&t, g);
                    for h in 0..2 {
                        let a = _mm256_set_m128(
                            _mm256_cvtpd_ps(acc[rr][2 * h + 1]),
                            _mm256_cvtpd_ps(acc[rr][2 * h]),
                        );
                        total[rr][h] =
                            finish_half(a, ss, zs, x.sums[r * groups + g], h, total[rr][h]);
                    }
                    acc[rr] = [_mm256_setzero_pd(); 4];
                }
            }
            if last {
                prefetch_next_scales(next_scales, ch.group);
            }
        }
        for (rr, halves) in total.iter().enumerate() {
            for (h, v) in halves.iter().enumerate() {
                // SAFETY: rr < MR <= PASS_ROWS; each entry is 16 f32, half h lanes 8 h..8 h + 8.
                unsafe { _mm256_storeu_ps(out[rr].as_mut_ptr().add(8 * h), *v) };
            }
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

    /// A layer of `n x k` codes of `bits` (8, or 4: stored as 4-bit lines) in groups of
    /// `group` (`k` for channelwise), with zero points when `asym`; with the values the
    /// storage holds (codes and zero points plus 8 for 4-bit storage, whose symmetric layers
    /// carry that 8 as their zero point) and the scales.
    struct Layer {
        w: BlockedWo,
        stored: Vec<f32>,
        zp: Option<Vec<f32>>,
        scale: Vec<f32>,
    }

    fn layer(rng: &mut Rng, n: usize, k: usize, group: usize, asym: bool, bits: u32) -> Layer {
        let groups = k / group;
        let code = |rng: &mut Rng| {
            if bits == 4 {
                rng.below(16) as i8 - 8
            } else {
                rng.next() as i8
            }
        };
        let q: Vec<i8> = (0..n * k).map(|_| code(rng)).collect();
        let scale: Vec<f32> = (0..n * groups)
            .map(|_| f32::from_bits((0x3a00_0000 + rng.below(1 << 22) as u32) & 0xffff_0000))
            .collect();
        let zp: Vec<i8> = (0..n * groups).map(|_| code(rng)).collect();
        let starts = (0..groups).map(|g| g * group).collect();
        let w = BlockedWo::new(n, k, &q, &scale, asym.then_some(&zp[..]), starts);
        assert_eq!(w.nibbles(), bits == 4);
        assert!(w.fixed_ok());
        let bias = if bits == 4 { 8.0 } else { 0.0 };
        let zp = (asym || bits == 4).then(|| {
            zp.iter()
                .map(|&z| if asym { f32::from(z) + bias } else { bias })
                .collect()
        });
        Layer {
            w,
            stored: q.iter().map(|&v| f32::from(v) + bias).collect(),
            zp,
            scale,
        }
    }

    /// All of a layer's outputs for `x` (`m` rows) by [`BlockedWo::gemm_fixed`].
    fn outputs(w: &BlockedWo, x: &FixedRows) -> Vec<f32> {
        let (m, n) = (x.rows, w.n);
        let mut got = vec![f32::NAN; m * n];
        w.gemm_fixed(x, 0, w.blocks(), |r, b, lanes| {
            for (l, &v) in lanes.iter().enumerate() {
                if 16 * b + l < n {
                    got[r * n + 16 * b + l] = v;
                }
            }
        });
        got
    }

    #[test]
    fn digits_rebuild_every_value_in_range() {
        let ends = [-(1 << 22), (1 << 22) - 1, -1, 0, 1, 127, 128, -128, -129];
        for a in (-(1 << 22)..(1 << 22)).step_by(997).chain(ends) {
            let d = digits(a);
            let back = i32::from(d[0]) + 256 * i32::from(d[1]) + 65536 * i32::from(d[2]);
            assert_eq!(back, a);
        }
        // LINE_ORDER and lined_position are inverses.
        for c in 0..16 {
            assert_eq!(LINE_ORDER[lined_position(c) % 8] + (c / 8) * 8, c);
        }
    }

    /// Where every input of a chunk is within 14 binades of its largest, a group's dot product
    /// is exact before its one rounding (for these inputs also in groups of several chunks,
    /// whose f64 sums do not round here): the output equals an f64 reference bit for bit, by
    /// the SIMD kernel (where the CPU has it) and the scalar one, for int8 and 4-bit codes;
    /// the SIMD conversion of the inputs equals the scalar one byte for byte.
    #[test]
    fn fixed_point_equals_the_exact_sums_rounded_once() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for (n, k, group, asym, m, bits) in [
            (16, 128, 128, false, 1, 8),
            (40, 256, 128, false, 2, 8),
            (33, 512, 64, true, 3, 8),
            (20, 320, 32, false, 5, 8),
            (17, 384, 384, true, 1, 8),
            (48, 1024, 1024, false, 2, 8),
            (16, 68, 68, false, 1, 8),
            (16, 128, 128, false, 1, 4),
            (40, 256, 64, true, 1, 4),
            (33, 512, 32, true, 3, 4),
            (20, 1024, 1024, false, 2, 4),
            (17, 136, 136, false, 1, 4),
        ] {
            let Layer {
                w,
                stored,
                zp,
                scale,
            } = layer(&mut rng, n, k, group, asym, bits);
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
                assert_eq!(simd.planes, scalar.planes, "n={n} k={k} bits={bits}");
                assert_eq!(simd.comp, scalar.comp);
                assert_eq!(simd.unit, scalar.unit);
                assert_eq!(simd.sums, scalar.sums);
            }
            let got = outputs(&w, &scalar);
            for r in 0..m {
                for j in 0..n {
                    let mut y = 0f32;
                    for g in 0..groups {
                        let cols = g * group..(g + 1) * group;
                        let exact: f64 = cols
                            .clone()
                            .map(|c| f64::from(stored[j * k + c]) * f64::from(x[r * k + c]))
                            .sum();
                        let mut a = exact as f32;
                        if let Some(z) = &zp {
                            let sum = lane_sum(&x[r * k + cols.start..r * k + cols.end]);
                            a = (-z[j * groups + g]).mul_add(sum, a);
                        }
                        y = a.mul_add(scale[j * groups + g], y);
                    }
                    let at = format!("n={n} k={k} g={group} bits={bits} r={r} j={j}");
                    assert_eq!(got[r * n + j].to_bits(), y.to_bits(), "{at}");
                }
            }
            // The scalar reference of every block agrees with what gemm_fixed gave.
            for b in 0..w.blocks() {
                for r in (0..m).step_by(PASS_ROWS) {
                    let mut out = [[0f32; BLOCK]; PASS_ROWS];
                    let mr = (m - r).min(PASS_ROWS);
                    block_scalar(&w, b, &scalar, r, mr, &mut out);
                    for (rr, lanes) in out.iter().enumerate().take(mr) {
                        for (l, v) in lanes.iter().enumerate().take(BLOCK.min(n - 16 * b)) {
                            assert_eq!(v.to_bits(), got[(r + rr) * n + 16 * b + l].to_bits());
                        }
                    }
                }
            }
        }
    }

    /// Inputs spread over more binades than the fixed point holds lose only below 2^-22 of
    /// their chunk's largest: close to the f64 sums; SIMD and scalar still agree exactly.
    /// Act-order layers gather their inputs in the sorted order first.
    #[test]
    fn wide_inputs_stay_close_and_act_order_gathers() {
        let mut rng = Rng(12345);
        let (n, k, group, m) = (48, 512, 128, 2);
        for bits in [8, 4] {
            let Layer {
                w, stored, scale, ..
            } = layer(&mut rng, n, k, group, false, bits);
            let x: Vec<f32> = (0..m * k).map(|_| rng.bf16(-60, 20)).collect();
            let row = |r: usize| &x[r * k..(r + 1) * k];
            let fx = w.fixed_rows_with(m, row, None, false).expect("finite");
            if fixed_dot() {
                let simd = w.fixed_rows_with(m, row, None, true).expect("finite");
                assert_eq!(simd.planes, fx.planes);
                assert_eq!(simd.comp, fx.comp);
            }
            let got = outputs(&w, &fx);
            let bias = if bits == 4 { 8.0 } else { 0.0 };
            for r in 0..m {
                for j in 0..n {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for c in 0..k {
                        let s = f64::from(scale[j * (k / group) + c / group]);
                        let t = f64::from(stored[j * k + c] - bias) * f64::from(x[r * k + c]) * s;
                        want += t;
                        mag += t.abs();
                    }
                    let err = (f64::from(got[r * n + j]) - want).abs();
                    assert!(err <= 1e-6 * mag, "bits={bits} r={r} j={j}");
                }
            }
            // A permutation: the same as handing over the gathered rows.
            let perm: Vec<u32> = (0..k as u32).map(|c| (c * 7 + 3) % k as u32).collect();
            let gathered: Vec<f32> = (0..m)
                .flat_map(|r| perm.iter().map(move |&c| (r, c)))
                .map(|(r, c)| x[r * k + c as usize])
                .collect();
            for simd in [false, fixed_dot()] {
                let a = w
                    .fixed_rows_with(m, row, Some(&perm), simd)
                    .expect("finite");
                let g = w
                    .fixed_rows_with(m, |r| &gathered[r * k..(r + 1) * k], None, false)
                    .expect("finite");
                assert_eq!(a.planes, g.planes);
                assert_eq!(a.comp, g.comp);
                assert_eq!(a.unit, g.unit);
            }
        }
    }

    /// A row with a non-finite value, or a nonzero chunk below 2^-100, is refused (the layer
    /// then takes the fp32 tile); groups off whole quads (int8) or lines (4-bit) make no
    /// chunks.
    #[test]
    fn rows_the_fixed_point_cannot_hold_are_refused() {
        let mut rng = Rng(7);
        for bits in [8, 4] {
            let w = layer(&mut rng, 16, 256, 128, false, bits).w;
            // NaNs whose rounding bias would carry out through the sign bit among them.
            let nans = [
                0x7fff_ffffu32,
                0xffff_ffff,
                0x7fff_8000,
                0xffff_8000,
                0x7f80_0001,
            ];
            let payloads = nans.map(f32::from_bits);
            let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1e-33];
            for bad in special.into_iter().chain(payloads) {
                let mut x = vec![0.5f32; 256];
                if bad == 1e-33 {
                    x[128..].iter_mut().for_each(|v| *v = bad);
                } else {
                    x[77] = bad;
                }
                for simd in [false, fixed_dot()] {
                    let fx = w.fixed_rows_with(1, |_| &x[..], None, simd);
                    assert!(fx.is_none(), "{:#x}", bad.to_bits());
                }
            }
        }
        assert!(chunks(256, &[0, 126], 4).is_none());
        assert!(chunks(258, &[0], 4).is_none());
        assert!(chunks(260, &[0], 8).is_none());
        assert!(chunks(256, &[0, 124], 8).is_none());
        assert_eq!(chunks(300, &[0, 40], 4).map(|c| c.len()), Some(4));
    }

    /// The kernels' f32 rounding of a one-chunk group's integer `lo + 65536 hi` (AVX2, and
    /// AVX-512 where the CPU has it) equals the f64 path's single rounding, across the whole
    /// range of int8 sums (4-bit ones lie inside it): at its ends, where `lo` alone has more
    /// bits than f32 holds (rounding it first would round twice), and at ties.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn group_sums_round_once() {
        assert!(
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            "the x86 CPUs this crate is tested on have AVX2 and FMA"
        );
        use std::arch::x86_64::*;
        let (lo_max, hi_max) = x86::SPLIT_BOUNDS;
        let mut rng = Rng(0x0dd_f00d);
        let mut pairs: Vec<(i32, i32)> = vec![
            (lo_max as i32, hi_max as i32),
            (-lo_max as i32, -hi_max as i32),
            (lo_max as i32, -hi_max as i32),
            (-lo_max as i32, hi_max as i32),
            (-1, 0),
            (1, -1),
            (0xffff, 0),
            (-0x10000, 1),
            // Ties: 2^25 + 2 and 2^25 + 6 (a half unit of the last place) round to even.
            ((1 << 25) + 2, 0),
            ((1 << 25) + 6, 0),
            ((1 << 25) - 6, 1 << 9),
            // 2^26 + 8 once; rounding `lo` first (to 2^25 + 4) gives 2^26 + 4, then 2^26.
            ((1 << 25) + 5, 1 << 9),
            // Beyond 4-bit sums (int8 only): 2^29 + 49 rounds once, to 2^29 + 64.
            ((1 << 29) + 49, 0),
        ];
        for _ in 0..100_000 {
            let lo = rng.below(2 * lo_max as u64 + 1) as i64 - lo_max;
            // Part with small `hi`, where `lo`'s low bits still count in the sum.
            let span = [64, 1 << 18, hi_max][rng.below(3) as usize];
            let hi = rng.below(2 * span as u64 + 1) as i64 - span;
            pairs.push((lo as i32, hi as i32));
        }
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        for chunk in pairs.chunks(16) {
            let (mut lo, mut hi) = ([0i32; 16], [0i32; 16]);
            for (j, &(l, h)) in chunk.iter().enumerate() {
                (lo[j], hi[j]) = (l, h);
            }
            let mut got = [0f32; 16];
            // SAFETY: AVX2 and FMA (asserted above); the arrays hold 16 values each.
            unsafe {
                for h in 0..2 {
                    let v = x86::exact_f32(
                        _mm256_loadu_si256(lo[8 * h..].as_ptr().cast()),
                        _mm256_loadu_si256(hi[8 * h..].as_ptr().cast()),
                    );
                    _mm256_storeu_ps(got[8 * h..].as_mut_ptr(), v);
                }
            }
            let mut wide = got;
            if avx512 {
                // SAFETY: AVX-512F (detected); the arrays hold 16 values each.
                unsafe {
                    let v = x86::exact_f32_x16(
                        _mm512_loadu_si512(lo.as_ptr().cast()),
                        _mm512_loadu_si512(hi.as_ptr().cast()),
                    );
                    _mm512_storeu_ps(wide.as_mut_ptr(), v);
                }
            }
            for j in 0..16 {
                let want = f64::from(hi[j]).mul_add(65536.0, f64::from(lo[j])) as f32;
                let at = format!("lo {} hi {}", lo[j], hi[j]);
                assert_eq!(got[j].to_bits(), want.to_bits(), "AVX2, {at}");
                assert_eq!(wide[j].to_bits(), want.to_bits(), "AVX-512, {at}");
            }
        }
    }

    /// The AVX2 form (forced where the CPU would run the AVX-512 one) equals the scalar
    /// reference bit for bit on 4-bit layers, one and two rows, with and without zero points,
    /// groups of one chunk or several; also where every product pair is at the int16 bound
    /// (stored 15 against digit -128 in every lane, four lines summed before widening). Its
    /// input conversion equals the scalar one byte for byte, and int8 layers are left to the
    /// fp32 tile.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_nibble_blocks_equal_the_scalar_reference() {
        assert!(
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma"),
            "the x86 CPUs this crate is tested on have AVX2 and FMA"
        );
        FORCE_AVX2.with(|f| f.set(true));
        assert_eq!(kernel(), FixedKernel::Avx2Nibbles);
        let mut rng = Rng(0x005e_ed0f_a7c2);
        let int8 = layer(&mut rng, 16, 128, 128, false, 8).w;
        assert_eq!(int8.fixed_max_rows(), 0);
        // Its input conversion still serves int8 layers (`fixed_rows_from`): their `+ 128`
        // sums and a last chunk of 4 columns.
        for (k, group) in [(68, 68), (256, 64)] {
            let w = layer(&mut rng, 16, k, group, true, 8).w;
            let x: Vec<f32> = (0..2 * k).map(|_| rng.bf16(-30, 3)).collect();
            let row = |r: usize| &x[r * k..(r + 1) * k];
            let scalar = w.fixed_rows_with(2, row, None, false).expect("finite");
            let simd = w.fixed_rows_with(2, row, None, true).expect("finite");
            assert_eq!(simd.planes, scalar.planes, "int8 k={k}");
            assert_eq!(simd.comp, scalar.comp, "int8 k={k}");
            assert_eq!(simd.unit, scalar.unit);
        }
        for (n, k, group, asym, m, extreme) in [
            (16, 128, 128, false, 1, false),
            (40, 256, 64, true, 2, false),
            (33, 512, 32, true, 3, false),
            (20, 1024, 1024, false, 2, false),
            (17, 136, 136, true, 1, false),
            (24, 384, 128, false, 2, true),
        ] {
            let Layer { mut w, .. } = layer(&mut rng, n, k, group, asym, 4);
            assert_eq!(w.fixed_max_rows(), AVX2_MAX_ROWS);
            let x: Vec<f32> = if extreme {
                let q = vec![7i8; n * k];
                let scale = vec![1.0f32; n * (k / group)];
                let starts = (0..k / group).map(|g| g * group).collect();
                w = BlockedWo::new(n, k, &q, &scale, None, starts);
                // Each chunk's first value sets its shift (2^21 units), every other one is
                // -128 units: digit 0 is -128 in every lane but the first.
                (0..m * k)
                    .map(|i| {
                        if i % CHUNK == 0 {
                            1.0
                        } else {
                            -128.0 / (1 << 21) as f32
                        }
                    })
                    .collect()
            } else {
                (0..m * k)
                    .map(|_| {
                        if rng.below(11) == 0 {
                            0.0
                        } else {
                            rng.bf16(-40, 12)
                        }
                    })
                    .collect()
            };
            let row = |r: usize| &x[r * k..(r + 1) * k];
            let scalar = w.fixed_rows_with(m, row, None, false).expect("finite");
            let simd = w.fixed_rows_with(m, row, None, true).expect("finite");
            assert_eq!(simd.planes, scalar.planes, "n={n} k={k}");
            assert_eq!(simd.comp, scalar.comp);
            assert_eq!(simd.unit, scalar.unit);
            assert_eq!(simd.sums, scalar.sums);
            let got = outputs(&w, &simd);
            for b in 0..w.blocks() {
                for r in (0..m).step_by(PASS_ROWS) {
                    let mut out = [[0f32; BLOCK]; PASS_ROWS];
                    let mr = (m - r).min(PASS_ROWS);
                    block_scalar(&w, b, &scalar, r, mr, &mut out);
                    for (rr, lanes) in out.iter().enumerate().take(mr) {
                        for (l, v) in lanes.iter().enumerate().take(BLOCK.min(n - 16 * b)) {
                            let at = format!("n={n} k={k} g={group} r={} j={}", r + rr, 16 * b + l);
                            assert!(v.is_finite(), "{at}");
                            assert_eq!(
                                v.to_bits(),
                                got[(r + rr) * n + 16 * b + l].to_bits(),
                                "{at}"
                            );
                        }
                    }
                }
            }
        }
        FORCE_AVX2.with(|f| f.set(false));
    }
}
