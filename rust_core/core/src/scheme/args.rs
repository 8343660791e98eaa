//! `QuantizationArgs` as compressed-tensors writes them, normalised the way compressed-tensors'
//! own validators do (`quantization/quant_args.py`), with the legacy spellings accepted.

use serde_json::{json, Map, Value};

use super::json::{Field, Obj};
use crate::error::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    Int,
    Float,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    Tensor,
    Channel,
    Group,
    Block,
    Token,
    TensorGroup,
    AttnHead,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Tensor => "tensor",
            Strategy::Channel => "channel",
            Strategy::Group => "group",
            Strategy::Block => "block",
            Strategy::Token => "token",
            Strategy::TensorGroup => "tensor_group",
            Strategy::AttnHead => "attn_head",
        }
    }
    fn parse(s: &str) -> Option<Strategy> {
        Some(match s {
            "tensor" => Strategy::Tensor,
            "channel" => Strategy::Channel,
            "group" => Strategy::Group,
            "block" => Strategy::Block,
            "token" => Strategy::Token,
            "tensor_group" => Strategy::TensorGroup,
            "attn_head" => Strategy::AttnHead,
            _ => return None,
        })
    }
}

/// Activation ordering. `Group` (`"group"`, `"dynamic"`, `true`) stores `weight_g_idx`;
/// `Weight` (`"weight"`, `"static"`) only reordered GPTQ's visit order: storage is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActOrder {
    Group,
    Weight,
}

impl ActOrder {
    pub fn name(self) -> &'static str {
        match self {
            ActOrder::Group => "group",
            ActOrder::Weight => "weight",
        }
    }
}

/// `dynamic`: `false`, `true`, or `"local"` (tensor_group only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dynamic {
    Static,
    Dynamic,
    Local,
}

/// How a checkpoint spelled fields that normalisation merges. Decisions never look at it; the
/// vLLM compatibility report does, because vLLM treats these spellings differently.
#[derive(Clone, Debug, Default)]
pub struct Spelling {
    /// `group_size` was `null` (channel strategy), not `-1`.
    pub group_size_null: bool,
    /// `actorder` as written (`"dynamic"`, `"static"`, `"true"`, ...), when it was set.
    pub actorder: Option<String>,
}

/// Normalised quantization arguments. Equality ignores [`Spelling`].
#[derive(Clone, Debug)]
pub struct QuantArgs {
    pub num_bits: u32,
    pub qtype: QuantType,
    pub symmetric: bool,
    pub strategy: Strategy,
    /// `> 0` for group strategy, `-1` for every other strategy (channel spelled `-1` or `null`).
    pub group_size: i64,
    pub block_structure: Option<[u64; 2]>,
    pub dynamic: Dynamic,
    pub actorder: Option<ActOrder>,
    pub spelling: Spelling,
}

/// The fields that define a scheme (everything but [`Spelling`]).
type ArgsKey = (
    u32,
    QuantType,
    bool,
    Strategy,
    i64,
    Option<[u64; 2]>,
    Dynamic,
    Option<ActOrder>,
);

impl QuantArgs {
    fn key(&self) -> ArgsKey {
        (
            self.num_bits,
            self.qtype,
            self.symmetric,
            self.strategy,
            self.group_size,
            self.block_structure,
            self.dynamic,
            self.actorder,
        )
    }
}

impl PartialEq for QuantArgs {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for QuantArgs {}

impl std::hash::Hash for QuantArgs {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

/// Which slot of a scheme the args came from; activations forbid act-order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgsRole {
    Weights,
    InputActivations,
    OutputActivations,
    KvCache,
}

impl QuantArgs {
    pub fn is_dynamic(&self) -> bool {
        !matches!(self.dynamic, Dynamic::Static)
    }

    /// Number of scale columns for a weight `[out, in]` (group: in / group_size).
    pub fn scale_columns(&self, in_features: usize) -> Option<usize> {
        match self.strategy {
            Strategy::Group => usize::try_from(self.group_size)
                .ok()
                .filter(|&g| g > 0)
                .map(|g| in_features / g),
            _ => Some(1),
        }
    }

    /// The DESIGN.md JSON form of weight args.
    pub fn weight_json(&self) -> Value {
        json!({
            "num_bits": self.num_bits,
            "type": match self.qtype { QuantType::Int => "int", QuantType::Float => "float" },
            "strategy": self.strategy.name(),
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "actorder": self.actorder.map(ActOrder::name),
        })
    }

    /// The DESIGN.md JSON form of activation args.
    pub fn activation_json(&self) -> Value {
        json!({
            "num_bits": self.num_bits,
            "type": match self.qtype { QuantType::Int => "int", QuantType::Float => "float" },
            "strategy": self.strategy.name(),
            "dynamic": self.is_dynamic(),
            "symmetric": self.symmetric,
        })
    }

    /// Parses and normalises one args object found at `field`.
    pub fn parse(field: &Field<'_>, role: ArgsRole) -> Result<QuantArgs> {
        let obj = field.object()?;
        Self::parse_obj(&obj, role)
    }

