//! The compressed-tensors `quantization_config` object of `config.json`.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use regex::Regex;
use serde_json::Value;

use super::args::{preset, ArgsRole, QuantArgs, QuantType, PRESET_NAMES};
use super::json::{Field, Obj};
use crate::error::{ConfigError, Error, Result, UnsupportedSchemeError};

/// Storage formats (`compressors/format.py`, `config/base.py::CompressionFormat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Dense,
    FakeQuant,
    PackQuantized,
    IntQuantized,
    NaiveQuantized,
    FloatQuantized,
    NvFp4PackQuantized,
    MxFp4PackQuantized,
    MxFp6PackQuantized,
    MxFp8Quantized,
    SparseBitmask,
    Sparse24Bitmask,
    Marlin24,
    MixedPrecision,
}

impl Format {
    pub fn parse(s: &str) -> Option<Format> {
        Some(match s {
            "dense" => Format::Dense,
            "fakequant" => Format::FakeQuant,
            "pack-quantized" => Format::PackQuantized,
            "int-quantized" => Format::IntQuantized,
            "naive-quantized" => Format::NaiveQuantized,
            "float-quantized" => Format::FloatQuantized,
            "nvfp4-pack-quantized" => Format::NvFp4PackQuantized,
            "mxfp4-pack-quantized" => Format::MxFp4PackQuantized,
            "mxfp6-pack-quantized" => Format::MxFp6PackQuantized,
            "mxfp8-quantized" => Format::MxFp8Quantized,
            "sparse-bitmask" => Format::SparseBitmask,
            "sparse-24-bitmask" => Format::Sparse24Bitmask,
            "marlin-24" => Format::Marlin24,
            "mixed-precision" => Format::MixedPrecision,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Dense => "dense",
            Format::FakeQuant => "fakequant",
            Format::PackQuantized => "pack-quantized",
            Format::IntQuantized => "int-quantized",
            Format::NaiveQuantized => "naive-quantized",
            Format::FloatQuantized => "float-quantized",
            Format::NvFp4PackQuantized => "nvfp4-pack-quantized",
            Format::MxFp4PackQuantized => "mxfp4-pack-quantized",
            Format::MxFp6PackQuantized => "mxfp6-pack-quantized",
            Format::MxFp8Quantized => "mxfp8-quantized",
            Format::SparseBitmask => "sparse-bitmask",
            Format::Sparse24Bitmask => "sparse-24-bitmask",
            Format::Marlin24 => "marlin-24",
            Format::MixedPrecision => "mixed-precision",
        }
    }

    const KNOWN: &'static str = "dense, pack-quantized, int-quantized, naive-quantized, float-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized, mxfp6-pack-quantized, mxfp8-quantized, sparse-bitmask, sparse-24-bitmask, marlin-24, mixed-precision";
}

/// One target or ignore entry: `re:<regex>` (Python `re.match`, anchored at the start only), or a
/// plain string that is both an exact module name and a class name.
#[derive(Clone, Debug)]
pub enum Target {
    Name(String),
    Regex { pattern: String, re: Regex },
}

impl Target {
    fn parse(field: &Field<'_>, s: &str) -> Result<Target> {
        match s.strip_prefix("re:") {
            Some(pattern) => {
                // `re.match` anchors at the start only; keep the rest of the pattern as written.
                let re = Regex::new(&format!("^(?:{pattern})")).map_err(|e| {
                    field.invalid(format!(
                        "regex \"{pattern}\" is not supported: {}",
                        e.to_string().lines().last().unwrap_or("invalid regex")
                    ))
                })?;
                Ok(Target::Regex {
                    pattern: pattern.to_string(),
                    re,
                })
            }
            None => Ok(Target::Name(s.to_string())),
        }
    }

    pub fn as_str(&self) -> String {
        match self {
            Target::Name(n) => n.clone(),
            Target::Regex { pattern, .. } => format!("re:{pattern}"),
        }
    }

    fn matches_regex(&self, module: &str) -> bool {
        match self {
            Target::Name(_) => false,
            Target::Regex { re, .. } => re.is_match(module),
        }
    }

