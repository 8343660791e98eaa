//! Discovery of MoE layers, experts, shared experts and routers across naming conventions, and the
//! routing parameters of `config.json`.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::error::{module_error, Result, UnsupportedSchemeError};
use crate::scheme::json::Field;
use crate::scheme::module::ModuleInfo;

pub mod sparse_layers;

/// The role of an expert projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ProjRole {
    Gate,
    Up,
    Down,
}

impl ProjRole {
    pub fn name(self) -> &'static str {
        match self {
            ProjRole::Gate => "gate",
            ProjRole::Up => "up",
            ProjRole::Down => "down",
        }
    }
    fn from_leaf(leaf: &str) -> Option<ProjRole> {
        Some(match leaf {
            "gate_proj" | "w1" => ProjRole::Gate,
            "up_proj" | "w3" => ProjRole::Up,
            "down_proj" | "w2" => ProjRole::Down,
            _ => return None,
        })
    }
}

/// The projections of one expert (or of a shared expert / dense MLP).
#[derive(Clone, Debug)]
pub struct ExpertModules {
    pub gate: Option<ModuleInfo>,
    pub up: ModuleInfo,
    pub down: ModuleInfo,
}

impl ExpertModules {
    pub fn modules(&self) -> impl Iterator<Item = (ProjRole, &ModuleInfo)> {
        self.gate
            .iter()
            .map(|g| (ProjRole::Gate, g))
            .chain([(ProjRole::Up, &self.up), (ProjRole::Down, &self.down)])
    }
}

#[derive(Clone, Debug)]
pub struct Router {
    /// e.g. `model.layers.1.mlp.gate`
    pub module: String,
    pub weight: String,
}

/// One MoE layer.
#[derive(Clone, Debug)]
pub struct MoeLayer {
    pub layer: usize,
    /// e.g. `model.layers.1.mlp` (Mixtral: `model.layers.1.block_sparse_moe`).
    pub prefix: String,
    pub experts: Vec<ExpertModules>,
    pub gated: bool,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub router: Option<Router>,
    /// The router's score-correction bias tensor ([`find_correction_bias`]), found whatever
    /// the router is named.
    pub correction_bias: Option<String>,
    pub shared_experts: Option<ExpertModules>,
    /// `mlp.shared_expert_gate` (Qwen2-MoE), when present.
    pub shared_expert_gate: Option<String>,
}

impl MoeLayer {
    /// Whether the routed experts run act-order for weights `w` (expert 0's): `actorder:
    /// "group"` and a `weight_g_idx` stored by any projection; one stored without is read in
    /// order, as the CPU loader and `dequantize` read it. Both repack targets decide so.
    pub fn act_order(&self, w: &crate::scheme::QuantArgs) -> bool {
        w.actorder == Some(crate::scheme::ActOrder::Group)
            && self
                .experts
                .iter()
                .any(|e| e.modules().any(|(_, m)| m.has_g_idx))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

impl Scoring {
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
        }
    }
}

/// Routing parameters from `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: Option<usize>,
    pub renormalize: bool,
    pub scoring: Scoring,
    /// A `scoring_func` other than softmax and sigmoid, as written: no kernel routes it, and
    /// building a CPU layer refuses it rather than route with softmax.
    pub unsupported_scoring: Option<String>,
    /// Why the model family's router is not the config-driven top-k that the CPU forward
    /// computes (set for families known to route otherwise).
    pub unsupported_model: Option<&'static str>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub routed_scaling_factor: f64,
    /// The `config.json` key `routed_scaling_factor` was read from (families spell it
    /// differently), for errors.
    pub routed_scaling_key: &'static str,
    /// `tanh(logits / c) * c` before scoring when set (Laguna `moe_router_logit_softcapping`).
    pub logit_softcapping: Option<f64>,
    /// `moe_apply_router_weight_on_input` is true: the top-k weight scales each expert's
    /// input, not its output. For SiLU-gated experts that is another function, which no kernel
    /// here computes (and transformers' Laguna refuses it), so CPU layers are refused.
    pub weight_on_input: bool,
    /// Whether the model family's router was checked to be what this config-driven routing
    /// computes (`Family::checked`); other families get the same routing, unverified.
    pub family_checked: bool,
    /// The routing settings, named as the summary names them (`scoring_func`, `renormalize`,
    /// `routed_scaling_factor`, `n_group`, `topk_group`), that `config.json` leaves out and
    /// that take the model family's value (its router or config class) rather than the generic
    /// default (softmax, no renormalisation, scale 1, no groups), where that value is used:
    /// e.g. DeepSeek-V3's scaling factor 2.5.
    pub family_defaults: Vec<&'static str>,
}

/// Where a multimodal wrapper keeps its language model's config: `text_config` (Kimi-VL,
/// Qwen3-VL-MoE, ...) or, for Qwen3-Omni, the thinker's (its talker's MoE blocks are set aside,
/// see [`main_stack`]).
const TEXT_CONFIGS: [&str; 2] = ["text_config", "thinker_config.text_config"];

/// The nested config at a dotted path of [`TEXT_CONFIGS`].
fn nested<'a>(config: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(config, |v, k| v.get(k))
}

/// Looks a key up in the config, then in a nested language-model config (`TEXT_CONFIGS`).
pub fn cfg<'a>(config: &'a Value, key: &str) -> Option<&'a Value> {
    cfg_at(config, key).map(|(_, v)| v)
}

/// [`cfg()`] with the key path where the value was found (`key`, `text_config.key`, ...).
pub fn cfg_at<'a>(config: &'a Value, key: &str) -> Option<(String, &'a Value)> {
    let top = config.get(key).filter(|v| !v.is_null());
    top.map(|v| (key.to_string(), v)).or_else(|| {
        TEXT_CONFIGS.iter().find_map(|path| {
            nested(config, path)
                .and_then(|t| t.get(key))
                .filter(|v| !v.is_null())
                .map(|v| (format!("{path}.{key}"), v))
        })
    })
}

/// The first of `keys` the config sets (at the top level, else in `text_config`), as a typed
/// field whose errors name its key path.
fn cfg_field<'a>(file: &'a Path, config: &'a Value, keys: &[&str]) -> Field<'a> {
    match keys.iter().find_map(|k| cfg_at(config, k)) {
        Some((path, v)) => Field::new(file, path, Some(v)),
        None => Field::new(file, keys.first().copied().unwrap_or(""), None),
    }
}

/// A count field: a non-negative integer that fits `usize` (an integral float such as `8.0`
/// too, as Python's json writes a count that went through a float).
fn count(field: &Field<'_>) -> Result<Option<usize>> {
    let v = match field.value {
        Some(Value::Number(n)) if n.as_u64().is_none() => match n.as_f64() {
            Some(f) if f >= 0.0 && f.fract() == 0.0 && f < u64::MAX as f64 => Some(f as u64),
            _ => field.opt_u64()?,
        },
        _ => field.opt_u64()?,
    };
    v.map(|v| usize::try_from(v).map_err(|_| field.invalid(format!("{v} is too large"))))
        .transpose()
}

