//! Marlin repacking of int4/int8 weights, scales, zero points and biases, byte-identical to
//! vLLM's load path (`reference/marlin_layout.md`, "newer main"), and the inverse of each step.
//!
//! Weights are read through a code accessor `code(k, n)` so that the same tile loop serves GPTQ
//! input (`[K/pf, N]`), compressed-tensors input (`[N, K/pf]`, i.e. GPTQ transposed), the
//! gate|up concatenation of MoE w13 and zero padding, without materialising any of them.

use rayon::prelude::*;

use super::tables::{
    pack_factor, tile_sources, zero_point_interleave, SCALE_PERM_GROUPED, SCALE_PERM_SINGLE,
    TILE_K, TILE_N, TILE_VALUES,
};
use crate::error::LayoutError;

fn layout_error(subject: &str, reason: impl Into<String>) -> LayoutError {
    LayoutError {
        subject: subject.to_string(),
        reason: reason.into(),
    }
}

/// A zeroed buffer for a large output. Linux: the kernel is asked to back it with transparent
/// huge pages first, so filling it takes a few hundred page faults instead of one per 4 KiB (on
/// virtual machines a 4 KiB fault costs microseconds, more than the repack itself).
pub fn output_buffer(len: usize) -> Vec<u32> {
    // `vec![0; n]` is a calloc: large ones are fresh zero pages, not yet touched, so the advice
    // below applies before the first fault, and the faults (with the kernel's zeroing) happen
    // in the parallel repack loop rather than in a single-threaded memset.
    let v: Vec<u32> = vec![0u32; len];
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let bytes = len * std::mem::size_of::<u32>();
        if bytes >= 4 * HUGE {
            let start = v.as_ptr() as usize;
            let aligned = start.div_ceil(HUGE) * HUGE;
            let end = (start + bytes) / HUGE * HUGE;
            if end > aligned {
                // SAFETY: [aligned, end) lies inside the allocation of `v` (rounded inwards to
                // 2 MiB boundaries); MADV_HUGEPAGE only changes how the kernel backs those pages,
                // never their contents.
                unsafe {
                    libc::madvise(
                        aligned as *mut libc::c_void,
                        end - aligned,
                        libc::MADV_HUGEPAGE,
                    );
                }
            }
        }
    }
    v
}

/// Marlin holds 4- and 8-bit codes only.
fn check_bits(subject: &str, bits: u32) -> Result<(), LayoutError> {
    if bits == 4 || bits == 8 {
        Ok(())
    } else {
        Err(layout_error(
            subject,
            format!("num_bits={bits} is not supported (4 or 8)"),
        ))
    }
}

