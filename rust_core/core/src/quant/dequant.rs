//! `w = (q - zp) * scale` in the scale dtype, as compressed-tensors' `_dequantize` computes it
//! with torch: each operation rounds to the scale dtype.

use half::{bf16, f16};
use rayon::prelude::*;

use super::pack::{field, PackVariant};
use crate::checkpoint::{Checkpoint, DType, TensorView};
use crate::error::{module_error, Result, UnsupportedSchemeError};
use crate::scheme::module::{ModuleInfo, ZeroPointLayout};
use crate::scheme::{Format, Strategy};

/// A dense `[out, in]` matrix in `dtype` (little-endian bytes).
#[derive(Clone, Debug)]
pub struct Dequantized {
    pub dtype: DType,
    pub shape: [usize; 2],
    pub data: Vec<u8>,
}

/// Arithmetic in one float dtype: values travel as f32 and are rounded after every operation.
#[derive(Clone, Copy)]
enum Arith {
    BF16,
    F16,
    F32,
}

impl Arith {
    #[inline]
    fn round(self, x: f32) -> f32 {
        match self {
            Arith::BF16 => bf16::from_f32(x).to_f32(),
            Arith::F16 => f16::from_f32(x).to_f32(),
            Arith::F32 => x,
        }
    }
    #[inline]
    fn store(self, x: f32, out: &mut [u8]) {
        match self {
            Arith::BF16 => out.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
            Arith::F16 => out.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes()),
            Arith::F32 => out.copy_from_slice(&x.to_le_bytes()),
        }
    }
    fn size(self) -> usize {
        match self {
            Arith::F32 => 4,
            _ => 2,
        }
    }
}

impl Arith {
    fn of(dtype: DType) -> Option<Arith> {
        match dtype {
            DType::BF16 => Some(Arith::BF16),
            DType::F16 => Some(Arith::F16),
            DType::F32 => Some(Arith::F32),
            _ => None,
        }
    }

    fn decode(self, bits: u32) -> f32 {
        match self {
            Arith::BF16 => bf16::from_bits(bits as u16).to_f32(),
            Arith::F16 => f16::from_bits(bits as u16).to_f32(),
            Arith::F32 => f32::from_bits(bits),
        }
    }

    /// `(q - zp) * scale` with compressed-tensors' rounding (every operation in the scale dtype).
    #[inline]
    fn value(self, q: i64, zp: Option<i64>, scale: f32) -> f32 {
        let d = match zp {
            Some(z) => self.round(self.round(q as f32) - self.round(z as f32)),
            None => self.round(q as f32),
        };
        self.round(d * scale)
    }
}

/// One dequantised value (signed code `q`, signed zero point, the scale's bit pattern) as the
/// little-endian bytes of `dtype` (2 or 4 of the 4 returned bytes are meaningful).
pub fn dequant_value(dtype: DType, q: i64, zp: Option<i64>, scale_bits: u32) -> [u8; 4] {
    let mut out = [0u8; 4];
    if let Some(a) = Arith::of(dtype) {
        let v = a.value(q, zp, a.decode(scale_bits));
        let n = a.size();
        a.store(v, &mut out[..n]);
    }
    out
}

/// Reads float values of a BF16/F16/F32 tensor as f32.
pub fn float_values(view: &TensorView<'_>) -> Result<Vec<f32>> {
    let b = view.bytes;
    Ok(match view.dtype() {
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        other => {
            return Err(module_error(
                view.name(),
                format!("has dtype {other}, expected BF16, F16 or F32"),
            ))
        }
    })
}

fn word_at(bytes: &[u8], i: usize) -> u32 {
    match bytes.get(4 * i..4 * i + 4) {
        Some(c) => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        None => 0,
    }
}

/// Dequantises one analysed module. Unquantized modules are returned as stored.
pub fn dequantize(
    ckpt: &Checkpoint,
    info: &ModuleInfo,
    version: Option<&str>,
) -> Result<Dequantized> {
    dequantize_with(ckpt, info, version, false)
}