    fn matches_class(&self, class: ModuleClass) -> bool {
        match (self, class) {
            (Target::Name(n), ModuleClass::Linear) => n == "Linear",
            _ => false,
        }
    }
}

/// What the checkpoint lets us infer about a module's class without the model graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleClass {
    /// Has a 2-D weight (plain or packed) and is not an embedding or a router.
    Linear,
    Other,
}

/// One `config_groups` entry with its format resolved.
#[derive(Clone, Debug)]
pub struct Scheme {
    pub name: String,
    pub targets: Vec<Target>,
    pub weights: Option<QuantArgs>,
    pub input_activations: Option<QuantArgs>,
    pub output_activations: Option<QuantArgs>,
    pub format: Format,
    /// The format the config names for this group: its own, else the global one
    /// (`mixed-precision` included); None where it names neither. What vLLM reads: it never
    /// infers one.
    pub declared_format: Option<Format>,
    /// Written in preset form (`{"W4A16": ["Linear"]}`), which vLLM's parse cannot read.
    pub preset: bool,
    /// `"input_activations": {}`: compressed-tensors (and moeq) read the default arguments
    /// (static per-tensor int8), vLLM reads the empty, falsy dict as no activation quantization.
    pub empty_input_activations: bool,
}

impl Scheme {
    /// The format vLLM reads for this group where it differs from `format` (see
    /// `declared_format`): None where they agree, `Some(None)` where the config names no
    /// format at all (moeq_rs infers one from the tensors; vLLM reads None, and its weight-only
    /// MoE method then refuses the layer).
    pub fn vllm_format(&self) -> Option<Option<Format>> {
        match self.declared_format {
            Some(f) if f == self.format => None,
            declared => Some(declared),
        }
    }

    /// The input activations vLLM reads for this group: none for an empty object (see
    /// `empty_input_activations`).
    pub fn vllm_input_activations(&self) -> Option<&QuantArgs> {
        self.input_activations
            .as_ref()
            .filter(|_| !self.empty_input_activations)
    }

    fn same_quantization(&self, other: &Scheme) -> bool {
        self.weights == other.weights
            && self.input_activations == other.input_activations
            && self.output_activations == other.output_activations
            && self.format == other.format
    }
}

/// The parsed `quantization_config`.
#[derive(Clone, Debug)]
pub struct QuantizationConfig {
    pub quant_method: String,
    pub format: Option<Format>,
    pub groups: Vec<Scheme>,
    pub ignore: Vec<Target>,
    pub kv_cache_scheme: Option<QuantArgs>,
    pub version: Option<String>,
    pub quantization_status: Option<String>,
    /// `moe_sparsity_config.num_experts`: per decoder layer, the expert count when pruned.
    pub moe_num_experts: Option<Vec<Option<usize>>>,
    /// Exact-name lookups, built once: CT writes ignore lists with one entry per module, so
    /// scanning them per module would be quadratic on large models.
    index: TargetIndex,
}

#[derive(Clone, Debug, Default)]
struct TargetIndex {
    ignore_names: HashSet<String>,
    /// group indices per exact target name
    group_names: HashMap<String, Vec<usize>>,
}

impl TargetIndex {
    fn build(groups: &[Scheme], ignore: &[Target]) -> TargetIndex {
        let mut idx = TargetIndex::default();
        for t in ignore {
            if let Target::Name(n) = t {
                idx.ignore_names.insert(n.clone());
            }
        }
        for (gi, g) in groups.iter().enumerate() {
            for t in &g.targets {
                if let Target::Name(n) = t {
                    let v = idx.group_names.entry(n.clone()).or_default();
                    if !v.contains(&gi) {
                        v.push(gi);
                    }
                }
            }
        }
        idx
    }
}

/// Where a module's scheme came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatchTier {
    Name,
    Regex,
    Class,
}

/// The CT format compressed-tensors infers for a scheme without an explicit one
/// (`compressors/format.py::infer_module_format`, integer part).
fn infer_format(weights: Option<&QuantArgs>, inputs: Option<&QuantArgs>) -> Format {
    match (weights, inputs) {
        (None, _) => Format::Dense,
        (Some(w), Some(a)) if w.qtype == QuantType::Int && a.qtype == QuantType::Int => {
            Format::IntQuantized
        }
        (Some(w), a)
            if w.qtype == QuantType::Int
                && w.num_bits <= 8
                && a.is_none_or(|a| a.qtype == QuantType::Int) =>
        {
            Format::PackQuantized
        }
        (Some(w), Some(a)) if w.qtype == QuantType::Float && a.qtype == QuantType::Float => {
            Format::FloatQuantized
        }
        _ => Format::NaiveQuantized,
    }
}

