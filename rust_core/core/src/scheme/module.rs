//! A module's resolved scheme and its tensors, cross-checked against each other.

use super::args::{ActOrder, QuantArgs, QuantType, Strategy};
use super::config::{Format, MatchTier, ModuleClass, QuantizationConfig};
use crate::checkpoint::{Checkpoint, DType, TensorInfo};
use crate::error::{module_error, Result, UnsupportedSchemeError};

/// Tensor name suffixes a quantized Linear module may own.
pub const MODULE_TENSOR_SUFFIXES: &[&str] = &[
    "weight",
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "weight_shape",
    "weight_global_scale",
    "input_scale",
    "input_zero_point",
    "input_global_scale",
    "output_scale",
    "bias",
];

/// The scheme a module resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedScheme {
    pub group: String,
    pub tier: MatchTier,
    pub format: Format,
    /// The format vLLM reads for the group (see [`super::config::Scheme::vllm_format`]).
    pub vllm_format: Option<Option<Format>>,
    pub weights: Option<QuantArgs>,
    pub input_activations: Option<QuantArgs>,
    /// vLLM reads the group's `input_activations` as none: an empty `{}` (see
    /// [`super::config::Scheme::empty_input_activations`]).
    pub vllm_drops_input_activations: bool,
}

/// How the zero points of an asymmetric module are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZeroPointLayout {
    /// int32 packed along the output dim, `[ceil(out*b/32), G]`, stored with the `2^(b-1)` offset.
    Packed,
    /// Plain signed int8 like the scale (`int-quantized`, legacy pack-quantized, tensor strategy).
    Unpacked,
}

/// A module after resolution and cross-checking.
#[derive(Clone, Debug)]
pub struct ModuleInfo {
    pub name: String,
    /// `None` when the module is stored unquantized (ignored, untargeted, or a dense format).
    pub scheme: Option<ResolvedScheme>,
    pub out_features: usize,
    pub in_features: usize,
    /// `weight_packed` or `weight`.
    pub weight_tensor: String,
    pub weight_dtype: DType,
    pub scale_dtype: Option<DType>,
    pub zero_point: Option<ZeroPointLayout>,
    pub has_g_idx: bool,
    pub has_input_scale: bool,
}

impl ModuleInfo {
    pub fn weights(&self) -> Option<&QuantArgs> {
        self.scheme.as_ref().and_then(|s| s.weights.as_ref())
    }
    pub fn input_activations(&self) -> Option<&QuantArgs> {
        self.scheme
            .as_ref()
            .and_then(|s| s.input_activations.as_ref())
    }
    pub fn format(&self) -> Format {
        self.scheme.as_ref().map_or(Format::Dense, |s| s.format)
    }
    /// The format vLLM reads for the module's group where it differs from [`Self::format`].
    pub fn vllm_format(&self) -> Option<Option<Format>> {
        self.scheme.as_ref().and_then(|s| s.vllm_format)
    }
    /// The input activations vLLM reads for the module's group.
    pub fn vllm_input_activations(&self) -> Option<&QuantArgs> {
        self.scheme
            .as_ref()
            .filter(|s| !s.vllm_drops_input_activations)
            .and_then(|s| s.input_activations.as_ref())
    }
}

fn leaf(name: &str) -> &str {
    name.rsplit('.').next().unwrap_or(name)
}

/// Routers (`mlp.gate`, `block_sparse_moe.gate`) are not `nn.Linear` in transformers 5.
pub fn is_router(module: &str) -> bool {
    module.ends_with(".mlp.gate") || module.ends_with(".block_sparse_moe.gate")
}

/// The tensors of one module, by position in [`MODULE_TENSOR_SUFFIXES`].
pub type ModuleSlots<'a> = [Option<&'a TensorInfo>; MODULE_TENSOR_SUFFIXES.len()];

/// Every module of a checkpoint with its tensors, built in one pass over the headers so that
/// per-module checks never format and hash tensor names again.
pub struct ModuleTable<'a> {
    /// Sorted by module name.
    modules: Vec<(&'a str, ModuleSlots<'a>)>,
}

