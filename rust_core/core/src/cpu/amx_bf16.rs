//! AMX-BF16 tiles for weight-only layers with bf16 activations, on CPUs that have them (Intel
//! Sapphire Rapids and later): one `tdpbf16ps` multiplies 16 activation rows by 16 features
//! over 32 inputs (8,192 multiply-adds), where `vdpbf16ps` does 32. On a 2-core Emerald
//! Rapids-class VM, `vdpbf16ps` peaked at 79 GMAC/s on two threads while torch's bf16 matmul
//! (oneDNN, on these tiles) ran Qwen3-30B-A3B's experts at ~235, so weight-only prefill there
//! was 2-4x behind torch until this path (bench/RESULTS.md, run AK).
//!
//! It serves [`super::wo::BlockedWo::gemm_bf16`] beyond one row tile: the dequantised-weight
//! case (bf16 scales, [`super::wo::bf16::DEQUANT_MIN_ROWS`] rows or more) through [`gemm`],
//! whose weights are widened into `bf16((q - z) * s)` pairs, and the exact-weight case through
//! [`gemm_grouped`], whose weights are the codes themselves (small integers, exact in bf16)
//! with each group's product folded into the totals by the group's zero point and scale.
//! Widened weights are `[pairs][16]` u32, which is exactly AMX's B operand (16 pairs x 16
//! features per tile); the activations are laid out row-major as bf16 pairs, the A operand.
//!
//! Numerics are the instruction's own, as the Intel SDM's pseudocode for `TDPBF16PS` gives
//! them (and Bochs implements them): for each output, the 16 even-column products and the 16
//! odd-column products of one step are each accumulated from zero by fused multiply-adds
//! (fp32, round to nearest even, subnormal inputs read as zero and subnormal results flushed),
//! the two partial sums are added, and that sum is added to the accumulator. So the rounding
//! depends on where the steps cut the reduction (every 32 columns from the first); that order
//! differs from the `vdpbf16ps` path's, within fp32 rounding of the same exact products.
//! [`Model`] implements it in software; the tests run the tile driver on the model against an
//! element-wise reference on any CPU, and [`enabled`] runs the driver once on the hardware
//! against the model before the dispatch uses it (on the 2-core VM above the hardware equalled
//! this model in 51,200 of 51,200 outputs of random normal operands, where the Intrinsics
//! Guide's sequential form matched 18,268).
//!
//! Work goes in passes of 2 row tiles x 2 blocks (32 rows x 32 features; one row tile where
//! 16 rows or fewer are left) over a chunk of the reduction ([`CHUNK_STEPS`]), each one
//! self-contained `asm!` block (zero or load the accumulators, loop, store) on tiles that the
//! [`Hw`]'s session configured, as the int8 tiles of [`super::amx`] do. The blocks are
//! widened chunk by chunk into a buffer that stays in L1 while every pass of rows reads it,
//! and block pairs go in panels so that a chunk of the rows is read once per panel; the
//! accumulators go through memory between chunks, which rounds nothing. Rows are padded to 32
//! and the reduction to 16 pairs with zeros; a single last block is run as a pair with
//! itself. Before the chunks, every pass ran the whole reduction: at Mixtral's 14,336-column
//! down projection a block pair's widened weights (917 KB) and a pass's rows (918 KB) no
//! longer fit L2 together.
//!
//! Widening the codes streams them from memory, and it waited on them: one thread reads
//! ~8 GB/s on the 2-core VM (as many lines in flight as one core allows), and while the tiles
//! computed, nothing was read. So the first pass of rows after each widening prefetches the
//! codes of the next one ([`Prefetch`], from [`CodeSource`]; 16 lines per step for int8
//! codes, 8 for 4-bit), and the widening finds them in L2. Alternated call by call in one
//! process (`moe_time`, cold weights, random routing, bf16 inputs), medians:
//! - W8A16: Mixtral T=128 256 against 334 ms (bf16 scales) and 199 against 274 (other
//!   scales), DeepSeek-V2-Lite T=128 65 against 81, Qwen3-30B-A3B T=1024 188 against 215;
//! - W4A16: Mixtral T=128 176 against 195 and 168 against 185, Qwen3-30B-A3B T=128 65
//!   against 71, DeepSeek-V2-Lite T=1024 142 against 150.
//!
//! (`prefetcht0` did less, 263 against 314 for int8 Mixtral T=128; so did prefetching inside
//! the widening, 2 KB ahead of its own loads: 278.)

use super::wo::BLOCK;

/// Activation rows per A tile, and pairs per A or B tile row.
pub const TILE: usize = 16;
/// Rows per pass (two row tiles).
pub const PASS_ROWS: usize = 2 * TILE;
/// Entries of a pass's output: row `r` of C `(i, j)` (row tile `i`, block `j`) is entry
/// `32 i + 2 r + j`.
pub const OUT_ENTRIES: usize = 2 * PASS_ROWS;

/// The outputs of one pass, as f32 bits' carrier, on a cache line (see
/// [`super::spare::OnLine`]).
pub type PassOut = super::spare::OnLine<[[f32; BLOCK]; OUT_ENTRIES]>;

/// One pass: rows `r0..r0 + 16 tiles` (one or two row tiles) of `a` (row-major, row `r` from
/// pair `r * stride`, `kp` pairs each) against blocks `b0` and `b1` of `w` (block `j` from
/// pair `j * wkp`), over
/// `groups` consecutive runs of `steps` steps (a step is 16 pairs): run `g` reads A from step
/// `s0 + g * steps` of the rows and B from step `g * steps` of the blocks, and its C tiles go
/// to `out[g]`, starting from zero, or with `carry` (one run) from what `out[0]` holds.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'a> {
    pub a: &'a [u32],
    pub stride: usize,
    pub kp: usize,
    pub r0: usize,
    pub s0: usize,
    pub w: &'a [u32],
    pub wkp: usize,
    pub b0: usize,
    pub b1: usize,
    pub steps: usize,
    pub groups: usize,
    pub carry: bool,
    /// Row tiles (1 or 2): with one, rows `r0 + 16..` are neither read nor written.
    pub tiles: usize,
    /// Code bytes the hardware block prefetches while it computes (see [`Prefetch`]); the
    /// model ignores them.
    pub pf: Option<Prefetch>,
}

/// Lines a pass prefetches (`prefetcht1`, into L2) while its tiles compute: with each of its
/// steps (`steps * groups` in all), `lines` lines from `at` and as many from `at + next`,
/// both moving on by that many lines per step. `drive` points them at the codes of the
/// widening after the pass (two blocks, 16 pairs per step), which otherwise waits on memory
/// while the tiles leave it idle. A prefetch never faults and changes nothing a program can
/// observe, so the addresses need no bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    pub at: *const u8,
    pub next: usize,
    pub lines: StepLines,
}

/// Lines of codes per block and step of the reduction (16 pairs): the hardware block has a
/// form for each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepLines {
    /// 8 lines (512 bytes): int8 codes, two columns of 16 bytes per pair.
    Eight,
    /// 4 lines (256 bytes): 4-bit codes, 16 bytes per pair.
    Four,
}

impl StepLines {
    /// The bytes per pair.
    pub const fn pair_bytes(self) -> usize {
        match self {
            StepLines::Eight => 32,
            StepLines::Four => 16,
        }
    }
}

