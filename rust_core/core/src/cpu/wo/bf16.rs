//! The bf16 dot-product path of weight-only layers, for bf16 activations on CPUs with
//! AVX512-BF16 (`vdpbf16ps`: 32 multiply-adds per instruction, twice the fp32 FMA rate).
//!
//! Every weight-only code is a small integer (|q| <= 128, or the 4-bit stored value 0..15),
//! exact in bf16, and a bf16 x bf16 product is exact in fp32, so the only roundings are the
//! fp32 additions, as in the fp32 path; what changes is that activations are bf16. That is the
//! caller's dtype for the layer input; the intermediate `silu(gate) * up` is rounded to bf16
//! before the down projection, as inference engines keep it in the activation dtype.
//!
//! Layout: activations are bf16 pairs (column `c` low, `c + 1` high), every group padded to an
//! even number of columns with zeros so that a pair never straddles a group, stored per row
//! tile as `[pairs][rows of the tile]` u32 (see [`Bf16Rows`]): one pair step of a tile reads
//! its rows' pairs from one 32-byte run at constant offsets, with no address arithmetic per
//! row and one stream for the prefetchers instead of eight. int8 codes are widened per call
//! into the same pair order, `[pairs][16]` u32, in a per-thread buffer: the widening costs
//! about one 8-row tile of dot products, so int8 layers use this path from [`BF16_MIN_ROWS`]
//! rows on. 4-bit codes within one row tile need no buffer: their storage's pair `p` is the
//! tile's pair `p` (even group starts from 0, even `k`), a shift of its line and one table lookup (`vpermw`)
//! turns each nibble into its bf16 value in registers, so those layers use this path from
//! [`NIBBLE_MIN_ROWS`] rows on (see [`BlockedWo::bf16_min_rows`]): 1-8 rows per expert run
//! 1.4-2x the fp32 kernel's rate.
//!
//! Numerics per group and lane: the group's pairs are dealt round-robin to [`unroll`] partial
//! sums (the remainder to the first); in each, per pair, `acc += w_hi * x_hi` then
//! `acc += w_lo * x_lo` (the order `vdpbf16ps` documents, fp32 with round-to-nearest-even and
//! subnormal results flushed to zero); the partial sums are added pairwise; then the group
//! epilogue of the fp32 path (`acc -= z * Σx`, `y += acc * s`). [`tile_scalar`] repeats this
//! exactly.
//!
//! Where codes are widened (int8, and 4-bit beyond one row tile), from [`DEQUANT_MIN_ROWS`]
//! rows, and every scale is a bf16 value, the widening writes the dequantised weights
//! instead: `bf16((q - z) * s)`, and the tiles add runs of up to `SPAN_PAIRS` pairs with a
//! scale of 1 and no zero-point term. That drops the per-group epilogue (~5-8% of the tile's
//! rate at group 128) at the price of one bf16 rounding per weight. The layer sees scale
//! values, not their dtype: for bf16 scales (a checkpoint's usual dtype) these weights are
//! compressed-tensors' dequantisation in the scale dtype bit for bit (DESIGN.md's
//! "dequantised weights"); fp16 or fp32 scales that all happen to be bf16 values (powers of
//! two, say) get the same bf16 weights where compressed-tensors would round to fp16 or not
//! at all, a difference within the bf16 path's tolerance.

use std::cell::RefCell;

use super::{BlockedWo, Codes, BLOCK, TILE_ROWS};
use crate::cpu::kernels::bf16_dot;

/// The first pair of each group of a `k`-column layer whose groups start at `group_starts`,
/// each padded to an even length, and the total (`groups + 1` entries).
pub(super) fn pair_offsets(k: usize, group_starts: &[usize]) -> Vec<usize> {
    let groups = group_starts.len().max(1);
    let bound = |g: usize| {
        group_starts
            .get(g)
            .copied()
            .unwrap_or(if g == 0 { 0 } else { k })
    };
    let mut offs = Vec::with_capacity(groups + 1);
    let mut p = 0;
    for g in 0..groups {
        offs.push(p);
        let (a, e) = (bound(g), bound(g + 1).min(k));
        p += e.saturating_sub(a).div_ceil(2);
    }
    offs.push(p);
    offs
}

/// How `gemm_bf16` takes its AMX-BF16 route in tests: on the hardware where enabled (as
/// outside tests), on the tiles' software model (so that tests cover the route on any CPU), or
/// not at all.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AmxRoute {
    Auto,
    Model,
    Off,
}

#[cfg(test)]
thread_local! {
    /// The route `gemm_bf16` takes on this thread (tests set it).
    pub static AMX_BF16_ROUTE: std::cell::Cell<AmxRoute> = const { std::cell::Cell::new(AmxRoute::Auto) };
}

/// Rows from which weight-only layers with bf16 inputs use this path.
pub const BF16_MIN_ROWS: usize = 8;

/// Rows from which 4-bit layers with bf16 inputs use this path: all. At one row it computes
/// ~40% faster than the fp32 kernel hot (72-75 against 52 GMAC/s on one core, `cargo run
/// --release --example wo_time`) and streams cold weights alike on one core (`COLD=1`), so
/// with two threads sharing the memory it overlaps better (Qwen3 W4A16 decode from Rust
/// 0.65-0.71 -> 0.58-0.66 ms); at 4 rows it streams them about twice as fast.
pub const NIBBLE_MIN_ROWS: usize = 1;

/// Rows from which layers with bf16 scales widen into dequantised weights (see
/// [`BlockedWo::widens_dequantised`]). Without the group epilogue the tiles run 5-15% faster
/// at 64 rows and 11-13% at 256 (one Zen 4 core, `wo_time` with `BF16_SCALES=1` against
/// without, interleaved), but the dequantising widening costs more than the plain one, which
/// one row tile does not repay (int8, 8 rows: 20% slower); 16-32 rows measured even.
pub const DEQUANT_MIN_ROWS: usize = 32;

// A tile of symmetric 4-bit blocks reads the zero points kept once for all blocks.
const _: () = assert!(super::UNIFORM_ZP_BLOCKS >= TILE_BLOCKS);

// The 4-bit in-register path serves one row tile at most, so dequantised widening never
// meets it.
const _: () = assert!(DEQUANT_MIN_ROWS > TILE_ROWS);

/// The run boundaries over `pairs` pairs of dequantised weights: `0, SPAN_PAIRS, ...`, then
/// `pairs` (the tiles' "groups" when the weights carry their scales).
fn dequant_runs(pairs: usize) -> Vec<usize> {
    (0..pairs)
        .step_by(SPAN_PAIRS)
        .chain(std::iter::once(pairs))
        .collect()
}

/// Group pair offsets `offs` (`groups + 1` entries) moved to whole AMX-BF16 steps: group `g`
/// from pair `to[g]`, a multiple of 16, its pairs then zeros up to the next group's step.
pub fn step_offsets(offs: &[usize]) -> Vec<usize> {
    let step = crate::cpu::amx_bf16::TILE;
    let mut to = Vec::with_capacity(offs.len());
    to.push(0);
    for w in offs.windows(2) {
        let last = to[to.len() - 1];
        to.push(last + w[1].saturating_sub(w[0]).next_multiple_of(step));
    }
    to
}

/// One group's fold of the AMX-BF16 grouped route: for each entry of a pass (row tile `i`,
/// row `r`, block `j` at `32 i + 2 r + j`, row `16 i + r` of the pass) and lane `l`:
/// `acc = fma(-z[j][l], sx[row], c)` (with zero points), then `totals = fma(acc, s[j][l],
/// totals)`: the scalar tile's group epilogue, as fused multiply-adds in either form.
pub fn fold_group(
    c: &crate::cpu::amx_bf16::PassOut,
    totals: &mut crate::cpu::amx_bf16::PassOut,
    s: &[[f32; BLOCK]; 2],
    z: Option<&[[f32; BLOCK]; 2]>,
    sx: &[f32; crate::cpu::amx_bf16::PASS_ROWS],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected; every argument is a whole array.
        unsafe { x86::fold_group(c, totals, s, z, sx) };
        return;
    }
    fold_group_scalar(c, totals, s, z, sx);
}

/// [`fold_group`]'s scalar form (the same fused operations).
pub fn fold_group_scalar(
    c: &crate::cpu::amx_bf16::PassOut,
    totals: &mut crate::cpu::amx_bf16::PassOut,
    s: &[[f32; BLOCK]; 2],
    z: Option<&[[f32; BLOCK]; 2]>,
    sx: &[f32; crate::cpu::amx_bf16::PASS_ROWS],
) {
    for (e, (ce, te)) in c.iter().zip(totals.iter_mut()).enumerate() {
        let (j, row) = (e % 2, (e / 32) * 16 + (e % 32) / 2);
        for l in 0..BLOCK {
            let acc = z.map_or(ce[l], |z| (-z[j][l]).mul_add(sx[row], ce[l]));
            te[l] = acc.mul_add(s[j][l], te[l]);
        }
    }
}

/// Blocks per register tile (two 16-feature blocks share each activation broadcast).
const TILE_BLOCKS: usize = 2;

/// At most this many pairs of widened codes per pass of the row tiles (whole groups, at
/// least one): 128 KiB for two blocks, which stay in L2 while every row tile reads them and
/// the activations stream past. Whole rows of a wide layer (Mixtral's down projection: 7168
/// pairs, 0.9 MiB for two blocks) did not, and the tiles ran ~10% slower.
const SPAN_PAIRS: usize = 1024;

/// The layer's groups cut into consecutive runs of at most `max_pairs` pairs (a longer group
/// alone), as `(first, end)` group ranges; one run of every group when `max_pairs` is 0.
fn group_spans(offs: &[usize], max_pairs: usize) -> Vec<(usize, usize)> {
    let groups = offs.len().saturating_sub(1);
    if max_pairs == 0 {
        return vec![(0, groups)];
    }
    let mut spans = Vec::new();
    let mut first = 0;
    for g in 1..=groups {
        if g == groups || offs[g + 1] - offs[first] > max_pairs {
            spans.push((first, g));
            first = g;
        }
    }
    spans
}

/// Activation rows as the bf16 kernels read them.
#[derive(Clone, Debug)]
pub struct Bf16Rows {
    /// bf16 pairs (each group padded to even length) by row tile: the tile of rows
    /// `r0..r0 + mt` (`r0` a multiple of [`TILE_ROWS`], `mt` up to it) starts at pair
    /// `r0 * pairs` and holds `[pairs][mt]` pairs, so row `r0 + i`'s pair `p` is the u16 at
    /// `2 * (r0 * pairs + p * mt + i)` (low) and the next (high). See [`tile_pair`].
    pub x: Vec<u16>,
    /// `Σ x` per row and group over the bf16 values (`[m][groups]`), the zero-point term.
    pub sums: Vec<f32>,
    pub pairs: usize,
    /// `m`, the rows prepared: the tile layout depends on it, so these rows serve only a
    /// GEMM of `m` rows.
    pub rows: usize,
}

/// The u16 index of row `r`'s pair `p` (low half) in a row tile of `mt` rows stored as
/// `[pairs][mt]` (the layout of [`Bf16Rows::x`] inside one tile).
#[inline]
pub fn tile_pair(mt: usize, r: usize, p: usize) -> usize {
    2 * (p * mt + r)
}

/// `v` rounded to bf16 (nearest, ties to even); subnormals become zero, as `vdpbf16ps` reads
/// them. Branch-free integer arithmetic, so slices of it vectorise.
#[inline]
pub fn to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = crate::cpu::kernels::round_bf16(v);
    let h = if nan {
        ((b >> 16) as u16) | 0x40
    } else {
        rounded
    };
    if h & 0x7f80 == 0 {
        h & 0x8000
    } else {
        h
    }
}

/// `Σ v` over bf16 values in eight interleaved lanes (a fixed order; every kernel reads the
/// same sums).
fn sum_bf16(v: &[u16]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (l, &h) in lanes.iter_mut().zip(c) {
            *l += from_bf16(u32::from(h));
        }
    }
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&h| from_bf16(u32::from(h)))
        .sum();
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
        + tail
}

/// The bf16 bits of a code or stored value (a small integer, exact in bf16).
#[inline]
fn code_bf16(v: i8) -> u32 {
    f32::from(v).to_bits() >> 16
}

pub(crate) fn from_bf16(h: u32) -> f32 {
    f32::from_bits(h << 16)
}

