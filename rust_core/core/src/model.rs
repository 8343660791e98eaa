//! An opened checkpoint: files, quantization config, every module cross-checked, MoE layers.

use std::collections::BTreeMap;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{json, Value};

use crate::checkpoint::Checkpoint;
use crate::checkpoint::DType;
use crate::error::UnsupportedSchemeError;
use crate::error::{module_error, CheckpointError, Result};
use crate::moe::{self, ExpertModules, MoeLayer, Routing};
use crate::oracle::{
    self, Backend, CpuFeatures, ExpertSchemes, LayerInput, LayerPlan, LayerShape, Method, Options,
    Platform, ProjScheme, QuantConfig,
};
use crate::quant::{self, Dequantized};
use crate::repack::checkpoint::LAYOUT_VERSION;
use crate::repack::moe_layer::MarlinGeometry;
use crate::scheme::json::Obj;
use crate::scheme::module::{self as smod, ModuleInfo};
use crate::scheme::QuantizationConfig;

/// A validated checkpoint. Opening reads headers, `config.json` and the tiny `weight_shape`
/// tensors; weight data is untouched until dequantised.
#[derive(Debug)]
pub struct Model {
    ckpt: Checkpoint,
    quant: Option<QuantizationConfig>,
    /// Every analysed Linear module, sorted by name.
    modules: Vec<ModuleInfo>,
    moe_layers: Vec<MoeLayer>,
    dense_layers: Vec<usize>,
    /// MoE blocks outside the model's stack of layers (its multi-token-prediction layers, a
    /// talker beside a thinker), by prefix: listed, not loaded.
    set_aside_moe: Vec<String>,
    routing: Routing,
    /// `config.json`'s `hidden_act`, as written.
    hidden_act: Option<String>,
    layout: Option<RepackedLayout>,
    /// Layer prefix -> a part of its MoE block no kernel computes ([`moe::unsupported_parts`]).
    unsupported_parts: BTreeMap<String, moe::UnsupportedPart>,
}

/// A checkpoint written by `moeq repack`: its `config.json` `"moeq"` object.
#[derive(Clone, Debug)]
pub struct RepackedLayout {
    pub layout: String,
    pub version: u64,
    /// The Marlin layout's layers.
    pub layers: Vec<RepackedLayer>,
    /// The CPU layout's prepacked layers (its other layers are in the source form).
    pub cpu_layers: Vec<crate::repack::cpu::CpuGeometry>,
}

#[derive(Clone, Debug)]
pub struct RepackedLayer {
    pub layer: usize,
    pub geometry: MarlinGeometry,
    pub weights: Option<crate::scheme::QuantArgs>,
}

/// The largest size or index a repacked layout's entry may state: far above any model's, and
/// small enough that the products of three of them (`[E, 2I, H]`) cannot overflow.
const MAX_LAYOUT_SIZE: usize = 1 << 20;

