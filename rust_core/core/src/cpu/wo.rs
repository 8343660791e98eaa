//! Weight-only (W8A16, W4A16) weights in 16-feature blocks for fp32 FMA kernels.
//!
//! Layout: block `b` holds `[k][16]` int8 codes (feature-minor), so one 16-byte load converts to
//! one register of 16 features at one input column, multiplied by a broadcast activation; the
//! accumulators are per feature, so there is no horizontal reduction anywhere. Scales and zero
//! points are kept per block as `[groups][16]`. Numerics: per group `acc = Σ q·x` (fp32 FMA in
//! column order), then `acc -= z·Σx` (zero points), then `y += acc·s`: the fp32 compute of
//! DESIGN.md on the dequantised weights, in a fixed order that the scalar reference repeats
//! exactly (same fused operations), so every path gives identical bits.

use super::kernels::{isa, Isa};

/// Features per block.
pub const BLOCK: usize = 16;
/// Activation rows per register tile.
pub const TILE_ROWS: usize = 8;

#[derive(Clone, Debug)]
pub struct BlockedWo {
    pub n: usize,
    pub k: usize,
    /// `[blocks][k][16]`, zero codes past `n`.
    codes: Vec<i8>,
    /// `[blocks][groups][16]`
    scale: Vec<f32>,
    /// `[blocks][groups][16]`, when the scheme is asymmetric.
    zp: Option<Vec<f32>>,
    /// First (sorted) column of each group.
    pub group_starts: Vec<usize>,
}

impl BlockedWo {
    /// From row-major `[n, k]` codes (columns already in group order), `[n, groups]` scales and
    /// zero points. Missing values read as zero, so short inputs cannot index out of bounds.
    pub fn new(
        n: usize,
        k: usize,
        q: &[i8],
        scale: &[f32],
        zp: Option<&[i8]>,
        group_starts: Vec<usize>,
    ) -> BlockedWo {
        let groups = group_starts.len().max(1);
        let blocks = n.div_ceil(BLOCK);
        let mut codes = vec![0i8; blocks * k * BLOCK];
        let mut sc = vec![0f32; blocks * groups * BLOCK];
        let mut zs = zp.map(|_| vec![0f32; blocks * groups * BLOCK]);
        for j in 0..n {
            let (b, l) = (j / BLOCK, j % BLOCK);
            for (c, &v) in q.get(j * k..(j + 1) * k).unwrap_or(&[]).iter().enumerate() {
                codes[(b * k + c) * BLOCK + l] = v;
            }
            for g in 0..groups {
                let at = (b * groups + g) * BLOCK + l;
                sc[at] = scale.get(j * groups + g).copied().unwrap_or(0.0);
                if let (Some(zs), Some(z)) = (zs.as_mut(), zp) {
                    zs[at] = f32::from(z.get(j * groups + g).copied().unwrap_or(0));
                }
            }
        }
        BlockedWo {
            n,
            k,
            codes,
            scale: sc,
            zp: zs,
            group_starts,
        }
    }

    pub fn blocks(&self) -> usize {
        self.n.div_ceil(BLOCK)
    }
    pub fn groups(&self) -> usize {
        self.group_starts.len().max(1)
    }
    fn bounds(&self, g: usize) -> (usize, usize) {
        (
            self.group_starts.get(g).copied().unwrap_or(0),
            self.group_starts.get(g + 1).copied().unwrap_or(self.k),
        )
    }

    /// Feature `j`'s codes (sorted column order), scales and zero points.
    pub fn row(&self, j: usize) -> (Vec<i8>, Vec<f32>, Option<Vec<i8>>) {
        let (b, l) = (j / BLOCK, j % BLOCK);
        let g = self.groups();
        let codes = (0..self.k)
            .map(|c| self.codes[(b * self.k + c) * BLOCK + l])
            .collect();
        let scale = (0..g)
            .map(|i| self.scale[(b * g + i) * BLOCK + l])
            .collect();
        let zp = self
            .zp
            .as_ref()
            .map(|z| (0..g).map(|i| z[(b * g + i) * BLOCK + l] as i8).collect());
        (codes, scale, zp)
    }

