//! What vLLM main @7cfb97e33791 (2026-08-20) would do with a layer, and which of its known
//! regressions concern it (`reference/vllm_moe_oracle.md` §2-§7). A model of vLLM's behaviour,
//! bugs included, so that a user learns before a long load fails.

use super::backends::{marlin_support_reason, WNA16_GROUP_SIZES};
use super::types::{LayerInput, Platform, ProjScheme};
use crate::scheme::config::{QuantizationConfig, Scheme, Target};
use crate::scheme::{Format, QuantArgs, QuantType, Strategy};

pub const VLLM_SNAPSHOT: &str = "7cfb97e33791";

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VllmVerdict {
    pub method: Option<String>,
    pub backend: Option<String>,
    pub error: Option<String>,
    /// Silent misbehaviour that raises nothing.
    pub notes: Vec<String>,
}

/// A known vLLM regression that concerns a layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Regression {
    pub id: &'static str,
    pub prs: &'static str,
    pub summary: &'static str,
}

fn verdict_error(method: Option<&str>, error: String) -> VllmVerdict {
    VllmVerdict {
        method: method.map(str::to_string),
        backend: None,
        error: Some(error),
        notes: Vec::new(),
    }
}

fn args_repr(a: Option<&QuantArgs>) -> String {
    match a {
        None => "None".into(),
        Some(a) => format!(
            "num_bits={} type={} strategy={} group_size={} symmetric={} dynamic={}",
            a.num_bits,
            if a.qtype == QuantType::Int {
                "int"
            } else {
                "float"
            },
            a.strategy.name(),
            if a.spelling.group_size_null {
                "None".to_string()
            } else {
                a.group_size.to_string()
            },
            a.symmetric,
            a.is_dynamic()
        ),
    }
}

/// vLLM's act-order test is an enum comparison (aliases count) in the method, but a string
/// comparison with "group" in Triton's rejection and in the non-Marlin assert.
fn actorder_enum(w: &QuantArgs) -> bool {
    w.strategy == Strategy::Group && w.actorder == Some(crate::scheme::ActOrder::Group)
}
fn actorder_string_is_group(w: &QuantArgs) -> bool {
    w.spelling.actorder.as_deref() == Some("group")
        || w.spelling.actorder.as_deref() == Some("true")
}

/// How vLLM's `CompressedTensorsConfig.from_config` fails on this config, before any layer is
/// looked at (the whole model does not load); None where it gets past the two checks modelled
/// here, in its order:
/// - it reads every config group as an object with `"targets"`: a preset group (a list,
///   `{"W4A16": ["Linear"]}`) is a TypeError;
/// - it drops groups whose single target ends in "Attention", then (in
///   `_quantization_scheme_map_from_config`) asserts float weights for a group read with an
///   activation-quantization format (`naive-quantized`, `int-quantized`, `float-quantized` or
///   `nvfp4-pack-quantized`, its own or the global one) but without `input_activations` (its FP8
///   weight-only case; an empty `{}` counts as none, being falsy): integer weight-only groups in
///   those formats fail a bare assert.
pub fn config_parse_error(qc: &QuantizationConfig) -> Option<String> {
    if let Some(g) = qc.groups.iter().find(|g| g.preset) {
        return Some(format!(
            "TypeError: list indices must be integers or slices, not str (vLLM reads every config \
             group as an object with \"targets\"; group \"{}\" is in preset form, a list of \
             targets)",
            g.name
        ));
    }
    // vLLM tests the raw target string; a regex's `re:` prefix cannot end one in "Attention".
    let attention_only = |g: &Scheme| {
        matches!(g.targets.as_slice(), [Target::Name(t) | Target::Regex { pattern: t, .. }]
            if t.ends_with("Attention"))
    };
    qc.groups
        .iter()
        .filter(|g| !attention_only(g))
        .find_map(|g| {
            let format = g.declared_format?;
            let activation_format = matches!(
                format,
                Format::NaiveQuantized
                    | Format::IntQuantized
                    | Format::FloatQuantized
                    | Format::NvFp4PackQuantized
            );
            let int_weights = g.weights.as_ref()?.qtype == QuantType::Int;
            (activation_format
                && g.vllm_input_activations().is_none()
                && int_weights
                && !g.targets.is_empty())
            .then(|| {
                format!(
                    "AssertionError (while parsing quantization_config, before any layer: config \
                     group \"{}\" is read with the activation-quantization format \"{}\"{} and \
                     has {}, so vLLM asserts that its weights are float; they are int, and the \
                     model does not load)",
                    g.name,
                    format.name(),
                    if qc.format == Some(format) {
                        ", the config's global format,"
                    } else {
                        ""
                    },
                    if g.empty_input_activations {
                        "an empty input_activations ({}), which vLLM reads as none"
                    } else {
                        "no input_activations"
                    }
                )
            })
        })
}