fn parse_layout(ckpt: &Checkpoint) -> Result<Option<RepackedLayout>> {
    let file = ckpt.config_path();
    let Some(root) = ckpt.config().as_object() else {
        return Ok(None);
    };
    let root = Obj::root(&file, "", root);
    let Some(m) = root.field("moeq").opt_object()? else {
        return Ok(None);
    };
    let layout = m.opt_str("layout")?.unwrap_or("").to_string();
    if layout != "marlin" && layout != "cpu" {
        return Err(UnsupportedSchemeError {
            subject: format!("{}: moeq.layout", file.display()),
            reason: format!(
                "layout \"{layout}\" cannot be read by this version of moeq_rs (supported: marlin, cpu)"
            ),
        }
        .into());
    }
    let version = m.opt_u64("layout_version")?.unwrap_or(0);
    if version != LAYOUT_VERSION {
        return Err(m.field("layout_version").invalid(format!(
            "layout_version {version} is not supported (this moeq_rs reads version {LAYOUT_VERSION})"
        )));
    }
    let mut layers = Vec::new();
    let mut cpu_layers = Vec::new();
    // A layer listed twice would be loaded from whichever entry came last.
    let mut seen_layers = std::collections::BTreeSet::new();
    // Without the list, the repacked tensors would be found by no one: no MoE layers, silently.
    let listed = m.field("layers").opt_array()?.ok_or_else(|| {
        m.field("layers")
            .invalid("missing (the list of repacked layers)")
    })?;
    for (i, v) in listed.iter().enumerate() {
        let f = crate::scheme::json::Field::new(&file, format!("moeq.layers[{i}]"), Some(v));
        let o = f.object()?;
        // The layer's tensors are found by its prefix: one naming another layer would load
        // that layer's weights under this index.
        let prefix_of = |layer: usize| -> Result<String> {
            let prefix = o
                .opt_str("prefix")?
                .ok_or_else(|| o.field("prefix").invalid("missing"))?;
            if moe::layer_index(prefix) != Some(layer) {
                return Err(o
                    .field("prefix")
                    .invalid(format!("\"{prefix}\" is not a prefix of layer {layer}")));
            }
            Ok(prefix.to_string())
        };
        let need_u = |k: &str| -> Result<usize> {
            let v = o.opt_u64(k)?.ok_or_else(|| o.field(k).invalid("missing"))?;
            usize::try_from(v)
                .ok()
                .filter(|&v| v <= MAX_LAYOUT_SIZE)
                .ok_or_else(|| {
                    o.field(k)
                        .invalid(format!("{v} is too large (at most {MAX_LAYOUT_SIZE})"))
                })
        };
        // A size the stored tensors are checked against: a zero would let every tensor be
        // empty whatever the other sizes say (and the loader then sizes buffers by them).
        let need_size = |k: &str| -> Result<usize> {
            match need_u(k)? {
                0 => Err(o.field(k).invalid("0 is not a size (at least 1)")),
                v => Ok(v),
            }
        };
        let layer = need_u("layer")?;
        if !seen_layers.insert(layer) {
            return Err(o
                .field("layer")
                .invalid(format!("layer {layer} is listed twice")));
        }
        if layout == "cpu" {
            let args = |k: &str, role| -> Result<crate::scheme::QuantArgs> {
                let obj = o
                    .field(k)
                    .opt_object()?
                    .ok_or_else(|| o.field(k).invalid("missing"))?;
                crate::scheme::QuantArgs::parse_obj(&obj, role)
            };
            let g = crate::repack::cpu::CpuGeometry {
                layer,
                prefix: prefix_of(layer)?,
                experts: need_size("num_experts")?,
                hidden: need_size("hidden_size")?,
                intermediate: need_size("intermediate_size")?,
                static_act: o.opt_bool("static_act_scales")?.unwrap_or(false),
                weights: args("weights", crate::scheme::ArgsRole::Weights)?,
                activation: match o.field("activation").opt_object()? {
                    Some(_) => Some(args(
                        "activation",
                        crate::scheme::ArgsRole::InputActivations,
                    )?),
                    None => None,
                },
                act_order: o.opt_bool("act_order")?.unwrap_or(false),
            };
            // A scheme no repack writes (float or 4-bit W8A8 weights, say) would be loaded as
            // the blocks are, whatever the record says, and planned as the record says.
            if !crate::repack::cpu::holds_weights(&g.weights, g.activation.is_some()) {
                return Err(o.field("weights").invalid(
                    "weights the CPU layout does not hold (int8 channelwise symmetric under int8 \
                     activations, else int4/int8 grouped or channelwise): the record is damaged",
                ));
            }
            if !g
                .activation
                .as_ref()
                .is_none_or(crate::repack::cpu::holds_activation)
            {
                return Err(o.field("activation").invalid(
                    "activations the CPU layout does not hold (symmetric int8, dynamic per token \
                     or static per tensor): the record is damaged",
                ));
            }
            let dynamic = g.activation.as_ref().is_some_and(|a| a.is_dynamic());
            if g.static_act != (g.activation.is_some() && !dynamic) {
                return Err(o.field("static_act_scales").invalid(format!(
                    "{} disagrees with the entry's activation ({})",
                    g.static_act,
                    match &g.activation {
                        Some(_) if dynamic => "dynamic",
                        Some(_) => "static",
                        None => "none",
                    }
                )));
            }
            // `kind` repeats what `activation` says: a record that disagrees with itself (or
            // names a kind no version wrote) is damaged.
            let kind = if g.activation.is_some() {
                "int8_w8a8"
            } else {
                "weight_only"
            };
            if let Some(stated) = o.opt_str("kind")? {
                if stated != kind {
                    return Err(o.field("kind").invalid(format!(
                        "\"{stated}\" disagrees with the entry's activation (a {kind} layer)"
                    )));
                }
            }
            let specs = g.specs();
            check_specs(ckpt, &specs, "CPU")?;
            // And the other way: a stacked tensor the record has no place for (zero points
            // under `symmetric: true`, sort indices without `act_order`, input scales of
            // dynamic activations) would be ignored, the layer computed as the record says.
            for suffix in crate::repack::cpu::LAYOUT_TENSORS {
                let name = format!("{}.{suffix}", g.prefix);
                if ckpt.info(&name).is_some() && !specs.iter().any(|s| s.0 == name) {
                    return Err(module_error(
                        &name,
                        format!(
                            "is stored, but the recorded CPU layout of layer {layer} has no \
                             place for it ({} in {}): the record and the tensors disagree",
                            o.path,
                            file.display()
                        ),
                    ));
                }
            }
            cpu_layers.push(g);
            continue;
        }
        let scale_dtype = o
            .opt_str("scale_dtype")?
            .and_then(DType::from_header)
            .ok_or_else(|| o.field("scale_dtype").invalid("expected a dtype name"))?;
        let weights = match o.field("weights").opt_object()? {
            Some(w) => Some(crate::scheme::QuantArgs::parse_obj(
                &w,
                crate::scheme::ArgsRole::Weights,
            )?),
            None => None,
        };
        let geometry = MarlinGeometry {
            prefix: prefix_of(layer)?,
            experts: need_size("num_experts")?,
            hidden: need_size("hidden_size")?,
            intermediate: need_size("intermediate_size")?,
            intermediate_padded: need_size("intermediate_size_padded")?,
            bits: match need_u("num_bits")? {
                b @ (4 | 8) => b as u32,
                b => return Err(o.field("num_bits").invalid(format!("{b} is not 4 or 8"))),
            },
            group_size: o.opt_i64("group_size")?.unwrap_or(-1),
            symmetric: o.opt_bool("symmetric")?.unwrap_or(true),
            act_order: o.opt_bool("act_order")?.unwrap_or(false),
            scale_dtype,
        };
        if geometry.intermediate > geometry.intermediate_padded {
            return Err(o.field("intermediate_size").invalid(format!(
                "{} is above intermediate_size_padded {}",
                geometry.intermediate, geometry.intermediate_padded
            )));
        }
        check_specs(ckpt, &geometry.specs(), "Marlin")?;
        // The source's weight args, recorded beside the geometry the tensors were checked
        // against: the plan reads them, so they must say what the geometry says.
        if let Some(w) = &weights {
            let disagreement = geometry.disagreements(w);
            if !disagreement.is_empty() {
                return Err(o.field("weights").invalid(format!(
                    "{}: the record is damaged",
                    disagreement.join(", ")
                )));
            }
        }
        layers.push(RepackedLayer {
            layer,
            geometry,
            weights,
        });
    }
    Ok(Some(RepackedLayout {
        layout,
        version,
        layers,
        cpu_layers,
    }))
}

/// One repacked layer as `report_json` lists it.
struct RepackedEntry<'a> {
    layer: usize,
    /// `<layer prefix>.experts`
    prefix: &'a str,
    experts: usize,
    hidden: usize,
    intermediate: usize,
    padded: usize,
    weights: Option<crate::scheme::QuantArgs>,
    activation: Option<crate::scheme::QuantArgs>,
}

/// Every stacked tensor of a recorded layout must be there with the recorded dtype and shape.
fn check_specs(ckpt: &Checkpoint, specs: &[(String, DType, Vec<usize>)], what: &str) -> Result<()> {
    for (name, dtype, shape) in specs {
        match ckpt.info(name) {
            Some(t) if t.dtype == *dtype && t.shape.as_slice() == shape.as_slice() => {}
            Some(t) => {
                return Err(module_error(
                    name,
                    format!(
                        "is {} {:?}, the recorded {what} layout says {} {:?}",
                        t.dtype,
                        t.shape.as_slice(),
                        dtype,
                        shape
                    ),
                ))
            }
            None => {
                return Err(module_error(
                    name,
                    "is missing from the repacked checkpoint",
                ))
            }
        }
    }
    Ok(())
}

