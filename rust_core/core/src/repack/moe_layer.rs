//! One compressed-tensors MoE layer to vLLM's Marlin fused-MoE tensors, and back.
//!
//! Byte reference: vLLM main @7cfb97e33791 (`reference/marlin_layout.md` §3.2, §8, §8b "newer
//! main"): w13 = gate then up along N, the intermediate size zero-padded to the tile without
//! act-order, w13 scales permuted with `size_k = I`, 4-bit zero points, act-order sort indices
//! from a stable argsort.

use super::marlin::{
    check_repack_shape, column_from_codes, ct_column, marlin_permute_scales,
    marlin_unpermute_scales, marlin_zero_points, marlin_zero_points_inverse, output_buffer,
    repack_columns, repacked_words, unrepack_to_codes, Column16,
};
use super::tables::pack_factor;
use crate::checkpoint::{Checkpoint, DType};
use crate::error::{Error, LayoutError, Result, UnsupportedSchemeError};
use crate::moe::MoeLayer;
use crate::quant::pack::{field, PackVariant};
use crate::scheme::module::{ModuleInfo, ZeroPointLayout};
use crate::scheme::{ActOrder, Format, QuantArgs, QuantType, Strategy};

/// The Marlin group sizes (`-1` = channelwise).
pub const MARLIN_GROUPS: [i64; 4] = [-1, 32, 64, 128];

/// Receives `(expert, stacked tensor name, that expert's bytes)`.
pub type ExpertSink<'a> = dyn FnMut(usize, &str, &[u8]) -> Result<()> + 'a;

/// A stored tensor looked up by name: dtype, shape and its bytes where they are stored (a
/// verify reads them in place: copying whole stacked tensors per expert made it quadratic).
pub type FetchedTensor<'a> = (DType, Vec<usize>, &'a [u8]);

/// The Marlin geometry of one layer, known before any byte is converted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MarlinGeometry {
    /// `<layer prefix>.experts`
    pub prefix: String,
    pub experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// The intermediate size after tile padding (equal to `intermediate` with act-order).
    pub intermediate_padded: usize,
    pub bits: u32,
    pub group_size: i64,
    pub symmetric: bool,
    pub act_order: bool,
    pub scale_dtype: DType,
}

impl MarlinGeometry {
    /// Where the weight args `w` that a Marlin record keeps beside this geometry say otherwise
    /// than the geometry [`geometry`] derives from them, one phrase each: int weights, group or
    /// channel, the same bits, group size and symmetry, and a group actorder under act-order
    /// (only that way: a group actorder whose experts store no g_idx is repacked without it).
    pub fn disagreements(&self, w: &QuantArgs) -> Vec<String> {
        [
            (w.qtype != QuantType::Int).then(|| "type is not int".to_string()),
            (!matches!(w.strategy, Strategy::Group | Strategy::Channel))
                .then(|| format!("strategy \"{}\" is not group or channel", w.strategy.name())),
            (w.num_bits != self.bits)
                .then(|| format!("num_bits {} where the entry says {}", w.num_bits, self.bits)),
            (w.group_size != self.group_size).then(|| {
                format!(
                    "group_size {} where the entry says {}",
                    w.group_size, self.group_size
                )
            }),
            (w.symmetric != self.symmetric).then(|| {
                format!(
                    "symmetric {} where the entry says {}",
                    w.symmetric, self.symmetric
                )
            }),
            (self.act_order && w.actorder != Some(ActOrder::Group))
                .then(|| "no group actorder where the entry says act_order true".to_string()),
        ]
        .into_iter()
        .flatten()
        .collect()
    }

    fn groups_h(&self) -> usize {
        if self.group_size > 0 {
            self.hidden / self.group_size as usize
        } else {
            1
        }
    }
    fn groups_i(&self) -> usize {
        if self.group_size > 0 {
            self.intermediate_padded / self.group_size as usize
        } else {
            1
        }
    }