/// Flush-to-zero of a subnormal result.
pub(crate) fn ftz(v: f32) -> f32 {
    if v != 0.0 && v.abs() < f32::MIN_POSITIVE {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// Word `w` is bf16(`w` mod 16): the nibble lookup's `vpermw` table (a word lookup reads only
/// the low 5 index bits, so bit 4 may hold the neighbouring nibble's low bit).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const NIBBLE_BF16: [u16; 32] = {
    let mut t = [0u16; 32];
    let mut w = 0;
    while w < 32 {
        t[w] = (((w % 16) as f32).to_bits() >> 16) as u16;
        w += 1;
    }
    t
};

thread_local! {
    /// Widened codes of the blocks a thread is working on, kept between calls.
    static WIDE: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

impl BlockedWo {
    /// The first pair of each group, and the total (`groups + 1` entries).
    pub fn pair_offsets(&self) -> &[usize] {
        &self.pair_offs
    }

    /// Rows from which bf16 input takes this path: [`NIBBLE_MIN_ROWS`] for 4-bit codes
    /// where the CPU can look their nibbles up in registers, [`BF16_MIN_ROWS`] otherwise.
    pub fn bf16_min_rows(&self) -> usize {
        if self.nibbles_in_registers() {
            NIBBLE_MIN_ROWS
        } else {
            BF16_MIN_ROWS
        }
    }

    /// 4-bit codes read straight from their bytes by the SIMD tile (no widening).
    fn nibbles_in_registers(&self) -> bool {
        matches!(self.codes, Codes::U4(_)) && bf16_dot()
    }

    /// Whether [`BlockedWo::gemm_bf16`] reads 4-bit codes straight from their bytes for `m`
    /// rows: within one row tile (more rows reuse widened codes, which is cheaper than looking
    /// them up again for every row tile).
    fn reads_nibbles(&self, m: usize) -> bool {
        // A tile's pair j is the storage's pair j when the groups cover the columns from 0
        // without padding (even `k`, even group starts, the first at 0: `pairs == k / 2`).
        let pairs = self.pair_offs.last().copied().unwrap_or(0);
        self.nibbles_in_registers() && m <= TILE_ROWS && pairs == self.k.div_ceil(2)
    }

    /// Blocks per tile of [`BlockedWo::gemm_bf16`] for `m` rows. 4-bit tiles read straight
    /// from the codes take one block: a single stream per thread, which the prefetchers follow
    /// better than two (measured: 17-22 against 12-13 GB/s on one core).
    pub fn tile_blocks(&self, m: usize) -> usize {
        if self.reads_nibbles(m) {
            1
        } else {
            TILE_BLOCKS
        }
    }

    /// `x[m, k]` (f32, sorted column order) as bf16 pairs, with the group sums. A short `x`
    /// leaves the missing rows zero (and fails a debug assertion: no caller passes one).
    pub fn bf16_rows(&self, x: &[f32], m: usize) -> Bf16Rows {
        self.bf16_rows_from(m, |r| x.get(r * self.k..(r + 1) * self.k), None)
    }

    /// As [`BlockedWo::bf16_rows`] for `m` rows given by `row` (each `k` values in the
    /// original column order), gathered through `perm` (act-order) on the way: no f32 copy.
    pub fn bf16_rows_from<'a>(
        &self,
        m: usize,
        row: impl Fn(usize) -> Option<&'a [f32]>,
        perm: Option<&[u32]>,
    ) -> Bf16Rows {
        let (k, groups) = (self.k, self.groups());
        let offs = self.pair_offsets();
        let pairs = offs[groups];
        let mut out = crate::cpu::spare::take(m * 2 * pairs, 0u16);
        // Always computed: a projection that shares these rows (gate with up) may have zero
        // points (4-bit storage adds them) where this one has none.
        let mut sums = crate::cpu::spare::take(m * groups, 0f32);
        // One row in pair order, then dealt into its tile. The padding halves are never
        // written, so they stay zero from row to row.
        let mut dst_row = crate::cpu::spare::take(2 * pairs, 0u16);
        for r in 0..m {
            let xr = row(r);
            // Every caller has its m rows; without them the rest stay zero.
            debug_assert!(
                xr.is_some_and(|xr| xr.len() >= k),
                "bf16 row {r} of {m} missing"
            );
            let Some(xr) = xr.filter(|xr| xr.len() >= k) else {
                break;
            };
            for g in 0..groups {
                let (a, e) = self.bounds(g);
                let (a, e) = (a.min(k), e.min(k));
                let dst = &mut dst_row[2 * offs[g]..2 * offs[g] + e.saturating_sub(a)];
                match perm.and_then(|p| p.get(a..e)) {
                    Some(cols) => {
                        for (d, &c) in dst.iter_mut().zip(cols) {
                            *d = to_bf16(xr.get(c as usize).copied().unwrap_or(0.0));
                        }
                    }
                    None => {
                        for (d, &v) in dst.iter_mut().zip(&xr[a..e]) {
                            *d = to_bf16(v);
                        }
                    }
                }
                if let Some(s) = sums.get_mut(r * groups + g) {
                    *s = sum_bf16(dst);
                }
            }
            let r0 = r - r % TILE_ROWS;
            let (mt, i) = ((m - r0).min(TILE_ROWS), r - r0);
            let tile = &mut out[2 * r0 * pairs..2 * (r0 + mt) * pairs];
            for (p, pair) in dst_row.chunks_exact(2).enumerate() {
                let at = tile_pair(mt, i, p);
                tile[at..at + 2].copy_from_slice(pair);
            }
        }
        crate::cpu::spare::give(dst_row);
        Bf16Rows {
            x: out,
            sums,
            pairs,
            rows: m,
        }
    }

    /// Block `b`'s stored values as bf16 pairs into `out` (`[pairs][16]`), the scalar form:
    /// group `g`'s pair `j` is pair `offs[g] + j` (`offs` non-decreasing, each group's pairs
    /// before the next's), and `out` holds pairs `first..first + out.len() / 16` of them;
    /// pairs of no group are left as they are.
    pub fn widen_scalar(&self, b: usize, offs: &[usize], first: usize, out: &mut [u32]) {
        let len = self.codes.block_len(self.k);
        let Some(block) = self.codes.bytes().get(b * len..(b + 1) * len) else {
            return;
        };
        self.fill_pairs((offs, first), out, |_, c, l| {
            code_bf16(self.codes.get(block, c, l))
        });
    }

    /// The pairs `j` (column `a + 2 j`) of a group of columns `a..e` that fall in pairs
    /// `first..first + n` when the group starts at pair `at`.
    fn pairs_in(
        a: usize,
        e: usize,
        at: usize,
        (first, n): (usize, usize),
    ) -> std::ops::Range<usize> {
        let len = e.saturating_sub(a).div_ceil(2);
        let lo = first.saturating_sub(at).min(len);
        let hi = (first + n).saturating_sub(at).min(len);
        lo..hi.max(lo)
    }

    /// Writes every group's columns as bf16 pairs `[pairs][16]`: pair `j` of group `g` is
    /// pair `offs[g] + j`, `value(g, c, l)` of column `c` low and of `c + 1` high (zero past
    /// the group's end), and `out` holds pairs `first..first + out.len() / 16`.
    fn fill_pairs(
        &self,
        (offs, first): (&[usize], usize),
        out: &mut [u32],
        value: impl Fn(usize, usize, usize) -> u32,
    ) {
        let n = out.len() / BLOCK;
        for g in 0..self.groups() {
            let (a, e) = self.bounds(g);
            let e = e.min(self.k);
            for j in Self::pairs_in(a, e, offs[g], (first, n)) {
                let c = a + 2 * j;
                for l in 0..BLOCK {
                    let hi = if c + 1 < e { value(g, c + 1, l) } else { 0 };
                    out[(offs[g] + j - first) * BLOCK + l] = value(g, c, l) | (hi << 16);
                }
            }
        }
    }

    /// The pair ranges no group has when group `g` starts at pair `offs[g]`: the gaps after
    /// each group (where there are any) and everything after the last, in order.
    fn gaps(&self, offs: &[usize]) -> Vec<(usize, usize)> {
        let groups = self.groups();
        let mut gaps = Vec::new();
        for g in 0..groups {
            let (a, e) = self.bounds(g);
            let end = offs[g] + e.min(self.k).saturating_sub(a).div_ceil(2);
            let next = if g + 1 < groups {
                offs[g + 1]
            } else {
                usize::MAX
            };
            if end < next {
                gaps.push((end, next));
            }
        }
        gaps
    }

    /// Zeros the pairs of `first..first + out.len() / 16` that lie in `gaps` (see
    /// [`BlockedWo::gaps`]).
    fn zero_gaps(gaps: &[(usize, usize)], first: usize, out: &mut [u32]) {
        let end = first + out.len() / BLOCK;
        let from = gaps.partition_point(|&(_, hi)| hi <= first);
        for &(lo, hi) in gaps[from..].iter().take_while(|&&(lo, _)| lo < end) {
            let (lo, hi) = (lo.max(first), hi.min(end));
            out[(lo - first) * BLOCK..(hi - first) * BLOCK].fill(0);
        }
    }

    /// As [`BlockedWo::widen_scalar`], vectorised where the CPU allows (equal output).
    fn widen(&self, b: usize, offs: &[usize], first: usize, out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        if bf16_dot() && offs.len() >= self.groups() {
            let len = self.codes.block_len(self.k);
            if let Some(block) = self.codes.bytes().get(b * len..(b + 1) * len) {
                // SAFETY: AVX-512F detected (`bf16_dot` implies it); `block` is one whole
                // block, `offs` has an entry per group.
                unsafe { x86::widen(self, block, (offs, first), out) };
                return;
            }
        }
        self.widen_scalar(b, offs, first, out);
    }

    /// Block `b`'s dequantised weights `(q - z) * s`, rounded to bf16 (a subnormal product
    /// to zero), as pairs into `out` (`[pairs][16]`, the layout of
    /// [`BlockedWo::widen_scalar`]); the scalar form. With bf16
    /// scales (every scale a bf16 value) these are compressed-tensors' dequantised weights
    /// bit for bit: `q - z` is a small integer, its product with a bf16 scale is exact in
    /// f32, and bf16 arithmetic rounds that product to nearest, ties to even.
    pub fn widen_dequant_scalar(&self, b: usize, offs: &[usize], first: usize, out: &mut [u32]) {
        let len = self.codes.block_len(self.k);
        let Some(block) = self.codes.bytes().get(b * len..(b + 1) * len) else {
            return;
        };
        let per = self.groups() * BLOCK;
        let (Some(scale), zp) = (
            self.scale.get(b * per..(b + 1) * per),
            self.zp_blocks(b, 1).flatten(),
        ) else {
            return;
        };
        self.fill_pairs((offs, first), out, |g, c, l| {
            let z = zp.map_or(0.0, |z| z[g * BLOCK + l]);
            let q = f32::from(self.codes.get(block, c, l));
            let p = (q - z) * scale[g * BLOCK + l];
            // A subnormal product becomes a signed zero before rounding, as in
            // `vcvtne2ps2bf16` (and `vdpbf16ps` would read its bf16 as zero anyway).
            u32::from(to_bf16(if p.is_subnormal() {
                0.0f32.copysign(p)
            } else {
                p
            }))
        });
    }

    /// As [`BlockedWo::widen_dequant_scalar`], vectorised where the CPU allows (equal output).
    fn widen_dequant(&self, b: usize, offs: &[usize], first: usize, out: &mut [u32]) {
        #[cfg(target_arch = "x86_64")]
        if bf16_dot() && offs.len() >= self.groups() {
            let (len, per) = (self.codes.block_len(self.k), self.groups() * BLOCK);
            let block = self.codes.bytes().get(b * len..(b + 1) * len);
            let scale = self.scale.get(b * per..(b + 1) * per);
            let zp = self.zp_blocks(b, 1);
            if let (Some(block), Some(scale), None | Some(Some(_))) = (block, scale, zp) {
                let (sz, range) = ((scale, zp.flatten()), (offs, first));
                // SAFETY: AVX-512F/BW/BF16 detected (`bf16_dot`); `block` is one whole block,
                // `scale` and `zp` its `groups * 16` values, `offs` has an entry per group.
                unsafe { x86::widen_dequant(self, block, sz, range, out) };
                return;
            }
        }
        self.widen_dequant_scalar(b, offs, first, out);
    }

    /// Whether [`BlockedWo::gemm_bf16`] widens this layer's codes into dequantised bf16
    /// weights for `m` rows: from [`DEQUANT_MIN_ROWS`] rows (beyond the 4-bit in-register
    /// path's one row tile) when the scales are bf16 values. The tiles then need no group
    /// epilogue (zero-point term and scale every group of 128 columns).
    pub fn widens_dequantised(&self, m: usize) -> bool {
        self.scales_bf16 && m >= DEQUANT_MIN_ROWS && crate::cpu::kernels::bf16_dequantised_weights()
    }

    /// Which AMX-BF16 route [`BlockedWo::gemm_bf16`] may take: `None` when none, else
    /// whether on the tiles' model (tests only) rather than the hardware.
    fn amx_route() -> Option<bool> {
        #[cfg(test)]
        let (model, off) = {
            let route = AMX_BF16_ROUTE.with(std::cell::Cell::get);
            (route == AmxRoute::Model, route == AmxRoute::Off)
        };
        #[cfg(not(test))]
        let (model, off) = (false, false);
        (!off && (model || crate::cpu::amx_bf16::enabled())).then_some(model)
    }

    /// Rows `0..m` of `xb` laid out for the AMX-BF16 tiles, and their stride in pairs: row-major
    /// pairs, group `g`'s pairs (from `offs[g]` in `xb`) from pair `to[g]` of its row, zeros
    /// elsewhere (the gaps, each row to `kp` pairs, and the rows past `m` to a whole pass).
    /// Rows lie a step more than `kp` apart: at a multiple of 4 KB (Qwen3's 2048 columns) a
    /// tile's 16 rows share one L1 set, and the passes took ~85% of a prefill call.
    /// The buffer starts on a cache line and, with `kp` a multiple of 16 pairs, so does every
    /// row (AMX's A tiles; see [`crate::cpu::spare::AlignedBuf`]).
    fn amx_rows(
        &self,
        xb: &Bf16Rows,
        m: usize,
        to: &[usize],
        kp: usize,
    ) -> (crate::cpu::spare::AlignedBuf<u32>, usize) {
        use crate::cpu::amx_bf16::{PASS_ROWS, TILE};
        let (pairs, offs) = (xb.pairs, self.pair_offsets());
        debug_assert!(
            kp.is_multiple_of(TILE),
            "rows of {kp} pairs are not whole steps"
        );
        let stride = kp + TILE;
        let mut a =
            crate::cpu::spare::AlignedBuf::take(m.next_multiple_of(PASS_ROWS) * stride, 0u32);
        for r in 0..m {
            let r0 = r - r % TILE_ROWS;
            let mt = (m - r0).min(TILE_ROWS);
            let tile = &xb.x[2 * r0 * pairs..2 * (r0 + mt) * pairs];
            let row = &mut a[r * stride..(r + 1) * stride];
            for (g, &dst) in to.iter().enumerate().take(self.groups()) {
                for p in offs[g]..offs[g + 1] {
                    let at = tile_pair(mt, r - r0, p);
                    row[dst + p - offs[g]] = u32::from(tile[at]) | (u32::from(tile[at + 1]) << 16);
                }
            }
        }
        (a, stride)
    }

    /// The dequantised-weight GEMM of [`BlockedWo::gemm_bf16`] on AMX-BF16 tiles (see
    /// [`crate::cpu::amx_bf16`], whose numerics it has): the rows laid out row-major as bf16
    /// pairs, the blocks widened pair by pair, chunk by chunk, and run against all rows.
    /// `false`, having done nothing, where the route is not taken.
    fn gemm_amx(
        &self,
        xb: &Bf16Rows,
        m: usize,
        first_block: usize,
        end: usize,
        emit: &mut impl FnMut(usize, usize, &[f32; BLOCK]),
    ) -> bool {
        use crate::cpu::amx_bf16;
        let Some(model) = Self::amx_route() else {
            return false;
        };
        let (pairs, offs) = (xb.pairs, self.pair_offsets());
        let kp = pairs.next_multiple_of(amx_bf16::TILE);
        // (The groups' pairs are contiguous here: the dequantised weights need no cut.)
        let (a, stride) = self.amx_rows(xb, m, offs, kp);
        let gaps = self.gaps(offs);
        let widen = |b: usize, first: usize, dst: &mut [u32]| {
            self.widen_dequant(first_block + b, offs, first, dst);
            Self::zero_gaps(&gaps, first, dst);
        };
        let out = |r: usize, j: usize, lanes: &[f32; BLOCK]| emit(r, first_block + j, lanes);
        let nb = end - first_block;
        let ahead = self.code_source(first_block);
        // The arguments fit by construction (whole steps, rows padded), so `gemm` runs.
        let ran = Self::on_tiles(model, |ops| {
            amx_bf16::gemm(ops, (&a[..], stride), m, kp, nb, (widen, ahead), out)
        });
        debug_assert!(ran, "AMX-BF16 GEMM refused its own layout");
        a.give();
        // (A refusal emitted nothing: the caller's other tiles run instead.)
        ran
    }

    /// The exact-weight GEMM of [`BlockedWo::gemm_bf16`] on AMX-BF16 tiles, for layers that
    /// keep their codes (fewer than [`DEQUANT_MIN_ROWS`] rows, or scales that are not bf16
    /// values): the codes widen as for the other tiles, each group moved to whole steps of 16
    /// pairs (zeros between, [`step_offsets`]), and
    /// [`crate::cpu::amx_bf16::gemm_grouped`] runs the groups, each from zero. Per group,
    /// lane and row, the fold is the other tiles' epilogue: `acc = c - z Σx`, `total += acc
    /// s`, each one fused multiply-add ([`fold_group`]). The products are the same exact
    /// ones; only the fp32 sums run in the instruction's order. `false`, having done
    /// nothing, where the route is not taken.
    fn gemm_amx_grouped(
        &self,
        xb: &Bf16Rows,
        m: usize,
        first_block: usize,
        end: usize,
        emit: &mut impl FnMut(usize, usize, &[f32; BLOCK]),
    ) -> bool {
        use crate::cpu::amx_bf16::{self, Fold, PASS_ROWS, TILE};
        let Some(model) = Self::amx_route() else {
            return false;
        };
        let (offs, groups) = (self.pair_offsets(), self.groups());
        let to = step_offsets(&offs[..=groups]);
        let kp = to[groups];
        let starts: Vec<usize> = to.iter().map(|p| p / TILE).collect();
        let (a, stride) = self.amx_rows(xb, m, &to, kp);
        let gaps = self.gaps(&to);
        let widen = |b: usize, first: usize, dst: &mut [u32]| {
            self.widen(first_block + b, &to, first, dst);
            Self::zero_gaps(&gaps, first, dst);
        };
        let per = groups * BLOCK;
        let nb = end - first_block;
        let fold = |f: Fold<'_>| {
            let (g, blk, pair) = (f.group, first_block + f.b, (nb - f.b).min(2));
            let scale = &self.scale[blk * per..(blk + pair) * per];
            // `None` without zero points (symmetric 4-bit blocks share theirs, so they are
            // asked for per pair); the blocks are in range, so never `Some(None)`.
            let zp = self.zp_blocks(blk, pair).flatten();
            // (A single last block fills the pass's second block with itself.)
            let lanes = |v: &[f32], j: usize| -> [f32; BLOCK] {
                let at = (j.min(pair - 1) * groups + g) * BLOCK;
                v.get(at..at + BLOCK)
                    .and_then(|l| l.try_into().ok())
                    .unwrap_or([0.0; BLOCK])
            };
            let s = [lanes(scale, 0), lanes(scale, 1)];
            let z = zp.map(|z| [lanes(z, 0), lanes(z, 1)]);
            let mut sx = [0f32; PASS_ROWS];
            for (i, v) in sx.iter_mut().enumerate().take(m.saturating_sub(f.r0)) {
                *v = xb.sums.get((f.r0 + i) * groups + g).copied().unwrap_or(0.0);
            }
            fold_group(f.c, f.totals, &s, z.as_ref(), &sx);
        };
        let out = |r: usize, j: usize, lanes: &[f32; BLOCK]| emit(r, first_block + j, lanes);
        let rows = (&a[..], stride);
        let widen = (widen, self.code_source(first_block));
        // The arguments fit by construction (whole steps, rows padded), so the GEMM runs.
        let ran = Self::on_tiles(model, |ops| {
            amx_bf16::gemm_grouped(ops, rows, m, kp, nb, &starts, widen, fold, out)
        });
        debug_assert!(ran, "AMX-BF16 grouped GEMM refused its own layout");
        a.give();
        // (A refusal emitted nothing: the caller's other tiles run instead.)
        ran
    }

    /// Where the AMX-BF16 GEMMs' widening reads codes, from block `first_block` on, for their
    /// passes to prefetch (see [`crate::cpu::amx_bf16::Prefetch`]).
    fn code_source(&self, first_block: usize) -> Option<crate::cpu::amx_bf16::CodeSource<'_>> {
        use crate::cpu::amx_bf16::StepLines;
        let lines = match &self.codes {
            Codes::I8(_) => StepLines::Eight,
            Codes::U4(_) => StepLines::Four,
        };
        let block_len = self.codes.block_len(self.k);
        let codes = self.codes.bytes().get(first_block * block_len..)?;
        Some(crate::cpu::amx_bf16::CodeSource {
            codes,
            block_len,
            lines,
        })
    }

    /// `f` on the tiles `amx_route()` chose: their model, or the hardware (where it exists;
    /// `false` elsewhere).
    fn on_tiles(
        model: bool,
        f: impl FnOnce(&mut dyn crate::cpu::amx_bf16::TileOps) -> bool,
    ) -> bool {
        if model {
            return f(&mut crate::cpu::amx_bf16::Model);
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // SAFETY: the hardware is chosen only where `amx_bf16::enabled()` holds: the CPU
            // has AMX-BF16 with the tile palette the passes use, the OS granted tile state,
            // and the hardware passed the self-test against the model.
            f(&mut unsafe { crate::cpu::amx_bf16::Hw::new() })
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            let _ = f;
            false
        }
    }

    /// As [`BlockedWo::gemm`] for activations prepared by [`BlockedWo::bf16_rows`] for the
    /// same `m` (rows prepared for another count emit nothing: their tile layout differs).
    pub fn gemm_bf16(
        &self,
        xb: &Bf16Rows,
        m: usize,
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
    ) {
        let end = (first_block + nblocks).min(self.blocks());
        let offs = self.pair_offsets();
        let (pairs, groups) = (xb.pairs, self.groups());
        if m == 0
            || pairs != offs[groups]
            || xb.rows != m
            || xb.x.len() < m * 2 * pairs
            || xb.sums.len() < m * groups
            || first_block >= end
        {
            return;
        }
        let simd = bf16_dot();
        let nibbles = self.reads_nibbles(m);
        // (A layer without columns has no pairs to cut into runs; it keeps the plain path.)
        let dequant = self.widens_dequantised(m) && pairs > 0;
        // On AMX-BF16 tiles: dequantised weights (as on any CPU from DEQUANT_MIN_ROWS with bf16
        // scales) as one sum, exact weights group by group beyond one row tile (where the
        // codes are widened anyway). From 9 rows the grouped tiles ran 1.7-2.8x `vdpbf16ps`'s
        // rate (`ROWS=9..24 N=512 K=2048 wo_time`, one core); at 8 int8 rows they were even.
        if dequant && self.gemm_amx(xb, m, first_block, end, &mut emit) {
            return;
        }
        if !dequant
            && m > TILE_ROWS
            && pairs > 0
            && self.gemm_amx_grouped(xb, m, first_block, end, &mut emit)
        {
            return;
        }
        let codes = self.codes.bytes();
        let len = self.codes.block_len(self.k);
        let tile_blocks = self.tile_blocks(m);
        let tiles = m.div_ceil(TILE_ROWS);
        // Dequantised weights carry their scales: the tiles see runs of at most SPAN_PAIRS
        // pairs (any cut of the padded pairs will do, padding being zero on both sides) with
        // a scale of 1 and no zero points, so a run's epilogue only adds it to the totals.
        let runs: Vec<usize>;
        let ones: Vec<f32>;
        let (t_offs, t_groups) = if dequant {
            runs = dequant_runs(pairs);
            ones = vec![1.0; TILE_BLOCKS * (runs.len() - 1) * BLOCK];
            (&runs[..], runs.len() - 1)
        } else {
            ones = Vec::new();
            (offs, groups)
        };
        // Spans matter only where row tiles share widened codes. One row tile (a decode call)
        // keeps its span and totals on the stack.
        let (all_groups, many_spans);
        let spans: &[(usize, usize)] = if tiles > 1 {
            many_spans = group_spans(t_offs, SPAN_PAIRS);
            &many_spans
        } else {
            all_groups = [(0, t_groups)];
            &all_groups
        };
        let zero = [[[0f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS];
        let (mut one, mut many);
        let totals: &mut [_] = if tiles > 1 {
            many = vec![zero; tiles];
            &mut many
        } else {
            one = [zero];
            &mut one
        };
        let mut run = |wide: &mut Vec<u32>| {
            if !nibbles && wide.len() < TILE_BLOCKS * pairs * BLOCK {
                wide.resize(TILE_BLOCKS * pairs * BLOCK, 0);
            }
            let mut b = first_block;
            while b < end {
                let nb = (end - b).min(tile_blocks);
                let w = if nibbles {
                    // 4-bit blocks hold exactly the tile's pairs (see `reads_nibbles`).
                    match codes.get(b * len..(b + nb) * len) {
                        Some(c) => Weights::Nibbles(c),
                        // The codes hold every block below `self.blocks()`.
                        None => return,
                    }
                } else {
                    for i in 0..nb {
                        let dst = &mut wide[i * pairs * BLOCK..(i + 1) * pairs * BLOCK];
                        if dequant {
                            self.widen_dequant(b + i, offs, 0, dst);
                        } else {
                            self.widen(b + i, offs, 0, dst);
                        }
                    }
                    Weights::Wide(&wide[..nb * pairs * BLOCK])
                };
                // (`t_offs` and `t_groups` are the layer's own groups unless dequantised.)
                let per = groups * BLOCK;
                let (scale, zp) = if dequant {
                    (&ones[..nb * t_groups * BLOCK], None)
                } else {
                    (
                        &self.scale[b * per..(b + nb) * per],
                        self.zp_blocks(b, nb).map(|z| z.unwrap_or(&[])),
                    )
                };
                let t = Tile {
                    w,
                    pairs,
                    offs: t_offs,
                    scale,
                    zp,
                    groups: (0, t_groups),
                    ahead: &[],
                };
                // The next blocks' codes, split evenly over this block's tile calls.
                let next = codes.get((b + nb) * len..((b + 2 * nb).min(end)) * len);
                // (4-bit tiles prefetch their own stream ahead instead.)
                let next = next.filter(|_| !nibbles).unwrap_or(&[]);
                let share = next
                    .len()
                    .div_ceil(tiles * spans.len())
                    .next_multiple_of(64);
                totals.fill(zero);
                // Span by span, every row tile adds its groups to its totals (in group
                // order, as one pass over all groups would).
                for (si, &span) in spans.iter().enumerate() {
                    for (ti, out) in totals.iter_mut().enumerate() {
                        let r = ti * TILE_ROWS;
                        let mr = (m - r).min(TILE_ROWS);
                        let from = ((si * tiles + ti) * share).min(next.len());
                        let t = Tile {
                            ahead: &next[from..(from + share).min(next.len())],
                            groups: span,
                            ..t
                        };
                        let xs = &xb.x[r * 2 * pairs..(r + mr) * 2 * pairs];
                        let ss = xb.sums.get(r * groups..(r + mr) * groups).unwrap_or(&[]);
                        #[cfg(target_arch = "x86_64")]
                        if simd {
                            // SAFETY: AVX512-BF16/BW detected; the tile holds `nb` blocks of
                            // `pairs` pairs (widened, or 4-bit lines) with their scales, its
                            // groups lie within the layer's; `xs`/`ss` hold `mr` rows.
                            unsafe { x86::tile(&t, xs, ss, mr, nb, out) };
                        } else {
                            tile_scalar(&t, xs, ss, mr, nb, out);
                        }
                        #[cfg(not(target_arch = "x86_64"))]
                        {
                            let _ = simd;
                            tile_scalar(&t, xs, ss, mr, nb, out);
                        }
                    }
                }
                for (ti, out) in totals.iter().enumerate() {
                    let r = ti * TILE_ROWS;
                    for (rr, row) in out.iter().enumerate().take((m - r).min(TILE_ROWS)) {
                        for (i, lanes) in row.iter().enumerate().take(nb) {
                            emit(r + rr, b + i, lanes);
                        }
                    }
                }
                b += nb;
            }
        };
        if nibbles {
            run(&mut Vec::new());
            return;
        }
        WIDE.with(|cell| match cell.try_borrow_mut() {
            Ok(mut wide) => run(&mut wide),
            Err(_) => run(&mut Vec::new()),
        });
    }
}

/// A tile's weights: widened pairs, or 4-bit codes read as they are stored.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    /// `[nb][pairs][16]` bf16 pairs.
    Wide(&'a [u32]),
    /// `nb` blocks of 4-bit storage (`nibble_block_len(pairs)` bytes each, stored values
    /// 0..15 laid out as `super::nibble_at` says).
    Nibbles(&'a [u8]),
}

impl Weights<'_> {
    /// Block `i`'s pair `p` for lane `l` as widened bf16 bits (`0` when out of range).
    fn pair(&self, pairs: usize, i: usize, p: usize, l: usize) -> u32 {
        match self {
            Weights::Wide(w) => w.get((i * pairs + p) * BLOCK + l).copied().unwrap_or(0),
            Weights::Nibbles(c) => {
                let value = |col: usize| {
                    let (at, shift) = super::nibble_at(col, l);
                    c.get(i * super::nibble_block_len(pairs) + at)
                        .map_or(0, |&byte| code_bf16(((byte >> shift) & 15) as i8))
                };
                value(2 * p) | (value(2 * p + 1) << 16)
            }
        }
    }
}

/// Up to `TILE_BLOCKS` blocks with their scales and zero points.
#[derive(Clone, Copy)]
pub struct Tile<'a> {
    w: Weights<'a>,
    pairs: usize,
    offs: &'a [usize],
    /// `[nb][groups][16]`
    scale: &'a [f32],
    zp: Option<&'a [f32]>,
    /// The groups this call adds to the running totals, `first..end`.
    groups: (usize, usize),
    /// Code bytes widened next, prefetched (one line per pair step) while this tile runs: the
    /// widening is the first read of the weights and would otherwise wait on memory.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    ahead: &'a [u8],
}

