//! AMX-BF16 tiles for weight-only layers with bf16 activations, on CPUs that have them (Intel
//! Sapphire Rapids and later): one `tdpbf16ps` multiplies 16 activation rows by 16 features
//! over 32 inputs (8,192 multiply-adds), where `vdpbf16ps` does 32. On a 2-core Emerald
//! Rapids-class VM, `vdpbf16ps` peaked at 79 GMAC/s on two threads while torch's bf16 matmul
//! (oneDNN, on these tiles) ran Qwen3-30B-A3B's experts at ~235, so weight-only prefill there
//! was 2-4x behind torch until this path (bench/RESULTS.md, run AK).
//!
//! It serves the dequantised-weight case of [`super::wo::BlockedWo::gemm_bf16`] (bf16 scales,
//! [`super::wo::bf16::DEQUANT_MIN_ROWS`] rows or more): the weights are widened per block into
//! `bf16((q - z) * s)` pairs, `[pairs][16]` u32, which is exactly AMX's B operand (16 pairs x
//! 16 features per tile); the activations are laid out row-major as bf16 pairs, the A operand.
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
//! Work goes in passes of 2 row tiles x 2 blocks (32 rows x 32 features) over the whole
//! reduction, each one self-contained `asm!` block (configure, zero, loop, store, release), as
//! the int8 tiles of [`super::amx`] do. Rows are padded to 32 and the reduction to 16 pairs
//! with zeros; a single last block is run as a pair with itself.

use super::wo::BLOCK;

/// Activation rows per A tile, and pairs per A or B tile row.
pub const TILE: usize = 16;
/// Rows per pass (two row tiles).
pub const PASS_ROWS: usize = 2 * TILE;
/// Entries of a pass's output: row `r` of C `(i, j)` (row tile `i`, block `j`) is entry
/// `32 i + 2 r + j`.
pub const OUT_ENTRIES: usize = 2 * PASS_ROWS;

/// The outputs of one pass, as f32 bits' carrier.
pub type PassOut = [[f32; BLOCK]; OUT_ENTRIES];

/// One pass: rows `r0..r0 + 32` of `a` (row-major, row `r` from pair `r * stride`, `kp`
/// pairs each) against blocks `b0` and `b1` of `w` (`[blocks][kp][16]` pairs), over `kp / 16`
/// steps.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'a> {
    pub a: &'a [u32],
    pub w: &'a [u32],
    pub kp: usize,
    pub stride: usize,
    pub r0: usize,
    pub b0: usize,
    pub b1: usize,
}

impl Pass<'_> {
    /// Every tile the pass loads lies inside its slice, and the reduction is whole steps.
    pub fn fits(&self) -> bool {
        let last_row = (self.r0 + PASS_ROWS - 1).checked_mul(self.stride);
        let rows_end = last_row.and_then(|r| r.checked_add(self.kp));
        let block = self.kp.checked_mul(BLOCK);
        let blocks_end = block.and_then(|b| b.checked_mul(self.b0.max(self.b1) + 1));
        self.kp > 0
            && self.kp.is_multiple_of(TILE)
            && self.stride >= self.kp
            && rows_end.is_some_and(|e| e <= self.a.len())
            && blocks_end.is_some_and(|e| e <= self.w.len())
    }
}

/// What runs a [`Pass`]: the hardware or the [`Model`].
pub trait TileOps {
    /// Runs `p` (which [`Pass::fits`]) and writes its 4 C tiles into `out`.
    fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut);
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
    fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
        assert!(p.fits(), "AMX-BF16 pass out of bounds");
        let steps = p.kp / TILE;
        for i in 0..2 {
            for (j, blk) in [p.b0, p.b1].into_iter().enumerate() {
                for r in 0..TILE {
                    let row = p.r0 + i * TILE + r;
                    let mut c = [0f32; BLOCK];
                    for s in 0..steps {
                        let a = &p.a[row * p.stride + s * TILE..][..TILE];
                        let w = &p.w[(blk * p.kp + s * TILE) * BLOCK..][..TILE * BLOCK];
                        for (n, cn) in c.iter_mut().enumerate() {
                            let col = w.iter().skip(n).step_by(BLOCK).copied();
                            *cn = dot_step(*cn, a.iter().copied(), col);
                        }
                    }
                    out[i * PASS_ROWS + 2 * r + j] = c;
                }
            }
        }
    }
}