/// `(n_group, topk_group)`.
type ExpertGroups = (usize, usize);

/// How a family's router scores when `config.json` names no scoring function.
#[derive(Clone, Copy, PartialEq)]
enum DefaultScoring {
    /// Sigmoid when the layer has a score-correction bias tensor, else softmax.
    Generic,
    /// Sigmoid: the family's router has no softmax branch (vLLM hard-codes it for GLM-4.5).
    Sigmoid,
    /// Softmax even beside a bias tensor (ERNIE-4.5 chooses on softmax scores plus its
    /// `moe_statics` bias).
    Softmax,
    /// A function no kernel has, as the family's config class names it.
    Unsupported(&'static str),
}

/// What routing a model family's `config.json` does not spell out: read from its transformers
/// router and config class (vLLM reads the config through the same class, so it fills in the
/// same values), for the CPU forward's config-driven top-k.
struct Family {
    /// Its `model_type` spellings (the top level's, or a wrapper's `text_config`'s).
    names: &'static [&'static str],
    /// The router was read (transformers, vLLM) and found to be the config-driven top-k computed
    /// here, with the keys and tensors this module reads. Other families route the same way,
    /// unverified, and `moeq inspect` says so.
    checked: bool,
    scoring: DefaultScoring,
    /// Renormalises the top-k weights when `config.json` has no `norm_topk_prob`: the router
    /// always does, or the config class defaults to it.
    renormalize: bool,
    /// The router renormalises whatever `config.json` says: its config class has no
    /// `norm_topk_prob`, or transformers and vLLM both ignore one that a config carries.
    renormalize_always: bool,
    /// With `renormalize_always`: except at top-1, where the one weight stays its score
    /// (vLLM's Hunyuan, `renormalize=top_k > 1`, as Hunyuan-Large's own top-1 gate).
    keep_top_1_score: bool,
    /// The routed scaling factor when `config.json` does not set one.
    scale: f64,
    /// The expert groups when `config.json` does not set them; such families group whatever
    /// `topk_method` says (transformers and vLLM).
    groups: Option<ExpertGroups>,
    /// Why the family's router is not the config-driven top-k the CPU forward computes.
    refusal: Option<&'static str>,
}

/// A family that routes as the generic defaults say: softmax (sigmoid beside a correction bias),
/// no renormalisation, scale 1, no groups.
const fn family(names: &'static [&'static str]) -> Family {
    Family {
        names,
        checked: false,
        scoring: DefaultScoring::Generic,
        renormalize: false,
        renormalize_always: false,
        keep_top_1_score: false,
        scale: 1.0,
        groups: None,
        refusal: None,
    }
}

impl Family {
    const fn checked(self) -> Family {
        Family {
            checked: true,
            ..self
        }
    }
    const fn scoring(self, scoring: DefaultScoring) -> Family {
        Family { scoring, ..self }
    }
    const fn sigmoid(self) -> Family {
        self.scoring(DefaultScoring::Sigmoid)
    }
    const fn renormalizing(self) -> Family {
        Family {
            renormalize: true,
            ..self
        }
    }
    const fn always_renormalizing(self) -> Family {
        Family {
            renormalize: true,
            renormalize_always: true,
            ..self
        }
    }
    const fn keeping_top_1_score(self) -> Family {
        Family {
            keep_top_1_score: true,
            ..self
        }
    }
    const fn scale(self, scale: f64) -> Family {
        Family { scale, ..self }
    }
    const fn groups(self, n_group: usize, topk_group: usize) -> Family {
        Family {
            groups: Some((n_group, topk_group)),
            ..self
        }
    }
    const fn refused(self, why: &'static str) -> Family {
        Family {
            refusal: Some(why),
            ..self
        }
    }
}

