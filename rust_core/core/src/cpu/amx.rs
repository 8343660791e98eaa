//! AMX-INT8 tiles for the W8A8 GEMM, on CPUs that have them (Intel Sapphire Rapids and later):
//! one `tdpbusd` multiplies 16 activation rows by 16 features over 64 inputs (16,384 u8 x i8
//! products) where a `vpdpbusd` does 64.
//!
//! The packed VNNI layout of [`super::packed`] already is AMX's B operand: in a block, 16
//! consecutive 64-byte quads (4 inputs x 16 features each) are one B tile of 16 rows, so AMX
//! reads the very bytes the VNNI kernels read, and the compensation (`- 128 * Σ w`) and the
//! epilogue stay as they are. Activations (`xu`, u8 rows of `k_pad` bytes) are the A tiles.
//!
//! Work goes in passes ([`Pass`]): up to 2 row tiles x 2 blocks (32 rows x 32 features) over
//! the whole reduction. On the hardware a pass is one `asm!` block that zeroes its
//! accumulators, runs its loop and stores them, so no tile contents live between blocks of
//! assembly or across any call the compiler makes; the tile configuration does, held by a
//! [`Session`] for as long as an [`Hw`] lives (one per GEMM call). [`run_pass`] is that
//! block's program written out in Rust over [`Instructions`], and [`Model`], an exact software
//! model of the five instructions (Intel SDM semantics of `tdpbusd`) that also checks every
//! byte a tile load reads lies inside its slice, runs it. The tests run [`tiles`] on the model
//! against the scalar reference on any CPU. On a CPU with AMX, [`usable`] runs it once on the
//! hardware against the scalar reference before the dispatch picks it, and keeps AMX off if the
//! two disagree.
//!
//! Tile state needs the kernel's permission (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`,
//! Linux 5.16 and later); when it is refused, on other systems, or when the CPU's tile palette
//! is smaller than the one used here, the int8 GEMM stays on AVX-512 VNNI.

use super::packed::{reference_accumulators, Accumulator, BLOCK};
use super::spare::OnLine;

/// Rows of an A or C tile (activation rows per row tile).
pub const TILE_ROWS: usize = 16;
/// Input bytes per A tile row: one step of the reduction.
pub const KSTEP: usize = 64;
/// Bytes of one B tile: 16 quads of a block.
const B_TILE: usize = KSTEP * BLOCK;
/// Row tiles per pass (two C tiles per block): 32 activation rows.
const ROW_TILES: usize = 2;
/// Blocks per pass (one B tile each): 32 features.
const BLOCKS: usize = 2;
/// Entries of a pass's accumulator buffer: every row of its four C tiles. Row `r` of C `(i,
/// j)` is entry `32 i + r nb + j` (`nb` the pass's blocks), so row tile `i`'s rows and blocks
/// are `(row, block)`-ordered from entry `32 i`, as `done` takes them.
pub const ACC_ENTRIES: usize = ROW_TILES * TILE_ROWS * BLOCKS;
/// From this many activation rows the int8 GEMM uses AMX: below it a 16-row tile is mostly
/// padding and the layer is bound by reading its weights anyway (SGLang's CPU kernels switch
/// to AMX above 4 rows too).
pub const MIN_ROWS: usize = 5;

/// The accumulators of one pass, on a cache line (see [`OnLine`]).
pub type PassOut = OnLine<[[i32; BLOCK]; ACC_ENTRIES]>;