/// `Σ a w` for rows `0..m` of `a` (row-major bf16 pairs, `kp` per row, row `r` from pair
/// `r * stride`, at least `m.next_multiple_of(32)` rows with the padding rows zero; a stride
/// that is not a multiple of 4 KB keeps a tile's 16 rows out of one L1 set) and blocks `0..nb`
/// of `w`
/// (`[nb][kp][16]` pairs): `emit(row, block, lanes)` for every row below `m` and block, in
/// block-pair then row order. Returns `false`, having done nothing, when the arguments do not
/// fit.
pub fn gemm<T: TileOps>(
    ops: &mut T,
    (a, stride): (&[u32], usize),
    m: usize,
    kp: usize,
    w: &[u32],
    nb: usize,
    mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
) -> bool {
    let rows = m.next_multiple_of(PASS_ROWS);
    if m == 0
        || nb == 0
        || kp == 0
        || !kp.is_multiple_of(TILE)
        || stride < kp
        || stride
            .checked_mul(rows - 1)
            .and_then(|s| s.checked_add(kp))
            .is_none_or(|end| end > a.len())
        || kp
            .checked_mul(nb)
            .and_then(|n| n.checked_mul(BLOCK))
            .is_none_or(|need| need > w.len())
    {
        return false;
    }
    let mut out: PassOut = [[0.0; BLOCK]; OUT_ENTRIES];
    for b in (0..nb).step_by(2) {
        let pair = (nb - b).min(2);
        for r0 in (0..m).step_by(PASS_ROWS) {
            let p = Pass {
                a,
                w,
                kp,
                stride,
                r0,
                b0: b,
                b1: b + pair - 1,
            };
            ops.pass(&p, &mut out);
            for r in 0..(m - r0).min(PASS_ROWS) {
                let (i, rr) = (r / TILE, r % TILE);
                for j in 0..pair {
                    emit(r0 + r, b + j, &out[i * PASS_ROWS + 2 * rr + j]);
                }
            }
        }
    }
    true
}

/// Whether [`gemm`] on `ops` equals it on the [`Model`] for a problem of 37 rows (a padded
/// second pass), 3 blocks (a pair and a single), 3 steps, random normal and zero operands.
pub fn self_test<T: TileOps>(ops: &mut T) -> bool {
    let (m, nb, kp): (usize, usize, usize) = (37, 3, 3 * TILE);
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
    let (got, want) = (
        emitted(ops, (&a, m, kp), &w, nb),
        emitted(&mut Model, (&a, m, kp), &w, nb),
    );
    want.is_some() && got == want
}

