//! From stored schemes to an [`ExpertKind`], or the reason no moeq_rs backend family can run it.

use super::types::{ExpertKind, ExpertSchemes, ProjScheme, QuantConfig, QuantKind};
use crate::scheme::{ActOrder, Format, QuantArgs, QuantType, Strategy};

/// A short human description of a projection scheme: `int4 g128 sym`, `int8 channel + int8 token dynamic`.
pub fn describe(p: &ProjScheme) -> String {
    let Some(w) = &p.weights else {
        return "unquantized".into();
    };
    let t = match w.qtype {
        QuantType::Int => "int",
        QuantType::Float => "float",
    };
    let group = match w.strategy {
        Strategy::Group => format!("g{}", w.group_size),
        s => s.name().to_string(),
    };
    let mut s = format!(
        "{t}{} {group}{}",
        w.num_bits,
        if w.symmetric { "" } else { " asym" }
    );
    if w.actorder == Some(ActOrder::Group) {
        s.push_str(" act-order");
    }
    if let Some(a) = &p.activation {
        let at = match a.qtype {
            QuantType::Int => "int",
            QuantType::Float => "float",
        };
        s.push_str(&format!(
            " + {at}{} {} {}{}",
            a.num_bits,
            a.strategy.name(),
            if a.is_dynamic() { "dynamic" } else { "static" },
            if a.symmetric { "" } else { " asym" }
        ));
    }
    s
}

/// The one scheme of an expert: gate, up and down must agree (w13 and w2 share one kernel type).
pub fn expert_scheme(e: &ExpertSchemes) -> Result<&ProjScheme, String> {
    let projections = e
        .gate
        .iter()
        .map(|g| ("gate_proj", g))
        .chain([("up_proj", &e.up), ("down_proj", &e.down)]);
    let mut first: Option<(&str, &ProjScheme)> = None;
    for (name, p) in projections {
        match first {
            None => first = Some((name, p)),
            Some((fname, f)) if f != p => {
                return Err(format!(
                    "{fname} is {} but {name} is {}: one expert needs one scheme for all its projections",
                    describe(f),
                    describe(p)
                ))
            }
            Some(_) => {}
        }
    }
    Ok(first.map_or(&e.up, |(_, p)| p))
}

/// Classifies a projection scheme. The error says what is wrong in terms a user can act on.
pub fn classify(p: &ProjScheme) -> Result<ExpertKind, String> {
    let Some(w) = &p.weights else {
        return Ok(ExpertKind::Unquantized);
    };
    if w.qtype == QuantType::Float {
        return Err(format!(
            "float {}-bit weights are not an int scheme: moeq_rs runs int4/int8 weights only",
            w.num_bits
        ));
    }
    if w.is_dynamic() {
        return Err("dynamic weight quantization is not a storage scheme".into());
    }
    match &p.activation {
        None => classify_weight_only(w, p.format),
        Some(a) => classify_w8a8(w, a, p.format),
    }
}

fn classify_weight_only(w: &QuantArgs, format: Format) -> Result<ExpertKind, String> {
    match w.strategy {
        Strategy::Group | Strategy::Channel => {}
        s => {
            return Err(format!(
                "weight-only int{} with strategy \"{}\" is not supported: weight-only MoE needs group or channel weights (vLLM crashes here with AttributeError)",
                w.num_bits,
                s.name()
            ))
        }
    }
    if !matches!(w.num_bits, 4 | 8) {
        return Err(format!(
            "{}-bit weights are not supported: moeq_rs backends run 4- and 8-bit weights",
            w.num_bits
        ));
    }
    if format != Format::PackQuantized {
        return Err(format!(
            "weight-only MoE needs format \"pack-quantized\", found \"{}\"",
            format.name()
        ));
    }
    Ok(ExpertKind::Wna16 {
        bits: w.num_bits,
        group_size: w.group_size,
        symmetric: w.symmetric,
        act_order: w.actorder == Some(ActOrder::Group),
    })
}