    /// Name, dtype and shape of every output tensor, in a fixed order.
    pub fn specs(&self) -> Vec<(String, DType, Vec<usize>)> {
        let (e, h, ip, i) = (
            self.experts,
            self.hidden,
            self.intermediate_padded,
            self.intermediate,
        );
        let pf = pack_factor(self.bits);
        let p = &self.prefix;
        let mut out = vec![
            (
                format!("{p}.w13_weight_packed"),
                DType::I32,
                vec![e, h / 16, 2 * ip * 16 / pf],
            ),
            (
                format!("{p}.w2_weight_packed"),
                DType::I32,
                vec![e, ip / 16, h * 16 / pf],
            ),
            (
                format!("{p}.w13_weight_scale"),
                self.scale_dtype,
                vec![e, self.groups_h(), 2 * ip],
            ),
            (
                format!("{p}.w2_weight_scale"),
                self.scale_dtype,
                vec![e, self.groups_i(), h],
            ),
        ];
        if !self.symmetric {
            out.push((
                format!("{p}.w13_weight_zero_point"),
                DType::I32,
                vec![e, self.groups_h(), 2 * ip / pf],
            ));
            out.push((
                format!("{p}.w2_weight_zero_point"),
                DType::I32,
                vec![e, self.groups_i(), h / pf],
            ));
        }
        if self.act_order {
            out.push((format!("{p}.w13_weight_g_idx"), DType::I32, vec![e, h]));
            out.push((format!("{p}.w2_weight_g_idx"), DType::I32, vec![e, i]));
            out.push((
                format!("{p}.w13_g_idx_sort_indices"),
                DType::I32,
                vec![e, h],
            ));
            out.push((format!("{p}.w2_g_idx_sort_indices"), DType::I32, vec![e, i]));
        }
        out
    }

    /// Bytes of the largest tensors together (what converting the layer holds in memory).
    pub fn bytes(&self) -> usize {
        self.specs()
            .iter()
            .map(|(_, d, s)| s.iter().product::<usize>() * d.bit_size() / 8)
            .sum()
    }
}

fn unsupported(subject: &str, reason: String) -> Error {
    UnsupportedSchemeError {
        subject: subject.to_string(),
        reason,
    }
    .into()
}

fn layout(subject: &str, reason: String) -> Error {
    LayoutError {
        subject: subject.to_string(),
        reason,
    }
    .into()
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 {
            a
        } else {
            gcd(b, a % b)
        }
    }
    if a == 0 || b == 0 {
        0
    } else {
        a / gcd(a, b) * b
    }
}