/// Where a GEMM's `widen` reads codes, for its passes to prefetch the next widening's
/// ([`Prefetch`]): block `b`'s pair `p` at byte `b * block_len + p * lines.pair_bytes()` of
/// `codes`. Where groups are padded, pairs and columns drift apart by the padding; a
/// prefetch is a hint, so near is good enough.
#[derive(Clone, Copy, Debug)]
pub struct CodeSource<'a> {
    pub codes: &'a [u8],
    pub block_len: usize,
    pub lines: StepLines,
}

impl CodeSource<'_> {
    /// The prefetch of the widening of block `b` (and `b + 1` below `nb`) from pair `first`.
    fn prefetch(&self, b: usize, first: usize, nb: usize) -> Prefetch {
        let at = b * self.block_len + first * self.lines.pair_bytes();
        Prefetch {
            at: self.codes.as_ptr().wrapping_add(at.min(self.codes.len())),
            next: if b + 1 < nb { self.block_len } else { 0 },
            lines: self.lines,
        }
    }
}

impl Pass<'_> {
    /// Every tile the pass loads lies inside its slice, and its runs inside the rows' and
    /// the blocks' pairs.
    pub fn fits(&self) -> bool {
        // (Checked arithmetic throughout: a wrapped sum would pass for a small one.)
        let last_row = self
            .tiles
            .checked_mul(TILE)
            .and_then(|r| r.checked_add(self.r0))
            .and_then(|r| r.checked_sub(1))
            .and_then(|r| r.checked_mul(self.stride));
        let rows_end = last_row.and_then(|r| r.checked_add(self.kp));
        let blocks_end = self
            .b0
            .max(self.b1)
            .checked_add(1)
            .and_then(|b| b.checked_mul(self.wkp))
            .and_then(|p| p.checked_mul(BLOCK));
        let run_pairs = self
            .steps
            .checked_mul(self.groups)
            .and_then(|s| s.checked_mul(TILE));
        let a_end = run_pairs
            .zip(self.s0.checked_mul(TILE))
            .and_then(|(p, s)| p.checked_add(s));
        self.kp > 0
            && self.kp.is_multiple_of(TILE)
            && self.stride >= self.kp
            && self.steps > 0
            && self.groups > 0
            && (!self.carry || self.groups == 1)
            && (1..=2).contains(&self.tiles)
            && a_end.is_some_and(|e| e <= self.kp)
            && run_pairs.is_some_and(|p| p <= self.wkp)
            && rows_end.is_some_and(|e| e <= self.a.len())
            && blocks_end.is_some_and(|e| e <= self.w.len())
    }
}

/// What runs a [`Pass`]: the hardware or the [`Model`].
pub trait TileOps {
    /// Runs `p` (which [`Pass::fits`]; `out` holds at least `p.groups` entries) and writes
    /// each run's C tiles (2 per row tile) into its entry of `out`, leaving the other rows'.
    fn pass(&mut self, p: &Pass<'_>, out: &mut [PassOut]);
}

use super::wo::bf16::{from_bf16, ftz as flush};

/// A bf16 value's f32 (the low half of `h`), subnormals read as zero (the instruction's DAZ).
fn input(h: u32) -> f32 {
    flush(from_bf16(h))
}

/// One `tdpbf16ps` step for one output: `c + ((Σ even products) + (Σ odd products))`, each
/// product sum a chain of fused multiply-adds from zero over the 16 pairs `a[k]`, `b[k]`
/// (low half even column, high half odd), as the SDM's pseudocode orders it.
pub fn dot_step(c: f32, a: impl Iterator<Item = u32>, b: impl Iterator<Item = u32>) -> f32 {
    let (mut even, mut odd) = (0f32, 0f32);
    for (x, w) in a.zip(b) {
        even = flush(input(x).mul_add(input(w), even));
        odd = flush(input(x >> 16).mul_add(input(w >> 16), odd));
    }
    flush(flush(c) + flush(even + odd))
}

/// An exact software model of the pass: `tdpbf16ps` per [`dot_step`], tile by tile.
#[derive(Clone, Debug, Default)]
pub struct Model;

impl TileOps for Model {
    fn pass(&mut self, p: &Pass<'_>, out: &mut [PassOut]) {
        assert!(
            p.fits() && out.len() >= p.groups,
            "AMX-BF16 pass out of bounds"
        );
        for (g, c_out) in out.iter_mut().enumerate().take(p.groups) {
            for i in 0..p.tiles {
                for (j, blk) in [p.b0, p.b1].into_iter().enumerate() {
                    for r in 0..TILE {
                        let row = p.r0 + i * TILE + r;
                        let e = i * PASS_ROWS + 2 * r + j;
                        let mut c = if p.carry { c_out[e] } else { [0f32; BLOCK] };
                        for s in g * p.steps..(g + 1) * p.steps {
                            let a = &p.a[row * p.stride + (p.s0 + s) * TILE..][..TILE];
                            let w = &p.w[(blk * p.wkp + s * TILE) * BLOCK..][..TILE * BLOCK];
                            for (n, cn) in c.iter_mut().enumerate() {
                                let col = w.iter().skip(n).step_by(BLOCK).copied();
                                *cn = dot_step(*cn, a.iter().copied(), col);
                            }
                        }
                        c_out[e] = c;
                    }
                }
            }
        }
    }
}

/// Steps of the reduction per chunk, at most (a longer group is cut into chunks): the
/// chunk's two widened blocks (2 x 256 pairs x 64 bytes, 32 KiB) are written and then read
/// by every pass of rows while they are in L1, instead of whole blocks from L2.
pub const CHUNK_STEPS: usize = 16;

/// Groups of steps per [`Pass`] of [`gemm_grouped`] (at most): their C tiles, 16 KB, stay in
/// L1 for the fold.
pub const GROUPS_PER_PASS: usize = 4;

/// One group's C tiles handed to [`gemm_grouped`]'s fold, for the pass of rows
/// `r0..r0 + 32` and blocks `b, b + 1` (entry `32 i + 2 r + j` is row `r0 + 16 i + r`, block
/// `b + j`; the second block repeats the first where only one is left).
pub struct Fold<'a> {
    pub r0: usize,
    pub b: usize,
    pub group: usize,
    pub c: &'a PassOut,
    pub totals: &'a mut PassOut,
}

/// Widens pairs `first..first + dst.len() / 16` of block `b` (in the step layout of the
/// GEMM's rows) into `dst` (`[pairs][16]`), zeros where no group has a pair.
pub trait Widen: FnMut(usize, usize, &mut [u32]) {}
impl<F: FnMut(usize, usize, &mut [u32])> Widen for F {}

