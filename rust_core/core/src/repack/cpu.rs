//! The CPU layout of `moeq repack --target cpu`: W8A8 expert weights stored already packed in
//! the VNNI blocks of [`crate::cpu::packed`], with their code sums, so loading a layer is a copy
//! into its arena and no packing.
//!
//! Per prepacked layer, with `P = <layer prefix>.experts`, `Bi = ceil(I / 16)`,
//! `Bh = ceil(H / 16)`, `Hp = ceil(H / 4) * 4`, `Ip = ceil(I / 4) * 4`:
//! - `P.w13_weight_packed` int8 `[E, 2 * Bi, Hp / 4, 64]`: gate's blocks, then up's
//! - `P.w2_weight_packed` int8 `[E, Bh, Ip / 4, 64]`
//! - `P.w13_weight_sum` int32 `[E, 2 * Bi * 16]`, `P.w2_weight_sum` int32 `[E, Bh * 16]`: the
//!   per-feature code sums (the u8 x i8 compensation terms; zero in padding)
//! - `P.w13_weight_scale` f32 `[E, 2 * I]`, `P.w2_weight_scale` f32 `[E, H]` (per channel)
//! - static activations only: `P.w13_input_scale`, `P.w2_input_scale` f32 `[E]`
//!
//! Weight-only layers (W8A16, W4A16) store the codes unpacked to int8, row-major, with columns
//! in act-order sorted order, as the fp32 kernels read them:
//! - `P.w13_weight_packed` int8 `[E, 2I, H]`, `P.w2_weight_packed` int8 `[E, H, I]`
//! - `P.w13_weight_scale` f32 `[E, 2I, G13]`, `P.w2_weight_scale` f32 `[E, H, G2]`
//! - asymmetric: `P.w13_weight_zero_point` int8 `[E, 2I, G13]`, `P.w2_weight_zero_point` int8
//!   `[E, H, G2]`
//! - act-order: `P.w13_g_idx_sort_indices` int32 `[E, 2, H]` (gate's column order, then up's),
//!   `P.w2_g_idx_sort_indices` int32 `[E, I]`, and the first sorted column of each group,
//!   `P.w13_group_starts` int32 `[E, 2, G13]`, `P.w2_group_starts` int32 `[E, G2]`
//!
//! Layers with per-expert mixed schemes, non-gated experts or no quantization are copied
//! unchanged and packed at load as before.

use serde_json::{json, Value};

use crate::checkpoint::dtype::DType;
use crate::checkpoint::Checkpoint;
use crate::cpu::linear::Linear;
use crate::cpu::moe::CpuExpert;
use crate::cpu::packed::{PackedI8, BLOCK};
use crate::error::{module_error, LayoutError, Result};
use crate::moe::MoeLayer;
use crate::scheme::{Format, QuantArgs, QuantType, Strategy};

/// One prepacked layer's shape, as recorded in `config.json` (`moeq.layers[]`).
#[derive(Clone, Debug, PartialEq)]
pub struct CpuGeometry {
    pub layer: usize,
    /// `<layer prefix>.experts`
    pub prefix: String,
    pub experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// Static per-tensor activation scales (else dynamic per token).
    pub static_act: bool,
    pub weights: QuantArgs,
    /// `None` for weight-only layers.
    pub activation: Option<QuantArgs>,
    /// Weight-only with act-order (`g_idx`) columns.
    pub act_order: bool,
}

/// Every stacked tensor a layer of the CPU layout may have, by its name after the prefix
/// ([`CpuGeometry::specs`] names those of one record's kind).
pub const LAYOUT_TENSORS: [&str; 14] = [
    "w13_weight_packed",
    "w2_weight_packed",
    "w13_weight_scale",
    "w2_weight_scale",
    "w13_weight_zero_point",
    "w2_weight_zero_point",
    "w13_g_idx_sort_indices",
    "w2_g_idx_sort_indices",
    "w13_group_starts",
    "w2_group_starts",
    "w13_weight_sum",
    "w2_weight_sum",
    "w13_input_scale",
    "w2_input_scale",
];

fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}
fn pad4(k: usize) -> usize {
    k.div_ceil(4) * 4
}

impl CpuGeometry {
    /// Bytes of one packed `[n, k]` matrix.
    fn packed_len(n: usize, k: usize) -> usize {
        blocks(n) * BLOCK * pad4(k)
    }

    /// Scale groups along `k` input features.
    pub fn groups(&self, k: usize) -> usize {
        self.weights.scale_columns(k).unwrap_or(1)
    }

    /// Every stacked tensor: name, dtype, shape.
    pub fn specs(&self) -> Vec<(String, DType, Vec<usize>)> {
        let (e, h, i, p) = (self.experts, self.hidden, self.intermediate, &self.prefix);
        if self.activation.is_none() {
            let (g13, g2) = (self.groups(h), self.groups(i));
            let mut out = vec![
                (
                    format!("{p}.w13_weight_packed"),
                    DType::I8,
                    vec![e, 2 * i, h],
                ),
                (format!("{p}.w2_weight_packed"), DType::I8, vec![e, h, i]),
                (
                    format!("{p}.w13_weight_scale"),
                    DType::F32,
                    vec![e, 2 * i, g13],
                ),
                (format!("{p}.w2_weight_scale"), DType::F32, vec![e, h, g2]),
            ];
            if !self.weights.symmetric {
                out.push((
                    format!("{p}.w13_weight_zero_point"),
                    DType::I8,
                    vec![e, 2 * i, g13],
                ));
                out.push((
                    format!("{p}.w2_weight_zero_point"),
                    DType::I8,
                    vec![e, h, g2],
                ));
            }
            if self.act_order {
                out.push((
                    format!("{p}.w13_g_idx_sort_indices"),
                    DType::I32,
                    vec![e, 2, h],
                ));
                out.push((format!("{p}.w2_g_idx_sort_indices"), DType::I32, vec![e, i]));
                out.push((format!("{p}.w13_group_starts"), DType::I32, vec![e, 2, g13]));
                out.push((format!("{p}.w2_group_starts"), DType::I32, vec![e, g2]));
            }
            return out;
        }
        let mut out = vec![
            (
                format!("{p}.w13_weight_packed"),
                DType::I8,
                vec![e, 2 * blocks(i), pad4(h) / 4, 64],
            ),
            (
                format!("{p}.w2_weight_packed"),
                DType::I8,
                vec![e, blocks(h), pad4(i) / 4, 64],
            ),
            (
                format!("{p}.w13_weight_sum"),
                DType::I32,
                vec![e, 2 * blocks(i) * BLOCK],
            ),
            (
                format!("{p}.w2_weight_sum"),
                DType::I32,
                vec![e, blocks(h) * BLOCK],
            ),
            (format!("{p}.w13_weight_scale"), DType::F32, vec![e, 2 * i]),
            (format!("{p}.w2_weight_scale"), DType::F32, vec![e, h]),
        ];
        if self.static_act {
            out.push((format!("{p}.w13_input_scale"), DType::F32, vec![e]));
            out.push((format!("{p}.w2_input_scale"), DType::F32, vec![e]));
        }
        out
    }

    /// The `moeq.layers[]` entry.
    pub fn to_json(&self) -> Value {
        json!({
            "layer": self.layer,
            "prefix": self.prefix,
            "num_experts": self.experts,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "kind": if self.activation.is_some() { "int8_w8a8" } else { "weight_only" },
            "static_act_scales": self.static_act,
            "act_order": self.act_order,
            "weights": self.weights.weight_json(),
            "activation": self.activation.as_ref().map(QuantArgs::activation_json),
        })
    }
}

/// Whether the CPU layout holds experts of weights `w` and input activations `a`: int8 W8A8
/// ([`holds_weights`], [`holds_activation`]) or int4/int8 weight-only, grouped or
/// channelwise. A repacked checkpoint's record is checked against the same rules: the loader
/// reads the blocks whatever the record says, and the plan follows the record.
pub fn holds_scheme(w: &QuantArgs, a: Option<&QuantArgs>) -> bool {
    holds_weights(w, a.is_some()) && a.is_none_or(holds_activation)
}

