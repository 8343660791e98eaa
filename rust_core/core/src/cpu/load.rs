//! Building [`CpuMoe`] layers from an opened checkpoint.

use super::linear::Linear;
use super::moe::{CpuExpert, CpuMoe};
use crate::checkpoint::Checkpoint;
use crate::error::{module_error, CheckpointError, ConfigError, Result, UnsupportedSchemeError};
use crate::model::Model;
use crate::moe::{ExpertModules, MoeLayer};
use crate::oracle::{Backend, CpuFeatures, Method, Options, Platform};
use crate::quant::pack::{field, PackVariant};
use crate::scheme::module::{ModuleInfo, ZeroPointLayout};
use crate::scheme::{ActOrder, Format, Strategy};

/// A float tensor (BF16, F16 or F32) as f32 values.
pub fn floats(ckpt: &Checkpoint, name: &str) -> Result<Vec<f32>> {
    crate::quant::dequant::float_values(&ckpt.tensor(name)?)
}

/// int8 weight codes (`int-quantized`), read by the stored dtype's values, as
/// `Checkpoint::dequantize` and compressed-tensors read them: I8 as it is, and I16, I32 or U8
/// (which opening accepts for 8-bit codes) converted, every value within -128..=127
/// ([`crate::checkpoint::TensorView::signed_codes`]), the codes the int8 kernels hold. (Their
/// raw bytes read as int8 gave wrong results without an error.)
pub fn int8_codes(ckpt: &Checkpoint, name: &str) -> Result<Vec<i8>> {
    let view = ckpt.tensor(name)?;
    if view.info.dtype == crate::checkpoint::DType::I8 {
        return Ok(view.bytes.iter().map(|&b| b as i8).collect());
    }
    // In range, so each fits an i8.
    Ok(view.signed_codes(8)?.into_iter().map(|v| v as i8).collect())
}

/// A scale tensor (weight or static activation scales) as f32 values, every one finite: a NaN
/// or infinite scale turns each token routed through it into NaN, and from there the whole
/// sequence, so it is refused at load, naming the file, tensor and element.
pub fn scales(ckpt: &Checkpoint, name: &str) -> Result<Vec<f32>> {
    let view = ckpt.tensor(name)?;
    let v = crate::quant::dequant::float_values(&view)?;
    match first_non_finite(&v) {
        None => Ok(v),
        Some((i, x)) => Err(CheckpointError::Tensor {
            path: view.path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!("element {i} is {x}; scales must be finite"),
        }
        .into()),
    }
}

/// Static activation scales (`input_scale`): finite ([`scales`]) and positive. The quantiser
/// divides by the scale: zero has no codes to give, and a negative scale only comes from a
/// damaged checkpoint (compressed-tensors stores `max|x| / 127`); either would silently zero or
/// flip every token routed through the expert.
pub fn input_scales(ckpt: &Checkpoint, name: &str) -> Result<Vec<f32>> {
    let v = scales(ckpt, name)?;
    match v.iter().position(|&x| x <= 0.0) {
        None => Ok(v),
        Some(i) => Err(CheckpointError::Tensor {
            path: ckpt.tensor(name)?.path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!(
                "element {i} is {}; static activation scales must be positive",
                v[i]
            ),
        }
        .into()),
    }
}

/// Gate and up projections of one expert see the same input, so under static activation
/// quantisation they must carry one scale (DESIGN.md); different ones are refused, naming both.
pub fn same_static_scale(gate: &str, up: &str, a: f32, b: f32) -> Result<()> {
    if a.to_bits() == b.to_bits() {
        return Ok(());
    }
    Err(UnsupportedSchemeError {
        subject: format!("'{gate}' and '{up}'"),
        reason: format!(
            "static input scales differ ({a} vs {b}); gate and up see the same input and must \
             share one"
        ),
    }
    .into())
}

/// The first NaN or infinite value and its index.
pub(crate) fn first_non_finite(v: &[f32]) -> Option<(usize, f32)> {
    v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i]))
}