/// Checks the repack shape rules: 4 or 8 bits, `K % 16 == 0`, `N % 64 == 0`.
pub fn check_repack_shape(
    subject: &str,
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<(), LayoutError> {
    check_bits(subject, bits)?;
    if size_k == 0 || !size_k.is_multiple_of(TILE_K) {
        return Err(layout_error(
            subject,
            format!("size_k={size_k} is not a positive multiple of {TILE_K}"),
        ));
    }
    if size_n == 0 || !size_n.is_multiple_of(TILE_N) {
        return Err(layout_error(
            subject,
            format!("size_n={size_n} is not a positive multiple of {TILE_N}"),
        ));
    }
    Ok(())
}

/// Number of int32 words of a Marlin weight `[K/16, N*16/pf]`.
pub fn repacked_words(size_k: usize, size_n: usize, bits: u32) -> usize {
    size_k / TILE_K * (size_n * TILE_K / pack_factor(bits))
}

/// The tile loop: fills `out` (`[K/16, N*16/pf]`) from `code(k, n)` (an unsigned code < 2^bits).
/// Shapes must have been checked with [`check_repack_shape`].
pub fn repack_codes<F>(code: F, size_k: usize, size_n: usize, bits: u32, out: &mut [u32])
where
    F: Fn(usize, usize) -> u32 + Sync,
{
    let pf = pack_factor(bits);
    let words_per_tile = TILE_VALUES / pf;
    let n_tiles = size_n / TILE_N;
    let row_words = n_tiles * words_per_tile;
    debug_assert_eq!(out.len(), size_k / TILE_K * row_words);
    let src = tile_sources(bits);
    out.par_chunks_mut(row_words.max(1))
        .enumerate()
        .for_each(|(kt, row)| {
            let k0 = kt * TILE_K;
            for (nt, tile) in row.chunks_exact_mut(words_per_tile).enumerate() {
                let n0 = nt * TILE_N;
                for (w, word) in tile.iter_mut().enumerate() {
                    let mut acc = 0u32;
                    for s in 0..pf {
                        let at = src.get(w * pf + s).copied().unwrap_or(0) as usize;
                        let (kk, nn) = (at / TILE_N, at % TILE_N);
                        acc |= code(k0 + kk, n0 + nn) << (s as u32 * bits);
                    }
                    *word = acc;
                }
            }
        });
}

/// The 16 codes of column `n` in tile row `kt` (rows `16kt..16kt+16`), packed: 4-bit codes as
/// nibbles in the low 64 bits (row `16kt+j` at bits `4j..4j+4`), 8-bit codes as the 16 bytes.
/// This is exactly two (4-bit) or four (8-bit) consecutive GPTQ words of one column.
pub type Column16 = u128;

/// The fast tile loop: fills `out` (`[K/16, N*16/pf]`) from whole 16-row columns. Produces the
/// same words as [`repack_codes`] (the table-driven reference), with a few shifts per word.
pub fn repack_columns<F>(column: F, size_k: usize, size_n: usize, bits: u32, out: &mut [u32])
where
    F: Fn(usize, usize) -> Column16 + Sync,
{
    // The bit width is a compile-time constant inside the loops: it decides every shift.
    if bits == 4 {
        repack_columns_const::<4, F>(column, size_k, size_n, out);
    } else {
        repack_columns_const::<8, F>(column, size_k, size_n, out);
    }
}

fn repack_columns_const<const BITS: u32, F>(
    column: F,
    size_k: usize,
    size_n: usize,
    out: &mut [u32],
) where
    F: Fn(usize, usize) -> Column16 + Sync,
{
    let pf = pack_factor(BITS);
    let words_per_tile = TILE_VALUES / pf;
    let n_tiles = size_n / TILE_N;
    let row_words = n_tiles * words_per_tile;
    debug_assert_eq!(out.len(), size_k / TILE_K * row_words);
    out.par_chunks_mut(row_words.max(1))
        .enumerate()
        .for_each(|(kt, row)| {
            let mut cols = [0u128; TILE_N];
            for (nt, tile) in row.chunks_exact_mut(words_per_tile).enumerate() {
                for (nn, c) in cols.iter_mut().enumerate() {
                    *c = column(kt, nt * TILE_N + nn);
                }
                dispatch_tile::<BITS>(&cols, tile);
            }
        });
}

/// Runs the SIMD tile kernel when the CPU has it, else the scalar one.
#[inline]
fn dispatch_tile<const BITS: u32>(cols: &[u128; TILE_N], tile: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        if BITS == 4 {
            if let Ok(t) = <&mut [u32; 128]>::try_from(&mut *tile) {
                // SAFETY: `available()` checked SSSE3 support at run time.
                unsafe { super::simd::tile_words_4bit(cols, t) };
                return;
            }
        } else if let Ok(t) = <&mut [u32; 256]>::try_from(&mut *tile) {
            // SAFETY: `available()` checked SSSE3 support at run time.
            unsafe { super::simd::tile_words_8bit(cols, t) };
            return;
        }
    }
    if BITS == 4 {
        scalar_tile_words_4bit(cols, tile);
    } else {
        scalar_tile_words_8bit(cols, tile);
    }
}