/// The weights of a CPU layer: int8 channelwise symmetric under int8 activations (`w8a8`),
/// else int4 or int8, grouped or channelwise.
pub fn holds_weights(w: &QuantArgs, w8a8: bool) -> bool {
    w.qtype == QuantType::Int
        && if w8a8 {
            w.num_bits == 8 && w.strategy == Strategy::Channel && w.symmetric
        } else {
            matches!(w.num_bits, 4 | 8) && matches!(w.strategy, Strategy::Channel | Strategy::Group)
        }
}

/// The input activations of a W8A8 CPU layer: symmetric int8, dynamic per token or static per
/// tensor (the two the kernels quantise; the oracle refuses the others).
pub fn holds_activation(a: &QuantArgs) -> bool {
    a.qtype == QuantType::Int
        && a.num_bits == 8
        && a.symmetric
        && if a.is_dynamic() {
            a.strategy == Strategy::Token
        } else {
            a.strategy == Strategy::Tensor
        }
}

/// The CPU layout of `l`, or `None` when the layer has no single CPU-quantized scheme (it is
/// then copied unchanged).
pub fn geometry(l: &MoeLayer) -> Option<CpuGeometry> {
    let first = l.experts.first()?.up.clone();
    let w = first.weights()?.clone();
    let a = first.input_activations().cloned();
    let format = first.format();
    let act_order = l.act_order(&w);
    let fits = |m: &crate::scheme::module::ModuleInfo| {
        m.format() == format && m.weights() == Some(&w) && m.input_activations() == a.as_ref()
    };
    let scheme_ok = match (&a, format) {
        (Some(_), Format::IntQuantized | Format::NaiveQuantized)
        | (None, Format::PackQuantized) => holds_scheme(&w, a.as_ref()),
        _ => false,
    };
    let uniform = l.gated
        && scheme_ok
        && l.experts
            .iter()
            .all(|e| e.gate.is_some() && e.modules().all(|(_, m)| fits(m)));
    uniform.then(|| CpuGeometry {
        layer: l.layer,
        prefix: format!("{}.experts", l.prefix),
        experts: l.experts.len(),
        hidden: l.hidden_size,
        intermediate: l.intermediate_size,
        static_act: a.as_ref().is_some_and(|a| !a.is_dynamic()),
        weights: w,
        activation: a,
        act_order,
    })
}