/// Every `(row, block, lanes' bits)` [`gemm`] emits on `ops`, in order; `None` if it refused.
type Emitted = Vec<(usize, usize, [u32; BLOCK])>;
fn emitted<T: TileOps>(
    ops: &mut T,
    (a, m, kp): (&[u32], usize, usize),
    w: &[u32],
    nb: usize,
) -> Option<Emitted> {
    let mut seen = Vec::new();
    let ran = gemm(ops, (a, kp), m, kp, w, nb, |r, b, l| {
        seen.push((r, b, l.map(f32::to_bits)));
    });
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
    use crate::cpu::wo::BLOCK;

    /// CPUID leaf 7: AMX-BF16 (EDX bit 22).
    pub(super) fn cpu_has_bf16_tiles() -> bool {
        use std::arch::x86_64::__cpuid_count;
        __cpuid_count(0, 0).eax >= 7 && __cpuid_count(7, 0).edx & (1 << 22) != 0
    }

    /// The CPU's AMX-BF16 tiles; each pass is one self-contained `asm!` block.
    #[derive(Debug)]
    pub struct Hw(());

    impl Hw {
        /// # Safety
        /// The CPU has AMX-BF16 with palette 1 of at least 8 tiles of 16 rows x 64 bytes, and
        /// the OS granted tile state to this process.
        pub unsafe fn new() -> Hw {
            Hw(())
        }
    }

    /// `4 * rounds` back-to-back `tdpbf16ps` into four independent accumulator tiles from
    /// operands held in tiles (no memory traffic but the 64-byte configuration): the
    /// instruction's throughput limit, for [`crate::cpu::peak`]. The zeroed operands keep
    /// every value zero.
    ///
    /// # Safety
    /// [`super::enabled`] returned true in this process.
    pub unsafe fn peak_loop(rounds: usize) {
        if rounds == 0 {
            return;
        }
        let cfg = crate::cpu::amx::tile_config();
        // SAFETY: the caller's contract: the CPU has AMX-BF16 with palette 1 of 8 full tiles
        // and the OS granted tile state. Nothing is read but the configuration and nothing
        // written; tile state is configured and released inside this one block.
        unsafe {
            crate::cpu::amx::tile_peak_asm!("tdpbf16ps", cfg, rounds);
        }
    }

    impl TileOps for Hw {
        fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
            // Checked here, not assumed: the loads below read exactly what `fits` checks.
            assert!(p.fits(), "AMX-BF16 pass out of bounds");
            let cfg = crate::cpu::amx::tile_config();
            let row_bytes = p.stride * 4;
            let block_pairs = p.kp * BLOCK;
            let a0 = p.a[p.r0 * p.stride..].as_ptr();
            let a1 = p.a[(p.r0 + TILE) * p.stride..].as_ptr();
            let b0 = p.w[p.b0 * block_pairs..].as_ptr();
            let b1 = p.w[p.b1 * block_pairs..].as_ptr();
            let c = out.as_mut_ptr();
            // SAFETY: an `Hw` exists only where AMX-BF16 is usable (`Hw::new`'s contract).
            // `fits` found rows r0..r0 + 32 (kp pairs each, `stride` apart) inside `a` and
            // blocks b0, b1 (kp x 16 pairs each) inside `w`; step s loads A rows at a + 64 s
            // (16 rows of 64 bytes, stride * 4 bytes apart) and B at b + 1024 s (16 x 64 contiguous bytes), s <
            // kp / 16, so every load stays inside. The stores write C (i, j) row r at byte
            // 64 (32 i + 2 r + j) of `out`, at most 64 * 63 + 64 = 4096 bytes, its size.
            // `steps >= 1` (fits), so the loop ends. Tile state is configured and released
            // inside this block.
            unsafe {
                crate::cpu::amx::tile_pass_asm!(
                    cfg,
                    (a0, a1, row_bytes),
                    (b0, b1),
                    p.kp / TILE,
                    (c, 2 * std::mem::size_of::<[f32; BLOCK]>()),
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
                        "tilestored [{c} + {cs}*1], tmm0",
                        "tilestored [{c} + {cs}*1 + 64], tmm1",
                        "tilestored [{c} + {cs}*1 + 2048], tmm2",
                        "tilestored [{c} + {cs}*1 + 2112], tmm3"
                    ]
                );
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
                    for s in 0..kp / TILE {
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
        assert!(gemm(ops, (&padded, stride), m, kp, w, nb, |r, b, l| {
            got[r * nb + b] = *l;
            seen[r * nb + b] += 1;
        }));
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
        for (m, nb, kp, seed) in [
            (1, 1, 16, 1),
            (32, 2, 32, 2),
            (37, 3, 48, 3),
            (70, 5, 16, 4),
        ] {
            let (a, w) = problem(m, nb, kp, seed);
            assert_eq!(
                bits(&run(&mut Model, &a, m, kp, &w, nb)),
                bits(&reference(&a, m, kp, &w, nb)),
                "m {m} nb {nb} kp {kp}"
            );
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
        assert!(!gemm(&mut Model, (&a, 24), 32, 24, &w, 2, none));
        assert!(!gemm(&mut Model, (&a, 16), 33, 16, &w, 2, none));
        assert!(!gemm(&mut Model, (&a, 16), 32, 16, &w, 3, none));
        assert!(!gemm(&mut Model, (&a, 16), 0, 16, &w, 2, none));
        assert!(!gemm(&mut Model, (&a, 8), 32, 16, &w, 2, none));
        assert!(!gemm(&mut Model, (&a, 17), 32, 16, &w, 2, none));
    }

    /// A faulty implementation (one output lane off by one ulp) fails the self-test.
    #[test]
    fn self_test_passes_the_model_and_catches_a_fault() {
        struct Off;
        impl TileOps for Off {
            fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
                Model.pass(p, out);
                out[5][7] = f32::from_bits(out[5][7].to_bits() ^ 1);
            }
        }
        assert!(self_test(&mut Model));
        assert!(!self_test(&mut Off));
    }

    /// On a CPU with AMX-BF16 (and the int8 tiles in use), the hardware equals the model on
    /// random operands with zeros and subnormals; elsewhere `enabled` is a clean `false`.
    #[test]
    fn hardware_equals_the_model_where_enabled() {
        if !enabled() {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            assert!(!super::super::kernels::isa().amx() || !hw::cpu_has_bf16_tiles());
            return;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        for (m, nb, kp, seed) in [(32, 2, 16, 11), (45, 3, 64, 12), (100, 4, 128, 13)] {
            let (a, w) = problem(m, nb, kp, seed);
            // SAFETY: `enabled()` holds.
            let mut hw = unsafe { Hw::new() };
            assert_eq!(
                bits(&run(&mut hw, &a, m, kp, &w, nb)),
                bits(&run(&mut Model, &a, m, kp, &w, nb)),
                "m {m} nb {nb} kp {kp}"
            );
        }
    }
}