fn parse_format(field: &Field<'_>) -> Result<Option<Format>> {
    match field.opt_str()? {
        None => Ok(None),
        Some(s) => Format::parse(s).map(Some).ok_or_else(|| {
            field.invalid(format!("unknown format \"{s}\" (known: {})", Format::KNOWN))
        }),
    }
}

fn parse_targets(field: &Field<'_>) -> Result<Vec<Target>> {
    let Some(items) = field.opt_array()? else {
        return Ok(Vec::new());
    };
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let f = Field::new(field.file, format!("{}[{i}]", field.path), Some(v));
            match f.opt_str()? {
                Some(s) => Target::parse(&f, s),
                None => {
                    Err(f.invalid("expected a module name, class name or \"re:\" regex string"))
                }
            }
        })
        .collect()
}

fn parse_args(obj: &Obj<'_>, key: &str, role: ArgsRole) -> Result<Option<QuantArgs>> {
    match obj.field(key).opt_object()? {
        None => Ok(None),
        Some(o) => QuantArgs::parse_obj(&o, role).map(Some),
    }
}

impl QuantizationConfig {
    /// Parses `config["quantization_config"]`; `None` when the model is not quantized.
    /// `file` is `config.json`, used in error messages.
    pub fn from_model_config(file: &Path, config: &Value) -> Result<Option<QuantizationConfig>> {
        let Some(root) = config.as_object() else {
            return Ok(None);
        };
        let root = Obj::root(file, "", root);
        let Some(qc) = root.field("quantization_config").opt_object()? else {
            return Ok(None);
        };
        Self::parse(&qc).map(Some)
    }