/// What vLLM would do for this layer on `platform`.
pub fn vllm_layer(input: &LayerInput, platform: Platform, tp_size: usize) -> VllmVerdict {
    let Some(e0) = input.experts.first() else {
        return verdict_error(None, "the layer has no experts".into());
    };
    // vLLM looks at expert 0's gate/up/down only, and needs them equal.
    let projections: Vec<&ProjScheme> = e0.gate.iter().chain([&e0.up, &e0.down]).collect();
    let s0 = projections.first().copied().unwrap_or(&e0.up);
    if projections.iter().any(|p| *p != s0) {
        return verdict_error(
            None,
            "ValueError: All MoE projections need to have same quantization scheme but found multiple".into(),
        );
    }
    let mut v = vllm_scheme(s0, input, platform, tp_size);
    let others: Vec<usize> = input
        .experts
        .iter()
        .enumerate()
        .filter(|(_, x)| x.up != e0.up || x.down != e0.down || x.gate != e0.gate)
        .map(|(i, _)| i)
        .collect();
    if let (Some(first), None) = (others.first(), v.error.as_ref()) {
        v.error = Some(format!(
            "vLLM applies expert 0's scheme to every expert of the layer; expert {first}{} is stored with another scheme and fails to load (weight shape mismatch) or is mis-decoded",
            if others.len() > 1 { format!(" and {} more", others.len() - 1) } else { String::new() }
        ));
    }
    v
}