/// Partial sums per (row, block, group): the pairs of a group are dealt round-robin to
/// `unroll` accumulators so that at least eight `vdpbf16ps` chains are in flight (their
/// latency would otherwise bound few-row tiles), then combined pairwise (`combine`).
pub const fn unroll(mr: usize, nb: usize) -> usize {
    match mr * nb {
        1 => 8,
        2 => 4,
        3..=4 => 2,
        _ => 1,
    }
}

/// Pairwise sum of a power-of-two number of partial sums: `(p0 + p1) + (p2 + p3)` for four.
fn combine(parts: &mut [f32]) -> f32 {
    let mut w = parts.len();
    while w > 1 {
        w /= 2;
        for q in 0..w {
            parts[q] = parts[2 * q] + parts[2 * q + 1];
        }
    }
    parts.first().copied().unwrap_or(0.0)
}

/// The scalar reference of the bf16 tile: the same operations in the same order. `x` is one
/// row tile of `mr` rows (`[t.pairs][mr]` pairs, see [`Bf16Rows::x`]); each group of
/// `t.groups` adds its term to the running total in `out`, in group order.
pub fn tile_scalar(
    t: &Tile<'_>,
    x: &[u16],
    sums: &[f32],
    mr: usize,
    nb: usize,
    out: &mut [[[f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS],
) {
    let groups = t.offs.len() - 1;
    let u = unroll(mr, nb);
    for (r, row) in out.iter_mut().enumerate().take(mr) {
        for (i, lanes) in row.iter_mut().enumerate().take(nb) {
            for (l, o) in lanes.iter_mut().enumerate() {
                let mut total = *o;
                for g in t.groups.0..t.groups.1.min(groups) {
                    let (first, end) = (t.offs[g], t.offs[g + 1]);
                    // Full runs of `u` pairs round-robin over the partial sums, the rest
                    // into partial 0.
                    let full = first + (end - first) / u * u;
                    let mut parts = [0f32; 8];
                    for p in first..end {
                        let part = &mut parts[if p < full { (p - first) % u } else { 0 }];
                        let w = t.w.pair(t.pairs, i, p, l);
                        let at = tile_pair(mr, r, p);
                        let xv = u32::from(x[at]) | (u32::from(x[at + 1]) << 16);
                        *part = ftz(*part + from_bf16(w >> 16) * from_bf16(xv >> 16));
                        *part = ftz(*part + from_bf16(w & 0xffff) * from_bf16(xv & 0xffff));
                    }
                    let mut acc = combine(&mut parts[..u]);
                    let at = (i * groups + g) * BLOCK + l;
                    if let (Some(z), Some(s)) = (t.zp, sums.get(r * groups + g)) {
                        acc = (-z[at]).mul_add(*s, acc);
                    }
                    total = acc.mul_add(t.scale[at], total);
                }
                *o = total;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::Codes;
    use super::{BlockedWo, Tile, Weights, BLOCK, TILE_BLOCKS, TILE_ROWS};
    use std::arch::x86_64::*;

    /// The kernel for `$mr` rows (1..=8) and `$nb` blocks (a literal).
    macro_rules! rows {
        // `$args`: the kernel's arguments (tile, rows, sums, totals, load, load4, prefetch).
        ($mr:expr, $nb:literal, $($args:expr),+) => {
            match $mr {
                1 => kernel::<1, $nb, { super::unroll(1, $nb) }>($($args),+),
                2 => kernel::<2, $nb, { super::unroll(2, $nb) }>($($args),+),
                3 => kernel::<3, $nb, { super::unroll(3, $nb) }>($($args),+),
                4 => kernel::<4, $nb, { super::unroll(4, $nb) }>($($args),+),
                5 => kernel::<5, $nb, { super::unroll(5, $nb) }>($($args),+),
                6 => kernel::<6, $nb, { super::unroll(6, $nb) }>($($args),+),
                7 => kernel::<7, $nb, { super::unroll(7, $nb) }>($($args),+),
                _ => kernel::<8, $nb, { super::unroll(8, $nb) }>($($args),+),
            }
        };
    }

    /// Pair `p`'s u32 lanes in a 4-bit block at `codes`: its line shifted down
    /// `4 * (p % 4)` bits, column `2p` in bits 0..4 and `2p + 1` in bits 16..20 of lane `l`
    /// (`super::super::nibble_at`).
    ///
    /// # Safety
    /// AVX-512F; line `p / 4` (64 bytes at `(p / 4) * 64`) is readable at `codes`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn pair_lanes(codes: *const u8, p: usize) -> __m512i {
        // SAFETY: the caller's contract.
        let line = unsafe { _mm512_loadu_si512(codes.add((p / 4) * 64).cast()) };
        _mm512_srl_epi32(line, _mm_cvtsi32_si128((4 * (p % 4)) as i32))
    }

    /// `one(lanes, j)` for every pair `j` of `range` of a 4-bit block at `codes` whose pair
    /// `j` is storage pair `first + j`, its lanes as [`pair_lanes`] gives them: a whole line
    /// (four pairs) per load where the range covers one, with immediate shifts, else pair by
    /// pair. (Loading the line once and shifting by constants took the widening 7-8% faster
    /// at 12-64 rows on one core, hot, against a load and a shift by register per pair.)
    ///
    /// # Safety
    /// AVX-512F; the lines of storage pairs `first + range` are readable at `codes`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn nibble_pairs(
        codes: *const u8,
        first: usize,
        range: std::ops::Range<usize>,
        mut one: impl FnMut(__m512i, usize),
    ) {
        let mut j = range.start;
        while j < range.end {
            let p = first + j;
            if p.is_multiple_of(4) && j + 4 <= range.end {
                // SAFETY: pairs p..p + 4 are in the range, so their line (64 bytes at
                // (p / 4) * 64) is readable (the caller's contract).
                let line = unsafe { _mm512_loadu_si512(codes.add((p / 4) * 64).cast()) };
                one(line, j);
                one(_mm512_srli_epi32::<4>(line), j + 1);
                one(_mm512_srli_epi32::<8>(line), j + 2);
                one(_mm512_srli_epi32::<12>(line), j + 3);
                j += 4;
            } else {
                // SAFETY: pair p is in the range, its line readable (the caller's contract).
                one(unsafe { pair_lanes(codes, p) }, j);
                j += 1;
            }
        }
    }

    /// `one(lo, hi, j)` for every pair `j` of `range` of an int8 block at `codes` whose group
    /// starts at column `a` and ends at `e`: pair `j` is columns `c = a + 2j` and `c + 1`, their
    /// codes as i32 lanes; `hi` is `None` where `c + 1` is past the group's end.
    ///
    /// # Safety
    /// AVX-512F; columns `a + 2 * range.start .. e` are readable at `codes` (16 bytes each)
    /// and `a + 2 * j < e` for every `j` of `range`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn int8_pairs(
        codes: *const u8,
        (a, e): (usize, usize),
        range: std::ops::Range<usize>,
        mut one: impl FnMut(__m512i, Option<__m512i>, usize),
    ) {
        // SAFETY: the caller's contract: column c < e is readable, 16 bytes at c * 16.
        let column = |c: usize| unsafe {
            _mm512_cvtepi8_epi32(_mm_loadu_si128(codes.add(c * BLOCK).cast()))
        };
        for j in range {
            let c = a + 2 * j;
            one(column(c), (c + 1 < e).then(|| column(c + 1)), j);
        }
    }

    /// [`super::fold_group`] with AVX-512 fused multiply-adds (equal to the scalar form).
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fold_group(
        c: &crate::cpu::amx_bf16::PassOut,
        totals: &mut crate::cpu::amx_bf16::PassOut,
        s: &[[f32; BLOCK]; 2],
        z: Option<&[[f32; BLOCK]; 2]>,
        sx: &[f32; crate::cpu::amx_bf16::PASS_ROWS],
    ) {
        // SAFETY: each load and store is one whole `[f32; 16]` of the arguments.
        unsafe {
            let s = [
                _mm512_loadu_ps(s[0].as_ptr()),
                _mm512_loadu_ps(s[1].as_ptr()),
            ];
            let z = z.map(|z| {
                [
                    _mm512_loadu_ps(z[0].as_ptr()),
                    _mm512_loadu_ps(z[1].as_ptr()),
                ]
            });
            for (e, (ce, te)) in c.iter().zip(totals.iter_mut()).enumerate() {
                let (j, row) = (e % 2, (e / 32) * 16 + (e % 32) / 2);
                let mut acc = _mm512_loadu_ps(ce.as_ptr());
                if let Some(z) = z {
                    acc = _mm512_fnmadd_ps(z[j], _mm512_set1_ps(sx[row]), acc);
                }
                let t = _mm512_fmadd_ps(acc, s[j], _mm512_loadu_ps(te.as_ptr()));
                _mm512_storeu_ps(te.as_mut_ptr(), t);
            }
        }
    }

    /// Widens one block (see [`BlockedWo::widen_scalar`]).
    ///
    /// # Safety
    /// AVX-512F; `offs` has an entry per group; `block` is one whole block of `w`
    /// (`block_len(k)` bytes). (`out` holds the pairs it holds: `pairs_in` keeps every store
    /// inside it.)
    #[target_feature(enable = "avx512f")]
    pub unsafe fn widen(
        w: &BlockedWo,
        block: &[u8],
        (offs, first_pair): (&[usize], usize),
        out: &mut [u32],
    ) {
        let n = out.len() / BLOCK;
        let hi_mask = _mm512_set1_epi32(0xffff_0000u32 as i32);
        let nib = _mm512_set1_epi32(15);
        let bp = block.as_ptr();
        let op = out.as_mut_ptr();
        // The bf16 bits of small integers held as i32: the top half of their f32 bits.
        let pair = |lo: __m512i, hi: __m512i| {
            let lo = _mm512_castps_si512(_mm512_cvtepi32_ps(lo));
            let hi = _mm512_castps_si512(_mm512_cvtepi32_ps(hi));
            _mm512_or_si512(_mm512_srli_epi32::<16>(lo), _mm512_and_si512(hi, hi_mask))
        };
        for (g, &first) in offs.iter().enumerate().take(w.groups()) {
            let (a, e) = w.bounds(g);
            let e = e.min(w.k);
            // Stores pair `j` of the range.
            let put = |v: __m512i, j: usize| {
                // SAFETY: `pairs_in` keeps pair first + j - first_pair below n, inside `out`.
                unsafe { _mm512_storeu_si512(op.add((first + j - first_pair) * BLOCK).cast(), v) };
            };
            let range = BlockedWo::pairs_in(a, e, first, (first_pair, n));
            match &w.codes {
                Codes::I8(_) => {
                    // Past the group's end, zeros widen to 0.0: an empty high half.
                    let one = |lo, hi: Option<__m512i>, j| {
                        put(pair(lo, hi.unwrap_or(_mm512_setzero_si512())), j);
                    };
                    // SAFETY: `pairs_in` keeps each pair's first column c inside the group
                    // (c < e <= k), and the group's columns lie inside the block.
                    unsafe { int8_pairs(bp, (a, e), range, one) };
                }
                // 4-bit storage has even group starts and even k: c + 1 < e always, and
                // columns c, c + 1 are pair p = c / 2 = a / 2 + j, in line p / 4.
                Codes::U4(_) => {
                    let one = |v: __m512i, j: usize| {
                        let hi = _mm512_srli_epi32::<16>(v);
                        put(pair(_mm512_and_si512(v, nib), _mm512_and_si512(hi, nib)), j);
                    };
                    // SAFETY: `pairs_in` keeps the range's pairs inside the group (below
                    // e / 2 <= k / 2), so their lines lie inside the block.
                    unsafe { nibble_pairs(bp, a / 2, range, one) };
                }
            }
        }
    }

    /// Widens one block into dequantised bf16 weights (see
    /// [`BlockedWo::widen_dequant_scalar`]): `(q - z) * s` (exact in f32), rounded by
    /// `vcvtne2ps2bf16`, whose round-to-nearest-even and zeroing of subnormal inputs the
    /// scalar form repeats.
    ///
    /// # Safety
    /// AVX-512F, AVX512-BW and AVX512-BF16 (`bf16_dot`); `offs` has an entry per group;
    /// `block` is one whole block of `w` (`block_len(k)` bytes), `scale` and `zp` (when given)
    /// hold its `groups * 16` values. (`out` holds the pairs it holds, as in `widen`.)
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn widen_dequant(
        w: &BlockedWo,
        block: &[u8],
        (scale, zp): (&[f32], Option<&[f32]>),
        (offs, first_pair): (&[usize], usize),
        out: &mut [u32],
    ) {
        let n = out.len() / BLOCK;
        let nib = _mm512_set1_epi32(15);
        // Words 0..16 of `vcvtne2ps2bf16(hi, lo)` are lo's, 16..32 hi's: interleave them
        // into (lo, hi) pairs.
        let mut idx = [0i16; 32];
        for (i, v) in idx.iter_mut().enumerate() {
            *v = (i / 2 + 16 * (i % 2)) as i16;
        }
        // SAFETY: 32 i16 are one 64-byte load.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
        let bp = block.as_ptr();
        let op = out.as_mut_ptr();
        // 2^23 as f32 bits: its unit in the last place is 1, so a small integer OR-ed into
        // its mantissa gives the float 2^23 + q exactly, with no conversion.
        let magic = _mm512_set1_epi32(0x4b00_0000);
        let two_23 = _mm512_set1_ps(8_388_608.0);
        for (g, &first) in offs.iter().enumerate().take(w.groups()) {
            let (a, e) = w.bounds(g);
            let e = e.min(w.k);
            // SAFETY: g < groups: the group's 16 scales (and zero points) lie inside the
            // block's `groups * 16`.
            let (s, z) = unsafe {
                (
                    _mm512_loadu_ps(scale.as_ptr().add(g * BLOCK)),
                    zp.map_or(_mm512_setzero_ps(), |z| {
                        _mm512_loadu_ps(z.as_ptr().add(g * BLOCK))
                    }),
                )
            };
            // (q - z) * s as compressed-tensors computes it, down to the sign of a zero
            // (`q * s - z * s` in one fused multiply-add would give +0 where q == z).
            // (Without zero points, q - 0 is q, so the subtraction is left out.)
            let has_zp = zp.is_some();
            let dq = |q: __m512i| {
                let q = _mm512_cvtepi32_ps(q);
                _mm512_mul_ps(if has_zp { _mm512_sub_ps(q, z) } else { q }, s)
            };
            // The same for the 4-bit code in bits 0..4 of each lane (other bits ignored):
            // (2^23 + q) - (2^23 + z) is q - z exactly, +0 where q == z as above (zero
            // points are small integers, so 2^23 + z is exact too).
            let zm = _mm512_add_ps(z, two_23);
            let dq4 = |v: __m512i| {
                // (v & 15) | 2^23's bits in one ternary-logic op (0xEA: (A & B) | C).
                let q = _mm512_ternarylogic_epi32::<0xEA>(v, nib, magic);
                _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(q), zm), s)
            };
            // Lanes of (lo, hi) f32 pairs as bf16 pairs, stored as pair `j` of the range.
            let put = |lo: __m512, hi: __m512, j: usize| {
                // SAFETY: __m512bh and __m512i are both 64 bytes of plain bits.
                let h: __m512i = unsafe { std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo)) };
                let v = _mm512_permutexvar_epi16(idx, h);
                // SAFETY: `pairs_in` keeps pair first + j - first_pair below n, inside `out`.
                unsafe { _mm512_storeu_si512(op.add((first + j - first_pair) * BLOCK).cast(), v) };
            };
            let range = BlockedWo::pairs_in(a, e, first, (first_pair, n));
            match &w.codes {
                Codes::I8(_) => {
                    // Past the group's end: an empty high half.
                    let one = |lo, hi: Option<__m512i>, j| {
                        put(dq(lo), hi.map_or(_mm512_setzero_ps(), dq), j);
                    };
                    // SAFETY: as in `widen`: each pair's first column lies inside the group
                    // and the group's columns inside the block.
                    unsafe { int8_pairs(bp, (a, e), range, one) };
                }
                // Even group starts and k: columns c, c + 1 are pair c / 2 = a / 2 + j, in
                // line p / 4 at bits 4 (p % 4) (low column) and 16 + 4 (p % 4) (high).
                Codes::U4(_) => {
                    let one = |v: __m512i, j: usize| {
                        put(dq4(v), dq4(_mm512_srli_epi32::<16>(v)), j);
                    };
                    // SAFETY: `pairs_in` keeps the range's pairs inside the group (below
                    // e / 2 <= k / 2), so their lines lie inside the block.
                    unsafe { nibble_pairs(bp, a / 2, range, one) };
                }
            }
        }
    }

    /// # Safety
    /// AVX512-BF16, AVX-512F and AVX512-BW (all implied by `bf16_dot`); `t.offs` is the
    /// layer's `pair_offsets()` (non-decreasing, ending at `t.pairs`); `t.w` holds `nb` blocks
    /// of `t.pairs` pairs (u32 pairs, or 4-bit lines), `t.scale` (and `t.zp`)
    /// `nb * groups * 16` values; `x` is one row tile of `mr` rows (`[t.pairs][mr]` pairs), `sums`
    /// `mr * groups` values when `t.zp` is set; `1 <= mr <= 8`, `1 <= nb <= 2`. Adds the
    /// groups `t.groups` to the running totals in `out` (not zeroed here), as
    /// [`super::tile_scalar`] does.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn tile(
        t: &Tile<'_>,
        x: &[u16],
        sums: &[f32],
        mr: usize,
        nb: usize,
        out: &mut [[[f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS],
    ) {
        let p = t.pairs;
        match t.w {
            Weights::Wide(w) => {
                let wp = w.as_ptr();
                // SAFETY: the kernel calls this with i < nb and j < pairs, so the 16 u32 at
                // (i * pairs + j) * 16 lie inside `w`.
                let load = |i: usize, j: usize| unsafe {
                    _mm512_loadu_si512(wp.add((i * p + j) * BLOCK).cast())
                };
                let load4 = |i: usize, j: usize| four(&load, i, j);
                // Widened codes are read from L2, where the tile before put them.
                let pf = |_: usize, _: usize| {};
                // SAFETY: the caller's contract is each kernel's contract.
                unsafe {
                    if nb >= 2 {
                        rows!(mr, 2, t, x, sums, out, load, load4, pf)
                    } else {
                        rows!(mr, 1, t, x, sums, out, load, load4, pf)
                    }
                }
            }
            Weights::Nibbles(c) => {
                // SAFETY: the caller's contract is `nibble_lines`'.
                unsafe { nibble_lines(t, c, x, sums, mr, nb, out) }
            }
        }
    }

    /// [`tile`] for 4-bit codes, read as they are stored (`super::super::nibble_at`): pair
    /// `j`'s bf16 words are its line, shifted down `4 * (j % 4)` bits, through the nibble
    /// table (a shift and a word lookup per pair; four pairs share a line's load). Decoding
    /// each pair from a byte row (a widening, a shift, an or and the lookup) made the tile
    /// slower than memory at one or two rows on Zen 4.
    ///
    /// # Safety
    /// As [`tile`], with `c` its 4-bit codes: `nb` blocks of `nibble_block_len(t.pairs)`
    /// bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn nibble_lines(
        t: &Tile<'_>,
        c: &[u8],
        x: &[u16],
        sums: &[f32],
        mr: usize,
        nb: usize,
        out: &mut [[[f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS],
    ) {
        let stride = super::super::nibble_block_len(t.pairs);
        let cp = c.as_ptr();
        // SAFETY: the table is 32 u16, one 64-byte load.
        let table = unsafe { _mm512_loadu_si512(super::NIBBLE_BF16.as_ptr().cast()) };
        // The line holding pair j of block i.
        let line = |i: usize, j: usize| {
            // SAFETY: the kernel calls this with i < nb, j < pairs: the line of pair j,
            // (j / 4) * 64 bytes into block i, lies inside the tile's codes.
            unsafe { _mm512_loadu_si512(cp.add(i * stride + (j / 4) * 64).cast()) }
        };
        // The word lookup reads 5 index bits and the table repeats every 16 words, so the
        // next nibble's low bit above the value does not matter.
        let look = |v: __m512i| _mm512_permutexvar_epi16(v, table);
        let load = |i: usize, j: usize| {
            look(_mm512_srl_epi16(
                line(i, j),
                _mm_cvtsi32_si128((4 * (j % 4)) as i32),
            ))
        };
        let load4 = |i: usize, j: usize| {
            if j.is_multiple_of(4) {
                let v = line(i, j);
                [
                    look(v),
                    look(_mm512_srli_epi16::<4>(v)),
                    look(_mm512_srli_epi16::<8>(v)),
                    look(_mm512_srli_epi16::<12>(v)),
                ]
            } else {
                four(&load, i, j)
            }
        };
        // The line `PF_DIST` bytes ahead of pair j's in the code stream (blocks are
        // contiguous, so it runs on into the next block); the address is formed with
        // wrapping_add and a prefetch never faults.
        let pf = |i: usize, j: usize| {
            _mm_prefetch::<_MM_HINT_T0>(
                cp.wrapping_add(i * stride + (j / 4) * 64 + PF_DIST).cast(),
            );
        };
        // SAFETY: the caller's contract is each kernel's contract.
        unsafe {
            if nb >= 2 {
                rows!(mr, 2, t, x, sums, out, load, load4, pf)
            } else {
                rows!(mr, 1, t, x, sums, out, load, load4, pf)
            }
        }
    }

    /// Pairs `j..j + 4` of block `i`, one `load` each.
    #[inline(always)]
    fn four(load: &impl Fn(usize, usize) -> __m512i, i: usize, j: usize) -> [__m512i; 4] {
        [load(i, j), load(i, j + 1), load(i, j + 2), load(i, j + 3)]
    }

    /// How far ahead (bytes) a 4-bit code stream is prefetched.
    const PF_DIST: usize = 4096;

    /// # Safety
    /// As [`tile`] with `mr == MR`, `nb == NB`, `U == super::unroll(MR, NB)`; `load(i, j)` is
    /// block `i`'s pair `j` as bf16 pairs, valid for `i < NB`, `j < t.pairs`; `load4(i, j)` is
    /// pairs `j..j + 4` of block `i`, valid for `i < NB`, `j + 3 < t.pairs`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn kernel<const MR: usize, const NB: usize, const U: usize>(
        t: &Tile<'_>,
        x: &[u16],
        sums: &[f32],
        out: &mut [[[f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS],
        load: impl Fn(usize, usize) -> __m512i,
        load4: impl Fn(usize, usize) -> [__m512i; 4],
        pf: impl Fn(usize, usize),
    ) {
        let groups = t.offs.len() - 1;
        // Checked once here, so that each group's epilogue is straight-line code (with checks
        // per group, the compiler spilled the accumulators to the stack and branched per row).
        if t.scale.len() < NB * groups * BLOCK {
            return;
        }
        let scale = t.scale.as_ptr();
        // The zero-point term needs both the zero points and the rows' group sums.
        let zp =
            t.zp.filter(|z| z.len() >= NB * groups * BLOCK && sums.len() >= MR * groups)
                .map(|z| z.as_ptr());
        let sp = sums.as_ptr();
        let xp = x.as_ptr();
        let (ahead, ahead_lines) = (t.ahead.as_ptr(), t.ahead.len().div_ceil(64));
        // `ahead` is this call's share: line q goes with the call's q-th pair step.
        let base = t.offs.get(t.groups.0).copied().unwrap_or(0);
        let ahead_at = |j: usize| {
            let q = j.wrapping_sub(base);
            if q < ahead_lines {
                // In bounds (q < lines of `ahead`); a prefetch never faults anyway.
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(q * 64).cast());
            }
        };
        // Pairs per batch of the main loop: whole runs of U partial sums, and at least the 4
        // pairs of a 64-byte line of 4-bit codes, so that the line's prefetch is issued once
        // per batch rather than tested for at every step.
        let batch = U.max(4);
        // The running totals live in `out` (L1), not registers: with them the group
        // accumulators would not fit in the 32 vector registers. Each group adds to them once.
        // Pair j into partial sum u of every (row, block).
        let step_with =
            |parts: &mut [[[__m512; U]; NB]; MR], w: [__m512i; NB], j: usize, u: usize| {
                for (r, a) in parts.iter_mut().enumerate() {
                    // SAFETY: j < pairs and r < MR: the two bf16 at 2 * (j * MR + r) (this row's
                    // pair j in the tile's `[pairs][MR]` layout) lie inside `x` (read unaligned).
                    let pair = unsafe { xp.add(2 * (j * MR + r)).cast::<i32>().read_unaligned() };
                    // SAFETY: __m512i and __m512bh are both 64-byte vectors of plain bits.
                    let xv: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(pair)) };
                    for (ai, wi) in a.iter_mut().zip(&w) {
                        // SAFETY: as above.
                        let wb = unsafe { std::mem::transmute::<__m512i, __m512bh>(*wi) };
                        ai[u] = _mm512_dpbf16_ps(ai[u], wb, xv);
                    }
                }
            };
        let step = |parts: &mut [[[__m512; U]; NB]; MR], j: usize, u: usize| {
            let mut w = [_mm512_setzero_si512(); NB];
            for (i, wi) in w.iter_mut().enumerate() {
                *wi = load(i, j);
            }
            step_with(parts, w, j, u);
        };
        for g in t.groups.0..t.groups.1.min(groups) {
            let (first, end) = (t.offs[g], t.offs[g + 1]);
            let mut parts = [[[_mm512_setzero_ps(); U]; NB]; MR];
            let mut j = first;
            // Batches start at multiples of U from `first`: pair j + q goes to partial q % U,
            // as in the runs below and in `tile_scalar`.
            while j + batch <= end {
                if j.wrapping_sub(base) < ahead_lines {
                    for q in 0..batch {
                        ahead_at(j + q);
                    }
                }
                for i in 0..NB {
                    for q in (0..batch).step_by(4) {
                        pf(i, j + q);
                    }
                }
                // Four pairs (a 64-byte line of 4-bit codes) are loaded at once.
                for q in (0..batch).step_by(4) {
                    let mut w4 = [[_mm512_setzero_si512(); 4]; NB];
                    for (i, wi) in w4.iter_mut().enumerate() {
                        *wi = load4(i, j + q);
                    }
                    for s in 0..4 {
                        let mut w = [_mm512_setzero_si512(); NB];
                        for (wi, w4i) in w.iter_mut().zip(&w4) {
                            *wi = w4i[s];
                        }
                        step_with(&mut parts, w, j + q + s, (q + s) % U);
                    }
                }
                j += batch;
            }
            while j + U <= end {
                for u in 0..U {
                    ahead_at(j + u);
                    step(&mut parts, j + u, u);
                }
                j += U;
            }
            while j < end {
                ahead_at(j);
                step(&mut parts, j, 0);
                j += 1;
            }
            let mut acc = [[_mm512_setzero_ps(); NB]; MR];
            for (a, pr) in acc.iter_mut().zip(&parts) {
                for (ai, p) in a.iter_mut().zip(pr) {
                    // Pairwise, as `combine` does.
                    let mut p = *p;
                    let mut w = U;
                    while w > 1 {
                        w /= 2;
                        for q in 0..w {
                            p[q] = _mm512_add_ps(p[2 * q], p[2 * q + 1]);
                        }
                    }
                    *ai = p[0];
                }
            }
            if let Some(zp) = zp {
                for (r, a) in acc.iter_mut().enumerate() {
                    // SAFETY: r < MR and g < groups: inside `sums` (MR * groups, checked).
                    let sm = _mm512_set1_ps(unsafe { *sp.add(r * groups + g) });
                    for (i, ai) in a.iter_mut().enumerate() {
                        // SAFETY: i < NB, g < groups: the 16 zero points at
                        // (i * groups + g) * 16 lie inside `t.zp` (NB * groups * 16, checked).
                        let z = unsafe { _mm512_loadu_ps(zp.add((i * groups + g) * BLOCK)) };
                        *ai = _mm512_fnmadd_ps(z, sm, *ai);
                    }
                }
            }
            for i in 0..NB {
                // SAFETY: as the zero points: inside `t.scale` (NB * groups * 16, checked).
                let s = unsafe { _mm512_loadu_ps(scale.add((i * groups + g) * BLOCK)) };
                for r in 0..MR {
                    let o = out[r][i].as_mut_ptr();
                    // SAFETY: r < MR <= 8, i < NB <= 2; each entry is 16 f32.
                    unsafe {
                        _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[r][i], s, _mm512_loadu_ps(o)))
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{dense, sample_bits};
    use super::*;

    /// `m` rows of sample activations `[m, k]`, their bf16 form, and `gemm_bf16`'s output as
    /// a dense `[m, n]` (NaN where nothing was emitted).
    fn dense_gemm_bf16(w: &BlockedWo, m: usize) -> (Vec<f32>, Bf16Rows, Vec<f32>) {
        let (n, k) = (w.n, w.k);
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 31) % 97) as f32 / 13.0 - 3.0 + 1e-3 * (i % 7) as f32)
            .collect();
        let xb = w.bf16_rows(&x, m);
        let got = dense(n, m, |emit| w.gemm_bf16(&xb, m, 0, w.blocks(), emit));
        (x, xb, got)
    }

    /// The AMX-BF16 grouped route's result for `m` rows, per output, written from its
    /// definition: per group, `tdpbf16ps` steps over the group's pairs (zeros to the step's
    /// end) from zero, then `acc = fma(-z, Σx, c)`, `total = fma(acc, s, total)`.
    fn amx_grouped_reference(w: &BlockedWo, xb: &Bf16Rows, m: usize) -> Vec<f32> {
        use crate::cpu::amx_bf16::{dot_step, TILE};
        let (n, offs, groups, pairs) = (w.n, w.pair_offsets(), w.groups(), xb.pairs);
        let mut wide = vec![0u32; offs[groups] * BLOCK];
        let mut out = vec![0f32; m * n];
        for b in 0..w.blocks() {
            w.widen_scalar(b, offs, 0, &mut wide);
            let zp = w.zp_blocks(b, 1).flatten();
            for r in 0..m {
                let r0 = r - r % TILE_ROWS;
                let mt = (m - r0).min(TILE_ROWS);
                let x_pair = |p: usize| {
                    let at = 2 * r0 * pairs + tile_pair(mt, r - r0, p);
                    u32::from(xb.x[at]) | (u32::from(xb.x[at + 1]) << 16)
                };
                for l in 0..BLOCK.min(n - b * BLOCK) {
                    let mut total = 0f32;
                    for g in 0..groups {
                        let mut c = 0f32;
                        for s0 in (offs[g]..offs[g + 1]).step_by(TILE) {
                            let ps = s0..s0 + TILE;
                            let inside = |p: &usize| *p < offs[g + 1];
                            let xs = ps.clone().map(|p| if inside(&p) { x_pair(p) } else { 0 });
                            let ws = ps.map(|p| if inside(&p) { wide[p * BLOCK + l] } else { 0 });
                            c = dot_step(c, xs, ws);
                        }
                        let at = g * BLOCK + l;
                        if let Some(z) = zp {
                            c = (-z[at]).mul_add(xb.sums[r * groups + g], c);
                        }
                        total = c.mul_add(w.scale[b * groups * BLOCK + at], total);
                    }
                    out[r * n + b * BLOCK + l] = total;
                }
            }
        }
        out
    }

    /// Widening: SIMD equals scalar; the bf16 tile: SIMD equals the scalar reference bit for
    /// bit, and both are close to an f64 reference on the bf16-rounded activations. Beyond one
    /// row tile, the AMX-BF16 grouped route (on the model anywhere, on the hardware where
    /// enabled) equals its own reference bit for bit and is as close to the f64 one.
    #[test]
    fn bf16_simd_equals_scalar_and_reference() {
        for (n, k, groups, asym, m) in [
            (37, 64, 4, true, 11),
            (16, 128, 1, false, 9),
            (50, 96, 3, true, 8),
            (20, 70, 2, true, 3),
            (33, 66, 3, false, 17),
            (48, 75, 5, true, 8),
            (40, 128, 2, true, 1),
            (24, 64, 1, false, 2),
            (33, 96, 3, true, 5),
            (17, 256, 2, false, 4),
            (24, 44, 2, false, 2),
            (20, 44, 2, true, 1),
            // Wider than one span of pairs: row tiles add span after span.
            (20, 4096, 32, true, 9),
            (18, 2304, 3, false, 17),
        ] {
            for bits in [8, 4] {
                let (w, _) = sample_bits(n, k, groups, asym, bits);
                let offs = w.pair_offsets();
                for b in 0..w.blocks() {
                    let mut a = vec![7u32; offs[groups] * BLOCK];
                    let mut s = vec![9u32; offs[groups] * BLOCK];
                    w.widen(b, offs, 0, &mut a);
                    w.widen_scalar(b, offs, 0, &mut s);
                    assert_eq!(a, s, "widen block {b} of {n}x{k}, {bits} bits");
                }
                AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Off));
                let (x, xb, got) = dense_gemm_bf16(&w, m);
                AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Auto));
                let mut outputs = vec![got.clone()];
                if m > TILE_ROWS {
                    let want = amx_grouped_reference(&w, &xb, m);
                    for route in [AmxRoute::Model, AmxRoute::Auto] {
                        AMX_BF16_ROUTE.with(|c| c.set(route));
                        let (_, _, amx) = dense_gemm_bf16(&w, m);
                        AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Auto));
                        if route == AmxRoute::Auto && !crate::cpu::amx_bf16::enabled() {
                            continue;
                        }
                        let same = amx
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{route:?} route, {n}x{k} {bits} bits, {m} rows");
                        outputs.push(amx);
                    }
                }
                let g = w.groups();
                let mut wide = vec![0u32; 2 * offs[g] * BLOCK];
                let tb = w.tile_blocks(m);
                for b in (0..w.blocks()).step_by(tb) {
                    let nb = (w.blocks() - b).min(tb);
                    for i in 0..nb {
                        w.widen_scalar(b + i, offs, 0, &mut wide[i * offs[g] * BLOCK..]);
                    }
                    let t = Tile {
                        w: Weights::Wide(&wide),
                        pairs: offs[g],
                        offs,
                        scale: &w.scale[b * g * BLOCK..(b + nb) * g * BLOCK],
                        zp: w.zp_blocks(b, nb).map(|z| z.expect("blocks in range")),
                        groups: (0, g),
                        ahead: &[],
                    };
                    for r0 in (0..m).step_by(TILE_ROWS) {
                        let mr = (m - r0).min(TILE_ROWS);
                        let mut want = [[[0f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS];
                        tile_scalar(
                            &t,
                            &xb.x[r0 * 2 * offs[g]..],
                            xb.sums.get(r0 * g..).unwrap_or(&[]),
                            mr,
                            nb,
                            &mut want,
                        );
                        for (rr, row) in want.iter().enumerate().take(mr) {
                            for (i, lanes) in row.iter().enumerate().take(nb) {
                                for (l, v) in lanes.iter().enumerate() {
                                    let j = (b + i) * BLOCK + l;
                                    if j < n {
                                        assert_eq!(
                                            got[(r0 + rr) * n + j].to_bits(),
                                            v.to_bits(),
                                            "row {} feature {j}",
                                            r0 + rr
                                        );
                                    }
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
                            let xv = from_bf16(u32::from(to_bf16(x[r * k + c])));
                            exact +=
                                (f64::from(codes[c]) - z) * f64::from(scale[gi]) * f64::from(xv);
                        }
                        for got in &outputs {
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

    /// bf16 `v` nearest to `p` (ties to the even one), found by comparing the two bf16 values
    /// around it in f64: an independent form of `to_bf16` for finite normal values.
    fn nearest_bf16(p: f32) -> u32 {
        let lo = p.to_bits() >> 16;
        let (a, b) = (from_bf16(lo), from_bf16(lo + 1));
        let (da, db) = (
            (f64::from(p) - f64::from(a)).abs(),
            (f64::from(b) - f64::from(p)).abs(),
        );
        if da < db || (da == db && lo.is_multiple_of(2)) {
            lo
        } else {
            lo + 1
        }
    }

    /// With bf16 scales, multi-row tiles widen codes into compressed-tensors' dequantised bf16
    /// weights: the SIMD widening equals the scalar one and `bf16((q - z) * s)` found
    /// independently, the GEMM equals the scalar tile on those weights bit for bit (runs of
    /// at most SPAN_PAIRS pairs, scale 1, no zero points) and the f64 sum within 1e-4.
    #[test]
    fn dequantised_widening_equals_compressed_tensors_and_the_scalar_tile() {
        for (n, k, groups, asym, m, bits) in [
            (37, 64, 4, true, 33, 8),
            (33, 66, 3, false, 41, 8),
            (48, 75, 5, true, 32, 8),
            (24, 44, 2, false, 35, 4),
            (40, 128, 2, true, 48, 4),
            (20, 4096, 32, true, 33, 4),
            (18, 2304, 3, false, 40, 8),
        ] {
            let (plain, q) = sample_bits(n, k, groups, asym, bits);
            assert!(!plain.scales_bf16, "1e-3 multiples are not bf16 values");
            // The sample's scales rounded to bf16, one in five negative.
            let scale: Vec<f32> = (0..n * groups)
                .map(|i| {
                    let v = from_bf16(u32::from(to_bf16(1e-3 * (1 + i % 13) as f32)));
                    if i % 5 == 3 {
                        -v
                    } else {
                        v
                    }
                })
                .collect();
            let zp: Vec<i8> = (0..n * groups).map(|i| (i % 15) as i8 - 7).collect();
            let starts: Vec<usize> = (0..groups).map(|g| g * k / groups).collect();
            let w = BlockedWo::new(n, k, &q, &scale, asym.then_some(&zp[..]), starts);
            assert!(w.scales_bf16);
            assert!(w.widens_dequantised(m), "{n}x{k} {bits} bits, {m} rows");
            assert!(!w.widens_dequantised(DEQUANT_MIN_ROWS - 1));
            let offs = w.pair_offsets();
            let g = w.groups();
            let pairs = offs[g];
            let mut deq = vec![0u32; w.blocks() * pairs * BLOCK];
            for b in 0..w.blocks() {
                let mut a = vec![7u32; pairs * BLOCK];
                let s = &mut deq[b * pairs * BLOCK..(b + 1) * pairs * BLOCK];
                w.widen_dequant(b, offs, 0, &mut a);
                w.widen_dequant_scalar(b, offs, 0, s);
                assert_eq!(a, s, "widen block {b} of {n}x{k}, {bits} bits");
            }
            // bf16((q - z) * s) of feature j, column c in group gi: compressed-tensors'
            // dequantisation.
            let ct_weight = |j: usize, c: usize, gi: usize| {
                let z = if asym {
                    f32::from(zp[j * groups + gi])
                } else {
                    0.0
                };
                nearest_bf16((f32::from(q[j * k + c]) - z) * scale[j * groups + gi])
            };
            for j in 0..n {
                let (b, l) = (j / BLOCK, j % BLOCK);
                for (gi, &first) in offs.iter().enumerate().take(g) {
                    let (a, e) = w.bounds(gi);
                    for c in a..e.min(k) {
                        let want = ct_weight(j, c, gi);
                        let at = (b * pairs + first + (c - a) / 2) * BLOCK + l;
                        let got = if (c - a) % 2 == 0 {
                            deq[at] & 0xffff
                        } else {
                            deq[at] >> 16
                        };
                        assert_eq!(got, want, "feature {j} column {c}");
                    }
                }
            }
            // The AMX-BF16 route on the model (any CPU) equals the instruction's order on
            // these weights; where the hardware route is enabled it equals the model.
            let amx_reference = |xb: &Bf16Rows, m: usize| {
                let kp = pairs.next_multiple_of(crate::cpu::amx_bf16::TILE);
                let mut out = vec![0f32; m * n];
                for r in 0..m {
                    let r0 = r - r % TILE_ROWS;
                    let mt = (m - r0).min(TILE_ROWS);
                    let row_pair = |p: usize| {
                        let at = 2 * r0 * pairs + tile_pair(mt, r - r0, p);
                        u32::from(xb.x[at]) | (u32::from(xb.x[at + 1]) << 16)
                    };
                    for j in 0..n {
                        let (b, l) = (j / BLOCK, j % BLOCK);
                        let w_pair = |p: usize| deq[(b * pairs + p) * BLOCK + l];
                        let mut c = 0f32;
                        for s0 in (0..kp).step_by(crate::cpu::amx_bf16::TILE) {
                            let ps = s0..s0 + crate::cpu::amx_bf16::TILE;
                            let get = |f: &dyn Fn(usize) -> u32, p: usize| {
                                if p < pairs {
                                    f(p)
                                } else {
                                    0
                                }
                            };
                            let a: Vec<u32> = ps.clone().map(|p| get(&row_pair, p)).collect();
                            let wv: Vec<u32> = ps.map(|p| get(&w_pair, p)).collect();
                            c = crate::cpu::amx_bf16::dot_step(c, a.into_iter(), wv.into_iter());
                        }
                        out[r * n + j] = c;
                    }
                }
                out
            };
            // (And at the threshold itself, a single pass of 32 rows.)
            for rows in [m, DEQUANT_MIN_ROWS] {
                for route in [AmxRoute::Model, AmxRoute::Auto] {
                    AMX_BF16_ROUTE.with(|c| c.set(route));
                    let (_, xb, got) = dense_gemm_bf16(&w, rows);
                    AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Auto));
                    if route == AmxRoute::Auto && !crate::cpu::amx_bf16::enabled() {
                        continue;
                    }
                    let want = amx_reference(&xb, rows);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{route:?} route, {n}x{k} {bits} bits, {rows} rows");
                }
            }
            // The AVX512-BF16 tiles (the route off): the scalar tile's order, bit for bit.
            AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Off));
            let (x, xb, got) = dense_gemm_bf16(&w, m);
            AMX_BF16_ROUTE.with(|c| c.set(AmxRoute::Auto));
            let runs = dequant_runs(pairs);
            let ones = vec![1f32; TILE_BLOCKS * (runs.len() - 1) * BLOCK];
            let tb = w.tile_blocks(m);
            for b in (0..w.blocks()).step_by(tb) {
                let nb = (w.blocks() - b).min(tb);
                let t = Tile {
                    w: Weights::Wide(&deq[b * pairs * BLOCK..(b + nb) * pairs * BLOCK]),
                    pairs,
                    offs: &runs,
                    scale: &ones[..nb * (runs.len() - 1) * BLOCK],
                    zp: None,
                    groups: (0, runs.len() - 1),
                    ahead: &[],
                };
                for r0 in (0..m).step_by(TILE_ROWS) {
                    let mr = (m - r0).min(TILE_ROWS);
                    let mut want = [[[0f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS];
                    tile_scalar(&t, &xb.x[r0 * 2 * pairs..], &[], mr, nb, &mut want);
                    for (rr, row) in want.iter().enumerate().take(mr) {
                        for (i, lanes) in row.iter().enumerate().take(nb) {
                            for (l, v) in lanes.iter().enumerate() {
                                let j = (b + i) * BLOCK + l;
                                if j < n {
                                    let r = r0 + rr;
                                    assert_eq!(got[r * n + j].to_bits(), v.to_bits(), "{r} {j}");
                                }
                            }
                        }
                    }
                }
            }
            for r in 0..m {
                for j in 0..n {
                    let mut exact = 0f64;
                    for c in 0..k {
                        let wv = ct_weight(j, c, c * groups / k);
                        let xv = from_bf16(u32::from(to_bf16(x[r * k + c])));
                        exact += f64::from(from_bf16(wv)) * f64::from(xv);
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

    /// Widening a range of pairs in the AMX step layout (groups moved to whole steps, gaps
    /// between) writes exactly that range of the whole-block widening, SIMD or scalar, plain
    /// or dequantised, and `zero_gaps` clears what no group has (the buffer starts as junk).
    #[test]
    fn pair_ranges_widen_as_whole_blocks_with_gaps_zeroed() {
        for (n, k, groups, asym, bits) in [
            (20, 75, 5, true, 8),
            (33, 66, 3, false, 4),
            (16, 256, 2, true, 4),
        ] {
            let (w, _) = sample_bits(n, k, groups, asym, bits);
            let offs = w.pair_offsets();
            let to = step_offsets(offs);
            let (kp, gaps) = (to[w.groups()], w.gaps(&to));
            for b in 0..w.blocks() {
                let mut whole = vec![0u32; kp * BLOCK];
                let mut whole_dq = vec![0u32; kp * BLOCK];
                w.widen_scalar(b, &to, 0, &mut whole);
                w.widen_dequant_scalar(b, &to, 0, &mut whole_dq);
                for first in (0..kp).step_by(TILE_ROWS + 3) {
                    let len = (2 * TILE_ROWS + 1).min(kp - first);
                    let want = &whole[first * BLOCK..(first + len) * BLOCK];
                    let want_dq = &whole_dq[first * BLOCK..(first + len) * BLOCK];
                    let mut got = vec![0xdead_beef_u32; len * BLOCK];
                    w.widen(b, &to, first, &mut got);
                    BlockedWo::zero_gaps(&gaps, first, &mut got);
                    assert_eq!(got, want, "block {b} pairs {first}+{len}");
                    got.fill(0xdead_beef);
                    w.widen_scalar(b, &to, first, &mut got);
                    BlockedWo::zero_gaps(&gaps, first, &mut got);
                    assert_eq!(got, want, "scalar, block {b} pairs {first}+{len}");
                    got.fill(0xdead_beef);
                    w.widen_dequant(b, &to, first, &mut got);
                    BlockedWo::zero_gaps(&gaps, first, &mut got);
                    assert_eq!(got, want_dq, "dequantised, block {b} pairs {first}+{len}");
                }
            }
        }
    }

    /// A layer without input columns (k = 0) emits zero rows on either path, bf16 scales and
    /// enough rows for the dequantised one included (it has no pairs to cut into runs).
    #[test]
    fn layers_without_columns_emit_zeros_on_both_paths() {
        for s in [0.5f32, 0.3] {
            let w = BlockedWo::new(16, 0, &[], &[s; 16], None, vec![0]);
            assert_eq!(w.scales_bf16, s == 0.5);
            let m = DEQUANT_MIN_ROWS + 8;
            let xb = w.bf16_rows(&[], m);
            let mut rows = vec![0usize; m];
            w.gemm_bf16(&xb, m, 0, w.blocks(), |r, _, lanes| {
                assert!(lanes.iter().all(|&v| v == 0.0));
                rows[r] += 1;
            });
            assert!(rows.iter().all(|&n| n == 1), "{rows:?}");
        }
    }

    /// Products below f32's normal range widen to signed zeros in both forms (the SIMD one
    /// rounds with `vcvtne2ps2bf16`, which reads them as zero); the rest round to nearest.
    #[test]
    fn dequantised_widening_zeroes_subnormal_products() {
        let (n, k) = (16, 256);
        // Every int8 code, and every 4-bit code (stored as nibbles, widened line by line).
        for span in [256usize, 16] {
            let q: Vec<i8> = (0..n * k)
                .map(|i| ((i % span) as i64 - (span / 2) as i64) as i8)
                .collect();
            subnormal_products_zeroed(n, k, &q, span == 16);
        }
    }

    fn subnormal_products_zeroed(n: usize, k: usize, q: &[i8], nibbles: bool) {
        // 2^-133 (a subnormal bf16 value) and FLT_MIN: codes times them span both sides of
        // the normal range, one feature in two negative.
        let scale: Vec<f32> = (0..n)
            .map(|j| {
                let v = f32::from_bits(if j % 4 < 2 { 0x0001_0000 } else { 0x0080_0000 });
                if j % 2 == 1 {
                    -v
                } else {
                    v
                }
            })
            .collect();
        let w = BlockedWo::new(n, k, q, &scale, None, vec![0]);
        assert!(w.scales_bf16);
        assert_eq!(matches!(w.codes, Codes::U4(_)), nibbles);
        let pairs = w.pair_offsets()[1];
        let (mut a, mut b) = (vec![7u32; pairs * BLOCK], vec![9u32; pairs * BLOCK]);
        w.widen_dequant(0, w.pair_offsets(), 0, &mut a);
        w.widen_dequant_scalar(0, w.pair_offsets(), 0, &mut b);
        assert_eq!(a, b);
        let (mut zeros, mut rounded) = (0, 0);
        for j in 0..n {
            for c in 0..k {
                let p = f32::from(q[j * k + c]) * scale[j];
                let at = (c / 2) * BLOCK + j;
                let got = if c % 2 == 0 {
                    a[at] & 0xffff
                } else {
                    a[at] >> 16
                };
                if p.is_subnormal() {
                    assert_eq!(got, if p < 0.0 { 0x8000 } else { 0 }, "{j} {c}");
                    zeros += 1;
                } else {
                    assert_eq!(got, nearest_bf16(p), "{j} {c}");
                    rounded += 1;
                }
            }
        }
        assert!(zeros > 100 && rounded > 100, "{zeros} {rounded}");
    }

    /// A 4-bit layer whose groups do not cover its columns from 0 (so the tile's pairs are
    /// not the storage's) takes the widened path, and agrees with the fp32 GEMM on
    /// activations exact in bf16 (a review found the in-register path taken, off by 0.29).
    #[test]
    fn groups_not_from_column_zero_widen_their_codes() {
        let (n, k, m) = (16, 16, 1);
        let q: Vec<i8> = (0..n * k)
            .map(|i| ((i * 3 + i / 5) % 16) as i8 - 8)
            .collect();
        let scale: Vec<f32> = (0..n * 2).map(|i| 0.25 + (i % 3) as f32 * 0.125).collect();
        let w = BlockedWo::new(n, k, &q, &scale, None, vec![2, 8]);
        assert!(matches!(w.codes, Codes::U4(_)));
        assert!(!w.reads_nibbles(m));
        let x: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
        let want = dense(n, m, |emit| w.gemm(&x, m, 0, w.blocks(), emit));
        let xb = w.bf16_rows(&x, m);
        let got = dense(n, m, |emit| w.gemm_bf16(&xb, m, 0, w.blocks(), emit));
        for (g, v) in got.iter().zip(&want) {
            assert!((g - v).abs() <= 1e-5 * v.abs().max(1.0), "{g} vs {v}");
        }
    }

    /// The codes the AMX-BF16 GEMMs' passes prefetch are the layer's own, from the first
    /// block of the call on, a block's bytes apart, with the pair size of their storage
    /// (32 bytes for two int8 columns of 16 lanes, 16 for a 4-bit pair).
    #[test]
    fn code_source_is_the_layers_codes_from_the_first_block() {
        use crate::cpu::amx_bf16::StepLines;
        let (n, k) = (64, 128);
        for (int8, lines) in [(true, StepLines::Eight), (false, StepLines::Four)] {
            let q: Vec<i8> = (0..n * k)
                .map(|i| {
                    if int8 {
                        (i % 251) as i8
                    } else {
                        (i % 16) as i8 - 8
                    }
                })
                .collect();
            let w = BlockedWo::new(n, k, &q, &vec![0.5; n], None, vec![0]);
            assert_eq!(matches!(w.codes, Codes::I8(_)), int8);
            let len = w.codes.block_len(k);
            assert_eq!(len, lines.pair_bytes() * k / 2, "one block's pairs");
            let src = w.code_source(2).expect("a layer with codes");
            assert_eq!((src.block_len, src.lines), (len, lines));
            let from = &w.code_bytes()[2 * len..];
            assert_eq!(
                (src.codes.as_ptr(), src.codes.len()),
                (from.as_ptr(), from.len())
            );
            assert!(w.code_source(w.blocks() + 1).is_none());
        }
    }

    /// The scalar tile reads 4-bit lines as their widened pairs.
    #[test]
    fn scalar_tile_reads_nibbles_as_widened_pairs() {
        for (n, k, groups, asym, m) in [(40, 64, 2, true, 3), (24, 44, 2, false, 1)] {
            let (w, _) = sample_bits(n, k, groups, asym, 4);
            assert!(matches!(w.codes, Codes::U4(_)));
            let offs = w.pair_offsets();
            let (g, pairs) = (w.groups(), offs[w.groups()]);
            let len = w.codes.block_len(k);
            assert_eq!(len, super::super::nibble_block_len(pairs));
            let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 / 5.0 - 1.0).collect();
            let xb = w.bf16_rows(&x, m);
            for b in 0..w.blocks() {
                let mut wide = vec![0u32; pairs * BLOCK];
                w.widen_scalar(b, offs, 0, &mut wide);
                let scale = &w.scale[b * g * BLOCK..(b + 1) * g * BLOCK];
                let zp = w.zp_blocks(b, 1).map(|z| z.expect("block in range"));
                let run = |weights| {
                    let t = Tile {
                        w: weights,
                        pairs,
                        offs,
                        scale,
                        zp,
                        groups: (0, g),
                        ahead: &[],
                    };
                    let mut out = [[[0f32; BLOCK]; TILE_BLOCKS]; TILE_ROWS];
                    tile_scalar(&t, &xb.x, &xb.sums, m, 1, &mut out);
                    out
                };
                let a = run(Weights::Wide(&wide));
                let c = run(Weights::Nibbles(&w.codes.bytes()[b * len..(b + 1) * len]));
                assert!(a[0][0].iter().any(|v| *v != 0.0));
                assert_eq!(a, c, "block {b} of {n}x{k}");
            }
        }
    }

    /// Gate and up share prepared rows when their columns and groups agree, even when only
    /// one of them stores 4-bit codes (whose +8 bias needs the group sums): the shared rows
    /// give the same result as the projection's own.
    #[test]
    fn rows_prepared_by_one_projection_serve_another() {
        let (k, groups, m, n) = (64, 2, 9, 20);
        let (up, _) = sample_bits(n, k, groups, false, 8);
        let (gate, _) = sample_bits(n, k, groups, false, 4);
        assert!(up.zp.is_none() && gate.zp.is_some());
        let x: Vec<f32> = (0..m * k).map(|i| (i % 23) as f32 / 7.0 - 1.5).collect();
        let collect = |w: &BlockedWo, xb: &Bf16Rows| {
            let mut out = vec![f32::NAN; m * n];
            w.gemm_bf16(xb, m, 0, w.blocks(), |r, b, lanes| {
                for (l, &v) in lanes.iter().enumerate() {
                    if b * BLOCK + l < n {
                        out[r * n + b * BLOCK + l] = v;
                    }
                }
            });
            out
        };
        let own = collect(&gate, &gate.bf16_rows(&x, m));
        let shared = collect(&gate, &up.bf16_rows(&x, m));
        assert!(own.iter().all(|v| v.is_finite()));
        assert_eq!(
            own.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            shared.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    /// Rows prepared for one row count are laid out by its tiles: a GEMM of another count
    /// emits nothing rather than misreading them.
    #[test]
    fn rows_serve_only_their_row_count() {
        let (w, _) = sample_bits(20, 64, 2, false, 8);
        let x: Vec<f32> = (0..9 * 64).map(|i| (i % 11) as f32 / 3.0 - 1.5).collect();
        let xb = w.bf16_rows(&x, 9);
        assert_eq!(xb.rows, 9);
        let mut emitted = 0;
        w.gemm_bf16(&xb, 8, 0, w.blocks(), |_, _, _| emitted += 1);
        assert_eq!(emitted, 0);
        w.gemm_bf16(&xb, 9, 0, w.blocks(), |_, _, _| emitted += 1);
        assert_eq!(emitted, 9 * w.blocks());
    }

    #[test]
    fn nibble_table_holds_the_codes_bf16_bits() {
        for (w, &b) in NIBBLE_BF16.iter().enumerate() {
            assert_eq!(u32::from(b), code_bf16((w % 16) as i8), "word {w}");
        }
    }

    #[test]
    fn group_spans_cover_the_groups_in_order() {
        // Groups of 64, 64, 1100 and 10 pairs.
        let offs = [0, 64, 128, 1228, 1238];
        assert_eq!(group_spans(&offs, 1024), vec![(0, 2), (2, 3), (3, 4)]);
        assert_eq!(group_spans(&offs, 1200), vec![(0, 2), (2, 4)]);
        assert_eq!(group_spans(&offs, 0), vec![(0, 4)]);
        assert_eq!(group_spans(&offs, 5000), vec![(0, 4)]);
        assert_eq!(group_spans(&[0, 10], 4), vec![(0, 1)]);
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(to_bf16(1.0), 0x3f80);
        // Ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7.
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(to_bf16(-2.5), 0xc020);
        // Subnormals flush to signed zero; infinities and NaN stay.
        assert_eq!(to_bf16(1e-40), 0);
        assert_eq!(to_bf16(-1e-40), 0x8000);
        assert_eq!(to_bf16(f32::INFINITY), 0x7f80);
        assert!(from_bf16(u32::from(to_bf16(f32::NAN))).is_nan());
    }
}