    pub fn parse(qc: &Obj<'_>) -> Result<QuantizationConfig> {
        let quant_method = qc
            .opt_str("quant_method")?
            .unwrap_or("compressed-tensors")
            .to_string();
        if quant_method != "compressed-tensors" {
            return Err(UnsupportedSchemeError {
                subject: format!("{}: {}.quant_method", qc.file.display(), qc.path),
                reason: format!(
                    "\"{quant_method}\" checkpoints are not supported; moeq_rs reads compressed-tensors checkpoints"
                ),
            }
            .into());
        }
        let global_format = parse_format(&qc.field("format"))?;
        let version = qc.opt_str("version")?.map(str::to_string);
        let quantization_status = qc.opt_str("quantization_status")?.map(str::to_string);

        let mut groups = Vec::new();
        if let Some(cg) = qc.field("config_groups").opt_object()? {
            for (name, value) in cg.map {
                let gfield = cg.field(name);
                groups.push(match value {
                    // Preset form: {"W4A16": ["Linear"]}.
                    Value::Array(_) => {
                        let Some((w, a)) = preset(name, version.as_deref()) else {
                            return Err(gfield.invalid(format!(
                                "\"{name}\" is not a known preset scheme (known: {}); a scheme must be an object",
                                PRESET_NAMES.join(", ")
                            )));
                        };
                        let wobj = w.as_ref().and_then(Value::as_object);
                        let aobj = a.as_ref().and_then(Value::as_object);
                        let weights = match wobj {
                            Some(m) => Some(QuantArgs::parse_obj(&Obj::root(qc.file, format!("{}(preset)", gfield.path), m), ArgsRole::Weights)?),
                            None => None,
                        };
                        let inputs = match aobj {
                            Some(m) => Some(QuantArgs::parse_obj(&Obj::root(qc.file, format!("{}(preset)", gfield.path), m), ArgsRole::InputActivations)?),
                            None => None,
                        };
                        let format = group_format(global_format, None, weights.as_ref(), inputs.as_ref());
                        Scheme {
                            name: name.clone(),
                            targets: parse_targets(&gfield)?,
                            weights,
                            input_activations: inputs,
                            output_activations: None,
                            format,
                            declared_format: global_format,
                            preset: true,
                            empty_input_activations: false,
                        }
                    }
                    _ => {
                        let g = gfield.object()?;
                        let weights = parse_args(&g, "weights", ArgsRole::Weights)?;
                        let inputs = parse_args(&g, "input_activations", ArgsRole::InputActivations)?;
                        let empty_inputs = g.field("input_activations").opt_object()?.is_some_and(|o| o.map.is_empty());
                        let outputs = parse_args(&g, "output_activations", ArgsRole::OutputActivations)?;
                        let own_format = parse_format(&g.field("format"))?;
                        if own_format == Some(Format::MixedPrecision) {
                            return Err(g.field("format").invalid("\"mixed-precision\" is only valid as the global format"));
                        }
                        let format = group_format(global_format, own_format, weights.as_ref(), inputs.as_ref());
                        let targets = g.field("targets");
                        if matches!(targets.value, None | Some(Value::Null)) {
                            // compressed-tensors' QuantizationScheme requires the field (vLLM
                            // fails on it too: main's from_config with a KeyError, 0.32's
                            // scheme map with a TypeError).
                            return Err(targets.invalid(
                                "missing: every config group lists its target modules (a list of names, class names or \"re:\" regexes; [] for none)",
                            ));
                        }
                        Scheme {
                            name: name.clone(),
                            targets: parse_targets(&targets)?,
                            weights,
                            input_activations: inputs,
                            output_activations: outputs,
                            format,
                            declared_format: own_format.or(global_format),
                            preset: false,
                            empty_input_activations: empty_inputs,
                        }
                    }
                });
            }
        }

        let ignore = parse_targets(&qc.field("ignore"))?;
        let kv_cache_scheme = parse_args(qc, "kv_cache_scheme", ArgsRole::KvCache)?;
        check_transforms(qc)?;
        let moe_num_experts = match qc.field("moe_sparsity_config").opt_object()? {
            None => None,
            Some(m) => match m.field("num_experts").opt_array()? {
                None => None,
                Some(items) => Some(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, v)| {
                            Field::new(qc.file, format!("{}.num_experts[{i}]", m.path), Some(v))
                                .opt_u64()
                                .map(|n| n.map(|n| n as usize))
                        })
                        .collect::<Result<Vec<_>>>()?,
                ),
            },
        };
        if let Some(sparsity) = qc.field("sparsity_config").opt_object()? {
            if let Some(f) = sparsity.opt_str("format")? {
                if f != "dense" {
                    return Err(UnsupportedSchemeError {
                        subject: format!("{}: {}", qc.file.display(), sparsity.field("format").path),
                        reason: format!("sparse format \"{f}\" is not supported (removed from compressed-tensors in 0.15)"),
                    }
                    .into());
                }
            }
        }
        let index = TargetIndex::build(&groups, &ignore);
        Ok(QuantizationConfig {
            index,
            quant_method,
            format: global_format,
            groups,
            ignore,
            kv_cache_scheme,
            version,
            quantization_status,
            moe_num_experts,
        })
    }

    /// Weights are stored unquantized when the status says the model was never compressed.
    pub fn stored_unquantized(&self) -> bool {
        matches!(
            self.quantization_status.as_deref(),
            Some("initialized" | "calibration" | "frozen" | "decompressed")
        )
    }

    pub fn is_ignored(&self, module: &str, class: ModuleClass) -> bool {
        self.index.ignore_names.contains(module)
            || self
                .ignore
                .iter()
                .any(|t| t.matches_regex(module) || t.matches_class(class))
    }

    /// Resolves the scheme of `module` with compressed-tensors' precedence: ignore first, then
    /// exact name > regex > class. Within one tier, groups giving the same target (`"Linear"`
    /// in two groups, one name or regex twice) resolve to the last of them, as CT and vLLM key
    /// their maps by the target (a checkpoint such as a MiniMax hybrid, FP8 on `"Linear"`
    /// then W4A16 on `"Linear"` plus the experts, loads in both); different targets whose
    /// winners disagree (two overlapping regexes) are an error, since CT orders those
    /// alphabetically and vLLM by the config.
    pub fn resolve(
        &self,
        file: &Path,
        module: &str,
        class: ModuleClass,
    ) -> Result<Option<(&Scheme, MatchTier)>> {
        if self.is_ignored(module, class) {
            return Ok(None);
        }
        let by_name: Vec<&Scheme> = self
            .index
            .group_names
            .get(module)
            .map(|v| v.iter().filter_map(|&i| self.groups.get(i)).collect())
            .unwrap_or_default();
        let by_regex = || -> Vec<&Scheme> {
            self.groups
                .iter()
                .filter(|g| g.targets.iter().any(|t| t.matches_regex(module)))
                .collect()
        };
        let by_class = || -> Vec<&Scheme> {
            self.groups
                .iter()
                .filter(|g| g.targets.iter().any(|t| t.matches_class(class)))
                .collect()
        };
        let (tier, matched) = if !by_name.is_empty() {
            (MatchTier::Name, by_name)
        } else {
            let r = by_regex();
            if !r.is_empty() {
                (MatchTier::Regex, r)
            } else {
                (MatchTier::Class, by_class())
            }
        };
        // The last group per target string (the name, every regex that matches, or "Linear"),
        // in the order of each target's first group (as vLLM's target map is built).
        let mut winners: Vec<(&str, &Scheme)> = Vec::new();
        for g in matched {
            let keys: Vec<&str> = match tier {
                MatchTier::Regex => g
                    .targets
                    .iter()
                    .filter_map(|t| match t {
                        Target::Regex { pattern, re } if re.is_match(module) => {
                            Some(pattern.as_str())
                        }
                        _ => None,
                    })
                    .collect(),
                // Every name-tier match is the module's own name, every class-tier one "Linear".
                MatchTier::Name | MatchTier::Class => vec![""],
            };
            for key in keys {
                match winners.iter_mut().find(|(k, _)| *k == key) {
                    Some(w) => w.1 = g,
                    None => winners.push((key, g)),
                }
            }
        }
        // Where several regexes match, CT takes the alphabetically first and vLLM the first in
        // its map: where their groups' schemes differ the config means two things (every
        // matching regex of a group counts: keyed by its first one only, a clash through a
        // group's second regex went unseen).
        let Some(&(_, vllm)) = winners.first() else {
            return Ok(None);
        };
        let ct = winners.iter().min_by_key(|(k, _)| *k).map_or(vllm, |w| w.1);
        if !ct.same_quantization(vllm) {
            return Err(Error::Config(ConfigError {
                file: file.to_path_buf(),
                key: "quantization_config.config_groups".into(),
                reason: format!(
                    "module '{module}' is matched by both '{}' and '{}' at the same precedence with different schemes (ambiguous: compressed-tensors takes the alphabetically first regex, vLLM the first listed)",
                    ct.name, vllm.name
                ),
            }));
        }
        let first = ct;
        Ok(Some((first, tier)))
    }
}