    pub(crate) fn parse_obj(obj: &Obj<'_>, role: ArgsRole) -> Result<QuantArgs> {
        let num_bits = obj.opt_u64("num_bits")?.unwrap_or(8);
        if num_bits == 0 || num_bits > 64 {
            return Err(obj
                .field("num_bits")
                .invalid(format!("{num_bits} bits is not a valid width")));
        }
        let qtype = match obj.opt_str("type")? {
            None | Some("int") => QuantType::Int,
            Some("float") => QuantType::Float,
            Some(other) => {
                return Err(obj
                    .field("type")
                    .invalid(format!("expected \"int\" or \"float\", found \"{other}\"")))
            }
        };
        let symmetric = obj.opt_bool("symmetric")?.unwrap_or(true);
        let group_size = obj.opt_i64("group_size")?;
        let strategy = match obj.opt_str("strategy")? {
            None => None,
            Some(s) => Some(Strategy::parse(s).ok_or_else(|| {
                obj.field("strategy").invalid(format!(
                    "unknown strategy \"{s}\" (expected tensor, channel, group, block, token, tensor_group or attn_head)"
                ))
            })?),
        };
        // Strategy inference and group_size normalisation (CT `validate_model_after`).
        let (strategy, group_size) = match (strategy, group_size) {
            (None, None) => (Strategy::Tensor, -1),
            (None, Some(g)) if g > 0 => (Strategy::Group, g),
            (None, Some(-1)) => (Strategy::Channel, -1),
            (None, Some(g)) => {
                return Err(obj.field("group_size").invalid(format!(
                    "{g} is not a valid group size (use a positive size, or -1 for channel)"
                )))
            }
            (Some(Strategy::Group), Some(g)) if g > 0 => (Strategy::Group, g),
            (Some(Strategy::Group), g) => {
                return Err(obj.field("group_size").invalid(format!(
                    "strategy \"group\" needs a positive group_size, found {}",
                    g.map_or("null".to_string(), |g| g.to_string())
                )))
            }
            (Some(Strategy::Channel), None | Some(-1)) => (Strategy::Channel, -1),
            (Some(Strategy::TensorGroup), Some(g)) if g > 0 => (Strategy::TensorGroup, g),
            (Some(s), None | Some(-1)) => (s, -1),
            (Some(s), Some(g)) => {
                return Err(obj.field("group_size").invalid(format!(
                    "group_size {g} contradicts strategy \"{}\"",
                    s.name()
                )))
            }
        };
        let block_structure = match obj.get("block_structure") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) if a.len() == 2 => {
                let dims: Option<Vec<u64>> = a.iter().map(Value::as_u64).collect();
                match dims {
                    Some(d) if d.iter().all(|&x| x > 0) => Some([d[0], d[1]]),
                    _ => {
                        return Err(obj
                            .field("block_structure")
                            .invalid("expected two positive integers"))
                    }
                }
            }
            Some(Value::String(s)) => {
                // Legacy "128x128" spelling.
                let parts: Vec<Option<u64>> = s.split('x').map(|p| p.trim().parse().ok()).collect();
                match parts.as_slice() {
                    [Some(a), Some(b)] if *a > 0 && *b > 0 => Some([*a, *b]),
                    _ => {
                        return Err(obj
                            .field("block_structure")
                            .invalid(format!("cannot read \"{s}\" as ROWSxCOLS")))
                    }
                }
            }
            Some(_) => {
                return Err(obj
                    .field("block_structure")
                    .invalid("expected [rows, cols]"))
            }
        };
        if strategy == Strategy::Block && block_structure.is_none() {
            return Err(obj
                .field("block_structure")
                .invalid("strategy \"block\" needs a block_structure"));
        }
        let dynamic = match obj.get("dynamic") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Dynamic::Static,
            Some(Value::Bool(true)) => Dynamic::Dynamic,
            // (compressed-tensors lower-cases it.)
            Some(Value::String(s)) if s.eq_ignore_ascii_case("local") => Dynamic::Local,
            Some(other) => {
                return Err(obj
                    .field("dynamic")
                    .invalid(format!("expected true, false or \"local\", found {other}")))
            }
        };
        let actorder = match obj.get("actorder") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(ActOrder::Group),
            Some(Value::String(s)) => match s.as_str() {
                "group" | "dynamic" => Some(ActOrder::Group),
                "weight" | "static" => Some(ActOrder::Weight),
                other => {
                    return Err(obj.field("actorder").invalid(format!(
                        "unknown actorder \"{other}\" (expected \"group\", \"dynamic\", \"weight\", \"static\", true, false or null)"
                    )))
                }
            },
            Some(other) => return Err(obj.field("actorder").invalid(format!("expected a string, bool or null, found {other}"))),
        };
        if actorder.is_some() && role != ArgsRole::Weights {
            return Err(obj
                .field("actorder")
                .invalid("activation ordering only applies to weights"));
        }
        if actorder.is_some() && strategy != Strategy::Group {
            return Err(obj.field("actorder").invalid(format!(
                "activation ordering needs strategy \"group\", found \"{}\"",
                strategy.name()
            )));
        }
        if strategy == Strategy::Token && dynamic == Dynamic::Static {
            return Err(obj
                .field("dynamic")
                .invalid("strategy \"token\" needs dynamic: true"));
        }
        // compressed-tensors' own rules (`QuantizationArgs.validate_model_after`), which vLLM
        // applies when it reads the config: a scheme it refuses is not read here as another.
        let dynamic_strategies = [
            Strategy::Token,
            Strategy::Tensor,
            Strategy::TensorGroup,
            Strategy::Group,
        ];
        if dynamic != Dynamic::Static && !dynamic_strategies.contains(&strategy) {
            return Err(obj.field("dynamic").invalid(format!(
                "dynamic quantization needs strategy \"token\", \"tensor\", \"tensor_group\" \
                 or \"group\", found \"{}\"",
                strategy.name()
            )));
        }
        if dynamic == Dynamic::Local && strategy != Strategy::TensorGroup {
            return Err(obj.field("dynamic").invalid(format!(
                "\"local\" is only supported for strategy \"tensor_group\", found \"{}\"",
                strategy.name()
            )));
        }
        let num_bits = u32::try_from(num_bits).unwrap_or(u32::MAX);
        let spelling = Spelling {
            group_size_null: strategy == Strategy::Channel && obj.opt_i64("group_size")?.is_none(),
            actorder: match obj.get("actorder") {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Bool(true)) => Some("true".into()),
                _ => None,
            },
        };
        Ok(QuantArgs {
            spelling,
            num_bits,
            qtype,
            symmetric,
            strategy,
            group_size,
            block_structure,
            dynamic,
            actorder,
        })
    }
}