fn le_bytes<T: Copy>(v: &[T], to: impl Fn(T) -> [u8; 4]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

fn as_i8(v: &[u8]) -> &[i8] {
    // SAFETY: u8 and i8 have the same size and alignment, and every bit pattern is valid for
    // both; the slice covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) }
}

fn as_bytes(v: &[i8]) -> &[u8] {
    // SAFETY: i8 and u8 have the same size and alignment, and every bit pattern is valid for
    // both; the slice covers exactly the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len()) }
}

/// Receives `(tensor, byte offset, bytes)` for each piece written.
pub type PartSink<'a> = dyn FnMut(&str, u64, &[u8]) -> Result<()> + 'a;

/// Packs every expert of `l` and hands each piece to `sink(tensor, byte offset, bytes)`;
/// `release(e)` after expert `e` lets the caller drop its source pages.
pub fn convert_layer(
    ckpt: &Checkpoint,
    l: &MoeLayer,
    g: &CpuGeometry,
    version: Option<&str>,
    sink: &mut PartSink<'_>,
    release: &mut dyn FnMut(usize),
) -> Result<()> {
    let p = &g.prefix;
    let (h, i) = (g.hidden, g.intermediate);
    let w13_len = 2 * CpuGeometry::packed_len(i, h);
    let w2_len = CpuGeometry::packed_len(h, i);
    let (s13, s2) = (2 * blocks(i) * BLOCK, blocks(h) * BLOCK);
    if g.activation.is_none() {
        return convert_weight_only(ckpt, l, g, version, sink, release);
    }
    for (e, x) in l.experts.iter().enumerate() {
        let ex = crate::cpu::load::expert(ckpt, x, version)?;
        let (
            Some(Linear::Int8 {
                w: gw,
                scale: gs,
                input_scale: ga,
                ..
            }),
            Linear::Int8 {
                w: uw, scale: us, ..
            },
            Linear::Int8 {
                w: dw,
                scale: ds,
                input_scale: da,
                ..
            },
        ) = (&ex.gate, &ex.up, &ex.down)
        else {
            return Err(module_error(
                &format!("{p}.{e}"),
                "is not W8A8 like expert 0",
            ));
        };
        let e64 = e as u64;
        sink(
            &format!("{p}.w13_weight_packed"),
            e64 * w13_len as u64,
            as_bytes(gw.bytes()),
        )?;
        sink(
            &format!("{p}.w13_weight_packed"),
            e64 * w13_len as u64 + gw.bytes().len() as u64,
            as_bytes(uw.bytes()),
        )?;
        sink(
            &format!("{p}.w2_weight_packed"),
            e64 * w2_len as u64,
            as_bytes(dw.bytes()),
        )?;
        let sums13: Vec<i32> = gw.wsum.iter().chain(&uw.wsum).copied().collect();
        sink(
            &format!("{p}.w13_weight_sum"),
            e64 * 4 * s13 as u64,
            &le_bytes(&sums13, i32::to_le_bytes),
        )?;
        sink(
            &format!("{p}.w2_weight_sum"),
            e64 * 4 * s2 as u64,
            &le_bytes(&dw.wsum, i32::to_le_bytes),
        )?;
        let scales13: Vec<f32> = gs.iter().chain(us).copied().collect();
        sink(
            &format!("{p}.w13_weight_scale"),
            e64 * 8 * i as u64,
            &le_bytes(&scales13, f32::to_le_bytes),
        )?;
        sink(
            &format!("{p}.w2_weight_scale"),
            e64 * 4 * h as u64,
            &le_bytes(ds, f32::to_le_bytes),
        )?;
        if g.static_act {
            let (Some(a13), Some(a2)) = (ga, da) else {
                return Err(module_error(
                    &format!("{p}.{e}"),
                    "has no static input_scale",
                ));
            };
            sink(&format!("{p}.w13_input_scale"), e64 * 4, &a13.to_le_bytes())?;
            sink(&format!("{p}.w2_input_scale"), e64 * 4, &a2.to_le_bytes())?;
        }
        release(e);
    }
    Ok(())
}

/// The parts of a weight-only linear layer as stored (row-major, sorted columns).
struct WeightOnlyParts {
    q: Vec<i8>,
    zp: Option<Vec<i8>>,
    scale: Vec<f32>,
    group_starts: Vec<usize>,
    perm: Option<Vec<u32>>,
}

fn weight_only_parts(lin: &Linear) -> Option<WeightOnlyParts> {
    let Linear::WeightOnly { n, w, perm, .. } = lin else {
        return None;
    };
    let mut parts = WeightOnlyParts {
        q: Vec::with_capacity(n * w.k),
        zp: None,
        scale: Vec::with_capacity(n * w.groups()),
        group_starts: w.group_starts().to_vec(),
        perm: perm.clone(),
    };
    for j in 0..*n {
        let (codes, scale, zp) = w.row(j);
        parts.q.extend(codes);
        parts.scale.extend(scale);
        if let Some(z) = zp {
            parts.zp.get_or_insert_with(Vec::new).extend(z);
        }
    }
    Some(parts)
}

fn convert_weight_only(
    ckpt: &Checkpoint,
    l: &MoeLayer,
    g: &CpuGeometry,
    version: Option<&str>,
    sink: &mut PartSink<'_>,
    release: &mut dyn FnMut(usize),
) -> Result<()> {
    let p = &g.prefix;
    let (h, i) = (g.hidden, g.intermediate);
    let (g13, g2) = (g.groups(h), g.groups(i));
    for (e, x) in l.experts.iter().enumerate() {
        let ex = crate::cpu::load::expert(ckpt, x, version)?;
        let parts: Vec<WeightOnlyParts> = ex
            .gate
            .iter()
            .chain([&ex.up, &ex.down])
            .filter_map(weight_only_parts)
            .collect();
        let [gate, up, down] = parts.as_slice() else {
            return Err(module_error(
                &format!("{p}.{e}"),
                "is not weight-only like expert 0",
            ));
        };
        let e64 = e as u64;
        // w13 holds gate's rows, then up's; `second` marks up.
        for (role, second, part) in [("w13", 0u64, gate), ("w13", 1, up), ("w2", 0, down)] {
            let (n, k, groups, stacked) = if role == "w13" {
                (i, h, g13, 2u64)
            } else {
                (h, i, g2, 1)
            };
            let row0 = e64 * stacked * n as u64 + second * n as u64;
            sink(
                &format!("{p}.{role}_weight_packed"),
                row0 * k as u64,
                as_bytes(&part.q),
            )?;
            sink(
                &format!("{p}.{role}_weight_scale"),
                4 * row0 * groups as u64,
                &le_bytes(&part.scale, f32::to_le_bytes),
            )?;
            if !g.weights.symmetric {
                let zp = part
                    .zp
                    .as_deref()
                    .ok_or_else(|| module_error(&format!("{p}.{e}"), "has no zero points"))?;
                sink(
                    &format!("{p}.{role}_weight_zero_point"),
                    row0 * groups as u64,
                    as_bytes(zp),
                )?;
            }
            if g.act_order {
                let identity: Vec<u32> = (0..k as u32).collect();
                let perm = part.perm.as_deref().unwrap_or(&identity);
                let slot = e64 * stacked + second;
                sink(
                    &format!("{p}.{role}_g_idx_sort_indices"),
                    4 * slot * k as u64,
                    &le_bytes(perm, |v| (v as i32).to_le_bytes()),
                )?;
                let starts: Vec<i32> = part.group_starts.iter().map(|&v| v as i32).collect();
                sink(
                    &format!("{p}.{role}_group_starts"),
                    4 * slot * groups as u64,
                    &le_bytes(&starts, i32::to_le_bytes),
                )?;
            }
        }
        release(e);
    }
    Ok(())
}

/// A weight-only layer's experts from the stored tensors, every index checked against `k` so
/// a damaged file cannot make the kernels read out of bounds.
fn load_weight_only(ckpt: &Checkpoint, g: &CpuGeometry) -> Result<Vec<CpuExpert>> {
    let p = &g.prefix;
    let (h, i) = (g.hidden, g.intermediate);
    let bad = |what: &str, reason: &str| -> crate::error::Error {
        LayoutError {
            subject: format!("{p}.{what}"),
            reason: reason.into(),
        }
        .into()
    };
    // Codes and zero points within the weights' bit width (4-bit ones in -8..=7), as the
    // source path checks them: the 4-bit storage would not hold a damaged value, and the
    // layer would then compute with it as an int8 code, silently. (A min and max over the
    // copy, which vectorise; the copy itself is the reading the load does anyway.)
    let bits = g.weights.num_bits;
    let int8 = |suffix: &str, what: &str| -> Result<Vec<i8>> {
        let view = ckpt.tensor(&format!("{p}.{suffix}"))?;
        let v: Vec<i8> = view.bytes.iter().map(|&b| b as i8).collect();
        if (1..8).contains(&bits) {
            let (lo, hi) = crate::checkpoint::file::signed_range(bits);
            let (least, most) = v
                .iter()
                .fold((i8::MAX, i8::MIN), |(l, m), &x| (l.min(x), m.max(x)));
            if i64::from(least) < lo || i64::from(most) > hi {
                let out = |x: &i8| !(lo..=hi).contains(&i64::from(*x));
                let at = v.iter().position(out).unwrap_or(0);
                return Err(crate::error::CheckpointError::Tensor {
                    path: view.path.to_path_buf(),
                    tensor: view.info.name.clone(),
                    reason: format!(
                        "element {at} is {}; {bits}-bit {what} lie in {lo}..={hi}",
                        v.get(at).copied().unwrap_or(0)
                    ),
                }
                .into());
            }
        }
        Ok(v)
    };
    let int32 = |suffix: &str| -> Result<Vec<i32>> {
        Ok(ckpt
            .tensor(&format!("{p}.{suffix}"))?
            .typed::<i32>()?
            .to_vec())
    };
    let q = [
        int8("w13_weight_packed", "integer codes")?,
        int8("w2_weight_packed", "integer codes")?,
    ];
    let sc = [
        crate::cpu::load::scales(ckpt, &format!("{p}.w13_weight_scale"))?,
        crate::cpu::load::scales(ckpt, &format!("{p}.w2_weight_scale"))?,
    ];
    let zp = if g.weights.symmetric {
        None
    } else {
        Some([
            int8("w13_weight_zero_point", "zero points")?,
            int8("w2_weight_zero_point", "zero points")?,
        ])
    };
    let order = if g.act_order {
        Some((
            [
                int32("w13_g_idx_sort_indices")?,
                int32("w2_g_idx_sort_indices")?,
            ],
            [int32("w13_group_starts")?, int32("w2_group_starts")?],
        ))
    } else {
        None
    };
    // Projection `which` (0: w13, 1: w2) of expert `e`; `second` selects up within w13.
    let proj = |e: usize, which: usize, second: usize| -> Result<Linear> {
        let (n, k, stacked) = if which == 0 { (i, h, 2) } else { (h, i, 1) };
        let groups = g.groups(k);
        let name = ["w13_weight_packed", "w2_weight_packed"][which];
        let row0 = e * stacked * n + second * n;
        let slot = e * stacked + second;
        let codes = q[which]
            .get(row0 * k..(row0 + n) * k)
            .ok_or_else(|| bad(name, "is shorter than recorded"))?
            .to_vec();
        let scale = sc[which]
            .get(row0 * groups..(row0 + n) * groups)
            .ok_or_else(|| bad(name, "has fewer scales than recorded"))?
            .to_vec();
        let zero = match &zp {
            Some(z) => Some(
                z[which]
                    .get(row0 * groups..(row0 + n) * groups)
                    .ok_or_else(|| bad(name, "has fewer zero points than recorded"))?
                    .to_vec(),
            ),
            None => None,
        };
        let (group_starts, perm) = match &order {
            None => (
                (0..groups).map(|gi| gi * (k / groups.max(1))).collect(),
                None,
            ),
            Some((perms, starts)) => {
                let perm: Vec<u32> = perms[which]
                    .get(slot * k..(slot + 1) * k)
                    .ok_or_else(|| bad("g_idx_sort_indices", "is shorter than recorded"))?
                    .iter()
                    .map(|&v| u32::try_from(v).ok().filter(|&c| (c as usize) < k))
                    .collect::<Option<_>>()
                    .ok_or_else(|| bad("g_idx_sort_indices", "holds a column outside the layer"))?;
                // Each column once: a repeated one would be counted twice and another never.
                let mut seen = vec![false; k];
                if perm
                    .iter()
                    .any(|&c| std::mem::replace(&mut seen[c as usize], true))
                {
                    return Err(bad(
                        "g_idx_sort_indices",
                        "repeats a column: not a permutation of the layer's columns",
                    ));
                }
                let gs: Vec<usize> = starts[which]
                    .get(slot * groups..(slot + 1) * groups)
                    .ok_or_else(|| bad("group_starts", "is shorter than recorded"))?
                    .iter()
                    .map(|&v| usize::try_from(v).unwrap_or(usize::MAX))
                    .collect();
                let ordered = gs.first() == Some(&0)
                    && gs.windows(2).all(|w| w[0] < w[1])
                    && gs.last().is_some_and(|&v| v < k);
                if !ordered {
                    return Err(bad(
                        "group_starts",
                        "must rise from 0 and stay below the input size",
                    ));
                }
                (gs, Some(perm))
            }
        };
        Ok(Linear::weight_only(
            n,
            k,
            &codes,
            zero.as_deref(),
            &scale,
            group_starts,
            perm,
        ))
    };
    (0..g.experts)
        .map(|e| {
            Ok(CpuExpert {
                gate: Some(proj(e, 0, 0)?),
                up: proj(e, 0, 1)?,
                down: proj(e, 1, 0)?,
            })
        })
        .collect()
}

/// The experts of a prepacked layer, read from `ckpt` (the repacked checkpoint).
pub fn load_experts(ckpt: &Checkpoint, g: &CpuGeometry) -> Result<Vec<CpuExpert>> {
    if g.activation.is_none() {
        return load_weight_only(ckpt, g);
    }
    let p = &g.prefix;
    let (h, i) = (g.hidden, g.intermediate);
    let tensor = |suffix: &str| ckpt.tensor(&format!("{p}.{suffix}"));
    let w13 = tensor("w13_weight_packed")?;
    let w2 = tensor("w2_weight_packed")?;
    let sum13 = tensor("w13_weight_sum")?;
    let sum2 = tensor("w2_weight_sum")?;
    let sum13: &[i32] = sum13.typed::<i32>()?;
    let sum2: &[i32] = sum2.typed::<i32>()?;
    let sc13 = crate::cpu::load::scales(ckpt, &format!("{p}.w13_weight_scale"))?;
    let sc2 = crate::cpu::load::scales(ckpt, &format!("{p}.w2_weight_scale"))?;
    let (a13, a2) = if g.static_act {
        (
            Some(crate::cpu::load::input_scales(
                ckpt,
                &format!("{p}.w13_input_scale"),
            )?),
            Some(crate::cpu::load::input_scales(
                ckpt,
                &format!("{p}.w2_input_scale"),
            )?),
        )
    } else {
        (None, None)
    };
    let half = CpuGeometry::packed_len(i, h);
    let w2_len = CpuGeometry::packed_len(h, i);
    let (s13, s2) = (2 * blocks(i) * BLOCK, blocks(h) * BLOCK);
    let bad = |what: &str| -> crate::error::Error {
        LayoutError {
            subject: format!("{p}.{what}"),
            reason: "does not match the recorded CPU layout".into(),
        }
        .into()
    };
    let (w13b, w2b) = (w13.bytes, w2.bytes);
    if w13b.len() != g.experts * 2 * half || w2b.len() != g.experts * w2_len {
        return Err(bad("w13_weight_packed / w2_weight_packed"));
    }
    if sum13.len() != g.experts * s13 || sum2.len() != g.experts * s2 {
        return Err(bad("w13_weight_sum / w2_weight_sum"));
    }
    if sc13.len() != g.experts * 2 * i || sc2.len() != g.experts * h {
        return Err(bad("w13_weight_scale / w2_weight_scale"));
    }
    // One copy, file pages -> the layer's huge-page arena; the experts point into it.
    let (arena, at) = crate::cpu::arena::Arena::build(&[as_i8(w13b), as_i8(w2b)]);
    let act = |a: &Option<Vec<f32>>, e: usize| a.as_ref().and_then(|v| v.get(e).copied());
    let mut out = Vec::with_capacity(g.experts);
    for e in 0..g.experts {
        let base = e * 2 * half;
        let lin =
            |n: usize, k: usize, offset: usize, sums: &[i32], scale: &[f32], a: Option<f32>| {
                PackedI8::from_shared(n, k, &arena, offset, sums.to_vec())
                    .map(|w| Linear::Int8 {
                        n,
                        k,
                        w,
                        scale: scale.to_vec(),
                        input_scale: a,
                    })
                    .ok_or_else(|| bad("w13_weight_packed"))
            };
        let bi = blocks(i) * BLOCK;
        let gate = lin(
            i,
            h,
            at[0] + base,
            &sum13[e * s13..e * s13 + bi],
            &sc13[e * 2 * i..e * 2 * i + i],
            act(&a13, e),
        )?;
        let up = lin(
            i,
            h,
            at[0] + base + half,
            &sum13[e * s13 + bi..(e + 1) * s13],
            &sc13[e * 2 * i + i..(e + 1) * 2 * i],
            act(&a13, e),
        )?;
        let down = lin(
            h,
            i,
            at[1] + e * w2_len,
            &sum2[e * s2..(e + 1) * s2],
            &sc2[e * h..(e + 1) * h],
            act(&a2, e),
        )?;
        out.push(CpuExpert {
            gate: Some(gate),
            up,
            down,
        });
    }
    Ok(out)
}