/// Every model family whose routing differs from the generic defaults or was checked, one record
/// each. Routing is tested on fixtures for Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2/V3,
/// Laguna, ERNIE-4.5, MiniMax-M2, Ling-2.0, AFMoE and Hunyuan; the other checked families route
/// as one of those. The unchecked families' values were read from transformers 5.24's config
/// classes and routers.
const FAMILIES: &[Family] = &[
    // Checked. Qwen-MoE and DeepSeek-V2 default to not renormalising.
    family(&["qwen2_moe", "qwen3_moe"]).checked(),
    family(&["deepseek_v2"]).checked(),
    family(&["bailing_moe", "bailing_moe_v2", "dots1", "olmoe", "jamba"]).checked(),
    // The routers of Mixtral, MiniMax, Hunyuan, Qwen3-VL-MoE and Qwen3.5-MoE always renormalise
    // (the last two have no `norm_topk_prob` in their config classes); Command-A's softmax over
    // the top-k logits is renormalised softmax; Qwen3-Next's and Qwen3-Omni's config classes
    // default to it.
    // Mixtral's, MiniMax's, MiniMax-M2's and ERNIE-4.5's routers (transformers) and vLLM's
    // (`renormalize=True`) ignore a `norm_topk_prob` in config.json; Hunyuan's do as well
    // (vLLM: `renormalize=top_k > 1`, keeping a top-1 expert's score, as Hunyuan-Large's own
    // gate does; transformers' renormalises that to 1).
    family(&["mixtral"]).checked().always_renormalizing(),
    family(&["minimax", "minimax_m2"])
        .checked()
        .always_renormalizing(),
    family(&["hunyuan_v1_moe"])
        .checked()
        .always_renormalizing()
        .keeping_top_1_score(),
    family(&[
        "qwen3_vl_moe",
        "qwen3_vl_moe_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
    ])
    .checked()
    .renormalizing(),
    family(&["qwen3_next", "qwen3_omni_moe", "qwen3_omni_moe_text"])
        .checked()
        .renormalizing(),
    family(&["cohere2_moe"]).checked().renormalizing(),
    family(&["ernie4_5_moe"])
        .checked()
        .scoring(DefaultScoring::Softmax)
        .always_renormalizing(),
    // DeepSeek-V3's router and those built on it (DeepSeek-V3.2, GLM-4.5, GLM-5, EXAONE-MoE),
    // Laguna, AFMoE, Hunyuan-V3: sigmoid, renormalised. vLLM reads Kimi-K2's config through
    // transformers' DeepseekV3Config.
    family(&["deepseek_v3", "kimi_k2", "deepseek_v32"])
        .checked()
        .sigmoid()
        .renormalizing()
        .scale(2.5)
        .groups(8, 4),
    family(&["glm_moe_dsa", "exaone_moe"])
        .checked()
        .sigmoid()
        .renormalizing()
        .scale(2.5),
    family(&["glm4_moe_lite"])
        .checked()
        .sigmoid()
        .renormalizing()
        .scale(1.8),
    family(&["glm4_moe", "glm4v_moe", "glm4v_moe_text", "laguna", "afmoe"])
        .checked()
        .sigmoid()
        .renormalizing(),
    family(&["hy_v3"])
        .checked()
        .sigmoid()
        .renormalizing()
        .scale(2.826),
    // Not checked, with their transformers config classes' defaults.
    family(&["lfm2_moe"]).sigmoid().renormalizing(),
    family(&["kimi_linear"])
        .sigmoid()
        .renormalizing()
        .scale(2.446),
    family(&["bailing_hybrid"])
        .sigmoid()
        .renormalizing()
        .scale(2.5)
        .groups(8, 4),
    family(&["axk1", "beam", "kimi_k25"])
        .renormalizing()
        .scale(2.5)
        .groups(8, 4),
    family(&[
        "axk2",
        "glm5_next",
        "glm5_next_text",
        "sarvam_mla",
        "sarvam_moe",
    ])
    .renormalizing()
    .scale(2.5),
    // MiniMax-M3-VL's router always renormalises.
    family(&["minimax_m3_vl", "minimax_m3_vl_text"])
        .renormalizing()
        .scale(2.0),
    family(&["granitemoe", "granitemoeshared", "granitemoehybrid"]).renormalizing(),
    family(&[
        "dots3_note",
        "dots3_note_text",
        "flint",
        "lara_mini",
        "mellum",
        "mimo_v2_flash",
        "mistral4",
        "nemo_speechlm",
        "nemotron_h",
        "nemotron_h_omni",
        "qwen3_omni_moe_thinker",
        "qwen4_exp",
        "qwen4_exp_text",
        "solar_open",
    ])
    .renormalizing(),
    // Families whose experts appear as per-expert modules (so the layer is found) but whose
    // router is not a top-k over scores weighting the expert outputs. (Command-A MoE with
    // averaged shared experts is refused in `Routing::from_config`.)
    family(&["deepseek_v4"])
        .scoring(DefaultScoring::Unsupported("sqrtsoftplus"))
        .renormalizing()
        .scale(1.5)
        .refused(
            "DeepSeek-V4 clamps its experts' SwiGLU and routes its first layers by token hash",
        ),
    family(&["llama4", "llama4_text"]).refused(
        "Llama-4 scales each expert's input (not its output) by the sigmoid of its top-k router \
         logit; the CPU forward weights outputs",
    ),
    family(&["phimoe"]).refused("PhiMoE's SparseMixer routing is not implemented"),
    family(&["gpt_oss"]).refused(
        "gpt-oss experts use a clamped SwiGLU on interleaved gate/up rows with biases, and its \
         router has a bias; the CPU forward computes silu(gate) * up",
    ),
    family(&["longcat_flash"]).refused(
        "LongCat-Flash routes to zero-computation (identity) experts that no checkpoint module \
         holds",
    ),
    family(&["jetmoe"]).refused("JetMoE adds an output bias to its experts' sum"),
    family(&["ernie4_5_vl_moe", "ernie4_5_vl_moe_text"]).refused(
        "ERNIE-4.5-VL routes text and image tokens to separate expert sets, each with its own \
         router",
    ),
    family(&["step3p5", "step3p7"]).refused(
        "Step-3.5 adds a router bias (moe.router_bias), clamps the SwiGLU of some layers and \
         keeps its shared expert beside the MoE block; none of these is read",
    ),
    family(&[
        "inkling_text",
        "inkling_mm_model",
        "inkling2",
        "inkling2_text",
        "inkling2_loop",
        "inkling2_loop_text",
    ])
    .refused(
        "Inkling normalises its routing weights together with the shared expert's (Inkling-1) \
         or soft-caps its SwiGLU (Inkling-2)",
    ),
    family(&["hy_v4", "hy_v4_vl", "hy_v4_vl_text"]).refused(
        "Hunyuan-V4 clamps its experts' SwiGLU (swiglu_limit); the CPU forward computes \
         silu(gate) * up",
    ),
];

/// Experts per token: the first key the config sets (Hunyuan's `moe_topk` may be a per-layer
/// list, accepted when every layer has the same value).
fn top_k(file: &Path, config: &Value) -> Result<Option<usize>> {
    let field = cfg_field(
        file,
        config,
        &[
            "num_experts_per_tok",
            "moe_top_k",
            "num_experts_per_token",
            "moe_k",
            "moe_topk",
        ],
    );
    let Some(Value::Array(per_layer)) = field.value else {
        return count(&field);
    };
    let mut ks = Vec::with_capacity(per_layer.len());
    for (i, v) in per_layer.iter().enumerate() {
        let item = Field::new(file, format!("{}[{i}]", field.path), Some(v));
        ks.push(count(&item)?.ok_or_else(|| item.invalid("expected a count, found null"))?);
    }
    match ks.first() {
        Some(&k) if ks.iter().all(|&x| x == k) => Ok(Some(k)),
        Some(_) => Err(field.invalid(format!(
            "per-layer top-k {ks:?} differs between layers; one value for all layers is supported"
        ))),
        None => Err(field.invalid("an empty list")),
    }
}

