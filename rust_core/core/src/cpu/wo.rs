//! Weight-only (W8A16, W4A16) weights in 16-feature blocks for fp32 FMA kernels.
//!
//! Layout: block `b` holds `[k][16]` int8 codes (feature-minor), so one 16-byte load converts to
//! one register of 16 features at one input column, multiplied by a broadcast activation; the
//! accumulators are per feature, so there is no horizontal reduction anywhere. Scales and zero
//! points are kept per block as `[groups][16]`. Numerics: per group `acc = Σ q·x` (fp32 FMA in
//! column order), then `acc -= z·Σx` (zero points), then `y += acc·s`: the fp32 compute of
//! DESIGN.md on the dequantised weights, in a fixed order that the scalar reference repeats
//! exactly (same fused operations), so every path gives identical bits.

use std::sync::Arc;

use super::arena::Arena;
use super::kernels::isa;

pub mod bf16;
pub mod fixed;

/// Features per block.
pub const BLOCK: usize = 16;
/// Activation rows per register tile.
pub const TILE_ROWS: usize = 8;
/// From this many rows the AVX-512 tile runs two blocks at once (`x86::tiles`);
/// below, each block streams alone (decode is bound by the weight stream, and its tuned
/// prefetch reads one block after another).
const PAIR_ROWS: usize = 3;

/// Blocks of zero points a symmetric 4-bit layer keeps (the most any tile reads at once).
const UNIFORM_ZP_BLOCKS: usize = 2;

#[derive(Clone, Debug)]
pub struct BlockedWo {
    pub n: usize,
    pub k: usize,
    codes: Codes,
    /// `[blocks][groups][16]`
    scale: Vec<f32>,
    /// `[blocks][groups][16]`: the zero point, plus 8 for 4-bit storage (whose stored values
    /// are code + 8); absent for symmetric int8 storage. Symmetric 4-bit storage, whose every
    /// value is that 8, keeps only [`UNIFORM_ZP_BLOCKS`] blocks of it, which every block
    /// reads ([`BlockedWo::zp_blocks`]): the tiles then stream no zero points (at one row and
    /// groups of 128, 6% of a 4-bit layer's bytes).
    zp: Option<Vec<f32>>,
    /// The scheme has zero points of its own.
    asym: bool,
    /// First (sorted) column of each group.
    group_starts: Vec<usize>,
    /// The first bf16 pair of each group and the total (see [`BlockedWo::pair_offsets`]),
    /// fixed with the groups.
    pair_offs: Vec<usize>,
    /// Every scale is finite and exactly a bf16 value (as a checkpoint's bf16 scales are), so
    /// the dequantised weights `(q - z) * s` in bf16 are compressed-tensors' own: the bf16
    /// path may widen codes straight into them (see [`bf16`]).
    scales_bf16: bool,
    /// The fixed-point kernel's column chunks (int8 codes with whole quads per group; empty
    /// otherwise; see [`fixed`]).
    chunks: Vec<fixed::Chunk>,
}

/// Bytes owned here or moved into the layer's huge-page [`Arena`].
#[derive(Clone, Debug)]
enum Bytes {
    Owned(Vec<u8>),
    Shared {
        arena: Arc<Arena>,
        offset: usize,
        len: usize,
    },
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Shared { arena, offset, len } => {
                let s = arena.slice(*offset, *len);
                // SAFETY: i8 and u8 have the same size, alignment and valid bit patterns.
                unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), s.len()) }
            }
        }
    }
}

/// The code storage of a block.
#[derive(Clone, Debug)]
enum Codes {
    /// `[blocks][k][16]` int8 (stored as their bytes), zero past `n`.
    I8(Bytes),
    /// `[blocks][ceil(k/8)][64]` bytes, the stored values `q + 8`: half the bytes to stream
    /// when every code fits 4 bits. Column pairs (`2p`, `2p + 1`) go in lines of four; see
    /// [`nibble_at`] for where a value sits in its line. Used when `k` and every group start
    /// are even, so a pair never straddles a group.
    U4(Bytes),
}

/// Where 4-bit storage keeps column `c` of lane `l` in its block: `(byte, shift)`, the value
/// being `(block[byte] >> shift) & 15`. Pair `p` (columns `2p`, `2p + 1`) lies in line
/// `p / 4` (64 bytes); read as 32 little-endian u16 words, the line's word `2l + h` holds
/// lane `l`'s column `2p + h` in bits `4s..4s + 4`, `s = p % 4`. So one load brings four
/// pairs, and pair `s`'s values, shifted down `4s` bits, sit in the low bits of the word
/// (or, as u32 lanes, of the low and high half of lane `l`) that a bf16 dot product (or a
/// lookup by lane) wants them in: a shift and a table lookup per pair, no byte shuffle.
#[inline]
pub(crate) fn nibble_at(c: usize, l: usize) -> (usize, u32) {
    let (p, h) = (c / 2, c % 2);
    (
        (p / 4) * 64 + 2 * (2 * l + h) + (p % 4) / 2,
        4 * (p % 2) as u32,
    )
}

/// Bytes of a 4-bit block of `pairs` column pairs: whole 64-byte lines.
pub(crate) fn nibble_block_len(pairs: usize) -> usize {
    pairs.div_ceil(4) * 64
}