impl<'a> ModuleTable<'a> {
    pub fn build(ckpt: &'a Checkpoint) -> ModuleTable<'a> {
        let mut parts: Vec<(&'a str, usize, &'a TensorInfo)> = ckpt
            .tensors()
            .filter_map(|(_, t)| {
                let (module, suffix) = t.name.rsplit_once('.')?;
                let pos = MODULE_TENSOR_SUFFIXES.iter().position(|s| *s == suffix)?;
                Some((module, pos, t))
            })
            .collect();
        // Tensor names are sorted, but "a.b.weight" sorts between "a.bias" and "a.weight": sort by
        // module so each module's tensors are adjacent.
        parts.sort_by(|a, b| a.0.cmp(b.0));
        let mut modules: Vec<(&'a str, ModuleSlots<'a>)> = Vec::new();
        for (module, pos, t) in parts {
            if modules.last().is_none_or(|(m, _)| *m != module) {
                modules.push((module, [None; MODULE_TENSOR_SUFFIXES.len()]));
            }
            if let Some(slot) = modules.last_mut().and_then(|(_, s)| s.get_mut(pos)) {
                *slot = Some(t);
            }
        }
        ModuleTable { modules }
    }

    /// Module names, sorted.
    pub fn names(&self) -> impl ExactSizeIterator<Item = &'a str> + '_ {
        self.modules.iter().map(|(m, _)| *m)
    }

    pub fn slots(&self, module: &str) -> Option<&ModuleSlots<'a>> {
        let i = self
            .modules
            .binary_search_by(|(m, _)| (*m).cmp(module))
            .ok()?;
        self.modules.get(i).map(|(_, s)| s)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &ModuleSlots<'a>)> + '_ {
        self.modules.iter().map(|(m, s)| (*m, s))
    }

    pub fn as_slice(&self) -> &[(&'a str, ModuleSlots<'a>)] {
        &self.modules
    }
}

fn slot<'a>(slots: &ModuleSlots<'a>, suffix: &str) -> Option<&'a TensorInfo> {
    MODULE_TENSOR_SUFFIXES
        .iter()
        .position(|s| *s == suffix)
        .and_then(|p| slots.get(p).copied().flatten())
}

/// The class compressed-tensors would see, inferred from the stored tensors.
pub fn module_class(module: &str, slots: &ModuleSlots<'_>) -> ModuleClass {
    if is_router(module) {
        return ModuleClass::Other;
    }
    let l = leaf(module);
    if l.contains("embed") || l == "wte" || l == "wpe" || l.contains("norm") {
        return ModuleClass::Other;
    }
    if slot(slots, "weight_packed").is_some() {
        return ModuleClass::Linear;
    }
    match slot(slots, "weight") {
        Some(t) if t.shape.len() == 2 => ModuleClass::Linear,
        _ => ModuleClass::Other,
    }
}

struct Tensors<'a, 's> {
    module: &'s str,
    slots: &'s ModuleSlots<'a>,
}