/// One module as a CPU linear layer.
pub fn linear(ckpt: &Checkpoint, m: &ModuleInfo, version: Option<&str>) -> Result<Linear> {
    let (n, k) = (m.out_features, m.in_features);
    let Some(w) = m.weights() else {
        return Ok(Linear::Dense {
            n,
            k,
            w: floats(ckpt, &m.weight_tensor)?,
        });
    };
    let unsupported = |reason: String| -> crate::error::Error {
        UnsupportedSchemeError {
            subject: format!("module '{}'", m.name),
            reason,
        }
        .into()
    };
    let name = &m.name;
    match (m.format(), m.input_activations()) {
        // compressed-tensors writes int8 codes alike under both names (its naive compressor
        // is the int one's fallback), and the oracle plans both onto this path.
        (Format::IntQuantized | Format::NaiveQuantized, Some(a)) => {
            if w.num_bits != 8 || w.strategy != Strategy::Channel || !w.symmetric || !a.symmetric {
                return Err(unsupported("the CPU int8 path needs symmetric channelwise int8 weights and symmetric activations".into()));
            }
            let q = int8_codes(ckpt, &m.weight_tensor)?;
            let scale = scales(ckpt, &format!("{name}.weight_scale"))?;
            let input_scale = if a.is_dynamic() {
                None
            } else {
                input_scales(ckpt, &format!("{name}.input_scale"))?
                    .first()
                    .copied()
            };
            Ok(Linear::int8(n, k, q, scale, input_scale))
        }
        (Format::PackQuantized, None) => {
            let bits = w.num_bits;
            let variant = PackVariant::for_version(version);
            let offset = 1i32 << (bits - 1);
            let words: &[u32] = ckpt.tensor(&m.weight_tensor)?.typed::<u32>()?;
            let kw = (k * bits as usize).div_ceil(32);
            let groups = match w.strategy {
                Strategy::Group => k / w.group_size.max(1) as usize,
                Strategy::Channel => 1,
                s => {
                    return Err(unsupported(format!(
                        "strategy \"{}\" is not a weight-only CPU scheme",
                        s.name()
                    )))
                }
            };
            // Column order: act-order sorts columns by group so each group is contiguous.
            let (col_group, perm): (Vec<u32>, Vec<u32>) =
                if m.has_g_idx && w.actorder == Some(ActOrder::Group) {
                    let (g, perm) = crate::repack::moe_layer::g_idx_and_perm(ckpt, m, k, groups)?;
                    (g.into_iter().map(|g| g as u32).collect(), perm)
                } else {
                    let per = k / groups.max(1);
                    (
                        (0..k).map(|c| (c / per.max(1)) as u32).collect(),
                        (0..k as u32).collect(),
                    )
                };
            let identity = perm.iter().enumerate().all(|(i, &p)| i as u32 == p);
            let mut q = vec![0i8; n * k];
            for r in 0..n {
                let word = |i: usize| words.get(r * kw + i).copied().unwrap_or(0);
                for (j, &c) in perm.iter().enumerate() {
                    q[r * k + j] = (field(word, c as usize, bits, variant) as i32 - offset) as i8;
                }
            }
            let mut group_starts = Vec::with_capacity(groups);
            let mut last = u32::MAX;
            for (j, &c) in perm.iter().enumerate() {
                let g = col_group.get(c as usize).copied().unwrap_or(0);
                if g != last {
                    group_starts.push(j);
                    last = g;
                }
            }
            if group_starts.len() != groups {
                return Err(module_error(
                    name,
                    format!(
                        "g_idx names {} groups, the scales have {groups}",
                        group_starts.len()
                    ),
                ));
            }
            let scale = scales(ckpt, &format!("{name}.weight_scale"))?;
            let zp = match m.zero_point {
                None => None,
                // Within the codes' range (at most 8 bits here), so each fits an i8.
                Some(ZeroPointLayout::Unpacked) => Some(
                    ckpt.tensor(&format!("{name}.weight_zero_point"))?
                        .signed_codes(bits)?
                        .into_iter()
                        .map(|v| v as i8)
                        .collect(),
                ),
                Some(ZeroPointLayout::Packed) => {
                    let zw: &[u32] = ckpt
                        .tensor(&format!("{name}.weight_zero_point"))?
                        .typed::<u32>()?;
                    let mut z = vec![0i8; n * groups];
                    for g in 0..groups {
                        let word = |i: usize| zw.get(i * groups + g).copied().unwrap_or(0);
                        for r in 0..n {
                            z[r * groups + g] =
                                (field(word, r, bits, variant) as i32 - offset) as i8;
                        }
                    }
                    Some(z)
                }
            };
            Ok(Linear::weight_only(
                n,
                k,
                &q,
                zp.as_deref(),
                &scale,
                group_starts,
                (!identity).then_some(perm),
            ))
        }
        (f, _) => Err(unsupported(format!(
            "format \"{}\" has no CPU kernel",
            f.name()
        ))),
    }
}