impl Model {
    pub fn open(dir: &Path) -> Result<Model> {
        let ckpt = Checkpoint::open(dir)?;
        let config_file = ckpt.config_path();
        let quant = QuantizationConfig::from_model_config(&config_file, ckpt.config())?;
        let table = smod::ModuleTable::build(&ckpt);
        let analysed: Vec<ModuleInfo> = table
            .as_slice()
            .par_iter()
            .filter_map(|(m, slots)| {
                (smod::module_class(m, slots) == crate::scheme::ModuleClass::Linear)
                    .then(|| smod::analyze(&ckpt, &config_file, quant.as_ref(), m, slots))
            })
            // Every result, then the first error in name order: a parallel collect into a
            // Result stops at whichever error a thread meets first, so the module an error
            // named changed from run to run.
            .collect::<Vec<Result<_>>>()
            .into_iter()
            .collect::<Result<_>>()?;
        let names: Vec<String> = table.names().map(str::to_string).collect();
        drop(table);
        // `table` is sorted by name and the parallel collect keeps that order.
        let modules = analysed;
        let find = |name: &str| find_module(&modules, name);

        let layout = parse_layout(&ckpt)?;
        let repacked: Vec<(usize, &str)> = layout.as_ref().map_or(Vec::new(), |l| {
            l.layers
                .iter()
                .map(|rl| (rl.layer, rl.geometry.prefix.as_str()))
                .chain(l.cpu_layers.iter().map(|g| (g.layer, g.prefix.as_str())))
                .collect()
        });
        let repacked_prefixes: Vec<&str> = repacked.iter().map(|&(_, p)| p).collect();
        if let Some(name) = moe::fused_expert_tensor(&ckpt, &repacked_prefixes) {
            return Err(UnsupportedSchemeError {
                subject: format!("tensor '{name}'"),
                reason: "holds several experts in one tensor (a fused layout such as \
                         transformers 5's experts.gate_up_proj [E, 2I, H]); moeq_rs reads \
                         experts stored one module each (experts.<e>.gate_proj, up_proj, \
                         down_proj, or w1/w3/w2), as compressed-tensors saves them"
                    .to_string(),
            }
            .into());
        }
        let discovery = moe::discover(&ckpt, &names, &repacked)?;
        let lookup = |name: &str| -> Result<ModuleInfo> {
            find(name)
                .cloned()
                .ok_or_else(|| module_error(name, "is not a Linear module with a 2-D weight"))
        };
        let config = ckpt.config();
        let configured = moe::configured_num_experts(&ckpt.config_path(), config)?;
        // (where config.json says it, e.g. `text_config.hidden_size`, and the value)
        let size_at = |key: &str| moe::configured_size(&ckpt.config_path(), config, key);
        let hidden_cfg = size_at("hidden_size")?;
        // The routed experts' width, in the families that name it apart from the dense MLP's
        // `intermediate_size` (Qwen-MoE, DeepSeek, GLM-MoE, ...): transformers and vLLM build
        // the experts from it, so experts of another width fail to load there. Where it is a
        // list (per layer or per modality in some families), it is not checked.
        let moe_inter_cfg = size_at("moe_intermediate_size")?;
        // The shared expert's width, where the config fixes it (transformers and vLLM build the
        // shared expert from it, none for 0, so a stored one of another width fails to load
        // there, and the forward here added it all the same): Nemotron-H's
        // `moe_shared_expert_intermediate_size` (times `n_shared_experts`), Qwen2-MoE's,
        // Qwen3-Next's and Laguna's `shared_expert_intermediate_size`; without either, the
        // DeepSeek lineage's `n_shared_experts` experts of `moe_intermediate_size` each (fused
        // into one MLP: DeepSeek-V2/V3, Kimi-K2, GLM-4.5, dots.llm1).
        let n_shared = size_at("n_shared_experts")?;
        let shared_cfg: Option<(String, usize)> =
            if let Some((at, v)) = size_at("moe_shared_expert_intermediate_size")? {
                Some(match &n_shared {
                    Some((nat, n)) => (format!("{at} {v} x {nat} {n}"), v.saturating_mul(*n)),
                    None => (format!("{at} {v}"), v),
                })
            } else if let Some((at, v)) = size_at("shared_expert_intermediate_size")? {
                Some((format!("{at} {v}"), v))
            } else {
                n_shared.and_then(|(at, n)| {
                    moe_inter_cfg
                        .as_ref()
                        .map(|(mat, mi)| (format!("{at} {n} x {mat} {mi}"), n.saturating_mul(*mi)))
                })
            };
        let mut moe_layers = Vec::with_capacity(discovery.layers.len());
        let mut any_bias = false;
        for d in discovery.layers {
            let owner = format!("{}.experts", d.prefix);
            let count = d.experts.len();
            if let Some(missing) = (0..count).find(|e| !d.experts.contains_key(e)) {
                // (The highest index says why, where it is far past the count.)
                let highest = d.experts.keys().next_back().copied().unwrap_or(0);
                return Err(module_error(
                    &owner,
                    format!(
                        "expert indices are not 0..{}: expert {missing} is missing (the \
                         highest index is {highest})",
                        count - 1
                    ),
                ));
            }
            let expected = quant
                .as_ref()
                .and_then(|q| q.moe_num_experts.as_ref())
                .and_then(|v| v.get(d.layer).copied().flatten())
                .or(configured);
            if let Some(n) = expected {
                if n != count {
                    return Err(module_error(
                        &owner,
                        format!(
                            "holds {count} experts but the config declares {n} for layer {}",
                            d.layer
                        ),
                    ));
                }
            }
            let mut experts = Vec::with_capacity(count);
            for (e, roles) in &d.experts {
                experts.push(moe::assemble(&format!("{owner}.{e}"), roles, lookup)?);
            }
            let gated = experts.first().is_some_and(|e| e.gate.is_some());
            let mut dims = None;
            for (e, x) in experts.iter().enumerate() {
                if x.gate.is_some() != gated {
                    return Err(module_error(
                        &format!("{owner}.{e}"),
                        "has a different set of projections than expert 0 (gate_proj present in some experts only)",
                    ));
                }
                let hd = moe::expert_dims(&format!("{owner}.{e}"), x)?;
                match dims {
                    None => dims = Some(hd),
                    Some(first) if first != hd => {
                        return Err(module_error(
                            &format!("{owner}.{e}"),
                            format!("has hidden/intermediate {hd:?}, expert 0 has {first:?}"),
                        ))
                    }
                    Some(_) => {}
                }
            }
            let (hidden_size, intermediate_size) = dims.unwrap_or((0, 0));
            if let Some((at, h)) = &hidden_cfg {
                if *h != hidden_size {
                    return Err(module_error(
                        &owner,
                        format!("experts take {hidden_size} inputs but config.json says {at} {h}"),
                    ));
                }
            }
            if let Some((at, i)) = &moe_inter_cfg {
                if *i != intermediate_size {
                    return Err(module_error(
                        &owner,
                        format!(
                            "experts have intermediate size {intermediate_size} but config.json \
                             says {at} {i}"
                        ),
                    ));
                }
            }
            if let Some(r) = &d.router {
                if let Some(info) = ckpt.info(&r.weight) {
                    if info.shape.as_slice() != [count, hidden_size] {
                        return Err(module_error(
                            &r.module,
                            format!(
                                "router weight has shape {:?}, expected [{count}, {hidden_size}]",
                                info.shape
                            ),
                        ));
                    }
                }
            }
            // A bias routes by sigmoid even where the router is not found under a known name.
            any_bias |= d.correction_bias.is_some();
            let shared_experts: Option<ExpertModules> = if d.shared.is_empty() {
                None
            } else {
                let s = moe::assemble(&format!("{}.shared_experts", d.prefix), &d.shared, lookup)?;
                check_shared_expert(&s, hidden_size, shared_cfg.as_ref())?;
                Some(s)
            };
            moe_layers.push(MoeLayer {
                layer: d.layer,
                prefix: d.prefix,
                experts,
                gated,
                hidden_size,
                intermediate_size,
                router: d.router,
                correction_bias: d.correction_bias,
                shared_experts,
                shared_expert_gate: d.shared_expert_gate,
            });
        }
        if let Some(l) = &layout {
            let prefixes = l
                .layers
                .iter()
                .map(|rl| rl.geometry.prefix.as_str())
                .chain(l.cpu_layers.iter().map(|g| g.prefix.as_str()));
            for p in prefixes {
                let lp = p.strip_suffix(".experts").unwrap_or(p);
                any_bias |= moe::find_correction_bias(&ckpt, lp).is_some();
            }
        }
        let routing = Routing::from_config(&config_file, config, any_bias)?;
        let hidden_act = moe::hidden_act(&config_file, config)?;
        let unsupported_parts = moe::unsupported_parts(&ckpt, &names);
        Ok(Model {
            hidden_act,
            layout,
            ckpt,
            quant,
            modules,
            moe_layers,
            dense_layers: discovery.dense_layers,
            set_aside_moe: discovery.set_aside,
            routing,
            unsupported_parts,
        })
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }
    pub fn quantization_config(&self) -> Option<&QuantizationConfig> {
        self.quant.as_ref()
    }
    pub fn moe_layers(&self) -> &[MoeLayer] {
        &self.moe_layers
    }
    pub fn dense_layers(&self) -> &[usize] {
        &self.dense_layers
    }
    pub fn routing(&self) -> &Routing {
        &self.routing
    }
    /// `config.json`'s `hidden_act` (the experts' activation), as written.
    pub fn hidden_act(&self) -> Option<&str> {
        self.hidden_act.as_deref()
    }