/// One 4-bit tile: word `4*(4*col + t) + warp` takes, from columns `c = 16*warp + col` and
/// `c + 8`, the bytes holding rows (2t, 2t+1) and (2t+8, 2t+9); low nibbles go to slots 0-3,
/// high nibbles to slots 4-7 (`reference/marlin_layout.md` §5.2).
#[inline]
pub(crate) fn scalar_tile_words_4bit(cols: &[u128; TILE_N], tile: &mut [u32]) {
    for warp in 0..4 {
        for col in 0..8 {
            let c0 = cols[16 * warp + col] as u64;
            let c1 = cols[16 * warp + col + 8] as u64;
            for t in 0..4 {
                let a = ((c0 >> (8 * t)) & 0xff) as u32;
                let b = ((c0 >> (32 + 8 * t)) & 0xff) as u32;
                let c = ((c1 >> (8 * t)) & 0xff) as u32;
                let d = ((c1 >> (32 + 8 * t)) & 0xff) as u32;
                let lo = (a & 15) | (b & 15) << 4 | (c & 15) << 8 | (d & 15) << 12;
                let hi = (a >> 4) | (b >> 4) << 4 | (c >> 4) << 8 | (d >> 4) << 12;
                if let Some(w) = tile.get_mut(4 * (4 * col + t) + warp) {
                    *w = lo | hi << 16;
                }
            }
        }
    }
}

/// One 8-bit tile: word `8*(4*col + t) + 2*warp + half` holds rows 2t, 2t+8, 2t+1, 2t+9 of
/// column `16*warp + col + 8*half`, one per byte.
#[inline]
pub(crate) fn scalar_tile_words_8bit(cols: &[u128; TILE_N], tile: &mut [u32]) {
    for warp in 0..4 {
        for half in 0..2 {
            for col in 0..8 {
                let c = cols[16 * warp + 8 * half + col];
                for t in 0..4 {
                    let byte = |k: usize| ((c >> (8 * k)) & 0xff) as u32;
                    let word = byte(2 * t)
                        | byte(2 * t + 8) << 8
                        | byte(2 * t + 1) << 16
                        | byte(2 * t + 9) << 24;
                    if let Some(w) = tile.get_mut(8 * (4 * col + t) + 2 * warp + half) {
                        *w = word;
                    }
                }
            }
        }
    }
}

/// Builds a [`Column16`] code by code (for act-order gathers and padding).
#[inline]
pub fn column_from_codes(bits: u32, code: impl Fn(usize) -> u32) -> Column16 {
    let mut c: u128 = 0;
    for j in 0..TILE_K {
        c |= u128::from(code(j)) << (j as u32 * bits);
    }
    c
}

/// The column of compressed-tensors words `[N, K/pf]` (GPTQ transposed): `16/pf` consecutive
/// words of row `n`, `kwords` words per row.
#[inline(always)]
pub fn ct_column(words: &[u32], kwords: usize, bits: u32, kt: usize, n: usize) -> Column16 {
    let rows = TILE_K / pack_factor(bits);
    let at = n * kwords + kt * rows;
    let mut c: u128 = 0;
    if let Some(ws) = words.get(at..at + rows) {
        for (r, &w) in ws.iter().enumerate() {
            c |= u128::from(w) << (32 * r);
        }
    }
    c
}

/// The column of GPTQ words `[K/pf, N]` (no permutation): consecutive words of column `n`.
#[inline(always)]
pub fn gptq_column(q: &[u32], size_n: usize, bits: u32, kt: usize, n: usize) -> Column16 {
    if bits == 4 {
        gptq_column_rows::<2>(q, size_n, kt, n)
    } else {
        gptq_column_rows::<4>(q, size_n, kt, n)
    }
}

#[inline(always)]
fn gptq_column_rows<const ROWS: usize>(q: &[u32], size_n: usize, kt: usize, n: usize) -> Column16 {
    let mut c: u128 = 0;
    for r in 0..ROWS {
        c |= u128::from(q.get((kt * ROWS + r) * size_n + n).copied().unwrap_or(0)) << (32 * r);
    }
    c
}

/// The inverse tile loop: calls `put(k, n, code)` for every value of a Marlin weight.
pub fn unrepack_codes<F>(marlin: &[u32], size_k: usize, size_n: usize, bits: u32, put: F)
where
    F: Fn(usize, usize, u32) + Sync,
{
    let pf = pack_factor(bits);
    let words_per_tile = TILE_VALUES / pf;
    let n_tiles = size_n / TILE_N;
    let row_words = n_tiles * words_per_tile;
    let mask = (1u32 << bits) - 1;
    let src = tile_sources(bits);
    marlin
        .par_chunks(row_words.max(1))
        .take(size_k / TILE_K)
        .enumerate()
        .for_each(|(kt, row)| {
            for (nt, tile) in row.chunks_exact(words_per_tile).enumerate() {
                for (w, &word) in tile.iter().enumerate() {
                    for s in 0..pf {
                        let at = src.get(w * pf + s).copied().unwrap_or(0) as usize;
                        put(
                            kt * TILE_K + at / TILE_N,
                            nt * TILE_N + at % TILE_N,
                            (word >> (s as u32 * bits)) & mask,
                        );
                    }
                }
            }
        });
}