fn vllm_scheme(
    s: &ProjScheme,
    input: &LayerInput,
    platform: Platform,
    tp_size: usize,
) -> VllmVerdict {
    let Some(w) = &s.weights else {
        return VllmVerdict {
            method: Some("UnquantizedFusedMoEMethod".into()),
            ..VllmVerdict::default()
        };
    };
    let a = s.activation.as_ref();
    let float = |bits: u32, strategy: Strategy, group: i64, w: &QuantArgs| {
        w.qtype == QuantType::Float
            && w.num_bits == bits
            && w.strategy == strategy
            && w.group_size == group
            && w.symmetric
    };
    let float_method = |method: &str| VllmVerdict {
        method: Some(method.into()),
        notes: vec!["float schemes are outside this report".into()],
        ..VllmVerdict::default()
    };
    // Rows 1 and 2, before the weight-only row that their group-32 weights also match: MXFP4,
    // and MXFP8 (uint8 scales, which its `mxfp8-quantized` format stands for here; the
    // config's `scale_dtype` is not read).
    if float(4, Strategy::Group, 32, w) {
        return float_method("CompressedTensorsW4A4Mxfp4MoEMethod");
    }
    if float(8, Strategy::Group, 32, w) && s.format == Format::MxFp8Quantized {
        return float_method("CompressedTensorsW8A8Mxfp8MoEMethod");
    }
    // Row 3: weight-only group/channel (no type check, no symmetry check).
    if matches!(w.strategy, Strategy::Group | Strategy::Channel) && a.is_none() && !w.is_dynamic() {
        return vllm_wna16(
            w,
            s.vllm_format.unwrap_or(Some(s.format)),
            input,
            platform,
            tp_size,
        );
    }
    // Row 4: NVFP4 weights (tensor_group of 16), with NVFP4 activations or none.
    if float(4, Strategy::TensorGroup, 16, w) {
        let method = "CompressedTensorsW4A4Nvfp4MoEMethod";
        if a.is_some_and(|a| !float(4, Strategy::TensorGroup, 16, a)) {
            return verdict_error(
                Some(method),
                "ValueError (vLLM takes NVFP4 MoE weights with NVFP4 activations or none)".into(),
            );
        }
        return float_method(method);
    }
    if w.qtype == QuantType::Float {
        return VllmVerdict {
            method: Some("CompressedTensorsW8A8Fp8MoEMethod (or another float method)".into()),
            notes: vec!["float schemes are outside this report".into()],
            ..VllmVerdict::default()
        };
    }
    let Some(a) = a else {
        // Row 6 reads `input_quant.num_bits` on None.
        return verdict_error(
            None,
            "AttributeError: 'NoneType' object has no attribute 'num_bits'".into(),
        );
    };
    // Row 6: dynamic per-token int8 W8A8.
    if w.num_bits == 8
        && a.num_bits == 8
        && matches!(w.strategy, Strategy::Tensor | Strategy::Channel)
        && a.strategy == Strategy::Token
        && !w.is_dynamic()
        && a.is_dynamic()
        && w.symmetric
    {
        let method = "CompressedTensorsW8A8Int8MoEMethod";
        if w.strategy != Strategy::Channel {
            return verdict_error(
                Some(method),
                "ValueError: For INT8 Fused MoE layers, we require channelwise, dynamic per token quantization.".into(),
            );
        }
        let mut v = VllmVerdict {
            method: Some(method.into()),
            ..VllmVerdict::default()
        };
        if !a.symmetric {
            v.notes.push(
                "asymmetric activations are silently run as symmetric (kInt8DynamicTokenSym)"
                    .into(),
            );
        }
        let i_pp = input.shape.intermediate / tp_size.max(1);
        // Priority [TRITON, HUMMING, CPU]; Humming (a default dependency of vLLM's CUDA
        // build) takes what Triton's expert limit refuses.
        match platform {
            Platform::Cuda { sm } if sm >= 75 => {
                if input.shape.num_experts.div_ceil(32) * 32 < 1024 {
                    v.backend = Some("TRITON".into());
                } else {
                    v.backend = Some("HUMMING".into());
                }
            }
            // CPUExpertsInt8 (x86 with AMX) or ArmCPUExpertsInt8.
            Platform::Cpu(f)
                if (f.amx_int8 || f.neon)
                    && input.shape.hidden.is_multiple_of(32)
                    && i_pp.is_multiple_of(32) =>
            {
                v.backend = Some("CPU".into());
            }
            _ => {
                v.error = Some("NotImplementedError: No Int8 MoE backend supports the deployment configuration (weight_key=kInt8StaticChannelSym, activation_key=kInt8DynamicTokenSym).".into());
            }
        }
        return v;
    }
    // Row 7: on SM 9.0 exactly, grouped int4 weights with 8-bit dynamic per-token symmetric
    // activations take the fp8 W4A8 method, whatever the activations' type
    // (`_is_fp8_w4a8` never checks it).
    if matches!(platform, Platform::Cuda { sm: 90 })
        && w.num_bits == 4
        && a.num_bits == 8
        && w.strategy == Strategy::Group
        && a.strategy == Strategy::Token
        && w.symmetric
        && a.symmetric
        && !w.is_dynamic()
        && a.is_dynamic()
    {
        return vllm_w4a8_fp8(w, a, input, tp_size);
    }
    // Row 8: int4 weights with int8 dynamic token activations.
    if w.num_bits == 4
        && matches!(w.strategy, Strategy::Group | Strategy::Channel)
        && a.num_bits == 8
        && a.strategy == Strategy::Token
        && !w.is_dynamic()
        && a.is_dynamic()
        && w.symmetric
    {
        return vllm_w4a8_int8(w, input, platform, tp_size);
    }
    verdict_error(
        None,
        format!(
            "RuntimeError: Unsupported FusedMoe scheme: {}, {}",
            args_repr(Some(w)),
            args_repr(Some(a))
        ),
    )
}