    /// Whether the CPU forward computes what `config.json` describes for a MoE layer of
    /// `experts` experts at `layer_prefix`: SiLU-gated experts and routing it follows
    /// ([`crate::moe::Routing::check`], told whether this layer's router has a
    /// score-correction bias). Otherwise the `config.json` key and the reason.
    pub fn cpu_layer_check(
        &self,
        layer_prefix: &str,
        experts: usize,
    ) -> std::result::Result<(), (&'static str, String)> {
        if !moe::is_silu(self.hidden_act()) {
            return Err((
                "hidden_act",
                format!(
                    "\"{}\" experts are not implemented (the CPU kernels compute silu(gate) * up)",
                    self.hidden_act().unwrap_or_default()
                ),
            ));
        }
        let biased = moe::find_correction_bias(&self.ckpt, layer_prefix).is_some();
        self.routing.check(experts, biased)
    }
    /// The repacked layout, when this checkpoint was written by `moeq repack`.
    pub fn layout(&self) -> Option<&RepackedLayout> {
        self.layout.as_ref()
    }

    /// The analysed Linear module `name`.
    pub fn module(&self, name: &str) -> Result<&ModuleInfo> {
        let found = find_module(&self.modules, name);
        found.ok_or_else(|| {
            let weight = format!("{name}.weight");
            let reason = if self.checkpoint().contains(&weight) {
                // Routers, embeddings and norms have a weight but are never quantized.
                format!(
                    "not a quantizable Linear module (a router, embedding or norm, which \
                     compressed-tensors leaves unquantized); read '{weight}' as stored with \
                     Checkpoint.tensor"
                )
            } else {
                "no such Linear module in the checkpoint (expected tensors '<module>.weight' or '<module>.weight_packed')"
                    .into()
            };
            CheckpointError::Module {
                module: name.to_string(),
                reason,
            }
            .into()
        })
    }

    pub fn dequantize(&self, name: &str) -> Result<Dequantized> {
        self.dequantize_with(name, false)
    }

    /// With `exact_f32`, `(q - zp) * scale` in f32 without rounding to the scale dtype.
    pub fn dequantize_with(&self, name: &str, exact_f32: bool) -> Result<Dequantized> {
        let info = self.module(name)?;
        let version = self.quant.as_ref().and_then(|q| q.version.as_deref());
        quant::dequantize_with(&self.ckpt, info, version, exact_f32)
    }

    /// The oracle's input for one MoE layer.
    pub fn layer_input(layer: &MoeLayer) -> LayerInput {
        LayerInput {
            layer: layer.layer,
            shape: LayerShape {
                hidden: layer.hidden_size,
                intermediate: layer.intermediate_size,
                num_experts: layer.experts.len(),
                gated: layer.gated,
            },
            experts: layer
                .experts
                .iter()
                .map(|e| ExpertSchemes {
                    gate: e.gate.as_ref().map(proj_scheme),
                    up: proj_scheme(&e.up),
                    down: proj_scheme(&e.down),
                })
                .collect(),
        }
    }

    /// [`Self::layer_input`] as vLLM reads the config: a group's `"input_activations": {}` is
    /// no activation quantization there (see
    /// [`crate::scheme::config::Scheme::vllm_input_activations`]).
    pub fn vllm_layer_input(layer: &MoeLayer) -> LayerInput {
        let mut input = Self::layer_input(layer);
        let modules = layer
            .experts
            .iter()
            .map(|e| [e.gate.as_ref(), Some(&e.up), Some(&e.down)]);
        for (schemes, modules) in input.experts.iter_mut().zip(modules) {
            let slots = [
                schemes.gate.as_mut(),
                Some(&mut schemes.up),
                Some(&mut schemes.down),
            ];
            for (s, m) in slots.into_iter().zip(modules) {
                if let (Some(s), Some(m)) = (s, m) {
                    s.activation = m.vllm_input_activations().cloned();
                }
            }
        }
        input
    }