/// One expert's projections as CPU linear layers.
pub fn expert(ckpt: &Checkpoint, e: &ExpertModules, version: Option<&str>) -> Result<CpuExpert> {
    let gate = match &e.gate {
        Some(g) => Some(linear(ckpt, g, version)?),
        None => None,
    };
    let up = linear(ckpt, &e.up, version)?;
    if let (
        Some(Linear::Int8 {
            input_scale: Some(a),
            ..
        }),
        Linear::Int8 {
            input_scale: Some(b),
            ..
        },
    ) = (&gate, &up)
    {
        let gname = e.gate.as_ref().map_or("gate_proj", |g| g.name.as_str());
        same_static_scale(gname, &e.up.name, *a, *b)?;
    }
    Ok(CpuExpert {
        gate,
        up,
        down: linear(ckpt, &e.down, version)?,
    })
}

/// The CPU MoE of decoder layer `layer`, after checking that the oracle plans it onto
/// `cpu_simd` (or that it is unquantized).
pub fn moe_layer(model: &Model, layer: usize) -> Result<CpuMoe> {
    if let Some(g) = model
        .layout()
        .and_then(|l| l.cpu_layers.iter().find(|g| g.layer == layer))
    {
        return prepacked_layer(model, g);
    }
    if let Some(why) = model.layout_refusal(layer, Platform::Cpu(CpuFeatures::detect())) {
        return Err(UnsupportedSchemeError {
            subject: format!("layer {layer}"),
            reason: why,
        }
        .into());
    }
    let l: &MoeLayer = model
        .moe_layers()
        .iter()
        .find(|l| l.layer == layer)
        .ok_or_else(|| {
            // Repacked layers are MoE layers too, though not in source form.
            let mut have: Vec<usize> = model.moe_layers().iter().map(|l| l.layer).collect();
            if let Some(layout) = model.layout() {
                have.extend(layout.layers.iter().map(|l| l.layer));
                have.extend(layout.cpu_layers.iter().map(|l| l.layer));
            }
            have.sort_unstable();
            have.dedup();
            module_error(
                &format!("layer {layer}"),
                format!("is not an MoE layer of this checkpoint (MoE layers: {have:?})"),
            )
        })?;
    check_layer_config(model, &l.prefix, l.experts.len())?;
    if let Some(e) = model.shared_expert_problem(l) {
        return Err(e);
    }
    let plan = crate::oracle::plan_layer(
        &Model::layer_input(l),
        Platform::Cpu(CpuFeatures::detect()),
        Options::default(),
    );
    if plan.method != Method::Unquantized && plan.backend != Some(Backend::CpuSimd) {
        return Err(UnsupportedSchemeError {
            subject: format!("{} (layer {layer})", l.prefix),
            reason: plan.error.unwrap_or_else(|| "no CPU plan".into()),
        }
        .into());
    }
    let ckpt = model.checkpoint();
    let version = model.quantization_config().and_then(|q| q.version.clone());
    let experts = l
        .experts
        .iter()
        .map(|e| expert(ckpt, e, version.as_deref()))
        .collect::<Result<Vec<_>>>()?;
    let shared = match &l.shared_experts {
        Some(s) => Some(expert(ckpt, s, version.as_deref())?),
        None => None,
    };
    let shared_gate = l.shared_expert_gate.as_ref().map(|g| format!("{g}.weight"));
    let bias = l.correction_bias.clone();
    assemble(
        model,
        &l.prefix,
        l.hidden_size,
        experts,
        shared,
        shared_gate,
        bias,
    )
}

