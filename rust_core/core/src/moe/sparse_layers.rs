//! Which decoder layers a Qwen-MoE family's `config.json` makes MoE blocks, against the layers
//! whose tensors hold experts.
//!
//! moeq finds MoE layers from the tensors. transformers and vLLM build each layer from the
//! config instead: in the Qwen2-MoE, Qwen3-MoE, Qwen3-VL-MoE and Qwen3-Omni families, layer `i`
//! is a MoE block when `i` is not in `mlp_only_layers`, `num_experts > 0` and
//! `(i + 1) % decoder_sparse_step == 0`, else a dense MLP (transformers 5.24's decoder layers,
//! vLLM's `qwen3_moe.py`). Where the two disagree, those loaders fail (vLLM's weight loader
//! refuses weights that have no parameter) or run a block whose weights the checkpoint lacks,
//! while moeq would load the experts: said, not refused, since moeq needs none of these keys.

use serde_json::Value;

use super::{cfg_at, nested, TEXT_CONFIGS};

/// The families whose decoder layers follow these keys, by any `model_type` their
/// `config.json` carries (the top level's or a wrapper's language-model config's).
const FAMILIES: [&str; 6] = [
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_vl_moe",
    "qwen3_vl_moe_text",
    "qwen3_omni_moe",
    "qwen3_omni_moe_text",
];

/// One layer the config and the tensors disagree on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    pub layer: usize,
    /// What the config makes of it: a MoE block (`true`) or a dense MLP.
    pub config_moe: bool,
    /// Why, in `config.json`'s words, with what follows for transformers and vLLM.
    pub reason: String,
}

/// The keys, as the families' config classes default them.
struct Rule {
    only_mlp: Vec<u64>,
    step: u64,
    experts: Option<u64>,
    /// The key paths `config.json` sets, for the messages.
    only_path: String,
    step_path: String,
}

impl Rule {
    fn read(config: &Value) -> Option<Rule> {
        // Any `model_type` the config carries: the top level's, or a wrapper's language model's.
        let family = std::iter::once(Some(config))
            .chain(TEXT_CONFIGS.iter().map(|p| nested(config, p)))
            .filter_map(|c| c?.get("model_type")?.as_str())
            .any(|t| FAMILIES.contains(&t));
        if !family {
            return None;
        }
        // A key of another type than the config class takes: transformers and vLLM would fail
        // or read it their own way; no claim is made then.
        let (only_path, only_mlp) = match cfg_at(config, "mlp_only_layers") {
            None => ("mlp_only_layers".to_string(), Vec::new()),
            Some((p, Value::Array(a))) => (p, a.iter().map(Value::as_u64).collect::<Option<_>>()?),
            Some(_) => return None,
        };
        let (step_path, step) = match cfg_at(config, "decoder_sparse_step") {
            None => ("decoder_sparse_step".to_string(), 1),
            Some((p, v)) => (p, v.as_u64().filter(|&s| s > 0)?),
        };
        let experts = match cfg_at(config, "num_experts") {
            None => None,
            Some((_, v)) => Some(v.as_u64()?),
        };
        Some(Rule {
            only_mlp,
            step,
            experts,
            only_path,
            step_path,
        })
    }

    /// Whether the config makes layer `i` a MoE block, and if not, why.
    fn moe(&self, i: usize) -> Result<(), String> {
        let n = i as u64;
        if self.only_mlp.contains(&n) {
            return Err(format!("{} lists it", self.only_path));
        }
        if self.experts == Some(0) {
            return Err("num_experts is 0".into());
        }
        if !(n + 1).is_multiple_of(self.step) {
            return Err(format!(
                "{} is {}, and {} is not a multiple of it",
                self.step_path,
                self.step,
                n + 1
            ));
        }
        Ok(())
    }
}