    /// `Σ x` per row and group, the zero-point term (`[m, groups]`).
    pub fn group_sums(&self, x: &[f32], m: usize) -> Vec<f32> {
        let g = self.groups();
        let mut out = vec![0f32; m * g];
        for r in 0..m {
            for gi in 0..g {
                let (a, e) = self.bounds(gi);
                out[r * g + gi] = x[r * self.k + a..r * self.k + e].iter().sum();
            }
        }
        out
    }

    /// `y[r, 16 b + l]` for rows `0..m` of `x` (`[m, k]` f32, sorted column order) and blocks
    /// `first_block..first_block + nblocks`: calls `emit(row, block, &lanes)`.
    pub fn gemm(
        &self,
        x: &[f32],
        m: usize,
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
    ) {
        let end = (first_block + nblocks).min(self.blocks());
        if x.len() < m * self.k || first_block >= end {
            return;
        }
        let sums = self.zp.as_ref().map(|_| self.group_sums(x, m));
        let simd = cfg!(target_arch = "x86_64") && matches!(isa(), Isa::Avx512 | Isa::Avx512Vnni);
        let g = self.groups();
        for b in first_block..end {
            let tile = Tile {
                codes: &self.codes[b * self.k * BLOCK..(b + 1) * self.k * BLOCK],
                scale: &self.scale[b * g * BLOCK..(b + 1) * g * BLOCK],
                zp: self
                    .zp
                    .as_ref()
                    .map(|z| &z[b * g * BLOCK..(b + 1) * g * BLOCK]),
                k: self.k,
                group_starts: &self.group_starts,
            };
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(TILE_ROWS);
                let xs = &x[r * self.k..(r + mr) * self.k];
                let ss = sums.as_ref().map(|s| &s[r * g..(r + mr) * g]);
                let mut out = [[0f32; BLOCK]; TILE_ROWS];
                if simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512F detected by `isa()`; the tile's slices hold one block
                    // (k x 16 codes, groups x 16 scales) and `xs`/`ss` hold `mr` rows.
                    unsafe {
                        x86::tile(&tile, xs, ss, mr, &mut out)
                    };
                } else {
                    tile_scalar(&tile, xs, ss, mr, &mut out);
                }
                for (rr, lanes) in out.iter().enumerate().take(mr) {
                    emit(r + rr, b, lanes);
                }
                r += mr;
            }
        }
    }
}

/// One block's weights.
pub struct Tile<'a> {
    codes: &'a [i8],
    scale: &'a [f32],
    zp: Option<&'a [f32]>,
    k: usize,
    group_starts: &'a [usize],
}

impl Tile<'_> {
    fn bounds(&self, g: usize) -> (usize, usize) {
        (
            self.group_starts.get(g).copied().unwrap_or(0),
            self.group_starts.get(g + 1).copied().unwrap_or(self.k),
        )
    }
}

/// Independent accumulators per row within a group: few rows leave the FMA latency exposed,
/// so the columns are split into `unroll` interleaved partial sums (combined pairwise).
pub fn unroll(rows: usize) -> usize {
    match rows {
        1 => 4,
        2 => 2,
        _ => 1,
    }
}