pub fn model_type(config: &Value) -> String {
    cfg(config, "model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string()
}

impl Routing {
    /// The routing keys of `config.json` (`file`). A key of the wrong type (a string for
    /// `norm_topk_prob`, a negative `n_group`, ...) is a `ConfigError` naming it: ignoring it
    /// would route differently from the model, silently.
    pub fn from_config(file: &Path, config: &Value, has_correction_bias: bool) -> Result<Routing> {
        // The family decides defaults below: a `model_type` that is not a string would quietly
        // route as an unknown family. A multimodal wrapper (`kimi_vl`) names its language
        // model's family in `text_config.model_type`; either may be the one listed.
        let mut families = Vec::new();
        let wrapped = TEXT_CONFIGS.map(|p| (format!("{p}.model_type"), nested(config, p)));
        let types = [("model_type".to_string(), Some(config))]
            .into_iter()
            .chain(wrapped);
        for (path, at) in types {
            let v = at.and_then(|c| c.get("model_type"));
            if let Some(t) = Field::new(file, path, v).opt_str()? {
                families.push(t);
            }
        }
        // The families' records, in the order of `families`.
        let records: Vec<&Family> = families
            .iter()
            .filter_map(|f| FAMILIES.iter().find(|r| r.names.contains(f)))
            .collect();
        let any = |p: fn(&Family) -> bool| records.iter().any(|r| p(r));
        let is = |name: &str| families.contains(&name);
        let top_k = top_k(file, config)?;
        // Keys the config leaves out, filled in from the family (listed in the summary).
        let mut defaulted = Vec::new();
        // Ling-2.0 (`bailing_moe`) names it `score_function`, AFMoE `score_func`, Command-A
        // MoE `expert_selection_fn`.
        let scoring_key = [
            "scoring_func",
            "score_function",
            "score_func",
            "expert_selection_fn",
        ];
        let family_scoring = records
            .iter()
            .map(|r| r.scoring)
            .find(|&s| s != DefaultScoring::Generic)
            .unwrap_or(DefaultScoring::Generic);
        let (scoring, unsupported_scoring) =
            match cfg_field(file, config, &scoring_key).opt_str()? {
                Some("sigmoid") => (Scoring::Sigmoid, None),
                Some("softmax") => (Scoring::Softmax, None),
                Some(other) => (Scoring::Softmax, Some(other.to_string())),
                None => match family_scoring {
                    DefaultScoring::Softmax => (Scoring::Softmax, None),
                    DefaultScoring::Sigmoid => {
                        defaulted.push("scoring_func");
                        (Scoring::Sigmoid, None)
                    }
                    DefaultScoring::Unsupported(f) => {
                        defaulted.push("scoring_func");
                        (Scoring::Softmax, Some(f.to_string()))
                    }
                    DefaultScoring::Generic if has_correction_bias => (Scoring::Sigmoid, None),
                    DefaultScoring::Generic => (Scoring::Softmax, None),
                },
            };
        // Most families say whether to renormalise with norm_topk_prob (AFMoE: route_norm;
        // Kimi-Linear and Bailing-hybrid: moe_renormalize); without it, the family's default.
        let renorm_keys = ["norm_topk_prob", "route_norm", "moe_renormalize"];
        // A router that always renormalises never reads the key, so it is not read here either
        // (a value of the wrong type included).
        let renorm_field = cfg_field(file, config, &renorm_keys);
        let renorm_key = if any(|r| r.renormalize_always) {
            renorm_field.value.map(|_| true)
        } else {
            renorm_field.opt_bool()?
        };
        let renormalize = match renorm_key {
            // vLLM's AFMoE applies route_norm to sigmoid scores only.
            Some(_) if is("afmoe") && scoring == Scoring::Softmax => false,
            _ if top_k == Some(1) && any(|r| r.keep_top_1_score) => false,
            Some(b) => b,
            None if any(|r| r.renormalize) => {
                defaulted.push("renormalize");
                true
            }
            None => false,
        };
        let family_default = records
            .iter()
            .find(|r| r.scale != 1.0 || r.groups.is_some())
            .map(|r| (r.scale, r.groups));
        let scaling_keys = [
            "routed_scaling_factor",
            "moe_routed_scaling_factor",
            "route_scale",
            // Hunyuan-V3, Step-3.5.
            "router_scaling_factor",
            "moe_router_scaling_factor",
        ];
        let routed_scaling_key = scaling_keys
            .into_iter()
            .find(|k| cfg_field(file, config, &[k]).value.is_some())
            .unwrap_or(scaling_keys[0]);
        let routed_scaling_factor = cfg_field(file, config, &[routed_scaling_key])
            .opt_f64()?
            .or_else(|| {
                let scale = family_default.map(|(s, _)| s).filter(|&s| s != 1.0)?;
                defaulted.push("routed_scaling_factor");
                Some(scale)
            })
            .unwrap_or(1.0);
        let logit_softcapping = cfg_field(
            file,
            config,
            &["moe_router_logit_softcapping", "router_logit_softcapping"],
        )
        .opt_f64()?
        .filter(|&c| c > 0.0);
        let weight_on_input = cfg_field(file, config, &["moe_apply_router_weight_on_input"])
            .opt_bool()?
            .unwrap_or(false);
        // Command-A MoE averages its shared and routed experts unless told to add them.
        let averaged = is("cohere2_moe")
            && count(&cfg_field(file, config, &["num_shared_experts"]))?.is_some_and(|n| n > 0)
            && cfg_field(file, config, &["shared_expert_combination_strategy"]).opt_str()?
                != Some("sum");
        let unsupported_model = records
            .iter()
            .find_map(|r| r.refusal)
            .or(averaged.then_some(
                "Command-A MoE averages the shared and routed experts' outputs \
             (shared_expert_combination_strategy), where the CPU forward adds them",
            ));
        // Expert groups: the config's, or the family's default groups (DeepSeek-V3). Those
        // families group whatever `topk_method` says (transformers and vLLM); DeepSeek-V2's
        // `topk_method: greedy` is plain top-k whatever the group keys say.
        let default_groups = family_default.and_then(|(_, g)| g);
        let greedy = default_groups.is_none()
            && cfg_field(file, config, &["topk_method"]).opt_str()? == Some("greedy");
        // Kimi-Linear and Bailing-hybrid spell n_group `num_expert_group`.
        let group_key = |keys: &[&str], default: Option<usize>| -> Result<(Option<usize>, bool)> {
            let field = cfg_field(file, config, keys);
            if let (None, Some(_)) = (field.value, default) {
                // cfg skips nulls; the family's router needs a number (transformers and vLLM
                // fail on a null), so a null is not read as the default.
                let null = std::iter::once(Some(config))
                    .chain(TEXT_CONFIGS.map(|p| nested(config, p)))
                    .flatten()
                    .any(|c| keys.iter().any(|k| c.get(k).is_some_and(Value::is_null)));
                if null {
                    return Err(field.invalid("null, where this model family needs a number"));
                }
            }
            Ok(match count(&field)? {
                Some(v) => (Some(v), false),
                None => (default, default.is_some()),
            })
        };
        let n_keys = ["n_group", "num_expert_group"];
        let (n_group, n_defaulted) = group_key(&n_keys, default_groups.map(|g| g.0))?;
        let n_group = n_group.filter(|&g| g > 1 && !greedy);
        // Without groups, topk_group is not used: not reported as a default.
        let (topk_group, k_defaulted) = match n_group {
            Some(_) => group_key(&["topk_group"], default_groups.map(|g| g.1))?,
            None => (count(&cfg_field(file, config, &["topk_group"]))?, false),
        };
        for (used, key) in [
            (n_defaulted && n_group.is_some(), "n_group"),
            (k_defaulted, "topk_group"),
        ] {
            if used {
                defaulted.push(key);
            }
        }
        Ok(Routing {
            top_k,
            renormalize,
            scoring,
            unsupported_scoring,
            unsupported_model,
            n_group,
            topk_group,
            routed_scaling_factor,
            routed_scaling_key,
            logit_softcapping,
            weight_on_input,
            family_checked: any(|r| r.checked),
            family_defaults: defaulted,
        })
    }

    /// How an error names a value `config.json` left to the model family's default.
    fn defaulted_note(&self, key: &str) -> String {
        if self.family_defaults.contains(&key) {
            format!(" (the model family's default; config.json does not set {key})")
        } else {
            String::new()
        }
    }

    /// What a layer of `experts` experts cannot be routed with, as the `config.json` key and the
    /// reason: a model family with a router of its own, a scoring function no kernel has,
    /// expert groups that do not divide the experts, that leave fewer than `top_k` candidates
    /// or that hold one expert each where the layer's router has a score-correction bias
    /// (`biased`), a `top_k` out of range.
    pub fn check(
        &self,
        experts: usize,
        biased: bool,
    ) -> std::result::Result<(), (&'static str, String)> {
        if let Some(why) = self.unsupported_model {
            return Err(("model_type", why.to_string()));
        }
        if self.weight_on_input {
            return Err((
                "moe_apply_router_weight_on_input",
                "true: the top-k weight would scale each expert's input, where the CPU forward \
                 scales its output (for gated experts those differ)"
                    .into(),
            ));
        }
        if let Some(s) = &self.unsupported_scoring {
            return Err((
                "scoring_func",
                format!("\"{s}\" routing is not implemented (softmax or sigmoid)"),
            ));
        }
        match self.top_k {
            Some(k) if k == 0 || k > experts => {
                return Err((
                    "num_experts_per_tok",
                    format!("{k} is not between 1 and the layer's {experts} experts"),
                ));
            }
            Some(_) => {}
            // The forward routes to top_k experts: without it there is no routing to follow.
            None => {
                return Err((
                    "num_experts_per_tok",
                    "is missing (the number of experts each token is routed to)".into(),
                ))
            }
        }
        // A zero, negative or non-finite scale silences, flips or poisons every routed
        // expert's output: a broken config rather than a model to follow.
        // (Checked as the forward uses it, in f32: 1e39 overflows there.)
        let scale = self.routed_scaling_factor;
        if !((scale as f32).is_finite() && (scale as f32) > 0.0) {
            let huge_or_tiny = scale.abs() >= 1e16 || (scale != 0.0 && scale.abs() < 1e-4);
            let shown = if huge_or_tiny {
                format!("{scale:e}")
            } else {
                format!("{scale}")
            };
            return Err((
                self.routed_scaling_key,
                format!(
                    "{shown} is not a positive number within f32's range (it multiplies the \
                     routed experts' sum)"
                ),
            ));
        }
        if let Some(groups) = self.n_group {
            if !experts.is_multiple_of(groups) {
                return Err((
                    "n_group",
                    format!(
                        "{groups} expert groups{whose} do not divide the layer's {experts} experts",
                        whose = self.defaulted_note("n_group"),
                    ),
                ));
            }
            let keep = self.topk_group.ok_or((
                "topk_group",
                format!("missing, and n_group is {groups}: how many groups to keep per token"),
            ))?;
            let kept = self.defaulted_note("topk_group");
            let per = experts / groups;
            // transformers and vLLM score a biased group by the sum of its two best biased
            // scores (`topk(2)`), which fails on groups of one: no score to follow.
            if biased && per < 2 {
                return Err((
                    "n_group",
                    format!(
                        "{groups} expert groups{whose} of the layer's {experts} experts hold one \
                         expert each, where a router with a score-correction bias scores a group \
                         by its two best experts (DeepSeek-V3's grouped top-k, as transformers \
                         and vLLM compute it)",
                        whose = self.defaulted_note("n_group"),
                    ),
                ));
            }
            if keep == 0 || keep > groups {
                return Err((
                    "topk_group",
                    format!("{keep}{kept} is not between 1 and n_group ({groups})"),
                ));
            }
            if let Some(k) = self.top_k.filter(|&k| k > keep * per) {
                return Err((
                    "topk_group",
                    format!("{keep} groups{kept} of {per} experts hold fewer than top_k ({k})"),
                ));
            }
        }
        Ok(())
    }
}

/// The experts' activation as `config.json` names it (`hidden_act`, or Gemma-style
/// `hidden_activation`, at the top level or in `text_config`), if it says; a value that is not
/// a string is a `ConfigError` naming the key.
pub fn hidden_act(file: &Path, config: &Value) -> Result<Option<String>> {
    Ok(
        cfg_field(file, config, &["hidden_act", "hidden_activation"])
            .opt_str()?
            .map(str::to_string),
    )
}

/// Whether the experts' activation is the SiLU gate the kernels compute (`silu(gate) * up`);
/// `None` (unstated) is taken as SiLU, as every supported model family uses it.
pub fn is_silu(hidden_act: Option<&str>) -> bool {
    matches!(hidden_act, None | Some("silu" | "swish"))
}

/// Where MoE blocks keep their shared expert: DeepSeek `shared_experts`, Qwen2-MoE
/// `shared_expert`, Hunyuan `shared_mlp`.
pub const SHARED_EXPERT_NAMES: [&str; 3] = ["shared_experts", "shared_expert", "shared_mlp"];

/// A part of a MoE block that no kernel computes, found by name: the tensor or module and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnsupportedPart {
    pub subject: String,
    pub reason: &'static str,
}