    /// The plan of every MoE layer.
    pub fn plan(&self, platform: Platform, opts: Options) -> Vec<LayerPlan> {
        self.moe_layers
            .iter()
            .map(|l| oracle::plan_layer(&Self::layer_input(l), platform, opts))
            .collect()
    }

    /// `moeq inspect --json` on the machine's own CPU with default options.
    pub fn summary_json(&self) -> Value {
        self.report_json(
            Platform::Cpu(CpuFeatures::detect()),
            Options::default(),
            false,
        )
    }

    /// A part of the MoE block at `prefix` (`...mlp`) that no kernel computes.
    pub fn unsupported_part(&self, prefix: &str) -> Option<&moe::UnsupportedPart> {
        self.unsupported_parts.get(prefix)
    }

    /// The error message of [`Model::unsupported_part`].
    fn unsupported_part_message(&self, prefix: &str) -> Option<String> {
        self.unsupported_part(prefix).map(|p| p.error().to_string())
    }

    /// A layer with an unsupported part has no backend, on any platform.
    fn refuse_unsupported_part(&self, plan: &mut oracle::LayerPlan, prefix: &str) {
        if let Some(why) = self.unsupported_part_message(prefix) {
            refuse(plan, why);
        }
    }

    /// A CPU plan whose layer the CPU forward cannot compute as `config.json` describes
    /// ([`Model::cpu_layer_check`]) loses its backend, with the reason in `error` and among
    /// the rejected backends: what `MoELayer.from_checkpoint` would refuse, said up front.
    fn refuse_unroutable(&self, plan: &mut oracle::LayerPlan, layer_prefix: &str, experts: usize) {
        if plan.backend != Some(Backend::CpuSimd) && plan.method != oracle::Method::Unquantized {
            return;
        }
        if let Err((key, reason)) = self.cpu_layer_check(layer_prefix, experts) {
            refuse(plan, format!("config.json: {key}: {reason}"));
        }
    }

    /// Why a layer that `moeq repack` wrote in one kernel's layout cannot run on `platform`'s
    /// backends: the Marlin layout is read by the CUDA kernels only, the CPU layout by the CPU
    /// forward only.
    pub fn layout_refusal(&self, layer: usize, platform: Platform) -> Option<String> {
        let layout = self.layout.as_ref()?;
        let on_cpu = matches!(platform, Platform::Cpu(_));
        let marlin = layout.layers.iter().any(|l| l.layer == layer);
        let cpu = layout.cpu_layers.iter().find(|l| l.layer == layer);
        let (stored, reader, target) = match (on_cpu, marlin, cpu) {
            (true, true, _) => (
                "vLLM's Marlin layout (moeq repack --target marlin)",
                "the CPU forward",
                Some("cpu"),
            ),
            (false, _, Some(g)) => (
                "the CPU layout (moeq repack --target cpu)",
                "the CUDA kernels",
                // Marlin holds weight-only experts; W8A8 runs on CUDA from its source form.
                g.activation.is_none().then_some("marlin"),
            ),
            _ => return None,
        };
        let or_repack =
            target.map_or_else(String::new, |t| format!(", or repack it with --target {t}"));
        Some(format!(
            "stored in {stored}, which {reader} cannot read; load the source checkpoint{or_repack}"
        ))
    }

    /// What the loaders refuse in a W8A8-static layer's activation scales, read from the
    /// tensors as they read them: a scale that is not finite and positive
    /// ([`crate::cpu::load::input_scales`]), or an expert whose gate and up projections carry
    /// different `input_scale`s (DESIGN.md: gate and up see the same input and must share one).
    /// One scalar per projection, read only for layers with static activation scales.
    pub fn static_scale_problem(&self, l: &MoeLayer) -> Option<crate::error::Error> {
        let first = |m: &ModuleInfo| -> Result<Option<f32>> {
            if !m.has_input_scale {
                return Ok(None);
            }
            let v = crate::cpu::load::input_scales(&self.ckpt, &format!("{}.input_scale", m.name))?;
            Ok(v.first().copied())
        };
        let check = || -> Result<()> {
            for e in &l.experts {
                let gate = e.gate.as_ref().map(first).transpose()?.flatten();
                let up = first(&e.up)?;
                first(&e.down)?;
                if let (Some(g), Some(a), Some(b)) = (&e.gate, gate, up) {
                    crate::cpu::load::same_static_scale(&g.name, &e.up.name, a, b)?;
                }
            }
            Ok(())
        };
        check().err()
    }

    /// The block prefixes (`model.layers.N.mlp`) of every MoE layer: those read from expert
    /// tensors and those stored in a repacked layout.
    fn moe_block_prefixes(&self) -> impl Iterator<Item = &str> {
        let repacked = self.layout.iter().flat_map(|l| {
            l.layers
                .iter()
                .map(|rl| rl.geometry.prefix.as_str())
                .chain(l.cpu_layers.iter().map(|g| g.prefix.as_str()))
        });
        self.moe_layers
            .iter()
            .map(|l| l.prefix.as_str())
            .chain(repacked.map(|p| p.strip_suffix(".experts").unwrap_or(p)))
    }

    /// What is wrong with the router score-correction bias of the MoE block at `layer_prefix`
    /// (`experts` experts), as a plan refusal and a loader error: a bias shaped as no model
    /// stores one ([`moe::correction_bias_problem`]), or none where another MoE layer of the
    /// checkpoint stores one, so that its experts would be chosen without it (vLLM refuses such
    /// a checkpoint: a weight it expects is never loaded; transformers routes with zeros). Not
    /// an error at open, which other tools read.
    pub fn correction_bias_problem(
        &self,
        layer_prefix: &str,
        experts: usize,
    ) -> Option<crate::error::Error> {
        if let Some(name) = moe::find_correction_bias(&self.ckpt, layer_prefix) {
            // ERNIE-4.5-VL's bias holds a row per modality (its layers are refused on the CPU
            // for their routing, and planned on CUDA as vLLM runs them).
            let per_modality = moe::model_type(self.ckpt.config()).starts_with("ernie4_5_vl_moe");
            return moe::correction_bias_problem(&self.ckpt, &name, experts, per_modality);
        }
        let (other, name) = self
            .moe_block_prefixes()
            .find_map(|p| Some((p, moe::find_correction_bias(&self.ckpt, p)?)))?;
        let suffix = name.strip_prefix(other)?;
        Some(
            crate::error::CheckpointError::Module {
                module: layer_prefix.to_string(),
                reason: format!(
                    "has no router score-correction bias ('{layer_prefix}{suffix}' is not in the \
                     checkpoint), where {other} stores one ('{name}'): its experts would be \
                     chosen without it (vLLM refuses such a checkpoint, transformers routes \
                     with zeros)"
                ),
            }
            .into(),
        )
    }