fn vllm_wna16(
    w: &QuantArgs,
    format: Option<Format>,
    input: &LayerInput,
    platform: Platform,
    tp_size: usize,
) -> VllmVerdict {
    let method = "CompressedTensorsWNA16MoEMethod";
    if !(2..=8).contains(&w.num_bits) || format != Some(Format::PackQuantized) {
        return verdict_error(
            None,
            format!(
                "ValueError: For Fused MoE layers, only format: pack-quantized and bits: 2..8 is supported (checkpoint: format {}, {} bits)",
                format.map_or("None (the config names none)", Format::name),
                w.num_bits
            ),
        );
    }
    if !w.symmetric && !matches!(w.num_bits, 4 | 8) {
        return verdict_error(Some(method), format!("KeyError: {}", w.num_bits));
    }
    let is_actorder = actorder_enum(w);
    let i_pp = input.shape.intermediate / tp_size.max(1);
    let g = w.group_size;
    let int4_sym = w.num_bits == 4 && w.symmetric;
    let g32 = w.num_bits == 4 && g == 32;
    let mut v = VllmVerdict {
        method: Some(method.into()),
        ..VllmVerdict::default()
    };
    if w.spelling.actorder.as_deref() == Some("dynamic") {
        v.notes.push(
            "actorder \"dynamic\" counts as act-order for Marlin's shape check but not for Triton or g_idx sorting: g_idx may be dropped".into(),
        );
    }
    let chosen = match platform {
        Platform::Cpu(f) => (int4_sym && !g32 && f.amx_int8).then_some("CPU"),
        Platform::Cuda { sm } => {
            // Priority [FLASHINFER_TRTLLM, MARLIN, BATCHED_MARLIN, TRITON, HUMMING, EMULATION].
            let marlin_key = matches!(w.num_bits, 4 | 8) && (w.symmetric || w.num_bits == 4);
            let null = w.spelling.group_size_null;
            let padded_experts_ok = input.shape.num_experts.div_ceil(32) * 32 < 1024;
            // Marlin's incompatibility reason is computed before any device or weight-key
            // check, and compares the raw group_size once the hidden size is a multiple of 128.
            if null && input.shape.hidden.is_multiple_of(128) {
                return verdict_error(
                    Some(method),
                    "TypeError: '<=' not supported between instances of 'NoneType' and 'int' (group_size null reaches check_moe_marlin_supports_config; vLLM #52713, fixed after the snapshot by #53163)".into(),
                );
            }
            if (100..110).contains(&sm) && int4_sym && g32 {
                Some("FLASHINFER_TRTLLM")
            } else if sm >= 75
                && marlin_key
                && marlin_support_reason(input.shape.hidden, i_pp, g, !is_actorder).is_none()
            {
                Some("MARLIN")
            } else if marlin_key && !actorder_string_is_group(w) && padded_experts_ok {
                // Triton's WNA16 experts run on any CUDA device (no capability check).
                Some("TRITON")
            } else if sm >= 75 && null && !matches!(w.num_bits, 4 | 8) {
                // Humming's weight-key check builds a (1, group_size) scale shape.
                return verdict_error(
                    Some(method),
                    "TypeError: '>' not supported between instances of 'NoneType' and 'int' (group_size null reaches Humming's weight-key check)".into(),
                );
            } else if sm >= 75 && humming_accepts(w) {
                Some("HUMMING")
            } else if w.num_bits == 4 && padded_experts_ok {
                // The int4 emulation experts are Triton experts, with its expert limit.
                Some("EMULATION")
            } else {
                None
            }
        }
    };
    let Some(b) = chosen else {
        v.error = Some(
            "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
                .into(),
        );
        return v;
    };
    v.backend = Some(b.into());
    // The method's asserts for every backend but Marlin.
    if b != "MARLIN" {
        if w.strategy != Strategy::Group {
            v.error = Some(format!(
                "AssertionError (channelwise weights are Marlin-only; the {b} backend was selected)"
            ));
            return v;
        }
        if actorder_string_is_group(w) {
            v.error = Some(format!(
                "AssertionError (act-order is Marlin-only; the {b} backend was selected)"
            ));
            return v;
        }
    }
    v.error = wna16_create_weights_error(w, input.shape.hidden, i_pp);
    v
}

/// Humming's WNA16 weight keys: int4 and int8 symmetric at any group size (its explicit
/// list), or an unsigned integer type of 2-8 bits with per-channel or `(1, g > 0)` scales,
/// which admits asymmetric int4 only at group 32 (its other keys carry a `(1, -1)` scale).
fn humming_accepts(w: &QuantArgs) -> bool {
    if w.symmetric {
        (2..=8).contains(&w.num_bits)
    } else {
        w.num_bits == 4 && w.strategy == Strategy::Group && w.group_size == 32
    }
}