impl Codes {
    /// The stored value of column `c`, lane `l` within a block slice: the code (int8) or the
    /// code + 8 (4-bit; the + 8 is folded into the zero point).
    #[inline]
    fn get(&self, block: &[u8], c: usize, l: usize) -> i8 {
        match self {
            Codes::I8(_) => block[c * BLOCK + l] as i8,
            Codes::U4(_) => {
                let (at, shift) = nibble_at(c, l);
                ((block[at] >> shift) & 15) as i8
            }
        }
    }
    fn bytes(&self) -> &[u8] {
        match self {
            Codes::I8(b) | Codes::U4(b) => b.as_slice(),
        }
    }
    fn storage_mut(&mut self) -> &mut Bytes {
        match self {
            Codes::I8(b) | Codes::U4(b) => b,
        }
    }
    /// Bytes per block for `k` columns.
    fn block_len(&self, k: usize) -> usize {
        match self {
            Codes::I8(_) => k * BLOCK,
            Codes::U4(_) => nibble_block_len(k.div_ceil(2)),
        }
    }
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
        let nibbles = k.is_multiple_of(2)
            && group_starts.iter().all(|g| g.is_multiple_of(2))
            && q.iter().take(n * k).all(|v| (-8..=7).contains(v));
        let mut codes = if nibbles {
            Codes::U4(Bytes::Owned(vec![
                0x88;
                blocks * nibble_block_len(k.div_ceil(2))
            ]))
        } else {
            Codes::I8(Bytes::Owned(vec![0u8; blocks * k * BLOCK]))
        };
        let mut sc = vec![0f32; blocks * groups * BLOCK];
        let bias = if nibbles { 8.0 } else { 0.0 };
        let zp_blocks = if zp.is_some() {
            blocks
        } else {
            blocks.min(UNIFORM_ZP_BLOCKS)
        };
        let mut zs = (zp.is_some() || nibbles).then(|| vec![bias; zp_blocks * groups * BLOCK]);
        for j in 0..n {
            let (b, l) = (j / BLOCK, j % BLOCK);
            for (c, &v) in q.get(j * k..(j + 1) * k).unwrap_or(&[]).iter().enumerate() {
                match &mut codes {
                    Codes::I8(Bytes::Owned(d)) => d[(b * k + c) * BLOCK + l] = v as u8,
                    Codes::U4(Bytes::Owned(d)) => {
                        let (at, shift) = nibble_at(c, l);
                        let at = b * nibble_block_len(k.div_ceil(2)) + at;
                        d[at] = (d[at] & !(15 << shift)) | (((v + 8) as u8) << shift);
                    }
                    // Built owned just above.
                    Codes::I8(Bytes::Shared { .. }) | Codes::U4(Bytes::Shared { .. }) => {}
                }
            }
            for g in 0..groups {
                let at = (b * groups + g) * BLOCK + l;
                sc[at] = scale.get(j * groups + g).copied().unwrap_or(0.0);
                if let (Some(zs), Some(z)) = (zs.as_mut(), zp) {
                    zs[at] = f32::from(z.get(j * groups + g).copied().unwrap_or(0)) + bias;
                }
            }
        }
        let pair_offs = bf16::pair_offsets(k, &group_starts);
        let scales_bf16 = sc
            .iter()
            .all(|v| v.is_finite() && v.to_bits() & 0xffff == 0);
        let chunks = match codes {
            Codes::I8(_) => fixed::chunks(k, &group_starts, 4).unwrap_or_default(),
            Codes::U4(_) => fixed::chunks(k, &group_starts, 8).unwrap_or_default(),
        };
        BlockedWo {
            n,
            k,
            codes,
            scale: sc,
            zp: zs,
            asym: zp.is_some(),
            group_starts,
            pair_offs,
            scales_bf16,
            chunks,
        }
    }

    pub fn blocks(&self) -> usize {
        self.n.div_ceil(BLOCK)
    }

    /// The code bytes (for moving them into a layer arena).
    pub fn code_bytes(&self) -> &[u8] {
        self.codes.bytes()
    }

    /// Whether the codes already live in a shared arena.
    pub fn is_shared(&self) -> bool {
        matches!(
            self.codes,
            Codes::I8(Bytes::Shared { .. }) | Codes::U4(Bytes::Shared { .. })
        )
    }

    /// Points the codes at `arena` at `offset` (where [`Arena::build`] copied them).
    pub fn share(&mut self, arena: &Arc<Arena>, offset: usize) {
        let len = self.codes.bytes().len();
        *self.codes.storage_mut() = Bytes::Shared {
            arena: Arc::clone(arena),
            offset,
            len,
        };
    }
    /// First (sorted) column of each group.
    pub fn group_starts(&self) -> &[usize] {
        &self.group_starts
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
        let len = self.codes.block_len(self.k);
        let block = &self.codes.bytes()[b * len..(b + 1) * len];
        let bias = if matches!(self.codes, Codes::U4(_)) {
            8
        } else {
            0
        };
        let codes = (0..self.k)
            .map(|c| self.codes.get(block, c, l) - bias)
            .collect();
        let scale = (0..g)
            .map(|i| self.scale[(b * g + i) * BLOCK + l])
            .collect();
        let zp = self.zp.as_ref().filter(|_| self.asym).map(|z| {
            (0..g)
                .map(|i| z[(b * g + i) * BLOCK + l] as i8 - bias)
                .collect()
        });
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

    /// The zero points of blocks `b..b + nb` (`[nb][groups][16]`): `None` without zero points,
    /// `Some(None)` past the layer's blocks. A symmetric 4-bit layer's are the same for every
    /// block, and every block reads the one copy kept.
    fn zp_blocks(&self, b: usize, nb: usize) -> Option<Option<&[f32]>> {
        let per = self.groups() * BLOCK;
        let first = if self.asym { b } else { 0 };
        self.zp.as_ref().map(|z| {
            (b + nb <= self.blocks())
                .then(|| z.get(first * per..(first + nb) * per))
                .flatten()
        })
    }

    /// Block `b`'s codes, scales and zero points (`b < self.blocks()`).
    fn tile(&self, b: usize) -> Tile<'_> {
        let (g, len) = (self.groups(), self.codes.block_len(self.k));
        Tile {
            storage: &self.codes,
            codes: &self.codes.bytes()[b * len..(b + 1) * len],
            scale: &self.scale[b * g * BLOCK..(b + 1) * g * BLOCK],
            zp: self.zp_blocks(b, 1).map(|z| z.unwrap_or(&[])),
            k: self.k,
            group_starts: &self.group_starts,
        }
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
        let (simd, avx2, neon) = (isa().avx512(), isa().avx2_fma(), isa().neon());
        // The AVX2 tile reads 4-bit codes scaled by powers of two, and the inputs scaled back
        // (`avx2::prescale`), once per call for all blocks.
        #[cfg(target_arch = "x86_64")]
        let scaled = (avx2 && !simd && matches!(self.codes, Codes::U4(_)))
            .then(|| avx2::prescale(&x[..m * self.k], self.k));
        #[cfg(target_arch = "x86_64")]
        let x = scaled.as_deref().unwrap_or(x);
        let g = self.groups();
        let mut b = first_block;
        while b < end {
            // Two blocks at a time where the AVX-512 pair applies (`PAIR_ROWS`), else one.
            let nb = if cfg!(target_arch = "x86_64") && simd && m >= PAIR_ROWS && b + 1 < end {
                2
            } else {
                1
            };
            let tiles = [self.tile(b), self.tile(b + nb - 1)];
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(TILE_ROWS);
                let xs = &x[r * self.k..(r + mr) * self.k];
                let ss = sums.as_ref().map(|s| &s[r * g..(r + mr) * g]);
                let mut out = [[[0f32; BLOCK]; TILE_ROWS]; 2];
                if simd {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: AVX-512F detected by `isa()`; each tile's slices hold one block
                    // of this layer (k x 16 int8 codes or ceil(k/8) x 64 nibble bytes,
                    // groups x 16 scales; a pair shares storage, k and groups) and `xs`/`ss`
                    // hold `mr` rows.
                    unsafe {
                        let [o0, o1] = &mut out;
                        if nb == 2 {
                            x86::tiles([&tiles[0], &tiles[1]], xs, ss, mr, [o0, o1]);
                        } else {
                            x86::tiles([&tiles[0]], xs, ss, mr, [o0]);
                        }
                    }
                } else if avx2 {
                    #[cfg(target_arch = "x86_64")]
                    avx2::tile_prescaled(&tiles[0], xs, ss, mr, &mut out[0]);
                } else if neon {
                    #[cfg(target_arch = "aarch64")]
                    neon::tile(&tiles[0], xs, ss, mr, &mut out[0]);
                } else {
                    tile_scalar(&tiles[0], xs, ss, mr, &mut out[0]);
                }
                for (bb, block) in out.iter().enumerate().take(nb) {
                    for (rr, lanes) in block.iter().enumerate().take(mr) {
                        emit(r + rr, b + bb, lanes);
                    }
                }
                r += mr;
            }
            b += nb;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(v) = scaled {
            super::spare::give(v);
        }
    }
}