/// The layers of `moe_layers` (experts found) and `dense_layers` (a dense MLP found) that a
/// Qwen-MoE family's config makes the other kind; empty for other families, and for configs
/// whose keys are not of the types their config class takes.
pub fn mismatches(config: &Value, moe_layers: &[usize], dense_layers: &[usize]) -> Vec<Mismatch> {
    let Some(rule) = Rule::read(config) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for &layer in moe_layers {
        if let Err(why) = rule.moe(layer) {
            out.push(Mismatch {
                layer,
                config_moe: false,
                reason: format!(
                    "config.json makes it a dense MLP ({why}), but its tensors hold experts: \
                     transformers and vLLM build a dense MLP there (vLLM refuses the expert \
                     weights; transformers leaves them unused and the MLP's weights uninitialised)"
                ),
            });
        }
    }
    for &layer in dense_layers {
        if rule.moe(layer).is_ok() {
            out.push(Mismatch {
                layer,
                config_moe: true,
                reason: format!(
                    "config.json makes it a MoE block (not in {}, {} {}), but its tensors hold \
                     a dense MLP: transformers and vLLM build a MoE block there, whose weights \
                     the checkpoint lacks",
                    rule.only_path, rule.step_path, rule.step
                ),
            });
        }
    }
    out.sort_by_key(|m| m.layer);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn qwen_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let c =
            json!({"model_type": "qwen3_moe", "mlp_only_layers": [1], "decoder_sparse_step": 1});
        let m = mismatches(&c, &[0, 1, 2], &[]);
        assert_eq!(m.len(), 1);
        assert!(!m[0].config_moe && m[0].layer == 1);
        assert!(
            m[0].reason.contains("mlp_only_layers lists it"),
            "{}",
            m[0].reason
        );

        let c = json!({"model_type": "qwen2_moe", "decoder_sparse_step": 2});
        let m = mismatches(&c, &[0, 1, 2, 3], &[]);
        assert_eq!(m.iter().map(|m| m.layer).collect::<Vec<_>>(), [0, 2]);
        assert!(m[0]
            .reason
            .contains("decoder_sparse_step is 2, and 1 is not a multiple"));

        // A dense layer where the defaults (step 1, no mlp_only_layers) make a MoE block.
        let c = json!({"model_type": "qwen3_moe"});
        let m = mismatches(&c, &[1], &[0]);
        assert_eq!(m.len(), 1);
        assert!(m[0].config_moe && m[0].layer == 0);
        // Agreeing layers, and layers the config makes dense that are dense.
        let c = json!({"model_type": "qwen3_moe", "mlp_only_layers": [0]});
        assert!(mismatches(&c, &[1, 2], &[0]).is_empty());
        let c = json!({"model_type": "qwen3_moe", "num_experts": 0});
        assert!(mismatches(&c, &[], &[0, 1]).is_empty());
        assert_eq!(mismatches(&c, &[1], &[0]).len(), 1);
    }

    #[test]
    fn wrapped_configs_are_read_and_other_families_are_not() {
        let c = json!({
            "model_type": "qwen3_vl_moe",
            "text_config": {"model_type": "qwen3_vl_moe_text", "mlp_only_layers": [0]}
        });
        let m = mismatches(&c, &[0], &[]);
        assert_eq!(m.len(), 1);
        assert!(
            m[0].reason.contains("text_config.mlp_only_layers lists it"),
            "{}",
            m[0].reason
        );
        let c = json!({
            "model_type": "qwen3_omni_moe",
            "thinker_config": {"model_type": "qwen3_omni_moe_thinker",
                               "text_config": {"model_type": "qwen3_omni_moe_text",
                                               "decoder_sparse_step": 2}}
        });
        assert_eq!(mismatches(&c, &[0, 1], &[]).len(), 1);
        // Other families build layers their own way; keys of the wrong type make no claim.
        let c = json!({"model_type": "mixtral", "mlp_only_layers": [0]});
        assert!(mismatches(&c, &[0], &[]).is_empty());
        for bad in [
            json!({"mlp_only_layers": "0"}),
            json!({"decoder_sparse_step": 0}),
        ] {
            let mut c = json!({"model_type": "qwen3_moe"});
            if let (Some(o), Some(b)) = (c.as_object_mut(), bad.as_object()) {
                o.extend(b.clone());
            }
            assert!(mismatches(&c, &[0], &[]).is_empty(), "{c}");
        }
    }
}