/// Checks that a layer can be stored in the Marlin layout and returns its geometry.
pub fn geometry(layer: &MoeLayer) -> Result<MarlinGeometry> {
    let prefix = format!("{}.experts", layer.prefix);
    if !layer.gated {
        return Err(unsupported(
            &prefix,
            "non-gated experts (no gate_proj) have no Marlin w13 layout".into(),
        ));
    }
    let first = layer
        .experts
        .first()
        .ok_or_else(|| layout(&prefix, "the layer has no experts".into()))?;
    let reference = &first.up;
    let Some(w) = reference.weights() else {
        return Err(unsupported(
            &prefix,
            "the experts are not quantized; there is nothing to repack".into(),
        ));
    };
    for (e, x) in layer.experts.iter().enumerate() {
        for (role, m) in x.modules() {
            if m.scheme
                .as_ref()
                .map(|s| (&s.weights, &s.input_activations, s.format))
                != reference
                    .scheme
                    .as_ref()
                    .map(|s| (&s.weights, &s.input_activations, s.format))
            {
                return Err(unsupported(
                    &prefix,
                    format!("expert {e} {}_proj has another scheme than expert 0: per-expert mixed precision cannot be stored as one Marlin layer", role.name()),
                ));
            }
        }
    }
    if reference.format() != Format::PackQuantized || reference.input_activations().is_some() {
        return Err(unsupported(
            &prefix,
            format!(
                "the Marlin target needs weight-only pack-quantized experts, found {}",
                reference.format().name()
            ),
        ));
    }
    if w.num_bits != 4 && w.num_bits != 8 {
        return Err(unsupported(
            &prefix,
            format!(
                "{}-bit weights are not supported by Marlin (4 or 8)",
                w.num_bits
            ),
        ));
    }
    if !w.symmetric && w.num_bits == 8 {
        return Err(unsupported(
            &prefix,
            "asymmetric int8 weights are not supported by Marlin (zero points are 4-bit only)"
                .into(),
        ));
    }
    if !matches!(w.strategy, Strategy::Group | Strategy::Channel) {
        return Err(unsupported(
            &prefix,
            format!(
                "strategy \"{}\" is not supported by Marlin",
                w.strategy.name()
            ),
        ));
    }
    if !MARLIN_GROUPS.contains(&w.group_size) {
        return Err(unsupported(
            &prefix,
            format!(
                "group_size {} is not supported by Marlin (-1, 32, 64, 128)",
                w.group_size
            ),
        ));
    }
    // (Not where expert 0's up_proj stores a g_idx: without it the whole layer lost act-order.)
    let act_order = layer.act_order(w);
    let (h, i) = (layer.hidden_size, layer.intermediate_size);
    let g = w.group_size;
    let ip = if act_order {
        let need = (g.max(0) as usize).max(64);
        if i % need != 0 {
            return Err(layout(&prefix, format!("act-order cannot be padded: intermediate_size={i} must be a multiple of max(64, group_size)={need}")));
        }
        i
    } else {
        let tile = lcm(64, g.max(1) as usize);
        i.div_ceil(tile) * tile
    };
    check_repack_shape(&format!("{prefix} (w13)"), h, 2 * ip, w.num_bits)?;
    check_repack_shape(&format!("{prefix} (w2)"), ip, h, w.num_bits)?;
    if g > 0 && h % g as usize != 0 {
        return Err(layout(
            &prefix,
            format!("hidden_size={h} is not a multiple of group_size {g}"),
        ));
    }
    let scale_dtype = reference
        .scale_dtype
        .ok_or_else(|| layout(&prefix, "experts have no weight_scale".into()))?;
    // One Marlin scale tensor holds every expert's scales in one dtype: a projection whose
    // scales are stored in another would be copied as the wrong bits.
    for x in &layer.experts {
        for (_, m) in x.modules() {
            if let Some(other) = m.scale_dtype.filter(|&d| d != scale_dtype) {
                return Err(layout(
                    &m.name,
                    format!(
                        "weight_scale is {other} but expert 0 up_proj's is {scale_dtype}: \
                         one Marlin layer stores all its experts' scales in one dtype"
                    ),
                ));
            }
        }
    }
    Ok(MarlinGeometry {
        prefix,
        experts: layer.experts.len(),
        hidden: h,
        intermediate: i,
        intermediate_padded: ip,
        bits: w.num_bits,
        group_size: g,
        symmetric: w.symmetric,
        act_order,
        scale_dtype,
    })
}

/// Raw words of a packed int32 tensor.
fn words<'a>(ckpt: &'a Checkpoint, name: &str) -> Result<&'a [u32]> {
    Ok(ckpt.tensor(name)?.typed::<u32>()?)
}

/// Scale elements as u32 bit patterns (2-byte dtypes widened), `[rows, cols]` row-major.
fn scale_bits(ckpt: &Checkpoint, name: &str) -> Result<Vec<u32>> {
    let v = ckpt.tensor(name)?;
    Ok(match v.dtype().bit_size() {
        16 => v.typed::<u16>()?.iter().map(|&x| u32::from(x)).collect(),
        _ => v.typed::<u32>()?.to_vec(),
    })
}

/// Unsigned zero-point codes `[G, out]` of a module.
fn zero_point_codes(
    ckpt: &Checkpoint,
    m: &ModuleInfo,
    bits: u32,
    groups: usize,
    variant: PackVariant,
) -> Result<Vec<u32>> {
    let name = format!("{}.weight_zero_point", m.name);
    let out = m.out_features;
    let mut codes = vec![0u32; groups * out];
    match m.zero_point {
        Some(ZeroPointLayout::Packed) => {
            let zp = words(ckpt, &name)?;
            for g in 0..groups {
                let word = |w: usize| zp.get(w * groups + g).copied().unwrap_or(0);
                for r in 0..out {
                    if let Some(c) = codes.get_mut(g * out + r) {
                        *c = field(word, r, bits, variant);
                    }
                }
            }
        }
        Some(ZeroPointLayout::Unpacked) => {
            let signed = ckpt.tensor(&name)?.signed_codes(bits)?;
            let offset = 1i64 << (bits - 1);
            for r in 0..out {
                for g in 0..groups {
                    let v = signed.get(r * groups + g).copied().unwrap_or(0) + offset;
                    if let Some(c) = codes.get_mut(g * out + r) {
                        *c = v.clamp(0, (1 << bits) - 1) as u32;
                    }
                }
            }
        }
        None => {}
    }
    Ok(codes)
}