/// compressed-tensors' preset schemes (`quant_scheme.py::PRESET_SCHEMES`), integer ones and the
/// common float ones, as raw JSON to run through the same parser as written schemes, as the
/// compressed-tensors release `ct_version` (the config's `version`) defines them: `W8A16` was
/// channelwise int8 before 0.16.0 and is int8 group 128 since (unknown versions read as the
/// newer). The integer `W{b}A{a}` presets (`b` 2-8 bits, `a` 4, 8 or 16, `b <= a`) are CT's
/// `_int_wnam`: symmetric group-128 weights, and below 16 activation bits dynamic per-token
/// activations; `W8A8` (and `INT8`) and `W4A16_ASYM` are its special cases.
pub fn preset(name: &str, ct_version: Option<&str>) -> Option<(Option<Value>, Option<Value>)> {
    // CT looks presets up upper-cased ("w4a16" is W4A16).
    let upper = name.to_ascii_uppercase();
    let name = upper.as_str();
    let int_w = |bits: u32, group: Option<i64>, sym: bool| -> Value {
        let mut m = Map::new();
        m.insert("num_bits".into(), json!(bits));
        m.insert("type".into(), json!("int"));
        m.insert("symmetric".into(), json!(sym));
        match group {
            Some(g) => {
                m.insert("strategy".into(), json!("group"));
                m.insert("group_size".into(), json!(g));
            }
            None => {
                m.insert("strategy".into(), json!("channel"));
            }
        }
        Value::Object(m)
    };
    let int_token = |bits: u32| json!({"num_bits": bits, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true});
    let fp8_tensor =
        json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "tensor"});
    Some(match name {
        "UNQUANTIZED" => (None, None),
        "W8A16" if ct_version.and_then(ct_release).is_some_and(|v| v < (0, 16)) => {
            (Some(int_w(8, None, true)), None)
        }
        "W4A16_ASYM" => (Some(int_w(4, Some(128), false)), None),
        "W8A8" | "INT8" => (Some(int_w(8, None, true)), Some(int_token(8))),
        "FP8" => (Some(fp8_tensor.clone()), Some(fp8_tensor)),
        "FP8_DYNAMIC" => (
            Some(json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel"})),
            Some(
                json!({"num_bits": 8, "type": "float", "symmetric": true, "strategy": "token", "dynamic": true}),
            ),
        ),
        _ => {
            let (w, a) = name.strip_prefix('W')?.split_once('A')?;
            let (w, a): (u32, u32) = (w.parse().ok()?, a.parse().ok()?);
            // Digits only: "W+4A16" parses as 4 in Rust, not a preset in CT.
            if !name[1..].bytes().all(|b| b.is_ascii_digit() || b == b'A')
                || !(2..=8).contains(&w)
                || ![4, 8, 16].contains(&a)
                || w > a
            {
                return None;
            }
            let acts = (a < 16).then(|| int_token(a));
            (Some(int_w(w, Some(128), true)), acts)
        }
    })
}

/// The `(major, minor)` of a compressed-tensors release string (a config's `version`:
/// `"0.20.1"`, `"0.9.5.dev12+gabc"`), for the behaviours that changed between releases.
pub fn ct_release(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.trim().trim_start_matches('v').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor: String = parts
        .next()?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    Some((major, minor.parse().ok()?))
}

pub const PRESET_NAMES: &[&str] = &[
    "UNQUANTIZED",
    "W{2-8}A{4,8,16} (W8A16, W4A16, W4A8, ...)",
    "W4A16_ASYM",
    "W8A8",
    "INT8",
    "FP8",
    "FP8_DYNAMIC",
];