/// One pass: `rts` row tiles x `nb` blocks over `steps` steps of 64 inputs. Step `s` loads A
/// tile `i` (16 rows, row stride `sa`) from `a[i].0[a[i].1 + 64 s..]` and B tile `j` (16 rows
/// of 64 bytes) from `b[j].0[b[j].1 + 1024 s..]`, then adds A `i` x B `j` into C `(i, j)`.
#[derive(Clone, Copy, Debug)]
pub struct Pass<'a> {
    pub a: [(&'a [u8], usize); ROW_TILES],
    pub sa: usize,
    pub b: [(&'a [i8], usize); BLOCKS],
    pub rts: usize,
    pub nb: usize,
    pub steps: usize,
    /// Where the next pass's B tiles lie, in bytes from this pass's (0 for none). With each
    /// step the hardware block then prefetches (`prefetcht1`, into L2) the 2 KB of them that
    /// the next pass's step will load, so that the weights stream in from memory while the
    /// tiles compute. On a 16-core Sapphire Rapids-class host this took Qwen3-30B-A3B W8A8 on
    /// 16 threads from ~7.1 to ~6.2 ms at T=128 and from ~17.0 to ~16.1 ms at T=1024 (medians
    /// of alternated runs; on 2 threads no change stood out of the noise). A prefetch never
    /// faults and changes nothing a program can observe, so the distance needs no bounds; the
    /// model ignores it.
    pub pf: usize,
}

impl Pass<'_> {
    /// Every tile the pass loads lies inside its slice, and its shape is one the hardware
    /// block has (1-2 row tiles, 1-2 blocks, at least one step).
    pub fn fits(&self) -> bool {
        let last = |at: usize, step: usize| (self.steps - 1).checked_mul(step)?.checked_add(at);
        (1..=ROW_TILES).contains(&self.rts)
            && (1..=BLOCKS).contains(&self.nb)
            && self.steps >= 1
            && self.a[..self.rts]
                .iter()
                .all(|&(x, at)| last(at, KSTEP).is_some_and(|at| tile_fits(x.len(), at, self.sa)))
            && self.b[..self.nb]
                .iter()
                .all(|&(w, at)| last(at, B_TILE).is_some_and(|at| tile_fits(w.len(), at, KSTEP)))
    }
}

/// What runs a [`Pass`]: the hardware ([`Hw`]) or the model ([`Model`]).
pub trait TileOps {
    /// Runs `p` (which [`Pass::fits`]) and stores its accumulators into `out` (see
    /// [`ACC_ENTRIES`] for where each row lands).
    fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut);
}

/// The five tile instructions a pass uses, one by one. Tiles: C `(i, j)` is accumulator
/// `2 i + j` (`tmm0..tmm3`), A `i` is `tmm4 + i`, B `j` is `tmm6 + j`; every tile is 16 rows of
/// 64 bytes.
pub trait Instructions {
    /// `tilezero` on the four C tiles.
    fn zero(&mut self);
    /// `tileloadd` A tile `i`: row `r` from `x[at + r * stride..][..64]`.
    fn load_a(&mut self, i: usize, x: &[u8], at: usize, stride: usize);
    /// `tileloadd` B tile `j`: row `r` from `w[at + 64 * r..][..64]`.
    fn load_b(&mut self, j: usize, w: &[i8], at: usize);
    /// `tdpbusd`: C `(i, j)` += A `i` (u8) x B `j` (i8).
    fn dot(&mut self, i: usize, j: usize);
    /// `tilestored` C `(i, j)`: row `r` to `out[at + r * stride]`.
    fn store(&mut self, i: usize, j: usize, out: &mut [[i32; BLOCK]], at: usize, stride: usize);
}

/// A pass as the hardware's `asm!` block runs it (see `hw::pass`), instruction for
/// instruction: zero, then per step the loads of every A, then of every B, then the products
/// in `(i, j)` order, the addresses moving on 64 (A) and 1024 (B) bytes per step; then the
/// stores. (The hardware block also prefetches, [`Pass::pf`], which changes no result.)
pub fn run_pass<I: Instructions>(ins: &mut I, p: &Pass<'_>, out: &mut PassOut) {
    ins.zero();
    for s in 0..p.steps {
        for (i, &(x, at)) in p.a.iter().enumerate().take(p.rts) {
            ins.load_a(i, x, at + s * KSTEP, p.sa);
        }
        for (j, &(w, at)) in p.b.iter().enumerate().take(p.nb) {
            ins.load_b(j, w, at + s * B_TILE);
        }
        for i in 0..p.rts {
            for j in 0..p.nb {
                ins.dot(i, j);
            }
        }
    }
    for i in 0..p.rts {
        for j in 0..p.nb {
            ins.store(i, j, &mut out[..], i * TILE_ROWS * BLOCKS + j, p.nb);
        }
    }
}

/// Whether `[at..at + 15 * stride + 64)` lies inside a slice of `len` bytes.
fn tile_fits(len: usize, at: usize, stride: usize) -> bool {
    (TILE_ROWS - 1)
        .checked_mul(stride)
        .and_then(|s| s.checked_add(at))
        .and_then(|s| s.checked_add(KSTEP))
        .is_some_and(|end| end <= len)
}

/// Raw accumulators `Σ xu * w` of rows `0..m` and blocks `first..end` of packed weights `w`
/// (`k_pad * 16` bytes per block), handed out as [`super::packed::PackedI8`]'s tiles hand
/// them: `done(row, rows, block, blocks, acc)` with `acc[rr * blocks + bb]` for row `row + rr`
/// and block `block + bb`, at most 16 rows and 2 blocks at a time, every (row, block) once.
/// Returns `false`, having done nothing, when the arguments do not fit (`k_pad` not a multiple
/// of 64, short slices): the caller then uses another kernel.
#[allow(clippy::too_many_arguments)]
pub fn tiles<T: TileOps>(
    ops: &mut T,
    xu: &[u8],
    m: usize,
    k_pad: usize,
    w: &[i8],
    first: usize,
    end: usize,
    mut done: impl FnMut(usize, usize, usize, usize, &mut [[i32; BLOCK]]),
) -> bool {
    let block_len = k_pad * BLOCK;
    let short = |len: usize, a: usize, b: usize| a.checked_mul(b).is_none_or(|need| len < need);
    if k_pad == 0
        || !k_pad.is_multiple_of(KSTEP)
        || first >= end
        || m == 0
        || short(xu.len(), m, k_pad)
        || short(w.len(), end, block_len)
    {
        return false;
    }
    // The last row tile when it has fewer than 16 rows, zero-padded: a tile load reads 16.
    let full = m / TILE_ROWS * TILE_ROWS;
    let tail = if full < m {
        // A spare buffer of this thread (one per GEMM call would be an allocation per panel),
        // on a cache line as the rows it copies should be.
        // Only the padding rows are zeroed: the others are copied over at once.
        let mut t = super::spare::LineBytes::take_any(TILE_ROWS * k_pad);
        let have = (m - full) * k_pad;
        t[..have].copy_from_slice(&xu[full * k_pad..m * k_pad]);
        t[have..].fill(0);
        t
    } else {
        super::spare::LineBytes::default()
    };
    // Row tile `r`'s source: xu itself, or the padded copy of the last rows.
    let src = |r: usize| -> (&[u8], usize) {
        if r < full {
            (xu, r * k_pad)
        } else {
            (&tail, 0)
        }
    };
    let mut acc: PassOut = OnLine([[0; BLOCK]; ACC_ENTRIES]);
    let mut b = first;
    while b < end {
        let nb = (end - b).min(BLOCKS);
        let mut r0 = 0;
        while r0 < m {
            let rts = (m - r0).div_ceil(TILE_ROWS).min(ROW_TILES);
            let second = if rts > 1 { r0 + TILE_ROWS } else { r0 };
            // The first pass over a block pair prefetches the next pair; later row tiles find
            // it in cache already.
            let pf = if r0 == 0 && b + nb < end {
                nb * block_len
            } else {
                0
            };
            let pass = Pass {
                a: [src(r0), src(second)],
                sa: k_pad,
                b: [(w, b * block_len), (w, (b + nb - 1) * block_len)],
                rts,
                nb,
                steps: k_pad / KSTEP,
                pf,
            };
            ops.pass(&pass, &mut acc);
            for i in 0..rts {
                let rows = (m - r0 - i * TILE_ROWS).min(TILE_ROWS);
                let part = &mut acc[i * TILE_ROWS * BLOCKS..][..rows * nb];
                done(r0 + i * TILE_ROWS, rows, b, nb, part);
            }
            r0 += rts * TILE_ROWS;
        }
        b += nb;
    }
    tail.give();
    true
}

/// Every `(row, block, lanes)` that [`tiles`] hands out for rows `0..m` and blocks
/// `first..end`, in row, then block, order (as [`reference_accumulators`] lists them); `None`
/// when [`tiles`] refuses the arguments.
pub fn accumulators<T: TileOps>(
    ops: &mut T,
    xu: &[u8],
    m: usize,
    k_pad: usize,
    w: &[i8],
    first: usize,
    end: usize,
) -> Option<Vec<Accumulator>> {
    let mut seen = Vec::new();
    let ran = tiles(ops, xu, m, k_pad, w, first, end, |r, mr, b, nb, acc| {
        for rr in 0..mr {
            for bb in 0..nb {
                seen.push((r + rr, b + bb, acc[rr * nb + bb]));
            }
        }
    });
    seen.sort_by_key(|e| (e.0, e.1));
    ran.then_some(seen)
}

/// Whether [`tiles`] on `ops` equals the scalar reference on a problem with a full pass of two
/// row tiles, a pass with one padded row tile (5 rows), a block pair and a single block, three
/// steps, and codes over the whole u8 x i8 range: the check [`usable`] runs on the hardware.
pub fn self_test<T: TileOps>(ops: &mut T) -> bool {
    let (m, blocks, k_pad) = (37, 3, 3 * KSTEP);
    let mut seed = 0x9e37_79b9u32;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        seed
    };
    let xu: Vec<u8> = (0..m * k_pad).map(|_| next() as u8).collect();
    let w: Vec<i8> = (0..blocks * k_pad * BLOCK).map(|_| next() as i8).collect();
    let reference = reference_accumulators(&xu, m, k_pad, &w, blocks);
    !reference.is_empty() && accumulators(ops, &xu, m, k_pad, &w, 0, blocks) == Some(reference)
}