/// A module's act-order `g_idx` (checked: `k` entries, each a group in `0..groups`) and its
/// stable argsort, which makes each group contiguous (vLLM sorts on the GPU, where the sort is
/// stable). The Marlin conversion and the CPU loader both read act-order through it.
pub(crate) fn g_idx_and_perm(
    ckpt: &Checkpoint,
    m: &ModuleInfo,
    k: usize,
    groups: usize,
) -> Result<(Vec<i32>, Vec<u32>)> {
    if !m.has_g_idx {
        // A module of an act-order layer stored without one: column c in group c / group_size,
        // as the CPU loader and `dequantize` read it (Marlin asked for the missing tensor).
        let per = k.div_ceil(groups.max(1)).max(1);
        let g = (0..k).map(|c| (c / per) as i32).collect();
        return Ok((g, (0..k as u32).collect()));
    }
    let name = format!("{}.weight_g_idx", m.name);
    let raw = ckpt.tensor(&name)?.to_i64_vec()?;
    if raw.len() != k {
        return Err(layout(
            &name,
            format!("has {} entries, expected {k}", raw.len()),
        ));
    }
    if let Some((i, v)) = raw
        .iter()
        .enumerate()
        .find(|(_, &v)| v < 0 || v >= groups as i64)
    {
        return Err(layout(
            &name,
            format!("entry {i} is {v}, not a group of the {groups} the scales hold"),
        ));
    }
    let g: Vec<i32> = raw.into_iter().map(|v| v as i32).collect();
    let mut perm: Vec<u32> = (0..g.len() as u32).collect();
    perm.sort_by_key(|&i| g.get(i as usize).copied().unwrap_or(0));
    Ok((g, perm))
}

fn to_bytes_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn scale_bytes(v: &[u32], dtype: DType) -> Vec<u8> {
    if dtype.bit_size() == 16 {
        v.iter().flat_map(|&w| (w as u16).to_le_bytes()).collect()
    } else {
        to_bytes_u32(v)
    }
}

/// Everything one expert contributes, before stacking.
struct ExpertOut {
    w13: Vec<u32>,
    w2: Vec<u32>,
    s13: Vec<u32>,
    s2: Vec<u32>,
    z13: Vec<u32>,
    z2: Vec<u32>,
    g13: Vec<i32>,
    p13: Vec<u32>,
    g2: Vec<i32>,
    p2: Vec<u32>,
}

