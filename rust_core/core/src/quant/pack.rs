//! compressed-tensors integer packing: each row is a little-endian bit stream in int32 words.

/// How values wider than a word boundary are laid out; only matters when `32 % bits != 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackVariant {
    /// compressed-tensors >= 0.18: one dense bit stream, values may straddle words.
    Dense,
    /// compressed-tensors <= 0.17: `32 / bits` values per word, high bits unused.
    WordAligned,
}

impl PackVariant {
    /// Picks the variant from the `version` string of the quantization config.
    pub fn for_version(version: Option<&str>) -> PackVariant {
        match version.and_then(crate::scheme::args::ct_release) {
            Some(v) if v < (0, 18) => PackVariant::WordAligned,
            _ => PackVariant::Dense,
        }
    }
}

/// Reads the unsigned field `k` (of `bits` bits) from a stream of words given by `word(i)`.
#[inline]
pub fn field(word: impl Fn(usize) -> u32, k: usize, bits: u32, variant: PackVariant) -> u32 {
    let mask = if bits >= 32 {
        u32::MAX
    } else {
        (1u32 << bits) - 1
    };
    let b = bits as usize;
    if 32 % b == 0 || variant == PackVariant::WordAligned {
        let per_word = 32 / b;
        let w = word(k / per_word);
        (w >> ((k % per_word) * b)) & mask
    } else {
        let bit = k * b;
        let (w, o) = (bit / 32, (bit % 32) as u32);
        let lo = word(w) >> o;
        let v = if o + bits > 32 {
            lo | (word(w + 1) << (32 - o))
        } else {
            lo
        };
        v & mask
    }
}

/// Packs unsigned fields into words (the inverse of [`field`]), for tests and writers.
pub fn pack_row(values: &[u32], bits: u32, variant: PackVariant) -> Vec<u32> {
    let b = bits as usize;
    let words = if 32 % b == 0 || variant == PackVariant::WordAligned {
        values.len().div_ceil(32 / b)
    } else {
        (values.len() * b).div_ceil(32)
    };
    let mut out = vec![0u32; words];
    for (k, &v) in values.iter().enumerate() {
        if 32 % b == 0 || variant == PackVariant::WordAligned {
            let per_word = 32 / b;
            if let Some(w) = out.get_mut(k / per_word) {
                *w |= v << ((k % per_word) * b);
            }
        } else {
            let bit = k * b;
            let (w, o) = (bit / 32, (bit % 32) as u32);
            if let Some(x) = out.get_mut(w) {
                *x |= v << o;
            }
            if o + bits > 32 {
                if let Some(x) = out.get_mut(w + 1) {
                    *x |= v >> (32 - o);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn int4_nibble_order_matches_ct() {
        // Column 8w+j is nibble j of word w, low nibble first.
        let vals: Vec<u32> = (0..8).collect();
        assert_eq!(pack_row(&vals, 4, PackVariant::Dense), vec![0x7654_3210]);
    }

    #[test]
    fn int8_bytes_are_row_major() {
        let vals = vec![0x01, 0x02, 0x03, 0xff];
        assert_eq!(pack_row(&vals, 8, PackVariant::Dense), vec![0xff03_0201]);
    }

    #[test]
    fn version_picks_variant() {
        assert_eq!(
            PackVariant::for_version(Some("0.17.1")),
            PackVariant::WordAligned
        );
        assert_eq!(PackVariant::for_version(Some("0.18.0")), PackVariant::Dense);
        assert_eq!(PackVariant::for_version(Some("0.20.0")), PackVariant::Dense);
        assert_eq!(PackVariant::for_version(None), PackVariant::Dense);
    }

    proptest! {
        #[test]
        fn pack_then_field_roundtrips(bits in 1u32..=8, dense in any::<bool>(), raw in proptest::collection::vec(any::<u32>(), 0..100)) {
            let variant = if dense { PackVariant::Dense } else { PackVariant::WordAligned };
            let vals: Vec<u32> = raw.iter().map(|v| v & ((1 << bits) - 1)).collect();
            let words = pack_row(&vals, bits, variant);
            for (k, &v) in vals.iter().enumerate() {
                let got = field(|i| words.get(i).copied().unwrap_or(0), k, bits, variant);
                prop_assert_eq!(got, v);
            }
        }
    }
}