/// Checks that `perm` is empty (no act-order) or a permutation of `0..size_k`.
pub fn check_perm(subject: &str, perm: &[u32], size_k: usize) -> Result<(), LayoutError> {
    if perm.is_empty() {
        return Ok(());
    }
    if perm.len() != size_k {
        return Err(layout_error(
            subject,
            format!(
                "perm has {} entries, expected 0 or size_k={size_k}",
                perm.len()
            ),
        ));
    }
    let mut seen = vec![false; size_k];
    for (i, &p) in perm.iter().enumerate() {
        match seen.get_mut(p as usize) {
            Some(s) if !*s => *s = true,
            Some(_) => {
                return Err(layout_error(
                    subject,
                    format!("perm[{i}]={p} appears twice (not a permutation)"),
                ))
            }
            None => {
                return Err(layout_error(
                    subject,
                    format!("perm[{i}]={p} is out of range for size_k={size_k}"),
                ))
            }
        }
    }
    Ok(())
}

/// vLLM's `gptq_marlin_repack(qweight [K/pf, N], perm, size_k, size_n, num_bits)`:
/// `[K/16, N*16/pf]` int32 words. `perm` is `[]` (no act-order) or `[K]`: row `k` of the result is
/// row `perm[k]` of the input.
pub fn gptq_marlin_repack(
    qweight: &[u32],
    perm: &[u32],
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<Vec<u32>, LayoutError> {
    const S: &str = "gptq_marlin_repack";
    check_repack_shape(S, size_k, size_n, bits)?;
    let pf = pack_factor(bits);
    if qweight.len() != size_k / pf * size_n {
        return Err(layout_error(
            S,
            format!(
                "qweight has {} words, expected [size_k/{pf}={}, size_n={size_n}]",
                qweight.len(),
                size_k / pf
            ),
        ));
    }
    check_perm(S, perm, size_k)?;
    let mut out = output_buffer(repacked_words(size_k, size_n, bits));
    let mask = (1u32 << bits) - 1;
    let gptq = |ks: usize, n: usize| -> u32 {
        let w = qweight.get((ks / pf) * size_n + n).copied().unwrap_or(0);
        (w >> ((ks % pf) as u32 * bits)) & mask
    };
    if perm.is_empty() {
        repack_columns(
            |kt, n| gptq_column(qweight, size_n, bits, kt, n),
            size_k,
            size_n,
            bits,
            &mut out,
        );
    } else {
        let p = |k: usize| perm.get(k).copied().unwrap_or(0) as usize;
        repack_columns(
            |kt, n| column_from_codes(bits, |j| gptq(p(kt * TILE_K + j), n)),
            size_k,
            size_n,
            bits,
            &mut out,
        );
    }
    Ok(out)
}

/// The inverse of [`gptq_marlin_repack`]: the GPTQ `qweight [K/pf, N]` in original row order.
pub fn gptq_marlin_unrepack(
    marlin: &[u32],
    perm: &[u32],
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<Vec<u32>, LayoutError> {
    const S: &str = "gptq_marlin_unrepack";
    check_repack_shape(S, size_k, size_n, bits)?;
    if marlin.len() != repacked_words(size_k, size_n, bits) {
        return Err(layout_error(
            S,
            format!(
                "input has {} words, expected {}",
                marlin.len(),
                repacked_words(size_k, size_n, bits)
            ),
        ));
    }
    check_perm(S, perm, size_k)?;
    let codes = unrepack_to_codes(marlin, size_k, size_n, bits);
    if perm.is_empty() {
        return Ok(pack_rows(&codes, size_k, size_n, bits));
    }
    // `codes` is in sorted order: row k holds original row perm[k].
    let mut orig = vec![0u8; size_k * size_n];
    for (k, &p) in perm.iter().enumerate() {
        let (Some(dst), Some(src)) = (
            orig.get_mut(p as usize * size_n..(p as usize + 1) * size_n),
            codes.get(k * size_n..(k + 1) * size_n),
        ) else {
            continue;
        };
        dst.copy_from_slice(src);
    }
    Ok(pack_rows(&orig, size_k, size_n, bits))
}

/// Unsigned codes `[K, N]` of a Marlin weight (in its sorted row order).
pub fn unrepack_to_codes(marlin: &[u32], size_k: usize, size_n: usize, bits: u32) -> Vec<u8> {
    let codes: Vec<std::sync::atomic::AtomicU8> = (0..size_k * size_n)
        .map(|_| std::sync::atomic::AtomicU8::new(0))
        .collect();
    unrepack_codes(marlin, size_k, size_n, bits, |k, n, c| {
        if let Some(x) = codes.get(k * size_n + n) {
            x.store(c as u8, std::sync::atomic::Ordering::Relaxed);
        }
    });
    codes
        .into_iter()
        .map(std::sync::atomic::AtomicU8::into_inner)
        .collect()
}

/// GPTQ packing of codes `[K, N]` along K: `[K/pf, N]` words.
pub fn pack_rows(codes: &[u8], size_k: usize, size_n: usize, bits: u32) -> Vec<u32> {
    let pf = pack_factor(bits);
    let mut q = vec![0u32; size_k / pf * size_n];
    q.par_chunks_mut(size_n.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            for j in 0..pf {
                let k = r * pf + j;
                for (n, w) in row.iter_mut().enumerate() {
                    *w |= u32::from(codes.get(k * size_n + n).copied().unwrap_or(0))
                        << (j as u32 * bits);
                }
            }
        });
    q
}

/// vLLM's `gptq_marlin_moe_repack(qweight [E, K/pf, N], perm [E, K] or [E, 0], ...)`:
/// `[E, K/16, N*16/pf]`.
pub fn gptq_marlin_moe_repack(
    qweight: &[u32],
    perm: &[u32],
    experts: usize,
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<Vec<u32>, LayoutError> {
    const S: &str = "gptq_marlin_moe_repack";
    check_repack_shape(S, size_k, size_n, bits)?;
    let pf = pack_factor(bits);
    let per_in = size_k / pf * size_n;
    if qweight.len() != experts * per_in {
        return Err(layout_error(
            S,
            format!(
                "qweight has {} words, expected [E={experts}, {}, {size_n}]",
                qweight.len(),
                size_k / pf
            ),
        ));
    }
    if !perm.is_empty() && perm.len() != experts * size_k {
        return Err(layout_error(
            S,
            format!(
                "perm has {} entries, expected [E={experts}, 0] or [E, size_k={size_k}]",
                perm.len()
            ),
        ));
    }
    let per_out = repacked_words(size_k, size_n, bits);
    let mut out = output_buffer(experts * per_out);
    // Experts in sequence: each expert's tile rows are already spread over the pool.
    out.chunks_mut(per_out.max(1)).enumerate().try_for_each(
        |(e, dst)| -> Result<(), LayoutError> {
            let q = qweight.get(e * per_in..(e + 1) * per_in).unwrap_or(&[]);
            let p = if perm.is_empty() {
                &[][..]
            } else {
                perm.get(e * size_k..(e + 1) * size_k).unwrap_or(&[])
            };
            check_perm(&format!("{S} (expert {e})"), p, size_k)?;
            let mask = (1u32 << bits) - 1;
            let gptq = |ks: usize, n: usize| {
                (q.get((ks / pf) * size_n + n).copied().unwrap_or(0) >> ((ks % pf) as u32 * bits))
                    & mask
            };
            if p.is_empty() {
                repack_columns(
                    |kt, n| gptq_column(q, size_n, bits, kt, n),
                    size_k,
                    size_n,
                    bits,
                    dst,
                );
            } else {
                let pk = |k: usize| p.get(k).copied().unwrap_or(0) as usize;
                repack_columns(
                    |kt, n| column_from_codes(bits, |j| gptq(pk(kt * TILE_K + j), n)),
                    size_k,
                    size_n,
                    bits,
                    dst,
                );
            }
            Ok(())
        },
    )?;
    Ok(out)
}

/// Whether `marlin_permute_scales` uses the grouped (64) table.
pub fn grouped_scales(size_k: usize, group_size: i64) -> bool {
    group_size != -1 && group_size > 0 && (group_size as usize) < size_k
}

fn permute_chunks<T: Copy + Send + Sync>(s: &[T], table: &[u8], inverse: bool) -> Vec<T> {
    let mut out = s.to_vec();
    out.par_chunks_mut(table.len())
        .zip(s.par_chunks(table.len()))
        .for_each(|(dst, src)| {
            for (j, &t) in table.iter().enumerate() {
                let t = t as usize;
                if inverse {
                    if let (Some(d), Some(v)) = (dst.get_mut(t), src.get(j)) {
                        *d = *v;
                    }
                } else if let (Some(d), Some(v)) = (dst.get_mut(j), src.get(t)) {
                    *d = *v;
                }
            }
        });
    out
}

/// vLLM's `marlin_permute_scales(s [G, N], size_k, size_n, group_size)`: same shape and dtype.
pub fn marlin_permute_scales<T: Copy + Send + Sync>(
    s: &[T],
    size_k: usize,
    size_n: usize,
    group_size: i64,
) -> Result<Vec<T>, LayoutError> {
    permute_scales_impl(
        "marlin_permute_scales",
        s,
        size_k,
        size_n,
        group_size,
        false,
    )
}

/// The inverse of [`marlin_permute_scales`].
pub fn marlin_unpermute_scales<T: Copy + Send + Sync>(
    s: &[T],
    size_k: usize,
    size_n: usize,
    group_size: i64,
) -> Result<Vec<T>, LayoutError> {
    permute_scales_impl(
        "marlin_unpermute_scales",
        s,
        size_k,
        size_n,
        group_size,
        true,
    )
}

fn permute_scales_impl<T: Copy + Send + Sync>(
    subject: &str,
    s: &[T],
    size_k: usize,
    size_n: usize,
    group_size: i64,
    inverse: bool,
) -> Result<Vec<T>, LayoutError> {
    if size_n == 0 || !size_n.is_multiple_of(TILE_N) {
        return Err(layout_error(
            subject,
            format!("size_n={size_n} is not a positive multiple of {TILE_N}"),
        ));
    }
    if !s.len().is_multiple_of(size_n) {
        return Err(layout_error(
            subject,
            format!("{} scales are not whole rows of size_n={size_n}", s.len()),
        ));
    }
    let table: &[u8] = if grouped_scales(size_k, group_size) {
        &SCALE_PERM_GROUPED
    } else {
        &SCALE_PERM_SINGLE
    };
    Ok(permute_chunks(s, table, inverse))
}

/// vLLM's `marlin_moe_permute_scales(s [E, G, N], size_k, size_n, group_size)`.
pub fn marlin_moe_permute_scales<T: Copy + Send + Sync>(
    s: &[T],
    size_k: usize,
    size_n: usize,
    group_size: i64,
) -> Result<Vec<T>, LayoutError> {
    // The table applies to each 64/32-chunk of the flattened [G, N] rows; rows are whole chunks
    // (N % 64 == 0), so experts never share a chunk and the whole array permutes at once.
    marlin_permute_scales(s, size_k, size_n, group_size)
}

/// vLLM's `marlin_permute_bias(b)`: the single table on every 32 entries.
pub fn marlin_permute_bias<T: Copy + Send + Sync>(b: &[T]) -> Result<Vec<T>, LayoutError> {
    if !b.len().is_multiple_of(SCALE_PERM_SINGLE.len()) {
        return Err(layout_error(
            "marlin_permute_bias",
            format!("{} entries is not a multiple of 32", b.len()),
        ));
    }
    Ok(permute_chunks(b, &SCALE_PERM_SINGLE, false))
}

/// The inverse of [`marlin_permute_bias`].
pub fn marlin_unpermute_bias<T: Copy + Send + Sync>(b: &[T]) -> Result<Vec<T>, LayoutError> {
    if !b.len().is_multiple_of(SCALE_PERM_SINGLE.len()) {
        return Err(layout_error(
            "marlin_unpermute_bias",
            format!("{} entries is not a multiple of 32", b.len()),
        ));
    }
    Ok(permute_chunks(b, &SCALE_PERM_SINGLE, true))
}

/// vLLM's `marlin_zero_points(zp [G, N] codes, size_k=G, size_n=N, num_bits)`: `[G, N/pf]`.
pub fn marlin_zero_points(
    zp: &[u32],
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<Vec<u32>, LayoutError> {
    const S: &str = "marlin_zero_points";
    check_bits(S, bits)?;
    if zp.len() != size_k * size_n {
        return Err(layout_error(
            S,
            format!(
                "zp has {} entries, expected [size_k={size_k}, size_n={size_n}]",
                zp.len()
            ),
        ));
    }
    if !size_n.is_multiple_of(TILE_N) {
        return Err(layout_error(
            S,
            format!("size_n={size_n} is not a multiple of {TILE_N}"),
        ));
    }
    if let Some((i, v)) = zp.iter().enumerate().find(|(_, &v)| v >> bits != 0) {
        return Err(layout_error(
            S,
            format!("zp[{i}]={v} does not fit in {bits} bits"),
        ));
    }
    let grouped = permute_chunks(zp, &SCALE_PERM_GROUPED, false);
    let pf = pack_factor(bits);
    let inter = zero_point_interleave(bits);
    let mut out = vec![0u32; zp.len() / pf];
    out.par_iter_mut().enumerate().for_each(|(w, word)| {
        let run = grouped.get(w * pf..(w + 1) * pf).unwrap_or(&[]);
        let mut acc = 0u32;
        for (j, &src) in inter.iter().enumerate() {
            acc |= run.get(src).copied().unwrap_or(0) << (j as u32 * bits);
        }
        *word = acc;
    });
    Ok(out)
}

/// The inverse of [`marlin_zero_points`]: codes `[G, N]`.
pub fn marlin_zero_points_inverse(
    packed: &[u32],
    size_k: usize,
    size_n: usize,
    bits: u32,
) -> Result<Vec<u32>, LayoutError> {
    const S: &str = "marlin_zero_points_inverse";
    check_bits(S, bits)?;
    let pf = pack_factor(bits);
    if packed.len() * pf != size_k * size_n || !size_n.is_multiple_of(TILE_N) {
        return Err(layout_error(
            S,
            format!(
                "{} words do not hold [size_k={size_k}, size_n={size_n}] codes",
                packed.len()
            ),
        ));
    }
    let inter = zero_point_interleave(bits);
    let mask = (1u32 << bits) - 1;
    let mut grouped = vec![0u32; size_k * size_n];
    grouped
        .par_chunks_mut(pf)
        .zip(packed.par_iter())
        .for_each(|(run, &word)| {
            for (j, &src) in inter.iter().enumerate() {
                if let Some(x) = run.get_mut(src) {
                    *x = (word >> (j as u32 * bits)) & mask;
                }
            }
        });
    Ok(permute_chunks(&grouped, &SCALE_PERM_GROUPED, true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// The fast column path equals the table-driven reference on random words.
        #[test]
        fn fast_path_equals_reference(bits in prop_oneof![Just(4u32), Just(8)], kt in 1usize..5, nt in 1usize..4, seed in any::<u64>(), with_perm in any::<bool>()) {
            let (k, n) = (kt * 16, nt * 64);
            let pf = pack_factor(bits);
            let mut x = seed | 1;
            let q: Vec<u32> = (0..k / pf * n).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u32 }).collect();
            let perm: Vec<u32> = if with_perm { let mut p: Vec<u32> = (0..k as u32).collect(); p.reverse(); p.swap(0, k / 2); p } else { Vec::new() };
            let fast = gptq_marlin_repack(&q, &perm, k, n, bits).unwrap();
            let mask = (1u32 << bits) - 1;
            let code = |kk: usize, nn: usize| {
                let ks = if perm.is_empty() { kk } else { perm[kk] as usize };
                (q[(ks / pf) * n + nn] >> ((ks % pf) as u32 * bits)) & mask
            };
            let mut reference = vec![0u32; repacked_words(k, n, bits)];
            repack_codes(code, k, n, bits, &mut reference);
            prop_assert_eq!(fast, reference);
        }
    }
}