/// The ValueErrors of `CompressedTensorsWNA16MoEMethod.create_weights` (grouped scales that
/// do not tile the hidden size or a tensor-parallel shard; packed zero points that would
/// straddle an int32 of a shard).
fn wna16_create_weights_error(w: &QuantArgs, hidden: usize, i_pp: usize) -> Option<String> {
    let g = w.group_size;
    if w.strategy == Strategy::Group && g > 0 {
        let g_us = usize::try_from(g).unwrap_or(usize::MAX);
        if !hidden.is_multiple_of(g_us) {
            return Some(format!(
                "ValueError: CompressedTensors WNA16 MoE requires hidden_size ({hidden}) to be divisible by group_size ({g})."
            ));
        }
        // Only group act-order loads w2's scales whole.
        let load_full_w2 = actorder_string_is_group(w);
        if !load_full_w2 && !i_pp.is_multiple_of(g_us) {
            return Some(format!(
                "ValueError: CompressedTensors WNA16 MoE with static group scales requires the MoE intermediate size per tensor-parallel partition ({i_pp}) to be divisible by group_size ({g}). Scale groups would otherwise cross TP shard boundaries; use a compatible TP size or enable expert parallelism."
            ));
        }
    }
    if !w.symmetric {
        let packed = (32 / w.num_bits.max(1)) as usize;
        if !(2 * i_pp).is_multiple_of(packed) {
            return Some(format!(
                "ValueError: CompressedTensors WNA16 MoE: gate+up output channels per TP rank (2 * intermediate_size_per_partition = {}) must be divisible by packed_factor ({packed}). Use a TP size where 2 * intermediate_size is divisible by {packed}.",
                2 * i_pp
            ));
        }
        if !hidden.is_multiple_of(packed) {
            return Some(format!(
                "ValueError: CompressedTensors WNA16 MoE: hidden_size ({hidden}) must be divisible by packed_factor ({packed}) for correct ZP unpacking."
            ));
        }
    }
    None
}

/// `CompressedTensorsW4A8Fp8MoEMethod` (SM 9.0 only): its asserts, then its CUTLASS kernel's
/// shape asserts in `create_weights`.
fn vllm_w4a8_fp8(w: &QuantArgs, a: &QuantArgs, input: &LayerInput, tp_size: usize) -> VllmVerdict {
    let method = "CompressedTensorsW4A8Fp8MoEMethod";
    let mut v = VllmVerdict {
        method: Some(method.into()),
        ..VllmVerdict::default()
    };
    if a.qtype == QuantType::Int {
        v.notes.push(
            "the checkpoint's int8 activations are quantized to fp8 instead: on SM 9.0 vLLM's W4A8 rule does not check the activation type".into(),
        );
    }
    v.notes
        .push("CUTLASS's W4A8 experts need a bf16 model (dtype); fp16 fails to load".into());
    let i_pp = input.shape.intermediate / tp_size.max(1);
    let hidden = input.shape.hidden;
    let gated = input.experts.first().is_some_and(|e| e.gate.is_some());
    v.error = if actorder_string_is_group(w) {
        Some("AssertionError (act-order is not supported by the W4A8 method)".into())
    } else if w.group_size != 128 {
        Some("AssertionError: Only group size 128 supported for W4A8 MoE".into())
    } else if !gated {
        Some("NotImplementedError: W4A8 MoE backend CUTLASS does not support the deployment configuration: kernel does not support no act_and_mul MLP layer.".into())
    } else if !hidden.is_multiple_of(256) {
        Some(format!(
            "AssertionError: hidden_size={hidden} must be divisible by 256"
        ))
    } else if !i_pp.is_multiple_of(256) {
        Some(format!(
            "AssertionError: intermediate_size_per_partition={i_pp} must be divisible by 256"
        ))
    } else {
        v.backend = Some("CUTLASS".into());
        None
    };
    v
}

/// `CompressedTensorsW4A8Int8MoEMethod`: its group check, then a backend, which only Arm CPUs
/// have (`CPUExpertsInt4`).
fn vllm_w4a8_int8(
    w: &QuantArgs,
    input: &LayerInput,
    platform: Platform,
    tp_size: usize,
) -> VllmVerdict {
    let method = "CompressedTensorsW4A8Int8MoEMethod";
    let i_pp = input.shape.intermediate / tp_size.max(1);
    let hidden = input.shape.hidden;
    let g = if w.spelling.group_size_null {
        -1
    } else {
        w.group_size
    };
    if g != -1 {
        let divides = |n: usize| usize::try_from(g).is_ok_and(|g| g > 0 && n.is_multiple_of(g));
        if !divides(hidden) || !divides(i_pp) {
            return verdict_error(
                Some(method),
                format!("ValueError: Group size ({g}) must evenly divide both hidden size ({hidden}) and intermediate size per partition ({i_pp})."),
            );
        }
    }
    let unsupported = || {
        let mut v = verdict_error(
            Some(method),
            "NotImplementedError: No W4A8 Int8 MoE backend supports the deployment configuration."
                .into(),
        );
        v.notes.push("vLLM's only W4A8 int8 kernel (CPUExpertsInt4) runs on Arm CPUs, for gated experts with per-channel or group 32/64/128 scales".into());
        v
    };
    let gated = input.experts.first().is_some_and(|e| e.gate.is_some());
    match platform {
        Platform::Cuda { .. } => verdict_error(
            Some(method),
            "NotImplementedError: W4A8 Int8 MoE is only supported on CPU platforms".into(),
        ),
        // CPUExpertsInt4's weight keys: per channel, or groups of 32, 64 or 128.
        Platform::Cpu(f) if f.neon && gated && matches!(g, -1 | 32 | 64 | 128) => VllmVerdict {
            method: Some(method.into()),
            backend: Some("CPU_INT4".into()),
            notes: vec![
                "CPUExpertsInt4 takes softmax routing only (Default, Renormalize): grouped or sigmoid routing fails to load".into(),
            ],
            ..VllmVerdict::default()
        },
        Platform::Cpu(_) => unsupported(),
    }
}