impl UnsupportedPart {
    /// The error every loader, plan and repack gives for a layer with this part.
    pub fn error(&self) -> UnsupportedSchemeError {
        UnsupportedSchemeError {
            subject: self.subject.clone(),
            reason: self.reason.to_string(),
        }
    }
}

/// Splits `<prefix>.<shared expert name>.<leaf>` ([`SHARED_EXPERT_NAMES`]).
fn split_shared(module: &str) -> Option<(&str, &str, &str)> {
    let (block, leaf) = module.rsplit_once('.')?;
    let (prefix, shared) = block.rsplit_once('.')?;
    SHARED_EXPERT_NAMES
        .contains(&shared)
        .then_some((prefix, shared, leaf))
}

/// Parts of MoE blocks the forward would leave out, by layer prefix (`...mlp`), the first of
/// each layer, from one pass over the tensor and module names:
/// - a bias on an expert or shared-expert projection (`experts.3.down_proj.bias`, gpt-oss
///   style): no kernel adds one;
/// - a shared-expert module other than gate/up/down_proj (a fused `gate_up_proj`), or shared
///   experts under two names: the shared expert would run without it.
///
/// A layer with one is refused (on every platform, by the CPU loader and the Marlin repack)
/// rather than computed without it; the checkpoint still opens.
pub fn unsupported_parts(
    ckpt: &Checkpoint,
    modules: &[String],
) -> BTreeMap<String, UnsupportedPart> {
    let mut found: BTreeMap<String, UnsupportedPart> = BTreeMap::new();
    for (_, t) in ckpt.tensors() {
        let Some(module) = t.name.strip_suffix(".bias") else {
            continue;
        };
        let prefix = match split_expert(module) {
            Some((p, ..)) => Some(p.to_string()),
            None => split_shared(module).map(|(p, ..)| p.to_string()),
        };
        if let Some(prefix) = prefix {
            found.entry(prefix).or_insert_with(|| UnsupportedPart {
                subject: t.name.clone(),
                reason: "expert projection biases are not added by any kernel",
            });
        }
    }
    let mut shared_names: BTreeMap<String, String> = BTreeMap::new();
    for m in modules {
        let Some((prefix, shared, leaf)) = split_shared(m) else {
            continue;
        };
        let problem = if !matches!(leaf, "gate_proj" | "up_proj" | "down_proj") {
            Some("is not a shared-expert projection the forward computes (gate_proj, up_proj, down_proj)")
        } else if shared_names
            .insert(prefix.to_string(), shared.to_string())
            .is_some_and(|first| first != shared)
        {
            Some("is a second shared expert of its block; the forward computes one")
        } else {
            None
        };
        if let Some(reason) = problem {
            found
                .entry(prefix.to_string())
                .or_insert_with(|| UnsupportedPart {
                    subject: m.clone(),
                    reason,
                });
        }
    }
    found
}