impl<'a> Tensors<'a, '_> {
    fn get(&self, suffix: &str) -> Option<&'a TensorInfo> {
        slot(self.slots, suffix)
    }
    fn require(&self, suffix: &str, why: &str) -> Result<&'a TensorInfo> {
        self.get(suffix).ok_or_else(|| {
            module_error(
                self.module,
                format!("missing tensor '{}.{suffix}' ({why})", self.module),
            )
        })
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Resolves and cross-checks one module. Errors name the module and the offending tensor.
pub fn analyze(
    ckpt: &Checkpoint,
    config_file: &std::path::Path,
    qc: Option<&QuantizationConfig>,
    module: &str,
    slots: &ModuleSlots<'_>,
) -> Result<ModuleInfo> {
    let t = Tensors { module, slots };
    let class = module_class(module, slots);
    let resolved = match qc {
        None => None,
        Some(qc) => qc
            .resolve(config_file, module, class)?
            .map(|(s, tier)| ResolvedScheme {
                group: s.name.clone(),
                tier,
                format: s.format,
                vllm_format: s.vllm_format(),
                weights: s.weights.clone(),
                input_activations: s.input_activations.clone(),
                vllm_drops_input_activations: s.empty_input_activations,
            }),
    };
    let stored_unquantized = qc.is_some_and(QuantizationConfig::stored_unquantized);
    let quant_tensors_present = ["weight_packed", "weight_scale"]
        .iter()
        .any(|s| t.get(s).is_some());

    let unquantized = |t: &Tensors<'_, '_>| -> Result<ModuleInfo> {
        let w = t.require("weight", "an unquantized module stores its weight")?;
        let (out_features, in_features) = match w.shape.as_slice() {
            [o, i] => (*o, *i),
            other => {
                return Err(module_error(
                    module,
                    format!("weight has shape {}, expected [out, in]", shape_str(other)),
                ))
            }
        };
        Ok(ModuleInfo {
            name: module.to_string(),
            scheme: None,
            out_features,
            in_features,
            weight_tensor: w.name.clone(),
            weight_dtype: w.dtype,
            scale_dtype: None,
            zero_point: None,
            has_g_idx: false,
            has_input_scale: false,
        })
    };

    let Some(scheme) = resolved else {
        if quant_tensors_present {
            return Err(module_error(
                module,
                "stores quantized tensors (weight_packed/weight_scale) but no config group targets it (or it is ignored)",
            ));
        }
        return unquantized(&t);
    };
    let Some(wargs) = scheme.weights.clone() else {
        return unquantized(&t).map(|mut m| {
            m.scheme = Some(scheme);
            m
        });
    };
    if stored_unquantized || matches!(scheme.format, Format::Dense | Format::FakeQuant) {
        return unquantized(&t);
    }
    // A plain float Linear reached only through the "Linear" class target, with no quantization
    // tensors at all, is a module compressed-tensors did not treat as Linear (e.g. an
    // embedding-like table with an unusual name): report it as unquantized.
    if scheme.tier == MatchTier::Class && !quant_tensors_present {
        if let Some(w) = t.get("weight") {
            if w.dtype.is_float() {
                return unquantized(&t);
            }
        }
    }

    let fmt = scheme.format;
    let bits = wargs.num_bits as usize;
    let (weight, out_features, in_features) = match fmt {
        Format::PackQuantized => {
            if wargs.qtype != QuantType::Int || !(1..=8).contains(&bits) {
                return Err(UnsupportedSchemeError {
                    subject: format!("module '{module}'"),
                    reason: format!("pack-quantized needs int weights of 1..8 bits, the scheme says {bits}-bit {:?}", wargs.qtype),
                }
                .into());
            }
            let wp = t.require("weight_packed", "pack-quantized weights")?;
            let ws = t.require("weight_shape", "pack-quantized weights record [out, in]")?;
            if wp.dtype != DType::I32 {
                return Err(module_error(module, format!("weight_packed has dtype {}, expected I32", wp.dtype)));
            }
            let dims = ckpt.tensor(&ws.name)?.to_i64_vec()?;
            let (out_f, in_f) = match dims.as_slice() {
                [o, i] if *o > 0 && *i > 0 => (*o as usize, *i as usize),
                _ => return Err(module_error(module, format!("weight_shape holds {dims:?}, expected two positive sizes [out, in]"))),
            };
            // (A product that wrapped would let a huge recorded width pass as a small one.)
            let Some(words) = in_f.checked_mul(bits).map(|b| b.div_ceil(32)) else {
                return Err(module_error(module, format!("weight_shape [{out_f}, {in_f}] is too large")));
            };
            if wp.shape.as_slice() != [out_f, words] {
                return Err(module_error(
                    module,
                    format!(
                        "weight_packed has shape {}, but weight_shape [{out_f}, {in_f}] at {bits} bits packs to [{out_f}, {words}]",
                        shape_str(&wp.shape)
                    ),
                ));
            }
            (wp, out_f, in_f)
        }
        Format::IntQuantized | Format::NaiveQuantized => {
            let w = t.require("weight", "int weights")?;
            let ok_dtype = match w.dtype {
                DType::I8 => bits <= 8,
                DType::I16 => bits <= 16,
                DType::I32 => bits <= 32,
                DType::U8 => bits <= 8,
                _ => false,
            };
            if wargs.qtype != QuantType::Int {
                return Err(UnsupportedSchemeError {
                    subject: format!("module '{module}'"),
                    reason: format!("format {} with float weights is not supported", fmt.name()),
                }
                .into());
            }
            if !ok_dtype {
                return Err(module_error(module, format!("weight has dtype {} which cannot hold {bits}-bit integer codes", w.dtype)));
            }
            match w.shape.as_slice() {
                [o, i] => (w, *o, *i),
                other => return Err(module_error(module, format!("weight has shape {}, expected [out, in]", shape_str(other)))),
            }
        }
        Format::FloatQuantized => {
            let w = t.require("weight", "float-quantized weights")?;
            match w.shape.as_slice() {
                [o, i] => (w, *o, *i),
                other => return Err(module_error(module, format!("weight has shape {}, expected [out, in]", shape_str(other)))),
            }
        }
        Format::NvFp4PackQuantized | Format::MxFp4PackQuantized | Format::MxFp6PackQuantized => {
            let w = t.require("weight_packed", "packed fp4/fp6 weights")?;
            t.require("weight_scale", "quantization scales")?;
            let (o, i) = match w.shape.as_slice() {
                [o, i] => (*o, if fmt == Format::MxFp6PackQuantized { *i * 8 / 6 } else { *i * 2 }),
                other => return Err(module_error(module, format!("weight_packed has shape {}, expected 2-D", shape_str(other)))),
            };
            return Ok(ModuleInfo {
                name: module.to_string(),
                scheme: Some(scheme),
                out_features: o,
                in_features: i,
                weight_tensor: w.name.clone(),
                weight_dtype: w.dtype,
                scale_dtype: t.get("weight_scale").map(|s| s.dtype),
                zero_point: None,
                has_g_idx: false,
                has_input_scale: t.get("input_scale").is_some(),
            });
        }
        Format::MxFp8Quantized => {
            let w = t.require("weight", "mxfp8 weights")?;
            match w.shape.as_slice() {
                [o, i] => (w, *o, *i),
                other => return Err(module_error(module, format!("weight has shape {}, expected [out, in]", shape_str(other)))),
            }
        }
        Format::SparseBitmask | Format::Sparse24Bitmask | Format::Marlin24 => {
            return Err(UnsupportedSchemeError {
                subject: format!("module '{module}'"),
                reason: format!("sparse format \"{}\" is not supported (removed from compressed-tensors in 0.15)", fmt.name()),
            }
            .into())
        }
        Format::Dense | Format::FakeQuant | Format::MixedPrecision => return unquantized(&t),
    };

    // Scales: one per (row, group) / (row) / tensor, in a float dtype.
    let scale = t.require("weight_scale", "every quantized weight has scales")?;
    if !matches!(scale.dtype, DType::BF16 | DType::F16 | DType::F32)
        && fmt != Format::FloatQuantized
        && fmt != Format::MxFp8Quantized
    {
        return Err(module_error(
            module,
            format!(
                "weight_scale has dtype {}, expected BF16, F16 or F32",
                scale.dtype
            ),
        ));
    }
    let groups = match wargs.strategy {
        Strategy::Group => {
            let g = wargs.group_size as usize;
            if in_features % g != 0 {
                return Err(module_error(
                    module,
                    format!("in_features {in_features} is not divisible by group_size {g}"),
                ));
            }
            in_features / g
        }
        _ => 1,
    };
    let expected_scale: Vec<Vec<usize>> = match wargs.strategy {
        Strategy::Tensor => vec![vec![1], vec![1, 1], vec![]],
        Strategy::Channel | Strategy::Group => vec![vec![out_features, groups]],
        Strategy::Block => {
            let [br, bc] = wargs.block_structure.unwrap_or([1, 1]);
            vec![vec![
                out_features.div_ceil(br as usize),
                in_features.div_ceil(bc as usize),
            ]]
        }
        Strategy::Token | Strategy::TensorGroup | Strategy::AttnHead => {
            if wargs.strategy == Strategy::TensorGroup {
                vec![vec![
                    out_features,
                    in_features / (wargs.group_size.max(1) as usize),
                ]]
            } else {
                return Err(UnsupportedSchemeError {
                    subject: format!("module '{module}'"),
                    reason: format!(
                        "weight strategy \"{}\" is not a weight strategy",
                        wargs.strategy.name()
                    ),
                }
                .into());
            }
        }
    };
    if !expected_scale
        .iter()
        .any(|e| e.as_slice() == scale.shape.as_slice())
    {
        let expected = expected_scale
            .first()
            .map(|e| shape_str(e))
            .unwrap_or_default();
        let what = match wargs.strategy {
            Strategy::Group => format!(
                "group_size {} over in_features {in_features}",
                wargs.group_size
            ),
            s => format!("strategy {}", s.name()),
        };
        return Err(module_error(
            module,
            format!(
                "weight_scale has shape {}, expected {expected} for {what} (out_features {out_features})",
                shape_str(&scale.shape)
            ),
        ));
    }

    // Zero points: present exactly when asymmetric.
    let zero_point = match (wargs.symmetric, t.get("weight_zero_point")) {
        (true, None) => None,
        (true, Some(_)) => {
            return Err(module_error(
                module,
                "has weight_zero_point but the scheme is symmetric",
            ));
        }
        (false, None) => {
            return Err(module_error(
                module,
                format!("missing tensor '{module}.weight_zero_point' (the scheme is asymmetric)"),
            ));
        }
        (false, Some(zp)) => {
            let packed_rows = (out_features * bits).div_ceil(32);
            if fmt == Format::PackQuantized
                && zp.dtype == DType::I32
                && wargs.strategy != Strategy::Tensor
            {
                if zp.shape.as_slice() != [packed_rows, groups] {
                    return Err(module_error(
                        module,
                        format!(
                            "weight_zero_point has shape {}, expected [{packed_rows}, {groups}] (packed along out_features {out_features})",
                            shape_str(&zp.shape)
                        ),
                    ));
                }
                Some(ZeroPointLayout::Packed)
            } else {
                if !matches!(zp.dtype, DType::I8 | DType::I32 | DType::U8) {
                    return Err(module_error(
                        module,
                        format!("weight_zero_point has dtype {}, expected I8", zp.dtype),
                    ));
                }
                if zp.shape != scale.shape {
                    return Err(module_error(
                        module,
                        format!(
                            "weight_zero_point has shape {}, expected the scale's {}",
                            shape_str(&zp.shape),
                            shape_str(&scale.shape)
                        ),
                    ));
                }
                Some(ZeroPointLayout::Unpacked)
            }
        }
    };

    // g_idx: only with group act-order. Missing with group act-order means plain column order
    // (compressed-tensors <= 0.11 dropped uninitialised g_idx tensors on save).
    let has_g_idx = match t.get("weight_g_idx") {
        None => false,
        Some(g) => {
            if wargs.actorder != Some(ActOrder::Group) {
                return Err(module_error(
                    module,
                    format!(
                        "has weight_g_idx but the scheme's actorder is {}",
                        wargs.actorder.map_or("null", ActOrder::name)
                    ),
                ));
            }
            if g.dtype != DType::I32 || g.shape.as_slice() != [in_features] {
                return Err(module_error(
                    module,
                    format!(
                        "weight_g_idx is {} {}, expected I32 [{in_features}]",
                        g.dtype,
                        shape_str(&g.shape)
                    ),
                ));
            }
            true
        }
    };

    // input_scale: stored exactly when input activations are static.
    let input_scale = t.get("input_scale");
    let has_input_scale = match (scheme.input_activations.as_ref(), input_scale) {
        (None, None) => false,
        (None, Some(_)) => {
            return Err(module_error(
                module,
                "has input_scale but the scheme has no input activation quantization",
            ))
        }
        (Some(a), None) if !a.is_dynamic() => {
            return Err(module_error(
                module,
                format!("missing tensor '{module}.input_scale' (static input activations)"),
            ));
        }
        (Some(_), None) => false,
        (Some(a), Some(s)) => {
            if a.is_dynamic() && a.dynamic != super::args::Dynamic::Local {
                return Err(module_error(
                    module,
                    "has input_scale but the scheme's input activations are dynamic",
                ));
            }
            if !matches!(s.dtype, DType::BF16 | DType::F16 | DType::F32) {
                return Err(module_error(
                    module,
                    format!("input_scale has dtype {}, expected a float dtype", s.dtype),
                ));
            }
            // Per-tensor: one value (compressed-tensors writes [1]); the kernels read one, and
            // more used to be read as their first, the others silently dropped.
            if a.strategy == super::Strategy::Tensor && s.numel() != 1 {
                return Err(module_error(
                    module,
                    format!(
                        "input_scale has shape {}, expected one value (per-tensor static input activations)",
                        shape_str(&s.shape)
                    ),
                ));
            }
            true
        }
    };

    Ok(ModuleInfo {
        name: module.to_string(),
        scheme: Some(scheme),
        out_features,
        in_features,
        weight_tensor: weight.name.clone(),
        weight_dtype: weight.dtype,
        scale_dtype: Some(scale.dtype),
        zero_point,
        has_g_idx,
        has_input_scale,
    })
}