/// Converts one MoE layer. `version` is the quantization config's compressed-tensors version.
///
/// Experts are converted one after the other (each one's tile loops use the whole thread pool),
/// and each expert's slices of the stacked tensors go to `sink(expert, tensor name, bytes)` as
/// soon as they exist, followed by `done(expert)`: memory stays near one expert, not one layer.
pub fn convert_layer(
    ckpt: &Checkpoint,
    layer: &MoeLayer,
    geo: &MarlinGeometry,
    version: Option<&str>,
    sink: &mut ExpertSink<'_>,
    done: &mut dyn FnMut(usize),
) -> Result<()> {
    let variant = PackVariant::for_version(version);
    let (h, i, ip, bits) = (
        geo.hidden,
        geo.intermediate,
        geo.intermediate_padded,
        geo.bits,
    );
    let pf = pack_factor(bits);
    let mask = (1u32 << bits) - 1;
    let (gh, gi) = (geo.groups_h(), geo.groups_i());
    let gi_src = if geo.group_size > 0 {
        i / geo.group_size as usize
    } else {
        1
    };
    let specs = geo.specs();
    let convert = |e: usize, x: &crate::moe::ExpertModules| -> Result<ExpertOut> {
        let gate = x
            .gate
            .as_ref()
            .ok_or_else(|| layout(&geo.prefix, format!("expert {e} has no gate_proj")))?;
        let (up, down) = (&x.up, &x.down);
        let gw = words(ckpt, &gate.weight_tensor)?;
        let uw = words(ckpt, &up.weight_tensor)?;
        let dw = words(ckpt, &down.weight_tensor)?;
        // Act-order: one w13 g_idx per expert, so gate's and up's must agree.
        let (g13, p13, g2, p2) = if geo.act_order {
            let (gg, gp) = g_idx_and_perm(ckpt, gate, h, gh)?;
            let (ug, _) = g_idx_and_perm(ckpt, up, h, gh)?;
            if gg != ug {
                return Err(layout(
                        &geo.prefix,
                        format!(
                            "expert {e}: '{}.weight_g_idx' and '{}.weight_g_idx' differ{}; Marlin keeps one w13 g_idx per expert",
                            gate.name,
                            up.name,
                            match (gate.has_g_idx, up.has_g_idx) {
                                (false, _) => " (gate_proj stores none: read as in order)",
                                (_, false) => " (up_proj stores none: read as in order)",
                                _ => "",
                            }
                        ),
                    ));
            }
            let (dg, dp) = g_idx_and_perm(ckpt, down, i, gi_src)?;
            (
                gp.iter().map(|&k| gg[k as usize]).collect(),
                gp,
                dp.iter().map(|&k| dg[k as usize]).collect(),
                dp,
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new(), Vec::new())
        };
        // Codes straight from the compressed-tensors [N, K/pf] words: GPTQ transposed.
        let kw_h = (h * bits as usize).div_ceil(32);
        let kw_i = (i * bits as usize).div_ceil(32);
        let ct = |src: &[u32], kwords: usize, n: usize, k: usize| -> u32 {
            field(
                |w| src.get(n * kwords + w).copied().unwrap_or(0),
                k,
                bits,
                variant,
            ) & mask
        };
        // Whole 16-row columns straight from the [N, K/pf] words; act-order gathers rows
        // code by code. Padding columns (w13) and rows (w2) are zero codes.
        let mut w13 = output_buffer(repacked_words(h, 2 * ip, bits));
        let col13 = |kt: usize, n: usize| -> Column16 {
            let (src, nn) = if n < ip { (gw, n) } else { (uw, n - ip) };
            if nn >= i {
                return 0;
            }
            if p13.is_empty() {
                ct_column(src, kw_h, bits, kt, nn)
            } else {
                column_from_codes(bits, |j| {
                    ct(
                        src,
                        kw_h,
                        nn,
                        p13.get(kt * 16 + j).copied().unwrap_or(0) as usize,
                    )
                })
            }
        };
        repack_columns(col13, h, 2 * ip, bits, &mut w13);
        let mut w2 = output_buffer(repacked_words(ip, h, bits));
        let col2 = |kt: usize, n: usize| -> Column16 {
            if p2.is_empty() {
                if (kt + 1) * 16 <= i {
                    ct_column(dw, kw_i, bits, kt, n)
                } else {
                    column_from_codes(bits, |j| {
                        let k = kt * 16 + j;
                        if k < i {
                            ct(dw, kw_i, n, k)
                        } else {
                            0
                        }
                    })
                }
            } else {
                column_from_codes(bits, |j| {
                    ct(
                        dw,
                        kw_i,
                        n,
                        p2.get(kt * 16 + j).copied().unwrap_or(0) as usize,
                    )
                })
            }
        };
        repack_columns(col2, ip, h, bits, &mut w2);

        // Scales: [N, G] -> [G, N], zero-padded, then Marlin-permuted.
        let gs = scale_bits(ckpt, &format!("{}.weight_scale", gate.name))?;
        let us = scale_bits(ckpt, &format!("{}.weight_scale", up.name))?;
        let ds = scale_bits(ckpt, &format!("{}.weight_scale", down.name))?;
        let mut s13 = vec![0u32; gh * 2 * ip];
        for g in 0..gh {
            for n in 0..i {
                s13[g * 2 * ip + n] = gs.get(n * gh + g).copied().unwrap_or(0);
                s13[g * 2 * ip + ip + n] = us.get(n * gh + g).copied().unwrap_or(0);
            }
        }
        let s13 = marlin_permute_scales(&s13, i, 2 * ip, geo.group_size)?;
        let mut s2 = vec![0u32; gi * h];
        for g in 0..gi_src {
            for n in 0..h {
                s2[g * h + n] = ds.get(n * gi_src + g).copied().unwrap_or(0);
            }
        }
        let size_k2 = gi
            * if geo.group_size > 0 {
                geo.group_size as usize
            } else {
                pf
            };
        let s2 = marlin_permute_scales(&s2, size_k2, h, geo.group_size)?;

        let (z13, z2) = if geo.symmetric {
            (Vec::new(), Vec::new())
        } else {
            let gz = zero_point_codes(ckpt, gate, bits, gh, variant)?;
            let uz = zero_point_codes(ckpt, up, bits, gh, variant)?;
            let dz = zero_point_codes(ckpt, down, bits, gi_src, variant)?;
            let mut z13 = vec![0u32; gh * 2 * ip];
            for g in 0..gh {
                for n in 0..i {
                    z13[g * 2 * ip + n] = gz.get(g * i + n).copied().unwrap_or(0);
                    z13[g * 2 * ip + ip + n] = uz.get(g * i + n).copied().unwrap_or(0);
                }
            }
            let mut z2 = vec![0u32; gi * h];
            z2[..gi_src * h].copy_from_slice(dz.get(..gi_src * h).unwrap_or(&[]));
            (
                marlin_zero_points(&z13, gh, 2 * ip, bits)?,
                marlin_zero_points(&z2, gi, h, bits)?,
            )
        };
        Ok(ExpertOut {
            w13,
            w2,
            s13,
            s2,
            z13,
            z2,
            g13,
            p13,
            g2,
            p2,
        })
    };

    for (e, x) in layer.experts.iter().enumerate() {
        let out = convert(e, x)?;
        for (name, dtype, shape) in &specs {
            let suffix = name.rsplit('.').next().unwrap_or("");
            let data: Vec<u8> = match suffix {
                "w13_weight_packed" => to_bytes_u32(&out.w13),
                "w2_weight_packed" => to_bytes_u32(&out.w2),
                "w13_weight_scale" => scale_bytes(&out.s13, *dtype),
                "w2_weight_scale" => scale_bytes(&out.s2, *dtype),
                "w13_weight_zero_point" => to_bytes_u32(&out.z13),
                "w2_weight_zero_point" => to_bytes_u32(&out.z2),
                "w13_weight_g_idx" => out.g13.iter().flat_map(|v| v.to_le_bytes()).collect(),
                "w2_weight_g_idx" => out.g2.iter().flat_map(|v| v.to_le_bytes()).collect(),
                "w13_g_idx_sort_indices" => to_bytes_u32(&out.p13),
                "w2_g_idx_sort_indices" => to_bytes_u32(&out.p2),
                _ => Vec::new(),
            };
            let expected =
                shape.iter().product::<usize>() * dtype.bit_size() / 8 / geo.experts.max(1);
            if data.len() != expected {
                return Err(layout(
                    name,
                    format!(
                        "expert {e} produced {} bytes, expected {expected}",
                        data.len()
                    ),
                ));
            }
            sink(e, name, &data)?;
        }
        drop(out);
        done(e);
    }
    Ok(())
}