/// The scalar reference: the same fused operations in the same order as the SIMD tile.
pub fn tile_scalar(
    t: &Tile<'_>,
    x: &[f32],
    sums: Option<&[f32]>,
    mr: usize,
    out: &mut [[f32; BLOCK]; TILE_ROWS],
) {
    let groups = t.group_starts.len().max(1);
    let u = unroll(mr);
    for r in 0..mr {
        for (l, o) in out[r].iter_mut().enumerate() {
            let mut total = 0f32;
            for g in 0..groups {
                let (a, e) = t.bounds(g);
                let fma = |acc: f32, c: usize| {
                    f32::from(t.codes[c * BLOCK + l]).mul_add(x[r * t.k + c], acc)
                };
                let mut parts = [0f32; 4];
                let mut c = a;
                while c + u <= e {
                    for (i, p) in parts.iter_mut().enumerate().take(u) {
                        *p = fma(*p, c + i);
                    }
                    c += u;
                }
                while c < e {
                    parts[0] = fma(parts[0], c);
                    c += 1;
                }
                let mut acc = match u {
                    4 => (parts[0] + parts[1]) + (parts[2] + parts[3]),
                    2 => parts[0] + parts[1],
                    _ => parts[0],
                };
                if let (Some(z), Some(s)) = (t.zp, sums) {
                    acc = (-z[g * BLOCK + l]).mul_add(s[r * groups + g], acc);
                }
                total = acc.mul_add(t.scale[g * BLOCK + l], total);
            }
            *o = total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Tile, BLOCK, TILE_ROWS};
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU supports AVX-512F; `t.codes.len() >= t.k * 16`, `t.scale` (and `t.zp`) hold
    /// `groups * 16` values, `x.len() >= mr * t.k`, `sums` (when zero points exist) holds
    /// `mr * groups` values, `1 <= mr <= 8`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) {
        // SAFETY: the caller's contract is each kernel's contract (all arms).
        unsafe {
            match mr {
                1 => kernel::<1, 4>(t, x, sums, out),
                2 => kernel::<2, 2>(t, x, sums, out),
                3 => kernel::<3, 1>(t, x, sums, out),
                4 => kernel::<4, 1>(t, x, sums, out),
                5 => kernel::<5, 1>(t, x, sums, out),
                6 => kernel::<6, 1>(t, x, sums, out),
                7 => kernel::<7, 1>(t, x, sums, out),
                _ => kernel::<8, 1>(t, x, sums, out),
            }
        }
    }

    /// # Safety
    /// As [`tile`] with `mr == MR`; `U` is [`super::unroll`]`(MR)`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn kernel<const MR: usize, const U: usize>(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) {
        let k = t.k;
        let groups = t.group_starts.len().max(1);
        let mut total = [_mm512_setzero_ps(); MR];
        let cp = t.codes.as_ptr();
        let xp = x.as_ptr();
        // One column: 16 codes times row r's activation into partial sum `u`.
        let step = |parts: &mut [[__m512; U]; MR], c: usize, u: usize| {
            // SAFETY: callers pass c < min(e, k): the 16 codes at c * 16 lie inside the block
            // (k * 16 codes) and x[r * k + c] inside row r; the prefetch address is formed with
            // wrapping_add and a prefetch never faults.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(c * BLOCK + 1024).cast());
                let w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    cp.add(c * BLOCK).cast(),
                )));
                for (r, p) in parts.iter_mut().enumerate() {
                    p[u] = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp.add(r * k + c)), p[u]);
                }
            }
        };
        for g in 0..groups {
            let (a, e) = t.bounds(g);
            let e = e.min(k);
            let mut parts = [[_mm512_setzero_ps(); U]; MR];
            let mut c = a;
            while c + U <= e {
                for u in 0..U {
                    step(&mut parts, c + u, u);
                }
                c += U;
            }
            while c < e {
                step(&mut parts, c, 0);
                c += 1;
            }
            let mut acc = [_mm512_setzero_ps(); MR];
            for (a, p) in acc.iter_mut().zip(&parts) {
                *a = match U {
                    4 => _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])),
                    2 => _mm512_add_ps(p[0], p[1]),
                    _ => p[0],
                };
            }
            // SAFETY: g < groups: the 16 scales (and zero points) at g * 16 are in bounds.
            let s = unsafe { _mm512_loadu_ps(t.scale.as_ptr().add(g * BLOCK)) };
            if let (Some(z), Some(sm)) = (t.zp, sums) {
                // SAFETY: as for the scales.
                let vz = unsafe { _mm512_loadu_ps(z.as_ptr().add(g * BLOCK)) };
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fnmadd_ps(vz, _mm512_set1_ps(sm[r * groups + g]), *a);
                }
            }
            for (tot, a) in total.iter_mut().zip(acc) {
                *tot = _mm512_fmadd_ps(a, s, *tot);
            }
        }
        for (r, tot) in total.iter().enumerate() {
            // SAFETY: r < MR <= 8 = out.len(); each entry is 16 f32.
            unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), *tot) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, k: usize, groups: usize, asym: bool) -> (BlockedWo, Vec<i8>) {
        let q: Vec<i8> = (0..n * k).map(|i| ((i * 7919) % 255) as i8).collect();
        let scale: Vec<f32> = (0..n * groups)
            .map(|i| 1e-3 * (1 + i % 13) as f32)
            .collect();
        let zp: Vec<i8> = (0..n * groups).map(|i| (i % 15) as i8 - 7).collect();
        let starts: Vec<usize> = (0..groups).map(|g| g * k / groups).collect();
        (
            BlockedWo::new(n, k, &q, &scale, asym.then_some(&zp[..]), starts),
            q,
        )
    }

    #[test]
    fn rows_round_trip() {
        let (w, q) = sample(37, 64, 4, true);
        for j in 0..37 {
            assert_eq!(w.row(j).0, q[j * 64..(j + 1) * 64].to_vec());
        }
    }

    /// The SIMD tile equals the scalar tile bit for bit, and both match an f64 reference.
    #[test]
    fn simd_equals_scalar_and_reference() {
        for (n, k, groups, asym, m) in [
            (37, 64, 4, true, 11),
            (16, 128, 1, false, 1),
            (50, 96, 3, true, 8),
            (20, 70, 2, true, 2),
            (33, 66, 3, false, 1),
        ] {
            let (w, _) = sample(n, k, groups, asym);
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 31) % 97) as f32 / 13.0 - 3.0)
                .collect();
            let mut got = vec![0f32; m * n];
            w.gemm(&x, m, 0, w.blocks(), |r, b, lanes| {
                for (l, &v) in lanes.iter().enumerate() {
                    if b * BLOCK + l < n {
                        got[r * n + b * BLOCK + l] = v;
                    }
                }
            });
            let sums = asym.then(|| w.group_sums(&x, m));
            for b in 0..w.blocks() {
                let g = w.groups();
                let t = Tile {
                    codes: &w.codes[b * k * BLOCK..(b + 1) * k * BLOCK],
                    scale: &w.scale[b * g * BLOCK..(b + 1) * g * BLOCK],
                    zp: w
                        .zp
                        .as_ref()
                        .map(|z| &z[b * g * BLOCK..(b + 1) * g * BLOCK]),
                    k,
                    group_starts: &w.group_starts,
                };
                for r0 in (0..m).step_by(TILE_ROWS) {
                    let mr = (m - r0).min(TILE_ROWS);
                    let mut want = [[0f32; BLOCK]; TILE_ROWS];
                    tile_scalar(
                        &t,
                        &x[r0 * k..],
                        sums.as_ref().map(|s| &s[r0 * g..]),
                        mr,
                        &mut want,
                    );
                    for (rr, lanes) in want.iter().enumerate().take(mr) {
                        for (l, v) in lanes.iter().enumerate() {
                            let j = b * BLOCK + l;
                            if j < n {
                                assert_eq!(got[(r0 + rr) * n + j].to_bits(), v.to_bits());
                            }
                        }
                    }
                }
            }
            for r in 0..m {
                for j in 0..n {
                    let (codes, scale, zp) = w.row(j);
                    let mut exact = 0f64;
                    for c in 0..k {
                        let gi = c * groups / k;
                        let z = zp.as_ref().map_or(0.0, |z| f64::from(z[gi]));
                        exact += (f64::from(codes[c]) - z)
                            * f64::from(scale[gi])
                            * f64::from(x[r * k + c]);
                    }
                    let v = f64::from(got[r * n + j]);
                    assert!(
                        (v - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                        "{v} vs {exact}"
                    );
                }
            }
        }
    }
}
