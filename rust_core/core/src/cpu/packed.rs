//! int8 weights prepacked for the u8 x i8 dot-product instructions (VNNI `vpdpbusd`), and the
//! register-blocked GEMM that reads them.
//!
//! Layout: output features in blocks of [`BLOCK`] = 16, input features in quads of 4. Block
//! `b` holds `[k_pad / 4][16][4]` bytes: for each quad of inputs, the 4 codes of feature 0,
//! then of feature 1, ... so one 64-byte load is exactly one `vpdpbusd` operand (16 int32
//! lanes, one per feature). A block is one contiguous run, so a thread streaming a column panel
//! reads memory sequentially. Padding (features past `n`, inputs past `k`) is zero codes.
//!
//! Activations enter as `xu = x + 128` (u8); the signed result is `Σ xu * w - 128 * Σ w`, with
//! `Σ w` per feature kept in [`PackedI8::wsum`] (the compensation term). Every path returns
//! exactly the scalar reference's int32 accumulators.

use std::sync::Arc;

use super::arena::Arena;
use super::kernels::isa;

/// Output features per block (one 512-bit register of int32 lanes).
pub const BLOCK: usize = 16;
/// Blocks per register tile: a tile is `rows x 64` outputs.
pub const TILE_BLOCKS: usize = 4;
/// Activation rows per register tile (6 x 4 accumulators + 4 weight registers + 1 broadcast).
pub const TILE_ROWS: usize = 6;
/// The most (row, block) accumulators one tile hands out: a VNNI register tile, or the AMX
/// tiles' [`super::amx::ACC_ENTRIES`].
const MAX_TILE: usize = if TILE_ROWS * TILE_BLOCKS > super::amx::ACC_ENTRIES {
    TILE_ROWS * TILE_BLOCKS
} else {
    super::amx::ACC_ENTRIES
};
/// Row passes over a tile from which the later passes prefetch the next tile: with fewer,
/// each pass would issue a large share of 128 KB of prefetches in a short run of compute and
/// stall on them (measured slower at 8-16 rows per expert, faster at 64).
#[cfg(target_arch = "x86_64")]
const MIN_PF_PASSES: usize = 4;
/// Up to this many activation rows (decode) the VNNI GEMM reads its blocks one after another
/// ([`x86::rows_streaming`]): one weight stream per thread instead of the register tile's four
/// runs 32 KB apart. Qwen3 W8A8 from Rust (`moe_time`, alternating builds): T=1 best of 40
/// 0.93-0.99 -> 0.84-0.91 ms (8 pairs), T=16 median 11.9-12.8 -> 10.8-11.9 ms (6 pairs,
/// each pair faster), DeepSeek-V2-Lite T=16 13.4-14.1 -> 12.9-13.4 ms.
const STREAM_ROWS: usize = 2;
/// Quads (4 inputs) per depth chunk of the VNNI register tile past `TILE_ROWS` rows: 4
/// blocks' chunk is 16 KB of weights, which stay in L1 while the row passes run over them
/// (a tile's full depth, 128 KB at 2048 inputs, is read from L2 by every pass). One thread,
/// `int8_gemm_time` at 64-256 rows: 1536x2048 198-203 -> 246-256 GMAC/s, 24576x2048 (from
/// memory) 174-201 -> 235-264; in the Qwen3 W8A8 layer at T=1024 the tiles (with their
/// epilogue) went from ~220 to ~230 GMAC/s per thread, the layer ~3-5% faster.
#[cfg(target_arch = "x86_64")]
const CHUNK_QUADS: usize = 64;
/// Row passes that share a depth chunk (their partial sums, 12 KB, stay in L1 beside it).
#[cfg(target_arch = "x86_64")]
const GROUP_PASSES: usize = 8;
/// The partial sums of one group of row passes over a tile (`PackedI8::chunked_tile`),
/// kept by the caller for all of a GEMM's tiles.
#[cfg(target_arch = "x86_64")]
type ChunkSums = [[i32; BLOCK]; GROUP_PASSES * TILE_ROWS * TILE_BLOCKS];
// `x86::rows_streaming` handles one or two rows.
const _: () = assert!(STREAM_ROWS >= 1 && STREAM_ROWS <= 2);

/// `[n, k]` int8 weights in the VNNI block layout, with per-feature code sums.
#[derive(Clone, Debug)]
pub struct PackedI8 {
    pub n: usize,
    pub k: usize,
    /// `k` rounded up to a multiple of 4: the row stride of the u8 activations too.
    pub k_pad: usize,
    data: Storage,
    /// `Σ_i w[j, i]` per feature, padded to whole blocks with zeros.
    pub wsum: Vec<i32>,
}

/// Where the packed bytes live: their own allocation, or a layer's shared [`Arena`].
#[derive(Clone, Debug)]
enum Storage {
    Owned(Vec<i8>),
    Shared {
        arena: Arc<Arena>,
        offset: usize,
        len: usize,
    },
}

impl PackedI8 {
    /// Packs row-major `[n, k]` codes (missing codes read as zero, so a short slice cannot
    /// index out of bounds; callers check the length beforehand).
    pub fn pack(q: &[i8], n: usize, k: usize) -> PackedI8 {
        let k_pad = k.div_ceil(4) * 4;
        let blocks = n.div_ceil(BLOCK);
        let block_len = k_pad * BLOCK;
        let mut data = vec![0i8; blocks * block_len];
        let mut wsum = vec![0i32; blocks * BLOCK];
        for (j, sum) in wsum.iter_mut().enumerate().take(n) {
            let (b, lane) = (j / BLOCK, j % BLOCK);
            let row = q.get(j * k..(j + 1) * k).unwrap_or(&[]);
            let dst = &mut data[b * block_len..(b + 1) * block_len];
            for (i, &v) in row.iter().enumerate() {
                dst[(i / 4) * 64 + lane * 4 + i % 4] = v;
            }
            *sum = row.iter().map(|&v| i32::from(v)).sum();
        }
        PackedI8 {
            n,
            k,
            k_pad,
            data: Storage::Owned(data),
            wsum,
        }
    }

    /// Number of 16-feature blocks.
    pub fn blocks(&self) -> usize {
        self.n.div_ceil(BLOCK)
    }

    /// The packed bytes (for writing the CPU layout to disk).
    pub fn bytes(&self) -> &[i8] {
        match &self.data {
            Storage::Owned(v) => v,
            Storage::Shared { arena, offset, len } => arena.slice(*offset, *len),
        }
    }

    /// Moves the bytes into `arena` at `offset` (where [`Arena::build`] copied them).
    pub fn share(&mut self, arena: &Arc<Arena>, offset: usize) {
        let len = self.bytes().len();
        self.data = Storage::Shared {
            arena: Arc::clone(arena),
            offset,
            len,
        };
    }

    /// Rebuilds from packed bytes written by [`PackedI8::bytes`]; `None` when the sizes disagree.
    pub fn from_packed(n: usize, k: usize, data: Vec<i8>) -> Option<PackedI8> {
        let k_pad = k.div_ceil(4) * 4;
        let blocks = n.div_ceil(BLOCK);
        if data.len() != blocks * k_pad * BLOCK {
            return None;
        }
        let mut wsum = vec![0i32; blocks * BLOCK];
        for (j, s) in wsum.iter_mut().enumerate().take(n) {
            let (b, lane) = (j / BLOCK, j % BLOCK);
            let block = &data[b * k_pad * BLOCK..(b + 1) * k_pad * BLOCK];
            *s = (0..k)
                .map(|i| i32::from(block[(i / 4) * 64 + lane * 4 + i % 4]))
                .sum();
        }
        Some(PackedI8 {
            n,
            k,
            k_pad,
            data: Storage::Owned(data),
            wsum,
        })
    }

    /// Rebuilds from packed bytes and their code sums (the CPU layout on disk); `None` when the
    /// sizes disagree with `[n, k]`.
    pub fn from_parts(n: usize, k: usize, data: Vec<i8>, wsum: Vec<i32>) -> Option<PackedI8> {
        let k_pad = k.div_ceil(4) * 4;
        let blocks = n.div_ceil(BLOCK);
        (data.len() == blocks * k_pad * BLOCK && wsum.len() == blocks * BLOCK).then_some(PackedI8 {
            n,
            k,
            k_pad,
            data: Storage::Owned(data),
            wsum,
        })
    }

    /// As [`PackedI8::from_parts`] for bytes already in `arena` at `offset` (the CPU layout
    /// copied straight from the file into the layer's arena).
    pub fn from_shared(
        n: usize,
        k: usize,
        arena: &Arc<Arena>,
        offset: usize,
        wsum: Vec<i32>,
    ) -> Option<PackedI8> {
        let k_pad = k.div_ceil(4) * 4;
        let blocks = n.div_ceil(BLOCK);
        let len = blocks * k_pad * BLOCK;
        let fits = arena.slice(offset, len).len() == len && wsum.len() == blocks * BLOCK;
        fits.then(|| PackedI8 {
            n,
            k,
            k_pad,
            data: Storage::Shared {
                arena: Arc::clone(arena),
                offset,
                len,
            },
            wsum,
        })
    }

    /// Whether the bytes already live in a shared arena.
    pub fn is_shared(&self) -> bool {
        matches!(self.data, Storage::Shared { .. })
    }

    /// Feature `j`'s codes in input order.
    pub fn row(&self, j: usize) -> Vec<i8> {
        let (b, lane) = (j / BLOCK, j % BLOCK);
        let block = &self.bytes()[b * self.k_pad * BLOCK..(b + 1) * self.k_pad * BLOCK];
        (0..self.k)
            .map(|i| block[(i / 4) * 64 + lane * 4 + i % 4])
            .collect()
    }