    /// What the CPU forward cannot read in a layer's shared expert: a projection stored
    /// unquantized in another dtype than BF16, F16 or F32, or a shared expert gate that is not a
    /// `[1, hidden]` vector of those (a quantized one, say). A CPU plan refusal and a loader
    /// error, not an error opening the checkpoint, which other platforms and tools read.
    pub fn shared_expert_problem(&self, l: &MoeLayer) -> Option<crate::error::Error> {
        if let Some(s) = &l.shared_experts {
            for m in s.gate.iter().chain([&s.up, &s.down]) {
                if m.scheme.is_none() && !plain_float(m.weight_dtype) {
                    return Some(module_error(
                        &m.weight_tensor,
                        format!(
                            "is stored unquantized as {}; the CPU forward reads unquantized \
                             weights as BF16, F16 or F32",
                            m.weight_dtype
                        ),
                    ));
                }
            }
        }
        let module = l.shared_expert_gate.as_ref()?;
        let name = format!("{module}.weight");
        let Some(info) = self.ckpt.info(&name) else {
            return Some(module_error(
                module,
                "has no plain '.weight' tensor (is it stored quantized?); the CPU forward reads \
                 the shared expert gate as a [1, hidden] BF16, F16 or F32 vector",
            ));
        };
        (!plain_float(info.dtype) || info.numel() != l.hidden_size).then(|| {
            module_error(
                &name,
                format!(
                    "is {} {:?}; the CPU forward reads the shared expert gate as [1, {}] BF16, \
                     F16 or F32",
                    info.dtype, info.shape, l.hidden_size
                ),
            )
        })
    }

