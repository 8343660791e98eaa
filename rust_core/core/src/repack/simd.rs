//! SSSE3 versions of the Marlin tile kernels ([`super::marlin`]'s `tile_words_4bit` /
//! `tile_words_8bit` are the scalar references; a test checks they agree on random tiles).
//!
//! 4-bit: for one column pair (c, c+8) of a warp, the four output words t = 0..3 are a 4x4 byte
//! transpose of (c.rows0-7, c.rows8-15, c+8.rows0-7, c+8.rows8-15) followed by a nibble
//! compaction; a 4x4 word transpose over the warps puts them in output order.
//! 8-bit: one column's 16 bytes shuffled as rows (2t, 2t+8, 2t+1, 2t+9) give its four words.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

#[cfg(target_arch = "x86_64")]
use super::tables::TILE_N;

/// Whether the SSSE3 kernels can run here (checked once).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| std::arch::is_x86_feature_detected!("ssse3"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Transposes four rows of four u32 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
#[inline]
fn transpose4(r0: __m128i, r1: __m128i, r2: __m128i, r3: __m128i) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(r0, r1);
    let t1 = _mm_unpacklo_epi32(r2, r3);
    let t2 = _mm_unpackhi_epi32(r0, r1);
    let t3 = _mm_unpackhi_epi32(r2, r3);
    [
        _mm_unpacklo_epi64(t0, t1),
        _mm_unpackhi_epi64(t0, t1),
        _mm_unpacklo_epi64(t2, t3),
        _mm_unpackhi_epi64(t2, t3),
    ]
}

/// Packs the low nibbles of the 4 bytes of each lane into bits 0-15 and the high nibbles into
/// bits 16-31.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
#[inline]
fn compact_nibbles(x: __m128i) -> __m128i {
    let m0f = _mm_set1_epi32(0x0F0F_0F0F);
    let m00ff = _mm_set1_epi32(0x00FF_00FF);
    let m0000ffff = _mm_set1_epi32(0x0000_FFFF);
    let squeeze = |v: __m128i| {
        let v = _mm_and_si128(_mm_or_si128(v, _mm_srli_epi32::<4>(v)), m00ff);
        _mm_and_si128(_mm_or_si128(v, _mm_srli_epi32::<8>(v)), m0000ffff)
    };
    let lo = squeeze(_mm_and_si128(x, m0f));
    let hi = squeeze(_mm_and_si128(_mm_srli_epi32::<4>(x), m0f));
    _mm_or_si128(lo, _mm_slli_epi32::<16>(hi))
}

/// The 4-bit tile (128 words) from its 64 columns.
///
/// # Safety
/// The CPU must support SSSE3 ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
pub unsafe fn tile_words_4bit(cols: &[u128; TILE_N], tile: &mut [u32; 128]) {
    // Byte t of each of the four source u32 lanes, gathered into lane t.
    let transpose_bytes = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for col in 0..8 {
        let mut per_warp = [_mm_setzero_si128(); 4];
        for (warp, v) in per_warp.iter_mut().enumerate() {
            let c0 = cols[16 * warp + col] as u64;
            let c1 = cols[16 * warp + col + 8] as u64;
            let x = _mm_shuffle_epi8(_mm_set_epi64x(c1 as i64, c0 as i64), transpose_bytes);
            *v = compact_nibbles(x);
        }
        // per_warp[w] lane t is word 16*col + 4*t + w.
        let rows = transpose4(per_warp[0], per_warp[1], per_warp[2], per_warp[3]);
        for (t, r) in rows.iter().enumerate() {
            let at = 16 * col + 4 * t;
            // SAFETY: `at + 4 <= 128` (col < 8, t < 4), so the 16-byte unaligned store stays
            // inside `tile`.
            unsafe { _mm_storeu_si128(tile.as_mut_ptr().add(at).cast::<__m128i>(), *r) };
        }
    }
}

/// The 8-bit tile (256 words) from its 64 columns.
///
/// # Safety
/// The CPU must support SSSE3 ([`available`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "ssse3")]
pub unsafe fn tile_words_8bit(cols: &[u128; TILE_N], tile: &mut [u32; 256]) {
    // Word t takes rows 2t, 2t+8, 2t+1, 2t+9.
    let order = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    for col in 0..8 {
        let mut v = [_mm_setzero_si128(); 8];
        for (j, slot) in v.iter_mut().enumerate() {
            // j = 2*warp + half selects column 16*warp + 8*half + col.
            let c = cols[16 * (j / 2) + 8 * (j % 2) + col];
            let x = _mm_set_epi64x((c >> 64) as u64 as i64, c as u64 as i64);
            *slot = _mm_shuffle_epi8(x, order);
        }
        // v[j] lane t is word 32*col + 8*t + j.
        let lo = transpose4(v[0], v[1], v[2], v[3]);
        let hi = transpose4(v[4], v[5], v[6], v[7]);
        for t in 0..4 {
            let at = 32 * col + 8 * t;
            // SAFETY: `at + 8 <= 256` (col < 8, t < 4): both 16-byte stores stay inside `tile`.
            unsafe {
                _mm_storeu_si128(tile.as_mut_ptr().add(at).cast::<__m128i>(), lo[t]);
                _mm_storeu_si128(tile.as_mut_ptr().add(at + 4).cast::<__m128i>(), hi[t]);
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::repack::marlin::{scalar_tile_words_4bit, scalar_tile_words_8bit};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn simd_tiles_equal_scalar(seed in any::<u64>()) {
            prop_assume!(available());
            let mut x = seed | 1;
            let mut cols = [0u128; TILE_N];
            for c in cols.iter_mut() {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                let a = x;
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                *c = u128::from(a) | u128::from(x) << 64;
            }
            let (mut s4, mut v4) = ([0u32; 128], [0u32; 128]);
            scalar_tile_words_4bit(&cols, &mut s4);
            // SAFETY: guarded by `available()` above.
            unsafe { tile_words_4bit(&cols, &mut v4) };
            prop_assert_eq!(s4, v4);
            let (mut s8, mut v8) = ([0u32; 256], [0u32; 256]);
            scalar_tile_words_8bit(&cols, &mut s8);
            // SAFETY: guarded by `available()` above.
            unsafe { tile_words_8bit(&cols, &mut v8) };
            prop_assert_eq!(s8, v8);
        }
    }
}