/// Like [`dequantize`]; with `exact_f32` the result is `(q - zp) * scale` in f32 without the
/// rounding to the scale dtype (exact: the operands have at most 9 + 11 significant bits).
pub fn dequantize_with(
    ckpt: &Checkpoint,
    info: &ModuleInfo,
    version: Option<&str>,
    exact_f32: bool,
) -> Result<Dequantized> {
    let (out_f, in_f) = (info.out_features, info.in_features);
    let weight = ckpt.tensor(&info.weight_tensor)?;
    let Some(args) = info.weights() else {
        return Ok(Dequantized {
            dtype: weight.dtype(),
            shape: [out_f, in_f],
            data: weight.bytes.to_vec(),
        });
    };
    let fmt = info.format();
    if !matches!(
        fmt,
        Format::PackQuantized | Format::IntQuantized | Format::NaiveQuantized
    ) {
        return Err(UnsupportedSchemeError {
            subject: format!("module '{}'", info.name),
            reason: format!(
                "dequantising format \"{}\" is not supported (int formats only)",
                fmt.name()
            ),
        }
        .into());
    }
    let module = info.name.as_str();
    let scale_view = ckpt.tensor(&format!("{module}.weight_scale"))?;
    let arith = match scale_view.dtype() {
        DType::BF16 => Arith::BF16,
        DType::F16 => Arith::F16,
        DType::F32 => Arith::F32,
        other => {
            return Err(module_error(
                module,
                format!("weight_scale has dtype {other}, expected BF16, F16 or F32"),
            ))
        }
    };
    let arith = if exact_f32 { Arith::F32 } else { arith };
    let out_dtype = if exact_f32 {
        DType::F32
    } else {
        scale_view.dtype()
    };
    let scales = float_values(&scale_view)?;
    let bits = args.num_bits;
    let offset = 1i64 << (bits.saturating_sub(1).min(62));
    let variant = PackVariant::for_version(version);
    let groups = match args.strategy {
        Strategy::Group => in_f / (args.group_size.max(1) as usize),
        Strategy::Tensor => 0,
        _ => 1,
    };

    // Column -> scale column. g_idx (act-order) makes it indirect; a -1 entry means "unset".
    let col_group: Vec<usize> = {
        let g_idx = if info.has_g_idx {
            Some(
                ckpt.tensor(&format!("{module}.weight_g_idx"))?
                    .to_i64_vec()?,
            )
        } else {
            None
        };
        match (args.strategy, g_idx) {
            (Strategy::Group, Some(g)) if !g.contains(&-1) => {
                if let Some((k, bad)) = g
                    .iter()
                    .enumerate()
                    .find(|(_, &v)| v < 0 || v as usize >= groups)
                {
                    return Err(module_error(
                        module,
                        format!("weight_g_idx[{k}] = {bad} is outside the {groups} groups"),
                    ));
                }
                g.iter().map(|&v| v as usize).collect()
            }
            (Strategy::Group, _) => (0..in_f).map(|k| k / args.group_size as usize).collect(),
            _ => vec![0; in_f],
        }
    };
    let scale_at = |r: usize, g: usize| -> f32 {
        if groups == 0 {
            scales.first().copied().unwrap_or(0.0)
        } else {
            scales.get(r * groups + g).copied().unwrap_or(0.0)
        }
    };

    // Signed zero points per (row, group).
    let zps: Option<Vec<i64>> = match info.zero_point {
        None => None,
        Some(ZeroPointLayout::Unpacked) => Some(
            ckpt.tensor(&format!("{module}.weight_zero_point"))?
                .signed_codes(bits)?,
        ),
        Some(ZeroPointLayout::Packed) => {
            let zp = ckpt.tensor(&format!("{module}.weight_zero_point"))?;
            let g_cols = groups.max(1);
            let mut out = vec![0i64; out_f * g_cols];
            for g in 0..g_cols {
                // Word w of group g's stream is element [w, g] of the [words, G] tensor.
                let word = |w: usize| word_at(zp.bytes, w * g_cols + g);
                for r in 0..out_f {
                    out[r * g_cols + g] = i64::from(field(word, r, bits, variant)) - offset;
                }
            }
            Some(out)
        }
    };
    let zp_at = |r: usize, g: usize| -> i64 {
        match &zps {
            None => 0,
            Some(z) if groups == 0 => z.first().copied().unwrap_or(0),
            Some(z) => z.get(r * groups.max(1) + g).copied().unwrap_or(0),
        }
    };

    let esize = arith.size();
    let mut data = vec![0u8; out_f * in_f * esize];
    let row_bytes = in_f * esize;
    if row_bytes == 0 {
        return Ok(Dequantized {
            dtype: out_dtype,
            shape: [out_f, in_f],
            data,
        });
    }
    let wbytes = weight.bytes;
    let wdtype = weight.dtype();
    if fmt != Format::PackQuantized && (wdtype != DType::I8 || bits < 8) {
        // Unpacked codes are read by value, as compressed-tensors reads them; each must lie in
        // the scheme's range, as the CPU loader requires (I8 holds every 8-bit code).
        weight.signed_codes(bits)?;
    }
    let words_per_row = (in_f * bits as usize).div_ceil(32);
    let words_per_row = if variant == PackVariant::WordAligned && 32 % bits != 0 {
        in_f.div_ceil(32 / bits as usize)
    } else {
        words_per_row
    };
    data.par_chunks_mut(row_bytes)
        .enumerate()
        .for_each(|(r, row)| {
            for (k, out) in row.chunks_exact_mut(esize).enumerate() {
                let q: i64 = match fmt {
                    Format::PackQuantized => {
                        let base = r * words_per_row;
                        i64::from(field(|w| word_at(wbytes, base + w), k, bits, variant)) - offset
                    }
                    _ => {
                        let i = r * in_f + k;
                        match wdtype {
                            DType::I8 => i64::from(wbytes.get(i).map_or(0, |&b| b as i8)),
                            DType::U8 => i64::from(wbytes.get(i).copied().unwrap_or(0)),
                            DType::I16 => wbytes
                                .get(2 * i..2 * i + 2)
                                .map_or(0, |c| i64::from(i16::from_le_bytes([c[0], c[1]]))),
                            _ => i64::from(word_at(wbytes, i) as i32),
                        }
                    }
                };
                let g = col_group.get(k).copied().unwrap_or(0);
                let zp = zp_at(r, g);
                let s = scale_at(r, g);
                arith.store(arith.value(q, zps.is_some().then_some(zp), s), out);
            }
        });
    Ok(Dequantized {
        dtype: out_dtype,
        shape: [out_f, in_f],
        data,
    })
}