/// `name` as f32 values, which must number `want`.
fn vector(ckpt: &Checkpoint, name: &str, want: usize) -> Result<Vec<f32>> {
    let v = floats(ckpt, name)?;
    if v.len() != want {
        return Err(module_error(
            name,
            format!("holds {} values, expected {want}", v.len()),
        ));
    }
    Ok(v)
}

/// The CPU computes what `config.json` describes for a layer of `experts` experts
/// ([`Model::cpu_layer_check`]), checked before any expert is loaded: an activation, scoring
/// function, model family or router-weight placement no kernel has is an
/// `UnsupportedSchemeError`, inconsistent routing keys a `ConfigError` naming the key.
fn check_layer_config(model: &Model, prefix: &str, experts: usize) -> Result<()> {
    if let Some(part) = model.unsupported_part(prefix) {
        return Err(part.error().into());
    }
    if let Some(e) = model.correction_bias_problem(prefix, experts) {
        return Err(e);
    }
    let file = model.checkpoint().config_path();
    model
        .cpu_layer_check(prefix, experts)
        .map_err(|(key, reason)| match key {
            "hidden_act" | "scoring_func" | "model_type" | "moe_apply_router_weight_on_input" => {
                UnsupportedSchemeError {
                    subject: format!("{}: {key}", file.display()),
                    reason,
                }
                .into()
            }
            _ => ConfigError {
                file,
                key: key.to_string(),
                reason,
            }
            .into(),
        })
}

/// The layer from its experts plus the tensors named: the shared expert gate (`[hidden]`) and
/// the router's correction bias (`[experts]`); routing from the model config.
fn assemble(
    model: &Model,
    prefix: &str,
    hidden: usize,
    experts: Vec<CpuExpert>,
    shared: Option<CpuExpert>,
    shared_gate: Option<String>,
    correction_bias: Option<String>,
) -> Result<CpuMoe> {
    let ckpt = model.checkpoint();
    let shared_gate = match shared_gate {
        Some(name) => Some(vector(ckpt, &name, hidden)?),
        None => None,
    };
    let correction_bias = match correction_bias {
        Some(name) => Some(vector(ckpt, &name, experts.len())?),
        None => None,
    };
    let top_k = model
        .routing()
        .top_k
        .ok_or_else(|| module_error(prefix, "config.json has no num_experts_per_tok"))?;
    let mut moe = CpuMoe {
        hidden,
        experts,
        shared,
        shared_gate,
        routing: model.routing().clone(),
        top_k,
        correction_bias,
        widest: Default::default(),
    };
    moe.consolidate();
    Ok(moe)
}

/// A layer of a `moeq repack --target cpu` checkpoint: experts from the stored packed blocks,
/// router, shared experts and their gate from the copied source tensors.
fn prepacked_layer(model: &Model, g: &crate::repack::cpu::CpuGeometry) -> Result<CpuMoe> {
    let lp = g.prefix.strip_suffix(".experts").unwrap_or(&g.prefix);
    check_layer_config(model, lp, g.experts)?;
    let ckpt = model.checkpoint();
    let version = model.quantization_config().and_then(|q| q.version.clone());
    let experts = crate::repack::cpu::load_experts(ckpt, g)?;
    let mut shared = None;
    for s in crate::moe::SHARED_EXPERT_NAMES {
        let sp = format!("{lp}.{s}");
        if let Ok(up) = model.module(&format!("{sp}.up_proj")) {
            let modules = ExpertModules {
                gate: model.module(&format!("{sp}.gate_proj")).ok().cloned(),
                up: up.clone(),
                down: model.module(&format!("{sp}.down_proj"))?.clone(),
            };
            shared = Some(expert(ckpt, &modules, version.as_deref())?);
            break;
        }
    }
    let gate_name = format!("{lp}.shared_expert_gate.weight");
    let bias = crate::moe::find_correction_bias(ckpt, lp);
    assemble(
        model,
        lp,
        g.hidden,
        experts,
        shared,
        ckpt.contains(&gate_name).then_some(gate_name),
        bias,
    )
}