    /// The JSON document of `moeq inspect --json` (DESIGN.md "Contracts"): checkpoint facts,
    /// the oracle's plan per layer, and with `compat` what vLLM would do.
    pub fn report_json(&self, platform: Platform, opts: Options, compat: bool) -> Value {
        let mut regressions: Vec<(oracle::vllm::Regression, Vec<usize>)> = Vec::new();
        // A config vLLM cannot parse fails the whole model before any MoE decision.
        let vllm_parse_error = self
            .quant
            .as_ref()
            .filter(|_| compat)
            .and_then(oracle::vllm::config_parse_error);
        let layers: Vec<Value> = self
            .moe_layers
            .iter()
            .map(|l| {
                let input = Self::layer_input(l);
                let mut plan = oracle::plan_layer(&input, platform, opts);
                if matches!(platform, Platform::Cpu(_)) {
                    self.refuse_unroutable(&mut plan, &l.prefix, l.experts.len());
                    if let Some(e) = self.shared_expert_problem(l) {
                        refuse(&mut plan, e.to_string());
                    }
                }
                self.refuse_unsupported_part(&mut plan, &l.prefix);
                if let Some(e) = self.static_scale_problem(l) {
                    refuse(&mut plan, e.to_string());
                }
                if let Some(e) = self.correction_bias_problem(&l.prefix, l.experts.len()) {
                    refuse(&mut plan, e.to_string());
                }
                let mut v = layer_json(l);
                if let Some(obj) = v.as_object_mut() {
                    obj.insert(
                        "unsupported".into(),
                        json!(self.unsupported_part_message(&l.prefix)),
                    );
                }
                add_plan_json(&mut v, &plan);
                if compat {
                    let seen_by_vllm = Self::vllm_layer_input(l);
                    let verdict = match &vllm_parse_error {
                        Some(e) => oracle::vllm::VllmVerdict {
                            error: Some(e.clone()),
                            ..Default::default()
                        },
                        None => oracle::vllm::vllm_layer(&seen_by_vllm, platform, opts.tp_size),
                    };
                    if let Some(obj) = v.as_object_mut() {
                        obj.insert(
                            "vllm".into(),
                            json!({
                                "method": verdict.method,
                                "backend": verdict.backend,
                                "error": verdict.error,
                                "notes": verdict.notes,
                            }),
                        );
                    }
                    // A model whose config vLLM cannot parse never reaches the layer code
                    // those regressions are in (the parse assert is older than all of them).
                    let layer_regressions = match vllm_parse_error {
                        Some(_) => Vec::new(),
                        None => oracle::vllm::regressions(&seen_by_vllm),
                    };
                    for r in layer_regressions {
                        match regressions.iter_mut().find(|(x, _)| x.id == r.id) {
                            Some((_, layers)) => layers.push(l.layer),
                            None => regressions.push((r, vec![l.layer])),
                        }
                    }
                }
                v
            })
            .collect();
        let mut layers = layers;
        if let Some(layout) = &self.layout {
            let mut entries: Vec<RepackedEntry<'_>> = Vec::new();
            for rl in &layout.layers {
                let g = &rl.geometry;
                entries.push(RepackedEntry {
                    layer: rl.layer,
                    prefix: &g.prefix,
                    experts: g.experts,
                    hidden: g.hidden,
                    intermediate: g.intermediate,
                    padded: g.intermediate_padded,
                    weights: rl.weights.clone(),
                    activation: None,
                });
            }
            for g in &layout.cpu_layers {
                entries.push(RepackedEntry {
                    layer: g.layer,
                    prefix: &g.prefix,
                    experts: g.experts,
                    hidden: g.hidden,
                    intermediate: g.intermediate,
                    padded: g.intermediate,
                    weights: Some(g.weights.clone()),
                    activation: g.activation.clone(),
                });
            }
            for RepackedEntry {
                layer,
                prefix,
                experts,
                hidden,
                intermediate,
                padded,
                weights,
                activation,
            } in entries
            {
                let format = if activation.is_some() {
                    crate::scheme::Format::IntQuantized
                } else {
                    crate::scheme::Format::PackQuantized
                };
                let scheme = ProjScheme {
                    weights: weights.clone(),
                    activation: activation.clone(),
                    format,
                    vllm_format: None,
                };
                let input = LayerInput {
                    layer,
                    shape: LayerShape {
                        hidden,
                        intermediate,
                        num_experts: experts,
                        // A repacked layer's w13 holds gate and up rows.
                        gated: true,
                    },
                    experts: vec![
                        ExpertSchemes {
                            gate: Some(scheme.clone()),
                            up: scheme.clone(),
                            down: scheme
                        };
                        experts
                    ],
                };
                let mut plan = oracle::plan_layer(&input, platform, opts);
                let layer_prefix = prefix
                    .strip_suffix(".experts")
                    .unwrap_or(prefix)
                    .to_string();
                if matches!(platform, Platform::Cpu(_)) {
                    self.refuse_unroutable(&mut plan, &layer_prefix, experts);
                }
                if let Some(why) = self.layout_refusal(layer, platform) {
                    refuse(&mut plan, why);
                }
                if let Some(e) = self.correction_bias_problem(&layer_prefix, experts) {
                    refuse(&mut plan, e.to_string());
                }
                self.refuse_unsupported_part(&mut plan, &layer_prefix);
                // The stacked static scales, checked as the loader reads them (as
                // `static_scale_problem` does for a source checkpoint's).
                if activation.as_ref().is_some_and(|a| !a.is_dynamic()) {
                    for which in ["w13_input_scale", "w2_input_scale"] {
                        let name = format!("{prefix}.{which}");
                        if let Err(e) = crate::cpu::load::input_scales(&self.ckpt, &name) {
                            refuse(&mut plan, e.to_string());
                            break;
                        }
                    }
                }
                let router = moe::find_router(&self.ckpt, &layer_prefix);
                let shared = moe::SHARED_EXPERT_NAMES.iter().find_map(|s| {
                    let sp = format!("{layer_prefix}.{s}");
                    let up = self.module(&format!("{sp}.up_proj")).ok()?;
                    let (w, a, f) = module_scheme_json(up);
                    Some(json!({"prefix": sp, "intermediate_size": up.out_features, "weight": w, "activation": a, "format": f}))
                });
                let mut v = json!({
                    "layer": layer,
                    "prefix": layer_prefix,
                    "num_experts": experts,
                    "hidden_size": hidden,
                    "intermediate_size": intermediate,
                    "intermediate_size_padded": padded,
                    "gated": true,
                    "layout": layout.layout,
                    "router": router.map(|r| json!({"module": r.module, "e_score_correction_bias": moe::find_correction_bias(&self.ckpt, &layer_prefix)})),
                    "shared_experts": shared,
                    "unsupported": self.unsupported_part_message(&layer_prefix),
                    "weight": weights.as_ref().map(|w| w.weight_json()),
                    "activation": activation.as_ref().map(|a| a.activation_json()),
                    "format": format.name(),
                    "mixed": false,
                });
                add_plan_json(&mut v, &plan);
                if compat {
                    if let Some(obj) = v.as_object_mut() {
                        obj.insert(
                            "vllm".into(),
                            json!({
                                "method": null,
                                "backend": null,
                                "error": format!(
                                    "vLLM loads compressed-tensors checkpoints, not the {} layout \
                                     moeq repack writes (repack runs its load-time conversion \
                                     ahead); give vLLM the source checkpoint",
                                    layout.layout
                                ),
                                "notes": [],
                            }),
                        );
                    }
                }
                layers.push(v);
            }
            layers.sort_by_key(|l| l.get("layer").and_then(Value::as_u64).unwrap_or(0));
        }
        let (sm, features) = match platform {
            Platform::Cuda { sm } => (Some(sm), None),
            Platform::Cpu(f) => (None, Some(f.names())),
        };
        // Layers a Qwen-MoE family's config makes the other kind (see [`moe::sparse_layers`]).
        let found: Vec<usize> = self.moe_layers.iter().map(|l| l.layer).collect();
        let config_mismatch =
            moe::sparse_layers::mismatches(self.ckpt.config(), &found, &self.dense_layers);
        let mut doc = json!({
            "model_dir": self.ckpt.dir().display().to_string(),
            "quant_method": self.quant.as_ref().map(|q| q.quant_method.clone()),
            "format": self.quant.as_ref().and_then(|q| q.format).map(|f| f.name()),
            "version": self.quant.as_ref().and_then(|q| q.version.clone()),
            "model_type": moe::model_type(self.ckpt.config()),
            "hidden_act": self.hidden_act,
            "hidden_act_supported": moe::is_silu(self.hidden_act()),
            "layout": self.layout.as_ref().map_or("compressed-tensors", |l| l.layout.as_str()),
            "routing": routing_json(&self.routing),
            "dense_layers": self.dense_layers,
            "config_layer_mismatch": config_mismatch.iter().map(|m| json!({
                "layer": m.layer,
                "config": if m.config_moe { "moe" } else { "dense" },
                "tensors": if m.config_moe { "dense" } else { "moe" },
                "reason": m.reason,
            })).collect::<Vec<_>>(),
            "set_aside_moe": self.set_aside_moe,
            "platform": {"name": platform.name(), "sm": sm, "cpu_features": features},
            "tp_size": opts.tp_size,
            "requested_backend": opts.backend.map(Backend::name),
            "moe_layers": layers,
        });
        if compat {
            if let Some(obj) = doc.as_object_mut() {
                obj.insert("vllm_snapshot".into(), json!(oracle::vllm::VLLM_SNAPSHOT));
                obj.insert(
                    "vllm_regressions".into(),
                    Value::Array(
                        regressions
                            .into_iter()
                            .map(|(r, layers)| json!({"id": r.id, "prs": r.prs, "summary": r.summary, "layers": layers}))
                            .collect(),
                    ),
                );
            }
        }
        doc
    }
}