/// A tensor holding all of a block's experts in one (`mlp.experts.gate_up_proj` `[E, 2I, H]` and
/// `mlp.experts.down_proj`, transformers 5's in-memory layout and Llama 4's; gpt-oss's
/// `experts.gate_up_proj_blocks`; vLLM's `experts.w13_weight`; Granite-MoE's
/// `block_sparse_moe.input_linear.weight` `[E, 2I, H]`; DBRX's `ffn.experts.mlp.w1`), outside
/// the blocks a `moeq repack` layout names (`repacked`: their prefixes): the first such tensor,
/// by name. Discovery reads experts as `experts.<e>.<proj>` modules, so a block stored this way
/// was found by no one: it vanished from the plan (neither MoE nor dense) and the checkpoint
/// opened as if it had one MoE layer fewer. Leaves beside the experts that are not
/// projections (Laguna's `experts.e_score_correction_bias`) do not count.
pub fn fused_expert_tensor<'a>(ckpt: &'a Checkpoint, repacked: &[&str]) -> Option<&'a str> {
    ckpt.tensors()
        .filter(|(_, t)| is_fused_expert_tensor(&t.name, t.shape.len(), repacked))
        .map(|(_, t)| t.name.as_str())
        .min()
}

/// The rule of [`fused_expert_tensor`] for a tensor of `ndim` dimensions: outside a repack
/// layout's blocks, any tensor of 3 or more dimensions inside an MoE block (a name segment
/// `experts`, `block_sparse_moe` or `moe`: compressed-tensors stores every Linear's weights,
/// scales and zero points in at most 2), and any `<owner>.experts.<leaf>...` whose leaf names a
/// projection (`..._proj...`, `w1`, `w13_weight`, ..., DBRX's `mlp`) rather than an expert
/// index, whatever its shape.
fn is_fused_expert_tensor(name: &str, ndim: usize, repacked: &[&str]) -> bool {
    if repacked
        .iter()
        .any(|p| name.strip_prefix(p).is_some_and(|r| r.starts_with('.')))
    {
        return false;
    }
    let in_moe_block = name
        .split('.')
        .any(|s| matches!(s, "experts" | "block_sparse_moe" | "moe"));
    if ndim >= 3 && in_moe_block {
        return true;
    }
    let Some((_, rest)) = name
        .rsplit_once(".experts.")
        .or_else(|| name.strip_prefix("experts.").map(|rest| ("", rest)))
    else {
        return false;
    };
    let leaf = rest.split('.').next().unwrap_or(rest);
    leaf.contains("_proj")
        || leaf == "mlp"
        || ["w1", "w2", "w3", "w13"]
            .iter()
            .any(|w| leaf == *w || leaf.strip_prefix(w).is_some_and(|r| r.starts_with('_')))
}

#[cfg(test)]
mod fused_tests {
    use super::is_fused_expert_tensor as fused;

    #[test]
    fn fused_expert_tensors_are_told_from_per_expert_modules() {
        let p = "model.layers.1.mlp.experts";
        for leaf in [
            "gate_up_proj",
            "down_proj",
            "gate_up_proj_blocks",
            "down_proj_bias",
            "w13_weight",
            "w2_weight_scale",
            "w1",
            "mlp.w1",
        ] {
            assert!(fused(&format!("{p}.{leaf}"), 2, &[]), "{leaf}");
        }
        for leaf in [
            "0.gate_proj.weight",
            "12.w1.weight_packed",
            "e_score_correction_bias",
            "w4",
            "w13x",
        ] {
            assert!(!fused(&format!("{p}.{leaf}"), 2, &[]), "{leaf}");
        }
        // Three dimensions inside an MoE block, whatever the name (Granite-MoE); not outside
        // one (a Mamba conv1d weight).
        assert!(fused(
            "model.layers.0.block_sparse_moe.input_linear.weight",
            3,
            &[]
        ));
        assert!(!fused(
            "model.layers.0.block_sparse_moe.input_linear.weight",
            2,
            &[]
        ));
        assert!(!fused("backbone.layers.0.mixer.conv1d.weight", 3, &[]));
        // A `moeq repack` layout's blocks are read by their prefix.
        assert!(!fused(&format!("{p}.w13_weight_packed"), 3, &[p]));
        assert!(!fused(
            &format!("{p}.w13_weight_packed"),
            3,
            &["model.layers.1.mlp"]
        ));
        assert!(fused(
            &format!("{p}.w13_weight_packed"),
            3,
            &["model.layers.0.mlp.experts"]
        ));
        assert!(fused("experts.gate_up_proj", 3, &[]));
        assert!(!fused("model.layers.1.mlp.gate.weight", 2, &[]));
    }
}

/// The router of the MoE block at `layer_prefix`: `gate` (most families), `router` (Jamba),
/// `router.gate` (AFMoE), `gate.wg` (Hunyuan).
pub fn find_router(ckpt: &Checkpoint, layer_prefix: &str) -> Option<Router> {
    ["gate", "router", "router.gate", "gate.wg"]
        .iter()
        .map(|m| format!("{layer_prefix}.{m}"))
        .find(|m| ckpt.contains(&format!("{m}.weight")))
        .map(|module| Router {
            weight: format!("{module}.weight"),
            module,
        })
}

/// What transformers' and vLLM's loaders would refuse in the score-correction bias `name` of
/// a layer of `experts` experts: a shape other than `[experts]`, or ERNIE-4.5's one-row
/// `[1, experts]` (`moe_statics`); ERNIE-4.5-VL (`per_modality`) stores one row per modality,
/// `[rows, experts / rows]`, which its loaders split. The same count in another shape
/// (`[2, experts / 2]` elsewhere) is refused too: it would be read as another router's bias.
pub fn correction_bias_problem(
    ckpt: &Checkpoint,
    name: &str,
    experts: usize,
    per_modality: bool,
) -> Option<crate::error::Error> {
    let (file, info) = ckpt.locate(name)?;
    let ok = match info.shape.as_slice() {
        [e] | [1, e] => *e == experts,
        [_, _] => per_modality && info.numel() == experts,
        _ => false,
    };
    (!ok).then(|| {
        crate::error::CheckpointError::Tensor {
            path: file.path().to_path_buf(),
            tensor: name.to_string(),
            reason: format!(
                "has shape {:?}, expected one score-correction value per expert: [{experts}] \
                 (or [1, {experts}] as ERNIE-4.5 stores it)",
                info.shape
            ),
        }
        .into()
    })
}