fn classify_w8a8(w: &QuantArgs, a: &QuantArgs, format: Format) -> Result<ExpertKind, String> {
    if a.qtype != QuantType::Int || a.num_bits != 8 {
        return Err(format!(
            "{}{}-bit activations are not supported: only int8 activations are",
            if a.qtype == QuantType::Int {
                "int"
            } else {
                "float "
            },
            a.num_bits
        ));
    }
    if w.num_bits != 8 {
        return Err(format!(
            "int{} weights with int8 activations (W{}A8) are not supported: activation quantization needs int8 weights",
            w.num_bits, w.num_bits
        ));
    }
    if w.strategy != Strategy::Channel {
        return Err(format!(
            "W8A8 needs channelwise int8 weights, found strategy \"{}\"",
            w.strategy.name()
        ));
    }
    if !w.symmetric {
        return Err(
            "asymmetric int8 weights are not supported by any backend (cpu_simd, cuda_int8_w8a8 and cuda_marlin_wna16 all need symmetric int8 weights)"
                .into(),
        );
    }
    if !a.symmetric {
        return Err(format!(
            "asymmetric {} int8 activations are not supported (rejected rather than run as symmetric)",
            if a.is_dynamic() { "dynamic" } else { "static" }
        ));
    }
    let static_act = match (a.strategy, a.is_dynamic()) {
        (Strategy::Token, true) => false,
        (Strategy::Tensor, false) => true,
        (s, d) => {
            return Err(format!(
                "{} per-{} int8 activations are not supported: use dynamic per-token or static per-tensor",
                if d { "dynamic" } else { "static" },
                s.name()
            ))
        }
    };
    if format != Format::IntQuantized && format != Format::NaiveQuantized {
        return Err(format!(
            "W8A8 MoE needs int8 weights stored as \"int-quantized\" or \"naive-quantized\", found \"{}\"",
            format.name()
        ));
    }
    Ok(ExpertKind::W8a8 { static_act })
}

/// The scale kind of a weight-only scheme (vLLM's `kInt4Static32GroupScale` /
/// `kInt4StaticGroupScale` / `kInt8StaticGroupScale`, with channelwise and group kept apart).
pub fn wna16_scale_kind(num_bits: u32, group_size: i64) -> Result<&'static str, String> {
    match (num_bits, group_size) {
        (_, g) if g == 0 || g < -1 => Err(format!(
            "group_size {g} is invalid (a positive group size, or -1/None for channelwise)"
        )),
        (4, 32) => Ok("int4_static_group32"),
        (4, -1) => Ok("int4_static_channel"),
        (4, _) => Ok("int4_static_group"),
        (8, -1) => Ok("int8_static_channel"),
        (8, _) => Ok("int8_static_group"),
        (b, _) => Err(format!(
            "num_bits {b} is not a weight-only MoE width (4 or 8)"
        )),
    }
}

/// The scale kind and quant config of a classified expert kind.
pub fn scale_and_config(kind: ExpertKind) -> (Option<&'static str>, Option<QuantConfig>) {
    match kind {
        ExpertKind::Unquantized => (None, None),
        ExpertKind::Wna16 {
            bits, group_size, ..
        } => (
            wna16_scale_kind(bits, group_size).ok(),
            Some(QuantConfig {
                kind: if bits == 4 {
                    QuantKind::Int4W4a16
                } else {
                    QuantKind::Int8W8a16
                },
                per_act_token_quant: false,
                group_size,
                static_act_scales: false,
            }),
        ),
        ExpertKind::W8a8 { static_act } => (
            Some(if static_act {
                "int8_channel_static_tensor"
            } else {
                "int8_channel_dynamic_token"
            }),
            Some(QuantConfig {
                kind: QuantKind::Int8W8a8,
                per_act_token_quant: !static_act,
                group_size: -1,
                static_act_scales: static_act,
            }),
        ),
    }
}

/// vLLM's fixed `make_int8_moe_quant_config` truth table (post-#50833): which config kind a
/// pair of activation scales and the per-token flag produce.
pub fn int8_moe_quant_kind(
    has_a1_scale: bool,
    has_a2_scale: bool,
    per_act_token_quant: bool,
) -> Result<QuantKind, String> {
    match (has_a1_scale, has_a2_scale, per_act_token_quant) {
        (true, false, _) | (false, true, _) => {
            Err("a1_scale and a2_scale must both be provided or both be None".into())
        }
        (false, false, false) => Ok(QuantKind::Int8W8a16),
        (false, false, true) | (true, true, _) => Ok(QuantKind::Int8W8a8),
    }
}