fn group_format(
    global: Option<Format>,
    own: Option<Format>,
    weights: Option<&QuantArgs>,
    inputs: Option<&QuantArgs>,
) -> Format {
    match (own, global) {
        (Some(f), _) => f,
        (None, Some(g)) if g != Format::MixedPrecision => g,
        _ => infer_format(weights, inputs),
    }
}

/// Online transforms (rotations applied at run time) change the computation; only those fused
/// into the stored weights (`weight_input`, `weight_output`) are harmless to a reader.
fn check_transforms(qc: &Obj<'_>) -> Result<()> {
    let Some(tc) = qc.field("transform_config").opt_object()? else {
        return Ok(());
    };
    let Some(groups) = tc.field("config_groups").opt_object()? else {
        return Ok(());
    };
    for name in groups.map.keys() {
        let g = groups.field(name).object()?;
        let Some(apply) = g.field("apply").opt_array()? else {
            continue;
        };
        for (i, a) in apply.iter().enumerate() {
            let af = Field::new(qc.file, format!("{}.apply[{i}]", g.path), Some(a));
            let a = af.object()?;
            let location = a.opt_str("location")?.unwrap_or("");
            if !matches!(location, "weight_input" | "weight_output") {
                let ttype = g.opt_str("type")?.unwrap_or("transform");
                return Err(UnsupportedSchemeError {
                    subject: format!("{}: {}", qc.file.display(), af.path),
                    reason: format!(
                        "online {ttype} transform at location \"{location}\" is not supported (only transforms fused into the weights, weight_input/weight_output, can be read)"
                    ),
                }
                .into());
            }
        }
    }
    Ok(())
}