/// One block's weights.
pub struct Tile<'a> {
    storage: &'a Codes,
    codes: &'a [u8],
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
                    f32::from(t.storage.get(t.codes, c, l)).mul_add(x[r * t.k + c], acc)
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

    /// How far ahead (bytes) the weight stream is prefetched.
    const PF_DIST: usize = 4096;

    /// `NB` blocks (one, or a pair) over the same rows, `ts[i]` into `outs[i]`. With a pair,
    /// each broadcast activation feeds a multiply-add for both blocks: with one broadcast per
    /// multiply-add the tile ran at about half the FMA peak (one thread, 8-64 rows: int8 43-56
    /// GMAC/s, int4 43, against the 81 of the `vfmadd` probe); with two, 67 and 61. Every
    /// block's sums are the same, bit for bit, alone or paired.
    ///
    /// # Safety
    /// The CPU supports AVX-512F; the blocks share storage, `k` and groups; each block's
    /// `codes.len() >= k * 16` (int8 codes) or `>= ceil(k / 8) * 64` (nibble lines, which
    /// go to `kernel4`), its `scale` (and `zp`) hold `groups * 16` values; `x.len() >= mr * k`,
    /// `sums` (when zero points exist) holds `mr * groups` values, `1 <= mr <= 8`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tiles<const NB: usize>(
        ts: [&Tile<'_>; NB],
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        outs: [&mut [[f32; BLOCK]; TILE_ROWS]; NB],
    ) {
        // The kernels take the row count and unroll as constants: one arm per row count.
        macro_rules! by_rows {
            ($kernel:ident) => {
                match mr {
                    1 => $kernel::<1, 4, NB>(ts, x, sums, outs),
                    2 => $kernel::<2, 2, NB>(ts, x, sums, outs),
                    3 => $kernel::<3, 1, NB>(ts, x, sums, outs),
                    4 => $kernel::<4, 1, NB>(ts, x, sums, outs),
                    5 => $kernel::<5, 1, NB>(ts, x, sums, outs),
                    6 => $kernel::<6, 1, NB>(ts, x, sums, outs),
                    7 => $kernel::<7, 1, NB>(ts, x, sums, outs),
                    _ => $kernel::<8, 1, NB>(ts, x, sums, outs),
                }
            };
        }
        // SAFETY: the caller's contract is each kernel's contract (all arms).
        unsafe {
            if matches!(ts[0].storage, super::Codes::U4(_)) {
                by_rows!(kernel4)
            } else {
                by_rows!(kernel)
            }
        }
    }

    /// The end of a group, shared by both kernels: the partial sums combined pairwise, the
    /// zero-point term `z * Σx` subtracted, and `acc * scale` added to the row totals.
    /// Straight-line code with unchecked reads: with a check per read the compiler kept
    /// branches in every group's epilogue.
    ///
    /// # Safety
    /// AVX-512F; `g < groups`; `t.scale` (and `t.zp`) hold `groups * 16` values and `sums`,
    /// when given, `MR * groups` (the contract of [`tiles`]).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn finish_group<const MR: usize, const U: usize>(
        parts: &[[__m512; U]; MR],
        t: &Tile<'_>,
        g: usize,
        sums: Option<&[f32]>,
        total: &mut [__m512; MR],
    ) {
        let groups = t.group_starts.len().max(1);
        let mut acc = [_mm512_setzero_ps(); MR];
        for (a, p) in acc.iter_mut().zip(parts) {
            *a = match U {
                4 => _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])),
                2 => _mm512_add_ps(p[0], p[1]),
                _ => p[0],
            };
        }
        // SAFETY: g < groups: the 16 scales at g * 16 lie inside `t.scale` (groups * 16).
        let s = unsafe { _mm512_loadu_ps(t.scale.as_ptr().add(g * BLOCK)) };
        if let (Some(z), Some(sm)) = (t.zp, sums) {
            // SAFETY: as the scales, inside `t.zp` (groups * 16).
            let vz = unsafe { _mm512_loadu_ps(z.as_ptr().add(g * BLOCK)) };
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: r < MR, g < groups: inside `sums` (MR * groups).
                let v = unsafe { *sm.as_ptr().add(r * groups + g) };
                *a = _mm512_fnmadd_ps(vz, _mm512_set1_ps(v), *a);
            }
        }
        for (tot, a) in total.iter_mut().zip(acc) {
            *tot = _mm512_fmadd_ps(a, s, *tot);
        }
    }

    /// `NB` blocks of int8 codes (the same `k` and groups) over the same rows.
    ///
    /// # Safety
    /// As [`tiles`] with `mr == MR`; `U` is [`super::unroll`]`(MR)`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn kernel<const MR: usize, const U: usize, const NB: usize>(
        ts: [&Tile<'_>; NB],
        x: &[f32],
        sums: Option<&[f32]>,
        outs: [&mut [[f32; BLOCK]; TILE_ROWS]; NB],
    ) {
        let t = ts[0];
        let k = t.k;
        let groups = t.group_starts.len().max(1);
        let mut total = [[_mm512_setzero_ps(); MR]; NB];
        let cps = ts.map(|t| t.codes.as_ptr().cast::<i8>());
        let block_len = t.codes.len();
        let xp = x.as_ptr();
        // One column: each block's 16 codes times row r's activation into partial sum `u`.
        let step = |parts: &mut [[[__m512; U]; MR]; NB], c: usize, u: usize| {
            // SAFETY: callers pass c < min(e, k): the 16 codes at c * 16 lie inside each
            // block (k * 16 codes) and x[r * k + c] inside row r.
            unsafe {
                let w = cps.map(|cp| {
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        cp.add(c * BLOCK).cast(),
                    )))
                });
                for r in 0..MR {
                    let xv = _mm512_set1_ps(*xp.add(r * k + c));
                    for (p, wb) in parts.iter_mut().zip(w) {
                        p[r][u] = _mm512_fmadd_ps(wb, xv, p[r][u]);
                    }
                }
            }
        };
        // Columns per batch, one block: whole runs of U, and at least the 4 columns of a
        // 64-byte line, whose prefetches (ahead in this block, and in the next, which the same
        // task usually reads next) are then issued once per batch, not tested for at every
        // column. Two blocks: a run of U, prefetching at each line's first column (with 4
        // columns per step the pair ran at 48-56 GMAC/s, with one at 67).
        let batch = if NB > 1 { U } else { U.max(4) };
        for g in 0..groups {
            let (a, e) = t.bounds(g);
            let e = e.min(k);
            let mut parts = [[[_mm512_setzero_ps(); U]; MR]; NB];
            let mut c = a;
            // Batches start at multiples of U from `a`: column c + q goes to partial q % U, as
            // in the runs below.
            while c + batch <= e {
                for q in (0..batch).step_by(4) {
                    let at = (c + q) * BLOCK;
                    if NB > 1 && !at.is_multiple_of(64) {
                        continue;
                    }
                    for cp in cps {
                        // The addresses are formed with wrapping_add; a prefetch never faults.
                        _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(at + PF_DIST).cast());
                        _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(at + NB * block_len).cast());
                    }
                }
                for q in 0..batch {
                    step(&mut parts, c + q, q % U);
                }
                c += batch;
            }
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
            for ((p, t), tot) in parts.iter().zip(ts).zip(total.iter_mut()) {
                // SAFETY: g < groups; the caller's contract covers the scales, zero points
                // and sums.
                unsafe { finish_group(p, t, g, sums, tot) };
            }
        }
        for (out, tot) in outs.into_iter().zip(total) {
            for (r, v) in tot.iter().enumerate() {
                // SAFETY: r < MR <= 8 = out.len(); each entry is 16 f32.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), *v) };
            }
        }
    }

    /// The 4-bit kernel over `NB` blocks: one 64-byte line holds four column pairs for 16 features.
    /// Columns go to the same partial sums, in the same order, as in [`kernel`] (groups start
    /// at even columns and `U` is even or 1, so a byte never straddles a chunk), hence
    /// identical results.
    ///
    /// # Safety
    /// As [`kernel`], with each block's codes holding `ceil(k / 8) * 64` bytes and `k` even.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn kernel4<const MR: usize, const U: usize, const NB: usize>(
        ts: [&Tile<'_>; NB],
        x: &[f32],
        sums: Option<&[f32]>,
        outs: [&mut [[f32; BLOCK]; TILE_ROWS]; NB],
    ) {
        let t = ts[0];
        let k = t.k;
        let groups = t.group_starts.len().max(1);
        let mut total = [[_mm512_setzero_ps(); MR]; NB];
        let cps = ts.map(|t| t.codes.as_ptr());
        let block_len = t.codes.len();
        let xp = x.as_ptr();
        // The 16 stored values as floats, looked up by a permute: it reads only the low 4 bits
        // of each index, so one instruction turns a nibble into its float (a mask and a
        // conversion would take two) and gives the same floats, hence the same sums.
        let values = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        // Each block's line holding pair p (columns 2p, 2p + 1).
        let lines = |p: usize| {
            // SAFETY: callers pass pairs inside the group (2p + 1 < e <= k): line p / 4 lies
            // inside each block of ceil(k / 8) * 64 bytes (stored + 8; the 8 is in the zero
            // point).
            cps.map(|cp| unsafe { _mm512_loadu_si512(cp.add((p / 4) * 64).cast()) })
        };
        // Columns c and c + 1 of every block into partial sums `ul` and `uh`, from the lines'
        // lanes shifted down 4 * ((c / 2) % 4) bits: column c in bits 0..4, c + 1 in bits
        // 16..20 (`super::nibble_at`).
        let pair_of = |parts: &mut [[[__m512; U]; MR]; NB],
                       v: [__m512i; NB],
                       c: usize,
                       ul: usize,
                       uh: usize| {
            let mut lo = [_mm512_setzero_ps(); NB];
            let mut hi = [_mm512_setzero_ps(); NB];
            for b in 0..NB {
                lo[b] = _mm512_permutexvar_ps(v[b], values);
                hi[b] = _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(v[b]), values);
            }
            for r in 0..MR {
                // SAFETY: c + 1 < e <= k: x[r * k + c] and the next lie inside row r.
                let xv = _mm512_set1_ps(unsafe { *xp.add(r * k + c) });
                for (p, l) in parts.iter_mut().zip(lo) {
                    p[r][ul] = _mm512_fmadd_ps(l, xv, p[r][ul]);
                }
            }
            for r in 0..MR {
                // SAFETY: as above.
                let xv = _mm512_set1_ps(unsafe { *xp.add(r * k + c + 1) });
                for (p, h) in parts.iter_mut().zip(hi) {
                    p[r][uh] = _mm512_fmadd_ps(h, xv, p[r][uh]);
                }
            }
        };
        let pair = |parts: &mut [[[__m512; U]; MR]; NB], c: usize, ul: usize, uh: usize| {
            let p = c / 2;
            let shift = _mm_cvtsi32_si128((4 * (p % 4)) as i32);
            pair_of(
                parts,
                lines(p).map(|v| _mm512_srl_epi32(v, shift)),
                c,
                ul,
                uh,
            );
        };
        for g in 0..groups {
            let (a, e) = t.bounds(g);
            let e = e.min(k);
            // Columns below `full` go round-robin to U partial sums, the rest to partial 0.
            let full = a + (e.saturating_sub(a) / U) * U;
            let mut parts = [[[_mm512_setzero_ps(); U]; MR]; NB];
            let mut c = a;
            // One block: batches of whole runs of U columns and at least the 8 columns of a
            // 64-byte line (4 pairs), whose prefetches (ahead in this block, and in the
            // next) are then issued once per batch. Two blocks: batches of one pair (or a
            // run of U), prefetching at each line's first; with four pairs in the loop body
            // the compiler hoisted their loads and spilled the partial sums. Column c + o goes
            // to partial o % U, as in the runs below.
            let batch = if NB > 1 { U.max(2) } else { U.max(8) };
            // (`full` is `e` when U is 1.)
            while c + batch <= full {
                let at = (c / 2) * BLOCK;
                if NB == 1 || at.is_multiple_of(64) {
                    for cp in cps {
                        // The addresses are formed with wrapping_add; a prefetch never faults.
                        _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(at + PF_DIST).cast());
                        _mm_prefetch::<_MM_HINT_T0>(cp.wrapping_add(at + NB * block_len).cast());
                    }
                }
                if NB == 1 && batch == 8 && (c / 2).is_multiple_of(4) {
                    // One whole line: loaded once, its four pairs by constant shifts.
                    let v = lines(c / 2);
                    pair_of(&mut parts, v, c, 0, 1 % U);
                    let sh = |n: u32| v.map(|v| _mm512_srl_epi32(v, _mm_cvtsi32_si128(n as i32)));
                    pair_of(&mut parts, sh(4), c + 2, 2 % U, 3 % U);
                    pair_of(&mut parts, sh(8), c + 4, 4 % U, 5 % U);
                    pair_of(&mut parts, sh(12), c + 6, 6 % U, 7 % U);
                } else {
                    for o in (0..batch).step_by(2) {
                        pair(&mut parts, c + o, o % U, (o + 1) % U);
                    }
                }
                c += batch;
            }
            if U >= 2 {
                while c < full {
                    for q in 0..U / 2 {
                        pair(&mut parts, c + 2 * q, 2 * q, 2 * q + 1);
                    }
                    c += U;
                }
            }
            while c + 1 < e {
                pair(&mut parts, c, 0, 0);
                c += 2;
            }
            for ((p, t), tot) in parts.iter().zip(ts).zip(total.iter_mut()) {
                // SAFETY: g < groups; the caller's contract covers the scales, zero points
                // and sums.
                unsafe { finish_group(p, t, g, sums, tot) };
            }
        }
        for (out, tot) in outs.into_iter().zip(total) {
            for (r, v) in tot.iter().enumerate() {
                // SAFETY: r < MR <= 8 = out.len(); each entry is 16 f32.
                unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), *v) };
            }
        }
    }
}