    /// Signed int32 dot products of activation rows with the features of blocks
    /// `first_block..first_block + nblocks`: calls `emit(row, block, &acc)` with the 16 lanes of
    /// each (row, block) pair, `acc[l]` for feature `16 * block + l`. `xu` is `[m, k_pad]` u8
    /// (`x + 128`). Lanes past `n` are zero.
    pub fn gemm(
        &self,
        xu: &[u8],
        m: usize,
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[i32; BLOCK]),
    ) {
        self.tiles(xu, m, first_block, nblocks, |r, mr, b, nb, acc| {
            for rr in 0..mr {
                for bb in 0..nb {
                    let lanes = &mut acc[rr * nb + bb];
                    let sums = &self.wsum[(b + bb) * BLOCK..(b + bb + 1) * BLOCK];
                    for (v, &s) in lanes.iter_mut().zip(sums) {
                        *v -= 128 * s;
                    }
                    emit(r + rr, b + bb, lanes);
                }
            }
        });
    }

    /// As [`PackedI8::gemm`], rescaled: emits `f32(acc[l]) * sx[row] * scale[16 * block + l]`
    /// (in that order, so every path rounds alike), the W8A8 output. `sx` has a scale per row
    /// of `xu`; `scale` one per feature (lanes past its end emit zeros).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_scaled(
        &self,
        xu: &[u8],
        m: usize,
        sx: &[f32],
        scale: &[f32],
        first_block: usize,
        nblocks: usize,
        mut emit: impl FnMut(usize, usize, &[f32; BLOCK]),
    ) {
        if sx.len() < m {
            return;
        }
        // The AVX2 epilogue with the AVX-VNNI tile only: with the `madd` tile it made the
        // Qwen3 prefill layer 15% slower here (300 -> 355 ms at T=1024, measured alternating
        // builds; the tile itself ran slower), with the AVX-VNNI tile 7% faster (102 -> 95).
        let (simd, avx2) = (isa().avx512(), isa().avx_vnni());
        let mut out = [[0f32; BLOCK]; MAX_TILE];
        self.tiles(xu, m, first_block, nblocks, |r, mr, b, nb, acc| {
            let rows = &sx[r..r + mr];
            let dst = &mut out[..mr * nb];
            if simd {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa()` detected AVX-512F; `acc` and `dst` hold `mr * nb` tiles,
                // `rows` has `mr` scales and `self.wsum` covers blocks `b..b + nb` (tiles()
                // only hands out whole blocks of this layer).
                unsafe {
                    x86::finish(acc, dst, b, &self.wsum, rows, scale)
                };
            } else if avx2 {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `isa()` detected AVX2; sizes as for the AVX-512 form.
                unsafe {
                    x86::finish_avx2(acc, dst, b, &self.wsum, rows, scale)
                };
            } else {
                finish_scalar(acc, dst, b, &self.wsum, rows, scale);
            }
            for rr in 0..mr {
                for bb in 0..nb {
                    emit(r + rr, b + bb, &dst[rr * nb + bb]);
                }
            }
        });
    }

    /// [`PackedI8::gemm_scaled`] written straight into rows of `out`: feature `j` of row `r`
    /// at `out[r * rs + j - col0]`, for blocks `first_block..first_block + nblocks`, all whole
    /// (their features `col0..`, every one with a scale), inside `out` and, beyond one row,
    /// in rows that do not overlap; `xu` holds `m` rows and `sx` their scales. Returns
    /// `false`, having written nothing, where that does not hold or the CPU lacks AVX-512
    /// (the caller then emits through [`PackedI8::gemm_scaled`]); `true` once every value is
    /// written. Saves the copy of every output block through a tile-sized buffer, ~10% of a
    /// W8A8 prefill layer's time.
    pub fn gemm_scaled_rows(
        &self,
        (xu, m, sx): (&[u8], usize, &[f32]),
        scale: &[f32],
        first_block: usize,
        nblocks: usize,
        (out, rs, col0): (&mut [f32], usize, usize),
    ) -> bool {
        let Some(end) = first_block.checked_add(nblocks) else {
            return false;
        };
        let fits = m > 0
            && sx.len() >= m
            && m.checked_mul(self.k_pad).is_some_and(|need| xu.len() >= need)
            && nblocks > 0
            && end <= self.blocks()
            && first_block * BLOCK >= col0
            && end * BLOCK <= scale.len()
            // (One row has no other row to overlap, whatever its stride.)
            && (m == 1 || rs >= end * BLOCK - col0)
            && (m - 1)
                .checked_mul(rs)
                .and_then(|v| v.checked_add(end * BLOCK - col0))
                .is_some_and(|need| need <= out.len());
        if !fits || !isa().avx512() {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        self.tiles(xu, m, first_block, nblocks, |r, mr, b, _, acc| {
            let at = r * rs + b * BLOCK - col0;
            // SAFETY: `isa()` detected AVX-512F; `acc` holds `mr * nb` tiles, `sx` the rows'
            // scales and `self.wsum` covers blocks `b..b + nb`; `fits` found every row's
            // blocks inside `out` (and `finish_into` checks each store).
            unsafe { x86::finish_into(acc, (out, at, rs), b, &self.wsum, &sx[r..r + mr], scale) };
        });
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (xu, out);
        cfg!(target_arch = "x86_64")
    }

    /// Runs the register tiles over blocks `first_block..first_block + nblocks` and rows
    /// `0..m`, calling `done(row, rows, block, blocks, acc)` with each tile's raw
    /// accumulators `Σ xu * w` (no compensation), `acc[rr * blocks + bb]` for row `row + rr`
    /// and block `block + bb`.
    fn tiles(
        &self,
        xu: &[u8],
        m: usize,
        first_block: usize,
        nblocks: usize,
        mut done: impl FnMut(usize, usize, usize, usize, &mut [[i32; BLOCK]]),
    ) {
        let block_len = self.k_pad * BLOCK;
        let end = (first_block + nblocks).min(self.blocks());
        if xu.len() < m * self.k_pad || first_block >= end {
            return;
        }
        let data = self.bytes();
        if data.len() < end * block_len || self.wsum.len() < end * BLOCK {
            return;
        }
        #[cfg(test)]
        if AMX_MODEL.with(std::cell::Cell::get) > 0
            && m >= super::amx::MIN_ROWS
            && super::amx::tiles(
                &mut super::amx::Model::default(),
                xu,
                m,
                self.k_pad,
                &data[..end * block_len],
                first_block,
                end,
                &mut done,
            )
        {
            AMX_MODEL.with(|c| c.set(c.get() + 1));
            return;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if isa().amx() && m >= super::amx::MIN_ROWS && self.k_pad.is_multiple_of(super::amx::KSTEP)
        {
            // SAFETY: `isa()` reports AMX only after `amx::usable()` found the tiles, the OS
            // permission and a passing hardware self-test in this process.
            let mut hw = unsafe { super::amx::Hw::new() };
            let w = &data[..end * block_len];
            if super::amx::tiles(&mut hw, xu, m, self.k_pad, w, first_block, end, &mut done) {
                super::amx::count_hardware_call();
                return;
            }
        }
        let (use_vnni, use_avx2, use_neon) = (isa().vnni(), isa().avx2_int8(), isa().neon());
        let use_avx_vnni = isa().avx_vnni();
        let mut acc = [[0i32; BLOCK]; TILE_ROWS * TILE_BLOCKS];
        #[cfg(target_arch = "x86_64")]
        let mut chunk_sums: ChunkSums = [[0; BLOCK]; GROUP_PASSES * TILE_ROWS * TILE_BLOCKS];
        #[cfg(target_arch = "x86_64")]
        let passes = m.div_ceil(TILE_ROWS);
        #[cfg(target_arch = "x86_64")]
        let xw = if use_avx2 {
            widen_words(&xu[..m * self.k_pad])
        } else {
            Vec::new()
        };
        let mut b = first_block;
        while b < end {
            let nb = (end - b).min(TILE_BLOCKS);
            #[cfg(target_arch = "x86_64")]
            if use_vnni && nb == TILE_BLOCKS && m > TILE_ROWS && self.k_pad / 4 > CHUNK_QUADS {
                self.chunked_tile(xu, m, b, end, &mut chunk_sums, &mut done);
                b += nb;
                continue;
            }
            let w = &data[b * block_len..(b + nb) * block_len];
            let mut r = 0;
            while r < m {
                let mr = (m - r).min(TILE_ROWS);
                let x = &xu[r * self.k_pad..(r + mr) * self.k_pad];
                let tile = &mut acc[..mr * nb];
                if !use_vnni && !use_avx_vnni {
                    // The VNNI kernels store whole tiles; the others add into them.
                    tile.fill([0; BLOCK]);
                }
                if use_vnni && m <= STREAM_ROWS {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa()` detected AVX-512 VNNI and BW; `x` is `mr` rows of
                    // `k_pad` bytes, `w` is `nb` whole blocks, `tile` has `mr * nb` entries.
                    unsafe {
                        x86::rows_streaming(x, mr, self.k_pad, w, nb, tile)
                    };
                } else if use_vnni {
                    #[cfg(target_arch = "x86_64")]
                    {
                        let pf = if r == 0 {
                            x86::Prefetch::Ahead
                        } else if passes < MIN_PF_PASSES {
                            x86::Prefetch::Nothing
                        } else {
                            // Pass p of the `passes - 1` later passes takes its share of the
                            // next tile's lines (the blocks after this tile, inside `end`).
                            let next = (end - (b + nb)).min(TILE_BLOCKS) * block_len / 64;
                            let share = next.div_ceil(passes - 1);
                            let from = (r / TILE_ROWS - 1) * share;
                            let lines = share.min(next.saturating_sub(from));
                            x86::Prefetch::Next {
                                at: data.as_ptr().wrapping_add((b + nb) * block_len + from * 64),
                                lines,
                            }
                        };
                        // SAFETY: `isa()` detected AVX-512 VNNI and BW; `x` is `mr` rows of
                        // `k_pad` bytes and `w` is `nb` whole blocks of `k_pad * 16` bytes, as
                        // required (prefetch addresses need not be valid).
                        unsafe { x86::tile(x, mr, self.k_pad, w, nb, tile, pf) };
                    }
                } else if use_avx_vnni {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa()` detected AVX2 and AVX-VNNI; the slices are sized as for
                    // the AVX-512 VNNI tile.
                    unsafe {
                        x86::tile_avx_vnni(x, mr, self.k_pad, w, nb, tile)
                    };
                } else if use_avx2 {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `isa()` detected AVX2; `xw` holds rows r..r + mr of `xu` as
                    // words, the other slices are sized as for the VNNI tile.
                    unsafe {
                        let rows = &xw[r * self.k_pad..(r + mr) * self.k_pad];
                        x86::tile_avx2_words(rows, mr, self.k_pad, w, nb, tile)
                    };
                } else if use_neon {
                    #[cfg(target_arch = "aarch64")]
                    neon::tile(x, mr, self.k_pad, w, nb, tile);
                } else {
                    tile_scalar(x, mr, self.k_pad, w, nb, tile);
                }
                done(r, mr, b, nb, tile);
                r += mr;
            }
            b += nb;
        }
        #[cfg(target_arch = "x86_64")]
        super::spare::give(xw);
    }
}

impl PackedI8 {
    /// The VNNI register tiles of blocks `b..b + TILE_BLOCKS` (inside `..end`) over rows
    /// `0..m`, as [`PackedI8::tiles`] hands them to `done`, with the depth cut into chunks of
    /// `CHUNK_QUADS` quads: up to `GROUP_PASSES` row passes run over one chunk while it is in
    /// L1, keeping their partial sums in a buffer, before the next chunk. The first group's
    /// first pass over a chunk reads it from memory (prefetching its streams ahead); with
    /// `MIN_PF_PASSES` row passes or more, the others bring the next tile into L2 in shares.
    #[cfg(target_arch = "x86_64")]
    fn chunked_tile(
        &self,
        xu: &[u8],
        m: usize,
        b: usize,
        end: usize,
        store: &mut ChunkSums,
        done: &mut impl FnMut(usize, usize, usize, usize, &mut [[i32; BLOCK]]),
    ) {
        use x86::{Depth, Prefetch};
        let nb = TILE_BLOCKS;
        let k_pad = self.k_pad;
        let block_len = k_pad * BLOCK;
        let quads = k_pad / 4;
        let chunks = quads.div_ceil(CHUNK_QUADS);
        let data = self.bytes();
        let w = &data[b * block_len..(b + nb) * block_len];
        let group_rows = GROUP_PASSES * TILE_ROWS;
        let groups = m.div_ceil(group_rows);
        let passes_all = m.div_ceil(TILE_ROWS);
        // The next tile's lines (the blocks after this tile, inside `end`) go to L2 in equal
        // shares over every chunk pass but the first group's first passes, which read this
        // tile from memory: as the full-depth passes share them, so the DRAM stream stays
        // even across the tile instead of bursting in its first group.
        let next = (end - (b + nb)).min(TILE_BLOCKS) * block_len / 64;
        let slots = chunks * (passes_all - 1);
        let share = if passes_all < MIN_PF_PASSES {
            0
        } else {
            next.div_ceil(slots.max(1))
        };
        let mut slot = 0;
        for g in 0..groups {
            let r0 = g * group_rows;
            let rows = (m - r0).min(group_rows);
            let passes = rows.div_ceil(TILE_ROWS);
            for c in 0..chunks {
                let depth = c * CHUNK_QUADS..((c + 1) * CHUNK_QUADS).min(quads);
                for p in 0..passes {
                    let r = r0 + p * TILE_ROWS;
                    let mr = (r0 + rows - r).min(TILE_ROWS);
                    let pf = if g == 0 && p == 0 {
                        Prefetch::Ahead
                    } else {
                        let from = slot * share;
                        slot += 1;
                        Prefetch::Next {
                            at: data.as_ptr().wrapping_add((b + nb) * block_len + from * 64),
                            lines: share.min(next.saturating_sub(from)),
                        }
                    };
                    let x = &xu[r * k_pad..(r + mr) * k_pad];
                    let tile = &mut store[p * TILE_ROWS * nb..(p * TILE_ROWS + mr) * nb];
                    let depth = Depth {
                        quads: depth.clone(),
                        add: c > 0,
                    };
                    // SAFETY: the caller found AVX-512 VNNI (`isa().vnni()`); `x` is `mr <= 6`
                    // rows of `k_pad` bytes, `w` 4 whole blocks, `tile` `mr * 4` entries and
                    // the quads end at `k_pad / 4` (prefetch addresses need not be valid).
                    unsafe { x86::tile4_part(x, mr, k_pad, w, tile, pf, depth) };
                }
            }
            for p in 0..passes {
                let r = r0 + p * TILE_ROWS;
                let mr = (r0 + rows - r).min(TILE_ROWS);
                done(
                    r,
                    mr,
                    b,
                    nb,
                    &mut store[p * TILE_ROWS * nb..(p * TILE_ROWS + mr) * nb],
                );
            }
        }
    }
}

/// The inputs zero-extended to words, as `x86::tile_avx2_words` takes them: once per GEMM
/// (every block reads them again), so that each quad's broadcast is one load, with no
/// widening in the inner loop. In a spare buffer of this thread (give it back).
#[cfg(target_arch = "x86_64")]
fn widen_words(xu: &[u8]) -> Vec<u16> {
    let mut xw = super::spare::take_empty(xu.len());
    xw.extend(xu.iter().map(|&v| u16::from(v)));
    xw
}

/// The scalar reference of the W8A8 epilogue for a tile of `sx.len()` rows and
/// `acc.len() / sx.len()` blocks from block `b`: `out[rr * nb + bb][l] =
/// f32(acc - 128 * wsum[j]) * sx[rr] * scale[j]` for feature `j = 16 * (b + bb) + l`, with
/// scale 0 where `scale` has no entry `j`.
pub fn finish_scalar(
    acc: &[[i32; BLOCK]],
    out: &mut [[f32; BLOCK]],
    b: usize,
    wsum: &[i32],
    sx: &[f32],
    scale: &[f32],
) {
    let (mr, nb) = (sx.len(), acc.len().checked_div(sx.len()).unwrap_or(0));
    for rr in 0..mr {
        for bb in 0..nb {
            let j0 = (b + bb) * BLOCK;
            for l in 0..BLOCK {
                let v = acc[rr * nb + bb][l] - 128 * wsum[j0 + l];
                let ws = scale.get(j0 + l).copied().unwrap_or(0.0);
                out[rr * nb + bb][l] = v as f32 * sx[rr] * ws;
            }
        }
    }
}

#[cfg(test)]
thread_local! {
    /// Tests only: when nonzero, this thread's int8 GEMMs take the AMX path on the
    /// instruction model ([`super::amx::Model`]) where the hardware path would apply (so that
    /// the path's hand-off to the epilogue is tested on CPUs without AMX), and count up by one
    /// per GEMM that took it.
    static AMX_MODEL: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// One (row, block) of raw accumulators: `(row, block, lanes)`.
pub type Accumulator = (usize, usize, [i32; BLOCK]);

/// The scalar reference's raw accumulators `Σ xu * w` (no compensation) of rows `0..m` and
/// blocks `0..blocks` of packed weights `w`, as `(row, block, lanes)` in row, then block,
/// order: what the AMX tiles are checked against (their self-test and tests). Empty when the
/// slices are shorter than that.
pub fn reference_accumulators(
    xu: &[u8],
    m: usize,
    k_pad: usize,
    w: &[i8],
    blocks: usize,
) -> Vec<Accumulator> {
    let block_len = k_pad * BLOCK;
    if xu.len() < m * k_pad || w.len() < blocks * block_len {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(m * blocks);
    for r in 0..m {
        for b in 0..blocks {
            let mut acc = [[0i32; BLOCK]; 1];
            let (x, blk) = (
                &xu[r * k_pad..(r + 1) * k_pad],
                &w[b * block_len..(b + 1) * block_len],
            );
            tile_scalar(x, 1, k_pad, blk, 1, &mut acc);
            out.push((r, b, acc[0]));
        }
    }
    out
}

/// The scalar reference tile: `out[r * nb + b][l] = Σ_i xu[r, i] * w_b[i, l]` (u8 x i8, int32).
pub fn tile_scalar(
    xu: &[u8],
    mr: usize,
    k_pad: usize,
    w: &[i8],
    nb: usize,
    out: &mut [[i32; BLOCK]],
) {
    let block_len = k_pad * BLOCK;
    for r in 0..mr {
        let x = &xu[r * k_pad..(r + 1) * k_pad];
        for b in 0..nb {
            let blk = &w[b * block_len..(b + 1) * block_len];
            let o = &mut out[r * nb + b];
            for (quad, xs) in x.chunks_exact(4).enumerate() {
                let wq = &blk[quad * 64..quad * 64 + 64];
                for (l, ol) in o.iter_mut().enumerate() {
                    for t in 0..4 {
                        *ol += i32::from(xs[t]) * i32::from(wq[l * 4 + t]);
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::BLOCK;

    /// How far ahead (bytes) each weight stream is prefetched.
    const PF_DIST: usize = 1024;

    /// What a VNNI tile prefetches while it computes. A tile's first pass over its weights
    /// reads them from DRAM, so it prefetches its own streams `PF_DIST` ahead; later passes
    /// (more rows over the same weights, read from L2; from `MIN_PF_PASSES` passes) prefetch
    /// a share of the next tile's weights into L2, so that its first pass finds them there.
    #[derive(Clone, Copy, Debug)]
    pub enum Prefetch {
        Ahead,
        /// `lines` cache lines from `at`.
        Next {
            at: *const i8,
            lines: usize,
        },
        Nothing,
    }

    /// The quads (groups of 4 inputs) a register tile covers, and whether it adds to the
    /// accumulators in `out` (a later depth chunk) or starts from zero.
    #[derive(Clone, Debug)]
    pub struct Depth {
        pub quads: std::ops::Range<usize>,
        pub add: bool,
    }

    impl Depth {
        fn full(k_pad: usize) -> Self {
            Depth {
                quads: 0..k_pad / 4,
                add: false,
            }
        }
    }

    /// The `mr x 4` register tile (`1 <= mr <= 6`) over the quads of `depth` only.
    ///
    /// # Safety
    /// As [`tile`] with `nb == 4`, and `depth.quads.end <= k_pad / 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile4_part(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        out: &mut [[i32; BLOCK]],
        pf: Prefetch,
        depth: Depth,
    ) {
        // SAFETY: the caller's contract is each kernel's contract (all arms).
        unsafe {
            match mr {
                1 => kernel::<1, 4>(xu, k_pad, w, out, pf, depth),
                2 => kernel::<2, 4>(xu, k_pad, w, out, pf, depth),
                3 => kernel::<3, 4>(xu, k_pad, w, out, pf, depth),
                4 => kernel::<4, 4>(xu, k_pad, w, out, pf, depth),
                5 => kernel::<5, 4>(xu, k_pad, w, out, pf, depth),
                _ => kernel::<6, 4>(xu, k_pad, w, out, pf, depth),
            }
        }
    }
    use std::arch::x86_64::*;

    /// Dispatches a `mr x nb` tile to its monomorphic kernel.
    ///
    /// # Safety
    /// The CPU supports AVX-512 VNNI and BW; `xu.len() >= mr * k_pad`, `k_pad % 4 == 0`,
    /// `w.len() >= nb * k_pad * 16`, `out.len() >= mr * nb`, `1 <= mr <= 6`, `1 <= nb <= 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn tile(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
        pf: Prefetch,
    ) {
        let full = Depth::full(k_pad);
        // SAFETY: the caller's contract is exactly each kernel's contract (all arms).
        unsafe {
            match (mr, nb) {
                (1..=6, 4) => tile4_part(xu, mr, k_pad, w, out, pf, full),
                (1, 1) => kernel::<1, 1>(xu, k_pad, w, out, pf, full),
                (1, 2) => kernel::<1, 2>(xu, k_pad, w, out, pf, full),
                (1, 3) => kernel::<1, 3>(xu, k_pad, w, out, pf, full),
                (r, 1) => kernel_rows::<1>(xu, r, k_pad, w, out, pf),
                (r, 2) => kernel_rows::<2>(xu, r, k_pad, w, out, pf),
                (r, _) => kernel_rows::<3>(xu, r, k_pad, w, out, pf),
            }
        }
    }

    /// The AVX2 tile (CPUs without VNNI): codes widened to int16 and multiplied with `madd`,
    /// which cannot saturate (|u8 x i8| * 2 < 2^31), so the sums equal the scalar reference.
    /// Each 64-byte quad of a block is four registers of 4 features x 4 inputs; `madd` leaves
    /// two partial sums per feature, added at the end. (The GEMM widens its inputs once per
    /// call and runs [`tile_avx2_words`]; this form, with the other tiles' signature, is the
    /// tests'.)
    ///
    /// # Safety
    /// The CPU supports AVX2; `xu.len() >= mr * k_pad`, `k_pad % 4 == 0`,
    /// `w.len() >= nb * k_pad * 16`, `out.len() >= mr * nb`.
    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    pub unsafe fn tile_avx2(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
    ) {
        let xw = super::widen_words(&xu[..mr * k_pad]);
        // SAFETY: the caller's contract, with `xw` the same rows as words.
        unsafe { tile_avx2_words(&xw, mr, k_pad, w, nb, out) }
    }

    /// [`tile_avx2`] on inputs already widened by [`super::widen_words`].
    ///
    /// # Safety
    /// As [`tile_avx2`], with `xw.len() >= mr * k_pad`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn tile_avx2_words(
        xw: &[u16],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
    ) {
        for b in 0..nb {
            let mut r = 0;
            while r < mr {
                let at = Rows { r, b, nb };
                // SAFETY: rows r..r + 1 or r + 2 (<= mr) lie in `xw`, block b in `w`, and their
                // outputs in `out` (the caller's contract, b < nb).
                unsafe {
                    // (A last single row is never a block's first pair of more than two.)
                    match (mr - r >= 2, r == 0 && mr > 2) {
                        (true, true) => rows_avx2::<2, true>(xw, k_pad, w, out, at),
                        (true, false) => rows_avx2::<2, false>(xw, k_pad, w, out, at),
                        (false, _) => rows_avx2::<1, false>(xw, k_pad, w, out, at),
                    }
                }
                r += 2;
            }
        }
    }

    /// `MR` (1 or 2) rows of one block, full depth, for [`tile_avx2`]: the row count fixed at
    /// compile time, so both rows' products interleave with no test per quad. With more than
    /// two rows, the first pair of a block (`FIRST`) reads it from memory for the others: the
    /// blocks of a call follow each other, so it prefetches each line twice ahead
    /// (`kernels::prefetch_stream`). Alternated call by call on a 2-core Zen 3 (AVX2, no
    /// VNNI; medians of 20 cold calls), Qwen3 W8A8 T=128 47.4 / 48.4 / 49.9 ms against 51.8 /
    /// 53.4 / 52.4, DeepSeek-V2-Lite 61.0 against 63.7, T=1024 335 against 338. At one or two
    /// rows it cost 2-4% (T=16 16.0 / 15.3 against 15.3 / 15.0 ms), so they run without it.
    ///
    /// # Safety
    /// AVX2; rows `at.r..at.r + MR` lie in `xw` (`k_pad` words each), block `at.b` in `w`
    /// (`k_pad * 16` codes), and `out[row * at.nb + at.b]` for those rows in `out`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn rows_avx2<const MR: usize, const FIRST: bool>(
        xw: &[u16],
        k_pad: usize,
        w: &[i8],
        out: &mut [[i32; BLOCK]],
        at: Rows,
    ) {
        let Rows { r, b, nb } = at;
        let wp = w.as_ptr().wrapping_add(b * k_pad * BLOCK);
        let xp = xw.as_ptr().wrapping_add(r * k_pad);
        let mut acc = [[_mm256_setzero_si256(); 4]; MR];
        for quad in 0..k_pad / 4 {
            if FIRST {
                crate::cpu::kernels::prefetch_stream(wp.wrapping_add(quad * 64));
            }
            let mut wq = [_mm256_setzero_si256(); 4];
            for (c, v) in wq.iter_mut().enumerate() {
                // SAFETY: quad < k_pad / 4: the 16 bytes at this offset lie inside block b of
                // `w` (the contract).
                *v = unsafe {
                    _mm256_cvtepi8_epi16(_mm_loadu_si128(wp.add(quad * 64 + c * 16).cast()))
                };
            }
            for (rr, a) in acc.iter_mut().enumerate() {
                // The row's 4 inputs as words, repeated over the register: one broadcast
                // load (assembling the pattern in scalar registers took ~12 instructions).
                // SAFETY: rr < MR and 4 * quad + 4 <= k_pad: the 8 bytes lie inside row
                // r + rr of `xw` (the contract).
                let x4 = unsafe { xp.add(rr * k_pad + 4 * quad).cast::<i64>().read_unaligned() };
                let vx = _mm256_set1_epi64x(x4);
                for (c, lanes) in a.iter_mut().enumerate() {
                    *lanes = _mm256_add_epi32(*lanes, _mm256_madd_epi16(wq[c], vx));
                }
            }
        }
        for (rr, a) in acc.iter().enumerate() {
            let o = &mut out[(r + rr) * nb + b];
            for (c, lanes) in a.iter().enumerate() {
                let mut pairs = [0i32; 8];
                // SAFETY: `pairs` is 32 bytes, one unaligned 256-bit store.
                unsafe { _mm256_storeu_si256(pairs.as_mut_ptr().cast(), *lanes) };
                for f in 0..4 {
                    o[c * 4 + f] = pairs[2 * f] + pairs[2 * f + 1];
                }
            }
        }
    }

    /// The AVX-VNNI tile (AVX2 CPUs with the VEX-encoded `vpdpbusd`, such as Intel's client
    /// cores since Alder Lake): a block's 64-byte quad is two 256-bit operands (features 0-7
    /// and 8-15), and up to 6 rows of one block run at a time (12 accumulators, 2 weight
    /// registers and a broadcast: 15 of the 16 registers). Stores whole tiles.
    ///
    /// # Safety
    /// The CPU supports AVX2 and AVX-VNNI; `xu.len() >= mr * k_pad`, `k_pad % 4 == 0`,
    /// `w.len() >= nb * k_pad * 16`, `out.len() >= mr * nb`.
    #[target_feature(enable = "avx2,avxvnni")]
    pub unsafe fn tile_avx_vnni(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
    ) {
        for b in 0..nb {
            let mut r = 0;
            while r < mr {
                let rows = (mr - r).min(6);
                let at = Rows { r, b, nb };
                // SAFETY: rows r..r + rows lie in `xu`, block b in `w`, and their outputs
                // in `out` (caller's contract, r + rows <= mr, b < nb).
                unsafe {
                    match rows {
                        1 => rows_avx_vnni::<1>(xu, k_pad, w, out, at),
                        2 => rows_avx_vnni::<2>(xu, k_pad, w, out, at),
                        3 => rows_avx_vnni::<3>(xu, k_pad, w, out, at),
                        4 => rows_avx_vnni::<4>(xu, k_pad, w, out, at),
                        5 => rows_avx_vnni::<5>(xu, k_pad, w, out, at),
                        _ => rows_avx_vnni::<6>(xu, k_pad, w, out, at),
                    }
                }
                r += rows;
            }
        }
    }

    /// Which rows and block [`rows_avx_vnni`] or [`rows_avx2`] computes: rows `r..r + MR` of
    /// block `b`, whose outputs go to `out[row * nb + b]`.
    #[derive(Clone, Copy)]
    struct Rows {
        r: usize,
        b: usize,
        nb: usize,
    }

    /// `MR` rows of one block, full depth, with 256-bit `vpdpbusd`.
    ///
    /// # Safety
    /// The CPU supports AVX2 and AVX-VNNI; rows `at.r..at.r + MR` of `xu` (`k_pad` bytes
    /// each, `k_pad % 4 == 0`), block `at.b` of `w` and entries `row * at.nb + at.b` of `out`
    /// for those rows are in bounds.
    #[target_feature(enable = "avx2,avxvnni")]
    #[inline]
    unsafe fn rows_avx_vnni<const MR: usize>(
        xu: &[u8],
        k_pad: usize,
        w: &[i8],
        out: &mut [[i32; BLOCK]],
        at: Rows,
    ) {
        let mut acc = [[_mm256_setzero_si256(); 2]; MR];
        let wp = w.as_ptr().wrapping_add(at.b * k_pad * BLOCK);
        let xp = xu.as_ptr().wrapping_add(at.r * k_pad);
        for quad in 0..k_pad / 4 {
            // SAFETY: quad < k_pad / 4, so both 32-byte halves of this quad's 64 bytes lie in
            // block `at.b` of `w` (caller's contract).
            let (w0, w1) = unsafe {
                (
                    _mm256_loadu_si256(wp.add(quad * 64).cast()),
                    _mm256_loadu_si256(wp.add(quad * 64 + 32).cast()),
                )
            };
            for (r, lanes) in acc.iter_mut().enumerate() {
                // SAFETY: r < MR and 4 * quad + 4 <= k_pad: the 4 bytes lie in row at.r + r
                // of `xu`; read_unaligned has no alignment requirement.
                let a = unsafe {
                    _mm256_set1_epi32(xp.add(r * k_pad + 4 * quad).cast::<i32>().read_unaligned())
                };
                lanes[0] = _mm256_dpbusd_avx_epi32(lanes[0], a, w0);
                lanes[1] = _mm256_dpbusd_avx_epi32(lanes[1], a, w1);
            }
        }
        for (r, lanes) in acc.iter().enumerate() {
            let o = &mut out[(at.r + r) * at.nb + at.b];
            // SAFETY: `o` is 16 i32 = 64 bytes: two unaligned 256-bit stores.
            unsafe {
                _mm256_storeu_si256(o.as_mut_ptr().cast(), lanes[0]);
                _mm256_storeu_si256(o.as_mut_ptr().add(8).cast(), lanes[1]);
            }
        }
    }

    /// The AVX-512 W8A8 epilogue, lane for lane the arithmetic of
    /// [`super::finish_scalar`] (`vcvtdq2ps` rounds to nearest as `as f32` does; the two
    /// multiplies in the same order).
    ///
    /// # Safety
    /// The CPU supports AVX-512F; with `mr = sx.len()` rows and `nb = acc.len() / mr`
    /// blocks: `acc` holds `mr * nb` tiles and `wsum.len() >= 16 * (b + nb)`. (An `out`
    /// shorter than `acc` is safe: the entries past its end are not written.)
    #[target_feature(enable = "avx512f")]
    pub unsafe fn finish(
        acc: &[[i32; BLOCK]],
        out: &mut [[f32; BLOCK]],
        b: usize,
        wsum: &[i32],
        sx: &[f32],
        scale: &[f32],
    ) {
        let nb = acc.len().checked_div(sx.len()).unwrap_or(0);
        // SAFETY: the caller's contract; row rr, block bb lands at 16 (rr nb + bb), entry
        // rr * nb + bb of `out`.
        unsafe {
            finish_into(
                acc,
                (out.as_flattened_mut(), 0, nb * BLOCK),
                b,
                wsum,
                sx,
                scale,
            )
        }
    }

    /// [`finish`] with its output rows `rs` values apart in `out`, from `at`: row `rr`, block
    /// `bb` of the tile is `out[at + rr * rs + 16 bb..][..16]` (a whole block each).
    ///
    /// # Safety
    /// As [`finish`]. Every store is checked: a block that would end past `out`'s end is
    /// not written (so a caller that needs every value written makes room for `at + (mr - 1)
    /// * rs + 16 nb` values).
    #[target_feature(enable = "avx512f")]
    pub unsafe fn finish_into(
        acc: &[[i32; BLOCK]],
        (out, at, rs): (&mut [f32], usize, usize),
        b: usize,
        wsum: &[i32],
        sx: &[f32],
        scale: &[f32],
    ) {
        let (mr, nb) = (sx.len(), acc.len().checked_div(sx.len()).unwrap_or(0));
        let bias = _mm512_set1_epi32(128);
        for bb in 0..nb {
            let j0 = (b + bb) * BLOCK;
            // Lanes with a scale: all 16, or the tail of the last block.
            let valid = scale.len().saturating_sub(j0).min(BLOCK);
            let mask: __mmask16 = ((1u32 << valid) - 1) as __mmask16;
            // SAFETY: the masked load touches only the `valid` entries from j0, which lie
            // in `scale`; wsum has 16 entries from j0 (caller's contract).
            let (ws, sums) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, scale.as_ptr().wrapping_add(j0)),
                    _mm512_loadu_si512(wsum.as_ptr().add(j0).cast()),
                )
            };
            let comp = _mm512_mullo_epi32(sums, bias);
            for (rr, &s) in sx.iter().enumerate().take(mr) {
                let t = rr * nb + bb;
                let Some(dst) = out
                    .get_mut(at + rr * rs + bb * BLOCK..)
                    .and_then(|d| d.get_mut(..BLOCK))
                else {
                    continue;
                };
                // SAFETY: t < mr * nb <= acc.len(), an entry of 64 bytes; `dst` is 16 f32.
                unsafe {
                    let v = _mm512_sub_epi32(_mm512_loadu_si512(acc[t].as_ptr().cast()), comp);
                    let f =
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(s)), ws);
                    _mm512_storeu_ps(dst.as_mut_ptr(), f);
                }
            }
        }
    }

    /// The AVX2 W8A8 epilogue (with the AVX-VNNI tile): [`finish`] on two halves of 8
    /// lanes, the same operations in the same order.
    ///
    /// # Safety
    /// The CPU supports AVX2; as [`finish`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn finish_avx2(
        acc: &[[i32; BLOCK]],
        out: &mut [[f32; BLOCK]],
        b: usize,
        wsum: &[i32],
        sx: &[f32],
        scale: &[f32],
    ) {
        let (mr, nb) = (sx.len(), acc.len().checked_div(sx.len()).unwrap_or(0));
        let bias = _mm256_set1_epi32(128);
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        for bb in 0..nb {
            for half in 0..2 {
                let j0 = (b + bb) * BLOCK + 8 * half;
                // Lanes with a scale: all 8, or the tail of the last block (maybe none).
                let valid = scale.len().saturating_sub(j0).min(8) as i32;
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lane);
                // SAFETY: the masked load touches only the `valid` entries from j0, which lie
                // in `scale`; wsum has 16 entries from the block's start (caller's contract).
                let (ws, sums) = unsafe {
                    (
                        _mm256_maskload_ps(scale.as_ptr().wrapping_add(j0), mask),
                        _mm256_loadu_si256(wsum.as_ptr().add(j0).cast()),
                    )
                };
                let comp = _mm256_mullo_epi32(sums, bias);
                for (rr, &s) in sx.iter().enumerate().take(mr) {
                    let t = rr * nb + bb;
                    // SAFETY: t < mr * nb <= acc.len(), out.len(); each entry is 16 values,
                    // and this half's 8 start at 8 * half.
                    unsafe {
                        let v = _mm256_sub_epi32(
                            _mm256_loadu_si256(acc[t].as_ptr().add(8 * half).cast()),
                            comp,
                        );
                        let f = _mm256_mul_ps(
                            _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s)),
                            ws,
                        );
                        _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * half), f);
                    }
                }
            }
        }
    }

    /// `mr` (1 or 2) rows of `nb` blocks, the blocks one after another: each block is one
    /// contiguous run and the blocks of a call follow each other in memory, so this reads a
    /// single stream, each line prefetched twice ahead of its use (`kernels::prefetch_stream`:
    /// into L1 and, farther on, into L2). Four accumulators per row over interleaved quads
    /// keep `vpdpbusd`'s latency hidden; integer sums do not depend on their order, so the
    /// results equal the scalar tile's exactly.
    ///
    /// # Safety
    /// As [`tile`]; `mr <= 2`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn rows_streaming(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
    ) {
        debug_assert!(
            matches!(mr, 1 | 2),
            "rows_streaming takes 1 or 2 rows, got {mr}"
        );
        // SAFETY: the caller's contract, with mr rows (1 or 2).
        unsafe {
            if mr >= 2 {
                stream::<2>(xu, k_pad, w, nb, out);
            } else {
                stream::<1>(xu, k_pad, w, nb, out);
            }
        }
    }

    /// [`rows_streaming`] for `MR` rows.
    ///
    /// # Safety
    /// As [`tile`] with `mr == MR`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn stream<const MR: usize>(
        xu: &[u8],
        k_pad: usize,
        w: &[i8],
        nb: usize,
        out: &mut [[i32; BLOCK]],
    ) {
        let block_len = k_pad * BLOCK;
        let quads = k_pad / 4;
        let xp = xu.as_ptr();
        for b in 0..nb {
            let wp = w.as_ptr().wrapping_add(b * block_len);
            let mut acc = [[_mm512_setzero_si512(); 4]; MR];
            // One quad: its 64 weight bytes times each row's 4 activations, into partial u.
            let step = |acc: &mut [[__m512i; 4]; MR], q: usize, u: usize| {
                // SAFETY: q < quads: the 64 bytes at q * 64 lie in block b of `w` (b < nb,
                // w.len() >= nb * block_len) and the 4 bytes at 4 q in each of the MR rows of
                // `xu` (xu.len() >= MR * k_pad); read_unaligned has no alignment requirement.
                unsafe {
                    let wv = _mm512_loadu_si512(wp.add(q * 64).cast());
                    for (r, row) in acc.iter_mut().enumerate() {
                        let x = xp.add(r * k_pad + 4 * q).cast::<i32>().read_unaligned();
                        row[u] = _mm512_dpbusd_epi32(row[u], _mm512_set1_epi32(x), wv);
                    }
                }
            };
            let mut q = 0;
            while q + 4 <= quads {
                for l in 0..4 {
                    crate::cpu::kernels::prefetch_stream(wp.wrapping_add((q + l) * 64));
                }
                for u in 0..4 {
                    step(&mut acc, q + u, u);
                }
                q += 4;
            }
            while q < quads {
                step(&mut acc, q, 0);
                q += 1;
            }
            for (r, row) in acc.iter().enumerate() {
                let sum = _mm512_add_epi32(
                    _mm512_add_epi32(row[0], row[1]),
                    _mm512_add_epi32(row[2], row[3]),
                );
                // SAFETY: r * nb + b < MR * nb <= out.len(); each entry is 64 bytes.
                unsafe { _mm512_storeu_si512(out[r * nb + b].as_mut_ptr().cast(), sum) };
            }
        }
    }

    /// Leftover blocks (fewer than 4) with several rows: one row at a time.
    ///
    /// # Safety
    /// As [`tile`] with `nb == NB`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn kernel_rows<const NB: usize>(
        xu: &[u8],
        mr: usize,
        k_pad: usize,
        w: &[i8],
        out: &mut [[i32; BLOCK]],
        pf: Prefetch,
    ) {
        for r in 0..mr {
            // SAFETY: row r of `xu` is in bounds (r < mr); `w` holds NB blocks; `out` has the
            // NB entries of row r.
            unsafe {
                kernel::<1, NB>(
                    &xu[r * k_pad..(r + 1) * k_pad],
                    k_pad,
                    w,
                    &mut out[r * NB..(r + 1) * NB],
                    if r == 0 { pf } else { Prefetch::Nothing },
                    Depth::full(k_pad),
                )
            };
        }
    }

    /// `MR` activation rows x `NB` blocks of 16 features over the quads of `depth`.
    ///
    /// # Safety
    /// The CPU supports AVX-512 VNNI and BW; `xu.len() >= MR * k_pad`, `k_pad % 4 == 0`,
    /// `w.len() >= NB * k_pad * 16`, `out.len() >= MR * NB`, `depth.quads.end <= k_pad / 4`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn kernel<const MR: usize, const NB: usize>(
        xu: &[u8],
        k_pad: usize,
        w: &[i8],
        out: &mut [[i32; BLOCK]],
        pf: Prefetch,
        depth: Depth,
    ) {
        let block_len = k_pad * BLOCK;
        let mut acc = [[_mm512_setzero_si512(); NB]; MR];
        if depth.add {
            for (r, row) in acc.iter_mut().enumerate() {
                for (b, lanes) in row.iter_mut().enumerate() {
                    // SAFETY: r * NB + b < MR * NB <= out.len(); each entry is 64 bytes.
                    *lanes = unsafe { _mm512_loadu_si512(out[r * NB + b].as_ptr().cast()) };
                }
            }
        }
        let wp = w.as_ptr();
        let xp = xu.as_ptr();
        let (ahead, next, lines) = match pf {
            Prefetch::Ahead => (true, wp, 0),
            Prefetch::Next { at, lines } => (false, at, lines),
            Prefetch::Nothing => (false, wp, 0),
        };
        let first_quad = depth.quads.start;
        for quad in depth.quads {
            let mut wv = [_mm512_setzero_si512(); NB];
            for (b, v) in wv.iter_mut().enumerate() {
                let at = b * block_len + quad * 64;
                // A prefetch never faults, and `wrapping_add` makes the address without
                // claiming it is in bounds.
                if ahead {
                    // Sixteen cache lines ahead in the same stream keeps several misses in
                    // flight per stream when the weights come from DRAM.
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(at + PF_DIST).cast());
                } else if (quad - first_quad) * NB + b < lines {
                    let line = (quad - first_quad) * NB + b;
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(line * 64).cast());
                }
                // SAFETY: b < NB and quad < k_pad / 4, so the 64 bytes at `at` lie inside
                // block b of `w` (w.len() >= NB * block_len).
                *v = unsafe { _mm512_loadu_si512(wp.add(at).cast()) };
            }
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: r < MR and 4 * quad + 4 <= k_pad: the 4 bytes read lie in row r of
                // `xu` (xu.len() >= MR * k_pad); read_unaligned has no alignment requirement.
                let a = unsafe {
                    _mm512_set1_epi32(xp.add(r * k_pad + 4 * quad).cast::<i32>().read_unaligned())
                };
                for (b, lanes) in row.iter_mut().enumerate() {
                    *lanes = _mm512_dpbusd_epi32(*lanes, a, wv[b]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (b, lanes) in row.iter().enumerate() {
                // SAFETY: r * NB + b < MR * NB <= out.len(); each entry is 16 i32 = 64 bytes.
                unsafe {
                    _mm512_storeu_si512(out[r * NB + b].as_mut_ptr().cast(), *lanes);
                }
            }
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::BLOCK;
    use std::arch::aarch64::*;

    /// The NEON tile: `out[r * nb + b][l] = Σ_i xu[r, i] * w_b[i, l]`, as [`super::tile_scalar`].
    /// Activations are used signed (`xu - 128`, exact in i8): `smull` gives exact int16
    /// products of 4 features x 4 inputs at a time, pairwise widening adds fold them into int32,
    /// and `128 * Σ w` is added back at the end so the result is the u8 form the caller expects.
    /// Checked against the scalar tile under qemu (`make check-aarch64`).
    pub fn tile(xu: &[u8], mr: usize, k_pad: usize, w: &[i8], nb: usize, out: &mut [[i32; BLOCK]]) {
        let block_len = k_pad * BLOCK;
        let quads = k_pad / 4;
        if xu.len() < mr * k_pad || w.len() < nb * block_len || out.len() < mr * nb {
            return;
        }
        for b in 0..nb {
            let blk = &w[b * block_len..(b + 1) * block_len];
            // Σ w per feature, for the u8 form.
            let mut wsum = [0i32; BLOCK];
            for quad in blk.chunks_exact(64) {
                for (l, s) in wsum.iter_mut().enumerate() {
                    *s += quad[l * 4..l * 4 + 4]
                        .iter()
                        .map(|&v| i32::from(v))
                        .sum::<i32>();
                }
            }
            for r in 0..mr {
                let x = &xu[r * k_pad..(r + 1) * k_pad];
                // SAFETY: NEON is part of the aarch64 baseline; every load reads 16 bytes inside
                // `blk` (quad * 64 + 16 * v + 16 <= quads * 64 = blk.len()) and every store
                // writes 4 lanes inside `lanes` (16 i32).
                unsafe {
                    let zero = vdupq_n_s32(0);
                    // acc[v][h]: features 4v + 2h, 4v + 2h + 1, two partial sums each.
                    let mut acc = [[zero; 2]; 4];
                    for q in 0..quads {
                        let word = u32::from_le_bytes([
                            x[4 * q],
                            x[4 * q + 1],
                            x[4 * q + 2],
                            x[4 * q + 3],
                        ]) ^ 0x8080_8080;
                        let xv = vreinterpretq_s8_u32(vdupq_n_u32(word));
                        for (v, a) in acc.iter_mut().enumerate() {
                            let wv = vld1q_s8(blk.as_ptr().add(q * 64 + v * 16));
                            let lo = vmull_s8(vget_low_s8(wv), vget_low_s8(xv));
                            let hi = vmull_high_s8(wv, xv);
                            a[0] = vaddq_s32(a[0], vpaddlq_s16(lo));
                            a[1] = vaddq_s32(a[1], vpaddlq_s16(hi));
                        }
                    }
                    let lanes = &mut out[r * nb + b];
                    for (v, a) in acc.iter().enumerate() {
                        let sums = vpaddq_s32(a[0], a[1]);
                        vst1q_s32(lanes.as_mut_ptr().add(4 * v), sums);
                    }
                    for (o, s) in lanes.iter_mut().zip(wsum) {
                        *o += 128 * s;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::xorshift;
    use proptest::prelude::*;

    fn scalar_dot(x: &[i8], w: &[i8]) -> i32 {
        x.iter()
            .zip(w)
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum()
    }

    proptest! {
        /// Every tile shape of the dispatched kernel equals the plain int32 dot product.
        #[test]
        fn gemm_equals_scalar(m in 0usize..15, n in 1usize..90, k in 0usize..150,
                              first in 0usize..3, seed in any::<u64>()) {
            let mut rng = xorshift(seed | 1);
            let mut next = || rng() as i8;
            let x: Vec<i8> = (0..m * k).map(|_| next()).collect();
            let w: Vec<i8> = (0..n * k).map(|_| next()).collect();
            let p = PackedI8::pack(&w, n, k);
            for j in 0..n {
                prop_assert_eq!(p.row(j), w[j * k..(j + 1) * k].to_vec());
            }
            let mut xu = vec![128u8; m * p.k_pad];
            for r in 0..m {
                for i in 0..k {
                    xu[r * p.k_pad + i] = (x[r * k + i] as u8) ^ 0x80;
                }
            }
            let first = first.min(p.blocks() - 1);
            let mut seen = vec![false; m * n];
            p.gemm(&xu, m, first, p.blocks(), |r, b, acc| {
                for (l, &v) in acc.iter().enumerate() {
                    let j = b * BLOCK + l;
                    if j < n {
                        assert_eq!(v, scalar_dot(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]));
                        seen[r * n + j] = true;
                    } else {
                        assert_eq!(v, 0);
                    }
                }
            });
            for r in 0..m {
                for j in 0..n {
                    prop_assert_eq!(seen[r * n + j], j >= first * BLOCK);
                }
            }
            let again = PackedI8::from_packed(n, k, p.bytes().to_vec()).unwrap();
            prop_assert_eq!(&again.wsum, &p.wsum);
        }
    }

    /// Many rows (the later row passes prefetch the next tile, from `MIN_PF_PASSES` passes)
    /// and a partial last tile still give the plain int32 dot products: with AVX-512 VNNI,
    /// 41 rows are one group of row passes over 2 depth chunks (the second partial), 107 rows
    /// three groups over 5 (`chunked_tile`), and 150 features a partial last tile.
    #[test]
    fn gemm_with_many_rows_equals_scalar() {
        for (m, n, k) in [(41, 150, 300), (107, 150, 1030), (7, 64, 260)] {
            gemm_equals_scalar_dots(m, n, k);
        }
    }

    fn gemm_equals_scalar_dots(m: usize, n: usize, k: usize) {
        let x: Vec<i8> = (0..m * k).map(|i| ((i * 31) % 251) as i8).collect();
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 17) % 253) as i8).collect();
        let p = PackedI8::pack(&w, n, k);
        let mut xu = vec![128u8; m * p.k_pad];
        for r in 0..m {
            for i in 0..k {
                xu[r * p.k_pad + i] = (x[r * k + i] as u8) ^ 0x80;
            }
        }
        let mut seen = 0;
        p.gemm(&xu, m, 0, p.blocks(), |r, b, acc| {
            for (l, &v) in acc.iter().enumerate().filter(|(l, _)| b * BLOCK + l < n) {
                let j = b * BLOCK + l;
                assert_eq!(
                    v,
                    scalar_dot(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k])
                );
                seen += 1;
            }
        });
        assert_eq!(seen, m * n);
    }

    /// An x86 int8 tile kernel with the scalar tile's signature.
    #[cfg(target_arch = "x86_64")]
    type TileFn = unsafe fn(&[u8], usize, usize, &[i8], usize, &mut [[i32; BLOCK]]);

    /// `tile` equals the scalar tile exactly for `rows` (each with 1-4 blocks of several
    /// depths) and the largest products over 4096 inputs.
    #[cfg(target_arch = "x86_64")]
    fn tile_equals_scalar(tile: TileFn, rows: std::ops::RangeInclusive<usize>, seed: u64) {
        let mut next = xorshift(seed);
        for mr in rows {
            // k = 68: 17 quads, a main loop of fours and a tail.
            for (nb, k) in [(1, 4), (2, 64), (3, 2048), (4, 12), (2, 68)] {
                let k_pad = k;
                let x: Vec<u8> = (0..mr * k_pad).map(|_| next() as u8).collect();
                let mut w: Vec<i8> = (0..nb * k_pad * BLOCK).map(|_| next() as i8).collect();
                w[0] = -128;
                let mut want = vec![[0i32; BLOCK]; mr * nb];
                tile_scalar(&x, mr, k_pad, &w, nb, &mut want);
                // Both x86 tiles store every entry (the scalar tile adds into zeros).
                let mut got = vec![[7i32; BLOCK]; mr * nb];
                // SAFETY: the caller checked the CPU runs `tile`; slices sized as required.
                unsafe { tile(&x, mr, k_pad, &w, nb, &mut got) };
                assert_eq!(got, want, "mr={mr} nb={nb} k={k}");
            }
        }
        let x = vec![255u8; 4096];
        let w = vec![-128i8; 4096 * BLOCK];
        let mut got = vec![[0i32; BLOCK]; 1];
        // SAFETY: as above; one row, one block of 4096 inputs.
        unsafe { tile(&x, 1, 4096, &w, 1, &mut got) };
        assert_eq!(got[0], [255 * -128 * 4096; BLOCK]);
    }

    /// The streaming decode kernel (1-2 rows, blocks one after another) equals the scalar
    /// tile exactly.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn streaming_rows_equal_scalar_tile() {
        if !std::arch::is_x86_feature_detected!("avx512vnni")
            || !std::arch::is_x86_feature_detected!("avx512bw")
        {
            return;
        }
        tile_equals_scalar(x86::rows_streaming, 1..=2, 0x3c6e_f372_fe94_f82b_u64);
    }

    /// The AVX2 tile (the kernel of CPUs without VNNI) equals the scalar tile exactly.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tile_equals_scalar_tile() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        tile_equals_scalar(x86::tile_avx2, 1..=6, 0x9e37_79b9_u64);
    }

    /// The AVX-VNNI tile (the kernel of AVX2 CPUs with AVX-VNNI) equals the scalar tile
    /// exactly: every row count up to two passes of 6, up to 4 blocks, the largest products.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx_vnni_tile_equals_scalar_tile() {
        if !std::arch::is_x86_feature_detected!("avxvnni") {
            // Tile-level check impossible here; the Python test of every kernel family then
            // runs without this one (cpu_kernel() never reports it on such a CPU).
            assert_ne!(
                crate::cpu::kernels::isa_name(crate::cpu::kernels::isa()),
                "avx_vnni"
            );
            return;
        }
        tile_equals_scalar(x86::tile_avx_vnni, 1..=13, 0x51_7cc1_b727_220a_u64);
    }

    /// The NEON tile equals the scalar tile exactly (aarch64; run under qemu by
    /// `make check-aarch64`).
    #[cfg(target_arch = "aarch64")]
    #[test]
    fn neon_tile_equals_scalar_tile() {
        let mut next = xorshift(0x2545_f491_u64);
        for (mr, nb, k) in [(1, 1, 4), (2, 3, 64), (6, 4, 2048), (5, 2, 12)] {
            let x: Vec<u8> = (0..mr * k).map(|_| next() as u8).collect();
            let mut w: Vec<i8> = (0..nb * k * BLOCK).map(|_| next() as i8).collect();
            w[0] = -128;
            let mut want = vec![[0i32; BLOCK]; mr * nb];
            tile_scalar(&x, mr, k, &w, nb, &mut want);
            let mut got = vec![[7i32; BLOCK]; mr * nb];
            neon::tile(&x, mr, k, &w, nb, &mut got);
            assert_eq!(got, want, "mr={mr} nb={nb} k={k}");
        }
        let x = vec![255u8; 4096];
        let w = vec![-128i8; 4096 * BLOCK];
        let mut got = vec![[0i32; BLOCK]; 1];
        neon::tile(&x, 1, 4096, &w, 1, &mut got);
        assert_eq!(got[0], [255 * -128 * 4096; BLOCK]);
    }

    /// The AVX-512 and AVX2 W8A8 epilogues equal the scalar one bit for bit, a partial last block
    /// (lanes past `scale` emit 0) and extreme accumulators included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_finish_equals_scalar_finish() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let avx512 = std::arch::is_x86_feature_detected!("avx512f");
        let mut next = xorshift(0x51ed_2701_u64);
        for (mr, nb, b, n) in [
            (6, 4, 0, 64),
            (1, 1, 2, 40),
            (3, 2, 1, 45),
            (5, 4, 1, 77),
            (2, 1, 3, 40),
        ] {
            let mut acc: Vec<[i32; BLOCK]> = (0..mr * nb)
                .map(|_| std::array::from_fn(|_| (next() >> 40) as i32 - (1 << 23)))
                .collect();
            acc[0][0] = i32::MAX / 2;
            acc[0][1] = i32::MIN / 2;
            let wsum: Vec<i32> = (0..(b + nb) * BLOCK)
                .map(|_| (next() % 60_000) as i32 - 30_000)
                .collect();
            let sx: Vec<f32> = (0..mr)
                .map(|_| (next() % 1000) as f32 * 1.3e-4 + 1e-6)
                .collect();
            let scale: Vec<f32> = (0..n)
                .map(|_| (next() % 1000) as f32 * 7.1e-5 + 1e-7)
                .collect();
            let mut want = vec![[1f32; BLOCK]; mr * nb];
            finish_scalar(&acc, &mut want, b, &wsum, &sx, &scale);
            let bits =
                |v: &[[f32; BLOCK]]| v.iter().flatten().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut got = vec![[3f32; BLOCK]; mr * nb];
            // SAFETY: AVX2 detected above; slices sized as `finish_avx2` requires.
            unsafe { x86::finish_avx2(&acc, &mut got, b, &wsum, &sx, &scale) };
            assert_eq!(bits(&got), bits(&want), "AVX2 mr={mr} nb={nb} b={b} n={n}");
            if avx512 {
                // SAFETY: AVX-512F detected above; every slice is sized as `finish` requires.
                unsafe { x86::finish(&acc, &mut got, b, &wsum, &sx, &scale) };
                assert_eq!(bits(&got), bits(&want), "mr={mr} nb={nb} b={b} n={n}");
            }
            let last = &got[nb - 1];
            let past = ((b + nb) * BLOCK).saturating_sub(n).min(BLOCK);
            assert!(last[BLOCK - past..].iter().all(|&v| v == 0.0));
        }
    }

    /// `gemm_scaled` emits what `gemm` does, rescaled in the documented order.
    /// The AMX path (on the instruction model) through `gemm_scaled`: the same bits as the
    /// kernel this CPU runs otherwise, for padded and full row tiles, a single trailing block
    /// and column ranges; rows below `amx::MIN_ROWS` stay on the register tiles.
    #[test]
    fn amx_path_through_the_epilogue_equals_the_other_kernels() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for &(m, n, k, first, nblocks) in &[
            (5usize, 16usize, 64usize, 0usize, 1usize),
            (16, 40, 192, 0, 3),
            (17, 100, 128, 1, 5),
            (37, 48, 256, 0, 3),
            (64, 33, 2048, 1, 2),
            (3, 48, 128, 0, 3),
        ] {
            let q: Vec<i8> = (0..n * k).map(|_| next() as i8).collect();
            let p = PackedI8::pack(&q, n, k);
            let xu: Vec<u8> = (0..m * p.k_pad).map(|_| next() as u8).collect();
            let sx: Vec<f32> = (0..m).map(|r| 1e-2 + r as f32 * 1e-3).collect();
            let scale: Vec<f32> = (0..n).map(|j| 1e-3 * (1 + j % 7) as f32).collect();
            let run = |model: bool| {
                AMX_MODEL.with(|c| c.set(u32::from(model)));
                let mut out = vec![f32::NAN; m * nblocks * BLOCK];
                let mut hits = 0;
                p.gemm_scaled(&xu, m, &sx, &scale, first, nblocks, |r, b, lanes| {
                    let at = (r * nblocks + b - first) * BLOCK;
                    out[at..at + BLOCK].copy_from_slice(lanes);
                    hits += 1;
                });
                // 2 when the model ran (1 set here, plus its count), else what was set.
                let took = AMX_MODEL.with(|c| c.replace(0));
                (out, hits, took)
            };
            let (want, want_hits, _) = run(false);
            let (got, got_hits, took) = run(true);
            assert_eq!(
                took == 2,
                m >= super::super::amx::MIN_ROWS,
                "m={m}: model path taken?"
            );
            assert_eq!(want_hits, m * nblocks);
            assert_eq!(got_hits, want_hits, "m={m} n={n} k={k}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "m={m} n={n} k={k}");
        }
    }

    /// Written straight into rows (a stride wider than the blocks, an offset column range),
    /// on the register tiles (3 rows), the AMX tiles where this CPU has them (21 rows), the
    /// AMX model and one row of any stride, the epilogue equals `gemm_scaled`'s emitted
    /// blocks bit for bit and touches nothing else; it refuses (writing nothing) partial
    /// blocks, short outputs, overlapping rows and arguments out of range, and runs only
    /// where AVX-512 does.
    #[test]
    fn gemm_scaled_rows_equal_the_emitted_blocks() {
        let (n, k) = (80, 192);
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 37 + i / 7) % 255) as i8).collect();
        let p = PackedI8::pack(&w, n, k);
        let scale: Vec<f32> = (0..n).map(|j| 1e-3 + j as f32 * 3e-5).collect();
        for (m, first, nblocks, model, rs) in [
            (3, 1, 3, false, 3 * BLOCK + 7),
            (21, 0, 5, false, 5 * BLOCK + 7),
            (21, 2, 2, true, 2 * BLOCK + 7),
            (1, 1, 4, false, 1),
        ] {
            let xu: Vec<u8> = (0..m * p.k_pad)
                .map(|i| ((i * 11 + 3) % 256) as u8)
                .collect();
            let sx: Vec<f32> = (0..m).map(|r| 0.01 + r as f32 * 1e-3).collect();
            let col0 = first * BLOCK;
            let len = (m - 1) * rs + nblocks * BLOCK;
            let mut want = vec![f32::NAN; len];
            p.gemm_scaled(&xu, m, &sx, &scale, first, nblocks, |r, b, lanes| {
                let at = r * rs + b * BLOCK - col0;
                want[at..at + BLOCK].copy_from_slice(lanes);
            });
            AMX_MODEL.with(|c| c.set(u32::from(model)));
            let mut got = vec![f32::NAN; len];
            let ran =
                p.gemm_scaled_rows((&xu, m, &sx), &scale, first, nblocks, (&mut got, rs, col0));
            let took = AMX_MODEL.with(|c| c.replace(0));
            assert_eq!(ran, isa().avx512(), "m={m}");
            if !ran {
                assert!(got.iter().all(|v| v.is_nan()));
                continue;
            }
            assert_eq!(took == 2, model, "m={m}: model path taken?");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "m={m} first={first}");
        }
        // Refusals, each from arguments that run with one thing changed: a last block past
        // the scales (n = 80 is 5 whole blocks; 72 scales), an output one value short, rows
        // that overlap, blocks before `col0`, no rows, no blocks, blocks past the layer's, a
        // row without its scale, rows short of `m`, a block range that wraps.
        let m = 4;
        let xu = vec![1u8; m * p.k_pad];
        let sx = vec![1.0f32; m];
        let mut out = vec![f32::NAN; m * n];
        let ok = (n, m * n, n, 0, m, 5, 0, m, m);
        for (i, case) in [
            ok,
            (72, m * n, n, 0, m, 5, 0, m, m),
            (n, m * n - 1, n, 0, m, 5, 0, m, m),
            (n, m * n, n - 1, 0, m, 5, 0, m, m),
            (n, m * n, n, BLOCK, m, 5, 0, m, m),
            (n, m * n, n, 0, 0, 5, 0, m, m),
            (n, m * n, n, 0, m, 0, 0, m, m),
            (n, m * n, n, 0, m, 5, 1, m, m),
            (n, m * n, n, 0, m, 5, 0, m - 1, m),
            (n, m * n, n, 0, m, 5, 0, m, m - 1),
            (n, m * n, n, 0, m, usize::MAX, 1, m, m),
        ]
        .into_iter()
        .enumerate()
        {
            let (scale_len, len, rs, col0, rows, nblocks, first, sx_len, xu_rows) = case;
            out.fill(f32::NAN);
            let got = p.gemm_scaled_rows(
                (&xu[..xu_rows * p.k_pad], rows, &sx[..sx_len]),
                &scale[..scale_len],
                first,
                nblocks,
                (&mut out[..len], rs, col0),
            );
            if i == 0 {
                assert_eq!(got, isa().avx512(), "the unchanged arguments run");
                continue;
            }
            assert!(!got, "case {i}: {case:?}");
            assert!(out.iter().all(|v| v.is_nan()), "case {i}");
        }
    }

    #[test]
    fn gemm_scaled_is_gemm_rescaled() {
        let (n, k, m) = (70, 100, 9);
        let w: Vec<i8> = (0..n * k).map(|i| ((i * 37) % 255) as i8).collect();
        let p = PackedI8::pack(&w, n, k);
        let xu: Vec<u8> = (0..m * p.k_pad).map(|i| ((i * 11) % 256) as u8).collect();
        let sx: Vec<f32> = (0..m).map(|r| 0.01 + r as f32 * 1e-3).collect();
        let scale: Vec<f32> = (0..n).map(|j| 1e-3 + j as f32 * 3e-5).collect();
        let mut want = vec![f32::NAN; m * n];
        p.gemm(&xu, m, 1, p.blocks(), |r, b, acc| {
            for (l, &v) in acc.iter().enumerate() {
                if b * BLOCK + l < n {
                    want[r * n + b * BLOCK + l] = v as f32 * sx[r] * scale[b * BLOCK + l];
                }
            }
        });
        let mut got = vec![f32::NAN; m * n];
        p.gemm_scaled(&xu, m, &sx, &scale, 1, p.blocks(), |r, b, lanes| {
            for (l, &v) in lanes.iter().enumerate() {
                if b * BLOCK + l < n {
                    got[r * n + b * BLOCK + l] = v;
                }
            }
        });
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want));
        assert!(got[..BLOCK].iter().all(|v| v.is_nan()) && !got[BLOCK].is_nan());
    }

    #[test]
    fn simd_tile_equals_scalar_tile_at_extremes() {
        // Largest magnitudes: 255 * -128 summed over 4096 inputs stays inside int32.
        let (n, k, m) = (64, 4096, 6);
        let p = PackedI8::pack(&vec![-128i8; n * k], n, k);
        let xu = vec![255u8; m * p.k_pad];
        let mut reference = vec![[0i32; BLOCK]; m * 4];
        tile_scalar(&xu, m, p.k_pad, p.bytes(), 4, &mut reference);
        let mut count = 0;
        p.gemm(&xu, m, 0, 4, |r, b, acc| {
            let want: Vec<i32> = reference[r * 4 + b]
                .iter()
                .map(|v| v - 128 * (-128 * k as i32))
                .collect();
            assert_eq!(acc.to_vec(), want);
            assert_eq!(acc[0], 127 * -128 * k as i32);
            count += 1;
        });
        assert_eq!(count, m * 4);
    }
}