/// The router's score-correction bias of the MoE block at `layer_prefix` (`...mlp`), where
/// its family keeps it: DeepSeek-V3 on the router (`mlp.gate`), MiniMax-M2 on the block
/// (`block_sparse_moe`), Laguna on `mlp.experts`, ERNIE-4.5 in `moe_statics` (beside the
/// router in its checkpoints, inside it in transformers 5).
pub fn find_correction_bias(ckpt: &Checkpoint, layer_prefix: &str) -> Option<String> {
    [
        "gate.e_score_correction_bias",
        "e_score_correction_bias",
        "experts.e_score_correction_bias",
        "moe_statics.e_score_correction_bias",
        "gate.moe_statics.e_score_correction_bias",
        // Ling-2.0 keeps it on the router as `expert_bias`, AFMoE on the block.
        "gate.expert_bias",
        "expert_bias",
    ]
    .iter()
    .map(|leaf| format!("{layer_prefix}.{leaf}"))
    .find(|name| ckpt.contains(name))
}

/// The expert count `config.json` declares, if any: the first of its spellings that is set,
/// which must be a count (`-1`, `2**64` or `"8"` was ignored, so nothing was checked). A list
/// is passed over: ERNIE-4.5-VL's `moe_num_experts` lists a count per modality.
pub fn configured_num_experts(file: &Path, config: &Value) -> Result<Option<usize>> {
    for key in [
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
        "moe_num_experts",
    ] {
        match cfg_at(config, key) {
            Some((_, Value::Array(_))) | None => {}
            Some((path, v)) => return count(&Field::new(file, path, Some(v))),
        }
    }
    Ok(None)
}

/// A size `config.json` sets under `key` (at the top level, else in a nested language-model
/// config), with the key path where it was found: a count (an integral float too), so that
/// `"256"`, `-256`, `256.5` or `true` are errors naming the key rather than a check silently
/// skipped. A list (per layer or per modality, in some families) is passed over, as an unset
/// or null key is.
pub fn configured_size(file: &Path, config: &Value, key: &str) -> Result<Option<(String, usize)>> {
    match cfg_at(config, key) {
        Some((_, Value::Array(_))) | None => Ok(None),
        Some((path, v)) => {
            let n = count(&Field::new(file, path.clone(), Some(v)))?;
            Ok(n.map(|n| (path, n)))
        }
    }
}

/// Finds every `<prefix>.experts.<e>.<proj>` module, grouped by prefix.
pub struct Discovery {
    pub layers: Vec<DiscoveredLayer>,
    /// MoE blocks outside the model's stack of layers (`main_stack`), by prefix: listed, not
    /// loaded.
    pub set_aside: Vec<String>,
    /// Decoder layers (of the model's stack) with a dense `mlp.{gate,up,down}_proj` MLP.
    pub dense_layers: Vec<usize>,
}

/// Module names of one MoE layer, before analysis.
pub struct DiscoveredLayer {
    pub layer: usize,
    pub prefix: String,
    /// expert index -> role -> module name
    pub experts: BTreeMap<usize, BTreeMap<ProjRole, String>>,
    pub router: Option<Router>,
    pub correction_bias: Option<String>,
    pub shared: BTreeMap<ProjRole, String>,
    pub shared_expert_gate: Option<String>,
}

// Compiled once: compiling a regex costs more than matching every module name of a model.
static LAYER_RE: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)").ok());

/// Splits `<prefix>.experts.<e>.<leaf>` without a regex (this runs for every module).
fn split_expert(module: &str) -> Option<(&str, &str, &str)> {
    let (rest, leaf) = module.rsplit_once('.')?;
    let (rest, e) = rest.rsplit_once('.')?;
    let prefix = rest.strip_suffix(".experts")?;
    let valid = !prefix.is_empty() && !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit());
    valid.then_some((prefix, e, leaf))
}

/// Splits `<prefix>.mlp.{gate,up,down}_proj` (a dense MLP).
fn split_dense(module: &str) -> Option<&str> {
    let (rest, leaf) = module.rsplit_once('.')?;
    let prefix = rest.strip_suffix(".mlp")?;
    matches!(leaf, "gate_proj" | "up_proj" | "down_proj").then_some(prefix)
}

pub(crate) fn layer_index(prefix: &str) -> Option<usize> {
    // The last `layers.N` / `h.N` / `blocks.N` component.
    let re = LAYER_RE.as_ref()?;
    re.captures_iter(prefix)
        .last()
        .and_then(|c| c.get(1))
        .and_then(|m| m.as_str().parse().ok())
}

/// The part of a prefix before its layer index: the stack of layers it belongs to
/// (`mtp.layers.` for `mtp.layers.0.mlp`, `model.layers.` for `model.layers.0.mlp`).
fn layer_stack(prefix: &str) -> &str {
    LAYER_RE
        .as_ref()
        .and_then(|re| re.captures_iter(prefix).last())
        .and_then(|c| c.get(1))
        .map_or(prefix, |m| &prefix[..m.start()])
}

/// A checkpoint may hold MoE blocks in more than one stack of layers: Qwen3-Next and Qwen3.5
/// keep their multi-token-prediction layer as `mtp.layers.0.mlp.experts` beside
/// `model.layers.N.mlp.experts`, Qwen3-Omni its talker beside its thinker. A layer index names
/// a layer of one stack only, so the other stacks' blocks would clash with the model's (the
/// checkpoint did not open) or pass for decoder layers they are not. The stack with the most MoE
/// layers is the model's (returned; `repacked`, the `(layer, prefix)` of the layers a `moeq
/// repack` layout holds, which discovery does not see, count too). With several stacks tied
/// for the most, there is none (nothing is set aside; clashing indices are an error then).
fn main_stack(layers: &[DiscoveredLayer], repacked: &[(usize, &str)]) -> Option<String> {
    let mut per_stack: BTreeMap<&str, usize> = BTreeMap::new();
    let prefixes = layers
        .iter()
        .map(|l| l.prefix.as_str())
        .chain(repacked.iter().map(|&(_, p)| p));
    for prefix in prefixes {
        *per_stack.entry(layer_stack(prefix)).or_default() += 1;
    }
    let most = per_stack.values().copied().max()?;
    let mut top = per_stack.into_iter().filter(|&(_, n)| n == most);
    match (top.next(), top.next()) {
        (Some((main, _)), None) => Some(main.to_string()),
        _ => None,
    }
}