/// The weight-only tile of the CPUs whose registers hold less than a block (AVX2: two
/// registers of 8 lanes; NEON: four of 4), written once: [`tile_scalar`]'s operations in its
/// order (fused multiply-adds per column into `unroll(mr)` partial sums, the same pairwise
/// combination and group epilogue), so the results are identical. (AVX2 decodes a 4-bit
/// column as its code times `2^avx2::shift(c)`, exactly, and its tile takes inputs that
/// `avx2::prescale` scaled back: the same products.) Each architecture supplies
/// the register operations ([`Lanes`]) and runs [`pass`] inside a function compiled for its
/// features, where the operations inline. Rows go in passes of up to four (each row's
/// operations do not depend on the others), which keeps the partial sums in registers.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod lanes {
    use super::{unroll, Codes, Tile, BLOCK, TILE_ROWS};

    /// The 16 features of a block, in registers.
    pub trait Lanes: Copy {
        /// All zeros.
        ///
        /// # Safety (this and every method below)
        /// The CPU has the architecture's features (the methods are meant to inline into a
        /// function compiled for them).
        unsafe fn zero() -> Self;
        /// Column `c`'s 16 stored values as floats (4-bit: its nibbles in the line of pair `c / 2`;
        /// AVX2 gives them times `2^avx2::shift(c)`, for inputs `avx2::prescale` scaled).
        ///
        /// # Safety
        /// The CPU has the architecture's features; `c < t.k` and `t.codes` holds the whole
        /// block (`k * 16` bytes, `ceil(k / 8) * 64` for 4-bit storage).
        unsafe fn column(t: &Tile<'_>, c: usize) -> Self;
        /// Columns `c` and `c + 1` of 4-bit storage: pair `c / 2` of its line,
        /// decoded together (the default decodes each).
        ///
        /// # Safety
        /// As [`Lanes::column`] for both columns; `c` is even.
        #[inline(always)]
        unsafe fn column_pair(t: &Tile<'_>, c: usize) -> (Self, Self) {
            // SAFETY: the caller's contract covers both columns.
            unsafe { (Self::column(t, c), Self::column(t, c + 1)) }
        }
        /// The eight columns `c..c + 8` of 4-bit storage, `c` a multiple of 8: one whole line,
        /// as [`Lanes::column_pair`] gives them (the default calls it four times).
        ///
        /// # Safety
        /// As [`Lanes::column`] for all eight columns; `c` is a multiple of 8.
        #[inline(always)]
        unsafe fn line_columns(t: &Tile<'_>, c: usize) -> [Self; 8] {
            // SAFETY: the caller's contract covers the four pairs.
            // Written out rather than mapped: a closure is not compiled for the
            // architecture's features, and the operations would not inline into it.
            unsafe {
                let (p0, p1) = (Self::column_pair(t, c), Self::column_pair(t, c + 2));
                let (p2, p3) = (Self::column_pair(t, c + 4), Self::column_pair(t, c + 6));
                [p0.0, p0.1, p1.0, p1.1, p2.0, p2.1, p3.0, p3.1]
            }
        }
        /// Asks for the cache line at `p` ahead of its use (nothing, by default).
        ///
        /// # Safety
        /// The CPU has the architecture's features; `p` may be any address (a prefetch never
        /// faults).
        #[inline(always)]
        unsafe fn prefetch(_p: *const u8) {}
        /// Sixteen floats at `p`.
        ///
        /// # Safety
        /// As [`Lanes::column`]; `p` points at 16 readable f32.
        unsafe fn load(p: *const f32) -> Self;
        /// `acc + w * x`, fused (the scalar `w.mul_add(x, acc)`).
        unsafe fn fma(acc: Self, w: Self, x: f32) -> Self;
        /// `tot + a * s`, fused (the scalar `a.mul_add(s, tot)`).
        unsafe fn fma_lanes(tot: Self, a: Self, s: Self) -> Self;
        /// `acc - z * v`, fused (the scalar `(-z).mul_add(v, acc)`).
        unsafe fn fnma(acc: Self, z: Self, v: f32) -> Self;
        /// `a + b`.
        unsafe fn add(a: Self, b: Self) -> Self;
        /// Stores the 16 lanes.
        unsafe fn store(self, out: &mut [f32; BLOCK]);
        /// [`pass`] for `Self` in a function compiled for the architecture's features (where
        /// the operations above inline).
        ///
        /// # Safety
        /// As [`pass`], the CPU having the features.
        unsafe fn pass_compiled<const R: usize, const U: usize>(
            t: &Tile<'_>,
            x: &[f32],
            sums: Option<&[f32]>,
            out: &mut [[f32; BLOCK]],
        );
    }

    /// The sizes a pass reads fit: codes, scales, zero points, `mr` rows of `x` and of the
    /// sums, at most [`TILE_ROWS`] rows.
    fn fits(t: &Tile<'_>, x: &[f32], sums: Option<&[f32]>, mr: usize) -> bool {
        let groups = t.group_starts.len().max(1);
        let need = t.storage.block_len(t.k);
        t.codes.len() >= need
            && x.len() >= mr * t.k
            && t.scale.len() >= groups * BLOCK
            && t.zp.is_none_or(|z| z.len() >= groups * BLOCK)
            && sums.is_none_or(|s| s.len() >= mr * groups)
            && mr <= TILE_ROWS
    }

    /// Rows `0..mr` in passes of up to four, each with `unroll(mr)` (the whole tile's)
    /// partial sums, through [`Lanes::pass_compiled`]. Returns `false`, having done nothing,
    /// when the operand sizes do not fit ([`fits`]).
    ///
    /// # Safety
    /// The CPU has `L`'s features.
    pub unsafe fn tile<L: Lanes>(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) -> bool {
        if !fits(t, x, sums, mr) {
            return false;
        }
        let groups = t.group_starts.len().max(1);
        let u = unroll(mr);
        let mut r0 = 0;
        while r0 < mr {
            let rows = (mr - r0).min(4);
            let xs = &x[r0 * t.k..];
            let ss = sums.map(|s| &s[r0 * groups..]);
            let dst = &mut out[r0..r0 + rows];
            // SAFETY: the CPU has `L`'s features (the caller's contract); `fits` held for all
            // `mr` rows, so for this pass's `rows` rows from r0 too.
            unsafe {
                match (rows, u) {
                    (1, 4) => L::pass_compiled::<1, 4>(t, xs, ss, dst),
                    (2, 2) => L::pass_compiled::<2, 2>(t, xs, ss, dst),
                    (1, _) => L::pass_compiled::<1, 1>(t, xs, ss, dst),
                    (2, _) => L::pass_compiled::<2, 1>(t, xs, ss, dst),
                    (3, _) => L::pass_compiled::<3, 1>(t, xs, ss, dst),
                    _ => L::pass_compiled::<4, 1>(t, xs, ss, dst),
                }
            }
            r0 += rows;
        }
        true
    }

    /// `R` rows of the tile with `U` partial sums per group.
    ///
    /// # Safety
    /// The CPU has the features `L`'s operations need, and the caller is compiled with them
    /// (so that they inline); [`fits`] holds for `R` rows; `out` has `R` rows.
    #[inline(always)]
    pub unsafe fn pass<L: Lanes, const R: usize, const U: usize>(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        out: &mut [[f32; BLOCK]],
    ) {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            match t.storage {
                Codes::I8(_) => pass_of::<L, R, U, false>(t, x, sums, out),
                Codes::U4(_) => pass_of::<L, R, U, true>(t, x, sums, out),
            }
        }
    }

    /// How far ahead (bytes) a pass prefetches its weight stream.
    const PF_DIST: usize = 4096;

    /// [`pass`] for one storage: `NIBBLES` for 4-bit codes, whose columns go in pairs (the two
    /// nibbles of a pair, decoded together; groups start at even columns, see
    /// [`Codes::U4`]). Whole 64-byte lines of a block go with their partial sums known at
    /// compile time, so they stay in registers; what is left of a group goes column by column.
    /// Column `c` goes to partial sum `(c - a) % U` below `full`, to partial 0 after it, in
    /// both, as in [`super::tile_scalar`].
    ///
    /// # Safety
    /// As [`pass`]; `NIBBLES` matches `t.storage`.
    #[inline(always)]
    unsafe fn pass_of<L: Lanes, const R: usize, const U: usize, const NIBBLES: bool>(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        out: &mut [[f32; BLOCK]],
    ) {
        // SAFETY (every `L::` call below): the CPU has `L`'s features and this body is
        // compiled with them (the caller's contract); the pointer and column arguments are
        // in bounds as each comment says.
        let groups = t.group_starts.len().max(1);
        let k = t.k;
        let xp = x.as_ptr();
        let cp = t.codes.as_ptr();
        let block_len = t.codes.len();
        // Columns per 64-byte line of the block.
        let line = if NIBBLES { 8 } else { 4 };
        let byte_row = |c: usize| if NIBBLES { c / 2 } else { c };
        // Row r's activation at column c.
        let xv = |r: usize, c: usize| {
            debug_assert!(r < R && c < k);
            // SAFETY: callers pass r < R and c < k; `fits` gave x.len() >= R * k.
            unsafe { *xp.add(r * k + c) }
        };
        // Whole lines hold whole runs of U columns (U is 1, 2 or 4).
        debug_assert!(line % U == 0);
        // SAFETY: see the note above.
        let mut total = [unsafe { L::zero() }; R];
        for g in 0..groups {
            let (a, e) = t.bounds(g);
            let e = e.min(k);
            let full = a + (e.saturating_sub(a) / U) * U;
            // SAFETY: see the note above.
            let mut parts = [[unsafe { L::zero() }; U]; R];
            let mut c = a;
            // Whole lines below `full`: c - a is a multiple of `line`, hence of U, so column
            // c + o goes to partial o % U.
            while c + line <= full {
                let at = byte_row(c) * BLOCK;
                // SAFETY: a prefetch never faults; the addresses are formed with wrapping_add.
                unsafe {
                    L::prefetch(cp.wrapping_add(at + PF_DIST));
                    L::prefetch(cp.wrapping_add(at + block_len));
                }
                if NIBBLES && c.is_multiple_of(8) {
                    // SAFETY: c + 7 < full <= k and c is a multiple of 8: the line of pairs
                    // c / 2..c / 2 + 4 lies inside the block.
                    let w = unsafe { L::line_columns(t, c) };
                    for (r, p) in parts.iter_mut().enumerate() {
                        for (o, &w) in w.iter().enumerate() {
                            // SAFETY: see the note above; r < R, c + o < k.
                            unsafe { p[o % U] = L::fma(p[o % U], w, xv(r, c + o)) };
                        }
                    }
                } else if NIBBLES {
                    for o in (0..8).step_by(2) {
                        // SAFETY: c + o + 1 < full <= k, c + o even (a is even): the line of pair
                        // (c + o) / 2 lies inside the block.
                        let (w0, w1) = unsafe { L::column_pair(t, c + o) };
                        for (r, p) in parts.iter_mut().enumerate() {
                            // SAFETY: see the note above; r < R, c + o + 1 < k.
                            unsafe {
                                p[o % U] = L::fma(p[o % U], w0, xv(r, c + o));
                                p[(o + 1) % U] = L::fma(p[(o + 1) % U], w1, xv(r, c + o + 1));
                            }
                        }
                    }
                } else {
                    for o in 0..4 {
                        // SAFETY: c + o < full <= k: column c + o lies inside the block.
                        let w = unsafe { L::column(t, c + o) };
                        for (r, p) in parts.iter_mut().enumerate() {
                            // SAFETY: see the note above; r < R, c + o < k.
                            unsafe { p[o % U] = L::fma(p[o % U], w, xv(r, c + o)) };
                        }
                    }
                }
                c += line;
            }
            let slot = |c: usize| if c < full { (c - a) % U } else { 0 };
            while c < e {
                if NIBBLES && c.is_multiple_of(2) && c + 1 < e {
                    // SAFETY: c + 1 < e <= k, c even: the line of pair c / 2 lies inside the block.
                    let (w0, w1) = unsafe { L::column_pair(t, c) };
                    let (s0, s1) = (slot(c), slot(c + 1));
                    for (r, p) in parts.iter_mut().enumerate() {
                        // SAFETY: see the note above; r < R, c + 1 < k.
                        unsafe {
                            p[s0] = L::fma(p[s0], w0, xv(r, c));
                            p[s1] = L::fma(p[s1], w1, xv(r, c + 1));
                        }
                    }
                    c += 2;
                } else {
                    // SAFETY: c < e <= k; the caller's contract covers the block.
                    let w = unsafe { L::column(t, c) };
                    let s = slot(c);
                    for (r, p) in parts.iter_mut().enumerate() {
                        // SAFETY: see the note above; r < R, c < k.
                        unsafe { p[s] = L::fma(p[s], w, xv(r, c)) };
                    }
                    c += 1;
                }
            }
            // SAFETY: the caller's contract: scale (and zp) hold groups * 16 values, g < groups.
            let sc = unsafe { L::load(t.scale.as_ptr().add(g * BLOCK)) };
            let z = t.zp.map(|z| {
                // SAFETY: as above.
                unsafe { L::load(z.as_ptr().add(g * BLOCK)) }
            });
            for (r, (p, tot)) in parts.iter().zip(total.iter_mut()).enumerate() {
                // SAFETY: see the note above.
                unsafe {
                    let mut acc = match U {
                        4 => L::add(L::add(p[0], p[1]), L::add(p[2], p[3])),
                        2 => L::add(p[0], p[1]),
                        _ => p[0],
                    };
                    if let (Some(z), Some(s)) = (z, sums) {
                        acc = L::fnma(acc, z, s[r * groups + g]);
                    }
                    *tot = L::fma_lanes(*tot, acc, sc);
                }
            }
        }
        for (o, tot) in out.iter_mut().zip(total) {
            // SAFETY: see the note above.
            unsafe { tot.store(o) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::lanes::{self, Lanes};
    use super::{Codes, Tile, BLOCK, TILE_ROWS};
    use std::arch::x86_64::*;

    /// The AVX2 + FMA weight-only tile ([`lanes`]), for AVX2 CPUs without AVX-512 (which
    /// otherwise ran the scalar tile, ~40x slower), on inputs as they are: 4-bit layers'
    /// are scaled here first ([`prescale`]; the GEMM does that once per call and calls
    /// [`tile_prescaled`]).
    #[cfg(test)]
    pub fn tile(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) {
        match t.storage {
            Codes::U4(_) => {
                let xs = prescale(&x[..mr * t.k], t.k);
                tile_prescaled(t, &xs, sums, mr, out);
                super::super::spare::give(xs);
            }
            Codes::I8(_) => tile_prescaled(t, x, sums, mr, out),
        }
    }

    /// Where the AVX2 tile finds a 4-bit column's value: column `c` is decoded as its code
    /// times `2^shift(c)` (masked in place in its 32-bit lane rather than shifted down, which
    /// saves a shift per column on ports that the conversions and FMAs also need), and
    /// [`prescale`] multiplies the inputs by `2^-shift(c)`. The odd column of a line's last pair
    /// sits in the lane's sign bits and is shifted down instead (`shift` 0).
    pub fn shift(c: usize) -> u32 {
        let (q, h) = ((c / 2) % 4, c % 2);
        if h == 1 && q == 3 {
            0
        } else {
            4 * q as u32 + 16 * h as u32
        }
    }

    /// `x` (rows of `k`) with column `c` multiplied by `2^-shift(c)`, in a spare buffer (give
    /// it back with `spare::give`). Powers of two: each product `(code * 2^s) * (x * 2^-s)`
    /// equals `code * x` exactly, so the tile's results are the scalar tile's bit for bit,
    /// unless `|x|` is below `2^-98` (then `x * 2^-28` is subnormal and may lose bits).
    pub fn prescale(x: &[f32], k: usize) -> Vec<f32> {
        // The factors repeat every line (8 columns).
        let f: [f32; 8] = std::array::from_fn(|c| f32::from_bits((127 - shift(c)) << 23));
        let mut out = super::super::spare::take_any(x.len(), 0f32);
        for (o, row) in out.chunks_mut(k.max(1)).zip(x.chunks(k.max(1))) {
            // Whole lines eight at a time where AVX2 runs (it does wherever the tile does),
            // what is left one by one; both from a line's start, so column j takes f[j % 8].
            let done = if detected() {
                let whole = row.len() / 8 * 8;
                // SAFETY: AVX2 detected just before; both slices hold `whole` floats.
                unsafe { scale_lines(&mut o[..whole], &row[..whole], &f) };
                whole
            } else {
                0
            };
            for ((o, &v), f) in o[done..].iter_mut().zip(&row[done..]).zip(f.iter().cycle()) {
                *o = v * f;
            }
        }
        out
    }

    /// `out[8 i + j] = x[8 i + j] * f[j]`, eight at a time: a GEMM call of many rows
    /// prescales all of them, once per panel where the threads split a projection's features
    /// (scalar, that was ~0.6 ms for 1024 x 2048 inputs).
    ///
    /// # Safety
    /// AVX2; `out` and `x` hold the same multiple of 8 floats.
    #[target_feature(enable = "avx2")]
    unsafe fn scale_lines(out: &mut [f32], x: &[f32], f: &[f32; 8]) {
        debug_assert!(out.len() == x.len() && x.len().is_multiple_of(8));
        // SAFETY: the caller's contract: 8 readable floats at `f`, at every 8th of `x` and
        // writable at every 8th of `out`, unaligned loads and stores.
        unsafe {
            let fv = _mm256_loadu_ps(f.as_ptr());
            for i in (0..x.len().min(out.len())).step_by(8) {
                let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), fv);
                _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            }
        }
    }

    /// [`tile`] on inputs that [`prescale`] scaled where the layer has 4-bit codes (int8
    /// layers' as they are).
    pub fn tile_prescaled(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) {
        // SAFETY: AVX2 and FMA detected just before (`detected`).
        let ran = detected() && unsafe { lanes::tile::<Avx2>(t, x, sums, mr, out) };
        // The callers' slices always fit and they dispatch here only with AVX2 and FMA; a
        // future caller's mistake shows here in debug builds instead of as zeros.
        debug_assert!(
            ran,
            "AVX2 weight-only tile: operand sizes or CPU do not fit"
        );
    }

    /// The CPU runs this tile (AVX2 and FMA).
    pub fn detected() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// Two registers: the 16 features of one block.
    #[derive(Clone, Copy)]
    struct Avx2([__m256; 2]);

    /// One line's 16 u32 lanes (`a`: lanes 0..8, `b`: 8..16; lane `l` holds words `2l` and
    /// `2l + 1`, see `super::nibble_at`): the line's column `o` (0..8) as floats scaled by
    /// `2^shift(o)`, the lanes masked to its nibble, or for column 7 (the lanes' top bits)
    /// shifted down to it.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn column_of_line(a: __m256i, b: __m256i, o: usize) -> Avx2 {
        // SAFETY: the caller's contract (AVX2).
        unsafe {
            if o == 7 {
                Avx2([
                    _mm256_cvtepi32_ps(_mm256_srli_epi32::<28>(a)),
                    _mm256_cvtepi32_ps(_mm256_srli_epi32::<28>(b)),
                ])
            } else {
                let mask = _mm256_set1_epi32((15u32 << shift(o)) as i32);
                Avx2([
                    _mm256_cvtepi32_ps(_mm256_and_si256(a, mask)),
                    _mm256_cvtepi32_ps(_mm256_and_si256(b, mask)),
                ])
            }
        }
    }

    /// The u32 lanes of line `c / 8` of a 4-bit block at `codes` (see [`column_of_line`]).
    ///
    /// # Safety
    /// AVX2; the line (64 bytes at `(c / 8) * 64`) is readable at `codes`.
    #[inline(always)]
    unsafe fn line_of(codes: *const u8, c: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller's contract.
        unsafe {
            let line = codes.add((c / 8) * 64);
            (
                _mm256_loadu_si256(line.cast()),
                _mm256_loadu_si256(line.add(32).cast()),
            )
        }
    }

    // SAFETY (for every intrinsic call below): these operations run only inside `pass`, which
    // is compiled for AVX2 and FMA and called where the CPU has them.
    impl Lanes for Avx2 {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: see the impl's note (AVX).
            Avx2(unsafe { [_mm256_setzero_ps(); 2] })
        }
        #[inline(always)]
        unsafe fn column(t: &Tile<'_>, c: usize) -> Self {
            // SAFETY: the caller's contract: the 16 bytes of column c (4-bit: the line of pair
            // c / 2) lie inside the block; AVX2 as in the impl's note.
            unsafe {
                match t.storage {
                    Codes::I8(_) => {
                        // Two 8-byte halves, each widened straight from memory (no shuffle to
                        // reach the upper half).
                        let p = t.codes.as_ptr().add(c * BLOCK);
                        Avx2([
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                p.add(8).cast(),
                            ))),
                        ])
                    }
                    Codes::U4(_) => {
                        let (a, b) = line_of(t.codes.as_ptr(), c);
                        column_of_line(a, b, c % 8)
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn column_pair(t: &Tile<'_>, c: usize) -> (Self, Self) {
            // SAFETY: the caller's contract: the line of pair c / 2 lies inside the block;
            // AVX2 as in the impl's note.
            unsafe {
                let (a, b) = line_of(t.codes.as_ptr(), c);
                (column_of_line(a, b, c % 8), column_of_line(a, b, c % 8 + 1))
            }
        }
        #[inline(always)]
        unsafe fn line_columns(t: &Tile<'_>, c: usize) -> [Self; 8] {
            // SAFETY: the caller's contract: line c / 8 lies inside the block; AVX2 as in the
            // impl's note.
            unsafe {
                let (a, b) = line_of(t.codes.as_ptr(), c);
                // Written out: a closure (`array::from_fn`) is not compiled for AVX2, so the
                // intrinsics would not inline into it.
                [
                    column_of_line(a, b, 0),
                    column_of_line(a, b, 1),
                    column_of_line(a, b, 2),
                    column_of_line(a, b, 3),
                    column_of_line(a, b, 4),
                    column_of_line(a, b, 5),
                    column_of_line(a, b, 6),
                    column_of_line(a, b, 7),
                ]
            }
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            // SAFETY: a prefetch never faults, whatever the address; SSE is in the x86-64
            // baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract: 16 readable f32 at p.
            unsafe { Avx2([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]) }
        }
        #[inline(always)]
        unsafe fn fma(acc: Self, w: Self, x: f32) -> Self {
            // SAFETY: see the impl's note (AVX, FMA).
            unsafe {
                let xv = _mm256_set1_ps(x);
                Avx2([
                    _mm256_fmadd_ps(w.0[0], xv, acc.0[0]),
                    _mm256_fmadd_ps(w.0[1], xv, acc.0[1]),
                ])
            }
        }
        #[inline(always)]
        unsafe fn fma_lanes(tot: Self, a: Self, s: Self) -> Self {
            // SAFETY: see the impl's note (FMA).
            unsafe {
                Avx2([
                    _mm256_fmadd_ps(a.0[0], s.0[0], tot.0[0]),
                    _mm256_fmadd_ps(a.0[1], s.0[1], tot.0[1]),
                ])
            }
        }
        #[inline(always)]
        unsafe fn fnma(acc: Self, z: Self, v: f32) -> Self {
            // SAFETY: see the impl's note (AVX, FMA).
            unsafe {
                let vv = _mm256_set1_ps(v);
                Avx2([
                    _mm256_fnmadd_ps(z.0[0], vv, acc.0[0]),
                    _mm256_fnmadd_ps(z.0[1], vv, acc.0[1]),
                ])
            }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            // SAFETY: see the impl's note (AVX).
            unsafe { Avx2([_mm256_add_ps(a.0[0], b.0[0]), _mm256_add_ps(a.0[1], b.0[1])]) }
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn pass_compiled<const R: usize, const U: usize>(
            t: &Tile<'_>,
            x: &[f32],
            sums: Option<&[f32]>,
            out: &mut [[f32; BLOCK]],
        ) {
            // SAFETY: the caller's contract is `lanes::pass`'s, and this function has the
            // features `Avx2`'s operations use.
            unsafe { lanes::pass::<Self, R, U>(t, x, sums, out) }
        }
        #[inline(always)]
        unsafe fn store(self, out: &mut [f32; BLOCK]) {
            // SAFETY: `out` holds 16 f32: two unaligned 256-bit stores; AVX as in the note.
            unsafe {
                _mm256_storeu_ps(out.as_mut_ptr(), self.0[0]);
                _mm256_storeu_ps(out.as_mut_ptr().add(8), self.0[1]);
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::lanes::{self, Lanes};
    use super::{Codes, Tile, BLOCK, TILE_ROWS};
    use std::arch::aarch64::*;

    /// The NEON weight-only tile ([`lanes`]). Checked under qemu (`make check-aarch64`).
    pub fn tile(
        t: &Tile<'_>,
        x: &[f32],
        sums: Option<&[f32]>,
        mr: usize,
        out: &mut [[f32; BLOCK]; TILE_ROWS],
    ) {
        // SAFETY: NEON is part of the aarch64 baseline.
        let ran = unsafe { lanes::tile::<Neon>(t, x, sums, mr, out) };
        // The callers' slices always fit (as for the x86 tile's contract); a future caller's
        // mistake shows here in debug builds instead of as zeros.
        debug_assert!(ran, "NEON weight-only tile: operand sizes do not fit");
    }

    /// Four registers: the 16 features of one block.
    #[derive(Clone, Copy)]
    struct Neon([float32x4_t; 4]);

    /// Sixteen int8 values (as two int16x8 halves) to floats.
    #[inline(always)]
    fn widen16(lo: int16x8_t, hi: int16x8_t) -> Neon {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe {
            Neon([
                vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
                vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))),
            ])
        }
    }

    // SAFETY (for every intrinsic call below): NEON is part of the aarch64 baseline.
    impl Lanes for Neon {
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: see the impl's note.
            Neon(unsafe { [vdupq_n_f32(0.0); 4] })
        }
        #[inline(always)]
        unsafe fn column(t: &Tile<'_>, c: usize) -> Self {
            match t.storage {
                Codes::I8(_) => {
                    // SAFETY: the caller's contract: the 16 bytes of column c lie inside the
                    // block.
                    unsafe {
                        let v = vld1q_s8(t.codes.as_ptr().add(c * BLOCK).cast());
                        widen16(vmovl_s8(vget_low_s8(v)), vmovl_s8(vget_high_s8(v)))
                    }
                }
                Codes::U4(_) => {
                    // Lane l of the pair's line holds column c at bit 4 * (p % 4) + 16 * (c % 2)
                    // (`super::nibble_at`); a negative count shifts right.
                    let p = c / 2;
                    let shift = -((4 * (p % 4) + 16 * (c % 2)) as i32);
                    // SAFETY: the caller's contract: the line of pair p (64 bytes at
                    // (p / 4) * 64) lies inside the block.
                    unsafe {
                        let line = t.codes.as_ptr().add((p / 4) * 64);
                        let (count, nib) = (vdupq_n_s32(shift), vdupq_n_u32(15));
                        let lanes = |q: usize| {
                            let v = vld1q_u32(line.add(16 * q).cast());
                            vcvtq_f32_u32(vandq_u32(vshlq_u32(v, count), nib))
                        };
                        Neon([lanes(0), lanes(1), lanes(2), lanes(3)])
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: the caller's contract: 16 readable f32 at p.
            unsafe {
                Neon([
                    vld1q_f32(p),
                    vld1q_f32(p.add(4)),
                    vld1q_f32(p.add(8)),
                    vld1q_f32(p.add(12)),
                ])
            }
        }
        #[inline(always)]
        unsafe fn fma(acc: Self, w: Self, x: f32) -> Self {
            // SAFETY: see the impl's note.
            unsafe {
                let xv = vdupq_n_f32(x);
                Neon(std::array::from_fn(|q| vfmaq_f32(acc.0[q], w.0[q], xv)))
            }
        }
        #[inline(always)]
        unsafe fn fma_lanes(tot: Self, a: Self, s: Self) -> Self {
            // SAFETY: see the impl's note.
            Neon(std::array::from_fn(|q| unsafe {
                vfmaq_f32(tot.0[q], a.0[q], s.0[q])
            }))
        }
        #[inline(always)]
        unsafe fn fnma(acc: Self, z: Self, v: f32) -> Self {
            // SAFETY: see the impl's note.
            unsafe {
                let vv = vdupq_n_f32(v);
                Neon(std::array::from_fn(|q| vfmsq_f32(acc.0[q], z.0[q], vv)))
            }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            // SAFETY: see the impl's note.
            Neon(std::array::from_fn(|q| unsafe {
                vaddq_f32(a.0[q], b.0[q])
            }))
        }
        #[target_feature(enable = "neon")]
        unsafe fn pass_compiled<const R: usize, const U: usize>(
            t: &Tile<'_>,
            x: &[f32],
            sums: Option<&[f32]>,
            out: &mut [[f32; BLOCK]],
        ) {
            // SAFETY: the caller's contract is `lanes::pass`'s (NEON is always present).
            unsafe { lanes::pass::<Self, R, U>(t, x, sums, out) }
        }
        #[inline(always)]
        unsafe fn store(self, out: &mut [f32; BLOCK]) {
            for (q, v) in self.0.iter().enumerate() {
                // SAFETY: `out` holds 16 f32; q * 4 + 4 <= 16.
                unsafe { vst1q_f32(out.as_mut_ptr().add(q * 4), *v) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[m, n]` output that `gemm` (given the emitter) writes: each block's lanes below
    /// `n`, NaN where nothing was emitted.
    pub(super) fn dense(
        n: usize,
        m: usize,
        gemm: impl FnOnce(&mut dyn FnMut(usize, usize, &[f32; BLOCK])),
    ) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        gemm(&mut |r, b, lanes| {
            for (l, &v) in lanes.iter().enumerate() {
                if b * BLOCK + l < n {
                    y[r * n + b * BLOCK + l] = v;
                }
            }
        });
        y
    }

    fn sample(n: usize, k: usize, groups: usize, asym: bool) -> (BlockedWo, Vec<i8>) {
        sample_bits(n, k, groups, asym, 8)
    }

    pub(crate) fn sample_bits(
        n: usize,
        k: usize,
        groups: usize,
        asym: bool,
        bits: u32,
    ) -> (BlockedWo, Vec<i8>) {
        let span = 1i64 << bits;
        let q: Vec<i8> = (0..n * k)
            .map(|i| ((i as i64 * 7919) % span - span / 2) as i8)
            .collect();
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

    /// A symmetric 4-bit layer keeps one tile's zero points (the storage's 8) for all its
    /// blocks, and computes what the same layer with zero points of 0 stored per block does,
    /// bit for bit, on every path: fp32 and bf16 tiles, one and many rows, one and two blocks.
    #[test]
    fn symmetric_nibbles_share_their_zero_points() {
        let (n, k, groups) = (80, 128, 2);
        let q: Vec<i8> = (0..n * k)
            .map(|i| ((i * 5 + i / 7) % 16) as i8 - 8)
            .collect();
        let scale: Vec<f32> = (0..n * groups)
            .map(|i| 0.01 + (i % 9) as f32 * 1e-3)
            .collect();
        let starts = vec![0, k / 2];
        let sym = BlockedWo::new(n, k, &q, &scale, None, starts.clone());
        let zeros = vec![0i8; n * groups];
        let asym = BlockedWo::new(n, k, &q, &scale, Some(&zeros), starts);
        assert!(matches!(sym.codes, Codes::U4(_)) && matches!(asym.codes, Codes::U4(_)));
        let per = groups * BLOCK;
        assert_eq!(sym.zp.as_ref().map(Vec::len), Some(UNIFORM_ZP_BLOCKS * per));
        assert_eq!(asym.zp.as_ref().map(Vec::len), Some(sym.blocks() * per));
        for m in [1, 2, 5, 9, 40] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37) % 101) as f32 / 17.0 - 2.9)
                .collect();
            let run = |w: &BlockedWo, bf16: bool| {
                dense(n, m, |emit| {
                    if bf16 {
                        w.gemm_bf16(&w.bf16_rows(&x, m), m, 0, w.blocks(), emit);
                    } else {
                        w.gemm(&x, m, 0, w.blocks(), emit);
                    }
                })
            };
            for bf16 in [false, true] {
                let (a, b) = (run(&sym, bf16), run(&asym, bf16));
                assert!(a.iter().all(|v| v.is_finite()) && a.iter().any(|v| *v != 0.0));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{m} rows, bf16 {bf16}");
            }
        }
    }

    /// 4-bit storage is laid out as `nibble_at` documents, read back through the words of
    /// each 64-byte line: pair `p`'s column `2p + h`, lane `l`, is bits `4 (p % 4)..` of the
    /// line's little-endian word `2l + h`; a partial last line pads with code 0 (stored 8).
    #[test]
    fn nibble_lines_hold_four_pairs_per_word() {
        for (n, k) in [(20, 64), (16, 44), (3, 6)] {
            let q: Vec<i8> = (0..n * k)
                .map(|i| ((i * 7 + i / 5) % 16) as i8 - 8)
                .collect();
            let w = BlockedWo::new(n, k, &q, &vec![1.0; n], None, vec![0]);
            assert!(matches!(w.codes, Codes::U4(_)));
            let len = k.div_ceil(8) * 64;
            assert_eq!(w.codes.bytes().len(), n.div_ceil(BLOCK) * len);
            for j in 0..n.div_ceil(BLOCK) * BLOCK {
                let (b, l) = (j / BLOCK, j % BLOCK);
                for c in 0..k.div_ceil(8) * 8 {
                    let (p, h) = (c / 2, c % 2);
                    let at = b * len + (p / 4) * 64 + 2 * (2 * l + h);
                    let word = u16::from_le_bytes([w.codes.bytes()[at], w.codes.bytes()[at + 1]]);
                    let stored = (word >> (4 * (p % 4))) & 15;
                    let want = if j < n && c < k { q[j * k + c] + 8 } else { 8 };
                    assert_eq!(stored as i8, want, "feature {j} column {c} of {n}x{k}");
                }
            }
        }
    }

    /// The AVX2 tile's 4-bit decoding: each column's value (`code << shift`, below the lane's
    /// sign bit, or for a line's last column its top bits shifted down) times its prescaled
    /// input is the code times the input, bit for bit, for inputs from `2^-98` to the largest
    /// finite ones, zeros and infinities.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_prescaled_products_are_the_codes_times_the_inputs() {
        let xs = [
            1.0f32,
            -3.7,
            1.0e-20,
            2f32.powi(-98),
            -2f32.powi(-97) * 1.5,
            1.0e30,
            f32::MAX,
            0.0,
            -0.0,
            f32::INFINITY,
        ];
        for c in 0..16 {
            let s = avx2::shift(c);
            assert!(
                s + 4 <= 31,
                "column {c}: the nibble must sit below the sign bit"
            );
            assert_eq!(
                s == 0,
                c % 2 == 0 && (c / 2) % 4 == 0 || c % 8 == 7,
                "column {c}"
            );
            for &x in &xs {
                let row: Vec<f32> = (0..16).map(|j| if j == c { x } else { 0.0 }).collect();
                let scaled = avx2::prescale(&row, 16);
                for code in 0..16u32 {
                    let w = (code << s) as i32 as f32;
                    let want = code as f32 * x;
                    let got = w * scaled[c];
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "column {c} code {code} x {x:e}: {got:e} != {want:e}"
                    );
                }
            }
        }
    }

    /// The AVX2 tile (AVX2 CPUs without AVX-512) equals the scalar tile bit for bit: 8- and
    /// 4-bit codes, with and without zero points, one to eight rows (every unroll and pass).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tile_equals_scalar() {
        if !avx2::detected() {
            assert!(!isa().avx2_fma());
            return;
        }
        // Uneven group bounds too (as act-order layers have after sorting): even starts (4-bit
        // storage) and an odd one (int8 storage).
        let uneven = |bits: u32, starts: Vec<usize>| {
            let (n, k, g) = (21, 64, starts.len());
            let span = 1i64 << bits;
            let q: Vec<i8> = (0..n * k)
                .map(|i| ((i as i64 * 7919) % span - span / 2) as i8)
                .collect();
            let scale: Vec<f32> = (0..n * g).map(|i| 1e-3 * (1 + i % 5) as f32).collect();
            let zp: Vec<i8> = (0..n * g).map(|i| (i % 7) as i8 - 3).collect();
            (BlockedWo::new(n, k, &q, &scale, Some(&zp), starts), n, k)
        };
        let mut layers = Vec::new();
        for (n, k, groups, asym) in [(37, 64, 4, true), (20, 70, 2, true), (33, 66, 3, false)] {
            for bits in [8, 4] {
                layers.push((sample_bits(n, k, groups, asym, bits).0, n, k));
            }
        }
        for bits in [8, 4] {
            layers.push(uneven(bits, vec![0, 6, 40]));
            layers.push(uneven(bits, vec![0, 7, 40]));
        }
        assert!(layers.iter().any(|(w, ..)| matches!(w.codes, Codes::U4(_))));
        for (w, n, k) in layers {
            for m in 1..=TILE_ROWS {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 37) % 101) as f32 / 11.0 - 4.0)
                    .collect();
                let sums = w.zp.is_some().then(|| w.group_sums(&x, m));
                for b in 0..w.blocks() {
                    let t = w.tile(b);
                    let mut want = [[0f32; BLOCK]; TILE_ROWS];
                    tile_scalar(&t, &x, sums.as_deref(), m, &mut want);
                    let mut got = [[f32::NAN; BLOCK]; TILE_ROWS];
                    avx2::tile(&t, &x, sums.as_deref(), m, &mut got);
                    for r in 0..m {
                        let bits = |v: &[f32; BLOCK]| v.map(f32::to_bits);
                        assert_eq!(bits(&got[r]), bits(&want[r]), "n={n} k={k} m={m} r={r}");
                    }
                }
            }
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
            for bits in [8, 4] {
                let (w, _) = sample_bits(n, k, groups, asym, bits);
                assert_eq!(
                    matches!(w.codes, Codes::U4(_)),
                    bits == 4 && k % 2 == 0 && (0..groups).all(|g| g * k / groups % 2 == 0)
                );
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
                let sums = w.zp.is_some().then(|| w.group_sums(&x, m));
                for b in 0..w.blocks() {
                    let g = w.groups();
                    let t = w.tile(b);
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
}