/// An exact software model of the tile instructions: `tdpbusd` as the Intel SDM defines it
/// (for each row `m` and column `n`: `C[m][n] += Σ_k Σ_t u8(A[m][4k + t]) * i8(B[k][4n + t])`,
/// wrapping int32). Tile loads and stores assert that they stay inside their slices, so a test
/// on the model also shows [`tiles`] never reads out of bounds.
#[derive(Clone, Debug)]
pub struct Model {
    a: [[[u8; KSTEP]; TILE_ROWS]; 2],
    b: [[[i8; KSTEP]; TILE_ROWS]; 2],
    c: [[[i32; BLOCK]; TILE_ROWS]; 4],
}

impl Default for Model {
    fn default() -> Self {
        Model {
            a: [[[0; KSTEP]; TILE_ROWS]; 2],
            b: [[[0; KSTEP]; TILE_ROWS]; 2],
            c: [[[0; BLOCK]; TILE_ROWS]; 4],
        }
    }
}

impl Instructions for Model {
    fn zero(&mut self) {
        self.c = [[[0; BLOCK]; TILE_ROWS]; 4];
    }
    fn load_a(&mut self, i: usize, x: &[u8], at: usize, stride: usize) {
        assert!(tile_fits(x.len(), at, stride), "A tile read out of bounds");
        for (r, row) in self.a[i].iter_mut().enumerate() {
            row.copy_from_slice(&x[at + r * stride..at + r * stride + KSTEP]);
        }
    }
    fn load_b(&mut self, j: usize, w: &[i8], at: usize) {
        assert!(tile_fits(w.len(), at, KSTEP), "B tile read out of bounds");
        for (r, row) in self.b[j].iter_mut().enumerate() {
            row.copy_from_slice(&w[at + r * KSTEP..at + (r + 1) * KSTEP]);
        }
    }
    fn dot(&mut self, i: usize, j: usize) {
        let (a, b) = (&self.a[i], &self.b[j]);
        for (m, c) in self.c[2 * i + j].iter_mut().enumerate() {
            for (k, brow) in b.iter().enumerate() {
                for (n, cn) in c.iter_mut().enumerate() {
                    let dp: i32 = (0..4)
                        .map(|t| i32::from(a[m][4 * k + t]) * i32::from(brow[4 * n + t]))
                        .sum();
                    *cn = cn.wrapping_add(dp);
                }
            }
        }
    }
    fn store(&mut self, i: usize, j: usize, out: &mut [[i32; BLOCK]], at: usize, stride: usize) {
        let last = (TILE_ROWS - 1) * stride + at;
        assert!(last < out.len(), "C tile stored out of bounds");
        for (r, row) in self.c[2 * i + j].iter().enumerate() {
            out[at + r * stride] = *row;
        }
    }
}

impl TileOps for Model {
    fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
        assert!(p.fits(), "pass out of bounds: {p:?}");
        run_pass(self, p, out);
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) use hw::tile_peak_asm;
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub use hw::{peak_loop, usable, Hw, Session, PEAK_MACS_PER_ISSUE};

/// AMX tiles are used on x86-64 Linux only (the permission request is Linux's).
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub fn usable() -> bool {
    false
}