/// Groups module names into MoE layers (names only; no tensor checks). `repacked`: the
/// `(layer, prefix)` of the layers a `moeq repack` layout holds, for `main_stack`.
pub fn discover(
    ckpt: &Checkpoint,
    modules: &[String],
    repacked: &[(usize, &str)],
) -> Result<Discovery> {
    let mut by_prefix: BTreeMap<&str, BTreeMap<usize, BTreeMap<ProjRole, &str>>> = BTreeMap::new();
    let mut dense_layers = Vec::new();
    for m in modules {
        if let Some((prefix, e, leaf)) = split_expert(m) {
            let Some(role) = ProjRole::from_leaf(leaf) else {
                continue;
            };
            let e: usize = e
                .parse()
                .map_err(|_| module_error(m, "expert index does not fit in an integer"))?;
            // Two names for one projection (`experts.1` and `experts.01`, or `gate_proj` beside
            // Mixtral's `w1`): one copy was silently dropped.
            if let Some(first) = by_prefix
                .entry(prefix)
                .or_default()
                .entry(e)
                .or_default()
                .insert(role, m.as_str())
            {
                return Err(module_error(
                    m,
                    format!(
                        "is the same projection of expert {e} as '{first}'; the checkpoint \
                         must name each projection once"
                    ),
                ));
            }
        } else if let Some(prefix) = split_dense(m) {
            if let Some(l) = layer_index(prefix) {
                dense_layers.push((l, layer_stack(prefix)));
            }
        }
    }

    let mut layers = Vec::new();
    for (prefix, experts) in by_prefix {
        let experts: BTreeMap<usize, BTreeMap<ProjRole, String>> = experts
            .into_iter()
            .map(|(e, roles)| {
                (
                    e,
                    roles.into_iter().map(|(r, m)| (r, m.to_string())).collect(),
                )
            })
            .collect();
        let prefix = prefix.to_string();
        let layer = layer_index(&prefix).ok_or_else(|| {
            module_error(
                &format!("{prefix}.experts"),
                "cannot find the decoder layer index (expected '...layers.N...')",
            )
        })?;
        let router = find_router(ckpt, &prefix);
        let correction_bias = find_correction_bias(ckpt, &prefix);
        let mut shared = BTreeMap::new();
        for sprefix in SHARED_EXPERT_NAMES.map(|s| format!("{prefix}.{s}")) {
            for (leaf, role) in [
                ("gate_proj", ProjRole::Gate),
                ("up_proj", ProjRole::Up),
                ("down_proj", ProjRole::Down),
            ] {
                let name = format!("{sprefix}.{leaf}");
                if modules.binary_search(&name).is_ok() {
                    shared.insert(role, name);
                }
            }
            if !shared.is_empty() {
                break;
            }
        }
        let gate_name = format!("{prefix}.shared_expert_gate");
        let shared_expert_gate = modules
            .binary_search(&gate_name)
            .is_ok()
            .then_some(gate_name);
        layers.push(DiscoveredLayer {
            layer,
            prefix,
            experts,
            router,
            correction_bias,
            shared,
            shared_expert_gate,
        });
    }
    layers.sort_by_key(|l| l.layer);
    let main = main_stack(&layers, repacked);
    // Without a main stack (a tie) every stack stays.
    let in_main = |stack: &str| main.as_deref().is_none_or(|m| stack == m);
    let (layers, aside): (Vec<_>, Vec<_>) = layers
        .into_iter()
        .partition(|l| in_main(layer_stack(&l.prefix)));
    let set_aside = aside.into_iter().map(|l| l.prefix).collect();
    let mut dense_layers: Vec<usize> = dense_layers
        .into_iter()
        .filter_map(|(l, stack)| in_main(stack).then_some(l))
        .collect();
    dense_layers.sort_unstable();
    dense_layers.dedup();
    for pair in layers.windows(2) {
        if let [a, b] = pair {
            if a.layer == b.layer {
                return Err(module_error(
                    &b.prefix,
                    format!(
                        "decoder layer {} has experts under both '{}' and '{}'",
                        a.layer, a.prefix, b.prefix
                    ),
                ));
            }
        }
    }
    dense_layers.retain(|l| !layers.iter().any(|m| m.layer == *l));
    Ok(Discovery {
        layers,
        set_aside,
        dense_layers,
    })
}

/// Builds the projections of one expert or shared expert from analysed modules, checking that
/// up and down exist.
pub fn assemble(
    owner: &str,
    roles: &BTreeMap<ProjRole, String>,
    mut analyze: impl FnMut(&str) -> Result<ModuleInfo>,
) -> Result<ExpertModules> {
    let get = |role: ProjRole| roles.get(&role);
    let (Some(up), Some(down)) = (get(ProjRole::Up), get(ProjRole::Down)) else {
        let have: Vec<&str> = roles.keys().map(|r| r.name()).collect();
        return Err(module_error(
            owner,
            format!("has projections {have:?}; an expert needs up and down (and optionally gate)"),
        ));
    };
    let gate = match get(ProjRole::Gate) {
        Some(g) => Some(analyze(g)?),
        None => None,
    };
    Ok(ExpertModules {
        gate,
        up: analyze(up)?,
        down: analyze(down)?,
    })
}

/// Checks shapes within one expert: gate and up are `[I, H]`, down is `[H, I]`, both sizes
/// positive (a zero-byte `[I, 0]` projection would otherwise plan a layer whose forward sizes
/// its buffers by an `I` no stored byte backs).
pub fn expert_dims(owner: &str, e: &ExpertModules) -> Result<(usize, usize)> {
    let (i, h) = (e.up.out_features, e.up.in_features);
    if i == 0 || h == 0 {
        return Err(module_error(
            owner,
            format!("up is [{i}, {h}]; an expert's hidden and intermediate sizes must be positive"),
        ));
    }
    if let Some(g) = &e.gate {
        if (g.out_features, g.in_features) != (i, h) {
            return Err(module_error(
                owner,
                format!(
                    "gate is [{}, {}] but up is [{i}, {h}]; they must match",
                    g.out_features, g.in_features
                ),
            ));
        }
    }
    if (e.down.out_features, e.down.in_features) != (h, i) {
        return Err(module_error(
            owner,
            format!(
                "down is [{}, {}], expected [{h}, {i}] (the transpose of up [{i}, {h}])",
                e.down.out_features, e.down.in_features
            ),
        ));
    }
    Ok((h, i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_type_has_one_family_record() {
        // A second record for a name would never be read: lookups take the first.
        let mut names: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.names.iter().copied())
            .collect();
        let listed = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), listed, "a model_type is listed in two records");
    }

    #[test]
    fn a_refused_family_is_not_checked() {
        for f in FAMILIES {
            assert!(!(f.checked && f.refusal.is_some()), "{:?}", f.names);
        }
    }
}