/// Dequantises expert `e`'s `role` projection ("gate", "up" or "down") from the Marlin tensors of
/// a layer: `[out, in]` in the scale dtype, with the same arithmetic as compressed-tensors.
pub fn dequantize_marlin<'a>(
    tensors: &(dyn Fn(&str) -> Option<FetchedTensor<'a>> + Sync),
    geo: &MarlinGeometry,
    expert: usize,
    role: &str,
) -> Result<crate::quant::Dequantized> {
    let p = &geo.prefix;
    let (h, i, ip, bits) = (
        geo.hidden,
        geo.intermediate,
        geo.intermediate_padded,
        geo.bits,
    );
    let pf = pack_factor(bits);
    let get = |suffix: &str| {
        tensors(&format!("{p}.{suffix}")).ok_or_else(|| layout(p, format!("missing {p}.{suffix}")))
    };
    let w13 = role != "down";
    // One expert's elements of a stacked tensor (w13_* or w2_*), decoded to u32: only that
    // expert's bytes are touched, whatever the number of experts.
    let expert_elems = |suffix: &str, per: usize| -> Result<(DType, Vec<u32>)> {
        let name = format!("{}_{suffix}", if w13 { "w13" } else { "w2" });
        let (dtype, _, bytes) = get(&name)?;
        let es = dtype.bit_size() / 8;
        let part = bytes
            .get(expert * per * es..(expert + 1) * per * es)
            .ok_or_else(|| layout(p, format!("{p}.{name} has no expert {expert}")))?;
        let v = if es == 2 {
            part.chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        } else {
            part.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        Ok((dtype, v))
    };
    let (k, n_total) = if w13 { (h, 2 * ip) } else { (ip, h) };
    let (_, wexp) = expert_elems("weight_packed", repacked_words(k, n_total, bits))?;
    let codes = unrepack_to_codes(&wexp, k, n_total, bits);
    let k_orig = if w13 { h } else { i };
    let perm: Vec<u32> = if geo.act_order {
        expert_elems("g_idx_sort_indices", k_orig)?.1
    } else {
        Vec::new()
    };
    let groups = if w13 { geo.groups_h() } else { geo.groups_i() };
    let (sdtype, sexp) = expert_elems("weight_scale", groups * n_total)?;
    let es = sdtype.bit_size() / 8;
    let size_k_scales = if w13 {
        i
    } else {
        groups
            * if geo.group_size > 0 {
                geo.group_size as usize
            } else {
                pf
            }
    };
    let scales = marlin_unpermute_scales(&sexp, size_k_scales, n_total, geo.group_size)?;
    let zps: Option<Vec<u32>> = if geo.symmetric {
        None
    } else {
        let (_, z) = expert_elems("weight_zero_point", groups * n_total / pf)?;
        Some(marlin_zero_points_inverse(&z, groups, n_total, bits)?)
    };
    let (col0, out_f, in_f) = match role {
        "gate" => (0, i, h),
        "up" => (ip, i, h),
        _ => (0, h, i),
    };
    let g_of_sorted: Vec<usize> = if geo.act_order {
        expert_elems("weight_g_idx", k_orig)?
            .1
            .iter()
            .map(|&v| v as usize)
            .collect()
    } else {
        (0..k)
            .map(|kk| {
                if geo.group_size > 0 {
                    kk / geo.group_size as usize
                } else {
                    0
                }
            })
            .collect()
    };
    let offset = 1i64 << (bits - 1);
    let mut w = vec![0u8; out_f * in_f * es];
    for sk in 0..in_f {
        // Sorted row sk holds original input row perm[sk].
        let orig_k = if perm.is_empty() {
            sk
        } else {
            perm.get(sk).copied().unwrap_or(0) as usize
        };
        let g = g_of_sorted.get(sk).copied().unwrap_or(0);
        for n in 0..out_f {
            let col = col0 + n;
            let code = i64::from(codes.get(sk * n_total + col).copied().unwrap_or(0));
            let sbits = scales.get(g * n_total + col).copied().unwrap_or(0);
            let zp = zps
                .as_ref()
                .map(|z| i64::from(z.get(g * n_total + col).copied().unwrap_or(0)));
            let val = crate::quant::dequant::dequant_value(
                sdtype,
                code - offset,
                zp.map(|z| z - offset),
                sbits,
            );
            let at = (n * in_f + orig_k) * es;
            if let Some(dst) = w.get_mut(at..at + es) {
                dst.copy_from_slice(&val[..es]);
            }
        }
    }
    Ok(crate::quant::Dequantized {
        dtype: sdtype,
        shape: [out_f, in_f],
        data: w,
    })
}