/// `Σ a w` for rows `0..m` of `a` (row-major bf16 pairs, `kp` per row, row `r` from pair
/// `r * stride`, at least `m.next_multiple_of(32)` rows with the padding rows zero; a stride
/// that is not a multiple of 4 KB keeps a tile's 16 rows out of one L1 set) and blocks
/// `0..nb`, whose `kp` pairs `widen` writes chunk by chunk ([`CHUNK_STEPS`]; the
/// accumulators are carried across chunks through memory, exactly): `emit(row, block,
/// lanes)` for every row below `m` and block, in block-pair then row order. With `ahead`
/// (where `widen` reads its codes), the passes prefetch each widening's codes before it
/// ([`Prefetch`]). Returns `false`, having done nothing, when the arguments do not fit.
pub fn gemm<T: TileOps + ?Sized>(
    ops: &mut T,
    a: (&[u32], usize),
    m: usize,
    kp: usize,
    nb: usize,
    (widen, ahead): (impl Widen, Option<CodeSource<'_>>),
    emit: impl FnMut(usize, usize, &[f32; BLOCK]),
) -> bool {
    let chunks = (0..kp / TILE)
        .step_by(CHUNK_STEPS)
        .map(|s0| Chunk {
            s0,
            steps: CHUNK_STEPS.min(kp / TILE - s0),
            groups: 1,
            group: 0,
            carry: s0 > 0,
            fold: false,
        })
        .collect::<Vec<_>>();
    let no_fold = |_: Fold<'_>| {};
    drive(
        ops,
        a,
        m,
        kp,
        nb,
        (&chunks, false),
        (widen, ahead),
        no_fold,
        emit,
    )
}

/// As [`gemm`], with the reduction cut into groups of whole steps (group `g` is steps
/// `starts[g]..starts[g + 1]`, `starts` non-decreasing from 0 to `kp / 16`): each group's
/// product starts from zero and `fold` adds it into the pass's totals (zero at the start of
/// each pass of 32 rows and two blocks), groups in order; an empty group folds zeros. The
/// totals are what `emit` gets. Runs of equal groups share a pass ([`GROUPS_PER_PASS`] and
/// [`CHUNK_STEPS`] at most); a group longer than a chunk is carried across its chunks.
#[allow(clippy::too_many_arguments)]
pub fn gemm_grouped<T: TileOps + ?Sized>(
    ops: &mut T,
    a: (&[u32], usize),
    m: usize,
    kp: usize,
    nb: usize,
    starts: &[usize],
    (widen, ahead): (impl Widen, Option<CodeSource<'_>>),
    fold: impl FnMut(Fold<'_>),
    emit: impl FnMut(usize, usize, &[f32; BLOCK]),
) -> bool {
    if starts.len() < 2
        || starts[0] != 0
        || starts.last() != Some(&(kp / TILE))
        || starts.windows(2).any(|s| s[1] < s[0])
    {
        return false;
    }
    let groups = starts.len() - 1;
    let mut chunks = Vec::new();
    let mut g = 0;
    while g < groups {
        let (s0, steps) = (starts[g], starts[g + 1] - starts[g]);
        if steps > CHUNK_STEPS {
            // One long group (channelwise scales): its chunks carry the accumulators.
            for c0 in (0..steps).step_by(CHUNK_STEPS) {
                let n = CHUNK_STEPS.min(steps - c0);
                let (carry, fold) = (c0 > 0, c0 + n == steps);
                let (groups, group) = (1, g);
                chunks.push(Chunk {
                    s0: s0 + c0,
                    steps: n,
                    groups,
                    group,
                    carry,
                    fold,
                });
            }
            g += 1;
            continue;
        }
        let mut run = 1;
        while steps > 0
            && run < GROUPS_PER_PASS
            && (run + 1) * steps <= CHUNK_STEPS
            && g + run < groups
            && starts[g + run + 1] - starts[g + run] == steps
        {
            run += 1;
        }
        let (carry, fold) = (false, true);
        chunks.push(Chunk {
            s0,
            steps,
            groups: run,
            group: g,
            carry,
            fold,
        });
        g += run;
    }
    drive(
        ops,
        a,
        m,
        kp,
        nb,
        (&chunks, true),
        (widen, ahead),
        fold,
        emit,
    )
}

/// A piece of the reduction for [`drive`]: `groups` runs of `steps` steps from step `s0`
/// (groups `group..`; no steps is one empty group, which folds zeros), from zero or carried,
/// folded after the pass or not.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    s0: usize,
    steps: usize,
    groups: usize,
    group: usize,
    carry: bool,
    fold: bool,
}

/// Pass outputs (4 KiB each: a pass's four C tiles) a panel of [`drive`] keeps across its
/// chunks, per kind (carried accumulators, and for grouped GEMMs the folded totals): 64, so
/// 256 KiB each, which stay in L2 with the chunk's rows. (Past 64 passes of rows a panel is
/// one block pair and holds one output per pass.)
const PANEL_TILES: usize = 64;

/// The widening [`drive`] runs after pair `q` of chunk `ci` in the panel from block `p0`
/// (panels of `panel` pairs over `nb` blocks), as its first block and step: the chunk's next
/// pair, else the first pair of the panel's next chunk with steps, else of the next panel's
/// first such chunk; `None` after the last.
fn next_widening(
    chunks: &[Chunk],
    (nb, panel): (usize, usize),
    (p0, ci, q): (usize, usize, usize),
) -> Option<(usize, usize)> {
    let first_with_steps = |from: usize| {
        chunks
            .iter()
            .skip(from)
            .find(|c| c.steps * c.groups > 0)
            .map(|c| c.s0)
    };
    if q + 1 < (nb - p0).div_ceil(2).min(panel) {
        return Some((p0 + 2 * (q + 1), chunks[ci].s0));
    }
    if let Some(s0) = first_with_steps(ci + 1) {
        return Some((p0, s0));
    }
    let next = p0 + 2 * panel;
    if next >= nb {
        return None;
    }
    first_with_steps(0).map(|s0| (next, s0))
}

/// The loop of [`gemm`] and [`gemm_grouped`], blocked as a GEMM is: the block pairs go in
/// panels (as many as keep [`PANEL_TILES`] accumulators for all passes of rows); per panel,
/// chunk by chunk, each pair's two blocks are widened into a buffer that stays in L1 and
/// every pass of rows runs against it, so a chunk of the rows (all passes) is read from
/// memory once per panel instead of once per block pair. Emits the folded totals
/// (`grouped`) or the carried accumulators.
#[allow(clippy::too_many_arguments)]
fn drive<T: TileOps + ?Sized>(
    ops: &mut T,
    (a, stride): (&[u32], usize),
    m: usize,
    kp: usize,
    nb: usize,
    (chunks, grouped): (&[Chunk], bool),
    (mut widen, ahead): (impl Widen, Option<CodeSource<'_>>),
    mut fold: impl FnMut(Fold<'_>),
    mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
) -> bool {
    let passes = m.div_ceil(PASS_ROWS);
    if m == 0
        || nb == 0
        || kp == 0
        || !kp.is_multiple_of(TILE)
        || stride < kp
        || stride
            .checked_mul(passes * PASS_ROWS - 1)
            .and_then(|s| s.checked_add(kp))
            .is_none_or(|end| end > a.len())
    {
        return false;
    }
    let wkp = chunks
        .iter()
        .map(|c| c.steps * c.groups * TILE)
        .max()
        .unwrap_or(0);
    // Widened blocks on a cache line: AMX's B tiles (see [`super::spare::AlignedBuf`]).
    let mut buf = super::spare::AlignedBuf::take(2 * wkp * BLOCK, 0u32);
    let zero: PassOut = super::spare::OnLine([[0.0; BLOCK]; OUT_ENTRIES]);
    let panel = (PANEL_TILES / passes).clamp(1, nb.div_ceil(2));
    // Per pair of the panel and pass of rows: the accumulators a chunk carries to the next
    // (`acc`), and the folded totals (`grouped`); a grouped pass's runs go to `runs`.
    let mut acc = vec![[zero; 1]; panel * passes];
    let mut totals = vec![zero; if grouped { panel * passes } else { 0 }];
    let mut runs = [zero; GROUPS_PER_PASS];
    for p0 in (0..nb).step_by(2 * panel) {
        let pairs_here = (nb - p0).div_ceil(2).min(panel);
        totals.fill(zero);
        for (ci, ch) in chunks.iter().enumerate() {
            let pairs = ch.steps * ch.groups * TILE;
            if pairs == 0 {
                for (at, totals) in totals.iter_mut().enumerate().take(pairs_here * passes) {
                    let (b, r0) = (p0 + 2 * (at / passes), (at % passes) * PASS_ROWS);
                    fold(Fold {
                        r0,
                        b,
                        group: ch.group,
                        c: &zero,
                        totals,
                    });
                }
                continue;
            }
            // A chunk of a chain (the plain GEMM's, or one long group's) works in `acc`.
            let chained = !grouped || ch.carry || !ch.fold;
            for q in 0..pairs_here {
                let b = p0 + 2 * q;
                let pair = (nb - b).min(2);
                for j in 0..pair {
                    widen(
                        b + j,
                        ch.s0 * TILE,
                        &mut buf[j * wkp * BLOCK..][..pairs * BLOCK],
                    );
                }
                // The first pass of rows prefetches the codes of the next widening.
                let pf = ahead.and_then(|codes| {
                    let (b, s0) = next_widening(chunks, (nb, panel), (p0, ci, q))?;
                    Some(codes.prefetch(b, s0 * TILE, nb))
                });
                for pi in 0..passes {
                    let r0 = pi * PASS_ROWS;
                    let p = Pass {
                        a,
                        stride,
                        kp,
                        r0,
                        s0: ch.s0,
                        w: &buf,
                        wkp,
                        b0: 0,
                        b1: pair - 1,
                        steps: ch.steps,
                        groups: ch.groups,
                        carry: ch.carry,
                        // (A last pass of 16 rows or fewer skips the second row tile.)
                        tiles: if m - r0 > TILE { 2 } else { 1 },
                        pf: pf.filter(|_| pi == 0),
                    };
                    let out = if chained {
                        &mut acc[q * passes + pi][..]
                    } else {
                        &mut runs[..]
                    };
                    ops.pass(&p, out);
                    if grouped && ch.fold {
                        for (i, c) in out.iter().enumerate().take(ch.groups) {
                            let totals = &mut totals[q * passes + pi];
                            fold(Fold {
                                r0,
                                b,
                                group: ch.group + i,
                                c,
                                totals,
                            });
                        }
                    }
                }
            }
        }
        for q in 0..pairs_here {
            let b = p0 + 2 * q;
            let pair = (nb - b).min(2);
            for pi in 0..passes {
                let at = q * passes + pi;
                let (r0, got) = (
                    pi * PASS_ROWS,
                    if grouped { &totals[at] } else { &acc[at][0] },
                );
                for r in 0..(m - r0).min(PASS_ROWS) {
                    let (i, rr) = (r / TILE, r % TILE);
                    for j in 0..pair {
                        emit(r0 + r, b + j, &got[i * PASS_ROWS + 2 * rr + j]);
                    }
                }
            }
        }
    }
    buf.give();
    true
}

/// `widen` for a GEMM over whole blocks already in memory: `w` as `[blocks][kp][16]` pairs.
pub fn from_blocks(w: &[u32], kp: usize) -> impl Widen + '_ {
    move |b: usize, first: usize, dst: &mut [u32]| {
        let at = (b * kp + first) * BLOCK;
        dst.copy_from_slice(&w[at..at + dst.len()]);
    }
}

/// Whether [`gemm`] and [`gemm_grouped`] on `ops` equal them on the [`Model`] for a problem
/// of 37 rows (a padded second pass), 3 blocks (a pair and a single), random normal and zero
/// operands, over 35 steps: the plain GEMM in three chunks, and groups of 2, 2, 0, 20
/// (carried across two chunks), 1 and 10 steps; and the plain GEMM of its first 9 rows (one
/// row tile). The three runs' passes prefetch nothing, 8 and 4 lines per step: each form of
/// the hardware block that a layer runs with a prefetch (or without) runs here once.
pub fn self_test<T: TileOps>(ops: &mut T) -> bool {
    let (m, nb, kp): (usize, usize, usize) = (37, 3, 35 * TILE);
    let mut seed = 0x2545_f491u32;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    let mut half = || {
        let r = next();
        if r % 13 == 0 {
            return 0u32;
        }
        // Sign, an exponent near 1, any mantissa: normal values of mixed magnitude.
        ((r & 1) << 15) | ((120 + (r >> 1) % 14) << 7) | ((r >> 8) & 0x7f)
    };
    let rows = m.next_multiple_of(PASS_ROWS);
    let mut a = vec![0u32; rows * kp];
    for v in &mut a[..m * kp] {
        *v = half() | (half() << 16);
    }
    let w: Vec<u32> = (0..nb * kp * BLOCK)
        .map(|_| half() | (half() << 16))
        .collect();
    let starts = [0, 2, 4, 4, 24, 25, 35];
    let problem = (&a[..], m, kp, &w[..], nb);
    // (The 37-row plain GEMM's passes prefetch nothing, the grouped one's 8 lines per step and
    // the 9-row one's below 4.)
    let (got, want) = (
        emitted(ops, problem, None, None),
        emitted(&mut Model, problem, None, None),
    );
    let (got_g, want_g) = (
        emitted(ops, problem, Some(&starts), Some(StepLines::Eight)),
        emitted(&mut Model, problem, Some(&starts), Some(StepLines::Eight)),
    );
    // (The first 9 rows, padded to a pass with zeros: `a` holds them at the same stride.)
    let mut one = a[..9 * kp].to_vec();
    one.resize(PASS_ROWS * kp, 0);
    let single = (&one[..], 9, kp, &w[..], nb);
    let (got_1, want_1) = (
        emitted(ops, single, None, Some(StepLines::Four)),
        emitted(&mut Model, single, None, None),
    );
    [(got, want), (got_g, want_g), (got_1, want_1)]
        .iter()
        .all(|(got, want)| want.is_some() && got == want)
}

/// `(row, block, lanes' bits)`, as a GEMM emits them.
type Emitted = Vec<(usize, usize, [u32; BLOCK])>;

/// Every `(row, block, lanes' bits)` [`gemm`] (or with `starts`, [`gemm_grouped`] with a
/// fold that adds each group's C, scaled by 1 + group / 8) emits on `ops`, in order; `None`
/// if it refused. With `prefetch`, the passes prefetch codes of a stand-in layer of the same
/// shape with that many lines per step, as a layer's do.
fn emitted<T: TileOps>(
    ops: &mut T,
    (a, m, kp, w, nb): (&[u32], usize, usize, &[u32], usize),
    starts: Option<&[usize]>,
    prefetch: Option<StepLines>,
) -> Option<Emitted> {
    let block_len = prefetch.map_or(0, |l| l.pair_bytes() * kp);
    let codes = vec![0u8; nb * block_len];
    let ahead = prefetch.map(|lines| CodeSource {
        codes: &codes,
        block_len,
        lines,
    });
    let mut seen = Vec::new();
    let emit = |r: usize, b: usize, l: &[f32; BLOCK]| seen.push((r, b, l.map(f32::to_bits)));
    let ran = match starts {
        None => gemm(ops, (a, kp), m, kp, nb, (from_blocks(w, kp), ahead), emit),
        Some(starts) => {
            let fold = |f: Fold<'_>| {
                let s = 1.0 + f.group as f32 / 8.0;
                for (t, c) in f.totals.iter_mut().zip(f.c.iter()) {
                    for (t, c) in t.iter_mut().zip(c) {
                        *t = c.mul_add(s, *t);
                    }
                }
            };
            let widen = from_blocks(w, kp);
            gemm_grouped(ops, (a, kp), m, kp, nb, starts, (widen, ahead), fold, emit)
        }
    };
    ran.then_some(seen)
}

/// Whether weight-only layers use these tiles: the int8 tiles are in use ([`super::kernels`]'s
/// `amx_int8` family, which has the OS's tile permission and passed its own self-test), the
/// CPU reports AMX-BF16, and [`self_test`] on the hardware equals the model. Asked once.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            if !super::kernels::isa().amx() || !hw::cpu_has_bf16_tiles() {
                return false;
            }
            // SAFETY: the amx_int8 family is chosen only after `amx::usable()` found the tiles
            // (palette 1, 8 tiles of 16 x 64 bytes) and the OS granted tile state; the CPU
            // reports AMX-BF16 (just checked).
            let agree = self_test(&mut unsafe { Hw::new() });
            if !agree {
                eprintln!(
                    "moeq_rs: AMX-BF16 tiles disagreed with their model in a self-test; \
                     weight-only layers keep AVX512-BF16"
                );
            }
            agree
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub use hw::{peak_loop, Hw};

/// Multiply-adds of one `tdpbf16ps` on full tiles: 16 rows x 16 features x 32 inputs.
pub const PEAK_MACS_PER_ISSUE: usize = TILE * BLOCK * 2 * TILE;

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod hw {
    use super::{Pass, PassOut, TileOps, TILE};
    use crate::cpu::amx::Session;
    use crate::cpu::wo::BLOCK;

    /// CPUID leaf 7: AMX-BF16 (EDX bit 22).
    pub(super) fn cpu_has_bf16_tiles() -> bool {
        use std::arch::x86_64::__cpuid_count;
        __cpuid_count(0, 0).eax >= 7 && __cpuid_count(7, 0).edx & (1 << 22) != 0
    }

    /// The CPU's AMX-BF16 tiles, configured while the value lives (it holds a tile
    /// [`Session`], shared with the int8 tiles on the same thread); each pass is one
    /// self-contained `asm!` block.
    #[derive(Debug)]
    pub struct Hw(Session);

    impl Hw {
        /// # Safety
        /// The CPU has AMX-BF16 with palette 1 of at least 8 tiles of 16 rows x 64 bytes, and
        /// the OS granted tile state to this process.
        pub unsafe fn new() -> Hw {
            // SAFETY: the caller's contract covers Session::open's.
            Hw(unsafe { Session::open() })
        }
    }

    /// `4 * rounds` back-to-back `tdpbf16ps` into four independent accumulator tiles from
    /// operands held in tiles (no memory traffic, but the 64-byte configuration where no
    /// session is open on the thread): the instruction's throughput limit, for
    /// [`crate::cpu::peak`]. The zeroed operands keep every value zero.
    ///
    /// # Safety
    /// [`super::enabled`] returned true in this process.
    pub unsafe fn peak_loop(rounds: usize) {
        if rounds == 0 {
            return;
        }
        // SAFETY: the caller's contract (the CPU has AMX-BF16 with palette 1 of 8 full tiles
        // and the OS granted tile state) is the session's, which configures the tiles while
        // the block runs. The block reads and writes no memory, only tiles.
        unsafe {
            let _tiles = Session::open();
            crate::cpu::amx::tile_peak_asm!("tdpbf16ps", rounds);
        }
    }

    /// One pass's `asm!` block, on tiles a [`Session`] configured: per run, the accumulators'
    /// `$init` (zeroed, or loaded from C), `steps` steps of the listed loads and products, the
    /// listed stores to C, C on by 4096 bytes. C `(i, j)` row `r` lies at
    /// `c + 64 (32 i + j) + 128 r`. (Both A addresses move on, used or not.)
    macro_rules! bf16_pass_asm {
        (($a0:expr, $a1:expr, $sa:expr, $b0:expr, $b1:expr, $steps:expr,
          $groups:expr, $c:expr), [$($init:literal),*], [$($load:literal),*],
         [$($dot:literal),*], [$($store:literal),*]
         $(, prefetch ($pf:expr, $pfn:expr, [$($at:literal),*], $step:literal))?) => {
            ::core::arch::asm!(
                "3:",
                $($init,)*
                "mov {n}, {steps}",
                "2:",
                $($load,)*
                $($dot,)*
                $(prefetch_lines!([$($at),*], $step),)?
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                $($store,)*
                "add {c}, 4096",
                "dec {groups}",
                "jnz 3b",
                a0 = inout(reg) $a0 => _,
                a1 = inout(reg) $a1 => _,
                sa = in(reg) $sa,
                b0 = inout(reg) $b0 => _,
                b1 = inout(reg) $b1 => _,
                // A B tile row (16 pairs) is 64 bytes; a C tile row is every other 64 bytes.
                sb = in(reg) BLOCK * 4,
                steps = in(reg) $steps,
                n = out(reg) _,
                groups = inout(reg) $groups => _,
                c = inout(reg) $c => _,
                $(pf = inout(reg) $pf => _, pfn = in(reg) $pfn,)?
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            )
        };
    }

    /// The prefetches of one step of a pass with a [`super::Prefetch`]: the lines at `$at`
    /// from `{pf}` and from `{pf} + {pfn}`, then `{pf}` moves on by `$step` bytes.
    macro_rules! prefetch_lines {
        ([$($at:literal),*], $step:literal) => {
            concat!(
                $("prefetcht1 [{pf} + ", $at, "]\n",)*
                $("prefetcht1 [{pf} + {pfn}*1 + ", $at, "]\n",)*
                "add {pf}, ", $step, "\n",
            )
        };
    }

    // A step is 16 pairs: the forms below prefetch 512 bytes (8 lines) per stream and step for
    // int8 codes and 256 (4 lines) for 4-bit ones.
    const _: () = assert!(
        super::StepLines::Eight.pair_bytes() * TILE == 512
            && super::StepLines::Four.pair_bytes() * TILE == 256
    );

    /// [`bf16_pass_asm`] for `$p`'s operands, one or two row tiles (`$tiles`), from zero or
    /// carried, and with prefetches or without.
    macro_rules! bf16_pass {
        ($ops:tt, $tiles:tt, $init:tt, None) => {
            bf16_pass!(@ $ops, $tiles, $init)
        };
        ($ops:tt, $tiles:tt, $init:tt, Some($pf:tt)) => {
            bf16_pass!(@ $ops, $tiles, $init, prefetch $pf)
        };
        (@ $ops:tt, 1, $init:tt $(, prefetch $pf:tt)?) => {
            bf16_pass_asm!(
                $ops,
                $init,
                [
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]"
                ],
                ["tdpbf16ps tmm0, tmm4, tmm6", "tdpbf16ps tmm1, tmm4, tmm7"],
                [
                    "tilestored [{c} + {sb}*2], tmm0",
                    "tilestored [{c} + {sb}*2 + 64], tmm1"
                ]
                $(, prefetch $pf)?
            )
        };
        (@ $ops:tt, 2, $init:tt $(, prefetch $pf:tt)?) => {
            bf16_pass_asm!(
                $ops,
                $init,
                [
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]"
                ],
                [
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7"
                ],
                [
                    "tilestored [{c} + {sb}*2], tmm0",
                    "tilestored [{c} + {sb}*2 + 64], tmm1",
                    "tilestored [{c} + {sb}*2 + 2048], tmm2",
                    "tilestored [{c} + {sb}*2 + 2112], tmm3"
                ]
                $(, prefetch $pf)?
            )
        };
    }

    impl TileOps for Hw {
        fn pass(&mut self, p: &Pass<'_>, out: &mut [PassOut]) {
            // Checked here, not assumed: the loads and stores below stay inside what `fits`
            // and the length check cover.
            assert!(
                p.fits() && out.len() >= p.groups,
                "AMX-BF16 pass out of bounds"
            );
            let row_bytes = p.stride * 4;
            let first = p.s0 * TILE;
            let a0 = p.a[p.r0 * p.stride + first..].as_ptr();
            // (With one row tile the second row tile's address is never loaded from.)
            let a1 = p.a[p.r0 * p.stride + first..]
                .as_ptr()
                .wrapping_add(TILE * p.stride);
            let b0 = p.w[p.b0 * p.wkp * BLOCK..].as_ptr();
            let b1 = p.w[p.b1 * p.wkp * BLOCK..].as_ptr();
            let c = out.as_mut_ptr();
            let (steps, groups) = (p.steps, p.groups);
            // SAFETY: an `Hw` exists only where AMX-BF16 is usable (`Hw::new`'s contract), and
            // its session keeps the tiles configured (8 tiles of 16 x 64 bytes) on this thread
            // while it lives (`Hw` is not `Send`; see `amx::Session`). `fits` found rows r0..r0
            // + 16 tiles (kp pairs each, `stride` apart) inside `a` with pairs 16 s0 + 16
            // groups steps <= kp, and blocks b0, b1 (wkp pairs each, 16 groups steps <= wkp of
            // them read) inside `w`; step s loads A rows at a + 64 s (16 rows of 64 bytes,
            // stride * 4 bytes apart; the second row tile only with two) and B at b + 1024 s
            // (16 x 64 contiguous bytes), so every load stays inside. Run g loads (with
            // `carry`, one run) and stores C (i, j) row r (i < tiles) at byte 4096 g + 64 (32 i
            // + 2 r + j) of `out`, inside its first `groups` entries of 4096 bytes. `steps` and
            // `groups` are at least 1 (fits), so both loops end. The prefetches (`p.pf`) may
            // name any address: a prefetch never faults and neither reads into nor writes any
            // register or memory the program sees; their address register moves on and is
            // discarded (`inout`), the stream offset is only read.
            unsafe {
                // This pass's operands, with `$tiles` row tiles and the accumulators' `$init`.
                macro_rules! run {
                    ($tiles:tt, $init:tt) => {
                        match p.pf {
                            Some(super::Prefetch {
                                at,
                                next,
                                lines: super::StepLines::Eight,
                            }) => bf16_pass!(
                                (a0, a1, row_bytes, b0, b1, steps, groups, c),
                                $tiles,
                                $init,
                                Some((at, next, [0, 64, 128, 192, 256, 320, 384, 448], 512))
                            ),
                            Some(super::Prefetch {
                                at,
                                next,
                                lines: super::StepLines::Four,
                            }) => bf16_pass!(
                                (a0, a1, row_bytes, b0, b1, steps, groups, c),
                                $tiles,
                                $init,
                                Some((at, next, [0, 64, 128, 192], 256))
                            ),
                            None => bf16_pass!(
                                (a0, a1, row_bytes, b0, b1, steps, groups, c),
                                $tiles,
                                $init,
                                None
                            ),
                        }
                    };
                }
                match (p.tiles, p.carry) {
                    (1, false) => run!(1, ["tilezero tmm0", "tilezero tmm1"]),
                    (1, true) => run!(
                        1,
                        [
                            "tileloadd tmm0, [{c} + {sb}*2]",
                            "tileloadd tmm1, [{c} + {sb}*2 + 64]"
                        ]
                    ),
                    (_, false) => run!(
                        2,
                        [
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3"
                        ]
                    ),
                    (_, true) => run!(
                        2,
                        [
                            "tileloadd tmm0, [{c} + {sb}*2]",
                            "tileloadd tmm1, [{c} + {sb}*2 + 64]",
                            "tileloadd tmm2, [{c} + {sb}*2 + 2048]",
                            "tileloadd tmm3, [{c} + {sb}*2 + 2112]"
                        ]
                    ),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (*seed >> 33) as u32
    }

    /// A bf16 value: zero, subnormal, or normal over a wide exponent range.
    fn half(seed: &mut u64) -> u32 {
        let r = lcg(seed);
        let sign = (r & 1) << 15;
        match r % 17 {
            0 => 0,
            1 => sign | ((r >> 4) & 0x7f).max(1),
            _ => sign | ((100 + (r >> 5) % 40) << 7) | ((r >> 12) & 0x7f),
        }
    }

    /// The instruction's definition per output, written from the SDM independently of the
    /// model's tile walk: for each 32-column step, two fused chains and two adds.
    fn reference(a: &[u32], m: usize, kp: usize, w: &[u32], nb: usize) -> Vec<[f32; BLOCK]> {
        reference_steps(a, (m, kp), w, nb, 0..kp / TILE)
    }

    /// [`reference`] over steps `steps` only, from zero.
    fn reference_steps(
        a: &[u32],
        (m, kp): (usize, usize),
        w: &[u32],
        nb: usize,
        steps: std::ops::Range<usize>,
    ) -> Vec<[f32; BLOCK]> {
        let bf = |h: u32| {
            let v = f32::from_bits((h & 0xffff) << 16);
            if v.is_subnormal() {
                0.0f32.copysign(v)
            } else {
                v
            }
        };
        let ftz = |v: f32| {
            if v.is_subnormal() {
                0.0f32.copysign(v)
            } else {
                v
            }
        };
        let mut out = Vec::new();
        for r in 0..m {
            for b in 0..nb {
                let mut lanes = [0f32; BLOCK];
                for (n, lane) in lanes.iter_mut().enumerate() {
                    let mut c = 0f32;
                    for s in steps.clone() {
                        let (mut e, mut o) = (0f32, 0f32);
                        for k in s * TILE..(s + 1) * TILE {
                            let x = a[r * kp + k];
                            let y = w[(b * kp + k) * BLOCK + n];
                            e = ftz(bf(x).mul_add(bf(y), e));
                            o = ftz(bf(x >> 16).mul_add(bf(y >> 16), o));
                        }
                        c = ftz(ftz(c) + ftz(e + o));
                    }
                    *lane = c;
                }
                out.push(lanes);
            }
        }
        out
    }

    fn problem(m: usize, nb: usize, kp: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
        let mut s = seed;
        let mut a = vec![0u32; m.next_multiple_of(PASS_ROWS) * kp];
        for v in &mut a[..m * kp] {
            *v = half(&mut s) | (half(&mut s) << 16);
        }
        let w = (0..nb * kp * BLOCK)
            .map(|_| half(&mut s) | (half(&mut s) << 16))
            .collect();
        (a, w)
    }

    fn run<T: TileOps>(
        ops: &mut T,
        a: &[u32],
        m: usize,
        kp: usize,
        w: &[u32],
        nb: usize,
    ) -> Vec<[f32; BLOCK]> {
        let mut got = vec![[f32::NAN; BLOCK]; m * nb];
        let mut seen = vec![0u32; m * nb];
        // A padded stride, as the layer uses, on every other problem.
        let stride = if m.is_multiple_of(2) { kp } else { kp + TILE };
        let mut padded = vec![0u32; m.next_multiple_of(PASS_ROWS) * stride];
        for r in 0..m {
            padded[r * stride..r * stride + kp].copy_from_slice(&a[r * kp..(r + 1) * kp]);
        }
        assert!(gemm(
            ops,
            (&padded, stride),
            m,
            kp,
            nb,
            (from_blocks(w, kp), None),
            |r, b, l| {
                got[r * nb + b] = *l;
                seen[r * nb + b] += 1;
            }
        ));
        assert!(
            seen.iter().all(|&c| c == 1),
            "every (row, block) emitted once"
        );
        got
    }

    fn bits(v: &[[f32; BLOCK]]) -> Vec<u32> {
        v.iter().flatten().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn model_equals_the_instruction_reference() {
        // (One carries its accumulators across three chunks; the last needs two panels.)
        let panel_blocks = 2 * PANEL_TILES / 2;
        for (m, nb, kp, seed) in [
            (1, 1, 16, 1),
            (32, 2, 32, 2),
            (37, 3, 48, 3),
            (70, 5, 16, 4),
            (33, 3, (2 * CHUNK_STEPS + 3) * TILE, 5),
            (40, panel_blocks + 3, 32, 6),
        ] {
            let (a, w) = problem(m, nb, kp, seed);
            assert_eq!(
                bits(&run(&mut Model, &a, m, kp, &w, nb)),
                bits(&reference(&a, m, kp, &w, nb)),
                "m {m} nb {nb} kp {kp}"
            );
        }
    }

    /// Grouped: each group's product from zero, folded in group order (here `t = fma(c, 1 +
    /// g / 8, t)`), equals the reference per group folded the same way, for runs of equal
    /// groups, an empty group, and a group carried across chunks.
    #[test]
    fn grouped_model_equals_the_reference_per_group() {
        let long = CHUNK_STEPS + 4;
        for (m, nb, starts, seed) in [
            (9, 2, vec![0, 4, 8, 12, 16, 20], 21),
            (40, 3, vec![0, 1, 1, 3, 3 + long, 4 + long], 22),
            (32, 1, vec![0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20], 23),
            // Two panels (of 32 pairs for two passes of rows), a long group carried.
            (40, PANEL_TILES + 3, vec![0, 1, 2, 2 + long], 24),
        ] {
            let kp = starts[starts.len() - 1] * TILE;
            let (a, w) = problem(m, nb, kp, seed);
            let mut want = vec![[0f32; BLOCK]; m * nb];
            for (g, s) in starts.windows(2).enumerate() {
                let c = reference_steps(&a, (m, kp), &w, nb, s[0]..s[1]);
                let scale = 1.0 + g as f32 / 8.0;
                for (t, c) in want.iter_mut().zip(&c) {
                    for (t, c) in t.iter_mut().zip(c) {
                        *t = c.mul_add(scale, *t);
                    }
                }
            }
            let got = emitted(&mut Model, (&a, m, kp, &w, nb), Some(&starts), None).expect("runs");
            let got: Vec<u32> = {
                let mut v = vec![0u32; m * nb * BLOCK];
                for (r, b, l) in &got {
                    v[(r * nb + b) * BLOCK..][..BLOCK].copy_from_slice(l);
                }
                v
            };
            assert_eq!(got, bits(&want), "m {m} nb {nb} starts {starts:?}");
        }
    }

    /// The step order is the instruction's, not one fused chain: some outputs differ from a
    /// sequential sum of the same products (else the reference above would prove nothing).
    #[test]
    fn model_order_differs_from_a_sequential_sum() {
        let (m, nb, kp) = (32, 2, 64);
        let (a, w) = problem(m, nb, kp, 9);
        let model = run(&mut Model, &a, m, kp, &w, nb);
        let mut differ = 0;
        for r in 0..m {
            for b in 0..nb {
                for n in 0..BLOCK {
                    let mut c = 0f32;
                    for k in 0..kp {
                        let (x, y) = (a[r * kp + k], w[(b * kp + k) * BLOCK + n]);
                        c = input(x).mul_add(input(y), c);
                        c = input(x >> 16).mul_add(input(y >> 16), c);
                    }
                    differ += usize::from(c.to_bits() != model[r * nb + b][n].to_bits());
                }
            }
        }
        assert!(differ > 0);
    }

    #[test]
    fn gemm_refuses_what_does_not_fit() {
        let (a, w) = problem(32, 2, 16, 5);
        let none = |_: usize, _: usize, _: &[f32; BLOCK]| panic!("emitted");
        // A reduction off whole steps, too few rows, none, a stride below the reduction, and
        // rows that do not fit `a`.
        for (stride, m, kp) in [
            (24, 32, 24),
            (16, 33, 16),
            (16, 0, 16),
            (8, 32, 16),
            (17, 32, 16),
        ] {
            let widen = from_blocks(&w, 16);
            let ran = gemm(&mut Model, (&a, stride), m, kp, 2, (widen, None), none);
            assert!(!ran, "stride {stride} m {m} kp {kp}");
        }
        let fold = |_: Fold<'_>| panic!("folded");
        for starts in [&[0usize][..], &[0, 2], &[1, 1], &[0, 1, 0, 1], &[0, 0]] {
            let widen = from_blocks(&w, 16);
            let ran = gemm_grouped(
                &mut Model,
                (&a, 16),
                32,
                16,
                2,
                starts,
                (widen, None),
                fold,
                none,
            );
            assert!(!ran, "{starts:?}");
        }
        // A carried run is one run; runs stay inside the rows' and the blocks' pairs.
        let p = Pass {
            a: &a,
            stride: 16,
            kp: 16,
            r0: 0,
            s0: 0,
            w: &w,
            wkp: 16,
            b0: 0,
            b1: 1,
            steps: 1,
            groups: 1,
            carry: true,
            tiles: 2,
            pf: None,
        };
        assert!(p.fits());
        assert!(Pass { tiles: 1, ..p }.fits());
        assert!(!Pass { tiles: 0, ..p }.fits());
        assert!(!Pass { tiles: 3, ..p }.fits());
        assert!(!Pass { groups: 2, ..p }.fits());
        assert!(!Pass {
            carry: false,
            groups: 2,
            ..p
        }
        .fits());
        assert!(!Pass { s0: 1, ..p }.fits());
        assert!(!Pass { b1: 2, ..p }.fits());
        assert!(!Pass { steps: 0, ..p }.fits());
        // Sums that would wrap around are refused, not taken for small ones.
        assert!(!Pass {
            b0: usize::MAX,
            b1: usize::MAX,
            wkp: 1 << 60,
            ..p
        }
        .fits());
        assert!(!Pass {
            r0: usize::MAX - 8,
            ..p
        }
        .fits());
        assert!(!Pass {
            s0: usize::MAX / 8,
            ..p
        }
        .fits());
        assert!(!Pass {
            tiles: usize::MAX,
            ..p
        }
        .fits());
    }

    /// What a GEMM did, in order: a widening (block, first pair), or a pass (first row,
    /// prefetch).
    #[derive(Debug, PartialEq)]
    enum Event {
        Widen(usize, usize),
        Pass(usize, Option<Prefetch>),
    }

    /// Records each pass's first row and prefetch into a shared log, and computes nothing
    /// (the outputs are not what the log is for).
    struct Recorder<'a>(&'a std::cell::RefCell<Vec<Event>>);

    impl TileOps for Recorder<'_> {
        fn pass(&mut self, p: &Pass<'_>, _: &mut [PassOut]) {
            assert!(p.fits(), "pass out of bounds");
            self.0.borrow_mut().push(Event::Pass(p.r0, p.pf));
        }
    }

    /// The first pass of rows after each widening prefetches the codes of the next widening
    /// (its first block's pair at 32 bytes per pair for int8 codes, 16 for 4-bit, and the
    /// second block's a block on, where there is one); no other pass prefetches, nor those
    /// after the last widening. Over chunks, empty, trailing empty and carried groups, a
    /// padded second pass of rows, a single last block, panels of one block pair (33 passes
    /// of rows) and panels of three pairs over three chunks (17 passes). (Whether the
    /// hardware issues the prefetches no test can see: they change no result.)
    #[test]
    fn passes_prefetch_the_next_widening_once() {
        for (m, nb, kp, starts, lines) in [
            (37, 5, 35 * TILE, None, StepLines::Eight),
            (37, 5, 35 * TILE, None, StepLines::Four),
            (
                37,
                5,
                35 * TILE,
                Some(&[0usize, 2, 4, 4, 24, 25, 35][..]),
                StepLines::Eight,
            ),
            (33 * PASS_ROWS, 5, 2 * TILE, None, StepLines::Four),
            (17 * PASS_ROWS, 7, 35 * TILE, None, StepLines::Eight),
            (
                17 * PASS_ROWS - 5,
                7,
                35 * TILE,
                Some(&[0usize, 2, 4, 4, 24, 25, 35, 35][..]),
                StepLines::Four,
            ),
        ] {
            // (The recorder computes nothing, so the widening need not write anything.)
            let (a, _) = problem(m, nb, kp, 9);
            let block_len = lines.pair_bytes() * kp;
            let codes = vec![0u8; nb * block_len];
            let ahead = Some(CodeSource {
                codes: &codes,
                block_len,
                lines,
            });
            let log = std::cell::RefCell::new(Vec::new());
            let widen = |b: usize, first: usize, _: &mut [u32]| {
                log.borrow_mut().push(Event::Widen(b, first));
            };
            let emit = |_: usize, _: usize, _: &[f32; BLOCK]| {};
            let ops = &mut Recorder(&log);
            let ran = match starts {
                None => gemm(ops, (&a, kp), m, kp, nb, (widen, ahead), emit),
                Some(starts) => {
                    let fold = |_: Fold<'_>| {};
                    gemm_grouped(ops, (&a, kp), m, kp, nb, starts, (widen, ahead), fold, emit)
                }
            };
            assert!(ran);
            // Per widening (one or two consecutive widen calls), its blocks and the passes
            // after it.
            let mut runs: Vec<Widening> = Vec::new();
            for e in log.into_inner() {
                match e {
                    Event::Widen(b, first) => match runs.last_mut() {
                        Some(r)
                            if r.passes.is_empty() && r.b + r.blocks == b && r.first == first =>
                        {
                            r.blocks += 1
                        }
                        _ => runs.push(Widening {
                            b,
                            first,
                            blocks: 1,
                            passes: Vec::new(),
                        }),
                    },
                    Event::Pass(r0, pf) => {
                        let last = runs.last_mut().expect("a widening before every pass");
                        last.passes.push((r0, pf));
                    }
                }
            }
            assert!(
                runs.len() > 2,
                "{m} rows, {nb} blocks: {} widenings",
                runs.len()
            );
            for (i, run) in runs.iter().enumerate() {
                let want = runs.get(i + 1).map(|next| {
                    let to_first = next.first * if lines == StepLines::Four { 16 } else { 32 };
                    Prefetch {
                        at: codes.as_ptr().wrapping_add(next.b * block_len + to_first),
                        next: if next.blocks == 2 { block_len } else { 0 },
                        lines,
                    }
                });
                assert_eq!(run.passes.len(), m.div_ceil(PASS_ROWS), "widening {i}");
                for &(r0, pf) in &run.passes {
                    let want = if r0 == 0 { want } else { None };
                    assert_eq!(pf, want, "{m} rows, {nb} blocks: widening {i}, row {r0}");
                }
            }
        }
    }

    /// One widening of a GEMM: its first block and pair, its blocks (1 or 2), and the
    /// passes after it (first row, prefetch).
    struct Widening {
        b: usize,
        first: usize,
        blocks: usize,
        passes: Vec<(usize, Option<Prefetch>)>,
    }

    /// A faulty implementation (one output lane off by one ulp) fails the self-test.
    #[test]
    fn self_test_passes_the_model_and_catches_a_fault() {
        struct Off;
        impl TileOps for Off {
            fn pass(&mut self, p: &Pass<'_>, out: &mut [PassOut]) {
                Model.pass(p, out);
                out[0][5][7] = f32::from_bits(out[0][5][7].to_bits() ^ 1);
            }
        }
        assert!(self_test(&mut Model));
        assert!(!self_test(&mut Off));
    }

    /// On a CPU with AMX-BF16 (and the int8 tiles in use), the hardware equals the model on
    /// random operands with zeros and subnormals; elsewhere `enabled` is a clean `false`.
    #[test]
    fn hardware_equals_the_model_where_enabled() {
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        assert!(!enabled());
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if !enabled() {
            assert!(!super::super::kernels::isa().amx() || !hw::cpu_has_bf16_tiles());
            return;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        for (m, nb, kp, seed) in [
            (32, 2, 16, 11),
            (45, 3, 64, 12),
            (100, 4, (2 * CHUNK_STEPS + 3) * TILE, 13),
            // One row tile: the first pass, the one that prefetches, has a single row tile.
            (9, 3, (CHUNK_STEPS + 5) * TILE, 14),
        ] {
            let (a, w) = problem(m, nb, kp, seed);
            // SAFETY: `enabled()` holds.
            let mut hw = unsafe { Hw::new() };
            assert_eq!(
                bits(&run(&mut hw, &a, m, kp, &w, nb)),
                bits(&run(&mut Model, &a, m, kp, &w, nb)),
                "m {m} nb {nb} kp {kp}"
            );
            // Grouped, with runs of equal groups, an empty one and one carried over chunks.
            let steps = kp / TILE;
            let mut starts: Vec<usize> = (0..=steps.min(4)).collect();
            starts.push(steps.min(4));
            starts.push(steps);
            let problem = (&a[..], m, kp, &w[..], nb);
            // SAFETY: `enabled()` holds.
            let mut hw = unsafe { Hw::new() };
            // Every form of the hardware block: without prefetches and with each kind.
            for prefetch in [None, Some(StepLines::Eight), Some(StepLines::Four)] {
                assert_eq!(
                    emitted(&mut hw, problem, Some(&starts), prefetch),
                    emitted(&mut Model, problem, Some(&starts), None),
                    "grouped: m {m} nb {nb} starts {starts:?} prefetch {prefetch:?}"
                );
                assert_eq!(
                    emitted(&mut hw, problem, None, prefetch),
                    emitted(&mut Model, problem, None, None),
                    "m {m} nb {nb} kp {kp} prefetch {prefetch:?}"
                );
            }
        }
    }
}