/// Int8 GEMM calls (one per expert panel and thread) that ran on the hardware tiles in this
/// process so far: lets a check such as `examples/amx_probe` tell that AMX really ran, not a
/// fallback. Counted per call, not per pass, so that threads do not contend on it.
pub fn hardware_calls() -> u64 {
    HARDWARE_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Counts one [`hardware_calls`] (the hardware path exists on x86-64 Linux only).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) fn count_hardware_call() {
    HARDWARE_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

static HARDWARE_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod hw {
    use super::{self_test, Pass, PassOut, TileOps, KSTEP, TILE_ROWS};

    /// `arch_prctl` requests (Linux `asm/prctl.h`) and the tile-data state component.
    const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;

    /// The 64-byte `ldtilecfg` operand: palette 1, all eight tiles 16 rows of 64 bytes.
    #[repr(C, align(64))]
    pub(super) struct Config([u8; 64]);

    /// The one configuration every [`Session`] loads, built once at compile time.
    pub(super) static ALL_FULL: Config = Config::all_full();

    impl Config {
        const fn all_full() -> Config {
            let mut c = [0u8; 64];
            c[0] = 1; // palette 1
            let colsb = (KSTEP as u16).to_le_bytes();
            let mut t = 0;
            while t < 8 {
                // colsb of tile t: a little-endian u16 at byte 16 + 2t; its rows at byte 48 + t.
                c[16 + 2 * t] = colsb[0];
                c[17 + 2 * t] = colsb[1];
                c[48 + t] = TILE_ROWS as u8;
                t += 1;
            }
            Config(c)
        }
        pub(super) fn bytes(&self) -> &[u8; 64] {
            &self.0
        }
    }

    std::thread_local! {
        /// How many [`Session`]s are open on this thread. Only sessions configure or release
        /// the tiles, so the tiles are configured as [`ALL_FULL`] exactly while this is above
        /// zero (given what [`Session`] says of other tile users).
        static OPEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    /// The tiles configured on this thread (palette 1, eight tiles of 16 rows x 64 bytes) for
    /// as long as the value lives: the first session open on a thread runs `ldtilecfg`, the
    /// last one closed runs `tilerelease`, and sessions nest (an inner one neither configures
    /// nor releases). Tile instructions need the configuration and `ldtilecfg` costs about as
    /// much as 1-4 steps of a pass (83-110 ns measured on the 2-core AMX VM, against 29-110 ns
    /// for a step's four loads and four products), so a GEMM's passes share one instead of
    /// each loading its own. Not `Send`: the configuration is the thread's (the OS saves and
    /// restores it with the rest of the thread's extended state).
    ///
    /// The x86-64 ABI lets any called function change the tile configuration, and the
    /// configuration now outlives the passes' assembly blocks: across the epilogues, widening
    /// and folds a GEMM calls between passes, the allocator, and rayon (a worker may run
    /// another job inside a callback). None of that code uses tiles but through a session,
    /// and no other library's tile code runs on our threads during a GEMM (the forward runs
    /// on the pool's threads and the caller's, with the GIL released, calling nothing
    /// outside this crate but the allocator and rayon). Were a foreign `tilerelease` to run
    /// there anyway, the next pass would stop with SIGILL (an invalid instruction), not
    /// touch memory out of bounds: the bounds every pass checks do not depend on the
    /// configuration beyond palette 1's largest tiles, which this one is.
    #[derive(Debug)]
    pub struct Session {
        thread_bound: std::marker::PhantomData<*const ()>,
    }

    impl Session {
        /// # Safety
        /// The CPU has AMX with palette 1 of at least 8 tiles of 16 rows x 64 bytes and the
        /// OS granted tile state to this process.
        #[must_use = "a session closes (and may release the tiles) when dropped"]
        pub unsafe fn open() -> Session {
            OPEN.with(|open| {
                if open.get() == 0 {
                    // SAFETY: the caller's contract (the CPU takes palette 1 with eight full
                    // tiles, the OS granted tile state). `ldtilecfg` reads the 64 bytes of
                    // ALL_FULL and zeroes every tile, declared clobbered; no session is open
                    // on this thread, so no pass relies on tile contents or a configuration.
                    unsafe {
                        ::core::arch::asm!(
                            "ldtilecfg [{cfg}]",
                            cfg = in(reg) ALL_FULL.bytes().as_ptr(),
                            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                            options(nostack, readonly, preserves_flags),
                        );
                    }
                }
                open.set(open.get() + 1);
            });
            Session {
                thread_bound: std::marker::PhantomData,
            }
        }

        /// Whether a session is open on this thread (the tiles are configured).
        pub fn open_here() -> bool {
            OPEN.with(|open| open.get() > 0)
        }
    }

    impl Drop for Session {
        fn drop(&mut self) {
            OPEN.with(|open| {
                // This session counted itself when it opened, on this thread (not `Send`).
                debug_assert!(open.get() > 0, "a tile session closed that never opened");
                let left = open.get().saturating_sub(1);
                open.set(left);
                if left == 0 {
                    // SAFETY: this session's opening configured the tiles or found them
                    // configured, so the CPU has them; `tilerelease` returns them to their
                    // initial state, declared clobbered, and no session is left open on this
                    // thread to rely on them.
                    unsafe {
                        ::core::arch::asm!(
                            "tilerelease",
                            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                            options(nostack, nomem, preserves_flags),
                        );
                    }
                }
            });
        }
    }

    /// The CPU's AMX tiles, configured while the value lives (it holds a [`Session`]). Each
    /// pass is one self-contained `asm!` block (zero or load the accumulators, compute,
    /// store), so no tile contents outlive it; only the configuration does.
    #[derive(Debug)]
    pub struct Hw(Session);

    impl Hw {
        /// # Safety
        /// [`usable`] returned true in this process (the CPU has AMX-INT8 with palette 1 of
        /// at least 8 tiles of 16 rows x 64 bytes, and the OS granted tile state).
        pub unsafe fn new() -> Hw {
            // SAFETY: the caller's contract is Session::open's.
            Hw(unsafe { Session::open() })
        }
    }

    /// The prefetches of one step of a two-block pass with [`Pass::pf`]: the 16 lines of each
    /// B tile that the next pass loads at this step, `pf` bytes on from this pass's.
    macro_rules! prefetch_next_b {
        ($($at:literal),*) => {
            concat!(
                $("prefetcht1 [{b0} + {pf} + ", $at, "]\n",)*
                $("prefetcht1 [{b1} + {pf} + ", $at, "]\n",)*
            )
        };
        // A pass's distance is a register operand: this form only names it.
        (@ $pf:expr) => {
            prefetch_next_b!(
                0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960
            )
        };
    }

    /// One pass's `asm!` block, on tiles a [`Session`] configured: zeroed accumulators, a loop
    /// of `steps` steps (the listed loads, products and prefetches, then the four source
    /// addresses move on), the listed stores. Stores: C `(i, j)` row `r` at
    /// `c + 64 (32 i + j) + r * cs`. The tile registers are declared clobbered; flags are
    /// changed by the loop.
    macro_rules! tile_pass_asm {
        (($a0:expr, $a1:expr, $sa:expr), ($b0:expr, $b1:expr), $steps:expr,
         ($out:expr, $cs:expr),
         [$($load:literal),*], [$($dot:literal),*], [$($store:literal),*]
         $(, prefetch $pf:expr)?) => {
            ::core::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                $($load,)*
                $($dot,)*
                $(prefetch_next_b!(@ $pf),)?
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {steps}",
                "jnz 2b",
                $($store,)*
                a0 = inout(reg) $a0 => _,
                a1 = inout(reg) $a1 => _,
                sa = in(reg) $sa,
                b0 = inout(reg) $b0 => _,
                b1 = inout(reg) $b1 => _,
                sb = in(reg) $crate::cpu::amx::KSTEP,
                steps = inout(reg) $steps => _,
                c = in(reg) $out,
                cs = in(reg) $cs,
                $(pf = in(reg) $pf,)?
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            )
        };
    }

    /// [`tile_pass_asm`] for an int8 [`Pass`]: its tiles' addresses, row stride and steps.
    macro_rules! pass_asm {
        ($p:expr, $out:expr, $cs:expr, $($rest:tt)*) => {
            tile_pass_asm!(
                (
                    $p.a[0].0.as_ptr().wrapping_add($p.a[0].1),
                    $p.a[1].0.as_ptr().wrapping_add($p.a[1].1),
                    $p.sa
                ),
                (
                    $p.b[0].0.as_ptr().wrapping_add($p.b[0].1),
                    $p.b[1].0.as_ptr().wrapping_add($p.b[1].1)
                ),
                $p.steps,
                ($out, $cs),
                $($rest)*
            )
        };
    }

    /// A peak loop's block for the tile product `$op` (`tdpbusd`, `tdpbf16ps`), on tiles a
    /// [`Session`] configured: `4 * rounds` back-to-back products into four independent
    /// accumulator tiles from zeroed operand tiles.
    macro_rules! tile_peak_asm {
        ($op:literal, $rounds:expr) => {
            ::core::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "2:",
                concat!($op, " tmm0, tmm4, tmm6"),
                concat!($op, " tmm1, tmm4, tmm7"),
                concat!($op, " tmm2, tmm5, tmm6"),
                concat!($op, " tmm3, tmm5, tmm7"),
                "dec {n}",
                "jnz 2b",
                n = inout(reg) $rounds => _,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack, nomem),
            )
        };
    }
    pub(crate) use tile_peak_asm;

    /// Multiply-adds of one `tdpbusd` on full tiles: 16 rows x 16 features x 64 inputs.
    pub const PEAK_MACS_PER_ISSUE: usize = TILE_ROWS * 16 * KSTEP;

    /// `4 * rounds` back-to-back `tdpbusd` into four independent accumulator tiles from
    /// operands held in tiles (no memory traffic, but the 64-byte configuration where no
    /// session is open on the thread): the instruction's throughput limit, for
    /// [`crate::cpu::peak`].
    ///
    /// # Safety
    /// [`usable`] returned true in this process.
    pub unsafe fn peak_loop(rounds: usize) {
        if rounds == 0 {
            return;
        }
        // SAFETY: the caller's contract (the CPU has AMX-INT8 with palette 1 of 8 full tiles
        // and the OS granted tile state) is the session's, which configures the tiles while
        // the block runs. The block reads and writes no memory, only tiles.
        unsafe {
            let _tiles = Session::open();
            tile_peak_asm!("tdpbusd", rounds);
        }
    }

    impl TileOps for Hw {
        fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
            // Checked here, not assumed: the loads below read exactly the tiles `fits` checks.
            assert!(p.fits(), "AMX pass out of bounds");
            let c = out.as_mut_ptr();
            // Row stride of a C tile's stores, in bytes: `nb` entries of 64 bytes.
            let cs = p.nb * std::mem::size_of::<[i32; super::BLOCK]>();
            // SAFETY: an `Hw` exists only where AMX is usable (`Hw::new`'s contract), and its
            // session keeps the tiles configured as ALL_FULL (8 tiles of 16 x 64 bytes) on this
            // thread while it lives (`Hw` is not `Send`; see `Session` for why nothing else on
            // the thread changes the configuration meanwhile). The loads read the tiles
            // `p.fits()` found inside their slices (A: 16 rows of 64 bytes at stride `sa` from
            // a[i] + 64 s; B: 16 x 64 contiguous bytes from b[j] + 1024 s; s < steps). The
            // stores write C (i, j) row r at entry 32 i + j + r nb of `out`: at most 32 + 1 +
            // 15 * 2 = 63 < 64 entries. Registers a1/b1 equal a0/b0 when unused and are never
            // dereferenced then. `steps >= 1` (fits), so the loop ends. The prefetches (`p.pf
            // != 0`) may name any address: a prefetch never faults and neither reads into nor
            // writes anything the program sees.
            unsafe {
                macro_rules! one_row_tile_two_blocks {
                    ($($prefetch:tt)*) => {
                        pass_asm!(p,
                            c,
                            cs,
                            [
                                "tileloadd tmm4, [{a0} + {sa}*1]",
                                "tileloadd tmm6, [{b0} + {sb}*1]",
                                "tileloadd tmm7, [{b1} + {sb}*1]"
                            ],
                            ["tdpbusd tmm0, tmm4, tmm6", "tdpbusd tmm1, tmm4, tmm7"],
                            [
                                "tilestored [{c} + {cs}*1], tmm0",
                                "tilestored [{c} + {cs}*1 + 64], tmm1"
                            ] $($prefetch)*)
                    };
                }
                macro_rules! two_row_tiles_two_blocks {
                    ($($prefetch:tt)*) => {
                        pass_asm!(p,
                            c,
                            cs,
                            [
                                "tileloadd tmm4, [{a0} + {sa}*1]",
                                "tileloadd tmm5, [{a1} + {sa}*1]",
                                "tileloadd tmm6, [{b0} + {sb}*1]",
                                "tileloadd tmm7, [{b1} + {sb}*1]"
                            ],
                            [
                                "tdpbusd tmm0, tmm4, tmm6",
                                "tdpbusd tmm1, tmm4, tmm7",
                                "tdpbusd tmm2, tmm5, tmm6",
                                "tdpbusd tmm3, tmm5, tmm7"
                            ],
                            [
                                "tilestored [{c} + {cs}*1], tmm0",
                                "tilestored [{c} + {cs}*1 + 64], tmm1",
                                "tilestored [{c} + {cs}*1 + 2048], tmm2",
                                "tilestored [{c} + {cs}*1 + 2112], tmm3"
                            ] $($prefetch)*)
                    };
                }
                match (p.rts, p.nb) {
                    (1, 1) => pass_asm!(
                        p,
                        c,
                        cs,
                        [
                            "tileloadd tmm4, [{a0} + {sa}*1]",
                            "tileloadd tmm6, [{b0} + {sb}*1]"
                        ],
                        ["tdpbusd tmm0, tmm4, tmm6"],
                        ["tilestored [{c} + {cs}*1], tmm0"]
                    ),
                    (1, 2) if p.pf != 0 => one_row_tile_two_blocks!(, prefetch p.pf),
                    (1, _) => one_row_tile_two_blocks!(),
                    (_, 1) => pass_asm!(
                        p,
                        c,
                        cs,
                        [
                            "tileloadd tmm4, [{a0} + {sa}*1]",
                            "tileloadd tmm5, [{a1} + {sa}*1]",
                            "tileloadd tmm6, [{b0} + {sb}*1]"
                        ],
                        ["tdpbusd tmm0, tmm4, tmm6", "tdpbusd tmm2, tmm5, tmm6"],
                        [
                            "tilestored [{c} + {cs}*1], tmm0",
                            "tilestored [{c} + {cs}*1 + 2048], tmm2"
                        ]
                    ),
                    (2, 2) if p.pf != 0 => two_row_tiles_two_blocks!(, prefetch p.pf),
                    _ => two_row_tiles_two_blocks!(),
                }
            }
        }
    }

    /// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); leaf 0x1D palette 1 and
    /// leaf 0x1E TMUL limits at least what [`ALL_FULL`] asks for.
    fn cpu_has_tiles() -> bool {
        use std::arch::x86_64::__cpuid_count;
        if __cpuid_count(0, 0).eax < 0x1e {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 {
            return false;
        }
        let palettes = __cpuid_count(0x1d, 0).eax;
        let p1 = __cpuid_count(0x1d, 1);
        let tmul = __cpuid_count(0x1e, 0).ebx;
        let bytes_per_row = p1.ebx & 0xffff;
        let names = p1.ebx >> 16;
        let max_rows = p1.ecx & 0xffff;
        let (max_k, max_n) = (tmul & 0xff, (tmul >> 8) & 0xffff);
        palettes >= 1
            && bytes_per_row as usize >= KSTEP
            && names >= 8
            && max_rows as usize >= TILE_ROWS
            && max_k as usize >= TILE_ROWS
            && max_n as usize >= KSTEP
    }

    /// Asks Linux for tile-data state in this process; true when granted.
    fn request_permission() -> bool {
        // SAFETY: arch_prctl with these codes only reads and sets the process's permitted
        // extended-state mask; a kernel without them returns an error.
        let req = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if req != 0 {
            return false;
        }
        let mut mask: u64 = 0;
        // SAFETY: ARCH_GET_XCOMP_PERM writes one u64 through the pointer, which is valid.
        let got = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_GET_XCOMP_PERM,
                std::ptr::addr_of_mut!(mask),
            )
        };
        got == 0 && mask & (1 << XFEATURE_XTILEDATA) != 0
    }

    /// Whether the int8 GEMM may use AMX in this process: the CPU has the tiles, Linux granted
    /// tile state, and [`super::tiles`] on the hardware equals the scalar reference
    /// ([`self_test`]). Asked once (by [`super::super::kernels::isa`]); a refusal or a failed
    /// self-test is said on stderr.
    pub fn usable() -> bool {
        if !cpu_has_tiles() {
            return false;
        }
        if !request_permission() {
            eprintln!(
                "moeq_rs: the CPU has AMX but Linux refused tile state (arch_prctl); \
                 using AVX-512 VNNI"
            );
            return false;
        }
        // SAFETY: the CPU has the tiles and the OS granted their state (just checked).
        let agree = self_test(&mut unsafe { Hw::new() });
        if !agree {
            eprintln!(
                "moeq_rs: AMX tiles disagreed with the scalar int8 GEMM in a self-test; \
                 using AVX-512 VNNI"
            );
        }
        agree
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed::PackedI8;
    use super::*;
    use proptest::prelude::*;

    fn run_model(
        xu: &[u8],
        m: usize,
        k_pad: usize,
        w: &[i8],
        first: usize,
        end: usize,
    ) -> Vec<Accumulator> {
        // Each hand-out is at most one C tile's rows by two blocks, sized as `done` is told.
        let ran = tiles(
            &mut Model::default(),
            xu,
            m,
            k_pad,
            w,
            first,
            end,
            |_, mr, _, nb, acc| {
                assert!((1..=TILE_ROWS).contains(&mr) && (1..=BLOCKS).contains(&nb));
                assert_eq!(acc.len(), mr * nb);
            },
        );
        assert!(ran);
        accumulators(&mut Model::default(), xu, m, k_pad, w, first, end).unwrap_or_default()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// The tile driver on the exact model equals the scalar reference for every (row,
        /// block), each handed out once, with slices of exactly the size the contract names
        /// (the model asserts that no tile load or store leaves them).
        #[test]
        fn model_tiles_equal_scalar(m in 1usize..70, n in 1usize..100, steps in 1usize..5,
                                    seed in any::<u64>()) {
            let k = steps * KSTEP;
            let mut s = seed | 1;
            let mut next = move || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; s };
            let q: Vec<i8> = (0..n * k).map(|_| next() as i8).collect();
            let packed = PackedI8::pack(&q, n, k);
            let xu: Vec<u8> = (0..m * k).map(|_| next() as u8).collect();
            let blocks = packed.blocks();
            let reference = reference_accumulators(&xu, m, k, packed.bytes(), blocks);
            prop_assert_eq!(run_model(&xu, m, k, packed.bytes(), 0, blocks), reference);
        }
    }

    #[test]
    fn model_tiles_at_extremes_and_a_block_range() {
        // 255 x -128 everywhere: the largest products, summed over 4 steps.
        let (m, blocks, k) = (21, 5, 4 * KSTEP);
        let xu = vec![255u8; m * k];
        let w = vec![-128i8; blocks * k * BLOCK];
        let got = run_model(&xu, m, k, &w, 1, 4);
        assert_eq!(got.len(), m * 3);
        for (r, b, lanes) in got {
            assert!(r < m && (1..4).contains(&b));
            assert_eq!(lanes, [255 * -128 * k as i32; BLOCK]);
        }
    }

    /// Records each pass's first B tile, row tile and prefetch distance, running the model.
    #[derive(Default)]
    struct Recorder {
        model: Model,
        passes: Vec<(usize, *const u8, usize)>,
    }

    impl TileOps for Recorder {
        fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
            let a = p.a[0].0.as_ptr().wrapping_add(p.a[0].1);
            self.passes.push((p.b[0].1, a, p.pf));
            self.model.pass(p, out)
        }
    }

    /// The first pass over each block pair prefetches exactly the B tiles of the next pair,
    /// which the next passes load; no other pass prefetches, nor the last pair's.
    #[test]
    fn passes_prefetch_the_next_block_pair_once() {
        let (m, blocks, k) = (40, 7, 2 * KSTEP);
        let block_len = k * BLOCK;
        let xu = vec![3u8; m * k];
        let w = vec![-2i8; blocks * block_len];
        let mut ops = Recorder::default();
        assert!(tiles(
            &mut ops,
            &xu,
            m,
            k,
            &w,
            1,
            blocks,
            |_, _, _, _, _| {}
        ));
        // Blocks 1..7 in pairs (1,2), (3,4), (5,6); 40 rows in row passes of 32 and 8.
        let starts: Vec<usize> = ops.passes.iter().map(|p| p.0 / block_len).collect();
        assert_eq!(starts, [1, 1, 3, 3, 5, 5]);
        for (i, &(b, a, pf)) in ops.passes.iter().enumerate() {
            let first_row_pass = a == xu.as_ptr();
            if first_row_pass && b / block_len + 2 < blocks {
                assert_eq!(pf, 2 * block_len, "pass {i}");
                assert_eq!(
                    ops.passes[i + 2].0,
                    b + pf,
                    "pass {i} prefetches what pass {} loads",
                    i + 2
                );
            } else {
                assert_eq!(pf, 0, "pass {i}");
            }
        }
    }

    #[test]
    fn tiles_refuse_what_they_cannot_run() {
        let mut ops = Model::default();
        let xu = vec![1u8; 8 * 128];
        let w = vec![1i8; 2 * 128 * BLOCK];
        let never = |_: usize, _: usize, _: usize, _: usize, _: &mut [[i32; BLOCK]]| {
            panic!("nothing may be emitted")
        };
        // k_pad not a multiple of 64, short activations, short weights, empty ranges.
        assert!(!tiles(&mut ops, &xu, 8, 96, &w, 0, 2, never));
        assert!(!tiles(&mut ops, &xu, 9, 128, &w, 0, 2, never));
        assert!(!tiles(&mut ops, &xu, 8, 128, &w, 0, 3, never));
        assert!(!tiles(&mut ops, &xu, 8, 128, &w, 2, 2, never));
        assert!(!tiles(&mut ops, &xu, 0, 128, &w, 0, 2, never));
    }

    /// The model with one instruction wrong, as a miscompiled or misassembled kernel would be.
    struct Faulty {
        model: Model,
        fault: usize,
    }

    impl TileOps for Faulty {
        fn pass(&mut self, p: &Pass<'_>, out: &mut PassOut) {
            run_pass(self, p, out)
        }
    }

    impl Instructions for Faulty {
        fn zero(&mut self) {
            self.model.zero()
        }
        fn load_a(&mut self, i: usize, x: &[u8], at: usize, stride: usize) {
            // Fault 0: the row stride ignored (rows read back to back).
            let stride = if self.fault == 0 { KSTEP } else { stride };
            self.model.load_a(i, x, at, stride)
        }
        fn load_b(&mut self, j: usize, w: &[i8], at: usize) {
            self.model.load_b(j, w, at)
        }
        fn dot(&mut self, i: usize, j: usize) {
            if self.fault == 1 {
                // Fault 1: A read as signed bytes (tdpbsud's operand roles swapped).
                for row in &mut self.model.a[i] {
                    for v in row.iter_mut() {
                        *v = (*v as i8).unsigned_abs();
                    }
                }
            }
            // Fault 2: the second A tile paired with the wrong accumulator.
            let i2 = if self.fault == 2 { 1 - i } else { i };
            self.model.dot(i2.min(1), j)
        }
        fn store(
            &mut self,
            i: usize,
            j: usize,
            out: &mut [[i32; BLOCK]],
            at: usize,
            stride: usize,
        ) {
            // Fault 3: the last block's tile stored over the first.
            let at = if self.fault == 3 { 0 } else { at };
            self.model.store(i, j, out, at, stride)
        }
    }

    #[test]
    fn self_test_passes_the_model_and_catches_faults() {
        assert!(self_test(&mut Model::default()));
        for fault in 0..4 {
            let mut ops = Faulty {
                model: Model::default(),
                fault,
            };
            assert!(!self_test(&mut ops), "fault {fault} not caught");
        }
    }

    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn tile_config_is_palette_one_with_full_tiles() {
        let b = hw::ALL_FULL.bytes();
        assert_eq!((b[0], b[1]), (1, 0));
        for t in 0..8 {
            assert_eq!(u16::from_le_bytes([b[16 + 2 * t], b[17 + 2 * t]]), 64);
            assert_eq!(b[48 + t], 16);
        }
        assert!(b[2..16].iter().all(|&v| v == 0) && b[32..48].iter().all(|&v| v == 0));
        assert!(b[56..].iter().all(|&v| v == 0));
        assert_eq!(b.as_ptr() as usize % 64, 0);
    }

    /// Where the CPU has no AMX (or Linux refuses tile state) the answer is a clean `false`,
    /// and the dispatch says so; where it has AMX, the dispatch picks it only after the
    /// hardware self-test in `usable` passed.
    #[test]
    fn usable_agrees_with_the_dispatch() {
        let amx = usable();
        let cap = std::env::var("MOEQ_CPU_ISA").unwrap_or_default();
        let capped = !matches!(super::super::kernels::isa_cap(&cap), "" | "amx_int8");
        assert_eq!(super::super::kernels::isa().amx(), amx && !capped);
        #[cfg(target_arch = "x86_64")]
        if !hw_cpuid_amx() {
            assert!(!amx);
        }
    }

    /// The tile configuration the CPU holds for this thread (`sttilecfg`): 64 zero bytes
    /// when the tiles are in their initial state (released, or never configured).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn held_config() -> [u8; 64] {
        #[repr(C, align(64))]
        struct Held([u8; 64]);
        let mut held = Held([0xA5; 64]);
        // SAFETY: only called where `usable()` holds (the CPU has the tiles); `sttilecfg`
        // writes exactly 64 bytes to its operand, a 64-byte buffer of ours.
        unsafe {
            ::core::arch::asm!(
                "sttilecfg [{at}]",
                at = in(reg) held.0.as_mut_ptr(),
                options(nostack, preserves_flags),
            );
        }
        held.0
    }

    /// Tile sessions nest: a GEMM (an `Hw`), the peak loop and another `Hw` opened and
    /// closed inside an open one leave the tiles configured for it, and its passes still equal
    /// the scalar reference after them (were the tiles released, the next pass would fault
    /// with SIGILL). The last session closed returns the tiles to their initial state.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn tile_sessions_nest_and_release() {
        if !usable() {
            assert!(!super::super::kernels::isa().amx());
            return;
        }
        // (Each test runs on a thread of its own.)
        assert!(!Session::open_here());
        assert_eq!(held_config(), [0; 64]);
        // SAFETY: `usable()` holds.
        let mut outer = unsafe { Hw::new() };
        assert!(Session::open_here());
        assert_eq!(&held_config(), hw::ALL_FULL.bytes());
        assert!(self_test(&mut outer));
        {
            // SAFETY: `usable()` holds.
            let mut inner = unsafe { Hw::new() };
            assert!(self_test(&mut inner));
            // SAFETY: `usable()` holds.
            unsafe { peak_loop(2) };
            if super::super::amx_bf16::enabled() {
                // SAFETY: `enabled()` holds.
                let mut bf16 = unsafe { super::super::amx_bf16::Hw::new() };
                assert!(super::super::amx_bf16::self_test(&mut bf16));
            }
        }
        // Still configured (checked before any tile instruction, which would fault if not).
        assert!(Session::open_here());
        assert_eq!(&held_config(), hw::ALL_FULL.bytes());
        // SAFETY: `usable()` holds.
        unsafe { peak_loop(2) };
        assert!(self_test(&mut outer));
        // Sessions are the thread's: another thread starts with none, and its own session's
        // release leaves this one's configured. (Linux starts a thread with a copy of its
        // creator's extended state, tile configuration included, so the new thread may hold
        // one before its first session: harmless, as no pass runs outside a session.)
        std::thread::spawn(|| {
            assert!(!Session::open_here());
            // SAFETY: `usable()` holds (checked on the spawning thread, for the process).
            let mut other = unsafe { Hw::new() };
            assert_eq!(&held_config(), hw::ALL_FULL.bytes());
            assert!(self_test(&mut other));
            drop(other);
            assert!(!Session::open_here());
            assert_eq!(held_config(), [0; 64]);
        })
        .join()
        .expect("a tile session on another thread");
        assert_eq!(&held_config(), hw::ALL_FULL.bytes());
        assert!(self_test(&mut outer));
        drop(outer);
        assert!(!Session::open_here());
        assert_eq!(held_config(), [0; 64]);
        // The peak loop alone configures and releases too.
        // SAFETY: `usable()` holds.
        unsafe { peak_loop(2) };
        assert_eq!(held_config(), [0; 64]);
    }

    #[cfg(target_arch = "x86_64")]
    fn hw_cpuid_amx() -> bool {
        use std::arch::x86_64::__cpuid_count;
        __cpuid_count(0, 0).eax >= 7 && __cpuid_count(7, 0).edx & (1 << 25) != 0
    }
}