/// Known vLLM regressions that concern a layer's scheme (any of its experts).
pub fn regressions(input: &LayerInput) -> Vec<Regression> {
    let mut out: Vec<Regression> = Vec::new();
    let mut add = |r: Regression| {
        if !out.iter().any(|x| x.id == r.id) {
            out.push(r);
        }
    };
    let schemes = input
        .experts
        .iter()
        .flat_map(|e| e.gate.iter().chain([&e.up, &e.down]));
    for s in schemes {
        let Some(w) = &s.weights else { continue };
        let weight_only = s.activation.is_none();
        if weight_only && w.num_bits == 8 && w.strategy == Strategy::Group {
            add(Regression {
                id: "int8-grouped-wna16",
                prs: "#42553, #47154, #44570, #52002",
                summary: "int8 grouped weight-only experts fail to load on vLLM v0.27.0 and v0.27.1 (`assert group_size == -1`, reintroduced by #44570, removed again by #52002)",
            });
        }
        if weight_only && w.strategy == Strategy::Channel && w.spelling.group_size_null {
            add(Regression {
                id: "channel-group-size-null",
                prs: "#44570, #52713, #53163",
                summary: "channelwise weights with `group_size: null` crash vLLM's Marlin support check with TypeError (#52713) until #53163",
            });
        }
        if w.spelling.actorder.as_deref() == Some("dynamic") {
            add(Regression {
                id: "actorder-dynamic-alias",
                prs: "(open hazard)",
                summary: "actorder \"dynamic\" is act-order for vLLM's Marlin shape check but not for its `== \"group\"` checks: g_idx can be silently dropped",
            });
        }
        if matches!(w.spelling.actorder.as_deref(), Some("weight" | "static")) {
            add(Regression {
                id: "actorder-weight",
                prs: "#41161",
                summary: "actorder \"weight\"/\"static\" was treated as act-order before #41161, breaking w2 scale sharding and is_k_full under tensor parallelism",
            });
        }
        if weight_only && w.num_bits == 4 && !w.symmetric {
            add(Regression {
                id: "asym-int4",
                prs: "#39980, #44025",
                summary: "asymmetric int4 MoE failed with AssertionError \"Only symmetric quantization is supported for MoE\" before #44025",
            });
        }
        if w.num_bits == 8 && !w.symmetric {
            add(Regression {
                id: "asym-int8",
                prs: "(unserved)",
                summary: "asymmetric int8 MoE weights have no vLLM backend (NotImplementedError)",
            });
        }
        if let Some(a) = &s.activation {
            if a.num_bits == 8 && a.strategy == Strategy::Token && a.is_dynamic() && w.num_bits == 8
            {
                add(Regression {
                    id: "dynamic-w8a8-as-w8a16",
                    prs: "#39187, #50833",
                    summary: "dynamic per-token int8 W8A8 ran as W8A16 (activations never quantized) from #39187 (2026-04-22) until #50833 (2026-08-07)",
                });
            }
            if a.strategy == Strategy::Tensor && !a.is_dynamic() && w.num_bits == 8 {
                add(Regression {
                    id: "static-w8a8",
                    prs: "(unserved)",
                    summary: "static per-tensor int8 W8A8 is not a vLLM MoE scheme (RuntimeError: Unsupported FusedMoe scheme)",
                });
            }
        }
    }
    let e0 = input.experts.first();
    if input.experts.iter().any(|e| Some(e) != e0) {
        add(Regression {
            id: "per-expert-mix",
            prs: "(design)",
            summary: "vLLM resolves expert 0's scheme for the whole layer; per-expert mixed precision does not load",
        });
    }
    let _ = WNA16_GROUP_SIZES;
    out
}
