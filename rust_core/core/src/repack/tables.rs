//! The permutation tables of the Marlin layout (`reference/marlin_layout.md` §5-§7), derived from
//! the closed form of vLLM's `gptq_marlin_repack` kernel (A16 variant).

/// Rows (k) and columns (n) of one Marlin tile.
pub const TILE_K: usize = 16;
pub const TILE_N: usize = 64;
/// Values per tile.
pub const TILE_VALUES: usize = TILE_K * TILE_N;

/// Values per int32 word.
pub const fn pack_factor(bits: u32) -> usize {
    32 / bits as usize
}

/// Where value `(kk, nn)` of a tile lands: `(word, slot)`, the slot being the bit-field index
/// inside the word (4-bit: nibble, 8-bit: byte). This is the `mma.m16n8k16` B-fragment order.
pub const fn tile_slot(bits: u32, kk: usize, nn: usize) -> (usize, usize) {
    let warp = nn / 16;
    let half = (nn % 16) / 8;
    let col = nn % 8;
    let t = (kk % 8) / 2;
    let lane = 4 * col + t;
    if bits == 4 {
        (4 * lane + warp, 4 * (kk % 2) + 2 * half + kk / 8)
    } else {
        (8 * lane + 2 * warp + half, 2 * (kk % 2) + kk / 8)
    }
}

/// For each position `word * pf + slot` of a tile, the tile-local `kk * 64 + nn` it holds.
pub fn tile_sources(bits: u32) -> [u16; TILE_VALUES] {
    let pf = pack_factor(bits);
    let mut out = [0u16; TILE_VALUES];
    for kk in 0..TILE_K {
        for nn in 0..TILE_N {
            let (word, slot) = tile_slot(bits, kk, nn);
            if let Some(x) = out.get_mut(word * pf + slot) {
                *x = (kk * TILE_N + nn) as u16;
            }
        }
    }
    out
}

/// vLLM's `get_weight_perm(bits)`: the same permutation, indexed the way vLLM's test oracle
/// flattens a tile (four 16x16 blocks, each row-major).
pub fn weight_perm(bits: u32) -> [u16; TILE_VALUES] {
    let src = tile_sources(bits);
    let mut out = [0u16; TILE_VALUES];
    for (o, s) in out.iter_mut().zip(src) {
        let (kk, nn) = (s as usize / TILE_N, s as usize % TILE_N);
        *o = ((nn / 16) * 256 + kk * 16 + nn % 16) as u16;
    }
    out
}

/// The grouped scale table (64 entries): output `j` takes input `perm[j]` of its 64-chunk.
pub const fn scale_perm_grouped() -> [u8; 64] {
    let mut out = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let (a, b) = (i / 8, i % 8);
        out[i] = (a + 8 * b) as u8;
        i += 1;
    }
    out
}

/// The single (channelwise) scale table (32 entries).
pub const fn scale_perm_single() -> [u8; 32] {
    const OFFSETS: [usize; 8] = [0, 1, 8, 9, 16, 17, 24, 25];
    let mut out = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        out[i] = (2 * (i / 8) + OFFSETS[i % 8]) as u8;
        i += 1;
    }
    out
}

/// The order of values inside a packed zero-point word (the dequantizer's unpacking order).
pub fn zero_point_interleave(bits: u32) -> &'static [usize] {
    if bits == 4 {
        &[0, 2, 4, 6, 1, 3, 5, 7]
    } else {
        &[0, 2, 1, 3]
    }
}

pub const SCALE_PERM_GROUPED: [u8; 64] = scale_perm_grouped();
pub const SCALE_PERM_SINGLE: [u8; 32] = scale_perm_single();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_perm_matches_the_reference_prefix() {
        let p4: Vec<u16> = weight_perm(4)[..16].to_vec();
        assert_eq!(
            p4,
            [0, 128, 8, 136, 16, 144, 24, 152, 256, 384, 264, 392, 272, 400, 280, 408]
        );
        let p8: Vec<u16> = weight_perm(8)[..16].to_vec();
        assert_eq!(
            p8,
            [0, 128, 16, 144, 8, 136, 24, 152, 256, 384, 272, 400, 264, 392, 280, 408]
        );
    }

    #[test]
    fn tables_are_permutations() {
        for bits in [4, 8] {
            let mut seen = [false; TILE_VALUES];
            for s in tile_sources(bits) {
                seen[s as usize] = true;
            }
            assert!(seen.iter().all(|&x| x));
        }
        let mut g: Vec<u8> = SCALE_PERM_GROUPED.to_vec();
        g.sort();
        assert_eq!(g, (0..64).collect::<Vec<u8>>());
        let mut s: Vec<u8> = SCALE_PERM_SINGLE.to_vec();
        s.sort();
        assert_eq!(s, (0..32).collect::<Vec<u8>>());
    }

    #[test]
    fn worked_example_word_zero() {
        // reference §5.2: 4-bit word 0 holds (0,0) (8,0) (0,8) (8,8) (1,0) (9,0) (1,8) (9,8).
        let src = tile_sources(4);
        let got: Vec<(usize, usize)> = src[..8]
            .iter()
            .map(|&s| (s as usize / 64, s as usize % 64))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0),
                (8, 0),
                (0, 8),
                (8, 8),
                (1, 0),
                (9, 0),
                (1, 8),
                (9, 8)
            ]
        );
        let src = tile_sources(8);
        let got: Vec<(usize, usize)> = src[..8]
            .iter()
            .map(|&s| (s as usize / 64, s as usize % 64))
            .collect();
        assert_eq!(
            got,
            [
                (0, 0),
                (8, 0),
                (1, 0),
                (9, 0),
                (0, 8),
                (8, 8),
                (1, 8),
                (9, 8)
            ]
        );
    }
}