/// A shared expert is checked as the routed experts are, when the checkpoint opens: its
/// projections fit together ([`moe::expert_dims`]) and take the routed experts' hidden size.
/// Unchecked, a mis-sized one loaded and then panicked in the forward or ran with the wrong
/// sizes. Its intermediate size may differ from the routed experts', but where the config
/// fixes it (`configured`: what the config says, and the width) it must be that.
fn check_shared_expert(
    s: &ExpertModules,
    hidden_size: usize,
    configured: Option<&(String, usize)>,
) -> Result<()> {
    let owner =
        s.up.name
            .strip_suffix(".up_proj")
            .unwrap_or(&s.up.name)
            .to_string();
    let (h, i) = moe::expert_dims(&owner, s)?;
    if h != hidden_size {
        return Err(module_error(
            &owner,
            format!("takes {h} inputs but the routed experts take {hidden_size}"),
        ));
    }
    if let Some((says, want)) = configured {
        if i != *want {
            return Err(module_error(
                &owner,
                format!(
                    "is a shared expert of intermediate size {i}, but config.json says {says} \
                     ({want}{})",
                    if *want == 0 { ": no shared expert" } else { "" }
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `dtype` is one the CPU forward reads unquantized weights and the shared expert
/// gate in.
fn plain_float(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
}

/// The plan loses its backend (kept among the rejected ones, with `why`), and says `why` in
/// `error` unless it already has an error.
fn refuse(plan: &mut oracle::LayerPlan, why: String) {
    if let Some(b) = plan.backend.take() {
        plan.rejected.push((b, why.clone()));
    }
    plan.error.get_or_insert(why);
}

fn routing_json(r: &Routing) -> Value {
    json!({
        "top_k": r.top_k,
        "renormalize": r.renormalize,
        "scoring_func": r.unsupported_scoring.as_deref().unwrap_or(r.scoring.name()),
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "routed_scaling_factor": r.routed_scaling_factor,
        "logit_softcapping": r.logit_softcapping,
        "family_checked": r.family_checked,
        "family_defaults": r.family_defaults,
        "unsupported_family": r.unsupported_model,
    })
}

/// The analysed module `name` (the list is sorted by name).
fn find_module<'a>(modules: &'a [ModuleInfo], name: &str) -> Option<&'a ModuleInfo> {
    let i = modules
        .binary_search_by(|m| m.name.as_str().cmp(name))
        .ok()?;
    modules.get(i)
}

fn proj_scheme(m: &ModuleInfo) -> ProjScheme {
    ProjScheme {
        weights: m.weights().cloned(),
        activation: m.input_activations().cloned(),
        format: m.format(),
        vllm_format: m.vllm_format(),
    }
}

fn quant_config_json(q: Option<&QuantConfig>) -> Value {
    q.map_or(Value::Null, |q| {
        json!({
            "kind": q.kind.name(),
            "per_act_token_quant": q.per_act_token_quant,
            "group_size": q.group_size,
            "static_act_scales": q.static_act_scales,
        })
    })
}

/// Adds the oracle fields of DESIGN.md's contract to a layer's JSON.
fn add_plan_json(v: &mut Value, plan: &LayerPlan) {
    let Some(obj) = v.as_object_mut() else { return };
    obj.insert("method".into(), json!(plan.method.name()));
    obj.insert(
        "scale_kind".into(),
        json!(plan.scale_kind.unwrap_or(if plan.method == Method::Mixed {
            "mixed"
        } else {
            "none"
        })),
    );
    obj.insert(
        "quant_config".into(),
        quant_config_json(plan.quant_config.as_ref()),
    );
    obj.insert("backend".into(), json!(plan.backend.map(Backend::name)));
    obj.insert(
        "rejected_backends".into(),
        Value::Array(
            plan.rejected
                .iter()
                .map(|(b, reason)| json!({"backend": b.name(), "reason": reason}))
                .collect(),
        ),
    );
    obj.insert("error".into(), json!(plan.error));
    if let (Some(experts), Some(Value::Array(entries))) = (&plan.experts, obj.get_mut("experts")) {
        for (entry, ep) in entries.iter_mut().zip(experts) {
            if let Some(e) = entry.as_object_mut() {
                e.insert("method".into(), json!(ep.method.name()));
                e.insert("scale_kind".into(), json!(ep.scale_kind));
                e.insert(
                    "quant_config".into(),
                    quant_config_json(ep.quant_config.as_ref()),
                );
                e.insert("backend".into(), json!(ep.backend.map(Backend::name)));
                e.insert("error".into(), json!(ep.error));
            }
        }
    }
}

/// The scheme facts of one module as JSON: `(weight, activation, format)`.
pub fn module_scheme_json(m: &ModuleInfo) -> (Value, Value, Value) {
    (
        m.weights().map_or(Value::Null, |w| w.weight_json()),
        m.input_activations()
            .map_or(Value::Null, |a| a.activation_json()),
        json!(m.scheme.as_ref().map_or("dense", |s| s.format.name())),
    )
}

/// The shared scheme of a set of modules, or `None` when they differ.
fn common<'a>(mut it: impl Iterator<Item = &'a ModuleInfo>) -> Option<(Value, Value, Value)> {
    let first = module_scheme_json(it.next()?);
    it.all(|m| module_scheme_json(m) == first).then_some(first)
}

fn expert_json(index: usize, e: &ExpertModules) -> Value {
    let mut v = match common(e.modules().map(|(_, m)| m)) {
        Some((w, a, f)) => json!({"expert": index, "weight": w, "activation": a, "format": f}),
        None => json!({"expert": index, "weight": null, "activation": null, "format": null}),
    };
    if let Some(obj) = v.as_object_mut() {
        let projections: serde_json::Map<String, Value> = e
            .modules()
            .map(|(role, m)| {
                let (w, a, f) = module_scheme_json(m);
                (
                    role.name().to_string(),
                    json!({"module": m.name, "weight": w, "activation": a, "format": f}),
                )
            })
            .collect();
        obj.insert("projections".into(), Value::Object(projections));
    }
    v
}

fn layer_json(l: &MoeLayer) -> Value {
    let all = l.experts.iter().flat_map(|e| e.modules().map(|(_, m)| m));
    let mut v = json!({
        "layer": l.layer,
        "prefix": l.prefix,
        "num_experts": l.experts.len(),
        "hidden_size": l.hidden_size,
        "intermediate_size": l.intermediate_size,
        "gated": l.gated,
        "router": l.router.as_ref().map(|r| json!({"module": r.module, "e_score_correction_bias": l.correction_bias})),
        "shared_experts": l.shared_experts.as_ref().map(|s| {
            let (w, a, f) = common(s.modules().map(|(_, m)| m)).unwrap_or((Value::Null, Value::Null, Value::Null));
            json!({"prefix": s.up.name.rsplit_once('.').map_or("", |p| p.0), "intermediate_size": s.up.out_features, "weight": w, "activation": a, "format": f})
        }),
    });
    if let Some(obj) = v.as_object_mut() {
        match common(all) {
            Some((w, a, f)) => {
                obj.insert("weight".into(), w);
                obj.insert("activation".into(), a);
                obj.insert("format".into(), f);
                obj.insert("mixed".into(), json!(false));
            }
            None => {
                obj.insert("weight".into(), Value::Null);
                obj.insert("activation".into(), Value::Null);
                obj.insert("format".into(), Value::Null);
                obj.insert("mixed".into(), json!(true));
                obj.insert(
                    "experts".into(),
                    Value::Array(
                        l.experts
                            .iter()
                            .enumerate()
                            .map(|(i, e)| expert_json(i, e))
                            .collect(),
                    ),
                );
            }
        }
    }
    v
}
